/* Causal attention of prefill chunks with bfloat16 queries, pool and output, on AVX-512 BF16's pair
 * dot product (vdpbf16ps: each of 16 fp32 lanes += the products of two bf16 pairs). The fp32 kernel
 * (prefill_attention.c) widens every K/V element and multiplies one pair per FMA lane; this one
 * multiplies two per lane, straight from the pool. Same arguments and work items as
 * prefill_attention_f32: (sequence, kv head, tile of PB_TOKENS query tokens), keys PB_KEYS at a time,
 * flash-attention style. The layout spares every per-block transpose:
 * - scores are key-major, S[key][query row]: the tile's queries are transposed once into pairs of d
 *   per row (qT[d / 2][row], 32 bits each), and each key's pair of d is broadcast from the pool;
 * - so the online softmax runs down the keys with one query row per lane (running max, sum and
 *   rescale as vectors, no horizontal reduction);
 * - P is rounded to bf16 (as flash-attention does on GPUs) and paired per two keys; V rows are paired
 *   per two keys by interleaving them (vpunpck: within each 32 of D the order becomes 0-3, 8-11,
 *   16-19, 24-27 | 4-7, 12-15, 20-23, 28-31, which the accumulators keep and the output undoes);
 * - P V accumulates in registers, tiles of query rows x vectors of D (the fp32 kernel's PF_PV shapes).
 * Scores, softmax and accumulators are fp32; the output is rounded to bf16 once. A tile's fixed work is
 * on vectors too (element-at-a-time loops there took 1.1-1.3x a 64-512-token span's time, 1.5-2.7x at
 * head size 128): the queries gathered 16 rows at a time, the softmax writing P's bf16 pairs, the output
 * 32 elements at a time (packus undoes the interleave). Over an fp8 pool (prefill_attention_bf16_fp8kv) each
 * block's K and V rows are widened to bf16 once (exact: every e4m3 value is a bf16) into scratch rows the
 * same loops read: one conversion per element per tile against 2 x 32 x G products.
 * Built where the compiler targets AVX-512 BF16;
 * elsewhere the engine widens the queries for the fp32 kernel, and with AMX it leaves bf16 spans to
 * SDPA, whose GEMMs run on tiles (model/attention.py).
 */
#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PB_TOKENS 32                      /* query tokens per work item */
#define PB_MAX_ROWS (PB_TOKENS * 16)      /* G <= 16 */
#define PB_KEYS 32                        /* keys per block */
#define PB_KCHUNK 8                       /* keys per scores tile */

typedef uint32_t pair_t;                  /* two bf16, the first in the low half */

static inline __m512 pb_dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* 16 fp32 lanes rounded to bf16 (nearest even), each in the low half of a 32-bit lane. */
static inline __m512i pb_round(__m512 x) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

/* S[j][rv * 16 + lane] = scale x (query row . key j) for keys j0 .. j0 + 7 and row vectors rv0 ..
 * rv0 + NRV - 1 (NRV a constant, 1 or 2); kw: each key's row in the pool as D / 2 pairs. */
static inline __attribute__((always_inline)) void pb_scores(const pair_t *qT, int RW, const pair_t *const *kw,
                                                            int j0, int rv0, const int NRV, int DP,
                                                            __m512 scale, float *S) {
    __m512 s[PB_KCHUNK][2];
    const pair_t *kr[PB_KCHUNK];
    for (int k = 0; k < PB_KCHUNK; k++) {
        kr[k] = kw[j0 + k];
        for (int v = 0; v < NRV; v++) s[k][v] = _mm512_setzero_ps();
    }
    for (int p = 0; p < DP; p++) {
        __m512i q[2];
        for (int v = 0; v < NRV; v++) q[v] = _mm512_load_si512(qT + (int64_t)p * RW + (rv0 + v) * 16);
        _Pragma("GCC unroll 8") for (int k = 0; k < PB_KCHUNK; k++) {
            const __m512i b = _mm512_set1_epi32((int)kr[k][p]);
            for (int v = 0; v < NRV; v++) s[k][v] = pb_dot(s[k][v], b, q[v]);
        }
    }
    for (int k = 0; k < PB_KCHUNK; k++)
        for (int v = 0; v < NRV; v++)
            _mm512_store_ps(S + (int64_t)(j0 + k) * RW + (rv0 + v) * 16, _mm512_mul_ps(s[k][v], scale));
}

