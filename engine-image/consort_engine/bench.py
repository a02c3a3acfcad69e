"""`consort bench offline|serve`: benchmark scripts with a report (not timed tests).

offline: our engine vs transformers `generate` on the same checkpoint and workload (bench_offline.py).
serve:   TTFT / ITL percentiles and throughput of any OpenAI-compatible endpoint (bench_serve.py).
local:   a running `consort up`: each specialist alone vs all at once on the same cores (bench_local.py).
Heavy imports stay inside the subcommands.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="consort bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    from . import bench_local, bench_offline, bench_serve
    bench_offline.add_args(sub.add_parser("offline", help="engine vs transformers generate, one run"))
    bench_serve.add_args(sub.add_parser("serve", help="streaming latency against an OpenAI endpoint"))
    bench_local.add_args(sub.add_parser("local", help="a running `consort up`: specialists alone vs all at once"))
    args = p.parse_args(argv)
    if args.cmd == "offline":
        return bench_offline.run(args)
    return bench_local.main(args) if args.cmd == "local" else bench_serve.main(args)


if __name__ == "__main__":
    sys.exit(main())
