"""A faulty upstream for the failover tests: it passes the router's /ready and /v1/status polls
like an engine, then fails generation in one chosen way. Only the fault is fake; the router under
test is the real process. Run: python faulty_engine.py PORT MODE (http500 | hang_after_first_chunk | ok: a
fixed one-word completion, for tests of the router's own work)."""
from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web


def chunk(text: str) -> bytes:
    body = {"id": "cmpl-faulty", "object": "text_completion", "model": "faulty",
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def build(mode: str) -> web.Application:
    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def status(_: web.Request) -> web.Response:
        return web.json_response({"state": "ready", "waiting": 0, "running": 0, "preempting": False, "adapters": {}})

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        if mode == "http500":
            return web.json_response({"error": {"type": "server_error", "code": "boom", "message": "boom"}}, status=500)
        if mode == "ok":
            return web.json_response({"id": "cmpl-ok", "object": "text_completion", "model": "faulty",
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("first"))
        await asyncio.sleep(3600)   # hangs mid-stream: the router's idle timeout must end it
        return resp

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", ready)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


if __name__ == "__main__":
    web.run_app(build(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), print=None)
