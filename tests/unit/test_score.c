/* test_score.c: the acceptance statistics of dflash-score on small cases
 * whose answers are worked out here by hand.
 *
 *   test_block_stats   dfl_score_block alone: tau, conditional acceptance
 *                      (with a censored slot), histogram, macro vs pooled.
 *   test_offline_*     the whole offline path (train.c's batch builder and
 *                      forward, then score.c) with a drafter whose every
 *                      draft is token 3: all its layers are zero, so each
 *                      block row leaves the layers as the target embedding
 *                      of its token; the mask token's embedding is e_3 and
 *                      the LM head row v is e_v, so slot k >= 1 always
 *                      predicts 3. Sequences with 3s in chosen places then
 *                      have known accepted prefixes, invalid slots included.
 *   test_lines         the output columns, TSV formatting, --anchors-from.
 */
#include "common.h"
#include "drafter.h"
#include "ops.h"
#include "score.h"
#include "test.h"
#include "train.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int near(double a, double b) { return fabs(a - b) <= 1e-12 * (1 + fabs(b)); }

/* ---- the statistics alone ------------------------------------------------------ */

static void test_block_stats(void) {
    dfl_score_stats st;
    dfl_score_stats_init(&st, 5);
    uint8_t all[5] = {0, 1, 1, 1, 1}, hole2[5] = {0, 1, 0, 1, 1};
    /* record 1: blocks A (s=4), B (s=0), C (s=2), D (s=1, slot 2 cannot be verified) */
    dfl_score_block(&st, 4, all);
    dfl_score_block(&st, 0, all);
    dfl_score_block(&st, 2, NULL);
    dfl_score_block(&st, 1, hole2);
    dfl_score_record(&st, 4, 5 + 1 + 3 + 2);
    /* record 2: one block, s = 3 */
    dfl_score_block(&st, 3, NULL);
    dfl_score_record(&st, 1, 4);
    /* hist: s=0: B; s=1: D; s=2: C; s=3: E; s=4: A */
    for (int s = 0; s < 5; s++) T_CHECKF(st.hist[s] == 1, "hist[%d] = %lld", s, (long long)st.hist[s]);
    /* pooled: (5+1+3+2+4)/5 = 3; macro: (11/4 + 4)/2 = 3.375 */
    T_CHECK(near(dfl_score_tau_pooled(&st), 3.0));
    T_CHECK(near(dfl_score_tau_macro(&st), 3.375));
    /* slot 1: tried by all 5, accepted by A, C, D, E: 4/5
     * slot 2: reached by A, C, D, E; D's slot 2 is invalid (censored): tried
     *         by A, C, E, accepted by A, C, E: 3/3
     * slot 3: tried by A, C, E; accepted by A, E: 2/3
     * slot 4: tried by A, E; accepted by A: 1/2 */
    T_CHECK(near(dfl_score_accept_k(&st, 1), 0.8));
    T_CHECK(near(dfl_score_accept_k(&st, 2), 1.0));
    T_CHECK(near(dfl_score_accept_k(&st, 3), 2.0 / 3.0));
    T_CHECK(near(dfl_score_accept_k(&st, 4), 0.5));
    T_CHECK(st.reach[2] == 3 && st.accept[2] == 3);
    /* nothing else reached: NaN, not 0 */
    dfl_score_stats e;
    dfl_score_stats_init(&e, 4);
    dfl_score_block(&e, 0, NULL);
    T_CHECK(near(dfl_score_accept_k(&e, 1), 0.0) && isnan(dfl_score_accept_k(&e, 2)));
    T_CHECK(isnan(dfl_score_tau_macro(&e)) && near(dfl_score_tau_pooled(&e), 1.0));
}

/* ---- offline, through the training code -------------------------------------------- */

#define V 11
#define H 8
#define MASK 10
#define C 3 /* what the constant drafter drafts */

