/* LoRA's update of a projection's output over the rows of one adapter (model/models/layers.py
 * Linear._add_lora, and the decoder layers in one call): y[t, c] += round(sum_j (sum_i x[t, i] A[j, i]) Bt[j, c])
 * for the segment's rows t and the shard's columns c, in fp32, the update rounded to the row type once and
 * added there (as torch's `y += delta.to(y.dtype)`). A is [r, k], Bt the adapter's B (scaling folded in)
 * transposed, [r, n]: the update's inner loop runs along a row of Bt, as vectors.
 *
 * Two passes in one parallel region, each over tiles of 4 rows: the rank-r products T = x A^T (a tile: 4 rows
 * x 4 of the rank, 16 vector sums along k, each x and A vector loaded once for 4 multiply-adds), then the
 * update T Bt (a tile: 4 rows x 4 vectors of columns, each Bt vector loaded once for the 4 rows). A row at a
 * time the two passes ran at ~9 GFLOP/s on Zen 4, a third of the matmuls' pace at 512 rows. Every element of
 * T and of the update is one tile's, so the sums do not depend on the team size. Small updates (one row at
 * rank 8 of a small model: a few thousand multiply-adds) run on the calling thread: a parallel region costs
 * more than they do. */
#include "common.h"

#define LORA_PARALLEL (1 << 16)     /* multiply-adds below which the call stays on one thread */
#if defined(VEC)
#define LORA_COLS (4 * VLEN)        /* columns of an update tile */
#define LOAD_f32(p) VEC_LOADU(p)
#define LOAD_bf16(p) VEC_LOAD_BF16(p)

/* out[q][j] = x row q . A row j over k, for NR rows xs and 4 rows of A (repeats stand in where fewer). */
#define DEFINE_SHRINK_TILE(SUFFIX, T, NR)                                                                  \
    static void shrink_tile##NR##_##SUFFIX(const T *const *xs, const float *const *as, int k,             \
                                           float out[][4]) {                                               \
        VEC acc[NR][4];                                                                                    \
        for (int q = 0; q < NR; q++)                                                                       \
            for (int j = 0; j < 4; j++) acc[q][j] = VEC_ZERO();                                            \
        int i = 0;                                                                                         \
        for (; i + VLEN <= k; i += VLEN) {                                                                 \
            VEC av[4];                                                                                     \
            for (int j = 0; j < 4; j++) av[j] = VEC_LOADU(as[j] + i);                                      \
            for (int q = 0; q < NR; q++) {                                                                 \
                const VEC xv = LOAD_##SUFFIX(xs[q] + i);                                                   \
                for (int j = 0; j < 4; j++) acc[q][j] = VEC_FMA(xv, av[j], acc[q][j]);                     \
            }                                                                                              \
        }                                                                                                  \
        for (int q = 0; q < NR; q++)                                                                       \
            for (int j = 0; j < 4; j++) {                                                                  \
                float s = vec_hsum(acc[q][j]);                                                             \
                for (int e = i; e < k; e++) s += get_##SUFFIX(xs[q], e) * as[j][e];                        \
                out[q][j] = s;                                                                             \
            }                                                                                              \
    }

/* out[q][c] = T row q . Bt column c0 + c, for NR rows and LORA_COLS columns (all inside n). */
#define DEFINE_EXPAND_TILE(NR)                                                                             \
    static void expand_tile##NR(const float *const *ts, int r, const float *bt, int64_t n, int64_t c0,     \
                                float out[][LORA_COLS]) {                                                  \
        VEC acc[NR][4];                                                                                    \
        for (int q = 0; q < NR; q++)                                                                       \
            for (int v = 0; v < 4; v++) acc[q][v] = VEC_ZERO();                                            \
        for (int j = 0; j < r; j++) {                                                                      \
            const float *b = bt + (int64_t)j * n + c0;                                                     \
            VEC bv[4];                                                                                     \
            for (int v = 0; v < 4; v++) bv[v] = VEC_LOADU(b + v * VLEN);                                   \
            for (int q = 0; q < NR; q++) {                                                                 \
                const VEC tv = VEC_SET1(ts[q][j]);                                                         \
                for (int v = 0; v < 4; v++) acc[q][v] = VEC_FMA(tv, bv[v], acc[q][v]);                    \
            }                                                                                              \
        }                                                                                                  \
        for (int q = 0; q < NR; q++)                                                                       \
            for (int v = 0; v < 4; v++) VEC_STOREU(out[q] + v * VLEN, acc[q][v]);                          \
    }
#else
#define LORA_COLS 32
#define DEFINE_SHRINK_TILE(SUFFIX, T, NR)                                                                  \
    static void shrink_tile##NR##_##SUFFIX(const T *const *xs, const float *const *as, int k,             \
                                           float out[][4]) {                                               \
        for (int q = 0; q < NR; q++)                                                                       \
            for (int j = 0; j < 4; j++) {                                                                  \
                float s = 0.f;                                                                             \
                for (int e = 0; e < k; e++) s += get_##SUFFIX(xs[q], e) * as[j][e];                        \
                out[q][j] = s;                                                                             \
            }                                                                                              \
    }

#define DEFINE_EXPAND_TILE(NR)                                                                             \
    static void expand_tile##NR(const float *const *ts, int r, const float *bt, int64_t n, int64_t c0,     \
                                float out[][LORA_COLS]) {                                                  \
        expand_cols(ts, NR, r, bt, n, c0, LORA_COLS, out);                                                 \
    }
