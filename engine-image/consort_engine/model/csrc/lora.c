/* LoRA's update of a projection's output over the rows of one adapter (model/models/layers.py
 * Linear._add_lora, and the decoder layers in one call): y[t, c] += round(sum_j (sum_i x[t, i] A[j, i]) Bt[j, c])
 * for the segment's rows t and the shard's columns c, in fp32, the update rounded to the row type once and
 * added there (as torch's `y += delta.to(y.dtype)`). A is [r, k], Bt the adapter's B (scaling folded in)
 * transposed, [r, n]: the update's inner loop runs along a row of Bt, as vectors.
 *
 * Two passes in one parallel region, each over tiles of LORA_ROWS rows (6 with AVX-512, 2 with AVX2: what the
 * registers hold): the rank-r products T = x A^T (a tile: its rows x 4 of the rank, vector sums along k, each x
 * and A vector loaded once for several multiply-adds), then the update T Bt (a tile: its rows x 4 vectors of
 * columns, each Bt vector loaded once for all its rows). A row at a
 * time the two passes ran at ~9 GFLOP/s on Zen 4, a third of the matmuls' pace at 512 rows. Every element of
 * T and of the update is one tile's, so the sums do not depend on the team size, nor on which other jobs share
 * the call. lora_jobs takes several updates at once (every segment and shard of a projection in a step, from
 * the decoder layers' one call): one parallel region for all of them, their tiles spread over the team, where a
 * decode step's segment alone is too small to split. Small calls (one row at rank 8 of a small model: a few
 * thousand multiply-adds) run on the calling thread: a parallel region costs more than they do. */
#include "common.h"
#include "lora.h"

#define LORA_PARALLEL (1 << 16)     /* multiply-adds below which the call stays on one thread */
#if defined(VEC)
#define LORA_COLS (4 * VLEN)        /* columns of an update tile */
/* rows of a tile: its sums (rows x 4) and the 5 vectors they take in stay in registers, 32 with AVX-512 */
#if defined(__AVX512F__)
#define LORA_ROWS 6
#else
#define LORA_ROWS 2
#endif
#define LOAD_f32(p) VEC_LOADU(p)
#define LOAD_bf16(p) VEC_LOAD_BF16(p)

/* out[q][j] = x row q . A row j over k, for NR rows xs and 4 rows of A (repeats stand in where fewer). */
#define DEFINE_SHRINK_TILE(SUFFIX, T, NAME, NR)                                                                  \
    static void shrink_##NAME##_##SUFFIX(const T *const *xs, const float *const *as, int k,               \
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
#define DEFINE_EXPAND_TILE(NAME, NR)                                                                             \
    static void expand_##NAME(const float *const *ts, int r, const float *bt, int64_t n, int64_t c0,       \
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
#define LORA_ROWS 4
#define DEFINE_SHRINK_TILE(SUFFIX, T, NAME, NR)                                                                  \
    static void shrink_##NAME##_##SUFFIX(const T *const *xs, const float *const *as, int k,               \
                                           float out[][4]) {                                               \
        for (int q = 0; q < NR; q++)                                                                       \
            for (int j = 0; j < 4; j++) {                                                                  \
                float s = 0.f;                                                                             \
                for (int e = 0; e < k; e++) s += get_##SUFFIX(xs[q], e) * as[j][e];                        \
                out[q][j] = s;                                                                             \
            }                                                                                              \
    }

#define DEFINE_EXPAND_TILE(NAME, NR)                                                                             \
    static void expand_##NAME(const float *const *ts, int r, const float *bt, int64_t n, int64_t c0,       \
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

DEFINE_EXPAND_TILE(rows, LORA_ROWS)
DEFINE_EXPAND_TILE(row, 1)

/* Update tile: rows ts (nr: LORA_ROWS or 1) x columns c0 .. c0 + width of the update, into out. */
static void expand(const float *const *ts, int nr, int r, const float *bt, int64_t n, int64_t c0, int64_t width,
                   float out[][LORA_COLS]) {
    if (width < LORA_COLS)
        expand_cols(ts, nr, r, bt, n, c0, width, out);
    else if (nr == LORA_ROWS)
        expand_rows(ts, r, bt, n, c0, out);
    else
        expand_row(ts, r, bt, n, c0, out);
}

/* The work items of a call's jobs, counted across them: item p of a pass is job j's item p - first[j]
 * (first[j] <= p < first[j + 1]). */
