"""Tensor parallelism on CPU (gloo, two processes): TP = 2 gives the same greedy tokens as TP = 1,
and its logits agree to float tolerance (the all-reduce sums the halves in another order)."""
from __future__ import annotations

import random

import pytest
import torch

from consort_engine.config import EngineConfig
from consort_engine.demo_model import write_demo_model
from consort_engine.core.engine import LLMEngine
from consort_engine.model.cpu_kernels import cpu_kernels
from consort_engine.model.model_runner import ModelRunner
from consort_engine.kv.sequence import SamplingParams, ScheduledBatch, Sequence

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-model")
    write_demo_model(out, seed=3)      # 4 heads, 2 KV heads, intermediate 688: all split by 2
    return out


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randint(5, 300))] for _ in range(8)]
    prompts.append(prompts[0][:40] + [7, 8, 9])            # a shared prefix (prefix cache on both)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 32), ignore_eos=True) for _ in prompts]
    return prompts, params


def run(checkpoint, tp: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), num_blocks=256, max_num_batched_tokens=128,
                                    tensor_parallel_size=tp))
    try:
        prompts, params = workload()
        return engine.generate(prompts, params)
    finally:
        engine.runner.close()


def test_tp2_greedy_equals_tp1(checkpoint):
    one, two = run(checkpoint, 1), run(checkpoint, 2)
    assert [len(x) for x in two] == [len(x) for x in one]
    assert two == one


def test_tp2_prefill_logits_match_tp1(checkpoint):
    prompt = list(range(3, 120))
    logits = {}
    for tp in (1, 2):
        runner = ModelRunner(EngineConfig(model=str(checkpoint), num_blocks=64, tensor_parallel_size=tp))
        try:
            assert runner.kv_heads == 2 // tp      # each rank holds its share of the KV heads
            seq = Sequence(prompt_token_ids=prompt)
            seq.block_table = list(range((len(prompt) + 15) // 16))
            logits[tp] = runner.execute(ScheduledBatch([seq], [len(prompt)], [True], mode="prefill"))
        finally:
            runner.close()
    torch.testing.assert_close(logits[2], logits[1], rtol=1e-4, atol=1e-4)


def test_tp_must_divide_the_heads(checkpoint):
    with pytest.raises(ValueError, match="does not divide num_key_value_heads"):
        ModelRunner(EngineConfig(model=str(checkpoint), num_blocks=16, tensor_parallel_size=4))


@pytest.mark.parametrize("method,group", [("awq", 8), ("awq", 16), ("gptq", 8)])
def test_tp2_runs_an_int4_checkpoint_as_tp1_does(checkpoint, tmp_path, method, group):
    """An int4 checkpoint under TP = 2: each rank cuts the codes (column-parallel: rows; row-parallel:
    whole groups), and the prefill logits agree with TP = 1's to the int16 rounding of the rows (each
    rank rounds its own half of a row-parallel input). Row-parallel cuts that cannot keep the codes are
    dequantized: with groups of 16 the down projection's 344 columns a rank cut inside a group, and
    GPTQ act-order's columns of a rank are spread over every group."""
    from quantized_checkpoints import runs_on_codes, write_quantized_checkpoint

    from consort_engine.model.models.layers import Linear

    write_quantized_checkpoint(checkpoint, tmp_path / "awq", method, group, sym=True, act_order=method == "gptq")
    prompt = list(range(3, 120))
    logits = {}
    for tp in (1, 2):
        runner = ModelRunner(EngineConfig(model=str(tmp_path / "awq"), num_blocks=64, tensor_parallel_size=tp))
        try:
            seq = Sequence(prompt_token_ids=prompt)
            seq.block_table = list(range((len(prompt) + 15) // 16))
            logits[tp] = runner.execute(ScheduledBatch([seq], [len(prompt)], [True], mode="prefill"))
            if tp == 2 and hasattr(cpu_kernels(), "gemm_i8w_f32"):     # rank 0's linears
                codes = {name.rpartition(".")[2]: runs_on_codes(m) for name, m in runner.model.named_modules()
                         if isinstance(m, Linear) and m is not runner.model.lm_head}
                in_order = method == "awq"
                assert codes == {"qkv_proj": True, "o_proj": in_order, "gate_up_proj": True,
                                 "down_proj": in_order and group == 8}
        finally:
            runner.close()
    torch.testing.assert_close(logits[2], logits[1], rtol=1e-3, atol=1e-3)
