"""An EnsembleRouter's whole reconcile decision, pure: (spec, observed, previous status, now) -> Decision.

Observed: the Specialists its selector picks (from Kopf's index) and its router pods. Decided: the
routing ConfigMap and router workload (children), the status (typed, by alias), events. See
specialist.py for the shape; the handler only observes and applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ..api.router import KIND, EnsembleRouterSpec, EnsembleRouterStatus
from ..api.specialist import SpecialistSpec
from ..resources import router as router_res
from ..resources.common import BuildContext, content_hash, owner_reference
from . import admission
from . import credential as credential_lc
from .common import Event, get_condition, set_condition
from .specialist import Decision


@dataclass(frozen=True)
class SelectedSpecialist:
    """One Specialist the selector picks, as Kopf's index holds it."""

    name: str
    spec: dict[str, Any]
    phase: str | None
    warm_replicas: int
    breaker: str
    lane_adapter: str | None


@dataclass(frozen=True)
class RouterObserved:
    name: str
    namespace: str
    uid: str
    generation: int | None
    specialists: tuple[SelectedSpecialist, ...] = ()   # selected, sorted by name
    pods_ready: tuple[bool, ...] = ()                  # one per router pod that is not terminating
    secrets: credential_lc.RouterSecrets = credential_lc.RouterSecrets()   # its Secrets as they are


def typed_status(status: dict[str, Any]) -> dict[str, Any]:
    return EnsembleRouterStatus.model_validate(status).wire()


def short_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())[:1000]
    return str(e)[:1000]


def decide(spec_raw: dict[str, Any], observed: RouterObserved, prev: dict[str, Any], now: datetime,
           ctx: BuildContext) -> Decision:
    o = observed
    events: list[Event] = []
    conds = prev.get("conditions")
    spec = EnsembleRouterSpec.model_validate(spec_raw)
    selected = o.specialists
    lanes, _invalid = [], []
    for s in selected:
        try:
            lanes.append(router_res.Lane(s.name, o.namespace, SpecialistSpec.model_validate(s.spec), s.lane_adapter))
        except ValidationError:
            _invalid.append(s.name)   # its own status says why; the router serves the others
    ready_specialists = sum(1 for s in selected if s.phase in ("Ready", "Idle"))   # Idle: scaled to zero, serves
    status: dict[str, Any] = {
        "observedGeneration": o.generation, "specialists": len(selected), "readySpecialists": ready_specialists,
        "lanes": [{"name": s.name, "phase": s.phase, "warmReplicas": s.warm_replicas, "breaker": s.breaker}
                  for s in selected] or None,
        # written by the router itself; carried so the typed status is whole (never patched by us)
        "breakerState": prev.get("breakerState"),
        "engineCredentialDigest": prev.get("engineCredentialDigest"),
    }
    # An image or classifier the operator will not run (admission.py) fails like a config that does
    # not render: nothing is written.
    failure = admission.router_refusal(spec, ctx)
    if failure is None:
        try:
            config = router_res.router_config(o.name, spec, lanes)
        except (ValidationError, ValueError) as e:
            failure = ("NoSpecialists", "no Specialist matches spec.specialistSelector") if not lanes \
                else ("InvalidConfig", short_error(e))
    if failure is not None:
        reason, msg = failure
        before = get_condition(conds, "ConfigValid") or {}
        conds = set_condition(conds, "ConfigValid", False, reason, msg, now, o.generation)
        conds = set_condition(conds, "Ready", False, reason, msg, now, o.generation)
        if before.get("status") != "False" or before.get("message") != msg:
            events.append(Event("Warning", reason, msg))
        status.update(phase="Invalid", conditions=conds)
        return Decision([], typed_status(status), events, None, "Invalid")

    skipped = router_res.skipped_references(spec, lanes)
    conds = set_condition(conds, "ConfigValid", True, "Rendered", f"{len(lanes)} lane(s)" + (
        f"; skipped (Specialist not in the ensemble): {', '.join(skipped)}" if skipped else ""), now, o.generation)
    status["configHash"] = content_hash(config.model_dump(mode="json"))
    # The Secrets first: the router pods mount them.
    secrets, staged_s, status["engineCredentialDigest"] = credential_lc.router_secrets(
        o.name, o.namespace, o.uid, spec.auth.enabled and spec.auth.api_keys_secret_ref is None, o.secrets,
        router_res.router_labels(o.name, ctx), owner_reference(KIND, o.name, o.uid), now,
        ctx.credential_propagation_seconds)
    children = secrets + router_res.router_children(o.name, o.namespace, o.uid, spec, config, ctx)
    # A staged credential rotation is promoted once it has reached every pod: the one timer a router asks for.
    requeue = None if staged_s is None else max(0.5, staged_s + 0.5)

    ready = sum(o.pods_ready)
    status.update(replicas=len(o.pods_ready), readyReplicas=ready, ready=f"{ready}/{spec.replicas}")
    if ready == 0 and spec.replicas > 0:
        phase, reason, msg = "Pending", "RouterNotReady", f"0/{spec.replicas} router replicas ready"
    elif ready_specialists < len(selected):
        phase, reason, msg = "Degraded", "SpecialistsNotReady", f"{ready_specialists}/{len(selected)} Specialists Ready"
    else:
        phase, reason, msg = "Ready", "Serving", f"{ready}/{spec.replicas} router replicas, {len(selected)} Specialists Ready"
    conds = set_condition(conds, "Ready", phase == "Ready", reason, msg, now, o.generation)
    status.update(phase=phase, conditions=conds)
    if phase != prev.get("phase"):
        events.append(Event("Normal" if phase == "Ready" else "Warning", phase, msg))
    return Decision(children, typed_status(status), events, requeue, phase)
