"""A chat request's messages as a chat template reads them: each message checked and its content made
one string, and tools and tool calls rewritten for a template that does not know them (the Hermes /
Qwen2.5 forms). The engine renders every chat prompt through this module and chat_template.py; a
router imports the same code to compute the same prompt token ids (precise prefix routing), so the
two never disagree on a rendering. Pure Python, standard library only.
"""
from __future__ import annotations

import json
import re
from typing import Any

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
ROLES = {"system", "user", "assistant", "tool", "developer"}


class MessageError(ValueError):
    """A bad message field: `code` and `param` as the engine's typed 400 names them."""

    def __init__(self, code: str, message: str, param: str) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def check_message(i: int, m: Any) -> dict:
    """One chat message: a role we know and text content (a string or text parts, joined)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise MessageError("invalid_type", f"'{param}' must be an object", param)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise MessageError("invalid_value", f"'{param}.role' must be one of {sorted(ROLES)}", f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):   # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise MessageError("unsupported_content", f"'{param}.content[{j}]': only text parts are supported",
                                   f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        if role != "assistant":
            raise MessageError("missing_field", f"'{param}.content' is required", f"{param}.content")
        content = ""
    elif not isinstance(content, str):
        raise MessageError("invalid_type", f"'{param}.content' must be a string or a list of text parts",
                           f"{param}.content")
    if role == "assistant" and m.get("tool_calls") is not None:
        check_history_tool_calls(f"{param}.tool_calls", m["tool_calls"])
    out = {k: v for k, v in m.items() if k not in ("role", "content")}
    out.update(role=role, content=content)
    return out


def check_history_tool_calls(param: str, calls: Any) -> None:
    """An assistant message's `tool_calls` as OpenAI writes them back into the history."""
    if not isinstance(calls, list):
        raise MessageError("invalid_type", f"'{param}' must be a list", param)
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError("invalid_value", f"'{param}[{j}]' must be {{\"type\": \"function\", \"function\": "
                               "{\"name\", \"arguments\"}}", f"{param}[{j}]")
        if not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise MessageError("invalid_type", f"'{param}[{j}].function.arguments' must be a JSON string",
                               f"{param}[{j}].function.arguments")


def hermes_tools_block(tools: list[dict]) -> str:
    """The tool listing Qwen2.5's chat template writes into the system message."""
    listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" + listing +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _arguments_obj(args: Any) -> Any:
    """OpenAI history carries arguments as JSON text; templates expect the object (vLLM parses it too)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return {} if args is None else args


def _hermes_calls_text(calls: list[dict]) -> str:
    return "\n".join(CALL_START + "\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": _arguments_obj(c["function"].get("arguments"))},
                                                   ensure_ascii=False) + "\n" + CALL_END for c in calls)


def template_knows(template: str, what: str) -> bool:
    return re.search(rf"\b{what}\b", template) is not None


def messages_for_template(messages: list[dict], tools: list[dict] | None, template: str) -> list[dict]:
    """The messages a template can render. One that reads `tool_calls` gets the arguments as objects;
    one that does not gets Hermes text instead (assistant <tool_call>s, <tool_response> user turns),
    and one that ignores `tools` gets the Qwen2.5 tool listing in the system message."""
    knows_calls = template_knows(template, "tool_calls")
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls and knows_calls:
            m["tool_calls"] = [{**c, "function": {**c["function"],
                                                  "arguments": _arguments_obj(c["function"].get("arguments"))}}
                               for c in calls]
        elif calls:
            del m["tool_calls"]
            text = m.get("content") or ""
            m["content"] = (text + "\n" if text else "") + _hermes_calls_text(calls)
        elif m.get("role") == "tool" and not knows_calls:
            response = "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + response      # consecutive results share one turn, as Qwen2.5
                continue
            m = {"role": "user", "content": response, "_tool_turn": True}
        out.append(m)
    for m in out:
        m.pop("_tool_turn", None)
    if tools and not template_knows(template, "tools"):
        block = hermes_tools_block(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
