"""A small asyncio Kubernetes client over aiohttp: server-side apply, get, status merge-patch.

Credentials come from the same `kopf.ConnectionInfo` Kopf logs in with, so the operator has one
identity and one login path (service account in a pod, kubeconfig outside).
"""
from __future__ import annotations

import json
from typing import Any

import aiohttp

from .api.base import GROUP, VERSION
from .resources.common import FIELD_MANAGER

# kind -> (api prefix, plural); everything the operator owns or reads.
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Specialist": (f"/apis/{GROUP}/{VERSION}", "specialists"),
    "EnsembleRouter": (f"/apis/{GROUP}/{VERSION}", "ensemblerouters"),
}


class KubeError(Exception):
    def __init__(self, status: int, body: Any, what: str):
        self.status = status
        self.body = body
        msg = body.get("message") if isinstance(body, dict) else str(body)[:500]
        super().__init__(f"{what}: HTTP {status}: {msg}")


def object_path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Kube:
    def __init__(self, server: str, ssl_context: Any, headers: dict[str, str], limit: int = 32):
        self.server = server.rstrip("/")
        self._ssl = ssl_context
        self._headers = headers
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> "Kube":
        return cls(info.server, info.as_ssl_context(), info.as_http_headers())

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, ssl=self._ssl),
                headers={**self._headers, "User-Agent": "consort-operator"},
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, what: str, *, params: dict[str, str] | None = None,
                       data: bytes | None = None, content_type: str | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        async with self.session.request(method, self.server + path, params=params, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                body = json.loads(text) if text else None
            except json.JSONDecodeError:
                body = text
            if resp.status >= 400:
                raise KubeError(resp.status, body, what)
            return body

    async def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER, force: bool = True) -> dict[str, Any]:
        """Server-side apply (an unchanged object is a no-op at the server: no resourceVersion bump)."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": field_manager, "fieldValidation": "Strict"}
        if force:
            params["force"] = "true"
        return await self._request("PATCH", path, f"apply {obj['kind']} {meta['namespace']}/{meta['name']}",
                                   params=params, data=json.dumps(obj).encode(),
                                   content_type="application/apply-patch+yaml")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", object_path(kind, namespace, name), f"get {kind} {namespace}/{name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        body = await self._request("GET", object_path(kind, namespace), f"list {kind} in {namespace}", params=params)
        return list(body.get("items") or [])

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the status subresource (never spec)."""
        return await self._request("PATCH", object_path(kind, namespace, name, "status"),
                                   f"patch {kind} {namespace}/{name} status",
                                   data=json.dumps({"status": status}).encode(),
                                   content_type="application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self._request("DELETE", object_path(kind, namespace, name), f"delete {kind} {namespace}/{name}")
        except KubeError as e:
            if e.status != 404:
                raise
