"""Prompt logprobs (completions `echo` + `logprobs`, vLLM's `prompt_logprobs`) vs transformers.

The engine keeps the logits of every prompt position of the sequences that ask, only theirs, and
reports log_softmax at each position: the prompt token's logprob, its rank and the top-k. They
must equal transformers' log_softmax of the model's logits over the whole prompt, with the prompt
cut into chunks by a small token budget, next to other sequences in the same batches (one asking
for fewer alternatives, others not asking), after the prompt's blocks sit in the prefix cache
(a sequence that asks takes no cached blocks), and for an n-sibling parked behind its twin.
"""
from __future__ import annotations

import random

import pytest
import torch
from fidelity_helpers import NearTies, hf_model, make_checkpoint, rank_bounds

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams, Sequence

K = 5


@torch.no_grad()
def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: transformers' log_softmax at positions 0..P-2 (predicting tokens 1..)."""
    logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(seq: Sequence, ref: torch.Tensor, k: int, name: str) -> None:
    plp = seq.prompt_logprobs
    p = seq.prompt_token_ids
    assert plp is not None and len(plp) == len(p) - 1, f"{name}: {len(plp or [])} of {len(p) - 1} positions"
    want = ref.gather(1, torch.tensor(p[1:], dtype=torch.int64).view(-1, 1)).view(-1)
    torch.testing.assert_close(torch.tensor(plp.logprobs), want, atol=2e-4, rtol=1e-4, msg=name)
    check_ranks(plp.ranks, ref, want, name)
    assert all(len(t) == k for t in plp.top_ids), name
    if not k or not len(plp):
        return
    top_v, _ = ref.topk(k, dim=-1)
    torch.testing.assert_close(torch.tensor(plp.top_logprobs), top_v, atol=2e-4, rtol=1e-4, msg=name)
    # the ids carry those values (ties in a random model are rare; compare values, not order)
    got = ref.gather(1, torch.tensor(plp.top_ids))
    torch.testing.assert_close(got, top_v, atol=2e-4, rtol=1e-4, msg=name)