#endif

/* The sums of an update tile one row at a time (any width): builds without vectors, and the last columns,
 * fewer than LORA_COLS. */
static void expand_cols(const float *const *ts, int nr, int r, const float *bt, int64_t n, int64_t c0,
                        int64_t width, float out[][LORA_COLS]) {
    for (int q = 0; q < nr; q++) {
        for (int64_t c = 0; c < width; c++) out[q][c] = 0.f;
        for (int j = 0; j < r; j++)
            for (int64_t c = 0; c < width; c++) out[q][c] += ts[q][j] * bt[(int64_t)j * n + c0 + c];
    }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

DEFINE_EXPAND_TILE(4)
DEFINE_EXPAND_TILE(1)

/* Update tile: rows ts (nr: 4 or 1) x columns c0 .. c0 + width of the update, into out. */
static void expand(const float *const *ts, int nr, int r, const float *bt, int64_t n, int64_t c0, int64_t width,
                   float out[][LORA_COLS]) {
    if (width < LORA_COLS)
        expand_cols(ts, nr, r, bt, n, c0, width, out);
    else if (nr == 4)
        expand_tile4(ts, r, bt, n, c0, out);
    else
        expand_tile1(ts, r, bt, n, c0, out);
}

/* A tile of the step's rows [r0, r0 + 4): all 4 at once where the segment has them, else its last rows one at a
 * time (a decode step's segment is often 1-3 rows: a 4-row tile would do their work four times over). */
#define DEFINE_LORA_ADD(SUFFIX, T)                                                                         \
    DEFINE_SHRINK_TILE(SUFFIX, T, 4)                                                                       \
    DEFINE_SHRINK_TILE(SUFFIX, T, 1)                                                                       \
    int lora_add_##SUFFIX(const T *x, int64_t ldx, int rows, int k, const float *a, int r, const float *bt,  \
                          int n, T *y, int64_t ldy) {                                                      \
        if (rows <= 0 || r <= 0 || n <= 0) return 0;                                                       \
        float *t = malloc(sizeof(float) * (size_t)rows * (size_t)r);                                       \
        if (!t) return -1;                                                                                 \
        const int64_t row_tiles = (rows + 3) / 4, rank_tiles = (r + 3) / 4;                                \
        const int64_t col_tiles = (n + LORA_COLS - 1) / LORA_COLS;                                         \
        const int64_t work = (int64_t)rows * r * ((int64_t)k + n);                                         \
        _Pragma("omp parallel num_threads(NT) if (work >= LORA_PARALLEL)")                                 \
        {                                                                                                  \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t p = 0; p < row_tiles * rank_tiles; p++) {                                         \
                const int64_t r0 = p / rank_tiles * 4, j0 = p % rank_tiles * 4, r1 = min64(r0 + 4, rows);  \
                const float *as[4];                                                                        \
                for (int j = 0; j < 4; j++) as[j] = a + min64(j0 + j, r - 1) * k;                          \
                for (int64_t q0 = r0; q0 < r1;) {                                                          \
                    const int nr = r1 - q0 == 4 ? 4 : 1;                                                   \
                    const T *xs[4];                                                                        \
                    for (int q = 0; q < 4; q++) xs[q] = x + min64(q0 + q, rows - 1) * ldx;                 \
                    float out[4][4];                                                                       \
                    if (nr == 4)                                                                           \
                        shrink_tile4_##SUFFIX(xs, as, k, out);                                             \
                    else                                                                                   \
                        shrink_tile1_##SUFFIX(xs, as, k, out);                                             \
                    for (int q = 0; q < nr; q++)                                                           \
                        for (int j = 0; j < 4 && j0 + j < r; j++) t[(q0 + q) * r + j0 + j] = out[q][j];    \
                    q0 += nr;                                                                              \
                }                                                                                          \
            }                                                                                              \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t p = 0; p < row_tiles * col_tiles; p++) {                                          \
                const int64_t c0 = p / row_tiles * LORA_COLS, r0 = p % row_tiles * 4, r1 = min64(r0 + 4, rows); \
                const int64_t width = min64(LORA_COLS, n - c0);                                            \
                for (int64_t q0 = r0; q0 < r1;) {                                                          \
                    const int nr = r1 - q0 == 4 ? 4 : 1;                                                   \
                    const float *ts[4];                                                                    \
                    for (int q = 0; q < 4; q++) ts[q] = t + min64(q0 + q, rows - 1) * r;                   \
                    float out[4][LORA_COLS];                                                               \
                    expand(ts, nr, r, bt, n, c0, width, out);                                              \
                    for (int q = 0; q < nr; q++) {                                                         \
                        T *yr = y + (q0 + q) * ldy + c0;                                                   \
                        for (int64_t c = 0; c < width; c++)                                                \
                            put_##SUFFIX(yr, c, get_##SUFFIX(yr, c) + round_##SUFFIX(out[q][c]));         \
                    }                                                                                      \
                    q0 += nr;                                                                              \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        free(t);                                                                                           \
        return 0;                                                                                          \
    }

DEFINE_LORA_ADD(f32, float)
DEFINE_LORA_ADD(bf16, bf16_t)
