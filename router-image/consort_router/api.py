"""Typed errors and request parsing for the router's OpenAI surface (pure; no aiohttp state)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

# Request limits (the router's side; the engine's are at the top of consort_engine/protocol.py, and
# docs/security.md "Request limits" gives each one's reason). The body size is RouterConfig.limits.
PRIORITY_RANGE = (-1000, 1000)      # as the engine's: shadow copies run at -1000, the lowest
DETECTOR_SCAN_CHARS = 64 * 1024     # characters of the prompt the detectors read
USER_PATTERN_TIMEOUT_S = 0.25       # an EnsembleRouter's own detector patterns, searched in a child process,
                                    # count as no match past this (detectors.PatternSandbox)


class ApiError(Exception):
    """Rendered as {"error": {"type", "code", "message", ...}} with `status`."""

    def __init__(self, status: int, code: str, message: str, type: str | None = None,
                 retry_after_ms: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.type = type or default_type(status)
        self.retry_after_ms = retry_after_ms

    def body(self) -> dict:
        err: dict[str, Any] = {"type": self.type, "code": self.code, "message": self.message}
        if self.param is not None:
            err["param"] = self.param
        if self.retry_after_ms is not None:
            err["retry_after_ms"] = self.retry_after_ms
        return {"error": err}

    def headers(self) -> dict[str, str]:
        h = {}
        if self.retry_after_ms is not None:
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


def default_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
            429: "admission_rejected", 503: "unavailable"}.get(status, "server_error" if status >= 500 else "error")


def bad(code: str, message: str, param: str | None = None) -> ApiError:
    return ApiError(400, code, message, param=param)


@dataclass(frozen=True)
class ParsedRequest:
    body: dict
    model: str | None
    intent: str | None
    priority: int
    stream: bool
    text: str


# A JSON escape of a UTF-16 surrogate: json.loads pairs valid ones; a lone one would stay in the
# str and break detectors, the classifier and UTF-8 encoding later.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json(raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("invalid_json", f"request body is not valid JSON: {e}")
    if SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad("invalid_unicode", "request body contains a lone UTF-16 surrogate escape (such as "
                      "\\ud800): strings must be valid Unicode")
    if not isinstance(obj, dict):
        raise bad("invalid_request", "request body must be a JSON object")
    return obj


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _text_of_responses_input(obj: dict) -> list[str]:
    """/v1/responses: `instructions` and `input` (a string or messages) as text; the engine checks the shape."""
    inp = obj.get("input")
    if inp is None:
        raise bad("missing_field", "'input' is required", "input")
    parts = [obj["instructions"]] if isinstance(obj.get("instructions"), str) else []
    if isinstance(inp, str):
        return parts + [inp]
    if not isinstance(inp, list):
        raise bad("invalid_type", "'input' must be a string or a list of messages", "input")
    # messages' content; a function_call_output item's `output` (a tool result) is input text too
    return parts + [_text_of_content(m.get("content", m.get("output"))) for m in inp if isinstance(m, dict)]


def check_priority(priority: Any, cap: int = PRIORITY_RANGE[1]) -> int:
    """The request's priority, within PRIORITY_RANGE (an unbounded one let a flood at 1e18 push every other
    request into 429s and preempt their decodes), then clamped to the tenant's cap (tenants.py): the one
    place a priority is bounded."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise bad("invalid_type", "'priority' must be an integer", "priority")
    lo, hi = PRIORITY_RANGE
    if not lo <= priority <= hi:
        raise bad("invalid_value", f"'priority' must be between {lo} and {hi}, got {priority}", "priority")
    return min(priority, cap)


def parse_request(obj: dict, kind: str, header_intent: str | None,
                  max_priority: int = PRIORITY_RANGE[1]) -> ParsedRequest:
    """Validate the fields the router reads; the engine validates the rest. A priority above the
    tenant's cap is lowered to it in the body the engine gets."""
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("invalid_type", "'model' must be a string", "model")
    intent = obj.get("intent")
    if intent is not None and not isinstance(intent, str):
        raise bad("invalid_type", "'intent' must be a string", "intent")
    if header_intent:
        intent = header_intent.strip()
    priority = check_priority(obj.get("priority", 0), max_priority)
    if obj.get("priority", 0) != priority:
        obj = {**obj, "priority": priority}
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("invalid_type", "'stream' must be a boolean", "stream")
    if kind == "responses":   # routed like chat: classified on the instructions and input text
        text = "\n".join(_text_of_responses_input(obj))
    elif kind == "chat":
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("missing_field", "'messages' must be a non-empty list", "messages")
        parts = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise bad("invalid_type", f"messages[{i}] must be an object", f"messages[{i}]")
            parts.append(_text_of_content(m.get("content")))
        text = "\n".join(parts)
    else:
        prompt = obj.get("prompt")
        if prompt is None:
            raise bad("missing_field", "'prompt' is required", "prompt")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
        elif isinstance(prompt, list):
            text = ""  # token ids: nothing to read for detectors and the classifier
        else:
            raise bad("invalid_type", "'prompt' must be a string, a list of strings or token ids", "prompt")
    return ParsedRequest(obj, model, intent or None, priority, stream, text)


def tokenizer_lane(model: object, cfg) -> tuple[str, str | None]:
    """(specialist, adapter) whose engine answers /tokenize and /detokenize for `model`: a
    specialist, `specialist:adapter`, or the ensemble (or nothing), which means the default
    specialist, else the first: one tokenizer has to answer and nothing is being routed."""
    if model is not None and not isinstance(model, str):
        raise bad("invalid_type", "'model' must be a string", "model")
    if model is None or model == cfg.ensemble:
        return (cfg.default_specialist or cfg.specialists[0].name), None
    if cfg.specialist(model) is not None:
        return model, None
    base, sep, adapter = model.rpartition(":")
    if sep and cfg.specialist(base) is not None:
        return base, adapter
    raise ApiError(404, "model_not_found", f"model {model!r} is neither the ensemble {cfg.ensemble!r} nor one of "
                   f"its specialists {[s.name for s in cfg.specialists]}", param="model")


def upstream_body(obj: dict, specialist: str, adapter: str | None) -> dict:
    """What the engine gets: the router-only `intent` removed, `model` set to the specialist."""
    out = {k: v for k, v in obj.items() if k != "intent"}
    out["model"] = specialist
    if adapter is not None and out.get("adapter") is None:
        out["adapter"] = adapter
    return out
