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


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False)])
def test_demo_checkpoint_loads_in_transformers_and_matches_our_runner(arch, tie, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = write_demo_model(tmp_path / arch, arch=arch, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128,
                           vocab=512, max_pos=256, seed=3, tie=tie, tokenizer=demo_tokenizer())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is tie
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
    seq = Sequence(prompt_token_ids=ids)
    seq.block_table = list(range(4))
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
