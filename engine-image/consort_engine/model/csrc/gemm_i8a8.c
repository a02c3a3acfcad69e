/* int8 x int8 GEMM (`--quantization w8a8`, and W8A8 checkpoints' codes): y[M, N] = x[M, K] @ (codes *
 * scale)^T (+ bias), each row of x rounded to int8 with its own scale (absolute maximum at 127), the
 * codes int8 with one fp32 scale per output column and group of k; x and y fp32 (`gemm_i8a8_f32`) or
 * bf16 (`gemm_i8a8_bf16`: each row widened exactly and rounded as an fp32 row is, the output rounded once).
 *
 * Why: VNNI's `vpdpbusd` multiplies four u8 x s8 pairs per int32 lane and adds them to it, twice the
 * products per instruction of the int16 rows of gemm_i8w.c (`vpdpwssd`), for 8 bits of each row instead
 * of 15. It needs u8 activations: each row is stored as x + 128 (1..255), and the sum it gives, sum((x +
 * 128) w), less 128 sum(w) over the block (the codes' column sums, one int32 per column and group, made
 * at pack time), is sum(x w), exactly. Only VNNI builds have it (AVX-512 VNNI: zmm; AVX-VNNI: ymm):
 * without VNNI, `vpmaddubsw` saturates its int16 pair sums at these magnitudes.
 *
 * Packed layout: panels of GEMM_NR = 16 columns grouped as gemm.h says, K taken in quads (four k; K
 * padded with zeros); for quad q a panel holds 64 bytes, column j's four codes at 4j, so one zmm (two
 * ymm) of a panel pairs with a broadcast quad of x. A tile is R rows x P panels of int32 accumulators,
 * one block a scale group (groups of a multiple of 4 k, at most I8A8_MAX_GROUP); a block's sums, less
 * their compensation, converted to fp32, are added times their group's column scales (one FMA), and
 * the row's scale multiplies the total once, at the end. Every build gives the same bits.
 */
#include "gemm.h"

#if defined(__AVX2__) && defined(__FMA__) && \
    ((defined(__AVX512F__) && defined(__AVX512VNNI__)) || (!defined(__AVX512F__) && defined(__AVXVNNI__)))

#define I8A8_QMAX 127.0f
#define I8A8_MAX_GROUP 65536           /* k a block sums in int32: 16,384 quads of |4 x 255 x 128| < 2^31 */

static int64_t i8a8_quads(int64_t K) { return (K + 3) / 4; }
static int64_t i8a8_row_bytes(int64_t K) { return i8a8_quads(K) * (int64_t)sizeof(int32_t); }
static int64_t i8a8_panel_bytes(int64_t K) { return i8a8_quads(K) * 64; }

int64_t gemm_packed_bytes_i8a8_f32(int64_t N, int64_t K) { return gemm_panels(N) * i8a8_panel_bytes(K); }

/* codes [N, K] -> the quad layout (zero past N and past K). */
void gemm_pack_i8a8_f32(const int8_t *w, int64_t N, int64_t K, int8_t *packed) {
    const int64_t Qd = i8a8_quads(K);
    #pragma omp parallel for schedule(static) num_threads(NT)
    for (int64_t p = 0; p < gemm_panels(N); p++)
        for (int64_t q = 0; q < Qd; q++)
            for (int j = 0; j < GEMM_NR; j++)
                for (int e = 0; e < 4; e++) {
                    const int64_t n = p * GEMM_NR + j, k = 4 * q + e;
                    packed[(p * Qd + q) * 64 + j * 4 + e] = n < N && k < K ? w[n * K + k] : 0;
                }
}

#if defined(__AVX512F__)
#define I8A8_ACC __m512i
#define I8A8_ACC_ZERO _mm512_setzero_si512
#define I8A8_CODES(p) _mm512_load_si512((const void *)(p))
#define I8A8_SET1 _mm512_set1_epi32
#define I8A8_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define I8A8_SUB _mm512_sub_epi32
#define I8A8_MADD(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))
#else
#define I8A8_ACC __m256i
#define I8A8_ACC_ZERO _mm256_setzero_si256
#define I8A8_CODES(p) _mm256_load_si256((const __m256i *)(p))
#define I8A8_SET1 _mm256_set1_epi32
#define I8A8_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define I8A8_SUB _mm256_sub_epi32
#define I8A8_MADD(acc, x, w) __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w))
#endif
#define I8A8_VPP (GEMM_NR / VLEN)      /* vectors per panel */
/* a block's sums less their compensation (GEMM_INT_BLOCK_OUT; cp: the group's, in the tile) */
#define I8A8_SUMS(r, v) I8A8_SUB(acc[r][v], I8A8_LOADI(cp + (v) * VLEN))

