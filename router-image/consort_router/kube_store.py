"""Breaker state that survives router restarts: a `BreakerStore` (breaker.py) over the
EnsembleRouter's `status.breakerState`.

`consort router` uses it instead of the config's store when CONSORT_ENSEMBLE_ROUTER=NAMESPACE/NAME is
set, as the operator sets it in router pods. The pod's Role (built by the operator's
`resources/router.py`) allows exactly `get` on its own EnsembleRouter and `get`/`patch` on its
status. The operator mirrors the states into each Specialist's `status.breaker` and `Demoted`
condition (lifecycle/breaker.py).

Through kubernetes_asyncio (kube.py: the pod's service account, or CONSORT_KUBE_API and friends).
`BreakerStore` is synchronous and `save` must never block the router's event loop, so the store owns
a thread running its own event loop, where its client lives: `save` hands the latest payload to it
(one write in flight, the newest payload last), `load` and `flush` wait for it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, ApiException, Configuration, CustomObjectsApi

from . import kube

log = logging.getLogger("consort.router.store")

GROUP, VERSION, PLURAL = "consort.dev", "v1alpha1", "ensemblerouters"
# Failures of one call: the store logs them and goes on (the next save retries with newer state).
CALL_ERRORS = (ApiException, aiohttp.ClientError, TimeoutError, OSError, ValueError)


class EnsembleRouterStatusStore:
    def __init__(self, namespace: str, name: str, cfg: Configuration | None = None, timeout: float = 5.0):
        cfg = cfg or kube.configuration()   # ValueError here, in the caller, when there is no API server
        self.namespace, self.name, self.timeout = namespace, name, timeout
        self.url = f"{cfg.host}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="breaker-store", daemon=True)
        self._thread.start()
        self._client: ApiClient = self._run(self._open(cfg))
        self._api = CustomObjectsApi(self._client)
        self._guard = threading.Lock()   # _pending and _writer, shared by the caller's thread and the store's
        self._pending: dict | None = None
        self._writer: Future | None = None

    async def _open(self, cfg: Configuration) -> ApiClient:
        return kube.api_client(cfg)       # its aiohttp session belongs to the store's loop

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- the two calls (raise ApiException etc.; the BreakerStore methods below log instead)
    def get(self) -> dict:
        """The EnsembleRouter, read through its status subresource."""
        return self._run(self._api.get_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.name, _request_timeout=self.timeout))

    def patch(self, body: dict) -> dict:
        return self._run(self._patch(body))

    async def _patch(self, body: dict) -> dict:
        # A dict body would go out as a JSON Patch (the first type the API lists); this is a merge patch.
        return await self._api.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.name, body,
            _content_type="application/merge-patch+json", _request_timeout=self.timeout)

    # ---- BreakerStore
    def load(self) -> dict:
        try:
            obj = self.get()
        except CALL_ERRORS as e:
            log.warning("could not load breaker state from %s: %s", self.url, kube.describe(e))
            return {}
        state = (obj.get("status") or {}).get("breakerState")
        return state if isinstance(state, dict) else {}

    def save(self, data: dict) -> None:
        with self._guard:
            self._pending = json.loads(json.dumps(data))
            if self._writer is None:
                self._writer = asyncio.run_coroutine_threadsafe(self._write_pending(), self._loop)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until what was saved is written (router shutdown)."""
        with self._guard:
            writer = self._writer
        if writer is not None:
            try:
                writer.result(timeout)
            except TimeoutError:
                log.warning("breaker state not written to %s within %.0f s", self.url, timeout)

    def close(self) -> None:
        """Flush, then close the client and stop the store's thread."""
        self.flush()
        self._run(self._client.close(), self.timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout)
        if not self._thread.is_alive():
            self._loop.close()

    async def _write_pending(self) -> None:
        """The one writer: writes the newest payload until none is left (the guard makes a `save`
        during a write either hand over to this loop or start the next writer, never neither)."""
        while True:
            with self._guard:
                data, self._pending = self._pending, None
                if data is None:
                    self._writer = None
                    return
            try:
                await self._patch({"status": {"breakerState": data}})
            except Exception as e:  # noqa: BLE001 - the one writer outlives any failed write
                log.warning("could not save breaker state to %s: %s", self.url, kube.describe(e))


def store_from_env() -> EnsembleRouterStatusStore | None:
    ref = os.environ.get("CONSORT_ENSEMBLE_ROUTER", "")
    if "/" not in ref:
        return None
    namespace, name = ref.split("/", 1)
    return EnsembleRouterStatusStore(namespace, name)
