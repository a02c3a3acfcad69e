"""LLMEngine with the real ModelRunner and Sampler on a tiny random Llama checkpoint (CPU, fp32).

Scheduling must not change what the model computes: a pool small enough to force preemption,
a token budget that chunks prefills and shared prefixes that hit the cache give the same greedy
tokens as an unconstrained run, and those tokens are the model's own (top-ranked by transformers
under teacher forcing)."""
from __future__ import annotations

import random

import pytest
import torch

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.kv.sequence import SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    return out, model


def prompts(n: int = 10, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 60))]
        out.append(shared + tail if i % 2 else tail)
    return out


def run(ckpt, **cfg) -> tuple[list[list[int]], dict]:
    config = EngineConfig(model=str(ckpt), dtype="float32", block_size=4, **cfg)
    engine = LLMEngine(config)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(10)]
    out = engine.generate(prompts(), params)
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    return out, stats


def test_real_runner_outputs_do_not_depend_on_scheduling(tiny_llama):
    ckpt, model = tiny_llama
    reference, _ = run(ckpt, num_blocks=512, max_num_batched_tokens=2048)
    constrained, stats = run(ckpt, num_blocks=48, max_num_batched_tokens=32)
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert constrained == reference

    # The engine's greedy tokens are the model's: each is transformers' top-1 (top-3 tolerance
    # for float near-ties) given the same prefix.
    for prompt, out in zip(prompts(), reference):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            logits = model(ids).logits[0]
        for k, tok in enumerate(out):
            top = logits[len(prompt) - 1 + k].topk(3).indices.tolist()
            assert tok in top, (k, tok, top)


@pytest.mark.parametrize("bf16_dot", [True, False])
def test_auto_dtype_keeps_a_bf16_checkpoint_in_bf16_where_the_cpu_multiplies_it(tiny_llama, tmp_path, monkeypatch,
                                                                               bf16_dot):
    """`--dtype auto` on a CPU: a bf16 checkpoint (what real checkpoints ship) loads as bf16 where the
    CPU has a bf16 dot product, else as float32; a float32 checkpoint stays float32. Either way every
    weight is the checkpoint's value, and the engine serves."""
    from consort_engine.model import model_runner
    from consort_engine.model.loader import resolve_dtype

    monkeypatch.setattr(model_runner, "has_bf16_dot", lambda: bf16_dot)
    import copy

    _, model = tiny_llama
    bf16_dir = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(bf16_dir)
    expected = torch.bfloat16 if bf16_dot else torch.float32
    assert resolve_dtype("auto", "cpu", "bfloat16", bf16_dot) == expected
    assert resolve_dtype("auto", "cpu", "float16", bf16_dot) == torch.float32
    assert resolve_dtype("auto", "cuda", "float32", bf16_dot) == torch.bfloat16
    assert resolve_dtype("float32", "cpu", "bfloat16", bf16_dot) == torch.float32
    for ckpt, dtype in ((bf16_dir, expected), (tiny_llama[0], torch.float32)):
        engine = LLMEngine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=64))
        embed = engine.runner.model.embed_tokens.weight
        assert engine.runner.dtype == embed.dtype == dtype
        stored = model.model.embed_tokens.weight.detach()
        assert torch.equal(embed.float(), stored.to(torch.bfloat16).float() if ckpt == bf16_dir else stored)
        out = engine.generate([[5, 6, 7]], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
        assert len(out[0]) == 4
