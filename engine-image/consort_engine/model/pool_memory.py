"""How much memory an engine's pools may take: what the device has free, less a reserve for a step's
activations; the KV pool (model_runner._pool_blocks) and a hybrid's state pools (_state_rows) split the rest."""
from __future__ import annotations

import torch

from consort_engine.model.cpu import cgroup_memory_available, memory_available
from consort_engine.model.loader import ModelConfig

MiB = 1 << 20


def mem_available(device: torch.device) -> int:
    """Bytes free for the pools: cudaMemGetInfo on CUDA; on CPU MemAvailable from /proc/meminfo, capped
    by what the cgroup's memory limit leaves (a pod's `resources.limits.memory`)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        return memory_available(f.read(), cgroup_memory_available())


def kv_bytes_per_token(c: ModelConfig, element_size: int, kv_heads: int | None = None, mtp: bool = False) -> int:
    """K and V of every attention layer (only those: a hybrid's mixers hold no per-token state; an MTP
    block's layer counts), `kv_heads` of them per layer (a tensor-parallel rank's share; default all),
    `element_size` bytes each (the pool's element)."""
    layers = len(c.attention_layers) + mtp
    return 2 * layers * (kv_heads or c.num_key_value_heads) * c.head_dim * element_size


def activation_reserve(c: ModelConfig, tokens: int, max_model_len: int, max_num_seqs: int,
                       mixer_width: int = 0) -> int:
    """Bytes a step's activations may need (twice a float32 estimate, plus 256 MiB): per token of the
    step's `tokens` the hidden states, projections and MLP (and a hybrid's mixer projections,
    `mixer_width` floats), every head's attention scores of a chunk at full length, the sampled rows' logits."""
    per_token = (6 * c.hidden_size + 3 * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                 + 3 * c.intermediate_size + 3 * mixer_width) * 4
    scores = c.num_attention_heads * min(tokens, max_model_len) * max_model_len * 4
    logits = 4 * max_num_seqs * c.vocab_size * 4
    return 2 * (tokens * per_token + scores + logits) + 256 * MiB
