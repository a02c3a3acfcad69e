"""Scheduler driven with synthetic model outputs (no model): ordering, budgets, preemption,
abort, stop conditions and adapter grouping."""
from __future__ import annotations

from engine_fakes import make_scheduler, make_seq, synthetic_step

from consort_engine.kv.sequence import SequenceStatus


def run_until_done(sched, max_steps: int = 10_000) -> list:
    batches = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return batches
        batch, _ = synthetic_step(sched)
        assert batch.seqs, "no progress with unfinished work"
        batches.append(batch)
    raise AssertionError("did not finish")


def test_waiting_order_is_priority_desc_then_arrival_asc():
    sched = make_scheduler(max_num_seqs=1)
    specs = [(0, 1.0), (5, 3.0), (0, 0.5), (5, 2.0), (9, 4.0), (-1, 0.0)]
    seqs = [make_seq(3, max_tokens=1, priority=p, arrival=a) for p, a in specs]
    for s in seqs:
        sched.add(s)
    batches = run_until_done(sched)
    admitted = [(b.seqs[0].priority, b.seqs[0].arrival) for b in batches]
    assert admitted == [(9, 4.0), (5, 2.0), (5, 3.0), (0, 0.5), (0, 1.0), (-1, 0.0)]
    assert sched.waiting_in_order() == []


def test_decodes_first_then_chunked_prefill_within_the_token_budget():
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=16)
    decoders = [make_seq(3, max_tokens=50, arrival=i) for i in range(4)]
    for s in decoders:
        sched.add(s)
    synthetic_step(sched)                    # all four prefilled (12 tokens) and sampled once
    long = make_seq(40, max_tokens=2, arrival=10.0)
    sched.add(long)
    chunks = []
    for _ in range(4):
        batch, _ = synthetic_step(sched)
        assert batch.num_tokens <= 16
        assert batch.seqs[:4] == decoders and batch.num_new_tokens[:4] == [1, 1, 1, 1]
        if long in batch.seqs:
            k = batch.seqs.index(long)
            assert k == 4 and batch.mode == "mixed"
            chunks.append((batch.num_new_tokens[k], batch.sample[k]))
    # 40 prompt tokens in 12-token chunks next to 4 decodes; only the last chunk samples.
    assert chunks == [(12, False), (12, False), (12, False), (4, True)]
    assert long.num_output_tokens == 1


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=3)
    for i in range(5):
        sched.add(make_seq(4, max_tokens=20, arrival=i))
    batch, _ = synthetic_step(sched)
    assert len(batch) == 3 and sched.num_running == 3 and sched.num_waiting == 2


def fill_pool(sched, specs, prompt_len=11):
    """Admit running seqs (priority, arrival) and prefill them; each holds 3 blocks of 4."""
    seqs = [make_seq(prompt_len, max_tokens=100, priority=p, arrival=a, first=1000 * (k + 1))
            for k, (p, a) in enumerate(specs)]
    for s in seqs:
        sched.add(s)
    synthetic_step(sched)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    return seqs


def test_preempts_lowest_priority_latest_arrival_first():
    sched = make_scheduler(num_blocks=12, preempt_watermark=0.0)   # watermark floor: 1 block
    a, b, c, d = fill_pool(sched, [(1, 0.0), (0, 1.0), (0, 2.0), (0, 3.0)])
    assert sched.block_manager.num_free_blocks == 0
    vip = make_seq(7, max_tokens=5, priority=5, arrival=9.0)        # needs 2 blocks (+1 decode)
    sched.add(vip)
    batch, _ = synthetic_step(sched)
    assert batch.preempted == [d]            # 3 blocks freed >= 2 needed + 1 watermark
    assert vip in batch.seqs and vip.status is SequenceStatus.RUNNING
    assert d.status is SequenceStatus.WAITING and d.num_computed_tokens == 0 and d.num_preemptions == 1
    assert sched.num_preemptions == 1


