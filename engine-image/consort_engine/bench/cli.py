"""`consort bench NAME`: benchmarks with a report (not timed tests).

offline: our engine vs transformers `generate` on the same checkpoint and workload (bench/offline.py).
structured: guided JSON-schema decoding tok/s vs free decoding (bench/structured.py).
spec:    none vs n-gram vs MTP drafting on one checkpoint: acceptance and tokens/s (bench/spec.py).
hybrid:  hybrid (attention + Mamba2) vs pure attention: KV bytes/token, seqs per pool, tok/s (bench/hybrid.py).
roofline: decode step at 32 running vs its roofline floor (bench/roofline.py).
quant:   quantized weights (int8, w8a8, fp8) vs the unquantized engine, side by side (bench/quant.py).
serve:   TTFT / ITL percentiles and throughput of any OpenAI-compatible endpoint (bench/serve.py).
local:   the ensemble on one box vs one engine: consort_operator/bench_local.py (it starts `consort up`).
affinity: prefix-affine vs least-loaded replicas through a router: consort_router/bench_affinity.py.
kv:      character-hash affinity vs precise routing vs precise routing + KV tier: consort_router/bench_kv.py.
The HTTP load generators (serve, local, affinity, offline --vs-server) count what the server does not
answer in full (rejections after their Retry-After retries, error events, timeouts): consort_common/openai_stream.py.
Heavy imports stay inside the subcommands.
"""
from __future__ import annotations

import argparse
import sys

from consort_engine.bench import BenchError
from consort_common.help import HelpFormatter


# name -> one-line help: `consort bench --help` and the top-level `consort --help` both list these.
BENCHES: dict[str, str] = {
    "offline": "engine vs transformers generate, one run",
    "roofline": "decode step at 32 running vs its GEMM/bandwidth floor",
    "quant": "quantized weights vs the unquantized engine, side by side",
    "serve": "streaming latency against an OpenAI endpoint",
    "structured": "guided json_schema vs free decoding tok/s",
    "spec": "speculative decoding: none vs n-gram vs MTP drafting",
    "hybrid": "hybrid (attention + Mamba2) vs pure attention: KV and tok/s",
    "local": "the ensemble on one box vs one engine (starts `consort up`)",
    "affinity": "prefix-affine vs least-loaded replicas through a router",
    "kv": "precise routing and the KV tier vs character-hash affinity",
}
# Implemented outside the engine (consort_common/cli.py NESTED dispatches them before this module
# sees them): listed here so that `consort bench --help` shows every benchmark.
ELSEWHERE = ("local", "affinity", "kv")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="consort bench", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    from consort_engine.bench import hybrid as bench_hybrid
    from consort_engine.bench import offline as bench_offline
    from consort_engine.bench import quant as bench_quant
    from consort_engine.bench import roofline as bench_roofline
    from consort_engine.bench import serve as bench_serve
    from consort_engine.bench import spec as bench_spec
    from consort_engine.bench import structured as bench_structured
    adders = {"offline": bench_offline.add_args, "quant": bench_quant.add_args, "roofline": bench_roofline.add_args, "serve": bench_serve.add_args,
              "structured": bench_structured.add_args, "spec": bench_spec.add_args, "hybrid": bench_hybrid.add_args}
    for name, help_ in BENCHES.items():
        sp = sub.add_parser(name, help=help_, description=help_, add_help=name not in ELSEWHERE,
                            formatter_class=HelpFormatter)
        if name in adders:
            adders[name](sp)
    args = p.parse_args(argv)
    try:
        if args.cmd in ELSEWHERE:
            raise BenchError(f"run it as `consort bench {args.cmd}`")
        return run(args)
    except BenchError as e:
        print(f"consort bench {args.cmd}: {e}", file=sys.stderr, flush=True)
        return 1


def run(args: argparse.Namespace) -> int:
    from consort_engine.bench import hybrid as bench_hybrid
    from consort_engine.bench import offline as bench_offline
    from consort_engine.bench import roofline as bench_roofline
    from consort_engine.bench import serve as bench_serve
    from consort_engine.bench import spec as bench_spec
    from consort_engine.bench import structured as bench_structured
    if args.cmd == "offline":
        return bench_offline.run(args)
    if args.cmd == "roofline":
        return bench_roofline.run(args)
    if args.cmd == "quant":
        from consort_engine.bench import quant as bench_quant
        return bench_quant.run(args)
    if args.cmd == "structured":
        return bench_structured.run(args)
    if args.cmd == "spec":
        return bench_spec.main(args)
    if args.cmd == "hybrid":
        return bench_hybrid.main(args)
    return bench_serve.main(args)


if __name__ == "__main__":
    sys.exit(main())
