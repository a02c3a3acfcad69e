"""Admission knobs: a sustained 429 spike escalates (threshold first, then priority floor), and decays."""
from __future__ import annotations

from consort_router.admission import (Knobs, RateWindow, WindowStats, floor_value, is_spike, priority_floors, step,
                                      threshold_delta)
from consort_router.config import AdmissionConfig

CFG = AdmissionConfig(spike_window_s=10, spike_min_count=5, spike_rate=0.2, escalate_every_s=5, threshold_step=0.1,
                      threshold_levels=2, floor_start=0, floor_step=100, floor_levels=3, cooldown_s=15)
SPIKE = WindowStats(total=20, rejected=10, intents=frozenset({"codegen"}))
QUIET = WindowStats(total=20, rejected=0)


def test_window_counts_and_expires():
    w = RateWindow()
    for i in range(10):
        w.record(float(i), i % 2 == 0, "codegen" if i < 5 else "review")
    s = w.stats(9.0, 10.0)
    assert (s.total, s.rejected, s.intents) == (10, 5, frozenset({"codegen", "review"}))
    s = w.stats(15.5, 10.0)  # events before 5.5 dropped
    assert (s.total, s.rejected) == (4, 2)


def test_spike_needs_count_and_rate():
    assert is_spike(CFG, SPIKE)
    assert not is_spike(CFG, WindowStats(total=100, rejected=10))  # 10% < 20%
    assert not is_spike(CFG, WindowStats(total=4, rejected=4))     # below the minimum count


def run(stats_at, until, k=None, dt=1.0):
    k = k or Knobs()
    hist = []
    t = 0.0
    while t <= until:
        k = step(CFG, k, stats_at(t), t)
        hist.append((t, k.level, threshold_delta(CFG, k), floor_value(CFG, k)))
        t += dt
    return k, hist


def test_escalates_threshold_first_then_floor_and_caps():
    k, hist = run(lambda t: SPIKE, 60)
    levels = [h[1] for h in hist]
    # one step per 5 s: level 1 at t=0, 2 at t=5, 3 at t=10 ...
    assert levels[0] == 1 and levels[5] == 2 and levels[10] == 3
    assert max(levels) == CFG.threshold_levels + CFG.floor_levels == k.level
    by_level = {h[1]: (h[2], h[3]) for h in hist}
    assert by_level[1] == (0.1, None) and by_level[2] == (0.2, None)   # threshold lowered, no floor yet
    assert by_level[3] == (0.2, 0) and by_level[4] == (0.2, 100) and by_level[5] == (0.2, 200)
    assert priority_floors(CFG, {"Algo": k}) == {"codegen": 200}


def test_decays_back_after_cooldown():
    k, _ = run(lambda t: SPIKE, 30)
    assert k.level == 5
    k2, hist = run(lambda t: QUIET, 200, k=Knobs(k.level, 30.0, 30.0, k.intents), dt=1.0)
    levels = [h[1] for h in hist]
    assert levels[0] == 5 and k2.level == 0 and k2.intents == frozenset()
    # monotone decay, one level per cool-down, none before the first cool-down elapsed
    assert all(b <= a for a, b in zip(levels, levels[1:]))
    first_drop = next(h[0] for h in hist if h[1] < 5)
    assert first_drop >= 45
    assert priority_floors(CFG, {"Algo": k2}) == {}


def test_spike_during_decay_stops_it():
    k = Knobs(level=4, last_change=0.0, last_spike=0.0, intents=frozenset({"x"}))
    k = step(CFG, k, QUIET, 16.0)
    assert k.level == 3
    k = step(CFG, k, SPIKE, 17.0)   # spike again: no decay, escalation waits for escalate_every_s
    assert k.level == 3
    k = step(CFG, k, SPIKE, 21.0)
    assert k.level == 4


def test_floors_merge_across_specialists():
    a = Knobs(level=3, intents=frozenset({"codegen"}))
    b = Knobs(level=5, intents=frozenset({"codegen", "review"}))
    assert priority_floors(CFG, {"A": a, "B": b}) == {"codegen": 200, "review": 200}
    assert priority_floors(CFG, {"A": Knobs(level=2, intents=frozenset({"x"}))}) == {}
