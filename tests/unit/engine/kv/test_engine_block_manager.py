"""Block manager behaviour on concrete cases: prefix reuse, the last-block rule, adapter and
namespace isolation, forced hash collisions, LRU eviction order, fork and rollback."""
from __future__ import annotations

import pytest

from consort_common.block_hash import block_hash
from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.sequence import SamplingParams, Sequence

BS = 4


def seq_of(tokens, adapter=None) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), adapter=adapter)


def run_to_completion(bm: BlockManager, seq: Sequence) -> None:
    """Allocate, 'compute' every token, register the full blocks."""
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(16, BS, namespace="algo")
    a = seq_of(range(1, 11))                    # 10 tokens: 2 full blocks + 2
    run_to_completion(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 16

    b = seq_of(list(range(1, 9)) + [99, 98, 97])   # shares the first two full blocks
    bm.allocate(b)
    assert b.block_table[:2] == a_blocks[:2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm.prefix_queries == 10 + 11 and bm.prefix_hits == 8
    assert bm.num_cached_blocks == 0               # the hits left the free list
    bm.free(b)
    bm.check_invariants([])


def test_concurrent_sharing_bumps_ref_counts():
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 10))
    run_to_completion(bm, a)
    b = seq_of(range(1, 10))
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_count[x] for x in b.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]     # the tail block is private
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])


def test_block_holding_the_last_prompt_token_is_never_reused():
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 9))                     # exactly two full blocks
    run_to_completion(bm, a)
    bm.free(a)
    b = seq_of(range(1, 9))
    bm.allocate(b)
    # One token must run through the model to give logits: only the first block is reused.
    assert b.num_cached_tokens == 4 and b.num_tokens - b.num_computed_tokens == 4


def test_adapter_is_part_of_the_key():
    bm = BlockManager(16, BS)
    a = seq_of(range(1, 10), adapter="lora-a")
    run_to_completion(bm, a)
    bm.free(a)
    other = seq_of(range(1, 10), adapter="lora-b")
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    base = seq_of(range(1, 10))
    bm.allocate(base)
    assert base.num_cached_tokens == 0
    same = seq_of(range(1, 10), adapter="lora-a")
    bm.allocate(same)
    assert same.num_cached_tokens == 8


def test_cache_salt_is_part_of_the_key():
    """Tenants (issue 25): a prefix cached under one salt is no hit under another, nor unsalted."""
    bm = BlockManager(16, BS)
    a = Sequence(list(range(1, 10)), SamplingParams(), cache_salt="tenant-a")
    run_to_completion(bm, a)
    bm.free(a)
    for salt in ("tenant-b", None):
        other = Sequence(list(range(1, 10)), SamplingParams(), cache_salt=salt)
        bm.allocate(other)
        assert other.num_cached_tokens == 0, salt
    same = Sequence(list(range(1, 10)), SamplingParams(), cache_salt="tenant-a")
    bm.allocate(same)
    assert same.num_cached_tokens == 8


def test_a_forced_collision_across_salts_is_still_a_miss():
    """Even with every hash equal, a block is verified against its salt."""
    bm = BlockManager(16, BS, hash_fn=lambda *keys: 7)
    a = Sequence(list(range(1, 6)), SamplingParams(), cache_salt="x")
    run_to_completion(bm, a)
    bm.free(a)
    b = Sequence(list(range(1, 6)), SamplingParams(), cache_salt="y")
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_forget_adapter_drops_only_that_adapters_cached_prefixes():
    bm = BlockManager(16, BS)
    for adapter in ("lora-a", "lora-b"):
        s = seq_of(range(1, 10), adapter=adapter)
        run_to_completion(bm, s)
        bm.free(s)
    assert bm.num_cached_blocks == 4
    assert bm.forget_adapter("lora-a") == 2
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 16
    again = seq_of(range(1, 10), adapter="lora-a")
    bm.allocate(again)
    assert again.num_cached_tokens == 0                 # a reloaded adapter of that name starts cold
    b = seq_of(range(1, 10), adapter="lora-b")
    bm.allocate(b)
    assert b.num_cached_tokens == 8
    bm.check_invariants([again, b])


def test_namespace_reaches_the_hash():
    seen = []

    def spy(parent, tokens, namespace, adapter, salt):
        seen.append(namespace)
        return block_hash(parent, tokens, namespace, adapter, salt)

    bm = BlockManager(8, BS, namespace="template", hash_fn=spy)
    run_to_completion(bm, seq_of(range(1, 10)))
    assert seen and set(seen) == {"template"}


