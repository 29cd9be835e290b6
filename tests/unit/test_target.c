/* test_target.c: the target model against Hugging Face transformers.
 *
 * Oracle: tests/fixtures/targets/NAME/reference/expected.safetensors, made
 * by tests/reference/make_targets.py (transformers, fp32 compute on the same
 * bf16 weights, eager attention, each sample run alone).
 *
 * Thresholds (normalised error e = sum (a-b)^2 / sum b^2, b = HF):
 *   F32_TOL 1e-9   our f32 states vs HF's f32 states. Both compute in f32;
 *                  they differ only by summation order (GEMM blocking,
 *                  softmax, RMSNorm reductions): relative error ~1e-7 per
 *                  op, e ~1e-13 after a few layers. 1e-9 leaves room for
 *                  deeper growth and still catches any real slip (a bf16
 *                  cos/sin, a wrong eps, a missing norm weight are >= 1e-7).
 *   HYBRID_TOL 1e-8 the same for Qwen3.5. Its DeltaNet output goes through
 *                  an RMSNorm of values of rms ~5e-3, which amplifies
 *                  rounding: a one-ulp (1e-7 relative) change of the
 *                  embeddings alone moves the last state by nmse 6e-10,
 *                  and transformers' chunked form of the recurrence differs
 *                  from the recurrent one we run by nmse 1e-10 on these
 *                  models (measured by tests/reference/make_targets.py). A
 *                  real slip (a wrong decay, gate or norm) costs > 1e-3.
 *   BF16_TOL 1e-5  the same after rounding ours to bf16 (what the stream
 *                  stores): bf16 keeps 8 significant bits, relative rounding
 *                  error <= 2^-9, uniform, so e ~ 2^-18/3 = 1.3e-6 from
 *                  storage alone; 1e-5 is ~8x that.
 *   WRONG_MIN 1e-3 tapping the neighbouring layer (HF hidden_states[k], the
 *                  classic off-by-one) must give at least this; the fixture
 *                  script asserts every layer moves the stream that much.
 *   GAP_MIN 1e-3   target ids must equal HF's argmax wherever HF's top-2
 *                  logit gap exceeds this: f32 logit differences are
 *                  ~1e-6 here, so a smaller gap is a genuine near-tie.
 */
#include "common.h"
#include "ops.h"
#include "safetensors.h"
#include "target.h"
#include "test.h"

#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define F32_TOL 1e-9
#define HYBRID_TOL 1e-8
#define BF16_TOL 1e-5
#define WRONG_MIN 1e-3
#define GAP_MIN 1e-3

static const char *FIX = "tests/fixtures/targets";

typedef struct {
    dfl_st *st;
    int64_t T, nseq, L, H;
    const int32_t *ids, *cu, *argmax;
    float *hs;          /* [L+1, T, H] */
    float *prenorm;     /* [T, H] */
    const float *gap;
} expected;

static const void *get_i32(dfl_st *st, const char *name, int64_t *n) {
    const dfl_st_tensor *t = dfl_st_find(st, name);
    if (!t || t->dtype != DFL_I32 || t->ndim != 1) return NULL;
    *n = t->shape[0];
    return t->data;
}

static int load_expected(expected *e, const char *name) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/reference/expected.safetensors", FIX, name);
    memset(e, 0, sizeof *e);
    if (dfl_st_open(&e->st, p)) return -1;
    int64_t ncu = 0, nam = 0;
    e->ids = get_i32(e->st, "input_ids", &e->T);
    e->cu = get_i32(e->st, "cu", &ncu);
    e->argmax = get_i32(e->st, "argmax", &nam);
    e->nseq = ncu - 1;
    if (nam != e->T) return -1;
    const dfl_st_tensor *hs = dfl_st_find(e->st, "hidden_states"), *pre = dfl_st_find(e->st, "last_prenorm"),
                        *gap = dfl_st_find(e->st, "gap");
    if (!e->ids || !e->cu || !e->argmax || !hs || !pre || !gap || hs->ndim != 3) return -1;
    e->L = hs->shape[0] - 1;
    e->H = hs->shape[2];
    e->hs = dfl_malloc((size_t)hs->numel * sizeof(float));
    dfl_st_to_f32(hs, e->hs);
    e->prenorm = dfl_malloc((size_t)pre->numel * sizeof(float));
    dfl_st_to_f32(pre, e->prenorm);
    e->gap = (const float *)gap->data;
    return 0;
}

static void free_expected(expected *e) {
    free(e->hs);
    free(e->prenorm);
    dfl_st_close(e->st);
}

static dfl_target *load(const char *name, int nlayers, int head) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", FIX, name);
    dfl_target *t = NULL;
    dfl_target_opts o = {nlayers, head};
    int rc = dfl_target_load(&t, p, dfl_ops_cpu(), &o);
    if (rc) fprintf(stderr, "  load %s: %s\n", name, dfl_errmsg());
    return t;
}

/* Fixture `name`'s expected outputs in *e and its model loaded with
 * (nlayers, head); NULL, with a failed check and nothing left open, when
 * either cannot be read. */
static dfl_target *open_case(expected *e, const char *name, int nlayers, int head) {
    if (load_expected(e, name)) {
        T_CHECKF(0, "%s: cannot read the expected outputs", name);
        return NULL;
    }
    dfl_target *t = load(name, nlayers, head);
    T_CHECKF(t != NULL, "%s: cannot load the model", name);
    if (!t) free_expected(e);
    return t;
}

/* The HF state that "output of layer k" must equal. */
static const float *hf_layer_out(const expected *e, int64_t k) {
    return k == e->L - 1 ? e->prenorm : e->hs + (k + 1) * e->T * e->H;
}

static double nmse_bf16(const float *a, const float *b, int64_t n) {
    float *r = dfl_malloc((size_t)n * sizeof *r);
    for (int64_t i = 0; i < n; i++) r[i] = dfl_bf16_to_f32(dfl_f32_to_bf16(a[i]));
    double e = t_nmse_f32(r, b, n);
    free(r);
    return e;
}

/* Every layer of one fixture model: taps, pre-norm last state, final norm,
 * argmax; and the off-by-one must fail. */
