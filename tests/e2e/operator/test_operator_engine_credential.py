"""The engine credential and the generated API keys on the real apiserver: each EnsembleRouter owns a
random engine credential Secret, mounted into its router pods; each Specialist it selects copies what
it accepts into the Secret its engine pods mount; annotating it rotates the Secret (staged, then
promoted, the previous token kept) without touching any pod template; API keys are generated when none are named and then left to the user."""
from __future__ import annotations

import base64
import json
import time

import pytest
import yaml
from kube import NotYet, owned_by, wait_for
from opkit import get_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MANIFESTS = """
apiVersion: consort.dev/v1alpha1
kind: Specialist
metadata: {name: algo, labels: {ensemble: cpp}}
spec:
  model: {source: demo://tiny}
  replicas: 1
  resources: {gpus: 0, cpu: "1", memory: 2Gi}
---
apiVersion: consort.dev/v1alpha1
kind: Specialist
metadata: {name: hub, labels: {ensemble: other}}
spec:
  model: {source: hf://org/model}
  replicas: 1
  resources: {gpus: 0, cpu: "1", memory: 2Gi}
---
apiVersion: consort.dev/v1alpha1
kind: EnsembleRouter
metadata: {name: front}
spec:
  specialistSelector: {matchLabels: {ensemble: cpp}}
  classifier: {kind: none, onReject: default, defaultSpecialist: algo}
  replicas: 1
"""


def secret_data(cluster, namespace: str, name: str) -> dict[str, str]:
    obj = get_json(cluster, "secret", name, "-n", namespace)
    return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}


def wait_secret(cluster, namespace: str, name: str) -> dict:
    def check() -> dict:
        out = cluster.kubectl("get", "secret", name, "-n", namespace, "-o", "json", check=False)
        if out.returncode != 0:
            raise NotYet(out.stderr.strip())
        return get_json(cluster, "secret", name, "-n", namespace)
    return wait_for(check, 60, f"Secret {name}", interval=0.5)


