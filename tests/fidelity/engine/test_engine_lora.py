"""LoRA adapters (PEFT format) applied unmerged vs transformers running the merged weights
(W + scaling * B A), with base and two adapters' requests mixed in the same steps; on a hybrid too (attention
layers' q/k/v/o, mixers' in_proj/out_proj, every layer's MLP)."""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from fidelity_helpers import assert_greedy_matches, hf_greedy, make_checkpoint

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.model.lora import AdapterError, load_peft_adapter
from consort_engine.kv.sequence import SamplingParams, Sequence

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HYBRID_PROJ = PROJ + ("in_proj", "out_proj")       # a Bamba mixer's


def lora_targets(model, targets) -> list[tuple[str, torch.nn.Linear]]:
    """(peft's key prefix, module) of each projection of a transformers model that `targets` names."""
    out = []
    for name, module in model.named_modules():
        m = re.fullmatch(r"model\.layers\.\d+\.(?:self_attn|mlp|feed_forward|mamba)\.(\w+_proj)", name)
        if m and m.group(1) in targets:
            out.append((f"base_model.model.{name}", module))
    return out


def write_adapter(ckpt: Path, out: Path, seed: int, rank: int = 8, alpha: float = 16.0,
                  targets=PROJ) -> Path:
    """A random PEFT LoRA adapter for ckpt (layout and key names as peft's save_pretrained writes)."""
    import transformers
    from safetensors.torch import save_file
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for prefix, module in lora_targets(model, targets):
        w = module.weight
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.3
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.3
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
         "base_model_name_or_path": str(ckpt)}))
    return out


def merged_checkpoint(ckpt: Path, adapter: Path, out: Path) -> Path:
    """The reference: the adapter folded into the weights, saved as a plain checkpoint."""
    import transformers
    from safetensors.torch import load_file
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        for prefix, module in lora_targets(model, HYBRID_PROJ):
            if f"{prefix}.lora_A.weight" in lora:
                module.weight += scaling * lora[f"{prefix}.lora_B.weight"] @ lora[f"{prefix}.lora_A.weight"]
    model.save_pretrained(out)
    for f in ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "bamba"])
def test_mixed_base_and_adapter_requests_match_merged_weights(arch, tmp_path):
    ckpt = make_checkpoint(arch, tmp_path)
    hybrid = arch == "bamba"
    a1 = write_adapter(ckpt, tmp_path / "a1", seed=1, targets=HYBRID_PROJ if hybrid else PROJ)
    a2 = write_adapter(ckpt, tmp_path / "a2", seed=2, rank=4, alpha=4.0,
                       targets=("q_proj", "in_proj", "down_proj") if hybrid else ("q_proj", "v_proj", "down_proj"))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(9)]
    names = [None, "a1", "a2"] * 3
    refs = {None: hf_greedy(ckpt, prompts, 12),
            "a1": hf_greedy(merged_checkpoint(ckpt, a1, tmp_path / "m1"), prompts, 12),
            "a2": hf_greedy(merged_checkpoint(ckpt, a2, tmp_path / "m2"), prompts, 12)}
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, num_blocks=256,
                                    adapters={"a1": str(a1), "a2": str(a2)}))
    assert engine.stats()["adapters"] == {"a1": "loaded", "a2": "loaded"}

    def run(names: list[str | None]) -> list[Sequence]:
        seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), adapter=n)
                for p, n in zip(prompts, names)]
        for s in seqs:
            engine.scheduler.add(s)
        while engine.has_unfinished():
            engine.step()
        assert_greedy_matches([refs[n][i] for i, n in enumerate(names)], [s.output_token_ids for s in seqs],
                              name="lora")
        return seqs
    seqs = run(names)
    differs = sum(n is not None and s.output_token_ids != refs[None][i].tokens
                  for i, (s, n) in enumerate(zip(seqs, names)))
    assert differs >= 4, "the adapters should change most outputs"
    # the same prompts under another adapter each (their cached prefixes, a hybrid's states with them, are
    # another adapter's: none may serve them), then under the first run's again (now they do)
    run(names[1:] + names[:1])
    hits = engine.stats()["prefix_cache_hits"]
    run(names)
    assert engine.stats()["prefix_cache_hits"] > hits
    assert engine.block_manager.num_free_blocks == 256


def test_bad_adapters_are_refused_with_the_reason(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path)
    shapes = {"qkv_proj": [(64, 64), (32, 64), (32, 64)], "o_proj": [(64, 64)],
              "gate_up_proj": [(160, 64), (160, 64)], "down_proj": [(64, 160)]}
    with pytest.raises(AdapterError, match="needs adapter_config.json"):
        load_peft_adapter("x", tmp_path / "missing", [shapes] * 2)
    good = write_adapter(ckpt, tmp_path / "ok", seed=3, rank=4)
    assert load_peft_adapter("ok", good, [shapes] * 2).rank == 4
    with pytest.raises(AdapterError, match="targets layer 1; the model has 1"):
        load_peft_adapter("ok", good, [shapes])
    wrong = {**shapes, "down_proj": [(64, 128)]}
    with pytest.raises(AdapterError, match="down_proj has A"):
        load_peft_adapter("ok", good, [shapes, wrong])
    mixer = {"in_proj": [(272, 64)], "out_proj": [(64, 128)], "gate_up_proj": shapes["gate_up_proj"],
             "down_proj": shapes["down_proj"]}         # a hybrid's mixer layer: no attention projections
    with pytest.raises(AdapterError, match="layer 0 has no k_proj"):
        load_peft_adapter("ok", good, [mixer, shapes])
    from safetensors.torch import save_file
    head = tmp_path / "head"
    shutil.copytree(good, head)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, str(head / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="unsupported tensor"):
        load_peft_adapter("head", head, [shapes] * 2)


def test_demo_adapter_on_a_hybrid_demo_model(tmp_path):
    """`demo://lora`'s adapter (demo_model.write_demo_adapter) on `consort demo-model --arch bamba`'s model:
    every projection its layers have (attention, mixers' in/out, MLPs), loaded, and it changes what the
    model says."""
    from safetensors.torch import load_file

    from consort_engine.demo_model import write_demo_adapter, write_demo_model

    model_dir = write_demo_model(tmp_path / "bamba", arch="bamba", hidden=64, layers=4, vocab=512, max_pos=256)
    adapter = write_demo_adapter(model_dir, tmp_path / "lora", rank=4, seed=1)
    names = set(load_file(str(adapter / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.mamba.in_proj.lora_A.weight" in names
    assert "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight" in names
    assert not any("layers.0.self_attn" in n or "layers.3.mamba" in n for n in names)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=64,
                                    adapters={"lora": str(adapter)}))
    prompt = list(range(5, 25))
    outs = {}
    for name in (None, "lora"):
        seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), adapter=name)
        engine.scheduler.add(seq)
        while engine.has_unfinished():
            engine.step()
        outs[name] = seq.output_token_ids
    assert outs[None] != outs["lora"]
