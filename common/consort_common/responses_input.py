"""A /v1/responses request's prompt as the chat messages and tools it means: instructions as the system
message, `input` items as messages (function_call items join the assistant turn they follow as tool
calls, function_call_output items become tool messages), flat function tools as chat's nested ones.

The engine maps every Responses request with these functions before the chat path renders it
(consort_engine/serving/responses.py); a router maps a body the same way to compute the engine's
prompt token ids (precise prefix routing). Errors are MessageError, which the engine answers as
typed 400s. Pure Python, standard library only.
"""
from __future__ import annotations

from typing import Any

from consort_common.chat_messages import MessageError

ROLES = {"user", "assistant", "system", "developer"}


def content_text(param: str, content: Any) -> str:
    """A message's content (or a function_call_output's output): a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(p.get("text"), str):
                raise MessageError("unsupported_value", "only text content parts (input_text, output_text) are "
                                   "supported", f"{param}[{j}]")
            parts.append(p["text"])
        return "".join(parts)
    raise MessageError("invalid_type", "a message's content must be a string or a list of text parts", param)


def _str_field(item: dict, key: str, param: str) -> str:
    if not isinstance(item.get(key), str):
        raise MessageError("invalid_type" if key in item else "missing_field", f"'{param}.{key}' must be a string",
                           f"{param}.{key}")
    return item[key]


def _function_call(i: int, item: dict) -> dict:
    """A `function_call` input item (a call the model made earlier) as a chat tool call."""
    p = f"input[{i}]"
    return {"id": _str_field(item, "call_id", p), "type": "function",
            "function": {"name": _str_field(item, "name", p), "arguments": _str_field(item, "arguments", p)}}


def input_messages(inp: Any) -> list[dict]:
    """`input` (a string, or a list of message / function_call / function_call_output items) as chat messages."""
    if isinstance(inp, str):
        if not inp:
            raise MessageError("empty_prompt", "'input' must not be empty", "input")
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise MessageError("invalid_type", "'input' must be a string or a non-empty list of messages", "input")
    out: list[dict] = []
    for i, m in enumerate(inp):
        kind = m.get("type", "message") if isinstance(m, dict) else None
        if kind == "function_call":   # joins the assistant turn it follows (OpenAI: message, then calls)
            call = _function_call(i, m)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str_field(m, "call_id", f"input[{i}]"),
                        "content": content_text(f"input[{i}].output", m.get("output"))})
        elif kind == "message" and m.get("role") in ROLES:
            out.append({"role": m["role"], "content": content_text(f"input[{i}].content", m.get("content"))})
        else:
            raise MessageError("unsupported_value", "'input' items must be messages with role user, assistant, "
                               "system or developer, function_call or function_call_output items", f"input[{i}]")
    return out


def with_instructions(messages: list[dict], instructions: str | None) -> list[dict]:
    """`instructions` lead the conversation as its system message."""
    return messages if instructions is None else [{"role": "system", "content": instructions}] + messages


def chat_tools(raw: Any) -> list[dict]:
    """Flat Responses function tools -> chat's nested ones; other tool types (web_search ...) are errors."""
    if not isinstance(raw, list):
        raise MessageError("invalid_type", "'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise MessageError("invalid_type", f"'tools[{i}]' must be an object", f"tools[{i}]")
        if t.get("type") != "function":
            raise MessageError("unsupported_value", f"'tools[{i}].type' {t.get('type')!r} is not supported here: "
                               "only function tools", f"tools[{i}].type")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
    return out


def chat_prompt(body: dict) -> dict:
    """The prompt fields of the chat body a Responses body means (`messages`, and `tools` when given):
    what the chat template renders. Raises MessageError where the engine answers a 400."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise MessageError("invalid_type", "'instructions' must be a string", "instructions")
    chat: dict[str, Any] = {"messages": with_instructions(input_messages(body.get("input")), instructions)}
    if body.get("tools") is not None:
        chat["tools"] = chat_tools(body["tools"])
    return chat
