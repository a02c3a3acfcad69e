"""Where one benchmark mix's time goes in the engine, per part: `perf record` over the Consort side of
hack/bench_vs_vllm.py (what `consort bench offline --engine-only` runs), counting only while the engine
generates (perf starts disabled; the run enables it around LLMEngine.generate through perf's control
fifo), the samples bucketed by the function they fell in. CPU-seconds are the samples over all threads
(2 cores: up to twice the wall time); the share is of the generate window's samples.

    PYTHONPATH=engine-image .venv/bin/python hack/profile_mix.py --mix prefill --dtype bfloat16 [--requests 64]

Needs `perf` (linux-perf) and permission to sample (root, or kernel.perf_event_paranoid <= 1). A
`--tree DIR` profiles another checkout's engine (its engine-image and hack), e.g. a `git worktree` of
the commit before a change, so before and after come from the same script.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FREQ = 999

# (part, pattern over "dso symbol"): the first that matches takes the sample
PARTS = (
    ("GEMM, oneDNN (bf16)", r"^\[JIT\]|libdnnl|dnnl_|brgemm"),
    ("GEMM, engine kernels", r"\bgemm_|i8w_|i8a8_|b16_"),
    ("GEMM, MKL / OpenBLAS", r"mkl_|sgemm|openblas"),
    ("prefill attention", r"prefill_attention|\bpb_|\bpf_"),
    ("decode attention", r"paged_attention"),
    ("K/V store", r"store_kv"),
    ("norms, RoPE, SiLU", r"rms_norm|\brope_|silu_mul"),
    ("page faults (KV pool first touch)", r"^\[kernel\.kallsyms\] .*(clear_page|page_fault|folio|handle_mm|pmd)"),
    ("OpenMP waits", r"libgomp"),
    ("other torch ops", r"libtorch|libc10"),
    ("Python", r"libpython|\.cpython-"),
    ("kernel, other", r"^\[kernel"),
)


def child(a: argparse.Namespace) -> None:
    """The benchmark's Consort side, perf enabled only inside generate."""
    tree = Path(a.tree)
    sys.path[:0] = [str(tree / "hack"), str(tree / "engine-image"), str(tree / "common")]
    import bench_vs_vllm
    from consort_engine.core import engine as core

    def command(fifo: str, ack: str, what: str) -> None:
        with open(fifo, "w") as f:
            f.write(f"{what}\n")
        with open(ack) as f:
            f.readline()

    generate = core.LLMEngine.generate

    def profiled(self, *args, **kw):
        command(a.ctl, a.ack, "enable")
        try:
            return generate(self, *args, **kw)
        finally:
            command(a.ctl, a.ack, "disable")
    core.LLMEngine.generate = profiled
    ns = argparse.Namespace(mix=a.mix, dtype=a.dtype, requests=a.requests, seed=0, temperature=0.0, top_p=1.0,
                            model=a.model)
    res = bench_vs_vllm.role_consort(ns)
    print(f"tok/s {res['tok_s']:.1f} wall {res['wall_s']:.2f} s", flush=True)


def bucket(report: str) -> dict[str, int]:
    """perf report lines ("pct  samples  dso  [.] sym") -> samples per part."""
    parts = {name: 0 for name, _ in PARTS} | {"other": 0}
    for line in report.splitlines():
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(.+?)\s+\[[.k]\]\s+(.*)", line)   # a dso may have spaces ([JIT] tid N)
        if m:
            where = f"{m.group(2)} {m.group(3)}"
            parts[next((n for n, pat in PARTS if re.search(pat, where)), "other")] += int(m.group(1))
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default="prefill", choices=("anchor", "prefill"))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose engine runs (default: this one)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench model)")
    ap.add_argument("--perf-data", type=Path, help="keep perf's samples here (for `perf report -i`: per thread, "
                                                    "per caller)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ctl", help=argparse.SUPPRESS)
    ap.add_argument("--ack", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    sys.path[:0] = [str(REPO / "engine-image"), str(REPO / "common")]
    from consort_common.machine import cpu_model_and_flags
    from consort_engine.bench.workload import bench_model
    if a.model is None:
        a.model = str(bench_model())
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack, data = f"{tmp}/ctl", f"{tmp}/ack", str(a.perf_data or f"{tmp}/perf.data")
        os.mkfifo(ctl)
        os.mkfifo(ack)
        run = subprocess.run(
            ["perf", "record", "-F", str(FREQ), "-D", "-1", f"--control=fifo:{ctl},{ack}", "-o", data, "--",
             sys.executable, __file__, "--child", "--ctl", ctl, "--ack", ack, "--mix", a.mix, "--dtype", a.dtype,
             "--requests", str(a.requests), "--tree", a.tree, "--model", a.model],
            stdout=subprocess.PIPE, text=True)   # the benchmark's progress log passes through on stderr
        if run.returncode != 0:
            return run.returncode
        result = next((ln for ln in run.stdout.splitlines() if ln.startswith("tok/s")), "?")
        report = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-g", "none", "--sort",
                                 "dso,sym", "-F", "overhead,sample,dso,sym", "--percent-limit", "0"],
                                capture_output=True, text=True).stdout
    parts = bucket(report)
    n = sum(parts.values())
    cpu_s = n / FREQ
    model, flags = cpu_model_and_flags()
    shown = " ".join(f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags)
    print(f"{model} ({shown}); {Path(a.tree).name}: {a.mix} mix, {a.dtype}, {a.requests} requests; {result}; "
          f"{n} samples at {FREQ} Hz while generating = {cpu_s:.2f} CPU-s")
    print("| part | share | CPU-s |\n|---|---|---|")
    for name, k in sorted(parts.items(), key=lambda kv: -kv[1]):
        if k:
            print(f"| {name} | {100 * k / n:.1f}% | {k / FREQ:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
