"""Property tests of the block manager: any interleaving of allocate / compute / decode / fork /
rollback / free (finish, cancel, preempt) keeps the pool accounting exact and never hands a
sequence a block whose computed contents differ from its own tokens, even with hash functions
that collide on purpose."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from consort_common.block_hash import block_hash
from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.sequence import SamplingParams, Sequence

NUM_BLOCKS = 12
BLOCK_SIZE = 2

tokens_st = st.lists(st.integers(1, 2), min_size=1, max_size=9)   # tiny alphabet: many shared prefixes
adapter_st = st.sampled_from([None, "a"])


class BlockManagerMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(block_hash)

    @initialize()
    def setup(self) -> None:
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, namespace="spec", hash_fn=self.hash_fn)
        # What the "model" wrote into each KV slot. K/V at a position depends on the token there
        # and on everything before it (causal attention), so a slot records the whole prefix.
        self.kv: list[tuple[int, ...] | None] = [None] * (NUM_BLOCKS * BLOCK_SIZE)
        self.live: list[Sequence] = []

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    @rule(tokens=tokens_st, adapter=adapter_st, lookahead=st.integers(0, 2))
    def allocate(self, tokens, adapter, lookahead) -> None:
        seq = Sequence(tokens, SamplingParams(), adapter=adapter)
        expected = self.bm.can_allocate(seq, lookahead)
        free_before = self.bm.num_free_blocks
        assert self.bm.try_allocate(seq, lookahead) == expected
        if not expected:
            assert self.bm.num_free_blocks == free_before and seq.block_table == []
            return
        assert seq.num_computed_tokens == seq.num_cached_tokens < seq.num_tokens
        assert seq.num_cached_tokens % BLOCK_SIZE == 0
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_tokens + lookahead
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data) -> None:
        """Run some uncomputed tokens through the 'model' (a prefill chunk or a decode)."""
        seq = data.draw(st.sampled_from(self.live))
        pending = seq.num_tokens - seq.num_computed_tokens
        if pending == 0:
            return
        n = data.draw(st.integers(1, pending))
        if not self.bm.can_append(seq, n):
            return
        self.bm.append_slots(seq, n)
        start = seq.num_computed_tokens
        for pos in range(start, start + n):
            block = seq.block_table[pos // BLOCK_SIZE]
            # Writing into a block someone else also reads would corrupt their K/V.
            assert self.bm.ref_count[block] == 1, "write into a shared block"
            self.kv[self._slot(seq, pos)] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens += n
        self.bm.cache_computed_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 2))
    def sample(self, data, token) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(1, 2), max_size=3))
    def fork(self, data, extra) -> None:
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(parent.token_ids + extra, SamplingParams(), adapter=parent.adapter)
        try:
            self.bm.fork(parent, child)
        except RuntimeError:
            return
        assert child.num_computed_tokens <= parent.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def rollback(self, data) -> None:
        """Speculative rejection: drop a tail of generated tokens and their blocks."""
        seq = data.draw(st.sampled_from(self.live))
        lo = max(seq.num_prompt_tokens, self.bm.num_registered_blocks(seq) * BLOCK_SIZE)
        if lo > seq.num_tokens:
            return
        keep = data.draw(st.integers(lo, seq.num_tokens))
        self.bm.rollback(seq, keep)
        del seq.token_ids[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, keep)
        assert len(seq.block_table) <= -(-keep // BLOCK_SIZE)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        """Finish, cancel or preempt: all the same to the block manager."""
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == []

    @invariant()
    def accounting(self) -> None:
        self.bm.check_invariants(self.live)
        assert all(rc >= 0 for rc in self.bm.ref_count)
        used = sum(1 for rc in self.bm.ref_count if rc > 0)
        assert self.bm.num_free_blocks + used == NUM_BLOCKS
        assert 0 <= self.bm.num_cached_blocks <= self.bm.num_free_blocks
        assert 0 <= self.bm.prefix_hits <= self.bm.prefix_queries

    @invariant()
    def computed_kv_matches_tokens(self) -> None:
        """Every computed position reads back K/V of its own prefix: reused blocks hold the right
        tokens under the right parent chain."""
        for seq in self.live:
            for pos in range(seq.num_computed_tokens):
                assert self.kv[self._slot(seq, pos)] == tuple(seq.token_ids[:pos + 1]), (seq.seq_id, pos)


def _constant_hash(parent, tokens, namespace, adapter, salt):
    return 0


def _parent_blind_hash(parent, tokens, namespace, adapter, salt):
    return tokens       # same tokens under a different prefix collide


def _two_bucket_hash(parent, tokens, namespace, adapter, salt):
    return sum(tokens) % 2


settings_ = settings(max_examples=100, stateful_step_count=40, deadline=None)

TestRealHash = BlockManagerMachine.TestCase
TestRealHash.settings = settings_


class ConstantHashMachine(BlockManagerMachine):
    hash_fn = staticmethod(_constant_hash)


class ParentBlindHashMachine(BlockManagerMachine):
    hash_fn = staticmethod(_parent_blind_hash)


class TwoBucketHashMachine(BlockManagerMachine):
    hash_fn = staticmethod(_two_bucket_hash)


TestConstantHash = ConstantHashMachine.TestCase
TestConstantHash.settings = settings_
TestParentBlindHash = ParentBlindHashMachine.TestCase
TestParentBlindHash.settings = settings_
TestTwoBucketHash = TwoBucketHashMachine.TestCase
TestTwoBucketHash.settings = settings_
