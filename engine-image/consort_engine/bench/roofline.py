"""`consort bench roofline`: the decode step at N running sequences against its roofline floor.

Measures this machine's fp32 GEMM rate (the step's shapes at decode and at 2,048 rows, the best) and memory
bandwidth (a sum over a tensor far larger than the caches), computes the step's FLOPs and bytes
(weights once + the KV every sequence reads), floor = max(flops / rate, bytes / bw), then times the
real engine step (bench_offline.decode_overhead: step time, forward share, time outside it).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"])

    def gemms(self) -> list[tuple[int, int]]:
        """(in, out) of every weight matmul of one layer (q, k, v, o, gate, up, down); lm_head apart."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden),
                (self.hidden, self.ffn), (self.hidden, self.ffn), (self.ffn, self.hidden)]

    def weight_params(self) -> int:
        return self.layers * sum(i * o for i, o in self.gemms()) + self.hidden * self.vocab


@dataclass
class Floor:
    flops: float
    bytes: float
    gemm_s: float
    mem_s: float

    @property
    def floor_s(self) -> float:
        return max(self.gemm_s, self.mem_s)


def decode_floor(s: Shape, running: int, context: int, elem_bytes: int, gemm_rate: float, bandwidth: float) -> Floor:
    """One decode step: every sequence's token through every weight (2 FLOPs a MAC) plus attention over
    `context` cached tokens (QK^T and PV); bytes = the weights once + each sequence's K and V read once."""
    weight_flops = 2 * running * s.weight_params()
    attn_flops = 2 * 2 * running * s.layers * s.heads * s.head_dim * context
    kv_bytes = running * s.layers * 2 * s.kv_heads * s.head_dim * context * elem_bytes
    nbytes = s.weight_params() * elem_bytes + kv_bytes
    flops = weight_flops + attn_flops
    return Floor(flops=flops, bytes=nbytes, gemm_s=flops / gemm_rate, mem_s=nbytes / bandwidth)


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_rate(s: Shape, running: int, dtype, reps: int = 20, peak_rows: int = 2048) -> float:
    """The machine's attainable GEMM FLOP/s for this model's weights: the best of the step's own
    shapes at `running` rows and at `peak_rows` rows (where GEMMs run at the machine's peak), each
    through the engine's own packed GEMM (models/packed.py) and plain torch matmul. The floor is
    what the FLOPs would cost at that rate; a small-row GEMM below it is part of the gap, not of
    the floor."""
    import torch

    from consort_engine.model.models.packed import pack_linear

    best = 0.0
    for rows in (running, peak_rows):
        weights = [torch.randn(o, i, dtype=dtype) for i, o in s.gemms() + [(s.hidden, s.vocab)]]
        xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]
        flops = sum(2 * rows * w.numel() for w in weights)
        packed = [pack_linear(w, None) for w in weights]
        if all(f is not None for f in packed):
            best = max(best, flops / _best(lambda: [f(x) for f, x in zip(packed, xs)], max(2, reps * running // rows)))
        best = max(best, flops / _best(lambda: [x @ w.t() for w, x in zip(weights, xs)], max(2, reps * running // rows)))
    return best


def bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s read by a sum over a 1 GiB fp32 tensor (far beyond L3)."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best(lambda: x.sum(), reps)


def run(args: argparse.Namespace) -> int:
    import torch

    from consort_engine.bench import offline as bench_offline
    from consort_engine.bench.workload import bench_model, log
    from consort_engine.core.engine import LLMEngine
    from consort_engine.model.models import packed

    args.threads = bench_offline.apply_threads(args.threads or None)
    args.dtype = "float32" if args.dtype == "both" else args.dtype
    model_dir = Path(args.model) if args.model else bench_model(False)
    shape = Shape.from_config(json.loads((model_dir / "config.json").read_text()))
    dtype = getattr(torch, args.dtype)
    engine = LLMEngine(bench_offline.engine_config(model_dir, args.dtype, args))
    engine.warmup()
    # The floor's rate and the step are timed in turn, `repeats` times, and each side keeps its best: on a
    # shared machine a neighbour's burst would otherwise land on one side only and swing the ratio.
    rate = bw = 0.0
    m: dict = {}
    for r in range(args.repeats):
        rate, bw = max(rate, gemm_rate(shape, args.running, dtype)), max(bw, bandwidth())
        engine.last_batch = None        # the previous round's full decode batch is not this round's
        got = bench_offline.decode_overhead(engine, args, running=args.running, prompt_len=args.prompt_len,
                                            steps=args.steps)
        if not m or got["step_ms"] < m["step_ms"]:
            m = got
        log(f"  round {r + 1}/{args.repeats}: GEMM {rate / 1e9:.1f} GFLOP/s, {bw / 1e9:.1f} GB/s (best so far), "
            f"step {got['step_ms']:.2f} ms")
    context = args.prompt_len + args.steps // 2          # mean cached length over the timed steps
    floor = decode_floor(shape, args.running, context, torch.finfo(dtype).bits // 8, rate, bw)
    measured = m["step_ms"] / 1000
    print(f"| running | GEMM GFLOP/s | GB/s | FLOPs/step | bytes/step | floor ms | measured ms | "
          f"measured / floor | forward ms | outside forward % |  ({args.dtype}, {args.threads} threads, "
          f"GEMM {packed.fp32_backend()})")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.running} | {rate / 1e9:.1f} | {bw / 1e9:.1f} | {floor.flops / 1e9:.2f} G | "
          f"{floor.bytes / 1e6:.1f} MB | {1000 * floor.floor_s:.2f} | {1000 * measured:.2f} | "
          f"{measured / floor.floor_s:.2f} | {m['forward_ms']:.2f} | {100 * m['outside_share']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": asdict(shape), "floor": asdict(floor), "measured": m,
                                               "gemm_flops": rate, "bandwidth": bw}, indent=2))
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    from consort_engine.bench import offline as bo   # the engine knobs are bench offline's (= the server's)

    bo.add_engine_args(p)
    p.add_argument("--running", type=int, default=32, help="sequences in the decode batch")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each running sequence")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per round")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of (GEMM rate, bandwidth, decode steps); each side keeps its best")
