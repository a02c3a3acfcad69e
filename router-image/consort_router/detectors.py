"""Structural detectors: prompts that trip one go to its specialist regardless of the classifier.

A detector counts regex occurrences in the prompt's first DETECTOR_SCAN_CHARS: its built-in pattern
set, searched here, plus the EnsembleRouter's own patterns, searched in a child process with a
deadline (PatternSandbox); `min_matches` or more trips it. Detectors are checked in configuration
order; the first that trips wins.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from .api import DETECTOR_SCAN_CHARS, USER_PATTERN_TIMEOUT_S

if TYPE_CHECKING:
    from .config import Detector

log = logging.getLogger("consort.router")

# Each occurrence of any pattern counts once. Case-sensitive, multiline. Every pattern runs in time
# linear in the prompt: a match attempt scans a bounded stretch (to the next line, or the next
# "template" / "Thread" keyword), never to the end of the text from every start. The old
# `template\s*<[^;{}]*\btypename\s*=` scanned to the next ; { } from every "template": 64 KB of
# "template<" took 2.7 s of the event loop (test_router_detectors.py keeps them linear).
BUILTIN_PATTERNS: dict[str, tuple[str, ...]] = {
    "sfinae_templates": (
        r"\benable_if(?:_t)?\b",
        r"\bvoid_t\b",
        r"\bdecltype\s*\(",
        r"\bstd::declval\b",
        r"\brequires\b",
        r"\bconcept\b",
        r"template\s*<(?:(?!template\b)[^;{}])*?\btypename\s*=",   # a defaulted type parameter in this head
        r"\bstd::is_\w+(?:_v)?\b",
        r"\bconditional_t\b",
        r"\bSFINAE\b",
        r"::value\b",
        r"typename\s+\w+::type\b",
    ),
    "build_files": (
        r"\bcmake_minimum_required\b",
        r"\badd_(?:executable|library|subdirectory|compile_options)\s*\(",
        r"\btarget_(?:link_libraries|include_directories|compile_features|compile_definitions)\s*\(",
        r"\bfind_package\s*\(",
        r"\bCMakeLists\.txt\b",
        r"\bCMAKE_[A-Z_]+\b",
        r"\bcc_(?:library|binary|test)\s*\(",
        r"\b(?:BUILD\.bazel|WORKSPACE|MODULE\.bazel)\b",
        r"\bbazel\s+(?:build|test|run)\b",
        r'\bload\(\s*"@',
        r"\bdeps\s*=\s*\[",
        r"\bmake(?:\[\d+\])?:\s",
        r"\bninja:\s",
        r"\bcollect2: error\b",
        r"\bundefined reference to\b",
    ),
    "gdb_transcript": (
        r"^\(gdb\)",
        r"\bProgram received signal\b",
        r"^#\d+\s+0x[0-9a-fA-F]+ in ",
        r"^#\d+\s+[\w:<>~]+\s*\(",
        r"\bBreakpoint \d+\b",
        r"\bSIG(?:SEGV|ABRT|BUS|FPE|ILL)\b",
        r"\bSegmentation fault\b",
        r"\bcore dumped\b",
        r"\bAddressSanitizer\b",
        r"^\(lldb\)",
        r"\bframe #\d+",
        r"\bThread \d+ (?:(?!Thread )[^\n])*?received signal\b",  # to the line's end or the next "Thread "
    ),
}

SCAN_LIMIT = DETECTOR_SCAN_CHARS
CHILD_START_S = 30.0     # a fresh interpreter on a busy node


def _alternation(patterns: Sequence[str]) -> str:
    return "|".join(f"(?:{p})" for p in patterns)


def _count(regex: re.Pattern[str], text: str, stop_at: int | None = None) -> int:
    n = 0
    for _ in regex.finditer(text, 0, SCAN_LIMIT):
        n += 1
        if stop_at is not None and n >= stop_at:
            break
    return n


@dataclass(frozen=True)
class CompiledDetector:
    name: str
    specialist: str
    regex: re.Pattern[str] | None    # the built-in set, searched in-process (linear)
    user_pattern: str | None         # the EnsembleRouter's patterns as one alternation (PatternSandbox)
    min_matches: int

    def count(self, text: str, stop_at: int | None = None) -> int:
        """Occurrences of the built-in patterns."""
        return _count(self.regex, text, stop_at) if self.regex is not None else 0


def compile_detector(d: Detector) -> CompiledDetector:
    builtin = re.compile(_alternation(BUILTIN_PATTERNS[d.builtin]), re.MULTILINE) if d.builtin else None
    return CompiledDetector(d.name, d.specialist, builtin, _alternation(d.patterns) if d.patterns else None,
                            d.min_matches)


def user_patterns(detectors: list[CompiledDetector]) -> tuple[str | None, ...] | None:
    """Each detector's own patterns (None where it has none), or None when no detector has any."""
    pats = tuple(d.user_pattern for d in detectors)
    return pats if any(pats) else None


def detect(detectors: list[CompiledDetector], text: str,
           user_counts: Sequence[int] | None = None) -> CompiledDetector | None:
    """The first detector (in order) that trips on `text`, or None. user_counts: each detector's
    occurrences of its own patterns, from PatternSandbox; None counts them here (tests, tools)."""
    for i, d in enumerate(detectors):
        n = d.count(text, stop_at=d.min_matches)
        if n < d.min_matches and d.user_pattern is not None:
            n += (user_counts[i] if user_counts is not None else
                  _count(re.compile(d.user_pattern, re.MULTILINE), text, d.min_matches - n))
        if n >= d.min_matches:
            return d
    return None


def _serve(conn) -> None:
    """The child: (patterns, text, stop_at) in, each pattern's count out, until the pipe closes."""
    conn.send("ready")
    while True:
        try:
            patterns, text, stop_at = conn.recv()
        except EOFError:
            return
        conn.send([_count(re.compile(p, re.MULTILINE), text, n) if p else 0 for p, n in zip(patterns, stop_at)])


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
