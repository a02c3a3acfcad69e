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


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return held_out_case(tmp_path_factory.mktemp("quant"))


@pytest.mark.parametrize("quantization", list(QUANT_BOUNDS))
def test_quantized_engine_stays_close_to_the_unquantized_model(case, quantization):
    plps = engine_prompt_logprobs(case.checkpoint, case.prompts, dtype="float32", quantization=quantization)
    assert_quant_fidelity(case, plps, quantization)
