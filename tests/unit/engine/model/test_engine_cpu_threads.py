"""Engine thread sizing from a plan, a cgroup CPU quota (v1 and v2) or the affinity."""
import os
import threading

import pytest
import torch

from consort_engine.model.cpu import apply_threads, cgroup_cpu_limit, engine_threads
from consort_engine.model.cpu_kernels import cpu_kernels


def test_cgroup_v2_and_v1_quotas(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(v2) is None
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "v1") == 0.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path / "v1") is None
    assert cgroup_cpu_limit(tmp_path / "nothing") is None


def test_threads_from_plan_then_quota_then_cores():
    assert engine_threads(1, quota=4.0, usable_cores=8) == 1          # a supervisor's plan wins
    assert engine_threads(16, quota=None, usable_cores=8) == 8         # never more than the cores
    assert engine_threads(None, quota=1.5, usable_cores=8) == 2
    assert engine_threads(None, quota=0.4, usable_cores=8) == 1
    assert engine_threads(None, quota=2.0, usable_cores=8) == 2
    assert engine_threads(None, quota=None, usable_cores=2) == 2


@pytest.mark.skipif(cpu_kernels() is None, reason="needs a C compiler (the kernels are built at run time)")
def test_the_c_kernels_run_the_planned_team_from_any_thread():
    """torch.set_num_threads only sets OpenMP's default for the calling thread; the engine calls the C
    kernels from its loop thread, which must still run the planned team (not every core)."""
    lib = cpu_kernels()
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            assert apply_threads(n) == min(n, len(os.sched_getaffinity(0)))
            seen = []
            t = threading.Thread(target=lambda: seen.append(lib.team_size()))
            t.start()
            t.join()
            assert seen == [torch.get_num_threads()], (n, seen)
            assert lib.team_size() == torch.get_num_threads()
    finally:
        apply_threads(before)
