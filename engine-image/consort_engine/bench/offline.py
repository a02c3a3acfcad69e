"""`consort bench offline`: our LLMEngine vs transformers `generate` (static batches of 16), one run.

Same checkpoint (tiny Llama: hidden 512, 8 layers, 8 heads / 4 KV heads, FFN 1408, vocab 32000,
random weights, seed 0; cached under ~/.cache/consort/bench-model), same workload (64 requests,
prompt lengths U[64, 512], output lengths U[16, 128], seeded; greedy; EOS ignored). Also reports
the share of decode-step time outside the model forward at 32 running sequences, TTFT with 1,024
cached prefix tokens + 32 new vs uncached, and `consort engine` start-up to /ready 200.

torch and transformers are imported inside functions: `consort bench --help` and the engine itself
never pay for them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from consort_engine.bench import BenchError
from consort_engine.config import checkpoint_dir
from consort_engine.model.cpu import apply_threads
from consort_engine.bench.workload import BENCH_SPEC, HF_BATCH, TOKEN_LOW, Workload, bench_model, log, make_workload


@contextmanager
def ticker(label: str, progress, every: float = 5.0):
    """Prints progress() every `every` seconds while the body runs."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def run():
        while not stop.wait(every):
            log(f"  {label}: {progress()} ({time.perf_counter() - t0:.0f} s)")

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


# ---------------------------------------------------------------------------------------------
# our engine


