"""Fatal start-up errors exit the router non-zero at once, with the cause as the last line and no
traceback, so a supervisor (`consort up`, kubelet) shows why it died."""
from __future__ import annotations

import socket
import subprocess
import time

import pytest

import procs

GOOD = "ensemble: cpp\nspecialists:\n  - name: algo\n    replicas: ['http://127.0.0.1:9']\n"


def run_router(config, port: int) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out = subprocess.run([procs.CONSORT, "router", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                         capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    return out.returncode, out.stderr.strip().splitlines()[-1], time.monotonic() - t0


@pytest.mark.parametrize("case, text, cause", [
    ("invalid", "ensemble: cpp\nspecialists: []\nbogus: 1\n", "specialists: List should have at least 1 item"),
    ("not-yaml", "ensemble: [\n", "expected the node content"),
    ("missing", None, "No such file or directory"),
])
def test_bad_config_exits_non_zero_with_the_cause_last(tmp_path, case, text, cause):
    config = tmp_path / "router.yaml"
    if text is not None:
        config.write_text(text)
    code, last, took = run_router(config, procs.free_port())
    assert code != 0
    assert last.startswith("consort router: fatal:") and cause in last, last
    if case == "invalid":
        assert str(config) in last and "bogus: Extra inputs are not permitted" in last, last
    assert took < 30


def test_busy_port_exits_1_naming_the_port(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(GOOD)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, last, took = run_router(config, port)
    assert code == 1
    assert last.startswith("consort router: fatal:") and str(port) in last and "in use" in last, last
    assert took < 30
