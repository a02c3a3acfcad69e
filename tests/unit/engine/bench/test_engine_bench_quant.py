"""`consort bench quant`'s pure parts: the arms it accepts, the rotation of their order, the table."""
from __future__ import annotations

import pytest

from consort_engine.bench import BenchError
from consort_engine.bench.quant import DEFAULT_ARMS, machine, parse_arms, round_order, table


def test_arms_parse_and_bad_ones_are_refused():
    assert parse_arms(DEFAULT_ARMS["cpu"])[0] == ("float32", "none")
    assert parse_arms("bfloat16:none, bfloat16:fp8") == [("bfloat16", "none"), ("bfloat16", "fp8")]
    assert parse_arms("float32:none,bfloat16:awq") == [("float32", "none"), ("bfloat16", "awq")]
    for bad in ("float32", "float64:none", "float32:int4", "float32:none,float32:none"):
        with pytest.raises(BenchError):
            parse_arms(bad)


def test_every_arm_takes_every_position_once_per_cycle():
    arms = ["a", "b", "c"]
    orders = [round_order(arms, r) for r in range(3)]
    assert orders[0] == arms
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == arms
    assert round_order(arms, 3) == arms


def test_table_gives_medians_and_ratios_to_the_first_arm():
    arms = [("float32", "none"), ("float32", "w8a8")]
    rows = table(arms, {arms[0]: [100.0, 120.0, 110.0], arms[1]: [150.0, 170.0, 160.0]}, "tok/s")
    assert rows[0].startswith("| dtype | quantization | round 0 tok/s")
    assert rows[2] == "| float32 | none | 100.0 | 120.0 | 110.0 | 110.0 | 1.00x |"
    assert rows[3] == "| float32 | w8a8 | 150.0 | 170.0 | 160.0 | 160.0 | 1.45x |"
    assert "flags:" in machine()
