"""`consort engine`: one specialist's engine behind an OpenAI-compatible aiohttp server.

Handlers are thin: protocol.py parses and validates, async_engine.py runs the engine on its own
thread, generate() below turns engine outputs into text deltas (incremental detokenizer + stop
strings) that the completion/chat handlers shape into JSON or SSE.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import web

from consort_engine.serving import protocol as P
from consort_engine.serving import responses as R
from consort_engine.text import tool_calls as T
from consort_engine.model.attention import default_block_size
from consort_engine.core.async_engine import AsyncEngine, EngineFailed, EngineNotReady
from consort_engine.config import EngineConfig, HelpFormatter
from consort_engine.serving.adapter_sync import AdapterSync
from consort_engine.model.lora import AdapterError
from consort_engine.serving.credential import needs_credential, presented, read_credentials
from consort_engine.serving.metrics import EngineMetrics, SloTracker
from consort_engine.kv.sequence import PromptLogprobs, Sequence
from consort_engine.model.cpu import apply_threads
from consort_engine.text.guided import CompileBusy, CompileSlots, CompileTimeout, GrammarError, Grammars, GuidedSpec
from consort_engine.model.loader import eos_token_ids, load_model_config
from consort_engine.text.tokenizer import ChatTemplateError, IncrementalDetokenizer, StopStringMatcher, Tokenizer, TooManyTokens

log = logging.getLogger("consort.server")


class StartupError(RuntimeError):
    """A fatal start-up problem; main() prints it as the last line and exits 1."""

CTX = web.AppKey("consort_ctx", object)
STREAM = "consort_stream"   # request key: the prepared SSE response of a streaming request
TENANT_HEADER = "x-consort-tenant"   # set by the router (which overwrites any client's); salts the prefix cache


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), so start-up time includes interpreter and imports."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_GRAMMARS_LOCK = threading.Lock()


@dataclass
class ServerContext:
    config: EngineConfig
    tokenizer: Tokenizer
    engine: AsyncEngine
    served_name: str
    aliases: frozenset[str]
    max_model_len: int
    vocab_size: int
    metrics: EngineMetrics = field(init=False)
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))   # the model cards' `created` (vLLM: start)
    startup_s: float | None = None
    in_flight: int = 0
    adapter_sync: AdapterSync | None = None     # --adapters-file: the adapters this engine must serve
    credentials: tuple[bytes, ...] = ()         # digests of the engine credential(s); (): open (credential.py)
    metrics_port: bool = False                  # /metrics is (also) served on its own port
    _grammars: Grammars | None = field(default=None, init=False, repr=False)
    compile_slots: CompileSlots = field(
        default_factory=lambda: CompileSlots(P.MAX_CONCURRENT_COMPILES, P.GUIDED_COMPILE_TIMEOUT_S))

    def __post_init__(self) -> None:
        c = self.config
        slo = SloTracker(None if c.slo_ttft_ms is None else c.slo_ttft_ms / 1000.0,
                         None if c.slo_itl_ms is None else c.slo_itl_ms / 1000.0)
        self.metrics = EngineMetrics(self.served_name, self.config.name, self.status, slo)

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler, built on the first guided request (xgrammar reads the
        whole vocabulary once; servers that never see one do not pay for it)."""
        with _GRAMMARS_LOCK:      # first guided requests may arrive together, on worker threads
            if self._grammars is None:
                eos = sorted(eos_token_ids(self.config.model, load_model_config(self.config.model)))
                self._grammars = Grammars(self.tokenizer.hf, self.vocab_size, eos)
        return self._grammars

    def speculation_state(self) -> str:
        if self.config.speculative == "off":
            return "off"
        state = self.engine.stats().get("speculation")
        if isinstance(state, dict):
            state = state.get("state")
        return state if state in ("on", "off", "fallback") else "on"

    def adapters_state(self) -> dict[str, str]:
        """name -> loaded | pending | failed."""
        if not self.engine.ready:
            wanted = self.adapter_sync.desired if self.adapter_sync is not None else self.config.adapters
            return {name: "pending" for name in wanted}
        paths = self.engine.stats().get("adapter_paths") or {}
        if self.adapter_sync is not None:
            return self.adapter_sync.states(paths)
        return {str(name): "loaded" for name in paths}

    def pending_adapters(self) -> list[str]:
        """The adapters /ready waits for: those the engine started with and still serves. A hot-load
        never takes a serving replica out of rotation; it shows in /v1/status until it is done."""
        states = self.adapters_state()
        if self.adapter_sync is not None:
            wanted = self.adapter_sync.startup & set(self.adapter_sync.desired)
            return sorted(n for n in wanted if states.get(n) == "pending")
        return sorted(n for n in self.config.adapters if states.get(n) != "loaded")

    def status(self) -> dict:
        s = self.engine.stats()
        runner = getattr(self.engine.engine, "runner", None)
        return {
            "specialist": self.config.name,
            "model": self.served_name,
            "model_path": self.config.model,
            "state": self.engine.state,
            "warm": self.engine.ready,
            "error": self.engine.error,
            "adapters": self.adapters_state(),
            "adapter_errors": dict(self.adapter_sync.errors) if self.adapter_sync is not None else {},
            "queue_depth": s.get("waiting", 0),
            "running": s.get("running", 0),
            "waiting": s.get("waiting", 0),
            "in_flight_requests": self.in_flight,
            "kv_total_blocks": s.get("kv_total_blocks"),
            "kv_free_blocks": s.get("kv_free_blocks"),
            "kv_cached_blocks": s.get("kv_cached_blocks"),
            "kv_usage": s.get("kv_usage"),
            "block_size": self.config.block_size,
            "preempting": bool(s.get("preempting", False)),
            "num_preemptions": s.get("num_preemptions", 0),
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "prefix_cache_hits": s.get("prefix_cache_hits", 0),
            "step_time_ewma_s": s.get("step_time_ewma_s"),
            "slo": self.metrics.slo.summary(),
            "speculation": {"mode": self.config.speculative, **(s.get("speculation") or {}),
                            "state": self.speculation_state(),
                            "num_speculative_tokens": self.config.num_speculative_tokens},
            "max_model_len": getattr(runner, "max_model_len", self.max_model_len),
            "device": self.config.device,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "dtype": self.config.dtype,
            "load_s": self.engine.load_s,
            "warmup_s": self.engine.warmup_s,
            "startup_s": self.startup_s,
            "engine": {k: v for k, v in s.items() if isinstance(v, (int, float, str, bool)) or v is None},
        }


