"""Fixtures for the operator's e2e tests: the CRDs applied once and the operator as a real subprocess
(`consort operator ...` against the test cluster's kubeconfig)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opkit import REPO, Operator

THIRDPARTY = ("scaledobjects.keda.sh", "servicemonitors.monitoring.coreos.com", "podmonitors.monitoring.coreos.com",
              "prometheusrules.monitoring.coreos.com")


@pytest.fixture(scope="session")
def thirdparty_crds(cluster) -> Path:
    """KEDA's and prometheus-operator's CRDs (hack/thirdparty-crds.sh: pinned, from the Go module proxy)
    applied to the test apiserver."""
    out = subprocess.run([str(REPO / "hack" / "thirdparty-crds.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    crd_dir = Path(out.stdout.strip().splitlines()[-1])
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_dir))
    for name in THIRDPARTY:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return crd_dir


@pytest.fixture(scope="session")
def crds(cluster):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    for name in ("specialists.consort.dev", "ensemblerouters.consort.dev"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return True


@pytest.fixture
def operator_factory(cluster, crds, tmp_path):
    started: list[Operator] = []

    def make(namespace: str, *extra: str) -> Operator:
        op = Operator(cluster, namespace, tmp_path, *extra).start()
        started.append(op)
        return op

    yield make
    # Delete the Consort objects while an operator still runs: Kopf's finalizer (its daemons need
    # one) is released by the operator, so the namespace fixture's deletion does not hang.
    for ns in {op.namespace for op in started if op.proc is not None and op.proc.poll() is None}:
        cluster.kubectl("delete", "specialists,ensemblerouters", "--all", "-n", ns, "--wait=true", "--timeout=60s",
                        check=False, timeout=90)
    for op in started:
        op.stop()
        sys.stderr.write(f"\n--- operator log tail ({op.namespace})\n{op.tail(30)}\n")


