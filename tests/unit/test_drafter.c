/* test_drafter.c: the DFlash drafter and its training step.
 *
 * Oracles:
 *   - central finite differences of the loss for every parameter (tiny config);
 *   - PyTorch fixtures (tests/reference/make_drafter.py, float64, written from
 *     the spec): logits, per-slot losses, the loss, every parameter's gradient
 *     (CE and KL), the weights after three AdamW steps (torch.optim.AdamW,
 *     clip_grad_norm_, warm-up + cosine);
 *   - the visibility rule of spec §2.5, entry by entry and at the model level
 *     (perturbation of features and tokens);
 *   - the label, weight and anchor rules of spec §2.2, §2.6 written out here.
 * Thresholds are normalised errors sum (a-b)^2 / sum b^2: the C code is fp32
 * against a float64 reference, so forward quantities sit near 1e-13 and
 * gradients near 1e-11; the thresholds (1e-9 and 1e-7) leave room for
 * summation order, while any wrong term (a missing block, a shifted label,
 * a wrong weight) moves them above 1e-3.
 */
#include "checkpoint.h"
#include "common.h"
#include "drafter.h"
#include "ops.h"
#include "rng.h"
#include "safetensors.h"
#include "test.h"
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FIXTURE_DIR
#define FIXTURE_DIR "tests/fixtures/drafter"
#endif
/* the same case for a drafter whose layer 0 has a sliding window */
#define FIXTURE_DIR_SWA "tests/fixtures/drafter-swa"
static const char *fixture_dir = FIXTURE_DIR;

static const dfl_ops *ops;

/* ---- helpers ---------------------------------------------------------------- */

static int parse_cfg(dfl_drafter_config *c, const char *json) {
    return dfl_drafter_config_parse(c, json, strlen(json), "<test>");
}

/* The RoPE keys of cfg_text's configs (test_fd_yarn swaps in YaRN's). */
static const char *rope_keys = "\"rope_theta\":500.0";

/* A config string with the given sizes (Qwen3 drafter, z-lab layout). */
static char *cfg_text(int H, int I, int L, int Hq, int Hkv, int D, int V, int B, const char *ids, int ntl, int mask) {
    char *s = dfl_malloc(2048);
    snprintf(s, 2048,
             "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"block_size\":%d,"
             "\"num_target_layers\":%d,\"dflash_config\":{\"mask_token_id\":%d,\"target_layer_ids\":%s},"
             "\"hidden_size\":%d,\"intermediate_size\":%d,\"num_hidden_layers\":%d,\"num_attention_heads\":%d,"
             "\"num_key_value_heads\":%d,\"head_dim\":%d,\"hidden_act\":\"silu\",\"rms_norm_eps\":1e-6,"
             "%s,\"vocab_size\":%d,\"max_position_embeddings\":4096}",
             B, ntl, mask, ids, H, I, L, Hq, Hkv, D, rope_keys, V);
    return s;
}

/* Parse cfg_text(...) into c; returns parse_cfg's code. */
static int parse_sized(dfl_drafter_config *c, int H, int I, int L, int Hq, int Hkv, int D, int V, int B,
                       const char *ids, int ntl, int mask) {
    char *s = cfg_text(H, I, L, Hq, Hkv, D, V, B, ids, ntl, mask);
    int rc = parse_cfg(c, s);
    free(s);
    return rc;
}

static double frand(dfl_rng *r) { return dfl_rng_uniform(r) * 2.0 - 1.0; }
static double rng_normal_cb(void *r) { return dfl_rng_normal((dfl_rng *)r); }

/* Random weights: matrices uniform * scale, norms 1 + 0.2 uniform. */
static void random_master(dfl_drafter *d, dfl_rng *r, double scale) {
    float *h = dfl_malloc((size_t)d->nparams * 4);
    for (int t = 0; t < d->ntensors; t++) {
        const dfl_param_info *p = &d->info[t];
        for (int64_t i = 0; i < p->numel; i++)
            h[p->offset + i] = p->ndim == 2 ? (float)(scale * frand(r)) : (float)(1.0 + 0.2 * frand(r));
    }
    dfl_drafter_set_master(d, h);
    free(h);
}

static void random_target(dfl_drafter *d, dfl_rng *r) {
    size_t VH = (size_t)(d->cfg.V * d->cfg.H);
    float *e = dfl_malloc(VH * 4), *w = dfl_malloc(VH * 4), *n = dfl_malloc((size_t)d->cfg.H * 4);
    for (size_t i = 0; i < VH; i++) e[i] = (float)frand(r), w[i] = (float)(0.7 * frand(r));
    for (int64_t i = 0; i < d->cfg.H; i++) n[i] = (float)(1 + 0.2 * frand(r));
    dfl_drafter_set_target(d, e, w, n, 1e-5f);
    free(e);
    free(w);
    free(n);
}

/* A drafter of config c with random_master(scale) and random_target weights. */
static dfl_drafter *random_drafter(const dfl_drafter_config *c, dfl_rng *r, double scale) {
    dfl_drafter *d = dfl_drafter_new(ops, c);
    random_master(d, r, scale);
    random_target(d, r);
    return d;
}

typedef struct {
    int64_t T;
    int32_t ids[64], tids[64];
    uint8_t mask[64];
    float *hidden, *last;
} test_seq;

static void make_seq(test_seq *s, const dfl_drafter_config *c, int64_t T, int prompt, dfl_rng *r) {
    s->T = T;
    for (int64_t t = 0; t < T; t++) {
        s->ids[t] = (int32_t)dfl_rng_below(r, (uint64_t)c->V - 1);
        s->tids[t] = (int32_t)dfl_rng_below(r, (uint64_t)c->V - 1);
        s->mask[t] = t >= prompt;
    }
    s->hidden = dfl_malloc((size_t)(T * c->K * c->H) * 4);
    s->last = dfl_malloc((size_t)(T * c->H) * 4);
    for (int64_t i = 0; i < T * c->K * c->H; i++) s->hidden[i] = (float)frand(r);
    for (int64_t i = 0; i < T * c->H; i++) s->last[i] = (float)(2 * frand(r));
}

/* The small drafter of the model-level tests (H 8, 2/1 heads of 4, block 4,
 * taps [0,2] of a 4-layer target, L layers, vocab V with mask V-1) with
 * random_drafter(scale) weights, then one make_seq sequence of T tokens
 * (prompt P), all drawn from the seed. small_free frees the three. */
static dfl_drafter *small_drafter(dfl_drafter_config *c, dfl_rng *r, test_seq *a, int L, int V, uint64_t seed,
                                  double scale, int64_t T, int prompt) {
    T_CHECK(parse_sized(c, 8, 12, L, 2, 1, 4, V, 4, "[0,2]", 4, V - 1) == 0);
    dfl_rng_seed(r, seed);
    dfl_drafter *d = random_drafter(c, r, scale);
    make_seq(a, c, T, prompt, r);
    return d;
}

static void small_free(dfl_drafter_config *c, dfl_drafter *d, test_seq *a) {
    free(a->hidden), free(a->last);
    dfl_drafter_free(d);
    dfl_drafter_config_free(c);
}

static dfl_train_seq as_seq(const test_seq *s) {
    dfl_train_seq q = {s->T, s->ids, s->mask, s->hidden, DFL_F32, s->tids, s->last, DFL_F32};
    return q;
}

/* Loss sum(gscale * loss) of a batch (no backward), in double. */
static double batch_loss(dfl_drafter *d, dfl_train_mb *mb, int kl) {
    const int64_t Q = mb->b.nblk * d->cfg.block_size;
    float *loss = dfl_malloc((size_t)Q * 4);
    dfl_drafter_forward(d, &mb->b);
    dfl_drafter_loss(d, &mb->b, kl, 0, loss, NULL, NULL);
    double s = 0;
    for (int64_t i = 0; i < Q; i++) s += (double)mb->b.gscale[i] * loss[i];
    free(loss);
    return s;
}

/* Run a micro-batch through the training path once (to close it). */
static void close_mb(dfl_drafter *d, const dfl_train_opts *o, dfl_train_mb *mb) {
    dfl_train_stats st;
    memset(&st, 0, sizeof st);
    dfl_drafter_zero_grad(d);
    dfl_train_mb_run(d, o, mb, &st, 1);
}

/* ---- config, parameters, rules ------------------------------------------------- */

