"""The operator's Kubernetes client: kubernetes_asyncio (maintained), one ApiClient per process.

Credentials are loaded once by kubernetes_asyncio's own loaders (the service account in a pod,
kubeconfig outside), and Kopf logs in with the same ones (`connection_info`), so the operator has
one identity and one login path. The verbs are the few the reconcile needs: server-side apply,
get, list, status merge-patch, delete.
"""
from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Callable

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from .api.base import GROUP, VERSION
from .resources.common import FIELD_MANAGER

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")

# kind -> (api prefix, plural); everything the operator owns or reads.
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "Event": ("/api/v1", "events"),
    "Specialist": (f"/apis/{GROUP}/{VERSION}", "specialists"),
    "EnsembleRouter": (f"/apis/{GROUP}/{VERSION}", "ensemblerouters"),
}
JSON_ONLY = {200: "object", 201: "object"}
NO_STORED_VERSION = "1"    # a resourceVersion precondition that no stored object satisfies (apply_new)     # deserialised as plain dicts, camelCase as on the wire


class KubeError(Exception):
    def __init__(self, status: int, body: Any, what: str):
        self.status = status
        self.body = body
        msg = body.get("message") if isinstance(body, dict) else str(body)[:500]
        super().__init__(f"{what}: HTTP {status}: {msg}")


def expected_failure(e: BaseException) -> bool:
    """An apiserver answer or an unreachable apiserver (an outage, a restart): a one-line warning and a
    retry, not a traceback (a traceback is for bugs)."""
    return isinstance(e, (KubeError, ApiException, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError))


def object_path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


async def load_configuration() -> k8s.Configuration:
    """In a pod: the service account (its rotating token re-read by the client), with the API
    Service's injected address rather than a DNS name; outside: $KUBECONFIG or ~/.kube/config."""
    cfg = k8s.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(SA_TOKEN):
        k8s_config.load_incluster_config(client_configuration=cfg)
    else:
        await k8s_config.load_kube_config(client_configuration=cfg)
    return cfg


async def connection_info(cfg: k8s.Configuration) -> Any:
    """The same credentials as a `kopf.ConnectionInfo`, for Kopf's own watches (as kopf.login_via_client
    does for the synchronous `kubernetes` package)."""
    import kopf

    header = await cfg.get_api_key_with_prefix("BearerToken")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
                               username=cfg.username or None, password=cfg.password or None, scheme=scheme,
                               token=token, certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


class Kube:
    def __init__(self, configuration: k8s.Configuration):
        self.configuration = configuration
        self.api = k8s.ApiClient(configuration)
        self.api.user_agent = "consort-operator"
        # kubernetes_asyncio's session trusts the environment, so aiohttp reads ~/.netrc and the proxy
        # variables in a worker thread on every request (two thread hops per call, a few per cent of
        # the operator's CPU under load). With no proxy variable set there is nothing to find there;
        # a kubeconfig proxy-url is passed per request and is unaffected.
        if not any(os.environ.get(v) for v in PROXY_VARIABLES):
            self.api.rest_client.pool_manager._trust_env = False
        # Called before every write: leader election raises here once this replica may have lost the
        # Lease (a process paused past its renew deadline writes nothing when it wakes, before the
        # watchdog has exited it).
        self.write_guard: Callable[[], None] | None = None

    async def close(self) -> None:
        await self.api.close()

    async def _call(self, method: str, path: str, what: str, *, query: list[tuple[str, str]] | None = None,
                    body: Any = None, content_type: str | None = None) -> Any:
        if method != "GET" and self.write_guard is not None:
            self.write_guard()
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            return await self.api.call_api(path, method, query_params=query or [], header_params=headers, body=body,
                                           response_types_map=JSON_ONLY, auth_settings=["BearerToken"],
                                           _return_http_data_only=True, _request_timeout=30)
        except ApiException as e:
            try:
                parsed = json.loads(e.body) if e.body else None
            except (TypeError, ValueError):
                parsed = e.body
            raise KubeError(int(e.status or 0), parsed, what) from None

    async def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER, force: bool = True) -> dict[str, Any]:
        """Server-side apply (an unchanged object is a no-op at the server: no resourceVersion bump)."""
        meta = obj["metadata"]
        query = [("fieldManager", field_manager), ("fieldValidation", "Strict")] + ([("force", "true")] if force else [])
        return await self._call("PATCH", object_path(obj["kind"], meta["namespace"], meta["name"]),
                                f"apply {obj['kind']} {meta['namespace']}/{meta['name']}", query=query, body=obj,
                                content_type="application/apply-patch+yaml")

    async def apply_new(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER) -> dict[str, Any] | None:
        """Server-side apply that only creates: None (HTTP 409, nothing written) when the object exists.
        The precondition is a resourceVersion no stored object has (etcd's first write is revision 2,
        and "0" would mean unconditional), so one request replaces a GET that would answer 404 and
        the object is created with this manager's Apply field ownership, as `apply` would."""
        body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": NO_STORED_VERSION}}
        try:
            return await self.apply(body, field_manager)
        except KubeError as e:
            if e.status == 409:
                return None
            raise

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", object_path(kind, namespace, name), f"get {kind} {namespace}/{name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        body = await self._call("GET", object_path(kind, namespace), f"list {kind} in {namespace}", query=query)
        return list(body.get("items") or [])

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST: 409 when the object exists (someone else created it first)."""
        meta = obj["metadata"]
        return await self._call("POST", object_path(obj["kind"], meta["namespace"]),
                                f"create {obj['kind']} {meta['namespace']}/{meta['name']}", body=obj)

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT with the resourceVersion read: 409 when the object changed since (optimistic concurrency)."""
        meta = obj["metadata"]
        return await self._call("PUT", object_path(obj["kind"], meta["namespace"], meta["name"]),
                                f"update {obj['kind']} {meta['namespace']}/{meta['name']}", body=obj)

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the status subresource (never spec)."""
        return await self._call("PATCH", object_path(kind, namespace, name, "status"),
                                f"patch {kind} {namespace}/{name} status", body={"status": status},
                                content_type="application/merge-patch+json")

    async def scale(self, kind: str, namespace: str, name: str, replicas: int, expected: int) -> bool:
        """Set spec.replicas through the /scale subresource (the path HPA and KEDA use), only if it
        is still `expected` (a JSON Patch `test`): False when someone changed it first (422)."""
        patch = [{"op": "test", "path": "/spec/replicas", "value": expected},
                 {"op": "replace", "path": "/spec/replicas", "value": replicas}]
        try:
            await self._call("PATCH", object_path(kind, namespace, name, "scale"),
                             f"scale {kind} {namespace}/{name} to {replicas}", body=patch,
                             content_type="application/json-patch+json")
        except KubeError as e:
            if e.status == 422:
                return False
            raise
        return True

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self._call("DELETE", object_path(kind, namespace, name), f"delete {kind} {namespace}/{name}")
        except KubeError as e:
            if e.status != 404:
                raise
