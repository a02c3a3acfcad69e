"""The speculation policy: draft lengths that maximise a step's expected tokens per second
(draft_plan.plan_drafts) under a measured step cost (step_cost.StepCost), and the scheduler's use of
it: a sequence whose drafts keep failing stops drafting where rows cost, and starts again when its
n-gram drafts (checked for free against what it emits) would have stood."""
from __future__ import annotations

import itertools
import random

import pytest
from engine_fakes import make_scheduler, make_seq

from consort_engine.spec.draft_plan import acceptance_rate, plan_drafts, probe_interval
from consort_engine.spec.step_cost import StepCost


def goodput(acceptance: list[float], ks: tuple[int, ...], num_decodes: int, cost: StepCost) -> float:
    decode_s, draft_s = cost.at(num_decodes)
    tokens = num_decodes + sum(a ** j for a, k in zip(acceptance, ks) for j in range(1, k + 1))
    return tokens / (decode_s + draft_s * sum(ks))


def test_step_cost_is_linear_between_points_and_extrapolates_beyond_the_last():
    cost = StepCost(seqs=(1, 4, 16), decode_s=(0.010, 0.016, 0.040), draft_s=(0.0005, 0.001, 0.002))
    assert cost.at(1) == (0.010, 0.0005)
    assert cost.at(10) == pytest.approx((0.028, 0.0015))
    assert cost.at(16) == pytest.approx((0.040, 0.002))
    assert cost.at(32) == pytest.approx((0.040 + 16 * 0.002, 0.002))    # last segment's slope, last draft cost
    assert StepCost((1,), (0.01,), (0.001,)).at(8) == pytest.approx((0.08, 0.001))


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_the_best_of_every_choice(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 4), rng.randint(1, 3)
    acceptance = [rng.choice([0.0, 0.1, 0.5, 0.8, 0.95, 1.0, rng.random()]) for _ in range(n)]
    decodes = n + rng.randint(0, 60)
    cost = StepCost((1, 64), (rng.uniform(0.005, 0.02), rng.uniform(0.02, 0.2)),
                    (rng.uniform(0.0, 0.002), rng.uniform(0.0005, 0.004)))
    plan = plan_drafts(acceptance, k, decodes, cost)
    assert len(plan) == n and all(0 <= d <= k for d in plan)
    best = max(goodput(acceptance, ks, decodes, cost) for ks in itertools.product(range(k + 1), repeat=n))
    assert goodput(acceptance, tuple(plan), decodes, cost) == pytest.approx(best, rel=1e-9)


def test_rows_that_cost_little_are_drafted_and_rows_that_cost_a_decode_only_for_sure_drafts():
    weight_bound = StepCost((1, 64), (0.010, 0.012), (0.00005, 0.00005))    # reading weights: rows nearly free
    # 64 decodes: 16 ms of weight reads and 1 ms a row, a draft row as dear as a decode row
    compute_bound = StepCost((1, 64), (0.010, 0.080), (0.001, 0.001))
    assert plan_drafts([0.3, 0.9], 3, 2, weight_bound) == [3, 3]
    assert plan_drafts([0.3, 0.5, 0.9, 0.99], 3, 64, compute_bound) == [0, 0, 2, 3]
    assert plan_drafts([0.2] * 8, 3, 64, compute_bound) == [0] * 8
    assert plan_drafts([0.2, 0.2], 4, 2, StepCost((1,), (0.01,), (0.0,))) == [4, 4]     # measured free


def test_higher_acceptance_never_drafts_less():
    cost = StepCost((1, 8, 64), (0.01, 0.015, 0.07), (0.0002, 0.0008, 0.001))
    rates = [i / 20 for i in range(21)]
    for n in (1, 8, 40, 64, 200):
        plan = plan_drafts(rates, 4, n, cost)
        assert plan == sorted(plan), (n, plan)
    assert plan_drafts(rates, 4, 1, cost)[-1] == 4 and plan_drafts(rates, 4, 200, cost)[0] == 0


def test_acceptance_estimate_leans_on_the_prior_until_the_sequence_has_its_own_counts():
    assert acceptance_rate(0.0, 0.0, 0.7, 2.0) == pytest.approx(0.7)
    assert acceptance_rate(0.0, 2.0, 0.7, 2.0) == pytest.approx(0.35)
    assert acceptance_rate(50.0, 50.0, 0.1, 2.0) > 0.95


