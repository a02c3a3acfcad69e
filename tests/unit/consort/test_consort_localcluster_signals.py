"""hack/localcluster's main() run inside another process (the e2e tests call it in pytest's own)
leaves that process's SIGPIPE handling as it was: Python ignores SIGPIPE, so a write to a closed pipe
or socket is an exception, not the death of the whole test run. Only `python -m localcluster`, the
command, restores the default (so `status | head` ends quietly)."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "hack"))
from localcluster import commands  # noqa: E402  (hack/localcluster)


def test_main_in_process_leaves_sigpipe_alone(tmp_path, capsys):
    before = signal.getsignal(signal.SIGPIPE)
    assert commands.main(["status", "--dir", str(tmp_path / "cluster"), "--bin-dir", str(tmp_path / "bin")]) == 1
    assert "not running" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN
