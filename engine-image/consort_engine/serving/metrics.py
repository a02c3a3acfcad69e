"""Prometheus metrics with vLLM's names (dashboards and benchmark tools work unchanged), consort_* for the rest.

Each app gets its own registry. Engine-wide gauges and counters are read from the engine thread's
latest stats snapshot at scrape time; per-request histograms are observed by the server.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets, so histograms line up with existing dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

REQUEST_LABELS = ("model_name", "specialist", "adapter")
ENGINE_LABELS = ("model_name", "specialist")


SLO_WINDOW = 1000           # recent finished requests the attainment is computed over
SLO_QUANTILE = 0.95         # targets are p95: an objective is met while >= 95% of requests meet it


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile (of a request's inter-token gaps)."""
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * 95 // 100) - 1)]


@dataclass
class SloTracker:
    """Per-request judgement against the specialist's published objectives (p95 targets).

    A request meets the TTFT objective when its first token came within the target, and the ITL
    objective when the 95th percentile of its own inter-token gaps is within the target (requests
    with fewer than two output tokens have no ITL). Attainment is over the last SLO_WINDOW requests."""
    ttft_s: float | None
    itl_s: float | None
    ttft: deque = field(default_factory=lambda: deque(maxlen=SLO_WINDOW))
    itl: deque = field(default_factory=lambda: deque(maxlen=SLO_WINDOW))

    def judge(self, ttft: float | None, itls: list[float]) -> dict[str, bool]:
        """{objective: met} for the objectives this request can be judged on; records them."""
        verdict = {}
        if self.ttft_s is not None and ttft is not None:
            verdict["ttft"] = ttft <= self.ttft_s
            self.ttft.append(verdict["ttft"])
        if self.itl_s is not None and itls:
            verdict["itl"] = p95(itls) <= self.itl_s
            self.itl.append(verdict["itl"])
        return verdict

    def summary(self) -> dict:
        out: dict = {"quantile": SLO_QUANTILE, "window": SLO_WINDOW}
        for name, target, window in (("ttft", self.ttft_s, self.ttft), ("itl", self.itl_s, self.itl)):
            if target is None:
                continue
            n = len(window)
            attained = sum(window) / n if n else None
            out[name] = {"target_ms": round(target * 1000), "requests": n, "attainment": attained,
                         "met": None if attained is None else attained >= SLO_QUANTILE}
        return out


