"""The CPU paged-attention kernel (csrc/paged_attention.c) reads K/V in place through block tables and equals
softmax(q K^T) V over each sequence's visible context: decode rows and verify windows of several query
rows in one call, grouped-query heads, items split across kv heads where a sequence's rows do not fit
one item, head sizes with and without a specialised loop, any block size, a bfloat16 pool under float32 or
bfloat16 queries, an fp8 (float8 e4m3fn) pool under either, and every build of the kernel this CPU runs.
The K/V store into an fp8 pool rounds bit for bit as torch does, and the prefill kernel reads that pool
as its float32 values."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from consort_engine.model import attention
from consort_engine.model import cpu_kernels as ck
from consort_engine.model.attention import AttentionMetadata, PagedAttention
from consort_engine.model.cpu_kernels import cpu_kernels
from kernel_levels import ON_X86_64, build_levels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs a C compiler")


def reference(q, kc, vc, block_tables, ctx_lens, qlens, h, kvh, d):
    """Per sequence: gather its blocks from the heads-first pool, bottom-right causal SDPA."""
    out, row = [], 0
    for b, (ctx, n) in enumerate(zip(ctx_lens, qlens)):
        blocks = block_tables[b, :(ctx + kc.shape[2] - 1) // kc.shape[2]].long()
        ks = kc[blocks].transpose(1, 2).reshape(-1, kvh, d)[:ctx].float()
        vs = vc[blocks].transpose(1, 2).reshape(-1, kvh, d)[:ctx].float()
        qs = q[row:row + n].float().transpose(0, 1).unsqueeze(0)                       # [1, H, n, D]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                           attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(n, h * d))
        row += n
    return torch.cat(out)


DECODE_CASES = [
    (8, 4, 64, [1] * 32),                  # the bench model's decode step
    (8, 4, 64, [1, 3, 1, 5, 2]),           # decode rows and verify windows together
    (4, 4, 64, [1, 2, 1]),                 # MHA (G = 1)
    (16, 2, 128, [1, 4]),                  # G = 8, the 128 specialisation
    (6, 3, 40, [2, 1, 1]),                 # a head size without a specialised loop
    (64, 8, 64, [5, 1, 5]),                # 64 heads x 5 rows, one kv head per item (few sequences)
    (32, 32, 64, [9, 1]),                  # MHA x 9 rows
]
# Batches wide enough (2 threads) for items of several kv heads (paged_attention.c heads_per_item)
WIDE_CASES = [
    (8, 4, 64, [1] * 64),                  # items of all 4 kv heads: a block's heads in one run
    (64, 8, 64, [5, 1, 5] * 22),           # 64 heads x 5 rows: items of 4 of the 8 kv heads (MAX_ROWS)
    (32, 32, 64, [9, 1] * 16),             # MHA x 9 rows: items of 16 kv heads
]
FP8 = torch.float8_e4m3fn


def fp8_codes(shape, g: torch.Generator) -> torch.Tensor:
    """An fp8 tensor of codes drawn uniformly below 0x48 (|v| < 4), random signs: one value in nine a
    subnormal (the widening's own path), where normal draws give about one in a hundred."""
    codes = torch.randint(0, 0x48, shape, generator=g) | torch.randint(0, 2, shape, generator=g) << 7
    return codes.to(torch.uint8).view(FP8)


def pool_of(shape, kv_dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return fp8_codes(shape, g) if kv_dtype == FP8 else torch.randn(shape, generator=g).to(kv_dtype)


DTYPES = [(torch.float32, torch.float32),
          (torch.bfloat16, torch.float32),      # a bf16 model computing in fp32 (no bf16 dot product on the CPU)
          (torch.bfloat16, torch.bfloat16),     # one computing in bf16: pairs multiplied in place, or widened
          (FP8, torch.float32),                 # an fp8 pool: the reference attends over its values as fp32
          (FP8, torch.bfloat16)]


def check_decode(h, kvh, d, qlens, kv_dtype, q_dtype, bs=16, ctx_lens=None, q_scale=2.0):
    """The batched group of one step through the kernel against SDPA over each sequence's gathered context:
    scattered blocks, contexts of any length (drawn under 90 + rows unless given), the last block partly
    filled. q_scale: the queries' spread (scores spread with it)."""
    g = torch.Generator().manual_seed(h * 100 + kvh + d + len(qlens) + bs)
    if ctx_lens is None:
        ctx_lens = [int(torch.randint(n, 90, (1,), generator=g)) + n for n in qlens]   # >= the query rows
    max_blocks = max((c + bs - 1) // bs for c in ctx_lens)
    num_blocks = len(qlens) * max_blocks + 16
    attn = PagedAttention(h, kvh, d, d ** -0.5, "cpu_kernel")
    attn.k_cache = pool_of((num_blocks, kvh, bs, d), kv_dtype, g)
    attn.v_cache = pool_of((num_blocks, kvh, bs, d), kv_dtype, g)
    perm = torch.randperm(num_blocks, generator=g)[:len(qlens) * max_blocks]       # scattered blocks
    block_tables = perm.view(len(qlens), max_blocks).to(torch.int32)
    t = sum(qlens)
    q = (torch.randn(t, h, d, generator=g) * q_scale).to(q_dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_batched_tokens=t,
                             block_tables=block_tables, context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                             cu_query_lens=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32))
    out = torch.full((t, h * d), float("nan"), dtype=q_dtype)
    attn._kernel(q, out, meta)
    ref = reference(q.float(), attn.k_cache, attn.v_cache, block_tables, ctx_lens, qlens, h, kvh, d)
    if q_dtype == torch.bfloat16:
        # bf16 products are exact in fp32 and the sums run in fp32: the fp32 result, rounded once
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h,kvh,d,qlens", DECODE_CASES)
@pytest.mark.parametrize("kv_dtype,q_dtype", DTYPES)
def test_kernel_equals_sdpa_over_the_gathered_context(h, kvh, d, qlens, kv_dtype, q_dtype):
    check_decode(h, kvh, d, qlens, kv_dtype, q_dtype)


@pytest.mark.parametrize("kv_dtype,q_dtype", DTYPES)
def test_kernel_takes_each_rows_max_over_all_its_keys(kv_dtype, q_dtype):
    """Scores hundreds apart (a near one-hot softmax): e^(score - max) overflows unless the max the
    softmax subtracts is the row's largest score over every key (the vector part and the tail)."""
    check_decode(8, 4, 64, [1, 2, 1, 1], kv_dtype, q_dtype, q_scale=400.0)


@contextlib.contextmanager
def kernel_team(threads):
    """The kernels' team at `threads` (the work split depends on it), torch's count again after."""
    cpu_kernels().set_num_threads(threads)
    try:
        yield
    finally:
        cpu_kernels().set_num_threads(torch.get_num_threads())


@pytest.mark.parametrize("h,kvh,d,qlens", WIDE_CASES)
def test_kernel_items_of_several_kv_heads(h, kvh, d, qlens):
    with kernel_team(2):
        for kv_dtype, q_dtype in DTYPES:
            check_decode(h, kvh, d, qlens, kv_dtype, q_dtype)


# (heads, kv heads, head size, query rows, contexts, threads): fewer items (sequence, kv head) than threads,
# so each context is split into parts of >= 16 blocks whose softmax max and sum are merged
SPLIT_CASES = [
    (8, 1, 64, [1], [2000], 2),                # one sequence, one kv head (MQA): 2 parts
    (8, 1, 64, [1], [1013], 4),                # 4 parts, the last block partly filled
    (16, 2, 128, [1, 4], [1500, 700], 8),      # a verify window, contexts of unequal length
    (8, 1, 64, [1, 4], [2000, 17], 4),         # the short context's last part: keys its first rows do not see
]


@pytest.mark.parametrize("h,kvh,d,qlens,ctx_lens,threads", SPLIT_CASES)
def test_kernel_splits_a_long_context_across_threads(h, kvh, d, qlens, ctx_lens, threads):
    with kernel_team(threads):
        for kv_dtype, q_dtype in DTYPES:
            check_decode(h, kvh, d, qlens, kv_dtype, q_dtype, ctx_lens=ctx_lens)


@pytest.mark.parametrize("bs", [8, 24, 64])
def test_kernel_reads_any_block_size(bs):
    """Blocks of fewer keys than a vector, of a count that is not a multiple of one, and of several."""
    for kv_dtype, q_dtype in DTYPES:
        check_decode(8, 4, 64, [1, 3, 1, 2], kv_dtype, q_dtype, bs=bs)
        check_decode(16, 2, 128, [1, 4], kv_dtype, q_dtype, bs=bs)


@pytest.fixture(scope="module")
def level_libraries(tmp_path_factory):
    """Each runnable level's build of the attention kernels (the decode and prefill kernels, the store)."""
    return build_levels(tmp_path_factory, "paged_attention", "prefill_attention", "team")


@ON_X86_64
def test_kernel_equals_sdpa_in_every_build_this_cpu_runs(level_libraries, monkeypatch):
    """Each x86-64 level's build of the kernel this CPU can run (plain loops at v2, ymm at v3, zmm at v4,
    the bf16 pair dot product with AVX-512 BF16) against SDPA, not only the library loaded here."""
    for so in level_libraries.values():
        monkeypatch.setattr(ck, "_lib", ck.load_library(so))
        for h, kvh, d, qlens in DECODE_CASES[1:5]:
            for kv_dtype, q_dtype in DTYPES:
                check_decode(h, kvh, d, qlens, kv_dtype, q_dtype)
        ck._lib.set_num_threads(2)                      # one sequence of one kv head: a split context
        for kv_dtype, q_dtype in DTYPES:
            check_decode(8, 1, 64, [1], kv_dtype, q_dtype, ctx_lens=[1013])


def test_rows_beyond_an_item_are_a_typed_failure_not_a_crash():
    """G x query rows of one kv head above the kernel's row budget: the call fails and says so."""
    attn = PagedAttention(64, 1, 64, 0.125, "cpu_kernel")
    attn.k_cache = attn.v_cache = torch.zeros(8, 1, 16, 64)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_batched_tokens=5,
                             block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             context_lens=torch.tensor([5], dtype=torch.int32),
                             cu_query_lens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="paged_attention kernel failed"):
        attn._kernel(torch.zeros(5, 64, 64), torch.empty(5, 64 * 64), meta)


HAS_PREFILL = cpu_kernels() is not None and hasattr(cpu_kernels(), "prefill_attention_f32")
HAS_BF16_DOT = cpu_kernels() is not None and hasattr(cpu_kernels(), "prefill_attention_bf16")   # AVX-512 BF16


@pytest.mark.skipif(not HAS_PREFILL, reason="the prefill kernel is built for AVX-512 or AVX2 + FMA CPUs")
@pytest.mark.parametrize("h,kvh,d,bs,spans", [
    (8, 4, 64, 16, [(0, 300), (0, 17), (40, 33)]),        # (cached, new): fresh chunks and one after a cache hit
    (8, 4, 64, 8, [(5, 1), (0, 16), (100, 64)]),          # a pool block size below the kernel's key block
    (16, 2, 128, 32, [(0, 45), (64, 16)]),               # G = 8, head size 128
    (4, 4, 64, 16, [(0, 130)]),                           # MHA
    (16, 1, 64, 16, [(3, 40), (129, 7), (0, 64)]),        # G = 16 (a tile's most rows); contexts end mid key block
])
@pytest.mark.parametrize("kv_dtype,q_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),     # a bf16 model computing in fp32 (no bf16 dot product on the CPU)
    (torch.bfloat16, torch.bfloat16),    # one computing in bf16: the pair dot product, or queries widened
    (FP8, torch.float32),                # an fp8 pool (--kv-cache-dtype fp8) under fp32 activations
    (FP8, torch.bfloat16),               # and under bf16 ones: its rows widened to bf16 pairs, or queries widened
])
def test_prefill_kernel_equals_causal_sdpa(h, kvh, d, bs, spans, kv_dtype, q_dtype):
    g = torch.Generator().manual_seed(h + d + bs + len(spans))
    ctx_lens = [c + n for c, n in spans]
    qlens = [n for _, n in spans]
    max_blocks = max((c + bs - 1) // bs for c in ctx_lens)
    num_blocks = len(spans) * max_blocks + 4
    attn = PagedAttention(h, kvh, d, d ** -0.5, "cpu_kernel")
    attn.k_cache = torch.randn(num_blocks, kvh, bs, d, generator=g).to(kv_dtype)
    attn.v_cache = torch.randn(num_blocks, kvh, bs, d, generator=g).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=g)[:len(spans) * max_blocks]
    block_tables = perm.view(len(spans), max_blocks).to(torch.int32)
    t = sum(qlens)
    q = torch.randn(t, h, d, generator=g).to(q_dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_batched_tokens=0,
                             prefill_block_tables=block_tables,
                             prefill_context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                             prefill_cu_query_lens=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()],
                                                                dtype=torch.int32))
    out = torch.full((t, h * d), float("nan"), dtype=q_dtype)
    if q_dtype == kv_dtype == torch.bfloat16 and attention.AMX:     # SDPA's bf16 path runs on AMX there
        assert not attn._prefill_kernel(q, out, meta)
        return
    assert attn._prefill_kernel(q, out, meta)
    ref = reference(q.float(), attn.k_cache, attn.v_cache, block_tables, ctx_lens, qlens, h, kvh, d)
    if q_dtype == torch.bfloat16 and HAS_BF16_DOT:
        # P rounded to bf16 (unit roundoff u = 2^-8) moves the output by at most u x max|V|, and the
        # output's rounding by u x |out|; on average it stays near the error of rounding once.
        err = (out.float() - ref).abs()
        assert bool((err <= 2 ** -8 * (attn.v_cache.float().abs().max() + ref.abs()) + 1e-5).all()), float(err.max())
        assert float(err.mean()) <= 2 * float((ref.to(torch.bfloat16).float() - ref).abs().mean())
    elif q_dtype == torch.bfloat16:    # widened: the fp32 result, rounded once
        torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=0, atol=0.01)
        assert float((out.float() - ref).abs().max()) <= float(ref.abs().max()) * 2 ** -8
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def four_token_prefill() -> AttentionMetadata:
    """A step of one fresh 4-token prefill span in pool block 0."""
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_batched_tokens=0,
                             prefill_block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             prefill_context_lens=torch.tensor([4], dtype=torch.int32),
                             prefill_cu_query_lens=torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.skipif(not HAS_PREFILL, reason="the prefill kernel is built for AVX-512 or AVX2 + FMA CPUs")
