"""Whole KV blocks in and out of the pool as bytes: what the KV tier (kv/tier.py) stores.

The pool is one tensor [kv layers, 2, blocks, ...] (model_runner.py); a block's bytes are
pool[:, :, block] made contiguous: every layer's K then V, in the pool's own layout. A hybrid's
state checkpoint (model/hybrid_state.py) travels with its block: a checkpoint row's conv state then
its SSM state, every mixer layer's. The layout identity names everything those bytes depend on, so
a block is only ever loaded into an engine that would have computed the same bytes.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def layout_identity(config, weights_dtype: torch.dtype, kv_cache: torch.Tensor, backend: str, tp_rank: int,
                    tp_size: int, states: tuple[torch.Tensor, ...] = ()) -> str:
    """Model (its config.json and weight files' names and sizes), weight quantization, the weights' dtype and
    the pool's, per-block shape, pool layout, shard and, for a hybrid, its checkpoint pools' per-row shapes and
    dtypes: two engines with the same identity compute the same K/V and state for the same tokens (quantized
    weights compute other K/V from the same files; a narrower pool rounds them otherwise)."""
    root = Path(config.model)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    shape = "x".join(str(d) for d in kv_cache[:, :, 0].shape)
    layout = "heads-first" if backend == "cpu_kernel" else "tokens-first"
    return (f"model={digest.hexdigest()[:16]} quant={config.quantization} dtype={_name(weights_dtype)} "
            f"kv={_name(kv_cache.dtype)} block={shape} layout={layout} shard={tp_rank}/{tp_size}"
            + "".join(f" state={'x'.join(map(str, t.shape[1:]))}:{_name(t.dtype)}" for t in states))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


@torch.inference_mode()
def read_states(pools: tuple[torch.Tensor, ...], rows: list[int]) -> list[bytes]:
    """The bytes of each checkpoint row (every pool's row in turn: conv, then SSM), in order."""
    idx = torch.tensor(rows, dtype=torch.int64, device=pools[0].device)
    raws = [p[idx].contiguous().cpu().view(torch.uint8).reshape(len(rows), -1).numpy() for p in pools]
    return [b"".join(raw[i].tobytes() for raw in raws) for i in range(len(rows))]


def state_bytes(pools: tuple[torch.Tensor, ...]) -> int:
    """Bytes of one checkpoint row as read_states writes it."""
    return sum(p[0].numel() * p.element_size() for p in pools)


@torch.inference_mode()
def write_states(pools: tuple[torch.Tensor, ...], rows: list[int], data: list[bytes]) -> None:
    """Put each row's bytes (from read_states, same layout identity) into its checkpoint row."""
    host = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8).view(len(rows), -1)
    idx = torch.tensor(rows, dtype=torch.int64, device=pools[0].device)
    at = 0
    for p in pools:
        n = p[0].numel() * p.element_size()
        p[idx] = host[:, at:at + n].contiguous().view(p.dtype).view(len(rows), *p.shape[1:]).to(p.device)
        at += n
