"""What the operator's reconcile loop logs as one warning line (an apiserver answer, or no apiserver
at all during an outage) and what keeps its traceback (a bug)."""
from __future__ import annotations

import asyncio

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from consort_operator.kube import KubeError, expected_failure


def test_an_apiserver_outage_is_expected_and_a_bug_is_not():
    outage = [KubeError(503, {"message": "etcd leader changed"}, "PATCH status"), ApiException(status=500),
              aiohttp.ClientConnectorError(None, OSError(111, "Connection refused")),
              aiohttp.ServerDisconnectedError(), asyncio.TimeoutError(), ConnectionResetError()]
    assert all(expected_failure(e) for e in outage)
    assert not any(expected_failure(e) for e in (KeyError("spec"), TypeError("x"), ValueError("y")))
