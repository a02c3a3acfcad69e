"""`consort demo-model`: checkpoints transformers loads, and our runner computes what it computes."""
from __future__ import annotations

import json

import pytest
import torch
from fidelity_helpers import demo_tokenizer

from consort_engine.config import EngineConfig
from consort_engine.demo_model import main, write_demo_model
from consort_engine.model.model_runner import ModelRunner
from consort_engine.kv.sequence import ScheduledBatch, Sequence


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False),
                                      ("bamba", False), ("bamba", True)])
def test_demo_checkpoint_loads_in_transformers_and_matches_our_runner(arch, tie, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    layers = 6 if arch == "bamba" else 2
    out = write_demo_model(tmp_path / arch, arch=arch, hidden=64, layers=layers, heads=4, kv_heads=2, ffn=128,
                           vocab=512, max_pos=256, seed=3, tie=tie, tokenizer=demo_tokenizer())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is tie
    if arch == "bamba":     # attention in every fourth layer, Mamba2 mixers elsewhere
        assert cfg["attn_layer_indices"] == [3] and cfg["mamba_n_heads"] * cfg["mamba_d_head"] == 2 * 64
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = "template <typename T> struct hash;"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tok.eos_token == "</s>" and tok.convert_tokens_to_ids("</s>") in cfg["eos_token_id"]

    runner = ModelRunner(EngineConfig(model=str(out), num_blocks=16))
    assert runner.eos_token_ids == set(cfg["eos_token_id"])
    assert runner.is_hybrid == (arch == "bamba")
    seq = Sequence(prompt_token_ids=ids)
    seq.block_table = list(range(4))
    seq.state_slot = 0 if runner.is_hybrid else -1
    ours = runner.execute(ScheduledBatch([seq], [len(ids)], [True], mode="prefill"))[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_demo_model_cli_is_deterministic(tmp_path, capsys):
    assert main([str(tmp_path / "a"), "--arch", "qwen3", "--seed", "1"]) == 0
    assert main([str(tmp_path / "b"), "--arch", "qwen3", "--seed", "1"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "a"), str(tmp_path / "b")]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (256, 4, 4096)


def test_demo_bamba_serves_and_refuses_mtp(tmp_path, capsys):
    """`consort demo-model --arch bamba`: a hybrid the engine serves (greedy tokens equal transformers', or
    part at a near-tie); asking for an MTP block with it is an error that says why."""
    from fidelity_helpers import greedy_agrees, hf_greedy

    from consort_engine.core.engine import LLMEngine
    from consort_engine.kv.sequence import SamplingParams

    assert main([str(tmp_path / "h"), "--arch", "bamba", "--seed", "2"]) == 0
    out = tmp_path / "h"
    assert capsys.readouterr().out.split() == [str(out)]
    engine = LLMEngine(EngineConfig(model=str(out), num_blocks=64, max_num_seqs=4))
    assert engine.runner.is_hybrid and engine.runner.num_kv_layers == 1      # layers 0-2 mixers, 3 attention
    engine.warmup()
    prompts = [[5, 60, 700, 33, 9], [1000, 2, 3]]
    got = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2)
    for ref, tokens in zip(hf_greedy(out, prompts, [6, 6]), got):
        assert len(tokens) == 6 and greedy_agrees(ref.logits, ref.tokens, tokens, name="demo bamba")[0] >= 1
    with pytest.raises(ValueError, match="--mtp is not available with --arch bamba"):
        write_demo_model(tmp_path / "m", arch="bamba", mtp="qwen3_next", tokenizer=demo_tokenizer())
