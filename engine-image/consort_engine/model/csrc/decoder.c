/* A step's decoder layers in one call: the llama family's pre-norm layer (RMSNorm, fused q/k/v projection,
 * optional per-head q/k RMSNorm, RoPE (of the first `rot` dims of each head), the K/V store, paged attention,
 * o projection, RMSNorm with the residual add, gate/up projection, SiLU x up, down projection; each projection
 * with the LoRA updates of the step's adapter rows), layer after layer, over this library's kernels. A hybrid's
 * (Bamba's) mixer layers take the attention's place in theirs: input projection, time steps, the Mamba2 decode
 * step over the rows' state slots, the verify windows' step (slots left alone, the projection kept for the
 * commit) and the prefill chunks' conv and scan (state checkpoints saved where they fall), gated RMSNorm,
 * output projection. Called
 * once a step instead of ~10 ctypes calls a layer from Python (models/fused_layers.py): each of those cost
 * 2-7 us of argument conversion, tensor allocation and views, ~80 us a layer, against a few hundred us of
 * kernels a layer for a small model at one sequence; a LoRA update through torch ops cost ~5 tensor ops a
 * shard.
 *
 * The kernels come in as function pointers (the ones Python would call for this activation dtype, pool
 * dtype and weight format), so this file has one copy for every dtype and needs none of the per-level
 * build conditions of the kernels it calls. Each kernel runs its own parallel regions as before; the
 * arithmetic, and so every bit of the output and of the pool, is the layer-by-layer path's.
 */
#include "common.h"
#include "lora.h"

/* The engine's GEMMs by their weight arguments (model/models/packed.py `_consort_call`): the packed
 * weight alone (gemm_f32, gemm_bf16); int8 codes, column scales and group (gemm_i8a8); the same and the
 * order in which the kernel reads x's columns (gemm_i8w). */
typedef int (*gemm_packed_fn)(const void *, int64_t, int64_t, int64_t, const void *, int64_t, void *, int64_t,
                              const float *);
typedef int (*gemm_codes_fn)(const void *, int64_t, int64_t, int64_t, const void *, const void *, int64_t, int64_t,
                             void *, int64_t, const float *);
typedef int (*gemm_ordered_fn)(const void *, int64_t, int64_t, int64_t, const void *, const void *, int64_t,
                               const void *, int64_t, void *, int64_t, const float *);
typedef void (*rms_norm_fn)(const void *, int64_t, void *, int64_t, const void *, int, int, int, float);
typedef void (*add_rms_norm_fn)(void *, const void *, void *, const void *, int, int, float);
typedef void (*rope_fn)(void *, int64_t, int, int, int, int, const int64_t *, const void *, const void *);
typedef void (*time_steps_fn)(const void *, int64_t, const void *, void *, int64_t, int, int);
typedef int (*mamba_step_fn)(const void *, int64_t, const void *, int64_t, const int64_t *, const int32_t *,
                             const int64_t *, int, int, void *, int64_t, float *, int64_t, const void *, const void *,
                             const float *, const void *, void *, int64_t, int, int, int, int, int, int);
typedef void (*gated_rms_norm_fn)(const void *, const void *, int64_t, void *, const void *, int, int, int, float);
typedef void (*mamba_conv_fn)(const void *, int64_t, const int32_t *, const int32_t *, const int64_t *, int,
                              const int32_t *, const int32_t *, const int64_t *, int, void *, int64_t, void *, int64_t,
                              const void *, const void *, void *, int64_t, int, int);
typedef void (*mamba_scan_fn)(const void *, int64_t, const void *, int64_t, const int32_t *, const int32_t *,
                              const int64_t *, int, const int32_t *, const int32_t *, const int64_t *, int, float *,
                              int64_t, float *, int64_t, const float *, const void *, float, float, void *, int64_t,
                              int, int, int, int);
typedef void (*silu_mul_fn)(const void *, void *, int, int);
typedef void (*store_kv_fn)(const void *, int64_t, const void *, int64_t, void *, void *, const int64_t *, int, int,
                            int, int, int64_t, int64_t, int64_t);
typedef int (*lora_jobs_fn)(const lora_job_t *, int);
typedef int (*attention_fn)(const void *, int64_t, const void *, const void *, void *, int64_t, const int32_t *, int,
                            const int32_t *, const int32_t *, int, int, int, int, int, int64_t, int64_t, int64_t,
                            float);

