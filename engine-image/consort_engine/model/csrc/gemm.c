/* float32 GEMM over a pre-packed weight: y[M, N] = x[M, K] @ W^T (+ bias), W given as [N, K].
 *
 * Why our own: a decode step is a handful of GEMMs at 1-64 rows, where oneDNN's packed inner product
 * falls well short of what it does at 2,048 rows (Zen 3: 55-70%; Zen 4: ~80% at 32 rows, ~40% at 8),
 * while a register-blocked FMA kernel over a panel layout keeps the FMA pipes fed at small row counts
 * (hack/gemm_backends.py; the step's GEMMs in docs/engine-speed.md).
 *
 * Packed layout (panels and groups: gemm.h): panel p holds W[p*16 + j][k] at p*K*16 + k*16 + j, so the
 * kernel streams one 64-byte line of W per k. A register tile is R rows x V panels with R*V (AVX-512: one zmm
 * per panel row) or 2*R*V (AVX2: two ymm) accumulators, the W loads shared by the rows. Every tile
 * keeps enough independent FMA chains in flight to cover the FMA latency (4 cycles: 8 ymm chains for
 * two 256-bit pipes; 4 zmm chains, a zmm FMA taking both pipes on Zen 4): few rows take more panels
 * per tile. `GEMM_TILE_ROWS` cuts the rows with no padded rows. This file also holds the driver both
 * GEMMs run through (`gemm_run`). Each output is one k-ordered fp32 FMA chain (differs from F.linear by summation order only).
 */
#include "gemm.h"

#if defined(__AVX2__) && defined(__FMA__)

int64_t gemm_packed_floats_f32(int64_t N, int64_t K) { return gemm_panels(N) * K * GEMM_NR; }

/* W [N, K] -> the panel layout (zero past N). */
void gemm_pack_f32(const float *w, int64_t N, int64_t K, float *packed) {
    #pragma omp parallel for schedule(static) num_threads(NT)
    for (int64_t p = 0; p < gemm_panels(N); p++) {
        float *dst = packed + p * K * GEMM_NR;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < GEMM_NR; j++) {
                int64_t n = p * GEMM_NR + j;
                dst[k * GEMM_NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
    }
}

#if defined(__AVX512F__)
#define GEMM_MAX_ROWS 12
#else
#define GEMM_MAX_ROWS 6
#endif
#define GEMM_VPP (GEMM_NR / VLEN)      /* vectors per panel row */

/* R rows x V panels; x is the tile's rows packed k-major ([K][R], `gemm_pack_tile`), out is [R][V * 16]
 * (ldo floats per row); constant R and V unroll fully, so the accumulators live in registers. */
#define GEMM_TILE(R, V)                                                                                  \
static void gemm_tile_##R##x##V(const void *restrict xv, const void *restrict panels, int64_t K,         \
                                float *restrict out, int64_t ldo, const float *restrict row_scales,      \
                                const float *restrict col_scales, int64_t scale_k, int64_t scale_ld) {   \
    const float *restrict x = (const float *)xv, *restrict pw = (const float *)panels;                   \
    const int64_t ps = K * GEMM_NR;                                                                       \
    (void)row_scales, (void)col_scales, (void)scale_k, (void)scale_ld;                                    \
    VEC acc[R][GEMM_VPP * V];                                                                             \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++) acc[r][v] = VEC_ZERO();           \
    for (int64_t k = 0; k < K; k++) {                                                                     \
        VEC w[GEMM_VPP * V];                                                                              \
        /* the panels after this tile's, into L2: at 1-64 rows a panel is used by few tiles, so its   \
           first touch would otherwise stall on L3/DRAM (panels are contiguous, this thread takes them \
           in order); into L1 they would evict the panels in use (measured 5-30% slower at 8-64 rows) */ \
        _Pragma("GCC unroll 16") for (int v = 0; v < V; v++)                                              \
            _mm_prefetch((const char *)(pw + (V + v) * ps + k * GEMM_NR), _MM_HINT_T1);                    \
        _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++)                                   \
            w[v] = VEC_LOAD(pw + (v / GEMM_VPP) * ps + k * GEMM_NR + (v % GEMM_VPP) * VLEN);              \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                            \
            VEC b = VEC_SET1(x[k * R + r]);                                                               \
            _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++)                               \
                acc[r][v] = VEC_FMA(b, w[v], acc[r][v]);                                                  \
        }                                                                                                 \
    }                                                                                                     \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int v = 0; v < GEMM_VPP * V; v++)                                   \
            VEC_STOREU(out + r * ldo + v * VLEN, acc[r][v]);                                              \
}

