/* Fused element-wise layers (fp32 arithmetic; bf16 variants round where transformers rounds).
 *
 * Each row runs a vector at a time where the library has vectors (VEC: AVX-512 or AVX2; the *_vec
 * functions, which return how far they got) and its last D % VLEN elements one at a time, the same
 * arithmetic either way. Written with intrinsics rather than left to the compiler, which vectorises the
 * plain loops too but narrows bf16 in scalar-sized steps and builds the exponential's 2^k in integer
 * lanes (docs/engine-speed.md, "Element-wise layers on vectors"). */
#include "common.h"

#if defined(VEC)
#define VEC_PART(fn, ...) fn(__VA_ARGS__)
/* Vector parts of the rows below, per row type; each returns the first element it left. */
#define DEFINE_VEC_PARTS(SUFFIX, T)                                                               \
    /* o = w * round(x * inv) */                                                                  \
    static inline int norm_vec_##SUFFIX(const T *x, T *o, const T *w, int D, float inv) {         \
        int d = 0;                                                                                \
        for (; d + VLEN <= D; d += VLEN) {                                                        \
            const VEC y = VEC_RND_##SUFFIX(VEC_MUL(VEC_GET_##SUFFIX(x + d), VEC_SET1(inv)));      \
            VEC_PUT_##SUFFIX(o + d, VEC_MUL(VEC_GET_##SUFFIX(w + d), y));                         \
        }                                                                                         \
        return d;                                                                                 \
    }                                                                                             \
    /* *ss = the sum of squares of x's vectors */                                                 \
    static inline int sum_squares_vec_##SUFFIX(const T *x, int D, float *ss) {                    \
        VEC acc = VEC_ZERO();                                                                     \
        int d = 0;                                                                                \
        for (; d + VLEN <= D; d += VLEN) {                                                        \
            const VEC v = VEC_GET_##SUFFIX(x + d);                                                \
            acc = VEC_FMA(v, v, acc);                                                             \
        }                                                                                         \
        *ss = vec_hsum(acc);                                                                      \
        return d;                                                                                 \
    }                                                                                             \
    /* r = round(r + x); *ss = the sum of squares of the new r */                                 \
    static inline int add_sum_squares_vec_##SUFFIX(T *r, const T *x, int D, float *ss) {          \
        VEC acc = VEC_ZERO();                                                                     \
        int d = 0;                                                                                \
        for (; d + VLEN <= D; d += VLEN) {                                                        \
            const VEC v = VEC_RND_##SUFFIX(VEC_ADD(VEC_GET_##SUFFIX(r + d), VEC_GET_##SUFFIX(x + d))); \
            VEC_PUT_##SUFFIX(r + d, v);                                                           \
            acc = VEC_FMA(v, v, acc);                                                             \
        }                                                                                         \
        *ss = vec_hsum(acc);                                                                      \
        return d;                                                                                 \
    }                                                                                             \
    /* one head's rotate-half over its first `half` pairs */                                      \
    static inline int rope_vec_##SUFFIX(T *xh, const T *c, const T *s, int half) {                \
        int i = 0;                                                                                \
        for (; i + VLEN <= half; i += VLEN) {                                                     \
            const VEC a = VEC_GET_##SUFFIX(xh + i), b = VEC_GET_##SUFFIX(xh + i + half);          \
            const VEC ci = VEC_GET_##SUFFIX(c + i), si = VEC_GET_##SUFFIX(s + i);                 \
            VEC_PUT_##SUFFIX(xh + i, VEC_SUB(VEC_RND_##SUFFIX(VEC_MUL(a, ci)), VEC_RND_##SUFFIX(VEC_MUL(b, si)))); \
            VEC_PUT_##SUFFIX(xh + i + half,                                                       \
                             VEC_ADD(VEC_RND_##SUFFIX(VEC_MUL(b, ci)), VEC_RND_##SUFFIX(VEC_MUL(a, si)))); \
        }                                                                                         \
        return i;                                                                                 \
    }                                                                                             \
    /* o = round(silu(g)) * u */                                                                  \
    static inline int silu_mul_vec_##SUFFIX(const T *g, const T *u, T *o, int F) {               \
        int f = 0;                                                                                \
        for (; f + VLEN <= F; f += VLEN) {                                                        \
            const VEC v = VEC_GET_##SUFFIX(g + f);                                                \
            const VEC e = exp_vec_clamped(VEC_SUB(VEC_ZERO(), v));                                \
            const VEC act = VEC_RND_##SUFFIX(VEC_DIV(v, VEC_ADD(VEC_SET1(1.0f), e)));             \
            VEC_PUT_##SUFFIX(o + f, VEC_MUL(act, VEC_GET_##SUFFIX(u + f)));                       \
        }                                                                                         \
        return f;                                                                                 \
    }
