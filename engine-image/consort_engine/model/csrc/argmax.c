/* Greedy decoding's argmax over logits rows, with torch.max(dim=-1)'s rule: the first NaN of a row
 * if it has one, else the first index of its largest value (-0 and +0 equal). torch's CPU kernel
 * compares one element at a time (~0.5 ms for 64 rows of a 32k vocabulary, 2 threads); this one
 * reads a row once a vector at a time and looks at single elements in one chunk only. */
#include "common.h"

#define CHUNK 512   /* elements per chunk: a multiple of 4 vectors on every build */

/* torch's loop, for rows with a NaN (or an infinity: the vector pass cannot tell them apart) */
#define DEFINE_ARGMAX_SCALAR(SUFFIX, T)                                                           \
    static int64_t argmax_scalar_##SUFFIX(const T *x, int64_t lo, int64_t hi) {                  \
        float best = get_##SUFFIX(x, lo);                                                         \
        int64_t at = lo;                                                                          \
        for (int64_t i = lo; i < hi; i++) {                                                       \
            const float v = get_##SUFFIX(x, i);                                                   \
            if (!(v <= best)) {                                                                   \
                best = v;                                                                         \
                at = i;                                                                           \
                if (v != v) break;                                                                \
            }                                                                                     \
        }                                                                                         \
        return at;                                                                                \
    }

#if defined(VEC)
/* Each whole chunk's max (4 vector accumulators, then its lanes); the first chunk whose max beats every
 * earlier one holds the row's first maximum, found there element by element. v * 0 summed over the row
 * is NaN iff the row holds a NaN or an infinity, which sends the row to the scalar loop. */
#define DEFINE_ARGMAX_ROW(SUFFIX, T)                                                              \
    static int64_t argmax_row_##SUFFIX(const T *x, int64_t n) {                                   \
        const int64_t whole = n / CHUNK * CHUNK;                                                  \
        if (whole == 0) return argmax_scalar_##SUFFIX(x, 0, n);                                   \
        VEC nan = VEC_ZERO();                                                                     \
        const VEC zero = VEC_ZERO();                                                              \
        float best = -__builtin_inff();                                                           \
        int64_t best_chunk = 0;                                                                   \
        float lanes[VLEN];                                                                        \
        for (int64_t c = 0; c < whole; c += CHUNK) {                                              \
            VEC m0 = VEC_GET_##SUFFIX(x + c), m1 = VEC_GET_##SUFFIX(x + c + VLEN);                    \
            VEC m2 = VEC_GET_##SUFFIX(x + c + 2 * VLEN), m3 = VEC_GET_##SUFFIX(x + c + 3 * VLEN);     \
            nan = VEC_FMA(m0, zero, VEC_FMA(m1, zero, VEC_FMA(m2, zero, VEC_FMA(m3, zero, nan)))); \
            for (int64_t i = c + 4 * VLEN; i < c + CHUNK; i += 4 * VLEN) {                        \
                const VEC v0 = VEC_GET_##SUFFIX(x + i), v1 = VEC_GET_##SUFFIX(x + i + VLEN);          \
                const VEC v2 = VEC_GET_##SUFFIX(x + i + 2 * VLEN), v3 = VEC_GET_##SUFFIX(x + i + 3 * VLEN); \
                m0 = VEC_MAX(m0, v0);                                                             \
                m1 = VEC_MAX(m1, v1);                                                             \
                m2 = VEC_MAX(m2, v2);                                                             \
                m3 = VEC_MAX(m3, v3);                                                             \
                nan = VEC_FMA(v0, zero, VEC_FMA(v1, zero, VEC_FMA(v2, zero, VEC_FMA(v3, zero, nan)))); \
            }                                                                                     \
            VEC_STOREU(lanes, VEC_MAX(VEC_MAX(m0, m1), VEC_MAX(m2, m3)));                         \
            float cmax = lanes[0];                                                                \
            for (int l = 1; l < VLEN; l++) cmax = lanes[l] > cmax ? lanes[l] : cmax;              \
            if (cmax > best) {                                                                    \
                best = cmax;                                                                      \
                best_chunk = c;                                                                   \
            }                                                                                     \
        }                                                                                         \
        VEC_STOREU(lanes, nan);                                                                   \
        for (int l = 0; l < VLEN; l++)                                                            \
            if (lanes[l] != 0.f) return argmax_scalar_##SUFFIX(x, 0, n);                          \
        int64_t at = best_chunk;                                                                  \
        while (get_##SUFFIX(x, at) != best) at++;   /* a chunk of all -inf went scalar above */  \
        if (whole < n) {          /* the tail: after every chunk, so it wins on a strictly larger value only */ \
            const int64_t t = argmax_scalar_##SUFFIX(x, whole, n);                                \
            const float v = get_##SUFFIX(x, t);                                                   \
            if (v > best || v != v) at = t;                                                       \
        }                                                                                         \
        return at;                                                                                \
    }
#else
#define DEFINE_ARGMAX_ROW(SUFFIX, T)                                                              \
    static int64_t argmax_row_##SUFFIX(const T *x, int64_t n) { return argmax_scalar_##SUFFIX(x, 0, n); }
#endif

/* out[r] = argmax of row r (rows of n at x + r * stride); rows split across the team when there is enough */
#define DEFINE_ARGMAX(SUFFIX, T)                                                                  \
    DEFINE_ARGMAX_SCALAR(SUFFIX, T)                                                               \
    DEFINE_ARGMAX_ROW(SUFFIX, T)                                                                  \
    void argmax_rows_##SUFFIX(const T *x, int64_t stride, int rows, int64_t n, int64_t *out) {   \
        _Pragma("omp parallel for if ((int64_t)rows * n >= 65536) num_threads(NT)")               \
        for (int r = 0; r < rows; r++) out[r] = argmax_row_##SUFFIX(x + (int64_t)r * stride, n);  \
    }

DEFINE_ARGMAX(f32, float)
DEFINE_ARGMAX(bf16, bf16_t)
