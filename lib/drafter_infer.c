/* drafter_infer.c: greedy drafting of one block with a context K/V cache.
 * The layer math is drafter.c's forward (spec §1.3-1.4) restricted to one
 * block; only the weights (d->W) and the target's frozen parts are shared. */
#include "drafter_infer.h"

#include "common.h"

#include <stdlib.h>
#include <string.h>

struct dfl_drafter_cache {
    dfl_drafter *d;
    int64_t cap, len;
    void **k, **v;             /* per layer: act [cap + B, Hkv*D]: context rows, then the block's */
    /* new context rows, grown as needed */
    int64_t cap_new;
    void *feats, *ctx_pre, *ctx, *kpre;      /* [n, K*H], [n, H], [n, H], [max(n, B), Hkv*D] */
    int32_t *pos_new;                        /* i32 [n] */
    /* the block (B rows) */
    void *h, *x, *qpre, *q, *att, *g, *u, *out; /* act */
    int32_t *pos_blk, *tokens, *pred;        /* i32 */
    dfl_block *block;
    int32_t *host_pos;
};

dfl_drafter_cache *dfl_drafter_cache_new(dfl_drafter *d, int64_t cap) {
    DFL_ASSERT(cap >= 1 && cap <= INT32_MAX - DFL_DRAFTER_MAX_BLOCK);
    DFL_ASSERT(d->embed && d->lm_head);
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    const size_t a = (size_t)ops->act_bytes, B = (size_t)c->block_size;
    const size_t H = (size_t)c->H, I = (size_t)c->I, QD = (size_t)(c->Hq * c->D), KVD = (size_t)(c->Hkv * c->D);
    dfl_drafter_cache *dc = dfl_calloc(1, sizeof *dc);
    dc->d = d;
    dc->cap = cap;
    dc->k = dfl_calloc((size_t)c->L, sizeof *dc->k);
    dc->v = dfl_calloc((size_t)c->L, sizeof *dc->v);
    for (int64_t l = 0; l < c->L; l++) {
        dc->k[l] = ops->alloc(((size_t)cap + B) * KVD * a);
        dc->v[l] = ops->alloc(((size_t)cap + B) * KVD * a);
    }
    dc->h = ops->alloc(B * H * a);
    dc->x = ops->alloc(B * H * a);
    dc->qpre = ops->alloc(B * QD * a);
    dc->q = ops->alloc(B * QD * a);
    dc->att = ops->alloc(B * QD * a);
    dc->g = ops->alloc(B * I * a);
    dc->u = ops->alloc(B * I * a);
    dc->out = ops->alloc(B * H * a);
    dc->pos_blk = ops->alloc(B * sizeof(int32_t));
    dc->tokens = ops->alloc(B * sizeof(int32_t));
    dc->pred = ops->alloc(B * sizeof(int32_t));
    dc->block = ops->alloc(sizeof(dfl_block));
    return dc;
}

void dfl_drafter_cache_free(dfl_drafter_cache *dc) {
    if (!dc) return;
    const dfl_ops *ops = dc->d->ops;
    for (int64_t l = 0; l < dc->d->cfg.L; l++) {
        ops->free(dc->k[l]);
        ops->free(dc->v[l]);
    }
    free(dc->k);
    free(dc->v);
    void *b[] = {dc->feats, dc->ctx_pre, dc->ctx, dc->kpre, dc->pos_new, dc->h, dc->x, dc->qpre, dc->q, dc->att,
                 dc->g, dc->u, dc->out, dc->pos_blk, dc->tokens, dc->pred, dc->block};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
        if (b[i]) ops->free(b[i]);
    free(dc->host_pos);
    free(dc);
}

int64_t dfl_drafter_cache_len(const dfl_drafter_cache *dc) { return dc->len; }

void dfl_drafter_cache_crop(dfl_drafter_cache *dc, int64_t len) {
    DFL_ASSERT(len >= 0 && len <= dc->len);
    dc->len = len;
}

static void reserve_new(dfl_drafter_cache *dc, int64_t n) {
    if (n <= dc->cap_new) return;
    const dfl_ops *ops = dc->d->ops;
    const dfl_drafter_config *c = &dc->d->cfg;
    const size_t a = (size_t)ops->act_bytes, H = (size_t)c->H, KVD = (size_t)(c->Hkv * c->D);
    const size_t rows = (size_t)(n > c->block_size ? n : c->block_size);
    void *b[] = {dc->feats, dc->ctx_pre, dc->ctx, dc->kpre, dc->pos_new};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
        if (b[i]) ops->free(b[i]);
    dc->feats = ops->alloc((size_t)n * (size_t)c->K * H * a);
    dc->ctx_pre = ops->alloc((size_t)n * H * a);
    dc->ctx = ops->alloc((size_t)n * H * a);
    dc->kpre = ops->alloc(rows * KVD * a);
    dc->pos_new = ops->alloc((size_t)n * sizeof(int32_t));
    dc->host_pos = dfl_realloc(dc->host_pos, rows * sizeof(int32_t));
    dc->cap_new = n;
}

