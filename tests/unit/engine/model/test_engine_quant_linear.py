"""Quantized linear weights (model/models/quant.py): the quantize/dequantize math (int8 and fp8 e4m3,
per output channel), each quantized product against F.linear, the engine's int8 kernel (per-channel
and an int4 checkpoint's per-group scales, every build's bits), LoRA on top of a quantized
projection, tensor-parallel shards quantized after the cut, an int4 checkpoint's codes in a Linear
and where they are dequantized instead, and the flag's checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quantized_checkpoints import runs_on_codes

from consort_common.machine import cpu_model_and_flags
from consort_engine.model import cpu_kernels as ck
from consort_engine.model.quantized_checkpoint import GroupCodes
from consort_engine.model.cpu_kernels import cpu_kernels
from consort_engine.model.lora import LoraContext
from consort_engine.model.models.packed import consort_int8, consort_w8a8
from consort_engine.model.models.layers import Linear
from consort_engine.model.models.quant import (FP8_MAX, check_quantization, dequantize_fp8, dequantize_int8,
                                                quantize_fp8, quantize_int8, quantize_linear)
from consort_engine.model.tensor_parallel import TPGroup


def weight(out: int = 96, inp: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-2, 1, out)[:, None]
    w[3] = 0.0                                   # an all-zero row must not divide by zero
    return w


def test_int8_per_channel_round_trip_is_within_half_a_step():
    w = weight()
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) == 127 and torch.all(q[3] == 0)
    err = (dequantize_int8(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)
    # each row's scale follows its own range: the small rows are not flattened by the large ones
    assert scale[0] < scale[-1] / 100


def test_fp8_per_channel_round_trip_keeps_e4m3_precision():
    w = weight()
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.allclose(q.float().abs().amax(1)[w.abs().amax(1) > 0], torch.tensor(FP8_MAX))
    back = dequantize_fp8(q, scale)
    assert torch.all(back[3] == 0)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 in the normal range; subnormals by an absolute step
    rel = ((back - w).abs() - 2.0 ** -9 * scale[:, None]).clamp(min=0) / w.abs().clamp(min=1e-30)
    assert float(rel.max()) <= 2.0 ** -4


@pytest.mark.parametrize("quantization,tol", [("int8", 0.02), ("w8a8", 0.05), ("fp8", 0.08)])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_quantized_product_is_close_to_the_float_one(quantization, tol, rows):
    w, b = weight(), torch.randn(96)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, w, b)
    got = quantize_linear(w, b, quantization)(x)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert float((got - ref).norm() / ref.norm()) < tol
    # and the error is the quantization's, not a wrong layout: far below a random product's
    assert float((got - ref).norm() / ref.norm()) < 0.2 * float((F.linear(x, w.flip(0), b) - ref).norm() / ref.norm())


needs_int8_kernel = pytest.mark.skipif(not hasattr(cpu_kernels(), "gemm_i8w_f32"),
                                       reason="the engine's int8 kernel needs an AVX2 + FMA build")


def rows_as_ints(x: torch.Tensor, top: float) -> torch.Tensor:
    """Each row of x rounded to integers with its absolute maximum at `top`, then scaled back."""
    amax = x.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return torch.round(x * inv) * (amax / top)


def rows_as_int16(x: torch.Tensor) -> torch.Tensor:
    """x as gemm_i8w_f32 takes it: rows at 32767."""
    return rows_as_ints(x, 32767.0)


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 40, 241, 500])
@pytest.mark.parametrize("out,inp", [(96, 64), (130, 37), (64, 300), (40, 1100)])
def test_engine_int8_kernel_is_the_dequantized_weight_times_rows_rounded_to_int16(rows, out, inp):
    """gemm_i8w_f32 rounds each row of x to 16-bit integers, multiplies them with the codes in integers
    and scales the sums: the product of the dequantized weight and the rounded rows, to fp32 rounding,
    for every row-tile cut (1-13 rows, the 240-row blocks), column counts that leave a partial panel
    group, an odd K (a zero pair half) and a K of several int32 blocks (1,100: 550 pairs)."""
    w, b = weight(out, inp, seed=rows), torch.randn(out, generator=torch.Generator().manual_seed(3))
    q, scale = quantize_int8(w)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(2))
    x[0, 1] = 40.0                               # a row with an outlier: its scale is its own
    got = consort_int8(q, scale, b)(x)
    dq, xr = dequantize_int8(q, scale).double(), rows_as_int16(x).double()
    step = x.abs().amax(1, keepdim=True).double() / 32767
    # fp32 rounding scales with the magnitudes summed, not with the sum (which can cancel to near 0), and
    # the kernel's 32767 / max may differ from this one by an ulp, which can round an element at a near
    # tie the other way (one step); a wrong panel, pair or scale is off by the order of the sum itself
    bound = 4e-6 * (xr.abs() @ dq.abs().T + b.abs().double()) + step * dq.abs().amax(1)
    assert bool(((got.double() - F.linear(xr, dq, b.double())).abs() <= bound).all())
    # and the rounding of x costs at most half a step per element against the unrounded product
    assert bool(((got.double() - F.linear(x.double(), dq, b.double())).abs() <= step / 2 * dq.abs().sum(1) + bound).all())


needs_w8a8_kernel = pytest.mark.skipif(not hasattr(cpu_kernels(), "gemm_i8a8_f32"),
                                       reason="the engine's int8 x int8 kernel needs VNNI (AVX-512 VNNI or AVX-VNNI)")


def rows_as_int8(x: torch.Tensor) -> torch.Tensor:
    """x as gemm_i8a8_f32 takes it: rows at 127."""
    return rows_as_ints(x, 127.0)


@needs_w8a8_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 40, 241])
@pytest.mark.parametrize("out,inp,group", [(96, 64, -1), (130, 37, -1), (40, 1100, -1), (64, 256, 32), (48, 300, 100)])
def test_engine_w8a8_kernel_is_the_dequantized_weight_times_rows_rounded_to_int8(rows, out, inp, group):
    """gemm_i8a8_f32 rounds each row of x to int8 (stored + 128 for `vpdpbusd`'s u8 operand, the codes'
    column sums taking the 128 back off) and multiplies in integers: the product of the dequantized weight
    and the rounded rows, to fp32 rounding, for every row-tile cut, a K that is no multiple of 4 (37), a
    K of 32-k vectors and a scalar tail (1,100), per-channel and per-group scales (a partial last group)."""
    w, b = weight(out, inp, seed=rows), torch.randn(out, generator=torch.Generator().manual_seed(3))
    q, scale = quantize_int8(w)
    if group != -1:      # a scale per group: the same codes, each group's scale its own
        scale = scale[:, None] * torch.linspace(0.5, 2.0, -(-inp // group))[None, :]
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(2))
    x[0, 1] = 40.0
    got = consort_w8a8(q, scale, b, group)(x)
    dq = GroupCodes(q, scale.reshape(out, -1).float(), group).dequantize().double()
    xr = rows_as_int8(x).double()
    step = x.abs().amax(1, keepdim=True).double() / 127
    bound = 4e-6 * (xr.abs() @ dq.abs().T + b.abs().double()) + step * dq.abs().amax(1)
    assert bool(((got.double() - F.linear(xr, dq, b.double())).abs() <= bound).all())


@needs_w8a8_kernel
def test_engine_w8a8_kernel_is_exact_at_the_extremes_and_keeps_nan_and_zero_rows():
    """Rows at -127 and 127 (u8 1 and 255) against codes -127 and 127 over 8,192 k sum exactly; a NaN row
    is NaN, a zero row the bias, neither disturbing its neighbours; a group not a multiple of 4 is refused."""
    k = 8192
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[1] = -127
    q[2, ::2] = -127
    x = torch.full((4, k), 1.0)
    x[1] = -1.0
    x[2, 5] = float("nan")
    x[3] = 0.0
    b = torch.arange(16.0)
    got = consort_w8a8(q, torch.ones(16), b)(x)
    want = F.linear(x[:2].double(), q.double(), b.double())      # each row at its maximum: 127 exactly
    torch.testing.assert_close(got[:2].double(), want, rtol=1e-6, atol=0)
    assert bool(got[2].isnan().all())
    torch.testing.assert_close(got[3], b)
    assert consort_w8a8(q[:, :90], torch.ones(16, 3), None, 30) is None


def int4_codes(out: int, inp: int, group: int, seed: int) -> GroupCodes:
    """An int4 checkpoint's linear as the engine holds it: codes in [-8, 7], fp16-exact scales per group."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else -(-inp // group)
    scales = (torch.rand(out, groups, generator=g) * 0.1 + 1e-3).half().float()
    return GroupCodes(torch.randint(-8, 8, (out, inp), generator=g, dtype=torch.int8), scales, group)


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 5, 13, 241])
@pytest.mark.parametrize("out,inp,group", [(96, 256, 32), (130, 300, 64), (40, 1100, 128), (64, 1100, -1),
                                           (48, 2048, 1024), (72, 160, 16), (40, 90, 16)])
