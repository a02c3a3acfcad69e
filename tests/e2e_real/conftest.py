"""The real node: a private control plane plus one containerd node running the images we build.

``real_cluster`` (session scope) builds what is missing (`make images`, the control plane, the
kubelet), starts `hack/controlplane.sh up --real-node` in its own state dir with no kwok nodes (so
nothing is ever scheduled onto a fake pod IP), imports the image archives, and stops it all at the
end. Needs root; `pytest -m real_node` selects these tests.

CONSORT_REAL_CLUSTER_DIR=<dir of a running `make cluster-real`> reuses that cluster instead (the
edit-test loop: rebuild one image, `ctr images import` it, rerun); it is left running. A real node
already running from another state dir (`make cluster-real`, then `make test`) is reused the same
way, saying so in one line: there is one per machine (one containerd image store, one bridge).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kube import Cluster

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
from localcluster.layout import Layout  # noqa: E402  (hack/localcluster: standard library only)
from localcluster.processes import real_node_elsewhere  # noqa: E402

CONTROLPLANE = REPO / "hack" / "controlplane.sh"
CACHE = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))
TEST_CLUSTERS = CACHE / "test-clusters"
IMAGES = CACHE / "images"
UP_TIMEOUT_S = 900  # a cold image import into containerd takes minutes


def _run(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0:
        pytest.fail("the real-node suite needs root (containerd, runc, bridges, iptables)", pytrace=False)
    if existing := os.environ.get("CONSORT_REAL_CLUSTER_DIR"):
        handle = Cluster(Path(existing) / "kubeconfig", CACHE / "bin", tmp_path_factory.mktemp("helm-home"),
                         Path(existing))
        yield handle
        handle.close()
        return
    for step in (["make", "-C", str(REPO), "images", "node"],):
        out = _run(step, timeout=3600)
        if out.returncode != 0:
            pytest.fail(f"{' '.join(step)} failed:\n{(out.stdout + out.stderr)[-3000:]}", pytrace=False)
    cluster_dir = TEST_CLUSTERS / f"real-{os.getpid()}"
    if (running := real_node_elsewhere(Layout(cluster_dir, CACHE / "bin"))) is not None:
        # `up` on that dir finds it running and imports the images just built; it stays up afterwards.
        sys.stderr.write(f"\n[real_cluster] reusing the real node already running from {running} (left running)\n")
        up = _run([str(CONTROLPLANE), "up", "--real-node", "--images", str(IMAGES)], timeout=UP_TIMEOUT_S,
                  env={**os.environ, "CONSORT_CLUSTER_DIR": str(running)})
        if up.returncode != 0:
            pytest.fail(f"importing the images into the running real node failed:\n{up.stderr[-4000:]}", pytrace=False)
        handle = Cluster(Path(up.stdout.strip().splitlines()[-1]), CACHE / "bin", tmp_path_factory.mktemp("helm-home"),
                         running)
        yield handle
        handle.close()
        return
    env = {**os.environ, "CONSORT_CLUSTER_DIR": str(cluster_dir)}
    started = time.monotonic()
    up = _run([str(CONTROLPLANE), "up", "--real-node", "--gpu-nodes", "0", "--cpu-nodes", "0",
               "--images", str(IMAGES)], timeout=UP_TIMEOUT_S, env=env)
    if up.returncode != 0:
        _run([str(CONTROLPLANE), "down"], timeout=120, env=env)
        pytest.fail(f"starting the real-node cluster failed:\n{up.stderr[-4000:]}", pytrace=False)
    handle = Cluster(Path(up.stdout.strip().splitlines()[-1]), CACHE / "bin",
                     tmp_path_factory.mktemp("helm-home"), cluster_dir)
    sys.stderr.write(f"\n[real_cluster] control plane + real node up in {time.monotonic() - started:.1f}s\n")
    try:
        yield handle
    finally:
        handle.close()
        down = _run([str(CONTROLPLANE), "down"], timeout=180, env=env)
        if down.returncode != 0:
            sys.stderr.write(f"[real_cluster] stopping the cluster failed:\n{down.stderr}\n")


# Figures the steps measure (request counts under a pod deletion or an adapter rotation), printed in
# the terminal summary so a passing run shows them too (pytest hides a passing test's stdout).
FIGURES: list[str] = []


@pytest.fixture
def figure():
    return FIGURES.append


def pytest_terminal_summary(terminalreporter) -> None:
    if FIGURES:
        terminalreporter.section("e2e_real figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
