"""Leader election against the real apiserver: of two `consort operator --leader-election` processes
exactly one holds the Lease and reconciles; SIGKILL it and the other acquires within lease duration
+ retry period and reconciles; SIGTERM hands the Lease back; a leader cut off from the apiserver
exits before the standby acquires."""
from __future__ import annotations

import re
import socket
import sys
import threading
import time
from urllib.parse import urlparse
from pathlib import Path

import pytest
import yaml
from kube import NotYet, wait_for
from opkit import Operator, get_json, reconciles, wait_counted, wait_phase

pytestmark = pytest.mark.e2e

LEASE = "consort-operator"


def specialist(name: str, replicas: int = 1) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist", "metadata": {"name": name},
        "spec": {"model": {"source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"}, "replicas": replicas, "minReady": 1,
                 "intents": ["codegen"]}})


class CuttableProxy:
    """A TCP forwarder to the apiserver that the test can cut: an outage only the operator behind it
    sees (TLS passes through; the serving certificate names 127.0.0.1, whatever the port)."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.up = False
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def proxied(cluster, tmp: Path) -> tuple[object, CuttableProxy]:
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    server = urlparse(kc["clusters"][0]["cluster"]["server"])
    proxy = CuttableProxy(server.hostname, server.port)
    kc["clusters"][0]["cluster"]["server"] = f"https://{server.hostname}:{proxy.port}"
    path = tmp / "proxied.kubeconfig"
    path.write_text(yaml.safe_dump(kc))

    class Proxied:
        kubeconfig = path
        env = cluster.env

    return Proxied, proxy


def start_pair(cluster, namespace: str, tmp: Path, *extra: str) -> list[Operator]:
    args = ("--leader-election", "--lease-namespace", namespace, "--lease-name", LEASE,
            "--warm-signal", "pod-ready", *extra)
    ops = []
    for i in range(2):
        (tmp / f"op{i}").mkdir()
        ops.append(Operator(cluster, namespace, tmp / f"op{i}", *args).start())
    return ops


def identity_of(op: Operator) -> str:
    m = re.search(r'consort_operator_leader\{identity="([^"]+)"\}', "\n".join(op.metrics()))
    assert m, op.tail()
    return m.group(1)


def leads(op: Operator) -> bool:
    return any(k.startswith("consort_operator_leader{") and v == 1.0 for k, v in op.metrics().items())


def holder(cluster, namespace: str) -> str:
    lease = get_json(cluster, "lease", LEASE, "-n", namespace)
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def stop_all(cluster, namespace: str, ops: list[Operator]) -> None:
    if any(op.proc is not None and op.proc.poll() is None for op in ops):
        cluster.kubectl("delete", "specialists,ensemblerouters", "--all", "-n", namespace, "--wait=true",
                        "--timeout=60s", check=False, timeout=90)
    for op in ops:
        op.stop()
        sys.stderr.write(f"\n--- operator log tail ({op.log_path})\n{op.tail(15)}\n")


@pytest.mark.timeout(300)
def test_one_leader_reconciles_and_a_killed_one_is_replaced_within_20s(cluster, crds, namespace, tmp_path):
    ops = start_pair(cluster, namespace, tmp_path)
    try:
        def one_leader() -> tuple[Operator, Operator]:
            flags = [leads(op) for op in ops]
            if sorted(flags) != [False, True]:
                raise NotYet(f"leader flags {flags}")
            return (ops[0], ops[1]) if flags[0] else (ops[1], ops[0])

        leader, standby = wait_for(one_leader, 30, "exactly one operator leads")
        assert holder(cluster, namespace) == identity_of(leader) != identity_of(standby)

        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("alpha"))
        wait_phase(cluster, namespace, "specialist", "alpha", "Ready", timeout=60)
        time.sleep(2)   # a standby that reconciled would have done so by now
        assert reconciles(leader) > 0 and reconciles(standby) == 0, (reconciles(leader), reconciles(standby))
        assert "leads (Lease" in leader.log_path.read_text() and "leads (Lease" not in standby.log_path.read_text()

        # SIGKILL: no release, the standby must wait out the lease and then take over.
        killed_at = time.monotonic()
        leader.proc.kill()
        leader.proc.wait(10)
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("alpha", replicas=2))

        def acquired() -> float:
            if holder(cluster, namespace) != identity_of(standby):
                raise NotYet(f"holder {holder(cluster, namespace)!r}")
            return time.monotonic() - killed_at

        took = wait_for(acquired, 30, "the standby to acquire the Lease", interval=0.2)

        def scaled() -> float:
            d = get_json(cluster, "deployment", "alpha", "-n", namespace)
            if d["spec"]["replicas"] != 2:
                raise NotYet(f"replicas {d['spec']['replicas']}")
            return time.monotonic() - killed_at

        reconciled = wait_for(scaled, 30, "the new leader to scale alpha", interval=0.2)
        sys.stderr.write(f"\n[leader failover] SIGKILL -> Lease acquired {took:.1f}s, -> change reconciled {reconciled:.1f}s\n")
        assert took < 20, f"failover took {took:.1f}s"
        assert leads(standby) and wait_counted(standby) > 0
        events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={LEASE}")["items"]
        said = {e["message"] for e in events if e.get("reason") == "LeaderElection"}
        assert f"{identity_of(standby)} became leader" in said and len(said) == 2, said

        # SIGTERM: the leader stops Kopf and hands the Lease back (empty holder) for the next one.
        cluster.kubectl("delete", "specialists", "--all", "-n", namespace, "--wait=true", "--timeout=60s", timeout=90)
        standby.stop()
        assert standby.proc.returncode == 0, standby.tail()
        assert holder(cluster, namespace) == ""
    finally:
        stop_all(cluster, namespace, ops)


@pytest.mark.timeout(300)
def test_a_leader_cut_off_from_the_apiserver_exits_before_the_standby_acquires(cluster, crds, namespace, tmp_path):
    """The measured failure of Kopf peering: the standby resumed while the cut-off leader never paused.
    Here the leader's own connection to the apiserver is cut (the standby's is not, the harder case):
    the leader must exit (status 1) before the standby's first write as holder."""
    via, proxy = proxied(cluster, tmp_path)
    args = ("--leader-election", "--lease-namespace", namespace, "--lease-name", LEASE, "--warm-signal", "pod-ready")
    ops: list[Operator] = []
    try:
        for i, target in enumerate((via, cluster)):   # the proxied one first: it becomes the leader
            (tmp_path / f"op{i}").mkdir()
            ops.append(Operator(target, namespace, tmp_path / f"op{i}", *args).start())
            if i == 0:
                wait_for(lambda: leads(ops[0]) or None, 30, "the proxied operator to lead")
        leader, standby = ops
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("alpha"))
        wait_phase(cluster, namespace, "specialist", "alpha", "Ready", timeout=60)

        cut_at = time.monotonic()
        proxy.cut()
        leader_exit = standby_lead = None
        while time.monotonic() - cut_at < 40 and (leader_exit is None or standby_lead is None):
            now = time.monotonic() - cut_at
            if leader_exit is None and leader.proc.poll() is not None:
                leader_exit = now
            if standby_lead is None and holder(cluster, namespace) == identity_of(standby):
                standby_lead = now
                assert leader.proc.poll() is not None, "the standby acquired while the cut-off leader still ran"
            time.sleep(0.1)

        def fmt(v: float | None) -> str:
            return "never" if v is None else f"{v:.1f}s"

        sys.stderr.write(f"\n[leader cut off] leader exited {fmt(leader_exit)}, standby acquired {fmt(standby_lead)} after the cut\n")
        assert leader_exit is not None and leader.proc.returncode == 1, leader.tail()
        assert "lost the leader Lease" in leader.log_path.read_text()
        assert standby_lead is not None and leader_exit < standby_lead < 30
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("alpha", replicas=2))

        def scaled() -> bool:
            if get_json(cluster, "deployment", "alpha", "-n", namespace)["spec"]["replicas"] != 2:
                raise NotYet("replicas")
            return True

        wait_for(scaled, 30, "the new leader to reconcile")
    finally:
        stop_all(cluster, namespace, ops)
        proxy.close()
