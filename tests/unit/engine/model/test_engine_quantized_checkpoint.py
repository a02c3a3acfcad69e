"""Pre-quantized int4 checkpoints (model/quantized_checkpoint.py): the engine's unpacked integers and scales
(GroupCodes) are the reference's codes minus zeros and its scales, and the weights they make equal the
reference (code - zero) * scale exactly, for AWQ GEMM, GPTQ (v1/v2; act-order dequantized) and
compressed-tensors pack-quantized written by tests/quantized_checkpoints.py; a spec-by-hand unpack of single
words; tensor-parallel cuts of the codes; FP8 checkpoints (compressed-tensors float-quantized, transformers'
fp8) decoded to the reference block by block, NVFP4 unpacked to integers exactly; format detection from
config.json and the --quantization agreement rules."""
from __future__ import annotations

import json

import pytest
import torch
from quantized_checkpoints import (AWQ_ORDER, int_quantized, pack_awq, pack_compressed_tensors, pack_gptq, pack_nvfp4,
                                   quantize_fp8, quantize_int, quantize_nvfp4, write_quantized_checkpoint)
from safetensors.torch import save_file

from consort_engine.model.quantized_checkpoint import (GroupCodes, CheckpointFormat, awq_codes, checkpoint_format,
                                                  checkpoint_weights, fp8_weight, gptq_weight, nvfp4_codes,
                                                  pack_quantized_codes,
                                                  resolve_quantization, unpack_columns, unpacked_tensors)
from consort_engine.model.models.quant import check_checkpoint_quantization

OUT, IN = 48, 256


def as_weight(w: GroupCodes | torch.Tensor) -> torch.Tensor:
    return w.dequantize() if isinstance(w, GroupCodes) else w


def weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(OUT, IN, generator=g) * torch.logspace(-2, 0, OUT)[:, None] + 0.01


def test_one_awq_word_unpacks_in_the_interleaved_order():
    """Nibble i of an AWQ word holds column AWQ_ORDER[i]: the word 0x76543210 (nibble i = i) is the
    columns 0, 4, 1, 5, 2, 6, 3, 7 in order."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_columns(word, AWQ_ORDER).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert unpack_columns(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # the sign bit is the top nibble's, not smeared over the others by the arithmetic shift
    assert unpack_columns(torch.tensor([[0x80000000 - 2 ** 32]], dtype=torch.int32)).tolist() == [[0] * 7 + [8]]
    assert unpack_columns(torch.tensor([[-1]], dtype=torch.int32)).tolist() == [[15] * 8]


@pytest.mark.parametrize("group_size", [64, -1])
def test_awq_unpacks_to_the_reference_weight_exactly(group_size):
    q = quantize_int(weight(), group_size, sym=False)
    t = pack_awq(q)
    assert t["qweight"].shape == (IN, OUT // 8) and t["qzeros"].shape == (q.zeros.shape[1], OUT // 8)
    codes = awq_codes(t["qweight"], t["qzeros"], t["scales"], group_size)
    assert torch.equal(codes.codes, (q.codes - q.zeros[:, q.g_idx]).to(torch.int8))
    assert torch.equal(codes.scales, q.scales.float()) and codes.group_size == group_size
    got = codes.dequantize()
    assert torch.equal(got, q.dequantized())
    # the order matters: the same words read in GPTQ's plain order give a different weight
    assert not torch.equal(unpack_columns(t["qweight"]), q.codes.t())


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("sym,act_order", [(True, False), (False, True), (True, True)])
def test_gptq_unpacks_to_the_reference_weight_exactly(v1, sym, act_order):
    perm = torch.randperm(IN, generator=torch.Generator().manual_seed(3)) if act_order else None
    q = quantize_int(weight(1), 64, sym, perm)
    t = pack_gptq(q, v1)
    assert t["qweight"].shape == (IN // 8, OUT)
    got = gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 64, zeros_minus_one=v1)
    # act-order's groups are not runs of columns: its code columns come sorted by group
    assert isinstance(got, GroupCodes) and (got.order is not None) == act_order
    if act_order:
        assert torch.equal(q.g_idx[got.order], torch.arange(IN) // 64)
    got = as_weight(got)
    assert torch.equal(got, q.dequantized())
    # reading v1 as v2 (or back) shifts every zero by one step: off by one scale everywhere
    wrong = as_weight(gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 64, zeros_minus_one=not v1))
    assert torch.allclose((wrong - got).abs(), q.scales.float()[:, q.g_idx])
    if act_order:        # g_idx, not the column index, picks the group
        assert not torch.equal(as_weight(gptq_weight(t["qweight"], t["qzeros"], t["scales"], None, 64, v1)), got)


def test_a_g_idx_of_unequal_groups_is_dequantized():
    """Groups that act-order's sort cannot make runs of group_size columns: the weight, dequantized."""
    q = quantize_int(weight(1), 64, True)
    t = pack_gptq(q, True)
    g_idx = t["g_idx"].clone()
    g_idx[:3] = 1                                   # group 0 is 61 columns, group 1 67
    got = gptq_weight(t["qweight"], t["qzeros"], t["scales"], g_idx, 64, zeros_minus_one=True)
    assert isinstance(got, torch.Tensor)
    codes, zeros = q.codes, q.zeros[:, g_idx.long()]
    assert torch.equal(got, (codes - zeros).float() * q.scales.float()[:, g_idx.long()])


