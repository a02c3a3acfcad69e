"""The whole engine (scheduler + block manager + ModelRunner + Sampler) vs transformers.

16 concurrent mixed-length greedy requests on tiny random checkpoints written by transformers,
under three kinds of pressure: (a) a pool small enough to force preemption (recompute), (b) shared
prefixes that hit the prefix cache, (c) chunked prefill of a long prompt under a small token budget.
Greedy tokens must match transformers'; at a divergence each side's token must be in the other's
top-5 logprobs (vLLM's check_logprobs_close), and at most one request may part from transformers,
at a near-tie (fidelity_helpers: the near-tie rule).
"""
from __future__ import annotations

import random

import pytest
import torch
from fidelity_helpers import Reference, assert_greedy_matches, check_logprobs_close, hf_greedy, make_checkpoint

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams, Sequence

N = 16
SHARED = 40          # tokens of the common prefix (10 blocks of 4)
LONG = 300           # the long prompt of case (c)

CASES = {
    #            pool blocks, token budget
    "preempt": dict(num_blocks=110, max_num_batched_tokens=512),
    "prefix": dict(num_blocks=1024, max_num_batched_tokens=512),
    "chunked": dict(num_blocks=1024, max_num_batched_tokens=48),
}


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(SHARED)]
    prompts, max_tokens = [], []
    for i in range(N):
        if i == 0:
            p = [rng.randrange(3, vocab) for _ in range(LONG)]
        else:
            tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 70))]
            p = shared + tail if i % 2 else tail
        prompts.append(p)
        max_tokens.append(rng.randrange(6, 20))
    return prompts, max_tokens


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_and_reference(request, tmp_path_factory):
    ckpt = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    prompts, max_tokens = workload(512)
    return request.param, ckpt, prompts, max_tokens, hf_greedy(ckpt, prompts, max_tokens)


def run_engine(ckpt, prompts, max_tokens, case: str):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, **CASES[case]))
    engine.warmup()
    chunks: dict[int, list[tuple[int, bool]]] = {}
    execute = engine.runner.execute

    def spy(batch):
        for s, n, smp in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            chunks.setdefault(s.seq_id, []).append((n, smp))
        return execute(batch)
    engine.runner.execute = spy

    if case == "prefix":     # a first request fills the cache with the shared prefix
        engine.generate([prompts[1][:SHARED + 4]], SamplingParams(temperature=0.0, max_tokens=2))
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5))
            for p, m in zip(prompts, max_tokens)]
    for s in seqs:
        engine.validate(s)
        engine.scheduler.add(s)
    while any(not s.is_finished for s in seqs):
        engine.step()
    return engine, seqs, chunks


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_matches_transformers(model_and_reference, case):
    arch, ckpt, prompts, max_tokens, refs = model_and_reference
    engine, seqs, chunks = run_engine(ckpt, prompts, max_tokens, case)
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], "every block is released at the end"
    if case == "preempt":
        assert stats["num_preemptions"] > 0
    if case == "prefix":
        assert stats["prefix_cache_hits"] > 0
        cached = [s.num_cached_tokens for s in seqs[1::2]]
        assert max(cached) >= SHARED - SHARED % 4, cached
    if case == "chunked":
        long_chunks = chunks[seqs[0].seq_id]
        assert sum(1 for n, smp in long_chunks if not smp) >= LONG // 48 - 1, long_chunks
        assert max(n for n, _ in long_chunks) <= 48

    for i, (s, ref) in enumerate(zip(seqs, refs)):
        assert s.finish_reason == "length" and len(s.output_token_ids) == max_tokens[i]
        assert len(s.output_logprobs) == max_tokens[i]
        top = [lp["top"] for lp in s.output_logprobs]
        assert all(lp["token_id"] == t for lp, t in zip(s.output_logprobs, s.output_token_ids))
        check_logprobs_close(ref, s.output_token_ids, top, name=f"{arch}/{case} request {i}")
    assert_greedy_matches(refs, [s.output_token_ids for s in seqs], name=f"{arch}/{case}")


@pytest.mark.parametrize("case", ["preempt", "chunked"])
def test_speculative_greedy_matches_transformers(model_and_reference, case):
    """n-gram speculation (verify windows of 1 + 3 rows through the paged kernel, rollback of
    rejected drafts) under pool pressure and chunking: the same greedy tokens as transformers."""
    arch, ckpt, prompts, max_tokens, refs = model_and_reference
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, speculative="ngram",
                                    num_speculative_tokens=3, spec_policy="always", **CASES[case]))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"], "every block is released at the end"
    spec = stats["speculation"]
    assert spec["state"] == "on" and spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0, spec
    assert [len(out) for out in outs] == max_tokens
    assert_greedy_matches(refs, outs, name=f"{arch}/{case} speculative")


@torch.no_grad()
def test_penalized_greedy_matches_transformers_generate(tmp_path):
    """repetition_penalty + logit_bias through the whole engine (batched with plain requests, under
    pool pressure, speculation on: penalized requests never draft) equal transformers' generate with
    the same processors (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)."""
    from fidelity_helpers import hf_model

    ckpt = make_checkpoint("llama", tmp_path)
    prompts, max_tokens = workload(512)
    bias = {17: 4.0, 99: -100.0}
    model = hf_model(ckpt)
    refs = []
    for p, m in zip(prompts, max_tokens):
        out = model.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=0,
                             repetition_penalty=1.5, sequence_bias={(t,): b for t, b in bias.items()},
                             output_scores=True, return_dict_in_generate=True)
        refs.append(Reference(p, out.sequences[0, len(p):].tolist(), [], [row[0] for row in out.scores]))
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, speculative="ngram",
                                    num_speculative_tokens=3, spec_policy="always", **CASES["preempt"]))
    penalized = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, repetition_penalty=1.5, logit_bias=bias)
                 for m in max_tokens]
    plain = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = engine.generate(prompts + prompts, penalized + plain)
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    assert_greedy_matches(refs, outs[:N], name="penalized")     # the processed scores decide the near-ties
    assert all(99 not in out for out in outs[:N])
    assert sum(out != ref.tokens for out, ref in zip(outs[N:], refs)) >= N // 2, "the penalty changed nothing"
