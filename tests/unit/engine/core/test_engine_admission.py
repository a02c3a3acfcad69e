"""Admission: the pure decision and the scheduler's live queue snapshot."""
from __future__ import annotations

import time

import pytest
from engine_fakes import make_scheduler, make_seq, synthetic_step

from consort_engine.core.admission import (AdmissionRequest, QueueSnapshot, StepEstimates,
                                      decide_admission, steps_until_blocks_free)


def snapshot(**kw) -> QueueSnapshot:
    base = dict(num_blocks=100, free_blocks=100, num_waiting=0, max_waiting=10, tokens_ahead=0,
                blocks_ahead=0, preemptible_blocks=0, running_release=())
    base.update(kw)
    return QueueSnapshot(**base)


def request(num_tokens=100, blocks=7, priority=0, deadline=None) -> AdmissionRequest:
    return AdmissionRequest(num_tokens=num_tokens, blocks_needed=blocks, priority=priority, deadline_in_s=deadline)


EST = StepEstimates(decode_step_s=0.02, prefill_tokens_per_s=1000.0)


def test_admits_when_there_is_room_and_time():
    assert decide_admission(request(deadline=1.0), snapshot(), EST) is None


def test_warming_retry_grows_with_elapsed_warmup():
    a = decide_admission(request(), snapshot(warm=False, warming_elapsed_s=0.0), EST)
    b = decide_admission(request(), snapshot(warm=False, warming_elapsed_s=3.0), EST)
    assert a.code == b.code == "warming"
    assert a.retry_after_ms >= 250 and b.retry_after_ms == 3000


def test_prompt_larger_than_the_pool_is_permanent_kv_capacity():
    r = decide_admission(request(blocks=101), snapshot(), EST)
    assert r.code == "kv_capacity" and r.permanent


def test_queue_full_retry_comes_from_running_finishes():
    running = ((10, 5), (50, 5), (30, 5))
    r = decide_admission(request(), snapshot(num_waiting=10, running_release=running), EST)
    assert r.code == "queue_full" and not r.permanent
    assert r.retry_after_ms == 200                         # the soonest finish: 10 steps x 20 ms
    r2 = decide_admission(request(), snapshot(num_waiting=12, running_release=running), EST)
    assert r2.retry_after_ms == 1000                       # three finishes needed: 50 steps


def test_saturated_pool_with_queue_is_transient_kv_capacity():
    running = ((40, 60), (80, 40))
    # 157 blocks wanted, 100 released by the runners: within one more pool turnover, so it queues.
    queued = decide_admission(request(blocks=7), snapshot(free_blocks=0, blocks_ahead=150,
                                                          running_release=running), EST)
    assert queued is None
    # 257 wanted: 1.57 turnovers beyond the running set: saturated.
    r = decide_admission(request(blocks=7), snapshot(free_blocks=0, blocks_ahead=250,
                                                     running_release=running), EST)
    assert r.code == "kv_capacity" and not r.permanent
    assert r.retry_after_ms == pytest.approx(80 * 20 * 0.57, abs=2)   # 80-step turnover, 0.57 over
    worse = decide_admission(request(blocks=7), snapshot(free_blocks=0, blocks_ahead=400,
                                                         running_release=running), EST)
    assert worse.retry_after_ms > r.retry_after_ms


def test_waiting_beyond_the_running_set_counts_in_the_deadline():
    running = ((40, 60), (80, 40))
    snap = snapshot(free_blocks=0, blocks_ahead=150, running_release=running)
    # It queues, but behind a full turnover of the running set and more: 80 x 20 ms x 1.57.
    r = decide_admission(request(blocks=7, deadline=1.0), snap, EST)
    assert r.code == "deadline" and r.retry_after_ms >= 1000


def test_lower_priority_runners_count_as_available_blocks():
    snap = snapshot(free_blocks=0, blocks_ahead=0, preemptible_blocks=50, running_release=((40, 50),))
    assert decide_admission(request(blocks=7, deadline=1.0), snap, EST) is None


