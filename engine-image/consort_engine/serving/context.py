"""What every route reads: the engine, tokenizer, grammars and metrics of this process (ServerContext),
and its status view."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from consort_engine.serving.errors import ApiError
from consort_engine.serving.limits import GUIDED_COMPILE_TIMEOUT_S, MAX_CONCURRENT_COMPILES
from consort_engine.core.async_engine import AsyncEngine
from consort_engine.config import EngineConfig
from consort_engine.serving.adapter_sync import AdapterSync
from consort_engine.serving.metrics import EngineMetrics, SloTracker
from consort_engine.text.guided import CompileSlots, Grammars
from consort_engine.model.loader import eos_token_ids, load_model_config
from consort_engine.text.tokenizer import Tokenizer

log = logging.getLogger("consort.server")



class StartupError(RuntimeError):
    """A fatal start-up problem; main() prints it as the last line and exits 1."""

CTX = web.AppKey("consort_ctx", object)
STREAM = "consort_stream"   # request key: the prepared SSE response of a streaming request
TENANT_HEADER = "x-consort-tenant"   # set by the router (which overwrites any client's); salts the prefix cache


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), so start-up time includes interpreter and imports."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_GRAMMARS_LOCK = threading.Lock()


@dataclass
class ServerContext:
    config: EngineConfig
    tokenizer: Tokenizer
    engine: AsyncEngine
    served_name: str
    aliases: frozenset[str]
    max_model_len: int
    vocab_size: int
    metrics: EngineMetrics = field(init=False)
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))   # the model cards' `created` (vLLM: start)
    startup_s: float | None = None
    in_flight: int = 0
    last_request: float = field(default_factory=time.monotonic)   # when a generation request last ended (or warm)
    adapter_sync: AdapterSync | None = None     # --adapters-file: the adapters this engine must serve
    credentials: tuple[bytes, ...] = ()         # digests of the engine credential(s); (): open (credential.py)
    metrics_port: bool = False                  # /metrics is (also) served on its own port
    _grammars: Grammars | None = field(default=None, init=False, repr=False)
    compile_slots: CompileSlots = field(
        default_factory=lambda: CompileSlots(MAX_CONCURRENT_COMPILES, GUIDED_COMPILE_TIMEOUT_S))

    def __post_init__(self) -> None:
        c = self.config
        slo = SloTracker(None if c.slo_ttft_ms is None else c.slo_ttft_ms / 1000.0,
                         None if c.slo_itl_ms is None else c.slo_itl_ms / 1000.0)
        self.metrics = EngineMetrics(self.served_name, self.config.name, self.status, slo)

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler, built on the first guided request (xgrammar reads the
        whole vocabulary once; servers that never see one do not pay for it)."""
        with _GRAMMARS_LOCK:      # first guided requests may arrive together, on worker threads
            if self._grammars is None:
                eos = sorted(eos_token_ids(self.config.model, load_model_config(self.config.model)))
                self._grammars = Grammars(self.tokenizer.hf, self.vocab_size, eos)
        return self._grammars

    def speculation_state(self) -> str:
        if self.config.speculative == "off":
            return "off"
        state = self.engine.stats().get("speculation")
        if isinstance(state, dict):
            state = state.get("state")
        return state if state in ("on", "off", "fallback") else "on"

    def adapters_state(self) -> dict[str, str]:
        """name -> loaded | pending | failed."""
        if not self.engine.ready:
            wanted = self.adapter_sync.desired if self.adapter_sync is not None else self.config.adapters
            return {name: "pending" for name in wanted}
        paths = self.engine.stats().get("adapter_paths") or {}
        if self.adapter_sync is not None:
            return self.adapter_sync.states(paths)
        return {str(name): "loaded" for name in paths}

    def check_target(self, req: Any) -> None:
        """The model a request (generation, tokenize, a model card) names must be served here; `req.adapter`
        is set when it names an adapter, bare (as vLLM serves LoRA modules) or as `base:adapter` (as
        /v1/models lists it). A 404 otherwise."""
        adapters = self.adapters_state()
        if req.model is not None and req.model not in self.aliases:
            base, sep, name = req.model.rpartition(":")
            if req.model in adapters and req.adapter in (None, req.model):
                req.adapter = req.model
            elif sep and base in self.aliases and name in adapters and req.adapter in (None, name):
                req.adapter = name
            else:
                raise ApiError(404, "model_not_found", f"model '{req.model}' is not served here; this engine serves "
                               f"'{self.served_name}'" + (f" and adapters {sorted(adapters)}" if adapters else ""),
                               "model")
        if req.adapter is not None and req.adapter not in adapters:
            raise ApiError(404, "adapter_not_found", f"adapter '{req.adapter}' is not loaded on this engine",
                           "adapter")

    def pending_adapters(self) -> list[str]:
        """The adapters /ready waits for: those the engine started with and still serves. A hot-load
        never takes a serving replica out of rotation; it shows in /v1/status until it is done."""
        states = self.adapters_state()
        if self.adapter_sync is not None:
            wanted = self.adapter_sync.startup & set(self.adapter_sync.desired)
            return sorted(n for n in wanted if states.get(n) == "pending")
        return sorted(n for n in self.config.adapters if states.get(n) != "loaded")

    def idle_s(self) -> float:
        """Seconds without a generation request (since the last ended, or since the engine turned
        warm); 0 while one runs. The operator's scale to zero reads it from /v1/status."""
        return 0.0 if self.in_flight else round(time.monotonic() - self.last_request, 1)

    def status(self) -> dict:
        s = self.engine.stats()
        runner = getattr(self.engine.engine, "runner", None)
        return {
            "specialist": self.config.name,
            "model": self.served_name,
            "model_path": self.config.model,
            "state": self.engine.state,
            "warm": self.engine.ready,
            "error": self.engine.error,
            "adapters": self.adapters_state(),
            "adapter_errors": dict(self.adapter_sync.errors) if self.adapter_sync is not None else {},
            "queue_depth": s.get("waiting", 0),
            "running": s.get("running", 0),
            "waiting": s.get("waiting", 0),
            "in_flight_requests": self.in_flight,
            "idle_s": self.idle_s(),
            "kv_total_blocks": s.get("kv_total_blocks"),
            "kv_free_blocks": s.get("kv_free_blocks"),
            "kv_cached_blocks": s.get("kv_cached_blocks"),
            "kv_usage": s.get("kv_usage"),
            "block_size": self.config.block_size,
            # the pool's element (--kv-cache-dtype resolved); None before the model loads
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch.") if hasattr(runner, "kv_dtype") else None,
            "preempting": bool(s.get("preempting", False)),
            "num_preemptions": s.get("num_preemptions", 0),
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "prefix_cache_hits": s.get("prefix_cache_hits", 0),
            "step_time_ewma_s": s.get("step_time_ewma_s"),
            "slo": self.metrics.slo.summary(),
            "speculation": {"mode": self.config.speculative, **(s.get("speculation") or {}),
                            "state": self.speculation_state(),
                            "num_speculative_tokens": self.config.num_speculative_tokens},
            "max_model_len": getattr(runner, "max_model_len", self.max_model_len),
            "device": self.config.device,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "dtype": self.config.dtype,
            "load_s": self.engine.load_s,
            "warmup_s": self.engine.warmup_s,
            "startup_s": self.startup_s,
            "engine": {k: v for k, v in s.items() if isinstance(v, (int, float, str, bool)) or v is None},
        }
