/* target_kv.c: incremental decoding of one sequence with a KV cache.
 *
 * The decoder layer is the one of target.c (Hugging Face Qwen3 / Llama /
 * Qwen3.5), run on n new rows at positions len .. len+n-1:
 *   h = RMSNorm_in(x); q, k, v = projections (Qwen3: q/k norms); RoPE at
 *   the new positions; k, v are written into the cache rows [len, len+n);
 *   a = attention of the new queries over cache rows [0, len+n), causal;
 *   x += a Wo^T; x += MLP(RMSNorm_post(x)).
 *
 * Attention. From an empty cache (prefill) the new rows are the whole
 * sequence: attn_causal with one sequence (and a sliding layer's window),
 * exactly the packed forward's call. Otherwise (verification of a block,
 * one decode step) query row i sees cache rows [0, len+i]; that is
 * attn_dflash with blocks of size 1: block i has context rows [0, len+i)
 * and its own row len+i; a sliding layer's row i, once the cache holds
 * more rows than its window W (len + n > W), [len+i-W+1, len+i]. The op
 * table needs no cache-specific op, and the CUDA table serves both as it
 * is. gpt-oss's sinks then take the lse either op wrote, as in target.c.
 *
 * Gated DeltaNet layers (Qwen3.5) keep no keys: their cache is the
 * recurrent state S (f32 [Hv, dk, dv]) and the last K-1 raw projections
 * (the convolution's history). Neither can be cut back like a KV cache, so
 * a forward whose rows the caller may crop back into (want->may_crop: a
 * speculative block) also keeps S from before it, the block's inputs to
 * the recurrence and the history window; a crop into the block restores S
 * and re-runs the recurrence over the rows kept. For Qwen3.5-27B and
 * 16-row blocks that is ~3.7 MiB per DeltaNet layer, where keeping S after
 * every row (as SGLang does) would take 51 MiB and as many bytes written
 * per verify step.
 */
#include "target.h"
#include "target_internal.h"

#include "common.h"

#include <stdlib.h>
#include <string.h>

struct dfl_target_kv {
    dfl_target *t;
    int64_t cap, len;
    int nl;                 /* layers cached (the loaded ones) */
    void **k, **v;          /* per attention layer: act [cap, Hkv, D] */
    /* per Gated DeltaNet layer: state S f32 [Hv, dk, dv], conv history act
     * [K-1, C]; for a crop into the last forward (rb_n rows from rb_start,
     * rb_n 0 when it kept none): S before it (pre), its rows' inputs to the
     * recurrence (blk_qkv act [rb_n, C], blk_ba act [rb_n, 2*Hv]) and the
     * history window (win act [K-1 + rb_n, C]). */
    float **S, **pre;
    void **hist, **win, **blk_qkv, **blk_ba, *hist_tmp;
    int64_t rb_cap, rb_start, rb_n;
    lin_ws lin;
    /* workspace for n new rows, grown as needed */
    int64_t cap_n, cap_taps;
    void *x, *h, *q, *kpre, *ao, *taps;
    mlp_ws mlp;
    head_ws head;
    int32_t *ids, *pos, *cu;
    dfl_block *blocks, *blk_win;   /* blk_win: the sliding layers */
    float *lse;                    /* gpt-oss: f32 [cap_n * Hq] */
    int32_t *host_pos;
    dfl_block *host_blocks;        /* [2 * cap_n]: full, then sliding */
};

/* One Gated DeltaNet layer's state, and its convolution history. */
static size_t state_bytes(const dfl_model_config *c) {
    return (size_t)(c->lin_v_heads * c->lin_k_dim * c->lin_v_dim) * sizeof(float);
}
static int64_t conv_channels(const dfl_model_config *c) {
    return 2 * c->lin_k_heads * c->lin_k_dim + c->lin_v_heads * c->lin_v_dim;
}
static size_t hist_bytes(const dfl_model_config *c, const dfl_ops *ops) {
    return (size_t)((c->lin_conv - 1) * conv_channels(c)) * (size_t)ops->act_bytes + 1;
}