def server_argv(model_dir: Path, dtype: str, args: argparse.Namespace) -> list[str]:
    """The `consort engine` flags this benchmark's settings stand for: the offline run and the HTTP
    server are built from the same argv, so they cannot drift apart (they did: see docs/engine-speed.md)."""
    argv = ["--model", str(model_dir), "--port", "0", "--name", "bench", "--dtype", dtype,
            "--device", args.device, "--block-size", str(args.block_size),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--speculative", args.speculative, "--quantization", getattr(args, "quantization", "none"),
            "--kv-cache-dtype", getattr(args, "kv_cache_dtype", "auto")]
    if args.num_blocks:
        argv += ["--num-blocks", str(args.num_blocks)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def engine_config(model_dir: Path, dtype: str, args: argparse.Namespace):
    """Exactly the EngineConfig `consort engine <server_argv>` builds (server.config_from_args)."""
    from consort_engine.serving.cli import config_from_args, parse_args
    return config_from_args(parse_args(server_argv(model_dir, dtype, args)))


def run_engine(model_dir: Path, dtype: str, wl: Workload, args: argparse.Namespace, extras: bool = True) -> dict:
    from consort_engine.core.engine import LLMEngine, freeze_heap
    from consort_engine.kv.sequence import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config(model_dir, dtype, args))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - t0
    freeze_heap()        # as the server does once warm; undone below, before the next engine
    graphs = getattr(engine.runner, "decode_graphs", None)
    log(f"engine[{dtype}]: loaded in {load_s:.2f} s, warmed up in {warm_s:.2f} s; "
        f"{engine.block_manager.num_blocks} KV blocks"
        + (f", {len(graphs.graphs)} decode CUDA graphs" if graphs else ""))
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **sampling(args, i)) for i, n in enumerate(wl.output_lens)]
    t0, cpu0 = time.perf_counter(), time.process_time()
    with ticker(f"engine[{dtype}]", lambda: f"{engine.num_steps} steps"):
        outs = engine.generate(wl.prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    got = [len(o) for o in outs]
    if got != wl.output_lens:
        raise RuntimeError(f"engine produced {sum(got)} tokens, wanted {wl.useful_tokens}")
    res = {"wall_s": wall, "useful_tokens": wl.useful_tokens, "generated_tokens": sum(got),
           "tok_s": wl.useful_tokens / wall, "cpu_s": cpu, "steps": engine.num_steps, "load_s": load_s, "warmup_s": warm_s,
           "preemptions": engine.stats().get("num_preemptions", 0), "speculation": engine.stats()["speculation"]}
    log(f"engine[{dtype}]: {wl.useful_tokens} tokens in {wall:.2f} s = {res['tok_s']:.1f} tok/s "
        f"({engine.num_steps} steps)")
    if extras:
        res["overhead"] = decode_overhead(engine, args)
        res["prefix_ttft"] = prefix_ttft(engine, args)
    del engine
    gc.unfreeze()
    free_memory()
    return res


def decode_overhead(engine, args: argparse.Namespace, running: int = 32, prompt_len: int = 128,
                    steps: int = 40) -> dict:
    """Share of decode-step time outside runner.execute with `running` sequences in decode."""
    from consort_engine.kv.sequence import SamplingParams, Sequence

    rng = random.Random(1)
    vocab = BENCH_SPEC["vocab_size"]
    seqs = [Sequence([rng.randrange(TOKEN_LOW, vocab) for _ in range(prompt_len)],
                     SamplingParams(temperature=0.0, max_tokens=(steps + 16) * engine.scheduler.decode_span + 64,
                                    ignore_eos=True)) for _ in range(running)]
    for s in seqs:
        engine.add_request(s)
    guard = 0
    decode_modes = ("decode", "spec_verify")     # a speculating engine's decode steps verify drafts
    while not (engine.last_batch is not None and engine.last_batch.mode in decode_modes
               and len(engine.last_batch) == running):
        engine.step()
        guard += 1
        if guard > 10_000:
            raise RuntimeError("sequences never reached a full decode batch")
    runner = engine.runner
    inner = runner.execute
    spent = [0.0]

    def timed(batch, *a, **kw):
        t = time.perf_counter()
        try:
            return inner(batch, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    runner.execute = timed
    total = 0.0
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t
            assert len(engine.last_batch) == running and engine.last_batch.mode in decode_modes
    finally:
        del runner.execute          # back to the bound method
        for s in seqs:
            engine.abort(s.seq_id)
    share = (total - spent[0]) / total
    res = {"running": running, "steps": steps, "step_ms": 1000 * total / steps,
           "forward_ms": 1000 * spent[0] / steps, "outside_share": share}
    log(f"  decode overhead @{running} running: step {res['step_ms']:.2f} ms, inside runner.execute "
        f"{res['forward_ms']:.2f} ms -> {100 * share:.1f}% outside the forward")
    return res


def _ttft(engine, prompt: list[int]) -> float:
    from consort_engine.kv.sequence import SamplingParams, Sequence

    seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    engine.add_request(seq)
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - t0


def prefix_ttft(engine, args: argparse.Namespace, prefix_len: int = 1024, new: int = 32, reps: int = 5) -> dict:
    """TTFT of (1,024 cached prefix tokens + 32 new) vs the same length uncached (medians)."""
    rng = random.Random(2)
    vocab = BENCH_SPEC["vocab_size"]
    rand = lambda n: [rng.randrange(TOKEN_LOW, vocab) for _ in range(n)]  # noqa: E731
    prefix = rand(prefix_len)
    _ttft(engine, prefix + rand(new))             # fills the prefix cache
    q0, h0 = engine.block_manager.prefix_queries, engine.block_manager.prefix_hits
    cached = [_ttft(engine, prefix + rand(new)) for _ in range(reps)]
    hits = engine.block_manager.prefix_hits - h0
    queries = engine.block_manager.prefix_queries - q0
    uncached = [_ttft(engine, rand(prefix_len + new)) for _ in range(reps)]
    c, u = statistics.median(cached), statistics.median(uncached)
    res = {"cached_ms": 1000 * c, "uncached_ms": 1000 * u, "ratio": c / u, "prefix_hits": hits,
           "prefix_queries": queries}
    log(f"  TTFT 1024 cached + 32 new: {res['cached_ms']:.1f} ms vs uncached {res['uncached_ms']:.1f} ms "
        f"-> ratio {res['ratio']:.3f} (prefix-cache hits {hits}/{queries} during the cached runs)")
    return res


# ---------------------------------------------------------------------------------------------
# transformers baseline


def free_memory() -> None:
    """Between runs: the next engine sizes its pool from free memory (cudaMemGetInfo on CUDA), so the
    last one's cached CUDA blocks go back too."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_hf(model_dir: Path, dtype: str, wl: Workload, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t0 = time.perf_counter()
    device = torch.device(getattr(args, "device", "cpu"))       # the engine's device: side by side on it
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval().to(device)
    model.generation_config.eos_token_id = None     # ignore EOS: every row runs max_new_tokens
    model.generation_config.pad_token_id = 0
    log(f"transformers[{dtype}]: loaded on {device} in {time.perf_counter() - t0:.2f} s "
        f"(attn {getattr(model.config, '_attn_implementation', '?')})")

    def batch_generate(prompts: list[list[int]], max_new: int):
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):        # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            drawn = sampling(args, 0)
            how = ({"do_sample": True, "temperature": drawn["temperature"], "top_p": drawn["top_p"]}
                   if drawn["temperature"] else {"do_sample": False})
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=0, **how)
        return out.shape[1] - width

    batch_generate([wl.prompts[0][:16]] * 2, 4)   # warm-up, not timed
    done = [0]
    generated = 0
    t0 = time.perf_counter()
    with ticker(f"transformers[{dtype}]", lambda: f"batch {done[0]}/{-(-len(wl.prompts) // HF_BATCH)}"):
        for b in range(0, len(wl.prompts), HF_BATCH):
            prompts, outs = wl.prompts[b:b + HF_BATCH], wl.output_lens[b:b + HF_BATCH]
            new = batch_generate(prompts, max(outs))
            if new != max(outs):
                raise RuntimeError(f"transformers generated {new} tokens per row, wanted {max(outs)}")
            generated += new * len(prompts)
            done[0] += 1
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "useful_tokens": wl.useful_tokens, "generated_tokens": generated,
           "tok_s": wl.useful_tokens / wall, "generated_tok_s": generated / wall}
    log(f"transformers[{dtype}]: {wl.useful_tokens} useful tokens ({generated} generated) in {wall:.2f} s = "
        f"{res['tok_s']:.1f} useful tok/s ({res['generated_tok_s']:.1f} generated tok/s)")
    del model
    free_memory()
    return res


# ---------------------------------------------------------------------------------------------
# start-up to /ready


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def engine_process(model_dir: Path, dtype: str, args: argparse.Namespace):
    """A `consort engine` child on the bench's argv and a free loopback port: yields (process, its
    output lines so far, base URL); SIGTERM (then kill) on the way out."""
    port = _free_port()
    consort = str(Path(sys.executable).with_name("consort"))
    argv = server_argv(model_dir, dtype, args)
    argv[argv.index("--port") + 1] = str(port)
    proc = subprocess.Popen([consort, "engine", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        yield proc, lines, f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        reader.join(5)


def startup_to_ready(model_dir: Path, dtype: str, args: argparse.Namespace, timeout: float = 300.0) -> dict:
    t0 = time.perf_counter()
    ready_s = None
    with engine_process(model_dir, dtype, args) as (proc, lines, url):
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                    if r.status == 200:
                        ready_s = time.perf_counter() - t0
                        break
            except OSError:
                pass
            time.sleep(0.05)
    if ready_s is None:
        raise BenchError("consort engine never reported /ready 200:\n" + "".join(lines[-30:]))
    own = next((ln.strip() for ln in lines if "ready in" in ln), "")
    log(f"start-up[{dtype}]: process start -> /ready 200 in {ready_s:.2f} s ({own})")
    return {"ready_s": ready_s, "engine_log": own}


def sampling(args: argparse.Namespace, i: int) -> dict:
    """Request i's sampling parameters: greedy by default; with --temperature, seeded per request."""
    temperature = getattr(args, "temperature", 0.0)
    if not temperature:
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_p": getattr(args, "top_p", 1.0), "seed": args.seed + i}


def run_server(model_dir: Path, dtype: str, wl: Workload, args: argparse.Namespace, timeout: float = 600.0) -> dict:
    """The same workload through a real `consort engine` process: every request sent at once (as the
    offline run adds them all at once), token-id prompts, the same sampling, EOS ignored, non-streaming.
    A rejection is retried after its Retry-After (openai_stream.py); one not answered in the end makes
    the run a BenchError (its tok/s would not be the workload's)."""
    import asyncio

    import aiohttp

    from consort_common.openai_stream import StreamResult, describe, request, tally

    async def one(url: str, session, i: int, prompt: list[int], n: int) -> StreamResult:
        body = {"model": "bench", "prompt": prompt, "max_tokens": n, "ignore_eos": True, **sampling(args, i)}
        return await request(session, f"{url}/v1/completions", body)

    async def drive(proc, lines: list[str], url: str) -> tuple[float, list[StreamResult]]:
        t_end = time.perf_counter() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            while True:
                if proc.poll() is not None or time.perf_counter() > t_end:
                    raise BenchError("consort engine never became ready:\n" + "".join(lines[-30:]))
                try:
                    async with session.get(f"{url}/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(url, session, i, p, n)
                                         for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))))
            return time.perf_counter() - t0, list(got)

    with engine_process(model_dir, dtype, args) as (proc, lines, url), ticker(f"server[{dtype}]", lambda: "running"):
        wall, results = asyncio.run(drive(proc, lines, url))
    counts = tally(results)
    if counts["ok"] < len(results):
        first = next(r for r in results if not r.ok)
        raise BenchError(f"server[{dtype}]: {len(results) - counts['ok']} of {len(results)} requests not answered "
                         f"({describe(counts)}; first: {first.outcome} {first.status or ''} {first.error})")
    if counts["retries"]:
        log(f"server[{dtype}]: {counts['retries']} rejected attempt(s) retried after Retry-After: the wall time "
            "includes those waits")
    got = [r.completion_tokens for r in results]
    if got != wl.output_lens:
        raise BenchError(f"server produced {sum(got)} tokens, wanted {wl.useful_tokens}")
    res = {"wall_s": wall, "useful_tokens": wl.useful_tokens, "tok_s": wl.useful_tokens / wall}
    log(f"server[{dtype}]: {wl.useful_tokens} tokens in {wall:.2f} s = {res['tok_s']:.1f} tok/s")
    return res


