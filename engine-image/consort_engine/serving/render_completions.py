"""Completion and chat responses: the OpenAI / vLLM shapes (logprobs blocks, usage, the envelope and
choice of a response, whole or as a chunk) as pure functions, and the replies built from a request's
choices: whole JSON, or SSE chunks as the choices produce them."""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from aiohttp import web

from consort_engine.core.async_engine import EngineFailed
from consort_engine.kv.sequence import PromptLogprobs, Sequence
from consort_engine.serving.context import STREAM, ServerContext
from consort_engine.serving.errors import server_error
from consort_engine.serving.generation import Choice, Delta, TokenLogprob
from consort_engine.serving.protocol import GenerationRequest
from consort_engine.text import tool_calls

log = logging.getLogger("consort.server")


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def prompt_token_logprobs(prompt: list[int], plp: PromptLogprobs, k: int) -> list[TokenLogprob]:
    """The prompt's tokens as TokenLogprob items with their top-k (k <= the width computed); the first
    token's logprob is None, as OpenAI and vLLM report it."""
    return [TokenLogprob(prompt[0], None)] + [
        TokenLogprob(t, lp, list(zip(ids[:k], vals[:k])))
        for t, lp, ids, vals in zip(prompt[1:], plp.logprobs, plp.top_ids, plp.top_logprobs)]


