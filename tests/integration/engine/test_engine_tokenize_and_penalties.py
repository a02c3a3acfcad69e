"""vLLM's extra endpoints (/tokenize, /detokenize, /version, /v1/models/{id}), the logits
processors (logit_bias, penalties, min_p) and `echo` on a real `consort engine`."""
from __future__ import annotations

import time

import httpx

import procs
from consort_engine.text.tokenizer import Tokenizer


def post(engine, path: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=60)


def test_tokenize_matches_the_tokenizer_and_the_prompt_the_engine_runs(engine, demo_model, client):
    tok = Tokenizer.from_dir(demo_model)
    r = post(engine, "/tokenize", {"model": "spec", "prompt": "std::vector<int> v;", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("std::vector<int> v;") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == [tok.hf.id_to_token(i) for i in body["tokens"]]
    messages = [{"role": "user", "content": "sort a vector"}]
    chat = post(engine, "/tokenize", {"messages": messages}).json()
    done = client.chat.completions.create(model="spec", messages=messages, max_tokens=1)
    assert chat["count"] == done.usage.prompt_tokens and chat["token_strs"] is None
    back = post(engine, "/detokenize", {"model": "spec", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(body["tokens"], skip_special_tokens=False)


def test_tokenize_errors_are_typed(engine):
    cases = [("/tokenize", {"prompt": "x", "messages": []}, 400, "missing_field"),
             ("/tokenize", {"prompt": 5}, 400, "invalid_type"),
             ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
             ("/detokenize", {"tokens": [1, -3]}, 400, "invalid_token_id"),
             ("/detokenize", {"tokens": "1 2"}, 400, "invalid_type")]
    for path, body, status, code in cases:
        r = post(engine, path, body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, body, r.text)


def test_model_card_by_id_and_version(engine):
    code, card = procs.http_get(engine.url + "/v1/models/spec")
    assert code == 200 and card["id"] == "spec" and card["root"] and card["parent"] is None
    # vLLM's `created` (the server's start, the same in every answer) and `max_model_len`
    assert isinstance(card["created"], int) and abs(card["created"] - time.time()) < 3600
    assert procs.http_get(engine.url + "/v1/models")[1]["data"][0]["created"] == card["created"]
    assert card["max_model_len"] == engine.status()["max_model_len"]
    r = httpx.get(engine.url + "/v1/models/other", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    code, v = procs.http_get(engine.url + "/version")
    assert code == 200 and v["version"]


def test_logit_bias_and_penalties_change_what_is_generated(engine, client):
    base = client.completions.create(model="spec", prompt="template <typename T>", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    forced = base.choices[0].model_extra["token_ids"][0] + 1
    biased = client.completions.create(model="spec", prompt="template <typename T>", max_tokens=8, temperature=0,
                                       logit_bias={str(forced): 100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"] == [forced] * 8
    # a strong repetition penalty never repeats a token the greedy run repeated
    ids = base.choices[0].model_extra["token_ids"]
    penalized = client.completions.create(model="spec", prompt="template <typename T>", max_tokens=8, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "repetition_penalty": 2.0, "min_p": 0.05})
    out = penalized.choices[0].model_extra["token_ids"]
    assert len(out) == 8 and (out != ids or len(set(ids)) == 8)
    r = post(engine, "/v1/completions", {"prompt": "x", "logit_bias": {"999999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert engine.status()["kv_free_blocks"] == engine.status()["kv_total_blocks"]


def test_echo_leads_the_completion_with_the_prompt(engine, client):
    prompt = "template <typename T>"
    plain = client.completions.create(model="spec", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model="spec", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="spec", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    ids = post(engine, "/tokenize", {"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model="spec", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(post(engine, "/detokenize", {"tokens": ids}).json()["prompt"])
    r = post(engine, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