def run_agree(model_dir: Path, dtypes: list[str], wl: Workload, args: argparse.Namespace) -> int:
    """Offline and HTTP back to back per dtype (same argv, same machine load): the ratio should be ~1."""
    # Other work on a shared machine comes and goes: alternate the order each round (ABBA) and report
    # every pair with its load, so a burst that hit one side shows up instead of hiding in a mean.
    rows = []
    for dtype in dtypes:
        for r in range(args.rounds):
            order = ("offline", "server") if r % 2 == 0 else ("server", "offline")
            got = {}
            for side in order:
                got[side] = (run_engine(model_dir, dtype, wl, args, extras=False) if side == "offline"
                             else run_server(model_dir, dtype, wl, args))["tok_s"]
                free_memory()
            rows.append((dtype, r, got["offline"], got["server"], os.getloadavg()[0]))
    print(f"| dtype | round | offline tok/s | server tok/s | offline / server | load (1-min) |  "
          f"({len(wl.prompts)} requests, {args.threads} threads)")
    print("|---|---|---|---|---|---|")
    for dtype, r, off, srv, load in rows:
        print(f"| {dtype} | {r} | {off:.1f} | {srv:.1f} | {off / srv:.2f} | {load:.2f} |")
    for dtype in dtypes:
        ratios = [o / v for d, _, o, v, _ in rows if d == dtype]
        print(f"{dtype}: median offline / server = {statistics.median(ratios):.2f} over {len(ratios)} round(s)")
    if args.json:
        Path(args.json).write_text(json.dumps([{"dtype": d, "round": r, "offline_tok_s": o, "server_tok_s": v,
                                                "load": ld} for d, r, o, v, ld in rows], indent=2))
    return 0