def test_prefill_kernel_declines_what_it_does_not_cover():
    """Other head sizes, and bf16 activations over an fp32 pool, go through SDPA: the kernel says no
    instead of computing."""
    meta = four_token_prefill()
    attn = PagedAttention(2, 2, 40, 0.1, "cpu_kernel")
    attn.k_cache = attn.v_cache = torch.zeros(2, 2, 16, 40)
    assert not attn._prefill_kernel(torch.zeros(4, 2, 40), torch.empty(4, 80), meta)
    attn = PagedAttention(2, 2, 64, 0.1, "cpu_kernel")
    attn.k_cache = attn.v_cache = torch.zeros(2, 2, 16, 64)
    assert not attn._prefill_kernel(torch.zeros(4, 2, 64, dtype=torch.bfloat16),
                                    torch.empty(4, 128, dtype=torch.bfloat16), meta)


@pytest.mark.skipif(not HAS_BF16_DOT or attention.AMX,
                    reason="the bf16 prefill kernel runs on AVX-512 BF16 without AMX")
def test_bf16_prefill_kernel_declines_queries_at_an_odd_row_stride():
    """It reads each row's queries as bf16 pairs (32-bit gathers): rows an odd number of elements apart
    are left to SDPA instead of read at the wrong offsets."""
    meta = four_token_prefill()
    attn = PagedAttention(2, 2, 64, 0.125, "cpu_kernel")
    attn.k_cache = attn.v_cache = torch.ones(1, 2, 16, 64, dtype=torch.bfloat16)
    q = torch.ones(4 * 129, dtype=torch.bfloat16).as_strided((4, 2, 64), (129, 64, 1))
    assert not attn._prefill_kernel(q, torch.zeros(4, 128, dtype=torch.bfloat16), meta)
    assert attn._prefill_kernel(q.contiguous(), torch.zeros(4, 128, dtype=torch.bfloat16), meta)


