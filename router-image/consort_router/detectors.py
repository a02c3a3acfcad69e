"""The EnsembleRouter's own detector patterns, searched in a child process with a deadline.

Routing (routing.py) matches the built-in pattern sets in-process; patterns a user wrote may
backtrack for seconds on a crafted prompt, so PatternSandbox counts them here and hands the counts
to routing (RouteInput.user_counts).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import re
from typing import Callable

from .api import USER_PATTERN_TIMEOUT_S
from .routing import SCAN_LIMIT, count_matches

log = logging.getLogger("consort.router")

CHILD_START_S = 30.0     # a fresh interpreter on a busy node


def _serve(conn) -> None:
    """The child: (patterns, text, stop_at) in, each pattern's count out, until the pipe closes."""
    conn.send("ready")
    while True:
        try:
            patterns, text, stop_at = conn.recv()
        except EOFError:
            return
        conn.send([count_matches(re.compile(p, re.MULTILINE), text, n) if p else 0 for p, n in zip(patterns, stop_at)])


class PatternSandbox:
    """Searches the EnsembleRouter's own detector patterns in a child process. Python's re holds the GIL
    for a whole search, so a pattern that backtracks for seconds on a crafted prompt would stall the
    router's event loop even from a thread; here it costs at most `timeout_s`: the child is killed, the
    patterns count as no match (a log line, consort_router_detector_timeouts) and the next search starts
    a fresh child. One search at a time, on one worker thread."""

    def __init__(self, timeout_s: float = USER_PATTERN_TIMEOUT_S, on_timeout: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._lock = asyncio.Lock()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn = None

    async def counts(self, patterns: tuple[str | None, ...], text: str, stop_at: tuple[int, ...]) -> tuple[int, ...]:
        async with self._lock:
            try:
                got = await asyncio.to_thread(self._search, patterns, text[:SCAN_LIMIT], stop_at)
            except (OSError, RuntimeError, EOFError):     # no child (or it died): route without them
                log.exception("detector pattern process failed: counted as no match")
                self.close()
                return (0,) * len(patterns)
        if got is None:
            if self.on_timeout is not None:
                self.on_timeout()
            log.warning("detector patterns ran past %.2f s on a %d-character prompt: counted as no match",
                        self.timeout_s, min(len(text), SCAN_LIMIT))
            return (0,) * len(patterns)
        return tuple(got)

    def _search(self, patterns, text: str, stop_at) -> list[int] | None:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((patterns, text, stop_at))
        if self._conn.poll(self.timeout_s):
            return self._conn.recv()
        self.close()
        return None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")     # the router has threads: no fork
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), name="consort-detector-patterns", daemon=True)
        self._proc.start()
        child.close()
        if not (self._conn.poll(CHILD_START_S) and self._conn.recv() == "ready"):    # a start is not a search:
            self.close()                                                            # outside the deadline
            raise RuntimeError(f"the detector pattern process did not start within {CHILD_START_S:g} s")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
            self._proc = self._conn = None
