"""A router pod being deleted: SIGTERM (after the pod's preStop) closes the listener at once, and the
requests already in flight, streams included, finish on the old process before it exits."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from conftest import router_config


def test_sigterm_lets_the_streams_in_flight_finish_and_refuses_new_connections(engines, make_router):
    r = make_router(router_config(engines))
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", r.url + "/v1/completions", timeout=120,
                          json={"model": "STL", "prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "the stream never started"
    r.proc.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:
        httpx.get(r.url + "/health", timeout=2)
        refused = False
    except httpx.TransportError:
        refused = True
    t.join(120)
    assert not t.is_alive()
    assert refused, "the listener still accepted a new connection after SIGTERM"
    assert events[-1] == "[DONE]", events[-3:]
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 300, f"{usage}: the stream was cut"
    assert r.proc.popen.wait(30) == 0, r.proc.tail()