static void check_model(const char *name) {
    expected e;
    dfl_target *t = open_case(&e, name, 0, 1);
    if (!t) return;
    const dfl_ops *ops = dfl_target_ops(t);
    int L = (int)e.L;
    int64_t T = e.T, H = e.H;
    T_CHECK(dfl_target_config(t)->num_hidden_layers == L && dfl_target_config(t)->hidden_size == H);
    const double tol = dfl_target_config(t)->hybrid ? HYBRID_TOL : F32_TOL;
    int taps[64];
    for (int k = 0; k < L; k++) taps[k] = L - 1 - k; /* reversed: order must follow the request */
    dfl_target_batch b = {e.ids, e.cu, e.nseq};
    dfl_target_want w = {.ntaps = L, .taps = taps, .last_hidden = 1, .normed = 1, .argmax = 1};
    dfl_target_out o;
    int rc = dfl_target_forward(t, &o, &b, &w);
    T_CHECKF(rc == 0, "%s", dfl_errmsg());
    if (rc) goto done;
    float *got = dfl_malloc((size_t)(T * L * H) * sizeof *got), *col = dfl_malloc((size_t)(T * H) * sizeof *col);
    dfl_target_taps_to_f32(t, &o, 0, T, got);
    double worst = 0, worst_bf = 0, least_wrong = 1e30;
    for (int j = 0; j < L; j++) {
        int k = taps[j];
        for (int64_t r = 0; r < T; r++) memcpy(col + r * H, got + (r * L + j) * H, (size_t)H * sizeof *col);
        double err = t_nmse_f32(col, hf_layer_out(&e, k), T * H);
        double err_bf = nmse_bf16(col, hf_layer_out(&e, k), T * H);
        double wrong = t_nmse_f32(col, e.hs + k * T * H, T * H); /* HF hidden_states[k]: one too shallow */
        double wrong2 = k + 2 <= L - 1 ? t_nmse_f32(col, e.hs + (k + 2) * T * H, T * H) : 1e30;
        T_CHECKF(err < tol, "%s layer %d: f32 nmse %.3g >= %g", name, k, err, tol);
        T_CHECKF(err_bf < BF16_TOL, "%s layer %d: bf16 nmse %.3g >= %g", name, k, err_bf, BF16_TOL);
        T_CHECKF(wrong > WRONG_MIN && wrong2 > WRONG_MIN, "%s layer %d: an off-by-one tap would pass (%.3g, %.3g)", name,
                 k, wrong, wrong2);
        if (err > worst) worst = err;
        if (err_bf > worst_bf) worst_bf = err_bf;
        if (wrong < least_wrong) least_wrong = wrong;
    }
    /* The last layer's output is pre-norm; HF's last hidden_states entry is
     * post-norm and must NOT match it. */
    ops->act_to_f32(col, o.last_hidden, T * H);
    T_CHECK(t_nmse_f32(col, e.prenorm, T * H) < tol);
    T_CHECK(t_nmse_f32(col, e.hs + L * T * H, T * H) > WRONG_MIN);
    ops->act_to_f32(col, o.normed, T * H);
    double err_norm = t_nmse_f32(col, e.hs + L * T * H, T * H);
    T_CHECKF(err_norm < tol, "%s final norm nmse %.3g", name, err_norm);
    int64_t compared = 0, mism = 0;
    for (int64_t r = 0; r < T; r++) {
        if (e.gap[r] <= GAP_MIN) continue;
        compared++;
        mism += o.argmax[r] != e.argmax[r];
    }
    T_CHECKF(mism == 0 && compared > T / 2, "%s argmax: %lld of %lld differ", name, (long long)mism, (long long)compared);
    fprintf(stderr, "  %s: L=%d T=%lld worst f32 nmse %.2e, worst bf16 nmse %.2e, off-by-one nmse >= %.2e, "
                    "final norm %.2e, argmax %lld/%lld compared\n",
            name, L, (long long)T, worst, worst_bf, least_wrong, err_norm, (long long)compared, (long long)T);
    free(got);
    free(col);
done:
    dfl_target_free(t);
    free_expected(&e);
}

static void test_qwen3_tied(void) { check_model("qwen3-tied"); }
static void test_qwen3_untied_new_spelling(void) { check_model("qwen3-untied"); }
static void test_llama3_rope_scaling(void) { check_model("llama3"); }
static void test_qwen3_sharded(void) { check_model("qwen3-sharded"); }
/* Qwen2: Llama's layer with biases on q, k and v */
static void test_qwen2(void) { check_model("qwen2"); }
static void test_gpt_oss(void) { check_model("gpt-oss"); }
static void test_gpt_oss_mxfp4(void) { check_model("gpt-oss-mxfp4"); }
static void test_qwen3_next(void) { check_model("qwen3-next"); }
/* Mistral: Llama's layer (no sliding window), head_dim set apart from H / heads */
static void test_mistral(void) { check_model("mistral"); }
/* YaRN: its frequencies, and cos and sin times its attention factor */
static void test_qwen3_yarn(void) { check_model("qwen3-yarn"); }

/* Sliding windows (Qwen3: layers 1-3, window 5, derived from
 * max_window_layers; Mistral: every layer, window 7; Qwen3-MoE: every
 * layer, window 6): packed together, and each sample alone, whose first
 * row is then row 0 of the batch (HF's states, the samples shorter than
 * the window and the one of exactly W tokens included). */
static void check_window_samples(const char *name) {
    check_model(name);
    expected e;
    dfl_target *t = open_case(&e, name, 0, 0);
    if (!t) return;
    const int64_t H = e.H, L = e.L, W = dfl_target_config(t)->sliding_window;
    int taps[64], shorter = 0, longer = 0;
    for (int k = 0; k < L; k++) taps[k] = k;
    dfl_target_want w = {.ntaps = (int)L, .taps = taps};
    for (int64_t s = 0; s < e.nseq; s++) {
        const int64_t r0 = e.cu[s], n = e.cu[s + 1] - r0;
        const int32_t cu[2] = {0, (int32_t)n};
        dfl_target_batch b = {e.ids + r0, cu, 1};
        dfl_target_out o;
        T_CHECKF(dfl_target_forward(t, &o, &b, &w) == 0, "%s", dfl_errmsg());
        float *got = dfl_malloc((size_t)(n * L * H) * sizeof *got), *col = dfl_malloc((size_t)(n * H) * sizeof *col);
        dfl_target_taps_to_f32(t, &o, 0, n, got);
        double worst = 0;
        for (int64_t k = 0; k < L; k++) {
            for (int64_t r = 0; r < n; r++) memcpy(col + r * H, got + (r * L + k) * H, (size_t)H * sizeof *col);
            double err = t_nmse_f32(col, hf_layer_out(&e, k) + r0 * H, n * H);
            worst = err > worst ? err : worst;
        }
        T_CHECKF(worst < F32_TOL, "%s sample %lld (%lld rows, window %lld): nmse %.3g", name, (long long)s,
                 (long long)n, (long long)W, worst);
        shorter += n <= W && n > 1;
        longer += n > W;
        free(got);
        free(col);
    }
    T_CHECKF(shorter && longer, "%s: samples on both sides of the window", name);
    dfl_target_free(t);
    free_expected(&e);
}
static void test_qwen3_swa(void) { check_window_samples("qwen3-swa"); }
static void test_mistral_swa(void) { check_window_samples("mistral-swa"); }
/* Qwen3-MoE: window 6 on every layer, max_window_layers (3) ignored */
static void test_qwen3_moe_swa(void) { check_window_samples("qwen3-moe-swa"); }
/* Qwen3.5: Gated DeltaNet and gated attention layers, (1 + w) norms,
 * partial RoPE; as Qwen3_5ForCausalLM and in the released VLM layout
 * (text_config, model.language_model.*, sharded, no layer_types). */
static void test_qwen35(void) { check_model("qwen35"); }
/* YaRN over a partial RoPE: the pass-through dims are not scaled */
static void test_qwen35_yarn(void) { check_model("qwen35-yarn"); }
static void test_qwen35_vlm_layout(void) { check_model("qwen35-vlm"); }

