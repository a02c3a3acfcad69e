"""Continuous-batching scheduler: admit, batch, preempt, commit. One per engine.

Each step: (0) a strictly higher-priority waiter that cannot get in preempts lower-priority
runners down to a free-pool watermark; (1) running decodes, highest priority first, growing
their block tables (a decode that finds no block preempts the lowest-priority, latest runner,
possibly itself); (2) running chunked prefills; (3) admission from the waiting heap in
(priority DESC, arrival ASC) order while the token budget, the seat limit and the pool allow.
Preemption is recompute: blocks are freed (their full blocks stay in the prefix cache, so the
recompute mostly hits), generated tokens are kept and recomputed with the prompt. Hybrid models
(whose prefix cache only hits at state checkpoints) swap instead: the victim's KV and state go to host memory and come back at
readmission (state_pool.SwappedState), and the victim is chosen by state_pool.pick_victim.
"""
from __future__ import annotations

import bisect
import heapq
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

from consort_engine.core.admission import (AdmissionRequest, QueueSnapshot, Rejection, StepEstimates,
                        decide_admission)
from consort_engine.kv.block_manager import BlockManager, blocks_for
from consort_engine.config import EngineConfig
from consort_engine.kv.sequence import PromptLogprobs, ScheduledBatch, Sequence, SequenceStatus
from consort_engine.spec.spec_decoder import SpecDecoder
from consort_engine.spec.speculative import propose_ngram
from consort_engine.kv.state_pool import SwappedState, pick_victim

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING


@dataclass(slots=True)
class StepOutput:
    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None     # per new token, whatever the sampler returned
    prompt_logprobs: PromptLogprobs | None = None   # with a sequence's first output, when asked for


