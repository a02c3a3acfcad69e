"""The router in front of real engines: routing by intent, detector and classifier; streaming; shadow
dispatch + calibration records; auth; bad input never 5xx; config reload; readiness."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import yaml

from conftest import read_jsonl, router_config, wait_engine_idle, wait_for

pytestmark = pytest.mark.timeout(300)
GREEDY = {"ignore_eos": True}
SFINAE = """template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
auto f(T t) -> decltype(t + 1) { return t + 1; }
template <typename T> struct has_x<T, std::void_t<decltype(std::declval<T>().x)>> : std::true_type {};"""


def test_routes_by_intent_detector_and_classifier(engines, make_router):
    r = make_router(router_config(engines))
    c = r.client()
    # 1. declared intent (header), whatever the prompt says
    raw = c.completions.with_raw_response.create(model="cpp", prompt="Implement Dijkstra shortest path",
                                                 max_tokens=4, temperature=0, extra_body=GREEDY,
                                                 extra_headers={"x-consort-intent": "review"})
    assert raw.headers["x-consort-specialist"] == "STL" and raw.parse().model == "STL"
    # ... or body field
    raw = c.completions.with_raw_response.create(model="cpp", prompt="x", max_tokens=2, temperature=0,
                                                 extra_body={**GREEDY, "intent": "templates"})
    assert raw.headers["x-consort-specialist"] == "Template"
    # 2. structural detector: SFINAE-heavy code goes to Template
    raw = c.chat.completions.with_raw_response.create(model="cpp", messages=[{"role": "user", "content": SFINAE}],
                                                      max_tokens=4, temperature=0, extra_body=GREEDY)
    assert raw.headers["x-consort-specialist"] == "Template" and raw.parse().model == "Template"
    # 3. classifier
    raw = c.completions.with_raw_response.create(
        model="cpp", prompt="Implement Dijkstra's shortest path algorithm with a priority queue",
        max_tokens=4, temperature=0, extra_body=GREEDY)
    h = raw.headers
    assert h["x-consort-specialist"] == "Algo" and raw.parse().model == "Algo"
    for k in ("x-request-id", "x-consort-shadow", "x-consort-adapter", "x-consort-admission", "x-consort-breaker"):
        assert k in h
    assert (h["x-consort-shadow"], h["x-consort-admission"], h["x-consort-breaker"], h["x-consort-adapter"]) == (
        "none", "admitted", "closed", "none")
    raw = c.completions.with_raw_response.create(model="cpp", prompt="std::ranges::sort with a projection",
                                                 max_tokens=4, temperature=0, extra_body=GREEDY)
    assert raw.headers["x-consort-specialist"] == "STL"
    # pin a specialist with `model`
    raw = c.completions.with_raw_response.create(model="Template", prompt="Implement Dijkstra",
                                                 max_tokens=2, temperature=0, extra_body=GREEDY)
    assert raw.headers["x-consort-specialist"] == "Template"
    # the caller's request id is kept and reaches the engine
    raw = c.completions.with_raw_response.create(model="cpp", prompt="x", max_tokens=1, extra_body=GREEDY,
                                                 extra_headers={"x-request-id": "rid-123", "x-consort-intent": "codegen"})
    assert raw.headers["x-request-id"] == "rid-123" and raw.parse().id.endswith("rid-123")
    # reject class -> typed 422
    with pytest.raises(openai.UnprocessableEntityError) as e:
        c.completions.create(model="cpp", prompt="What is the capital of France? Tell me a joke", max_tokens=2)
    assert e.value.body["code"] == "unroutable"
    code, models = r.get("/v1/models")
    assert code == 200 and {m["id"] for m in models["data"]} == {"cpp", "Template", "Algo", "STL"}


def test_streaming_passes_through_identically(engines, make_router):
    r = make_router(router_config(engines))
    direct = openai.OpenAI(base_url=engines["Algo"].url + "/v1", api_key="x", max_retries=0)
    kw = dict(prompt="template <typename T> struct", max_tokens=24, temperature=0, extra_body=GREEDY)
    want = "".join(ch.choices[0].text for ch in direct.completions.create(model="Algo", stream=True, **kw))
    got, n = [], 0
    for ch in r.client().completions.create(model="Algo", stream=True, **kw):
        got.append(ch.choices[0].text)
        n += 1
    assert "".join(got) == want and n >= 10  # chunks arrive as the engine emits them
    # chat streaming through the router, with usage
    chunks = list(r.client().chat.completions.create(
        model="cpp", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY, extra_headers={"x-consort-intent": "review"}))
    assert chunks[-1].usage.completion_tokens == 8 and chunks[0].model == "STL"


def test_sse_is_not_buffered(engines, make_router):
    """The first chunk reaches the client long before the last one is produced."""
    r = make_router(router_config(engines))
    t0 = time.monotonic()
    times = []
    with httpx.stream("POST", r.url + "/v1/completions", timeout=120,
                      json={"model": "STL", "prompt": "x", "max_tokens": 200, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-consort-specialist"] == "STL"
        for line in resp.iter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic() - t0)
    assert len(times) > 50
    assert times[0] < 0.5 * times[-1], (times[0], times[-1])


def test_shadow_dispatch_writes_calibration_records(engines, make_router, tmp_path):
    cfg = router_config(engines, shadow={"default_threshold": 1.0, "max_tokens": 8})  # every classified request
    r = make_router(cfg, workdir=tmp_path / "shadow")
    c = r.client()
    raw = c.completions.with_raw_response.create(
        model="cpp", prompt="Implement Dijkstra's shortest path algorithm with a priority queue",
        max_tokens=8, temperature=0, extra_body=GREEDY, extra_headers={"x-request-id": "shadow-1"})
    assert raw.headers["x-consort-specialist"] == "Algo"
    shadow = raw.headers["x-consort-shadow"]
    assert shadow in ("Template", "STL")
    primary_text = raw.parse().choices[0].text   # only the primary's answer comes back
    log = tmp_path / "shadow" / "calibration.jsonl"
    try:
        recs = wait_for(lambda: [x for x in read_jsonl(log) if x["request_id"] == "shadow-1"], 30, "calibration record")
    except TimeoutError:
        raise AssertionError(f"{read_jsonl(log)}\n{httpx.get(r.url + '/metrics').text}\n{r.proc.tail()}")
    rec = recs[0]
    assert rec["primary"]["specialist"] == "Algo" and rec["shadow"]["specialist"] == shadow
    assert rec["primary"]["output"] == primary_text and rec["reason"] == "low_confidence" and rec["agree"] is False
    assert rec["shadow"]["output"] != primary_text and len(rec["shadow"]["sha256"]) == 64
    assert rec["primary"]["verifier"]["reason"] == "no_code"  # random weights write no code blocks
    # the shadow ran on the shadow engine at the lowest priority and was never returned
    metrics = httpx.get(r.url + "/metrics").text
    assert f'consort_router_shadow_total{{outcome="disagree",reason="low_confidence",specialist="{shadow}"}} 1.0' in metrics
    # intent-declared traffic is not shadowed (confidence 1)
    raw = c.completions.with_raw_response.create(model="cpp", prompt="x", max_tokens=2, extra_body=GREEDY,
                                                 extra_headers={"x-consort-intent": "review"})
    assert raw.headers["x-consort-shadow"] == "none"
    for e in engines.values():
        wait_engine_idle(e)


def test_auth(engines, make_router, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# router keys\nsk-good-1\nsk-good-2\n")
    r = make_router(router_config(engines, auth={"api_keys_file": str(keys), "protect_routing": True,
                                                 "protect_metrics": False}))
    body = {"model": "cpp", "prompt": "x", "max_tokens": 1, "intent": "review"}
    for key in (None, "sk-wrong", "sk-good-10"):
        resp = r.post("/v1/completions", body, key=key)
        assert resp.status_code == 401, key
        assert resp.json()["error"]["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
    assert r.post("/v1/completions", body, key="sk-good-2").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        r.client("nope").completions.create(model="cpp", prompt="x", max_tokens=1, extra_body={"intent": "review"})
    assert r.client("sk-good-1").completions.create(model="cpp", prompt="x", max_tokens=1,
                                                    extra_body={"intent": "review"}).model == "STL"
    assert r.get("/health")[0] == 200 and r.get("/ready")[0] == 200
    assert r.get("/metrics")[0] == 200
    assert r.get("/v1/routing")[0] == 401 and r.get("/v1/routing", "sk-good-1")[0] == 200
    assert r.post("/v1/feedback", {"feedback_id": "x", "correct": True}).status_code == 401
    # keys never reach the log
    assert "sk-good" not in r.proc.log_path.read_text() and "sk-wrong" not in r.proc.log_path.read_text()


def test_bad_input_is_typed_4xx_never_5xx(engines, make_router):
    r = make_router(router_config(engines, limits={"max_body_bytes": 4096}))
    cases = [
        (lambda: httpx.post(r.url + "/v1/completions", content=b"{not json", timeout=10), 400, "invalid_json"),
        (lambda: httpx.post(r.url + "/v1/completions", content=b"[1]", timeout=10), 400, "invalid_request"),
        (lambda: r.post("/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model_not_found"),
        (lambda: r.post("/v1/completions", {"model": "cpp", "prompt": "x" * 5000}), 413, "request_too_large"),
        (lambda: httpx.post(r.url + "/v1/completions", content=iter([b"x" * 3000] * 4), timeout=10),  # chunked
         413, "request_too_large"),
        (lambda: r.post("/v1/completions", {"model": "cpp"}), 400, "missing_field"),
        (lambda: r.post("/v1/chat/completions", {"model": "cpp", "messages": "hi"}), 400, "missing_field"),
        (lambda: r.post("/v1/completions", {"model": "cpp", "prompt": "x", "priority": "high"}), 400, "invalid_type"),
        (lambda: r.post("/v1/completions", {"model": "cpp", "prompt": "x", "intent": "review",
                                            "max_tokens": -3}), 400, None),   # the engine's own typed 400
        (lambda: httpx.post(r.url + "/v1/completions", content=b'{"model": "cpp", "prompt": "a\\ud800"}',
                            timeout=10), 400, "invalid_unicode"),
        (lambda: httpx.post(r.url + "/v1/chat/completions", timeout=10,
                            content=b'{"model": "cpp", "messages": [{"role": "user", "content": "\\udfff"}]}'),
         400, "invalid_unicode"),
        (lambda: httpx.get(r.url + "/v1/completions", timeout=10), 405, "method_not_allowed"),
        (lambda: httpx.get(r.url + "/nope", timeout=10), 404, "not_found"),
        (lambda: r.post("/v1/feedback", {"feedback_id": "never-issued", "correct": True}), 404,
         "unknown_feedback_id"),
        (lambda: r.post("/v1/feedback", {"request_id": "x", "correct": True}), 400, "missing_field"),
        (lambda: r.post("/v1/feedback", {"feedback_id": "x", "correct": "yes"}), 400, "invalid_type"),
        (lambda: r.post("/v1/feedback", {"feedback_id": "x", "score": 3}), 400, "invalid_type"),
    ]
    for i, (call, status, code) in enumerate(cases):
        resp = call()
        assert resp.status_code == status, (i, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert err["type"] and err["message"] and (code is None or err["code"] == code), (i, err)
    # the router is still fine
    assert r.post("/v1/completions", {"model": "cpp", "prompt": "x", "intent": "review", "max_tokens": 1}).status_code == 200
    # unknown fields are ignored (as vLLM ignores them), and the engine's report reaches the client
    ok = r.post("/v1/completions", {"model": "cpp", "prompt": "x", "intent": "review", "max_tokens": 1,
                                    "bogus_field": 1})
    assert ok.status_code == 200 and ok.headers["x-consort-ignored-fields"] == "bogus_field", ok.text


def test_config_reload_without_dropping_in_flight(engines, make_router):
    cfg = router_config(engines)
    r = make_router(cfg)
    result = {}

    def long_stream():
        text = []
        for ch in r.client().completions.create(model="cpp", prompt="x", max_tokens=150, temperature=0, stream=True,
                                                extra_body={**GREEDY, "intent": "codegen"}):
            text.append(ch.choices[0].text)
            if len(text) == 3:
                result["started"] = True
        result["chunks"] = len(text)

    t = threading.Thread(target=long_stream)
    t.start()
    wait_for(lambda: result.get("started"), 30, "stream started")
    # remap codegen to Template while the stream runs
    specs = cfg["specialists"]
    for s in specs:
        s["intents"] = {"Template": ["templates", "codegen"], "Algo": [], "STL": ["review"]}[s["name"]]
    r.config_path.write_text(yaml.safe_dump(cfg))
    wait_for(lambda: r.routing()["intents"].get("codegen") == "Template", 20, "config reloaded")
    t.join(120)
    assert result["chunks"] >= 100  # the in-flight stream finished on its original specialist
    raw = r.client().completions.with_raw_response.create(model="cpp", prompt="x", max_tokens=1,
                                                          extra_body={**GREEDY, "intent": "codegen"})
    assert raw.headers["x-consort-specialist"] == "Template"
    # a broken config is refused; the router keeps serving the last good one
    r.config_path.write_text("ensemble: cpp\nspecialists: []\n")
    time.sleep(1.0)
    assert r.routing()["intents"]["codegen"] == "Template"
    assert "config_reloads_total{result=\"error\"}" in httpx.get(r.url + "/metrics").text


def test_not_ready_without_a_warm_replica(make_router, logs):
    import procs
    dead = f"http://127.0.0.1:{procs.free_port()}"
    cfg = {"ensemble": "e", "specialists": [{"name": "A", "replicas": [dead]}], "default_specialist": "A",
           "classifier": {"kind": "none"}}
    r = make_router(cfg, wait_ready=False)
    code, body = r.get("/ready")
    assert code == 503 and body["status"] == "not_ready"
    resp = r.post("/v1/completions", {"model": "e", "prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_ready_replica"
    assert "Retry-After" in resp.headers


def test_ready_while_every_lane_is_at_zero_when_they_scale_from_zero(make_router, logs, tmp_path):
    """Every Specialist scaled to zero: the router stays Ready (in its Service), or the request that
    would wake a lane could never reach it."""
    import procs
    dead = f"http://127.0.0.1:{procs.free_port()}"
    cfg = {"ensemble": "e", "default_specialist": "A", "classifier": {"kind": "none"},
           "activator": {"kind": "file", "dir": str(tmp_path / "wake")},
           "specialists": [{"name": "A", "replicas": [dead], "scale_from_zero": {"hold_timeout_s": 1}},
                           {"name": "B", "replicas": [dead]}]}
    r = make_router(cfg, wait_ready=False)
    code, body = r.get("/ready")
    assert code == 200 and body == {"status": "ready", "routable": [], "from_zero": ["A"]}, body
    # it holds the request and asks for a replica (none comes here: a typed timeout, not a refusal)
    resp = r.post("/v1/completions", {"model": "A", "prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "cold_start_timeout"
    assert (tmp_path / "wake" / "A").exists()
