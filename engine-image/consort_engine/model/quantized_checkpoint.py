"""Pre-quantized checkpoints: AWQ (GEMM) and GPTQ (v1 and v2) int4, compressed-tensors
pack-quantized int4/int8 (W4A16, W8A16), int-quantized int8 (W8A8), nvfp4-pack-quantized (NVFP4) and
float-quantized FP8, the block-scaled FP8 of transformers' `fp8` method (Qwen3-FP8, DeepSeek-V3), and NVIDIA
ModelOpt's NVFP4 and FP8 (`quant_method: modelopt`). config.json's
`quantization_config` names the format; at load every quantized linear (its packed codes, zero points
and scales) becomes its integers and scales (`GroupCodes`: code - zero as int8, one fp32 scale per
output channel and group of input columns), exactly. NVFP4's e2m1 values are integers once doubled (0 to
12), so they are codes too, each group's scale halved.

On CPU the engine keeps them so: each Linear multiplies them in the engine's int8 kernel with one scale
per group (csrc/gemm_i8w.c; layers.Linear.pack), in a quarter of the fp32 weight's memory and at the
int8 kernel's speed, each row of its input rounded to 16-bit integers; a W8A8 checkpoint's rows are
rounded to int8, as it was calibrated, on the int8 x int8 kernel where the CPU has VNNI (csrc/gemm_i8a8.c,
the 16-bit kernel elsewhere). GPTQ act-order's code columns are sorted by group
and the kernel reads each input row in that order. Elsewhere (CUDA; a CPU the kernel does not build for; a
tensor-parallel cut inside a group or of act-order's columns) the weight is dequantized, w = (code -
zero) * scale in fp32, and runs as a float checkpoint would. torch's own CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`) was measured and not kept (docs/engine-speed.md).

FP8 weights (e4m3) are decoded at load, w = value * scale in fp32, and run in the model's dtype (no CPU
kernel multiplies e4m3); `--quantization fp8` then rounds the decoded weights to e4m3 again, one scale per
output row, for the CUDA fp8 GEMM. The activations' static scales (`input_scale`, NVFP4's
`input_global_scale`) and the KV cache's (`k_scale`, `v_scale`) are read past, not applied: each GEMM takes
its rows as they are (W4A4 and W8A8-FP8 checkpoints run with unquantized activations), the fp8 KV pool is
unscaled.

The layouts (w = (q - zero) * scale, groups of `group_size` input columns, one scale per output
channel and group):
- AWQ GEMM: `qweight` int32 [in, out/8], eight output columns per word, nibble i holding column
  AWQ_PACK_ORDER[i] of its eight; `qzeros` int32 [groups, out/8] packed the same way; `scales` [groups, out].
- GPTQ: `qweight` int32 [in/8, out], eight input rows per word in order (nibble i = row 8j+i);
  `qzeros` int32 [groups, out/8], eight output columns per word in order; `scales` [groups, out];
  `g_idx` [in] the group of each input row (act-order permutes it). The v1 format (AutoGPTQ, the
  default `checkpoint_format`) stores each zero minus one; `gptq_v2` stores it as is.
- compressed-tensors pack-quantized (weights only): `weight_packed` int32 [out, in * bits / 32],
  32 / bits input columns per word in order, each code the signed value + 2^(bits - 1); `weight_scale`
  [out, groups]; `weight_shape` [out, in]; symmetric (no zero point).
- compressed-tensors int-quantized (int8 weights and dynamic int8 activations): `weight` int8 [out, in],
  the signed values; `weight_scale` [out, groups]; symmetric.
- compressed-tensors float-quantized (FP8): `weight` float8_e4m3fn [out, in]; `weight_scale` one for the
  tensor ([] or [1]), one per output channel ([out, 1]) or one per block of rows x columns (strategy
  `block`, `block_structure` [b0, b1]: [ceil(out / b0), ceil(in / b1)]).
- compressed-tensors nvfp4-pack-quantized (NVFP4, W4A16 or W4A4): `weight_packed` uint8 [out, in / 2], two
  4-bit codes per byte, the even column in the low nibble, each code e2m1 (bit 3 the sign, bits 0-2 the
  magnitude's index in E2M1); `weight_scale` float8_e4m3fn [out, in / 16]; `weight_global_scale` fp32 [1], a
  divisor: w = value * (weight_scale / weight_global_scale).
- ModelOpt NVFP4 (`quant_algo: NVFP4`): `weight` uint8 [out, in / 2] packed as above; `weight_scale`
  float8_e4m3fn [out, in / 16]; `weight_scale_2` fp32 [] or [1], a multiplier: w = value * (weight_scale *
  weight_scale_2). ModelOpt FP8 (`quant_algo: FP8`): `weight` float8_e4m3fn, `weight_scale` fp32 [] (per tensor).
- transformers' `fp8` (FineGrainedFP8): `weight` float8_e4m3fn [out, in]; `weight_scale_inv` per block of
  `weight_block_size` [b0, b1] as above (despite its name, w = value * weight_scale_inv).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from consort_engine.model.loader import iter_safetensors

CHECKPOINT_FORMATS = ("awq", "gptq", "compressed-tensors", "modelopt")
MODELOPT = "modelopt"
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble i of an AWQ word holds column AWQ_PACK_ORDER[i]
PACK_QUANTIZED, INT_QUANTIZED, FLOAT_QUANTIZED = "pack-quantized", "int-quantized", "float-quantized"
NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
NVFP4_GROUP = 16                               # input columns per NVFP4 scale
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12)       # twice the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (index: bits 0-2)
FP8 = "fp8"                                    # transformers' quant_method for block-scaled FP8 checkpoints
# scales the engine does not apply (activations' static scales, the KV cache's), read past
UNAPPLIED_SCALES = ("input_scale", "input_global_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class CheckpointFormat:
    """What config.json's quantization_config says about the quantized weights."""

    method: str                  # awq | gptq | compressed-tensors
    group_size: int              # input columns per scale; -1: the whole row
    zeros_minus_one: bool = False    # GPTQ v1: every stored zero is the zero minus one
    bits: int = 4
    layout: str = PACK_QUANTIZED     # compressed-tensors: pack-quantized | int-quantized | float-quantized
    block: tuple[int, int] | None = None     # FP8: rows x columns a scale covers (None: per tensor or channel)

    @property
    def float8(self) -> bool:
        """e4m3 weights (decoded at load) rather than integer codes."""
        return self.method == FP8 or self.layout == FLOAT_QUANTIZED

    @property
    def nvfp4(self) -> bool:
        return self.layout == NVFP4_PACK_QUANTIZED

    @property
    def kind(self) -> str:
        """The weights' element, for messages: int4, int8, nvfp4 or fp8."""
        return "fp8" if self.float8 else "nvfp4" if self.nvfp4 else f"int{self.bits}"

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor names (after the module's prefix) one quantized linear is made of."""
        if self.method == MODELOPT:
            return ("weight", "weight_scale", "weight_scale_2") if self.nvfp4 else ("weight", "weight_scale")
        if self.method == FP8:
            return ("weight", "weight_scale_inv")
        if self.method == "awq":
            return ("qweight", "qzeros", "scales")
        if self.method == "gptq":
            return ("qweight", "qzeros", "scales", "g_idx")
        if self.layout in (INT_QUANTIZED, FLOAT_QUANTIZED):
            return ("weight", "weight_scale")
        if self.layout == NVFP4_PACK_QUANTIZED:
            return ("weight_packed", "weight_scale", "weight_global_scale")
        return ("weight_packed", "weight_scale", "weight_shape")

    def is_part(self, leaf: str, tensor: torch.Tensor) -> bool:
        """Whether a tensor is part of a quantized linear: int-quantized's `weight` is, as int8 only, an FP8
        one's as e4m3 only (a `weight` of the model's dtype belongs to a module left unquantized: the
        embedding, the LM head, the norms)."""
        code = torch.float8_e4m3fn if self.float8 else torch.uint8 if self.nvfp4 else torch.int8
        return leaf in self.parts and (leaf != "weight" or tensor.dtype == code)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"unsupported quantization_config: {what}")


