"""An engine started inside a real memory cgroup (what a pod's resources.limits.memory makes) sizes its
KV pool from what the limit leaves, not from the node's /proc/meminfo: a pool sized from the node and
committed lazily grows past the limit mid-serving, and the OOM kill takes every accepted request."""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup")
V2 = (ROOT / "cgroup.controllers").exists()
PARENT = ROOT if V2 else ROOT / "memory"
LIMIT = 3 << 30

SIZE_POOL = """
import json, sys
from consort_engine.config import EngineConfig
from consort_engine.model.model_runner import ModelRunner, mem_available
import torch
r = ModelRunner(EngineConfig(model=sys.argv[1], max_num_seqs=128))
print(json.dumps({"pool": r.num_blocks * r.block_bytes, "available": mem_available(torch.device("cpu"))}))
"""


def can_make_memory_cgroups() -> bool:
    if os.geteuid() != 0 or not os.access(PARENT, os.W_OK):
        return False
    if not V2:
        return (PARENT / "memory.limit_in_bytes").exists()
    try:   # a v2 root with processes of its own cannot enable controllers for children (EBUSY)
        (ROOT / "cgroup.subtree_control").write_text("+memory")
        return True
    except OSError:
        return False


@pytest.fixture
def memory_cgroup():
    """make(limit) -> a fresh memory cgroup; each is removed at the end (its processes have exited)."""
    made = []

    def make(limit: int) -> Path:
        d = PARENT / f"consort-test-{uuid.uuid4().hex[:8]}"
        d.mkdir()
        made.append(d)
        (d / ("memory.max" if V2 else "memory.limit_in_bytes")).write_text(str(limit))
        return d

    yield make
    for d in made:
        d.rmdir()


def size_pool_in(cgroup: Path | None, model: Path) -> subprocess.CompletedProcess:
    join = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    return subprocess.run([sys.executable, "-c", SIZE_POOL, str(model)], capture_output=True, text=True, timeout=300,
                          preexec_fn=join, env=os.environ)


@pytest.mark.skipif(not can_make_memory_cgroups(), reason="needs root and a writable cgroup memory controller")
def test_the_kv_pool_fits_the_cgroup_limit_not_the_node(memory_cgroup, tmp_path):
    from consort_engine.demo_model import write_demo_model

    # 16k positions x 128 sequences: the cap from the config alone is 8 GiB of KV, far above the limit
    model = write_demo_model(tmp_path / "demo", max_pos=16384, seed=0)
    out = size_pool_in(memory_cgroup(LIMIT), model)
    assert out.returncode == 0, out.stderr[-2000:]
    sized = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < sized["available"] <= LIMIT
    assert 0 < sized["pool"] <= LIMIT // 2          # kv_memory_fraction 0.5 of what the limit leaves
    # the same sizing outside the cgroup sees the node: more than the limit wherever the node has room
    outside = size_pool_in(None, model)
    assert outside.returncode == 0, outside.stderr[-2000:]
    node = json.loads(outside.stdout.strip().splitlines()[-1])
    assert node["available"] > sized["available"]
    if node["available"] > 4 * LIMIT:
        assert node["pool"] > LIMIT
    # a limit that leaves nothing after the activation reserve (~1.3 GiB at 16k positions): a start-up
    # error that says what to change
    starved = size_pool_in(memory_cgroup(1 << 30), model)
    assert starved.returncode != 0
    assert "no memory left for the KV pool" in starved.stderr and "spec.kv.numBlocks" in starved.stderr, \
        starved.stderr[-2000:]
