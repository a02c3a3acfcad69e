/* Paged attention of the batched group (decode rows, short verify windows), and the K/V store: the
 * queries of several sequences attend over K/V read in place from the block pool through each
 * sequence's block table (no gather copy).
 *
 * Layout: any [num_blocks, ...] pool where element (block, offset, kv head, d) sits at
 * block * blk_stride + offset * tok_stride + head * head_stride + d: flash-attn's
 * [num_blocks, block_size, kv_heads, D] or the CPU-friendly [num_blocks, kv_heads, block_size, D]
 * (each head's block is one contiguous run). Blocks are scattered, so the hardware prefetcher cannot
 * guess the jumps: the kernel prefetches into L2 (not L1, which the 16 KiB runs in flight would
 * thrash: prefetcht0 measured 19 GB/s, prefetcht1 29 GB/s over the bench model's 8 layers), one
 * row per row computed, so DRAM stays busy in both passes: the K pass fetches the next K block and
 * this block's V, the V pass the next item's K blocks and this item's V two blocks on once more (the
 * K pass's V prefetches come faster than DRAM serves them, and a V pass without the second ones waited
 * on V loads a third of its time).
 * Sequence b owns query rows cu_q[b] .. cu_q[b+1]-1 (the last qlen tokens of its context of
 * ctx_lens[b] tokens, causal): query i sits at position ctx - qlen + i and sees keys 0..pos.
 * Work item = (sequence, a group of its kv heads: all of them where the batch gives every thread enough
 * items, else one): each K/V row is read once and shared by the G = H / KVH query heads of its group and
 * by all query tokens of the sequence. Each thread takes a contiguous, cost-balanced range of items;
 * where the items are fewer than the threads (one sequence, fewer kv heads than threads) each item's
 * context is split into parts instead (flash-decoding), merged by their softmax max and sum.
 * Scores are fp32, the softmax is exact (scores of one item fit a scratch row), the output is written in
 * the queries' dtype.
 *
 * The pool holds fp32, bf16 or fp8 (float8 e4m3fn, common.h: the value itself, no scale): fp8 is half
 * the bytes of bf16, so decode attention, which reads the whole context per token, reads half as much
 * memory, and the pool holds twice the tokens. The kernels take fp32 or bf16 queries over each (suffixes
 * f32, bf16, f32_bf16kv, f32_fp8kv, bf16_fp8kv); K/V rows are widened to fp32 as they are read.
 *
 * Head sizes 64 and 128 run on SIMD vectors (AVX-512 or AVX2 + FMA builds): a query row against VLEN
 * keys at a time, each key's products summed across the lanes of its vector and the VLEN sums gathered
 * into one vector by a transpose-add (sum_lanes), so no key pays a horizontal sum of its own; bf16
 * queries over a bf16 pool multiply pairs of elements in place where AVX-512 BF16 is built (vdpbf16ps:
 * bf16 products are exact in fp32), else both are widened (once per run where several query rows share
 * it: widen_run); an fp8 pool is widened the same way, under fp32 or bf16 queries. The V pass keeps tiles
 * of output rows in registers across a block's keys. On AVX2 over an fp32 pool the scores keep the plain
 * loops (scores_f32: measured faster there). Other head sizes (and builds without those vectors) run
 * plain loops.
 */
#include "common.h"

#define MAX_ROWS 256 /* G * qlen per work item */
#define AI inline __attribute__((always_inline))

/* Row of D elements -> fp32 scratch (bf16: widen; fp32: copy); copy_row_bf16 keeps a bf16 row as it is
 * (the pair dot product's queries; the scratch row is D floats, of which it uses half). */
static inline void load_row_f32(float *restrict dst, const float *restrict src, int D) {
    memcpy(dst, src, sizeof(float) * (size_t)D);
}
static inline void load_row_bf16(float *restrict dst, const bf16_t *restrict src, int D) {
    for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
}
static inline void copy_row_bf16(float *restrict dst, const bf16_t *restrict src, int D) {
    memcpy(dst, src, sizeof(bf16_t) * (size_t)D);
}
/* K/V row as fp32: the pool row itself for fp32, widened into `dst` for bf16 and fp8. */
static inline const float *kv_row_f32(float *restrict dst, const float *restrict src, int D) {
    (void)dst; (void)D;
    return src;
}
static inline const float *kv_row_bf16(float *restrict dst, const bf16_t *restrict src, int D) {
    load_row_bf16(dst, src, D);
    return dst;
}
static inline const float *kv_row_fp8(float *restrict dst, const fp8_t *restrict src, int D) {
    for (int d = 0; d < D; d++) dst[d] = fp8_to_f32(src[d]);
    return dst;
}
static inline void store_row_f32(float *restrict dst, const float *restrict src, int D) {
    memcpy(dst, src, sizeof(float) * (size_t)D);
}
static inline void store_row_bf16(bf16_t *restrict dst, const float *restrict src, int D) {
    for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d]);
}
static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int D) {
    for (int d = 0; d < D; d++) y[d] += a * x[d];
}