dfl_target_kv *dfl_target_kv_new(dfl_target *t, int64_t cap) {
    DFL_ASSERT(cap >= 1 && cap <= INT32_MAX);
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    dfl_target_kv *kv = dfl_calloc(1, sizeof *kv);
    kv->t = t;
    kv->cap = cap;
    kv->nl = t->nlayers;
    kv->k = dfl_calloc((size_t)kv->nl, sizeof *kv->k);
    kv->v = dfl_calloc((size_t)kv->nl, sizeof *kv->v);
    kv->S = dfl_calloc((size_t)kv->nl, sizeof *kv->S);
    kv->pre = dfl_calloc((size_t)kv->nl, sizeof *kv->pre);
    kv->blk_qkv = dfl_calloc((size_t)kv->nl, sizeof *kv->blk_qkv);
    kv->blk_ba = dfl_calloc((size_t)kv->nl, sizeof *kv->blk_ba);
    kv->hist = dfl_calloc((size_t)kv->nl, sizeof *kv->hist);
    kv->win = dfl_calloc((size_t)kv->nl, sizeof *kv->win);
    size_t bytes = (size_t)(cap * c->num_key_value_heads * c->head_dim) * (size_t)ops->act_bytes;
    for (int l = 0; l < kv->nl; l++) {
        if (t->layers[l].linear) {
            kv->S[l] = ops->alloc(state_bytes(c));
            kv->pre[l] = ops->alloc(state_bytes(c));
            kv->hist[l] = ops->alloc(hist_bytes(c, ops));
        } else {
            kv->k[l] = ops->alloc(bytes);
            kv->v[l] = ops->alloc(bytes);
        }
    }
    if (c->hybrid) kv->hist_tmp = ops->alloc(hist_bytes(c, ops));
    kv->cu = ops->alloc(2 * sizeof(int32_t));
    return kv;
}

static void free_bufs(const dfl_ops *ops, dfl_target_kv *kv) {
    void *b[] = {kv->x, kv->h, kv->q, kv->kpre, kv->ao, kv->taps, kv->ids, kv->pos, kv->blocks, kv->blk_win, kv->lse};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
        if (b[i]) ops->free(b[i]);
    dfl_target_head_free(ops, &kv->head);
    dfl_target_mlp_free(ops, &kv->mlp);
}

void dfl_target_kv_free(dfl_target_kv *kv) {
    if (!kv) return;
    const dfl_ops *ops = kv->t->ops;
    for (int l = 0; l < kv->nl; l++) {
        void *b[] = {kv->k[l], kv->v[l], kv->S[l], kv->pre[l], kv->hist[l], kv->win[l], kv->blk_qkv[l], kv->blk_ba[l]};
        for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
            if (b[i]) ops->free(b[i]);
    }
    if (kv->hist_tmp) ops->free(kv->hist_tmp);
    dfl_target_lin_free(ops, &kv->lin);
    free(kv->k);
    free(kv->v);
    free(kv->S);
    free(kv->pre);
    free(kv->blk_qkv);
    free(kv->blk_ba);
    free(kv->hist);
    free(kv->win);
    free_bufs(ops, kv);
    ops->free(kv->cu);
    free(kv->host_pos);
    free(kv->host_blocks);
    free(kv);
}

int64_t dfl_target_kv_len(const dfl_target_kv *kv) { return kv->len; }
int64_t dfl_target_kv_cap(const dfl_target_kv *kv) { return kv->cap; }

/* Put the Gated DeltaNet layers back at position len: the empty state, or
 * the state before the last forward advanced over its first m = len -
 * rb_start rows again (the same op on the same inputs). */