def _block(value: Any, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    _need(isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value),
          f"{what} {value!r} (two positive sizes)")
    return int(value[0]), int(value[1])


def _fp8_activations(act: dict[str, Any] | None) -> None:
    """An FP8 checkpoint's activations: none quantized, or e4m3 (dynamic, or static scales read past)."""
    _need(act is None or (act.get("type") == "float" and int(act.get("num_bits", 0)) == 8),
          "compressed-tensors float-quantized with activations other than 8-bit float")


def _float_quantized(w: dict[str, Any], act: dict[str, Any] | None) -> CheckpointFormat:
    bits = int(w.get("num_bits", 0))
    _need(w.get("type") == "float" and bits == 8,
          f"compressed-tensors float-quantized weights of {bits} bits, type {w.get('type')!r} (8-bit float: FP8)")
    _need(bool(w.get("symmetric", True)), "asymmetric compressed-tensors weights")
    strategy = w.get("strategy", "tensor")
    _need(strategy in ("tensor", "channel", "block"),
          f"compressed-tensors float-quantized strategy {strategy!r} (tensor, channel or block)")
    block = _block(w.get("block_structure"), "block_structure") if strategy == "block" else None
    _need(strategy != "block" or block is not None, "compressed-tensors strategy block without block_structure")
    _fp8_activations(act)
    return CheckpointFormat("compressed-tensors", -1, bits=8, layout=FLOAT_QUANTIZED, block=block)


