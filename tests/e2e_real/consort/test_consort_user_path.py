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
from datetime import datetime
from pathlib import Path

import pytest
from consort_engine.model.cpu import memory_available
from consort_operator.api.base import quantity_value
from faults import (ApiserverOutage, Load, deployment_settled, kill_container_process, leadership_spans, service_url,
                    watch_phases)
from kube import NotYet, condition, wait_for
from procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.real_node]

REPO = Path(__file__).resolve().parents[3]
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
    # The README's values file for local images; pod-ready: Ready comes from the kubelet's probes,
    # which the first step asserts.
    c.helm("install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace", "--wait", "--timeout", "5m",
           "-f", str(CHART / "values-local.yaml"), "--set", "warmSignal=pod-ready", timeout=400)
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
    wait_for(lambda: c.kubectl_json("get", "deployment", f"{ROUTER}-router", "-n", NS)["status"].get("readyReplicas") == 2,
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


# --- faults under bounded load through the router Service (tests/e2e_real/faults.py) ----------

ROUTER_DEPLOYMENT = f"{ROUTER}-router"
NODE = "consort-node-0"


def router_pods(c) -> list[dict]:
    pods = c.kubectl_json("get", "pods", "-n", NS, "-l", f"consort.dev/ensemble-router={ROUTER}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def all_specialists_ready(c) -> list[dict]:
    items = c.kubectl_json("get", "specialists", "-n", NS)["items"]
    phases = {s["metadata"]["name"]: (s.get("status") or {}).get("phase") for s in items}
    if sorted(phases) != sorted(SPECIALISTS) or any(p != "Ready" for p in phases.values()):
        raise NotYet(f"phases {phases}")
    return items


@contextmanager
def started_load(c, **kw):
    """Load through the router Service, once it has had its first answers."""
    with Load(service_url(c, ROUTER, NS), ROUTER, api_key(c), **kw) as load:
        def answered() -> bool:
            if load.ok < 6:
                raise NotYet(load.summary() + "; " + "; ".join(load.failed[-2:]))
            return True

        wait_for(answered, 120, "the load through the router Service to get its first answers", interval=0.5)
        yield load


def test_router_runs_two_replicas_and_its_service_answers_from_this_node(installed):
    c, _ = installed
    wait_for(lambda: deployment_settled(c, ROUTER_DEPLOYMENT, NS, 2), 300, "both router replicas Ready", interval=2)
    pdb = c.kubectl_json("get", "pdb", ROUTER_DEPLOYMENT, "-n", NS)
    assert pdb["spec"]["maxUnavailable"] == 1, pdb["spec"]
    with started_load(c, workers=1) as load:
        pass
    assert not load.failed, load.failed


def test_deleting_a_router_pod_under_load_fails_no_request(installed, figure):
    c, _ = installed
    victim = router_pods(c)[0]
    with started_load(c) as load:
        c.kubectl("delete", "pod", "-n", NS, victim["metadata"]["name"], "--wait=false")

        def replaced() -> bool:
            names = [p["metadata"]["name"] for p in router_pods(c)]
            if victim["metadata"]["name"] in names:
                raise NotYet(f"{victim['metadata']['name']} still live")
            return deployment_settled(c, ROUTER_DEPLOYMENT, NS, 2)

        wait_for(replaced, 180, "the deleted router pod to be replaced and Ready", interval=1)
        # the deleted pod is gone only after its preStop and drain: the load ran through all of it
        gone = wait_for(lambda: not any(p["metadata"]["name"] == victim["metadata"]["name"] for p in c.kubectl_json(
            "get", "pods", "-n", NS, "-l", f"consort.dev/ensemble-router={ROUTER}")["items"]) or NotYet("terminating"),
            120, "the deleted router pod to finish terminating", interval=1)
        assert gone
        time.sleep(2)
    figure(f"router pod deleted under load (2 router replicas): {load.summary()}")
    assert load.ok and not load.failed, load.failed[:5]


def test_killing_an_engine_process_degrades_the_specialist_and_it_recovers_with_no_failed_request(installed, figure):
    c, _ = installed
    victim = engine_pod(c, "template")
    container = victim["spec"]["containers"][0]["name"]
    seen: list[tuple[str, str]] = []
    stop = threading.Event()
    watcher = watch_phases(c, "specialist", "template", NS, stop, seen)
    try:
        with started_load(c, intent="template") as load:
            killed_at = time.monotonic()
            kill_container_process(c, victim, container)

            def recovered() -> bool:
                if any(phase == "Failed" for phase, _ in seen):
                    return True   # asserted below: no use waiting
                pod = engine_pod(c, "template")
                status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
                if pod["metadata"]["uid"] != victim["metadata"]["uid"]:
                    raise NotYet("the pod was replaced: the kill must restart the container in place")
                if status["restartCount"] < 1 or not status.get("ready") or not seen or seen[-1][0] != "Ready" \
                        or not any(phase == "Degraded" for phase, _ in seen):
                    raise NotYet(f"restarts {status['restartCount']}, ready {status.get('ready')}, phases {seen}")
                return True

            wait_for(recovered, 300, "the engine container to restart and template to be Ready again", interval=1)
            back_after = time.monotonic() - killed_at
            time.sleep(2)
    finally:
        stop.set()
        watcher.join(30)
    figure(f"engine process killed (template, SIGKILL): phases {' -> '.join(f'{p}/{r}' for p, r in seen)}; "
           f"Ready again after {back_after:.0f}s; {load.summary()}")
    assert ("Degraded", "ReplicaRestarting") in seen, seen
    assert not any(phase == "Failed" for phase, _ in seen), seen
    assert load.ok and not load.failed, load.failed[:5]


def test_draining_the_node_is_not_blocked_by_a_specialist_at_min_ready(installed, figure):
    """stl runs replicas == minReady == 1: its PDB still allows one disruption, so `kubectl drain`
    evicts it and finishes (on this one-node cluster the replacement stays Pending until uncordon).
    The drain selects the engine pods: the routers' and the operator's own PDBs keep one of their
    two replicas, which on a single node (nowhere to reschedule) would rightly hold a full drain."""
    c, _ = installed
    spec = c.kubectl_json("get", "specialist", "stl", "-n", NS)["spec"]
    assert spec["replicas"] == spec["minReady"], spec
    pdb = wait_for(lambda: c.kubectl_json("get", "pdb", "stl", "-n", NS), 30, "the stl PDB")
    assert pdb["spec"].get("maxUnavailable") == 1 and pdb["status"].get("disruptionsAllowed") == 1, pdb
    victim = engine_pod(c, "stl")
    started = time.monotonic()
    try:
        drain = c.kubectl("drain", NODE, "--pod-selector=consort.dev/specialist=stl", "--ignore-daemonsets",
                          "--delete-emptydir-data", "--timeout=120s", check=False, timeout=150)
        took = time.monotonic() - started
        assert drain.returncode == 0, f"drain failed or was blocked:\n{drain.stdout[-2000:]}\n{drain.stderr[-2000:]}"
        assert f"node/{NODE} drained" in drain.stdout, drain.stdout

        def pending_replacement() -> dict:
            pod = engine_pod(c, "stl")
            if pod["metadata"]["uid"] == victim["metadata"]["uid"] or pod["status"].get("phase") != "Pending":
                raise NotYet(f"{pod['metadata']['name']}: {pod['status'].get('phase')}")
            return pod

        wait_for(pending_replacement, 60, "stl's replacement pod to wait Pending on the cordoned node", interval=1)
    finally:
        c.kubectl("uncordon", NODE, check=False)
    figure(f"kubectl drain with stl at replicas == minReady: done in {took:.1f}s (evicted, replacement Pending)")
    wait_for(lambda: all_specialists_ready(c), 420, "every Specialist Ready again after uncordon", interval=2)


def operator_leader(c) -> tuple[str, dict]:
    leases = c.kubectl_json("get", "leases", "-n", OPERATOR_NS)["items"]
    lease = next(x for x in leases if x["metadata"]["name"].startswith(RELEASE))
    holder = lease["spec"].get("holderIdentity") or ""
    if not holder:
        raise NotYet(f"Lease {lease['metadata']['name']} is free")
    return holder, lease


def operator_pods(c) -> list[dict]:
    return c.kubectl_json("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=consort-operator")["items"]


def test_killing_the_operator_leader_mid_rollout_hands_over_within_20s_with_no_failed_request(installed, figure):
    c, _ = installed
    operator = c.kubectl_json("get", "deployments", "-n", OPERATOR_NS)["items"][0]["metadata"]["name"]
    wait_for(lambda: deployment_settled(c, operator, OPERATOR_NS, 2), 120, "both operator replicas Ready", interval=2)
    holder, _ = wait_for(lambda: operator_leader(c), 60, "an operator to hold the Lease")
    leader = next(p for p in operator_pods(c) if holder.startswith(p["metadata"]["name"] + "_"))
    before = c.kubectl_json("get", "deployment", ROUTER_DEPLOYMENT, "-n", NS)
    with started_load(c) as load:
        # a router rollout (new pod template): the Deployment surges one pod at a time
        c.kubectl("patch", "ensemblerouter", ROUTER, "-n", NS, "--type=merge",
                  "-p", json.dumps({"spec": {"resources": {"cpu": "200m", "memory": "500Mi"}}}))
        wait_for(lambda: c.kubectl_json("get", "deployment", ROUTER_DEPLOYMENT, "-n", NS)["metadata"]["generation"]
                 > before["metadata"]["generation"] or NotYet("template unchanged"), 60,
                 "the operator to start the router rollout", interval=0.5)
        killed_at = time.monotonic()
        kill_container_process(c, leader, leader["spec"]["containers"][0]["name"])

        def taken_over() -> str:
            now_holder, _ = operator_leader(c)
            if now_holder == holder:
                raise NotYet(f"still {holder}")
            return now_holder

        new_holder = wait_for(taken_over, 40, "another operator to take the Lease", interval=0.5)
        handover = time.monotonic() - killed_at
        wait_for(lambda: deployment_settled(c, ROUTER_DEPLOYMENT, NS, 2), 240, "the router rollout to finish", interval=1)

        def router_status_caught_up() -> dict:
            er = c.kubectl_json("get", "ensemblerouter", ROUTER, "-n", NS)
            st = er.get("status") or {}
            if st.get("observedGeneration") != er["metadata"]["generation"] or st.get("readyReplicas") != 2:
                raise NotYet(f"status {st.get('observedGeneration')}/{er['metadata']['generation']}, "
                             f"ready {st.get('readyReplicas')}")
            return er

        wait_for(router_status_caught_up, 60, "the new leader to report the finished rollout", interval=1)
        done = time.monotonic() - killed_at
        time.sleep(2)
    figure(f"operator leader SIGKILLed mid router rollout: Lease taken over after {handover:.1f}s "
           f"({holder} -> {new_holder}), rollout reported done {done:.0f}s after the kill; {load.summary()}")
    assert handover <= 20, f"the standby took {handover:.1f}s to take over"
    assert load.ok and not load.failed, load.failed[:5]


def test_apiserver_down_for_60s_under_load_fails_no_request_and_never_two_leaders(installed, figure):
    c, forward = installed
    forward.stop()   # it goes through the apiserver; the load does not
    outage = ApiserverOutage(c)
    transitions_before = operator_leader(c)[1]["spec"].get("leaseTransitions", 0)
    with started_load(c) as load:
        outage.stop()
        stopped_at = time.monotonic()
        try:
            time.sleep(60)
            failed_during = len(load.failed)
            sent_during = load.sent
        finally:
            outage.start()
        back_at, back_wall = time.monotonic(), time.time()
        wait_for(lambda: c.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0, 60,
                 "the apiserver to answer /readyz again", interval=0.5)

        def everything_ready() -> bool:
            all_specialists_ready(c)
            deployment_settled(c, ROUTER_DEPLOYMENT, NS, 2)
            pods = operator_pods(c)
            if len(pods) != 2 or not all(condition(p, "Ready") and condition(p, "Ready")["status"] == "True" for p in pods):
                raise NotYet("operator pods not Ready")
            _, lease = operator_leader(c)   # and leading again: renewed since the apiserver came back
            renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00")).timestamp()
            if renewed < back_wall:
                raise NotYet(f"Lease not renewed since the apiserver's return (holder {lease['spec']['holderIdentity']})")
            return True

        wait_for(everything_ready, 90, "everything Ready again after the apiserver's return", interval=1)
        ready_after = time.monotonic() - back_at
        time.sleep(3)
    _, lease = operator_leader(c)
    spans = leadership_spans(c, OPERATOR_NS, operator_pods(c))
    overlaps = [(a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    logs = "\n".join(c.kubectl("logs", "-n", OPERATOR_NS, p["metadata"]["name"], *extra, check=False).stdout
                     for p in operator_pods(c) for extra in ((), ("--previous",)))
    # The node controller's mark (see below) leaves one NodeNotReady event per pod.
    marked = c.kubectl("get", "events", "-n", NS, "--field-selector", "reason=NodeNotReady", "-o", "name",
                       check=False).stdout.split()
    figure(f"apiserver stopped {back_at - stopped_at:.0f}s under load: {sent_during} requests during "
           f"({failed_during} failed), {load.summary()} in all; everything Ready {ready_after:.0f}s after its return; "
           f"Lease transitions {transitions_before} -> {lease['spec'].get('leaseTransitions', 0)}, "
           f"{len(spans)} leadership spans, {logs.count('Traceback')} tracebacks in the operators' logs, "
           f"{len(marked)} pods marked NotReady by the node controller")
    assert not load.failed, (load.failed[:5], f"{len(marked)} pods marked NotReady by the node controller")
    # Recovery, not speed (4-18 s measured here; the figure above reports it). With a node-monitor
    # grace period shorter than the outage plus the controller's informer retry, the node controller
    # marked the node's pods NotReady on the apiserver's return and requests were refused for seconds
    # (everything Ready only 68 s after it): the local cluster's period is 240 s.
    assert ready_after <= 180, f"everything Ready only {ready_after:.0f}s after the apiserver's return"
    assert spans and not overlaps, f"two operators led at once: {overlaps}"
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 500:][:3000]


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
