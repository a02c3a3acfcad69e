"""Speculative decoding (n-gram prompt lookup, greedy verification) with the paged fake runner:
the output is exactly one-token decoding's, in fewer steps, and the pool never leaks."""
from __future__ import annotations

import random

import pytest
from engine_fakes import GreedySampler, PagedFakeRunner, make_scheduler, make_seq

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams, Sequence
from consort_engine.spec.speculative import propose_ngram


def test_propose_ngram_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert propose_ngram([5, 6, 7, 5, 6, 7, 5, 6], 2) == [7, 5]        # latest earlier occurrence
    assert propose_ngram([9, 1, 2, 8, 2, 1, 2], 2) == [8, 2]           # 2-gram [1, 2] beats 1-gram [2]
    assert propose_ngram([1, 2, 3], 2) == [] and propose_ngram([7], 2) == []
    assert propose_ngram([4, 4], 3) == [4]                               # only what follows exists
    assert propose_ngram([1, 2, 1, 2], 0) == []


def test_propose_ngram_ignores_byte_matches_across_token_boundaries():
    # 0x00010000 then 1: the bytes of token 1 (01 00 00 00) appear inside them, misaligned
    assert propose_ngram([1 << 16, 1, 5, 1], 2) == [5, 1]
    assert propose_ngram([1 << 16, 0, 1], 2) == []


def make_engine(spec: str = "ngram", num_blocks: int = 512, vocab: int = 5, eos=None, **cfg) -> LLMEngine:
    runner = PagedFakeRunner(num_blocks=num_blocks, block_size=4, vocab=vocab, eos_token_ids=eos)
    # policy always: the fake runner's steps cost nothing a plan could weigh (test_engine_draft_plan.py)
    config = EngineConfig(model="fake", name="algo", block_size=4, speculative=spec, num_speculative_tokens=3,
                          spec_policy="always", **cfg)
    return LLMEngine(config, runner=runner, sampler=GreedySampler())


def prompts(n: int, seed: int = 0, vocab: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.mark.parametrize("num_blocks,budget", [(512, 2048), (40, 32)])
def test_greedy_output_equals_one_token_decoding(num_blocks, budget):
    ps = prompts(16, seed=num_blocks)
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True) for i in range(16)]
    reference = make_engine("off", num_blocks=2048).generate(ps, params)
    engine = make_engine("ngram", num_blocks=num_blocks, max_num_batched_tokens=budget)
    out = engine.generate(ps, params)
    assert out == reference
    spec = engine.stats()["speculation"]
    assert spec["state"] == "on" and spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] < spec["draft_tokens"]
    assert any(b.mode == "spec_verify" for b in engine.runner.batches)
    if num_blocks == 40:
        assert engine.stats()["num_preemptions"] > 0, "the small pool was meant to force preemption"
    assert engine.block_manager.num_free_blocks == num_blocks    # rejected drafts' blocks came back
    engine.block_manager.check_invariants([])


def test_fewer_steps_when_drafts_are_accepted():
    ps = prompts(4, seed=7, vocab=3)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain, spec = make_engine("off", vocab=3), make_engine("ngram", vocab=3)
    assert spec.generate(ps, params) == plain.generate(ps, params)
    assert spec.num_steps < plain.num_steps
    assert spec.stats()["speculation"]["acceptance_rate"] > 0.1


def test_eos_inside_an_accepted_run_stops_there():
    ps = prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=80)
    reference = make_engine("off", eos={2}).generate(ps, params)
    engine = make_engine("ngram", eos={2})
    assert engine.generate(ps, params) == reference
    assert all(o[-1] == 2 or len(o) == 80 for o in reference)
    assert engine.block_manager.num_free_blocks == 512


def test_with_tau_zero_drafts_only_for_greedy_requests_without_logprobs_never_past_max_tokens():
    sched = make_scheduler(num_blocks=64, speculative="ngram", num_speculative_tokens=3, spec_typical_tau=0.0)
    greedy = make_seq(4, max_tokens=3, first=1)
    greedy.token_ids = [1, 2, 1, 2, 1]; greedy.prompt_token_ids = list(greedy.token_ids)
    sampled = make_seq(4, max_tokens=9, first=1)
    sampled.sampling.temperature = 0.7
    sampled.token_ids = [1, 2, 1, 2, 1]; sampled.prompt_token_ids = list(sampled.token_ids)
    with_lp = make_seq(4, max_tokens=9, first=1, logprobs=2)
    with_lp.token_ids = [1, 2, 1, 2, 1]; with_lp.prompt_token_ids = list(with_lp.token_ids)
    for s in (greedy, sampled, with_lp):
        sched.add(s)
    first = sched.schedule()                   # prefill all three, one token each
    assert first.mode == "prefill"
    sched.postprocess(first, [2, 2, 2])
    batch = sched.schedule()
    assert batch.mode == "spec_verify"
    drafts = dict(zip((s.seq_id for s in batch.seqs), batch.num_draft))
    # greedy: [1,2,1,2,1,2] -> 2-gram [1, 2] proposes [1, 2]; capped at max_tokens - 1 - 1 = 1
    assert drafts == {greedy.seq_id: 1, sampled.seq_id: 0, with_lp.seq_id: 0}
    assert batch.num_new_tokens == [2, 1, 1] and greedy.token_ids[-1] == 1
    outs = sched.postprocess(batch, [1, 9, 4, 4])     # greedy's window: draft 1 accepted, bonus 9
    by_id = {o.seq_id: o for o in outs}
    assert by_id[greedy.seq_id].new_token_ids == [1, 9] and by_id[greedy.seq_id].finish_reason == "length"
    assert greedy.output_token_ids == [2, 1, 9] and greedy.block_table == []
    assert sched.spec.num_accepted_tokens == 1 and sched.spec.num_draft_tokens == 1


