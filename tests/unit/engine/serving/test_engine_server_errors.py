"""Issue 25: a 5xx names the request id, never the exception text (which can carry paths, tensor
shapes or another request's data); the cause is logged under that id."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from consort_engine.core.async_engine import EngineFailed
from consort_engine.serving.errors import ApiError
from consort_engine.serving.generation import admit
from consort_engine.serving.http import error_middleware

SECRET = "/var/lib/tenant-a/prompt.txt shape [4, 8192]"


async def test_an_unhandled_error_is_a_generic_500_with_the_request_id(caplog):
    async def boom(request):
        raise RuntimeError(SECRET)

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/boom", boom)
    async with TestClient(TestServer(app)) as client:
        with caplog.at_level(logging.ERROR, logger="consort.server"):
            r = await client.get("/boom", headers={"x-request-id": "rid-123"})
            body = await r.json()
    assert r.status == 500 and body["error"]["code"] == "internal_error"
    assert body["error"]["type"] == "server_error" and "rid-123" in body["error"]["message"]
    assert SECRET not in str(body) and "RuntimeError" not in str(body)
    assert "rid-123" in caplog.text and SECRET in caplog.text      # the cause is in the log, under the id


async def test_an_engine_failure_is_a_generic_5xx_with_the_request_id(caplog):
    class Failing:
        async def add(self, seqs):
            raise EngineFailed(f"engine step failed: {SECRET}")

    ctx = SimpleNamespace(engine=Failing())
    with caplog.at_level(logging.ERROR, logger="consort.server"), pytest.raises(ApiError) as e:
        await admit(ctx, [], "rid-9")
    assert (e.value.status, e.value.code) == (503, "engine_failed")
    assert "rid-9" in e.value.message and SECRET not in e.value.message
    assert SECRET in caplog.text and "rid-9" in caplog.text
