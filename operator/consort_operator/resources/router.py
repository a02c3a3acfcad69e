"""Pure builders: EnsembleRouter spec (+ the Specialists it selects) -> routing ConfigMap
(a `consort_router.config.RouterConfig`), router Deployment, Service, ServiceAccount, Role, RoleBinding."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from consort_router.config import (AdmissionConfig, AuthConfig, BreakerConfig, ClassifierConfig, Detector,
                                   IntentRule, LimitsConfig, RouterConfig, ServiceSelector, ShadowConfig,
                                   SpecialistRoute, StoreConfig, VerifierConfig)
from consort_router.config import ReplicaChoice as ReplicaChoiceConfig

from ..api.base import GROUP
from ..api.router import KIND, PLURAL, EnsembleRouterSpec
from ..api.specialist import SpecialistSpec
from .common import (LABEL_ROUTER, BuildContext, common_labels, container_security_context, content_hash,
                     LOG_STORAGE, ephemeral_storage_limit, object_meta, owner_reference, pod_security_context, scratch_volume,
                     stamp_hash, toleration_dicts)
from .credential import (API_KEYS_KEY, ROUTER_CREDENTIAL_FILE, api_keys_secret_name,
                         router_credential_volume)

COMPONENT = "router"
ROUTER_PORT = 8080
CONFIG_DIR = "/etc/consort/router"
CONFIG_FILE = "router.yaml"
AUTH_DIR = "/etc/consort/auth"
CLASSIFIER_DIR = "/etc/consort/classifier"
STATE_DIR = "/var/lib/consort"
# Pod deletion: preStop waits while the Service drops the pod, then `consort router` drains its
# requests in flight for up to 45 s (consort_router.dispatch.DRAIN_S), inside the grace period.
ROUTER_PRESTOP_S = 5
ROUTER_GRACE_S = ROUTER_PRESTOP_S + 45 + 10
STATE_LIMIT = "64Mi"   # breakers.json
TMP_LIMIT = "1Gi"      # the verifier's sandboxed compiles


@dataclass(frozen=True)
class Lane:
    """A selected Specialist as the router needs to know it."""

    name: str
    namespace: str
    spec: SpecialistSpec
    adapter: str | None = None     # the lane's default adapter (lifecycle.rollout.lane_adapter)

    @property
    def revision(self) -> str:
        """A new checkpoint or a new default adapter makes the lane fresh: the router restarts its
        correctness window, so the samples since this revision judge exactly this rotation."""
        source = next((a.source for a in self.spec.adapters or [] if a.name == self.adapter), None)
        return lane_revision(self.spec.model.wire(), self.adapter, source)


def lane_revision(model: dict[str, Any], adapter: str | None, adapter_source: str | None) -> str:
    return content_hash({"model": model, "adapter": adapter, "source": adapter_source}, 12)


def router_resource_name(name: str) -> str:
    return f"{name}-router"


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_ROUTER: name, "app.kubernetes.io/component": COMPONENT}


def router_labels(name: str, ctx: BuildContext) -> dict[str, str]:
    return {**common_labels(COMPONENT, name, ctx), **selector_labels(name)}


def router_config(name: str, spec: EnsembleRouterSpec, lanes: list[Lane]) -> RouterConfig:
    """Render the routing config. Raises (pydantic ValidationError / ValueError) when it is invalid,
    e.g. no Specialist selected, an intent claimed twice, a rule naming an unselected Specialist."""
    lanes = sorted(lanes, key=lambda lane: lane.name)
    names = {lane.name for lane in lanes}
    routes = [
        SpecialistRoute(
            name=lane.name,
            service=ServiceSelector(namespace=lane.namespace, service=lane.name, port=lane.spec.port),
            intents=sorted(lane.spec.intents or []),
            # A fallback outside the ensemble cannot take traffic: the router only knows its lanes.
            fallback=lane.spec.fallback if lane.spec.fallback in names else None,
            adapter=lane.adapter,
            revision=lane.revision,
        )
        for lane in lanes
    ]
    c = spec.classifier
    classifier = ClassifierConfig(
        kind=c.kind,
        examples_path=f"{CLASSIFIER_DIR}/examples.jsonl" if c.examples_config_map_ref else None,
        reject_label=c.reject_label,
        min_confidence=c.min_confidence,
        on_reject=c.on_reject,
        torch_model_path=f"{CLASSIFIER_DIR}/model.pt" if c.kind == "torch" and c.model_config_map_ref else None,
        torch_labels=list(c.labels or []),
    )
    b = spec.breaker
    floors = [lane.spec.slo.correctness_floor for lane in lanes]
    floor = b.floor if b.floor is not None else (min(floors) if floors else BreakerConfig().floor)
    a = spec.admission
    v = spec.verifier
    s = spec.shadow
    return RouterConfig(
        ensemble=name,
        specialists=routes,
        # Rules and detectors naming a Specialist outside the ensemble (not selected, or deleted)
        # are left out rather than invalidating the whole table; see `skipped_references`.
        rules=[IntentRule(intent=r.intent, specialist=r.specialist) for r in spec.rules or [] if r.specialist in names],
        detectors=[Detector(name=d.name, specialist=d.specialist, builtin=d.builtin, patterns=list(d.patterns or []),
                            min_matches=d.min_matches) for d in spec.detectors or [] if d.specialist in names],
        classifier=classifier,
        default_specialist=c.default_specialist,
        shadow=ShadowConfig(enabled=s.enabled, default_threshold=s.default_threshold,
                            thresholds=dict(s.thresholds or {}), max_inflight=s.max_inflight, max_tokens=s.max_tokens),
        breaker=BreakerConfig(window=b.window, min_samples=b.min_samples, floor=floor,
                              recovery_margin=b.recovery_margin, trip_after=b.trip_after,
                              trip_after_s=b.trip_after_seconds, reset_after=b.reset_after,
                              reset_after_s=b.reset_after_seconds, half_open_samples=b.half_open_samples,
                              fresh_samples=b.fresh_samples, fresh_shadow_fraction=b.fresh_shadow_fraction),
        admission=AdmissionConfig(spike_window_s=a.spike_window_seconds, spike_min_count=a.spike_min_count,
                                  spike_rate=a.spike_rate, threshold_step=a.threshold_step,
                                  threshold_levels=a.threshold_levels, floor_step=a.floor_step,
                                  floor_levels=a.floor_levels, cooldown_s=a.cooldown_seconds),
        verifier=VerifierConfig(enabled=v.enabled, sample_rate=v.sample_rate, std=v.std, cpu_seconds=v.cpu_seconds,
                                memory_mb=v.memory_mb, wall_timeout_s=v.wall_timeout_seconds,
                                max_concurrency=v.max_concurrency),
        auth=AuthConfig(api_keys_file=api_keys_file(spec), protect_metrics=spec.auth.protect_metrics,
                        protect_routing=spec.auth.protect_routing, engine_credential_file=ROUTER_CREDENTIAL_FILE),
        store=StoreConfig(kind="file", path=f"{STATE_DIR}/breakers.json"),
        limits=LimitsConfig(),
        replica_choice=ReplicaChoiceConfig(policy=spec.replica_choice.policy, load_slack=spec.replica_choice.load_slack,
                                           block_chars=spec.replica_choice.block_chars),
    )


def api_keys_file(spec: EnsembleRouterSpec) -> str | None:
    """Where the router pod reads its API keys: the named Secret's key, else the generated Secret's."""
    if not spec.auth.enabled:
        return None
    ref = spec.auth.api_keys_secret_ref
    return f"{AUTH_DIR}/{ref.key if ref else API_KEYS_KEY}"


def api_keys_volume(name: str, spec: EnsembleRouterSpec) -> dict[str, Any] | None:
    if not spec.auth.enabled:
        return None
    ref = spec.auth.api_keys_secret_ref
    secret, key = (ref.name, ref.key) if ref else (api_keys_secret_name(name), API_KEYS_KEY)
    return {"name": "api-keys", "secret": {"secretName": secret, "items": [{"key": key, "path": key}]}}


def skipped_references(spec: EnsembleRouterSpec, lanes: list[Lane]) -> list[str]:
    """Rules and detectors `router_config` leaves out because their Specialist is not in the ensemble."""
    names = {lane.name for lane in lanes}
    out = [f"rule {r.intent} -> {r.specialist}" for r in spec.rules or [] if r.specialist not in names]
    out += [f"detector {d.name} -> {d.specialist}" for d in spec.detectors or [] if d.specialist not in names]
    return out


def router_configmap(name: str, namespace: str, uid: str, config: RouterConfig, ctx: BuildContext) -> dict[str, Any]:
    return stamp_hash({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(router_resource_name(name), namespace, router_labels(name, ctx),
                                owner_reference(KIND, name, uid)),
        "data": {CONFIG_FILE: config.dump_yaml()},
    })


def router_deployment(name: str, namespace: str, uid: str, spec: EnsembleRouterSpec, ctx: BuildContext) -> dict[str, Any]:
    owner = owner_reference(KIND, name, uid)
    labels = router_labels(name, ctx)
    rname = router_resource_name(name)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": rname}},
        scratch_volume("state", STATE_LIMIT),
        scratch_volume("tmp", TMP_LIMIT),
    ]
    mounts: list[dict[str, Any]] = [
        # The whole directory (never subPath) so ConfigMap updates reach the router's hot reload.
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "state", "mountPath": STATE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    keys = api_keys_volume(name, spec)
    if keys is not None:
        volumes.append(keys)
        mounts.append({"name": "api-keys", "mountPath": AUTH_DIR, "readOnly": True})
    credential_volume, credential_mount = router_credential_volume(name)
    volumes.append(credential_volume)
    mounts.append(credential_mount)
    c = spec.classifier
    items = []
    if c.examples_config_map_ref:
        items.append((c.examples_config_map_ref, "examples.jsonl"))
    if c.kind == "torch" and c.model_config_map_ref:
        items.append((c.model_config_map_ref, "model.pt"))
    for i, (ref, path) in enumerate(items):
        volumes.append({"name": f"classifier-{i}", "configMap": {"name": ref.name, "items": [{"key": ref.key, "path": path}]}})
        mounts.append({"name": f"classifier-{i}", "mountPath": f"{CLASSIFIER_DIR}/{path}", "subPath": path, "readOnly": True})
    r = spec.resources
    container = {
        "name": COMPONENT,
        "image": spec.image or ctx.router_image,
        "imagePullPolicy": ctx.image_pull_policy,
        # The image's own entry point, `consort router`; CONSORT_ENSEMBLE_ROUTER below keeps its
        # breaker state in this EnsembleRouter's status (consort_router/kube_store.py).
        "command": ["consort", "router"],
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(ROUTER_PORT)],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "CONSORT_ENSEMBLE_ROUTER", "value": f"{namespace}/{name}"},
        ],
        # the request explicit: a limit alone would default the request to it
        "resources": {"requests": {"cpu": str(r.cpu), "memory": str(r.memory), "ephemeral-storage": LOG_STORAGE},
                      "limits": {"memory": str(r.memory), "ephemeral-storage": ephemeral_storage_limit(volumes)}},
        "startupProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2, "failureThreshold": 60,
                         "timeoutSeconds": 3},   # the classifier trains at start: up to 2 min before liveness
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 3},
        # Deletion: the Service stops sending new connections while preStop waits, then SIGTERM
        # closes the listener and lets the requests in flight (streams included) finish.
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_S}}},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5},
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": rname,
        "automountServiceAccountToken": True,  # EndpointSlice discovery, breaker state in status
        "enableServiceLinks": False,
        "securityContext": pod_security_context(ctx),
        "terminationGracePeriodSeconds": ROUTER_GRACE_S,
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(name)}}],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    if spec.tolerations:
        pod_spec["tolerations"] = toleration_dicts(spec.tolerations)
    return stamp_hash({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(rname, namespace, labels, owner),
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                                             "prometheus.io/path": "/metrics"}},
                "spec": pod_spec,
            },
        },
    })


def router_pdb(name: str, namespace: str, uid: str, ctx: BuildContext) -> dict[str, Any]:
    """One router pod at a time through a node drain (the others keep serving; a single replica
    may go, as the engines' PDB lets a drain proceed)."""
    return stamp_hash({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(router_resource_name(name), namespace, router_labels(name, ctx),
                                owner_reference(KIND, name, uid)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)},
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    })


