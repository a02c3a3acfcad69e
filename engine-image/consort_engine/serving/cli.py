"""`consort engine`: flags -> EngineConfig, the server context built, the app served until a signal."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from consort_engine.serving.limits import ADAPTER_NAME
from consort_engine.model.attention import default_block_size
from consort_engine.core.async_engine import AsyncEngine
from consort_common.help import HelpFormatter
from consort_engine.config import KV_CACHE_DTYPES, EngineConfig, byte_size
from consort_engine.serving.adapter_sync import AdapterSync
from consort_engine.serving.credential import CredentialSource
from consort_engine.model.cpu import apply_threads
from consort_engine.model.models.quant import QUANTIZATIONS, check_checkpoint_quantization, check_quantization
from consort_engine.text.tokenizer import Tokenizer

from consort_engine.serving.context import CTX, ServerContext, StartupError, process_age_s
from consort_engine.serving.server import build_app, metrics
log = logging.getLogger("consort.server")



def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort engine", description="Serve one specialist's paged-KV engine.",
                                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json); a Specialist's "
                        "demo:// source is turned into one by `consort up` or `consort demo-model DIR`")
    p.add_argument("--port", type=int, required=True, help="port (0 = any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--name", default=None, help="specialist name; unset: the checkpoint directory's name")
    p.add_argument("--served-model-name", default=None, help="model id in responses; unset: --name")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks in the pool; unset: sized from the memory left after the weights "
                        "(--kv-memory-fraction of it)")
    p.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                   help="tokens per KV block; unset: 256 on cuda (flash-attn's page), 16 on cpu")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split attention heads and the MLP over this many ranks (processes; GPUs on cuda)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache; auto: bfloat16 on cuda; on cpu a bfloat16 checkpoint stays "
                        "bfloat16 where the CPU has AMX or AVX-512 BF16, else float32")
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="quantize the decoder's linear weights at load: int8 (int8 weights, each layer's input rounded "
                        "per row to 16-bit integers, the LM head too; cpu), w8a8 (int8 weights and activations, cpu), fp8 (e4m3 weights and activations, cuda); per-channel scales. "
                        "A pre-quantized checkpoint (awq or gptq int4, compressed-tensors int4/int8/nvfp4, "
                        "modelopt nvfp4, named by config.json's quantization_config) loads with none, auto or its own "
                        "format's name; on cpu its codes run on the int8 kernel, elsewhere it is dequantized to "
                        "--dtype. An fp8 checkpoint (compressed-tensors float-quantized, modelopt fp8, transformers' "
                        "fp8) is decoded to --dtype; fp8 rounds "
                        "it to e4m3 per row again (cuda)")
    p.add_argument("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="the KV pool's element: auto = the weights' dtype; bfloat16 (a float32 model's pool in half "
                        "the memory) or fp8 (float8 e4m3, unscaled: half a bfloat16 pool; decode attention reads "
                        "half the bytes and the pool holds twice the tokens); on cuda a narrower pool takes the Triton "
                        "kernel, and fp8 needs compute capability 8.9+")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + completion; unset: the checkpoint's max_position_embeddings")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, metavar="N",
                   help="sequences running in one step (the decode batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens, metavar="N",
                   help="tokens per step: decode tokens plus prefill chunks")
    p.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting, metavar="N",
                   help="waiting-queue bound; past it requests get 429 queue_full")
    p.add_argument("--kv-memory-fraction", type=float, default=EngineConfig.kv_memory_fraction, metavar="F",
                   help="share of the memory left after the weights that the KV pool may take (without --num-blocks)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of a prompt prefix seen before")
    p.add_argument("--kv-tier-path", default=None, metavar="DIR",
                   help="KV tier: prefix blocks evicted from the pool are written here and read back on a prefix "
                        "hit instead of recomputed; survives restarts, and replicas sharing the directory share "
                        "prefills (docs/kv-cache.md). Unset: no disk tier")
    p.add_argument("--kv-tier-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="KV tier bound (e.g. 20G), least recently used blocks out first; with --kv-tier-path "
                        "unset, the tier is host memory (GPU pods). Unset: 4G with --kv-tier-path, else no tier")
    p.add_argument("--speculative", default="off", choices=["off", "ngram", "mtp"],
                   help="speculative decoding: ngram drafts from the prompt and output so far, mtp from the "
                        "checkpoint's multi-token-prediction block")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                   help="draft tokens proposed per step (with --speculative)")
    p.add_argument("--speculative-policy", default=EngineConfig.spec_policy, choices=["goodput", "always"],
                   help="goodput: each step drafts where the expected tokens per second gain (the step cost is "
                        "measured at start-up, each sequence's acceptance as it runs); always: every eligible "
                        "decode drafts up to K")
    p.add_argument("--spec-typical-tau", type=float, default=EngineConfig.spec_typical_tau,
                   help="typical-acceptance tau for sampled requests (0: only greedy requests speculate)")
    p.add_argument("--tool-trigger", action="append", default=None, metavar="TOKEN",
                   help="tool-call trigger token (repeatable; unset: <QUERY_TOOL> and <SCRIPT_START>): "
                        "speculation stops at it")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter (repeatable); requests pick it with `adapter` or model "
                        "SPECIALIST:NAME")
    p.add_argument("--adapters-file", default=None, metavar="PATH",
                   help="JSON list of the adapters to serve (the Specialist's mounted ConfigMap): loaded before "
                        "/ready, then re-read every few seconds and hot-loaded / unloaded to match")
    p.add_argument("--max-adapters", type=int, default=4, metavar="N",
                   help="adapters loaded at once; one more is refused until another is unloaded")
    p.add_argument("--seed", type=int, default=0,
                   help="accepted as vLLM's flag; a request's own `seed` makes its sampling reproducible")
    p.add_argument("--enforce-eager", action="store_true",
                   help="cuda: no decode CUDA graphs, every step runs eagerly (cpu never captures)")
    p.add_argument("--slo-ttft-ms", type=int, default=None, help="published time-to-first-token objective (p95)")
    p.add_argument("--slo-itl-ms", type=int, default=None, help="published inter-token latency objective (p95)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and the kernels; unset: the cgroup CPU quota, else every "
                        "core this process may use")
    p.add_argument("--credential-file", default=None, metavar="PATH",
                   help="require this file's credential (Authorization: Bearer) on every route but /health, "
                        "/ready and /metrics (one a line; a directory: every file's lines; re-read when it "
                        "changes); else $CONSORT_ENGINE_CREDENTIAL_FILE, else open to every caller")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics on this port; the API port's /metrics then needs the credential")
    p.add_argument("--max-body-bytes", type=int, default=EngineConfig.max_body_bytes,
                   help="largest request body accepted; larger ones get 413 request_too_large")
    p.add_argument("--drain-timeout", type=float, default=45.0, metavar="SECONDS",
                   help="on SIGTERM, seconds to let accepted requests finish (keep it below the pod's "
                        "terminationGracePeriodSeconds) before cancelling them")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    if "://" in a.model:   # a Specialist's model source, which Path() would also mangle (demo:/tiny)
        raise SystemExit(f"consort engine: --model {a.model}: a model source URL, not a directory; the engine "
                         "takes a checkpoint directory (`consort demo-model DIR` writes a demo one; `consort up` "
                         "turns a manifest's sources into directories)")
    adapters = {}
    for item in a.adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"consort engine: --adapter expects NAME=PATH, got {item!r}")
        if not ADAPTER_NAME.fullmatch(name):
            raise SystemExit(f"consort engine: adapter name {name!r} must be a DNS label (lowercase, digits, '-')")
        adapters[name] = path
    if adapters and a.adapters_file:
        raise SystemExit("consort engine: --adapter and --adapters-file exclude each other (the file is the whole list)")
    if not 0.0 <= a.spec_typical_tau <= 1.0:
        raise SystemExit(f"consort engine: --spec-typical-tau must be in [0, 1], got {a.spec_typical_tau}")
    for flag, value in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-itl-ms", a.slo_itl_ms)):
        if value is not None and value <= 0:
            raise SystemExit(f"consort engine: {flag} must be a positive number of milliseconds, got {value}")
    try:
        check_quantization(a.quantization, a.device)
        check_checkpoint_quantization(a.quantization, a.model)
    except ValueError as e:
        raise SystemExit(f"consort engine: --quantization: {e}")
    if a.tensor_parallel_size < 1:
        raise SystemExit(f"consort engine: --tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
    return EngineConfig(
        model=str(Path(a.model)), name=a.name or Path(a.model).resolve().name, device=a.device, dtype=a.dtype,
        quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
        tensor_parallel_size=a.tensor_parallel_size,
        block_size=a.block_size or default_block_size(a.device), num_blocks=a.num_blocks, kv_memory_fraction=a.kv_memory_fraction,
        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_waiting=a.max_waiting, enable_prefix_caching=not a.no_prefix_caching, speculative=a.speculative,
        kv_tier_path=a.kv_tier_path, kv_tier_bytes=a.kv_tier_bytes,
        num_speculative_tokens=a.num_speculative_tokens, spec_policy=a.speculative_policy,
        spec_typical_tau=a.spec_typical_tau,
        adapters=adapters, max_adapters=a.max_adapters, seed=a.seed, enforce_eager=a.enforce_eager,
        slo_ttft_ms=a.slo_ttft_ms, slo_itl_ms=a.slo_itl_ms, max_body_bytes=a.max_body_bytes,
        **({} if a.tool_trigger is None else {"tool_triggers": list(a.tool_trigger)}))


def resolve_tool_triggers(config: EngineConfig, tokenizer: Tokenizer) -> None:
    """Tool triggers that are single tokens of this tokenizer are watched by id; others cannot be
    (a draft run is checked token by token) and are reported once at start-up."""
    ids = []
    for text in config.tool_triggers:
        tid = tokenizer.hf.token_to_id(text)
        if tid is None:
            log.info("tool trigger %r is not a single token of this tokenizer: not watched", text)
        else:
            ids.append(tid)
    config.tool_trigger_ids = sorted(set(config.tool_trigger_ids) | set(ids))


def checkpoint_limits(config: EngineConfig) -> tuple[int, int]:
    """(max_model_len, vocab_size) from config.json, before the engine has loaded."""
    cfg = json.loads((Path(config.model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    max_len = config.max_model_len or cfg.get("max_position_embeddings") or 2048
    return int(max_len), int(cfg.get("vocab_size", 0))


def build_context(config: EngineConfig, served_name: str | None = None, warmup: bool = True) -> ServerContext:
    if not (Path(config.model) / "config.json").is_file():
        raise StartupError(f"{config.model} is not a checkpoint directory (no config.json)")
    tokenizer = Tokenizer.from_dir(config.model)
    resolve_tool_triggers(config, tokenizer)
    max_len, vocab = checkpoint_limits(config)
    served = served_name or config.name
    aliases = frozenset({served, config.name, Path(config.model).resolve().name, str(config.model)})
    engine = AsyncEngine(config, warmup=warmup, freeze_heap=True)   # one engine for the process's life
    return ServerContext(config=config, tokenizer=tokenizer, engine=engine, served_name=served, aliases=aliases,
                         max_model_len=max_len, vocab_size=vocab or tokenizer.vocab_size)


async def serve_metrics(ctx: ServerContext, host: str, port: int) -> web.AppRunner:
    """/metrics alone on its own port (--metrics-port): a NetworkPolicy can admit monitoring there only."""
    app = web.Application()
    app[CTX] = ctx
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"consort engine: metrics on http://{host}:{bound}/metrics", flush=True)
    return runner


async def serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    threads = apply_threads(args.threads)
    print(f"consort engine: specialist {config.name!r}, model {config.model}, device {config.device}, "
          f"dtype {config.dtype}, {threads} CPU thread(s)", flush=True)
    credential_source = CredentialSource(args.credential_file)
    credentials = credential_source.read()   # before the model loads: a bad file fails at once
    ctx = build_context(config, args.served_model_name)
    ctx.credentials = credentials
    ctx.metrics_port = args.metrics_port is not None
    if args.adapters_file:
        ctx.adapter_sync = AdapterSync(args.adapters_file, config.model, ctx.engine.call)
        await asyncio.to_thread(ctx.adapter_sync.initial)
    app = build_app(ctx)
    # shutdown_timeout: how long runner.cleanup() (on SIGTERM) lets accepted requests finish after
    # the listener closes; new connections are refused meanwhile, so routers retry them elsewhere.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=log if args.access_log else None,
                           shutdown_timeout=args.drain_timeout)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else args.port
    print(f"consort engine: listening on http://{args.host}:{port} (/health alive, /ready after warmup)", flush=True)
    if ctx.credentials:
        print("consort engine: an engine credential is required on every route but /health, /ready"
              + ("" if ctx.metrics_port else " and /metrics"), flush=True)
    metrics_runner = await serve_metrics(ctx, args.host, args.metrics_port) if ctx.metrics_port else None

    def on_ready() -> None:
        ctx.startup_s = process_age_s() or (time.monotonic() - ctx.started)
        ctx.last_request = time.monotonic()   # idle time counts from warm: a fresh replica is not idle
        runner_ = ctx.engine.engine.runner
        ctx.max_model_len = int(getattr(runner_, "max_model_len", ctx.max_model_len))
        s = ctx.engine.stats()
        print(f"consort engine: ready in {ctx.startup_s:.2f} s from process start (load {ctx.engine.load_s:.2f} s, "
              f"warmup {ctx.engine.warmup_s or 0:.2f} s); kv blocks {s.get('kv_total_blocks')} x "
              f"{config.block_size} tokens; max_model_len {ctx.max_model_len}", flush=True)

    stop = asyncio.Event()
    # A model that cannot load is fatal: exit non-zero at once (a supervisor or kubelet restarts us
    # or shows the cause) rather than serve 503s forever.
    ctx.engine.on_start(ready=on_ready, failed=stop.set)
    print("consort engine: loading model ...", flush=True)
    ctx.engine.start()
    if ctx.credentials:   # rotation: the file is followed, no restart
        credential_task = asyncio.create_task(credential_source.follow(lambda d: setattr(ctx, "credentials", d), stop))
    if ctx.adapter_sync is not None:
        def loaded_paths() -> dict[str, str] | None:
            return ctx.engine.stats().get("adapter_paths") or {} if ctx.engine.ready else None
        sync_task = asyncio.create_task(ctx.adapter_sync.run(loaded_paths, stop))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if ctx.credentials:
        await credential_task
    if ctx.adapter_sync is not None:
        await sync_task
    s = ctx.engine.stats()
    if ctx.engine.state != "failed":
        print(f"consort engine: draining: {s.get('running', 0)} running and {s.get('waiting', 0)} waiting "
              f"requests may finish within {args.drain_timeout:g} s; new connections are refused", flush=True)
    await runner.cleanup()
    if metrics_runner is not None:
        await metrics_runner.cleanup()
    print("consort engine: shutting down", flush=True)
    await asyncio.to_thread(ctx.engine.shutdown)
    if ctx.engine.state == "failed":
        raise StartupError(f"model {config.model} failed to load: {ctx.engine.error}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(args))
    except Exception as exc:  # noqa: BLE001 - any escape from serve() is fatal
        # Bad model dir, unsupported architecture, port in use, ...: the cause is the last line.
        log.debug("start-up failed", exc_info=True)
        cause = " ".join(str(exc).split()) or type(exc).__name__   # one line, even for multi-line messages
        print(f"consort engine: fatal: {cause}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
