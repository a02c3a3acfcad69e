"""Prefix affinity: chained text-block hashes, the LRU index, and choose_replica's balance of cache
hits against queue depth."""
from __future__ import annotations

import math
from collections import Counter

from consort_router.affinity import Affinity, PrefixIndex, prefix_hashes
from consort_router.replicas import MIN_AFFINE_SHARE, ReplicaState, choice_outcome, choose_replica

SYSTEM = "You are a careful C++ reviewer. " * 10   # 320 chars: two full 128-char blocks


def rep(url, running=0, ready=True):
    return ReplicaState(url=url, specialist="s", ready=ready, running=running)


def hashes(text, salt="lane\0", block=128, max_blocks=64):
    return prefix_hashes(text, salt, block, max_blocks)


def test_hashes_chain_over_full_blocks_only():
    h = hashes("x" * 300)
    assert len(h) == 2                                  # the 44-char tail is not a block
    assert hashes("x" * 300 + "tail") == h
    assert hashes("y" + "x" * 299)[0] != h[0]
    # Same second block text, different first: a different second hash (it chains).
    a, b = hashes("a" * 128 + "z" * 128), hashes("b" * 128 + "z" * 128)
    assert a[1] != b[1]
    assert hashes("x" * 300, salt="other\0") != h      # another lane or adapter: another cache
    assert len(hashes("x" * 10_000, max_blocks=5)) == 5
    assert hashes("short") == ()


def test_index_match_depth_and_chain():
    idx = PrefixIndex(capacity=1000)
    turn1 = hashes(SYSTEM + "first question " * 20)
    idx.record(turn1, "a")
    turn2 = hashes(SYSTEM + "first question " * 20 + "answer and a follow-up " * 20)
    depth = idx.match(turn2)
    assert depth == {"a": len(turn1)}                  # the new blocks are on nobody yet
    idx.record(hashes(SYSTEM + "another user entirely " * 20), "b")
    d = idx.match(turn2)
    assert d["a"] == len(turn1) and d["b"] == 2        # b shares the system prompt's two blocks
    assert idx.match(hashes("z" * 600)) == {}


def test_index_is_lru_bounded_and_forgets_replicas():
    idx = PrefixIndex(capacity=4)
    old, new = hashes("o" * 128 * 3), hashes("n" * 128 * 3)
    idx.record(old, "a")
    idx.record(new, "b")
    assert len(idx) == 4
    assert idx.match(old) == {}                        # the oldest blocks went first
    assert idx.match(new) == {"b": 3}
    idx.forget("b")
    assert idx.match(new) == {} and len(idx) == 1   # old[2] (on a) is left


def test_deepest_match_wins_within_slack():
    reps = [rep("a", running=3), rep("b", running=1), rep("c", running=0)]
    h = hashes(SYSTEM)
    aff = Affinity(h, {"a": 2, "b": 1}, load_slack=4.0)
    chosen = choose_replica(reps, 8.0, affinity=aff)
    assert chosen.url == "a" and choice_outcome(aff, chosen) == "affine"


def test_too_loaded_affine_replica_spills_to_least_loaded():
    reps = [rep("a", running=9), rep("b", running=2), rep("c", running=1)]
    aff = Affinity(hashes(SYSTEM), {"a": 2}, load_slack=4.0)
    chosen = choose_replica(reps, 8.0, affinity=aff)
    assert chosen.url == "c" and choice_outcome(aff, chosen) == "spill"
    # A shallower holder within the slack beats spilling.
    aff = Affinity(hashes(SYSTEM), {"a": 2, "b": 1}, load_slack=4.0)
    assert choose_replica(reps, 8.0, affinity=aff).url == "b"


def test_cold_prompts_spread_and_shared_beginnings_meet():
    reps = [rep("http://r0"), rep("http://r1"), rep("http://r2")]
    picks = Counter()
    for i in range(60):
        aff = Affinity(hashes(f"conversation {i:03d} " * 20), {}, load_slack=4.0)
        chosen = choose_replica(reps, 8.0, affinity=aff)
        assert choice_outcome(aff, chosen) == "cold"
        picks[chosen.url] += 1
    assert len(picks) == 3 and min(picks.values()) >= 8    # rendezvous hashing spreads them
    same = {choose_replica(reps, 8.0, affinity=Affinity(hashes(SYSTEM + f"q{i}" * 200), {}, 4.0)).url
            for i in range(10)}
    assert len(same) == 1                              # one first block: one replica


def test_no_affinity_or_short_prompt_is_least_loaded():
    reps = [rep("a", running=2), rep("b", running=1)]
    assert choose_replica(reps, 8.0, affinity=None).url == "b"
    aff = Affinity((), {}, 4.0)
    chosen = choose_replica(reps, 8.0, affinity=aff)
    assert chosen.url == "b" and choice_outcome(aff, chosen) == "least_loaded"


def test_affinity_respects_ready_exclude_and_adapter():
    reps = [rep("a", ready=False), rep("b", running=3), rep("c")]
    reps[1].adapters = ("fix",)
    aff = Affinity(hashes(SYSTEM), {"a": 2, "c": 2}, load_slack=10.0)
    assert choose_replica(reps, 8.0, affinity=aff).url == "c"              # a is not ready
    assert choose_replica(reps, 8.0, frozenset({"c"}), affinity=aff).url == "b"
    assert choose_replica(reps, 8.0, adapter="fix", affinity=aff).url == "b"  # only b has the adapter


