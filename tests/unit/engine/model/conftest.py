"""Fixtures of the CPU kernel tests."""
from __future__ import annotations

import pytest

from consort_common.machine import cpu_model_and_flags
from consort_engine.model import cpu_kernels as ck

# The x86-64 levels' builds this CPU runs (LEVELS: the engine image prebuilds one per level).
RUNNABLE_LEVELS = ck.runnable_levels(cpu_model_and_flags()[1])


@pytest.fixture(scope="module")
def level_builds(tmp_path_factory):
    """build(*stems) -> {level: library path}: the kernel sources of those stems (csrc/<stem>.c) built for
    each runnable level, so a test runs every build the engine image ships that this CPU can run."""
    def build(*stems: str) -> dict:
        if not RUNNABLE_LEVELS:
            pytest.skip("the engine image's builds are for x86-64 CPUs")
        sources = [p for p in ck.SOURCES if p.stem in stems]
        out = {}
        for level in RUNNABLE_LEVELS:
            out[level] = tmp_path_factory.mktemp("levels") / f"{'-'.join(stems)}-{level}.so"
            ck.compile_sources(out[level], level, sources=sources)
        return out
    return build
