"""Scratch decode batches: the runner's warm-up shapes and the speculation step-cost profile
(spec/step_cost.py).

Both run before any request owns a block: the K/V they write lands in blocks whose owners write them
before anything reads them, and in hybrid state rows a request's first chunk zeroes.
"""
from __future__ import annotations

import math
from typing import Any

from consort_engine.kv.sequence import ScheduledBatch, Sequence
from consort_engine.model.step_inputs import MTPRows


def scratch_decodes(runner: Any, n: int, ctx: int, slots: int = 0) -> list[Sequence]:
    """n sequences of ctx computed tokens, each one token to decode, with block tables covering
    max(slots, ctx + 1) positions (wrapping around the pool)."""
    bs = runner.block_size
    per = math.ceil(max(slots, ctx + 1) / bs)
    seqs = []
    for j in range(n):
        s = Sequence(prompt_token_ids=[(j + i) % runner.vocab_size for i in range(ctx + 1)])
        s.num_computed_tokens = ctx
        s.state_slot = j
        s.block_table = [(j * per + b) % runner.num_blocks for b in range(per)]
        seqs.append(s)
    return seqs


def decode_batch(seqs: list[Sequence], ctx: int) -> ScheduledBatch:
    """Every sequence's next token at position ctx."""
    for s in seqs:
        s.num_computed_tokens = ctx
    return ScheduledBatch(seqs, [1] * len(seqs), [True] * len(seqs), mode="decode")


def verify_batch(seqs: list[Sequence], ctx: int, k: int) -> ScheduledBatch:
    """Every sequence's verify window of 1 + k rows ending at position ctx, every row sampled."""
    for s in seqs:
        s.num_computed_tokens = ctx - k
    n = len(seqs)
    return ScheduledBatch(seqs, [1 + k] * n, [True] * n, mode="spec_verify", num_draft=[k] * n)


def mtp_rows(runner: Any, seqs: list[Sequence], ctx: int, k: int) -> list[MTPRows]:
    """The MTP pass over each sequence's last decoded row (the runner's last step), k drafts after it."""
    return [MTPRows(s.token_ids[ctx:ctx + 1], runner.last_hidden[a:b], ctx - 1, s.block_table, k)
            for s, (a, b) in zip(seqs, runner.last_item_rows)]
