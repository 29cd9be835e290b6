/* test_score_cache.c: the caches of the online loop, and the loop itself.
 *
 * Oracles:
 *   target KV cache  the packed full-sequence forward (dfl_target_forward,
 *                    itself checked against transformers in test_target):
 *                    prefill + extensions of various sizes + a rejected block
 *                    cropped away must give every row's taps, pre-norm output
 *                    and argmax of the full forward. Both compute in f32 and
 *                    differ only by summation order (attention walks its keys
 *                    in other tiles), so the normalised error is ~1e-14;
 *                    TOL = 1e-10 catches any wrong position, missing key or
 *                    stale cache row (those give > 1e-3: checked below).
 *   drafter cache    dfl_drafter_forward on the training path's batch (one
 *                    block, context = every position before the anchor),
 *                    at every anchor of a sequence fed in uneven chunks.
 *   the loop         greedy decoding of the target: the speculative output
 *                    must equal it token for token (lossless), and its cycle
 *                    records must obey the reference's bookkeeping. Each
 *                    cycle's length: the drafter's block at its anchor
 *                    through the training path (context = the taps of one
 *                    full forward of prompt + greedy continuation), 1 + the
 *                    predictions matching the greedy tokens up to the first
 *                    mismatch; tau must be their mean. A loop that stops one
 *                    token early (or counts a match after a mismatch) can
 *                    stay lossless; it fails here. With a random drafter
 *                    almost every cycle has length 1, so the loop also runs
 *                    with a planted one (plant()) whose lengths reach B.
 */
#include "common.h"
#include "drafter.h"
#include "drafter_infer.h"
#include "ops.h"
#include "rng.h"
#include "safetensors.h"
#include "score.h"
#include "target.h"
#include "test.h"
#include "train.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-10
#define WRONG_MIN 1e-3

static const char *FIX = "tests/fixtures/targets";

static dfl_target *load_target(const char *name) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", FIX, name);
    dfl_target *t = NULL;
    dfl_target_opts o = {0, 1};
    if (dfl_target_load(&t, p, dfl_ops_cpu(), &o)) fprintf(stderr, "  %s\n", dfl_errmsg());
    return t;
}

/* ---- target KV cache ------------------------------------------------------------ */

typedef struct {
    float *taps, *last; /* [T, L*H], [T, H] */
    int32_t *argmax;    /* [T] */
    float *gap;
} rows;

static void rows_alloc(rows *r, int64_t T, int64_t L, int64_t H) {
    r->taps = dfl_calloc((size_t)(T * L * H), sizeof(float));
    r->last = dfl_calloc((size_t)(T * H), sizeof(float));
    r->argmax = dfl_calloc((size_t)T, sizeof(int32_t));
    r->gap = dfl_calloc((size_t)T, sizeof(float));
}

static void rows_free(rows *r) {
    free(r->taps);
    free(r->last);
    free(r->argmax);
    free(r->gap);
}

/* Copy a forward's n rows into r at row0. */
static void rows_put(rows *r, dfl_target *t, const dfl_target_out *o, int64_t row0, int64_t n) {
    const dfl_ops *ops = dfl_target_ops(t);
    const int64_t H = dfl_target_config(t)->hidden_size, L = o->ntaps;
    dfl_target_taps_to_f32(t, o, 0, n, r->taps + row0 * L * H);
    ops->act_to_f32(r->last + row0 * H, o->last_hidden, n * H);
    ops->download(r->argmax + row0, o->argmax, (size_t)n * sizeof(int32_t));
    ops->download(r->gap + row0, o->gap, (size_t)n * sizeof(float));
}

