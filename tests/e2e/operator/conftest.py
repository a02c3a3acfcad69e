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
    for op in started:
        op.stop()
        sys.stderr.write(f"\n--- operator log tail ({op.namespace})\n{op.tail(30)}\n")