static dfl_drafter *constant_drafter(int B) {
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\":[\"DFlashDraftModel\"],\"model_type\":\"qwen3\",\"block_size\":%d,"
             "\"num_target_layers\":4,\"dflash_config\":{\"mask_token_id\":%d,\"target_layer_ids\":[1]},"
             "\"hidden_size\":%d,\"intermediate_size\":8,\"num_hidden_layers\":1,\"num_attention_heads\":2,"
             "\"num_key_value_heads\":1,\"head_dim\":4,\"rms_norm_eps\":1e-6,\"rope_theta\":1000.0,\"vocab_size\":%d}",
             B, MASK, H, V);
    dfl_drafter_config c;
    if (dfl_drafter_config_parse(&c, cfg, strlen(cfg), "<test>")) return NULL;
    dfl_drafter *d = dfl_drafter_new(dfl_ops_cpu(), &c);
    dfl_drafter_config_free(&c);
    float *w = dfl_calloc((size_t)d->nparams, 4);
    for (int i = 0; i < d->ntensors; i++)
        if (d->info[i].ndim == 1)
            for (int64_t j = 0; j < d->info[i].numel; j++) w[d->info[i].offset + j] = 1.0f; /* norms 1, matrices 0 */
    dfl_drafter_set_master(d, w);
    free(w);
    float embed[V * H], head[V * H];
    for (int v = 0; v < V; v++)
        for (int h = 0; h < H; h++) {
            embed[v * H + h] = (float)((v * 7 + h * 3) % 5) - 2.0f; /* any: slot 0 is never drafted */
            head[v * H + h] = v < H && h == v ? 1.0f : 0.0f;       /* logit v = out[v] */
        }
    for (int h = 0; h < H; h++) embed[MASK * H + h] = h == C ? 1.0f : 0.0f;
    dfl_drafter_set_target(d, embed, head, NULL, 1e-6f);
    return d;
}

/* Record 1 (T = 10) and record 2 (T = 4), B = 4 (slots 1..3):
 *   pos   0  1  2  3  4  5  6  7  8  9
 *   ids   5  3  3  7  3  3  3  3  1  3
 *   mask  0  1  1  1  1  1  0  1  1  1
 * anchors (mask[a] = mask[a+1] = 1): 1 2 3 4 7 8; slots a+1..a+3:
 *   a=1: 3 ok, 7 wrong              s=1
 *   a=2: 7 wrong                    s=0
 *   a=3: 3 ok, 3 ok, pos 6 masked   s=2 (slot 3 invalid)
 *   a=4: 3 ok, pos 6 masked         s=1 (slot 2 invalid, slot 3 valid and right)
 *   a=7: 1 wrong                    s=0 (slot 3 past the end)
 *   a=8: 3 ok, past the end         s=1
 * record 2: ids 3 3 3 3, mask 1 1 1 1: anchors 0 1 2 -> s = 3, 2, 1. */
static const int32_t ids1[10] = {5, 3, 3, 7, 3, 3, 3, 3, 1, 3}, ids2[4] = {3, 3, 3, 3};
static const uint8_t mask1[10] = {0, 1, 1, 1, 1, 1, 0, 1, 1, 1}, mask2[4] = {1, 1, 1, 1}, mask0[5] = {0, 0, 1, 0, 1};

static void run_offline(dfl_drafter *d, int64_t micro_rows, dfl_score_stats *out) {
    dfl_train_opts o;
    dfl_train_opts_default(&o, d->cfg.block_size);
    dfl_offline *s = dfl_offline_new(d, &o, micro_rows);
    float feats[10 * H];
    for (int i = 0; i < 10 * H; i++) feats[i] = (float)(i % 7) * 0.25f;
    int32_t a[10];
    dfl_train_seq q1 = {10, ids1, mask1, feats, DFL_F32, NULL, NULL, DFL_F32};
    dfl_train_seq q2 = {4, ids2, mask2, feats, DFL_F32, NULL, NULL, DFL_F32};
    dfl_train_seq q0 = {5, ids1, mask0, feats, DFL_F32, NULL, NULL, DFL_F32}; /* no anchor at all */
    dfl_offline_add(s, &q1, a, dfl_anchor_candidates(a, mask1, 10));
    dfl_offline_add(s, &q0, a, dfl_anchor_candidates(a, mask0, 5));
    dfl_offline_add(s, &q2, a, dfl_anchor_candidates(a, mask2, 4));
    *out = *dfl_offline_finish(s);
    dfl_offline_free(s);
}

