"""Pre-quantized int4 weight-only checkpoints: AWQ (GEMM), GPTQ (v1 and v2) and compressed-tensors
pack-quantized. config.json's `quantization_config` names the format; at load every quantized linear
(its packed int32 codes, zero points and fp16 scales) is dequantized once into a plain `weight`
tensor, and the model loads it like a bf16/fp32 checkpoint (then packed for the CPU GEMM, in --dtype).

Why dequantize rather than keep int4: measured on the 2-core AVX2 EPYC (docs/engine-speed.md), torch's
CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`, per-group dequant inside the matmul) ran 2.4x
slower than the fp32 packed GEMM at one row and 2.3x slower at 32 rows on a 4096 x 4096 layer; the
memory it saves does not buy time on such CPUs, and the dequantized weight reuses every float path
(packed GEMM, LoRA, tensor-parallel shards) unchanged.

The layouts (w = (q - zero) * scale, groups of `group_size` input columns, one scale per output
channel and group):
- AWQ GEMM: `qweight` int32 [in, out/8], eight output columns per word, nibble i holding column
  AWQ_PACK_ORDER[i] of its eight; `qzeros` int32 [groups, out/8] packed the same way; `scales` [groups, out].
- GPTQ: `qweight` int32 [in/8, out], eight input rows per word in order (nibble i = row 8j+i);
  `qzeros` int32 [groups, out/8], eight output columns per word in order; `scales` [groups, out];
  `g_idx` [in] the group of each input row (act-order permutes it). The v1 format (AutoGPTQ, the
  default `checkpoint_format`) stores each zero minus one; `gptq_v2` stores it as is.
- compressed-tensors pack-quantized: `weight_packed` int32 [out, in/8], eight input columns per word
  in order, each code the signed value + 8; `weight_scale` [out, groups]; `weight_shape` [out, in];
  symmetric (no zero point).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from consort_engine.model.loader import iter_safetensors

CHECKPOINT_FORMATS = ("awq", "gptq", "compressed-tensors")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # nibble i of an AWQ word holds column AWQ_PACK_ORDER[i]
BITS = 4
PACK = 32 // BITS
MAX_CODE = (1 << BITS) - 1


@dataclass(frozen=True)
class Int4Format:
    """What config.json's quantization_config says about the packed weights."""

    method: str                  # awq | gptq | compressed-tensors
    group_size: int              # input columns per scale; -1: the whole row
    zeros_minus_one: bool = False    # GPTQ v1: every stored zero is the zero minus one

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor names (after the module's prefix) one quantized linear is made of."""
        if self.method == "awq":
            return ("qweight", "qzeros", "scales")
        if self.method == "gptq":
            return ("qweight", "qzeros", "scales", "g_idx")
        return ("weight_packed", "weight_scale", "weight_shape")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"unsupported quantization_config: {what}")


def checkpoint_format(raw_config: dict[str, Any]) -> Int4Format | None:
    """config.json -> the int4 format its weights are packed in, None for a float checkpoint; a clear
    ValueError for a quantized checkpoint this engine cannot read."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        _need(int(qc.get("bits", qc.get("w_bit", 4))) == BITS, f"awq bits {qc.get('bits')} (only 4)")
        _need(str(qc.get("version", "gemm")).lower() == "gemm", f"awq version {qc.get('version')!r} (only gemm)")
        _need(bool(qc.get("zero_point", True)), "awq without zero points")
        return Int4Format("awq", int(qc.get("group_size", qc.get("q_group_size", 128))))
    if method == "gptq":
        _need(int(qc.get("bits", 4)) == BITS, f"gptq bits {qc.get('bits')} (only 4)")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        _need(fmt in ("gptq", "gptq_v2"), f"gptq checkpoint_format {fmt!r} (gptq or gptq_v2)")
        return Int4Format("gptq", int(qc.get("group_size", 128)), zeros_minus_one=fmt == "gptq")
    if method == "compressed-tensors":
        _need(qc.get("format") == "pack-quantized", f"compressed-tensors format {qc.get('format')!r} (only pack-quantized)")
        groups = list((qc.get("config_groups") or {}).values())
        _need(len(groups) == 1, "compressed-tensors with other than one config group")
        w = groups[0].get("weights") or {}
        _need(int(w.get("num_bits", 0)) == BITS and w.get("type", "int") == "int", "compressed-tensors weights not int4")
        _need(bool(w.get("symmetric", True)), "asymmetric compressed-tensors weights")
        _need(groups[0].get("input_activations") is None, "compressed-tensors with quantized activations")
        strategy = w.get("strategy", "group")
        _need(strategy in ("group", "channel"), f"compressed-tensors strategy {strategy!r} (group or channel)")
        return Int4Format("compressed-tensors", int(w.get("group_size") or -1) if strategy == "group" else -1)
    raise ValueError(f"unsupported quantization_config: quant_method {method!r}; "
                     f"readable: {', '.join(CHECKPOINT_FORMATS)} (int4)")


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """int32 [r, c] -> codes [r, 8c], word j's nibble i landing in column 8j + order[i]."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & MAX_CODE            # [r, c, 8], nibble i at i
    inverse = [order.index(k) for k in range(PACK)]                 # column k comes from nibble inverse[k]
    return codes[..., inverse].reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> codes [8r, c], word (j, col)'s nibble i landing in row 8j + i."""
    return unpack_columns(packed.t()).t()


