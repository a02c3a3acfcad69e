"""`consort bench quant`: quantized weights (and KV caches) against the unquantized engine, side by side in one run.

Each arm is a `DTYPE:QUANTIZATION[:KV_CACHE_DTYPE]` triple (`consort engine --dtype --quantization
--kv-cache-dtype`, the last auto unless given); every arm runs the
same `consort bench offline` workload (anchor by default; `--prompt-len` / `--output-len` reshape it, e.g.
long contexts for the KV cache's arms) through `bench_offline.run_engine`, round
after round, the arms' order rotating each round so load from other work on a shared machine does
not land on one arm. Prints every round's tok/s, each arm's median and its ratio to the first arm's
median, with the CPU model and its vector flags (or the GPU's name).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from pathlib import Path

from consort_common.machine import machine
from consort_engine.bench import BenchError
from consort_engine.bench.workload import BENCH_SPEC, bench_model, log, make_workload
from consort_engine.config import KV_CACHE_DTYPES, byte_size


def pool_blocks(model_dir: Path, dtype: str, kv: str, block_size: int, memory: int) -> int:
    """Blocks of an arm's pool that fit in `memory` bytes (--kv-memory): the same bytes for every arm,
    so a narrower element holds more tokens."""
    import torch

    from consort_engine.model.attention import kv_cache_dtype
    from consort_engine.model.loader import load_model_config
    from consort_engine.model.pool_memory import kv_bytes_per_token

    element = kv_cache_dtype(kv, getattr(torch, dtype), torch.device("cpu"))
    return max(1, memory // (kv_bytes_per_token(load_model_config(model_dir), element.itemsize) * block_size))

DEFAULT_ARMS = {"cpu": "float32:none,float32:int8,float32:w8a8,bfloat16:none",
                "cuda": "bfloat16:none,bfloat16:fp8"}
QUANTIZATIONS = ("none", "int8", "w8a8", "fp8", "awq", "gptq", "compressed-tensors")
# arms that load --quantized-model, a pre-quantized checkpoint
PREQUANTIZED = ("awq", "gptq", "compressed-tensors", "modelopt")
DTYPES = ("float32", "bfloat16")


def parse_arms(text: str) -> list[tuple[str, str, str]]:
    """`float32:none,float32:w8a8,bfloat16:none:fp8` -> [(dtype, quantization, kv cache dtype), ...], checked."""
    arms = []
    for item in text.split(","):
        parts = item.strip().split(":")
        arm = (*parts, "auto") if len(parts) == 2 else tuple(parts)
        if len(arm) != 3 or arm[0] not in DTYPES or arm[1] not in QUANTIZATIONS or arm[2] not in KV_CACHE_DTYPES:
            raise BenchError(f"--arms: {item!r} is not DTYPE:QUANTIZATION[:KV_CACHE_DTYPE] (dtype in {DTYPES}, "
                             f"quantization in {QUANTIZATIONS}, kv cache dtype in {KV_CACHE_DTYPES})")
        arms.append(arm)
    if len(set(arms)) != len(arms):
        raise BenchError(f"--arms: {text!r} repeats an arm")
    return arms


def round_order(arms: list, r: int) -> list:
    """Round r runs the arms rotated by r: each arm takes each position once every len(arms) rounds."""
    k = r % len(arms)
    return arms[k:] + arms[:k]


def table(arms: list[tuple[str, str, str]], runs: dict[tuple[str, str, str], list[float]], unit: str) -> list[str]:
    """Markdown rows: arm, each round's figure, median, ratio of medians to the first arm."""
    rounds = max(len(v) for v in runs.values())
    base = statistics.median(runs[arms[0]])
    lines = ["| dtype | quantization | kv cache | " + " | ".join(f"round {i} {unit}" for i in range(rounds))
             + f" | median {unit} | vs first arm |",
             "|---|---|---|" + "---|" * rounds + "---|---|"]
    for arm in arms:
        med = statistics.median(runs[arm])
        lines.append(f"| {arm[0]} | {arm[1]} | {arm[2]} | " + " | ".join(f"{v:.1f}" for v in runs[arm])
                     + f" | {med:.1f} | {med / base:.2f}x |")
    return lines


