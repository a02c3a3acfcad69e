"""GET /v1/kv/events?wait=S: a caught-up subscriber's request is held until the engine stores a block
(then it answers at once with the event) or the wait ends (then it answers with no events); a wait
out of bounds is a typed 400; an engine told to stop answers a held request at once."""
from __future__ import annotations

import threading
import time

import httpx

import procs

PROMPT = [(i * 53) % 3000 + 11 for i in range(70)]     # token ids of their own: blocks no other test stores
WAIT_S = 20.0


def test_a_held_request_answers_at_the_next_event(engine):
    with httpx.Client(timeout=120) as c:
        hello = c.get(engine.url + "/v1/kv/events").json()
        caught_up = {"epoch": hello["epoch"], "since": hello["seq"], "wait": str(WAIT_S)}
        reply: dict = {}

        def held() -> None:
            t0 = time.monotonic()
            reply["body"] = c.get(engine.url + "/v1/kv/events", params=caught_up).json()
            reply["s"] = time.monotonic() - t0

        waiter = threading.Thread(target=held)
        waiter.start()
        time.sleep(0.5)                       # the request is waiting on the engine by now
        assert "body" not in reply            # nothing stored yet: still held
        r = c.post(engine.url + "/v1/completions", json={"model": "spec", "prompt": PROMPT, "max_tokens": 2,
                                                          "temperature": 0})
        assert r.status_code == 200, r.text
        waiter.join(WAIT_S + 30)
        body = reply["body"]
        assert body["epoch"] == hello["epoch"] and body["seq"] > hello["seq"]
        assert any(e["type"] == "stored" and e["medium"] == "pool" for e in body["events"])
        assert reply["s"] < WAIT_S            # answered by the event, not by the end of the wait


def test_a_wait_with_no_event_ends_empty_and_bad_waits_are_400(engine):
    with httpx.Client(timeout=60) as c:
        hello = c.get(engine.url + "/v1/kv/events").json()
        t0 = time.monotonic()
        quiet = c.get(engine.url + "/v1/kv/events",
                      params={"epoch": hello["epoch"], "since": hello["seq"], "wait": "0.4"}).json()
        assert time.monotonic() - t0 >= 0.4
        assert quiet == {"epoch": hello["epoch"], "seq": hello["seq"], "events": [], "more": False}
        # Nothing to wait for when there is something to read: a snapshot (no since) comes at once.
        t0 = time.monotonic()
        assert "snapshot" in c.get(engine.url + "/v1/kv/events", params={"wait": "25"}).json()
        assert time.monotonic() - t0 < 25
        for wait in ("31", "-1", "nan", "inf", "soon", "1" * 20):
            r = c.get(engine.url + "/v1/kv/events", params={"since": hello["seq"], "wait": wait})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_wait", (wait, r.text)


def test_a_held_request_does_not_hold_up_a_stopping_engine(demo_model, engine_logs):
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "32", name="held")
    reply: dict = {}
    try:
        with httpx.Client(timeout=60) as c:
            hello = c.get(eng.url + "/v1/kv/events").json()

            def held() -> None:
                r = c.get(eng.url + "/v1/kv/events",
                          params={"epoch": hello["epoch"], "since": hello["seq"], "wait": "30"})
                reply["status"], reply["body"] = r.status_code, r.json()

            waiter = threading.Thread(target=held)
            waiter.start()
            time.sleep(0.5)
            assert "status" not in reply
            t0 = time.monotonic()
            code = eng.stop()                  # SIGTERM: the drain answers the held request first
            stopped = time.monotonic() - t0
            waiter.join(30)
    finally:
        eng.stop()
    assert code == 0, eng.proc.tail()
    assert reply["status"] == 200 and reply["body"]["events"] == []
    assert stopped < 30                        # not held for the whole wait
