"""OpenAI Responses API (/v1/responses) as a view of chat generation: text and function tools.

A request becomes a chat request (instructions as the system message, `input` items as the messages,
flat function tools as chat's nested ones: consort_common/responses_input.py, which routers use to
render the same prompt); the chat path generates, and these pure functions shape its
output into the Response object and the Responses SSE events (response.created ... response.completed)
that `openai.types.responses` reads. Function calls come back as `function_call` output items, and
`function_call` / `function_call_output` input items go back in as assistant tool calls and tool
messages, so a tool loop works. Responses are not stored, so `previous_response_id` is a typed 400."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, model_validator

from consort_common.chat_messages import MessageError
from consort_common.responses_input import chat_tools, input_messages, with_instructions
from consort_engine.serving.errors import bad
from consort_engine.serving.fields import Raw, Str, checked
from consort_engine.text import tool_calls

# Fields a chat request would not understand and that are not mapped below: rejected.
UNSUPPORTED = ("previous_response_id", "conversation", "background", "prompt")


def _mapped(convert: Callable[[Any], Any]) -> Any:
    """A field mapped by consort_common/responses_input.py (shared with routers); its errors as typed 400s."""
    def check(v: Any, key: str) -> Any:
        try:
            return convert(v)
        except MessageError as e:
            raise bad(e.code, e.message, e.param) from None
    return checked(None, check)


def _chat_tool_choice(choice: Any) -> Any:
    """auto / none / required pass as they are; {"type": "function", "name"} nests as chat's named choice."""
    if not isinstance(choice, dict):
        return choice     # strings (and bad types) are chat's to check
    if choice.get("type") != "function":
        raise bad("unsupported_value", f"'tool_choice' of type {choice.get('type')!r} is not supported here: "
                  "auto, none, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    if not isinstance(choice.get("name"), str):
        raise bad("invalid_value", "a function 'tool_choice' must be {\"type\": \"function\", \"name\": ...}",
                  "tool_choice.name")
    return {"type": "function", "function": {"name": choice["name"]}}


def _check_tools(chat: dict) -> None:
    """Chat's tool checks, their messages and params spelled the flat Responses way."""
    try:
        tool_calls.parse_tools(chat)
    except tool_calls.ToolsError as e:
        def flat(s: str) -> str:
            return s.replace(".function.", ".")
        raise bad(e.code, flat(e.message), flat(e.param)) from None


class ResponsesBody(BaseModel):
    """POST /v1/responses: checked here, then generated as the chat request it means (`chat`), whose
    model checks the sampling fields it carries over."""
    model_config = ConfigDict(extra="ignore")
    input: _mapped(input_messages)
    instructions: Str
    tools: _mapped(chat_tools)
    tool_choice: checked(None, lambda v, key: _chat_tool_choice(v))
    max_output_tokens: Raw
    model: Raw                      # carried over as they are: the chat body checks them
    temperature: Raw
    top_p: Raw
    stream: Raw
    seed: Raw
    priority: Raw
    user: Raw
    parallel_tool_calls: Raw

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise bad("invalid_request", "request body must be a JSON object")
        for key in UNSUPPORTED:
            if body.get(key) is not None:
                raise bad("unsupported_value", f"'{key}' is not supported by /v1/responses here", key)
        if "input" not in body:
            raise bad("missing_field", "'input' is required", "input")
        return body

    @model_validator(mode="after")
    def _tools_checked(self) -> "ResponsesBody":
        _check_tools(self.chat())
        return self

    def chat(self) -> dict:
        """The chat request this Responses request means."""
        chat: dict[str, Any] = {"messages": with_instructions(self.input, self.instructions)}
        for key in ("model", "temperature", "top_p", "stream", "seed", "priority", "user", "parallel_tool_calls"):
            if getattr(self, key) is not None:
                chat[key] = getattr(self, key)
        for key, value in (("max_tokens", self.max_output_tokens), ("tools", self.tools),
                           ("tool_choice", self.tool_choice)):
            if value is not None:
                chat[key] = value
        return chat


def to_chat(body: Any) -> dict:
    """The chat request a Responses request means; typed 400s for what is not supported."""
    return ResponsesBody.model_validate(body).chat()


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex


def response(resp_id: str, model: str, body: dict, output: list[dict] | None, status: str, created: float,
             finish_reason: str | None = None, usage: dict | None = None) -> dict:
    """The Response object around its output items (none yet while in progress)."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict")} for t in body.get("tools") or []]
    return {
        "id": resp_id, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else status, "incomplete_details": incomplete,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "output": output or [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"), "tools": tools,
        "error": None, "metadata": {},
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


def item_id(resp_id: str, output_index: int = 0, prefix: str = "msg_") -> str:
    """Output items share the response's hex: msg_<hex> for the first message, <prefix><hex>_<i> after."""
    hexid = resp_id[len("resp_"):]
    return prefix + hexid if output_index == 0 and prefix == "msg_" else f"{prefix}{hexid}_{output_index}"


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def message(mid: str, text: str | None, status: str) -> dict:
    """An assistant output message; no content yet while it is being added."""
    return {"id": mid, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def function_call(fid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


Event = tuple[str, dict]     # (Responses event type, its fields less type and sequence_number)


@dataclass
class OutputItems:
    """The chat path's output events (tool_calls.Event: content text, tool-call deltas) -> the Response's
    output items, and the Responses stream events that build them, in order: an item is added when its
    first piece comes, written (text / arguments deltas) and done when the next item starts or at finish."""
    resp_id: str
    items: list[dict] = field(default_factory=list)     # finished items, the Response's `output`
    _open: dict | None = None                            # the item being written (its final form)
    _call_index: int | None = None                       # the open function_call's index in the chat deltas

    def feed(self, events: list[tool_calls.Event]) -> list[Event]:
        out: list[Event] = []
        for kind, v in events:
            if kind == "content":
                if not v:
                    continue
                if self._open is None or self._open["type"] != "message":
                    out += self._close() + self.open_message()
                self._open["content"][0]["text"] += v
                out.append(("response.output_text.delta", dict(delta=v, logprobs=[], **self._where(True))))
            else:
                fn = v.get("function", {})
                if self._open is None or self._call_index != v["index"]:
                    out += self._close()
                    self._call_index = v["index"]
                    out += self._add(function_call(item_id(self.resp_id, len(self.items), "fc_"), v.get("id", ""),
                                                   fn.get("name", ""), "", "completed"))
                if fn.get("arguments"):
                    self._open["arguments"] += fn["arguments"]
                    out.append(("response.function_call_arguments.delta",
                                dict(delta=fn["arguments"], **self._where(False))))
        return out

    def finish(self) -> list[Event]:
        """Close the last item; an output with nothing in it is one empty message, as before tools."""
        out = [] if self.items or self._open else self.open_message()
        return out + self._close()

    def _where(self, text: bool) -> dict:
        where = dict(item_id=self._open["id"], output_index=len(self.items))
        return dict(where, content_index=0) if text else where

    def _add(self, item: dict) -> list[Event]:
        self._open = item
        added = dict(item, status="in_progress")
        if item["type"] == "message":
            added["content"] = []      # its text part is added next (a copy: the item's text grows)
        return [("response.output_item.added", dict(output_index=len(self.items), item=added))]

    def open_message(self) -> list[Event]:
        """Add an empty assistant message item and its text part; content that comes next is written to it."""
        out = self._add(message(item_id(self.resp_id, len(self.items)), "", "completed"))
        out.append(("response.content_part.added", dict(part=text_part(""), **self._where(True))))
        return out

    def _close(self) -> list[Event]:
        item = self._open
        if item is None:
            return []
        out: list[Event]
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out = [("response.output_text.done", dict(text=text, logprobs=[], **self._where(True))),
                   ("response.content_part.done", dict(part=text_part(text), **self._where(True)))]
        else:
            out = [("response.function_call_arguments.done", dict(arguments=item["arguments"], **self._where(False)))]
        out.append(("response.output_item.done", dict(output_index=len(self.items), item=item)))
        self.items.append(item)
        self._open, self._call_index = None, None
        return out


def event(kind: str, seq: int, **fields: Any) -> dict:
    return {"type": kind, "sequence_number": seq, **fields}


def now() -> float:
    return float(int(time.time()))
