"""responses.py's pure parts: Responses requests -> chat requests (tools, tool loop input items) and the
chat path's output events -> output items and stream events, validated with `openai.types.responses`."""
from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from consort_engine.serving import responses as R
from consort_engine.text import tool_calls as T
from consort_engine.serving.errors import ApiError

TOOL = {"type": "function", "name": "get_weather", "description": "forecast", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_function_tools_and_choice_map_onto_chat():
    chat = R.to_chat({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                      "parallel_tool_calls": False})
    assert chat["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in
                                                               ("name", "description", "parameters", "strict")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    tc = T.parse_tools(chat)
    assert (tc.mode, tc.name, tc.parallel) == ("named", "get_weather", False)
    assert R.to_chat({"input": "hi", "tools": [TOOL], "tool_choice": "required"})["tool_choice"] == "required"


def test_tool_loop_input_items_become_assistant_calls_and_tool_messages():
    chat = R.to_chat({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}],
        "tools": [TOOL]})
    user, assistant, tool1, tool2 = chat["messages"]
    assert assistant["content"] == "checking" and [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert tool1 == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"} and tool2["content"] == "rain"
    lone = R.to_chat({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})
    assert lone["messages"][0]["role"] == "assistant" and lone["messages"][0]["tool_calls"][0]["id"] == "c"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL, {"type": "file_search", "vector_store_ids": []}]}, "tools[1].type"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [dict(TOOL, name="bad name")]}, "tools[0].name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
])
def test_bad_tools_and_items_are_typed_400s_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        R.to_chat({"input": "hi", **body})
    assert e.value.status == 400 and e.value.param == param, e.value.body()


def stream_and_items(events: list[T.Event], body: dict) -> tuple[list[dict], dict]:
    """All stream events (numbered) and the final Response, each validated with the openai types."""
    from openai.types.responses import Response, ResponseStreamEvent
    out = R.OutputItems("resp_abc")
    evs = out.feed(events) + out.finish()
    numbered = [R.event(k, i, **f) for i, (k, f) in enumerate(evs)]
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in numbered:
        adapter.validate_python(e)
    final = R.response("resp_abc", "m", body, out.items, "completed", 0.0, "stop",
                       {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
    Response.model_validate(final)
    return numbered, final


def test_content_then_two_calls_stream_in_order_and_add_up_to_the_items():
    tc = T.ToolChoice([{"type": "function", "function": {"name": "f"}}], "auto")
    s = T.ToolCallStreamer(tc)
    text = 'Let me check.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' \
           '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'
    chat_events = [e for ch in text for e in s.feed(ch)] + s.finish()    # one character at a time
    events, final = stream_and_items(chat_events, {"tools": [{"type": "function", "name": "f"}]})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    msg, c1, c2 = final["output"]
    assert msg["content"][0]["text"] == "Let me check."
    assert [c1["name"], c1["arguments"], c2["arguments"]] == ["f", '{"a": 1}', '{"a": 2}']
    assert c1["call_id"].startswith("call_") and c1["call_id"] != c2["call_id"] and c1["id"] != c2["id"]
    assert final["tools"][0]["name"] == "f" and final["tool_choice"] == "auto"
    for idx, item in enumerate(final["output"]):   # each item: added, ..., done, at its own output_index
        mine = [e for e in events if e.get("output_index") == idx]
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert mine[-1]["item"] == item and mine[0]["item"]["status"] == "in_progress"
        if item["type"] == "function_call":
            deltas = "".join(e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta")
            assert deltas == item["arguments"] == mine[-2]["arguments"]
            assert mine[-2]["type"] == "response.function_call_arguments.done"
    assert [e["output_index"] for e in events if "output_index" in e] == sorted(
        e["output_index"] for e in events if "output_index" in e)


def test_a_pure_call_has_no_message_and_no_output_is_one_empty_message():
    tc = T.ToolChoice([{"type": "function", "function": {"name": "f"}}], "named", "f")
    s = T.ToolCallStreamer(tc)
    _, final = stream_and_items(s.feed('{"a"') + s.feed(': 1}') + s.finish(), {})
    assert [i["type"] for i in final["output"]] == ["function_call"] and final["output"][0]["arguments"] == '{"a": 1}'
    events, final = stream_and_items([], {})
    assert [i["type"] for i in final["output"]] == ["message"] and final["output"][0]["content"][0]["text"] == ""
    assert final["output"][0]["id"] == R.item_id("resp_abc") == "msg_abc"