/* The online-softmax step of row vector rv over keys c0 .. c0 + nk - 1 (S holds their scores, where
 * any row of the vector sees them): the probabilities (zero where a row does not see the key) go to Pp
 * rounded to bf16 and paired per two keys, m and l take the running max and sum (of the fp32
 * probabilities), alpha the factor the rows' earlier P V sums take. Block 0 holds key 0, which every row
 * sees, so m is finite from the first block on. Where the vector's first row (the lowest pos) sees the
 * whole block, as in every block before the diagonal, no key needs a mask. */
static inline __attribute__((always_inline)) __m512i pb_pair(__m512 p0, __m512 p1) {
    return _mm512_or_si512(pb_round(p0), _mm512_slli_epi32(pb_round(p1), 16));
}

/* Key j's probabilities for row vector rv, e^(S - mx), zero in rows that do not see it where MASKED
 * (a constant: the blocks before the diagonal run without the compare). */
static inline __attribute__((always_inline)) __m512 pb_prob(const float *S, int RW, int rv, int j, int c0,
                                                            __m512i posv, __m512 mx, const int MASKED) {
    const __m512 e = exp_vec_nonpos(_mm512_sub_ps(_mm512_load_ps(S + (int64_t)j * RW + rv * 16), mx));
    return MASKED ? _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(_mm512_set1_epi32(c0 + j), posv), e) : e;
}

/* The probabilities of keys 0 .. nk - 1 into Pp (bf16 pairs), their fp32 sum returned. */
static inline __attribute__((always_inline)) __m512 pb_probs(const float *S, int RW, int rv, int c0, int nk,
                                                             __m512i posv, __m512 mx, pair_t *Pp, const int MASKED) {
    __m512 sum = _mm512_setzero_ps();
    int j = 0;
    for (; j + 2 <= nk; j += 2) {
        const __m512 p0 = pb_prob(S, RW, rv, j, c0, posv, mx, MASKED);
        const __m512 p1 = pb_prob(S, RW, rv, j + 1, c0, posv, mx, MASKED);
        sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);
        _mm512_store_si512(Pp + (int64_t)(j / 2) * RW + rv * 16, pb_pair(p0, p1));
    }
    if (j < nk) {                             /* an odd last key: its pair's second half is 0 */
        const __m512 p0 = pb_prob(S, RW, rv, j, c0, posv, mx, MASKED);
        sum = _mm512_add_ps(sum, p0);
        _mm512_store_si512(Pp + (int64_t)(j / 2) * RW + rv * 16, pb_pair(p0, _mm512_setzero_ps()));
    }
    return sum;
}

static inline __attribute__((always_inline)) void pb_softmax(const float *S, int RW, int rv, int c0, int nk,
                                                             const int *pos, float *m, float *l, float *alpha,
                                                             pair_t *Pp) {
    const __m512i posv = _mm512_loadu_si512(pos + rv * 16);
    const int full = c0 + nk - 1 <= pos[rv * 16];
    const __m512 mold = _mm512_load_ps(m + rv * 16);
    __m512 mx = mold, sum;
    if (full) {                               /* four max chains: one would wait on each max's latency */
        __m512 m4[4] = {mold, mold, mold, mold};
        int j = 0;
        const float *sv = S + rv * 16;
        for (; j + 4 <= nk; j += 4)
            for (int u = 0; u < 4; u++) m4[u] = _mm512_max_ps(m4[u], _mm512_load_ps(sv + (int64_t)(j + u) * RW));
        for (; j < nk; j++) m4[0] = _mm512_max_ps(m4[0], _mm512_load_ps(sv + (int64_t)j * RW));
        mx = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
        sum = pb_probs(S, RW, rv, c0, nk, posv, mx, Pp, 0);
    } else {
        for (int j = 0; j < nk; j++) {
            const __mmask16 vis = _mm512_cmple_epi32_mask(_mm512_set1_epi32(c0 + j), posv);
            mx = _mm512_mask_max_ps(mx, vis, mx, _mm512_load_ps(S + (int64_t)j * RW + rv * 16));
        }
        sum = pb_probs(S, RW, rv, c0, nk, posv, mx, Pp, 1);
    }
    const __m512 al = exp_vec_nonpos(_mm512_sub_ps(mold, mx));   /* m = -inf: e^-87, times l and acc = 0 */
    _mm512_store_ps(l + rv * 16, _mm512_fmadd_ps(_mm512_load_ps(l + rv * 16), al, sum));
    _mm512_store_ps(m + rv * 16, mx);
    _mm512_store_ps(alpha + rv * 16, al);
}

