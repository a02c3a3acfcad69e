"""A generation request made ready to run: the body parsed and bounded, the model it names checked
against this engine, the checks that need the model (vocabulary, context length), each prompt's
token ids, and its output constraint compiled. Everything that can refuse a request does so here,
before a sequence exists."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from consort_common.block_hash import prefix_salt
from consort_engine.kv.sequence import SamplingParams
from consort_engine.serving.context import ServerContext
from consort_engine.serving.errors import admission_error, bad
from consort_engine.serving.http import OFF_LOOP_BYTES, decode_json
from consort_engine.serving.limits import GUIDED_COMPILE_TIMEOUT_S, MAX_CONCURRENT_COMPILES
from consort_engine.serving.protocol import GenerationRequest, parse_chat, parse_completion
from consort_engine.serving.responses import to_chat
from consort_engine.serving.tokenize_request import TokenizeRequest
from consort_engine.text.guided import CompileBusy, CompileTimeout, GrammarError, GuidedSpec
from consort_engine.text.tokenizer import ChatTemplateError, Tokenizer, TooManyTokens


@dataclass
class Prompt:
    """One prompt of the request: the request as it sees it, its token ids, the tokens to generate."""
    req: GenerationRequest
    ids: list[int]
    max_tokens: int


@dataclass
class Prepared:
    req: GenerationRequest
    prompts: list[Prompt]
    cache_salt: str | None                      # the prefix-cache salt (tenant and cache_salt)
    responses_body: dict | None = None          # /v1/responses: the body its reply echoes


async def prepare(ctx: ServerContext, kind: str, raw: bytes, tenant: str | None) -> Prepared:
    """completion | chat | responses: the raw body -> a Prepared request, or a typed 4xx. A large body is
    parsed and tokenized on a worker thread so /health and streams keep flowing."""
    def run() -> Prepared:
        body = decode_json(raw)
        responses_body = body if kind == "responses" else None
        if kind == "responses":
            body = to_chat(body)
        req = parse_completion(body) if kind == "completion" else parse_chat(body)
        ctx.check_target(req)
        check_vocab(req.sampling, ctx.vocab_size)
        per_prompt = [replace(req, prompt=p if isinstance(p, str) else None,
                              prompt_token_ids=p if isinstance(p, list) else None) for p in req.prompts] or [req]
        prompts = []
        for r in per_prompt:
            ids = build_prompt(ctx, r)
            # max_tokens 0 (echo only) still runs one step, whose token is dropped
            prompts.append(Prompt(r, ids, max(1, resolve_max_tokens(r, len(ids), ctx.max_model_len))))
        return Prepared(req, prompts, prefix_salt(tenant, req.cache_salt), responses_body)

    prepared = await asyncio.to_thread(run) if len(raw) > OFF_LOOP_BYTES else run()
    if prepared.req.sampling.guided is not None:
        await compile_guided(ctx, prepared.req.sampling.guided)
    return prepared


def check_vocab(sp: SamplingParams, vocab_size: int) -> None:
    """The sampling fields bounded by the model's vocabulary: logit_bias and stop_token_ids ids inside it
    (as vLLM checks them), top_k above it off (as vLLM clamps it; no huge int reaches a tensor)."""
    for param, ids in (("logit_bias", sp.logit_bias), ("stop_token_ids", sp.stop_token_ids)):
        for t in ids:
            if t < 0 or t >= vocab_size:
                raise bad("invalid_value", f"'{param}' token id {t} is outside the vocabulary [0, {vocab_size})",
                          param)
    if sp.top_k >= vocab_size:
        sp.top_k = 0


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for t in ids:
        if t < 0 or t >= vocab_size:
            raise bad("invalid_token_id", f"token id {t} is outside the vocabulary [0, {vocab_size})", param)


def render_chat(tokenizer: Tokenizer, req: GenerationRequest | TokenizeRequest) -> str:
    """The request's messages through the chat template; a template error is the client's (400)."""
    try:
        tools = getattr(req, "tools", None)
        return tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message,
                                             tools=tools.tools if tools is not None else None)
    except ChatTemplateError as e:
        raise bad("chat_template_error", str(e), "messages")


def build_prompt(ctx: ServerContext, req: GenerationRequest) -> list[int]:
    if req.prompt_token_ids is not None:
        check_token_ids(req.prompt_token_ids, ctx.vocab_size)
    try:
        if req.kind == "chat":
            text = render_chat(ctx.tokenizer, req)
            ids = ctx.tokenizer.encode_chat(text, limit=ctx.max_model_len)
        elif req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
        else:
            ids = ctx.tokenizer.encode(req.prompt, limit=ctx.max_model_len)
    except TooManyTokens as e:
        resolve_max_tokens(req, e.count, ctx.max_model_len, e.at_least)   # raises context_length_exceeded
        raise
    if not ids:
        raise bad("empty_prompt", "the prompt encodes to zero tokens", "prompt")
    return ids


def resolve_max_tokens(req: GenerationRequest, num_prompt_tokens: int, max_model_len: int,
                       at_least: bool = False) -> int:
    """Check the context window; returns the max_tokens to generate. With `at_least` the prompt has
    more than `num_prompt_tokens` tokens (only its head was counted)."""
    if num_prompt_tokens >= max_model_len:
        raise bad("context_length_exceeded",
                  f"the prompt has {'more than ' if at_least else ''}{num_prompt_tokens} tokens; this model's "
                  f"context is {max_model_len} tokens", "messages" if req.kind == "chat" else "prompt")
    if req.max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + req.max_tokens > max_model_len:
        raise bad("context_length_exceeded",
                  f"prompt ({num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) exceeds this model's "
                  f"context of {max_model_len} tokens", "max_tokens")
    return req.max_tokens


async def compile_guided(ctx: ServerContext, g: GuidedSpec) -> None:
    """Compile (or find cached) a request's grammar, off the loop (a new schema can take seconds) and
    through the compile slots: a typed 400 when it does not compile or not in time, a typed 429 when
    every slot stays busy."""
    if ctx._grammars is not None and ctx._grammars.cached(g):
        return
    try:
        await ctx.compile_slots.run(lambda: ctx.grammars.compile(g))
    except GrammarError as e:
        raise bad("invalid_value", str(e), e.param) from None
    except CompileTimeout:
        raise bad("grammar_timeout", f"'{g.param}' did not compile within {GUIDED_COMPILE_TIMEOUT_S:g} s (the "
                  "compile finishes in the background; an identical request later reuses it)", g.param) from None
    except CompileBusy:
        raise admission_error("queue_full", 1000, f"{MAX_CONCURRENT_COMPILES} grammar compiles are running; "
                              "retry later") from None
