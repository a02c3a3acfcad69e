/* The Mamba2 mixer on CPU (models/mamba2.py): the decode steps, and the prefill chunks' conv and scan, each
 * one call per mixer layer for all of a step's rows.
 *
 * The decode step: for each single-token row of a step, the causal depthwise conv over its slot's conv
 * state and the new input, SiLU, then one recurrence step of its slot's SSM state, both states updated
 * in place, where the torch path (models/ssd.py conv_step + state_update) ran about 25 tensor ops per
 * layer, the slots' state gathered and scattered back. It rounds where that path rounds in a bf16 model
 * (each conv product, the conv sum, the bias add, SiLU, dt x, the state's output, x D and their sum);
 * the SSM state stays float32.
 *
 * dt: the time steps softplus(dt + dt_bias), computed for the whole step before the step or scan
 * (mamba_time_steps: a vectorised pass; element by element inside the scan it took a quarter of a small
 * model's scan).
 * Runs: run r is the step rows rows[r] .. rows[r] + len - 1 (len = lengths[r], or 1 without lengths),
 * stepped one after another from slot slots[r] (conv state [conv_dim][d_conv - 1] at conv + slot *
 * conv_stride, SSM state [heads][head_dim][d_state] at ssm + slot * ssm_stride): a decode row is a run of
 * one, a speculative verify window (last token + drafts) a run of its length. Row i reads xbc + i *
 * xbc_stride ([conv_dim]: x | B | C) and dt + i * dt_stride ([heads]) and writes y + i * y_stride
 * ([heads * head_dim]). Heads h of group h / (heads / groups) read that group's B and C. A state row
 * ([d_state] of a head's [head_dim][d_state]) stays in registers and L1 across the run's rows: a run
 * costs one pass over its state, not one per row.
 *
 * keep = 0 leaves the slots' state as it was (the run's states evolve in a per-thread copy of one state
 * row at a time): a verify window's rows are computed before it is known how many of them stand; the
 * engine then runs the kept rows again with keep = 1 (model/hybrid_state.py commit_windows), so the slot
 * never holds a rejected draft's state and nothing has to be saved or put back. */
#include "common.h"

/* The recurrence for one token over state rows of a head: s <- s * dA + dx * B, then y = s . C. Four rows
 * at a time (the prefill scan): four independent sums (one row's sum is a chain of dependent FMAs, which
 * ran at a quarter of the FMA rate) and one load of B and C for the four. The decode step goes one row
 * at a time (ssm_row), the row held across a run's tokens: four rows there measured slower. */
static inline void ssm_rows4(float *restrict s0, float *restrict s1, float *restrict s2, float *restrict s3,
                             const float *dx, const float *restrict B, const float *restrict C, float dA,
                             int N, float *acc) {
    const float x0 = dx[0], x1 = dx[1], x2 = dx[2], x3 = dx[3];
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (int k = 0; k < N; k++) {
        const float b = B[k], c = C[k];
        const float v0 = s0[k] * dA + x0 * b, v1 = s1[k] * dA + x1 * b;
        const float v2 = s2[k] * dA + x2 * b, v3 = s3[k] * dA + x3 * b;
        s0[k] = v0;
        s1[k] = v1;
        s2[k] = v2;
        s3[k] = v3;
        a0 += v0 * c;
        a1 += v1 * c;
        a2 += v2 * c;
        a3 += v3 * c;
    }
    acc[0] = a0;
    acc[1] = a1;
    acc[2] = a2;
    acc[3] = a3;
}

static inline float ssm_row(float *restrict s, float dx, const float *restrict B, const float *restrict C,
                            float dA, int N) {
    float a = 0.f;
    for (int k = 0; k < N; k++) {
        const float v = s[k] * dA + dx * B[k];
        s[k] = v;
        a += v * C[k];
    }
    return a;
}

/* Rows 0 .. np - 1 (np <= 4) of a state block with row stride N: acc[q] = row q . C after the update. */
static inline void ssm_rows(float *s, int np, int N, const float *dx, const float *B, const float *C,
                            float dA, float *acc) {
    if (np == 4) {
        ssm_rows4(s, s + N, s + 2 * (int64_t)N, s + 3 * (int64_t)N, dx, B, C, dA, N, acc);
        return;
    }
    for (int q = 0; q < np; q++) acc[q] = ssm_row(s + (int64_t)q * N, dx[q], B, C, dA, N);
}