def test_routers_agree_on_a_tied_depth_and_on_a_held_history():
    # Two router replicas in front of the same three idle engines that all hold the system prompt
    # (depth 2): the choice hangs on the prompt's blocks, not on the router, so both send it to the
    # same replica.
    h = hashes(SYSTEM + "a conversation of its own " * 20)
    depth = {"http://r0": 2, "http://r1": 2, "http://r2": 2}
    router1 = [rep("http://r0"), rep("http://r1"), rep("http://r2")]
    router2 = [rep("http://r0"), rep("http://r1"), rep("http://r2")]
    one = choose_replica(router1, 8.0, affinity=Affinity(h, depth, load_slack=4.0))
    two = choose_replica(router2, 8.0, affinity=Affinity(h, depth, load_slack=4.0))
    assert one.url == two.url
    assert choice_outcome(Affinity(h, depth, 4.0), one) == "short_prefix"   # the load chose; the system prompt alone is not enough
    # The next turn, its history evicted everywhere: the same first block past the system prompt,
    # the same replica.
    later = hashes(SYSTEM + "a conversation of its own " * 20 + "an answer, then more " * 20)
    assert later[2] == h[2]
    assert choose_replica(router2, 8.0, affinity=Affinity(later, depth, load_slack=4.0)).url == one.url
    # Its history held on one replica: both routers send it there, though each has its own sends in
    # flight elsewhere.
    held = dict(depth, **{one.url: len(later)})
    for r, n in zip(router1, (0, 2, 1)):
        r.inflight = n
    for r, n in zip(router2, (3, 0, 2)):
        r.inflight = n
    for router in (router1, router2):
        assert choose_replica(router, 8.0, affinity=Affinity(later, held, load_slack=4.0)).url == one.url


def test_a_shared_system_prompt_does_not_pull_every_conversation_onto_one_replica():
    # r0 served the first conversation and holds the system prompt (2 of the prompt's blocks, under
    # MIN_AFFINE_SHARE): one request there outweighs it, and the next conversation goes to an idle
    # replica; of idle ones, one holding the system prompt goes first.
    h = hashes(SYSTEM + "a long first question of its own " * 40)
    assert 2 < MIN_AFFINE_SHARE * len(h)
    reps = [rep("http://r0", running=1), rep("http://r1"), rep("http://r2")]
    aff = Affinity(h, {"http://r0": 2}, load_slack=4.0)
    chosen = choose_replica(reps, 8.0, affinity=aff)
    assert chosen.url != "http://r0" and choice_outcome(aff, chosen) == "short_prefix"
    both = Affinity(h, {"http://r0": 2, "http://r2": 2}, 4.0)
    chosen = choose_replica(reps, 8.0, affinity=both)
    # counted as the load's choice, not as affine, though r2 holds the system prompt
    assert chosen.url == "http://r2" and choice_outcome(both, chosen) == "short_prefix"
    # Its history there (at least half the prompt), r0 keeps it within load_slack of the least load...
    for held in (len(h), math.ceil(MIN_AFFINE_SHARE * len(h))):
        deep = Affinity(h, {"http://r0": held, "http://r1": 2}, load_slack=4.0)
        assert choose_replica(reps, 8.0, affinity=deep).url == "http://r0"
    # ... and no further: one request past the slack, it spills to the least loaded.
    reps[0].running = 4
    assert choose_replica(reps, 8.0, affinity=deep).url == "http://r0"
    reps[0].running = 5
    chosen = choose_replica(reps, 8.0, affinity=deep)
    assert chosen.url != "http://r0" and choice_outcome(deep, chosen) == "spill"


def test_conversations_sharing_a_system_prompt_spread_over_tied_replicas():
    reps = [rep("http://r0"), rep("http://r1"), rep("http://r2")]
    depth = {r.url: 2 for r in reps}                   # everyone holds the system prompt only
    picks = Counter(choose_replica(reps, 8.0, affinity=Affinity(hashes(SYSTEM + f"user {i:03d} asks " * 20),
                                                                depth, load_slack=4.0)).url
                    for i in range(60))
    assert len(picks) == 3 and min(picks.values()) >= 8
    # A prompt that is all held (no block past it): keyed on its last block, still a held replica.
    whole = hashes(SYSTEM)
    assert choose_replica(reps, 8.0, affinity=Affinity(whole, depth, load_slack=4.0)).url in depth


def test_of_equal_depth_the_replica_holding_more_blocks_wins():
    # A replica back from a restart holds a conversation's four blocks in its tier (4 x 0.5); another
    # holds the two blocks of the system prompt in its pool (2 x 1): the same depth, but the first
    # has more of the prompt, whatever the block past the shorter chain hashes to.
    for i in range(8):
        h = hashes(SYSTEM + f"conversation {i} of its own " * 40)
        reps = [rep("http://restarted", running=i % 3), rep("http://other", running=i % 3)]
        aff = Affinity(h, {"http://restarted": 2.0, "http://other": 2.0}, 4.0, precise=True,
                       chain={"http://restarted": 4, "http://other": 2})
        assert choose_replica(reps, 8.0, affinity=aff).url == "http://restarted"
        assert aff.blocks_held("http://other") == 2
    assert Affinity(hashes(SYSTEM), {"a": 3}, 4.0).blocks_held("a") == 3    # character mode: its depth
