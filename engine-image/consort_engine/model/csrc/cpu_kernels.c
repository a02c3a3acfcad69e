/* CPU kernels of the Consort engine: paged attention, K/V store and the fused element-wise layers.
 *
 * Paged attention: queries of several sequences attend over K/V read in place
 * from the block pool through each sequence's block table (no gather copy).
 *
 * Layout: any [num_blocks, ...] pool where element (block, offset, kv head, d) sits at
 * block * blk_stride + offset * tok_stride + head * head_stride + d: flash-attn's
 * [num_blocks, block_size, kv_heads, D] or the CPU-friendly [num_blocks, kv_heads, block_size, D]
 * (each head's block is one contiguous run). Blocks are scattered, so the hardware prefetcher cannot
 * guess the jumps: the kernel prefetches into L2 (not L1, which the 16 KiB runs in flight would
 * thrash: prefetcht0 measured 19 GB/s, prefetcht1 29 GB/s over the bench model's 8 layers), one
 * row per row computed, so DRAM stays busy in both passes: the K pass fetches the next K block and
 * this block's V, the V pass the next item's K blocks.
 * Sequence b owns query rows cu_q[b] .. cu_q[b+1]-1 (the last qlen tokens of its context of
 * ctx_lens[b] tokens, causal): query i sits at position ctx - qlen + i and sees keys 0..pos.
 * Work item = (sequence, its kv heads, or a group of them where the rows would not fit): each K/V row
 * is read once and shared by the G = H / KVH query heads of its group and by all query tokens of the
 * sequence. Each thread takes a contiguous, cost-balanced range of items. Scores are fp32, the softmax is
 * exact (scores of one item fit a scratch row), the output is written in the cache dtype.
 *
 * Built at run time with the system C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes; OpenMP resolves to the libgomp torch already loaded, so the thread pool is shared.
 *
 * Team size: every parallel region runs kernel_threads threads (set_num_threads, from the engine's
 * thread plan), not OpenMP's per-thread default. The engine calls the kernels from its loop thread,
 * whose default is libgomp's start-up value (every core of the node), not what torch.set_num_threads
 * set in the main thread: engines sharing cores would each run a full team and oversubscribe them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* One SIMD vector of fp32 lanes for the kernels written with intrinsics (the prefill attention, the
 * GEMM): a zmm with AVX-512, a ymm with AVX2 + FMA. Without either those kernels are not built. */
#if defined(__AVX512F__)
#define VEC __m512
#define VLEN 16
#define VEC_ZERO _mm512_setzero_ps
#define VEC_LOAD _mm512_load_ps
#define VEC_LOADU _mm512_loadu_ps
#define VEC_SET1 _mm512_set1_ps
#define VEC_FMA _mm512_fmadd_ps
#define VEC_MUL _mm512_mul_ps
#define VEC_STORE _mm512_store_ps
#define VEC_STOREU _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC __m256
#define VLEN 8
#define VEC_ZERO _mm256_setzero_ps
#define VEC_LOAD _mm256_load_ps
#define VEC_LOADU _mm256_loadu_ps
#define VEC_SET1 _mm256_set1_ps
#define VEC_FMA _mm256_fmadd_ps
#define VEC_MUL _mm256_mul_ps
#define VEC_STORE _mm256_store_ps
#define VEC_STOREU _mm256_storeu_ps
#endif

#define MAX_ROWS 256 /* G * qlen per work item */

typedef uint16_t bf16_t;

static int kernel_threads = 0;   /* 0: OpenMP's default */
#define NT (kernel_threads > 0 ? kernel_threads : omp_get_max_threads())

void set_num_threads(int n) { kernel_threads = n; }

/* The team size a parallel region of these kernels gets (tests check the plan reaches every thread). */
int team_size(void) {
    int n = 0;
    _Pragma("omp parallel num_threads(NT)")
    _Pragma("omp single")
    n = omp_get_num_threads();
    return n;
}

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (bf16_t)(u >> 16);
}

/* Row of D elements of the pool -> fp32 (bf16: widen; fp32: copy). */
static inline void load_row_f32(float *restrict dst, const float *restrict src, int D) {
    memcpy(dst, src, sizeof(float) * (size_t)D);
}
static inline void load_row_bf16(float *restrict dst, const bf16_t *restrict src, int D) {
    for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
}
/* K/V row as fp32: the pool row itself for fp32, widened into `dst` for bf16. */
static inline const float *kv_row_f32(float *restrict dst, const float *restrict src, int D) {
    (void)dst; (void)D;
    return src;
}
static inline const float *kv_row_bf16(float *restrict dst, const bf16_t *restrict src, int D) {
    load_row_bf16(dst, src, D);
    return dst;
}
static inline void store_row_f32(float *restrict dst, const float *restrict src, int D) {
    memcpy(dst, src, sizeof(float) * (size_t)D);
}
static inline void store_row_bf16(bf16_t *restrict dst, const float *restrict src, int D) {
    for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d]);
}

/* exp(x) as 2^k * p(f), |f| <= 1/2, degree-7 Taylor of 2^f: relative error < 1e-8,
 * written so the compiler vectorises it (libm's expf is a scalar call without -ffast-math). */
static inline float exp_nonpos_core(float x) { /* x in [-87, 88] */
    const float t = x * 1.44269504088896341f;
    const float k = __builtin_rintf(t);
    const float f = (t - k) * 0.693147180559945309f; /* 2^(t-k) = e^f */
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float exp_nonpos(float x) { return exp_nonpos_core(x < -87.0f ? -87.0f : x); }

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int D) {
    for (int d = 0; d < D; d++) y[d] += a * x[d];
}

