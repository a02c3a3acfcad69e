"""vLLM's extra endpoints through the router (/tokenize, /detokenize, /version, /v1/models/{id}) and
the logits processors passed through to real engines."""
from __future__ import annotations

import time

import httpx
import pytest

import procs
from conftest import router_config

pytestmark = pytest.mark.timeout(300)


def test_tokenize_and_detokenize_are_answered_by_the_named_specialist(engines, make_router):
    r = make_router(router_config(engines))
    direct = httpx.post(engines["STL"].url + "/tokenize", json={"prompt": "std::map<int, int> m;"}, timeout=30).json()
    via = r.post("/tokenize", {"model": "STL", "prompt": "std::map<int, int> m;"})
    assert via.status_code == 200 and via.headers["x-consort-specialist"] == "STL"
    assert via.json() == direct
    # the ensemble (or no model) asks the default specialist: none is configured, so the first
    ens = r.post("/tokenize", {"model": "cpp", "messages": [{"role": "user", "content": "hi"}]})
    assert ens.status_code == 200 and ens.headers["x-consort-specialist"] == "Template" and ens.json()["count"] > 0
    back = r.post("/detokenize", {"model": "STL", "tokens": direct["tokens"]})
    assert back.status_code == 200 and "std::map" in back.json()["prompt"]
    for path, body, status, code in [("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
                                     ("/tokenize", {"model": 3, "prompt": "x"}, 400, "invalid_type"),
                                     ("/detokenize", {"model": "STL", "tokens": [-1]}, 400, "invalid_token_id")]:
        res = r.post(path, body)
        assert (res.status_code, res.json()["error"]["code"]) == (status, code), res.text


def test_model_cards_and_version(engines, make_router):
    r = make_router(router_config(engines))
    code, ensemble = r.get("/v1/models/cpp")
    assert code == 200 and ensemble["root"] == "cpp" and ensemble["parent"] is None
    code, stl = r.get("/v1/models/STL")
    assert code == 200 and stl["parent"] == "cpp"
    code, missing = r.get("/v1/models/zzz")
    assert code == 404 and missing["error"]["code"] == "model_not_found"
    code, listing = r.get("/v1/models")
    assert {m["id"] for m in listing["data"]} == {"cpp", "Template", "Algo", "STL"}
    assert all("root" in m for m in listing["data"])
    # vLLM's card fields: `created` (the router's start, one int for all) and `max_model_len` (the
    # engines'; the ensemble's is the least of its specialists', a routed request may land on any)
    engine_lens = {name: procs.http_get(e.url + "/v1/models")[1]["data"][0]["max_model_len"]
                   for name, e in engines.items()}
    cards = {m["id"]: m for m in listing["data"]}
    assert len({m["created"] for m in listing["data"]}) == 1
    assert isinstance(cards["cpp"]["created"], int) and abs(cards["cpp"]["created"] - time.time()) < 3600
    assert {n: cards[n]["max_model_len"] for n in engine_lens} == engine_lens
    assert cards["cpp"]["max_model_len"] == min(engine_lens.values())
    code, v = r.get("/version")
    assert code == 200 and v["version"]


def test_logit_bias_and_penalties_pass_through_the_router(engines, make_router):
    r = make_router(router_config(engines))
    c = r.client()
    forced = httpx.post(engines["STL"].url + "/tokenize", json={"prompt": "vector", "add_special_tokens": False},
                        timeout=30).json()["tokens"][0]
    out = c.completions.create(model="STL", prompt="int main() {", max_tokens=6, temperature=0,
                               logit_bias={str(forced): 100}, frequency_penalty=0.5, presence_penalty=0.5,
                               extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.2})
    assert out.choices[0].model_extra["token_ids"] == [forced] * 6
    assert out.usage.completion_tokens == 6


def test_n_and_several_prompts_through_the_router(engines, make_router):
    r = make_router(router_config(engines))
    c = r.client()
    out = c.completions.create(model="STL", prompt=["int a;", "int b;"], max_tokens=3, temperature=0, n=2,
                               extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3] and out.usage.completion_tokens == 12
    chat = c.chat.completions.create(model="STL", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2)
    assert len(chat.choices) == 2
