"""Which KV blocks each engine replica holds, from the engines' own block events (docs/kv-cache.md).

Every engine publishes `GET /v1/kv/events?epoch=&since=&limit=&wait=`: the block hashes its prefix cache
stored and removed, per medium (`pool`: its KV pool; `tier`: the KV tier below it), numbered within
an epoch (one per engine start). `ReplicaBlocks.apply` folds one reply into the replica's view:
events continue the view only when they follow its epoch and sequence number exactly; anything else
(first contact, engine restart, a gap) comes back from the engine as a snapshot that replaces the
view. So the view is never wrong, only late; a hash it lacks costs a cache miss. How late: the
subscriber holds one long poll per replica (`wait`), which the engine answers at its next event, so
about one round trip after the engine stored a block.

Memory is bounded: at most `max_hashes` hashes per replica and medium, the oldest stored forgotten
first. Requests are bounded: one at a time per replica, a few in a row only while the engine says
it has more, off the request path (`KVSubscriber`, one background task per replica).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from .metrics import RouterMetrics

log = logging.getLogger("consort.router.kv")

MEDIA = ("pool", "tier")
TIER_WEIGHT = 0.5          # a block in the tier is worth less than one in the pool: it must be read back
PAGES_PER_ROUND = 4        # replies fetched per replica per round while the engine says `more`
MAX_RETRY_S = 8.0          # the longest pause before asking a failing engine again
# At most one answered long poll per replica this often: a busy engine has block events every few
# steps, and a router asking again at each would cost the engine and itself a request per event
# (several routers, several times that). What the router sent itself it already expects (Affinity.sent).
MIN_FOLLOW_S = 0.05
# A prompt this router just sent is expected on its replica until the engine's events say so or this
# many seconds pass: a follow-up turn sent before the engine has computed (and published) the prompt's
# blocks still finds its prefix. Only this router's own sends: another router replica learns from the
# events.
EXPECT_S = 5.0
MAX_EXPECTED = 65536


@dataclass
class ReplicaBlocks:
    """One replica's held block hashes as its events last said (dicts keep insertion order: the oldest
    stored hash is the first to forget when over `max_hashes`)."""

    max_hashes: int
    epoch: str | None = None
    seq: int | None = None
    held: dict[str, dict[bytes, None]] = field(default_factory=lambda: {m: {} for m in MEDIA})
    snapshots: int = 0
    events: int = 0
    dropped: int = 0             # hashes forgotten over max_hashes (or cut from a truncated snapshot)
    updated_at: float = 0.0
    expected: dict[bytes, float] = field(default_factory=dict)   # sent here, not in the events yet: deadline

    def expect(self, hashes: tuple[bytes, ...], now: float | None = None) -> None:
        """This router sent a prompt with these blocks here: count them held until EXPECT_S passes or
        the events bring them (a failed or evicted prefill then costs a miss, never a wrong block:
        the engine verifies every hit)."""
        now = time.monotonic() if now is None else now
        for h in hashes:
            self.expected.pop(h, None)
            self.expected[h] = now + EXPECT_S
        while len(self.expected) > MAX_EXPECTED:
            del self.expected[next(iter(self.expected))]

    def apply(self, reply: dict) -> None:
        """Fold one /v1/kv/events reply in. Raises ValueError on a reply that is not the engine's shape
        (the view is left as it was)."""
        epoch, seq = reply.get("epoch"), reply.get("seq")
        if not isinstance(epoch, str) or not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError("a kv events reply needs a string epoch and an integer seq")
        if "snapshot" in reply:
            snap = reply["snapshot"]
            if not isinstance(snap, dict):
                raise ValueError("snapshot is not an object")
            held = {m: self._hashes(snap.get(m, ())) for m in MEDIA}
            self.held = {m: {} for m in MEDIA}
            for m in MEDIA:
                self._store(m, held[m])
            self.snapshots += 1
        else:
            if epoch != self.epoch:
                raise ValueError("events of another epoch than the view's (the engine sends a snapshot then)")
            events = reply.get("events")
            if not isinstance(events, list):
                raise ValueError("events is not a list")
            parsed = []
            for e in events:
                if not isinstance(e, dict) or e.get("medium") not in MEDIA or \
                        e.get("type") not in ("stored", "removed", "cleared"):
                    raise ValueError(f"not a block event: {str(e)[:100]}")
                parsed.append((e["type"], e["medium"], self._hashes(e.get("hashes", ()))))
            for kind, medium, hashes in parsed:
                for h in hashes:
                    self.expected.pop(h, None)    # the engine's word replaces the guess
                if kind == "stored":
                    self._store(medium, hashes)
                elif kind == "removed":
                    held = self.held[medium]
                    for h in hashes:
                        held.pop(h, None)
                else:
                    self.held[medium].clear()
            self.events += len(parsed)
        self.epoch, self.seq = epoch, seq
        self.updated_at = time.monotonic()

    def _store(self, medium: str, hashes: list[bytes]) -> None:
        held = self.held[medium]
        for h in hashes:
            held.pop(h, None)      # re-stored: now the newest
            held[h] = None
        over = len(held) - self.max_hashes
        if over > 0:
            for h in list(itertools.islice(held, over)):
                del held[h]
            self.dropped += over

    @staticmethod
    def _hashes(raw: object) -> list[bytes]:
        if not isinstance(raw, list):
            raise ValueError("hashes is not a list")
        try:
            return [bytes.fromhex(h) for h in raw]
        except (TypeError, ValueError):
            raise ValueError("a block hash is not hex") from None

    def depth(self, hashes: tuple[bytes, ...], now: float | None = None) -> float:
        """Leading blocks of `hashes` this replica holds: 1 per block in the pool (or expected there),
        TIER_WEIGHT per block only in the tier; the count stops at the first block held nowhere (a
        prefix is a chain)."""
        return self.match(hashes, now)[0]

    def match(self, hashes: tuple[bytes, ...], now: float | None = None) -> tuple[float, int]:
        """(depth, how many leading blocks of `hashes` it holds in any medium)."""
        pool, tier, expected = self.held["pool"], self.held["tier"], self.expected
        now = time.monotonic() if now is None else now
        score, n = 0.0, 0
        for h in hashes:
            if h in pool or expected.get(h, 0.0) > now:
                score += 1.0
            elif h in tier:
                score += TIER_WEIGHT
            else:
                break
            n += 1
        return score, n

    def size(self) -> int:
        return sum(len(v) for v in self.held.values())


class KVSubscriber:
    """Follows every tracked replica's block events in the background; `blocks[url]` is its view.

    One task per replica holds one request at a time: a long poll (`wait_s`) that the engine answers
    at its next block event, so the view follows the engine within a round trip. A replica not ready
    yet is looked at again every `retry_s`; a failed request is retried after `retry_s`, doubling
    per failure in a row up to MAX_RETRY_S. An engine that does not know `wait` (400) is polled
    every `retry_s` instead. Answered polls are at least MIN_FOLLOW_S apart."""

    def __init__(self, session: aiohttp.ClientSession, retry_s: float, timeout_s: float,
                 max_hashes: int, limit: int = 4096, metrics: RouterMetrics | None = None,
                 is_ready: Callable[[str], bool] = lambda url: True, wait_s: float = 10.0) -> None:
        self.session = session
        self.is_ready = is_ready   # a warming engine has no events yet, and must see no traffic from us
        self.retry_s = retry_s
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.max_hashes = max_hashes
        self.limit = limit
        self.urls: set[str] = set()
        self.blocks: dict[str, ReplicaBlocks] = {}
        self.metrics = metrics
        self.errors = 0
        self.polled: set[str] = set()      # engines that refused `wait`: polled every retry_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._running = False

    def track(self, urls: set[str]) -> None:
        """The replicas to follow now; a replica that left takes its view (and its request) with it."""
        self.urls = set(urls)
        for url in list(self.blocks):
            if url not in self.urls:
                del self.blocks[url]
        self.polled &= self.urls
        if self._running:
            self._sync_tasks()

    def _sync_tasks(self) -> None:
        for url in list(self._tasks):
            if url not in self.urls:
                self._tasks.pop(url).cancel()
        for url in self.urls - set(self._tasks):
            self._tasks[url] = asyncio.create_task(self.follow(url), name=f"kv-events {url}")

    async def poll_one(self, url: str, wait_s: float = 0.0) -> int | None:
        """Bring `url`'s view up to date: a few replies while the engine says `more`, the first held up
        to `wait_s` by a caught-up engine. How many events (a snapshot counts one) it applied; None when
        a request failed (the view is left as it was)."""
        got = 0
        view = self.blocks.get(url)
        if view is None:
            view = self.blocks[url] = ReplicaBlocks(self.max_hashes)
        for _ in range(PAGES_PER_ROUND):
            params = {"limit": str(self.limit)}
            if view.epoch is not None and view.seq is not None:
                params.update(epoch=view.epoch, since=str(view.seq))
                if wait_s > 0 and url not in self.polled:
                    params["wait"] = f"{wait_s:g}"
            timeout = aiohttp.ClientTimeout(total=self.timeout_s + (wait_s if "wait" in params else 0.0))
            try:
                async with self.session.get(f"{url}/v1/kv/events", params=params, timeout=timeout) as resp:
                    if resp.status == 400 and "wait" in params:
                        self.polled.add(url)     # an engine from before the long poll: poll it
                        log.info("kv events from %s: the engine does not take wait; polling", url)
                        return got
                    if resp.status != 200:     # warming (503), an engine without events (404): retry
                        self.errors += 1
                        return None
                    reply = await resp.json(content_type=None)
                view.apply(reply)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self.errors += 1
                log.debug("kv events from %s: %s", url, e)
                return None
            if "snapshot" in reply:
                got += 1
                self.polled.discard(url)      # a new engine process: it may take `wait` now
                if self.metrics is not None:
                    self.metrics.kv_snapshots.inc()
            else:
                got += len(reply["events"])
                if self.metrics is not None:
                    self.metrics.kv_events.inc(len(reply["events"]))
            if not reply.get("more"):
                return got
            wait_s = 0.0
        return got

    async def follow(self, url: str) -> None:
        """One replica's loop, until it is no longer tracked (cancelled)."""
        failures = 0
        while url in self.urls:
            if not self.is_ready(url):
                failures = 0              # back: its snapshot is fetched at once, not after a backoff
                await asyncio.sleep(self.retry_s)
                continue
            wait_s = 0.0 if url in self.polled else self.wait_s
            started = time.monotonic()
            try:
                got = await self.poll_one(url, wait_s)
            except Exception:  # noqa: BLE001 - keep following whatever one reply meets
                log.exception("kv events from %s failed", url)
                got = None
            self._lag()
            failures = 0 if got is not None else failures + 1
            if failures:
                delay = min(self.retry_s * 2 ** (failures - 1), MAX_RETRY_S)
            elif url in self.polled or (got == 0 and time.monotonic() - started < wait_s / 2):
                delay = self.retry_s    # polled; or answered early with nothing new (an engine stopping)
            else:
                delay = MIN_FOLLOW_S - (time.monotonic() - started)
                if delay <= 0:
                    continue
            await asyncio.sleep(delay)

    def _lag(self) -> None:
        if self.metrics is not None:
            now = time.monotonic()
            self.metrics.kv_lag.set(max((now - v.updated_at for v in self.blocks.values()), default=0.0))

    def start(self) -> None:
        self._running = True
        self._sync_tasks()

    async def stop(self) -> None:
        self._running = False
        tasks, self._tasks = list(self._tasks.values()), {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
