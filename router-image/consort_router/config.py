"""RouterConfig: the one schema of the router's configuration.

The operator renders this model (from an `EnsembleRouter` resource) into the routing ConfigMap;
`consort router --config FILE` loads it back with `RouterConfig.load(FILE)`. Keep this module light:
it imports pydantic, the standard library and api.py's limits only (the operator imports it).

Routing order (DESIGN.md section 5): declared intent (`x-consort-intent` header or `intent` body
field) -> intent table; then structural detectors; then the classifier (a distribution over
specialists plus a reject class). `model` = the ensemble name routes, a specialist name pins.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .api import PRIORITY_RANGE

NAME_RE = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
BUILTIN_DETECTORS = ("sfinae_templates", "build_files", "gdb_transcript")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServiceSelector(_Strict):
    """Cluster mode: the specialist's replicas are the ready endpoints of this Service's EndpointSlices."""

    namespace: str = Field(description="Namespace of the Service.")
    service: str = Field(description="Service name (EndpointSlices labelled kubernetes.io/service-name=<service>).")
    port: int = Field(ge=1, le=65535, description="Engine HTTP port on each endpoint.")
    scheme: Literal["http", "https"] = Field("http", description="Scheme used to reach the endpoints.")


class ScaleFromZero(_Strict):
    """A lane that may have no replica at all (its Specialist scales to zero when idle): what the
    router does with its requests while a replica starts (activator.py)."""

    while_cold: Literal["hold", "fallback"] = Field(
        "hold", description="hold: wait for the first warm replica; fallback: send to the lane's fallback meanwhile.")
    max_held: int = Field(64, ge=1, le=10_000, description="Requests held at once; beyond it 503 cold_start_queue_full.")
    hold_timeout_s: float = Field(60.0, gt=0, le=3600, description="Longest wait of a held request; then 503 cold_start_timeout.")


class ActivatorConfig(_Strict):
    """How the router asks for a replica of a lane at zero (wake.py)."""

    kind: Literal["scale", "file"] = Field(
        "scale", description="scale: set the Specialist's /scale subresource from 0 to 1 (cluster: the lane's Service "
        "namespace, the Specialist of the lane's name); file: create DIR/<lane> (`consort up` watches it).")
    dir: str | None = Field(None, description="kind file: the directory.")

    @model_validator(mode="after")
    def _dir(self) -> "ActivatorConfig":
        if self.kind == "file" and not self.dir:
            raise ValueError("activator.kind file needs activator.dir")
        return self


class SpecialistRoute(_Strict):
    """One specialist lane: where its replicas are and which intents it serves."""

    name: str = Field(pattern=NAME_RE, description="Specialist name; a request may pin it with `model: <name>`.")
    replicas: list[str] = Field(
        default_factory=list,
        description="Local mode: base URLs of the specialist's engine replicas (e.g. http://127.0.0.1:8101).",
    )
    service: ServiceSelector | None = Field(
        None, description="Cluster mode: discover replicas from this Service's ready EndpointSlice endpoints."
    )
    intents: list[str] = Field(
        default_factory=list, description="Declared intents this specialist serves (intent -> specialist rules)."
    )
    fallback: str | None = Field(
        None, description="Specialist that takes this one's primary traffic while its breaker is open."
    )
    tokenizer: str | None = Field(
        None, description="Directory holding the specialist's tokenizer.json (and tokenizer_config.json): the "
        "router tokenizes completion prompts as the engine does to route on the engine's own block hashes. "
        "None: the router fetches it from one of the lane's engines (GET /v1/kv/tokenizer).")
    adapter: str | None = Field(None, description="Adapter requested on the engine when the request names none.")
    revision: str | None = Field(
        None,
        description="Lane revision (checkpoint or adapter rotation). A change marks the lane fresh: its "
        "correctness window restarts and it gets heavier shadowing until the window fills.",
    )
    scale_from_zero: ScaleFromZero | None = Field(
        None, description="The lane may have no replica (scale to zero): hold its requests while one starts.")

    @field_validator("replicas")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        out = []
        for url in v:
            if not re.match(r"^https?://[^/\s]+$", url.rstrip("/")):
                raise ValueError(f"replica {url!r} is not a base URL like http://host:port")
            out.append(url.rstrip("/"))
        return out

    @model_validator(mode="after")
    def _one_source(self) -> "SpecialistRoute":
        if self.replicas and self.service is not None:
            raise ValueError(f"specialist {self.name}: give either replicas or service, not both")
        return self


class IntentRule(_Strict):
    """A declared-intent alias: requests declaring `intent` go to `specialist`."""

    intent: str = Field(min_length=1, max_length=64, description="Intent label as declared by callers.")
    specialist: str = Field(description="Specialist that serves it.")


class Detector(_Strict):
    """A structural detector: if the prompt trips it, route to `specialist` regardless of the classifier."""

    name: str = Field(pattern=NAME_RE, description="Detector name (reported in metrics and /v1/routing).")
    specialist: str = Field(description="Target specialist.")
    builtin: Literal["sfinae_templates", "build_files", "gdb_transcript"] | None = Field(
        None,
        description="Built-in pattern set: sfinae_templates (enable_if/decltype/void_t/requires...), "
        "build_files (CMake/Bazel/Make), gdb_transcript ((gdb) prompts, backtraces, signals).",
    )
    patterns: list[str] = Field(
        default_factory=list, description="Extra regular expressions (Python syntax, multiline) counted as matches."
    )
    min_matches: int = Field(
        2, ge=1, description="Total matches (sum over patterns, each occurrence counts) needed to trip."
    )

    @field_validator("patterns")
    @classmethod
    def _compile(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"bad detector pattern {p!r}: {e}") from e
        return v

    @model_validator(mode="after")
    def _has_patterns(self) -> "Detector":
        if self.builtin is None and not self.patterns:
            raise ValueError(f"detector {self.name}: give builtin or patterns")
        return self


class LabeledExample(_Strict):
    text: str = Field(description="Prompt text.")
    label: str = Field(description="Specialist name, or the reject label.")


class ClassifierConfig(_Strict):
    """The fallback router after rules and detectors."""

    kind: Literal["builtin", "torch", "none"] = Field(
        "builtin",
        description="builtin: multinomial naive Bayes over hashed word/char n-grams trained at start-up; "
        "torch: a user TorchScript model (see torch_model_path); none: no classifier.",
    )
    examples_path: str | None = Field(None, description="JSONL file of {\"text\", \"label\"} training examples.")
    examples: list[LabeledExample] = Field(default_factory=list, description="Inline training examples.")
    reject_label: str = Field("reject", description="Label of the reject class in the examples.")
    hash_dim: int = Field(1 << 18, ge=1024, description="Hashed feature space size.")
    alpha: float = Field(0.1, gt=0, description="Additive (Laplace) smoothing of the naive Bayes counts.")
    evidence_cap: float = Field(
        4.0,
        gt=0,
        description="Summed feature log-likelihoods are scaled to at most this many features' worth of "
        "evidence, which tempers naive-Bayes overconfidence so top-1 probabilities can drive shadow thresholds.",
    )
    min_confidence: float = Field(
        0.0, ge=0, le=1, description="A top-1 probability below this is treated as reject."
    )
    on_reject: Literal["unroutable", "default"] = Field(
        "unroutable",
        description="unroutable: typed 422 `unroutable`; default: route to `default_specialist`.",
    )
    torch_model_path: str | None = Field(
        None,
        description="kind=torch: TorchScript module mapping a list[str] of prompts to logits "
        "[batch, len(torch_labels)]; imported only when configured.",
    )
    torch_labels: list[str] = Field(default_factory=list, description="kind=torch: label of each logit column.")


class ShadowConfig(_Strict):
    """Shadow dispatch: a low-confidence request is also sent to its second choice at the lowest priority."""

    enabled: bool = Field(True, description="Master switch.")
    default_threshold: float = Field(0.5, ge=0, le=1, description="Shadow when top-1 probability < this.")
    thresholds: dict[str, float] = Field(
        default_factory=dict, description="Per-intent threshold overrides (e.g. review: 0.9, codegen: 0.2)."
    )
    priority: int = Field(PRIORITY_RANGE[0], ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                          description="Engine priority of shadow copies (lowest; droppable).")
    max_inflight: int = Field(16, ge=0, description="Shadow copies in flight at once; more are dropped.")
    max_tokens: int | None = Field(None, ge=1, description="Cap on the shadow copy's max_tokens.")
    record_outputs: bool = Field(
        True, description="Store both outputs in calibration records (False: sha256 hashes only)."
    )
    timeout_s: float = Field(120.0, gt=0, description="A shadow copy still running after this is dropped.")

    @field_validator("thresholds")
    @classmethod
    def _range(cls, v: dict[str, float]) -> dict[str, float]:
        for k, t in v.items():
            if not 0 <= t <= 1:
                raise ValueError(f"shadow threshold for {k!r} must be in [0, 1]")
        return v


class BreakerConfig(_Strict):
    """Correctness breaker per specialist (rolling pass rate over the last `window` samples)."""

    window: int = Field(50, ge=1, description="Samples in the rolling correctness window.")
    min_samples: int = Field(20, ge=1, description="No transition is decided on fewer samples than this.")
    floor: float = Field(0.7, ge=0, le=1, description="Correctness floor (pass-rate).")
    recovery_margin: float = Field(
        0.05, ge=0, le=1, description="Recovery requires rate >= floor + margin (hysteresis band)."
    )
    trip_after: int = Field(
        10, ge=1, description="Consecutive samples with rate < floor needed to trip (sustained breach)."
    )
    trip_after_s: float = Field(0.0, ge=0, description="... and the breach must also have lasted this long.")
    reset_after: int = Field(
        20, ge=1, description="Consecutive samples with rate >= floor + margin needed to leave `open`."
    )
    reset_after_s: float = Field(0.0, ge=0, description="... and the recovery must also have lasted this long.")
    relapse_window: int = Field(
        250, ge=0, description="A trip within this many samples of closing is a relapse: each relapse doubles "
        "the recovery run the next reset needs (up to 64x), so a lane hovering at the floor cannot cycle.",
    )
    half_open_samples: int = Field(
        10, ge=1, description="Samples in `half_open` (primary again, heavily shadowed) before `closed`."
    )
    fresh_samples: int = Field(
        20, ge=0, description="A lane with fewer samples than this (since its revision) is fresh."
    )
    fresh_shadow_fraction: float = Field(
        0.5, ge=0, le=1, description="Share of a fresh or half-open lane's primary requests also shadowed."
    )


class AdmissionConfig(_Strict):
    """Escalation knobs for a sustained 429 spike on one specialist."""

    spike_window_s: float = Field(10.0, gt=0, description="Window over which engine 429s are counted.")
    spike_min_count: int = Field(5, ge=1, description="429s in the window needed to call it a spike.")
    spike_rate: float = Field(0.2, ge=0, le=1, description="... and 429s / responses in the window >= this.")
    escalate_every_s: float = Field(5.0, ge=0, description="At most one escalation step per this interval.")
    threshold_step: float = Field(0.1, ge=0, le=1, description="Shadow threshold lowered by this per step.")
    threshold_levels: int = Field(2, ge=0, description="Threshold steps taken before the priority floor rises.")
    floor_start: int = Field(0, description="Priority floor at its first level (priority < floor is rejected).")
    floor_step: int = Field(100, ge=1, description="Floor raised by this per further level.")
    floor_levels: int = Field(3, ge=0, description="Maximum priority-floor levels.")
    cooldown_s: float = Field(15.0, ge=0, description="Spike-free time before one level decays back.")
    retry_after_ms: int = Field(1000, ge=0, description="Retry-After for `priority_floor` rejections.")


class VerifierConfig(_Strict):
    """The built-in C++ verifier: g++ -fsyntax-only on code blocks of sampled responses, sandboxed."""

    enabled: bool = Field(True, description="Master switch.")
    sample_rate: float = Field(0.1, ge=0, le=1, description="Share of primary (and all shadow) responses verified.")
    gxx: str = Field("g++", description="Compiler binary (path or name on PATH).")
    std: str = Field("c++20", pattern=r"^(c|gnu)\+\+[0-9a-z]{2}$", description="-std= value.")
    cpu_seconds: int = Field(10, ge=1, description="RLIMIT_CPU of the compiler process.")
    memory_mb: int = Field(1024, ge=64, description="RLIMIT_AS of the compiler process.")
    wall_timeout_s: float = Field(20.0, gt=0, description="Wall clock limit; the process group is killed.")
    max_concurrency: int = Field(2, ge=1, description="Compilations at once.")
    max_queue: int = Field(64, ge=0, description="Pending verifications beyond this are dropped.")
    template_depth: int = Field(256, ge=16, description="-ftemplate-depth=.")
    constexpr_depth: int = Field(256, ge=16, description="-fconstexpr-depth=.")
    constexpr_ops_limit: int = Field(1 << 24, ge=1024, description="-fconstexpr-ops-limit=.")
    max_code_bytes: int = Field(65536, ge=64, description="Larger code blocks fail without compiling.")
    max_output_bytes: int = Field(16384, ge=256, description="Compiler diagnostics kept per run.")
    network: Literal["auto", "unshare", "inherit"] = Field(
        "auto",
        description="auto: run in a new network namespace (unshare -n) when permitted, else inherit; "
        "unshare: require it; inherit: do not isolate (g++ does not use the network).",
    )


class AuthConfig(_Strict):
    """API-key auth (Authorization: Bearer <key>). /health and /ready are always open."""

    api_keys_file: str | None = Field(
        None, description="File with one tenant per line, `name: key` (a bare key is an anonymous tenant "
        "`anon-<digest prefix>`; # comments); None disables auth (every request is tenant `anonymous`). "
        "Re-read on change."
    )
    protect_metrics: bool = Field(False, description="Require a key for GET /metrics.")
    engine_credential_file: str | None = Field(
        None, description="File whose first line is the engine credential, sent as `Authorization: Bearer` on "
        "every call to an engine (requests, shadows, /v1/status polls, tokenize); the engines' "
        "--credential-file. None: engines are called without one.")
    protect_routing: bool = Field(True, description="Require a key for GET /v1/routing.")


class TenantPolicy(_Strict):
    """What one tenant may do (tenants.py applies it)."""

    max_priority: int = Field(1000, ge=-1000, le=1000, description="A request's priority is clamped to this.")
    tokens_per_s: float | None = Field(
        None, gt=0, description="Token-rate quota (estimated prompt tokens + max_tokens x n per request, refilled "
        "at this rate); over it a request gets 429 `tenant_quota` with Retry-After. None: no quota.")
    burst_tokens: int | None = Field(
        None, ge=1, description="Bucket size (default: 10 s of tokens_per_s); a larger request waits for a full "
        "bucket.")
    unbounded_max_tokens: int = Field(
        4096, ge=1, description="What a request without max_tokens counts as against the quota.")


class TenantsConfig(_Strict):
    """Per-tenant limits: `defaults` for every tenant, `overrides` by tenant name (from the keys file)."""

    defaults: TenantPolicy = Field(default_factory=TenantPolicy)
    overrides: dict[str, TenantPolicy] = Field(default_factory=dict)
    metric_tenants: int = Field(
        32, ge=0, description="Distinct tenant label values in metrics; later tenants are counted as `other`.")


class StoreConfig(_Strict):
    """Where breaker state survives restarts."""

    kind: Literal["file", "none"] = Field(
        "file", description="file: JSON at `path`; none: in memory (the operator may inject its own store)."
    )
    path: str | None = Field(None, description="kind=file: JSON file path.")
    save_interval_s: float = Field(2.0, gt=0, description="Dirty state is saved at most this often.")


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get a typed 413.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Upstream connect timeout.")
    request_timeout_s: float = Field(600.0, gt=0, description="Upstream total timeout per request.")
    stream_idle_timeout_s: float = Field(30.0, gt=0, description="A stream with no chunk from the engine for this "
                                         "long is cancelled upstream, ended with a typed SSE error event and "
                                         "counted as a failure against the lane's breaker.")
    feedback_map_size: int = Field(100_000, ge=1, description="Feedback ids remembered for /v1/feedback.")


class ReplicaPolling(_Strict):
    interval_s: float = Field(0.5, gt=0, description="Engines' /ready and /v1/status are polled this often.")
    timeout_s: float = Field(1.0, gt=0, description="Poll timeout; a replica that does not answer is not ready.")
    preempting_penalty: float = Field(
        8.0, ge=0, description="Queue-depth units added to a replica whose status says it is preempting."
    )
    discovery_interval_s: float = Field(5.0, gt=0, description="Cluster mode: EndpointSlice re-list interval.")


class ReplicaChoice(_Strict):
    """How a lane picks among its warm replicas (see affinity.py and replicas.choose_replica)."""

    policy: Literal["prefix-affine", "least-loaded"] = Field(
        "prefix-affine",
        description="prefix-affine: the replica holding the deepest prefix of the prompt in its KV cache (at least half "
        "its blocks), while its load is within load_slack of the least; a shorter prefix (a shared system prompt) "
        "goes to the least loaded; least-loaded: the least queue depth only.",
    )
    block_chars: int = Field(128, ge=8, description="Prompt characters per hashed block (engines cache whole "
                             "KV blocks; 128 characters is about two 16-token blocks).")
    max_blocks: int = Field(64, ge=1, description="Leading blocks hashed per prompt (longer prompts match on "
                            "their first max_blocks * block_chars characters).")
    load_slack: float = Field(4.0, ge=0, description="Queue-depth units the affine replica may carry above the "
                              "least-loaded one before a request spills to the least-loaded one.")
    index_blocks: int = Field(200_000, ge=1, description="Block hashes remembered (LRU), all lanes together.")
    kv_events: bool = Field(True, description="prefix-affine: follow each engine's block events (GET "
                            "/v1/kv/events) and, for prompts whose token ids the router knows exactly, route on "
                            "the blocks each replica says it holds (docs/prefix-affinity.md).")
    kv_events_wait_s: float = Field(10.0, gt=0, le=30, description="How long an engine holds the router's "
                                    "block-events request when it has nothing new (a long poll: the engine answers "
                                    "it at its next event, so the router's view follows within a round trip).")
    kv_events_interval_s: float = Field(0.5, gt=0, description="Retry delay of the block-events subscriber: a replica "
                                        "not ready yet is looked at again this often, a failed request is retried "
                                        "after it (doubling per failure in a row, up to 8 s), and an engine without "
                                        "the long poll is polled this often.")
    kv_max_hashes: int = Field(262_144, ge=1, description="Block hashes held per replica and medium (pool, tier) "
                               "in the router's view; the oldest stored are forgotten first (a miss, never a "
                               "wrong route).")


class RouterConfig(_Strict):
    """The ensemble router's whole configuration (the routing ConfigMap's `router.yaml`)."""

    ensemble: str = Field(pattern=NAME_RE, description="Ensemble name; `model: <ensemble>` asks the router to route.")
    specialists: list[SpecialistRoute] = Field(min_length=1, description="The specialist lanes.")
    rules: list[IntentRule] = Field(
        default_factory=list, description="Extra intent -> specialist rules (aliases beyond each lane's intents)."
    )
    detectors: list[Detector] = Field(default_factory=list, description="Structural detectors, checked in order.")
    classifier: ClassifierConfig = Field(default_factory=ClassifierConfig)
    default_specialist: str | None = Field(
        None,
        description="Serves requests nothing else routes (no classifier, or on_reject=default). "
        "None: such requests get a typed 422 `unroutable`.",
    )
    shadow: ShadowConfig = Field(default_factory=ShadowConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    tenants: TenantsConfig = Field(default_factory=TenantsConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    polling: ReplicaPolling = Field(default_factory=ReplicaPolling)
    replica_choice: ReplicaChoice = Field(default_factory=ReplicaChoice)
    activator: ActivatorConfig = Field(default_factory=ActivatorConfig)
    calibration_log: str | None = Field(None, description="JSONL file of shadow calibration records.")
    reload_interval_s: float = Field(1.0, gt=0, description="Config file mtime poll interval.")

    @model_validator(mode="after")
    def _references(self) -> "RouterConfig":
        names = [s.name for s in self.specialists]
        if len(set(names)) != len(names):
            raise ValueError("specialist names must be unique")
        if self.ensemble in names:
            raise ValueError("the ensemble name must differ from every specialist name")
        known = set(names)

        def check(ref: str | None, what: str) -> None:
            if ref is not None and ref not in known:
                raise ValueError(f"{what} refers to unknown specialist {ref!r}")

        for s in self.specialists:
            check(s.fallback, f"specialist {s.name} fallback")
            if s.fallback == s.name:
                raise ValueError(f"specialist {s.name} cannot be its own fallback")
            if s.scale_from_zero is not None and s.service is None and self.activator.kind == "scale":
                raise ValueError(f"specialist {s.name}: a lane listed by URL has no /scale to ask; "
                                 "use activator.kind file")
        for r in self.rules:
            check(r.specialist, f"rule for intent {r.intent!r}")
        for d in self.detectors:
            check(d.specialist, f"detector {d.name}")
        check(self.default_specialist, "default_specialist")
        if self.classifier.on_reject == "default" and self.default_specialist is None:
            raise ValueError("classifier.on_reject=default needs default_specialist")
        self.intent_table()  # raises on conflicting intent declarations
        return self

    def intent_table(self) -> dict[str, str]:
        """Declared intent -> specialist, from each lane's `intents` and the extra `rules`."""
        table: dict[str, str] = {}
        pairs = [(i, s.name) for s in self.specialists for i in s.intents]
        pairs += [(r.intent, r.specialist) for r in self.rules]
        for intent, name in pairs:
            if table.get(intent, name) != name:
                raise ValueError(f"intent {intent!r} maps to both {table[intent]!r} and {name!r}")
            table[intent] = name
        return table

    def specialist(self, name: str) -> SpecialistRoute | None:
        return next((s for s in self.specialists if s.name == name), None)

    @classmethod
    def load(cls, path: str | Path) -> "RouterConfig":
        """Load from YAML or JSON (by content: JSON is valid YAML). Relative paths stay as written."""
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml  # only when needed

            data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        return cls.model_validate(data)

    def dump_yaml(self) -> str:
        """YAML text of this config (what the operator writes into the ConfigMap)."""
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
