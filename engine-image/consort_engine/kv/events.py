"""Block events: what this engine's prefix cache holds, published so routers can route on it.

Every change to the set of reusable blocks is one event: `stored` / `removed`, on a medium, `pool`
(the engine's KV pool) or `tier` (the KV tier below it, kv/tier.py), with the blocks' hashes
(consort_common/block_hash.py: the router computes the same hashes from token ids). Events carry a sequence
number; the log keeps the latest `capacity` of them in a ring and, beside it, the set of hashes each
medium holds now.

A subscriber asks for the events after the last sequence number it saw (`since`) in this process's
`epoch` (a random id per start). When it cannot be answered exactly (another epoch: the engine
restarted; `since` older than the ring: the subscriber fell behind; no `since`: first contact) it
gets a snapshot instead: the held sets and the sequence number they are current at, taken under the
same lock as the events, so "snapshot, then events after its seq" is never a wrong index. Held sets
above `snapshot_cap` hashes are cut (`truncated`: the subscriber knows it misses some).

A subscriber that is caught up may also ask to be woken at the next event (`wake_on_event`): the
HTTP handler holds its request open until then or until its bounded wait ends (a long poll), so a
router learns where a prompt went as soon as the engine stored it, without polling often.

Thread-safe: the engine loop records, HTTP handlers read.
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MEDIA = ("pool", "tier")
KINDS = ("stored", "removed", "cleared")    # cleared: the medium holds nothing any more (tier turned off)
MAX_EVENTS_PER_REPLY = 4096
MAX_WAITERS = 256          # subscribers held waiting at once (a router holds one per engine)


@dataclass(frozen=True)
class BlockEvent:
    seq: int
    kind: str
    medium: str
    hashes: tuple[bytes, ...]
    time: float

    def to_json(self) -> dict:
        return {"seq": self.seq, "type": self.kind, "medium": self.medium,
                "hashes": [h.hex() for h in self.hashes], "time": round(self.time, 6)}


class KVEventLog:
    def __init__(self, capacity: int = 65536, snapshot_cap: int = 1 << 20) -> None:
        self.epoch = uuid.uuid4().hex
        self.snapshot_cap = snapshot_cap
        self._ring: deque[BlockEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._held: dict[str, set[bytes]] = {m: set() for m in MEDIA}
        self._lock = threading.Lock()
        self.snapshots_served = 0
        self.last_lag = 0          # events the last caught-up subscriber was behind when it asked
        self._waiters: list[Callable[[], None]] = []   # woken once at the next event, then dropped
        self._closed = False

    @property
    def seq(self) -> int:
        return self._seq

    def record(self, kind: str, medium: str, hashes: list[bytes] | tuple[bytes, ...] = ()) -> None:
        assert kind in KINDS and medium in MEDIA, (kind, medium)
        if not hashes and kind != "cleared":
            return
        with self._lock:
            held = self._held[medium]
            if kind == "stored":
                held.update(hashes)
            elif kind == "removed":
                held.difference_update(hashes)
            else:
                held.clear()
            self._seq += 1
            self._ring.append(BlockEvent(self._seq, kind, medium, tuple(hashes), time.time()))
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def wake_on_event(self, epoch: str | None, since: int | None, wake: Callable[[], None]) -> bool:
        """Call `wake` once, from the thread that records it, at the next event after `since` in `epoch`.
        False (nothing registered: read now) when a read would not come back empty: another epoch, no
        `since`, events after it already, or the log closed."""
        with self._lock:
            if self._closed or epoch != self.epoch or since != self._seq:
                return False
            self._waiters.append(wake)
            return True

    def forget_waiter(self, wake: Callable[[], None]) -> None:
        """A waiter whose wait ended without an event."""
        with self._lock:
            if wake in self._waiters:
                self._waiters.remove(wake)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def close(self) -> None:
        """The engine stops: wake every waiter now and let no more wait (a held request would hold up
        the drain)."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def held(self, medium: str) -> int:
        return len(self._held[medium])

    def read(self, epoch: str | None, since: int | None, limit: int = MAX_EVENTS_PER_REPLY) -> dict:
        """The reply to a subscriber that saw everything up to `since` in `epoch`: the events after it
        (at most `limit`; `more` says whether to ask again at once), or a snapshot."""
        with self._lock:
            oldest = self._ring[0].seq if self._ring else self._seq + 1
            exact = (epoch == self.epoch and since is not None and oldest - 1 <= since <= self._seq)
            if not exact:
                self.snapshots_served += 1
                snapshot, truncated = {}, False
                for medium, held in self._held.items():
                    hashes = list(held)
                    truncated |= len(hashes) > self.snapshot_cap
                    snapshot[medium] = [h.hex() for h in hashes[:self.snapshot_cap]]
                return {"epoch": self.epoch, "seq": self._seq, "snapshot": snapshot, "truncated": truncated}
            self.last_lag = self._seq - since
            start = since - (oldest - 1)       # ring index of the first event after `since`
            events = list(itertools.islice(self._ring, start, start + limit))
        last = events[-1].seq if events else since
        return {"epoch": self.epoch, "seq": last, "events": [e.to_json() for e in events],
                "more": last < self._seq}
