"""Scale to zero in local mode: `consort up` stops an idle engine and starts it again when a request
arrives; the router holds the lane's requests meanwhile, so a burst against the stopped engine gets
no error. Real processes on 127.0.0.1 (one demo-model Specialist, the default EnsembleRouter)."""
from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from procs import consort_up, free_port, manifest_dir

IDLE_AFTER_S = 8
BURST = 8

MANIFEST = f"""
apiVersion: consort.dev/v1alpha1
kind: Specialist
metadata:
  name: algo
spec:
  model: {{source: demo://tiny}}
  replicas: 1
  resources: {{gpus: 0, cpu: "1", memory: 2Gi}}
  kv: {{blockSize: 16, numBlocks: 256}}
  scheduler: {{maxNumSeqs: 16, maxNumBatchedTokens: 512}}
  warmupTimeoutSeconds: 120
  scaleToZero: {{idleAfter: {IDLE_AFTER_S}s, holdTimeoutSeconds: 60, maxHeld: 32}}
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except (ProcessLookupError, OSError):
        return False


def wait_for(predicate, timeout: float, what: str, log_path, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s:\n{log_path.read_text()[-3000:]}"
        time.sleep(every)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text format, by name and exact label set (any label order)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        m = re.match(r"^([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and set(filter(None, (m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return 0.0


@pytest.mark.timeout(300)
def test_an_idle_engine_stops_and_a_burst_while_stopped_is_held_then_served(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with consort_up(tmp_path, port, manifests=manifest_dir(tmp_path, MANIFEST)) as (proc, log_path):
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        # (On a slow box the engine may already have gone idle before this: then this one starts it.)
        first = client.completions.create(model="algo", prompt="int main() {", max_tokens=4)
        assert first.usage.completion_tokens == 4
        stops = log_path.read_text().count("scaling to zero")

        # Idle for the window after that answer: consort up stops the engine (the operator's own
        # decision). A request sent the moment it stops finds the router's last poll still saying
        # ready (polls are 0.5 s apart): it is held and the engine started again, never refused.
        wait_for(lambda: log_path.read_text().count("scaling to zero") > stops, IDLE_AFTER_S + 15, "scale to zero",
                 log_path, every=0.01)
        at_stop = client.completions.with_raw_response.create(model="algo", prompt="int g() {", max_tokens=4)
        assert at_stop.http_response.status_code == 200
        stops = log_path.read_text().count("scaling to zero")
        pids = re.findall(r"engine algo: (?:pid|a request is waiting; starting 1 process\(es\) \(pid) (\d+)",
                          log_path.read_text())
        pid = int(pids[-1])

        wait_for(lambda: log_path.read_text().count("scaling to zero") > stops, IDLE_AFTER_S + 15, "scale to zero",
                 log_path)
        wait_for(lambda: not alive(pid), 30, "the idle engine exiting", log_path)
        # The router sees the lane with no ready replica at its next poll.
        wait_for(lambda: metric(httpx.get(f"{base}/metrics", timeout=5).text, "consort_router_replica_ready",
                                specialist="algo", replica="0") == 0, 10, "the router noticing", log_path)

        def one(i: int) -> tuple[int, float, str]:
            t0 = time.monotonic()
            r = client.completions.with_raw_response.create(model="algo", prompt=f"void f{i}() {{", max_tokens=4)
            return r.http_response.status_code, time.monotonic() - t0, r.headers["x-consort-specialist"]

        starts_before = metric(httpx.get(f"{base}/metrics", timeout=5).text, "consort_router_cold_starts_total",
                               specialist="algo")
        t0 = time.monotonic()
        with ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(one, range(BURST)))
        assert [code for code, _, _ in results] == [200] * BURST, results
        assert {who for _, _, who in results} == {"algo"}
        first_answer = min(s for _, s, _ in results)
        text = log_path.read_text()
        cold = float(re.findall(r"engine algo: warm after a cold start of ([0-9.]+) s", text)[-1])
        engine_log = (tmp_path / "run" / "logs" / "engine-algo-0.log").read_text()
        ready, load, warmup = map(float, re.findall(
            r"ready in ([0-9.]+) s from process start \(load ([0-9.]+) s, warmup ([0-9.]+) s\)", engine_log)[-1])
        print(f"\nscale from zero: {BURST} requests while stopped, 0 errors; engine cold start {cold:.1f} s "
              f"(process start {ready - load - warmup:.1f} s, model load {load:.1f} s, warmup {warmup:.1f} s, "
              f"consort up and router {cold - ready:.1f} s), first answer after {first_answer:.1f} s, last after "
              f"{max(s for _, s, _ in results):.1f} s (burst took {time.monotonic() - t0:.1f} s)")
        new_pid = int(re.findall(r"engine algo: a request is waiting; starting 1 process\(es\) \(pid (\d+)\)", text)[-1])
        assert new_pid != pid and alive(new_pid)

        m = httpx.get(f"{base}/metrics", timeout=5).text
        assert metric(m, "consort_router_cold_starts_total", specialist="algo") == starts_before + 1   # one for the burst
        assert metric(m, "consort_router_hold_seconds_count", specialist="algo", outcome="warm") >= BURST
        assert metric(m, "consort_router_hold_seconds_count", specialist="algo", outcome="timeout") == 0
        assert metric(m, "consort_router_held_requests", specialist="algo") == 0
