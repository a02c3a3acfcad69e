"""Kopf glue: watches, indexes and one daemon per Specialist / EnsembleRouter.

Each daemon is a level-triggered loop: build the desired children (pure builders), write only the
ones whose content hash differs from what the cluster holds (server-side apply), gather observations
from Kopf's in-memory indexes and the engines (through the pod-address resolver), run the pure
lifecycle state machines and merge-patch `status` when it changed. Watch events wake the owning
daemon at once; otherwise it polls (engines warming produce no Kubernetes events).

Nothing here writes `spec`; Kopf writes only its finalizer (daemons need one so that they are
stopped before the object goes away).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import kopf
from .api.base import GROUP, VERSION
from .api.base import LabelSelector
from .api.router import EnsembleRouterStatus
from .api.specialist import SpecialistSpec
from .credentials import observe_router_secrets
from .kube import Kube, KubeError, connection_info, expected_failure, load_configuration
from .lifecycle import ownership as ownership_lc
from .lifecycle import router as router_lc
from .lifecycle import specialist as specialist_lc
from .lifecycle import warmup as warmup_lc
from .lifecycle.common import Event
from .metrics import (APPLIES, EVENTS, PHASES, RECONCILE_ERRORS, RECONCILE_SECONDS, RECONCILES,
                      STATUS_WRITES)
from .probe import Prober
from .resolver import NullResolver, PodAddressResolver, PodRef
from .resources.common import ANNOTATION_HASH, MANAGED_BY, BuildContext

log = logging.getLogger("consort.operator")

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}


# ---- runtime configuration (main.py builds it and hands it to Kopf as memo.runtime) ---------------

@dataclass
class Runtime:
    ctx: BuildContext = field(default_factory=BuildContext)
    resolver: PodAddressResolver = field(default_factory=NullResolver)
    warm_signal: str = "engine-or-pod-ready"
    poll_seconds: float = 2.0          # while some replica is cold (engines give no k8s events)
    idle_seconds: float = 30.0         # when everything is warm and settled
    resync_seconds: float = 600.0      # re-read owned objects (recreate deleted ones, fix drift)
    peering_priority: int | None = None
    write_guard: Callable[[], None] | None = None   # leader election's check before each write
    kube: Kube | None = None
    prober: Prober | None = None
    wakers: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)
    phases: dict[tuple[str, str], str] = field(default_factory=dict)

    def client(self) -> Kube:
        if self.kube is None:
            raise RuntimeError("not logged in")
        return self.kube

    def pacing(self) -> specialist_lc.Pacing:
        return specialist_lc.Pacing(self.warm_signal, self.poll_seconds, self.idle_seconds)  # type: ignore[arg-type]

    def waker(self, key: tuple[str, str, str]) -> asyncio.Event:
        ev = self.wakers.get(key)
        if ev is None:
            ev = self.wakers[key] = asyncio.Event()
        return ev

    def wake(self, kind: str, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.waker((kind, namespace, name)).set()

    def wake_all(self, kind: str, namespace: str) -> None:
        for (k, ns, _), ev in self.wakers.items():
            if k == kind and ns == namespace:
                ev.set()

    async def sleep(self, key: tuple[str, str, str], seconds: float) -> None:
        ev = self.waker(key)
        try:
            await asyncio.wait_for(ev.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        ev.clear()

    def set_phase(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self.phases.pop(key, None)
        else:
            self.phases[key] = phase
        counts: dict[str, int] = {}
        for p in self.phases.values():
            counts[p] = counts.get(p, 0) + 1
        for p in ("Pending", "Warming", "Ready", "Degraded", "Failed", "Idle"):
            PHASES.labels(p).set(counts.get(p, 0))


def rt_of(memo: Any) -> Runtime:
    """The operator's Runtime from Kopf's memo (Kopf copies the memo per object, shallowly: every
    handler sees the one Runtime main.py put there)."""
    return memo.runtime


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


# ---- operator settings and login ---------------------------------------------------------------

@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.posting.loggers = False             # only our explicit transition Events
    settings.posting.level = logging.INFO
    settings.peering.lifetime = 30
    if runtime.peering_priority is not None:
        settings.peering.priority = runtime.peering_priority
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    runtime.prober = Prober()


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    if runtime.kube:
        await runtime.kube.close()
    if runtime.prober:
        await runtime.prober.close()


@kopf.on.login()
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """One identity for Kopf's watches and our own calls, loaded by kubernetes_asyncio."""
    runtime = rt_of(memo)
    cfg = await load_configuration()
    if runtime.kube is not None:       # a re-login (credentials expired): the new client replaces the old
        await runtime.kube.close()
    runtime.kube = Kube(cfg)
    runtime.kube.write_guard = runtime.write_guard
    return await connection_info(cfg)