/* Context rows [len, len+n): their K/V in every layer. */
static void append_context(dfl_drafter_cache *dc, const void *feats, dfl_dtype dtype, int64_t n) {
    dfl_drafter *d = dc->d;
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    const int64_t H = c->H, KH = c->K * H, KVD = c->Hkv * c->D;
    for (int64_t i = 0; i < n; i++) dc->host_pos[i] = (int32_t)(dc->len + i);
    ops->upload(dc->pos_new, dc->host_pos, (size_t)n * sizeof(int32_t));
    ops->load_act(dc->feats, feats, dtype, n * KH);
    ops->matmul(dc->ctx_pre, dc->feats, d->W.fc, n, KH, H, 0);
    ops->rmsnorm(dc->ctx, NULL, dc->ctx_pre, d->W.hidden_norm, n, H, c->eps);
    for (int64_t l = 0; l < c->L; l++) {
        const dfl_drafter_layer *W = &d->W.layer[l];
        void *kd = DFL_AT(ops, dc->k[l], dc->len * KVD), *vd = DFL_AT(ops, dc->v[l], dc->len * KVD);
        ops->matmul(dc->kpre, dc->ctx, W->k, n, H, KVD, 0);
        ops->qk_norm_rope(kd, NULL, dc->kpre, W->kn, 0, dc->pos_new, d->inv_freq, d->rope_scale, n, c->Hkv, c->D,
                          c->eps);
        ops->matmul(vd, dc->ctx, W->v, n, H, KVD, 0);
    }
    dc->len += n;
}

int dfl_drafter_draft(dfl_drafter_cache *dc, const void *feats, dfl_dtype dtype, int64_t n, int32_t anchor,
                      int32_t *draft, float *out) {
    dfl_drafter *d = dc->d;
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    const int64_t B = c->block_size, H = c->H, I = c->I, Hq = c->Hq, Hkv = c->Hkv, D = c->D;
    const int64_t QD = Hq * D, KVD = Hkv * D;
    DFL_ASSERT(n >= 0);
    if (dc->len + n > dc->cap)
        return dfl_err(DFL_EX_DATA, "drafter: %lld context positions exceed the cache of %lld",
                       (long long)(dc->len + n), (long long)dc->cap);
    reserve_new(dc, n > 0 ? n : 1);
    if (n > 0) append_context(dc, feats, dtype, n);

    /* the block: [anchor, mask x (B-1)] at positions len .. len+B-1 */
    const int64_t len = dc->len, NK = len + B;
    int32_t tok[DFL_DRAFTER_MAX_BLOCK];
    for (int64_t k = 0; k < B; k++) {
        tok[k] = k == 0 ? anchor : (int32_t)c->mask_token_id;
        dc->host_pos[k] = (int32_t)(len + k);
    }
    const dfl_block blk = {0, (int32_t)len, (int32_t)len};
    ops->upload(dc->tokens, tok, (size_t)B * sizeof(int32_t));
    ops->upload(dc->pos_blk, dc->host_pos, (size_t)B * sizeof(int32_t));
    ops->upload(dc->block, &blk, sizeof blk);
    ops->embed(dc->h, dc->tokens, d->embed, B, H);
    for (int64_t l = 0; l < c->L; l++) {
        const dfl_drafter_layer *W = &d->W.layer[l];
        void *kb = DFL_AT(ops, dc->k[l], len * KVD), *vb = DFL_AT(ops, dc->v[l], len * KVD);
        ops->rmsnorm(dc->x, NULL, dc->h, W->ln1, B, H, c->eps);
        ops->matmul(dc->qpre, dc->x, W->q, B, H, QD, 0);
        ops->qk_norm_rope(dc->q, NULL, dc->qpre, W->qn, 0, dc->pos_blk, d->inv_freq, d->rope_scale, B, Hq, D,
                          c->eps);
        ops->matmul(dc->kpre, dc->x, W->k, B, H, KVD, 0);
        ops->qk_norm_rope(kb, NULL, dc->kpre, W->kn, 0, dc->pos_blk, d->inv_freq, d->rope_scale, B, Hkv, D,
                          c->eps);
        ops->matmul(vb, dc->x, W->v, B, H, KVD, 0);
        /* no lse: no backward follows (and the CUDA forward then does not
         * count key tiles for one) */
        ops->attn_dflash(dc->att, NULL, dc->q, dc->k[l], dc->v[l], dc->block, 1, B, NK, Hq, Hkv, D,
                         dfl_model_config_window(&c->mc, l));
        ops->matmul(dc->h, dc->att, W->o, B, QD, H, 1);              /* h += attn Wo^T */
        ops->rmsnorm(dc->x, NULL, dc->h, W->ln2, B, H, c->eps);
        ops->matmul(dc->g, dc->x, W->gate, B, H, I, 0);
        ops->matmul(dc->u, dc->x, W->up, B, H, I, 0);
        ops->swiglu(dc->g, dc->g, dc->u, B * I);
        ops->matmul(dc->h, dc->g, W->down, B, I, H, 1);              /* h += mlp */
    }
    ops->rmsnorm(dc->out, NULL, dc->h, d->W.norm, B, H, c->eps);
    /* slot 0 is the anchor itself: only slots 1..B-1 are drafted */
    ops->lmhead_argmax(dc->pred, NULL, DFL_AT(ops, dc->out, H), d->lm_head, B - 1, H, c->V);
    ops->download(draft, dc->pred, (size_t)(B - 1) * sizeof(int32_t));
    if (out) ops->act_to_f32(out, dc->out, B * H);
    ops->sync();
    return 0;
}
