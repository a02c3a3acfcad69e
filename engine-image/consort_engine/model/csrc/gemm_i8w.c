/* int8 weight GEMM (`--quantization int8`, and pre-quantized checkpoints' codes): y[M, N] = x[M, K] @ (codes *
 * scale)^T (+ bias), the codes int8 with one fp32 scale per output column and group of k (one group for
 * `int8`'s per-channel scales; AWQ/GPTQ groups of 32-128 k); x and y fp32 (`gemm_i8w_f32`) or bf16
 * (`gemm_i8w_bf16`: each row widened exactly and rounded as an fp32 row is, the output rounded once).
 *
 * Why integers: with fp32 activations an int8 weight is widened to fp32 and multiplied at the FMA rate,
 * no faster than fp32 weights once a GEMM has enough rows to reuse them. Rounding each row of x to
 * 16-bit integers instead (one scale per row, its absolute maximum at 32767: 15 bits of resolution
 * against bf16's 8) lets `vpmaddwd` multiply 16 pairs and add them pairwise into 8 int32 lanes (a ymm;
 * 32 pairs into 16 lanes in a zmm; VNNI's `vpdpwssd` adds them to the accumulator in the same
 * instruction): on Zen 3 1.5x the FMA pipes' multiply-adds per cycle (hack/gemm_backends.py
 * --quantized has the measured rates).
 *
 * Packed layout: panels of GEMM_NR = 16 columns grouped as gemm.h says, K taken in pairs (an odd K ends
 * with a zero); for k pair q a panel holds 32 bytes, columns 0-7 then 8-15, each column's two codes
 * side by side, so one `vpmovsxbw` widens 8 columns x 2 k (ymm) or the whole panel's 16 (zmm) into the
 * int16 lanes `vpmaddwd` pairs with a broadcast pair of x. A tile is R rows x P panels with int32
 * accumulators, summed in blocks of at most I8W_KBLK pairs (256 pairs of |32767 x 128| products stay
 * below 2^31) that end at each scale group's end; a block's sums, converted to fp32, are added times
 * their group's column scales (one FMA), and the row's scale multiplies the total once, at the end.
 * Every build gives the same bits: the sums are exact and converted and scaled in one order.
 */
#include "gemm.h"

/* zmm int16 operations need AVX-512BW, which every AVX-512 CPU but the Xeon Phi has: an AVX-512F-only
 * build leaves the kernel out (packed.consort_int8 then falls back). */
#if defined(__AVX2__) && defined(__FMA__) && (!defined(__AVX512F__) || defined(__AVX512BW__))

#define I8W_KBLK 256                   /* k pairs summed in int32 before the fp32 sum takes them */
#define I8W_QMAX 32767.0f

static int64_t i8w_pairs(int64_t K) { return (K + 1) / 2; }
static int64_t i8w_row_bytes(int64_t K) { return i8w_pairs(K) * (int64_t)sizeof(int32_t); }
static int64_t i8w_panel_bytes(int64_t K) { return i8w_pairs(K) * 32; }

int64_t gemm_packed_bytes_i8w_f32(int64_t N, int64_t K) { return gemm_panels(N) * i8w_panel_bytes(K); }

/* codes [N, K] -> the pair layout (zero past N and past K). */
void gemm_pack_i8w_f32(const int8_t *w, int64_t N, int64_t K, int8_t *packed) {
    const int64_t Q = i8w_pairs(K);
    #pragma omp parallel for schedule(static) num_threads(NT)
    for (int64_t p = 0; p < gemm_panels(N); p++)
        for (int64_t q = 0; q < Q; q++)
            for (int j = 0; j < GEMM_NR; j++)
                for (int e = 0; e < 2; e++) {
                    const int64_t n = p * GEMM_NR + j, k = 2 * q + e;
                    packed[(p * Q + q) * 32 + (j / 8) * 16 + (j % 8) * 2 + e] = n < N && k < K ? w[n * K + k] : 0;
                }
}

/* One accumulator vector: VLEN int32 lanes, each a column's sum, converted into the vector layer's fp32
 * VEC (common.h). With AVX-512 a zmm holds a whole panel (16 columns: one `vpmovsxbw` of a pair's 32
 * bytes), otherwise a ymm holds half of one. */
#if defined(__AVX512F__)
#define I8W_ACC __m512i
#define I8W_ACC_ZERO _mm512_setzero_si512
#define I8W_CODES(p) _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)(p)))
#define I8W_SET1 _mm512_set1_epi32
#else
#define I8W_ACC __m256i
#define I8W_ACC_ZERO _mm256_setzero_si256
#define I8W_CODES(p) _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(p)))
#define I8W_SET1 _mm256_set1_epi32
#endif
#define I8W_VPP (GEMM_NR / VLEN)       /* vectors per panel */
#define I8W_SUMS(r, v) acc[r][v]       /* a block's sums as they are (GEMM_INT_BLOCK_OUT) */