@pytest.mark.parametrize("group_size", [32, -1])
def test_compressed_tensors_int8_unpacks_exactly(group_size):
    """W8A16 (pack-quantized, four codes a word, each the signed value + 128) and W8A8 (int-quantized: the
    int8 values as they are) give the integers and the weight exactly."""
    q = quantize_int(weight(3), group_size, sym=True, bits=8)
    t = pack_compressed_tensors(q, bits=8)
    assert t["weight_packed"].shape == (OUT, IN // 4)
    codes = pack_quantized_codes(t["weight_packed"], t["weight_scale"], t["weight_shape"], group_size, bits=8)
    assert torch.equal(codes.codes, (q.codes - 128).to(torch.int8)) and int(codes.codes.abs().max()) == 127
    assert torch.equal(codes.dequantize(), q.dequantized())
    # read as int4 (eight codes a word) the same words are another weight
    assert not torch.equal(unpack_columns(t["weight_packed"])[:, :IN], q.codes)
    fmt = CheckpointFormat("compressed-tensors", group_size, bits=8, layout="int-quantized")
    t = int_quantized(q)
    got = dict(unpacked_tensors(fmt, [("l.weight", t["weight"]), ("l.weight_scale", t["weight_scale"]),
                                      ("norm.weight", torch.ones(4))], keep_codes=True))
    assert torch.equal(got["l.weight"].dequantize(), q.dequantized()) and torch.equal(got["norm.weight"], torch.ones(4))


@pytest.mark.parametrize("group_size", [32, -1])
def test_compressed_tensors_pack_quantized_unpacks_exactly(group_size):
    q = quantize_int(weight(2), group_size, sym=True)
    t = pack_compressed_tensors(q)
    assert t["weight_packed"].shape == (OUT, IN // 8)
    codes = pack_quantized_codes(t["weight_packed"], t["weight_scale"], t["weight_shape"], group_size)
    assert torch.equal(codes.codes, (q.codes - 8).to(torch.int8))
    assert torch.equal(codes.dequantize(), q.dequantized())


@pytest.mark.parametrize("group_size", [64, -1])
def test_tensor_parallel_cuts_of_the_codes_are_the_cuts_of_the_weight(group_size):
    """Rows (column-parallel) and whole groups of columns (row-parallel) cut the integers and their scales
    as they cut the dequantized weight; a column cut inside a group is refused (None: dequantized)."""
    t = pack_awq(quantize_int(weight(4), group_size, sym=False))
    codes = awq_codes(t["qweight"], t["qzeros"], t["scales"], group_size)
    w = codes.dequantize()
    assert torch.equal(codes.rows(slice(16, 32)).dequantize(), w[16:32])
    for cut in (slice(0, 128), slice(128, 256), slice(64, 192)):
        assert torch.equal(codes.columns(cut).dequantize(), w[:, cut])
    assert (codes.columns(slice(32, 160)) is None) == (group_size == 64)
    q = quantize_int(weight(4), 64, True, torch.randperm(IN, generator=torch.Generator().manual_seed(1)))
    t = pack_gptq(q, True)
    act_order = gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 64, zeros_minus_one=True)
    assert torch.equal(act_order.rows(slice(8, 24)).dequantize(), q.dequantized()[8:24])
    assert act_order.columns(slice(0, 128)) is None      # act-order: a rank's columns span every group


CONFIGS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            CheckpointFormat("awq", 128)),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True},
             CheckpointFormat("gptq", 32, zeros_minus_one=True)),
    "gptq_v2": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"},
                CheckpointFormat("gptq", -1)),
    "ct": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}}},
           CheckpointFormat("compressed-tensors", 64)),
    "ct-w8a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
        "input_activations": None}}}, CheckpointFormat("compressed-tensors", 128, bits=8)),
    "ct-w8a8": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}}},
                CheckpointFormat("compressed-tensors", -1, bits=8, layout="int-quantized")),
    "ct-fp8-dynamic": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
                       CheckpointFormat("compressed-tensors", -1, bits=8, layout="float-quantized")),
    "ct-fp8-block": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
        "input_activations": None}}}, CheckpointFormat("compressed-tensors", -1, bits=8, layout="float-quantized",
                                                       block=(128, 128))),
    "ct-nvfp4": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
        "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                              "dynamic": "local"}}}},
                 CheckpointFormat("compressed-tensors", 16, bits=4, layout="nvfp4-pack-quantized")),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                        "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
                       CheckpointFormat("modelopt", 16, bits=4, layout="nvfp4-pack-quantized")),
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"},
                     CheckpointFormat("modelopt", -1, bits=8, layout="float-quantized")),
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            CheckpointFormat("fp8", -1, bits=8, block=(128, 128))),
}

