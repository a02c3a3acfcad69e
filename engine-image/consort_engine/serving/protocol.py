"""OpenAI-compatible request parsing, as pure functions (the response shapes: shapes.py).

`parse_completion` / `parse_chat` turn a decoded JSON body into a `GenerationRequest` or raise
`ApiError` (a typed 4xx). The aiohttp handlers in server.py only glue these to the engine.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from consort_engine.text import tool_calls as T
from consort_engine.text.guided import GuidedSpec
from consort_engine.kv.sequence import SamplingParams

# ---------------------------------------------------------------------------------------------
# Request limits: every list, number and string a request hands the engine is bounded here, before
# any work starts (DESIGN.md section 8; docs/security.md "Request limits" gives each one's reason).
# A value outside them is a typed 400 naming the field; none may raise inside the engine's step,
# where a failure ends every request in flight on the replica.

MAX_LOGPROBS = 20              # logprobs / top_logprobs / prompt_logprobs (vLLM's default max_logprobs)
MAX_CHOICES = 64               # prompts x n (or best_of) in one request
MAX_STOP_STRINGS = 16          # `stop`: OpenAI allows 4, vLLM any number; 16 leaves room for eval harnesses
MAX_STOP_CHARS = 256           # per stop string: up to 255 characters of output are held back while they may start one
MAX_STOP_TOKEN_IDS = 1024      # `stop_token_ids` (vLLM: unbounded): a model has a few, a class of tokens hundreds
MAX_LOGIT_BIAS = 300           # `logit_bias` entries, OpenAI's limit
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)        # a signed 64-bit seed, as vLLM's OpenAI server takes it
PRIORITY_RANGE = (-1000, 1000)                  # the router's shadow copies run at -1000 (its lowest)
MAX_DEADLINE_MS = 24 * 3600 * 1000              # a day: longer deadlines mean nothing, bigger numbers overflow
MAX_CACHE_SALT_CHARS = 256     # vLLM's `cache_salt`: 43 base64 characters are 256 bits; more only costs hashing
MIN_TEMPERATURE = 0.01         # vLLM's floor: 0 < t < 0.01 runs at 0.01 (smaller divides logits into inf / NaN)
REPETITION_PENALTY_RANGE = (0.01, 100.0)        # vLLM: any > 0; beyond these a seen token's fate is sealed anyway,
                                                # and 1e-300 turned logits into inf, then NaN (a failed step)
MAX_GUIDED_CHARS = 64 * 1024   # a schema / regex / grammar / choice list as text: xgrammar compile time grows
                               # superlinearly (a 25 KB schema ~0.5 s, 100 KB ~34 s on the 2-core dev box)
MAX_CONCURRENT_COMPILES = 2    # grammar compiles at once, each on a worker thread; more wait for a slot
GUIDED_COMPILE_TIMEOUT_S = 10.0  # a compile (slot wait included) answered later than this is a typed error
# top_k: -1 or 0 (off) or 1..vocab; above the vocabulary it is off, as vLLM clamps it (check_vocab).

ADAPTER_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")   # a DNS label, as the CRD requires


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    retry_after_ms: int | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        err: dict[str, Any] = {"type": self.type, "code": self.code, "message": self.message, "param": self.param}
        if self.retry_after_ms is not None:
            err["retry_after_ms"] = self.retry_after_ms
        return {"error": err}

    def headers(self) -> dict[str, str]:
        if self.retry_after_ms is None:
            return {}
        return {"Retry-After": str(retry_after_seconds(self.retry_after_ms))}


def retry_after_seconds(retry_after_ms: int) -> int:
    return max(1, math.ceil(retry_after_ms / 1000))


def admission_error(code: str, retry_after_ms: float, message: str) -> ApiError:
    ms = max(1, int(math.ceil(retry_after_ms)))
    return ApiError(429, code, message or f"admission rejected: {code}", type="admission_rejected", retry_after_ms=ms)


def bad(code: str, message: str, param: str | None = None, status: int = 400) -> ApiError:
    return ApiError(status, code, message, param)


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
    tools: T.ToolChoice | None = None            # chat: tools given (rendered; parsed unless tool_choice none)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ignored_fields: list[str] = field(default_factory=list)   # unknown fields, ignored as vLLM does


# ---------------------------------------------------------------------------------------------
# field checks

_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite JSON number (NaN and Infinity parse; an integer too big for a float overflows)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _int(body: dict, key: str, default: Any = None, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise bad("invalid_type", f"'{key}' must be an integer", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad("invalid_value", f"'{key}' must be {rng}, got {v}", key)
    return v


def _num(body: dict, key: str, default: float, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_num(v):
        raise bad("invalid_type", f"'{key}' must be a number", key)
    if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        rng = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
        raise bad("invalid_value", f"'{key}' must be {rng}, got {v}", key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad("invalid_type", f"'{key}' must be a boolean", key)
    return v


def _str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad("invalid_type", f"'{key}' must be a string", key)
    return v


def _require_neutral(body: dict, key: str, neutral: Any) -> None:
    """Fields we accept only at their no-op value (anything else would silently change semantics)."""
    v = body.get(key)
    if v is None or v == neutral or (isinstance(neutral, dict) and v in ({}, neutral)):
        return
    raise bad("unsupported_value", f"'{key}' is only supported at its default ({neutral!r})", key)


def unknown_fields(body: dict, allowed: frozenset[str], prefix: str = "") -> list[str]:
    """Fields we do not know. Clients (LangChain, LiteLLM, newer SDKs) send extras: they are
    ignored, as vLLM ignores them, and reported (log + x-consort-ignored-fields); known fields we
    cannot honour stay typed 400s."""
    return [prefix + key for key in body if key not in allowed]


# Fields shared by both endpoints. OpenAI fields without an effect here are accepted only when neutral.
_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "typical_p", "seed", "stop", "stop_token_ids",
    "n", "stream", "stream_options", "ignore_eos", "user", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_p", "skip_special_tokens",
    # vLLM structured output extras
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "guided_decoding_backend", "guided_whitespace_pattern",
    # Consort extensions
    "priority", "deadline_ms", "adapter", "return_token_ids",
    "prompt_logprobs", "cache_salt",     # vLLM's extras
})
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
                         "add_generation_prompt", "continue_final_message"}


GUIDED_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(v: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> compact JSON (the compile-cache key; key
    order kept: it is the order the properties are generated in)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise bad("invalid_value", f"'{param}' is not valid JSON", param) from None
    if not isinstance(v, dict):
        raise bad("invalid_type", f"'{param}' must be a JSON schema object", param)
    return json.dumps(v, separators=(",", ":"))


def _guided_of(kind: str, v: Any, param: str) -> GuidedSpec:
    """One vLLM-style constraint (json | regex | choice | grammar | json_object) -> GuidedSpec."""
    if kind == "json":
        return GuidedSpec("json_schema", _schema_text(v, param), param)
    if kind == "json_object":
        if v is not True:
            raise bad("invalid_value", f"'{param}' must be true", param)
        return GuidedSpec("json_object", "", param)
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise bad("invalid_type", f"'{param}' must be a non-empty list of non-empty strings", param)
        return GuidedSpec("choice", json.dumps(v, ensure_ascii=False), param)
    if not (isinstance(v, str) and v):
        raise bad("invalid_type", f"'{param}' must be a non-empty string", param)
    return GuidedSpec(kind, v, param)


def _response_format(v: Any) -> GuidedSpec | None:
    """OpenAI response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("invalid_type", "'response_format' must be an object with a 'type'", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "", "response_format")
    if kind != "json_schema":
        raise bad("invalid_value", f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                  "response_format.type")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise bad("missing_field", "'response_format.json_schema' is required for type json_schema",
                  "response_format.json_schema")
    if "schema" not in js:
        raise bad("missing_field", "'response_format.json_schema.schema' is required",
                  "response_format.json_schema.schema")
    return GuidedSpec("json_schema", _schema_text(js["schema"], "response_format.json_schema.schema"),
                      "response_format.json_schema.schema")