/* R rows x P panels; x is the tile's rows as quads of u8 (x + 128), row after row ([R][Qd] int32,
 * `i8a8_pack_tile`). col_scales holds the groups' fp32 scales ([G][scale_ld]) and after them their
 * int32 compensations, 128 x each column's code sum over the group ([G][scale_ld]). One block a group. */
#define I8A8_TILE(R, P)                                                                                   \
static void i8a8_tile_##R##x##P(const void *restrict xv, const void *restrict panels, int64_t K,          \
                                float *restrict out, int64_t ldo, const float *restrict row_scales,       \
                                const float *restrict col_scales, int64_t scale_k, int64_t scale_ld) {    \
    enum { V = P * I8A8_VPP };                                                                            \
    const int32_t *restrict x = (const int32_t *)xv;                                                      \
    const int8_t *restrict pw = (const int8_t *)panels;                                                   \
    const int64_t Qd = i8a8_quads(K), ps = i8a8_panel_bytes(K), gq = scale_k / 4;                         \
    const int32_t *restrict comps = (const int32_t *)(col_scales + (K + scale_k - 1) / scale_k * scale_ld); \
    for (int64_t q0 = 0, q1; q0 < Qd; q0 = q1) {                                                          \
        const int64_t g = q0 / gq;                                                                        \
        q1 = (g + 1) * gq < Qd ? (g + 1) * gq : Qd;                                                       \
        const float *restrict cs = col_scales + g * scale_ld;                                             \
        const int32_t *restrict cp = comps + g * scale_ld;                                                \
        I8A8_ACC acc[R][V];                                                                               \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                              \
            _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) acc[r][v] = I8A8_ACC_ZERO();             \
        for (int64_t q = q0; q < q1; q++) {                                                               \
            I8A8_ACC w[V];                                                                                \
            /* the panels after this tile's, into L2 (as the fp32 tiles do, gemm.c) */                    \
            _Pragma("GCC unroll 16") for (int p = 0; p < P; p++)                                          \
                _mm_prefetch((const char *)(pw + (P + p) * ps + q * 64), _MM_HINT_T1);                    \
            _Pragma("GCC unroll 16") for (int v = 0; v < V; v++)                                          \
                w[v] = I8A8_CODES(pw + (v / I8A8_VPP) * ps + q * 64 + (v % I8A8_VPP) * (64 / I8A8_VPP));  \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                        \
                const I8A8_ACC b = I8A8_SET1(x[r * Qd + q]);                                              \
                _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) I8A8_MADD(acc[r][v], b, w[v]);       \
            }                                                                                             \
        }                                                                                                 \
        GEMM_INT_BLOCK_OUT(R, V, I8A8_SUMS, cs, out, ldo, q0)                                             \
    }                                                                                                     \
    GEMM_INT_ROW_SCALE(R, V, out, ldo, row_scales)                                                        \
}

#if defined(__AVX512F__)
GEMM_TILE_SET_12(I8A8_TILE)
static const gemm_tile_fn I8A8_TILES[13] = GEMM_TILES_12(i8a8);
static const int I8A8_TILE_PANELS[13] = GEMM_TILE_PANELS_12;
#define I8A8_TILE_ROWS gemm_tile_rows_12
#else
/* the int16 kernel's ymm tiles (gemm_i8w.c): 6 and 4 rows x one panel, 2 and 1 x two */
I8A8_TILE(6, 1) I8A8_TILE(4, 1) I8A8_TILE(2, 2) I8A8_TILE(1, 2)
static const gemm_tile_fn I8A8_TILES[7] = {NULL, i8a8_tile_1x2, i8a8_tile_2x2, NULL, i8a8_tile_4x1, NULL,
                                           i8a8_tile_6x1};
static const int I8A8_TILE_PANELS[7] = {0, 2, 2, 0, 1, 0, 1};
#define I8A8_TILE_ROWS gemm_tile_rows_6421
#endif

/* One row: x[k] * inv rounded to int8 (round to nearest even), stored + 128 as u8 quads into quads[0,
 * Qd): vector for whole blocks of 32 k, scalar for the rest, 128 (a zero) past K. */
