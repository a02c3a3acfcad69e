"""One OpenAI completion request as a load generator sees it: every outcome counted, none fatal.

A server under load answers in ways a benchmark must count, not crash on: an admission rejection
(HTTP 429, or 503 while warming / with no ready replica) with Retry-After, a typed error event in
the stream (`data: {"error": {...}}`: the router's upstream_failed / idle_timeout, the engine's
engine_failed), a stream that goes quiet. `request` sends one request and classifies its outcome:

  ok           a 200 whose stream ended with `data: [DONE]` (or a non-streamed 200 JSON body)
  rejected     429 or 503, after the retries the ClientPolicy allows
  error_event  a typed error event in the stream (the text before it is kept)
  timeout      no byte for `idle_timeout_s`, or the session's own timeout
  failed       anything else: another status, a connection error, a malformed or truncated stream

Retry-After is honoured: a rejection that advises a delay (the body's `retry_after_ms`, else the
Retry-After header in seconds) is retried after that delay, capped at `max_retry_wait_s`, at most
`retries` times (ClientPolicy); a rejection without advice is counted at once. Timings (TTFT,
inter-token gaps, end-to-end) are those of the attempt that was answered; `retries` says how many
were rejected first.

The engine's and the router's benchmarks both drive streams through it (neither package may import
the other; both may import consort_common).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("ok", "rejected", "error_event", "timeout", "failed")
REJECTED_STATUSES = (429, 503)


@dataclass(frozen=True)
class ClientPolicy:
    retries: int = 3                      # retries of an advised rejection; 0: count every rejection at once
    max_retry_wait_s: float = 5.0         # cap on one advised delay (a load generator must keep moving)
    idle_timeout_s: float | None = None   # no byte for this long: a timeout (None: the session's own only)


@dataclass
class StreamResult:
    outcome: str = "failed"
    status: int = 0
    error: str = ""               # the typed error's code (or type), the exception, or the body's head
    retry_after_s: float | None = None
    retries: int = 0              # rejected attempts before this one
    ttft: float | None = None     # first token's chunk (its text may be held back), from the answered attempt's send
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    text: str = ""
    chunks: int = 0               # content-bearing chunks (a token count where usage is absent)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0        # usage.prompt_tokens_details.cached_tokens: prompt tokens the server had cached

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def add_args(p: argparse.ArgumentParser, idle_timeout_s: float = 120.0) -> None:
    """The load-generator flags every benchmark shares (policy_of reads them back)."""
    p.add_argument("--retries", type=int, default=ClientPolicy.retries,
                   help="retries of a 429/503 that advises Retry-After, after the advised delay "
                        "(then it counts as rejected)")
    p.add_argument("--max-retry-wait", type=float, default=ClientPolicy.max_retry_wait_s,
                   help="cap on one Retry-After wait, seconds")
    p.add_argument("--idle-timeout", type=float, default=idle_timeout_s,
                   help="a request with no byte for this long counts as a timeout, seconds (0: none)")


def policy_of(args: argparse.Namespace) -> ClientPolicy:
    return ClientPolicy(retries=max(0, args.retries), max_retry_wait_s=max(0.0, args.max_retry_wait),
                        idle_timeout_s=args.idle_timeout if args.idle_timeout > 0 else None)


def tally(results: Iterable[StreamResult]) -> dict[str, int]:
    """Requests per outcome, plus the rejected attempts that were retried."""
    out = dict.fromkeys(OUTCOMES, 0) | {"retries": 0}
    for r in results:
        out[r.outcome] += 1
        out["retries"] += r.retries
    return out


def describe(counts: dict[str, int]) -> str:
    """A tally as one report fragment: `ok 30, rejected 2, error events 1, timeouts 0, failed 0, retries 5`."""
    return ", ".join(f"{k.replace('_', ' ')}{'s' if k in ('error_event', 'timeout') else ''} {counts[k]}"
                     for k in (*OUTCOMES, "retries"))


async def request(session: Any, url: str, body: dict, headers: dict | None = None,
                  policy: ClientPolicy = ClientPolicy()) -> StreamResult:
    """POST `body` to `url` (an aiohttp session); retried after advised rejections as `policy` allows."""
    attempt = 0
    while True:
        res = await _attempt(session, url, body, headers or {}, policy.idle_timeout_s)
        res.retries = attempt
        if res.outcome != "rejected" or res.retry_after_s is None or attempt >= policy.retries:
            return res
        await asyncio.sleep(min(res.retry_after_s, policy.max_retry_wait_s))
        attempt += 1


async def _attempt(session: Any, url: str, body: dict, headers: dict, idle_timeout_s: float | None) -> StreamResult:
    import aiohttp

    res = StreamResult()
    stamps: list[float] = []          # arrival of each content-bearing chunk
    first: list[float] = []           # arrival of the first chunk that carries a token
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    idle = asyncio.timeout(idle_timeout_s)
    try:
        # One idle deadline for the attempt, pushed back at every chunk (a server that never
        # answers the headers times out too).
        async with idle:
            async with session.post(url, json=body, headers=headers) as resp:
                res.status = resp.status
                if resp.status != 200:
                    _refused(res, resp.status, resp.headers.get("Retry-After"), await resp.read())
                elif resp.content_type == "text/event-stream":
                    done = False
                    async for line in _lines(resp):
                        if idle_timeout_s is not None:
                            idle.reschedule(loop.time() + idle_timeout_s)
                        if done := _event(res, line, stamps, first):
                            break
                    if not done:
                        res.outcome, res.error = "failed", "the stream ended without data: [DONE]"
                else:
                    _whole(res, await resp.read())
    except TimeoutError:          # aiohttp's own timeouts are TimeoutErrors too
        res.outcome = "timeout"
        res.error = f"no byte for {idle_timeout_s:g} s" if idle.expired() else "the session's timeout"
    except aiohttp.ClientError as e:
        res.outcome, res.error = "failed", f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    if first or stamps:
        res.ttft = (first or stamps)[0] - t0
        res.itls = [b - a for a, b in zip(stamps, stamps[1:])]
    return res


async def _lines(resp: Any):
    """The body's lines, however the chunks split them (no line-length limit)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.strip()
    if buf.strip():
        yield buf.strip()