def test_a_sequence_stops_drafting_where_its_drafts_fail_and_starts_again_when_they_would_stand():
    sched = make_scheduler(num_blocks=64, speculative="ngram", num_speculative_tokens=3)
    sched.spec.cost = StepCost((1, 64), (0.010, 0.080), (0.004, 0.004))   # drafts dear: they must be likely
    seq = make_seq(8, max_tokens=200)
    seq.token_ids = [1, 2, 3, 4, 1, 2, 3, 4]; seq.prompt_token_ids = list(seq.token_ids)
    sched.add(seq)
    sched.postprocess(sched.schedule(), [1])             # prefill emits 1: "1" was followed by "2 3 4"
    drafted, shadows = [], []
    for i in range(8):                                   # the model never emits what the lookup proposes
        batch = sched.schedule()
        drafted.append(batch.num_draft[0] if batch.num_draft else 0)
        shadows.append(seq.shadow_draft)
        miss = (seq.shadow_draft + 1) % 5 if seq.shadow_draft >= 0 else 1
        sched.postprocess(batch, [miss] * batch.rows_sampled(0))
    # the engine's prior (0.7) at one decode: drafting pays; one failed window at the prior stops it
    assert drafted[0] >= 1 and drafted[1:] == [0] * 7, drafted
    assert shadows[0] == -1 and any(s >= 0 for s in shadows[1:])      # watched, not drafted
    assert sched.spec.num_draft_tokens == drafted[0] and sched.spec.num_drafts == 1
    assert sched.spec.num_held_decodes == 7
    # Now the model copies what the n-gram lookup proposes: the free checks raise the estimate.
    for _ in range(40):
        batch = sched.schedule()
        k = batch.num_draft[0] if batch.num_draft else 0
        if k:
            break
        assert seq.shadow_draft >= 0
        sched.postprocess(batch, [seq.shadow_draft])
    assert k > 0, "a sequence whose drafts would stand drafts again"
    sched.postprocess(batch, list(seq.token_ids[-k:]) + [5])        # and its window is accepted whole
    assert sched.spec.num_accepted_tokens == k
    sched.block_manager.check_invariants([s for s in sched.running])


def test_policy_always_and_no_measured_cost_draft_up_to_k():
    for cfg, cost in (({"spec_policy": "always"}, StepCost((1,), (0.01,), (1.0,))), ({}, None)):
        sched = make_scheduler(num_blocks=64, speculative="ngram", num_speculative_tokens=3, **cfg)
        sched.spec.cost = cost
        seq = make_seq(8, max_tokens=50)
        seq.token_ids = [1, 2, 3, 4, 1, 2, 3, 4]; seq.prompt_token_ids = list(seq.token_ids)
        sched.add(seq)
        sched.postprocess(sched.schedule(), [1])
        seq.draft_hits, seq.draft_tries = 0.0, 100.0                # every draft so far failed
        assert sched.schedule().num_draft == [3]


def test_probes_grow_rarer_as_a_held_sequences_drafts_look_worse():
    assert probe_interval(1.0, 16, 256) == 16 and probe_interval(0.5, 16, 256) == 32
    assert probe_interval(0.01, 16, 256) == probe_interval(0.0, 16, 256) == 256


def test_an_mtp_sequence_held_from_drafting_probes_rarely_once_its_probes_fail():
    sched = make_scheduler(num_blocks=256, speculative="ngram", num_speculative_tokens=3)
    sched.spec.drafter = "mtp"          # placeholders only: what is drafted comes from the block
    sched.spec.cost = StepCost((1, 64), (0.010, 0.080), (0.004, 0.004))
    seq = make_seq(8, max_tokens=1000)
    seq.mtp_hidden = object()           # a kept hidden row: propose reserves MTP placeholders
    sched.add(seq)
    sched.postprocess(sched.schedule(), [1])
    probes = []
    for step in range(400):
        batch = sched.schedule()
        k = batch.num_draft[0] if batch.num_draft else 0
        if k:
            probes.append(step)
        other = 3 if seq.token_ids[-1 - k] == 2 else 2               # never the placeholder (the last token)
        sched.postprocess(batch, [other] * batch.rows_sampled(0))
        seq.mtp_hidden = object()
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and probes[0] <= 1 and len(probes) <= 8, probes
    assert gaps == sorted(gaps) and gaps[-1] > 100, gaps          # every failed probe pushes the next out
