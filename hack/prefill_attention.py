"""GFLOP/s of the prefill attention the engine runs on CPU (model/attention.py): the C prefill kernel
(csrc prefill_attention_f32, AVX-512 and AVX2 + FMA builds) against torch's SDPA, the path it replaces
(causal over a fresh chunk's own K/V, or over the gathered context after a prefix-cache hit), on the
benchmark model's heads (8 query heads, 4 kv heads, head size 64; --head-dim 128 takes 16 and 2),
float32 queries over a float32 pool (--kv-dtype bfloat16: a bf16 model computing in fp32;
float8_e4m3fn: an fp8 pool) and scattered pool blocks. `--q-dtype bfloat16` (a bf16 model computing in
bf16, over a bf16 or fp8 pool) adds the kernel with the queries widened to fp32 (what the engine runs where
the library has no AVX-512 BF16 pair dot product) beside the bf16 kernel. All sides run the same spans
through PagedAttention, best of 5 in rotation, so a burst of neighbour load hits them alike. FLOPs:
4 x heads x head size per visible (query, key) pair.

`--tree DIR` adds another checkout's kernels (a `git worktree` of the commit before a change), built with
this machine's -march=native and the engine's flags, run in rotation with this one's on the same pools.

    PYTHONPATH=engine-image .venv/bin/python hack/prefill_attention.py [--head-dim 128]
        [--kv-dtype bfloat16|float8_e4m3fn] [--q-dtype bfloat16] [--tree DIR]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from consort_common.machine import cpu_model_and_flags
from consort_engine.model import attention
from consort_engine.model import cpu_kernels as cpu_kernels_mod
from consort_engine.model.attention import AttentionMetadata, PagedAttention, PrefillSpan

# (name, [(cached, new) per sequence]): the chunk lengths a 2,048-token step budget cuts prompts into
CASES = (("16 x 64", [(0, 64)] * 16), ("1 x 128", [(0, 128)]), ("4 x 300", [(0, 300)] * 4),
         ("1 x 512", [(0, 512)]), ("4 x 512", [(0, 512)] * 4), ("8 x 256", [(0, 256)] * 8),
         ("1 x 2048", [(0, 2048)]), ("256 cached + 256", [(256, 256)]), ("1024 cached + 1024", [(1024, 1024)]))
CSRC = "engine-image/consort_engine/model/csrc"
BLOCK = 16


def setup(spans: list[tuple[int, int]], h: int, kvh: int, d: int, kv_dtype: torch.dtype, q_dtype: torch.dtype,
          g: torch.Generator):
    """A layer over a pool of scattered blocks holding every span's context, and the step's metadata."""
    ctx_lens, qlens = [c + n for c, n in spans], [n for _, n in spans]
    max_blocks = max((c + BLOCK - 1) // BLOCK for c in ctx_lens)
    num_blocks = len(spans) * max_blocks
    attn = PagedAttention(h, kvh, d, d ** -0.5, "cpu_kernel")
    attn.k_cache = torch.randn(num_blocks, kvh, BLOCK, d, generator=g).to(kv_dtype)
    attn.v_cache = torch.randn(num_blocks, kvh, BLOCK, d, generator=g).to(kv_dtype)
    tables = torch.randperm(num_blocks, generator=g).view(len(spans), max_blocks).to(torch.int32)
    starts = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    prefills = [PrefillSpan(starts[i], starts[i + 1], c, c + n,
                            tables[i, :(c + n + BLOCK - 1) // BLOCK].long() if c else None)
                for i, (c, n) in enumerate(spans)]
    t = starts[-1]
    # slots -1: the K/V are in the pool already (as after the step's store); both sides attend over it
    meta = AttentionMetadata(slot_mapping=torch.full((t,), -1, dtype=torch.int64), prefills=prefills,
                             prefill_block_tables=tables,
                             prefill_context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                             prefill_cu_query_lens=torch.tensor(starts, dtype=torch.int32))
    qkv = [torch.randn(t, n, d, generator=g).to(q_dtype) for n in (h, kvh, kvh)]
    flops = sum(4 * h * d * n * (c + (n + 1) / 2) for c, n in spans)
    return attn, qkv, meta, flops


def sdpa_only(attn: PagedAttention) -> PagedAttention:
    """The same layer over the same pool, its kernel declining, as on a build without it."""
    sdpa = PagedAttention(attn.h, attn.kvh, attn.d, attn.scale, attn.backend)
    sdpa.k_cache, sdpa.v_cache = attn.k_cache, attn.v_cache
    sdpa._prefill_kernel = lambda *a: False
    return sdpa


class Widened(PagedAttention):
    """The same layer over the same pool, bf16 queries widened for the fp32 kernel (as without the
    library's bf16 kernel)."""

    def __init__(self, attn: PagedAttention):
        super().__init__(attn.h, attn.kvh, attn.d, attn.scale, attn.backend)
        self.k_cache, self.v_cache = attn.k_cache, attn.v_cache

    def _prefill_kernel(self, q, out, meta) -> bool:
        lookup = attention.kernel

        def no_bf16(name, dtype, kv_dtype=None):
            if dtype == torch.bfloat16:
                raise AttributeError(name)
            return lookup(name, dtype, kv_dtype)
        attention.kernel = no_bf16
        try:
            return super()._prefill_kernel(q, out, meta)
        finally:
            attention.kernel = lookup


class OtherTree(PagedAttention):
    """The same layer over the same pool, run by another checkout's kernel library."""

    def __init__(self, attn: PagedAttention, lib):
        super().__init__(attn.h, attn.kvh, attn.d, attn.scale, attn.backend)
        self.k_cache, self.v_cache, self.lib = attn.k_cache, attn.v_cache, lib

    def forward(self, *args):
        ours, cpu_kernels_mod._lib = cpu_kernels_mod._lib, self.lib
        try:
            return super().forward(*args)
        finally:
            cpu_kernels_mod._lib = ours


def build_tree(tree: Path, out: Path):
    """The prefill kernels of `tree` (and the K/V store its layer calls) as a library of their own."""
    src = tree / CSRC
    print(f"[prefill-attention] compiling {src}'s prefill kernels (native)", flush=True)
    names = ("prefill_attention.c", "prefill_attention_bf16.c", "paged_attention.c", "team.c")
    cpu_kernels_mod.compile_sources(out, "native", sources=[src / n for n in names])
    return cpu_kernels_mod.load_library(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (0: torch's default)")
    ap.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16", "float8_e4m3fn"))
    ap.add_argument("--q-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--tree", type=Path, default=None, help="another checkout's kernels, timed beside this one's")
    a = ap.parse_args()
    if a.q_dtype == "bfloat16" and a.kv_dtype == "float32":
        ap.error("--q-dtype bfloat16 runs over a bfloat16 or fp8 pool (--kv-dtype bfloat16 or float8_e4m3fn)")
    from consort_engine.model.cpu_kernels import cpu_kernels, kernel_suffix, set_threads
    if a.threads:
        set_threads(a.threads)
    if cpu_kernels() is None or not hasattr(cpu_kernels(), "prefill_attention_f32"):
        raise SystemExit("the prefill kernel is not built on this CPU (it needs AVX-512 or AVX2 + FMA)")
    h, kvh = (8, 4) if a.head_dim == 64 else (16, 2)
    kv_dtype, q_dtype = getattr(torch, a.kv_dtype), getattr(torch, a.q_dtype)
    widened = q_dtype == torch.bfloat16
    if widened and attention.AMX:
        # The engine leaves bf16 prefill spans to SDPA (AMX tiles) on this CPU; these figures decide
        # whether it should: the kernels run here regardless.
        print("AMX: the engine runs bf16 prefill spans on SDPA here; the kernel columns are what it would run instead")
        attention.AMX = False
    model, flags = cpu_model_and_flags()
    print(f"{model}; {' '.join(f for f in ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'amx_tile') if f in flags)}; "
          f"{torch.get_num_threads()} threads; heads {h}/{kvh} x {a.head_dim}, {a.q_dtype} queries, {a.kv_dtype} pool; "
          f"GFLOP/s, best of 5")
    kernel_name = "kernel"
    if widened:
        built = hasattr(cpu_kernels(), f"prefill_attention_{kernel_suffix(q_dtype, kv_dtype)}")
        kernel_name = f"kernel ({'bf16 pair dot' if built else 'widened too: no AVX-512 BF16 build'})"
    with tempfile.TemporaryDirectory() as tmp:
        other = build_tree(a.tree.resolve(), Path(tmp) / "other.so") if a.tree else None
        columns = ([f"{a.tree.name}'s kernel"] if other else []) + [kernel_name] \
            + (["kernel, widened"] if widened else []) + ["SDPA"] \
            + (["kernel / other tree's"] if other else []) + (["kernel / widened"] if widened else []) \
            + ["kernel / SDPA"]
        print(f"| spans | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
        g = torch.Generator().manual_seed(0)
        for name, spans in CASES:
            attn, (q, k, v), meta, flops = setup(spans, h, kvh, a.head_dim, kv_dtype, q_dtype, g)
            if not attn._prefill_kernel(q, torch.empty(q.shape[0], h * a.head_dim, dtype=q_dtype), meta):
                raise SystemExit(f"the layer runs SDPA, not the kernel, for {a.q_dtype} queries over a {a.kv_dtype} "
                                 "pool: nothing to compare")
            sides = ({"other": OtherTree(attn, other)} if other else {}) | {"kernel": attn} \
                | ({"widened": Widened(attn)} if widened else {}) | {"sdpa": sdpa_only(attn)}
            best = dict.fromkeys(sides, 0.0)
            for layer in sides.values():     # untimed: first-touch of the outputs, each library's first call
                layer(q, k, v, meta)
            for _ in range(5):
                for side, layer in sides.items():
                    t0 = time.perf_counter()
                    layer(q, k, v, meta)
                    best[side] = max(best[side], flops / (time.perf_counter() - t0) / 1e9)
            rates = [f"{r:.1f}" for r in best.values()]
            ratios = [f"{best['kernel'] / best[side]:.2f}x" for side in ("other", "widened", "sdpa") if side in best]
            print(f"| {name} | {' | '.join(rates + ratios)} |", flush=True)


if __name__ == "__main__":
    main()
