"""Hybrid attention + Mamba2 (transformers' BambaForCausalLM) through the whole engine vs transformers.

Tiny random checkpoints written by transformers (its torch fallback runs the reference on CPU: no
mamba_ssm kernels), several attention layer placements. The engine keeps KV blocks for the attention
layers only and the mixers' conv/SSM state in per-sequence slots: greedy tokens must equal
transformers' under concurrency (mixed lengths: decodes batched in one state update while prompts
scan), chunked prefill (a small token budget: the scan continues from the saved state across chunk
boundaries that do not line up with the SSD chunk size) and preemption (swap: KV + state parked in
host memory and put back into new blocks and a new slot; and recompute: the slot is freed and the
sequence prefills again from its last state checkpoint or zero state). Prefix caching: prompts that
share a prefix restore the conv/SSM state saved at the last cached block boundary and prefill only
the rest; greedy tokens equal caching off and transformers'.
"""
from __future__ import annotations

import random

import pytest
import torch
from fidelity_helpers import (assert_drafts_match_reference, check_logprobs_close, greedy_agrees, hf_greedy,
                              make_checkpoint)

from consort_engine.bench.hybrid import continuation_drafter
from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams, Sequence

N = 10
LONG = 150           # the long prompt: several SSD chunks (16) and several prefill chunks in "chunked"

CASES = {
    #             pool blocks, token budget
    "concurrent": dict(num_blocks=1024, max_num_batched_tokens=512),
    "preempt": dict(num_blocks=70, max_num_batched_tokens=512),
    "preempt-recompute": dict(num_blocks=70, max_num_batched_tokens=512, hybrid_swap=False),
    "chunked": dict(num_blocks=1024, max_num_batched_tokens=24),
}
PLACEMENTS = {"attn-1": [1], "attn-0-3": [0, 3], "attn-2": [2]}


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(5)
    prompts, max_tokens = [], []
    for i in range(N):
        n = LONG if i == 0 else rng.randrange(1, 60)     # a one-token prompt decodes from zero state
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
        max_tokens.append(rng.randrange(6, 18))
    return prompts, max_tokens


@pytest.fixture(scope="module", params=list(PLACEMENTS))
def hybrid(request, tmp_path_factory):
    ckpt = make_checkpoint("bamba", tmp_path_factory.mktemp(request.param),
                           attn_layer_indices=PLACEMENTS[request.param])
    slow_decay(ckpt)      # a wrong state anywhere (a rollback, a swap, a chunk boundary) shows in later tokens
    prompts, max_tokens = workload(512)
    return request.param, ckpt, prompts, max_tokens, hf_greedy(ckpt, prompts, max_tokens)


def run_engine(ckpt, prompts, max_tokens, case: str, **kw):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=8,
                                    **CASES[case], **kw))
    engine.warmup()
    chunks: dict[int, list[int]] = {}
    logits: dict[int, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def spy(batch):
        out = execute(batch)
        row = 0
        for s, n, smp in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            chunks.setdefault(s.seq_id, []).append(n)
            if smp:
                logits.setdefault(s.seq_id, []).append(out[row].clone())
                row += 1
        return out
    engine.runner.execute = spy
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5))
            for p, m in zip(prompts, max_tokens)]
    for s in seqs:
        engine.add_request(s)
    steps = 0
    while any(not s.is_finished for s in seqs):
        engine.step()
        engine.block_manager.check_invariants(engine.scheduler.running)
        steps += 1
        assert steps < 2000
    return engine, seqs, chunks, logits


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_greedy_matches_transformers(hybrid, case):
    name, ckpt, prompts, max_tokens, refs = hybrid
    engine, seqs, chunks, logits = run_engine(ckpt, prompts, max_tokens, case)
    runner, stats = engine.runner, engine.stats()
    assert runner.is_hybrid and runner.num_kv_layers == len(PLACEMENTS[name])
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], "every block is released at the end"
    slots = engine.block_manager.state_slots
    assert slots.num_free == slots.num_slots == 8, "every state slot is released at the end"
    assert engine.block_manager.enable_caching and engine.block_manager.checkpoints == 2   # max_num_seqs // 4
    if case.startswith("preempt"):
        assert stats["num_preemptions"] > 0
    executed = sum(sum(c) for c in chunks.values())
    exactly_once = sum(len(p) + m - 1 for p, m in zip(prompts, max_tokens))
    if case == "preempt":     # swapped victims resume: no token runs through the model twice
        assert stats["num_preemptions_swapped"] == stats["num_preemptions"]
        assert executed == exactly_once, (executed, exactly_once)
    if case == "preempt-recompute":
        assert stats["num_preemptions_swapped"] == 0
        assert executed > exactly_once
    if case == "chunked":
        long_chunks = chunks[seqs[0].seq_id]
        assert sum(1 for n in long_chunks if n > 1) >= LONG // 24, long_chunks
        assert max(long_chunks) <= 24
    exact = 0
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        assert s.finish_reason == "length" and len(s.output_token_ids) == max_tokens[i]
        top = [lp["top"] for lp in s.output_logprobs]
        matched = check_logprobs_close(ref, s.output_token_ids, top, name=f"{name}/{case} request {i}")
        exact += matched == max_tokens[i]
        # logits of the matched steps agree with transformers' to fp32 rounding
        for step in range(matched):
            torch.testing.assert_close(logits[s.seq_id][step], ref.logits[step], atol=2e-3, rtol=1e-3)
    assert exact >= N - 1, f"only {exact}/{N} requests matched transformers exactly in fp32"


