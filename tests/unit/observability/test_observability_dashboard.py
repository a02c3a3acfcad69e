"""The Grafana dashboard (charts/consort/dashboards/consort-ensemble.json): every PromQL expression
parses (promtool check rules, after Grafana's variables are substituted) and reads only metric
names our engine, router and operator registries really serve."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from promql import REPO, grafana_to_promql, metric_names, run_promtool, served_series_names

DASHBOARD = REPO / "charts" / "consort" / "dashboards" / "consort-ensemble.json"
# What an SRE opens this dashboard for (issue 13): each must be on it, per specialist.
REQUIRED = {
    "ttft": "vllm:time_to_first_token_seconds_bucket",
    "itl": "vllm:inter_token_latency_seconds_bucket",
    "queue": "vllm:num_requests_waiting",
    "kv use": "vllm:kv_cache_usage_perc",
    "breaker state": "consort_router_breaker_state",
    "shadow disagreement": "consort_router_shadow_total",
    "speculation acceptance": "vllm:spec_decode_num_accepted_tokens_total",
    "prefix-cache hits": "vllm:prefix_cache_hits_total",
    "kv tier hits": "vllm:external_prefix_cache_hits_total",
    "kv tier refusals": "consort_kv_tier_rejected_blocks_total",
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def expressions(d: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every label_values() variable query."""
    exprs = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in panels(d) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*[A-Za-z_][A-Za-z0-9_]*\)", v["query"]["query"])
            assert m, f"variable {v['name']}: expected label_values(selector, label)"
            exprs.append((f"variable {v['name']}", m.group(1)))
    return exprs


def test_metric_names_reads_selectors_not_functions_labels_or_keywords() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, specialist) (rate(vllm:time_to_first_token_seconds_bucket'
            '{specialist=~"a|b", code="5xx"}[5m]))) / on (specialist) group_left max without (pod) (up offset 1m) '
            '> bool 1e3 unless consort_warm and count(x{y="sum(z)"}[1h:1m])')
    assert metric_names(expr) == {"vllm:time_to_first_token_seconds_bucket", "up", "consort_warm", "x"}


def test_served_names_come_from_the_registries() -> None:
    names = served_series_names()
    assert {"vllm:num_requests_waiting", "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
            "consort_router_shadow_total", "consort_operator_reconcile_total"} <= names
    assert "consort_router_shadow" not in names     # a counter is served as *_total only


def test_dashboard_is_grafana_json_with_unique_ids_and_no_overlapping_panels() -> None:
    d = dashboard()
    assert d["uid"] == "consort-ensemble" and d["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels(d):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]


def test_every_expression_parses_and_reads_served_metrics(tmp_path: Path) -> None:
    exprs = expressions(dashboard())
    served = served_series_names()
    for where, expr in exprs:
        names = metric_names(grafana_to_promql(expr))
        assert names, f"{where}: no metric name in {expr!r}"
        assert names <= served, f"{where}: {sorted(names - served)} not served by the engine, router or operator"
    # promtool parses PromQL for real: each expression as a recording rule.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"consort:dashboard:expr{i}", "expr": grafana_to_promql(e)} for i, (_, e) in enumerate(exprs)]}]}
    (tmp_path / "dashboard.rules.yaml").write_text(yaml.safe_dump(rules))
    out = run_promtool("check", "rules", str(tmp_path / "dashboard.rules.yaml"))
    assert out.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("what", sorted(REQUIRED))
def test_dashboard_shows(what: str) -> None:
    exprs = [e for where, e in expressions(dashboard()) if where.startswith("panel")]
    reading = [e for e in exprs if REQUIRED[what] in metric_names(grafana_to_promql(e))]
    assert reading, f"no panel reads {REQUIRED[what]} ({what})"
    assert all("specialist" in e for e in reading), f"{what} is not per specialist"
