"""Kopf glue: watches, indexes and one daemon per Specialist / EnsembleRouter; observe -> decide -> apply.

Each daemon waits for a watch event on what it reads (the object, its pods and Deployment, the
EnsembleRouters selecting it) or for a timer its last decision asked for (lifecycle/pacing.py), then
observes one typed snapshot (Kopf's in-memory indexes, the engines' probes). When that snapshot is
what the last pass decided from, nothing runs; otherwise the pure lifecycle decides and the daemon
applies: children that changed (lifecycle/children.py), the status merge patch (lifecycle/status.py,
nothing when empty), events. A failed pass raises kopf.TemporaryError: Kopf runs the daemon again
after the delay lifecycle/pacing.py gives.

Nothing here writes `spec`; Kopf writes only its finalizer (daemons need one so that they are
stopped before the object goes away).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any, Awaitable, Callable

import kopf
from .api.base import GROUP, VERSION
from .apply import decide_and_apply, now_utc
from .credentials import observe_router_secrets
from .kube import KubeError, Kube, connection_info, expected_failure, load_configuration
from .lifecycle import children as children_lc
from .lifecycle import pacing as pacing_lc
from .lifecycle import router as router_lc
from .lifecycle import selection
from .lifecycle import specialist as specialist_lc
from .lifecycle import warmup as warmup_lc
from .lifecycle.rollout import lane_adapter
from .metrics import RECONCILE_ERRORS, RECONCILE_SECONDS, RECONCILES
from .observe import first, observe_specialist
from .probe import Prober
from .resources.common import ANNOTATION_HASH, MANAGED_BY
from .runtime import ObjectState, Runtime

log = logging.getLogger("consort.operator")

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
OWNER_KIND = {"engine": "Specialist", "router": "EnsembleRouter"}


# ---- operator settings and login ---------------------------------------------------------------

class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: the operator has no on.create/update/delete handlers (its passes are daemons that
    read whole objects), so the diff Kopf builds of every watch event against the last handled spec
    is never read; building it deep-copies each pod, Deployment and Specialist event, a tenth of the
    operator's CPU while 1,000 Specialists are applied. Nothing is stored on the objects either."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    runtime: Runtime = memo.runtime   # Kopf copies the memo shallowly: every handler sees this one
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
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
    if memo.runtime.kube:
        await memo.runtime.kube.close()
    if memo.runtime.prober:
        await memo.runtime.prober.close()


@kopf.on.login()
async def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """One identity for Kopf's watches and our own calls, loaded by kubernetes_asyncio."""
    runtime: Runtime = memo.runtime
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
        "name": name, "labels": dict(labels), "spec": copy.deepcopy(dict(spec)), "phase": status.get("phase"),
        "warmReplicas": status.get("warmReplicas") or 0, "breaker": (status.get("breaker") or {}).get("state") or "Closed",
        "laneAdapter": lane_adapter([a.get("name") for a in spec.get("adapters") or []], status.get("adapters")),
    }}


@kopf.index(GROUP, VERSION, "ensemblerouters")
async def router_index(namespace: str, name: str, meta: Any, spec: Any, status: Any, **_: Any) -> dict[Any, Any]:
    return {namespace: {"name": name, "uid": meta.get("uid"),
                        "selector": copy.deepcopy(dict(spec.get("specialistSelector") or {})),
                        "breakerState": copy.deepcopy(status.get("breakerState") or {}),
                        "credentialDigest": status.get("engineCredentialDigest")}}


@kopf.on.event("v1", "pods", labels=MANAGED)
@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def child_event(namespace: str, labels: Any, memo: Any, **_: Any) -> None:
    kind = OWNER_KIND.get(labels.get("app.kubernetes.io/component"))
    if kind:
        memo.runtime.wake(kind, namespace, labels.get("app.kubernetes.io/instance"))


@kopf.on.event(GROUP, VERSION, "specialists")
async def specialist_event(namespace: str, name: str, memo: Any, **_: Any) -> None:
    memo.runtime.wake("Specialist", namespace, name)
    memo.runtime.wake_all("EnsembleRouter", namespace)


@kopf.on.event(GROUP, VERSION, "ensemblerouters")
async def router_event(namespace: str, name: str, memo: Any, **_: Any) -> None:
    memo.runtime.wake("EnsembleRouter", namespace, name)
    memo.runtime.wake_all("Specialist", namespace)   # breaker mirror


