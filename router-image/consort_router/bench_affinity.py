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
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from consort_common import openai_stream
from .bench import REPLICA_THREADS, WORDS, percentile, router_config, start_engine, start_router, stop_all, wait_ready
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


class TurnGate:
    """Holds every conversation before each turn in `actions` until all conversations still going have
    arrived there, then runs that turn's action once (a restart, a counter reading) and lets them on.
    `arrive` gets the turn's prompt text (completions) so an action can see what comes next."""

    def __init__(self, parties: int, actions: dict[int, Callable[[list[str]], Awaitable[None]]]) -> None:
        self.parties = parties
        self.actions = actions
        self.prompts: dict[int, list[str]] = {t: [] for t in actions}
        self.done = {t: asyncio.Event() for t in actions}
        self.started: set[int] = set()
        self.action_s = 0.0      # time spent in the actions (a restart): not serving time
        self.answers: dict[int, list[tuple[str, StreamResult]]] = {}   # turn -> (prompt, its result)

    def answered(self, turn: int, prompt: str, res: StreamResult) -> None:
        self.answers.setdefault(turn, []).append((prompt, res))

    async def arrive(self, turn: int, prompt: str) -> None:
        if turn in self.actions:
            self.prompts[turn].append(prompt)
            await self._run_ready()
            await self.done[turn].wait()

    async def leave(self) -> None:
        """A conversation ended (all its turns, or its first failed one): no turn waits for it any more."""
        self.parties -= 1
        await self._run_ready()

    async def _run_ready(self) -> None:
        for t, action in self.actions.items():
            if t not in self.started and len(self.prompts[t]) >= self.parties:
                self.started.add(t)
                t0 = time.perf_counter()
                try:
                    await action(self.prompts[t])
                finally:
                    self.action_s += time.perf_counter() - t0
                    self.done[t].set()


def completion_prompt(system: str, exchanges: list[tuple[str, str]], question: str) -> str:
    """A completions prompt resending the whole history, as a chat client over /v1/completions does."""
    return system + "".join(f"\n\nUser: {q}\nAssistant: {a}" for q, a in exchanges) + f"\n\nUser: {question}\nAssistant:"


async def conversation(session: aiohttp.ClientSession, url: str, system: str, rng: random.Random, turns: int,
                       max_tokens: int, start_delay: float, policy: ClientPolicy = ClientPolicy(),
                       api: str = "chat", question_words: tuple[int, int] = (60, 30),
                       gate: TurnGate | None = None, in_flight: asyncio.Semaphore | None = None,
                       cache_salt: str | None = None) -> list[Turn]:
    """One chat client: each turn resends the whole history (`api` chat: as messages; completions: as
    one text prompt). A turn that is not answered in full (rejected after its retries, an error event,
    a timeout) ends the conversation, as a user would give up: the next turn would resend a history
    with a hole in it. `in_flight` bounds the requests the arm's conversations have out at once (all
    conversations stay open, their turns interleave: each history waits in some cache meanwhile)."""
    await asyncio.sleep(start_delay)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, question_words[0])}]
    exchanges: list[tuple[str, str]] = []
    out: list[Turn] = []
    try:
        for t in range(turns):
            body = {"model": "ens", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            if cache_salt is not None:
                body["cache_salt"] = cache_salt
            if api == "chat":
                body["messages"] = messages
            else:
                body |= {"prompt": completion_prompt(system, exchanges, messages[-1]["content"]),
                         "stream_options": {"include_usage": True}}
            if gate is not None:
                await gate.arrive(t, body.get("prompt", ""))
            async with in_flight or contextlib.nullcontext():
                res = await request(session, url + ("/v1/chat/completions" if api == "chat" else "/v1/completions"),
                                    body, policy=policy)
            out.append(Turn(t == 0, res))
            if gate is not None:
                gate.answered(t, body.get("prompt", ""), res)
            if not res.ok:
                break
            exchanges.append((messages[-1]["content"], res.text))
            messages += [{"role": "assistant", "content": res.text},
                         {"role": "user", "content": words(rng, question_words[1])}]
    finally:
        if gate is not None:
            await gate.leave()
    return out


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "tier_cache_queries", "tier_cache_hits")


async def prefix_counters(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, int]:
    """The engines' prefix-cache counters (/v1/status), summed: prompt tokens looked up in the pool and
    found there, then looked up in the KV tier and loaded from it (tokens)."""
    out = dict.fromkeys(COUNTERS, 0)
    for u in urls:
        async with session.get(u + "/v1/status") as r:
            s = await r.json()
        for k in COUNTERS:
            out[k] += int(s.get(k, (s.get("engine") or {}).get(k, 0)) or 0)
    return out


