"""Time to first token of one prompt: recomputed vs loaded from the KV tier (a warm restart), and
the block hash's cost per block.

Usage: python hack/bench_kv_tier.py [--tokens 2048] [--hidden 1024] [--layers 8]
Writes a random-weight Llama-family demo checkpoint of that size (timing only: the weights do not
matter), runs the prompt once on an engine with a disk tier (prefill: the recompute time), closes
it (its prefix blocks go to the tier), then starts a second engine on the same directory and runs
the same prompt (the tier hit: every full block but the last token's is loaded, not computed).
Both engines are CPU, float32, one process; prints a small report with the CPU model.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.demo_model import write_demo_model
from consort_common.block_hash import ROOT, block_hash
from consort_engine.kv.sequence import SamplingParams, Sequence


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    seq = Sequence(list(prompt), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    engine.scheduler.add(seq)
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - t0, seq.num_cached_tokens


def hash_cost_us(tokens: list[int], block_size: int, reps: int = 50) -> float:
    blocks = [tuple(tokens[i:i + block_size]) for i in range(0, len(tokens) - block_size + 1, block_size)]
    t0 = time.perf_counter()
    for _ in range(reps):
        parent = ROOT
        for b in blocks:
            parent = block_hash(parent, b, "spec", None, None)
    return (time.perf_counter() - t0) / reps / len(blocks) * 1e6


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = Path("/proc/cpuinfo").read_text()
    return f"{model}; avx512f {'yes' if ' avx512f' in flags else 'no'}, amx_tile {'yes' if ' amx_tile' in flags else 'no'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_demo_model(Path(tmp) / "model", hidden=a.hidden, layers=a.layers, heads=a.hidden // 64,
                                kv_heads=max(1, a.hidden // 256), ffn=a.hidden * 11 // 4, vocab=4096,
                                max_pos=max(4096, a.tokens + 16))
        prompt = [random.Random(0).randrange(5, 4096) for _ in range(a.tokens)]
        config = EngineConfig(model=str(ckpt), dtype="float32", block_size=a.block_size,
                              num_blocks=a.tokens // a.block_size + 8, kv_tier_path=str(Path(tmp) / "tier"),
                              max_num_batched_tokens=a.tokens)
        first = LLMEngine(config)
        first.warmup()
        recompute, _ = ttft(first, prompt)
        first.close()
        second = LLMEngine(config)
        second.warmup()
        hit, cached = ttft(second, prompt)
        s = second.stats()
        block_mib = second.runner.block_bytes / 2**20
    print(f"CPU: {cpu()}")
    print(f"model: Llama-family, hidden {a.hidden}, {a.layers} layers, float32; prompt {a.tokens} tokens, "
          f"block {a.block_size} tokens ({block_mib:.2f} MiB of K/V)")
    print(f"{'':28} {'TTFT s':>8} {'cached tokens':>14}")
    print(f"{'recompute (cold pool)':28} {recompute:8.3f} {0:14d}")
    print(f"{'tier hit (warm restart)':28} {hit:8.3f} {cached:14d}")
    print(f"tier load: {s['kv_tier_load_seconds'] / max(s['kv_tier_hits'], 1) * 1e3:.2f} ms per block; "
          f"speed-up {recompute / hit:.1f}x")
    print(f"block hash: {hash_cost_us(prompt, a.block_size):.2f} us per block "
          f"({a.tokens // a.block_size} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
