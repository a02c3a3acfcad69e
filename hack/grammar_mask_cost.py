"""Per-token mask cost of xgrammar vs llguidance on a tokenizer.json (one JSON-schema decode).

Usage: python hack/grammar_mask_cost.py MODEL_DIR [MODEL_DIR ...] [--bpe32k]  (--bpe32k: also a
32k-token byte-level BPE trained here on the Python stdlib, see train_bpe)
Walks a fixed valid JSON document token by token; at each step times filling the [1, ceil(V/32)]
int32 bitmask for the current state, then advances the matcher with the document's next token.
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"],
          "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]})


def xgrammar_cost(hf, vocab: int, ids: list[int]) -> tuple[float, float]:
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    t = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - t) * 1e3
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for tok in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert m.accept_token(tok), tok
    return compile_ms, times


def llguidance_cost(hf, vocab: int, ids: list[int]) -> tuple[float, float]:
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(tok, grammar)
    compile_ms = (time.perf_counter() - t) * 1e3
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for t_id in ids:
        t = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t)
        assert m.consume_token(t_id), (t_id, m.get_error())
    return compile_ms, times


def main(dirs: list[str]) -> None:
    print("| tokenizer | vocab | library | compile ms | mask us/token: median | mean | max |")
    print("|---|---|---|---|---|---|---|")
    for d in dirs:
        hf = PreTrainedTokenizerFast(tokenizer_file=f"{d}/tokenizer.json")
        vocab = max(len(hf), json.load(open(f"{d}/config.json")).get("vocab_size", 0))
        ids = hf.encode(DOC, add_special_tokens=False)
        for name, fn in (("xgrammar", xgrammar_cost), ("llguidance", llguidance_cost)):
            c, t = fn(hf, vocab, ids)
            us = [x * 1e6 for x in t]
            print(f"| {d} | {vocab} | {name} {importlib.metadata.version(name)} | {c:.1f} | "
                  f"{statistics.median(us):.1f} | {statistics.mean(us):.1f} | {max(us):.1f} |")




def train_bpe(out: str, vocab: int = 32000) -> str:
    """A byte-level BPE tokenizer of `vocab` tokens trained on the Python stdlib sources: a realistic
    large vocabulary where no model hub is reachable (only the vocabulary matters to the mask)."""
    import glob
    import os
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "..", "**", "*.py"), recursive=True))
    def texts():
        for path in files[:3000]:
            try:
                yield open(path, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue

    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(f"{out}/tokenizer.json")
    with open(f"{out}/config.json", "w") as f:
        json.dump({"vocab_size": tok.get_vocab_size()}, f)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    argv = [a for a in sys.argv[1:] if a != "--bpe32k"]
    if "--bpe32k" in sys.argv:
        argv.append(train_bpe("/tmp/consort-bpe32k"))
    main(argv)
