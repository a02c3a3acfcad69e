"""Tools through the router with the real `openai` client: `tools`, `tool_choice` and
`parallel_tool_calls` pass through unchanged to real engines, and tool calls come back in responses
and streamed deltas (the demo model is gibberish: valid arguments are the structured output's doing)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conftest import router_config

pytestmark = pytest.mark.timeout(300)

FIND = {"type": "object", "additionalProperties": False, "required": ["header", "line"],
        "properties": {"header": {"enum": ["<vector>", "<map>", "<set>"]},
                       "line": {"type": "integer", "minimum": 1, "maximum": 500}}}
COMPILE = {"type": "object", "additionalProperties": False, "required": ["flags"],
           "properties": {"flags": {"type": "string", "maxLength": 10}}}
TOOLS = [{"type": "function", "function": {"name": "find_include", "parameters": FIND}},
         {"type": "function", "function": {"name": "compile", "description": "g++ flags", "parameters": COMPILE}}]
SCHEMAS = {"find_include": FIND, "compile": COMPILE}
MESSAGES = [{"role": "user", "content": "which header declares std::vector?"}]


def check(calls) -> None:
    assert calls, "no tool calls"
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_named_and_required_tool_calls_through_the_router(engines, make_router):
    r = make_router(router_config(engines))
    c = r.client()
    named = {"type": "function", "function": {"name": "find_include"}}
    for seed in range(3):
        out = c.chat.completions.create(model="STL", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                        max_tokens=48, seed=seed)
        ChatCompletion.model_validate(out.model_dump())
        assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content is None
        assert [t.function.name for t in out.choices[0].message.tool_calls] == ["find_include"]
        check(out.choices[0].message.tool_calls)
        req = c.chat.completions.create(model="cpp", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=96, seed=seed)
        ChatCompletion.model_validate(req.model_dump())
        assert req.choices[0].finish_reason == "tool_calls" and len(req.choices[0].message.tool_calls) == 1, req
        check(req.choices[0].message.tool_calls)


def test_streamed_tool_calls_through_the_router_end_with_done_and_reassemble(engines, make_router):
    r = make_router(router_config(engines))
    body = {"model": "STL", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 96, "seed": 4}
    whole = r.post("/v1/chat/completions", body).json()
    ChatCompletion.model_validate(whole)
    with httpx.stream("POST", r.url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines[:-1]]
    name, args, finish = None, "", None
    for ch in chunks:
        for choice in ch.choices:
            for t in choice.delta.tool_calls or []:
                assert t.index == 0
                name = (t.function.name if t.function else None) or name
                args += (t.function.arguments if t.function else None) or ""
            finish = choice.finish_reason or finish
    call = whole["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (name, args, finish) == (call["name"], call["arguments"], "tool_calls")
    assert chunks[-1].usage.model_dump() == ChatCompletion.model_validate(whole).usage.model_dump()
    # the openai client's own stream reader sees the same call
    stream = r.client().chat.completions.create(**{k: v for k, v in body.items() if k != "model"}, model="STL",
                                                stream=True)
    got = "".join(t.function.arguments or "" for ch in stream if ch.choices
                  for t in ch.choices[0].delta.tool_calls or [] if t.function)
    assert got == args


def test_tool_history_passes_and_bad_tools_are_the_engines_typed_400s(engines, make_router):
    r = make_router(router_config(engines))
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "find_include", "arguments": '{"header": "<vector>", "line": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "#include <vector>"}]
    out = r.client().chat.completions.create(model="STL", messages=history, tools=TOOLS, max_tokens=6, seed=0)
    ChatCompletion.model_validate(out.model_dump())
    bad = r.post("/v1/chat/completions", {"model": "STL", "messages": MESSAGES, "tools": TOOLS,
                                          "tool_choice": {"type": "function", "function": {"name": "link"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice.function.name", bad.text
    bad = r.post("/v1/chat/completions", {"model": "STL", "messages": MESSAGES,
                                          "tools": [{"type": "function", "function": {"name": "a b"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name", bad.text
