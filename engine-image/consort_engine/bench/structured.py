"""`consort bench structured`: guided (JSON-schema) decoding tokens/s vs free decoding, side by side.

Same engine, same prompts, same batch sizes: each batch first runs guided to completion, then runs
free with every sequence held to the very token count its guided twin produced (ignore_eos), so
both sides decode the same number of tokens in the same batch shapes and the ratio is the cost of
the grammar (mask fill on the CPU, bitmask unpack + masked_fill, matcher advance). Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from consort_engine.config import checkpoint_dir

# Bounded by construction (the demo model's gibberish never closes an unbounded string), and free of
# maxLength strings, whose masks cost xgrammar 0.2.8 ~30x more per step (docs/structured-output.md).
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "tags", "score", "ranks"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["vector", "map", "set", "deque", "list"]},
                                  "minItems": 3, "maxItems": 6},
                         "score": {"enum": ["low", "mid", "high"]},
                         "ranks": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                                   "minItems": 4, "maxItems": 8}}}


def _run(engine, prompts: list[list[int]], params: list, matchers: list | None) -> tuple[list, float]:
    from consort_engine.kv.sequence import Sequence
    seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params)]
    for s, m in zip(seqs, matchers or [None] * len(seqs)):
        s.matcher = m
        engine.scheduler.add(s)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return seqs, time.perf_counter() - t


def run(args: argparse.Namespace) -> int:
    from consort_engine.config import EngineConfig
    from consort_engine.demo_model import write_demo_model
    from consort_engine.core.engine import LLMEngine
    from consort_engine.text.guided import Grammars, GuidedSpec
    from consort_engine.model.loader import eos_token_ids, load_model_config
    from consort_engine.kv.sequence import SamplingParams
    from consort_engine.text.tokenizer import Tokenizer

    model = Path(args.model) if args.model else write_demo_model(Path(tempfile.mkdtemp()) / "demo", seed=0)
    tok = Tokenizer.from_dir(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tok.hf, vocab, sorted(eos_token_ids(model, load_model_config(model))))
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA), "bench")
    engine = LLMEngine(EngineConfig(name="bench", model=str(model), device=args.device, num_blocks=args.num_blocks))
    engine.warmup()
    prompt = tok.hf.encode("Describe one record as JSON:", add_special_tokens=False).ids
    rows = []
    for batch in args.batch:
        prompts = [prompt + [7 + i] for i in range(batch)]      # distinct prompts: no shared prefix blocks
        guided_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, guided=spec)
                         for i in range(batch)]
        _run(engine, prompts, guided_params, [grammars.matcher(spec) for _ in prompts])   # warm caches
        g_seqs, g_s = _run(engine, prompts, guided_params, [grammars.matcher(spec) for _ in prompts])
        lengths = [s.num_output_tokens for s in g_seqs]
        valid = sum(_valid(tok.decode(s.output_token_ids, True)) for s in g_seqs)
        free_params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                       for i, n in enumerate(lengths)]
        f_seqs, f_s = _run(engine, prompts, free_params, None)
        tokens = sum(lengths)
        assert sum(s.num_output_tokens for s in f_seqs) == tokens
        rows.append((batch, tokens, f_s, g_s, valid))
    print(table(rows, args.device))
    return 0


def _valid(text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def table(rows: list[tuple[int, int, float, float, int]], device: str) -> str:
    lines = [f"structured output cost, demo model, {device}: same tokens, same batch shapes",
             "| batch | tokens | free tok/s | json_schema tok/s | cost (guided s / free s) | valid JSON |",
             "|---:|---:|---:|---:|---:|---:|"]
    for batch, tokens, f_s, g_s, valid in rows:
        lines.append(f"| {batch} | {tokens} | {tokens / f_s:.0f} | {tokens / g_s:.0f} | {g_s / f_s:.2f}x | "
                     f"{valid}/{batch} |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, type=checkpoint_dir, metavar="DIR",
                   help="checkpoint directory; unset: a fresh demo model")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine runs")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes, one row each")
    p.add_argument("--max-tokens", type=int, default=160, help="most tokens a guided answer may take")
    p.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks of the engine")
