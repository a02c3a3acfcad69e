"""LLMEngine end to end with a deterministic paged fake runner (no model)."""
from __future__ import annotations

import random

import pytest
from engine_fakes import GreedySampler, PagedFakeRunner

from consort_engine.config import EngineConfig
from consort_engine.core.engine import AdmissionRejected, LLMEngine, StepOutput
from consort_engine.kv.sequence import SamplingParams, Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_engine(num_blocks=512, block_size=4, eos=None, max_model_len=512, **cfg) -> LLMEngine:
    runner = PagedFakeRunner(num_blocks=num_blocks, block_size=block_size, eos_token_ids=eos,
                             max_model_len=max_model_len)
    config = EngineConfig(model="fake", name="algo", block_size=block_size, **cfg)
    return LLMEngine(config, runner=runner, sampler=GreedySampler())


def random_prompts(n, lo=3, hi=60, seed=0, shared_prefix=()):
    rng = random.Random(seed)
    return [list(shared_prefix) + [rng.randrange(1, 100) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


def test_generate_is_deterministic_and_respects_max_tokens():
    prompts = random_prompts(12)
    out1 = make_engine().generate(prompts, GREEDY)
    out2 = make_engine().generate(prompts, GREEDY)
    assert out1 == out2 and all(len(o) == 24 for o in out1)
    assert len({tuple(o) for o in out1}) > 1   # outputs depend on the prompt


def test_small_pool_with_preemption_matches_an_unconstrained_pool():
    prompts = random_prompts(16, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(16)]
    reference = make_engine(num_blocks=2048).generate(prompts, params)
    small = make_engine(num_blocks=40, max_num_batched_tokens=32)
    out = small.generate(prompts, params)
    assert small.stats()["num_preemptions"] > 0, "pool was meant to force preemption"
    assert out == reference
    assert small.block_manager.num_free_blocks == 40
    small.block_manager.check_invariants([])


def test_chunked_prefill_matches_whole_prefill():
    prompts = random_prompts(4, lo=150, hi=200, seed=2)
    whole = make_engine(max_num_batched_tokens=4096).generate(prompts, GREEDY)
    engine = make_engine(max_num_batched_tokens=24)
    chunked = engine.generate(prompts, GREEDY)
    assert chunked == whole
    assert max(b.num_tokens for b in engine.runner.batches) <= 24


def test_prefix_cache_hits_and_gives_identical_outputs():
    prefix = list(range(200, 264))             # 64 shared tokens = 16 blocks of 4
    prompts = random_prompts(8, lo=5, hi=20, seed=3, shared_prefix=prefix)
    uncached = make_engine(enable_prefix_caching=False).generate(prompts, GREEDY)
    engine = make_engine()
    first = engine.generate(prompts[:1], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert first + rest == uncached
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= 7 * 64
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)


def test_priority_preemption_through_the_engine_keeps_outputs_exact():
    prompts = random_prompts(10, lo=20, hi=40, seed=4)
    reference = make_engine(num_blocks=2048).generate(prompts, GREEDY)
    engine = make_engine(num_blocks=60)
    engine.warmup()
    seqs = [Sequence(p, GREEDY, priority=0, arrival=float(i)) for i, p in enumerate(prompts[:7])]
    for s in seqs:
        engine.add_request(s)
    for _ in range(5):
        engine.step()
    vips = [Sequence(p, GREEDY, priority=10, arrival=100.0 + i) for i, p in enumerate(prompts[7:])]
    for s in vips:
        engine.add_request(s)
    finished_order = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished_order.append(out.seq_id)
    assert engine.stats()["num_preemptions"] > 0
    assert [s.output_token_ids for s in seqs + vips] == reference
    # The high-priority requests, though last to arrive, are not the last to finish.
    assert finished_order.index(vips[-1].seq_id) < finished_order.index(seqs[-1].seq_id)


def test_step_outputs_stream_tokens_and_logprobs():
    engine = make_engine()
    engine.warmup()
    seq = Sequence([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1))
    engine.add_request(seq)
    outs: list[StepOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.new_token_ids[0] for o in outs] == seq.output_token_ids
    assert [o.finished for o in outs] == [False, False, True] and outs[-1].finish_reason == "length"
    assert all(o.logprobs and o.logprobs[0]["token"] == o.new_token_ids[0] for o in outs)
    assert len(seq.output_logprobs) == 3 and seq.first_token_time is not None


def test_eos_stops_unless_ignored():
    probe = make_engine().generate([[1, 2, 3]], GREEDY)[0]
    eos_token = probe[2]
    engine = make_engine(eos={eos_token})
    stop = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert stop == probe[:3]
    ignored = engine.generate([[1, 2, 3]], GREEDY)[0]
    assert ignored == probe


def test_add_request_validation_and_warming():
    engine = make_engine(num_blocks=8, max_model_len=64, max_waiting=2)
    with pytest.raises(AdmissionRejected) as warming:
        engine.add_request(Sequence([1, 2, 3], GREEDY))
    assert warming.value.code == "warming" and warming.value.retry_after_ms > 0
    engine.warmup()
    with pytest.raises(ValueError):
        engine.add_request(Sequence([], GREEDY))
    with pytest.raises(ValueError):
        engine.add_request(Sequence(list(range(64)), GREEDY))
    with pytest.raises(ValueError):
        engine.add_request(Sequence([1, 2], SamplingParams(max_tokens=0)))
    with pytest.raises(AdmissionRejected) as too_big:
        engine.add_request(Sequence(list(range(1, 40)), GREEDY))   # 10 blocks > pool of 8
    assert too_big.value.code == "kv_capacity" and too_big.value.permanent
    engine.add_request(Sequence([1, 2], GREEDY))
    engine.add_request(Sequence([3, 4], GREEDY))
    with pytest.raises(AdmissionRejected) as full:
        engine.add_request(Sequence([5, 6], GREEDY))
    assert full.value.code == "queue_full" and full.value.retry_after_ms >= 100


def test_abort_frees_blocks_and_stats_report_the_pool():
    engine = make_engine(num_blocks=64)
    engine.warmup()
    a = Sequence(list(range(1, 30)), GREEDY)
    b = Sequence(list(range(50, 60)), GREEDY)
    engine.add_request(a)
    engine.add_request(b)
    engine.step()
    stats = engine.stats()
    assert stats["running"] == 2 and stats["waiting"] == 0
    assert stats["kv_free_blocks"] == 64 - len(a.block_table) - len(b.block_table)
    assert 0 < stats["kv_usage"] < 1 and stats["step_time_ewma_s"] > 0
    assert stats["prefill_tokens_per_s"] > 0
    engine.abort(a.seq_id, reason="client_disconnected")
    assert a.finish_reason == "client_disconnected" and a.block_table == []
    engine.abort(b.seq_id)
    stats = engine.stats()
    assert stats["kv_free_blocks"] == 64 and stats["running"] == 0 and not engine.has_unfinished()
    assert stats["kv_cached_blocks"] > 0       # computed full blocks stay reusable
    assert set(stats) >= {"running", "waiting", "kv_total_blocks", "kv_free_blocks", "kv_cached_blocks",
                          "kv_usage", "preempting", "num_preemptions", "prefix_cache_queries",
                          "prefix_cache_hits", "step_time_ewma_s", "prefill_tokens_per_s", "decode_step_s"}


def test_preempting_flag_follows_recent_preemptions():
    engine = make_engine(num_blocks=30, max_num_batched_tokens=64)
    engine.generate(random_prompts(12, lo=20, hi=40, seed=5), GREEDY)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["preempting"] is True


def test_siblings_added_together_share_one_prefill_and_all_or_none():
    """The n samples of a prompt, admitted in one command: one prefill, the rest from the prefix cache."""
    prompt = random_prompts(1, lo=41, hi=42, seed=9)[0]          # 41 tokens: 10 full blocks of 4
    engine = make_engine()
    engine.warmup()
    seqs = [Sequence(list(prompt), GREEDY) for _ in range(4)]
    engine.add_requests(seqs)
    assert engine.stats()["waiting"] == 4
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["prefix_cache_hits"] == 3 * 40
    assert len({tuple(s.output_token_ids) for s in seqs}) == 1
    assert engine.block_manager.num_free_blocks == 512
    # A sibling whose twin is aborted before its prefill still runs (it is queued, not lost).
    a, b = Sequence(list(prompt), GREEDY), Sequence(list(prompt), GREEDY)
    engine.add_requests([a, b])
    engine.abort(a.seq_id)
    while engine.has_unfinished():
        engine.step()
    assert b.output_token_ids == seqs[0].output_token_ids and a.finish_reason == "abort"
    # All or none: an invalid member leaves nothing queued.
    with pytest.raises(ValueError):
        engine.add_requests([Sequence(list(prompt), GREEDY), Sequence([], GREEDY)])
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 512
