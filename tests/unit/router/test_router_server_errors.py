"""Issue 25: the router's 5xx answers name the request id, never exception text or upstream addresses."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from consort_router import server as S

SECRET = "Cannot connect to host 10.1.2.3:8000 [tenant-a /var/run/secret]"


async def test_an_unhandled_error_is_a_generic_500_with_the_request_id(caplog):
    async def boom(request):
        raise RuntimeError(SECRET)

    app = web.Application(middlewares=[S.middleware])
    app[S.ROUTER] = SimpleNamespace(keys=SimpleNamespace(enabled=False))
    app.router.add_get("/boom", boom)
    async with TestClient(TestServer(app)) as client:
        with caplog.at_level(logging.ERROR, logger="consort.router"):
            r = await client.get("/boom", headers={"x-request-id": "rid-7"})
            body = await r.json()
    assert r.status == 500 and body["error"]["code"] == "internal_error" and body["error"]["type"] == "server_error"
    assert "rid-7" in body["error"]["message"] and SECRET not in str(body) and "RuntimeError" not in str(body)
    assert "rid-7" in caplog.text and SECRET in caplog.text
