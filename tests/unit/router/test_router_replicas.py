"""Replica choice: least queue depth among ready replicas, preempting penalty, in-flight accounting."""
from __future__ import annotations

from consort_router.replicas import ReplicaState, choose_replica, parse_status


def rep(url, ready=True, waiting=0, running=0, preempting=False, inflight=0, at_poll=0):
    return ReplicaState(url=url, specialist="s", ready=ready, waiting=waiting, running=running,
                        preempting=preempting, inflight=inflight, inflight_at_poll=at_poll)


def test_least_queue_depth_among_ready():
    reps = [rep("a", waiting=3, running=2), rep("b", waiting=1, running=1), rep("c", ready=False)]
    assert choose_replica(reps, 8.0).url == "b"


def test_not_ready_never_chosen():
    assert choose_replica([rep("a", ready=False), rep("b", ready=False)], 8.0) is None
    assert choose_replica([], 8.0) is None


def test_preempting_penalty():
    reps = [rep("a", running=4, preempting=True), rep("b", running=9)]
    assert choose_replica(reps, 8.0).url == "b"        # 12 vs 9
    assert choose_replica(reps, 4.0).url == "a"        # 8 vs 9
    assert choose_replica(reps, 0.0).url == "a"


def test_requests_sent_since_the_poll_count():
    a = rep("a", running=1, inflight=5, at_poll=0)     # 5 sent since the poll
    b = rep("b", running=3, inflight=1, at_poll=1)
    assert choose_replica([a, b], 8.0).url == "b"


def test_exclude_and_ties():
    reps = [rep("b"), rep("a")]
    assert choose_replica(reps, 8.0).url == "a"        # deterministic tie-break
    assert choose_replica(reps, 8.0, frozenset({"a"})).url == "b"


def test_parse_status_shapes():
    assert parse_status({"waiting": 2, "running": 3, "preempting": False, "adapters": {"x": "loaded"}}) == (
        2, 3, False, ("x",))
    assert parse_status({"waiting": [1, 2], "running": 1, "preempting": 2}) == (2, 1, True, ())
    assert parse_status("garbage") == (0, 0, False, ())


def test_adapter_requests_prefer_replicas_that_have_it_loaded():
    a = rep("a", running=0)                          # idle, but without the adapter
    b = rep("b", running=6)
    b.adapters = ("v2",)
    assert choose_replica([a, b], 8.0).url == "a"                       # base requests: least load
    assert choose_replica([a, b], 8.0, adapter="v2").url == "b"         # v2 only where it is loaded
    assert choose_replica([a, b], 8.0, frozenset({"b"}), adapter="v2").url == "a"   # retry: anyone left
    assert choose_replica([a, b], 8.0, adapter="v3").url == "a"         # nobody has it: least load answers