typedef struct {
    const void *fn;            /* the GEMM */
    int64_t nargs;             /* its weight arguments: 1 (w0), 3 (w0, w1, w2) or 4 (w0, w1, w2, w3) */
    const void *w0, *w1;
    int64_t w2;
    const void *w3;
    const float *bias;         /* fp32, or NULL */
    int64_t n, k;
} linear_t;

/* One LoRA pair of an adapter on one shard of a projection (model/lora.py): y[:, offset:offset + n] gains
 * (x A^T) Bt. */
typedef struct {
    const float *a, *bt;       /* A [r, k]; (B * scaling)^T [r, n] */
    int64_t r, offset, n;
} lora_pair_t;

/* An adapter's pairs on every layer: those of layer i's projection p (PROJ_*) are
 * pairs[first[4 i + p] .. first[4 i + p + 1]). */
typedef struct {
    const lora_pair_t *pairs;
    const int64_t *first;
} adapter_t;

/* A run of the step's rows that carry one adapter (lora.segments_of). */
typedef struct {
    int64_t start, end;
    const adapter_t *adapter;
} segment_t;

enum { PROJ_QKV, PROJ_O, PROJ_GATE_UP, PROJ_DOWN };

/* A mixer layer's own parameters (models/mamba2.py Mamba2Mixer); its projections are the layer's qkv (in_proj)
 * and o (out_proj), which is also where an adapter's pairs on them are (PROJ_QKV, PROJ_O). */
typedef struct {
    const void *conv_w, *conv_b;           /* [conv_dim][d_conv]; bias or NULL */
    const void *dt_bias, *D, *norm;        /* [heads], [heads], the gated norm's [inner] */
    const float *A;                        /* -exp(A_log) [heads] */
    int64_t index;                         /* its row in the state pools */
} mixer_t;

typedef struct {
    const void *in_norm, *post_norm, *q_norm, *k_norm;    /* q_norm, k_norm: NULL without per-head norms */
    void *k_cache, *v_cache;                              /* NULL in a mixer layer */
    linear_t qkv, o, gate_up, down;
    const mixer_t *mixer;                                 /* NULL in an attention layer */
} layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, block_size, elem;   /* elem: bytes of an activation */
    int64_t blk_stride, tok_stride, head_stride;                          /* the pool's, in elements */
    int64_t rot;                                                          /* dims of a head RoPE rotates */
    int64_t inner, conv_dim, m_heads, m_head_dim, groups, d_state, d_conv;  /* the mixers' (hybrids) */
    float eps, scale;
    float dt_lo, dt_hi;                                                   /* the mixers' time step limits */
    const void *cos, *sin;
    const void *rms_norm, *add_rms_norm, *rope, *silu_mul, *store_kv, *paged_attention, *prefill_attention;
    const void *lora_jobs;
    const void *time_steps, *mamba_step, *gated_rms_norm, *mamba_conv, *mamba_scan;    /* hybrids, or NULL */
} model_t;

typedef struct {
    int64_t rows, batched_rows;            /* the step's rows; the batched group's are [0, batched_rows) */
    const int64_t *positions, *slots;
    const int32_t *bt, *ctx, *cu;          /* the batched group's sequences (attention.AttentionMetadata) */
    int64_t bt_width, batched_seqs;
    const int32_t *pbt, *pctx, *pcu;       /* the prefill spans' */
    int64_t pbt_width, prefill_seqs;
    void *residual;                        /* in: the embeddings; out: the residual stream after the last layer */
    void *h;                               /* out: the last layer's output (the model adds the two) */
    void *x, *qkv, *attn, *gu, *act;       /* scratch, [rows] x hidden, q/k/v, heads x head_dim, 2 inter, inter */
    int64_t n_segments;                    /* the rows that carry an adapter, or 0 */
    const segment_t *segments;
    /* hybrids: every row is a decode row (row decode_rows[i] in state slot decode_slots[i]) or in a verify
     * window (rows win_rows[w] .. + win_lengths[w] - 1 from slot win_slots[w]); a mixer's conv state at
     * conv + index * conv_mixer + slot * conv_slot (elements), its SSM state likewise in ssm. With windows,
     * mixer i's projection (gate | xbc | time steps) goes to kept + i * rows * its width, for the commit. */
    int64_t n_decode;
    const int64_t *decode_rows, *decode_slots;
    void *conv;
    int64_t conv_slot, conv_mixer;
    float *ssm;
    int64_t ssm_slot, ssm_mixer;
    int64_t n_windows;
    const int64_t *win_rows;
    const int32_t *win_lengths;
    const int64_t *win_slots;
    void *kept;
    /* hybrids' prefill chunks (state_pool.StateMetadata.chunk_ids): rows starts[c] .. ends[c] - 1 from slot
     * chunk_slots[c]; cuts: the conv and SSM state cut_off[i] rows into chunk cut_chunk[i] saved to checkpoint
     * row cut_row[i] (a mixer's at ckpt_conv + index * ckpt_conv_mixer + row * ckpt_conv_row, ckpt_ssm likewise);
     * conv_out: scratch, [rows] x conv_dim */
    int64_t n_chunks;
    const int32_t *starts, *ends;
    const int64_t *chunk_slots;
    int64_t n_cuts;
    const int32_t *cut_chunk, *cut_off;
    const int64_t *cut_row;
    void *ckpt_conv;
    int64_t ckpt_conv_row, ckpt_conv_mixer;
    float *ckpt_ssm;
    int64_t ckpt_ssm_row, ckpt_ssm_mixer;
    void *conv_out;
} step_t;