def test_router_credential_and_keys_are_owned_mounted_and_rotate(cluster, namespace, operator_factory):
    operator_factory(namespace, "--credential-propagation-seconds", "4")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=MANIFESTS)
    router_uid = get_json(cluster, "ensemblerouter", "front", "-n", namespace)["metadata"]["uid"]

    cred = wait_secret(cluster, namespace, "front-engine-credential")
    keys = wait_secret(cluster, namespace, "front-api-keys")
    for s in (cred, keys):
        assert owned_by(s, router_uid) and s["type"] == "Opaque"
    first = secret_data(cluster, namespace, "front-engine-credential")
    token = first["current"].strip()
    assert len(token) >= 40 and first["accepted"] == token + "\n"
    tenant, _, key = secret_data(cluster, namespace, "front-api-keys")["keys"].splitlines()[-1].partition(": ")
    assert tenant == "default" and len(key) >= 40

    # mounted: the router pods read `current` and the keys; the selected engines accept `accepted`
    router_dep = wait_for(lambda: get_json(cluster, "deployment", "front-router", "-n", namespace), 60, "router Deployment")
    pod = router_dep["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["engine-credential"]["secret"]["secretName"] == "front-engine-credential"
    assert vols["api-keys"]["secret"]["secretName"] == "front-api-keys"
    config = yaml.safe_load(get_json(cluster, "configmap", "front-router", "-n", namespace)["data"]["router.yaml"])
    assert config["auth"]["engine_credential_file"].endswith("/current") and config["auth"]["api_keys_file"].endswith("/keys")

    # the engines of each Specialist mount one Secret of their own, holding the `accepted` tokens of
    # every router that selects it: the router's arrival rolls no engine (generation 1: one write)
    def copied(specialist: str, want: dict[str, str]):
        def check() -> dict:
            out = cluster.kubectl("get", "secret", f"{specialist}-engine-credentials", "-n", namespace, "-o", "json",
                                  check=False)
            got = {} if out.returncode else secret_data(cluster, namespace, f"{specialist}-engine-credentials")
            if got != want or out.returncode:
                raise NotYet(str(sorted(got)) if not out.returncode else out.stderr.strip())
            return True
        return check
    wait_for(copied("algo", {"front": first["accepted"]}), 60, "algo's engines accepting front's credential")
    algo_uid = get_json(cluster, "specialist", "algo", "-n", namespace)["metadata"]["uid"]
    assert owned_by(get_json(cluster, "secret", "algo-engine-credentials", "-n", namespace), algo_uid)
    algo = wait_for(lambda: get_json(cluster, "deployment", "algo", "-n", namespace), 60, "engine Deployment algo")
    assert algo["metadata"]["generation"] == 1
    engine_pod = algo["spec"]["template"]["spec"]
    ev = next(v for v in engine_pod["volumes"] if v["name"] == "engine-credentials")
    assert ev["secret"] == {"secretName": "algo-engine-credentials", "optional": True, "defaultMode": 420}
    args = engine_pod["containers"][0]["args"]
    assert args[args.index("--credential-file") + 1] == "/etc/consort/engine-credentials"
    wait_for(copied("hub", {}), 60, "hub's engines closed (selected by no router)")

    # egress: DNS for every engine, HTTPS only for the one downloading from the hub
    def egress(name: str) -> list:
        pol = wait_for(lambda: get_json(cluster, "networkpolicy", f"{name}-engine", "-n", namespace), 60, "NetworkPolicy")
        assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"]
        return [sorted((p["protocol"], p["port"]) for p in rule["ports"]) for rule in pol["spec"]["egress"]]
    assert egress("algo") == [[("TCP", 53), ("UDP", 53)]]
    assert egress("hub") == [[("TCP", 53), ("UDP", 53)], [("TCP", 443)]]

    # rotation: staged (the engines learn the new token first), then promoted; the previous is kept
    generation = algo["metadata"]["generation"], router_dep["metadata"]["generation"]
    cluster.kubectl("annotate", "ensemblerouter", "front", "-n", namespace, "consort.dev/rotate-credential=1")

    def staged() -> dict:
        d = secret_data(cluster, namespace, "front-engine-credential")
        if "pending" not in d and d["current"] == first["current"]:
            raise NotYet(str(sorted(d)))
        return d
    seen = wait_for(staged, 30, "the rotation staged", interval=0.2)
    if "pending" in seen:     # caught between the steps: accepted by the engines, not yet sent
        assert seen["current"] == first["current"] and seen["accepted"].splitlines() == [seen["pending"].strip(), token]

    def promoted() -> dict:
        d = secret_data(cluster, namespace, "front-engine-credential")
        if "pending" in d or d["current"] == first["current"]:
            raise NotYet(str(sorted(d)))
        return d
    done = wait_for(promoted, 60, "the rotation promoted", interval=0.5)
    new = done["current"].strip()
    assert new != token and done["previous"].strip() == token and done["accepted"].splitlines() == [new, token]
    assert get_json(cluster, "secret", "front-engine-credential", "-n", namespace)["metadata"]["annotations"][
        "consort.dev/credential-rotation"] == "1"
    wait_for(copied("algo", {"front": done["accepted"]}), 60, "algo's engines following the rotation")
    # no pod template changed: the running pods follow their mounted files
    assert (get_json(cluster, "deployment", "algo", "-n", namespace)["metadata"]["generation"],
            get_json(cluster, "deployment", "front-router", "-n", namespace)["metadata"]["generation"]) == generation

    # the generated keys are the user's to edit: the operator keeps what they wrote
    mine = base64.b64encode(b"team-a: sk-mine-0123456789\n").decode()
    cluster.kubectl("patch", "secret", "front-api-keys", "-n", namespace, "--type", "merge",
                    "-p", f'{{"data": {{"keys": "{mine}"}}}}')
    cluster.kubectl("annotate", "ensemblerouter", "front", "-n", namespace, "touch=1")   # a reconcile pass
    time.sleep(3)
    assert secret_data(cluster, namespace, "front-api-keys")["keys"] == "team-a: sk-mine-0123456789\n"
    assert secret_data(cluster, namespace, "front-engine-credential")["current"].strip() == new