# ---------------------------------------------------------------------------------------------
# generation: engine outputs -> text deltas


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[P.TokenLogprob]
    finish_reason: str | None = None
    stop_reason: Any = None
    num_output_tokens: int = 0      # all tokens generated so far (set on every delta)
    prompt_logprobs: PromptLogprobs | None = None   # on the first delta, when the request asks


@dataclass
class RequestTimes:
    arrival: float
    admitted: float | None = None
    first: float | None = None
    last: float | None = None
    itls: list[float] = field(default_factory=list)

    def on_tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.first is None:
            self.first = now
        elif self.last is not None:
            gap = (now - self.last) / n
            self.itls.extend([gap] * n)
        self.last = now


def _token_logprobs(ids: list[int], raw: Any) -> list[P.TokenLogprob]:
    """Normalize the engine's per-token logprobs (one entry per new token) into TokenLogprob."""
    if not raw:
        return []
    out = []
    for tid, entry in zip(ids, raw):
        if isinstance(entry, P.TokenLogprob):
            out.append(entry)
            continue
        if isinstance(entry, dict) and "logprob" in entry:   # the Sampler's {"token_id", "logprob", "top"}
            out.append(P.TokenLogprob(int(entry.get("token_id", tid)), float(entry["logprob"]),
                                      [(int(t), float(v)) for t, v in entry.get("top", [])]))
            continue
        if isinstance(entry, dict):            # {token_id: logprob} incl. the chosen token
            chosen = float(entry.get(tid, float("-inf")))
            top = sorted(((int(k), float(v)) for k, v in entry.items()), key=lambda kv: -kv[1])
        else:                                  # (chosen_logprob, [(token_id, logprob), ...])
            chosen, top_raw = entry[0], entry[1] if len(entry) > 1 else []
            if isinstance(top_raw, dict):
                top_raw = top_raw.items()
            top = sorted(((int(k), float(v)) for k, v in top_raw), key=lambda kv: -kv[1])
            chosen = float(chosen)
        out.append(P.TokenLogprob(int(tid), chosen, top))
    return out


async def generate(ctx: ServerContext, req: P.GenerationRequest, seq: Sequence, times: RequestTimes,
                   stream) -> AsyncIterator[Delta]:
    """Yield text deltas for an admitted sequence; stops the sequence in the engine on a stop string."""
    detok = IncrementalDetokenizer(ctx.tokenizer, seq.prompt_token_ids, req.skip_special_tokens)
    matcher = StopStringMatcher(req.sampling.stop)
    k = seq.sampling.logprobs    # best_of ranks by them: the sequence has them even where the request did not ask
    total = 0
    async for out in stream:
        plp = getattr(out, "prompt_logprobs", None)
        if req.max_tokens == 0:   # echo only: prefill ran (prompt logprobs); its sampled token is dropped
            ctx.engine.abort(seq.seq_id, "length")
            yield Delta("", [], [], "length", None, 0, plp)
            return
        ids = list(out.new_token_ids or [])
        total += len(ids)
        times.on_tokens(time.monotonic(), len(ids))
        lps = _token_logprobs(ids, out.logprobs) if k is not None else []
        if k is not None:
            lps = [P.TokenLogprob(lp.token_id, lp.logprob, lp.top[:k]) for lp in lps]
        text, stopped = matcher.feed(detok.step(ids) if ids else "")
        if stopped:
            ctx.engine.abort(seq.seq_id, "stop")
            yield Delta(text, ids, lps, "stop", matcher.matched, total, plp)
            return
        if out.finished:
            tail, stopped = matcher.feed(detok.flush())
            text += tail
            if not stopped:
                text += matcher.flush()
            reason = "stop" if stopped else (out.finish_reason or "stop")
            stop_reason = matcher.matched if stopped else None
            if reason == "stop" and stop_reason is None and ids and ids[-1] in req.sampling.stop_token_set:
                stop_reason = ids[-1]
            yield Delta(text, ids, lps, reason, stop_reason, total, plp)
            return
        yield Delta(text, ids, lps, num_output_tokens=total, prompt_logprobs=plp)