def router_service(name: str, namespace: str, uid: str, spec: EnsembleRouterSpec, ctx: BuildContext) -> dict[str, Any]:
    meta = object_meta(name, namespace, router_labels(name, ctx), owner_reference(KIND, name, uid),
                       annotations=dict(spec.service.annotations or {}))
    return stamp_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def router_rbac(name: str, namespace: str, uid: str, ctx: BuildContext) -> list[dict[str, Any]]:
    """ServiceAccount + Role + RoleBinding: discover engine endpoints; read its own EnsembleRouter and
    write only its status (breaker state)."""
    owner = owner_reference(KIND, name, uid)
    labels = router_labels(name, ctx)
    rname = router_resource_name(name)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(rname, namespace, labels, owner)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(rname, namespace, labels, owner),
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [name], "verbs": ["get"]},
            {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [name], "verbs": ["get", "patch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(rname, namespace, labels, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rname},
        "subjects": [{"kind": "ServiceAccount", "name": rname, "namespace": namespace}],
    }
    return [stamp_hash(sa), stamp_hash(role), stamp_hash(binding)]


def router_children(name: str, namespace: str, uid: str, spec: EnsembleRouterSpec, config: RouterConfig,
                    ctx: BuildContext) -> list[dict[str, Any]]:
    return [
        *router_rbac(name, namespace, uid, ctx),
        router_configmap(name, namespace, uid, config, ctx),
        router_service(name, namespace, uid, spec, ctx),
        router_deployment(name, namespace, uid, spec, ctx),
        router_pdb(name, namespace, uid, ctx),
    ]
