"""`consort bench local`: does one box serve its whole ensemble as fast as it serves one engine?

Two phases on the same cores, the same streaming load per specialist (`--concurrency` streams of
`--prompt-words`-word prompts and `--max-tokens` new tokens, `--requests` per specialist):

1. alone: each Specialist's engine by itself, started as `consort up` would start it but given
   every core (the most one engine gets out of this box), loaded straight, without a router;
2. together: the whole ensemble (`consort up -f FILES`, started here, or a running one with
   `--url`), every specialist loaded at once through the router, pinned by `model`.

The ratio of the aggregate output tok/s together to the mean of the engines alone says whether
the engines, the router and the client share the cores (near or above 1) or fight over them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from consort_common import openai_stream
from consort_common.help import HelpFormatter
from consort_engine.bench.serve import http_url, make_workload, one_request, summarize

from . import local


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(url: str, model: str | None, args: argparse.Namespace, seed: int, requests: int | None = None) -> dict:
    """`requests` streaming completions, at most `--concurrency` in flight; bench serve's summary."""
    import aiohttp

    work = make_workload(requests or args.requests, (args.prompt_words,) * 2, (args.max_tokens,) * 2, seed)
    sem = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    policy = openai_stream.policy_of(args)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(prompt: str, n: int):
            async with sem:
                return await one_request(session, url, model, prompt, n, "completions", True, policy)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in work))
        return summarize(results, time.perf_counter() - t0)


async def load_all(url: str, names: list[str], args: argparse.Namespace) -> tuple[dict[str, dict], float]:
    """Every specialist under load at once; the wall time of the whole phase."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(load(url, n, args, 100 + i) for i, n in enumerate(names)))
    return dict(zip(names, runs)), time.perf_counter() - t0


def alone(m: local.Manifests, name: str, args: argparse.Namespace, run_dir: Path, say: Any) -> dict:
    """One Specialist's engine by itself with every core: its `consort up` argv, --threads raised."""
    one = local.Manifests(specialists={name: m.specialists[name]})
    up_args = argparse.Namespace(engine_base_port=0, replicas=1, cache=args.cache)
    child = local.plan_engines(one, up_args, run_dir, lambda _msg: None)[0]
    cores = len(os.sched_getaffinity(0))
    child.argv[child.argv.index("--threads") + 1] = str(cores)
    child.cpus = None
    local.start(child)
    try:
        deadline = time.monotonic() + args.start_timeout
        while not (child.discover_url() and local.http_ok(child.url + "/ready")):
            if child.popen.poll() is not None or time.monotonic() > deadline:
                raise local.UpError(f"{child.name} alone did not get ready; last lines of {child.log_path}:\n"
                                    f"{local.tail(child.log_path)}")
            time.sleep(0.25)
        asyncio.run(load(child.url, None, args, 99, requests=args.concurrency))   # warm-up
        r = asyncio.run(load(child.url, None, args, 0))
        say(f"  {name} alone ({cores} threads, straight at the engine): {r['output_tokens_per_s']:.1f} tok/s")
        return r
    finally:
        local.stop_all([child])


