"""Admission control: admit, or reject with a typed reason and a retry-after from live state.

`decide_admission` is a pure function of (request, queue snapshot, measured step times), so the
policy is unit-testable without an engine. The scheduler builds the snapshot; the engine keeps
the step-time estimates (EWMAs of measured steps).

The three admission conditions of the serving design, and where each is enforced:
(a) room for the prompt + one decode step (+ the draft window): `blocks_needed` against free,
    evictable and preemptible blocks, and the turnover of the running set;
(b) the caller's deadline (`deadline_ms`, due time of the first token) is achievable from the
    queue ahead of it and the measured prefill throughput and step time;
(c) admitting does not push another in-flight request past its own deadline. This holds by
    construction of the scheduler rather than by a check here: a new request queues behind every
    waiter of equal or higher priority, and each step serves running decodes and running prefill
    chunks before it admits anyone, so no request of equal or higher priority is delayed by a
    newcomer. Lower-priority requests are delayed (or preempted) on purpose: that is what priority
    means, and the seed's resolution for a conflict ("preempt a strictly lower-priority request").
    Deadline misses that happen anyway are counted (consort_deadline_requests_total{result="missed"}).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIN_RETRY_MS = 100          # floor: a retry sooner than this only adds load
WARMING_MIN_RETRY_MS = 250


@dataclass(frozen=True)
class Rejection:
    code: str                # kv_capacity | deadline | queue_full | warming
    retry_after_ms: int
    message: str
    permanent: bool = False  # retrying cannot help (the prompt can never fit this pool)


@dataclass(frozen=True)
class AdmissionRequest:
    num_tokens: int              # tokens to prefill
    blocks_needed: int           # blocks for the prompt + the lookahead (decode step, draft window)
    priority: int
    deadline_in_s: float | None  # seconds left until the first token is due; None = no deadline


@dataclass(frozen=True)
class QueueSnapshot:
    num_blocks: int                  # pool size
    free_blocks: int
    num_waiting: int
    max_waiting: int
    tokens_ahead: int                # prefill tokens queued ahead: waiters at >= priority + running prefills
    blocks_ahead: int                # blocks those waiters need
    preemptible_blocks: int          # blocks held by running seqs of strictly lower priority
    running_release: tuple[tuple[int, int], ...] = ()  # (decode steps left at most, blocks held), other running seqs
    warm: bool = True
    warming_elapsed_s: float = 0.0


@dataclass(frozen=True)
class StepEstimates:
    decode_step_s: float = 0.0           # EWMA of a decode step; 0 = not measured yet
    prefill_tokens_per_s: float = 0.0    # EWMA prefill throughput; 0 = not measured yet


def _ms(seconds: float, floor: int = MIN_RETRY_MS) -> int:
    return max(floor, int(math.ceil(seconds * 1000.0)))


def steps_until_blocks_free(deficit: int, running_release: tuple[tuple[int, int], ...]) -> int | None:
    """Decode steps until `deficit` blocks are released by running seqs finishing (shortest
    first); None when even all of them finishing is not enough."""
    if deficit <= 0:
        return 0
    released = 0
    for steps, blocks in sorted(running_release):
        released += blocks
        if released >= deficit:
            return steps
    return None


def steps_until_finishes(count: int, running_release: tuple[tuple[int, int], ...]) -> int:
    """Decode steps until `count` running seqs finish (each finish lets one waiter in).
    Beyond the running set, assume waves of the same length."""
    if not running_release:
        return 1
    steps = sorted(s for s, _ in running_release)
    waves, rest = divmod(count - 1, len(steps))
    return waves * steps[-1] + steps[rest]


def decide_admission(req: AdmissionRequest, q: QueueSnapshot, est: StepEstimates) -> Rejection | None:
    if not q.warm:
        # Warm-up time so far is the best guess of what is left (it only shrinks from here).
        return Rejection("warming", _ms(q.warming_elapsed_s, WARMING_MIN_RETRY_MS), "engine is warming up")
    if req.blocks_needed > q.num_blocks:
        return Rejection("kv_capacity", 0, f"prompt needs {req.blocks_needed} KV blocks, "
                         f"the pool has {q.num_blocks}", permanent=True)
    step_s = est.decode_step_s
    if q.num_waiting >= q.max_waiting:
        excess = q.num_waiting - q.max_waiting + 1
        retry = steps_until_finishes(excess, q.running_release) * step_s
        return Rejection("queue_full", _ms(retry), f"{q.num_waiting} requests waiting (max {q.max_waiting})")

    # Blocks this request waits for: its own plus those of everyone queued ahead of it, minus
    # what is free now and what it could take from lower-priority runners by preemption.
    deficit = req.blocks_needed + q.blocks_ahead - q.free_blocks - q.preemptible_blocks
    block_steps = steps_until_blocks_free(deficit, q.running_release)
    if block_steps is None:
        # Short even after every running request finishes: the rest must come from queued work
        # ahead running through the pool. Up to one more full pool of it is a queue worth
        # waiting in; beyond that the pool is saturated and another replica is the better bet.
        turnover_steps = max((s for s, _ in q.running_release), default=1)
        short = deficit - sum(b for _, b in q.running_release)
        extra_turnovers = short / q.num_blocks
        if extra_turnovers > 1.0:
            retry = turnover_steps * step_s * (extra_turnovers - 1.0)
            return Rejection("kv_capacity", _ms(retry), f"KV pool saturated: {short} blocks short "
                             f"after every running request finishes (pool {q.num_blocks})")
        block_steps = int(turnover_steps * (1.0 + extra_turnovers))

    if req.deadline_in_s is not None:
        if req.deadline_in_s <= 0:
            return Rejection("deadline", MIN_RETRY_MS, "deadline already passed")
        tps = est.prefill_tokens_per_s
        if tps > 0:   # without a measurement yet, admit (optimistic until the first steps)
            queue_s = max(q.tokens_ahead / tps, block_steps * step_s)
            eta = queue_s + req.num_tokens / tps + step_s
            if eta > req.deadline_in_s:
                # The queue ahead drains in real time: after (eta - deadline) it would fit.
                return Rejection("deadline", _ms(eta - req.deadline_in_s),
                                 f"estimated first token in {eta * 1000:.0f} ms, "
                                 f"deadline in {req.deadline_in_s * 1000:.0f} ms")
    return None