/* One work item: sequence b's query rows against kv heads kh0 .. kh0 + hg - 1. T is the element type,
 * D is a compile-time constant when the caller passes a literal (always_inline specialises the loops).
 * Rows r = c * G * qlen + i * G + g: query token i, head (kh0 + c) * G + g. Within a block the heads
 * are read in order, so with the heads-first pool one block of the item is one contiguous run of
 * hg * BS * D elements (random 4 KiB runs read at ~22 GB/s here, 16 KiB runs at ~30). */
#define DEFINE_ITEM(NAME, QS, TQ, KS, TKV)                                                                    \
    static inline __attribute__((always_inline)) void item_##NAME(                              \
        const TQ *q, int64_t q_stride, const TKV *kc, const TKV *vc, TQ *out, int64_t out_stride,  \
        const int32_t *bt, int ctx, int q0, int qlen, int kh0, int hg, int H, int KVH, const int D, \
        int BS, int64_t blk_stride, int64_t tok, int64_t head_stride, float scale, float *scratch, \
        const int32_t *next_bt, int next_nb, int64_t next_head) {                                 \
        const int G = H / KVH, rq = G * qlen, rows = hg * rq;                                     \
        const int64_t tokb = tok * (int64_t)sizeof(TKV), headb = head_stride * (int64_t)sizeof(TKV); \
        float *qf = scratch;                          /* [rows, D] */                             \
        float *acc = qf + (int64_t)rows * D;          /* [rows, D] */                             \
        float *row = acc + (int64_t)rows * D;         /* [D] */                                   \
        float *s = row + D;                           /* [rows, ctx] */                           \
        int lim[MAX_ROWS];                                                                        \
        for (int c = 0; c < hg; c++)                                                              \
            for (int i = 0; i < qlen; i++)                                                        \
                for (int g = 0; g < G; g++) {                                                     \
                    const int r = c * rq + i * G + g;                                             \
                    load_row_##QS(qf + (int64_t)r * D,                                            \
                                  q + (int64_t)(q0 + i) * q_stride + (int64_t)((kh0 + c) * G + g) * D, D); \
                    for (int d = 0; d < D; d++) qf[(int64_t)r * D + d] *= scale;                  \
                    lim[r] = ctx - qlen + i + 1; /* keys [0, lim) are visible */                  \
                }                                                                                 \
        const int64_t head = (int64_t)kh0 * head_stride;                                          \
        const int nblocks = (ctx + BS - 1) / BS;                                                  \
        /* K pass: scores; prefetches the next block's K and this block's V. */                   \
        for (int b = 0, j = 0; b < nblocks; b++) {                                                \
            const TKV *kb = kc + (int64_t)bt[b] * blk_stride + head;                              \
            const char *nx = b + 1 < nblocks ? (const char *)(kc + (int64_t)bt[b + 1] * blk_stride + head) : 0; \
            const char *vx = (const char *)(vc + (int64_t)bt[b] * blk_stride + head);              \
            const int n = ctx - j < BS ? ctx - j : BS;                                            \
            for (int c = 0; c < hg; c++)                                                          \
                for (int o = 0; o < n; o++) {                                                     \
                    for (int off = 0; off < D * (int)sizeof(TKV); off += 64) {                    \
                        if (nx) __builtin_prefetch(nx + c * headb + o * tokb + off, 0, 2);        \
                        __builtin_prefetch(vx + c * headb + o * tokb + off, 0, 2);                \
                    }                                                                             \
                    const float *kr = kv_row_##KS(row, kb + c * head_stride + o * tok, D);        \
                    float *sc = s + (int64_t)c * rq * ctx + j + o;                                \
                    const float *qc = qf + (int64_t)c * rq * D;                                   \
                    for (int r = 0; r < rq; r++) sc[(int64_t)r * ctx] = dot(qc + (int64_t)r * D, kr, D); \
                }                                                                                 \
            j += n;                                                                               \
        }                                                                                         \
        for (int r = 0; r < rows; r++) {                                                          \
            float *sr = s + (int64_t)r * ctx;                                                     \
            const int L = lim[r];                                                                 \
            float m = -INFINITY, sum = 0.f;                                                       \
            for (int j = 0; j < L; j++) m = sr[j] > m ? sr[j] : m;                                \
            for (int j = 0; j < L; j++) {                                                         \
                sr[j] = exp_nonpos(sr[j] - m);                                                    \
                sum += sr[j];                                                                     \
            }                                                                                     \
            const float inv = 1.f / sum;                                                          \
            for (int j = 0; j < L; j++) sr[j] *= inv;                                             \
            for (int j = L; j < ctx; j++) sr[j] = 0.f;                                            \
            memset(acc + (int64_t)r * D, 0, sizeof(float) * (size_t)D);                           \
        }                                                                                         \
        /* V pass (in L2 from the K pass's prefetches); prefetches the next item's K blocks. */     \
        for (int b = 0, j = 0; b < nblocks; b++) {                                                \
            const TKV *vb = vc + (int64_t)bt[b] * blk_stride + head;                              \
            const int n = ctx - j < BS ? ctx - j : BS;                                            \
            for (int c = 0; c < hg; c++)                                                          \
                for (int o = 0; o < n; o++) {                                                     \
                    if (b < next_nb) for (int off = 0; off < D * (int)sizeof(TKV); off += 64)     \
                        __builtin_prefetch((const char *)(kc + (int64_t)next_bt[b] * blk_stride + next_head) \
                                           + c * headb + o * tokb + off, 0, 2);                   \
                    const float *vr = kv_row_##KS(row, vb + c * head_stride + o * tok, D);        \
                    const float *sc = s + (int64_t)c * rq * ctx + j + o;                          \
                    float *ac = acc + (int64_t)c * rq * D;                                        \
                    for (int r = 0; r < rq; r++) axpy(ac + (int64_t)r * D, sc[(int64_t)r * ctx], vr, D); \
                }                                                                                 \
            j += n;                                                                               \
        }                                                                                         \
        for (int c = 0; c < hg; c++)                                                              \
            for (int i = 0; i < qlen; i++)                                                        \
                for (int g = 0; g < G; g++) {                                                     \
                    const int r = c * rq + i * G + g;                                             \
                    store_row_##QS(out + (int64_t)(q0 + i) * out_stride + (int64_t)((kh0 + c) * G + g) * D, \
                                   acc + (int64_t)r * D, D);                                      \
                }                                                                                 \
    }