/* Prefetch into L2 the row of key o (`bytes` long, o x tokb bytes in) of runs a and b (either may be null):
 * the runs prefetch as they compute key by key, so the misses in flight follow the arithmetic instead of
 * arriving as one burst per run. */
typedef struct { const char *a, *b; int64_t tokb; int bytes; } prefetch_t;
static AI void prefetch_key(prefetch_t pf, int o) {
    for (int off = 0; off < pf.bytes; off += 64) {
        if (pf.a) __builtin_prefetch(pf.a + o * pf.tokb + off, 0, 2);
        if (pf.b) __builtin_prefetch(pf.b + o * pf.tokb + off, 0, 2);
    }
}

/* One run of a block: the n keys (or values) of one kv head at k + o * tok, o < n, against that head's
 * rq query rows (q: rq rows of D, as the item prepared them; s: rq rows of ctx scores, at the run's
 * first key). scores_*: s[r][o] = scale x q_r . k_o. pv_*: acc[r] += s[r][o] x v_o over the run.
 * `row` is BS x D floats of scratch (a row, or a run widened); pf the rows each key prefetches. */
#define DEFINE_PLAIN_RUNS(KS, TKV)                                                                             \
    static AI void scores_plain_##KS(const float *q, int rq, const TKV *k, int64_t tok, int n, const int D,    \
                                     float scale, float *s, int ctx, float *row, prefetch_t pf) {              \
        for (int o = 0; o < n; o++) {                                                                          \
            prefetch_key(pf, o);                                                                               \
            const float *kr = kv_row_##KS(row, k + o * tok, D);                                                \
            for (int r = 0; r < rq; r++) s[(int64_t)r * ctx + o] = scale * dot(q + (int64_t)r * D, kr, D);     \
        }                                                                                                      \
    }                                                                                                          \
    static AI void pv_plain_##KS(float *acc, int rq, const TKV *v, int64_t tok, int n, const int D,            \
                                 const float *s, int ctx, float *row, prefetch_t pf) {                         \
        for (int o = 0; o < n; o++) {                                                                          \
            prefetch_key(pf, o);                                                                               \
            const float *vr = kv_row_##KS(row, v + o * tok, D);                                                \
            for (int r = 0; r < rq; r++) axpy(acc + (int64_t)r * D, s[(int64_t)r * ctx + o], vr, D);           \
        }                                                                                                      \
    }
DEFINE_PLAIN_RUNS(f32, float)
DEFINE_PLAIN_RUNS(bf16, bf16_t)
DEFINE_PLAIN_RUNS(fp8, fp8_t)

#if defined(VEC)
#if defined(__AVX512F__)
#define ACC_VECS 16         /* accumulator vectors a V tile holds in registers (of 32) */
/* Lane i of the result = the sum of v[i]'s lanes: adds of interleaved pairs, then of 64-bit pairs, then
 * of 128-bit blocks (15 adds and 30 shuffles for 16 sums). */
