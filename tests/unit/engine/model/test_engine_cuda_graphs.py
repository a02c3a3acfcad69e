"""Decode CUDA graphs and pinned staging, everything but the capture/replay call itself, on CPU.

DecodeGraphs(capture=False) runs the exact static-buffer path a captured graph replays (inputs padded
to the bucket, pad rows in the scratch block, lengths read from tensors) as an eager forward, through
a real ModelRunner on a demo checkpoint: the n real rows' logits must equal the unpadded eager step's,
and the pad rows must leave every slot of the block manager's blocks as the eager step leaves it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from consort_engine.bench import offline as bench_offline

from consort_engine.serving import cli as server
from consort_engine.config import EngineConfig
from consort_engine.model.cuda_graphs import (DecodeBuffers, DecodeGraphs, bucket_for, capture_sizes,
                                        decode_graph_eligible, fill_decode_buffers, pad_rows, use_decode_graphs)
from consort_engine.model.host_staging import ALIGN, PinnedStaging, pack, packed_layout, unpack
from consort_engine.model.model_runner import ModelRunner
from consort_engine.model.step_inputs import RowGroup
from consort_engine.kv.sequence import SamplingParams, ScheduledBatch, Sequence

BS = 4
MAX_NUM_SEQS = 12       # buckets 1, 2, 4, 8, 12


# ---------------------------------------------------------------------------------------------- pure parts
def test_capture_sizes_are_vllms_buckets_capped_at_max_num_seqs_and_512():
    assert capture_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert capture_sizes(12) == [1, 2, 4, 8, 12]            # the cap itself: every batch has a graph
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    big = capture_sizes(4096)
    assert big[-1] == 512 and len(big) == 3 + 64


def test_bucket_for_is_the_smallest_bucket_that_holds_n():
    buckets = capture_sizes(100)
    for n in range(1, 101):
        b = bucket_for(n, buckets)
        assert b >= n and not any(n <= c < b for c in buckets), n
    assert bucket_for(101, buckets) is None
    assert bucket_for(5, buckets) == 8 and bucket_for(8, buckets) == 8 and bucket_for(9, buckets) == 16


def test_graphs_are_captured_only_on_cuda_with_an_in_place_backend():
    assert use_decode_graphs("cuda", False, "flash", 1, False)
    assert use_decode_graphs("cuda", False, "triton", 1, False)
    assert not use_decode_graphs("cpu", False, "cpu_kernel", 1, False)      # CPU never captures
    assert not use_decode_graphs("cpu", False, "triton", 1, False)
    assert not use_decode_graphs("cuda", True, "flash", 1, False)           # --enforce-eager
    assert not use_decode_graphs("cuda", False, "torch", 1, False)          # gathers max_model_len per row
    assert not use_decode_graphs("cuda", False, "flash", 2, False)          # tensor parallel
    assert not use_decode_graphs("cuda", False, "flash", 1, True)           # hybrid state


@pytest.mark.parametrize(("new", "sampled", "flags", "ok"), [
    ([1, 1, 1], [1, 1, 1], {}, True),
    ([1] * 12, [1] * 12, {}, True),
    ([1] * 13, [1] * 13, {}, False),                     # above the largest bucket
    ([], [], {}, False),
    ([1, 5], [1, 1], {}, False),                         # a prefill chunk
    ([1, 1], [1, 0], {}, False),                         # a row not sampled
    ([1, 4], [1, 4], {}, False),                         # a verify window
    ([1, 1], [1, 1], {"lora": True}, False),
    ([1, 1], [1, 1], {"prompt_logprobs": True}, False),
    ([1, 1], [1, 1], {"hybrid": True}, False),
    ([1, 1], [1, 1], {"tp_size": 2}, False),
])
def test_which_steps_a_decode_graph_replays(new, sampled, flags, ok):
    kw = {"lora": False, "prompt_logprobs": False, "hybrid": False, "tp_size": 1, **flags}
    assert decode_graph_eligible(new, sampled, max_bucket=12, **kw) is ok


def test_pack_and_unpack_round_trip_at_aligned_offsets():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 1 << 40, s, generator=g) for s in [(5,), (0,), (3, 7), (17,), (1,)]]
    offsets, total = packed_layout([t.shape for t in ts])
    assert offsets == [0, 16, 16, 48, 80] and total == 96 and all(o % ALIGN == 0 for o in offsets)
    flat = torch.full((total + 5,), -1, dtype=torch.int64)
    assert pack(ts, flat) == offsets
    back = unpack(flat, [t.shape for t in ts])
    for t, v in zip(ts, back):
        assert torch.equal(t, v) and v.is_contiguous()
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()   # views, not copies
    with pytest.raises(AssertionError):
        pack([torch.zeros(3, dtype=torch.int32)], flat)                            # one dtype per buffer
    with pytest.raises(AssertionError):
        pack([torch.zeros(100, dtype=torch.int64)], flat)                          # does not fit


def test_staging_reuses_one_host_buffer_per_dtype_and_grows_it():
    staging = PinnedStaging(torch.device("cpu"))       # the CUDA one is pinned and waits for its last copy
    first = staging.to_device([torch.arange(5), torch.arange(6).view(2, 3)])
    assert [t.tolist() for t in first] == [list(range(5)), [[0, 1, 2], [3, 4, 5]]]
    buf = staging.host(torch.int64, 1)
    second = staging.to_device([torch.full((7,), 9)])
    assert second[0].tolist() == [9] * 7 and first[0].tolist() == list(range(5)), "results are not host views"
    assert staging.host(torch.int64, 1).data_ptr() == buf.data_ptr()              # reused across steps
    big = staging.to_device([torch.arange(10_000), torch.ones(3, dtype=torch.int64)])
    assert torch.equal(big[0], torch.arange(10_000)) and staging.host(torch.int64, 1).numel() >= 10_016
    ints = staging.to_device([torch.tensor([1, 2], dtype=torch.int32)])
    assert ints[0].dtype == torch.int32 and ints[0].tolist() == [1, 2]


def test_a_bucket_layout_is_a_prefix_of_the_largest_and_pads_into_the_scratch_block():
    n64, n32 = DecodeBuffers.sizes(12, 6)
    flat64, flat32 = torch.full((n64,), -7, dtype=torch.int64), torch.full((n32,), -7, dtype=torch.int32)
    assert DecodeBuffers.sizes(4, 6)[0] <= n64 and DecodeBuffers.sizes(4, 6)[1] <= n32
    big64, big32 = DecodeBuffers.sizes(512, 9)
    for b in capture_sizes(512):      # every bucket's layout is a prefix of the largest's flat tensors
        small64, small32 = DecodeBuffers.sizes(b, 9)
        assert small64 <= big64 and small32 <= big32
        views = DecodeBuffers.views(torch.zeros(big64, dtype=torch.int64), torch.zeros(big32, dtype=torch.int32), b, 9)
        assert views.block_tables.shape == (b, 9) and views.cu_query_lens.shape == (b + 1,)
    buf = DecodeBuffers.views(flat64, flat32, 4, 6)
    from consort_engine.model.attention import AttentionMetadata
    from consort_engine.model.step_inputs import StepInputs
    meta = AttentionMetadata(slot_mapping=torch.tensor([13, 6]), num_batched_tokens=2,
                             block_tables=torch.tensor([[3, 0], [1, 9]], dtype=torch.int32),
                             context_lens=torch.tensor([2, 3], dtype=torch.int32),
                             cu_query_lens=torch.tensor([0, 1, 2], dtype=torch.int32))
    inp = StepInputs(torch.tensor([70, 71]), torch.tensor([1, 2]), meta, torch.tensor([0, 1]))
    fill_decode_buffers(buf, inp, scratch_block=50, block_size=BS)
    assert buf.input_ids.tolist() == [70, 71, 0, 0] and buf.positions.tolist() == [1, 2, 0, 0]
    assert buf.slot_mapping.tolist() == [13, 6, 200, 200]                  # pad rows: slot 0 of block 50
    assert buf.context_lens.tolist() == [2, 3, 1, 1]                       # one visible token: no empty softmax
    assert buf.cu_query_lens.tolist() == [0, 1, 2, 3, 4]
    assert buf.block_tables.tolist() == [[3, 0, 50, 50, 50, 50], [1, 9, 50, 50, 50, 50]] + [[50] * 6] * 2


# ---------------------------------------------------------------------------------------------- real runner
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from consort_engine.demo_model import train_tokenizer, write_demo_model
    return write_demo_model(tmp_path_factory.mktemp("graphs") / "demo", hidden=64, layers=2, heads=4, kv_heads=2,
                            ffn=128, vocab=512, max_pos=256, seed=1,
                            tokenizer=train_tokenizer(512, limit_bytes=300_000))


def _slots(runner: ModelRunner, kv: torch.Tensor | None = None) -> torch.Tensor:
    """The pool (or a copy of it) as [layers, 2, slots, kv_heads, D] in either layout (slot = block * BS + offset)."""
    kv = runner.kv_cache if kv is None else kv
    if runner.backend == "cpu_kernel":          # [L, 2, blocks, kvh, bs, D]
        kv = kv.transpose(3, 4)
    return kv.reshape(kv.shape[0], 2, -1, kv.shape[-2], kv.shape[-1])


def _prefilled(runner: ModelRunner, n: int) -> list[Sequence]:
    """n sequences of different lengths, prefilled; sequence 0 owns block 0 (where a pad row writing
    slot 0 of block 0 would land), the rest take blocks from a shuffled free list."""
    g = torch.Generator().manual_seed(n)
    free = torch.randperm(runner.num_blocks - 1, generator=g).add(1).tolist()
    seqs = []
    for i in range(n):
        s = Sequence(prompt_token_ids=torch.randint(3, runner.vocab_size, (3 + 5 * i,), generator=g).tolist(),
                     sampling=SamplingParams(temperature=0.0))
        need = -(-(len(s.token_ids) + 8) // BS)          # room for the decode steps below
        s.block_table = ([0] if i == 0 else []) + [free.pop() for _ in range(need - (i == 0))]
        seqs.append(s)
    runner.execute(ScheduledBatch(seqs, [s.num_tokens for s in seqs], [True] * n, mode="prefill"))
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(7)
    return seqs


SENTINEL = 12345.0     # what the scratch block holds before each step (finite: gathers multiply it by 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their bits: the CPU kernel's pool is uninitialised memory, which may hold NaNs."""
    return t.contiguous().view(torch.int32)