/* acc[r][0..D) = acc[r] * alpha[r] + sum over key pairs jp of P pairs x V pairs: rows RR at a time, D in
 * slices of SV vectors (the slice's accumulators stay in registers while the key pairs stream past). */
#define DEFINE_PB_PV(SV, RR)                                                                              \
static inline __attribute__((always_inline)) void pb_pv_##SV##x##RR(                                    \
        float *acc, int D, const pair_t *Pp, int RW, const float *alpha, const pair_t *Vp, int npairs,    \
        int rows) {                                                                                       \
    for (int d0 = 0; d0 < D; d0 += SV * 16)                                                               \
    for (int r0 = 0; r0 < rows; r0 += RR) {                                                               \
        const int rr = rows - r0 < RR ? rows - r0 : RR;                                                   \
        __m512 a[RR][SV];                                                                                 \
        for (int r = 0; r < rr; r++) {                                                                    \
            const __m512 al = _mm512_set1_ps(alpha[r0 + r]);                                              \
            for (int v = 0; v < SV; v++)                                                                  \
                a[r][v] = _mm512_mul_ps(_mm512_load_ps(acc + (int64_t)(r0 + r) * D + d0 + v * 16), al);   \
        }                                                                                                 \
        if (rr == RR) {                                                                                   \
            for (int jp = 0; jp < npairs; jp++) {                                                         \
                __m512i vv[SV];                                                                           \
                for (int v = 0; v < SV; v++) vv[v] = _mm512_load_si512(Vp + (int64_t)jp * D + d0 + v * 16); \
                _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {                                    \
                    const __m512i p = _mm512_set1_epi32((int)Pp[(int64_t)jp * RW + r0 + r]);              \
                    _Pragma("GCC unroll 8") for (int v = 0; v < SV; v++) a[r][v] = pb_dot(a[r][v], p, vv[v]); \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            for (int jp = 0; jp < npairs; jp++) {                                                         \
                __m512i vv[SV];                                                                           \
                for (int v = 0; v < SV; v++) vv[v] = _mm512_load_si512(Vp + (int64_t)jp * D + d0 + v * 16); \
                for (int r = 0; r < rr; r++) {                                                            \
                    const __m512i p = _mm512_set1_epi32((int)Pp[(int64_t)jp * RW + r0 + r]);              \
                    for (int v = 0; v < SV; v++) a[r][v] = pb_dot(a[r][v], p, vv[v]);                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < rr; r++)                                                                      \
            for (int v = 0; v < SV; v++) _mm512_store_ps(acc + (int64_t)(r0 + r) * D + d0 + v * 16, a[r][v]); \
    }                                                                                                     \
}
DEFINE_PB_PV(4, 6)     /* D = 64: 24 accumulators + 4 V pairs' vectors of 32 zmm */
DEFINE_PB_PV(8, 3)     /* D = 128 */

/* An fp8 row of D (a multiple of 32) as bf16: the widened lanes (times FP8_UNIT) scaled back, rounded
 * to bf16 without a change (each fp8 value is a bf16) and narrowed. */
static inline void pb_fp8_row(bf16_t *dst, const fp8_t *src, int D) {
    const __m512 unit = _mm512_set1_ps(1.f / FP8_UNIT);
    for (int d = 0; d < D; d += 16)
        vec_put_bf16(dst + d, _mm512_mul_ps(VEC_LOAD_FP8(src + d), unit));
}

/* One work item (the arguments of pf_item in prefill_attention.c; offsets are in elements). `fp8`: kc, vc
 * are fp8 pools (fp8_t) whose rows the item widens into its scratch rows kw8 / vw8 block by block. */
static inline __attribute__((always_inline)) void pb_item(
    const bf16_t *q, int64_t q_stride, const void *kc, const void *vc, bf16_t *out, int64_t out_stride,
    const int32_t *bt, int ctx, int q0, int qlen, int t0, int t1, int kh, int H, int KVH, int D, int BS,
    int64_t blk_stride, int64_t tok, int64_t head_stride, float scale, float *scratch, const int fp8) {
    const int G = H / KVH, rows = (t1 - t0) * G, nrv = (rows + 15) / 16, RW = nrv * 16, DP = D / 2;
    pair_t *qT = (pair_t *)scratch;                              /* [DP][RW] */
    float *S = (float *)(qT + (int64_t)DP * PB_MAX_ROWS);        /* [PB_KEYS][RW] */
    pair_t *Pp = (pair_t *)(S + PB_KEYS * PB_MAX_ROWS);          /* [PB_KEYS / 2][RW] */
    pair_t *Vp = Pp + PB_KEYS / 2 * PB_MAX_ROWS;                 /* [PB_KEYS / 2][D] */
    float *acc = (float *)(Vp + PB_KEYS / 2 * D);                /* [rows][D] */
    float *m = acc + (int64_t)PB_MAX_ROWS * D, *l = m + PB_MAX_ROWS, *alpha = l + PB_MAX_ROWS;
    bf16_t *kw8 = (bf16_t *)(alpha + PB_MAX_ROWS), *vw8 = kw8 + PB_KEYS * D;   /* [PB_KEYS][D] each (fp8) */
    int pos[PB_MAX_ROWS];
    const pair_t *kw[PB_KEYS];
    const bf16_t *vrows[PB_KEYS];
    const pair_t *q_tile = (const pair_t *)(q + (int64_t)(q0 + t0) * q_stride + (int64_t)kh * G * D);
    int at[PB_MAX_ROWS];                    /* row r's query, in pairs from q_tile */
    for (int r = 0; r < RW; r++) {          /* rows past `rows` (to a whole vector) repeat the last one */
        const int rr = r < rows ? r : rows - 1, i = rr / G, g = rr % G;
        at[r] = (int)(((int64_t)i * q_stride + (int64_t)g * D) / 2);
        pos[r] = ctx - qlen + t0 + i;       /* sees keys 0 .. pos (rising with r) */
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    for (int rv = 0; rv < nrv; rv++) {      /* the transpose, 16 rows' pair p at a time */
        const __m512i idx = _mm512_loadu_si512(at + rv * 16);
        for (int p = 0; p < DP; p++)
            _mm512_store_si512(qT + (int64_t)p * RW + rv * 16,
                               _mm512_i32gather_epi32(idx, (const int *)(q_tile + p), 4));
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * (size_t)D);
    const __m512 sc = _mm512_set1_ps(scale);
    const int64_t head = (int64_t)kh * head_stride;
    const int jend = ctx - qlen + t1;       /* keys the tile's last row sees */
    for (int c0 = 0; c0 < jend; c0 += PB_KEYS) {
        const int nk = jend - c0 < PB_KEYS ? jend - c0 : PB_KEYS, npairs = (nk + 1) / 2;
        for (int jj = 0; jj < PB_KEYS; jj++) {   /* keys past the end repeat the last (never visible) */
            const int j = c0 + (jj < nk ? jj : nk - 1);
            const int64_t at = (int64_t)bt[j / BS] * blk_stride + head + (int64_t)(j % BS) * tok;
            if (fp8 && jj < nk) {
                pb_fp8_row(kw8 + (int64_t)jj * D, (const fp8_t *)kc + at, D);
                pb_fp8_row(vw8 + (int64_t)jj * D, (const fp8_t *)vc + at, D);
            }
            kw[jj] = (const pair_t *)(fp8 ? kw8 + (int64_t)(jj < nk ? jj : nk - 1) * D : (const bf16_t *)kc + at);
            vrows[jj] = fp8 ? vw8 + (int64_t)(jj < nk ? jj : nk - 1) * D : (const bf16_t *)vc + at;
        }
        for (int kb = 0; kb < nk; kb += PB_KCHUNK)
            for (int rv = 0; rv < nrv; rv += 2) {
                const int two = rv + 1 < nrv;
                if (c0 + kb > pos[(rv + 1 + two) * 16 - 1]) continue;   /* none of these rows sees these keys */
                if (two)
                    pb_scores(qT, RW, kw, kb, rv, 2, DP, sc, S);
                else
                    pb_scores(qT, RW, kw, kb, rv, 1, DP, sc, S);
            }
        for (int rv = 0; rv < nrv; rv++) pb_softmax(S, RW, rv, c0, nk, pos, m, l, alpha, Pp);
        for (int jp = 0; jp < npairs; jp++) {
            const int j1 = 2 * jp + 1 < nk;
            const bf16_t *v0 = vrows[2 * jp], *v1 = j1 ? vrows[2 * jp + 1] : v0;   /* P is 0 for the spare */
            for (int d = 0; d < D; d += 32) {
                const __m512i x = _mm512_loadu_si512(v0 + d), y = _mm512_loadu_si512(v1 + d);
                _mm512_store_si512(Vp + (int64_t)jp * D + d, _mm512_unpacklo_epi16(x, y));
                _mm512_store_si512(Vp + (int64_t)jp * D + d + 16, _mm512_unpackhi_epi16(x, y));
            }
        }
        if (D == 64)
            pb_pv_4x6(acc, D, Pp, RW, alpha, Vp, npairs, rows);
        else
            pb_pv_8x3(acc, D, Pp, RW, alpha, Vp, npairs, rows);
    }
    for (int r = 0; r < rows; r++) {
        const int i = t0 + r / G, g = r % G;
        bf16_t *dst = out + (int64_t)(q0 + i) * out_stride + (int64_t)(kh * G + g) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        const float *ar = acc + (int64_t)r * D;
        for (int d = 0; d < D; d += 32) {   /* packus undoes the interleave (see the top) */
            const __m512i lo = vec_bf16_bits(_mm512_mul_ps(_mm512_load_ps(ar + d), inv));
            const __m512i hi = vec_bf16_bits(_mm512_mul_ps(_mm512_load_ps(ar + d + 16), inv));
            _mm512_storeu_si512(dst + d, _mm512_packus_epi32(lo, hi));
        }
    }
}

/* The entry points, the arguments of prefill_attention_f32 with bf16 queries and output over a bf16 or an
 * fp8 pool: 0, -2 (no scratch), or -3 for what they do not cover (the engine then widens for the fp32 kernel). */
static int pb_run(const bf16_t *q, int64_t q_stride, const void *kc, const void *vc, bf16_t *out,
                  int64_t out_stride, const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,
                  const int32_t *cu_q, int B, int H, int KVH, int D, int BS, int64_t blk_stride,
                  int64_t tok_stride, int64_t head_stride, float scale, const int fp8) {
    if ((D != 64 && D != 128) || H % KVH || H / KVH > 16 || q_stride % 2) return -3;   /* queries read as pairs */
    const int tiles = prefill_tiles(cu_q, B, PB_TOKENS);
    const int64_t scratch_len = (int64_t)D / 2 * PB_MAX_ROWS + (int64_t)PB_KEYS * PB_MAX_ROWS
                                + PB_KEYS / 2 * (PB_MAX_ROWS + D) + (int64_t)PB_MAX_ROWS * D + 3 * PB_MAX_ROWS
                                + (int64_t)PB_KEYS * D;      /* the fp8 rows widened: 2 x [PB_KEYS][D] bf16 */
    int err = 0;
    #pragma omp parallel num_threads(NT)
    {
        float *scratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)((scratch_len + 15) / 16 * 16));
        if (!scratch) err = -2;
        #pragma omp for schedule(dynamic, 1)
        for (int it = tiles * KVH - 1; it >= 0; it--) {   /* a span's last tiles (the most keys) first */
            if (!scratch) continue;
            int b, t0, t1;
            const int kh = it % KVH;
            prefill_tile(cu_q, PB_TOKENS, it / KVH, &b, &t0, &t1);
            const int qlen = cu_q[b + 1] - cu_q[b];
            const int32_t *bt = block_tables + (int64_t)b * max_blocks;
            if (fp8)   /* two call sites: each inlines pb_item with its pool type a constant */
                pb_item(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], qlen, t0, t1, kh, H, KVH, D,
                        BS, blk_stride, tok_stride, head_stride, scale, scratch, 1);
            else
                pb_item(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], qlen, t0, t1, kh, H, KVH, D,
                        BS, blk_stride, tok_stride, head_stride, scale, scratch, 0);
        }
        free(scratch);
    }
    return err;
}

int prefill_attention_bf16(const bf16_t *q, int64_t q_stride, const bf16_t *kc, const bf16_t *vc, bf16_t *out,
                           int64_t out_stride, const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,
                           const int32_t *cu_q, int B, int H, int KVH, int D, int BS, int64_t blk_stride,
                           int64_t tok_stride, int64_t head_stride, float scale) {
    return pb_run(q, q_stride, kc, vc, out, out_stride, block_tables, max_blocks, ctx_lens, cu_q, B, H, KVH, D, BS,
                  blk_stride, tok_stride, head_stride, scale, 0);
}

int prefill_attention_bf16_fp8kv(const bf16_t *q, int64_t q_stride, const fp8_t *kc, const fp8_t *vc, bf16_t *out,
                                 int64_t out_stride, const int32_t *block_tables, int max_blocks,
                                 const int32_t *ctx_lens, const int32_t *cu_q, int B, int H, int KVH, int D, int BS,
                                 int64_t blk_stride, int64_t tok_stride, int64_t head_stride, float scale) {
    return pb_run(q, q_stride, kc, vc, out, out_stride, block_tables, max_blocks, ctx_lens, cu_q, B, H, KVH, D, BS,
                  blk_stride, tok_stride, head_stride, scale, 1);
}
#endif