static void test_config(void) {
    dfl_drafter_config c;
    char *s = cfg_text(4096, 12288, 5, 32, 8, 128, 151936, 16, "[1,9,17,25,33]", 36, 151669);
    T_CHECK(parse_cfg(&c, s) == 0);
    T_CHECK(c.K == 5 && c.block_size == 16 && c.mask_token_id == 151669 && c.layer_ids[4] == 33);
    /* the released 8B inventory: 58 tensors, fc [H, K*H], 1,048,626,432 parameters */
    int n = dfl_drafter_params(&c, NULL);
    T_CHECKF(n == 58, "%d tensors", n);
    dfl_param_info *info = dfl_calloc((size_t)n, sizeof *info);
    dfl_drafter_params(&c, info);
    T_CHECK(!strcmp(info[0].name, "fc.weight") && info[0].shape[0] == 4096 && info[0].shape[1] == 20480);
    T_CHECK(!strcmp(info[2].name, "layers.0.self_attn.q_proj.weight"));
    T_CHECK(!strcmp(info[57].name, "norm.weight"));
    int64_t total = info[57].offset + info[57].numel;
    T_CHECKF(total == 1048626432, "%lld parameters", (long long)total);
    free(info);
    /* K taps need not equal the number of layers (spec §5.13) */
    json_t *j = dfl_drafter_config_json(&c);
    T_CHECK(json_integer_value(json_object_get(j, "block_size")) == 16);
    T_CHECK(json_array_size(json_object_get(json_object_get(j, "dflash_config"), "target_layer_ids")) == 5);
    json_decref(j);
    dfl_drafter_config_free(&c);
    free(s);
    T_CHECK(parse_sized(&c, 64, 96, 2, 4, 2, 16, 100, 8, "[0,3,5]", 8, 99) == 0 && c.K == 3 && c.L == 2);
    dfl_drafter_config_free(&c);
    /* block_size inside dflash_config (newer heads); written back there */
    const char *nested =
        "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"num_target_layers\":8,"
        "\"dflash_config\":{\"mask_token_id\":5,\"target_layer_ids\":[1,4],\"block_size\":10},"
        "\"hidden_size\":16,\"intermediate_size\":32,\"num_hidden_layers\":1,\"num_attention_heads\":2,"
        "\"num_key_value_heads\":1,\"head_dim\":8,\"vocab_size\":50}";
    T_CHECK(parse_cfg(&c, nested) == 0 && c.block_size == 10);
    j = dfl_drafter_config_json(&c);
    T_CHECK(!json_object_get(j, "block_size"));
    T_CHECK(json_integer_value(json_object_get(json_object_get(j, "dflash_config"), "block_size")) == 10);
    /* no max_position_embeddings: never written as 0 (a context of no tokens
     * to a serving engine); the target's fills it */
    T_CHECK(!json_object_get(j, "max_position_embeddings"));
    json_decref(j);
    dfl_model_config tc;
    memset(&tc, 0, sizeof tc);
    tc.max_position_embeddings = 40960;
    dfl_drafter_config_from_target(&c, &tc);
    j = dfl_drafter_config_json(&c);
    T_CHECK(json_integer_value(json_object_get(j, "max_position_embeddings")) == 40960);
    json_decref(j);
    dfl_drafter_config_free(&c);
    /* missing target_layer_ids: the reference default (L taps over [1, N-3]) */
    const char *deflt =
        "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"num_target_layers\":36,\"block_size\":16,"
        "\"dflash_config\":{\"mask_token_id\":5},\"hidden_size\":16,\"intermediate_size\":32,\"num_hidden_layers\":5,"
        "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":8,\"vocab_size\":50}";
    T_CHECK(parse_cfg(&c, deflt) == 0 && c.K == 5 && c.layer_ids[0] == 1 && c.layer_ids[1] == 9 &&
            c.layer_ids[4] == 33);
    dfl_drafter_config_free(&c);
    /* refusals name the key */
    T_CHECK(parse_sized(&c, 16, 32, 1, 2, 1, 8, 50, 16, "[1,40]", 36, 5) == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "target_layer_ids"));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_sized(&c, 16, 32, 1, 2, 1, 8, 50, 16, "[1]", 36, 50) == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "mask_token_id"));
    dfl_drafter_config_free(&c);
    const char *noblock =
        "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"num_target_layers\":8,"
        "\"dflash_config\":{\"mask_token_id\":5},\"hidden_size\":16,\"intermediate_size\":32,\"num_hidden_layers\":1,"
        "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":8,\"vocab_size\":50}";
    T_CHECK(parse_cfg(&c, noblock) == DFL_EX_DATA && strstr(dfl_errmsg(), "block_size"));
    dfl_drafter_config_free(&c);
    /* a drafter is dense: a mixture-of-experts architecture (whose
     * intermediate_size may be absent) is refused, not read with I = 0 */
    const char *moe =
        "{\"architectures\":[\"Qwen3_5MoeForCausalLM\"],\"model_type\":\"qwen3\",\"num_target_layers\":8,\"block_size\":4,"
        "\"dflash_config\":{\"mask_token_id\":5},\"hidden_size\":16,\"num_hidden_layers\":1,"
        "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":8,\"vocab_size\":50}";
    T_CHECK(parse_cfg(&c, moe) == DFL_EX_DATA && strstr(dfl_errmsg(), "mixture of experts"));
    dfl_drafter_config_free(&c);
}

/* A 5-layer drafter config with `extra` keys (Qwen3.6-27B's drafter is
 * layer_types sliding x4 then full, use_sliding_window true, window 2048). */
static int parse_swa(dfl_drafter_config *c, const char *extra) {
    char s[1024];
    snprintf(s, sizeof s,
             "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"num_target_layers\":64,"
             "\"block_size\":16,\"dflash_config\":{\"mask_token_id\":5,\"target_layer_ids\":[1,16,31,46,61]},"
             "\"hidden_size\":16,\"intermediate_size\":32,\"num_hidden_layers\":5,\"num_attention_heads\":2,"
             "\"num_key_value_heads\":1,\"head_dim\":8,\"vocab_size\":50%s}",
             extra);
    return parse_cfg(c, s);
}

/* The windows of the 5 layers as "w0,w1,w2,w3,w4". */
static const char *windows_of(const dfl_drafter_config *c) {
    static char s[128];
    int n = 0;
    for (int64_t l = 0; l < c->L; l++)
        n += snprintf(s + n, sizeof s - (size_t)n, "%s%lld", l ? "," : "", (long long)dfl_model_config_window(&c->mc, l));
    return s;
}

#define SWA_LT ",\"layer_types\":[\"sliding_attention\",\"sliding_attention\",\"sliding_attention\"," \
               "\"sliding_attention\",\"full_attention\"]"

/* Sliding-window drafters: which layers slide and how far, read as
 * transformers' Qwen3Config reads them, written back in full; a layer named
 * sliding that would run without a window is refused, naming the key. */
