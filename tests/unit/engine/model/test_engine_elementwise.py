"""The element-wise C kernels (csrc/elementwise.c: RMSNorm, residual add + RMSNorm, per-head RMSNorm in
place, rotate-half RoPE in place, SiLU-and-multiply) compute what the torch path of models/ops.py computes,
in float32 and bfloat16, for rows whose width is and is not a multiple of the vector (the vector loop and
the element-at-a-time tail), in every build of the library this CPU runs (plain loops at x86-64-v2, ymm at
v3, zmm at v4, vcvtneps2bf16's rounding with AVX-512 BF16). RMSNorm against transformers' formula, which
rounds the normalised row before the weight's multiply (torch's fused rms_norm rounds once)."""
from __future__ import annotations

import pytest
import torch

from consort_engine.model.cpu_kernels import cpu_kernels
from kernel_levels import ON_X86_64, build_levels, each_build
from consort_engine.model.models import ops

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs a C compiler")

DTYPES = (torch.float32, torch.bfloat16)
WIDTHS = (512, 40, 72)         # 16 vectors of zmm; 2 zmm + 8 (or 5 ymm); 4 zmm + 8 (9 ymm): tails each
ROWS = (3, 70)                 # one thread's loop; 64 rows and more take the team


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float32: to a few ulps. bfloat16: the kernels round where the torch path rounds, so elements differ
    only where the float32 values before a rounding differ in their last bits (another summation order,
    1 / sqrt against rsqrt, the exponential): by two bf16 steps at most (a step at the rounding before the
    weight's multiply, then that multiply's own), in few elements."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    g, w = got.float(), want.float()
    if got.dtype == torch.float32:
        torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-6, msg=what)
        return
    # |w| 2^-7 is at least one bf16 step of w; below 1e-30 anything (silu of -100: torch's -3.7e-42 is
    # ours -6e-37, the exponential clamped at e^88)
    step = torch.clamp(w.abs() * 2.0 ** -7, min=1e-30)
    off = (g - w).abs()
    assert bool((off <= 2 * step).all()), f"{what}: {off.max().item()} away"
    differ = int((off > 0).sum())
    assert differ <= max(3, 0.02 * off.numel()), f"{what}: {differ} of {off.numel()} differ"


def transformers_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def check_kernels(dtype: torch.dtype, width: int, rows: int, seed: int, level: str = "loaded") -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(dtype)
    resid = torch.randn(rows, width, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
    what = f"{dtype} rows={rows} width={width} ({level})"

    assert_close(ops.rms_norm(x, w, 1e-6, True), transformers_rms_norm(x, w, 1e-6), f"rms_norm {what}")

    r_fast, r_ref = resid.clone(), resid.clone()
    out_fast, r_fast = ops.add_rms_norm(r_fast, x, w, 1e-6, True)
    r_ref = r_ref + x
    out_ref = transformers_rms_norm(r_ref, w, 1e-6)
    assert torch.equal(r_fast, r_ref), f"add_rms_norm's residual {what}"     # one rounded add: exact
    assert_close(out_fast, out_ref, f"add_rms_norm {what}")

    # per-head views into a fused qkv row (a stride wider than the heads), as the attention layer passes
    heads, d = 3, width
    qkv = torch.randn(rows, heads * d + 24, generator=g).to(dtype)
    view = qkv[:, :heads * d].view(rows, heads, d)
    hw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    want = transformers_rms_norm(view.clone(), hw, 1e-6)
    before = qkv[:, heads * d:].clone()
    assert_close(ops.rms_norm_heads_(view, hw, 1e-6, True), want, f"rms_norm_heads_ {what}")
    assert torch.equal(qkv[:, heads * d:], before), "the row's columns past the heads are left alone"

    positions = torch.randint(0, 256, (rows,), generator=g)
    angles = torch.arange(256).float()[:, None] * 0.5 ** torch.arange(d // 2).float()[None, :]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qkv = torch.randn(rows, heads * d + 24, generator=g).to(dtype)
    view = qkv[:, :heads * d].view(rows, heads, d)
    want = ops.rope_(view.clone(), positions, cos, sin, False)
    assert_close(ops.rope_(view, positions, cos, sin, True), want, f"rope_ {what}")
    # partial rotary (Bamba): the first half of each head rotates, the rest stays as it was
    rest = view[..., d // 2:].clone()
    want = ops.rope_(view.clone(), positions, cos[:, :d // 4], sin[:, :d // 4], False)
    assert_close(ops.rope_(view, positions, cos[:, :d // 4].contiguous(), sin[:, :d // 4].contiguous(), True), want,
                 f"rope_ partial {what}")
    assert torch.equal(view[..., d // 2:], rest), "the dims past the rotary ones are left alone"

    gu = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])         # the exponential's clamps, and zero
    assert_close(ops.silu_mul(gu, True), ops.silu_mul(gu, False), f"silu_mul {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_kernels_equal_the_torch_path(dtype, width, rows):
    check_kernels(dtype, width, rows, seed=width * 1000 + rows)


@pytest.fixture(scope="module")
def level_libraries(tmp_path_factory):
    """Each runnable level's build of the element-wise kernels."""
    return build_levels(tmp_path_factory, "elementwise", "team")


@ON_X86_64
def test_kernels_equal_the_torch_path_in_every_build_this_cpu_runs(level_libraries, monkeypatch):
    for level in each_build(level_libraries, monkeypatch):
        for dtype in DTYPES:
            for width in WIDTHS:
                check_kernels(dtype, width, rows=70, seed=width, level=level)
