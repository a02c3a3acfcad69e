/* Causal attention of prefill chunks over the pool (float32 queries and output over a float32, bfloat16
 * or fp8 e4m3fn pool, the K/V widened as they are read; AVX-512 or AVX2 + FMA builds, elsewhere the engine
 * uses torch's SDPA). fp8 (common.h) is the pool that holds twice a bf16 pool's tokens in the same memory;
 * prefill reads its K/V like any other pool's. Same arguments as paged_attention_f32: sequence b's query rows
 * cu_q[b] .. cu_q[b+1]-1 are the last tokens of its context, its K/V (the chunk's own already stored)
 * read in place through its block table. Work item = (sequence, kv head, tile of PF_TOKENS query
 * tokens); keys are taken PF_KEYS at a time, flash-attention style:
 * - their K rows transposed once into [D][PF_KEYS], shared by the tile's G x 32 query rows;
 * - scores for PF_SCORE_ROWS rows x 16 keys at a time in registers (a row's 16 are one zmm or two ymm);
 * - online softmax per row (running max and sum), over the block's scores in place;
 * - P V accumulated in registers, a tile of rows x vectors of D at a time (PF_PV).
 * Why: torch's fp32 SDPA ran fresh 128-512-token chunks at 24-59 GFLOP/s on the AVX-512 machine, this
 * kernel at 83-112 (2,048 tokens: level, ~120); SDPA stays the path for other head sizes and dtypes
 * (the kernel returns -3). Tiles of 32 tokens measured 3-5% faster than 16 at 300-2,048 tokens.
 * AVX2 (16 ymm registers), per thread over 512-2,048-token spans: blocks of 64 keys (a row's softmax
 * bookkeeping spread over 4x the keys: +10%), P V tiles of 4 rows x 16 floats (a tile's rows cut into
 * full tiles, 8 FMA chains: +17%), score tiles of 6 rows (12 chains: +15%); 40-42 -> 60-67 GFLOP/s.
 */
#include "common.h"

#if defined(VEC)
#define PF_TOKENS 32
#define PF_MAX_ROWS (PF_TOKENS * 16)      /* G <= 16 */
#define PF_SUB (16 / VLEN)                /* vectors of 16 keys' scores */

/* The pool's element type (a constant in each kernel's copy of the loops). */
enum { KV_F32, KV_BF16, KV_FP8 };

/* A row of V (or its part from element d0 on) as fp32 vectors; fp8's in FP8_UNIT (VEC_LOAD_FP8), which
 * the output's division by the softmax sum takes out (3% faster than a multiply per vector). */
#define PF_LOAD_V(row, d0, kvt) ((kvt) == KV_BF16 ? VEC_LOAD_BF16((const bf16_t *)(row) + (d0))               \
                                 : (kvt) == KV_FP8 ? VEC_LOAD_FP8((const fp8_t *)(row) + (d0))                \
                                 : VEC_LOADU((const float *)(row) + (d0)))

#if defined(__AVX512F__)
#define PF_KEYS 16                        /* keys per block */
#define PF_SCORE_ROWS 8                   /* query rows per scores tile: 8 FMA chains (two zmm FMA pipes: 4 rows
                                             measured 8-17% slower on Zen 5, the same bits) */
/* the whole row of D in registers: 24 of 32 zmm */
#define PF_PV(D, ...) do { if ((D) == 64) pf_pv_4x6(__VA_ARGS__); else pf_pv_8x3(__VA_ARGS__); } while (0)

/* One query row's online-softmax step over the block of keys c0 .. c0 + nk - 1: its scores in P (16
 * floats) become probabilities (zero past `pos`, the row's last visible key); *m and *l take the new
 * running max and sum, *alpha the factor the row's earlier P V sums take. 0 when the row sees none of
 * these keys (alpha 1, P zero). */