static void test_config_sliding(void) {
    dfl_drafter_config c;
    T_CHECK(parse_swa(&c, SWA_LT ",\"use_sliding_window\":true,\"sliding_window\":2048,\"max_window_layers\":5") == 0);
    T_CHECKF(!strcmp(windows_of(&c), "2048,2048,2048,2048,0"), "%s", windows_of(&c));
    /* written back as read, and read back the same */
    json_t *j = dfl_drafter_config_json(&c);
    T_CHECK(json_is_true(json_object_get(j, "use_sliding_window")));
    T_CHECK(json_integer_value(json_object_get(j, "sliding_window")) == 2048);
    T_CHECK(!strcmp(json_string_value(json_array_get(json_object_get(j, "layer_types"), 3)), "sliding_attention"));
    T_CHECK(!strcmp(json_string_value(json_array_get(json_object_get(j, "layer_types"), 4)), "full_attention"));
    char *text = json_dumps(j, JSON_COMPACT);
    dfl_drafter_config c2;
    T_CHECK(parse_cfg(&c2, text) == 0 && !strcmp(windows_of(&c2), "2048,2048,2048,2048,0"));
    dfl_drafter_config_free(&c2);
    free(text);
    json_decref(j);
    dfl_drafter_config_free(&c);
    /* no layer_types: the layers from max_window_layers on (default 28: none
     * of 5); an absent window is Qwen3Config's 4096 */
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":true,\"max_window_layers\":3") == 0);
    T_CHECKF(!strcmp(windows_of(&c), "0,0,0,4096,4096"), "%s", windows_of(&c));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":true,\"sliding_window\":7") == 0);
    T_CHECKF(!strcmp(windows_of(&c), "0,0,0,0,0"), "%s", windows_of(&c));
    j = dfl_drafter_config_json(&c);
    T_CHECK(json_is_false(json_object_get(j, "use_sliding_window")) && json_is_null(json_object_get(j, "sliding_window")));
    json_decref(j);
    dfl_drafter_config_free(&c);
    /* a window but use_sliding_window false: no window (transformers drops it) */
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":false,\"sliding_window\":7,\"max_window_layers\":0") == 0);
    T_CHECKF(!strcmp(windows_of(&c), "0,0,0,0,0"), "%s", windows_of(&c));
    dfl_drafter_config_free(&c);
    /* refusals */
    T_CHECK(parse_swa(&c, SWA_LT ",\"use_sliding_window\":false,\"sliding_window\":2048") == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "\"layer_types\"[0]") && strstr(dfl_errmsg(), "use_sliding_window"));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, SWA_LT ",\"use_sliding_window\":true,\"sliding_window\":null") == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "\"sliding_window\" is null"));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, SWA_LT ",\"use_sliding_window\":true,\"sliding_window\":0") == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "at least 1"));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":true,\"sliding_window\":15,\"max_window_layers\":4") == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "smaller than the block size 16"));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":true,\"sliding_window\":16,\"max_window_layers\":4") == 0);
    T_CHECKF(!strcmp(windows_of(&c), "0,0,0,0,16"), "%s", windows_of(&c));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":true,\"sliding_window\":2.5") == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "sliding_window"));
    dfl_drafter_config_free(&c);
    T_CHECK(parse_swa(&c, ",\"use_sliding_window\":true,\"layer_types\":[\"sliding_attention\",\"chunked_attention\","
                          "\"full_attention\",\"full_attention\",\"full_attention\"]") == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "chunked_attention"));
    dfl_drafter_config_free(&c);
}

static void test_slot_weights_and_schedule(void) {
    T_CHECK(dfl_slot_weight(0, 7) == 0.0);
    T_CHECK(dfl_slot_weight(1, 7) == 1.0);
    T_CHECKF(fabs(dfl_slot_weight(15, 7) - exp(-2.0)) < 1e-15, "w_15 = %.17g", dfl_slot_weight(15, 7));
    T_CHECK(fabs(dfl_slot_weight(15, 7) - 0.1353352832366127) < 1e-15);
    dfl_train_opts o;
    dfl_train_opts_default(&o, 16);
    T_CHECK(o.gamma == 7.0 && o.anchors == 512 && o.lr == 6e-4 && o.warmup_ratio == 0.04 && o.max_grad_norm == 1.0);
    /* 100 steps, 4 of warm-up: 1/4, 2/4, 3/4, 1 of peak, then cosine */
    T_CHECK(fabs(dfl_lr_at(0, 100, 0.04, 1.0) - 0.25) < 1e-15);
    T_CHECK(fabs(dfl_lr_at(3, 100, 0.04, 1.0) - 1.0) < 1e-15);
    T_CHECK(fabs(dfl_lr_at(4, 100, 0.04, 1.0) - 1.0) < 1e-15);
    T_CHECK(fabs(dfl_lr_at(52, 100, 0.04, 1.0) - 0.5) < 1e-12);
    T_CHECK(dfl_lr_at(99, 100, 0.04, 1.0) > 0 && dfl_lr_at(99, 100, 0.04, 1.0) < 1e-3);
    /* past the schedule the rate stays 0 (the cosine climbed back to the peak) */
    T_CHECK(dfl_lr_at(100, 100, 0.04, 1.0) == 0.0);
    T_CHECK(dfl_lr_at(150, 100, 0.04, 1.0) == 0.0 && dfl_lr_at(196, 100, 0.04, 1.0) == 0.0);
    /* the longest schedules: all warm-up over 2^63-1 steps (floor(R * T)
     * was 2^63 as a double, cast to an int64_t: the rate was a cosine of
     * garbage) and over dflash-train-step's limit 2^53 (exact) */
    const int64_t big = INT64_MAX, lim = INT64_C(1) << 53;
    T_CHECKF(dfl_lr_at(0, big, 1.0, 1.0) > 0 && dfl_lr_at(0, big, 1.0, 1.0) < 1e-18, "%g", dfl_lr_at(0, big, 1.0, 1.0));
    T_CHECK(dfl_lr_at(big - 1, big, 1.0, 1.0) == 1.0);
    T_CHECK(dfl_lr_at(lim - 1, lim, 1.0, 1.0) == 1.0 && dfl_lr_at(0, lim, 1.0, 1.0) == 1.0 / (double)lim);
    T_CHECK(fabs(dfl_lr_at(lim / 2, lim, 0.5, 1.0) - 1.0) < 1e-15);
}

static void test_anchors(void) {
    uint8_t mask[40];
    for (int t = 0; t < 40; t++) mask[t] = t >= 10 && t != 20 && t != 21;
    mask[30] = 0;
    int32_t cand[40], out[40];
    int64_t nc = dfl_anchor_candidates(cand, mask, 40);
    /* a <= T-2, mask[a] and mask[a+1] */
    int64_t expect = 0;
    for (int a = 0; a + 1 < 40; a++) expect += mask[a] && mask[a + 1];
    T_CHECK(nc == expect);
    for (int64_t i = 0; i < nc; i++) T_CHECK(mask[cand[i]] && mask[cand[i] + 1] && cand[i] <= 38);
    dfl_rng r;
    dfl_rng_seed(&r, 7);
    int64_t n = dfl_anchors_sample(out, mask, 40, 5, &r);
    T_CHECK(n == 5);
    for (int64_t i = 0; i < n; i++) {
        T_CHECK(mask[out[i]] && mask[out[i] + 1]);
        if (i) T_CHECK(out[i] > out[i - 1]); /* sorted, distinct */
    }
    /* resampled on every use; the same seed gives the same anchors */
    int32_t again[40];
    int64_t n2 = dfl_anchors_sample(again, mask, 40, 5, &r);
    T_CHECK(n2 == 5 && memcmp(out, again, 5 * 4) != 0);
    dfl_rng_seed(&r, 7);
    n2 = dfl_anchors_sample(again, mask, 40, 5, &r);
    T_CHECK(n2 == 5 && memcmp(out, again, 5 * 4) == 0);
    /* fewer candidates than asked: all of them */
    n = dfl_anchors_sample(out, mask, 40, 512, &r);
    T_CHECK(n == nc && !memcmp(out, cand, (size_t)nc * 4));
    /* uniform: every candidate drawn about equally often */
    int64_t hits[40] = {0};
    for (int it = 0; it < 4000; it++) {
        n = dfl_anchors_sample(out, mask, 40, 3, &r);
        for (int64_t i = 0; i < n; i++) hits[out[i]]++;
    }
    double mean = 4000.0 * 3 / (double)nc;
    for (int64_t i = 0; i < nc; i++) T_CHECKF(fabs(hits[cand[i]] - mean) < 0.2 * mean, "%d drawn %lld", cand[i], (long long)hits[cand[i]]);
    uint8_t none[5] = {1, 0, 1, 0, 1};
    T_CHECK(dfl_anchors_sample(out, none, 5, 8, &r) == 0);
}

/* Blocks, positions, tokens, labels, weights of a batch, against the rules
 * of spec §2.3-§2.6 written out here; and the visibility of every (query,
 * key) pair against §2.5. */
