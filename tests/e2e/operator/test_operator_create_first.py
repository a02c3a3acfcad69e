"""The operator's create-only server-side apply (Kube.apply_new), against the real apiserver: it
creates an absent object with the operator's Apply field ownership (a later apply that drops a field
removes it), and writes nothing to an object that exists (someone else's stays as it was)."""
from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from opkit import get_json

from consort_operator.kube import Kube
from consort_operator.resources.common import FIELD_MANAGER

pytestmark = pytest.mark.e2e


def configmap(namespace: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": namespace}, "data": data}


async def with_kube(cluster, work):
    cfg = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    kube = Kube(cfg)
    try:
        return await work(kube)
    finally:
        await kube.close()


def test_apply_new_creates_with_apply_ownership_and_never_touches_what_exists(cluster, namespace):
    async def work(kube: Kube):
        created = await kube.apply_new(configmap(namespace, a="1", b="2"))
        again = await kube.apply_new(configmap(namespace, a="changed"))
        await kube.apply(configmap(namespace, a="1"))   # b dropped: removed, because the create owned it as Apply
        return created, again

    created, again = asyncio.run(with_kube(cluster, work))
    assert created["data"] == {"a": "1", "b": "2"} and again is None
    managers = {(m["manager"], m["operation"]) for m in created["metadata"]["managedFields"]}
    assert managers == {(FIELD_MANAGER, "Apply")}
    assert get_json(cluster, "configmap", "cfg", "-n", namespace)["data"] == {"a": "1"}

    cluster.kubectl("create", "configmap", "theirs", "-n", namespace, "--from-literal=x=1")
    before = get_json(cluster, "configmap", "theirs", "-n", namespace)
    theirs = {**configmap(namespace, x="2"), "metadata": {"name": "theirs", "namespace": namespace}}
    assert asyncio.run(with_kube(cluster, lambda kube: kube.apply_new(theirs))) is None
    after = get_json(cluster, "configmap", "theirs", "-n", namespace)
    assert after["data"] == {"x": "1"} and after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
