"""The request models (one pydantic model per POST body): every limit is refused with a typed 400
naming the field, in OpenAI's error shape; unknown fields are ignored and reported on generation
bodies and refused on adapter loads; hostile shapes (huge lists, integers past int64, deep nesting)
are refused or ignored without a pydantic error or a crash."""
from __future__ import annotations

import json

import pytest

from consort_engine.serving.errors import ApiError
from consort_engine.serving.http import decode_json
from consort_engine.serving.limits import (MAX_CACHE_SALT_CHARS, MAX_CHOICES, MAX_DEADLINE_MS, MAX_GUIDED_CHARS,
                                           MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                           MAX_STOP_TOKEN_IDS, PRIORITY_RANGE, SEED_RANGE)
from consort_engine.serving.prepare import resolve_max_tokens
from consort_engine.serving.protocol import parse_chat, parse_completion
from consort_engine.serving.request_models import AdapterLoadBody, ChatBody, CompletionBody
from consort_engine.serving.responses import ResponsesBody
from consort_engine.serving.tokenize_request import parse_detokenize, parse_tokenize

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}

# (extra fields, the param the 400 names): each limit the engine enforces, just past its edge
LIMITS = [
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"²": 1}}, "logit_bias"),
    ({"logit_bias": {"1" * 13: 1}}, "logit_bias"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.0}, "top_k"),
    ({"priority": PRIORITY_RANGE[1] + 1}, "priority"),
    ({"priority": PRIORITY_RANGE[0] - 1}, "priority"),
    ({"seed": SEED_RANGE[1] + 1}, "seed"),
    ({"n": 0}, "n"),
    ({"n": MAX_CHOICES + 1}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"typical_p": 1.5}, "typical_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"deadline_ms": 0}, "deadline_ms"),
    ({"deadline_ms": MAX_DEADLINE_MS + 1}, "deadline_ms"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "include_usage"),
    ({"model": 7}, "model"),
    ({"user": ["u"]}, "user"),
    ({"adapter": 1}, "adapter"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "x" * (MAX_GUIDED_CHARS + 1)}, "guided_grammar"),
    ({"guided_regex": "a", "guided_grammar": "b"}, "guided_grammar"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
]


def refused(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body)
    err = e.value
    assert err.status == 400 and set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert err.body()["error"]["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize("extra,param", LIMITS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(LIMITS)])
def test_each_limit_is_a_typed_400_naming_the_field_on_both_endpoints(extra, param):
    for parse, base in ((parse_completion, COMPLETION), (parse_chat, CHAT)):
        err = refused(parse, {**base, **extra})
        assert err.param == param, (parse.__name__, err.body())
        assert err.code in ("invalid_type", "invalid_value", "unsupported_value", "missing_field"), err.body()


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "best_of": MAX_CHOICES + 1}, "best_of"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": ["a", "b", "c"], "n": MAX_CHOICES // 2}, "n"),
    ({"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({}, "prompt"),
])
def test_completion_only_limits(body, param):
    assert refused(parse_completion, body).param == param


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_chat_only_limits(body, param):
    assert refused(parse_chat, body).param == param


def test_unknown_fields_are_ignored_and_reported_known_ones_are_not():
    req = parse_chat({**CHAT, "frobnicate": 1, "stream_options": {"include_usage": True, "extra": 1},
                      "metadata": {"k": "v"}})
    assert req.ignored_fields == ["frobnicate", "stream_options.extra"] and req.include_usage
    assert parse_completion({**COMPLETION, "response_format": {"type": "text"}}).ignored_fields == []
    assert set(CompletionBody.model_fields) > {"prompt", "best_of", "echo", "suffix", "stop", "priority"}
    assert "messages" in ChatBody.model_fields and "messages" not in CompletionBody.model_fields


def test_adapter_load_refuses_unknown_fields_and_bad_names():
    assert AdapterLoadBody.model_validate({"name": "sql-v2", "path": "/a"}).name == "sql-v2"
    for body, code, param in [({"name": "a", "path": "/a", "x": 1}, "unknown_field", "x"),
                              ({"name": "Bad_Name", "path": "/a"}, "invalid_name", "name"),
                              ({"path": "/a"}, "invalid_name", "name"),
                              ({"name": "a" * 64, "path": "/a"}, "invalid_name", "name"),
                              ({"name": "a"}, "invalid_path", "path"),
                              ({"name": "a", "path": 3}, "invalid_path", "path")]:
        with pytest.raises(ApiError) as e:
            AdapterLoadBody.model_validate(body)
        assert (e.value.status, e.value.code, e.value.param) == (400, code, param)
    with pytest.raises(ApiError) as e:
        AdapterLoadBody.model_validate([1])
    assert e.value.code == "invalid_request"


