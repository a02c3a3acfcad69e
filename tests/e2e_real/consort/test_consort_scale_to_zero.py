"""Scale to zero on the real node, with the node-local model cache on (chart value modelCache):
a Specialist with scaleToZero goes to zero pods when idle (phase Idle, Argo CD Healthy by the
shipped health.lua run on the live object), then a burst of 20 concurrent requests through the
router Service is held while the engine starts from the cached model, and every one is answered.

The steps share one installation and run in order; the second prints the cold start's time split
(pod created, scheduled, sandbox + image, init containers, engine process -> /ready, pod Ready,
first token) from a watch on the pod, the containers' states and the engine's own log.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from faults import service_url
from kube import NotYet, condition, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.real_node]

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "consort"
HEALTH_LUA = REPO / "examples" / "argocd" / "consort.dev" / "Specialist" / "health.lua"
RELEASE, OPERATOR_NS, NS = "consort", "consort-system", "default"
NAME, ROUTER = "sleepy", "s2z"
ENGINE_UID = 10001
IDLE_AFTER_S = 10
BURST = 20
FIRST_ANSWER_S = 20      # the cold-start budget (docs/autoscaling.md): reported as met or missed
HELD_AT_MOST_S = 60      # what the test asserts: the burst is answered within its hold timeout

MANIFESTS = [
    {"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
     "metadata": {"name": NAME, "labels": {"consort.dev/ensemble": ROUTER}},
     "spec": {"model": {"source": "demo://tiny"}, "replicas": 1, "minReady": 1,
              "resources": {"gpus": 0, "cpu": "400m", "memory": "2Gi"}, "kv": {"blockSize": 16, "numBlocks": 256},
              "scheduler": {"maxNumSeqs": 32, "maxNumBatchedTokens": 1024}, "warmupTimeoutSeconds": 120,
              "scaleToZero": {"idleAfter": f"{IDLE_AFTER_S}s", "whileCold": "hold", "maxHeld": 64,
                              "holdTimeoutSeconds": 60}}},
    {"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": ROUTER},
     "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": ROUTER}}, "replicas": 1,
              "resources": {"cpu": "200m", "memory": "512Mi"}}},
]


@pytest.fixture(scope="module")
def installed(real_cluster, tmp_path_factory):
    c = real_cluster
    # A directory that does not exist yet: kubelet creates it (root-owned) and the chart's pods must
    # make it theirs, as on a fresh node.
    cache_dir = tmp_path_factory.mktemp("node") / "model-cache"
    c.helm("install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace", "--wait", "--timeout", "5m",
           "-f", str(CHART / "values-local.yaml"), "--set", f"modelCache.hostPath={cache_dir}",
           "--set", "modelCache.size=2Gi", timeout=400)
    manifests = yaml.safe_dump_all(MANIFESTS)
    c.kubectl("apply", "-n", NS, "-f", "-", input=manifests)
    yield c, cache_dir
    c.kubectl("delete", "-n", NS, "-f", "-", "--ignore-not-found", "--wait=true", "--timeout=120s", input=manifests,
              check=False, timeout=150)
    c.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--ignore-not-found", "--wait", "--timeout", "2m", check=False,
           timeout=150)
    shutil.rmtree(cache_dir, ignore_errors=True)


def api_key(c) -> str:
    text = base64.b64decode(c.kubectl_json("get", "secret", f"{ROUTER}-api-keys", "-n", NS)["data"]["keys"]).decode()
    return next(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("default: "))


def engine_pods(c) -> list[dict]:
    return c.kubectl_json("get", "pods", "-n", NS, "-l", f"consort.dev/specialist={NAME}")["items"]


def argocd_health(obj: dict) -> dict:
    """The chart's Argo CD health check, run as Argo CD runs it (a Lua 5.1) on the live object."""
    import lupa.lua51

    lua = lupa.lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(HEALTH_LUA.read_text())
    return {"status": hs["status"], "message": hs["message"]}


def cache_outcome(pod: dict) -> str:
    """The demo model's init container's `model cache hit|miss|bypass ...` line (its termination message)."""
    for s in pod["status"].get("initContainerStatuses") or []:
        if s["name"].startswith("demo-model-"):
            msg = ((s.get("state") or {}).get("terminated") or {}).get("message") or ""
            if msg:
                return msg.strip()
    raise NotYet("the demo model's init container has not finished")


