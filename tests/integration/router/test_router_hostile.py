"""Issue 25 through the real router process: a prompt built to make a detector backtrack, an
EnsembleRouter pattern that backtracks exponentially, and an out-of-range priority neither stall the
router (/health under 100 ms meanwhile) nor keep a plain request from completing. The upstream is a
stand-in engine (faulty_engine.py ok): only the router's own work is measured."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import EXAMPLES

import procs

FAKE = Path(__file__).with_name("faulty_engine.py")
SFINAE_BOMB = "template<" * (64 * 1024 // 9)          # the old pattern: 2.7-8 s of the event loop
EXPONENTIAL = r"(a+)+$"                                 # an operator's pattern; "a" * 24 + "b": ~3 s in-process


@pytest.fixture(scope="module")
def router(tmp_path_factory, logs):
    from conftest import start_router
    port = procs.free_port()
    fake = procs.start_process([sys.executable, str(FAKE), str(port), "ok"], f"fake-ok-{port}", logs)
    procs.wait_http(f"http://127.0.0.1:{port}/ready", fake, timeout=30)
    url = f"http://127.0.0.1:{port}"
    cfg = {
        "ensemble": "cpp",
        "specialists": [{"name": "Template", "replicas": [url], "intents": ["templates"]},
                        {"name": "Algo", "replicas": [url], "intents": ["codegen"]},
                        {"name": "Debug", "replicas": [url], "intents": ["debug"]}],
        "detectors": [{"name": "sfinae", "specialist": "Template", "builtin": "sfinae_templates", "min_matches": 3},
                      {"name": "gdb", "specialist": "Debug", "builtin": "gdb_transcript", "min_matches": 2},
                      {"name": "own", "specialist": "Algo", "patterns": [EXPONENTIAL], "min_matches": 1}],
        "classifier": {"examples_path": str(EXAMPLES), "on_reject": "default"},
        "default_specialist": "Algo",
        "shadow": {"enabled": False},
        "verifier": {"sample_rate": 0.0},
        "polling": {"interval_s": 0.2},
    }
    r = start_router(tmp_path_factory.mktemp("hostile-router"), cfg, logs)
    yield r
    r.stop()
    fake.stop()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def under_load(url: str, hostile: list[dict]) -> tuple[list[httpx.Response], list[float], httpx.Response]:
    """Sends the hostile bodies one after another from a thread while probing /health every 20 ms and
    sending one plain request; returns their answers, the probes' latencies and the plain answer."""
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.extend(post(url, b) for b in hostile))
    sender.start()
    latencies, plain = [], None
    with httpx.Client(timeout=10) as c:
        while sender.is_alive() or plain is None:
            t0 = time.monotonic()
            assert c.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            if plain is None:
                plain = post(url, {"model": "cpp", "prompt": "sort a vector", "max_tokens": 2})
            time.sleep(0.02)
    sender.join()
    return answers, latencies, plain


def test_a_prompt_that_made_a_detector_backtrack_is_routed_without_stalling(router):
    hostile = [{"model": "cpp", "prompt": SFINAE_BOMB, "max_tokens": 2},
               {"model": "cpp", "prompt": "Thread 1 " * 7000, "max_tokens": 2}] * 3
    answers, latencies, plain = under_load(router.url, hostile)
    assert [r.status_code for r in answers] == [200] * len(hostile), [r.text[:200] for r in answers]
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "ok"
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"


def test_an_operator_pattern_that_backtracks_exponentially_counts_as_no_match(router):
    hostile = [{"model": "cpp", "prompt": "a" * 24 + "b", "max_tokens": 2}] * 3
    answers, latencies, plain = under_load(router.url, hostile)
    assert [r.status_code for r in answers] == [200] * 3
    assert all(r.headers["x-consort-specialist"] == "Algo" for r in answers)   # the default, not the detector
    assert plain.status_code == 200
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert "consort_router_detector_timeouts_total 3.0" in metrics, [
        line for line in metrics.splitlines() if "detector" in line]


@pytest.mark.parametrize("priority", [10 ** 18, -(10 ** 18), 1001])
def test_an_out_of_range_priority_is_a_typed_400_at_the_router(router, priority):
    r = post(router.url, {"model": "cpp", "prompt": "x", "max_tokens": 2, "priority": priority})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_value", "priority")
