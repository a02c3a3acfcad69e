"""Hybrid prefix caching in the block manager: which block boundaries get a state checkpoint, hits
that stop at the deepest checkpointed block, restores queued at admission, and checkpoint rows that
leave with their block, are taken from the least recently freed cached block when short, and are
never taken from a block a running sequence holds."""
from __future__ import annotations

from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.sequence import SamplingParams, Sequence

BS = 4


def hybrid_bm(num_blocks=64, rows=8, every=8, **kw) -> BlockManager:
    return BlockManager(num_blocks, BS, namespace="h", state_slots=4, checkpoints=rows, checkpoint_every=every, **kw)


def prefill(bm: BlockManager, seq: Sequence, chunk: int = 1 << 30) -> list[list[tuple[int, int]]]:
    """Admit seq and 'compute' its prompt in chunks as the engine does: plan, run, register."""
    assert bm.try_allocate(seq)
    plans = []
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        plans.append(bm.plan_checkpoints(seq, n) if n > 1 else [])
        seq.num_computed_tokens += n
        bm.cache_computed_blocks(seq)
    return plans


def seq_of(n: int, start: int = 1) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams())


def test_checkpoints_every_n_tokens_and_at_the_prompt_end_within_chunks():
    bm = hybrid_bm()
    a = seq_of(30)                        # boundaries every 8 tokens: 8, 16, 24; the prompt's end: 28
    plans = prefill(bm, a, chunk=12)         # chunks [0, 12), [12, 24), [24, 30)
    assert [[off for off, _ in p] for p in plans] == [[8], [4, 12], [4]]
    assert sorted(row for p in plans for _, row in p) == [0, 1, 2, 3]
    bm.free(a)
    bm.check_invariants([])
    assert bm.num_free_blocks == 64


def test_hit_stops_at_the_deepest_checkpoint_and_queues_a_restore():
    bm = hybrid_bm()
    a = seq_of(30)
    prefill(bm, a)
    rows = {i: bm._ckpt[b] for i, b in enumerate(a.block_table) if bm._ckpt[b] >= 0}
    assert sorted(rows) == [1, 3, 5, 6]        # blocks ending at 8, 16, 24, 28
    bm.free(a)
    b = Sequence(list(range(1, 23)) + [99] * 5, SamplingParams())   # shares 22 tokens: 5 full blocks
    assert bm.try_allocate(b)
    assert b.num_cached_tokens == 16, "block 4 (ending at 20) has no checkpoint: the hit stops at 16"
    assert bm.take_state_restores() == [(b.state_slot, rows[3])] and bm.take_state_restores() == []
    assert bm.prefix_hits == 16
    c = seq_of(30)                            # the same prompt: its last usable block ends at 28
    assert bm.try_allocate(c) and c.num_cached_tokens == 28
    assert bm.take_state_restores() == [(c.state_slot, rows[6])]
    bm.check_invariants([b, c])


def test_swapped_sequence_takes_no_hits():
    from consort_engine.kv.state_pool import SwappedState
    bm = hybrid_bm()
    a = seq_of(30)
    prefill(bm, a)
    bm.free(a)
    b = seq_of(30)
    b.swapped = SwappedState(12, [0, 1, 2], 0)    # brings its own KV and state back
    assert bm.try_allocate(b) and b.num_cached_tokens == 0 and bm.take_state_restores() == []


def test_rows_leave_with_their_block_and_short_rows_come_from_the_oldest_free_block():
    bm = hybrid_bm(num_blocks=16, rows=3, every=1 << 20)    # only prompt ends get checkpoints
    a, b = seq_of(9), seq_of(9, start=100)                    # 2 full blocks each: ends at 8
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    c = seq_of(13, start=200)                 # one row left: its end (12) takes it
    prefill(bm, c)
    assert bm._ckpt_free == []
    d = seq_of(9, start=300)                  # no free row: the oldest freed cached block's (a's) goes
    assert [off for p in prefill(bm, d) for off, _ in p] == [8]
    again_a, again_b = seq_of(9), seq_of(9, start=100)
    assert bm.try_allocate(again_a) and again_a.num_cached_tokens == 0, "a's checkpoint was taken: no hit"
    assert bm.try_allocate(again_b) and again_b.num_cached_tokens == 8, "b's was not"
    assert bm.take_state_restores() == [(again_b.state_slot, bm._ckpt[again_b.block_table[1]])]
    bm.check_invariants([c, d, again_a, again_b])


