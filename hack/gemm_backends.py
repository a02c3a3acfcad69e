"""GFLOP/s of the packed CPU GEMMs the engine can use (models/packed.py), oneDNN vs MKL, for the
benchmark model's shapes (hidden 512, FFN 1408, vocab 32000) at decode and prefill row counts.

    .venv/bin/python hack/gemm_backends.py [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = ((512, 1024), (512, 2816), (1408, 512), (512, 32000))   # (in, out): qkv, gate_up, down, LM head


def rate(fn, x: torch.Tensor, flops: float) -> float:
    reps = max(3, int(2e9 / flops))
    for _ in range(3):
        fn(x)
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return flops * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"{torch.get_num_threads()} threads; GFLOP/s")
    print("| rows | in x out | MKL packed | oneDNN packed | oneDNN / MKL |")
    print("|---|---|---|---|---|")
    for m in a.rows:
        for k, n in SHAPES:
            w, x = torch.randn(n, k), torch.randn(m, k)
            mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
            dnn = torch.ops.mkldnn._reorder_linear_weight(w, None)
            f = 2.0 * m * k * n
            r_mkl = rate(lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, m), x, f)
            r_dnn = rate(lambda x: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], ""), x, f)
            print(f"| {m} | {k} x {n} | {r_mkl:.0f} | {r_dnn:.0f} | {r_dnn / r_mkl:.2f} |")


if __name__ == "__main__":
    main()
