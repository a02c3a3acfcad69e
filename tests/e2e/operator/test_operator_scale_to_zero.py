"""Scale to zero against a real kube-apiserver (kwok pods; the engine is a real local process reached
through the pod-address resolver): the CRD's CEL rules for scaleToZero, the operator scaling an idle
Specialist to 0 through /scale and reporting Idle, and the router's waker (as the router's
ServiceAccount, under the Role the operator built) bringing it back."""
from __future__ import annotations

import json
import sys
import urllib.request

import pytest
import yaml
from kube import NotYet, condition, wait_for
from opkit import CONSORT, free_port, get_json
from procs import start_process

pytestmark = pytest.mark.e2e


ROUTER = {"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": "front"},
          "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "front"}}, "replicas": 1}}


def specialist(name: str, **scale_to_zero) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
        "metadata": {"name": name, "labels": {"consort.dev/ensemble": "front"}},
        "spec": {"model": {"source": "demo://tiny"}, "replicas": 1, "minReady": 1,
                 "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}, "kv": {"blockSize": 16, "numBlocks": 128},
                 "warmupTimeoutSeconds": 600, "scaleToZero": scale_to_zero},
    })


def test_cel_rules_for_scale_to_zero(cluster, namespace, crds):
    for spec, message in ((specialist("short", idleAfter="2s"), "scaleToZero.idleAfter must be at least 5s"),
                          (specialist("nofb", whileCold="fallback"), "scaleToZero.whileCold: fallback needs spec.fallback")):
        r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=spec, check=False)
        assert r.returncode != 0 and message in r.stderr, r.stderr
    # minReady 1 at replicas 0 is accepted with scaleToZero (what the /scale write to 0 makes)
    doc = yaml.safe_load(specialist("zero", idleAfter="5s"))
    doc["spec"]["replicas"] = 0
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    doc["metadata"]["name"], doc["spec"]["scaleToZero"] = "plain", None
    del doc["spec"]["scaleToZero"]
    r = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert r.returncode != 0 and "minReady must not exceed replicas" in r.stderr, r.stderr


@pytest.fixture
def demo_model() -> str:
    from consort_operator.local import CACHE, local_model_dir

    return local_model_dir("demo://tiny", CACHE, print)