def test_hybrid_kv_pool_is_attention_layers_only(hybrid):
    """The pool holds K/V of the attention layers only: a hybrid's bytes per token shrink by the mixer share."""
    name, ckpt, *_ = hybrid
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, **CASES["concurrent"]))
    r = engine.runner
    c = r.hf_config
    assert r.kv_cache.shape[0] == len(PLACEMENTS[name]) < c.num_hidden_layers
    assert r.kv_bytes_per_token == 2 * len(PLACEMENTS[name]) * c.num_key_value_heads * c.head_dim * 4
    mixers = c.num_hidden_layers - len(PLACEMENTS[name])
    assert r.ssm_state.shape == (engine.config.max_num_seqs, mixers, 8, 16, 16)
    assert r.conv_state.shape == (engine.config.max_num_seqs, mixers, 128 + 2 * 2 * 16, 3)


@pytest.mark.parametrize("case", ["concurrent", "preempt", "chunked"])
def test_hybrid_speculative_greedy_matches_transformers(hybrid, case, monkeypatch):
    """Speculation on a hybrid: verify windows step the mixers row by row with a state snapshot per
    position; rejected drafts roll the state back to the last kept token. Same greedy tokens.

    Random weights rarely repeat an n-gram, so the n-gram proposer is swapped for one that drafts
    transformers' own continuation with every third token wrong: windows accept 0..K drafts."""
    name, ckpt, prompts, max_tokens, refs = hybrid
    monkeypatch.setattr("consort_engine.core.scheduler.propose_ngram",
                        continuation_drafter(prompts, [r.tokens for r in refs], 512))
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=8,
                                    speculative="ngram", num_speculative_tokens=3, spec_policy="always",
                                    **CASES[case]))
    engine.warmup()
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                     for m in max_tokens])
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    slots = engine.block_manager.state_slots
    assert slots.num_free == slots.num_slots
    sch = engine.scheduler
    assert sch.spec.num_accepted_tokens > 0, "no draft was accepted: the windows were not exercised"
    assert sch.spec.num_draft_tokens > sch.spec.num_accepted_tokens, "no draft was rejected: the rollback was not exercised"
    exact = sum(out == list(ref.tokens) for out, ref in zip(outs, refs))
    assert exact >= N - 1, f"{name}/{case}: only {exact}/{N} speculative requests matched transformers"