# ---------------------------------------------------------------------------------------------
# handlers


def _json_error(err: P.ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers())


def request_id(request: web.Request) -> str:
    """This request's id (the client's x-request-id, else a new one), stamped on the response."""
    rid = request.get("request_id") or request.headers.get("x-request-id") or uuid.uuid4().hex
    request["request_id"] = rid
    return rid


def server_error(rid: str, code: str, what: str, cause: BaseException | None = None, status: int = 500) -> P.ApiError:
    """A 5xx that names the request id, not the cause: exception text can carry paths, shapes or another
    request's data. The cause is logged under the same id."""
    if cause is not None:
        log.error("request %s: %s: %s", rid, what, cause)
    return P.ApiError(status, code, f"{what} (request id {rid}; the cause is in the server log)", type="server_error")


@web.middleware
async def credential_middleware(request: web.Request, handler):
    """With a credential configured, every route but the probes (and /metrics) needs it: a typed 401,
    which error_middleware (outside this one) renders."""
    ctx: ServerContext = request.app[CTX]
    if ctx.credentials and needs_credential(request.path, ctx.metrics_port) \
            and not presented(ctx.credentials, request.headers.get("Authorization")):
        raise P.ApiError(401, "invalid_credential", "this engine requires its credential (Authorization: "
                         "Bearer <engine credential>); clients reach it through the router",
                         type="authentication_error")
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except P.ApiError as err:
        ctx: ServerContext = request.app[CTX]
        if err.status == 429:
            ctx.metrics.observe_rejected(request.get("consort_adapter"), err.code)
        else:
            ctx.metrics.observe_invalid(err.code)
        return _json_error(err)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "http_error")
            return _json_error(P.ApiError(exc.status, code, exc.reason))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - a bug must never take the server down
        rid = request_id(request)
        log.exception("request %s: unhandled error on %s %s", rid, request.method, request.path)
        return _json_error(server_error(rid, "internal_error", "internal error"))


async def stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    ctx: ServerContext = request.app[CTX]
    h = response.headers
    h["x-request-id"] = request.get("request_id") or request.headers.get("x-request-id") or uuid.uuid4().hex
    h["x-consort-specialist"] = ctx.config.name
    h["x-consort-adapter"] = request.get("consort_adapter") or "none"
    h["x-consort-speculation"] = ctx.speculation_state()
    if request.get("ignored_fields"):
        h["x-consort-ignored-fields"] = ",".join(request["ignored_fields"])


# A JSON escape of a UTF-16 surrogate: json.loads pairs valid ones, a lone one stays in the str
# and breaks the tokenizer (and UTF-8) later.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Bodies above this are parsed and tokenized on a worker thread so /health and streams keep flowing.
OFF_LOOP_BYTES = 64 * 1024


def decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise P.bad("invalid_json", f"request body is not valid JSON: {e}")
    if SURROGATE_ESCAPE.search(raw) and has_lone_surrogate(body):
        raise P.bad("invalid_unicode", "request body contains a lone UTF-16 surrogate escape (such as "
                    "\\ud800): strings must be valid Unicode")
    return body


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string in the parsed body (keys included) is not valid Unicode. Each string is
    checked on its own: re-encoding the whole body at once would hold the GIL for ~100 ms per 10 MB."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    return await asyncio.to_thread(decode_json, raw) if len(raw) > OFF_LOOP_BYTES else decode_json(raw)


def render_chat(tokenizer: Tokenizer, req: P.GenerationRequest | P.TokenizeRequest) -> str:
    """The request's messages through the chat template; a template error is the client's (400)."""
    try:
        tools = getattr(req, "tools", None)
        return tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             tools=tools.tools if tools is not None else None)
    except ChatTemplateError as e:
        raise P.bad("chat_template_error", str(e), "messages")