# ---- indexes (Kopf's in-memory caches) and wake-ups -------------------------------------------

@kopf.index("v1", "pods", labels=MANAGED)
async def pod_index(namespace: str, labels: Any, body: Any, **_: Any) -> dict[Any, Any]:
    key = (namespace, labels.get("app.kubernetes.io/component"), labels.get("app.kubernetes.io/instance"))
    return {key: warmup_lc.pod_fields(body)}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
async def deployment_index(namespace: str, name: str, meta: Any, status: Any, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): {
        "hash": (meta.get("annotations") or {}).get(ANNOTATION_HASH),
        "generation": meta.get("generation") or 0,
        "observed_generation": status.get("observedGeneration") or 0,
        "replicas": status.get("replicas") or 0,
        "updated_replicas": status.get("updatedReplicas") or 0,
        "ready_replicas": status.get("readyReplicas") or 0,
        "available_replicas": status.get("availableReplicas") or 0,
    }}


@kopf.index(GROUP, VERSION, "specialists")
async def specialist_index(namespace: str, name: str, labels: Any, spec: Any, status: Any, **_: Any) -> dict[Any, Any]:
    return {namespace: {
        "name": name,
        "labels": dict(labels),
        "spec": copy.deepcopy(dict(spec)),
        "phase": status.get("phase"),
        "warmReplicas": status.get("warmReplicas") or 0,
        "breaker": (status.get("breaker") or {}).get("state") or "Closed",
        "laneAdapter": _lane_adapter_raw(spec, status),
    }}


def _lane_adapter_raw(spec: Any, status: Any) -> str | None:
    """lifecycle.rollout.lane_adapter over raw dicts (the index keeps no parsed models)."""
    state = {a.get("name"): a.get("state") for a in status.get("adapters") or []}
    for a in reversed(spec.get("adapters") or []):
        if state.get(a.get("name")) in ("Probation", "Active"):
            return a.get("name")
    return None


@kopf.index(GROUP, VERSION, "ensemblerouters")
async def router_index(namespace: str, name: str, spec: Any, status: Any, **_: Any) -> dict[Any, Any]:
    return {namespace: {
        "name": name,
        "selector": copy.deepcopy(dict(spec.get("specialistSelector") or {})),
        "breakerState": copy.deepcopy(status.get("breakerState") or {}),
    }}


def _owner_kind(labels: Any) -> str | None:
    return {"engine": "Specialist", "router": "EnsembleRouter"}.get(labels.get("app.kubernetes.io/component"))


