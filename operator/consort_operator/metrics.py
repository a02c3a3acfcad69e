"""Prometheus metrics of the operator (served on --metrics-port)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter("consort_operator_reconcile_total", "Reconcile passes by kind and result",
                     ["kind", "result"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("consort_operator_reconcile_errors_total", "Reconcile passes that failed",
                           ["kind"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("consort_operator_reconcile_duration_seconds", "Duration of one reconcile pass",
                              ["kind"], registry=REGISTRY,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
APPLIES = Counter("consort_operator_child_writes_total", "Owned objects written (server-side apply) by kind",
                  ["kind"], registry=REGISTRY)
WAKEUPS_UNCHANGED = Counter("consort_operator_wakeups_unchanged_total",
                            "Wake-ups that found nothing a pass decides from changed (no pass ran)", ["kind"],
                            registry=REGISTRY)
STATUS_WRITES = Counter("consort_operator_status_writes_total", "Status subresource patches", ["kind"],
                        registry=REGISTRY)
EVENTS = Counter("consort_operator_events_total", "Kubernetes Events posted", ["kind", "reason"], registry=REGISTRY)
PROBES = Counter("consort_operator_engine_probes_total", "Engine /ready probes through the pod-address resolver",
                 ["result"], registry=REGISTRY)
# One series per process (its own identity): 1 while it holds the leader Lease, 0 while standby.
LEADER = Gauge("consort_operator_leader", "1 while this operator replica holds the leader Lease",
               ["identity"], registry=REGISTRY)
PHASES = Gauge("consort_operator_specialists", "Specialists by phase", ["phase"], registry=REGISTRY)


def serve(port: int, addr: str) -> None:
    start_http_server(port, addr=addr, registry=REGISTRY)
