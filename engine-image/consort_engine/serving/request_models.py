"""One pydantic model per POST body: completions, chat completions, adapter loads (the Responses body:
responses.py; tokenize and detokenize: tokenize_request.py). Each field's type (fields.py) bounds it
and answers a bad value with a typed 400 naming it; checks across fields run after them. Unknown
fields of a generation request are ignored, as vLLM ignores them, and reported (`unknown_fields`);
an adapter load refuses them."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from consort_engine.serving.errors import bad
from consort_engine.serving.guided_fields import bounded, guided_spec
from consort_engine.serving.fields import (AdapterField, Bool, CacheSalt, Int, LogitBias, Neutral, Num, Prompts, Raw,
                                           StopTokenIds, Stops, Str, Temperature, TopK, check_message,
                                           checked)
from consort_engine.text import tool_calls
from consort_engine.text.guided import GuidedSpec
from consort_engine.serving.limits import (ADAPTER_NAME, MAX_CHOICES, MAX_DEADLINE_MS, MAX_LOGPROBS, PRIORITY_RANGE,
                                           REPETITION_PENALTY_RANGE, SEED_RANGE)


def unknown_fields(body: dict, model: type[BaseModel], prefix: str = "") -> list[str]:
    """Fields of `body` that `model` does not know (clients such as LangChain, LiteLLM and newer SDKs send
    extras). Known fields we cannot honour stay typed 400s."""
    known = model.model_fields
    return [prefix + key for key in body if key not in known]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Bool()
    continuous_usage_stats: Bool()


def _stream_options(v: Any, key: str) -> tuple[StreamOptions, list[str]]:
    """stream_options, and its unknown fields (named stream_options.<key>)."""
    if not isinstance(v, dict):
        raise bad("invalid_type", "'stream_options' must be an object", "stream_options")
    return StreamOptions.model_validate(v), unknown_fields(v, StreamOptions, "stream_options.")


def _messages(v: Any, key: str) -> list[dict]:
    if not isinstance(v, list):
        raise bad("invalid_type", "'messages' must be a list", "messages")
    if not v:
        raise bad("empty_prompt", "'messages' must not be empty", "messages")
    return [check_message(i, m) for i, m in enumerate(v)]


class SamplingBody(BaseModel):
    """The fields both generation endpoints share. OpenAI fields without an effect here are accepted only
    at their neutral value."""
    model_config = ConfigDict(extra="ignore")

    model: Str
    top_k: TopK
    temperature: Temperature
    top_p: Num(1.0, 0.0, 1.0, lo_open=True)
    typical_p: Num(1.0, 0.0, 1.0, lo_open=True)
    seed: Int(None, *SEED_RANGE)
    stop: Stops
    stop_token_ids: StopTokenIds
    ignore_eos: Bool()
    presence_penalty: Num(0.0, -2.0, 2.0)
    frequency_penalty: Num(0.0, -2.0, 2.0)
    repetition_penalty: Num(1.0, *REPETITION_PENALTY_RANGE)
    min_p: Num(0.0, 0.0, 1.0)
    logit_bias: LogitBias
    # structured output: one of these (guided_fields.guided_spec)
    response_format: Raw
    guided_json: Raw
    guided_regex: Raw
    guided_choice: Raw
    guided_grammar: Raw
    structured_outputs: Raw
    guided_decoding_backend: Raw            # vLLM's knobs without an effect here
    guided_whitespace_pattern: Raw
    max_tokens: Int()                       # the low end depends on the endpoint (checked after)
    stream: Bool()
    stream_options: checked(None, _stream_options)
    # Consort extensions (and vLLM's extras)
    priority: Int(0, *PRIORITY_RANGE)       # a tenant's cap is the router's (it sends the clamped value)
    deadline_ms: Num(None, 0.0, MAX_DEADLINE_MS, lo_open=True)
    adapter: AdapterField
    cache_salt: CacheSalt
    n: Int(1, 1, MAX_CHOICES)
    return_token_ids: Bool()
    skip_special_tokens: Bool(True)
    prompt_logprobs: Int(None, 0, MAX_LOGPROBS)
    user: Str

    # what the fields mean together, set after they are checked
    _ignored: list[str] = PrivateAttr(default_factory=list)   # unknown fields, ignored as vLLM ignores them
    _guided: GuidedSpec | None = PrivateAttr(default=None)     # the one output constraint

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown(cls, body: Any, handler) -> "SamplingBody":
        if not isinstance(body, dict):
            raise bad("invalid_json", "request body must be a JSON object")
        checked_body = handler(body)
        checked_body._ignored = unknown_fields(body, cls)
        return checked_body

    @property
    def ignored(self) -> list[str]:
        unknown = self.stream_options[1] if self.stream_options is not None else []
        return self._ignored + unknown

    @property
    def guided(self) -> GuidedSpec | None:
        return self._guided

    def check_sampling(self) -> None:
        """The checks across the shared fields (each endpoint's own checks follow)."""
        if self.prompt_logprobs is not None and self.stream:
            raise bad("unsupported_value", "'prompt_logprobs' cannot be streamed (as in vLLM); with 'echo' and "
                      "'logprobs' a completions stream carries the prompt's logprobs", "prompt_logprobs")
        self._guided = guided_spec(self.response_format,
                                   {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                                    "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar},
                                   self.structured_outputs)

    def check_max_tokens(self, key: str, lo: int) -> None:
        v = getattr(self, key)
        if v is not None and v < lo:
            raise bad("invalid_value", f"'{key}' must be at least {lo}, got {v}", key)


NoSuffix = Neutral("")


class CompletionBody(SamplingBody):
    """POST /v1/completions."""
    prompt: Prompts
    suffix: NoSuffix
    logprobs: Int(None, 0, MAX_LOGPROBS)
    echo: Bool()
    best_of: Int(None, 1, MAX_CHOICES)

    @model_validator(mode="after")
    def _across(self) -> "CompletionBody":
        self.check_sampling()
        if self.prompt is None:
            raise bad("missing_field", "'prompt' is required", "prompt")
        # echo with max_tokens 0 (as vLLM allows): the prompt back, with its logprobs, and nothing generated
        self.check_max_tokens("max_tokens", 0 if self.echo else 1)
        # n samples of each prompt (best_of sampled, the n with the highest cumulative logprob returned, as
        # vLLM does), at most MAX_CHOICES in all; best_of != n cannot stream: the ranking needs the end
        best_of = self.best_of
        if best_of is not None and best_of < self.n:
            raise bad("invalid_value", f"'best_of' ({best_of}) must be at least n ({self.n})", "best_of")
        if best_of is not None and best_of != self.n and self.stream:
            raise bad("unsupported_value", "'best_of' other than n cannot be streamed", "best_of")
        ranked = best_of is not None and best_of != self.n
        total = (best_of if ranked else self.n) * (len(self.prompt) if len(self.prompt) > 1 else 1)
        if total > MAX_CHOICES:
            raise bad("invalid_value", f"{total} samples (prompts x best_of) exceed the limit of {MAX_CHOICES}",
                      "best_of" if ranked else "n")
        return self


class ChatBody(SamplingBody):
    """POST /v1/chat/completions."""
    messages: checked(None, _messages)
    max_completion_tokens: Int()
    logprobs: Bool()
    top_logprobs: Int(None, 0, MAX_LOGPROBS)
    tools: Raw                              # tools / tool_choice / parallel_tool_calls: tool_calls.parse_tools
    tool_choice: Raw
    parallel_tool_calls: Raw
    store: Raw                              # OpenAI's bookkeeping fields: accepted, without an effect here
    metadata: Raw
    service_tier: Raw
    add_generation_prompt: Bool(True)
    continue_final_message: Bool()
    _tools: tool_calls.ToolChoice | None = PrivateAttr(default=None)

    @property
    def tool_choice_of(self) -> tool_calls.ToolChoice | None:
        """tools, tool_choice and parallel_tool_calls together (None: no tools given)."""
        return self._tools

    @model_validator(mode="after")
    def _across(self) -> "ChatBody":
        self.check_sampling()
        self._check_tools()
        if self.messages is None:
            raise bad("missing_field", "'messages' is required", "messages")
        self.check_max_tokens("max_tokens", 1)
        self.check_max_tokens("max_completion_tokens", 1)
        if self.top_logprobs is not None and not self.logprobs and self.top_logprobs > 0:
            raise bad("invalid_value", "'top_logprobs' requires 'logprobs': true", "top_logprobs")
        return self


    def _check_tools(self) -> None:
        """`required` and a named tool_choice become the request's structured-output constraint (so they
        cannot be combined with another one)."""
        try:
            self._tools = tool_calls.parse_tools({"tools": self.tools, "tool_choice": self.tool_choice,
                                                  "parallel_tool_calls": self.parallel_tool_calls})
        except tool_calls.ToolsError as e:
            raise bad(e.code, e.message, e.param) from None
        guided = tool_calls.guided_schema(self._tools) if self._tools is not None else None
        if guided is not None:
            if self._guided is not None:
                raise bad("invalid_value", f"tool_choice {self._tools.mode} constrains the output and cannot be "
                          f"combined with '{self._guided.param}'", "tool_choice")
            self._guided = bounded(guided)


def _adapter_name(v: Any, key: str) -> str:
    if not isinstance(v, str) or not ADAPTER_NAME.fullmatch(v):
        raise bad("invalid_name", "name must be a DNS label (lowercase letters, digits, '-'; at most 63)", "name")
    return v


def _adapter_path(v: Any, key: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad("invalid_path", "path must be the adapter directory on the engine's filesystem", "path")
    return v


AdapterName = checked("", _adapter_name)
AdapterPath = checked("", _adapter_path)


class AdapterLoadBody(BaseModel):
    """POST /v1/adapters {"name": ..., "path": PEFT dir}; any other field is a 400."""
    model_config = ConfigDict(extra="ignore")
    name: AdapterName
    path: AdapterPath

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise bad("invalid_request", "body must be a JSON object with name and path")
        unknown = sorted(set(body) - set(cls.model_fields))
        if unknown:
            raise bad("unknown_field", f"unknown fields: {', '.join(unknown)}", unknown[0])
        # absent or null: "" (the checks refuse it, naming the field)
        return {"name": body.get("name") or "", "path": body.get("path") or ""}
