"""`consort engine --speculative mtp` over HTTP: a checkpoint with an MTP block drafts with it
(status and header say so, metrics count its drafts) and streams the same greedy text as the
shared engine serving the same weights without a drafter."""
from __future__ import annotations

import json

import httpx
import procs
from conftest import MAX_MODEL_LEN


def test_mtp_engine_streams_the_same_greedy_text(engine, demo_model, engine_logs, tmp_path):
    from consort_engine.demo_model import write_demo_model
    # seed 0 and the same corpus: the shared engine's weights and tokenizer, plus an MTP block
    model = write_demo_model(tmp_path / "mtp", max_pos=MAX_MODEL_LEN, seed=0, mtp="qwen3_next",
                             mtp_seconds=300, mtp_steps=10)
    body = {"prompt": "template <typename T> struct vector {", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    plain = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json()
    mtp = procs.start_engine(model, engine_logs, "--num-blocks", "64", "--speculative", "mtp", name="spec-mtp")
    try:
        with httpx.stream("POST", mtp.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.headers["x-consort-speculation"] == "on"
            chunks = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line.strip() != "data: [DONE]"]
        ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
        assert ids == plain["choices"][0]["token_ids"] and len(ids) == 40
        s = mtp.status()
        spec = s["speculation"]
        assert spec["state"] == "on" and spec["drafter"] == "mtp" and spec["draft_tokens"] > 0, spec
        assert s["kv_free_blocks"] == s["kv_total_blocks"] == 64
        metrics = httpx.get(mtp.url + "/metrics", timeout=10).text
        drafted = float(spec["draft_tokens"])
        assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="spec-mtp",specialist="spec-mtp"}} {drafted}' in metrics
    finally:
        assert mtp.stop() == 0, mtp.proc.tail()
