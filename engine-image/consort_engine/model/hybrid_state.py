"""The device side of a hybrid (attention + Mamba2) model's recurrent state: the slot pools, the
checkpoint pools of prefix caching, and the copies between them and host memory.

- slots `[max_num_seqs, mixers, ...]`: one row per running sequence (kv/state_pool.py);
- checkpoints `[rows, mixers, ...]`: the state at a cached block's last token, written by the mixers
  while a prefill chunk scans past it and read back into a slot on a prefix hit (the block manager
  decides which row belongs to which block).
"""
from __future__ import annotations

import torch

from consort_engine.kv.state_pool import StateMetadata, SwappedState, VerifyWindows, build_state_metadata
from consort_engine.model.step_inputs import RowGroup


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t: pinned memory filled without blocking on CUDA, a plain copy on the CPU."""
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def state_bytes_per_seq(mixers: list, dtype: torch.dtype) -> int:
    """A sequence's state over all the mixers: the conv state in `dtype`, the SSM state in float32."""
    (cd, ck), (sh, sp, sn) = mixers[0].state_shapes()
    return len(mixers) * (cd * ck * dtype.itemsize + sh * sp * sn * 4)


class HybridState:
    def __init__(self, mixers: list, slots: int, checkpoints: int, dtype: torch.dtype, device: torch.device):
        (cd, ck), (sh, sp, sn) = mixers[0].state_shapes()
        n = len(mixers)
        self.device = device
        self.conv = torch.zeros(slots, n, cd, ck, dtype=dtype, device=device)
        self.ssm = torch.zeros(slots, n, sh, sp, sn, dtype=torch.float32, device=device)
        self.ckpt_conv = torch.zeros(checkpoints, n, cd, ck, dtype=dtype, device=device)
        self.ckpt_ssm = torch.zeros(checkpoints, n, sh, sp, sn, dtype=torch.float32, device=device)
        self.bytes_per_seq = state_bytes_per_seq(mixers, dtype)
        self.mixers = mixers
        self.windows: VerifyWindows | None = None    # the last step's verify windows

    @property
    def num_checkpoints(self) -> int:
        return self.ckpt_conv.shape[0]

    @property
    def checkpoint_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The checkpoint rows' pools, conv then SSM: a row's bytes go to the KV tier with its block."""
        return self.ckpt_conv, self.ckpt_ssm

    def metadata(self, groups: list[RowGroup], item_rows: list[tuple[int, int]]) -> StateMetadata:
        """The mixers' view of a step; a sequence's first chunk starts from zero state (a fresh slot, or a
        preempted sequence recomputing from its first token). A chunk that starts later continues from
        its slot: the previous chunk's state, a swapped-in one or a restored checkpoint."""
        fresh = [g.state_slot for g in groups if g.start == 0]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.int64, device=self.device)
            self.conv[idx] = 0
            self.ssm[idx] = 0
        meta = build_state_metadata(self.conv, self.ssm, item_rows, [g.state_slot for g in groups],
                                    [g.num_sampled > 1 for g in groups], [g.checkpoints for g in groups],
                                    (self.ckpt_conv, self.ckpt_ssm))
        self.windows = meta.windows
        return meta

    def commit_windows(self, kept: dict[int, int]) -> None:
        """kept: slot -> tokens of its verify window whose state stands. The verify step left the slots as
        they were before the windows: every mixer now steps each window's kept tokens into its slot."""
        win, self.windows = self.windows, None
        runs = win.kept_runs(kept) if win is not None else None
        if runs is None:
            return
        if win.commit is not None:          # the verify step's one C call kept the inputs: one call steps them all
            win.commit(runs)
            return
        for m in self.mixers:
            m.step_again(win.inputs[m.index], runs, self.conv[:, m.index], self.ssm[:, m.index])

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(slot, checkpoint row): a prefix hit's sequence continues from the state saved at its last cached block."""
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        rows = torch.tensor([r for _, r in pairs], dtype=torch.int64, device=self.device)
        self.conv[slots] = self.ckpt_conv[rows]
        self.ssm[slots] = self.ckpt_ssm[rows]

    def swap_out(self, sw: SwappedState, kv_cache: torch.Tensor) -> None:
        blocks = torch.tensor(sw.src_blocks, dtype=torch.int64, device=self.device)
        sw.kv = to_host(kv_cache[:, :, blocks])     # block dim 2 in both pool layouts
        sw.conv = to_host(self.conv[sw.src_slot])
        sw.ssm = to_host(self.ssm[sw.src_slot])

    def swap_in(self, sw: SwappedState, kv_cache: torch.Tensor, block_table: list[int], slot: int) -> None:
        assert sw.copied, "swap_in before swap_out"
        blocks = torch.tensor(block_table[:len(sw.src_blocks)], dtype=torch.int64, device=self.device)
        kv_cache[:, :, blocks] = sw.kv.to(self.device, non_blocking=True)
        self.conv[slot] = sw.conv.to(self.device, non_blocking=True)
        self.ssm[slot] = sw.ssm.to(self.device, non_blocking=True)