static void check_kv(const char *name) {
    dfl_target *t = load_target(name);
    if (!t) {
        T_CHECK(0);
        return;
    }
    const dfl_model_config *c = dfl_target_config(t);
    const int L = (int)c->num_hidden_layers;
    const int64_t H = c->hidden_size, T = 41;
    int taps[64];
    for (int k = 0; k < L; k++) taps[k] = k;
    int32_t ids[64], wrong[8];
    dfl_rng r;
    dfl_rng_seed(&r, 11);
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)dfl_rng_below(&r, (uint64_t)c->vocab_size);
    for (int i = 0; i < 8; i++) wrong[i] = (int32_t)dfl_rng_below(&r, (uint64_t)c->vocab_size);

    /* the oracle: one full forward */
    rows full, inc;
    rows_alloc(&full, T, L, H);
    rows_alloc(&inc, T, L, H);
    int32_t cu[2] = {0, (int32_t)T};
    dfl_target_batch b = {ids, cu, 1};
    dfl_target_want w = {.ntaps = L, .taps = taps, .last_hidden = 1, .argmax = 1};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    rows_put(&full, t, &o, 0, T);

    /* incremental: prefill 7, then 1, 6 (a verify block), 3, 1, ... with a
     * wrong block run and cropped away twice on the way, and twice a block
     * accepted in part (its first rows right, the rest wrong, cropped back
     * into the block: what the speculative loop does; a hybrid target must
     * restore its recurrent state from the middle of the block) */
    dfl_target_kv *kv = dfl_target_kv_new(t, T + 8);
    const int64_t steps[] = {7, 1, 6, 3, 1, 1, 6, 5, 2, 6, 3};
    int64_t pos = 0;
    w.may_crop = 1;
    for (size_t s = 0; s < sizeof steps / sizeof steps[0] && pos < T; s++) {
        int64_t n = steps[s] < T - pos ? steps[s] : T - pos;
        if (s == 3 || s == 7) { /* a rejected block: run it, then crop it off */
            T_CHECK(dfl_target_kv_forward(kv, &o, wrong, 6, &w) == 0);
            T_CHECK(dfl_target_kv_len(kv) == pos + 6);
            dfl_target_kv_crop(kv, pos);
        }
        if ((s == 2 || s == 8) && n > 1) { /* a block of n right rows, then 6 - n wrong ones */
            int32_t blk[6];
            memcpy(blk, ids + pos, (size_t)n * sizeof *blk);
            memcpy(blk + n, wrong, (size_t)(6 - n) * sizeof *blk);
            T_CHECK(dfl_target_kv_forward(kv, &o, blk, 6, &w) == 0);
            rows_put(&inc, t, &o, pos, n);
            dfl_target_kv_crop(kv, pos + n - 1); /* keep all but the last right row, as after a partial accept */
            pos += n - 1;
            n = 1;
        }
        int rc = dfl_target_kv_forward(kv, &o, ids + pos, n, &w);
        T_CHECKF(rc == 0, "%s", dfl_errmsg());
        if (rc) break;
        rows_put(&inc, t, &o, pos, n);
        pos += n;
        T_CHECK(dfl_target_kv_len(kv) == pos);
    }
    T_CHECK(pos == T);
    double e_taps = t_nmse_f32(inc.taps, full.taps, T * L * H), e_last = t_nmse_f32(inc.last, full.last, T * H);
    int64_t mism = 0, compared = 0;
    for (int64_t i = 0; i < T; i++) {
        if (full.gap[i] <= 1e-4) continue; /* a genuine near-tie */
        compared++;
        mism += inc.argmax[i] != full.argmax[i];
    }
    /* Qwen3.5: rounding differences grow through the DeltaNet's norm (see
     * test_target.c, HYBRID_TOL) */
    const double tol = c->hybrid ? 1e-8 : TOL;
    T_CHECKF(e_taps < tol && e_last < tol, "%s: taps nmse %.3g, last nmse %.3g", name, e_taps, e_last);
    T_CHECKF(mism == 0 && compared > T / 2, "%s: argmax %lld of %lld differ", name, (long long)mism, (long long)compared);
    /* the check is sensitive: rows one position off differ */
    double shifted = t_nmse_f32(inc.last + H, full.last, (T - 1) * H);
    T_CHECKF(shifted > WRONG_MIN, "%s: shifted rows nmse %.3g", name, shifted);
    /* a cache that forgot the crop (the rejected block still in it) is wrong */
    dfl_target_kv_crop(kv, 0);
    T_CHECK(dfl_target_kv_forward(kv, &o, ids, 10, &w) == 0);
    T_CHECK(dfl_target_kv_forward(kv, &o, wrong, 3, &w) == 0);
    T_CHECK(dfl_target_kv_forward(kv, &o, ids + 10, 5, &w) == 0);
    rows_put(&inc, t, &o, 10, 5);
    double stale = t_nmse_f32(inc.last + 10 * H, full.last + 10 * H, 5 * H);
    T_CHECKF(stale > WRONG_MIN, "%s: stale cache rows nmse %.3g", name, stale);
    /* capacity and ids are checked */
    dfl_target_kv_crop(kv, 0);
    T_CHECK(dfl_target_kv_forward(kv, &o, ids, T + 9, &w) == DFL_EX_DATA);
    int32_t bad = (int32_t)c->vocab_size;
    T_CHECK(dfl_target_kv_forward(kv, &o, &bad, 1, &w) == DFL_EX_DATA);
    fprintf(stderr, "  %s: taps nmse %.2e, last nmse %.2e, argmax %lld/%lld compared, shifted %.2e, stale %.2e\n", name,
            e_taps, e_last, (long long)compared, (long long)T, shifted, stale);
    dfl_target_kv_free(kv);
    rows_free(&full);
    rows_free(&inc);
    dfl_target_free(t);
}

static void test_kv_qwen3_untied(void) { check_kv("qwen3-untied"); }
static void test_kv_qwen3_tied(void) { check_kv("qwen3-tied"); }
static void test_kv_llama3(void) { check_kv("llama3"); }
static void test_kv_qwen2(void) { check_kv("qwen2"); }
static void test_kv_gpt_oss(void) { check_kv("gpt-oss"); }
static void test_kv_gpt_oss_mxfp4(void) { check_kv("gpt-oss-mxfp4"); }
static void test_kv_qwen3_next(void) { check_kv("qwen3-next"); }
static void test_kv_mistral(void) { check_kv("mistral"); }
static void test_kv_qwen3_yarn(void) { check_kv("qwen3-yarn"); }
/* sliding windows (5, 7 and 6 of 41 rows): from the first verify step on, the
 * cache is longer than the window */
static void test_kv_qwen3_swa(void) { check_kv("qwen3-swa"); }
static void test_kv_mistral_swa(void) { check_kv("mistral-swa"); }
static void test_kv_qwen3_moe_swa(void) { check_kv("qwen3-moe-swa"); }
static void test_kv_qwen35(void) { check_kv("qwen35"); }
static void test_kv_qwen35_yarn(void) { check_kv("qwen35-yarn"); }

/* ---- drafter context cache ------------------------------------------------------ */

/* keys spliced into make_drafter's config (test_drafter_cache_sliding) */
static const char *drafter_extra = "";

static dfl_drafter *make_drafter(dfl_target *t, const char *name, int B, uint64_t seed, double scale) {
    const dfl_model_config *tc = dfl_target_config(t);
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"block_size\":%d,"
             "\"num_target_layers\":%lld,\"dflash_config\":{\"mask_token_id\":%lld,\"target_layer_ids\":[0,2,3]},"
             "\"hidden_size\":%lld,\"intermediate_size\":40,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
             "\"num_key_value_heads\":2,\"head_dim\":12,\"rms_norm_eps\":1e-6,\"rope_theta\":1000.0,"
             "\"vocab_size\":%lld%s}",
             B, (long long)tc->num_hidden_layers, (long long)tc->vocab_size - 1, (long long)tc->hidden_size,
             (long long)tc->vocab_size, drafter_extra);
    dfl_drafter_config c;
    if (dfl_drafter_config_parse(&c, cfg, strlen(cfg), "<test>")) {
        fprintf(stderr, "  %s\n", dfl_errmsg());
        return NULL;
    }
    dfl_drafter *d = dfl_drafter_new(dfl_target_ops(t), &c);
    dfl_drafter_config_free(&c);
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    float *h = dfl_malloc((size_t)d->nparams * 4);
    for (int i = 0; i < d->ntensors; i++) {
        const dfl_param_info *p = &d->info[i];
        for (int64_t j = 0; j < p->numel; j++)
            h[p->offset + j] = p->ndim == 2 ? (float)(scale * (2 * dfl_rng_uniform(&r) - 1))
                                            : (float)(1 + 0.2 * (2 * dfl_rng_uniform(&r) - 1));
    }
    dfl_drafter_set_master(d, h);
    free(h);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", FIX, name);
    if (dfl_drafter_load_target(d, dir, tc)) {
        fprintf(stderr, "  %s\n", dfl_errmsg());
        dfl_drafter_free(d);
        return NULL;
    }
    return d;
}

/* The target `name` in *t and make_drafter(*t, name, B, seed, scale) in *d;
 * 0, or -1 with a failed check and nothing left to free. */
static int open_pair(dfl_target **t, dfl_drafter **d, const char *name, int B, uint64_t seed, double scale) {
    *t = load_target(name);
    *d = *t ? make_drafter(*t, name, B, seed, scale) : NULL;
    T_CHECK(*d != NULL);
    if (*d) return 0;
    dfl_target_free(*t);
    return -1;
}

static void check_drafter_cache(void) {
    dfl_target *t;
    dfl_drafter *d;
    if (open_pair(&t, &d, "qwen3-untied", 5, 3, 0.4)) return;
    const dfl_drafter_config *c = &d->cfg;
    const int64_t T = 30, B = c->block_size, H = c->H, KH = c->K * H;
    dfl_rng r;
    dfl_rng_seed(&r, 5);
    int32_t ids[30];
    uint8_t mask[30];
    float *feats = dfl_malloc((size_t)(T * KH) * 4);
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)dfl_rng_below(&r, (uint64_t)c->V - 1), mask[i] = 1;
    for (int64_t i = 0; i < T * KH; i++) feats[i] = (float)(2 * dfl_rng_uniform(&r) - 1);
    dfl_train_opts o;
    dfl_train_opts_default(&o, (int)B);
    dfl_train_seq q = {T, ids, mask, feats, DFL_F32, NULL, NULL, DFL_F32};
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    dfl_train_stats st;
    float *ref = dfl_malloc((size_t)(B * H) * 4), *got = dfl_malloc((size_t)(B * H) * 4);
    int32_t *ref_pred = dfl_malloc((size_t)B * 4), draft[DFL_DRAFTER_MAX_BLOCK];

    dfl_drafter_cache *dc = dfl_drafter_cache_new(d, T);
    /* anchors 0 (no context at all), 3, 4, 9, 10, 11, 20, 29: uneven chunks of new context rows */
    const int32_t anchors[] = {0, 3, 4, 9, 10, 11, 20, 29};
    double worst = 0;
    int64_t mism = 0;
    for (size_t i = 0; i < sizeof anchors / sizeof anchors[0]; i++) {
        const int32_t a = anchors[i];
        /* the oracle: the training path's batch, one block at a */
        memset(&st, 0, sizeof st);
        dfl_train_mb_reset(&mb);
        dfl_train_mb_add(&mb, c, &o, &q, &a, 1, NULL);
        dfl_train_mb_run(d, &o, &mb, &st, 0);
        dfl_drafter_loss(d, &mb.b, 0, 0, NULL, ref_pred, NULL);
        d->ops->act_to_f32(ref, dfl_drafter_output(d), B * H);
        /* the cache: the rows since the last anchor, then the block */
        int64_t len = dfl_drafter_cache_len(dc);
        int rc = dfl_drafter_draft(dc, feats + len * KH, DFL_F32, a - len, ids[a], draft, got);
        T_CHECKF(rc == 0, "%s", dfl_errmsg());
        T_CHECK(dfl_drafter_cache_len(dc) == a);
        double e = t_nmse_f32(got, ref, B * H);
        if (e > worst) worst = e;
        for (int64_t k = 1; k < B; k++) mism += draft[k - 1] != ref_pred[k];
    }
    T_CHECKF(worst < TOL, "drafter cache vs forward: nmse %.3g", worst);
    T_CHECKF(mism == 0, "%lld drafted tokens differ", (long long)mism);
    /* sensitivity: a cache whose context is one row short is wrong */
    dfl_drafter_cache_crop(dc, 0);
    dfl_drafter_draft(dc, feats, DFL_F32, 19, ids[20], draft, got); /* block at 19, compared with the block at 20 */
    double off = t_nmse_f32(got, ref, B * H); /* ref: the last anchor (29) */
    T_CHECKF(off > WRONG_MIN, "a wrong context passes: %.3g", off);
    /* crop, then continue: equal to a fresh run */
    dfl_drafter_cache_crop(dc, 5);
    dfl_drafter_draft(dc, feats + 5 * KH, DFL_F32, T - 1 - 5, ids[T - 1], draft, got);
    double again = t_nmse_f32(got, ref, B * H);
    T_CHECKF(again < TOL, "after crop: nmse %.3g", again);
    T_CHECK(dfl_drafter_draft(dc, feats, DFL_F32, 2, ids[0], draft, NULL) == DFL_EX_DATA); /* past the capacity */
    fprintf(stderr, "  drafter cache%s: worst nmse %.2e over %zu anchors; wrong context %.2e\n",
            *drafter_extra ? " (sliding layer 0, window 7)" : "", worst, sizeof anchors / sizeof anchors[0], off);
    dfl_drafter_cache_free(dc);
    dfl_train_mb_free(&mb);
    free(feats);
    free(ref);
    free(got);
    free(ref_pred);
    dfl_drafter_free(d);
    dfl_target_free(t);
}

static void test_drafter_cache(void) { check_drafter_cache(); }
/* The same with a sliding window of 7 on layer 0: the cache keeps every
 * context row, and the attention's window picks the last ones, as the
 * training forward's mask does (anchors 9 to 29 have their context cut). */
