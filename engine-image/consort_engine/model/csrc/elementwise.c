/* Fused element-wise layers (fp32 arithmetic; bf16 variants round where transformers rounds).
 *
 * Each row runs a vector at a time where the library has vectors (the *_vec functions, which return how
 * far they got) and its last D % VLEN elements one at a time, the same arithmetic either way: float32
 * rows with AVX2 or AVX-512, bfloat16 rows with AVX-512 BF16, whose vcvtneps2bf16 rounds a vector in one
 * instruction. Elsewhere the compiler vectorises the plain loops itself, narrowing bf16 in integer steps.
 * Written with intrinsics where that pays: 1.1-1.4x the compiler's loops (docs/engine-speed.md, "The
 * element-wise layers and the softmax's max"). */
#include "common.h"

#if defined(VEC)
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
    /* *ss = the sum of squares of x's vectors (two accumulators: the FMA's latency, not one chain) */ \
    static inline int sum_squares_vec_##SUFFIX(const T *x, int D, float *ss) {                    \
        VEC acc0 = VEC_ZERO(), acc1 = VEC_ZERO();                                                 \
        int d = 0;                                                                                \
        for (; d + 2 * VLEN <= D; d += 2 * VLEN) {                                                \
            const VEC v0 = VEC_GET_##SUFFIX(x + d), v1 = VEC_GET_##SUFFIX(x + d + VLEN);          \
            acc0 = VEC_FMA(v0, v0, acc0);                                                         \
            acc1 = VEC_FMA(v1, v1, acc1);                                                         \
        }                                                                                         \
        for (; d + VLEN <= D; d += VLEN) {                                                        \
            const VEC v = VEC_GET_##SUFFIX(x + d);                                                \
            acc0 = VEC_FMA(v, v, acc0);                                                           \
        }                                                                                         \
        *ss = vec_hsum(VEC_ADD(acc0, acc1));                                                      \
        return d;                                                                                 \
    }                                                                                             \
    /* r = round(r + x) over one vector at d, whose squares acc takes */                          \
    static inline VEC add_square_vec_##SUFFIX(T *r, const T *x, int d, VEC acc) {                 \
        const VEC v = VEC_RND_##SUFFIX(VEC_ADD(VEC_GET_##SUFFIX(r + d), VEC_GET_##SUFFIX(x + d))); \
        VEC_PUT_##SUFFIX(r + d, v);                                                               \
        return VEC_FMA(v, v, acc);                                                                \
    }                                                                                             \
    /* r = round(r + x); *ss = the sum of squares of the new r */                                 \
    static inline int add_sum_squares_vec_##SUFFIX(T *r, const T *x, int D, float *ss) {          \
        VEC acc0 = VEC_ZERO(), acc1 = VEC_ZERO();                                                 \
        int d = 0;                                                                                \
        for (; d + 2 * VLEN <= D; d += 2 * VLEN) {                                                \
            acc0 = add_square_vec_##SUFFIX(r, x, d, acc0);                                        \
            acc1 = add_square_vec_##SUFFIX(r, x, d + VLEN, acc1);                                 \
        }                                                                                         \
        for (; d + VLEN <= D; d += VLEN) acc0 = add_square_vec_##SUFFIX(r, x, d, acc0);           \
        *ss = vec_hsum(VEC_ADD(acc0, acc1));                                                      \
        return d;                                                                                 \
    }                                                                                             \
    /* rotate-half over the first `half` pairs of each of a token's n_head heads of D: each vector of \
     * the cos / sin rows loaded once for all the heads */                                        \
    static inline int rope_vec_##SUFFIX(T *xt, int n_head, int D, const T *c, const T *s, int half) { \
        int i = 0;                                                                                \
        for (; i + VLEN <= half; i += VLEN) {                                                     \
            const VEC ci = VEC_GET_##SUFFIX(c + i), si = VEC_GET_##SUFFIX(s + i);                 \
            for (int h = 0; h < n_head; h++) {                                                    \
                T *xh = xt + (int64_t)h * D;                                                      \
                const VEC a = VEC_GET_##SUFFIX(xh + i), b = VEC_GET_##SUFFIX(xh + i + half);      \
                VEC_PUT_##SUFFIX(xh + i,                                                          \
                                 VEC_SUB(VEC_RND_##SUFFIX(VEC_MUL(a, ci)), VEC_RND_##SUFFIX(VEC_MUL(b, si)))); \
                VEC_PUT_##SUFFIX(xh + i + half,                                                   \
                                 VEC_ADD(VEC_RND_##SUFFIX(VEC_MUL(b, ci)), VEC_RND_##SUFFIX(VEC_MUL(a, si)))); \
            }                                                                                     \
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
#define VEC_PART_f32(fn, ...) fn(__VA_ARGS__)
#else
#define VEC_PART_f32(fn, ...) 0   /* no vectors: every element one at a time */
#endif
#if defined(__AVX512BF16__)
DEFINE_VEC_PARTS(bf16, bf16_t)
#define VEC_PART_bf16(fn, ...) fn(__VA_ARGS__)
#else
#define VEC_PART_bf16(fn, ...) 0
#endif
/* float32 rows take the compiler's vectorised loop for the norm's output: 15% faster than norm_vec at
 * 2,048 rows of 512 on Zen 4, level at 64 (hack/elementwise.py); bfloat16 rows take norm_vec, 1.2x. */
#define NORM_VEC_f32(...) 0
#define NORM_VEC_bf16(...) VEC_PART_bf16(norm_vec_bf16, __VA_ARGS__)

/* o = w * round(x * inv), inv = 1 / rms: the output of both norms (ss: the row's sum of squares). */
#define DEFINE_NORM_ROW(SUFFIX, T)                                                                \
    static inline void norm_row_##SUFFIX(const T *x, T *o, const T *w, int D, float ss, float eps) { \
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);                                      \
        for (int d = NORM_VEC_##SUFFIX(x, o, w, D, inv); d < D; d++)                    \
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
                for (int d = VEC_PART_##SUFFIX(sum_squares_vec_##SUFFIX, xr, D, &ss); d < D; d++) {        \
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
            for (int d = VEC_PART_##SUFFIX(add_sum_squares_vec_##SUFFIX, r, xr, D, &ss); d < D; d++) {     \
                const float v = round_##SUFFIX(get_##SUFFIX(r, d) + get_##SUFFIX(xr, d));         \
                put_##SUFFIX(r, d, v);                                                            \
                ss += v * v;                                                                      \
            }                                                                                     \
            norm_row_##SUFFIX(r, o, w, D, ss, eps);                                               \
        }                                                                                         \
    }

/* In-place rotate-half RoPE on the first `rot` dims of n_head heads of D per token (token stride x_stride;
 * rot = D but for partial rotary, as Bamba's), with cos/sin tables [max_len, rot/2] in the model dtype
 * indexed by positions. */
#define DEFINE_ROPE(SUFFIX, T)                                                                    \
    void rope_##SUFFIX(T *x, int64_t x_stride, int n_tok, int n_head, int D, int rot,             \
                       const int64_t *positions, const T *cos_t, const T *sin_t) {                \
        const int half = rot / 2;                                                                 \
        _Pragma("omp parallel for if (n_tok >= 64) num_threads(NT)")                                              \
        for (int t = 0; t < n_tok; t++) {                                                         \
            const T *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;           \
            const int i0 = VEC_PART_##SUFFIX(rope_vec_##SUFFIX, x + t * x_stride, n_head, D, c, s, half);   \
            for (int h = 0; h < n_head; h++) {                                                    \
                T *xh = x + t * x_stride + (int64_t)h * D;                                        \
                for (int i = i0; i < half; i++) {                                                 \
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
            for (int f = VEC_PART_##SUFFIX(silu_mul_vec_##SUFFIX, g, u, o, F); f < F; f++) {               \
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
