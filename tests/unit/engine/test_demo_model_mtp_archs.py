"""`consort demo-model --mtp` for every --arch it offers: the MTP block is the base model's own decoder
layer (Qwen3: q/k norms, Qwen2: q/k/v biases), trained by transformers' modules of that arch, and
the engine's MTP drafter serves it: its drafts equal the full-recompute reference
(demo_model.mtp_reference_drafts, as tests/fidelity/test_mtp.py checks the llama block), in both
checkpoint layouts."""
from __future__ import annotations

import json
import random

import pytest
from safetensors import safe_open

from consort_engine.config import EngineConfig
from consort_engine.demo_model import main, mtp_reference_drafts, train_tokenizer, write_demo_model
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams

VOCAB = 512
LAYERS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(VOCAB, limit_bytes=300_000)


def mtp_model(root, arch: str, layout: str, tokenizer):
    return write_demo_model(root / f"{arch}-{layout}", arch=arch, hidden=64, layers=LAYERS, heads=4, kv_heads=2,
                            ffn=128, vocab=VOCAB, max_pos=256, seed=0, tokenizer=tokenizer, mtp=layout,
                            mtp_seconds=120, mtp_steps=3)


def drafting_engine(model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, speculative="mtp",
                                  num_speculative_tokens=3, max_model_len=256, max_num_batched_tokens=16))


def served_drafts(eng: LLMEngine, prompt: list[int]) -> list[tuple[list[int], list[int]]]:
    """(context, drafts) of every MTP draft window of a greedy run of `prompt`."""
    seen: list[tuple[list[int], list[int]]] = []
    inner = eng._draft_mtp

    def spy(batch):
        inner(batch)
        for seq, k in zip(batch.seqs, batch.num_draft or []):
            if k:
                seen.append((seq.token_ids[: seq.num_computed_tokens + 1], seq.token_ids[-k:]))

    eng._draft_mtp = spy
    eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    return seen


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(7, VOCAB) for _ in range(24)]
    return base + base[:12]


def assert_drafts_match_reference(model, eng: LLMEngine) -> None:
    assert eng.runner.has_mtp and eng.stats()["speculation"]["state"] == "on"
    seen = served_drafts(eng, prompt(3))
    assert len(seen) >= 4
    matched = sum(mtp_reference_drafts(model, ctx, len(d)) == d for ctx, d in seen[:6])
    assert matched >= min(len(seen), 6) - 1, f"{matched} of {min(len(seen), 6)} draft windows matched"


# llama: tests/fidelity/test_mtp.py
@pytest.mark.parametrize("arch,layout", [("qwen3", "qwen3_next"), ("qwen3", "deepseek_v3"),
                                         ("qwen2", "deepseek_v3"), ("mistral", "qwen3_next")])
def test_mtp_drafts_of_every_arch_equal_the_reference(arch, layout, tokenizer, tmp_path):
    model = mtp_model(tmp_path, arch, layout, tokenizer)
    eng = drafting_engine(model)
    attn = eng.runner.model.mtp.layer.self_attn
    assert (attn.q_norm is not None) == (arch == "qwen3")            # the arch's own decoder layer
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert_drafts_match_reference(model, eng)


def test_demo_model_cli_qwen3_mtp_deepseek_layout(tmp_path):
    """The issue's command (without --train, whose fit is not what failed): a checkpoint whose MTP
    block is a Qwen3 decoder layer under DeepSeek-V3 names, drafted by the engine as transformers
    computes it."""
    out = tmp_path / "qwen3-mtp"
    assert main([str(out), "--arch", "qwen3", "--size", "tiny", "--mtp", "deepseek_v3", "--mtp-seconds", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["num_nextn_predict_layers"] == 1
    n = cfg["num_hidden_layers"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {f"model.layers.{n}.self_attn.q_norm.weight", f"model.layers.{n}.eh_proj.weight"} <= names
    assert not any(k.startswith("mtp.") for k in names)
    assert_drafts_match_reference(out, drafting_engine(out))
