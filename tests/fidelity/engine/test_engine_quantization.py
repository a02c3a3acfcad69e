"""Quantized weights (`--quantization`) against the unquantized model (transformers, fp32) on held-out text.

A tiny Llama checkpoint written by transformers, its weights drawn wide enough that its next-token
distributions are peaked (as a trained model's are; near-uniform ones flip on any rounding), reads C
headers (/usr/include/stdlib.h, stdio.h), and the engine reports the prompt logprobs of every position.
Per quantization, against transformers' log_softmax of the unquantized checkpoint:
- top-1 agreement: the share of positions whose most likely next token is the reference's;
- max logprob error: the largest |ours - reference| over the logprobs of the text's actual tokens;
- perplexity delta: exp(-mean logprob) of the text, relative to the reference's.
The bounds (fidelity_helpers.QUANT_BOUNDS) hold with a margin over what this checkpoint measures
(printed with -s); the unquantized engine ("none") is held to tight ones, which checks the harness.
fp8 runs the CPU emulation of the CUDA arithmetic here; tests/gpu/engine/test_engine_fp8.py runs `_scaled_mm`.
"""
from __future__ import annotations

import pytest
from fidelity_helpers import QUANT_BOUNDS, assert_quant_fidelity, engine_prompt_logprobs, held_out_case

from consort_engine.model.cpu_kernels import cpu_kernels

# an int4 checkpoint (groups of 32) of the held-out case's model: (top-1, max logprob error, perplexity
# delta) bounds, with a margin over the 0.64 / 0.51 / +0.92% it measures (the model's near-uniform
# distributions flip on int4's coarse rounding; a trained model's are peaked)
INT4_BOUNDS = (0.55, 0.75, 0.02)
# w8a8 on the engine's VNNI kernel (an int8 scale per row) measures 0.957 / 0.074 / +0.038%; FBGEMM's one
# scale per call (CPUs without VNNI) is what QUANT_BOUNDS["w8a8"] allows
W8A8_ROWS_BOUNDS = (0.93, 0.15, 0.005)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return held_out_case(tmp_path_factory.mktemp("quant"))


@pytest.mark.parametrize("quantization", list(QUANT_BOUNDS))
def test_quantized_engine_stays_close_to_the_unquantized_model(case, quantization):
    plps = engine_prompt_logprobs(case.checkpoint, case.prompts, dtype="float32", quantization=quantization)
    rows = quantization == "w8a8" and hasattr(cpu_kernels(), "gemm_i8a8_f32")
    assert_quant_fidelity(case, plps, quantization, bounds=W8A8_ROWS_BOUNDS if rows else None)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_a_bf16_model_quantized_holds_the_fp32_models_bounds(case, quantization):
    """A bf16 model (weights rounded from the checkpoint, a bf16 KV cache, and on a CPU with a bf16 dot
    product bf16 activations: the integer kernels take bf16 rows) with int8 / w8a8, against the fp32
    unquantized model, within the bounds its fp32 twin is held to. Measured on the AMD EPYC Zen 5 (bf16
    activations): int8 0.9717 / 0.066 / -0.065%, w8a8 0.9539 / 0.075 / -0.115%."""
    plps = engine_prompt_logprobs(case.checkpoint, case.prompts, dtype="bfloat16", quantization=quantization)
    rows = quantization == "w8a8" and hasattr(cpu_kernels(), "gemm_i8a8_f32")
    assert_quant_fidelity(case, plps, quantization, name="bf16 ", bounds=W8A8_ROWS_BOUNDS if rows else None)


def test_int4_checkpoint_on_the_int8_kernel_is_as_close_as_dequantized(case, tmp_path, monkeypatch):
    """The same model as an AWQ int4 checkpoint (groups of 32, tests/quantized_checkpoints.py): its linears
    on the int8 kernel (the codes, rows rounded to int16) against the unquantized model, then the same
    checkpoint dequantized to fp32 weights (the kernel refused): the rounding to int4 costs what the
    bounds allow, the kernel's rounding of the rows next to nothing on top."""
    from quantized_checkpoints import write_quantized_checkpoint

    from consort_engine.model.models import layers

    write_quantized_checkpoint(case.checkpoint, tmp_path / "awq", "awq", 32)
    on_codes = engine_prompt_logprobs(tmp_path / "awq", case.prompts, dtype="float32", quantization="auto")
    codes = assert_quant_fidelity(case, on_codes, "awq", bounds=INT4_BOUNDS)
    monkeypatch.setattr(layers, "consort_int8", lambda *args: None)
    dequantized = engine_prompt_logprobs(tmp_path / "awq", case.prompts, dtype="float32", quantization="auto")
    plain = assert_quant_fidelity(case, dequantized, "awq", name="dequantized ", bounds=INT4_BOUNDS)
    assert abs(codes[0] - plain[0]) <= 0.01 and abs(codes[1] - plain[1]) <= 0.01 and abs(codes[2] - plain[2]) <= 1e-3


# NVFP4 and FP8 checkpoints of the held-out case's model (tests/quantized_checkpoints.py): (top-1, max logprob
# error, perplexity delta) bounds with a margin over what each measures (machine 9: NVFP4 0.612 / 0.633 /
# -0.004%, FP8 per channel 0.887 / 0.237 / +0.25%, in blocks of 32 x 32 0.866 / 0.206 / -0.52%)
CHECKPOINT_BOUNDS = {"nvfp4": (0.52, 0.9, 0.02), "fp8-channel": (0.78, 0.4, 0.012), "fp8-block": (0.78, 0.4, 0.012)}
CHECKPOINTS = {"nvfp4": ("compressed-tensors", dict(layout="nvfp4-pack-quantized")),
               "fp8-channel": ("compressed-tensors", dict(bits=8, layout="float-quantized")),
               "fp8-block": ("fp8", dict(bits=8, block=(32, 32)))}


@pytest.mark.parametrize("fmt", list(CHECKPOINTS))
def test_nvfp4_and_fp8_checkpoints_stay_close_to_the_unquantized_model(case, tmp_path, fmt):
    """The same model as an NVFP4 checkpoint (on the int8 kernel's groups of 16) and as FP8 ones (per channel,
    in blocks; decoded at load), against the unquantized model: the rounding of their weights costs what
    CHECKPOINT_BOUNDS allow (NVFP4: 8 levels a sign, a scale per 16 weights; e4m3: 3 mantissa bits)."""
    from quantized_checkpoints import write_quantized_checkpoint

    method, kw = CHECKPOINTS[fmt]
    write_quantized_checkpoint(case.checkpoint, tmp_path / fmt, method, -1, **kw)
    plps = engine_prompt_logprobs(tmp_path / fmt, case.prompts, dtype="float32", quantization="auto")
    assert_quant_fidelity(case, plps, fmt, bounds=CHECKPOINT_BOUNDS[fmt])
