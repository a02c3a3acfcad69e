/* What the packed GEMMs share (gemm.c: fp32 weights; gemm_bf16.c: bf16; gemm_i8w.c and gemm_i8a8.c: int8
 * codes): the panel layout's sizes and the driver that cuts rows into register tiles and threads over
 * panel groups.
 *
 * N is cut into panels of GEMM_NR = 16 columns, padded to a multiple of GEMM_GROUP = 4 panels (zeros).
 * Threads split the panel groups; rows are taken in blocks of GEMM_MBLK so a block of x stays in L2, and
 * each block's rows are cut into tiles and packed per tile (`gemm_kernel.pack_tile`) before any tile
 * reads them.
 */
#ifndef CONSORT_KERNELS_GEMM_H
#define CONSORT_KERNELS_GEMM_H
#include "common.h"

#define GEMM_NR 16
#define GEMM_GROUP 4
#define GEMM_MBLK 240
#define GEMM_SCRATCH_ROWS 12          /* the tallest tile of any build */

/* A register tile: (its rows of x as pack_tile left them, its panels, K, out, ldo (floats per out row),
 * the rows' scales, the panels' column scales, scale_k, scale_ld); row and column scales are NULL where
 * a kernel has none. Column scales come per group of scale_k k (even): those of k in [g * scale_k,
 * (g + 1) * scale_k) are at col_scales + g * scale_ld, one per padded column (scale_k >= K: one row). */
typedef void (*gemm_tile_fn)(const void *restrict, const void *restrict, int64_t, float *restrict, int64_t,
                             const float *restrict, const float *restrict, int64_t, int64_t);

typedef struct {
    const gemm_tile_fn *tiles;         /* by a tile's rows */
    const int *tile_panels;            /* panels one tile call covers, by its rows */
    int (*tile_rows)(int64_t left);    /* the next tile's rows out of `left` */
    /* h rows of x (ldx elements apart), their columns read in `order` (gemm_weight), -> what that tile
     * reads, at dst, and each row's scale (kernels with none leave row_scales alone). wide: K floats of
     * the calling thread's where the kernel `widens`, else NULL. */
    void (*pack_tile)(const void *x, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                      float *row_scales, float *wide);
    int64_t (*row_bytes)(int64_t K);   /* one packed row of x */
    int64_t (*panel_bytes)(int64_t K); /* one panel of W */
    int x_size;                        /* bytes of one element of x: 4 (fp32) or 2 (bf16) */
    int widens;                        /* bf16 rows for a kernel that rounds fp32 ones: pack_tile widens each first */
    /* NULL: y is fp32, written by the tiles (the bias added after). Else y has the kernel's own element
     * type: the tiles write h rows of fp32 sums into a stack tile (ldt floats a row), and this adds the
     * bias (the n columns' own, or NULL) and stores their n columns at row r, column col0 of y. */
    void (*store)(const float *tile, int64_t ldt, int h, int64_t n, const float *bias, void *y, int64_t ldy,
                  int64_t r, int64_t col0);
} gemm_kernel;

/* The next tile's rows out of `left` for tiles of 6, 4, 2 and 1 rows: 6-row tiles, 8 as 4 + 4, then 4,
 * 2, 1 (32 rows = 6+6+6+6+4+4); the AVX2 fp32 tiles' cut and the int8 tiles' (every build). */
static inline int gemm_tile_rows_6421(int64_t left) {
    if (left == 8) return 4;
    return left >= 6 ? 6 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* The next tile's rows out of `left` for tiles of 1-12 rows: up to 12, and 13-23 cut into two near halves
 * (>= 7 and 6); the AVX-512 tiles' cut (fp32 and int8). */
static inline int gemm_tile_rows_12(int64_t left) {
    if (left <= 12) return (int)left;
    if (left < 24) return (int)((left + 1) / 2);
    return 12;
}

/* The AVX-512 tile set both kernels instantiate, cut by gemm_tile_rows_12: 4-12 rows x 2 panels, 1-3 rows
 * x 4 (gemm.c says why). TILE(R, P) defines `<prefix>_tile_RxP`; GEMM_TILES_12(prefix) is the table of
 * them by rows. */
#define GEMM_TILE_SET_12(TILE) TILE(12, 2) TILE(11, 2) TILE(10, 2) TILE(9, 2) TILE(8, 2) TILE(7, 2) \
    TILE(6, 2) TILE(5, 2) TILE(4, 2) TILE(3, 4) TILE(2, 4) TILE(1, 4)
#define GEMM_TILES_12(prefix) {NULL, prefix##_tile_1x4, prefix##_tile_2x4, prefix##_tile_3x4, prefix##_tile_4x2, \
    prefix##_tile_5x2, prefix##_tile_6x2, prefix##_tile_7x2, prefix##_tile_8x2, prefix##_tile_9x2,            \
    prefix##_tile_10x2, prefix##_tile_11x2, prefix##_tile_12x2}
#define GEMM_TILE_PANELS_12 {0, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2}

/* Panels of N's columns, padded to whole groups. */
static inline int64_t gemm_panels(int64_t N) {
    return ((N + GEMM_NR - 1) / GEMM_NR + GEMM_GROUP - 1) / GEMM_GROUP * GEMM_GROUP;
}

#if defined(__AVX2__)
/* A row's absolute maximum, for the kernels that round each row of x to integers (gemm_i8w.c,
 * gemm_i8a8.c); *bad set where the row holds NaN or an infinity. */
static inline float gemm_row_absmax(const float *src, int64_t K, int *bad) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 vmax = _mm256_setzero_ps(), vbad = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(src + k));
        vmax = _mm256_max_ps(vmax, a);
        vbad = _mm256_or_ps(vbad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));    /* NaN or infinite */
    }
    float m[8], amax = 0.0f;
    *bad = _mm256_movemask_ps(vbad) != 0;
    _mm256_storeu_ps(m, vmax);
    for (int j = 0; j < 8; j++) amax = m[j] > amax ? m[j] : amax;
    for (; k < K; k++) {
        const float a = fabsf(src[k]);
        amax = a > amax ? a : amax;
        *bad |= !(a < INFINITY);
    }
    return amax;
}
#endif

