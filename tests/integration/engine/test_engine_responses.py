"""/v1/responses on a real `consort engine`, driven by the `openai` client: text in and out, streamed
and not, every object and event validated against `openai.types.responses`."""
from __future__ import annotations

import httpx
from pydantic import TypeAdapter

def event_adapter():
    from openai.types.responses import ResponseStreamEvent
    return TypeAdapter(ResponseStreamEvent)


def test_response_equals_the_chat_completion_it_means(engine, client):
    from openai.types.responses import Response
    r = client.responses.create(model="spec", input="sort a vector", instructions="be brief",
                                max_output_tokens=6, temperature=0)
    Response.model_validate(r.model_dump())
    chat = client.chat.completions.create(model="spec", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a vector"}])
    assert r.object == "response" and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"
    msgs = client.responses.create(model="spec", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}])
    chat2 = client.chat.completions.create(model="spec", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"}])
    assert msgs.output_text == chat2.choices[0].message.content


def test_streamed_events_validate_and_add_up_to_the_response(engine, client):
    adapter = event_adapter()
    kw = dict(model="spec", input="int main() {", max_output_tokens=8, temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    for e in events:
        adapter.validate_python(e.model_dump())
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text == events[-4].text
    assert events[-1].response.output_text == full.output_text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens


def test_unsupported_and_bad_input_are_typed_400s(engine):
    for body, param in [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({}, "input"), ({"input": []}, "input"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                         "input[0].content[0]"),
                        ({"input": "x", "instructions": 3}, "instructions")]:
        r = httpx.post(engine.url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
