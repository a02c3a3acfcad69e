"""Element-wise layers and LoRA's update: fused C kernels on CPU (csrc/elementwise.c, csrc/lora.c), torch ops
elsewhere.

`fast` is decided once per model (CPU, fp32/bf16, kernels compiled); both paths compute what
transformers computes, rounding at the same points in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from consort_engine.model.cpu_kernels import cpu_kernels, kernel


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, fast: bool) -> torch.Tensor:
    """x [T, D] contiguous -> new tensor."""
    if not fast:
        return F.rms_norm(x, w.shape, w, eps)
    out = torch.empty_like(x)
    kernel("rms_norm", x.dtype)(x.data_ptr(), x.shape[-1], out.data_ptr(), x.shape[-1], w.data_ptr(),
                                x.shape[0], 1, x.shape[-1], eps)
    return out


def rms_norm_heads_(x: torch.Tensor, w: torch.Tensor, eps: float, fast: bool) -> torch.Tensor:
    """Per-head RMSNorm of x [T, heads, D] (a strided view into the qkv buffer), in place when fast."""
    if not fast:
        return F.rms_norm(x, w.shape, w, eps)
    assert x.stride()[1:] == (x.shape[2], 1)
    kernel("rms_norm", x.dtype)(x.data_ptr(), x.stride(0), x.data_ptr(), x.stride(0), w.data_ptr(),
                                x.shape[0], x.shape[1], x.shape[2], eps)
    return x


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float,
                 fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x -> (RMSNorm of the sum, the sum). Fast path updates residual in place."""
    if not fast:
        residual = residual + x
        return F.rms_norm(residual, w.shape, w, eps), residual
    out = torch.empty_like(x)
    kernel("add_rms_norm", x.dtype)(residual.data_ptr(), x.data_ptr(), out.data_ptr(), w.data_ptr(),
                                    x.shape[0], x.shape[1], eps)
    return out, residual


def rope_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          fast: bool) -> torch.Tensor:
    """Rotate-half RoPE of the first `rot` dims of each head of qk [T, heads, D] (strided view); cos/sin: the
    [max_len, rot/2] tables (rot = D but for partial rotary).

    Fast path rotates in place; the torch path returns a new contiguous tensor."""
    rot = 2 * cos.shape[1]
    if not fast:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        x1, x2 = qk[..., :rot].chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, qk[..., rot:]), dim=-1)
    assert qk.stride()[1:] == (qk.shape[2], 1)
    kernel("rope", qk.dtype)(qk.data_ptr(), qk.stride(0), qk.shape[0], qk.shape[1], qk.shape[2], rot,
                             positions.data_ptr(), cos.data_ptr(), sin.data_ptr())
    return qk


def silu_mul(gu: torch.Tensor, fast: bool) -> torch.Tensor:
    """gu [T, 2F] (gate | up) -> silu(gate) * up [T, F]."""
    f = gu.shape[1] // 2
    if not fast:
        return F.silu(gu[:, :f]) * gu[:, f:]
    out = torch.empty(gu.shape[0], f, dtype=gu.dtype)
    kernel("silu_mul", gu.dtype)(gu.data_ptr(), out.data_ptr(), gu.shape[0], f)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.max(dim=-1).indices of logits rows [N, V] (int64), ties and NaNs as torch breaks them: on CPU by
    csrc/argmax.c, whose vector pass is 6-7x torch's element-at-a-time loop (64 rows of a 32k vocabulary)."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16)
            or x.stride(-1) != 1 or x.shape[1] == 0 or cpu_kernels() is None):
        return x.max(dim=-1).indices
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel("argmax_rows", x.dtype)(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def add_lora_(y: torch.Tensor, x: torch.Tensor, start: int, end: int,
              pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
    """y[start:end, offset:offset + n] += ((x[start:end] A^T) Bt), rounded to y's dtype, for each (offset, n, A,
    Bt) of one adapter on one projection: csrc/lora.c on CPU, one call a pair (against ~5 tensor ops), two
    matmuls elsewhere. fp32 throughout either way."""
    if not pairs:
        return
    if (x.device.type != "cpu" or x.dtype != y.dtype or x.dtype not in (torch.float32, torch.bfloat16)
            or x.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1 or cpu_kernels() is None):
        xs = x[start:end].float()
        for offset, n, a, bt in pairs:
            y[start:end, offset:offset + n] += ((xs @ a.t()) @ bt).to(y.dtype)
        return
    fn, e = kernel("lora_add", x.dtype), x.element_size()
    xp = x.data_ptr() + start * x.stride(0) * e
    for offset, n, a, bt in pairs:
        if fn(xp, x.stride(0), end - start, x.shape[1], a.data_ptr(), a.shape[0], bt.data_ptr(), n,
              y.data_ptr() + (start * y.stride(0) + offset) * e, y.stride(0)):
            raise MemoryError(f"lora_add: no memory for its buffer ({end - start} rows x rank {a.shape[0]})")