def test_preemption_order_continues_to_higher_priority_victims():
    sched = make_scheduler(num_blocks=12, preempt_watermark=0.0)
    a, b, c, d = fill_pool(sched, [(1, 0.0), (0, 1.0), (0, 2.0), (0, 3.0)])
    vip = make_seq(23, max_tokens=5, priority=5, arrival=9.0)       # needs 6 blocks (+1 = 7)
    sched.add(vip)
    batch, _ = synthetic_step(sched)
    assert batch.preempted == [d, c, b]      # 9 blocks >= 6 + 1 watermark; a (priority 1) kept
    assert a.status is SequenceStatus.RUNNING


def test_equal_priority_waiter_does_not_preempt():
    sched = make_scheduler(num_blocks=12)
    fill_pool(sched, [(0, 0.0), (0, 1.0), (0, 2.0), (0, 3.0)])
    late = make_seq(7, priority=0, arrival=9.0)
    sched.add(late)
    batch, _ = synthetic_step(sched)
    assert batch.preempted == [] and late.status is SequenceStatus.WAITING


def test_no_preemption_when_it_could_not_admit_the_waiter():
    sched = make_scheduler(num_blocks=12)
    fill_pool(sched, [(9, 0.0), (9, 1.0), (9, 2.0), (0, 3.0)])
    vip = make_seq(30, priority=5)           # needs 8 blocks; only 3 are preemptible
    sched.add(vip)
    batch, _ = synthetic_step(sched)
    assert batch.preempted == []


def test_preempts_to_the_watermark_not_to_one_block():
    sched = make_scheduler(num_blocks=40, preempt_watermark=0.25, max_num_batched_tokens=4096)
    runners = fill_pool(sched, [(0, float(i)) for i in range(13)])  # 39 blocks in use
    assert sched.block_manager.num_free_blocks == 1
    vip = make_seq(7, max_tokens=5, priority=1, arrival=99.0)        # needs 2 blocks (+decode)
    sched.add(vip)
    batch, _ = synthetic_step(sched)
    # Target = 2 needed + 10 watermark, 1 free: four victims (12 blocks), not one.
    assert batch.preempted == runners[::-1][:4]
    assert sched.block_manager.num_free_blocks >= 10


def test_priority_waiter_takes_a_seat_when_max_num_seqs_is_full():
    sched = make_scheduler(num_blocks=200, max_num_seqs=2)
    lo1, lo2 = fill_pool(sched, [(0, 0.0), (0, 1.0)])
    vip = make_seq(3, priority=3, arrival=5.0)
    sched.add(vip)
    batch, _ = synthetic_step(sched)
    assert batch.preempted == [lo2] and vip in batch.seqs and sched.num_running == 2


def test_decode_out_of_blocks_preempts_the_lowest_and_everyone_finishes():
    # 10 blocks of 4; four seqs of 7 prompt tokens decode 20 tokens each: they cannot all fit.
    sched = make_scheduler(num_blocks=10, preempt_watermark=0.0)
    seqs = [make_seq(7, max_tokens=20, priority=p, arrival=i) for i, p in enumerate([0, 2, 0, 1])]
    for s in seqs:
        sched.add(s)
    batches = run_until_done(sched)
    preempted = [v for b in batches for v in b.preempted]
    assert preempted, "pool was meant to be too small"
    # The first victim is the lowest priority, latest arrival among those running.
    assert preempted[0] is seqs[2]
    assert all(s.num_output_tokens == 20 and s.finish_reason == "length" for s in seqs)
    assert all(s.output_token_ids == [7] * 20 for s in seqs)
    assert sched.block_manager.num_free_blocks == 10
    sched.block_manager.check_invariants([])


def test_recompute_after_preemption_covers_generated_tokens():
    sched = make_scheduler(num_blocks=8, preempt_watermark=0.0)
    low = make_seq(9, max_tokens=30, priority=0)
    sched.add(low)
    for _ in range(4):
        synthetic_step(sched)
    assert low.num_output_tokens == 4
    vip = make_seq(21, max_tokens=1, priority=1, arrival=1.0, first=500)   # 6 blocks, 5 free
    sched.add(vip)
    batch, _ = synthetic_step(sched)
    assert batch.preempted == [low]
    assert low.num_tokens == 13 and low.num_computed_tokens == 0
    # Readmission recomputes prompt + the 4 generated tokens (minus cached blocks) in one go.
    batch, _ = synthetic_step(sched)
    k = batch.seqs.index(low)
    assert low.num_cached_tokens + batch.num_new_tokens[k] == 13 and batch.sample[k]
    # Its 3 full blocks stayed cached when it was preempted; vip's 6th block evicted the
    # least recently freed one, the tail (freed first), so the first two still hit.
    assert low.num_cached_tokens == 8
    assert low.num_output_tokens == 5


