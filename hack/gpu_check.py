"""`make gpu-check`: every GPU check in one command (under 8 minutes on one H100), one table at the end.

Steps (`--dry-run` lists them with their commands and time limits, and runs nothing):
1. `pytest tests/gpu`: the engine on CUDA vs transformers on the same GPU (flash / triton / torch
   attention, block sizes, CUDA graphs vs eager), pinned staging, `_scaled_mm` fp8 vs the emulation,
   fp8 fidelity on held-out text.
2. `consort bench offline --device cuda --dtype bfloat16 --quick`: one run against transformers
   `generate` on the GPU (flash attention, graphs on), then engine-only runs for the other attention
   backends with CUDA graphs on and off; every row's ratio is against that one transformers figure.
3. `consort bench quant --device cuda`: bf16 vs fp8 weights, side by side.
Each step has its own time limit; a step that fails or times out is a FAIL row, and the others still run.
Where flash-attn does not import (it has no wheels on PyPI), the flash rows say so (skip) and the
transformers run moves to the triton backend. The exit status is 1 if any step failed.

On a GPU machine without a package index: `make gpu-wheels` (here) downloads the engine's packages that
a PyTorch image may lack into .whl/; there, `python3 -m pip install --no-index --no-deps --target
/tmp/site .whl/*.whl && PYTHONPATH=/tmp/site python3 hack/gpu_check.py` (docs/gpu.md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480                       # the whole check: 8 minutes
# attention backend -> block size it runs with (flash-attn reads paged KV in 256-token pages)
BACKENDS = {"flash": 256, "triton": 16}


@dataclass
class Step:
    name: str                        # the table's first column
    argv: list[str]
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)
    json_path: str | None = None     # where the bench writes its results (None: a pytest step)


@dataclass
class Row:
    name: str
    ok: bool
    seconds: float
    result: str                      # "12 passed, 3 skipped", "812.4 tok/s", ...
    vs: str = ""                     # ratio column
    skipped: bool = False            # not run: what it needs is not here (result says what)


def offline_name(backend: str, graphs: bool) -> str:
    return f"offline bf16 {backend} graphs {'on' if graphs else 'off'}"


def plan(python: str, out_dir: str, flash: bool = True) -> list[Step]:
    """The steps, in order; benches write JSON under out_dir. flash: flash-attn imports (else no flash steps)."""
    bench = [python, "-m", "consort_common.cli", "bench"]
    steps = [Step("pytest tests/gpu", [python, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"], 210)]
    first = True
    for backend, block in BACKENDS.items():
        if backend == "flash" and not flash:
            continue
        for graphs in (True, False):
            name = offline_name(backend, graphs)
            argv = bench + ["offline", "--device", "cuda", "--dtype", "bfloat16", "--quick", "--no-startup",
                            "--block-size", str(block)]
            argv += [] if graphs else ["--enforce-eager"]
            argv += [] if first else ["--engine-only"]
            path = f"{out_dir}/offline-{backend}-{'graphs' if graphs else 'eager'}.json"
            steps.append(Step(name, argv + ["--json", path], 70 if first else 40,
                              {"CONSORT_ATTENTION_BACKEND": backend}, path))
            first = False
    path = f"{out_dir}/quant.json"
    steps.append(Step("quant bf16 vs fp8", bench + ["quant", "--device", "cuda", "--quick", "--rounds", "1",
                                                     "--arms", "bfloat16:none,bfloat16:fp8", "--json", path],
                      60, {}, path))
    return steps


def summarize_pytest(output: str) -> str:
    """pytest's final counts line: '12 passed, 3 skipped in 40.1s' -> '12 passed, 3 skipped'."""
    m = re.findall(r"(\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected))", output.splitlines()[-1]
                   if output.strip() else "")
    return ", ".join(m) or "no summary"