@pytest.fixture
def asked(monkeypatch) -> list[str]:
    """The names of the kernels the attention layer looks up (and finds) while the test runs."""
    names: list[str] = []
    lookup = attention.kernel

    def recording(name, dtype, kv_dtype=None):
        fn = lookup(name, dtype, kv_dtype)
        names.append(fn.__name__)
        return fn
    monkeypatch.setattr(attention, "kernel", recording)
    return names


@pytest.mark.skipif(not HAS_PREFILL, reason="the prefill kernel is built for AVX-512 or AVX2 + FMA CPUs")
def test_bf16_prefill_takes_the_pair_dot_kernel_where_the_library_has_it(asked):
    """bf16 queries over a bf16 pool run the bf16 kernel in place where it is built (AVX-512 BF16), else
    the fp32 one on widened queries; with AMX neither (SDPA)."""
    meta = four_token_prefill()
    attn = PagedAttention(2, 2, 64, 0.125, "cpu_kernel")
    attn.k_cache = attn.v_cache = torch.ones(1, 2, 16, 64, dtype=torch.bfloat16)
    out = torch.zeros(4, 128, dtype=torch.bfloat16)
    ran = attn._prefill_kernel(torch.ones(4, 2, 64, dtype=torch.bfloat16), out, meta)
    if attention.AMX:
        assert not ran and asked == []
        return
    assert ran and bool((out == 1).all())
    assert asked == (["prefill_attention_bf16"] if HAS_BF16_DOT else ["prefill_attention_f32_bf16kv"])