static void check_offline(int64_t micro_rows) {
    dfl_drafter *d = constant_drafter(4);
    if (!d) {
        T_CHECK(0);
        return;
    }
    dfl_score_stats st;
    run_offline(d, micro_rows, &st);
    T_CHECKF(st.records == 3 && st.scored == 2 && st.blocks == 9 && st.tokens == 19, "records %lld scored %lld blocks %lld",
             (long long)st.records, (long long)st.scored, (long long)st.blocks);
    /* hist: record 1 s = 1 0 2 1 0 1, record 2 s = 3 2 1 */
    const int64_t hist[4] = {2, 4, 2, 1};
    for (int s = 0; s < 4; s++) T_CHECKF(st.hist[s] == hist[s], "hist[%d] = %lld", s, (long long)st.hist[s]);
    /* pooled (1*2 + 2*4 + 3*2 + 4*1)/9 = 20/9; macro ((2+1+3+2+1+2)/6 + (4+3+2)/3)/2 = (11/6 + 3)/2 */
    T_CHECKF(near(dfl_score_tau_pooled(&st), 20.0 / 9.0), "tau %.12f", dfl_score_tau_pooled(&st));
    T_CHECKF(near(dfl_score_tau_macro(&st), (11.0 / 6.0 + 3.0) / 2.0), "macro %.12f", dfl_score_tau_macro(&st));
    /* conditional: slot 1 tried by all 9, accepted by 7 (s >= 1); slot 2
     * reached by a=1, a=3 (rec 1; a=4 and a=8 censored) and a=0, a=1 (rec 2;
     * a=2 censored), accepted by a=3, a=0, a=1: 3/4; slot 3 reached by a=3
     * (censored) and rec 2's a=0: 1/1 */
    T_CHECK(near(dfl_score_accept_k(&st, 1), 7.0 / 9.0));
    T_CHECK(near(dfl_score_accept_k(&st, 2), 3.0 / 4.0));
    T_CHECK(near(dfl_score_accept_k(&st, 3), 1.0));
    /* marginal: valid slots k=1: 9 (7 right), k=2: 6 (5 right), k=3: 4 (4 right) */
    T_CHECK(st.count[1] == 9 && st.correct[1] == 7);
    T_CHECK(st.count[2] == 6 && st.correct[2] == 5);
    T_CHECK(st.count[3] == 4 && st.correct[3] == 4);
    T_CHECK(near(dfl_score_accuracy(&st), 16.0 / 19.0));
    /* loss: z_3 = 1/sqrt(1/8 + eps), every other logit 0; CE = lse - z_y
     * with lse = log(e^z3 + 10); w_k = exp(-(k-1)/4) (gamma 4 for B = 4) */
    double z3 = 1.0 / sqrt(1.0 / 8.0 + 1e-6), lse = log(exp(z3) + 10.0);
    double w[4] = {0, 1, exp(-0.25), exp(-0.5)}, right[4] = {0, 7, 5, 4}, wrong[4] = {0, 2, 1, 0};
    double num = 0, den = 0;
    for (int k = 1; k < 4; k++) {
        num += w[k] * (right[k] * (lse - z3) + wrong[k] * lse);
        den += w[k] * (right[k] + wrong[k]);
    }
    T_CHECKF(fabs(dfl_score_loss(&st) - num / den) < 1e-5, "loss %.8f, expected %.8f", dfl_score_loss(&st), num / den);
    dfl_drafter_free(d);
}

static void test_offline_one_batch(void) { check_offline(1 << 20); }
/* 9 rows per micro-batch: record 1's anchors split over several, records
 * sharing one; the same answers */
static void test_offline_small_batches(void) { check_offline(9); }

/* ---- output lines ---------------------------------------------------------------------- */

static char *tsv(const json_t *line, int header) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (header) dfl_score_tsv_header(f, line);
    dfl_score_tsv_row(f, line);
    fclose(f);
    return buf;
}

