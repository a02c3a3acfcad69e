"""Pure builders: Specialist spec -> engine Deployment, Service, PodDisruptionBudget, NetworkPolicy.

No I/O here; `handlers.py` applies what these return.
"""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from consort_common.demo_source import DemoSource, parse_demo

from ..api.base import quantity_value
from ..api.specialist import KIND, SpecialistSpec
from .common import (LABEL_SPECIALIST, BuildContext, common_labels, container_security_context,
                     LOG_STORAGE, ephemeral_storage_limit, object_meta, owner_reference, pod_security_context,
                     scratch_volume, stamp_hash, toleration_dicts)
from .credential import ENGINE_CREDENTIALS_DIR, engine_credentials_secret, engine_credentials_volume

COMPONENT = "engine"
CONTAINER = "engine"
MODELS_ROOT = "/models"
# The adapters the engines serve live in a ConfigMap mounted here, not in the pod template: the
# engine follows the file (hot-load / unload), so an adapter rotation restarts no pod.
ADAPTERS_DIR = "/etc/consort/adapters"
ADAPTERS_FILE = "adapters.json"
DEMO_ADAPTERS_DIR = "/tmp/consort-adapters"    # demo://lora adapters: the engine writes them on first use
# emptyDir sizeLimits. hf:// checkpoints land in hf-cache, sized by resources.ephemeralStorage when set
# (a checkpoint over DOWNLOAD_LIMIT needs it); demo:// checkpoints are at most a few hundred MB.
DOWNLOAD_LIMIT = "100Gi"
DEMO_LIMIT = "4Gi"
TMP_LIMIT = "2Gi"
ASSEMBLED_LIMIT = "16Mi"   # symlinks only
INIT_STORAGE = "256Mi"     # an init container's own logs
MODEL_CACHE_MOUNT = "/var/cache/consort-models"   # the node's model cache, in the init containers only
KV_TIER_DIR = "/var/cache/consort-kv"   # spec.kv.tier kind disk: the tier directory (an emptyDir or a claim)


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_SPECIALIST: name, "app.kubernetes.io/component": COMPONENT}


def pod_selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def engine_labels(name: str, ctx: BuildContext) -> dict[str, str]:
    return {**common_labels(COMPONENT, name, ctx), **selector_labels(name)}


# ---- model / tokenizer / adapter sources -------------------------------------------------------

