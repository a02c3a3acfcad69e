"""GFLOP/s of the packed CPU GEMMs the engine can use (models/packed.py): its own kernel (csrc gemm_f32,
AVX2 + FMA builds), oneDNN and MKL, for the benchmark model's shapes (hidden 512, FFN 1408, vocab 32000)
at decode and prefill row counts. Each backend is timed best-of-5 in rotation, so a burst of
neighbour load hits all of them alike.

    PYTHONPATH=engine-image .venv/bin/python hack/gemm_backends.py [--threads N] [--rows 1 8 32 2048]
"""
from __future__ import annotations

import argparse
import time

import torch

from consort_engine.model.models import packed

SHAPES = ((512, 1024), (512, 2816), (1408, 512), (512, 32000))   # (in, out): qkv, gate_up, down, LM head


def rates(fns: dict, x: torch.Tensor, flops: float, rounds: int = 5) -> dict[str, float]:
    reps = max(3, int(3e8 / flops))
    best = dict.fromkeys(fns, 0.0)
    for fn in fns.values():
        fn(x)
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn(x)
            best[name] = max(best[name], flops * reps / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    names = list(packed.FP32_BACKENDS)
    print(f"{torch.get_num_threads()} threads; GFLOP/s, best of 5; default backend here: {packed.fp32_backend()}")
    print("| rows | in x out | " + " | ".join(names) + " | consort / oneDNN |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for m in a.rows:
        for k, n in SHAPES:
            w, x = torch.randn(n, k), torch.randn(m, k)
            fns = {name: f for name, pack in packed.FP32_BACKENDS.items() if (f := pack(w, None)) is not None}
            r = rates(fns, x, 2.0 * m * k * n)
            cells = " | ".join(f"{r[name]:.0f}" if name in r else "-" for name in names)
            ratio = f"{r['consort'] / r['onednn']:.2f}" if "consort" in r and "onednn" in r else "-"
            print(f"| {m} | {k} x {n} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
