"""`consort bench hybrid`: a hybrid (attention + Mamba2, Bamba) vs a pure-attention (Llama) model of similar size.

Both are random-weight checkpoints written by transformers with the same hidden size, depth, heads
and MLP; the hybrid keeps attention in every `--attn-every`-th layer and Mamba2 mixers elsewhere.
Per model, from our runner: KV bytes per token (attention layers only), state bytes per sequence
(the mixers' conv + SSM state), and how many sequences of `--context` tokens one pool of `--pool-mib`
holds; then throughput: `--batch` greedy requests of `--prompt-len` tokens generating `--max-tokens`
each, output tokens over the wall time of `generate` (prefill included, warm-up excluded, the fastest
of --repeats runs) and over the process's CPU time (steadier where other work shares the CPU).
With --spec-k K (3 by default; 0: off), the same requests with speculative decoding: each step verifies
a window of the last token + K drafts per request. The drafts are the model's own greedy continuation
with every third token changed (about two of three drafts accepted; a random-weight model rarely repeats
an n-gram, so the n-gram drafter would draft almost nothing): output tok/s with drafting against without,
at a known acceptance; the greedy outputs must equal the run without (the exit status is 1 otherwise).
Then, for the hybrid, prefix caching: the time to first token of a prompt whose first
`--cached-prefix` tokens are in the prefix cache (KV blocks + the mixers' state checkpoint at that
boundary) against the same-length prompt computed from scratch.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def write_checkpoints(out: Path, args) -> dict[str, Path]:
    import torch
    import transformers
    common = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    attn = [i for i in range(args.layers) if i % args.attn_every == args.attn_every - 1]
    configs = {
        "llama (attention)": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)),
        f"bamba (attention {len(attn)}/{args.layers})": (transformers.BambaForCausalLM, transformers.BambaConfig(
            **common, attn_layer_indices=attn, mamba_n_heads=args.hidden // 16, mamba_d_head=32,
            mamba_d_state=64, mamba_chunk_size=64, mamba_n_groups=1)),
    }
    paths = {}
    for name, (cls, cfg) in configs.items():
        torch.manual_seed(0)         # before the model initialises its weights: the same checkpoints every run
        model = cls(cfg)
        path = out / name.split()[0]
        model.save_pretrained(path)
        paths[name] = (path, sum(p.numel() for p in model.parameters()))
    return paths


def continuation_drafter(prompts: list[list[int]], outputs: list[list[int]], vocab: int):
    """A drafter proposing each request's greedy continuation (`outputs`) with every third token changed:
    propose(token_ids, k) for a sequence whose tokens start with one of `prompts` (the longest that fits)."""
    by_prompt = {tuple(p): list(o) for p, o in zip(prompts, outputs)}
    lengths = sorted({len(p) for p in prompts}, reverse=True)

    def propose(token_ids: list[int], k: int, **_) -> list[int]:
        n = next((n for n in lengths if tuple(token_ids[:n]) in by_prompt), None)
        if n is None:
            return []
        g, ref = len(token_ids) - n, by_prompt[tuple(token_ids[:n])]
        return [t if (g + j) % 3 != 2 else (t + 1) % vocab for j, t in enumerate(ref[g:g + k])]
    return propose


def timed_generate(path: Path, args, ps: list[list[int]], spec_k: int = 0, outputs=None):
    """The fastest of --repeats greedy runs of ps: (outputs, wall s, CPU s, runner, acceptance rate); with
    spec_k, drafts of spec_k tokens from continuation_drafter(outputs)."""
    from consort_engine.config import EngineConfig
    from consort_engine.core.engine import LLMEngine
    from consort_engine.kv.sequence import SamplingParams
    # policy always: every step verifies the same drafts (what this bench measures is the verify windows)
    spec = dict(speculative="ngram", num_speculative_tokens=spec_k, spec_policy="always") if spec_k else {}
    engine = LLMEngine(EngineConfig(model=str(path), name="bench", device=args.device, dtype=args.dtype,
                                    max_num_seqs=max(16, args.batch), num_blocks=args.num_blocks,
                                    max_model_len=args.context + 64, block_size=16, **spec))
    if spec_k:
        engine.scheduler.spec.propose_ngram = continuation_drafter(ps, outputs, args.vocab)
    engine.warmup()
    params_ = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    wall = cpu = float("inf")
    for _ in range(args.repeats):
        if args.device == "cuda":
            import torch
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(ps, params_)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return outs, wall, cpu, engine.runner, engine.stats()["speculation"]["acceptance_rate"]


def measure(name: str, path: Path, params: int, args) -> dict:
    ps = [[(7 * i + j) % (args.vocab - 3) + 3 for j in range(args.prompt_len)] for i in range(args.batch)]
    outs, wall, cpu, r, _ = timed_generate(path, args, ps)
    n = sum(map(len, outs))
    row = {"model": name, "params_m": params / 1e6, "dtype": str(r.dtype).removeprefix("torch."),
           "kv_layers": r.num_kv_layers, "kv_bytes_per_token": r.kv_bytes_per_token,
           "state_bytes_per_seq": r.state_bytes_per_seq,
           "seqs_in_pool": r.seqs_in_pool(args.pool_mib * MiB, args.context), "tok_s": n / wall,
           "tok_cpu_s": n / cpu}
    if args.spec_k:
        spec_outs, wall, _, _, acceptance = timed_generate(path, args, ps, args.spec_k, outs)
        row.update(spec_tok_s=n / wall, acceptance=acceptance, spec_same=spec_outs == outs)
    return row


def measure_prefix_ttft(path: Path, args) -> dict:
    """TTFT (one greedy token) of prefix + a new suffix after prefix + another suffix was served, vs a
    prompt of the same length that shares nothing with the cache; the fastest of --repeats each."""
    from consort_engine.config import EngineConfig
    from consort_engine.core.engine import LLMEngine
    from consort_engine.kv.sequence import SamplingParams
    n, suffix = args.cached_prefix, 16
    engine = LLMEngine(EngineConfig(model=str(path), name="bench", device=args.device, dtype=args.dtype,
                                    max_num_seqs=16, num_blocks=args.num_blocks, block_size=16,
                                    max_model_len=n + 2 * suffix + 64, max_num_batched_tokens=max(2048, n + suffix)))
    engine.warmup()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(seed: int, length: int) -> list[int]:
        return [(seed * 7919 + 31 * j) % (args.vocab - 3) + 3 for j in range(length)]

    def ttft(p: list[int]) -> float:
        if args.device == "cuda":
            import torch
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate([p], one)
        return time.perf_counter() - t0
    cold = cached = float("inf")
    for r in range(args.repeats):
        cold = min(cold, ttft(prompt(1000 + r, n + suffix)))         # nothing of it is cached
        prefix = prompt(2000 + r, n)
        ttft(prefix + prompt(3000 + r, suffix))                        # fills the cache
        hits = engine.block_manager.prefix_hits
        cached = min(cached, ttft(prefix + prompt(4000 + r, suffix)))
        if engine.block_manager.prefix_hits - hits != n:
            raise RuntimeError(f"the cached prefix did not hit ({engine.block_manager.prefix_hits - hits} of {n} tokens)")
    return {"prefix": n, "suffix": suffix, "ttft_cold_s": cold, "ttft_cached_s": cached}


def main(args: argparse.Namespace) -> int:
    if args.threads:
        from consort_engine.model.cpu_kernels import set_threads
        set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        rows = []
        ttft = None
        for name, (path, params) in write_checkpoints(out, args).items():
            rows.append(measure(name, path, params, args))
            print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
            if name.startswith("bamba") and args.cached_prefix:
                ttft = measure_prefix_ttft(path, args)
    dt = rows[0]["dtype"]      # what the runner made of --dtype (model/loader.py resolve_dtype)
    spec = (f" output tok/s, drafts of {args.spec_k} (acceptance) | same greedy tokens |", "---:|---|") \
        if args.spec_k else ("", "")
    print(f"| model | params | KV layers | KV bytes/token ({dt}) | state bytes/seq | seqs of {args.context} tokens "
          f"in {args.pool_mib} MiB | output tok/s (batch {args.batch}, {args.device}) | tok/CPU-s |{spec[0]}")
    print(f"|---|---:|---:|---:|---:|---:|---:|---:|{spec[1]}")
    for r in rows:
        extra = f" {r['spec_tok_s']:.1f} ({r['acceptance']:.2f}) | {'yes' if r['spec_same'] else 'NO'} |" \
            if args.spec_k else ""
        print(f"| {r['model']} | {r['params_m']:.1f}M | {r['kv_layers']} | {r['kv_bytes_per_token']} | "
              f"{r['state_bytes_per_seq']} | {r['seqs_in_pool']} | {r['tok_s']:.1f} | {r['tok_cpu_s']:.1f} |{extra}")
    if ttft is not None:
        print(f"\nbamba prefix cache: TTFT of {ttft['prefix']} cached + {ttft['suffix']} new tokens "
              f"{ttft['ttft_cached_s'] * 1e3:.1f} ms vs {ttft['ttft_cold_s'] * 1e3:.1f} ms uncached "
              f"({ttft['ttft_cached_s'] / ttft['ttft_cold_s']:.3f}x, {args.device})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "prefix_ttft": ttft}, indent=2))
    return 0 if all(r.get("spec_same", True) for r in rows) else 1


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help="keep the checkpoints here; unset: a temporary directory")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine runs")
    p.add_argument("--dtype", default="auto", help="as `consort engine --dtype`")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of both models")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of both models")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (grouped-query attention)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    p.add_argument("--attn-every", type=int, default=4, help="the hybrid's attention layers: every n-th")
    p.add_argument("--pool-mib", type=int, default=256, help="the pool both models are compared in")
    p.add_argument("--context", type=int, default=2048, help="tokens per sequence for the pool capacity column")
    p.add_argument("--batch", type=int, default=16, help="requests of the throughput runs")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--num-blocks", type=int, default=512, help="pool blocks of the throughput runs")
    p.add_argument("--repeats", type=int, default=2, help="runs per model; the fastest counts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--spec-k", type=int, default=3, metavar="K",
                   help="draft tokens per step of the speculative runs (0: none)")
    p.add_argument("--cached-prefix", type=int, default=1024,
                   help="the hybrid's prefix-cache TTFT: tokens of the cached prefix (a multiple of 256; 0: skip)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
