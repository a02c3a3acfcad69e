"""`consort bench hybrid`'s speculative runs: the drafter proposes the greedy continuation with every third
token changed, and a small run prints both models' rows with drafting, the same greedy tokens as without."""
from __future__ import annotations

import argparse
import json

from consort_engine.bench import hybrid as bench_hybrid


def test_continuation_drafter_changes_every_third_token_of_the_continuation():
    propose = bench_hybrid.continuation_drafter([[5, 6], [7, 8]], [[10, 11, 12, 13, 14], [20, 21, 22, 23]], 100)
    assert propose([5, 6], 4) == [10, 11, 13, 13]                # continuation positions 0, 1, (2 changed), 3
    assert propose([7, 8, 20, 21], 3) == [23, 23]                # position 2 changed; the continuation ends
    assert propose([9, 9, 1], 3) == []                           # a prompt it does not know
    assert bench_hybrid.continuation_drafter([[1]], [[99, 99, 99]], 100)([1], 3) == [99, 99, 0]   # mod vocab


def test_small_hybrid_bench_runs_speculation_with_the_same_tokens(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_hybrid.add_args(p)
    args = p.parse_args(["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--vocab", "256",
                         "--attn-every", "2", "--batch", "3", "--prompt-len", "16", "--max-tokens", "12",
                         "--num-blocks", "64", "--context", "128", "--repeats", "1", "--cached-prefix", "0",
                         "--threads", "2", "--json", str(tmp_path / "rows.json")])
    assert args.spec_k == 3
    assert bench_hybrid.main(args) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["model"].split()[0] for r in rows] == ["llama", "bamba"]
    for r in rows:
        assert r["spec_same"] and r["spec_tok_s"] > 0
        assert 0.3 < r["acceptance"] < 0.9, r       # every third draft wrong: windows keep 1..3 of 3
    table = capsys.readouterr().out
    assert "drafts of 3 (acceptance)" in table and table.count("| yes |") == 2


def test_bench_checkpoints_are_the_same_every_run(tmp_path):
    """Both models' weights come from a seeded initialisation: runs of the bench compare like with like."""
    p = argparse.ArgumentParser()
    bench_hybrid.add_args(p)
    args = p.parse_args(["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--vocab", "256",
                         "--attn-every", "2"])
    first, second = (bench_hybrid.write_checkpoints(tmp_path / d, args) for d in ("a", "b"))
    assert list(first) == list(second) == ["llama (attention)", "bamba (attention 1/2)"]
    for (a, n), (b, m) in zip(first.values(), second.values()):
        assert n == m and (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
