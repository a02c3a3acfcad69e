"""Completion and chat responses: whole JSON, or SSE chunks as the choices produce them; the chunk
framing (`sse_event`) and `usage_of` are the Responses renderer's too."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

from aiohttp import web

from consort_engine.core.async_engine import EngineFailed
from consort_engine.kv.sequence import Sequence
from consort_engine.serving import shapes
from consort_engine.serving.context import STREAM, ServerContext
from consort_engine.serving.errors import server_error
from consort_engine.serving.generation import Choice, merged
from consort_engine.serving.protocol import GenerationRequest, best_indices, samples_per_prompt
from consort_engine.text import tool_calls

log = logging.getLogger("consort.server")


def echoed_prompt(ctx: ServerContext, req: GenerationRequest, seq: Sequence) -> str:
    """With `echo`, the prompt as text (a token-id prompt decoded), which leads the completion."""
    if not req.echo:
        return ""
    return req.prompt if req.prompt is not None else ctx.tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=False)


def echoed_logprobs(c: Choice) -> list[shapes.TokenLogprob]:
    """With `echo` and `logprobs` k, the prompt's tokens lead the choice's logprobs (the first one None)."""
    if not (c.req.echo and c.req.logprobs is not None):
        return []
    return shapes.prompt_token_logprobs(c.seq.prompt_token_ids, c.prompt_lps, c.req.logprobs)


def prompt_logprobs_of(ctx: ServerContext, c: Choice) -> list[dict | None]:
    return shapes.vllm_prompt_logprobs(c.seq.prompt_token_ids, c.prompt_lps, c.req.prompt_logprobs,
                                  ctx.tokenizer.id_to_token)


def usage_of(choices: list[Choice], n: int, completion_tokens: int) -> dict:
    """OpenAI's usage: each prompt counted once, whatever n; every choice's generated tokens."""
    firsts = choices[::n]
    return shapes.usage(sum(len(c.seq.prompt_token_ids) for c in firsts), completion_tokens,
                   sum(c.seq.num_cached_tokens for c in firsts))


def best_choices(choices: list[Choice], k: int, n: int) -> list[Choice]:
    """Of each prompt's k samples, the n with the highest cumulative logprob, renumbered i * n + rank."""
    out = []
    for i in range(0, len(choices), k):
        group = choices[i:i + k]
        keep = best_indices([sum(lp.logprob for lp in c.lps) for c in group], n)
        out += [replace(group[j], index=(i // k) * n + r) for r, j in enumerate(keep)]
    return out


async def full_response(ctx: ServerContext, req: GenerationRequest, choices: list[Choice]) -> web.Response:
    async for c, d in merged(choices):
        c.text.append(d.text)
        c.ids.extend(d.token_ids)
        c.lps.extend(d.logprobs)
        if d.prompt_logprobs is not None:     # (empty, so falsy, for a one-token prompt)
            c.prompt_lps = d.prompt_logprobs
        c.last = d
    assert all(c.finished for c in choices)
    k = samples_per_prompt(req)
    usage = usage_of(choices, k, sum(len(c.ids) for c in choices))   # every sample counts, best_of too
    if req.best_of is not None:
        choices = best_choices(choices, k, req.n)
    body = shapes.envelope(req, ctx.served_name, chunk=False)
    body["choices"] = []
    for c in choices:
        logprobs = None
        if req.logprobs is not None:
            logprobs = (shapes.chat_logprobs(c.lps, ctx.tokenizer.id_to_token) if req.kind == "chat"
                        else shapes.completion_logprobs(echoed_logprobs(c) + c.lps, ctx.tokenizer.id_to_token, 0))
        text, reason, calls = echoed_prompt(ctx, c.req, c.seq) + "".join(c.text), c.last.finish_reason, None
        if req.tools is not None and req.tools.parses:
            parsed = tool_calls.parse_output(req.tools, text)
            text, calls = (parsed.content if parsed.tool_calls else parsed.content or ""), parsed.tool_calls or None
            reason = tool_calls.finish_reason(req.tools, bool(calls), reason)
        one = shapes.choice(c.req, text, reason, chunk=False, logprobs=logprobs,
                       token_ids=c.ids if req.return_token_ids else None, stop_reason=c.last.stop_reason,
                       index=c.index, tool_calls=calls)
        if req.return_token_ids and req.prompts:
            one["prompt_token_ids"] = list(c.seq.prompt_token_ids)
        if req.prompt_logprobs is not None and req.kind == "completion":   # vLLM: per choice
            one["prompt_logprobs"] = prompt_logprobs_of(ctx, c)
        body["choices"].append(one)
    if req.prompt_logprobs is not None and req.kind == "chat":   # vLLM: the response's (one prompt)
        body["prompt_logprobs"] = prompt_logprobs_of(ctx, choices[0])
    body["usage"] = usage
    if req.return_token_ids and not req.prompts:
        body["prompt_token_ids"] = list(choices[0].seq.prompt_token_ids)
    return web.json_response(body)


def sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def stream_response(request: web.Request, ctx: ServerContext, req: GenerationRequest,
                          choices: list[Choice]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    request[STREAM] = resp
    await resp.prepare(request)
    base = shapes.envelope(req, ctx.served_name, chunk=True)
    n_out = 0
    offsets = {c.index: 0 for c in choices}
    unsent_prompt_ids = {c.index for c in choices} if req.return_token_ids else set()
    parsers = {c.index: tool_calls.ToolCallStreamer(req.tools) for c in choices} if req.tools and req.tools.parses else {}

    def chunk_of(c: Choice, choice: dict) -> dict:
        chunk = dict(base, choices=[choice])
        if c.index in unsent_prompt_ids:   # with the first chunk of each choice
            unsent_prompt_ids.discard(c.index)
            chunk["prompt_token_ids"] = list(c.seq.prompt_token_ids)
        return chunk

    # With echo the prompt comes first, as vLLM streams it; with logprobs too, once its logprobs are
    # out (they come with the choice's first output).
    echo_later = req.echo and req.logprobs is not None
    unsent_echo = {c.index for c in choices} if req.echo else set()

    async def send_echo(c: Choice) -> None:
        unsent_echo.discard(c.index)
        text = echoed_prompt(ctx, c.req, c.seq)
        logprobs = None
        if echo_later:
            logprobs = shapes.completion_logprobs(echoed_logprobs(c), ctx.tokenizer.id_to_token, 0)
        offsets[c.index] += len(text)
        await resp.write(sse_event(chunk_of(c, shapes.choice(c.req, text, None, chunk=True, logprobs=logprobs,
                                                   index=c.index))))

    for c in choices:
        if req.kind == "chat":   # OpenAI sends the role first
            await resp.write(sse_event(chunk_of(c, shapes.choice(c.req, "", None, chunk=True, first=True, index=c.index))))
        if req.echo and not echo_later:
            await send_echo(c)
    try:
        async for c, d in merged(choices):
            n_out += len(d.token_ids)
            c.last = d
            if c.index in unsent_echo:
                if d.prompt_logprobs is not None:
                    c.prompt_lps = d.prompt_logprobs
                await send_echo(c)
            pieces, finish = [(d.text, None)], d.finish_reason
            if c.index in parsers:     # text -> content and tool-call deltas (a tag split over tokens waits)
                parser = parsers[c.index]
                pieces = tool_calls.chunk_pieces(parser.feed(d.text) + (parser.finish() if finish else [])) or [("", None)]
                finish = finish and tool_calls.finish_reason(req.tools, parser.called, finish)
            if not (any(t or tc for t, tc in pieces) or finish or (req.return_token_ids and d.token_ids)
                    or d.logprobs):
                continue
            logprobs = None
            if req.logprobs is not None:
                if req.kind == "chat":
                    logprobs = shapes.chat_logprobs(d.logprobs, ctx.tokenizer.id_to_token)
                else:
                    logprobs = shapes.completion_logprobs(d.logprobs, ctx.tokenizer.id_to_token, offsets[c.index])
            offsets[c.index] += len(d.text)
            for i, (text, calls) in enumerate(pieces):   # logprobs/ids with the first, finish with the last
                last = i == len(pieces) - 1
                chunk = chunk_of(c, shapes.choice(c.req, text, finish if last else None, chunk=True,
                                             logprobs=logprobs if i == 0 else None,
                                             token_ids=(d.token_ids if i == 0 else []) if req.return_token_ids
                                             else None, stop_reason=d.stop_reason, index=c.index,
                                             tool_calls=calls))
                if req.include_usage and req.continuous_usage:
                    chunk["usage"] = usage_of(choices, req.n, n_out)
                await resp.write(sse_event(chunk))
    except EngineFailed as e:   # headers are out: report in-band, as OpenAI-compatible servers do
        err = server_error(req.request_id, "engine_failed", "the engine failed while serving this request", e)
        await resp.write(sse_event(err.body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    assert all(c.finished for c in choices)
    if req.include_usage:
        await resp.write(sse_event(dict(base, choices=[], usage=usage_of(choices, req.n, n_out))))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
