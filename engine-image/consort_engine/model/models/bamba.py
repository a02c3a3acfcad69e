"""Bamba (transformers' BambaForCausalLM): attention layers interleaved with Mamba2 mixer layers (mamba2.py).

Attention layers read and write the paged KV pool like Llama's (partial RoPE: the rotary tables span
the first `partial_rotary_factor` of each head, the dims that rotate); mixer layers keep their state in
the runner's state slot pool.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from consort_engine.model.loader import ModelConfig
from consort_engine.model.tensor_parallel import SINGLE, TPGroup
from consort_engine.model.models.layers import Attention, Linear, RMSNorm
from consort_engine.model.models.llama import CausalLM
from consort_engine.model.models.mamba2 import BambaLayer, Mamba2Mixer
from consort_engine.model.models.mtp import MTPBlock, mtp_names
from consort_engine.model.models.rope import RotaryEmbedding


class BambaForCausalLM(CausalLM):
    single_modules = ("o_proj", "down_proj", "lm_head", "in_proj", "out_proj", "fc")   # fc: the MTP block's

    def __init__(self, cfg: ModelConfig, max_len: int, backend: str, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup = SINGLE, mtp: bool = False):
        super().__init__()
        if tp.size > 1:
            raise ValueError("tensor parallelism is not supported for bamba (hybrid) models yet")
        self.cfg = cfg
        fast = backend == "cpu_kernel"
        attn = set(cfg.attention_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        mixers = [i for i in range(cfg.num_hidden_layers) if i not in attn]
        self.layers = nn.ModuleList(
            BambaLayer(cfg, i in attn, mixers.index(i) if i not in attn else -1, backend, fast)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, [cfg.vocab_size], False)
        self.tied_head = None
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rot, max_len, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        # The checkpoint's MTP block (models/mtp.py) on one of this model's attention layers: drafting
        # touches no mixer state. Loaded only when it drafts.
        self.mtp = MTPBlock(cfg, BambaLayer(cfg, True, -1, backend, fast), fast) if mtp else None

    @property
    def attention_modules(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers if layer.self_attn is not None]

    @property
    def mixers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.layers if layer.mamba is not None]

    adapter_targets = ("qkv_proj", "o_proj", "in_proj", "out_proj", "gate_up_proj", "down_proj")

    def projection(self, layer: int, module: str) -> Linear | None:
        """Layer `layer`'s projection of that name: the attention's in an attention layer, the mixer's
        in_proj / out_proj in a mixer layer, the MLP's in every layer; None where the layer has none."""
        block = self.layers[layer]
        if module in ("gate_up_proj", "down_proj"):
            return getattr(block.feed_forward, module)
        return getattr(block.self_attn if block.mamba is None else block.mamba, module, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.load_tensors((name.removeprefix("model.").replace("final_layernorm.", "norm."), tensor)
                          for name, tensor in mtp_names(weights, self.cfg.num_hidden_layers, self.mtp is not None))