def run_order(seq: Sequence) -> tuple[int, float, int]:
    """Running and waiting order: priority DESC, arrival ASC (seq_id breaks exact ties)."""
    return (-seq.priority, seq.arrival, seq.seq_id)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 eos_token_ids: Iterable[int] = (), max_model_len: int | None = None,
                 swap_bytes: tuple[int, int] | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.max_model_len = max_model_len or sys.maxsize
        # Proposal, verification, rollback and the acceptance counters live in the SpecDecoder.
        # (propose_ngram is looked up here, at construction, so a test can swap the proposer.)
        self.spec = SpecDecoder(config, block_manager, self.max_model_len, propose_ngram)
        # Tokens one decode step may add: 1, or 1 + K when speculating (verify the draft window).
        self.speculate = self.spec.enabled
        self.decode_span = 1 + self.spec.k
        self.num_lookahead = self.decode_span
        self.tool_trigger_ids = frozenset(config.tool_trigger_ids)
        self.watermark_blocks = max(1, int(config.preempt_watermark * block_manager.num_blocks + 0.999999))

        self.running: list[Sequence] = []          # kept sorted by run_order: victims at the tail
        self._heap: list[tuple[int, float, int, Sequence]] = []
        self._waiting: dict[int, Sequence] = {}     # heap entries not in here are stale (aborted)
        self._waiting_load: dict[int, list[int]] = {}  # priority -> [prefill tokens, blocks needed]
        # Siblings parked behind the seq that computes their shared prompt (n samples of one prompt):
        # they queue once its prefill is done and find its blocks in the prefix cache, so n samples
        # cost one prefill, not n. child seq_id -> (child, the seq it waits for).
        self._parked: dict[int, tuple[Sequence, Sequence]] = {}

        # Hybrids: (KV bytes per block, state bytes per sequence) when preemption swaps (see module doc).
        self.swap_bytes = swap_bytes
        self.num_preemptions = 0
        self.num_swapped = 0              # preemptions that parked KV + state in host memory
        self.last_preemption_time: float | None = None
        # Outputs produced outside postprocess (a seq finished while being preempted).
        self._pending_outputs: list[StepOutput] = []

    # ------------------------------------------------------------------ queue
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._parked)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting or self._parked)

    @property
    def waiting(self) -> list[Sequence]:
        """Waiting seqs (parked siblings too), in no particular order (see waiting_in_order)."""
        return list(self._waiting.values()) + [child for child, _ in self._parked.values()]

    def waiting_in_order(self) -> list[Sequence]:
        return sorted(self._waiting.values(), key=run_order)

    def add(self, seq: Sequence, after: Sequence | None = None) -> None:
        """Queue seq; with `after` (a seq with the same prompt), only once after's prompt is computed."""
        seq.status = _WAITING
        if after is not None and not after.is_finished and self.block_manager.enable_caching:
            self._parked[seq.seq_id] = (seq, after)
        else:
            self._push_waiting(seq)

    def _unpark(self) -> None:
        """Queue the parked siblings whose prompt is now computed (and cached), or whose twin is gone."""
        for seq_id, (child, twin) in list(self._parked.items()):
            if twin.is_finished or twin.num_computed_tokens >= twin.num_prompt_tokens:
                del self._parked[seq_id]
                if (child.needs_prompt_logprobs and twin.prompt_logprobs is not None
                        and not twin.needs_prompt_logprobs):
                    child.prompt_logprobs = twin.prompt_logprobs   # the same prompt's: complete, never changes
                self._push_waiting(child)

    def _waiting_cost(self, seq: Sequence) -> tuple[int, int]:
        computed = seq.swapped.num_computed_tokens if seq.swapped is not None else 0
        return seq.num_tokens - computed, blocks_for(seq.num_tokens + self.num_lookahead, self.block_manager.block_size)

    def _push_waiting(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (-seq.priority, seq.arrival, seq.seq_id, seq))
        self._waiting[seq.seq_id] = seq
        tokens, blocks = self._waiting_cost(seq)
        load = self._waiting_load.setdefault(seq.priority, [0, 0])
        load[0] += tokens
        load[1] += blocks

    def _remove_waiting(self, seq: Sequence) -> None:
        del self._waiting[seq.seq_id]
        tokens, blocks = self._waiting_cost(seq)
        load = self._waiting_load[seq.priority]
        load[0] -= tokens
        load[1] -= blocks
        if load[1] == 0:
            del self._waiting_load[seq.priority]

    def _peek_waiting(self) -> Sequence | None:
        heap = self._heap
        while heap and heap[0][2] not in self._waiting:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def _pop_waiting(self) -> Sequence:
        seq = heapq.heappop(self._heap)[3]
        self._remove_waiting(seq)
        return seq

    # ------------------------------------------------------------------ cancel / finish
    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a request; its blocks go back to the pool at once."""
        parked = self._parked.pop(seq_id, None)
        seq = self._waiting.get(seq_id)
        if parked is not None:
            seq = parked[0]
        elif seq is not None:
            self._remove_waiting(seq)
            if len(self._heap) > 2 * len(self._waiting) + 64:   # drop stale heap entries
                self._heap = [e for e in self._heap if e[2] in self._waiting]
                heapq.heapify(self._heap)
        else:
            k = next((k for k, s in enumerate(self.running) if s.seq_id == seq_id), None)
            if k is None:
                return None
            seq = self.running.pop(k)      # by position: Sequence's dataclass __eq__ compares tokens
            self.block_manager.free(seq)
        seq.finish("abort")
        return seq

    def take_pending_outputs(self) -> list[StepOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        bm = self.block_manager
        swap = None
        if self.swap_bytes is not None and seq.num_computed_tokens:
            kept = blocks_for(seq.num_computed_tokens, bm.block_size)
            swap = SwappedState(seq.num_computed_tokens, seq.block_table[:kept], seq.state_slot)
        bm.free(seq)
        if blocks_for(len(seq.token_ids) + self.num_lookahead, bm.block_size) > bm.num_blocks:
            # It has outgrown the whole pool: it could never be readmitted (and would block the
            # head of the queue forever). It ends here, truncated, like hitting max_model_len.
            seq.finish("length")
            self._pending_outputs.append(StepOutput(seq.seq_id, [], True, "length", None))
            return
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        seq.mtp_hidden = None       # recomputed from scratch: no hidden states carry over
        seq.swapped = swap          # the engine copies it out before this step's forward reuses the blocks
        seq.status = _WAITING
        self._push_waiting(seq)
        preempted.append(seq)
        self.num_preemptions += 1
        self.num_swapped += swap is not None
        self.last_preemption_time = time.monotonic()

    def count_adapter_users(self, adapter: str) -> int:
        return sum(1 for s in self.running if s.adapter == adapter) + \
            sum(1 for s in self.waiting if s.adapter == adapter)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch:
        if self._parked:
            self._unpark()
        bm = self.block_manager
        running = self.running
        budget = self.config.max_num_batched_tokens
        span = self.decode_span
        bs = bm.block_size
        seqs: list[Sequence] = []
        nums: list[int] = []
        sample: list[bool] = []
        drafts: list[int] = []
        preempted: list[Sequence] = []

        # (0) priority preemption for the head of the queue.
        head = self._peek_waiting()
        if head is not None and running and head.priority > running[-1].priority:
            self._preempt_for(head, preempted)

        # (1) decodes, highest priority first; victims are always later in this order. Speculating: each
        # decode's draft length where drafting pays (None: up to K each).
        limits = self.spec.plan([s for s in running if len(s.token_ids) - s.num_computed_tokens == 1]) \
            if self.speculate else None
        prefilling: list[Sequence] = []
        decode_preempted = False
        i = 0
        while i < len(running):
            seq = running[i]
            i += 1
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n > span:
                prefilling.append(seq)
                continue
            if n > budget:
                continue
            k = 0
            if n == 1 and self.speculate:
                k = self.spec.propose(seq, budget - n, None if limits is None else limits.get(seq.seq_id, 0))
            if k:
                n += k
            need = (computed + n + bs - 1) // bs - len(seq.block_table)
            if need > 0 and need > bm.num_free_blocks:
                decode_preempted = True
                if not self._preempt_for_decode(seq, need, preempted):
                    break          # seq itself was the last victim; everything after it is gone too
            if need > 0:
                bm.append_slots(seq, n)
            seqs.append(seq)
            nums.append(n)
            sample.append(True)
            drafts.append(k)
            budget -= n
        num_decodes = len(seqs)

        # (2) chunked prefills of running seqs (blocks were allocated at admission).
        for seq in prefilling:
            if budget <= 0:
                break
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            n = remaining if remaining <= budget else budget
            seqs.append(seq)
            nums.append(n)
            sample.append(n == remaining)
            budget -= n

        # (3) admission. Not in a step where decodes had to be preempted for memory.
        # Seqs preempted for a higher-priority waiter are not readmitted in the same step.
        if not decode_preempted:
            max_seqs = self.config.max_num_seqs
            floor = max(v.priority for v in preempted) if preempted else None
            while budget > 0 and len(running) < max_seqs:
                head = self._peek_waiting()
                if head is None or (floor is not None and head.priority <= floor):
                    break
                if not bm.try_allocate(head, self.num_lookahead):
                    break
                self._pop_waiting()
                if head.swapped is not None:     # resumes where it stopped: the engine swaps it in
                    head.num_computed_tokens = head.swapped.num_computed_tokens
                head.status = _RUNNING
                bisect.insort(running, head, key=run_order)
                remaining = head.num_tokens - head.num_computed_tokens
                n = remaining if remaining <= budget else budget
                seqs.append(head)
                nums.append(n)
                sample.append(n == remaining)
                budget -= n

        num_prefills = len(seqs) - num_decodes
        drafts += [0] * num_prefills
        verify = any(drafts)
        mode = ("mixed" if num_decodes and num_prefills else "prefill" if num_prefills
                else "spec_verify" if verify else "decode")
        if len(seqs) > 1 and any(s.adapter is not None for s in seqs):
            # Group by adapter (stable: decodes stay ahead of prefills inside each group).
            order = sorted(range(len(seqs)), key=lambda k: seqs[k].adapter or "")
            seqs = [seqs[k] for k in order]
            nums = [nums[k] for k in order]
            sample = [sample[k] for k in order]
            drafts = [drafts[k] for k in order]
        return ScheduledBatch(seqs=seqs, num_new_tokens=nums, sample=sample, mode=mode, preempted=preempted,
                              num_draft=drafts if verify else [])

    def _preempt_for_decode(self, seq: Sequence, need: int, preempted: list[Sequence]) -> bool:
        """Free blocks for a decode by preempting from the tail (lowest priority, latest arrival)
        until the watermark is free. False when seq itself had to go."""
        bm = self.block_manager
        running = self.running
        target = need + self.watermark_blocks
        while bm.num_free_blocks < target and running[-1] is not seq:
            self._preempt(self._pop_victim(target - bm.num_free_blocks, after=seq), preempted)
        if need <= bm.num_free_blocks:
            return True
        assert running[-1] is seq
        self._preempt(running.pop(), preempted)
        return False

    def _preempt_for(self, head: Sequence, preempted: list[Sequence]) -> None:
        """A strictly higher-priority waiter that cannot be admitted preempts lower-priority
        runners until it fits with a watermark of free blocks to spare (never just one block,
        or the next decode step would preempt again)."""
        bm = self.block_manager
        running = self.running
        need = bm.blocks_needed_to_allocate(head, self.num_lookahead)
        seats_full = len(running) >= self.config.max_num_seqs
        if need <= bm.num_free_blocks and not seats_full:
            return
        victims = [s for s in running if s.priority < head.priority]
        freeable = sum(1 for s in victims for b in s.block_table if bm.ref_count[b] == 1)
        if need > bm.num_free_blocks + freeable:
            return     # even preempting every lower-priority runner would not admit it
        target = need + self.watermark_blocks
        while (running and running[-1].priority < head.priority
               and (bm.num_free_blocks < target or len(running) >= self.config.max_num_seqs)):
            self._preempt(self._pop_victim(target - bm.num_free_blocks), preempted)

    def _pop_victim(self, need: int, after: Sequence | None = None) -> Sequence:
        """Take the next victim out of running: the tail (lowest priority, latest arrival), or for
        swapping hybrids pick_victim's choice among the tail's priority class, never `after` or a
        sequence ahead of it (those are already in this step's batch)."""
        running = self.running
        if self.swap_bytes is None:
            return running.pop()
        lo = len(running) - 1
        floor = running[lo].priority
        while lo > 0 and running[lo - 1].priority == floor and running[lo - 1] is not after:
            lo -= 1
        block_bytes, state_bytes = self.swap_bytes
        k = lo + pick_victim([len(s.block_table) for s in running[lo:]], need, block_bytes, state_bytes)
        return running.pop(k)

    # ------------------------------------------------------------------ commit
    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int],
                    logprobs: list | None = None) -> list[StepOutput]:
        """Commit one step: advance computed tokens, append sampled tokens (batch.rows_sampled(i)
        per sequence, in batch order), verify drafts, finish and free what stopped."""
        bm = self.block_manager
        bs = bm.block_size
        outputs = self.take_pending_outputs()
        now = time.monotonic()
        finished_any = False
        j = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            rows = batch.rows_sampled(i)
            if seq.status is not _RUNNING:      # aborted between schedule and commit
                j += rows
                continue
            before = seq.num_computed_tokens
            if rows == 0:
                seq.num_computed_tokens = before + n
                if seq.num_computed_tokens // bs != before // bs:   # a new full block: cacheable
                    bm.cache_computed_blocks(seq)
                continue
            targets = sampled_token_ids[j:j + rows]
            lps = [None] * rows if logprobs is None else logprobs[j:j + rows]
            j += rows
            emit = targets[:1]
            if rows > 1:    # verify: drafts equal to the model's own choices (engine._sample) stand
                emit = self.spec.accept(seq, targets)
            elif n == 1:    # a decode that did not draft: would its n-gram draft have stood?
                self.spec.observe_shadow(seq, emit[0])
            new, reason = [], None
            for token in emit:
                seq.token_ids.append(token)
                if rows > 1:
                    self.spec.commit_token(seq, token)
                new.append(token)
                if token in self.tool_trigger_ids:
                    seq.speculate = False
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            # K/V stands for the window's first token and every emitted token but the last.
            seq.num_computed_tokens = before + n if rows == 1 else before + len(emit)
            new_lps = [lp for lp in lps[:len(new)] if lp is not None]
            seq.output_logprobs.extend(new_lps)
            first = seq.first_token_time is None
            if first:
                seq.first_token_time = now
            if reason is None:
                if rows > 1:
                    self.spec.release(seq, before + n)
                if seq.num_computed_tokens // bs != before // bs:
                    bm.cache_computed_blocks(seq)
            else:
                seq.finish(reason)
                bm.free(seq)
                finished_any = True
            outputs.append(StepOutput(seq.seq_id, new, reason is not None, reason, new_lps or None,
                                      seq.prompt_logprobs if first else None))
        if finished_any:
            self.running = [s for s in self.running if s.status is _RUNNING]
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if token in self.eos_token_ids and not sp.ignore_eos:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"
        if sp.stop_token_ids and token in sp.stop_token_set:
            return "stop"
        num_tokens = len(seq.token_ids)
        if num_tokens - len(seq.prompt_token_ids) >= sp.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ admission
    def queue_snapshot(self, seq: Sequence, warm: bool = True, warming_elapsed_s: float = 0.0) -> QueueSnapshot:
        """Live queue state as seen by `seq`: what is ahead of it, what it could preempt."""
        bm = self.block_manager
        tokens_ahead = blocks_ahead = 0
        for prio, (tokens, blocks) in self._waiting_load.items():
            if prio >= seq.priority:
                tokens_ahead += tokens
                blocks_ahead += blocks
        preemptible = 0
        release: list[tuple[int, int]] = []
        for s in self.running:
            pending = s.num_tokens - s.num_computed_tokens
            if pending > self.decode_span:      # mid-prefill: its chunks share the token budget
                tokens_ahead += pending
            if s.priority < seq.priority:
                preemptible += len(s.block_table)
            else:
                left = min(s.sampling.max_tokens - s.num_output_tokens, self.max_model_len - s.num_tokens)
                release.append((max(1, left), len(s.block_table)))
        return QueueSnapshot(num_blocks=bm.num_blocks, free_blocks=bm.num_free_blocks,
                             num_waiting=len(self._waiting), max_waiting=self.config.max_waiting,
                             tokens_ahead=tokens_ahead, blocks_ahead=blocks_ahead,
                             preemptible_blocks=preemptible, running_release=tuple(release),
                             warm=warm, warming_elapsed_s=warming_elapsed_s)

    def check_admission(self, seq: Sequence, estimates: StepEstimates = StepEstimates(),
                        warm: bool = True, warming_elapsed_s: float = 0.0,
                        now: float | None = None) -> Rejection | None:
        """Would `seq` be admitted to the queue? None, or a typed rejection with retry-after."""
        now = time.monotonic() if now is None else now
        req = AdmissionRequest(
            num_tokens=seq.num_tokens,
            blocks_needed=blocks_for(seq.num_tokens + self.num_lookahead, self.block_manager.block_size),
            priority=seq.priority,
            deadline_in_s=None if seq.deadline is None else seq.deadline - now)
        return decide_admission(req, self.queue_snapshot(seq, warm, warming_elapsed_s), estimates)
