"""Cluster mode: a specialist's replicas are the ready endpoints of its Service's EndpointSlices.

Lists `discovery.k8s.io/v1` EndpointSlices labelled `kubernetes.io/service-name=<service>` through
kubernetes_asyncio (kube.py: the pod's service account) and swaps the replica list into the runtime. A watch on
those slices (one per namespace) wakes the re-list the moment one changes, so a pod that turns Ready
is routed, and one that starts terminating is dropped, within a round trip rather than an interval;
the re-list every `polling.discovery_interval_s` stays as the resync if a watch breaks. Endpoints
whose `conditions.ready` is false are left out; the poller still gates on each engine's own /ready.

Outside a pod: CONSORT_KUBE_API, CONSORT_KUBE_TOKEN_FILE, CONSORT_KUBE_CA_FILE (kube.py).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import aiohttp
from kubernetes_asyncio.client import ApiException, DiscoveryV1Api
from kubernetes_asyncio.watch import Watch

from . import kube
from .config import ServiceSelector

if TYPE_CHECKING:
    from .server import Router

log = logging.getLogger("consort.router.discovery")
LIST_TIMEOUT_S = 10
WATCH_S = 300   # the apiserver ends each watch after this; the next one resumes where it stopped


def ready_urls(slices: list[dict], sel: ServiceSelector) -> list[str]:
    """Pure: base URLs of the ready endpoints in a list of EndpointSlice objects."""
    urls = []
    for sl in slices:
        if sl.get("addressType") not in (None, "IPv4", "IPv6", "FQDN"):
            continue
        for ep in sl.get("endpoints") or ():
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in ep.get("addresses") or ():
                host = f"[{addr}]" if sl.get("addressType") == "IPv6" else addr
                urls.append(f"{sel.scheme}://{host}:{sel.port}")
    return sorted(set(urls))


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


async def discovery_loop(router: "Router") -> None:
    try:
        cfg = kube.configuration()
    except ValueError as e:   # said once, loudly: the Service-backed lanes stay without replicas
        log.error("EndpointSlice discovery is off: %s", e)
        return
    async with kube.api_client(cfg) as client:
        api = DiscoveryV1Api(client)
        wake = asyncio.Event()
        watching: dict[str, frozenset[str]] = {}
        watches: list[asyncio.Task] = []
        trigger = "start"
        try:
            while True:
                rt = router.runtime
                wanted = watched_services(rt.config.specialists)
                if wanted != watching:    # first round, or a config reload changed the Services
                    for t in watches:
                        t.cancel()
                    watches = [asyncio.create_task(watch_slices(api, ns, names, wake), name=f"endpointslice-watch-{ns}")
                               for ns, names in wanted.items()]
                    watching = wanted
                await relist(router, api)
                router.metrics.discovery_relists.labels(trigger).inc()
                try:
                    await asyncio.wait_for(wake.wait(), rt.config.polling.discovery_interval_s)
                    trigger = "watch"
                except asyncio.TimeoutError:
                    trigger = "interval"
                wake.clear()
        finally:
            for t in watches:
                t.cancel()
            await asyncio.gather(*watches, return_exceptions=True)   # their sessions close before the client's


async def relist(router: "Router", api: DiscoveryV1Api) -> None:
    """Lists every Service-backed lane's EndpointSlices and swaps changed replica lists in."""
    rt = router.runtime
    changed = False
    for s in rt.config.specialists:
        if s.service is None:
            continue
        try:
            urls = ready_urls(await list_slices(api, s.service), s.service)
        except (ApiException, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.warning("EndpointSlice list for %s failed: %s", s.name, kube.describe(e))
            continue
        if router.lanes.discovered.get(s.name) != urls:
            router.lanes.discovered[s.name] = urls
            changed = True
    if changed:
        reps = dict(rt.replicas)
        for s in rt.config.specialists:
            if s.service is not None:
                reps[s.name] = [router.lanes.replica(s.name, u) for u in router.lanes.discovered.get(s.name, [])]
        router.swap_runtime(replace(rt, replicas=reps))
        if router.poller:
            await router.poller.poll_all()
