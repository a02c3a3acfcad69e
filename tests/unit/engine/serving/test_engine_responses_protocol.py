"""The /v1/responses translation: a Responses request as the chat request it means, and the Response
object that validates against the `openai` package's type."""
from __future__ import annotations

import pytest
from openai.types.responses import Response

from consort_engine.serving import responses as R
from consort_engine.serving.errors import ApiError
from consort_engine.serving.protocol import parse_chat


def test_input_and_instructions_become_chat_messages():
    chat = R.to_chat({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 7,
                      "temperature": 0.5, "top_p": 0.9, "stream": True, "store": False, "metadata": {"a": "b"}})
    assert chat == {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    "model": "m", "temperature": 0.5, "top_p": 0.9, "stream": True, "max_tokens": 7}
    listed = R.to_chat({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]})
    assert listed["messages"] == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]
    assert parse_chat(listed).messages[0]["content"] == "ab"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": 3}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": "x", "instructions": ["no"]}, "instructions"),
])
def test_unsupported_and_malformed_requests_are_typed_400s(body, param):
    with pytest.raises(ApiError) as e:
        R.to_chat(body)
    assert e.value.status == 400 and e.value.param == param


ABC = [R.message("msg_1", "abc", "completed")]


def test_response_object_validates_and_marks_length_as_incomplete():
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 2}}
    done = Response.model_validate(R.response("resp_1", "m", {"input": "x"}, ABC, "completed", 1.0, "stop", usage))
    assert done.status == "completed" and done.output_text == "abc"
    assert (done.usage.input_tokens_details.cached_tokens, done.usage.input_tokens_details.cache_write_tokens) == (2, 3)
    cut = Response.model_validate(R.response("resp_1", "m", {"max_output_tokens": 3}, ABC, "completed", 1.0,
                                             "length", usage))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert Response.model_validate(R.response("resp_1", "m", {}, None, "in_progress", 1.0)).output == []
