"""Prefix-affinity benchmark: `consort bench affinity --model DIR`.

Multi-turn, shared-system-prompt traffic (each conversation: a system prompt shared by all, its own
first question, then follow-up turns that resend the whole history, as chat clients do) through a
real router, in three arms run one after another on the same engines:

  single        1 replica (the cache-hit ceiling: every prefix is on the one replica)
  least-loaded  3 replicas, replica_choice.policy least-loaded
  prefix-affine 3 replicas, replica_choice.policy prefix-affine

Each arm uses its own system prompt and conversation texts, so no arm finds the previous arm's
prefixes in cache. Reports, per arm, the engines' prefix-cache hit rate (hit tokens / queried
prompt tokens, summed over the arm's replicas, from /v1/status), TTFT p50/p99 of the follow-up
turns (the cached-prefix turns), and the router's replica-choice outcomes. Requests the router does
not answer in full are counted per arm, never fatal (openai_stream.py: 429/503 rejections, retried
after their Retry-After a bounded number of times; typed error events; idle timeouts).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from consort_common import openai_stream
from .bench import WORDS, percentile, router_config, start_engine, start_router, stop_all, wait_ready
from consort_common.openai_stream import ClientPolicy, StreamResult, request, tally
from consort_common.help import HelpFormatter

ARMS = ("single", "least-loaded", "prefix-affine")


@dataclass
class Turn:
    first_turn: bool
    result: StreamResult

    @property
    def ok(self) -> bool:
        return self.result.ok


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(session: aiohttp.ClientSession, url: str, system: str, rng: random.Random, turns: int,
                       max_tokens: int, start_delay: float, policy: ClientPolicy = ClientPolicy()) -> list[Turn]:
    """One chat client: each turn resends the whole history. A turn that is not answered in full
    (rejected after its retries, an error event, a timeout) ends the conversation, as a user would
    give up: the next turn would resend a history with a hole in it."""
    await asyncio.sleep(start_delay)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 60)}]
    out: list[Turn] = []
    for t in range(turns):
        body = {"model": "ens", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        res = await request(session, url + "/v1/chat/completions", body, policy=policy)
        out.append(Turn(t == 0, res))
        if not res.ok:
            break
        messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": words(rng, 30)}]
    return out


async def prefix_counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[int, int]:
    queries = hits = 0
    for u in urls:
        async with session.get(u + "/v1/status") as r:
            s = await r.json()
        queries += int(s.get("prefix_cache_queries", 0))
        hits += int(s.get("prefix_cache_hits", 0))
    return queries, hits


async def choice_outcomes(session: aiohttp.ClientSession, router_url: str) -> dict[str, int]:
    async with session.get(router_url + "/metrics") as r:
        text = await r.text()
    out: dict[str, int] = {}
    for ln in text.splitlines():
        if ln.startswith("consort_router_replica_choice_total{"):
            k = ln.split('outcome="', 1)[1].split('"', 1)[0]
            out[k] = out.get(k, 0) + int(float(ln.rsplit(" ", 1)[1]))
    return out


async def run_arm(arm: str, router_url: str, engine_urls: list[str], args: argparse.Namespace) -> dict:
    rng = random.Random(f"{args.seed}-{arm}")
    system = words(rng, args.system_words)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        q0, h0 = await prefix_counters(session, engine_urls)
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(
            conversation(session, router_url, system, random.Random(rng.random()), args.turns, args.max_tokens,
                         0.05 * i, openai_stream.policy_of(args))
            for i in range(args.conversations)))
        wall = time.perf_counter() - t0
        q1, h1 = await prefix_counters(session, engine_urls)
        outcomes = await choice_outcomes(session, router_url)
    turns = [t for c in convs for t in c]
    follow = [t.result.ttft for t in turns if t.ok and not t.first_turn and t.result.ttft is not None]
    counts = tally(t.result for t in turns)
    return {"arm": arm, "replicas": len(engine_urls), "requests": len(turns), "ok": counts["ok"],
            "rejected": counts["rejected"], "error_events": counts["error_event"], "timeouts": counts["timeout"],
            "failed": counts["failed"], "retries": counts["retries"], "hit_rate": (h1 - h0) / max(q1 - q0, 1),
            "followup_ttft_p50_ms": 1e3 * percentile(follow, 50), "followup_ttft_p99_ms": 1e3 * percentile(follow, 99),
            "wall_s": wall, "outcomes": outcomes}


def report(results: list[dict], args: argparse.Namespace) -> str:
    base = next(r["hit_rate"] for r in results if r["arm"] == "single")
    lines = [f"prefix affinity: {args.conversations} conversations x {args.turns} turns, system prompt "
             f"{args.system_words} words, max_tokens {args.max_tokens}",
             f"  {'arm':<14} {'replicas':>8} {'hit rate':>9} {'vs single':>10} {'TTFT p50':>10} {'TTFT p99':>10} "
             f"{'rejected':>8} {'errors':>6} {'timeouts':>8} {'failed':>6} {'retries':>7}  choices"]
    for r in results:
        lines.append(f"  {r['arm']:<14} {r['replicas']:>8} {100 * r['hit_rate']:>8.1f}% "
                     f"{100 * (r['hit_rate'] - base):>+9.1f}% {r['followup_ttft_p50_ms']:>8.0f}ms "
                     f"{r['followup_ttft_p99_ms']:>8.0f}ms {r['rejected']:>8} {r['error_events']:>6} "
                     f"{r['timeouts']:>8} {r['failed']:>6} {r['retries']:>7}  "
                     + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())))
    lines.append("  (hit rate: prefix-cache hit tokens / prompt tokens over the arm's replicas; TTFT: follow-up "
                 "turns, whose history is cached where they were served before; rejected: 429/503 after "
                 f"{args.retries} Retry-After retries, errors: typed error events in the stream, timeouts: no byte "
                 f"for {args.idle_timeout:g} s, failed: anything else; a conversation ends at its first such turn)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="consort bench affinity", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint dir: three `consort engine`s are started on it")
    ap.add_argument("--engine-args", default="--num-blocks 512", help="extra `consort engine` arguments")
    ap.add_argument("--conversations", type=int, default=24, help="conversations, all sharing one system prompt")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--system-words", type=int, default=120, help="length of the shared system prompt, words")
    ap.add_argument("--max-tokens", type=int, default=24, help="output tokens per turn")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    openai_stream.add_args(ap)
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model {args.model}: no checkpoint there (no config.json; `consort demo-model DIR` writes one)")

    tmp = Path(tempfile.mkdtemp(prefix="consort-affinity-bench-"))
    procs = []
    try:
        engines = []
        for i in range(3):
            p, url = start_engine(args.model, "bench", args.engine_args.split(), tmp)
            procs.append(p)
            engines.append(url)
        print(f"bench: starting 3 engines on {args.model} (logs in {tmp})", file=sys.stderr)
        setups = {"single": (engines[:1], "least-loaded"), "least-loaded": (engines, "least-loaded"),
                  "prefix-affine": (engines, "prefix-affine")}
        routers = {}
        for arm, (urls, policy) in setups.items():
            p, url = start_router(router_config({"bench": urls}, "bench", replica_choice={"policy": policy},
                                                polling={"interval_s": 0.1}), tmp)
            procs.append(p)
            routers[arm] = url
        if not wait_ready(engines + list(routers.values()), procs):
            print(f"bench: engines/routers did not become ready; logs in {tmp}", file=sys.stderr)
            return 1
        results = []
        for arm in ARMS:
            print(f"bench: arm {arm} ...", file=sys.stderr)
            results.append(asyncio.run(run_arm(arm, routers[arm], setups[arm][0], args)))
        print(report(results, args))
        if args.json:
            print(json.dumps(results, indent=2))
        return 0
    finally:
        stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())