static int gemm(const linear_t *l, const void *x, int64_t m, void *y) {
    if (l->nargs == 1)
        return ((gemm_packed_fn)l->fn)(x, l->k, m, l->k, l->w0, l->n, y, l->n, l->bias);
    if (l->nargs == 3)
        return ((gemm_codes_fn)l->fn)(x, l->k, m, l->k, l->w0, l->w1, l->w2, l->n, y, l->n, l->bias);
    return ((gemm_ordered_fn)l->fn)(x, l->k, m, l->k, l->w0, l->w1, l->w2, l->w3, l->n, y, l->n, l->bias);
}

/* y = x W^T + b for the step's rows, plus each adapter segment's LoRA update of projection `proj` of `layer`
 * (as Linear.forward adds it after the GEMM), all segments and shards in one lora_jobs call. Nonzero: out of
 * memory (the GEMM's or the update's buffers). */
static int linear(const model_t *m, const step_t *s, const linear_t *l, int layer, int proj, const void *x, void *y) {
    if (gemm(l, x, s->rows, y)) return 1;
    const int idx = 4 * layer + proj;
    int64_t n_jobs = 0;
    for (int64_t g = 0; g < s->n_segments; g++)
        n_jobs += s->segments[g].adapter->first[idx + 1] - s->segments[g].adapter->first[idx];
    if (!n_jobs) return 0;
    lora_job_t *jobs = malloc(sizeof(lora_job_t) * (size_t)n_jobs), *J = jobs;
    if (!jobs) return 1;
    for (int64_t g = 0; g < s->n_segments; g++) {
        const segment_t *seg = s->segments + g;
        const adapter_t *ad = seg->adapter;
        for (int64_t p = ad->first[idx]; p < ad->first[idx + 1]; p++, J++) {
            const lora_pair_t *P = ad->pairs + p;
            *J = (lora_job_t){(const char *)x + seg->start * l->k * m->elem, l->k, seg->end - seg->start, l->k,
                              P->a, P->bt, P->r, P->n, (char *)y + (seg->start * l->n + P->offset) * m->elem, l->n};
        }
    }
    const int rc = ((lora_jobs_fn)m->lora_jobs)(jobs, (int)n_jobs);
    free(jobs);
    return rc;
}

enum { OP_QKV = 1, OP_O, OP_GATE_UP, OP_DOWN, OP_DECODE_ATTENTION, OP_PREFILL_ATTENTION, OP_MIXER_STEP };

