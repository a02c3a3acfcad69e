"""`EnsembleRouter` (consort.dev/v1alpha1): the front door of an ensemble of Specialists.

Its spec is the user-facing, Kubernetes-shaped face of `consort_router.config.RouterConfig`;
`resources/router.py` renders one into the other (Specialists become Service-discovered lanes).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .base import (DnsLabel, LabelSelector, LocalObjectKeyRef, Model, Quantity, Toleration, cel, Condition)

KIND = "EnsembleRouter"
PLURAL = "ensemblerouters"
SINGULAR = "ensemblerouter"
SHORT_NAMES = ["er", "ensemble"]


class IntentRule(Model):
    intent: DnsLabel = Field(description="Intent label callers declare (x-consort-intent header or `intent` field).")
    specialist: DnsLabel = Field(description="Specialist that serves it as primary.")


class Detector(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("has(self.builtin) || (has(self.patterns) && size(self.patterns) > 0)",
            "a detector needs builtin or at least one pattern"),
    ]}}

    name: DnsLabel = Field(description="Detector name (reported in metrics and /v1/routing).")
    specialist: DnsLabel = Field(description="Specialist a tripped detector routes to, regardless of the classifier.")
    builtin: Literal["sfinae_templates", "build_files", "gdb_transcript"] | None = Field(
        default=None, description="Built-in pattern set: sfinae_templates (enable_if/decltype/void_t/requires), build_files (CMake/Bazel/Make), gdb_transcript ((gdb) prompts, backtraces, signals).")
    patterns: list[str] | None = Field(default=None, max_length=64, description="Extra regular expressions (Python syntax, multiline); each occurrence counts as a match.")
    min_matches: int = Field(default=2, ge=1, le=1000, description="Matches needed to trip.")


class ClassifierSource(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("!has(self.kind) || self.kind != 'torch' || has(self.modelConfigMapRef)", "classifier.kind torch needs modelConfigMapRef"),
        cel("!has(self.onReject) || self.onReject != 'default' || has(self.defaultSpecialist)", "onReject default needs defaultSpecialist"),
    ]}}

    kind: Literal["builtin", "torch", "none"] = Field(default="builtin", description="builtin: a light naive-Bayes model trained at router start-up from labeled examples; torch: a user TorchScript model (refused unless the operator runs with --allow-torch-classifier); none: rules and detectors only.")
    examples_config_map_ref: LocalObjectKeyRef | None = Field(default=None, description="ConfigMap key holding JSONL training examples ({\"text\", \"label\"} per line; label = specialist name or the reject label).")
    model_config_map_ref: LocalObjectKeyRef | None = Field(default=None, description="kind torch: ConfigMap (binaryData) key holding the TorchScript module.")
    labels: list[str] | None = Field(default=None, description="kind torch: the label of each logit column.")
    reject_label: str = Field(default="reject", max_length=63, description="Label of the reject class in the examples.")
    min_confidence: float = Field(default=0.0, ge=0.0, le=1.0, description="A top-1 probability below this counts as reject.")
    on_reject: Literal["unroutable", "default"] = Field(default="unroutable", description="unroutable: typed 422; default: send to defaultSpecialist.")
    default_specialist: DnsLabel | None = Field(default=None, description="Serves requests that nothing else routes.")


class Shadow(Model):
    enabled: bool = Field(default=True, description="Shadow dispatch master switch.")
    default_threshold: float = Field(default=0.5, ge=0.0, le=1.0, description="Shadow to the second choice when the classifier's top-1 probability is below this.")
    thresholds: dict[str, Annotated[float, Field(ge=0.0, le=1.0)]] | None = Field(default=None, max_length=256, description="Per-intent thresholds (e.g. review: 0.9, codegen: 0.2), each in [0, 1].")
    max_inflight: int = Field(default=16, ge=0, le=10_000, description="Shadow copies in flight at once; more are dropped (they run at the lowest priority).")
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000, description="Cap on a shadow copy's max_tokens.")


class Breaker(Model):
    window: int = Field(default=50, ge=1, le=100_000, description="Samples in the rolling correctness window.")
    min_samples: int = Field(default=20, ge=1, le=100_000, description="No transition is decided on fewer samples.")
    floor: float | None = Field(default=None, ge=0.0, le=1.0, description="Correctness floor for every lane; default: the lowest spec.slo.correctnessFloor of the selected Specialists.")
    recovery_margin: float = Field(default=0.05, ge=0.0, le=1.0, description="Recovery needs rate >= floor + margin (hysteresis).")
    trip_after: int = Field(default=10, ge=1, le=100_000, description="Consecutive breaching samples before the breaker opens (sustained breach).")
    trip_after_seconds: float = Field(default=0.0, ge=0.0, le=86_400.0, description="... and the breach must also have lasted this long.")
    reset_after: int = Field(default=20, ge=1, le=100_000, description="Consecutive recovered samples before an open breaker half-opens.")
    reset_after_seconds: float = Field(default=0.0, ge=0.0, le=86_400.0, description="... and the recovery must also have lasted this long.")
    half_open_samples: int = Field(default=10, ge=1, le=100_000, description="Clean samples in half-open before closing.")
    fresh_samples: int = Field(default=20, ge=0, le=100_000, description="A lane with fewer samples since its revision is fresh (heavier shadowing).")
    fresh_shadow_fraction: float = Field(default=0.5, ge=0.0, le=1.0, description="Share of a fresh or half-open lane's primary requests that are also shadowed.")


class Admission(Model):
    spike_window_seconds: float = Field(default=10.0, ge=0.1, le=3600.0, description="Window over which engine 429s are counted.")
    spike_min_count: int = Field(default=5, ge=1, le=1_000_000, description="429s in the window that make a spike.")
    spike_rate: float = Field(default=0.2, ge=0.0, le=1.0, description="... and the 429 share of responses in the window.")
    threshold_step: float = Field(default=0.1, ge=0.0, le=1.0, description="First escalation: the shadow threshold drops by this per step.")
    threshold_levels: int = Field(default=2, ge=0, le=100, description="Threshold steps before the priority floor rises.")
    floor_step: int = Field(default=100, ge=1, le=1_000_000, description="Second escalation: the intent's priority floor rises by this per level.")
    floor_levels: int = Field(default=3, ge=0, le=100, description="Maximum priority-floor levels.")
    cooldown_seconds: float = Field(default=15.0, ge=0.0, le=3600.0, description="Spike-free time before one level decays back (reversible knobs).")


class Verifier(Model):
    enabled: bool = Field(default=True, description="Compile code blocks of sampled responses with g++ -fsyntax-only (sandboxed) as the correctness signal.")
    sample_rate: float = Field(default=0.1, ge=0.0, le=1.0, description="Share of primary responses verified (shadow responses are always verified).")
    std: str = Field(default="c++20", pattern=r"^(c|gnu)\+\+[0-9a-z]{2}$", description="-std= value.")
    cpu_seconds: int = Field(default=10, ge=1, le=600, description="CPU-time limit per compilation.")
    memory_mb: int = Field(default=1024, ge=64, le=65_536, description="Address-space limit per compilation, MiB.")
    wall_timeout_seconds: float = Field(default=20.0, ge=0.1, le=600.0, description="Wall-clock limit per compilation.")
    max_concurrency: int = Field(default=2, ge=1, le=256, description="Compilations at once per router replica.")


class ReplicaChoice(Model):
    policy: Literal["prefix-affine", "least-loaded"] = Field(default="prefix-affine", description="How a lane picks among its warm replicas: prefix-affine sends a request to the replica most likely to hold its prompt's prefix in KV cache (the engines' own block hashes, followed through their block events, where the router can tokenize the prompt; otherwise chained hashes of its text blocks) while that replica holds at least half the prompt's blocks and its queue depth is within loadSlack of the least-loaded one (a shorter prefix, such as a shared system prompt, goes to the least loaded); least-loaded uses queue depth only.")
    load_slack: float = Field(default=4.0, ge=0.0, le=1000.0, description="Queue-depth units the affine replica may carry above the least-loaded one before a request spills to the least-loaded one.")
    block_chars: int = Field(default=128, ge=8, le=65_536, description="Prompt characters per hashed block (engines cache whole KV blocks; 128 characters is about two 16-token blocks).")


class RouterService(Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP", description="Service type of the router's front door.")
    port: int = Field(default=80, ge=1, le=65535, description="Service port (targets the router's container port 8080).")
    annotations: dict[str, str] | None = Field(default=None, description="Extra Service annotations (e.g. for a cloud load balancer).")


class Auth(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("!has(self.apiKeysSecretRef) || !has(self.enabled) || self.enabled",
            "auth.apiKeysSecretRef needs auth.enabled (keys named and turned off at once)"),
    ]}}

    enabled: bool = Field(default=True, description="API-key auth (Authorization: Bearer <key>). Without apiKeysSecretRef the operator generates a Secret <name>-api-keys (key `keys`, one tenant `default: <random key>`), owned by this EnsembleRouter; the operator never changes a key in it: read the key from it, or edit it to add tenants. false turns auth off (every caller is the tenant `anonymous`): only for a ClusterIP Service.")
    api_keys_secret_ref: LocalObjectKeyRef | None = Field(default=None, description="Secret key holding the API keys, one tenant a line (`name: key`). Keys are never written inline in the spec; unset: the generated <name>-api-keys Secret. The Secret is always the one in the EnsembleRouter's own namespace.")
    protect_metrics: bool = Field(default=False, description="Require a key for GET /metrics.")
    protect_routing: bool = Field(default=True, description="Require a key for GET /v1/routing.")


class RouterResources(Model):
    cpu: Quantity = Field(default="1", description="CPU request per router replica.")
    memory: Quantity = Field(default="1Gi", description="Memory request and limit per router replica.")


EXPOSED_NEEDS_KEYS = ("a NodePort or LoadBalancer router Service needs auth.enabled: it is reachable from "
                      "outside the cluster, and without keys anyone there could call it")


class EnsembleRouterSpec(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("!has(self.service) || !has(self.service.type) || self.service.type == 'ClusterIP' || "
            "!has(self.auth) || !has(self.auth.enabled) || self.auth.enabled", EXPOSED_NEEDS_KEYS, reason="FieldValueForbidden"),
    ]}}

    specialist_selector: LabelSelector = Field(default_factory=LabelSelector, json_schema_extra={"default": {}},
                                               description="Which Specialists in this namespace form the ensemble; empty selects all.")
    rules: list[IntentRule] | None = Field(default=None, max_length=256, description="Extra intent -> specialist rules beyond each Specialist's spec.intents.")
    detectors: list[Detector] | None = Field(default=None, max_length=64, description="Structural detectors checked in order before the classifier.")
    classifier: ClassifierSource = Field(default_factory=ClassifierSource, json_schema_extra={"default": {}}, description="The classifier that routes what rules and detectors leave.")
    shadow: Shadow = Field(default_factory=Shadow, json_schema_extra={"default": {}}, description="Shadow dispatch on low classifier confidence.")
    breaker: Breaker = Field(default_factory=Breaker, json_schema_extra={"default": {}}, description="Per-specialist correctness circuit breakers.")
    admission: Admission = Field(default_factory=Admission, json_schema_extra={"default": {}}, description="Escalation on sustained 429 spikes.")
    verifier: Verifier = Field(default_factory=Verifier, json_schema_extra={"default": {}}, description="The built-in C++ verifier.")
    replica_choice: ReplicaChoice = Field(default_factory=ReplicaChoice, json_schema_extra={"default": {}}, description="How each lane picks one of its warm engine replicas per request.")
    replicas: int = Field(default=2, ge=0, le=100, description="Router replicas.")
    image: str | None = Field(default=None, min_length=1, max_length=512, description="Router image override; default: the operator's --router-image. Must start with one of the operator's allowed image prefixes (--allowed-image; the --engine-image and --router-image repositories are always allowed), or the EnsembleRouter is refused (reason ImageNotAllowed): its pods hold the API keys.")
    resources: RouterResources = Field(default_factory=RouterResources, json_schema_extra={"default": {}}, description="Router pod resources.")
    node_selector: dict[str, str] | None = Field(default=None, description="Node labels router pods must match.")
    tolerations: list[Toleration] | None = Field(default=None, description="Tolerations for router pods.")
    service: RouterService = Field(default_factory=RouterService, json_schema_extra={"default": {}}, description="The router's Service.")
    auth: Auth = Field(default_factory=Auth, json_schema_extra={"default": {}}, description="API-key auth.")

    @model_validator(mode="after")
    def _exposed_needs_keys(self) -> "EnsembleRouterSpec":
        if self.service.type != "ClusterIP" and not self.auth.enabled:
            raise ValueError(EXPOSED_NEEDS_KEYS)
        if self.auth.api_keys_secret_ref is not None and not self.auth.enabled:
            raise ValueError("auth.apiKeysSecretRef needs auth.enabled (keys named and turned off at once)")
        return self


class LaneStatus(Model):
    name: str = Field(description="Specialist name.")
    phase: str | None = Field(default=None, description="The Specialist's phase.")
    warm_replicas: int = Field(default=0, description="Warm replicas of the lane.")
    breaker: Literal["Closed", "Open", "HalfOpen"] = Field(default="Closed", description="Breaker state of the lane.")


class EnsembleRouterStatus(Model):
    observed_generation: int | None = Field(default=None, description="metadata.generation this status reflects.")
    phase: Literal["Pending", "Ready", "Degraded", "Invalid"] | None = Field(default=None, description="Pending (router not available), Ready, Degraded (some lanes not Ready) or Invalid (the spec does not render into a valid router config).")
    replicas: int = Field(default=0, description="Router pods that exist.")
    ready_replicas: int = Field(default=0, description="Router pods that are Ready.")
    ready: str | None = Field(default=None, description="ready/desired router replicas, for `kubectl get`.")
    specialists: int = Field(default=0, description="Specialists selected into the ensemble.")
    ready_specialists: int = Field(default=0, description="Selected Specialists that are Ready.")
    lanes: list[LaneStatus] | None = Field(default=None, description="Per-specialist lane summary.")
    config_hash: str | None = Field(default=None, description="Hash of the rendered routing ConfigMap.")
    breaker_state: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        description="Breaker states written by the router itself ({version, breakers: {specialist: state}}), so they survive router restarts; the operator mirrors them into each Specialist's status.breaker.")
    engine_credential_digest: str | None = Field(default=None, description="A digest of the engine credential tokens the engines accept (it changes at each step of a rotation); the Specialists this EnsembleRouter selects copy the tokens into their engines' credentials Secret when it changes.")
    conditions: list[Condition] | None = Field(default=None, description="Ready and ConfigValid.")
