"""Adapter rollout as reconciled state: Loading -> Probation (the new adapter takes the lane, whose
revision changes so the router's correctness window restarts) -> Active or RolledBack from the
samples the router reports in its EnsembleRouter status."""
from __future__ import annotations

import json
import time

import pytest
import yaml
from kube import NotYet, condition, wait_for
from opkit import get_json, wait_phase

pytestmark = pytest.mark.e2e


def specialist(adapters: list[str]) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
        "metadata": {"name": "algo", "labels": {"consort.dev/ensemble": "r"}},
        "spec": {"model": {"source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"}, "intents": ["codegen"],
                 "adapters": [{"name": a, "source": f"file:///adapters/{a}"} for a in adapters],
                 "rollout": {"probationSamples": 200, "promotionFloor": 0.9}}})


ROUTER = yaml.safe_dump({"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": "front"},
                         "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "r"}}, "replicas": 1}})


def lane(cluster, namespace: str) -> dict:
    cm = get_json(cluster, "configmap", "front-router", "-n", namespace)
    return yaml.safe_load(cm["data"]["router.yaml"])["specialists"][0]


def adapter_states(cluster, namespace: str) -> dict[str, str]:
    st = get_json(cluster, "specialist", "algo", "-n", namespace).get("status") or {}
    return {a["name"]: a["state"] for a in st.get("adapters") or []}


def wait_states(cluster, namespace, want: dict[str, str], timeout=60):
    def check():
        got = adapter_states(cluster, namespace)
        if got != want:
            raise NotYet(f"adapters {got}")
        return got
    return wait_for(check, timeout, f"adapter states {want}", interval=0.5)


def wait_lane(cluster, namespace, adapter: str, timeout=60) -> dict:
    def check():
        ln = lane(cluster, namespace)
        if ln.get("adapter") != adapter:
            raise NotYet(f"lane {ln}")
        return ln
    return wait_for(check, timeout, f"router lane default adapter {adapter}", interval=0.5)


def router_reports(cluster, namespace, revision: str, total: int, rate: float) -> None:
    """What the router's breaker store writes: samples since the lane revision and the window."""
    window = [1.0] * round(50 * rate) + [0.0] * (50 - round(50 * rate))
    entry = {"state": "closed", "revision": revision, "total": total, "samples": window, "since": time.time()}
    cluster.kubectl("patch", "ensemblerouter", "front", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"breakerState": {"version": 1, "breakers": {"algo": entry}}}}))


@pytest.mark.timeout(300)
def test_adapter_rollout_promotes_and_rolls_back_from_router_samples(cluster, namespace, operator_factory):
    operator_factory(namespace, "--warm-signal", "pod-ready", "--pod-address", "none")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist(["v1"]) + "---\n" + ROUTER)
    wait_phase(cluster, namespace, "specialist", "algo", "Ready", timeout=90)
    # Warm replicas passed /ready, which requires every adapter loaded: Loading -> Probation.
    wait_states(cluster, namespace, {"v1": "Probation"})
    r1 = wait_lane(cluster, namespace, "v1")["revision"]
    sp = get_json(cluster, "specialist", "algo", "-n", namespace)
    assert condition(sp, "AdapterRollout")["status"] == "True" and condition(sp, "AdapterRollout")["reason"] == "Probation"

    router_reports(cluster, namespace, "stale-revision", 500, 1.0)     # samples of another rotation: ignored
    time.sleep(3)
    assert adapter_states(cluster, namespace) == {"v1": "Probation"}
    router_reports(cluster, namespace, r1, 250, 0.96)
    wait_states(cluster, namespace, {"v1": "Active"})
    sp = get_json(cluster, "specialist", "algo", "-n", namespace)
    assert sp["status"]["activeAdapter"] == "v1"
    assert condition(sp, "AdapterRollout")["reason"] == "Stable"
    v1 = next(a for a in sp["status"]["adapters"] if a["name"] == "v1")
    assert v1["samples"] == 250 and v1["rate"] == 0.96
    cols = cluster.kubectl("get", "specialist", "algo", "-n", namespace, "--no-headers").stdout.split()
    assert cols[3] == "v1", cols

    template = get_json(cluster, "deployment", "algo", "-n", namespace)["spec"]["template"]
    # Rotation to v2: it takes the lane under a new revision; its samples fail the floor.
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist(["v1", "v2"]))
    wait_states(cluster, namespace, {"v1": "Active", "v2": "Probation"}, timeout=90)
    r2 = wait_lane(cluster, namespace, "v2")["revision"]
    assert r2 != r1
    router_reports(cluster, namespace, r2, 220, 0.5)
    wait_states(cluster, namespace, {"v1": "Active", "v2": "RolledBack"})
    wait_lane(cluster, namespace, "v1")

    def v2_unloaded() -> list[str]:
        data = get_json(cluster, "configmap", "algo-adapters", "-n", namespace)["data"]["adapters.json"]
        adapters = [f"{a['name']}={a['path']}" for a in json.loads(data)["adapters"]]
        if adapters != ["v1=/adapters/v1"]:
            raise NotYet(f"adapters.json lists {adapters}")
        return adapters
    wait_for(v2_unloaded, 60, "the engines to stop loading the rolled-back adapter")
    # The rotation and the rollback went through the engines' adapters file: the pods were never rolled.
    assert get_json(cluster, "deployment", "algo", "-n", namespace)["spec"]["template"] == template
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=algo,involvedObject.kind=Specialist")["items"]
    reasons = {(e["type"], e["reason"]) for e in events}
    assert {("Normal", "AdapterProbation"), ("Normal", "AdapterPromoted"), ("Warning", "AdapterRolledBack")} <= reasons, reasons
    sp = get_json(cluster, "specialist", "algo", "-n", namespace)
    assert sp["status"]["activeAdapter"] == "v1" and condition(sp, "AdapterRollout")["reason"] == "RolledBack"