@kopf.on.event("v1", "pods", labels=MANAGED)
async def pod_event(namespace: str, labels: Any, memo: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    kind = _owner_kind(labels)
    if kind:
        runtime.wake(kind, namespace, labels.get("app.kubernetes.io/instance"))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_event(namespace: str, labels: Any, memo: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    kind = _owner_kind(labels)
    if kind:
        runtime.wake(kind, namespace, labels.get("app.kubernetes.io/instance"))


@kopf.on.event(GROUP, VERSION, "specialists")
async def specialist_event(namespace: str, name: str, memo: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    runtime.wake("Specialist", namespace, name)
    runtime.wake_all("EnsembleRouter", namespace)


@kopf.on.event(GROUP, VERSION, "ensemblerouters")
async def router_event(namespace: str, name: str, memo: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    runtime.wake("EnsembleRouter", namespace, name)
    runtime.wake_all("Specialist", namespace)   # breaker mirror


# ---- owned objects: write only what changed ----------------------------------------------------

@dataclass
class Owned:
    """What one daemon knows about the children it wrote (lost on restart: then it reads them)."""

    hashes: dict[tuple[str, str], str] = field(default_factory=dict)
    generations: dict[tuple[str, str], int] = field(default_factory=dict)
    last_resync: float = 0.0


async def post_event(body: Any, kind: str, ev: Event) -> None:
    EVENTS.labels(kind, ev.reason).inc()
    kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)


async def ensure_children(rt: Runtime, body: Any, kind: str, children: list[dict[str, Any]], owned: Owned,
                          deployments: Any) -> tuple[list[Event], list[ownership_lc.Conflict]]:
    """Create or update children whose desired content hash differs from the live one; never one that
    exists and is not this object's (lifecycle/ownership.py): those are returned as conflicts."""
    events: list[Event] = []
    conflicts: list[ownership_lc.Conflict] = []
    uid = body["metadata"]["uid"]
    resync = time.monotonic() - owned.last_resync > rt.resync_seconds
    for child in children:
        ckind, meta = child["kind"], child["metadata"]
        key = (ckind, meta["name"])
        want = meta["annotations"][ANNOTATION_HASH]
        live_hash: str | None
        if ckind == "Deployment":
            live = _first(deployments.get((meta["namespace"], meta["name"])))
            live_hash = live["hash"] if live else None
            drifted = live is not None and key in owned.generations and live["generation"] != owned.generations[key]
            if live_hash == want and not drifted:
                owned.hashes[key] = want
                continue
            # The index holds only Deployments with our label: read the object itself, whoever made it.
            live_obj = await rt.client().get(ckind, meta["namespace"], meta["name"])
        else:
            if owned.hashes.get(key) == want and not resync:
                continue
            live_obj = await rt.client().get(ckind, meta["namespace"], meta["name"])
            live_hash = ((live_obj or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_HASH)
            if live_obj is not None and live_hash == want:
                owned.hashes[key] = want
                continue
        refused = ownership_lc.conflict(child, live_obj, uid)
        if refused is not None:
            owned.hashes.pop(key, None)    # re-checked on the next pass
            conflicts.append(refused)
            continue
        exists = live_obj is not None
        result = await rt.client().apply(child)
        APPLIES.labels(ckind).inc()
        owned.hashes[key] = want
        owned.generations[key] = int(result.get("metadata", {}).get("generation") or 0)
        verb = "Updated" if exists else "Created"
        events.append(Event("Normal", f"{verb}{ckind}", f"{verb.lower()} {ckind} {meta['name']}"))
    if resync:
        owned.last_resync = time.monotonic()
    return events, conflicts


def _first(store: Any) -> Any:
    if not store:
        return None
    for item in store:
        return item
    return None


def merge_patch(old: dict[str, Any], new: dict[str, Any], owned_keys: set[str]) -> dict[str, Any]:
    """Top-level merge patch from old to new over the keys this operator owns."""
    patch: dict[str, Any] = {}
    for k in owned_keys:
        if k in new and new[k] is not None:
            if old.get(k) != new[k]:
                patch[k] = new[k]
        elif old.get(k) is not None:
            patch[k] = None
    return patch


# breakerState is the router's own to write (kube_store.py in the router pods)
ROUTER_STATUS_KEYS = frozenset(f.alias or n for n, f in EnsembleRouterStatus.model_fields.items()) - {"breakerState"}


# ---- Specialist ---------------------------------------------------------------------------------

async def probe_replicas(runtime: Runtime, namespace: str, pods: list[dict[str, Any]], port: int,
                         adapters: bool = False, routers: tuple[str, ...] = ()) -> dict[str, warmup_lc.ProbeResult]:
    """The engines' own answers. Under the pod-ready warm signal only where adapters are listed: a
    hot-load does not show in pod readiness, and routing to an adapter before it is loaded fails."""
    if runtime.prober is None or (runtime.warm_signal == "pod-ready" and not adapters):
        return {}
    targets = {}
    for p in pods:
        if p["deleting"]:
            continue
        addr = runtime.resolver.resolve(PodRef(namespace, p["name"], p["ip"], port))
        if addr:
            targets[p["name"]] = addr
    token = runtime.prober.token(namespace, routers)
    results = await asyncio.gather(*(runtime.prober.probe(a, token) for a in targets.values()))
    out = dict(zip(targets, results))
    for p in pods:   # resolvable nowhere: unreachable
        out.setdefault(p["name"], warmup_lc.ProbeResult(reachable=False, reason="no address"))
    return out


def _pod(p: dict[str, Any]) -> warmup_lc.PodObs:
    started = p.get("started_at")
    return warmup_lc.PodObs(
        name=p["name"], phase=p["phase"], ready=p["ready"], scheduled=p["scheduled"], deleting=p["deleting"],
        started_at=datetime.strptime(started, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) if started else None,
        restarts=p["restarts"], waiting_reason=p["waiting_reason"], template_hash=p["template_hash"])


async def observe_specialist(rt: Runtime, body: Any, pod_index: Any, deployment_index: Any,
                             router_index: Any) -> specialist_lc.SpecialistObserved:
    """One typed snapshot: the engine Deployment and pods (Kopf's indexes), the engines' /ready and
    /v1/status (probes), and the breaker states of the EnsembleRouters that select this Specialist."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    dep_raw = _first(deployment_index.get((namespace, name)))
    dep = warmup_lc.DeploymentObs(**{k: dep_raw[k] for k in (
        "generation", "observed_generation", "replicas", "updated_replicas", "ready_replicas",
        "available_replicas")}) if dep_raw else None
    pods_raw = list(pod_index.get((namespace, "engine", name), []))
    port = (body.get("spec") or {}).get("port") or SpecialistSpec.model_fields["port"].default
    labels = dict(meta.get("labels") or {})
    selecting = [r for r in router_index.get(namespace, [])
                 if LabelSelector.model_validate(r["selector"] or {}).matches(labels)]
    routers = tuple(sorted(r["name"] for r in selecting))
    probes = await probe_replicas(rt, namespace, pods_raw, port, adapters=bool((body.get("spec") or {}).get("adapters")),
                                  routers=routers)
    router_states = tuple(r["breakerState"] for r in selecting)
    return specialist_lc.SpecialistObserved(name, namespace, meta["uid"], meta.get("generation"), dep,
                                            tuple(_pod(p) for p in pods_raw), probes, router_states, routers)


async def apply_decision(rt: Runtime, kind: str, body: Any, prev: dict[str, Any], decision: specialist_lc.Decision,
                         owned: Owned, deployment_index: Any, status_keys: frozenset[str]) -> None:
    """Children (only what changed), then status (merge patch of what changed), then events."""
    events, conflicts = await ensure_children(rt, body, kind, decision.children, owned, deployment_index)
    status = decision.status
    if decision.children:   # no children decided (invalid spec): ownership was not looked at
        meta = body["metadata"]
        conds, ev = ownership_lc.ownership_condition(status.get("conditions"), conflicts, kind, now_utc(),
                                                     meta.get("generation"))
        status, events = {**status, "conditions": conds}, events + ev
    await write_status(rt, kind, body, prev, status, status_keys)
    meta = body["metadata"]
    if kind == "Specialist":   # the consort_operator_specialists{phase} gauge
        rt.set_phase((meta["namespace"], meta["name"]), decision.phase)
    for e in events + decision.events:
        await post_event(body, kind, e)


async def reconcile_specialist(rt: Runtime, body: Any, owned: Owned, pod_index: Any, deployment_index: Any,
                               router_index: Any) -> float:
    """One pass: observe, decide (pure), apply. Returns the delay before the next pass."""
    prev = copy.deepcopy(dict(body.get("status") or {}))
    observed = await observe_specialist(rt, body, pod_index, deployment_index, router_index)
    decision = specialist_lc.decide(dict(body.get("spec") or {}), observed, prev, now_utc(), rt.ctx, rt.pacing())
    await apply_decision(rt, "Specialist", body, prev, decision, owned, deployment_index, specialist_lc.STATUS_KEYS)
    if decision.scale_to is not None:   # scale to zero (lifecycle/scaling.py), through /scale like an HPA
        meta = body["metadata"]
        await rt.client().scale("Specialist", meta["namespace"], meta["name"], decision.scale_to,
                                int((body.get("spec") or {}).get("replicas", 1)))
    return decision.requeue_seconds


async def write_status(rt: Runtime, kind: str, body: Any, prev: dict[str, Any], status: dict[str, Any], keys: set[str]) -> None:
    patch = merge_patch(prev, status, keys)
    if not patch:
        return
    meta = body["metadata"]
    await rt.client().patch_status(kind, meta["namespace"], meta["name"], patch)
    STATUS_WRITES.labels(kind).inc()


async def _daemon_loop(rt: Runtime, kind: str, body: Any, stopped: Any, logger: Any, pass_fn: Any) -> None:
    meta = body["metadata"]
    key = (kind, meta["namespace"], meta["name"])
    failures = 0
    # Spread the first passes of many objects a little (a 200-object apply arrives at once).
    await asyncio.sleep(random.uniform(0, 0.05))
    while not stopped:
        t0 = time.perf_counter()
        try:
            delay = await pass_fn()
            RECONCILES.labels(kind, "ok").inc()
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - keep the daemon alive; report and back off
            failures += 1
            RECONCILES.labels(kind, "error").inc()
            RECONCILE_ERRORS.labels(kind).inc()
            delay = min(60.0, 0.5 * 2 ** min(failures, 7))
            if isinstance(e, KubeError) and e.status == 409:
                delay = 0.2
            (logger.warning if expected_failure(e) else logger.exception)(
                f"reconcile of {kind} {key[1]}/{key[2]} failed ({failures}x): {type(e).__name__}: {e}")
        finally:
            RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - t0)
        await rt.sleep(key, delay)


@kopf.daemon(GROUP, VERSION, "specialists", cancellation_timeout=5.0)
async def specialist_daemon(stopped: Any, body: Any, logger: Any, memo: Any, pod_index: Any, deployment_index: Any,
                            router_index: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    owned = Owned()
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    try:
        await _daemon_loop(runtime, "Specialist", body, stopped, logger,
                           lambda: reconcile_specialist(runtime, body, owned, pod_index, deployment_index, router_index))
    finally:
        runtime.wakers.pop(("Specialist", *key), None)
        runtime.set_phase(key, None)


# ---- EnsembleRouter ----------------------------------------------------------------------------

async def reconcile_router(rt: Runtime, body: Any, owned: Owned, pod_index: Any, deployment_index: Any,
                           specialist_index: Any) -> float:
    """One pass: observe (selected Specialists, router pods), decide (pure), apply."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    prev = copy.deepcopy(dict(body.get("status") or {}))
    selector = LabelSelector.model_validate(dict((body.get("spec") or {}).get("specialistSelector") or {}))
    selected = tuple(router_lc.SelectedSpecialist(s["name"], s["spec"], s["phase"], s["warmReplicas"], s["breaker"],
                                                  s["laneAdapter"])
                     for s in sorted(specialist_index.get(namespace, []), key=lambda s: s["name"])
                     if selector.matches(s["labels"]))
    pods = tuple(p["ready"] for p in pod_index.get((namespace, "router", name), []) if not p["deleting"])
    secrets = await observe_router_secrets(rt.client(), rt.prober, body)
    observed = router_lc.RouterObserved(name, namespace, meta["uid"], meta.get("generation"), selected, pods, secrets)
    decision = router_lc.decide(dict(body.get("spec") or {}), observed, prev, now_utc(), rt.ctx, rt.idle_seconds)
    await apply_decision(rt, "EnsembleRouter", body, prev, decision, owned, deployment_index, ROUTER_STATUS_KEYS)
    return decision.requeue_seconds


@kopf.daemon(GROUP, VERSION, "ensemblerouters", cancellation_timeout=5.0)
async def router_daemon(stopped: Any, body: Any, logger: Any, memo: Any, pod_index: Any, deployment_index: Any,
                        specialist_index: Any, **_: Any) -> None:
    runtime = rt_of(memo)
    owned = Owned()
    key = (body["metadata"]["namespace"], body["metadata"]["name"])

    async def one_pass() -> float:
        delay = await reconcile_router(runtime, body, owned, pod_index, deployment_index, specialist_index)
        await asyncio.sleep(0.3)   # coalesce bursts of Specialist events into one pass
        return delay

    try:
        await _daemon_loop(runtime, "EnsembleRouter", body, stopped, logger, one_pass)
    finally:
        runtime.wakers.pop(("EnsembleRouter", *key), None)
