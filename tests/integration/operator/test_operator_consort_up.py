"""`consort up -f examples/local`: real engine and router processes from the same manifests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
CONSORT = str(Path(sys.executable).with_name("consort"))


from procs import consort_up, free_port, manifest_dir  # noqa: E402


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; consort up reaps its children.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_consort_up_serves_openai_and_stops_cleanly(tmp_path):
    port = free_port()
    started = time.monotonic()
    with consort_up(tmp_path, port) as (proc, log_path):
        ready_s = time.monotonic() - started
        text = log_path.read_text()
        pids = [int(p) for p in re.findall(r": pid (\d+),", text)]
        assert len(pids) == 4, text          # three engines + the router
        assert "engine algo: warm" in text and "engine template: warm" in text and "engine stl: warm" in text

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        raw = client.completions.with_raw_response.create(model="stl", prompt="std::ranges::sort(v,", max_tokens=8)
        completion = raw.parse()
        assert raw.headers["x-consort-specialist"] == "stl"
        assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"
        routed = client.chat.completions.with_raw_response.create(
            model="cpp-local", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-consort-intent": "templates"})
        assert routed.headers["x-consort-specialist"] == "template"
        # the engines are closed to everyone but the router: a generated credential, in a 0600 file
        cred = tmp_path / "run" / "engine-credential"
        assert cred.stat().st_mode & 0o777 == 0o600 and len(cred.read_text().strip()) >= 32
        engine_url = re.search(r"engine stl: pid \d+, (http://\S+)", text).group(1)
        direct = httpx.post(engine_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert direct.status_code == 401 and direct.json()["error"]["code"] == "invalid_credential"
        adapter = httpx.post(engine_url + "/v1/adapters", json={"name": "x", "path": "/etc"}, timeout=30)
        assert adapter.status_code == 401
        assert httpx.get(engine_url + "/health", timeout=10).status_code == 200

        time.sleep(2)
        idle_rss_gib = sum(rss_kib(p) for p in pids) / 2**20
        print(f"\nconsort up: ready in {ready_s:.1f} s, idle RSS of engines+router {idle_rss_gib:.2f} GiB")
        assert idle_rss_gib <= 4.0

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log_path.read_text()
        assert "stopped" in log_path.read_text().splitlines()[-1]
        assert [p for p in pids if alive(p)] == []


@pytest.mark.timeout(400)
def test_a_killed_engine_is_restarted_while_the_others_and_the_fallback_serve(tmp_path):
    port = free_port()
    with consort_up(tmp_path, port) as (proc, log_path):
        algo_pid = int(re.search(r"engine algo: pid (\d+),", log_path.read_text()).group(1))

        # A second `consort up` on the same ports fails at once, naming the port.
        second = subprocess.run([CONSORT, "up", "-f", str(REPO / "examples" / "local"), "--port", str(port),
                                 "--run-dir", str(tmp_path / "run2")], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1] == \
            f"consort up: port {port} on 127.0.0.1 is in use (is another `consort up` running?)", second.stderr
        assert "Traceback" not in second.stderr + second.stdout

        from openai import APIStatusError, OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        os.kill(algo_pid, signal.SIGKILL)
        killed = time.monotonic()
        served: list[str] = []
        pinned_to_dead: list[str] = []
        while time.monotonic() - killed < 90:
            # algo's lane falls back to stl; the other specialists answer as before
            r = client.completions.with_raw_response.create(model="cpp-local", prompt="int f() {", max_tokens=2,
                                                            extra_headers={"x-consort-intent": "codegen"})
            served.append(r.headers["x-consort-specialist"])
            pinned = client.completions.with_raw_response.create(model="template", prompt="x", max_tokens=2)
            assert pinned.headers["x-consort-specialist"] == "template"
            try:   # pinned to the dead one: its fallback answers, or a typed 503; never a 500 or a hang
                dead = client.completions.with_raw_response.create(model="algo", prompt="x", max_tokens=2)
                pinned_to_dead.append(dead.headers["x-consort-specialist"])
            except APIStatusError as e:
                assert e.status_code == 503 and e.response.json()["error"]["type"], e.response.text
                pinned_to_dead.append("503")
            if "engine algo: warm again" in log_path.read_text():
                break
            time.sleep(0.3)
        back_s = time.monotonic() - killed
        text = log_path.read_text()
        assert "engine algo: warm again" in text, text[-3000:]
        assert back_s < 60, f"algo was back only after {back_s:.0f} s"
        print(f"\nalgo killed: back in {back_s:.1f} s; codegen served by {served}; pinned to algo: {pinned_to_dead}")
        assert "stl" in served, served
        assert pinned_to_dead and set(pinned_to_dead) <= {"algo", "stl", "503"}, pinned_to_dead
        died = text[text.index(f"engine algo (pid {algo_pid}) exited with code -9"):]
        assert "specialist 'algo'" in died.split("engine algo: restarted")[0], died[:2000]  # its own lines
        r = client.completions.with_raw_response.create(model="cpp-local", prompt="int f() {", max_tokens=2,
                                                        extra_headers={"x-consort-intent": "codegen"})
        deadline = time.monotonic() + 10
        while r.headers["x-consort-specialist"] != "algo" and time.monotonic() < deadline:
            time.sleep(0.5)   # the router's next poll sees it ready
            r = client.completions.with_raw_response.create(model="cpp-local", prompt="int f() {", max_tokens=2,
                                                            extra_headers={"x-consort-intent": "codegen"})
        assert r.headers["x-consort-specialist"] == "algo"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log_path.read_text()[-2000:]


HYBRID = """\
apiVersion: consort.dev/v1alpha1
kind: EnsembleRouter
metadata: {name: hybrid-local}
spec:
  specialistSelector: {matchLabels: {consort.dev/ensemble: hybrid-local}}
---
apiVersion: consort.dev/v1alpha1
kind: Specialist
metadata:
  name: mamba
  labels: {consort.dev/ensemble: hybrid-local}
spec:
  model: {source: "demo://tiny-bamba?seed=1"}
  resources: {gpus: 0, cpu: 400m, memory: 2Gi}
  kv: {blockSize: 16, numBlocks: 256}
  scheduler: {maxNumSeqs: 8, maxNumBatchedTokens: 512}
  warmupTimeoutSeconds: 120
"""


@pytest.mark.timeout(300)
def test_a_hybrid_demo_specialist_serves_through_the_router(tmp_path):
    """demo://tiny-bamba: a Bamba (Mamba2 mixers, attention in the last layer) written once into the cache."""
    import json

    from consort_operator.local import CACHE
    from openai import OpenAI

    port = free_port()
    with consort_up(tmp_path, port, manifests=manifest_dir(tmp_path, HYBRID)) as (proc, log_path):
        path = CACHE / "demo-models" / "tiny-bamba-1"
        assert f"model {path}," in (tmp_path / "run" / "logs" / "engine-mamba-0.log").read_text()
        assert json.loads((path / "config.json").read_text())["model_type"] == "bamba"
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model="mamba", max_tokens=6, messages=[{"role": "user", "content": "std::vector"}])
        assert raw.headers["x-consort-specialist"] == "mamba"
        chat = raw.parse()
        assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