def build_prompt(ctx: ServerContext, req: P.GenerationRequest) -> list[int]:
    try:
        if req.kind == "chat":
            ids = ctx.tokenizer.encode_chat(render_chat(ctx.tokenizer, req), limit=ctx.max_model_len)
        elif req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            P.check_token_ids(ids, ctx.vocab_size)
        else:
            ids = ctx.tokenizer.encode(req.prompt, limit=ctx.max_model_len)
    except TooManyTokens as e:
        P.resolve_max_tokens(req, e.count, ctx.max_model_len, e.at_least)   # raises context_length_exceeded
        raise
    if not ids:
        raise P.bad("empty_prompt", "the prompt encodes to zero tokens", "prompt")
    return ids


def check_target(ctx: ServerContext, req: P.GenerationRequest) -> None:
    """The model named must be served here. An adapter can be named as the model, bare (as vLLM
    serves LoRA modules) or as `base:adapter` (as /v1/models lists it)."""
    if req.model is not None and req.model not in ctx.aliases:
        base, sep, name = req.model.rpartition(":")
        adapters = ctx.adapters_state()
        if req.model in adapters and req.adapter in (None, req.model):
            req.adapter = req.model
        elif sep and base in ctx.aliases and name in adapters and req.adapter in (None, name):
            req.adapter = name
        else:
            raise P.ApiError(404, "model_not_found", f"model '{req.model}' is not served here; this engine serves "
                             f"'{ctx.served_name}'" + (f" and adapters {sorted(adapters)}" if adapters else ""),
                             "model")
    if req.adapter is not None and req.adapter not in ctx.adapters_state():
        raise P.ApiError(404, "adapter_not_found", f"adapter '{req.adapter}' is not loaded on this engine",
                         "adapter")


async def admit(ctx: ServerContext, seqs: list[Sequence], rid: str) -> list:
    try:
        return await ctx.engine.add(seqs)
    except EngineNotReady as e:
        raise P.admission_error("warming", e.retry_after_ms, f"the engine is {e.state}; retry when /ready is 200")
    except EngineFailed as e:
        raise server_error(rid, "engine_failed", "the engine has failed", e, status=503)
    except Exception as e:
        if type(e).__name__ == "AdmissionRejected":
            if getattr(e, "permanent", False):   # can never fit this engine: retrying cannot help
                raise P.bad("kv_capacity", getattr(e, "message", "") or str(e), "prompt")
            raise P.admission_error(getattr(e, "code", "queue_full"), getattr(e, "retry_after_ms", 1000),
                                    getattr(e, "message", "") or str(e))
        if isinstance(e, ValueError):   # the engine refused the request itself (e.g. exceeds the pool)
            raise P.bad("invalid_request", str(e))
        raise


@dataclass
class Choice:
    """One sequence of a request and what it has produced: choice `index` of the response (prompt i,
    sample j -> i * n + j, as OpenAI numbers them)."""
    index: int
    req: P.GenerationRequest        # the request as this choice's prompt sees it (prompt, echo)
    seq: Sequence
    times: RequestTimes
    deltas: AsyncIterator[Delta] | None = None
    last: Delta | None = None       # the latest delta; its finish_reason is set once the choice is done
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lps: list[P.TokenLogprob] = field(default_factory=list)
    prompt_lps: PromptLogprobs | None = None     # the prompt's logprobs, when asked for

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None


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


async def compile_guided(ctx: ServerContext, g: GuidedSpec) -> None:
    """Compile (or find cached) a request's grammar, off the loop (a new schema can take seconds) and
    through the compile slots: a typed 400 when it does not compile or not in time, a typed 429 when
    every slot stays busy."""
    if ctx._grammars is not None and ctx._grammars.cached(g):
        return
    try:
        await ctx.compile_slots.run(lambda: ctx.grammars.compile(g))
    except GrammarError as e:
        raise P.bad("invalid_value", str(e), e.param) from None
    except CompileTimeout:
        raise P.bad("grammar_timeout", f"'{g.param}' did not compile within {P.GUIDED_COMPILE_TIMEOUT_S:g} s (the "
                    "compile finishes in the background; an identical request later reuses it)", g.param) from None
    except CompileBusy:
        raise P.admission_error("queue_full", 1000, f"{P.MAX_CONCURRENT_COMPILES} grammar compiles are running; "
                                "retry later") from None


