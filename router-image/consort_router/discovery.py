"""Cluster mode: a specialist's replicas are the ready endpoints of its Service's EndpointSlices.

Lists `discovery.k8s.io/v1` EndpointSlices labelled `kubernetes.io/service-name=<service>` with the
pod's service-account token (in-cluster) and swaps the replica list into the runtime. A watch on
those slices (one per namespace) wakes the re-list the moment one changes, so a pod that turns Ready
is routed, and one that starts terminating is dropped, within a round trip rather than an interval;
the re-list every `polling.discovery_interval_s` stays as the resync if a watch breaks. Endpoints
whose `conditions.ready` is false are left out; the poller still gates on each engine's own /ready.

Environment overrides (for running outside a pod): CONSORT_KUBE_API (https://host:port),
CONSORT_KUBE_TOKEN_FILE, CONSORT_KUBE_CA_FILE.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import replace
from typing import TYPE_CHECKING

import aiohttp

from .config import ServiceSelector

if TYPE_CHECKING:
    from .server import Router

log = logging.getLogger("consort.router.discovery")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


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


def api_settings() -> tuple[str, str | None, ssl.SSLContext | bool]:
    api = os.environ.get("CONSORT_KUBE_API")
    if not api:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("no Kubernetes API: not in a pod and CONSORT_KUBE_API is unset")
        api = f"https://{host}:{port}"
    token_file = os.environ.get("CONSORT_KUBE_TOKEN_FILE", f"{SA_DIR}/token")
    token = open(token_file).read().strip() if os.path.exists(token_file) else None
    ca = os.environ.get("CONSORT_KUBE_CA_FILE", f"{SA_DIR}/ca.crt")
    ctx: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if os.path.exists(ca) else True
    return api.rstrip("/"), token, ctx


def slices_request(api: str, token: str | None, namespace: str, services: frozenset[str] | set[str]) -> dict:
    """url, params and headers of a list (or, with watch=1 added, a watch) of these Services' EndpointSlices."""
    return {"url": f"{api}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            "params": {"labelSelector": f"kubernetes.io/service-name in ({','.join(sorted(services))})"},
            "headers": {"Authorization": f"Bearer {token}"} if token else {}}


async def list_slices(session: aiohttp.ClientSession, api: str, token: str | None, ssl_ctx,
                      sel: ServiceSelector) -> list[dict]:
    req = slices_request(api, token, sel.namespace, {sel.service})
    async with session.get(req["url"], params=req["params"], headers=req["headers"], ssl=ssl_ctx,
                           timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        return (await resp.json()).get("items") or []


def watched_services(specialists) -> dict[str, frozenset[str]]:
    """Pure: namespace -> the Service names whose EndpointSlices the router watches there."""
    out: dict[str, set[str]] = {}
    for s in specialists:
        if s.service is not None:
            out.setdefault(s.service.namespace, set()).add(s.service.service)
    return {ns: frozenset(names) for ns, names in out.items()}


async def watch_slices(session: aiohttp.ClientSession, api: str, token: str | None, ssl_ctx, namespace: str,
                       services: frozenset[str], wake: asyncio.Event) -> None:
    """Sets `wake` on every event of a watch on these Services' EndpointSlices (the re-list reads
    them); reconnects when the apiserver ends the watch or the connection drops."""
    req = slices_request(api, token, namespace, services)
    params = {**req["params"], "watch": "1", "timeoutSeconds": "300"}
    while True:
        try:
            async with session.get(req["url"], params=params, headers=req["headers"], ssl=ssl_ctx,
                                   timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=330)) as resp:
                resp.raise_for_status()
                async for line in resp.content:   # one JSON event per line
                    if line.strip():
                        wake.set()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("EndpointSlice watch in %s failed (re-listing every interval meanwhile): %s", namespace, e)
            await asyncio.sleep(2)


async def discovery_loop(router: "Router") -> None:
    api, token, ssl_ctx = api_settings()
    assert router.session is not None
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
                watches = [asyncio.create_task(watch_slices(router.session, api, token, ssl_ctx, ns, names, wake),
                                               name=f"endpointslice-watch-{ns}") for ns, names in wanted.items()]
                watching = wanted
            await relist(router, api, token, ssl_ctx)
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


async def relist(router: "Router", api: str, token: str | None, ssl_ctx) -> None:
    """Lists every Service-backed lane's EndpointSlices and swaps changed replica lists in."""
    rt = router.runtime
    changed = False
    for s in rt.config.specialists:
        if s.service is None:
            continue
        try:
            urls = ready_urls(await list_slices(router.session, api, token, ssl_ctx, s.service), s.service)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.warning("EndpointSlice list for %s failed: %s", s.name, e)
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
