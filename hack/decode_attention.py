"""GB/s of the decode attention kernel (csrc/paged_attention.c, the batched group: decode rows and verify
windows) on the benchmark model's heads (8 query heads, 4 kv heads, head size 64; --head-dim 128), per
activation / pool dtype: float32 over float32, float32 over a bfloat16 pool (a bf16 model computing in
fp32), bfloat16 over bfloat16, and float32 or bfloat16 over a float8 e4m3fn pool (half a bf16 pool's
bytes; --dtypes picks some). Cases: 64 sequences with contexts U[100, 600] over 8 layers of pools
(more than the L3: from DRAM) with the blocks scattered or in order, the same with 4-token verify
windows, 16 sequences over one layer (in cache), and 1 or 4 sequences of ~2,000 tokens over 8 layers
(one user's long chat: fewer sequences than threads x items). The pools ask for huge pages as the
engine's does. GB/s counts the K/V bytes each call reads once. Each case's dtypes run in rotation on the
same contexts and block tables, so their times compare: the table also gives this tree's microseconds per
layer call and an fp8 pool's speed over the bf16 pool's under the same queries.

`--tree DIR` builds another checkout's kernel beside this one's (a `git worktree` of the commit before a
change), both with this machine's -march=native and the engine's flags, and runs them in rotation on
the same pools, best of --repeats each, so a burst of neighbour load hits both alike. `--level` builds
for one of the engine image's x86-64 levels instead (x86-64-v3: the AVX2 + FMA library, on any CPU that
runs it).

    PYTHONPATH=engine-image:common .venv/bin/python hack/decode_attention.py [--tree DIR] [--head-dim 128]
        [--level x86-64-v3] [--dtypes bf16 bf16_fp8kv]
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
from consort_engine.model.model_runner import tune_cpu_memory

REPO = Path(__file__).resolve().parents[1]
CSRC = Path("engine-image/consort_engine/model/csrc")
H, KVH, BLOCK = 8, 4, 16
# (name, sequences, query rows each, layers, blocks in order, contexts drawn from [lo, hi))
CASES = (("64 x decode, scattered, 8 layers", 64, 1, 8, False, (100, 600)),
         ("64 x decode, in order, 8 layers", 64, 1, 8, True, (100, 600)),
         ("64 x verify 4, scattered, 8 layers", 64, 4, 8, False, (100, 600)),
         ("16 x decode, 1 layer (in cache)", 16, 1, 1, False, (100, 600)),
         ("1 x decode, ~2k context, 8 layers", 1, 1, 8, False, (1900, 2100)),
         ("4 x decode, ~2k context, 8 layers", 4, 1, 8, False, (1900, 2100)))
DTYPES = {"f32": (torch.float32, torch.float32), "f32_bf16kv": (torch.float32, torch.bfloat16),
          "bf16": (torch.bfloat16, torch.bfloat16), "f32_fp8kv": (torch.float32, torch.float8_e4m3fn),
          "bf16_fp8kv": (torch.bfloat16, torch.float8_e4m3fn)}
BF16_POOL = {"f32_fp8kv": "f32_bf16kv", "bf16_fp8kv": "bf16"}   # the bf16-pool row an fp8 row compares with


def build(tree: Path, out: Path, level: str) -> ctypes.CDLL:
    """paged_attention.c of `tree` as its own library (`level`'s -march, the engine's flags)."""
    src = tree / CSRC
    print(f"[decode-attention] compiling {src / 'paged_attention.c'} for {level}", flush=True)
    compile_sources(out, level, sources=[src / "paged_attention.c", src / "team.c"])
    lib = ctypes.CDLL(str(out))
    for suffix in DTYPES:
        fn = getattr(lib, f"paged_attention_{suffix}", None)    # an older tree's may lack some
        if fn is not None:
            fn.argtypes, fn.restype = SIGNATURES["paged_attention"]
    lib.set_num_threads(torch.get_num_threads())
    return lib


def pool(blocks: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    t = torch.empty(blocks, KVH, BLOCK, d, dtype=dtype)
    tune_cpu_memory(t)                       # huge pages, as the engine's pool
    return t.copy_(torch.randn(blocks, KVH, BLOCK, d, generator=g))


def measure(libs: dict[str, ctypes.CDLL], case: tuple, suffixes: list[str], d: int,
            repeats: int) -> tuple[dict[tuple[str, str], float], int]:
    """Seconds per layer call of each (dtype suffix, library), best of `repeats` in rotation (a library
    without the suffix's kernel is left out), and the keys of K/V one call reads (context x kv heads)."""
    _, b, qlen, layers, in_order, (lo, hi) = case
    g = torch.Generator().manual_seed(b + qlen)
    ctx = torch.randint(lo, hi, (b,), generator=g, dtype=torch.int32) + qlen
    max_blocks = int((ctx.max() + BLOCK - 1) // BLOCK)
    n = b * max_blocks
    order = torch.arange(n) if in_order else torch.randperm(n, generator=g)
    tables = order.view(b, max_blocks).to(torch.int32)
    cu = torch.arange(0, (b + 1) * qlen, qlen, dtype=torch.int32)
    pools, qs = {}, {}               # per pool dtype (layers of K, V) and per query dtype
    for suffix in suffixes:
        q_dtype, kv_dtype = DTYPES[suffix]
        if kv_dtype not in pools:
            pools[kv_dtype] = [(pool(n, d, kv_dtype, g), pool(n, d, kv_dtype, g)) for _ in range(layers)]
        if q_dtype not in qs:
            qs[q_dtype] = (torch.randn(b * qlen, H, d, generator=g).to(q_dtype),
                           torch.empty(b * qlen, H * d, dtype=q_dtype))
    runs = [(suffix, name, fn) for suffix in suffixes for name, lib in libs.items()
            if (fn := getattr(lib, f"paged_attention_{suffix}", None)) is not None]
    best = {(suffix, name): float("inf") for suffix, name, _ in runs}
    for _ in range(repeats):
        for suffix, name, fn in runs:
            q_dtype, kv_dtype = DTYPES[suffix]
            q, out = qs[q_dtype]
            t = time.perf_counter()
            for kc, vc in pools[kv_dtype]:
                rc = fn(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), out.stride(0),
                        tables.data_ptr(), max_blocks, ctx.data_ptr(), cu.data_ptr(), b, H, KVH, d, BLOCK,
                        kc.stride(0), kc.stride(2), kc.stride(1), d ** -0.5)
                if rc:
                    raise RuntimeError(f"paged_attention_{suffix} failed ({rc})")
            best[suffix, name] = min(best[suffix, name], (time.perf_counter() - t) / layers)
    return best, int(ctx.sum()) * KVH


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, default=None, help="another checkout's kernel, timed beside this one's")
    p.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--level", default="native", choices=["native", *LEVELS], help="the build's x86-64 level")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                   help="query / pool dtype suffixes to run (default: all)")
    a = p.parse_args()
    model, flags = cpu_model_and_flags()
    shown = " ".join(f for f in ("avx512f", "avx512_bf16", "amx_tile", "avx2") if f in flags)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this tree": build(REPO, Path(tmp) / "this.so", a.level)}
        if a.tree:
            libs = {a.tree.name: build(a.tree.resolve(), Path(tmp) / "other.so", a.level), **libs}
        print(f"{model} ({shown}), {a.level} build, {torch.get_num_threads()} threads, head size {a.head_dim}, "
              "GB/s of K/V; this tree's microseconds per layer call; an fp8 pool's speed over the bf16 pool's")
        print("| case | q / pool | " + " | ".join(libs) + " | us / call | vs bf16 pool |"
              + (" this / other |" if a.tree else ""))
        print("|---|---|" + "---|" * (len(libs) + 2 + bool(a.tree)))
        for case in CASES:
            best, keys = measure(libs, case, a.dtypes, a.head_dim, a.repeats)
            for suffix in a.dtypes:
                nbytes = keys * a.head_dim * 2 * DTYPES[suffix][1].itemsize
                rates = [f"{nbytes / best[suffix, name] / 1e9:.1f}" if (suffix, name) in best else "-"
                         for name in libs]
                t = best[suffix, "this tree"]
                vs = BF16_POOL.get(suffix)
                vs = f"{best[vs, 'this tree'] / t:.2f}x" if vs in a.dtypes else ""
                other = best.get((suffix, a.tree.name)) if a.tree else None
                ratio = (f" {other / t:.2f}x |" if other else " - |") if a.tree else ""
                print(f"| {case[0]} | {suffix} | " + " | ".join(rates) + f" | {t * 1e6:.0f} | {vs} |" + ratio,
                      flush=True)


if __name__ == "__main__":
    main()
