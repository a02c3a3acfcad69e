"""Warmup gating: a Specialist is Warming until `minReady` replicas report warm, then Ready.

Pure: (spec, generation, observed Deployment and pods, probe results, warm-signal policy, previous
status, now) -> (new status dict, events). The daemon in `handlers.py` gathers the observations.

Warm signal per replica (policy, `--warm-signal`):
  engine               only the engine's own GET /ready counts (unreachable = cold)
  pod-ready            only the pod's Ready condition counts (in a real cluster that is the
                       readinessProbe on /ready, so the two agree)
  engine-or-pod-ready  the engine's answer when it is reachable, the pod's Ready condition otherwise
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from ..api.specialist import SpecialistSpec
from .common import Event, get_condition, set_condition

WarmSignal = Literal["engine", "pod-ready", "engine-or-pod-ready"]
WARM_SIGNALS: tuple[str, ...] = ("engine", "pod-ready", "engine-or-pod-ready")

FATAL_WAITING = frozenset({"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                           "CreateContainerError", "InvalidImageName", "RunContainerError"})
# A Specialist that was serving and has a replica restarting is Degraded, not Failed, until that
# replica has crashed this often (then its back-off is the kubelet's CrashLoopBackOff for good).
RESTARTS_BEFORE_FAILED = 3


def pod_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Pure: what warmup reads of a Pod object (kept in the operator's pod index). The warmup clock
    (`started_at`) runs from the engine container's current start; while it restarts, from its last
    exit (the pod's own start would be long past, and the replica would read as a warmup timeout)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    started = None
    restarts = 0
    waiting = None
    for cs in status.get("containerStatuses") or []:
        restarts += int(cs.get("restartCount") or 0)
        state = cs.get("state") or {}
        if "running" in state:
            started = state["running"].get("startedAt") or started
        else:   # just killed (state terminated, no lastState yet), or waiting to restart
            started = ((state.get("terminated") or {}).get("finishedAt")
                       or ((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt") or started)
        if "waiting" in state:
            waiting = state["waiting"].get("reason") or waiting
    return {
        "name": meta.get("name"),
        "ip": status.get("podIP"),
        "phase": status.get("phase") or "Pending",
        "ready": conds.get("Ready") == "True",
        "scheduled": conds.get("PodScheduled") == "True",
        "deleting": meta.get("deletionTimestamp") is not None,
        "started_at": started or status.get("startTime"),
        "restarts": restarts,
        "waiting_reason": waiting,
        "template_hash": (meta.get("labels") or {}).get("pod-template-hash"),
    }


@dataclass(frozen=True)
class PodObs:
    name: str
    phase: str = "Pending"                 # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False                    # the pod's Ready condition
    scheduled: bool = False
    deleting: bool = False
    started_at: datetime | None = None     # the engine container's start (or the pod's start)
    restarts: int = 0
    waiting_reason: str | None = None      # e.g. CrashLoopBackOff
    template_hash: str | None = None       # pod-template-hash label


@dataclass(frozen=True)
class ProbeResult:
    """One GET /ready + /v1/status of a replica's engine through the pod-address resolver."""

    reachable: bool
    warm: bool = False
    reason: str = ""
    adapters: dict[str, str] = field(default_factory=dict)   # name -> loaded | pending | failed
    adapter_errors: dict[str, str] = field(default_factory=dict)   # name -> why its hot-load failed
    slo: dict[str, Any] = field(default_factory=dict)        # the engine's /v1/status "slo" report
    speculation: dict[str, Any] = field(default_factory=dict)   # its "speculation" report
    idle_s: float | None = None    # its "idle_s": seconds without a generation request (lifecycle/scaling.py)


@dataclass(frozen=True)
class DeploymentObs:
    generation: int = 0
    observed_generation: int = 0
    replicas: int = 0
    updated_replicas: int = 0
    ready_replicas: int = 0
    available_replicas: int = 0


def replica_warm(pod: PodObs, probe: ProbeResult | None, policy: WarmSignal) -> tuple[bool, str]:
    """(warm, source) for one replica under the policy."""
    if policy == "pod-ready":
        return pod.ready, "pod-ready"
    if probe is not None and probe.reachable:
        return probe.warm, "engine"
    if policy == "engine-or-pod-ready":
        return pod.ready, "pod-ready"
    return False, "none"


