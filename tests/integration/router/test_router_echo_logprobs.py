"""Completions `echo` + `logprobs` and vLLM's `prompt_logprobs` through the router to a real engine,
with the real `openai` client: shapes, the first prompt token's null, values equal to a logprobs
request on the same tokens, usage, streaming (prompt first), every KV block free after."""
from __future__ import annotations

import json
from typing import Literal, Optional

import httpx
import pytest
from openai.types import Completion
from openai.types.completion_choice import CompletionChoice
from pydantic import ValidationError

from conftest import router_config, wait_engine_idle

pytestmark = pytest.mark.timeout(300)
K = 2


class StreamChoice(CompletionChoice):
    finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None


class CompletionChunk(Completion):
    choices: list[StreamChoice]


def validate_echo(body: dict, model=Completion) -> None:
    """openai's Logprobs types say list[float] / list[dict]; OpenAI's API and vLLM send null for the first
    prompt token. Those entries, and only those, fail validation; the rest validates."""
    firsts = [i for i, c in enumerate(body["choices"])
              if c.get("logprobs") and c["logprobs"]["token_logprobs"] and c["logprobs"]["token_logprobs"][0] is None]
    if firsts:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        assert {err["loc"] for err in e.value.errors()} == {
            ("choices", i, "logprobs", f, 0) for i in firsts for f in ("token_logprobs", "top_logprobs")}
    patched = json.loads(json.dumps(body))
    for i in firsts:
        lp = patched["choices"][i]["logprobs"]
        lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    model.model_validate(patched)


def test_echo_logprobs_through_the_router(engines, make_router):
    r = make_router(router_config(engines))
    c = r.client()
    ids = httpx.post(engines["STL"].url + "/tokenize", json={"prompt": "std::map<int, int> m; m[1] ="},
                     timeout=30).json()["tokens"]
    gen = c.completions.create(model="STL", prompt=ids, max_tokens=5, temperature=0, logprobs=K,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    out = gen.choices[0].model_extra["token_ids"]
    raw = c.completions.with_raw_response.create(model="STL", prompt=ids + out, max_tokens=3, temperature=0,
                                                 logprobs=K, echo=True,
                                                 extra_body={"ignore_eos": True, "prompt_logprobs": K})
    assert raw.headers["x-consort-specialist"] == "STL"
    body = raw.http_response.json()
    validate_echo(body)
    echoed = raw.parse()
    ch = echoed.choices[0]
    lp = ch.logprobs
    n_prompt = len(ids) + len(out)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) <= K for t in lp.top_logprobs[1:]) and lp.text_offset[0] == 0
    assert ch.text.startswith(httpx.post(engines["STL"].url + "/detokenize", json={"tokens": ids + out},
                                         timeout=30).json()["prompt"])
    # the tokens generated with logprobs, echoed back as the prompt: the same logprobs
    assert lp.token_logprobs[len(ids):n_prompt] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-4)
    plp = ch.model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    assert [e[str(t)]["logprob"] for t, e in zip((ids + out)[1:], plp[1:])] == pytest.approx(
        lp.token_logprobs[1:n_prompt], abs=1e-6)
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (n_prompt, 3)

    stream = c.completions.create(model="STL", prompt=ids + out, max_tokens=3, temperature=0, logprobs=K,
                                  echo=True, stream=True, extra_body={"ignore_eos": True},
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) == n_prompt
    streamed = [v for k in chunks for x in k.choices if x.logprobs for v in x.logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert "".join(x.text for k in chunks for x in k.choices) == ch.text
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 3
    with httpx.stream("POST", r.url + "/v1/completions", timeout=60,
                      json={"model": "STL", "prompt": ids, "max_tokens": 2, "logprobs": K, "echo": True,
                            "stream": True}) as resp:
        lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        validate_echo(json.loads(line), CompletionChunk)
    bad = r.post("/v1/completions", {"model": "STL", "prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    wait_engine_idle(engines["STL"])


def test_echo_with_max_tokens_0_returns_the_prompt_only(engines, make_router):
    """vLLM's prompt scoring: echo + max_tokens 0 gives the prompt, its logprobs, nothing generated."""
    r = make_router(router_config(engines))
    c = r.client()
    prompt = "std::map<int, int> m; m[1] ="
    n_prompt = len(httpx.post(engines["STL"].url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"])
    full = c.completions.create(model="STL", prompt=prompt, max_tokens=2, temperature=0, logprobs=K, echo=True)
    raw = c.completions.with_raw_response.create(model="STL", prompt=prompt, max_tokens=0, logprobs=K, echo=True,
                                                 extra_body={"prompt_logprobs": K})
    validate_echo(raw.http_response.json())
    out = raw.parse()
    ch = out.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    assert len(ch.logprobs.tokens) == n_prompt and ch.logprobs.token_logprobs[0] is None
    assert ch.logprobs.token_logprobs == pytest.approx(full.choices[0].logprobs.token_logprobs[:n_prompt], abs=1e-5)
    assert len(ch.model_extra["prompt_logprobs"]) == n_prompt
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 0)
    plain = c.completions.create(model="STL", prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None
    chunks = list(c.completions.create(model="STL", prompt=prompt, max_tokens=0, logprobs=K, echo=True, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(x.text for k in chunks for x in k.choices) == prompt
    assert chunks[-1].usage.completion_tokens == 0
    no_echo = r.post("/v1/completions", {"model": "STL", "prompt": "x", "max_tokens": 0})
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"
    wait_engine_idle(engines["STL"])
