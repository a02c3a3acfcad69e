"""Shared pieces of the pure builders: labels, owner references, content hashes, build settings."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..api.base import API_VERSION, quantity_value

PART_OF = "consort"
MANAGED_BY = "consort-operator"
LABEL_SPECIALIST = "consort.dev/specialist"
LABEL_ROUTER = "consort.dev/ensemble-router"
ANNOTATION_HASH = "consort.dev/spec-hash"
FIELD_MANAGER = "consort-operator"


@dataclass(frozen=True)
class BuildContext:
    """Operator-wide settings the builders need (from flags / the Helm chart)."""

    engine_image: str = "ghcr.io/consort-dev/consort-engine:0.1.0"
    router_image: str = "ghcr.io/consort-dev/consort-router:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    network_policy: bool = True
    operator_namespace: str = "consort-system"
    operator_pod_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "consort-operator"),)
    # Namespaces (by label selector) allowed to scrape engine /metrics through the NetworkPolicy.
    metrics_namespace_labels: tuple[tuple[str, str], ...] = ()
    run_as_user: int = 10001
    extra_labels: tuple[tuple[str, str], ...] = field(default=())
    # Image prefixes a spec.image override may use, beyond the repositories of the two images above
    # ("*": any); lifecycle/admission.py.
    allowed_images: tuple[str, ...] = ()
    # classifier.kind torch runs a TorchScript module from a ConfigMap in the pod that holds the keys.
    allow_torch_classifier: bool = False
    # How long a staged engine credential waits before routers send it (lifecycle/credential.py):
    # long enough for the updated Secret to reach every pod.
    credential_propagation_seconds: float = 120.0
    # The node-local model cache (`consort model-cache`): a hostPath directory on every node that the
    # init containers fetching hf:// and building demo:// checkpoints go through; "" turns it off.
    model_cache_dir: str = ""
    model_cache_bytes: int = 100 * 2**30


def owner_reference(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": kind, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def object_meta(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any],
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(sorted(labels.items())),
                            "ownerReferences": [owner]}
    if annotations:
        meta["annotations"] = dict(sorted(annotations.items()))
    return meta


def content_hash(obj: Any, n: int = 16) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()[:n]


def stamp_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """Annotate an object with the hash of its own desired content (so 'changed?' is one compare)."""
    meta = obj["metadata"]
    ann = dict(meta.get("annotations") or {})
    ann.pop(ANNOTATION_HASH, None)
    probe = {**obj, "metadata": {**meta, "annotations": ann}}
    ann[ANNOTATION_HASH] = content_hash(probe)
    meta["annotations"] = dict(sorted(ann.items()))
    return obj


def common_labels(component: str, instance: str, ctx: BuildContext) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": f"consort-{component}",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    labels.update(dict(ctx.extra_labels))
    return labels


def pod_security_context(ctx: BuildContext) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": ctx.run_as_user, "runAsGroup": ctx.run_as_user,
            "fsGroup": ctx.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def toleration_dicts(tolerations: list[Any] | None) -> list[dict[str, Any]]:
    return [t.wire() for t in tolerations or []]


# ---- scratch space: every emptyDir is bounded, and so is every container -----------------------------

# A container's own ephemeral storage beyond its emptyDirs: logs (root filesystems are read-only).
LOG_STORAGE = "1Gi"


def scratch_volume(name: str, size_limit: str) -> dict[str, Any]:
    """A disk emptyDir with a sizeLimit: a pod filling it is evicted instead of filling the node."""
    return {"name": name, "emptyDir": {"sizeLimit": size_limit}}


def ephemeral_storage_limit(volumes: list[dict[str, Any]], own: str = LOG_STORAGE) -> str:
    """The pod's one main container's ephemeral-storage limit: the kubelet holds the pod's disk
    emptyDirs and logs against the sum of its containers' limits, so the limit must cover every
    disk emptyDir's sizeLimit plus the container's own share, or a full download would evict it."""
    total = quantity_value(own)
    for v in volumes:
        empty = v.get("emptyDir")
        if empty is not None and empty.get("medium") != "Memory":
            total += quantity_value(empty["sizeLimit"])
    return f"{math.ceil(total / 2**20)}Mi"
