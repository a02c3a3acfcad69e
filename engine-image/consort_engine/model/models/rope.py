"""Rotary position embedding with a precomputed cos/sin cache indexed by positions.

Scaling variants as transformers computes them: default, linear, llama3, yarn, dynamic (static
NTK form: the base is stretched once for the engine's max length, as vLLM does, since continuous
batching has no single "current sequence length").
"""
from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None,
                    max_len: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention_factor applied to cos/sin)."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return base, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return base / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / base
        inv = torch.where(wavelen > old / low, base / factor, base)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, inv), 1.0
    if kind == "dynamic":
        orig = int(scaling.get("original_max_position_embeddings", max_len))
        if max_len <= orig:
            return base, 1.0
        theta = theta * ((factor * max_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, factor)
    raise ValueError(f"unsupported rope_type {kind!r} (default, linear, llama3, dynamic, yarn)")


def _yarn(dim: int, theta: float, s: dict[str, Any], factor: float) -> tuple[torch.Tensor, float]:
    orig = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = theta ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra, float(attn)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [max_len, dim/2] with the model dtype's values (as transformers casts them),
    stored in the compute dtype; ops.rope_ rotates q and k by position."""

    def __init__(self, dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        inv, attn_factor = inv_frequencies(dim, theta, scaling, max_len)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]
        store = torch.get_default_dtype() if dtype == torch.bfloat16 else dtype   # bf16 values, compute dtype
        self.register_buffer("cos", (freqs.cos() * attn_factor).to(dtype).to(store).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attn_factor).to(dtype).to(store).to(device), persistent=False)