static AI __m512 sum_lanes(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)        /* per 128 bits: a0+a2, b0+b2, a1+a3, b1+b3 (a, b = v[2i], v[2i+1]) */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {      /* per 128 bits: the block's sums of v[4i .. 4i+3] */
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
#define ACC_VECS 8          /* of 16 ymm */
static AI __m256 sum_lanes(const __m256 *v) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d x = _mm256_castps_pd(t[2 * i]), y = _mm256_castps_pd(t[2 * i + 1]);
        u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#endif
#define PV_ROWS 4           /* a V tile's most rows */
#define PV_SV(D) ((D) / VLEN < ACC_VECS ? (D) / VLEN : ACC_VECS)                   /* a V tile's vectors of D */
#define PV_RB(D) (ACC_VECS / PV_SV(D) < PV_ROWS ? ACC_VECS / PV_SV(D) : PV_ROWS)   /* and its rows */

/* The first m (<= VLEN) lanes of x to s. */
static AI void store_scores(float *s, VEC x, int m) {
    if (m == VLEN) {
        VEC_STOREU(s, x);
        return;
    }
    float t[VLEN] __attribute__((aligned(64)));
    VEC_STORE(t, x);
    memcpy(s, t, sizeof(float) * (size_t)m);
}

/* The runs on vectors (D a multiple of VLEN, a constant where the item is specialised). Scores take
 * VLEN keys at a time (past the run's end the last key repeats, its lanes not stored); the V pass
 * takes slices of SV vectors of D and tiles of up to RB rows, their accumulators in registers while the
 * run's values stream past, each value vector loaded (widened) once per tile. The lanes' unit
 * (VEC_UNIT_*) is divided out of the scores' scale and the probabilities (pv_scaled's ps). */
#define DEFINE_VEC_RUNS(KS, TKV)                                                                               \
    static AI void scores_vec_##KS(const float *q, int rq, const TKV *k, int64_t tok, int n, const int D,      \
                                   float scale, float *s, int ctx, float *row, prefetch_t pf) {                \
        (void)row;                                                                                             \
        for (int o0 = 0; o0 < n; o0 += VLEN) {                                                                 \
            const int m = n - o0 < VLEN ? n - o0 : VLEN;                                                       \
            const TKV *kr[VLEN];                                                                               \
            for (int o = 0; o < VLEN; o++) kr[o] = k + (int64_t)(o0 + (o < m ? o : m - 1)) * tok;              \
            for (int r = 0; r < rq; r++) {                                                                     \
                const float *qr = q + (int64_t)r * D;                                                          \
                VEC p[VLEN];                                                                                   \
                _Pragma("GCC unroll 16") for (int o = 0; o < VLEN; o++) {                                      \
                    if (r == 0 && o < m) prefetch_key(pf, o0 + o);                                             \
                    VEC a = VEC_MUL(VEC_LOADU(qr), VEC_GET_##KS(kr[o]));                                          \
                    for (int d = VLEN; d < D; d += VLEN) a = VEC_FMA(VEC_LOADU(qr + d), VEC_GET_##KS(kr[o] + d), a); \
                    p[o] = a;                                                                                  \
                }                                                                                              \
                store_scores(s + (int64_t)r * ctx + o0, VEC_MUL(sum_lanes(p), VEC_SET1(scale / VEC_UNIT_##KS)), m); \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    static AI void pv_tile_##KS(float *acc, const TKV *v, int64_t tok, int n, const int D, int d0,             \
                                const int SV, const int R, const float *s, int ctx, float ps, prefetch_t pf) { \
        VEC a[ACC_VECS];                                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 16") for (int x = 0; x < SV; x++)                                              \
                a[r * SV + x] = VEC_LOADU(acc + (int64_t)r * D + d0 + x * VLEN);                               \
        for (int o = 0; o < n; o++) {                                                                          \
            prefetch_key(pf, o);                                                                               \
            VEC p[PV_ROWS];                                                                                    \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) p[r] = VEC_SET1(s[(int64_t)r * ctx + o] * ps); \
            const TKV *vr = v + o * tok + d0;                                                                  \
            _Pragma("GCC unroll 16") for (int x = 0; x < SV; x++) {                                            \
                const VEC y = VEC_GET_##KS(vr + x * VLEN);                                                        \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                           \
                    a[r * SV + x] = VEC_FMA(p[r], y, a[r * SV + x]);                                           \
            }                                                                                                  \
        }                                                                                                      \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                   \
            _Pragma("GCC unroll 16") for (int x = 0; x < SV; x++)                                              \
                VEC_STOREU(acc + (int64_t)r * D + d0 + x * VLEN, a[r * SV + x]);                               \
    }                                                                                                          \
    static AI void pv_scaled_##KS(float *acc, int rq, const TKV *v, int64_t tok, int n, const int D,           \
                                  const float *s, int ctx, float ps, prefetch_t pf) {                          \
        const int SV = PV_SV(D), RB = PV_RB(D);                                                                \
        for (int d0 = 0; d0 < D; d0 += SV * VLEN)                                                              \
            for (int r0 = 0; r0 < rq; r0 += RB) {                                                              \
                float *ar = acc + (int64_t)r0 * D;                                                             \
                const float *sr = s + (int64_t)r0 * ctx;                                                       \
                const prefetch_t p = d0 || r0 ? (prefetch_t){0, 0, 0, 0} : pf;   /* the first tile's */        \
                switch (rq - r0 < RB ? rq - r0 : RB) {   /* R a constant in each tile, <= RB */                \
                case 1: pv_tile_##KS(ar, v, tok, n, D, d0, SV, 1, sr, ctx, ps, p); break;                    \
                case 2: pv_tile_##KS(ar, v, tok, n, D, d0, SV, 2 < RB ? 2 : RB, sr, ctx, ps, p); break;        \
                case 3: pv_tile_##KS(ar, v, tok, n, D, d0, SV, 3 < RB ? 3 : RB, sr, ctx, ps, p); break;        \
                default: pv_tile_##KS(ar, v, tok, n, D, d0, SV, RB, sr, ctx, ps, p); break;                    \
                }                                                                                              \
            }                                                                                                  \
    }                                                                                                          \
    static AI void pv_vec_##KS(float *acc, int rq, const TKV *v, int64_t tok, int n, const int D,              \
                               const float *s, int ctx, float *row, prefetch_t pf) {                           \
        (void)row;                                                                                             \
        pv_scaled_##KS(acc, rq, v, tok, n, D, s, ctx, 1.f / VEC_UNIT_##KS, pf);                                \
    }
DEFINE_VEC_RUNS(f32, float)
DEFINE_VEC_RUNS(bf16, bf16_t)
DEFINE_VEC_RUNS(fp8, fp8_t)
/* fp32 scores over an fp32 pool: on AVX2 the plain loops (the compiler's ymm dot products) measured faster
 * than scores_vec's (in cache 1.14x against 0.86x the earlier kernel's rate); over a run widened into L1
 * (scores_wide_bf16) scores_vec's were (verify windows 1.28x against 1.13x). The V tile pays off on both. */
#if defined(__AVX512F__)
#define scores_f32 scores_vec_f32
#else
#define scores_f32 scores_plain_f32
#endif

/* fp32 arithmetic over bf16 or fp8 runs with several query rows: the run's rows widened once into `row`
 * (BS x D floats, in the lanes' unit), then the fp32 runs over them, instead of each row (or each V tile)
 * widening them again. */
#define DEFINE_WIDE_RUNS(KS, TKV)                                                                              \
    static AI const float *widen_run_##KS(float *row, const TKV *k, int64_t tok, int n, const int D) {         \
        for (int o = 0; o < n; o++)                                                                            \
            for (int d = 0; d < D; d += VLEN) VEC_STOREU(row + (int64_t)o * D + d, VEC_GET_##KS(k + o * tok + d)); \
        return row;                                                                                            \
    }                                                                                                          \
    static AI void scores_wide_##KS(const float *q, int rq, const TKV *k, int64_t tok, int n, const int D,     \
                                    float scale, float *s, int ctx, float *row, prefetch_t pf) {               \
        if (rq == 1)                                                                                           \
            scores_vec_##KS(q, rq, k, tok, n, D, scale, s, ctx, row, pf);                                      \
        else                                                                                                   \
            scores_vec_f32(q, rq, widen_run_##KS(row, k, tok, n, D), D, n, D, scale / VEC_UNIT_##KS, s, ctx,   \
                           row, pf);                                                                           \
    }                                                                                                          \
    static AI void pv_wide_##KS(float *acc, int rq, const TKV *v, int64_t tok, int n, const int D,             \
                                const float *s, int ctx, float *row, prefetch_t pf) {                          \
        if (rq <= PV_RB(D))         /* one tile of rows: each vector is widened once anyway */                 \
            pv_vec_##KS(acc, rq, v, tok, n, D, s, ctx, row, pf);                                               \
        else                                                                                                   \
            pv_scaled_f32(acc, rq, widen_run_##KS(row, v, tok, n, D), D, n, D, s, ctx, 1.f / VEC_UNIT_##KS, pf); \
    }
DEFINE_WIDE_RUNS(bf16, bf16_t)
DEFINE_WIDE_RUNS(fp8, fp8_t)
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Scores of bf16 query rows (kept as bf16 by copy_row_bf16) against bf16 keys, pairs of elements per
 * lane (vdpbf16ps); D a multiple of 32. */
static AI void scores_dot_bf16(const float *q, int rq, const bf16_t *k, int64_t tok, int n, const int D,
                               float scale, float *s, int ctx, float *row, prefetch_t pf) {
    (void)row;
    for (int o0 = 0; o0 < n; o0 += 16) {
        const int m = n - o0 < 16 ? n - o0 : 16;
        const bf16_t *kr[16];
        for (int o = 0; o < 16; o++) kr[o] = k + (int64_t)(o0 + (o < m ? o : m - 1)) * tok;
        for (int r = 0; r < rq; r++) {
            const bf16_t *qr = (const bf16_t *)(q + (int64_t)r * D);
            __m512 p[16];
            _Pragma("GCC unroll 16") for (int o = 0; o < 16; o++) {
                if (r == 0 && o < m) prefetch_key(pf, o0 + o);
                __m512 a = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 32)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qr + d),
                                         (__m512bh)_mm512_loadu_si512(kr[o] + d));
                p[o] = a;
            }
            store_scores(s + (int64_t)r * ctx + o0, _mm512_mul_ps(sum_lanes(p), _mm512_set1_ps(scale)), m);
        }
    }
}
#endif

/* Where item row r (query token i, head (kh0 + c) * G + g, r = c * rq + i * G + g) writes its output. */
static inline int64_t out_offset(int r, int rq, int G, int q0, int kh0, int64_t out_stride, int D) {
    const int c = r / rq, i = r % rq / G, g = r % G;
    return (int64_t)(q0 + i) * out_stride + (int64_t)((kh0 + c) * G + g) * D;
}

/* One work item: sequence b's query rows against kv heads kh0 .. kh0 + hg - 1, over its key blocks
 * [b0, b1) (all of them, or one part of a split context; then `part` takes the rows' unnormalised
 * P V sums [rows, D], their max [rows] and sum [rows] instead of the output). TQ / TKV are the element
 * types, QLOAD prepares a query row in scratch, SCORES / PV are the runs, QSTORE writes an output row;
 * D is a compile-time constant when the caller passes a literal (always_inline specialises the loops).
 * Rows r = c * G * qlen + i * G + g: query token i, head (kh0 + c) * G + g. Within a block the heads
 * are read in order, so with the heads-first pool one block of the item is one contiguous run of
 * hg * BS * D elements (random 4 KiB runs read at ~22 GB/s here, 16 KiB runs at ~30). */
#define DEFINE_ITEM(NAME, TQ, TKV, QLOAD, SCORES, PV, QSTORE)                                                  \
    static inline __attribute__((always_inline)) void item_##NAME(                                             \
        const TQ *q, int64_t q_stride, const TKV *kc, const TKV *vc, TQ *out, int64_t out_stride,              \
        const int32_t *bt, int ctx, int q0, int qlen, int kh0, int hg, int H, int KVH, const int D,            \
        int BS, int64_t blk_stride, int64_t tok, int64_t head_stride, float scale, float *scratch,             \
        int b0, int b1, float *part, const int32_t *next_bt, int next_nb, int64_t next_head) {                 \
        const int G = H / KVH, rq = G * qlen, rows = hg * rq;                                                  \
        const int64_t tokb = tok * (int64_t)sizeof(TKV), headb = head_stride * (int64_t)sizeof(TKV);           \
        float *qf = scratch;                          /* [rows, D] */                                          \
        float *acc = qf + (int64_t)rows * D;          /* [rows, D] */                                          \
        float *row = acc + (int64_t)rows * D;         /* [BS, D]: a run widened */                             \
        float *s = row + (int64_t)BS * D;             /* [rows, ctx] */                                        \
        int lim[MAX_ROWS];                                                                                     \
        for (int c = 0; c < hg; c++)                                                                           \
            for (int i = 0; i < qlen; i++)                                                                     \
                for (int g = 0; g < G; g++) {                                                                  \
                    const int r = c * rq + i * G + g;                                                          \
                    QLOAD(qf + (int64_t)r * D,                                                                 \
                          q + (int64_t)(q0 + i) * q_stride + (int64_t)((kh0 + c) * G + g) * D, D);             \
                    lim[r] = ctx - qlen + i + 1; /* keys [0, lim) are visible */                               \
                }                                                                                              \
        const int64_t head = (int64_t)kh0 * head_stride;                                                       \
        const int j0 = b0 * BS, jend = ctx < b1 * BS ? ctx : b1 * BS;   /* keys [j0, jend): blocks [b0, b1) */ \
        /* K pass: scores; prefetches the next block's K and this block's V. */                                \
        for (int b = b0, j = j0; b < b1; b++) {                                                                \
            const TKV *kb = kc + (int64_t)bt[b] * blk_stride + head;                                           \
            const char *nx = b + 1 < b1 ? (const char *)(kc + (int64_t)bt[b + 1] * blk_stride + head) : 0;     \
            const char *vx = (const char *)(vc + (int64_t)bt[b] * blk_stride + head);                          \
            const int n = ctx - j < BS ? ctx - j : BS;                                                         \
            for (int c = 0; c < hg; c++) {                                                                     \
                const prefetch_t pf = {nx ? nx + c * headb : 0, vx + c * headb, tokb, D * (int)sizeof(TKV)};   \
                SCORES(qf + (int64_t)c * rq * D, rq, kb + c * head_stride, tok, n, D, scale,                   \
                       s + (int64_t)c * rq * ctx + j, ctx, row, pf);                                           \
            }                                                                                                  \
            j += n;                                                                                            \
        }                                                                                                      \
        for (int r = 0; r < rows; r++) {     /* a part: P unnormalised, the row's max and sum to `part` */     \
            float *sr = s + (int64_t)r * ctx;                                                                  \
            const int L = lim[r] < j0 ? j0 : lim[r] < jend ? lim[r] : jend;                                    \
            const float m = row_max(sr + j0, L - j0);                                                          \
            float sum = 0.f;                                                                                   \
            for (int j = j0; j < L; j++) {                                                                     \
                sr[j] = exp_nonpos(sr[j] - m);                                                                 \
                sum += sr[j];                                                                                  \
            }                                                                                                  \
            if (part) {                                                                                        \
                part[(int64_t)rows * D + r] = m;                                                               \
                part[(int64_t)rows * (D + 1) + r] = sum;                                                       \
            } else {                                                                                           \
                const float inv = 1.f / sum;                                                                   \
                for (int j = j0; j < L; j++) sr[j] *= inv;                                                     \
            }                                                                                                  \
            for (int j = L; j < jend; j++) sr[j] = 0.f;                                                        \
            memset(acc + (int64_t)r * D, 0, sizeof(float) * (size_t)D);                                        \
        }                                                                                                      \
        /* V pass (in L2 from the K pass's prefetches); prefetches the next item's K blocks and V two on. */   \
        for (int b = b0, j = j0; b < b1; b++) {                                                                \
            const TKV *vb = vc + (int64_t)bt[b] * blk_stride + head;                                           \
            const int n = ctx - j < BS ? ctx - j : BS;                                                         \
            const char *nk = b < next_nb ? (const char *)(kc + (int64_t)next_bt[b] * blk_stride + next_head) : 0; \
            const char *v2 = b + 2 < b1 ? (const char *)(vc + (int64_t)bt[b + 2] * blk_stride + head) : 0;    \
            for (int c = 0; c < hg; c++) {                                                                     \
                const prefetch_t pf = {nk ? nk + c * headb : 0, v2 ? v2 + c * headb : 0, tokb, D * (int)sizeof(TKV)}; \
                PV(acc + (int64_t)c * rq * D, rq, vb + c * head_stride, tok, n, D,                             \
                   s + (int64_t)c * rq * ctx + j, ctx, row, pf);                                               \
            }                                                                                                  \
            j += n;                                                                                            \
        }                                                                                                      \
        if (part) {                                                                                            \
            memcpy(part, acc, sizeof(float) * (size_t)rows * (size_t)D);                                       \
            return;                                                                                            \
        }                                                                                                      \
        for (int r = 0; r < rows; r++)                                                                         \
            QSTORE(out + out_offset(r, rq, G, q0, kh0, out_stride, D), acc + (int64_t)r * D, D);               \
    }

/* Every head size on plain loops; 64 and 128 on vectors where the build has them (item_fast_*). */
DEFINE_ITEM(plain_f32, float, float, load_row_f32, scores_plain_f32, pv_plain_f32, store_row_f32)
DEFINE_ITEM(plain_bf16, bf16_t, bf16_t, load_row_bf16, scores_plain_bf16, pv_plain_bf16, store_row_bf16)
DEFINE_ITEM(plain_f32_bf16kv, float, bf16_t, load_row_f32, scores_plain_bf16, pv_plain_bf16, store_row_f32)
DEFINE_ITEM(plain_f32_fp8kv, float, fp8_t, load_row_f32, scores_plain_fp8, pv_plain_fp8, store_row_f32)
DEFINE_ITEM(plain_bf16_fp8kv, bf16_t, fp8_t, load_row_bf16, scores_plain_fp8, pv_plain_fp8, store_row_bf16)
#if defined(VEC)
DEFINE_ITEM(fast_f32, float, float, load_row_f32, scores_f32, pv_vec_f32, store_row_f32)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
DEFINE_ITEM(fast_bf16, bf16_t, bf16_t, copy_row_bf16, scores_dot_bf16, pv_vec_bf16, store_row_bf16)
#else
DEFINE_ITEM(fast_bf16, bf16_t, bf16_t, load_row_bf16, scores_wide_bf16, pv_wide_bf16, store_row_bf16)
#endif
DEFINE_ITEM(fast_f32_bf16kv, float, bf16_t, load_row_f32, scores_wide_bf16, pv_wide_bf16, store_row_f32)
DEFINE_ITEM(fast_f32_fp8kv, float, fp8_t, load_row_f32, scores_wide_fp8, pv_wide_fp8, store_row_f32)
DEFINE_ITEM(fast_bf16_fp8kv, bf16_t, fp8_t, load_row_bf16, scores_wide_fp8, pv_wide_fp8, store_row_bf16)
#else
#define item_fast_f32 item_plain_f32
#define item_fast_bf16 item_plain_bf16
#define item_fast_f32_bf16kv item_plain_f32_bf16kv
#define item_fast_f32_fp8kv item_plain_f32_fp8kv
#define item_fast_bf16_fp8kv item_plain_bf16_fp8kv
#endif

/* KV heads per work item: the most (longer runs of the pool per block) whose query rows fit MAX_ROWS while
 * the batch still gives each of the nt threads ITEMS_PER_THREAD items, else one. Few, wide items leave a
 * thread idle (one sequence: one item, one thread) and balance coarsely: one head per item read
 * 1.6-2.2x faster at 1 sequence, 1.2-1.6x at 4, 1.0-1.2x at 16 (hack/decode_attention.py), while at 64
 * sequences of 8 kv heads the widest items stayed 2-4% ahead. */
#define ITEMS_PER_THREAD 32
static int heads_per_item(int H, int KVH, int max_q, int B, int nt) {
    const int G = H / KVH;
    for (int hg = KVH; hg > 1; hg--)
        if (KVH % hg == 0 && hg * G * max_q <= MAX_ROWS
            && (int64_t)B * (KVH / hg) >= (int64_t)ITEMS_PER_THREAD * nt)
            return hg;
    return 1;
}

/* This thread's items [lo, hi) of B * groups (sequence-major): contiguous, so an item can prefetch the
 * next one's K blocks, and cut where the running cost (context x query rows + a fixed part per
 * item) crosses t / nt of the total, so threads finish together however the contexts differ. */
static inline int64_t item_cost(const int32_t *ctx_lens, const int32_t *cu_q, int b) {
    return (int64_t)ctx_lens[b] * (cu_q[b + 1] - cu_q[b]) + 64;
}

static void attention_share(const int32_t *ctx_lens, const int32_t *cu_q, int B, int groups, int t, int nt,
                            int *lo, int *hi) {
    int64_t total = 0, run = 0;
    for (int b = 0; b < B; b++) total += groups * item_cost(ctx_lens, cu_q, b);
    *lo = *hi = B * groups;
    int first = 1;
    for (int it = 0; it < B * groups; it++) {
        if (first && run * nt >= total * t) { *lo = it; first = 0; }
        if (run * nt >= total * (t + 1)) { *hi = it; return; }
        run += item_cost(ctx_lens, cu_q, it / groups);
    }
}

/* Parts each item's context is split into (flash-decoding) where the items are fewer than the threads
 * (one sequence of a model with fewer kv heads than threads): enough for every thread, each at least
 * MIN_PART_BLOCKS blocks of the longest context (a part's merge and its prefetch ramp cost a few blocks). */
#define MIN_PART_BLOCKS 16
static int context_parts(int items, int nt, int max_ctx, int BS) {
    if (items >= nt) return 1;
    const int want = (nt + items - 1) / items, most = (max_ctx + BS - 1) / BS / MIN_PART_BLOCKS;
    return want < most ? want : most > 1 ? most : 1;
}

/* Row r of an item from its parts' (P V sums, max, sum): sum_p e^(m_p - m) acc_p / sum_p e^(m_p - m) l_p,
 * m the parts' max (a part the row sees no key of has m_p = -inf, l_p = 0: weight 0). */
static void merge_row(const float *parts, int nparts, int64_t part_len, int rows, int D, int r, float *o) {
    float m = -INFINITY;
    for (int p = 0; p < nparts; p++) {
        const float mp = parts[p * part_len + (int64_t)rows * D + r];
        m = mp > m ? mp : m;
    }
    float l = 0.f;
    for (int d = 0; d < D; d++) o[d] = 0.f;
    for (int p = 0; p < nparts; p++) {
        const float *pp = parts + p * part_len;
        const float mp = pp[(int64_t)rows * D + r];
        if (mp == -INFINITY) continue;
        const float w = exp_nonpos(mp - m);
        l += w * pp[(int64_t)rows * (D + 1) + r];
        for (int d = 0; d < D; d++) o[d] += w * pp[(int64_t)r * D + d];
    }
    const float inv = 1.f / l;
    for (int d = 0; d < D; d++) o[d] *= inv;
}

#define DEFINE_KERNEL(SUFFIX, TQ, TKV, QSTORE)                                                          \
    int paged_attention_##SUFFIX(const TQ *q, int64_t q_stride, const TKV *kc, const TKV *vc,   \
                                 TQ *out,                                                         \
                                 int64_t out_stride, const int32_t *block_tables, int max_blocks, \
                                 const int32_t *ctx_lens, const int32_t *cu_q, int B, int H,      \
                                 int KVH, int D, int BS, int64_t blk_stride, int64_t tok_stride,  \
                                 int64_t head_stride, float scale) {                              \
        int max_ctx = 0, max_q = 0;                                                               \
        for (int b = 0; b < B; b++) {                                                             \
            if (ctx_lens[b] > max_ctx) max_ctx = ctx_lens[b];                                     \
            if (cu_q[b + 1] - cu_q[b] > max_q) max_q = cu_q[b + 1] - cu_q[b];                     \
        }                                                                                         \
        const int nt = NT, G = H / KVH, hg = heads_per_item(H, KVH, max_q, B, nt), groups = KVH / hg; \
        if (G * max_q > MAX_ROWS) return -1;                                                      \
        const int64_t scratch_len = (int64_t)hg * G * max_q * (2 * D + max_ctx) + (int64_t)BS * D + 16;         \
        const int items = B * groups, parts = context_parts(items, nt, max_ctx, BS);              \
        const int64_t part_len = (int64_t)hg * G * max_q * (D + 2);                               \
        float *partials = parts > 1 ? (float *)malloc(sizeof(float) * (size_t)(items * parts * part_len)) : 0; \
        if (parts > 1 && !partials) return -2;                                                    \
        int err = 0;                                                                              \
        _Pragma("omp parallel num_threads(nt)")                                                   \
        {                                                                                         \
            float *scratch = (float *)aligned_alloc(64, sizeof(float) * ((scratch_len + 15) / 16 * 16)); \
            if (!scratch) err = -2;                                                               \
            /* units: the items, or with a split context (item, part) pairs, an even range each */ \
            const int t = omp_get_thread_num(), team = omp_get_num_threads(), units = items * parts; \
            int lo = (int)((int64_t)units * t / team), hi = (int)((int64_t)units * (t + 1) / team); \
            if (parts == 1) attention_share(ctx_lens, cu_q, B, groups, t, team, &lo, &hi);       \
            for (int u = lo; u < hi; u++) {                                                       \
                const int it = u / parts, p = u % parts;                                          \
                const int b = it / groups, kh0 = it % groups * hg, qlen = cu_q[b + 1] - cu_q[b];  \
                if (!scratch || qlen <= 0) continue;                                              \
                const int32_t *bt = block_tables + (int64_t)b * max_blocks;                       \
                const int nb = (ctx_lens[b] + BS - 1) / BS;                                       \
                /* the next item's K blocks, prefetched during this item's V pass (whole items) */  \
                const int nxt = parts == 1 && it + 1 < hi ? it + 1 : -1;                          \
                const int32_t *next_bt = nxt < 0 ? 0 : block_tables + (int64_t)(nxt / groups) * max_blocks; \
                const int next_nb = nxt < 0 ? 0 : (ctx_lens[nxt / groups] + BS - 1) / BS;        \
                const int64_t next_head = nxt < 0 ? 0 : (int64_t)(nxt % groups * hg) * head_stride; \
                const int b0 = (int)((int64_t)nb * p / parts), b1 = (int)((int64_t)nb * (p + 1) / parts); \
                float *part = parts == 1 ? 0 : partials + (int64_t)u * part_len;                  \
                /* one call site for whole items and parts: each inlines the items (D specialised) */ \
                if (D == 64)                                                                      \
                    item_fast_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], qlen, kh0, hg, \
                                       H, KVH, 64, BS, blk_stride, tok_stride, head_stride, scale, scratch, \
                                       b0, b1, part, next_bt, next_nb, next_head);                \
                else if (D == 128)                                                                \
                    item_fast_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], qlen, kh0, hg, \
                                       H, KVH, 128, BS, blk_stride, tok_stride, head_stride, scale, scratch, \
                                       b0, b1, part, next_bt, next_nb, next_head);                \
                else                                                                              \
                    item_plain_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], qlen, kh0, hg, \
                                        H, KVH, D, BS, blk_stride, tok_stride, head_stride, scale, scratch, \
                                        b0, b1, part, next_bt, next_nb, next_head);               \
            }                                                                                     \
            if (parts > 1) {                    /* every thread takes this branch: parts is shared */ \
                _Pragma("omp barrier")                                                            \
                _Pragma("omp for schedule(static)")                                               \
                for (int it = 0; it < items; it++) {                                              \
                    const int b = it / groups, kh0 = it % groups * hg, qlen = cu_q[b + 1] - cu_q[b]; \
                    const int rq = G * qlen, rows = hg * rq;                                      \
                    if (!scratch || qlen <= 0) continue;                                          \
                    for (int r = 0; r < rows; r++) {                                              \
                        merge_row(partials + (int64_t)it * parts * part_len, parts, part_len, rows, D, r, scratch); \
                        QSTORE(out + out_offset(r, rq, G, cu_q[b], kh0, out_stride, D), scratch, D); \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            free(scratch);                                                                        \
        }                                                                                         \
        free(partials);                                                                           \
        return err;                                                                               \
    }

DEFINE_KERNEL(f32, float, float, store_row_f32)
DEFINE_KERNEL(bf16, bf16_t, bf16_t, store_row_bf16)
DEFINE_KERNEL(f32_bf16kv, float, bf16_t, store_row_f32)
DEFINE_KERNEL(f32_fp8kv, float, fp8_t, store_row_f32)
DEFINE_KERNEL(bf16_fp8kv, bf16_t, fp8_t, store_row_bf16)

/* Write the new tokens' K/V rows into their pool slots (slot = block * BS + offset; < 0 skips).
 * k, v: [n, KVH, D] with any token stride (views into the fused qkv projection). Into an fp8 pool each
 * value is rounded to nearest even and saturated at +-448 (f32_to_fp8; bf16 widened first, exactly). */
#define DEFINE_STORE(SUFFIX, TS, TC, CONV)                                                                   \
    void store_kv_##SUFFIX(const TS *k, int64_t k_stride, const TS *v, int64_t v_stride, TC *kc,  \
                           TC *vc, const int64_t *slots, int n, int KVH, int D, int BS,            \
                           int64_t blk_stride, int64_t tok_stride, int64_t head_stride) {         \
        _Pragma("omp parallel for if (n >= 256) num_threads(NT)")                                                 \
        for (int t = 0; t < n; t++) {                                                             \
            const int64_t s = slots[t];                                                           \
            if (s < 0) continue;                                                                  \
            const int64_t base = (s / BS) * blk_stride + (s % BS) * tok_stride;                  \
            for (int h = 0; h < KVH; h++) {                                                       \
                TC *kd = kc + base + h * head_stride, *vd = vc + base + h * head_stride;          \
                const TS *ks = k + t * k_stride + (int64_t)h * D, *vs = v + t * v_stride + (int64_t)h * D; \
                for (int d = 0; d < D; d++) {                                                     \
                    kd[d] = CONV(ks[d]);                                                          \
                    vd[d] = CONV(vs[d]);                                                          \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

#define SAME(x) (x)
DEFINE_STORE(f32, float, float, SAME)
DEFINE_STORE(bf16, bf16_t, bf16_t, SAME)
DEFINE_STORE(f32_bf16kv, float, bf16_t, f32_to_bf16)
static inline fp8_t bf16_to_fp8(bf16_t x) { return f32_to_fp8(bf16_to_f32(x)); }
DEFINE_STORE(f32_fp8kv, float, fp8_t, f32_to_fp8)
DEFINE_STORE(bf16_fp8kv, bf16_t, fp8_t, bf16_to_fp8)
