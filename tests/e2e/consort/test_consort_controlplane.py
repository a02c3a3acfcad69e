"""Proof that the local control plane is a real Kubernetes: apiserver validation, kube-scheduler
placement by extended resources, kwok-driven pod readiness, garbage collection, and Helm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kube import NotYet, condition, owned_by, wait_for

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPO = Path(__file__).resolve().parents[3]
GPU = "nvidia.com/gpu"


def pinned_kubernetes_version() -> str:
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        if line.startswith("KUBERNETES_VERSION="):
            return line.split("=", 1)[1].split()[0]
    raise AssertionError("KUBERNETES_VERSION missing from hack/versions.env")


def gpu_capacity_by_node(cluster) -> dict[str, int]:
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    return {n["metadata"]["name"]: int(n["status"].get("capacity", {}).get(GPU, "0")) for n in nodes}


def deployment(name: str, replicas: int, gpus: int = 0) -> dict:
    resources: dict = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    if gpus:
        resources["limits"] = {GPU: str(gpus)}
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                {"name": "main", "image": "registry.invalid/consort-e2e:0.1.0", "resources": resources}]}},
        },
    }


def wait_deployment_ready(cluster, namespace: str, name: str, replicas: int, timeout: float = 60) -> dict:
    def ready() -> dict:
        dep = cluster.kubectl_json("get", "deployment", name, "-n", namespace)
        status = dep.get("status", {})
        if status.get("readyReplicas") != replicas or status.get("updatedReplicas") != replicas:
            raise NotYet(f"status {json.dumps(status)}")
        return dep

    return wait_for(ready, timeout, f"deployment {namespace}/{name} to have {replicas} ready replicas")


@pytest.fixture(scope="module")
def widget_crd(cluster):
    """The Widget CRD (cluster-scoped, so shared by this module's tests), removed afterwards."""
    cluster.kubectl("apply", "-f", str(FIXTURES / "widget-crd.yaml"))
    wait_for(lambda: (condition(cluster.kubectl_json("get", "crd", "widgets.e2e.consort.dev"), "Established")
                      or {}).get("status") == "True", 30, "CRD widgets.e2e.consort.dev to be Established")
    yield "widgets.e2e.consort.dev"
    cluster.kubectl("delete", "-f", str(FIXTURES / "widget-crd.yaml"), "--ignore-not-found", "--timeout=60s")


def test_kubectl_and_apiserver_report_the_pinned_release(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    pinned = pinned_kubernetes_version()
    assert version["serverVersion"]["gitVersion"] == pinned
    assert version["clientVersion"]["gitVersion"] == pinned
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == ("1", pinned.split(".")[1])


def test_kwok_nodes_advertise_gpus_and_are_ready(cluster):
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    gpus = gpu_capacity_by_node(cluster)
    assert sum(1 for n in gpus.values() if n >= 8) >= 2, gpus
    assert any(n == 0 for n in gpus.values()), f"expected a CPU-only node: {gpus}"
    for node in nodes:
        assert condition(node, "Ready")["status"] == "True", node["metadata"]["name"]
    # The same view through the Python client the operator uses.
    from kubernetes import client

    listed = client.CoreV1Api(cluster.api_client()).list_node()
    assert {n.metadata.name for n in listed.items} == set(gpus)


def test_crd_schema_rejects_invalid_object_with_apiserver_message(cluster, namespace, widget_crd):
    def widget(name: str, spec: dict) -> str:
        return json.dumps({"apiVersion": "e2e.consort.dev/v1", "kind": "Widget",
                           "metadata": {"name": name, "namespace": namespace}, "spec": spec})

    # Discovery of a fresh CRD can lag Established by a moment; retry the valid apply until served.
    wait_for(lambda: cluster.kubectl("apply", "-f", "-", input=widget("good", {"size": "small", "replicas": 2}),
                                     check=False).returncode == 0, 30, "a valid Widget to be accepted")
    rejected = cluster.kubectl("apply", "-f", "-", input=widget("bad", {"size": "huge", "replicas": 0}), check=False)
    assert rejected.returncode != 0
    assert 'The Widget "bad" is invalid' in rejected.stderr
    assert 'spec.size: Unsupported value: "huge": supported values: "small", "large"' in rejected.stderr
    assert "spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or equal to 1" \
        in rejected.stderr
    missing = cluster.kubectl("apply", "-f", "-", input=widget("empty", {}), check=False)
    assert missing.returncode != 0 and "spec.size: Required value" in missing.stderr
    names = {w["metadata"]["name"] for w in cluster.kubectl_json("get", "widgets", "-n", namespace)["items"]}
    assert names == {"good"}


def test_gpu_deployment_is_scheduled_onto_gpu_nodes_and_ready(cluster, namespace):
    gpu_nodes = {name for name, n in gpu_capacity_by_node(cluster).items() if n > 0}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(deployment("gpu-app", 3, gpus=1)))
    wait_deployment_ready(cluster, namespace, "gpu-app", 3)
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "app=gpu-app")["items"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"]["nodeName"] in gpu_nodes, (pod["metadata"]["name"], pod["spec"]["nodeName"])
        assert pod["status"]["phase"] == "Running"
        assert condition(pod, "PodScheduled")["status"] == "True"
        assert condition(pod, "Ready")["status"] == "True"
        assert pod["status"]["podIP"], "kwok assigns a (fake) pod IP"


def test_pod_needing_more_gpus_than_any_node_stays_pending_with_scheduler_reason(cluster, namespace):
    too_many = max(gpu_capacity_by_node(cluster).values()) + 1
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "greedy"},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/consort-e2e:0.1.0",
                                 "resources": {"limits": {GPU: str(too_many)}}}]},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def unschedulable() -> dict:
        observed = cluster.kubectl_json("get", "pod", "greedy", "-n", namespace)
        scheduled = condition(observed, "PodScheduled")
        if not scheduled or scheduled["status"] != "False":
            raise NotYet(f"PodScheduled {scheduled}")
        return scheduled

    scheduled = wait_for(unschedulable, 30, "kube-scheduler to mark pod greedy unschedulable")
    assert scheduled["reason"] == "Unschedulable"
    assert f"Insufficient {GPU}" in scheduled["message"]
    events = cluster.kubectl_json("get", "events", "-n", namespace,
                                  "--field-selector", "involvedObject.name=greedy,reason=FailedScheduling")
    assert any(f"Insufficient {GPU}" in e["message"] for e in events["items"])
    observed = cluster.kubectl_json("get", "pod", "greedy", "-n", namespace)
    assert observed["status"]["phase"] == "Pending"
    assert not observed["spec"].get("nodeName")