def _nvfp4(w: dict[str, Any], act: dict[str, Any] | None) -> CheckpointFormat:
    _need(w.get("type") == "float" and int(w.get("num_bits", 0)) == 4
          and int(w.get("group_size") or 0) == NVFP4_GROUP and bool(w.get("symmetric", True)),
          f"compressed-tensors {NVFP4_PACK_QUANTIZED} weights other than 4-bit float in groups of {NVFP4_GROUP}")
    _need(act is None or (act.get("type") == "float" and int(act.get("num_bits", 0)) == 4),
          f"compressed-tensors {NVFP4_PACK_QUANTIZED} with activations other than none or 4-bit float")
    return CheckpointFormat("compressed-tensors", NVFP4_GROUP, bits=4, layout=NVFP4_PACK_QUANTIZED)


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointFormat:
    layout = qc.get("format")
    formats = (PACK_QUANTIZED, INT_QUANTIZED, NVFP4_PACK_QUANTIZED, FLOAT_QUANTIZED)
    _need(layout in formats, f"compressed-tensors format {layout!r} ({', '.join(formats)})")
    groups = list((qc.get("config_groups") or {}).values())
    _need(len(groups) == 1, "compressed-tensors with other than one config group")
    w, act = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if layout == FLOAT_QUANTIZED:
        return _float_quantized(w, act)
    if layout == NVFP4_PACK_QUANTIZED:
        return _nvfp4(w, act)
    bits = int(w.get("num_bits", 0))
    _need(w.get("type", "int") == "int" and bits in ((4, 8) if layout == PACK_QUANTIZED else (8,)),
          f"compressed-tensors {layout} weights of {bits} bits, type {w.get('type')!r}")
    _need(bool(w.get("symmetric", True)), "asymmetric compressed-tensors weights")
    _need(w.get("actorder") is None, "compressed-tensors act-order weights")
    strategy = w.get("strategy", "group")
    _need(strategy in ("group", "channel"), f"compressed-tensors strategy {strategy!r} (group or channel)")
    if layout == PACK_QUANTIZED:
        _need(act is None, "compressed-tensors pack-quantized with quantized activations")
    else:     # the activations' own quantization is not applied: each GEMM rounds its rows to 16 bits
        _need(act is not None and act.get("type", "int") == "int" and int(act.get("num_bits", 0)) == 8
              and bool(act.get("dynamic", False)), "compressed-tensors int-quantized without dynamic int8 activations")
    return CheckpointFormat("compressed-tensors", int(w.get("group_size") or -1) if strategy == "group" else -1,
                            bits=bits, layout=layout)


