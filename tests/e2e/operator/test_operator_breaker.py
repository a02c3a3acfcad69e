"""Breaker demotion made durable: the real router process keeps its breaker states in its
EnsembleRouter's status through its own (operator-built, least-privilege) Role; the operator mirrors
them into the Specialists (BREAKER column, Demoted condition, Events); a restarted router resumes
from them."""
from __future__ import annotations

import base64
import json
import sys
import time
import urllib.request

import pytest
import yaml
from kube import NotYet, condition, wait_for
from opkit import free_port, get_json, wait_phase
from procs import start_process

pytestmark = pytest.mark.e2e


def specialist(name: str, fallback: str, intent: str) -> dict:
    return {"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
            "metadata": {"name": name, "labels": {"consort.dev/ensemble": "b"}},
            "spec": {"model": {"source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"}, "intents": [intent], "fallback": fallback}}


ROUTER = {"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": "front"},
          "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "b"}}, "replicas": 1}}


class RouterProc:
    def __init__(self, config: str, port: int, env: dict, log):
        self.port = port
        self.proc = start_process([sys.executable, "-m", "consort_router.cli", "--config", config,
                                   "--port", str(port)], log.stem, log.parent, env=env)

    def routing(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/routing", timeout=2) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.stop(20)


@pytest.mark.timeout(400)
def test_breaker_state_survives_router_restarts_and_demotes_the_specialist(cluster, namespace, operator_factory, tmp_path):
    from consort_router.breaker import BreakerState
    from consort_router.config import RouterConfig

    from consort_router import kube
    from consort_router.kube_store import EnsembleRouterStatusStore
    from kubernetes_asyncio.client import ApiException

    operator_factory(namespace, "--warm-signal", "pod-ready", "--pod-address", "none")
    docs = [specialist("algo", "stl", "codegen"), specialist("stl", "algo", "ranges"), ROUTER]
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(docs))
    wait_phase(cluster, namespace, "ensemblerouter", "front", "Ready", timeout=90)

    # The router's identity: the ServiceAccount + Role the operator built for it.
    token = cluster.kubectl("create", "token", "front-router", "-n", namespace, "--duration=1h").stdout.strip()
    (tmp_path / "token").write_text(token)
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    server = kc["clusters"][0]["cluster"]["server"]
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    as_router = {"CONSORT_KUBE_API": server, "CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "token"),
                 "CONSORT_KUBE_CA_FILE": str(tmp_path / "ca.crt")}
    env = {**cluster.env(), "CONSORT_ENSEMBLE_ROUTER": f"{namespace}/front", **as_router}

    # Its config as rendered by the operator, with local static replicas instead of EndpointSlices
    # (kwok pod IPs are never contacted; nothing listens on the engine port, which is fine here), and
    # without the mounted Secrets (keys and engine credential live in the pod, not on this machine).
    rendered = RouterConfig.model_validate(yaml.safe_load(get_json(cluster, "configmap", "front-router", "-n", namespace)["data"]["router.yaml"]))
    dead = f"http://127.0.0.1:{free_port()}"
    local = rendered.model_copy(update={
        "specialists": [s.model_copy(update={"service": None, "replicas": [dead]}) for s in rendered.specialists],
        "store": rendered.store.model_copy(update={"save_interval_s": 0.2}),
        "auth": rendered.auth.model_copy(update={"api_keys_file": None, "engine_credential_file": None})})
    config = tmp_path / "router.yaml"
    config.write_text(RouterConfig.model_validate(local.model_dump()).dump_yaml())

    router = RouterProc(str(config), free_port(), env, tmp_path / "router.log")
    try:
        def saved() -> dict:
            st = get_json(cluster, "ensemblerouter", "front", "-n", namespace)["status"].get("breakerState") or {}
            if sorted((st.get("breakers") or {})) != ["algo", "stl"]:
                raise NotYet(f"breakerState {st}")
            return st
        wait_for(saved, 60, "the router process to write its breaker states into EnsembleRouter status")
    finally:
        router.stop()

    # A sustained breach, as the router records it: algo open (shadow-only; stl takes its traffic).
    store = EnsembleRouterStatusStore(namespace, "front", kube.configuration(as_router))
    states = store.load()
    now = time.time()
    states["breakers"]["algo"] = BreakerState(state="open", samples=(0.0,) * 15 + (1.0,) * 5, total=20, since=now,
                                              revision=states["breakers"]["algo"].get("revision")).to_dict()
    store.save(states)
    store.flush()

    def demoted() -> dict:
        sp = get_json(cluster, "specialist", "algo", "-n", namespace)
        if (sp["status"].get("breaker") or {}).get("state") != "Open":
            raise NotYet(f"breaker {sp['status'].get('breaker')}")
        return sp
    sp = wait_for(demoted, 60, "the operator to mirror the open breaker into Specialist algo")
    assert sp["status"]["breaker"] == {"state": "Open", "rate": 0.25, "samples": 20, "fallback": "stl",
                                       "since": sp["status"]["breaker"]["since"]}
    assert condition(sp, "Demoted")["status"] == "True" and condition(sp, "Demoted")["reason"] == "BreakerOpen"
    cols = cluster.kubectl("get", "specialist", "algo", "-n", namespace,
                           "-o", "custom-columns=PHASE:.status.phase,BREAKER:.status.breaker.state", "--no-headers").stdout.split()
    assert cols == ["Ready", "Open"], cols
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=algo,reason=Demoted")["items"]
    assert events and "fallback stl takes primary traffic" in events[0]["message"]

    # A restarted router resumes from the stored state.
    router = RouterProc(str(config), free_port(), env, tmp_path / "router2.log")
    try:
        def resumed() -> dict:
            if not router.proc.alive():
                raise AssertionError((tmp_path / "router2.log").read_text())
            try:
                return router.routing()
            except OSError as e:
                raise NotYet(str(e))
        view = wait_for(resumed, 30, "the restarted router's /v1/routing")
        assert "open" in json.dumps(view["specialists"]["algo"]).lower(), view["specialists"]["algo"]
    finally:
        router.stop()

    # Least privilege: the router's token reaches only its own EnsembleRouter status.
    other = EnsembleRouterStatusStore(namespace, "another", kube.configuration(as_router))
    with pytest.raises(ApiException) as err:
        other.get()
    assert err.value.status == 403
    assert other.load() == {}   # the BreakerStore side logs and goes on
    store.patch({"spec": {"replicas": 5}})   # through the status subresource spec does not change
    assert get_json(cluster, "ensemblerouter", "front", "-n", namespace)["spec"]["replicas"] == 1

    # Recovery: closed again -> Restored, Demoted False.
    states["breakers"]["algo"] = BreakerState(state="closed", samples=(1.0,) * 20, total=40, since=time.time(),
                                              revision=states["breakers"]["algo"].get("revision")).to_dict()
    store.save(states)
    store.flush()

    def restored() -> dict:
        sp = get_json(cluster, "specialist", "algo", "-n", namespace)
        if sp["status"]["breaker"]["state"] != "Closed":
            raise NotYet(f"breaker {sp['status']['breaker']}")
        return sp
    sp = wait_for(restored, 60, "the operator to mirror the closed breaker")
    assert condition(sp, "Demoted")["status"] == "False"
    store.close()
    other.close()
