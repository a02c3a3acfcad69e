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
 * this block's V, the V pass the next item's K blocks.
 * Sequence b owns query rows cu_q[b] .. cu_q[b+1]-1 (the last qlen tokens of its context of
 * ctx_lens[b] tokens, causal): query i sits at position ctx - qlen + i and sees keys 0..pos.
 * Work item = (sequence, its kv heads, or a group of them where the rows would not fit): each K/V row
 * is read once and shared by the G = H / KVH query heads of its group and by all query tokens of the
 * sequence. Each thread takes a contiguous, cost-balanced range of items. Scores are fp32, the softmax is
 * exact (scores of one item fit a scratch row), the output is written in the cache dtype.
 */
#include "common.h"

#define MAX_ROWS 256 /* G * qlen per work item */

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