static void restore_linear(dfl_target_kv *kv, int64_t len) {
    const dfl_target *t = kv->t;
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const size_t sb = state_bytes(c), hb = hist_bytes(c, ops) - 1;
    const int64_t m = len - kv->rb_start;
    if (len > 0)
        DFL_ASSERT(kv->rb_n > 0 && m >= 0 && m < kv->rb_n &&
                   "a hybrid target crops only to 0 or into its last forward made with may_crop");
    const int32_t cu[2] = {0, (int32_t)m};
    if (m > 0) ops->upload(kv->cu, cu, sizeof cu); /* every forward uploads its own */
    for (int l = 0; l < kv->nl; l++) {
        const layer_w *lw = &t->layers[l];
        if (!lw->linear) continue;
        if (len == 0) {
            ops->zero(kv->S[l], sb);
            ops->zero(kv->hist[l], hb);
            continue;
        }
        ops->copy(kv->S[l], kv->pre[l], sb);
        if (m > 0)
            ops->gated_delta(kv->lin.o, kv->S[l], NULL, kv->blk_qkv[l], kv->blk_ba[l], lw->A_log, lw->dt_bias, kv->cu, 1,
                             m, c->lin_k_heads, c->lin_v_heads, c->lin_k_dim, c->lin_v_dim);
        ops->copy(kv->hist[l], DFL_AT(ops, kv->win[l], m * conv_channels(c)), hb);
    }
    if (len == 0) kv->rb_n = 0;
}

void dfl_target_kv_crop(dfl_target_kv *kv, int64_t len) {
    DFL_ASSERT(len >= 0 && len <= kv->len);
    if (len < kv->len && kv->t->cfg.hybrid) restore_linear(kv, len);
    kv->len = len;
}

static void reserve(dfl_target_kv *kv, int64_t n, int64_t tap_elems, int64_t nrows) {
    const dfl_ops *ops = kv->t->ops;
    const dfl_model_config *c = &kv->t->cfg;
    const size_t a = (size_t)ops->act_bytes;
    const int64_t H = c->hidden_size, D = c->head_dim;
    const int64_t QD = c->num_attention_heads * D, KD = c->num_key_value_heads * D;
    if (n > kv->cap_n) {
        kv->x = dfl_target_regrow(ops, kv->x, (size_t)(n * H) * a);
        kv->h = dfl_target_regrow(ops, kv->h, (size_t)(n * H) * a);
        kv->q = dfl_target_regrow(ops, kv->q, (size_t)(n * QD) * a);
        kv->kpre = dfl_target_regrow(ops, kv->kpre, (size_t)(n * KD) * a);
        kv->ao = dfl_target_regrow(ops, kv->ao, (size_t)(n * (QD > KD ? QD : KD)) * a);
        dfl_target_mlp_reserve(kv->t, &kv->mlp, n);
        kv->ids = dfl_target_regrow(ops, kv->ids, (size_t)n * sizeof(int32_t));
        kv->pos = dfl_target_regrow(ops, kv->pos, (size_t)n * sizeof(int32_t));
        kv->blocks = dfl_target_regrow(ops, kv->blocks, (size_t)n * sizeof(dfl_block));
        if (c->sliding_window) kv->blk_win = dfl_target_regrow(ops, kv->blk_win, (size_t)n * sizeof(dfl_block));
        if (c->gpt_oss) kv->lse = dfl_target_regrow(ops, kv->lse, (size_t)(n * c->num_attention_heads) * sizeof(float));
        kv->host_pos = dfl_realloc(kv->host_pos, (size_t)n * sizeof(int32_t));
        kv->host_blocks = dfl_realloc(kv->host_blocks, (size_t)(2 * n) * sizeof(dfl_block));
        kv->cap_n = n;
    }
    if (tap_elems > kv->cap_taps) {
        kv->taps = dfl_target_regrow(ops, kv->taps, (size_t)tap_elems * a);
        kv->cap_taps = tap_elems;
    }
    dfl_target_head_reserve(kv->t, &kv->head, nrows);
    dfl_target_lin_reserve(kv->t, &kv->lin, n);
}

