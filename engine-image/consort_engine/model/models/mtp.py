"""Multi-token-prediction (MTP) block: the checkpoint's own drafter.

One MTP block predicts the token after next: at position p it fuses the embedding of token p+1 with
the target model's (final-norm) hidden state at p, runs one decoder layer with its own paged KV
(an extra layer in the runner's pool) and the shared LM head gives token p+2. Drafting K tokens
chains it: the block's own output hidden state stands in for the target's at the next position.

    x = fc(cat(enorm(embed(t[p+1])), hnorm(h[p])));  h' = norm(layer(x));  logits = lm_head(h')

Checkpoint layouts (the block's decoder layer is the base model's own attention layer kind: Llama-family,
or a hybrid's attention layer, so a Bamba's MTP block is attention only and keeps no mixer state):
- Qwen3-Next: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`,
  `mtp.norm` (the LM head is the model's).
- DeepSeek-V3: `model.layers.{num_hidden_layers}.` + `eh_proj`, `enorm`, `hnorm`, the decoder layer's
  own names, `shared_head.norm`; its copies `embed_tokens` and `shared_head.head` are the model's
  embedding and LM head and are not loaded twice.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from consort_engine.model.attention import AttentionMetadata
from consort_engine.model.models.fused_layers import FusedLayers
from consort_engine.model.loader import ModelConfig
from consort_engine.model.models.layers import Linear, RMSNorm
from consort_engine.model.models.rope import RotaryEmbedding
from consort_engine.model.hookless import HooklessModule

# checkpoint name (relative to the layout's prefix) -> MTPBlock parameter name
_QWEN3_NEXT = {"fc.": "fc.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "layers.0.": "layer.", "norm.": "norm."}
_DEEPSEEK_V3 = {"eh_proj.": "fc.", "enorm.": "enorm.", "hnorm.": "hnorm.", "shared_head.norm.": "norm."}
_DEEPSEEK_SHARED = ("embed_tokens.", "shared_head.head.")     # the model's own, repeated


def mtp_param_name(name: str, num_hidden_layers: int) -> str | None:
    """The MTPBlock parameter a checkpoint tensor loads into ("" for a shared copy to skip), or
    None when the tensor is not part of an MTP block."""
    if name.startswith("mtp."):
        rest = name[4:]
        if re.match(r"layers\.[1-9]", rest):
            return ""        # more MTP depths than one: only the first drafts (chained)
        for src, dst in _QWEN3_NEXT.items():
            if rest.startswith(src):
                return dst + rest[len(src):]
        return None
    prefix = f"model.layers.{num_hidden_layers}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    if rest.startswith(_DEEPSEEK_SHARED):
        return ""
    for src, dst in _DEEPSEEK_V3.items():
        if rest.startswith(src):
            return dst + rest[len(src):]
    return "layer." + rest


def has_mtp(names: list[str], num_hidden_layers: int) -> bool:
    return any(mtp_param_name(n, num_hidden_layers) for n in names)


def mtp_names(weights: Iterable[tuple[str, torch.Tensor]], num_hidden_layers: int,
              drafting: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with the MTP block's under `mtp.<MTPBlock name>` (dropped, as are its copies
    of shared tensors, when the block does not draft); the others as they are."""
    for name, tensor in weights:
        mtp_name = mtp_param_name(name, num_hidden_layers)
        if mtp_name is None:
            yield name, tensor
        elif mtp_name and drafting:
            yield "mtp." + mtp_name, tensor


class MTPBlock(HooklessModule):
    def __init__(self, cfg: ModelConfig, layer: nn.Module, fast: bool):
        """layer: a decoder layer of the base model's attention kind (forward(x, residual, positions,
        rotary, meta) -> (h, residual)); its K/V is the runner's last pool layer."""
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, fast)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, fast)
        self.fc = Linear(2 * h, [h], False)
        self.layer = layer
        self.norm = RMSNorm(h, cfg.rms_norm_eps, fast)
        self.fused: FusedLayers | None | bool = False     # the layer's C plan (False: not planned yet)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds of tokens p+1, normed hidden states at p [T, H] -> the layer's input x [T, H]."""
        return self.fc(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def store_kv(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                 slots: torch.Tensor) -> None:
        """The layer's K/V of rows x at positions into the block's pool layer, nothing else: what a
        kept row that drafts nothing leaves for the drafts after it (the attention output and the MLP
        of such rows are never read)."""
        self.layer.self_attn.store_kv(self.layer.input_layernorm(x), positions, rotary, slots)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
               meta: AttentionMetadata) -> torch.Tensor:
        """The layer and the final norm over rows x -> normed output [T, H] (the LM head's input for
        token p+2, and the next chained step's hidden state). The layer in one C call where it applies
        (fused_layers.py; the same bits: the sum is rounded as the fused add rounds it)."""
        self.fused = FusedLayers.refresh(self.fused, [self.layer], rotary, self.norm.weight.dtype)
        if self.fused is not None and self.fused.applies(x, meta):
            return self.norm(self.fused.run(x, positions, meta))
        h, residual = self.layer(x, None, positions, rotary, meta)
        return self.norm(h, residual)[0]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        """embeds of tokens p+1, normed hidden states at p, positions p [T] -> normed output [T, H]."""
        return self.decode(self.fuse(embeds, hidden), positions, rotary, meta)