/* The attention block of one layer: x -> s->attn. Returns 0 or the failing op (OP_*). */
static int attention(const model_t *m, const layer_t *L, int layer, const step_t *s) {
    const int64_t H = m->heads, KVH = m->kv_heads, D = m->head_dim, T = s->rows, width = (H + 2 * KVH) * D;
    char *qkv = s->qkv;
    if (linear(m, s, &L->qkv, layer, PROJ_QKV, s->x, qkv)) return OP_QKV;
    if (L->q_norm) {
        ((rms_norm_fn)m->rms_norm)(qkv, width, qkv, width, L->q_norm, T, H, D, m->eps);
        ((rms_norm_fn)m->rms_norm)(qkv + H * D * m->elem, width, qkv + H * D * m->elem, width, L->k_norm, T, KVH, D,
                                   m->eps);
    }
    ((rope_fn)m->rope)(qkv, width, T, H + KVH, D, (int)m->rot, s->positions, m->cos, m->sin);
    const char *k = qkv + H * D * m->elem, *v = qkv + (H + KVH) * D * m->elem;
    ((store_kv_fn)m->store_kv)(k, width, v, width, L->k_cache, L->v_cache, s->slots, T, KVH, D, m->block_size,
                               m->blk_stride, m->tok_stride, m->head_stride);
    char *out = s->attn;
    if (s->batched_rows
        && ((attention_fn)m->paged_attention)(qkv, width, L->k_cache, L->v_cache, out, H * D, s->bt, s->bt_width,
                                              s->ctx, s->cu, s->batched_seqs, H, KVH, D, m->block_size,
                                              m->blk_stride, m->tok_stride, m->head_stride, m->scale))
        return OP_DECODE_ATTENTION;
    const int64_t nb = s->batched_rows;
    if (s->prefill_seqs
        && ((attention_fn)m->prefill_attention)(qkv + nb * width * m->elem, width, L->k_cache, L->v_cache,
                                                out + nb * H * D * m->elem, H * D, s->pbt, s->pbt_width, s->pctx,
                                                s->pcu, s->prefill_seqs, H, KVH, D, m->block_size, m->blk_stride,
                                                m->tok_stride, m->head_stride, m->scale))
        return OP_PREFILL_ATTENTION;
    return 0;
}

/* The Mamba2 step of the runs (rows[r] .. + lengths[r] - 1, or one row each without lengths) from their slots,
 * written back to them with keep = 1, else left as they were (mamba_step); y into s->attn. */
static int mixer_step(const model_t *m, const mixer_t *X, const step_t *s, const char *xbc, const char *dt,
                      int64_t width, const int64_t *rows, const int32_t *lengths, const int64_t *slots, int64_t n,
                      int keep) {
    return ((mamba_step_fn)m->mamba_step)(xbc, width, dt, width, rows, lengths, slots, (int)n, keep,
                                          (char *)s->conv + X->index * s->conv_mixer * m->elem, s->conv_slot,
                                          s->ssm + X->index * s->ssm_mixer, s->ssm_slot, X->conv_w, X->conv_b, X->A,
                                          X->D, s->attn, m->inner, (int)m->conv_dim, (int)m->d_conv, (int)m->m_heads,
                                          (int)m->m_head_dim, (int)m->groups, (int)m->d_state);
}

/* The prefill chunks' causal conv (into s->conv_out) and scan (y into s->attn), from and into their slots,
 * the state at each cut saved to its checkpoint row (mamba_conv, mamba_scan). */
static void mixer_chunks(const model_t *m, const mixer_t *X, const step_t *s, const char *xbc, const char *dt,
                         int64_t width) {
    const int64_t e = m->elem;
    char *ckpt_conv = s->ckpt_conv ? (char *)s->ckpt_conv + X->index * s->ckpt_conv_mixer * e : NULL;
    float *ckpt_ssm = s->ckpt_ssm ? s->ckpt_ssm + X->index * s->ckpt_ssm_mixer : NULL;
    ((mamba_conv_fn)m->mamba_conv)(xbc, width, s->starts, s->ends, s->chunk_slots, (int)s->n_chunks, s->cut_chunk,
                                   s->cut_off, s->cut_row, (int)s->n_cuts,
                                   (char *)s->conv + X->index * s->conv_mixer * e, s->conv_slot, ckpt_conv,
                                   s->ckpt_conv_row, X->conv_w, X->conv_b, s->conv_out, m->conv_dim,
                                   (int)m->conv_dim, (int)m->d_conv);
    ((mamba_scan_fn)m->mamba_scan)(s->conv_out, m->conv_dim, dt, width, s->starts, s->ends, s->chunk_slots,
                                   (int)s->n_chunks, s->cut_chunk, s->cut_off, s->cut_row, (int)s->n_cuts,
                                   s->ssm + X->index * s->ssm_mixer, s->ssm_slot, ckpt_ssm, s->ckpt_ssm_row, X->A,
                                   X->D, m->dt_lo, m->dt_hi, s->attn, m->inner, (int)m->m_heads, (int)m->m_head_dim,
                                   (int)m->groups, (int)m->d_state);
}

