"""The engine's OpenAI surface, driven by the real `openai` client against a real `consort engine`."""
from __future__ import annotations

import json

import httpx
import pytest

import procs

GREEDY_IGNORE_EOS = {"ignore_eos": True}


def extra(obj, key):
    return (obj.model_extra or {}).get(key)


def wait_idle(engine, timeout: float = 15.0) -> dict:
    """The engine back to no running/waiting sequences and every KV block free."""
    def idle():
        s = engine.status()
        return s if (s["running"], s["waiting"], s["kv_free_blocks"]) == (0, 0, s["kv_total_blocks"]) else None
    return procs.wait_until(idle, timeout, what="engine idle with all KV blocks free")


def test_models_and_status(engine, demo_model):
    code, models = procs.http_get(engine.url + "/v1/models")
    assert code == 200 and models["data"][0]["id"] == "spec" and models["data"][0]["max_model_len"] == 512
    s = engine.status()
    assert s["warm"] is True and s["specialist"] == "spec" and s["speculation"]["state"] == "off"
    assert s["kv_total_blocks"] == 256 and s["kv_free_blocks"] == 256 and s["adapters"] == {}
    assert s["kv_cache_dtype"] in ("float32", "bfloat16")          # auto: the model's dtype
    assert procs.http_get(engine.url + "/health")[0] == 200
    assert procs.http_get(engine.url + "/ready")[0] == 200