/* Room to keep n rows of Gated DeltaNet inputs for a crop. */
static void reserve_rollback(dfl_target_kv *kv, int64_t n) {
    const dfl_ops *ops = kv->t->ops;
    const dfl_model_config *c = &kv->t->cfg;
    const size_t a = (size_t)ops->act_bytes;
    const int64_t C = conv_channels(c);
    if (n <= kv->rb_cap) return;
    for (int l = 0; l < kv->nl; l++) {
        if (!kv->t->layers[l].linear) continue;
        kv->win[l] = dfl_target_regrow(ops, kv->win[l], (size_t)((c->lin_conv - 1 + n) * C) * a);
        kv->blk_qkv[l] = dfl_target_regrow(ops, kv->blk_qkv[l], (size_t)(n * C) * a);
        kv->blk_ba[l] = dfl_target_regrow(ops, kv->blk_ba[l], (size_t)(n * 2 * c->lin_v_heads) * a);
    }
    kv->rb_cap = n;
}

/* The request against what was loaded; *need = layers to run. */
static int check(const dfl_target_kv *kv, const int32_t *ids, int64_t n, const dfl_target_want *w, int *need) {
    const dfl_target *t = kv->t;
    const int L = (int)t->cfg.num_hidden_layers;
    if (n < 1) return dfl_err(DFL_EX_DATA, "target: a cached forward needs at least one token");
    if (kv->len + n > kv->cap)
        return dfl_err(DFL_EX_DATA, "target: %lld positions exceed the KV cache of %lld", (long long)(kv->len + n),
                       (long long)kv->cap);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->cfg.vocab_size)
            return dfl_err(DFL_EX_DATA, "target: token id %d is outside the vocabulary [0, %lld)", (int)ids[i],
                           (long long)t->cfg.vocab_size);
    if (w->ntaps < 0 || w->ntaps > 64) return dfl_err(DFL_EX_USAGE, "target: %d taps requested (at most 64)", w->ntaps);
    /* Every cached layer runs, whatever the taps: a later position needs the
     * keys and values of all of them. */
    *need = kv->nl;
    for (int j = 0; j < w->ntaps; j++)
        if (w->taps[j] < 0 || w->taps[j] >= L)
            return dfl_err(DFL_EX_USAGE, "layer id %d is outside [0, %d) for this %d-layer model", w->taps[j], L, L);
        else if (w->taps[j] >= kv->nl)
            return dfl_err(DFL_EX_USAGE, "target: layer %d requested but only %d layers were loaded", w->taps[j], kv->nl);
    if ((w->last_hidden || w->normed || w->argmax) && kv->nl < L)
        return dfl_err(DFL_EX_USAGE, "target: the last layer's output needs all %d layers loaded", L);
    if ((w->normed || w->argmax) && !t->head)
        return dfl_err(DFL_EX_USAGE, "target: the final norm and LM head were not loaded");
    if (w->rows)
        for (int64_t i = 0; i < w->nrows; i++)
            if (w->rows[i] < 0 || w->rows[i] >= n)
                return dfl_err(DFL_EX_USAGE, "target: row %d is outside the %lld new rows", (int)w->rows[i], (long long)n);
    return dfl_target_check_sampling(w);
}

/* A Gated DeltaNet layer on the n new rows: from the cached state and
 * history, which it advances; with `keep`, also what a crop needs. */