DEFINE_VEC_PARTS(f32, float)
DEFINE_VEC_PARTS(bf16, bf16_t)
#else
#define VEC_PART(fn, ...) 0   /* no vectors: every element one at a time */
#endif

/* o = w * round(x * inv), inv = 1 / rms: the output of both norms (ss: the row's sum of squares). */
#define DEFINE_NORM_ROW(SUFFIX, T)                                                                \
    static inline void norm_row_##SUFFIX(const T *x, T *o, const T *w, int D, float ss, float eps) { \
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);                                      \
        for (int d = VEC_PART(norm_vec_##SUFFIX, x, o, w, D, inv); d < D; d++)                    \
            put_##SUFFIX(o, d, get_##SUFFIX(w, d) * round_##SUFFIX(get_##SUFFIX(x, d) * inv));    \
    }

/* rows of D at x + t * x_stride + h * D (t < n_tok, h < n_head) -> out, same addressing.
 * y = w * round(x / rms(x)), like transformers' RMSNorm. out may alias x. */
#define DEFINE_RMSNORM(SUFFIX, T)                                                                 \
    void rms_norm_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t out_stride, const T *w,  \
                           int n_tok, int n_head, int D, float eps) {                             \
        _Pragma("omp parallel for if (n_tok >= 64) num_threads(NT)")                                              \
        for (int t = 0; t < n_tok; t++)                                                           \
            for (int h = 0; h < n_head; h++) {                                                    \
                const T *xr = x + t * x_stride + (int64_t)h * D;                                  \
                T *o = out + t * out_stride + (int64_t)h * D;                                     \
                float ss = 0.f;                                                                   \
                for (int d = VEC_PART(sum_squares_vec_##SUFFIX, xr, D, &ss); d < D; d++) {        \
                    const float v = get_##SUFFIX(xr, d);                                          \
                    ss += v * v;                                                                  \
                }                                                                                 \
                norm_row_##SUFFIX(xr, o, w, D, ss, eps);                                          \
            }                                                                                     \
    }

/* residual += x (rounded like a bf16 add), out = RMSNorm(residual) * w. Rows of D, contiguous. */
#define DEFINE_ADD_RMSNORM(SUFFIX, T)                                                             \
    void add_rms_norm_##SUFFIX(T *residual, const T *x, T *out, const T *w, int n, int D,         \
                               float eps) {                                                       \
        _Pragma("omp parallel for if (n >= 64) num_threads(NT)")                                                  \
        for (int t = 0; t < n; t++) {                                                             \
            T *r = residual + (int64_t)t * D;                                                     \
            const T *xr = x + (int64_t)t * D;                                                     \
            T *o = out + (int64_t)t * D;                                                          \
            float ss = 0.f;                                                                       \
            for (int d = VEC_PART(add_sum_squares_vec_##SUFFIX, r, xr, D, &ss); d < D; d++) {     \
                const float v = round_##SUFFIX(get_##SUFFIX(r, d) + get_##SUFFIX(xr, d));         \
                put_##SUFFIX(r, d, v);                                                            \
                ss += v * v;                                                                      \
            }                                                                                     \
            norm_row_##SUFFIX(r, o, w, D, ss, eps);                                               \
        }                                                                                         \
    }

/* In-place rotate-half RoPE on n_head heads of D per token (token stride x_stride), with
 * cos/sin tables [max_len, D/2] in the model dtype indexed by positions. */
#define DEFINE_ROPE(SUFFIX, T)                                                                    \
    void rope_##SUFFIX(T *x, int64_t x_stride, int n_tok, int n_head, int D,                      \
                       const int64_t *positions, const T *cos_t, const T *sin_t) {                \
        const int half = D / 2;                                                                   \
        _Pragma("omp parallel for if (n_tok >= 64) num_threads(NT)")                                              \
        for (int t = 0; t < n_tok; t++) {                                                         \
            const T *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;           \
            for (int h = 0; h < n_head; h++) {                                                    \
                T *xh = x + t * x_stride + (int64_t)h * D;                                        \
                for (int i = VEC_PART(rope_vec_##SUFFIX, xh, c, s, half); i < half; i++) {        \
                    const float a = get_##SUFFIX(xh, i), b = get_##SUFFIX(xh, i + half);          \
                    const float ci = get_##SUFFIX(c, i), si = get_##SUFFIX(s, i);                 \
                    put_##SUFFIX(xh, i, round_##SUFFIX(a * ci) - round_##SUFFIX(b * si));         \
                    put_##SUFFIX(xh, i + half, round_##SUFFIX(b * ci) + round_##SUFFIX(a * si));  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

/* out[t, f] = silu(gu[t, f]) * gu[t, F + f]   (gate and up halves of the fused projection) */
#define DEFINE_SILU_MUL(SUFFIX, T)                                                                \
    void silu_mul_##SUFFIX(const T *gu, T *out, int n, int F) {                                   \
        _Pragma("omp parallel for if (n >= 16) num_threads(NT)")                                                  \
        for (int t = 0; t < n; t++) {                                                             \
            const T *g = gu + (int64_t)t * 2 * F, *u = g + F;                                     \
            T *o = out + (int64_t)t * F;                                                          \
            for (int f = VEC_PART(silu_mul_vec_##SUFFIX, g, u, o, F); f < F; f++) {               \
                const float v = get_##SUFFIX(g, f);                                               \
                const float act = round_##SUFFIX(v / (1.0f + exp_clamped(-v)));                   \
                put_##SUFFIX(o, f, act * get_##SUFFIX(u, f));                                     \
            }                                                                                     \
        }                                                                                         \
    }

/* Mamba2's gated norm (transformers' BambaRMSNormGated, norm after the gate): v = y * silu(gate) in fp32,
 * each of `groups` groups of a row scaled by 1 / rms(v over the group), rounded to the model dtype, times w.
 * y rows of D contiguous; gate rows at gate_stride (a view into the mixer's input projection). */
#define DEFINE_GATED_RMSNORM(SUFFIX, T)                                                           \
    void gated_rms_norm_##SUFFIX(const T *y, const T *gate, int64_t gate_stride, T *out, const T *w, \
                                 int n, int D, int groups, float eps) {                           \
        const int gd = D / groups;                                                                \
        _Pragma("omp parallel for if (n >= 16) num_threads(NT)")                                  \
        for (int t = 0; t < n; t++) {                                                             \
            float v[gd];                                                                          \
            const T *yr = y + (int64_t)t * D, *gr = gate + (int64_t)t * gate_stride;              \
            T *o = out + (int64_t)t * D;                                                          \
            for (int g0 = 0; g0 < D; g0 += gd) {                                                  \
                float ss = 0.f;                                                                   \
                for (int d = 0; d < gd; d++) {                                                    \
                    const float z = get_##SUFFIX(gr, g0 + d);                                     \
                    v[d] = get_##SUFFIX(yr, g0 + d) * (z / (1.0f + exp_clamped(-z)));             \
                    ss += v[d] * v[d];                                                            \
                }                                                                                 \
                const float inv = 1.0f / sqrtf(ss / (float)gd + eps);                             \
                for (int d = 0; d < gd; d++)                                                      \
                    put_##SUFFIX(o, g0 + d, get_##SUFFIX(w, g0 + d) * round_##SUFFIX(v[d] * inv)); \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_NORM_ROW(f32, float)
DEFINE_NORM_ROW(bf16, bf16_t)
DEFINE_RMSNORM(f32, float)
DEFINE_RMSNORM(bf16, bf16_t)
DEFINE_ADD_RMSNORM(f32, float)
DEFINE_ADD_RMSNORM(bf16, bf16_t)
DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, bf16_t)
DEFINE_SILU_MUL(f32, float)
DEFINE_SILU_MUL(bf16, bf16_t)
DEFINE_GATED_RMSNORM(f32, float)
DEFINE_GATED_RMSNORM(bf16, bf16_t)