static void test_drafter_cache_sliding(void) {
    drafter_extra = ",\"use_sliding_window\":true,\"sliding_window\":7,"
                    "\"layer_types\":[\"sliding_attention\",\"full_attention\"]";
    check_drafter_cache();
    drafter_extra = "";
}

/* The drafter's frozen copies of the target's embedding, LM head and final
 * norm (the KL loss normalises the target's states with it) from the
 * released Qwen3.5 layout: model.language_model.* names, a (1 + w) norm.
 * The target's own normed rows and argmax are the oracle. */
static void test_drafter_target_weights_qwen35_vlm(void) {
    dfl_target *t;
    dfl_drafter *d;
    if (open_pair(&t, &d, "qwen35-vlm", 5, 3, 0.4)) return;
    const dfl_ops *ops = dfl_target_ops(t);
    const int64_t H = dfl_target_config(t)->hidden_size, V = dfl_target_config(t)->vocab_size, T = 12;
    int32_t ids[12], cu[2] = {0, (int32_t)T}, pred[12];
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 37 + 5) % V);
    dfl_target_batch b = {ids, cu, 1};
    dfl_target_want w = {.last_hidden = 1, .normed = 1, .argmax = 1};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    float *ref = dfl_malloc((size_t)(T * H) * 4), *got = dfl_malloc((size_t)(T * H) * 4);
    void *normed = ops->alloc((size_t)(T * H) * (size_t)ops->act_bytes);
    int32_t *dpred = ops->alloc((size_t)T * 4);
    ops->act_to_f32(ref, o.normed, T * H);
    T_CHECK(d->target_norm_plus_one == 1);
    ops->rmsnorm1p(normed, o.last_hidden, d->target_norm, T, H, d->target_eps);
    ops->act_to_f32(got, normed, T * H);
    double e = t_nmse_f32(got, ref, T * H);
    T_CHECKF(e < 1e-12, "the drafter's copy of the final norm: nmse %.3g", e);
    ops->lmhead_argmax(dpred, NULL, normed, d->lm_head, T, H, V);
    ops->download(pred, dpred, sizeof pred);
    T_CHECK(!memcmp(pred, o.argmax, sizeof pred));
    /* the embedding: rows of model.language_model.embed_tokens.weight, read here from the file */
    dfl_st *st = NULL;
    const dfl_st_tensor *emb = NULL;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/qwen35-vlm", FIX);
    T_CHECK(dfl_st_open_dir(&st, dir) == 0 && (emb = dfl_st_find(st, "model.language_model.embed_tokens.weight")));
    if (emb) {
        float *all = dfl_malloc((size_t)emb->numel * 4);
        dfl_st_to_f32(emb, all);
        ops->upload(dpred, ids, sizeof ids);
        ops->embed(normed, dpred, d->embed, T, H);
        ops->act_to_f32(got, normed, T * H);
        int64_t bad = 0;
        for (int64_t i = 0; i < T; i++) bad += memcmp(got + i * H, all + (int64_t)ids[i] * H, (size_t)H * 4) != 0;
        T_CHECKF(bad == 0, "%lld embedding rows differ from the file's", (long long)bad);
        free(all);
    }
    dfl_st_close(st);
    fprintf(stderr, "  qwen35-vlm: drafter's final norm vs the target's nmse %.2e, argmax equal\n", e);
    ops->free(normed);
    ops->free(dpred);
    free(ref);
    free(got);
    dfl_drafter_free(d);
    dfl_target_free(t);
}

/* ---- the loop ------------------------------------------------------------------------ */

/* Point the drafter's mask token at token x: its embedding row becomes a
 * large multiple of x's LM-head row, so the residual stream of every mask
 * slot is dominated by it (the layers read it through their pre-norms) and
 * the drafter predicts x at every slot, whatever its context. Run against a
 * greedy continuation that repeats x, whole blocks are accepted, and
 * partial accepts with later matches after the first mismatch are common:
 * the random drafter alone accepts a draft token about once in 200 cycles.
 * The CPU's compute weights are the f32 host arrays. */
static void plant(dfl_drafter *d, int32_t x) {
    const int64_t H = d->cfg.H;
    DFL_ASSERT(d->ops->wt_bytes == 4);
    float *emb = d->embed, row[256];
    const float *head = d->lm_head;
    DFL_ASSERT(H <= 256);
    double ne = 0, nh = 0;
    for (int64_t j = 0; j < H; j++) {
        ne += (double)emb[j] * emb[j]; /* row 0's norm: the scale of the embeddings */
        nh += (double)head[x * H + j] * head[x * H + j];
        row[j] = head[x * H + j];
    }
    const double f = 30 * sqrt(ne / nh);
    for (int64_t j = 0; j < H; j++) emb[d->cfg.mask_token_id * H + j] = (float)(f * row[j]);
}

