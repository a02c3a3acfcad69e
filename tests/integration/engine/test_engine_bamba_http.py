"""`consort engine` serving a hybrid attention + Mamba2 checkpoint (transformers' BambaForCausalLM)
over HTTP: greedy completions equal transformers' generate, streamed and not, concurrent requests
release every block and state slot, and a repeated prompt is served from the prefix cache (its KV
blocks and the mixers' state checkpoint) with the same tokens."""
from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import procs
import pytest
import torch

from conftest import MAX_MODEL_LEN

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fidelity"))   # fidelity_helpers
from fidelity_helpers import greedy_agrees  # noqa: E402


@pytest.fixture(scope="module")
def bamba_model(demo_model, tmp_path_factory):
    """Random Bamba weights written by transformers, with the demo model's tokenizer."""
    import json

    import transformers
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    cfg = transformers.BambaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=MAX_MODEL_LEN, attn_layer_indices=[2],
                                   mamba_n_heads=8, mamba_d_state=16, mamba_chunk_size=16, mamba_n_groups=2,
                                   initializer_range=0.08, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(7)
    out = tmp_path_factory.mktemp("bamba") / "bamba"
    transformers.BambaForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / f, out / f)
    return out


def test_bamba_engine_matches_transformers_over_http(bamba_model, engine_logs):
    from transformers import AutoModelForCausalLM
    eng = procs.start_engine(bamba_model, engine_logs, "--num-blocks", "64", "--dtype", "float32",
                             name="hybrid")
    try:
        prompts = [[5, 17, 99, 230, 31], list(range(40, 90)), [300]]
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        with ThreadPoolExecutor(3) as ex:
            outs = list(ex.map(lambda p: httpx.post(eng.url + "/v1/completions", json={**body, "prompt": p},
                                                    timeout=120).json(), prompts))
        ours = [o["choices"][0]["token_ids"] for o in outs]
        model = AutoModelForCausalLM.from_pretrained(bamba_model, dtype=torch.float32).eval()
        for p, got in zip(prompts, ours):
            out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, output_logits=True, return_dict_in_generate=True)
            ref, logits = out.sequences[0, len(p):].tolist(), [row[0] for row in out.logits]
            # transformers' tokens, or parted at a near-tie (the hybrid's logits agree to ~2e-3)
            greedy_agrees(logits, ref, got, tol=2e-3, name=f"prompt of {len(p)}")
        again = httpx.post(eng.url + "/v1/completions", json={**body, "prompt": prompts[1]}, timeout=120).json()
        assert again["choices"][0]["token_ids"] == ours[1]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48     # 50 tokens: full blocks to 48
        s = eng.status()
        assert s["kv_free_blocks"] == s["kv_total_blocks"] == 64
    finally:
        assert eng.stop() == 0, eng.proc.tail()
    assert "prefix caching is off" not in eng.proc.log_path.read_text()