@pytest.mark.timeout(420)
def test_the_operator_scales_an_idle_specialist_to_zero_and_a_scale_patch_wakes_it(
        cluster, namespace, operator_factory, demo_model, tmp_path):
    mapping = tmp_path / "pod-addresses.json"
    mapping.write_text("{}")
    operator = operator_factory(namespace, "--warm-signal", "engine", "--pod-address", f"file:{mapping}")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("idle", idleAfter="5s"))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(ROUTER))

    def one_pod() -> str:
        pods = [p for p in get_json(cluster, "pods", "-n", namespace, "-l", "consort.dev/specialist=idle")["items"]
                if not p["metadata"].get("deletionTimestamp")]
        if len(pods) != 1:
            raise NotYet(f"{len(pods)} pods")
        return pods[0]["metadata"]["name"]

    pod = wait_for(one_pod, 120, "the engine pod")
    port = free_port()

    def map_live_pods() -> None:
        """Every live engine pod -> the one local engine. The Specialist's first pass may precede its
        router's, and the router's credential then rolls the pod: the new pod must be reachable too."""
        pods = [p["metadata"]["name"] for p in get_json(cluster, "pods", "-n", namespace, "-l",
                                                        "consort.dev/specialist=idle")["items"]
                if not p["metadata"].get("deletionTimestamp")]
        want = {name: f"127.0.0.1:{port}" for name in pods}
        if json.loads(mapping.read_text()) != want:
            mapping.write_text(json.dumps(want))

    map_live_pods()
    engine = start_process([CONSORT, "engine", "--model", demo_model, "--port", str(port), "--host", "127.0.0.1",
                            "--name", "idle", "--num-blocks", "128"], "engine-idle", tmp_path)
    try:
        def status(phase: str, ready: str | None = None):
            def check() -> dict:
                map_live_pods()
                obj = get_json(cluster, "specialist", "idle", "-n", namespace)
                st = obj.get("status") or {}
                if st.get("phase") != phase or (ready is not None and st.get("ready") != ready):
                    raise NotYet(json.dumps({k: st.get(k) for k in ("phase", "ready", "replicas")}))
                return obj
            return check

        def engine_ready() -> bool:
            if not engine.alive():
                raise AssertionError(f"the engine exited: {engine.tail(20)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(engine_ready, 120, "the engine's own /ready", interval=0.5)
        try:
            wait_for(status("Ready"), 180, "Ready with the engine warm", interval=0.5)
        except TimeoutError as e:
            # One line that survives a CI summary: was it the engine or the operator's view of it?
            print("--- engine log tail\n" + engine.tail(), file=sys.stderr)
            last = " | ".join(operator.tail(4).splitlines())[-600:]
            raise AssertionError(f"{e}; engine /ready now: {engine_ready()}; operator log: {last}") from e
        # No request for idleAfter: the operator writes 0 through /scale and reports Idle.
        # (its pod may still be terminating when the phase turns Idle: "1/0" until it is gone)
        obj = wait_for(status("Idle", "0/0"), 120, "Idle after the window, its pod gone", interval=0.5)
        assert obj["spec"]["replicas"] == 0 and obj["status"]["ready"] == "0/0"
        assert condition(obj, "Ready")["status"] == "True" and condition(obj, "Ready")["reason"] == "ScaledToZero"
        scale = get_json(cluster, "specialist", "idle", "-n", namespace, "--subresource=scale")
        assert scale["spec"].get("replicas", 0) == 0   # (omitted at 0)
        dep = get_json(cluster, "deployment", "idle", "-n", namespace)
        assert dep["spec"].get("replicas", 0) == 0
        row = cluster.kubectl("get", "specialist", "idle", "-n", namespace).stdout
        assert "Idle" in row and "0/0" in row, row
        events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=idle")["items"]
        reasons = {e["reason"] for e in events}
        assert {"ScaledToZero", "Idle"} <= reasons and not reasons & {"Degraded", "Failed"}, reasons

        # The router's wake, as the router: its ServiceAccount and the Role the operator built for it
        # (patch on specialists/scale for "idle" only), through the router's own waker.
        import asyncio
        import base64

        from consort_router import kube as router_kube
        from consort_router.config import RouterConfig
        from consort_router.wake import ScaleWaker

        kc = yaml.safe_load(cluster.kubeconfig.read_text())
        (tmp_path / "token").write_text(cluster.kubectl("create", "token", "front-router", "-n", namespace,
                                                        "--duration=1h").stdout.strip())
        (tmp_path / "ca.crt").write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
        as_router = {"CONSORT_KUBE_API": kc["clusters"][0]["cluster"]["server"],
                     "CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "token"), "CONSORT_KUBE_CA_FILE": str(tmp_path / "ca.crt")}
        rendered = RouterConfig.model_validate(yaml.safe_load(
            get_json(cluster, "configmap", "front-router", "-n", namespace)["data"]["router.yaml"]))
        assert rendered.specialist("idle").scale_from_zero is not None
        role = get_json(cluster, "role", "front-router", "-n", namespace)
        assert {"apiGroups": ["consort.dev"], "resources": ["specialists/scale"], "resourceNames": ["idle"],
                "verbs": ["patch"]} in role["rules"]

        async def wake_twice() -> None:
            waker = ScaleWaker(lambda: rendered)
            waker._client = router_kube.api_client(router_kube.configuration(as_router))
            try:
                await waker("idle")
                await waker("idle")    # replicas is 1 now: the tested patch is refused (422), quietly
            finally:
                await waker.close()

        asyncio.run(wake_twice())
        assert get_json(cluster, "specialist", "idle", "-n", namespace)["spec"]["replicas"] == 1
        # The router's identity may scale only its own lanes.
        def can_scale(name: str) -> str:
            return cluster.kubectl("auth", "can-i", "patch", f"specialists/{name}", "--subresource=scale", "-n",
                                   namespace, f"--as=system:serviceaccount:{namespace}:front-router",
                                   check=False).stdout.strip()
        assert (can_scale("idle"), can_scale("other")) == ("yes", "no")
        new_pod = wait_for(one_pod, 120, "a new engine pod")
        assert new_pod != pod
        def out_of_idle() -> dict:
            obj = get_json(cluster, "specialist", "idle", "-n", namespace)
            if obj["status"].get("phase") == "Idle":
                raise NotYet("still Idle")
            return obj

        obj = wait_for(out_of_idle, 90, "out of Idle", interval=0.5)
        assert obj["spec"]["replicas"] == 1 and obj["status"]["desiredReplicas"] == 1
    finally:
        engine.stop(20)