static void test_batch_rules(void) {
    dfl_drafter_config c;
    T_CHECK(parse_sized(&c, 8, 12, 1, 2, 1, 4, 23, 4, "[0,2]", 4, 22) == 0);
    dfl_rng r;
    dfl_rng_seed(&r, 3);
    test_seq a, b;
    make_seq(&a, &c, 14, 3, &r);
    make_seq(&b, &c, 9, 2, &r);
    a.mask[9] = 0;
    int32_t anc_a[] = {3, 4, 7, 11, 12}, anc_b[] = {2, 6};
    const int B = c.block_size;
    for (int target = 0; target < 2; target++) {
        dfl_train_opts o;
        dfl_train_opts_default(&o, B);
        o.gamma = 3;
        o.labels_target = target;
        dfl_train_mb mb;
        dfl_train_mb_init(&mb);
        dfl_train_seq sa = as_seq(&a), sb = as_seq(&b);
        dfl_train_mb_add(&mb, &c, &o, &sa, anc_a, 5, &r);
        dfl_train_mb_add(&mb, &c, &o, &sb, anc_b, 2, &r);
        /* context rows: up to the last anchor of each sequence */
        T_CHECK(mb.b.NC == 12 + 6 && mb.b.nblk == 7);
        dfl_drafter *d = random_drafter(&c, &r, 0.3);
        close_mb(d, &o, &mb);
        const int64_t NC = mb.b.NC, Q = mb.b.nblk * B;
        struct { const test_seq *s; const int32_t *anc; int n; int64_t base; } seqs[2] = {{&a, anc_a, 5, 0}, {&b, anc_b, 2, 12}};
        int64_t j = 0;
        for (int q = 0; q < 2; q++) {
            for (int i = 0; i < seqs[q].n; i++, j++) {
                const int64_t an = seqs[q].anc[i], T = seqs[q].s->T;
                for (int k = 0; k < B; k++) {
                    const int64_t row = j * B + k, p = an + k;
                    T_CHECK(mb.b.pos[NC + row] == p);                                         /* §2.4 */
                    T_CHECK(mb.b.tokens[row] == (k == 0 ? seqs[q].s->ids[an] : c.mask_token_id)); /* §2.3 */
                    int valid = k > 0 && p < T && seqs[q].s->mask[p];                      /* §2.6 */
                    int32_t y = valid ? (target ? seqs[q].s->tids[p - 1] : seqs[q].s->ids[p]) : -1;
                    T_CHECKF(mb.b.labels[row] == y, "block %lld slot %d: label %d, want %d", (long long)j, k,
                             mb.b.labels[row], y);
                    double w = valid ? exp(-(double)(k - 1) / 3.0) : 0.0;
                    T_CHECK(fabs(mb.b.gscale[row] - w) < 1e-7);
                    /* visibility, entry by entry: §2.5 vs the dfl_block the attention op gets */
                    const dfl_block *bl = &mb.b.blocks[j];
                    for (int64_t kv = 0; kv < NC + Q; kv++) {
                        int rule;
                        if (kv < NC) {
                            /* a context row: its sequence and position */
                            int owner = kv < 12 ? 0 : 1;
                            int64_t pos = kv - seqs[owner].base;
                            rule = owner == q && pos < an;
                            T_CHECK(mb.b.pos[kv] == pos);
                        } else {
                            rule = (kv - NC) / B == j;
                        }
                        int got = (kv >= bl->ctx_off && kv < bl->ctx_off + bl->ctx_len) ||
                                  (kv >= bl->blk_off && kv < bl->blk_off + B);
                        if (got != rule) {
                            T_CHECKF(got == rule, "block %lld (anchor %lld) key row %lld: op sees %d, rule says %d",
                                     (long long)j, (long long)an, (long long)kv, got, rule);
                            kv = NC + Q;
                        }
                    }
                }
            }
        }
        dfl_drafter_free(d);
        dfl_train_mb_free(&mb);
    }
    free(a.hidden), free(a.last), free(b.hidden), free(b.last);
    dfl_drafter_config_free(&c);
}

/* Model-level visibility: a block's outputs are bit-identical when the
 * target feature AT its anchor or after it changes, or another block's
 * token changes; they change when a feature before the anchor changes. */
static void test_visibility_model(void) {
    dfl_drafter_config c;
    dfl_rng r;
    test_seq a;
    dfl_drafter *d = small_drafter(&c, &r, &a, 2, 23, 11, 0.4, 16, 1);
    /* anchors closer than B: blocks overlap in positions (spec §5.4) */
    int32_t anc[] = {3, 4, 6, 12};
    const int n = 4, B = c.block_size;
    const int64_t H = c.H, KH = c.K * c.H, Q = n * B;
    dfl_train_opts o;
    dfl_train_opts_default(&o, B);
    float *base = dfl_malloc((size_t)(Q * H) * 4), *out = dfl_malloc((size_t)(Q * H) * 4);
    float *h0 = dfl_malloc((size_t)(a.T * KH) * 4);
    memcpy(h0, a.hidden, (size_t)(a.T * KH) * 4);
    dfl_train_seq sq = as_seq(&a);
#define RUN(dst)                                                    \
    do {                                                            \
        dfl_train_mb mb;                                            \
        dfl_train_mb_init(&mb);                                     \
        dfl_train_mb_add(&mb, &c, &o, &sq, anc, n, &r);             \
        close_mb(d, &o, &mb);                                       \
        ops->act_to_f32(dst, dfl_drafter_output(d), Q *H);          \
        dfl_train_mb_free(&mb);                                     \
    } while (0)
    RUN(base);
    for (int j = 0; j < n; j++) {
        /* the feature AT the anchor, and every later one */
        for (int64_t p = anc[j]; p < a.T; p++) {
            memcpy(a.hidden, h0, (size_t)(a.T * KH) * 4);
            for (int64_t i = 0; i < KH; i++) a.hidden[p * KH + i] += 3.0f;
            RUN(out);
            T_CHECKF(!memcmp(out + j * B * H, base + j * B * H, (size_t)(B * H) * 4),
                     "block %d (anchor %d) changed when the feature at position %lld changed", j, anc[j], (long long)p);
        }
        /* the one just before the anchor is visible */
        memcpy(a.hidden, h0, (size_t)(a.T * KH) * 4);
        for (int64_t i = 0; i < KH; i++) a.hidden[(anc[j] - 1) * KH + i] += 3.0f;
        RUN(out);
        T_CHECKF(memcmp(out + j * B * H, base + j * B * H, (size_t)(B * H) * 4) != 0,
                 "block %d did not see position %d", j, anc[j] - 1);
    }
    memcpy(a.hidden, h0, (size_t)(a.T * KH) * 4);
    /* another block's anchor token: only that block changes */
    for (int j = 0; j < n; j++) {
        int32_t keep = a.ids[anc[j]];
        a.ids[anc[j]] = (keep + 5) % 20;
        RUN(out);
        for (int i = 0; i < n; i++) {
            int same = !memcmp(out + i * B * H, base + i * B * H, (size_t)(B * H) * 4);
            T_CHECKF(same == (i != j), "changing block %d's token %s block %d", j, same ? "left" : "changed", i);
        }
        a.ids[anc[j]] = keep;
    }
#undef RUN
    free(base), free(out), free(h0);
    small_free(&c, d, &a);
}

/* An anchor at position 0 has no context at all: its block sees only
 * itself, its outputs are finite and no feature changes them. */
static void test_anchor_at_zero(void) {
    dfl_drafter_config c;
    dfl_rng r;
    test_seq a;
    dfl_drafter *d = small_drafter(&c, &r, &a, 1, 23, 13, 0.4, 10, 0);
    int32_t anc[] = {0, 5};
    const int64_t B = c.block_size, H = c.H, Q = 2 * B, KH = c.K * c.H;
    dfl_train_opts o;
    dfl_train_opts_default(&o, (int)B);
    dfl_train_seq sq = as_seq(&a);
    float *base = dfl_malloc((size_t)(Q * H) * 4), *out = dfl_malloc((size_t)(Q * H) * 4);
    for (int pass = 0; pass < 2; pass++) {
        dfl_train_mb mb;
        dfl_train_mb_init(&mb);
        dfl_train_mb_add(&mb, &c, &o, &sq, anc, 2, &r);
        T_CHECK(mb.blocks[0].ctx_len == 0 && mb.b.NC == 5);
        close_mb(d, &o, &mb);
        ops->act_to_f32(pass ? out : base, dfl_drafter_output(d), Q * H);
        dfl_train_mb_free(&mb);
        for (int64_t i = 0; i < a.T * KH; i++) a.hidden[i] = -2.0f * a.hidden[i] + 1.0f;
    }
    int finite = 1;
    for (int64_t i = 0; i < Q * H; i++) finite &= isfinite(base[i]);
    T_CHECK(finite);
    T_CHECK(!memcmp(base, out, (size_t)(B * H) * 4));                   /* block 0: no context */
    T_CHECK(memcmp(base + B * H, out + B * H, (size_t)(B * H) * 4) != 0); /* block 1 sees 0..4 */
    free(base), free(out);
    small_free(&c, d, &a);
}