DEFINE_ITEM(f32, f32, float, f32, float)
DEFINE_ITEM(bf16, bf16, bf16_t, bf16, bf16_t)
DEFINE_ITEM(f32_bf16kv, f32, float, bf16, bf16_t)

/* KV heads per work item: all of them where the item's query rows fit MAX_ROWS (the longest runs of
 * the pool per block), else the largest divisor of KVH that fits. */
static int heads_per_item(int H, int KVH, int max_q) {
    const int G = H / KVH;
    for (int hg = KVH; hg > 1; hg--)
        if (KVH % hg == 0 && hg * G * max_q <= MAX_ROWS) return hg;
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

#define DEFINE_KERNEL(SUFFIX, TQ, TKV)                                                                  \
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
        const int G = H / KVH, hg = heads_per_item(H, KVH, max_q), groups = KVH / hg;             \
        if (G * max_q > MAX_ROWS) return -1;                                                      \
        const int64_t scratch_len = (int64_t)hg * G * max_q * (2 * D + max_ctx) + D + 16;         \
        int err = 0;                                                                              \
        _Pragma("omp parallel num_threads(NT)")                                                   \
        {                                                                                         \
            float *scratch = (float *)aligned_alloc(64, sizeof(float) * ((scratch_len + 15) / 16 * 16)); \
            if (!scratch) err = -2;                                                               \
            int lo, hi;                                                                           \
            attention_share(ctx_lens, cu_q, B, groups, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi); \
            for (int it = lo; it < hi; it++) {                                                    \
                const int b = it / groups, kh0 = it % groups * hg, qlen = cu_q[b + 1] - cu_q[b];  \
                if (!scratch || qlen <= 0) continue;                                              \
                const int32_t *bt = block_tables + (int64_t)b * max_blocks;                       \
                /* the next item's K blocks, prefetched during this item's V pass */                \
                const int nxt = it + 1 < hi ? it + 1 : -1;                                        \
                const int32_t *next_bt = nxt < 0 ? 0 : block_tables + (int64_t)(nxt / groups) * max_blocks; \
                const int next_nb = nxt < 0 ? 0 : (ctx_lens[nxt / groups] + BS - 1) / BS;        \
                const int64_t next_head = nxt < 0 ? 0 : (int64_t)(nxt % groups * hg) * head_stride; \
                if (D == 64)                                                                      \
                    item_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], \
                                  qlen, kh0, hg, H, KVH, 64, BS, blk_stride, tok_stride, head_stride, scale, scratch, next_bt, next_nb, next_head); \
                else if (D == 128)                                                                \
                    item_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], \
                                  qlen, kh0, hg, H, KVH, 128, BS, blk_stride, tok_stride, head_stride, scale, scratch, next_bt, next_nb, next_head); \
                else                                                                              \
                    item_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], \
                                  qlen, kh0, hg, H, KVH, D, BS, blk_stride, tok_stride, head_stride, scale, scratch, next_bt, next_nb, next_head); \
            }                                                                                     \
            free(scratch);                                                                        \
        }                                                                                         \
        return err;                                                                               \
    }

DEFINE_KERNEL(f32, float, float)
DEFINE_KERNEL(bf16, bf16_t, bf16_t)
DEFINE_KERNEL(f32_bf16kv, float, bf16_t)

/* ------------------------------------------------------------------------------------------------
 * Causal attention of prefill chunks over the pool (float32; AVX-512 or AVX2 + FMA builds, elsewhere
 * the engine uses torch's SDPA). Same arguments as paged_attention_f32: sequence b's query rows
 * cu_q[b] .. cu_q[b+1]-1 are the last tokens of its context, its K/V (the chunk's own already stored)
 * read in place through its block table. Work item = (sequence, kv head, tile of PF_TOKENS query
 * tokens); keys are taken PF_KEYS at a time, flash-attention style:
 * - their K rows transposed once into [D][PF_KEYS], shared by the tile's G x 32 query rows;
 * - scores for PF_SCORE_ROWS rows x 16 keys at a time in registers (a row's 16 are one zmm or two ymm);
 * - online softmax per row (running max and sum), over the block's scores in place;
 * - P V accumulated in registers, PF_PV_ROWS rows x PF_PV_VECS vectors of D at a time.
 * Why: torch's fp32 SDPA ran fresh 128-512-token chunks at 24-59 GFLOP/s on the AVX-512 machine, this
 * kernel at 83-112 (2,048 tokens: level, ~120); SDPA stays the path for other head sizes and dtypes
 * (the kernel returns -3). Tiles of 32 tokens measured 3-5% faster than 16 at 300-2,048 tokens.
 * AVX2 (16 ymm): blocks of 64 keys (a row's fixed softmax work amortised over 4x the keys of 16:
 * +10-15%), 6-row score tiles (12 FMA chains, +15% over 4) and 4-row x 16-float P V tiles (8 chains,
 * every register left for them).
 * ------------------------------------------------------------------------------------------------ */
#if defined(VEC)
#define PF_TOKENS 32
#define PF_MAX_ROWS (PF_TOKENS * 16)      /* G <= 16 */
#define PF_SUB (16 / VLEN)                /* vectors of 16 keys' scores */