class Ensemble:
    """`consort up -f FILES` on free ports, started and stopped here."""

    def __init__(self, files: list[str], run_dir: Path, timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = run_dir / "up.log"
        argv = [sys.executable, "-m", "consort_common.cli", "up", "--port", str(self.port),
                "--engine-base-port", "0", "--run-dir", str(run_dir / "up")]
        for f in files:
            argv += ["-f", f]
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while "ready:" not in self.log_path.read_text(errors="replace"):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise local.UpError(f"consort up did not get ready; its log:\n{local.tail(self.log_path)}")
            time.sleep(0.5)

    def plan_line(self) -> str:
        return next((ln.split("] ", 1)[-1] for ln in self.log_path.read_text().splitlines() if "CPU plan" in ln), "")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def run(args: argparse.Namespace) -> dict:
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    m = local.load_manifests(args.file)
    names = sorted(args.specialist or m.specialists)
    if unknown := sorted(set(names) - set(m.specialists)):
        raise local.UpError(f"no Specialist {', '.join(unknown)} in {', '.join(args.file)} "
                            f"(it has {', '.join(sorted(m.specialists))})")
    run_dir = Path(tempfile.mkdtemp(prefix="consort-bench-local-"))
    say(f"bench local: specialists {', '.join(names)} on {len(os.sched_getaffinity(0))} cores; per specialist "
        f"{args.requests} streaming requests, {args.concurrency} at a time, {args.prompt_words}-word prompts, "
        f"{args.max_tokens} new tokens; logs in {run_dir}")
    solo = {n: alone(m, n, args, run_dir, say) for n in names}
    ensemble = None if args.url else Ensemble(args.file, run_dir, args.start_timeout)
    try:
        url = args.url.rstrip("/") if args.url else ensemble.url
        plan = ensemble.plan_line() if ensemble else "(a running consort up)"
        say(f"  ensemble at {url}: {plan}")
        asyncio.run(load_all(url, names, argparse.Namespace(**{**vars(args), "requests": args.concurrency})))
        together, wall = asyncio.run(load_all(url, names, args))
    finally:
        if ensemble is not None:
            ensemble.stop()
    tokens = sum(s["output_tokens"] for s in together.values())
    mean_alone = sum(s["output_tokens_per_s"] for s in solo.values()) / len(solo)
    return {"specialists": names, "cores": len(os.sched_getaffinity(0)), "plan": plan, "alone": solo,
            "together": together, "aggregate_tok_s": tokens / wall, "mean_alone_tok_s": mean_alone,
            "ratio": tokens / wall / mean_alone if mean_alone else 0.0,
            "failures": sum(s["requests"] - s["ok"] for s in [*solo.values(), *together.values()])}


def report(r: dict) -> str:
    lines = ["", f"=== consort bench local ({r['cores']} cores) ===",
             f"| specialist | alone, all cores (tok/s) | together, via router (tok/s) | TTFT p50 together |",
             "|---|---:|---:|---:|"]
    for n in r["specialists"]:
        a, t = r["alone"][n], r["together"][n]
        lines.append(f"| {n} | {a['output_tokens_per_s']:.0f} | {t['output_tokens_per_s']:.0f} | "
                     f"{t['ttft_s']['p50'] * 1000:.0f} ms |")
    lines += [f"| **one engine alone (mean) vs all at once (aggregate)** | {r['mean_alone_tok_s']:.0f} | "
              f"{r['aggregate_tok_s']:.0f} | **{r['ratio']:.2f}x** |"]
    if r["failures"]:
        lines.append(f"failures: {r['failures']} (429/503 after their Retry-After retries, error events, "
                     "timeouts, other failures)")
        for phase in ("alone", "together"):
            for n in r["specialists"]:
                if r[phase][n]["ok"] < r[phase][n]["requests"]:
                    lines.append(f"  {n} {phase}: {openai_stream.describe(r[phase][n]['outcomes'])}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort bench local", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("-f", "--file", action="append", metavar="PATH",
                   help="manifests, as for `consort up`; unset: examples/local")
    p.add_argument("--url", default=None, type=http_url,
                   help="the router of a running `consort up` with the same manifests; unset: start one here")
    p.add_argument("--specialist", action="append", help="a specialist to load (repeatable); unset: all")
    p.add_argument("--concurrency", type=int, default=12, help="streams per specialist")
    p.add_argument("--requests", type=int, default=96, help="requests per specialist and phase")
    p.add_argument("--prompt-words", type=int, default=300,
                   help="prompt length, words (300: ~400 tokens on the demo tokenizer)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request (ignore_eos)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--start-timeout", type=float, default=240.0, help="seconds for engines / consort up to be ready")
    p.add_argument("--cache", type=Path, default=local.CACHE, help="demo models (as for `consort up`)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    openai_stream.add_args(p)
    args = p.parse_args(argv)
    args.file = args.file or [str(Path(__file__).resolve().parents[2] / "examples" / "local")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        r = run(args)
    except local.UpError as e:
        print(f"consort bench local: {e}", file=sys.stderr)
        return 1
    print(report(r))
    if args.json:
        print(json.dumps(r))
    return 0 if r["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
