"""SLO judgement: per request against the published p95 targets, attainment over a window."""
from __future__ import annotations

from prometheus_client import generate_latest

from consort_engine.serving.metrics import SLO_WINDOW, EngineMetrics, SloTracker, p95


def test_p95_is_nearest_rank():
    assert p95([0.5]) == 0.5
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0      # 20 gaps: the 19th is the 95th percentile


def test_judge_ttft_and_itl_per_request():
    t = SloTracker(ttft_s=0.2, itl_s=0.05)
    assert t.judge(0.1, [0.01] * 30) == {"ttft": True, "itl": True}
    # one slow gap in 30 is inside the p95 allowance; three are not
    assert t.judge(0.1, [0.01] * 29 + [0.5]) == {"ttft": True, "itl": True}
    assert t.judge(0.3, [0.01] * 27 + [0.5] * 3) == {"ttft": False, "itl": False}
    assert t.judge(0.1, []) == {"ttft": True}                  # one output token: no ITL to judge
    s = t.summary()
    assert s["ttft"] == {"target_ms": 200, "requests": 4, "attainment": 0.75, "met": False}
    assert s["itl"]["requests"] == 3 and abs(s["itl"]["attainment"] - 2 / 3) < 1e-9


def test_attainment_is_over_a_bounded_window_and_absent_objectives_are_not_judged():
    t = SloTracker(ttft_s=0.2, itl_s=None)
    for _ in range(SLO_WINDOW):
        t.judge(1.0, [0.5])                      # all missed ...
    for _ in range(SLO_WINDOW):
        t.judge(0.1, [0.5])                      # ... then a full window of met: the misses aged out
    s = t.summary()
    assert s["ttft"]["attainment"] == 1.0 and s["ttft"]["met"] and "itl" not in s
    assert SloTracker(None, None).judge(5.0, [5.0]) == {}


def test_metrics_export_targets_and_verdicts():
    m = EngineMetrics("m", "Algo", lambda: {}, SloTracker(ttft_s=0.5, itl_s=None))
    m.observe_finished(None, prompt_tokens=4, output_tokens=3, ttft=0.9, admission_ttft=0.8, itls=[0.1, 0.1],
                       e2e=1.2, finish_reason="length", preempted=False)
    text = generate_latest(m.registry).decode()
    assert 'consort_slo_target_seconds{model_name="m",objective="ttft",specialist="Algo"} 0.5' in text
    assert ('consort_slo_requests_total{model_name="m",objective="ttft",result="missed",specialist="Algo"} 1.0'
            in text)
    assert 'objective="itl"' not in text


def test_deadline_verdicts_are_counted_only_for_requests_with_a_deadline():
    m = EngineMetrics("m", "Algo", lambda: {})
    kw = dict(prompt_tokens=4, output_tokens=3, ttft=0.1, admission_ttft=0.1, itls=[], e2e=0.2,
              finish_reason="length", preempted=False)
    m.observe_finished(None, **kw)                           # no deadline: not judged
    m.observe_finished(None, deadline_missed=True, **kw)
    m.observe_finished(None, deadline_missed=False, **kw)
    text = generate_latest(m.registry).decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("consort_deadline_requests_total{")]
    assert sorted(ln.rsplit(" ", 1)[1] for ln in lines) == ["1.0", "1.0"]
    assert any('result="missed"' in ln for ln in lines) and any('result="met"' in ln for ln in lines)