/* acc += the pairwise products of w and b, as one asm statement: the register allocator then sees one
 * read-modify-write accumulator, as it does for an FMA. Written as intrinsics (vpmaddwd + vpaddd, or
 * VNNI's one `vpdpwssd`), gcc 12 kept every accumulator on the stack and the tile ran at half rate. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define I8W_MADD(acc, w, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(b))
#elif defined(__AVX512F__)
#define I8W_MADD(acc, w, b)                                                                                \
    do {                                                                                                   \
        __m512i t_;                                                                                        \
        __asm__("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+v"(acc), "=&v"(t_) : "v"(b), "v"(w));        \
    } while (0)
#elif defined(__AVXVNNI__)              /* AVX-VNNI without AVX-512 (Alder Lake, Sierra Forest) */
#define I8W_MADD(acc, w, b) __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(b))
#else
#define I8W_MADD(acc, w, b)                                                                                \
    do {                                                                                                   \
        __m256i t_;                                                                                        \
        __asm__("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t_) : "x"(b), "x"(w));        \
    } while (0)
#endif

/* R rows x P panels (P * I8W_VPP accumulator vectors per row); x is the tile's rows as pairs of int16,
 * row after row ([R][Q] int32, `i8w_pack_tile`: R sequential streams). A block of sums ends at I8W_KBLK
 * pairs and at every scale group's end; converted, times their group's column scales, they are added to the
 * tile's fp32 sums (one FMA), which are then scaled by the rows' scales. I8W_TILE keeps those fp32 sums in
 * out (GEMM_INT_BLOCK_OUT: a load and a store a vector a block), which leaves every register to the int32
 * accumulators of the tallest tiles; I8W_TILE_REG keeps them in registers, for tiles of at most 12
 * accumulators: where groups are small (NVFP4's 16 k end a block every 8 pairs) the trip through out cost
 * a quarter of the kernel's time. The two give the same bits (the same FMAs in the same order). */
#define I8W_TILE_DEF(NAME, R, P, SUMS_DECL, BLOCK_OUT, SUMS_OUT)                                          \
static void NAME(const void *restrict xv, const void *restrict panels, int64_t K, float *restrict out,    \
                 int64_t ldo, const float *restrict row_scales, const float *restrict col_scales,         \
                 int64_t scale_k, int64_t scale_ld) {                                                     \
    enum { V = P * I8W_VPP };                                                                             \
    const int32_t *restrict x = (const int32_t *)xv;                                                      \
    const int8_t *restrict pw = (const int8_t *)panels;                                                   \
    const int64_t Q = i8w_pairs(K), ps = i8w_panel_bytes(K), gq = scale_k / 2;                            \
    SUMS_DECL;                                                                                            \
    for (int64_t q0 = 0, q1; q0 < Q; q0 = q1) {                                                           \
        const int64_t g = q0 / gq, gend = (g + 1) * gq;                                                   \
        q1 = q0 + I8W_KBLK < gend ? q0 + I8W_KBLK : gend;                                                 \
        q1 = q1 < Q ? q1 : Q;                                                                             \
        const float *restrict cs = col_scales + g * scale_ld;                                             \
        I8W_ACC acc[R][V];                                                                                \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                              \
            _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) acc[r][v] = I8W_ACC_ZERO();              \
        for (int64_t q = q0; q < q1; q++) {                                                               \
            I8W_ACC w[V];                                                                                 \
            /* the panels after this tile's, into L2 (as the fp32 tiles do, gemm.c) */                    \
            _Pragma("GCC unroll 16") for (int p = 0; p < P; p++)                                          \
                _mm_prefetch((const char *)(pw + (P + p) * ps + q * 32), _MM_HINT_T1);                    \
            _Pragma("GCC unroll 16") for (int v = 0; v < V; v++)                                          \
                w[v] = I8W_CODES(pw + (v / I8W_VPP) * ps + q * 32 + (v % I8W_VPP) * (32 / I8W_VPP));      \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                        \
                const I8W_ACC b = I8W_SET1(x[r * Q + q]);                                                 \
                _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) I8W_MADD(acc[r][v], w[v], b);        \
            }                                                                                             \
        }                                                                                                 \
        BLOCK_OUT                                                                                         \
    }                                                                                                     \
    SUMS_OUT                                                                                              \
    GEMM_INT_ROW_SCALE(R, V, out, ldo, row_scales)                                                        \
}
#define I8W_TILE(R, P) I8W_TILE_DEF(i8w_tile_##R##x##P, R, P, (void)0,                                     \
                                    GEMM_INT_BLOCK_OUT(R, V, I8W_SUMS, cs, out, ldo, q0), )
