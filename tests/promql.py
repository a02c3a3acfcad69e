"""PromQL helpers for the dashboard and alert tests: the metric names an expression reads, the
series names our three /metrics endpoints can serve (from the real prometheus_client registries),
and promtool (Debian's `prometheus` package, installed by hack/prometheus-tools.sh).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Every PromQL keyword, aggregation and function name that can stand where a metric name could.
KEYWORDS = frozenset("""
by without on ignoring group_left group_right bool and or unless offset atan2 inf nan
sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
""".split())
# Sample names per metric type, from a family's name (prometheus_client strips _total from counters).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"),
            "summary": ("", "_count", "_sum"), "info": ("_info",), "stateset": ("",), "unknown": ("",)}
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def grafana_to_promql(expr: str) -> str:
    """Grafana's built-in intervals become durations; template variables ($namespace...) match all."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not in a string, a label
    matcher, a grouping clause or a range, not called like a function, and not a keyword."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    names = set()
    for m in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def served_series_names() -> set[str]:
    """Sample names the engine, router and operator registries expose, by metric type."""
    from consort_engine.serving.metrics import EngineMetrics, SloTracker
    from consort_operator.metrics import REGISTRY as operator_registry
    from consort_router.metrics import RouterMetrics

    engine = EngineMetrics("m", "s", stats=lambda: {}, slo=SloTracker(1.0, 0.1))
    names = set()
    for registry in (engine.registry, RouterMetrics().registry, operator_registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: run hack/prometheus-tools.sh (make test does; Debian package prometheus)"
    return path


def run_promtool(*args: str, cwd: Path | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, input=input, capture_output=True, text=True, timeout=120)


# vLLM's names (`vllm:...`) are kept so vLLM's dashboards and benchmark tools work unchanged;
# promtool's lint reserves colons for recording rules. That is the one finding we accept.
ACCEPTED_LINT = re.compile(r"^vllm:[A-Za-z0-9_:]+ metric names should not contain ':'$")


def check_metrics(exposition: str) -> list[str]:
    """`promtool check metrics` on one /metrics body: the findings left after the accepted one.
    promtool exits 0 when clean, 3 on lint findings; anything else (1: unparsable) is a finding."""
    out = run_promtool("check", "metrics", input=exposition)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    findings = [ln for ln in lines if not ACCEPTED_LINT.match(ln)]
    if out.returncode not in (0, 3) or (out.returncode == 3 and not lines):
        findings.append(f"promtool exited {out.returncode}")
    return findings
