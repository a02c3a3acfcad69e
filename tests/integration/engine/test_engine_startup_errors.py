"""Fatal start-up errors exit the engine non-zero at once, with the cause as the last line, so a
supervisor (`consort up`, kubelet) restarts it or shows why instead of waiting on a dead engine."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import pytest

import procs


def run_engine(*args: str, timeout: float = 90) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out = subprocess.run([procs.CONSORT, "engine", "--host", "127.0.0.1", *args], capture_output=True, text=True,
                         timeout=timeout)
    return out.returncode, (out.stdout + out.stderr).strip().splitlines()[-1], time.monotonic() - t0


def test_unsupported_architecture_exits_1_with_the_cause_last(demo_model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(demo_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["FooForCausalLM"], model_type="foo")
    (bad / "config.json").write_text(json.dumps(cfg))
    code, last, _ = run_engine("--model", str(bad), "--port", "0")
    assert code == 1
    assert last.startswith("consort engine: fatal:") and "unsupported model_type 'foo'" in last, last


@pytest.mark.parametrize("case", ["missing-model", "port-in-use"])
def test_bad_model_dir_or_busy_port_exits_1_naming_it(demo_model, tmp_path, case):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if case == "missing-model":
            code, last, took = run_engine("--model", str(tmp_path / "nope"), "--port", "0")
            assert code == 1 and f"{tmp_path / 'nope'} is not a checkpoint directory" in last, last
        else:
            code, last, took = run_engine("--model", str(demo_model), "--port", str(port))
            assert code == 1 and "fatal:" in last and str(port) in last, last
    assert took < 60
