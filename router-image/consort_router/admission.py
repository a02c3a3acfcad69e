"""Admission escalation: a sustained engine-429 spike on one specialist turns two reversible knobs.

Each specialist has an escalation `level`:
  1 .. threshold_levels            its shadow threshold is lowered by `threshold_step` per level, and
                                   low-confidence classifier traffic is served by its second choice
                                   (the second choice catches more low-confidence traffic);
  threshold_levels+1 .. +floor_levels  additionally the priority floor of the intents that saw the 429s
                                   rises: floor_start, then + floor_step per further level; requests
                                   below it get 429 `priority_floor` with Retry-After.
One step up per `escalate_every_s` while the spike lasts; one step down after `cooldown_s` without it.

`RateWindow` only records observations; `step` is the pure decision over them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from .config import AdmissionConfig


@dataclass
class RateWindow:
    """Recent primary responses from one specialist: (time, was_429, intent)."""

    events: deque = field(default_factory=deque)

    def record(self, now: float, rejected: bool, intent: str) -> None:
        self.events.append((now, rejected, intent))

    def stats(self, now: float, window_s: float) -> "WindowStats":
        cutoff = now - window_s
        ev = self.events
        while ev and ev[0][0] < cutoff:
            ev.popleft()
        n429 = 0
        intents = set()
        for _, rejected, intent in ev:
            if rejected:
                n429 += 1
                intents.add(intent)
        return WindowStats(total=len(ev), rejected=n429, intents=frozenset(intents))


@dataclass(frozen=True)
class WindowStats:
    total: int
    rejected: int
    intents: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Knobs:
    level: int = 0
    last_change: float = float("-inf")
    last_spike: float = float("-inf")
    intents: frozenset[str] = frozenset()  # intents whose floor this specialist raises


def is_spike(cfg: AdmissionConfig, stats: WindowStats) -> bool:
    return stats.rejected >= cfg.spike_min_count and stats.rejected >= cfg.spike_rate * max(stats.total, 1)


def step(cfg: AdmissionConfig, k: Knobs, stats: WindowStats, now: float) -> Knobs:
    """Escalate one level during a sustained spike, decay one level after a quiet cool-down."""
    top = cfg.threshold_levels + cfg.floor_levels
    if is_spike(cfg, stats):
        k = replace(k, last_spike=now, intents=k.intents | stats.intents)
        if k.level < top and now - k.last_change >= cfg.escalate_every_s:
            k = replace(k, level=k.level + 1, last_change=now)
        return k
    if k.level > 0 and now - k.last_spike >= cfg.cooldown_s and now - k.last_change >= cfg.cooldown_s:
        level = k.level - 1
        return replace(k, level=level, last_change=now, intents=k.intents if level > cfg.threshold_levels else frozenset())
    return k


def threshold_delta(cfg: AdmissionConfig, k: Knobs) -> float:
    """How much this specialist's shadow thresholds are lowered."""
    return cfg.threshold_step * min(k.level, cfg.threshold_levels)


def floor_value(cfg: AdmissionConfig, k: Knobs) -> int | None:
    """The priority floor this specialist imposes on its spiking intents, or None."""
    lvl = k.level - cfg.threshold_levels
    if lvl <= 0 or not k.intents:
        return None
    return cfg.floor_start + (lvl - 1) * cfg.floor_step


def priority_floors(cfg: AdmissionConfig, knobs: dict[str, Knobs]) -> dict[str, int]:
    """intent -> the highest floor any specialist imposes on it."""
    out: dict[str, int] = {}
    for k in knobs.values():
        f = floor_value(cfg, k)
        if f is None:
            continue
        for intent in k.intents:
            out[intent] = max(out.get(intent, f), f)
    return out