static inline __attribute__((always_inline)) int pf_softmax_row(float *P, int c0, int nk, int pos,
                                                                float *m, float *l, float *alpha) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 vis = _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(c0)),
                                                  _mm512_set1_epi32(pos)) & (__mmask16)((1u << nk) - 1);
    if (!vis) { *alpha = 1.f; memset(P, 0, 64); return 0; }
    const __m512 sv = _mm512_mask_blend_ps(vis, _mm512_set1_ps(-INFINITY), _mm512_load_ps(P));
    const float mx = vec_hmax(sv), mnew = mx > *m ? mx : *m;
    const __m512 p = _mm512_maskz_mov_ps(vis, exp_vec_nonpos(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
    *alpha = *m == -INFINITY ? 0.f : exp_nonpos(*m - mnew);
    *l = *l * *alpha + vec_hsum(p);
    *m = mnew;
    _mm512_store_ps(P, p);
    return 1;
}
#else
#define PF_KEYS 64
#define PF_SCORE_ROWS 6                   /* 12 FMA chains of two ymm */
#define PF_PV(D, ...) pf_pv_2x4(__VA_ARGS__)   /* 4 rows x 16 floats of D: 8 chains */

/* As the AVX-512 one over a block of 64 keys (8 ymm); the visible lanes are a compare mask (keys
 * c0 + lane <= pos: keys past c0 + nk are past every row's pos, so nk needs no mask of its own, and
 * the scores there, never computed, are blended away). */
static inline __attribute__((always_inline)) int pf_softmax_row(float *P, int c0, int nk, int pos,
                                                                float *m, float *l, float *alpha) {
    (void)nk;
    if (pos < c0) { *alpha = 1.f; memset(P, 0, sizeof(float) * PF_KEYS); return 0; }
    const __m256i lim = _mm256_set1_epi32(pos - c0 + 1);   /* lanes below it are visible */
    __m256 sv[PF_KEYS / 8], vis[PF_KEYS / 8], mx = _mm256_set1_ps(-INFINITY);
    for (int v = 0; v < PF_KEYS / 8; v++) {
        const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(v * 8));
        vis[v] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, lane));
        sv[v] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(P + v * 8), vis[v]);
        mx = _mm256_max_ps(mx, sv[v]);
    }
    const float mb = vec_hmax(mx), mnew = mb > *m ? mb : *m;
    const __m256 mv = _mm256_set1_ps(mnew);
    __m256 sum = _mm256_setzero_ps();
    for (int v = 0; v < PF_KEYS / 8; v++) {
        const __m256 p = _mm256_and_ps(vis[v], exp_vec_nonpos(_mm256_sub_ps(sv[v], mv)));
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(P + v * 8, p);
    }
    *alpha = *m == -INFINITY ? 0.f : exp_nonpos(*m - mnew);
    *l = *l * *alpha + vec_hsum(sum);
    *m = mnew;
    return 1;
}
#endif

/* acc[r][0..D) = acc[r] * alpha[r] + sum_j P[r][j] V[j] over nk keys: rows RR at a time, D in slices of
 * SV vectors (the slice's accumulators stay in registers while the keys stream past). V rows are fp32,
 * or bf16 or fp8 (kvt, a constant) widened as they load. */