def add_mtp_block(ckpt, attention_layer: int) -> None:
    """An MTP block in the Qwen3-Next layout (`mtp.*`): the decoder layer a copy of the model's attention
    layer `attention_layer`, a random input projection. It drafts (rarely the model's tokens) and loads."""
    from safetensors.torch import load_file, save_file
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(7)
    h = tensors["model.embed_tokens.weight"].shape[1]
    src = f"model.layers.{attention_layer}."
    block = {"mtp.layers.0." + k[len(src):]: v.clone() for k, v in tensors.items() if k.startswith(src)}
    block["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.2
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        block[f"mtp.{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    save_file({**tensors, **block}, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hybrid_mtp(tmp_path_factory):
    ckpt = make_checkpoint("bamba", tmp_path_factory.mktemp("mtp"), attn_layer_indices=[0, 3])
    slow_decay(ckpt)
    add_mtp_block(ckpt, 3)
    prompts, max_tokens = workload(512)
    return ckpt, prompts, max_tokens, hf_greedy(ckpt, prompts, max_tokens)


def test_hybrid_mtp_drafts_equal_the_reference(hybrid_mtp):
    """MTP on a hybrid: the block is one of the model's attention layers (partial rotary; its own KV
    layer after the two attention layers'); its passes touch no mixer state. Drafts, through chunked
    prefill, equal transformers' full recompute (BambaDecoderLayer, demo_model.mtp_reference_drafts)."""
    from consort_engine.model.models.layers import Attention
    ckpt, prompts, *_ = hybrid_mtp
    eng = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, speculative="mtp",
                                 num_speculative_tokens=3, max_num_batched_tokens=16, num_blocks=1024,
                                 spec_policy="always"))
    r = eng.runner
    assert r.has_mtp and r.kv_cache.shape[0] == 3 and eng.stats()["speculation"]["state"] == "on"
    assert isinstance(r.model.mtp.layer.self_attn, Attention) and r.model.mtp.layer.mamba is None
    assert_drafts_match_reference(ckpt, eng, prompts[1], 24)


def continuation_drafts(engine: LLMEngine, prompts: list[list[int]], refs) -> None:
    """After the MTP block drafts (its pass and chain run as ever), replace its drafts with transformers'
    continuation, every third token wrong: the random block's drafts are almost never accepted."""
    propose = continuation_drafter(prompts, [r.tokens for r in refs], 512)
    inner = engine._draft_mtp

    def draft(batch):
        inner(batch)
        for seq, k in zip(batch.seqs, batch.num_draft or []):
            if k:
                ref = propose(seq.token_ids[: seq.num_computed_tokens + 1], k)
                seq.token_ids[-k:] = ref + seq.token_ids[len(seq.token_ids) - k + len(ref):]
    engine._draft_mtp = draft


@pytest.mark.parametrize("drafts", ["block", "continuation"])
@pytest.mark.parametrize("case", ["concurrent", "preempt", "chunked"])
def test_hybrid_mtp_greedy_matches_transformers(hybrid_mtp, case, drafts):
    """Greedy output with MTP drafting equals transformers' (verify windows on the mixers, the block's
    own KV layer) under concurrency, preemption (swap: the block's KV layer goes with the others) and
    chunked prefill; the pool and the state slots do not leak. With the block's own drafts (rejected
    but for chance) and with drafts that are mostly right (windows keep 1..K+1 tokens, the next MTP pass
    runs over every kept row)."""
    ckpt, prompts, max_tokens, refs = hybrid_mtp
    # policy always: windows are verified every step, even with the random block's rejected drafts
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=8,
                                    speculative="mtp", num_speculative_tokens=3, spec_policy="always",
                                    **CASES[case]))
    if drafts == "continuation":
        continuation_drafts(engine, prompts, refs)
    engine.warmup()
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                     for m in max_tokens])
    stats = engine.stats()
    spec = stats["speculation"]
    assert spec["drafter"] == "mtp" and spec["draft_tokens"] > 0, spec
    if drafts == "continuation":
        assert 0.3 < spec["acceptance_rate"] < 0.95, spec
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    slots = engine.block_manager.state_slots
    assert slots.num_free == slots.num_slots
    if case == "preempt":
        assert stats["num_preemptions_swapped"] > 0
    exact = sum(out == list(ref.tokens) for out, ref in zip(outs, refs))
    assert exact >= N - 1, f"mtp/{case}: only {exact}/{N} requests matched transformers"


