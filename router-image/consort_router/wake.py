"""How the activator asks for a replica of a lane at zero (config `activator.kind`).

scale: a JSON Patch on the Specialist's /scale subresource that sets replicas to 1 only if it is 0
(a `test` op makes the check and the write one atomic call: a lane some other owner already scaled
is left alone, and the apiserver answers 422, which is no error here). The router pod's Role allows
`patch` on `specialists/scale` for the Specialists it routes, by name, and nothing else there.

file: create DIR/<lane> (`consort up` watches the directory, starts the lane's engine and removes it).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from kubernetes_asyncio.client import ApiClient, ApiException, CustomObjectsApi

from . import kube
from .config import RouterConfig

log = logging.getLogger("consort.router.wake")

GROUP, VERSION, PLURAL = "consort.dev", "v1alpha1", "specialists"
# A Scale object omits replicas at 0 (omitempty), so "replicas is 0" is tested as "spec is {}".
FROM_ZERO = [{"op": "test", "path": "/spec", "value": {}},
             {"op": "add", "path": "/spec/replicas", "value": 1}]


class ScaleWaker:
    def __init__(self, config: Callable[[], RouterConfig]) -> None:
        self.config = config       # the current config: the lanes' namespaces, from their Services
        self._client: ApiClient | None = None

    async def __call__(self, lane: str) -> None:
        route = self.config().specialist(lane)
        if route is None or route.service is None:
            return
        if self._client is None:
            self._client = kube.api_client()   # ValueError when there is no API server: logged by the caller
        try:
            await CustomObjectsApi(self._client).patch_namespaced_custom_object_scale(
                GROUP, VERSION, route.service.namespace, PLURAL, lane, FROM_ZERO,
                _content_type="application/json-patch+json", _request_timeout=5)
            log.info("asked for a replica of %s/%s (scale 0 -> 1)", route.service.namespace, lane)
        except ApiException as e:
            if e.status != 422:   # 422: the test failed, replicas is not 0 (someone scaled it already)
                raise RuntimeError(kube.describe(e)) from e

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class FileWaker:
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)

    async def __call__(self, lane: str) -> None:
        await asyncio.to_thread(self._touch, lane)

    def _touch(self, lane: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / lane).touch()

    async def close(self) -> None:
        return None


def waker(config: Callable[[], RouterConfig], base_dir: Path) -> ScaleWaker | FileWaker:
    a = config().activator
    if a.kind == "file":
        d = Path(a.dir or "")
        return FileWaker(str(d if d.is_absolute() else base_dir / d))
    return ScaleWaker(config)