/* ---- finite differences ------------------------------------------------------------ */

static void fd_check(int kl) {
    dfl_drafter_config c;
    dfl_rng r;
    test_seq a;
    dfl_drafter *d = small_drafter(&c, &r, &a, 2, 13, 5, 0.5, 12, 2);
    a.mask[8] = 0;
    int32_t anc[] = {2, 3, 6, 10};
    dfl_train_opts o;
    dfl_train_opts_default(&o, c.block_size);
    o.gamma = 2;
    o.kl = kl;
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    dfl_train_seq sq = as_seq(&a);
    dfl_train_mb_add(&mb, &c, &o, &sq, anc, 4, &r);
    close_mb(d, &o, &mb); /* gradient of sum(w m loss) */
    const int64_t P = d->nparams;
    float *g = dfl_malloc((size_t)P * 4), *w = dfl_malloc((size_t)P * 4);
    ops->download(g, d->grad, (size_t)P * 4);
    dfl_drafter_get_master(d, w);
    double *fd = dfl_malloc((size_t)P * sizeof(double));
    const float h = 1e-2f;
    for (int64_t i = 0; i < P; i++) {
        float keep = w[i];
        w[i] = keep + h;
        dfl_drafter_set_master(d, w);
        double lp = batch_loss(d, &mb, kl);
        w[i] = keep - h;
        dfl_drafter_set_master(d, w);
        double lm = batch_loss(d, &mb, kl);
        w[i] = keep;
        fd[i] = (lp - lm) / (2.0 * (double)h);
    }
    dfl_drafter_set_master(d, w);
    double worst = 0;
    const char *worst_name = "";
    for (int t = 0; t < d->ntensors; t++) {
        const dfl_param_info *p = &d->info[t];
        double num = 0, den = 0;
        for (int64_t i = p->offset; i < p->offset + p->numel; i++) {
            num += (g[i] - fd[i]) * (g[i] - fd[i]);
            den += fd[i] * fd[i];
        }
        double e = den > 0 ? num / den : num;
        T_CHECKF(den > 0, "%s: zero finite-difference gradient", p->name);
        T_CHECKF(e < 1e-5, "%s: gradient vs finite differences: normalised error %.3g", p->name, e);
        if (e > worst) worst = e, worst_name = p->name;
    }
    printf("  fd %s: worst tensor %s, normalised error %.2g\n", kl ? "kl" : "ce", worst_name, worst);
    free(g), free(w), free(fd);
    dfl_train_mb_free(&mb);
    small_free(&c, d, &a);
}

/* What small_output saw of the drafter it ran. */
typedef struct {
    float rope_scale;
    int64_t window[2];
} small_run;

/* A small drafter (2 layers, cfg_text with the current rope_keys), one
 * micro-batch of blocks at anchors 2 and 6: the first n floats of its
 * output into out. */
static small_run small_output(float *out, int64_t n) {
    dfl_drafter_config c;
    dfl_rng r;
    test_seq a;
    dfl_drafter *d = small_drafter(&c, &r, &a, 2, 13, 5, 0.5, 12, 2);
    small_run s = {d->rope_scale, {dfl_model_config_window(&c.mc, 0), dfl_model_config_window(&c.mc, 1)}};
    int32_t anc[] = {2, 6};
    dfl_train_opts o;
    dfl_train_opts_default(&o, c.block_size);
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    dfl_train_seq sq = as_seq(&a);
    dfl_train_mb_add(&mb, &c, &o, &sq, anc, 2, &r);
    close_mb(d, &o, &mb);
    ops->act_to_f32(out, dfl_drafter_output(d), n);
    dfl_train_mb_free(&mb);
    small_free(&c, d, &a);
    return s;
}

static void test_fd_ce(void) { fd_check(0); }
static void test_fd_kl(void) { fd_check(1); }
/* A drafter with YaRN RoPE (its config's rope_scaling): the scale on cos
 * and sin is in the forward (the output moves) and in the backward (the
 * finite differences agree). With head_dim 4, one frequency is kept and one
 * divided by the factor. */
static void test_fd_yarn(void) {
    const char *plain = rope_keys;
    float out[2][8];
    for (int yarn = 0; yarn < 2; yarn++) {
        rope_keys = yarn ? "\"rope_theta\":500.0,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4.0,"
                           "\"original_max_position_embeddings\":16}"
                         : plain;
        small_run s = small_output(out[yarn], 8);
        T_CHECK(yarn ? fabsf(s.rope_scale - 1.1386294f) < 1e-6f : s.rope_scale == 1.0f);
    }
    T_CHECK(memcmp(out[0], out[1], sizeof out[0]) != 0);
    fd_check(0);
    rope_keys = plain;
}

/* A drafter whose layer 0 has a sliding window of 4 (= B; the blocks at 6
 * and, in fd_check, 10 have their context cut): the window changes the output and the
 * gradients follow it (finite differences). */
static void test_fd_sliding(void) {
    const char *plain = rope_keys;
    float out[2][64];
    for (int swa = 0; swa < 2; swa++) {
        rope_keys = swa ? "\"rope_theta\":500.0,\"use_sliding_window\":true,\"sliding_window\":4,"
                          "\"layer_types\":[\"sliding_attention\",\"full_attention\"]"
                        : plain;
        small_run s = small_output(out[swa], 64); /* both blocks: B * 2 rows of H = 8 */
        T_CHECK(s.window[0] == (swa ? 4 : 0) && s.window[1] == 0);
    }
    /* block 0 (anchor 2) sees 2 context keys either way, but its causal
     * slots differ; block 1 (anchor 6) also loses context */
    T_CHECK(memcmp(out[0], out[1], 32 * sizeof(float)) != 0 && memcmp(out[0] + 32, out[1] + 32, 32 * sizeof(float)) != 0);
    rope_keys = "\"rope_theta\":500.0,\"use_sliding_window\":true,\"sliding_window\":4,"
                "\"layer_types\":[\"sliding_attention\",\"full_attention\"]";
    fd_check(0);
    fd_check(1);
    rope_keys = plain;
}

/* ---- PyTorch fixtures -------------------------------------------------------------------- */

typedef struct {
    dfl_st *st;
    dfl_drafter_config c;
    dfl_drafter *d;
    float *master0;
    test_seq seq[2];
    int32_t anc[2][16], anc2[2][16];
    int nanc[2], nanc2[2];
    double gamma;
} fixture;

static float *fx_f32(fixture *f, const char *name, int64_t *numel) {
    const dfl_st_tensor *t = dfl_st_find(f->st, name);
    if (!t) {
        T_CHECKF(t != NULL, "fixture tensor %s missing", name);
        return NULL;
    }
    float *out = dfl_malloc((size_t)t->numel * 4 + 4);
    memcpy(out, t->data, (size_t)t->nbytes);
    if (numel) *numel = t->numel;
    return out;
}

/* The fixture's int32 anchor list `name` into dst; returns how many. */
static int fx_anchors(fixture *f, const char *name, int32_t *dst) {
    int64_t na;
    int32_t *an = (int32_t *)fx_f32(f, name, &na);
    memcpy(dst, an, (size_t)na * 4);
    free(an);
    return (int)na;
}

