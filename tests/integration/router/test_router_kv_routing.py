"""Precise prefix routing with real processes: two replicas of one lane behind the engine credential; the
router follows their block events, computes the engine's own block hashes of a completion prompt (with
the lane's tokenizer) or of a chat (rendered with the chat template the engines publish) and sends
follow-ups that share a long prefix to the replica that holds it."""
from __future__ import annotations

import json
import time

import httpx
import pytest

import procs
from conftest import wait_for
from consort_common.block_hash import prefix_hashes, prefix_salt
from consort_router.prompt_tokens import PromptTokenizer

pytestmark = pytest.mark.timeout(400)

CREDENTIAL = "kv-routing-engine-credential"
AUTH = {"Authorization": f"Bearer {CREDENTIAL}"}


def served(engine: procs.Engine) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:request_success_total{"))


def router_counter(router, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for ln in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        if ln.startswith(name):
            label = ln.split('outcome="', 1)[1].split('"', 1)[0] if 'outcome="' in ln else ""
            out[label] = out.get(label, 0) + float(ln.rsplit(" ", 1)[1])
    return out


def kv_router(make_router, engines: list[procs.Engine], cred, retry_s: float = 0.1, **lane):
    return make_router({
        "ensemble": "cpp", "default_specialist": "Algo",
        "specialists": [{"name": "Algo", "replicas": [e.url for e in engines], **lane}],
        "shadow": {"default_threshold": 0.0}, "breaker": {"fresh_samples": 0}, "verifier": {"sample_rate": 0.0},
        "polling": {"interval_s": 0.2}, "replica_choice": {"kv_events_interval_s": retry_s},
        "store": {"path": "breakers.json"}, "auth": {"engine_credential_file": str(cred)},
    })


def first_turns(engines: list[procs.Engine], tag: str) -> list[list[dict]]:
    """One conversation per replica, its first turn served by that replica directly (as if another
    router replica had sent it): the history each follow-up turn repeats."""
    histories = []
    for home, engine in enumerate(engines):
        messages = [{"role": "system", "content": f"Session {tag}-{home}: you review a long C++ code base with many "
                                                  "templates, loops and allocators; answer in one line. " * 8},
                    {"role": "user", "content": "What does std::launder do?"}]
        r = httpx.post(engine.url + "/v1/chat/completions", timeout=60,
                       headers={**AUTH, "x-consort-tenant": "anonymous"},   # the tenant the router sends without auth
                       json={"model": "Algo", "messages": messages, "max_tokens": 4})
        assert r.status_code == 200, r.text
        histories.append(messages + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}])
    return histories


def pool(engine: procs.Engine) -> set[bytes]:
    snap = httpx.get(engine.url + "/v1/kv/events", headers=AUTH, timeout=10).json()["snapshot"]
    return {bytes.fromhex(h) for h in snap["pool"]}


@pytest.fixture(scope="module")
def pair(demo_models, logs, tmp_path_factory):
    cred = tmp_path_factory.mktemp("kv-cred") / "credential"
    cred.write_text(CREDENTIAL + "\n")
    started = [procs.start_engine(demo_models["Algo"], logs, "--num-blocks", "256", "--credential-file", str(cred),
                                  name="Algo", wait_ready=False) for _ in range(2)]
    try:
        for e in started:
            procs.wait_http(e.url + "/ready", e.proc, timeout=240)
        yield started, cred
    finally:
        for e in started:
            e.stop()


