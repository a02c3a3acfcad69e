"""GB/s of the element-wise kernels (csrc/elementwise.c: residual add + RMSNorm, RoPE, SiLU-and-multiply)
on the benchmark model's shapes (hidden 512, 8 query and 4 kv heads of 64, intermediate 1,408), float32
and bfloat16, at 64 rows (a decode step: in cache) and 2,048 rows (a prefill chunk: from the L3 or
DRAM). GB/s counts the bytes each call reads and writes once.

`--tree DIR` builds another checkout's kernels beside this one's (a `git worktree` of the commit before
a change), both with this machine's -march=native (or `--level`'s) and the engine's flags, and runs them
in rotation on the same tensors, best of --repeats each, so a burst of neighbour load hits both alike.

    PYTHONPATH=engine-image:common .venv/bin/python hack/elementwise.py [--tree DIR] [--level x86-64-v3]
"""
from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch

from consort_common.machine import cpu_model_and_flags
from consort_engine.model.cpu_kernels import LEVELS, SIGNATURES, compile_sources

REPO = Path(__file__).resolve().parents[1]
CSRC = Path("engine-image/consort_engine/model/csrc")
HIDDEN, HEADS, KV_HEADS, HEAD, FFN = 512, 8, 4, 64, 1408
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def build(tree: Path, out: Path, level: str) -> ctypes.CDLL:
    """elementwise.c of `tree` as its own library (`level`'s -march, the engine's flags)."""
    src = tree / CSRC
    print(f"[elementwise] compiling {src / 'elementwise.c'} for {level}", flush=True)
    compile_sources(out, level, sources=[src / "elementwise.c", src / "team.c"])
    lib = ctypes.CDLL(str(out))
    for name in ("add_rms_norm", "rope", "silu_mul"):
        for suffix in SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = SIGNATURES[name]
    lib.set_num_threads(torch.get_num_threads())
    return lib


def calls(lib: ctypes.CDLL, dtype: torch.dtype, rows: int) -> dict[str, tuple[object, int]]:
    """Each kernel as a no-argument call on fresh tensors of `rows`, with the bytes it moves."""
    g = torch.Generator().manual_seed(rows)
    es, sfx = torch.tensor([], dtype=dtype).element_size(), SUFFIX[dtype]
    x, resid = (torch.randn(rows, HIDDEN, generator=g).to(dtype) for _ in range(2))
    w, out = torch.ones(HIDDEN, dtype=dtype), torch.empty(rows, HIDDEN, dtype=dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD, generator=g).to(dtype)
    pos = torch.randint(0, 2048, (rows,), generator=g)
    cos, sin = (torch.rand(2048, HEAD // 2, generator=g).to(dtype) for _ in range(2))
    gu, act = torch.randn(rows, 2 * FFN, generator=g).to(dtype), torch.empty(rows, FFN, dtype=dtype)
    add_rms, rope, silu = (getattr(lib, f"{n}_{sfx}") for n in ("add_rms_norm", "rope", "silu_mul"))
    return {
        "add + RMSNorm": (lambda: add_rms(resid.data_ptr(), x.data_ptr(), out.data_ptr(), w.data_ptr(), rows,
                                          HIDDEN, 1e-6), 4 * rows * HIDDEN * es),
        "RoPE (q and k)": (lambda: rope(qkv.data_ptr(), qkv.stride(0), rows, HEADS + KV_HEADS, HEAD, HEAD,
                                        pos.data_ptr(), cos.data_ptr(), sin.data_ptr()),
                           2 * rows * (HEADS + KV_HEADS) * HEAD * es),
        "SiLU x up": (lambda: silu(gu.data_ptr(), act.data_ptr(), rows, FFN), 3 * rows * FFN * es),
    }


def best_seconds(fn, repeats: int) -> float:
    n = 20
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, help="another checkout to compare with (its kernels built alike)")
    ap.add_argument("--level", default="native", choices=["native", *LEVELS])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    trees = {"this tree": REPO} | ({f"{a.tree.name}": a.tree} if a.tree else {})
    model, flags = cpu_model_and_flags()
    shown = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(tree, Path(tmp) / f"ew{i}.so", a.level) for i, (name, tree) in enumerate(trees.items())}
        print(f"{model} ({shown}), {torch.get_num_threads()} threads, {a.level}; GB/s, best of {a.repeats}")
        cols = list(libs) + (["ratio"] if len(libs) == 2 else [])
        print(f"| kernel | dtype | rows | {' | '.join(cols)} |\n|---|---|---|{'---|' * len(cols)}")
        for dtype in SUFFIX:
            for rows in (64, 2048):
                per = {name: calls(lib, dtype, rows) for name, lib in libs.items()}
                for kernel in per["this tree"]:
                    secs = {name: float("inf") for name in libs}
                    for _ in range(a.repeats):                  # the trees in rotation
                        for name in libs:
                            secs[name] = min(secs[name], best_seconds(per[name][kernel][0], 1))
                    gbs = {name: per[name][kernel][1] / secs[name] / 1e9 for name in libs}
                    row = [f"{gbs[name]:.1f}" for name in libs]
                    if len(libs) == 2:
                        other = next(n for n in libs if n != "this tree")
                        row.append(f"{gbs['this tree'] / gbs[other]:.2f}x")
                    print(f"| {kernel} | {SUFFIX[dtype]} | {rows} | {' | '.join(row)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
