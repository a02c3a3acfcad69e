"""Tools: request validation, the Hermes/Qwen tool-call parser (whole text and streamed in any
split), the guided schemas for `required` / named choice (real xgrammar on the demo tokenizer), and
chat-template rendering of tools, assistant tool calls and tool results."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from consort_engine.text import tool_calls as T
from consort_engine.demo_model import write_demo_model
from consort_engine.text.guided import Grammars
from consort_engine.text.tokenizer import Tokenizer
from consort_engine.serving.errors import ApiError
from consort_engine.serving.fields import check_message
from consort_engine.serving.protocol import parse_chat

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
CHAT = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}


def auto() -> T.ToolChoice:
    return T.parse_tools({"tools": TOOLS})


def calls_of(p: T.ParsedOutput) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.tool_calls]


def streamed(tc: T.ToolChoice, text: str, seed: int) -> tuple[T.ParsedOutput, list]:
    """The text fed in random pieces of 1-7 characters (tags and JSON split anywhere)."""
    rng, s, events, i = random.Random(seed), T.ToolCallStreamer(tc), [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        events += s.feed(text[i:i + k])
        i += k
    events += s.finish()
    return T.assemble(events), events


# ---------------------------------------------------------------------------------------------
# request side


def test_parse_chat_accepts_tools_and_each_choice():
    r = parse_chat(CHAT)
    assert r.tools.mode == "auto" and r.tools.parallel and r.sampling.guided is None
    assert parse_chat({**CHAT, "tool_choice": "none"}).tools.mode == "none"
    req = parse_chat({**CHAT, "tool_choice": "required", "parallel_tool_calls": False})
    assert (req.tools.mode, req.tools.parallel, req.sampling.guided.param) == ("required", False, "tools")
    named = parse_chat({**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.tools.name == "get_weather" and json.loads(named.sampling.guided.spec) == WEATHER
    assert parse_chat({**CHAT, "tools": []}).tools is None
    assert parse_chat({"messages": CHAT["messages"], "tool_choice": "none"}).tools is None


@pytest.mark.parametrize("extra,code,param", [
    ({"tools": {"type": "function"}}, "invalid_type", "tools"),
    ({"tools": ["f"]}, "invalid_type", "tools[0]"),
    ({"tools": [{"type": "code_interpreter"}]}, "invalid_value", "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "invalid_type", "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "invalid_value", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "invalid_value", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "invalid_type",
     "tools[0].function.parameters"),
    ({"tools": TOOLS + [TOOLS[1]]}, "invalid_value", "tools[2].function.name"),
    ({"tool_choice": "sometimes"}, "invalid_value", "tool_choice"),
    ({"tool_choice": 3}, "invalid_type", "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "invalid_value",
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function"}}, "invalid_value", "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "invalid_type", "parallel_tool_calls"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "invalid_value", "tool_choice"),
])
def test_bad_tool_fields_are_typed_400s(extra, code, param):
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, **extra})
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


def test_required_or_named_without_tools_is_a_400_and_history_tool_calls_are_checked():
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": CHAT["messages"], "tool_choice": "required"})
    assert e.value.param == "tool_choice"
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": 1}]}]})
    assert e.value.param == "messages[0].tool_calls[0]"


# ---------------------------------------------------------------------------------------------
# the Hermes parser (auto)

ONE = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b\\"{", "days": 1, "x": {"y": [1, "}"]}}}\n'
       '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n')


def test_one_call_with_leading_content():
    p = T.parse_output(auto(), ONE)
    assert p.content == "Let me look."
    assert calls_of(p) == [("get_weather", {"city": "Paris", "days": 3})]
    c = p.tool_calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10
    assert c["function"]["arguments"] == '{"city": "Paris", "days": 3}'      # as the model wrote it


def test_several_calls_braces_inside_strings_and_no_content():
    p = T.parse_output(auto(), TWO)
    assert p.content is None
    assert calls_of(p) == [("get_weather", {"city": 'a}b"{', "days": 1, "x": {"y": [1, "}"]}}), ("now", {})]
    assert len({c["id"] for c in p.tool_calls}) == 2


def test_malformed_json_and_stray_tags_stay_content():
    text = 'before <tool_call>{"name": get_weather}</tool_call> after'
    assert T.parse_output(auto(), text) == T.ParsedOutput(text, [])
    text = 'a <tool_call>{"arguments": {}}</tool_call>'        # no name: not a call
    assert T.parse_output(auto(), text).content == text
    plain = "no calls here, a < sign and a <tool_ word  \n"
    assert T.parse_output(auto(), plain) == T.ParsedOutput(plain, [])


def test_one_good_call_among_bad_and_an_unterminated_last_call():
    p = T.parse_output(auto(), 'x <tool_call>nope</tool_call> <tool_call>{"name": "now", "arguments": {}}')
    assert p.content == "x <tool_call>nope</tool_call>" and calls_of(p) == [("now", {})]


@pytest.mark.parametrize("text", [ONE, TWO, "text then <tool_call>{bad}</tool_call> and more",
                                  "plain text with a trailing <tool_c", "<tool_call>\n{\"name\": \"now\", \"arguments\""
                                  ": {\"a\": \"</tool\"}}</tool_call> tail text"])
def test_streamed_in_any_split_reassembles_to_the_whole_parse(text):
    whole = T.parse_output(auto(), text)
    for seed in range(60):
        got, _ = streamed(auto(), text, seed)
        assert got.content == whole.content, seed
        assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls], seed


def test_stream_sends_index_id_name_first_then_argument_fragments():
    _, events = streamed(auto(), TWO, seed=3)
    deltas = [d for kind, d in events if kind == "tool_call"]
    first = deltas[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather"}
    frags = [d for d in deltas if d["index"] == 0][1:]
    assert len(frags) > 3 and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                                  for d in frags)
    assert json.loads("".join(d["function"]["arguments"] for d in frags))["city"] == 'a}b"{'
    second = [d for d in deltas if d["index"] == 1]
    assert second[0]["function"] == {"name": "now"} and second[0]["id"] != first["id"]


def test_no_tag_text_is_released_as_content_while_a_split_tag_is_held():
    s = T.ToolCallStreamer(auto())
    assert s.feed("hello <tool") == [("content", "hello")]
    assert s.feed("_call>{\"name\": \"now\", ") == []
    ev = s.feed("\"arguments\": {}}</tool_call>")
    assert [k for k, _ in ev] == ["tool_call", "tool_call"] and s.called
    assert T.finish_reason(auto(), s.called, "stop") == "tool_calls"
    assert T.finish_reason(auto(), s.called, "length") == "length"
    assert T.finish_reason(auto(), False, "stop") == "stop"


# ---------------------------------------------------------------------------------------------
# required / named: guided JSON, no tags


def test_required_output_is_an_array_of_calls_and_streams_the_same():
    tc = T.parse_tools({"tools": TOOLS, "tool_choice": "required"})
    text = '[{"name": "get_weather", "arguments": {"city": "x]}\\\\", "days": 2}}, {"name": "now", "arguments": {}}]'
    whole = T.parse_output(tc, text)
    assert whole.content is None
    assert calls_of(whole) == [("get_weather", {"city": "x]}\\", "days": 2}), ("now", {})]
    for seed in range(30):
        got, _ = streamed(tc, text, seed)
        assert [c["function"] for c in got.tool_calls] == [c["function"] for c in whole.tool_calls]
    one = T.parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert calls_of(T.parse_output(one, '{"name": "now", "arguments": {}}')) == [("now", {})]
    cut = T.parse_output(tc, '[{"name": "now", "arguments": {}}, {"name": "get_w')   # max_tokens hit
    assert calls_of(cut) == [("now", {})] and cut.content == '{"name": "get_w'


def test_named_output_is_the_arguments():
    tc = T.parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    got, events = streamed(tc, '{"city": "Oslo", "days": 4}', seed=1)
    assert calls_of(got) == [("get_weather", {"city": "Oslo", "days": 4})] and got.content is None
    assert events[0][1]["function"] == {"name": "get_weather"}
    assert T.finish_reason(tc, True, "stop") == "stop"            # OpenAI and vLLM: a forced call ends "stop"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("tools") / "demo", seed=0)


@pytest.fixture(scope="module")
def grammars(demo) -> Grammars:
    tok = Tokenizer.from_dir(demo)
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    return Grammars(tok.hf, vocab, [tok.hf.token_to_id(tok.eos_token)])


def _accepts(grammars: Grammars, tok: Tokenizer, spec, text: str) -> bool:
    m = grammars.matcher(spec)
    return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_terminated() is False \
        and m.accept_token(tok.hf.token_to_id(tok.eos_token))


def test_guided_schemas_compile_and_accept_exactly_calls_of_the_tools(grammars, demo):
    tok = Tokenizer.from_dir(demo)
    req = T.guided_schema(T.parse_tools({"tools": TOOLS, "tool_choice": "required"}))
    good = '[{"name": "get_weather", "arguments": {"city": "x", "days": 2}}, {"name": "now", "arguments": {}}]'
    assert _accepts(grammars, tok, req, good)
    assert not _accepts(grammars, tok, req, '[{"name": "other", "arguments": {}}]')
    assert not _accepts(grammars, tok, req, '[]')
    schema = json.loads(req.spec)
    jsonschema.validate(json.loads(good), schema)
    named = T.guided_schema(T.parse_tools({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                            "function": {"name": "now"}}}))
    assert named.param == "tools[1].function.parameters" and _accepts(grammars, tok, named, "{}")


# ---------------------------------------------------------------------------------------------
# prompt side

HISTORY = [{"role": "system", "content": "be brief"},
           {"role": "user", "content": "weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris", "days": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "warm"}]


def test_template_without_tools_gets_the_hermes_block_calls_and_responses(demo):
    tok = Tokenizer.from_dir(demo)               # the demo template knows nothing of tools
    msgs = [check_message(i, m) for i, m in enumerate(HISTORY)]
    text = tok.apply_chat_template(msgs, tools=TOOLS)
    assert text.startswith("<|system|>\nbe brief\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
            '</tool_call><|end|>') in text
    assert "<|user|>\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|end|>" in text
    assert text.endswith("<|assistant|>\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<tools>" not in plain and tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS) \
        .startswith("<|system|>\n# Tools")


QWEN_LIKE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
             "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
             "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>"
             "{% endfor %}{% endfor %}")


def test_template_that_knows_tools_gets_them_and_arguments_as_objects(demo):
    tok = Tokenizer.from_dir(demo)
    tok.chat_template, tok._compiled = QWEN_LIKE, None
    text = tok.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=False)
    assert text.startswith("TOOLS:get_weather;now;[system]be brief[user]")
    assert '<call get_weather {"city": "Paris", "days": 1}>' in text      # an object, not a JSON string
    assert text.endswith("[tool]sunny[tool]warm") and "# Tools" not in text


def test_a_call_whose_head_streamed_stays_a_call_when_its_json_breaks_later():
    text = '<tool_call>{"name": "now", "arguments": {"a": 1,, }}</tool_call> ok'
    s = T.ToolCallStreamer(auto())
    events = s.feed(text[:42]) + s.feed(text[42:]) + s.finish()     # the head is complete in the first piece
    got = T.assemble(events)
    assert [c["function"]["name"] for c in got.tool_calls] == ["now"] and got.content == " ok"
    assert got.tool_calls[0]["function"]["arguments"] == '{"a": 1,, }'
    whole = T.parse_output(auto(), text)                                # all at once: not a call, content
    assert whole.tool_calls == [] and whole.content == text


def test_auto_or_none_without_tools_is_no_tools():
    assert parse_chat({"messages": CHAT["messages"], "tool_choice": "auto"}).tools is None
    assert parse_chat({"messages": CHAT["messages"], "parallel_tool_calls": True}).tools is None
