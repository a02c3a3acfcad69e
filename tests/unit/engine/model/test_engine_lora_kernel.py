"""LoRA's update on CPU (csrc/lora.c through ops.add_lora_): a segment's rows of one projection's shard gain
(x A^T) Bt rounded to the row type, against the same sum in float64, in fp32 and bf16, on one thread and on
the team, with strided rows, in every build this CPU runs (tiles of 6 rows with AVX-512, 2 with AVX2); rows
outside the segment and columns outside the shard stay as they were. Several updates in one call (lora_jobs)
get the bits each gets alone."""
from __future__ import annotations

import ctypes
from ctypes import c_int64, c_void_p

import pytest
import torch
from kernel_levels import ON_X86_64, build_levels, each_build

from consort_engine.model import cpu_kernels as ck
from consort_engine.model.models import ops

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler for the CPU kernels")

# (rows in the segment, k, rank, n): below and above the kernel's single-thread bound (LORA_PARALLEL), k and n
# off the vector width, n across the column chunks (256), rank 1 and odd ranks
SHAPES = ((1, 64, 8, 100), (3, 100, 1, 1), (1, 512, 16, 1536), (37, 512, 13, 700), (5, 96, 64, 257),
          (300, 256, 8, 256))


def case(rows: int, k: int, r: int, n: int, dtype: torch.dtype, seed: int):
    """x [rows + 6, k] as a view of wider rows, y [rows + 6, n + 9] (also strided), one pair at column 4,
    the segment rows 2 .. rows + 2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows + 6, k + 5, generator=g).to(dtype)[:, :k]
    y = torch.randn(rows + 6, n + 20, generator=g).to(dtype)[:, 3:n + 12]
    a = torch.randn(r, k, generator=g) / k ** 0.5
    bt = torch.randn(r, n, generator=g) / r ** 0.5
    return x, y, [(4, n, a, bt)], 2, rows + 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_update_equals_the_sum_in_float64(shape, dtype):
    check_update(shape, dtype)


@ON_X86_64
def test_update_equals_the_sum_in_float64_in_every_build_this_cpu_runs(tmp_path_factory, monkeypatch):
    for _ in each_build(build_levels(tmp_path_factory, "lora", "team"), monkeypatch):
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                check_update(shape, dtype)


def check_update(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    x, y, pairs, start, end = case(*shape, dtype, seed=sum(shape))
    before = y.clone()
    ops.add_lora_(y, x, start, end, pairs)
    (offset, n, a, bt), = pairs
    delta = (x[start:end].double() @ a.double().t()) @ bt.double()
    want = before[start:end, offset:offset + n].double() + delta.to(dtype).double()
    got = y[start:end, offset:offset + n].double()
    # fp32: the sums' rounding; bf16: the update and the sum each rounded once to bf16 (an ulp of the update,
    # whose fp32 sum may fall on the other side of a tie, and half an ulp of the sum)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert ((got - want).abs() <= tol * (delta.abs() + want.abs()) + 1e-6).all()
    assert (got - before[start:end, offset:offset + n].double()).abs().max() > 0.1     # the update landed
    untouched = torch.ones_like(y, dtype=torch.bool)
    untouched[start:end, offset:offset + n] = False
    assert torch.equal(y[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_torch_ops_agree(dtype, monkeypatch):
    """The same update through the kernel and through the two matmuls (the path off CPU or without kernels)."""
    x, y, pairs, start, end = case(37, 512, 13, 700, dtype, seed=7)
    by_torch = y.clone()
    ops.add_lora_(y, x, start, end, pairs)
    monkeypatch.setattr(ops, "cpu_kernels", lambda: None)
    ops.add_lora_(by_torch, x, start, end, pairs)
    if dtype == torch.float32:
        torch.testing.assert_close(y, by_torch, rtol=1e-5, atol=1e-5)
    else:      # the update's rounding may fall either side of a tie, and the sum's with it: an ulp of each apart
        (offset, n, a, bt), = pairs
        delta = torch.zeros_like(y, dtype=torch.float32)
        delta[start:end, offset:offset + n] = x[start:end].float() @ a.t() @ bt
        assert ((y.float() - by_torch.float()).abs() <= 2.0 ** -7 * (delta.abs() + by_torch.float().abs())).all()
        assert (y != by_torch).float().mean() < 0.01


def test_every_pair_of_the_adapter_lands_on_its_shard():
    """A fused projection's shards (q, k, v): each pair updates its own columns only."""
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(6, 64, generator=g), torch.randn(6, 48, generator=g)
    before = y.clone()
    pairs = [(0, 16, torch.randn(4, 64, generator=g), torch.randn(4, 16, generator=g)),
             (32, 16, torch.randn(4, 64, generator=g), torch.randn(4, 16, generator=g))]
    ops.add_lora_(y, x, 1, 4, pairs)
    for offset, n, a, bt in pairs:
        torch.testing.assert_close(y[1:4, offset:offset + n], before[1:4, offset:offset + n] + x[1:4] @ a.t() @ bt,
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1:4, 16:32], before[1:4, 16:32])      # the shard without a pair
    assert torch.equal(y[[0, 4, 5]], before[[0, 4, 5]])


class _Job(ctypes.Structure):        # csrc/lora.h lora_job_t
    _fields_ = [("x", c_void_p), ("ldx", c_int64), ("rows", c_int64), ("k", c_int64), ("a", c_void_p),
                ("bt", c_void_p), ("r", c_int64), ("n", c_int64), ("y", c_void_p), ("ldy", c_int64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jobs_in_one_call_equal_each_alone_on_any_team(dtype):
    """lora_jobs (the decoder layers' call: every segment and shard of a projection at once) gives each job the
    bits it gets alone, on two threads and on one; a job of no rows changes nothing."""
    shapes = ((3, 512, 8, 512), (4, 512, 8, 256), (1, 512, 13, 700), (37, 100, 4, 64), (0, 512, 8, 512))
    cases = [case(*shape, dtype, seed=i) for i, shape in enumerate(shapes)]
    alone = []
    for x, y, pairs, start, end in cases:
        y = y.clone()
        ops.add_lora_(y, x, start, end, pairs)
        alone.append(y)
    threads = torch.get_num_threads()
    for team in (threads, 1):
        ck.set_threads(team)
        try:
            ys = [y.clone() for _, y, _, _, _ in cases]
            e = ys[0].element_size()
            jobs = (_Job * len(cases))(*(
                _Job(x.data_ptr() + start * x.stride(0) * e, x.stride(0), end - start, x.shape[1], a.data_ptr(),
                     bt.data_ptr(), a.shape[0], n, y.data_ptr() + (start * y.stride(0) + offset) * e, y.stride(0))
                for (x, _, [(offset, n, a, bt)], start, end), y in zip(cases, ys)))
            fn = ck.kernel("lora_jobs", dtype)
            assert fn(jobs, len(cases)) == 0
        finally:
            ck.set_threads(threads)
        for got, want in zip(ys, alone):
            assert torch.equal(got, want)
    assert torch.equal(ys[-1], cases[-1][1])          # the job of no rows
