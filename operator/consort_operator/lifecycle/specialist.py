"""A Specialist's whole reconcile decision, pure: (spec, observed, previous status, now) -> Decision.

The daemon in `handlers.py` observes (one typed snapshot from Kopf's indexes and the engines' probes),
calls `decide`, and applies what it returns (children by server-side apply, status by merge patch,
events). The lifecycles themselves live in warmup.py, rollout.py, breaker.py and slo.py; `decide`
composes them in order and types the result: the status is the `SpecialistStatus` model serialised
by alias, so a field the CRD does not know fails here, not silently in the apiserver's pruning.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from ..api.base import explain
from ..api.specialist import SpecialistSpec, SpecialistStatus
from ..resources import router as router_res
from ..resources import specialist as specialist_res
from ..resources.common import BuildContext
from . import admission
from . import breaker as breaker_lc
from . import rollout as rollout_lc
from . import scaling as scaling_lc
from . import slo as slo_lc
from . import speculation as speculation_lc
from . import warmup as warmup_lc
from .pacing import Pacing, deadlines, requeue_seconds
from .status import SPECIALIST_STATUS_KEYS as STATUS_KEYS
from .common import Event, get_condition, set_condition


@dataclass(frozen=True)
class SpecialistObserved:
    """Everything one pass reads about a Specialist, gathered before deciding."""

    name: str
    namespace: str
    uid: str
    generation: int | None
    deployment: warmup_lc.DeploymentObs | None = None
    pods: tuple[warmup_lc.PodObs, ...] = ()
    probes: dict[str, warmup_lc.ProbeResult] = field(default_factory=dict)
    # breakerState of every EnsembleRouter whose selector picks this Specialist
    router_states: tuple[dict[str, Any], ...] = ()
    # names of those EnsembleRouters: the engines accept each one's credential
    routers: tuple[str, ...] = ()
    # replicas the engine warm signal wants probed that have no address (yet): polled for one
    unaddressed: tuple[str, ...] = ()
    # (EnsembleRouter, the tokens its engine credential Secret accepts) for those whose Secret was read
    credentials: tuple[tuple[str, str], ...] = ()


@dataclass
class Decision:
    children: list[dict[str, Any]]      # desired objects (content-hash annotated); empty: touch nothing
    status: dict[str, Any]              # the whole status, camelCase, by alias from the typed model
    events: list[Event]
    requeue_seconds: float | None       # the next pass without an event (None: only on one)
    phase: str | None
    scale_to: int | None = None         # spec.replicas to write through /scale (scale to zero); None: leave it


Inputs = tuple[SpecialistObserved, "str | None"]


def pass_inputs(observed: SpecialistObserved, deployment_hash: str | None) -> Inputs:
    """What of an observation `decide` and the children's check read (with the live Deployment's
    content hash): a Deployment's rollout counters other than updatedReplicas move without changing
    any decision, so they wake no pass."""
    d = observed.deployment
    trimmed = None if d is None else warmup_lc.DeploymentObs(generation=d.generation, updated_replicas=d.updated_replicas)
    return replace(observed, deployment=trimmed), deployment_hash


def echo_inputs(inputs: Inputs, written: tuple[str, int] | None) -> Inputs:
    """The inputs as the watch shows them once the pass's own Deployment write arrives (`written`:
    the content hash and generation the operator last wrote or read; None: none known), so that the
    echo of its own write wakes no pass."""
    if written is None:
        return inputs
    observed, _ = inputs
    d = observed.deployment
    echo = warmup_lc.DeploymentObs(generation=written[1], updated_replicas=d.updated_replicas if d else 0)
    return replace(observed, deployment=echo), written[0]


UNPROBED = warmup_lc.ProbeResult(reachable=False)


def typed_status(status: dict[str, Any]) -> dict[str, Any]:
    """The status through its pydantic model and back, by alias: unknown or misspelt fields raise."""
    return SpecialistStatus.model_validate(status).wire()


def refuse(refused: tuple[str, str], generation: int | None, prev: dict[str, Any], now: datetime,
           requeue: float | None = None) -> Decision:
    """A spec the operator will not run (lifecycle/admission.py): no children, Failed, one Warning."""
    reason, msg = refused
    before = get_condition(prev.get("conditions"), "Ready") or {}
    conds = set_condition(prev.get("conditions"), "Ready", False, reason, msg, now, generation)
    kept = {k: v for k, v in prev.items() if k in STATUS_KEYS}
    status = typed_status({**kept, "phase": "Failed", "conditions": conds, "observedGeneration": generation})
    events = [] if before.get("reason") == reason and before.get("message") == msg else [Event("Warning", reason, msg)]
    return Decision([], status, events, requeue, "Failed")


def decide(spec_raw: dict[str, Any], observed: SpecialistObserved, prev: dict[str, Any], now: datetime,
           ctx: BuildContext, pacing: Pacing) -> Decision:
    o = observed
    try:
        spec = SpecialistSpec.model_validate(spec_raw)
    except ValidationError as e:
        conds = set_condition(prev.get("conditions"), "Ready", False, "InvalidSpec", explain(e, SpecialistSpec)[:1000], now, o.generation)
        kept = {k: v for k, v in prev.items() if k in STATUS_KEYS}
        status = typed_status({**kept, "phase": "Failed", "conditions": conds, "observedGeneration": o.generation})
        return Decision([], status, [], None, "Failed")

    refused = admission.specialist_refusal(spec, ctx)
    if refused is not None:
        return refuse(refused, o.generation, prev, now)

    events: list[Event] = []
    status, ev = warmup_lc.evaluate(spec, o.generation, o.deployment, list(o.pods), o.probes, pacing.warm_signal,
                                    prev, now, selector=specialist_res.pod_selector_string(o.name))
    idle = scaling_lc.least_idle_seconds((o.probes.get(r["pod"]) or UNPROBED).idle_s for r in status["replicaStatus"])
    scale = scaling_lc.decide(spec.scale_to_zero, spec.replicas, status["replicas"], status["warmReplicas"], idle)
    status, ev = scaling_lc.idle_status(status, ev, scale, now, o.generation, prev.get("phase"))
    events += ev

    # Correctness samples of the lane's current rotation, as the router collected them since the
    # lane revision it was given (a Probation adapter is the lane's default adapter).
    lane = rollout_lc.lane_adapter(spec.adapter_names(), prev.get("adapters"))
    samples: dict[str, tuple[int, int]] = {}
    if lane is not None:
        revision = router_res.Lane(o.name, o.namespace, spec, lane).revision
        for st in o.router_states:
            got = rollout_lc.samples_from_router(((st or {}).get("breakers") or {}).get(o.name), revision)
            if got:
                samples[lane] = got
    warm_pods = [(r["pod"], r["source"], o.probes.get(r["pod"])) for r in status["replicaStatus"] if r["warm"]]
    warm = [(source, probe) for _, source, probe in warm_pods]
    obs = rollout_lc.observations_from_replicas(spec.adapter_names(), warm_pods, samples)
    adapters, active, ev = rollout_lc.evaluate(spec, status["warmReplicas"], obs, prev.get("adapters"), now)
    events += ev
    # The engines stop loading an adapter in the pass that rolls it back (not one pass later).
    children = specialist_res.specialist_children(o.name, o.namespace, o.uid, spec, ctx, rollout_lc.rolled_back(adapters),
                                                  dict(o.credentials))
    status["adapters"] = adapters or None
    status["activeAdapter"] = active
    if adapters or prev.get("adapters"):
        conds = rollout_lc.rollout_condition(status["conditions"], adapters, now, o.generation)
    else:
        conds = set_condition(status["conditions"], "AdapterRollout", False, "NoAdapters", "no adapters configured",
                              now, o.generation)

    brk, conds, ev = breaker_lc.evaluate(o.name, spec.fallback, list(o.router_states), prev.get("breaker"), conds,
                                         now, o.generation)
    events += ev
    reports = [p.slo for _, p in warm if p is not None and p.slo]
    status["slo"], conds, ev = slo_lc.evaluate(spec, reports, conds, now, o.generation)
    events += ev
    status["breaker"] = brk
    status["conditions"] = conds
    status["speculation"] = speculation_lc.pooled([p.speculation for _, p in warm if p is not None]) \
        if spec.speculative.mode != "off" else None

    settled = status["warmReplicas"] >= spec.replicas and status["replicas"] == spec.replicas
    warm_names = {r["pod"] for r in status["replicaStatus"] if r["warm"]}
    waits = deadlines(o.pods, warm_names, spec.warmup_timeout_seconds, adapters, spec.rollout.probation_window_seconds, now)
    if o.unaddressed and pacing.warm_signal == "engine":
        waits.append(pacing.poll_seconds)    # only an engine's answer warms it: look for its address
    if scale.recheck_seconds is not None:    # the end of the idle window
        waits.append(max(pacing.poll_seconds, scale.recheck_seconds))
    requeue = requeue_seconds(pacing, o.probes, settled, waits)
    return Decision(children, typed_status(status), events, requeue, status["phase"], scale.replicas)