static int job_of(const int64_t *first, int n_jobs, int64_t p) {
    int lo = 0, hi = n_jobs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* A tile of a job's rows [r0, r0 + LORA_ROWS): all at once where the job has them, else its last rows one at a
 * time (a decode step's segment is often a few rows: a full tile would do their work several times over). Its item p:
 * shrink, row tile p / rank tiles and rank tile p % rank tiles; expand, column tile p / row tiles and row tile
 * p % row tiles (a column tile's Bt rows stay in cache across the row tiles). */
#define DEFINE_LORA_JOBS(SUFFIX, T)                                                                        \
    DEFINE_SHRINK_TILE(SUFFIX, T, rows, LORA_ROWS)                                                         \
    DEFINE_SHRINK_TILE(SUFFIX, T, row, 1)                                                                  \
    static void shrink_item_##SUFFIX(const lora_job_t *J, int64_t p, float *t) {                           \
        const T *x = J->x;                                                                                 \
        const int64_t rows = J->rows, r = J->r, k = J->k, rank_tiles = (r + 3) / 4;                        \
        const int64_t r0 = p / rank_tiles * LORA_ROWS, j0 = p % rank_tiles * 4;                            \
        const int64_t r1 = min64(r0 + LORA_ROWS, rows);                                                    \
        const float *as[4];                                                                                \
        for (int j = 0; j < 4; j++) as[j] = J->a + min64(j0 + j, r - 1) * k;                               \
        for (int64_t q0 = r0; q0 < r1;) {                                                                  \
            const int nr = r1 - q0 == LORA_ROWS ? LORA_ROWS : 1;                                           \
            const T *xs[LORA_ROWS];                                                                        \
            for (int q = 0; q < LORA_ROWS; q++) xs[q] = x + min64(q0 + q, rows - 1) * J->ldx;              \
            float out[LORA_ROWS][4];                                                                       \
            if (nr == LORA_ROWS)                                                                           \
                shrink_rows_##SUFFIX(xs, as, (int)k, out);                                                 \
            else                                                                                           \
                shrink_row_##SUFFIX(xs, as, (int)k, out);                                                  \
            for (int q = 0; q < nr; q++)                                                                   \
                for (int j = 0; j < 4 && j0 + j < r; j++) t[(q0 + q) * r + j0 + j] = out[q][j];            \
            q0 += nr;                                                                                      \
        }                                                                                                  \
    }                                                                                                      \
    static void expand_item_##SUFFIX(const lora_job_t *J, int64_t p, const float *t) {                     \
        const int64_t rows = J->rows, r = J->r, n = J->n, row_tiles = (rows + LORA_ROWS - 1) / LORA_ROWS;  \
        const int64_t c0 = p / row_tiles * LORA_COLS, r0 = p % row_tiles * LORA_ROWS;                      \
        const int64_t r1 = min64(r0 + LORA_ROWS, rows);                                                    \
        const int64_t width = min64(LORA_COLS, n - c0);                                                    \
        for (int64_t q0 = r0; q0 < r1;) {                                                                  \
            const int nr = r1 - q0 == LORA_ROWS ? LORA_ROWS : 1;                                           \
            const float *ts[LORA_ROWS];                                                                    \
            for (int q = 0; q < LORA_ROWS; q++) ts[q] = t + min64(q0 + q, rows - 1) * r;                   \
            float out[LORA_ROWS][LORA_COLS];                                                               \
            expand(ts, nr, (int)r, J->bt, n, c0, width, out);                                              \
            for (int q = 0; q < nr; q++) {                                                                 \
                T *yr = (T *)J->y + (q0 + q) * J->ldy + c0;                                                \
                for (int64_t c = 0; c < width; c++)                                                        \
                    put_##SUFFIX(yr, c, get_##SUFFIX(yr, c) + round_##SUFFIX(out[q][c]));                 \
            }                                                                                              \
            q0 += nr;                                                                                      \
        }                                                                                                  \
    }                                                                                                      \
    int lora_jobs_##SUFFIX(const lora_job_t *jobs, int n_jobs) {                                           \
        if (n_jobs <= 0) return 0;                                                                         \
        int64_t *first = malloc(sizeof(int64_t) * 3 * (size_t)(n_jobs + 1));                               \
        if (!first) return -1;                                                                             \
        int64_t *shrink_first = first, *expand_first = first + n_jobs + 1, *t_first = expand_first + n_jobs + 1; \
        int64_t work = 0;                                                                                  \
        shrink_first[0] = expand_first[0] = t_first[0] = 0;                                                \
        for (int j = 0; j < n_jobs; j++) {                                                                 \
            const lora_job_t *J = jobs + j;                                                                \
            const int64_t rows = J->rows > 0 && J->r > 0 && J->n > 0 ? J->rows : 0;   /* 0: nothing to do */ \
            const int64_t row_tiles = (rows + LORA_ROWS - 1) / LORA_ROWS;                                  \
            shrink_first[j + 1] = shrink_first[j] + row_tiles * ((J->r + 3) / 4);                          \
            expand_first[j + 1] = expand_first[j] + row_tiles * ((J->n + LORA_COLS - 1) / LORA_COLS);      \
            t_first[j + 1] = t_first[j] + rows * J->r;                                                     \
            work += rows * J->r * (J->k + J->n);                                                           \
        }                                                                                                  \
        float *t = malloc(sizeof(float) * (size_t)(t_first[n_jobs] > 0 ? t_first[n_jobs] : 1));           \
        if (!t) {                                                                                          \
            free(first);                                                                                   \
            return -1;                                                                                     \
        }                                                                                                  \
        _Pragma("omp parallel num_threads(NT) if (work >= LORA_PARALLEL)")                                 \
        {                                                                                                  \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t p = 0; p < shrink_first[n_jobs]; p++) {                                           \
                const int j = job_of(shrink_first, n_jobs, p);                                             \
                shrink_item_##SUFFIX(jobs + j, p - shrink_first[j], t + t_first[j]);                       \
            }                                                                                              \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t p = 0; p < expand_first[n_jobs]; p++) {                                           \
                const int j = job_of(expand_first, n_jobs, p);                                             \
                expand_item_##SUFFIX(jobs + j, p - expand_first[j], t + t_first[j]);                       \
            }                                                                                              \
        }                                                                                                  \
        free(t);                                                                                           \
        free(first);                                                                                       \
        return 0;                                                                                          \
    }                                                                                                      \
    int lora_add_##SUFFIX(const T *x, int64_t ldx, int rows, int k, const float *a, int r, const float *bt,  \
                          int n, T *y, int64_t ldy) {                                                      \
        const lora_job_t job = {x, ldx, rows, k, a, bt, r, n, y, ldy};                                     \
        return lora_jobs_##SUFFIX(&job, 1);                                                                \
    }

DEFINE_LORA_JOBS(f32, float)
DEFINE_LORA_JOBS(bf16, bf16_t)