/* Mixture of experts (made by tests/reference/make_targets_moe.py): Qwen3-MoE
 * with the experts one tensor each (as the released Qwen3-30B-A3B files) and
 * one dense layer (mlp_only_layers), the same weights stacked as
 * transformers 5 writes them (and "num_local_experts"); Qwen3.5-MoE with the
 * shared expert, flat and in the released VLM layout (stacked experts). */
static void test_qwen3_moe(void) { check_model("qwen3-moe"); }
static void test_qwen3_moe_fused(void) { check_model("qwen3-moe-fused"); }
static void test_qwen35_moe(void) { check_model("qwen35-moe"); }
static void test_qwen35_moe_vlm_layout(void) { check_model("qwen35-moe-vlm"); }

/* Packing several samples into one forward gives each sample the states it
 * gets alone. Rows of a packed batch go through the same GEMMs (rows are
 * independent), attention is per sequence, so the result is bitwise equal
 * unless the BLAS picks a different reduction order for a different M. */
static void check_packing(const char *name, int tap0, int tap1, int tap2) {
    expected e;
    dfl_target *t = open_case(&e, name, 0, 1);
    if (!t) return;
    int taps[3] = {tap0, tap1, tap2};
    int64_t T = e.T, H = e.H, K = 3;
    float *packed = dfl_malloc((size_t)(T * K * H) * sizeof(float)), *alone = dfl_malloc((size_t)(T * K * H) * sizeof(float));
    int32_t *pk_ids = dfl_malloc((size_t)T * sizeof(int32_t));
    dfl_target_batch b = {e.ids, e.cu, e.nseq};
    dfl_target_want w = {.ntaps = 3, .taps = taps, .argmax = 1};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    dfl_target_taps_to_f32(t, &o, 0, T, packed);
    memcpy(pk_ids, o.argmax, (size_t)T * sizeof(int32_t));
    int64_t id_diff = 0;
    for (int64_t s = 0; s < e.nseq; s++) {
        int32_t cu1[2] = {0, e.cu[s + 1] - e.cu[s]};
        dfl_target_batch b1 = {e.ids + e.cu[s], cu1, 1};
        T_CHECK(dfl_target_forward(t, &o, &b1, &w) == 0);
        dfl_target_taps_to_f32(t, &o, 0, cu1[1], alone + e.cu[s] * K * H);
        for (int64_t r = 0; r < cu1[1]; r++) id_diff += o.argmax[r] != pk_ids[e.cu[s] + r];
    }
    double err = t_nmse_f32(packed, alone, T * K * H);
    int bitwise = !memcmp(packed, alone, (size_t)(T * K * H) * sizeof(float));
    /* a sequence's leak into the next (conv history, state) costs > 1e-3 */
    double tol = dfl_target_config(t)->hybrid ? 1e-9 : 1e-10;
    T_CHECKF(err < tol, "packed vs alone nmse %.3g", err);
    T_CHECK(id_diff == 0);
    fprintf(stderr, "  %s packed vs one at a time: %s (nmse %.2e)\n", name, bitwise ? "bitwise equal" : "not bitwise",
            err);
    free(packed);
    free(alone);
    free(pk_ids);
    dfl_target_free(t);
    free_expected(&e);
}

static void test_packing_matches_one_at_a_time(void) { check_packing("qwen3-tied", 0, 3, 5); }
/* The hybrid: the convolution's history and the recurrent state restart at
 * every sequence of the batch (3 tokens or the whole state would leak). */
static void test_packing_qwen35(void) { check_packing("qwen35", 0, 3, 6); }
/* Routing is per token: packing changes no expert choice. */
static void test_packing_moe(void) {
    check_packing("qwen3-moe", 0, 1, 3);
    check_packing("qwen35-moe-vlm", 0, 3, 6);
}

/* A batch of NS sequences of LEN longer than the MLP's row chunk gives the
 * same states as its sequences run alone, each within one chunk. */
static void check_long_batch(const char *name, int NS, int LEN) {
    dfl_target *t = load(name, 0, 0);
    if (!t) {
        T_CHECK(0);
        return;
    }
    int64_t T = (int64_t)NS * LEN, H = dfl_target_config(t)->hidden_size;
    int32_t *ids = dfl_malloc((size_t)T * sizeof(int32_t)), *cu = dfl_malloc((size_t)(NS + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919 + 13) % 97);
    for (int s = 0; s <= NS; s++) cu[s] = s * LEN;
    int tap = 2;
    float *packed = dfl_malloc((size_t)(T * H) * sizeof(float)), *alone = dfl_malloc((size_t)(T * H) * sizeof(float));
    dfl_target_batch b = {ids, cu, NS};
    dfl_target_want w = {.ntaps = 1, .taps = &tap};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    dfl_target_taps_to_f32(t, &o, 0, T, packed);
    for (int s = 0; s < NS; s++) {
        int32_t cu1[2] = {0, LEN};
        dfl_target_batch b1 = {ids + cu[s], cu1, 1};
        T_CHECK(dfl_target_forward(t, &o, &b1, &w) == 0);
        dfl_target_taps_to_f32(t, &o, 0, LEN, alone + (int64_t)cu[s] * H);
    }
    double err = t_nmse_f32(packed, alone, T * H);
    T_CHECKF(err < 1e-10, "%s: chunked vs alone nmse %.3g", name, err);
    free(ids);
    free(cu);
    free(packed);
    free(alone);
    dfl_target_free(t);
}

/* 4096 rows a dense chunk: 43 sequences of 100. */
static void test_long_batch_chunks(void) { check_long_batch("qwen3-sharded", 43, 100); }
/* 32768 tokens a sparse chunk at 2 experts a token (65536 pairs): 330
 * sequences of 100 cross it. */
static void test_long_batch_chunks_moe(void) { check_long_batch("qwen3-moe", 330, 100); }

/* normed / argmax for chosen rows equal those rows of the full result. */
static void test_rows(void) {
    expected e;
    dfl_target *t = open_case(&e, "llama3", 0, 1);
    if (!t) return;
    const dfl_ops *ops = dfl_target_ops(t);
    int64_t T = e.T, H = e.H;
    dfl_target_batch b = {e.ids, e.cu, e.nseq};
    dfl_target_want w = {.normed = 1, .argmax = 1};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    float *full = dfl_malloc((size_t)(T * H) * sizeof(float));
    int32_t *ids = dfl_malloc((size_t)T * sizeof(int32_t));
    ops->act_to_f32(full, o.normed, T * H);
    memcpy(ids, o.argmax, (size_t)T * sizeof(int32_t));
    int32_t rows[] = {5, 6, 7, 20, 3, 3, (int32_t)T - 1};
    int64_t n = sizeof rows / sizeof rows[0];
    w.rows = rows;
    w.nrows = n;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0 && o.nrows == n);
    float *sel = dfl_malloc((size_t)(n * H) * sizeof(float));
    ops->act_to_f32(sel, o.normed, n * H);
    for (int64_t i = 0; i < n; i++) {
        T_CHECK(!memcmp(sel + i * H, full + (int64_t)rows[i] * H, (size_t)H * sizeof(float)));
        T_CHECK(o.argmax[i] == ids[rows[i]]);
    }
    /* sampled rows: the same rows drawn with their keys; bad sampling
     * requests refused (no keys, a temperature whose inverse overflows) */
    uint64_t keys[7] = {1, 2, 3, 4, 5, 6, 7};
    w.temperature = 0.5f, w.sample_keys = keys;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0 && o.nrows == n);
    w.sample_keys = NULL;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    w.sample_keys = keys, w.temperature = 1e-45f;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    w.temperature = -1.0f;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    w.temperature = 0, w.sample_keys = NULL;
    int32_t bad_row = (int32_t)T;
    w.rows = &bad_row;
    w.nrows = 1;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    free(full);
    free(ids);
    free(sel);
    dfl_target_free(t);
    free_expected(&e);
}