# ---------------------------------------------------------------------------------------------
# report


@dataclass
class DtypeResult:
    dtype: str
    engine: dict
    hf: dict | None
    startup: dict | None = None
    ratio: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.engine["tok_s"] / self.hf["tok_s"] if self.hf else None


REFERENCE = {"float32": 5.5, "bfloat16": 6.3}   # vLLM CPU 0.32 over the same baseline on this machine class


def report(results: list[DtypeResult], wl: Workload, args: argparse.Namespace) -> str:
    L = ["", "=== consort bench offline ===",
         f"workload: {len(wl.prompts)} requests, prompts {min(map(len, wl.prompts))}-{max(map(len, wl.prompts))} "
         f"tokens ({wl.prompt_tokens} total), outputs {min(wl.output_lens)}-{max(wl.output_lens)} "
         f"({wl.useful_tokens} total), greedy, EOS ignored; baseline: transformers generate, static batches "
         f"of {HF_BATCH}, left padding; torch threads {args.threads}",
         "",
         f"{'dtype':<9} {'engine tok/s':>12} {'hf useful tok/s':>16} {'hf generated tok/s':>19} {'ratio':>7} "
         f"{'vLLM ref':>8} {'floor':>6}"]
    for r in results:
        if r.hf is None:
            L.append(f"{r.dtype:<9} {r.engine['tok_s']:>12.1f} {'(skipped)':>16}")
            continue
        L.append(f"{r.dtype:<9} {r.engine['tok_s']:>12.1f} {r.hf['tok_s']:>16.1f} {r.hf['generated_tok_s']:>19.1f} "
                 f"{r.ratio:>6.2f}x {REFERENCE.get(r.dtype, float('nan')):>7.1f}x {'ok' if r.ratio >= 2.0 else 'LOW':>6}")
    L.append("")
    for r in results:
        o, p, sp = r.engine.get("overhead"), r.engine.get("prefix_ttft"), r.engine.get("speculation") or {}
        if sp.get("draft_tokens"):
            L.append(f"{r.dtype:<9} speculation {sp['mode']}: {r.engine['steps']} steps, {sp['accepted_tokens']}/"
                     f"{sp['draft_tokens']} draft tokens accepted ({100 * sp['acceptance_rate']:.0f}%)")
        if o:
            L.append(f"{r.dtype:<9} decode step @32 running: {o['step_ms']:.2f} ms, {100 * o['outside_share']:.1f}% "
                     f"outside runner.execute (goal <= 10%)")
        if p:
            L.append(f"{r.dtype:<9} TTFT 1024 cached + 32 new: {p['cached_ms']:.1f} ms vs uncached "
                     f"{p['uncached_ms']:.1f} ms = {p['ratio']:.3f} (goal <= 0.2)")
        if r.startup:
            L.append(f"{r.dtype:<9} start-up (process start -> /ready 200): {r.startup['ready_s']:.2f} s "
                     f"(goal <= 20 s; vLLM CPU 77 s)")
    return "\n".join(L)


