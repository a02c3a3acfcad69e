"""LoRA adapters in PEFT's on-disk format, applied unmerged so one engine serves many adapters.

An adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
`adapter_model.safetensors` with `...layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r] (a hybrid's layers: `self_attn`, `mamba` with its in_proj and out_proj, and
`feed_forward` for the MLP). A projection's output gains scaling * (x A^T) B^T for the rows of the
requests that name the adapter; the scheduler groups a step's rows by adapter, so each adapter costs
two thin matmuls per projection per step (on CPU one kernel call, csrc/lora.c). The scaling is folded
into B at load time, and B is kept transposed ([r, out]): the update runs along its rows.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# projection name in the checkpoint -> (our fused module, shard index)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0), "in_proj": ("in_proj", 0), "out_proj": ("out_proj", 0)}
KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp|feed_forward|mamba)\.(\w+_proj)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be loaded or unloaded; `code` is the typed API error code."""

    def __init__(self, message: str, code: str = "invalid_adapter"):
        super().__init__(message)
        self.code = code


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, fused module, shard) -> (A [r, in], (B * scaling)^T [r, shard_out]), float32, contiguous
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class LoraContext:
    """Row segments of the current step that carry an adapter: (start, end, adapter name). Set by the
    model runner before each forward; read by every projection."""
    segments: list[tuple[int, int, str]] = field(default_factory=list)


def load_peft_adapter(name: str, path: str | Path, shard_shapes: list[dict[str, list[tuple[int, int]]]],
                      device: torch.device | str = "cpu") -> LoraAdapter:
    """Read a PEFT LoRA adapter; shard_shapes[i] maps each fused module of layer i to its shards' (out, in)
    (a hybrid's layers differ: attention or mixer)."""
    path = Path(path)
    cfg_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"adapter {name!r}: {path} needs adapter_config.json and adapter_model.safetensors")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", cfg.get("r", 0)))
    if rank <= 0:
        raise AdapterError(f"adapter {name!r}: rank r must be positive, got {cfg.get('r')!r}")
    scaling = alpha / rank ** 0.5 if cfg.get("use_rslora") else alpha / rank
    from safetensors.torch import load_file
    tensors = load_file(str(weights_path))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"adapter {name!r}: unsupported tensor {key} (LoRA on the attention, mixer and MLP "
                               f"projections only)")
        layer = int(m.group(1))
        if layer >= len(shard_shapes):
            raise AdapterError(f"adapter {name!r}: {key} targets layer {layer}; the model has {len(shard_shapes)}")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    adapter = LoraAdapter(name, str(path), rank, scaling)
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {proj} lacks lora_{'B' if 'A' in ab else 'A'}")
        module, shard = TARGETS[proj]
        if module not in shard_shapes[layer]:
            kinds = " / ".join(sorted(shard_shapes[layer]))
            raise AdapterError(f"adapter {name!r}: layer {layer} has no {proj} (its projections: {kinds})")
        out_f, in_f = shard_shapes[layer][module][shard]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise AdapterError(f"adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                               f"{tuple(b.shape)}; expected ({rank}, {in_f}) and ({out_f}, {rank})")
        adapter.weights[(layer, module, shard)] = (a.to(device, torch.float32).contiguous(),
                                                   (b.to(device, torch.float32) * scaling).t().contiguous())
    if not adapter.weights:
        raise AdapterError(f"adapter {name!r}: no LoRA tensors in {weights_path}")
    return adapter


def segments_of(adapters: list[str | None], row_counts: list[int]) -> list[tuple[int, int, str]]:
    """Row segments (start, end, adapter) of a step laid out as consecutive per-sequence rows;
    neighbouring sequences with the same adapter share one segment."""
    out: list[tuple[int, int, str]] = []
    row = 0
    for name, n in zip(adapters, row_counts):
        if name is not None:
            if out and out[-1][2] == name and out[-1][1] == row:
                out[-1] = (out[-1][0], row + n, name)
            else:
                out.append((row, row + n, name))
        row += n
    return out
