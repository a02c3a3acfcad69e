"""The KV tier and block events over HTTP: /v1/kv/events behind the engine credential, its hashes
are the ones a router computes from token ids, and a second engine process on the same tier
directory serves a prompt from cached tokens (usage.prompt_tokens_details.cached_tokens)."""
from __future__ import annotations

import httpx

import procs
from consort_common.block_hash import prefix_hashes

CREDENTIAL = "kv-tier-test-credential"
BLOCK_SIZE = 8
PROMPT = [(i * 37) % 4000 + 5 for i in range(100)]     # token ids: 12 full blocks before the last token


def start(demo_model, logs, tier, cred, name="tiered"):
    return procs.start_engine(demo_model, logs, "--num-blocks", "64", "--block-size", str(BLOCK_SIZE),
                              "--kv-tier-path", str(tier), "--kv-tier-bytes", "64M",
                              "--credential-file", str(cred), name=name)


def complete(client: httpx.Client, url: str) -> dict:
    r = client.post(url + "/v1/completions", json={"model": "tiered", "prompt": PROMPT, "max_tokens": 4,
                                                   "temperature": 0},
                    headers={"Authorization": f"Bearer {CREDENTIAL}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_events_and_a_warm_restart_from_the_tier(demo_model, engine_logs, tmp_path):
    cred = tmp_path / "credential"
    cred.write_text(CREDENTIAL + "\n")
    tier = tmp_path / "tier"
    auth = {"Authorization": f"Bearer {CREDENTIAL}"}
    expected = [h.hex() for h in prefix_hashes(PROMPT, BLOCK_SIZE, "tiered")][:(len(PROMPT) - 1) // BLOCK_SIZE]

    first = start(demo_model, engine_logs, tier, cred)
    try:
        with httpx.Client(timeout=120) as c:
            assert c.get(first.url + "/v1/kv/events").status_code == 401
            assert c.get(first.url + "/v1/kv/events", params={"since": "-1"}, headers=auth).status_code == 400
            hello = c.get(first.url + "/v1/kv/events", headers=auth).json()
            assert hello["snapshot"] == {"pool": [], "tier": []}
            out = complete(c, first.url)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            news = c.get(first.url + "/v1/kv/events", headers=auth,
                         params={"epoch": hello["epoch"], "since": hello["seq"]}).json()
            stored = [h for e in news["events"] if e["type"] == "stored" and e["medium"] == "pool" for h in e["hashes"]]
            assert stored[:len(expected)] == expected        # the router's hashes, computed from token ids
            assert news["epoch"] == hello["epoch"] and news["seq"] > hello["seq"]
    finally:
        assert first.stop() == 0, first.proc.tail()

    second = start(demo_model, engine_logs, tier, cred)
    try:
        with httpx.Client(timeout=120) as c:
            snap = c.get(second.url + "/v1/kv/events", headers=auth,
                         params={"epoch": hello["epoch"], "since": news["seq"]}).json()
            assert snap["epoch"] != hello["epoch"]           # a restart: a snapshot, not events
            assert set(expected) <= set(snap["snapshot"]["tier"])
            again = complete(c, second.url)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(expected) * BLOCK_SIZE
            assert again["choices"][0]["text"] == out["choices"][0]["text"]
            metrics = c.get(second.url + "/metrics", headers=auth).text
            assert "vllm:external_prefix_cache_hits_total" in metrics and "consort_kv_tier_enabled" in metrics
    finally:
        assert second.stop() == 0, second.proc.tail()
