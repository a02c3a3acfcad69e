/* LoRA's update of a projection's output over the rows of one adapter (model/models/layers.py
 * Linear._add_lora, and the decoder layers in one call): y[t, c] += round(sum_j (sum_i x[t, i] A[j, i]) Bt[j, c])
 * for the segment's rows t and the shard's columns c, in fp32, the update rounded to the row type once and
 * added there (as torch's `y += delta.to(y.dtype)`). A is [r, k], Bt the adapter's B (scaling folded in)
 * transposed, [r, n]: the update's inner loop runs along a row of Bt, as vectors.
 *
 * Two passes in one parallel region: the rank-r products of each row (x A^T, r dot products of k), then the
 * row's n updates in chunks of columns. Small updates (one row at rank 8 of a small model: a few thousand
 * multiply-adds) run on the calling thread: a parallel region costs more than they do. */
#include "common.h"

#define LORA_COLUMNS 256            /* columns of an update a thread sums at once (its accumulators) */
#define LORA_PARALLEL (1 << 16)     /* multiply-adds below which the call stays on one thread */

#define DEFINE_LORA_ADD(SUFFIX, T)                                                                         \
    int lora_add_##SUFFIX(const T *x, int64_t ldx, int rows, int k, const float *a, int r, const float *bt,  \
                          int n, T *y, int64_t ldy) {                                                      \
        if (rows <= 0 || r <= 0 || n <= 0) return 0;                                                       \
        float *t = malloc(sizeof(float) * (size_t)rows * (size_t)r);                                       \
        if (!t) return -1;                                                                                 \
        const int64_t chunks = (n + LORA_COLUMNS - 1) / LORA_COLUMNS;                                      \
        const int64_t work = (int64_t)rows * r * ((int64_t)k + n);                                         \
        _Pragma("omp parallel num_threads(NT) if (work >= LORA_PARALLEL)")                                 \
        {                                                                                                  \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t p = 0; p < (int64_t)rows * r; p++) {                                              \
                const T *xr = x + (p / r) * ldx;                                                           \
                const float *ar = a + (p % r) * (int64_t)k;                                                \
                float s = 0.f;                                                                             \
                for (int i = 0; i < k; i++) s += get_##SUFFIX(xr, i) * ar[i];                              \
                t[p] = s;                                                                                  \
            }                                                                                              \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t q = 0; q < rows * chunks; q++) {                                                  \
                const int64_t row = q / chunks, c0 = (q % chunks) * LORA_COLUMNS;                          \
                const int64_t c1 = c0 + LORA_COLUMNS < n ? c0 + LORA_COLUMNS : n;                          \
                const float *tr = t + row * r;                                                             \
                float acc[LORA_COLUMNS];                                                                   \
                for (int64_t c = 0; c < c1 - c0; c++) acc[c] = 0.f;                                        \
                for (int j = 0; j < r; j++) {                                                              \
                    const float tj = tr[j];                                                                \
                    const float *b = bt + (int64_t)j * n + c0;                                             \
                    for (int64_t c = 0; c < c1 - c0; c++) acc[c] += tj * b[c];                             \
                }                                                                                          \
                T *yr = y + row * ldy + c0;                                                                \
                for (int64_t c = 0; c < c1 - c0; c++)                                                      \
                    put_##SUFFIX(yr, c, get_##SUFFIX(yr, c) + round_##SUFFIX(acc[c]));                     \
            }                                                                                              \
        }                                                                                                  \
        free(t);                                                                                           \
        return 0;                                                                                          \
    }

DEFINE_LORA_ADD(f32, float)
DEFINE_LORA_ADD(bf16, bf16_t)