def _group_index(in_features: int, group_size: int) -> torch.Tensor:
    return torch.arange(in_features) // (in_features if group_size == -1 else group_size)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ GEMM tensors -> W [out, in] float32."""
    q = unpack_columns(qweight, AWQ_PACK_ORDER)                     # [in, out]
    z = unpack_columns(qzeros, AWQ_PACK_ORDER)                      # [groups, out]
    g = _group_index(q.shape[0], group_size)
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    group_size: int, zeros_minus_one: bool) -> torch.Tensor:
    """GPTQ tensors -> W [out, in] float32 (g_idx None: groups in order)."""
    q = unpack_rows(qweight)                                        # [in, out]
    out = q.shape[1]
    z = unpack_columns(qzeros)[:, :out] + int(zeros_minus_one)     # [groups, out]
    g = _group_index(q.shape[0], group_size) if g_idx is None else g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


def dequantize_pack_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
                              group_size: int) -> torch.Tensor:
    """compressed-tensors pack-quantized tensors -> W [out, in] float32."""
    out, inp = (int(v) for v in weight_shape.tolist())
    q = unpack_columns(weight_packed)[:out, :inp] - (1 << (BITS - 1))
    return q.float() * weight_scale.float()[:, _group_index(inp, group_size)]


def _dequantize(fmt: Int4Format, t: dict[str, torch.Tensor]) -> torch.Tensor:
    if fmt.method == "awq":
        return dequantize_awq(t["qweight"], t["qzeros"], t["scales"], fmt.group_size)
    if fmt.method == "gptq":
        return dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), fmt.group_size,
                               fmt.zeros_minus_one)
    return dequantize_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_shape"], fmt.group_size)


def dequantized_tensors(fmt: Int4Format, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every quantized linear's parts replaced by its `PREFIX.weight`
    (float32), yielded as soon as its parts are all read; every other tensor passes through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in fmt.parts:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == len(fmt.parts):
            yield f"{prefix}.weight", _dequantize(fmt, pending.pop(prefix))
    for prefix, parts in pending.items():      # GPTQ without g_idx: groups in order
        if fmt.method == "gptq" and set(fmt.parts) - set(parts) == {"g_idx"}:
            yield f"{prefix}.weight", _dequantize(fmt, parts)
        else:
            raise ValueError(f"{fmt.method} checkpoint: {prefix} lacks {sorted(set(fmt.parts) - set(parts))}")


def checkpoint_weights(model_dir: str, fmt: Int4Format | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, quantized linears already dequantized (fmt from checkpoint_format)."""
    tensors = iter_safetensors(model_dir)
    return tensors if fmt is None else dequantized_tensors(fmt, tensors)


def resolve_quantization(requested: str, fmt: Int4Format | None) -> str:
    """--quantization against the checkpoint -> the quantization to apply at load (none | int8 | w8a8 |
    fp8). A pre-quantized checkpoint takes `none`, `auto` or its own format's name; anything else is a
    clear error rather than a second rounding of already rounded weights."""
    if fmt is None:
        if requested in CHECKPOINT_FORMATS:
            raise ValueError(f"--quantization {requested}: the checkpoint is not {requested}-quantized "
                             "(config.json has no quantization_config)")
        return "none" if requested == "auto" else requested
    if requested not in ("none", "auto", fmt.method):
        raise ValueError(f"--quantization {requested}: the checkpoint is already quantized ({fmt.method} int4); "
                         f"use auto or {fmt.method}")
    return "none"
