"""The draft policy on the real engine (tiny demo model, in process): warm-up measures the step cost the
plan reads, drafts that never stand stop where rows cost while drafts that stand keep going, and the
greedy output is the same under every policy."""
from __future__ import annotations

import random

import pytest

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams
from consort_engine.spec.step_cost import StepCost

BATCH = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def make_engine(demo_model, speculative: str = "ngram", policy: str = "goodput") -> LLMEngine:
    return LLMEngine(EngineConfig(name="policy", model=str(demo_model), dtype="float32", speculative=speculative,
                                  num_speculative_tokens=3, spec_policy=policy, max_num_seqs=BATCH))


@pytest.fixture(scope="module")
def reference(demo_model):
    rng = random.Random(11)
    engine = make_engine(demo_model, speculative="off")
    vocab = engine.runner.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(20, 60))] for _ in range(BATCH)]
    return prompts, engine.generate(prompts, PARAMS), vocab


def drafter(prompts, outputs, vocab: int, wrong: bool):
    """Proposes each request's own greedy continuation (every draft stands), or that continuation with
    every token changed (no draft stands)."""
    by_prompt = {tuple(p): o for p, o in zip(prompts, outputs)}

    def propose(token_ids: list[int], k: int, **_) -> list[int]:
        for p, out in by_prompt.items():
            if tuple(token_ids[:len(p)]) == p:
                g = len(token_ids) - len(p)
                return [(t + 1) % vocab if wrong else t for t in out[g:g + k]]
        return []
    return propose


def test_warmup_measures_the_step_cost_at_growing_batches(demo_model):
    engine = make_engine(demo_model)
    engine.warmup()
    cost = engine.spec.cost
    assert isinstance(cost, StepCost) and cost.seqs == (1, 2, 4, 8, 16)
    assert all(d > 0 for d in cost.decode_s) and len(cost.draft_s) == 5
    assert engine.stats()["speculation"]["policy"] == "goodput"
    always = make_engine(demo_model, policy="always")
    always.warmup()
    assert always.spec.cost is None and always.stats()["speculation"]["policy"] == "always"


def run(demo_model, reference, policy: str, wrong: bool) -> tuple[list[list[int]], dict]:
    prompts, outputs, vocab = reference
    engine = make_engine(demo_model, policy=policy)
    engine.warmup()
    if policy == "goodput":     # rows as dear as decode rows: a draft must be likely to stand to pay
        engine.spec.cost = StepCost((1, BATCH), (0.002, 0.010), (0.0006, 0.0006))
    engine.spec.propose_ngram = drafter(prompts, outputs, vocab, wrong)
    out = engine.generate(prompts, PARAMS)
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return out, engine.stats()["speculation"]


def test_drafts_that_never_stand_stop_and_drafts_that_stand_go_on(demo_model, reference):
    outputs = reference[1]
    always_out, always = run(demo_model, reference, "always", wrong=True)
    wrong_out, wrong = run(demo_model, reference, "goodput", wrong=True)
    right_out, right = run(demo_model, reference, "goodput", wrong=False)
    always_right = run(demo_model, reference, "always", wrong=False)[1]
    assert always_out == wrong_out == right_out == outputs
    assert always["accepted_tokens"] == wrong["accepted_tokens"] == 0
    # always: 3 drafts a step for every request; goodput: the prior's first window, then nothing
    assert always["draft_tokens"] > 10 * BATCH * 3
    assert wrong["draft_tokens"] <= BATCH * 3, wrong
    assert always["held_decodes"] == 0 and wrong["held_decodes"] > 10 * BATCH
    # drafts that stand: nearly as many as policy always verifies (the prior, 0.7, does not pay at these
    # costs: the first steps only watch, and the free checks raise the estimate)
    assert right["acceptance_rate"] == 1.0 and right["draft_tokens"] >= 0.85 * always_right["draft_tokens"], right
    assert always_right["draft_tokens"] > 400
