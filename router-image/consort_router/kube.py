"""The router's Kubernetes client: kubernetes_asyncio, configured from the pod's service account.

In a pod: `load_incluster_config`, which takes the API server from KUBERNETES_SERVICE_HOST/PORT (an
address, so no cluster DNS is needed) and re-reads the projected token file every minute as the
kubelet rotates it. Outside a pod (tests, local runs): CONSORT_KUBE_API=https://host:port, with the
token and CA from CONSORT_KUBE_TOKEN_FILE / CONSORT_KUBE_CA_FILE (either may be absent: then no
token, and the system CAs); those two files also override the service account's inside a pod.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from kubernetes_asyncio.client import ApiClient, ApiException, Configuration
from kubernetes_asyncio.config import ConfigException
from kubernetes_asyncio.config.incluster_config import load_incluster_config

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def configuration(env: Mapping[str, str] = os.environ) -> Configuration:
    """Raises ValueError when there is no API server to talk to (not in a pod, CONSORT_KUBE_API unset)."""
    token_file = env.get("CONSORT_KUBE_TOKEN_FILE") or f"{SA_DIR}/token"
    ca_file = env.get("CONSORT_KUBE_CA_FILE") or f"{SA_DIR}/ca.crt"
    cfg = Configuration()
    api = env.get("CONSORT_KUBE_API")
    if not api:
        try:
            load_incluster_config(cfg, token_filename=token_file, cert_filename=ca_file,
                                  environ={"KUBERNETES_SERVICE_PORT": "443", **env})
        except ConfigException as e:
            raise ValueError(f"no Kubernetes API: not in a pod ({e}) and CONSORT_KUBE_API is unset") from e
        return cfg
    cfg.host = api.rstrip("/")
    if os.path.exists(ca_file):
        cfg.ssl_ca_cert = ca_file
    if os.path.exists(token_file):
        cfg.api_key["BearerToken"] = read_token(token_file)
        # Re-read on every call, like the in-cluster loader (which does it once a minute): tokens rotate.
        cfg.refresh_api_key_hook = lambda c: c.api_key.update(BearerToken=read_token(token_file))
    return cfg


def read_token(path: str) -> str:
    with open(path) as f:
        return "Bearer " + f.read().strip()


def api_client(cfg: Configuration | None = None) -> ApiClient:
    """A client for the running event loop (its aiohttp session is bound to it); close it, or use
    `async with`."""
    return ApiClient(cfg or configuration())


def describe(e: BaseException) -> str:
    """One line for a failed call (an ApiException's str carries every response header)."""
    return f"{e.status} {e.reason}" if isinstance(e, ApiException) else repr(e)
