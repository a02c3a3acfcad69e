"""Shared pytest fixtures: a real local Kubernetes control plane for e2e tests.

Fixture API (stable; the operator's e2e tests rely on it)
---------------------------------------------------------
``cluster`` (session scope, lazy: only tests that request it start it)
    Starts a private control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
    kwok; see hack/localcluster/) in its own state dir and stops it when the session ends. With
    ``pytest --use-existing-cluster`` and ``KUBECONFIG`` set, it uses that cluster instead and stops
    nothing. The local cluster has kwok nodes ``kwok-gpu-0``, ``kwok-gpu-1`` (``nvidia.com/gpu: 8``,
    64 CPU, 512Gi) and ``kwok-cpu-0`` (16 CPU, 64Gi); kwok pods become Running/Ready at once, their
    IPs are fake and never reachable.

    - ``cluster.kubeconfig: Path``        admin kubeconfig (system:masters, token over TLS)
    - ``cluster.kubectl(*args, input=None, check=True, timeout=60) -> CompletedProcess[str]``
    - ``cluster.helm(*args, input=None, check=True, timeout=180) -> CompletedProcess[str]``
      (both get ``--kubeconfig``; helm gets private HELM_*_HOME dirs; with check=True a non-zero
      exit raises CommandFailed, whose message includes stdout and stderr)
    - ``cluster.kubectl_json(*args) -> dict``  ``kubectl <args> -o json`` parsed
    - ``cluster.api_client() -> kubernetes.client.ApiClient`` for that kubeconfig
    - ``cluster.bin(name) -> str``        path of kubectl, helm, kwok, etcd, kube-apiserver, ...
    - ``cluster.env() -> dict``           os.environ + KUBECONFIG + the binaries dir first on PATH
    - ``cluster.state_dir: Path | None``  the private cluster's state dir (logs/ has every
      component's log); None with --use-existing-cluster

``namespace`` (function scope)
    A fresh namespace (``t-<test name>-<random>``) whose ``default`` ServiceAccount exists. Yields
    the name (str). After the test it is deleted and its pods are force-deleted (waiting, bounded,
    until none is left, so node capacity is free for the next test); the session waits once at the
    end (bounded, 90 s) until every test namespace is gone, and fails if one is not.

Helpers in tests/kube.py: ``wait_for(predicate, timeout, what, interval=0.2)`` (a predicate may
raise ``NotYet("what I saw")`` to report its observation), ``condition``, ``owned_by``.

The binaries come from ``make controlplane`` (hack/controlplane.sh build, cached in
~/.cache/consort/bin); the fixture runs that build too, which is a no-op once it is stamped.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `from kube import ...` also outside pytest's rootdir logic
from kube import Cluster, CommandFailed, NotYet, wait_for  # noqa: E402,F401  (Cluster: the fixture's handle)

REPO = Path(__file__).resolve().parent.parent
CONTROLPLANE = REPO / "hack" / "controlplane.sh"
CACHE = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))
TEST_CLUSTERS = CACHE / "test-clusters"
UP_TIMEOUT_S = 240
NAMESPACE_DELETE_TIMEOUT_S = 90


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--use-existing-cluster", action="store_true", default=False,
                     help="e2e tests use the cluster in $KUBECONFIG instead of starting a private one")


def _controlplane(command: str, cluster_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONSORT_CLUSTER_DIR": str(cluster_dir)}
    return subprocess.run([str(CONTROLPLANE), command], capture_output=True, text=True, timeout=timeout, env=env)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_abandoned_clusters() -> None:
    """Stops clusters left by earlier pytest sessions that were killed before their teardown."""
    if not TEST_CLUSTERS.is_dir():
        return
    for entry in TEST_CLUSTERS.iterdir():
        match = re.fullmatch(r"pytest-(\d+)(\.lock)?", entry.name)
        if not match or _pid_alive(int(match.group(1))):
            continue
        if match.group(2):
            entry.unlink(missing_ok=True)
        else:
            _controlplane("down", entry, timeout=60)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    helm_home = tmp_path_factory.mktemp("helm-home")
    if request.config.getoption("--use-existing-cluster"):
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise pytest.UsageError("--use-existing-cluster needs KUBECONFIG to point at the cluster")
        handle = Cluster(Path(kubeconfig.split(os.pathsep)[0]), CACHE / "bin", helm_home)
        yield handle
        handle.close()
        return
    build = subprocess.run([str(CONTROLPLANE), "build"], capture_output=True, text=True, timeout=3600)
    if build.returncode != 0:
        pytest.fail(f"building the control plane failed:\n{build.stderr[-3000:]}", pytrace=False)
    _sweep_abandoned_clusters()
    cluster_dir = TEST_CLUSTERS / f"pytest-{os.getpid()}"
    started = time.monotonic()
    up = _controlplane("up", cluster_dir, timeout=UP_TIMEOUT_S)
    if up.returncode != 0:
        _controlplane("down", cluster_dir, timeout=60)
        pytest.fail(f"starting the local control plane failed:\n{up.stderr[-3000:]}", pytrace=False)
    handle = Cluster(Path(up.stdout.strip().splitlines()[-1]), CACHE / "bin", helm_home, cluster_dir)
    sys.stderr.write(f"\n[cluster fixture] local control plane up in {time.monotonic() - started:.1f}s "
                     f"({handle.kubeconfig})\n")
    try:
        yield handle
    finally:
        handle.close()
        down = _controlplane("down", cluster_dir, timeout=60)
        if down.returncode != 0:
            sys.stderr.write(f"[cluster fixture] stopping the control plane failed:\n{down.stderr}\n")


def _namespace_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower().removeprefix("test_")).strip("-")
    return f"t-{stem[:48].strip('-')}-{secrets.token_hex(3)}"


@pytest.fixture(scope="session")
def _namespace_reaper(cluster: Cluster):
    """Waits at session end (bounded) until every test namespace is really gone.

    Namespace finalization takes ~10 s (kube-controller-manager waits 5 s before it starts and
    then re-checks), so each test only starts the deletion and frees its pods; this waits once.
    """
    pending: list[str] = []
    yield pending

    def all_gone() -> bool:
        namespaces = cluster.kubectl_json("get", "namespaces")["items"]
        left = {ns["metadata"]["name"]: ns for ns in namespaces if ns["metadata"]["name"] in pending}
        if left:
            # The namespace controller says why (content or finalizers remaining) in its conditions.
            why = {name: [c.get("message") for c in (ns.get("status") or {}).get("conditions") or []
                          if c.get("status") == "True"] for name, ns in left.items()}
            raise NotYet(f"still present: {why}")
        return True

    if pending:
        wait_for(all_gone, NAMESPACE_DELETE_TIMEOUT_S, f"{len(pending)} test namespaces to be deleted", interval=0.5)


@pytest.fixture
def namespace(cluster: Cluster, _namespace_reaper: list[str], request: pytest.FixtureRequest):
    name = _namespace_name(request.node.name)
    cluster.kubectl("create", "namespace", name)
    _namespace_reaper.append(name)
    # Pods are rejected until the ServiceAccount controller has created `default`.
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             30, f"ServiceAccount default in namespace {name}")
    yield name
    # Terminating first (nothing new can be created in it), then free the pods' node capacity at
    # once so the next test schedules onto empty nodes; the namespace itself is awaited at the end.
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false",
                    "--ignore-not-found", check=False)

    def no_pods() -> bool:
        left = cluster.kubectl("get", "pods", "-n", name, "-o", "name", check=False).stdout.split()
        if left:
            raise NotYet(f"pods left: {left}")
        return True

    wait_for(no_pods, 30, f"the pods of namespace {name} to be deleted")