def test_an_idle_specialist_goes_to_zero_pods_reads_idle_and_argocd_healthy(installed, figure):
    c, cache_dir = installed

    def ready_pod() -> dict:
        pods = [p for p in engine_pods(c) if not p["metadata"].get("deletionTimestamp")]
        if len(pods) != 1 or (condition(pods[0], "Ready") or {}).get("status") != "True":
            raise NotYet(f"{len(pods)} pods, {[p['status'].get('phase') for p in pods]}")
        return pods[0]

    pod = wait_for(ready_pod, 420, f"the {NAME} engine pod to be Ready", interval=2)
    # The first start on a fresh node filled the cache through a directory kubelet created as root
    # (a pod of the Deployment's first template may have filled it and this one copied it: a hit).
    assert re.match(r"model cache (miss|hit) demo://tiny", cache_outcome(pod)), cache_outcome(pod)
    st = os.stat(cache_dir)
    assert (st.st_uid, st.st_gid) == (ENGINE_UID, ENGINE_UID), f"cache dir owned by {st.st_uid}:{st.st_gid}"
    assert any(p.is_dir() for p in cache_dir.iterdir()), list(cache_dir.iterdir())

    from openai import OpenAI
    wait_for(lambda: c.kubectl_json("get", "deployment", f"{ROUTER}-router", "-n", NS)["status"].get("readyReplicas") == 1,
             300, "the router Deployment to be ready", interval=2)
    client = OpenAI(base_url=f"{service_url(c, ROUTER, NS)}/v1", api_key=api_key(c), max_retries=2, timeout=60)
    served_at = time.monotonic()
    assert client.completions.create(model=NAME, prompt="int main() {", max_tokens=4).choices[0].text is not None

    def idle() -> dict:
        obj = c.kubectl_json("get", "specialist", NAME, "-n", NS)
        left = engine_pods(c)
        if obj["spec"].get("replicas") != 0 or (obj.get("status") or {}).get("phase") != "Idle" or left:
            raise NotYet(f"replicas {obj['spec'].get('replicas')}, phase {(obj.get('status') or {}).get('phase')}, "
                         f"{len(left)} pod(s) left")
        return obj

    obj = wait_for(idle, IDLE_AFTER_S + 120, f"{NAME} to scale to zero pods and read Idle", interval=1)
    took = time.monotonic() - served_at
    ready = condition(obj, "Ready")
    assert ready["status"] == "True" and ready["reason"] == "ScaledToZero", ready
    assert c.kubectl_json("get", "deployment", NAME, "-n", NS)["spec"]["replicas"] == 0
    health = argocd_health(obj)
    assert health["status"] == "Healthy" and health["message"].startswith("Idle: "), health
    figure(f"scale to zero: {NAME} (idleAfter {IDLE_AFTER_S}s) at 0 pods, phase Idle, Argo CD {health['status']} "
           f"{took:.0f}s after its last answer; first start's model cache: {cache_outcome(pod)}")


