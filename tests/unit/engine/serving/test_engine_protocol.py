"""Request parsing and validation of the engine's OpenAI surface (consort_engine.serving.protocol)."""
from __future__ import annotations

import pytest

from consort_engine.serving.errors import ApiError, admission_error
from consort_engine.serving.limits import (MAX_CACHE_SALT_CHARS, MAX_DEADLINE_MS, MAX_GUIDED_CHARS, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE, PRIORITY_RANGE, SEED_RANGE)
from consort_common.block_hash import prefix_salt
from consort_engine.serving.prepare import check_vocab, resolve_max_tokens
from consort_engine.serving.generation import prompt_logprobs_width
from consort_engine.serving.protocol import parse_chat, parse_completion
from consort_engine.serving.render_completions import (best_indices, completion_logprobs, prompt_token_logprobs,
                                                       vllm_prompt_logprobs)


def err(fn, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    return e.value


def test_completion_defaults_and_extensions():
    r = parse_completion({"model": "m", "prompt": "hi", "temperature": 0, "stop": "\n", "priority": 3,
                            "deadline_ms": 250, "return_token_ids": True, "logprobs": 2, "seed": 7,
                            "stream": True, "stream_options": {"include_usage": True}, "top_k": -1,
                            "user": "u", "presence_penalty": 0})
    assert r.prompt == "hi" and r.max_tokens == 16 and r.sampling.greedy and r.sampling.stop == ["\n"]
    assert (r.priority, r.deadline_ms, r.return_token_ids, r.logprobs, r.sampling.seed) == (3, 250.0, True, 2, 7)
    assert r.stream and r.include_usage and r.sampling.top_k == 0


def test_prompt_forms():
    assert parse_completion({"prompt": [1, 2, 3]}).prompt_token_ids == [1, 2, 3]
    assert parse_completion({"prompt": ["x"]}).prompt == "x"
    assert parse_completion({"prompt": [[4, 5]]}).prompt_token_ids == [4, 5]
    several = parse_completion({"prompt": ["a", [7, 8]], "n": 3, "best_of": 3})
    assert several.prompts == ["a", [7, 8]] and several.n == 3 and several.prompt == "a"
    assert err(parse_completion, {"prompt": ["a", ""]}).code == "empty_prompt"
    assert err(parse_completion, {"prompt": ["a", "b"], "n": 40}).param == "n"          # 80 choices > 64
    ranked = parse_completion({"prompt": "a", "n": 2, "best_of": 4})
    assert (ranked.n, ranked.best_of, ranked.samples) == (2, 4, 4)
    assert parse_completion({"prompt": "a", "n": 2, "best_of": 2}).best_of is None     # best_of == n: plain n
    assert err(parse_completion, {"prompt": "a", "n": 3, "best_of": 2}).code == "invalid_value"
    assert err(parse_completion, {"prompt": "a", "best_of": 3, "stream": True}).code == "unsupported_value"
    assert err(parse_completion, {"prompt": ["a", "b"], "best_of": 40}).param == "best_of"   # 80 samples > 64
    assert err(parse_completion, {"prompt": ""}).code == "empty_prompt"
    assert err(parse_completion, {"prompt": []}).code == "empty_prompt"
    assert err(parse_completion, {"prompt": [1, "a"]}).code == "invalid_type"
    assert err(parse_completion, {}).code == "missing_field"


@pytest.mark.parametrize("body,code,param", [
    ({"prompt": "x", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "invalid_value", "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "invalid_type", "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "invalid_type", "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "invalid_type", "temperature"),
    ({"prompt": "x", "temperature": -1}, "invalid_value", "temperature"),
    ({"prompt": "x", "top_p": 0}, "invalid_value", "top_p"),
    ({"prompt": "x", "n": 0}, "invalid_value", "n"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "invalid_value", "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": "lots"}, "invalid_type", "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "invalid_value", "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "invalid_value", "min_p"),
    ({"prompt": "x", "logit_bias": ["5"]}, "invalid_type", "logit_bias"),
    ({"prompt": "x", "logit_bias": {"the": 1}}, "invalid_value", "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "invalid_value", "logit_bias"),
    ({"prompt": "x", "stop": [""]}, "invalid_value", "stop"),
    ({"prompt": "x", "stop": 5}, "invalid_type", "stop"),
    ({"prompt": "x", "logprobs": 21}, "invalid_value", "logprobs"),
    ({"prompt": "x", "deadline_ms": 0}, "invalid_value", "deadline_ms"),
    ({"prompt": "x", "prompt_logprobs": 21}, "invalid_value", "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "unsupported_value", "prompt_logprobs"),
])
def test_completion_rejects(body, code, param):
    e = err(parse_completion, body)
    assert (e.status, e.code, e.param) == (400, code, param)
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_prompt_logprobs_width():
    """echo + logprobs k and vLLM's prompt_logprobs k ask the engine for the prompt's logprobs (the wider)."""
    width = lambda body: prompt_logprobs_width(parse_completion({"prompt": "x", **body}))
    assert width({"echo": True, "logprobs": 2}) == 2
    assert width({"logprobs": 2}) is None and width({"echo": True}) is None
    assert width({"echo": True, "logprobs": 0}) == 0
    assert width({"prompt_logprobs": 4, "logprobs": 1, "echo": True}) == 4
    assert width({"prompt_logprobs": 1, "logprobs": 3, "echo": True}) == 3
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0})
    assert prompt_logprobs_width(chat) == 0 and not chat.ignored_fields


def test_prompt_logprob_shapes():
    """Echo items: the first prompt token None, then top-k cut to the request's k; vLLM's prompt_logprobs:
    the prompt token itself first (its own rank), then the top-k not already there."""
    from consort_engine.kv.sequence import PromptLogprobs
    plp = PromptLogprobs([-0.5, -3.0], [1, 4], [[7, 8, 9], [7, 8, 9]], [[-0.5, -1.0, -2.0], [-0.2, -1.5, -2.5]])
    items = prompt_token_logprobs([5, 7, 6], plp, 2)
    assert [(i.token_id, i.logprob, i.top) for i in items] == [
        (5, None, []), (7, -0.5, [(7, -0.5), (8, -1.0)]), (6, -3.0, [(7, -0.2), (8, -1.5)])]
    text = lambda t: f"<{t}>"
    lp = completion_logprobs(items, text, 0)
    assert lp["token_logprobs"] == [None, -0.5, -3.0] and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 3, 6] and lp["tokens"] == ["<5>", "<7>", "<6>"]
    vl = vllm_prompt_logprobs([5, 7, 6], plp, 2, text)
    assert vl[0] is None
    assert vl[1] == {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
                     "8": {"logprob": -1.0, "rank": 2, "decoded_token": "<8>"}}
    assert list(vl[2]) == ["6", "7", "8"] and vl[2]["6"]["rank"] == 4 and vl[2]["7"]["rank"] == 1


def test_unknown_fields_are_ignored_and_reported_known_unsupported_ones_stay_400():
    r = parse_completion({"prompt": "x", "bogus": 1, "stream_options": {"include_usage": True, "nope": True}})
    assert r.ignored_fields == ["bogus", "stream_options.nope"] and r.include_usage
    assert err(parse_completion, {"prompt": "x", "bogus": 1, "suffix": "z"}).param == "suffix"


def test_chat_parsing():
    r = parse_chat({"messages": [{"role": "system", "content": "s"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3})
    assert r.messages[1]["content"] == "ab" and r.max_tokens == 5 and r.logprobs == 3
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).max_tokens is None
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}).logprobs is None
    assert err(parse_chat, {"messages": []}).code == "empty_prompt"
    assert err(parse_chat, {"messages": [{"role": "wizard", "content": "x"}]}).param == "messages[0].role"
    assert err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).code == "invalid_value"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt": "y"}).ignored_fields == ["prompt"]
    assert err(parse_chat, [1, 2]).code == "invalid_json"


