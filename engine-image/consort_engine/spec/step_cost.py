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

# Beyond these a step's cost grows linearly (StepCost extrapolates): a CPU step is bound by arithmetic
# from a few tens of sequences; a GPU's from a few hundred, and its profile steps take milliseconds.
PROFILE_MAX_SEQS = {"cpu": 64, "cuda": 256}


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


def _seconds(runner: Any, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t


def profile_step_cost(runner: Any, k: int, rounds: int = 3) -> StepCost:
    """Time decode steps and verify steps of k drafts each at 1, 2, 4, ... sequences (up to the seats,
    the token budget and PROFILE_MAX_SEQS): what a step costs and what each draft adds to it (with an
    MTP block, its passes too). Every size once a round, the fastest of `rounds` rounds: a shape's
    first run (kernel selection, allocation) and a neighbour's burst do not count."""
    config = runner.config
    most = PROFILE_MAX_SEQS.get(runner.device.type, PROFILE_MAX_SEQS["cpu"])
    top = max(1, min(config.max_num_seqs, most, config.max_num_batched_tokens // (1 + k)))
    ctx = max(k + 1, min(256, runner.max_model_len - k - 2))
    sizes = sorted({min(2 ** i, top) for i in range(top.bit_length() + 1)})
    batches = {n: scratch_decodes(runner, n, ctx, slots=ctx + k + 1) for n in sizes}
    arms = ("decode", "verify", "mtp0", "mtpk") if runner.has_mtp else ("decode", "verify")
    best = {(n, arm): float("inf") for n in sizes for arm in arms}
    t0 = time.perf_counter()
    for _ in range(rounds):
        for n, seqs in batches.items():
            runs = {"decode": lambda: runner.execute(decode_batch(seqs, ctx)),
                    "verify": lambda: runner.execute(verify_batch(seqs, ctx, k))}
            for arm, fn in runs.items():
                best[n, arm] = min(best[n, arm], _seconds(runner, fn))
            if runner.has_mtp:           # the MTP pass after a decode (its hidden rows), without and with drafts
                for arm, d in (("mtp0", 0), ("mtpk", k)):
                    runner.execute(decode_batch(seqs, ctx))
                    rows = mtp_rows(runner, seqs, ctx, d)
                    best[n, arm] = min(best[n, arm], _seconds(runner, lambda: runner.mtp_draft(rows)))
    decode_s = [best[n, "decode"] for n in sizes]
    draft_s = [(best[n, "verify"] - best[n, "decode"]
                + (best[n, "mtpk"] - best[n, "mtp0"] if runner.has_mtp else 0.0)) / (n * k) for n in sizes]
    log.info("speculation: step cost profiled in %.1f s (sequences: decode ms, +ms per draft): %s",
             time.perf_counter() - t0,
             ", ".join(f"{n}: {d * 1e3:.2f}, +{c * 1e3:.3f}" for n, d, c in zip(sizes, decode_s, draft_s)))
    return StepCost(tuple(sizes), tuple(decode_s), tuple(draft_s))
