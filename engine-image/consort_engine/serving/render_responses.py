"""/v1/responses replies: a chat generation's one choice as a Response object, or as the Responses SSE
events (response.created ... response.completed); responses.py holds the request mapping and shapes."""
from __future__ import annotations

import json
from typing import AsyncIterator

from aiohttp import web

from consort_engine.core.async_engine import EngineFailed
from consort_engine.serving import responses
from consort_engine.serving.context import STREAM, ServerContext
from consort_engine.serving.errors import server_error
from consort_engine.serving.generation import Choice, Delta
from consort_engine.text import tool_calls


def _sse(kind: str, obj: dict) -> bytes:
    """One Responses SSE event: its type on the `event:` line, the object on the `data:` line."""
    return f"event: {kind}\ndata: ".encode() + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(c: Choice) -> dict:
    """The choice's usage as chat counts it (responses.response reshapes it)."""
    prompt, output = len(c.seq.prompt_token_ids), len(c.ids)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": c.seq.num_cached_tokens}}


async def responses_reply(request: web.Request, ctx: ServerContext, body: dict, choices: list[Choice],
                          deltas: AsyncIterator[tuple[Choice, Delta]], rid: str) -> web.StreamResponse:
    """/v1/responses: the chat generation's one choice as a Response, or as Responses SSE events.
    With tools its text goes through the chat tool-call parser: content and function_call items."""
    resp_id, created, model = responses.new_id(), responses.now(), ctx.served_name
    c = choices[0]
    tc = c.req.tools if c.req.tools is not None and c.req.tools.parses else None
    parser = tool_calls.ToolCallStreamer(tc) if tc is not None else None
    items = responses.OutputItems(resp_id)

    def pieces(text: str) -> list[tool_calls.Event]:
        return parser.feed(text) if parser is not None else [("content", text)]

    def final() -> dict:
        return responses.response(resp_id, model, body, items.items, "completed", created, c.last.finish_reason,
                          _usage(c))

    if not body.get("stream"):
        async for _, d in deltas:
            c.text.append(d.text)
            c.ids += d.token_ids
            c.last = d
        items.feed(pieces("".join(c.text)) + (parser.finish() if parser is not None else []))
        items.finish()
        return web.json_response(final())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    request[STREAM] = resp
    await resp.prepare(request)
    seq = 0

    async def send(events: list[responses.Event]) -> None:
        nonlocal seq
        for kind, fields in events:
            await resp.write(_sse(kind, responses.event(kind, seq, **fields)))
            seq += 1

    started = responses.response(resp_id, model, body, None, "in_progress", created)
    await send([("response.created", dict(response=started)), ("response.in_progress", dict(response=started))])
    if parser is None:      # plain text: the message item opens before the first token, as OpenAI's does
        await send(items.open_message())
    try:
        async for _, d in deltas:
            c.text.append(d.text)
            c.ids += d.token_ids
            c.last = d
            await send(items.feed(pieces(d.text)))
    except EngineFailed as e:   # headers are out: the Responses stream's own error event
        err = server_error(rid, "engine_failed", "the engine failed while serving this request", e)
        await send([("error", dict(code="engine_failed", message=err.message, param=None))])
        await resp.write_eof()
        return resp
    await send(items.feed(parser.finish() if parser is not None else []) + items.finish())
    done = final()
    await send([("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                 dict(response=done))])
    await resp.write_eof()
    return resp