def check_ranks(ranks: list[int], ref: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Each rank is the reference's, but for near-ties (a vocabulary of 512 near-uniform logits
    deep in the distribution: on another CPU a neighbour within float error may sort either
    side); at most one position in 50 may differ."""
    want_rank = ((ref > want.view(-1, 1)).sum(-1) + 1).tolist()
    ties = NearTies(limit=max(1, len(ranks) // 50))
    for i, (got, exact) in enumerate(zip(ranks, want_rank)):
        if got == exact:
            continue
        lo, hi = rank_bounds(ref[i], float(want[i]))
        assert lo <= got <= hi, f"{name} position {i}: rank {got}, transformers' {exact} (near-ties allow {lo}..{hi})"
        ties.add(f"position {i}: {got} vs {exact}")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    ckpt = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, ckpt, hf_model(ckpt)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for length in (150, 37, 90, 2, 1)[:n]]


def test_prompt_logprobs_match_transformers_chunked_and_batched(model):
    arch, ckpt, hf = model
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, num_blocks=512,
                                    max_num_batched_tokens=32))
    engine.warmup()
    chunked: dict[int, int] = {}
    execute = engine.runner.execute

    def spy(batch):
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            if n > 1:
                chunked[s.seq_id] = chunked.get(s.seq_id, 0) + 1
        mixed.append(len(batch.seqs))
        return execute(batch)
    mixed: list[int] = []
    engine.runner.execute = spy

    ps = prompts(5)
    ks = [K, 2, None, K, 0]           # the third does not ask; the others ask for different widths
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k))
            for p, k in zip(ps, ks)]
    for s in seqs:
        engine.add_request(s)
    first_outputs: dict[int, object] = {}
    while any(not s.is_finished for s in seqs):
        for out in engine.step():
            first_outputs.setdefault(out.seq_id, out)
    assert chunked[seqs[0].seq_id] >= 150 // 32, "the long prompt ran in several chunks"
    assert max(mixed) > 1, "prompts shared batches"
    for s, k in zip(seqs, ks):
        out = first_outputs[s.seq_id]
        if k is None:
            assert s.prompt_logprobs is None and out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs is s.prompt_logprobs, "delivered with the first output"
        check(s, reference(hf, s.prompt_token_ids), k, f"{arch} prompt of {s.num_prompt_tokens}")
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_prompt_logprobs_skip_the_prefix_cache_and_siblings_share_them(model):
    arch, ckpt, hf = model
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, num_blocks=512,
                                    max_num_batched_tokens=64))
    p = prompts(1, seed=9)[0]
    engine.generate([p], SamplingParams(temperature=0.0, max_tokens=2))     # the prompt is now cached
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    twin, sibling = Sequence(list(p), sp), Sequence(list(p), sp)
    engine.add_requests([twin, sibling])
    while engine.has_unfinished():
        engine.step()
    assert twin.num_cached_tokens == 0, "a sequence asking for prompt logprobs takes no cached blocks"
    assert sibling.num_cached_tokens > 0, "its sibling takes the twin's blocks and its prompt logprobs"
    ref = reference(hf, p)
    check(twin, ref, K, f"{arch} twin")
    check(sibling, ref, K, f"{arch} sibling")
    assert twin.output_token_ids == sibling.output_token_ids


def test_prompt_logprobs_survive_a_preemption_mid_prefill(model):
    """A higher-priority arrival preempts a long prompt between chunks: on recompute the positions
    already collected are not collected again, and the rest still equal transformers'."""
    arch, ckpt, hf = model
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, num_blocks=50,
                                    max_num_batched_tokens=32))
    engine.warmup()
    long_p, urgent_p = prompts(1, seed=21)[0], prompts(3, seed=22)[2]
    low = Sequence(list(long_p), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K))
    engine.add_request(low)
    engine.step()
    engine.step()
    collected = len(low.prompt_logprobs)
    assert 0 < collected < len(long_p) - 1, "the long prompt is mid-prefill"
    high = Sequence(list(urgent_p), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), priority=5)
    engine.add_request(high)
    while engine.has_unfinished():
        engine.step()
    assert low.num_preemptions >= 1 and low.num_cached_tokens == 0
    check(low, reference(hf, long_p), K, f"{arch} preempted")


def test_the_rank_check_accepts_a_near_tie_and_refuses_a_wrong_rank(model):
    """The rule above, on the reference itself: a competitor moved one float step past the prompt
    token (another CPU's summation order) changes the reference's rank and is accepted as one
    near-tie; a rank off where no competitor is near, or more near-ties than the bound, fail."""
    arch, _, hf = model
    p = prompts(1)[0]
    ref = reference(hf, p)
    want = ref.gather(1, torch.tensor(p[1:]).view(-1, 1)).view(-1)
    ranks = ((ref > want.view(-1, 1)).sum(-1) + 1).tolist()
    check_ranks(ranks, ref, want, arch)
    # a position whose nearest competitors are well apart from the prompt token (most of them)
    gaps = (ref - want.view(-1, 1)).abs().scatter(1, torch.tensor(p[1:]).view(-1, 1), torch.inf).min(-1).values
    i = int(torch.nonzero(gaps > 1e-3)[0])
    # on "another CPU" the token ranked just below the prompt token comes out one ulp above it
    below = torch.where(ref[i] < want[i], ref[i], torch.tensor(-torch.inf)).argmax()
    bumped = ref.clone()
    bumped[i, below] = torch.nextafter(want[i], torch.tensor(torch.inf))
    check_ranks(ranks, bumped, want, arch)                 # our rank is one better there: a near-tie
    wrong = list(ranks)
    wrong[i] += 1                                          # one off where nothing is near: refused
    with pytest.raises(AssertionError, match=f"position {i}: rank"):
        check_ranks(wrong, ref, want, arch)
    many = torch.stack([bumped[i]] * 60)                   # 60 positions, every one a near-tie: over 1 in 50
    with pytest.raises(AssertionError, match="near-ties"):
        check_ranks([ranks[i]] * 60, many, want[i].repeat(60), arch)