/* The mixer block of one layer, as Mamba2Mixer.forward runs it for decode rows, verify windows and prefill
 * chunks: x -> s->h (the projection's gate | xbc | dt in s->qkv or s->kept, the time steps in place of dt, y in
 * s->attn, the gated norm in s->act). Returns 0 or the failing op (OP_*). */
static int mixer(const model_t *m, const layer_t *L, int layer, const step_t *s) {
    const mixer_t *X = L->mixer;
    const int64_t T = s->rows, width = m->inner + m->conv_dim + m->m_heads, e = m->elem;
    char *proj = s->kept ? (char *)s->kept + X->index * T * width * e : s->qkv;
    char *xbc = proj + m->inner * e, *dt = xbc + m->conv_dim * e;
    if (linear(m, s, &L->qkv, layer, PROJ_QKV, s->x, proj)) return OP_QKV;
    ((time_steps_fn)m->time_steps)(dt, width, X->dt_bias, dt, width, (int)T, (int)m->m_heads);
    if ((s->n_decode && mixer_step(m, X, s, xbc, dt, width, s->decode_rows, NULL, s->decode_slots, s->n_decode, 1))
        || (s->n_windows
            && mixer_step(m, X, s, xbc, dt, width, s->win_rows, s->win_lengths, s->win_slots, s->n_windows, 0)))
        return OP_MIXER_STEP;
    if (s->n_chunks) mixer_chunks(m, X, s, xbc, dt, width);
    ((gated_rms_norm_fn)m->gated_rms_norm)(s->attn, proj, width, s->act, X->norm, (int)T, (int)m->inner,
                                           (int)m->groups, m->eps);
    return linear(m, s, &L->o, layer, PROJ_O, s->act, s->h) ? OP_O : 0;
}

/* After a verify step: every mixer steps the kept rows of the windows (s->win_rows, s->win_lengths: the kept
 * runs; s->win_slots) again into their slots, from the projection the verify step kept for it (s->kept, s->rows
 * rows a mixer, the time steps in place), y into s->attn: HybridState.commit_windows in one call instead of a
 * kernel call from Python a mixer. 0, or 16 * layer + OP_MIXER_STEP (out of memory). */
int commit_windows(const model_t *m, const layer_t *layers, int n_layers, const step_t *s) {
    const int64_t width = m->inner + m->conv_dim + m->m_heads, e = m->elem;
    for (int i = 0; i < n_layers; i++) {
        const mixer_t *X = layers[i].mixer;
        if (!X) continue;
        const char *xbc = (const char *)s->kept + (X->index * s->rows * width + m->inner) * e;
        if (mixer_step(m, X, s, xbc, xbc + m->conv_dim * e, width, s->win_rows, s->win_lengths, s->win_slots,
                       s->n_windows, 1))
            return 16 * i + OP_MIXER_STEP;
    }
    return 0;
}

/* Every layer over the step's rows. 0, or 16 * layer + the failing op (OP_*): a GEMM or the mixer step out of
 * memory for its buffers, or an attention kernel's error. */
int decoder_layers(const model_t *m, const layer_t *layers, int n_layers, const step_t *s) {
    const int T = (int)s->rows, hidden = (int)m->hidden;
    for (int i = 0; i < n_layers; i++) {
        const layer_t *L = layers + i;
        if (i == 0)     /* the residual stream starts as the embeddings */
            ((rms_norm_fn)m->rms_norm)(s->residual, hidden, s->x, hidden, L->in_norm, T, 1, hidden, m->eps);
        else
            ((add_rms_norm_fn)m->add_rms_norm)(s->residual, s->h, s->x, L->in_norm, T, hidden, m->eps);
        int op;
        if (L->mixer)
            op = mixer(m, L, i, s);
        else if (!(op = attention(m, L, i, s)) && linear(m, s, &L->o, i, PROJ_O, s->attn, s->h))
            op = OP_O;
        if (op) return 16 * i + op;
        ((add_rms_norm_fn)m->add_rms_norm)(s->residual, s->h, s->x, L->post_norm, T, hidden, m->eps);
        if (linear(m, s, &L->gate_up, i, PROJ_GATE_UP, s->x, s->gu)) return 16 * i + OP_GATE_UP;
        ((silu_mul_fn)m->silu_mul)(s->gu, s->act, T, (int)m->inter);
        if (linear(m, s, &L->down, i, PROJ_DOWN, s->act, s->h)) return 16 * i + OP_DOWN;
    }
    return 0;
}
