"""Where a step's time goes outside the kernels: the engine's step split into its phases (schedule, prepare the
inputs, the model's forward, final norm + LM head, sampling, postprocess), median milliseconds over the decode
steps of `--requests` sequences of the bench model (prompts of `--prompt` tokens, `--output` tokens each,
greedy), with `CONSORT_FUSED_LAYERS` on and off in alternating fresh processes (`--rounds` each), so both sides
meet the same machine. Also a checkpoint of your own (`--model DIR`).

    PYTHONPATH=engine-image:common .venv/bin/python hack/step_phases.py --dtype bfloat16 --requests 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("step", "schedule", "prepare", "forward", "logits", "sample", "postprocess")


def child(a: argparse.Namespace) -> None:
    """One engine, timed by phase over a generate of the workload; prints one JSON line."""
    sys.path[:0] = [str(REPO / "engine-image"), str(REPO / "common")]
    import torch
    from consort_engine.bench import offline
    from consort_engine.bench.workload import bench_model
    from consort_engine.core.engine import LLMEngine, freeze_heap
    from consort_engine.kv.sequence import SamplingParams

    p = argparse.ArgumentParser()
    offline.add_args(p)
    engine = LLMEngine(offline.engine_config(Path(a.model or bench_model()), a.dtype,
                                             p.parse_args(["--engine-only", "--no-startup"])))
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
    params = [SamplingParams(max_tokens=a.output, ignore_eos=True, temperature=0.0) for _ in prompts]
    t0 = time.perf_counter()
    engine.generate(prompts, params)
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
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    sys.path[:0] = [str(REPO / "common")]
    from consort_common.machine import cpu_model_and_flags
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(a.rounds):
        for fused in (("1", "0") if r % 2 == 0 else ("0", "1")):
            cmd = [sys.executable, __file__, "--child", "--dtype", a.dtype, "--requests", str(a.requests),
                   "--prompt", str(a.prompt), "--output", str(a.output)] + (["--model", a.model] if a.model else [])
            print(f"[step_phases] round {r + 1}/{a.rounds}, fused layers {'on' if fused == '1' else 'off'}", flush=True)
            out = subprocess.run(cmd, env=os.environ | {"CONSORT_FUSED_LAYERS": fused}, capture_output=True,
                                 text=True, check=True).stdout
            runs[fused].append(json.loads(out.strip().splitlines()[-1]))
    model, flags = cpu_model_and_flags()
    shown = " ".join(f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags)
    print(f"{model} ({shown}); {a.dtype}, {a.requests} x (prompt {a.prompt}, {a.output} out); median ms of the "
          f"decode steps, median over {a.rounds} runs (range)")
    print("| phase | modules | fused | fused / modules |\n|---|---|---|---|")
    for k in ("tok_s",) + PHASES:
        off, on = ([run[k] for run in runs[f]] for f in ("0", "1"))
        fmt = "{:.1f}" if k == "tok_s" else "{:.3f}"
        cell = lambda v: f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"  # noqa: E731
        print(f"| {'tok/s' if k == 'tok_s' else k} | {cell(off)} | {cell(on)} | "
              f"{statistics.median(on) / statistics.median(off):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
