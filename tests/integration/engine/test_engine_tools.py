"""Tools on a real `consort engine` with the real `openai` client. The demo model writes gibberish, so
a named or `required` choice returning arguments that validate is the structured output's doing;
`auto` parsing is driven end to end by a regex that makes the model write a Hermes <tool_call>."""
from __future__ import annotations

import json

import httpx
import jsonschema
from openai.types.chat import ChatCompletion, ChatCompletionChunk

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["q"],
          "properties": {"q": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def post(engine, body: dict) -> httpx.Response:
    return httpx.post(engine.url + "/v1/chat/completions", json={"model": "spec", **body}, timeout=120)


def sse(engine, body: dict) -> list[dict]:
    """The raw stream's events; it must end with [DONE]."""
    with httpx.stream("POST", engine.url + "/v1/chat/completions", timeout=120,
                      json={"model": "spec", **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def reassemble(chunks: list[dict]) -> tuple[str, list[dict], str | None]:
    """(content, tool calls merged by index, finish_reason) from chunk dicts."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            content += d.get("content") or ""
            for t in d.get("tool_calls") or []:
                call = calls.setdefault(t["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = t.get("id") or call["id"]
                fn = t.get("function") or {}
                call["name"] = fn.get("name") or call["name"]
                call["arguments"] += fn.get("arguments") or ""
            finish = c["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_calls(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.type == "function" and call.id.startswith("call_")


def prompt_tokens(engine, messages: list[dict], tools: list[dict] | None) -> int:
    r = httpx.post(engine.url + "/tokenize", json={"model": "spec", "messages": messages, "tools": tools}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_named_choice_returns_the_function_with_valid_arguments_for_every_seed(client, engine):
    with_tools = prompt_tokens(engine, MESSAGES, TOOLS)
    assert with_tools > prompt_tokens(engine, MESSAGES, None) + 50      # the tools block is in the prompt
    for seed in range(4):
        out = client.chat.completions.create(model="spec", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                             max_tokens=64, temperature=1.0, seed=seed)
        ChatCompletion.model_validate(out.model_dump())
        ch = out.choices[0]
        assert ch.finish_reason == "stop" and ch.message.content is None, ch
        assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
        check_calls(ch.message.tool_calls)
        assert out.usage.prompt_tokens == with_tools
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_required_returns_calls_of_the_tools_for_every_seed(client):
    for seed in range(4):
        out = client.chat.completions.create(model="spec", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=64, seed=seed)
        ChatCompletion.model_validate(out.model_dump())
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        check_calls(ch.message.tool_calls)
    # parallel calls: an array the gibberish model may keep extending; every finished call is valid
    out = client.chat.completions.create(model="spec", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=96, seed=1)
    ChatCompletion.model_validate(out.model_dump())
    assert len(out.choices[0].message.tool_calls) >= 1
    check_calls(out.choices[0].message.tool_calls)
    assert out.choices[0].finish_reason in ("tool_calls", "length")


def test_streamed_tool_calls_reassemble_to_the_non_streamed_call(engine):
    for choice, extra in ((NAMED, {}), ("required", {"parallel_tool_calls": False})):
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 64, "seed": 5, **extra}
        whole = post(engine, body).json()
        ChatCompletion.model_validate(whole)
        chunks = sse(engine, body)
        for ch in chunks:
            ChatCompletionChunk.model_validate(ch)
        content, calls, finish = reassemble(chunks)
        msg = whole["choices"][0]["message"]
        assert content == "" and finish == whole["choices"][0]["finish_reason"]
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        firsts = [t for ch in chunks for c in ch["choices"] for t in c["delta"].get("tool_calls") or []]
        assert firsts[0]["id"].startswith("call_") and firsts[0]["function"] == {"name": calls[0]["name"]}
        assert len(firsts) > 2                                     # arguments arrive in fragments
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


# The model is made to write a Hermes call by a regex, so the auto parser reads a real token stream.
HERMES = r'Sure\.\n<tool_call>\n\{"name": "search", "arguments": \{"q": "[a-z]{1,8}"\}\}\n</tool_call>'


def test_auto_parses_a_hermes_call_written_by_the_model_streamed_and_not(client, engine):
    for seed in range(3):
        out = client.chat.completions.create(model="spec", messages=MESSAGES, tools=TOOLS, max_tokens=64, seed=seed,
                                             extra_body={"guided_regex": HERMES})
        ChatCompletion.model_validate(out.model_dump())
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure.", ch
        assert [c.function.name for c in ch.message.tool_calls] == ["search"]
        check_calls(ch.message.tool_calls)
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, "seed": seed, "guided_regex": HERMES}
        content, calls, finish = reassemble(sse(engine, body))
        assert (content, finish) == ("Sure.", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    # tool_choice none: the same text is content, nothing parsed
    none = client.chat.completions.create(model="spec", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=64, seed=0, extra_body={"guided_regex": HERMES})
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    # free text from the demo model: no tags, so content (gibberish) and no calls
    free = client.chat.completions.create(model="spec", messages=MESSAGES, tools=TOOLS, max_tokens=16, seed=0)
    ChatCompletion.model_validate(free.model_dump())
    assert free.choices[0].message.content and free.choices[0].finish_reason in ("stop", "length")


def test_history_with_tool_calls_and_tool_results_renders(client, engine):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    out = client.chat.completions.create(model="spec", messages=history, tools=TOOLS, max_tokens=8, seed=0, n=2)
    ChatCompletion.model_validate(out.model_dump())
    assert out.usage.prompt_tokens == prompt_tokens(engine, history, TOOLS)
    assert out.usage.prompt_tokens > prompt_tokens(engine, MESSAGES, TOOLS) + 20
    assert out.usage.completion_tokens == 16 or out.choices[0].finish_reason == "stop" \
        or out.choices[1].finish_reason == "stop"


def test_bad_tools_are_typed_400s(engine):
    cases = [({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice.function.name"),
             ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
               "tool_choice": "required"}, "tools")]
    for extra, param in cases:
        r = post(engine, {"messages": MESSAGES, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
