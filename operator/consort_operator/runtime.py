"""The operator's process-wide state that Kopf's handlers share (main.py builds it; memo.runtime).

Flags (build context, resolver, pacing), the API client and prober, and per object: what the
operator knows of its children and last pass (`ObjectState`, kept across Kopf's restarts of a
failed daemon) and a wake-up flag that watch events set.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .credentials import AcceptedTokens
from .kube import Kube
from .lifecycle.children import Owned
from .lifecycle.pacing import Pacing
from .metrics import PHASES
from .probe import Prober
from .resolver import NullResolver, PodAddressResolver
from .resources.common import BuildContext

ObjectKey = tuple[str, str, str]   # (kind, namespace, name)

# A wake-up waits for a burst of watch events to go quiet this long (at most BURST_SECONDS) so that
# one pass sees them all: a new Deployment's pods change several times within a second or two.
QUIET_SECONDS = 1.0
BURST_SECONDS = 5.0


@dataclass
class ObjectState:
    """One object's daemon memory: children written, the inputs of its last pass, its next timer."""

    owned: Owned = field(default_factory=Owned)
    inputs: Any = None                   # what the last pass decided from (None: no pass yet)
    deadline: float | None = None        # monotonic time of the next timed pass (None: events only)
    written: tuple[str | None, dict[str, Any]] | None = None   # (resourceVersion patched, status after)

    def prev_status(self, body: Any) -> dict[str, Any]:
        """The status the object holds: the body's, or what the last patch made of it while the
        watch has not delivered that patch yet (same resourceVersion as when it was sent)."""
        rv = body["metadata"].get("resourceVersion")
        if self.written is not None and self.written[0] == rv:
            return dict(self.written[1])
        return dict(body.get("status") or {})


@dataclass
class Runtime:
    ctx: BuildContext = field(default_factory=BuildContext)
    resolver: PodAddressResolver = field(default_factory=NullResolver)
    warm_signal: str = "engine-or-pod-ready"
    poll_seconds: float = 2.0          # while some replica is cold (engines give no k8s events)
    idle_seconds: float = 30.0         # when everything is warm and settled
    resync_seconds: float = 600.0      # re-read owned objects (recreate deleted ones, fix drift)
    peering_priority: int | None = None
    write_guard: Callable[[], None] | None = None   # leader election's check before each write
    kube: Kube | None = None
    prober: Prober | None = None
    accepted: AcceptedTokens = field(default_factory=AcceptedTokens)   # router tokens engines accept
    wakers: dict[ObjectKey, asyncio.Event] = field(default_factory=dict)
    objects: dict[ObjectKey, ObjectState] = field(default_factory=dict)
    phases: dict[tuple[str, str], str] = field(default_factory=dict)

    def client(self) -> Kube:
        if self.kube is None:
            raise RuntimeError("not logged in")
        return self.kube

    def pacing(self) -> Pacing:
        return Pacing(self.warm_signal, self.poll_seconds, self.idle_seconds)  # type: ignore[arg-type]

    def state(self, key: ObjectKey) -> ObjectState:
        return self.objects.setdefault(key, ObjectState())

    def waker(self, key: ObjectKey) -> asyncio.Event:
        ev = self.wakers.get(key)
        if ev is None:
            ev = self.wakers[key] = asyncio.Event()
        return ev

    def wake(self, kind: str, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.waker((kind, namespace, name)).set()

    def wake_all(self, kind: str, namespace: str) -> None:
        for (k, ns, _), ev in self.wakers.items():
            if k == kind and ns == namespace:
                ev.set()

    def forget(self, key: ObjectKey) -> None:
        self.wakers.pop(key, None)
        self.objects.pop(key, None)

    async def wait(self, key: ObjectKey, deadline: float | None) -> bool:
        """Until a watch event (then until its burst goes quiet) or the deadline. True: an event."""
        ev = self.waker(key)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(ev.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            return False
        end = time.monotonic() + BURST_SECONDS
        while True:
            ev.clear()
            left = min(QUIET_SECONDS, end - time.monotonic())
            if left <= 0:
                return True
            try:
                await asyncio.wait_for(ev.wait(), timeout=left)
            except asyncio.TimeoutError:
                return True

    def set_phase(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self.phases.pop(key, None)
        else:
            self.phases[key] = phase
        counts: dict[str, int] = {}
        for p in self.phases.values():
            counts[p] = counts.get(p, 0) + 1
        for p in ("Pending", "Warming", "Ready", "Degraded", "Failed", "Idle"):
            PHASES.labels(p).set(counts.get(p, 0))