def vllm_prompt_logprobs(prompt: list[int], plp: PromptLogprobs, k: int, token_text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {id: {logprob, rank,
    decoded_token}} holding the prompt token itself and the top-k (rank 1 = the most likely)."""
    out: list[dict | None] = [None]
    for t, lp, rank, ids, vals in zip(prompt[1:], plp.logprobs, plp.ranks, plp.top_ids, plp.top_logprobs):
        entry = {str(t): {"logprob": _lp(lp), "rank": rank, "decoded_token": token_text(t)}}
        for r, (tid, v) in enumerate(zip(ids[:k], vals[:k]), 1):
            entry.setdefault(str(tid), {"logprob": _lp(v), "rank": r, "decoded_token": token_text(tid)})
        out.append(entry)
    return out


def completion_logprobs(items: list[TokenLogprob], token_text, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for it in items:
        s = token_text(it.token_id)
        tokens.append(s)
        if it.logprob is None:      # the first prompt token of an echo
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(it.logprob))
            tops.append({token_text(t): _lp(lp) for t, lp in it.top})
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(items: list[TokenLogprob], token_text) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = token_text(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(it.token_id, it.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in it.top]} for it in items]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def response_id(req: GenerationRequest) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.request_id


def envelope(req: GenerationRequest, model: str, chunk: bool) -> dict:
    if req.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": response_id(req), "object": obj, "created": int(time.time()), "model": model}


def choice(req: GenerationRequest, text: str | None, finish_reason: str | None, *, chunk: bool, first: bool = False,
           logprobs: dict | None = None, token_ids: list[int] | None = None, stop_reason: Any = None,
           index: int = 0, tool_calls: list[dict] | None = None) -> dict:
    """One choice; chat `tool_calls` go into the message (content None when there is none) or the delta."""
    if req.kind == "chat":
        if chunk:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text or first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            c: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            c = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None and stop_reason is not None:
        c["stop_reason"] = stop_reason
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def echoed_prompt(ctx: ServerContext, req: GenerationRequest, seq: Sequence) -> str:
    """With `echo`, the prompt as text (a token-id prompt decoded), which leads the completion."""
    if not req.echo:
        return ""
    return req.prompt if req.prompt is not None else ctx.tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=False)


def echoed_logprobs(c: Choice) -> list[TokenLogprob]:
    """With `echo` and `logprobs` k, the prompt's tokens lead the choice's logprobs (the first one None)."""
    if not (c.req.echo and c.req.logprobs is not None):
        return []
    return prompt_token_logprobs(c.seq.prompt_token_ids, c.prompt_lps, c.req.logprobs)


def prompt_logprobs_of(ctx: ServerContext, c: Choice) -> list[dict | None]:
    return vllm_prompt_logprobs(c.seq.prompt_token_ids, c.prompt_lps, c.req.prompt_logprobs,
                                  ctx.tokenizer.id_to_token)


def usage_of(choices: list[Choice], n: int, completion_tokens: int) -> dict:
    """OpenAI's usage: each prompt counted once, whatever n; every choice's generated tokens."""
    firsts = choices[::n]
    return usage(sum(len(c.seq.prompt_token_ids) for c in firsts), completion_tokens,
                   sum(c.seq.num_cached_tokens for c in firsts))


def best_indices(cumulative: list[float], n: int) -> list[int]:
    """The n samples of one prompt with the highest cumulative logprob, in sampling order (stable ties)."""
    ranked = sorted(range(len(cumulative)), key=lambda i: -cumulative[i])[:n]
    return sorted(ranked)


def best_choices(choices: list[Choice], k: int, n: int) -> list[Choice]:
    """Of each prompt's k samples, the n with the highest cumulative logprob, renumbered i * n + rank."""
    out = []
    for i in range(0, len(choices), k):
        group = choices[i:i + k]
        keep = best_indices([sum(lp.logprob for lp in c.lps) for c in group], n)
        out += [replace(group[j], index=(i // k) * n + r) for r, j in enumerate(keep)]
    return out


async def full_response(ctx: ServerContext, req: GenerationRequest, choices: list[Choice],
                        deltas: AsyncIterator[tuple[Choice, Delta]]) -> web.Response:
    async for c, d in deltas:
        c.text.append(d.text)
        c.ids += d.token_ids
        c.lps += d.logprobs
        if d.prompt_logprobs is not None:     # (empty, so falsy, for a one-token prompt)
            c.prompt_lps = d.prompt_logprobs
        c.last = d
    assert all(c.finished for c in choices)
    k = req.samples
    usage = usage_of(choices, k, sum(len(c.ids) for c in choices))   # every sample counts, best_of too
    if req.best_of is not None:
        choices = best_choices(choices, k, req.n)
    body = envelope(req, ctx.served_name, chunk=False)
    body["choices"] = []
    for c in choices:
        logprobs = None
        if req.logprobs is not None:
            logprobs = (chat_logprobs(c.lps, ctx.tokenizer.id_to_token) if req.kind == "chat"
                        else completion_logprobs(echoed_logprobs(c) + c.lps, ctx.tokenizer.id_to_token, 0))
        text, reason, calls = echoed_prompt(ctx, c.req, c.seq) + "".join(c.text), c.last.finish_reason, None
        if req.tools is not None and req.tools.parses:
            parsed = tool_calls.parse_output(req.tools, text)
            text, calls = (parsed.content if parsed.tool_calls else parsed.content or ""), parsed.tool_calls or None
            reason = tool_calls.finish_reason(req.tools, bool(calls), reason)
        one = choice(c.req, text, reason, chunk=False, logprobs=logprobs,
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


async def stream_response(request: web.Request, ctx: ServerContext, req: GenerationRequest, choices: list[Choice],
                          deltas: AsyncIterator[tuple[Choice, Delta]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    request[STREAM] = resp
    await resp.prepare(request)
    base = envelope(req, ctx.served_name, chunk=True)
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
            logprobs = completion_logprobs(echoed_logprobs(c), ctx.tokenizer.id_to_token, 0)
        offsets[c.index] += len(text)
        await resp.write(sse_event(chunk_of(c, choice(c.req, text, None, chunk=True, logprobs=logprobs,
                                                   index=c.index))))

    for c in choices:
        if req.kind == "chat":   # OpenAI sends the role first
            await resp.write(sse_event(chunk_of(c, choice(c.req, "", None, chunk=True, first=True, index=c.index))))
        if req.echo and not echo_later:
            await send_echo(c)
    try:
        async for c, d in deltas:
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
            # New tokens are sent even while their text is held back (an incomplete UTF-8 sequence, a
            # possible stop string or tool-call tag): the chunk says a token came, as vLLM's does, so
            # a client's time to first token is the first token's, not the first decodable text's.
            if not (any(t or tc for t, tc in pieces) or finish or d.token_ids or d.logprobs):
                continue
            logprobs = None
            if req.logprobs is not None:
                if req.kind == "chat":
                    logprobs = chat_logprobs(d.logprobs, ctx.tokenizer.id_to_token)
                else:
                    logprobs = completion_logprobs(d.logprobs, ctx.tokenizer.id_to_token, offsets[c.index])
            offsets[c.index] += len(d.text)
            for i, (text, calls) in enumerate(pieces):   # logprobs/ids with the first, finish with the last
                last = i == len(pieces) - 1
                chunk = chunk_of(c, choice(c.req, text, finish if last else None, chunk=True,
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
