"""Scale to zero: when an idle Specialist goes to zero replicas, and how a scaled-to-zero one reads. Pure.

Who writes `spec.replicas` (the /scale subresource): the user, an HPA or KEDA while the Specialist
serves; the operator only the step to 0 (every replica idle for `scaleToZero.idleAfter`); a router
only the step from 0 to 1 (a request arrived for a lane with no warm replica; consort_router/activator.py).
An HPA leaves a target at 0 replicas alone, so the three never write the same transition.

"Idle" comes from the engines themselves: each reports `idle_s` in /v1/status (seconds since its last
generation request ended, or since it started; 0 while one is in flight), which the operator's probes
read every pass. No write per request anywhere; a replica that restarts counts as fresh.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..api.specialist import ScaleToZero
from .common import Event, set_condition


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int | None              # write spec.replicas through /scale; None: leave it to its owner
    idle: bool                        # scaled to zero: phase Idle
    recheck_seconds: float | None     # look again no later than this (the idle window ends then)
    message: str


KEEP = ScaleDecision(None, False, None, "")


def least_idle_seconds(reports: Iterable[float | None]) -> float | None:
    """The replicas' shortest idle time: the Specialist is as idle as its busiest replica. None when
    there is no replica, or one gave no figure (unreachable, older engine): then nobody knows."""
    values = list(reports)
    if not values or any(v is None for v in values):
        return None
    return min(v for v in values if v is not None)


def decide(policy: ScaleToZero | None, replicas: int, live: int, warm: int, idle_seconds: float | None) -> ScaleDecision:
    """(scaleToZero, spec.replicas, live pods, warm pods, least idle seconds) -> what to do.

    Scales to zero only a settled Specialist: every desired replica exists and is warm (a replica
    still warming reports idle since its start, and killing it would waste the warmup), and every
    one of them has been idle for the whole window."""
    if policy is None:
        return KEEP
    window = policy.idle_after_seconds
    if replicas == 0:
        return ScaleDecision(None, True, None,
                             f"scaled to zero after {policy.idle_after} without requests; the next request starts a replica")
    if live != replicas or warm < replicas or idle_seconds is None:
        return KEEP
    if idle_seconds >= window:
        return ScaleDecision(0, False, None,
                             f"every replica idle for {idle_seconds:.0f} s (idleAfter {policy.idle_after}): scaling to zero")
    return ScaleDecision(None, False, window - idle_seconds, "")


# What warmup says about replicas going away; expected while scaling to zero, so not posted then.
WARMUP_REASONS = frozenset({"Pending", "Warming", "Ready", "Degraded", "Failed", "ReplicaCold"})


def idle_status(status: dict[str, Any], warmup_events: list[Event], decision: ScaleDecision, now: datetime,
                generation: int | None, prev_phase: str | None) -> tuple[dict[str, Any], list[Event]]:
    """A scaled-to-zero Specialist reads Idle and Ready: it serves (a request starts a replica), so
    neither Argo CD nor an EnsembleRouter should count it as progressing or degraded. Returns the
    status and the events to post (warmup's, less its phase events while idle, plus ours)."""
    events = warmup_events + ([Event("Normal", "ScaledToZero", decision.message)] if decision.replicas == 0 else [])
    if not decision.idle:
        return status, events
    conds = set_condition(status.get("conditions"), "Ready", True, "ScaledToZero", decision.message, now, generation)
    conds = set_condition(conds, "Warm", True, "ScaledToZero", "0/0 replicas warm", now, generation)
    events = [e for e in events if e.reason not in WARMUP_REASONS]
    if prev_phase != "Idle":
        events.append(Event("Normal", "Idle", decision.message))
    return {**status, "phase": "Idle", "conditions": conds}, events