def checkpoint_format(raw_config: dict[str, Any], model_dir: str | Path | None = None) -> CheckpointFormat | None:
    """config.json (and, where it names no quantization, model_dir's hf_quant_config.json: ModelOpt's own
    file, which older exports keep beside an unannotated config.json) -> the format the weights are quantized
    in, None for a float checkpoint; a clear ValueError for a quantized checkpoint this engine cannot read."""
    qc = raw_config.get("quantization_config")
    modelopt = Path(model_dir) / "hf_quant_config.json" if model_dir is not None else None
    if not qc and modelopt is not None and modelopt.is_file():
        qc = {"quant_method": MODELOPT, **(json.loads(modelopt.read_text()).get("quantization") or {})}
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        _need(int(qc.get("bits", qc.get("w_bit", 4))) == 4, f"awq bits {qc.get('bits')} (only 4)")
        _need(str(qc.get("version", "gemm")).lower() == "gemm", f"awq version {qc.get('version')!r} (only gemm)")
        _need(bool(qc.get("zero_point", True)), "awq without zero points")
        return CheckpointFormat("awq", int(qc.get("group_size", qc.get("q_group_size", 128))))
    if method == "gptq":
        _need(int(qc.get("bits", 4)) == 4, f"gptq bits {qc.get('bits')} (only 4)")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        _need(fmt in ("gptq", "gptq_v2"), f"gptq checkpoint_format {fmt!r} (gptq or gptq_v2)")
        return CheckpointFormat("gptq", int(qc.get("group_size", 128)), zeros_minus_one=fmt == "gptq")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == MODELOPT:
        algo = str(qc.get("quant_algo", "")).upper()
        _need(algo in ("NVFP4", "FP8"), f"modelopt quant_algo {qc.get('quant_algo')!r} (NVFP4 or FP8)")
        if algo == "FP8":
            return CheckpointFormat(MODELOPT, -1, bits=8, layout=FLOAT_QUANTIZED)
        _need(int(qc.get("group_size", NVFP4_GROUP)) == NVFP4_GROUP,
              f"modelopt NVFP4 group_size {qc.get('group_size')}")
        return CheckpointFormat(MODELOPT, NVFP4_GROUP, bits=4, layout=NVFP4_PACK_QUANTIZED)
    if method == FP8:
        _need(str(qc.get("fmt", "e4m3")).lower() == "e4m3", f"fp8 fmt {qc.get('fmt')!r} (only e4m3)")
        _need(str(qc.get("activation_scheme", "dynamic")).lower() in ("dynamic", "static"),
              f"fp8 activation_scheme {qc.get('activation_scheme')!r}")
        return CheckpointFormat(FP8, -1, bits=8, block=_block(qc.get("weight_block_size"), "weight_block_size"))
    raise ValueError(f"unsupported quantization_config: quant_method {method!r}; readable: awq and gptq "
                     "(int4), compressed-tensors (int4, int8, nvfp4, fp8), modelopt (nvfp4, fp8), fp8 (block-scaled)")


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None, bits: int = 4) -> torch.Tensor:
    """int32 [r, c] -> codes [r, (32 / bits) c], word j's field i (bits wide, from the low end) landing in
    column (32 / bits) j + order[i] (None: + i)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)    # [r, c, per], field i at i
    if order is not None:
        codes = codes[..., [order.index(k) for k in range(per)]]    # column k comes from field order.index(k)
    return codes.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> codes [8r, c], word (j, col)'s nibble i landing in row 8j + i."""
    return unpack_columns(packed.t()).t()


def _group_index(in_features: int, group_size: int) -> torch.Tensor:
    return torch.arange(in_features) // (in_features if group_size == -1 else group_size)