def run(args: argparse.Namespace) -> int:
    from consort_engine.bench import offline as bench_offline
    from consort_engine.model.cpu import apply_threads

    arms = parse_arms(args.arms or DEFAULT_ARMS[args.device])
    args.threads = apply_threads(args.threads or None)
    n = args.requests if args.requests else (16 if args.quick else 64)
    model_dir = Path(args.model) if args.model else bench_model(False)
    if any(q in PREQUANTIZED for _, q, _ in arms) and not args.quantized_model:
        raise BenchError("--arms: an awq, gptq or compressed-tensors arm needs --quantized-model "
                         "(that checkpoint of --model)")
    wl = make_workload(n, seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len,
                       vocab=BENCH_SPEC["vocab_size"])
    log(f"workload: {n} requests, {wl.prompt_tokens} prompt tokens, {wl.useful_tokens} output tokens; "
        f"arms {arms}, {args.rounds} round(s)")
    runs: dict[tuple[str, str, str], list[float]] = {arm: [] for arm in arms}
    per_cpu_s: dict[tuple[str, str, str], list[float]] = {arm: [] for arm in arms}   # steadier on a shared machine
    loads = []
    for r in range(args.rounds):
        for arm in round_order(arms, r):
            dtype, quant, kv = arm
            arm_args = copy.copy(args)
            arm_args.quantization, arm_args.kv_cache_dtype = quant, kv
            arm_args.temperature, arm_args.top_p = 0.0, 1.0
            log(f"round {r}: {dtype} {quant} kv {kv}")
            arm_model = Path(args.quantized_model) if quant in PREQUANTIZED else model_dir
            if args.kv_memory:
                arm_args.num_blocks = pool_blocks(arm_model, dtype, kv, args.block_size, args.kv_memory)
            res = bench_offline.run_engine(arm_model, dtype, wl, arm_args, extras=False)
            runs[arm].append(res["tok_s"])
            per_cpu_s[arm].append(wl.useful_tokens / res["cpu_s"])
        loads.append(os.getloadavg()[0])
    print("\n=== consort bench quant ===")
    print(f"machine: {machine() if args.device == 'cpu' else gpu_name()}; torch threads {args.threads}; "
          f"1-min load after each round: {', '.join(f'{x:.2f}' for x in loads)}")
    print(f"workload: {n} requests, {wl.prompt_tokens} prompt tokens, {wl.useful_tokens} output tokens, greedy"
          + (f"; every arm's KV pool {args.kv_memory / 2**20:.0f} MiB" if args.kv_memory else ""))
    print("\n".join(table(arms, runs, "tok/s")), flush=True)
    print("\nthe same runs in output tokens per CPU-second of this process (all threads; load from other work "
          "moves it less than wall time):")
    print("\n".join(table(arms, per_cpu_s, "tok/cpu-s")), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({":".join(arm): v for arm, v in runs.items()}, indent=2))
    return 0


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def add_args(p: argparse.ArgumentParser) -> None:
    from consort_engine.bench.offline import add_engine_args

    add_engine_args(p)
    p.add_argument("--arms", default=None, metavar="DTYPE:QUANT[:KV],...",
                   help=f"the arms, the first the baseline; unset: {DEFAULT_ARMS['cpu']} on cpu, "
                        f"{DEFAULT_ARMS['cuda']} on cuda")
    p.add_argument("--quantized-model", default=None, metavar="DIR",
                   help="a pre-quantized checkpoint (AWQ, GPTQ or compressed-tensors) of the same model: the awq, "
                        "gptq and compressed-tensors arms load it")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the arms' order rotates each round")
    p.add_argument("--requests", type=int, default=None, help="number of requests; unset: 64, or 16 with --quick")
    p.add_argument("--quick", action="store_true", help="16 requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    p.add_argument("--prompt-len", type=token_range, default=(64, 512), metavar="MIN,MAX",
                   help="prompt tokens, drawn uniformly (the anchor: 64,512)")
    p.add_argument("--output-len", type=token_range, default=(16, 128), metavar="MIN,MAX",
                   help="output tokens, drawn uniformly (the anchor: 16,128)")
    p.add_argument("--kv-memory", type=byte_size, default=None, metavar="SIZE",
                   help="every arm's KV pool in this many bytes (e.g. 96M; --num-blocks per arm from its element), "
                        "so the arms compare at the same memory; unset: --num-blocks, else sized as the server does")


def token_range(text: str) -> tuple[int, int]:
    """argparse type: `MIN,MAX` tokens, 1 <= MIN <= MAX."""
    lo, _, hi = text.partition(",")
    try:
        r = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not MIN,MAX (whole numbers of tokens)") from None
    if not 1 <= r[0] <= r[1]:
        raise argparse.ArgumentTypeError(f"{text}: needs 1 <= MIN <= MAX")
    return r