#if defined(__AVX512F__)
/* 4-12 rows: two panels (8-24 chains; a broadcast of x feeds two FMAs, which measured 3-15% faster
 * than one panel at 8-64 rows); 1-3 rows: four (4-12). */
GEMM_TILE_SET_12(GEMM_TILE)
static const gemm_tile_fn GEMM_TILES[GEMM_MAX_ROWS + 1] = GEMM_TILES_12(gemm);
static const int GEMM_TILE_PANELS[GEMM_MAX_ROWS + 1] = GEMM_TILE_PANELS_12;
#define GEMM_TILE_ROWS gemm_tile_rows_12
#else
/* 6 and 4 rows: one panel (12 and 8 chains); 2 rows: two panels (8); 1 row: four (8). */
GEMM_TILE(6, 1) GEMM_TILE(4, 1) GEMM_TILE(2, 2) GEMM_TILE(1, 4)
static const gemm_tile_fn GEMM_TILES[GEMM_MAX_ROWS + 1] = {
    NULL, gemm_tile_1x4, gemm_tile_2x2, NULL, gemm_tile_4x1, NULL, gemm_tile_6x1};
static const int GEMM_TILE_PANELS[GEMM_MAX_ROWS + 1] = {0, 4, 2, 0, 1, 0, 1};
#define GEMM_TILE_ROWS gemm_tile_rows_6421
#endif

/* The tallest register tile of this build: 12 with AVX-512 (zmm tiles), 6 with AVX2. */
int gemm_tile_max_rows(void) { return GEMM_MAX_ROWS; }

/* A tile's h rows packed k-major ([K][h]), so its broadcasts read one sequential stream instead of h
 * strided rows (measured +5% at 2,048 rows, +7-15% at 256). */
static void gemm_pack_tile(const void *xv, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                           float *row_scales, float *wide) {
    const float *x = xv;
    float *xp = dst;
    (void)order, (void)row_scales, (void)wide;   /* gemm_f32 reads fp32 x in order */
    for (int i = 0; i < h; i++)
        for (int64_t k = 0; k < K; k++) xp[k * h + i] = x[i * ldx + k];
}

static int64_t gemm_row_bytes_f32(int64_t K) { return K * (int64_t)sizeof(float); }
static int64_t gemm_panel_bytes_f32(int64_t K) { return K * GEMM_NR * (int64_t)sizeof(float); }

static const gemm_kernel GEMM_F32 = {GEMM_TILES, GEMM_TILE_PANELS, GEMM_TILE_ROWS, gemm_pack_tile,
                                     gemm_row_bytes_f32, gemm_panel_bytes_f32, sizeof(float), 0, NULL};

/* Rows [m0, m1) of x, cut into tiles as the kernel cuts them, each tile packed at its first row's
 * place in xp ((r - m0) rows of rb bytes in) with its rows' scales. Tile t is packed by thread t % nt. */
static void gemm_pack_rows(const gemm_kernel *kern, const void *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K,
                           const int32_t *order, int64_t rb, char *xp, float *row_scales, float *wide, int tid,
                           int nt) {
    for (int64_t r = m0, t = 0; r < m1; t++) {
        const int h = kern->tile_rows(m1 - r);
        if (t % nt == tid)
            kern->pack_tile((const char *)x + r * ldx * kern->x_size, ldx, h, K, order, xp + (r - m0) * rb,
                            row_scales + (r - m0), wide);
        r += h;
    }
}

/* Group g of 4 panels (ps bytes each) for rows [m0, m1) (packed in xp, rb bytes a row), results into y
 * (columns col0..col0+63, ldy) or, where the group runs past N or the kernel stores y itself, into a
 * scratch row block first (then the real columns are copied, or stored by the kernel). */
