"""Parse + validate cost of typical request bodies, this tree against a git ref, side by side in one run.

    python hack/bench_request_parse.py [--baseline main]

Each side runs in its own interpreter (the baseline from `git archive REF`), timing what the route
does before tokenizing: decode the JSON body and build the validated GenerationRequest. Prints a
report; the CPU and whether other work shared it belong next to the figures."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r'''
import json, timeit, sys
from consort_engine.serving.http import decode_json
from consort_engine.serving.protocol import parse_chat, parse_completion
chat = {"model": "m", "messages": [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a SQL query that lists the ten largest orders."}],
        "temperature": 0.7, "top_p": 0.95, "max_tokens": 256, "stop": ["\n\n"], "stream": True,
        "stream_options": {"include_usage": True}, "seed": 7}
completion = {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0.2, "top_k": 40,
              "stop": ["\ndef ", "\nclass "], "logprobs": 2, "n": 2}
huge = {"prompt": "x", **{f"k{i}": i for i in range(350_000)}}          # ~4 MiB of unknown keys
cases = [("chat", parse_chat, json.dumps(chat).encode(), 2000), ("completion", parse_completion,
         json.dumps(completion).encode(), 2000), ("350k keys (4 MiB)", parse_completion, json.dumps(huge).encode(), 1)]
out = {}
for name, parse, raw, n in cases:
    best = min(timeit.repeat(lambda: parse(decode_json(raw)), number=n, repeat=3)) / n
    parse_only = min(timeit.repeat(lambda: parse(json.loads(raw)), number=n, repeat=3)) / n
    decode = min(timeit.repeat(lambda: json.loads(raw), number=n, repeat=3)) / n
    out[name] = {"bytes": len(raw), "decode+parse_us": best * 1e6, "validate_us": (parse_only - decode) * 1e6}
print(json.dumps(out))
'''


def measure(engine_image: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(engine_image))
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="main", help="git ref to compare against (default: main)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "engine-image"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        print(f"measuring {args.baseline} ...", flush=True)
        old = measure(Path(tmp) / "engine-image")
    print("measuring this tree ...", flush=True)
    new = measure(ROOT / "engine-image")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    flags = Path("/proc/cpuinfo").read_text()
    print(f"\nCPU: {cpu}; avx512f {'yes' if 'avx512f' in flags else 'no'}, amx_tile "
          f"{'yes' if 'amx_tile' in flags else 'no'}; best of 3 repeats\n")
    print(f"{'body':<20}{'bytes':>10}  {'decode+parse ' + args.baseline:>22}{'this tree':>12}{'ratio':>8}"
          f"  {'validate ' + args.baseline:>18}{'this tree':>12}")
    for name in old:
        o, n = old[name], new[name]
        print(f"{name:<20}{o['bytes']:>10}  {o['decode+parse_us']:>19.1f} us{n['decode+parse_us']:>9.1f} us"
              f"{n['decode+parse_us'] / o['decode+parse_us']:>8.2f}  {o['validate_us']:>15.1f} us"
              f"{n['validate_us']:>9.1f} us")


if __name__ == "__main__":
    main()