def test_completion_non_stream_usage_headers(client, engine):
    raw = client.completions.with_raw_response.create(
        model="spec", prompt="template <typename T>", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, extra_headers={"x-request-id": "req-42"})
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.headers["x-consort-specialist"] == "spec"
    assert raw.headers["x-consort-adapter"] == "none"
    assert raw.headers["x-consort-speculation"] == "off"
    r = raw.parse()
    ch = r.choices[0]
    assert r.object == "text_completion" and r.model == "spec" and r.id == "cmpl-req-42"
    assert ch.finish_reason == "length" and isinstance(ch.text, str)
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(extra(r, "prompt_token_ids"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert len(extra(ch, "token_ids")) == 12


def test_token_id_prompt_and_checkpoint_name_alias(client, demo_model):
    r = client.completions.create(model=demo_model.name, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert extra(r, "prompt_token_ids") == [5, 6, 7, 8] and r.usage.prompt_tokens == 4
    assert len(extra(r.choices[0], "token_ids")) == 3


def test_stream_matches_non_stream_and_reports_usage(client):
    kw = dict(model="spec", prompt="int main() {", max_tokens=20, temperature=0, extra_body=GREEDY_IGNORE_EOS)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_non_stream_and_stream(client):
    msgs = [{"role": "system", "content": "You write C++."}, {"role": "user", "content": "A lambda, please."}]
    r = client.chat.completions.create(model="spec", messages=msgs, max_tokens=10, temperature=0,
                                       extra_body=GREEDY_IGNORE_EOS)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    stream = list(client.chat.completions.create(model="spec", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=GREEDY_IGNORE_EOS))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    assert stream[-1].usage.completion_tokens == 10 and stream[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_chat_template_is_applied(client, demo_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_model)
    msgs = [{"role": "user", "content": "std::vector<int> v;"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    r = client.chat.completions.create(model="spec", messages=msgs, max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens == len(want)
    assert extra(r, "prompt_token_ids") == list(want)


def test_completion_logprobs(client):
    r = client.completions.create(model="spec", prompt="namespace std {", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body=GREEDY_IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)   # greedy picks the top token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body=GREEDY_IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def seeded(client, seed: int, **kw):
    return client.completions.create(model="spec", prompt="class Foo {", max_tokens=kw.pop("max_tokens", 16),
                                     temperature=1.0, seed=seed,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)


def test_seed_reproducibility(client):
    a, b, c = seeded(client, 123), seeded(client, 123), seeded(client, 124)
    ids = lambda r: extra(r.choices[0], "token_ids")  # noqa: E731
    assert ids(a) == ids(b) and a.choices[0].text == b.choices[0].text
    assert ids(a) != ids(c)


def pick_stop(text: str) -> tuple[str, str]:
    """A 2-3 character stop string from the middle of `text` and the text expected before it."""
    for i in range(max(1, len(text) // 3), len(text) - 3):
        s = text[i:i + 3]
        if s.strip() and text.find(s) == i:
            return s, text[:i]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_truncates_and_aborts(client, engine):
    base = seeded(client, 7, max_tokens=40).choices[0].text
    stop, expect = pick_stop(base)
    r = seeded(client, 7, max_tokens=40, stop=[stop, "never-appears-xyz"])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    stream = list(client.completions.create(model="spec", prompt="class Foo {", max_tokens=40, temperature=1.0,
                                            seed=7, stop=stop, stream=True, extra_body=GREEDY_IGNORE_EOS))
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == expect and stream[-1].choices[0].finish_reason == "stop"
    wait_idle(engine)


def test_priority_and_deadline_are_accepted(client, engine):
    r = client.completions.create(model="spec", prompt="auto x = 1;", max_tokens=2, temperature=0,
                                  extra_body={"priority": 5, "deadline_ms": 60000})
    assert r.choices[0].finish_reason in ("length", "stop")
    met = [ln for ln in httpx.get(engine.url + "/metrics", timeout=10).text.splitlines()
           if ln.startswith("consort_deadline_requests_total{") and 'result="met"' in ln]
    assert met and float(met[0].rsplit(" ", 1)[1]) >= 1, met


def test_metrics_have_vllm_names(engine, client):
    client.completions.create(model="spec", prompt="x", max_tokens=3, temperature=0, extra_body=GREEDY_IGNORE_EOS)
    r = httpx.get(engine.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "consort_admission_to_first_token_seconds_bucket",
                 "consort_requests_preempted_once_total", "consort_admission_rejected_total",
                 # what vLLM's Grafana dashboard reads besides the above
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
                 "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket"):
        assert name in text, name
    lines = text.splitlines()

    def total(metric: str) -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(metric + "{"))

    # every finished request is sized; the counters also hold aborted requests' work
    finished = total("vllm:request_success_total")
    assert finished >= 1 and total("vllm:request_generation_tokens_count") == finished
    assert 3 <= total("vllm:request_generation_tokens_sum") <= total("vllm:generation_tokens_total")
    assert 1 <= total("vllm:request_queue_time_seconds_count") <= finished
    gen = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total{")]
    assert gen and 'specialist="spec"' in gen[0] and 'adapter="none"' in gen[0] and 'model_name="spec"' in gen[0]
    assert float(gen[0].rsplit(" ", 1)[1]) >= 3
    ttft_count = [ln for ln in text.splitlines() if ln.startswith("vllm:time_to_first_token_seconds_count")]
    assert float(ttft_count[0].rsplit(" ", 1)[1]) >= 1


def test_slo_attainment_in_status_and_metrics(engine, client):
    """The shared engine publishes generous objectives (conftest): every finished request meets them."""
    client.completions.create(model="spec", prompt="x", max_tokens=4, temperature=0, extra_body=GREEDY_IGNORE_EOS)
    slo = engine.status()["slo"]
    assert slo["ttft"]["target_ms"] == 600000 and slo["ttft"]["requests"] >= 1
    assert slo["ttft"]["attainment"] == 1.0 and slo["ttft"]["met"] is True
    assert slo["itl"]["requests"] >= 1 and slo["itl"]["attainment"] == 1.0
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    met = [ln for ln in text.splitlines()
           if ln.startswith("consort_slo_requests_total{") and 'objective="ttft"' in ln and 'result="met"' in ln]
    assert met and float(met[0].rsplit(" ", 1)[1]) >= 1
    assert 'consort_slo_target_seconds{model_name="spec",objective="itl",specialist="spec"} 600.0' in text


def test_prefix_cache_hits_show_in_status_and_usage(client, engine):
    prompt = list(range(10, 10 + 100))     # 6 full blocks of 16
    client.completions.create(model="spec", prompt=prompt, max_tokens=1, temperature=0)
    before = engine.status()["prefix_cache_hits"]
    r = client.completions.create(model="spec", prompt=prompt + [7, 7], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 96
    assert engine.status()["prefix_cache_hits"] > before


def test_adapter_hot_load_and_unload_errors_are_typed(engine):
    def post(body):
        return httpx.post(engine.url + "/v1/adapters", json=body, timeout=30)
    for body, status, code in (({"name": "a", "path": "/nope"}, 422, "invalid_adapter"),
                               ({"name": "Bad_Name", "path": "/x"}, 400, "invalid_name"),
                               ({"name": "a"}, 400, "invalid_path"),
                               ({"name": "a", "path": "/x", "rank": 4}, 400, "unknown_field")):
        r = post(body)
        assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)
    r = httpx.delete(engine.url + "/v1/adapters/a", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    assert engine.status()["adapters"] == {}

def test_sse_wire_format(engine):
    """The raw SSE bytes: `data: {json}` events, blank-line separated, ending with `data: [DONE]`."""
    body = {"model": "spec", "prompt": "x", "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 4
    assert "prompt_token_ids" in chunks[0]


def test_speculative_engine_streams_the_same_greedy_text(engine, demo_model, engine_logs):
    """`--speculative ngram`: verify windows run through the real model; the stream carries several
    tokens per step and the text equals one-token decoding's (the shared engine, speculation off)."""
    prompt = "int a = 1; int b = 2; int a = 1; int b = 2; int a = 1; int b = 2;"
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json()
    spec = procs.start_engine(demo_model, engine_logs, "--num-blocks", "64", "--speculative", "ngram",
                              name="spec-ngram")
    try:
        with httpx.stream("POST", spec.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.headers["x-consort-speculation"] == "on"
            chunks = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line.strip() != "data: [DONE]"]
        ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
        assert ids == plain["choices"][0]["token_ids"] and len(ids) == 48
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
        s = spec.status()
        assert s["speculation"]["state"] == "on" and s["speculation"]["draft_tokens"] > 0
        assert s["kv_free_blocks"] == s["kv_total_blocks"] == 64
        accepted = s["speculation"]["accepted_tokens"]
        metrics = httpx.get(spec.url + "/metrics", timeout=10).text
        assert f"vllm:spec_decode_num_accepted_tokens_total{{model_name=\"spec-ngram\",specialist=\"spec-ngram\"}} {float(accepted)}" in metrics
        labels = '{model_name="spec-ngram",specialist="spec-ngram"}'
        spec_stats = s["speculation"]
        assert spec_stats["policy"] == "goodput" and 0 < spec_stats["drafts"] <= spec_stats["draft_tokens"]
        assert f"vllm:spec_decode_num_drafts_total{labels} {float(spec_stats['drafts'])}" in metrics
        assert f"consort_spec_decode_held_decodes_total{labels} {float(spec_stats['held_decodes'])}" in metrics
    finally:
        assert spec.stop() == 0, spec.proc.tail()


def test_an_fp8_kv_cache_serves_the_openai_surface_and_says_so(demo_model, engine_logs):
    """`--kv-cache-dtype fp8`: the real openai client streams a chat completion from an engine whose pool is
    float8 (status names it), and every block is free again afterwards."""
    import openai

    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "64", "--kv-cache-dtype", "fp8",
                             name="spec-fp8")
    try:
        assert eng.status()["kv_cache_dtype"] == "float8_e4m3fn"
        client = openai.OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="spec-fp8", messages=[{"role": "user", "content": "int main() { return 0; }"}],
            max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 24
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        s = wait_idle(eng)
        assert s["kv_free_blocks"] == s["kv_total_blocks"] == 64
    finally:
        assert eng.stop() == 0, eng.proc.tail()


def test_lora_adapter_served_by_name_beside_the_base_model(engine, demo_model, engine_logs, tmp_path):
    adapter = procs.write_lora_adapter(demo_model, tmp_path / "cpp-style")
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "64", "--adapter", f"cpp-style={adapter}",
                             name="spec-lora")
    try:
        s = eng.status()
        assert s["adapters"] == {"cpp-style": "loaded"}
        body = {"prompt": "template <typename T>", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        base = httpx.post(eng.url + "/v1/completions", json=body, timeout=60).json()
        plain = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json()
        assert base["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]   # no adapter: the base model
        r = httpx.post(eng.url + "/v1/completions", json={**body, "model": "spec-lora:cpp-style"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-consort-adapter"] == "cpp-style"
        tuned = r.json()["choices"][0]["token_ids"]
        assert len(tuned) == 16 and tuned != base["choices"][0]["token_ids"]
        again = httpx.post(eng.url + "/v1/completions", json={**body, "adapter": "cpp-style"}, timeout=60).json()
        assert again["choices"][0]["token_ids"] == tuned
    finally:
        assert eng.stop() == 0, eng.proc.tail()


def test_an_unreadable_adapter_at_start_exits_1_naming_it(demo_model, engine_logs, tmp_path):
    # A start-up adapter that cannot load is fatal, like a model that cannot: the process exits 1
    # with the cause as its last line (kubelet shows it in CrashLoopBackOff; `consort up` restarts).
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "64", "--adapter", f"bad={tmp_path / 'nope'}",
                             name="spec-bad-adapter", wait_ready=False)
    try:
        code = eng.proc.popen.wait(120)
        last = eng.proc.tail(1)
        assert code == 1, eng.proc.tail()
        assert last.startswith("consort engine: fatal:") and "AdapterError" in last and "nope" in last, last
    finally:
        eng.stop()


def test_adapter_hot_load_serve_unload_and_reload_under_the_same_name(demo_model, engine_logs, tmp_path):
    first = procs.write_lora_adapter(demo_model, tmp_path / "v1", seed=1)
    second = procs.write_lora_adapter(demo_model, tmp_path / "v2", seed=2)
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", "64", "--max-adapters", "1",
                             name="spec-hot")
    body = {"prompt": "struct Point { int x; int y; };" * 3, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}

    def complete(**extra):
        r = httpx.post(eng.url + "/v1/completions", json={**body, **extra}, timeout=60)
        return r.status_code, r.json()

    try:
        base = complete()[1]["choices"][0]["token_ids"]
        r = httpx.post(eng.url + "/v1/adapters", json={"name": "style", "path": str(first)}, timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "loaded"
        assert eng.status()["adapters"] == {"style": "loaded"}
        models = procs.http_get(eng.url + "/v1/models")[1]["data"]
        assert [m["id"] for m in models] == ["spec-hot", "spec-hot:style"] and models[1]["root"] == str(first)
        assert models[1]["max_model_len"] == models[0]["max_model_len"] and models[1]["created"] == models[0]["created"]
        code, one = complete(adapter="style")
        assert code == 200 and one["choices"][0]["token_ids"] != base
        # one adapter slot: a second adapter is refused; the same name twice too
        r = httpx.post(eng.url + "/v1/adapters", json={"name": "other", "path": str(second)}, timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "max_adapters"
        r = httpx.post(eng.url + "/v1/adapters", json={"name": "style", "path": str(second)}, timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists"
        r = httpx.delete(eng.url + "/v1/adapters/style", timeout=30)
        assert r.status_code == 200 and r.json()["dropped_cached_blocks"] > 0    # its prefix blocks go too
        code, gone = complete(adapter="style")
        assert code == 404 and gone["error"]["code"] == "adapter_not_found"
        # the same name with other weights: nothing of the first adapter is reused
        assert httpx.post(eng.url + "/v1/adapters", json={"name": "style", "path": str(second)},
                          timeout=60).status_code == 200
        two = complete(adapter="style")[1]
        assert two["choices"][0]["token_ids"] not in (one["choices"][0]["token_ids"], base)
        assert two["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
        wait_idle(eng)
    finally:
        assert eng.stop() == 0, eng.proc.tail()