@dataclass
class GroupCodes:
    """One linear's quantized weight as its integers: W[:, order] = codes * scales[:, j // group_size] for the
    codes' column j. `order` (GPTQ act-order) is the input column each code column holds, so that every
    group is a run of code columns; None: in order."""

    codes: torch.Tensor          # int8 [out, in]: code - zero (int4: in [-16, 15]; int8: in [-128, 127])
    scales: torch.Tensor         # float32 [out, groups]
    group_size: int              # input columns per scale; -1: the whole row
    order: torch.Tensor | None = None    # int64 [in]: code column j is input column order[j]
    int8_rows: bool = False      # calibrated for int8 activations (W8A8): multiplied so where the CPU can

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """W [out, in] float32: each code times its scale (exact for fp16 and bf16 scales)."""
        w = self.codes.float() * self.scales[:, _group_index(self.codes.shape[1], self.group_size)]
        if self.order is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.order, w)

    def rows(self, index: slice) -> GroupCodes:
        """Output channels `index` (a column-parallel shard)."""
        return GroupCodes(self.codes[index], self.scales[index], self.group_size, self.order, self.int8_rows)

    def columns(self, index: slice) -> GroupCodes | None:
        """Input columns `index` (a row-parallel shard); None where the cut falls inside a group or the
        columns are not in order (act-order: a rank's columns are spread over every group)."""
        start, stop = index.start, min(index.stop, self.codes.shape[1])
        if self.order is not None:
            return None
        if self.group_size == -1:
            return GroupCodes(self.codes[:, start:stop], self.scales, -1, int8_rows=self.int8_rows)
        g = self.group_size
        if start % g or (stop % g and stop != self.codes.shape[1]):
            return None
        return GroupCodes(self.codes[:, start:stop], self.scales[:, start // g:-(-stop // g)], g,
                          int8_rows=self.int8_rows)


def same_order(shards: list[GroupCodes]) -> bool:
    """Whether the shards' code columns are in one order (fused q/k/v or gate/up: GPTQ's act-order sorts
    by the shared input's statistics, so it is one order unless the tool broke ties differently)."""
    first = shards[0].order
    return all((c.order is None and first is None) or (c.order is not None and first is not None
                                                       and torch.equal(c.order, first)) for c in shards)


def _codes(q: torch.Tensor, zeros: torch.Tensor | int, g: torch.Tensor) -> torch.Tensor:
    """Codes [in, out] minus their groups' zeros -> int8 [out, in]."""
    return (q - (zeros[g] if isinstance(zeros, torch.Tensor) else zeros)).t().to(torch.int8).contiguous()


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> GroupCodes:
    """AWQ GEMM tensors -> the linear's integers and scales."""
    q = unpack_columns(qweight, AWQ_PACK_ORDER)                     # [in, out]
    z = unpack_columns(qzeros, AWQ_PACK_ORDER)                      # [groups, out]
    return GroupCodes(_codes(q, z, _group_index(q.shape[0], group_size)), scales.float().t().contiguous(), group_size)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group_size: int, zeros_minus_one: bool) -> GroupCodes | torch.Tensor:
    """GPTQ tensors -> the linear's integers and scales. With act-order (`desc_act`: g_idx not in column
    order) the code columns are sorted by group, `order` saying where each came from; a g_idx whose
    groups are not all group_size columns gives W [out, in] float32 instead. g_idx None: groups in order."""
    q = unpack_rows(qweight)                                        # [in, out]
    out = q.shape[1]
    z = unpack_columns(qzeros)[:, :out] + int(zeros_minus_one)     # [groups, out]
    in_order = _group_index(q.shape[0], group_size)
    sc = scales.float().t().contiguous()
    if g_idx is None or torch.equal(g_idx.long(), in_order):
        return GroupCodes(_codes(q, z, in_order), sc, group_size)
    g = g_idx.long()
    order = torch.argsort(g, stable=True)
    if torch.equal(g[order], in_order):
        return GroupCodes(_codes(q[order], z, in_order), sc, group_size, order)
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def pack_quantized_codes(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
                         group_size: int, bits: int = 4) -> GroupCodes:
    """compressed-tensors pack-quantized tensors (int4 or int8 codes) -> the linear's integers and scales."""
    out, inp = (int(v) for v in weight_shape.tolist())
    q = unpack_columns(weight_packed, bits=bits)[:out, :inp] - (1 << (bits - 1))
    return GroupCodes(q.to(torch.int8), weight_scale.float().reshape(out, -1).contiguous(), group_size)


def nvfp4_codes(packed: torch.Tensor, group_scales: torch.Tensor) -> GroupCodes:
    """NVFP4 codes and each group's scale (fp32) -> the linear's integers and scales: each e2m1 value doubled
    (an integer of -12 to 12) times half its group's scale, which is value * scale exactly (halving and
    doubling move only the exponent)."""
    out = packed.shape[0]
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out, -1).long()
    magnitude = torch.tensor(E2M1_DOUBLED, dtype=torch.int8)[nibbles & 7]
    codes = torch.where(nibbles & 8 != 0, -magnitude, magnitude)
    return GroupCodes(codes.contiguous(), (group_scales / 2).reshape(out, -1).contiguous(), NVFP4_GROUP)


