"""LLMEngine: the single-threaded step loop tying scheduler, model runner and sampler together.

No asyncio here: the server runs the engine in one dedicated thread and funnels add/abort into
it between steps. Step times are measured and smoothed (EWMA) so admission can estimate
time-to-first-token from live state.
"""
from __future__ import annotations

import atexit
import gc
import logging
import time
from dataclasses import dataclass
from itertools import accumulate

import torch

from consort_engine.core.admission import StepEstimates
from consort_engine.kv.block_manager import BlockManager, blocks_for
from consort_engine.kv.events import KVEventLog
from consort_engine.kv.tier import KVTier
from consort_engine.config import EngineConfig
from consort_engine.model.kv_blocks import layout_identity, read_blocks, read_states, write_blocks, write_states
from consort_engine.model.lora import AdapterError
from consort_engine.model.sampler import greedy_tokens
from consort_engine.core.scheduler import Scheduler, StepOutput
from consort_engine.kv.sequence import SamplingParams, ScheduledBatch, Sequence
from consort_engine.spec.step_cost import profile_step_cost
from consort_engine.text.guided import advance, apply_mask

__all__ = ["AdmissionRejected", "LLMEngine", "StepOutput"]

log = logging.getLogger("consort.engine")

DEFAULT_TIER_BYTES = 4 * 2**30
CLOSE_FLUSH_S = 5.0        # at shutdown, pool blocks go to the tier for at most this long (the thread gets 10 s)
PREEMPTING_WINDOW_S = 10.0   # `preempting` in stats: a preemption happened this recently
EWMA_ALPHA = 0.2


