"""One prepared request's generation: its sequences (prompts x samples) made and admitted in one engine
command, engine outputs turned into text deltas (incremental detokenizer + stop strings), the n /
best_of choices merged, and each choice's metrics recorded when it ends."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from consort_engine.core.async_engine import EngineFailed, EngineNotReady
from consort_engine.core.engine import AdmissionRejected
from consort_engine.kv.sequence import PromptLogprobs, Sequence
from consort_engine.serving.context import ServerContext
from consort_engine.serving.errors import admission_error, bad, server_error
from consort_engine.serving.prepare import Prepared
from consort_engine.serving.protocol import GenerationRequest
from consort_engine.text.tokenizer import IncrementalDetokenizer, StopStringMatcher

log = logging.getLogger("consort.server")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None                       # None: the first prompt token (nothing predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), best first


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: Any = None
    num_output_tokens: int = 0      # all tokens generated so far (set on every delta)
    prompt_logprobs: PromptLogprobs | None = None   # on the first delta, when the request asks


@dataclass
class RequestTimes:
    arrival: float
    deadline: float | None = None      # monotonic; the first token should come before it
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
            self.itls += [gap] * n
        self.last = now


def _token_logprobs(ids: list[int], raw: Any) -> list[TokenLogprob]:
    """Normalize the engine's per-token logprobs (one entry per new token) into TokenLogprob."""
    if not raw:
        return []
    out = []
    for tid, entry in zip(ids, raw):
        if isinstance(entry, TokenLogprob):
            out.append(entry)
            continue
        if isinstance(entry, dict) and "logprob" in entry:   # the Sampler's {"token_id", "logprob", "top"}
            out.append(TokenLogprob(int(entry.get("token_id", tid)), float(entry["logprob"]),
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
        out.append(TokenLogprob(int(tid), chosen, top))
    return out


async def generate(ctx: ServerContext, req: GenerationRequest, seq: Sequence, times: RequestTimes, stream,
                   detok: IncrementalDetokenizer, matcher: StopStringMatcher) -> AsyncIterator[Delta]:
    """Yield text deltas for an admitted sequence (its text through `detok`, cut at the first stop string
    `matcher` finds); stops the sequence in the engine on a stop string."""
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
            lps = [TokenLogprob(lp.token_id, lp.logprob, lp.top[:k]) for lp in lps]
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


async def admit(ctx: ServerContext, seqs: list[Sequence], rid: str) -> list:
    try:
        return await ctx.engine.add(seqs)
    except EngineNotReady as e:
        raise admission_error("warming", e.retry_after_ms, f"the engine is {e.state}; retry when /ready is 200")
    except EngineFailed as e:
        raise server_error(rid, "engine_failed", "the engine has failed", e, status=503)
    except AdmissionRejected as e:
        if e.permanent:   # can never fit this engine: retrying cannot help
            raise bad("kv_capacity", e.message or str(e), "prompt")
        raise admission_error(e.code, e.retry_after_ms, e.message or str(e))
    except ValueError as e:   # the engine refused the request itself (e.g. exceeds the pool)
        raise bad("invalid_request", str(e))


@dataclass
class Choice:
    """One sequence of a request and what it has produced: choice `index` of the response (prompt i,
    sample j -> i * n + j, as OpenAI numbers them)."""
    index: int
    req: GenerationRequest        # the request as this choice's prompt sees it (prompt, echo)
    seq: Sequence
    times: RequestTimes
    deltas: AsyncIterator[Delta] | None = None
    last: Delta | None = None       # the latest delta; its finish_reason is set once the choice is done
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lps: list[TokenLogprob] = field(default_factory=list)
    prompt_lps: PromptLogprobs | None = None     # the prompt's logprobs, when asked for

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None


def prompt_logprobs_width(req: GenerationRequest) -> int | None:
    """Top-k alternatives the engine computes per prompt token: echo + logprobs k (the prompt's
    logprobs lead the choice's), vLLM's prompt_logprobs k, the wider of both; None: none computed."""
    ks = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(ks) if ks else None


def make_choices(ctx: ServerContext, prepared: Prepared, arrival: float) -> list[Choice]:
    """A sequence per prompt and sample: choice i * k + j is prompt i's sample j (k = best_of or n)."""
    req = prepared.req
    deadline = arrival + req.deadline_ms / 1000.0 if req.deadline_ms is not None else None
    k = req.samples
    # best_of ranks by the sampled tokens' logprobs, so those are computed even when not returned
    logprobs = req.logprobs if req.best_of is None else (req.logprobs or 0)
    choices = []
    for i, p in enumerate(prepared.prompts):
        for j in range(k):
            seed = req.sampling.seed if req.sampling.seed is None else req.sampling.seed + j
            sampling = replace(req.sampling, max_tokens=p.max_tokens, logprobs=logprobs, seed=seed,
                               prompt_logprobs=prompt_logprobs_width(req))
            seq = Sequence(prompt_token_ids=p.ids, sampling=sampling, priority=req.priority, arrival=arrival,
                           deadline=deadline, adapter=req.adapter, cache_salt=prepared.cache_salt)
            if sampling.guided is not None:
                seq.matcher = ctx.grammars.matcher(sampling.guided)   # compiled (cached) by prepare
            choices.append(Choice(i * k + j, p.req, seq, RequestTimes(arrival=arrival, deadline=deadline)))
    return choices


async def admit_choices(ctx: ServerContext, choices: list[Choice], rid: str) -> None:
    """Admit every choice in one engine command. The n samples of a prompt run its prefill once: the
    block manager gives the siblings the first one's full prompt blocks by hash as they are allocated,
    in the same step, and each layer writes those blocks' K/V before any sequence attends to them."""
    streams = await admit(ctx, [c.seq for c in choices], rid)
    for c, stream in zip(choices, streams):
        c.times.admitted = stream.admitted_at
        c.deltas = generate(ctx, c.req, c.seq, c.times, stream,
                            IncrementalDetokenizer(ctx.tokenizer, c.seq.prompt_token_ids, c.req.skip_special_tokens),
                            StopStringMatcher(c.req.sampling.stop))


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


def record(ctx: ServerContext, c: Choice) -> None:
    """Metrics for a choice; one that did not finish (client gone, error) is aborted: its blocks free now."""
    seq, times, n_prompt, deadline = c.seq, c.times, len(c.seq.prompt_token_ids), c.times.deadline
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
