"""GFLOP/s of the packed CPU GEMMs the engine can use (models/packed.py): its own kernel (csrc gemm_f32,
AVX2 + FMA builds), oneDNN and MKL, for the benchmark model's shapes (hidden 512, FFN 1408, vocab 32000)
at decode and prefill row counts. Each backend is timed best-of-5 in rotation, so a burst of
neighbour load hits all of them alike. With --quantized: the int8 products instead (models/quant.py),
against the default fp32 one: the engine's int8 kernel (gemm_i8w_f32: int8 weights, each row of x
rounded to int16), an int4 checkpoint's codes on it with one scale per group of 128 k (AWQ's and
GPTQ's default), torch's `_weight_int8pack_mm` on bf16 activations, and w8a8 on the engine's int8 x
int8 kernel (gemm_i8a8_f32: rows rounded to int8, VNNI builds) and on FBGEMM's dynamic int8 linear.
With --bf16: a bf16 weight as the engine can multiply it, widened once to fp32 (the fp32 kernel) or
through oneDNN's packed bf16 GEMM (what it uses where the CPU has AMX or AVX-512 BF16), against fp32.

    PYTHONPATH=engine-image .venv/bin/python hack/gemm_backends.py [--threads N] [--rows 1 8 32 2048] [--quantized | --bf16]
"""
from __future__ import annotations

import argparse
import time

import torch

from consort_engine.model.models import packed, quant

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


def torch_int8(q: torch.Tensor, scale: torch.Tensor):
    scale = scale.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scale).float()


def int4_group128(w: torch.Tensor):
    """w rounded to int4 codes in [-8, 7], a scale per row and group of 128 k, on the engine's int8 kernel."""
    if w.shape[1] % 128:
        return None
    groups = w.view(w.shape[0], -1, 128)
    scales = (groups.abs().amax(2) / 7).clamp(min=quant.MIN_SCALE)
    codes = (groups / scales[..., None]).round().clamp(-8, 7).to(torch.int8).view_as(w)
    return packed.consort_int8(codes, scales, None, 128)


def quantized(w: torch.Tensor) -> dict:
    q, scale = quant.quantize_int8(w)
    return {"fp32": packed.pack_linear(w, None), "int8 (engine)": packed.consort_int8(q, scale, None),
            "int4 g128 (engine)": int4_group128(w), "int8 (torch)": torch_int8(q, scale),
            "w8a8 (engine)": packed.consort_w8a8(q, scale, None), "w8a8 (FBGEMM)": quant.fbgemm_w8a8(q, scale, None)}


def bf16_input(f):
    """f on x rounded to bf16 once per input (the engine's activations are bf16 already)."""
    last: dict = {}

    def run(x: torch.Tensor) -> torch.Tensor:
        if last.get("x") is not x:
            last["x"], last["xb"] = x, x.bfloat16()
        return f(last["xb"])
    return run


def bf16(w: torch.Tensor) -> dict:
    wb = w.bfloat16()
    ours = packed.consort_bf16(wb, None)
    return {"fp32": packed.pack_linear(w, None), "bf16 widened": bf16_input(packed._fp32_compute(wb, None)),
            "bf16 (oneDNN)": bf16_input(packed._onednn(wb, None)), "bf16 (engine)": ours and bf16_input(ours)}


def backends(w: torch.Tensor) -> dict:
    return {name: f for name, pack in packed.FP32_BACKENDS.items() if (f := pack(w, None)) is not None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 2048])
    p.add_argument("--quantized", action="store_true", help="the int8 products against fp32")
    p.add_argument("--bf16", action="store_true", help="the bf16 products against fp32")
    p.add_argument("--shapes", nargs="+", metavar="IN:OUT", help="weights of these shapes instead of the bench "
                   "model's (e.g. 4096:6144 4096:28672 14336:4096, an 8B model's qkv, gate_up and down)")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes] if a.shapes else SHAPES
    if a.threads:
        torch.set_num_threads(a.threads)
    make, (first, second) = ((quantized, ("fp32", "int8 (engine)")) if a.quantized else
                             (bf16, ("fp32", "bf16 (oneDNN)")) if a.bf16 else (backends, ("consort", "onednn")))
    names = list(make(torch.randn(16, 16)))
    print(f"{torch.get_num_threads()} threads; GFLOP/s, best of 5; default fp32 backend here: {packed.fp32_backend()}")
    print("| rows | in x out | " + " | ".join(names) + f" | {second} / {first} |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for m in a.rows:
        for k, n in shapes:
            w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
            r = rates({name: f for name, f in make(w).items() if f is not None}, x, 2.0 * m * k * n)
            cells = " | ".join(f"{r[name]:.0f}" if name in r else "-" for name in names)
            ratio = f"{r[second] / r[first]:.2f}" if first in r and second in r else "-"
            print(f"| {m} | {k} x {n} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