def test_rows_of_held_blocks_are_never_taken():
    bm = hybrid_bm(num_blocks=32, rows=1, every=1 << 20)
    a = seq_of(9)
    prefill(bm, a)                            # a still runs: its checkpoint is pinned
    b = seq_of(9, start=100)
    assert prefill(bm, b) == [[]], "no row to spare: no checkpoint, never a stolen one"
    bm.check_invariants([a, b])
    bm.free(b)
    c = seq_of(9, start=100)
    assert bm.try_allocate(c) and c.num_cached_tokens == 0


def test_eviction_frees_the_row_and_a_duplicate_prefix_keeps_one():
    bm = hybrid_bm(num_blocks=6, rows=4, every=1 << 20)
    a, b = seq_of(9), seq_of(9)               # the same prompt admitted together: two snapshots at 8
    assert bm.try_allocate(a) and bm.try_allocate(b)
    for s in (a, b):
        assert [off for off, _ in bm.plan_checkpoints(s, 9)] == [8]
        s.num_computed_tokens = 9
    bm.cache_computed_blocks(a)
    bm.cache_computed_blocks(b)
    assert len(bm._ckpt_free) == 3, "the second copy's row went back"
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    big = seq_of(23, start=500)               # takes every block: the cached ones are evicted
    assert bm.try_allocate(big)
    assert len(bm._ckpt_free) == 4 and all(r < 0 for r in bm._ckpt)
    bm.check_invariants([big])


def test_aborted_chunk_gives_its_planned_rows_back():
    bm = hybrid_bm(rows=2)
    a = seq_of(30)
    assert bm.try_allocate(a)
    assert [off for off, _ in bm.plan_checkpoints(a, 30)] == [8, 28]   # rows run short: the prompt's end first
    bm.free(a)                                            # before the step registered anything
    assert sorted(bm._ckpt_free) == [0, 1]
    bm.check_invariants([])


def test_a_collision_takes_the_row_off_the_block_nobody_finds():
    bm = hybrid_bm(rows=4, every=1 << 20, hash_fn=lambda *keys: 7)   # every block hashes alike
    a = seq_of(5)                              # one full block ending at 4: its prompt end
    prefill(bm, a)
    b = seq_of(5, start=50)                    # same hash, other content: takes the slot
    bm.free(a)
    prefill(bm, b)
    bm.check_invariants([b])
    assert sum(r >= 0 for r in bm._ckpt) == 1


def test_evicted_blocks_go_to_the_tier_with_their_rows_and_a_tier_hit_ends_at_a_saved_state():
    """Eviction hands the tier each block with its checkpoint row; a tier lookup stops at the deepest
    found block saved with a state (the pool's rule), loads that state into a row and restores it."""
    from consort_engine.kv.tier import KVTier
    tier = KVTier(None, 1 << 20, "hybrid-test")
    bm = hybrid_bm(tier=tier)
    a = seq_of(30)
    prefill(bm, a)
    rows = {i: bm._ckpt[b] for i, b in enumerate(a.block_table) if bm._ckpt[b] >= 0}
    assert sorted(rows) == [1, 3, 5, 6]
    bm.free(a)
    big = seq_of(64 * BS - 1, start=1000)       # takes every block: the cached ones are evicted
    assert bm.try_allocate(big)
    out = bm.take_offloads()
    assert sorted(row for _, _, row in out if row >= 0) == sorted(rows.values()) and len(out) == 7
    for b, h, row in out:                          # the engine's copy: K/V, and the row's state
        tier.save(h, f"kv{b}".encode(), f"state{row}".encode() if row >= 0 else b"")
    assert tier.flush(5.0)
    bm.free(big)
    b = Sequence(list(range(1, 23)) + [99] * 5, SamplingParams())   # 5 full blocks in the tier
    assert bm.try_allocate(b)
    assert b.num_cached_tokens == 16 and bm.tier_hits == 16, "block 4 (ending at 20) was saved without a state"
    loads = bm.take_onloads()
    assert [(row >= 0, st) for _, _, row, st in loads] == [(False, b"")] * 3 + [(True, f"state{rows[3]}".encode())]
    assert bm.take_state_restores() == [(b.state_slot, loads[-1][2])]
    bm.check_invariants([b])
