"""Structured output through the router with the real `openai` client: response_format and vLLM's
guided extras pass through to real engines, and the output obeys them."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from conftest import router_config

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["header", "lines"],
          "properties": {"header": {"enum": ["<vector>", "<map>", "<set>"]},
                         "lines": {"type": "integer", "minimum": 1, "maximum": 500}}}


def test_json_schema_regex_and_choice_through_the_router(engines, make_router):
    r = make_router(router_config(engines))
    c = r.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "include", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        out = c.chat.completions.create(model="STL", messages=[{"role": "user", "content": "which header?"}],
                                        max_tokens=48, seed=seed, response_format=fmt)
        ChatCompletion.model_validate(out.model_dump())
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    chunks = list(c.chat.completions.create(model="STL", messages=[{"role": "user", "content": "which?"}],
                                            max_tokens=48, seed=9, response_format=fmt, stream=True))
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), SCHEMA)
    reg = c.completions.create(model="STL", prompt="int x = ", max_tokens=8, seed=1,
                               extra_body={"guided_regex": r"-?[1-9][0-9]{0,3};"})
    Completion.model_validate(reg.model_dump())
    assert re.fullmatch(r"-?[1-9][0-9]{0,3};", reg.choices[0].text)
    # room for the longest choice at one character a token plus the EOS the grammar then forces: sampled
    # (no seed), the demo model's tokenizer spells "std::vector" in 4 to 11 tokens, and max_tokens=8 cut
    # ~8% of picks short (60-request probe, before and after stop 21's kernels alike)
    pick = c.chat.completions.create(model="STL", messages=[{"role": "user", "content": "container?"}], max_tokens=16,
                                     extra_body={"guided_choice": ["std::vector", "std::deque"]})
    assert pick.choices[0].message.content in ("std::vector", "std::deque")
    assert pick.choices[0].finish_reason == "stop"
    bad = r.post("/v1/chat/completions", {"model": "STL", "messages": [{"role": "user", "content": "x"}],
                                          "guided_regex": "(unclosed"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex", bad.text
