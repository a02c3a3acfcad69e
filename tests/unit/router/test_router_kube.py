"""The router's Kubernetes client configuration (consort_router/kube.py): the env overrides, the
in-cluster service account (an address, no cluster DNS), and a token file that rotates."""
from __future__ import annotations

import pytest
from consort_router import kube


def sa_files(tmp_path, token: str = "t0") -> dict[str, str]:
    (tmp_path / "token").write_text(token)   # as the kubelet writes it: no newline
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")   # read as a path only here
    return {"CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "token"), "CONSORT_KUBE_CA_FILE": str(tmp_path / "ca.crt")}


async def bearer(cfg) -> str:
    return (await cfg.auth_settings())["BearerToken"]["value"]


async def test_consort_kube_api_with_a_token_file_that_rotates(tmp_path):
    cfg = kube.configuration({"CONSORT_KUBE_API": "https://127.0.0.1:6443/", **sa_files(tmp_path)})
    assert cfg.host == "https://127.0.0.1:6443"
    assert cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert await bearer(cfg) == "Bearer t0"
    (tmp_path / "token").write_text("t1\n")        # rotated (and written by hand: the newline goes)
    assert await bearer(cfg) == "Bearer t1"


async def test_consort_kube_api_without_token_or_ca_is_anonymous_with_the_system_cas(tmp_path):
    cfg = kube.configuration({"CONSORT_KUBE_API": "https://127.0.0.1:6443",
                              "CONSORT_KUBE_TOKEN_FILE": str(tmp_path / "none"), "CONSORT_KUBE_CA_FILE": str(tmp_path / "none")})
    assert cfg.ssl_ca_cert is None
    assert "BearerToken" not in await cfg.auth_settings()


@pytest.mark.parametrize(("host", "url"), [("10.96.0.1", "https://10.96.0.1:443"), ("fd00::1", "https://[fd00::1]:443")])
async def test_in_cluster_the_service_address_from_the_environment(tmp_path, host, url):
    cfg = kube.configuration({"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "443", **sa_files(tmp_path)})
    assert cfg.host == url
    assert cfg.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert await bearer(cfg) == "Bearer t0"


def test_no_api_server_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="CONSORT_KUBE_API"):
        kube.configuration(sa_files(tmp_path))
