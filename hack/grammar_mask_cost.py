"""Per-token mask cost of xgrammar vs llguidance on a tokenizer.json (one JSON-schema decode).

Usage: python hack/grammar_mask_cost.py MODEL_DIR [MODEL_DIR ...]
Walks a fixed valid JSON document token by token; at each step times filling the [1, ceil(V/32)]
int32 bitmask for the current state, then advances the matcher with the document's next token.
"""
from __future__ import annotations

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
    return compile_ms, statistics.median(times) * 1e6


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
    return compile_ms, statistics.median(times) * 1e6


def main(dirs: list[str]) -> None:
    print("| tokenizer | vocab | library | compile ms | median mask us/token |")
    print("|---|---|---|---|---|")
    for d in dirs:
        hf = PreTrainedTokenizerFast(tokenizer_file=f"{d}/tokenizer.json")
        vocab = max(len(hf), json.load(open(f"{d}/config.json")).get("vocab_size", 0))
        ids = hf.encode(DOC, add_special_tokens=False)
        for name, fn in (("xgrammar", xgrammar_cost), ("llguidance", llguidance_cost)):
            c, m = fn(hf, vocab, ids)
            print(f"| {d} | {vocab} | {name} {getattr(sys.modules[name], '__version__', '')} | {c:.1f} | {m:.1f} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
