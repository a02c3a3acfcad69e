"""The bridge between asyncio handlers and the single-threaded LLMEngine.

One background thread owns the engine: it builds it, warms it up, then runs the step loop. Handlers
talk to it through a thread-safe command queue (add / abort); the thread answers admission through
a concurrent future (so a 429 is decided before the response starts) and delivers each step's
outputs to per-request asyncio queues with one `call_soon_threadsafe` per step. When there is no
work the thread blocks on the command queue (no busy loop).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from consort_engine.config import EngineConfig
from consort_engine.kv.sequence import Sequence

log = logging.getLogger("consort.engine")


class EngineNotReady(Exception):
    """Raised by `add` while the engine is loading or warming up (-> 429 warming)."""

    def __init__(self, state: str, retry_after_ms: int):
        super().__init__(f"engine is {state}")
        self.state = state
        self.retry_after_ms = retry_after_ms


class EngineFailed(Exception):
    """The engine could not start, or a step raised while this request was in flight."""


@dataclass
class _Add:
    seqs: list[Sequence]     # admitted together, in one command: all of them or none
    future: concurrent.futures.Future


@dataclass
class _Abort:
    seq_id: int
    reason: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


class RequestStream:
    """Per-request output channel; async-iterates the engine's StepOutputs until one is finished."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.admitted_at: float | None = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def drain_nowait(self) -> list:
        """All outputs already delivered (lets a handler coalesce several steps into one write)."""
        items = []
        while not self.finished and not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            items.append(item)
            if item.finished:
                self.finished = True
        return items


