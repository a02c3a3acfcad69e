"""The Mamba2 mixer's steps in C (csrc/mamba.c) against the torch code they replace, for float32 and bfloat16
models, one or several groups, with and without a conv bias:
- the decode step (Mamba2Mixer._step_kernel against _step: models/ssd.py conv_step + state_update): the
  output rows and both states of every slot, rows and slots in any order; slots the step does not name stay
  as they were;
- the prefill scan (Mamba2Mixer._scan_kernel, the recurrence token by token, against ssd.chunk_scan's
  chunked algorithm) and the gated norm (csrc/elementwise.c against GatedRMSNorm's tensor ops): a whole
  mixer forward over a step of prefill chunks and decode rows, checkpoints at a chunk's start, inside it
  and at its end; the layer output, the pools and the checkpoint rows;
- the time steps (mamba_time_steps: softplus(dt + dt_bias) over strided rows, in place too) against float64;
- speculative verify windows (the C step over each window's rows, against the tensor-op step position by
  position): the windows' slots stay as they were; HybridState.commit_windows then leaves each in the state
  the step would have left with only its kept tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from consort_engine.kv.state_pool import build_state_metadata
from consort_engine.model import cpu_kernels as ck
from consort_engine.model.hybrid_state import HybridState
from consort_engine.model.loader import ModelConfig
from consort_engine.model.models.mamba2 import Mamba2Mixer

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler for the CPU kernels")


def mixer(dtype: torch.dtype, groups: int, conv_bias: bool, g: torch.Generator,
          time_step_limit: tuple[float, float] | None = None, heads: int = 8, expand: int = 2) -> Mamba2Mixer:
    raw = {"mamba_n_heads": heads, "mamba_expand": expand, "mamba_n_groups": groups, "mamba_d_state": 24,
           "mamba_d_conv": 4, "mamba_chunk_size": 16, "mamba_conv_bias": conv_bias,
           "time_step_limit": time_step_limit}
    cfg = ModelConfig(model_type="bamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32,
                      max_position_embeddings=64, raw=raw)
    m = Mamba2Mixer(cfg, index=1, fast=True)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        m.A_log.copy_(torch.rand(m.heads, generator=g) * 2 - 1)
        m.dt_bias.copy_(torch.randn(m.heads, generator=g))
        m.dt_bias[0] = 25.0                      # softplus above its threshold: the identity
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,conv_bias", [(1, True), (2, False), (4, True)])
def test_c_decode_step_equals_the_torch_step(dtype, groups, conv_bias):
    g = torch.Generator().manual_seed(groups * 10 + conv_bias + (dtype == torch.bfloat16))
    m = mixer(dtype, groups, conv_bias, g)
    slots_n, mixers = 9, 3
    (cd, ck_), (h, p, n) = m.state_shapes()
    conv = (torch.randn(slots_n, mixers, cd, ck_, generator=g)).to(dtype)
    ssm = torch.randn(slots_n, mixers, h, p, n, generator=g)
    t = 7                                        # step rows: 0, 2, 3, 6 decode; 1 and 4-5 another group's
    rows, slots = [6, 0, 3, 2], [4, 8, 1, 5]
    proj = torch.randn(t, m.inner + m.conv_dim + m.heads, generator=g).to(dtype)
    _, xbc, dt = proj.split([m.inner, m.conv_dim, m.heads], dim=-1)
    A = -torch.exp(m.A_log.float())
    groups_rows = [(r, r + 1) for r in rows]
    st = build_state_metadata(conv, ssm, groups_rows, slots, [False] * len(rows))
    assert st.decode_ids is not None

    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    y_ref = torch.zeros(t, m.inner, dtype=dtype)
    m._step(xbc, dt, A, y_ref, torch.tensor(rows), torch.tensor(slots), ref_conv[:, 1], ref_ssm[:, 1])
    y = torch.zeros(t, m.inner, dtype=dtype)
    m._step_kernel(xbc, m.time_steps(dt), A, y, st.decode_ids[0], None, st.decode_ids[1], conv[:, 1], ssm[:, 1])

    untouched = [s for s in range(slots_n) if s not in slots]
    assert torch.equal(conv[untouched], ref_conv[untouched]) and torch.equal(ssm[untouched], ref_ssm[untouched])
    assert torch.equal(conv[:, [0, 2]], ref_conv[:, [0, 2]]) and torch.equal(ssm[:, [0, 2]], ref_ssm[:, [0, 2]])
    assert torch.equal(conv, ref_conv)          # the window moved on: the same values, whatever the dtype
    assert bool((y[[1, 4, 5]] == 0).all())      # rows outside the decode group are not written
    if dtype == torch.float32:
        torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    else:
        # the same rounding points; the float32 sums may add in another order, moving a value by one
        # bf16 step where it lands next to a rounding boundary
        torch.testing.assert_close(ssm, ref_ssm, rtol=1e-4, atol=1e-4)
        diff = (y.float() - y_ref.float()).abs()
        assert bool((diff <= 2 ** -7 * y_ref.float().abs() + 1e-6).all()), float(diff.max())
        assert float((diff > 0).float().mean()) <= 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,conv_bias,limit,heads,expand",
                         [(1, True, None, 8, 2), (2, False, (0.0, 0.7), 8, 2), (4, True, None, 8, 2),
                          (2, True, None, 32, 3)])        # head_dim 6: the scan's rows in fours and a pair
def test_c_prefill_scan_equals_the_chunked_scan(dtype, groups, conv_bias, limit, heads, expand):
    g = torch.Generator().manual_seed(100 + groups * 10 + conv_bias + (dtype == torch.bfloat16) + heads)
    fast = mixer(dtype, groups, conv_bias, g, limit, heads, expand)
    ref = copy.deepcopy(fast)
    ref.fast = ref.norm.fast = False          # the torch scan and gated norm
    slots_n, mixers, ckpt_rows = 6, 2, 7
    (cd, kc), (h, p, n) = fast.state_shapes()
    conv = torch.randn(slots_n, mixers, cd, kc, generator=g).to(dtype)
    ssm = torch.randn(slots_n, mixers, h, p, n, generator=g)
    ckpt = (torch.zeros(ckpt_rows, mixers, cd, kc, dtype=dtype), torch.zeros(ckpt_rows, mixers, h, p, n))
    # rows: chunk 0-4 (slot 3), decode row 5 (slot 0), chunk 6-28 (slot 5, cuts at 0, 8 and 23 = its end),
    # chunk 29-68 (slot 1, cuts at 16 and 33: inside the scan's chunks of 16 and across them)
    items, slots = [(0, 5), (5, 6), (6, 29), (29, 69)], [3, 0, 5, 1]
    cuts = [[], [], [(0, 2), (8, 0), (23, 5)], [(16, 6), (33, 1)]]
    x = torch.randn(69, 64, generator=g).to(dtype)

    def run(m: Mamba2Mixer):
        c, s, cc, cs = conv.clone(), ssm.clone(), ckpt[0].clone(), ckpt[1].clone()
        st = build_state_metadata(c, s, items, slots, [False] * 4, cuts, (cc, cs))
        with torch.inference_mode():
            return m(x, st), c, s, cc, cs
    out, *pools = run(fast)
    out_ref, *pools_ref = run(ref)
    assert torch.equal(pools[0], pools_ref[0]) and torch.equal(pools[2], pools_ref[2])   # conv: the same code
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pools[1], pools_ref[1], **tol)                                     # SSM pool
    torch.testing.assert_close(pools[3], pools_ref[3], **tol)                                     # its checkpoints
    assert bool((pools[3][[3, 4]] == 0).all())            # rows no cut names are not written
    if dtype == torch.float32:
        torch.testing.assert_close(out, out_ref, **tol)
    else:   # y differs by a bf16 step here and there (other float32 sums); the norm and out_proj spread it
        diff = (out.float() - out_ref.float()).abs()
        assert float(diff.max()) <= 0.02 * float(out_ref.float().abs().max()), float(diff.max())
        assert float(diff.mean()) <= 0.002 * float(out_ref.float().abs().mean()), float(diff.mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,conv_bias", [(1, True), (2, False)])
def test_verify_windows_leave_their_slots_until_the_kept_tokens_commit(dtype, groups, conv_bias):
    g = torch.Generator().manual_seed(200 + groups * 10 + conv_bias + (dtype == torch.bfloat16))
    fast = mixer(dtype, groups, conv_bias, g)
    ref = copy.deepcopy(fast)
    ref.fast = ref.norm.fast = False
    slots_n, mixers = 7, 2
    (cd, kc), (h, p, n) = fast.state_shapes()
    conv = torch.randn(slots_n, mixers, cd, kc, generator=g).to(dtype)
    ssm = torch.randn(slots_n, mixers, h, p, n, generator=g)
    # rows: window 0-3 (slot 5), decode row 4 (slot 0), window 5-6 (slot 2), window 7-11 (slot 6)
    items, slots, windows = [(0, 4), (4, 5), (5, 7), (7, 12)], [5, 0, 2, 6], [True, False, True, True]
    x = torch.randn(12, 64, generator=g).to(dtype)
    kept = {5: 2, 2: 2, 6: 1}       # window 0: 2 of its 4 tokens, window 5-6 both, window 7-11: 1

    def run(m: Mamba2Mixer, steps):
        hs = HybridState([m], slots_n, 0, dtype, torch.device("cpu"))
        hs.conv, hs.ssm = conv.clone(), ssm.clone()           # the test's pools: the mixer is index 1 of 2
        for spans, step_slots, flags in steps:
            st = build_state_metadata(hs.conv, hs.ssm, spans, step_slots, flags)
            hs.windows = st.windows
            with torch.inference_mode():
                out = m(x, st)
        return out, hs
    outs = {}
    for m in (fast, ref):
        out, hs = run(m, [(items, slots, windows)])
        outs[m is fast] = out, hs.conv.clone(), hs.ssm.clone()
        untouched = [1, 2, 3, 4, 5, 6]                        # the windows' slots too: only the decode row moved
        assert torch.equal(hs.conv[untouched], conv[untouched]) and torch.equal(hs.ssm[untouched], ssm[untouched])
        assert not torch.equal(hs.ssm[0], ssm[0])
        with torch.inference_mode():
            hs.commit_windows(kept)
        # the truth: decode steps, one token of each sequence at a time, over the kept tokens
        _, truth = run(m, [([(0, 1), (4, 5), (5, 6), (7, 8)], [5, 0, 2, 6], [False] * 4),
                           ([(1, 2), (6, 7)], [5, 2], [False] * 2)])
        assert torch.equal(hs.conv, truth.conv)
        torch.testing.assert_close(hs.ssm, truth.ssm, rtol=1e-6, atol=1e-6)
        assert hs.windows is None
    # C against the tensor ops: the layer output (every window row) and the decode row's state
    (out_c, conv_c, ssm_c), (out_t, conv_t, ssm_t) = outs[True], outs[False]
    tol = dict(rtol=1e-4, atol=1e-4)
    assert torch.equal(conv_c, conv_t)
    torch.testing.assert_close(ssm_c, ssm_t, **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(out_c, out_t, **tol)
    else:
        diff = (out_c.float() - out_t.float()).abs()
        assert float(diff.max()) <= 0.02 * float(out_t.float().abs().max()), float(diff.max())
        assert float(diff.mean()) <= 0.002 * float(out_t.float().abs().mean()), float(diff.mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_time_steps_equal_softplus(dtype):
    """softplus(round(dt + dt_bias)) per row and head, rounded to the model dtype: float32 within 2e-6 of the
    float64 value over -30..30 (the exponential's error at large |x|), bf16 at most one rounding step off
    torch's softplus; rows read and written at their strides, and in place (the decode call's way)."""
    g = torch.Generator().manual_seed(4)
    rows, heads = 7, 37                                  # heads off the vector width
    proj = (torch.rand(rows, heads + 11, generator=g) * 60 - 30).to(dtype)
    dt, bias = proj[:, 5:5 + heads], (torch.randn(heads, generator=g) * 0.5).to(dtype)
    want = torch.nn.functional.softplus((dt + bias).double())
    out = torch.empty(rows, heads, dtype=dtype)
    fn = ck.kernel("mamba_time_steps", dtype)
    fn(dt.data_ptr(), dt.stride(0), bias.data_ptr(), out.data_ptr(), out.stride(0), rows, heads)
    rel = ((out.double() - want) / want).abs().max().item()
    if dtype == torch.float32:
        assert rel < 2e-6, rel
    else:
        assert rel <= 2 ** -8, rel
        ref = torch.nn.functional.softplus(dt + bias)
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
    before = proj.clone()
    fn(dt.data_ptr(), dt.stride(0), bias.data_ptr(), dt.data_ptr(), dt.stride(0), rows, heads)
    assert torch.equal(dt, out)                                          # in place: the same values
    assert torch.equal(proj[:, :5], before[:, :5]) and torch.equal(proj[:, 5 + heads:], before[:, 5 + heads:])
