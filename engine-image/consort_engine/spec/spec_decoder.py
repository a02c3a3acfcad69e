"""SpecDecoder: everything speculative decoding does, in one place.

Proposal (n-gram prompt lookup, or placeholders the checkpoint's MTP block fills in before the
forward), verification (the greedy argmax rule; typical acceptance for sampled requests),
rollback (rejected drafts cut from the tokens, their blocks returned, the K/V slots they wrote
inside kept blocks zeroed, a hybrid model's mixer state advanced over the kept tokens only) and the
proposed/accepted counters that metrics and `speculation_stats()` read. The scheduler and the
engine call into it at fixed points of a step and know nothing else about speculation:

    schedule:    plan()           -> each decode's draft length where drafting pays (draft_plan.py)
                 propose()        -> k draft tokens appended to a decode's window
    forward:     draft_mtp() before, keep_hidden() after (MTP drafter only)
    sample:      typical_window() for sampled verify windows (greedy rows: argmax)
    postprocess: accept() -> the tokens to emit; release() after the window committed;
                 observe_shadow() for a decode that did not draft
    after step:  commit()  -> hybrid windows' kept tokens into the state + stale-slot zeroing on the runner
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from consort_engine.kv.block_manager import BlockManager
from consort_engine.config import EngineConfig
from consort_engine.text.guided import advance, grammar_prefix
from consort_engine.kv.sequence import ScheduledBatch, Sequence
from consort_engine.spec.draft_plan import acceptance_rate, plan_drafts, probe_interval
from consort_engine.spec.speculative import propose_ngram, typical_accepted
from consort_engine.spec.step_cost import StepCost

# The acceptance estimate (draft_plan.py): before anything was verified the engine assumes drafts pay
# (so drafting starts and gets measured); a sequence's own counts sit on PRIOR_WEIGHT pseudo-tries of
# the engine's recent rate, and decay per observation (a sequence's latest windows count most).
PRIOR_ACCEPTANCE, ENGINE_PRIOR_WEIGHT, PRIOR_WEIGHT = 0.7, 4.0, 2.0
SEQ_DECAY, ENGINE_DECAY = 0.8, 0.99
# MTP drafts cost a pass and a verify row to see: a sequence the plan keeps from drafting drafts one
# token every PROBE_EVERY steps while its drafts look sure, less often as they look worse (draft_plan.py).
PROBE_EVERY, PROBE_MAX = 16, 256


class SpecDecoder:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 propose_ngram: Callable[..., list[int]] = propose_ngram) -> None:
        self.propose_ngram = propose_ngram
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.enabled = config.speculative != "off"
        self.k = config.num_speculative_tokens if self.enabled else 0
        # ngram, or mtp (the engine sets it when the checkpoint's MTP block loaded): then propose()
        # reserves the window with placeholder tokens that draft_mtp() replaces with the block's drafts.
        self.drafter = "ngram"
        self.tool_trigger_ids = frozenset(config.tool_trigger_ids)
        self.num_draft_tokens = 0        # proposed / accepted by verification, cumulative
        self.num_accepted_tokens = 0
        self.num_drafts = 0              # verify windows (mean accepted run: num_accepted_tokens / num_drafts)
        self.num_held_decodes = 0        # eligible decodes the policy kept from drafting (the plan said 0)
        # Where drafting pays (policy goodput): the step cost the engine measured at warm-up (None: not
        # measured, every eligible decode drafts up to K) and the engine's recent acceptance counts.
        self.cost: StepCost | None = None
        self.recent_hits = self.recent_tries = 0.0
        # Pool slots that held rejected draft K/V inside kept blocks: zeroed after the commit, so
        # stale K/V can never be read (or shared through the prefix cache).
        self.stale_slots: list[int] = []

    # ------------------------------------------------------------------ proposal
    def eligible(self, seq: Sequence) -> bool:
        """Greedy requests verify by exact argmax equality, sampled ones by typical acceptance (when
        spec_typical_tau > 0); requests asking for logprobs, or whose penalties depend on the tokens
        before each row (repetition, frequency, presence, logit_bias), do not speculate. Guided
        (structured output) requests speculate with n-gram drafts: their drafts are checked against
        the grammar here (MTP drafts exist only after scheduling), their verify rows masked each at
        its own position (engine._sample), and sampled ones run typical acceptance over those masked
        rows (the token drawn at the first refusal is legal after the kept drafts)."""
        sp = seq.sampling
        guided = sp.guided is not None or seq.matcher is not None
        return not (sp.logprobs is not None or sp.penalized or not seq.speculate
                    or (guided and self.drafter != "ngram")
                    or (not sp.greedy and self.config.spec_typical_tau <= 0))

    def plan(self, decodes: list[Sequence]) -> dict[int, int] | None:
        """Draft lengths (seq_id -> 0..K) for this step's eligible decodes: those that maximise expected
        tokens per second under the measured step cost (draft_plan.py). None: every one may draft K."""
        if self.cost is None or self.config.spec_policy != "goodput":
            return None
        candidates = [s for s in decodes if self.eligible(s)]
        prior = self._prior()
        rates = [acceptance_rate(s.draft_hits, s.draft_tries, prior, PRIOR_WEIGHT) for s in candidates]
        return {s.seq_id: k for s, k in zip(candidates, plan_drafts(rates, self.k, len(decodes), self.cost))}

    def _prior(self) -> float:
        """The engine's recent acceptance: what a sequence's own counts start from."""
        return acceptance_rate(self.recent_hits, self.recent_tries, PRIOR_ACCEPTANCE, ENGINE_PRIOR_WEIGHT)

    def propose(self, seq: Sequence, budget: int, limit: int | None = None) -> int:
        """Append up to K (or the plan's `limit`) draft tokens to a decode's window; how many were
        appended. A draft never runs past max_tokens or the context, and never needs a block the pool
        does not have free right now (speculation does not preempt anyone). A decode the plan keeps
        from drafting still has its acceptance watched: the n-gram draft it would have made is noted
        for observe_shadow, and an MTP sequence drafts one token now and then (probe_interval)."""
        seq.shadow_draft = -1
        if not self.eligible(seq):
            return 0
        k = self.k if limit is None else limit
        if k == 0:
            self.num_held_decodes += 1
            seq.steps_since_draft += 1
            if self.drafter == "ngram":
                shadow = self.propose_ngram(seq.token_ids, 1, packed=seq.packed_tokens)
                seq.shadow_draft = shadow[0] if shadow else -1
                return 0
            rate = acceptance_rate(seq.draft_hits, seq.draft_tries, self._prior(), PRIOR_WEIGHT)
            if seq.steps_since_draft < probe_interval(rate, PROBE_EVERY, PROBE_MAX):
                return 0
            k = 1
        sp = seq.sampling
        k = min(k, budget, sp.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
        if k <= 0:
            return 0
        if self.drafter == "mtp":
            draft = [seq.token_ids[-1]] * k if seq.mtp_hidden is not None else []
        else:
            draft = self.propose_ngram(seq.token_ids, k, packed=seq.packed_tokens)
            if draft and seq.matcher is not None:    # cut at the first token the grammar refuses
                draft = draft[:grammar_prefix(seq.matcher, draft)]
        if not draft:
            return 0
        # Free blocks must cover the whole window: then this decode cannot trigger a preemption
        # (which could pick seq itself and would requeue it with the drafts in its tokens).
        if self.block_manager.slots_needed(seq, 1 + len(draft)) > self.block_manager.num_free_blocks:
            return 0
        seq.token_ids.extend(draft)
        seq.steps_since_draft = 0
        return len(draft)

    def draft_mtp(self, batch: ScheduledBatch, runner: Any) -> None:
        """Run the MTP pass over every batch sequence's rows kept from its last step (their K/V in the
        block's own layer) and write the drafts into the verify windows' placeholder tokens."""
        from consort_engine.model.step_inputs import MTPRows
        items, targets = [], []
        for i, seq in enumerate(batch.seqs):
            k = batch.num_draft[i] if batch.num_draft else 0
            kept = seq.num_computed_tokens - seq.mtp_start
            if seq.mtp_hidden is None or not 0 < kept <= seq.mtp_hidden.shape[0]:
                continue     # nothing kept (or preempted since): the placeholders stay, verify rejects them
            tokens = seq.token_ids[seq.mtp_start + 1: seq.num_computed_tokens + 1]
            items.append(MTPRows(tokens, seq.mtp_hidden, seq.mtp_start, seq.block_table, k))
            targets.append((seq, k))
            seq.mtp_hidden = None
        for (seq, k), draft in zip(targets, runner.mtp_draft(items)):
            if k:
                seq.token_ids[-k:] = draft

    @staticmethod
    def keep_hidden(batch: ScheduledBatch, runner: Any) -> None:
        """Each sequence's normed hidden rows of this step, for the next step's MTP pass."""
        hidden = runner.last_hidden
        for seq, (a, b) in zip(batch.seqs, runner.last_item_rows):
            seq.mtp_hidden, seq.mtp_start = hidden[a:b], seq.num_computed_tokens

    # ------------------------------------------------------------------ verification
    def typical_window(self, seq: Sequence, logits: torch.Tensor, draft: list[int],
                       sample_one: Callable[[torch.Tensor, Sequence], int]) -> list[int]:
        """Row choices for a sampled request's window: drafts kept by typical acceptance, then one
        token sampled with the request's own parameters (seed included) at the first refusal. A
        sampled token that happens to equal the next draft keeps that draft too."""
        k = len(draft)
        probs = torch.softmax(logits.float() / seq.sampling.temperature, dim=-1)
        tau = self.config.spec_typical_tau
        a = 0
        while True:
            a += typical_accepted(probs[a:k], draft[a:], tau)
            token = sample_one(logits[a:a + 1], seq)
            if a < k and token == draft[a]:
                a += 1
                continue
            return draft[:a] + [token] * (k + 1 - a)   # rows past the refusal are never read

    def accept(self, seq: Sequence, targets: list[int]) -> list[int]:
        """Verify a window: cut the k drafts from seq's tokens and return the tokens to emit, the
        longest draft prefix equal to the model's own choices (targets, one per row) plus one token
        of the model's own, unless the run crossed a tool trigger: it ends there."""
        k = len(targets) - 1
        draft = seq.token_ids[-k:]
        del seq.token_ids[-k:]
        accepted = 0
        while accepted < k and draft[accepted] == targets[accepted]:
            accepted += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.num_drafts += 1
        self._observe(seq, accepted, accepted + (accepted < k))
        cut = next((p for p in range(accepted) if draft[p] in self.tool_trigger_ids), None)
        return draft[:cut + 1] if cut is not None else draft[:accepted] + targets[accepted:accepted + 1]

    def observe_shadow(self, seq: Sequence, token: int) -> None:
        """A decode that did not draft emitted `token`: did the draft it would have made (its first
        token) get it right? For a sampled request a match is stricter than typical acceptance."""
        if seq.shadow_draft >= 0:
            self._observe(seq, int(token == seq.shadow_draft), 1)
            seq.shadow_draft = -1

    def _observe(self, seq: Sequence, hits: int, tries: int) -> None:
        seq.draft_hits = seq.draft_hits * SEQ_DECAY + hits
        seq.draft_tries = seq.draft_tries * SEQ_DECAY + tries
        self.recent_hits = self.recent_hits * ENGINE_DECAY + hits
        self.recent_tries = self.recent_tries * ENGINE_DECAY + tries

    @staticmethod
    def commit_token(seq: Sequence, token: int) -> None:
        """A verify window's emitted token, in order: a guided sequence's matcher advances over the
        accepted tokens only (one-row steps advance it in engine._sample)."""
        if seq.matcher is not None:
            advance([seq.matcher], [token])

    # ------------------------------------------------------------------ rollback
    def release(self, seq: Sequence, window_end: int) -> None:
        """After a kept window commits: blocks past the kept tokens go back to the pool, and the
        slots rejected drafts wrote inside kept blocks (up to window_end) are marked stale."""
        bm = self.block_manager
        bs = bm.block_size
        computed = seq.num_computed_tokens
        assert computed == seq.num_tokens - 1, "write pointer must sit at the last kept token"
        bm.rollback(seq, seq.num_tokens)
        kept = len(seq.block_table) * bs
        self.stale_slots += [seq.block_table[p // bs] * bs + p % bs for p in range(computed, min(window_end, kept))]

    def commit(self, batch: ScheduledBatch, before: list[int] | None, runner: Any) -> None:
        """After postprocess: a hybrid model's mixer state advanced to the last kept token of each
        verify window (before: computed tokens per seq ahead of the commit), stale slots zeroed."""
        if before is not None:
            runner.commit_windows({s.state_slot: s.num_computed_tokens - b
                                   for s, b, k in zip(batch.seqs, before, batch.num_draft)
                                   if k and s.state_slot >= 0})
        if self.stale_slots:
            runner.zero_slots(self.stale_slots)
            self.stale_slots = []

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """mode as configured; drafter ngram or mtp; state on, fallback (mtp asked for, the checkpoint has
        no MTP block or runs tensor parallel: n-gram drafts instead) or off."""
        mode = self.config.speculative
        state = "off" if mode == "off" else ("fallback" if mode == "mtp" and self.drafter != "mtp" else "on")
        proposed, accepted = self.num_draft_tokens, self.num_accepted_tokens
        return {"mode": mode, "state": state, "drafter": self.drafter if mode != "off" else None,
                "policy": self.config.spec_policy if mode != "off" else None,
                "drafts": self.num_drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
                "held_decodes": self.num_held_decodes,
                "acceptance_rate": accepted / proposed if proposed else None}
