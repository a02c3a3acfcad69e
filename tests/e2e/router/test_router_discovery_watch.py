"""The router in cluster mode against the real apiserver: an EndpointSlice change wakes its re-list
through the watch, long before the re-list interval (120 s here).

The slice's only endpoint is not ready, so the router never dials it (its address is in TEST-NET-1
and nothing here may leave the machine); what is observed is the re-list the watch triggers
(`consort_router_discovery_relists_total{trigger="watch"}`), for a change and for a delete. The
router's list (kubernetes_asyncio, the JSON `ready_urls` reads) is checked in this process on a slice
with a ready endpoint, which the router process is not given to dial.
"""
from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import httpx
import pytest
import yaml

import procs
from kube import NotYet, wait_for

pytestmark = pytest.mark.e2e


def relists(url: str, trigger: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf'^consort_router_discovery_relists_total{{trigger="{trigger}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def replica_urls(url: str) -> list[str]:
    return [r["url"] for r in httpx.get(url + "/v1/routing", timeout=10).json()["specialists"]["a"]["replicas"]]


def watch_relisted(url: str, before: float) -> float:
    n = relists(url, "watch")
    if n <= before:
        raise NotYet(f"watch-triggered re-lists still {n}")
    return n


def test_an_endpointslice_change_reaches_the_router_through_the_watch(cluster, namespace, tmp_path):
    kc = json.loads(cluster.kubeconfig.read_text())
    server = kc["clusters"][0]["cluster"]["server"]
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    (tmp_path / "token").write_text(kc["users"][0]["user"]["token"])
    config = {"ensemble": "ens", "store": {"kind": "none"},
              "specialists": [{"name": "a", "service": {"namespace": namespace, "service": "a", "port": 8000}}],
              "polling": {"interval_s": 0.5, "discovery_interval_s": 120}}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    port = procs.free_port()
    router = procs.start_process([procs.CONSORT, "router", "--config", str(tmp_path / "router.yaml"), "--port", str(port)],
                                 f"router-watch-{port}", tmp_path / "logs",
                                 env={"CONSORT_KUBE_API": server, "CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "token"),
                                      "CONSORT_KUBE_CA_FILE": str(tmp_path / "ca.crt")})
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(url + "/health", router, timeout=60)
        wait_for(lambda: relists(url, "start") == 1, 30, "the router's first EndpointSlice list")
        time.sleep(1)   # the watch's initial events (none: no slice yet) have settled
        before = relists(url, "watch")
        apply_slice(cluster, namespace, "a-1", "a", 8000, [{"addresses": ["192.0.2.10"], "conditions": {"ready": False}}])
        created = wait_for(lambda: watch_relisted(url, before), 20, "a watch-triggered re-list after the EndpointSlice was created")
        assert replica_urls(url) == [], "a not-ready endpoint must not become a replica"
        cluster.kubectl("delete", "endpointslice", "a-1", "-n", namespace)
        wait_for(lambda: watch_relisted(url, created), 20, "a watch-triggered re-list after the EndpointSlice was deleted")
        assert relists(url, "interval") == 0
    finally:
        code = router.stop()
    assert code == 0, router.tail()


def apply_slice(cluster, namespace: str, name: str, service: str, port: int, endpoints: list[dict]) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4", "endpoints": endpoints,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}))


def test_the_router_lists_ready_endpoints_through_kubernetes_asyncio(cluster, namespace, tmp_path):
    from consort_router import kube
    from consort_router.config import ServiceSelector
    from consort_router.discovery import list_slices, ready_urls
    from kubernetes_asyncio.client import DiscoveryV1Api

    kc = json.loads(cluster.kubeconfig.read_text())
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    (tmp_path / "token").write_text(kc["users"][0]["user"]["token"])
    env = {"CONSORT_KUBE_API": kc["clusters"][0]["cluster"]["server"], "CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "token"),
           "CONSORT_KUBE_CA_FILE": str(tmp_path / "ca.crt")}
    apply_slice(cluster, namespace, "a-1", "a", 8000, [{"addresses": ["192.0.2.10"], "conditions": {"ready": False}},
                                                       {"addresses": ["192.0.2.11"], "conditions": {"ready": True}},
                                                       {"addresses": ["192.0.2.12"]}])   # ready unknown: counted
    apply_slice(cluster, namespace, "b-1", "b", 8000, [{"addresses": ["192.0.2.13"], "conditions": {"ready": True}}])
    sel = ServiceSelector(namespace=namespace, service="a", port=8000)

    async def urls() -> list[str]:
        async with kube.api_client(kube.configuration(env)) as client:
            return ready_urls(await list_slices(DiscoveryV1Api(client), sel), sel)

    assert asyncio.run(urls()) == ["http://192.0.2.11:8000", "http://192.0.2.12:8000"]


def test_the_watch_resumes_where_it_ended_and_restarts_after_failing(cluster, namespace, tmp_path, monkeypatch, caplog):
    """Watches the apiserver ends (after 1 s here) resume from the last resourceVersion: no replayed
    events, so no spurious re-lists. A watch refused (the token went bad) backs off and restarts, and
    the events it missed meanwhile still wake the re-list."""
    from consort_router import discovery, kube
    from kubernetes_asyncio.client import DiscoveryV1Api

    monkeypatch.setattr(discovery, "WATCH_S", 1)
    kc = json.loads(cluster.kubeconfig.read_text())
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    token = kc["users"][0]["user"]["token"]
    (tmp_path / "token").write_text(token)
    cfg = kube.configuration({"CONSORT_KUBE_API": kc["clusters"][0]["cluster"]["server"],
                              "CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "token"), "CONSORT_KUBE_CA_FILE": str(tmp_path / "ca.crt")})
    apply_slice(cluster, namespace, "a-1", "a", 8000, [{"addresses": ["192.0.2.10"], "conditions": {"ready": False}}])

    async def scenario() -> dict:
        async with kube.api_client(cfg) as client:
            wake = asyncio.Event()
            task = asyncio.create_task(discovery.watch_slices(DiscoveryV1Api(client), namespace, frozenset({"a"}), wake))
            try:
                await asyncio.wait_for(wake.wait(), 10)       # a-1's ADDED
                wake.clear()
                await asyncio.sleep(3.5)                      # three or so watches ended and resumed
                replayed = wake.is_set()
                (tmp_path / "token").write_text("not-a-token")
                await asyncio.sleep(2.5)                      # refused (401), backing off
                refused_wake = wake.is_set()
                (tmp_path / "token").write_text(token)
                await asyncio.to_thread(apply_slice, cluster, namespace, "a-2", "a", 8000,
                                        [{"addresses": ["192.0.2.11"], "conditions": {"ready": False}}])
                await asyncio.wait_for(wake.wait(), 15)       # the restarted watch delivers a-2's ADDED
                return {"replayed": replayed, "refused_wake": refused_wake}
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level("WARNING", logger="consort.router.discovery"):
        got = asyncio.run(scenario())
    assert got == {"replayed": False, "refused_wake": False}
    assert any("401" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
