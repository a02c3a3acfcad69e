"""LoRA's update on CPU: csrc/lora.c (ops.add_lora_, one call a pair) against the two fp32 matmuls and the add
it replaced (`(x A^T) Bt` rounded to the row type, added), in rotation on the same tensors, best of --repeats
each, microseconds a call and the kernel's GFLOP/s. Shapes: a decode step of the bench model (hidden 512,
gate/up 2 x 1,408) at 1, 8 and 64 rows, a 4,096-wide model's projection at 1 and 64 rows, and prefill chunks
of 512 rows; ranks 8-64.

    PYTHONPATH=engine-image:common .venv/bin/python hack/lora_update.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import time

import torch

from consort_common.machine import cpu_model_and_flags
from consort_engine.model.models import ops

# (rows, k, rank, n)
SHAPES = ((1, 512, 8, 1536), (8, 512, 8, 1536), (64, 512, 8, 2816), (64, 1408, 8, 512), (1, 4096, 16, 4096),
          (64, 4096, 16, 4096), (512, 1024, 16, 1024), (512, 4096, 64, 4096))


def torch_ops(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """What Linear._add_lora ran before the kernel (B kept [n, r] then), for one segment and one pair."""
    xs = x[0:x.shape[0]].float()
    y[0:x.shape[0], 0:b.shape[0]] += ((xs @ a.t()) @ b.t()).to(y.dtype)


def _timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds of each side, in rotation")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, flags = cpu_model_and_flags()
    shown = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags)
    print(f"{model} ({shown}), {a.threads} threads; best of {a.repeats}, the two in rotation")
    print("| dtype | rows | k | rank | n | torch ops, us | kernel, us | kernel GFLOP/s | speed-up |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows, k, r, n in SHAPES:
            g = torch.Generator().manual_seed(rows + k + r + n)
            x, y = torch.randn(rows, k, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
            pair = (0, n, torch.randn(r, k, generator=g) / k ** 0.5, torch.randn(r, n, generator=g) / r ** 0.5)
            b = pair[3].t().contiguous()
            calls = max(1, int(4e6 / (rows * r * (k + n))))
            kernel, matmuls = [], []
            print(f"[lora_update] {str(dtype)[6:]} {rows} x {k} rank {r} -> {n}", flush=True)
            for _ in range(a.repeats):
                matmuls.append(_timed(lambda: torch_ops(y, x, pair[2], b), calls))
                kernel.append(_timed(lambda: ops.add_lora_(y, x, 0, rows, [pair]), calls))
            flop = 2 * rows * r * (k + n)
            print(f"| {str(dtype)[6:]} | {rows} | {k} | {r} | {n} | {min(matmuls):.1f} | {min(kernel):.1f} | "
                  f"{flop / min(kernel) / 1e3:.1f} | {min(matmuls) / min(kernel):.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