#if defined(__AVX512F__)
#define PF_KEYS 16                        /* keys per block */
#define PF_SCORE_ROWS 4                   /* query rows per scores tile: 4 FMA chains */
#define PF_PV(D) ((D) == 64 ? pf_pv_4x6 : pf_pv_8x3)   /* the whole row of D in registers: 24 of 32 zmm */

/* e^x for x <= 0 lanes (clamped at -87), the same polynomial as exp_nonpos_core, 2^k by scalef. */
static inline __m512 exp512_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}

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
    const float mx = _mm512_reduce_max_ps(sv), mnew = mx > *m ? mx : *m;
    const __m512 p = _mm512_maskz_mov_ps(vis, exp512_nonpos(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
    *alpha = *m == -INFINITY ? 0.f : exp_nonpos(*m - mnew);
    *l = *l * *alpha + _mm512_reduce_add_ps(p);
    *m = mnew;
    _mm512_store_ps(P, p);
    return 1;
}
#else
#define PF_KEYS 64
#define PF_SCORE_ROWS 6                   /* 12 FMA chains of two ymm */
#define PF_PV(D) pf_pv_2x4                /* 4 rows x 16 floats of D: 8 chains */

/* e^x for x <= 0 lanes (clamped at -87), the polynomial of exp_nonpos_core, 2^k built in the exponent. */
static inline __m256 exp256_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, k), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax256(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

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
    const float mb = hmax256(mx), mnew = mb > *m ? mb : *m;
    const __m256 mv = _mm256_set1_ps(mnew);
    __m256 sum = _mm256_setzero_ps();
    for (int v = 0; v < PF_KEYS / 8; v++) {
        const __m256 p = _mm256_and_ps(vis[v], exp256_nonpos(_mm256_sub_ps(sv[v], mv)));
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(P + v * 8, p);
    }
    *alpha = *m == -INFINITY ? 0.f : exp_nonpos(*m - mnew);
    *l = *l * *alpha + hsum256(sum);
    *m = mnew;
    return 1;
}
#endif

/* acc[r][0..D) = acc[r] * alpha[r] + sum_j P[r][j] V[j] over nk keys: rows RR at a time, D in slices of
 * SV vectors (the slice's accumulators stay in registers while the keys stream past). */
