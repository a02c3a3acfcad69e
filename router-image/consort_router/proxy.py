"""Upstream mechanics: open a request on a replica (retrying on another one only before the first
byte), fail a plan over to its next target (a lane's fallback) before the first byte, relay the
answer, SSE chunk by chunk without buffering, and read the text of a captured answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from .activator import Activator
from .affinity import Affinity, PrefixIndex, request_affinity
from .api import ApiError, ParsedRequest, upstream_body
from .config import RouterConfig
from .metrics import RouterMetrics
from .plan import Plan
from .replicas import CREDENTIAL_REFUSED, ReplicaState, choice_outcome, choose_replica
from .state import Lanes, Runtime

log = logging.getLogger("consort.router")

CONNECT_ERRORS = (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError)
PASS_HEADERS = ("Content-Type", "Retry-After", "x-consort-adapter", "x-consort-speculation", "x-consort-ignored-fields",
                "Cache-Control")
CAPTURE_LIMIT = 4 << 20
TENANT_HEADER = "x-consort-tenant"         # set by the router on every upstream call, never taken from a client


def upstream_timeout(cfg: RouterConfig) -> aiohttp.ClientTimeout:
    """A request to an engine: the whole answer within limits.request_timeout_s."""
    return aiohttp.ClientTimeout(total=cfg.limits.request_timeout_s, sock_connect=cfg.limits.connect_timeout_s)


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


def text_of_response(body: object) -> str:
    """The first choice's text of a non-streamed completion or chat completion (or a Response's)."""
    if not isinstance(body, dict):
        return ""
    if body.get("object") == "response":
        return "".join(p.get("text", "") for item in body.get("output") or () if isinstance(item, dict)
                       for p in item.get("content") or () if isinstance(p, dict) and isinstance(p.get("text"), str))
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if isinstance(c.get("text"), str):
        return c["text"]
    msg = c.get("message")
    if isinstance(msg, dict) and isinstance(msg.get("content"), str):
        return msg["content"]
    return ""


def text_of_sse(raw: bytes) -> str:
    """Concatenated first-choice text of an SSE stream (completions `text` or chat `delta.content`)."""
    parts = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if obj.get("type") == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            parts.append(obj["delta"])   # a /v1/responses stream
        for c in obj.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            if isinstance(c.get("text"), str):
                parts.append(c["text"])
            delta = c.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                parts.append(delta["content"])
    return "".join(parts)


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
        if resp.status in (401, 403):
            # The engine refuses this router's credential (not on the pod yet): the client's key is
            # not at fault, so its 401 is never relayed; another replica, or no replica, is tried.
            resp.release()
            r.inflight -= 1
            r.ready, r.reason = False, CREDENTIAL_REFUSED
            last_error = RuntimeError(CREDENTIAL_REFUSED)
            a = Attempt(r, resp.status, "credential_refused")
            attempts.append(a)
            if on_attempt:
                on_attempt(a, True)
            continue
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


async def open_plan(session: aiohttp.ClientSession, rt: Runtime, plan: Plan, req: ParsedRequest, path: str,
                    rid: str, tenant: str, lanes: Lanes, metrics: RouterMetrics,
                    prefixes: PrefixIndex, activator: Activator,
                    replicas_now: Callable[[str], list[ReplicaState]],
                    affinity_of: Callable[..., Awaitable[Affinity | None]] | None = None) -> tuple[str, Upstream]:
    """The first of plan.targets that answers, before any byte reaches the client: a lane with no
    ready or reachable replica, or whose replicas all answer 5xx, passes the request on to the
    next target (its fallback). A 429 is an answer (admission), passed through. A lane scaled to
    zero holds the request (`activator`) until a replica turns warm, or passes it to its fallback.
    Each answered attempt is recorded on its lane (`lanes`, `metrics`); the replica that served the
    prompt is remembered (Affinity.sent): in `prefixes` for character hashes, or, when `affinity_of`
    (the router's) scored the engines' own block hashes, as blocks expected on that replica until its
    block events confirm them."""
    cfg = rt.config
    timeout = upstream_timeout(cfg)
    failures: list[str] = []
    deadline = time.monotonic() + cfg.limits.request_timeout_s
    for i, target in enumerate(plan.targets):
        spec = cfg.specialist(target)
        assert spec is not None

        def on_attempt(a: Attempt, retried: bool, target: str = target) -> None:
            if a.status:
                lanes.record_response(target, a.status == 429, plan.decision.intent, time.monotonic())
            if retried:
                metrics.retries.labels(target, "connect" if a.status == 0 else str(a.status)).inc()

        body = upstream_body(req.body, target, plan.adapters.get(target))   # the lane's adapter unless one is asked
        payload = json.dumps(body).encode()
        adapter = plan.adapters.get(target) or body.get("adapter")
        up: Upstream | None = None
        # A lane that scales to zero is admitted a second time when none of its replicas could be
        # reached: its last engine stopped for idleness after the router's last poll still saw it
        # ready. The refused connections marked its replicas not ready, so the activator now holds
        # the request (and asks for a replica) like any request that finds the lane cold.
        admissions = 2 if spec.scale_from_zero is not None else 1
        for admission in range(admissions):
            if not await activator.admit(spec, replicas_now(target) if admission else rt.replicas.get(target, []),
                                         i + 1 < len(plan.targets), deadline):
                failures.append(f"{target}: starting from zero replicas")
                break
            replicas = replicas_now(target)   # current: discovery may have added one while the request was held
            affinity = (await affinity_of(cfg, req, target, adapter, tenant, body) if affinity_of is not None else
                        request_affinity(cfg.replica_choice, prefixes, req.body, req.text, target, adapter, tenant))
            try:
                up = await open_upstream(session, replicas, path, payload,
                                         {"Content-Type": "application/json", "x-request-id": rid,
                                          TENANT_HEADER: tenant}, timeout,
                                         cfg.polling.preempting_penalty, on_attempt, adapter=plan.adapters.get(target),
                                         affinity=affinity)
                break
            except NoReplica as e:
                if admission + 1 == admissions or any(r.ready for r in replicas_now(target)):
                    failures.append(f"{target}: {e}")
                    break
        if up is None:
            continue
        if up.response.status >= 500 and i + 1 < len(plan.targets):
            failures.append(f"{target}: HTTP {up.response.status}")
            up.response.release()
            up.replica.inflight -= 1
            metrics.retries.labels(target, "fallback").inc()
            continue
        metrics.replica_choice.labels(target, choice_outcome(affinity, up.replica)).inc()
        if affinity is not None and up.response.status < 400:
            affinity.sent(up.replica.url, prefixes)
        if i > 0:
            log.info("request %s: %s served for %s (%s)", rid, target, plan.targets[0], "; ".join(failures))
        return target, up
    log.warning("request %s: no ready replica could serve: %s", rid, "; ".join(failures))
    raise ApiError(503, "no_ready_replica", f"no ready replica of {', '.join(plan.targets)} could serve this "
                   f"request (request id {rid})", retry_after_ms=1000)


async def answer_text(session: aiohttp.ClientSession, replicas: list[ReplicaState], path: str, body: dict,
                      headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                      preempting_penalty: float) -> str | None:
    """The first choice's text of a non-streamed answer to `body` from one of `replicas` (a shadow copy);
    None when no replica took it or it answered other than 200."""
    try:
        up = await open_upstream(session, replicas, path, json.dumps(body).encode(), headers, timeout,
                                 preempting_penalty, adapter=body.get("adapter"))
    except NoReplica:
        return None
    try:
        if up.response.status != 200:
            return None
        return text_of_response(await up.response.json(content_type=None))
    finally:
        up.replica.inflight -= 1
        up.response.release()


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
        except ConnectionResetError:
            # aiohttp's ClientConnectionResetError ("Cannot write to closing transport") is both a
            # ClientConnectionError and a ConnectionResetError; only writes to the client raise it here,
            # so it is the client leaving, not the engine failing.
            raise
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
