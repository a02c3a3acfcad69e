"""The x86-64 levels' builds of the CPU kernels, for tests that run every build this CPU can run (a helper
module, not a conftest.py: router tests import their own conftest by that name)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from consort_common.machine import cpu_model_and_flags
from consort_engine.model import cpu_kernels as ck

# The x86-64 levels' builds this CPU runs (LEVELS: the engine image prebuilds one per level).
RUNNABLE_LEVELS = ck.runnable_levels(cpu_model_and_flags()[1])
ON_X86_64 = pytest.mark.skipif(not RUNNABLE_LEVELS, reason="the engine image's builds are for x86-64 CPUs")


def build_levels(tmp_path_factory: pytest.TempPathFactory, *stems: str) -> dict[str, Path]:
    """{level: library}: the kernel sources of those stems (csrc/<stem>.c) built for each runnable level, so a
    test runs every build the engine image ships that this CPU can run (none off x86-64: the tests carry
    ON_X86_64)."""
    sources = [p for p in ck.SOURCES if p.stem in stems]
    out = {}
    for level in RUNNABLE_LEVELS:
        out[level] = tmp_path_factory.mktemp("levels") / f"{'-'.join(stems)}-{level}.so"
        ck.compile_sources(out[level], level, sources=sources)
    return out


def each_build(libraries: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each library of build_levels in turn as the engine's kernels (cpu_kernels()); yields its level."""
    for level, so in libraries.items():
        monkeypatch.setattr(ck, "_lib", ck.load_library(so))
        yield level
