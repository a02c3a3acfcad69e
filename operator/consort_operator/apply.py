"""Apply a decision: write only the children lifecycle/children.py says, the status merge patch when
it is not empty, the decision's events. The one place the daemons write to the apiserver."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any, Callable

import kopf
from .lifecycle import children as children_lc
from .lifecycle import ownership as ownership_lc
from .lifecycle import pacing as pacing_lc
from .lifecycle import status as status_lc
from .lifecycle.common import Event
from .lifecycle.specialist import Decision
from .metrics import APPLIES, EVENTS, RECONCILES, STATUS_WRITES, WAKEUPS_UNCHANGED
from .observe import first
from .runtime import ObjectState, Runtime


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


async def ensure_children(rt: Runtime, body: Any, children: list[dict[str, Any]], owned: children_lc.Owned,
                          deployments: Any, parent_status: dict[str, Any]) -> tuple[list[Event], list[ownership_lc.Conflict]]:
    """Read and write only what lifecycle/children.py says; conflicts (someone else's objects) returned."""
    written: list[tuple[dict[str, Any], children_lc.Action]] = []
    conflicts: list[ownership_lc.Conflict] = []
    resync = children_lc.resync_due(owned, time.monotonic(), rt.resync_seconds)
    for child in children:
        key, meta = children_lc.key_of(child), child["metadata"]
        if children_lc.known_current(child, owned, first(deployments.get((meta["namespace"], meta["name"]))), resync):
            owned.record(key, children_lc.wanted_hash(child))
            continue
        if children_lc.create_first(child, owned, parent_status):
            created = await rt.client().apply_new(child)
            if created is not None:
                APPLIES.labels(child["kind"]).inc()
                owned.record(key, children_lc.wanted_hash(child), int(created.get("metadata", {}).get("generation") or 0))
                written.append((child, "create"))
                continue
        live = await rt.client().get(child["kind"], meta["namespace"], meta["name"])
        what = children_lc.action(child, live, owned, body["metadata"]["uid"])
        if isinstance(what, ownership_lc.Conflict):
            owned.hashes.pop(key, None)    # re-checked on the next pass
            conflicts.append(what)
        elif what == "keep":
            owned.record(key, children_lc.wanted_hash(child), (live.get("metadata") or {}).get("generation"))
        else:
            result = await rt.client().apply(child)
            APPLIES.labels(child["kind"]).inc()
            owned.record(key, children_lc.wanted_hash(child), int(result.get("metadata", {}).get("generation") or 0))
            written.append((child, what))
    if resync:
        owned.last_resync = time.monotonic()
    return children_lc.written_events(written), conflicts


async def apply_decision(rt: Runtime, kind: str, body: Any, state: ObjectState, prev: dict[str, Any],
                         decision: Decision, deployment_index: Any) -> tuple[dict[str, Any], list[ownership_lc.Conflict]]:
    """Children (only what changed), then status (merge patch of what changed), then events.
    Returns the status the object holds afterwards and the children refused (someone else's)."""
    events, conflicts = await ensure_children(rt, body, decision.children, state.owned, deployment_index, prev)
    meta = body["metadata"]
    status = decision.status
    if decision.children:   # no children decided (invalid spec): ownership was not looked at
        conds, ev = ownership_lc.ownership_condition(status.get("conditions"), conflicts, kind, now_utc(),
                                                     meta.get("generation"))
        status, events = {**status, "conditions": conds}, events + ev
    patch = status_lc.merge_patch(prev, status, status_lc.STATUS_KEYS[kind])
    after = status_lc.patched(prev, patch)
    if patch:
        await rt.client().patch_status(kind, meta["namespace"], meta["name"], patch)
        STATUS_WRITES.labels(kind).inc()
        state.written = (meta.get("resourceVersion"), after)
    if kind == "Specialist":   # the consort_operator_specialists{phase} gauge
        rt.set_phase((meta["namespace"], meta["name"]), decision.phase)
    for e in events + decision.events:
        EVENTS.labels(kind, e.reason).inc()
        kopf.event(body, type=e.type, reason=e.reason, message=e.message)
    if decision.scale_to is not None:   # scale to zero (lifecycle/scaling.py), through /scale like an HPA
        await rt.client().scale(kind, meta["namespace"], meta["name"], decision.scale_to,
                                int((body.get("spec") or {}).get("replicas", 1)))
    return after, conflicts


async def decide_and_apply(rt: Runtime, kind: str, body: Any, state: ObjectState, due: bool, inputs: Any,
                           decide: Callable[[dict[str, Any]], Decision], deployment_index: Any,
                           echo: Callable[[Any], Any] = lambda inputs: inputs) -> None:
    """The pass proper, unless nothing it decides from changed and no timer is due. `echo`: the
    inputs as the watch will show them after this pass's own child writes."""
    prev = state.prev_status(body)
    if not due and state.inputs == (inputs, prev):
        WAKEUPS_UNCHANGED.labels(kind).inc()
        return
    decision = decide(prev)
    after, conflicts = await apply_decision(rt, kind, body, state, prev, decision, deployment_index)
    RECONCILES.labels(kind, "ok").inc()
    state.inputs = (echo(inputs), after)
    wait = pacing_lc.next_pass(decision.requeue_seconds, bool(conflicts), rt.idle_seconds)
    state.deadline = None if wait is None else time.monotonic() + wait


