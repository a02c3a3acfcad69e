"""Scale to zero in `consort up`: the same `scaleToZero` fields as in a cluster, with processes.

An engine whose Specialist sets `scaleToZero` is stopped (SIGTERM to its process group) once every
one of its processes reports `idle_s` >= `idleAfter` in /v1/status (the operator's own decision,
lifecycle/scaling.py, with the processes as replicas). The router holds the lane's requests
(consort_router/activator.py) and asks for a replica by creating `RUN_DIR/wake/<specialist>`; the
next supervision step starts the engine again on its old port, removes the file, and logs how long
the cold start took (file seen -> engine /ready 200).
"""
from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api.specialist import ScaleToZero
from .lifecycle import scaling

CHECK_S = 1.0     # how often the engines' idle time is read


def engine_idle_seconds(url: str, credential: str | None, timeout: float = 1.0) -> float | None:
    """The engine's `idle_s` from /v1/status (which needs the run's engine credential); None when
    it does not answer."""
    headers = {"Authorization": f"Bearer {credential}"} if credential else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/status", headers=headers), timeout=timeout) as r:
            idle = json.loads(r.read()).get("idle_s")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return float(idle) if isinstance(idle, (int, float)) and not isinstance(idle, bool) else None


@dataclass
class LocalScaler:
    """Per supervision step: stop idle engines, start asked-for ones. `start(child)` and `ready(url)`
    are consort up's own (local.py)."""

    policies: dict[str, ScaleToZero]           # Specialist -> its scaleToZero
    wake_dir: Path
    credential: str | None
    start: Callable[[Any], None]
    ready: Callable[[str], bool]
    cold_since: dict[str, float] = field(default_factory=dict)   # Specialist -> when the wake file was seen
    cold_starts: list[float] = field(default_factory=list)      # seconds, for the log and tests
    last_check: float = 0.0

    def step(self, engines: list[Any], now: float, log: Callable[[str], None]) -> None:
        check = now - self.last_check >= CHECK_S
        if check:
            self.last_check = now
        for name, policy in sorted(self.policies.items()):
            children = [c for c in engines if c.specialist == name]
            wake = self.wake_dir / name
            if wake.exists():
                self._wake(name, children, wake, now, log)
            if name in self.cold_since and all(self.ready(c.url) for c in children):
                took = now - self.cold_since.pop(name)
                self.cold_starts.append(took)
                log(f"engine {name}: warm after a cold start of {took:.1f} s")
            elif check and name not in self.cold_since and not any(c.stopped for c in children):
                self._maybe_stop(name, policy, children, log)

    def _wake(self, name: str, children: list[Any], wake: Path, now: float, log: Callable[[str], None]) -> None:
        stopped = [c for c in children if c.stopped]
        if any(c.popen is not None and c.popen.poll() is None for c in stopped):
            return   # still draining after its stop: start it once it has exited
        for c in stopped:
            c.stopped = False
            self.start(c)
        if stopped:
            self.cold_since[name] = now
            log(f"engine {name}: a request is waiting; starting {len(stopped)} process(es) (pid "
                f"{', '.join(str(c.popen.pid) for c in stopped)})")
        wake.unlink(missing_ok=True)

    def _maybe_stop(self, name: str, policy: ScaleToZero, children: list[Any], log: Callable[[str], None]) -> None:
        idle = scaling.least_idle_seconds(engine_idle_seconds(c.url, self.credential) for c in children)
        decision = scaling.decide(policy, len(children), len(children), len(children), idle)
        if decision.replicas != 0:
            return
        for c in children:
            c.stopped = True
            try:
                os.killpg(c.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        log(f"engine {name}: {decision.message}")


def local_scaler(specialists: dict[str, Any], run_dir: Path, credential: Path | None,
                 start: Callable[[Any], None], ready: Callable[[str], bool]) -> LocalScaler | None:
    """The scaler for the Specialists (name -> (manifest, spec)) that set scaleToZero; None if none does."""
    policies = {n: spec.scale_to_zero for n, (_, spec) in specialists.items() if spec.scale_to_zero is not None}
    if not policies:
        return None
    secret = credential.read_text().strip() if credential is not None else None
    return LocalScaler(policies, run_dir / "wake", secret, start, ready)