def bench_rows(step: Step, data, hf_tok_s: float | None) -> tuple[list[Row], float | None]:
    """Rows of one bench's JSON: offline ([{dtype, engine: {tok_s}, hf: {tok_s} | null}]) or quant
    ({"dtype:quant": [tok/s per round]}); returns them and the transformers figure (the first offline one)."""
    if isinstance(data, dict):                             # bench quant
        arms = list(data.items())
        base = sorted(arms[0][1])[len(arms[0][1]) // 2]
        rows = []
        for arm, runs in arms:
            med = sorted(runs)[len(runs) // 2]
            rows.append(Row(f"quant {arm}", True, 0.0, f"{med:.1f} tok/s", f"{med / base:.2f}x vs {arms[0][0]}"))
        return rows, hf_tok_s
    r = data[0]
    hf_tok_s = r["hf"]["tok_s"] if r.get("hf") else hf_tok_s
    vs = f"{r['engine']['tok_s'] / hf_tok_s:.2f}x vs transformers" if hf_tok_s else ""
    return [Row(step.name, True, 0.0, f"{r['engine']['tok_s']:.1f} tok/s", vs)], hf_tok_s


def flash_rows(python: str) -> list[Row]:
    """Skip rows for the flash steps where flash-attn does not import in `python` (with the steps' path)."""
    try:
        probe = subprocess.run([python, "-c", "import flash_attn"], env=step_env({}), capture_output=True, text=True)
    except OSError as e:
        why = str(e)
    else:
        if probe.returncode == 0:
            return []
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return [Row(offline_name("flash", g), False, 0.0, f"flash-attn does not import ({why})", skipped=True)
            for g in (True, False)]


def table(rows: list[Row], device: str) -> str:
    lines = [f"=== make gpu-check on {device} ===", "| check | status | seconds | result | vs |", "|---|---|---|---|---|"]
    for r in rows:
        status = "skip" if r.skipped else "ok" if r.ok else "FAIL"
        lines.append(f"| {r.name} | {status} | {r.seconds:.0f} | {r.result} | {r.vs} |")
    failed = sum(not (r.ok or r.skipped) for r in rows)
    lines.append(f"total {sum(r.seconds for r in rows):.0f} s; {failed} failed, {sum(r.skipped for r in rows)} skipped")
    return "\n".join(lines)


def step_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment a step runs in: the project's packages first on the path (no install needed)."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / p) for p in ("engine-image", "router-image", "operator", "common")]
                                        + [env.get("PYTHONPATH", "")])
    return env


def run_step(step: Step, hf_tok_s: float | None) -> tuple[list[Row], float | None]:
    env = step_env(step.env)
    print(f"[gpu-check] {step.name}: {' '.join(step.argv)} (limit {step.timeout_s} s)", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        return [Row(step.name, False, time.monotonic() - t0, f"timed out after {step.timeout_s} s")], hf_tok_s
    secs = time.monotonic() - t0
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
        summary = summarize_pytest(proc.stdout) if step.json_path is None else f"exit {proc.returncode}"
        return [Row(step.name, False, secs, summary)], hf_tok_s
    if step.json_path is None:
        return [Row(step.name, True, secs, summarize_pytest(proc.stdout))], hf_tok_s
    rows, hf_tok_s = bench_rows(step, json.loads(Path(step.json_path).read_text()), hf_tok_s)
    rows[0].seconds = secs
    return rows, hf_tok_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list the steps and their limits; run nothing")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs the steps")
    args = p.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="gpu-check-")
    skipped = flash_rows(args.python)
    steps = plan(args.python, out_dir, flash=not skipped)
    if args.dry_run:
        for r in skipped:
            print(f"{r.name}: skipped, {r.result}")
        for s in steps:
            env = " ".join(f"{k}={v}" for k, v in s.env.items())
            print(f"{s.name}: {env + ' ' if env else ''}{' '.join(s.argv)}  (limit {s.timeout_s} s)")
        print(f"total limit {sum(s.timeout_s for s in steps)} s (budget {BUDGET_S} s)")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (`--dry-run` lists the steps)", file=sys.stderr)
        return 1
    rows: list[Row] = []
    hf_tok_s = None
    for step in steps:
        got, hf_tok_s = run_step(step, hf_tok_s)
        rows += got
    print(table(rows + skipped, torch.cuda.get_device_name()), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
