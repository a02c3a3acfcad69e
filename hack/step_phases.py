"""Where a step's time goes outside the kernels: the engine's step split into its phases (schedule, prepare the
inputs, the model's forward, final norm + LM head, sampling, postprocess), median milliseconds over the decode
steps of `--requests` sequences of the bench model (prompts of `--prompt` tokens, `--output` tokens each,
greedy), with `CONSORT_FUSED_LAYERS` on and off in alternating fresh processes (`--rounds` each), so both sides
meet the same machine. Also a checkpoint of your own (`--model DIR`); requests spread over `--adapters` random
LoRA adapters of rank `--rank` (demo_model.write_demo_adapter); `--base-tree DIR` runs the first side from
another checkout (e.g. a `git worktree` of the commit before a change) with its defaults instead of this one's
engine with the layers unfused.

    PYTHONPATH=engine-image:common .venv/bin/python hack/step_phases.py --dtype bfloat16 --requests 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("step", "schedule", "prepare", "forward", "logits", "sample", "postprocess")


def child(a: argparse.Namespace) -> None:
    """One engine, timed by phase over a generate of the workload; prints one JSON line."""
    tree = Path(a.tree or REPO)
    sys.path[:0] = [str(tree / "engine-image"), str(tree / "common")]
    import torch
    from consort_engine.bench import offline
    from consort_engine.bench.workload import bench_model
    from consort_engine.core.engine import LLMEngine, freeze_heap
    from consort_engine.demo_model import write_demo_adapter
    from consort_engine.kv.sequence import SamplingParams, Sequence

    p = argparse.ArgumentParser()
    offline.add_args(p)
    model = Path(a.model or bench_model())
    cfg = offline.engine_config(model, a.dtype, p.parse_args(["--engine-only", "--no-startup"]))
    names = [f"a{i}" for i in range(a.adapters)]
    if names:
        tmp = Path(tempfile.mkdtemp(prefix="step-phases-"))
        cfg.adapters = {n: str(write_demo_adapter(model, tmp / n, rank=a.rank, seed=i)) for i, n in enumerate(names)}
        cfg.max_adapters = max(cfg.max_adapters, len(names))
    engine = LLMEngine(cfg)
    engine.warmup()
    freeze_heap()
    times: dict[str, list[float]] = {k: [] for k in PHASES}

    def timed(obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def run(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            times[phase].append(time.perf_counter() - t)
            return out
        setattr(obj, name, run)
    for obj, name, phase in ((engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
                             (engine.runner, "prepare", "prepare"), (engine.runner.model, "forward", "forward"),
                             (engine.runner.model, "compute_logits", "logits"), (engine, "_sample", "sample"),
                             (engine.scheduler, "postprocess", "postprocess")):
        timed(obj, name, phase)
    g = torch.Generator().manual_seed(0)
    vocab = engine.runner.vocab_size
    prompts = [torch.randint(3, vocab, (a.prompt,), generator=g).tolist() for _ in range(a.requests)]
    sp = SamplingParams(max_tokens=a.output, ignore_eos=True, temperature=0.0)
    seqs = [Sequence(p, sp, adapter=names[i % len(names)] if names else None) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for seq in seqs:         # LLMEngine.generate, with each request's adapter
        engine.validate(seq)
        engine.scheduler.add(seq)
    while any(not s.is_finished for s in seqs):
        engine.step()
    wall = time.perf_counter() - t0
    skip = -(-a.prompt * a.requests // engine.config.max_num_batched_tokens) + 1   # the prefill steps
    print(json.dumps({"tok_s": a.output * a.requests / wall,
                      **{k: statistics.median(v[skip:]) * 1e3 for k, v in times.items()}}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1500, help="prompt tokens of each request")
    ap.add_argument("--output", type=int, default=500, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench model)")
    ap.add_argument("--adapters", type=int, default=0, help="LoRA adapters the requests spread over (0: none)")
    ap.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    ap.add_argument("--base-tree", default=None, metavar="DIR",
                    help="run the first side from this checkout, its defaults (else: this one, layers unfused)")
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    sys.path[:0] = [str(REPO / "common")]
    from consort_common.machine import cpu_model_and_flags
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    sides = {"0": f"{a.base_tree} (its defaults)" if a.base_tree else "fused layers off", "1": "fused layers on"}
    for r in range(a.rounds):
        for fused in (("1", "0") if r % 2 == 0 else ("0", "1")):
            cmd = [sys.executable, __file__, "--child", "--dtype", a.dtype, "--requests", str(a.requests),
                   "--prompt", str(a.prompt), "--output", str(a.output), "--adapters", str(a.adapters),
                   "--rank", str(a.rank)] + (["--model", a.model] if a.model else [])
            env = os.environ | {"CONSORT_FUSED_LAYERS": fused}
            if a.base_tree and fused == "0":
                cmd, env = cmd + ["--tree", a.base_tree], os.environ
            print(f"[step_phases] round {r + 1}/{a.rounds}, {sides[fused]}", flush=True)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            runs[fused].append(json.loads(out.strip().splitlines()[-1]))
    model, flags = cpu_model_and_flags()
    shown = " ".join(f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags)
    lora = f", over {a.adapters} adapters of rank {a.rank}" if a.adapters else ""
    print(f"{model} ({shown}); {a.dtype}, {a.requests} x (prompt {a.prompt}, {a.output} out){lora}; median ms of "
          f"the decode steps, median over {a.rounds} runs (range)")
    first = "base tree" if a.base_tree else "modules"
    print(f"| phase | {first} | fused | fused / {first} |\n|---|---|---|---|")
    for k in ("tok_s",) + PHASES:
        off, on = ([run[k] for run in runs[f]] for f in ("0", "1"))
        fmt = "{:.1f}" if k == "tok_s" else "{:.3f}"
        cell = lambda v: f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"  # noqa: E731
        print(f"| {'tok/s' if k == 'tok_s' else k} | {cell(off)} | {cell(on)} | "
              f"{statistics.median(on) / statistics.median(off):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
