"""Pre-quantized checkpoints (AWQ and GPTQ int4, compressed-tensors int4, W8A16, W8A8, NVFP4 and FP8, ModelOpt NVFP4
and FP8, transformers' block-scaled FP8; model/quantized_checkpoint.py) through the whole engine against
transformers running the fake-quantized model (the same dequantized weights in a float checkpoint): greedy tokens
match (near-tie rule of fidelity_helpers), with top-5 logprobs close, for tiny Llama and Qwen2 checkpoints
written by transformers and packed by tests/quantized_checkpoints.py. Where the engine's int8 kernel is built,
the decoder's integer (and NVFP4) linears run on their codes (act-order's too); FP8 ones run decoded.
transformers' own readers of the FP8 and compressed-tensors formats decode the same weights."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from fidelity_helpers import assert_greedy_matches, check_logprobs_close, hf_greedy, make_checkpoint, run_engine
from quantized_checkpoints import runs_on_codes, write_quantized_checkpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from consort_engine.kv.sequence import SamplingParams, Sequence
from consort_engine.model.cpu_kernels import cpu_kernels
from consort_engine.model.models.layers import Linear
from consort_engine.model.quantized_checkpoint import checkpoint_format, checkpoint_weights

FORMATS = {"awq": ("awq", {}), "gptq-act-order": ("gptq", dict(sym=True, act_order=True)),
           "gptq-v2-asym": ("gptq", dict(v1=False)), "compressed-tensors": ("compressed-tensors", {}),
           "compressed-tensors-w8a16": ("compressed-tensors", dict(bits=8)),
           "compressed-tensors-w8a8": ("compressed-tensors", dict(bits=8, layout="int-quantized", group=-1)),
           "compressed-tensors-fp8": ("compressed-tensors", dict(bits=8, layout="float-quantized")),
           "compressed-tensors-fp8-block": ("compressed-tensors", dict(bits=8, layout="float-quantized",
                                                                       strategy="block")),
           "compressed-tensors-nvfp4": ("compressed-tensors", dict(layout="nvfp4-pack-quantized")),
           "modelopt-nvfp4": ("modelopt", dict(layout="nvfp4-pack-quantized")),
           "modelopt-fp8": ("modelopt", dict(bits=8, layout="float-quantized")),
           "modelopt-nvfp4-hf-quant-config": ("modelopt", dict(layout="nvfp4-pack-quantized", hf_quant_config=True)),
           "fp8-block": ("fp8", dict(bits=8))}
GROUP = 32      # the tiny checkpoints' hidden (64) and intermediate (160) sizes are multiples of it


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_greedy_matches_the_fake_quantized_model(tmp_path, arch, fmt, caplog):
    method, kw = FORMATS[fmt]
    kw = dict(kw)
    src = make_checkpoint(arch, tmp_path)
    quantized, fake = tmp_path / "quantized", tmp_path / "fake"
    write_quantized_checkpoint(src, quantized, method, kw.pop("group", GROUP), fake_dst=fake, **kw)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 60)]
    refs = hf_greedy(fake, prompts, 12)
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5))
            for p in prompts]
    with caplog.at_level(logging.INFO, logger="consort.engine"):
        engine = run_engine(quantized, seqs, dtype="float32", quantization="auto")
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        check_logprobs_close(ref, s.output_token_ids, [lp["top"] for lp in s.output_logprobs],
                             name=f"{arch}/{fmt} request {i}")
    assert_greedy_matches(refs, [s.output_token_ids for s in seqs], name=f"{arch}/{fmt}")
    model = engine.runner.model
    on_codes = [runs_on_codes(m) for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert len(on_codes) == 2 * 4      # 2 layers: qkv, o, gate_up, down
    if "fp8" in fmt:     # decoded at load, and the load says so
        assert set(on_codes) == {False}
        assert "checkpoint (fp8 e4m3): its linears decoded at load, running in torch.float32" in caplog.text
    else:
        assert set(on_codes) == {hasattr(cpu_kernels(), "gemm_i8w_f32")}
        assert f"{sum(on_codes)} linears multiply their codes on the int8 kernel" in caplog.text
    # the fake-quantized model is not the float one: the test would see a wrong unpack
    assert hf_greedy(src, prompts[2:], 12)[0].logits[0].ne(refs[2].logits[0]).any()



# (method, writer options, whether transformers' reader rounds the weights through bf16 as it decodes them)
READERS = {"fp8-block": ("fp8", dict(bits=8, block=(32, 32)), False),
           "compressed-tensors-nvfp4": ("compressed-tensors", dict(layout="nvfp4-pack-quantized"), True),
           "compressed-tensors-fp8": ("compressed-tensors", dict(bits=8, layout="float-quantized"), True),
           "compressed-tensors-fp8-block": ("compressed-tensors", dict(bits=8, layout="float-quantized",
                                                                       strategy="block", block=(32, 32)), True)}


@pytest.mark.parametrize("fmt", list(READERS))
def test_checkpoint_decodes_as_transformers_reads_it(tmp_path, fmt):
    """transformers' own readers, not only our writer, are the reference for the formats themselves: its
    FineGrainedFP8 (which decodes FP8 on a CPU; blocks that divide the weight) and compressed-tensors'
    decompression (`run_compressed=False`; it decodes through bf16, so ours is compared rounded to bf16) give the
    weights the engine decodes, bit for bit."""
    from transformers import CompressedTensorsConfig

    method, kw, through_bf16 = READERS[fmt]
    src = make_checkpoint("qwen2", tmp_path)
    dst = tmp_path / fmt
    reference = write_quantized_checkpoint(src, dst, method, -1, **kw)
    qc = {} if method == "fp8" else {"quantization_config": CompressedTensorsConfig(run_compressed=False)}
    theirs = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, **qc).state_dict()
    fmt_ = checkpoint_format(json.loads((dst / "config.json").read_text()))
    ours = dict(checkpoint_weights(str(dst), fmt_, torch.float32))
    assert len(reference) == 2 * 7
    for name in reference:
        want = ours[name].to(torch.bfloat16).float() if through_bf16 else ours[name]
        assert torch.equal(want, theirs[name].float()), name
        assert not torch.equal(ours[name], src_weight(src, name)), name     # quantized: not the float weight


def src_weight(src, name: str) -> torch.Tensor:
    return load_file(str(next(src.glob("*.safetensors"))))[name].float()


def test_fp8_checkpoint_greedy_matches_transformers_running_it(tmp_path):
    """The engine's greedy tokens match transformers running transformers' FP8 checkpoint itself (decoded on a
    CPU), blocks of 32 x 32."""
    src = make_checkpoint("qwen2", tmp_path)
    dst = tmp_path / "fp8"
    write_quantized_checkpoint(src, dst, "fp8", -1, bits=8, block=(32, 32))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 31)]
    refs = hf_greedy(dst, prompts, 10)
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5))
            for p in prompts]
    run_engine(dst, seqs, dtype="float32", quantization="auto")
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        check_logprobs_close(ref, s.output_token_ids, [lp["top"] for lp in s.output_logprobs], name=f"fp8 request {i}")
    assert_greedy_matches(refs, [s.output_token_ids for s in seqs], name="fp8")