# ---- the daemon: wait, observe, decide when the inputs changed, apply --------------------------

Pass = Callable[[ObjectState, bool], Awaitable[None]]


async def run_daemon(rt: Runtime, kind: str, body: Any, stopped: Any, retry: int, logger: Any, one_pass: Pass) -> None:
    meta = body["metadata"]
    key = (kind, meta["namespace"], meta["name"])
    state = rt.state(key)
    waker = rt.waker(key)
    stopping = asyncio.ensure_future(stopped.wait())   # a stopping daemon is not left waiting for an event
    stopping.add_done_callback(lambda _: waker.set())
    try:
        due = True   # the first pass (or a retry) always runs
        while not stopped:
            t0 = time.perf_counter()
            try:
                await one_pass(state, due)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Kopf runs the daemon again after the delay
                RECONCILES.labels(kind, "error").inc()
                RECONCILE_ERRORS.labels(kind).inc()
                (logger.warning if expected_failure(e) else logger.exception)(
                    f"reconcile of {kind} {key[1]}/{key[2]} failed ({retry + 1}x): {type(e).__name__}: {e}")
                conflict = isinstance(e, KubeError) and e.status == 409
                raise kopf.TemporaryError(str(e), delay=pacing_lc.retry_delay(retry, conflict)) from e
            finally:
                RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - t0)
            resync = children_lc.resync_in(state.owned, time.monotonic(), rt.resync_seconds)
            deadline = time.monotonic() + resync
            if state.deadline is not None:
                deadline = min(deadline, state.deadline)
            due = not await rt.wait(key, deadline)
    finally:
        stopping.cancel()
        if stopped:
            rt.forget(key)
            if kind == "Specialist":
                rt.set_phase(key[1:], None)


@kopf.daemon(GROUP, VERSION, "specialists", cancellation_timeout=5.0)
async def specialist_daemon(stopped: Any, body: Any, logger: Any, memo: Any, retry: int, pod_index: Any,
                            deployment_index: Any, router_index: Any, **_: Any) -> None:
    rt: Runtime = memo.runtime

    async def one_pass(state: ObjectState, due: bool) -> None:
        observed, dep_hash = await observe_specialist(rt, body, pod_index, deployment_index, router_index)
        spec = copy.deepcopy(dict(body.get("spec") or {}))
        await decide_and_apply(rt, "Specialist", body, state, due, (spec, specialist_lc.pass_inputs(observed, dep_hash)),
                               lambda prev: specialist_lc.decide(spec, observed, prev, now_utc(), rt.ctx, rt.pacing()),
                               deployment_index, lambda inputs: (spec, specialist_lc.echo_inputs(
                                   inputs[1], state.owned.written(("Deployment", body["metadata"]["name"])))))

    await run_daemon(rt, "Specialist", body, stopped, retry, logger, one_pass)


@kopf.daemon(GROUP, VERSION, "ensemblerouters", cancellation_timeout=5.0)
async def router_daemon(stopped: Any, body: Any, logger: Any, memo: Any, retry: int, pod_index: Any,
                        deployment_index: Any, specialist_index: Any, **_: Any) -> None:
    rt: Runtime = memo.runtime

    async def one_pass(state: ObjectState, due: bool) -> None:
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        spec = copy.deepcopy(dict(body.get("spec") or {}))
        selected = selection.selected_specialists(specialist_index.get(namespace, []), spec.get("specialistSelector"))
        pods = tuple(p["ready"] for p in pod_index.get((namespace, "router", name), []) if not p["deleting"])
        secrets = await observe_router_secrets(rt.client(), rt.prober, body)
        observed = router_lc.RouterObserved(name, namespace, meta["uid"], meta.get("generation"), selected, pods, secrets)
        dep = first(deployment_index.get((namespace, name))) or {}
        await decide_and_apply(rt, "EnsembleRouter", body, state, due,
                               (spec, observed, dep.get("hash"), dep.get("generation")),
                               lambda prev: router_lc.decide(spec, observed, prev, now_utc(), rt.ctx), deployment_index)

    await run_daemon(rt, "EnsembleRouter", body, stopped, retry, logger, one_pass)
