"""Warmup gating with real local `consort engine` processes reached through the injectable
pod-address resolver (kwok's pods are fake: Ready at once, IPs never contacted)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from kube import NotYet, condition, wait_for
from opkit import CONSORT, get_json, free_port
from procs import start_process

from consort_operator.lifecycle import slo

pytestmark = pytest.mark.e2e
SLO_MS = 60000      # generous objectives: every request meets them


def specialist(name: str, replicas: int, min_ready: int) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist", "metadata": {"name": name},
        "spec": {"model": {"source": "demo://tiny"}, "replicas": replicas, "minReady": min_ready,
                 "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"}, "kv": {"blockSize": 16, "numBlocks": 128},
                 "warmupTimeoutSeconds": 600, "slo": {"ttftMs": SLO_MS, "itlMs": SLO_MS}},
    })


class Engine:
    def __init__(self, model: str, name: str, port: int, log: Path):
        self.port = port
        self.proc = start_process([CONSORT, "engine", "--model", model, "--port", str(port), "--host", "127.0.0.1",
                                   "--name", name, "--num-blocks", "128", "--slo-ttft-ms", str(SLO_MS),
                                   "--slo-itl-ms", str(SLO_MS)], log.stem, log.parent)

    def stop(self) -> None:
        self.proc.stop(20)


@pytest.fixture
def demo_model() -> str:
    from consort_operator.local import CACHE, local_model_dir

    return local_model_dir("demo://tiny", CACHE, print)


def status(cluster, namespace: str, name: str) -> dict:
    return get_json(cluster, "specialist", name, "-n", namespace).get("status") or {}


def wait_status(cluster, namespace, name, what, pred, timeout=120):
    def check():
        st = status(cluster, namespace, name)
        if not pred(st):
            raise NotYet(json.dumps({k: st.get(k) for k in ("phase", "ready", "warmReplicas", "replicaStatus")}))
        return st
    return wait_for(check, timeout, what, interval=0.5)


@pytest.mark.timeout(420)
def test_warmup_gating_follows_the_engines_not_kwok(cluster, namespace, operator_factory, demo_model, tmp_path):
    mapping = tmp_path / "pod-addresses.json"
    mapping.write_text("{}")
    operator_factory(namespace, "--warm-signal", "engine", "--pod-address", f"file:{mapping}")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("warm", 2, 2))

    def two_ready_pods() -> list[str]:
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "consort.dev/specialist=warm")["items"]
        ready = [p["metadata"]["name"] for p in pods
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        if len(ready) != 2:
            raise NotYet(f"{len(pods)} pods, {len(ready)} Ready")
        return sorted(ready)

    pod_a, pod_b = wait_for(two_ready_pods, 60, "two kwok pods Ready")
    # kwok says Ready, but no engine answers: the Specialist is not Ready.
    st = wait_status(cluster, namespace, "warm", "Warming with kwok pods Ready",
                     lambda s: s.get("phase") == "Warming" and s.get("replicas") == 2)
    assert st["warmReplicas"] == 0 and {r["source"] for r in st["replicaStatus"]} == {"none"}
    time.sleep(3)
    assert status(cluster, namespace, "warm")["phase"] == "Warming"

    port_a, port_b = free_port(), free_port()
    mapping.write_text(json.dumps({f"{namespace}/{pod_a}": f"127.0.0.1:{port_a}", pod_b: f"127.0.0.1:{port_b}"}))
    engines = [Engine(demo_model, "warm", port_a, tmp_path / "engine-a.log")]
    try:
        st = wait_status(cluster, namespace, "warm", "one replica warm",
                         lambda s: s.get("warmReplicas") == 1, timeout=90)
        assert st["phase"] == "Warming" and st["ready"] == "1/2"
        assert {r["pod"]: (r["warm"], r["source"]) for r in st["replicaStatus"]} == {pod_a: (True, "engine"), pod_b: (False, "none")}

        engines.append(Engine(demo_model, "warm", port_b, tmp_path / "engine-b.log"))
        sp_ready = wait_status(cluster, namespace, "warm", "Ready with both engines warm",
                               lambda s: s.get("phase") == "Ready" and s.get("warmReplicas") == 2, timeout=90)
        obj = get_json(cluster, "specialist", "warm", "-n", namespace)
        assert condition(obj, "Ready")["status"] == "True" and condition(obj, "Warm")["status"] == "True"
        assert sp_ready["ready"] == "2/2"
        assert condition(obj, "SLOMet")["reason"] == "NotEnoughRequests"

        # SLO attainment: the engines judge each request against spec.slo; the status pools them.
        import httpx
        for _ in range(slo.MIN_REQUESTS):
            r = httpx.post(f"http://127.0.0.1:{port_a}/v1/completions", timeout=60,
                           json={"prompt": "x", "max_tokens": 3, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
        st = wait_status(cluster, namespace, "warm", "SLO attainment pooled",
                         lambda s: ((s.get("slo") or {}).get("ttft") or {}).get("requests", 0) >= slo.MIN_REQUESTS)
        assert st["slo"]["ttft"]["attainment"] == 1.0 and st["slo"]["itl"]["targetMs"] == SLO_MS
        assert condition(get_json(cluster, "specialist", "warm", "-n", namespace), "SLOMet")["status"] == "True"

        # Scale-up: the new replica counts only once its engine is warm (it has none here).
        cluster.kubectl("patch", "specialist", "warm", "-n", namespace, "--type", "merge", "-p", '{"spec": {"replicas": 3}}')
        st = wait_status(cluster, namespace, "warm", "three replicas, two warm",
                         lambda s: s.get("replicas") == 3 and s.get("desiredReplicas") == 3)
        assert st["phase"] == "Ready" and st["warmReplicas"] == 2 and st["ready"] == "2/3"
        obj = get_json(cluster, "specialist", "warm", "-n", namespace)
        assert condition(obj, "Warm")["status"] == "False"

        # An engine going away drops the Specialist below minReady.
        engines[0].stop()
        st = wait_status(cluster, namespace, "warm", "Degraded after an engine stopped",
                         lambda s: s.get("phase") == "Degraded", timeout=60)
        assert st["warmReplicas"] == 1

        events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=warm")["items"]
        reasons = [e["reason"] for e in events]
        assert {"ReplicaWarm", "Warming", "Ready", "ReplicaCold", "Degraded"} <= set(reasons), reasons
    finally:
        for e in engines:
            e.stop()