def test_engine_int8_kernel_takes_group_scales(rows, out, inp, group):
    """An int4 checkpoint's codes with one scale per column and group of k: the kernel's int32 blocks end
    at each group's end and each block is scaled by its group. The product of the dequantized weight and
    the rows rounded to int16, for groups of 16-1,024 k (NVFP4's 16 and up to 64 on the tiles whose fp32 sums
    stay in registers; a partial last group: 300 = 4 x 64 + 44, 90 = 5 x 16 + 10; a group of 512 pairs cut in
    two int32 blocks), per-channel scales over a K of several blocks."""
    c = int4_codes(out, inp, group, seed=rows)
    b = torch.randn(out, generator=torch.Generator().manual_seed(3))
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(2))
    got = consort_int8(c.codes, c.scales, b, group)(x)
    dq, xr = c.dequantize().double(), rows_as_int16(x).double()
    step = x.abs().amax(1, keepdim=True).double() / 32767
    bound = 4e-6 * (xr.abs() @ dq.abs().T + b.abs().double()) + step * dq.abs().amax(1)
    assert bool(((got.double() - F.linear(xr, dq, b.double())).abs() <= bound).all())
    # a scale applied to the wrong group is off by the order of the sum itself
    shifted = GroupCodes(c.codes, c.scales.roll(1, dims=1), group)
    if c.scales.shape[1] > 1:
        assert not bool(((got.double() - F.linear(xr, shifted.dequantize().double(), b.double())).abs() <= bound).all())