static int fixture_open(fixture *f) {
    memset(f, 0, sizeof *f);
    char path[256];
    snprintf(path, sizeof path, "%s/case.safetensors", fixture_dir);
    if (dfl_st_open(&f->st, path)) {
        T_CHECKF(0, "%s", dfl_errmsg());
        return -1;
    }
    snprintf(path, sizeof path, "%s/config.json", fixture_dir);
    if (dfl_drafter_config_load(&f->c, path)) {
        T_CHECKF(0, "%s", dfl_errmsg());
        return -1;
    }
    f->gamma = atof(dfl_st_meta(f->st, "gamma"));
    f->d = dfl_drafter_new(ops, &f->c);
    f->master0 = dfl_malloc((size_t)f->d->nparams * 4);
    for (int t = 0; t < f->d->ntensors; t++) {
        char name[96];
        snprintf(name, sizeof name, "param.%s", f->d->info[t].name);
        int64_t n = 0;
        float *p = fx_f32(f, name, &n);
        if (!p) return -1;
        T_CHECK(n == f->d->info[t].numel);
        memcpy(f->master0 + f->d->info[t].offset, p, (size_t)n * 4);
        free(p);
    }
    dfl_drafter_set_master(f->d, f->master0);
    float *e = fx_f32(f, "embed", NULL), *w = fx_f32(f, "lm_head", NULL), *n = fx_f32(f, "target_norm", NULL);
    dfl_drafter_set_target(f->d, e, w, n, (float)atof(dfl_st_meta(f->st, "target_eps")));
    free(e), free(w), free(n);
    for (int s = 0; s < 2; s++) {
        char name[64];
        test_seq *q = &f->seq[s];
        int64_t T;
        snprintf(name, sizeof name, "seq%d.ids", s);
        int32_t *ids = (int32_t *)fx_f32(f, name, &T);
        snprintf(name, sizeof name, "seq%d.loss_mask", s);
        int32_t *lm = (int32_t *)fx_f32(f, name, NULL);
        q->T = T;
        for (int64_t t = 0; t < T; t++) q->ids[t] = ids[t], q->mask[t] = (uint8_t)lm[t], q->tids[t] = 0;
        free(ids), free(lm);
        snprintf(name, sizeof name, "seq%d.hidden", s);
        q->hidden = fx_f32(f, name, NULL);
        snprintf(name, sizeof name, "seq%d.last_hidden", s);
        q->last = fx_f32(f, name, NULL);
        snprintf(name, sizeof name, "seq%d.anchors", s);
        f->nanc[s] = fx_anchors(f, name, f->anc[s]);
        snprintf(name, sizeof name, "seq%d.anchors2", s);
        f->nanc2[s] = fx_anchors(f, name, f->anc2[s]);
    }
    return 0;
}

static void fixture_close(fixture *f) {
    for (int s = 0; s < 2; s++) free(f->seq[s].hidden), free(f->seq[s].last);
    free(f->master0);
    dfl_drafter_free(f->d);
    dfl_drafter_config_free(&f->c);
    dfl_st_close(f->st);
}

/* Compare the gradient (already divided by the normaliser) tensor by tensor. */
static void check_grads(fixture *f, const float *g, const char *prefix, double thr) {
    double worst = 0;
    for (int t = 0; t < f->d->ntensors; t++) {
        char name[96];
        snprintf(name, sizeof name, "%s.%s", prefix, f->d->info[t].name);
        float *ref = fx_f32(f, name, NULL);
        if (!ref) continue;
        double e = t_nmse_f32(g + f->d->info[t].offset, ref, f->d->info[t].numel);
        T_CHECKF(e < thr, "%s: normalised error %.3g", name, e);
        if (e > worst) worst = e;
        free(ref);
    }
    printf("  %s: worst tensor normalised error %.2g\n", prefix, worst);
}

/* The gradient of the last fixture_step, divided by its weight normaliser,
 * against the fixture's `prefix` tensors. */
static void check_step_grads(fixture *f, const dfl_train_stats *st, const char *prefix) {
    float *g = dfl_malloc((size_t)f->d->nparams * 4);
    ops->download(g, f->d->grad, (size_t)f->d->nparams * 4);
    for (int64_t i = 0; i < f->d->nparams; i++) g[i] = (float)(g[i] / st->den_w);
    check_grads(f, g, prefix, 1e-9);
    free(g);
}

/* The step loss against the fixture's scalar `name`, to a relative 1e-5. */
static void check_loss(fixture *f, const dfl_train_opts *o, const dfl_train_stats *st, const char *name, int split) {
    float *ref = fx_f32(f, name, NULL);
    double L = dfl_train_loss(o, st);
    T_CHECKF(fabs(L - ref[0]) < 1e-5 * fabs(ref[0]), "%s %.9g vs reference %.9g (split %d)", name, L, ref[0], split);
    free(ref);
}

/* The training options the fixture was made with (before a test's own). */
static void fixture_opts(const fixture *f, dfl_train_opts *o) {
    dfl_train_opts_default(o, f->c.block_size);
    o->gamma = f->gamma;
}

/* Fill the gradient with NaN (what a buffer nobody zeroed may hold). */
static void poison_grad(dfl_drafter *d) {
    float *nan = dfl_malloc((size_t)d->nparams * 4);
    for (int64_t i = 0; i < d->nparams; i++) nan[i] = NAN;
    ops->upload(d->grad, nan, (size_t)d->nparams * 4);
    free(nan);
}

/* fixture_step starts the gradient with dfl_drafter_start_grad over a
 * poisoned buffer (instead of dfl_drafter_zero_grad) when set */
static int g_start_grad;

static void fixture_step(fixture *f, int kl, int split, dfl_train_stats *st, dfl_train_opts *o,
                         int32_t (*anc)[16], const int *nanc, const int *which, int nw) {
    dfl_rng r;
    dfl_rng_seed(&r, 1);
    memset(st, 0, sizeof *st);
    if (g_start_grad) {
        poison_grad(f->d);
        dfl_drafter_start_grad(f->d);
    } else {
        dfl_drafter_zero_grad(f->d);
    }
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    for (int i = 0; i < nw; i++) {
        dfl_train_seq sq = as_seq(&f->seq[which[i]]);
        dfl_train_mb_add(&mb, &f->c, o, &sq, anc[which[i]], nanc[which[i]], &r);
        if (split) {
            dfl_train_mb_run(f->d, o, &mb, st, 1);
            dfl_train_mb_reset(&mb);
        }
    }
    if (!split) dfl_train_mb_run(f->d, o, &mb, st, 1);
    dfl_train_mb_free(&mb);
}

static void test_fixture_ce(void) {
    fixture f;
    if (fixture_open(&f)) return;
    dfl_train_opts o;
    fixture_opts(&f, &o);
    const int B = f.c.block_size;
    int both[2] = {0, 1};
    dfl_train_stats st;
    /* one micro-batch holding both sequences; logits and slot losses per sequence */
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    dfl_rng r;
    dfl_rng_seed(&r, 1);
    for (int s = 0; s < 2; s++) {
        dfl_train_seq sq = as_seq(&f.seq[s]);
        dfl_train_mb_add(&mb, &f.c, &o, &sq, f.anc[s], f.nanc[s], &r);
    }
    memset(&st, 0, sizeof st);
    dfl_drafter_zero_grad(f.d);
    dfl_train_mb_run(f.d, &o, &mb, &st, 0);
    const int64_t Q = mb.b.nblk * B, V = f.c.V, H = f.c.H;
    void *lg = ops->alloc((size_t)(Q * V) * (size_t)ops->act_bytes);
    ops->matmul(lg, dfl_drafter_output(f.d), f.d->lm_head, Q, H, V, 0);
    float *logits = dfl_malloc((size_t)(Q * V) * 4), *loss = dfl_malloc((size_t)Q * 4);
    ops->act_to_f32(logits, lg, Q * V);
    ops->free(lg);
    dfl_drafter_loss(f.d, &mb.b, 0, 0, loss, NULL, NULL);
    int64_t row0 = 0;
    for (int s = 0; s < 2; s++) {
        char name[64];
        snprintf(name, sizeof name, "ce.seq%d.logits", s);
        float *ref = fx_f32(&f, name, NULL);
        int64_t rows = (int64_t)f.nanc[s] * B;
        double e = t_nmse_f32(logits + row0 * V, ref, rows * V);
        T_CHECKF(e < 1e-9, "%s: normalised error %.3g", name, e);
        printf("  %s: normalised error %.2g\n", name, e);
        free(ref);
        snprintf(name, sizeof name, "ce.seq%d.slot_loss", s);
        ref = fx_f32(&f, name, NULL);
        e = t_nmse_f32(loss + row0, ref, rows);
        T_CHECKF(e < 1e-9, "%s: normalised error %.3g", name, e);
        free(ref);
        row0 += rows;
    }
    free(logits), free(loss);
    dfl_train_mb_free(&mb);
    /* the step loss and gradients: one micro-batch, then split in two */
    for (int split = 0; split < 2; split++) {
        fixture_step(&f, 0, split, &st, &o, f.anc, f.nanc, both, 2);
        check_loss(&f, &o, &st, "ce.loss", split);
        check_step_grads(&f, &st, "ce.grad");
    }
    o.norm_count = 1;
    check_loss(&f, &o, &st, "ce.loss_count", 1);
    fixture_close(&f);
}

