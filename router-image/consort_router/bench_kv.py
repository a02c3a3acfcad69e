"""KV fleet benchmark: `consort bench kv --model DIR`.

What precise routing (the engines' block events) and the KV tier buy a fleet whose working set is
several times one replica's KV pool. The `consort bench affinity` workload (multi-turn conversations
sharing a system prompt, each turn resending the whole history) goes as completions with text
prompts through real routers over three real engines, in four arms run one after another. Every arm
sends the same words (the same token counts: how many blocks the shared system prompt fills decides
much of the hit rate), each under its own `cache_salt`, so no arm inherits another's cache:

  affinity           3 replicas, prefix-affine on character hashes (replica_choice.kv_events off)
  precise            the same replicas, precise routing on the engines' block events, 1 router
  precise-2-routers  the same, 2 router replicas (each following every engine) splitting the conversations
  precise+tier       3 fresh replicas sharing one KV tier directory, precise routing; the replica
                     holding the most conversations restarts (same directory) before the middle turn

then two tier checks on the precise+tier replicas: after the restart, how much of the prefix the
restarted replica held before it came back cached (every pool block of the new process was loaded
from the tier, directly or by an earlier request of that turn); and a conversation started on
replica 1 continued on replica 2 after replica 1 stopped (its pool went to the shared directory).

Reports per arm: follow-up TTFT p50/p90, output tokens/s, the engines' prefix-cache hit rate (pool)
and tier hit rate (tokens loaded from the tier), both over the prompt tokens; the targets (affinity
p90 / precise+tier p90 >= 3x with throughput not lower; 2 routers' hit rate within 5% of 1's; both
tier checks >= 90%) as PASS/MISS, never failing the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from consort_common import openai_stream
from consort_common.block_hash import prefix_hashes, prefix_salt
from consort_common.help import HelpFormatter
from consort_common.machine import cpu_model_and_flags, machine
from consort_common.openai_stream import request
from .bench import REPLICA_THREADS, router_config, start_engine, start_router, stop_all, wait_ready
from .bench_affinity import TurnGate, completion_prompt, prefix_counters, run_arm, words
from .prompt_tokens import PromptTokenizer

ARMS = ("affinity", "precise", "precise-2-routers", "precise+tier")
NAME = "bench"                 # the engines' specialist name (it is in every block hash)
TENANT = "anonymous"           # the tenant the router sends without auth (in every block's salt)
BLOCK = 16                     # the engines' block size on CPU
TOKENS_PER_WORD = 1.1          # the workload's words in the demo tokenizer (measured, to size the pool)


@dataclass(frozen=True)
class Size:
    conversations: int
    turns: int
    system_words: int
    question_words: tuple[int, int]     # first question, each follow-up
    max_tokens: int
    in_flight: int                      # requests out at once over the 3 replicas


SIZES = {"quick": Size(14, 3, 24, (24, 8), 4, 3), "full": Size(16, 4, 60, (300, 12), 16, 3)}


def working_set_blocks(size: Size) -> int:
    """Distinct KV blocks of the workload's final histories: the shared system prompt once, then each
    conversation's own questions, answers and turn markers (an estimate made before the run; the
    report gives the measured one)."""
    own = TOKENS_PER_WORD * (size.question_words[0] + (size.turns - 1) * size.question_words[1]) \
        + size.turns * (size.max_tokens + 6)
    return int((TOKENS_PER_WORD * size.system_words + size.conversations * own) / BLOCK)


def pool_blocks(size: Size) -> int:
    """Room for the longest turns a replica serves at once (its share of the requests in flight, and
    one more: routing is not an even split). The sizes are chosen so that this is a quarter of the
    working set or less."""
    longest = TOKENS_PER_WORD * (size.system_words + size.question_words[0] + (size.turns - 1) *
                                 size.question_words[1]) + size.turns * (size.max_tokens + 6)
    return (size.in_flight // 3 + 1) * (int(longest / BLOCK) + 1)


async def status(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/v1/status") as r:
        s = await r.json()
    return s | (s.get("engine") or {})


async def held(session: aiohttp.ClientSession, url: str) -> set[bytes]:
    """The block hashes an engine holds now, pool and tier (its events' snapshot)."""
    async with session.get(url + "/v1/kv/events") as r:
        snap = (await r.json())["snapshot"]
    return {bytes.fromhex(h) for m in ("pool", "tier") for h in snap.get(m, ())}


def depth(hashes: list[bytes], have: set[bytes]) -> int:
    n = 0
    for h in hashes:
        if h not in have:
            break
        n += 1
    return n


class Fleet:
    """The processes of one run: engines by index (restartable on their port), routers, their logs."""

    def __init__(self, model: str, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        self.procs: list[subprocess.Popen] = []
        self.args: dict[str, list[str]] = {}

    def engine(self, extra: list[str], port: int | None = None) -> str:
        p, url = start_engine(self.model, NAME, extra, self.tmp, port=port)
        self.procs.append(p)
        self.args[url] = extra
        return url

    def router(self, engines: list[str], kv_events: bool, load_slack: float | None = None) -> str:
        # The default polling periods: four routers polling six engines faster would take a share of
        # two cores that shows in every arm.
        choice = {"policy": "prefix-affine", "kv_events": kv_events}
        if load_slack is not None:
            choice["load_slack"] = load_slack
        cfg = router_config({NAME: engines}, NAME, replica_choice=choice)
        p, url = start_router(cfg, self.tmp)
        self.procs.append(p)
        return url

    def stop_engine(self, url: str) -> None:
        """SIGTERM (the engine writes its pool's prefix blocks to the tier) and wait for the exit."""
        port = url.rsplit(":", 1)[1]
        for p in self.procs:
            if p.poll() is None and p.args[p.args.index("--port") + 1] == port:
                p.send_signal(signal.SIGTERM)
                p.wait(60)

    def restart_engine(self, url: str) -> None:
        self.stop_engine(url)
        self.engine(self.args[url], port=int(url.rsplit(":", 1)[1]))
        if not wait_ready([url], self.procs[-1:], timeout_s=300):
            raise RuntimeError(f"engine {url} did not come back; logs in {self.tmp}")


async def router_snapshots(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("consort_router_kv_snapshots_total"))


class RestartCheck:
    """Before the middle turn of the precise+tier arm, the replica holding the most conversations (their
    next prompt's leading blocks in its pool or tier, deeper than on any other replica) restarts on the
    same tier directory: how many of their prefix tokens it held, how many of those their next turn
    found cached (each answer's usage.prompt_tokens_details.cached_tokens, up to what the replica held
    of that prompt), and how many tokens the new process loaded from the tier meanwhile."""

    def __init__(self, fleet: Fleet, engines: list[str], router: str, tok: PromptTokenizer, turn: int) -> None:
        self.fleet, self.engines, self.router, self.tok = fleet, engines, router, tok
        self.turn = turn                     # the turn the restart comes before
        self.held_tokens = 0
        self.conversations = 0
        self.after: dict = {}
        self.before: dict = {}
        self.replica = 0
        self.held: dict[str, int] = {}       # the held conversations' next prompts -> prefix tokens held

    def hashes(self, prompt: str) -> list[bytes]:
        ids = self.tok.encode_head(prompt, 1 << 20, 0)
        return prefix_hashes(ids[:len(ids) - 1], BLOCK, NAME, None, prefix_salt(TENANT, "precise+tier"))

    async def restart(self, prompts: list[str]) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            views = [await held(session, u) for u in self.engines]
            owned: list[dict[str, int]] = [{} for _ in self.engines]     # per replica: prompt -> held tokens
            for p in prompts:
                d = [depth(self.hashes(p), v) for v in views]
                top = max(range(len(d)), key=d.__getitem__)
                if d[top] > max(d[:top] + d[top + 1:]):
                    owned[top][p] = d[top] * BLOCK
            self.replica = max(range(len(owned)), key=lambda i: len(owned[i]))
            self.held = owned[self.replica]
            self.conversations, self.held_tokens = len(self.held), sum(self.held.values())
            print(f"bench: restarting replica {self.replica} ({self.conversations} of {len(prompts)} conversations "
                  f"held there, {self.held_tokens} prefix tokens)", file=sys.stderr, flush=True)
            snaps = await router_snapshots(session, self.router)
            await asyncio.to_thread(self.fleet.restart_engine, self.engines[self.replica])
            deadline = time.monotonic() + 30
            while await router_snapshots(session, self.router) <= snaps and time.monotonic() < deadline:
                await asyncio.sleep(0.1)     # the router follows the new process before the turn goes
            self.before = await status(session, self.engines[self.replica])

    async def read(self, prompts: list[str]) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            self.after = await status(session, self.engines[self.replica])

    def result(self, gate: TurnGate) -> dict:
        d = {k: self.after.get(k, 0) - self.before.get(k, 0) for k in
             ("prefix_cache_queries", "prefix_cache_hits", "tier_cache_hits")}
        answers = gate.answers.get(self.turn, [])
        cached = sum(min(res.cached_tokens, self.held[p]) for p, res in answers if p in self.held and res.ok)
        return {"replica": self.replica, "conversations": self.conversations, "held_tokens": self.held_tokens,
                "served_tokens": d, "tier_tokens": d["tier_cache_hits"], "cached_tokens": cached,
                "of_held": cached / max(self.held_tokens, 1),
                "tier_of_prompt": d["tier_cache_hits"] / max(d["prefix_cache_queries"], 1)}


async def shared_tier_check(fleet: Fleet, engines: list[str], tok: PromptTokenizer, args) -> dict:
    """A conversation of its own on replica 1 (two turns), replica 1 stops (its pool goes to the shared
    directory), the next turn on replica 2: the share of the prefix replica 1 held (pool or tier) that
    replica 2 loaded."""
    rng = random.Random(f"{args.seed}-shared")
    system, exchanges = words(rng, args.system_words), []
    headers = {"x-consort-tenant": TENANT}
    policy = openai_stream.policy_of(args)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for turn in range(2):
            q = words(rng, 40)
            body = {"model": NAME, "prompt": completion_prompt(system, exchanges, q), "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            res = await request(session, engines[1] + "/v1/completions", body, headers, policy)
            if not res.ok:
                return {"ok": False, "error": res.error}
            exchanges.append((q, res.text))
        prompt = completion_prompt(system, exchanges, words(rng, 20))
        ids = tok.encode_head(prompt, 1 << 20, 0)
        hs = prefix_hashes(ids[:len(ids) - 1], BLOCK, NAME, None, prefix_salt(TENANT, None))
        first = depth(hs, await held(session, engines[1]))       # the prefix replica 1 computed
        await asyncio.to_thread(fleet.stop_engine, engines[1])
        before = await status(session, engines[2])
        files = {p.stem for p in Path(fleet.tmp, "tier").rglob("*.kvb")}   # what replica 1 left there
        on_disk = depth(hs, {h for h in hs if h.hex() in files})
        body = {"model": NAME, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        res = await request(session, engines[2] + "/v1/completions", body, headers, policy)
        after = await status(session, engines[2])
    loaded = after["tier_cache_hits"] - before["tier_cache_hits"]
    return {"ok": res.ok, "prefix_tokens": first * BLOCK, "on_disk_tokens": on_disk * BLOCK,
            "tier_tokens": loaded, "of_prefix": loaded / max(first * BLOCK, 1)}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(res: dict, args) -> str:
    arms = {r["arm"]: r for r in res["arms"]}
    model, flags = cpu_model_and_flags()
    lines = [f"KV fleet: {args.conversations} conversations x {args.turns} turns (completions, history resent), "
             f"system prompt {args.system_words} words, max_tokens {args.max_tokens}; 3 replicas of {REPLICA_THREADS} "
             f"thread; precise arms' "
             f"load_slack {'default' if args.load_slack is None else f'{args.load_slack:g}'}",
             f"  KV pool {res['pool_blocks']} blocks of {BLOCK} per replica; working set {res['working_set_blocks']} "
             f"blocks (measured: system prompt once + every conversation's last prompt and answer) = "
             f"{res['working_set_blocks'] / res['pool_blocks']:.1f}x one pool",
             f"  CPU: {model}; avx512f {'yes' if 'avx512f' in flags else 'no'}, amx_tile "
             f"{'yes' if 'amx_tile' in flags else 'no'} ({machine()})",
             f"  {'arm':<18} {'routers':>7} {'ok':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'out tok/s':>9} "
             f"{'pool hit':>8} {'tier hit':>8}  choices"]
    for r in res["arms"]:
        lines.append(f"  {r['arm']:<18} {r['routers']:>7} {r['ok']:>3}/{r['requests']:<3} "
                     f"{r['followup_ttft_p50_ms']:>7.0f}ms {r['followup_ttft_p90_ms']:>7.0f}ms "
                     f"{r['output_tokens'] / r['serving_s']:>9.1f} {100 * r['hit_rate']:>7.1f}% "
                     f"{100 * r['tier_hit_rate']:>7.1f}%  " + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
                     + "; TTFT p90 by turn " + " ".join(f"{v:.0f}" for v in r["ttft_p90_ms_by_turn"]) + " ms")
    a, t = arms["affinity"], arms["precise+tier"]
    ratio = a["followup_ttft_p90_ms"] / max(t["followup_ttft_p90_ms"], 1e-9)
    tput = (t["output_tokens"] / t["serving_s"]) / max(a["output_tokens"] / a["serving_s"], 1e-9)
    one, two = arms["precise"]["hit_rate"], arms["precise-2-routers"]["hit_rate"]
    rs, sh = res["restart"], res["shared"]
    lines += [
        f"  follow-up TTFT p90 affinity / precise+tier: {ratio:.2f}x (target >= 3x) {verdict(ratio >= 3)}; "
        f"throughput precise+tier / affinity {tput:.2f}x (target >= 1) {verdict(tput >= 1)}",
        f"  hit rate 2 routers {100 * two:.1f}% vs 1 router {100 * one:.1f}%: {100 * (two - one):+.1f} points "
        f"(target within 5) {verdict(abs(two - one) <= 0.05)}",
        f"  restart: replica {rs['replica']} held {rs['held_tokens']} prefix tokens of {rs['conversations']} conversations; their "
        f"next turn found {rs['cached_tokens']} of them cached: {100 * rs['of_held']:.1f}% (target >= 90%) "
        f"{verdict(rs['of_held'] >= 0.9)}; the new process loaded {rs['tier_tokens']} tokens from the tier that turn, "
        f"{100 * rs['tier_of_prompt']:.1f}% of all its prompt tokens",
        f"  shared tier: a conversation of replica 1 (stopped) continued on replica 2: {sh.get('tier_tokens', 0)} of "
        f"{sh.get('prefix_tokens', 0)} prefix tokens replica 1 held came from the tier ({100 * sh.get('of_prefix', 0):.1f}%, target "
        f">= 90%) {verdict(sh.get('of_prefix', 0) >= 0.9)}",
        "  (TTFT: follow-up turns; pool hit / tier hit: prompt tokens found in the engines' pools / loaded from "
        "the tier, over all prompt tokens of the arm; out tok/s: output tokens over the arm's serving time, the "
        "restart's pause excluded; ok: turns answered in full / sent)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="consort bench kv", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint dir: the engines are started on it")
    ap.add_argument("--quick", action="store_true", help="a small run (a few minutes on 2 cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    ap.add_argument("--load-slack", type=float, default=None, metavar="UNITS",
                    help="replica_choice.load_slack of the precise arms' routers (default: the router's, 4)")
    openai_stream.add_args(ap)
    args = ap.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        ap.error(f"--model {args.model}: no checkpoint there (no config.json; `consort demo-model DIR` writes one)")
    if args.load_slack is not None and not 0 <= args.load_slack <= 1e6:
        ap.error(f"--load-slack {args.load_slack:g}: queue-depth units from 0 to 1e6")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # a killed run stops its engines and routers too
    size = SIZES["quick" if args.quick else "full"]
    args.conversations, args.turns, args.system_words, args.max_tokens = \
        size.conversations, size.turns, size.system_words, size.max_tokens
    tok = PromptTokenizer.from_dir(args.model)
    pool = pool_blocks(size)
    print(f"bench: KV pool {pool} blocks per replica, working set about {working_set_blocks(size)} blocks",
          file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="consort-kv-bench-"))
    fleet = Fleet(args.model, tmp)
    # REPLICA_THREADS: otherwise the arms would measure the engines' oversubscription, not the routing
    base = ["--num-blocks", str(pool), "--block-size", str(BLOCK), "--threads", str(REPLICA_THREADS)]
    tier = [*base, "--kv-tier-path", str(tmp / "tier"), "--kv-tier-bytes", "2G"]
    try:
        plain = [fleet.engine(base) for _ in range(3)]
        tiered = [fleet.engine(tier) for _ in range(3)]
        slack = args.load_slack
        routers = {"affinity": [fleet.router(plain, False)], "precise": [fleet.router(plain, True, slack)],
                   "precise+tier": [fleet.router(tiered, True, slack)]}
        routers["precise-2-routers"] = [routers["precise"][0], fleet.router(plain, True, slack)]
        print(f"bench: starting 6 engines and 4 routers on {args.model} (logs in {tmp})", file=sys.stderr, flush=True)
        if not wait_ready(plain + tiered + [u for rs in routers.values() for u in rs], fleet.procs):
            print(f"bench: engines/routers did not become ready; logs in {tmp}", file=sys.stderr)
            return 1
        mid = size.turns // 2
        restart = RestartCheck(fleet, tiered, routers["precise+tier"][0], tok, mid)
        tier_gate = TurnGate(size.conversations, {mid: restart.restart, mid + 1: restart.read})
        results = []
        for arm in ARMS:
            engines = tiered if arm == "precise+tier" else plain
            gate = tier_gate if arm == "precise+tier" else None
            print(f"bench: arm {arm} ...", file=sys.stderr, flush=True)
            r = asyncio.run(run_arm(arm, routers[arm], engines, args, "completions", size.question_words, gate,
                                    size.in_flight, workload="kv", cache_salt=arm))
            print(f"bench: arm {arm}: {r['ok']}/{r['requests']} ok in {r['wall_s']:.0f} s, pool hit "
                  f"{100 * r['hit_rate']:.1f}%, tier hit {100 * r['tier_hit_rate']:.1f}%"
                  + "".join(f"; {e}" for e in r["error_samples"]), file=sys.stderr, flush=True)
            results.append(r)
        if not restart.after:          # the read gate comes after the last turn (turns < 3)
            asyncio.run(restart.read([]))
        print("bench: shared tier check ...", file=sys.stderr, flush=True)
        shared = asyncio.run(shared_tier_check(fleet, tiered, tok, args))
        ws = max(int((TOKENS_PER_WORD * args.system_words + sum(
            t - TOKENS_PER_WORD * args.system_words for t in r["last_prompt_tokens"])) / BLOCK) for r in results)
        res = {"pool_blocks": pool, "working_set_blocks": ws, "arms": results, "restart": restart.result(tier_gate),
               "shared": shared}
        print(report(res, args))
        if args.json:
            print(json.dumps(res, indent=2))
        return 0
    finally:
        stop_all(fleet.procs)
        shutil.rmtree(tmp / "tier", ignore_errors=True)    # the logs stay; the tier's blocks (up to 2 GB) go


if __name__ == "__main__":
    sys.exit(main())
