"""The router's view of each replica's KV blocks, fed by the engine's real event log (KVEventLog)."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from consort_common.block_hash import prefix_hashes, prefix_salt
from consort_engine.kv.events import KVEventLog
from consort_router.affinity import Affinity, PrefixIndex
from consort_router.kv_index import EXPECT_S, TIER_WEIGHT, KVSubscriber, ReplicaBlocks

H = prefix_hashes(list(range(64)), 16, "spec")      # four chained block hashes


def follow(log: KVEventLog, view: ReplicaBlocks, limit: int = 4096) -> dict:
    """One subscriber round trip, as KVSubscriber asks."""
    reply = log.read(view.epoch, view.seq, limit)
    view.apply(reply)
    return reply


def test_first_contact_is_a_snapshot_then_events_follow():
    log, view = KVEventLog(), ReplicaBlocks(max_hashes=100)
    log.record("stored", "pool", H[:2])
    assert "snapshot" in follow(log, view)
    assert view.depth(H) == 2
    log.record("stored", "pool", H[2:])
    log.record("removed", "pool", [H[1]])
    log.record("stored", "tier", [H[1]])
    reply = follow(log, view)
    assert "events" in reply and len(reply["events"]) == 3
    assert view.depth(H) == 1 + TIER_WEIGHT + 2     # block 1 only in the tier counts for less
    assert view.snapshots == 1 and view.events == 3
    log.record("cleared", "tier")
    follow(log, view)
    assert view.depth(H) == 1                       # the chain stops at the block held nowhere


def test_a_gap_gets_a_snapshot_that_replaces_the_view():
    log, view = KVEventLog(capacity=4), ReplicaBlocks(max_hashes=100)
    follow(log, view)
    for h in H:                                     # more events than the ring keeps
        log.record("stored", "pool", [h])
    log.record("removed", "pool", [H[0]])
    reply = follow(log, view)
    assert "snapshot" in reply and view.snapshots == 2
    assert set(view.held["pool"]) == set(H[1:]) and view.depth(H) == 0


def test_a_prompt_this_router_sent_is_expected_there_until_the_events_say_or_the_deadline_passes():
    """A follow-up turn sent before the next events poll still finds its prefix on the replica its
    first turn went to; the engine's own events then replace the guess, and an unconfirmed guess
    (a failed prefill) lapses."""
    log, here, there = KVEventLog(), ReplicaBlocks(max_hashes=100), ReplicaBlocks(max_hashes=100)
    follow(log, here)
    sent = Affinity(H, {}, 4.0, precise=True, views={"http://here": here, "http://there": there})
    sent.sent("http://here", PrefixIndex(16))
    assert here.depth(H) == 4 and there.depth(H) == 0
    assert here.depth(H, now=time.monotonic() + EXPECT_S + 1) == 0          # never confirmed: gone
    log.record("stored", "pool", H[:2])
    follow(log, here)                                                        # confirmed: held for good
    assert here.depth(H[:2], now=time.monotonic() + EXPECT_S + 1) == 2 and set(here.expected) == set(H[2:])
    log.record("removed", "pool", [H[0]])
    follow(log, here)
    assert here.depth(H) == 0                                                # the engine's word wins


def test_an_engine_restart_new_epoch_is_a_snapshot():
    old, view = KVEventLog(), ReplicaBlocks(max_hashes=100)
    old.record("stored", "pool", H)
    follow(old, view)
    new = KVEventLog()                               # the engine restarted: empty cache, new epoch
    new.record("stored", "pool", H[:1])
    assert "snapshot" in follow(new, view)
    assert view.epoch == new.epoch and view.depth(H) == 1


def test_events_of_another_epoch_are_refused_and_leave_the_view():
    log, view = KVEventLog(), ReplicaBlocks(max_hashes=100)
    log.record("stored", "pool", H)
    follow(log, view)
    with pytest.raises(ValueError):
        view.apply({"epoch": "other", "seq": 9, "events": []})
    with pytest.raises(ValueError):
        view.apply({"epoch": log.epoch, "seq": 9, "events": [{"type": "stored", "medium": "disk", "hashes": []}]})
    with pytest.raises(ValueError):
        view.apply({"epoch": log.epoch, "seq": 9, "events": [{"type": "stored", "medium": "pool", "hashes": ["zz"]}]})
    assert view.depth(H) == 4 and view.epoch == log.epoch


def test_the_view_is_capped_oldest_stored_forgotten_first():
    log, view = KVEventLog(), ReplicaBlocks(max_hashes=3)
    follow(log, view)
    log.record("stored", "pool", H)
    follow(log, view)
    assert list(view.held["pool"]) == list(H[1:]) and view.dropped == 1
    assert view.depth(H) == 0                       # its first block forgotten: no prefix match (a miss, not wrong)
    assert view.depth(H[1:]) == 3


async def test_subscriber_polls_an_engine_route_pages_and_forgets_replicas_that_left():
    log = KVEventLog()
    seen: list[dict] = []

    async def events(request: web.Request) -> web.Response:
        seen.append(dict(request.query) | {"auth": request.headers.get("Authorization")})
        q = request.query
        return web.json_response(log.read(q.get("epoch"), int(q["since"]) if "since" in q else None,
                                          int(q.get("limit", 4096))))

    app = web.Application()
    app.router.add_get("/v1/kv/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer engine-secret"}) as session:
            sub = KVSubscriber(session, retry_s=0.05, timeout_s=2, max_hashes=100, limit=1)
            sub.track({url})
            assert await sub.poll_one(url) == 1     # the snapshot
            assert sub.blocks[url].snapshots == 1 and seen[-1]["auth"] == "Bearer engine-secret"
            for h in H:
                log.record("stored", "pool", [h])
            seen.clear()
            assert await sub.poll_one(url) == 4     # limit 1: pages while `more`, at most PAGES_PER_ROUND
            assert len(seen) == 4 and sub.blocks[url].depth(H) == 4
            assert seen[0]["since"] == "0" and seen[-1]["since"] == "3"
            sub.track(set())
            assert url not in sub.blocks
    finally:
        await runner.cleanup()


async def test_router_routes_precisely_only_while_every_ready_replica_is_followed():
    """Router.affinity: engine block hashes scored from the views while each ready replica has one and
    they share a block size; the character-hash guess otherwise (and for chat)."""
    from consort_router.api import ParsedRequest
    from consort_router.config import RouterConfig
    from consort_router.router import Router

    cfg = RouterConfig.model_validate({"ensemble": "e", "default_specialist": "A",
                                       "specialists": [{"name": "A", "replicas": ["http://a", "http://b"]}]})
    router = Router(cfg)
    a, b = router.replicas_now("A")
    for r in (a, b):
        r.ready, r.block_size = True, 16
    ids = list(range(64))
    req = ParsedRequest({"prompt": ids}, None, None, 0, False, "")
    router.kv = KVSubscriber(None, 1, 1, max_hashes=100)     # views set by hand: no polling here
    log = KVEventLog()
    log.record("stored", "pool", prefix_hashes(ids, 16, "A", None, prefix_salt("t", None))[:3])
    router.kv.blocks[b.url] = ReplicaBlocks(100)
    router.kv.blocks[b.url].apply(log.read(None, None))
    assert not (await router.affinity(cfg, req, "A", None, "t")).precise      # a is not followed yet
    router.kv.blocks[a.url] = ReplicaBlocks(100)
    router.kv.blocks[a.url].apply(KVEventLog().read(None, None))
    aff = await router.affinity(cfg, req, "A", None, "t")
    assert aff.precise and aff.depth == {b.url: 3} and len(aff.hashes) == 4
    assert (await router.affinity(cfg, req, "A", None, "other-tenant")).depth == {}
    assert (await router.affinity(cfg, req, "A", "lora", "t")).depth == {}
    a.block_size = 32                                                      # replicas cut blocks differently
    assert not (await router.affinity(cfg, req, "A", None, "t")).precise
    a.block_size = 16
    chat = ParsedRequest({"messages": [{"role": "user", "content": "x" * 4000}]}, None, None, 0, False, "x" * 4000)
    assert not (await router.affinity(cfg, chat, "A", None, "t")).precise
    off = cfg.model_copy(update={"replica_choice": cfg.replica_choice.model_copy(update={"kv_events": False})})
    assert not (await router.affinity(off, req, "A", None, "t")).precise


def test_a_replica_that_is_not_ready_is_not_polled():
    calls: list[str] = []

    class Session:
        def get(self, url, **_):
            calls.append(url)
            raise AssertionError("a warming replica was polled")

    async def go() -> None:
        sub = KVSubscriber(Session(), 0.01, 1.0, 16, is_ready=lambda url: url.endswith(":2"))
        sub.track({"http://127.0.0.1:1"})
        sub.start()
        await asyncio.sleep(0.1)
        await sub.stop()

    asyncio.run(go())
    assert calls == []


async def serve(handler, keys: dict | None = None) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for key, value in (keys or {}).items():
        app[key] = value
    app.router.add_get("/v1/kv/events", handler)
    runner = web.AppRunner(app, handler_cancellation=True)     # as the engine runs it
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def until(check, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, "not within the timeout"
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def test_subscriber_holds_one_long_poll_per_replica_and_drops_a_replica_that_left():
    """The engine's own handler (a long poll over the real event log): an event reaches the view while
    the request is held, long before the retry delay; one request per replica at a time."""
    from types import SimpleNamespace

    from consort_engine.serving.context import CTX
    from consort_engine.serving.server import kv_events

    log = KVEventLog()
    held = {"now": 0, "most": 0, "waits": []}

    async def handler(request: web.Request) -> web.Response:
        held["now"] += 1
        held["most"] = max(held["most"], held["now"])
        held["waits"].append(request.query.get("wait"))
        try:
            return await kv_events(request)
        finally:
            held["now"] -= 1

    runner, url = await serve(handler, {CTX: SimpleNamespace(engine=SimpleNamespace(engine=SimpleNamespace(kv_events=log)))})
    retry_s = 2.0
    try:
        async with aiohttp.ClientSession() as session:
            sub = KVSubscriber(session, retry_s=retry_s, timeout_s=2, max_hashes=100, wait_s=20)
            sub.track({url})
            sub.start()
            await until(lambda: url in sub.blocks and sub.blocks[url].snapshots == 1)
            await until(lambda: log.waiting == 1)          # caught up: held on the engine
            log.record("stored", "pool", list(H[:3]))
            lag = await until(lambda: sub.blocks[url].depth(H) == 3)
            assert lag < retry_s                           # pushed, not found by a later poll
            await until(lambda: log.waiting == 1)
            assert held["most"] == 1 and held["waits"][0] is None and held["waits"][-1] == "20"
            sub.track(set())                               # the replica left: its request goes too
            await until(lambda: held["now"] == 0 and log.waiting == 0)
            assert url not in sub.blocks and not sub._tasks
            await sub.stop()
    finally:
        await runner.cleanup()


async def test_subscriber_backs_off_a_failing_engine_and_polls_one_without_the_long_poll():
    calls: list[str | None] = []

    async def failing(request: web.Request) -> web.Response:
        calls.append(request.query.get("wait"))
        return web.json_response({"error": {"code": "boom"}}, status=500)

    runner, url = await serve(failing)
    try:
        async with aiohttp.ClientSession() as session:
            sub = KVSubscriber(session, retry_s=0.05, timeout_s=2, max_hashes=100, wait_s=5)
            sub.track({url})
            sub.start()
            await asyncio.sleep(0.7)
            await sub.stop()
        # 0.05, 0.1, 0.2, 0.4 s apart: about 4 requests, where a fixed 0.05 s retry would make 14
        assert 2 <= len(calls) <= 6 and sub.errors == len(calls)
    finally:
        await runner.cleanup()

    log = KVEventLog()
    asked: list[dict] = []

    async def before_the_long_poll(request: web.Request) -> web.Response:
        q = dict(request.query)
        asked.append(q)
        if "wait" in q:
            return web.json_response({"error": {"code": "unknown_parameter"}}, status=400)
        return web.json_response(log.read(q.get("epoch"), int(q["since"]) if "since" in q else None))

    runner, url = await serve(before_the_long_poll)
    try:
        async with aiohttp.ClientSession() as session:
            sub = KVSubscriber(session, retry_s=0.05, timeout_s=2, max_hashes=100, wait_s=5)
            sub.track({url})
            sub.start()
            await until(lambda: url in sub.polled)
            log.record("stored", "pool", list(H[:2]))
            await until(lambda: sub.blocks[url].depth(H) == 2)
            await sub.stop()
        assert sum("wait" in q for q in asked) == 1 and sub.errors == 0
    finally:
        await runner.cleanup()
