"""The alert rules (charts/consort/rules/consort-alerts.yaml): valid for promtool, unit-tested with
`promtool test rules` (alerts_test.yaml: series shaped as our /metrics serve them), each alert
fired at least once there, and reading only metric names our registries serve."""
from __future__ import annotations

from pathlib import Path

import yaml
from promql import REPO, metric_names, run_promtool, served_series_names

RULES = REPO / "charts" / "consort" / "rules" / "consort-alerts.yaml"
UNIT = Path(__file__).with_name("alerts_test.yaml")


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_rules_pass_promtool_check() -> None:
    out = run_promtool("check", "rules", str(RULES))
    assert out.returncode == 0 and f"SUCCESS: {len(alert_rules())} rules found" in out.stdout, out.stdout + out.stderr


def test_promtool_unit_tests_pass() -> None:
    out = run_promtool("test", "rules", UNIT.name, cwd=UNIT.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_fires_in_a_unit_test_and_has_severity_and_text() -> None:
    fired = {t["alertname"] for case in yaml.safe_load(UNIT.read_text())["tests"]
             for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    for rule in alert_rules():
        assert rule["alert"] in fired, f"{rule['alert']} never fires in {UNIT.name}"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_rules_read_only_served_metrics() -> None:
    served = served_series_names()
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names and names <= served, f"{rule['alert']}: {sorted(names - served)} not served"


def test_unit_test_series_are_served_metrics() -> None:
    served = served_series_names()
    for case in yaml.safe_load(UNIT.read_text())["tests"]:
        for s in case["input_series"]:
            assert metric_names(s["series"]) <= served, s["series"]
