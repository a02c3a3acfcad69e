"""Auth (keys file, constant-time compare, fail closed) and request parsing (typed 4xx)."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from consort_router.api import ApiError, parse_json, parse_request, upstream_body
from consort_router.auth import ANONYMOUS, KeyRing, bearer, parse_keys, resolve


def test_keys_file_and_bearer(tmp_path):
    p = tmp_path / "keys"
    p.write_text("# comment\nsk-one\n\n  sk-two  \n")
    ring = KeyRing(str(p))
    ring.refresh()
    assert ring.enabled and len(ring.entries) == 2
    assert ring.tenant("Bearer sk-one") and ring.tenant("bearer sk-two")
    assert ring.tenant("Bearer sk-three") is None
    assert ring.tenant("sk-one") is None and ring.tenant(None) is None and ring.tenant("Bearer ") is None
    assert ring.tenant("Basic sk-one") is None
    # the ring keeps only digests
    assert b"sk-one" not in repr(ring).encode()


def test_keys_reload_on_change_and_fail_closed(tmp_path):
    p = tmp_path / "keys"
    p.write_text("old\n")
    ring = KeyRing(str(p))
    ring.refresh()
    assert ring.tenant("Bearer old")
    time.sleep(0.01)
    p.write_text("new\n")
    os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
    ring.refresh()
    assert ring.tenant("Bearer new") and ring.tenant("Bearer old") is None
    p.unlink()
    ring.refresh()
    assert ring.tenant("Bearer new") is None  # missing file: nobody gets in


def test_resolve_compares_against_every_key():
    d = parse_keys("a\nb\nc\n")
    assert resolve(d, "c") and resolve(d, "d") is None and resolve((), "a") is None and resolve(d, None) is None
    assert bearer("Bearer  x ") == "x"


def test_named_tenants_and_anonymous_old_keys():
    entries = parse_keys("# tenants\nteam-a: sk-aaa\nteam.b : sk:b:with:colons\nsk-legacy\n")
    assert resolve(entries, "sk-aaa") == "team-a"
    assert resolve(entries, "sk:b:with:colons") == "team.b"
    anon = resolve(entries, "sk-legacy")
    assert anon == "anon-" + hashlib.sha256(b"sk-legacy").hexdigest()[:8]
    assert "sk-legacy" not in anon
    assert resolve(entries, "team-a: sk-aaa") is None and resolve(entries, "team-a") is None
    for bad_text in ("bad name!: k\n", "a: k1\na: k2\n", "a: \n"):
        with pytest.raises(ValueError):
            parse_keys(bad_text)


def test_auth_off_is_the_anonymous_tenant():
    assert KeyRing(None).tenant(None) == ANONYMOUS == KeyRing(None).tenant("Bearer whatever")


def test_parse_request_typed_errors():
    with pytest.raises(ApiError) as e:
        parse_json(b"{not json")
    assert (e.value.status, e.value.code) == (400, "invalid_json")
    with pytest.raises(ApiError):
        parse_json(b"[1,2]")
    for body, code in [({"model": 3, "prompt": "x"}, "invalid_type"), ({"prompt": "x", "priority": "hi"}, "invalid_type"),
                       ({"prompt": "x", "priority": True}, "invalid_type"), ({"prompt": "x", "stream": "yes"}, "invalid_type"),
                       ({"model": "m"}, "missing_field"), ({"prompt": {"a": 1}}, "invalid_type")]:
        with pytest.raises(ApiError) as e:
            parse_request(body, "completion", None)
        assert e.value.status == 400 and e.value.code == code, body
    with pytest.raises(ApiError):
        parse_request({"messages": []}, "chat", None)
    with pytest.raises(ApiError):
        parse_request({"messages": ["x"]}, "chat", None)


def test_parse_request_text_and_intent():
    r = parse_request({"model": "cpp", "messages": [{"role": "system", "content": "sys"},
                                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                       "intent": "debug", "priority": 5}, "chat", None)
    assert (r.text, r.intent, r.priority, r.stream) == ("sys\nhi", "debug", 5, False)
    r = parse_request({"prompt": "x", "intent": "debug"}, "completion", "build-fix")
    assert r.intent == "build-fix"  # the header wins
    assert parse_request({"prompt": [1, 2, 3]}, "completion", None).text == ""
    assert upstream_body({"model": "cpp", "intent": "x", "prompt": "p"}, "Algo", "lora1") == {
        "model": "Algo", "prompt": "p", "adapter": "lora1"}
    assert upstream_body({"model": "cpp", "adapter": "mine", "prompt": "p"}, "Algo", "lora1")["adapter"] == "mine"


def test_error_body_and_headers():
    e = ApiError(429, "priority_floor", "m", retry_after_ms=1500)
    assert e.body() == {"error": {"type": "admission_rejected", "code": "priority_floor", "message": "m",
                                  "retry_after_ms": 1500}}
    assert e.headers() == {"Retry-After": "2"}
    assert ApiError(401, "invalid_api_key", "m").headers() == {"WWW-Authenticate": "Bearer"}


def test_parse_request_responses_reads_instructions_and_input_text():
    r = parse_request({"model": "cpp", "instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}],
        "stream": True}, "responses", None)
    assert (r.text, r.stream) == ("sys\nhi\nyo", True)
    assert parse_request({"input": "plain"}, "responses", None).text == "plain"
    for body, code in [({"model": "cpp"}, "missing_field"), ({"input": 3}, "invalid_type")]:
        with pytest.raises(ApiError) as e:
            parse_request(body, "responses", None)
        assert (e.value.status, e.value.code, e.value.param) == (400, code, "input")


def test_shadow_reads_and_caps_responses():
    from consort_router.config import ShadowConfig
    from consort_router.proxy import text_of_response, text_of_sse
    from consort_router.shadow import shadow_body

    out = shadow_body({"model": "cpp", "input": "x", "max_output_tokens": 500, "stream": True}, "STL",
                      ShadowConfig(max_tokens=64))
    assert (out["max_output_tokens"], out["stream"], "max_tokens" in out) == (64, False, False)
    body = {"object": "response", "output": [{"type": "message", "content": [{"type": "output_text", "text": "ab"}]}]}
    assert text_of_response(body) == "ab"
    sse = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n'
           b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"b"}\n\n')
    assert text_of_sse(sse) == "ab"


def test_engine_credential_file(tmp_path):
    from consort_router.auth import engine_credential
    p = tmp_path / "cred"
    p.write_text("# engine credential\nc-new\nc-old\n")
    assert engine_credential(str(p)) == "c-new" and engine_credential(None) is None
    p.write_text("\n# none\n")
    with pytest.raises(ValueError):
        engine_credential(str(p))


def test_engine_credential_follows_its_file(tmp_path):
    from consort_router.auth import EngineCredential
    p = tmp_path / "cred"
    p.write_text("c1\n")
    c = EngineCredential(str(p))
    assert c.refresh() and c.headers() == {"Authorization": "Bearer c1"}
    assert not c.refresh()                                  # unchanged
    p.write_text("c2\nc1\n")
    os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert c.refresh() and c.value == "c2"
    assert EngineCredential(None).headers() == {} and not EngineCredential(None).refresh()