@pytest.mark.skipif(not HAS_PREFILL, reason="the prefill kernel is built for AVX-512 or AVX2 + FMA CPUs")
def test_bf16_prefill_over_an_fp8_pool_takes_the_pair_dot_kernel_with_amx_too(asked, monkeypatch):
    """bf16 queries over an fp8 pool: the pair dot product kernel widening the pool's rows to bf16 where it
    is built (AVX-512 BF16, AMX machines included: SDPA would read a gathered, widened copy), else the fp32
    kernel on widened queries."""
    monkeypatch.setattr(attention, "AMX", True)
    attn = PagedAttention(2, 2, 64, 0.125, "cpu_kernel")
    attn.k_cache = attn.v_cache = torch.full((1, 2, 16, 64), 3.0).to(FP8)
    out = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert attn._prefill_kernel(torch.ones(4, 2, 64, dtype=torch.bfloat16), out, four_token_prefill())
    assert bool((out == 3).all())
    assert asked == (["prefill_attention_bf16_fp8kv"] if HAS_BF16_DOT else ["prefill_attention_f32_fp8kv"])


def test_kernel_suffix_names_each_activation_and_pool_dtype():
    assert ck.kernel_suffix(torch.float32) == ck.kernel_suffix(torch.float32, torch.float32) == "f32"
    assert ck.kernel_suffix(torch.bfloat16, torch.bfloat16) == "bf16"
    assert ck.kernel_suffix(torch.float32, torch.bfloat16) == "f32_bf16kv"
    assert ck.kernel_suffix(torch.float32, FP8) == "f32_fp8kv"
    assert ck.kernel_suffix(torch.bfloat16, FP8) == "bf16_fp8kv"
    assert set(ck.SUFFIXES) >= {"f32", "bf16", "f32_bf16kv", "f32_fp8kv", "bf16_fp8kv"}