def test_abort_frees_blocks_immediately():
    sched = make_scheduler(num_blocks=32)
    run, wait = make_seq(10, max_tokens=50), make_seq(10, max_tokens=50, arrival=1.0)
    sched.add(run)
    synthetic_step(sched)
    free = sched.block_manager.num_free_blocks
    held = len(run.block_table)
    assert sched.abort(run.seq_id) is run
    assert sched.block_manager.num_free_blocks == free + held
    assert run.finish_reason == "abort" and run.is_finished and sched.num_running == 0
    sched.add(wait)
    assert sched.abort(wait.seq_id) is wait and sched.num_waiting == 0
    assert sched.abort(12345678) is None
    batch, _ = synthetic_step(sched)
    assert batch.seqs == []


def test_abort_between_schedule_and_postprocess_is_ignored():
    sched = make_scheduler()
    a, b = make_seq(5, max_tokens=3), make_seq(5, max_tokens=3, arrival=1.0)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.abort(a.seq_id)
    outs = sched.postprocess(batch, [11, 22])
    assert [o.seq_id for o in outs] == [b.seq_id] and b.output_token_ids == [22]


def test_stop_conditions():
    sched = make_scheduler()
    sched.eos_token_ids = {7}
    eos = make_seq(3, max_tokens=10)
    eos.sampling.ignore_eos = False
    stop = make_seq(3, max_tokens=10, stop_token_ids=[7], arrival=1.0)
    ignore = make_seq(3, max_tokens=2, arrival=2.0)
    for s in (eos, stop, ignore):
        sched.add(s)
    _, outs = synthetic_step(sched, token=7)
    by_id = {o.seq_id: o for o in outs}
    assert by_id[eos.seq_id].finish_reason == "stop"
    assert by_id[stop.seq_id].finish_reason == "stop"
    assert not by_id[ignore.seq_id].finished
    _, outs = synthetic_step(sched, token=7)
    assert outs[0].finish_reason == "length" and ignore.num_output_tokens == 2
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_max_model_len_finishes_with_length():
    sched = make_scheduler()
    sched.max_model_len = 6
    s = make_seq(4, max_tokens=100)
    sched.add(s)
    run_until_done(sched)
    assert s.num_tokens == 6 and s.finish_reason == "length"


def test_first_token_time_is_set_once():
    sched = make_scheduler()
    s = make_seq(4, max_tokens=3)
    sched.add(s)
    synthetic_step(sched)
    first = s.first_token_time
    assert first is not None
    synthetic_step(sched)
    assert s.first_token_time == first


def test_batch_grouped_by_adapter():
    sched = make_scheduler(num_blocks=128)
    adapters = ["b", None, "a", "b", "a", None]
    seqs = [make_seq(4, max_tokens=5, adapter=ad, arrival=i) for i, ad in enumerate(adapters)]
    for s in seqs[:3]:
        sched.add(s)
    synthetic_step(sched)                    # first three now decode
    for s in seqs[3:]:
        sched.add(s)
    batch, _ = synthetic_step(sched)         # three decodes + three prefills
    order = [s.adapter for s in batch.seqs]
    assert order == [None, None, "a", "a", "b", "b"]
    # Inside each adapter group, decodes come before prefills.
    for ad in ("a", "b", None):
        rows = [k for k, s in enumerate(batch.seqs) if s.adapter == ad]
        assert [batch.num_new_tokens[k] for k in rows] == [1, 4]


def test_mode_reflects_the_batch():
    sched = make_scheduler()
    sched.add(make_seq(4, max_tokens=5))
    b1, _ = synthetic_step(sched)
    b2, _ = synthetic_step(sched)
    assert (b1.mode, b2.mode) == ("prefill", "decode")


