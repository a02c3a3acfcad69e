"""The CPU a benchmark ran on: its model and the vector / matrix flags the figures depend on."""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


# read once: the engine asks per linear layer at load, and /proc/cpuinfo is large on big hosts
@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or "unknown CPU", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown CPU", ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def machine() -> str:
    """CPU model, CPU count and which of CPU_FLAGS it has."""
    model, flags = cpu_model_and_flags()
    have = [f for f in CPU_FLAGS if f in flags]
    return f"{model}; {os.cpu_count()} CPUs; flags: {' '.join(have) or 'none of ' + ' '.join(CPU_FLAGS)}"
