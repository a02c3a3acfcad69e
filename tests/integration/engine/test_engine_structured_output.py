"""Structured output on a real `consort engine` with the real `openai` client: the demo model's text
is gibberish, so output that parses and validates is the grammar's doing."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
from openai.types import Completion
from openai.types.chat import ChatCompletion

import procs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0,
                                                                               "maximum": 1000},
                         "kind": {"enum": ["vector", "map", "set"]}}}
MESSAGES = [{"role": "user", "content": "describe a container as JSON"}]


def wait_idle(engine, timeout: float = 15.0) -> dict:
    def idle():
        s = engine.status()
        return s if (s["running"], s["waiting"], s["kv_free_blocks"]) == (0, 0, s["kv_total_blocks"]) else None
    return procs.wait_until(idle, timeout, what="engine idle with all KV blocks free")


def test_json_schema_output_validates_for_every_seed(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "container", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        out = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=96, temperature=1.0,
                                             seed=seed, response_format=fmt)
        ChatCompletion.model_validate(out.model_dump())
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    wait_idle(engine)


def test_json_schema_streamed_and_json_object(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "container", "schema": SCHEMA, "strict": True}}
    stream = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=96, seed=7,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    out = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=200, seed=1, temperature=0.7,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":          # an open-ended object may run to max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.lstrip().startswith("{")


def test_regex_choice_and_grammar_on_completions(client):
    for seed in range(3):
        r = client.completions.create(model="spec", prompt="a date:", max_tokens=20, seed=seed,
                                      extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
        Completion.model_validate(r.model_dump())
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text), r.choices[0].text
        c = client.completions.create(model="spec", prompt="pick:", max_tokens=10, seed=seed,
                                      extra_body={"structured_outputs": {"choice": ["std::vector", "std::list"]}})
        assert c.choices[0].text in ("std::vector", "std::list") and c.choices[0].finish_reason == "stop"
    g = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=10,
                                       extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert g.choices[0].message.content in ("yes", "no")


def test_uncompilable_and_conflicting_constraints_are_typed_400s(engine):
    cases = [({"guided_regex": "a(b"}, "guided_regex"),
             ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
              "response_format.json_schema.schema"),
             ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")]
    for extra, param in cases:
        r = httpx.post(engine.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_aborted_guided_stream_frees_its_blocks(engine):
    body = {"messages": MESSAGES, "max_tokens": 400, "stream": True, "guided_regex": "[a-z ]{300,}"}
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    wait_idle(engine)


def test_n_siblings_each_follow_the_schema(client, engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "container", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=96, n=3, seed=11,
                                         response_format=fmt)
    assert len(out.choices) == 3
    for ch in out.choices:
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
    assert len({ch.message.content for ch in out.choices}) > 1     # siblings sample apart (seed + i)
    wait_idle(engine)
