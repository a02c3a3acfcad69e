"""When to look again: the probe policy, the next self-wake, the retry delay. Pure.

A pass runs when something it reads changed (a watch event on the object, its pods, its Deployment,
a selecting EnsembleRouter) or when a timer it asked for is due. It asks for one only for what
Kubernetes gives no event about:
  - engines it can probe (their /ready, hot-loaded adapters, SLO and speculation reports change
    without an event): every poll_seconds while a replica is cold, every min(10 s, idle) settled;
  - the warmup timeout of a cold replica, and the end of an adapter's probation window;
  - the resync of the children (handled beside it: children.resync_in).
Everything else is event-driven: a pass that finds nothing to change writes nothing and sets no timer.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Iterable

from .common import parse_time
from .warmup import PodObs, ProbeResult, WarmSignal

RETRY_CAP_SECONDS = 60.0
CONFLICT_RETRY_SECONDS = 0.2


@dataclass(frozen=True)
class Pacing:
    """The warm-signal policy and the poll intervals (flags)."""

    warm_signal: WarmSignal = "engine-or-pod-ready"
    poll_seconds: float = 2.0       # while some replica is cold (engines give no Kubernetes events)
    idle_seconds: float = 30.0      # settled


def probes_wanted(warm_signal: WarmSignal, has_adapters: bool) -> bool:
    """Whether to ask the engines at all. Under the pod-ready warm signal only where adapters are
    listed: a hot-load does not show in pod readiness, and routing to an adapter before it is loaded
    fails."""
    return warm_signal != "pod-ready" or has_adapters


def probe_targets(pods: Iterable[dict[str, Any]]) -> list[str]:
    """Names of the pods worth probing (Kopf's pod index entries): every one not terminating."""
    return [p["name"] for p in pods if not p["deleting"]]


def requeue_seconds(pacing: Pacing, probes: dict[str, ProbeResult], settled: bool, deadlines: Iterable[float]
                    ) -> float | None:
    """Seconds until the next pass it must run without an event (None: wait for one). `probes` holds
    only the replicas that had an address to probe; `deadlines` are seconds until time-based
    transitions (a warmup timeout, a probation window's end)."""
    waits = [d for d in deadlines if d >= 0]
    if probes:
        waits.append(max(pacing.poll_seconds, min(10.0, pacing.idle_seconds)) if settled else pacing.poll_seconds)
    return min(waits) if waits else None


def next_pass(requeue: float | None, conflicts: bool, idle_seconds: float) -> float | None:
    """The decision's timer; a child refused as someone else's is looked at again every idle period
    (its owner may delete it, and an object without the operator's label sends it no event)."""
    if conflicts:
        return idle_seconds if requeue is None else min(requeue, idle_seconds)
    return requeue


def deadlines(pods: Iterable[PodObs], warm: set[str], warmup_timeout: float, adapters: list[dict[str, Any]] | None,
              probation_window: float, now: datetime) -> list[float]:
    """Seconds until a cold replica's warmup times out and until a Probation adapter's window ends
    (a little after, so that the pass that runs then sees it over)."""
    out = []
    for p in pods:
        if p.started_at is not None and not p.deleting and p.name not in warm:
            out.append((p.started_at + timedelta(seconds=warmup_timeout) - now).total_seconds() + 0.5)
    for a in adapters or []:
        since = parse_time(a.get("since"))
        if a.get("state") == "Probation" and since is not None:
            out.append((since + timedelta(seconds=probation_window) - now).total_seconds() + 0.5)
    return out


def retry_delay(retry: int, conflict: bool) -> float:
    """Kopf's delay before it runs a failed daemon again: exponential from 0.5 s, capped; a write
    conflict (409: the object moved under the pass) is retried at once, on the fresh object."""
    if conflict:
        return CONFLICT_RETRY_SECONDS
    return min(RETRY_CAP_SECONDS, 0.5 * 2 ** min(retry, 7))
