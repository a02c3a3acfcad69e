"""Field types for the request models (request_models.py, tokenize_request.py): each checks one JSON
value and raises a typed 400 naming the field (OpenAI's error shape), never pydantic's own error, so a
client sees the same body whichever check refused it. JSON null is the field's default, as OpenAI
takes it. Each check is a plain validator: pydantic runs it only on the fields a body carries."""
from __future__ import annotations

import math
import re
from typing import Annotated, Any, Callable

from pydantic import Field, PlainValidator, ValidationInfo

from consort_common import chat_messages
from consort_engine.serving.errors import bad
from consort_engine.serving.limits import (MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                           MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """A finite JSON number (NaN and Infinity parse; an integer too big for a float overflows)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def checked(default: Any, check: Callable[[Any, str], Any]) -> Any:
    """A field type: `check(value, field name)` on a value that is not null; null (or absent) is `default`."""
    def validate(v: Any, info: ValidationInfo) -> Any:
        return default if v is None else check(v, info.field_name)
    return Annotated[Any, PlainValidator(validate), Field(default=default)]


def check_int(v: Any, key: str, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(v):
        raise bad("invalid_type", f"'{key}' must be an integer", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad("invalid_value", f"'{key}' must be {rng}, got {v}", key)
    return v


def Int(default: int | None = None, lo: int | None = None, hi: int | None = None) -> Any:
    return checked(default, lambda v, key: check_int(v, key, lo, hi))


def Num(default: float | None, lo: float, hi: float | None = None, lo_open: bool = False) -> Any:
    def check(v: Any, key: str) -> float:
        if not is_num(v):
            raise bad("invalid_type", f"'{key}' must be a number", key)
        if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            rng = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise bad("invalid_value", f"'{key}' must be {rng}, got {v}", key)
        return float(v)
    return checked(default, check)


def check_bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise bad("invalid_type", f"'{key}' must be a boolean", key)
    return v


def Bool(default: bool | None = False) -> Any:
    return checked(default, check_bool)


def check_str(v: Any, key: str) -> str:
    if not isinstance(v, str):
        raise bad("invalid_type", f"'{key}' must be a string", key)
    return v


Str = checked(None, check_str)
# An adapter's name: "" means none, as an absent one does.
AdapterField = checked(None, lambda v, key: check_str(v, key) or None)
Raw = Annotated[Any, Field(default=None)]       # checked where it is used (a guided constraint, tools)


def Neutral(neutral: Any) -> Any:
    """A field accepted only at its no-op value (anything else would silently change semantics)."""
    def check(v: Any, key: str) -> Any:
        if v == neutral or (isinstance(neutral, dict) and v in ({}, neutral)):
            return v
        raise bad("unsupported_value", f"'{key}' is only supported at its default ({neutral!r})", key)
    return checked(None, check)


def _temperature(v: Any, key: str) -> float:
    if not is_num(v):
        raise bad("invalid_type", f"'{key}' must be a number", key)
    if v < 0:
        raise bad("invalid_value", f"'{key}' must be >= 0.0, got {v}", key)
    return max(float(v), MIN_TEMPERATURE) if v > 0 else 0.0     # vLLM's floor (it runs 0 < t < 0.01 at 0.01)


Temperature = checked(1.0, _temperature)
# -1 or 0 (off) or >= 1; the top end is the vocabulary's (prepare.check_vocab)
TopK = checked(0, lambda v, key: max(check_int(v, key, -1), 0))


def _stops(stop: Any, key: str) -> list[str]:
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


def _stop_token_ids(ids: Any, key: str) -> list[int]:
    if not (isinstance(ids, list) and all(is_int(t) for t in ids)):
        raise bad("invalid_type", "'stop_token_ids' must be a list of integers", "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad("invalid_value", f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                  "stop_token_ids")
    return list(ids)


# ASCII digits only (str.isdigit admits "²", which int() refuses) and short (int() refuses 4,300+ digits)
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")


def _logit_bias(v: Any, key: str) -> dict[int, float]:
    """OpenAI's {"<token id>": bias in [-100, 100]}; ids are checked against the vocabulary later."""
    if not isinstance(v, dict):
        raise bad("invalid_type", "'logit_bias' must be an object of token id -> bias", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad("invalid_value", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(v)}",
                  "logit_bias")
    out: dict[int, float] = {}
    for k, bias in v.items():
        if not (isinstance(k, str) and _TOKEN_ID_KEY.fullmatch(k)):
            raise bad("invalid_value", f"'logit_bias' keys must be token ids, got {k[:40]!r}", "logit_bias")
        if not is_num(bias) or not -100 <= bias <= 100:
            raise bad("invalid_value", f"'logit_bias[{k}]' must be a number in [-100, 100], got {bias!r}",
                      "logit_bias")
        out[int(k)] = float(bias)
    return out


def _cache_salt(v: Any, key: str) -> str:
    salt = check_str(v, key)
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad("invalid_value", f"'cache_salt' must be 1 to {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    return salt


Stops = checked([], _stops)
StopTokenIds = checked([], _stop_token_ids)
LogitBias = checked({}, _logit_bias)
CacheSalt = checked(None, _cache_salt)


def check_message(i: int, m: Any) -> dict:
    """One chat message as the chat template reads it (consort_common/chat_messages.py), or a typed 400."""
    try:
        return chat_messages.check_message(i, m)
    except chat_messages.MessageError as e:
        raise bad(e.code, e.message, e.param) from None


def check_one_prompt(prompt: Any) -> str | list[int]:
    """One prompt of a completion: non-empty text or a non-empty list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad("empty_prompt", "'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad("empty_prompt", "'prompt' must not be empty", "prompt")
        if not all(is_int(t) for t in prompt):
            raise bad("invalid_type", "'prompt' must be a string or a list of token ids", "prompt")
        return list(prompt)
    raise bad("invalid_type", "'prompt' must be a string or a list of token ids", "prompt")


def _prompts(prompt: Any, key: str) -> list[str | list[int]]:
    """`prompt`: one prompt, or a list of several (each text or token ids)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [check_one_prompt(p) for p in prompt]
    return [check_one_prompt(prompt)]


Prompts = checked(None, _prompts)