/* The token most frequent in v[0..n) (the smallest id among equals). */
static int32_t most_frequent(const int32_t *v, int64_t n) {
    int32_t best = v[0];
    int64_t bc = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t c = 0;
        for (int64_t j = 0; j < n; j++) c += v[j] == v[i];
        if (c > bc || (c == bc && v[i] < best)) best = v[i], bc = c;
    }
    return best;
}

/* The oracle of one cycle: the drafter's block at anchor a through the
 * training path (one block; context = every position before a, the target's
 * taps from one full forward of prompt + greedy continuation, in bf16 as the
 * loop's), its argmax at slots 1..B-1 (slot k predicts position a+k; slot 0
 * holds the anchor's token, position a) compared with the greedy tokens at
 * a+1, a+2, ... up to the first mismatch. The cycle's length: 1 + the
 * leading matches (the reference's a + 1, the bonus included). *gap: the
 * least top-1 minus top-2 logit of the slots that decided it (the matches
 * and the first mismatch), to tell near-ties apart (host memory: the CPU's
 * ops). */
static int32_t oracle_len(dfl_drafter *d, dfl_train_mb *mb, const dfl_train_opts *o, const dfl_train_seq *q, int32_t a,
                          int32_t *pred, float *gap) {
    const int64_t B = d->cfg.block_size;
    int32_t top[DFL_DRAFTER_MAX_BLOCK];
    float gaps[DFL_DRAFTER_MAX_BLOCK];
    dfl_train_stats st;
    memset(&st, 0, sizeof st);
    dfl_train_mb_reset(mb);
    dfl_train_mb_add(mb, &d->cfg, o, q, &a, 1, NULL);
    dfl_train_mb_run(d, o, mb, &st, 0);
    dfl_drafter_loss(d, &mb->b, 0, 0, NULL, pred, NULL);
    d->ops->lmhead_argmax(top, gaps, dfl_drafter_output(d), d->lm_head, B, d->cfg.H, d->cfg.V);
    int32_t m = 0;
    while (m < B - 1 && pred[m + 1] == q->ids[a + m + 1]) m++;
    *gap = INFINITY;
    for (int64_t k = 1; k <= m + 1 && k < B; k++)
        if (gaps[k] < *gap) *gap = gaps[k];
    return m + 1;
}

/* The loop drafts from the taps of its cached forwards, the oracle from one
 * full forward: equal up to f32 summation order, but a tap on a bf16
 * rounding boundary may round the other way (one bf16 step, 0.4%).
 * Scaling every feature by a factor in [0.998, 1.002] moved the drafter's
 * logit gaps by < 1e-2 (measured: 8e-3 at most), one feature's step far
 * less; a cycle decided by a smaller gap (the random drafter's least is
 * ~2e-4: 9 and 12 of its cycles) is not compared. */
#define NEAR_TIE 1e-2

#define LOOP_NEW 40

/* `planted`: before each prompt, plant() the token most frequent in the
 * target's greedy continuation. */
