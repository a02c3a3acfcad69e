"""Pre-packed CPU GEMM weights: the weight is reordered once at load time into a GEMM kernel's
blocked format, so small-batch decode matmuls skip the per-call repacking.

float32 has three backends (`fp32_backend`, CONSORT_GEMM=consort|onednn|mkl overrides):
- consort: the engine's own kernel (csrc/gemm.c `gemm_f32`: 16-column panels, register tiles
  of up to 12 rows x 2 panels of zmm accumulators with AVX-512, 6 rows x 1 panel of ymm ones with
  AVX2, x packed k-major per tile, the next panels prefetched into L2). The default wherever it builds.
  Measured (docs/engine-speed.md): on the 2-core AMD EPYC Zen 4 (AVX-512), the 33 GEMMs of one decode
  step with cache-cold weights in rotation at 32 rows 195-200 GFLOP/s against oneDNN's 163-180, 8 rows
  ~1.4x, 256 rows level, 2,048-row prefill chunks 0.97x; the anchor workload level with oneDNN, the
  decode step ~10% faster. On the Zen 3 machine (AVX2): 128-138 GFLOP/s against oneDNN's 112-115 at
  32 rows, the decode step 41.6 -> 33.9 ms.
- onednn: oneDNN's packed inner product (the earlier default with AVX-512; Zen 4: 32 rows 135-150
  GFLOP/s against MKL's 105-114, the LM head 122 vs 67).
- mkl: MKL's packed sgemm, where oneDNN is missing.
Results equal F.linear to float32 rounding (summation order).

bfloat16 where the CPU has a bf16 dot product (AMX tiles, or AVX-512 BF16's `vdpbf16ps`): oneDNN's
packed bf16 kernel (on the 2-core AMD EPYC Zen 5, 1.5-2x the engine's fp32 kernel from 32 rows:
docs/engine-speed.md), and without AMX up to BF16_KERNEL_ROWS rows the engine's own (csrc/gemm_bf16.c
`gemm_bf16`: the int8 kernels' register tiles on `vdpbf16ps`), which is faster there and builds no
kernel per new row count. Without a dot product, oneDNN's bf16 GEMM is slower than the fp32 ones, so
the bf16 weight is widened once (exactly) and multiplied in fp32, the output rounded to bf16. That is
the arithmetic of a bf16 GEMM (bf16 x bf16 products are exact in fp32, fp32 accumulation, one rounding
of the output); only the summation order differs.

Packing is verified at load time against F.linear; if the ops are missing or disagree, the
plain weight is kept (returns None).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from consort_common.machine import cpu_model_and_flags

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


def _aligned(size: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty 1-d tensor of `size` elements starting on a 64-byte boundary (the kernel's aligned loads)."""
    per = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(size + 64 // per, dtype=dtype)
    start = (-raw.data_ptr() % 64) // per
    return raw[start:start + size]


@dataclass(frozen=True)
class GemmCall:
    """One of the engine's GEMMs over one packed weight, as C calls it (csrc/decoder.c `linear_t`)."""
    fn: int                       # the function's address
    weights: tuple[int, ...]      # its weight arguments: pointers, group sizes (0: NULL)
    bias: int                     # fp32 bias, or 0
    n: int
    k: int


def gemm_call(packed: Callable[[torch.Tensor], torch.Tensor] | None, dtype: torch.dtype) -> GemmCall | None:
    """How C calls the packed weight `packed` (pack_linear) for `dtype` activations as the function itself
    does, up to its `max_rows` rows where it has that bound; None where it runs something else (oneDNN,
    MKL, a dtype conversion)."""
    return getattr(packed, "gemm_calls", {}).get(dtype)


def _consort_call(gemm: Callable[..., int], n: int, k: int, bias: torch.Tensor | None,
                  *weights: torch.Tensor | int | None,
                  out_dtype: torch.dtype = torch.float32) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., k] -> x W^T + b (out_dtype) through one of the engine's GEMMs, given its weight arguments:
    tensors (passed as pointers), integers and None (NULL) as they are."""
    b = None if bias is None else bias.float().contiguous()
    args = [w.data_ptr() if isinstance(w, torch.Tensor) else w for w in weights]
    b_ptr = None if b is None else b.data_ptr()

    def run(x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, k)      # the layers' rows are 2-D already
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty(m, n, dtype=out_dtype)
        if m and gemm(x2.data_ptr(), x2.stride(0), m, k, *args, n, y.data_ptr(), n, b_ptr):
            raise MemoryError(f"{gemm.__name__}: no memory for its buffers ({m} x {k})")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    run.weights, run.bias = weights, b          # keep the packed tensors and the bias alive with the function
    address = c_address(gemm)
    run.gemm_calls = {} if address is None else {out_dtype: GemmCall(address, tuple(a or 0 for a in args), b_ptr or 0,
                                                                     n, k)}
    return run


def c_address(fn) -> int | None:
    """The address of a C function from ctypes; None for anything else (a Python wrapper around one)."""
    try:
        return ctypes.cast(fn, ctypes.c_void_p).value
    except ctypes.ArgumentError:
        return None


def _consort(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The engine's own kernel (csrc/gemm.c `gemm_f32`, AVX2 + FMA builds) over its panel layout;
    None where it is not built."""
    from consort_engine.model.cpu_kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None or not hasattr(lib, "gemm_f32"):
        return None
    n, k = weight.shape
    packed = _aligned(lib.gemm_packed_floats_f32(n, k), torch.float32)
    lib.gemm_pack_f32(weight.contiguous().data_ptr(), n, k, packed.data_ptr())
    return _consort_call(lib.gemm_f32, n, k, bias, packed)


