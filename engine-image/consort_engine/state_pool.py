"""Per-sequence recurrent state of hybrid (attention + Mamba2) models: slots, not blocks.

A mixer layer's conv and SSM state is a fixed number of bytes per sequence, whatever its length.
The runner holds one pool per kind, [max_num_seqs, mixer layers, ...]; a running sequence owns one
slot index (Sequence.state_slot), taken on admission with its KV blocks and given back with them on
finish, abort or preemption (block_manager.py). A preempted sequence recomputes from scratch, like
its KV: a fresh slot is zeroed when its first chunk runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StateMetadata:
    """What the mixers of one step read: the pools and which rows use which slot."""
    conv: torch.Tensor                          # [slots, mixers, conv_dim, d_conv - 1]
    ssm: torch.Tensor                           # [slots, mixers, heads, head_dim, d_state] float32
    decode_rows: torch.Tensor | None = None     # [B] int64: rows of single-token groups (one batched step)
    decode_slots: torch.Tensor | None = None    # [B] int64: their slots
    chunks: list[tuple[int, int, int]] = field(default_factory=list)   # (start row, end row, slot) scans


class StateSlots:
    """Free list of state slot ids 0..n-1."""

    def __init__(self, n: int) -> None:
        self.num_slots = n
        self._free = list(range(n - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"state slot {slot} freed twice"
        self._free.append(slot)


def state_bytes_per_seq(mixers) -> int:
    """Bytes of conv (model dtype counted as 4) + SSM (float32) state one sequence holds, all mixers."""
    total = 0
    for m in mixers:
        conv, ssm = m.state_shapes()
        total += 4 * (conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2])
    return total


def build_state_metadata(conv: torch.Tensor, ssm: torch.Tensor, rows: list[tuple[int, int]],
                         slots: list[int]) -> StateMetadata:
    """Split a step's row groups (item order, [start, end) rows, slot) into the batched decode rows
    and the per-sequence scan chunks."""
    dec_rows, dec_slots, chunks = [], [], []
    for (a, b), s in zip(rows, slots):
        assert s >= 0, "a hybrid model's sequence runs without a state slot"
        if b - a == 1:
            dec_rows.append(a)
            dec_slots.append(s)
        elif b > a:
            chunks.append((a, b, s))
    meta = StateMetadata(conv, ssm, chunks=chunks)
    if dec_rows:
        meta.decode_rows = torch.tensor(dec_rows, dtype=torch.int64, device=conv.device)
        meta.decode_slots = torch.tensor(dec_slots, dtype=torch.int64, device=conv.device)
    return meta
