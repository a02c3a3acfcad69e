"""`Specialist` (consort.dev/v1alpha1): one specialist LLM served by Consort's paged-KV engine."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import (DURATION, PATTERN_HINTS, Condition, DnsLabel, Model, Quantity, Toleration, cel,
                   duration_seconds)

KIND = "Specialist"
PLURAL = "specialists"
SINGULAR = "specialist"
SHORT_NAMES = ["spec", "sp"]

ADAPTER_SOURCE = r"^(demo://lora(\?seed=[0-9]{1,9})?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?|file:///.+|hf://[A-Za-z0-9][-._A-Za-z0-9]*/[-._A-Za-z0-9]+(@[-._A-Za-z0-9]+)?)$"
MODEL_SOURCE = r"^(demo://(tiny|bench)(-bamba)?(\?seed=[0-9]{1,9})?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^/].*)?|file:///.+|hf://[A-Za-z0-9][-._A-Za-z0-9]*/[-._A-Za-z0-9]+(@[-._A-Za-z0-9]+)?)$"
PATTERN_HINTS[MODEL_SOURCE] = ("one of pvc://CLAIM/PATH, file:///PATH (absolute), hf://ORG/NAME[@REVISION], "
                               "demo://tiny[-bamba][?seed=N] or demo://bench[-bamba]")
PATTERN_HINTS[ADAPTER_SOURCE] = ("one of pvc://CLAIM/PATH, file:///PATH (absolute), hf://ORG/NAME[@REVISION] "
                                 "or demo://lora[?seed=N]")


# A `..` segment in a pvc:// path would leave the claim's mount (engine pods mount every claim and
# emptyDir under /models). Refused by CEL in the CRD and by the models below; [.] rather than \. so the
# regex reads the same in Python and in a CEL string literal.
PVC_PARENT = r"^pvc://[^/]+/(.*/)?[.][.](/.*)?$"
PVC_PARENT_MESSAGE = "a pvc:// path must not contain '..'"


def no_pvc_parent(url: str | None) -> str | None:
    if url is not None and re.match(PVC_PARENT, url):
        raise ValueError(PVC_PARENT_MESSAGE)
    return url


def pvc_parent_rule(field: str, optional: bool = False) -> dict[str, Any]:
    rule = f"!self.{field}.matches('{PVC_PARENT}')"
    return cel(f"!has(self.{field}) || {rule}" if optional else rule, PVC_PARENT_MESSAGE, field_path=f".{field}")


class ModelSource(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        pvc_parent_rule("source"), pvc_parent_rule("tokenizer", optional=True),
    ]}}

    source: str = Field(
        description=(
            "Where the checkpoint (config.json, *.safetensors) lives: `pvc://CLAIM/PATH` (a "
            "PersistentVolumeClaim in the namespace, mounted read-only; PATH may not contain `..`), `file:///PATH` (a path already "
            "present in the engine image or on the node), `hf://ORG/NAME[@REVISION]` (downloaded into "
            "an emptyDir by an init container on first start), or `demo://tiny[?seed=N]` / `demo://bench` (a small "
            "random-weight Llama checkpoint written by `consort demo-model`: demos and tests, CPU is enough; "
            "`demo://tiny-bamba` / `demo://bench-bamba`: the same as a hybrid, Mamba2 mixers with attention in every "
            "fourth layer)."),
        pattern=MODEL_SOURCE, max_length=512)
    tokenizer: str | None = Field(
        default=None, pattern=MODEL_SOURCE, max_length=512,
        description="Tokenizer location (same URL forms as source); defaults to the checkpoint directory itself.")
    quantization: Literal["none", "auto", "int8", "w8a8", "fp8", "awq", "gptq", "compressed-tensors",
                          "modelopt"] = Field(
        default="none",
        description=("Quantize the decoder's linear weights when the engine loads the checkpoint (bf16/fp32 "
                     "on disk), one scale per output channel: `int8` (int8 weights, each layer's input rounded "
                     "per row to 16-bit integers, CPU; the LM head too), `w8a8` (int8 weights and 8-bit "
                     "activations, CPU), `fp8` (e4m3 weights and activations, GPUs "
                     "of compute capability 8.9 or newer). A pre-quantized checkpoint (AWQ or GPTQ int4, "
                     "compressed-tensors W4A16, W8A16, W8A8 or NVFP4, ModelOpt NVFP4, named by its config.json's "
                     "quantization_config) loads with `none`, `auto` or its own format's name (`awq`, `gptq`, "
                     "`compressed-tensors`, `modelopt`; the engine refuses to start when the checkpoint is "
                     "another); on CPU its linears multiply "
                     "their codes with one scale per group in the engine's integer kernels (a quarter of the "
                     "fp32 weight's memory), elsewhere they are dequantized to the dtype. An FP8 checkpoint "
                     "(compressed-tensors float-quantized, ModelOpt FP8, or transformers' block-scaled `fp8`) "
                     "loads with `none`, `auto` or its format's name, its weights decoded to the dtype, or with "
                     "`fp8` (GPUs) rounded "
                     "to e4m3 per row again. LoRA adapters stay in full precision."))

    _no_parent = field_validator("source", "tokenizer")(no_pvc_parent)


class GpuResources(Model):
    gpus: int = Field(default=1, ge=0, le=16, description="GPUs per engine replica (requests = limits). 0 runs the engine on CPU.")
    gpu_resource_name: str = Field(default="nvidia.com/gpu", max_length=253,
                                   pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$",
                                   description="Extended resource name of the accelerator (device plugin).")
    cpu: Quantity = Field(default="4", description="CPU request per replica (limit is not set: CPU throttling hurts decode latency).")
    memory: Quantity = Field(default="32Gi", description="Memory request and limit per replica (host RAM: weights staging, tokenizer, HTTP).")
    ephemeral_storage: Quantity | None = Field(default=None, description="Ephemeral storage request (the hf:// download lands in an emptyDir).")


class KVTier(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("!has(self.claim) || self.kind == 'disk'", "kv.tier.claim needs kind: disk", field_path=".claim"),
    ]}}

    kind: Literal["memory", "disk"] = Field(description="Where the engine keeps the KV blocks its pool evicts: memory (host memory, lost with the process; the GPU case) or disk (a directory: blocks survive restarts, and replicas sharing a claim share prefills).")
    size: Quantity = Field(default="4Gi", description="Bound of the tier per replica (least recently used blocks out first). memory: taken from the pod's memory, so leave room in resources.memory; disk without a claim: also the emptyDir's sizeLimit.")
    claim: DnsLabel | None = Field(default=None, description="disk: a PersistentVolumeClaim in the same namespace mounted as the tier directory (ReadWriteMany for several replicas to share it). Unset: an emptyDir of `size` per pod (kept across engine restarts in the pod, lost with the pod).")

    @model_validator(mode="after")
    def _claim_is_disk(self) -> "KVTier":   # mirrors the CEL rule above
        if self.claim is not None and self.kind != "disk":
            raise ValueError("kv.tier.claim needs kind: disk")
        return self


class KVCache(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("!(has(self.memoryFraction) && has(self.numBlocks))",
            "set at most one of kv.memoryFraction and kv.numBlocks"),
    ]}}

    block_size: Literal[8, 16, 32, 256] | None = Field(default=None, description="Tokens per KV block: 8 for prefix-heavy specialists (Template, STL), 32 for long generations, 256 for flash-attn's in-place paged KV. Unset: 256 when the specialist requests GPUs, 16 on CPU.")
    memory_fraction: float | None = Field(default=None, ge=0.05, le=0.98,
                                          description="Share of the memory left after the weights and an activation reserve that the KV pool takes (GPU: free device memory; CPU: the node's available memory capped by the pod's memory limit). Sized once at start; the pool never grows. Default: the engine's own (0.5 on CPU, 0.9 on GPU).")
    num_blocks: int | None = Field(default=None, ge=1, le=10_000_000, description="Exact KV pool size in blocks (overrides memoryFraction sizing).")
    prefix_caching: bool = Field(default=True, description="Reuse KV blocks across requests sharing a prefix (key: specialist, adapter, token-prefix hash).")
    dtype: Literal["auto", "bfloat16", "fp8"] = Field(default="auto", description="Element of the KV pool: auto = the model's dtype; `bfloat16` (a float32 model's pool in half the memory) or `fp8` (float8 e4m3, unscaled, saturating at +-448: half a bfloat16 pool), so decode attention reads half the bytes and the pool holds twice the tokens, for a small loss of fidelity (docs/kv-cache.md). On GPUs a narrower pool is read by the engine's Triton kernel instead of flash-attn, and fp8 needs compute capability 8.9 or newer (the engine refuses to start otherwise).")
    tier: KVTier | None = Field(default=None, description="A KV tier below the pool (docs/kv-cache.md): evicted prefix blocks are kept there and read back instead of recomputed. Unset: no tier.")

    @model_validator(mode="after")
    def _one_sizing(self) -> "KVCache":   # mirrors the CEL rule above
        if self.memory_fraction is not None and self.num_blocks is not None:
            raise ValueError("set at most one of kv.memoryFraction and kv.numBlocks")
        return self


class SchedulerKnobs(Model):
    max_num_seqs: int = Field(default=128, ge=1, le=4096, description="Maximum running sequences per engine step.")
    max_num_batched_tokens: int = Field(default=2048, ge=16, le=1_048_576, description="Token budget per step (decode tokens plus chunked-prefill tokens).")
    max_waiting: int = Field(default=1024, ge=1, le=1_000_000, description="Waiting-queue bound; beyond it requests get 429 queue_full.")


class Adapter(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [pvc_parent_rule("source")]}}

    name: DnsLabel = Field(description="Adapter name; clients select it with the `adapter` request field, metrics carry it as a label.")
    source: str = Field(description="PEFT LoRA directory (adapter_config.json + adapter_model.safetensors): pvc://, file:// or hf:// as for the model, or `demo://lora[?seed=N]` (a random LoRA for a demo:// model, written by an init container: demos and tests).",
                        pattern=ADAPTER_SOURCE, max_length=512)

    _no_parent = field_validator("source")(no_pvc_parent)


class RolloutPolicy(Model):
    probation_samples: int = Field(default=200, ge=1, le=1_000_000, description="Correctness samples a new adapter must collect before promotion or rollback is decided.")
    probation_window: str = Field(default="1h", pattern=DURATION, description="Maximum probation duration (Go duration, e.g. 30m, 1h); when it ends with too few samples the adapter is promoted only if its rate clears the floor.")
    shadow_fraction: float = Field(default=0.25, ge=0.0, le=1.0, description="Fraction of a probation adapter's traffic the router also shadows on the active adapter.")
    promotion_floor: float = Field(default=0.9, ge=0.0, le=1.0, description="Minimum correctness rate (compile-pass rate) for promotion; below it the adapter is rolled back.")

    @property
    def probation_window_seconds(self) -> float:
        return duration_seconds(self.probation_window)


class Speculative(Model):
    mode: Literal["off", "ngram", "mtp"] = Field(default="off", description="Self-drafting speculative decoding: off, ngram (prompt lookup) or mtp (the checkpoint's multi-token-prediction head; engines without one draft with ngram and report state fallback). Requests without logprobs speculate: greedy ones with output exactly one-token decoding's, sampled ones by typical acceptance (typicalTau).")
    num_tokens: int = Field(default=3, ge=1, le=8, description="Draft tokens proposed per step (K); admission reserves KV for the whole window.")
    typical_tau: float = Field(default=0.1, ge=0.0, le=1.0, description="Typical-acceptance tau for sampled (temperature > 0) requests; 0 = only greedy requests speculate.")
    policy: Literal["goodput", "always"] = Field(default="goodput", description="goodput: each engine step drafts only where the expected tokens per second gain, from each sequence's measured acceptance and the step cost the engine measures at start-up (drafts stop for sequences whose drafts fail once rows cost, e.g. at large batches on a CPU); always: every eligible decode drafts numTokens.")


class Slo(Model):
    ttft_ms: int = Field(default=1000, ge=1, le=600_000, description="Time-to-first-token target (p95), milliseconds.")
    itl_ms: int = Field(default=100, ge=1, le=60_000, description="Inter-token latency target (p95), milliseconds.")
    correctness_floor: float = Field(default=0.8, ge=0.0, le=1.0, description="Rolling correctness (C++ compile-pass) rate below which the router's breaker demotes this specialist to shadow-only.")
    window: str = Field(default="24h", pattern=DURATION, description="Rolling window of the correctness rate (Go duration, e.g. 24h, 30m).")

    @property
    def window_seconds(self) -> float:
        return duration_seconds(self.window)


# int8 and w8a8 are CPU kernels, fp8 a GPU one (model/models/quant.py in the engine); int4 checkpoints load on either
QUANTIZATION_RULE = ("!has(self.model.quantization) || !(self.model.quantization in ['int8', 'w8a8', 'fp8']) || "
                     "((self.model.quantization == 'fp8') == (!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus > 0))")
LOAD_TIME_QUANTIZATIONS = ("int8", "w8a8", "fp8")
QUANTIZATION_MESSAGE = "model.quantization fp8 needs resources.gpus > 0; int8 and w8a8 run on CPU engines (gpus 0)"


class ScaleToZero(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("duration(self.idleAfter) >= duration('5s')", "scaleToZero.idleAfter must be at least 5s",
            field_path=".idleAfter"),
    ]}}

    idle_after: str = Field(default="15m", pattern=DURATION, max_length=32, description="How long every replica must have served no request before the operator scales the Specialist to zero replicas (through its /scale subresource). Go duration, at least 5s.")
    while_cold: Literal["hold", "fallback"] = Field(default="hold", description="What the router does with a request for this Specialist while it has no warm replica: hold it until the first replica turns warm (up to holdTimeoutSeconds), or send it to the Specialist's fallback (which must be set) while the replica starts.")
    max_held: int = Field(default=64, ge=1, le=10_000, description="Requests a router holds at once for this Specialist while it starts; beyond it a request gets 503 cold_start_queue_full with Retry-After.")
    hold_timeout_seconds: int = Field(default=60, ge=1, le=3600, description="How long a held request waits for a warm replica (never beyond the router's request timeout); then 503 cold_start_timeout with Retry-After.")

    @property
    def idle_after_seconds(self) -> float:
        return duration_seconds(self.idle_after)

    @model_validator(mode="after")
    def _min_idle(self) -> "ScaleToZero":   # mirrors the CEL rule above
        if self.idle_after_seconds < 5:
            raise ValueError("scaleToZero.idleAfter must be at least 5s")
        return self


class SpecialistSpec(Model):
    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": [
        cel("!has(self.minReady) || !has(self.replicas) || self.minReady <= self.replicas || (self.replicas == 0 && has(self.scaleToZero))",
            "minReady must not exceed replicas", field_path=".minReady"),
        cel("!has(self.scaleToZero) || self.scaleToZero.whileCold != 'fallback' || has(self.fallback)",
            "scaleToZero.whileCold: fallback needs spec.fallback", field_path=".scaleToZero.whileCold"),
        cel("!has(self.tensorParallelSize) || self.tensorParallelSize == 1 || !has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0 || self.resources.gpus == self.tensorParallelSize",
            "resources.gpus must equal tensorParallelSize (one GPU per rank), or be 0 (CPU ranks)", field_path=".tensorParallelSize"),
        cel("!has(self.tensorParallelSize) || self.tensorParallelSize == 1 || !has(self.adapters) || size(self.adapters) == 0",
            "LoRA adapters are not supported with tensorParallelSize > 1 yet", field_path=".tensorParallelSize"),
        cel(QUANTIZATION_RULE, QUANTIZATION_MESSAGE, field_path=".model.quantization"),
    ]}}

    model: ModelSource = Field(description="Checkpoint and tokenizer of this specialist (a Hugging Face checkpoint of a supported architecture: Llama, Mistral, Qwen2, Qwen3, or Bamba, hybrid attention + Mamba2).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(default="auto", description="Weight/activation dtype: auto = bfloat16 on GPU; on CPU, a bfloat16 checkpoint "
                                                                         "stays bfloat16 where the CPU has AMX or AVX-512 BF16, anything else float32.")
    max_context: int | None = Field(default=None, ge=128, le=1_048_576, description="Maximum tokens per sequence (prompt + output); default: the checkpoint's max_position_embeddings.")
    replicas: int = Field(default=1, ge=0, le=1000, description="Desired engine replicas (pods).")
    min_ready: int = Field(default=1, ge=0, le=1000, description="Replicas that must report warm before the Specialist is Ready (also the PodDisruptionBudget's minAvailable).")
    resources: GpuResources = Field(default_factory=GpuResources, json_schema_extra={"default": {}}, description="Accelerator, CPU and memory per replica.")
    tensor_parallel_size: int = Field(default=1, ge=1, le=16, description="Ranks each replica splits the model over (attention heads and MLP; NCCL on GPUs, one GPU per rank, so resources.gpus must equal it; gloo on CPU, the replica's CPUs shared among the ranks). Must divide the checkpoint's attention heads, KV heads and intermediate size.")
    node_selector: dict[str, str] | None = Field(default=None, description="Node labels engine pods must match (e.g. a GPU product label).")
    tolerations: list[Toleration] | None = Field(default=None, description="Tolerations for engine pods (a toleration for the GPU resource taint is added automatically when gpus > 0).")
    image: str | None = Field(default=None, min_length=1, max_length=512, description="Engine image override; default: the operator's --engine-image. Must start with one of the operator's allowed image prefixes (--allowed-image; the --engine-image and --router-image repositories are always allowed), or the Specialist is refused (Ready False, reason ImageNotAllowed).")
    enforce_eager: bool = Field(default=False, description="GPU engines: run every step eagerly instead of replaying the decode CUDA graphs captured at warm-up (vLLM's --enforce-eager; a faster start and less GPU memory, slower decode). No effect on CPU engines, which never capture.")
    kv: KVCache = Field(default_factory=KVCache, json_schema_extra={"default": {}}, description="Paged KV-cache layout of this specialist's engine (one pool per replica).")
    scheduler: SchedulerKnobs = Field(default_factory=SchedulerKnobs, json_schema_extra={"default": {}}, description="Per-engine continuous-batching scheduler limits.")
    adapters: list[Adapter] | None = Field(default=None, max_length=64, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
                                           description="LoRA adapters served by this specialist; a newly listed adapter goes through probation before it becomes active.")
    max_adapters: int = Field(default=4, ge=1, le=64, description="Adapters resident at once per engine.")
    rollout: RolloutPolicy = Field(default_factory=RolloutPolicy, json_schema_extra={"default": {}}, description="How new adapters are promoted or rolled back.")
    speculative: Speculative = Field(default_factory=Speculative, json_schema_extra={"default": {}}, description="Speculative decoding (self-drafting).")
    slo: Slo = Field(default_factory=Slo, json_schema_extra={"default": {}}, description="Published per-specialist objectives; the correctness floor drives the router's breaker.")
    warmup_timeout_seconds: int = Field(default=900, ge=10, le=86_400, description="How long a replica may take from container start to warm (weights loaded, shapes compiled); sizes the startupProbe. A replica still cold after it is restarted and the Specialist reports WarmupTimeout.")
    intents: list[DnsLabel] | None = Field(default=None, max_length=64, json_schema_extra={"x-kubernetes-list-type": "set"},
                                           description="Request intents this specialist serves as primary (e.g. codegen, debug, build-fix, review).")
    fallback: DnsLabel | None = Field(default=None, description="Specialist that takes primary traffic for these intents while this one's breaker is open; must not be this Specialist.")
    port: int = Field(default=8000, ge=1024, le=65535, description="Engine HTTP port inside the pod.")
    scale_to_zero: ScaleToZero | None = Field(default=None, description="Scale to zero replicas when idle, and back to one on the next request (the router holds requests meanwhile). Unset: the Specialist keeps its replicas. With it set, replicas may be 0 whatever minReady says: the operator writes 0 after idleAfter without requests, the router writes 1 when a request arrives.")

    @model_validator(mode="after")
    def _min_ready(self) -> "SpecialistSpec":   # mirrors the CEL rules above
        if self.min_ready > self.replicas and not (self.replicas == 0 and self.scale_to_zero is not None):
            raise ValueError("minReady must not exceed replicas")
        if self.scale_to_zero is not None and self.scale_to_zero.while_cold == "fallback" and self.fallback is None:
            raise ValueError("scaleToZero.whileCold: fallback needs spec.fallback")
        if self.tensor_parallel_size > 1:
            if self.resources.gpus not in (0, self.tensor_parallel_size):
                raise ValueError("resources.gpus must equal tensorParallelSize (one GPU per rank), or be 0 (CPU ranks)")
            if self.adapters:
                raise ValueError("LoRA adapters are not supported with tensorParallelSize > 1 yet")
        if self.model.quantization in LOAD_TIME_QUANTIZATIONS and (self.model.quantization == "fp8") != (self.resources.gpus > 0):
            raise ValueError(QUANTIZATION_MESSAGE)
        return self

    def adapter_names(self) -> list[str]:
        return [a.name for a in self.adapters or []]


# ---- status ------------------------------------------------------------------------------------

AdapterState = Literal["Loading", "Probation", "Active", "RolledBack", "Retired"]
Phase = Literal["Pending", "Warming", "Ready", "Degraded", "Failed", "Idle"]
BreakerState = Literal["Closed", "Open", "HalfOpen"]


class AdapterReplicaStatus(Model):
    pod: str = Field(description="The engine pod.")
    state: Literal["loaded", "pending", "failed", "unknown"] = Field(
        description="The engine's report: loaded, pending (hot-load not done yet), failed, or unknown (warm by pod readiness only, not probed).")
    message: str | None = Field(default=None, description="Why the hot-load failed.")


class AdapterStatus(Model):
    name: str = Field(description="Adapter name.")
    state: AdapterState = Field(description="Loading (not yet on every warm replica), Probation (collecting samples), Active, RolledBack (failed the floor) or Retired (removed from spec).")
    since: str = Field(description="RFC 3339 time of the last state change.")
    source: str | None = Field(default=None, description="The adapter source this state refers to (a new source restarts the rollout).")
    loaded_replicas: int = Field(default=0, description="Warm replicas that report the adapter loaded.")
    replicas: list[AdapterReplicaStatus] | None = Field(
        default=None, description="Per warm replica: the hot-load's progress (engines follow the adapters ConfigMap; no pod restarts).")
    samples: int = Field(default=0, description="Correctness samples in the probation window.")
    passes: int = Field(default=0, description="Passing samples in the probation window.")
    rate: float | None = Field(default=None, description="passes / samples when samples > 0.")
    message: str = Field(default="", description="Why the adapter is in this state.")


class BreakerStatus(Model):
    state: BreakerState = Field(description="Closed (serving as primary), Open (demoted to shadow-only) or HalfOpen (recovering).")
    rate: float | None = Field(default=None, description="Rolling correctness rate the router last reported.")
    samples: int = Field(default=0, description="Samples in the rolling window.")
    since: str | None = Field(default=None, description="RFC 3339 time of the last state change.")
    fallback: str | None = Field(default=None, description="Specialist taking primary traffic while Open.")


class ReplicaStatus(Model):
    pod: str = Field(description="Pod name.")
    warm: bool = Field(description="Whether the replica reports warm.")
    source: Literal["engine", "pod-ready", "none"] = Field(description="Where the warm signal came from: the engine's /ready, the pod's Ready condition (fallback), or none (unreachable).")


class SloObjectiveStatus(Model):
    target_ms: int = Field(description="The objective (p95 target) the replicas judged against, milliseconds.")
    requests: int = Field(default=0, description="Recent requests judged on the warm replicas.")
    attainment: float | None = Field(default=None, description="Share of those requests that met the target; the objective is met at >= 0.95.")


class SloStatus(Model):
    ttft: SloObjectiveStatus | None = Field(default=None, description="Time to first token.")
    itl: SloObjectiveStatus | None = Field(default=None, description="Inter-token latency (each request's own p95 gap).")


class SpeculationStatus(Model):
    drafter: Literal["ngram", "mtp"] | None = Field(default=None, description="What drafts on the warm replicas: ngram (prompt lookup) or mtp (the checkpoint's MTP block).")
    state: Literal["on", "off", "fallback"] | None = Field(default=None, description="on; fallback when mtp was asked for and a replica drafts with ngram (no MTP block in the checkpoint); off.")
    draft_tokens: int = Field(default=0, description="Draft tokens proposed on the warm replicas since they started.")
    accepted_tokens: int = Field(default=0, description="Of those, accepted by verification.")
    acceptance_rate: float | None = Field(default=None, description="accepted / draft tokens, when any were drafted.")


class SpecialistStatus(Model):
    observed_generation: int | None = Field(default=None, description="metadata.generation this status reflects.")
    phase: Phase | None = Field(default=None, description="Pending (no replica running), Warming (fewer than minReady warm), Ready, Degraded (was Ready, fell below minReady), Failed (warmup timed out or pods crash) or Idle (scaled to zero by scaleToZero; the next request starts a replica).")
    replicas: int = Field(default=0, description="Engine pods that exist (not terminating).")
    desired_replicas: int = Field(default=0, description="spec.replicas as last reconciled.")
    ready_replicas: int = Field(default=0, description="Pods whose Ready condition is True.")
    warm_replicas: int = Field(default=0, description="Replicas that report warm (the routing table only holds warm replicas).")
    updated_replicas: int = Field(default=0, description="Pods running the current pod template.")
    ready: str | None = Field(default=None, description="warm/desired, for `kubectl get`.")
    selector: str | None = Field(default=None, description="Label selector of the engine pods (scale subresource).")
    active_adapter: str | None = Field(default=None, description="The most recently promoted Active adapter.")
    adapters: list[AdapterStatus] | None = Field(default=None, description="Per-adapter rollout state.")
    breaker: BreakerStatus | None = Field(default=None, description="Circuit-breaker state as decided by the router, made durable here.")
    replica_status: list[ReplicaStatus] | None = Field(default=None, description="Warm state per replica.")
    slo: SloStatus | None = Field(default=None, description="Attainment of spec.slo's latency objectives, pooled from the warm replicas' recent requests.")
    speculation: SpeculationStatus | None = Field(default=None, description="Speculative decoding on the warm replicas (absent when spec.speculative.mode is off): drafter and acceptance, pooled.")
    conditions: list[Condition] | None = Field(default=None, description="Ready, Warm, AdapterRollout, Demoted and SLOMet.")
