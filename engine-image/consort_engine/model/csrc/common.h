/* What every CPU kernel of the engine shares: the SIMD vector of the kernels written with intrinsics,
 * bf16 and fp8 conversions, the exponential, and the team size.
 *
 * The kernels (paged_attention.c, prefill_attention.c, prefill_attention_bf16.c, elementwise.c, gemm.c,
 * gemm_bf16.c, gemm_i8w.c, gemm_i8a8.c, argmax.c, lora.c, mamba.c, team.c) are built into
 * one library at run time with the system C compiler (-O3 -march=native -fopenmp; the engine image
 * prebuilds one per x86-64 level) and called through ctypes (model/cpu_kernels.py); OpenMP resolves to
 * the libgomp torch already loaded, so the thread pool is shared.
 *
 * Team size: every parallel region runs kernel_threads threads (set_num_threads, from the engine's
 * thread plan), not OpenMP's per-thread default. The engine calls the kernels from its loop thread,
 * whose default is libgomp's start-up value (every core of the node), not what torch.set_num_threads
 * set in the main thread: engines sharing cores would each run a full team and oversubscribe them.
 */
#ifndef CONSORT_KERNELS_COMMON_H
#define CONSORT_KERNELS_COMMON_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* One SIMD vector of fp32 lanes for the kernels written with intrinsics (the prefill attention, the
 * GEMM): a zmm with AVX-512, a ymm with AVX2 + FMA. Without either those kernels are not built. */
#if defined(__AVX512F__)
#define VEC __m512
#define VLEN 16
#define VEC_ZERO _mm512_setzero_ps
#define VEC_LOAD _mm512_load_ps
#define VEC_LOADU _mm512_loadu_ps
#define VEC_SET1 _mm512_set1_ps
#define VEC_FMA _mm512_fmadd_ps
#define VEC_MUL _mm512_mul_ps
#define VEC_STORE _mm512_store_ps
#define VEC_STOREU _mm512_storeu_ps
#define VEC_MAX _mm512_max_ps
#define VEC_MIN _mm512_min_ps
#define VEC_DIV _mm512_div_ps
#define VEC_SUB _mm512_sub_ps
#define VEC_ADD _mm512_add_ps
#define VEC_FROM_I32 _mm512_cvtepi32_ps   /* VLEN int32 lanes -> fp32 */
#define VEC_ROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VEC_TIMES_POW2(p, k) _mm512_scalef_ps(p, k)      /* p * 2^k, k integral */
/* VLEN bf16 values from memory, widened to fp32 (a bf16 is the top half of its fp32) */
#define VEC_LOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* VLEN fp8 values from memory as fp32 lanes, their values times 2^-8 (FP8_UNIT): each byte, sign-extended
 * to 16 bits and shifted left 7, is an fp16 (exponent bias 15) with the byte's exponent and mantissa; the
 * mask clears the copy of the sign the shift left at bit 14. vcvtph2ps widens fp16 subnormals (fp8's)
 * exactly and at full speed, where fp32 subnormals put through a multiply stall it (the byte's bits at
 * fp32's, times 2^120: +25% decode time over a pool of normal draws, 1% of them fp8 subnormals); leaving
 * the 2^8 to the caller (a scale, a probability) saves a multiply per vector. */
#define VEC_LOAD_FP8(p) _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(                                  \
        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p))), 7), _mm256_set1_epi16((short)0xbf80)))
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC __m256
#define VLEN 8
#define VEC_ZERO _mm256_setzero_ps
#define VEC_LOAD _mm256_load_ps
#define VEC_LOADU _mm256_loadu_ps
#define VEC_SET1 _mm256_set1_ps
#define VEC_FMA _mm256_fmadd_ps
#define VEC_MUL _mm256_mul_ps
#define VEC_STORE _mm256_store_ps
#define VEC_STOREU _mm256_storeu_ps
#define VEC_MAX _mm256_max_ps
#define VEC_MIN _mm256_min_ps
#define VEC_DIV _mm256_div_ps
#define VEC_SUB _mm256_sub_ps
#define VEC_ADD _mm256_add_ps
#define VEC_FROM_I32 _mm256_cvtepi32_ps
#define VEC_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* p * 2^k, k integral in [-126, 127]: 2^k built in the exponent bits */
#define VEC_TIMES_POW2(p, k) _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(                    \
        _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23)))
#define VEC_LOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#if defined(__F16C__)
#define VEC_LOAD_FP8(p) _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(                                          \
        _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p))), 7), _mm_set1_epi16((short)0xbf80)))
#else  /* every AVX2 CPU has F16C; else the byte's bits at fp32's (value x 2^-120), scaled */
#define VEC_LOAD_FP8(p) _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(                \
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))), 20), _mm256_set1_epi32((int)0x87f00000))), \
        _mm256_set1_ps(0x1p112f))