def test_rejected_drafts_roll_back_computed_tokens_and_blocks():
    sched = make_scheduler(num_blocks=64, speculative="ngram", num_speculative_tokens=3)
    seq = make_seq(10, max_tokens=20)
    seq.token_ids = [3, 1, 4, 1, 5, 9, 2, 6, 8, 8]; seq.prompt_token_ids = list(seq.token_ids)
    sched.add(seq)
    sched.postprocess(sched.schedule(), [5])           # prefill samples 5; "5" occurred before "9 2 6"
    batch = sched.schedule()
    assert batch.mode == "spec_verify" and batch.num_draft == [3] and seq.token_ids[-3:] == [9, 2, 6]
    assert len(seq.block_table) == 4                   # the window reaches position 13: 4 blocks of 4
    outs = sched.postprocess(batch, [7, 7, 7, 7])      # the model disagrees at once: only its 7 stands
    assert outs[0].new_token_ids == [7] and seq.token_ids[10:] == [5, 7]
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3
    assert sched.block_manager.num_free_blocks == 61
    # the rejected draft's K/V at position 11 sits in a kept block: listed for zeroing
    assert sched.spec.stale_slots == [seq.block_table[2] * 4 + 3]
    assert sched.spec.num_draft_tokens == 3 and sched.spec.num_accepted_tokens == 0
    batch = sched.schedule()                           # next window starts at the kept token
    assert batch.seqs == [seq] and seq.num_computed_tokens == 11


def test_a_tool_trigger_ends_the_accepted_run_and_speculation_for_that_request():
    trigger = 4       # this fake model first emits it inside accepted draft runs
    ps = prompts(12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = make_engine("off").generate(ps, params)
    engine = make_engine("ngram", tool_trigger_ids=[trigger])
    seqs = [Sequence(list(p), params) for p in ps]
    for s in seqs:
        engine.scheduler.add(s)
    drafted_after_trigger = cut_runs = 0
    while engine.has_unfinished():
        batch = engine.scheduler.schedule()
        for s, k in zip(batch.seqs, batch.num_draft or [0] * len(batch.seqs)):
            drafted_after_trigger += bool(k) and trigger in s.output_token_ids[:-k]
        logits = engine.runner.execute(batch)
        token_ids, lps = engine._sample(batch, logits)
        for out in engine.scheduler.postprocess(batch, token_ids, lps):
            if trigger in out.new_token_ids:
                assert out.new_token_ids.index(trigger) == len(out.new_token_ids) - 1, out  # nothing past it
                cut_runs += len(out.new_token_ids) > 1
        engine.runner.zero_slots(engine.scheduler.spec.stale_slots)
        engine.scheduler.spec.stale_slots = []
    assert [s.output_token_ids for s in seqs] == reference
    assert drafted_after_trigger == 0 and cut_runs > 0
    assert not any(s.speculate for s in seqs if trigger in s.output_token_ids)
    assert engine.block_manager.num_free_blocks == 512


def test_typical_acceptance_is_strict_where_the_model_is_sure():
    import torch
    from consort_engine.spec.speculative import typical_accepted, typical_threshold
    sure = torch.tensor([[0.97, 0.01, 0.01, 0.01]])
    spread = torch.full((1, 4), 0.25)
    assert typical_threshold(spread, 0.1).item() < typical_threshold(sure, 0.1).item() <= 0.1 + 1e-7
    rows = torch.cat([sure, spread, sure])
    assert typical_accepted(rows, [0, 3, 0], 0.1) == 3         # 0.25 >= threshold on the spread row
    assert typical_accepted(rows, [0, 3, 1], 0.1) == 2         # 0.01 on a sure row: refused
    assert typical_accepted(rows, [2, 3, 0], 0.1) == 0
    assert typical_accepted(rows, [], 0.1) == 0


def test_sampled_requests_speculate_with_typical_acceptance_and_stay_seed_reproducible():
    from consort_engine.model.sampler import Sampler

    def run(spec: str, tau: float = 0.1):
        runner = PagedFakeRunner(num_blocks=256, block_size=4, vocab=5)
        config = EngineConfig(model="fake", name="algo", block_size=4, speculative=spec, num_speculative_tokens=3,
                              spec_typical_tau=tau, spec_policy="always")
        engine = LLMEngine(config, runner=runner, sampler=Sampler())
        params = [SamplingParams(temperature=0.7, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(8)]
        return engine, engine.generate(prompts(8, seed=9), params)

    engine, out = run("ngram")
    again = run("ngram")[1]
    assert out == again and all(len(o) == 30 for o in out)          # seeded: reproducible
    spec = engine.stats()["speculation"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0
    assert engine.block_manager.num_free_blocks == 256
    off, _ = run("ngram", tau=0.0)                                   # tau 0: sampled requests do not draft
    assert off.stats()["speculation"]["draft_tokens"] == 0