@needs_int8_kernel
def test_engine_int8_kernel_refuses_an_odd_group():
    """A k pair would straddle two scales: no kernel (the caller dequantizes instead)."""
    c = int4_codes(16, 90, 45, seed=0)
    assert consort_int8(c.codes, c.scales, None, 45) is None


@needs_int8_kernel
def test_engine_int8_kernel_sums_the_largest_products_without_overflow():
    """Every product at its largest (codes 127, every x at its row's maximum) over 2,048 k: each int32
    block holds 256 pairs of them (2,130,591,232, just under 2^31) before the fp32 sum takes it."""
    k = 2048
    w = torch.full((16, k), 0.5)
    w[1] = -0.5
    x = torch.full((3, k), 2.0)
    got = consort_int8(*quantize_int8(w), None)(x)
    want = torch.full((3, 16), k * 1.0)
    want[:, 1] = -k
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@needs_int8_kernel
def test_engine_int8_kernel_keeps_nan_and_zero_rows():
    """A row holding NaN or an infinity comes out NaN (as the fp32 product would), an all-zero row
    comes out as the bias, and neither disturbs the rows beside it."""
    g = torch.Generator().manual_seed(4)
    w, b = weight(), torch.randn(96, generator=g)
    q, scale = quantize_int8(w)
    x = torch.randn(4, 64, generator=g)
    x[1, 5], x[2] = float("nan"), 0.0
    x[3, 7] = float("inf")
    got = consort_int8(q, scale, b)(x)
    assert bool(got[1].isnan().all()) and bool(got[3].isnan().all())
    torch.testing.assert_close(got[2], b)
    torch.testing.assert_close(got[0], F.linear(rows_as_int16(x[:1]), dequantize_int8(q, scale), b)[0])


# The int8 kernel's builds: every level the engine image ships from v3 up (ymm or zmm, vpmaddwd + vpaddd
# or VNNI's vpdpwssd: gemm_i8w.c `I8W_MADD`).
INT8_LEVELS = [name for name, level in ck.LEVELS.items() if "avx2" in level.needs]