#endif
#endif

typedef uint16_t bf16_t;

/* 0: OpenMP's default (team.c); hidden: the library's own, read without a GOT load */
extern int kernel_threads __attribute__((visibility("hidden")));
#define NT (kernel_threads > 0 ? kernel_threads : omp_get_max_threads())

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element i of a row as fp32, by the row's type (the kernels' macros pick one by dtype suffix). */
static inline float get_f32(const float *p, int64_t i) { return p[i]; }
static inline float get_bf16(const bf16_t *p, int64_t i) { return bf16_to_f32(p[i]); }

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (bf16_t)(u >> 16);
}

/* float8 e4m3fn, the fp8 K/V pool's element: sign, 4 exponent bits (bias 7), 3 mantissa bits; no
 * infinities, 0x7f / 0xff NaN, largest finite 448, subnormals m x 2^-9. Half the bytes of bf16: decode
 * attention reads half as much memory, and the same memory holds twice the tokens. The stored value is
 * the fp8 value itself (no scale factor).
 * fp8_to_f32 widens exactly without an fp32 subnormal (a slow input to the FPU): the exponent rebiased
 * (+120) in fp32's bits, or for fp8's subnormals (and zero) the mantissa times 2^-9. */
typedef uint8_t fp8_t;
#define FP8_UNIT 0x1p-8f    /* VEC_LOAD_FP8's lanes are the values times this */
static inline float fp8_to_f32(fp8_t b) {
    const uint32_t m = b & 0x7fu, u = (m << 20) + (120u << 23);
    float f;
    memcpy(&f, &u, 4);
    f = m < 8 ? (float)m * 0x1p-9f : f;
    return b & 0x80 ? -f : f;
}

/* fp32 -> fp8 rounded to nearest even, saturating at +-448: torch's .to(torch.float8_e4m3fn) on CPU for
 * every finite value (infinities and NaN store +-448: the pool never holds a NaN byte). Branch-free so
 * the store's loops vectorise. Below 2^-6 (fp8's subnormals) the fp32 add rounds: 2^14's ulp is 2^-9. */
static inline fp8_t f32_to_fp8(float f) {
    uint32_t u, sub;
    memcpy(&u, &f, 4);
    const uint32_t a = u & 0x7fffffffu;
    float t;
    memcpy(&t, &a, 4);
    t += 0x1p14f;
    memcpy(&sub, &t, 4);
    sub -= 0x46800000u;                                                 /* bits of 2^14 */
    const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);   /* rebias 127 -> 7 */
    uint32_t r = a < 0x3c800000u ? sub : normal;                        /* below 2^-6 */
    r = a >= 0x43e00000u ? 0x7eu : r;                                   /* 448 and beyond */
    return (fp8_t)(r | ((u >> 24) & 0x80u));
}

/* x at the row type's precision (where transformers rounds an intermediate), and element i of a row set
 * from fp32, by the row's type. */
