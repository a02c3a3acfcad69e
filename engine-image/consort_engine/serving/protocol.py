"""A generation request as the engine takes it: the completions and chat bodies (request_models.py),
validated, become one `GenerationRequest`, or a typed 4xx (`ApiError`) before any work starts."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from consort_engine.kv.sequence import SamplingParams
from consort_engine.serving.errors import bad
from consort_engine.serving.guided_fields import bounded, guided_spec
from consort_engine.serving.request_models import ChatBody, CompletionBody, SamplingBody, unknown_fields
from consort_engine.text import tool_calls


@dataclass
class GenerationRequest:
    """One validated request, before tokenization."""
    kind: str                                   # completion | chat
    model: str | None
    sampling: SamplingParams
    prompt: str | None = None                   # text prompt (completions)
    prompt_token_ids: list[int] | None = None   # token-id prompt (completions)
    messages: list[dict] | None = None          # chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_tokens: int | None = None               # None: fill the context (chat default)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    priority: int = 0
    deadline_ms: float | None = None
    adapter: str | None = None
    cache_salt: str | None = None               # vLLM's: requests share cached prefixes only with the same salt
    return_token_ids: bool = False
    logprobs: int | None = None                 # top-k alternatives per token (0 = chosen only)
    skip_special_tokens: bool = True
    echo: bool = False                          # completions: the prompt text leads the choice's text
    prompt_logprobs: int | None = None          # vLLM's: each prompt token's logprob + top-k, in the response
    n: int = 1                                  # samples per prompt
    best_of: int | None = None                  # completions: sample this many per prompt, return the n best
    prompts: list = field(default_factory=list)  # completions with several prompts: each str or token ids
    tools: tool_calls.ToolChoice | None = None   # chat: tools given (rendered; parsed unless tool_choice none)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ignored_fields: list[str] = field(default_factory=list)   # unknown fields, ignored as vLLM does


def _as_dict(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("invalid_json", "request body must be a JSON object")
    return body


def _sampling(b: SamplingBody) -> SamplingParams:
    return SamplingParams(
        temperature=b.temperature, top_p=b.top_p, top_k=b.top_k, typical_p=b.typical_p, seed=b.seed, stop=b.stop,
        stop_token_ids=b.stop_token_ids, ignore_eos=b.ignore_eos, presence_penalty=b.presence_penalty,
        frequency_penalty=b.frequency_penalty, repetition_penalty=b.repetition_penalty, min_p=b.min_p,
        logit_bias=b.logit_bias,
        guided=guided_spec(b.response_format, {"guided_json": b.guided_json, "guided_regex": b.guided_regex,
                                               "guided_choice": b.guided_choice, "guided_grammar": b.guided_grammar},
                           b.structured_outputs))


def _request(kind: str, body: dict, b: SamplingBody, max_tokens: int | None) -> GenerationRequest:
    ignored = unknown_fields(body, type(b))
    opts = None
    if b.stream_options is not None:
        opts, unknown = b.stream_options
        ignored += unknown
    return GenerationRequest(
        kind=kind, model=b.model, sampling=_sampling(b), max_tokens=max_tokens, stream=b.stream,
        include_usage=opts is not None and opts.include_usage,
        continuous_usage=opts is not None and opts.continuous_usage_stats, priority=b.priority,
        deadline_ms=b.deadline_ms, adapter=b.adapter, cache_salt=b.cache_salt, n=b.n,
        return_token_ids=b.return_token_ids, skip_special_tokens=b.skip_special_tokens,
        prompt_logprobs=b.prompt_logprobs, ignored_fields=ignored)


def parse_completion(body: Any) -> GenerationRequest:
    body = _as_dict(body)
    b = CompletionBody.model_validate(body)
    req = _request("completion", body, b, 16 if b.max_tokens is None else b.max_tokens)  # OpenAI's default 16
    first = b.prompt[0]
    req.prompt, req.prompt_token_ids = (first, None) if isinstance(first, str) else (None, first)
    if len(b.prompt) > 1:     # several prompts: one choice each (n each), batched
        req.prompts = b.prompt
    req.logprobs, req.echo = b.logprobs, b.echo
    if b.best_of is not None and b.best_of != b.n:
        req.best_of = b.best_of
    return req


def parse_chat(body: Any) -> GenerationRequest:
    body = _as_dict(body)
    b = ChatBody.model_validate(body)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    req = _request("chat", body, b, max_tokens)
    _tools(body, req)
    req.messages = b.messages
    req.add_generation_prompt, req.continue_final_message = b.add_generation_prompt, b.continue_final_message
    req.logprobs = (b.top_logprobs or 0) if b.logprobs else None
    return req


def _tools(body: dict, req: GenerationRequest) -> None:
    """tools / tool_choice / parallel_tool_calls; `required` and a named choice become the request's
    structured-output constraint (so they cannot be combined with another one)."""
    try:
        req.tools = tool_calls.parse_tools(body)
    except tool_calls.ToolsError as e:
        raise bad(e.code, e.message, e.param) from None
    guided = tool_calls.guided_schema(req.tools) if req.tools is not None else None
    if guided is not None:
        if req.sampling.guided is not None:
            raise bad("invalid_value", f"tool_choice {req.tools.mode} constrains the output and cannot be combined "
                      f"with '{req.sampling.guided.param}'", "tool_choice")
        req.sampling.guided = bounded(guided)


def prompt_logprobs_width(req: GenerationRequest) -> int | None:
    """Top-k alternatives the engine computes per prompt token: echo + logprobs k (the prompt's
    logprobs lead the choice's), vLLM's prompt_logprobs k, the wider of both; None: none computed."""
    ks = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(ks) if ks else None


def samples_per_prompt(req: GenerationRequest) -> int:
    return req.best_of or req.n


def best_indices(cumulative: list[float], n: int) -> list[int]:
    """The n samples of one prompt with the highest cumulative logprob, in sampling order (stable ties)."""
    ranked = sorted(range(len(cumulative)), key=lambda i: -cumulative[i])[:n]
    return sorted(ranked)