/* The integer kernels' epilogues (gemm_i8w.c, gemm_i8a8.c), as macros over a tile's R x V accumulator
 * array so it stays in registers. GEMM_INT_BLOCK_OUT: a block's int32 sums, SUMS(r, v) (each kernel's
 * correction applied), converted and times their group's column scales cs, added into out (stored on the
 * first block, q0 == 0). GEMM_INT_ROW_SCALE: out times each row's scale, once, at the end; the empty asm
 * keeps the compiler's reassociation (-fassociative-math) from multiplying the scales together first in
 * some tiles, which made a row's bits depend on where it sat. */
#define GEMM_INT_BLOCK_OUT(R, V, SUMS, cs, out, ldo, q0)                                                   \
    _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) {                                                \
        const VEC c = VEC_LOADU((cs) + v * VLEN);                                                         \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                            \
            float *o = (out) + r * (ldo) + v * VLEN;                                                      \
            const VEC f = VEC_FROM_I32(SUMS(r, v));                                                       \
            VEC_STOREU(o, (q0) ? VEC_FMA(f, c, VEC_LOADU(o)) : VEC_MUL(f, c));                            \
        }                                                                                                 \
    }
#define GEMM_INT_ROW_SCALE(R, V, out, ldo, row_scales)                                                    \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                \
        const VEC s = VEC_SET1((row_scales)[r]);                                                          \
        _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) {                                            \
            float *o = (out) + r * (ldo) + v * VLEN;                                                      \
            VEC t = VEC_LOADU(o);                                                                         \
            __asm__("" : "+v"(t));                                                                        \
            VEC_STOREU(o, VEC_MUL(t, s));                                                                 \
        }                                                                                                 \
    }

/* A packed weight as the driver hands it on: its panels (`kern`'s layout), its column scales (one per
 * padded column for each group of scale_k k, rows scale_ld floats apart; NULL: none) and the order x's
 * columns are read in (weight column j multiplies x's column order[j]; NULL: in order). */
typedef struct {
    const char *panels;
    const float *col_scales;
    int64_t scale_k, scale_ld;
    const int32_t *order;
} gemm_weight;

#if defined(__AVX2__)
/* K bf16 -> fp32 (exact), for the kernels that round fp32 rows (gemm_i8w.c, gemm_i8a8.c). */
static inline void gemm_widen_bf16(const bf16_t *src, int64_t K, float *dst) {
    int64_t k = 0;
    for (; k + VLEN <= K; k += VLEN) VEC_STOREU(dst + k, VEC_LOAD_BF16(src + k));
    for (; k < K; k++) dst[k] = bf16_to_f32(src[k]);
}
#endif

/* A gemm_kernel's store for bf16 y (gemm.c): h rows of fp32 sums + the bias, each rounded to bf16 once
 * (round to nearest even). */
void gemm_store_bf16(const float *tile, int64_t ldt, int h, int64_t n, const float *bias, void *y, int64_t ldy,
                     int64_t r, int64_t col0);

/* y = x W^T (+ bias), x of kern->x_size bytes an element, y fp32 (or the store's type), ldx and ldy in
 * elements. 0, or -2 when a buffer cannot be allocated (nothing computed). */
int gemm_run(const gemm_kernel *kern, const void *x, int64_t ldx, int64_t M, int64_t K, const gemm_weight *w,
             int64_t N, void *y, int64_t ldy, const float *bias);
#endif
