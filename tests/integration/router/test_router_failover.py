"""Failover through the real router: a lane with no ready replica, or whose engine fails before the
first byte, hands the request to its fallback (headers say who served); after the first byte a
hung engine is cut off by the idle-stream timeout with a typed SSE error and a breaker failure."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import router_config

import procs

FAULTY = Path(__file__).with_name("faulty_engine.py")


@pytest.fixture
def faulty(logs):
    started: list[procs.Proc] = []

    def start(mode: str) -> str:
        port = procs.free_port()
        p = procs.start_process([sys.executable, str(FAULTY), str(port), mode], f"faulty-{mode}-{port}", logs)
        started.append(p)
        procs.wait_http(f"http://127.0.0.1:{port}/ready", p, timeout=30)
        return f"http://127.0.0.1:{port}"

    yield start
    for p in started:
        p.stop()


def with_algo_at(engines, urls: list[str], **over) -> dict:
    cfg = router_config(engines, **over)
    for s in cfg["specialists"]:
        if s["name"] == "Algo":
            s["replicas"] = urls
    return cfg


def test_no_ready_replica_uses_the_fallback_with_truthful_headers_and_no_shadow(engines, make_router):
    dead = f"http://127.0.0.1:{procs.free_port()}"     # nothing listens: never ready
    r = make_router(with_algo_at(engines, [dead]))
    procs.wait_until(lambda: not r.routing()["specialists"]["Algo"]["routable"], 10, what="Algo unroutable")
    resp = r.post("/v1/completions", {"model": "cpp", "prompt": "int main() {", "intent": "codegen", "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-consort-specialist"] == "STL"
    assert resp.headers["x-consort-admission"] == "admitted"
    assert resp.headers["x-consort-shadow"] == "none"
    assert r.routing()["shadow"]["inflight"] == 0
    # A request pinned to the lane insists on it: a typed 503 that says so.
    pinned = r.post("/v1/completions", {"model": "Algo", "prompt": "x", "max_tokens": 2})
    assert pinned.status_code == 503 and pinned.json()["error"]["code"] == "no_ready_replica"
    assert pinned.headers["x-consort-admission"] == "rejected:no_ready_replica"
    assert int(pinned.headers["Retry-After"]) >= 1


def test_5xx_before_the_first_byte_fails_over_to_the_fallback(engines, make_router, faulty):
    r = make_router(with_algo_at(engines, [faulty("http500")]))
    procs.wait_until(lambda: r.routing()["specialists"]["Algo"]["routable"], 10, what="the faulty Algo ready")
    client = r.client()
    raw = client.completions.with_raw_response.create(model="cpp", prompt="int main() {", max_tokens=4,
                                                      extra_headers={"x-consort-intent": "codegen"})
    assert raw.parse().choices[0].text is not None
    assert raw.headers["x-consort-specialist"] == "STL"
    stream = client.completions.create(model="cpp", prompt="int main() {", max_tokens=4, stream=True,
                                       extra_headers={"x-consort-intent": "codegen"})
    assert "".join(c.choices[0].text for c in stream if c.choices) is not None


def test_a_hung_stream_is_cut_by_the_idle_timeout_with_a_typed_error_and_a_breaker_failure(engines, make_router,
                                                                                           faulty):
    r = make_router(with_algo_at(engines, [faulty("hang_after_first_chunk")], limits={"stream_idle_timeout_s": 1.0}))
    procs.wait_until(lambda: r.routing()["specialists"]["Algo"]["routable"], 10, what="the hanging Algo ready")
    before = r.routing()["specialists"]["Algo"]["breaker"]["total"]
    t0 = time.monotonic()
    with httpx.stream("POST", r.url + "/v1/completions", timeout=30,
                      json={"model": "Algo", "prompt": "x", "max_tokens": 8, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - t0
    assert json.loads(events[0])["choices"][0]["text"] == "first"
    err = json.loads(events[-1])["error"]
    assert err["code"] == "idle_timeout" and err["type"] == "upstream_error", events
    assert "[DONE]" not in events
    assert took < 10, f"the stream hung for {took:.1f} s"
    procs.wait_until(lambda: r.routing()["specialists"]["Algo"]["breaker"]["total"] > before, 5,
                     what="the idle timeout counted against Algo's breaker")
    # The openai client raises the typed error instead of returning a truncated answer.
    with pytest.raises(openai.APIError) as e:
        list(r.client().completions.create(model="Algo", prompt="x", max_tokens=8, stream=True))
    assert "no token from the engine" in str(e.value)