@needs_int8_kernel
def test_engine_int8_kernel_gives_the_same_bits_in_every_build_this_cpu_runs(tmp_path, monkeypatch):
    """The int32 sums are exact and every build converts and scales them in the same order, so the ymm
    and zmm tiles (their row cuts differ: 6/4/2/1 against up to 12), with or without VNNI, give
    bit-identical outputs: each build this CPU can run against the library the engine loads here. And a
    row's bits do not depend on its place in the batch (which tile, which row of it). The same for the
    int8 x int8 kernel (w8a8) in the builds that have it (VNNI: ymm with AVX-VNNI, zmm with AVX-512 VNNI)."""
    runnable = [level for level in ck.runnable_levels(cpu_model_and_flags()[1]) if level in INT8_LEVELS]
    assert runnable                                          # an AVX2 + FMA build runs the int8 kernel
    sources = [p for p in ck.SOURCES if p.stem in ("gemm", "gemm_i8w", "gemm_i8a8", "team")]
    g = torch.Generator().manual_seed(7)
    cases = []
    for out, inp in ((96, 64), (130, 37), (40, 1100)):
        q, scale = quantize_int8(torch.randn(out, inp, generator=g) * 0.05)
        b = torch.randn(out, generator=g)
        cases += [(q, scale, b, torch.randn(rows, inp, generator=g)) for rows in (1, 2, 3, 5, 8, 13, 23, 40, 241)]
    for out, inp, group in ((96, 256, 32), (130, 300, 64), (72, 160, 16)):    # int4 and NVFP4 checkpoints' groups
        c = int4_codes(out, inp, group, seed=out)
        cases += [(c.codes, c.scales, None, torch.randn(rows, inp, generator=g), group) for rows in (1, 7, 13, 40)]
    cases = [case if len(case) == 5 else (*case, -1) for case in cases]
    want = [consort_int8(q, scale, b, group)(x) for q, scale, b, x, group in cases]
    want_bf16 = [consort_int8(q, scale, b, group)(x.bfloat16()) for q, scale, b, x, group in cases]
    w8a8 = [consort_w8a8(q, scale, b, group) for q, scale, b, x, group in cases]
    want_w8a8 = [f(x) if f else None for f, (q, scale, b, x, group) in zip(w8a8, cases)]
    for level in runnable:
        so = tmp_path / f"int8-{level}.so"
        ck.compile_sources(so, level, sources=sources)
        monkeypatch.setattr(ck, "_lib", ck.load_library(so))
        for (q, scale, b, x, group), ref, ref16, ref8 in zip(cases, want, want_bf16, want_w8a8):
            assert torch.equal(consort_int8(q, scale, b, group)(x), ref), (level, x.shape, q.shape, group)
            assert torch.equal(consort_int8(q, scale, b, group)(x.bfloat16()), ref16), ("bf16", level, x.shape)
            if ref8 is not None and (f := consort_w8a8(q, scale, b, group)) is not None:
                assert torch.equal(f(x), ref8), ("w8a8", level, x.shape, q.shape, group)
        for q, scale, b, x, group in (cases[26], cases[-1]):
            for gemm in (consort_int8, consort_w8a8):
                if (f := gemm(q, scale, b, group)) is not None:
                    same = f(x[:1].repeat(25, 1))
                    assert torch.equal(same, same[:1].expand_as(same)), (gemm.__name__, level, group)


