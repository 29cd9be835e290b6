/* train.c: anchors, blocks, labels, loss weights, micro-batches, AdamW step. */
#include "train.h"

#include "common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void dfl_train_opts_default(dfl_train_opts *o, int block_size) {
    memset(o, 0, sizeof *o);
    o->anchors = 512;
    /* the paper's decay: 7 for B = 16, 5 for 10, 4 for 8 (spec §2.0) */
    o->gamma = block_size >= 16 ? 7.0 : block_size >= 10 ? 5.0 : 4.0;
    o->lr = 6e-4;
    o->warmup_ratio = 0.04;
    o->weight_decay = 0.0;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->adam_eps = 1e-8;
    o->max_grad_norm = 1.0;
    o->total_steps = 0;
    o->micro_rows = 16384;
}

double dfl_slot_weight(int k, double gamma) { return k >= 1 ? exp(-(double)(k - 1) / gamma) : 0.0; }

double dfl_lr_at(int64_t i, int64_t total, double warmup_ratio, double peak) {
    /* Past the schedule the rate stays at its end, 0: the cosine would
     * otherwise climb back to the peak (a resumed run longer than T). */
    if (i >= total) return 0.0;
    /* W <= total, and held there in integers: near INT64_MAX the double of
     * total rounds up to 2^63, which no int64_t holds (dflash-train-step
     * keeps total <= 2^53, where every step is exact) */
    double w = floor(warmup_ratio * (double)total);
    int64_t W = w < (double)total ? (int64_t)w : total;
    if (i < W) return peak * (double)(i + 1) / (double)W;
    int64_t span = total - W > 1 ? total - W : 1;
    return peak * 0.5 * (1.0 + cos(M_PI * (double)(i - W) / (double)span));
}

/* ---- anchors ------------------------------------------------------------------ */

