"""Several choices per request on a real `consort engine`: `n` samples of a prompt (sharing its
prefill), several prompts in one completion request, streamed and not, validated by the `openai` client."""
from __future__ import annotations

import httpx

GREEDY = {"ignore_eos": True}
LONG = "template <typename T> struct S { T v; }; " * 12
BLOCK = 16     # the shared engine's KV block size (the engine default)


def status(engine) -> dict:
    return httpx.get(engine.url + "/v1/status", timeout=10).json()


def test_n_samples_are_seeded_counted_and_share_the_prefill(engine, client):
    before = status(engine)
    r = client.completions.create(model="spec", prompt=LONG, max_tokens=5, temperature=1.0, seed=11, n=4,
                                  extra_body=GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) > 1, "each sample draws with its own seed"
    prompt_tokens = len(httpx.post(engine.url + "/tokenize", json={"prompt": LONG}).json()["tokens"])
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 20
    # One prefill: the three siblings got the first one's full prompt blocks from the prefix cache.
    after = status(engine)
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits == 3 * (prompt_tokens // BLOCK) * BLOCK, (hits, prompt_tokens)
    again = client.completions.create(model="spec", prompt=LONG, max_tokens=5, temperature=1.0, seed=11, n=4,
                                      extra_body=GREEDY)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    assert status(engine)["kv_free_blocks"] == status(engine)["kv_total_blocks"]


def test_several_prompts_and_n_stream_every_choice_with_its_index(engine, client):
    prompts = ["int main() {", "std::vector<int> v;"]
    full = client.completions.create(model="spec", prompt=prompts, max_tokens=6, temperature=0, n=2, extra_body=GREEDY)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert full.choices[0].text == full.choices[1].text and full.choices[2].text == full.choices[3].text  # greedy
    single = client.completions.create(model="spec", prompt=prompts[1], max_tokens=6, temperature=0, extra_body=GREEDY)
    assert full.choices[2].text == single.choices[0].text
    assert full.usage.completion_tokens == 24
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model="spec", prompt=prompts, max_tokens=6, temperature=0, n=2,
                                           stream=True, stream_options={"include_usage": True}, extra_body=GREEDY):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == full.usage.prompt_tokens


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(engine, client):
    """best_of=4, n=2 draws the same four seeded samples as n=4 and keeps the two most likely. The seed
    is one whose two most likely samples are not the first two (the ranking must do something: without
    the samples' logprobs every sum was 0 and the first two came back)."""
    for seed in range(5, 15):
        kw = dict(model="spec", prompt=LONG, max_tokens=5, temperature=1.0, seed=seed, extra_body=GREEDY)
        four = client.completions.create(n=4, logprobs=0, **kw)
        sums = [sum(c.logprobs.token_logprobs) for c in four.choices]
        best = sorted(sorted(range(4), key=lambda i: -sums[i])[:2])
        if best != [0, 1]:
            break
    assert best != [0, 1], "ten seeds, each with its two most likely samples first"
    r = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    assert [c.text for c in r.choices] == [four.choices[i].text for i in best]
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == four.usage.prompt_tokens  # all 4 counted
    with_lp = client.completions.create(n=1, best_of=3, logprobs=1, **kw)
    assert len(with_lp.choices) == 1 and len(with_lp.choices[0].logprobs.top_logprobs[0]) == 1
    resp = httpx.post(engine.url + "/v1/completions", json=dict(prompt="x", n=1, best_of=2, stream=True))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "best_of"
    assert status(engine)["kv_free_blocks"] == status(engine)["kv_total_blocks"]


def test_chat_n_returns_n_messages(engine, client):
    r = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": "sort a vector"}],
                                       max_tokens=4, temperature=0.9, seed=3, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in r.choices)
    chunks = list(client.chat.completions.create(model="spec", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, n=2, stream=True))
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    assert status(engine)["kv_free_blocks"] == status(engine)["kv_total_blocks"]


def test_every_body_and_chunk_validates_against_the_openai_types(engine):
    import json

    from typing import Literal, Optional

    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.completion_choice import CompletionChoice

    class StreamChoice(CompletionChoice):      # a streamed completion is a Completion whose unfinished
        finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None   # choices have no reason yet

    class CompletionChunk(Completion):
        choices: list[StreamChoice]

    body = {"model": "spec", "prompt": ["int a;", [5, 6, 7]], "n": 2, "max_tokens": 3, "echo": True,
            "logit_bias": {"9": 1.0}, "presence_penalty": 0.3}
    Completion.model_validate(httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json())
    chat = {"model": "spec", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 2}
    ChatCompletion.model_validate(httpx.post(engine.url + "/v1/chat/completions", json=chat, timeout=60).json())
    for path, payload, model in (("/v1/completions", body, CompletionChunk), ("/v1/chat/completions", chat, ChatCompletionChunk)):
        with httpx.stream("POST", engine.url + path, json={**payload, "stream": True,
                                                           "stream_options": {"include_usage": True}}, timeout=60) as r:
            lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        for line in lines[:-1]:
            model.model_validate(json.loads(line))