@dataclass
class Sources:
    """Volumes, mounts and init steps that make every pvc:// / file:// / hf:// source a local path."""

    volumes: dict[str, dict[str, Any]] = field(default_factory=dict)
    mounts: dict[str, dict[str, Any]] = field(default_factory=dict)
    downloads: list[tuple[str, str | None, str]] = field(default_factory=list)  # (repo, revision, dir)
    demos: list[tuple[DemoSource, str]] = field(default_factory=list)          # (demo, dir)
    download_limit: str = DOWNLOAD_LIMIT                                         # hf-cache sizeLimit

    def resolve(self, url: str) -> str:
        if url.startswith("file://"):
            return url[len("file://"):]
        if url.startswith("pvc://"):
            claim, _, sub = url[len("pvc://"):].partition("/")
            vol = _volume_name("pvc", claim)
            self.volumes[vol] = {"name": vol, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            mount_path = f"{MODELS_ROOT}/pvc/{claim}"
            self.mounts[vol] = {"name": vol, "mountPath": mount_path, "readOnly": True}
            return f"{mount_path}/{sub}".rstrip("/") if sub else mount_path
        if url.startswith("hf://"):
            repo, _, rev = url[len("hf://"):].partition("@")
            target = f"{MODELS_ROOT}/hf/{repo}" + (f"@{rev}" if rev else "")
            if (repo, rev or None, target) not in self.downloads:
                self.downloads.append((repo, rev or None, target))
            self.volumes["hf-cache"] = scratch_volume("hf-cache", self.download_limit)
            self.mounts["hf-cache"] = {"name": "hf-cache", "mountPath": f"{MODELS_ROOT}/hf"}
            return target
        if url.startswith("demo://"):
            demo = parse_demo(url)
            target = f"{MODELS_ROOT}/demo/{demo.name}-{demo.seed}"
            if (demo, target) not in self.demos:
                self.demos.append((demo, target))
            self.volumes["demo"] = scratch_volume("demo", DEMO_LIMIT)
            self.mounts["demo"] = {"name": "demo", "mountPath": f"{MODELS_ROOT}/demo"}
            return target
        raise ValueError(f"unsupported source {url!r}")


def _volume_name(prefix: str, name: str) -> str:
    vol = re.sub(r"[^a-z0-9-]", "-", f"{prefix}-{name}".lower())[:63].strip("-")
    return vol


def _model_cache_command(ctx: BuildContext, pairs: list[tuple[str, str]]) -> list[str]:
    """`consort model-cache` filling each target from the node's cache (fetching on a miss)."""
    return ["consort", "model-cache", "--cache-dir", MODEL_CACHE_MOUNT, "--max-bytes", str(ctx.model_cache_bytes),
            *(x for pair in pairs for x in pair)]


def _with_model_cache(init: dict[str, Any]) -> dict[str, Any]:
    """The node's cache mounted into this init container alone: the engine reads its own verified
    copy, so it never sees (nor can write to) what other pods on the node will load. The outcome
    line (`model cache hit|miss ...`) becomes the container's termination message in the pod status."""
    init["volumeMounts"] = [*init["volumeMounts"], {"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT}]
    init["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return init


def _model_cache_owner(ctx: BuildContext) -> dict[str, Any]:
    """The first init container with the cache: hands the node's directory to the engines' user.
    kubelet creates a missing hostPath directory (`DirectoryOrCreate`) owned by root, which the
    fetching step (uid run_as_user) cannot write, and fsGroup does not apply to hostPath volumes. So
    this step alone runs as root, with CAP_CHOWN only, and touches nothing but the directory itself
    (its entries are the engines' own); a directory already owned by that user is left as it is."""
    uid = ctx.run_as_user
    return {
        "name": "model-cache-owner", "image": ctx.engine_image, "imagePullPolicy": ctx.image_pull_policy,
        "command": ["sh", "-c", f'[ "$(stat -c %u:%g {MODEL_CACHE_MOUNT})" = "{uid}:{uid}" ] || '
                                f"chown {uid}:{uid} {MODEL_CACHE_MOUNT}"],
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT}],
        "securityContext": {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                      "limits": {"memory": "32Mi", "ephemeral-storage": INIT_STORAGE}},
    }


def _download_script(downloads: list[tuple[str, str | None, str]]) -> str:
    calls = "; ".join(
        f"snapshot_download(repo_id={repo!r}, revision={rev!r}, local_dir={target!r})"
        for repo, rev, target in downloads)
    return f"from huggingface_hub import snapshot_download; {calls}"


# ---- engine command line -----------------------------------------------------------------------

def metrics_port(spec: SpecialistSpec) -> int:
    """The engine's own /metrics port in the pod (`consort engine --metrics-port`), next to its API port:
    the NetworkPolicy admits monitoring to this port only, never to the API."""
    return spec.port + 1 if spec.port < 65535 else spec.port - 1


def engine_args(name: str, spec: SpecialistSpec, model_dir: str, adapters: dict[str, str],
                host: str = "0.0.0.0", port: int | None = None, device: str | None = None,
                threads: int | None = None, adapters_file: str | None = None) -> list[str]:
    """Flags of `consort engine` for this spec (consort_engine.serving.cli.parse_args).

    A CPU engine runs `threads`, else ceil(resources.cpu) threads: its pod gets a CPU request and
    no limit (no CFS throttling), so without the flag it would size itself from its affinity,
    every core of the node, and engines sharing a node would oversubscribe it."""
    device = device or ("cuda" if spec.resources.gpus > 0 else "cpu")
    args = ["--model", model_dir, "--host", host, "--port", str(spec.port if port is None else port), "--name", name,
            "--device", device, "--dtype", spec.dtype]
    if spec.kv.block_size is not None:     # unset: the engine picks by device (256 on cuda, 16 on cpu)
        args += ["--block-size", str(spec.kv.block_size)]
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.enforce_eager:
        args += ["--enforce-eager"]
    if spec.model.quantization != "none":
        args += ["--quantization", spec.model.quantization]
    if device == "cpu":
        args += ["--threads", str(threads or max(1, math.ceil(quantity_value(spec.resources.cpu))))]
    if spec.max_context is not None:
        args += ["--max-model-len", str(spec.max_context)]
    if spec.kv.num_blocks is not None:
        args += ["--num-blocks", str(spec.kv.num_blocks)]
    elif spec.kv.memory_fraction is not None:
        args += ["--kv-memory-fraction", f"{spec.kv.memory_fraction:g}"]
    elif device == "cuda":
        args += ["--kv-memory-fraction", "0.9"]
    if spec.kv.dtype != "auto":      # the engine's default: pods from before the field keep their args
        args += ["--kv-cache-dtype", spec.kv.dtype]
    if not spec.kv.prefix_caching:
        args += ["--no-prefix-caching"]
    elif spec.kv.tier is not None:
        args += ["--kv-tier-bytes", str(int(quantity_value(spec.kv.tier.size)))]
        if spec.kv.tier.kind == "disk":
            args += ["--kv-tier-path", KV_TIER_DIR]
    s = spec.scheduler
    args += ["--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
             "--max-waiting", str(s.max_waiting)]
    args += ["--speculative", spec.speculative.mode]
    if spec.speculative.mode != "off":
        args += ["--num-speculative-tokens", str(spec.speculative.num_tokens),
                 "--spec-typical-tau", f"{spec.speculative.typical_tau:g}"]
        if spec.speculative.policy != "goodput":      # the engine's default: pods from before the field keep their args
            args += ["--speculative-policy", spec.speculative.policy]
    args += ["--max-adapters", str(spec.max_adapters)]
    args += ["--slo-ttft-ms", str(spec.slo.ttft_ms), "--slo-itl-ms", str(spec.slo.itl_ms)]
    args += ["--drain-timeout", str(DRAIN_S)]
    if adapters_file:
        args += ["--adapters-file", adapters_file]
    for adapter_name, path in adapters.items():
        args += ["--adapter", f"{adapter_name}={path}"]
    return args


def _probe(path: str, port: int, period: int, failures: int, timeout: int, initial: int = 0) -> dict[str, Any]:
    probe = {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
             "failureThreshold": failures, "timeoutSeconds": timeout}
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe


STARTUP_PERIOD = 10
# A Specialist that scales to zero starts while requests wait for it: its probes look every second,
# so the pod turns Ready (and the router sends the held requests) within a second of the engine's
# /ready, not a probe period later. Readiness keeps the same 10 s of failures before it drops a pod.
COLD_START_PROBE_PERIOD = 1
# Pod deletion: preStop waits PRESTOP_S so Services and routers stop sending new requests, then
# SIGTERM lets accepted requests finish for DRAIN_S (`consort engine --drain-timeout`), all inside
# the grace period.
PRESTOP_S = 5
DRAIN_S = 45
TERMINATION_GRACE_S = PRESTOP_S + DRAIN_S + 10


def startup_probe(spec: SpecialistSpec) -> dict[str, Any]:
    """/ready may take up to warmupTimeoutSeconds to turn 200; after that kubelet restarts the container."""
    period = COLD_START_PROBE_PERIOD if spec.scale_to_zero is not None else STARTUP_PERIOD
    return _probe("/ready", spec.port, period, max(1, math.ceil(spec.warmup_timeout_seconds / period)),
                  min(5, period))


def readiness_probe(spec: SpecialistSpec) -> dict[str, Any]:
    if spec.scale_to_zero is not None:
        return _probe("/ready", spec.port, COLD_START_PROBE_PERIOD, 10, COLD_START_PROBE_PERIOD)
    return _probe("/ready", spec.port, 5, 2, 3)


def rollout_strategy(spec: SpecialistSpec) -> dict[str, Any]:
    """Keep minReady warm replicas through a rollout; surge one when there is no slack."""
    unavailable = max(0, spec.replicas - spec.min_ready)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": unavailable}}


def engine_deployment(name: str, namespace: str, uid: str, spec: SpecialistSpec, ctx: BuildContext) -> dict[str, Any]:
    owner = owner_reference(KIND, name, uid)
    labels = engine_labels(name, ctx)
    r = spec.resources
    src = Sources(download_limit=str(r.ephemeral_storage) if r.ephemeral_storage is not None else DOWNLOAD_LIMIT)
    model_dir = src.resolve(spec.model.source)
    init_containers: list[dict[str, Any]] = []
    image = spec.image or ctx.engine_image
    tok_dir = src.resolve(spec.model.tokenizer) if spec.model.tokenizer else None
    # Adapter sources that need a volume (pvc://) or a download (hf://) shape the template: adding
    # one of those rolls the pods, the fallback; demo:// and paths on volumes already there do not.
    # Every listed adapter's volume, rolled back or not: a rollback must not roll the pods either.
    desired_adapters(spec, frozenset(), src)
    # The node's cache is shared by every namespace's pods on the node, and a manifest catches torn
    # or corrupted entries, not a writer that rewrites it too: only the operator's own engine image
    # writes there, never a spec.image override.
    cached = bool(ctx.model_cache_dir) and image == ctx.engine_image
    if src.downloads:
        fetch_command = (_model_cache_command(ctx, [(f"hf://{repo}" + (f"@{rev}" if rev else ""), target)
                                                    for repo, rev, target in src.downloads]) if cached
                         else ["python", "-c", _download_script(src.downloads)])
        init_containers.append({
            "name": "fetch", "image": image, "imagePullPolicy": ctx.image_pull_policy,
            "command": fetch_command,
            "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}],
            "volumeMounts": list(src.mounts.values()) + [{"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": container_security_context(),
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                          "limits": {"memory": "2Gi", "ephemeral-storage": INIT_STORAGE}},
        })
    for demo, target in src.demos:
        # demo://lora adapters are written for the model, whose init container runs before theirs
        # (the model is resolved first, so it comes first in src.demos).
        what = ["--lora-for", model_dir, "--seed", str(demo.seed)] if demo.name == "lora" else demo.model_args()
        demo_command = (_model_cache_command(ctx, [(f"demo://{demo.name}?seed={demo.seed}", target)])
                        if cached and demo.name != "lora" else ["consort", "demo-model", target, *what])
        init_containers.append({
            "name": f"demo-model-{demo.name}-{demo.seed}"[:63], "image": image,
            "imagePullPolicy": ctx.image_pull_policy,
            "command": demo_command,
            "env": [{"name": "HOME", "value": "/tmp"}],
            "volumeMounts": list(src.mounts.values()) + [{"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": container_security_context(),
            # Filled in below with the engine's own requests: an init container asking for more
            # than the engine would raise the whole pod's request (max of init vs. sum of app).
            "resources": {},
        })
    if tok_dir:
        # The engine reads tokenizer files from the checkpoint dir: assemble a view with symlinks.
        assembled = f"{MODELS_ROOT}/assembled"
        script = (f"set -e; for f in {shlex.quote(model_dir)}/*; do ln -sf \"$f\" {assembled}/; done; "
                  f"for f in {shlex.quote(tok_dir)}/*token* {shlex.quote(tok_dir)}/*vocab* {shlex.quote(tok_dir)}/*merges*; "
                  f"do [ -e \"$f\" ] && ln -sf \"$f\" {assembled}/; done; true")
        src.volumes["assembled"] = scratch_volume("assembled", ASSEMBLED_LIMIT)
        src.mounts["assembled"] = {"name": "assembled", "mountPath": assembled}
        init_containers.append({
            "name": "assemble", "image": image, "imagePullPolicy": ctx.image_pull_policy,
            "command": ["sh", "-c", script], "volumeMounts": list(src.mounts.values()),
            "securityContext": container_security_context(),
            "resources": {"requests": {"cpu": "50m", "memory": "32Mi"},
                          "limits": {"memory": "64Mi", "ephemeral-storage": INIT_STORAGE}},
        })
        model_dir = assembled

    requests: dict[str, Any] = {"cpu": str(r.cpu), "memory": str(r.memory)}
    limits: dict[str, Any] = {"memory": str(r.memory)}
    if r.gpus > 0:
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    # An explicit request: with a limit alone Kubernetes defaults the request to it, and a pod asking
    # for its whole download budget (100Gi) would not schedule on most nodes.
    requests["ephemeral-storage"] = str(r.ephemeral_storage) if r.ephemeral_storage is not None else LOG_STORAGE
    credential_volume, credential_mount = engine_credentials_volume(name)
    volumes = list(src.volumes.values()) + [
        {"name": "adapters", "configMap": {"name": adapters_configmap_name(name)}},
        credential_volume,
        scratch_volume("tmp", TMP_LIMIT),
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    ]
    tier_mounts = []
    tier = spec.kv.tier if spec.kv.prefix_caching else None
    if tier is not None and tier.kind == "disk":
        volumes.append({"name": "kv-tier", "persistentVolumeClaim": {"claimName": tier.claim}} if tier.claim else
                       scratch_volume("kv-tier", str(tier.size)))
        tier_mounts.append({"name": "kv-tier", "mountPath": KV_TIER_DIR})
    limits["ephemeral-storage"] = ephemeral_storage_limit(volumes)

    for init in init_containers:
        if init["name"].startswith("demo-model-"):
            init["resources"] = {"requests": dict(requests), "limits": dict(limits)}
    through_cache = [i for i in init_containers if i["command"][:2] == ["consort", "model-cache"]]
    for init in through_cache:
        _with_model_cache(init)
    if through_cache:
        volumes.append({"name": "model-cache", "hostPath": {"path": ctx.model_cache_dir, "type": "DirectoryOrCreate"}})
        init_containers.insert(0, _model_cache_owner(ctx))

    tolerations = toleration_dicts(spec.tolerations)
    if r.gpus > 0 and not any(t.get("key") == r.gpu_resource_name for t in tolerations):
        tolerations.append({"key": r.gpu_resource_name, "operator": "Exists", "effect": "NoSchedule"})

    mounts = list(src.mounts.values()) + [
        {"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True},
        credential_mount,
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ] + tier_mounts
    container = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": ctx.image_pull_policy,
        "command": ["consort", "engine"],
        "args": engine_args(name, spec, model_dir, {}, adapters_file=f"{ADAPTERS_DIR}/{ADAPTERS_FILE}")
        + ["--metrics-port", str(metrics_port(spec)), "--credential-file", ENGINE_CREDENTIALS_DIR],
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": metrics_port(spec), "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"},
                {"name": "CONSORT_SPECIALIST", "value": name}],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": startup_probe(spec),
        "readinessProbe": readiness_probe(spec),
        # /health is answered by the event loop, never by the model thread: a busy engine passes it.
        "livenessProbe": _probe("/health", spec.port, 10, 6, 5),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_S}}},
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(ctx),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(name)}}],
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    if tolerations:
        pod_spec["tolerations"] = tolerations
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(name, namespace, labels, owner),
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec.warmup_timeout_seconds + 600,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": rollout_strategy(spec),
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port(spec)),
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": pod_spec,
            },
        },
    }
    return stamp_hash(deployment)