@needs_int8_kernel
def test_the_integer_kernels_take_bf16_rows_as_the_fp32_ones_rounded_once():
    """gemm_i8w_bf16 / gemm_i8a8_bf16 read bf16 rows and write bf16: each output is the fp32 entry's on
    the same (exactly widened) rows, bias included, rounded to bf16 once: the same bits. Per-channel and
    an int4 checkpoint's group scales, act-order columns, every tile and cut of rows, rows of NaN."""
    g = torch.Generator().manual_seed(3)
    for out, inp, group in ((96, 64, -1), (130, 37, -1), (40, 1100, -1), (64, 256, 32), (48, 300, 100)):
        if group == -1:
            codes, scale = quantize_int8(torch.randn(out, inp, generator=g) * 0.05)
        else:
            c = int4_codes(out, inp, group, seed=out)
            codes, scale = c.codes, c.scales
        b = torch.randn(out, generator=g)
        order = torch.randperm(inp, generator=g) if group == 32 else None
        fns = [consort_int8(codes, scale, b, group, order), consort_w8a8(codes, scale, None, group)]
        for f in (f for f in fns if f is not None):
            for rows in (1, 2, 3, 5, 8, 13, 23, 40, 241):
                x = torch.randn(rows, inp, generator=g).bfloat16()
                x[rows // 2, inp // 3] = float("nan")
                got = f(x)
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got, f(x.float()).bfloat16(), rtol=0, atol=0, equal_nan=True,
                                           msg=f"{out} x {inp}, group {group}, {rows} rows")
                assert got[rows // 2].isnan().all() and not got[:rows // 2].isnan().any()


@needs_int8_kernel
def test_int8_runs_on_the_engine_kernel_in_either_activation_dtype():
    """--quantization int8 takes the engine's kernel where it is built (torch's _weight_int8pack_mm
    ran the anchor workload at 0.58x fp32 on AVX2), for fp32 and bf16 rows (gemm_i8w_bf16). (Rows of
    ones round to 16-bit integers exactly.)"""
    w = weight()
    q, scale = quantize_int8(w)
    want = F.linear(torch.ones(3, 64), dequantize_int8(q, scale))
    for dtype in (torch.float32, torch.bfloat16):
        got = quantize_linear(w, None, "int8")(torch.ones(3, 64, dtype=dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype), rtol=1e-5, atol=1e-4)
    lib = cpu_kernels()
    calls = []
    real = lib.gemm_i8w_f32
    try:
        lib.gemm_i8w_f32 = lambda *a: calls.append(a) or real(*a)
        lib.gemm_i8w_f32.__name__ = "gemm_i8w_f32"
        quantize_linear(w, None, "int8")(torch.ones(3, 64))
    finally:
        lib.gemm_i8w_f32 = real
    assert len(calls) == 1


def test_fp8_emulation_equals_dequantized_operands_multiplied_in_fp32():
    """What _scaled_mm computes on CUDA (tests/gpu checks it there): both operands rounded through e4m3
    with their row scales, the product in fp32."""
    w, x = weight(), torch.randn(7, 64)
    wq, ws = quantize_fp8(w)
    xq, xs = quantize_fp8(x)
    want = dequantize_fp8(xq, xs) @ dequantize_fp8(wq, ws).t()
    torch.testing.assert_close(quantize_linear(w, None, "fp8")(x), want)


@pytest.mark.parametrize("quantization", ["int8", "w8a8", "fp8"])
def test_lora_stays_full_precision_on_a_quantized_projection(quantization):
    lin = Linear(64, [48, 48], bias=False)
    lin.weight.data.copy_(weight())
    x = torch.randn(6, 64)
    lin.pack(quantization)
    assert lin.packed is not None
    base = lin(x)
    a, b = torch.randn(4, 64), torch.randn(48, 4)
    lin.lora_ctx = LoraContext([(2, 5, "ad")])
    lin.lora["ad"] = [(48, 48, a, b.t().contiguous())]     # the second shard; B kept transposed (lora.py)
    got = lin(x)
    delta = torch.zeros_like(base)
    delta[2:5, 48:] = (x[2:5] @ a.t()) @ b.t()
    torch.testing.assert_close(got, base + delta, rtol=1e-5, atol=1e-4)


def test_tensor_parallel_shards_are_quantized_after_the_cut():
    """Each column-parallel rank quantizes its own rows: together they equal the unsplit quantized product."""
    w, x = weight(), torch.randn(3, 64)
    full = quantize_linear(w, None, "int8")(x)
    parts = []
    for rank in range(2):
        lin = Linear(64, [48], bias=False, parallel="column", tp=TPGroup(rank, 2))
        lin.load_shard("weight", 0, w)
        lin.pack("int8")
        parts.append(lin(x))
    torch.testing.assert_close(torch.cat(parts, 1), full)


@needs_int8_kernel
def test_an_int4_checkpoints_fused_shards_run_as_codes_with_lora_on_top():
    """q/k/v-like shards of GroupCodes load into one Linear and pack onto the int8 kernel (the codes, not a
    float weight: the weight is released), the product that of the dequantized shards; LoRA adds on top."""
    shards = [int4_codes(n, 128, 32, seed=n) for n in (64, 32, 32)]
    lin = Linear(128, [64, 32, 32], bias=False)
    for i, c in enumerate(shards):
        lin.load_shard("weight", i, c)
    lin.pack("awq")
    assert runs_on_codes(lin) and lin.weight.data.stride() == (0, 0) and not lin.codes
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 128, generator=g)
    w = torch.cat([c.dequantize() for c in shards])
    base = lin(x)
    torch.testing.assert_close(base, F.linear(rows_as_int16(x), w), rtol=1e-5, atol=1e-4)
    a, b = torch.randn(4, 128, generator=g), torch.randn(32, 4, generator=g)
    lin.lora_ctx = LoraContext([(1, 3, "ad")])
    lin.lora["ad"] = [(64, 32, a, b.t().contiguous())]     # B kept transposed (lora.py)
    delta = torch.zeros_like(base)
    delta[1:3, 64:96] = (x[1:3] @ a.t()) @ b.t()
    torch.testing.assert_close(lin(x), base + delta, rtol=1e-5, atol=1e-4)


