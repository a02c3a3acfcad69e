"""Packed CPU GEMM weights (models/packed.py) compute x W^T + b like F.linear at every row count,
through every float32 backend: the engine's own kernel (csrc gemm_f32), oneDNN and MKL."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from consort_common.machine import cpu_model_and_flags
from consort_engine.model.cpu_kernels import cpu_kernels
from consort_engine.model.models import packed
from consort_engine.model.models.packed import fp32_backend, pack_linear

HAS_OURS = cpu_kernels() is not None and hasattr(cpu_kernels(), "gemm_f32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    fn = pack_linear(w, b)
    assert fn is not None, "packing applies to CPU fp32/bf16 weights"
    for m in (1, 7, 32, 300):
        x = torch.randn(m, 64, generator=g).to(dtype)
        got, ref = fn(x), F.linear(x, w, b)
        assert got.dtype == dtype and got.shape == ref.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


BACKENDS = [pytest.param("consort", marks=pytest.mark.skipif(not HAS_OURS, reason="kernel needs AVX2 + FMA")),
            "onednn", "mkl"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,k", [(96, 64), (7, 48), (100, 33), (1000, 130), (64, 1)])
def test_every_fp32_backend_matches_f_linear_at_every_row_shape(backend, n, k, monkeypatch):
    """Row counts cover each register tile (AVX2: 6, 4, 2, 1 rows; AVX-512: 1-12) and every way rows
    are cut into tiles (up to 2 x 12 + 1), and the 240-row block edge; n covers partial panels (16
    columns) and partial panel groups (64)."""
    monkeypatch.setenv("CONSORT_GEMM", backend)
    assert fp32_backend() == backend
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        fn = pack_linear(w, bias)
        assert fn is not None
        for m in (*range(26), 32, 239, 240, 241, 500):
            x = torch.randn(m, k, generator=g)
            got, ref = fn(x), F.linear(x, w, bias)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(ref.abs().max().item() if m else 0, 1.0))


@pytest.mark.skipif(not HAS_OURS, reason="kernel needs AVX2 + FMA")
def test_engine_kernel_takes_strided_and_batched_inputs(monkeypatch):
    monkeypatch.setenv("CONSORT_GEMM", "consort")
    w = torch.randn(50, 40)
    fn = pack_linear(w, None)
    rows = torch.randn(9, 80)[:, ::2]                   # a column stride: copied to contiguous rows first
    sliced = torch.randn(9, 60)[:, 10:50]               # a row stride of 60: read in place
    batched = torch.randn(2, 3, 40)
    for x in (rows, sliced, batched):
        torch.testing.assert_close(fn(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_fp32_backend_follows_the_override_then_prefers_the_engine_kernel(monkeypatch):
    for forced in ("onednn", "mkl", "consort"):
        monkeypatch.setenv("CONSORT_GEMM", forced)
        assert fp32_backend() == forced
    monkeypatch.delenv("CONSORT_GEMM")
    assert fp32_backend() == ("consort" if HAS_OURS else "onednn" if torch.backends.mkldnn.is_available() else "mkl")
    monkeypatch.setenv("CONSORT_CPU_KERNEL", "0")                    # kernels off: a library backend
    monkeypatch.setattr("consort_engine.model.cpu_kernels._lib", False)
    assert fp32_backend() == ("onednn" if torch.backends.mkldnn.is_available() else "mkl")


@pytest.mark.skipif(not HAS_OURS, reason="kernel needs AVX2 + FMA")
def test_engine_kernel_uses_avx512_tiles_where_the_cpu_has_them():
    """The build is -march=native: on an AVX-512 CPU the tiles are zmm ones (the 12-row tile exists)."""
    from consort_engine.model.cpu_kernels import cpu_kernels as lib

    assert hasattr(lib(), "gemm_f32")
    tiles = lib().gemm_tile_max_rows()
    assert tiles == (12 if "avx512f" in cpu_model_and_flags()[1] else 6)


def test_packing_skips_what_it_cannot_pack():
    assert pack_linear(torch.randn(3, 4, 5), None) is None          # not a matrix
    assert pack_linear(torch.randn(4, 4, dtype=torch.float64), None) is None


HAS_BF16_GEMM = cpu_kernels() is not None and hasattr(cpu_kernels(), "gemm_bf16")


@pytest.mark.skipif(not HAS_BF16_GEMM, reason="the bf16 kernel needs AVX-512 BF16")
@pytest.mark.parametrize("n,k", [(96, 64), (7, 48), (100, 33), (1000, 130), (64, 1)])
def test_bf16_kernel_rounds_the_fp32_product_once_at_every_row_shape(n, k):
    """csrc gemm_bf16 against the fp32 product of the same bf16 inputs: within one bf16 rounding of it
    (2^-8 relative) plus what a different fp32 summation order can move it ((k - 1) 2^-23 of the sum of
    |x w|), at every tile and every cut of rows into tiles (odd k: a padded pair; n: partial panels and
    groups). A row holding NaN or an infinity gives non-finite outputs in that row only."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    for bias in (None, b):
        fn = packed.consort_bf16(w, bias)
        for m in (*range(26), 32, 239, 240, 241, 500):
            x = torch.randn(m, k, generator=g).bfloat16()
            got = fn(x)
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.dtype == torch.bfloat16 and got.shape == ref.shape
            spread = (k - 1) * 2.0 ** -23 * (x.float().abs() @ w.float().abs().t())
            bound = 2.0 ** -8 * (ref.abs() + spread) + spread + 2.0 ** -23 * ref.abs()
            assert ((got.float() - ref).abs() <= bound).all(), f"{m} rows"
        x = torch.randn(5, k, generator=g).bfloat16()
        x[1, 0], x[3, k - 1] = float("nan"), float("inf")
        got = fn(x)
        assert got[1].isnan().all() and not got[3].isfinite().any()
        assert got[[0, 2, 4]].isfinite().all()


