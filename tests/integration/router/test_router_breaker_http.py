"""Correctness breakers end to end: /v1/feedback trips a specialist to shadow-only with its fallback
serving, shadow feedback recovers it without flapping, and a restart keeps the breaker state."""
from __future__ import annotations

import json

import pytest

from conftest import router_config

pytestmark = pytest.mark.timeout(300)
BREAKER = {"window": 10, "min_samples": 5, "floor": 0.7, "recovery_margin": 0.1, "trip_after": 3, "reset_after": 5,
           "half_open_samples": 4, "fresh_samples": 0, "fresh_shadow_fraction": 1.0}


def ask(r, intent="codegen"):
    """The answer's headers; x-consort-feedback-id names it for /v1/feedback."""
    headers = {"x-consort-intent": intent}
    raw = r.client().completions.with_raw_response.create(model="cpp", prompt="int main() {", max_tokens=2,
                                                          temperature=0, extra_body={"ignore_eos": True},
                                                          extra_headers=headers)
    return raw.headers


def feedback(r, headers, correct, specialist=None):
    body = {"feedback_id": headers["x-consort-feedback-id"], "correct": correct}
    if specialist:
        body["specialist"] = specialist
    resp = r.post("/v1/feedback", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def algo(r):
    return r.routing()["specialists"]["Algo"]["breaker"]


def trip_algo(r, prefix="f"):
    states = []
    for i in range(12):
        h = ask(r)
        assert h["x-consort-specialist"] == "Algo"
        out = feedback(r, h, False)
        states.append(out["breaker"])
        if out["breaker"] == "open":
            break
    return states


def test_trip_to_shadow_only_then_recover_without_flapping(engines, make_router, tmp_path):
    r = make_router(router_config(engines, breaker=BREAKER), workdir=tmp_path / "b")
    # healthy feedback keeps it closed
    for i in range(5):
        assert feedback(r, ask(r), True)["breaker"] == "closed"
    # sustained failures: trips once, after `trip_after` consecutive breach samples
    states = trip_algo(r)
    # 5 passes + failures: the rate drops below 0.7 at the 3rd failure; trip_after=3 -> open at the 5th
    assert states == ["closed"] * 4 + ["open"], states
    b = algo(r)
    assert b["state"] == "open" and b["rate"] < 0.7 and b["transitions"] == 1

    # shadow-only: the fallback (STL) takes codegen as primary, Algo gets the shadow copy
    h = ask(r)
    assert (h["x-consort-specialist"], h["x-consort-breaker"], h["x-consort-shadow"]) == ("STL", "open", "Algo")
    # feedback about the answer the caller saw goes to STL, about the shadow to Algo
    resp = r.post("/v1/feedback", {"feedback_id": h["x-consort-feedback-id"], "specialist": "Template",
                                   "correct": True})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "not_involved"
    assert feedback(r, h, True)["specialist"] == "STL"
    # each id counts once (the shadow's verdict needs an answer of its own)
    resp = r.post("/v1/feedback", {"feedback_id": h["x-consort-feedback-id"], "specialist": "Algo", "correct": True})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_feedback_id"

    # recovery comes only from sustained good shadow results; record every state on the way
    seen = []
    for i in range(40):
        h = ask(r)
        if h["x-consort-specialist"] == "STL":
            assert h["x-consort-shadow"] == "Algo"
            out = feedback(r, h, True, specialist="Algo")
        else:  # half_open: Algo primary again, heavily shadowed to its fallback
            assert h["x-consort-specialist"] == "Algo" and h["x-consort-breaker"] == "half_open"
            assert h["x-consort-shadow"] == "STL"
            out = feedback(r, h, True)
        seen.append(out["breaker"])
        if out["breaker"] == "closed":
            break
    # open ... open, half_open ... half_open, closed: each state once, in order, no flapping
    collapsed = [s for j, s in enumerate(seen) if j == 0 or seen[j - 1] != s]
    assert collapsed == ["open", "half_open", "closed"], seen
    assert seen.count("open") >= 5  # not before a sustained recovery run
    assert algo(r)["transitions"] == 3
    h = ask(r)
    assert (h["x-consort-specialist"], h["x-consort-breaker"], h["x-consort-shadow"]) == ("Algo", "closed", "none")

    # short dips around the floor after recovery do not trip it again
    pattern = [True, True, True, False, True, True, False, True, True, True, True, False] * 3
    for i, ok in enumerate(pattern):
        assert feedback(r, ask(r), ok)["breaker"] == "closed"
    metrics = r.get("/metrics")[1]
    assert 'consort_router_breaker_transitions_total{specialist="Algo",to="open"} 1.0' in metrics
    assert 'consort_router_breaker_state{specialist="Algo"} 0.0' in metrics


def test_restart_keeps_breaker_state(engines, make_router, tmp_path, logs):
    work = tmp_path / "restart"
    cfg = router_config(engines, breaker=BREAKER)
    r1 = make_router(cfg, workdir=work)
    assert trip_algo(r1) == ["closed"] * 6 + ["open"]  # min_samples 5, then 3 breach samples
    before = algo(r1)
    assert before["state"] == "open"
    assert r1.stop() == 0
    saved = json.loads((work / "breakers.json").read_text())
    assert saved["breakers"]["Algo"]["state"] == "open" and len(saved["breakers"]["Algo"]["samples"]) == 7

    r2 = make_router(cfg, workdir=work)
    after = algo(r2)
    assert (after["state"], after["samples"], after["transitions"]) == ("open", before["samples"], 1)
    h = ask(r2)
    assert (h["x-consort-specialist"], h["x-consort-breaker"]) == ("STL", "open")
    # a new lane revision (refreshed checkpoint) restarts its window and half-opens it
    for s in cfg["specialists"]:
        if s["name"] == "Algo":
            s["revision"] = "v2"
    import yaml
    r2.config_path.write_text(yaml.safe_dump(cfg))
    from conftest import wait_for
    b = wait_for(lambda: (lambda x: x if x["state"] == "half_open" else None)(algo(r2)), 20, "revision applied")
    assert b["samples"] == 0 and b["fresh"] is False  # fresh_samples=0 in this config
