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
