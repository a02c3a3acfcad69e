"""Paged-KV block manager: one fixed pool per engine, ref-counted blocks, prefix cache.

The pool never grows. A block is either referenced by running sequences (ref > 0), free and
empty, or free but still holding a reusable prefix ("cached"). Cached blocks are evicted
least-recently-freed first, and only when no empty block is left.

Prefix cache: every FULL block whose K/V has been computed gets a hash chained over its
parent: consort_common/block_hash.block_hash(parent hash, block token ids, namespace, adapter, salt), the one
definition routers compute too. The namespace (specialist name), the adapter and the sequence's
cache salt (its tenant, vLLM's cache_salt) are in every block's key, so two adapters never share
K/V and a cache hit tells nobody about another tenant's prompts. A lookup hit is verified, not
trusted: the candidate's token ids, adapter, salt and parent must match exactly.
"Parent" is compared through content ids: blocks holding the same verified prefix share one
content id, a new prefix gets a fresh one, and ids are never reused. Verifying the parent's
content id (not just its hash) makes a forced hash collision harmless for the whole chain.

Registered and evicted blocks are published as block events (kv/events.py). With a KV tier
(kv/tier.py), a cached block evicted from the pool is queued for the tier (`take_offloads`: the
engine copies its K/V, and a hybrid's state checkpoint at its end, out before the step reuses the
block), and a prompt's blocks past the pool's hits are looked up in the tier at admission; each one
found is registered at once and queued to be copied into its new pool block before the step runs
(`take_onloads`).

Hybrid (attention + Mamba2) models: a cached block's K/V is only reusable together with the mixers'
conv/SSM state at the same token. With `checkpoints` (a count of state checkpoint rows the runner
holds), the engine asks `plan_checkpoints` which block boundaries of each prefill chunk to snapshot;
the snapshot is attached to the block ending there when that block is registered (the findable
entry for its hash: one content id, so one prefix). A hybrid hit stops at the deepest matched block
that carries a checkpoint (`hybrid_hit_blocks`: in the pool a row, in the tier a state saved with the
block, which is loaded into a row), and admission queues (state slot, checkpoint) for the engine to copy
before the step runs (`take_state_restores`). A checkpoint leaves with its block (eviction), or,
when all rows are taken, the one on the least recently freed cached block goes; checkpoints of
blocks that running sequences hold are never taken, so a restore always reads the state saved at
exactly that boundary.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from consort_common.block_hash import ROOT, block_hash
from consort_engine.kv.events import KVEventLog
from consort_engine.kv.sequence import Sequence
from consort_engine.kv.state_pool import StateSlots

# (parent hash, block token ids, namespace, adapter, salt) -> hash; tests pass colliding ones
HashFn = Callable[[Hashable, tuple[int, ...], str, "str | None", "str | None"], Hashable]

_NO_CONTENT = 0   # content id of "no block" (root parent) and of unregistered blocks


class TierLookup(Protocol):
    """What the block manager asks of a KV tier (kv/tier.py)."""
    enabled: bool

    def holds(self, h: bytes) -> bool: ...

    def load(self, h: bytes) -> bytes | None: ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def hybrid_hit_blocks(has_state: list[bool]) -> int:
    """How many of a hybrid's matched leading blocks a hit may reuse: up to the deepest one whose
    mixers' state at its last token is available (the prefill continues from that state)."""
    return max((i + 1 for i, ok in enumerate(has_state) if ok), default=0)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: str = "",
                 enable_caching: bool = True, hash_fn: HashFn = block_hash, state_slots: int = 0,
                 events: KVEventLog | None = None, tier: TierLookup | None = None,
                 checkpoints: int = 0, checkpoint_every: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.enable_caching = enable_caching
        self._hash_fn = hash_fn
        self.events = events
        self.tier = tier if enable_caching else None
        # (evicted block, hash, checkpoint row or -1): copy to the tier
        self._offloads: list[tuple[int, Hashable, int]] = []
        # (pool block, K/V bytes, checkpoint row or -1, state bytes) found in the tier: copy in
        self._onloads: list[tuple[int, bytes, int, bytes]] = []
        # Hybrid models: a conv/SSM state slot per running sequence, taken and given back with its blocks.
        self.state_slots = StateSlots(state_slots) if state_slots else None
        # Hybrids with prefix caching: state checkpoint rows (see module doc); every: tokens between them.
        self.checkpoints = checkpoints if enable_caching and state_slots else 0
        self.checkpoint_every = max(block_size, checkpoint_every // block_size * block_size)
        self._ckpt_free: list[int] = list(range(self.checkpoints - 1, -1, -1))
        self._ckpt: list[int] = [-1] * num_blocks              # block -> checkpoint row of the state at its end
        self._ckpt_pending: dict[int, dict[int, int]] = {}      # seq_id -> {block index: row written this step}
        self._restores: list[tuple[int, int]] = []              # (state slot, checkpoint row): copy in

        # Per-block state, indexed by physical block id.
        self.ref_count: list[int] = [0] * num_blocks
        self._hash: list[Hashable | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._adapter: list[str | None] = [None] * num_blocks
        self._salt: list[str | None] = [None] * num_blocks
        self._content: list[int] = [_NO_CONTENT] * num_blocks
        self._parent_content: list[int] = [_NO_CONTENT] * num_blocks
        self._content_ids = itertools.count(1)

        # Free blocks: empty ones first (a stack), then cached ones in LRU order (oldest first).
        self._free_empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[Hashable, int] = {}

        # Per running sequence: hashes of its leading blocks that are registered in the cache.
        self._seq_hashes: dict[int, list[Hashable]] = {}

        # vLLM semantics, in tokens: queried = prompt tokens looked up, hits = tokens reused.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # The tier, in tokens (vLLM's external_prefix_cache_*): looked up past the pool's hits, found.
        self.tier_queries = 0
        self.tier_hits = 0

    # ---------------------------------------------------------------- pool state
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ---------------------------------------------------------------- prefix lookup
    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[Hashable]]:
        """Cached blocks reusable for seq's leading full blocks, and their hashes.

        The block holding the last token is never reused: at least one token must run
        through the model so that there are logits to sample from. A sequence that still needs
        its prompt logprobs reuses nothing: they come from the logits at every prompt position.
        """
        if not self.enable_caching or seq.needs_prompt_logprobs or seq.swapped is not None:
            return [], []
        bs = self.block_size
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // bs
        blocks: list[int] = []
        hashes: list[Hashable] = []
        parent_hash: Hashable = ROOT
        parent_content = _NO_CONTENT
        for i in range(max_blocks):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            h = self._hash_fn(parent_hash, block_tokens, self.namespace, seq.adapter, seq.cache_salt)
            b = self._by_hash.get(h)
            if b is None or not self._same_content(b, block_tokens, seq, parent_content):
                break
            blocks.append(b)
            hashes.append(h)
            parent_hash, parent_content = h, self._content[b]
        if self.state_slots is not None:     # hybrids: the KV is reusable only up to a saved state
            n = hybrid_hit_blocks([self._ckpt[b] >= 0 for b in blocks])
            del blocks[n:], hashes[n:]
        return blocks, hashes

    def _same_content(self, block: int, tokens: tuple[int, ...], seq: Sequence, parent_content: int) -> bool:
        return (self._tokens[block] == tokens and self._adapter[block] == seq.adapter
                and self._salt[block] == seq.cache_salt and self._parent_content[block] == parent_content)

    # ---------------------------------------------------------------- allocation
    def _blocks_needed(self, seq: Sequence, hits: list[int], num_lookahead: int) -> int:
        """Blocks that must come out of the free pool to admit seq: fresh blocks plus cached
        hits that are currently free (taking them also shrinks the free pool)."""
        fresh = blocks_for(seq.num_tokens + num_lookahead, self.block_size) - len(hits)
        free_hits = sum(1 for b in hits if self.ref_count[b] == 0)
        return fresh + free_hits

    def blocks_needed_to_allocate(self, seq: Sequence, num_lookahead: int = 0) -> int:
        hits, _ = self._match_prefix(seq)
        return self._blocks_needed(seq, hits, num_lookahead)

    def can_allocate(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        return self.blocks_needed_to_allocate(seq, num_lookahead) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Give a waiting seq blocks for all its tokens (+ lookahead), reusing cached prefix blocks.

        Sets seq.num_cached_tokens and seq.num_computed_tokens to the reused prefix length.
        """
        if not self.try_allocate(seq, num_lookahead):
            raise RuntimeError(f"not enough free KV blocks for seq {seq.seq_id}")

    def try_allocate(self, seq: Sequence, num_lookahead: int = 0, reserve: int = 0) -> bool:
        """allocate() if the blocks for tokens + lookahead (+ `reserve` spare free blocks) are
        there; one prefix lookup for both the check and the allocation."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        hits, hashes = self._match_prefix(seq)
        if self._blocks_needed(seq, hits, num_lookahead) + reserve > self.num_free_blocks:
            return False
        if self.state_slots is not None:
            if not self.state_slots.num_free:
                return False
            seq.state_slot = self.state_slots.take()
        for b in hits:     # take hits before allocating, so eviction cannot pick them
            if self.ref_count[b] == 0:
                del self._free_cached[b]
            self.ref_count[b] += 1
        table = list(hits)
        for _ in range(blocks_for(seq.num_tokens + num_lookahead, self.block_size) - len(hits)):
            table.append(self._take_free_block())
        seq.block_table = table
        self._seq_hashes[seq.seq_id] = hashes
        loaded = self._load_from_tier(seq) if self.tier is not None and self.tier.enabled else 0
        if hashes and self.checkpoints:      # the state at the hit's last block, pool's or tier's
            self._restores.append((seq.state_slot, self._ckpt[table[len(hashes) - 1]]))
        seq.num_cached_tokens = len(hashes) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens - loaded
        return True

    def _load_from_tier(self, seq: Sequence) -> int:
        """Extend seq's reused prefix past the pool's hits with blocks the tier holds: each is
        registered now and queued for copying into its pool block before the step runs. A hybrid's
        hit ends at the deepest found block saved with its state (not one the pool already holds: its
        row could not be pinned), which is loaded into a checkpoint row for the restore.
        Adapter blocks never go to the tier (an adapter's weights can change under its name); a
        swapped-out sequence resumes from its own copy. Returns the tokens found."""
        if seq.adapter is not None or seq.needs_prompt_logprobs or seq.swapped is not None:
            return 0
        bs = self.block_size
        hashes = self._seq_hashes[seq.seq_id]
        start, max_blocks = len(hashes), (seq.num_tokens - 1) // bs
        self.tier_queries += (max_blocks - start) * bs
        found: list[tuple[bytes, bytes, bytes]] = []      # (hash, K/V, state) of blocks start, start + 1, ...
        parent_hash = hashes[-1] if hashes else ROOT
        for i in range(start, max_blocks):
            h = self._hash_fn(parent_hash, tuple(seq.token_ids[i * bs:(i + 1) * bs]), self.namespace,
                              seq.adapter, seq.cache_salt)
            got = self.tier.load(h) if isinstance(h, bytes) else None
            if got is None:
                break
            found.append((h, *got))
            parent_hash = h
        row = -1
        if self.state_slots is not None:
            del found[hybrid_hit_blocks([bool(st) and h not in self._by_hash for h, _, st in found]):]
            row = self._take_checkpoint() if found else -1
            if row < 0:
                found = []
        for k, (h, kv, state) in enumerate(found):
            i = start + k
            b = seq.block_table[i]
            last = row >= 0 and k == len(found) - 1
            self._onloads.append((b, kv, row if last else -1, state if last else b""))
            block_tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            stored = self._register(b, h, block_tokens, seq, self._content[seq.block_table[i - 1]] if i else _NO_CONTENT)
            if stored and self.events is not None:
                self.events.record("stored", "pool", [h])
            if last:
                self._ckpt[b] = row
            hashes.append(h)
        self.tier_hits += len(found) * bs
        return len(found) * bs

    def take_offloads(self) -> list[tuple[int, Hashable, int]]:
        """(pool block, hash, checkpoint row or -1) of the cached blocks evicted since the last call,
        for the tier; the caller copies them (and the row: the state at the block's end) out before
        the next forward or tier load overwrites them."""
        out, self._offloads = self._offloads, []
        return out

    def take_state_restores(self) -> list[tuple[int, int]]:
        """(state slot, checkpoint row) of the hybrid hits admitted since the last call; the caller
        copies each row into its slot before the next forward (the hit's blocks pin the row)."""
        out, self._restores = self._restores, []
        return out

    def plan_checkpoints(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Which block boundaries of seq's next prefill chunk get a state checkpoint: (tokens into the
        chunk, checkpoint row) for every multiple of checkpoint_every and the prompt's last full-block
        boundaries (a repeat or a continuation of this prompt hits there). The rows are attached to
        their blocks when those are registered. A boundary that finds no row is skipped: a later hit
        stops at an earlier checkpoint, it never reads a wrong state."""
        if not self.checkpoints:
            return []
        bs = self.block_size
        start = seq.num_computed_tokens
        prompt_ends = {(seq.num_prompt_tokens - 1) // bs * bs, seq.num_prompt_tokens // bs * bs}
        at = [p for p in range((start // bs + 1) * bs, start + num_new_tokens + 1, bs)
              if p % self.checkpoint_every == 0 or p in prompt_ends]
        pending = self._ckpt_pending.setdefault(seq.seq_id, {})
        cuts = []
        for p in sorted(at, key=lambda p: (p not in prompt_ends, p)):   # when rows run short: the prompt's end first
            row = self._take_checkpoint()
            if row < 0:
                break
            pending[p // bs - 1] = row
            cuts.append((p - start, row))
        return sorted(cuts)

    def _take_checkpoint(self) -> int:
        """A free checkpoint row, else the one on the least recently freed cached block; -1: every
        row belongs to blocks in use or to this step's snapshots."""
        if self._ckpt_free:
            return self._ckpt_free.pop()
        for b in self._free_cached:
            row = self._ckpt[b]
            if row >= 0:
                self._ckpt[b] = -1
                return row
        return -1

    def _attach_checkpoint(self, seq: Sequence, i: int, h: Hashable) -> None:
        """Give the state snapshot taken at the end of seq's block i (if any) to the findable block of
        hash h: after _register it holds the same content (the same prefix), so the same state."""
        pending = self._ckpt_pending.get(seq.seq_id)
        row = pending.pop(i, -1) if pending else -1
        if row < 0:
            return
        owner = self._by_hash[h]
        if self._ckpt[owner] < 0:
            self._ckpt[owner] = row
        else:                       # the same prefix was computed twice: keep the first state
            self._ckpt_free.append(row)

    def take_onloads(self) -> list[tuple[int, bytes, int, bytes]]:
        """(pool block, K/V bytes, checkpoint row or -1, state bytes) found in the tier since the last
        call; the caller copies them in (after take_offloads' copies: a block or row may be freed and
        refilled in one step) and before take_state_restores' copies read the rows."""
        out, self._onloads = self._onloads, []
        return out

    def forget_adapter(self, adapter: str) -> int:
        """Drop the cached prefixes computed with an adapter (it was unloaded: a later adapter of the
        same name must not reuse them). Only free cached blocks can hold them: callers unload an
        adapter when no sequence uses it. Returns how many blocks were dropped."""
        dropped = [b for b in self._free_cached if self._adapter[b] == adapter]
        for b in dropped:
            del self._free_cached[b]
            self._evict(b)
            self._free_empty.append(b)
        return len(dropped)

    def _take_free_block(self) -> int:
        if self._free_empty:
            b = self._free_empty.pop()
        else:
            b, _ = self._free_cached.popitem(last=False)   # least recently freed
            h = self._hash[b]
            if self._tier_wants(b, h) and all(b != ob for ob, *_ in self._onloads):
                self._offloads.append((b, h, self._ckpt[b]))
            self._evict(b)
        self.ref_count[b] = 1
        return b

    def _evict(self, b: int) -> None:
        if self._ckpt[b] >= 0:      # the state goes with its block
            self._ckpt_free.append(self._ckpt[b])
            self._ckpt[b] = -1
        h = self._hash[b]
        if h is not None and self._by_hash.get(h) == b:
            del self._by_hash[h]
            if self.events is not None:
                self.events.record("removed", "pool", [h])
        self._hash[b] = None
        self._tokens[b] = None
        self._adapter[b] = None
        self._salt[b] = None
        self._content[b] = _NO_CONTENT
        self._parent_content[b] = _NO_CONTENT

    # ---------------------------------------------------------------- growth
    def slots_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers num_computed_tokens + num_new_tokens."""
        need = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return need if need > 0 else 0

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self.slots_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        need = self.slots_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to extend seq {seq.seq_id}")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    # ---------------------------------------------------------------- prefix registration
    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose K/V is now computed, so later requests can reuse them.

        Called after each step; does nothing unless a block boundary was crossed.
        """
        if not self.enable_caching:
            return
        hashes = self._seq_hashes.get(seq.seq_id)
        if hashes is None:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        if num_full <= len(hashes):
            return
        table = seq.block_table
        tokens = seq.token_ids
        stored = []
        for i in range(len(hashes), num_full):
            parent_hash = hashes[i - 1] if i else ROOT
            parent_content = self._content[table[i - 1]] if i else _NO_CONTENT
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            h = self._hash_fn(parent_hash, block_tokens, self.namespace, seq.adapter, seq.cache_salt)
            if self._register(table[i], h, block_tokens, seq, parent_content):
                stored.append(h)
            if self.checkpoints:
                self._attach_checkpoint(seq, i, h)
            hashes.append(h)
        if stored and self.events is not None:
            self.events.record("stored", "pool", stored)

    def _register(self, b: int, h: Hashable, block_tokens: tuple[int, ...], seq: Sequence, parent_content: int) -> bool:
        """Record block b's content; True when h is newly findable in the cache (a `stored` event)."""
        self._hash[b] = h
        self._tokens[b] = block_tokens
        self._adapter[b] = seq.adapter
        self._salt[b] = seq.cache_salt
        self._parent_content[b] = parent_content
        other = self._by_hash.get(h)
        if other is not None and other != b and self._same_content(other, block_tokens, seq, parent_content):
            # Same prefix computed twice (admitted in the same step): same content id, so
            # chains through either copy verify. Keep the existing entry.
            self._content[b] = self._content[other]
            return False
        # New content, or a genuine hash collision: the newest block takes the slot.
        if other is not None and other != b and self._ckpt[other] >= 0:   # unfindable now: its state is of no use
            self._ckpt_free.append(self._ckpt[other])
            self._ckpt[other] = -1
        self._content[b] = next(self._content_ids)
        self._by_hash[h] = b
        return other is None

    # ---------------------------------------------------------------- release
    def free(self, seq: Sequence) -> None:
        """Drop seq's references (cancel, finish or preempt). Computed full blocks stay cached."""
        self.cache_computed_blocks(seq)
        # Tail first: with LRU eviction the end of a prefix goes before its beginning.
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)
        for row in self._ckpt_pending.pop(seq.seq_id, {}).values():   # snapshots of blocks never computed
            self._ckpt_free.append(row)
        if self.state_slots is not None and seq.state_slot >= 0:
            self.state_slots.give(seq.state_slot)
            seq.state_slot = -1

    def _release(self, b: int) -> None:
        rc = self.ref_count[b] - 1
        assert rc >= 0, f"block {b} released more often than referenced"
        self.ref_count[b] = rc
        if rc == 0:
            if self._content[b] != _NO_CONTENT:
                self._free_cached[b] = None
            else:
                self._free_empty.append(b)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child (same tokens as parent so far) share parent's computed full blocks.

        The partial tail block is not shared (no copy-on-write): child recomputes it.
        """
        assert not child.block_table and child.token_ids[:parent.num_tokens] == parent.token_ids
        assert self.state_slots is None, "fork shares KV without the matching state: not for hybrid models"
        bs = self.block_size
        shared = min(parent.num_computed_tokens, parent.num_tokens - 1) // bs
        fresh = blocks_for(child.num_tokens, bs) - shared
        if fresh > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to fork seq {parent.seq_id}")
        self.cache_computed_blocks(parent)
        table = parent.block_table[:shared]
        for b in table:
            self.ref_count[b] += 1
        for _ in range(fresh):
            table.append(self._take_free_block())
        child.block_table = table
        child.num_computed_tokens = shared * bs
        child.num_cached_tokens = shared * bs
        parent_hashes = self._seq_hashes.get(parent.seq_id, [])
        self._seq_hashes[child.seq_id] = list(parent_hashes[:shared])

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep K/V blocks for the first num_tokens tokens only; free the tail blocks.

        Speculative-decoding seam: the caller truncates seq.token_ids / num_computed_tokens.
        Rejected draft tokens are never registered (registration follows acceptance), so the
        kept part never cuts into a registered block.
        """
        hashes = self._seq_hashes.get(seq.seq_id, [])
        assert num_tokens >= len(hashes) * self.block_size, "rollback into a registered prefix block"
        keep = blocks_for(num_tokens, self.block_size)
        for b in reversed(seq.block_table[keep:]):
            self._release(b)
        del seq.block_table[keep:]

    def _tier_wants(self, b: int, h: Hashable) -> bool:
        """Whether block b (hash h) goes to the tier: computed without an adapter, and the tier lacks it
        or b carries a state checkpoint (a hybrid's copy with its state serves more hits)."""
        return (self.tier is not None and self.tier.enabled and self._adapter[b] is None and isinstance(h, bytes)
                and (self._ckpt[b] >= 0 or not self.tier.holds(h)))

    def tier_candidates(self) -> list[tuple[int, Hashable, int]]:
        """(block, hash, checkpoint row or -1) of every findable block the tier could take (at shutdown)."""
        return [(b, h, self._ckpt[b]) for h, b in self._by_hash.items() if self._tier_wants(b, h)]

    # ---------------------------------------------------------------- introspection (tests, status)
    def num_registered_blocks(self, seq: Sequence) -> int:
        """Leading blocks of seq registered in the prefix cache (fixed content from now on)."""
        return len(self._seq_hashes.get(seq.seq_id, ()))

    def check_invariants(self, live: list[Sequence]) -> None:
        """Assert pool accounting: every block free xor referenced, refs = table occurrences."""
        refs = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                refs[b] += 1
        assert refs == self.ref_count, "ref counts differ from block-table occurrences"
        free = set(self._free_empty) | set(self._free_cached)
        assert len(free) == self.num_free_blocks, "a block is on a free list twice"
        assert all((self.ref_count[b] == 0) == (b in free) for b in range(self.num_blocks)), "leak"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h and self._content[b] != _NO_CONTENT
        if self.state_slots is not None:
            held = [s.state_slot for s in live if s.block_table]
            assert -1 not in held and len(set(held)) == len(held), "state slot missing or shared"
            assert len(held) + self.state_slots.num_free == self.state_slots.num_slots, "state slot leak"
        rows = [r for r in self._ckpt if r >= 0] + self._ckpt_free
        rows += [r for p in self._ckpt_pending.values() for r in p.values()]
        assert sorted(rows) == list(range(self.checkpoints)), "checkpoint row leaked or shared"
        for b, row in enumerate(self._ckpt):
            assert row < 0 or self._by_hash.get(self._hash[b]) == b, "checkpoint on a block nobody can find"