@pytest.mark.parametrize("source", ["directory", "engine"])
def test_follow_ups_land_on_the_replica_holding_their_prefix(pair, demo_models, make_router, source):
    """Each replica computed a long prefix for a request the router never saw (another router replica
    sent it, say): the router knows where each prefix is from the engines' events alone, and every
    follow-up goes there (`affine`: the character-hash guess, knowing nothing, would place them cold).
    The lane's tokenizer comes from a directory the router config names, or from the engines."""
    engines, cred = pair
    router = kv_router(make_router, engines, cred,
                       **({"tokenizer": str(demo_models["Algo"])} if source == "directory" else {}))
    shared = [f"Context {k} ({source}): you are reviewing a long C++ code base with many templates and loops. " * 12
              for k in range(2)]      # new to both engines (the module's tests share them): events, not snapshots
    for home, prefix in enumerate(shared):
        r = httpx.post(engines[home].url + "/v1/completions", timeout=60,
                       headers={**AUTH, "x-consort-tenant": "anonymous"},   # the tenant the router sends without auth
                       json={"model": "Algo", "prompt": prefix + "First question.", "max_tokens": 1})
        assert r.status_code == 200, r.text
    wait_for(lambda: router_counter(router, "consort_router_kv_events_total").get("", 0) >= 2, 20,
             "the router applying both replicas' block events")
    client = router.client()
    want = {"affine": 6}
    if source == "engine":      # the lane's first request starts the fetch (it goes by load: shorter than a block)
        client.completions.create(model="Algo", prompt="warm up", max_tokens=1)
        wait_for(lambda: "tokenizer revision" in router.proc.log_path.read_text(), 30, "the router fetching the tokenizer")
        want["least_loaded"] = 1
    for i in range(6):
        home = i % 2
        before = [served(e) for e in engines]
        out = client.completions.create(model="Algo", prompt=shared[home] + f"Follow-up number {i}.", max_tokens=1)
        assert [served(e) - b for e, b in zip(engines, before)].index(1) == home, f"follow-up {i} left its replica"
        assert out.usage.prompt_tokens_details.cached_tokens > 0
    assert router_counter(router, "consort_router_replica_choice_total") == want
    assert router_counter(router, "consort_router_kv_snapshots_total")[""] >= 2   # first contact, each replica


def test_block_events_reach_the_router_as_the_engine_stores_them(pair, make_router):
    """The router holds a long poll on each engine, answered at the engine's next block event: the
    blocks of a prompt another router sent are in this router's view about one round trip after the
    engine stored them. Measured against a retry delay (`kv_events_interval_s`) of 4 s, the period
    the router polled at before: four lags together stay below one period, where polling would make
    each about half of one."""
    engines, cred = pair
    interval = 4.0
    router = kv_router(make_router, engines, cred, retry_s=interval)
    wait_for(lambda: router_counter(router, "consort_router_kv_snapshots_total").get("", 0) >= 2, 30,
             "the router's first contact with both replicas")
    lags = []
    for i in range(4):
        seen = router_counter(router, "consort_router_kv_events_total").get("", 0)
        r = httpx.post(engines[i % 2].url + "/v1/completions", timeout=60,
                       headers={**AUTH, "x-consort-tenant": "anonymous"},
                       json={"model": "Algo", "prompt": f"Lag probe {i}: a prompt of its own, long enough for a "
                                                        "few blocks of the engine's cache. " * 4, "max_tokens": 1})
        assert r.status_code == 200, r.text
        answered = time.monotonic()
        wait_for(lambda: router_counter(router, "consort_router_kv_events_total").get("", 0) > seen, 30,
                 "the router applying the engine's new block events")
        lags.append(time.monotonic() - answered)
    assert sum(lags) < interval, lags


