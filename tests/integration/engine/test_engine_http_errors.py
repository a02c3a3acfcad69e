"""Bad input gets a typed 4xx and the engine keeps serving (real process, raw HTTP and the openai client)."""
from __future__ import annotations

import httpx
import openai
import pytest

CTX = 512   # the demo model's max_model_len (conftest.MAX_MODEL_LEN)


def post(engine, path: str, **kw) -> httpx.Response:
    return httpx.post(engine.url + path, timeout=30, **kw)


def assert_typed(r: httpx.Response, status: int, code: str, param: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["message"], err
    if param != "__any__":
        assert err["param"] == param, err
    assert r.headers["x-consort-specialist"] == "spec"
    return err


def still_serving(engine) -> None:
    r = post(engine, "/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b"null"])
def test_invalid_json(engine, path, raw):
    assert_typed(post(engine, path, content=raw, headers={"content-type": "application/json"}), 400, "invalid_json")


@pytest.mark.parametrize("body,status,code,param", [
    ({"prompt": "", "max_tokens": 4}, 400, "empty_prompt", "prompt"),
    ({"prompt": [], "max_tokens": 4}, 400, "empty_prompt", "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ({"prompt": "x", "max_tokens": "4"}, 400, "invalid_type", "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"prompt": "x", "n": 65}, 400, "invalid_value", "n"),
    ({"prompt": ["a", ""]}, 400, "empty_prompt", "prompt"),
    ({"prompt": [1, 2, 10 ** 9]}, 400, "invalid_token_id", "prompt"),
    ({"prompt": [1, 2, -5]}, 400, "invalid_token_id", "prompt"),
    ({"prompt": list(range(3, 3 + CTX))}, 400, "context_length_exceeded", "prompt"),
    ({"prompt": list(range(3, 3 + CTX - 10)), "max_tokens": 50}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model_not_found", "model"),
    ({"prompt": "x", "adapter": "no-such-adapter"}, 404, "adapter_not_found", "adapter"),
    ({"prompt": "x", "priority": 1.5}, 400, "invalid_type", "priority"),
    ({"prompt": "x", "stop": [1]}, 400, "invalid_type", "stop"),
])
def test_completion_bad_input(engine, body, status, code, param):
    assert_typed(post(engine, "/v1/completions", json=body), status, code, param)


@pytest.mark.parametrize("body,code,param", [
    ({"messages": []}, "empty_prompt", "messages"),
    ({"messages": "hi"}, "invalid_type", "messages"),
    ({"messages": [{"role": "user"}]}, "missing_field", "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "invalid_value",
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "context_length_exceeded", "messages"),
])
def test_chat_bad_input(engine, body, code, param):
    assert_typed(post(engine, "/v1/chat/completions", json=body), 400, code, param)


def test_openai_client_sees_typed_errors_then_server_keeps_serving(engine, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="spec", prompt="x", max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["code"] == "invalid_value"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    # Unknown fields are ignored (as vLLM ignores them) and named in x-consort-ignored-fields.
    raw = client.completions.with_raw_response.create(model="spec", prompt="x", max_tokens=2,
                                                      extra_body={"frobnicate": True, "functions": []})
    assert raw.parse().choices[0].text is not None
    assert raw.headers["x-consort-ignored-fields"] == "frobnicate,functions"
    still_serving(engine)
    s = engine.status()
    assert s["state"] == "ready" and s["running"] == 0 and s["kv_free_blocks"] == s["kv_total_blocks"]


def test_unknown_route_and_method_are_json(engine):
    r = httpx.get(engine.url + "/v1/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(engine.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    still_serving(engine)