class _EngineStatsCollector:
    """Gauges and cumulative counters taken from the engine's stats snapshot when scraped."""

    def __init__(self, stats: Callable[[], dict], labels: tuple[str, str]):
        self.stats = stats
        self.labels = list(labels)

    def describe(self):
        return []

    def collect(self):
        s = self.stats()
        gauges = (("vllm:num_requests_running", "Running sequences (hold KV blocks)", s.get("running", 0)),
                  ("vllm:num_requests_waiting", "Waiting sequences", s.get("waiting", 0)),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", s.get("kv_usage", 0.0)),
                  ("consort_kv_free_blocks", "Free KV blocks (including evictable cached blocks)",
                   s.get("kv_free_blocks", 0)),
                  ("consort_kv_cached_blocks", "KV blocks holding reusable prefix-cache content",
                   s.get("kv_cached_blocks", 0)),
                  ("consort_preempting", "1 while the scheduler is preempting", int(bool(s.get("preempting")))),
                  ("consort_warm", "1 once warmup finished and the engine serves", int(bool(s.get("warm")))),
                  ("consort_kv_tier_enabled", "1 while the KV tier below the pool is on (0: off, or turned off "
                   "after a disk failure or a slow write)", int(bool(s.get("kv_tier_enabled")))),
                  ("consort_kv_tier_bytes", "Bytes of KV blocks this engine keeps in its tier", s.get("kv_tier_bytes", 0)),
                  ("consort_kv_tier_blocks", "KV blocks this engine keeps in its tier", s.get("kv_tier_blocks", 0)),
                  ("consort_kv_events_seq", "Sequence number of the latest block event", s.get("kv_events_seq", 0)),
                  ("consort_kv_events_lag", "Events the last caught-up subscriber of /v1/kv/events was behind",
                   s.get("kv_events_lag", 0)))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=ENGINE_LABELS)
            g.add_metric(self.labels, float(value or 0))
            yield g
        counters = (("vllm:num_preemptions", "Cumulative preemptions", s.get("num_preemptions", 0)),
                    ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens", s.get("prefix_cache_queries", 0)),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", s.get("prefix_cache_hits", 0)),
                    ("vllm:external_prefix_cache_queries", "KV-tier queries (prompt tokens past the pool's hits), "
                     "in tokens", s.get("tier_cache_queries", 0)),
                    ("vllm:external_prefix_cache_hits", "KV-tier hits (tokens loaded instead of recomputed)",
                     s.get("tier_cache_hits", 0)),
                    ("consort_kv_tier_lookups_hit", "KV-tier block reads that found a valid block", s.get("kv_tier_hits", 0)),
                    ("consort_kv_tier_lookups_missed", "KV-tier block reads that found none", s.get("kv_tier_misses", 0)),
                    ("consort_kv_tier_rejected_blocks", "KV-tier blocks refused: torn, corrupted or another "
                     "model's or layout's", s.get("kv_tier_rejected", 0)),
                    ("consort_kv_tier_written_blocks", "KV blocks written to the tier", s.get("kv_tier_written", 0)),
                    ("consort_kv_tier_dropped_writes", "KV blocks not written: the tier's writer was behind",
                     s.get("kv_tier_dropped_writes", 0)),
                    ("consort_kv_tier_evicted_blocks", "KV blocks dropped from the tier by its byte bound",
                     s.get("kv_tier_evicted", 0)),
                    ("consort_kv_tier_load_seconds", "Seconds spent reading blocks found in the tier (divide by "
                     "consort_kv_tier_lookups_hit for the mean load latency)", s.get("kv_tier_load_seconds", 0.0)),
                    ("consort_kv_event_snapshots", "Snapshots served to /v1/kv/events subscribers that could not "
                     "catch up from the event ring", s.get("kv_events_snapshots", 0)),
                    ("vllm:spec_decode_num_drafts", "Verify windows (draft runs) verified",
                     (s.get("speculation") or {}).get("drafts", 0)),
                    ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed for verification",
                     (s.get("speculation") or {}).get("draft_tokens", 0)),
                    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification",
                     (s.get("speculation") or {}).get("accepted_tokens", 0)),
                    ("consort_spec_decode_held_decodes", "Decodes that could have drafted and did not: the draft "
                     "policy (goodput) expected the drafts to cost more than they add",
                     (s.get("speculation") or {}).get("held_decodes", 0)))
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=ENGINE_LABELS)
            c.add_metric(self.labels, float(value or 0))
            yield c