def test_deleting_a_deployment_garbage_collects_replicasets_and_pods(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(deployment("web", 2)))
    dep = wait_deployment_ready(cluster, namespace, "web", 2)
    replicasets = [rs for rs in cluster.kubectl_json("get", "replicasets", "-n", namespace)["items"]
                   if owned_by(rs, dep["metadata"]["uid"])]
    assert len(replicasets) == 1
    pods = [p for p in cluster.kubectl_json("get", "pods", "-n", namespace)["items"]
            if owned_by(p, replicasets[0]["metadata"]["uid"])]
    assert len(pods) == 2

    # Background cascade: the API deletes only the owner; kube-controller-manager's GC does the rest.
    cluster.kubectl("delete", "deployment", "web", "-n", namespace, "--cascade=background", "--wait=false")

    def children_gone() -> bool:
        left = [f"{o['kind']}/{o['metadata']['name']}"
                for o in cluster.kubectl_json("get", "replicasets,pods", "-n", namespace)["items"]]
        if left:
            raise NotYet(f"still present: {left}")
        return True

    wait_for(children_gone, 60, "the garbage collector to delete the ReplicaSet and its Pods")


def test_deleting_a_custom_resource_garbage_collects_what_it_owns(cluster, namespace, widget_crd):
    # The operator relies on this: everything it creates is owned by its custom resource.
    wait_for(lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=json.dumps(
        {"apiVersion": "e2e.consort.dev/v1", "kind": "Widget", "metadata": {"name": "owner"},
         "spec": {"size": "large"}})).returncode == 0, 30, "Widget owner to be created")
    owner = cluster.kubectl_json("get", "widget", "owner", "-n", namespace)
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "owned", "ownerReferences": [{"apiVersion": "e2e.consort.dev/v1", "kind": "Widget",
                                              "name": "owner", "uid": owner["metadata"]["uid"]}]},
             "data": {"k": "v"}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(child))
    cluster.kubectl("delete", "widget", "owner", "-n", namespace, "--wait=false")
    wait_for(lambda: "NotFound" in cluster.kubectl("get", "configmap", "owned", "-n", namespace,
                                                   check=False).stderr,
             60, "the garbage collector to delete ConfigMap owned (owned by the deleted Widget)")


def test_helm_template_and_install_a_chart(cluster, namespace):
    chart = str(FIXTURES / "chart")
    rendered = cluster.helm("template", "demo", chart, "--namespace", namespace,
                            "--set", "message=rendered").stdout
    assert "name: demo-config" in rendered and 'message: "rendered"' in rendered
    assert "kind: Deployment" in rendered

    installed = cluster.helm("install", "demo", chart, "--namespace", namespace, "--set", "gpus=1",
                             "--wait", "--timeout", "90s")
    assert "STATUS: deployed" in installed.stdout
    config = cluster.kubectl_json("get", "configmap", "demo-config", "-n", namespace)
    assert config["data"]["message"] == "hello from helm"
    # Helm asked the real apiserver for its version (the chart's kubeVersion constraint passed too).
    assert config["data"]["kubeVersion"] == pinned_kubernetes_version()
    dep = wait_deployment_ready(cluster, namespace, "demo-app", 1)
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"
    releases = json.loads(cluster.helm("list", "--namespace", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]

    cluster.helm("uninstall", "demo", "--namespace", namespace, "--wait", "--timeout", "60s")
    assert "NotFound" in cluster.kubectl("get", "configmap", "demo-config", "-n", namespace, check=False).stderr
