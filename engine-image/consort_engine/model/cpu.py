"""How many CPU threads and how much memory an engine may use: pure functions of the cgroup files,
/proc/meminfo and the affinity.

An engine that takes torch's default (every core it sees) oversubscribes the machine as soon as a
second engine runs beside it: three engines on two cores ran at 0.22x of one. So the engine sizes
its torch and OpenMP pools to its share: `--threads N` when a supervisor (`consort up`) planned
it, else the container's CPU quota (a pod's `resources.limits.cpu`), else the cores it may run on.

The same holds for memory: /proc/meminfo describes the node, not the pod. A CPU engine sized its KV
pool from it, committed lazily, and grew past its pod's `resources.limits.memory` mid-serving (an OOM
kill of every accepted request); the pool is sized from what the cgroup leaves instead.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
V1_NO_LIMIT = 1 << 62    # cgroup v1 writes "no limit" as 2^63 - 1 rounded down to a page


def _self_cgroup() -> str:
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


def cgroup_dirs(root: Path, controller: str, self_cgroup: str | None = None) -> list[Path]:
    """Directories that may hold this process's `controller` files, most specific first: v2 before v1;
    under each mount the process's own cgroup (`self_cgroup` is /proc/self/cgroup, read when None: a
    host or a systemd unit sees the whole tree) before the mount itself (a container sees its own
    cgroup there)."""
    v2, v1 = [], []
    for line in (_self_cgroup() if self_cgroup is None else self_cgroup).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].lstrip("/")
        if controllers == "":
            v2.append(root / path)
        elif controller in controllers.split(","):
            v1 += [root / controllers / path, root / controller / path]
    v1_mounts = [root / controller] + [root / m for m in (f"{controller},cpuacct", f"cpuacct,{controller}")
                                       if controller == "cpu"]
    dirs = v2 + [root] + v1 + v1_mounts
    return list(dict.fromkeys(dirs))


def cgroup_cpu_limit(root: Path = CGROUP, self_cgroup: str | None = None) -> float | None:
    """CPUs allowed by the CFS quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
    or None when there is no quota."""
    dirs = cgroup_dirs(root, "cpu", self_cgroup)
    for d in dirs:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        except (OSError, ValueError):
            pass
    for d in dirs:
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def cgroup_memory_available(root: Path = CGROUP, self_cgroup: str | None = None) -> int | None:
    """Bytes the cgroup's memory limit still leaves (limit - usage + reclaimable page cache), or None
    without a limit. v2: `memory.max` / `memory.current` of the process's cgroup and every parent up to
    the mount (a limit on a parent binds a child, e.g. a systemd slice), the smallest headroom; v1:
    `memory.limit_in_bytes` and the parents' `hierarchical_memory_limit` / `memory.usage_in_bytes`. Both
    count page cache as usage, which the kernel reclaims before it OOM-kills, so inactive file pages
    count as available."""
    for d in cgroup_dirs(root, "memory", self_cgroup):
        if (d / "memory.max").exists():
            found = [a for a in map(_v2_headroom, [d, *(p for p in d.parents if p == root or root in p.parents)])
                     if a is not None]
            return min(found) if found else None
        if (d / "memory.limit_in_bytes").exists():
            return _v1_headroom(d)
    return None


def _v2_headroom(d: Path) -> int | None:
    try:
        limit = (d / "memory.max").read_text().strip()
        usage = int((d / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - usage + _memory_stat(d / "memory.stat").get("inactive_file", 0))


def _v1_headroom(d: Path) -> int | None:
    try:
        limit = int((d / "memory.limit_in_bytes").read_text())
        usage = int((d / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    stat = _memory_stat(d / "memory.stat")
    limit = min(limit, stat.get("hierarchical_memory_limit", limit))
    if limit >= V1_NO_LIMIT:
        return None
    return max(0, limit - usage + stat.get("total_inactive_file", 0))


def _memory_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split()[:2] for line in lines if len(line.split()) >= 2)}


def memory_available(meminfo: str, cgroup_available: int | None) -> int:
    """Bytes an engine may still commit: the node's MemAvailable, capped by its cgroup's headroom."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            node = int(line.split()[1]) * 1024
            return node if cgroup_available is None else min(node, cgroup_available)
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


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
    from consort_engine.model.cpu_kernels import set_threads

    set_threads(n)
    return n
