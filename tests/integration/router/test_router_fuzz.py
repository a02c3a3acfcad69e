"""Property-based fuzzing of the real router and engine processes: for any JSON body (and any
bytes) the answer is a typed 2xx/4xx, never a 5xx, and afterwards no KV block is leaked."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import router_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import procs

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=20))
# Issue 25's shapes: huge lists, integers past int64 and past any float, and prompts built to make a
# detector backtrack. Prebuilt, so that drawing them costs nothing.
HUGE_INTS = st.sampled_from([2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 18, 10 ** 400, -(10 ** 400)])
HOSTILE = st.one_of(HUGE_INTS, st.sampled_from([
    [f"s{i}" for i in range(5000)], ["x" * 300], list(range(5000)), {str(i): 1 for i in range(1000)},
    {"\u00b2": 1, "9" * 5000: 1}, "template<" * 7000, "Thread 1 " * 7000, "a" * 24 + "b"]))
JSONISH = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                       max_leaves=10)
SMALL_TOKENS = st.one_of(st.integers(-3, 6), st.none(), st.booleans(), st.floats(), st.text(max_size=5))
MESSAGE = st.fixed_dictionaries({}, optional={"role": st.one_of(st.sampled_from(["user", "system", "assistant",
                                                                                  "tool", "x"]), SCALARS),
                                              "content": st.one_of(st.text(max_size=40), JSONISH)})
COMMON = {"model": st.one_of(st.sampled_from(["cpp", "Algo", "STL", "Template", "nope"]), SCALARS),
          "temperature": st.one_of(SCALARS, HUGE_INTS), "top_p": SCALARS, "top_k": st.one_of(SCALARS, HOSTILE),
          "stream": st.one_of(st.booleans(), SCALARS), "stop": st.one_of(st.text(max_size=5), JSONISH, HOSTILE),
          "priority": st.one_of(SCALARS, HUGE_INTS), "deadline_ms": st.one_of(SCALARS, HUGE_INTS),
          "adapter": SCALARS, "logprobs": st.one_of(SCALARS, HUGE_INTS),
          "seed": st.one_of(SCALARS, HUGE_INTS), "n": st.one_of(SCALARS, HUGE_INTS), "intent": SCALARS,
          "logit_bias": st.one_of(JSONISH, HOSTILE), "stop_token_ids": st.one_of(JSONISH, HOSTILE),
          "repetition_penalty": st.one_of(SCALARS, st.sampled_from([1e-300, 1e300])),
          "stream_options": JSONISH, "bogus": JSONISH}
# max_tokens is always there (a valid small number or garbage): a valid request never fills the context.
COMPLETION = st.fixed_dictionaries({"max_tokens": SMALL_TOKENS}, optional={
    **COMMON, "prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 5000), max_size=20), JSONISH,
                                  HOSTILE)})
CHAT = st.fixed_dictionaries({"max_tokens": SMALL_TOKENS}, optional={
    **COMMON, "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSONISH)})
SURROGATE_BODIES = st.sampled_from([b'{"prompt": "\\ud800", "max_tokens": 2}',
                                    b'{"messages": [{"role": "user", "content": "a\\udc00"}], "max_tokens": 2}',
                                    b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}'])

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def send(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def assert_typed(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["code"], r.text[:300]


@pytest.fixture(scope="module")
def fuzz_router(engines, tmp_path_factory, logs):
    from conftest import start_router
    r = start_router(tmp_path_factory.mktemp("fuzz-router"), router_config(engines), logs)
    yield r
    r.stop()


@FUZZ
@given(body=st.one_of(COMPLETION, JSONISH), chat=st.one_of(CHAT, JSONISH), junk=st.binary(max_size=64),
       surrogate=SURROGATE_BODIES)
def test_router_and_engine_never_answer_5xx(fuzz_router, engines, body, chat, junk, surrogate):
    engine = engines["Algo"].url
    for url in (fuzz_router.url, engine):
        assert_typed(send(url, "/v1/completions", json.dumps(body).encode()))
        assert_typed(send(url, "/v1/chat/completions", json.dumps(chat).encode()))
        assert_typed(send(url, "/v1/completions", junk))
        assert_typed(send(url, "/v1/completions", surrogate))
    assert_typed(send(fuzz_router.url, "/v1/feedback", json.dumps(body).encode()))
    assert_typed(send(engine, "/v1/adapters", json.dumps(body).encode()))


EDGE_NUMBERS = st.sampled_from([0, 1, -1, 0.5, 1e-300, 1e300, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 18,
                                10 ** 400, float("nan"), float("inf")])
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "priority", "deadline_ms",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "best_of", "logprobs")
# Otherwise valid requests with edge values: a random body is rarely valid enough to reach the sampler.
EDGY = st.fixed_dictionaries({"prompt": st.just("int main"), "max_tokens": st.just(2)}, optional={
    **{f: EDGE_NUMBERS for f in SAMPLING}, "stop": HOSTILE, "logit_bias": HOSTILE, "stop_token_ids": HOSTILE})


@FUZZ
@given(body=EDGY)
def test_edge_values_in_otherwise_valid_requests_never_answer_5xx(fuzz_router, engines, body):
    for url in (fuzz_router.url, engines["Algo"].url):
        assert_typed(send(url, "/v1/completions", json.dumps(body).encode()))


def test_no_kv_block_leaked_after_the_fuzzing(engines):
    # Runs after the property test (file order): every engine is idle with its whole pool free.
    for e in engines.values():
        def idle(e=e):
            s = e.status()
            return (s["running"], s["waiting"], s["kv_free_blocks"]) == (0, 0, s["kv_total_blocks"])
        procs.wait_until(idle, 30, what=f"engine {e.name} idle with every KV block free")
