"""Observe: one typed snapshot of what a Specialist's pass decides from, out of Kopf's indexes and the
engines' own answers (probes through the pod-address resolver)."""
from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

from .api.specialist import SpecialistSpec
from .lifecycle import pacing as pacing_lc
from .lifecycle import selection
from .lifecycle import specialist as specialist_lc
from .lifecycle import warmup as warmup_lc
from .resolver import PodRef
from .runtime import Runtime


def first(store: Any) -> Any:
    """The one entry of a Kopf index store (None when empty)."""
    return next(iter(store), None) if store else None


async def observe_specialist(rt: Runtime, body: Any, pod_index: Any, deployment_index: Any,
                             router_index: Any) -> tuple[specialist_lc.SpecialistObserved, Any]:
    """One typed snapshot: the engine Deployment and pods (Kopf's indexes), the engines' /ready and
    /v1/status (probes, where pacing.probes_wanted), and the breaker states of the EnsembleRouters
    that select this Specialist. Also the Deployment's hash and generation (what children.py reads)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    dep_raw = first(deployment_index.get((namespace, name)))
    dep = warmup_lc.DeploymentObs(**{k: dep_raw[k] for k in (
        "generation", "observed_generation", "replicas", "updated_replicas", "ready_replicas",
        "available_replicas")}) if dep_raw else None
    pods_raw = list(pod_index.get((namespace, "engine", name), []))
    port = spec.get("port") or SpecialistSpec.model_fields["port"].default
    targets, unaddressed = {}, []
    if rt.prober is not None and pacing_lc.probes_wanted(rt.warm_signal, bool(spec.get("adapters"))):  # type: ignore[arg-type]
        ips = {p["name"]: p["ip"] for p in pods_raw}
        for pod in pacing_lc.probe_targets(pods_raw):
            addr = rt.resolver.resolve(PodRef(namespace, pod, ips[pod], port))
            targets.update({pod: addr} if addr else {})
            unaddressed += [] if addr else [pod]
    labels = dict(meta.get("labels") or {})
    selecting = selection.selecting_routers(router_index.get(namespace, []), labels)
    routers = tuple(sorted(r["name"] for r in selecting))   # the engines accept each one's credential
    credentials = []   # what the engines accept from each (read again only when a router's digest moves)
    for r in sorted(selecting, key=lambda r: r["name"]):
        text = await rt.accepted.read(rt.client(), namespace, r["name"], r["uid"], r.get("credentialDigest"))
        credentials += [(r["name"], text)] if text is not None else []
    token = rt.prober.token(namespace, routers) if targets else None
    results = await asyncio.gather(*(rt.prober.probe(a, token) for a in targets.values())) if targets else []
    observed = specialist_lc.SpecialistObserved(
        name, namespace, meta["uid"], meta.get("generation"), dep, tuple(_pod(p) for p in pods_raw),
        dict(zip(targets, results)), tuple(r["breakerState"] for r in selecting), routers, tuple(unaddressed),
        tuple(credentials))
    return observed, (dep_raw or {}).get("hash")


def _pod(p: dict[str, Any]) -> warmup_lc.PodObs:
    started = p.get("started_at")
    return warmup_lc.PodObs(
        name=p["name"], phase=p["phase"], ready=p["ready"], scheduled=p["scheduled"], deleting=p["deleting"],
        started_at=datetime.strptime(started, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) if started else None,
        restarts=p["restarts"], waiting_reason=p["waiting_reason"], template_hash=p["template_hash"])
