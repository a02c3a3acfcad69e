"""Quantized linear weights (`--quantization`), made once at load time from the checkpoint's bf16 or
fp32 weight; every scale is per output channel (one per row of W), symmetric, no zero point.

- int8 (CPU): int8 weights; activations in floating point between layers (the model's compute dtype:
  model_runner.compute_dtype). The engine's own kernel (csrc/gemm_i8w.c `gemm_i8w_f32`, and
  `gemm_i8w_bf16` for bf16 rows and output; AVX2 + FMA builds) rounds each row of a GEMM's input to
  16-bit integers (one scale per row: 15 bits, finer than bf16's 8) and multiplies in integers
  (`vpmaddwd`, or VNNI's `vpdpwssd`; int32 sums), from a quarter of fp32's weight bytes: from 32 rows
  on 1.35-1.8x the fp32 GEMM with AVX2 (Zen 3), ~2x with AVX-512 VNNI (Zen 5). It covers the LM head
  too (llama.QUANTIZE_LM_HEAD). Elsewhere torch's CPU weight-only kernel `aten._weight_int8pack_mm`
  (gpt-fast's) on bf16 activations, which ran the AVX2 machine's anchor workload at 0.58x fp32.
- w8a8 (CPU): int8 weights and dynamically quantized int8 activations, multiplied in int8 with int32
  accumulation. With VNNI (AVX-512 VNNI, AVX-VNNI) the engine's own kernel (csrc/gemm_i8a8.c
  `gemm_i8a8_f32`: one scale per row, `vpdpbusd`); without, FBGEMM's dynamic quantized linear
  (`quantized::linear_dynamic`: one scale per call, taken from all its rows, 7 bits), which on the
  AVX2 machine ran 3.1x the fp32 GEMM at 32 rows.
- fp8 (CUDA): float8 e4m3 weights and per-row dynamically quantized e4m3 activations, multiplied by
  `torch._scaled_mm` with row-wise scales (Hopper and newer). On a CPU the same arithmetic is
  emulated (both operands rounded through e4m3, the product in fp32): slow, for checking accuracy.

LoRA adapters stay in full precision on top (layers.Linear adds them to the quantized product);
tensor parallelism quantizes each rank's shard after it is cut, so every rank has its own scales.
Measured against the fp32 GEMM on its own shapes (docs/engine-speed.md), the choices above are the
ones that won; a dequantize-then-matmul int8 path and `torch._int_mm` on CPU lost and are not kept.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from consort_engine.model.quantized_checkpoint import CHECKPOINT_FORMATS, checkpoint_format, resolve_quantization
from consort_engine.model.models.packed import consort_int8, consort_w8a8

LOAD_TIME = ("int8", "w8a8", "fp8")              # quantized here, from a float checkpoint
# none: the checkpoint as it is (a pre-quantized one's codes as they are, model/quantized_checkpoint.py); auto: the
# same, spelled for "whatever the checkpoint is"; awq | gptq | compressed-tensors: the checkpoint must be that
QUANTIZATIONS = ("none", "auto", *LOAD_TIME, *CHECKPOINT_FORMATS)
INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)      # 448
MIN_SCALE = 1e-12                                # an all-zero row keeps a usable scale


def check_quantization(quantization: str, device: str) -> None:
    """A clear error for a quantization this device cannot run (before any weight loads)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantization in ("int8", "w8a8") and device.startswith("cuda"):
        raise ValueError(f"quantization {quantization} runs on CPU; on CUDA use fp8")


def check_checkpoint_quantization(quantization: str, model_dir: str) -> None:
    """A clear error when --quantization disagrees with the checkpoint's own (config.json's
    quantization_config), before any weight loads; a missing config.json is the loader's error."""
    config = Path(model_dir) / "config.json"
    if config.is_file():
        resolve_quantization(quantization, checkpoint_format(json.loads(config.read_text()), model_dir))


def channel_scales(w: torch.Tensor, qmax: float) -> torch.Tensor:
    """One fp32 scale per output channel (row of W [out, in]): the row's absolute maximum maps to qmax."""
    return (w.float().abs().amax(dim=1) / qmax).clamp(min=MIN_SCALE)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (int8 [out, in], fp32 scales [out]), round to nearest, symmetric."""
    scale = channel_scales(w, INT8_MAX)
    q = torch.round(w.float() / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of W (or of activations) [n, k] -> (e4m3 [n, k], fp32 scales [n]); the row maximum maps to 448."""
    scale = channel_scales(w, FP8_MAX)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def _int8_weight_only(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    q, scale = quantize_int8(weight)
    b = None if bias is None else bias.float()
    ours = consort_int8(q, scale, b) if weight.device.type == "cpu" else None
    if ours is not None:
        return ours
    scale_bf16 = scale.to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), q, scale_bf16)
        y = y.to(x.dtype)
        return y if b is None else y.add_(b.to(x.dtype))
    return run


def _w8a8_dynamic(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    q, scale = quantize_int8(weight)
    ours = consort_w8a8(q, scale, None if bias is None else bias.float()) if weight.device.type == "cpu" else None
    return ours if ours is not None else fbgemm_w8a8(q, scale, bias)


def fbgemm_w8a8(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """int8 codes [n, k] with per-row scales through FBGEMM's dynamic quantized linear (activations
    rounded to 7 bits with one scale per call): w8a8 on a CPU without VNNI."""
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():       # the quantized-tensor constructors warn that they are deprecated
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
            packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
    finally:
        torch.backends.quantized.engine = engine

    def run(x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, so AVX2's u8 x s8 pair sums (vpmaddubsw) cannot saturate
        y = torch.ops.quantized.linear_dynamic(x.float(), packed, True)
        return y.to(x.dtype)
    return run


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [m, k] -> (e4m3 [m, k], fp32 scales [m, 1]), one scale per row (dynamic)."""
    q, scale = quantize_fp8(x)
    return q, scale[:, None]


def _fp8(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    q, scale = quantize_fp8(weight)
    b = None if bias is None else bias.to(torch.bfloat16 if weight.is_cuda else torch.float32)
    if not weight.is_cuda:
        w = dequantize_fp8(q, scale)

        def emulate(x: torch.Tensor) -> torch.Tensor:
            xq, xs = fp8_rows(x.reshape(-1, x.shape[-1]))
            return F.linear(xq.float() * xs, w, b).to(x.dtype)
        return emulate
    w_t = q.t()                                   # [in, out] column-major, as _scaled_mm wants its second operand
    scale_w = scale[None, :].contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        pad = -m % 16                             # _scaled_mm wants every dimension a multiple of 16
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        xq, xs = fp8_rows(x2)
        y = torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=scale_w, bias=b, out_dtype=torch.bfloat16)
        return y[:m].to(x.dtype)
    return run


QUANTIZERS = {"int8": _int8_weight_only, "w8a8": _w8a8_dynamic, "fp8": _fp8}


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                    quantization: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [M, in] -> x W^T + b through the quantized copy of W (fp32 or bf16 W; output in x's dtype)."""
    return QUANTIZERS[quantization](weight, bias)
