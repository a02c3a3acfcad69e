"""`consort bench spec MODEL`: speculative decoding on one checkpoint: none vs n-gram vs MTP drafting,
each drafter under the draft policies (goodput: draft where it pays; always: every decode drafts K).

For each drafter, policy, batch size (1 and 16 by default) and prompt kind, greedy runs (or sampled
ones, `--temperature`, seeded per request) of the same requests: acceptance rate (accepted / drafted
tokens), engine steps and end-to-end tokens/s (output tokens over wall time of `generate`, warm-up
excluded, the fastest of --repeats runs) and tokens per CPU-second of the process (steadier than wall
time where other work shares the CPU). Greedy outputs must equal the no-drafter run's (the last
column; the exit status is 1 otherwise: use float32, where it is exact); sampled runs are not
compared (typical acceptance keeps drafts the model would not have sampled). Prompt kinds, cut from
the checkpoint's C++ corpus (libstdc++):
- copy-heavy: a header excerpt, then the instruction to repeat it and its first line again (the
  continuation echoes the context: what prompt lookup is for);
- free-form: a header excerpt alone (the continuation is new text).
MTP needs a checkpoint with an MTP block (`consort demo-model OUT --train --mtp`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from consort_engine.config import checkpoint_dir


def prompts(model: Path, kind: str, n: int, length: int) -> list[list[int]]:
    from tokenizers import Tokenizer
    from consort_engine.demo_model import cpp_text
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    texts = [t for t in cpp_text(limit_bytes=3_000_000) if len(t) > 4 * length][: 4 * n]
    out = []
    for i in range(n):
        ids = tok.encode(texts[(7 * i) % len(texts)][1000:]).ids[:length]
        if kind == "copy-heavy":
            again = tok.encode("\n// The same again:\n").ids
            ids = ids + again + ids[: length // 4]
        out.append(ids)
    return out


def run_one(model: Path, drafter: str, policy: str, ps: list[list[int]], max_tokens: int, args) -> dict:
    from consort_engine.config import EngineConfig
    from consort_engine.core.engine import LLMEngine
    from consort_engine.kv.sequence import SamplingParams
    engine = LLMEngine(EngineConfig(model=str(model), name="bench", device=args.device, dtype=args.dtype,
                                    speculative=drafter, num_speculative_tokens=args.k, spec_policy=policy,
                                    max_num_seqs=max(16, len(ps)), max_model_len=args.max_model_len))
    engine.warmup()
    engine.generate([ps[0]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))   # verify path warm
    sched = engine.scheduler
    params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(ps))]
    wall = cpu = float("inf")
    for _ in range(args.repeats):          # the fastest of the repeats: a shared CPU is noisy
        sched.spec.num_draft_tokens = sched.spec.num_accepted_tokens = 0
        steps0 = engine.num_steps
        if args.device == "cuda":
            import torch
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(ps, params)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    spec = engine.stats()["speculation"]
    return {"drafter": drafter, "policy": policy if drafter != "off" else "-", "state": spec["state"],
            "outputs": outs, "wall_s": wall,
            "tok_s": sum(map(len, outs)) / wall, "tok_cpu_s": sum(map(len, outs)) / cpu, "steps": engine.num_steps - steps0,
            "acceptance": spec["acceptance_rate"], "drafted": spec["draft_tokens"]}


def main(args: argparse.Namespace) -> int:
    if args.threads:
        from consort_engine.model.cpu_kernels import set_threads
        set_threads(args.threads)
    model = Path(args.model)
    drafters, policies = args.drafters.split(","), args.policies.split(",")
    if not set(drafters) <= {"off", "ngram", "mtp"} or not set(policies) <= {"goodput", "always"}:
        raise SystemExit(f"consort bench spec: drafters are off, ngram, mtp and policies goodput, always; "
                         f"got {args.drafters!r} and {args.policies!r}")
    rows = []
    for kind in args.kinds.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            ps = prompts(model, kind, batch, args.prompt_len)
            base = None
            arms = [(d, p) for d in drafters for p in (policies if d != "off" else ["-"])]
            for drafter, policy in arms:
                r = run_one(model, drafter, policy, ps, args.max_tokens, args)
                base = base or dict(r)
                same = sum(a == b for a, b in zip(r["outputs"], base["outputs"])) / len(ps)
                r.update(kind=kind, batch=batch, speedup=r["tok_s"] / base["tok_s"],
                         cpu_speedup=r["tok_cpu_s"] / base["tok_cpu_s"],
                         same=same if args.temperature == 0 else None)
                del r["outputs"]
                rows.append(r)
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                print(f"{kind:<10} batch {batch:>2} {drafter:<5} {policy:<7} ({r['state']}): acceptance {acc}, "
                      f"{r['tok_s']:.1f} tok/s, {r['steps']} steps", file=sys.stderr, flush=True)
    print("| prompts | batch | drafter | policy | acceptance | drafted | steps | tokens/s | vs none | tokens/CPU-s "
          "| vs none | output = none's |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        same = "-" if r["same"] is None else f"{r['same']:.0%}"
        print(f"| {r['kind']} | {r['batch']} | {r['drafter']} | {r['policy']} | {acc} | {r['drafted']} | "
              f"{r['steps']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['tok_cpu_s']:.1f} | "
              f"{r['cpu_speedup']:.2f}x | {same} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["same"] in (None, 1.0) for r in rows) else 1


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=checkpoint_dir, help="checkpoint directory (with an MTP block for the mtp rows)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine runs")
    p.add_argument("--dtype", default="auto", help="as `consort engine --dtype` (float32: greedy outputs compare exactly)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--drafters", default="off,ngram,mtp", help="drafters, comma-separated (off is the baseline: "
                   "first)")
    p.add_argument("--policies", default="goodput,always", help="draft policies, comma-separated (as `consort "
                   "engine --speculative-policy`)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampled requests (seeded per request) "
                   "instead of greedy ones; outputs are then not compared")
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--kinds", default="copy-heavy,free-form", help="prompt kinds, comma-separated (see above)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--max-model-len", type=int, default=1024, help="as `consort engine --max-model-len`")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice); with 1, "
                   "tokens per CPU-second is steady on a shared machine")
    p.add_argument("--repeats", type=int, default=3, help="runs per row; the fastest counts")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