def test_context_window():
    r = parse_completion({"prompt": "x", "max_tokens": 10})
    assert resolve_max_tokens(r, 90, 100) == 10
    e = pytest.raises(ApiError, resolve_max_tokens, r, 91, 100).value
    assert (e.code, e.status) == ("context_length_exceeded", 400)
    assert pytest.raises(ApiError, resolve_max_tokens, r, 100, 100).value.param == "prompt"
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert resolve_max_tokens(chat, 30, 100) == 70


def test_admission_error_shape():
    e = admission_error("kv_capacity", 1200.2, "pool full")
    assert e.status == 429 and e.headers() == {"Retry-After": "2"}
    assert e.body() == {"error": {"type": "admission_rejected", "code": "kv_capacity", "message": "pool full",
                                  "param": None, "retry_after_ms": 1201}}
    assert admission_error("queue_full", 0, "").headers() == {"Retry-After": "1"}


def test_penalties_min_p_and_logit_bias_reach_the_sampling_params():
    req = parse_completion({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                              "min_p": 0.1, "logit_bias": {"7": -100, "12": 2.5}})
    sp = req.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == (0.5, -1.0, 1.3, 0.1)
    assert sp.logit_bias == {7: -100.0, 12: 2.5} and sp.penalized
    assert not parse_completion({"prompt": "x", "min_p": 0.2}).sampling.penalized   # min_p is a warper


def test_best_indices_keeps_the_highest_cumulative_logprobs_in_sampling_order():
    assert best_indices([-3.0, -1.0, -2.0, -0.5], 2) == [1, 3]
    assert best_indices([-1.0, -1.0, -1.0], 2) == [0, 1]      # ties: the earlier samples
    assert best_indices([-2.0], 1) == [0]


# Request limits (issue 25): every list, number and string is bounded before work starts.
HUGE = 10 ** 400     # a JSON integer beyond any float: math.isfinite overflowed on it (a 500)