def test_tokenize_and_detokenize_bodies():
    assert parse_tokenize({"prompt": "x"}).add_special_tokens is True
    assert parse_tokenize({**CHAT}).add_special_tokens is False
    for body, param in [({"prompt": "x", **CHAT}, "prompt"), ({}, "prompt"), ({"prompt": 3}, "prompt"),
                        ({"messages": []}, "messages"), ({"prompt": "x", "return_token_strs": 1}, "return_token_strs")]:
        assert refused(parse_tokenize, body).param == param
    assert parse_detokenize({"tokens": [1, 2]}).tokens == [1, 2]
    for body in ({}, {"tokens": [1, "2"]}, {"tokens": [True]}, {"tokens": "12"}):
        assert refused(parse_detokenize, body).param == "tokens"


def test_responses_body_maps_to_chat_and_refuses_what_it_cannot_serve():
    chat = ResponsesBody.model_validate({"input": "hi", "instructions": "be brief", "max_output_tokens": 5}).chat()
    assert chat == {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    "max_tokens": 5}
    for body, param in [({}, "input"), ({"input": "x", "previous_response_id": "r"}, "previous_response_id"),
                        ({"input": "x", "instructions": 1}, "instructions"), ({"input": ""}, "input"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type")]:
        assert refused(ResponsesBody.model_validate, body).param == param


@pytest.mark.parametrize("body,param", [
    ({"n": 2 ** 64}, "n"),
    ({"seed": 2 ** 64}, "seed"),
    ({"priority": -(2 ** 64)}, "priority"),
    ({"temperature": 10 ** 400}, "temperature"),        # past any float: not a finite number
    ({"top_p": float("nan")}, "top_p"),
    ({"logit_bias": {"1": float("inf")}}, "logit_bias"),
    ({"stop_token_ids": [2 ** 64]}, None),               # an int: bounded by the vocabulary (prepare.check_vocab)
    ({"stop": ["x"] * 1_000_000}, "stop"),
    ({"stop_token_ids": list(range(1_000_000))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 0 for i in range(100_000)}}, "logit_bias"),
])
def test_hostile_numbers_and_huge_lists_are_refused_without_work(body, param):
    if param is None:
        assert parse_completion({**COMPLETION, **body}).sampling.stop_token_ids == [2 ** 64]
        return
    assert refused(parse_completion, {**COMPLETION, **body}).param == param


def test_a_huge_max_tokens_is_refused_against_the_context():
    req = parse_completion({**COMPLETION, "max_tokens": 2 ** 64})
    with pytest.raises(ApiError) as e:
        resolve_max_tokens(req, 3, 2048)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")


def test_deep_nesting_and_many_unknown_keys():
    with pytest.raises(ApiError) as e:      # deeper than the JSON parser goes: a typed 400, not a 500
        decode_json(b"[" * 5000 + b"]" * 5000)
    assert (e.value.status, e.value.code) == (400, "invalid_json")
    deep: object = "x"
    for _ in range(900):                    # as deep as a body that parses can be
        deep = [deep]
    deep_body = decode_json(json.dumps({**COMPLETION, "extra": deep}).encode())
    # an unknown field nested deep is ignored whole (never walked); a deep value in a known field is refused
    assert parse_completion(deep_body).ignored_fields == ["extra"]
    assert refused(parse_completion, {**COMPLETION, "stop": deep}).param == "stop"
    assert refused(parse_chat, {"messages": [{"role": "user", "content": deep}]}).param == "messages[0].content"
    assert refused(parse_completion, {**COMPLETION, "guided_json": "[" * 900 + "]" * 900}).param == "guided_json"
    assert parse_completion({**COMPLETION, "guided_json": {"a": deep}}).sampling.guided.kind == "json_schema"
    many = {f"k{i}": i for i in range(350_000)}
    req = parse_completion({**COMPLETION, **many})
    assert len(req.ignored_fields) == 350_000 and req.ignored_fields[0] == "k0"
