/* bf16 GEMM over a pre-packed weight: y[M, N] = x[M, K] @ W^T (+ bias), x, W and y bf16, the bias fp32.
 *
 * Why our own: oneDNN's packed bf16 GEMM, what a bf16 model runs on elsewhere, reaches the bf16 dot
 * product's peak only from a few hundred rows; at a decode step's 1-32 rows it runs at 6-76% of its
 * 2,048-row rate (hack/gemm_backends.py --bf16), and it builds (JIT-compiles) a new kernel the first
 * time it sees a row count. This is the int8 kernels' register tiles (gemm_i8w.c) on AVX-512 BF16's
 * `vdpbf16ps`: each fp32 lane adds two bf16 products, a panel's 16 columns in one zmm.
 *
 * Packed layout: panels of GEMM_NR = 16 columns grouped as gemm.h says, K taken in pairs (an odd K ends
 * with a zero); for k pair q a panel holds 64 bytes, column j's two bf16 side by side at 4j, so one zmm
 * load of a panel pairs with a broadcast pair of x: a row of bf16 is its pairs already, and each tile's
 * rows are copied pair-major. A tile is R rows x P panels of fp32 accumulators over the whole of K; the
 * driver's store (gemm_store_bf16) adds the bias and rounds each output to bf16 once (round to nearest
 * even), as F.linear does. The products are exact in fp32 and summed in k order,
 * each pair's odd k first (the instruction's order); `vdpbf16ps` treats bf16 subnormals as zero, as
 * oneDNN's kernels on it do.
 */
#include "gemm.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

static int64_t b16_pairs(int64_t K) { return (K + 1) / 2; }
static int64_t b16_row_bytes(int64_t K) { return b16_pairs(K) * (int64_t)sizeof(int32_t); }
static int64_t b16_panel_bytes(int64_t K) { return b16_pairs(K) * 64; }

int64_t gemm_packed_bytes_bf16(int64_t N, int64_t K) { return gemm_panels(N) * b16_panel_bytes(K); }

/* W [N, K] bf16 -> the pair layout (zero past N and past K). */
void gemm_pack_bf16(const bf16_t *w, int64_t N, int64_t K, bf16_t *packed) {
    const int64_t Q = b16_pairs(K);
    #pragma omp parallel for schedule(static) num_threads(NT)
    for (int64_t p = 0; p < gemm_panels(N); p++)
        for (int64_t q = 0; q < Q; q++)
            for (int j = 0; j < GEMM_NR; j++)
                for (int e = 0; e < 2; e++) {
                    const int64_t n = p * GEMM_NR + j, k = 2 * q + e;
                    packed[((p * Q + q) * GEMM_NR + j) * 2 + e] = n < N && k < K ? w[n * K + k] : 0;
                }
}

/* acc += the pairwise products of w and b, as one asm statement: the register allocator then keeps the
 * accumulators in registers, as it does for an FMA (gemm_i8w.c says what the intrinsic did). */
#define B16_DOT(acc, w, b) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(b))

/* R rows x P panels (one zmm accumulator a panel per row); x is the tile's rows as pairs of bf16,
 * pair-major ([Q][R] int32, `b16_pack_tile`), out [R][P * 16] fp32 (ldo floats a row). */
#define B16_TILE(R, P)                                                                                    \
static void b16_tile_##R##x##P(const void *restrict xv, const void *restrict panels, int64_t K,           \
                               float *restrict out, int64_t ldo, const float *restrict row_scales,        \
                               const float *restrict col_scales, int64_t scale_k, int64_t scale_ld) {     \
    const int32_t *restrict x = (const int32_t *)xv;                                                      \
    const char *restrict pw = (const char *)panels;                                                       \
    const int64_t Q = b16_pairs(K), ps = b16_panel_bytes(K);                                              \
    (void)row_scales, (void)col_scales, (void)scale_k, (void)scale_ld;                                    \
    __m512 acc[R][P];                                                                                     \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();             \
    for (int64_t q = 0; q < Q; q++) {                                                                     \
        __m512 w[P];                                                                                      \
        /* the panels after this tile's, into L2 (as the fp32 tiles do, gemm.c) */                        \
        _Pragma("GCC unroll 16") for (int p = 0; p < P; p++)                                              \
            _mm_prefetch(pw + (P + p) * ps + q * 64, _MM_HINT_T1);                                        \
        _Pragma("GCC unroll 16") for (int p = 0; p < P; p++)                                              \
            w[p] = _mm512_load_ps((const float *)(pw + p * ps + q * 64));                                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                            \
            const __m512 b = _mm512_castsi512_ps(_mm512_set1_epi32(x[q * R + r]));                       \
            _Pragma("GCC unroll 16") for (int p = 0; p < P; p++) B16_DOT(acc[r][p], w[p], b);             \
        }                                                                                                 \
    }                                                                                                     \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int p = 0; p < P; p++)                                              \
            _mm512_storeu_ps(out + r * ldo + p * GEMM_NR, acc[r][p]);                                     \
}

/* The fp32 AVX-512 tiles' set (gemm.h): up to 24 zmm accumulators + 2 panels + a broadcast. */
GEMM_TILE_SET_12(B16_TILE)
static const gemm_tile_fn B16_TILES[13] = GEMM_TILES_12(b16);
static const int B16_TILE_PANELS[13] = GEMM_TILE_PANELS_12;

/* h rows of bf16 -> their pairs, pair-major ([Q][h] int32, an odd K's last pair ending with a zero), so a
 * tile's broadcasts read one stream (as gemm.c packs its tiles). */
static void b16_pack_tile(const void *xv, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                          float *row_scales, float *wide) {
    const bf16_t *x = xv;
    int32_t *xp = dst;
    const int64_t Q = b16_pairs(K);
    (void)order, (void)row_scales, (void)wide;
    for (int i = 0; i < h; i++) {
        const bf16_t *row = x + i * ldx;
        for (int64_t q = 0; q < K / 2; q++) memcpy(xp + q * h + i, row + 2 * q, sizeof(int32_t));
        if (K % 2) xp[(Q - 1) * h + i] = row[K - 1];      /* the low half: k = K - 1; the high half zero */
    }
}

static const gemm_kernel GEMM_BF16 = {B16_TILES, B16_TILE_PANELS, gemm_tile_rows_12, b16_pack_tile, b16_row_bytes,
                                      b16_panel_bytes, sizeof(bf16_t), 0, gemm_store_bf16};

int gemm_bf16(const bf16_t *x, int64_t ldx, int64_t M, int64_t K, const bf16_t *packed, int64_t N, bf16_t *y,
              int64_t ldy, const float *bias) {
    const gemm_weight w = {(const char *)packed, NULL, 0, 0, NULL};
    return gemm_run(&GEMM_BF16, x, ldx, M, K, &w, N, y, ldy, bias);
}
#endif
