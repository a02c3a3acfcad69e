"""Pre-packed CPU GEMM weights: the weight is reordered once at load time into a GEMM library's
blocked format, so small-batch decode matmuls skip the per-call repacking.

float32 goes through oneDNN's packed inner product. Measured on the 2-core AMD EPYC (avx512, no
AMX) machine, 2 threads, GFLOP/s oneDNN vs MKL's packed sgemm (hack/gemm_backends.py prints the
table): decode rows M=8: 89-115 vs 56-70; M=32: 135-150 vs 105-114, and the LM head (512 x 32000)
122 vs 67; M=64: 141-149 vs 94-140; M=256 level; only 2,048-row prefill chunks favour MKL (158-170 vs
176-183). A decode step is mostly small-M GEMMs, the LM head the largest, so oneDNN; MKL's pack is
the fallback where oneDNN is missing. Results equal F.linear to float32 rounding (summation order).

bfloat16 on a CPU without AMX: oneDNN's bf16 GEMM runs ~1.7x slower than MKL's fp32 GEMM there,
so the bf16 weight is widened once (exactly) and multiplied in fp32, the output rounded to bf16.
That is the arithmetic of a bf16 GEMM (bf16 x bf16 products are exact in fp32, fp32 accumulation,
one rounding of the output); only the summation order differs. With AMX, oneDNN's packed bf16
kernel is used.

Packing is verified at load time against F.linear; if the ops are missing or disagree, the
plain weight is kept (returns None).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# MKL blocks the packed weight for this many rows. Measured on the 2-core AVX-512 machine
# (bench shapes, GFLOP/s): 64 is 5-30% faster than 32 at decode batches of 32-64 rows (the LM head
# 152 -> 194 at 64 rows) and as fast at 2,048-row prefill chunks; 128/256 are no better.
PACK_BATCH_HINT = 64


def _mkl(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_HINT)
    shape_only = torch.zeros(1, dtype=weight.dtype).expand(weight.shape)   # the op reads its shape only

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, packed, shape_only, bias, x.shape[0])
    return run


def _fp32(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The float32 packed GEMM: oneDNN where present (see the module doc), else MKL's."""
    if torch.backends.mkldnn.is_available():
        return _onednn(weight, bias)
    return _mkl(weight, bias)


def _fp32_compute(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    inner = _fp32(weight.float(), None if bias is None else bias.float())
    out_dtype = weight.dtype

    def run(x: torch.Tensor) -> torch.Tensor:
        return inner(x.float()).to(out_dtype)
    return run


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any("amx_bf16" in line for line in f if line.startswith("flags"))
    except OSError:
        return False


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return run


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function x [M, in] -> x W^T + b over a packed copy of W, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    try:
        fp32 = torch.backends.mkldnn.is_available() or torch.backends.mkl.is_available()
        if weight.dtype == torch.float32 and fp32:
            fn = _fp32(weight, bias)
        elif weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and has_amx():
            fn = _onednn(weight, bias)
        elif weight.dtype == torch.bfloat16 and fp32:
            fn = _fp32_compute(weight, bias)
        else:
            return None
        g = torch.Generator().manual_seed(0)
        tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
        for m in (1, 3, 40):
            x = torch.randn(m, weight.shape[1], generator=g).to(weight.dtype)
            ref, got = F.linear(x, weight, bias).float(), fn(x).float()
            if got.shape != ref.shape or not torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item()):
                return None
        return fn
    except (RuntimeError, AttributeError):
        return None