/* the block's sums into the register sums fs (as GEMM_INT_BLOCK_OUT adds them into out), stored at the end */
#define I8W_BLOCK_REG(R)                                                                                  \
    _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) {                                                \
        const VEC c = VEC_LOADU(cs + v * VLEN);                                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                            \
            const VEC f = VEC_FROM_I32(acc[r][v]);                                                        \
            fs[r][v] = q0 ? VEC_FMA(f, c, fs[r][v]) : VEC_MUL(f, c);                                      \
        }                                                                                                 \
    }
#define I8W_STORE_REG(R)                                                                                  \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) VEC_STOREU(out + r * ldo + v * VLEN, fs[r][v]);
#define I8W_SUMS_REG(R)                                                                                   \
    VEC fs[R][V];                                                                                         \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                  \
        _Pragma("GCC unroll 16") for (int v = 0; v < V; v++) fs[r][v] = VEC_ZERO()
#define I8W_TILE_REG(R, P) I8W_TILE_DEF(i8w_reg_tile_##R##x##P, R, P, I8W_SUMS_REG(R), I8W_BLOCK_REG(R),   \
                                        I8W_STORE_REG(R))

#if defined(__AVX512F__)
/* The fp32 AVX-512 tiles' set (gemm.h): up to 24 zmm accumulators + 2 codes + a broadcast. */
GEMM_TILE_SET_12(I8W_TILE)
static const gemm_tile_fn I8W_TILES[13] = GEMM_TILES_12(i8w);
static const int I8W_TILE_PANELS[13] = GEMM_TILE_PANELS_12;
#define I8W_TILE_ROWS gemm_tile_rows_12
/* Small groups: 6, 4, 2 and 1 rows of 12, 8, 8 and 4 accumulators, their fp32 sums in as many registers. */
#define I8W_SMALL_GROUP_PAIRS 32       /* groups of up to 64 k take these tiles */
I8W_TILE_REG(6, 2) I8W_TILE_REG(4, 2) I8W_TILE_REG(2, 4) I8W_TILE_REG(1, 4)
static const gemm_tile_fn I8W_REG_TILES[7] = {NULL, i8w_reg_tile_1x4, i8w_reg_tile_2x4, NULL, i8w_reg_tile_4x2,
                                              NULL, i8w_reg_tile_6x2};
static const int I8W_REG_TILE_PANELS[7] = {0, 4, 4, 0, 2, 0, 2};
#else
/* 6 and 4 rows: one panel (12 and 8 ymm accumulators: 6 x 2 + 2 codes + a broadcast + a product is
 * every ymm register); 2 rows and 1: two panels. */
I8W_TILE(6, 1) I8W_TILE(4, 1) I8W_TILE(2, 2) I8W_TILE(1, 2)
static const gemm_tile_fn I8W_TILES[7] = {NULL, i8w_tile_1x2, i8w_tile_2x2, NULL, i8w_tile_4x1, NULL, i8w_tile_6x1};
static const int I8W_TILE_PANELS[7] = {0, 2, 2, 0, 1, 0, 1};
#define I8W_TILE_ROWS gemm_tile_rows_6421
#endif

/* x[k .. k + 8), or with an order x[order[k]] .. (a gather: GPTQ act-order's columns). */
static inline __m256 i8w_load8(const float *src, const int32_t *order, int64_t k) {
    return order ? _mm256_i32gather_ps(src, _mm256_loadu_si256((const __m256i *)(order + k)), 4)
                 : _mm256_loadu_ps(src + k);
}

/* One row: x[k] (x[order[k]]) * inv rounded to int16 (round to nearest even), pairs (x[2q], x[2q+1]) as
 * int32 into pairs[0, Q): vector for whole blocks of 16 k, scalar for the rest, zero past K. */
static void i8w_round_pairs(const float *src, const int32_t *order, int64_t K, float inv, int32_t *pairs) {
    const __m256 s = _mm256_set1_ps(inv);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(i8w_load8(src, order, k), s));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(i8w_load8(src, order, k + 8), s));
        /* packs works per 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> k order */
        _mm256_storeu_si256((__m256i *)(pairs + k / 2), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
    }
    int16_t *out = (int16_t *)(pairs + k / 2);
    for (int64_t j = 0; k + j < K; j++) out[j] = (int16_t)lrintf(src[order ? order[k + j] : k + j] * inv);
    if (K % 2) out[K - k] = 0;
}