class EngineMetrics:
    def __init__(self, model_name: str, specialist: str, stats: Callable[[], dict], slo: SloTracker | None = None):
        self.slo = slo or SloTracker(None, None)
        self.model_name = model_name
        self.specialist = specialist
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        L = REQUEST_LABELS
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Request arrival to first output token",
                              L, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                             L, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request arrival to last output token",
                             L, buckets=E2E_BUCKETS, registry=r)
        self.admission_ttft = Histogram("consort_admission_to_first_token_seconds",
                                        "Admission by the scheduler to first output token",
                                        L, buckets=TTFT_BUCKETS, registry=r)
        # The request phases and sizes vLLM's Grafana dashboard reads, under vLLM's names and buckets
        # (its request phases share the e2e latency buckets).
        def request_histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"vllm:request_{name}", doc, L, buckets=buckets, registry=r)

        self.queue_time = request_histogram("queue_time_seconds", "Arrival to first scheduled (waiting)", E2E_BUCKETS)
        self.prefill_time = request_histogram("prefill_time_seconds", "First scheduled to first output token",
                                              E2E_BUCKETS)
        self.decode_time = request_histogram("decode_time_seconds", "First to last output token", E2E_BUCKETS)
        self.inference_time = request_histogram("inference_time_seconds", "First scheduled to last output token",
                                                E2E_BUCKETS)
        self.tpot = request_histogram("time_per_output_token_seconds", "Mean gap between a request's output tokens",
                                      ITL_BUCKETS)
        self.request_prompt_tokens = request_histogram("prompt_tokens", "Prompt tokens per finished request",
                                                       TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = request_histogram("generation_tokens", "Generated tokens per finished request",
                                                           TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", L, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", L, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                       L + ("finished_reason",), registry=r)
        self.preempted_once = Counter("consort_requests_preempted_once",
                                      "Requests preempted at least once before finishing", L, registry=r)
        self.aborted = Counter("consort_requests_aborted", "Admitted requests ended early: client gone or error",
                               L, registry=r)
        self.rejected = Counter("consort_admission_rejected", "Requests refused at admission (429)",
                                L + ("code",), registry=r)
        self.bad_requests = Counter("consort_invalid_requests", "Requests refused as invalid (4xx)",
                                    ENGINE_LABELS + ("code",), registry=r)
        self.deadline_requests = Counter("consort_deadline_requests", "Finished requests that carried deadline_ms: "
                                         "first token in time (met) or late (missed)", L + ("result",), registry=r)
        self.slo_requests = Counter("consort_slo_requests", "Finished requests judged against each published "
                                    "objective (p95 target)", ENGINE_LABELS + ("objective", "result"), registry=r)
        slo_target = Gauge("consort_slo_target_seconds", "Published objective (p95 target) per specialist",
                           ENGINE_LABELS + ("objective",), registry=r)
        for objective, target in (("ttft", self.slo.ttft_s), ("itl", self.slo.itl_s)):
            if target is not None:
                slo_target.labels(model_name, specialist, objective).set(target)
        r.register(_EngineStatsCollector(stats, (model_name, specialist)))

    def labels(self, adapter: str | None) -> tuple[str, str, str]:
        return (self.model_name, self.specialist, adapter or "none")

    def observe_rejected(self, adapter: str | None, code: str) -> None:
        self.rejected.labels(*self.labels(adapter), code).inc()

    def observe_invalid(self, code: str) -> None:
        self.bad_requests.labels(self.model_name, self.specialist, code).inc()

    def observe_aborted(self, adapter: str | None, *, prompt_tokens: int, output_tokens: int) -> None:
        """Work done for a request that did not finish still counts in the token totals (as in vLLM,
        which counts per step), so the counters measure what the engine computed."""
        lab = self.labels(adapter)
        self.prompt_tokens.labels(*lab).inc(prompt_tokens)
        self.generation_tokens.labels(*lab).inc(output_tokens)
        self.aborted.labels(*lab).inc()

    def observe_finished(self, adapter: str | None, *, prompt_tokens: int, output_tokens: int,
                         ttft: float | None, admission_ttft: float | None, itls: list[float], e2e: float,
                         finish_reason: str, preempted: bool, deadline_missed: bool | None = None) -> None:
        lab = self.labels(adapter)
        if deadline_missed is not None:
            self.deadline_requests.labels(*lab, "missed" if deadline_missed else "met").inc()
        self.prompt_tokens.labels(*lab).inc(prompt_tokens)
        self.generation_tokens.labels(*lab).inc(output_tokens)
        self.request_prompt_tokens.labels(*lab).observe(prompt_tokens)
        self.request_generation_tokens.labels(*lab).observe(output_tokens)
        decode = sum(itls)                              # first to last output token
        if ttft is not None:
            self.ttft.labels(*lab).observe(ttft)
            self.decode_time.labels(*lab).observe(decode)
        if itls:
            self.tpot.labels(*lab).observe(decode / len(itls))
        if admission_ttft is not None:
            self.admission_ttft.labels(*lab).observe(admission_ttft)
            self.prefill_time.labels(*lab).observe(admission_ttft)
            self.inference_time.labels(*lab).observe(admission_ttft + decode)
            if ttft is not None:
                self.queue_time.labels(*lab).observe(max(0.0, ttft - admission_ttft))
        h = self.itl.labels(*lab)
        for x in itls:
            h.observe(x)
        self.e2e.labels(*lab).observe(e2e)
        self.request_success.labels(*lab, finish_reason).inc()
        for objective, met in self.slo.judge(ttft, itls).items():
            self.slo_requests.labels(self.model_name, self.specialist, objective, "met" if met else "missed").inc()
        if preempted:
            self.preempted_once.labels(*lab).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
