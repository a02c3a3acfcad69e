"""`consort engine`: one specialist's engine behind an OpenAI-compatible aiohttp server.

The routes and the app. Handlers are thin: protocol.py parses and validates, generation.py admits
the request's sequences and turns engine outputs into text deltas, render.py shapes them into JSON
or SSE; context.py holds what every route reads, http.py the middlewares and body parsing, cli.py
the command line.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from consort_engine.serving import protocol as P
from consort_engine.serving import responses as R
from consort_engine.text import tool_calls as T
from consort_engine.core.async_engine import EngineFailed
from consort_engine.model.lora import AdapterError
from consort_engine.kv.events import MAX_EVENTS_PER_REPLY
from consort_engine.kv.sequence import Sequence
from consort_engine.serving.context import CTX, STREAM, ServerContext, TENANT_HEADER
from consort_engine.serving.generation import (Choice, RequestTimes, admit_choices, build_prompt, check_target,
                                               compile_guided, merged, record, render_chat)
from consort_engine.serving.http import (OFF_LOOP_BYTES, credential_middleware, decode_json, error_middleware,
                                         read_json, request_id, server_error, stamp_headers)
from consort_engine.serving.render import sse_event, full_response, stream_response, usage_of

log = logging.getLogger("consort.server")


# ---------------------------------------------------------------------------------------------
# handlers


async def handle_generation(request: web.Request, kind: str) -> web.StreamResponse:
    ctx: ServerContext = request.app[CTX]
    arrival = time.monotonic()
    rid = request_id(request)
    raw = await request.read()

    def prepare() -> tuple[P.GenerationRequest, list[tuple[P.GenerationRequest, list[int]]]]:
        body = decode_json(raw)
        if kind == "responses":
            request["responses_body"] = body
            body = R.to_chat(body)
        req = P.parse_completion(body) if kind == "completion" else P.parse_chat(body)
        check_target(ctx, req)
        P.check_vocab(req.sampling, ctx.vocab_size)
        per_prompt = [replace(req, prompt=p if isinstance(p, str) else None,
                              prompt_token_ids=p if isinstance(p, list) else None) for p in req.prompts] or [req]
        return req, [(r, build_prompt(ctx, r)) for r in per_prompt]

    req, prompts = await asyncio.to_thread(prepare) if len(raw) > OFF_LOOP_BYTES else prepare()
    if req.sampling.guided is not None:
        await compile_guided(ctx, req.sampling.guided)
    req.request_id = rid
    request["consort_adapter"] = req.adapter
    if req.ignored_fields:
        request["ignored_fields"] = req.ignored_fields
        log.info("request %s: ignored unknown fields %s", req.request_id, ", ".join(req.ignored_fields))
    deadline = arrival + req.deadline_ms / 1000.0 if req.deadline_ms is not None else None
    choices = []
    salt = P.prefix_salt(request.headers.get(TENANT_HEADER), req.cache_salt)
    k = P.samples_per_prompt(req)
    # best_of ranks by the sampled tokens' logprobs, so those are computed even when not returned
    logprobs = req.logprobs if req.best_of is None else (req.logprobs or 0)
    for i, (preq, ids) in enumerate(prompts):
        max_tokens = max(1, P.resolve_max_tokens(preq, len(ids), ctx.max_model_len))   # 0: echo only, one dropped
        for j in range(k):
            seed = req.sampling.seed if req.sampling.seed is None else req.sampling.seed + j
            sampling = replace(req.sampling, max_tokens=max_tokens, logprobs=logprobs, seed=seed,
                               prompt_logprobs=P.prompt_logprobs_width(req))
            seq = Sequence(prompt_token_ids=ids, sampling=sampling, priority=req.priority, arrival=arrival,
                           deadline=deadline, adapter=req.adapter, cache_salt=salt)
            if sampling.guided is not None:
                seq.matcher = ctx.grammars.matcher(sampling.guided)   # compiled (cached) just above
            choices.append(Choice(i * k + j, preq, seq, RequestTimes(arrival=arrival)))
    ctx.in_flight += 1
    try:
        await admit_choices(ctx, choices, rid)
        if kind == "responses":
            return await responses_reply(request, ctx, request["responses_body"], choices)
        if req.stream:
            return await stream_response(request, ctx, req, choices)
        return await full_response(ctx, req, choices)
    except EngineFailed as e:
        raise server_error(rid, "engine_failed", "the engine failed while serving this request", e)
    except ConnectionResetError:
        if STREAM not in request:
            raise
        # The client left mid-stream (a benchmark tool cancels every in-flight request when its run ends):
        # not a server error, so no traceback. The choices are unfinished: the finally aborts them.
        log.info("request %s: client disconnected mid-stream", req.request_id)
        return request[STREAM]
    finally:
        ctx.in_flight -= 1
        for c in choices:
            record(ctx, c, deadline)


async def responses_reply(request: web.Request, ctx: ServerContext, body: dict,
                          choices: list[Choice]) -> web.StreamResponse:
    """/v1/responses: the chat generation's one choice as a Response, or as Responses SSE events.
    With tools its text goes through the chat tool-call parser: content and function_call items."""
    rid, created, model = R.new_id(), R.now(), ctx.served_name
    c = choices[0]
    tc = c.req.tools if c.req.tools is not None and c.req.tools.parses else None
    parser = T.ToolCallStreamer(tc) if tc is not None else None
    items = R.OutputItems(rid)

    def pieces(text: str) -> list[T.Event]:
        return parser.feed(text) if parser is not None else [("content", text)]

    def final() -> dict:
        return R.response(rid, model, body, items.items, "completed", created, c.last.finish_reason,
                          usage_of(choices, 1, len(c.ids)))

    if not body.get("stream"):
        async for _, d in merged(choices):
            c.text.append(d.text)
            c.ids.extend(d.token_ids)
            c.last = d
        items.feed(pieces("".join(c.text)) + (parser.finish() if parser is not None else []))
        items.finish()
        return web.json_response(final())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    request[STREAM] = resp
    await resp.prepare(request)
    seq = 0

    async def send(events: list[R.Event]) -> None:
        nonlocal seq
        for kind, fields in events:
            await resp.write(f"event: {kind}\n".encode() + sse_event(R.event(kind, seq, **fields)))
            seq += 1

    await send([("response.created", dict(response=R.response(rid, model, body, None, "in_progress", created))),
                ("response.in_progress", dict(response=R.response(rid, model, body, None, "in_progress", created)))])
    if parser is None:      # plain text: the message item opens before the first token, as OpenAI's does
        await send(items.open_message())
    try:
        async for _, d in merged(choices):
            c.text.append(d.text)
            c.ids.extend(d.token_ids)
            c.last = d
            await send(items.feed(pieces(d.text)))
    except EngineFailed as e:   # headers are out: the Responses stream's own error event
        err = server_error(request_id(request), "engine_failed", "the engine failed while serving this request", e)
        await send([("error", dict(code="engine_failed", message=err.message, param=None))])
        await resp.write_eof()
        return resp
    await send(items.feed(parser.finish() if parser is not None else []) + items.finish())
    done = final()
    await send([("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                 dict(response=done))])
    await resp.write_eof()
    return resp


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
    model_id = request.match_info["model_id"]
    req = P.TokenizeRequest(model=model_id)
    check_target(ctx, req)       # the same names a request may use: the served name, aliases, adapters
    want = ctx.served_name if req.adapter is None else f"{ctx.served_name}:{req.adapter}"
    return web.json_response(next(c for c in model_cards(ctx) if c["id"] == want))


async def tokenize(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    req = P.parse_tokenize(await read_json(request))
    check_target(ctx, req)
    tok = ctx.tokenizer

    def run() -> list[int]:
        text = (req.prompt or "") if req.messages is None else render_chat(tok, req)
        return tok.encode(text, add_special_tokens=req.add_special_tokens)

    ids = await asyncio.to_thread(run)
    body = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
            "token_strs": [tok.hf.id_to_token(i) for i in ids] if req.return_token_strs else None}
    if req.ignored_fields:
        request["ignored_fields"] = req.ignored_fields
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    model, adapter, ids = P.parse_detokenize(await read_json(request))
    check_target(ctx, P.TokenizeRequest(model=model, adapter=adapter))
    P.check_token_ids(ids, ctx.vocab_size, "tokens")
    return web.json_response({"prompt": await asyncio.to_thread(ctx.tokenizer.decode, ids, False)})


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
        raise P.admission_error("warming", 1000, "the engine is not ready; load adapters once /ready is 200")
    try:
        return await ctx.engine.call(fn)
    except AdapterError as e:
        raise P.bad(e.code, str(e), param, status=ADAPTER_STATUS.get(e.code, 422))


async def load_adapter(request: web.Request) -> web.Response:
    """POST /v1/adapters {"name": ..., "path": PEFT dir}: hot-load a LoRA adapter."""
    ctx: ServerContext = request.app[CTX]
    body = await read_json(request)
    if not isinstance(body, dict):
        raise P.bad("invalid_request", "body must be a JSON object with name and path")
    unknown = sorted(set(body) - {"name", "path"})
    if unknown:
        raise P.bad("unknown_field", f"unknown fields: {', '.join(unknown)}", unknown[0])
    name, path = body.get("name"), body.get("path")
    if not isinstance(name, str) or not P.ADAPTER_NAME.fullmatch(name):
        raise P.bad("invalid_name", "name must be a DNS label (lowercase letters, digits, '-'; at most 63)", "name")
    if not isinstance(path, str) or not path:
        raise P.bad("invalid_path", "path must be the adapter directory on the engine's filesystem", "path")
    await _adapter_call(ctx, lambda engine: engine.load_adapter(name, path), "path")
    log.info("adapter %s loaded from %s", name, path)
    return web.json_response({"name": name, "path": path, "state": "loaded"})


async def unload_adapter(request: web.Request) -> web.Response:
    """DELETE /v1/adapters/{name}: unload an adapter no request uses (409 while one does)."""
    ctx: ServerContext = request.app[CTX]
    name = request.match_info["name"]
    dropped = await _adapter_call(ctx, lambda engine: engine.unload_adapter(name), "name")
    log.info("adapter %s unloaded (%d cached blocks dropped)", name, dropped)
    return web.json_response({"name": name, "state": "unloaded", "dropped_cached_blocks": dropped})


async def kv_events(request: web.Request) -> web.Response:
    """GET /v1/kv/events?epoch=E&since=N: this engine's block events after N in epoch E, or a snapshot of
    the blocks it holds when it cannot answer that exactly (kv/events.py; docs/kv-cache.md)."""
    ctx: ServerContext = request.app[CTX]
    log_ = getattr(ctx.engine.engine, "kv_events", None)
    if log_ is None:
        raise P.admission_error("warming", 1000, "the engine is still loading; no block events yet")
    q = request.query
    unknown = sorted(set(q) - {"epoch", "since", "limit"})
    if unknown:
        raise P.bad("unknown_parameter", f"unknown query parameters: {', '.join(unknown)}", unknown[0])
    epoch = q.get("epoch")
    if epoch is not None and len(epoch) > 64:
        raise P.bad("invalid_epoch", "epoch is at most 64 characters (the value a reply gave)", "epoch")
    since = limit = None
    for name in ("since", "limit"):
        text = q.get(name)
        if text is None:
            continue
        if not text.isdigit() or len(text) > 18:
            raise P.bad(f"invalid_{name}", f"{name} must be a non-negative integer", name)
        if name == "since":
            since = int(text)
        else:
            limit = min(max(int(text), 1), MAX_EVENTS_PER_REPLY)
    body = await asyncio.get_running_loop().run_in_executor(
        None, lambda: json.dumps(log_.read(epoch, since, limit or MAX_EVENTS_PER_REPLY)))
    return web.Response(text=body, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[CTX].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def build_app(ctx: ServerContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware, credential_middleware],
                          client_max_size=ctx.config.max_body_bytes)
    app[CTX] = ctx
    app.on_response_prepare.append(stamp_headers)
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
    app.router.add_get("/metrics", metrics)
    return app


# ---------------------------------------------------------------------------------------------
# CLI


