"""A request's life inside one engine: tokens, KV bookkeeping and sampling parameters.

The scheduler and block manager mutate these; the model runner only reads them.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from consort_engine.text.guided import GuidedSpec
    from consort_engine.kv.state_pool import SwappedState

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"      # holds KV blocks, scheduled every step
    FINISHED = "finished"    # stopped (eos, length, stop string, abort); blocks released


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 = off
    typical_p: float = 1.0         # 1.0 = off
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None    # None = no logprobs; k = chosen token + top-k
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's logprob (and rank) + top-k
    # Logits processors (OpenAI / vLLM semantics); the neutral values leave the logits untouched.
    presence_penalty: float = 0.0  # - p once for every token already generated
    frequency_penalty: float = 0.0  # - f per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # prompt + generated tokens: positive logits / r, negative * r
    min_p: float = 0.0             # drop tokens below min_p * the top token's probability
    logit_bias: dict[int, float] = field(default_factory=dict)
    guided: "GuidedSpec | None" = None  # structured output: the grammar the text must match

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids for the per-token membership test (a list scan was O(ids) per token)."""
        return frozenset(self.stop_token_ids)

    @property
    def penalized(self) -> bool:
        """Whether logit_bias or a penalty changes this request's logits."""
        return bool(self.logit_bias) or (self.presence_penalty, self.frequency_penalty,
                                         self.repetition_penalty) != (0.0, 0.0, 1.0)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1.. (token 0 has nothing before it), computed during prefill and
    appended chunk by chunk: each token's own logprob and rank (1 = the most likely), and the top-k
    alternatives (k = sampling.prompt_logprobs) as (ids, logprobs), best first."""
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def extend(self, other: "PromptLogprobs") -> None:
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


@dataclass
class Sequence:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0                       # higher runs first
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None           # monotonic seconds by which the first token must be out
    adapter: str | None = None              # LoRA adapter name; part of the prefix-cache key and batch grouping
    cache_salt: str | None = None           # part of the prefix-cache key: different salts (tenants, vLLM's
                                            # cache_salt) never share blocks; a hit reveals nobody else's prompt
    seq_id: int = field(default_factory=lambda: next(_ids))

    token_ids: list[int] = field(init=False)          # prompt + generated
    num_computed_tokens: int = 0                       # tokens whose K/V sit in the pool
    num_cached_tokens: int = 0                         # of those, reused from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)  # logical block i -> physical block id
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None                   # stop | length | abort
    num_preemptions: int = 0
    output_logprobs: list = field(default_factory=list)  # per generated token, when requested
    prompt_logprobs: PromptLogprobs | None = None      # when sampling.prompt_logprobs asks (set at init)
    first_token_time: float | None = None
    speculate: bool = True                             # False once a tool trigger was emitted
    # Speculation policy (spec/draft_plan.py): decayed counts of this sequence's verified draft tokens, the
    # n-gram draft of a step that did not draft (checked against the token it emits; -1: none), steps since
    # the last draft.
    draft_hits: float = 0.0
    draft_tries: float = 0.0
    shadow_draft: int = -1
    steps_since_draft: int = 0
    matcher: Any = field(default=None, repr=False)     # xgrammar GrammarMatcher of a guided request
    packed_tokens: bytearray = field(default_factory=bytearray, repr=False)  # committed tokens, for n-gram lookup
    # MTP drafting: the target's normed hidden states of the last step that ran this sequence (rows from
    # position mtp_start on); the next step's MTP pass fuses the kept ones with the tokens after them.
    mtp_hidden: object = field(default=None, repr=False)
    mtp_start: int = 0
    state_slot: int = -1                               # hybrid models: row of the conv/SSM state pools (state_pool.py)
    swapped: "SwappedState | None" = field(default=None, repr=False)  # hybrids, preempted: KV + state in host memory
    penalty_counts: Any = field(default=None, repr=False)  # sampler.TokenCounts of a penalized sequence

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobs()

    def finish(self, reason: str) -> None:
        """Ends the sequence (stop | length | abort) and drops what the sampler kept for it."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.penalty_counts = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: such a sequence runs its whole prompt
        through the model (no prefix-cache hits, which would skip positions)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens


@dataclass
class ScheduledBatch:
    """One engine step: the scheduler's output and the model runner's input.

    For each sequence, `num_new_tokens[i]` tokens starting at `seqs[i].num_computed_tokens`
    are run through the model this step (a prefill chunk, or 1 for decode; 1 + K for
    spec_verify). Blocks covering them are already allocated in `seq.block_table`.
    `sample[i]` says whether the step ends at the sequence's last token (a token is sampled);
    a non-final prefill chunk is computed but not sampled.
    `num_draft[i]` (spec_verify) counts the draft tokens at the end of sequence i's window: they sit
    at the end of `seq.token_ids` until the step commits, and each of the 1 + num_draft[i] rows is
    sampled (empty list: no drafts in this step).
    `checkpoints[i]` (hybrids with prefix caching): (tokens into sequence i's prefill chunk, checkpoint
    row) where the mixers' state is saved for later prefix hits (BlockManager.plan_checkpoints).
    """
    seqs: list[Sequence]
    num_new_tokens: list[int]
    sample: list[bool]
    mode: str = "decode"                       # prefill | decode | mixed | spec_verify
    preempted: list[Sequence] = field(default_factory=list)
    num_draft: list[int] = field(default_factory=list)
    checkpoints: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def rows_sampled(self, i: int) -> int:
        """Logit rows sequence i contributes: 0 (prefill chunk), 1, or 1 + drafts."""
        if not self.sample[i]:
            return 0
        return 1 + (self.num_draft[i] if self.num_draft else 0)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)