def _event(res: StreamResult, line: bytes, stamps: list[float], first: list[float] | None = None) -> bool:
    """Fold one SSE line into `res`; True when the stream is over (done, an error event, garbage).
    `first` gets the arrival of the first chunk carrying a token: a completion choice, or a chat delta
    that is not the opening role-only one (a token whose text is held back comes with empty text)."""
    if not line.startswith(b"data:"):
        return False            # comments, event:/id: fields, the blank line between events
    data = line[5:].strip()
    if data == b"[DONE]":
        res.outcome = "ok"
        return True
    try:
        msg = json.loads(data)
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        res.outcome, res.error = "failed", f"malformed event: {data[:120]!r}"
        return True
    if "error" in msg:
        res.outcome, res.error = "error_event", _error_code(msg)
        return True
    _usage(res, msg)
    for ch in msg.get("choices") or []:
        delta = ch.get("delta") or {}
        if first is not None and not first and ("text" in ch or ("content" in delta and "role" not in delta)):
            first.append(time.perf_counter())
        piece = ch.get("text") if "text" in ch else delta.get("content")
        if piece:
            stamps.append(time.perf_counter())
            res.chunks += 1
            res.text += piece
    return False


def _whole(res: StreamResult, raw: bytes) -> None:
    """A non-streamed 200: the completion's text and usage."""
    try:
        msg = json.loads(raw)
    except ValueError:
        res.outcome, res.error = "failed", f"malformed body: {raw[:120]!r}"
        return
    if not isinstance(msg, dict) or "error" in msg:
        res.outcome, res.error = "failed", _error_code(msg) if isinstance(msg, dict) else "malformed body"
        return
    _usage(res, msg)
    res.text = "".join((ch.get("text") or (ch.get("message") or {}).get("content") or "")
                       for ch in msg.get("choices") or [])
    res.outcome = "ok"


def _refused(res: StreamResult, status: int, header: str | None, raw: bytes) -> None:
    try:
        msg = json.loads(raw)
    except ValueError:
        msg = None
    err = msg.get("error") if isinstance(msg, dict) else None
    res.error = _error_code(msg) if isinstance(err, dict) else raw[:200].decode(errors="replace")
    if status not in REJECTED_STATUSES:
        res.outcome = "failed"
        return
    res.outcome = "rejected"
    ms = err.get("retry_after_ms") if isinstance(err, dict) else None
    if isinstance(ms, (int, float)) and ms >= 0:
        res.retry_after_s = ms / 1000.0
    elif header is not None:
        try:
            res.retry_after_s = max(0.0, float(header))
        except ValueError:
            pass          # an HTTP-date: no advice we act on


def _error_code(msg: dict) -> str:
    err = msg.get("error")
    if not isinstance(err, dict):
        return str(err)[:200]
    return str(err.get("code") or err.get("type") or err.get("message") or "error")


def _usage(res: StreamResult, msg: dict) -> None:
    usage = msg.get("usage")
    if isinstance(usage, dict):
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            res.cached_tokens = int(details.get("cached_tokens") or 0)
