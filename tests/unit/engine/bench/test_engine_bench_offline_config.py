"""`consort bench offline` must build the engine exactly as `consort engine` does for the same flags:
the offline figure under-reported the server when the two drifted apart (issue 14)."""
from __future__ import annotations

import argparse
import dataclasses

from consort_engine.bench import offline as bench_offline

from consort_engine.serving import cli as server


def bench_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_offline.add_args(p)
    return p.parse_args(argv)


def server_config(argv: list[str]):
    return server.config_from_args(server.parse_args(["--port", "0", "--name", "bench", *argv]))


def test_bare_bench_builds_a_bare_servers_engine(tmp_path):
    got = bench_offline.engine_config(tmp_path, "float32", bench_args([]))
    want = server_config(["--model", str(tmp_path), "--dtype", "float32"])
    assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_bench_flags_reach_the_engine_as_the_servers_do(tmp_path):
    flags = ["--block-size", "32", "--num-blocks", "777", "--max-num-seqs", "48",
             "--max-num-batched-tokens", "1024", "--speculative", "ngram", "--threads", "1"]
    got = bench_offline.engine_config(tmp_path, "bfloat16", bench_args(flags))
    want = server_config(["--model", str(tmp_path), "--dtype", "bfloat16", *flags[:-2]])
    assert dataclasses.asdict(got) == dataclasses.asdict(want)
    assert (got.block_size, got.num_blocks, got.max_num_seqs) == (32, 777, 48)


def test_the_server_process_gets_the_same_argv(tmp_path):
    args = bench_args(["--threads", "2"])
    argv = bench_offline.server_argv(tmp_path, "float32", args)
    assert argv[argv.index("--threads") + 1] == "2"           # the server sizes its pools as the bench did
    assert "--num-blocks" not in argv                          # both size the KV pool from free memory


def test_sampled_runs_are_seeded_per_request_and_greedy_by_default():
    assert bench_offline.sampling(bench_args([]), 3) == {"temperature": 0.0}
    args = bench_args(["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"])
    assert [bench_offline.sampling(args, i) for i in (0, 3)] == [
        {"temperature": 0.8, "top_p": 0.9, "seed": 5}, {"temperature": 0.8, "top_p": 0.9, "seed": 8}]