def run(args: argparse.Namespace) -> int:
    # The server's thread sizing (torch + the C kernels' OpenMP pool), not torch's default.
    args.threads = apply_threads(args.threads or None)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    n = args.requests if args.requests else (16 if args.quick else 64)
    model_dir = Path(args.model) if args.model else bench_model(args.rebuild)
    wl = make_workload(n, seed=args.seed, vocab=BENCH_SPEC["vocab_size"])
    log(f"workload: {n} requests, {wl.prompt_tokens} prompt tokens, {wl.useful_tokens} output tokens")
    results = []
    if args.vs_server:
        return run_agree(model_dir, dtypes, wl, args)
    for dtype in dtypes:
        log(f"--- {dtype} ---")
        eng = run_engine(model_dir, dtype, wl, args)
        hf = None if args.engine_only else run_hf(model_dir, dtype, wl, args)
        start = None if args.no_startup else startup_to_ready(model_dir, dtype, args)
        results.append(DtypeResult(dtype, eng, hf, start))
        if hf:
            log(f"{dtype}: engine {eng['tok_s']:.1f} tok/s vs transformers {hf['tok_s']:.1f} tok/s = "
                f"{results[-1].ratio:.2f}x")
    print(report(results, wl, args), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
        log(f"wrote {args.json}")
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine the benchmark builds (its `consort engine` flags: server_argv) and where results go;
    `bench roofline` takes these too."""
    from consort_engine.config import KV_CACHE_DTYPES, EngineConfig

    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both",
                   help="weights and KV cache; both: one run each (roofline: float32)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine runs")
    p.add_argument("--quantization", default="none", choices=["none", "auto", "int8", "w8a8", "fp8", "awq", "gptq", "compressed-tensors"],
                   help="the engine's --quantization (`consort bench quant` runs several side by side)")
    p.add_argument("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="the engine's --kv-cache-dtype (`consort bench quant` arms DTYPE:QUANT:KV side by side)")
    # Defaults are `consort engine`'s own (EngineConfig's), so a bare bench runs the engine a bare server runs.
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks; unset: sized from free memory, as the server does")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="sequences running in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="tokens per step: decode tokens plus prefill chunks")
    p.add_argument("--speculative", default="off", choices=["off", "ngram"],
                   help="engine speculation (greedy output is identical; the report adds acceptance)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="cuda: no decode CUDA graphs (run twice, with and without, to compare)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0: as `consort engine`: the cgroup quota, else the usable cores)")
    p.add_argument("--model", default=None, metavar="DIR", type=checkpoint_dir,
                   help="checkpoint to bench; unset: the cached bench model")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--requests", type=int, default=None,
                   help="number of requests; unset: 64, or 16 with --quick")
    p.add_argument("--quick", action="store_true", help="16 requests: a fast sanity run")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's draws")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the engine runs at this temperature (seeded per request; 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    p.add_argument("--vs-server", action="store_true",
                   help="run the workload offline and through a real `consort engine` HTTP server, back to back "
                        "(interleaved per dtype), and print both tok/s and their ratio")
    p.add_argument("--rounds", type=int, default=2, help="--vs-server: offline/server pairs, order alternating")
    p.add_argument("--no-startup", action="store_true", help="skip the start-up-to-ready measurement")
    p.add_argument("--engine-only", action="store_true", help="skip the transformers baseline (no ratio)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached benchmark checkpoint")
