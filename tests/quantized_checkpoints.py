"""Writes pre-quantized checkpoints (AWQ GEMM and GPTQ v1/v2 int4, compressed-tensors pack-quantized int4
and int8, compressed-tensors int-quantized int8, NVFP4 and float-quantized FP8, ModelOpt NVFP4 and FP8,
transformers' block-scaled fp8) from
a float checkpoint, bit by bit as each format's spec lays them out, and the fake-quantized float
checkpoint with the same weights for transformers. Independent of the engine's unpacker
(consort_engine/model/quantized_checkpoint.py): packing here is a loop over nibbles, and the reference
weight is (code - zero) * scale computed from the integers before they are packed (FP8: each block's e4m3
values times its scale, block by block; NVFP4: each e2m1 value times its group's e4m3 scale over the global
scale, group by group, or times its scale and ModelOpt's multiplier).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ GEMM: nibble i of a word holds column AWQ_ORDER[i] of its 8


@dataclass
class IntLinear:
    codes: torch.Tensor      # [out, in] int64 in 0..2^bits - 1
    zeros: torch.Tensor      # [out, groups] int64 in 0..2^bits - 1
    scales: torch.Tensor     # [out, groups] float16
    g_idx: torch.Tensor      # [in] int64: the group of each input column

    def dequantized(self) -> torch.Tensor:
        return (self.codes - self.zeros[:, self.g_idx]).float() * self.scales.float()[:, self.g_idx]


def quantize_int(w: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None = None,
                 bits: int = 4) -> IntLinear:
    """Round-to-nearest integers of `bits` per (output row, group of input columns); `perm` (GPTQ
    act-order) is the order the columns are grouped in, the codes staying in the original column order.
    Symmetric: zero 2^(bits - 1), the group's absolute maximum at 2^(bits - 1) - 1 steps."""
    out, inp = w.shape
    gs = inp if group_size == -1 else group_size
    top, half = (1 << bits) - 1, 1 << (bits - 1)
    order = torch.arange(inp) if perm is None else perm
    g_idx = torch.empty(inp, dtype=torch.long)
    g_idx[order] = torch.arange(inp) // gs
    groups = inp // gs
    zeros = torch.empty(out, groups, dtype=torch.long)
    scales = torch.empty(out, groups, dtype=torch.float16)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if sym:
            scale = (cols.abs().amax(1) / (half - 1)).clamp(min=1e-6).half()
            zero = torch.full((out,), half, dtype=torch.long)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale = ((hi - lo) / top).clamp(min=1e-6).half()
            zero = torch.round(-lo / scale.float()).long().clamp(0, top)
        zeros[:, g], scales[:, g] = zero, scale
    codes = torch.round(w.float() / scales.float()[:, g_idx]).long() + zeros[:, g_idx]
    return IntLinear(codes.clamp(0, top), zeros, scales, g_idx)


@dataclass
class Fp8Linear:
    values: torch.Tensor     # [out, in] float8_e4m3fn
    scales: torch.Tensor     # as the format stores them: [1] (tensor), [out, 1] (channel), [ceil(out/b0), ceil(in/b1)]
    reference: torch.Tensor  # [out, in] float32: each value times its block's scale


