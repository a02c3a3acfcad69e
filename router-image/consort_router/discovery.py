"""Cluster mode: a specialist's replicas are the ready endpoints of its Service's EndpointSlices.

Lists `discovery.k8s.io/v1` EndpointSlices labelled `kubernetes.io/service-name=<service>` through
kubernetes_asyncio (kube.py: the pod's service account) and hands each lane's replica URLs to the router (`replace_replicas`). A watch on
those slices (one per namespace) wakes the re-list the moment one changes, so a pod that turns Ready
is routed, and one that starts terminating is dropped, within a round trip rather than an interval;
the re-list every `polling.discovery_interval_s` stays as the resync if a watch breaks. Endpoints
whose `conditions.ready` is false are left out, except a replica the lane already routed that is not
terminating (`lane_replicas`: held while the control plane cannot tell); the poller gates every
replica on the engine's own /ready.

Outside a pod: CONSORT_KUBE_API, CONSORT_KUBE_TOKEN_FILE, CONSORT_KUBE_CA_FILE (kube.py).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

import aiohttp
from kubernetes_asyncio.client import ApiException, DiscoveryV1Api
from kubernetes_asyncio.watch import Watch

from . import kube
from .config import RouterConfig, ServiceSelector, SpecialistRoute
from .metrics import RouterMetrics

log = logging.getLogger("consort.router.discovery")
LIST_TIMEOUT_S = 10
WATCH_S = 300   # the apiserver ends each watch after this; the next one resumes where it stopped


def _endpoint_urls(slices: list[dict], sel: ServiceSelector, keep) -> list[str]:
    urls = []
    for sl in slices:
        if sl.get("addressType") not in (None, "IPv4", "IPv6", "FQDN"):
            continue
        for ep in sl.get("endpoints") or ():
            if not keep(ep.get("conditions") or {}):
                continue
            for addr in ep.get("addresses") or ():
                host = f"[{addr}]" if sl.get("addressType") == "IPv6" else addr
                urls.append(f"{sel.scheme}://{host}:{sel.port}")
    return sorted(set(urls))


def ready_urls(slices: list[dict], sel: ServiceSelector) -> list[str]:
    """Pure: base URLs of the ready endpoints in a list of EndpointSlice objects."""
    return _endpoint_urls(slices, sel, lambda c: c.get("ready") is not False)


def unconfirmed_urls(slices: list[dict], sel: ServiceSelector) -> list[str]:
    """Pure: endpoints listed not ready that are not terminating. A pod whose node stopped reporting
    (the apiserver or the node's kubelet was away) is marked so by the node controller while the
    engine in it may serve on: the control plane cannot tell, not "the engine is unready"."""
    return _endpoint_urls(slices, sel, lambda c: c.get("ready") is False and c.get("terminating") is not True)


def lane_replicas(known: list[str], ready: list[str], unconfirmed: list[str]) -> tuple[list[str], list[str]]:
    """Pure: (the lane's replica URLs, those of them held). Every ready endpoint, and a replica the
    lane already routed that the slices now list as not ready but not terminating: it is held, and
    the router's own /ready probe of it (the poller) decides whether it takes traffic, so a node
    status blink does not empty a lane of healthy engines. A new endpoint enters only when ready; a
    removed or terminating one leaves at once."""
    held = sorted(set(known) & set(unconfirmed))
    return sorted(set(ready) | set(held)), held


def service_selector(services: frozenset[str] | set[str]) -> str:
    """Pure: the label selector of these Services' EndpointSlices."""
    return f"kubernetes.io/service-name in ({','.join(sorted(services))})"


async def list_slices(api: DiscoveryV1Api, sel: ServiceSelector) -> list[dict]:
    """The Service's EndpointSlices as the apiserver's JSON (camelCase keys, what `ready_urls` reads)."""
    got = await api.list_namespaced_endpoint_slice(sel.namespace, label_selector=service_selector({sel.service}),
                                                   _request_timeout=LIST_TIMEOUT_S)
    return api.api_client.sanitize_for_serialization(got).get("items") or []


def watched_services(specialists) -> dict[str, frozenset[str]]:
    """Pure: namespace -> the Service names whose EndpointSlices the router watches there."""
    out: dict[str, set[str]] = {}
    for s in specialists:
        if s.service is not None:
            out.setdefault(s.service.namespace, set()).add(s.service.service)
    return {ns: frozenset(names) for ns, names in out.items()}


async def watch_slices(api: DiscoveryV1Api, namespace: str, services: frozenset[str], wake: asyncio.Event) -> None:
    """Sets `wake` on every event of a watch on these Services' EndpointSlices (the re-list reads
    them). The apiserver ends each watch after WATCH_S; the next resumes from the last resourceVersion
    seen (from scratch, with a wake-up, when that is too old). A broken watch backs off and restarts."""
    selector = service_selector(services)
    version: str | None = None
    backoff = 1.0
    while True:
        watch = Watch(return_type="object")   # events stay dicts: only their arrival matters here
        failed = ""
        try:
            async with watch.stream(api.list_namespaced_endpoint_slice, namespace, label_selector=selector,
                                    resource_version=version, timeout_seconds=WATCH_S,
                                    _request_timeout=(10, WATCH_S + 30)) as events:
                async for _ in events:
                    wake.set()
                    backoff = 1.0
        except ApiException as e:
            if e.status == 410:   # that resourceVersion is compacted away: start over, and re-list now
                watch.resource_version = None
                wake.set()
            else:
                failed = kube.describe(e)
        except Exception as e:  # noqa: BLE001 - connection, timeout, malformed event: retry, never die
            failed = kube.describe(e)
        version = watch.resource_version
        if failed:
            log.warning("EndpointSlice watch in %s failed (re-listing every interval meanwhile): %s", namespace, failed)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)


# lane -> its replica URLs now, for every Service-backed lane: the router swaps them in and probes them
ReplaceReplicas = Callable[[dict[str, list[str]]], Awaitable[None]]


async def discovery_loop(config: Callable[[], RouterConfig], replace_replicas: ReplaceReplicas,
                         metrics: RouterMetrics) -> None:
    """List and watch the EndpointSlices of the Services that `config()` (the config now: a reload may
    change the Services) names, until cancelled; every change of a lane's replicas goes to
    `replace_replicas`."""
    try:
        cfg = kube.configuration()
    except ValueError as e:   # said once, loudly: the Service-backed lanes stay without replicas
        log.error("EndpointSlice discovery is off: %s", e)
        return
    known: dict[str, list[str]] = {}   # lane -> the replica URLs last handed over
    held: dict[str, list[str]] = {}    # lane -> those of them listed not ready, yet kept
    async with kube.api_client(cfg) as client:
        api = DiscoveryV1Api(client)
        wake = asyncio.Event()
        watching: dict[str, frozenset[str]] = {}
        watches: list[asyncio.Task] = []
        trigger = "start"
        try:
            while True:
                specialists = config().specialists
                wanted = watched_services(specialists)
                if wanted != watching:    # first round, or a config reload changed the Services
                    for t in watches:
                        t.cancel()
                    watches = [asyncio.create_task(watch_slices(api, ns, names, wake), name=f"endpointslice-watch-{ns}")
                               for ns, names in wanted.items()]
                    watching = wanted
                if await relist(api, specialists, known, held, metrics):
                    await replace_replicas({s.name: known.get(s.name, []) for s in specialists if s.service is not None})
                metrics.discovery_relists.labels(trigger).inc()
                try:
                    await asyncio.wait_for(wake.wait(), config().polling.discovery_interval_s)
                    trigger = "watch"
                except asyncio.TimeoutError:
                    trigger = "interval"
                wake.clear()
        finally:
            for t in watches:
                t.cancel()
            await asyncio.gather(*watches, return_exceptions=True)   # their sessions close before the client's


async def relist(api: DiscoveryV1Api, specialists: Sequence[SpecialistRoute], known: dict[str, list[str]], held: dict[str, list[str]],
                 metrics: RouterMetrics) -> bool:
    """Lists every Service-backed lane's EndpointSlices into `known` (and `held`); True when a lane's
    replica list changed."""
    changed = False
    for s in specialists:
        if s.service is None:
            continue
        try:
            slices = await list_slices(api, s.service)
        except (ApiException, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.warning("EndpointSlice list for %s failed: %s", s.name, kube.describe(e))
            continue
        urls, now_held = lane_replicas(known.get(s.name, []), ready_urls(slices, s.service),
                                       unconfirmed_urls(slices, s.service))
        if now_held != held.get(s.name, []):
            if now_held:
                log.warning("lane %s: EndpointSlices mark %d replica(s) not ready without terminating them; "
                            "held, the router's own /ready probes decide: %s", s.name, len(now_held),
                            ", ".join(now_held))
            else:
                log.info("lane %s: no replica held any more", s.name)
            held[s.name] = now_held
        metrics.discovery_held.labels(s.name).set(len(now_held))
        if known.get(s.name, []) != urls:
            known[s.name] = urls
            changed = True
    return changed