def test_router_hashes_are_the_engines_published_hashes(pair, demo_models, tmp_path):
    """For the same prompt the router's hashes (its tokenizer, block size, the engine's extra keys) are the
    hashes the engine publishes, for two tenants, a cache salt and an adapter (each a chain of its own)."""
    engine = pair[0][0]
    block_size = httpx.get(engine.url + "/v1/status", headers=AUTH, timeout=10).json()["block_size"]
    tok = PromptTokenizer.from_dir(demo_models["Algo"])
    assert httpx.get(engine.url + "/v1/kv/tokenizer", timeout=10).status_code == 401   # behind the credential
    served_tok = PromptTokenizer.from_engine(httpx.get(engine.url + "/v1/kv/tokenizer", headers=AUTH, timeout=10).json())
    prompt = "template <typename T> struct Holder { T value; }; " * 10
    chains = []
    adapter = procs.write_lora_adapter(demo_models["Algo"], tmp_path / "v2")
    r = httpx.post(engine.url + "/v1/adapters", json={"name": "v2", "path": str(adapter)}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    for tenant, salt, lora in (("team-a", None, None), ("team-b", None, None), ("team-a", "s1", None),
                               ("team-a", None, "v2")):
        body = {"model": "Algo", "prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {}),
                **({"adapter": lora} if lora else {})}
        r = httpx.post(engine.url + "/v1/completions", json=body, timeout=60,
                       headers={**AUTH, "x-consort-tenant": tenant})
        assert r.status_code == 200, r.text
        ids = tok.encode_head(prompt, 4096, block_size)
        engine_ids = httpx.post(engine.url + "/tokenize", json={"model": "Algo", "prompt": prompt}, headers=AUTH,
                                timeout=10).json()["tokens"]
        assert ids == engine_ids == served_tok.encode_head(prompt, 4096, block_size)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        chain = prefix_hashes(ids, block_size, "Algo", lora, prefix_salt(tenant, salt))
        assert len(chain) >= 4 and set(chain) <= pool(engine), (tenant, salt, lora)
        chains.append(set(chain))
    assert all(not (chains[a] & chains[b]) for a in range(4) for b in range(a + 1, 4))


def test_chat_follow_up_turns_land_on_the_replica_holding_their_conversation(pair, make_router):
    """The router renders a chat (and a Responses request, mapped to its chat as the engine maps it) with the
    template the engines publish (GET /v1/kv/tokenizer) and scores the engines' own block hashes: each
    follow-up turn of a conversation goes to the replica that served its first turn, which finds the
    history in its prefix cache."""
    engines, cred = pair
    router = kv_router(make_router, engines, cred)
    histories = first_turns(engines, "precise")
    wait_for(lambda: router_counter(router, "consort_router_kv_events_total").get("", 0) >= 2, 20,
             "the router applying both replicas' block events")
    client = router.client()
    # the lane's first request starts the tokenizer fetch (it goes by load: shorter than a block)
    client.chat.completions.create(model="Algo", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    wait_for(lambda: "tokenizer revision" in router.proc.log_path.read_text(), 30, "the router fetching the tokenizer")
    for i in range(4):
        home = i % 2
        before = [served(e) for e in engines]
        out = client.chat.completions.create(model="Algo", max_tokens=1, messages=histories[home] + [
            {"role": "user", "content": f"Follow-up number {i}: and std::bit_cast?"}])
        assert [served(e) - b for e, b in zip(engines, before)].index(1) == home, f"turn {i} left its replica"
        assert out.usage.prompt_tokens_details.cached_tokens >= 64
    # a Responses request continuing a conversation: the engine maps it to the same chat, and so does the router
    for home in (1, 0):
        system, *turns = histories[home]
        before = [served(e) for e in engines]
        resp = client.responses.create(model="Algo", max_output_tokens=1, instructions=system["content"],
                                       input=turns + [{"role": "user", "content": "And std::bit_cast?"}])
        assert [served(e) - b for e, b in zip(engines, before)].index(1) == home, "a Responses turn left its replica"
        assert resp.usage.input_tokens_details.cached_tokens >= 64
    assert router_counter(router, "consort_router_replica_choice_total") == {"affine": 6, "least_loaded": 1}


def test_a_chat_template_the_router_cannot_render_routes_on_characters(pair, demo_models, make_router, tmp_path):
    """A lane whose tokenizer directory carries a template that fails on every body (here one that raises;
    the engines render their own): its chats are served as usual, placed by the character-hash guess
    (which knows nothing of prefixes the engines computed for others: `cold`), and no error reaches
    the client."""
    engines, cred = pair
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text((demo_models["Algo"] / "tokenizer.json").read_text())
    cfg = json.loads((demo_models["Algo"] / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ raise_exception('no') }}"}))
    router = kv_router(make_router, engines, cred, tokenizer=str(tok_dir))
    histories = first_turns(engines, "fallback")
    wait_for(lambda: router_counter(router, "consort_router_kv_events_total").get("", 0) >= 2, 20,
             "the router applying both replicas' block events")
    client = router.client()
    for home in (0, 1):
        out = client.chat.completions.create(model="Algo", max_tokens=1, messages=histories[home] + [
            {"role": "user", "content": "And std::bit_cast?"}])
        assert out.choices[0].finish_reason in ("stop", "length")
    assert router_counter(router, "consort_router_replica_choice_total") == {"cold": 2}
    # its completions still route on the engines' hashes (the tokenizer itself loaded)
    shared = "Context fallback: you are reviewing a long C++ code base with many templates and loops. " * 12
    events = router_counter(router, "consort_router_kv_events_total").get("", 0)
    r = httpx.post(engines[1].url + "/v1/completions", timeout=60, headers={**AUTH, "x-consort-tenant": "anonymous"},
                   json={"model": "Algo", "prompt": shared + "First question.", "max_tokens": 1})
    assert r.status_code == 200, r.text
    before = served(engines[1])
    wait_for(lambda: router_counter(router, "consort_router_kv_events_total").get("", 0) > events, 20,
             "the router applying the replica's new blocks")
    client.completions.create(model="Algo", prompt=shared + "Follow-up.", max_tokens=1)
    assert served(engines[1]) - before == 1
    assert router_counter(router, "consort_router_replica_choice_total") == {"cold": 2, "affine": 1}
