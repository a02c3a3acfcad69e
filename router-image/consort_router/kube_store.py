"""Breaker state that survives router restarts: a `BreakerStore` (breaker.py) over the
EnsembleRouter's `status.breakerState`.

`consort router` uses it instead of the config's store when CONSORT_ENSEMBLE_ROUTER=NAMESPACE/NAME is
set, as the operator sets it in router pods. The pod's Role (built by the operator's
`resources/router.py`) allows exactly `get` on its own EnsembleRouter and `get`/`patch` on its
status. The operator mirrors the states into each Specialist's `status.breaker` and `Demoted`
condition (lifecycle/breaker.py).

Standard library only (the router image has no Kubernetes client). Credentials: the pod's service
account (token + CA under /var/run/secrets/kubernetes.io/serviceaccount, KUBERNETES_SERVICE_HOST),
or CONSORT_KUBE_SERVER / CONSORT_KUBE_TOKEN_FILE / CONSORT_KUBE_CA_FILE (tests, out of cluster).
`save` never blocks the event loop: a background thread writes the latest payload.
"""
from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import urllib.error
import urllib.request

log = logging.getLogger("consort.router.store")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
GROUP_VERSION = "consort.dev/v1alpha1"


class EnsembleRouterStatusStore:
    def __init__(self, namespace: str, name: str, server: str | None = None, token_file: str | None = None,
                 ca_file: str | None = None, timeout: float = 5.0):
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.server = (server or os.environ.get("CONSORT_KUBE_SERVER")
                       or (f"https://{host}:{port}" if host else None))
        if not self.server:
            raise ValueError("no Kubernetes API server: not in a pod and CONSORT_KUBE_SERVER unset")
        self.token_file = token_file or os.environ.get("CONSORT_KUBE_TOKEN_FILE") or f"{SA_DIR}/token"
        ca = ca_file or os.environ.get("CONSORT_KUBE_CA_FILE") or f"{SA_DIR}/ca.crt"
        self.ssl = ssl.create_default_context(cafile=ca)
        self.url = f"{self.server.rstrip('/')}/apis/{GROUP_VERSION}/namespaces/{namespace}/ensemblerouters/{name}/status"
        self.timeout = timeout
        self._pending: dict | None = None
        self._cv = threading.Condition()
        self._writer: threading.Thread | None = None

    def _request(self, method: str, body: dict | None = None) -> dict:
        with open(self.token_file) as f:       # re-read: projected tokens rotate
            token = f.read().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(self.url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout, context=self.ssl) as resp:
            return json.loads(resp.read() or b"{}")

    # ---- BreakerStore
    def load(self) -> dict:
        try:
            obj = self._request("GET")
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.warning("could not load breaker state from %s: %s", self.url, e)
            return {}
        state = (obj.get("status") or {}).get("breakerState")
        return state if isinstance(state, dict) else {}

    def save(self, data: dict) -> None:
        with self._cv:
            self._pending = json.loads(json.dumps(data))
            self._cv.notify()
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="breaker-store", daemon=True)
                self._writer.start()

    def flush(self, timeout: float = 10.0) -> None:
        """Write what is pending now (router shutdown)."""
        with self._cv:
            data, self._pending = self._pending, None
        if data is not None:
            self._patch(data)

    def _patch(self, data: dict) -> None:
        try:
            self._request("PATCH", {"status": {"breakerState": data}})
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.warning("could not save breaker state to %s: %s", self.url, e)

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    if not self._cv.wait(timeout=60):
                        return
                data, self._pending = self._pending, None
            self._patch(data)


def store_from_env() -> EnsembleRouterStatusStore | None:
    ref = os.environ.get("CONSORT_ENSEMBLE_ROUTER", "")
    if "/" not in ref:
        return None
    namespace, name = ref.split("/", 1)
    return EnsembleRouterStatusStore(namespace, name)