@pytest.mark.parametrize("body,code,param", [
    ({"stop": ["s%d" % i for i in range(MAX_STOP_STRINGS + 1)]}, "invalid_value", "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "invalid_value", "stop"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "invalid_value", "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {"1" * 5000: 1}}, "invalid_value", "logit_bias"),     # int() refuses 4,300+ digits
    ({"logit_bias": {"\u00b2": 1}}, "invalid_value", "logit_bias"),        # "²".isdigit(), int("²") raises
    ({"logit_bias": {"5": HUGE}}, "invalid_value", "logit_bias"),
    ({"seed": 1 << 63}, "invalid_value", "seed"),
    ({"seed": -(1 << 63) - 1}, "invalid_value", "seed"),
    ({"priority": 10 ** 18}, "invalid_value", "priority"),
    ({"priority": PRIORITY_RANGE[0] - 1}, "invalid_value", "priority"),
    ({"deadline_ms": HUGE}, "invalid_type", "deadline_ms"),
    ({"deadline_ms": MAX_DEADLINE_MS + 1}, "invalid_value", "deadline_ms"),
    ({"temperature": HUGE}, "invalid_type", "temperature"),
    ({"temperature": float("nan")}, "invalid_type", "temperature"),
    ({"top_p": float("inf")}, "invalid_type", "top_p"),
    ({"min_p": float("nan")}, "invalid_type", "min_p"),
    ({"typical_p": -HUGE}, "invalid_type", "typical_p"),
    ({"presence_penalty": float("-inf")}, "invalid_type", "presence_penalty"),
    ({"repetition_penalty": 1e-300}, "invalid_value", "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "invalid_value", "repetition_penalty"),
    ({"top_k": -2}, "invalid_value", "top_k"),
    ({"n": HUGE}, "invalid_value", "n"),
    ({"best_of": HUGE}, "invalid_value", "best_of"),
    ({"logprobs": HUGE}, "invalid_value", "logprobs"),
    ({"prompt_logprobs": HUGE}, "invalid_value", "prompt_logprobs"),
    ({"guided_regex": "a" * (MAX_GUIDED_CHARS + 1)}, "invalid_value", "guided_regex"),
    ({"guided_choice": ["c" * 1000] * 70}, "invalid_value", "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
     "invalid_value", "response_format.json_schema.schema"),
])
def test_request_limits_are_typed_400s_naming_the_field(body, code, param):
    e = err(parse_completion, {"prompt": "x", **body})
    assert (e.status, e.code, e.param) == (400, code, param), e.message


def test_limits_at_their_bounds_are_accepted():
    lo_seed, hi_seed = SEED_RANGE
    r = parse_completion({"prompt": "x", "stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
                            "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS, "seed": hi_seed,
                            "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)},
                            "priority": PRIORITY_RANGE[1], "deadline_ms": MAX_DEADLINE_MS,
                            "repetition_penalty": 100, "top_k": 10 ** 30})
    assert len(r.sampling.stop) == MAX_STOP_STRINGS and r.sampling.seed == hi_seed and r.priority == 1000
    assert parse_completion({"prompt": "x", "seed": lo_seed, "priority": -1000}).sampling.seed == lo_seed


def test_a_tiny_temperature_runs_at_vllms_floor():
    assert parse_completion({"prompt": "x", "temperature": 1e-300}).sampling.temperature == MIN_TEMPERATURE
    assert parse_completion({"prompt": "x", "temperature": 0}).sampling.greedy
    assert parse_completion({"prompt": "x", "temperature": 0.7}).sampling.temperature == 0.7


def test_check_vocab_bounds_ids_and_turns_top_k_above_the_vocabulary_off():
    def sp(**body):
        return parse_completion({"prompt": "x", **body}).sampling
    big = sp(top_k=2 ** 64)
    check_vocab(big, 1000)
    assert big.top_k == 0                     # vLLM: top_k >= vocab is no top-k; no huge int reaches a tensor
    kept = sp(top_k=999)
    check_vocab(kept, 1000)
    assert kept.top_k == 999
    for body, param in (({"logit_bias": {"1000": 1}}, "logit_bias"), ({"stop_token_ids": [2 ** 70]}, "stop_token_ids"),
                        ({"stop_token_ids": [-1]}, "stop_token_ids")):
        with pytest.raises(ApiError) as e:
            check_vocab(sp(**body), 1000)
        assert (e.value.code, e.value.param) == ("invalid_value", param)


def test_tool_choice_schemas_are_bounded_too():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}
    e = err(parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"})
    assert (e.code, e.param) == ("invalid_value", "tools")


def test_cache_salt_is_bounded_and_salts_by_tenant():
    """vLLM's cache_salt is accepted (1..MAX_CACHE_SALT_CHARS characters); the prefix salt combines it
    with the router's tenant, unambiguously, and is None only when neither is given."""
    req = parse_completion({"prompt": "x", "cache_salt": "s1"})
    assert req.cache_salt == "s1" and "cache_salt" not in req.ignored_fields
    for bad_salt in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 5):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": "x", "cache_salt": bad_salt})
        assert e.value.status == 400 and e.value.param == "cache_salt"
    assert prefix_salt(None, None) is None
    salts = {prefix_salt(t, s) for t, s in [("a", None), ("b", None), ("a", "s"), (None, "s"), ("a|", "s"),
                                             ("a", "|s")]}
    assert len(salts) == 6 and None not in salts
