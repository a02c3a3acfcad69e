"""ModelRunner: loads the checkpoint, owns the KV pool, turns a ScheduledBatch into logits.

The pool is sized once at start-up (config.num_blocks, or free memory after the weights minus an
activation reserve, times kv_memory_fraction) and never grows. `execute` reads the sequences and
their block tables (allocated by the block manager) and never mutates them.

dtype (config.dtype) is the weights' and the KV cache's unless --kv-cache-dtype narrows the pool (kv_dtype);
compute_dtype is the activations' (they differ only for bf16 on some CPUs, see compute_dtype()). On CPU the
attention, K/V store and element-wise layers run as C kernels (cpu_kernels.py) and the GEMM weights are pre-packed.
On CUDA a step's inputs reach the device through pinned staging buffers (host_staging.py) and pure
decode steps replay CUDA graphs captured at warm-up (cuda_graphs.py).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import time
from itertools import accumulate

import torch

from consort_engine.model.attention import (AttentionMetadata, PrefillSpan, choose_backend, flash_refusal,
                                            kv_cache_dtype, pool_shape)
from consort_engine.config import EngineConfig
from consort_engine.model.cuda_graphs import DecodeGraphs, use_decode_graphs
from consort_engine.model.host_staging import PinnedStaging
from consort_engine.model.loader import checkpoint_names, eos_token_ids, load_model_config, resolve_dtype
from consort_engine.model.models import MODELS
from consort_engine.model.pool_memory import MiB, activation_reserve, kv_bytes_per_token, mem_available
from consort_engine.model.models.layers import Linear
from consort_engine.model.models.mtp import has_mtp
from consort_engine.model.lora import AdapterError, LoraAdapter, LoraContext, load_peft_adapter, segments_of
from consort_engine.model.models.packed import has_bf16_dot
from consort_engine.model.sampler import greedy_tokens
from consort_engine.model.quantized_checkpoint import checkpoint_format, checkpoint_weights, resolve_quantization
from consort_engine.model.models.quant import check_quantization
from consort_engine.kv.sequence import PromptLogprobs, ScheduledBatch, Sequence
from consort_engine.kv.state_pool import SwappedState, seqs_per_pool, state_rows
from consort_engine.model.hybrid_state import HybridState, state_bytes_per_seq
from consort_engine.model.step_inputs import MTPRows, RowGroup, StepInputs, host_ints
from consort_engine.model.scratch_batches import decode_batch, mtp_rows, scratch_decodes, verify_batch
from consort_engine.model.tensor_parallel import SINGLE, TPGroup, TPWorkers

MAX_KERNEL_QUERY = 16     # sequences with at most this many new tokens join the batched (kernel) group
PROMPT_LOGITS_ELEMENTS = 1 << 25   # full-vocab fp32 logit rows per slice for prompt logprobs (128 MiB)

log = logging.getLogger("consort.engine")


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """bfloat16 on a CPU computes in float32 (weights rounded to bf16 and a bf16 KV cache, but fp32
    activations and GEMMs) where bf16 GEMMs do not pay: without a bf16 dot product (AMX, AVX-512
    BF16) oneDNN's bf16 GEMM runs at about half the speed of the fp32 one. The int8 and w8a8 kernels
    take bf16 rows as they are (a bf16 model with w8a8 measured 1.3x its fp32 activations on Zen 5).
    CONSORT_BF16_COMPUTE=1 forces bf16 activations."""
    if (device.type == "cpu" and dtype == torch.bfloat16 and not has_bf16_dot()
            and os.environ.get("CONSORT_BF16_COMPUTE") != "1"):
        return torch.float32
    return dtype


def tune_cpu_memory(kv_cache: torch.Tensor) -> None:
    """Page-fault avoidance on CPU (glibc/Linux; a no-op elsewhere).

    - The pool is first touched during prefill, 4 KiB page by page (a fault each, ~1/3 of prefill
      time measured); asking for transparent huge pages makes that 2 MiB a fault, still lazily.
    - Step activations (tens of MiB at 2k tokens) are above glibc's mmap threshold, so every one was
      a fresh mmap that faults in again; keeping them on the heap reuses the pages across steps."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    huge = 2 * MiB
    start = -(-kv_cache.data_ptr() // huge) * huge
    end = (kv_cache.data_ptr() + kv_cache.numel() * kv_cache.element_size()) // huge * huge
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)   # MADV_HUGEPAGE
    libc.mallopt(-3, 32 * MiB)   # M_MMAP_THRESHOLD: glibc's maximum
    libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD: keep freed activations for the next step


