/* float32 GEMM over a pre-packed weight: y[M, N] = x[M, K] @ W^T (+ bias), W given as [N, K].
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
 */
#include "common.h"

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
