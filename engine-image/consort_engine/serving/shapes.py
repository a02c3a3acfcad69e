"""OpenAI / vLLM response shapes as pure functions: logprobs blocks, usage, the envelope and
choice of a completion or chat response (whole or as a chunk)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from consort_engine.kv.sequence import PromptLogprobs
from consort_engine.serving.protocol import GenerationRequest


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None                       # None: the first prompt token (nothing predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), best first


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