static void check_loop(dfl_drafter *d, dfl_target *t, const char *what, int planted, double *tau, double *tau_oracle) {
    const dfl_model_config *tc = dfl_target_config(t);
    const dfl_drafter_config *dcfg = &d->cfg;
    const int64_t B = dcfg->block_size, KH = (int64_t)dcfg->K * dcfg->H;
    dfl_target_kv *kv = dfl_target_kv_new(t, 200);
    dfl_drafter_cache *dc = dfl_drafter_cache_new(d, 200);
    dfl_gen_result g = {0}, s = {0}, full = {0};
    dfl_rng r;
    dfl_rng_seed(&r, 9);
    int64_t mism = 0, cycles = 0, bad_books = 0, bad_len = 0, not_prefix = 0, near_ties = 0;
    int64_t len_sum = 0, oracle_sum = 0, hist[DFL_DRAFTER_MAX_BLOCK + 1] = {0};
    char first[160] = "";
    dfl_train_opts to;
    dfl_train_opts_default(&to, (int)B);
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    int32_t pred[DFL_DRAFTER_MAX_BLOCK];
    float least = INFINITY; /* the least deciding gap of the compared cycles */
    const int64_t lens[] = {1, 2, 5, 13, 30};
    for (size_t p = 0; p < sizeof lens / sizeof lens[0]; p++) {
        int32_t prompt[64];
        for (int64_t i = 0; i < lens[p]; i++) prompt[i] = (int32_t)dfl_rng_below(&r, (uint64_t)tc->vocab_size - 1);
        /* the oracle's sequence: the prompt and the target's greedy
         * continuation past every block the loop can verify (no stop token) */
        dfl_gen_opts fo = {.max_new = LOOP_NEW + B};
        T_CHECK(dfl_greedy_generate(t, kv, prompt, lens[p], &fo, &full) == 0);
        T_CHECK(full.n == LOOP_NEW + B);
        const int64_t T = lens[p] + full.n;
        int32_t seq[128], olen[128] = {0}; /* olen[a]: the oracle's length at anchor a, 0 = not yet run */
        float ogap[128];                    /* its least deciding gap */
        uint8_t mask[128];
        DFL_ASSERT(T <= 128);
        memcpy(seq, prompt, (size_t)lens[p] * sizeof *seq);
        memcpy(seq + lens[p], full.ids, (size_t)full.n * sizeof *seq);
        memset(mask, 1, sizeof mask);
        int32_t cu[2] = {0, (int32_t)T};
        dfl_target_batch tb = {seq, cu, 1};
        dfl_target_want tw = {.ntaps = dcfg->K, .taps = dcfg->layer_ids};
        dfl_target_out to_out;
        uint16_t *feats = dfl_malloc((size_t)(T * KH) * sizeof *feats);
        T_CHECK(dfl_target_forward(t, &to_out, &tb, &tw) == 0);
        dfl_target_taps_to_bf16(t, &to_out, 0, T, feats);
        dfl_train_seq q = {T, seq, mask, feats, DFL_BF16, NULL, NULL, DFL_F32};
        if (planted) plant(d, most_frequent(full.ids, LOOP_NEW));
        for (int eos = 0; eos < 2; eos++) {
            /* with eos: stop at the target's own greedy token number 7, so both must stop there */
            dfl_gen_opts go = {.max_new = LOOP_NEW};
            T_CHECK(dfl_greedy_generate(t, kv, prompt, lens[p], &go, &g) == 0);
            int64_t stop_tok = g.n > 7 ? g.ids[7] : -1;
            if (eos) {
                go.n_eos = 1;
                go.eos = &stop_tok;
                T_CHECK(dfl_greedy_generate(t, kv, prompt, lens[p], &go, &g) == 0);
            }
            not_prefix += g.n > full.n || memcmp(g.ids, full.ids, (size_t)g.n * sizeof *g.ids) != 0;
            int rc = dfl_spec_generate(t, kv, d, dc, prompt, lens[p], &go, &s);
            T_CHECKF(rc == 0, "%s", dfl_errmsg());
            mism += s.n != g.n || memcmp(s.ids, g.ids, (size_t)g.n * 4) != 0;
            if (!eos) T_CHECK(g.n == LOOP_NEW);
            /* bookkeeping of the reference: anchors start at the prompt's end
             * and advance by each cycle's length; the loop runs until the
             * output is long enough (or a stop token was committed) */
            int64_t pos = lens[p], sum = 0;
            for (int64_t c = 0; c < s.ncycles; c++) {
                bad_books += s.anchors[c] != pos || s.len[c] < 1 || s.len[c] > B;
                pos += s.len[c];
                sum += s.len[c];
                len_sum += s.len[c];
                /* each cycle's length: the oracle's at its anchor (a
                 * near-tie: the loop's own, not compared) */
                const int32_t a = s.anchors[c];
                int32_t want = 0;
                if (a >= lens[p] && a < lens[p] + LOOP_NEW) {
                    if (!olen[a]) olen[a] = oracle_len(d, &mb, &to, &q, a, pred, &ogap[a]);
                    want = olen[a];
                    if (ogap[a] < NEAR_TIE) {
                        near_ties++;
                        want = s.len[c];
                    } else if (ogap[a] < least) {
                        least = ogap[a];
                    }
                }
                oracle_sum += want;
                if (want >= 1 && want <= B) hist[want]++;
                if (s.len[c] != want && !bad_len++)
                    snprintf(first, sizeof first,
                             "prompt %zu (%lld tokens)%s, cycle %lld at anchor %d: length %d, oracle %d", p,
                             (long long)lens[p], eos ? " with a stop token" : "", (long long)c, a, s.len[c], want);
            }
            cycles += s.ncycles;
            if (!eos) bad_books += sum < LOOP_NEW || sum - s.len[s.ncycles - 1] >= LOOP_NEW; /* while start < n + 40 */
            /* with a stop token at output index i: the loop ends after the
             * first cycle that committed it (positions up to n + sum) */
            int64_t i = g.n - 1;
            if (eos) bad_books += sum < i || (s.ncycles > 1 && sum - s.len[s.ncycles - 1] >= i);
        }
        free(feats);
    }
    const char *kind = planted ? "planted" : "random";
    T_CHECKF(mism == 0, "%s %s drafter: %lld outputs differ from greedy decoding", what, kind, (long long)mism);
    T_CHECKF(bad_books == 0, "%s %s drafter: %lld cycle records break the reference's bookkeeping", what, kind,
             (long long)bad_books);
    T_CHECKF(not_prefix == 0, "%s: %lld greedy outputs are not a prefix of the longer one", what,
             (long long)not_prefix);
    T_CHECKF(bad_len == 0, "%s %s drafter: %lld of %lld cycle lengths differ from the oracle's; first: %s", what, kind,
             (long long)bad_len, (long long)cycles, first);
    /* the near-ties are few (the planted drafter's gaps are > 1) */
    T_CHECKF(near_ties * 10 <= cycles && (!planted || near_ties == 0), "%s %s drafter: %lld of %lld cycles near-ties",
             what, kind, (long long)near_ties, (long long)cycles);
    *tau = (double)len_sum / (double)cycles;
    *tau_oracle = (double)oracle_sum / (double)cycles;
    fprintf(stderr, "  %s %s drafter: lossless on %zu prompts x 2, pooled tau %.3f over %lld cycles; oracle lengths",
            what, kind, sizeof lens / sizeof lens[0], *tau, (long long)cycles);
    for (int64_t k = 1; k <= B; k++) fprintf(stderr, " %lld", (long long)hist[k]);
    fprintf(stderr, " (1..%lld); %lld near-ties not compared, least gap compared %.2e\n", (long long)B,
            (long long)near_ties, least);
    dfl_train_mb_free(&mb);
    dfl_gen_result_free(&g);
    dfl_gen_result_free(&s);
    dfl_gen_result_free(&full);
    dfl_drafter_cache_free(dc);
    dfl_target_kv_free(kv);
}

