"""Activator: a request for a lane with no warm replica (scaled to zero) waits here while a replica starts.

Per lane: a bounded FIFO of held requests, one cold start at a time. The first held request asks for
a replica (`wake`, wake.py: the Specialist's /scale subresource in a cluster, a file `consort up`
watches locally) and again every `REWAKE_S` while requests wait (a lost or refused ask is retried).
A watcher polls `is_warm` and, when the first replica turns warm, releases the held requests in
arrival order. A request waits at most `hold_timeout_s`, and never beyond its own deadline; then,
or when the queue is full, it gets a typed 503 whose Retry-After is the rest of the expected cold
start (the lane's recent cold starts, or the hold timeout before any was seen).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .api import ApiError
from .config import ScaleFromZero, SpecialistRoute

log = logging.getLogger("consort.router.activator")

REWAKE_S = 5.0            # ask again while requests wait (the first ask may have been lost)
CHECK_S = 0.05            # how often the watcher looks for a warm replica
RECENT_STARTS = 8         # cold-start durations kept per lane for Retry-After
WATCH_S = 600.0           # with nobody held (whileCold: fallback), how long a cold start is watched


@dataclass
class LaneHold:
    waiters: deque[asyncio.Future] = field(default_factory=deque)
    cold_since: float | None = None      # when the current cold start began (first held request)
    last_wake: float = float("-inf")
    starts: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STARTS))
    watcher: asyncio.Task | None = None


def retry_after_s(starts: list[float], cold_since: float | None, now: float, default_s: float) -> float:
    """Seconds until the lane is expected warm: the median recent cold start (or `default_s` before
    any) less what the current one has already taken; at least 1 s."""
    expected = statistics.median(starts) if starts else default_s
    elapsed = 0.0 if cold_since is None else now - cold_since
    return max(1.0, expected - elapsed)


class Activator:
    def __init__(self, wake: Callable[[str], Awaitable[None]], is_warm: Callable[[str], bool],
                 metrics: object | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.wake, self.is_warm, self.metrics, self.clock = wake, is_warm, metrics, clock
        self.lanes: dict[str, LaneHold] = {}
        self._tasks: set[asyncio.Task] = set()

    def held(self, lane: str) -> int:
        hold = self.lanes.get(lane)
        return len(hold.waiters) if hold else 0

    def ask(self, lane: str, hold: LaneHold | None = None) -> None:
        """Ask for a replica of `lane` (at most once per REWAKE_S), without waiting for it."""
        hold = hold or self.lanes.setdefault(lane, LaneHold())
        now = self.clock()
        if hold.cold_since is None:
            hold.cold_since = now
            if self.metrics is not None:
                self.metrics.cold_starts.labels(lane).inc()
        if hold.watcher is None or hold.watcher.done():
            hold.watcher = asyncio.create_task(self._watch(lane, hold), name=f"activator-{lane}")
        if now - hold.last_wake < REWAKE_S:
            return
        hold.last_wake = now
        task = asyncio.create_task(self._wake(lane))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake(self, lane: str) -> None:
        try:
            await self.wake(lane)
        except Exception as e:  # noqa: BLE001 - the watcher asks again; held requests time out typed
            log.warning("could not ask for a replica of %s: %s", lane, e)

    def refusal(self, lane: str, policy: ScaleFromZero, code: str, why: str) -> ApiError:
        hold = self.lanes.get(lane) or LaneHold()
        wait = retry_after_s(list(hold.starts), hold.cold_since, self.clock(), policy.hold_timeout_s)
        return ApiError(503, code, f"specialist {lane} is starting from zero replicas: {why}; retry in {wait:.0f} s",
                        retry_after_ms=int(wait * 1000))

    async def hold(self, lane: str, policy: ScaleFromZero, deadline: float) -> float:
        """Wait until `lane` has a warm replica; returns the seconds held. Raises a typed 503 when
        the lane's queue is full, or when neither the hold timeout nor `deadline` (clock time) leaves
        room for the replica to turn warm."""
        hold = self.lanes.setdefault(lane, LaneHold())
        if len(hold.waiters) >= policy.max_held:
            self._observe(lane, "queue_full", 0.0)
            raise self.refusal(lane, policy, "cold_start_queue_full",
                               f"{policy.max_held} requests already wait for it")
        t0 = self.clock()
        limit = min(deadline, t0 + policy.hold_timeout_s)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        hold.waiters.append(fut)
        if self.metrics is not None:
            self.metrics.held.labels(lane).inc()
        self.ask(lane, hold)
        try:
            await asyncio.wait_for(fut, timeout=max(0.0, limit - t0))
        except asyncio.TimeoutError:
            self._observe(lane, "timeout", self.clock() - t0)
            raise self.refusal(lane, policy, "cold_start_timeout",
                               f"no replica turned warm within {limit - t0:.1f} s") from None
        finally:
            if fut in hold.waiters:
                hold.waiters.remove(fut)
            if self.metrics is not None:
                self.metrics.held.labels(lane).dec()
        waited = self.clock() - t0
        self._observe(lane, "warm", waited)
        return waited

    def _observe(self, lane: str, outcome: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.hold_seconds.labels(lane, outcome).observe(seconds)

    def drain(self, lane: str) -> int:
        """The lane turned warm: release its held requests in arrival order; returns how many."""
        hold = self.lanes.get(lane)
        if hold is None:
            return 0
        if hold.cold_since is not None:
            hold.starts.append(self.clock() - hold.cold_since)
            hold.cold_since = None
        hold.last_wake = float("-inf")
        released = 0
        while hold.waiters:
            fut = hold.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                released += 1
        return released

    async def _watch(self, lane: str, hold: LaneHold) -> None:
        while hold.waiters or (hold.cold_since is not None and self.clock() - hold.cold_since < WATCH_S):
            if self.is_warm(lane):
                n = self.drain(lane)
                log.info("%s warm after a cold start of %.1f s: released %d held request(s)",
                         lane, hold.starts[-1] if hold.starts else 0.0, n)
                return
            self.ask(lane, hold)
            await asyncio.sleep(CHECK_S)
        hold.cold_since = None   # nobody waits and it never turned warm: the next request starts a new count

    async def admit(self, route: SpecialistRoute, replicas: list, has_fallback: bool, deadline: float) -> bool:
        """Before a request goes to lane `route`: True to send it there now (it has a ready replica,
        or does not scale to zero, or a replica turned warm while the request was held); False to pass
        it to the next target, the lane's fallback (whileCold: fallback), after asking for a replica."""
        policy = route.scale_from_zero
        if policy is None or any(r.ready for r in replicas):
            return True
        if policy.while_cold == "fallback" and has_fallback:
            self.ask(route.name)
            return False
        await self.hold(route.name, policy, deadline)
        return True

    async def close(self) -> None:
        tasks = [*self._tasks, *(h.watcher for h in self.lanes.values() if h.watcher is not None)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
