/* Paged attention for CPU: queries of several sequences attend over K/V read in place
 * from the block pool through each sequence's block table (no gather copy).
 *
 * Layout (same as flash-attn's paged KV): k_cache, v_cache [num_blocks, block_size, kv_heads, D].
 * Sequence b owns query rows cu_q[b] .. cu_q[b+1]-1 (the last qlen tokens of its context of
 * ctx_lens[b] tokens, causal): query i sits at position ctx - qlen + i and sees keys 0..pos.
 * Work item = (sequence, kv head): K/V rows are read once and shared by the G = H / KVH query
 * heads of the group and by all query tokens of the sequence. Scores use fp32; softmax is exact
 * (two passes over a per-item scratch row), output is written in the cache dtype.
 *
 * Built at run time with the system C compiler (-O3 -march=native -fopenmp) and called through
 * ctypes; OpenMP resolves to the libgomp torch already loaded, so the thread pool is shared.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define LOAD_F32(p, i) ((p)[i])
#define STORE_F32(p, i, v) ((p)[i] = (v))
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define STORE_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))

#define MAX_ROWS 256 /* G * qlen per work item */

#define DEFINE_ITEM(NAME, T, LOAD, STORE, DD)                                                        \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *q, int64_t q_stride, const T *kc, const T *vc, T *out, int64_t out_stride,          \
        const int32_t *bt, int ctx, int q0, int qlen, int kh, int H, int KVH, int D_, int BS,        \
        float scale, float *scratch) {                                                               \
        const int D = (DD) > 0 ? (DD) : D_;                                                          \
        const int G = H / KVH;                                                                       \
        const int rows = G * qlen;                                                                   \
        float *qf = scratch;                      /* [rows, D] */                                    \
        float *acc = qf + (int64_t)rows * D;      /* [rows, D] */                                    \
        float *kv = acc + (int64_t)rows * D;      /* [D] */                                          \
        float *s = kv + D;                        /* [rows, ctx] */                                  \
        int lim[MAX_ROWS];                                                                           \
        for (int i = 0; i < qlen; i++)                                                               \
            for (int g = 0; g < G; g++) {                                                            \
                int r = i * G + g;                                                                   \
                const T *qp = q + (int64_t)(q0 + i) * q_stride + (int64_t)(kh * G + g) * D;          \
                for (int d = 0; d < D; d++) qf[(int64_t)r * D + d] = LOAD(qp, d) * scale;            \
                lim[r] = ctx - qlen + i + 1; /* keys [0, lim) visible */                             \
            }                                                                                        \
        const int64_t tok_stride = (int64_t)KVH * D;                                                 \
        for (int j = 0; j < ctx; j++) {                                                              \
            const T *kp = kc + ((int64_t)bt[j / BS] * BS + j % BS) * tok_stride + (int64_t)kh * D;   \
            for (int d = 0; d < D; d++) kv[d] = LOAD(kp, d);                                         \
            for (int r = 0; r < rows; r++) {                                                         \
                const float *qr = qf + (int64_t)r * D;                                               \
                float dot = 0.f;                                                                     \
                for (int d = 0; d < D; d++) dot += qr[d] * kv[d];                                    \
                s[(int64_t)r * ctx + j] = dot;                                                       \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < rows; r++) {                                                             \
            float *sr = s + (int64_t)r * ctx;                                                        \
            float m = -INFINITY;                                                                     \
            for (int j = 0; j < lim[r]; j++) m = sr[j] > m ? sr[j] : m;                              \
            float sum = 0.f;                                                                         \
            for (int j = 0; j < lim[r]; j++) {                                                       \
                sr[j] = expf(sr[j] - m);                                                             \
                sum += sr[j];                                                                        \
            }                                                                                        \
            float inv = 1.f / sum;                                                                   \
            for (int j = 0; j < lim[r]; j++) sr[j] *= inv;                                           \
            for (int j = lim[r]; j < ctx; j++) sr[j] = 0.f;                                          \
            for (int d = 0; d < D; d++) acc[(int64_t)r * D + d] = 0.f;                               \
        }                                                                                            \
        for (int j = 0; j < ctx; j++) {                                                              \
            const T *vp = vc + ((int64_t)bt[j / BS] * BS + j % BS) * tok_stride + (int64_t)kh * D;   \
            for (int d = 0; d < D; d++) kv[d] = LOAD(vp, d);                                         \
            for (int r = 0; r < rows; r++) {                                                         \
                const float p = s[(int64_t)r * ctx + j];                                             \
                float *ar = acc + (int64_t)r * D;                                                    \
                for (int d = 0; d < D; d++) ar[d] += p * kv[d];                                      \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < qlen; i++)                                                               \
            for (int g = 0; g < G; g++) {                                                            \
                int r = i * G + g;                                                                   \
                T *op = out + (int64_t)(q0 + i) * out_stride + (int64_t)(kh * G + g) * D;            \
                for (int d = 0; d < D; d++) STORE(op, d, acc[(int64_t)r * D + d]);                   \
            }                                                                                        \
    }

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                          \
    DEFINE_ITEM(NAME##_d64, T, LOAD, STORE, 64)                                                      \
    DEFINE_ITEM(NAME##_d128, T, LOAD, STORE, 128)                                                    \
    DEFINE_ITEM(NAME##_dany, T, LOAD, STORE, 0)                                                      \
    int NAME(const T *q, int64_t q_stride, const T *kc, const T *vc, T *out, int64_t out_stride,     \
             const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,                   \
             const int32_t *cu_q, int B, int H, int KVH, int D, int BS, float scale) {               \
        int max_ctx = 0, max_q = 0;                                                                  \
        for (int b = 0; b < B; b++) {                                                                \
            if (ctx_lens[b] > max_ctx) max_ctx = ctx_lens[b];                                        \
            if (cu_q[b + 1] - cu_q[b] > max_q) max_q = cu_q[b + 1] - cu_q[b];                        \
        }                                                                                            \
        const int G = H / KVH;                                                                       \
        if (G * max_q > MAX_ROWS) return -1;                                                         \
        const int64_t scratch_len = (int64_t)G * max_q * (2 * D + max_ctx) + D + 16;                 \
        int err = 0;                                                                                 \
        _Pragma("omp parallel")                                                                      \
        {                                                                                            \
            float *scratch = (float *)malloc(sizeof(float) * scratch_len);                           \
            if (!scratch) err = -2;                                                                  \
            _Pragma("omp for schedule(dynamic, 1)")                                                  \
            for (int item = 0; item < B * KVH; item++) {                                             \
                if (!scratch) continue;                                                              \
                int b = item / KVH, kh = item % KVH;                                                 \
                int qlen = cu_q[b + 1] - cu_q[b];                                                    \
                if (qlen <= 0) continue;                                                             \
                const int32_t *bt = block_tables + (int64_t)b * max_blocks;                          \
                if (D == 64)                                                                         \
                    NAME##_d64(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b], qlen, \
                               kh, H, KVH, D, BS, scale, scratch);                                   \
                else if (D == 128)                                                                   \
                    NAME##_d128(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b],      \
                                qlen, kh, H, KVH, D, BS, scale, scratch);                            \
                else                                                                                 \
                    NAME##_dany(q, q_stride, kc, vc, out, out_stride, bt, ctx_lens[b], cu_q[b],      \
                                qlen, kh, H, KVH, D, BS, scale, scratch);                            \
            }                                                                                        \
            free(scratch);                                                                           \
        }                                                                                            \
        return err;                                                                                  \
    }

DEFINE_KERNEL(paged_attention_f32, float, LOAD_F32, STORE_F32)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, LOAD_BF16, STORE_BF16)