/* Loading only the layers needed; requests beyond them are refused. Bad
 * batches are refused, never read out of bounds. */
static void test_partial_load_and_bad_requests(void) {
    expected e;
    dfl_target *t = open_case(&e, "qwen3-tied", 2, 0);
    if (!t) return;
    T_CHECK(dfl_target_loaded_layers(t) == 2);
    int tap = 1, deep = 4, neg = -1;
    dfl_target_batch b = {e.ids, e.cu, e.nseq};
    dfl_target_want w = {.ntaps = 1, .taps = &tap};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    float *got = dfl_malloc((size_t)(e.T * e.H) * sizeof(float));
    dfl_target_taps_to_f32(t, &o, 0, e.T, got);
    T_CHECK(t_nmse_f32(got, e.hs + 2 * e.T * e.H, e.T * e.H) < F32_TOL);
    free(got);
    w.taps = &deep;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    w.taps = &neg;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    w.taps = &tap;
    w.argmax = 1;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == DFL_EX_USAGE);
    w.argmax = 0;
    int32_t ids[3] = {1, 211, 2}, cu[2] = {0, 3}, cu_bad[3] = {0, 2, 2};
    dfl_target_batch bb = {ids, cu, 1};
    T_CHECK(dfl_target_forward(t, &o, &bb, &w) == DFL_EX_DATA && strstr(dfl_errmsg(), "211"));
    ids[1] = 5;
    bb.cu = cu_bad;
    bb.nseq = 2;
    T_CHECK(dfl_target_forward(t, &o, &bb, &w) == DFL_EX_DATA && strstr(dfl_errmsg(), "empty"));
    dfl_target_free(t);
    free_expected(&e);
}

/* ---- broken model directories ------------------------------------------- */

static char tmp[] = "/tmp/dflash-target-XXXXXX";

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    char buf[65536];
    size_t n;
    while (a && b && (n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
    if (a) fclose(a);
    if (b) fclose(b);
}

/* The directory tmp/NAME (into d) with fixture FROM's config.json copied
 * in; returns FROM's weights (all shards) opened, to be rewritten there as
 * one model.safetensors (NULL if they cannot be read). */
static dfl_st *start_copy_of(const char *from, const char *name, char *d, size_t dn) {
    char p[600], src[512];
    snprintf(d, dn, "%s/%s", tmp, name);
    mkdir(d, 0777);
    snprintf(src, sizeof src, "%s/%s/config.json", FIX, from);
    snprintf(p, sizeof p, "%s/config.json", d);
    copy_file(src, p);
    snprintf(src, sizeof src, "%s/%s", FIX, from);
    dfl_st *st;
    return dfl_st_open_dir(&st, src) ? NULL : st;
}

static dfl_st *start_copy(const char *name, char *d, size_t dn) { return start_copy_of("qwen3-tied", name, d, dn); }

/* A copy of fixture FROM in tmp/NAME, with `edit` applied to its tensors:
 * drop (shape NULL) or reshape (2-D) the tensor named `tensor`. */
static void make_broken_of(const char *from, const char *name, const char *tensor, const int64_t *shape) {
    char d[512], p[600];
    dfl_st *st = start_copy_of(from, name, d, sizeof d);
    if (!st) return;
    int n = dfl_st_count(st), k = 0;
    dfl_st_in *in = dfl_calloc((size_t)n, sizeof *in);
    float *keep[1] = {NULL};
    for (int i = 0; i < n; i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        if (tensor && !strcmp(t->name, tensor)) {
            if (!shape) continue;
            /* same bytes, another shape of the same element count is not
             * possible in general: write a fresh zero tensor */
            int64_t numel = shape[0] * shape[1];
            keep[0] = dfl_calloc((size_t)numel, sizeof(float));
            in[k] = (dfl_st_in){t->name, DFL_F32, 2, {shape[0], shape[1]}, keep[0]};
        } else {
            in[k] = (dfl_st_in){t->name, (dfl_dtype)t->dtype, t->ndim, {0}, t->data};
            for (int j = 0; j < t->ndim; j++) in[k].shape[j] = t->shape[j];
        }
        k++;
    }
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    dfl_st_write(p, in, k, NULL);
    free(keep[0]);
    free(in);
    dfl_st_close(st);
}

static void make_broken(const char *name, const char *tensor, const int64_t *shape) {
    make_broken_of("qwen3-tied", name, tensor, shape);
}

static void expect_load_error(const char *name, int code, const char *want) {
    char d[512];
    snprintf(d, sizeof d, "%s/%s", tmp, name);
    dfl_target *t = NULL;
    dfl_target_opts o = {0, 1};
    int rc = dfl_target_load(&t, d, dfl_ops_cpu(), &o);
    T_CHECKF(rc == code && t == NULL && strstr(dfl_errmsg(), want), "%s: rc %d, message '%s', wanted '%s'", name, rc,
             dfl_errmsg(), want);
    dfl_target_free(t);
}

static void edit_config(const char *name, const char *from, const char *to) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s/config.json", tmp, name);
    FILE *f = fopen(p, "rb");
    char buf[8192] = {0}, out[8192];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    char *at = strstr(buf, from);
    if (!at) return;
    snprintf(out, sizeof out, "%.*s%s%s", (int)(at - buf), buf, to, at + strlen(from));
    f = fopen(p, "wb");
    fputs(out, f);
    fclose(f);
}

