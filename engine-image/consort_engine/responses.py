"""OpenAI Responses API (/v1/responses), text in and out, as a view of chat generation.

A request becomes a chat request (instructions as the system message, `input` as the messages);
the chat path generates, and these pure functions shape its text into the Response object and the
Responses SSE events (response.created ... response.completed) that `openai.types.responses` reads.
Responses are not stored, so `previous_response_id` is a typed 400."""
from __future__ import annotations

import time
import uuid
from typing import Any

from .protocol import bad

# Fields a chat request would not understand, each mapped or rejected here.
UNSUPPORTED = ("previous_response_id", "tools", "tool_choice", "conversation", "background", "prompt")
_ROLES = {"user", "assistant", "system", "developer"}


def _content_text(i: int, content: Any) -> str:
    """A message's content: a string, or input_text/output_text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(p.get("text"), str):
                raise bad("unsupported_value", "only text content parts (input_text, output_text) are supported",
                          f"input[{i}].content[{j}]")
            parts.append(p["text"])
        return "".join(parts)
    raise bad("invalid_type", "a message's content must be a string or a list of text parts", f"input[{i}].content")


def _messages(inp: Any) -> list[dict]:
    if isinstance(inp, str):
        if not inp:
            raise bad("empty_prompt", "'input' must not be empty", "input")
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad("invalid_type", "'input' must be a string or a non-empty list of messages", "input")
    out = []
    for i, m in enumerate(inp):
        if not isinstance(m, dict) or m.get("type", "message") != "message" or m.get("role") not in _ROLES:
            raise bad("unsupported_value", "'input' items must be messages with role user, assistant, system "
                      "or developer", f"input[{i}]")
        out.append({"role": m["role"], "content": _content_text(i, m.get("content"))})
    return out


def to_chat(body: Any) -> dict:
    """The chat request a Responses request means; typed 400s for what is not supported."""
    if not isinstance(body, dict):
        raise bad("invalid_request", "request body must be a JSON object")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise bad("unsupported_value", f"'{key}' is not supported by /v1/responses here", key)
    if "input" not in body:
        raise bad("missing_field", "'input' is required", "input")
    messages = _messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("invalid_type", "'instructions' must be a string", "instructions")
        messages = [{"role": "system", "content": instructions}] + messages
    chat: dict[str, Any] = {"messages": messages}
    for key in ("model", "temperature", "top_p", "stream", "seed", "priority", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex


def response(resp_id: str, model: str, body: dict, text: str | None, status: str, created: float,
             finish_reason: str | None = None, usage: dict | None = None) -> dict:
    """The Response object: one assistant message with one output_text part once there is text."""
    output = [] if text is None else [message(resp_id, text, "completed")]
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {
        "id": resp_id, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else status, "incomplete_details": incomplete,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "output": output,
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "error": None, "metadata": {},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": _input_details(usage),
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def _input_details(usage: dict) -> dict:
    """Cached prompt tokens were read from the prefix cache; the others were computed and written to it."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"cached_tokens": cached, "cache_write_tokens": usage["prompt_tokens"] - cached}


def item_id(resp_id: str) -> str:
    return "msg_" + resp_id[len("resp_"):]


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def message(resp_id: str, text: str | None, status: str) -> dict:
    """The assistant's output message; no content yet while it is being added."""
    return {"id": item_id(resp_id), "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def event(kind: str, seq: int, **fields: Any) -> dict:
    return {"type": kind, "sequence_number": seq, **fields}


def now() -> float:
    return float(int(time.time()))
