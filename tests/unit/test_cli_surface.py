"""Every `consort` subcommand, as a real process: `--help` works, and a user's mistake (a missing
path, an unknown choice, a malformed URL) exits non-zero with a line naming the command and the
problem, never a Python traceback (issue 29). No case loads a model: they fail before that."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from consort_operator.cli import NESTED, SUBCOMMANDS

CONSORT = str(Path(sys.executable).with_name("consort"))
BENCHES = ("offline", "roofline", "serve", "structured", "spec", "hybrid", "local", "affinity")
MISSING = "/nonexistent/consort-test"

# argv -> a fragment of the line that must explain the mistake (one case per subcommand at least)
BAD = {
    ("nosuch",): "consort: unknown command 'nosuch'",
    ("engine", "--model", MISSING, "--port", "0"): f"consort engine: fatal: {MISSING} is not a checkpoint directory",
    ("router", "--config", MISSING + ".yaml", "--port", "0"): "consort router: fatal:",
    ("operator", "--warm-signal", "bogus"): "consort operator: error: argument --warm-signal: invalid choice",
    ("up", "-f", MISSING): f"consort up: {MISSING}: no such file or directory",
    ("crds", "--out-dir", MISSING): f"consort crds: {MISSING}/consort.dev.yaml: No such file or directory",
    ("demo-model", "/tmp/unused", "--arch", "gpt2"): "consort demo-model: error: argument --arch: invalid choice",
    ("demo-model", "/tmp/unused", "--lora-for", MISSING): f"consort demo-model: error: argument --lora-for: {MISSING}",
    ("bench", "nosuch"): "consort bench: error: argument cmd: invalid choice",
    ("bench", "offline", "--model", MISSING): f"consort bench offline: error: argument --model: {MISSING}",
    ("bench", "roofline", "--model", MISSING): f"consort bench roofline: error: argument --model: {MISSING}",
    ("bench", "serve", "--url", "127.0.0.1:8080"): "consort bench serve: error: argument --url: '127.0.0.1:8080' is not",
    ("bench", "structured", "--model", MISSING): f"consort bench structured: error: argument --model: {MISSING}",
    ("bench", "spec", MISSING): f"consort bench spec: error: argument model: {MISSING}",
    ("bench", "hybrid", "--device", "tpu"): "consort bench hybrid: error: argument --device: invalid choice",
    ("bench", "local", "-f", MISSING): f"consort bench local: {MISSING}: no such file or directory",
    ("bench", "local", "--specialist", "nope"): "consort bench local: no Specialist nope in",
    ("bench", "affinity", "--model", MISSING): f"consort bench affinity: error: --model {MISSING}: no checkpoint",
}
HELP = [(), *((c,) for c in SUBCOMMANDS), *(("bench", b) for b in BENCHES)]


def consort(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONSORT, *argv], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """Every case at once (a few import torch: seconds each), in parallel."""
    cases = [(*a, "--help") for a in HELP] + list(BAD)
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(cases, pool.map(consort, cases)))


def test_every_bench_and_nested_command_is_covered():
    assert {b for _, b in NESTED} <= set(BENCHES)
    assert {a[0] for a in BAD} >= set(SUBCOMMANDS)


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a) or "consort")
def test_help(runs, argv):
    out = runs[(*argv, "--help")]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("argv", list(BAD), ids=lambda a: " ".join(a))
def test_user_error_is_one_line_not_a_traceback(runs, argv):
    out = runs[argv]
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("consort")]
    assert len(lines) == 1 and BAD[argv] in lines[0], out.stderr[-2000:]