def test_constant_hash_never_hands_out_other_tokens():
    bm = BlockManager(16, BS, hash_fn=lambda *a: 0)
    a = seq_of([1, 1, 1, 1, 2, 2, 2, 2, 3])
    run_to_completion(bm, a)
    bm.free(a)
    b = seq_of([5, 5, 5, 5, 2, 2, 2, 2, 3])
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_parent_blind_hash_does_not_splice_a_block_onto_another_prefix():
    """Hash ignores the parent, so block [2,2,2,2] after [1,1,1,1] and after [5,5,5,5] collide.
    Tokens alone match; the parent check must refuse the splice."""
    bm = BlockManager(16, BS, hash_fn=lambda parent, tokens, *keys: tokens)
    x = seq_of([1, 1, 1, 1, 2, 2, 2, 2, 3])
    run_to_completion(bm, x)
    y = seq_of([5, 5, 5, 5, 9])
    run_to_completion(bm, y)
    bm.free(x)
    bm.free(y)
    z = seq_of([5, 5, 5, 5, 2, 2, 2, 2, 3])
    bm.allocate(z)
    assert z.num_cached_tokens == 4          # [5,5,5,5] is reused, x's [2,2,2,2] is not


def test_duplicate_prefixes_share_a_content_id_so_chains_continue():
    """Two seqs admitted together compute the same prefix twice; a later request that matches
    the first copy of block 0 must still match block 1 registered by the second seq."""
    bm = BlockManager(32, BS)
    a = seq_of(range(1, 14))
    b = seq_of(range(1, 14))
    bm.allocate(a)
    bm.allocate(b)
    a.num_computed_tokens = 4                # a computed block 0 only
    bm.cache_computed_blocks(a)
    b.num_computed_tokens = 12               # b computed blocks 0..2
    bm.cache_computed_blocks(b)
    c = seq_of(range(1, 14))
    bm.allocate(c)
    assert c.num_cached_tokens == 12


def cached_tokens_on_admission(bm: BlockManager, tokens) -> int:
    probe = seq_of(tokens)
    bm.allocate(probe)
    hit = probe.num_cached_tokens
    bm.free(probe)                           # never computed: nothing new gets cached
    return hit


def test_lru_evicts_least_recently_freed_and_empty_blocks_first():
    bm = BlockManager(6, BS)
    seqs = [seq_of([10 * k + i for i in range(5)]) for k in range(3)]   # 1 full block + 1 each
    for s in seqs:
        run_to_completion(bm, s)
    for s in seqs:                           # freed in order: seqs[0] is least recent
        bm.free(s)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 6
    # 3 empty blocks exist: a 3-block request must not evict anything.
    filler = seq_of([90 + i for i in range(12)])
    run_to_completion(bm, filler)
    assert bm.num_cached_blocks == 3
    bm.free(filler)                          # its 3 full blocks join the cache, tail first
    assert bm.num_cached_blocks == 6
    # 4 fresh blocks, none empty: evict the 4 least recently freed = seqs 0..2, filler's tail.
    big = seq_of(range(200, 216))
    bm.allocate(big)
    assert bm.num_cached_blocks == 2
    bm.free(big)
    for k in range(3):
        assert cached_tokens_on_admission(bm, [10 * k + i for i in range(5)]) == 0
    assert cached_tokens_on_admission(bm, [90 + i for i in range(9)]) == 8     # blocks 0, 1 survived
    assert cached_tokens_on_admission(bm, [90 + i for i in range(13)]) == 8    # block 2 was evicted


def test_lru_order_within_the_cached_list():
    bm = BlockManager(4, BS)
    a, b = seq_of([1, 2, 3, 4, 5]), seq_of([6, 7, 8, 9, 10])
    run_to_completion(bm, a)
    run_to_completion(bm, b)
    bm.free(a)
    bm.free(b)
    big = seq_of(range(20, 31))              # 3 blocks: 2 empty + evicts a's block (older)
    bm.allocate(big)
    bm.free(big)
    assert cached_tokens_on_admission(bm, [1, 2, 3, 4, 5]) == 0
    assert cached_tokens_on_admission(bm, [6, 7, 8, 9, 10]) == 4


def test_fork_shares_full_computed_blocks_only():
    bm = BlockManager(16, BS)
    parent = seq_of(range(1, 11))
    run_to_completion(bm, parent)
    child = seq_of(range(1, 11))
    bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert child.num_computed_tokens == 8
    bm.check_invariants([parent, child])
    bm.free(parent)
    bm.free(child)
    bm.check_invariants([])


def test_rollback_frees_the_tail_blocks():
    bm = BlockManager(16, BS)
    s = seq_of(range(1, 6))
    bm.allocate(s, num_lookahead=8)          # room for a draft window
    assert len(s.block_table) == 4
    free_before = bm.num_free_blocks
    bm.rollback(s, 6)
    assert len(s.block_table) == 2 and bm.num_free_blocks == free_before + 2
    bm.check_invariants([s])


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(2, BS)
    s = seq_of(range(1, 10))
    assert not bm.can_allocate(s)
    with pytest.raises(RuntimeError):
        bm.allocate(s)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_caching_disabled_registers_nothing():
    bm = BlockManager(8, BS, enable_caching=False)
    a = seq_of(range(1, 10))
    run_to_completion(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0
    b = seq_of(range(1, 10))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.prefix_queries == 0
