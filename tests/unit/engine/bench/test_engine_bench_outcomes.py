"""Benchmarks count what a server under load answers instead of dying on it (issue 29).

`consort bench affinity` died with KeyError: 'choices' on a typed SSE error event once the router
started rejecting. Here a real aiohttp server on 127.0.0.1 answers as a router under admission
does: 429 with Retry-After (advised in the body, or only in the header, or not at all), a stream
that ends in a typed error event, a stream that goes quiet, and ordinary streams. The benchmarks'
own arm / load functions run against it and must finish and report each kind per arm.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from consort_common import openai_stream
from consort_engine.bench import serve as bench_serve
from consort_router import bench as router_bench
from consort_router import bench_affinity

engine_stream = router_stream = openai_stream   # the engine's and the router's benchmarks share it

Script = Callable[[int, dict], str]      # (request number, body) -> what to answer


def chunk(body: dict, text: str) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if "messages" in body else {"index": 0, "text": text}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def answer(request: web.Request, kind: str, body: dict) -> web.StreamResponse:
    """429-advised | 429-header | 429-bare | 503-warming | 400 | error-event | stall | malformed | truncated | ok"""
    if kind.startswith(("429", "503")):
        err = {"type": "admission_rejected", "code": "queue_full" if kind[0] == "4" else "warming"}
        headers = {}
        if kind in ("429-advised", "503-warming"):
            err["retry_after_ms"] = 20
            headers["Retry-After"] = "1"
        if kind == "429-header":
            headers["Retry-After"] = "0"
        return web.json_response({"error": err}, status=int(kind[:3]), headers=headers)
    if kind == "400":
        return web.json_response({"error": {"type": "invalid_request_error", "code": "bad_field"}}, status=400)
    if not body.get("stream"):
        return web.json_response({"choices": [{"index": 0, "text": "x y"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk(body, "first "))
    if kind == "error-event":      # the router's in-band error: no [DONE] follows
        await resp.write(b'data: {"error":{"type":"upstream_error","code":"upstream_failed","message":"x"}}\n\n')
        return resp
    if kind == "stall":
        await asyncio.sleep(3)
        return resp
    if kind == "malformed":
        await resp.write(b"data: {not json\n\n")
        return resp
    await resp.write(chunk(body, "second"))
    await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n')
    if kind != "truncated":
        await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def fake_router() -> AsyncIterator[Callable[[Script], str]]:
    """start(script) -> base URL of a server answering completions as `script` says, plus the
    /v1/status and /metrics bench affinity reads from its engines and router."""
    runners: list[web.AppRunner] = []

    async def start(script: Script) -> str:
        seen = 0

        async def completions(request: web.Request) -> web.StreamResponse:
            nonlocal seen
            body = await request.json()
            seen += 1
            return await answer(request, script(seen - 1, body), body)

        async def status(_request: web.Request) -> web.Response:
            return web.json_response({"prefix_cache_queries": 10 * seen, "prefix_cache_hits": 5 * seen})

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(text=f'consort_router_replica_choice_total{{outcome="affine"}} {seen}.0\n')

        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/status", status)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


def test_the_engine_and_router_benchmarks_read_streams_with_the_one_shared_reader():
    # The engine and the router never import each other; their benchmarks share consort_common's reader.
    assert bench_serve.openai_stream is router_bench.openai_stream is bench_affinity.openai_stream is openai_stream


@pytest.mark.parametrize("kind,outcome,retries,error", [
    ("ok", "ok", 0, ""),
    ("429-advised", "rejected", 2, "queue_full"),       # retried twice after 20 ms, then counted
    ("429-header", "rejected", 2, "queue_full"),        # Retry-After header only (0 s)
    ("429-bare", "rejected", 0, "queue_full"),          # no advice: counted at once
    ("503-warming", "rejected", 2, "warming"),
    ("400", "failed", 0, "bad_field"),
    ("error-event", "error_event", 0, "upstream_failed"),
    ("stall", "timeout", 0, "no byte for 0.3 s"),
    ("malformed", "failed", 0, "malformed event"),
    ("truncated", "failed", 0, "without data: [DONE]"),
])
async def test_request_classifies_every_answer(fake_router, kind, outcome, retries, error):
    url = await fake_router(lambda n, body: kind)
    policy = engine_stream.ClientPolicy(retries=2, max_retry_wait_s=0.05, idle_timeout_s=0.3)
    async with aiohttp.ClientSession() as session:
        res = await engine_stream.request(session, url + "/v1/completions",
                                          {"prompt": "p", "max_tokens": 2, "stream": True}, policy=policy)
    assert (res.outcome, res.retries) == (outcome, retries), res
    assert error in res.error
    if kind == "ok":
        assert res.text == "first second" and res.completion_tokens == 2 and len(res.itls) == 1
        assert res.ttft is not None and 0 < res.ttft <= res.e2e
    if kind == "error-event":
        assert res.text == "first "             # what came before the error is kept
    if kind.startswith(("429", "503")):
        assert res.status == int(kind[:3]) and res.retry_after_s == (None if kind == "429-bare" else
                                                                     0.0 if kind == "429-header" else 0.02)


async def test_a_rejection_is_retried_after_its_advice_and_then_answered(fake_router):
    url = await fake_router(lambda n, body: "429-advised" if n < 2 else "ok")
    async with aiohttp.ClientSession() as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await router_stream.request(session, url + "/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "hi"}], "stream": True})
        waited = loop.time() - t0
    assert (res.outcome, res.retries, res.text) == ("ok", 2, "first second")
    assert waited >= 0.04                  # two advised 20 ms waits (the 1 s header loses to the body's ms)


async def test_a_non_streamed_answer_is_read_whole(fake_router):
    url = await fake_router(lambda n, body: "ok")
    async with aiohttp.ClientSession() as session:
        res = await engine_stream.request(session, url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert (res.outcome, res.completion_tokens, res.text) == ("ok", 2, "x y")


def affinity_args(**over) -> argparse.Namespace:
    args = dict(seed=0, system_words=8, conversations=5, turns=2, max_tokens=4, retries=2, max_retry_wait=0.05,
                idle_timeout=0.3)
    return argparse.Namespace(**(args | over))


async def test_affinity_arm_counts_rejections_error_events_and_timeouts(fake_router):
    # The first answer advises a retry; the next three end whichever conversations get them.
    bad = ["429-advised", "429-bare", "error-event", "stall"]
    url = await fake_router(lambda n, body: bad[n] if n < len(bad) else "ok")
    args = affinity_args()
    r = await bench_affinity.run_arm("single", [url], [url], args)
    # three conversations end at their first turn, the other two run both turns
    assert (r["requests"], r["ok"], r["rejected"], r["error_events"], r["timeouts"], r["failed"], r["retries"]) \
        == (3 + 2 * 2, 4, 1, 1, 1, 0, 1), r
    assert r["hit_rate"] == 0.5 and r["outcomes"] == {"affine": 8} and not math.isnan(r["followup_ttft_p50_ms"])
    table = bench_affinity.report([r], args)
    header, row = table.splitlines()[1:3]
    assert header.split()[-6:] == ["rejected", "errors", "timeouts", "failed", "retries", "choices"]
    assert row.split()[-7:-1] == ["1", "1", "1", "0", "1", "affine"]


async def test_affinity_conversation_sends_the_answered_text_back(fake_router):
    sent: list[dict] = []
    url = await fake_router(lambda n, body: sent.append(body) or "ok")
    async with aiohttp.ClientSession() as session:
        turns = await bench_affinity.conversation(session, url, "sys", random.Random(0), 2, 4, 0.0)
    assert [t.ok for t in turns] == [True, True]
    assert sent[1]["messages"][2] == {"role": "assistant", "content": "first second"}


async def test_affinity_completions_resend_the_history_and_wait_at_the_gate(fake_router):
    """Completions conversations resend the history as one prompt; a gated turn starts only once every
    conversation still going reached it, after its action ran once with their prompts."""
    sent: list[dict] = []
    url = await fake_router(lambda n, body: sent.append(body) or "ok")
    ran: list[list[str]] = []

    async def action(prompts: list[str]) -> None:
        ran.append(list(prompts))
        assert len(sent) == 3                     # every first turn went out before the gate opened

    gate = bench_affinity.TurnGate(3, {1: action})
    async with aiohttp.ClientSession() as session:
        convs = await asyncio.gather(*(bench_affinity.conversation(
            session, url, "sys", random.Random(i), 2, 4, 0.01 * i, api="completions", gate=gate) for i in range(3)))
    assert all(t.ok for c in convs for t in c) and len(sent) == 6 and len(ran) == 1 and len(ran[0]) == 3
    firsts = {b["prompt"] for b in sent[:3]}
    for body in sent[3:]:
        head = body["prompt"].split(" first second\n\nUser: ")[0]
        assert head in firsts and body["prompt"] in ran[0] and body["stream_options"] == {"include_usage": True}


async def test_router_bench_one_counts_instead_of_failing(fake_router):
    url = await fake_router(lambda n, body: ["429-bare", "error-event", "ok"][n])
    async with aiohttp.ClientSession() as session:
        got = [await router_bench.one(session, url + "/v1/completions", {"prompt": "p", "stream": True}, {})
               for _ in range(3)]
    counts = router_stream.tally(got)
    assert (counts["rejected"], counts["error_event"], counts["ok"]) == (1, 1, 1)
    assert "rejected 1, error events 1" in router_stream.describe(counts)


async def test_bench_serve_reports_each_outcome(fake_router, capsys):
    kinds = ["429-advised", "429-bare", "error-event", "stall", "400"]
    url = await fake_router(lambda n, body: kinds[n] if n < len(kinds) else "ok")
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    args = p.parse_args(["--url", url, "--model", "m", "--requests", "8", "--concurrency", "1", "--output-min", "2",
                         "--output-max", "2", "--max-retry-wait", "0.05", "--idle-timeout", "0.3"])
    s = await bench_serve.run(args)
    assert s["outcomes"] == {"ok": 4, "rejected": 1, "error_event": 1, "timeout": 1, "failed": 1, "retries": 1}
    assert s["requests"] == 8 and s["ok"] == 4 and s["output_tokens"] == 4 * 2
    assert s["failures"] == {"429 queue_full": 1, "upstream_failed": 1, "no byte for 0.3 s": 1, "400 bad_field": 1}
    assert "outcomes      ok 4, rejected 1, error events 1, timeouts 1, failed 1, retries 1" in bench_serve.report(s)
