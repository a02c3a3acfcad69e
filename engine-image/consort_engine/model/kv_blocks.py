"""Whole KV blocks in and out of the pool as bytes: what the KV tier (kv/tier.py) stores.

The pool is one tensor [kv layers, 2, blocks, ...] (model_runner.py); a block's bytes are
pool[:, :, block] made contiguous: every layer's K then V, in the pool's own layout. The layout
identity names everything those bytes depend on, so a block is only ever loaded into an engine
that would have computed the same bytes.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def layout_identity(config, kv_cache: torch.Tensor, backend: str, tp_rank: int, tp_size: int) -> str:
    """Model (its config.json and weight files' names and sizes), weight quantization, dtype, per-block
    shape, pool layout and shard: two engines with the same identity compute the same K/V for the same
    tokens (quantized weights compute other K/V from the same files)."""
    root = Path(config.model)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    shape = "x".join(str(d) for d in kv_cache[:, :, 0].shape)
    layout = "heads-first" if backend == "cpu_kernel" else "tokens-first"
    return (f"model={digest.hexdigest()[:16]} quant={config.quantization} dtype={str(kv_cache.dtype).removeprefix('torch.')} "
            f"block={shape} layout={layout} shard={tp_rank}/{tp_size}")


@torch.inference_mode()
def read_blocks(kv_cache: torch.Tensor, blocks: list[int]) -> list[bytes]:
    """The bytes of each block, in order (one gather and one device-to-host copy for all)."""
    idx = torch.tensor(blocks, dtype=torch.int64, device=kv_cache.device)
    host = kv_cache[:, :, idx].movedim(2, 0).contiguous().cpu()
    raw = host.view(torch.uint8).reshape(len(blocks), -1).numpy()
    return [raw[i].tobytes() for i in range(len(blocks))]


@torch.inference_mode()
def write_blocks(kv_cache: torch.Tensor, blocks: list[int], data: list[bytes]) -> None:
    """Put each block's bytes (from read_blocks, same layout identity) into its pool block."""
    per_block = kv_cache[:, :, 0].shape
    host = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
    host = host.view(kv_cache.dtype).view(len(blocks), *per_block).movedim(0, 2)
    idx = torch.tensor(blocks, dtype=torch.int64, device=kv_cache.device)
    kv_cache[:, :, idx] = host.to(kv_cache.device)