W8A8_ACTIVATIONS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}


def ct(layout: str, bits: int, activations: dict | None, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": layout, "config_groups": {"g": {
        "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "channel", **weights},
        "input_activations": activations}}}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_format_is_read_from_quantization_config(name):
    qc, want = CONFIGS[name]
    assert checkpoint_format({"quantization_config": qc}) == want
    assert checkpoint_format({}) is None


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemm"),
    ({"quant_method": "gptq", "bits": 8}, "only 4"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}, "nvfp4-pack-quantized, float-quantized"),
    (ct("nvfp4-pack-quantized", 4, None, type="float", group_size=32), "4-bit float in groups of 16"),
    (ct("nvfp4-pack-quantized", 4, W8A8_ACTIVATIONS, type="float", group_size=16), "none or 4-bit float"),
    (ct("float-quantized", 8, None, type="float", strategy="group"), "strategy 'group' .tensor, channel or block"),
    (ct("float-quantized", 4, None, type="float"), "weights of 4 bits, type 'float' .8-bit float"),
    (ct("float-quantized", 8, W8A8_ACTIVATIONS, type="float"), "activations other than 8-bit float"),
    (ct("float-quantized", 8, None, type="float", strategy="block"), "block without block_structure"),
    (ct("float-quantized", 8, None, type="float", strategy="block", block_structure=[128]), "two positive sizes"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "modelopt quant_algo 'W4A8_AWQ' .NVFP4 or FP8"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "modelopt NVFP4 group_size 32"),
    (ct("pack-quantized", 2, None), "pack-quantized weights of 2 bits"),
    (ct("int-quantized", 4, W8A8_ACTIVATIONS), "int-quantized weights of 4 bits"),
    (ct("pack-quantized", 8, W8A8_ACTIVATIONS), "pack-quantized with quantized activations"),
    (ct("int-quantized", 8, None), "without dynamic int8 activations"),
    (ct("int-quantized", 8, {**W8A8_ACTIVATIONS, "dynamic": False}), "without dynamic int8 activations"),
    (ct("pack-quantized", 4, None, symmetric=False), "asymmetric"),
    (ct("pack-quantized", 4, None, actorder="group"), "act-order"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
])
def test_unreadable_formats_are_clear_errors(qc, words):
    with pytest.raises(ValueError, match=words):
        checkpoint_format({"quantization_config": qc})