static void test_broken_models(void) {
    make_broken("missing", "model.layers.3.self_attn.k_norm.weight", NULL);
    expect_load_error("missing", DFL_EX_DATA, "model.layers.3.self_attn.k_norm.weight");
    int64_t wrong[2] = {72, 73};
    make_broken("misshapen", "model.layers.2.mlp.up_proj.weight", wrong);
    expect_load_error("misshapen", DFL_EX_DATA, "model.layers.2.mlp.up_proj.weight");

    make_broken("truncated", NULL, NULL);
    char p[600];
    snprintf(p, sizeof p, "%s/truncated/model.safetensors", tmp);
    struct stat sb;
    stat(p, &sb);
    T_CHECK(truncate(p, sb.st_size - 100) == 0);
    expect_load_error("truncated", DFL_EX_DATA, "model.safetensors");

    make_broken("dynamic", NULL, NULL);
    edit_config("dynamic", "\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 4.0}");
    expect_load_error("dynamic", DFL_EX_DATA, "dynamic");

    make_broken("arch", NULL, NULL);
    edit_config("arch", "Qwen3ForCausalLM", "GemmaForCausalLM");
    expect_load_error("arch", DFL_EX_DATA, "GemmaForCausalLM");
    /* a dense Qwen3 declared MoE: the router the config implies is missing */
    make_broken("dense-as-moe", NULL, NULL);
    edit_config("dense-as-moe", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM");
    expect_load_error("dense-as-moe", DFL_EX_DATA, "model.layers.0.mlp.gate.weight");

    make_broken("drafter-arch", NULL, NULL);
    edit_config("drafter-arch", "Qwen3ForCausalLM", "DFlashDraftModel");
    expect_load_error("drafter-arch", DFL_EX_DATA, "not a supported target");

    /* untied, but no lm_head.weight: fine without the head, refused with it */
    make_broken("nohead", NULL, NULL);
    edit_config("nohead", "\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false");
    expect_load_error("nohead", DFL_EX_DATA, "lm_head.weight");
    dfl_target *t = NULL;
    dfl_target_opts o = {0, 0};
    snprintf(p, sizeof p, "%s/nohead", tmp);
    T_CHECK(dfl_target_load(&t, p, dfl_ops_cpu(), &o) == 0);
    dfl_target_free(t);

    expect_load_error("does-not-exist", DFL_EX_NOINPUT, "does-not-exist");
}

/* Qwen3.5 directories with a DeltaNet tensor missing or misshapen, a layer
 * kind that disagrees with the weights, layer_types of the wrong length, a
 * text_config without a size: each refused with exit 65 and a message that
 * names the tensor or key, both in the flat and the VLM layout. */
static void test_broken_qwen35(void) {
    make_broken_of("qwen35", "q35-missing", "model.layers.0.linear_attn.in_proj_a.weight", NULL);
    expect_load_error("q35-missing", DFL_EX_DATA, "model.layers.0.linear_attn.in_proj_a.weight");
    int64_t conv2d[2] = {160, 4}; /* [C, K]: the [C, 1, K] of nn.Conv1d without its middle 1 */
    make_broken_of("qwen35", "q35-conv", "model.layers.1.linear_attn.conv1d.weight", conv2d);
    expect_load_error("q35-conv", DFL_EX_DATA, "model.layers.1.linear_attn.conv1d.weight");
    int64_t alog[2] = {4, 1};
    make_broken_of("qwen35", "q35-alog", "model.layers.2.linear_attn.A_log", alog);
    expect_load_error("q35-alog", DFL_EX_DATA, "model.layers.2.linear_attn.A_log");
    int64_t gate[2] = {128, 48}; /* q_proj without its gate rows */
    make_broken_of("qwen35", "q35-nogate", "model.layers.3.self_attn.q_proj.weight", gate);
    expect_load_error("q35-nogate", DFL_EX_DATA, "model.layers.3.self_attn.q_proj.weight");

    make_broken_of("qwen35", "q35-kind", NULL, NULL); /* layer 3 declared linear, stored as attention */
    edit_config("q35-kind", "\"linear_attention\",\n    \"full_attention\"", "\"linear_attention\",\n    \"linear_attention\"");
    expect_load_error("q35-kind", DFL_EX_DATA, "model.layers.3.linear_attn.");
    make_broken_of("qwen35", "q35-types", NULL, NULL);
    edit_config("q35-types", "\"layer_types\": [\n    \"linear_attention\",", "\"layer_types\": [");
    expect_load_error("q35-types", DFL_EX_DATA, "layer_types");

    make_broken_of("qwen35-vlm", "vlm-missing", "model.language_model.layers.5.linear_attn.dt_bias", NULL);
    expect_load_error("vlm-missing", DFL_EX_DATA, "model.language_model.layers.5.linear_attn.dt_bias");
    make_broken_of("qwen35-vlm", "vlm-nosize", NULL, NULL);
    edit_config("vlm-nosize", "\"hidden_size\": 48,", "");
    expect_load_error("vlm-nosize", DFL_EX_DATA, "\"hidden_size\" is missing");
    make_broken_of("qwen35-vlm", "vlm-notext", NULL, NULL);
    edit_config("vlm-notext", "\"text_config\"", "\"txt_config\"");
    expect_load_error("vlm-notext", DFL_EX_DATA, "text_config");
    /* the VLM fixture as one file (index dropped) still loads */
    char p[600];
    dfl_target *t = NULL;
    dfl_target_opts o = {0, 1};
    make_broken_of("qwen35-vlm", "vlm-one-file", NULL, NULL);
    snprintf(p, sizeof p, "%s/vlm-one-file", tmp);
    T_CHECKF(dfl_target_load(&t, p, dfl_ops_cpu(), &o) == 0, "%s", dfl_errmsg());
    dfl_target_free(t);
}

/* MoE directories with an expert, a router, a stacked tensor or the shared
 * expert's gate missing or misshapen, a dense layer declared sparse:
 * refused with exit 65 and the tensor named. */
/* gpt-oss's MXFP4 experts: a missing scale tensor, blocks of another dtype
 * and a bias of another shape are refused naming the tensor. */
static void test_broken_mxfp4(void) {
    make_broken_of("gpt-oss-mxfp4", "mx-scales", "model.layers.1.mlp.experts.down_proj_scales", NULL);
    expect_load_error("mx-scales", DFL_EX_DATA, "model.layers.1.mlp.experts.down_proj_scales");
    int64_t blocks[2] = {6, 64};
    make_broken_of("gpt-oss-mxfp4", "mx-dtype", "model.layers.2.mlp.experts.gate_up_proj_blocks", blocks);
    expect_load_error("mx-dtype", DFL_EX_DATA, "gate_up_proj_blocks' has dtype F32; expected U8");
    int64_t bias[2] = {6, 32};
    make_broken_of("gpt-oss-mxfp4", "mx-bias", "model.layers.0.mlp.experts.gate_up_proj_bias", bias);
    expect_load_error("mx-bias", DFL_EX_DATA, "model.layers.0.mlp.experts.gate_up_proj_bias");
    make_broken_of("gpt-oss", "oss-sinks", "model.layers.3.self_attn.sinks", NULL);
    expect_load_error("oss-sinks", DFL_EX_DATA, "model.layers.3.self_attn.sinks");
}

static void test_broken_moe(void) {
    make_broken_of("qwen3-moe", "moe-expert", "model.layers.2.mlp.experts.5.up_proj.weight", NULL);
    expect_load_error("moe-expert", DFL_EX_DATA, "model.layers.2.mlp.experts.5.up_proj.weight");
    int64_t router[2] = {5, 40};
    make_broken_of("qwen3-moe", "moe-router", "model.layers.3.mlp.gate.weight", router);
    expect_load_error("moe-router", DFL_EX_DATA, "model.layers.3.mlp.gate.weight");
    int64_t expert[2] = {40, 20}; /* gate_proj stored transposed */
    make_broken_of("qwen3-moe", "moe-transposed", "model.layers.0.mlp.experts.0.gate_proj.weight", expert);
    expect_load_error("moe-transposed", DFL_EX_DATA, "model.layers.0.mlp.experts.0.gate_proj.weight");
    make_broken_of("qwen3-moe", "moe-dense-layer", NULL, NULL); /* layer 1 is dense in the weights */
    edit_config("moe-dense-layer", "\"mlp_only_layers\": [\n    1\n  ]", "\"mlp_only_layers\": []");
    expect_load_error("moe-dense-layer", DFL_EX_DATA, "model.layers.1.mlp.gate.weight");
    make_broken_of("qwen3-moe", "moe-count", NULL, NULL); /* 7 experts declared, 6 stored */
    edit_config("moe-count", "\"num_experts\": 6", "\"num_experts\": 7");
    expect_load_error("moe-count", DFL_EX_DATA, "model.layers.0.mlp.gate.weight");
    int64_t stacked[2] = {7 * 36, 48}; /* gate_up_proj flattened to 2-D */
    make_broken_of("qwen35-moe-vlm", "moe-stacked", "model.language_model.layers.4.mlp.experts.gate_up_proj", stacked);
    expect_load_error("moe-stacked", DFL_EX_DATA, "model.language_model.layers.4.mlp.experts.gate_up_proj");
    make_broken_of("qwen35-moe-vlm", "moe-down", "model.language_model.layers.6.mlp.experts.down_proj", NULL);
    expect_load_error("moe-down", DFL_EX_DATA, "model.language_model.layers.6.mlp.experts.down_proj");
    make_broken_of("qwen35-moe-vlm", "moe-shared", "model.language_model.layers.7.mlp.shared_expert_gate.weight", NULL);
    expect_load_error("moe-shared", DFL_EX_DATA, "model.language_model.layers.7.mlp.shared_expert_gate.weight");
}

/* A Qwen3-MoE target whose sparse chunks are shorter than the dense ones
 * (40 experts a token: 65536 / 40 = 1638 tokens against MLP_ROWS = 4096),
 * with dense layers (decoder_sparse_step 2): a forward of 1700 rows, then
 * one of 3000, must give the second what a fresh target gives it. The MLP's
 * scratch must grow with the dense chunk even once the sparse chunk has
 * stopped growing (it did not: the dense layers wrote past it). Made by
 * mktarget; random weights, no reference needed (the oracle is a fresh load). */
static void forward_rows(dfl_target *t, int64_t T, int tap, float *out) {
    enum { LEN = 100 };
    const int NS = (int)(T / LEN);
    int32_t *ids = dfl_malloc((size_t)T * sizeof(int32_t)), *cu = dfl_malloc((size_t)(NS + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < T; i++) ids[i] = (int32_t)((i * 7919 + 13) % 97);
    for (int s = 0; s <= NS; s++) cu[s] = s * LEN;
    dfl_target_batch b = {ids, cu, NS};
    dfl_target_want w = {.ntaps = 1, .taps = &tap};
    dfl_target_out o;
    T_CHECK(dfl_target_forward(t, &o, &b, &w) == 0);
    if (out) dfl_target_taps_to_f32(t, &o, 0, T, out);
    free(ids);
    free(cu);
}

static void test_moe_workspace_growth(void) {
    char dir[600], cmd[1600];
    const char *build = getenv("DFLASH_BUILD");
    snprintf(dir, sizeof dir, "%s/moe-wide-k", tmp);
    snprintf(cmd, sizeof cmd,
             "'%s/tests/mktarget' --experts 40 --experts-per-tok 40 --moe-intermediate 8 --sparse-step 2 --layers 4 "
             "--hidden 16 --heads 2 --kv-heads 1 --intermediate 64 --vocab 97 -o '%s'",
             build ? build : "build", dir);
    T_CHECKF(system(cmd) == 0, "%s", cmd);
    dfl_target *t = NULL, *fresh = NULL;
    dfl_target_opts opts = {0, 0};
    T_CHECKF(dfl_target_load(&t, dir, dfl_ops_cpu(), &opts) == 0, "%s", dfl_errmsg());
    T_CHECKF(dfl_target_load(&fresh, dir, dfl_ops_cpu(), &opts) == 0, "%s", dfl_errmsg());
    if (!t || !fresh) {
        dfl_target_free(t);
        dfl_target_free(fresh);
        return;
    }
    T_CHECK(dfl_target_config(t)->experts_per_tok == 40 && dfl_target_config(t)->decoder_sparse_step == 2);
    const int64_t T = 3000, H = dfl_target_config(t)->hidden_size;
    float *got = dfl_malloc((size_t)(T * H) * sizeof(float)), *want = dfl_malloc((size_t)(T * H) * sizeof(float));
    forward_rows(t, 1700, 3, NULL);
    forward_rows(t, T, 3, got);
    forward_rows(fresh, T, 3, want);
    T_CHECK(!memcmp(got, want, (size_t)(T * H) * sizeof(float)));
    free(got);
    free(want);
    dfl_target_free(t);
    dfl_target_free(fresh);
}

/* A 2 MB directory whose config.json claims a MoE model of 20000 layers of
 * 4096 experts (count_params accepts it: the experts are 1 wide) and whose
 * weights hold the embedding and every layer's input norm, so the layer
 * count checks out, and nothing else. The loader must refuse it naming the
 * first missing tensor without first planning the 2.5e8 tensors the config
 * implies (~57 GB of plan: it did). Loaded in a child under an address-space
 * limit of what the test already holds plus 1 GiB (the normal build; ASan
 * reserves terabytes of shadow, so the limit cannot apply there). */
static void test_moe_plan_bounded_by_weights(void) {
#ifdef UNDER_ASAN
    printf("  skipped under ASan (needs RLIMIT_AS)\n");
#else
    enum { L = 20000 };
    char d[512], p[600];
    snprintf(d, sizeof d, "%s/moe-claims", tmp);
    mkdir(d, 0777);
    snprintf(p, sizeof p, "%s/config.json", d);
    FILE *f = fopen(p, "w");
    fprintf(f, "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":2,\"num_hidden_layers\":%d,"
               "\"num_attention_heads\":1,\"num_key_value_heads\":1,\"head_dim\":2,\"vocab_size\":4,"
               "\"num_experts\":4096,\"num_experts_per_tok\":1,\"moe_intermediate_size\":1,\"intermediate_size\":2}",
            L);
    fclose(f);
    static float zeros[8];
    char (*names)[64] = dfl_malloc((L + 1) * sizeof *names);
    dfl_st_in *in = dfl_calloc(L + 1, sizeof *in);
    in[0] = (dfl_st_in){"model.embed_tokens.weight", DFL_F32, 2, {4, 2}, zeros};
    for (int i = 0; i < L; i++) {
        snprintf(names[i], sizeof names[i], "model.layers.%d.input_layernorm.weight", i);
        in[i + 1] = (dfl_st_in){names[i], DFL_F32, 1, {2}, zeros};
    }
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    T_CHECK(dfl_st_write(p, in, L + 1, NULL) == 0);
    free(in);
    free(names);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        FILE *m = fopen("/proc/self/statm", "r");
        unsigned long pages = 0;
        if (m && fscanf(m, "%lu", &pages) == 1) {
            rlim_t cap = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)1 << 30);
            struct rlimit rl = {cap, cap};
            setrlimit(RLIMIT_AS, &rl);
        }
        if (m) fclose(m);
        dfl_target *t = NULL;
        dfl_target_opts o = {0, 0};
        int rc = dfl_target_load(&t, d, dfl_ops_cpu(), &o);
        int named = rc && strstr(dfl_errmsg(), "'model.layers.0.self_attn.q_proj.weight' is missing") != NULL;
        if (!named) fprintf(stderr, "  child: rc %d, %s\n", rc, dfl_errmsg());
        _exit(rc == DFL_EX_DATA && named ? 0 : 1);
    }
    int st = 0;
    T_CHECK(pid > 0 && waitpid(pid, &st, 0) == pid);
    T_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
