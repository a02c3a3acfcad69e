"""The KV tier under a hybrid (attention + Mamba2, transformers' BambaForCausalLM) engine: a prefix
block leaves the pool for the tier with the conv/SSM state checkpoint saved at its end, and a tier
hit restores that state and continues the prompt from there. Greedy tokens equal the same engine
without a tier and transformers' (a small pool: preemption by swap and by recompute), a second
engine on the same directory serves a prompt from the tier, a tier file whose state part is
corrupted is refused and recomputed, and a hybrid's file is refused by a non-hybrid engine.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from fidelity_helpers import VOCAB, check_logprobs_close, hf_greedy, make_checkpoint

from consort_common.block_hash import prefix_hashes
from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams, Sequence
from consort_engine.kv.tier import SUFFIX

NAME = "hyb"
SMALL = dict(num_blocks=32, max_num_batched_tokens=512)      # a wave outgrows it as it decodes


@pytest.fixture(scope="module")
def waves(tmp_path_factory):
    """Two waves sharing a 50-token prefix; between them an unrelated wave pushes the first out of
    the pool (into the tier, when there is one)."""
    ckpt = make_checkpoint("bamba", tmp_path_factory.mktemp("bamba-tier"), attn_layer_indices=[0, 3])
    rng = random.Random(17)
    prefix = [rng.randrange(3, VOCAB) for _ in range(50)]
    first = [prefix + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (0, 13, 29)]
    flush = [[rng.randrange(3, VOCAB) for _ in range(60)] for _ in range(3)]
    second = [first[0], first[1] + [rng.randrange(3, VOCAB) for _ in range(9)], first[2],
              prefix + [rng.randrange(3, VOCAB) for _ in range(21)]]
    prompts = [first, flush, second]
    max_tokens = [rng.randrange(14, 24) for _ in range(sum(map(len, prompts)))]
    return ckpt, prompts, max_tokens, hf_greedy(ckpt, [p for w in prompts for p in w], max_tokens)


def engine(ckpt: Path, **kw) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=8, name=NAME,
                                 hybrid_checkpoints=16, hybrid_checkpoint_every=8, **kw))
    eng.warmup()
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> list[Sequence]:
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5))
            for p, m in zip(prompts, max_tokens)]
    for s in seqs:               # offline: no admission control, the small pool preempts instead
        eng.validate(s)
        eng.scheduler.add(s)
    steps = 0
    while any(not s.is_finished for s in seqs):
        eng.step()
        eng.block_manager.check_invariants(eng.scheduler.running)
        steps += 1
        assert steps < 2000
    return seqs


def run_waves(eng: LLMEngine, prompts: list[list[list[int]]], max_tokens: list[int]) -> list[Sequence]:
    seqs: list[Sequence] = []
    for wave in prompts:
        seqs += run(eng, wave, max_tokens[len(seqs):len(seqs) + len(wave)])
        if eng.kv_tier is not None:
            assert eng.kv_tier.flush(10.0)
    return seqs


@pytest.mark.parametrize("swap", [True, False], ids=["preempt-swap", "preempt-recompute"])
def test_hybrid_tier_hits_give_the_same_greedy_tokens(waves, tmp_path, swap):
    ckpt, prompts, max_tokens, refs = waves
    plain = run_waves(engine(ckpt, hybrid_swap=swap, **SMALL), prompts, max_tokens)
    eng = engine(ckpt, hybrid_swap=swap, kv_tier_path=str(tmp_path), **SMALL)
    tiered = run_waves(eng, prompts, max_tokens)
    stats = eng.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_tier_written"] > 0 and stats["tier_cache_hits"] > 0, stats
    second = tiered[-len(prompts[2]):]
    assert sum(s.num_cached_tokens for s in second) >= stats["tier_cache_hits"] > 0
    assert stats["kv_tier_rejected"] == 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    same = exact = 0
    for i, (s, p, ref) in enumerate(zip(tiered, plain, refs)):
        assert len(s.output_token_ids) == max_tokens[i]
        same += s.output_token_ids == p.output_token_ids
        top = [lp["top"] for lp in s.output_logprobs]
        exact += check_logprobs_close(ref, s.output_token_ids, top, name=f"request {i}") == max_tokens[i]
    assert same == len(tiered), f"only {same}/{len(tiered)} equal the engine without a tier"
    assert exact >= len(tiered) - 1, f"only {exact}/{len(tiered)} matched transformers exactly in fp32"
    eng.close()


def serve_one(eng: LLMEngine, prompt: list[int], max_tokens: int) -> Sequence:
    return run(eng, [prompt], [max_tokens])[0]


def test_a_second_hybrid_engine_on_the_same_directory_starts_warm(waves, tmp_path):
    ckpt, prompts, max_tokens, refs = waves
    prompt, n, ref = prompts[0][2], max_tokens[2], refs[2]
    first = engine(ckpt, num_blocks=256, kv_tier_path=str(tmp_path))
    out = serve_one(first, prompt, n).output_token_ids
    first.close()                 # the pool's prefix blocks (and their states) go to the directory
    second = engine(ckpt, num_blocks=256, kv_tier_path=str(tmp_path))
    seq = serve_one(second, prompt, n)
    stats = second.stats()
    assert seq.num_cached_tokens == (len(prompt) - 1) // 4 * 4 > 0       # the prompt's end has a checkpoint
    assert stats["prefix_cache_hits"] == 0 and stats["tier_cache_hits"] == seq.num_cached_tokens
    assert seq.output_token_ids == out
    assert check_logprobs_close(ref, seq.output_token_ids, [lp["top"] for lp in seq.output_logprobs]) == n
    second.close()


def test_a_tier_file_with_a_corrupted_state_is_refused_and_recomputed(waves, tmp_path):
    ckpt, prompts, max_tokens, _ = waves
    prompt, n = prompts[0][2], max_tokens[2]
    first = engine(ckpt, num_blocks=256, kv_tier_path=str(tmp_path))
    out = serve_one(first, prompt, n).output_token_ids
    first.close()
    deepest = prefix_hashes(prompt, 4, NAME, None, None)[(len(prompt) - 1) // 4 - 1]
    files = {p.name: p for p in tmp_path.glob("*/*" + SUFFIX)}
    path = files[deepest.hex() + SUFFIX]
    blob = bytearray(path.read_bytes())
    kv_bytes = first.runner.block_bytes
    assert len(blob) > kv_bytes + first.runner.state_bytes_per_seq, "the state is stored after the K/V"
    blob[-5] ^= 0x01              # inside the SSM state: the K/V part is intact
    path.write_bytes(bytes(blob))
    second = engine(ckpt, num_blocks=256, kv_tier_path=str(tmp_path))
    seq = serve_one(second, prompt, n)
    stats = second.stats()
    assert stats["kv_tier_rejected"] == 1 and not path.exists()
    assert seq.num_cached_tokens < (len(prompt) - 1) // 4 * 4     # an earlier checkpoint at most
    assert seq.output_token_ids == out
    second.close()


def test_a_hybrid_tier_file_is_refused_by_a_non_hybrid_engine(waves, tmp_path):
    from consort_engine.demo_model import write_demo_model
    ckpt, prompts, max_tokens, _ = waves
    prompt, n = prompts[0][2], max_tokens[2]
    hybrid = engine(ckpt, num_blocks=256, kv_tier_path=str(tmp_path / "hybrid"))
    serve_one(hybrid, prompt, n)
    hybrid.close()
    llama_ckpt = write_demo_model(tmp_path / "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=160,
                                  vocab=VOCAB, max_pos=512, seed=3)

    def llama() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", block_size=4, name=NAME,
                                      num_blocks=256, kv_tier_path=str(tmp_path / "llama")))
    first = llama()
    reference = serve_one(first, prompt, n).output_token_ids
    first.close()
    assert " state=" in hybrid.kv_tier.identity and " state=" not in first.kv_tier.identity
    for f in (tmp_path / "hybrid").glob("*/*" + SUFFIX):      # the same hashes, put where the Llama looks
        shutil.copy(f, first.kv_tier.dir)
    second = llama()
    seq = serve_one(second, prompt, n)
    assert second.stats()["kv_tier_rejected"] == 1 and seq.num_cached_tokens == 0   # the first lookup refuses
    assert seq.output_token_ids == reference
    second.close()


def test_a_hybrids_fp8_pool_swaps_and_tiers_its_blocks_bit_for_bit(waves, tmp_path):
    """`--kv-cache-dtype fp8` under a hybrid: its attention layers' fp8 blocks go out to host memory on
    preemption (swap) and to the tier with their state checkpoints, and come back as they were: the tokens
    equal the same fp8 engine's without a tier."""
    import torch

    ckpt, prompts, max_tokens, _ = waves
    plain = run_waves(engine(ckpt, kv_cache_dtype="fp8", **SMALL), prompts, max_tokens)
    eng = engine(ckpt, kv_cache_dtype="fp8", kv_tier_path=str(tmp_path), **SMALL)
    assert eng.runner.kv_cache.dtype == torch.float8_e4m3fn
    tiered = run_waves(eng, prompts, max_tokens)
    stats = eng.stats()
    assert stats["num_preemptions"] > 0 and stats["tier_cache_hits"] > 0 and stats["kv_tier_rejected"] == 0, stats
    assert [s.output_token_ids for s in tiered] == [s.output_token_ids for s in plain]
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    eng.close()
