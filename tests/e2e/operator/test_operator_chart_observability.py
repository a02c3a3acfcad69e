"""The chart's observability objects: the Grafana dashboard ConfigMap and the PrometheusRule render
only when their values ask, carry the exact files CI tests (dashboards/, rules/), and both are
accepted by the apiserver (server-side dry run; the PrometheusRule against prometheus-operator's CRD). And `promtool check metrics` on a real operator's
/metrics after it reconciled a Specialist and an EnsembleRouter."""
from __future__ import annotations

import json
import urllib.request

import pytest
import yaml
from kube import NotYet, wait_for
from opkit import REPO
from promql import check_metrics

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "consort"


def render(cluster, *sets: str) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    out = cluster.helm("template", "consort", str(CHART), "-n", "consort-system", *args)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def test_off_by_default(cluster):
    docs = render(cluster)
    assert "PrometheusRule" not in kinds(docs)
    assert not any(d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard") for d in docs)


def test_dashboard_configmap_carries_the_dashboard_and_the_sidecar_label(cluster, namespace):
    docs = render(cluster, "grafanaDashboard.enabled=true", "grafanaDashboard.annotations.grafana_folder=Consort")
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Consort"}
    assert cm["metadata"]["namespace"] == "consort-system"
    shipped = json.loads((CHART / "dashboards" / "consort-ensemble.json").read_text())
    assert json.loads(cm["data"]["consort-ensemble.json"]) == shipped
    cm["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(cm))
    other = render(cluster, "grafanaDashboard.enabled=true", "grafanaDashboard.namespace=monitoring")
    assert next(d for d in other if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")
                )["metadata"]["namespace"] == "monitoring"


def test_prometheus_rule_is_the_tested_rules_file(cluster, thirdparty_crds, namespace):
    docs = render(cluster, "prometheusRule.enabled=true", "prometheusRule.labels.release=kube-prometheus-stack")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    # prometheus-operator's own CRD accepts it (server-side dry run against its schema)
    applied = dict(rule, metadata={**rule["metadata"], "namespace": namespace})
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(applied))
    assert "prometheusrule.monitoring.coreos.com/" in out.stdout and "(server dry run)" in out.stdout, out.stdout
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "consort-alerts.yaml").read_text())
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} >= {
        "ConsortBreakerOpen", "ConsortNoWarmReplicas", "ConsortQueueHigh", "ConsortKVCacheNearFull",
        "ConsortShadowDisagreementHigh", "ConsortErrorRatioHigh"}


def test_schema_rejects_unknown_or_mistyped_values(cluster):
    for bad, field in (("prometheusRule.enabled=maybe", "prometheusRule"), ("grafanaDashboard.color=red", "grafanaDashboard"),
                       ("grafanaDashboard.namespace=Not_A_Namespace", "grafanaDashboard")):
        out = cluster.helm("template", "x", str(CHART), "--set", bad, check=False)
        assert out.returncode != 0 and field in out.stderr, (bad, out.stderr)


def test_operator_metrics_pass_promtool(cluster, namespace, operator_factory):
    op = operator_factory(namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist", "metadata": {"name": "lint", "labels": {"e": "lint"}},
         "spec": {"model": {"source": "demo://tiny"}, "replicas": 1, "resources": {"gpus": 0}}},
        {"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": "lint"},
         "spec": {"specialistSelector": {"matchLabels": {"e": "lint"}}, "replicas": 1}}]))

    def reconciled_both() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5) as r:
            body = r.read().decode()
        if not all(f'consort_operator_reconcile_total{{kind="{k}"' in body for k in ("Specialist", "EnsembleRouter")):
            raise NotYet("no reconcile of both kinds in /metrics yet")
        return body

    body = wait_for(reconciled_both, 60, "the operator reconciled the Specialist and the EnsembleRouter")
    assert "consort_operator_reconcile_duration_seconds_bucket{" in body and "consort_operator_specialists{" in body
    assert check_metrics(body) == [], "promtool check metrics findings on the operator's /metrics"