#endif
}

/* ---- weight encodings ---------------------------------------------------- */

/* All taps of fixture FROM's inputs for the model in `dir`, f32; and,
 * unless NULL, the bytes its weights take in *wbytes. */
static float *all_taps_of(const char *from, const char *dir, int64_t *n, uint64_t *wbytes) {
    expected e;
    float *got = NULL;
    if (load_expected(&e, from)) return NULL;
    dfl_target *t = NULL;
    dfl_target_opts o = {0, 0};
    if (dfl_target_load(&t, dir, dfl_ops_cpu(), &o) == 0) {
        if (wbytes) *wbytes = dfl_target_weight_bytes(t);
        int taps[64], L = (int)e.L;
        for (int k = 0; k < L; k++) taps[k] = k;
        dfl_target_batch b = {e.ids, e.cu, e.nseq};
        dfl_target_want w = {.ntaps = L, .taps = taps};
        dfl_target_out out;
        if (dfl_target_forward(t, &out, &b, &w) == 0) {
            *n = e.T * L * e.H;
            got = dfl_malloc((size_t)*n * sizeof *got);
            dfl_target_taps_to_f32(t, &out, 0, e.T, got);
        }
    } else {
        fprintf(stderr, "  %s: %s\n", dir, dfl_errmsg());
    }
    dfl_target_free(t);
    free_expected(&e);
    return got;
}