static void linear_step(dfl_target_kv *kv, int l, int64_t n, int keep) {
    dfl_target *t = kv->t;
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t C = conv_channels(c), K1 = c->lin_conv - 1;
    const size_t sb = state_bytes(c), a = (size_t)ops->act_bytes;
    if (keep) {
        ops->copy(kv->win[l], kv->hist[l], (size_t)(K1 * C) * a);
        ops->copy(kv->pre[l], kv->S[l], sb);
    }
    dfl_target_linear_attn(t, &t->layers[l], &kv->lin, kv->x, kv->h, kv->cu, 1, n, kv->hist[l], kv->S[l], NULL);
    if (keep) {
        ops->copy(DFL_AT(ops, kv->win[l], K1 * C), kv->lin.raw, (size_t)(n * C) * a);
        ops->copy(kv->blk_qkv[l], kv->lin.conv, (size_t)(n * C) * a);
        ops->copy(kv->blk_ba[l], kv->lin.ba, (size_t)(n * 2 * c->lin_v_heads) * a);
    }
    /* the history is now the last K-1 raw rows of [history; new rows] */
    if (n >= K1) {
        ops->copy(kv->hist[l], DFL_AT(ops, kv->lin.raw, (n - K1) * C), (size_t)(K1 * C) * a);
    } else {
        ops->copy(kv->hist_tmp, DFL_AT(ops, kv->hist[l], n * C), (size_t)((K1 - n) * C) * a);
        ops->copy(DFL_AT(ops, kv->hist_tmp, (K1 - n) * C), kv->lin.raw, (size_t)(n * C) * a);
        void *swap = kv->hist[l];
        kv->hist[l] = kv->hist_tmp;
        kv->hist_tmp = swap;
    }
}

/* The keys of new rows i < n (at positions len + i) as attn_dflash blocks
 * of one query (B = 1): row len + i sees cache rows [max(0, len + i - W +
 * 1), len + i] (window W; 0: [0, len + i]); its own key is its "block". */
static void row_blocks(dfl_block *blk, int64_t len, int64_t n, int64_t window) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = len + i, lo = window > 0 && r - window + 1 > 0 ? r - window + 1 : 0;
        blk[i] = (dfl_block){.ctx_off = (int32_t)lo, .ctx_len = (int32_t)(r - lo), .blk_off = (int32_t)r};
    }
}

/* The attention of n new rows over the cache's NK = len + n rows into
 * kv->ao. */
static void attention_step(dfl_target_kv *kv, const layer_w *lw, int l, int64_t n) {
    const dfl_target *t = kv->t;
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t D = c->head_dim, Hq = c->num_attention_heads, Hkv = c->num_key_value_heads;
    const int64_t len = kv->len, NK = len + n;
    float *lse = lw->sinks ? kv->lse : NULL; /* gpt-oss: its sinks need the lse */
    if (len == 0) /* prefill: the packed forward's call */
        ops->attn_causal(kv->ao, lse, kv->q, kv->k[l], kv->v[l], kv->cu, 1, n, Hq, Hkv, D, lw->window);
    else if (lw->window && NK > lw->window) /* the window cuts: each row its window */
        ops->attn_dflash(kv->ao, lse, kv->q, kv->k[l], kv->v[l], kv->blk_win, n, 1, NK, Hq, Hkv, D, 0);
    else
        ops->attn_dflash(kv->ao, lse, kv->q, kv->k[l], kv->v[l], kv->blocks, n, 1, NK, Hq, Hkv, D, 0);
    if (lse) ops->attn_sinks(kv->ao, lse, lw->sinks, n, Hq, D);
}

