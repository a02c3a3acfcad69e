"""Router metrics (`consort_router_*`), one registry per router process."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # no *_created series

LATENCY_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("consort_router_requests", "Requests by routed specialist, intent, source and status.",
                                ["specialist", "intent", "source", "code"], registry=r)
        self.tenant_requests = Counter("consort_router_tenant_requests",
                                       "Generation requests by tenant (the first tenants.metric_tenants names; the "
                                       "rest `other`) and status.", ["tenant", "code"], registry=r)
        self.rejections = Counter("consort_router_rejections", "Requests the router answered with an error itself.",
                                  ["code"], registry=r)
        self.upstream_429 = Counter("consort_router_upstream_429", "Engine 429s passed through.",
                                    ["specialist", "code"], registry=r)
        self.retries = Counter("consort_router_retries", "Pre-first-byte retries on another replica.",
                               ["specialist", "reason"], registry=r)
        self.stream_errors = Counter("consort_router_stream_errors", "Streams ended by an upstream failure.",
                                     ["specialist"], registry=r)
        self.disconnects = Counter("consort_router_client_disconnects", "Client disconnects propagated upstream.",
                                   ["specialist"], registry=r)
        self.shadows = Counter("consort_router_shadow", "Shadow copies by target and outcome.",
                               ["specialist", "reason", "outcome"], registry=r)
        self.calibration = Counter("consort_router_calibration_records", "Disagreement records written.",
                                   ["primary", "shadow"], registry=r)
        self.verifier = Counter("consort_router_verifier_runs", "Verified responses by result.",
                                ["specialist", "result"], registry=r)
        self.feedback = Counter("consort_router_feedback", "External correctness signals.", ["specialist"],
                                registry=r)
        self.breaker_state = Gauge("consort_router_breaker_state", "0 closed, 1 half_open, 2 open.",
                                   ["specialist"], registry=r)
        self.breaker_rate = Gauge("consort_router_breaker_rate", "Rolling correctness rate (-1 with no samples).",
                                  ["specialist"], registry=r)
        self.breaker_samples = Gauge("consort_router_breaker_samples", "Samples in the window.", ["specialist"],
                                     registry=r)
        self.breaker_transitions = Counter("consort_router_breaker_transitions", "Breaker transitions.",
                                           ["specialist", "to"], registry=r)
        self.admission_level = Gauge("consort_router_admission_level", "Escalation level per specialist.",
                                     ["specialist"], registry=r)
        self.shadow_threshold_delta = Gauge("consort_router_shadow_threshold_delta",
                                            "How much the specialist's shadow thresholds are lowered.",
                                            ["specialist"], registry=r)
        self.priority_floor = Gauge("consort_router_priority_floor", "Priority floor per intent (absent: none).",
                                    ["intent"], registry=r)
        self.replica_ready = Gauge("consort_router_replica_ready", "1 if the replica is ready.",
                                   ["specialist", "replica"], registry=r)
        self.replica_load = Gauge("consort_router_replica_queue_depth", "Polled waiting + running.",
                                  ["specialist", "replica"], registry=r)
        self.kv_snapshots = Counter("consort_router_kv_snapshots", "Block-event snapshots taken from engines "
                                    "(first contact, engine restart, or a subscriber that fell behind the ring).",
                                    registry=r)
        self.kv_events = Counter("consort_router_kv_events", "Engine block events applied to the router's view.",
                                 registry=r)
        self.kv_lag = Gauge("consort_router_kv_lag_seconds", "Seconds since the stalest replica view of block "
                            "events last heard from its engine (up to kv_events_wait_s while the engine is quiet).", registry=r)
        self.replica_choice = Counter("consort_router_replica_choice",
                                      "Replica choices by outcome: affine (sent where its prefix is cached), spill "
                                      "(its prefix is on a replica too loaded), cold (cached nowhere), least_loaded "
                                      "(affinity off or prompt shorter than a block).",
                                      ["specialist", "outcome"], registry=r)
        self.detector_timeouts = Counter("consort_router_detector_timeouts",
                                         "Searches of an EnsembleRouter's own detector patterns cut off at their "
                                         "deadline (counted as no match).", registry=r)
        self.routing_seconds = Histogram("consort_router_routing_seconds", "Time to the routing decision.",
                                         registry=r, buckets=LATENCY_BUCKETS)
        self.overhead = Histogram("consort_router_overhead_seconds",
                                  "Router time per request outside the engine: arrival to upstream send, plus "
                                  "relaying the first chunk.", registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("consort_router_time_to_first_byte_seconds", "Request arrival to first upstream byte.",
                              ["specialist"], registry=r, buckets=LATENCY_BUCKETS)
        self.config_reloads = Counter("consort_router_config_reloads", "Config reloads by result.", ["result"],
                                      registry=r)
        self.discovery_relists = Counter("consort_router_discovery_relists",
                                         "EndpointSlice re-lists, by what started them (watch event or interval).",
                                         ["trigger"], registry=r)
        self.discovery_held = Gauge("consort_router_discovery_held_replicas",
                                    "Replicas a lane keeps although its EndpointSlices list them not ready (not "
                                    "terminating: the control plane cannot tell); the router's own /ready probes "
                                    "decide whether they take traffic.", ["specialist"], registry=r)
        self.cold_starts = Counter("consort_router_cold_starts",
                                   "Cold starts the activator began: a request found a scale-to-zero lane with no "
                                   "warm replica and the router asked for one.", ["specialist"], registry=r)
        self.held = Gauge("consort_router_held_requests", "Requests held now while their lane starts from zero.",
                          ["specialist"], registry=r)
        self.hold_seconds = Histogram("consort_router_hold_seconds",
                                      "How long held requests waited, by outcome: warm (released to the first warm "
                                      "replica), timeout or queue_full (answered 503).", ["specialist", "outcome"],
                                      registry=r, buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
