"""Block events: a subscriber follows the ring exactly, and catches up after a gap with a snapshot."""
from __future__ import annotations

from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.events import KVEventLog
from consort_engine.kv.sequence import SamplingParams, Sequence


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Subscriber:
    """What a router keeps per engine: the held hashes per medium, rebuilt from replies."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.since: int | None = None
        self.held: dict[str, set[str]] = {}
        self.snapshots = 0

    def poll(self, log: KVEventLog, limit: int = 4096) -> None:
        while True:
            reply = log.read(self.epoch, self.since, limit)
            self.epoch, self.since = reply["epoch"], reply["seq"]
            if "snapshot" in reply:
                self.snapshots += 1
                self.held = {m: set(hs) for m, hs in reply["snapshot"].items()}
                return
            for e in reply["events"]:
                held = self.held.setdefault(e["medium"], set())
                if e["type"] == "stored":
                    held.update(e["hashes"])
                elif e["type"] == "removed":
                    held.difference_update(e["hashes"])
                else:
                    held.clear()
            if not reply["more"]:
                return


def truth(log: KVEventLog) -> dict[str, set[str]]:
    return {m: set(hs) for m, hs in log.read(None, None)["snapshot"].items()}


def test_a_subscriber_that_keeps_up_sees_every_event_and_no_snapshot_after_the_first():
    log = KVEventLog(capacity=100)
    sub = Subscriber()
    sub.poll(log)
    assert sub.snapshots == 1
    log.record("stored", "pool", [h(1), h(2), h(3)])
    log.record("removed", "pool", [h(2)])
    log.record("stored", "tier", [h(2)])
    sub.poll(log, limit=1)      # paged: one event per reply, `more` until caught up
    assert sub.snapshots == 1
    assert sub.held == truth(log) == {"pool": {h(1).hex(), h(3).hex()}, "tier": {h(2).hex()}}


def test_after_a_gap_longer_than_the_ring_the_subscriber_gets_a_snapshot_not_a_wrong_index():
    log = KVEventLog(capacity=8)
    sub = Subscriber()
    sub.poll(log)
    log.record("stored", "pool", [h(0)])
    sub.poll(log)
    for i in range(1, 40):          # the ring forgets the events the subscriber missed
        log.record("stored", "pool", [h(i)])
        log.record("removed", "pool", [h(i - 1)])
    sub.poll(log)
    assert sub.snapshots == 2
    assert sub.held == truth(log) == {"pool": {h(39).hex()}, "tier": set()}
    log.record("cleared", "pool")
    sub.poll(log)
    assert sub.snapshots == 2 and sub.held["pool"] == set()


def test_another_epoch_or_a_future_seq_gets_a_snapshot():
    log = KVEventLog()
    log.record("stored", "pool", [h(1)])
    assert "snapshot" in log.read("other-epoch", 1)
    assert "snapshot" in log.read(log.epoch, 5)       # a seq this process never gave out
    assert log.read(log.epoch, 1)["events"] == []
    assert KVEventLog().epoch != log.epoch           # a restart is another epoch


def test_snapshot_is_capped_and_says_so():
    log = KVEventLog(snapshot_cap=3)
    log.record("stored", "pool", [h(i) for i in range(5)])
    reply = log.read(None, None)
    assert reply["truncated"] and len(reply["snapshot"]["pool"]) == 3


def test_block_manager_publishes_what_its_cache_can_find():
    log = KVEventLog()
    bm = BlockManager(4, 2, namespace="spec", events=log)
    sub = Subscriber()
    sub.poll(log)
    a = Sequence([1, 2, 3, 4, 5], SamplingParams())
    bm.allocate(a)
    a.num_computed_tokens = a.num_tokens
    bm.cache_computed_blocks(a)
    bm.free(a)
    sub.poll(log)
    assert sub.held["pool"] == {x.hex() for x in bm._by_hash}
    assert len(sub.held["pool"]) == 2
    b = Sequence([9, 9, 9, 9, 9, 9, 9], SamplingParams())   # needs all 4 blocks: evicts a's cached ones
    bm.allocate(b)
    sub.poll(log)
    assert sub.held["pool"] == set()
    assert sub.snapshots == 1


def test_a_caught_up_waiter_is_woken_once_at_the_next_event_and_all_at_close():
    log = KVEventLog(capacity=16)
    woken: list[str] = []
    log.record("stored", "pool", [h(1)])
    assert not log.wake_on_event(log.epoch, 0, lambda: woken.append("behind"))      # events to read now
    assert not log.wake_on_event("another epoch", log.seq, lambda: woken.append("epoch"))   # a snapshot now
    assert not log.wake_on_event(log.epoch, None, lambda: woken.append("first"))
    assert log.wake_on_event(log.epoch, log.seq, lambda: woken.append("a"))
    gone = lambda: woken.append("gone")   # noqa: E731 - a waiter whose wait ended
    assert log.wake_on_event(log.epoch, log.seq, gone)
    log.forget_waiter(gone)
    assert log.waiting == 1 and woken == []
    log.record("removed", "pool", [h(1)])
    log.record("stored", "pool", [h(2)])
    assert woken == ["a"] and log.waiting == 0       # once, then dropped
    assert log.wake_on_event(log.epoch, log.seq, lambda: woken.append("b"))
    log.close()                                      # the engine stops: nobody is left holding
    assert woken == ["a", "b"] and log.waiting == 0
    assert not log.wake_on_event(log.epoch, log.seq, lambda: woken.append("late"))
