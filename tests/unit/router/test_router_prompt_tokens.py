"""The router's prompt token ids are the engine's (its Tokenizer on the same checkpoint), head cuts included,
and so are the block hashes both compute from them."""
from __future__ import annotations

import json
import shutil

import pytest

from consort_common.block_hash import prefix_hashes, prefix_salt
from consort_engine.demo_model import write_demo_model
from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.events import KVEventLog
from consort_engine.kv.sequence import SamplingParams, Sequence
from consort_engine.text.tokenizer import Tokenizer
from consort_router.kv_index import ReplicaBlocks
from consort_router.prompt_tokens import PromptTokenizer, prompt_ids

PROMPTS = ["int main() { return 0; }", "  leading spaces and unicode: café — ✓ 数字",
           "template <typename T> struct Holder { T value; }; " * 60, "x"]


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "add-bos"])
def checkpoint(request, tmp_path_factory):
    d = write_demo_model(tmp_path_factory.mktemp("prompt-tokens") / "demo", seed=0)
    if request.param:       # a Llama-style tokenizer_config that asks for the BOS token
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["add_bos_token"] = True
        copy = d.parent / "bos"
        shutil.copytree(d, copy)
        (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
        d = copy
    return d


@pytest.mark.parametrize("prompt", PROMPTS)
def test_router_ids_are_the_engines(checkpoint, prompt):
    engine = Tokenizer.from_dir(checkpoint).encode(prompt)
    router = PromptTokenizer.from_dir(checkpoint)
    assert router.encode_head(prompt, 100_000, 16) == engine
    # a head: tokens cut from a long text are the engine's first ids, never other ones
    head = router.encode_head(prompt, 64, 16)
    assert head == engine[:len(head)] and (len(head) >= 40 or len(engine) < 64)
    assert prompt_ids(router, {"prompt": prompt}, 64, 16) == head
    assert prompt_ids(router, {"prompt": [prompt]}, 64, 16) == head


def test_ids_need_no_tokenizer_and_chat_is_not_guessed():
    assert prompt_ids(None, {"prompt": [5, 6, 7]}, 2, 16) == [5, 6]
    assert prompt_ids(None, {"prompt": [[5, 6, 7]]}, 8, 16) == [5, 6, 7]
    assert prompt_ids(None, {"prompt": "text"}, 8, 16) is None
    assert prompt_ids(None, {"prompt": [[1], [2]]}, 8, 16) is None           # several prompts
    assert prompt_ids(None, {"prompt": [1, True]}, 8, 16) is None
    assert prompt_ids(None, {"messages": [{"role": "user", "content": "x"}], "prompt": [1]}, 8, 16) is None


def test_the_router_view_fed_by_block_manager_events_holds_the_router_hashes(checkpoint):
    """Engine side: the block manager registers a prompt's blocks and publishes them; router side: its view
    of those events holds every hash it computes for the same prompt (and none for another adapter)."""
    ids = PromptTokenizer.from_dir(checkpoint).encode_head(PROMPTS[2], 256, 16)
    log = KVEventLog()
    bm = BlockManager(num_blocks=64, block_size=16, namespace="Algo", events=log)
    seq = Sequence(list(ids), SamplingParams(), adapter="v2", cache_salt=prefix_salt("team-a", None))
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    view = ReplicaBlocks(max_hashes=1000)
    view.apply(log.read(None, None))
    hashes = tuple(prefix_hashes(ids, 16, "Algo", "v2", prefix_salt("team-a", None)))
    assert len(hashes) == len(ids) // 16 and view.depth(hashes) == len(hashes)
    assert view.depth(tuple(prefix_hashes(ids, 16, "Algo", None, prefix_salt("team-a", None)))) == 0


async def test_lane_tokenizers_fetch_once_per_revision_and_again_on_new_replicas(checkpoint, monkeypatch):
    """A lane's tokenizer comes from its engine's /v1/kv/tokenizer (real aiohttp on 127.0.0.1 serving the
    checkpoint's file): fetched in the background, shared by lanes with the same revision, fetched again
    when the lane's replicas change, retried after a failure only after RETRY_S."""
    import asyncio
    import hashlib

    import aiohttp
    from aiohttp import web

    from consort_router import lane_tokenizers as lt

    text = (checkpoint / "tokenizer.json").read_text()
    cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    calls: list[str] = []

    async def route(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.json_response({"revision": hashlib.sha256(text.encode()).hexdigest()[:32], "tokenizer_json": text,
                                  "bos_token": cfg.get("bos_token"), "add_bos_token": cfg.get("add_bos_token")})

    async def missing(request: web.Request) -> web.Response:     # an engine without the route
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/v1/kv/tokenizer", route)
    app.router.add_get("/bad/v1/kv/tokenizer", missing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    tasks: list = []

    def spawn(coro):
        tasks.append(asyncio.ensure_future(coro))

    async def settle():
        await asyncio.gather(*tasks)
        tasks.clear()

    try:
        async with aiohttp.ClientSession() as session:
            lanes = lt.LaneTokenizers()
            assert lanes.get("A", None, [url], session, spawn) is None        # fetch started, not there yet
            await settle()
            tok = lanes.get("A", None, [url], session, spawn)
            assert tok is not None and not tasks                              # there; no second fetch
            assert tok.encode_head(PROMPTS[0], 100, 16) == Tokenizer.from_dir(checkpoint).encode(PROMPTS[0])
            assert lanes.get("B", None, [url], session, spawn) is None
            await settle()
            assert lanes.get("B", None, [url], session, spawn) is tok         # same revision, one copy
            assert lanes.get("A", None, [url, url + "/x"], session, spawn) is tok and len(tasks) == 1  # new replicas
            await settle()
            assert len(calls) == 3
            assert lanes.get("C", None, [url + "/bad"], session, spawn) is None
            await settle()
            assert lanes.get("C", None, [url + "/bad"], session, spawn) is None and not tasks   # no retry yet
            monkeypatch.setattr(lt, "RETRY_S", 0.0)
            lanes.get("C", None, [url + "/bad"], session, spawn)
            assert len(tasks) == 1
            await settle()
    finally:
        await runner.cleanup()
