"""Upstream mechanics: open a request on a replica (retrying on another one only before the first
byte) and relay the answer, SSE chunk by chunk without buffering.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from aiohttp import web

from .affinity import Affinity
from .replicas import ReplicaState, choose_replica

CONNECT_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError)
PASS_HEADERS = ("Content-Type", "Retry-After", "x-consort-adapter", "x-consort-speculation", "x-consort-ignored-fields",
                "Cache-Control")
CAPTURE_LIMIT = 4 << 20


class NoReplica(Exception):
    pass


@dataclass
class Attempt:
    replica: ReplicaState
    status: int
    code: str = ""


@dataclass
class Upstream:
    """An open upstream response (status and headers read, body not yet)."""

    response: aiohttp.ClientResponse
    replica: ReplicaState
    attempts: list[Attempt] = field(default_factory=list)
    first_byte_at: float = 0.0


def error_code(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("code") or err.get("type") or "")
    except (ValueError, AttributeError):
        return ""


async def open_upstream(
    session: aiohttp.ClientSession,
    replicas: list[ReplicaState],
    path: str,
    payload: bytes,
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
    preempting_penalty: float,
    on_attempt: Callable[[Attempt, bool], None] | None = None,
    adapter: str | None = None,
    affinity: Affinity | None = None,
) -> Upstream:
    """POST to the best replica; on connection failure, 5xx or 429 retry another while one is left.

    Returns the last response (possibly a 429 or 5xx to pass through). Raises NoReplica when no ready
    replica could even be connected to. `on_attempt(attempt, retried)` observes every answered attempt.
    """
    tried: set[str] = set()
    attempts: list[Attempt] = []
    last_error: Exception | None = None
    while True:
        r = choose_replica(replicas, preempting_penalty, frozenset(tried), adapter, affinity)
        if r is None:
            raise NoReplica(str(last_error) if last_error else "no ready replica")
        tried.add(r.url)
        r.inflight += 1
        try:
            resp = await session.post(r.url + path, data=payload, headers=headers, timeout=timeout)
        except CONNECT_ERRORS as e:
            r.inflight -= 1
            r.ready, r.reason = False, f"request failed: {type(e).__name__}"
            last_error = e
            a = Attempt(r, 0, "connect_error")
            attempts.append(a)
            if on_attempt:
                on_attempt(a, True)
            continue
        except BaseException:
            r.inflight -= 1
            raise
        first = time.monotonic()
        if resp.status == 429 or resp.status >= 500:
            another = choose_replica(replicas, preempting_penalty, frozenset(tried), adapter, affinity) is not None
            if another:
                try:
                    body = await resp.read()
                except CONNECT_ERRORS:
                    body = b""
                finally:
                    resp.release()
                    r.inflight -= 1
                a = Attempt(r, resp.status, error_code(body))
                attempts.append(a)
                if on_attempt:
                    on_attempt(a, True)
                continue
        a = Attempt(r, resp.status)
        attempts.append(a)
        if on_attempt:
            on_attempt(a, False)
        return Upstream(resp, r, attempts, first)


def copy_headers(resp: aiohttp.ClientResponse, out: web.StreamResponse) -> None:
    for h in PASS_HEADERS:
        v = resp.headers.get(h)
        if v is not None:
            out.headers[h] = v


def sse_error(code: str, message: str) -> bytes:
    """A terminal SSE event: the typed error (the openai client raises it). No [DONE] follows, so a
    client that ignores error events still sees a stream that did not complete."""
    body = {"error": {"type": "upstream_error", "code": code, "message": message}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class RelayResult:
    completed: bool            # the whole upstream body reached the client
    captured: bytes = b""      # the body, when capture was asked for
    error: str = ""            # upstream_failed | idle_timeout | client_disconnected
    first_relay_s: float = 0.0 # first chunk: received from upstream -> written to the client


async def relay_stream(up: Upstream, out: web.StreamResponse, request: web.Request, capture: bool,
                       idle_timeout_s: float | None = None) -> RelayResult:
    """Write each upstream chunk to the client as it arrives. An upstream failure mid-stream, or no
    chunk for `idle_timeout_s`, ends the stream with a terminal SSE error event and closes the
    upstream connection (the engine sees the disconnect and frees the sequence); so does a client
    disconnect (ConnectionResetError on write, or the handler's cancellation)."""
    buf: list[bytes] = []
    size = 0
    resp = up.response
    done = False
    try:
        await out.prepare(request)
        first_relay = 0.0
        loop = asyncio.get_running_loop()
        try:
            # One deadline for the whole relay, pushed back after every chunk: no task per token.
            async with asyncio.timeout(idle_timeout_s) as idle:
                async for chunk in resp.content.iter_any():
                    t = time.perf_counter() if not first_relay else 0.0
                    if capture and size < CAPTURE_LIMIT:
                        buf.append(chunk)
                        size += len(chunk)
                    await out.write(chunk)
                    if t:
                        first_relay = time.perf_counter() - t
                    if idle_timeout_s is not None:
                        idle.reschedule(loop.time() + idle_timeout_s)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
            code, why = (("idle_timeout", f"no token from the engine for {idle_timeout_s:g} s")
                         if isinstance(e, TimeoutError) else
                         ("upstream_failed", f"the engine stopped mid-stream ({type(e).__name__})"))
            try:
                await out.write(sse_error(code, why))
                await out.write_eof()
            except (ConnectionResetError, RuntimeError):
                pass
            return RelayResult(False, b"".join(buf), code)
        done = True
        await out.write_eof()
        return RelayResult(True, b"".join(buf), first_relay_s=first_relay)
    except ConnectionResetError:
        return RelayResult(False, b"".join(buf), "client_disconnected")
    finally:
        if done:
            resp.release()
        else:
            resp.close()  # close, not release: the engine must see the disconnect
