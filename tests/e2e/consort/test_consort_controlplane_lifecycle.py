"""hack/controlplane.sh as a user meets it: idempotent up, stale processes, down, and one-line
errors for a missing Go or an unreachable module proxy. Runs its own private clusters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kube import wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[3]
CONTROLPLANE = REPO / "hack" / "controlplane.sh"
sys.path.insert(0, str(REPO / "hack"))
from localcluster import commands, components, layout, processes  # noqa: E402  (hack/localcluster)


def controlplane(*args: str, cluster_dir: Path | None = None, timeout: float = 240,
                 **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    if cluster_dir is not None:
        full_env["CONSORT_CLUSTER_DIR"] = str(cluster_dir)
    return subprocess.run([str(CONTROLPLANE), *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def live_pids(cluster_dir: Path) -> dict[str, int]:
    where = layout.Layout(cluster_dir.resolve(), Path.home() / ".cache" / "consort" / "bin")
    return processes.cluster_pids(where)


@pytest.fixture
def private_dir(tmp_path: Path):
    cluster_dir = tmp_path / "cluster"
    yield cluster_dir
    controlplane("down", cluster_dir=cluster_dir, timeout=60)
    assert live_pids(cluster_dir) == {}


def test_up_is_idempotent_recovers_from_a_crashed_component_and_down_stops_everything(private_dir):
    first = controlplane("up", cluster_dir=private_dir)
    assert first.returncode == 0, first.stderr
    kubeconfig = first.stdout.strip().splitlines()[-1]
    assert Path(kubeconfig).is_file()
    state = json.loads((private_dir / "state.json").read_text())
    # The target is a usable apiserver within 30 s of a warm `up` (binaries cached).
    assert state["apiserver_ready_s"] <= 30, state
    pids = live_pids(private_dir)
    assert sorted(pids) == sorted(components.COMPONENTS)

    again = controlplane("up", cluster_dir=private_dir)
    assert again.returncode == 0, again.stderr
    assert "already running" in again.stderr
    assert again.stdout.strip().splitlines()[-1] == kubeconfig
    assert live_pids(private_dir) == pids

    status = controlplane("status", cluster_dir=private_dir)
    assert status.returncode == 0 and "ready at https://127.0.0.1:" in status.stdout

    # A crashed apiserver leaves the rest of the cluster behind as stale processes.
    os.kill(pids["kube-apiserver"], signal.SIGKILL)
    wait_for(lambda: "kube-apiserver" not in live_pids(private_dir), 10, "the killed kube-apiserver to exit")
    assert controlplane("status", cluster_dir=private_dir).returncode == 1
    recovered = controlplane("up", cluster_dir=private_dir)
    assert recovered.returncode == 0, recovered.stderr
    assert "stopped stale processes from an earlier run" in recovered.stderr
    new_pids = live_pids(private_dir)
    assert sorted(new_pids) == sorted(components.COMPONENTS)
    assert not set(new_pids.values()) & set(pids.values())
    kubectl = Path.home() / ".cache" / "consort" / "bin" / "kubectl"
    nodes = subprocess.run([str(kubectl), f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "name"],
                           capture_output=True, text=True, timeout=30)
    assert nodes.returncode == 0, nodes.stderr
    assert "node/kwok-gpu-0" in nodes.stdout.split()

    down = controlplane("down", cluster_dir=private_dir, timeout=60)
    assert down.returncode == 0, down.stderr
    assert live_pids(private_dir) == {}
    assert not private_dir.exists()
    assert "nothing" in controlplane("down", cluster_dir=private_dir, timeout=60).stderr


def test_build_without_go_says_so_in_one_line(tmp_path: Path):
    # An empty cache forces a build; a PATH without Go must stop it at once with one line.
    result = controlplane("build", CONSORT_CACHE=str(tmp_path / "cache"), PATH="/usr/bin:/bin", timeout=30)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Go is missing" in lines[0], result.stderr


def test_build_with_unreachable_module_proxy_names_the_proxy(tmp_path: Path):
    result = controlplane("build", CONSORT_CACHE=str(tmp_path / "cache"), GOMODCACHE=str(tmp_path / "mod"),
                          GOPROXY="http://127.0.0.1:9", GOSUMDB="off", timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "cannot download Go modules from GOPROXY=http://127.0.0.1:9" in last, result.stderr
    subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=False)  # the module cache is read-only


def test_a_port_taken_between_choosing_and_binding_is_detected_and_retried(tmp_path: Path, monkeypatch, capsys):
    # Hand etcd a port that a listener here already holds: etcd fails to bind, `up` must notice,
    # name the cause and start again on fresh ports instead of hanging.
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    real_choose = commands.choose_free_ports
    calls: list[int] = []

    def choose_with_a_taken_port(count: int) -> list[int]:
        calls.append(count)
        ports = real_choose(count)
        return [busy.getsockname()[1], *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(commands, "choose_free_ports", choose_with_a_taken_port)
    cluster_dir = tmp_path / "cluster"
    bin_dir = str(Path.home() / ".cache" / "consort" / "bin")
    try:
        assert commands.main(["up", "--dir", str(cluster_dir), "--bin-dir", bin_dir]) == 0
        err = capsys.readouterr().err
        assert "a port was taken between choosing and binding it" in err and "retrying with new ports" in err
        assert len(calls) == 2
        state = json.loads((cluster_dir / "state.json").read_text())
        assert state["ports"]["etcd"] != busy.getsockname()[1]
    finally:
        busy.close()
        commands.main(["down", "--dir", str(cluster_dir), "--bin-dir", bin_dir])
    assert live_pids(cluster_dir) == {}


def test_a_second_real_node_is_refused_in_one_line_naming_the_running_one(tmp_path: Path, monkeypatch, capsys):
    # `make cluster-real` runs; `make test` would start its own real node, whose containerd then
    # waits on the first one's image store: `up` must say so at once, in one line, and start nothing.
    other = tmp_path / "cluster-real"
    (other / "node").mkdir(parents=True)
    fake_containerd = subprocess.Popen(
        ["containerd", "-c", "import time; time.sleep(60)", "--config", str(other / "node" / "containerd.toml")],
        executable=sys.executable)
    # Until the child has exec'd, /proc shows the parent's command line: wait for the fake's own.
    deadline = time.monotonic() + 10
    while b"containerd.toml" not in Path(f"/proc/{fake_containerd.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the fake containerd did not start"
        time.sleep(0.01)
    monkeypatch.setattr(commands.real, "preflight", lambda: None)   # root and the node's tools: not the point here
    cluster_dir = tmp_path / "cluster"
    try:
        assert commands.main(["up", "--real-node", "--dir", str(cluster_dir),
                              "--bin-dir", str(Path.home() / ".cache" / "consort" / "bin")]) == 1
    finally:
        fake_containerd.kill()
        fake_containerd.wait()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"a real node already runs from {other}" in lines[0], lines
    assert f"CONSORT_REAL_CLUSTER_DIR={other}" in lines[0]
    assert live_pids(cluster_dir) == {} and not (cluster_dir / "node").exists()


def test_a_cluster_dir_does_not_claim_a_sibling_whose_name_it_prefixes(tmp_path: Path):
    # /x/cluster and /x/cluster-real are two clusters: `down` of the first must not stop the second's.
    sibling = tmp_path / "cluster-real" / "node" / "containerd.toml"
    fake = subprocess.Popen(["containerd", "-c", "import time; time.sleep(60)", "--config", str(sibling)],
                            executable=sys.executable)
    try:
        deadline = time.monotonic() + 10
        while b"containerd.toml" not in Path(f"/proc/{fake.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the fake containerd did not start"
            time.sleep(0.01)
        assert not processes.belongs_to(fake.pid, layout.Layout(tmp_path / "cluster", tmp_path / "bin"))
        assert processes.belongs_to(fake.pid, layout.Layout(tmp_path / "cluster-real", tmp_path / "bin"))
    finally:
        fake.kill()
        fake.wait()