def engine_service(name: str, namespace: str, uid: str, spec: SpecialistSpec, ctx: BuildContext) -> dict[str, Any]:
    return stamp_hash({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(name, namespace, engine_labels(name, ctx), owner_reference(KIND, name, uid)),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
            "publishNotReadyAddresses": False,
        },
    })


def engine_disruptions(spec: SpecialistSpec) -> int:
    """Replicas a voluntary disruption (a node drain) may take down at once: the slack above minReady,
    and never fewer than one. minAvailable = minReady allowed none when replicas == minReady, so
    `kubectl drain` never finished; a drain now goes one replica at a time and the lane runs below
    minReady while the evicted replica warms elsewhere (rollouts still keep minReady: they surge)."""
    return max(1, spec.replicas - spec.min_ready)


def engine_pdb(name: str, namespace: str, uid: str, spec: SpecialistSpec, ctx: BuildContext) -> dict[str, Any]:
    return stamp_hash({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(name, namespace, engine_labels(name, ctx), owner_reference(KIND, name, uid)),
        "spec": {
            "maxUnavailable": engine_disruptions(spec),
            "selector": {"matchLabels": selector_labels(name)},
            # A replica that never warmed may be evicted (it protects nothing).
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    })


def downloads(spec: SpecialistSpec) -> bool:
    """Whether the pod downloads a checkpoint, tokenizer or adapter (an hf:// source) when it starts."""
    src = Sources()
    src.resolve(spec.model.source)
    if spec.model.tokenizer:
        src.resolve(spec.model.tokenizer)
    desired_adapters(spec, frozenset(), src)
    return bool(src.downloads)


def engine_network_policy(name: str, namespace: str, uid: str, spec: SpecialistSpec,
                          ctx: BuildContext) -> dict[str, Any]:
    """Ingress: only the ensemble's routers (same namespace) and the operator reach engine pods' API port;
    monitoring namespaces (metricsNamespaceLabels) reach the metrics port alone.
    Egress: DNS, and HTTPS (TCP 443, any address: the hub, its CDN or a mirror) only when a source is
    hf://; nothing else. An engine calls nobody: pvc://, file:// and demo:// sources need no network,
    and a compromised engine cannot reach the cluster's other services or the API server."""
    peers: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "router",
                                         "app.kubernetes.io/part-of": "consort"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ctx.operator_namespace}},
         "podSelector": {"matchLabels": dict(ctx.operator_pod_labels)}},
    ]
    ingress: list[dict[str, Any]] = [{"from": peers, "ports": [{"protocol": "TCP", "port": spec.port}]}]
    if ctx.metrics_namespace_labels:
        ingress.append({"from": [{"namespaceSelector": {"matchLabels": dict(ctx.metrics_namespace_labels)}}],
                        "ports": [{"protocol": "TCP", "port": metrics_port(spec)}]})
    # DNS to any address: cluster DNS may be a Service, a node-local cache or the node itself.
    egress: list[dict[str, Any]] = [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    if downloads(spec):
        egress.append({"ports": [{"protocol": "TCP", "port": 443}]})
    return stamp_hash({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(f"{name}-engine", namespace, engine_labels(name, ctx), owner_reference(KIND, name, uid)),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    })


def desired_adapters(spec: SpecialistSpec, exclude: frozenset[str], src: Sources) -> list[dict[str, str]]:
    """The adapters the engines must serve (rolled-back ones excluded), each with its path in the pod."""
    out = []
    for a in spec.adapters or []:
        if a.name in exclude:
            continue
        if a.source.startswith("demo://lora"):
            path = f"{DEMO_ADAPTERS_DIR}/lora-{parse_demo(a.source).seed}"
        else:
            path = src.resolve(a.source)
        out.append({"name": a.name, "path": path, "source": a.source})
    return out


def adapters_configmap_name(name: str) -> str:
    return f"{name}-adapters"


def adapters_configmap(name: str, namespace: str, uid: str, spec: SpecialistSpec, ctx: BuildContext,
                       exclude_adapters: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The file every engine replica follows (`consort engine --adapters-file`)."""
    adapters = desired_adapters(spec, exclude_adapters, Sources())
    return stamp_hash({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(adapters_configmap_name(name), namespace, engine_labels(name, ctx),
                                owner_reference(KIND, name, uid)),
        "data": {ADAPTERS_FILE: json.dumps({"adapters": adapters}, indent=1, sort_keys=True) + "\n"},
    })


def specialist_children(name: str, namespace: str, uid: str, spec: SpecialistSpec, ctx: BuildContext,
                        exclude_adapters: frozenset[str] = frozenset(),
                        credentials: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Everything one Specialist owns, in apply order (what the pods mount before the pods).
    `credentials`: {EnsembleRouter selecting it: the tokens its engines accept from that router}."""
    children = [
        adapters_configmap(name, namespace, uid, spec, ctx, exclude_adapters),
        engine_credentials_secret(name, namespace, engine_labels(name, ctx), owner_reference(KIND, name, uid),
                                  credentials or {}),
        engine_service(name, namespace, uid, spec, ctx),
        engine_pdb(name, namespace, uid, spec, ctx),
        engine_deployment(name, namespace, uid, spec, ctx),
    ]
    if ctx.network_policy:
        children.insert(0, engine_network_policy(name, namespace, uid, spec, ctx))
    return children
