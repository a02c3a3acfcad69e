"""Fixtures for the operator's e2e tests: the CRDs applied once and the operator as a real subprocess
(`consort operator ...` against the test cluster's kubeconfig)."""
from __future__ import annotations

import sys

import pytest
from opkit import REPO, Operator

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


