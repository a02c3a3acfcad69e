"""The whole user path on a real node: helm install -> kubectl apply -f examples/local/ -> routed
OpenAI traffic through `kubectl port-forward` to the router Service -> an engine pod dies and is
replaced while traffic keeps succeeding -> `kubectl diff` is clean -> uninstall leaves nothing.

The steps share one installation, so they run in order in one module (each a test of its own, so
a failure names the step). Every wait is bounded and says what it waited for.
"""
from __future__ import annotations

import base64
import json
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from consort_engine.model.cpu import memory_available
from consort_operator.api.base import quantity_value
from kube import NotYet, condition, wait_for
from procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.real_node]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "consort"
EXAMPLES = REPO / "examples" / "local"
RELEASE = "consort"
OPERATOR_NS = "consort-system"
NS = "default"
SPECIALISTS = ("algo", "template", "stl")
ROUTER = "cpp-local"
KWOK_FAKE_CIDR = "10.0.0.0/16"


class PortForward:
    """`kubectl port-forward svc/<name>` on a free local port, restarted if it dies (it does when
    the pod behind it is replaced)."""

    def __init__(self, cluster, target: str, remote_port: int, namespace: str = NS):
        self.cluster, self.target, self.remote, self.namespace = cluster, target, remote_port, namespace
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def ensure(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [self.cluster.bin("kubectl"), f"--kubeconfig={self.cluster.kubeconfig}", "-n", self.namespace,
                 "port-forward", "--address=127.0.0.1", self.target, f"{self.port}:{self.remote}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            line = self.proc.stdout.readline()  # "Forwarding from 127.0.0.1:P -> R" once listening
            if "Forwarding from" not in line:
                raise NotYet(f"port-forward {self.target}: {line.strip()}")
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def installed(real_cluster):
    c = real_cluster
    c.helm("install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace", "--wait", "--timeout", "5m",
           "--set", "image.repository=consort/operator", "--set", "image.tag=dev",
           "--set", "engineImage=consort/engine:dev", "--set", "routerImage=consort/router:dev",
           "--set", "warmSignal=pod-ready", timeout=400)
    c.kubectl("apply", "-f", str(EXAMPLES))
    forward = PortForward(c, f"svc/{ROUTER}", 80)
    yield c, forward
    forward.stop()
    # A no-op after test_uninstall_leaves_no_orphans; after a failed step it leaves the cluster
    # clean for the next run (CONSORT_REAL_CLUSTER_DIR reuses it).
    c.kubectl("delete", "-f", str(EXAMPLES), "--ignore-not-found", "--wait=true", "--timeout=120s", check=False,
              timeout=150)
    c.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--ignore-not-found", "--wait", "--timeout", "2m", check=False,
           timeout=150)


def operator_logs(c) -> str:
    return c.kubectl("logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=consort-operator", "--tail=40",
                     check=False).stdout


def test_specialists_become_ready_through_real_readiness_probes(installed):
    c, _ = installed

    def all_ready():
        items = c.kubectl_json("get", "specialists", "-n", NS)["items"]
        phases = {s["metadata"]["name"]: (s.get("status") or {}).get("phase") for s in items}
        if sorted(phases) != sorted(SPECIALISTS) or any(p != "Ready" for p in phases.values()):
            pods = c.kubectl("get", "pods", "-n", NS, "-o", "wide", check=False).stdout
            raise NotYet(f"phases {phases}\n{pods}")
        return items

    try:
        specialists = wait_for(all_ready, 600, "every Specialist of examples/local to be Ready", interval=2)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n--- operator\n{operator_logs(c)}") from None
    for s in specialists:
        assert condition(s, "Ready")["status"] == "True"
    # Ready came from the kubelet: each engine pod is Ready through its /ready probe, on the real node.
    pods = c.kubectl_json("get", "pods", "-n", NS, "-l", "app.kubernetes.io/component=engine")["items"]
    assert len(pods) == len(SPECIALISTS)
    node_available = memory_available(Path("/proc/meminfo").read_text(), None)   # the real node is this machine
    for pod in pods:
        assert pod["spec"]["nodeName"] == "consort-node-0"
        assert condition(pod, "Ready")["status"] == "True"
        probe = pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]
        assert probe["path"] == "/ready"
        assert not pod["status"]["podIP"].startswith("10.0."), "an engine pod got a kwok (fake) IP"
        sc = pod["spec"]["containers"][0]["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and pod["spec"]["securityContext"]["runAsNonRoot"] is True
        # the engine sized its memory from its pod's limit (the container's cgroup), not the node's meminfo
        engine = pod["spec"]["containers"][0]
        log = c.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", engine["name"]).stdout
        seen = re.search(r"KV pool: \d+ blocks \(\d+ MiB\).*? (\d+) MiB available", log)
        assert seen, log[-3000:]
        limit = quantity_value(engine["resources"]["limits"]["memory"])
        assert 0 < int(seen.group(1)) * 2**20 <= limit, seen.group(0)
        assert node_available > limit, "the node itself has less free memory than the pod's limit: nothing shown"


def test_openai_client_gets_routed_completions_and_a_stream(installed):
    from openai import OpenAI

    c, forward = installed
    wait_for(lambda: c.kubectl_json("get", "deployment", f"{ROUTER}-router", "-n", NS)["status"].get("readyReplicas") == 1,
             300, f"router Deployment {ROUTER}-router ready", interval=2)
    base = wait_for(forward.ensure, 60, "kubectl port-forward to the router Service")
    client = OpenAI(base_url=f"{base}/v1", api_key=api_key(c), max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(model=ROUTER, prompt="template <typename T>", max_tokens=8)
    completion = raw.parse()
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    assert raw.headers["x-consort-specialist"] in SPECIALISTS
    pinned = client.chat.completions.create(model="stl", messages=[{"role": "user", "content": "sort a vector"}],
                                            max_tokens=8)
    assert pinned.choices[0].message.content is not None
    chunks = list(client.completions.create(model="algo", prompt="int main() {", max_tokens=8, stream=True))
    assert sum(len(ch.choices[0].text) for ch in chunks if ch.choices) > 0


def engine_pod(c, specialist: str) -> dict:
    pods = c.kubectl_json("get", "pods", "-n", NS, "-l", f"consort.dev/specialist={specialist}")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if len(live) != 1:
        raise NotYet(f"{len(live)} live pods for {specialist}")
    return live[0]


def ready_replacement(c, specialist: str, old: dict) -> dict:
    """The specialist's live pod once it is not `old` and is Ready (NotYet otherwise)."""
    pod = engine_pod(c, specialist)
    if pod["metadata"]["uid"] == old["metadata"]["uid"]:
        raise NotYet(f"the old {specialist} pod is still the live one")
    ready = condition(pod, "Ready")
    if not ready or ready["status"] != "True":
        raise NotYet(f"{pod['metadata']['name']} not Ready yet")
    return pod


API_KEY: list[str] = []   # the router's generated key, read once from its Secret


def api_key(c) -> str:
    """The key of tenant `default` in the Secret the operator generated for the router (no
    apiKeysSecretRef in examples/local): the router requires one."""
    if not API_KEY:
        text = base64.b64decode(c.kubectl_json("get", "secret", f"{ROUTER}-api-keys", "-n", NS)["data"]["keys"]).decode()
        API_KEY.append(next(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("default: ")))
    return API_KEY[0]


def routing_replicas(base: str, specialist: str) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(f"{base}/v1/routing", headers={"Authorization": f"Bearer {API_KEY[0]}"}) \
        if API_KEY else f"{base}/v1/routing"
    with urllib.request.urlopen(req, timeout=10) as r:
        table = json.load(r)
    lanes = table.get("lanes") or table.get("specialists") or {}
    lane = lanes.get(specialist) if isinstance(lanes, dict) else next(
        (x for x in lanes if x.get("name") == specialist), None)
    return (lane or {}).get("replicas") or []


@contextmanager
def steady_traffic(forward, send, pause: float, limit: int = 3000):
    """send(client) in a background thread until the block ends (bounded: at most `limit` requests):
    yields (what send returned, one line per failed request), filled as it goes."""
    from openai import OpenAI

    results: list = []
    errors: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set() and len(results) + len(errors) < limit:
            try:
                client = OpenAI(base_url=f"{forward.ensure()}/v1", api_key=api_key(forward.cluster), max_retries=0,
                                timeout=60)
                results.append(send(client))
            except NotYet:
                time.sleep(0.5)
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(pause)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        yield results, errors
    finally:
        stop.set()
        worker.join(90)


def test_deleting_an_engine_pod_keeps_traffic_flowing_and_it_rejoins_when_warm(installed, figure):
    c, forward = installed
    victim = engine_pod(c, "stl")

    def send(client) -> str:
        raw = client.completions.with_raw_response.create(model=ROUTER, prompt="std::vector<int> v;",
                                                          max_tokens=4, extra_headers={"x-consort-intent": "stl"})
        return raw.headers.get("x-consort-specialist", "?")

    with steady_traffic(forward, send, pause=0.2) as (served, errors):
        time.sleep(2)
        c.kubectl("delete", "pod", "-n", NS, victim["metadata"]["name"], "--wait=false")

        replacement = wait_for(lambda: ready_replacement(c, "stl", victim), 300, "the Deployment to replace the deleted stl pod", interval=1)
        # It rejoins the router once warm: the router lists the new pod's address as a ready replica.
        new_ip = replacement["status"]["podIP"]
        wait_for(lambda: any(new_ip in json.dumps(r) for r in routing_replicas(forward.ensure(), "stl")), 120,
                 f"the router to route to the replacement ({new_ip})", interval=1)
        time.sleep(3)
    figure(f"engine pod deleted under traffic: {len(served) + len(errors)} requests, {len(errors)} failed")
    assert served, "no request completed during the outage window"
    assert not errors, f"{len(errors)} client errors while an engine pod was replaced: {errors[:5]}"
    # The liveness probe (/health, answered by the event loop while the engine steps) killed no busy engine.
    pods = c.kubectl_json("get", "pods", "-n", NS, "-l", "app.kubernetes.io/component=engine")["items"]
    restarts = {p["metadata"]["name"]: s["restartCount"] for p in pods for s in p["status"].get("containerStatuses") or []}
    assert restarts and not any(restarts.values()), f"engine containers restarted: {restarts}"


def test_kubectl_diff_is_clean_after_reconcile(installed):
    c, _ = installed
    diff = c.kubectl("diff", "-f", str(EXAMPLES), check=False)
    assert diff.returncode == 0, f"kubectl diff shows drift after reconcile:\n{diff.stdout[-3000:]}"


def test_adapter_rotation_is_a_hot_load_with_no_failed_request_and_no_restart(installed, figure):
    """A new adapter reaches the running engine through its mounted adapters ConfigMap (the kubelet
    refreshes the volume; the engine follows the file): same pod, no restart, steady traffic all 200."""
    from openai import OpenAI

    c, forward = installed
    before = engine_pod(c, "algo")
    ip = before["status"]["podIP"]

    def send(client) -> str:
        client.completions.create(model="algo", prompt="int f() {", max_tokens=4)
        return "ok"

    with steady_traffic(forward, send, pause=0.1) as (ok, failed):
        time.sleep(2)
        patch = {"spec": {"adapters": [{"name": "fresh", "source": "demo://lora?seed=1"}]}}
        c.kubectl("patch", "specialist", "algo", "-n", NS, "--type=merge", "-p", json.dumps(patch))
        # The router learns adapters from the engines' /v1/status: the same pod now serves `fresh`.
        wait_for(lambda: any(ip in r["url"] and r["ready"] and "fresh" in r["adapters"]
                             for r in routing_replicas(forward.ensure(), "algo")),
                 240, f"the running algo pod ({ip}) to hot-load adapter fresh", interval=2)
        client = OpenAI(base_url=f"{forward.ensure()}/v1", api_key=api_key(c), max_retries=1, timeout=60)
        raw = client.completions.with_raw_response.create(model="algo", prompt="int f()", max_tokens=4,
                                                          extra_body={"adapter": "fresh"})
        assert raw.parse().choices[0].text is not None
        assert raw.headers.get("x-consort-adapter") == "fresh"
        time.sleep(2)
    figure(f"steady load through the adapter rotation: {len(ok) + len(failed)} requests, {len(failed)} failed")
    assert ok and not failed, failed[:5]
    after = engine_pod(c, "algo")
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the rotation replaced the engine pod"
    restarts = [s["restartCount"] for s in after["status"].get("containerStatuses") or []]
    assert restarts == [0], restarts

    def promoted() -> dict:
        status = c.kubectl_json("get", "specialist", "algo", "-n", NS).get("status") or {}
        fresh = next((a for a in status.get("adapters") or [] if a["name"] == "fresh"), None)
        if not fresh or fresh["state"] not in ("Probation", "Active"):
            raise NotYet(f"adapter status {fresh}")
        return fresh
    fresh = wait_for(promoted, 120, "the operator to see the hot-load and move fresh to Probation", interval=2)
    assert fresh["loadedReplicas"] == 1, fresh
    # The operator probed the engine (pod-ready warm signal or not): the replica's own report.
    assert fresh["replicas"] == [{"pod": before["metadata"]["name"], "state": "loaded"}], fresh


def test_nothing_dialled_outside_the_node(installed):
    # The egress guard (hack/localcluster/node.py) rejects and counts new connections from pods
    # to anything off the node, and from this machine to kwok's fake pod range.
    c, _ = installed
    out = subprocess.run(["iptables", "-w", "-n", "-v", "-x", "-L", "CONSORT-EGRESS"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:] if line.split()]
    assert rows and all(row[0] == "0" for row in rows), f"connections left the node:\n{out.stdout}"


def test_uninstall_leaves_no_orphans(installed):
    c, forward = installed
    forward.stop()
    c.kubectl("delete", "-f", str(EXAMPLES), "--wait=true", "--timeout=180s", timeout=200)
    c.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "3m", timeout=200)

    def nothing_left():
        left = c.kubectl("get", "deployments,services,pods,configmaps,serviceaccounts,poddisruptionbudgets,"
                         "networkpolicies", "-n", NS, "-l", "app.kubernetes.io/part-of=consort", "-o", "name",
                         check=False).stdout.split()
        left += c.kubectl("get", "all", "-n", OPERATOR_NS, "-o", "name", check=False).stdout.split()
        left += [n for n in c.kubectl("get", "clusterroles,clusterrolebindings", "-o", "name").stdout.split()
                 if "consort" in n]
        if left:
            raise NotYet(f"left: {left}")
        return True

    wait_for(nothing_left, 180, "every Consort object to be gone", interval=2)