static void loop_lossless(const char *name) {
    for (int planted = 0; planted < 2; planted++) {
        dfl_target *t;
        dfl_drafter *d;
        if (open_pair(&t, &d, name, 5, 4, 0.3)) return;
        double tau, tau_oracle;
        check_loop(d, t, name, planted, &tau, &tau_oracle);
        /* tau: the mean of the oracle's lengths (near-ties: the loop's own);
         * integer sums over the same count, so equal, or a length is wrong */
        T_CHECKF(tau == tau_oracle, "%s %s drafter: tau %.6f, the oracle's %.6f", name, planted ? "planted" : "random",
                 tau, tau_oracle);
        dfl_drafter_free(d);
        dfl_target_free(t);
    }
}

static void test_loop_lossless(void) { loop_lossless("qwen3-untied"); }
/* The hybrid target: every partly accepted block restores the Gated
 * DeltaNet state from the middle of the verify forward. */
static void test_loop_lossless_qwen35(void) { loop_lossless("qwen35"); }

int main(void) {
    /* Hundreds of tiny forwards: on a loaded 2-core machine OpenMP barriers
     * would dominate; the parallel op paths are tested in test_ops_cpu. */
    omp_set_num_threads(1);
    T_RUN(test_kv_qwen3_untied);
    T_RUN(test_kv_qwen3_tied);
    T_RUN(test_kv_llama3);
    T_RUN(test_kv_qwen2);
    T_RUN(test_kv_gpt_oss);
    T_RUN(test_kv_gpt_oss_mxfp4);
    T_RUN(test_kv_qwen3_next);
    T_RUN(test_kv_mistral);
    T_RUN(test_kv_qwen3_yarn);
    T_RUN(test_kv_qwen3_swa);
    T_RUN(test_kv_mistral_swa);
    T_RUN(test_kv_qwen3_moe_swa);
    T_RUN(test_kv_qwen35);
    T_RUN(test_kv_qwen35_yarn);
    T_RUN(test_drafter_cache);
    T_RUN(test_drafter_cache_sliding);
    T_RUN(test_drafter_target_weights_qwen35_vlm);
    T_RUN(test_loop_lossless);
    T_RUN(test_loop_lossless_qwen35);
    return t_exit();
}