static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline void put_f32(float *p, int64_t i, float v) { p[i] = v; }
static inline void put_bf16(bf16_t *p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
/* exp(x) as 2^k * p(f), |f| <= 1/2, degree-7 Taylor of 2^f: relative error < 1e-8,
 * written so the compiler vectorises it (libm's expf is a scalar call without -ffast-math). */
static inline float exp_nonpos_core(float x) { /* x in [-87, 88] */
    const float t = x * 1.44269504088896341f;
    const float k = __builtin_rintf(t);
    const float f = (t - k) * 0.693147180559945309f; /* 2^(t-k) = e^f */
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float exp_nonpos(float x) { return exp_nonpos_core(x < -87.0f ? -87.0f : x); }

static inline float exp_clamped(float x) { /* exp(x), x clamped to [-87, 88] */
    x = x > 88.0f ? 88.0f : x;
    return exp_nonpos_core(x < -87.0f ? -87.0f : x);
}

/* The prefill kernels' work items (prefill_attention.c, prefill_attention_bf16.c): each sequence's query
 * rows cu_q[b] .. cu_q[b+1]-1 cut into tiles of `tokens`. prefill_tiles: how many in all; prefill_tile:
 * tile t (counted across sequences) -> its sequence *b and its rows [*t0, *t1) within that sequence. */
static inline int prefill_tiles(const int32_t *cu_q, int B, int tokens) {
    int tiles = 0;
    for (int b = 0; b < B; b++) tiles += (cu_q[b + 1] - cu_q[b] + tokens - 1) / tokens;
    return tiles;
}

static inline void prefill_tile(const int32_t *cu_q, int tokens, int t, int *b, int *t0, int *t1) {
    for (*b = 0;; (*b)++) {
        const int n = (cu_q[*b + 1] - cu_q[*b] + tokens - 1) / tokens;
        if (t < n) break;
        t -= n;
    }
    const int qlen = cu_q[*b + 1] - cu_q[*b];
    *t0 = t * tokens;
    *t1 = *t0 + tokens < qlen ? *t0 + tokens : qlen;
}

#if defined(VEC)
/* e^x for lanes in [-87, 88]: the polynomial of exp_nonpos_core, a vector at a time. */
static inline VEC exp_vec_core(VEC x) {
    const VEC t = VEC_MUL(x, VEC_SET1(1.44269504088896341f));
    const VEC k = VEC_ROUND(t);
    const VEC f = VEC_MUL(VEC_SUB(t, k), VEC_SET1(0.693147180559945309f));
    VEC p = VEC_SET1(1.f / 5040.f);
    p = VEC_FMA(p, f, VEC_SET1(1.f / 720.f));
    p = VEC_FMA(p, f, VEC_SET1(1.f / 120.f));
    p = VEC_FMA(p, f, VEC_SET1(1.f / 24.f));
    p = VEC_FMA(p, f, VEC_SET1(1.f / 6.f));
    p = VEC_FMA(p, f, VEC_SET1(0.5f));
    p = VEC_FMA(p, f, VEC_SET1(1.f));
    p = VEC_FMA(p, f, VEC_SET1(1.f));
    return VEC_TIMES_POW2(p, k);
}

/* e^x for x <= 0 lanes (clamped at -87). */
static inline VEC exp_vec_nonpos(VEC x) { return exp_vec_core(VEC_MAX(x, VEC_SET1(-87.f))); }

/* e^x, x clamped to [-87, 88] (exp_clamped a vector at a time). */
static inline VEC exp_vec_clamped(VEC x) { return exp_vec_core(VEC_MIN(VEC_MAX(x, VEC_SET1(-87.f)), VEC_SET1(88.f))); }

/* The largest of a vector's lanes. */
static inline float vec_hmax(VEC v) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps(v);
#else
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#endif
}

/* The sum of a vector's lanes. */
static inline float vec_hsum(VEC v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps(v);
#else
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#endif
}

#if defined(__AVX512F__)
/* Each lane rounded to bf16 as f32_to_bf16 rounds (nearest even): the bf16 bits in the lane's low half. */
static inline __m512i vec_bf16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}
#endif
#if defined(__AVX512BF16__)
/* round_bf16 / put_bf16 a vector at a time by vcvtneps2bf16, a third of vec_bf16_bits' time in silu_mul: it
 * rounds alike but flushes fp32 subnormals (below 2^-126) to zero, as the GEMMs' bf16 stores do (gemm.c);
 * no activation is that small. */
static inline __m512 vec_round_bf16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }
static inline void vec_put_bf16(bf16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}
#endif

/* A vector of a row as fp32 lanes by the row's type (as get_f32 / get_bf16 / fp8_to_f32 for one element). */
#define VEC_GET_f32(p) VEC_LOADU(p)
#define VEC_GET_bf16(p) VEC_LOAD_BF16(p)
#define VEC_GET_fp8(p) VEC_LOAD_FP8(p)
/* The VEC_GET_* lanes are the row's values times these (a power of two: fp8's is folded into a scale or
 * a probability, exactly). */
#define VEC_UNIT_f32 1.f
#define VEC_UNIT_bf16 1.f
#define VEC_UNIT_fp8 FP8_UNIT
/* A vector at the row type's precision (round_f32 / round_bf16), and stored into a row of that type
 * (put_f32 / put_bf16), a vector at a time; bf16's with AVX-512 BF16 only. */
#define VEC_RND_f32(x) (x)
#define VEC_PUT_f32(p, x) VEC_STOREU(p, x)
#if defined(__AVX512BF16__)
#define VEC_RND_bf16(x) vec_round_bf16(x)
#define VEC_PUT_bf16(p, x) vec_put_bf16(p, x)
#endif
#endif

/* max(x[0 .. n)), -inf for none; NaN lanes are passed over, as the plain loop's compare passes them (vmaxps
 * returns its second operand where either is NaN). The compiler leaves that loop a serial chain of scalar
 * max instructions (a max reduction is not reassociable where NaN may occur). */
static inline float row_max(const float *x, int n) {
    float m = -INFINITY;
    int j = 0;
#if defined(VEC)
    if (n >= VLEN) {
        VEC mv = VEC_SET1(-INFINITY);
        for (; j + VLEN <= n; j += VLEN) mv = VEC_MAX(VEC_LOADU(x + j), mv);
        m = vec_hmax(mv);
    }
#endif
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

#endif