async def admit_choices(ctx: ServerContext, choices: list[Choice], rid: str) -> None:
    """Admit every choice in one engine command. The n samples of a prompt run its prefill once: the
    block manager gives the siblings the first one's full prompt blocks by hash as they are allocated,
    in the same step, and each layer writes those blocks' K/V before any sequence attends to them."""
    streams = await admit(ctx, [c.seq for c in choices], rid)
    for c, stream in zip(choices, streams):
        c.times.admitted = stream.admitted_at
        c.deltas = generate(ctx, c.req, c.seq, c.times, stream)


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
    """Every choice's deltas as they come; the first failure ends it (and the others are stopped)."""
    if len(choices) == 1:
        c = choices[0]
        async for d in c.deltas:
            yield c, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for d in c.deltas:
                await queue.put((c, d, None))
            await queue.put((c, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((c, None, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                left -= 1
                continue
            yield c, d
    finally:
        for t in tasks:
            t.cancel()


def record(ctx: ServerContext, c: Choice, deadline: float | None) -> None:
    """Metrics for a choice; one that did not finish (client gone, error) is aborted: its blocks free now."""
    seq, times, n_prompt = c.seq, c.times, len(c.seq.prompt_token_ids)
    if not c.finished:
        ctx.engine.abort(seq.seq_id, "abort")
        if times.admitted is not None:
            ctx.metrics.observe_aborted(c.req.adapter, prompt_tokens=min(seq.num_computed_tokens, n_prompt),
                                        output_tokens=seq.num_output_tokens)
        return
    ctx.metrics.observe_finished(
        c.req.adapter, prompt_tokens=n_prompt, output_tokens=c.last.num_output_tokens,
        ttft=None if times.first is None else times.first - times.arrival,
        admission_ttft=None if times.first is None or times.admitted is None else times.first - times.admitted,
        itls=times.itls, e2e=time.monotonic() - times.arrival,
        finish_reason=c.last.finish_reason or "stop", preempted=seq.num_preemptions > 0,
        deadline_missed=None if deadline is None or times.first is None else times.first > deadline)


def echoed_prompt(ctx: ServerContext, req: P.GenerationRequest, seq: Sequence) -> str:
    """With `echo`, the prompt as text (a token-id prompt decoded), which leads the completion."""
    if not req.echo:
        return ""
    return req.prompt if req.prompt is not None else ctx.tokenizer.decode(seq.prompt_token_ids, skip_special_tokens=False)


def echoed_logprobs(c: Choice) -> list[P.TokenLogprob]:
    """With `echo` and `logprobs` k, the prompt's tokens lead the choice's logprobs (the first one None)."""
    if not (c.req.echo and c.req.logprobs is not None):
        return []
    return P.prompt_token_logprobs(c.seq.prompt_token_ids, c.prompt_lps, c.req.logprobs)


def prompt_logprobs_of(ctx: ServerContext, c: Choice) -> list[dict | None]:
    return P.vllm_prompt_logprobs(c.seq.prompt_token_ids, c.prompt_lps, c.req.prompt_logprobs,
                                  ctx.tokenizer.id_to_token)


def usage_of(choices: list[Choice], n: int, completion_tokens: int) -> dict:
    """OpenAI's usage: each prompt counted once, whatever n; every choice's generated tokens."""
    firsts = choices[::n]
    return P.usage(sum(len(c.seq.prompt_token_ids) for c in firsts), completion_tokens,
                   sum(c.seq.num_cached_tokens for c in firsts))


def best_choices(choices: list[Choice], k: int, n: int) -> list[Choice]:
    """Of each prompt's k samples, the n with the highest cumulative logprob, renumbered i * n + rank."""
    out = []
    for i in range(0, len(choices), k):
        group = choices[i:i + k]
        keep = P.best_indices([sum(lp.logprob for lp in c.lps) for c in group], n)
        out += [replace(group[j], index=(i // k) * n + r) for r, j in enumerate(keep)]
    return out


async def full_response(ctx: ServerContext, req: P.GenerationRequest, choices: list[Choice]) -> web.Response:
    async for c, d in merged(choices):
        c.text.append(d.text)
        c.ids.extend(d.token_ids)
        c.lps.extend(d.logprobs)
        if d.prompt_logprobs is not None:     # (empty, so falsy, for a one-token prompt)
            c.prompt_lps = d.prompt_logprobs
        c.last = d
    assert all(c.finished for c in choices)
    k = P.samples_per_prompt(req)
    usage = usage_of(choices, k, sum(len(c.ids) for c in choices))   # every sample counts, best_of too
    if req.best_of is not None:
        choices = best_choices(choices, k, req.n)
    body = P.envelope(req, ctx.served_name, chunk=False)
    body["choices"] = []
    for c in choices:
        logprobs = None
        if req.logprobs is not None:
            logprobs = (P.chat_logprobs(c.lps, ctx.tokenizer.id_to_token) if req.kind == "chat"
                        else P.completion_logprobs(echoed_logprobs(c) + c.lps, ctx.tokenizer.id_to_token, 0))
        text, reason, calls = echoed_prompt(ctx, c.req, c.seq) + "".join(c.text), c.last.finish_reason, None
        if req.tools is not None and req.tools.parses:
            parsed = T.parse_output(req.tools, text)
            text, calls = (parsed.content if parsed.tool_calls else parsed.content or ""), parsed.tool_calls or None
            reason = T.finish_reason(req.tools, bool(calls), reason)
        one = P.choice(c.req, text, reason, chunk=False, logprobs=logprobs,
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


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def stream_response(request: web.Request, ctx: ServerContext, req: P.GenerationRequest,
                          choices: list[Choice]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    request[STREAM] = resp
    await resp.prepare(request)
    base = P.envelope(req, ctx.served_name, chunk=True)
    n_out = 0
    offsets = {c.index: 0 for c in choices}
    unsent_prompt_ids = {c.index for c in choices} if req.return_token_ids else set()
    parsers = {c.index: T.ToolCallStreamer(req.tools) for c in choices} if req.tools and req.tools.parses else {}

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
            logprobs = P.completion_logprobs(echoed_logprobs(c), ctx.tokenizer.id_to_token, 0)
        offsets[c.index] += len(text)
        await resp.write(_sse(chunk_of(c, P.choice(c.req, text, None, chunk=True, logprobs=logprobs,
                                                   index=c.index))))

    for c in choices:
        if req.kind == "chat":   # OpenAI sends the role first
            await resp.write(_sse(chunk_of(c, P.choice(c.req, "", None, chunk=True, first=True, index=c.index))))
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
                pieces = T.chunk_pieces(parser.feed(d.text) + (parser.finish() if finish else [])) or [("", None)]
                finish = finish and T.finish_reason(req.tools, parser.called, finish)
            if not (any(t or tc for t, tc in pieces) or finish or (req.return_token_ids and d.token_ids)
                    or d.logprobs):
                continue
            logprobs = None
            if req.logprobs is not None:
                if req.kind == "chat":
                    logprobs = P.chat_logprobs(d.logprobs, ctx.tokenizer.id_to_token)
                else:
                    logprobs = P.completion_logprobs(d.logprobs, ctx.tokenizer.id_to_token, offsets[c.index])
            offsets[c.index] += len(d.text)
            for i, (text, calls) in enumerate(pieces):   # logprobs/ids with the first, finish with the last
                last = i == len(pieces) - 1
                chunk = chunk_of(c, P.choice(c.req, text, finish if last else None, chunk=True,
                                             logprobs=logprobs if i == 0 else None,
                                             token_ids=(d.token_ids if i == 0 else []) if req.return_token_ids
                                             else None, stop_reason=d.stop_reason, index=c.index,
                                             tool_calls=calls))
                if req.include_usage and req.continuous_usage:
                    chunk["usage"] = usage_of(choices, req.n, n_out)
                await resp.write(_sse(chunk))
    except EngineFailed as e:   # headers are out: report in-band, as OpenAI-compatible servers do
        err = server_error(req.request_id, "engine_failed", "the engine failed while serving this request", e)
        await resp.write(_sse(err.body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    assert all(c.finished for c in choices)
    if req.include_usage:
        await resp.write(_sse(dict(base, choices=[], usage=usage_of(choices, req.n, n_out))))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


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
            await resp.write(f"event: {kind}\n".encode() + _sse(R.event(kind, seq, **fields)))
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
    app.router.add_get("/metrics", metrics)
    return app


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort engine", description="Serve one specialist's paged-KV engine.",
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json); a Specialist's "
                        "demo:// source is turned into one by `consort up` or `consort demo-model DIR`")
    p.add_argument("--port", type=int, required=True, help="port (0 = any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--name", default=None, help="specialist name; unset: the checkpoint directory's name")
    p.add_argument("--served-model-name", default=None, help="model id in responses; unset: --name")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks in the pool; unset: sized from the memory left after the weights "
                        "(--kv-memory-fraction of it)")
    p.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                   help="tokens per KV block; unset: 256 on cuda (flash-attn's page), 16 on cpu")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split attention heads and the MLP over this many ranks (processes; GPUs on cuda)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache; auto: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + completion; unset: the checkpoint's max_position_embeddings")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, metavar="N",
                   help="sequences running in one step (the decode batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens, metavar="N",
                   help="tokens per step: decode tokens plus prefill chunks")
    p.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting, metavar="N",
                   help="waiting-queue bound; past it requests get 429 queue_full")
    p.add_argument("--kv-memory-fraction", type=float, default=EngineConfig.kv_memory_fraction, metavar="F",
                   help="share of the memory left after the weights that the KV pool may take (without --num-blocks)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of a prompt prefix seen before")
    p.add_argument("--speculative", default="off", choices=["off", "ngram", "mtp"],
                   help="speculative decoding: ngram drafts from the prompt and output so far, mtp from the "
                        "checkpoint's multi-token-prediction block")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                   help="draft tokens proposed per step (with --speculative)")
    p.add_argument("--spec-typical-tau", type=float, default=EngineConfig.spec_typical_tau,
                   help="typical-acceptance tau for sampled requests (0: only greedy requests speculate)")
    p.add_argument("--tool-trigger", action="append", default=None, metavar="TOKEN",
                   help="tool-call trigger token (repeatable; unset: <QUERY_TOOL> and <SCRIPT_START>): "
                        "speculation stops at it")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter (repeatable); requests pick it with `adapter` or model "
                        "SPECIALIST:NAME")
    p.add_argument("--adapters-file", default=None, metavar="PATH",
                   help="JSON list of the adapters to serve (the Specialist's mounted ConfigMap): loaded before "
                        "/ready, then re-read every few seconds and hot-loaded / unloaded to match")
    p.add_argument("--max-adapters", type=int, default=4, metavar="N",
                   help="adapters loaded at once; one more is refused until another is unloaded")
    p.add_argument("--seed", type=int, default=0,
                   help="accepted as vLLM's flag; a request's own `seed` makes its sampling reproducible")
    p.add_argument("--enforce-eager", action="store_true",
                   help="cuda: no decode CUDA graphs, every step runs eagerly (cpu never captures)")
    p.add_argument("--slo-ttft-ms", type=int, default=None, help="published time-to-first-token objective (p95)")
    p.add_argument("--slo-itl-ms", type=int, default=None, help="published inter-token latency objective (p95)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and the kernels; unset: the cgroup CPU quota, else every "
                        "core this process may use")
    p.add_argument("--credential-file", default=None, metavar="PATH",
                   help="require this file's credential (Authorization: Bearer) on every route but /health, "
                        "/ready and /metrics; else $CONSORT_ENGINE_CREDENTIAL_FILE, else open to every caller")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics on this port; the API port's /metrics then needs the credential")
    p.add_argument("--max-body-bytes", type=int, default=EngineConfig.max_body_bytes,
                   help="largest request body accepted; larger ones get 413 request_too_large")
    p.add_argument("--drain-timeout", type=float, default=45.0, metavar="SECONDS",
                   help="on SIGTERM, seconds to let accepted requests finish (keep it below the pod's "
                        "terminationGracePeriodSeconds) before cancelling them")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    if "://" in a.model:   # a Specialist's model source, which Path() would also mangle (demo:/tiny)
        raise SystemExit(f"consort engine: --model {a.model}: a model source URL, not a directory; the engine "
                         "takes a checkpoint directory (`consort demo-model DIR` writes a demo one; `consort up` "
                         "turns a manifest's sources into directories)")
    adapters = {}
    for item in a.adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"consort engine: --adapter expects NAME=PATH, got {item!r}")
        if not P.ADAPTER_NAME.fullmatch(name):
            raise SystemExit(f"consort engine: adapter name {name!r} must be a DNS label (lowercase, digits, '-')")
        adapters[name] = path
    if adapters and a.adapters_file:
        raise SystemExit("consort engine: --adapter and --adapters-file exclude each other (the file is the whole list)")
    if not 0.0 <= a.spec_typical_tau <= 1.0:
        raise SystemExit(f"consort engine: --spec-typical-tau must be in [0, 1], got {a.spec_typical_tau}")
    for flag, value in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-itl-ms", a.slo_itl_ms)):
        if value is not None and value <= 0:
            raise SystemExit(f"consort engine: {flag} must be a positive number of milliseconds, got {value}")
    if a.tensor_parallel_size < 1:
        raise SystemExit(f"consort engine: --tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
    return EngineConfig(
        model=str(Path(a.model)), name=a.name or Path(a.model).resolve().name, device=a.device, dtype=a.dtype,
        tensor_parallel_size=a.tensor_parallel_size,
        block_size=a.block_size or default_block_size(a.device), num_blocks=a.num_blocks, kv_memory_fraction=a.kv_memory_fraction,
        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_waiting=a.max_waiting, enable_prefix_caching=not a.no_prefix_caching, speculative=a.speculative,
        num_speculative_tokens=a.num_speculative_tokens, spec_typical_tau=a.spec_typical_tau,
        adapters=adapters, max_adapters=a.max_adapters, seed=a.seed, enforce_eager=a.enforce_eager,
        slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms, max_body_bytes=a.max_body_bytes,
        **({} if a.tool_trigger is None else {"tool_triggers": list(a.tool_trigger)}))


def resolve_tool_triggers(config: EngineConfig, tokenizer: Tokenizer) -> None:
    """Tool triggers that are single tokens of this tokenizer are watched by id; others cannot be
    (a draft run is checked token by token) and are reported once at start-up."""
    ids = []
    for text in config.tool_triggers:
        tid = tokenizer.hf.token_to_id(text)
        if tid is None:
            log.info("tool trigger %r is not a single token of this tokenizer: not watched", text)
        else:
            ids.append(tid)
    config.tool_trigger_ids = sorted(set(config.tool_trigger_ids) | set(ids))


def checkpoint_limits(config: EngineConfig) -> tuple[int, int]:
    """(max_model_len, vocab_size) from config.json, before the engine has loaded."""
    cfg = json.loads((Path(config.model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    max_len = config.max_model_len or cfg.get("max_position_embeddings") or 2048
    return int(max_len), int(cfg.get("vocab_size", 0))


def build_context(config: EngineConfig, served_name: str | None = None, warmup: bool = True) -> ServerContext:
    if not (Path(config.model) / "config.json").is_file():
        raise StartupError(f"{config.model} is not a checkpoint directory (no config.json)")
    tokenizer = Tokenizer.from_dir(config.model)
    resolve_tool_triggers(config, tokenizer)
    max_len, vocab = checkpoint_limits(config)
    served = served_name or config.name
    aliases = frozenset({served, config.name, Path(config.model).resolve().name, str(config.model)})
    engine = AsyncEngine(config, warmup=warmup)
    return ServerContext(config=config, tokenizer=tokenizer, engine=engine, served_name=served, aliases=aliases,
                         max_model_len=max_len, vocab_size=vocab or tokenizer.vocab_size)


async def serve_metrics(ctx: ServerContext, host: str, port: int) -> web.AppRunner:
    """/metrics alone on its own port (--metrics-port): a NetworkPolicy can admit monitoring there only."""
    app = web.Application()
    app[CTX] = ctx
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"consort engine: metrics on http://{host}:{bound}/metrics", flush=True)
    return runner


async def serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    threads = apply_threads(args.threads)
    print(f"consort engine: specialist {config.name!r}, model {config.model}, device {config.device}, "
          f"dtype {config.dtype}, {threads} CPU thread(s)", flush=True)
    credentials = read_credentials(args.credential_file)   # before the model loads: a bad file fails at once
    ctx = build_context(config, args.served_model_name)
    ctx.credentials = credentials
    ctx.metrics_port = args.metrics_port is not None
    if args.adapters_file:
        ctx.adapter_sync = AdapterSync(args.adapters_file, config.model, ctx.engine.call)
        await asyncio.to_thread(ctx.adapter_sync.initial)
    app = build_app(ctx)
    # shutdown_timeout: how long runner.cleanup() (on SIGTERM) lets accepted requests finish after
    # the listener closes; new connections are refused meanwhile, so routers retry them elsewhere.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=log if args.access_log else None,
                           shutdown_timeout=args.drain_timeout)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else args.port
    print(f"consort engine: listening on http://{args.host}:{port} (/health alive, /ready after warmup)", flush=True)
    if ctx.credentials:
        print("consort engine: an engine credential is required on every route but /health, /ready"
              + ("" if ctx.metrics_port else " and /metrics"), flush=True)
    metrics_runner = await serve_metrics(ctx, args.host, args.metrics_port) if ctx.metrics_port else None

    def on_ready() -> None:
        ctx.startup_s = process_age_s() or (time.monotonic() - ctx.started)
        runner_ = ctx.engine.engine.runner
        ctx.max_model_len = int(getattr(runner_, "max_model_len", ctx.max_model_len))
        s = ctx.engine.stats()
        print(f"consort engine: ready in {ctx.startup_s:.2f} s from process start (load {ctx.engine.load_s:.2f} s, "
              f"warmup {ctx.engine.warmup_s or 0:.2f} s); kv blocks {s.get('kv_total_blocks')} x "
              f"{config.block_size} tokens; max_model_len {ctx.max_model_len}", flush=True)

    stop = asyncio.Event()
    ctx.engine._on_ready.append(on_ready)
    # A model that cannot load is fatal: exit non-zero at once (a supervisor or kubelet restarts us
    # or shows the cause) rather than serve 503s forever.
    ctx.engine._on_failed.append(stop.set)
    print("consort engine: loading model ...", flush=True)
    ctx.engine.start()
    if ctx.adapter_sync is not None:
        def loaded_paths() -> dict[str, str] | None:
            return ctx.engine.stats().get("adapter_paths") or {} if ctx.engine.ready else None
        sync_task = asyncio.create_task(ctx.adapter_sync.run(loaded_paths, stop))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if ctx.adapter_sync is not None:
        await sync_task
    s = ctx.engine.stats()
    if ctx.engine.state != "failed":
        print(f"consort engine: draining: {s.get('running', 0)} running and {s.get('waiting', 0)} waiting "
              f"requests may finish within {args.drain_timeout:g} s; new connections are refused", flush=True)
    await runner.cleanup()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    print("consort engine: shutting down", flush=True)
    await asyncio.to_thread(ctx.engine.shutdown)
    if ctx.engine.state == "failed":
        raise StartupError(f"model {config.model} failed to load: {ctx.engine.error}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(args))
    except Exception as exc:  # noqa: BLE001 - any escape from serve() is fatal
        # Bad model dir, unsupported architecture, port in use, ...: the cause is the last line.
        log.debug("start-up failed", exc_info=True)
        cause = " ".join(str(exc).split()) or type(exc).__name__   # one line, even for multi-line messages
        print(f"consort engine: fatal: {cause}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
