"""What a decode step costs, and what each draft token adds to it: measured on the engine's own runner
at warm-up (scratch batches, before any request owns a block), read by the draft planner (draft_plan.py).
"""
from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable

import torch

from consort_engine.model.scratch_batches import decode_batch, mtp_rows, scratch_decodes, verify_batch

log = logging.getLogger("consort.engine")

PROFILE_MAX_SEQS = 64     # beyond it a step's cost grows linearly (StepCost extrapolates)


@dataclass(frozen=True)
class StepCost:
    """Measured seconds of a decode step at `seqs[i]` sequences (decode_s) and what each draft token
    adds to it (draft_s: its verify row, plus its MTP pass). Linear between the measured points;
    beyond the last, decode time grows by the last segment's slope and a draft costs the last's."""
    seqs: tuple[int, ...]
    decode_s: tuple[float, ...]
    draft_s: tuple[float, ...]

    def at(self, n: int) -> tuple[float, float]:
        """(decode seconds, seconds per draft token) at n decodes."""
        xs, ds, cs = self.seqs, self.decode_s, self.draft_s
        if n <= xs[0]:
            return ds[0], cs[0]
        if n >= xs[-1]:
            slope = (ds[-1] - ds[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ds[-1] / xs[-1]
            return ds[-1] + slope * (n - xs[-1]), cs[-1]
        i = bisect_left(xs, n)             # xs[i - 1] < n <= xs[i]
        t = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ds[i - 1] + t * (ds[i] - ds[i - 1]), cs[i - 1] + t * (cs[i] - cs[i - 1])


def _seconds(runner: Any, fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        best = min(best, time.perf_counter() - t)
    return best


def profile_step_cost(runner: Any, k: int, repeats: int = 2) -> StepCost:
    """Time decode steps and verify steps of k drafts each at 1, 2, 4, ... sequences (up to the seats,
    the token budget and PROFILE_MAX_SEQS): what a step costs and what each draft adds to it (with an
    MTP block, its passes too). The fastest of `repeats` runs of each."""
    config = runner.config
    top = max(1, min(config.max_num_seqs, PROFILE_MAX_SEQS, config.max_num_batched_tokens // (1 + k)))
    ctx = max(k + 1, min(256, runner.max_model_len - k - 2))
    sizes = sorted({min(2 ** i, top) for i in range(top.bit_length() + 1)})
    t0 = time.perf_counter()
    decode_s, draft_s = [], []
    for n in sizes:
        seqs = scratch_decodes(runner, n, ctx, slots=ctx + k + 1)
        decode = _seconds(runner, lambda: runner.execute(decode_batch(seqs, ctx)), repeats)
        verify = _seconds(runner, lambda: runner.execute(verify_batch(seqs, ctx, k)), repeats)
        per_draft = (verify - decode) / (n * k)
        if runner.has_mtp:
            runner.execute(decode_batch(seqs, ctx))
            passes = [_seconds(runner, lambda d=d: runner.mtp_draft(mtp_rows(runner, seqs, ctx, d)), repeats)
                      for d in (0, k)]
            per_draft += (passes[1] - passes[0]) / (n * k)
        decode_s.append(decode)
        draft_s.append(per_draft)
    cost = StepCost(tuple(sizes), tuple(decode_s), tuple(draft_s))
    log.info("speculation: step cost profiled in %.1f s (sequences: decode ms, +ms per draft): %s",
             time.perf_counter() - t0,
             ", ".join(f"{n}: {d * 1e3:.2f}, +{c * 1e3:.3f}" for n, d, c in zip(sizes, decode_s, draft_s)))
    return cost