#define DEFINE_PF_PV(SV, RR)                                                                              \
static inline __attribute__((always_inline)) void pf_pv_##SV##x##RR(                                    \
        float *acc, int D, const float *P, const float *alpha, const void *const *vrows, int nk, int rows, \
        const int kvt) {                                                                                  \
    for (int d0 = 0; d0 < D; d0 += SV * VLEN)                                                             \
    for (int r0 = 0; r0 < rows; r0 += RR) {                                                               \
        const int rr = rows - r0 < RR ? rows - r0 : RR;                                                   \
        VEC a[RR][SV];                                                                                    \
        for (int r = 0; r < rr; r++) {                                                                    \
            const VEC al = VEC_SET1(alpha[r0 + r]);                                                       \
            for (int v = 0; v < SV; v++) a[r][v] = VEC_MUL(VEC_LOAD(acc + (int64_t)(r0 + r) * D + d0 + v * VLEN), al); \
        }                                                                                                 \
        if (rr == RR) {                                                                                   \
            for (int j = 0; j < nk; j++) {                                                                \
                VEC vv[SV];                                                                               \
                for (int v = 0; v < SV; v++) vv[v] = PF_LOAD_V(vrows[j], d0 + v * VLEN, kvt);              \
                _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {                                    \
                    const VEC p = VEC_SET1(P[(r0 + r) * PF_KEYS + j]);                                    \
                    _Pragma("GCC unroll 8") for (int v = 0; v < SV; v++) a[r][v] = VEC_FMA(p, vv[v], a[r][v]); \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            for (int j = 0; j < nk; j++) {                                                                \
                VEC vv[SV];                                                                               \
                for (int v = 0; v < SV; v++) vv[v] = PF_LOAD_V(vrows[j], d0 + v * VLEN, kvt);              \
                for (int r = 0; r < rr; r++) {                                                            \
                    const VEC p = VEC_SET1(P[(r0 + r) * PF_KEYS + j]);                                    \
                    for (int v = 0; v < SV; v++) a[r][v] = VEC_FMA(p, vv[v], a[r][v]);                    \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < rr; r++)                                                                      \
            for (int v = 0; v < SV; v++) VEC_STORE(acc + (int64_t)(r0 + r) * D + d0 + v * VLEN, a[r][v]);  \
    }                                                                                                     \
}
#if defined(__AVX512F__)
DEFINE_PF_PV(4, 6)
DEFINE_PF_PV(8, 3)
#else
DEFINE_PF_PV(2, 4)
#endif

/* Scores of query rows r0 .. r0 + rr - 1 (rr <= PF_SCORE_ROWS; qr: row r0 of the scaled queries) against
 * the 16 keys at kt's column kb, into P[row][kb .. kb + 15]. RR is rr where the tile is full (a
 * constant: the loops unroll onto registers), else 0 and the loop runs rr rows. */
static inline __attribute__((always_inline)) void pf_scores(const float *qr, const float *kt, int kb, int D,
                                                            float *P, int rr, const int RR) {
    const int n = RR ? RR : rr;
    VEC s[PF_SCORE_ROWS][PF_SUB];
    for (int r = 0; r < PF_SCORE_ROWS; r++)
        for (int v = 0; v < PF_SUB; v++) s[r][v] = VEC_ZERO();
    for (int d = 0; d < D; d++) {
        VEC k[PF_SUB];
        for (int v = 0; v < PF_SUB; v++) k[v] = VEC_LOAD(kt + d * PF_KEYS + kb + v * VLEN);
        _Pragma("GCC unroll 8") for (int r = 0; r < n; r++) {
            const VEC b = VEC_SET1(qr[(int64_t)r * D + d]);
            for (int v = 0; v < PF_SUB; v++) s[r][v] = VEC_FMA(b, k[v], s[r][v]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int v = 0; v < PF_SUB; v++) VEC_STORE(P + r * PF_KEYS + kb + v * VLEN, s[r][v]);
}

/* One work item. The pool (kc, vc) holds fp32, bf16 or fp8 by kvt (a constant: each caller's copy is
 * specialised); K/V are widened to fp32 as they are read, as a bf16 model's fp32 activations attend over
 * its bf16 cache on CPUs without AMX. Offsets are in elements. */
static inline __attribute__((always_inline)) void pf_item(
        const float *q, int64_t q_stride, const void *kc, const void *vc, float *out, int64_t out_stride,
        const int32_t *bt, int ctx, int q0, int qlen, int t0, int t1, int kh, int H, int KVH, int D, int BS,
        int64_t blk_stride, int64_t tok, int64_t head_stride, float scale, float *scratch, const int kvt) {
    const int esize = kvt == KV_BF16 ? (int)sizeof(bf16_t) : kvt == KV_FP8 ? (int)sizeof(fp8_t) : (int)sizeof(float);
    const int G = H / KVH, rows = (t1 - t0) * G;
    float *qs = scratch;                                   /* [rows][D] */
    float *acc = qs + (int64_t)PF_MAX_ROWS * D;            /* [rows][D] */
    float *kt = acc + (int64_t)PF_MAX_ROWS * D;            /* [D][PF_KEYS] */
    float *P = kt + (int64_t)D * PF_KEYS;                  /* [rows][PF_KEYS] */
    float *m = P + PF_MAX_ROWS * PF_KEYS, *l = m + PF_MAX_ROWS, *alpha = l + PF_MAX_ROWS;
    int pos[PF_MAX_ROWS];
    const void *vrows[PF_KEYS];
    for (int i = t0; i < t1; i++)
        for (int g = 0; g < G; g++) {
            const int r = (i - t0) * G + g;
            const float *src = q + (int64_t)(q0 + i) * q_stride + (int64_t)(kh * G + g) * D;
            for (int d = 0; d < D; d++) qs[(int64_t)r * D + d] = src[d] * scale;
            memset(acc + (int64_t)r * D, 0, sizeof(float) * (size_t)D);
            m[r] = -INFINITY; l[r] = 0.f;
            pos[r] = ctx - qlen + i;                       /* sees keys 0 .. pos (rising with r) */
        }
    const int64_t head = (int64_t)kh * head_stride;
    const int jend = ctx - qlen + t1;                      /* keys the tile's last row sees */
    for (int c0 = 0; c0 < jend; c0 += PF_KEYS) {
        const int nk = jend - c0 < PF_KEYS ? jend - c0 : PF_KEYS;
        for (int jj = 0; jj < PF_KEYS; jj++) {             /* K rows -> kt[d][jj] (zero past the end) */
            if (jj < nk) {
                const int j = c0 + jj;
                const int64_t at = ((int64_t)bt[j / BS] * blk_stride + head + (int64_t)(j % BS) * tok) * esize;
                const void *kr = (const char *)kc + at;
                vrows[jj] = (const char *)vc + at;
                if (kvt == KV_BF16)
                    for (int d = 0; d < D; d++) kt[d * PF_KEYS + jj] = bf16_to_f32(((const bf16_t *)kr)[d]);
                else if (kvt == KV_FP8)
                    for (int d = 0; d < D; d++) kt[d * PF_KEYS + jj] = fp8_to_f32(((const fp8_t *)kr)[d]);
                else
                    for (int d = 0; d < D; d++) kt[d * PF_KEYS + jj] = ((const float *)kr)[d];
            } else {
                for (int d = 0; d < D; d++) kt[d * PF_KEYS + jj] = 0.f;
            }
        }
        for (int r0 = 0; r0 < rows; r0 += PF_SCORE_ROWS) {
            const int rr = rows - r0 < PF_SCORE_ROWS ? rows - r0 : PF_SCORE_ROWS;
            /* 16-key groups past the tile's last row's pos are seen by none of its rows: not computed */
            for (int kb = 0; kb < PF_KEYS && c0 + kb <= pos[r0 + rr - 1]; kb += 16) {
                if (rr == PF_SCORE_ROWS)
                    pf_scores(qs + (int64_t)r0 * D, kt, kb, D, P + r0 * PF_KEYS, rr, PF_SCORE_ROWS);
                else
                    pf_scores(qs + (int64_t)r0 * D, kt, kb, D, P + r0 * PF_KEYS, rr, 0);
            }
        }
        int live = 0;                                      /* rows that see any key of this block */
        for (int r = 0; r < rows; r++)
            live |= pf_softmax_row(P + r * PF_KEYS, c0, nk, pos[r], m + r, l + r, alpha + r);
        if (!live) continue;
        PF_PV(D, acc, D, P, alpha, vrows, nk, rows, kvt);
    }
    for (int i = t0; i < t1; i++)
        for (int g = 0; g < G; g++) {
            const int r = (i - t0) * G + g;
            float *dst = out + (int64_t)(q0 + i) * out_stride + (int64_t)(kh * G + g) * D;
            const float inv = (kvt == KV_FP8 ? 1.f / FP8_UNIT : 1.f) / l[r];
            for (int d = 0; d < D; d++) dst[d] = acc[(int64_t)r * D + d] * inv;
        }
}

/* The entry points: prefill_attention_f32 (fp32 pool), prefill_attention_f32_bf16kv (bf16 pool) and
 * prefill_attention_f32_fp8kv (fp8 pool), fp32 queries and output; 0, -2 (no scratch), or -3 for what they
 * do not cover (SDPA then runs). */
#define DEFINE_PREFILL(SUFFIX, TKV, KVT)                                                                \
int prefill_attention_##SUFFIX(const float *q, int64_t q_stride, const TKV *kc, const TKV *vc, float *out,  \
                               int64_t out_stride, const int32_t *block_tables, int max_blocks,            \
                               const int32_t *ctx_lens, const int32_t *cu_q, int B, int H, int KVH, int D, \
                               int BS, int64_t blk_stride, int64_t tok_stride, int64_t head_stride,        \
                               float scale) {                                                              \
    if ((D != 64 && D != 128) || H % KVH || H / KVH > 16) return -3;                                        \
    const int tiles = prefill_tiles(cu_q, B, PF_TOKENS);                                                    \
    const int64_t scratch_len = 2 * (int64_t)PF_MAX_ROWS * D + (int64_t)(D + PF_MAX_ROWS) * PF_KEYS         \
                                + 3 * PF_MAX_ROWS + 16;                                                     \
    int err = 0;                                                                                            \
    _Pragma("omp parallel num_threads(NT)")                                                                 \
    {                                                                                                       \
        float *scratch = (float *)aligned_alloc(64, sizeof(float) * ((scratch_len + 15) / 16 * 16));      \
        if (!scratch) err = -2;                                                                             \
        _Pragma("omp for schedule(dynamic, 1)")                                                             \
        for (int it = tiles * KVH - 1; it >= 0; it--) {   /* a span's last tiles (the most keys) first */   \
            if (!scratch) continue;                                                                         \
            int b, t0, t1;                                                                                  \
            const int kh = it % KVH;                                                                        \
            prefill_tile(cu_q, PF_TOKENS, it / KVH, &b, &t0, &t1);                                          \
            const int qlen = cu_q[b + 1] - cu_q[b];                                                         \
            pf_item(q, q_stride, kc, vc, out, out_stride, block_tables + (int64_t)b * max_blocks,           \
                    ctx_lens[b], cu_q[b], qlen, t0, t1, kh, H, KVH, D, BS, blk_stride, tok_stride,          \
                    head_stride, scale, scratch, KVT);                                                      \
        }                                                                                                   \
        free(scratch);                                                                                      \
    }                                                                                                       \
    return err;                                                                                             \
}

DEFINE_PREFILL(f32, float, KV_F32)
DEFINE_PREFILL(f32_bf16kv, bf16_t, KV_BF16)
DEFINE_PREFILL(f32_fp8kv, fp8_t, KV_FP8)
#endif
