"""A generation request as the engine takes it: the completions and chat bodies (request_models.py),
validated, become one `GenerationRequest`, or a typed 4xx (`ApiError`) before any work starts."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from consort_engine.kv.sequence import SamplingParams
from consort_engine.serving.request_models import ChatBody, CompletionBody, SamplingBody
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

    @property
    def samples(self) -> int:
        """Sequences per prompt: best_of when the n best are picked from more, else n."""
        return self.best_of or self.n


def _sampling(b: SamplingBody) -> SamplingParams:
    return SamplingParams(
        temperature=b.temperature, top_p=b.top_p, top_k=b.top_k, typical_p=b.typical_p, seed=b.seed, stop=b.stop,
        stop_token_ids=b.stop_token_ids, ignore_eos=b.ignore_eos, presence_penalty=b.presence_penalty,
        frequency_penalty=b.frequency_penalty, repetition_penalty=b.repetition_penalty, min_p=b.min_p,
        logit_bias=b.logit_bias, guided=b.guided)


def _request(kind: str, b: SamplingBody, max_tokens: int | None) -> GenerationRequest:
    opts = b.stream_options[0] if b.stream_options is not None else None
    return GenerationRequest(
        kind=kind, model=b.model, sampling=_sampling(b), max_tokens=max_tokens, stream=b.stream,
        include_usage=opts is not None and opts.include_usage,
        continuous_usage=opts is not None and opts.continuous_usage_stats, priority=b.priority,
        deadline_ms=b.deadline_ms, adapter=b.adapter, cache_salt=b.cache_salt, n=b.n,
        return_token_ids=b.return_token_ids, skip_special_tokens=b.skip_special_tokens,
        prompt_logprobs=b.prompt_logprobs, ignored_fields=b.ignored)


def parse_completion(body: Any) -> GenerationRequest:
    b = CompletionBody.model_validate(body)
    req = _request("completion", b, 16 if b.max_tokens is None else b.max_tokens)   # OpenAI's default 16
    first = b.prompt[0]
    req.prompt, req.prompt_token_ids = (first, None) if isinstance(first, str) else (None, first)
    if len(b.prompt) > 1:     # several prompts: one choice each (n each), batched
        req.prompts = b.prompt
    req.logprobs, req.echo = b.logprobs, b.echo
    if b.best_of is not None and b.best_of != b.n:
        req.best_of = b.best_of
    return req


def parse_chat(body: Any) -> GenerationRequest:
    b = ChatBody.model_validate(body)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    req = _request("chat", b, max_tokens)
    req.tools, req.messages = b.tool_choice_of, b.messages
    req.add_generation_prompt, req.continue_final_message = b.add_generation_prompt, b.continue_final_message
    req.logprobs = (b.top_logprobs or 0) if b.logprobs else None
    return req
