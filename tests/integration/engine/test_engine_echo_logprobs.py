"""Completions `echo` + `logprobs` (the prompt's logprobs lead the choice's) and vLLM's
`prompt_logprobs`, on a real `consort engine` with the real `openai` client and raw HTTP."""
from __future__ import annotations

import json
from typing import Literal, Optional

import httpx
import pytest
from openai.types import Completion
from openai.types.completion_choice import CompletionChoice
from pydantic import ValidationError

K = 3
NEW = 4


class StreamChoice(CompletionChoice):      # streamed choices have no finish_reason until the end
    finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None


class CompletionChunk(Completion):
    choices: list[StreamChoice]


def validate_echo(body: dict, model=Completion) -> None:
    """model_validate an echo + logprobs body. openai's Logprobs types say list[float] / list[dict], while
    OpenAI's own API and vLLM send null for the first prompt token: those entries, and only those, fail;
    with them set aside the rest must validate."""
    first = [(i, c) for i, c in enumerate(body["choices"])
             if c.get("logprobs") and c["logprobs"]["token_logprobs"] and c["logprobs"]["token_logprobs"][0] is None]
    if first:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        assert {err["loc"] for err in e.value.errors()} == {
            loc for i, _ in first for loc in (("choices", i, "logprobs", "token_logprobs", 0),
                                              ("choices", i, "logprobs", "top_logprobs", 0))}
    patched = json.loads(json.dumps(body))
    for i, _ in first:
        lp = patched["choices"][i]["logprobs"]
        lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    model.model_validate(patched)


def post(engine, body: dict) -> dict:
    r = httpx.post(engine.url + "/v1/completions", json={"model": "spec", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(engine, text: str) -> list[int]:
    return httpx.post(engine.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(engine, client):
    prompt = "template <typename T> struct vector {"
    ids = tokenize(engine, prompt)
    params = dict(max_tokens=NEW, temperature=0, logprobs=K)
    plain = client.completions.create(model="spec", prompt=prompt, **params,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    raw = client.completions.with_raw_response.create(model="spec", prompt=prompt, echo=True, **params,
                                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    echoed = raw.parse()
    ch, gen = echoed.choices[0], plain.choices[0]
    assert ch.text == prompt + gen.text
    lp = ch.logprobs
    n = len(ids) + NEW
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(isinstance(t, dict) and 1 <= len(t) <= K for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in
                                          zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    # the generated part is the plain request's, token for token
    assert ch.model_extra["token_ids"] == gen.model_extra["token_ids"]
    assert lp.tokens[len(ids):] == gen.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(gen.logprobs.token_logprobs, abs=1e-4)
    # each prompt token's logprob is at most its top-k's best
    for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert v <= max(top.values()) + 1e-5
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (len(ids), NEW)
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0   # the prompt ran whole: no cache hits
    validate_echo(raw.http_response.json())
    status = engine.status()
    assert status["kv_free_blocks"] == status["kv_total_blocks"]


def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_generated(engine):
    """Greedy tokens generated with logprobs, then sent back as the prompt with echo: the echoed
    logprobs of those positions are the generated ones (prefill rows vs decode rows of the model)."""
    ids = tokenize(engine, "int main() { std::vector<int> v;")
    gen = post(engine, {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": K, "ignore_eos": True,
                        "return_token_ids": True})["choices"][0]
    out = gen["token_ids"]
    back = post(engine, {"prompt": ids + out, "max_tokens": 1, "temperature": 0, "logprobs": K, "echo": True,
                         "prompt_logprobs": K})
    validate_echo(back)
    ch = back["choices"][0]
    lp = ch["logprobs"]
    assert lp["token_logprobs"][len(ids):len(ids) + len(out)] == pytest.approx(gen["logprobs"]["token_logprobs"],
                                                                               abs=1e-4)
    for mine, theirs in zip(lp["top_logprobs"][len(ids):], gen["logprobs"]["top_logprobs"]):
        assert sorted(mine.values()) == pytest.approx(sorted(theirs.values()), abs=1e-4)
    # vLLM's prompt_logprobs: None first, then {id: {logprob, rank, decoded_token}} with the prompt token
    plp = ch["prompt_logprobs"]
    prompt = ids + out
    assert len(plp) == len(prompt) and plp[0] is None
    for t, entry, v in zip(prompt[1:], plp[1:], lp["token_logprobs"][1:]):
        assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-6)
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:K] == list(range(1, K + 1)) and len(entry) in (K, K + 1)
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["logprob"] == pytest.approx(max(e["logprob"] for e in entry.values()))
        assert entry[str(t)]["rank"] >= 1 and isinstance(entry[str(t)]["decoded_token"], str)
    # prompt_logprobs alone (no echo): same values, plain text
    alone = post(engine, {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
    ch2 = alone["choices"][0]
    assert ch2["logprobs"] is None
    for a, b in zip(ch2["prompt_logprobs"][1:], plp[1:]):
        assert {k: v["logprob"] for k, v in a.items()} == pytest.approx(
            {k: b[k]["logprob"] for k in a}, abs=1e-4)
    Completion.model_validate(alone)
    # chat: vLLM puts them on the response (one prompt, whatever n)
    chat = httpx.post(engine.url + "/v1/chat/completions", timeout=60, json={
        "model": "spec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1,
        "n": 2}).json()
    cplp = chat["prompt_logprobs"]
    assert len(cplp) == chat["usage"]["prompt_tokens"] and cplp[0] is None
    assert all(1 <= len(e) <= 2 and min(v["rank"] for v in e.values()) == 1 for e in cplp[1:])
    status = engine.status()
    assert status["kv_free_blocks"] == status["kv_total_blocks"]


def test_echo_logprobs_stream_the_prompt_first_and_n_choices_share_it(engine):
    prompt = "class Widget { public:"
    body = {"model": "spec", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    full = post(engine, body)
    with httpx.stream("POST", engine.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    for c in chunks:
        validate_echo(c, CompletionChunk)
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["token_logprobs"][0] is None
    n_prompt = full["usage"]["prompt_tokens"]
    assert len(first["logprobs"]["tokens"]) == n_prompt
    streamed = [v for c in chunks for ch in c["choices"] if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
    want = full["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want[1:], abs=1e-5)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == full["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == NEW and chunks[-1]["usage"]["prompt_tokens"] == n_prompt

    one = post(engine, {**body, "prompt": [7], "prompt_logprobs": 1})       # a one-token prompt: nothing to score
    lp1 = one["choices"][0]["logprobs"]
    assert lp1["token_logprobs"][0] is None and len(lp1["tokens"]) == 1 + NEW
    assert one["choices"][0]["prompt_logprobs"] == [None]
    with httpx.stream("POST", engine.url + "/v1/completions", timeout=60,
                      json={**body, "prompt": [7], "stream": True}) as r:
        one_lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(one_lines[0][len("data: "):])["choices"][0]["logprobs"]["token_logprobs"] == [None]
    assert one_lines[-1] == "data: [DONE]"

    two = post(engine, {**body, "n": 2, "temperature": 1.0, "seed": 3})
    validate_echo(two)
    a, b = (c["logprobs"] for c in two["choices"])
    assert a["token_logprobs"][:n_prompt] == b["token_logprobs"][:n_prompt]
    assert a["token_logprobs"][1:n_prompt] == pytest.approx(want[1:n_prompt], abs=1e-5)
    assert two["usage"]["prompt_tokens"] == n_prompt and two["usage"]["completion_tokens"] == 2 * NEW
    status = engine.status()
    assert status["kv_free_blocks"] == status["kv_total_blocks"]
