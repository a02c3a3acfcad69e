"""`consort bench quant`'s pure parts: the arms it accepts, the rotation of their order, the table."""
from __future__ import annotations

import pytest

from consort_engine.bench import BenchError
from consort_engine.bench.quant import DEFAULT_ARMS, add_args, machine, parse_arms, round_order, table


def test_arms_parse_and_bad_ones_are_refused():
    assert parse_arms(DEFAULT_ARMS["cpu"])[0] == ("float32", "none", "auto")
    assert parse_arms("bfloat16:none, bfloat16:fp8") == [("bfloat16", "none", "auto"), ("bfloat16", "fp8", "auto")]
    assert parse_arms("float32:none,bfloat16:awq") == [("float32", "none", "auto"), ("bfloat16", "awq", "auto")]
    assert parse_arms("bfloat16:none,bfloat16:none:fp8,float32:int8:bfloat16") == [
        ("bfloat16", "none", "auto"), ("bfloat16", "none", "fp8"), ("float32", "int8", "bfloat16")]
    for bad in ("float32", "float64:none", "float32:int4", "float32:none,float32:none", "float32:none:int8",
                "float32:none:fp8:x", "bfloat16:none:auto,bfloat16:none"):
        with pytest.raises(BenchError):
            parse_arms(bad)


def test_the_workload_takes_prompt_and_output_ranges():
    import argparse

    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args(["--prompt-len", "1024,2048", "--output-len", "128"])
    assert (a.prompt_len, a.output_len) == ((1024, 2048), (128, 128))
    assert p.parse_args([]).prompt_len == (64, 512)
    for bad in ("0,4", "9,3", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--prompt-len", bad])


def test_every_arm_takes_every_position_once_per_cycle():
    arms = ["a", "b", "c"]
    orders = [round_order(arms, r) for r in range(3)]
    assert orders[0] == arms
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == arms
    assert round_order(arms, 3) == arms


def test_table_gives_medians_and_ratios_to_the_first_arm():
    arms = [("float32", "none", "auto"), ("float32", "w8a8", "fp8")]
    rows = table(arms, {arms[0]: [100.0, 120.0, 110.0], arms[1]: [150.0, 170.0, 160.0]}, "tok/s")
    assert rows[0].startswith("| dtype | quantization | kv cache | round 0 tok/s")
    assert rows[2] == "| float32 | none | auto | 100.0 | 120.0 | 110.0 | 110.0 | 1.00x |"
    assert rows[3] == "| float32 | w8a8 | fp8 | 150.0 | 170.0 | 160.0 | 160.0 | 1.45x |"
    assert "flags:" in machine()


def test_kv_memory_gives_every_arm_the_same_bytes(tmp_path):
    """--kv-memory: an fp8 pool gets twice a bf16 pool's blocks and four times a float32 one's."""
    import json

    from consort_engine.bench.quant import pool_blocks

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 1408, "vocab_size": 32000, "max_position_embeddings": 2048}))
    mib = 1 << 20            # a token: 2 x 8 layers x 4 heads x 64 = 4,096 elements
    assert pool_blocks(tmp_path, "bfloat16", "auto", 16, 96 * mib) == 96 * mib // (8192 * 16) == 768
    assert pool_blocks(tmp_path, "bfloat16", "fp8", 16, 96 * mib) == 1536
    assert pool_blocks(tmp_path, "float32", "auto", 16, 96 * mib) == 384
    assert pool_blocks(tmp_path, "float32", "bfloat16", 16, 96 * mib) == 768