static void i8a8_round_quads(const float *src, int64_t K, float inv, int32_t *quads) {
    const __m256 s = _mm256_set1_ps(inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), offset = _mm256_set1_epi8((char)0x80);
    uint8_t *out = (uint8_t *)quads;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k + 8 * i), s));
        /* packs work per 128-bit lane: the bytes come as [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7] in
           4-byte groups; the permute puts them back in k order; x + 128 is x ^ 0x80 on a byte */
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(out + k), _mm256_xor_si256(_mm256_permutevar8x32_epi32(b, order), offset));
    }
    for (; k < K; k++) out[k] = (uint8_t)(lrintf(src[k] * inv) + 128);
    for (; k % 4; k++) out[k] = 128;
}

/* h rows -> u8 quads, row after row ([h][Qd] int32), each row rounded with its own scale (absolute
 * maximum / 127; gemm_row_absmax). A row holding NaN or an infinity gets a NaN scale, so its outputs are
 * NaN as the fp32 product's would be. `order` is not taken (act-order is an int4 format's). */
static void i8a8_pack_tile(const void *xv, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                           float *row_scales, float *wide) {
    const float *x = xv;
    int32_t *xp = dst;
    (void)order, (void)wide;
    for (int i = 0; i < h; i++) {
        int bad;
        const float amax = gemm_row_absmax(x + i * ldx, K, &bad);
        const float inv = amax > 0.0f && !bad ? I8A8_QMAX / amax : 0.0f;
        row_scales[i] = bad ? NAN : amax / I8A8_QMAX;
        i8a8_round_quads(x + i * ldx, K, inv, xp + i * i8a8_quads(K));
    }
}

/* bf16 rows: each widened into the thread's fp32 row (exactly), then rounded as an fp32 row is. */
static void i8a8_pack_tile_bf16(const void *xv, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                                float *row_scales, float *wide) {
    for (int i = 0; i < h; i++) {
        gemm_widen_bf16((const bf16_t *)xv + i * ldx, K, wide);
        i8a8_pack_tile(wide, K, 1, K, order, (int32_t *)dst + i * i8a8_quads(K), row_scales + i, NULL);
    }
}

static const gemm_kernel GEMM_I8A8 = {I8A8_TILES, I8A8_TILE_PANELS, I8A8_TILE_ROWS, i8a8_pack_tile,
                                      i8a8_row_bytes, i8a8_panel_bytes, sizeof(float), 0, NULL};
/* bf16 x and y: the same sums, the output (+ bias) rounded to bf16 once */
static const gemm_kernel GEMM_I8A8_BF16 = {I8A8_TILES, I8A8_TILE_PANELS, I8A8_TILE_ROWS, i8a8_pack_tile_bf16,
                                           i8a8_row_bytes, i8a8_panel_bytes, sizeof(bf16_t), 1, gemm_store_bf16};

static int i8a8_run(const gemm_kernel *kern, const void *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes,
                    const float *scales, int64_t group, int64_t N, void *y, int64_t ldy, const float *bias) {
    if (group <= 0 || group % 4 || (group < K ? group : K) > I8A8_MAX_GROUP) return -1;
    const gemm_weight w = {(const char *)codes, scales, group, gemm_packed_bytes_i8a8_f32(N, K) / (4 * i8a8_quads(K)),
                           NULL};
    return gemm_run(kern, x, ldx, M, K, &w, N, y, ldy, bias);
}

/* `scales` holds, for each group of `group` k (a multiple of 4, at most I8A8_MAX_GROUP; K or more: one
 * group), one float per packed column (gemm_packed_bytes_i8a8_f32(N, K) / (K rounded up to 4) of them;
 * zero past N), the groups' rows one after another, and after them, laid out the same, each group's
 * int32 compensation: 128 x the column's code sum over the group. -1 for a group it cannot take. */
int gemm_i8a8_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                  int64_t group, int64_t N, float *y, int64_t ldy, const float *bias) {
    return i8a8_run(&GEMM_I8A8, x, ldx, M, K, codes, scales, group, N, y, ldy, bias);
}

/* The same with bf16 x and y (the weight packed as for gemm_i8a8_f32). */
int gemm_i8a8_bf16(const bf16_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                   int64_t group, int64_t N, bf16_t *y, int64_t ldy, const float *bias) {
    return i8a8_run(&GEMM_I8A8_BF16, x, ldx, M, K, codes, scales, group, N, y, ldy, bias);
}
#endif
