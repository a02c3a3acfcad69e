/* Paged attention for CPU: queries of several sequences attend over K/V read in place
 * from the block pool through each sequence's block table (no gather copy).
 *
 * Layout (same as flash-attn's paged KV): k_cache, v_cache [num_blocks, block_size, kv_heads, D].
 * Sequence b owns query rows cu_q[b] .. cu_q[b+1]-1 (the last qlen tokens of its context of
 * ctx_lens[b] tokens, causal): query i sits at position ctx - qlen + i and sees keys 0..pos.
 * Work item = (sequence, kv head): each K/V row is read once and shared by the G = H / KVH query
 * heads of the group and by all query tokens of the sequence. Scores are fp32, the softmax is
 * exact (scores of one item fit a scratch row), the output is written in the cache dtype.
 *
 * Built at run time with the system C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes; OpenMP resolves to the libgomp torch already loaded, so the thread pool is shared.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 256 /* G * qlen per work item */

typedef uint16_t bf16_t;

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

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.f;
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int D) {
    for (int d = 0; d < D; d++) y[d] += a * x[d];
}

/* One (sequence, kv head) item. T is the element type, D is a compile-time constant when
 * the caller passes a literal (always_inline specialises the loops). */
#define DEFINE_ITEM(SUFFIX, T)                                                                    \
    static inline __attribute__((always_inline)) void item_##SUFFIX(                              \
        const T *q, int64_t q_stride, const T *kc, const T *vc, T *out, int64_t out_stride,       \
        const int32_t *bt, int ctx, int q0, int qlen, int kh, int H, int KVH, const int D,        \
        int BS, float scale, float *scratch) {                                                    \
        const int G = H / KVH, rows = G * qlen;                                                   \
        float *qf = scratch;                          /* [rows, D] */                             \
        float *acc = qf + (int64_t)rows * D;          /* [rows, D] */                             \
        float *row = acc + (int64_t)rows * D;         /* [D] */                                   \
        float *s = row + D;                           /* [rows, ctx] */                           \
        int lim[MAX_ROWS];                                                                        \
        for (int i = 0; i < qlen; i++)                                                            \
            for (int g = 0; g < G; g++) {                                                         \
                const int r = i * G + g;                                                          \
                load_row_##SUFFIX(qf + (int64_t)r * D,                                            \
                                  q + (int64_t)(q0 + i) * q_stride + (int64_t)(kh * G + g) * D, D); \
                for (int d = 0; d < D; d++) qf[(int64_t)r * D + d] *= scale;                      \
                lim[r] = ctx - qlen + i + 1; /* keys [0, lim) are visible */                      \
            }                                                                                     \
        const int64_t tok = (int64_t)KVH * D, head = (int64_t)kh * D;                             \
        const int nblocks = (ctx + BS - 1) / BS;                                                  \
        for (int b = 0, j = 0; b < nblocks; b++) {                                                \
            const T *kb = kc + (int64_t)bt[b] * BS * tok + head;                                  \
            const int n = ctx - j < BS ? ctx - j : BS;                                            \
            for (int o = 0; o < n; o++, j++) {                                                    \
                const float *kr = kv_row_##SUFFIX(row, kb + o * tok, D);                          \
                for (int r = 0; r < rows; r++) s[(int64_t)r * ctx + j] = dot(qf + (int64_t)r * D, kr, D); \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < rows; r++) {                                                          \
            float *sr = s + (int64_t)r * ctx;                                                     \
            const int L = lim[r];                                                                 \
            float m = -INFINITY, sum = 0.f;                                                       \
            for (int j = 0; j < L; j++) m = sr[j] > m ? sr[j] : m;                                \
            for (int j = 0; j < L; j++) {                                                         \
                sr[j] = expf(sr[j] - m);                                                          \
                sum += sr[j];                                                                     \
            }                                                                                     \
            const float inv = 1.f / sum;                                                          \
            for (int j = 0; j < L; j++) sr[j] *= inv;                                             \
            for (int j = L; j < ctx; j++) sr[j] = 0.f;                                            \
            memset(acc + (int64_t)r * D, 0, sizeof(float) * (size_t)D);                           \
        }                                                                                         \
        for (int b = 0, j = 0; b < nblocks; b++) {                                                \
            const T *vb = vc + (int64_t)bt[b] * BS * tok + head;                                  \
            const int n = ctx - j < BS ? ctx - j : BS;                                            \
            for (int o = 0; o < n; o++, j++) {                                                    \
                const float *vr = kv_row_##SUFFIX(row, vb + o * tok, D);                          \
                for (int r = 0; r < rows; r++) axpy(acc + (int64_t)r * D, s[(int64_t)r * ctx + j], vr, D); \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < qlen; i++)                                                            \
            for (int g = 0; g < G; g++) {                                                         \
                const int r = i * G + g;                                                          \
                store_row_##SUFFIX(out + (int64_t)(q0 + i) * out_stride + (int64_t)(kh * G + g) * D, \
                                   acc + (int64_t)r * D, D);                                      \
            }                                                                                     \
    }

DEFINE_ITEM(f32, float)
DEFINE_ITEM(bf16, bf16_t)

#define DEFINE_KERNEL(SUFFIX, T)                                                                  \
    int paged_attention_##SUFFIX(const T *q, int64_t q_stride, const T *kc, const T *vc, T *out,  \
                                 int64_t out_stride, const int32_t *block_tables, int max_blocks, \
                                 const int32_t *ctx_lens, const int32_t *cu_q, int B, int H,      \
                                 int KVH, int D, int BS, float scale) {                           \
        int max_ctx = 0, max_q = 0;                                                               \
        for (int b = 0; b < B; b++) {                                                             \
            if (ctx_lens[b] > max_ctx) max_ctx = ctx_lens[b];                                     \
            if (cu_q[b + 1] - cu_q[b] > max_q) max_q = cu_q[b + 1] - cu_q[b];                     \
        }                                                                                         \
        const int G = H / KVH;                                                                    \
        if (G * max_q > MAX_ROWS) return -1;                                                      \
        const int64_t scratch_len = (int64_t)G * max_q * (2 * D + max_ctx) + D + 16;              \
        int err = 0;                                                                              \
        _Pragma("omp parallel")                                                                   \
        {                                                                                         \
            float *scratch = (float *)aligned_alloc(64, sizeof(float) * ((scratch_len + 15) / 16 * 16)); \
            if (!scratch) err = -2;                                                               \
            _Pragma("omp for schedule(dynamic, 1)")                                               \
            for (int it = 0; it < B * KVH; it++) {                                                \
                const int b = it / KVH, kh = it % KVH, qlen = cu_q[b + 1] - cu_q[b];             \
                if (!scratch || qlen <= 0) continue;                                              \
                const int32_t *bt = block_tables + (int64_t)b * max_blocks;                       \
                if (D == 64)                                                                      \
                    item_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], \
                                  qlen, kh, H, KVH, 64, BS, scale, scratch);                      \
                else if (D == 128)                                                                \
                    item_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], \
                                  qlen, kh, H, KVH, 128, BS, scale, scratch);                     \
                else                                                                              \
                    item_##SUFFIX(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], \
                                  qlen, kh, H, KVH, D, BS, scale, scratch);                       \
            }                                                                                     \
            free(scratch);                                                                        \
        }                                                                                         \
        return err;                                                                               \
    }

DEFINE_KERNEL(f32, float)
DEFINE_KERNEL(bf16, bf16_t)
