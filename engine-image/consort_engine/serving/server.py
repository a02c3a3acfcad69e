"""`consort engine`: one specialist's engine behind an OpenAI-compatible aiohttp server.

The routes and the app. Handlers are thin and follow a request's stages: prepare.py parses the body
(one pydantic model per endpoint: request_models.py, tokenize_request.py), checks it against the
model and tokenizes it; generation.py admits its sequences and turns engine outputs into text deltas;
a renderer per API family (render_completions.py, render_responses.py, render_tokenize.py) shapes
them into JSON or SSE. context.py holds what every route reads, http.py the middlewares and body
reading, errors.py the typed errors, cli.py the command line.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from consort_engine.core.async_engine import EngineFailed
from consort_engine.model.lora import AdapterError
from consort_engine.serving.context import CTX, STREAM, TENANT_HEADER, ServerContext
from consort_engine.serving.errors import ApiError, bad, not_ready, server_error
from consort_engine.serving.generation import admit_choices, make_choices, merged, record
from consort_engine.serving.http import credential_middleware, error_middleware, read_json, request_id, stamp_headers
from consort_engine.serving.prepare import check_token_ids, prepare, render_chat
from consort_engine.serving.render_completions import full_response, stream_response
from consort_engine.serving.render_responses import responses_reply
from consort_engine.serving.render_tokenize import detokenize_reply, tokenize_reply
from consort_engine.serving.request_models import AdapterLoadBody
from consort_engine.serving.tokenize_request import TokenizeRequest, parse_detokenize, parse_tokenize
from consort_engine.kv.events import MAX_EVENTS_PER_REPLY, MAX_WAITERS, KVEventLog

MAX_KV_WAIT_S = 30.0       # the longest a block-events request may be held (a router asks for less)

log = logging.getLogger("consort.server")


# ---------------------------------------------------------------------------------------------
# handlers


async def handle_generation(request: web.Request, kind: str) -> web.StreamResponse:
    """completion | chat | responses: prepare (parse, check, tokenize), admit, render."""
    ctx: ServerContext = request.app[CTX]
    arrival = time.monotonic()
    rid = request_id(request)
    prepared = await prepare(ctx, kind, await request.read(), request.headers.get(TENANT_HEADER))
    req = prepared.req
    req.request_id = rid
    request["consort_adapter"] = req.adapter
    if req.ignored_fields:
        request["ignored_fields"] = req.ignored_fields
        log.info("request %s: ignored unknown fields %s", rid, ", ".join(req.ignored_fields))
    choices = make_choices(ctx, prepared, arrival)
    ctx.in_flight += 1
    try:
        await admit_choices(ctx, choices, rid)
        deltas = merged(choices)
        if prepared.responses_body is not None:
            return await responses_reply(request, ctx, prepared.responses_body, choices, deltas, rid)
        if req.stream:
            return await stream_response(request, ctx, req, choices, deltas)
        return await full_response(ctx, req, choices, deltas)
    except EngineFailed as e:
        raise server_error(rid, "engine_failed", "the engine failed while serving this request", e)
    except ConnectionResetError:
        if STREAM not in request:
            raise
        # The client left mid-stream (a benchmark tool cancels every in-flight request when its run ends):
        # not a server error, so no traceback. The choices are unfinished: the finally aborts them.
        log.info("request %s: client disconnected mid-stream", rid)
        return request[STREAM]
    finally:
        ctx.in_flight -= 1
        ctx.last_request = time.monotonic()
        for c in choices:
            record(ctx, c)


async def responses(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "responses")


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "chat")


async def health(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    return web.json_response({"status": "alive", "state": ctx.engine.state})


async def ready(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    state = ctx.engine.state
    adapters = ctx.adapters_state()
    pending = ctx.pending_adapters()
    if state == "ready" and not pending:
        return web.json_response({"status": "ready", "specialist": ctx.config.name, "startup_s": ctx.startup_s})
    reason = {"starting": "engine starting", "loading": "loading the model", "warming": "warming up",
              "failed": f"engine failed: {ctx.engine.error}", "stopped": "engine stopped"}.get(state, state)
    if state == "ready":
        reason = f"adapters not loaded: {', '.join(pending)}"
    return web.json_response({"status": "not_ready", "state": state, "reason": reason, "adapters": adapters},
                             status=503)


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[CTX].status())


def model_cards(ctx: ServerContext) -> list[dict]:
    """The base model and each loaded adapter (`root`: where its weights came from; `parent`: an
    adapter's base), as vLLM lists them."""
    created = ctx.created
    data = [{"id": ctx.served_name, "object": "model", "created": created, "owned_by": "consort",
             "root": ctx.config.model, "parent": None, "max_model_len": ctx.max_model_len,
             "specialist": ctx.config.name}]
    paths = ctx.engine.stats().get("adapter_paths") or {}
    data += [{"id": f"{ctx.served_name}:{name}", "object": "model", "created": created, "owned_by": "consort",
              "root": paths.get(name, ctx.config.adapters.get(name)), "parent": ctx.served_name,
              "max_model_len": ctx.max_model_len, "adapter": name}
             for name in sorted(ctx.adapters_state())]
    return data


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": model_cards(request.app[CTX])})


async def model_card(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    req = TokenizeRequest(model=request.match_info["model_id"])
    ctx.check_target(req)       # the same names a request may use: the served name, aliases, adapters
    want = ctx.served_name if req.adapter is None else f"{ctx.served_name}:{req.adapter}"
    return web.json_response(next(c for c in model_cards(ctx) if c["id"] == want))


async def tokenize(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    req = parse_tokenize(await read_json(request))
    ctx.check_target(req)
    if req.ignored_fields:
        request["ignored_fields"] = req.ignored_fields

    def run() -> list[int]:
        text = (req.prompt or "") if req.messages is None else render_chat(ctx.tokenizer, req)
        return ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    return tokenize_reply(ctx, req, await asyncio.to_thread(run))


async def detokenize(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    body = parse_detokenize(await read_json(request))
    ctx.check_target(TokenizeRequest(model=body.model, adapter=body.adapter))
    check_token_ids(body.tokens, ctx.vocab_size, "tokens")
    return detokenize_reply(await asyncio.to_thread(ctx.tokenizer.decode, body.tokens, False))


async def version(request: web.Request) -> web.Response:
    try:
        v = importlib.metadata.version("consort")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree that is not installed
        v = "unknown"
    return web.json_response({"version": v})


ADAPTER_STATUS = {"invalid_adapter": 422, "adapter_exists": 409, "max_adapters": 409, "adapter_in_use": 409,
                  "adapter_not_found": 404}


async def _adapter_call(ctx: ServerContext, fn, param: str) -> Any:
    """Run an adapter change on the engine thread between steps; AdapterError -> typed 4xx."""
    if not ctx.engine.ready:
        raise not_ready("the engine is not ready; load adapters once /ready is 200")
    try:
        return await ctx.engine.call(fn)
    except AdapterError as e:
        raise bad(e.code, str(e), param, status=ADAPTER_STATUS.get(e.code, 422))


async def load_adapter(request: web.Request) -> web.Response:
    """POST /v1/adapters {"name": ..., "path": PEFT dir}: hot-load a LoRA adapter."""
    ctx: ServerContext = request.app[CTX]
    body = AdapterLoadBody.model_validate(await read_json(request))
    await _adapter_call(ctx, lambda engine: engine.load_adapter(body.name, body.path), "path")
    log.info("adapter %s loaded from %s", body.name, body.path)
    return web.json_response({"name": body.name, "path": body.path, "state": "loaded"})


async def unload_adapter(request: web.Request) -> web.Response:
    """DELETE /v1/adapters/{name}: unload an adapter no request uses (409 while one does)."""
    ctx: ServerContext = request.app[CTX]
    name = request.match_info["name"]
    dropped = await _adapter_call(ctx, lambda engine: engine.unload_adapter(name), "name")
    log.info("adapter %s unloaded (%d cached blocks dropped)", name, dropped)
    return web.json_response({"name": name, "state": "unloaded", "dropped_cached_blocks": dropped})


async def kv_events(request: web.Request) -> web.Response:
    """GET /v1/kv/events?epoch=E&since=N[&wait=S]: this engine's block events after N in epoch E, or a
    snapshot of the blocks it holds when it cannot answer that exactly (kv/events.py; docs/kv-cache.md).
    With `wait` (seconds, at most MAX_KV_WAIT_S) and nothing after N yet, the reply waits for the next
    event or the end of the wait, whichever comes first (a long poll; empty `events` at the end)."""
    ctx: ServerContext = request.app[CTX]
    log_ = getattr(ctx.engine.engine, "kv_events", None)
    if log_ is None:
        raise not_ready("the engine is still loading; no block events yet")
    q = request.query
    unknown = sorted(set(q) - {"epoch", "since", "limit", "wait"})
    if unknown:
        raise bad("unknown_parameter", f"unknown query parameters: {', '.join(unknown)}", unknown[0])
    epoch = q.get("epoch")
    if epoch is not None and len(epoch) > 64:
        raise bad("invalid_epoch", "epoch is at most 64 characters (the value a reply gave)", "epoch")
    wait = kv_wait_seconds(q.get("wait"))
    since = limit = None
    for name in ("since", "limit"):
        text = q.get(name)
        if text is None:
            continue
        if not text.isdigit() or len(text) > 18:
            raise bad(f"invalid_{name}", f"{name} must be a non-negative integer", name)
        if name == "since":
            since = int(text)
        else:
            limit = min(max(int(text), 1), MAX_EVENTS_PER_REPLY)
    if wait > 0:
        await wait_for_kv_event(log_, epoch, since, wait)
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: json.dumps(log_.read(epoch, since, limit or MAX_EVENTS_PER_REPLY)))
    return web.Response(text=body, content_type="application/json")


def kv_wait_seconds(text: str | None) -> float:
    """The `wait` of a block-events request: 0 (answer at once) unless given, at most MAX_KV_WAIT_S."""
    if text is None:
        return 0.0
    try:
        wait = float(text) if len(text) <= 16 else math.nan
    except ValueError:
        wait = math.nan
    if not 0 <= wait <= MAX_KV_WAIT_S:     # NaN fails this too
        raise bad("invalid_wait", f"wait must be a number of seconds from 0 to {MAX_KV_WAIT_S:g}", "wait")
    return wait


async def wait_for_kv_event(log_: KVEventLog, epoch: str | None, since: int | None, wait: float) -> None:
    """Hold a caught-up subscriber until the next block event or `wait` seconds; at once when there is
    something to read already (events after `since`, or a snapshot to send)."""
    if log_.waiting >= MAX_WAITERS:
        raise ApiError(429, "too_many_waiters", f"{MAX_WAITERS} block-event subscribers wait already; "
                       "retry later", "wait", type="rate_limit_error", retry_after_ms=1000)
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(woken.set)

    if not log_.wake_on_event(epoch, since, wake):
        return
    try:
        await asyncio.wait_for(woken.wait(), wait)
    except TimeoutError:
        pass
    finally:
        log_.forget_waiter(wake)


async def end_kv_waits(app: web.Application) -> None:
    """On shutdown: held block-event requests answer now, so they do not hold up the drain."""
    log_ = getattr(app[CTX].engine.engine, "kv_events", None)
    if log_ is not None:
        log_.close()


async def kv_tokenizer(request: web.Request) -> web.Response:
    """GET /v1/kv/tokenizer: the checkpoint's tokenizer.json, the BOS rule and the chat template this engine
    tokenizes and renders prompts with, so a router computes the same token ids and block hashes
    (Tokenizer.published; docs/prefix-affinity.md)."""
    ctx: ServerContext = request.app[CTX]

    def read() -> str:
        return json.dumps(ctx.tokenizer.published((Path(ctx.config.model) / "tokenizer.json").read_text()))

    return web.Response(text=await asyncio.to_thread(read), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[CTX].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def build_app(ctx: ServerContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware, credential_middleware],
                          client_max_size=ctx.config.max_body_bytes)
    app[CTX] = ctx
    app.on_response_prepare.append(stamp_headers)
    app.on_shutdown.append(end_kv_waits)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id}", model_card)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/adapters", load_adapter)
    app.router.add_delete("/v1/adapters/{name}", unload_adapter)
    app.router.add_get("/v1/kv/events", kv_events)
    app.router.add_get("/v1/kv/tokenizer", kv_tokenizer)
    app.router.add_get("/metrics", metrics)
    return app