async def choice_outcomes(session: aiohttp.ClientSession, router_url: str) -> dict[str, int]:
    async with session.get(router_url + "/metrics") as r:
        text = await r.text()
    out: dict[str, int] = {}
    for ln in text.splitlines():
        if ln.startswith("consort_router_replica_choice_total{"):
            k = ln.split('outcome="', 1)[1].split('"', 1)[0]
            out[k] = out.get(k, 0) + int(float(ln.rsplit(" ", 1)[1]))
    return out


async def run_arm(arm: str, router_urls: list[str], engine_urls: list[str], args: argparse.Namespace,
                  api: str = "chat", question_words: tuple[int, int] = (60, 30),
                  gate: TurnGate | None = None, in_flight: int = 0, workload: str | None = None,
                  cache_salt: str | None = None) -> dict:
    """One arm's conversations, split round-robin over `router_urls` (at most `in_flight` requests out
    at once; 0: no bound), and what the engines and routers counted meanwhile. The words are drawn
    from the seed and `workload` (default: the arm's name: each arm its own prompts); `cache_salt`
    keeps arms that share a workload out of each other's cache."""
    rng = random.Random(f"{args.seed}-{workload or arm}")
    system = words(rng, args.system_words)
    bound = asyncio.Semaphore(in_flight) if in_flight else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        c0 = await prefix_counters(session, engine_urls)
        o0 = [await choice_outcomes(session, u) for u in router_urls]     # a router may serve an earlier arm too
        t0 = time.perf_counter()
        convs = await asyncio.gather(*(
            conversation(session, router_urls[i % len(router_urls)], system, random.Random(rng.random()), args.turns,
                         args.max_tokens, 0.05 * i, openai_stream.policy_of(args), api, question_words, gate,
                         bound, cache_salt)
            for i in range(args.conversations)))
        wall = time.perf_counter() - t0
        c1 = await prefix_counters(session, engine_urls)
        outcomes: dict[str, int] = {}
        for u, before in zip(router_urls, o0):
            for k, v in (await choice_outcomes(session, u)).items():
                if v > before.get(k, 0):
                    outcomes[k] = outcomes.get(k, 0) + v - before.get(k, 0)
    turns = [t for c in convs for t in c]
    follow = [t.result.ttft for t in turns if t.ok and not t.first_turn and t.result.ttft is not None]
    counts = tally(t.result for t in turns)
    delta = {k: c1[k] - c0[k] for k in COUNTERS}
    return {"arm": arm, "replicas": len(engine_urls), "routers": len(router_urls), "requests": len(turns),
            "ok": counts["ok"], "rejected": counts["rejected"], "error_events": counts["error_event"],
            "timeouts": counts["timeout"], "failed": counts["failed"], "retries": counts["retries"],
            "hit_rate": delta["prefix_cache_hits"] / max(delta["prefix_cache_queries"], 1),
            "tier_hit_rate": delta["tier_cache_hits"] / max(delta["prefix_cache_queries"], 1), "counters": delta,
            "followup_ttft_p50_ms": 1e3 * percentile(follow, 50), "followup_ttft_p90_ms": 1e3 * percentile(follow, 90),
            "followup_ttft_p99_ms": 1e3 * percentile(follow, 99), "wall_s": wall,
            "ttft_p90_ms_by_turn": [1e3 * percentile([c[t].result.ttft for c in convs if len(c) > t and c[t].ok
                                                      and c[t].result.ttft is not None], 90)
                                    for t in range(max((len(c) for c in convs), default=0))],
            "serving_s": wall - (gate.action_s if gate is not None else 0.0),
            "output_tokens": sum(t.result.completion_tokens or t.result.chunks for t in turns if t.ok),
            "last_prompt_tokens": [c[-1].result.prompt_tokens + c[-1].result.completion_tokens for c in convs if c],
            "outcomes": outcomes, "error_samples": sorted({t.result.error[:200] for t in turns if not t.ok})[:5]}


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
    ap.add_argument("--engine-args", default=f"--num-blocks 512 --threads {REPLICA_THREADS}",
                    help="extra `consort engine` arguments (one thread each: every replica a one-CPU pod; engines "
                         "whose threads outnumber the machine's cores spin on each other's)")
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
            results.append(asyncio.run(run_arm(arm, [routers[arm]], setups[arm][0], args)))
        print(report(results, args))
        if args.json:
            print(json.dumps(results, indent=2))
        return 0
    finally:
        stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())
