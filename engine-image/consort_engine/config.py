"""Engine configuration: one specialist's engine, fixed at start-up."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path


def checkpoint_dir(text: str) -> str:
    """argparse type: a checkpoint directory (with config.json), checked before any model loads."""
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a checkpoint directory (no config.json there)")
    return text


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """argparse type: a positive number of bytes, with an optional binary suffix (512M, 4G, 1T)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS and t[-1:] else ""
    try:
        n = int(float(t[:len(t) - len(unit)]) * _SIZE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not a size (a number of bytes, or with K, M, G or T)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be positive")
    return n


KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")   # --kv-cache-dtype: the pool's element (model/attention.kv_cache_dtype)


@dataclass
class EngineConfig:
    model: str                          # checkpoint dir: config.json, *.safetensors, tokenizer.json
    name: str = "default"               # specialist name: stamped on responses, part of the prefix-cache key
    device: str = "cpu"                 # cpu | cuda
    tensor_parallel_size: int = 1       # ranks (processes; GPUs on cuda) the weights and KV heads are split over
    dtype: str = "auto"                 # auto (loader.resolve_dtype) | float32 | bfloat16 | float16
    quantization: str = "none"          # none | int8 (int8 weights, int16 rows; cpu) | w8a8 (cpu) | fp8 (cuda): model/models/quant.py
    kv_cache_dtype: str = "auto"        # auto (the weights' dtype) | bfloat16 | fp8 (e4m3): attention.kv_cache_dtype
    block_size: int = 16                # tokens per KV block (8 for prefix-heavy specialists)
    num_blocks: int | None = None       # None: size the pool from free memory after weights + reserve
    kv_memory_fraction: float = 0.5     # share of free memory (after weights) the pool may take when sizing
    max_model_len: int | None = None    # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 128             # running sequences per step
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    preempt_watermark: float = 0.05     # preempt until this fraction of the pool is free, never just one block
    hybrid_swap: bool = True            # hybrids: preemption parks KV + state in host memory (False: recompute)
    max_waiting: int = 1024             # waiting-queue bound: beyond it, 429 queue_full
    enable_prefix_caching: bool = True
    # Hybrids' prefix caching: rows of saved conv/SSM state (each one slot's bytes; None: a quarter of
    # max_num_seqs, at least 1; 0: no prefix caching for hybrids), and the tokens between the block boundaries that get one
    # (besides each prompt's last full block): see docs/hybrid-models.md
    hybrid_checkpoints: int | None = None
    hybrid_checkpoint_every: int = 256
    # KV tier below the pool (kv/tier.py): evicted prefix blocks go to files under this directory
    # (None: host memory, when kv_tier_bytes is set), at most kv_tier_bytes of them; both None: off
    kv_tier_path: str | None = None
    kv_tier_bytes: int | None = None
    speculative: str = "off"            # off | ngram | mtp
    num_speculative_tokens: int = 3
    spec_policy: str = "goodput"        # goodput: draft where it pays (spec/draft_plan.py) | always
    spec_typical_tau: float = 0.1       # typical acceptance for sampled requests; 0 = greedy requests only
    # Tool-call trigger tokens: an accepted draft run is cut right after one, and that sequence
    # decodes one token per step from there (the caller dispatches a tool; nothing is guessed past it).
    tool_triggers: list[str] = field(default_factory=lambda: ["<QUERY_TOOL>", "<SCRIPT_START>"])
    tool_trigger_ids: list[int] = field(default_factory=list)   # resolved from tool_triggers by the tokenizer
    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT dir (next issue)
    max_adapters: int = 4
    seed: int = 0
    enforce_eager: bool = False         # cuda: no decode CUDA graphs (every step runs eagerly); cpu never captures
    slo_ttft_ms: int | None = None      # published objectives (p95 targets): judged per request, exported
    slo_itl_ms: int | None = None
    max_body_bytes: int = 4 * 1024 * 1024   # HTTP request bodies above this get 413 (server only)