@pytest.mark.skipif(not HAS_BF16_GEMM, reason="the bf16 kernel needs AVX-512 BF16")
def test_bf16_kernel_takes_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(50, 40, generator=g).bfloat16()
    fn = packed.consort_bf16(w, None)
    rows = torch.randn(9, 80, generator=g).bfloat16()[:, ::2]      # a column stride: copied to contiguous rows
    sliced = torch.randn(9, 60, generator=g).bfloat16()[:, 10:50]  # a row stride of 60: read in place
    batched = torch.randn(2, 3, 40, generator=g).bfloat16()
    for x in (rows, sliced, batched):
        assert torch.equal(fn(x), fn(x.contiguous().reshape(-1, 40)).view(*x.shape[:-1], 50))


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """Which bf16 backend each call of a weight packed while the test runs took: "engine" or "onednn"."""
    names: list[str] = []

    def spy(name, pack):
        def packer(weight, bias):
            fn = pack(weight, bias)
            return lambda x: names.append(name) or fn(x)
        return packer
    monkeypatch.setattr(packed, "consort_bf16", spy("engine", packed.consort_bf16))
    monkeypatch.setattr(packed, "_onednn", spy("onednn", packed._onednn))
    return names


@pytest.mark.skipif(not HAS_BF16_GEMM or "amx_bf16" in cpu_model_and_flags()[1],
                    reason="the engine's bf16 kernel runs where AVX-512 BF16 is built and there is no AMX")
def test_bf16_weights_run_the_engine_kernel_up_to_its_rows_then_onednn(ran):
    g = torch.Generator().manual_seed(7)
    w, bias = torch.randn(200, 96, generator=g).bfloat16(), torch.randn(200, generator=g).bfloat16()
    fn = pack_linear(w, bias)
    for m in (1, 40, packed.BF16_KERNEL_ROWS, packed.BF16_KERNEL_ROWS + 1, 700):
        ran.clear()
        x = torch.randn(m, 96, generator=g).bfloat16()
        torch.testing.assert_close(fn(x), F.linear(x, w, bias), rtol=2e-2, atol=0.2)
        assert ran == ["engine" if m <= packed.BF16_KERNEL_ROWS else "onednn"], f"{m} rows"


@pytest.mark.skipif(not HAS_BF16_GEMM, reason="the engine's bf16 kernel is built where AVX-512 BF16 is")
@pytest.mark.parametrize("forced, amx, engine_rows", [("", True, 0), ("consort", True, packed.BF16_KERNEL_ROWS),
                                                      ("onednn", False, 0), ("mkl", False, packed.BF16_KERNEL_ROWS)])
def test_bf16_backend_with_amx_and_as_consort_gemm_says(monkeypatch, ran, forced, amx, engine_rows):
    """With AMX oneDNN takes every bf16 row count, unless CONSORT_GEMM=consort (the engine's kernel up to its
    rows, to compare the two there); CONSORT_GEMM=onednn takes oneDNN's everywhere; mkl has no bf16 GEMM here."""
    model, flags = cpu_model_and_flags()
    flags = flags | {"amx_bf16"} if amx else flags - {"amx_bf16"}
    monkeypatch.setattr(packed, "cpu_model_and_flags", lambda: (model, flags))
    monkeypatch.setenv("CONSORT_GEMM", forced)
    g = torch.Generator().manual_seed(8)
    w = torch.randn(64, 96, generator=g).bfloat16()
    fn = pack_linear(w, None)
    for m in (1, packed.BF16_KERNEL_ROWS, packed.BF16_KERNEL_ROWS + 1):
        ran.clear()
        x = torch.randn(m, 96, generator=g).bfloat16()
        torch.testing.assert_close(fn(x), F.linear(x, w), rtol=2e-2, atol=0.2)
        assert ran == ["engine" if m <= engine_rows else "onednn"], f"{m} rows"
