"""CUDA graphs for pure-decode steps: one graph per batch-size bucket, replayed over static buffers.

A decode step launches a few kernels per layer on tiny tensors, so on a GPU the host's launch time
dominates it; a captured graph replays the whole forward with one launch. A graph freezes its
shapes, tensor addresses and Python-side values, so:
- batch sizes are bucketed (vLLM's: 1, 2, 4, 8, then multiples of 8 up to min(max_num_seqs, 512),
  plus that cap itself): a step of n sequences runs the smallest bucket >= n;
- inputs live in static device buffers (views of one int64 and one int32 flat tensor, so a step's
  inputs arrive in two non-blocking copies from pinned host memory, see host_staging.py); the
  output (last hidden states, before the final norm) is the graph's own tensor;
- the bucket - n padding rows write their K/V to the runner's scratch block (one block past the
  block manager's range, never handed out) and attend to that one slot (context 1: no empty softmax);
- AttentionMetadata's Python ints are fixed at capture (max_context_len = max_model_len,
  max_query_len 1): every backend used here reads the true lengths from context_lens / block_tables
  (Triton, the CPU kernel, the torch gather; flash through flash_attn_with_kvcache, `single_query`).

Only steps where every sequence has exactly one new token and one sampled row, without LoRA, prompt
logprobs, hybrid state or tensor parallelism, replay a graph; everything else runs eagerly as before.

`DecodeGraphs(runner, capture=False)` runs the very same path eagerly: inputs staged in host buffers
with the bucket's layout, copied into the static buffers, and then the forward over them instead of a
replay. That is how the CPU tests prove the staging, padding and scratch-block logic that the captured
graphs replay; only the capture and the replay call themselves need CUDA.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from consort_engine.model.attention import AttentionMetadata
from consort_engine.model.host_staging import PinnedStaging, packed_layout, unpack

if TYPE_CHECKING:   # pragma: no cover
    from consort_engine.model.model_runner import ModelRunner
    from consort_engine.model.step_inputs import StepInputs
    from consort_engine.kv.sequence import ScheduledBatch

log = logging.getLogger("consort.engine")

MAX_GRAPH_BATCH = 512       # vLLM's largest capture size: beyond it the launch overhead is amortised anyway
GRAPH_BACKENDS = ("flash", "triton")   # read the pool in place; the torch gather would copy max_model_len per row


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, 512), plus that cap itself
    (so the largest batch the scheduler can form always has a graph)."""
    cap = max(1, min(max_num_seqs, MAX_GRAPH_BATCH))
    sizes = [b for b in (1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)) if b <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows (buckets ascending); None when n exceeds them all."""
    for b in buckets:
        if b >= n:
            return b
    return None


def use_decode_graphs(device_type: str, enforce_eager: bool, backend: str, tp_size: int, hybrid: bool) -> bool:
    """Whether a runner captures decode graphs at warm-up (CPU never does)."""
    return (device_type == "cuda" and not enforce_eager and backend in GRAPH_BACKENDS and tp_size == 1
            and not hybrid)


def decode_graph_eligible(new_tokens: list[int], rows_sampled: list[int], *, lora: bool, prompt_logprobs: bool,
                          hybrid: bool, tp_size: int, max_bucket: int) -> bool:
    """A step a decode graph can replay: 1..max_bucket sequences, each one new token and one sampled
    row, no LoRA rows, no prompt logprobs, no hybrid state, one rank."""
    return (0 < len(new_tokens) <= max_bucket and not (lora or prompt_logprobs or hybrid) and tp_size == 1
            and all(n == 1 for n in new_tokens) and all(k == 1 for k in rows_sampled))


@dataclass
class DecodeBuffers:
    """A bucket's decode inputs: views of one int64 and one int32 flat tensor (device, or pinned host
    staging laid out identically so that one copy per dtype fills the device side)."""
    input_ids: torch.Tensor        # [bucket] int64
    positions: torch.Tensor        # [bucket] int64
    slot_mapping: torch.Tensor     # [bucket] int64
    context_lens: torch.Tensor     # [bucket] int32
    cu_query_lens: torch.Tensor    # [bucket + 1] int32
    block_tables: torch.Tensor     # [bucket, max_blocks] int32

    @staticmethod
    def shapes(bucket: int, max_blocks: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        return [(bucket,)] * 3, [(bucket,), (bucket + 1,), (bucket, max_blocks)]

    @staticmethod
    def sizes(bucket: int, max_blocks: int) -> tuple[int, int]:
        """Elements of the int64 and int32 flat prefixes this bucket uses."""
        s64, s32 = DecodeBuffers.shapes(bucket, max_blocks)
        return packed_layout(s64)[1], packed_layout(s32)[1]

    @classmethod
    def views(cls, flat64: torch.Tensor, flat32: torch.Tensor, bucket: int, max_blocks: int) -> DecodeBuffers:
        s64, s32 = cls.shapes(bucket, max_blocks)
        return cls(*unpack(flat64, s64), *unpack(flat32, s32))


def fill_decode_buffers(dst: DecodeBuffers, inp: StepInputs, scratch_block: int, block_size: int) -> None:
    """A pure-decode step's host inputs (ModelRunner.build_inputs) into a bucket's buffers: the n real
    rows as they are, the pad rows as a one-token sequence in the scratch block (slot 0 of it,
    context 1, every table entry the scratch block). Block-table columns past a row's blocks are never read."""
    meta = inp.meta
    n, w = inp.input_ids.numel(), meta.block_tables.shape[1]
    assert n <= dst.input_ids.numel() and w <= dst.block_tables.shape[1], (n, w)
    dst.input_ids[:n].copy_(inp.input_ids)
    dst.positions[:n].copy_(inp.positions)
    dst.slot_mapping[:n].copy_(meta.slot_mapping)
    dst.context_lens[:n].copy_(meta.context_lens)
    dst.block_tables[:n, :w].copy_(meta.block_tables)
    dst.block_tables[:n, w:].fill_(scratch_block)
    pad_rows(dst, n, scratch_block, block_size)


