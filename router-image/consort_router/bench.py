"""Router added-latency benchmark: `python -m consort_router.bench --model DIR` (or `--engine-url URL`).

Starts (or uses) one real engine and a real `consort router` in front of it, then runs rounds of
`--streams` concurrent streaming completions, alternating direct-to-engine and through-the-router
rounds so both arms see the same engine state. Reports, per arm, time to first token (first SSE
content chunk) p50/p99 and the difference; the router's own overhead histogram (arrival -> upstream
send + first-chunk relay, from its /metrics); and router CPU seconds per request (from /proc).
Requests not answered in full are counted per arm by outcome (openai_stream.py), never fatal.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from consort_common import openai_stream
from consort_common.openai_stream import ClientPolicy, StreamResult, describe, request, tally

WORDS = ("int", "auto", "template", "typename", "std", "vector", "const", "return", "class", "struct",
         "constexpr", "noexcept", "static", "void", "while", "for", "namespace", "using", "size_t")


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def cpu_list(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict,
              policy: ClientPolicy = ClientPolicy()) -> StreamResult:
    """One streaming completion, its outcome classified (openai_stream.py): TTFT is the first content chunk."""
    return await request(session, url, body, headers, policy)


def bodies(n: int, model: str, max_tokens: int, rng: random.Random) -> list[dict]:
    return [{"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 48))),
             "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True} for _ in range(n)]


async def mixed_round(session, engine_url: str, router_url: str, streams: int, model: str, max_tokens: int,
                      rng: random.Random, policy: ClientPolicy = ClientPolicy(),
                      ) -> tuple[list[StreamResult], list[StreamResult]]:
    """`streams` concurrent streams, half straight to the engine and half through the router, launched in
    a shuffled order, so both arms share the same engine steps (a paired comparison)."""
    arms = ["direct"] * (streams // 2) + ["routed"] * (streams - streams // 2)
    rng.shuffle(arms)
    tasks = []
    for arm, body in zip(arms, bodies(streams, model, max_tokens, rng)):
        if arm == "direct":
            tasks.append(one(session, engine_url + "/v1/completions", body, {}, policy))
        else:
            tasks.append(one(session, router_url + "/v1/completions", {**body, "model": "ens"},
                             {"x-consort-intent": "bench"}, policy))
    res = await asyncio.gather(*tasks)
    return ([r for a, r in zip(arms, res) if a == "direct"], [r for a, r in zip(arms, res) if a == "routed"])


async def closed_phase(session, base_url: str, arm: str, streams: int, per_stream: int, model: str,
                       max_tokens: int, rng: random.Random, policy: ClientPolicy = ClientPolicy(),
                       ) -> list[StreamResult]:
    """`streams` closed-loop clients, each sending `per_stream` requests back to back (arrivals spread
    over the engine's steps, as under steady load)."""
    headers = {"x-consort-intent": "bench"} if arm == "routed" else {}
    name = "ens" if arm == "routed" else model

    async def worker(k: int) -> list[StreamResult]:
        await asyncio.sleep(0.002 * k)  # stagger the start
        out = []
        for b in bodies(per_stream, name, max_tokens, random.Random(rng.random())):
            out.append(await one(session, base_url + "/v1/completions", b, headers, policy))
        return out

    res = await asyncio.gather(*(worker(k) for k in range(streams)))
    return [x for r in res for x in r]


def scrape(metrics_text: str, name: str) -> dict[float, float]:
    """Cumulative histogram buckets {le: count} of an unlabelled histogram."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_percentile(buckets: dict[float, float], p: float) -> float:
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return float("nan")
    want = total * p / 100.0
    for le in sorted(buckets):
        if buckets[le] >= want:
            return le
    return float("inf")


async def run(args: argparse.Namespace, engine_url: str, router_url: str, router_pid: int, model: str) -> dict:
    rng = random.Random(args.seed)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    policy = openai_stream.policy_of(args)
    direct: list[StreamResult] = []
    routed: list[StreamResult] = []
    cpu = 0.0
    n_routed = 0
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await mixed_round(session, engine_url, router_url, min(16, args.streams), model, 4, rng, policy)  # warm up
        async with session.get(router_url + "/metrics") as r:
            base_metrics = await r.text()
        for i in range(args.rounds):
            c0 = cpu_seconds(router_pid)
            if args.design == "closed":  # 64 closed-loop streams per arm, ABBA phases
                d, r_ = [], []
                for arm in (("direct", "routed") if i % 2 == 0 else ("routed", "direct")):
                    r0 = cpu_seconds(router_pid)
                    res = await closed_phase(session, engine_url if arm == "direct" else router_url, arm,
                                             args.streams, args.per_stream, model, args.max_tokens, rng, policy)
                    if arm == "direct":
                        d = res
                    else:
                        r_ = res
                        cpu += cpu_seconds(router_pid) - r0
                c0 = cpu_seconds(router_pid)
            elif args.design == "mixed":
                d, r_ = await mixed_round(session, engine_url, router_url, args.streams, model, args.max_tokens, rng,
                                          policy)
            else:  # alternate: whole rounds per arm, in ABBA order
                d, r_ = [], []
                for arm in (("direct", "routed") if i % 2 == 0 else ("routed", "direct")):
                    n = args.streams
                    if arm == "direct":
                        d = await asyncio.gather(*(one(session, engine_url + "/v1/completions", b, {}, policy)
                                                   for b in bodies(n, model, args.max_tokens, rng)))
                    else:
                        r0 = cpu_seconds(router_pid)
                        r_ = await asyncio.gather(*(one(session, router_url + "/v1/completions", {**b, "model": "ens"},
                                                        {"x-consort-intent": "bench"}, policy)
                                                    for b in bodies(n, model, args.max_tokens, rng)))
                        cpu += cpu_seconds(router_pid) - r0
                c0 = cpu_seconds(router_pid)  # alternate: CPU counted on routed rounds only
            cpu += cpu_seconds(router_pid) - c0
            n_routed += len(r_)
            direct += d
            routed += r_
        async with session.get(router_url + "/metrics") as r:
            metrics = await r.text()
    b0 = scrape(base_metrics, "consort_router_overhead_seconds")
    b1 = scrape(metrics, "consort_router_overhead_seconds")
    over = {le: b1.get(le, 0) - b0.get(le, 0) for le in b1}
    d_ttft = [s.ttft for s in direct if s.ok and s.ttft is not None]
    r_ttft = [s.ttft for s in routed if s.ok and s.ttft is not None]
    return {
        "streams": args.streams, "rounds": args.rounds, "max_tokens": args.max_tokens, "design": args.design,
        "direct": {**tally(direct), "ttft_p50_ms": 1e3 * percentile(d_ttft, 50),
                   "ttft_p99_ms": 1e3 * percentile(d_ttft, 99)},
        "router": {**tally(routed), "ttft_p50_ms": 1e3 * percentile(r_ttft, 50),
                   "ttft_p99_ms": 1e3 * percentile(r_ttft, 99)},
        "added_ttft_p50_ms": 1e3 * (percentile(r_ttft, 50) - percentile(d_ttft, 50)),
        "added_ttft_p99_ms": 1e3 * (percentile(r_ttft, 99) - percentile(d_ttft, 99)),
        "router_overhead_p50_ms_le": 1e3 * bucket_percentile(over, 50),
        "router_overhead_p99_ms_le": 1e3 * bucket_percentile(over, 99),
        "router_cpu_ms_per_request": 1e3 * cpu / max(n_routed, 1),
    }


def report(res: dict) -> str:
    d, r = res["direct"], res["router"]
    lines = [
        f"router added latency: {res['rounds']} rounds of {res['streams']} concurrent streams, design "
        f"{res['design']}, max_tokens {res['max_tokens']}",
        f"  direct  TTFT p50 {d['ttft_p50_ms']:8.2f} ms  p99 {d['ttft_p99_ms']:8.2f} ms  ({describe(d)})",
        f"  router  TTFT p50 {r['ttft_p50_ms']:8.2f} ms  p99 {r['ttft_p99_ms']:8.2f} ms  ({describe(r)})",
        f"  added   TTFT p50 {res['added_ttft_p50_ms']:+8.2f} ms  p99 {res['added_ttft_p99_ms']:+8.2f} ms "
        f"(goal p50 <= 1 ms, p99 <= 5 ms)",
        f"  router's own overhead (arrival -> upstream send + first-chunk relay): p50 <= "
        f"{res['router_overhead_p50_ms_le']:.2f} ms, p99 <= {res['router_overhead_p99_ms_le']:.2f} ms (histogram bucket)",
        f"  router CPU per request: {res['router_cpu_ms_per_request']:.3f} ms",
    ]
    return "\n".join(lines)


CONSORT = str(Path(sys.executable).with_name("consort"))


# Threads of each engine when a benchmark runs several replicas on one machine: every replica a one-CPU
# pod. OpenMP threads wait actively, so engines whose threads outnumber the cores spin on each other's
# (three two-thread engines on two cores: 10.6 against 84 tok/s).
REPLICA_THREADS = 1


def start_engine(model: str, name: str, extra_args: list[str], logdir: Path, cpus: str | None = None,
                 port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A `consort engine` on `port` (default: a free loopback port), pinned to `cpus` with its threads
    set to match."""
    port = port or free_port()
    env = dict(os.environ)
    pin: list[str] = []
    if cpus:
        pin = ["taskset", "-c", cpus]
        env["OMP_NUM_THREADS"] = str(len(cpu_list(cpus)))
    p = subprocess.Popen([*pin, CONSORT, "engine", "--model", model, "--port", str(port), "--name", name,
                          *extra_args], env=env, stdout=open(logdir / f"engine-{port}.log", "a"),
                         stderr=subprocess.STDOUT)
    return p, f"http://127.0.0.1:{port}"


def router_config(lanes: dict[str, list[str]], default: str, **over) -> dict:
    """A benchmark router: the given lanes (name -> replica urls), no classifier, shadow, verifier or
    breaker warm-up; `over` replaces top-level sections."""
    cfg = {"ensemble": "ens", "specialists": [{"name": n, "replicas": urls, "intents": ["bench"] if n == default
                                               else []} for n, urls in lanes.items()],
           "classifier": {"kind": "none"}, "default_specialist": default,
           "verifier": {"enabled": False}, "shadow": {"enabled": False}, "breaker": {"fresh_samples": 0},
           "store": {"kind": "none"}}
    cfg.update(over)
    return cfg


def start_router(cfg: dict, logdir: Path, cpus: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = logdir / f"router-{port}.json"
    path.write_text(json.dumps(cfg))
    pin = ["taskset", "-c", cpus] if cpus else []
    p = subprocess.Popen([*pin, CONSORT, "router", "--config", str(path), "--port", str(port)],
                         stdout=open(logdir / f"router-{port}.log", "w"), stderr=subprocess.STDOUT)
    return p, f"http://127.0.0.1:{port}"


def wait_ready(urls: list[str], procs: list[subprocess.Popen], timeout_s: float = 600) -> bool:
    """Every url's /ready answers 200 (False when a process exits or time runs out)."""
    import urllib.request
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        try:
            with urllib.request.urlopen(pending[0] + "/ready", timeout=2) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except OSError:
            pass
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.2)
    return True


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m consort_router.bench", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint dir: start a `consort engine` on it")
    src.add_argument("--engine-url", help="an already running engine")
    ap.add_argument("--engine-name", default="bench", help="specialist name of the engine")
    ap.add_argument("--engine-args", default="--num-blocks 1024",
                    help="extra `consort engine` arguments (one string)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--design", choices=["closed", "alternate", "mixed"], default="closed",
                    help="closed: `--streams` closed-loop clients per arm, ABBA phases (steady load); alternate: "
                    "bursts of `--streams` simultaneous requests per arm; mixed: bursts split half/half")
    ap.add_argument("--per-stream", type=int, default=4, help="closed design: requests per client per phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-cpus", default=None, help="pin the engine (taskset list, e.g. 0); sets its threads")
    ap.add_argument("--router-cpus", default=None, help="pin the router (taskset list, e.g. 1)")
    ap.add_argument("--client-cpus", default=None, help="pin this load generator (e.g. 1)")
    ap.add_argument("--json", action="store_true", help="print the JSON result too")
    openai_stream.add_args(ap)
    args = ap.parse_args(argv)
    if args.client_cpus:
        os.sched_setaffinity(0, cpu_list(args.client_cpus))

    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="consort-router-bench-"))
    try:
        if args.model:
            ep, engine_url = start_engine(args.model, args.engine_name, args.engine_args.split(), tmp, args.engine_cpus)
            procs.append(ep)
        else:
            engine_url = args.engine_url.rstrip("/")
        rp, router_url = start_router(router_config({args.engine_name: [engine_url]}, args.engine_name), tmp,
                                      args.router_cpus)
        procs.append(rp)
        if not wait_ready([router_url], procs):
            print(f"bench: engine/router did not become ready; logs in {tmp}", file=sys.stderr)
            return 1
        res = asyncio.run(run(args, engine_url, router_url, rp.pid, args.engine_name))
        print(report(res))
        if args.json:
            print(json.dumps(res, indent=2))
        return 0
    finally:
        stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())
