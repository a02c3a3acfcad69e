"""The roofline floor arithmetic of `consort bench roofline`, checked by hand on a small shape."""
from __future__ import annotations

from consort_engine.bench.roofline import Shape, decode_floor


def test_floor_counts_weights_once_and_kv_per_sequence():
    s = Shape.from_config({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                           "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 10})
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16 each, down 16x8 -> 64+32+32+64+128+128+128
    assert s.weight_params() == 2 * 576 + 80
    f = decode_floor(s, running=3, context=5, elem_bytes=4, gemm_rate=1e9, bandwidth=1e9)
    assert f.flops == 2 * 3 * 1232 + 4 * 3 * 2 * 2 * 4 * 5
    assert f.bytes == 1232 * 4 + 3 * 2 * 2 * 1 * 4 * 5 * 4
    assert f.floor_s == max(f.flops, f.bytes) / 1e9