class PodTimeline:
    """`kubectl get pods -w` on the Specialist's pods: the monotonic time each milestone was first seen."""

    def __init__(self, c) -> None:
        self.seen: dict[str, float] = {}
        self.pod: dict = {}
        self.proc = subprocess.Popen([c.bin("kubectl"), f"--kubeconfig={c.kubeconfig}", "get", "pods", "-n", NS,
                                      "-l", f"consort.dev/specialist={NAME}", "-w", "-o", "json"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _mark(self, what: str, now: float) -> None:
        self.seen.setdefault(what, now)

    def _read(self) -> None:
        decoder, buf = json.JSONDecoder(), ""
        for line in self.proc.stdout:
            buf += line
            try:
                pod, end = decoder.raw_decode(buf.lstrip())
            except ValueError:
                continue
            buf = buf.lstrip()[end:]
            now = time.monotonic()
            if pod["metadata"].get("deletionTimestamp"):
                continue
            self.pod = pod
            self._mark("created", now)
            if (condition(pod, "PodScheduled") or {}).get("status") == "True":
                self._mark("scheduled", now)
            for s in pod["status"].get("initContainerStatuses") or []:
                state = s.get("state") or {}
                if "running" in state or "terminated" in state:
                    self._mark(f"{s['name']} started", now)
                if "terminated" in state:
                    self._mark(f"{s['name']} done", now)
            for s in pod["status"].get("containerStatuses") or []:
                if "running" in (s.get("state") or {}):
                    self._mark("engine started", now)
            if (condition(pod, "Ready") or {}).get("status") == "True":
                self._mark("pod Ready", now)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.thread.join(10)


def test_a_burst_at_zero_is_held_and_all_20_answered(installed, figure):
    from openai import OpenAI

    c, _ = installed
    assert not engine_pods(c), "the previous step left an engine pod"
    base, key = f"{service_url(c, ROUTER, NS)}/v1", api_key(c)
    timeline = PodTimeline(c)
    time.sleep(1)   # the watch is established (it lists nothing: no pod yet)

    def one(i: int) -> tuple[float, float]:
        client = OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
        first = None
        chunks = client.completions.create(model=NAME, prompt=f"void f{i}() {{", max_tokens=4, stream=True)
        for ch in chunks:
            if first is None and ch.choices and ch.choices[0].text:
                first = time.monotonic()
        client.close()
        return (first or time.monotonic()) - t0, time.monotonic() - t0

    errors: list[str] = []

    def guarded(i: int) -> tuple[float, float] | None:
        try:
            return one(i)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return None

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(BURST) as pool:
            answers = [a for a in pool.map(guarded, range(BURST)) if a is not None]
    finally:
        timeline.stop()
    assert not errors, f"{len(errors)} of {BURST} requests failed: {errors[:5]}"
    first_token = min(a[0] for a in answers)
    pod = timeline.pod
    name = pod["metadata"]["name"]
    log = c.kubectl("logs", "-n", NS, name, "-c", pod["spec"]["containers"][0]["name"]).stdout
    engine = re.search(r"ready in ([0-9.]+) s from process start \(load ([0-9.]+) s, warmup ([0-9.]+) s\)", log)
    assert engine, log[-2000:]
    fresh = c.kubectl_json("get", "pod", name, "-n", NS)
    outcome = cache_outcome(fresh)
    events = c.kubectl_json("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")["items"]
    pulled = sorted({e["message"].split('"')[1] for e in events if e["reason"] == "Pulled" and "already present" in e["message"]})

    rel = {k: v - t0 for k, v in timeline.seen.items()}
    inits = [s["name"] for s in pod["spec"].get("initContainers") or []]
    steps = [("pod created", rel.get("created")), ("scheduled", rel.get("scheduled"))]
    for n in inits:
        steps += [(f"{n} started", rel.get(f"{n} started")), (f"{n} done", rel.get(f"{n} done"))]
    steps += [("engine container started", rel.get("engine started")), ("pod Ready", rel.get("pod Ready")),
              ("first token", first_token)]
    split = ", ".join(f"{what} {at:.1f}s" for what, at in steps if at is not None)
    budget = "met" if first_token <= FIRST_ANSWER_S else "MISSED"
    figure(f"cold start from zero (burst of {BURST}, model cache: {outcome}): {split}; "
           f"{FIRST_ANSWER_S}s first-answer budget {budget}; engine: ready "
           f"{engine.group(1)}s from process start (load {engine.group(2)}s, warmup {engine.group(3)}s); "
           f"images already on the node: {', '.join(pulled) or 'none reported'}; "
           f"all {len(answers)} answered, last after {max(a[1] for a in answers):.1f}s")
    assert len(answers) == BURST
    assert outcome.startswith("model cache hit demo://tiny"), outcome
    # A speed target is a reported figure, not a pass/fail on a shared machine: the test asserts that the
    # burst was held and answered, with a bound that only a broken wake-up misses.
    assert first_token <= HELD_AT_MOST_S, f"first token {first_token:.1f}s after the first request: {split}"
    # The router serves the warm engine as soon as it answers; the operator's status follows at its
    # next probe (the burst can be over within a second of the engine turning warm).
    def ready_again() -> dict:
        obj = c.kubectl_json("get", "specialist", NAME, "-n", NS)
        if obj["status"].get("phase") != "Ready":
            raise NotYet(f"phase {obj['status'].get('phase')}")
        return obj
    obj = wait_for(ready_again, 60, f"{NAME} to read Ready again", interval=1)
    assert obj["spec"]["replicas"] == 1
