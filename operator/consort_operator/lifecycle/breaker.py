"""Breaker demotion, made durable and visible.

The router decides trips inline (consort_router.breaker) and persists its states in its
EnsembleRouter's `status.breakerState` ({"version": 1, "breakers": {specialist: state}}). This pure
function mirrors one specialist's entry into its Specialist status (`breaker`, condition `Demoted`)
and emits an Event per transition.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .common import Event, rfc3339, set_condition

STATES = {"closed": "Closed", "open": "Open", "half_open": "HalfOpen"}


def from_router(entry: dict[str, Any] | None, fallback: str | None) -> dict[str, Any] | None:
    """One router breaker entry (BreakerState.to_dict()) -> Specialist status.breaker."""
    if not entry:
        return None
    samples = list(entry.get("samples") or [])
    out: dict[str, Any] = {"state": STATES.get(str(entry.get("state")), "Closed"), "samples": len(samples)}
    if samples:
        out["rate"] = round(sum(float(x) for x in samples) / len(samples), 4)
    since = entry.get("since")
    if isinstance(since, (int, float)) and since > 0:
        out["since"] = rfc3339(datetime.fromtimestamp(since, tz=timezone.utc))
    if fallback:
        out["fallback"] = fallback
    return out


def evaluate(name: str, fallback: str | None, router_states: list[dict[str, Any]],
             prev_breaker: dict[str, Any] | None, conditions: list[dict[str, Any]] | None,
             now: datetime, generation: int | None) -> tuple[dict[str, Any], list[dict[str, Any]], list[Event]]:
    """router_states: the `status.breakerState` of every EnsembleRouter selecting this Specialist.
    The most severe state wins (Open > HalfOpen > Closed) when several routers front it."""
    candidates = []
    for st in router_states:
        entry = ((st or {}).get("breakers") or {}).get(name)
        mirrored = from_router(entry, fallback)
        if mirrored:
            candidates.append(mirrored)
    severity = {"Closed": 0, "HalfOpen": 1, "Open": 2}
    breaker = max(candidates, key=lambda b: severity[b["state"]]) if candidates else {"state": "Closed", "samples": 0}
    if fallback and "fallback" not in breaker:
        breaker["fallback"] = fallback
    events: list[Event] = []
    before = (prev_breaker or {}).get("state", "Closed")
    if breaker["state"] != before:
        rate = breaker.get("rate")
        detail = f"rate {rate:.3f} over {breaker['samples']} samples" if rate is not None else "no samples"
        if breaker["state"] == "Open":
            events.append(Event("Warning", "Demoted", f"breaker open ({detail}): shadow-only, "
                                f"{'fallback ' + fallback + ' takes primary traffic' if fallback else 'no fallback configured'}"))
        elif breaker["state"] == "HalfOpen":
            events.append(Event("Normal", "Recovering", f"breaker half-open ({detail}): primary again, heavily shadowed"))
        else:
            events.append(Event("Normal", "Restored", f"breaker closed ({detail})"))
    demoted = breaker["state"] == "Open"
    conditions = set_condition(conditions, "Demoted", demoted, "BreakerOpen" if demoted else (
        "BreakerHalfOpen" if breaker["state"] == "HalfOpen" else "BreakerClosed"),
        f"breaker {breaker['state']}" + (f", fallback {fallback}" if demoted and fallback else ""), now, generation)
    return breaker, conditions, events
