"""Prefix-affine replica choice with real processes: two replicas of one specialist; every turn of a
conversation goes back to the replica that served its first turn (whose KV cache holds the prefix)."""
from __future__ import annotations

import httpx
import pytest

import procs
from conftest import router_config, wait_for

pytestmark = pytest.mark.timeout(300)


def served(engine: procs.Engine) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:request_success_total{"))


def choices(router) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("consort_router_replica_choice_total{"):
            outcome = ln.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0) + float(ln.rsplit(" ", 1)[1])
    return out


def kv_snapshots(router) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("consort_router_kv_snapshots_total"))


def test_conversation_turns_return_to_the_replica_holding_their_prefix(engines, demo_models, logs, make_router):
    extra = procs.start_engine(demo_models["Algo"], logs, "--num-blocks", "128", name="Algo")
    try:
        pair = [engines["Algo"], extra]
        cfg = router_config(engines)
        for s in cfg["specialists"]:
            if s["name"] == "Algo":
                s["replicas"] = [e.url for e in pair]
        router = make_router(cfg)
        client = router.client()
        # Chats route on the engines' own block hashes once the lane's tokenizer (fetched from an
        # engine on the lane's first request) and both replicas' block events are in: wait for both,
        # so that every turn below is placed the same way (the warm-up goes by load: under a block).
        client.completions.create(model="Algo", prompt="warm up", max_tokens=1)
        wait_for(lambda: "tokenizer revision" in router.proc.log_path.read_text(), 60, "the router fetching the tokenizer")
        replicas = sum(len(s["replicas"]) for s in cfg["specialists"])
        wait_for(lambda: kv_snapshots(router) >= replicas, 60, "the router following every replica's block events")
        homes: list[int] = []
        for conv in range(6):
            messages = [{"role": "user", "content": f"conversation {conv}: review this loop please. " * 8}]
            home = None
            for turn in range(3):
                before = [served(e) for e in pair]
                out = client.chat.completions.create(model="Algo", messages=messages, max_tokens=8, temperature=0)
                delta = [served(e) - b for e, b in zip(pair, before)]
                assert sorted(delta) == [0, 1], delta
                where = delta.index(1)
                home = where if home is None else home
                assert where == home, f"conversation {conv} turn {turn} left its replica"
                messages += [{"role": "assistant", "content": out.choices[0].message.content or "ok"},
                             {"role": "user", "content": f"and now turn {turn + 1}, once more in detail. " * 4}]
            homes.append(home)
        assert choices(router) == {"cold": 6, "affine": 12, "least_loaded": 1}
        # New conversations spread over both replicas (rendezvous hashing of their first block).
        for i in range(12):
            before = [served(e) for e in pair]
            client.completions.create(model="Algo", prompt=f"a new question, number {i}. " * 10, max_tokens=1)
            homes.append([served(e) - b for e, b in zip(pair, before)].index(1))
        assert set(homes) == {0, 1}, homes
        # A prompt shorter than one block is placed by load alone.
        client.completions.create(model="Algo", prompt="x", max_tokens=2)
        assert choices(router) == {"cold": 18, "affine": 12, "least_loaded": 2}
    finally:
        extra.stop()


def test_least_loaded_policy_does_not_hash(engines, make_router):
    cfg = router_config(engines, replica_choice={"policy": "least-loaded"})
    router = make_router(cfg)
    router.client().completions.create(model="Algo", prompt="int main() { return 0; } " * 20, max_tokens=2)
    assert choices(router) == {"least_loaded": 1}