def test_steps_until_blocks_free():
    release = ((30, 4), (10, 2), (20, 3))
    assert steps_until_blocks_free(0, release) == 0
    assert steps_until_blocks_free(2, release) == 10
    assert steps_until_blocks_free(5, release) == 20
    assert steps_until_blocks_free(9, release) == 30
    assert steps_until_blocks_free(10, release) is None


def test_deadline_rejected_with_retry_after_from_the_queue():
    snap = snapshot(tokens_ahead=5000)
    r = decide_admission(request(num_tokens=100, deadline=1.0), snap, EST)
    # ETA = 5000/1000 queue + 100/1000 own prefill + one 20 ms step = 5.12 s; 1 s allowed.
    assert r.code == "deadline"
    assert r.retry_after_ms == pytest.approx(4120, abs=2)
    assert decide_admission(request(num_tokens=100, deadline=6.0), snap, EST) is None


def test_deadline_counts_the_wait_for_blocks():
    snap = snapshot(free_blocks=0, running_release=((100, 50),))
    r = decide_admission(request(blocks=7, deadline=1.0), snap, EST)
    assert r.code == "deadline" and r.retry_after_ms >= 1000      # 100 steps x 20 ms = 2 s of waiting


def test_retry_after_grows_with_the_queue():
    retries = [decide_admission(request(deadline=0.5), snapshot(tokens_ahead=t), EST).retry_after_ms
               for t in (1000, 2000, 4000)]
    assert retries == sorted(retries) and retries[0] < retries[-1]


def test_no_estimate_yet_admits_but_a_passed_deadline_is_rejected():
    assert decide_admission(request(deadline=0.001), snapshot(tokens_ahead=10**6), StepEstimates()) is None
    assert decide_admission(request(deadline=-0.5), snapshot(), StepEstimates()).code == "deadline"


# ---------------------------------------------------------------- from the live scheduler

def test_scheduler_queue_full():
    sched = make_scheduler(max_waiting=2)
    for i in range(2):
        sched.add(make_seq(4, arrival=i))
    r = sched.check_admission(make_seq(4), EST)
    assert r is not None and r.code == "queue_full"


def test_scheduler_deadline_sees_tokens_ahead_at_equal_or_higher_priority():
    sched = make_scheduler(num_blocks=1000)
    for i in range(5):
        sched.add(make_seq(100, priority=1, arrival=i))    # 500 tokens queued at priority 1
    est = StepEstimates(decode_step_s=0.01, prefill_tokens_per_s=100.0)
    now = time.monotonic()
    low = make_seq(10, priority=0)
    low.deadline = now + 1.0
    r = sched.check_admission(low, est, now=now)
    assert r is not None and r.code == "deadline"
    assert 4000 <= r.retry_after_ms <= 4200                 # 5 s queue + 0.1 s own + 1 step - 1 s
    high = make_seq(10, priority=2)
    high.deadline = now + 1.0
    assert sched.check_admission(high, est, now=now) is None   # nobody is ahead of it

    # As the queue drains the estimate falls, and the same request gets in.
    while sched.num_waiting:
        synthetic_step(sched)
    assert sched.check_admission(low, est, now=now) is None


def test_scheduler_snapshot_reflects_running_and_preemptible_blocks():
    sched = make_scheduler(num_blocks=20)
    lo = make_seq(10, max_tokens=30, priority=0)
    hi = make_seq(10, max_tokens=5, priority=5, arrival=1.0, first=100)
    sched.add(lo)
    sched.add(hi)
    synthetic_step(sched)
    mid = make_seq(4, priority=3)
    snap = sched.queue_snapshot(mid)
    assert snap.preemptible_blocks == len(lo.block_table)
    assert snap.running_release == ((4, len(hi.block_table)),)   # 5 max tokens, 1 generated
    assert snap.free_blocks == sched.block_manager.num_free_blocks
