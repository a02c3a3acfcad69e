"""examples/autoscaling reads metrics the engine really serves, under the labels it really puts on
them, and scales a Specialist through its /scale subresource (the apiserver checks the schemas in
tests/e2e/operator/test_operator_autoscaling.py)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from consort_engine.serving.metrics import ENGINE_LABELS, EngineMetrics
from consort_operator.api.crds import specialist_crd

EXAMPLES = Path(__file__).resolve().parents[4] / "examples" / "autoscaling"
# A PromQL metric name at the head of a selector: `name{` (colons allowed, as in vLLM's names).
SERIES = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")


def load(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def engine_series() -> dict[str, set[str]]:
    """{metric name: label names} as the engine's /metrics exposes them (gauges included)."""
    registry = EngineMetrics("m", "algo", lambda: {"waiting": 3, "kv_usage": 0.5}).registry
    return {s.name: set(s.labels) for fam in registry.collect() for s in fam.samples}


def selectors(query: str) -> list[tuple[str, set[str]]]:
    return [(name, {m.split("=")[0].strip().rstrip("!") for m in body.split(",") if m.strip()})
            for name, body in SERIES.findall(query)]


def test_keda_queries_read_engine_series_by_their_own_labels():
    served = engine_series()
    so = load("keda-scaledobject.yaml")
    queries = [t["metadata"]["query"] for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(queries) == 2
    for query in queries:
        for name, labels in selectors(query):
            assert name in served, f"{name} is not an engine metric"
            # `namespace` comes from the PodMonitor's target labels; the rest must be the engine's.
            assert labels - {"namespace"} <= set(ENGINE_LABELS) & served[name], (query, served[name])
    assert {n for q in queries for n, _ in selectors(q)} == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


def test_hpa_metrics_are_the_ones_prometheus_adapter_serves_from_engine_series():
    served = engine_series()
    rules = yaml.safe_load(load("prometheus-adapter-config.yaml")["data"]["config.yaml"])["rules"]
    adapter = {}
    for rule in rules:
        ((name, _),) = selectors(rule["seriesQuery"])
        assert name in served, f"{name} is not an engine metric"
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        adapter[rule["name"]["as"]] = name
    hpa = load("hpa.yaml")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted and wanted <= set(adapter), (wanted, adapter)


def test_both_examples_scale_a_specialist_through_its_scale_subresource():
    crd = specialist_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    api_version = f"{crd['spec']['group']}/{version['name']}"
    for doc, ref in ((load("hpa.yaml"), "scaleTargetRef"), (load("keda-scaledobject.yaml"), "scaleTargetRef")):
        target = doc["spec"][ref]
        assert (target["apiVersion"], target["kind"]) == (api_version, crd["spec"]["names"]["kind"])
