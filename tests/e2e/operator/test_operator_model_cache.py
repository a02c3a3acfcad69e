"""The node-local model cache on a real kube-apiserver: an operator run with --model-cache-dir puts the
node's directory (hostPath) into the demo:// init container of the engine pods it creates, and the API
server accepts that template; the engine container itself never mounts it."""
from __future__ import annotations

import pytest
import yaml
from kube import NotYet, wait_for
from opkit import get_json

pytestmark = pytest.mark.e2e

CACHE_DIR = "/var/lib/consort/model-cache"


def specialist(name: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist", "metadata": {"name": name},
        "spec": {"model": {"source": "demo://tiny?seed=4"}, "replicas": 1, "minReady": 1,
                 "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, "kv": {"blockSize": 16, "numBlocks": 128}},
    })


@pytest.mark.timeout(300)
def test_operator_mounts_the_node_model_cache_into_the_init_container_only(cluster, namespace, operator_factory):
    operator_factory(namespace, "--model-cache-dir", CACHE_DIR, "--model-cache-size", "20Gi")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("cached"))

    def template() -> dict:
        items = get_json(cluster, "deployments", "-n", namespace)["items"]
        if not items:
            raise NotYet("no Deployment yet")
        return items[0]["spec"]["template"]["spec"]

    pod = wait_for(template, 90, "the engine Deployment")
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model-cache"]["hostPath"] == {"path": CACHE_DIR, "type": "DirectoryOrCreate"}
    owner, init = pod["initContainers"]   # the first hands the node's directory to the engines' user
    assert owner["name"] == "model-cache-owner" and owner["securityContext"]["capabilities"]["add"] == ["CHOWN"]
    assert init["command"][:2] == ["consort", "model-cache"]
    assert init["command"][init["command"].index("--max-bytes") + 1] == str(20 * 2**30)
    assert init["command"][-2:] == ["demo://tiny?seed=4", "/models/demo/tiny-4"]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "model-cache" in {m["name"] for m in init["volumeMounts"]}
    assert "model-cache" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