def _guided(body: dict) -> GuidedSpec | None:
    """The request's one output constraint, from response_format, vLLM's guided_* extras or its
    structured_outputs object; several at once is a 400 (which should win is not obvious)."""
    found: list[GuidedSpec] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    for key in GUIDED_EXTRAS:
        if body.get(key) is not None:
            found.append(_guided_of(key.removeprefix("guided_"), body[key], key))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("invalid_type", "'structured_outputs' must be an object", "structured_outputs")
        for key, v in so.items():
            if key not in STRUCTURED_KEYS:
                continue          # vLLM's other knobs (backend, whitespace_pattern, ...) do not apply here
            if v is not None and v is not False:
                found.append(_guided_of(key, v, f"structured_outputs.{key}"))
    if len(found) > 1:
        raise bad("invalid_value", "only one structured output constraint may be given, got "
                  + ", ".join(g.param for g in found), found[1].param)
    return _bounded(found[0]) if found else None


def _bounded(g: GuidedSpec) -> GuidedSpec:
    """A constraint small enough to compile (MAX_GUIDED_CHARS of schema, regex, grammar or choices)."""
    if len(g.spec) > MAX_GUIDED_CHARS:
        raise bad("invalid_value", f"'{g.param}' is {len(g.spec)} characters as text; at most {MAX_GUIDED_CHARS} "
                  "are compiled", g.param)
    return g


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise bad("invalid_type", "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("invalid_value", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad("invalid_value", "'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("invalid_value", f"'stop' strings may be at most {MAX_STOP_CHARS} characters long", "stop")
    return list(stops)


def _stop_token_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
        raise bad("invalid_type", "'stop_token_ids' must be a list of integers", "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad("invalid_value", f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                  "stop_token_ids")
    return list(ids)


def _temperature(body: dict) -> float:
    t = _num(body, "temperature", 1.0, 0.0)
    return max(t, MIN_TEMPERATURE) if t > 0 else 0.0     # vLLM's floor (it logs a warning and runs at 0.01)


def _sampling(body: dict) -> SamplingParams:
    top_k = _int(body, "top_k", 0, lo=-1)      # the top end is the vocabulary's: check_vocab
    return SamplingParams(
        temperature=_temperature(body),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        typical_p=_num(body, "typical_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=_int(body, "seed", None, *SEED_RANGE),
        stop=_stops(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos"),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, *REPETITION_PENALTY_RANGE),
        guided=_guided(body),
        min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
        logit_bias=_logit_bias(body),
    )


# ASCII digits only (str.isdigit admits "²", which int() refuses) and short (int() refuses 4,300+ digits)
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's {"<token id>": bias in [-100, 100]}; ids are checked against the vocabulary later."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("invalid_type", "'logit_bias' must be an object of token id -> bias", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad("invalid_value", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}",
                  "logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key)):
            raise bad("invalid_value", f"'logit_bias' keys must be token ids, got {key[:40]!r}", "logit_bias")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise bad("invalid_value", f"'logit_bias[{key}]' must be a number in [-100, 100], got {bias!r}",
                      "logit_bias")
        out[int(key)] = float(bias)
    return out


def _max_tokens(body: dict, keys: tuple[str, ...], lo: int = 1) -> int | None:
    value = None
    for key in keys:
        v = _int(body, key, lo=None)
        if v is not None:
            if v < lo:
                raise bad("invalid_value", f"'{key}' must be at least {lo}, got {v}", key)
            value = v
    return value


def _priority(body: dict) -> int:
    """The request's scheduling priority, within PRIORITY_RANGE. A tenant's cap is applied by the router
    (api.check_priority), which sends the clamped value; a direct caller needs the engine credential."""
    return _int(body, "priority", 0, *PRIORITY_RANGE)


def _cache_salt(body: dict) -> str | None:
    salt = _str(body, "cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad("invalid_value", f"'cache_salt' must be 1 to {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    return salt


def prefix_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its tenant (the router's x-consort-tenant) and, within the
    tenant, its `cache_salt`. None (the shared cache) only when neither is given."""
    if tenant is None and cache_salt is None:
        return None
    return hashlib.sha256(json.dumps([tenant, cache_salt]).encode()).hexdigest()


def _common(body: dict, req: GenerationRequest) -> GenerationRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("invalid_type", "'model' must be a string", "model")
    req.model = model
    req.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("invalid_type", "'stream_options' must be an object", "stream_options")
        req.ignored_fields += unknown_fields(opts, STREAM_OPTIONS, "stream_options.")
        req.include_usage = _bool(opts, "include_usage")
        req.continuous_usage = _bool(opts, "continuous_usage_stats")
    req.priority = _priority(body)
    if body.get("deadline_ms") is not None:
        req.deadline_ms = _num(body, "deadline_ms", 0.0, 0.0, MAX_DEADLINE_MS, lo_open=True)
    req.adapter = _str(body, "adapter") or None
    req.cache_salt = _cache_salt(body)
    req.n = _int(body, "n", 1, lo=1, hi=MAX_CHOICES)
    req.return_token_ids = _bool(body, "return_token_ids")
    req.skip_special_tokens = _bool(body, "skip_special_tokens", True)
    req.prompt_logprobs = _int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if req.prompt_logprobs is not None and req.stream:
        raise bad("unsupported_value", "'prompt_logprobs' cannot be streamed (as in vLLM); with 'echo' and "
                  "'logprobs' a completions stream carries the prompt's logprobs", "prompt_logprobs")
    _str(body, "user")
    return req


def _as_dict(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("invalid_json", "request body must be a JSON object")
    return body


def _one_prompt(prompt: Any) -> str | list[int]:
    """One prompt of a completion: non-empty text or a non-empty list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad("empty_prompt", "'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad("empty_prompt", "'prompt' must not be empty", "prompt")
        if not all(_is_int(t) for t in prompt):
            raise bad("invalid_type", "'prompt' must be a string or a list of token ids", "prompt")
        return list(prompt)
    raise bad("invalid_type", "'prompt' must be a string or a list of token ids", "prompt")


def _check_choices(body: dict, req: GenerationRequest) -> None:
    """n samples of each prompt (best_of sampled, the n with the highest cumulative logprob returned, as
    vLLM does), at most MAX_CHOICES sampled in all. best_of != n cannot stream: the ranking needs the end."""
    best_of = _int(body, "best_of", None, lo=1, hi=MAX_CHOICES)
    if best_of is not None and best_of < req.n:
        raise bad("invalid_value", f"'best_of' ({best_of}) must be at least n ({req.n})", "best_of")
    if best_of is not None and best_of != req.n:
        if req.stream:
            raise bad("unsupported_value", "'best_of' other than n cannot be streamed", "best_of")
        req.best_of = best_of
    total = samples_per_prompt(req) * max(1, len(req.prompts))
    if total > MAX_CHOICES:
        raise bad("invalid_value", f"{total} samples (prompts x best_of) exceed the limit of {MAX_CHOICES}",
                  "best_of" if req.best_of else "n")


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


def parse_completion(body: Any) -> GenerationRequest:
    body = _as_dict(body)
    ignored = unknown_fields(body, COMPLETION_FIELDS)
    _require_neutral(body, "suffix", "")
    req = GenerationRequest(kind="completion", model=None, sampling=_sampling(body), ignored_fields=ignored)
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad("missing_field", "'prompt' is required", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:     # several prompts: one choice each (n each), batched
            req.prompts = [_one_prompt(p) for p in prompt]
        prompt = prompt[0]
    prompt = _one_prompt(prompt)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids = prompt
    # echo with max_tokens 0 (as vLLM allows): the prompt back, with its logprobs, and nothing generated
    req.max_tokens = _max_tokens(body, ("max_tokens",), lo=0 if body.get("echo") is True else 1)
    if req.max_tokens is None:
        req.max_tokens = 16   # the OpenAI completions default
    lp = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    req.logprobs = lp
    req.echo = _bool(body, "echo")
    req = _common(body, req)
    _check_choices(body, req)
    return req


_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _message(i: int, m: Any) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad("invalid_type", f"'{param}' must be an object", param)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad("invalid_value", f"'{param}.role' must be one of {sorted(_ROLES)}", f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):   # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad("unsupported_content", f"'{param}.content[{j}]': only text parts are supported",
                          f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        if role != "assistant":
            raise bad("missing_field", f"'{param}.content' is required", f"{param}.content")
        content = ""
    elif not isinstance(content, str):
        raise bad("invalid_type", f"'{param}.content' must be a string or a list of text parts", f"{param}.content")
    if role == "assistant" and m.get("tool_calls") is not None:
        try:
            T.check_history_tool_calls(f"{param}.tool_calls", m["tool_calls"])
        except T.ToolsError as e:
            raise bad(e.code, e.message, e.param) from None
    out = {k: v for k, v in m.items() if k not in ("role", "content")}
    out.update(role=role, content=content)
    return out


def _tool_choice(body: dict) -> T.ToolChoice | None:
    try:
        return T.parse_tools(body)
    except T.ToolsError as e:
        raise bad(e.code, e.message, e.param) from None


def _tools(body: dict, req: GenerationRequest) -> None:
    """tools / tool_choice / parallel_tool_calls; `required` and a named choice become the request's
    structured-output constraint (so they cannot be combined with another one)."""
    req.tools = _tool_choice(body)
    guided = T.guided_schema(req.tools) if req.tools is not None else None
    if guided is not None:
        if req.sampling.guided is not None:
            raise bad("invalid_value", f"tool_choice {req.tools.mode} constrains the output and cannot be combined "
                      f"with '{req.sampling.guided.param}'", "tool_choice")
        req.sampling.guided = _bounded(guided)


def parse_chat(body: Any) -> GenerationRequest:
    body = _as_dict(body)
    ignored = unknown_fields(body, CHAT_FIELDS)
    req = GenerationRequest(kind="chat", model=None, sampling=_sampling(body), ignored_fields=ignored)
    _tools(body, req)
    messages = body.get("messages")
    if messages is None:
        raise bad("missing_field", "'messages' is required", "messages")
    if not isinstance(messages, list):
        raise bad("invalid_type", "'messages' must be a list", "messages")
    if not messages:
        raise bad("empty_prompt", "'messages' must not be empty", "messages")
    req.messages = [_message(i, m) for i, m in enumerate(messages)]
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    req.continue_final_message = _bool(body, "continue_final_message", False)
    req.max_tokens = _max_tokens(body, ("max_tokens", "max_completion_tokens"))
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want and top > 0:
        raise bad("invalid_value", "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    req.logprobs = (top or 0) if want else None
    return _common(body, req)


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


# ---------------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "return_token_strs", "adapter", "tools"})


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True          # a prompt gets BOS; a chat template writes its own specials
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    adapter: str | None = None               # same tokenizer; named only so the model check matches generation
    tools: T.ToolChoice | None = None        # rendered with the messages, as a chat request renders them
    ignored_fields: list[str] = field(default_factory=list)


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _as_dict(body)
    req = TokenizeRequest(model=_str(body, "model"), adapter=_str(body, "adapter") or None,
                          ignored_fields=unknown_fields(body, TOKENIZE_FIELDS),
                          return_token_strs=_bool(body, "return_token_strs"))
    if ("prompt" in body) == ("messages" in body):
        raise bad("missing_field", "give exactly one of 'prompt' (text) or 'messages' (a chat)", "prompt")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad("invalid_type", "'messages' must be a non-empty list", "messages")
        req.messages = [_message(i, m) for i, m in enumerate(messages)]
        req.tools = _tool_choice({"tools": body.get("tools")})
        req.add_special_tokens = _bool(body, "add_special_tokens", False)
        req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
        req.continue_final_message = _bool(body, "continue_final_message", False)
    else:
        req.prompt = _str(body, "prompt")
        if req.prompt is None:
            raise bad("invalid_type", "'prompt' must be a string", "prompt")
        req.add_special_tokens = _bool(body, "add_special_tokens", True)
    return req


def parse_detokenize(body: Any) -> tuple[str | None, str | None, list[int]]:
    """(model, adapter, tokens)."""
    body = _as_dict(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise bad("invalid_type", "'tokens' must be a list of token ids", "tokens")
    return _str(body, "model"), _str(body, "adapter") or None, list(tokens)


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