def _e4m3(scale: torch.Tensor) -> torch.Tensor:
    """An e4m3 scale tensor as fp32 (some writers store its bytes as uint8)."""
    return (scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale).float()


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """e4m3 values [out, in] and their scales -> W [out, in] float32, value * scale: one scale for the tensor,
    one per output channel ([out, 1] or [out]), or one per block of `block` rows x columns ([ceil(out / b0),
    ceil(in / b1)], the last blocks cut short)."""
    out, inp = weight.shape
    s = scale.float()
    if block is not None and s.dim() == 2 and s.shape == (-(-out // block[0]), -(-inp // block[1])):
        s = s.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    elif s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.numel() == out and (s.dim() == 1 or s.shape[-1] == 1):
        s = s.reshape(out, 1)
    else:
        raise ValueError(f"fp8 weight {tuple(weight.shape)}: scales of shape {tuple(scale.shape)} fit neither the "
                         f"tensor, its output channels nor blocks of {block}")
    return weight.float() * s


def _weight(fmt: CheckpointFormat, t: dict[str, torch.Tensor]) -> GroupCodes | torch.Tensor:
    if fmt.float8:
        return fp8_weight(t["weight"], t["weight_scale_inv" if fmt.method == FP8 else "weight_scale"], fmt.block)
    if fmt.method == "awq":
        return awq_codes(t["qweight"], t["qzeros"], t["scales"], fmt.group_size)
    if fmt.method == "gptq":
        return gptq_weight(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), fmt.group_size,
                           fmt.zeros_minus_one)
    if fmt.nvfp4 and fmt.method == MODELOPT:          # a multiplier
        return nvfp4_codes(t["weight"], _e4m3(t["weight_scale"]) * t["weight_scale_2"].float().reshape(()))
    if fmt.nvfp4:                                      # compressed-tensors: a divisor
        return nvfp4_codes(t["weight_packed"], _e4m3(t["weight_scale"]) / t["weight_global_scale"].float().reshape(()))
    if fmt.layout == INT_QUANTIZED:
        w = t["weight"]
        scales = t["weight_scale"].float().reshape(w.shape[0], -1).contiguous()
        return GroupCodes(w.contiguous(), scales, fmt.group_size, int8_rows=True)
    return pack_quantized_codes(t["weight_packed"], t["weight_scale"], t["weight_shape"], fmt.group_size, fmt.bits)


def unpacked_tensors(fmt: CheckpointFormat, tensors: Iterable[tuple[str, torch.Tensor]],
                     keep_codes: bool) -> Iterator[tuple[str, GroupCodes | torch.Tensor]]:
    """The checkpoint's tensors with every quantized linear's parts replaced by its `PREFIX.weight`,
    yielded as soon as its parts are all read: its GroupCodes (keep_codes), else W float32; the scales the
    engine does not apply (UNAPPLIED_SCALES) dropped; every other tensor passes through."""
    def weight(parts: dict[str, torch.Tensor]) -> GroupCodes | torch.Tensor:
        w = _weight(fmt, parts)
        return w.dequantize() if isinstance(w, GroupCodes) and not keep_codes else w

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf in UNAPPLIED_SCALES:
            continue
        if not fmt.is_part(leaf, tensor):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == len(fmt.parts):
            yield f"{prefix}.weight", weight(pending.pop(prefix))
    for prefix, parts in pending.items():      # GPTQ without g_idx: groups in order
        if fmt.method == "gptq" and set(fmt.parts) - set(parts) == {"g_idx"}:
            yield f"{prefix}.weight", weight(parts)
        else:
            raise ValueError(f"{fmt.method} checkpoint: {prefix} lacks {sorted(set(fmt.parts) - set(parts))}")


def checkpoint_weights(model_dir: str, fmt: CheckpointFormat | None, dtype: torch.dtype,
                       keep_codes: bool = False) -> Iterator[tuple[str, GroupCodes | torch.Tensor]]:
    """Every tensor of the checkpoint in `dtype` (fmt from checkpoint_format); its quantized linears'
    weights as GroupCodes (keep_codes) or dequantized."""
    tensors = iter_safetensors(model_dir)
    if fmt is not None:
        tensors = unpacked_tensors(fmt, tensors, keep_codes)
    return ((name, t if isinstance(t, GroupCodes) else t.to(dtype)) for name, t in tensors)


def resolve_quantization(requested: str, fmt: CheckpointFormat | None) -> str:
    """--quantization against the checkpoint -> the quantization the model runs: none | int8 | w8a8 | fp8
    (applied at load) for a float checkpoint, the checkpoint's format (awq | gptq | compressed-tensors)
    for a pre-quantized one. A pre-quantized checkpoint takes `none`, `auto` or its own format's name;
    anything else is a clear error rather than a second rounding of already rounded weights. An FP8
    checkpoint's weights run decoded (none), or with `fp8` rounded to e4m3 per row again for the CUDA GEMM."""
    if fmt is None:
        if requested in CHECKPOINT_FORMATS:
            raise ValueError(f"--quantization {requested}: the checkpoint is not {requested}-quantized "
                             "(config.json has no quantization_config)")
        return "none" if requested == "auto" else requested
    allowed = ("none", "auto", fmt.method, FP8) if fmt.float8 else ("none", "auto", fmt.method)
    if requested not in allowed:
        raise ValueError(f"--quantization {requested}: the checkpoint is already quantized "
                         f"({fmt.method} {fmt.kind}); "
                         f"use auto or {fmt.method}")
    if fmt.float8:
        return FP8 if requested == FP8 else "none"
    return fmt.method
