"""The KV tier under a real engine (demo Llama checkpoint, CPU, fp32): blocks evicted from a small
pool come back from the tier, greedy outputs are the same as without it, and a new engine on the
same directory starts warm."""
from __future__ import annotations

import random

import pytest

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams, Sequence

VOCAB = 512


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from consort_engine.demo_model import write_demo_model
    return write_demo_model(tmp_path_factory.mktemp("tier-demo") / "demo", hidden=64, layers=2, heads=4,
                            kv_heads=2, ffn=160, vocab=VOCAB, max_pos=512, seed=3)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    return [(shared if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 50))]
            for i in range(8)]


def engine(ckpt, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, **cfg))


def two_rounds(eng: LLMEngine) -> list[list[int]]:
    """Every prompt twice, the second round after the first is out of a small pool."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = eng.generate(prompts(), params)
    if eng.kv_tier is not None:
        assert eng.kv_tier.flush(10.0)
    return first + eng.generate(prompts(), params)


def test_greedy_outputs_are_the_same_with_the_tier_and_blocks_come_back_from_it(demo, tmp_path):
    reference = two_rounds(engine(demo, num_blocks=512))
    eng = engine(demo, num_blocks=40, max_num_batched_tokens=32, kv_tier_path=str(tmp_path))
    with_tier = two_rounds(eng)
    stats = eng.stats()
    assert stats["kv_tier_written"] > 0 and stats["tier_cache_hits"] > 0, stats
    assert stats["num_preemptions"] > 0
    assert with_tier == reference
    eng.block_manager.check_invariants([])
    eng.close()


def test_a_tier_in_host_memory_gives_the_same_outputs(demo):
    reference = two_rounds(engine(demo, num_blocks=512))
    eng = engine(demo, num_blocks=40, kv_tier_bytes=1 << 24)
    assert two_rounds(eng) == reference
    assert eng.stats()["tier_cache_hits"] > 0 and eng.kv_tier.kind == "memory"


def test_a_second_engine_on_the_same_directory_starts_warm(demo, tmp_path):
    first = engine(demo, num_blocks=512, kv_tier_path=str(tmp_path))
    prompt = prompts()[1]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = first.generate([prompt], params)
    first.close()                  # the pool's prefix blocks go to the directory
    second = engine(demo, num_blocks=512, kv_tier_path=str(tmp_path))
    second.warmup()
    seq = Sequence(list(prompt), params)
    second.scheduler.add(seq)
    while not seq.is_finished:
        second.step()
    assert seq.num_cached_tokens == (len(prompt) - 1) // 4 * 4 > 0
    assert seq.output_token_ids == out[0]
    assert second.stats()["prefix_cache_hits"] == 0 and second.stats()["tier_cache_hits"] == seq.num_cached_tokens


def test_an_fp8_pool_round_trips_the_tier_and_keeps_to_its_own_layout(demo, tmp_path):
    """fp8 blocks (a quarter of fp32's bytes) go out to the tier and come back bit for bit: the outputs
    are those of an fp8 engine whose pool never evicted; an fp32 engine on the same directory finds none
    of them (its layout identity names the other pool element)."""
    reference = two_rounds(engine(demo, num_blocks=512, kv_cache_dtype="fp8"))
    eng = engine(demo, num_blocks=40, max_num_batched_tokens=32, kv_tier_path=str(tmp_path), kv_cache_dtype="fp8")
    assert eng.runner.kv_cache.element_size() == 1
    with_tier = two_rounds(eng)
    stats = eng.stats()
    assert stats["kv_tier_written"] > 0 and stats["tier_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert with_tier == reference
    eng.block_manager.check_invariants([])
    eng.close()
    fp32 = engine(demo, num_blocks=512, kv_tier_path=str(tmp_path))
    assert fp32.runner.kv_bytes_per_token == 4 * eng.runner.kv_bytes_per_token
    fp32.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert fp32.stats()["tier_cache_hits"] == 0
