"""Deterministic stand-ins for the model runner and sampler (no model), and scheduler drivers.

PagedFakeRunner really pages: it writes each computed token id into a KV slot array through
the sequence's block table and derives the next token from what it reads back through the
table. A wrong block table, a prefix block reused with the wrong tokens, or a recompute that
skips a token changes the output, so "same output as an unconstrained pool" is a real check.
"""
from __future__ import annotations

import torch

from consort_engine.kv.block_manager import BlockManager
from consort_engine.config import EngineConfig
from consort_engine.core.scheduler import Scheduler
from consort_engine.kv.sequence import ScheduledBatch, SamplingParams, Sequence


class PagedFakeRunner:
    P = (1 << 31) - 1

    def __init__(self, num_blocks: int = 64, block_size: int = 4, vocab: int = 101,
                 max_model_len: int = 512, eos_token_ids: set[int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab = vocab
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids or set()
        # One "KV" value per slot; -1 = never written.
        self.kv = [-1] * (num_blocks * block_size)
        self.warmed = False
        self.batches: list[ScheduledBatch] = []
        self.rows_per_step: list[int] = []

    def warmup(self) -> None:
        self.warmed = True

    def zero_slots(self, slots: list[int]) -> None:
        """Rejected draft K/V: forgotten, so reading it later fails loudly."""
        for slot in slots:
            self.kv[slot] = -1

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """K/V at a position = f(K/V at the previous position, token): causal, like attention.
        The previous position is read back through the block table, so any paging mistake
        (wrong table, wrong reused block, skipped recompute) changes every later token."""
        self.batches.append(batch)
        rows = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            assert n > 0 and start + n <= seq.num_tokens
            prev = self.kv[self._slot(seq, start - 1)] if start else 0
            assert prev >= 0, "read a KV slot that was never written"
            states = []
            for pos in range(start, start + n):
                prev = (prev * 1_000_003 + seq.token_ids[pos] * 7919 + pos + 1) % self.P
                self.kv[self._slot(seq, pos)] = prev
                states.append(prev)
            for state in states[n - batch.rows_sampled(i):]:   # the last row, or a whole verify window
                row = torch.full((self.vocab,), -1.0)
                row[state % self.vocab] = 1.0
                rows.append(row)
        self.rows_per_step.append(len(rows))
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)


class GreedySampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        token_ids = logits.argmax(-1).tolist()
        logprobs = None
        if any(s.sampling.logprobs is not None for s in seqs):
            lp = torch.log_softmax(logits, -1)
            logprobs = [{"token": t, "logprob": float(lp[i, t])} for i, t in enumerate(token_ids)]
        return token_ids, logprobs


def make_scheduler(num_blocks: int = 64, block_size: int = 4, swap: bool = False, **cfg) -> Scheduler:
    """swap: as for a hybrid model (state slots, no prefix cache, swap preemption; a state slot
    weighs as much as 4 KV blocks)."""
    config = EngineConfig(model="none", block_size=block_size, num_blocks=num_blocks, **cfg)
    bm = BlockManager(num_blocks, block_size, namespace="test", enable_caching=not swap,
                      state_slots=config.max_num_seqs if swap else 0)
    return Scheduler(config, bm, swap_bytes=(256, 1024) if swap else None)


def swapped_in(batch) -> None:
    """What the engine does after schedule() for swap preemption, minus the copies."""
    for s in batch.seqs:
        s.swapped = None


def make_seq(n_prompt: int, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0,
             adapter: str | None = None, first: int = 1, **sp) -> Sequence:
    return Sequence(list(range(first, first + n_prompt)),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sp),
                    priority=priority, arrival=arrival, adapter=adapter)


def synthetic_step(sched: Scheduler, token: int = 7):
    """One scheduler step with synthetic model output: every sampled row gets `token`."""
    batch = sched.schedule()
    swapped_in(batch)
    outs = sched.postprocess(batch, [token] * sum(batch.rows_sampled(i) for i in range(len(batch))))
    return batch, outs