def _consort_rows(lib, name: str, n: int, k: int, bias: torch.Tensor | None,
                  *weights: torch.Tensor | int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x W^T + b through the engine's `name`_f32 (fp32 rows and output) or `name`_bf16 (bf16 rows and
    output), as x comes."""
    f32 = _consort_call(getattr(lib, f"{name}_f32"), n, k, bias, *weights)
    bf16 = _consort_call(getattr(lib, f"{name}_bf16"), n, k, bias, *weights, out_dtype=torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        return bf16(x) if x.dtype == torch.bfloat16 else f32(x.float()).to(x.dtype)
    run.weights = weights
    run.gemm_calls = {**f32.gemm_calls, **bf16.gemm_calls}
    return run


def consort_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A bf16 weight through the engine's kernel (csrc/gemm_bf16.c `gemm_bf16`: bf16 x and y, AVX-512 BF16
    builds); None where it is not built."""
    from consort_engine.model.cpu_kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None or not hasattr(lib, "gemm_bf16"):
        return None
    n, k = weight.shape
    packed = _aligned(lib.gemm_packed_bytes_bf16(n, k) // 2, torch.bfloat16)
    lib.gemm_pack_bf16(weight.contiguous().data_ptr(), n, k, packed.data_ptr())
    return _consort_call(lib.gemm_bf16, n, k, bias, packed, out_dtype=torch.bfloat16)


def _group_scales(scale: torch.Tensor, n: int, groups: int, columns: int, extra: int = 0) -> torch.Tensor:
    """The kernels' column scales: [groups][columns] fp32 (zero past n), then `extra` more floats."""
    buf = _aligned(groups * columns + extra, torch.float32)
    buf.zero_()[:groups * columns].view(groups, columns)[:, :n] = scale.float().reshape(n, groups).t()
    return buf


def consort_int8(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, group_size: int = -1,
                 order: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """int8 weights through the engine's kernel (`gemm_i8w_f32` / `_bf16`, activations rounded per row to
    16-bit integers inside it): codes [n, k] int8; fp32 scales [n] (one per output row, `int8`) or [n,
    groups] (one per output row and group of group_size k: a pre-quantized checkpoint's codes); bf16
    activations and output as they are, others through fp32. `order`: the input column each code column
    multiplies (the kernel reads x's columns so as it rounds them; GPTQ act-order), None: in order. None
    where the kernel is not built or cannot take the groups (an odd group size)."""
    from consort_engine.model.cpu_kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None or not hasattr(lib, "gemm_i8w_f32"):
        return None
    n, k = codes.shape
    group = k + k % 2 if group_size == -1 else group_size
    groups = scale.reshape(n, -1).shape[1]
    if group % 2 or groups != -(-k // group):
        return None
    size = lib.gemm_packed_bytes_i8w_f32(n, k)
    packed = _aligned(size, torch.int8)
    lib.gemm_pack_i8w_f32(codes.contiguous().data_ptr(), n, k, packed.data_ptr())
    scales = _group_scales(scale, n, groups, size // (k + k % 2))      # padded columns: scale 0
    columns_of_x = None if order is None else order.to(torch.int32).contiguous()
    return _consort_rows(lib, "gemm_i8w", n, k, bias, packed, scales, group, columns_of_x)


I8A8_MAX_GROUP = 65536       # csrc/gemm_i8a8.c: the most k one int32 block sums


def consort_w8a8(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int = -1) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """int8 weights times int8 activations through the engine's VNNI kernel (`gemm_i8a8_f32`: each row of
    x rounded to int8 with its own scale inside it, `vpdpbusd`): codes [n, k] int8, fp32 scales [n] or
    [n, groups] as consort_int8 takes them; activations and output as consort_int8 takes them. None where the kernel is not
    built (a CPU without VNNI) or cannot take the groups (a group not a multiple of 4 k)."""
    from consort_engine.model.cpu_kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None or not hasattr(lib, "gemm_i8a8_f32"):
        return None
    n, k = codes.shape
    group = k + -k % 4 if group_size == -1 else group_size
    groups = scale.reshape(n, -1).shape[1]
    if group % 4 or groups != -(-k // group) or min(group, k) > I8A8_MAX_GROUP:
        return None
    size = lib.gemm_packed_bytes_i8a8_f32(n, k)
    packed = _aligned(size, torch.int8)
    lib.gemm_pack_i8a8_f32(codes.contiguous().data_ptr(), n, k, packed.data_ptr())
    columns = size // (k + -k % 4)
    buf = _group_scales(scale, n, groups, columns, extra=groups * columns)
    # the kernel's u8 rows are x + 128: it takes 128 x each column's code sum per group back off
    sums = torch.zeros(n, groups, dtype=torch.int32).index_add_(1, torch.arange(k) // group, codes.to(torch.int32))
    buf[groups * columns:].view(torch.int32).view(groups, columns)[:, :n] = 128 * sums.t()
    return _consort_rows(lib, "gemm_i8a8", n, k, bias, packed, buf, group)


def fp32_backend() -> str:
    """consort | onednn | mkl: CONSORT_GEMM, else the engine's kernel where it is built (AVX2 + FMA, with
    AVX-512 where the CPU has it), else oneDNN, else MKL."""
    from consort_engine.model.cpu_kernels import cpu_kernels

    forced = os.environ.get("CONSORT_GEMM", "")
    if forced in FP32_BACKENDS:
        return forced
    if hasattr(cpu_kernels(), "gemm_f32"):
        return "consort"
    return "onednn" if torch.backends.mkldnn.is_available() else "mkl"


def _fp32(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The float32 packed GEMM of `fp32_backend()` (MKL's where oneDNN is asked for but missing)."""
    backend = fp32_backend()
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        backend = "mkl"
    return FP32_BACKENDS[backend](weight, bias)


def _fp32_compute(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    inner = _fp32(weight.float(), None if bias is None else bias.float())
    if inner is None:
        return None
    out_dtype = weight.dtype

    def run(x: torch.Tensor) -> torch.Tensor:
        return inner(x.float()).to(out_dtype)
    return run


def has_bf16_dot() -> bool:
    """A bf16 dot-product instruction, which oneDNN's bf16 kernels run on: AMX or AVX-512 BF16."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_model_and_flags()[1])


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return run


# bf16 GEMMs of up to this many rows run on the engine's kernel, more on oneDNN's. hack/gemm_backends.py
# --bf16 on the 2-core AMD EPYC Zen 5: the engine's 1.3-1.8x oneDNN's at 1-8 rows (the LM head level at
# 1), 1.1-1.3x at 32, 1.0-1.1x at 64, level at 128-256, 0.9-1.0x from 512.
BF16_KERNEL_ROWS = 256


def _bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A bf16 weight on a CPU with a bf16 dot product: the engine's kernel up to BF16_KERNEL_ROWS rows,
    oneDNN's above; oneDNN's at every row count with AMX (its tiles; the engine's kernel is not measured
    against them) or where the engine's is not built. CONSORT_GEMM=consort takes the engine's with AMX too
    (to compare the two there, the decoder layers in one call with it: fused_layers.py), =onednn oneDNN's
    at every row count."""
    onednn = _onednn(weight, bias)
    forced = os.environ.get("CONSORT_GEMM", "")
    amx = "amx_bf16" in cpu_model_and_flags()[1]
    ours = consort_bf16(weight, bias) if forced == "consort" or (forced != "onednn" and not amx) else None
    if ours is None:
        return onednn

    def run(x: torch.Tensor) -> torch.Tensor:
        return ours(x) if x.numel() <= BF16_KERNEL_ROWS * x.shape[-1] else onednn(x)
    run.gemm_calls, run.max_rows = getattr(ours, "gemm_calls", {}), BF16_KERNEL_ROWS
    return run


# name -> packer (weight, bias) -> x -> x W^T + b, or None where it does not build
FP32_BACKENDS = {"consort": _consort, "onednn": _onednn, "mkl": _mkl}


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function x [M, in] -> x W^T + b over a packed copy of W, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    try:
        fp32 = torch.backends.mkldnn.is_available() or torch.backends.mkl.is_available()
        if weight.dtype == torch.float32 and fp32:
            fn = _fp32(weight, bias)
        elif weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and has_bf16_dot():
            fn = _bf16(weight, bias)
        elif weight.dtype == torch.bfloat16 and fp32:
            fn = _fp32_compute(weight, bias)
        else:
            return None
        if fn is None:
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