int64_t dfl_anchor_candidates(int32_t *cand, const uint8_t *loss_mask, int64_t T) {
    int64_t n = 0;
    for (int64_t a = 0; a + 1 < T; a++)
        if (loss_mask[a] && loss_mask[a + 1]) cand[n++] = (int32_t)a;
    return n;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int64_t dfl_anchors_sample(int32_t *out, const uint8_t *loss_mask, int64_t T, int64_t max_anchors, dfl_rng *rng) {
    int64_t n = dfl_anchor_candidates(out, loss_mask, T);
    int64_t k = n < max_anchors ? n : max_anchors;
    /* partial Fisher-Yates: the first k entries become a uniform k-subset */
    for (int64_t i = 0; i < k && k < n; i++) {
        int64_t j = i + (int64_t)dfl_rng_below(rng, (uint64_t)(n - i));
        int32_t t = out[i];
        out[i] = out[j];
        out[j] = t;
    }
    qsort(out, (size_t)k, sizeof *out, cmp_i32);
    return k;
}

/* ---- micro-batches --------------------------------------------------------------- */

void dfl_train_mb_init(dfl_train_mb *mb) { memset(mb, 0, sizeof *mb); }

void dfl_train_mb_reset(dfl_train_mb *mb) {
    mb->b.NC = 0;
    mb->b.nblk = 0;
    mb->nseq = 0;
    mb->tokens = 0;
}

void dfl_train_mb_free(dfl_train_mb *mb) {
    if (mb->ops) mb->ops->host_free(mb->feats);
    else free(mb->feats);
    free(mb->ctx_pos);
    free(mb->blk_pos);
    free(mb->pos);
    free(mb->tokens_arr);
    free(mb->labels);
    free(mb->gscale);
    free(mb->valid);
    free(mb->metric_label);
    free(mb->blocks);
    free(mb->target_h);
    free(mb->streak);
    memset(mb, 0, sizeof *mb);
}

int64_t dfl_train_mb_rows(const dfl_train_mb *mb) { return mb->b.NC + mb->b.nblk * mb->B; }

static float to_f32(const void *p, dfl_dtype t, int64_t i) {
    switch (t) {
    case DFL_BF16: return dfl_bf16_to_f32(((const uint16_t *)p)[i]);
    case DFL_F16: return dfl_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static void grow(void **p, int64_t need, size_t esz) {
    *p = dfl_realloc(*p, (size_t)(need > 0 ? need : 1) * esz);
}

/* The features' room grown to `need` elements, the first `keep` kept: in
 * the device's host memory when the micro-batch has one (no realloc there).
 * Only between uploads: the last one was waited for (dfl_train_mb_run's
 * loss download) before the next sequence is added. */
static void grow_feats(dfl_train_mb *mb, int64_t need, int64_t keep) {
    if (!mb->ops) {
        grow(&mb->feats, need, mb->feat_esz);
        return;
    }
    void *p = mb->ops->host_alloc((size_t)(need > 0 ? need : 1) * mb->feat_esz);
    if (keep > 0) memcpy(p, mb->feats, (size_t)keep * mb->feat_esz);
    mb->ops->host_free(mb->feats);
    mb->feats = p;
}

void dfl_train_mb_add(dfl_train_mb *mb, const dfl_drafter_config *c, const dfl_train_opts *o, const dfl_train_seq *s,
                      const int32_t *anchors, int64_t n, dfl_rng *rng) {
    if (n <= 0) return;
    const int64_t B = c->block_size, KH = c->K * c->H, H = c->H, T = s->T;
    const int64_t C = anchors[n - 1]; /* rows 0..a_last-1: every block's context */
    const int64_t NC0 = mb->b.NC, nb0 = mb->b.nblk, NC = NC0 + C, nblk = nb0 + n, Q = nblk * B;
    if (mb->nseq == 0) {
        mb->B = (int)B;
        mb->b.feats_dtype = o->noise_std > 0 ? DFL_F32 : s->hidden_dtype;
        mb->feat_esz = dfl_dtype_size(mb->b.feats_dtype);
        mb->b.target_h_dtype = s->last_hidden ? s->last_dtype : DFL_F32;
        mb->th_esz = dfl_dtype_size(mb->b.target_h_dtype);
    }
    DFL_ASSERT(o->noise_std > 0 || s->hidden_dtype == mb->b.feats_dtype);
    if (NC > mb->cap_nc) {
        int64_t cap = NC * 2;
        grow_feats(mb, cap * KH, NC0 * KH);
        grow((void **)&mb->ctx_pos, cap, 4);
        mb->cap_nc = cap;
    }
    if (Q > mb->cap_q) {
        int64_t cap = Q * 2;
        grow((void **)&mb->blk_pos, cap, 4);
        grow((void **)&mb->tokens_arr, cap, 4);
        grow((void **)&mb->labels, cap, 4);
        grow((void **)&mb->gscale, cap, 4);
        grow((void **)&mb->valid, cap, 1);
        grow((void **)&mb->metric_label, cap, 4);
        grow((void **)&mb->blocks, cap / B + 1, sizeof(dfl_block));
        grow((void **)&mb->streak, cap / B + 1, sizeof(int32_t));
        if (o->kl) grow(&mb->target_h, cap * H, mb->th_esz);
        mb->cap_q = cap;
    }
    /* context features, positions 0..C-1 of this sequence */
    char *fd = (char *)mb->feats + (size_t)(NC0 * KH) * mb->feat_esz;
    if (o->noise_std > 0) {
        float *f = (float *)fd;
        for (int64_t i = 0; i < C * KH; i++)
            f[i] = to_f32(s->hidden, s->hidden_dtype, i) + (float)(o->noise_std * dfl_rng_normal(rng));
    } else if (C > 0) { /* no context (an anchor at 0): feats may still be NULL */
        memcpy(fd, s->hidden, (size_t)(C * KH) * mb->feat_esz);
    }
    for (int64_t t = 0; t < C; t++) mb->ctx_pos[NC0 + t] = (int32_t)t;
    /* blocks */
    for (int64_t j = 0; j < n; j++) {
        const int64_t a = anchors[j], jj = nb0 + j;
        mb->blocks[jj].ctx_off = (int32_t)NC0;
        mb->blocks[jj].ctx_len = (int32_t)a; /* positions strictly before the anchor */
        mb->blocks[jj].blk_off = (int32_t)(jj * B); /* + NC when the batch is closed */
        for (int64_t k = 0; k < B; k++) {
            const int64_t r = jj * B + k, p = a + k;
            mb->blk_pos[r] = (int32_t)p;
            mb->tokens_arr[r] = k == 0 ? s->ids[a] : (int32_t)c->mask_token_id;
            int ok = k > 0 && p < T && s->loss_mask[p];
            int32_t y = -1;
            if (ok) y = o->labels_target ? s->target_ids[p - 1] : s->ids[p]; /* slot k <-> token a+k */
            mb->labels[r] = y;
            mb->metric_label[r] = y;
            mb->valid[r] = (uint8_t)ok;
            mb->gscale[r] = ok ? (float)dfl_slot_weight((int)k, o->gamma) : 0.0f;
            if (o->kl) {
                /* the target's distribution for token a+k comes from position a+k-1 */
                int64_t src = p - 1 < 0 ? 0 : (p - 1 >= T ? T - 1 : p - 1);
                memcpy((char *)mb->target_h + (size_t)(r * H) * mb->th_esz,
                       (const char *)s->last_hidden + (size_t)(src * H) * mb->th_esz, (size_t)H * mb->th_esz);
            }
        }
    }
    mb->b.NC = NC;
    mb->b.nblk = nblk;
    mb->nseq++;
    mb->tokens += T;
}

/* Close the batch: positions [context; blocks], block key offsets after NC. */
static void mb_close(dfl_train_mb *mb, int B) {
    const int64_t NC = mb->b.NC, Q = mb->b.nblk * B;
    mb->pos = dfl_realloc(mb->pos, (size_t)(NC + Q > 0 ? NC + Q : 1) * 4);
    if (NC > 0) memcpy(mb->pos, mb->ctx_pos, (size_t)NC * 4); /* ctx_pos may be NULL without context */
    memcpy(mb->pos + NC, mb->blk_pos, (size_t)Q * 4);
    dfl_block *bl = mb->blocks;
    for (int64_t j = 0; j < mb->b.nblk; j++) bl[j].blk_off = (int32_t)(NC + j * B);
    mb->b.feats = mb->feats;
    mb->b.pos = mb->pos;
    mb->b.tokens = mb->tokens_arr;
    mb->b.blocks = mb->blocks;
    mb->b.labels = mb->labels;
    mb->b.gscale = mb->gscale;
    mb->b.target_h = mb->target_h;
}

void dfl_train_mb_run(dfl_drafter *d, const dfl_train_opts *o, dfl_train_mb *mb, dfl_train_stats *st, int backward) {
    const int B = d->cfg.block_size;
    const int64_t Q = mb->b.nblk * B;
    if (mb->b.nblk == 0) return;
    mb_close(mb, B);
    float *loss = dfl_malloc((size_t)Q * 4);
    int32_t *pred = dfl_malloc((size_t)Q * 4), *tpred = o->kl ? dfl_malloc((size_t)Q * 4) : NULL;
    dfl_drafter_forward(d, &mb->b);
    dfl_drafter_loss(d, &mb->b, o->kl, backward, loss, pred, tpred);
    if (o->kl)
        for (int64_t r = 0; r < Q; r++) mb->metric_label[r] = mb->valid[r] ? tpred[r] : -1;
    for (int64_t j = 0; j < mb->b.nblk; j++) {
        int streak = 1; /* still accepting */
        int64_t s = 0;
        for (int k = 1; k < B; k++) {
            const int64_t r = j * B + k;
            if (!mb->valid[r]) {
                streak = 0;
                continue;
            }
            const int ok = pred[r] == mb->metric_label[r];
            st->num += (double)mb->gscale[r] * (double)loss[r];
            st->den_w += (double)mb->gscale[r];
            st->den_c += 1.0;
            st->count[k]++;
            st->correct[k] += ok;
            if (streak && ok) s++;
            else streak = 0;
        }
        st->streak_sum += (double)s;
        st->nblocks++;
        mb->streak[j] = (int32_t)s;
    }
    st->nseq += mb->nseq;
    st->tokens += mb->tokens;
    st->block_tokens += Q;
    if (backward) dfl_drafter_backward(d, &mb->b);
    free(loss);
    free(pred);
    free(tpred);
}

/* ---- the optimizer step ----------------------------------------------------------- */

void dfl_train_apply(dfl_drafter *d, const dfl_train_opts *o, const dfl_train_stats *st, int64_t i, double *grad_norm,
                     double *lr_out) {
    const dfl_ops *ops = d->ops;
    const double den = o->norm_count ? st->den_c : st->den_w;
    DFL_ASSERT(den > 0);
    const double norm = sqrt(ops->sumsq(d->grad, d->nparams)) / den;
    double clip = 1.0;
    if (o->max_grad_norm > 0) {
        clip = o->max_grad_norm / (norm + 1e-6);
        if (clip > 1.0) clip = 1.0;
    }
    const double lr = dfl_lr_at(i, o->total_steps, o->warmup_ratio, o->lr);
    /* the compute weights follow in the same pass (dfl_drafter_sync_weights' work) */
    ops->adamw(d->master, d->wt, d->grad, d->m, d->v, d->nparams, (float)lr, (float)o->beta1, (float)o->beta2,
               (float)o->adam_eps, (float)o->weight_decay, (float)(clip / den), i + 1);
    if (grad_norm) *grad_norm = norm;
    if (lr_out) *lr_out = lr;
}

double dfl_train_loss(const dfl_train_opts *o, const dfl_train_stats *st) {
    const double den = o->norm_count ? st->den_c : st->den_w;
    return den > 0 ? st->num / den : 0.0;
}

double dfl_train_accuracy(const dfl_train_stats *st) {
    int64_t c = 0, n = 0;
    for (int k = 0; k < DFL_DRAFTER_MAX_BLOCK; k++) {
        c += st->correct[k];
        n += st->count[k];
    }
    return n ? (double)c / (double)n : 0.0;
}

double dfl_train_tau(const dfl_train_stats *st) {
    return st->nblocks ? st->streak_sum / (double)st->nblocks + 1.0 : 0.0;
}