static void gemm_group(const gemm_kernel *kern, const char *xp, int64_t rb, const float *row_scales, int64_t m0,
                       int64_t m1, int64_t K, const gemm_weight *w, int64_t g, int64_t ps, void *y, int64_t ldy,
                       int64_t N, const float *bias, float *scratch) {
    const int64_t width = GEMM_NR * GEMM_GROUP, col0 = g * width, n = col0 + width < N ? width : N - col0;
    const char *pw = w->panels + g * GEMM_GROUP * ps;
    const float *col_scales = w->col_scales ? w->col_scales + col0 : NULL;
    float *yf = y;
    const int staged = n < width || kern->store;
    for (int64_t r = m0; r < m1;) {
        const int h = kern->tile_rows(m1 - r), panels = kern->tile_panels[h];
        float *out = staged ? scratch : yf + r * ldy + col0;
        const int64_t ldo = staged ? width : ldy;
        for (int v = 0; v < GEMM_GROUP; v += panels)
            kern->tiles[h](xp + (r - m0) * rb, pw + v * ps, K, out + v * GEMM_NR, ldo, row_scales + (r - m0),
                           col_scales ? col_scales + v * GEMM_NR : NULL, w->scale_k, w->scale_ld);
        if (kern->store)
            kern->store(scratch, width, h, n, bias ? bias + col0 : NULL, y, ldy, r, col0);
        else if (staged)
            for (int i = 0; i < h; i++) memcpy(yf + (r + i) * ldy + col0, scratch + i * width, n * sizeof(float));
        r += h;
    }
    if (bias && !kern->store)
        for (int64_t i = m0; i < m1; i++)
            for (int64_t j = 0; j < n; j++) yf[i * ldy + col0 + j] += bias[col0 + j];
}

int gemm_run(const gemm_kernel *kern, const void *x, int64_t ldx, int64_t M, int64_t K, const gemm_weight *w,
             int64_t N, void *y, int64_t ldy, const float *bias) {
    const int64_t groups = gemm_panels(N) / GEMM_GROUP, ps = kern->panel_bytes(K), rb = kern->row_bytes(K);
    const int64_t rows = M < GEMM_MBLK ? M : GEMM_MBLK;
    const int nt = NT;
    char *xp = aligned_alloc(64, (size_t)((rows * rb + 63) / 64 * 64));
    float *row_scales = malloc((size_t)rows * sizeof(float));
    float *wide = kern->widens ? malloc((size_t)(nt * K) * sizeof(float)) : NULL;   /* a widened row a thread */
    if (!xp || !row_scales || (kern->widens && !wide)) {
        free(xp);
        free(row_scales);
        free(wide);
        return -2;
    }
    #pragma omp parallel num_threads(nt)
    {
        float scratch[GEMM_SCRATCH_ROWS * GEMM_NR * GEMM_GROUP] __attribute__((aligned(64)));
        const int tid = omp_get_thread_num();
        for (int64_t mb = 0; mb < M; mb += GEMM_MBLK) {
            int64_t me = mb + GEMM_MBLK < M ? mb + GEMM_MBLK : M;
            gemm_pack_rows(kern, x, ldx, mb, me, K, w->order, rb, xp, row_scales, wide ? wide + tid * K : NULL, tid,
                           omp_get_num_threads());
            #pragma omp barrier
            #pragma omp for schedule(static)     /* its closing barrier: xp is reused by the next block */
            for (int64_t g = 0; g < groups; g++)
                gemm_group(kern, xp, rb, row_scales, mb, me, K, w, g, ps, y, ldy, N, bias, scratch);
        }
    }
    free(xp);
    free(row_scales);
    free(wide);
    return 0;
}

void gemm_store_bf16(const float *tile, int64_t ldt, int h, int64_t n, const float *bias, void *y, int64_t ldy,
                     int64_t r, int64_t col0) {
    bf16_t *yb = (bf16_t *)y + r * ldy + col0;
    for (int i = 0; i < h; i++) {
        const float *t = tile + i * ldt;
        bf16_t *o = yb + i * ldy;
#if defined(__AVX512BF16__)
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, t + j);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
            _mm256_mask_storeu_epi16(o + j, m, (__m256i)_mm512_cvtneps_pbh(v));
        }
#else
        for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(bias ? t[j] + bias[j] : t[j]);
#endif
    }
}

int gemm_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const float *packed, int64_t N,
             float *y, int64_t ldy, const float *bias) {
    const gemm_weight w = {(const char *)packed, NULL, 0, 0, NULL};
    return gemm_run(&GEMM_F32, x, ldx, M, K, &w, N, y, ldy, bias);
}
#endif