def test_quantization_flag_must_agree_with_the_checkpoint():
    awq = CheckpointFormat("awq", 128)
    for ok in ("none", "auto", "awq"):
        assert resolve_quantization(ok, awq) == "awq"
    for bad in ("gptq", "int8", "w8a8", "fp8", "compressed-tensors"):
        with pytest.raises(ValueError, match="already quantized"):
            resolve_quantization(bad, awq)
    assert resolve_quantization("auto", None) == "none" and resolve_quantization("w8a8", None) == "w8a8"
    with pytest.raises(ValueError, match="not awq-quantized"):
        resolve_quantization("awq", None)
    # FP8 checkpoints run decoded, or with fp8 rounded to e4m3 per row again (the CUDA GEMM); never int8
    for fmt in (CONFIGS["fp8"][1], CONFIGS["ct-fp8-block"][1]):
        for ok in {"none", "auto", fmt.method} - {"fp8"}:     # fp8 is also transformers' name for its format
            assert resolve_quantization(ok, fmt) == "none"
        assert resolve_quantization("fp8", fmt) == "fp8"
        for bad in ("int8", "w8a8", "awq"):
            with pytest.raises(ValueError, match="already quantized .* fp8"):
                resolve_quantization(bad, fmt)


def test_nvfp4_unpacks_to_integers_and_the_reference_exactly():
    """Every e2m1 code doubled is an integer, each group's scale halved: the weight equals the reference
    value * (scale / global) bit for bit; one byte by hand: the even column in the low nibble, bit 3 the sign."""
    w = weight(7)
    q = quantize_nvfp4(w)
    t = pack_nvfp4(q)
    codes = nvfp4_codes(t["weight_packed"], t["weight_scale"].float() / t["weight_global_scale"])
    assert codes.codes.dtype == torch.int8 and codes.group_size == 16 and codes.scales.shape == (OUT, IN // 16)
    assert set(codes.codes.unique().abs().tolist()) <= {0, 1, 2, 3, 4, 6, 8, 12}
    assert torch.equal(codes.dequantize(), q.reference)
    assert (q.reference - w).abs().max() <= w.abs().max() / 4        # e2m1: 1 mantissa bit
    byte = nvfp4_codes(torch.tensor([[0x9A]], dtype=torch.uint8), torch.tensor([[4.0]]))
    assert byte.codes.tolist() == [[-2, -1]] and byte.dequantize().tolist() == [[-4.0, -2.0]]   # -1.0, -0.5 times 4


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8_weights_decode_to_the_reference_block_by_block(strategy):
    """Scales per tensor, output channel or block (blocks that do not divide the weight cut short at its
    edges): value * scale equals the reference, bit for bit; a scale that fits none of them is named."""
    w = weight(6)
    q = quantize_fp8(w, strategy, (32, 96), torch.bfloat16)
    block = (32, 96) if strategy == "block" else None
    assert q.scales.shape == {"tensor": (1,), "channel": (OUT, 1), "block": (2, 3)}[strategy]
    assert torch.equal(fp8_weight(q.values, q.scales, block), q.reference)
    if strategy != "block":     # the other spellings: a 0-d tensor scale, a [out] channel scale
        assert torch.equal(fp8_weight(q.values, q.scales.reshape(-1) if strategy == "channel"
                                      else q.scales.reshape(()), None), q.reference)
    assert (q.reference - w).abs().max() <= w.abs().max() / 16     # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"scales of shape \(5, 3\) fit neither"):
        fp8_weight(q.values, torch.ones(5, 3), (32, 96))


@pytest.mark.parametrize("method,kw", [("awq", {}), ("gptq", dict(sym=True, act_order=True)),
                                        ("gptq", dict(v1=False)), ("compressed-tensors", {}),
                                        ("compressed-tensors", dict(bits=8)),
                                        ("compressed-tensors", dict(bits=8, layout="int-quantized")),
                                        ("compressed-tensors", dict(bits=8, layout="float-quantized")),
                                        ("compressed-tensors",
                                         dict(bits=8, layout="float-quantized", strategy="block")),
                                        ("compressed-tensors", dict(layout="nvfp4-pack-quantized")),
                                        ("modelopt", dict(layout="nvfp4-pack-quantized")),
                                        ("modelopt", dict(bits=8, layout="float-quantized")),
                                        ("modelopt", dict(layout="nvfp4-pack-quantized", hf_quant_config=True)),
                                        ("fp8", dict(bits=8))])
def test_checkpoint_weights_give_every_linear_as_codes_or_dequantized(tmp_path, method, kw):
    """A whole checkpoint directory: quantized linears come out as PREFIX.weight, their integers (CPU) or
    dequantized (FP8: always decoded), equal to the reference; every other tensor unchanged, in the dtype asked
    for (an FP8 checkpoint's activation and KV cache scales dropped); the flag check reads the same config.json."""
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(5)
    tensors = {"model.embed_tokens.weight": torch.randn(40, 64, generator=g),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
               "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64, generator=g),
               "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96, generator=g),
               "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    dst = tmp_path / "q"
    reference = write_quantized_checkpoint(src, dst, method, 32, **kw)
    raw = json.loads((dst / "config.json").read_text())
    fmt = checkpoint_format(raw, dst)
    assert ("quantization_config" in raw) != kw.get("hf_quant_config", False)     # ModelOpt's own file read
    got = dict(checkpoint_weights(str(dst), fmt, torch.float32))
    assert set(got) == set(tensors)
    for name, t in got.items():
        assert torch.equal(t, reference.get(name, tensors[name])), name
    kept = dict(checkpoint_weights(str(dst), fmt, torch.bfloat16, keep_codes=True))
    fp8 = fmt.float8
    assert fp8 == (method == "fp8" or kw.get("layout") == "float-quantized")
    assert fmt.method == method
    for name, t in kept.items():
        if fp8:
            assert torch.equal(t, reference.get(name, tensors[name]).to(torch.bfloat16)), name
        elif name in reference:
            assert isinstance(t, GroupCodes) and (t.order is not None) == kw.get("act_order", False), name
            assert torch.equal(t.dequantize(), reference[name]), name
        else:
            assert torch.equal(t, tensors[name].to(torch.bfloat16)), name
    check_checkpoint_quantization("auto", str(dst))
    with pytest.raises(ValueError, match="already quantized"):
        check_checkpoint_quantization("int8", str(dst))


def test_a_linear_missing_a_part_is_named(tmp_path):
    q = pack_awq(quantize_int(weight(), 64, sym=False))
    save_file({"l.qweight": q["qweight"], "l.scales": q["scales"]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"l lacks \['qzeros'\]"):
        list(checkpoint_weights(str(tmp_path), CheckpointFormat("awq", 64), torch.float32))


def test_engine_cli_refuses_a_flag_the_checkpoint_disagrees_with(tmp_path):
    from consort_engine.serving.cli import config_from_args, parse_args

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": weight()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    write_quantized_checkpoint(src, tmp_path / "gptq", "gptq", 64)
    assert config_from_args(parse_args(["--model", str(tmp_path / "gptq"), "--port", "8000", "--quantization", "gptq"])).quantization == "gptq"
    with pytest.raises(SystemExit, match="--quantization: --quantization awq: the checkpoint is already quantized"):
        config_from_args(parse_args(["--model", str(tmp_path / "gptq"), "--port", "8000", "--quantization", "awq"]))
    with pytest.raises(SystemExit, match="not gptq-quantized"):
        config_from_args(parse_args(["--model", str(src), "--port", "8000", "--quantization", "gptq"]))
