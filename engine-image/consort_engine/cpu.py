"""How many CPU threads an engine may use: pure functions of the cgroup files and the affinity.

An engine that takes torch's default (every core it sees) oversubscribes the machine as soon as a
second engine runs beside it: three engines on two cores ran at 0.22x of one. So the engine sizes
its torch and OpenMP pools to its share: `--threads N` when a supervisor (`consort up`) planned
it, else the container's CPU quota (a pod's `resources.limits.cpu`), else the cores it may run on.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> float | None:
    """CPUs allowed by the CFS quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
    or None when there is no quota."""
    v2 = root / "cpu.max"
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for d in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def engine_threads(requested: int | None, quota: float | None, usable_cores: int) -> int:
    """Threads for the engine's compute pools: the planned number, else the quota rounded up
    (a 1.5-CPU quota runs 2 threads that together get 1.5 CPUs), never more than the cores."""
    if requested:
        return max(1, min(requested, usable_cores))
    if quota is not None:
        return max(1, min(math.ceil(quota - 1e-9), usable_cores))
    return max(1, usable_cores)


def apply_threads(requested: int | None) -> int:
    """Size torch's and OpenMP's pools before any parallel work starts; returns the count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = engine_threads(requested, cgroup_cpu_limit(), cores)
    os.environ["OMP_NUM_THREADS"] = str(n)   # the C kernels' OpenMP runtime reads it when it loads
    from .cpu_kernels import set_threads

    set_threads(n)
    return n
