"""Failure paths with real processes: client disconnects reach the engine, an engine killed mid-stream
ends the stream with a clean SSE error event, retries happen only before the first byte, and engine
429s pass through typed while a sustained spike escalates (and decays) the admission knobs."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

import procs
from conftest import router_config, wait_engine_idle, wait_for

pytestmark = pytest.mark.timeout(400)


def stream_lines(url: str, body: dict, stop_after: int | None = None, timeout: float = 120):
    """POST a streaming request; returns (headers, data lines). Closes the connection after `stop_after`."""
    lines = []
    with httpx.stream("POST", url, json=body, timeout=timeout) as resp:
        headers = resp.headers
        for line in resp.iter_lines():
            if line.startswith("data:"):
                lines.append(line[5:].strip())
                if stop_after is not None and len(lines) >= stop_after:
                    break
    return headers, lines


def test_client_disconnect_cancels_the_engine_request(engines, make_router):
    """Proof by work done, not by wall time: a cancelled request generates far fewer than its max_tokens
    (a fast machine finishes 480 demo-model tokens in about a second, so a timeout proves nothing)."""
    r = make_router(router_config(engines))
    stl = engines["STL"]
    wait_engine_idle(stl)
    body = {"model": "STL", "prompt": "x", "max_tokens": 480, "temperature": 0, "stream": True, "ignore_eos": True}
    before = stl.generated_tokens()
    headers, lines = stream_lines(r.url + "/v1/completions", body, stop_after=3)
    assert headers["x-consort-specialist"] == "STL" and len(lines) == 3
    wait_engine_idle(stl, timeout=15)   # the engine freed the sequence and every block
    assert stl.generated_tokens() - before < 480
    # the same for a non-streamed request whose client goes away while the engine decodes
    before = stl.generated_tokens()
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", r.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: stl.status()["running"] == 1, timeout=15, what="the request decoding on the engine")
    wait_engine_idle(stl, timeout=15)
    assert stl.generated_tokens() - before < 480
    metrics = httpx.get(r.url + "/metrics").text
    assert 'consort_router_client_disconnects_total{specialist="STL"} 2.0' in metrics


def test_engine_killed_mid_stream_and_retry_before_first_byte(engines, demo_model, make_router, logs):
    doomed = procs.start_engine(demo_model, logs, "--num-blocks", "128", name="Algo")
    try:
        cfg = router_config(engines, polling={"interval_s": 600.0})  # the dead replica stays "ready" to the router
        for s in cfg["specialists"]:
            if s["name"] == "Algo":
                s["replicas"] = [doomed.url, engines["Algo"].url]
        r = make_router(cfg)
        body = {"model": "Algo", "prompt": "x", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        results: dict[int, list] = {}
        started = [threading.Event(), threading.Event()]

        def run(i: int) -> None:
            lines = []
            with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line[5:].strip())
                        if len(lines) == 3:
                            started[i].set()
            results[i] = lines

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        threads[0].start()
        assert started[0].wait(60)
        threads[1].start()          # least in-flight: lands on the other replica
        assert started[1].wait(60)
        doomed.proc.popen.kill()    # SIGKILL one engine while both streams run
        for t in threads:
            t.join(120)
            assert not t.is_alive()
        outcomes = sorted(results.values(), key=len)
        broken, whole = outcomes
        # the stream on the killed engine ended with one clean SSE error event, no [DONE]
        err = json.loads(broken[-1])
        assert err["error"]["code"] == "upstream_failed" and err["error"]["type"] == "upstream_error"
        assert "[DONE]" not in broken and all(json.loads(x).get("choices") for x in broken[:-1])
        # the other stream finished normally
        assert whole[-1] == "[DONE]" and len(whole) > 100
        # the router still serves. Two concurrent requests: both replicas look ready and idle to the router
        # (polling every 600 s), so one of them goes to the dead replica, fails to connect before any byte,
        # and is retried on the live one.
        first = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        first.set()

        holder = threading.Thread(target=hold)
        holder.start()
        assert first.wait(60)   # the holder streams (on the live replica, retried there if it hit the dead one)
        resp = httpx.post(r.url + "/v1/completions", timeout=60,
                          json={"model": "Algo", "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert resp.status_code == 200 and resp.headers["x-consort-specialist"] == "Algo"
        holder.join(120)
        routing = r.routing()["specialists"]["Algo"]["replicas"]
        dead = next(x for x in routing if x["url"] == doomed.url)
        assert dead["ready"] is False and "request failed" in dead["reason"]
        metrics = httpx.get(r.url + "/metrics").text
        assert 'consort_router_stream_errors_total{specialist="Algo"} 1.0' in metrics
        assert 'consort_router_retries_total{reason="connect",specialist="Algo"} 1.0' in metrics
        assert any(line.startswith("consort_router_requests_total") and 'code="200"' in line
                   for line in metrics.splitlines())
        assert r.get("/health")[0] == 200
        wait_engine_idle(engines["Algo"])
    finally:
        doomed.stop()


def test_engine_429_passes_through_and_a_spike_escalates_then_decays(demo_model, engines, make_router, logs):
    tight = procs.start_engine(demo_model, logs, "--num-blocks", "128", "--max-num-seqs", "1", "--max-waiting", "1",
                               name="Algo")
    try:
        cfg = router_config(engines, polling={"interval_s": 0.2},
                            admission={"spike_window_s": 3.0, "spike_min_count": 3, "spike_rate": 0.2,
                                       "escalate_every_s": 0.3, "threshold_levels": 1, "floor_levels": 1,
                                       "floor_start": 0, "floor_step": 100, "cooldown_s": 1.5,
                                       "retry_after_ms": 1500})
        for s in cfg["specialists"]:
            if s["name"] == "Algo":
                s["replicas"] = [tight.url]
        r = make_router(cfg)
        long_body = {"model": "cpp", "intent": "codegen", "prompt": "x", "max_tokens": 480, "ignore_eos": True,
                     "stream": True, "priority": 100}
        stop = threading.Event()

        def hold() -> None:   # keep the single running slot and the single waiting slot busy
            while not stop.is_set():
                stream_lines(r.url + "/v1/completions", long_body)

        holders = [threading.Thread(target=hold) for _ in range(2)]
        for t in holders:
            t.start()
            time.sleep(0.3)
        wait_for(lambda: (lambda s: s if s["running"] == 1 and s["waiting"] == 1 else None)(tight.status()), 30,
                 "engine full")
        # more requests: typed 429 passed through with Retry-After and the admission stamp
        rejected = 0
        deadline = time.monotonic() + 20
        while rejected < 6 and time.monotonic() < deadline:
            resp = r.post("/v1/completions", {"model": "cpp", "intent": "codegen", "prompt": "x", "max_tokens": 2,
                                              "priority": 100})
            if resp.status_code == 429:
                err = resp.json()["error"]
                assert err["type"] == "admission_rejected" and err["code"] == "queue_full"
                assert int(resp.headers["Retry-After"]) >= 1
                assert resp.headers["x-consort-admission"] == "rejected:queue_full"
                assert resp.headers["x-consort-specialist"] == "Algo"
                rejected += 1
            else:   # a holder was between two requests: the slot was free
                assert resp.status_code == 200, resp.text
            time.sleep(0.1)
        assert rejected == 6
        # sustained spike: threshold lowered first, then the codegen priority floor rises
        routing = wait_for(lambda: (lambda x: x if x["priority_floors"].get("codegen") == 0 else None)(r.routing()),
                           20, "priority floor raised")
        adm = routing["specialists"]["Algo"]["admission"]
        assert adm["level"] == 2 and adm["shadow_threshold_delta"] == pytest.approx(0.1) and adm["floor"] == 0
        assert adm["floor_intents"] == ["codegen"]
        metrics = httpx.get(r.url + "/metrics").text
        assert 'consort_router_priority_floor{intent="codegen"} 0.0' in metrics
        assert 'consort_router_admission_level{specialist="Algo"} 2.0' in metrics
        # below the floor: rejected by the router itself, typed, with Retry-After
        resp = r.post("/v1/completions", {"model": "cpp", "intent": "codegen", "prompt": "x", "max_tokens": 1,
                                          "priority": -5})
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "priority_floor"
        assert resp.headers["Retry-After"] == "2" and resp.headers["x-consort-admission"] == "rejected:priority_floor"
        # other intents are untouched
        resp = r.post("/v1/completions", {"model": "cpp", "intent": "review", "prompt": "x", "max_tokens": 1,
                                          "priority": -5})
        assert resp.status_code == 200 and resp.headers["x-consort-admission"] == "admitted"
        stop.set()
        for t in holders:
            t.join(120)
        wait_engine_idle(tight)
        # at/above the floor: admitted and stamped with the floor in force
        resp = r.post("/v1/completions", {"model": "cpp", "intent": "codegen", "prompt": "x", "max_tokens": 1})
        if r.routing()["priority_floors"].get("codegen") is not None:
            assert resp.status_code == 200 and resp.headers["x-consort-admission"].startswith("floor:")
        # spike over: both knobs decay back
        routing = wait_for(lambda: (lambda x: x if x["specialists"]["Algo"]["admission"]["level"] == 0 else None)(
            r.routing()), 30, "admission knobs decayed")
        assert routing["priority_floors"] == {}
        resp = r.post("/v1/completions", {"model": "cpp", "intent": "codegen", "prompt": "x", "max_tokens": 1,
                                          "priority": -5})
        assert resp.status_code == 200 and resp.headers["x-consort-admission"] == "admitted"
    finally:
        tight.stop()
