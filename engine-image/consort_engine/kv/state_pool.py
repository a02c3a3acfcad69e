"""Per-sequence recurrent state of hybrid (attention + Mamba2) models: slots, not blocks.

A mixer layer's conv and SSM state is a fixed number of bytes per sequence, whatever its length.
The runner holds one pool per kind, [max_num_seqs, mixer layers, ...]; a running sequence owns one
slot index (Sequence.state_slot), taken on admission with its KV blocks and given back with them on
finish, abort or preemption (block_manager.py). A sequence's first chunk runs on a zeroed slot.

Preemption swaps instead of recomputing (SwappedState): a hybrid's prefix cache hits only at state
checkpoints, so a recompute would run most of the sequence again, while the bytes that let it resume are its attention
layers' KV (a few layers) plus one state slot. The scheduler records what to copy; the engine has the
runner copy it to host memory (pinned on CUDA) before the step that reuses the blocks runs, and back
into the blocks and slot the sequence gets when it is readmitted. Which runner goes is pick_victim's
choice: a state copy is a fixed cost per victim, so it prefers one victim that frees enough blocks
over several small ones.

Speculative verify: a window (last token + K drafts) steps the recurrence row by row (RowRuns), batched
over every window of the step, from its slot's state without writing it back; each mixer keeps the
inputs its step took (VerifyWindows). Once acceptance is known, every window steps its kept tokens
again, this time into its slot (model/hybrid_state.py commit_windows): the slot never holds a rejected
draft's state, so nothing is saved or put back (a real hybrid's state is megabytes per layer and
sequence), and a window costs two passes over its state, whatever its length and acceptance.

Prefix caching: a prefill chunk may carry checkpoints, (tokens into the chunk, checkpoint row): the
scan stops at each and saves the conv and SSM state there into the runner's checkpoint pools
([rows, mixers, ...]), which the block manager attaches to the block ending at that token. A prefix
hit copies its row into the new sequence's slot before the step runs, and the prefill continues
from it.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class StateMetadata:
    """What the mixers of one step read: the pools and which rows use which slot."""
    conv: torch.Tensor                          # [slots, mixers, conv_dim, d_conv - 1]
    ssm: torch.Tensor                           # [slots, mixers, heads, head_dim, d_state] float32
    decode_rows: torch.Tensor | slice | None = None   # rows of single-token groups (one batched step)
    decode_slots: torch.Tensor | slice | None = None  # their slots (a slice when consecutive: views, no gather)
    decode_ids: tuple[torch.Tensor, torch.Tensor] | None = None   # the same as int64 arrays (CPU: the C step)
    # CPU: chunks and their checkpoints as arrays for the C scan: (starts, ends int32, slots int64),
    # (the cuts' chunk, tokens into it int32, checkpoint row int64)
    chunk_ids: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
    chunks: list[tuple[int, int, int]] = field(default_factory=list)   # (start row, end row, slot) scans
    # per chunk: (rows into it, checkpoint row) where its state is saved into ckpt_conv / ckpt_ssm
    chunk_checkpoints: list[list[tuple[int, int]]] = field(default_factory=list)
    ckpt_conv: torch.Tensor | None = None       # [rows, mixers, conv_dim, d_conv - 1]
    ckpt_ssm: torch.Tensor | None = None        # [rows, mixers, heads, head_dim, d_state] float32
    windows: "VerifyWindows | None" = None      # speculative verify windows


@dataclass
class RowRuns:
    """Runs of consecutive step rows, each stepped token by token from one slot's state: what a mixer's
    `step` takes."""
    first_rows: list[int]
    lengths: list[int]
    slots: list[int]
    device: torch.device

    @cached_property
    def ids(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first rows int64, lengths int32, slots int64) on CPU: the C step's arrays."""
        return (torch.tensor(self.first_rows, dtype=torch.int64), torch.tensor(self.lengths, dtype=torch.int32),
                torch.tensor(self.slots, dtype=torch.int64))

    @cached_property
    def by_position(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Position by position (tensor ops step that way): the (rows, slots) of the runs that long, in run
        order, int64 on the device; the first position holds every run."""
        steps = []
        for j in range(max(self.lengths, default=0)):
            live = [k for k, n in enumerate(self.lengths) if n > j]
            steps.append((torch.tensor([self.first_rows[k] + j for k in live], dtype=torch.int64, device=self.device),
                          torch.tensor([self.slots[k] for k in live], dtype=torch.int64, device=self.device)))
        return steps

    @cached_property
    def on_copies(self) -> tuple[torch.Tensor, "RowRuns"]:
        """(the slots as an index on the device, the same runs on slots 0..n-1): stepping copies of the
        slots' state, gathered in run order."""
        idx = torch.tensor(self.slots, dtype=torch.int64, device=self.device)
        return idx, RowRuns(self.first_rows, self.lengths, list(range(len(self.slots))), self.device)


@dataclass
class VerifyWindows:
    """A step's verify windows (one run each) and, per mixer, the inputs its step took (whatever that
    mixer needs to step a window's rows again); commit: where the step ran its layers in one C call, the
    same steps of every mixer in one call (kept runs -> None), else None (mixer by mixer)."""
    runs: RowRuns
    inputs: list = field(default_factory=list)
    commit: Callable[[RowRuns], None] | None = None

    def kept_runs(self, kept: dict[int, int]) -> RowRuns | None:
        """kept: slot -> tokens of its window whose state stands (1..length). The runs of those tokens,
        from each window's first row; None when no window is named (its sequence finished)."""
        runs = self.runs
        keep = [(a, min(kept[s], n), s) for a, n, s in zip(runs.first_rows, runs.lengths, runs.slots) if s in kept]
        if not keep:
            return None
        return RowRuns([a for a, _, _ in keep], [m for _, m, _ in keep], [s for *_, s in keep], runs.device)


class StateSlots:
    """Free state slot ids 0..n-1, lowest first: sequences admitted together get consecutive slots in
    run order, so a decode batch's slots are usually a slice (see as_index)."""

    def __init__(self, n: int) -> None:
        self.num_slots = n
        self._free = list(range(n))       # a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return heapq.heappop(self._free)

    def give(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"state slot {slot} freed twice"
        heapq.heappush(self._free, slot)


@dataclass
class SwappedState:
    """A preempted hybrid sequence's computed KV blocks and conv/SSM state, parked in host memory.
    The scheduler fills what to copy (src_*); the runner fills the host tensors (swap_out) and copies
    them into the sequence's new blocks and slot at readmission (swap_in)."""
    num_computed_tokens: int
    src_blocks: list[int]
    src_slot: int
    kv: torch.Tensor | None = None         # [kv layers, 2, blocks, ...] in the pool's layout
    conv: torch.Tensor | None = None       # [mixers, conv_dim, d_conv - 1]
    ssm: torch.Tensor | None = None        # [mixers, heads, head_dim, d_state]

    @property
    def copied(self) -> bool:
        return self.kv is not None


def pick_victim(blocks: list[int], need: int, block_bytes: int, state_bytes: int) -> int:
    """Which of the candidate runners (their block counts, run order: latest last) to preempt so that
    `need` more blocks come free, weighing the bytes a swap copies (its blocks + one state slot, twice)
    against the blocks it frees. One that alone frees enough: the cheapest such copy; else the one
    freeing the most (fewest victims, so fewest fixed state copies). Ties go to the latest arrival."""
    cost = [b * block_bytes + state_bytes for b in blocks]
    enough = [i for i, b in enumerate(blocks) if b >= need]
    if enough:
        return min(enough, key=lambda i: (cost[i], -i))
    return max(range(len(blocks)), key=lambda i: (blocks[i], i))


def as_index(ids: list[int], device: torch.device) -> torch.Tensor | slice:
    """A slice when the ids are consecutive and ascending (indexing then makes views, not copies:
    in steady state a decode batch's rows and slots usually are), else an int64 index tensor."""
    if ids[-1] - ids[0] == len(ids) - 1 and all(b == a + 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.int64, device=device)


def build_state_metadata(conv: torch.Tensor, ssm: torch.Tensor, rows: list[tuple[int, int]],
                         slots: list[int], windows: list[bool],
                         checkpoints: list[list[tuple[int, int]]] | None = None,
                         ckpt: tuple[torch.Tensor, torch.Tensor] | None = None) -> StateMetadata:
    """Split a step's row groups (item order: [start, end) rows, slot, whether it is a verify window,
    the checkpoints of a prefill chunk) into the batched decode rows, the verify windows and the
    per-sequence scan chunks."""
    dec_rows, dec_slots, chunks, wins, cuts = [], [], [], [], []
    for k, ((a, b), s, w) in enumerate(zip(rows, slots, windows)):
        assert s >= 0, "a hybrid model's sequence runs without a state slot"
        if b - a == 1:
            dec_rows.append(a)
            dec_slots.append(s)
        elif w:
            wins.append((a, b - a, s))
        elif b > a:
            chunks.append((a, b, s))
            cuts.append(checkpoints[k] if checkpoints else [])
        assert not (checkpoints and checkpoints[k]) or (b - a > 1 and not w), "checkpoint outside a prefill chunk"
    dev = conv.device
    meta = StateMetadata(conv, ssm, chunks=chunks, chunk_checkpoints=cuts)
    if ckpt is not None:
        meta.ckpt_conv, meta.ckpt_ssm = ckpt
    if dec_rows:
        meta.decode_rows, meta.decode_slots = as_index(dec_rows, dev), as_index(dec_slots, dev)
        if dev.type == "cpu":
            meta.decode_ids = torch.tensor(dec_rows, dtype=torch.int64), torch.tensor(dec_slots, dtype=torch.int64)
    if chunks and dev.type == "cpu":
        spans = (torch.tensor([a for a, _, _ in chunks], dtype=torch.int32),
                 torch.tensor([b for _, b, _ in chunks], dtype=torch.int32),
                 torch.tensor([s for _, _, s in chunks], dtype=torch.int64))
        at = [(i, off, row) for i, cs in enumerate(cuts) for off, row in cs]
        meta.chunk_ids = spans, (torch.tensor([i for i, _, _ in at], dtype=torch.int32),
                                 torch.tensor([off for _, off, _ in at], dtype=torch.int32),
                                 torch.tensor([row for _, _, row in at], dtype=torch.int64))
    if wins:
        runs = RowRuns([a for a, _, _ in wins], [n for _, n, _ in wins], [s for *_, s in wins], dev)
        meta.windows = VerifyWindows(runs, [None] * conv.shape[1])
    return meta


def seqs_per_pool(pool_bytes: int, context_len: int, block_size: int, block_bytes: int, state_bytes: int) -> int:
    """Sequences of `context_len` tokens that fit in `pool_bytes`: each holds its KV blocks (attention
    layers only) plus, for a hybrid, its conv/SSM state (bytes per sequence, not per token)."""
    per_seq = -(-context_len // block_size) * block_bytes + state_bytes
    return pool_bytes // per_seq if per_seq else 0


def state_rows(max_num_seqs: int, checkpoints: int | None, bytes_per_row: int, budget: int) -> tuple[int, int]:
    """(slots, checkpoint rows) of a hybrid's state pools within `budget` bytes, a row of either pool
    `bytes_per_row`: max_num_seqs slots where they fit, else as many as fit (a running sequence needs
    its slot, so fewer slots run fewer sequences at once). checkpoints None: a quarter of the slots, at
    least 1; 0: none (no prefix caching). (0, 0) when not even one slot and its rows fit."""
    def rows(slots: int) -> int:
        return max(1, slots // 4) if checkpoints is None else checkpoints

    slots = min(max_num_seqs, budget // max(bytes_per_row, 1))
    while slots > 0 and (slots + rows(slots)) * bytes_per_row > budget:
        slots -= 1
    return (slots, rows(slots)) if slots else (0, 0)