def pad_rows(dst: DecodeBuffers, n: int, scratch_block: int, block_size: int) -> None:
    """Rows n.. of a bucket: token 0 at position 0 of a one-token sequence living in the scratch block."""
    dst.input_ids[n:].zero_()
    dst.positions[n:].zero_()
    dst.slot_mapping[n:].fill_(scratch_block * block_size)
    dst.context_lens[n:].fill_(1)
    dst.block_tables[n:].fill_(scratch_block)
    torch.arange(dst.input_ids.numel() + 1, out=dst.cu_query_lens)   # one query row per sequence, pad rows too


class DecodeGraphs:
    """Static decode buffers for every bucket and, with capture=True (CUDA), one graph per bucket."""

    def __init__(self, runner: ModelRunner, capture: bool):
        self.runner = runner
        self.capture = capture
        self.buckets = capture_sizes(runner.config.max_num_seqs)
        self.max_blocks = math.ceil(runner.max_model_len / runner.block_size)
        self.scratch_block = runner.scratch_block
        n64, n32 = DecodeBuffers.sizes(self.buckets[-1], self.max_blocks)
        dev = runner.device
        # every bucket's buffers are a prefix of these (its layout is packed_layout of its own shapes)
        self.flat64 = torch.zeros(n64, dtype=torch.int64, device=dev)
        self.flat32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        # the runner's pinned buffers on CUDA; plain host ones for the eager CPU mode (the same code path)
        self.staging = runner.staging or PinnedStaging(dev)
        self.buffers = {b: DecodeBuffers.views(self.flat64, self.flat32, b, self.max_blocks) for b in self.buckets}
        self.meta = {b: self._metadata(self.buffers[b]) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_runs = 0          # steps that went through the static buffers (replays on CUDA)

    def _metadata(self, buf: DecodeBuffers) -> AttentionMetadata:
        """The bucket's attention metadata over its static buffers; the ints are bounds, not lengths."""
        b = buf.input_ids.numel()
        return AttentionMetadata(slot_mapping=buf.slot_mapping, num_batched_tokens=b, block_tables=buf.block_tables,
                                 context_lens=buf.context_lens, cu_query_lens=buf.cu_query_lens,
                                 max_context_len=self.runner.max_model_len, max_query_len=1, max_query_len_all=1,
                                 single_query=True)

    def can_run(self, batch: ScheduledBatch) -> bool:
        r = self.runner
        return decode_graph_eligible(batch.num_new_tokens, [batch.rows_sampled(i) for i in range(len(batch.seqs))],
                                     lora=any(s.adapter for s in batch.seqs),
                                     prompt_logprobs=any(s.needs_prompt_logprobs for s in batch.seqs),
                                     hybrid=r.is_hybrid, tp_size=r.tp.size, max_bucket=self.buckets[-1])

    def _forward(self, b: int) -> torch.Tensor:
        """The model over bucket b's static buffers (what a graph captures; eager when capture=False)."""
        buf = self.buffers[b]
        return self.runner.model(buf.input_ids, buf.positions, self.meta[b])

    def run(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states [n, hidden] of a pure-decode step (host inputs from build_inputs(on_host=True)),
        computed over its bucket's padded buffers. On CUDA the rows are a view of the graph's output:
        read them before the next replay."""
        n = inp.input_ids.numel()
        b = bucket_for(n, self.buckets)
        self.num_runs += 1
        # staged in host memory with the bucket's layout, then one copy per dtype into the static prefix
        n64, n32 = DecodeBuffers.sizes(b, self.max_blocks)
        h64, h32 = self.staging.host(torch.int64, n64), self.staging.host(torch.int32, n32)
        fill_decode_buffers(DecodeBuffers.views(h64, h32, b, self.max_blocks), inp, self.scratch_block,
                            self.runner.block_size)
        self.staging.upload(h64, self.flat64[:n64])
        self.staging.upload(h32, self.flat32[:n32])
        if not self.capture:
            return self._forward(b)[:n]
        self.graphs[b].replay()       # pragma: no cover - CUDA only
        return self.outputs[b][:n]

    @torch.inference_mode()
    def capture_all(self) -> None:  # pragma: no cover - CUDA only
        """One graph per bucket, largest first, all in one memory pool (a smaller graph's activations
        fit in what the larger ones reserved). Each bucket runs once eagerly first over an all-pad
        step (Triton compiles its specialisation, cuBLAS picks its kernels), then is captured."""
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        order = self.buckets[::-1]
        # warm-up and capture on one side stream (torch's recipe): cuBLAS / cuBLASLt set up their
        # workspace per stream, so a warm-up on another stream than the capture's leaves that set-up
        # to the capture itself
        side, main = torch.cuda.Stream(self.runner.device), torch.cuda.current_stream(self.runner.device)
        log.info("capturing %d decode CUDA graphs (batch sizes %d..%d)", len(order), order[-1], order[0])
        for i, b in enumerate(order):
            # every row a pad row: the warm-up and the capture write K/V into the scratch block only
            pad_rows(self.buffers[b], 0, self.scratch_block, self.runner.block_size)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._forward(b)
            side.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
            if (i + 1) % 16 == 0:
                log.info("decode CUDA graphs: %d/%d captured (%.1f s)", i + 1, len(order), time.monotonic() - t0)
        main.wait_stream(side)
        torch.cuda.synchronize(self.runner.device)
        log.info("captured %d decode CUDA graphs in %.2f s", len(self.graphs), time.monotonic() - t0)
