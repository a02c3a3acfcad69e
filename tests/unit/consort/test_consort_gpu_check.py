"""`make gpu-check` (hack/gpu_check.py) without a GPU: its plan (steps, flags, limits within the 8-minute
budget), `--dry-run`, and the table built from the real benches' JSON shapes and pytest's summary line."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "hack" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod         # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_plan_covers_tests_backends_graphs_and_fp8_within_the_budget(tmp_path):
    gc = gpu_check()
    steps = gc.plan("py", str(tmp_path))
    assert steps[0].argv[:4] == ["py", "-m", "pytest", "tests/gpu"]
    assert sum(s.timeout_s for s in steps) <= gc.BUDGET_S == 480
    offline = [s for s in steps if "offline" in s.argv]
    assert {(s.env["CONSORT_ATTENTION_BACKEND"], "--enforce-eager" in s.argv) for s in offline} == \
        {(b, eager) for b in gc.BACKENDS for eager in (False, True)}
    # transformers runs once (the first offline step); the rest are engine-only against that figure
    assert ["--engine-only" in s.argv for s in offline] == [False] + [True] * (len(offline) - 1)
    for s in offline:
        assert s.argv[s.argv.index("--block-size") + 1] == str(gc.BACKENDS[s.env["CONSORT_ATTENTION_BACKEND"]])
        assert s.argv[s.argv.index("--dtype") + 1] == "bfloat16" and "cuda" in s.argv
    quant = steps[-1]
    assert quant.argv[quant.argv.index("--arms") + 1] == "bfloat16:none,bfloat16:fp8"
    assert len({s.json_path for s in steps[1:]}) == len(steps) - 1


def test_plan_arguments_parse_as_the_benches_own(tmp_path):
    """Every bench step's arguments are accepted by `consort bench`'s real parser."""
    import argparse
    from consort_engine.bench import offline, quant
    gc = gpu_check()
    for s in gc.plan("py", str(tmp_path))[1:]:
        p = argparse.ArgumentParser()
        sub = p.add_subparsers(dest="cmd")
        offline.add_args(sub.add_parser("offline"))
        quant.add_args(sub.add_parser("quant"))
        args = p.parse_args(s.argv[s.argv.index("bench") + 1:])
        assert args.device == "cuda" and args.json == s.json_path


def test_dry_run_lists_every_step(capsys):
    gc = gpu_check()
    assert gc.main(["--dry-run", "--python", "py"]) == 0
    out = capsys.readouterr().out
    for s in gc.plan("py", "x"):
        assert s.name in out
    assert "CONSORT_ATTENTION_BACKEND=triton" in out and "total limit" in out


def test_table_from_bench_json_and_pytest_summary():
    from consort_engine.bench.offline import DtypeResult
    gc = gpu_check()
    steps = gc.plan("py", "x")
    first = [asdict(DtypeResult("bfloat16", {"tok_s": 900.0}, {"tok_s": 300.0, "generated_tok_s": 310.0}))]
    eager = [asdict(DtypeResult("bfloat16", {"tok_s": 450.0}, None))]
    rows, hf = gc.bench_rows(steps[1], first, None)
    assert hf == 300.0 and rows[0].vs == "3.00x vs transformers"
    rows2, _ = gc.bench_rows(steps[2], eager, hf)
    assert rows2[0].result == "450.0 tok/s" and rows2[0].vs == "1.50x vs transformers"
    qrows, _ = gc.bench_rows(steps[-1], {"bfloat16:none": [100.0, 120.0], "bfloat16:fp8": [150.0, 170.0]}, hf)
    assert [r.vs for r in qrows] == ["1.00x vs bfloat16:none", "1.42x vs bfloat16:none"]
    assert gc.summarize_pytest("....\n12 passed, 3 skipped, 1 failed in 40.10s") == "12 passed, 3 skipped, 1 failed"
    text = gc.table([gc.Row("pytest tests/gpu", False, 41, "1 failed")] + rows + qrows, "H100")
    assert text.splitlines()[0] == "=== make gpu-check on H100 ==="
    assert "| pytest tests/gpu | FAIL | 41 | 1 failed |  |" in text and text.endswith("1 failed, 0 skipped")


def test_without_flash_attn_its_rows_are_skips_and_transformers_runs_on_triton(tmp_path):
    """Where flash-attn does not import (it has no wheels; a PyTorch image seldom has it), the flash
    steps are skip rows saying why, not triton runs under flash's name, and the one transformers run
    moves to the triton step; skips do not fail the check."""
    gc = gpu_check()
    steps = gc.plan("py", str(tmp_path), flash=False)
    offline = [s for s in steps if "offline" in s.argv]
    assert {s.env["CONSORT_ATTENTION_BACKEND"] for s in offline} == {"triton"} and len(offline) == 2
    assert ["--engine-only" in s.argv for s in offline] == [False, True]
    assert offline[0].timeout_s == 70
    rows = gc.flash_rows(sys.executable)     # this venv has no flash-attn
    assert [r.name for r in rows] == ["offline bf16 flash graphs on", "offline bf16 flash graphs off"]
    assert all(r.skipped and not r.ok and "flash_attn" in r.result for r in rows)
    assert len(gc.flash_rows(str(tmp_path / "no-such-python"))) == 2
    text = gc.table([gc.Row("pytest tests/gpu", True, 40, "12 passed")] + rows, "H200")
    assert "| offline bf16 flash graphs on | skip | 0 | flash-attn does not import (" in text
    assert text.endswith("0 failed, 2 skipped")


def test_steps_find_the_project_without_an_install():
    """A GPU machine runs the steps from a bare checkout (no editable install): every package's folder
    is on the steps' path, so `python -m consort_common.cli bench` imports there."""
    gc = gpu_check()
    path = gc.step_env({"X": "1"})["PYTHONPATH"].split(":")
    for folder in ("engine-image", "router-image", "operator", "common"):
        assert str(ROOT / folder) in path
    import subprocess
    env = gc.step_env({})
    env["PYTHONNOUSERSITE"] = "1"
    probe = subprocess.run([sys.executable, "-S", "-c", "import consort_common.cli, consort_engine.bench.offline"],
                           env=env, capture_output=True, text=True, cwd=str(ROOT))
    assert probe.returncode == 0, probe.stderr
