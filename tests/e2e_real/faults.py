"""What the fault steps of tests/e2e_real need: bounded load through the router Service, and the
faults themselves (a container's process killed from the node, the apiserver stopped and started).

The load goes to the router Service's ClusterIP, as a pod's client would: kube-proxy's rules on
this machine (the real node) carry it to a router pod, with no `kubectl port-forward` (which pins
one pod, and needs the apiserver) in between.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
from kube import NotYet  # noqa: E402
from localcluster.layout import Layout  # noqa: E402  (hack/localcluster: standard library only)
from localcluster.processes import cmdline, start_process  # noqa: E402


@dataclass
class Load:
    """A few workers sending completions through the router until stopped or `limit` requests are
    done (it stops by itself); every third is streamed. Each request opens its own connection (a
    fresh client), as many independent callers would, so a replaced pod is never reached through a
    kept-alive connection the client chose to reuse."""

    base_url: str
    model: str
    api_key: str
    intent: str | None = None
    workers: int = 3
    limit: int = 2000
    pause: float = 0.2
    ok: int = 0
    streamed: int = 0
    failed: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sent(self) -> int:
        return self.ok + len(self.failed)

    def _one(self, n: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=60)
        headers = {"x-consort-intent": self.intent} if self.intent else {}
        try:
            if n % 3 == 0:
                chunks = list(client.completions.create(model=self.model, prompt="std::vector<int> v;", max_tokens=4,
                                                        stream=True, extra_headers=headers))
                if not any(ch.choices and ch.choices[0].finish_reason for ch in chunks):
                    raise RuntimeError(f"stream ended without a finish_reason after {len(chunks)} chunks")
            else:
                out = client.completions.create(model=self.model, prompt="int main() {", max_tokens=4,
                                                extra_headers=headers)
                if not out.choices:
                    raise RuntimeError("no choices")
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
            with self._lock:
                self.failed.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}"[:300])
        else:
            with self._lock:
                self.ok += 1
                self.streamed += n % 3 == 0
        finally:
            client.close()

    def _loop(self, worker: int) -> None:
        n = worker
        while not self._stop.is_set() and self.sent < self.limit:
            self._one(n)
            n += self.workers
            self._stop.wait(self.pause)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def summary(self) -> str:
        return f"{self.sent} requests ({self.streamed} streamed), {len(self.failed)} failed"


def service_url(c, name: str, namespace: str) -> str:
    svc = c.kubectl_json("get", "service", name, "-n", namespace)
    port = svc["spec"]["ports"][0]["port"]
    return f"http://{svc['spec']['clusterIP']}:{port}"


def container_pid(c, pod: dict, container: str) -> int:
    """The host PID of a container's main process, from the node's containerd."""
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
    cid = status["containerID"].removeprefix("containerd://")
    sock = c.state_dir / "node" / "containerd.sock"
    out = subprocess.run(["ctr", f"--address={sock}", "-n", "k8s.io", "task", "ls"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    for line in out.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == cid:
            return int(pid)
    raise LookupError(f"no task {cid} for {pod['metadata']['name']}/{container} in:\n{out}")


def kill_container_process(c, pod: dict, container: str) -> int:
    """SIGKILL the container's main process (not the pod): the kubelet restarts the container."""
    pid = container_pid(c, pod, container)
    os.kill(pid, signal.SIGKILL)
    return pid


class ApiserverOutage:
    """Stops this cluster's kube-apiserver (SIGTERM, waits for it to exit) and starts it again with
    the same command line, log and pid file."""

    def __init__(self, c):
        self.layout = Layout(c.state_dir, c.bin_dir)
        self.pid = int((self.layout.pids / "kube-apiserver.pid").read_text())
        self.argv = cmdline(self.pid)
        assert self.argv and Path(self.argv[0]).name == "kube-apiserver", self.argv

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{self.pid}").exists():
            os.kill(self.pid, signal.SIGKILL)

    def start(self) -> None:
        proc = start_process("kube-apiserver", self.argv, self.layout)
        self.pid = proc.pid


def deployment_settled(c, name: str, namespace: str, replicas: int) -> dict:
    d = c.kubectl_json("get", "deployment", name, "-n", namespace)
    st = d.get("status") or {}
    counts = (st.get("readyReplicas"), st.get("updatedReplicas"), st.get("availableReplicas"), st.get("replicas"))
    if st.get("observedGeneration") != d["metadata"]["generation"] or counts != (replicas,) * 4:
        raise NotYet(f"{name}: generation {d['metadata']['generation']} observed {st.get('observedGeneration')}, "
                     f"ready/updated/available/total {counts}")
    return d


def watch_phases(c, kind: str, name: str, namespace: str, stop: threading.Event,
                 seen: list[tuple[str, str]]) -> threading.Thread:
    """Records each (phase, reason of the Ready condition) change of an object until `stop`."""
    def loop() -> None:
        while not stop.is_set():
            out = c.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False, timeout=20)
            if out.returncode == 0:
                status = json.loads(out.stdout).get("status") or {}
                ready = next((x for x in status.get("conditions") or [] if x["type"] == "Ready"), {})
                now = (status.get("phase"), ready.get("reason"))
                if not seen or seen[-1] != now:
                    seen.append(now)
            stop.wait(0.5)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def leadership_spans(c, namespace: str, pods: list[dict]) -> list[tuple[float, float, str]]:
    """(from, to, identity) of each operator process's time as leader, from the operators' logs
    (current and previous containers, kubelet timestamps): it leads from its "leads" line until its
    "lost the leader Lease" line, or until its container ended, or now."""
    def ts(stamp: str) -> float:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

    spans = []
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod["status"]["containerStatuses"][0]
        for previous, ended in ((True, ((status.get("lastState") or {}).get("terminated") or {}).get("finishedAt")),
                                (False, None)):
            if previous and not ended:
                continue
            out = c.kubectl("logs", "-n", namespace, name, "--timestamps", *(["--previous"] if previous else []),
                            check=False, timeout=30).stdout
            start = me = None
            for line in out.splitlines():
                stamp, _, text = line.partition(" ")
                if m := re.search(r"consort operator: (\S+) leads \(Lease", text):
                    start, me = ts(stamp), m.group(1)
                elif "lost the leader Lease" in text and start is not None:
                    spans.append((start, ts(stamp), me))
                    start = None
            if start is not None:
                spans.append((start, ts(ended) if ended else time.time(), me))
    return sorted(spans)
