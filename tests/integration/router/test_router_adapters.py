"""Adapter-aware routing with real processes: two replicas of one specialist, an adapter hot-loaded
on one of them; requests for the adapter go where it is loaded, base requests anywhere."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import procs
from conftest import router_config, wait_for

pytestmark = pytest.mark.timeout(300)


def served_with_adapter(engine: procs.Engine, adapter: str) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:request_success_total{") and f'adapter="{adapter}"' in ln)


def test_adapter_requests_go_to_the_replica_that_has_the_adapter(engines, demo_models, logs, make_router, tmp_path):
    extra = procs.start_engine(demo_models["Algo"], logs, "--num-blocks", "128", name="Algo")
    try:
        adapter = procs.write_lora_adapter(demo_models["Algo"], tmp_path / "v2")
        r = httpx.post(extra.url + "/v1/adapters", json={"name": "v2", "path": str(adapter)}, timeout=60)
        assert r.status_code == 200, r.text
        cfg = router_config(engines)
        for s in cfg["specialists"]:
            if s["name"] == "Algo":
                s["replicas"] = [engines["Algo"].url, extra.url]
        router = make_router(cfg)

        def polled():
            reps = router.routing()["specialists"]["Algo"]["replicas"]
            return reps if any("v2" in rep["adapters"] for rep in reps) else None
        wait_for(polled, 20, "the router to see v2 on one replica")
        # concurrent: least-load alone would spread them over both replicas (in-flight accounting)
        with ThreadPoolExecutor(6) as pool:
            resps = list(pool.map(lambda _: httpx.post(router.url + "/v1/completions", timeout=60, json={
                "model": "Algo", "prompt": "x", "max_tokens": 8, "ignore_eos": True, "adapter": "v2"}), range(6)))
        for resp in resps:
            assert resp.status_code == 200, resp.text       # never sent to the replica without v2 (404)
            assert resp.headers["x-consort-adapter"] == "v2" and resp.headers["x-consort-specialist"] == "Algo"
        assert served_with_adapter(extra, "v2") == 6 and served_with_adapter(engines["Algo"], "v2") == 0
        # base requests still spread over both replicas (least load); neither refuses them
        for _ in range(4):
            assert httpx.post(router.url + "/v1/completions", timeout=60,
                              json={"model": "Algo", "prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        extra.stop()