def shared_prefix_workload(vocab: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Two waves: the first computes prompts that share a 50-token prefix, the second hits it (exact
    repeats, longer continuations, other suffixes). 50 is not a block multiple: hits end at 48."""
    rng = random.Random(11)
    prefix = [rng.randrange(3, vocab) for _ in range(50)]
    first = [prefix + [rng.randrange(3, vocab) for _ in range(k)] for k in (0, 13, 29)]
    second = [first[0], first[1] + [rng.randrange(3, vocab) for _ in range(9)], first[2],
              prefix + [rng.randrange(3, vocab) for _ in range(21)], prefix[:33]]
    max_tokens = [rng.randrange(14, 24) for _ in range(len(first) + len(second))]
    return first, second, max_tokens


def slow_decay(ckpt) -> None:
    """Mixers whose state lasts: transformers' init gives A = -1 .. -heads, under which a prefix's state
    has all but decayed by the time a second wave restores it, so a wrong or missing checkpoint would
    still pass; A = -0.01 keeps what the prefix put in the state in every later token's output."""
    from safetensors.torch import load_file, save_file
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith("A_log"):
            tensors[name] = torch.full_like(tensors[name], -4.6)         # log(0.01)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def shared_prefix(tmp_path_factory):
    ckpt = make_checkpoint("bamba", tmp_path_factory.mktemp("shared"), attn_layer_indices=[0, 3])
    slow_decay(ckpt)
    first, second, max_tokens = shared_prefix_workload(512)
    return ckpt, first, second, max_tokens, hf_greedy(ckpt, first + second, max_tokens)


def run_waves(ckpt, first, second, max_tokens, case: str, **kw):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=8,
                                    hybrid_checkpoints=16, hybrid_checkpoint_every=8, name="hyb",
                                    **{**CASES[case], **kw}))
    engine.warmup()
    seqs = []
    for wave in (first, second):
        batch = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens[len(seqs) + i],
                                                  ignore_eos=True, logprobs=5)) for i, p in enumerate(wave)]
        for s in batch:        # offline: no admission control, the small pools preempt instead
            engine.validate(s)
            engine.scheduler.add(s)
        seqs += batch
        steps = 0
        while any(not s.is_finished for s in batch):
            engine.step()
            engine.block_manager.check_invariants(engine.scheduler.running)
            steps += 1
            assert steps < 2000
    return engine, seqs


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_prefix_hits_match_caching_off_and_transformers(shared_prefix, case):
    """The second wave restores the mixers' state saved at a cached block boundary (checkpoints every
    8 tokens, inside prefill chunks and at their ends in "chunked") and prefills only the rest; greedy
    tokens equal the same run with caching off and transformers'. Hits show in the prefix counters,
    the hit blocks in the block events."""
    from consort_common.block_hash import prefix_hashes
    ckpt, first, second, max_tokens, refs = shared_prefix
    pool = dict(num_blocks=32) if case.startswith("preempt") else {}    # a wave outgrows it as it decodes
    on, seqs = run_waves(ckpt, first, second, max_tokens, case, **pool)
    off, seqs_off = run_waves(ckpt, first, second, max_tokens, case, enable_prefix_caching=False, **pool)
    stats = on.stats()
    assert off.stats()["prefix_cache_hits"] == 0 and on.block_manager.enable_caching
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    hit = [s.num_cached_tokens for s in seqs[len(first):]]
    assert stats["prefix_cache_hits"] >= sum(hit) > 0, (stats["prefix_cache_hits"], hit)
    assert all(n % 8 == 0 or n in (60, 76) for n in hit), hit     # checkpoints: every 8 tokens, prompt ends
    if case in ("concurrent", "chunked"):        # a roomy pool: the repeats hit at their last full block
        assert hit[0] == 48 and hit[2] == 76, hit
        held = set(on.kv_events.read(None, None)["snapshot"]["pool"])
        assert {h.hex() for h in prefix_hashes(second[0][:48], 4, "hyb", None, None)} <= held
    if case.startswith("preempt"):
        assert stats["num_preemptions"] > 0
    same = exact = 0
    for i, (s, s_off, ref) in enumerate(zip(seqs, seqs_off, refs)):
        assert len(s.output_token_ids) == max_tokens[i]
        same += s.output_token_ids == s_off.output_token_ids
        top = [lp["top"] for lp in s.output_logprobs]
        exact += check_logprobs_close(ref, s.output_token_ids, top, name=f"{case} request {i}") == max_tokens[i]
    assert same >= len(seqs) - 1, f"{case}: only {same}/{len(seqs)} equal caching off"
    assert exact >= len(seqs) - 1, f"{case}: only {exact}/{len(seqs)} matched transformers exactly in fp32"