/* n values as float: the array itself, or (bf16) converted into buf. */
static inline const float *as_f32_f32(float *buf, const float *src, int n) {
    (void)buf;
    (void)n;
    return src;
}

static inline const float *as_f32_bf16(float *buf, const bf16_t *src, int n) {
    for (int i = 0; i < n; i++) buf[i] = get_bf16(src, i);
    return buf;
}

#define DEFINE_MAMBA_STEP(SUFFIX, T)                                                                    \
int mamba_step_##SUFFIX(const T *xbc, int64_t xbc_stride, const T *dt, int64_t dt_stride,              \
                        const int64_t *rows, const int32_t *lengths, const int64_t *slots, int n,        \
                        int keep, T *conv, int64_t conv_stride, float *ssm, int64_t ssm_stride,          \
                        const T *conv_w, const T *conv_b, const float *A, const T *Dp, T *y,             \
                        int64_t y_stride, int CD, int K, int H, int P, int G, int N) {                   \
    const int inner = H * P, KS = K - 1, heads_per_group = H / G, nt = NT;                              \
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * ((size_t)n + 1));   /* run r's first out row */ \
    if (!first) return -2;                                                                              \
    int max_len = 1;                                                                                    \
    first[0] = 0;                                                                                       \
    for (int r = 0; r < n; r++) {                                                                       \
        const int len = lengths ? lengths[r] : 1;                                                       \
        first[r + 1] = first[r] + len;                                                                  \
        if (len > max_len) max_len = len;                                                               \
    }                                                                                                   \
    /* per thread: a state row, the run's dt and decay; 64-byte aligned (a row split across cache lines  \
     * ran the keep = 0 pass at half speed) */                                                          \
    const int64_t per_thread = (N + 2 * (int64_t)max_len + 15) / 16 * 16;                               \
    float *out = (float *)aligned_alloc(64, (sizeof(float) * (size_t)first[n] * CD + 63) / 64 * 64); /* conv out */ \
    float *scratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)nt * (size_t)per_thread);       \
    if (!out || !scratch) { free(first); free(out); free(scratch); return -2; }                         \
    _Pragma("omp parallel num_threads(nt)")                                                             \
    {                                                                                                   \
        float *row_copy = scratch + omp_get_thread_num() * per_thread;                                  \
        float *d_t = row_copy + N, *decay_t = d_t + max_len;                                            \
        _Pragma("omp for schedule(static)")                                                             \
        for (int r = 0; r < n; r++) {                                                                   \
            const int len = (int)(first[r + 1] - first[r]);                                             \
            T *cs = conv + slots[r] * conv_stride;                                                      \
            for (int t = 0; t < len; t++) {       /* row t's window: the state from t on, then inputs */ \
                float *o = out + (first[r] + t) * CD;                                                   \
                const T *x = xbc + (rows[r] + t) * xbc_stride;                                          \
                for (int c = 0; c < CD; c++) {                                                          \
                    const T *st = cs + (int64_t)c * KS, *w = conv_w + (int64_t)c * K;                   \
                    float acc = 0.f;                                                                    \
                    for (int k = 0; k < KS; k++) {                                                      \
                        const float tap = t + k < KS ? get_##SUFFIX(st, t + k)                          \
                            : get_##SUFFIX(xbc + (rows[r] + t + k - KS) * xbc_stride, c);               \
                        acc += round_##SUFFIX(get_##SUFFIX(w, k) * tap);                                \
                    }                                                                                   \
                    acc = round_##SUFFIX(acc + round_##SUFFIX(get_##SUFFIX(w, KS) * get_##SUFFIX(x, c))); \
                    o[c] = conv_b ? round_##SUFFIX(acc + get_##SUFFIX(conv_b, c)) : acc;                \
                }                                                                                       \
                for (int c = 0; c < CD; c++)      /* SiLU apart: a loop over the row that vectorises */ \
                    o[c] = round_##SUFFIX(o[c] / (1.0f + exp_clamped(-o[c])));                          \
            }                                                                                           \
            if (keep)           /* the window moves on by len: ascending k reads ahead of its writes */ \
                for (int c = 0; c < CD; c++) {                                                          \
                    T *st = cs + (int64_t)c * KS;                                                       \
                    for (int k = 0; k < KS; k++)                                                        \
                        st[k] = len + k < KS ? st[len + k] : (xbc + (rows[r] + len + k - KS) * xbc_stride)[c]; \
                }                                                                                       \
        }                                                                                               \
        _Pragma("omp for schedule(static)")                                                             \
        for (int it = 0; it < n * H; it++) {                                                            \
            const int r = it / H, h = it % H, g = h / heads_per_group;                                  \
            const int len = (int)(first[r + 1] - first[r]);                                             \
            const float Dh = get_##SUFFIX(Dp, h);                                                       \
            for (int t = 0; t < len; t++) {                                                             \
                d_t[t] = get_##SUFFIX(dt + (rows[r] + t) * dt_stride, h);                               \
                decay_t[t] = exp_clamped(d_t[t] * A[h]);                                                \
            }                                                                                           \
            float *s = ssm + slots[r] * ssm_stride + (int64_t)h * P * N;                                \
            for (int p = 0; p < P; p++) {             /* a state row, kept in L1 across the run */      \
                float *sp = s + (int64_t)p * N;                                                         \
                if (!keep) {                                                                            \
                    memcpy(row_copy, sp, sizeof(float) * (size_t)N);                                    \
                    sp = row_copy;                                                                      \
                }                                                                                       \
                for (int t = 0; t < len; t++) {                                                         \
                    const float *o = out + (first[r] + t) * CD;                                         \
                    const float *xs = o + (int64_t)h * P, *B = o + inner + (int64_t)g * N;              \
                    const float *C = o + inner + (int64_t)G * N + (int64_t)g * N;                       \
                    const float dx = round_##SUFFIX(d_t[t] * xs[p]);                                    \
                    const float acc = ssm_row(sp, dx, B, C, decay_t[t], N);                             \
                    put_##SUFFIX(y + (rows[r] + t) * y_stride + (int64_t)h * P, p,                      \
                                 round_##SUFFIX(acc) + round_##SUFFIX(xs[p] * Dh));                     \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    free(out);                                                                                          \
    free(first);                                                                                        \
    free(scratch);                                                                                      \
    return 0;                                                                                           \
}

DEFINE_MAMBA_STEP(f32, float)
DEFINE_MAMBA_STEP(bf16, bf16_t)

/* softplus(x) = max(x, 0) + log1p(e^-|x|), log1p(u) = 2 atanh(s), s = u / (2 + u) <= 1/3, by atanh's series
 * to s^17 (the first term left out is under 1e-10 of the sum): within a few ulp of float32 softplus.
 * Scalar, written so the compiler vectorises the loop over a row's heads. */
static inline float softplus(float x) {
    const float u = exp_nonpos(-fabsf(x)), s = u / (2.f + u), s2 = s * s;
    float p = 1.f / 17.f;
    p = p * s2 + 1.f / 15.f;
    p = p * s2 + 1.f / 13.f;
    p = p * s2 + 1.f / 11.f;
    p = p * s2 + 1.f / 9.f;
    p = p * s2 + 1.f / 7.f;
    p = p * s2 + 1.f / 5.f;
    p = p * s2 + 1.f / 3.f;
    p = p * s2 + 1.f;
    return (x > 0.f ? x : 0.f) + 2.f * s * p;
}

/* The time steps every mixer step and scan takes: out[i][h] = softplus(dt[i][h] + bias[h]) for `rows` rows of
 * H heads (row strides dt_stride, out_stride; out may be dt), each rounded where the model's dtype rounds
 * (the sum, the softplus), as torch's softplus(dt + dt_bias) in that dtype does. */
#define DEFINE_MAMBA_TIME_STEPS(SUFFIX, T)                                                              \
void mamba_time_steps_##SUFFIX(const T *dt, int64_t dt_stride, const T *bias, T *out, int64_t out_stride, \
                               int rows, int H) {                                                       \
    for (int i = 0; i < rows; i++)                                                                      \
        for (int h = 0; h < H; h++)                                                                     \
            put_##SUFFIX(out + i * out_stride, h,                                                       \
                         softplus(round_##SUFFIX(get_##SUFFIX(dt + i * dt_stride, h) + get_##SUFFIX(bias, h)))); \
}

DEFINE_MAMBA_TIME_STEPS(f32, float)
DEFINE_MAMBA_TIME_STEPS(bf16, bf16_t)

/* The prefill scan: every prefill chunk of a step (span s: rows span_start[s] .. span_end[s] - 1, slot
 * span_slot[s]) through the SSM recurrence token by token, from its slot's state, which ends as the state
 * after the span's last token. On a CPU this beats the chunked SSD algorithm (models/ssd.py chunk_scan,
 * matmul-shaped for GPUs): per token and head it is 3 vector ops per state element (decay, input, output)
 * against the chunked form's C.B scores and two state passes, and a work item (span, head) keeps its
 * head's state ([head_dim][d_state] float32) in L1/L2 across its tokens. Checkpoints (prefix caching):
 * cut c saves the state after cut_off[c] tokens of span cut_span[c] into row cut_row[c] of ckpt
 * (cuts of a span in rising order). x, B, C: the conv's output rows (x | B | C, row stride xbc_stride).
 * dt: softplus(dt + dt_bias) as for the step, clamped here to the time-step limit. Rounds where the
 * torch scan rounds: everything after dt in float32, y rounded once. */
#define DEFINE_MAMBA_SCAN(SUFFIX, T)                                                                    \
void mamba_scan_##SUFFIX(const T *xbc, int64_t xbc_stride, const T *dt, int64_t dt_stride,             \
                         const int32_t *span_start, const int32_t *span_end, const int64_t *span_slot,   \
                         int spans, const int32_t *cut_span, const int32_t *cut_off, const int64_t *cut_row, \
                         int cuts, float *ssm, int64_t ssm_stride, float *ckpt, int64_t ckpt_stride,     \
                         const float *A, const T *Dp, float dt_lo, float dt_hi, T *y,                    \
                         int64_t y_stride, int H, int P, int G, int N) {                                 \
    const int inner = H * P, heads_per_group = H / G;                                                   \
    const int64_t state = (int64_t)P * N;                                                               \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(NT)")                                    \
    for (int it = 0; it < spans * H; it++) {                                                            \
        const int sp = it / H, h = it % H, g = h / heads_per_group;                                     \
        float bc[2 * N];                                        /* (bf16) the token's B and C as float */ \
        float *s = ssm + span_slot[sp] * ssm_stride + (int64_t)h * state;                               \
        const float Ah = A[h], Dh = get_##SUFFIX(Dp, h);                                                \
        int c = 0;                                                                                      \
        while (c < cuts && cut_span[c] < sp) c++;                                                       \
        for (int j = 0;; j++) {                                   /* j tokens of the span done */      \
            for (; c < cuts && cut_span[c] == sp && cut_off[c] == j; c++)                               \
                memcpy(ckpt + cut_row[c] * ckpt_stride + (int64_t)h * state, s, sizeof(float) * (size_t)state); \
            const int t = span_start[sp] + j;                                                           \
            if (t >= span_end[sp]) break;                                                               \
            const T *row = xbc + t * xbc_stride;                                                        \
            const T *xs = row + (int64_t)h * P;                                                         \
            const float *B = as_f32_##SUFFIX(bc, row + inner + (int64_t)g * N, N);                      \
            const float *C = as_f32_##SUFFIX(bc + N, row + inner + (int64_t)G * N + (int64_t)g * N, N); \
            float d = get_##SUFFIX(dt + t * dt_stride, h);                                              \
            d = d < dt_lo ? dt_lo : (d > dt_hi ? dt_hi : d);                                            \
            const float dA = exp_clamped(d * Ah);                                                            \
            T *yr = y + t * y_stride + (int64_t)h * P;                                                  \
            for (int p = 0; p < P; p += 4) {                                                            \
                const int np = P - p < 4 ? P - p : 4;                                                   \
                float dx[4], acc[4];                                                                    \
                for (int q = 0; q < np; q++) dx[q] = d * get_##SUFFIX(xs, p + q);                       \
                ssm_rows(s + (int64_t)p * N, np, N, dx, B, C, dA, acc);                                 \
                for (int q = 0; q < np; q++)                                                            \
                    put_##SUFFIX(yr, p + q, acc[q] + Dh * get_##SUFFIX(xs, p + q));                     \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_MAMBA_SCAN(f32, float)
DEFINE_MAMBA_SCAN(bf16, bf16_t)

/* The prefill chunks' causal depthwise conv + SiLU (models/ssd.py conv_chunk, one call for the step's
 * chunks instead of a few tensor ops per chunk): chunk s's window is its slot's conv state ([conv_dim]
 * [d_conv - 1], the inputs before it) followed by its rows of xbc; out rows get silu(conv + bias) (the
 * conv summed in fp32, rounded once with its bias in a bf16 model, as torch's conv1d does), the slot's
 * state becomes the window's last d_conv - 1 inputs, and cut c (of chunk cut_span[c]) saves the
 * d_conv - 1 inputs before its token cut_off[c] into row cut_row[c] of ckpt. Work items: (chunk, 64
 * channels), vectorised across the channels; d_conv <= 9 (the taps sit in arrays on the stack; Mamba2
 * models use 4, and models/mamba2.py takes the tensor ops above MAX_KERNEL_CONV). */
#define MB_CONV_CHANNELS 64
#define DEFINE_MAMBA_CONV(SUFFIX, T)                                                                    \
void mamba_conv_##SUFFIX(const T *xbc, int64_t xbc_stride, const int32_t *span_start, const int32_t *span_end, \
                         const int64_t *span_slot, int spans, const int32_t *cut_span, const int32_t *cut_off, \
                         const int64_t *cut_row, int cuts, T *conv, int64_t conv_stride, T *ckpt,        \
                         int64_t ckpt_stride, const T *conv_w, const T *conv_b, T *out, int64_t out_stride, \
                         int CD, int K) {                                                               \
    const int KS = K - 1, blocks = (CD + MB_CONV_CHANNELS - 1) / MB_CONV_CHANNELS;                      \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(NT)")                                    \
    for (int it = 0; it < spans * blocks; it++) {                                                       \
        const int sp = it / blocks, c0 = it % blocks * MB_CONV_CHANNELS;                                \
        const int nc = CD - c0 < MB_CONV_CHANNELS ? CD - c0 : MB_CONV_CHANNELS;                         \
        const int a = span_start[sp], len = span_end[sp] - a;                                           \
        float st[8][MB_CONV_CHANNELS], wT[9][MB_CONV_CHANNELS], bias[MB_CONV_CHANNELS];                \
        T *cs = conv + span_slot[sp] * conv_stride;                                                     \
        for (int c = 0; c < nc; c++) {                                                                  \
            for (int k = 0; k < KS; k++) st[k][c] = get_##SUFFIX(cs + (int64_t)(c0 + c) * KS, k);       \
            for (int k = 0; k < K; k++) wT[k][c] = get_##SUFFIX(conv_w + (int64_t)(c0 + c) * K, k);     \
            bias[c] = conv_b ? get_##SUFFIX(conv_b, c0 + c) : 0.f;                                      \
        }                                                                                               \
        for (int t = 0; t < len; t++) {                                                                 \
            float acc[MB_CONV_CHANNELS];                                                                \
            for (int c = 0; c < nc; c++) acc[c] = 0.f;                                                  \
            for (int k = 0; k < K; k++) {                 /* window position t + k */                   \
                const int i = t + k - KS;                                                               \
                if (i < 0)                                                                              \
                    for (int c = 0; c < nc; c++) acc[c] += wT[k][c] * st[KS + i][c];                    \
                else {                                                                                  \
                    const T *xr = xbc + (int64_t)(a + i) * xbc_stride + c0;                             \
                    for (int c = 0; c < nc; c++) acc[c] += wT[k][c] * get_##SUFFIX(xr, c);              \
                }                                                                                       \
            }                                                                                           \
            T *o = out + (int64_t)(a + t) * out_stride + c0;                                            \
            for (int c = 0; c < nc; c++) {                                                              \
                const float v = round_##SUFFIX(acc[c] + bias[c]);                                    \
                put_##SUFFIX(o, c, v / (1.0f + exp_clamped(-v)));                                     \
            }                                                                                           \
        }                                                                                               \
        /* window position w: the old state below KS, then the chunk's rows */                          \
        for (int c = 0; c < cuts; c++) {                                                                \
            if (cut_span[c] != sp) continue;                                                            \
            T *dst = ckpt + cut_row[c] * ckpt_stride;                                                   \
            for (int j = 0; j < KS; j++) {                                                              \
                const int w = cut_off[c] + j;                                                           \
                for (int ch = 0; ch < nc; ch++)                                                         \
                    put_##SUFFIX(dst, (int64_t)(c0 + ch) * KS + j, w < KS ? st[w][ch]                    \
                                    : get_##SUFFIX(xbc + (int64_t)(a + w - KS) * xbc_stride + c0, ch));   \
            }                                                                                           \
        }                                                                                               \
        for (int j = 0; j < KS; j++) {                    /* the new state: window positions len .. */  \
            const int w = len + j;                                                                      \
            for (int ch = 0; ch < nc; ch++)                                                             \
                put_##SUFFIX(cs, (int64_t)(c0 + ch) * KS + j, w < KS ? st[w][ch]                         \
                                : get_##SUFFIX(xbc + (int64_t)(a + w - KS) * xbc_stride + c0, ch));       \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_MAMBA_CONV(f32, float)
DEFINE_MAMBA_CONV(bf16, bf16_t)
