"""Tool calling as vLLM's OpenAI server does it with `--enable-auto-tool-choice --tool-call-parser hermes`.

Three parts, all pure (no engine, no aiohttp):
- request side: `parse_tools` validates `tools` / `tool_choice` / `parallel_tool_calls` into a `ToolChoice`;
  `guided_schema` gives the JSON schema that enforces `required` and named choice through structured
  output (guided.py), as vLLM does;
- prompt side (consort_common/chat_messages.py, shared with the router): `messages_for_template` lets
  a chat template that knows nothing of tools still see them (a Hermes/Qwen2.5-style system block
  listing them in <tools></tools>, assistant tool calls as <tool_call> text, tool results as
  <tool_response> user turns);
- output side: `ToolCallStreamer` turns generated text into content and OpenAI `tool_calls` deltas,
  chunk by chunk (a tag split across tokens is held back until it resolves); `parse_output` is the
  same streamer fed the whole text at once, so a streamed answer reassembles to the non-streamed one.

Output formats: `auto` parses Hermes tags, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(one or several; text outside them is content; a call whose JSON does not parse stays content).
`required` is guided to a JSON array of {"name", "arguments"} objects (one object when
`parallel_tool_calls` is false) and named choice to the function's arguments object; both come back
as tool_calls without tags.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from consort_common.chat_messages import CALL_END, CALL_START, MessageError

if TYPE_CHECKING:
    from consort_engine.text.guided import GuidedSpec

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MODES = ("none", "auto", "required")

# The head of a call object in the order Hermes/Qwen models write it (and our guided JSON does):
# once it is complete the name is known and the arguments can stream.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# Trailing characters that may close the outer call object rather than the arguments: held back.
_CLOSERS = "} \t\r\n"
_DECODER = json.JSONDecoder()


class ToolsError(MessageError):
    """A bad `tools` / `tool_choice` field; the serving layer turns it into a typed 400."""


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools and how they may be used. mode: none | auto | required | named."""
    tools: list[dict]
    mode: str
    name: str | None = None          # the function forced by a named choice
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"


# ---------------------------------------------------------------------------------------------
# request side