static void test_fixture_kl(void) {
    fixture f;
    if (fixture_open(&f)) return;
    dfl_train_opts o;
    fixture_opts(&f, &o);
    o.kl = 1;
    int both[2] = {0, 1};
    dfl_train_stats st;
    fixture_step(&f, 1, 0, &st, &o, f.anc, f.nanc, both, 2);
    check_loss(&f, &o, &st, "kl.loss", 0);
    check_step_grads(&f, &st, "kl.grad");
    fixture_close(&f);
}

/* The same steps from dfl_drafter_start_grad on a gradient full of NaN:
 * the first backward must write every element the reference has (the
 * matrices by their first products, the norm weights zeroed), the second
 * micro-batch (split) must add. */
static void test_fixture_start_grad(void) {
    g_start_grad = 1;
    test_fixture_ce();
    test_fixture_kl();
    g_start_grad = 0;
}

/* With no context rows in the micro-batch (every anchor at 0) no product
 * writes fc's gradient: dfl_drafter_start_grad's backward must leave it 0,
 * and every gradient as dfl_drafter_zero_grad's does. */
static void test_start_grad_no_context(void) {
    dfl_drafter_config c;
    dfl_rng r;
    test_seq a;
    dfl_drafter *d = small_drafter(&c, &r, &a, 1, 23, 13, 0.4, 10, 0);
    int32_t anc[] = {0};
    dfl_train_opts o;
    dfl_train_opts_default(&o, c.block_size);
    dfl_train_seq sq = as_seq(&a);
    float *g[2];
    for (int pass = 0; pass < 2; pass++) {
        dfl_rng rr;
        dfl_rng_seed(&rr, 3);
        dfl_train_mb mb;
        dfl_train_mb_init(&mb);
        dfl_train_mb_add(&mb, &c, &o, &sq, anc, 1, &rr);
        T_CHECK(mb.b.NC == 0);
        dfl_train_stats st;
        memset(&st, 0, sizeof st);
        if (pass) {
            poison_grad(d);
            dfl_drafter_start_grad(d);
        } else {
            dfl_drafter_zero_grad(d);
        }
        dfl_train_mb_run(d, &o, &mb, &st, 1);
        g[pass] = dfl_malloc((size_t)d->nparams * 4);
        ops->download(g[pass], d->grad, (size_t)d->nparams * 4);
        dfl_train_mb_free(&mb);
    }
    int64_t differ = 0, nonzero_fc = 0;
    for (int64_t i = 0; i < d->nparams; i++) differ += !(g[0][i] == g[1][i]); /* NaN differs */
    for (int64_t i = 0; i < d->info[0].numel; i++) nonzero_fc += g[1][d->info[0].offset + i] != 0.0f;
    T_CHECKF(differ == 0, "%lld gradient elements differ from the zeroed start's", (long long)differ);
    T_CHECKF(nonzero_fc == 0, "%lld of fc's gradient elements are not 0", (long long)nonzero_fc);
    free(g[0]), free(g[1]);
    small_free(&c, d, &a);
}

/* Three AdamW steps with warm-up, cosine, clipping and weight decay; the
 * first step's two sequences go through two micro-batches. */
static void test_fixture_adamw(void) {
    fixture f;
    if (fixture_open(&f)) return;
    json_t *adam = json_loads(dfl_st_meta(f.st, "adam"), 0, NULL);
    dfl_train_opts o;
    fixture_opts(&f, &o);
    o.lr = json_number_value(json_object_get(adam, "peak"));
    o.total_steps = json_integer_value(json_object_get(adam, "total"));
    o.warmup_ratio = json_number_value(json_object_get(adam, "warmup_ratio"));
    o.weight_decay = json_number_value(json_object_get(adam, "wd"));
    o.max_grad_norm = json_number_value(json_object_get(adam, "clip"));
    json_decref(adam);
    float *norms = fx_f32(&f, "adam.norms", NULL);
    int both[2] = {0, 1}, zero[1] = {0}, one[1] = {1};
    dfl_train_stats st;
    for (int i = 0; i < 3; i++) {
        if (i == 0) fixture_step(&f, 0, 1, &st, &o, f.anc, f.nanc, both, 2);
        else fixture_step(&f, 0, 0, &st, &o, f.anc2, f.nanc2, i == 1 ? zero : one, 1);
        double gn, lr;
        dfl_train_apply(f.d, &o, &st, i, &gn, &lr);
        T_CHECKF(fabs(gn - norms[i]) < 1e-5 * norms[i], "step %d: grad norm %.9g vs %.9g", i, gn, norms[i]);
        T_CHECK(gn > o.max_grad_norm); /* the clip is exercised */
    }
    free(norms);
    float *after = dfl_malloc((size_t)f.d->nparams * 4);
    dfl_drafter_get_master(f.d, after);
    for (int64_t i = 0; i < f.d->nparams; i++) after[i] -= f.master0[i];
    check_grads(&f, after, "adam.delta3", 1e-8);
    free(after);
    fixture_close(&f);
}

/* The fixture tests again on drafter-swa (make_drafter.py's sliding-window
 * case): logits, slot losses, both losses' gradients, AdamW steps. */
static void on_swa(void (*test)(void)) {
    fixture_dir = FIXTURE_DIR_SWA;
    test();
    fixture_dir = FIXTURE_DIR;
}
static void test_swa_fixture_ce(void) { on_swa(test_fixture_ce); }
static void test_swa_fixture_kl(void) { on_swa(test_fixture_kl); }
static void test_swa_fixture_start_grad(void) { on_swa(test_fixture_start_grad); }
static void test_swa_fixture_adamw(void) { on_swa(test_fixture_adamw); }

static void test_init_weights(void) {
    dfl_drafter_config c;
    T_CHECK(parse_sized(&c, 32, 48, 1, 2, 1, 16, 40, 4, "[0,2]", 4, 39) == 0);
    dfl_drafter *d = dfl_drafter_new(ops, &c);
    dfl_rng r;
    dfl_rng_seed(&r, 9);
    dfl_drafter_init_weights(d, 0.02, rng_normal_cb, &r);
    float *w = dfl_malloc((size_t)d->nparams * 4);
    dfl_drafter_get_master(d, w);
    const dfl_param_info *fc = &d->info[0], *hn = &d->info[1];
    double ss = 0;
    for (int64_t i = 0; i < fc->numel; i++) ss += (double)w[fc->offset + i] * w[fc->offset + i];
    double sd = sqrt(ss / (double)fc->numel);
    T_CHECKF(fabs(sd - 0.02) < 0.002, "fc std %.4f", sd);
    for (int64_t i = 0; i < hn->numel; i++) T_CHECK(w[hn->offset + i] == 1.0f);
    free(w);
    dfl_drafter_free(d);
    dfl_drafter_config_free(&c);
}