static void layer_step(dfl_target_kv *kv, int l, int64_t n) {
    dfl_target *t = kv->t;
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const layer_w *lw = &t->layers[l];
    const int64_t H = c->hidden_size, D = c->head_dim;
    const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads, KD = Hkv * D;
    const int64_t len = kv->len;
    void *kdst = DFL_AT(ops, kv->k[l], len * KD), *vdst = DFL_AT(ops, kv->v[l], len * KD);

    dfl_target_norm(t, kv->h, kv->x, lw->in_norm, n, H);
    /* with q/k norms: project into ao / kpre, then norm + rotate into q / the cache */
    void *qsrc = c->qk_norm ? kv->ao : kv->q, *ksrc = c->qk_norm ? kv->kpre : kdst;
    dfl_target_proj(t, qsrc, kv->h, lw->q, lw->q_bias, n, H, Hq * D);
    dfl_target_qk_rope(t, kv->q, qsrc, lw->q_norm, kv->pos, n, Hq);
    dfl_target_proj(t, ksrc, kv->h, lw->k, lw->k_bias, n, H, KD);
    dfl_target_qk_rope(t, kdst, ksrc, lw->k_norm, kv->pos, n, Hkv);
    dfl_target_proj(t, vdst, kv->h, lw->v, lw->v_bias, n, H, KD);
    attention_step(kv, lw, l, n);
    if (lw->attn_gate) { /* Qwen3.5: attn * sigmoid(h Wgate^T) */
        dfl_target_matmul(t, kv->lin.agate, kv->h, lw->attn_gate, n, H, Hq * D, 0);
        ops->sigmoid_mul(kv->ao, kv->ao, kv->lin.agate, n * Hq * D);
    }
    dfl_target_matmul(t, kv->x, kv->ao, lw->o, n, Hq * D, H, 1);
    if (lw->o_bias) ops->add_bias(kv->x, lw->o_bias, n, H);

    dfl_target_norm(t, kv->h, kv->x, lw->post_norm, n, H);
    dfl_target_mlp(t, lw, &kv->mlp, kv->x, kv->h, n);
}

int dfl_target_kv_forward(dfl_target_kv *kv, dfl_target_out *out, const int32_t *ids, int64_t n,
                          const dfl_target_want *w) {
    memset(out, 0, sizeof *out);
    dfl_target *t = kv->t;
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size;
    int need = 0, rc = check(kv, ids, n, w, &need);
    if (rc) return rc;
    const int64_t nrows = (w->normed || w->argmax) ? (w->rows ? w->nrows : n) : 0;
    reserve(kv, n, (int64_t)w->ntaps * n * H, nrows);

    for (int64_t i = 0; i < n; i++) kv->host_pos[i] = (int32_t)(kv->len + i);
    const int32_t cu[2] = {0, (int32_t)n};
    ops->upload(kv->ids, ids, (size_t)n * sizeof(int32_t));
    ops->upload(kv->pos, kv->host_pos, (size_t)n * sizeof(int32_t));
    if (kv->len > 0) { /* past the prefill (attn_causal): each row's keys as a block of one query */
        row_blocks(kv->host_blocks, kv->len, n, 0);
        ops->upload(kv->blocks, kv->host_blocks, (size_t)n * sizeof(dfl_block));
        if (c->sliding_window && kv->len + n > c->sliding_window) {
            row_blocks(kv->host_blocks + n, kv->len, n, c->sliding_window);
            ops->upload(kv->blk_win, kv->host_blocks + n, (size_t)n * sizeof(dfl_block));
        }
    }
    ops->upload(kv->cu, cu, sizeof cu);

    const int keep = c->hybrid && w->may_crop;
    if (keep) reserve_rollback(kv, n);
    ops->embed(kv->x, kv->ids, t->embed, n, H);
    for (int l = 0; l < need; l++) {
        if (t->layers[l].linear) {
            dfl_target_norm(t, kv->h, kv->x, t->layers[l].in_norm, n, H);
            linear_step(kv, l, n, keep);
            dfl_target_norm(t, kv->h, kv->x, t->layers[l].post_norm, n, H);
            dfl_target_mlp(t, &t->layers[l], &kv->mlp, kv->x, kv->h, n);
        } else {
            layer_step(kv, l, n);
        }
        dfl_target_keep_taps(t, kv->taps, kv->x, w, l, n);
    }
    kv->rb_start = kv->len;
    kv->rb_n = keep ? n : 0;
    kv->len += n;
    dfl_target_finish(t, out, &kv->head, kv->x, kv->taps, w, n, nrows);
    return 0;
}
