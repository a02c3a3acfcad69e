"""When drafting pays: per-sequence draft lengths that maximise a step's expected tokens per second.

A verify window turns k drafts into 1 + a + a^2 + ... + a^k expected tokens (a: the sequence's
per-token acceptance) for k more query rows (and, with the MTP drafter, k passes of its block).
While a step is bound by reading the weights (few sequences) rows are nearly free and every draft
pays; once it is bound by arithmetic (tens of sequences on a CPU, hundreds on a GPU) a draft row
costs about what a decode row costs, and drafts that are likely rejected make the step slower than
the tokens they add. `plan_drafts` picks the draft lengths of one step's decodes that maximise
expected tokens over expected step time under the engine's measured `StepCost`: the j-th draft of
sequence i adds a_i^j expected tokens for one draft's cost, so the best plan takes drafts in order
of a_i^j for as long as each one raises the ratio (vLLM's static `disable_by_batch_size`, computed).

A sequence's acceptance is a decayed count of its own verified drafts over a prior, the engine's
recent acceptance (`acceptance_rate`): a sequence that stops copying its context stops drafting, and
one that starts again is seen by the drafter's free check (spec_decoder: the n-gram proposal of a
non-drafting step compared with the token the step emits; MTP: a one-token probe, rarer the worse
the sequence's drafts have been, `probe_interval`).
"""
from __future__ import annotations

from consort_engine.spec.step_cost import StepCost


def plan_drafts(acceptance: list[float], k: int, num_decodes: int, cost: StepCost) -> list[int]:
    """Draft lengths (0..k) for the drafting candidates among a step's num_decodes decodes, given each
    candidate's per-token acceptance: the set of drafts with the best expected tokens per second."""
    decode_s, draft_s = cost.at(num_decodes)
    if draft_s <= 0.0:                     # drafts measured free: all of them
        return [k] * len(acceptance)
    gains = sorted((a ** j for a in acceptance for j in range(1, k + 1)), reverse=True)
    tokens, seconds, floor = float(num_decodes), decode_s, None
    for g in gains:
        if g * seconds <= draft_s * tokens:    # g / draft_s no better than the plan's tokens / second
            break
        tokens, seconds, floor = tokens + g, seconds + draft_s, g
    if floor is None:
        return [0] * len(acceptance)
    return [sum(1 for j in range(1, k + 1) if a ** j >= floor) for a in acceptance]


def acceptance_rate(hits: float, tries: float, prior: float, weight: float) -> float:
    """A per-token acceptance estimate: decayed counts of verified draft tokens (hits) over the tokens
    tried (a window of k drafts with h accepted tried h + 1, or k when all stood), plus `weight`
    pseudo-tries at `prior`."""
    return (hits + weight * prior) / (tries + weight)


def probe_interval(acceptance: float, every: int, most: int) -> float:
    """Steps between one-token probes of a sequence held from drafting: `every` while its drafts look
    sure, growing as 1 / acceptance to at most `most` (a probe that fails costs a verify row)."""
    return min(most, every / max(acceptance, every / most))