static float *all_taps(const char *dir, int64_t *n) { return all_taps_of("qwen3-tied", dir, n, NULL); }

/* Fixture FROM rewritten with every tensor in `dtype` (f32, f16) in tmp/NAME. */
static void make_converted_of(const char *from, const char *name, dfl_dtype dtype) {
    char d[512], p[600];
    dfl_st *st = start_copy_of(from, name, d, sizeof d);
    if (!st) return;
    int n = dfl_st_count(st);
    dfl_st_in *in = dfl_calloc((size_t)n, sizeof *in);
    void **bufs = dfl_calloc((size_t)n, sizeof *bufs);
    for (int i = 0; i < n; i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        if (t->dtype == DFL_U8) { /* MXFP4 blocks and scales: as they are */
            bufs[i] = memcpy(dfl_malloc(t->nbytes), t->data, t->nbytes);
            in[i] = (dfl_st_in){t->name, DFL_U8, t->ndim, {0}, bufs[i]};
            for (int j = 0; j < t->ndim; j++) in[i].shape[j] = t->shape[j];
            continue;
        }
        float *f = dfl_malloc((size_t)t->numel * sizeof *f);
        dfl_st_to_f32(t, f);
        if (dtype == DFL_F16) {
            uint16_t *h = dfl_malloc((size_t)t->numel * sizeof *h);
            for (int64_t j = 0; j < t->numel; j++) h[j] = dfl_f32_to_f16(f[j]);
            free(f);
            bufs[i] = h;
        } else {
            bufs[i] = f;
        }
        in[i] = (dfl_st_in){t->name, dtype, t->ndim, {0}, bufs[i]};
        for (int j = 0; j < t->ndim; j++) in[i].shape[j] = t->shape[j];
    }
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    dfl_st_write(p, in, n, NULL);
    for (int i = 0; i < n; i++) free(bufs[i]);
    free(bufs);
    free(in);
    dfl_st_close(st);
}

static void make_converted(const char *name, dfl_dtype dtype) { make_converted_of("qwen3-tied", name, dtype); }

/* qwen3-tied with a 1-byte tensor first, so every weight is misaligned in
 * the file (other writers do not align); written by hand. */
static void make_unaligned(const char *name) {
    char d[512], p[600];
    dfl_st *st = start_copy(name, d, sizeof d);
    if (!st) return;
    json_t *h = json_object();
    json_object_set_new(h, "aaa.pad", json_pack("{s:s,s:[i],s:[i,i]}", "dtype", "U8", "shape", 1, "data_offsets", 0, 1));
    uint64_t off = 1;
    for (int i = 0; i < dfl_st_count(st); i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        json_t *shape = json_array();
        for (int j = 0; j < t->ndim; j++) json_array_append_new(shape, json_integer(t->shape[j]));
        json_object_set_new(h, t->name, json_pack("{s:s,s:o,s:[I,I]}", "dtype", t->dtype_str, "shape", shape,
                                                  "data_offsets", (json_int_t)off, (json_int_t)(off + t->nbytes)));
        off += t->nbytes;
    }
    char *text = json_dumps(h, JSON_COMPACT);
    uint64_t n = strlen(text), padded = (n + 7) / 8 * 8;
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    FILE *f = fopen(p, "wb");
    fwrite(&padded, 8, 1, f);
    fputs(text, f);
    for (uint64_t i = n; i < padded; i++) fputc(' ', f);
    fputc(0, f);
    for (int i = 0; i < dfl_st_count(st); i++) fwrite(dfl_st_at(st, i)->data, 1, dfl_st_at(st, i)->nbytes, f);
    fclose(f);
    free(text);
    json_decref(h);
    dfl_st_close(st);
}

/* The same weights stored as f32 give bitwise the same states as bf16;
 * as f16 (exact for all but the tiniest weights) the same to ~f32 rounding;
 * misaligned in the file, bitwise the same. */
