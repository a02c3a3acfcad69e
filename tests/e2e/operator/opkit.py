"""Helpers of the operator's e2e tests (imported by name: pytest puts this folder on sys.path)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from kube import NotYet, wait_for

REPO = Path(__file__).resolve().parents[3]
CONSORT = str(Path(sys.executable).with_name("consort"))


from procs import free_port  # noqa: E402,F401  (one port picker for every test; re-exported)


class Operator:
    """`consort operator` as a subprocess; logs in `log_path`."""

    def __init__(self, cluster, namespace: str, tmp: Path, *extra: str):
        self.cluster = cluster
        self.namespace = namespace
        self.extra = list(extra)
        self.log_path = tmp / f"operator-{namespace}.log"
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start_argv_filter = lambda argv: argv

    def start(self) -> "Operator":
        # kwok's pod IPs are fake: an operator on the default pod-ip resolver would dial them (and the
        # real node's egress guard counts it). A test that wants probes names its resolver.
        resolver = [] if "--pod-address" in self.extra else ["--pod-address", "none"]
        argv = [CONSORT, "operator", "--kubeconfig", str(self.cluster.kubeconfig), "--namespace", self.namespace,
                "--standalone", "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
                "--poll-seconds", "0.5", "--idle-seconds", "5", *resolver, *self.extra]
        argv = self.start_argv_filter(argv)
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.cluster.env())
        out.close()
        wait_for(self.live, 60, f"operator liveness ({self.tail()})", interval=0.5)
        return self

    def live(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"


def reconciles(op: Operator) -> float:
    """The operator's finished passes (consort_operator_reconcile_total over kinds and results)."""
    return sum(v for k, v in op.metrics().items() if k.startswith("consort_operator_reconcile_total{"))


def wait_counted(op: Operator, timeout: float = 15) -> float:
    """Until `op` has counted a pass. A pass writes its children first and counts itself after its
    status patch and events, so a child can show the change a moment before the counter moves."""
    def counted() -> float:
        if (n := reconciles(op)) == 0:
            raise NotYet("no pass counted")
        return n
    return wait_for(counted, timeout, "the operator to count its pass", interval=0.2)


def get_json(cluster, *args: str) -> dict:
    return cluster.kubectl_json("get", *args)


def wait_phase(cluster, namespace: str, kind: str, name: str, phase: str, timeout: float = 90,
               ready: str | None = None) -> dict:
    def check() -> dict:
        obj = get_json(cluster, kind, name, "-n", namespace)
        st = obj.get("status") or {}
        if st.get("phase") != phase or (ready is not None and st.get("ready") != ready):
            raise NotYet(f"status {json.dumps({k: st.get(k) for k in ('phase', 'ready', 'warmReplicas', 'replicaStatus')})}")
        return obj

    return wait_for(check, timeout, f"{kind} {namespace}/{name} phase {phase}", interval=0.5)