def fp8_cases(g: torch.Generator) -> torch.Tensor:
    """fp32 values the conversion to fp8 must round as torch does: every finite fp8 value, the exact ties
    between neighbours and the fp32 values either side of each, subnormals and what rounds to or below
    them, fp32 subnormals, values beyond 448 (saturated), infinities, both zeros, and normals at scales
    from the subnormals to past 448."""
    grid = torch.arange(0x7f, dtype=torch.uint8).view(FP8).float()           # +0 .. 448
    mid = (grid[1:] + grid[:-1]) / 2                                          # exact in fp32
    inf = torch.tensor(float("inf"))
    special = torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -6 - 2.0 ** -12, 1e-40, 1e-45,
                            448.5, 463.9, 464.0, 464.1, 479.9, 480.0, 1e4, 3e38, float("inf")])
    normals = [torch.randn(4096, generator=g) * scale for scale in (1e-3, 0.05, 1.0, 20.0, 300.0)]
    v = torch.cat([grid, mid, mid.nextafter(inf), mid.nextafter(-inf), special, *normals])
    return torch.cat([v, -v])


def check_fp8_store(src_dtype: torch.dtype) -> None:
    """K and V, views into a fused projection (token stride above KVH x D), stored into an fp8 pool: the bytes
    at each written slot are torch's rounding of the (fp32-widened) source; slots < 0 leave the pool as it was."""
    g = torch.Generator().manual_seed(11)
    h, kvh, d, bs = 4, 2, 64, 16
    values = fp8_cases(g)
    n = -(-values.numel() // (kvh * d))                                         # tokens
    values = torch.cat([values, torch.randn(n * kvh * d - values.numel(), generator=g)])
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=g)
    qkv[:, h * d:(h + kvh) * d] = values.view(n, kvh * d)
    qkv[:, (h + kvh) * d:] = values[torch.randperm(values.numel(), generator=g)].view(n, kvh * d)
    qkv = qkv.to(src_dtype)
    k, v = qkv[:, h * d:(h + kvh) * d].view(n, kvh, d), qkv[:, (h + kvh) * d:].view(n, kvh, d)
    num_blocks = -(-n // bs) + 3
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[::7] = -1
    kc = torch.full((num_blocks, kvh, bs, d), 0x55, dtype=torch.uint8).view(FP8)
    vc = torch.full((num_blocks, kvh, bs, d), 0x55, dtype=torch.uint8).view(FP8)
    ck.kernel("store_kv", src_dtype, FP8)(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(),
        n, kvh, d, bs, kc.stride(0), kc.stride(2), kc.stride(1))
    for pool, src in ((kc, k), (vc, v)):
        want = torch.full((num_blocks, kvh, bs, d), 0x55, dtype=torch.uint8)
        kept = slots >= 0
        want[slots[kept] // bs, :, slots[kept] % bs] = src[kept].float().to(FP8).view(torch.uint8)
        bad = (pool.view(torch.uint8) != want).nonzero()
        if len(bad):
            pytest.fail(f"{len(bad)} bytes differ from torch's, the first at (block, head, offset, d) "
                        f"{bad[0].tolist()}")


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_into_an_fp8_pool_rounds_as_torch_does(src_dtype):
    check_fp8_store(src_dtype)


@pytest.mark.parametrize("h,d", [(4, 64), (16, 64), (4, 40)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_every_fp8_value_exactly(h, d, q_dtype):
    """Sequences of one key: each output row is its kv head's V row, so every fp8 code but NaN (both zeros
    and the subnormals included) comes out as its exact value (in bf16 too: fp8's values are bf16's), through
    the vectors widened per V tile (G = 2), widened once per run for several tiles (G = 8), and the plain
    loops (head size 40)."""
    g = torch.Generator().manual_seed(h + d)
    kvh, bs = 2, 16
    codes = torch.tensor([c for c in range(256) if c & 0x7f != 0x7f], dtype=torch.uint8)
    b = -(-codes.numel() // (kvh * d))
    rows = torch.cat([codes, codes[torch.randint(0, codes.numel(), (b * kvh * d - codes.numel(),), generator=g)]])
    vc = torch.zeros(b + 1, kvh, bs, d, dtype=torch.uint8)
    vc[1:, :, 0] = rows.view(b, kvh, d)
    vc = vc.view(FP8)
    attn = PagedAttention(h, kvh, d, d ** -0.5, "cpu_kernel")
    attn.k_cache, attn.v_cache = fp8_codes(vc.shape, g), vc
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64), num_batched_tokens=b,
                             block_tables=torch.arange(1, b + 1, dtype=torch.int32).view(b, 1),
                             context_lens=torch.ones(b, dtype=torch.int32),
                             cu_query_lens=torch.arange(b + 1, dtype=torch.int32))
    out = torch.full((b, h * d), float("nan"), dtype=q_dtype)
    attn._kernel(torch.randn(b, h, d, generator=g).to(q_dtype), out, meta)
    want = vc[1:, :, 0].float().repeat_interleave(h // kvh, dim=1).reshape(b, h * d)
    assert torch.equal(out.float(), want)


def check_fp8_prefill(h, kvh, d, bs, spans):
    """The fp32 prefill kernel over an fp8 pool (called directly: fp32 queries, the engine widens bf16 ones)
    against SDPA over the pool's values as fp32."""
    g = torch.Generator().manual_seed(h + d + bs + len(spans))
    ctx_lens, qlens = [c + n for c, n in spans], [n for _, n in spans]
    max_blocks = max((c + bs - 1) // bs for c in ctx_lens)
    num_blocks = len(spans) * max_blocks + 4
    kc, vc = fp8_codes((num_blocks, kvh, bs, d), g), fp8_codes((num_blocks, kvh, bs, d), g)
    perm = torch.randperm(num_blocks, generator=g)[:len(spans) * max_blocks]
    bt = perm.view(len(spans), max_blocks).to(torch.int32)
    t = sum(qlens)
    q = torch.randn(t, h, d, generator=g)
    out = torch.full((t, h * d), float("nan"))
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    rc = ck.kernel("prefill_attention", torch.float32, FP8)(
        q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), out.stride(0), bt.data_ptr(),
        max_blocks, ctx.data_ptr(), cu.data_ptr(), len(spans), h, kvh, d, bs, kc.stride(0), kc.stride(2),
        kc.stride(1), d ** -0.5)
    assert rc == 0
    ref = reference(q, kc, vc, bt, ctx_lens, qlens, h, kvh, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


FP8_PREFILL_CASES = [
    (8, 4, 64, 16, [(0, 300), (0, 17), (40, 33)]),        # (cached, new): fresh chunks and one after a cache hit
    (16, 2, 128, 32, [(0, 45), (64, 16)]),                # G = 8, head size 128
    (16, 1, 64, 8, [(3, 40), (129, 7), (0, 64)]),         # G = 16, blocks below the kernel's key block
]


@pytest.mark.skipif(not HAS_PREFILL, reason="the prefill kernel is built for AVX-512 or AVX2 + FMA CPUs")
@pytest.mark.parametrize("h,kvh,d,bs,spans", FP8_PREFILL_CASES)
def test_prefill_kernel_over_an_fp8_pool_equals_causal_sdpa(h, kvh, d, bs, spans):
    check_fp8_prefill(h, kvh, d, bs, spans)


@ON_X86_64
def test_fp8_store_and_prefill_in_every_build_this_cpu_runs(level_libraries, monkeypatch):
    """The store's conversion (vectorised by the compiler for each level's vectors) and the prefill
    kernel's fp8 widening (AVX2 or AVX-512) in each level's build, not only the library loaded here."""
    for so in level_libraries.values():
        monkeypatch.setattr(ck, "_lib", ck.load_library(so))
        for src_dtype in (torch.float32, torch.bfloat16):
            check_fp8_store(src_dtype)
        if hasattr(ck._lib, "prefill_attention_f32_fp8kv"):      # AVX2 + FMA and AVX-512 builds
            for case in FP8_PREFILL_CASES[:2]:
                check_fp8_prefill(*case)