def evaluate(spec: SpecialistSpec, generation: int | None, deployment: DeploymentObs | None,
             pods: list[PodObs], probes: dict[str, ProbeResult], policy: WarmSignal,
             prev: dict[str, Any] | None, now: datetime, selector: str | None = None
             ) -> tuple[dict[str, Any], list[Event]]:
    prev = prev or {}
    events: list[Event] = []
    live = sorted((p for p in pods if not p.deleting), key=lambda p: p.name)
    replica_status = []
    warm_pods: list[PodObs] = []
    for pod in live:
        warm, source = replica_warm(pod, probes.get(pod.name), policy)
        replica_status.append({"pod": pod.name, "warm": warm, "source": source})
        if warm:
            warm_pods.append(pod)

    was_warm = {r["pod"]: r["warm"] for r in prev.get("replicaStatus") or []}
    for r in replica_status:
        before = was_warm.get(r["pod"])
        if r["warm"] and not before:
            events.append(Event("Normal", "ReplicaWarm", f"replica {r['pod']} is warm (signal: {r['source']})"))
        elif before and not r["warm"]:
            events.append(Event("Warning", "ReplicaCold", f"replica {r['pod']} stopped reporting warm"))

    desired = spec.replicas
    warm = len(warm_pods)
    minimum = spec.min_ready
    prev_phase = prev.get("phase")
    timeout = spec.warmup_timeout_seconds

    serving_before = prev_phase in ("Ready", "Degraded")
    restarting = [p for p in live if serving_before and 0 < p.restarts < RESTARTS_BEFORE_FAILED
                  and p.waiting_reason in (None, "CrashLoopBackOff")]
    fatal = [p for p in live if p.waiting_reason in FATAL_WAITING and p not in restarting]
    timed_out = [p for p in live if p.started_at is not None and p not in warm_pods
                 and (now - p.started_at).total_seconds() > timeout]
    running = [p for p in live if p.phase == "Running"]

    if warm >= minimum:
        phase, reason = "Ready", "MinReadyWarm"
        message = f"{warm}/{desired} replicas warm (minReady {minimum})"
    elif restarting and not fatal and not timed_out:
        phase, reason = "Degraded", "ReplicaRestarting"
        message = (f"replica {restarting[0].name} restarting (restart {restarting[0].restarts}); "
                   f"only {warm}/{desired} replicas warm, fewer than minReady {minimum}")
    elif fatal:
        phase, reason = "Failed", fatal[0].waiting_reason or "ContainerFailing"
        message = f"replica {fatal[0].name}: {fatal[0].waiting_reason}; {warm}/{desired} warm (minReady {minimum})"
    elif timed_out:
        phase, reason = "Failed", "WarmupTimeout"
        message = (f"replica {timed_out[0].name} not warm {timeout} s after start "
                   f"(warmupTimeoutSeconds); {warm}/{desired} warm (minReady {minimum})")
    elif prev_phase in ("Ready", "Degraded"):
        phase, reason = "Degraded", "BelowMinReady"
        message = f"only {warm}/{desired} replicas warm, fewer than minReady {minimum}"
    elif not running:
        unscheduled = [p for p in live if not p.scheduled]
        phase = "Pending"
        reason = "Unschedulable" if live and len(unscheduled) == len(live) else ("NoReplicas" if not live else "Starting")
        message = (f"{len(unscheduled)} replica(s) not scheduled yet" if reason == "Unschedulable"
                   else "no engine pod exists yet" if not live else "engine pods starting")
    else:
        phase, reason = "Warming", "Warming"
        message = f"{warm}/{desired} replicas warm, waiting for minReady {minimum}"

    if phase != prev_phase:
        etype = "Warning" if phase in ("Failed", "Degraded") else "Normal"
        events.append(Event(etype, phase, message))

    conds = prev.get("conditions")
    conds = set_condition(conds, "Ready", phase == "Ready", reason if phase != "Ready" else "MinReadyWarm",
                          message, now, generation)
    all_warm = warm >= desired
    conds = set_condition(conds, "Warm", all_warm, "AllReplicasWarm" if all_warm else "Warming",
                          f"{warm}/{desired} replicas warm", now, generation)
    before = get_condition(prev.get("conditions"), "Warm")
    if all_warm and desired > 0 and before is not None and before.get("status") != "True":
        events.append(Event("Normal", "AllReplicasWarm", f"all {desired} replicas warm"))

    status = {
        "phase": phase,
        "replicas": len(live),
        "desiredReplicas": desired,
        "readyReplicas": sum(1 for p in live if p.ready),
        "warmReplicas": warm,
        "updatedReplicas": deployment.updated_replicas if deployment else 0,
        "ready": f"{warm}/{desired}",
        "replicaStatus": replica_status,
        "conditions": conds,
    }
    if selector:
        status["selector"] = selector
    if generation is not None:
        status["observedGeneration"] = generation
    return status, events
