"""Packed CPU GEMM weights (models/packed.py) compute x W^T + b like F.linear at every row count."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from consort_engine.models.packed import pack_linear


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


def test_packing_skips_what_it_cannot_pack():
    assert pack_linear(torch.randn(3, 4, 5), None) is None          # not a matrix
    assert pack_linear(torch.randn(4, 4, dtype=torch.float64), None) is None
