"""`consort bench kv --quick` end to end: six real engines (three with a shared KV tier directory), four
real routers, the multi-turn workload in every arm, an engine restart mid-arm and the shared-tier
check. Asserts the report's shape and what does not depend on timing: every turn answered, a pool at
least 4x smaller than the working set, the tier serving blocks another process computed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1500)

CONSORT = str(Path(sys.executable).with_name("consort"))
ARMS = ["affinity", "precise", "precise-2-routers", "precise+tier"]


@pytest.fixture(scope="module")
def run(demo_model):
    p = subprocess.run([CONSORT, "bench", "kv", "--model", str(demo_model), "--quick", "--json"],
                       capture_output=True, text=True, timeout=1400)
    assert p.returncode == 0, p.stderr[-3000:]
    text, _, raw = p.stdout.partition("\n{")
    return text, json.loads("{" + raw), p.stderr


def test_every_arm_answers_every_turn(run):
    _, res, progress = run
    assert [r["arm"] for r in res["arms"]] == ARMS
    for r in res["arms"]:
        assert r["requests"] == 14 * 3 and r["ok"] == r["requests"], r
        assert r["output_tokens"] == r["ok"] * 4, r           # ignore_eos: max_tokens every turn
        assert 0 < r["hit_rate"] < 1, r                      # the shared system prompt at least
    assert [r["routers"] for r in res["arms"]] == [1, 1, 2, 1]
    assert sum(r["tier_hit_rate"] for r in res["arms"][:3]) == 0       # no tier there
    assert res["arms"][3]["counters"]["tier_cache_hits"] > 0           # the restarted replica's at least
    for arm in ARMS:
        assert f"bench: arm {arm} ..." in progress


def test_working_set_is_several_pools(run):
    _, res, _ = run
    assert res["working_set_blocks"] >= 4 * res["pool_blocks"], res


def test_tier_serves_another_process_blocks(run):
    """The restarted replica and a second replica on the same directory both load blocks they never
    computed; what replica 1 left on disk is a prefix of the continued conversation's blocks."""
    _, res, _ = run
    rs, sh = res["restart"], res["shared"]
    assert rs["conversations"] > 0 and rs["held_tokens"] > 0, rs
    assert 0 < rs["cached_tokens"] <= rs["held_tokens"], rs     # their answers' cached_tokens, up to what was held
    assert sh["ok"] and sh["on_disk_tokens"] > 0, sh
    assert 0 < sh["tier_tokens"] <= sh["on_disk_tokens"], sh


def test_report_names_cpu_targets_and_arms(run):
    text, _, _ = run
    assert "avx512f" in text and "amx_tile" in text and "CPU:" in text
    for arm in ARMS:
        assert f"\n  {arm} " in text
    for target in ("target >= 3x", "target within 5", "target >= 90%"):
        line = next(ln for ln in text.splitlines() if target in ln)
        assert "PASS" in line or "MISS" in line, line
