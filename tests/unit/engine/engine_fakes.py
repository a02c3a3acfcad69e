"""Deterministic stand-ins for the model runner and sampler (no model), and scheduler drivers.

PagedFakeRunner really pages: it writes each computed token id into a KV slot array through
the sequence's block table and derives the next token from what it reads back through the
table. A wrong block table, a prefix block reused with the wrong tokens, or a recompute that
skips a token changes the output, so "same output as an unconstrained pool" is a real check.
"""
from __future__ import annotations

import torch

from consort_engine.block_manager import BlockManager
from consort_engine.config import EngineConfig
from consort_engine.scheduler import Scheduler
from consort_engine.sequence import ScheduledBatch, SamplingParams, Sequence


class PagedFakeRunner:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, vocab: int = 101,
                 max_model_len: int = 512, eos_token_ids: set[int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab = vocab
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids or set()
        self.kv = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        gen = torch.Generator().manual_seed(1234)
        self.weights = torch.randint(1, 1 << 20, (max_model_len,), generator=gen)
        self.warmed = False
        self.batches: list[ScheduledBatch] = []

    def warmup(self) -> None:
        self.warmed = True

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.batches.append(batch)
        rows = []
        for seq, n, sample in zip(batch.seqs, batch.num_new_tokens, batch.sample):
            start = seq.num_computed_tokens
            assert start + n <= seq.num_tokens
            self.kv[self._slots(seq, start, start + n)] = torch.tensor(seq.token_ids[start:start + n])
            if sample:
                ctx = self.kv[self._slots(seq, 0, start + n)]
                assert bool((ctx >= 0).all()), "read a KV slot that was never written"
                h = int(((ctx + 1) * self.weights[: start + n]).sum()) % self.vocab
                row = torch.full((self.vocab,), -1.0)
                row[h] = 1.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)


class GreedySampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        token_ids = logits.argmax(-1).tolist()
        logprobs = None
        if any(s.sampling.logprobs is not None for s in seqs):
            lp = torch.log_softmax(logits, -1)
            logprobs = [{"token": t, "logprob": float(lp[i, t])} for i, t in enumerate(token_ids)]
        return token_ids, logprobs


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **cfg) -> Scheduler:
    config = EngineConfig(model="none", block_size=block_size, num_blocks=num_blocks, **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size, namespace="test"))


def make_seq(n_prompt: int, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0,
             adapter: str | None = None, first: int = 1, **sp) -> Sequence:
    return Sequence(list(range(first, first + n_prompt)),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sp),
                    priority=priority, arrival=arrival, adapter=adapter)


def synthetic_step(sched: Scheduler, token: int = 7):
    """One scheduler step with synthetic model output: every sampled row gets `token`."""
    batch = sched.schedule()
    outs = sched.postprocess(batch, [token] * sum(batch.sample))
    return batch, outs