def quantize_fp8(w: torch.Tensor, strategy: str, block: tuple[int, int], scale_dtype: torch.dtype) -> Fp8Linear:
    """e4m3 values of w, one scale (absolute maximum / 448, stored in scale_dtype) per tensor, output channel or
    block of rows x columns (the last blocks cut short), block by block."""
    out, inp = w.shape
    b0, b1 = {"tensor": (out, inp), "channel": (1, inp), "block": block}[strategy]
    nb0, nb1 = -(-out // b0), -(-inp // b1)
    scales = torch.empty(nb0, nb1, dtype=scale_dtype)
    values = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    reference = torch.empty(out, inp)
    for i in range(nb0):
        for j in range(nb1):
            rows, cols = slice(i * b0, min((i + 1) * b0, out)), slice(j * b1, min((j + 1) * b1, inp))
            part = w[rows, cols].float()
            scale = (part.abs().max() / 448.0).clamp(min=1e-8).to(scale_dtype)
            v = (part / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            scales[i, j], values[rows, cols] = scale, v
            reference[rows, cols] = v.float() * scale.float()
    return Fp8Linear(values, scales.reshape(1) if strategy == "tensor" else scales, reference)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)     # an FP4 code's magnitude by its bits 0-2; bit 3: the sign


@dataclass
class NvFp4Linear:
    nibbles: torch.Tensor    # [out, in] int64: 4-bit codes, sign in bit 3
    scales: torch.Tensor     # [out, in / 16] float8_e4m3fn
    global_scale: torch.Tensor   # [1] float32: compressed-tensors' divisor, or ModelOpt's multiplier (its inverse)
    reference: torch.Tensor  # [out, in] float32: E2M1[code] * (scale / global_scale), or * (scale * multiplier)


def quantize_nvfp4(w: torch.Tensor, modelopt: bool = False) -> NvFp4Linear:
    """NVFP4 as llm-compressor makes it: a global scale 448 * 6 / max|w|, per group of 16 columns an e4m3 scale
    (group max / 6 times the global scale), each value the nearest e2m1 to w / (scale / global), group by group;
    ModelOpt keeps the global scale's inverse, a multiplier (w / (scale * multiplier))."""
    out, inp = w.shape
    global_scale = (448.0 * 6.0 / w.abs().max().float()).reshape(1)
    multiplier = (1.0 / global_scale).float()
    nibbles = torch.empty(out, inp, dtype=torch.long)
    scales = torch.empty(out, inp // 16, dtype=torch.float8_e4m3fn)
    reference = torch.empty(out, inp)
    table = torch.tensor(E2M1)
    for g in range(inp // 16):
        part = w[:, 16 * g:16 * (g + 1)].float()
        scale = (part.abs().amax(1) / 6.0 * global_scale).clamp(min=2.0 ** -9).to(torch.float8_e4m3fn)
        effective = scale.float() * multiplier if modelopt else scale.float() / global_scale
        index = (part.abs()[:, :, None] / effective[:, None, None] - table).abs().argmin(-1)
        sign = part < 0
        nibbles[:, 16 * g:16 * (g + 1)] = index + 8 * sign.long()
        scales[:, g] = scale
        reference[:, 16 * g:16 * (g + 1)] = torch.where(sign, -table[index], table[index]) * effective[:, None]
    return NvFp4Linear(nibbles, scales, multiplier if modelopt else global_scale, reference)


def pack_nvfp4(q: NvFp4Linear, modelopt: bool = False) -> dict[str, torch.Tensor]:
    """Two codes a byte, the even column's in the low nibble; compressed-tensors' names, or ModelOpt's."""
    out, inp = q.nibbles.shape
    packed = torch.zeros(out, inp // 2, dtype=torch.long)
    for j in range(inp // 2):
        packed[:, j] = q.nibbles[:, 2 * j] | (q.nibbles[:, 2 * j + 1] << 4)
    if modelopt:
        return {"weight": packed.to(torch.uint8), "weight_scale": q.scales,
                "weight_scale_2": q.global_scale.reshape(()), "input_scale": torch.tensor(0.25)}
    return {"weight_packed": packed.to(torch.uint8), "weight_scale": q.scales, "weight_global_scale": q.global_scale,
            "input_global_scale": torch.tensor([4.0])}


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_last_dim(values: torch.Tensor, order: tuple[int, ...] | None = None, bits: int = 4) -> torch.Tensor:
    """[r, per c] codes -> int32 [r, c] (per = 32 / bits): word j's bits i*bits.. hold value per j + order[i]."""
    r, n = values.shape
    per = 32 // bits
    order = order or tuple(range(per))
    words = torch.zeros(r, n // per, dtype=torch.int64)
    for j in range(n // per):
        for i in range(per):
            words[:, j] |= values[:, per * j + order[i]] << (bits * i)
    return _int32(words)


def pack_awq(q: IntLinear) -> dict[str, torch.Tensor]:
    return {"qweight": pack_last_dim(q.codes.t(), AWQ_ORDER), "qzeros": pack_last_dim(q.zeros.t(), AWQ_ORDER),
            "scales": q.scales.t().contiguous()}


def pack_gptq(q: IntLinear, v1: bool) -> dict[str, torch.Tensor]:
    return {"qweight": pack_last_dim(q.codes).t().contiguous(),            # [in/8, out]: 8 input rows a word
            "qzeros": pack_last_dim(q.zeros.t() - int(v1)),             # v1 stores zero - 1
            "scales": q.scales.t().contiguous(), "g_idx": q.g_idx.to(torch.int32)}


def pack_compressed_tensors(q: IntLinear, bits: int = 4) -> dict[str, torch.Tensor]:
    assert bool((q.zeros == 1 << (bits - 1)).all()), "pack-quantized is symmetric: codes are the signed value + 2^(bits-1)"
    return {"weight_packed": pack_last_dim(q.codes, bits=bits), "weight_scale": q.scales.contiguous(),
            "weight_shape": torch.tensor(list(q.codes.shape), dtype=torch.int64)}


def int_quantized(q: IntLinear) -> dict[str, torch.Tensor]:
    """compressed-tensors int-quantized: the signed int8 values as they are, the scales beside them."""
    assert bool((q.zeros == 128).all()), "int-quantized is symmetric"
    return {"weight": (q.codes - 128).to(torch.int8), "weight_scale": q.scales.contiguous()}


def quantization_config(method: str, group_size: int, sym: bool, act_order: bool, v1: bool, bits: int = 4,
                        layout: str = "pack-quantized", strategy: str = "channel",
                        block: tuple[int, int] = (32, 48)) -> dict:
    if method == "modelopt":
        algo = "NVFP4" if layout == "nvfp4-pack-quantized" else "FP8"
        return {"quant_method": "modelopt", "quant_algo": algo, "kv_cache_quant_algo": "FP8",
                "exclude_modules": ["lm_head"], **({"group_size": 16} if algo == "NVFP4" else {})}
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if layout == "nvfp4-pack-quantized":     # W4A4, as the NVFP4 recipe writes it: a global activation scale
        fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
        return {"quant_method": "compressed-tensors", "format": layout, "ignore": ["lm_head"], "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {**fp4, "dynamic": False},
                        "input_activations": {**fp4, "dynamic": "local"}}}}
    if layout == "float-quantized":      # static activation scales and a KV cache scheme, as llm-compressor writes
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}
        return {"quant_method": "compressed-tensors", "format": layout, "ignore": ["lm_head"], "kv_cache_scheme": fp8,
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": fp8, "weights": {
                    **weights, **({"block_structure": list(block)} if strategy == "block" else {})}}}}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    strategy = {"strategy": "channel"} if group_size == -1 else {"strategy": "group", "group_size": group_size}
    activations = ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
                   if layout == "int-quantized" else None)
    return {"quant_method": "compressed-tensors", "format": layout, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations, "weights": {
                "num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, **strategy}}}}


def write_quantized_checkpoint(src: Path, dst: Path, method: str, group_size: int, sym: bool = False,
                               act_order: bool = False, v1: bool = True, fake_dst: Path | None = None,
                               bits: int = 4, layout: str = "pack-quantized", strategy: str = "channel",
                               block: tuple[int, int] = (32, 48),
                               hf_quant_config: bool = False) -> dict[str, torch.Tensor]:
    """Quantize src's decoder linears into dst in `method`'s layout (everything else copied); `bits` and
    `layout` for compressed-tensors (pack-quantized | int-quantized: int8 only | nvfp4-pack-quantized |
    float-quantized: FP8 scaled per `strategy`, with static activation and KV cache scales beside); method fp8:
    transformers' FP8 in blocks of `block`; with fake_dst, also write the float checkpoint of the dequantized
    weights; hf_quant_config (modelopt): the quantization in ModelOpt's own hf_quant_config.json, config.json
    left without one. Returns weight name -> dequantized float32 weight."""
    assert bits == 4 or method in ("compressed-tensors", "fp8", "modelopt"), "AWQ and GPTQ are written as int4"
    fp8 = method == "fp8" or layout == "float-quantized"
    modelopt = method == "modelopt"
    sym = sym or method == "compressed-tensors"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    g = torch.Generator().manual_seed(7)
    packed, fake, reference, perms = {}, {}, {}, {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            packed[name] = fake[name] = t
            continue
        if fp8:
            q8 = quantize_fp8(t, "block" if method == "fp8" else "tensor" if modelopt else strategy, block,
                              torch.bfloat16 if method == "compressed-tensors" else torch.float32)
            packed[f"{prefix}.weight"] = q8.values
            packed[f"{prefix}.{'weight_scale_inv' if method == 'fp8' else 'weight_scale'}"] = (
                q8.scales.reshape(()) if modelopt else q8.scales)
            if method != "fp8":      # scales the engine reads past
                packed[f"{prefix}.input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
                if prefix.endswith("k_proj"):      # ModelOpt keeps them on the projections, compressed-tensors above
                    at = prefix if modelopt else prefix.rpartition(".")[0]
                    packed[f"{at}.k_scale"] = torch.tensor(0.5)
                    packed[f"{prefix[:-6] + 'v_proj' if modelopt else at}.v_scale"] = torch.tensor(0.25)
            reference[name] = q8.reference
            fake[name] = reference[name].to(t.dtype)
            continue
        if layout == "nvfp4-pack-quantized":
            q4 = quantize_nvfp4(t, modelopt)
            packed.update({f"{prefix}.{k}": v for k, v in pack_nvfp4(q4, modelopt).items()})
            reference[name] = q4.reference
            fake[name] = reference[name].to(t.dtype)
            continue
        # act-order sorts by the input's statistics: projections of one input (q/k/v, gate/up) share it
        key = (prefix.rpartition(".")[0], SAME_INPUT.get(prefix.rpartition(".")[2], prefix))
        perm = perms.setdefault(key, torch.randperm(t.shape[1], generator=g)) if act_order else None
        q = quantize_int(t, group_size, sym, perm, bits)
        parts = (pack_awq(q) if method == "awq" else pack_gptq(q, v1) if method == "gptq"
                 else int_quantized(q) if layout == "int-quantized" else pack_compressed_tensors(q, bits))
        packed.update({f"{prefix}.{k}": v for k, v in parts.items()})
        reference[name] = q.dequantized()
        fake[name] = reference[name].to(t.dtype)
    save_file(packed, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qc = quantization_config(method, group_size, sym, act_order, v1, bits, layout, strategy, block)
    if hf_quant_config:
        assert qc.pop("quant_method") == "modelopt", "hf_quant_config.json is ModelOpt's"
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": qc}))
    else:
        config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if fake_dst is not None:
        shutil.copytree(src, fake_dst)
        save_file(fake, str(fake_dst / "model.safetensors"))
    return reference


def runs_on_codes(linear) -> bool:
    """Whether an engine Linear multiplies int8 codes (the int8 kernel: `int8`, a pre-quantized checkpoint's codes)
    rather than a float weight: its packed GEMM holds an int8 tensor."""
    return any(isinstance(w, torch.Tensor) and w.dtype == torch.int8 for w in getattr(linear.packed, "weights", ()))
