"""KV pool sizing on CPU sees the cgroup's memory limit (a pod's resources.limits.memory), v1 and v2."""
import pytest

from consort_engine.model.cpu import cgroup_dirs, cgroup_memory_available, memory_available

GiB, MiB = 1 << 30, 1 << 20
V1_UNLIMITED = "9223372036854771712\n"


def write(d, **files):
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)


def test_v2_limit_minus_usage_plus_reclaimable_page_cache(tmp_path):
    write(tmp_path, memory_max=f"{2 * GiB}\n", memory_current=f"{GiB}\n",
          memory_stat=f"anon 900\nfile 200\ninactive_file {100 * MiB}\n")
    assert cgroup_memory_available(tmp_path, "0::/\n") == GiB + 100 * MiB
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_available(tmp_path, "0::/\n") is None


def test_v1_limit_takes_the_parents_hierarchical_limit_too(tmp_path):
    write(tmp_path / "memory", memory_limit_in_bytes=f"{GiB}\n", memory_usage_in_bytes=f"{256 * MiB}\n",
          memory_stat=f"cache 5\ntotal_inactive_file {64 * MiB}\nhierarchical_memory_limit {512 * MiB}\n")
    assert cgroup_memory_available(tmp_path, "4:memory:/\n") == 512 * MiB - 256 * MiB + 64 * MiB
    write(tmp_path / "memory", memory_limit_in_bytes=V1_UNLIMITED, memory_stat=f"hierarchical_memory_limit {V1_UNLIMITED}")
    assert cgroup_memory_available(tmp_path, "4:memory:/\n") is None
    assert cgroup_memory_available(tmp_path / "nothing", "4:memory:/\n") is None


def test_own_cgroup_first_then_the_mount_a_container_sees(tmp_path):
    # a host (or a systemd unit) sees the whole tree: its own cgroup is the one with the limit
    write(tmp_path / "memory", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes="0\n")
    write(tmp_path / "memory" / "svc" / "engine", memory_limit_in_bytes=f"{GiB}\n", memory_usage_in_bytes="0\n")
    own = "5:cpu,cpuacct:/\n4:memory:/svc/engine\n0::/\n"
    assert cgroup_dirs(tmp_path, "memory", own)[:2] == [tmp_path, tmp_path / "memory" / "svc" / "engine"]
    assert cgroup_memory_available(tmp_path, own) == GiB
    # a container: /proc/self/cgroup names the host's path, the mount holds the container's own cgroup
    write(tmp_path / "memory", memory_limit_in_bytes=f"{2 * GiB}\n", memory_usage_in_bytes=f"{GiB}\n")
    assert cgroup_memory_available(tmp_path, "4:memory:/kubepods/burstable/pod1/ctr\n") == GiB


def test_memory_available_is_the_node_capped_by_the_cgroup():
    meminfo = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n"
    assert memory_available(meminfo, None) == 20000000 * 1024
    assert memory_available(meminfo, GiB) == GiB
    assert memory_available(meminfo, 10**15) == 20000000 * 1024
    with pytest.raises(RuntimeError, match="MemAvailable"):
        memory_available("MemTotal: 1 kB\n", None)


def test_v2_a_parents_limit_binds_a_child_without_one(tmp_path):
    """systemd slices, batch schedulers: the limit sits on a parent of the process's own cgroup."""
    write(tmp_path / "job", memory_max=f"{2 * GiB}\n", memory_current=f"{GiB}\n", memory_stat="inactive_file 0\n")
    write(tmp_path / "job" / "step" / "task", memory_max="max\n", memory_current=f"{GiB // 2}\n")
    write(tmp_path / "job" / "step", memory_max=f"{8 * GiB}\n", memory_current=f"{GiB}\n")
    write(tmp_path, memory_max="max\n", memory_current=f"{4 * GiB}\n")         # outside the job: not counted
    assert cgroup_memory_available(tmp_path, "0::/job/step/task\n") == GiB
