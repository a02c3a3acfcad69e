"""The operator cannot be turned against its namespace (issue 25), against the real apiserver: it
never takes over an object it does not own, runs no image outside its allowlist, and the CRD's CEL
refuses `..` in pvc:// paths."""
from __future__ import annotations

import time

import pytest
import yaml
from kube import NotYet, condition, wait_for
from opkit import get_json

pytestmark = pytest.mark.e2e

VICTIM = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, labels: {app: web}}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, image: registry.invalid/web:1}]}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {selector: {app: web}, ports: [{port: 80}]}
"""


def specialist(name: str, **spec) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist", "metadata": {"name": name},
        "spec": {"model": {"source": "demo://tiny"}, "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, **spec}})


def wait_condition(cluster, namespace: str, name: str, type_: str, reason: str, timeout: float = 60) -> dict:
    def check() -> dict:
        cond = condition(get_json(cluster, "specialist", name, "-n", namespace), type_)
        if not cond or cond.get("reason") != reason:
            raise NotYet(f"{type_}: {cond}")
        return cond
    return wait_for(check, timeout, f"specialist {name} {type_} reason {reason}", interval=0.5)


def warnings(cluster, namespace: str, name: str, reason: str) -> list[dict]:
    events = get_json(cluster, "events", "-n", namespace, "--field-selector",
                      f"involvedObject.kind=Specialist,involvedObject.name={name},reason={reason}")["items"]
    return [e for e in events if e.get("type") == "Warning"]


def test_a_specialist_named_like_an_unowned_deployment_leaves_it_unchanged(cluster, namespace, operator_factory):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=VICTIM)
    before = {k: get_json(cluster, k, "web", "-n", namespace) for k in ("deployment", "service")}
    operator_factory(namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("web"))
    cond = wait_condition(cluster, namespace, "web", "ChildrenOwned", "ChildConflict")
    assert cond["status"] == "False" and "Deployment web" in cond["message"] and "Service web" in cond["message"]
    def warned() -> list[dict]:
        got = warnings(cluster, namespace, "web", "ChildConflict")
        if not got:
            raise NotYet("no event yet")
        return got

    wait_for(warned, 30, "a ChildConflict Warning Event")
    time.sleep(3)   # a few more reconcile passes
    for kind, old in before.items():
        now = get_json(cluster, kind, "web", "-n", namespace)
        assert now["spec"] == old["spec"], kind
        assert now["metadata"].get("labels") == old["metadata"].get("labels"), kind
        assert not now["metadata"].get("ownerReferences"), kind
        assert "consort-operator" not in {f.get("manager") for f in now["metadata"].get("managedFields") or []}, kind
    # Deleting the Specialist garbage-collects nothing of the victim's.
    cluster.kubectl("delete", "specialist", "web", "-n", namespace, "--wait=true", "--timeout=60s")
    time.sleep(2)
    assert get_json(cluster, "deployment", "web", "-n", namespace)["metadata"]["uid"] == before["deployment"]["metadata"]["uid"]
    assert get_json(cluster, "service", "web", "-n", namespace)["metadata"]["uid"] == before["service"]["metadata"]["uid"]


def test_an_image_outside_the_allowlist_is_refused(cluster, namespace, operator_factory):
    operator_factory(namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("evil", image="docker.io/attacker/engine:1"))
    cond = wait_condition(cluster, namespace, "evil", "Ready", "ImageNotAllowed")
    assert "docker.io/attacker/engine:1" in cond["message"]
    assert get_json(cluster, "specialist", "evil", "-n", namespace)["status"]["phase"] == "Failed"
    assert cluster.kubectl("get", "deployment", "evil", "-n", namespace, check=False).returncode != 0


def test_the_crd_refuses_dotdot_in_pvc_paths(cluster, crds, namespace):
    for spec in ({"model": {"source": "pvc://models/../secrets"}},
                 {"model": {"source": "pvc://m/x", "tokenizer": "pvc://m/a/.."}},
                 {"model": {"source": "pvc://m/x"}, "adapters": [{"name": "a", "source": "pvc://m/../a"}]}):
        doc = yaml.safe_dump({"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
                              "metadata": {"name": "dots"}, "spec": spec})
        out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=doc, check=False)
        assert out.returncode != 0 and "must not contain '..'" in out.stderr, out.stderr
    ok = yaml.safe_dump({"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist", "metadata": {"name": "dots"},
                         "spec": {"model": {"source": "pvc://m/v1..2"}}})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=ok)


def test_the_crd_refuses_an_exposed_router_without_keys(cluster, crds, namespace):
    def router(spec: dict) -> str:
        return yaml.safe_dump({"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter",
                               "metadata": {"name": "front"}, "spec": spec})
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                          input=router({"service": {"type": "LoadBalancer"}, "auth": {"enabled": False}}))
    assert out.returncode != 0 and "needs auth.enabled" in out.stderr, out.stderr
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", check=False, input=router(
        {"auth": {"enabled": False, "apiKeysSecretRef": {"name": "keys", "key": "k"}}}))
    assert out.returncode != 0 and "needs auth.enabled" in out.stderr, out.stderr
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=router(
        {"service": {"type": "LoadBalancer"}, "auth": {"apiKeysSecretRef": {"name": "keys", "key": "k"}}}))