static void test_lines(void) {
    dfl_score_stats st;
    dfl_score_stats_init(&st, 4);
    st.records = 2;
    dfl_score_block(&st, 0, NULL);
    dfl_score_block(&st, 1, NULL);
    dfl_score_record(&st, 2, 3);
    dfl_score_line l = {"2025-01-02T03:04:05Z", "ck\tpt", 17, "val.dfs", 0, "data", 7, "all", -1, 0, 0, -1, -1, NAN};
    json_t *j = dfl_score_line_json(&l, &st);
    const char *want = "time mode drafter step input records blocks tokens tau_macro tau_pooled loss accuracy accept_k "
                       "accuracy_k hist block_size labels gamma anchors seed";
    char keys[1024] = "";
    const char *key;
    json_t *v;
    json_object_foreach(j, key, v) snprintf(keys + strlen(keys), sizeof keys - strlen(keys), "%s%s", keys[0] ? " " : "", key);
    T_CHECKF(!strcmp(keys, want), "offline columns: %s", keys);
    char *s = tsv(j, 1);
    /* tau 1.5 both ways; slot 1: 1/2, slot 2: 0/1, slot 3 never reached; a path with a tab escaped */
    T_CHECKF(strstr(s, "\n2025-01-02T03:04:05Z\toffline\tck\\tpt\t17\tval.dfs\t2\t2\t0\t1.500000\t1.500000\t\t\t"
                       "0.500000,0.000000,nan\tnan,nan,nan\t1,1,0,0\t4\tdata\t7.000000\tall\t\n") != NULL,
             "row: %s", s);
    free(s);
    json_decref(j);
    l.online = 1;
    l.max_new = 64;
    l.step = -1;
    j = dfl_score_line_json(&l, &st);
    keys[0] = 0;
    json_object_foreach(j, key, v) snprintf(keys + strlen(keys), sizeof keys - strlen(keys), "%s%s", keys[0] ? " " : "", key);
    T_CHECKF(!strcmp(keys, "time mode drafter step input records blocks tokens tau_macro tau_pooled accept_k hist "
                           "block_size max_new_tokens tokens_per_s greedy_tokens_per_s speedup mismatches "
                           "temperature seed top_k top_p"),
             "online columns: %s", keys);
    T_CHECK(json_is_null(json_object_get(j, "step")));
    T_CHECK(json_real_value(json_object_get(j, "temperature")) == 0 && json_is_null(json_object_get(j, "seed")) &&
            json_is_null(json_object_get(j, "top_k")) && json_is_null(json_object_get(j, "top_p")));
    json_decref(j);
    l.temperature = 0.7, l.sample_seed = 5, l.top_k = 20, l.top_p = 0.95; /* sampled: its settings */
    j = dfl_score_line_json(&l, &st);
    T_CHECK(fabs(json_real_value(json_object_get(j, "temperature")) - 0.7) < 1e-12 &&
            json_integer_value(json_object_get(j, "seed")) == 5 && json_integer_value(json_object_get(j, "top_k")) == 20 &&
            fabs(json_real_value(json_object_get(j, "top_p")) - 0.95) < 1e-12);
    json_decref(j);
}

static void test_anchors_file(void) {
    char path[] = "/tmp/dflash-test-anchors.XXXXXX";
    int fd = mkstemp(path);
    T_CHECK(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("{\"id\": \"a\", \"anchors\": [3, 5, 9]}\n\n{\"id\": 7, \"anchors\": []}\n", f);
    fclose(f);
    json_t *m = NULL;
    T_CHECK(dfl_score_load_anchors(path, &m) == 0);
    T_CHECK(json_object_size(m) == 2 && json_array_size(json_object_get(m, "a")) == 3 && json_object_get(m, "7"));
    json_decref(m);
    f = fopen(path, "w");
    fputs("{\"id\": \"a\", \"anchors\": [3]}\n{\"id\": \"b\", \"anchors\": [1, -2]}\n", f);
    fclose(f);
    T_CHECK(dfl_score_load_anchors(path, &m) == DFL_EX_DATA);
    T_CHECKF(strstr(dfl_errmsg(), ":2: anchors[1]") != NULL, "%s", dfl_errmsg());
    f = fopen(path, "w");
    fputs("{\"id\": \"a\", \"anchors\": [3]}\n{\"id\": \"a\", \"anchors\": [4]}\n", f);
    fclose(f);
    T_CHECK(dfl_score_load_anchors(path, &m) == DFL_EX_DATA && strstr(dfl_errmsg(), ":2: id \"a\" appears twice"));
    f = fopen(path, "w");
    fputs("{\"id\": \"a\", \"anchors\": [3]}\nnot json\n", f);
    fclose(f);
    T_CHECK(dfl_score_load_anchors(path, &m) == DFL_EX_DATA && strstr(dfl_errmsg(), ":2: not a JSON object"));
    unlink(path);
    T_CHECK(dfl_score_load_anchors(path, &m) == DFL_EX_NOINPUT);
}

int main(void) {
    omp_set_num_threads(1);
    T_RUN(test_block_stats);
    T_RUN(test_offline_one_batch);
    T_RUN(test_offline_small_batches);
    T_RUN(test_lines);
    T_RUN(test_anchors_file);
    return t_exit();
}