#define DEFINE_PF_PV(SV, RR)                                                                              \
static inline void pf_pv_##SV##x##RR(float *acc, int D, const float *P, const float *alpha,              \
                                      const float *const *vrows, int nk, int rows) {                     \
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
                for (int v = 0; v < SV; v++) vv[v] = VEC_LOADU(vrows[j] + d0 + v * VLEN);                 \
                _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {                                    \
                    const VEC p = VEC_SET1(P[(r0 + r) * PF_KEYS + j]);                                    \
                    _Pragma("GCC unroll 8") for (int v = 0; v < SV; v++) a[r][v] = VEC_FMA(p, vv[v], a[r][v]); \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            for (int j = 0; j < nk; j++) {                                                                \
                VEC vv[SV];                                                                               \
                for (int v = 0; v < SV; v++) vv[v] = VEC_LOADU(vrows[j] + d0 + v * VLEN);                 \
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

static void pf_item(const float *q, int64_t q_stride, const float *kc, const float *vc, float *out, int64_t out_stride,
                    const int32_t *bt, int ctx, int q0, int qlen, int t0, int t1, int kh, int H, int KVH, int D, int BS,
                    int64_t blk_stride, int64_t tok, int64_t head_stride, float scale, float *scratch) {
    const int G = H / KVH, rows = (t1 - t0) * G;
    float *qs = scratch;                                   /* [rows][D] */
    float *acc = qs + (int64_t)PF_MAX_ROWS * D;            /* [rows][D] */
    float *kt = acc + (int64_t)PF_MAX_ROWS * D;            /* [D][PF_KEYS] */
    float *P = kt + (int64_t)D * PF_KEYS;                  /* [rows][PF_KEYS] */
    float *m = P + PF_MAX_ROWS * PF_KEYS, *l = m + PF_MAX_ROWS, *alpha = l + PF_MAX_ROWS;
    int pos[PF_MAX_ROWS];
    const float *vrows[PF_KEYS];
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
                const float *kr = kc + (int64_t)bt[j / BS] * blk_stride + head + (int64_t)(j % BS) * tok;
                vrows[jj] = vc + (int64_t)bt[j / BS] * blk_stride + head + (int64_t)(j % BS) * tok;
                for (int d = 0; d < D; d++) kt[d * PF_KEYS + jj] = kr[d];
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
        PF_PV(D)(acc, D, P, alpha, vrows, nk, rows);
    }
    for (int i = t0; i < t1; i++)
        for (int g = 0; g < G; g++) {
            const int r = (i - t0) * G + g;
            float *dst = out + (int64_t)(q0 + i) * out_stride + (int64_t)(kh * G + g) * D;
            const float inv = 1.f / l[r];
            for (int d = 0; d < D; d++) dst[d] = acc[(int64_t)r * D + d] * inv;
        }
}

int prefill_attention_f32(const float *q, int64_t q_stride, const float *kc, const float *vc, float *out,
                          int64_t out_stride, const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,
                          const int32_t *cu_q, int B, int H, int KVH, int D, int BS, int64_t blk_stride,
                          int64_t tok_stride, int64_t head_stride, float scale) {
    if ((D != 64 && D != 128) || H % KVH || H / KVH > 16) return -3;
    int tiles = 0;
    for (int b = 0; b < B; b++) tiles += (cu_q[b + 1] - cu_q[b] + PF_TOKENS - 1) / PF_TOKENS;
    const int64_t scratch_len = 2 * (int64_t)PF_MAX_ROWS * D + (int64_t)(D + PF_MAX_ROWS) * PF_KEYS + 3 * PF_MAX_ROWS + 16;
    int err = 0;
    #pragma omp parallel num_threads(NT)
    {
        float *scratch = (float *)aligned_alloc(64, sizeof(float) * ((scratch_len + 15) / 16 * 16));
        if (!scratch) err = -2;
        #pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < tiles * KVH; it++) {
            if (!scratch) continue;
            int t = it / KVH, b = 0;
            const int kh = it % KVH;
            for (;; b++) {                                 /* tile t -> (sequence b, its tile t) */
                const int n = (cu_q[b + 1] - cu_q[b] + PF_TOKENS - 1) / PF_TOKENS;
                if (t < n) break;
                t -= n;
            }
            const int qlen = cu_q[b + 1] - cu_q[b], t0 = t * PF_TOKENS;
            const int t1 = t0 + PF_TOKENS < qlen ? t0 + PF_TOKENS : qlen;
            pf_item(q, q_stride, kc, vc, out, out_stride, block_tables + (int64_t)b * max_blocks, ctx_lens[b],
                    cu_q[b], qlen, t0, t1, kh, H, KVH, D, BS, blk_stride, tok_stride, head_stride, scale, scratch);
        }
        free(scratch);
    }
    return err;
}
#endif

/* Write the new tokens' K/V rows into their pool slots (slot = block * BS + offset; < 0 skips).
 * k, v: [n, KVH, D] with any token stride (views into the fused qkv projection). */
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

/* ---------------------------------------------------------------------------------------------
 * Fused element-wise layers (fp32 arithmetic; bf16 variants round where transformers rounds).
 * ------------------------------------------------------------------------------------------- */

static inline float exp_clamped(float x) { /* exp(x), x clamped to [-87, 88] */
    x = x > 88.0f ? 88.0f : x;
    return exp_nonpos_core(x < -87.0f ? -87.0f : x);
}

static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float get_f32(const float *p, int64_t i) { return p[i]; }
static inline float get_bf16(const bf16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void put_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void put_bf16(bf16_t *p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

/* rows of D at x + t * x_stride + h * D (t < n_tok, h < n_head) -> out, same addressing.
 * y = w * round(x / rms(x)), like transformers' RMSNorm. out may alias x. */
#define DEFINE_RMSNORM(SUFFIX, T)                                                                 \
    void rms_norm_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t out_stride, const T *w,  \
                           int n_tok, int n_head, int D, float eps) {                             \
        _Pragma("omp parallel for if (n_tok >= 64) num_threads(NT)")                                              \
        for (int t = 0; t < n_tok; t++)                                                           \
            for (int h = 0; h < n_head; h++) {                                                    \
                const T *xr = x + t * x_stride + (int64_t)h * D;                                  \
                T *o = out + t * out_stride + (int64_t)h * D;                                     \
                float ss = 0.f;                                                                   \
                for (int d = 0; d < D; d++) {                                                     \
                    const float v = get_##SUFFIX(xr, d);                                          \
                    ss += v * v;                                                                  \
                }                                                                                 \
                const float inv = 1.0f / sqrtf(ss / (float)D + eps);                              \
                for (int d = 0; d < D; d++)                                                       \
                    put_##SUFFIX(o, d, get_##SUFFIX(w, d) * round_##SUFFIX(get_##SUFFIX(xr, d) * inv)); \
            }                                                                                     \
    }

/* residual += x (rounded like a bf16 add), out = RMSNorm(residual) * w. Rows of D, contiguous. */
#define DEFINE_ADD_RMSNORM(SUFFIX, T)                                                             \
    void add_rms_norm_##SUFFIX(T *residual, const T *x, T *out, const T *w, int n, int D,         \
                               float eps) {                                                       \
        _Pragma("omp parallel for if (n >= 64) num_threads(NT)")                                                  \
        for (int t = 0; t < n; t++) {                                                             \
            T *r = residual + (int64_t)t * D;                                                     \
            const T *xr = x + (int64_t)t * D;                                                     \
            T *o = out + (int64_t)t * D;                                                          \
            float ss = 0.f;                                                                       \
            for (int d = 0; d < D; d++) {                                                         \
                const float v = round_##SUFFIX(get_##SUFFIX(r, d) + get_##SUFFIX(xr, d));         \
                put_##SUFFIX(r, d, v);                                                            \
                ss += v * v;                                                                      \
            }                                                                                     \
            const float inv = 1.0f / sqrtf(ss / (float)D + eps);                                  \
            for (int d = 0; d < D; d++)                                                           \
                put_##SUFFIX(o, d, get_##SUFFIX(w, d) * round_##SUFFIX(get_##SUFFIX(r, d) * inv)); \
        }                                                                                         \
    }

/* In-place rotate-half RoPE on n_head heads of D per token (token stride x_stride), with
 * cos/sin tables [max_len, D/2] in the model dtype indexed by positions. */
#define DEFINE_ROPE(SUFFIX, T)                                                                    \
    void rope_##SUFFIX(T *x, int64_t x_stride, int n_tok, int n_head, int D,                      \
                       const int64_t *positions, const T *cos_t, const T *sin_t) {                \
        const int half = D / 2;                                                                   \
        _Pragma("omp parallel for if (n_tok >= 64) num_threads(NT)")                                              \
        for (int t = 0; t < n_tok; t++) {                                                         \
            const T *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;           \
            for (int h = 0; h < n_head; h++) {                                                    \
                T *xh = x + t * x_stride + (int64_t)h * D;                                        \
                for (int i = 0; i < half; i++) {                                                  \
                    const float a = get_##SUFFIX(xh, i), b = get_##SUFFIX(xh, i + half);          \
                    const float ci = get_##SUFFIX(c, i), si = get_##SUFFIX(s, i);                 \
                    put_##SUFFIX(xh, i, round_##SUFFIX(a * ci) - round_##SUFFIX(b * si));         \
                    put_##SUFFIX(xh, i + half, round_##SUFFIX(b * ci) + round_##SUFFIX(a * si));  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

/* out[t, f] = silu(gu[t, f]) * gu[t, F + f]   (gate and up halves of the fused projection) */
#define DEFINE_SILU_MUL(SUFFIX, T)                                                                \
    void silu_mul_##SUFFIX(const T *gu, T *out, int n, int F) {                                   \
        _Pragma("omp parallel for if (n >= 16) num_threads(NT)")                                                  \
        for (int t = 0; t < n; t++) {                                                             \
            const T *g = gu + (int64_t)t * 2 * F, *u = g + F;                                     \
            T *o = out + (int64_t)t * F;                                                          \
            for (int f = 0; f < F; f++) {                                                         \
                const float v = get_##SUFFIX(g, f);                                               \
                const float act = round_##SUFFIX(v / (1.0f + exp_clamped(-v)));                   \
                put_##SUFFIX(o, f, act * get_##SUFFIX(u, f));                                     \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_RMSNORM(f32, float)
DEFINE_RMSNORM(bf16, bf16_t)
DEFINE_ADD_RMSNORM(f32, float)
DEFINE_ADD_RMSNORM(bf16, bf16_t)
DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, bf16_t)
DEFINE_SILU_MUL(f32, float)
DEFINE_SILU_MUL(bf16, bf16_t)

/* ------------------------------------------------------------------------------------------------
 * float32 GEMM over a pre-packed weight: y[M, N] = x[M, K] @ W^T (+ bias), W given as [N, K].
 *
 * Why our own: a decode step is a handful of GEMMs at 1-64 rows, where oneDNN's packed inner product
 * falls well short of what it does at 2,048 rows (Zen 3: 55-70%; Zen 4: ~80% at 32 rows, ~40% at 8),
 * while a register-blocked FMA kernel over a panel layout keeps the FMA pipes fed at small row counts
 * (hack/gemm_backends.py; the step's GEMMs in docs/engine-speed.md).
 *
 * Packed layout: N is cut into panels of GEMM_NR = 16 columns (one 64-byte line per k), panels padded
 * to a multiple of GEMM_GROUP = 4 (zeros); panel p holds W[p*16 + j][k] at p*K*16 + k*16 + j, so the
 * kernel streams one line of W per k. A register tile is R rows x V panels with R*V (AVX-512: one zmm
 * per panel row) or 2*R*V (AVX2: two ymm) accumulators, the W loads shared by the rows. Every tile
 * keeps enough independent FMA chains in flight to cover the FMA latency (4 cycles: 8 ymm chains for
 * two 256-bit pipes; 4 zmm chains, a zmm FMA taking both pipes on Zen 4): few rows take more panels
 * per tile. `gemm_tile_rows` cuts the rows with no padded rows. Threads split the panel groups; rows are blocked by 240 so a block of x stays in L2.
 * Each output is one k-ordered fp32 FMA chain (differs from F.linear by summation order only).
 * ------------------------------------------------------------------------------------------------ */
#if defined(__AVX2__) && defined(__FMA__)

#define GEMM_NR 16
#define GEMM_GROUP 4
#define GEMM_MBLK 240

int64_t gemm_packed_floats_f32(int64_t N, int64_t K) {
    int64_t panels = (N + GEMM_NR - 1) / GEMM_NR;
    panels = (panels + GEMM_GROUP - 1) / GEMM_GROUP * GEMM_GROUP;
    return panels * K * GEMM_NR;
}

/* W [N, K] of element type T -> the panel layout (zero past N): gemm_pack_f32 for fp32 weights,
 * gemm_pack_i8w_f32 for the int8 codes of `gemm_i8w_f32` (below). */
#define DEFINE_GEMM_PACK(NAME, T)                                                                        \
void NAME(const T *w, int64_t N, int64_t K, T *packed) {                                                 \
    int64_t panels = gemm_packed_floats_f32(N, K) / (K * GEMM_NR);                                       \
    _Pragma("omp parallel for schedule(static) num_threads(NT)")                                         \
    for (int64_t p = 0; p < panels; p++) {                                                               \
        T *dst = packed + p * K * GEMM_NR;                                                                \
        for (int64_t k = 0; k < K; k++)                                                                   \
            for (int j = 0; j < GEMM_NR; j++) {                                                           \
                int64_t n = p * GEMM_NR + j;                                                              \
                dst[k * GEMM_NR + j] = n < N ? w[n * K + k] : (T)0;                                       \
            }                                                                                             \
    }                                                                                                     \
}
DEFINE_GEMM_PACK(gemm_pack_f32, float)
DEFINE_GEMM_PACK(gemm_pack_i8w_f32, int8_t)

/* A register tile: (x rows packed k-major, panels (fp32, or int8 codes), K, out, ldo, the panels' column
 * scales (int8 only)). */
typedef void (*gemm_tile_fn)(const float *restrict, const void *restrict, int64_t, float *restrict, int64_t,
                             const float *restrict);

#if defined(__AVX512F__)
#define GEMM_WIDEN(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(p))))
#define GEMM_MAX_ROWS 12
#else
#define GEMM_WIDEN(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define GEMM_MAX_ROWS 6
#endif
#define GEMM_VPP (GEMM_NR / VLEN)      /* vectors per panel row */

/* R rows x V panels; x is the tile's rows packed k-major ([K][R], `gemm_pack_rows`), out is [R][V * 16]
 * (ldo floats per row); constant R and V unroll fully, so the accumulators live in registers. T is the
 * panels' element type, LOADW loads one vector of them as fp32, SCALE applies the columns' scales at
 * the end (int8 codes: the products summed over k, times the column's scale, are the dequantized
 * weight's; fp32: nothing to apply). */
#define GEMM_TILE_OF(NAME, T, LOADW, SCALE, R, V)                                                        \
static void NAME(const float *restrict x, const void *restrict panels, int64_t K,                        \
                 float *restrict out, int64_t ldo, const float *restrict scales) {                       \
    const T *restrict pw = (const T *)panels;                                                             \
    const int64_t ps = K * GEMM_NR;                                                                       \
    VEC acc[R][GEMM_VPP * V];                                                                        \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++) acc[r][v] = VEC_ZERO();         \
    for (int64_t k = 0; k < K; k++) {                                                                     \
        VEC w[GEMM_VPP * V];                                                                         \
        /* the panels after this tile's, into L2: at 1-64 rows a panel is used by few tiles, so its   \
           first touch would otherwise stall on L3/DRAM (panels are contiguous, this thread takes them \
           in order); into L1 they would evict the panels in use (measured 5-30% slower at 8-64 rows) */ \
        _Pragma("GCC unroll 16") for (int v = 0; v < V; v++)                                              \
            _mm_prefetch((const char *)(pw + (V + v) * ps + k * GEMM_NR), _MM_HINT_T1);                    \
        _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++)                                   \
            w[v] = LOADW(pw + (v / GEMM_VPP) * ps + k * GEMM_NR + (v % GEMM_VPP) * VLEN);            \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                            \
            VEC b = VEC_SET1(x[k * R + r]);                                                          \
            _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++)                               \
                acc[r][v] = VEC_FMA(b, w[v], acc[r][v]);                                                 \
        }                                                                                                 \
    }                                                                                                     \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++)                                   \
            VEC_STOREU(out + r * ldo + v * VLEN,                                                     \
                       SCALE(acc[r][v], scales + (v / GEMM_VPP) * GEMM_NR + (v % GEMM_VPP) * VLEN)); \
}
#define GEMM_UNSCALED(acc, s) (acc)
#define GEMM_SCALED(acc, s) VEC_MUL(acc, VEC_LOAD(s))
#define GEMM_TILE(R, V)                                                                                  \
    GEMM_TILE_OF(gemm_tile_##R##x##V, float, VEC_LOAD, GEMM_UNSCALED, R, V)                            \
    GEMM_TILE_OF(gemm_tile_i8_##R##x##V, int8_t, GEMM_WIDEN, GEMM_SCALED, R, V)

#if defined(__AVX512F__)
/* 4-12 rows: two panels (8-24 chains; a broadcast of x feeds two FMAs, which measured 3-15% faster
 * than one panel at 8-64 rows); 1-3 rows: four (4-12). */
GEMM_TILE(12, 2) GEMM_TILE(11, 2) GEMM_TILE(10, 2) GEMM_TILE(9, 2) GEMM_TILE(8, 2)
GEMM_TILE(7, 2) GEMM_TILE(6, 2) GEMM_TILE(5, 2) GEMM_TILE(4, 2)
GEMM_TILE(3, 4) GEMM_TILE(2, 4) GEMM_TILE(1, 4)
static const gemm_tile_fn GEMM_TILES[GEMM_MAX_ROWS + 1] = {
    NULL, gemm_tile_1x4, gemm_tile_2x4, gemm_tile_3x4, gemm_tile_4x2, gemm_tile_5x2, gemm_tile_6x2,
    gemm_tile_7x2, gemm_tile_8x2, gemm_tile_9x2, gemm_tile_10x2, gemm_tile_11x2, gemm_tile_12x2};
static const gemm_tile_fn GEMM_TILES_I8[GEMM_MAX_ROWS + 1] = {
    NULL, gemm_tile_i8_1x4, gemm_tile_i8_2x4, gemm_tile_i8_3x4, gemm_tile_i8_4x2, gemm_tile_i8_5x2,
    gemm_tile_i8_6x2, gemm_tile_i8_7x2, gemm_tile_i8_8x2, gemm_tile_i8_9x2, gemm_tile_i8_10x2,
    gemm_tile_i8_11x2, gemm_tile_i8_12x2};
static const int GEMM_TILE_PANELS[GEMM_MAX_ROWS + 1] = {0, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2};

/* The next tile's rows out of `left`: up to 12, and 13-23 cut into two near halves (>= 7 and 6). */
static int gemm_tile_rows(int64_t left) {
    if (left <= GEMM_MAX_ROWS) return (int)left;
    if (left < 2 * GEMM_MAX_ROWS) return (int)((left + 1) / 2);
    return GEMM_MAX_ROWS;
}
#else
/* 6 and 4 rows: one panel (12 and 8 chains); 2 rows: two panels (8); 1 row: four (8). */
GEMM_TILE(6, 1) GEMM_TILE(4, 1) GEMM_TILE(2, 2) GEMM_TILE(1, 4)
static const gemm_tile_fn GEMM_TILES[GEMM_MAX_ROWS + 1] = {
    NULL, gemm_tile_1x4, gemm_tile_2x2, NULL, gemm_tile_4x1, NULL, gemm_tile_6x1};
static const gemm_tile_fn GEMM_TILES_I8[GEMM_MAX_ROWS + 1] = {
    NULL, gemm_tile_i8_1x4, gemm_tile_i8_2x2, NULL, gemm_tile_i8_4x1, NULL, gemm_tile_i8_6x1};
static const int GEMM_TILE_PANELS[GEMM_MAX_ROWS + 1] = {0, 4, 2, 0, 1, 0, 1};

/* 6-row tiles, 8 as 4 + 4, then 4, 2, 1 (32 rows = 6+6+6+6+4+4). */
static int gemm_tile_rows(int64_t left) {
    if (left == 8) return 4;
    return left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}
#endif

/* The tallest register tile of this build: 12 with AVX-512 (zmm tiles), 6 with AVX2. */
int gemm_tile_max_rows(void) { return GEMM_MAX_ROWS; }

/* Rows [m0, m1) of x, cut into tiles as gemm_tile_rows cuts them, each tile's rows packed k-major into
 * xp ([K][h] at (r - m0) * K), so a tile's broadcasts read one sequential stream instead of h strided
 * rows (measured +5% at 2,048 rows, +7-15% at 256). Tile t is packed by thread t % nt. */
static void gemm_pack_rows(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, float *xp, int tid, int nt) {
    for (int64_t r = m0, t = 0; r < m1; t++) {
        const int h = gemm_tile_rows(m1 - r);
        if (t % nt == tid) {
            float *dst = xp + (r - m0) * K;
            for (int i = 0; i < h; i++) {
                const float *src = x + (r + i) * ldx;
                for (int64_t k = 0; k < K; k++) dst[k * h + i] = src[k];
            }
        }
        r += h;
    }
}

/* One group of 4 panels for rows [m0, m1) (packed in xp) through `tiles`: panels `pw` of esize-byte
 * elements (with their columns' scales, int8), results into y (columns col0..col0+63, ldy) or, where
 * the group runs past N, into a scratch row block first (then only the real columns are copied). */
static void gemm_group(const float *xp, int64_t m0, int64_t m1, int64_t K, const gemm_tile_fn *tiles,
                       const char *pw, int esize, const float *scales,
                       float *y, int64_t ldy, int64_t col0, int64_t N, const float *bias, float *scratch) {
    const int64_t width = GEMM_NR * GEMM_GROUP, ps = K * GEMM_NR * esize;
    const int tail = col0 + width > N;
    for (int64_t r = m0; r < m1;) {
        const int h = gemm_tile_rows(m1 - r), panels = GEMM_TILE_PANELS[h];
        float *out = tail ? scratch : y + r * ldy + col0;
        const int64_t ldo = tail ? width : ldy;
        for (int v = 0; v < GEMM_GROUP; v += panels)
            tiles[h](xp + (r - m0) * K, pw + v * ps, K, out + v * GEMM_NR, ldo, scales ? scales + v * GEMM_NR : NULL);
        if (tail)
            for (int i = 0; i < h; i++) memcpy(y + (r + i) * ldy + col0, scratch + i * width, (N - col0) * sizeof(float));
        r += h;
    }
    if (bias) {
        int64_t n = col0 + width < N ? width : N - col0;
        for (int64_t i = m0; i < m1; i++)
            for (int64_t j = 0; j < n; j++) y[i * ldy + col0 + j] += bias[col0 + j];
    }
}

/* int8 weight-only (`--quantization int8`): the codes in the fp32 panel layout, one byte per element (a
 * quarter of fp32's weight bytes to stream), one fp32 scale per output column (padded to the panels).
 * The int8 tiles widen each code as they load it and scale the sums once at the end. Measured on the
 * AVX2 machine (hack/gemm_backends.py --quantized): 1.3-2.8x the fp32 kernel at 1-8 rows, level from 32
 * rows on (the FMAs are the same; the widening is shared by the tile's rows), where torch's `_weight_int8pack_mm`
 * (bf16 activations) ran at 0.4-0.6x. Widening a group once into an fp32 buffer for all rows measured
 * the same from 32 rows on and 0.8-0.95x at fewer, so it is not kept. The codes are packed by
 * gemm_pack_i8w_f32 (above). */

/* y = x W^T (+ bias) over fp32 panels (`packed`) or int8 ones (`codes` and `scales`). 0, or -2 when the
 * packed-rows buffer cannot be allocated (nothing computed). */
static int gemm_run(const float *x, int64_t ldx, int64_t M, int64_t K, const float *packed, const int8_t *codes,
                    const float *scales, int64_t N, float *y, int64_t ldy, const float *bias) {
    const int64_t groups = gemm_packed_floats_f32(N, K) / (K * GEMM_NR * GEMM_GROUP), gsize = GEMM_GROUP * K * GEMM_NR;
    const int64_t rows = M < GEMM_MBLK ? M : GEMM_MBLK;
    const gemm_tile_fn *tiles = codes ? GEMM_TILES_I8 : GEMM_TILES;
    const char *panels = codes ? (const char *)codes : (const char *)packed;
    const int esize = codes ? 1 : (int)sizeof(float);
    float *xp = aligned_alloc(64, (size_t)((rows * K * (int64_t)sizeof(float) + 63) / 64 * 64));
    if (!xp) return -2;
    #pragma omp parallel num_threads(NT)
    {
        float scratch[GEMM_MAX_ROWS * GEMM_NR * GEMM_GROUP] __attribute__((aligned(64)));
        for (int64_t mb = 0; mb < M; mb += GEMM_MBLK) {
            int64_t me = mb + GEMM_MBLK < M ? mb + GEMM_MBLK : M;
            gemm_pack_rows(x, ldx, mb, me, K, xp, omp_get_thread_num(), omp_get_num_threads());
            #pragma omp barrier
            #pragma omp for schedule(static)     /* its closing barrier: xp is reused by the next block */
            for (int64_t g = 0; g < groups; g++) {
                const int64_t col0 = g * GEMM_NR * GEMM_GROUP;
                gemm_group(xp, mb, me, K, tiles, panels + g * gsize * esize, esize, codes ? scales + col0 : NULL,
                           y, ldy, col0, N, bias, scratch);
            }
        }
    }
    free(xp);
    return 0;
}

int gemm_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *packed, int64_t N,
             float *y, int64_t ldy, const float *bias) {
    return gemm_run(x, ldx, M, K, packed, NULL, NULL, N, y, ldy, bias);
}

/* `scales` holds one float per packed column (gemm_packed_floats_f32(N, K) / K of them). */
int gemm_i8w_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 int64_t N, float *y, int64_t ldy, const float *bias) {
    return gemm_run(x, ldx, M, K, NULL, codes, scales, N, y, ldy, bias);
}
#endif
