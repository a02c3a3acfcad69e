"""open_plan (consort_router/proxy.py) with the activator: the moment a lane's last engine stops for
idleness. The router's last poll still says the replica is ready, the activator lets the request
through, and the connection is refused: the request must be held and the lane woken, not answered
`503 no_ready_replica`. Real sockets on 127.0.0.1 (a closed port is the stopped engine, an aiohttp
app on that port the started one), the real Activator and proxy; the engine and its poller are
stand-ins, the race is the router's own."""
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from consort_router.activator import Activator
from consort_router.affinity import PrefixIndex
from consort_router.api import ApiError, parse_request
from consort_router.config import RouterConfig
from consort_router.metrics import RouterMetrics
from consort_router.plan import PlanInput, plan_request
from consort_router.proxy import open_plan
from consort_router.replicas import ReplicaState
from consort_router.routing import LaneView, RoutingTable
from consort_router.state import Lanes, Runtime


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_app() -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "c", "object": "text_completion", "model": "algo",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def config(url: str, **scale_from_zero) -> RouterConfig:
    return RouterConfig.model_validate({
        "ensemble": "e", "default_specialist": "algo", "activator": {"kind": "file", "dir": "wake"},
        "specialists": [{"name": "algo", "replicas": [url], "scale_from_zero": scale_from_zero or None}]})


async def send(cfg: RouterConfig, replica: ReplicaState, activator: Activator) -> tuple[str, int]:
    table = RoutingTable.build(cfg, None)
    runtime = Runtime(cfg, table, Path("."), {"algo": [replica]})
    req = parse_request({"model": "algo", "prompt": "int main() {", "max_tokens": 2}, "completion", None)
    plan = plan_request(cfg, table, req, PlanInput({"algo": LaneView()}, {}, shadow_room=False,
                                                   verifier_available=False))
    async with aiohttp.ClientSession() as session:
        target, up = await open_plan(session, runtime, plan, req, "/v1/completions", "rid-1", "default",
                                     Lanes(cfg), RouterMetrics(), PrefixIndex(64), activator,
                                     lambda lane: runtime.replicas.get(lane, []))
        status = up.response.status
        up.response.release()
        return target, status


def test_a_request_that_finds_the_last_engine_just_stopped_is_held_and_the_lane_woken():
    async def main() -> None:
        port = closed_port()
        url = f"http://127.0.0.1:{port}"
        # the router's last poll, from before the engine stopped for idleness
        replica = ReplicaState(url, "algo", ready=True, reason="ready", polled_at=time.monotonic())
        runner: list[web.AppRunner] = []
        wakes: list[str] = []

        async def wake(lane: str) -> None:   # what `consort up` (or the Specialist's /scale) does: start it
            wakes.append(lane)
            r = web.AppRunner(engine_app())
            await r.setup()
            await web.TCPSite(r, "127.0.0.1", port).start()
            runner.append(r)
            replica.ready, replica.reason = True, "ready"   # the poller's next round

        activator = Activator(wake, lambda lane: replica.ready, RouterMetrics())
        try:
            target, status = await asyncio.wait_for(send(config(url, hold_timeout_s=10), replica, activator), 10)
        finally:
            await activator.close()
            for r in runner:
                await r.cleanup()
        assert (target, status) == ("algo", 200)
        assert wakes == ["algo"]                  # held once, one ask for a replica
        assert len(activator.lanes["algo"].starts) == 1

    asyncio.run(main())


def test_a_lane_that_does_not_scale_to_zero_still_answers_no_ready_replica_at_once():
    async def main() -> None:
        url = f"http://127.0.0.1:{closed_port()}"
        replica = ReplicaState(url, "algo", ready=True, reason="ready")

        async def wake(lane: str) -> None:
            raise AssertionError("a lane without scale_from_zero is never woken")

        activator = Activator(wake, lambda lane: replica.ready, RouterMetrics())
        t0 = time.monotonic()
        with pytest.raises(ApiError) as e:
            await send(config(url), replica, activator)
        await activator.close()
        assert e.value.status == 503 and e.value.code == "no_ready_replica"
        assert time.monotonic() - t0 < 5 and not replica.ready

    asyncio.run(main())