@needs_w8a8_kernel
def test_w8a8_runs_int8_rows_on_the_engine_kernel():
    """--quantization w8a8 and a W8A8 checkpoint's codes (int8_rows) multiply rows rounded to int8 on the
    engine's VNNI kernel (one scale per row), not FBGEMM's (one per call) nor the 16-bit rows."""
    # seeded: a row element at a near-tie can round the other way in the kernel (its 127 / max may differ
    # by an ulp), one int8 step, which these tolerances do not allow; about 1 draw in 150 has one
    w, x = weight(), torch.randn(6, 64, generator=torch.Generator().manual_seed(11))
    q, scale = quantize_int8(w)
    want = F.linear(rows_as_int8(x), dequantize_int8(q, scale))
    torch.testing.assert_close(quantize_linear(w, None, "w8a8")(x), want, rtol=1e-5, atol=1e-5)
    lin = Linear(64, [48, 48], bias=False)
    for i in range(2):
        lin.load_shard("weight", i, GroupCodes(q[48 * i:48 * i + 48], scale[48 * i:48 * i + 48, None], -1, int8_rows=True))
    lin.pack("compressed-tensors")
    assert runs_on_codes(lin)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lin(x), F.linear(rows_as_int16(x), dequantize_int8(q, scale)), rtol=1e-5, atol=1e-5)


@needs_int8_kernel
def test_act_order_codes_gather_the_input_columns():
    """GPTQ act-order: code columns sorted by group, `order` naming each one's input column. Fused shards
    in one order run on the kernel, which reads x's columns in that order (the product of the weight in
    input order); shards in different orders are dequantized."""
    order = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    shards = [GroupCodes(c.codes, c.scales, 32, order) for c in (int4_codes(n, 128, 32, seed=n) for n in (48, 16))]
    lin = Linear(128, [48, 16], bias=False)
    for i, c in enumerate(shards):
        lin.load_shard("weight", i, c)
    lin.pack("gptq")
    assert runs_on_codes(lin)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(13))
    w = torch.cat([c.dequantize() for c in shards])
    assert torch.equal(w[:, order], torch.cat([c.codes.float() * c.scales.repeat_interleave(32, 1) for c in shards]))
    torch.testing.assert_close(lin(x), F.linear(rows_as_int16(x), w), rtol=1e-5, atol=1e-4)
    # the kernel reads x's columns in the order as it rounds them (an AVX2 gather, a scalar tail): the
    # same bits as x gathered first, for a K that leaves a tail (37) and one of whole vectors (128)
    for k in (37, 128):
        g = torch.Generator().manual_seed(k)
        c, perm, rows = int4_codes(40, k, -1, seed=k), torch.randperm(k, generator=g), torch.randn(13, k, generator=g)
        gathered = consort_int8(c.codes, c.scales, None, -1, perm)(rows)
        assert torch.equal(gathered, consort_int8(c.codes, c.scales, None, -1)(rows[:, perm]))
    other = GroupCodes(shards[1].codes, shards[1].scales, 32, order.flip(0))
    lin = Linear(128, [48, 16], bias=False)
    lin.load_shard("weight", 0, shards[0])
    lin.load_shard("weight", 1, other)
    lin.pack("gptq")
    assert not runs_on_codes(lin)
    torch.testing.assert_close(lin(x), F.linear(x, torch.cat([shards[0].dequantize(), other.dequantize()])))


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_int8_kernel), False])
def test_int4_codes_are_dequantized_where_the_kernel_does_not_take_them(kernel, monkeypatch):
    """Row-parallel ranks cut whole groups and keep the codes; a cut inside a group, shards with different
    group sizes, or a CPU without the kernel dequantize into the float weight: the same product (to the
    int16 rounding of x that only the kernel does)."""
    if not kernel:
        monkeypatch.setattr(ck, "_lib", None)
    c = int4_codes(48, 256, 64, seed=1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(14))
    for rank in range(2):              # 128 columns a rank: two whole groups
        lin = Linear(128, [48], bias=False, parallel="row", tp=TPGroup(rank, 2))
        lin.load_shard("weight", 0, c)
        lin.pack("gptq")
        assert runs_on_codes(lin) == kernel
        cut = slice(128 * rank, 128 * rank + 128)      # (the rank's partial product: before the all-reduce)
        torch.testing.assert_close(lin.packed(x[:, cut]), F.linear(x[:, cut], c.dequantize()[:, cut]),
                                   rtol=2e-4, atol=2e-3)
    inside = int4_codes(48, 96, 32, seed=2)
    lin = Linear(48, [48], bias=False, parallel="row", tp=TPGroup(1, 2))    # columns 48-95: group 1 is cut
    lin.load_shard("weight", 0, inside)
    lin.pack("gptq")
    assert not runs_on_codes(lin)
    torch.testing.assert_close(lin.packed(x[:, :48]), F.linear(x[:, :48], inside.dequantize()[:, 48:]))
    lin = Linear(256, [48, 48], bias=False)
    lin.load_shard("weight", 0, c)
    lin.load_shard("weight", 1, int4_codes(48, 256, 128, seed=3))
    lin.pack("awq")
    assert not runs_on_codes(lin)
    torch.testing.assert_close(lin(x)[:, :48], F.linear(x, c.dequantize()), rtol=1e-5, atol=1e-5)


