"""FP8 (e4m3, per-channel weight scales, per-row activation scales) through `torch._scaled_mm` on CUDA:
the product equals the CPU emulation's arithmetic (tests/unit/engine/model/test_engine_quant_linear.py checks that
one), and the engine with `--quantization fp8` on the GPU stays within the fp8 fidelity bounds on
held-out text (tests/fidelity/engine/test_engine_quantization.py runs the same case with the CPU emulation).
Row-wise scaled_mm needs compute capability 8.9 (Ada) or newer."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs CUDA with fp8 (compute capability >= 8.9)")


@pytest.mark.parametrize("rows", [1, 13, 64])
def test_scaled_mm_equals_the_emulated_fp8_product(rows):
    from consort_engine.model.models.quant import quantize_linear
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(384, 256, generator=g), torch.randn(384, generator=g), torch.randn(rows, 256, generator=g)
    want = quantize_linear(w, b, "fp8")(x)                                  # CPU: dequantized operands, fp32
    got = quantize_linear(w.cuda().bfloat16(), b.cuda().bfloat16(), "fp8")(x.cuda().bfloat16())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # the GPU quantizes bf16 operands and rounds its output to bf16: a few bf16 ulps of the output
    torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_fp8_engine_on_cuda_stays_close_to_the_unquantized_model(tmp_path):
    from fidelity_helpers import assert_quant_fidelity, engine_prompt_logprobs, held_out_case
    case = held_out_case(tmp_path)
    plps = engine_prompt_logprobs(case.checkpoint, case.prompts, device="cuda", dtype="bfloat16", quantization="fp8")
    assert_quant_fidelity(case, plps, "fp8", name="cuda bf16 ")


def test_an_fp8_kv_pool_on_cuda_takes_the_triton_kernel_and_holds_the_cpu_bounds(tmp_path):
    """`--kv-cache-dtype fp8` on the GPU: 256-token blocks would take flash-attn, which reads the model's dtype
    only, so the pool is read by the Triton kernel (decode) and SDPA over the widened context (prefill
    chunks); held to the bounds tests/fidelity/engine/test_engine_kv_cache_dtype.py holds the CPU engine to."""
    from fidelity_helpers import KV_BOUNDS, assert_quant_fidelity, held_out_case, run_engine

    from consort_engine.kv.sequence import SamplingParams, Sequence

    case = held_out_case(tmp_path)
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1))
            for p in case.prompts]
    engine = run_engine(case.checkpoint, seqs, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                        block_size=256, max_num_batched_tokens=48, enable_prefix_caching=False)
    assert engine.runner.backend == "triton" and engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert_quant_fidelity(case, [s.prompt_logprobs for s in seqs], "fp8", name="cuda kv ",
                          bounds=KV_BOUNDS["bfloat16", "fp8"])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