/* Checkpoint directories: bf16 weights, exact trainer state, refusals. */
static void test_checkpoint(void) {
    dfl_drafter_config c;
    T_CHECK(parse_sized(&c, 16, 24, 2, 2, 1, 8, 29, 4, "[0,2]", 4, 28) == 0);
    dfl_drafter *d = dfl_drafter_new(ops, &c);
    dfl_rng r;
    dfl_rng_seed(&r, 21);
    random_master(d, &r, 0.3);
    const int64_t P = d->nparams;
    float *mv = dfl_malloc((size_t)P * 4);
    for (int64_t i = 0; i < P; i++) mv[i] = (float)frand(&r);
    ops->upload(d->m, mv, (size_t)P * 4);
    for (int64_t i = 0; i < P; i++) mv[i] = (float)(1 + frand(&r));
    ops->upload(d->v, mv, (size_t)P * 4);
    char dir[] = "/tmp/dflash-ckpt-XXXXXX", ck[600];
    T_CHECK(mkdtemp(dir) != NULL);
    snprintf(ck, sizeof ck, "%s/ck", dir);
    json_t *st = json_pack("{ss si}", "format", "dflash-trainer-state", "step", 3);
    T_CHECK(dfl_ckpt_save(ck, d, st) == 0);
    json_decref(st);
    dfl_drafter_config c2;
    T_CHECK(dfl_ckpt_load_config(ck, &c2) == 0);
    T_CHECK(c2.K == 2 && c2.block_size == 4 && c2.mask_token_id == 28 && c2.H == 16 && c2.L == 2);
    dfl_drafter *e = dfl_drafter_new(ops, &c2);
    float *w = dfl_malloc((size_t)P * 4), *w2 = dfl_malloc((size_t)P * 4);
    dfl_drafter_get_master(d, w);
    /* model.safetensors: the master rounded to bf16 */
    T_CHECK(dfl_ckpt_load_weights(ck, e) == 0);
    dfl_drafter_get_master(e, w2);
    int64_t bad = 0;
    for (int64_t i = 0; i < P; i++) bad += w2[i] != dfl_bf16_to_f32(dfl_f32_to_bf16(w[i]));
    T_CHECKF(bad == 0, "%lld weights are not the bf16 rounding of the master", (long long)bad);
    /* trainer state: master and moments exactly */
    json_t *got = NULL;
    T_CHECK(dfl_ckpt_has_state(ck) && dfl_ckpt_load_state(ck, e, &got) == 0);
    T_CHECK(got && json_integer_value(json_object_get(got, "step")) == 3);
    json_decref(got);
    dfl_drafter_get_master(e, w2);
    T_CHECK(!memcmp(w, w2, (size_t)P * 4));
    ops->download(w2, e->v, (size_t)P * 4);
    T_CHECK(!memcmp(mv, w2, (size_t)P * 4));
    /* a model-only checkpoint has no state; a drafter of another shape is refused */
    T_CHECK(dfl_ckpt_save(ck, d, NULL) == 0);
    T_CHECK(!dfl_ckpt_has_state(ck) && dfl_ckpt_load_state(ck, e, &got) == DFL_EX_NOINPUT);
    dfl_drafter_config c3;
    T_CHECK(parse_sized(&c3, 16, 20, 2, 2, 1, 8, 29, 4, "[0,2]", 4, 28) == 0);
    dfl_drafter *f = dfl_drafter_new(ops, &c3);
    T_CHECKF(dfl_ckpt_load_weights(ck, f) == DFL_EX_DATA && strstr(dfl_errmsg(), "mlp."), "%s", dfl_errmsg());
    dfl_drafter_free(f);
    dfl_drafter_config_free(&c3);
    T_CHECK(t_rm_rf(dir) == 0);
    free(w), free(w2), free(mv);
    dfl_drafter_free(e);
    dfl_drafter_free(d);
    dfl_drafter_config_free(&c2);
    dfl_drafter_config_free(&c);
}

/* ---- the step metrics: per-position accuracy and offline tau ------------------- */

/* dfl_train_mb_run's counting on a hand-made micro-batch. The target's LM
 * head is all zeros, so every logit is 0 and the argmax (lowest index on
 * ties) predicts token 0 in every slot whatever the drafter computes: slot k
 * of the block at anchor a is right iff its label ids[a+k] is 0 (CE labels),
 * and it carries a loss iff loss_mask[a+k]. Block size 4 (slots 1..3), T 17,
 * ids 3 except the 0s below, loss_mask 1 except at 15:
 *
 *   block  anchor  slot 1      slot 2        slot 3     accepted prefix s_j
 *   A      1       ids[2]=0 ok ids[3]=0 ok   ids[4]=5 x  2
 *   B      5       ids[6]=7 x  ids[7]=0 ok   ids[8]=0 ok 0  (matches after a miss do not count)
 *   C      9       ids[10]=0ok ids[11]=0 ok  ids[12]=0ok 3
 *   D      13      ids[14]=0ok 15: no loss   ids[16]=0ok 1  (a slot without a loss ends the prefix)
 *
 * per slot (correct/count): k=1 3/4, k=2 3/3 (D's has no loss), k=3 3/4;
 * accuracy 9/11; tau = 1 + (2+0+3+1)/4 = 2.5. Counting every right slot
 * instead of the prefix would give s = 2,2,3,2 and tau 3.25; not ending the
 * prefix at the slot without a loss, s_D = 2 and tau 2.75. */
static void test_tau_and_position_accuracy(void) {
    dfl_drafter_config c;
    dfl_rng r;
    test_seq a;
    dfl_drafter *d = small_drafter(&c, &r, &a, 1, 23, 17, 0.4, 17, 0);
    T_CHECK(c.block_size == 4);
    const int64_t VH = c.V * c.H;
    float *e = dfl_malloc((size_t)VH * 4), *w = dfl_malloc((size_t)VH * 4);
    for (int64_t i = 0; i < VH; i++) e[i] = (float)frand(&r), w[i] = 0.0f;
    dfl_drafter_set_target(d, e, w, NULL, 1e-5f);
    for (int t = 0; t < 17; t++) a.ids[t] = 3, a.mask[t] = 1;
    static const int zero[] = {2, 3, 7, 8, 10, 11, 12, 14, 15, 16};
    for (size_t i = 0; i < sizeof zero / sizeof zero[0]; i++) a.ids[zero[i]] = 0;
    a.ids[4] = 5;
    a.ids[6] = 7;
    a.mask[15] = 0;
    int32_t anc[] = {1, 5, 9, 13};
    dfl_train_opts o;
    dfl_train_opts_default(&o, c.block_size);
    o.kl = 0;
    o.labels_target = 0;
    dfl_train_seq sq = as_seq(&a);
    dfl_rng rr;
    dfl_rng_seed(&rr, 1);
    dfl_train_mb mb;
    dfl_train_mb_init(&mb);
    dfl_train_mb_add(&mb, &c, &o, &sq, anc, 4, &rr);
    T_CHECK(mb.b.nblk == 4);
    dfl_train_stats st;
    memset(&st, 0, sizeof st);
    dfl_drafter_zero_grad(d);
    dfl_train_mb_run(d, &o, &mb, &st, 0);
    if (mb.b.nblk == 4) {
        T_CHECKF(mb.streak[0] == 2 && mb.streak[1] == 0 && mb.streak[2] == 3 && mb.streak[3] == 1,
                 "streaks %d %d %d %d, want 2 0 3 1", mb.streak[0], mb.streak[1], mb.streak[2], mb.streak[3]);
    }
    T_CHECK(st.nblocks == 4);
    T_CHECKF(st.streak_sum == 6.0, "streak_sum %g, want 6", st.streak_sum);
    T_CHECK(st.count[0] == 0 && st.correct[0] == 0);
    T_CHECKF(st.correct[1] == 3 && st.count[1] == 4, "slot 1: %lld/%lld, want 3/4", (long long)st.correct[1],
             (long long)st.count[1]);
    T_CHECKF(st.correct[2] == 3 && st.count[2] == 3, "slot 2: %lld/%lld, want 3/3", (long long)st.correct[2],
             (long long)st.count[2]);
    T_CHECKF(st.correct[3] == 3 && st.count[3] == 4, "slot 3: %lld/%lld, want 3/4", (long long)st.correct[3],
             (long long)st.count[3]);
    T_CHECKF(dfl_train_tau(&st) == 2.5, "tau %.17g, want 2.5", dfl_train_tau(&st));
    T_CHECKF(dfl_train_accuracy(&st) == 9.0 / 11.0, "accuracy %.17g, want 9/11", dfl_train_accuracy(&st));
    dfl_train_mb_free(&mb);
    free(e), free(w);
    small_free(&c, d, &a);
}

int main(void) {
    ops = dfl_ops_cpu();
    T_RUN(test_config);
    T_RUN(test_config_sliding);
    T_RUN(test_slot_weights_and_schedule);
    T_RUN(test_anchors);
    T_RUN(test_batch_rules);
    T_RUN(test_visibility_model);
    T_RUN(test_anchor_at_zero);
    T_RUN(test_init_weights);
    T_RUN(test_checkpoint);
    T_RUN(test_fd_ce);
    T_RUN(test_fd_kl);
    T_RUN(test_fd_yarn);
    T_RUN(test_fixture_ce);
    T_RUN(test_fixture_kl);
    T_RUN(test_fixture_start_grad);
    T_RUN(test_start_grad_no_context);
    T_RUN(test_fixture_adamw);
    T_RUN(test_fd_sliding);
    T_RUN(test_swa_fixture_ce);
    T_RUN(test_swa_fixture_kl);
    T_RUN(test_swa_fixture_start_grad);
    T_RUN(test_swa_fixture_adamw);
    T_RUN(test_tau_and_position_accuracy);
    return t_exit();
}