static void test_weight_encodings(void) {
    char ref_dir[512], d[600];
    snprintf(ref_dir, sizeof ref_dir, "%s/qwen3-tied", FIX);
    int64_t n = 0;
    float *ref = all_taps(ref_dir, &n), *got;
    T_CHECK(ref != NULL);
    if (!ref) return;
    make_converted("f32", DFL_F32);
    snprintf(d, sizeof d, "%s/f32", tmp);
    got = all_taps(d, &n);
    T_CHECK(got && !memcmp(got, ref, (size_t)n * sizeof *got));
    free(got);
    make_converted("f16", DFL_F16);
    snprintf(d, sizeof d, "%s/f16", tmp);
    got = all_taps(d, &n);
    double e = got ? t_nmse_f32(got, ref, n) : 1;
    T_CHECKF(e < 1e-8, "f16 weights: nmse %.3g", e);
    fprintf(stderr, "  f16 weights vs bf16: nmse %.2e\n", e);
    free(got);
    /* Qwen3.5 with every tensor f32 (released checkpoints keep A_log and
     * the DeltaNet norm in f32): bitwise the same states as bf16, through
     * every load-time transform ((1 + w), q/gate split, rotary order) */
    char q35[512];
    snprintf(q35, sizeof q35, "%s/qwen35", FIX);
    int64_t n35 = 0, m35 = 0;
    float *ref35 = all_taps_of("qwen35", q35, &n35, NULL);
    make_converted_of("qwen35", "q35-f32", DFL_F32);
    snprintf(d, sizeof d, "%s/q35-f32", tmp);
    got = all_taps_of("qwen35", d, &m35, NULL);
    T_CHECK(ref35 && got && n35 == m35 && !memcmp(got, ref35, (size_t)n35 * sizeof *got));
    free(got);
    /* ... and as f16: the reordered rows are copied in the file's dtype,
     * then widened as any f16 weight is */
    make_converted_of("qwen35", "q35-f16", DFL_F16);
    snprintf(d, sizeof d, "%s/q35-f16", tmp);
    got = all_taps_of("qwen35", d, &m35, NULL);
    e = got && n35 == m35 ? t_nmse_f32(got, ref35, n35) : 1;
    T_CHECKF(e < 1e-8, "qwen35 f16 weights: nmse %.3g", e);
    fprintf(stderr, "  qwen35 f16 weights vs bf16: nmse %.2e\n", e);
    free(got);
    free(ref35);
    make_unaligned("unaligned");
    snprintf(d, sizeof d, "%s/unaligned", tmp);
    got = all_taps(d, &n);
    T_CHECK(got && !memcmp(got, ref, (size_t)n * sizeof *got));
    free(got);
    free(ref);
}

/* Whether tensor `name` is one the CPU keeps as bf16 (target.c mat_dtype):
 * a layer's projection matrices (q, k, v, o; gate, up, down, the shared
 * expert's too; Gated DeltaNet's in_proj_qkv(z), in_proj_z, out_proj) and
 * the experts (biases not). Not: the router, in_proj_a/b/ba, the shared
 * expert's gate, norms, biases, the embedding and the LM head. */
static int is_matrix(const char *name) {
    if (strstr(name, ".mlp.experts.")) return !strstr(name, "_bias");
    size_t n = strlen(name);
    if (n < 7 || strcmp(name + n - 7, ".weight") || !strstr(name, "_proj")) return 0;
    return !strstr(name, "in_proj_a.") && !strstr(name, "in_proj_b.") && !strstr(name, "in_proj_ba.");
}

/* The elements of those matrices in the files of `dir`. */
static uint64_t matrix_elements(const char *dir) {
    dfl_st *st = NULL;
    if (dfl_st_open_dir(&st, dir)) return 0;
    uint64_t n = 0;
    for (int i = 0; i < dfl_st_count(st); i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        if (!is_matrix(t->name) || strstr(t->name, "_scales")) continue;
        n += (uint64_t)t->numel * (strstr(t->name, "_blocks") ? 2 : 1); /* MXFP4: two values a byte */
    }
    dfl_st_close(st);
    return n;
}

/* The CPU keeps a target's layer matrices in bf16 when the file's are
 * bf16 (half the memory) and in f32 when they are f32. The values are the
 * same and the products the same sums (dfl_cpu_gemm_nt_bf16, the few-rows
 * kernel), so the states are bitwise the same, and the f32 file's model
 * takes exactly 2 more bytes per matrix weight: so every matrix is kept
 * in bf16, and nothing else is. Dense (with and without a rotary
 * permutation of q and k), hybrid (q_proj split into q and its gate; Qwen3-
 * Next's fused projections regrouped), and each way experts are stored:
 * one tensor per expert, stacked, gpt-oss's transposed stack. (The MXFP4
 * experts take the bf16 path too: test_gpt_oss_mxfp4.) */
static void test_matrix_storage(void) {
    static const char *const fix[] = {"qwen3-untied", "llama3",          "qwen35",  "qwen3-next",   "qwen35-moe",
                                      "qwen3-moe",    "qwen3-moe-fused", "gpt-oss", "gpt-oss-mxfp4"};
    for (size_t i = 0; i < sizeof fix / sizeof fix[0]; i++) {
        char ref_dir[512], d[600], name[64];
        snprintf(ref_dir, sizeof ref_dir, "%s/%s", FIX, fix[i]);
        snprintf(name, sizeof name, "%s-f32", fix[i]);
        int64_t n = 0, m = 0;
        uint64_t bytes_bf16 = 0, bytes_f32 = 0, nmat = matrix_elements(ref_dir);
        float *ref = all_taps_of(fix[i], ref_dir, &n, &bytes_bf16);
        make_converted_of(fix[i], name, DFL_F32);
        snprintf(d, sizeof d, "%s/%s", tmp, name);
        float *got = all_taps_of(fix[i], d, &m, &bytes_f32);
        T_CHECKF(ref && got && n == m && !memcmp(got, ref, (size_t)n * sizeof *got), "%s: f32 matrices give other states",
                 fix[i]);
        T_CHECKF(nmat > 0 && bytes_f32 == bytes_bf16 + 2 * nmat,
                 "%s: weights %llu bytes from bf16, %llu from f32, %llu matrix weights", fix[i],
                 (unsigned long long)bytes_bf16, (unsigned long long)bytes_f32, (unsigned long long)nmat);
        fprintf(stderr, "  %s: %llu matrix weights; %.3f MiB from bf16 files, %.3f MiB from f32, same states\n", fix[i],
                (unsigned long long)nmat, bytes_bf16 / 1048576.0, bytes_f32 / 1048576.0);
        free(ref);
        free(got);
    }
}

int main(void) {
    T_RUN(test_qwen3_tied);
    T_RUN(test_qwen3_untied_new_spelling);
    T_RUN(test_llama3_rope_scaling);
    T_RUN(test_qwen2);
    T_RUN(test_gpt_oss);
    T_RUN(test_gpt_oss_mxfp4);
    T_RUN(test_qwen3_next);
    T_RUN(test_mistral);
    T_RUN(test_qwen3_yarn);
    T_RUN(test_qwen3_swa);
    T_RUN(test_mistral_swa);
    T_RUN(test_qwen3_moe_swa);
    T_RUN(test_qwen3_sharded);
    T_RUN(test_qwen35);
    T_RUN(test_qwen35_yarn);
    T_RUN(test_qwen35_vlm_layout);
    T_RUN(test_qwen3_moe);
    T_RUN(test_qwen3_moe_fused);
    T_RUN(test_qwen35_moe);
    T_RUN(test_qwen35_moe_vlm_layout);
    T_RUN(test_packing_matches_one_at_a_time);
    T_RUN(test_packing_qwen35);
    T_RUN(test_packing_moe);
    T_RUN(test_long_batch_chunks);
    T_RUN(test_long_batch_chunks_moe);
    T_RUN(test_rows);
    T_RUN(test_partial_load_and_bad_requests);
    if (!mkdtemp(tmp)) return 1;
    T_RUN(test_broken_models);
    T_RUN(test_broken_qwen35);
    T_RUN(test_broken_moe);
    T_RUN(test_broken_mxfp4);
    T_RUN(test_moe_workspace_growth);
    T_RUN(test_moe_plan_bounded_by_weights);
    T_RUN(test_weight_encodings);
    T_RUN(test_matrix_storage);
    if (t_rm_rf(tmp) != 0) return 1;
    return t_exit();
}
