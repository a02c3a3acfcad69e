"""The operator's Kubernetes client session: no per-request environment lookups unless a proxy is set."""
from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as k8s

from consort_operator.kube import PROXY_VARIABLES, Kube


async def trusts_env() -> bool:
    kube = Kube(k8s.Configuration(host="https://127.0.0.1:1"))
    try:
        return kube.api.rest_client.pool_manager.trust_env
    finally:
        await kube.close()


def test_no_proxy_variables_no_environment_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    assert asyncio.run(trusts_env()) is False


def test_a_proxy_variable_keeps_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    assert asyncio.run(trusts_env()) is True
