"""`consort bench serve`: streaming latency/throughput against any OpenAI-compatible endpoint.

Sends `--requests` streaming requests with at most `--concurrency` in flight and reports TTFT,
ITL and end-to-end latency percentiles plus output-token throughput. Prompts are random words
(seeded) so any server can tokenize them; lengths are in words, roughly tokens for most tokenizers.
Requests the server does not answer in full (429/503 rejections after their Retry-After retries,
typed error events, idle timeouts, other failures) are counted by outcome, never fatal
(openai_stream.py); the exit status is 1 when none was answered.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter

from consort_common import openai_stream
from consort_common.openai_stream import ClientPolicy, StreamResult, describe, request, tally

WORDS = ("int", "auto", "template", "typename", "std", "vector", "const", "return", "class", "struct",
         "constexpr", "noexcept", "static", "void", "while", "for", "if", "else", "namespace", "using",
         "size_t", "unique_ptr", "shared_ptr", "move", "forward", "lambda", "capture", "thread", "mutex",
         "atomic", "iterator", "begin", "end", "operator", "virtual", "override", "delete", "new", "value")


def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default), p in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_len))), rng.randint(*output_len))
            for _ in range(n)]


async def one_request(session, url: str, model: str | None, prompt: str, max_tokens: int, endpoint: str,
                      ignore_eos: bool, policy: ClientPolicy = ClientPolicy()) -> StreamResult:
    """One streaming request; its outcome classified, never raised (openai_stream.py)."""
    body: dict = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    return await request(session, url + path, body, policy=policy)


async def discover_model(session, url: str) -> str | None:
    try:
        async with session.get(url + "/v1/models") as r:
            data = await r.json()
            return data["data"][0]["id"]
    except Exception:  # noqa: BLE001 - servers without /v1/models: send no model
        return None


async def run(args: argparse.Namespace) -> dict:
    import aiohttp

    url = args.url.rstrip("/")
    work = make_workload(args.requests, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                         args.seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    policy = openai_stream.policy_of(args)
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        model = args.model or await discover_model(session, url)
        sem = asyncio.Semaphore(args.concurrency)
        done = 0
        t_start = time.perf_counter()

        async def task(prompt: str, n: int) -> StreamResult:
            nonlocal done
            async with sem:
                r = await one_request(session, url, model, prompt, n, args.endpoint, not args.no_ignore_eos, policy)
            done += 1
            if done % max(1, args.requests // 10) == 0 or done == args.requests:
                print(f"  {done}/{args.requests} requests done ({time.perf_counter() - t_start:.1f} s)", flush=True)
            return r

        print(f"bench serve: {args.requests} streaming requests to {url} (model {model}), concurrency "
              f"{args.concurrency}, prompt {args.prompt_min}-{args.prompt_max} words, output "
              f"{args.output_min}-{args.output_max} tokens", flush=True)
        results = await asyncio.gather(*(task(p, n) for p, n in work))
        wall = time.perf_counter() - t_start
    return summarize(results, wall)


def summarize(results: list[StreamResult], wall: float) -> dict:
    """Latency and throughput of the answered requests; the others counted by outcome (`outcomes`) and
    by cause (`failures`: `STATUS error-code` for an HTTP answer, else the error event's code, the
    timeout or the exception)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itls]
    e2e = [r.e2e for r in ok]
    out_tokens = sum(r.completion_tokens or r.chunks for r in ok)
    failures = Counter(f"{r.status} {r.error}"[:80] if r.status not in (0, 200) else r.error.split(":")[0]
                       for r in results if not r.ok)
    pct = lambda xs: {f"p{p}": percentile(xs, p) for p in (50, 90, 99)}  # noqa: E731
    return {"requests": len(results), "ok": len(ok), "outcomes": tally(results), "failures": dict(failures),
            "wall_s": wall,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
            "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
            "ttft_s": pct(ttft), "itl_s": pct(itl), "e2e_s": pct(e2e),
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else float("nan"),
            "mean_itl_s": sum(itl) / len(itl) if itl else float("nan")}


def report(s: dict) -> str:
    ms = lambda d: "  ".join(f"{k} {v * 1000:8.1f} ms" for k, v in d.items())  # noqa: E731
    lines = ["", "=== consort bench serve ===",
             f"requests      {s['ok']}/{s['requests']} ok" + (f"  failures {s['failures']}" if s["failures"] else ""),
             f"outcomes      {describe(s['outcomes'])}",
             f"wall          {s['wall_s']:.2f} s",
             f"throughput    {s['output_tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s "
             f"({s['output_tokens']} tokens)",
             f"TTFT          {ms(s['ttft_s'])}   mean {s['mean_ttft_s'] * 1000:.1f} ms",
             f"ITL           {ms(s['itl_s'])}   mean {s['mean_itl_s'] * 1000:.1f} ms",
             f"E2E           {ms(s['e2e_s'])}"]
    return "\n".join(lines)


def http_url(text: str) -> str:
    """argparse type: an http(s) server URL (a typo fails at parsing, not as N failed requests). The
    OpenAI client's base_url habit, `http://host:port/v1`, names the same server: the benchmarks add
    /v1/... themselves, so a trailing /v1 is dropped rather than doubled into 404s."""
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text.rstrip("/").removesuffix("/v1")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, type=http_url,
                   help="the server, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model field; unset: the first id of GET /v1/models")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="POST /v1/completions or /v1/chat/completions")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=256, help="requests in all")
    p.add_argument("--prompt-min", type=int, default=64, help="shortest prompt, words (drawn uniformly)")
    p.add_argument("--prompt-max", type=int, default=512, help="longest prompt, words")
    p.add_argument("--output-min", type=int, default=16, help="fewest max_tokens (drawn uniformly)")
    p.add_argument("--output-max", type=int, default=128, help="most max_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send the ignore_eos extension")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    openai_stream.add_args(p)


def main(args: argparse.Namespace) -> int:
    summary = asyncio.run(run(args))
    print(report(summary))
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1
