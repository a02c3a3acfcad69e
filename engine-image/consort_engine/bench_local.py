"""`consort bench local`: does one box serve its whole ensemble? Against a running `consort up`
(`make up`), the same streaming load goes to each specialist alone, then to every specialist at
once, through the router with the specialist pinned by `model`. The report compares the aggregate
output tokens/s with all of them busy to one engine alone on the same cores (the mean of the solo
runs): a ratio near 1 means the engines share the cores instead of fighting over them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from .bench_serve import make_workload, one_request, summarize


async def specialists(session, url: str) -> list[str]:
    async with session.get(url + "/v1/models") as r:
        data = (await r.json())["data"]
    return [m["id"] for m in data if m.get("parent")]


async def load(session, url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    work = make_workload(args.requests, (args.prompt_words, args.prompt_words), (args.max_tokens, args.max_tokens), seed)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str, n: int):
        async with sem:
            return await one_request(session, url, model, prompt, n, "completions", True)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p, n) for p, n in work))
    return summarize(results, time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> dict:
    import aiohttp

    url = args.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        names = args.specialist or await specialists(session, url)
        print(f"bench local: {url}, specialists {', '.join(names)}; per specialist {args.requests} streaming "
              f"requests, concurrency {args.concurrency}, {args.prompt_words}-word prompts, {args.max_tokens} "
              f"new tokens", flush=True)
        await load(session, url, names[0], argparse.Namespace(**{**vars(args), "requests": args.concurrency}), 99)
        alone = {}
        for i, name in enumerate(names):
            alone[name] = await load(session, url, name, args, i)
            print(f"  {name} alone: {alone[name]['output_tokens_per_s']:.1f} tok/s", flush=True)
        t0 = time.perf_counter()
        together_runs = await asyncio.gather(*(load(session, url, n, args, 100 + i) for i, n in enumerate(names)))
        wall = time.perf_counter() - t0
    together = dict(zip(names, together_runs))
    tokens = sum(s["output_tokens"] for s in together_runs)
    mean_alone = sum(s["output_tokens_per_s"] for s in alone.values()) / len(alone)
    return {"specialists": names, "alone": alone, "together": together, "aggregate_tok_s": tokens / wall,
            "mean_alone_tok_s": mean_alone, "ratio": tokens / wall / mean_alone if mean_alone else 0.0,
            "failures": sum(s["requests"] - s["ok"] for s in [*alone.values(), *together_runs])}


def report(r: dict) -> str:
    lines = ["", "=== consort bench local ===",
             f"{'specialist':<14}{'alone tok/s':>14}{'together tok/s':>16}{'TTFT p50 together':>20}"]
    for n in r["specialists"]:
        a, t = r["alone"][n], r["together"][n]
        lines.append(f"{n:<14}{a['output_tokens_per_s']:>14.1f}{t['output_tokens_per_s']:>16.1f}"
                     f"{t['ttft_s']['p50'] * 1000:>17.0f} ms")
    lines += [f"one engine alone (mean)   {r['mean_alone_tok_s']:.1f} tok/s",
              f"all at once (aggregate)   {r['aggregate_tok_s']:.1f} tok/s",
              f"ratio                     {r['ratio']:.2f}x" + (f"   failures {r['failures']}" if r["failures"] else "")]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the router of a running `consort up`")
    p.add_argument("--specialist", action="append", help="specialists to load (default: all, from /v1/models)")
    p.add_argument("--concurrency", type=int, default=12, help="streams per specialist")
    p.add_argument("--requests", type=int, default=24, help="requests per specialist and phase")
    p.add_argument("--prompt-words", type=int, default=300, help="~400 tokens on the demo tokenizer")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    r = asyncio.run(run(args))
    print(report(r))
    if args.json:
        print(json.dumps(r))
    return 0 if r["failures"] == 0 else 1
