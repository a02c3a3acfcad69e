"""Cluster mode: a specialist's replicas are the ready endpoints of its Service's EndpointSlices.

Lists `discovery.k8s.io/v1` EndpointSlices labelled `kubernetes.io/service-name=<service>` every
`polling.discovery_interval_s` with the pod's service-account token (in-cluster), and swaps the
replica list into the runtime. Endpoints whose `conditions.ready` is false are left out; the poller
still gates on each engine's own /ready.

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


async def list_slices(session: aiohttp.ClientSession, api: str, token: str | None, ssl_ctx,
                      sel: ServiceSelector) -> list[dict]:
    url = f"{api}/apis/discovery.k8s.io/v1/namespaces/{sel.namespace}/endpointslices"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.get(url, params={"labelSelector": f"kubernetes.io/service-name={sel.service}"},
                           headers=headers, ssl=ssl_ctx, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        return (await resp.json()).get("items") or []


async def discovery_loop(router: "Router") -> None:
    api, token, ssl_ctx = api_settings()
    assert router.session is not None
    while True:
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
        await asyncio.sleep(rt.config.polling.discovery_interval_s)
