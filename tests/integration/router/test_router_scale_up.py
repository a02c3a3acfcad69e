"""A scale-up under steady load with real processes: the router knows a second replica of Algo before
its engine exists (as it learns an address from the EndpointSlices of a pod that is not Ready yet), the
engine then starts, loads and warms; the router sends it nothing until its /ready says warm, then
shares the load with it. No request fails on the way (docs/autoscaling.md)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import procs
from conftest import router_config, wait_for

pytestmark = pytest.mark.timeout(300)


def engine_counter(engine: procs.Engine, name: str, **labels: str) -> float:
    """Sum of `name` over the engine's series carrying `labels` (0 while it has none)."""
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name + "{") and all(w in ln for w in want))


def engine_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False                              # not listening yet


def router_retries(router) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("consort_router_retries_total{"))


def test_a_new_replica_takes_traffic_only_once_warm(engines, demo_models, logs, make_router):
    new_port = procs.free_port()
    new_url = f"http://127.0.0.1:{new_port}"
    cfg = router_config(engines)
    for s in cfg["specialists"]:
        if s["name"] == "Algo":
            s["replicas"] = [engines["Algo"].url, new_url]
    router = make_router(cfg)

    def replica(url: str) -> dict:
        return next(r for r in router.routing()["specialists"]["Algo"]["replicas"] if r["url"] == url)

    assert replica(new_url)["ready"] is False
    codes: list[int] = []
    stop = threading.Event()

    def steady_load(_: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                resp = client.post(router.url + "/v1/completions",
                                   json={"model": "Algo", "prompt": "x", "max_tokens": 4, "ignore_eos": True})
                codes.append(resp.status_code)

    new = None
    with ThreadPoolExecutor(3) as pool:
        load = [pool.submit(steady_load, i) for i in range(3)]
        try:
            wait_for(lambda: len(codes) >= 6, 60, "steady load through the router")
            new = procs.start_engine(demo_models["Algo"], logs, "--num-blocks", "128", name="Algo", port=new_port,
                                     wait_ready=False)
            # While it loads and warms, the router holds it out of rotation (judged only between two
            # not-ready answers of the engine, so the engine turning warm in between is no race).
            held_out = 0
            while not engine_ready(new_url):
                routed = replica(new_url)["ready"]
                if not engine_ready(new_url):
                    assert routed is False
                    held_out += 1
                assert new.proc.alive(), new.proc.tail()
                time.sleep(0.05)
            assert held_out > 0
            before = len(codes)
            # Once warm it joins: least-load spreads three concurrent clients over both replicas.
            wait_for(lambda: engine_counter(new, "vllm:request_success_total") >= 3, 60,
                     "the warm replica to serve requests")
            served_during = len(codes) - before
        finally:
            stop.set()
            for f in load:
                f.result()
    try:
        assert replica(new_url)["ready"] is True
        assert codes and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
        # ... and no request was tried on it and retried elsewhere (refused or `warming`) either.
        assert router_retries(router) == 0
        # Nothing reached it while it was warming: it never refused a request as `warming`.
        assert engine_counter(new, "consort_admission_rejected_total", code="warming") == 0
        print(f"scale-up under load: {len(codes)} requests, all 200; {served_during} after the new replica "
              f"turned warm, {engine_counter(new, 'vllm:request_success_total'):.0f} of them served by it")
    finally:
        if new is not None:
            new.stop()
