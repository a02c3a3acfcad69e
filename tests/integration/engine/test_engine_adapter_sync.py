"""`consort engine --adapters-file`: the engine serves the adapters a file lists (the Specialist's mounted
ConfigMap) and follows the file: a rotation is a hot-load under traffic, not a restart."""
from __future__ import annotations

import json
import threading
import time

import httpx
import procs
import pytest

from consort_engine.serving.adapter_sync import DesiredAdapter, plan_adapters

BODY = {"prompt": "struct Point { int x; int y; };", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}


def write(path, *entries: tuple[str, str, str]) -> None:
    tmp = path.with_suffix(".tmp")     # replaced atomically, as the kubelet swaps a ConfigMap volume's files
    tmp.write_text(json.dumps({"adapters": [{"name": n, "path": p, "source": s} for n, p, s in entries]}))
    tmp.replace(path)


def wait_states(eng, want: dict[str, str], timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = eng.status()
        if s["adapters"] == want:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"adapters {s['adapters']} (errors {s['adapter_errors']}), wanted {want}")
        time.sleep(0.2)


def test_plan_unloads_changed_paths_and_does_not_retry_a_failed_entry():
    a1, a2, b = DesiredAdapter("a", "/p/a1"), DesiredAdapter("a", "/p/a2"), DesiredAdapter("b", "/p/b")
    assert plan_adapters({"a": a1}, {}, {}).load == [a1]
    plan = plan_adapters({"a": a2, "b": b}, {"a": "/p/a1", "old": "/p/o"}, {"b": b})
    assert plan.unload == ["a", "old"] and plan.load == [a2]          # b failed as it is: not retried
    assert plan_adapters({"b": DesiredAdapter("b", "/p/b2")}, {}, {"b": b}).load == [DesiredAdapter("b", "/p/b2")]
    assert not plan_adapters({"a": a1}, {"a": "/p/a1"}, {})


def test_engine_follows_its_adapters_file_under_traffic(demo_model, engine_logs, tmp_path):
    spec = tmp_path / "adapters.json"
    write(spec, ("style", str(tmp_path / "lora-1"), "demo://lora?seed=1"))
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "64", "--max-adapters", "2",
                             "--adapters-file", str(spec), name="spec-sync")
    codes: list[int] = []
    stop = threading.Event()

    def steady_load() -> None:          # base-model and adapter traffic through the whole rotation
        with httpx.Client(timeout=60) as c:
            while not stop.is_set() and len(codes) < 2000:
                codes.append(c.post(eng.url + "/v1/completions", json=BODY).status_code)

    try:
        # /ready waited for the adapter the file listed at start (written from its demo:// source)
        assert eng.status()["adapters"] == {"style": "loaded"}
        tuned = httpx.post(eng.url + "/v1/completions", json={**BODY, "adapter": "style"}, timeout=60).json()
        base = httpx.post(eng.url + "/v1/completions", json=BODY, timeout=60).json()
        assert tuned["choices"][0]["token_ids"] != base["choices"][0]["token_ids"]
        load = threading.Thread(target=steady_load)
        load.start()
        # A broken adapter is reported, not fatal, and does not take the replica out of rotation.
        write(spec, ("style", str(tmp_path / "lora-1"), "demo://lora?seed=1"), ("broken", str(tmp_path / "nope"), ""))
        s = wait_states(eng, {"style": "loaded", "broken": "failed"})
        assert "nope" in s["adapter_errors"]["broken"]
        assert httpx.get(eng.url + "/ready", timeout=10).status_code == 200
        # Rotation: the new adapter is hot-loaded, the old one unloaded once nothing uses it.
        write(spec, ("style-v2", str(tmp_path / "lora-2"), "demo://lora?seed=2"))
        wait_states(eng, {"style-v2": "loaded"})
        v2 = httpx.post(eng.url + "/v1/completions", json={**BODY, "adapter": "style-v2"}, timeout=60).json()
        assert v2["choices"][0]["token_ids"] not in (tuned["choices"][0]["token_ids"], base["choices"][0]["token_ids"])
        gone = httpx.post(eng.url + "/v1/completions", json={**BODY, "adapter": "style"}, timeout=60)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"
        models = [m["id"] for m in httpx.get(eng.url + "/v1/models", timeout=10).json()["data"]]
        assert models == ["spec-sync", "spec-sync:style-v2"]
        stop.set()
        load.join(60)
        print(f"steady load through the rotation: {len(codes)} requests, {sum(c != 200 for c in codes)} failed")
        assert codes and all(c == 200 for c in codes), sorted(set(codes))
        s = eng.status()
        assert s["kv_free_blocks"] == s["kv_total_blocks"]
    finally:
        stop.set()
        assert eng.stop() == 0, eng.proc.tail()