/* h rows -> int16 pairs, row after row ([h][Q] int32: x[2q] low, x[2q+1] high; with an order, x's
 * columns in that order), each row rounded with its own scale (absolute maximum / 32767;
 * gemm_row_absmax). A row holding NaN or an infinity gets a NaN scale, so its
 * outputs are NaN as the fp32 product's would be. */
static void i8w_pack_tile(const void *xv, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                          float *row_scales, float *wide) {
    const float *x = xv;
    (void)wide;
    int32_t *xp = dst;
    const int64_t Q = i8w_pairs(K);
    for (int i = 0; i < h; i++) {
        const float *src = x + i * ldx;
        int bad;
        const float amax = gemm_row_absmax(src, K, &bad);
        const float inv = amax > 0.0f && !bad ? I8W_QMAX / amax : 0.0f;
        row_scales[i] = bad ? NAN : amax / I8W_QMAX;
        i8w_round_pairs(src, order, K, inv, xp + i * Q);
    }
}

/* bf16 rows: each widened into the thread's fp32 row (exactly), then rounded as an fp32 row is. */
static void i8w_pack_tile_bf16(const void *xv, int64_t ldx, int h, int64_t K, const int32_t *order, void *dst,
                               float *row_scales, float *wide) {
    for (int i = 0; i < h; i++) {
        gemm_widen_bf16((const bf16_t *)xv + i * ldx, K, wide);
        i8w_pack_tile(wide, K, 1, K, order, (int32_t *)dst + i * i8w_pairs(K), row_scales + i, NULL);
    }
}

static const gemm_kernel GEMM_I8W = {I8W_TILES, I8W_TILE_PANELS, I8W_TILE_ROWS, i8w_pack_tile,
                                     i8w_row_bytes, i8w_panel_bytes, sizeof(float), 0, NULL};
/* bf16 x and y: the same sums, the output (+ bias) rounded to bf16 once */
static const gemm_kernel GEMM_I8W_BF16 = {I8W_TILES, I8W_TILE_PANELS, I8W_TILE_ROWS, i8w_pack_tile_bf16,
                                          i8w_row_bytes, i8w_panel_bytes, sizeof(bf16_t), 1, gemm_store_bf16};

#if defined(__AVX512F__)
static const gemm_kernel GEMM_I8W_SMALL = {I8W_REG_TILES, I8W_REG_TILE_PANELS, gemm_tile_rows_6421, i8w_pack_tile,
                                           i8w_row_bytes, i8w_panel_bytes, sizeof(float), 0, NULL};
static const gemm_kernel GEMM_I8W_SMALL_BF16 = {I8W_REG_TILES, I8W_REG_TILE_PANELS, gemm_tile_rows_6421,
                                                i8w_pack_tile_bf16, i8w_row_bytes, i8w_panel_bytes, sizeof(bf16_t), 1,
                                                gemm_store_bf16};
#endif

static int i8w_run(const gemm_kernel *kern, const void *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes,
                   const float *scales, int64_t group, const int32_t *order, int64_t N, void *y, int64_t ldy,
                   const float *bias) {
    if (group <= 0 || group % 2) return -1;
#if defined(__AVX512F__)
    if (group / 2 <= I8W_SMALL_GROUP_PAIRS && group < K)
        kern = kern == &GEMM_I8W ? &GEMM_I8W_SMALL : &GEMM_I8W_SMALL_BF16;
#endif
    const gemm_weight w = {(const char *)codes, scales, group, gemm_packed_bytes_i8w_f32(N, K) / (2 * i8w_pairs(K)),
                           order};
    return gemm_run(kern, x, ldx, M, K, &w, N, y, ldy, bias);
}

/* `scales` holds, for each group of `group` k (even; K or more: one group, a scale per column), one float
 * per packed column (gemm_packed_bytes_i8w_f32(N, K) / (K rounded up to even) of them; zero past N), the
 * groups' rows one after another. `order` (K int32, or NULL: in order): code column k multiplies x's
 * column order[k]. -1 for an odd group (a pair would straddle two scales). */
int gemm_i8w_f32(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                 int64_t group, const int32_t *order, int64_t N, float *y, int64_t ldy, const float *bias) {
    return i8w_run(&GEMM_I8W, x, ldx, M, K, codes, scales, group, order, N, y, ldy, bias);
}

/* The same with bf16 x and y (the weight packed as for gemm_i8w_f32). */
int gemm_i8w_bf16(const bf16_t *x, int64_t ldx, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                  int64_t group, const int32_t *order, int64_t N, bf16_t *y, int64_t ldy, const float *bias) {
    return i8w_run(&GEMM_I8W_BF16, x, ldx, M, K, codes, scales, group, order, N, y, ldy, bias);
}
#endif