def test_a_seq_that_outgrows_the_whole_pool_finishes_truncated_instead_of_blocking():
    sched = make_scheduler(num_blocks=6, preempt_watermark=0.0)       # 24 token slots
    big = make_seq(20, max_tokens=30)
    small = make_seq(3, max_tokens=2, arrival=1.0, first=100)
    sched.add(big)
    outs_all = []
    for _ in range(10):
        _, outs = synthetic_step(sched)
        outs_all += outs
    assert big.is_finished and big.finish_reason == "length"
    assert big.num_tokens == 25                 # K/V in all 24 slots, plus the token sampled from them
    assert outs_all[-1].seq_id == big.seq_id and outs_all[-1].finished and outs_all[-1].new_token_ids == []
    sched.add(small)                            # the queue is not blocked behind it
    run_until_done(sched)
    assert small.num_output_tokens == 2
    assert sched.block_manager.num_free_blocks == 6


def test_hybrid_swap_picks_the_cheapest_victim_that_frees_enough_and_resumes_it():
    """Swap preemption (hybrids): among the lowest-priority runners, the victim whose swap copies the
    fewest bytes while freeing enough blocks, not simply the latest arrival; it keeps its computed
    tokens and resumes from them (the engine copies KV + state back), recomputing nothing."""
    from consort_engine.kv.state_pool import pick_victim
    sched = make_scheduler(num_blocks=12, preempt_watermark=0.0, swap=True)
    big, small, late = [make_seq(n, max_tokens=100, priority=0, arrival=a, first=1000 * (k + 1))
                        for k, (n, a) in enumerate([(23, 0.0), (11, 1.0), (7, 2.0)])]   # 6, 3, 2 blocks
    for s in (big, small, late):
        sched.add(s)
    synthetic_step(sched)
    vip = make_seq(11, max_tokens=5, priority=5, arrival=9.0)        # needs 3 blocks (+1 watermark)
    sched.add(vip)
    assert sched.block_manager.num_free_blocks == 1
    batch, _ = synthetic_step(sched)
    # late (2 blocks) does not free enough on its own; small (3) does and copies less than big (6)
    assert batch.preempted == [small] and late.status is SequenceStatus.RUNNING
    assert small.swapped is not None and small.swapped.num_computed_tokens == 11
    assert len(small.swapped.src_blocks) == 3 and small.num_computed_tokens == 0
    assert sched.num_swapped == 1
    while small.status is not SequenceStatus.RUNNING:    # readmitted once the vip is done
        batch, _ = synthetic_step(sched)
    i = batch.seqs.index(small)
    assert batch.num_new_tokens[i] == 1 and batch.sample[i], "resumes with one decode token, no recompute"
    # the pure choice: ties to the latest arrival; nothing frees enough -> the largest
    assert pick_victim([3, 3], need=2, block_bytes=256, state_bytes=1024) == 1
    assert pick_victim([1, 5, 2], need=9, block_bytes=256, state_bytes=1024) == 1


def test_recompute_scheduler_still_preempts_the_latest_arrival():
    sched = make_scheduler(num_blocks=12, preempt_watermark=0.0)
    big, small, late = [make_seq(n, max_tokens=100, priority=0, arrival=a, first=1000 * (k + 1))
                        for k, (n, a) in enumerate([(23, 0.0), (11, 1.0), (7, 2.0)])]
    for s in (big, small, late):
        sched.add(s)
    synthetic_step(sched)
    sched.add(make_seq(11, max_tokens=5, priority=5, arrival=9.0))
    batch, _ = synthetic_step(sched)
    assert batch.preempted[0] is late and late.swapped is None


class ScanCountingList(list):
    scans = 0

    def __contains__(self, item) -> bool:
        ScanCountingList.scans += 1
        return super().__contains__(item)


def test_stop_token_ids_are_a_set_lookup_not_a_list_scan():
    """Issue 25: stop_token_ids was scanned per token (1,024 now at most, protocol.MAX_STOP_TOKEN_IDS)."""
    sched = make_scheduler()
    ids = ScanCountingList(range(100, 1100))
    s = make_seq(3, max_tokens=20, stop_token_ids=ids)
    sched.add(s)
    ScanCountingList.scans = 0
    for _ in range(5):
        synthetic_step(sched, token=7)
    assert ScanCountingList.scans == 0 and s.num_output_tokens == 5
    synthetic_step(sched, token=1099)
    assert s.finish_reason == "stop"