def check_tp_split(cfg, size: int) -> None:
    """Raises ValueError unless `size` ranks split the heads, KV heads and MLP evenly."""
    if cfg.is_hybrid:
        raise ValueError(f"tensor parallelism is not supported for {cfg.model_type} (hybrid) models yet")
    group = TPGroup(0, size)
    for n, what in ((cfg.num_attention_heads, "num_attention_heads"), (cfg.num_key_value_heads, "num_key_value_heads"),
                    (cfg.intermediate_size, "intermediate_size")):
        group.split(n, what)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        """`tp` None: the engine's runner (rank 0), which starts ranks 1..N-1 itself when
        config.tensor_parallel_size > 1 (see tensor_parallel.py); a worker rank passes its group."""
        t0 = time.monotonic()
        check_quantization(config.quantization, config.device)
        self.config = config
        self.workers: TPWorkers | None = None
        if tp is None and config.tensor_parallel_size > 1:
            if config.adapters:
                raise ValueError("LoRA adapters are not supported with tensor_parallel_size > 1 yet")
            check_tp_split(load_model_config(config.model), config.tensor_parallel_size)   # before any rank starts
            self.workers = TPWorkers(config, type(self))
            tp = self.workers.join_group(config.device)
        self.tp = tp = tp or SINGLE
        self.device = torch.device(config.device)
        self.hf_config = cfg = load_model_config(config.model)
        self.dtype = resolve_dtype(config.dtype, config.device, cfg.torch_dtype, has_bf16_dot())  # weights, KV
        prequantized = checkpoint_format(cfg.raw, config.model)         # model/quantized_checkpoint.py
        self.quantization = resolve_quantization(config.quantization, prequantized)
        self.compute_dtype = compute_dtype(self.dtype, self.device)   # activations, GEMMs
        log.info("weights in %s, activations in %s (--dtype %s; the checkpoint is %s)",
                 self.dtype, self.compute_dtype, config.dtype, cfg.torch_dtype or "of unstated dtype")
        self.eos_token_ids: set[int] = eos_token_ids(config.model, cfg)
        # MTP drafting: one rank only (the block is not split for tensor parallelism yet)
        # Hybrid (attention + Mamba2): KV only for the attention layers, a state slot per sequence for the rest.
        self.is_hybrid = cfg.is_hybrid
        self.has_mtp = (config.speculative == "mtp" and tp.size == 1
                        and has_mtp(checkpoint_names(config.model), cfg.num_hidden_layers))
        self.num_kv_layers = len(cfg.attention_layers) + self.has_mtp     # the MTP block's own KV layer last
        self.last_hidden: torch.Tensor | None = None     # normed target hidden states of the last step (MTP)
        self.last_item_rows: list[tuple[int, int]] = []
        # (batch index, the prompt logprobs this step computed for it), for sequences that ask (rank 0)
        self.last_prompt_logprobs: list[tuple[int, PromptLogprobs]] = []
        self.vocab_size = cfg.vocab_size
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window:     # no sliding-window kernel: stay where full attention is exact
            self.max_model_len = min(self.max_model_len, cfg.sliding_window)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)   # the pool's element
        log.info("KV cache in %s (--kv-cache-dtype %s)", self.kv_dtype, config.kv_cache_dtype)
        self.backend = choose_backend(self.device, self.dtype, self.block_size, self.kv_dtype)
        if self.device.type == "cuda" and self.backend != "flash":
            log.info("attention on CUDA: %s, not flash-attn (%s)", self.backend, flash_refusal(
                self.device, self.dtype, self.block_size, self.kv_dtype) or "CONSORT_ATTENTION_BACKEND")
        self.max_kernel_query = (max(1, 256 // (cfg.num_attention_heads // cfg.num_key_value_heads))
                                 if self.backend in ("cpu_kernel", "triton") else 1)
        self.max_kernel_query = min(self.max_kernel_query, MAX_KERNEL_QUERY)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.compute_dtype)
        try:
            with torch.device(self.device):
                self.model = MODELS[cfg.model_type](cfg, self.max_model_len, self.backend, self.dtype, self.device,
                                                    tp, mtp=self.has_mtp)
        finally:
            torch.set_default_dtype(default_dtype)
        # a pre-quantized checkpoint's linears keep their codes on CPU (the int8 kernel), else are dequantized
        self.model.load_weights(checkpoint_weights(config.model, prequantized, self.dtype,
                                                   keep_codes=self.device.type == "cpu"))
        self.model.eval()
        self.num_packed = 0
        if self.quantization != "none" or (self.device.type == "cpu"
                                           and os.environ.get("CONSORT_PACK_WEIGHTS", "1") != "0"):
            self.num_packed = self.model.pack_weights(self.quantization)
        if prequantized is not None and prequantized.float8:
            log.info("%s checkpoint (fp8 e4m3): its linears decoded at load, running in %s%s", prequantized.method,
                     self.compute_dtype, ", rounded to e4m3 per row again (--quantization fp8)"
                     if self.quantization == "fp8" else "")
        elif prequantized is not None:      # which linears a user's checkpoint runs on its codes (act-order, TP cuts)
            linears = [m for m in self.model.modules() if isinstance(m, Linear)]
            codes = sum(m.runs_codes for m in linears)
            log.info("%s checkpoint (%s): %d linears multiply their codes on the int8 kernel, the other %d "
                     "hold float weights (dequantized, or not quantized in the checkpoint)", prequantized.method,
                     prequantized.kind, codes, len(linears) - codes)
        self.lora_ctx = LoraContext()
        self.adapters: dict[str, LoraAdapter] = {}
        for name, path in config.adapters.items():
            self.load_adapter(name, path)

        # hybrids: state slots (one per running sequence) and, with prefix caching, checkpoint rows (hybrid_state.py)
        self.hybrid_state = self.conv_state = self.ssm_state = None
        self.state_bytes_per_seq = self.num_checkpoints = 0
        if self.is_hybrid:
            slots, rows = self._state_rows()
            if slots < config.max_num_seqs:    # the engine's scheduler runs as many sequences as there are slots
                self.config = config = dataclasses.replace(config, max_num_seqs=slots)
            self.hybrid_state = HybridState(self.model.mixers, slots, rows, self.compute_dtype, self.device)
            self.conv_state, self.ssm_state = self.hybrid_state.conv, self.hybrid_state.ssm
            self.state_bytes_per_seq = self.hybrid_state.bytes_per_seq
            self.num_checkpoints = self.hybrid_state.num_checkpoints
        self.num_blocks = self._pool_blocks()
        if tp.size > 1:   # every rank holds the same block ids: agree on the smallest pool
            n = torch.tensor([self.num_blocks])
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
            self.num_blocks = int(n.item())
        # one block past the block manager's range (num_blocks usable ones): the decode graphs' padding
        # rows write and read their K/V there, so they never touch a real sequence's blocks
        self.scratch_block = self.num_blocks
        kv_shape = (self.num_kv_layers, 2, *pool_shape(self.backend, self.num_blocks + 1, self.block_size,
                                                          self.kv_heads, cfg.head_dim))
        # The CPU kernel never reads a slot before it is written, so untouched pages stay uncommitted;
        # the gather fallbacks read whole blocks and need finite values in the unused tail.
        alloc = torch.empty if self.backend == "cpu_kernel" else torch.zeros
        self.kv_cache = alloc(kv_shape, dtype=self.kv_dtype, device=self.device)
        if self.device.type == "cpu":
            tune_cpu_memory(self.kv_cache)
        attn_modules = [layer.self_attn for layer in self.model.layers if layer.self_attn is not None]
        for i, module in enumerate(attn_modules):
            module.attn.k_cache = self.kv_cache[i, 0]
            module.attn.v_cache = self.kv_cache[i, 1]
        if self.has_mtp:
            attn = self.model.mtp.layer.self_attn.attn
            attn.k_cache, attn.v_cache = self.kv_cache[-1, 0], self.kv_cache[-1, 1]
        # CUDA: step inputs go through persistent pinned buffers; decode graphs are captured at warm-up
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.decode_graphs: DecodeGraphs | None = None
        self.load_seconds = time.monotonic() - t0

    # ------------------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """KV heads this rank holds (all of them without tensor parallelism)."""
        return self.hf_config.num_key_value_heads // self.tp.size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.hf_config, self.kv_dtype.itemsize, self.kv_heads, self.has_mtp)

    def seqs_in_pool(self, pool_bytes: int, context_len: int) -> int:
        """How many sequences of context_len tokens one pool of pool_bytes holds (KV + hybrid state)."""
        return seqs_per_pool(pool_bytes, context_len, self.block_size, self.block_bytes, self.state_bytes_per_seq)

    def _memory_budget(self) -> tuple[int, int, str]:
        """(bytes this engine's pools may use, the activation reserve they leave, where the first comes from)."""
        available = mem_available(self.device)
        where = "free device memory" if self.device.type == "cuda" else "MemAvailable capped by the cgroup memory limit"
        if self.device.type == "cpu" and self.tp.size > 1:   # the ranks share the host (and the pod's limit)
            available //= self.tp.size
            where += f", a 1/{self.tp.size} share per rank"
        m = self.model.mixers[0] if self.is_hybrid else None
        width = 2 * m.inner + m.conv_dim + m.heads if m else 0
        return available, activation_reserve(self.hf_config, self.config.max_num_batched_tokens, self.max_model_len,
                                             self.config.max_num_seqs, width), where

    def _state_rows(self) -> tuple[int, int]:
        """A hybrid's state slots and checkpoint rows (model/hybrid_state.py): max_num_seqs slots where
        the pools fit in half of what the KV pool may take (kv_memory_fraction of the memory the
        activation reserve leaves), so the attention layers' KV keeps the other half; else fewer. At
        Bamba-9B's shape a slot is ~120 MiB: the default 128 slots and 32 checkpoint rows would take ~19 GiB."""
        c = self.config
        available, reserve, where = self._memory_budget()
        budget = int(max(available - reserve, 0) * c.kv_memory_fraction) // 2
        per_row = state_bytes_per_seq(self.model.mixers, self.compute_dtype)
        slots, rows = state_rows(c.max_num_seqs, c.hybrid_checkpoints if c.enable_prefix_caching else 0,
                                 per_row, budget)
        if slots == 0:
            raise RuntimeError(f"no memory for one sequence's hybrid state (a slot of {per_row / MiB:.1f} MiB, and a "
                               f"checkpoint row as large with prefix caching): half of "
                               f"{max(available - reserve, 0) / MiB:.0f} MiB ({where}, less the activation reserve) "
                               f"is {budget / MiB:.1f} MiB; give the engine more memory")
        if slots < c.max_num_seqs:
            log.warning("hybrid state: %d slots and %d checkpoint rows of %.1f MiB fit in %.1f MiB (half of the "
                        "pools' memory; %s): at most %d sequences run at once, not max_num_seqs %d",
                        slots, rows, per_row / MiB, budget / MiB, where, slots, c.max_num_seqs)
        return slots, rows

    def _pool_blocks(self) -> int:
        available, reserve, where = self._memory_budget()
        if self.config.num_blocks:
            n = int(self.config.num_blocks)
            log.info("KV pool: %d blocks (%.0f MiB), set by --num-blocks; %.0f MiB available (%s)",
                     n, n * self.block_bytes / MiB, available / MiB, where)
            if n * self.block_bytes > available:
                log.warning("the KV pool (%.0f MiB) is larger than the memory available to this engine (%.0f MiB): "
                            "it is committed as it fills, and the engine is OOM-killed when it passes the limit",
                            n * self.block_bytes / MiB, available / MiB)
            return n
        # a hybrid's state pools are already allocated (not in `available` any more)
        free = available - reserve
        n = int(max(free, 0) * self.config.kv_memory_fraction) // max(self.block_bytes, 1)   # 0: no attention layer
        # more than every running sequence at full length can never be used
        n = min(n, self.config.max_num_seqs * math.ceil(self.max_model_len / self.block_size))
        if n < 1:
            raise RuntimeError(f"no memory left for the KV pool: {available / MiB:.0f} MiB available ({where}) "
                               f"less a {reserve / MiB:.0f} MiB activation reserve; give the engine more memory "
                               "or set the pool's size (--num-blocks, Specialist spec.kv.numBlocks)")
        log.info("KV pool: %d blocks (%.0f MiB) of %.0f MiB available (%s) less a %.0f MiB activation reserve, "
                 "kv_memory_fraction %.2f", n, n * self.block_bytes / MiB, available / MiB, where, reserve / MiB,
                 self.config.kv_memory_fraction)
        return n

    # ------------------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, on_host: bool = False) -> StepInputs:
        groups = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            s = seq.num_computed_tokens
            groups.append(RowGroup(seq.token_ids[s:s + n], s, seq.block_table, batch.rows_sampled(i), seq.adapter,
                                   seq.state_slot, batch.checkpoints.get(i, [])))
        return self.build_inputs(groups, on_host)

    def build_inputs(self, groups: list[RowGroup], on_host: bool = False, mixers: bool = True) -> StepInputs:
        """Flat step inputs for row groups: short ones in the batched (kernel) group first, then prefill spans.
        On the device's, unless on_host (the decode graphs copy them into their static buffers themselves).
        mixers: a hybrid's forward through its mixers (not the MTP block's passes, attention only)."""
        new = [len(g.tokens) for g in groups]
        bs, flash = self.block_size, self.backend == "flash"
        batched = [i for i in range(len(groups)) if flash or new[i] <= self.max_kernel_query]
        if len(batched) != len(groups):
            in_group = set(batched)
            order = batched + [i for i in range(len(groups)) if i not in in_group]
        else:
            order = batched
        nb = len(batched)

        # Built as Python lists and made tensors once each: a decode step's inputs are a few dozen numbers,
        # where each torch operation on them costs microseconds (~25 of them took 0.1 ms at one sequence).
        starts = [groups[i].start for i in order]
        lens = [new[i] for i in order]
        ctx = [s + n for s, n in zip(starts, lens)]
        cu = [0, *accumulate(lens)]
        tokens, positions, slots, tables = [], [], [], []
        for i, s, n in zip(order, starts, lens):
            table = groups[i].block_table[: (s + n + bs - 1) // bs]
            tokens += groups[i].tokens
            positions += range(s, s + n)
            p, end = s, s + n
            while p < end:          # slots a block's run at a time
                block, offset = divmod(p, bs)
                run = min(end - p, bs - offset)
                first = table[block] * bs + offset
                slots += range(first, first + run)
                p += run
            tables.append(table)
        max_blocks = max(len(t) for t in tables)
        flat: list[int] = []
        for t in tables:
            flat += t + [0] * (max_blocks - len(t))

        b = len(order)
        bt = host_ints(flat, torch.int32).view(b, max_blocks)
        meta = AttentionMetadata(slot_mapping=host_ints(slots), num_batched_tokens=cu[nb])
        if nb:
            meta.block_tables = bt[:nb] if nb < b else bt
            meta.context_lens = host_ints(ctx[:nb], torch.int32)
            meta.cu_query_lens = host_ints(cu[: nb + 1], torch.int32)
            meta.max_context_len = max(ctx[:nb])
            meta.max_query_len = max(lens[:nb])
        if flash:   # pragma: no cover - CUDA + flash-attn only
            meta.cu_context_lens = host_ints([0, *accumulate(ctx)], torch.int32)
            meta.max_query_len_all = max(lens)
        if nb < b and self.backend == "cpu_kernel":
            meta.prefill_block_tables = bt[nb:]
            meta.prefill_context_lens = host_ints(ctx[nb:], torch.int32)
            meta.prefill_cu_query_lens = host_ints([c - cu[nb] for c in cu[nb:]], torch.int32)
        for r in range(nb, b):
            span = PrefillSpan(start=cu[r], end=cu[r + 1], cached=starts[r], context_len=ctx[r])
            if starts[r] > 0:
                span.block_ids = bt[r, : (ctx[r] + bs - 1) // bs].to(torch.int64)
            meta.prefills.append(span)
        positions_t = host_ints(positions)

        row_of = {i: r for r, i in enumerate(order)}
        sample_rows: list[int] = []       # the last num_sampled rows of each group, in group order
        item_rows = [(cu[row_of[i]], cu[row_of[i] + 1]) for i in range(len(groups))]
        for i, g in enumerate(groups):
            k = g.num_sampled
            if k:
                end = item_rows[i][1]
                sample_rows.extend(range(end - k, end))
        sample_idx = host_ints(sample_rows)
        ids = host_ints(tokens)
        if self.device.type != "cpu" and not on_host:
            ids, positions_t, sample_idx = self._upload(ids, positions_t, sample_idx, meta)
        if self.is_hybrid and mixers:
            meta.state = self.hybrid_state.metadata(groups, item_rows)
        lora = segments_of([groups[i].adapter for i in order], lens) if self.adapters else []
        return StepInputs(ids, positions_t, meta, sample_idx, lora, order, item_rows)

    def _upload(self, ids: torch.Tensor, positions: torch.Tensor, sample_idx: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover
        """A step's host inputs to the device: the int64 ones in one pinned copy, the int32 ones in
        another (host_staging.py); meta's tensors are replaced by their device views."""
        spans = [p for p in meta.prefills if p.block_ids is not None]
        longs = self.staging.to_device([ids, positions, sample_idx, meta.slot_mapping] + [p.block_ids for p in spans])
        ids, positions, sample_idx, meta.slot_mapping = longs[:4]
        for p, block_ids in zip(spans, longs[4:]):
            p.block_ids = block_ids
        names = [n for n in ("block_tables", "context_lens", "cu_query_lens", "cu_context_lens")
                 if getattr(meta, n) is not None]
        for name, t in zip(names, self.staging.to_device([getattr(meta, n) for n in names])):
            setattr(meta, name, t)
        return ids, positions, sample_idx

    @torch.inference_mode()
    def commit_windows(self, kept: dict[int, int]) -> None:
        """After a verify step of a hybrid: state slot -> window tokens kept; the mixers' state becomes
        the one after the last kept token (HybridState.commit_windows)."""
        self.hybrid_state.commit_windows(kept)

    @torch.inference_mode()
    def restore_states(self, pairs: list[tuple[int, int]]) -> None:
        """Hybrid prefix hits: (state slot, checkpoint row) copied in before the step runs."""
        self.hybrid_state.restore(pairs)

    def load_adapter(self, name: str, path: str) -> LoraAdapter:
        """Read a PEFT LoRA adapter and attach it (between steps). AdapterError when it cannot be served."""
        if self.tp.size > 1:
            raise AdapterError("LoRA adapters are not supported with tensor_parallel_size > 1 yet",
                               code="adapter_unsupported")
        if name in self.adapters:
            raise AdapterError(f"adapter {name!r} is already loaded", code="adapter_exists")
        if len(self.adapters) >= self.config.max_adapters:
            raise AdapterError(f"{len(self.adapters)} adapters loaded, max_adapters is {self.config.max_adapters}",
                               code="max_adapters")
        adapter = load_peft_adapter(name, path, self.model.shard_shapes(), self.device)
        self.model.attach_adapter(adapter, self.lora_ctx)
        self.adapters[name] = adapter
        return adapter

    def unload_adapter(self, name: str) -> None:
        self.model.detach_adapter(name)
        del self.adapters[name]

    @torch.inference_mode()
    def swap_out(self, sw: SwappedState) -> None:
        """Copy a preempted hybrid sequence's computed KV blocks and its state slot to host memory
        (pinned on CUDA, so the copy is asynchronous and ordered before the step that reuses them)."""
        self.hybrid_state.swap_out(sw, self.kv_cache)

    @torch.inference_mode()
    def swap_in(self, sw: SwappedState, block_table: list[int], slot: int) -> None:
        """Put a swapped sequence's KV into the first blocks of its new table and its state into its new slot."""
        self.hybrid_state.swap_in(sw, self.kv_cache, block_table, slot)

    @torch.inference_mode()
    def zero_slots(self, slots: list[int]) -> None:
        """Zero K and V of these pool slots in every layer (rejected draft tokens' tail)."""
        if self.workers:
            self.workers.call("zero_slots", slots)
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        blocks, offsets = idx // self.block_size, idx % self.block_size
        pool = self.kv_cache.view(torch.uint8)   # zero bytes are 0.0 in every element (float8 has no index_put)
        if self.backend == "cpu_kernel":       # [layers, 2, blocks, kv_heads, block_size, D]
            pool[:, :, blocks, :, offsets, :] = 0
        else:                                   # [layers, 2, blocks, block_size, kv_heads, D]
            pool[:, :, blocks, offsets] = 0

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits [sampled rows, vocab] in batch order."""
        if not batch.seqs:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.workers:
            self.workers.call("execute", batch)   # every rank runs the same step (its collectives meet)
        graph = self.decode_graphs is not None and self.decode_graphs.can_run(batch)
        inp = self.prepare(batch, on_host=graph)
        if graph:       # h: the sampled rows already (every row of a pure decode step, in batch order)
            h = self.decode_graphs.run(inp)
        else:
            self.lora_ctx.segments = inp.lora_segments
            try:
                h = self.model(inp.input_ids, inp.positions, inp.meta)
            finally:
                self.lora_ctx.segments = []
        if self.has_mtp:     # the next step's MTP pass fuses these with the tokens that follow them
            self.last_hidden, self.last_item_rows = self.model.norm(h), inp.item_rows
        self.last_prompt_logprobs = []
        if self.tp.rank == 0 and any(s.needs_prompt_logprobs for s in batch.seqs):
            self.last_prompt_logprobs = self.prompt_logprobs(batch, inp.item_rows, h)
        if inp.sample_idx.numel() == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.model.compute_logits(h if graph else h[inp.sample_idx]).float()

    def prompt_logprobs(self, batch: ScheduledBatch, item_rows: list[tuple[int, int]],
                        h: torch.Tensor) -> list[tuple[int, PromptLogprobs]]:
        """Logprobs of the prompt tokens this step's rows predict, for the sequences that ask only.

        The row at position q predicts token q + 1, so a chunk over positions s..s+n-1 yields prompt
        tokens s+1..min(s+n, P-1) (the last prompt row is the sampled one); positions already
        collected (before a preemption) are skipped. Every asking row goes through the head in
        slices of bounded size: log_softmax, the prompt token's logprob and rank, and the top-k."""
        spans: list[tuple[int, int, int, int]] = []      # (batch index, first row, first position, rows)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if not seq.needs_prompt_logprobs:
                continue
            s = seq.num_computed_tokens
            lo, hi = max(s, len(seq.prompt_logprobs)), min(s + n, seq.num_prompt_tokens - 1)
            if hi > lo:
                spans.append((i, item_rows[i][0] + lo - s, lo, hi - lo))
        if not spans:
            return []
        dev = h.device
        rows = torch.cat([torch.arange(r, r + c) for _, r, _, c in spans]).to(dev)
        targets = torch.tensor([t for i, _, q, c in spans for t in batch.seqs[i].prompt_token_ids[q + 1:q + 1 + c]],
                               dtype=torch.int64, device=dev).view(-1, 1)
        k = min(max(batch.seqs[i].sampling.prompt_logprobs for i, *_ in spans), self.vocab_size)
        step = max(1, PROMPT_LOGITS_ELEMENTS // self.vocab_size)
        chosen, ranks, top_v, top_i = [], [], [], []
        for a in range(0, rows.numel(), step):
            lp = torch.log_softmax(self.model.compute_logits(h[rows[a:a + step]]).float(), dim=-1)
            c = lp.gather(1, targets[a:a + step])
            chosen.append(c.view(-1))
            ranks.append((lp > c).sum(dim=-1) + 1)
            v, ix = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
            top_v.append(v)
            top_i.append(ix)
        chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
        top_v_l, top_i_l = torch.cat(top_v).tolist(), torch.cat(top_i).tolist()
        out, a = [], 0
        for i, _, _, c in spans:
            kk = batch.seqs[i].sampling.prompt_logprobs
            ids, vals = top_i_l[a:a + c], top_v_l[a:a + c]
            if kk < k:       # a request asking fewer alternatives than the batch's widest
                ids, vals = [t[:kk] for t in ids], [t[:kk] for t in vals]
            out.append((i, PromptLogprobs(chosen_l[a:a + c], ranks_l[a:a + c], ids, vals)))
            a += c
        return out

    @torch.inference_mode()
    def mtp_draft(self, items: list[MTPRows]) -> list[list[int]]:
        """The block's K/V for every item's rows (its layer's input and K/V projection only), then for the
        drafting items the whole layer over their last row and max(num_draft) - 1 chained one-row steps:
        greedy draft tokens per item, item order."""
        drafts: list[list[int]] = [[] for _ in items]
        if not items:
            return drafts
        mtp, model = self.model.mtp, self.model
        inp = self.build_inputs([RowGroup(it.tokens, it.start, it.block_table, 1 if it.num_draft else 0)
                                 for it in items], mixers=False)
        hidden = torch.cat([items[i].hidden[: len(items[i].tokens)] for i in inp.order])
        x = mtp.fuse(model.embed_tokens(inp.input_ids), hidden)
        mtp.store_kv(x, inp.positions, model.rotary, inp.meta.slot_mapping)
        active = [i for i, it in enumerate(items) if it.num_draft]
        if not active:
            return drafts
        # the last row of each drafting item: its attention over the block's K/V (all written above)
        last = self.build_inputs([RowGroup([0], items[i].start + len(items[i].tokens) - 1, items[i].block_table, 1)
                                  for i in active], mixers=False)
        h = mtp.decode(x[inp.sample_idx], last.positions, model.rotary, last.meta)
        tokens = greedy_tokens(model.head(h))
        step = 0
        while True:
            chosen = tokens.tolist()
            for i, t in zip(active, chosen):
                drafts[i].append(t)
            step += 1
            keep = [j for j, i in enumerate(active) if items[i].num_draft > step]
            if not keep:
                return drafts
            if len(keep) != len(active):
                idx = torch.tensor(keep, dtype=torch.int64, device=h.device)
                h, tokens = h[idx], tokens[idx]
                active = [active[j] for j in keep]
            # draft number `step` sits at position L + step (L = the last real token's); its row is the one before
            inp = self.build_inputs([RowGroup([0], items[i].start + len(items[i].tokens) + step - 1,
                                              items[i].block_table, 1) for i in active], mixers=False)
            h = mtp(model.embed_tokens(tokens), h, inp.positions, model.rotary, inp.meta)
            tokens = greedy_tokens(model.head(h))

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks (no-op without them)."""
        if self.workers:
            self.workers.stop()
            self.workers = None

    # ------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Runs a prefill, a decode and (when speculating) a verify batch through scratch blocks
        before any request owns a block.

        The K/V they write is garbage nobody reads: every block is written by its owner before
        it is attended. Then, on CUDA unless enforce_eager, the decode graphs are captured (cuda_graphs.py).
        """
        bs = self.block_size
        prompt = max(1, min(self.config.max_num_batched_tokens, 512, self.max_model_len - 1,
                            self.num_blocks * bs - 1))
        seq = Sequence(prompt_token_ids=[i % self.vocab_size for i in range(prompt + 1)])
        seq.block_table = list(range(math.ceil((prompt + 1) / bs)))
        seq.state_slot = 0          # hybrids: scratch state, zeroed again by a request's first chunk
        self.execute(ScheduledBatch([seq], [prompt], [True], mode="prefill"))
        n = max(1, min(self.config.max_num_seqs, 32, self.num_blocks))
        ctx = max(1, min(prompt, (self.num_blocks // n) * bs - 1))
        seqs = scratch_decodes(self, n, ctx)
        self.execute(decode_batch(seqs, ctx))
        if self.has_mtp:         # the MTP pass over those rows, one draft each (the chain is the same shapes)
            self.mtp_draft(mtp_rows(self, seqs, ctx, 1))
        k = self.config.num_speculative_tokens if self.config.speculative != "off" else 0
        if k and ctx > k:        # the verify window: 1 + k query rows per sequence, every row sampled
            self.execute(verify_batch(seqs, ctx, k))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.decode_graphs is None and use_decode_graphs(self.device.type, self.config.enforce_eager, self.backend,
                                                            self.tp.size, self.is_hybrid):
            self.decode_graphs = DecodeGraphs(self, capture=True)    # pragma: no cover - CUDA only
            self.decode_graphs.capture_all()
        elif self.device.type == "cuda" and self.decode_graphs is None:
            log.info("decode CUDA graphs off (enforce_eager=%s, backend %s, tp %d, hybrid %s): every step eager",
                     self.config.enforce_eager, self.backend, self.tp.size, self.is_hybrid)
