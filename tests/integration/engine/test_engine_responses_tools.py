"""Function tools in /v1/responses on a real `consort engine`, driven by the `openai` client: named and
`required` choices come back as `function_call` items whose arguments validate (the structured output's
doing: the demo model writes gibberish), streamed events validate, come in order and add up to the
non-streamed Response, and the calls go back in as input items for the next turn."""
from __future__ import annotations

import json

import httpx
import jsonschema
from pydantic import TypeAdapter

from test_engine_tools import SCHEMAS, SEARCH, WEATHER

TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "search", "parameters": SEARCH, "strict": True}]
NAMED = {"type": "function", "name": "get_weather"}


def check_response(r) -> list:
    from openai.types.responses import Response
    Response.model_validate(r.model_dump())
    calls = [o for o in r.output if o.type == "function_call"]
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
    return calls


def test_named_and_required_choices_return_function_call_items(client):
    for seed in range(3):
        r = client.responses.create(model="spec", input="weather in Paris?", tools=TOOLS, tool_choice=NAMED,
                                    max_output_tokens=64, temperature=1.0, extra_body={"seed": seed})
        calls = check_response(r)
        assert [o.type for o in r.output] == ["function_call"] and calls[0].name == "get_weather", r.output
        assert r.status == "completed" and r.tool_choice.name == "get_weather"
        assert [t.name for t in r.tools] == ["get_weather", "search"]
        req = client.responses.create(model="spec", input="weather in Paris?", tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_output_tokens=64, extra_body={"seed": seed})
        calls = check_response(req)
        assert len(calls) == 1 and calls[0].name in SCHEMAS and req.parallel_tool_calls is False
    # the same request as a chat completion: the same call
    chat = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": "weather in Paris?"}],
                                          tools=[{"type": "function", "function": {k: v for k, v in t.items()
                                                                                   if k != "type"}} for t in TOOLS],
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          max_tokens=64, temperature=0)
    r = client.responses.create(model="spec", input="weather in Paris?", tools=TOOLS, tool_choice=NAMED,
                                max_output_tokens=64, temperature=0)
    assert r.output[0].arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_function_call_events_are_ordered_and_add_up(client):
    from openai.types.responses import ResponseStreamEvent
    adapter = TypeAdapter(ResponseStreamEvent)
    for choice in (NAMED, "required"):
        kw = dict(model="spec", input="weather in Paris?", tools=TOOLS, tool_choice=choice, max_output_tokens=64,
                  temperature=0, parallel_tool_calls=False)
        full = client.responses.create(**kw)
        events = list(client.responses.create(stream=True, **kw))
        for e in events:
            adapter.validate_python(e.model_dump())
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
        assert events[2].item.type == "function_call" and events[2].item.status == "in_progress"
        assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"], kinds
        assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"} and len(kinds[3:-3]) > 2
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        item = events[-2].item
        assert args == events[-3].arguments == item.arguments == full.output[0].arguments
        assert item.name == full.output[0].name and item.id == events[2].item.id == events[-3].item_id
        assert events[-1].response.output[0].call_id == item.call_id
        assert events[-1].response.usage.output_tokens == full.usage.output_tokens


def test_a_tool_loop_feeds_calls_and_outputs_back(client, engine):
    first = client.responses.create(model="spec", input="weather in Paris?", tools=TOOLS, tool_choice=NAMED,
                                    max_output_tokens=64, temperature=0)
    call = first.output[0]
    history = [{"role": "user", "content": "weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"}]
    second = client.responses.create(model="spec", input=history, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    check_response(second)
    assert [o.type for o in second.output] == ["message"] and second.output_text
    # the prompt is the chat history it means: assistant tool call, then the tool result
    chat_history = [{"role": "user", "content": "weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                           "function": {"name": call.name,
                                                                                        "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24C"}]
    chat = client.chat.completions.create(model="spec", messages=chat_history, tool_choice="none", max_tokens=8,
                                          temperature=0, tools=[{"type": "function", "function": {
                                              k: v for k, v in t.items() if k != "type"}} for t in TOOLS])
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == chat.choices[0].message.content


def test_other_tool_types_and_bad_tool_fields_are_typed_400s(engine):
    for body, param in [({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
                        ({"tools": [dict(TOOLS[0], name="no spaces")]}, "tools[0].name"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
                        ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments")]:
        r = httpx.post(engine.url + "/v1/responses", json={"model": "spec", "input": "x", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