class AdmissionRejected(Exception):
    """A request the engine will not queue now. `permanent`: retrying cannot help."""

    def __init__(self, code: str, retry_after_ms: int, message: str, permanent: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.retry_after_ms = retry_after_ms
        self.message = message
        self.permanent = permanent


@dataclass
class Ewma:
    alpha: float = EWMA_ALPHA
    value: float = 0.0
    count: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1


def make_tier(config: EngineConfig, runner, events: KVEventLog) -> KVTier | None:
    """The KV tier the flags ask for, or None (not asked for, or this engine cannot copy its blocks)."""
    if config.kv_tier_path is None and config.kv_tier_bytes is None:
        return None
    if config.tensor_parallel_size > 1 or not hasattr(runner, "kv_cache"):
        log.warning("KV tier is off: it needs the whole KV pool in this process (tensor_parallel_size 1)")
        return None
    # a hybrid's blocks carry the state checkpoint at their end: its shapes are part of the layout
    states = runner.hybrid_state.checkpoint_pools if getattr(runner, "is_hybrid", False) else ()
    identity = layout_identity(config, runner.dtype, runner.kv_cache, runner.backend, 0, 1, states)
    tier = KVTier(config.kv_tier_path, config.kv_tier_bytes or DEFAULT_TIER_BYTES, identity, events)
    log.info("KV tier: %s, %.1f GiB, %s", tier.dir or "host memory", tier.max_bytes / 2**30, identity)
    return tier


def freeze_heap() -> None:
    """For a process that holds one engine for its life (the server, a benchmark run): what is alive
    once it is loaded and warm (torch, the model, the imports: ~230k objects for the bench model) is
    moved out of the cyclic collector's sight, so a full collection walks only what the steps allocate.
    One over the whole heap took ~100 ms on the bench model, a stall of the step loop. Not for a
    process that drops engines and makes more: their cyclic garbage would stay (gc.unfreeze undoes it).
    Unfrozen at exit: the interpreter's last collection must see the objects (nanobind, under triton,
    reports every instance it still holds as a leak)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner=None, sampler=None) -> None:
        if runner is None:
            from consort_engine.model.model_runner import ModelRunner
            runner = ModelRunner(config)
        if sampler is None:
            from consort_engine.model.sampler import Sampler
            sampler = Sampler()
        hybrid = getattr(runner, "is_hybrid", False)
        if hybrid and runner.config.max_num_seqs < config.max_num_seqs:
            config = runner.config      # fewer state slots fit than max_num_seqs (ModelRunner._state_rows)
        self.config = config
        self.runner = runner
        self.sampler = sampler
        self.max_model_len: int = runner.max_model_len
        caching = config.enable_prefix_caching
        checkpoints = getattr(runner, "num_checkpoints", 0)
        if hybrid and caching and not checkpoints:
            # A cached prefix's KV is useless without the mixers' state at that token: never reuse it.
            log.warning("prefix caching is off for %s: hybrid (attention + Mamba2) model without state "
                        "checkpoints (hybrid_checkpoints 0)", config.name)
            caching = False
        self.kv_events = KVEventLog()
        self.kv_tier = make_tier(config, runner, self.kv_events) if caching else None
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, namespace=config.name,
                                          enable_caching=caching,
                                          state_slots=config.max_num_seqs if hybrid else 0,
                                          events=self.kv_events, tier=self.kv_tier,
                                          checkpoints=checkpoints if hybrid else 0,
                                          checkpoint_every=config.hybrid_checkpoint_every)
        # Swap preemption needs the whole pool in this process (no tensor-parallel ranks to replay it).
        swap = hybrid and config.hybrid_swap and config.tensor_parallel_size == 1
        self.scheduler = Scheduler(config, self.block_manager, eos_token_ids=runner.eos_token_ids,
                                   max_model_len=self.max_model_len,
                                   swap_bytes=(runner.block_bytes, runner.state_bytes_per_seq) if swap else None)
        self.hybrid = hybrid
        self.spec = self.scheduler.spec
        if getattr(runner, "has_mtp", False):
            self.spec.drafter = "mtp"
        self.warm = False
        self.warmup_s: float | None = None
        self._warmup_started: float | None = None

        self.num_steps = 0
        self.last_batch: ScheduledBatch | None = None
        self._step_time = Ewma()
        self._decode_step = Ewma()
        self._prefill_tokens = Ewma()     # ratio of EWMAs = prefill throughput
        self._prefill_time = Ewma()
        self._sched_overhead = Ewma()     # schedule + postprocess, per step

    # ------------------------------------------------------------------ lifecycle
    def warmup(self) -> None:
        """Run the model's warm-up shapes; add_request rejects with `warming` until done."""
        self._warmup_started = time.monotonic()
        self.runner.warmup()
        if self.spec.enabled and self.config.spec_policy == "goodput":
            self.spec.cost = profile_step_cost(self.runner, self.spec.k)
        self.warmup_s = time.monotonic() - self._warmup_started
        self.warm = True

    # ------------------------------------------------------------------ requests
    def validate(self, seq: Sequence) -> None:
        """Requests that can never run: ValueError (bad input) or a permanent AdmissionRejected."""
        if seq.num_prompt_tokens == 0:
            raise ValueError("prompt is empty")
        if seq.sampling.max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens; the context is {self.max_model_len} "
                             f"and at least one token must be generated")
        need = blocks_for(seq.num_tokens + self.scheduler.num_lookahead, self.block_manager.block_size)
        if need > self.block_manager.num_blocks:
            raise AdmissionRejected("kv_capacity", 0, f"prompt needs {need} KV blocks, the pool has "
                                    f"{self.block_manager.num_blocks}", permanent=True)

    def estimates(self) -> StepEstimates:
        tps = self._prefill_tokens.value / self._prefill_time.value if self._prefill_time.value > 0 else 0.0
        decode = self._decode_step.value if self._decode_step.count else self._step_time.value
        return StepEstimates(decode_step_s=decode, prefill_tokens_per_s=tps)

    def add_requests(self, seqs: list[Sequence]) -> None:
        """Queue seqs together, all or none. A seq with the same prompt, adapter and salt as an earlier one
        (the n samples of a prompt) waits for that one's prefill and takes its blocks from the prefix
        cache: one prefill, not n."""
        first: dict[tuple, Sequence] = {}
        added: list[Sequence] = []
        try:
            for seq in seqs:
                key = (seq.adapter, seq.cache_salt, tuple(seq.token_ids))
                self.add_request(seq, after=first.get(key))
                first.setdefault(key, seq)
                added.append(seq)
        except BaseException:
            for seq in added:       # a half-admitted request would run unseen
                self.abort(seq.seq_id)
            raise

    def add_request(self, seq: Sequence, after: Sequence | None = None) -> None:
        """Queue a request, or raise ValueError (bad input) / AdmissionRejected (overload)."""
        self.validate(seq)
        elapsed = time.monotonic() - self._warmup_started if self._warmup_started else 0.0
        rejection = self.scheduler.check_admission(seq, self.estimates(), warm=self.warm,
                                                   warming_elapsed_s=elapsed)
        if rejection is not None:
            raise AdmissionRejected(rejection.code, rejection.retry_after_ms, rejection.message,
                                    rejection.permanent)
        self.scheduler.add(seq, after)

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        """Cancel a request (client gone, stop string matched): its KV blocks are free at once."""
        seq = self.scheduler.abort(seq_id)
        if seq is not None:
            seq.finish_reason = reason

    def load_adapter(self, name: str, path: str) -> None:
        """Hot-load a LoRA adapter between steps (lora.AdapterError when it cannot be served)."""
        self.runner.load_adapter(name, path)

    def unload_adapter(self, name: str) -> int:
        """Unload an adapter no request uses; its cached prefixes go with it. Returns blocks dropped."""
        if name not in getattr(self.runner, "adapters", {}):
            raise AdapterError(f"adapter {name!r} is not loaded", code="adapter_not_found")
        users = self.scheduler.count_adapter_users(name)
        if users:
            raise AdapterError(f"adapter {name!r} is used by {users} running or waiting requests",
                               code="adapter_in_use")
        self.runner.unload_adapter(name)
        return self.block_manager.forget_adapter(name)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        # The copies this step's allocations asked for: every read of a freed block, slot or row first
        # (swapped victims, blocks evicted to the tier), then the writes into their new owners.
        swap = self.scheduler.swap_bytes is not None
        if swap:
            self._swap_out(batch)
        if self.kv_tier is not None:
            self._save_evicted()
        if swap:
            self._swap_in(batch)
        if self.kv_tier is not None:
            self._load_found()
        if self.block_manager.checkpoints:
            self._checkpoint_states(batch)
        t1 = time.perf_counter()
        if not batch.seqs:
            self.last_batch = batch
            return self.scheduler.take_pending_outputs()
        mtp = self.spec.drafter == "mtp"
        if mtp:
            self._draft_mtp(batch)
        logits = self.runner.execute(batch)
        if mtp:
            self.spec.keep_hidden(batch, self.runner)
        for i, lps in getattr(self.runner, "last_prompt_logprobs", ()):
            batch.seqs[i].prompt_logprobs.extend(lps)
        token_ids, logprobs = self._sample(batch, logits)
        t2 = time.perf_counter()
        before = [s.num_computed_tokens for s in batch.seqs] if self.hybrid and batch.num_draft else None
        outputs = self.scheduler.postprocess(batch, token_ids, logprobs)
        self.spec.commit(batch, before, self.runner)
        t3 = time.perf_counter()
        self.last_batch = batch
        self._record(batch, t3 - t0, (t1 - t0) + (t3 - t2))
        return outputs

    def _swap_out(self, batch: ScheduledBatch) -> None:
        """Hybrids: copy this step's victims out before the forward reuses their blocks and slots
        (before _swap_in: a readmitted sequence may get a victim's blocks)."""
        for seq in batch.preempted:
            if seq.swapped is not None and not seq.swapped.copied:
                self.runner.swap_out(seq.swapped)

    def _swap_in(self, batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            if seq.swapped is not None:
                self.runner.swap_in(seq.swapped, seq.block_table, seq.state_slot)
                seq.swapped = None

    def _checkpoint_states(self, batch: ScheduledBatch) -> None:
        """Hybrid prefix caching: the admitted hits' slots get their saved state (after the swaps: a
        hit may take a victim's slot; after the tier loads: a tier hit's state arrives in its row), and
        the step's prefill chunks learn where to save theirs."""
        bm = self.block_manager
        restores = bm.take_state_restores()
        if restores:
            self.runner.restore_states(restores)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if n > 1 and not (batch.num_draft and batch.num_draft[i]):
                cuts = bm.plan_checkpoints(seq, n)
                if cuts:
                    batch.checkpoints[i] = cuts

    def _save_evicted(self) -> None:
        """Copy the blocks (and hybrid state rows) this step's allocations evicted out to the tier,
        before _load_found fills the blocks and rows found in the tier (one block or row may be both)."""
        saves = self.block_manager.take_offloads()
        if saves:
            self._save_to_tier(saves)

    def _load_found(self) -> None:
        loads = self.block_manager.take_onloads()
        if loads:
            write_blocks(self.runner.kv_cache, [b for b, *_ in loads], [kv for _, kv, *_ in loads])
            states = [(row, st) for _, _, row, st in loads if row >= 0]
            if states:
                write_states(self.runner.hybrid_state.checkpoint_pools, [r for r, _ in states], [st for _, st in states])

    def _save_to_tier(self, blocks: list[tuple[int, bytes, int]], wait: bool = False) -> None:
        rows = [row for _, _, row in blocks if row >= 0]
        states = iter(read_states(self.runner.hybrid_state.checkpoint_pools, rows) if rows else ())
        for (_, h, row), kv in zip(blocks, read_blocks(self.runner.kv_cache, [b for b, *_ in blocks])):
            self.kv_tier.save(h, kv, next(states) if row >= 0 else b"", wait=wait)

    def close(self) -> None:
        """Stop: the prefix blocks still in the pool go to the tier first (a restart on the same
        directory starts warm), then the runner's ranks stop."""
        if self.kv_tier is not None and self.kv_tier.enabled:
            self._save_evicted()
            self._load_found()        # registered blocks whose bytes are still on their way in
            held = self.block_manager.tier_candidates()
            deadline = time.monotonic() + CLOSE_FLUSH_S
            for i in range(0, len(held), 64):
                if time.monotonic() > deadline:
                    log.warning("KV tier: %d pool blocks not written at shutdown (%.0f s spent)",
                                len(held) - i, CLOSE_FLUSH_S)
                    break
                self._save_to_tier(held[i:i + 64], wait=True)
            self.kv_tier.flush(timeout=max(1.0, deadline - time.monotonic()))
            self.kv_tier.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _draft_mtp(self, batch: ScheduledBatch) -> None:
        self.spec.draft_mtp(batch, self.runner)

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> tuple[list[int], list | None]:
        """Token ids for every sampled row (batch.rows_sampled order). A verify window's rows hold
        the model's own choice at each draft position: the argmax for greedy requests; for sampled
        ones the draft itself where typical acceptance keeps it, then one sampled token."""
        sampled_seqs = [s for s, flag in zip(batch.seqs, batch.sample) if flag]
        if not sampled_seqs:
            return [], None
        if not batch.num_draft:
            token_ids, logprobs = self.sampler.sample(logits, sampled_seqs)
            token_ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
            if any(s.matcher is not None for s in sampled_seqs):
                advance([s.matcher for s in sampled_seqs], token_ids)
            return token_ids, logprobs
        counts = [batch.rows_sampled(i) for i in range(len(batch.seqs)) if batch.sample[i]]
        starts = [0, *accumulate(counts)][:-1]
        windows = [(r, s.matcher, s.token_ids[-(c - 1):]) for s, r, c in zip(sampled_seqs, starts, counts)
                   if c > 1 and s.matcher is not None]
        if windows:      # guided verify rows: one grammar mask row per position, so argmax is legal
            logits = apply_mask(logits, [], windows)
        greedy = greedy_tokens(logits).tolist()
        single = [r for r, c in zip(starts, counts) if c == 1]
        token_ids = list(greedy)
        for seq, r, c in zip(sampled_seqs, starts, counts):
            if c > 1 and not seq.sampling.greedy:
                token_ids[r:r + c] = self.spec.typical_window(seq, logits[r:r + c], seq.token_ids[-(c - 1):], self._sample_one)
        logprobs: list | None = None
        if single:
            rows = torch.tensor(single, dtype=torch.int64, device=logits.device)
            picked, lps = self.sampler.sample(logits[rows], [s for s, c in zip(sampled_seqs, counts) if c == 1])
            picked = picked.tolist() if isinstance(picked, torch.Tensor) else picked
            for r, t in zip(single, picked):
                token_ids[r] = t
            if any(s.matcher is not None for s in sampled_seqs):   # windows' matchers advance in postprocess
                advance([s.matcher if c == 1 else None for s, c in zip(sampled_seqs, counts)],
                        [token_ids[r] for r in starts])
            if lps is not None:
                logprobs = [None] * len(token_ids)
                for r, lp in zip(single, lps):
                    logprobs[r] = lp
        return token_ids, logprobs

    def _sample_one(self, logits: torch.Tensor, seq: Sequence) -> int:
        """One token from one verify-window row; a guided row was masked at its position in _sample."""
        return self.sampler.sample(logits, [seq], masked=seq.matcher is not None)[0][0]

    def _record(self, batch: ScheduledBatch, step_s: float, overhead_s: float) -> None:
        self.num_steps += 1
        self._step_time.update(step_s)
        self._sched_overhead.update(overhead_s)
        if batch.mode in ("decode", "spec_verify"):
            self._decode_step.update(step_s)
        else:
            drafts = batch.num_draft or [0] * len(batch.seqs)
            prefill_tokens = sum(n for n, flag, k in zip(batch.num_new_tokens, batch.sample, drafts)
                                 if (n > 1 and not k) or not flag)
            if prefill_tokens:
                self._prefill_tokens.update(prefill_tokens)
                self._prefill_time.update(step_s)

    # ------------------------------------------------------------------ offline API
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run a batch of token-id prompts to completion; generated token ids, in prompt order."""
        if not self.warm:
            self.warmup()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [Sequence(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
        for seq in seqs:
            self.validate(seq)
        for seq in seqs:       # offline: no queue bound, no deadline; the loop drains it
            self.scheduler.add(seq)
        while any(not s.is_finished for s in seqs):
            outputs = self.step()
            if not self.last_batch.seqs and not outputs:
                raise RuntimeError("scheduler made no progress with unfinished requests")
        return [s.output_token_ids for s in seqs]

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict:
        bm = self.block_manager
        sched = self.scheduler
        last = sched.last_preemption_time
        est = self.estimates()
        return {
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "kv_total_blocks": bm.num_blocks,
            "kv_free_blocks": bm.num_free_blocks,
            "kv_cached_blocks": bm.num_cached_blocks,
            "kv_usage": bm.num_used_blocks / bm.num_blocks,
            "preempting": last is not None and time.monotonic() - last < PREEMPTING_WINDOW_S,
            "num_preemptions": sched.num_preemptions,
            "num_preemptions_swapped": sched.num_swapped,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "tier_cache_queries": bm.tier_queries,
            "tier_cache_hits": bm.tier_hits,
            "kv_events_seq": self.kv_events.seq,
            "kv_events_snapshots": self.kv_events.snapshots_served,
            "kv_events_lag": self.kv_events.last_lag,
            **(self.kv_tier.stats() if self.kv_tier is not None else {}),
            "step_time_ewma_s": self._step_time.value,
            "prefill_tokens_per_s": est.prefill_tokens_per_s,
            "decode_step_s": est.decode_step_s,
            "scheduler_overhead_s": self._sched_overhead.value,
            "num_steps": self.num_steps,
            "warm": self.warm,
            "speculation": self.spec.stats(),
            "adapters": {name: "loaded" for name in getattr(self.runner, "adapters", {})},
            "adapter_paths": {name: a.path for name, a in getattr(self.runner, "adapters", {}).items()},
        }

