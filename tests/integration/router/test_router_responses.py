"""/v1/responses through the router with the real `openai` client: routed like chat (classified on the
input text), streamed and not, every object and event validated against `openai.types.responses`."""
from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from conftest import router_config

pytestmark = pytest.mark.timeout(300)

SFINAE = ("template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>> void f(T); "
          "std::enable_if<true>::type and decltype(std::declval<T>()) with SFINAE and void_t")


def test_responses_route_like_chat_and_validate(engines, make_router):
    from openai.types.responses import Response, ResponseStreamEvent

    r = make_router(router_config(engines))
    c = r.client()
    raw = c.responses.with_raw_response.create(model="cpp", input=SFINAE, instructions="explain",
                                               max_output_tokens=6, temperature=0)
    resp = raw.parse()
    Response.model_validate(resp.model_dump())
    chat = c.chat.completions.with_raw_response.create(model="cpp", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "explain"}, {"role": "user", "content": SFINAE}])
    assert raw.headers["x-consort-specialist"] == chat.headers["x-consort-specialist"] == "Template"
    assert resp.output_text == chat.parse().choices[0].message.content
    assert resp.usage.output_tokens == chat.parse().usage.completion_tokens

    adapter = TypeAdapter(ResponseStreamEvent)
    events = list(c.responses.create(model="STL", input=[{"role": "user", "content": "std::vector<int> v;"}],
                                     max_output_tokens=5, temperature=0, stream=True))
    for e in events:
        adapter.validate_python(e.model_dump())
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    direct = c.responses.create(model="STL", input="std::vector<int> v;", max_output_tokens=5, temperature=0)
    assert direct.output_text == deltas


def test_responses_errors_are_typed_through_the_router(engines, make_router):
    r = make_router(router_config(engines))
    for body, code, param in [({"model": "cpp"}, "missing_field", "input"),
                              ({"model": "cpp", "input": 3}, "invalid_type", "input"),
                              ({"model": "STL", "input": "x", "previous_response_id": "resp_1"}, "unsupported_value",
                               "previous_response_id")]:
        res = r.post("/v1/responses", body)
        assert res.status_code == 400, res.text
        assert (res.json()["error"]["code"], res.json()["error"]["param"]) == (code, param)


def test_responses_function_tools_through_the_router(engines, make_router):
    """Flat function tools pass through: a named call as a function_call item, streamed events in order."""
    import json
    from openai.types.responses import Response, ResponseStreamEvent

    tool = {"type": "function", "name": "lookup", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["q"],
        "properties": {"q": {"type": "string", "maxLength": 10}}}}
    c = make_router(router_config(engines)).client()
    kw = dict(model="STL", input="std::vector<int> v;", tools=[tool], tool_choice={"type": "function", "name": "lookup"},
              max_output_tokens=48, temperature=0)
    r = c.responses.create(**kw)
    Response.model_validate(r.model_dump())
    assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "lookup"
    assert set(json.loads(r.output[0].arguments)) == {"q"}
    adapter = TypeAdapter(ResponseStreamEvent)
    events = list(c.responses.create(stream=True, **kw))
    for e in events:
        adapter.validate_python(e.model_dump())
    assert [e.type for e in events][-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                              "response.completed"]
    assert events[-3].arguments == r.output[0].arguments
    back = c.responses.create(model="STL", max_output_tokens=4, temperature=0, tools=[tool], tool_choice="none",
                              input=[{"role": "user", "content": "std::vector<int> v;"},
                                     r.output[0].model_dump(exclude_none=True),
                                     {"type": "function_call_output", "call_id": r.output[0].call_id, "output": "ok"}])
    assert back.output[0].type == "message" and back.usage.input_tokens > r.usage.input_tokens
