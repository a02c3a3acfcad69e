"""What one forward pass takes: each sequence's rows (RowGroup, MTPRows) and the device tensors the
runner builds from them (StepInputs), which the decode CUDA graphs replay into their buffers too."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from consort_engine.model.attention import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # [T] int64, batched group first, then prefill spans
    positions: torch.Tensor      # [T] int64
    meta: AttentionMetadata
    sample_idx: torch.Tensor     # [S] int64: token row of each sampled sequence, in batch order
    lora_segments: list[tuple[int, int, str]] = field(default_factory=list)   # rows of adapter requests
    order: list[int] = field(default_factory=list)       # item (sequence) index of each row group, row order
    item_rows: list[tuple[int, int]] = field(default_factory=list)   # [start, end) rows of each item, item order


@dataclass
class RowGroup:
    """One sequence's rows in a forward: `tokens` at positions start.. (their K/V go to those slots),
    the last `num_sampled` rows sampled."""
    tokens: list[int]
    start: int
    block_table: list[int]
    num_sampled: int
    adapter: str | None = None
    state_slot: int = -1          # hybrid models: the sequence's conv/SSM state slot
    checkpoints: list[tuple[int, int]] = field(default_factory=list)   # hybrids: (rows in, checkpoint row) to save


@dataclass
class MTPRows:
    """A sequence's MTP pass input: rows at positions start.. fuse tokens start+1.. with the target's
    normed hidden states there; `num_draft` tokens are drafted after the last row (0: KV only)."""
    tokens: list[int]
    hidden: torch.Tensor
    start: int
    block_table: list[int]
    num_draft: int


TYPECODES = {torch.int64: "q", torch.int32: "i"}


def host_ints(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of Python ints (int64 or int32) over an array's buffer: torch.tensor on a list converts
    int by int (113 us for 2,048 of them, 3 us for 5), the array in C (31 us, 1 us)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(TYPECODES[dtype], values), dtype=dtype)