def check_static_decode_equals_eager(demo, n: int) -> None:
    runner = ModelRunner(EngineConfig(model=str(demo), block_size=BS, num_blocks=128, dtype="float32",
                                      max_num_seqs=MAX_NUM_SEQS))
    assert runner.backend == os.environ.get("CONSORT_ATTENTION_BACKEND", "cpu_kernel")
    assert runner.scratch_block == 128 and runner.num_blocks == 128 and runner.kv_cache.shape[2] == 129
    graphs = DecodeGraphs(runner, capture=False)
    bucket = bucket_for(n, graphs.buckets)
    seqs = _prefilled(runner, n)
    real = slice(0, runner.num_blocks * BS)
    scratch = slice(runner.scratch_block * BS, (runner.scratch_block + 1) * BS)
    for step in range(3):
        batch = ScheduledBatch(seqs, [1] * n, [True] * n, mode="decode")
        written = torch.tensor([s.block_table[s.num_computed_tokens // BS] * BS + s.num_computed_tokens % BS
                                for s in seqs])
        runner.kv_cache[:, :, runner.scratch_block] = SENTINEL      # block dim 2 in both layouts
        before = runner.kv_cache.clone()
        runner.decode_graphs = None
        eager = runner.execute(batch)
        eager_kv = _slots(runner)[:, :, real].clone()
        runner.kv_cache.copy_(before)
        runner.decode_graphs = graphs
        assert graphs.can_run(batch)
        runs = graphs.num_runs
        static = runner.execute(batch)
        assert graphs.num_runs == runs + 1, "the step went through the static buffers"
        assert static.shape == eager.shape == (n, runner.vocab_size) and torch.isfinite(static).all()
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        assert torch.equal(static.argmax(-1), eager.argmax(-1))
        kv = _slots(runner)
        # the real rows wrote what the eager step wrote; no other slot of a real block changed
        torch.testing.assert_close(kv[:, :, written], eager_kv[:, :, written], rtol=1e-5, atol=1e-5)
        others = torch.ones(runner.num_blocks * BS, dtype=torch.bool)
        others[written] = False
        untouched = _bits(kv[:, :, real][:, :, others])
        assert torch.equal(untouched, _bits(_slots(runner, before)[:, :, real][:, :, others]))
        assert torch.equal(untouched, _bits(eager_kv[:, :, others]))
        # the pad rows (if any) wrote their K/V into the scratch block's first slot, nowhere else
        pad = kv[:, :, scratch]
        assert (pad[:, :, 1:] == SENTINEL).all()
        assert ((pad[:, :, 0] != SENTINEL).any() and torch.isfinite(pad[:, :, 0]).all()) if bucket > n \
            else (pad[:, :, 0] == SENTINEL).all()
        for s, t in zip(seqs, eager.argmax(-1).tolist()):
            s.num_computed_tokens += 1
            s.token_ids.append(t)


@pytest.mark.parametrize("n", [1, 3, 5, 8, 11])          # buckets 1, 4, 8, 8, 12
def test_static_padded_decode_equals_eager_and_spares_real_blocks(demo, n):
    check_static_decode_equals_eager(demo, n)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_padded_decode_on_the_other_backends(demo, backend, monkeypatch, request):
    """The torch gather and the Triton kernel (under its interpreter, in a fresh process: it must be on
    before triton is imported) read the true lengths from the static tensors as well."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", request.node.nodeid, "-q", "-p", "no:cacheprovider"],
                              env=env, capture_output=True, text=True, timeout=900, cwd=request.config.rootpath)
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
        return
    monkeypatch.setenv("CONSORT_ATTENTION_BACKEND", backend)
    for n in (3, 5):
        check_static_decode_equals_eager(demo, n)


def test_the_all_pad_step_captures_run_over_touches_only_the_scratch_block(demo):
    """What capture_all runs (eagerly to warm up, then under capture) before any request: every row a pad row."""
    runner = ModelRunner(EngineConfig(model=str(demo), block_size=BS, num_blocks=128, dtype="float32",
                                      max_num_seqs=MAX_NUM_SEQS))
    graphs = DecodeGraphs(runner, capture=False)
    _prefilled(runner, 2)
    before = _slots(runner).clone()
    for b in graphs.buckets[::-1]:
        pad_rows(graphs.buffers[b], 0, runner.scratch_block, BS)
        assert torch.isfinite(graphs._forward(b)).all()
    after = _slots(runner)
    real = slice(0, runner.num_blocks * BS)
    assert torch.equal(_bits(after[:, :, real]), _bits(before[:, :, real]))
    assert not torch.equal(after[:, :, runner.scratch_block * BS], before[:, :, runner.scratch_block * BS])


def test_steps_a_graph_cannot_replay_run_eagerly(demo):
    runner = ModelRunner(EngineConfig(model=str(demo), block_size=BS, num_blocks=128, dtype="float32",
                                      max_num_seqs=MAX_NUM_SEQS))
    runner.decode_graphs = graphs = DecodeGraphs(runner, capture=False)
    seqs = _prefilled(runner, 3)
    assert graphs.num_runs == 0, "a prefill never goes through the decode buffers"
    asks = Sequence(prompt_token_ids=[3, 4, 5], sampling=SamplingParams(temperature=0.0, prompt_logprobs=2))
    assert asks.needs_prompt_logprobs
    assert not graphs.can_run(ScheduledBatch([seqs[0], asks], [1, 1], [True, True]))
    seqs[2].adapter = "a"
    assert not graphs.can_run(ScheduledBatch(seqs, [1] * 3, [True] * 3))
    seqs[2].adapter = None
    assert graphs.can_run(ScheduledBatch(seqs, [1] * 3, [True] * 3))
    assert not graphs.can_run(ScheduledBatch(seqs, [1, 1, 1], [True, False, True]))
    assert not graphs.can_run(ScheduledBatch(seqs, [1, 1, 1], [True] * 3, mode="spec_verify", num_draft=[0, 2, 0]))


def test_cpu_runner_never_captures_and_its_inputs_stay_plain_host_tensors(demo):
    runner = ModelRunner(EngineConfig(model=str(demo), block_size=BS, max_num_seqs=4))
    runner.warmup()
    assert runner.decode_graphs is None and runner.staging is None
    inp = runner.build_inputs([RowGroup([5], 3, [0], 1), RowGroup([6, 7], 0, [1], 1)])
    assert inp.input_ids.device.type == "cpu" and inp.input_ids._base is None     # no staging views on CPU


def test_enforce_eager_reaches_the_engine_from_the_server_and_the_bench(tmp_path):
    base = ["--model", str(tmp_path), "--port", "0"]
    assert not server.config_from_args(server.parse_args(base)).enforce_eager
    assert server.config_from_args(server.parse_args(base + ["--enforce-eager"])).enforce_eager
    import argparse
    p = argparse.ArgumentParser()
    bench_offline.add_args(p)
    args = p.parse_args(["--device", "cuda", "--enforce-eager"])
    assert "--enforce-eager" in bench_offline.server_argv(tmp_path, "bfloat16", args)
    assert bench_offline.engine_config(tmp_path, "bfloat16", args).enforce_eager
    assert not bench_offline.engine_config(tmp_path, "bfloat16", p.parse_args(["--device", "cuda"])).enforce_eager
