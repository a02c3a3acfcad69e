"""Scheduler under random traffic: arrivals with mixed priorities, aborts and a small pool.
Whatever happens, blocks are accounted exactly, limits hold, and every request either is
aborted or finishes with exactly its max_tokens."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from engine_fakes import make_scheduler, swapped_in

from consort_engine.kv.sequence import SamplingParams, Sequence, SequenceStatus

request_st = st.tuples(st.integers(1, 40),      # prompt length
                       st.integers(1, 30),      # max_tokens
                       st.integers(0, 3),       # priority
                       st.sampled_from([None, "a", "b"]),
                       st.integers(0, 3))       # prompt family (shared prefixes)
event_st = st.one_of(st.tuples(st.just("add"), request_st),
                     st.tuples(st.just("abort"), st.integers(0, 50)),
                     st.tuples(st.just("step"), st.integers(1, 3)))


@settings(max_examples=120, deadline=None)
@given(events=st.lists(event_st, min_size=4, max_size=60), num_blocks=st.integers(12, 32),
       budget=st.sampled_from([8, 16, 64]), max_seqs=st.integers(1, 8), speculate=st.booleans(),
       swap=st.booleans())
def test_random_traffic_keeps_invariants_and_finishes_everything(events, num_blocks, budget, max_seqs, speculate,
                                                                 swap):
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                           preempt_watermark=0.1, speculative="ngram" if speculate else "off",
                           num_speculative_tokens=3, swap=swap)
    bm = sched.block_manager
    seqs: list[Sequence] = []
    clock = [0.0]

    def step():
        batch = sched.schedule()
        for s in batch.preempted:    # a swap keeps exactly the computed tokens' blocks of the victim
            if s.swapped is not None:
                assert len(s.swapped.src_blocks) == -(-s.swapped.num_computed_tokens // bm.block_size)
                assert s.swapped.num_computed_tokens < s.num_tokens
        swapped_in(batch)
        assert batch.num_tokens <= budget and len(batch) <= max_seqs
        assert sched.num_running <= max_seqs
        assert len({s.seq_id for s in batch.seqs}) == len(batch)
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            assert s.status is SequenceStatus.RUNNING and n > 0
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens + n
        adapters = [s.adapter or "" for s in batch.seqs]
        assert adapters == sorted(adapters) or len(set(adapters)) == 1
        # One synthetic token per sampled row, a function of (sequence, position): drafts copied from
        # the context sometimes agree with it, sometimes not.
        tokens = []
        for i, s in enumerate(batch.seqs):
            rows = batch.rows_sampled(i)
            tokens += [(s.seq_id * 7 + p // 3) % 5 + 1 for p in range(s.num_tokens - rows, s.num_tokens)]
        outs = sched.postprocess(batch, tokens)
        bm.check_invariants(sched.running)
        return batch, outs

    for kind, arg in events:
        if kind == "add":
            n, max_tokens, prio, adapter, family = arg
            clock[0] += 1.0
            prompt = [family * 100 + i for i in range(n)]
            seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           priority=prio, arrival=clock[0], adapter=adapter)
            if -(-(n + sched.num_lookahead) // bm.block_size) <= num_blocks:   # the engine rejects never-fitting prompts
                seqs.append(seq)
                sched.add(seq)
        elif kind == "abort":
            if seqs:
                target = seqs[arg % len(seqs)]
                was_live = not target.is_finished
                got = sched.abort(target.seq_id)
                assert (got is target) == was_live
                assert target.block_table == []
                bm.check_invariants(sched.running)
        else:
            for _ in range(arg):
                step()

    for _ in range(5000):
        if not sched.has_unfinished():
            break
        batch, outs = step()
        assert batch.seqs or outs, "stalled with unfinished requests"
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
    for s in seqs:
        assert s.is_finished
        if s.finish_reason != "abort":
            assert s.finish_reason == "length"
            if s.num_output_tokens != s.sampling.max_tokens:
                # Truncated only because it outgrew the whole pool (with its speculative lookahead slots).
                assert -(-(s.num_tokens + sched.num_lookahead) // bm.block_size) > num_blocks
