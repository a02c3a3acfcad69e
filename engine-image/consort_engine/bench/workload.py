"""The benchmark checkpoint (a tiny random Llama, built once and cached) and the seeded workload of
requests every engine benchmark and the side-by-side with vLLM run."""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path


BENCH_SPEC = {
    "arch": "llama", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "intermediate_size": 1408, "vocab_size": 32000,
    "max_position_embeddings": 2048, "seed": 0, "version": 1,
}
HF_BATCH = 16
TOKEN_LOW = 3            # prompt ids drawn from [TOKEN_LOW, vocab): no specials (unk/bos/eos = 0/1/2)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# checkpoint


def cache_dir() -> Path:
    return Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))


def _byte_tokenizer_json() -> str:
    """A byte-level BPE with no merges (259 ids: <unk> <s> </s> + 256 bytes): enough for the server's
    text path; the benchmark itself feeds token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok.to_str()


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def build_checkpoint(out: Path, spec: dict = BENCH_SPEC) -> Path:
    """Write the benchmark checkpoint with transformers (config.json + model.safetensors) and a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=spec["hidden_size"], num_hidden_layers=spec["num_hidden_layers"],
                      num_attention_heads=spec["num_attention_heads"],
                      num_key_value_heads=spec["num_key_value_heads"],
                      intermediate_size=spec["intermediate_size"], vocab_size=spec["vocab_size"],
                      max_position_embeddings=spec["max_position_embeddings"], tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(spec["seed"])
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(_byte_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "add_bos_token": True, "chat_template": CHAT_TEMPLATE, "model_max_length": spec["max_position_embeddings"]}))
    (out / "bench-spec.json").write_text(json.dumps(spec, sort_keys=True))
    return out


def bench_model(rebuild: bool = False) -> Path:
    out = cache_dir() / "bench-model"
    stamp = out / "bench-spec.json"
    if not rebuild and stamp.exists() and json.loads(stamp.read_text()) == BENCH_SPEC \
            and (out / "model.safetensors").exists():
        log(f"checkpoint: cached at {out}")
        return out
    log(f"checkpoint: building the benchmark model at {out} ...")
    t0 = time.perf_counter()
    build_checkpoint(out)
    log(f"checkpoint: built in {time.perf_counter() - t0:.1f} s")
    return out


# ---------------------------------------------------------------------------------------------
# workload


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(n: int, seed: int = 0, prompt_len=(64, 512), output_len=(16, 128), vocab: int = 32000) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_len)
        prompts.append([rng.randrange(TOKEN_LOW, vocab) for _ in range(plen)])
        outs.append(rng.randint(*output_len))
    return Workload(prompts, outs)
