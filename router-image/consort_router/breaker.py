"""Correctness breakers, one per specialist: a pure state machine over a rolling pass rate.

States:
  closed     the specialist takes primary traffic.
  open       shadow-only: its configured fallback takes its primary traffic; the specialist keeps
             receiving shadow copies, whose verifier results are how it can recover.
  half_open  primary again, but heavily shadowed; closes after `half_open_samples` clean samples.

Transitions (all need at least `min_samples` samples in the window):
  closed/half_open -> open   the rate stayed below `floor` for `trip_after` consecutive samples
                             (and `trip_after_s` seconds): a sustained breach.
  open -> half_open          the rate stayed at or above `floor + recovery_margin` for `reset_after`
                             consecutive samples (and `reset_after_s` seconds): a sustained recovery.
  half_open -> closed        `half_open_samples` samples without a breach run.
The gap between the trip condition (< floor) and the recovery condition (>= floor + margin), plus
the run lengths, is the hysteresis: a rate oscillating around the floor moves nothing. A noisy lane
that does recover by chance and trips again soon after (from half_open, or within `relapse_window`
samples of closing) is a relapse: each relapse doubles the recovery run the next reset needs (up to 64x), so a lane
whose true rate sits at the floor cannot cycle.

A lane whose `revision` changes (new checkpoint or adapter) restarts its window and is fresh (heavier
shadowing) until `fresh_samples` samples arrive; an open lane becomes half_open on a new revision.

`BreakerStore` persists the states: a tiny protocol the operator implements over EnsembleRouter status.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from .config import BreakerConfig

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass(frozen=True)
class BreakerState:
    state: str = CLOSED
    samples: tuple[float, ...] = ()   # last `window` correctness samples in [0, 1]
    total: int = 0                    # samples since the current revision
    breach_run: int = 0               # consecutive samples with rate < floor
    breach_since: float | None = None
    recovery_run: int = 0             # consecutive samples with rate >= floor + margin
    recovery_since: float | None = None
    half_open_count: int = 0
    since: float = 0.0                # time of the last transition
    revision: str | None = None
    transitions: int = 0
    relapses: int = 0                 # trips soon after a recovery; each doubles the next recovery run
    closed_at_total: int = -(10**9)   # `total` when the breaker last closed

    @property
    def rate(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = list(self.samples)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BreakerState":
        known = {f for f in cls.__dataclass_fields__}
        d = {k: v for k, v in d.items() if k in known}
        if d.get("state") not in STATE_CODES:
            d["state"] = CLOSED
        d["samples"] = tuple(float(x) for x in d.get("samples", ()))
        return cls(**d)


def is_fresh(s: BreakerState, cfg: BreakerConfig) -> bool:
    return s.total < cfg.fresh_samples


def reset_run(s: BreakerState, cfg: BreakerConfig) -> int:
    """Consecutive recovered samples an open breaker needs: reset_after, doubled per relapse."""
    return cfg.reset_after * (1 << min(s.relapses, 6))


def _transition(s: BreakerState, to: str, now: float) -> BreakerState:
    return replace(
        s, state=to, since=now, transitions=s.transitions + 1, breach_run=0, breach_since=None,
        recovery_run=0, recovery_since=None, half_open_count=0,
    )


def observe(s: BreakerState, cfg: BreakerConfig, value: float, now: float) -> BreakerState:
    """Fold one correctness sample (1.0 pass, 0.0 fail, or a score in between) into the breaker."""
    value = min(1.0, max(0.0, float(value)))
    samples = (s.samples + (value,))[-cfg.window:]
    s = replace(s, samples=samples, total=s.total + 1)
    if len(samples) < cfg.min_samples:
        return replace(s, breach_run=0, breach_since=None, recovery_run=0, recovery_since=None)
    rate = sum(samples) / len(samples)

    if s.state in (CLOSED, HALF_OPEN):
        if rate < cfg.floor:
            s = replace(s, breach_run=s.breach_run + 1, breach_since=s.breach_since if s.breach_since is not None else now)
        else:
            s = replace(s, breach_run=0, breach_since=None)
        if s.breach_run >= cfg.trip_after and now - (s.breach_since or now) >= cfg.trip_after_s:
            relapse = s.state == HALF_OPEN or s.total - s.closed_at_total <= cfg.relapse_window
            return _transition(replace(s, relapses=s.relapses + 1 if relapse else 0), OPEN, now)
        if s.state == HALF_OPEN:
            s = replace(s, half_open_count=s.half_open_count + 1)
            if s.half_open_count >= cfg.half_open_samples and s.breach_run == 0:
                return _transition(replace(s, closed_at_total=s.total), CLOSED, now)
        return s

    # OPEN
    if rate >= cfg.floor + cfg.recovery_margin:
        s = replace(s, recovery_run=s.recovery_run + 1,
                    recovery_since=s.recovery_since if s.recovery_since is not None else now)
    else:
        s = replace(s, recovery_run=0, recovery_since=None)
    if s.recovery_run >= reset_run(s, cfg) and now - (s.recovery_since or now) >= cfg.reset_after_s:
        return _transition(s, HALF_OPEN, now)
    return s


def apply_revision(s: BreakerState, revision: str | None, now: float) -> BreakerState:
    """A changed lane revision restarts the window (fresh lane); an open breaker goes half_open."""
    if revision == s.revision:
        return s
    fresh = replace(s, samples=(), total=0, revision=revision, breach_run=0, breach_since=None,
                    recovery_run=0, recovery_since=None, half_open_count=0)
    return _transition(fresh, HALF_OPEN, now) if s.state == OPEN else fresh


# ---------------------------------------------------------------- persistence


class BreakerStore(Protocol):
    """Where breaker states survive restarts. `load()` returns what the last `save()` got (or {}).

    The payload is a JSON-safe dict: {"version": 1, "breakers": {specialist: BreakerState.to_dict()}}.
    Implementations must not raise on a missing store (return {}); `save` may be called every few seconds.
    """

    def load(self) -> dict: ...

    def save(self, data: dict) -> None: ...


@dataclass
class MemoryStore:
    data: dict = field(default_factory=dict)

    def load(self) -> dict:
        return json.loads(json.dumps(self.data))

    def save(self, data: dict) -> None:
        self.data = json.loads(json.dumps(data))


@dataclass
class FileStore:
    path: Path

    def load(self) -> dict:
        try:
            data = json.loads(Path(self.path).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def save(self, data: dict) -> None:
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".breakers.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def dump_states(states: dict[str, BreakerState]) -> dict:
    return {"version": 1, "breakers": {k: v.to_dict() for k, v in sorted(states.items())}}


def load_states(data: dict) -> dict[str, BreakerState]:
    out = {}
    for name, d in (data.get("breakers") or {}).items():
        if isinstance(d, dict):
            try:
                out[name] = BreakerState.from_dict(d)
            except (TypeError, ValueError):
                continue
    return out
