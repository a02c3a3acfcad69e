"""`consort bench local`: engines alone, then `consort up -f examples/local` under load at once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CONSORT = str(Path(sys.executable).with_name("consort"))


@pytest.mark.timeout(400)
def test_bench_local_starts_the_ensemble_and_reports_the_ratio():
    out = subprocess.run([CONSORT, "bench", "local", "-f", str(REPO / "examples" / "local"), "--specialist", "algo",
                          "--specialist", "stl", "--requests", "4", "--concurrency", "2", "--prompt-words", "40",
                          "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=380, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["specialists"] == ["algo", "stl"] and r["failures"] == 0
    assert r["plan"].startswith("CPU plan on cores") and "algo" in r["plan"]
    for name in ("algo", "stl"):
        assert r["alone"][name]["output_tokens"] == 4 * 8 and r["together"][name]["output_tokens"] == 4 * 8
    assert r["ratio"] == pytest.approx(r["aggregate_tok_s"] / r["mean_alone_tok_s"]) and r["ratio"] > 0
    assert "| algo |" in out.stdout and f"**{r['ratio']:.2f}x**" in out.stdout