def test_hybrid_n_samples_share_one_prefill_and_checkpoints_off(tmp_path, caplog):
    """n samples of one prompt: one prefill, the others restore its last checkpoint. With no
    checkpoint rows (hybrid_checkpoints 0) prefix caching is off for a hybrid, with a log line."""
    ckpt = make_checkpoint("bamba", tmp_path)
    prompts, max_tokens = workload(512)
    refs = hf_greedy(ckpt, prompts[:1], max_tokens[:1])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens[0], ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, **CASES["concurrent"]))
    seqs = [Sequence(list(prompts[0]), params) for _ in range(3)]
    engine.warmup()
    engine.add_requests(seqs)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.prefix_hits == 2 * ((LONG - 1) // 4 * 4)
    assert seqs[0].output_token_ids == seqs[1].output_token_ids == seqs[2].output_token_ids
    greedy_agrees(refs[0].logits, refs[0].tokens, seqs[0].output_token_ids, tol=2e-3, name="n samples")
    with caplog.at_level("WARNING", logger="consort.engine"):
        engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, hybrid_checkpoints=0,
                                        **CASES["concurrent"]))
    assert "prefix caching is off" in caplog.text and not engine.block_manager.enable_caching
    outs = engine.generate([prompts[0], prompts[0]], params)
    assert engine.block_manager.prefix_hits == 0 and outs[0] == outs[1] == seqs[0].output_token_ids


@pytest.mark.parametrize("n,groups", [(1, 1), (37, 2), (64, 4)])
def test_ssd_functions_match_transformers_reference(n, groups):
    """Our chunk scan (state in, state out, B/C per group) and batched state update equal transformers'
    torch reference (mamba2_chunk_scan with initial_states, mamba2_selective_state_update)."""
    from transformers.models.bamba import modeling_bamba as ref

    from consort_engine.model.models import ssd
    torch.manual_seed(n)
    h, p, d = 8, 16, 16
    x, dt = torch.randn(n, h, p), torch.randn(n, h)
    A, D, dt_bias = -torch.rand(h) * 4, torch.randn(h), torch.randn(h)
    B, C, state = torch.randn(n, groups, d), torch.randn(n, groups, d), torch.randn(h, p, d)
    y, final = ssd.chunk_scan(x, dt, A, B, C, D, dt_bias, 16, state)
    y_ref, final_ref = ref.mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], 16, D=D, dt_bias=dt_bias,
                                             initial_states=state[None], dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(y, y_ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_ref[0], atol=1e-4, rtol=1e-4)
    # one decode step for a batch of 3 sequences
    s0 = torch.randn(3, h, p, d)
    xb, dtb, Bb, Cb = torch.randn(3, h, p), torch.randn(3, h), torch.randn(3, groups, d), torch.randn(3, groups, d)
    yb, new = ssd.state_update(s0.clone(), xb, dtb, A, Bb, Cb, D, dt_bias)
    s_ref = s0.clone()
    yb_ref = ref.mamba2_selective_state_update(
        s_ref, xb, dtb[..., None].expand(-1, -1, p), A[:, None, None].expand(-1, p, d), Bb, Cb,
        D[:, None].expand(-1, p), dt_bias=dt_bias[:, None].expand(-1, p), dt_softplus=True)
    torch.testing.assert_close(yb, yb_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new, s_ref, atol=1e-4, rtol=1e-4)


def test_state_slots_and_pool_capacity():
    from consort_engine.kv.state_pool import StateSlots, as_index, seqs_per_pool
    slots = StateSlots(4)
    taken = [slots.take() for _ in range(3)]
    assert taken == [0, 1, 2]
    slots.give(1)
    assert slots.take() == 1 and slots.num_free == 1      # lowest first: batches stay consecutive
    with pytest.raises(AssertionError):
        slots.give(3)                                       # never taken: a double free
    assert as_index([3, 4, 5], torch.device("cpu")) == slice(3, 6)
    assert as_index([3, 5], torch.device("cpu")).tolist() == [3, 5]
    # 2048 tokens in blocks of 16: 128 blocks of 4 KiB + 100 KiB of state per sequence
    assert seqs_per_pool(64 << 20, 2048, 16, 4096, 100 << 10) == (64 << 20) // (128 * 4096 + (100 << 10))
    assert seqs_per_pool(64 << 20, 2048, 16, 4096, 0) == 128


def test_state_rows_fit_the_budget():
    """Slots and checkpoint rows (a quarter of the slots by default) within a budget of bytes."""
    from consort_engine.kv.state_pool import state_rows
    assert state_rows(128, None, 100, 1 << 30) == (128, 32)          # everything fits
    assert state_rows(128, None, 100, 100 * 160 - 1) == (127, 31)     # one row short: 127 + 31 = 158 rows
    assert state_rows(128, None, 100, 100 * 10) == (8, 2)
    assert state_rows(128, 0, 100, 100 * 10) == (10, 0)               # no prefix caching: slots only
    assert state_rows(128, 5, 100, 100 * 10) == (5, 5)                # checkpoint rows as set
    assert state_rows(4, None, 100, 100 * 1000) == (4, 1)
    assert state_rows(128, None, 100, 199) == (0, 0)                  # one slot and its row need 200
    assert state_rows(128, 5, 100, 599) == (0, 0)


def test_hybrid_state_pools_fit_the_memory(tmp_path, monkeypatch, caplog):
    """max_num_seqs slots that do not fit in half the pools' memory shrink to what fits: the engine then
    runs that many sequences at once, and its tokens equal an engine with every slot; when not one slot
    fits, the engine says so at start."""
    from consort_engine.model import model_runner

    ckpt = make_checkpoint("bamba", tmp_path)
    prompts, max_tokens = workload(512)
    config = EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=8, num_blocks=1024)
    full = LLMEngine(config)
    per_row = full.runner.hybrid_state.bytes_per_seq
    reserve = full.runner._memory_budget()[1]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    expected = full.generate(prompts, params)
    assert full.runner.hybrid_state.conv.shape[0] == 8 and full.config.max_num_seqs == 8

    # half of the fraction of what the reserve leaves = 4.5 rows: 3 slots + 1 checkpoint row fit, 4 + 1 do not
    monkeypatch.setattr(model_runner, "mem_available",
                        lambda device: reserve + int(9 * per_row / config.kv_memory_fraction) + 1)
    caplog.set_level("WARNING", logger="consort.engine")
    small = LLMEngine(config)
    assert small.runner.hybrid_state.conv.shape[0] == small.runner.hybrid_state.ssm.shape[0] == 3
    assert small.runner.num_checkpoints == 1 and small.block_manager.state_slots.num_slots == 3
    assert small.config.max_num_seqs == 3 and config.max_num_seqs == 8
    assert "at most 3 sequences run at once, not max_num_seqs 8" in caplog.text
    seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
    small.warmup()
    for s in seqs:
        small.add_request(s)
    most = 0
    while any(not s.is_finished for s in seqs):
        small.step()
        most = max(most, len(small.scheduler.running))
    assert most == 3
    assert [s.output_token_ids for s in seqs] == expected
    stats = small.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"] and small.block_manager.state_slots.num_free == 3

    monkeypatch.setattr(model_runner, "mem_available",
                        lambda device: reserve + int(3 * per_row / config.kv_memory_fraction))
    with pytest.raises(RuntimeError, match="no memory for one sequence's hybrid state"):
        LLMEngine(config)


def test_hybrid_tensor_parallelism_is_a_typed_error(tmp_path):
    """Tensor parallelism fails before any rank starts (adapters on hybrids: test_engine_lora.py)."""
    ckpt = make_checkpoint("bamba", tmp_path)
    with pytest.raises(ValueError, match="tensor parallelism is not supported for bamba"):
        LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", tensor_parallel_size=2, num_blocks=64))