@dataclass
class AsyncEngine:
    config: EngineConfig
    engine_factory: Callable[[EngineConfig], Any] | None = None   # default: LLMEngine
    warmup: bool = True
    freeze_heap: bool = False               # the server's one engine: engine.freeze_heap once warm
    state: str = "starting"                 # starting | loading | warming | ready | failed | stopped
    error: str | None = None
    load_s: float | None = None
    warmup_s: float | None = None
    ready_at: float | None = None           # monotonic time the engine turned ready
    engine: Any = None
    _snapshot: dict = field(default_factory=dict)
    _streams: dict[int, RequestStream] = field(default_factory=dict)   # loop thread only
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _cmds: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    _stop: threading.Event = field(default_factory=threading.Event)
    _on_ready: list[Callable[[], None]] = field(default_factory=list)
    _on_failed: list[Callable[[], None]] = field(default_factory=list)   # start-up failed (loop thread)
    _created: float = field(default_factory=time.monotonic)

    # ---- lifecycle (loop thread) ------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="consort-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = "stopped" if self.state != "failed" else self.state

    def on_start(self, ready: Callable[[], None], failed: Callable[[], None]) -> None:
        """Call `ready` (or `failed`, when the model cannot load) on the event loop once start-up ends."""
        self._on_ready.append(ready)
        self._on_failed.append(failed)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def stats(self) -> dict:
        """The engine's latest stats (refreshed by the engine thread after every command batch and step)."""
        return dict(self._snapshot, state=self.state, warm=self.ready)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- requests (loop thread) -------------------------------------------------------------
    async def add(self, seqs: list[Sequence]) -> list[RequestStream]:
        """Admit every sequence of `seqs` in one command, so they enter the same step (the n samples of a
        prompt share its prefill), or none of them; raise the engine's AdmissionRejected,
        EngineNotReady, EngineFailed."""
        if self.state != "ready":
            if self.state == "failed":
                raise EngineFailed(self.error or "engine failed to start")
            # Time spent starting so far is the best guess of what is left (as the core's admission does).
            elapsed_ms = (time.monotonic() - self._created) * 1000.0
            raise EngineNotReady(self.state, max(250, int(elapsed_ms)))
        streams = [RequestStream(seq) for seq in seqs]
        for stream in streams:
            self._streams[stream.seq.seq_id] = stream
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Add(list(seqs), fut))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            for seq in seqs:
                self._streams.pop(seq.seq_id, None)
            if not fut.done() or fut.cancelled() or fut.exception() is None:
                for seq in seqs:   # cancelled while waiting: undo if they got in
                    self._cmds.put(_Abort(seq.seq_id, "abort"))
            raise
        now = time.monotonic()
        for stream in streams:
            stream.admitted_at = now
        return streams

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        """Stop a sequence now (client gone, stop string found); its blocks are freed by the engine thread."""
        self._streams.pop(seq_id, None)
        self._cmds.put(_Abort(seq_id, reason))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (for diagnostics and tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            stream = self._streams.get(out.seq_id)
            if stream is None:
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                self._streams.pop(out.seq_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(exc)

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._start_engine()
        except BaseException as e:  # noqa: BLE001 - reported through /ready and /v1/status
            self.error = f"{type(e).__name__}: {e}"
            self.state = "failed"
            log.error("engine failed to start:\n%s", traceback.format_exc())
            for cb in self._on_failed:
                self._loop.call_soon_threadsafe(cb)
            return
        self.state = "ready"
        self.ready_at = time.monotonic()
        for cb in self._on_ready:
            self._loop.call_soon_threadsafe(cb)
        try:
            self._loop_steps()
        finally:
            close = (getattr(self.engine, "close", None)   # LLMEngine.close: tier flush, then the runner
                     or getattr(getattr(self.engine, "runner", None), "close", None))
            if close is not None:
                close()   # tensor-parallel worker ranks stop with the loop

    def _start_engine(self) -> None:
        self.state = "loading"
        t0 = time.monotonic()
        factory = self.engine_factory
        if factory is None:
            from consort_engine.core.engine import LLMEngine
            factory = LLMEngine
        self.engine = factory(self.config)
        self.load_s = time.monotonic() - t0
        log.info("model loaded in %.2f s", self.load_s)
        self._refresh()
        if self.warmup:
            self.state = "warming"
            t1 = time.monotonic()
            warm = getattr(self.engine, "warmup", None) or self.engine.runner.warmup
            warm()   # LLMEngine.warmup runs the runner's prefill + decode shapes and opens admission
            self.warmup_s = time.monotonic() - t1
            log.info("warmup done in %.2f s", self.warmup_s)
        if self.freeze_heap:
            from consort_engine.core.engine import freeze_heap
            freeze_heap()
        self._refresh()

    def _refresh(self) -> None:
        try:
            self._snapshot = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - a stats bug must not stop serving
            log.exception("engine.stats() failed")

    def _apply(self, cmd: Any) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                engine.add_requests(cmd.seqs)
            except BaseException as e:  # AdmissionRejected and validation errors go back to the handler
                cmd.future.set_exception(e)
            else:
                cmd.future.set_result(None)
        elif isinstance(cmd, _Abort):
            try:
                engine.abort(cmd.seq_id, cmd.reason)
            except Exception:  # noqa: BLE001
                log.exception("abort(%s) failed", cmd.seq_id)
        elif isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                result = cmd.fn(engine)
            except BaseException as e:
                cmd.future.set_exception(e)
            else:
                # before the answer: a client told "loaded" must find it in /v1/status (the batch's own
                # refresh came after the answer, and a quick status read saw the adapter missing)
                self._refresh()
                cmd.future.set_result(result)

    def _loop_steps(self) -> None:
        engine, cmds = self.engine, self._cmds
        while not self._stop.is_set():
            busy = engine.has_unfinished()
            try:
                cmd = cmds.get_nowait() if busy else cmds.get(timeout=5.0)
            except queue.Empty:
                cmd = False
            while cmd is not False:
                if cmd is None:   # shutdown
                    return
                self._apply(cmd)
                try:
                    cmd = cmds.get_nowait()
                except queue.Empty:
                    cmd = False
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - fail the in-flight requests, keep serving
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._recover(e)
                    outputs = []
                self._refresh()   # before delivery: a client that got its output sees stats at least this fresh
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
            else:
                self._refresh()

    def _recover(self, exc: Exception) -> None:
        self._loop.call_soon_threadsafe(self._fail_all, EngineFailed(f"engine step failed: {exc}"))
        for seq_id in self._unfinished_ids():
            try:
                self.engine.abort(seq_id, "abort")
            except Exception:  # noqa: BLE001
                log.exception("abort(%s) after a failed step", seq_id)

    def _unfinished_ids(self) -> list[int]:
        sched = getattr(self.engine, "scheduler", None)
        ids = []
        for name in ("running", "waiting"):
            ids += [s.seq_id for s in getattr(sched, name, [])]
        return ids
