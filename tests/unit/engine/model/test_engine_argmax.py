"""Greedy decoding's argmax kernel (csrc/argmax.c through ops.argmax_rows) picks what torch.max(dim=-1)
picks: the first of equal maxima, the first NaN, wherever they fall (in a chunk, across chunks, in the
tail after the last whole chunk), in fp32 and bf16, in every build this CPU runs."""
from __future__ import annotations

import pytest
import torch

from consort_common.machine import cpu_model_and_flags
from consort_engine.model import cpu_kernels as ck
from consort_engine.model.models import ops
from consort_engine.model.models.ops import argmax_rows
from consort_engine.model.sampler import Sampler
from consort_engine.kv.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler for the CPU kernels")

LENGTHS = (1, 7, 511, 512, 513, 1024, 1500, 32000)   # below a chunk (512), whole chunks, chunks + a tail


def rows_to_check() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in LENGTHS:
        rows.append(torch.randn(5, n, generator=g))
        rows.append(torch.randint(-3, 4, (5, n), generator=g).float())     # many equal maxima
    n = 1100                                               # 2 chunks of 512 and a tail of 76
    for spots, value in (((10, 550), 5.0), ((550,), 5.0), ((1050, 20), 5.0), ((1090,), 5.0), ((700, 10), 5.0)):
        r = torch.zeros(n)
        for i in spots:
            r[i] = value
        rows.append(r[None])
    r = torch.zeros(3, n)
    r[0, 550], r[0, 10] = 6.0, 5.0            # a larger value in a later chunk wins
    r[1, 1050], r[1, 600] = 5.0, 5.0          # the tail ties a chunk: the chunk's comes first
    r[2, 1050], r[2, 600] = 7.0, 5.0          # a larger value in the tail wins
    rows.append(r)
    for at in (3, 700, 1090):                  # the first NaN wins, before or after the largest value
        r = torch.randn(2, n, generator=g)
        r[:, 600] = 100.0
        r[0, at] = float("nan")
        r[1, at], r[1, at + 5] = float("nan"), float("nan")
        rows.append(r)
    r = torch.randn(4, n, generator=g)
    r[0, 900] = float("inf")
    r[1, 5] = float("-inf")
    r[2] = float("-inf")
    r[3, 200], r[3, 100] = float("inf"), float("inf")
    rows.append(r)
    z = torch.zeros(2, n)
    z[0, :300] = -0.0                          # -0 and +0 are equal: the first index
    z[1] -= 1.0
    z[1, 800], z[1, 40] = 0.0, -0.0
    rows.append(z)
    return rows


def check_rows() -> None:
    for x in rows_to_check():
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            assert torch.equal(argmax_rows(xd), xd.max(dim=-1).indices), (dtype, x.shape)
            wide = torch.full((x.shape[0], x.shape[1] + 9), 1e4, dtype=dtype)
            wide[:, : x.shape[1]] = xd          # rows at a stride longer than the row
            assert torch.equal(argmax_rows(wide[:, : x.shape[1]]), xd.max(dim=-1).indices), (dtype, x.shape)


def test_argmax_rows_breaks_ties_and_nans_as_torch_max():
    check_rows()


def test_argmax_rows_falls_back_to_torch_off_the_kernels_cases():
    x = torch.randn(6, 40)
    assert torch.equal(argmax_rows(x.t()), x.t().max(dim=-1).indices)                # not unit stride
    assert torch.equal(argmax_rows(x.double()), x.double().max(dim=-1).indices)      # not fp32 / bf16
    assert torch.equal(argmax_rows(x[0]), x[0].max(dim=-1).indices)                  # one row, 1-D


def test_greedy_sampling_takes_the_kernels_argmax(monkeypatch):
    called = []

    def recording(name, dtype, kv_dtype=None):
        called.append(name)
        return ck.kernel(name, dtype, kv_dtype)
    monkeypatch.setattr(ops, "kernel", recording)
    logits = torch.zeros(2, 1500)
    logits[0, 1200], logits[0, 300] = 2.0, 2.0
    logits[1, 1499] = 1.0
    seqs = [Sequence(prompt_token_ids=[1, 2], sampling=SamplingParams(temperature=0.0)) for _ in range(2)]
    assert Sampler().sample(logits, seqs)[0] == [300, 1499]
    assert called == ["argmax_rows"]


RUNNABLE_LEVELS = ck.runnable_levels(cpu_model_and_flags()[1])


@pytest.mark.skipif(not RUNNABLE_LEVELS, reason="the engine image's builds are for x86-64 CPUs")
def test_argmax_rows_in_every_build_this_cpu_runs(tmp_path, monkeypatch):
    """The zmm (v4), ymm (v3) and scalar (v2) builds, not only the library loaded here."""
    sources = [p for p in ck.SOURCES if p.stem in ("argmax", "team")]
    for level in RUNNABLE_LEVELS:
        so = tmp_path / f"argmax-{level}.so"
        ck.compile_sources(so, level, sources=sources)
        monkeypatch.setattr(ck, "_lib", ck.load_library(so))
        check_rows()