def test_quantization_flag_is_checked_against_the_device():
    for q in ("none", "int8", "w8a8", "fp8"):
        check_quantization(q, "cpu")
    check_quantization("fp8", "cuda")
    with pytest.raises(ValueError, match="on CUDA use fp8"):
        check_quantization("w8a8", "cuda")
    with pytest.raises(ValueError, match="unknown quantization"):
        check_quantization("int4", "cpu")


def test_engine_flag_reaches_the_config(tmp_path):
    from consort_engine.serving.cli import config_from_args, parse_args

    (tmp_path / "config.json").write_text("{}")
    base = ["--model", str(tmp_path), "--port", "0"]
    assert config_from_args(parse_args(base)).quantization == "none"
    assert config_from_args(parse_args(base + ["--quantization", "w8a8"])).quantization == "w8a8"
    with pytest.raises(SystemExit):
        config_from_args(parse_args(base + ["--quantization", "int8", "--device", "cuda"]))
    with pytest.raises(SystemExit):
        parse_args(base + ["--quantization", "int4"])


@pytest.mark.parametrize("quantization,head_quantized", [("int8", True), ("w8a8", False)])
def test_the_lm_head_is_quantized_only_where_its_activations_keep_15_bits(quantization, head_quantized):
    """--quantization int8 covers the LM head too (15-bit activations, and the head is a large share of a
    decode step's weights); w8a8 leaves it in the checkpoint's dtype, as vLLM's recipes do."""
    from consort_engine.model.loader import ModelConfig
    from consort_engine.model.models.llama import LlamaForCausalLM

    cfg = ModelConfig(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=96,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg, 64, "sdpa", torch.float32, torch.device("cpu"))
    w = weight()
    model.lm_head.weight.data.copy_(w)
    model.pack_weights(quantization)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    got = model.lm_head(x)
    quantized = quantize_linear(w, None, quantization)(x)
    torch.testing.assert_close(got, quantized if head_quantized else F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(quantized, F.linear(x, w), rtol=1e-5, atol=1e-5)   # the two are told apart


def test_bf16_activations_where_the_gemms_take_them(monkeypatch):
    """A bf16 model computes in bf16 on a CPU only where its GEMMs run in bf16: with a bf16 dot product
    (AMX, AVX-512 BF16), quantized or not (the int8 and w8a8 kernels take bf16 rows); on CUDA always."""
    from consort_engine.model import model_runner

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    monkeypatch.delenv("CONSORT_BF16_COMPUTE", raising=False)
    for dot in (True, False):
        monkeypatch.setattr(model_runner, "has_bf16_dot", lambda dot=dot: dot)
        assert model_runner.compute_dtype(bf16, cpu) == (bf16 if dot else torch.float32)
        assert model_runner.compute_dtype(torch.float32, cpu) == torch.float32
        assert model_runner.compute_dtype(bf16, torch.device("cuda")) == bf16
    monkeypatch.setenv("CONSORT_BF16_COMPUTE", "1")
    assert model_runner.compute_dtype(bf16, cpu) == bf16