def _check_tool(i: int, tool: Any) -> dict:
    p = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolsError("invalid_type", f"'{p}' must be an object", p)
    if tool.get("type") != "function":
        raise ToolsError("invalid_value", f"'{p}.type' must be \"function\", got {tool.get('type')!r}", f"{p}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolsError("invalid_type", f"'{p}.function' must be an object", f"{p}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolsError("invalid_value", f"'{p}.function.name' must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}",
                         f"{p}.function.name")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise ToolsError("invalid_type", f"'{p}.function.parameters' must be a JSON schema object",
                         f"{p}.function.parameters")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolsError("invalid_type", f"'{p}.function.description' must be a string", f"{p}.function.description")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ToolsError("invalid_type", f"'{p}.function.strict' must be a boolean", f"{p}.function.strict")
    return tool


def parse_tools(body: dict) -> ToolChoice | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> ToolChoice (None: no tools, choice none or auto)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise ToolsError("invalid_type", "'tools' must be a list of function tools", "tools")
    tools = [_check_tool(i, t) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ToolsError("invalid_value", f"'tools[{i}].function.name' {n!r} is given twice",
                             f"tools[{i}].function.name")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsError("invalid_type", "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = body.get("tool_choice")
    mode, name = ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in MODES:
            raise ToolsError("invalid_value", f"'tool_choice' must be one of {list(MODES)} or a named function, "
                             f"got {choice!r}", "tool_choice")
        mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolsError("invalid_value", "a named 'tool_choice' must be {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", "tool_choice")
        if fn["name"] not in names:
            raise ToolsError("invalid_value", f"'tool_choice.function.name' {fn['name']!r} is not in 'tools' "
                             f"({names})", "tool_choice.function.name")
        mode, name = "named", fn["name"]
    elif choice is not None:
        raise ToolsError("invalid_type", "'tool_choice' must be a string or an object", "tool_choice")
    if mode == "required" and not tools:
        raise ToolsError("invalid_value", "'tool_choice' required needs 'tools'", "tool_choice")
    if not tools:
        return None
    return ToolChoice(tools, mode, name, parallel is not False)


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def guided_schema(tc: ToolChoice) -> GuidedSpec | None:
    """The structured-output constraint that enforces `required` or a named choice (None otherwise)."""
    from consort_engine.text.guided import GuidedSpec    # guided.py needs torch; the prompt side here does not
    if tc.mode == "named":
        i, tool = next((i, t) for i, t in enumerate(tc.tools) if t["function"]["name"] == tc.name)
        return GuidedSpec("json_schema", json.dumps(_params(tool), separators=(",", ":")),
                          f"tools[{i}].function.parameters")
    if tc.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "arguments": _params(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tc.tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "items": one} if tc.parallel else one
    return GuidedSpec("json_schema", json.dumps(schema, separators=(",", ":")), "tools")


# ---------------------------------------------------------------------------------------------
# output side


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _held(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag (may still become the tag)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


@dataclass
class _Call:
    """One call being written: its body (the JSON object's text so far) and what has been sent."""
    index: int
    id: str = field(default_factory=new_call_id)
    name_sent: bool = False
    args_start: int = 0          # offset of the arguments value in the body
    args_sent: int = 0           # characters of the arguments text already sent

    def header(self, name: str) -> dict:
        self.name_sent = True
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": name}}

    def args(self, text: str) -> dict:
        self.args_sent += len(text)
        return {"index": self.index, "function": {"arguments": text}}

    def progress(self, body: str) -> list[dict]:
        """Deltas for a body still being written: the header once the name is known, then the
        arguments except a trailing run that may close the outer object instead."""
        out = []
        if not self.name_sent:
            m = _HEAD.match(body)
            try:
                name = json.loads('"' + m.group(1) + '"') if m else None
            except ValueError:
                name = None
            if name is None:
                return out
            out.append(self.header(name))
            self.args_start = m.end()
        args = body[self.args_start:]
        safe = len(args.rstrip(_CLOSERS))
        if safe > self.args_sent:
            out.append(self.args(args[self.args_sent:safe]))
        return out

    def close(self, body: str) -> list[dict] | None:
        """Deltas that finish a complete body; None if it is not a call (malformed JSON: content)."""
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                and isinstance(obj.get("arguments", {}), dict)):
            if not self.name_sent:
                return None
            rest = body[self.args_start:].rstrip()     # committed already: send what the model wrote
            rest = rest[:-1] if rest.endswith("}") else rest
            return [self.args(rest[self.args_sent:])] if len(rest) > self.args_sent else []
        m = _HEAD.match(body)
        if m is not None:        # the arguments as the model wrote them (what has streamed is a prefix)
            self.args_start = m.end()
            text = body[m.end():_DECODER.raw_decode(body, m.end())[1]]
        else:
            text = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
        out = [] if self.name_sent else [self.header(obj["name"])]
        if len(text) > self.args_sent and text.startswith(body[self.args_start:self.args_start + self.args_sent]):
            out.append(self.args(text[self.args_sent:]))
        elif self.args_sent == 0:
            out.append(self.args(text))
        return out


Event = tuple[str, Any]          # ("content", str) | ("tool_call", delta dict)


class ToolCallStreamer:
    """Generated text -> ordered content / tool_call events, for one choice.

    `feed(text)` returns the events the text settles; `finish()` the rest. Whitespace next to a
    call is dropped (a segment before a call and, once a call was made, the text after the last one
    lose their trailing whitespace); other text outside calls is content."""

    def __init__(self, tc: ToolChoice) -> None:
        self.tc = tc
        self.mode = tc.mode
        self.calls: list[_Call] = []
        self._buf = ""               # text not yet settled
        self._ws = ""                # whitespace held outside calls
        self._call: _Call | None = None
        self._body = ""              # the open call's body
        self._ws_before = ""         # whitespace before the open call's tag (content again if it is not a call)
        self._depth = 0              # required: JSON nesting depth outside the open item
        self._in_str = self._esc = False

    @property
    def called(self) -> bool:
        return any(c.name_sent for c in self.calls)

    def feed(self, text: str) -> list[Event]:
        if self.mode == "named":
            return self._named(text)
        if self.mode == "required":
            return self._required(text)
        return self._hermes(text, final=False)

    def finish(self) -> list[Event]:
        if self.mode == "named":
            return [] if self.calls else self._named("")
        if self.mode == "required":
            return self._required_finish()
        return self._hermes("", final=True)

    # ---- named: the whole output is the arguments
    def _named(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not self.calls:
            self.calls.append(_Call(0))
            out.append(("tool_call", self.calls[0].header(self.tc.name)))
        if text:
            out.append(("tool_call", self.calls[0].args(text)))
        return out

    # ---- auto: Hermes tags in free text
    def _content(self, text: str, before_call: bool) -> list[Event]:
        text = self._ws + text
        kept = text.rstrip()
        self._ws = "" if before_call else text[len(kept):]
        if before_call:
            self._ws_before = text[len(kept):]
        return [("content", kept)] if kept else []

    def _open(self) -> None:
        self._call, self._body = _Call(len(self.calls)), ""

    def _commit(self, call: _Call) -> None:
        if not any(c is call for c in self.calls):
            self.calls.append(call)

    def _progress(self) -> list[Event]:
        out = [("tool_call", d) for d in self._call.progress(self._body)]
        if self._call.name_sent:         # committed: its index is taken
            self._commit(self._call)
        return out

    def _close(self, final: bool) -> list[Event]:
        call, body = self._call, self._body
        self._call = None
        deltas = call.close(body)
        if deltas is None:       # not a call: its text is content, with the whitespace before it
            raw = CALL_START + body + ("" if final else CALL_END)
            self._ws = self._ws_before
            return self._content(raw, before_call=False)
        self._commit(call)
        return [("tool_call", d) for d in deltas]

    def _hermes(self, text: str, final: bool) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._call is None:
                i = self._buf.find(CALL_START)
                if i >= 0:
                    out += self._content(self._buf[:i], before_call=True)
                    self._buf = self._buf[i + len(CALL_START):]
                    self._open()
                    continue
                keep = 0 if final else _held(self._buf, CALL_START)
                out += self._content(self._buf[:len(self._buf) - keep], before_call=False)
                self._buf = self._buf[len(self._buf) - keep:]
                if final and self._ws and not self.calls:
                    out.append(("content", self._ws))     # no call: the text is the model's, untouched
                    self._ws = ""
                return out
            j = self._buf.find(CALL_END)
            if j >= 0:
                self._body += self._buf[:j]
                self._buf = self._buf[j + len(CALL_END):]
                out += self._close(final=False)
                continue
            keep = 0 if final else _held(self._buf, CALL_END)
            self._body += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            if final:                        # an unterminated last call (vLLM parses those too)
                out += self._close(final=True)
                continue
            return out + self._progress()

    # ---- required: a guided JSON array of call objects (one object without parallel calls)
    def _required(self, text: str) -> list[Event]:
        out: list[Event] = []
        outer = 1 if self.tc.parallel else 0          # depth at which an item object opens
        start = 0                                     # where the open item's text begins in `text`
        for i, ch in enumerate(text):                 # over generated text only, never per token
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "[{":
                if ch == "{" and self._depth == outer and self._call is None:
                    self._open()
                    start = i
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if ch == "}" and self._depth == outer and self._call is not None:
                    self._body += text[start:i + 1]
                    out += self._close_item()
        if self._call is not None:
            self._body += text[start:]
            out += self._progress()
        return out

    def _close_item(self) -> list[Event]:
        call, body = self._call, self._body
        self._call = None
        deltas = call.close(body)
        if deltas is None:
            return [("content", body)]
        self._commit(call)
        return [("tool_call", d) for d in deltas]

    def _required_finish(self) -> list[Event]:
        if self._call is None:
            return []
        return self._close_item()          # cut short (max_tokens): what was written


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]


def assemble(events: list[Event]) -> ParsedOutput:
    """Events -> the non-streamed message: content joined, each call's deltas merged by index."""
    content = "".join(v for k, v in events if k == "content")
    calls: dict[int, dict] = {}
    for kind, d in events:
        if kind != "tool_call":
            continue
        c = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        if "id" in d:
            c["id"] = d["id"]
        fn = d.get("function", {})
        if "name" in fn:
            c["function"]["name"] = fn["name"]
        c["function"]["arguments"] += fn.get("arguments", "")
    return ParsedOutput(content or None, [calls[i] for i in sorted(calls)])


def parse_output(tc: ToolChoice, text: str) -> ParsedOutput:
    """The whole output at once: what the streamed deltas of the same text reassemble to."""
    s = ToolCallStreamer(tc)
    return assemble(s.feed(text) + s.finish())


def finish_reason(tc: ToolChoice, called: bool, engine_reason: str) -> str:
    """vLLM's rule: auto and required report "tool_calls" when calls were made and generation ended
    on its own; a named choice reports the engine's reason (OpenAI does the same)."""
    if called and tc.mode in ("auto", "required") and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def chunk_pieces(events: list[Event]) -> list[tuple[str, list[dict] | None]]:
    """Streamer events -> (content, tool_calls) payloads, one SSE chunk each: consecutive content
    joined, one tool-call delta per chunk (clients that read `delta.tool_calls[0]` see every one)."""
    out: list[tuple[str, list[dict] | None]] = []
    for kind, v in events:
        if kind == "content":
            if out and out[-1][1] is None:
                out[-1] = (out[-1][0] + v, None)
            else:
                out.append((v, None))
        else:
            out.append(("", [v]))
    return out
