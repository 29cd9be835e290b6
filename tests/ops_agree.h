/* ops_agree.h: every op of a backend (DEV) against the CPU reference (REF),
 * forward and backward, by normalised error nmse = sum (a-b)^2 / sum b^2
 * (DESIGN §3), with a stated limit per quantity. Used by test_ops_cuda.c
 * with the real CUDA table (on a GPU) or the emulated one (tests/emu).
 *
 * Inputs are drawn as bf16 values (and uploaded to both backends as such),
 * so both compute on identical inputs and the differences are the device's
 * own roundings. The limits, and why:
 *   NMSE_ROUND 1e-5   an output rounded to bf16 once: relative error up to
 *                     2^-9, mean square about 2^-18/3 = 1.3e-6 of the
 *                     values' square; gradients that are accumulated into a
 *                     bf16 buffer (+=) round twice. ~4-8x headroom.
 *   NMSE_INNER 1e-4   ops that also round intermediates to bf16 as the
 *                     tensor cores require: attention (P and dS feed bf16
 *                     matrix products; the backward's delta uses the bf16
 *                     output), the LM-head gradient (softmax - onehot in
 *                     bf16 before the dh product).
 *   NMSE_F32 1e-9     f32 results of identical inputs that differ only by
 *                     summation order (dw of a matmul, rstd, lse, CE loss):
 *                     ~1e-12 expected.
 *   NMSE_KL 1e-6      the KL loss is a small difference of log-sum-exps
 *                     (~10): an absolute 1e-6 is ~1e-4 of it.
 *   NMSE_EXACT 1e-12  the optimizer: the same f32 formulas in the same
 *                     order (fused multiply-adds aside).
 * Every comparison also requires every value finite; a NaN fails it.
 * Outputs that the ops accumulate into (gradients) start from random
 * values of the gradient's own scale, so a missing "+=" fails too.
 * Shapes are odd on purpose: sizes not multiples of 8, GQA groups of 1..4,
 * packed sequences, DFlash blocks sharing context keys, blocks with no
 * context, tiles of keys seen by more blocks than one chunk holds, and both
 * attention paths (head dim 64/128: tensor cores; 24/40: simple kernels). */
#ifndef DFLASH_OPS_AGREE_H
#define DFLASH_OPS_AGREE_H

#include "common.h"
#include "ops.h"
#include "rng.h"
#include "moe_oracle.h"
#include "sample.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NMSE_ROUND 1e-5
#define NMSE_INNER 1e-4
#define NMSE_F32 1e-9
#define NMSE_KL 1e-6
#define NMSE_EXACT 1e-12

static const dfl_ops *REF, *DEV;
static dfl_rng AG_RNG;
static int AG_BIG; /* also the larger shapes (a real GPU) */

/* ---- host data ------------------------------------------------------------ */

static float bf16_round(float x) { return dfl_bf16_to_f32(dfl_f32_to_bf16(x)); }

/* n normal values times scale, rounded to bf16 */
static float *ag_randn(int64_t n, double scale) {
    float *x = dfl_malloc((size_t)(n ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = bf16_round((float)(scale * dfl_rng_normal(&AG_RNG)));
    return x;
}

static double ag_rms(const float *x, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return n ? sqrt(s / (double)n) : 0;
}

/* ---- one tensor on both backends ------------------------------------------ */

typedef enum { AG_ACT, AG_F32, AG_I32 } ag_kind;
typedef struct {
    void *r, *d; /* REF and DEV buffers */
    int64_t n;
    ag_kind kind;
} ag_pair;

static void *ag_put(const dfl_ops *o, const void *host, int64_t n, ag_kind kind) {
    size_t es = kind == AG_ACT ? (size_t)o->act_bytes : 4;
    void *p = o->alloc((size_t)(n ? n : 1) * es);
    if (!host || !n) return p;
    if (kind == AG_ACT) o->load_act(p, host, DFL_F32, n);
    else o->upload(p, host, (size_t)n * 4);
    return p;
}

static ag_pair ag_new(const void *host, int64_t n, ag_kind kind) {
    ag_pair p = {ag_put(REF, host, n, kind), ag_put(DEV, host, n, kind), n, kind};
    return p;
}

static void ag_free(ag_pair *p) {
    REF->free(p->r);
    DEV->free(p->d);
}

/* read one side back as f32 */
static float *ag_get(const dfl_ops *o, const void *buf, int64_t n, ag_kind kind) {
    float *h = dfl_malloc((size_t)(n ? n : 1) * sizeof(float));
    if (kind == AG_ACT) o->act_to_f32(h, buf, n);
    else o->download(h, buf, (size_t)n * 4);
    return h;
}

/* nmse of DEV against REF for a pair, printed, checked against `limit` */
static double ag_check(const char *what, const ag_pair *p, double limit) {
    float *r = ag_get(REF, p->r, p->n, p->kind), *d = ag_get(DEV, p->d, p->n, p->kind);
    int finite = 1;
    for (int64_t i = 0; i < p->n; i++) finite &= isfinite(d[i]) != 0;
    double e = t_nmse_f32(d, r, p->n);
    printf("  nmse %-28s %.2e (limit %.0e)\n", what, e, limit);
    T_CHECKF(finite && e <= limit, "%s: nmse %.3g, limit %.0e%s", what, e, limit, finite ? "" : ", non-finite values");
    free(r);
    free(d);
    return e;
}

/* The worst nmse of one row of `width` values, DEV against REF, checked
 * against `limit`: a mask off by one key moves one row by far more than
 * the rounding does, but the whole tensor's nmse by less. */
static double ag_check_rows(const char *what, const ag_pair *p, int64_t width, double limit) {
    float *r = ag_get(REF, p->r, p->n, p->kind), *d = ag_get(DEV, p->d, p->n, p->kind);
    double worst = 0;
    int64_t at = 0;
    for (int64_t i = 0; i + width <= p->n; i += width) {
        double e = t_nmse_f32(d + i, r + i, width);
        if (!(e <= worst)) worst = e, at = i / width;
    }
    printf("  nmse %-28s %.2e worst row (%lld; limit %.0e)\n", what, worst, (long long)at, limit);
    T_CHECKF(worst <= limit, "%s: row %lld nmse %.3g, limit %.0e", what, (long long)at, worst, limit);
    free(r);
    free(d);
    return worst;
}

/* a gradient buffer pre-filled with random values of scale `rms` */
static ag_pair ag_grad(int64_t n, ag_kind kind, double rms) {
    float *h = ag_randn(n, rms > 0 ? rms : 1.0);
    ag_pair p = ag_new(h, n, kind);
    free(h);
    return p;
}

/* ---- conversions ----------------------------------------------------------- */

static void conversions_round_to_nearest_even(void) {
    const int64_t n = 1001;
    float *x = dfl_malloc(n * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)dfl_rng_normal(&AG_RNG) * 3.0f;
        if (i % 7 == 0) { /* exact ties between two bf16 values */
            uint32_t u;
            memcpy(&u, &x[i], 4);
            u = (u & 0xffff0000u) | 0x8000u;
            memcpy(&x[i], &u, 4);
        }
    }
    uint16_t *got = dfl_malloc(n * 2), *bits = dfl_malloc(n * 2);
    void *a = DEV->alloc((size_t)n * DEV->act_bytes);
    DEV->load_act(a, x, DFL_F32, n); /* f32 -> act */
    DEV->act_to_bf16(got, a, n);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += got[i] != dfl_f32_to_bf16(x[i]);
    T_CHECKF(bad == 0, "load_act f32: %d of %d not round-to-nearest-even", bad, (int)n);
    for (int64_t i = 0; i < n; i++) bits[i] = dfl_f32_to_bf16(x[i]);
    DEV->load_wt(a, bits, DFL_BF16, n); /* bf16 -> wt, bit for bit */
    DEV->act_to_bf16(got, a, n);
    T_CHECK(memcmp(got, bits, (size_t)n * 2) == 0);
    for (int64_t i = 0; i < n; i++) { /* f16 -> act: exact to f32, then rounded */
        float f = (float)dfl_rng_normal(&AG_RNG) * 100.0f;
        bits[i] = dfl_f32_to_f16(f);
    }
    DEV->load_act(a, bits, DFL_F16, n);
    DEV->act_to_bf16(got, a, n);
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += got[i] != dfl_f32_to_bf16(dfl_f16_to_f32(bits[i]));
    T_CHECKF(bad == 0, "load_act f16: %d wrong", bad);
    float *back = dfl_malloc(n * sizeof(float));
    DEV->act_to_f32(back, a, n);
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += back[i] != dfl_bf16_to_f32(got[i]);
    T_CHECKF(bad == 0, "act_to_f32: %d differ from the bf16 values", bad);
    float *master = DEV->alloc((size_t)n * 4);
    DEV->upload(master, x, (size_t)n * 4);
    DEV->master_to_wt(a, master, n);
    DEV->act_to_bf16(got, a, n);
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += got[i] != dfl_f32_to_bf16(x[i]);
    T_CHECKF(bad == 0, "master_to_wt: %d wrong", bad);
    DEV->free(master);
    DEV->free(a);
    free(x), free(got), free(bits), free(back);
}

/* ---- dense ----------------------------------------------------------------- */

static void matmul_agrees(void) {
    const int64_t M = 37, K = 53, N = 29;
    float *hx = ag_randn(M * K, 1), *hw = ag_randn(N * K, 0.2), *ho = ag_randn(M * N, 1);
    ag_pair x = ag_new(hx, M * K, AG_ACT), w = ag_new(hw, N * K, AG_ACT), o = ag_new(ho, M * N, AG_ACT);
    REF->matmul(o.r, x.r, w.r, M, K, N, 0);
    DEV->matmul(o.d, x.d, w.d, M, K, N, 0);
    ag_check("matmul out", &o, NMSE_ROUND);
    REF->matmul(o.r, x.r, w.r, M, K, N, 1);
    DEV->matmul(o.d, x.d, w.d, M, K, N, 1);
    ag_check("matmul out (accumulate)", &o, NMSE_ROUND);
    ag_free(&x), ag_free(&w), ag_free(&o);
    free(hx), free(hw), free(ho);
}

static void matmul_bwd_agrees(void) {
    const int64_t M = 41, K = 35, N = 23;
    float *hx = ag_randn(M * K, 1), *hw = ag_randn(N * K, 0.2), *hd = ag_randn(M * N, 1);
    ag_pair x = ag_new(hx, M * K, AG_ACT), w = ag_new(hw, N * K, AG_ACT), dout = ag_new(hd, M * N, AG_ACT);
    ag_pair din = ag_grad(M * K, AG_ACT, 1.0), dw = ag_grad(N * K, AG_F32, 5.0);
    REF->matmul_bwd(din.r, dw.r, dout.r, x.r, w.r, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    DEV->matmul_bwd(din.d, dw.d, dout.d, x.d, w.d, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    ag_check("matmul_bwd din", &din, NMSE_ROUND);
    ag_check("matmul_bwd dw", &dw, NMSE_F32);
    /* each gradient alone (the other NULL) */
    REF->matmul_bwd(NULL, dw.r, dout.r, x.r, w.r, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    DEV->matmul_bwd(NULL, dw.d, dout.d, x.d, w.d, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    REF->matmul_bwd(din.r, NULL, dout.r, x.r, w.r, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    DEV->matmul_bwd(din.d, NULL, dout.d, x.d, w.d, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    ag_check("matmul_bwd din (2nd)", &din, NMSE_ROUND);
    ag_check("matmul_bwd dw (2nd)", &dw, NMSE_F32);
    /* din overwritten (it holds the sums above): the reference overwrites too */
    REF->matmul_bwd(din.r, dw.r, dout.r, x.r, w.r, M, K, N, DFL_ACC_DW);
    DEV->matmul_bwd(din.d, dw.d, dout.d, x.d, w.d, M, K, N, DFL_ACC_DW);
    ag_check("matmul_bwd din (overwritten)", &din, NMSE_ROUND);
    ag_check("matmul_bwd dw (3rd)", &dw, NMSE_F32);
    /* dw overwritten (it holds three sums), din added to */
    REF->matmul_bwd(din.r, dw.r, dout.r, x.r, w.r, M, K, N, DFL_ACC_DIN);
    DEV->matmul_bwd(din.d, dw.d, dout.d, x.d, w.d, M, K, N, DFL_ACC_DIN);
    ag_check("matmul_bwd din (4th)", &din, NMSE_ROUND);
    ag_check("matmul_bwd dw (overwritten)", &dw, NMSE_F32);
    ag_free(&x), ag_free(&w), ag_free(&dout), ag_free(&din), ag_free(&dw);
    free(hx), free(hw), free(hd);
}

static void rmsnorm_case(int64_t rows, int64_t dim) {
    float *hx = ag_randn(rows * dim, 2), *hw = ag_randn(dim, 1), *hd = ag_randn(rows * dim, 1);
    ag_pair x = ag_new(hx, rows * dim, AG_ACT), w = ag_new(hw, dim, AG_ACT), dout = ag_new(hd, rows * dim, AG_ACT);
    ag_pair out = ag_new(NULL, rows * dim, AG_ACT), rstd = ag_new(NULL, rows, AG_F32);
    REF->rmsnorm(out.r, rstd.r, x.r, w.r, rows, dim, 1e-6f);
    DEV->rmsnorm(out.d, rstd.d, x.d, w.d, rows, dim, 1e-6f);
    ag_check("rmsnorm out", &out, NMSE_ROUND);
    ag_check("rmsnorm rstd", &rstd, NMSE_F32);
    if (DEV->act_bytes == 2) { /* CUDA's row in registers and its row read twice: the same bits */
        ag_pair out2 = ag_new(NULL, rows * dim, AG_ACT), rstd2 = ag_new(NULL, rows, AG_F32);
        setenv("DFLASH_CUDA_NORM_REGS", "0", 1);
        DEV->rmsnorm(out2.d, rstd2.d, x.d, w.d, rows, dim, 1e-6f);
        unsetenv("DFLASH_CUDA_NORM_REGS");
        uint16_t *a = dfl_malloc((size_t)(rows * dim) * 2), *b = dfl_malloc((size_t)(rows * dim) * 2);
        float *ra = dfl_malloc((size_t)rows * 4), *rb = dfl_malloc((size_t)rows * 4);
        DEV->act_to_bf16(a, out.d, rows * dim), DEV->act_to_bf16(b, out2.d, rows * dim);
        DEV->download(ra, rstd.d, (size_t)rows * 4), DEV->download(rb, rstd2.d, (size_t)rows * 4);
        T_CHECKF(!memcmp(a, b, (size_t)(rows * dim) * 2) && !memcmp(ra, rb, (size_t)rows * 4),
                 "rmsnorm %lld x %lld: DFLASH_CUDA_NORM_REGS=0 gives other bits", (long long)rows, (long long)dim);
        free(a), free(b), free(ra), free(rb);
        ag_free(&out2), ag_free(&rstd2);
    }
    REF->rmsnorm1p(out.r, x.r, w.r, rows, dim, 1e-6f); /* Qwen3.5's (1 + w) */
    DEV->rmsnorm1p(out.d, x.d, w.d, rows, dim, 1e-6f);
    ag_check("rmsnorm1p out", &out, NMSE_ROUND);
    /* backward, both from the reference's rstd (identical inputs) */
    float *hr = ag_get(REF, rstd.r, rows, AG_F32);
    DEV->upload(rstd.d, hr, (size_t)rows * 4);
    ag_pair din = ag_grad(rows * dim, AG_ACT, 0.5), dw = ag_grad(dim, AG_F32, 3.0);
    REF->rmsnorm_bwd(din.r, dw.r, dout.r, x.r, rstd.r, w.r, rows, dim);
    DEV->rmsnorm_bwd(din.d, dw.d, dout.d, x.d, rstd.d, w.d, rows, dim);
    ag_check("rmsnorm_bwd din", &din, NMSE_ROUND);
    ag_check("rmsnorm_bwd dw", &dw, NMSE_F32);
    REF->rmsnorm_bwd(NULL, dw.r, dout.r, x.r, rstd.r, w.r, rows, dim);
    DEV->rmsnorm_bwd(NULL, dw.d, dout.d, x.d, rstd.d, w.d, rows, dim);
    ag_check("rmsnorm_bwd dw (din NULL)", &dw, NMSE_F32);
    ag_free(&x), ag_free(&w), ag_free(&dout), ag_free(&out), ag_free(&rstd), ag_free(&din), ag_free(&dw);
    free(hx), free(hw), free(hd), free(hr);
}

static void rmsnorm_agrees(void) {
    rmsnorm_case(33, 96);   /* 16-byte rows: vector path */
    rmsnorm_case(29, 37);   /* odd: scalar path */
    rmsnorm_case(300, 128); /* a q_norm shape: many rows, blocks of several rows */
    rmsnorm_case(6, 4096);  /* hidden 4096: the backward's 64 KiB of shared memory (over 48 KiB) */
    rmsnorm_case(9, 1000);  /* the forward's row in registers, its last run part-full */
    rmsnorm_case(5, 6144);  /* past the forward's registers: read twice */
    if (AG_BIG) rmsnorm_case(4099, 4096);
}

/* scale: 1, or a YaRN attention factor (the same f32 products on both sides) */
static void rope_case(int64_t T, int64_t nh, int64_t d, float scale) {
    float *hx = ag_randn(T * nh * d, 1);
    int32_t *pos = dfl_malloc((size_t)T * 4);
    float *inv = dfl_malloc((size_t)(d / 2) * 4);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)dfl_rng_below(&AG_RNG, 40960);
    /* scaled: every 7th pair a pass-through (frequency 0), left unscaled */
    for (int64_t i = 0; i < d / 2; i++)
        inv[i] = scale != 1 && i % 7 == 6 ? 0.0f : (float)pow(1e6, -2.0 * (double)i / (double)d);
    ag_pair x = ag_new(hx, T * nh * d, AG_ACT), p = ag_new(pos, T, AG_I32), f = ag_new(inv, d / 2, AG_F32);
    REF->rope(x.r, p.r, f.r, scale, T, nh, d, 0);
    DEV->rope(x.d, p.d, f.d, scale, T, nh, d, 0);
    ag_check(scale == 1 ? "rope" : "rope, scaled", &x, NMSE_ROUND);
    REF->rope(x.r, p.r, f.r, scale, T, nh, d, 1);
    DEV->rope(x.d, p.d, f.d, scale, T, nh, d, 1);
    ag_check(scale == 1 ? "rope, then inverse" : "rope, then inverse, scaled", &x, NMSE_ROUND);
    /* the transpose undoes it but for scale^2 (to bf16 roundings), on the
     * scaled pairs: a pass-through pair comes back as it was */
    float *back = ag_get(DEV, x.d, T * nh * d, AG_ACT);
    for (int64_t i = 0; i < T * nh * d; i++)
        if (inv[i % d % (d / 2)] != 0.0f) back[i] /= scale * scale;
    double e = t_nmse_f32(back, hx, T * nh * d);
    T_CHECKF(e < 4 * NMSE_ROUND, "rope's transpose does not undo rope (scale %g): nmse %.3g", scale, e);
    ag_free(&x), ag_free(&p), ag_free(&f);
    free(hx), free(pos), free(inv), free(back);
}

static void rope_agrees(void) {
    rope_case(19, 3, 64, 1.0f);
    rope_case(7, 5, 10, 1.0f);
    rope_case(19, 3, 64, 1.1386294f); /* YaRN's factor for a context 4x the pretrained */
}

/* qk_norm_rope against the CPU's composition (rmsnorm or rmsnorm1p, then
 * rope); the CUDA kernel rounds once where the two ops round twice; rstd
 * as rmsnorm saves it. Also in place (out = in), as the op allows, and
 * without rstd. */
static void qk_norm_rope_case(int64_t T, int64_t nh, int64_t d, int plus_one, float scale) {
    float *hx = ag_randn(T * nh * d, 3), *hw = ag_randn(d, 0.5);
    int32_t *pos = dfl_malloc((size_t)T * 4);
    float *inv = dfl_malloc((size_t)(d / 2) * 4);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)dfl_rng_below(&AG_RNG, 40960);
    for (int64_t i = 0; i < d / 2; i++) inv[i] = i % 5 == 4 ? 0.0f : (float)pow(1e6, -2.0 * (double)i / (double)d);
    ag_pair x = ag_new(hx, T * nh * d, AG_ACT), w = ag_new(hw, d, AG_ACT), p = ag_new(pos, T, AG_I32);
    ag_pair f = ag_new(inv, d / 2, AG_F32), out = ag_new(NULL, T * nh * d, AG_ACT);
    ag_pair rstd = ag_new(NULL, T * nh, AG_F32);
    char what[64];
    REF->qk_norm_rope(out.r, rstd.r, x.r, w.r, plus_one, p.r, f.r, scale, T, nh, d, 1e-6f);
    DEV->qk_norm_rope(out.d, rstd.d, x.d, w.d, plus_one, p.d, f.d, scale, T, nh, d, 1e-6f);
    snprintf(what, sizeof what, "qk_norm_rope d%d%s%s", (int)d, plus_one ? " (1 + w)" : "",
             scale != 1 ? " scaled" : "");
    ag_check(what, &out, NMSE_ROUND);
    snprintf(what, sizeof what, "qk_norm_rope d%d rstd", (int)d);
    ag_check(what, &rstd, NMSE_F32);
    REF->qk_norm_rope(x.r, NULL, x.r, w.r, plus_one, p.r, f.r, scale, T, nh, d, 1e-6f);
    DEV->qk_norm_rope(x.d, NULL, x.d, w.d, plus_one, p.d, f.d, scale, T, nh, d, 1e-6f);
    snprintf(what, sizeof what, "qk_norm_rope d%d in place", (int)d);
    ag_check(what, &x, NMSE_ROUND);
    ag_free(&x), ag_free(&w), ag_free(&p), ag_free(&f), ag_free(&out), ag_free(&rstd);
    free(hx), free(hw), free(pos), free(inv);
}

/* its backward, both from the reference's rstd (identical inputs): din
 * pre-filled with noise that must be overwritten, dw with values that the
 * gradient is added to */
static void qk_norm_rope_bwd_case(int64_t T, int64_t nh, int64_t d, float scale) {
    const int64_t n = T * nh * d;
    float *hx = ag_randn(n, 3), *hw = ag_randn(d, 0.5), *hd = ag_randn(n, 1);
    int32_t *pos = dfl_malloc((size_t)T * 4);
    float *inv = dfl_malloc((size_t)(d / 2) * 4);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)dfl_rng_below(&AG_RNG, 40960);
    for (int64_t i = 0; i < d / 2; i++) inv[i] = (float)pow(1e6, -2.0 * (double)i / (double)d);
    ag_pair x = ag_new(hx, n, AG_ACT), w = ag_new(hw, d, AG_ACT), dout = ag_new(hd, n, AG_ACT);
    ag_pair p = ag_new(pos, T, AG_I32), f = ag_new(inv, d / 2, AG_F32);
    ag_pair out = ag_new(NULL, n, AG_ACT), rstd = ag_new(NULL, T * nh, AG_F32);
    REF->qk_norm_rope(out.r, rstd.r, x.r, w.r, 0, p.r, f.r, scale, T, nh, d, 1e-6f);
    float *hr = ag_get(REF, rstd.r, T * nh, AG_F32);
    DEV->upload(rstd.d, hr, (size_t)(T * nh) * 4);
    ag_pair din = ag_grad(n, AG_ACT, 5.0), dw = ag_grad(d, AG_F32, 3.0);
    REF->qk_norm_rope_bwd(din.r, dw.r, dout.r, x.r, rstd.r, w.r, p.r, f.r, scale, T, nh, d);
    DEV->qk_norm_rope_bwd(din.d, dw.d, dout.d, x.d, rstd.d, w.d, p.d, f.d, scale, T, nh, d);
    char what[64];
    snprintf(what, sizeof what, "qk_norm_rope_bwd d%d%s din", (int)d, scale != 1 ? " scaled" : "");
    ag_check(what, &din, NMSE_ROUND);
    snprintf(what, sizeof what, "qk_norm_rope_bwd d%d dw (+=)", (int)d);
    ag_check(what, &dw, NMSE_F32);
    REF->qk_norm_rope_bwd(NULL, dw.r, dout.r, x.r, rstd.r, w.r, p.r, f.r, scale, T, nh, d);
    DEV->qk_norm_rope_bwd(NULL, dw.d, dout.d, x.d, rstd.d, w.d, p.d, f.d, scale, T, nh, d);
    snprintf(what, sizeof what, "qk_norm_rope_bwd d%d dw (din NULL)", (int)d);
    ag_check(what, &dw, NMSE_F32);
    ag_free(&x), ag_free(&w), ag_free(&dout), ag_free(&p), ag_free(&f), ag_free(&out), ag_free(&rstd);
    ag_free(&din), ag_free(&dw);
    free(hx), free(hw), free(hd), free(pos), free(inv), free(hr);
}

static void qk_norm_rope_agrees(void) {
    const float yarn = 1.1386294f; /* YaRN's factor on cos and sin, a context 4x the pretrained */
    qk_norm_rope_case(37, 8, 128, 0, 1); /* the Qwen3 head; pairs of pairs */
    qk_norm_rope_case(37, 8, 128, 0, yarn);
    qk_norm_rope_case(9, 3, 256, 1, 1);  /* Qwen3.5's, (1 + w); two passes a lane */
    qk_norm_rope_case(11, 2, 10, 0, 1);  /* an odd half: one pair a lane */
    qk_norm_rope_case(5, 12, 576, 0, 1); /* two head groups; angles past the cached ones */
    qk_norm_rope_case(5, 12, 576, 0, yarn);
    qk_norm_rope_bwd_case(300, 8, 128, 1); /* the drafter's q/k: many units a block, several blocks */
    qk_norm_rope_bwd_case(300, 8, 128, yarn);
    qk_norm_rope_bwd_case(7, 12, 64, 1);   /* two head groups, the second part-full */
    qk_norm_rope_bwd_case(11, 2, 10, 1);   /* an odd half: one pair a lane */
    qk_norm_rope_bwd_case(5, 3, 576, 1);   /* angles past the cached ones */
    qk_norm_rope_bwd_case(5, 3, 576, yarn);
}

static void swiglu_case(int64_t n) {
    float *hg = ag_randn(n, 2), *hu = ag_randn(n, 1), *hd = ag_randn(n, 1);
    ag_pair g = ag_new(hg, n, AG_ACT), u = ag_new(hu, n, AG_ACT), d = ag_new(hd, n, AG_ACT);
    ag_pair out = ag_new(NULL, n, AG_ACT), dg = ag_grad(n, AG_ACT, 0.5), du = ag_grad(n, AG_ACT, 0.5);
    REF->swiglu(out.r, g.r, u.r, n);
    DEV->swiglu(out.d, g.d, u.d, n);
    ag_check("swiglu", &out, NMSE_ROUND);
    REF->swiglu_bwd(dg.r, du.r, d.r, g.r, u.r, n, 1);
    DEV->swiglu_bwd(dg.d, du.d, d.d, g.d, u.d, n, 1);
    ag_check("swiglu_bwd dgate", &dg, NMSE_ROUND);
    ag_check("swiglu_bwd dup", &du, NMSE_ROUND);
    REF->swiglu_bwd(NULL, du.r, d.r, g.r, u.r, n, 1);
    DEV->swiglu_bwd(NULL, du.d, d.d, g.d, u.d, n, 1);
    ag_check("swiglu_bwd dup (dgate NULL)", &du, NMSE_ROUND);
    REF->swiglu_bwd(dg.r, du.r, d.r, g.r, u.r, n, 0); /* overwritten */
    DEV->swiglu_bwd(dg.d, du.d, d.d, g.d, u.d, n, 0);
    ag_check("swiglu_bwd dgate (overwritten)", &dg, NMSE_ROUND);
    ag_check("swiglu_bwd dup (overwritten)", &du, NMSE_ROUND);
    REF->add(out.r, out.r, g.r, n); /* out aliases a */
    DEV->add(out.d, out.d, g.d, n);
    ag_check("add (out = a + b, aliased)", &out, NMSE_ROUND);
    ag_free(&g), ag_free(&u), ag_free(&d), ag_free(&out), ag_free(&dg), ag_free(&du);
    free(hg), free(hu), free(hd);
}

/* a projection's bias (Qwen2's q, k, v) added to every row */
static void add_bias_case(int64_t rows, int64_t cols) {
    float *hx = ag_randn(rows * cols, 1), *hb = ag_randn(cols, 0.5);
    ag_pair x = ag_new(hx, rows * cols, AG_ACT), b = ag_new(hb, cols, AG_ACT);
    REF->add_bias(x.r, b.r, rows, cols);
    DEV->add_bias(x.d, b.d, rows, cols);
    char what[64];
    snprintf(what, sizeof what, "add_bias %lldx%lld", (long long)rows, (long long)cols);
    ag_check(what, &x, NMSE_ROUND);
    ag_free(&x), ag_free(&b);
    free(hx), free(hb);
}

static void elementwise_agrees(void) {
    swiglu_case(1003); /* vector body and scalar tail */
    swiglu_case(1024);
    swiglu_case(203);
    add_bias_case(37, 56);   /* a tiny Qwen2's q rows */
    add_bias_case(300, 512); /* several rows a block */
}

static void embed_case(int64_t T, int64_t H, int64_t V) {
    float *ht = ag_randn(V * H, 1);
    int32_t *ids = dfl_malloc((size_t)T * 4);
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)dfl_rng_below(&AG_RNG, (uint64_t)V);
    ag_pair tab = ag_new(ht, V * H, AG_ACT), id = ag_new(ids, T, AG_I32), out = ag_new(NULL, T * H, AG_ACT);
    REF->embed(out.r, id.r, tab.r, T, H);
    DEV->embed(out.d, id.d, tab.d, T, H);
    /* a gather of bf16 values: exact */
    ag_check("embed", &out, 0.0);
    ag_free(&tab), ag_free(&id), ag_free(&out);
    free(ht), free(ids);
}

static void embed_agrees(void) {
    embed_case(13, 40, 50);
    embed_case(9, 37, 11);
}

/* ---- attention --------------------------------------------------------------- */

/* W: a sliding window (0: none); with_lse: the lse too (attn_sinks's input) */
static void causal_case_w(const int32_t *lens, int64_t nseq, int64_t Hq, int64_t Hkv, int64_t D, int64_t W,
                          int with_lse) {
    int32_t *cu = dfl_malloc((size_t)(nseq + 1) * 4);
    cu[0] = 0;
    for (int64_t s = 0; s < nseq; s++) cu[s + 1] = cu[s] + lens[s];
    int64_t T = cu[nseq];
    float *hq = ag_randn(T * Hq * D, 1), *hk = ag_randn(T * Hkv * D, 1), *hv = ag_randn(T * Hkv * D, 1);
    ag_pair q = ag_new(hq, T * Hq * D, AG_ACT), k = ag_new(hk, T * Hkv * D, AG_ACT), v = ag_new(hv, T * Hkv * D, AG_ACT);
    ag_pair c = ag_new(cu, nseq + 1, AG_I32), out = ag_new(NULL, T * Hq * D, AG_ACT);
    ag_pair lse = ag_new(NULL, T * Hq, AG_F32);
    REF->attn_causal(out.r, with_lse ? lse.r : NULL, q.r, k.r, v.r, c.r, nseq, T, Hq, Hkv, D, W);
    DEV->attn_causal(out.d, with_lse ? lse.d : NULL, q.d, k.d, v.d, c.d, nseq, T, Hq, Hkv, D, W);
    char what[64];
    snprintf(what, sizeof what, "attn_causal D%d G%d W%lld%s", (int)D, (int)(Hq / Hkv), (long long)W,
             with_lse ? " +lse" : "");
    ag_check(what, &out, NMSE_INNER);
    if (W) { /* each (row, head) alone: a key off the window's edge moves its row by ~1e-2 */
        snprintf(what, sizeof what, "attn_causal D%d G%d W%lld", (int)D, (int)(Hq / Hkv), (long long)W);
        ag_check_rows(what, &out, D, 1e-3);
    }
    if (with_lse) {
        snprintf(what, sizeof what, "attn_causal D%d G%d W%lld lse", (int)D, (int)(Hq / Hkv), (long long)W);
        ag_check(what, &lse, NMSE_F32);
    }
    ag_free(&q), ag_free(&k), ag_free(&v), ag_free(&c), ag_free(&out), ag_free(&lse);
    free(cu), free(hq), free(hk), free(hv);
}

static void causal_case(const int32_t *lens, int64_t nseq, int64_t Hq, int64_t Hkv, int64_t D) {
    causal_case_w(lens, nseq, Hq, Hkv, D, 0, 0);
}

static void attn_causal_agrees(void) {
    const int32_t a[] = {1, 70, 133}, b[] = {5, 40}, c[] = {65}, d[] = {17, 3, 64, 129};
    causal_case(a, 3, 8, 2, 64);  /* tensor cores, G = 4, packed */
    causal_case(b, 2, 3, 3, 24);  /* simple kernel, G = 1 */
    causal_case(c, 1, 4, 1, 128); /* tensor cores, D = 128 */
    causal_case(d, 4, 6, 2, 64);  /* G = 3: row tiles cut across positions */
    const int32_t d256[] = {1, 33, 97, 64};
    causal_case(d256, 4, 6, 1, 256); /* tensor cores, D = 256 (Qwen3.5), 32-key tiles, G = 6 */
    if (AG_BIG) {
        const int32_t e[] = {2048, 1000, 1}, f[] = {2048, 517};
        causal_case(e, 3, 32, 8, 128);
        causal_case(f, 2, 24, 4, 256); /* Qwen3.5-27B attention heads */
    }
}

/* A target's sliding window (gpt-oss, Qwen3, Mistral) and the lse that
 * gpt-oss's sinks need: windows of one key, shorter than a key tile, a
 * tile, just past one and longer than the rows, on the tensor-core shapes
 * (D 64 G 4 and G 3, D 128 G 1, D 256 G 6) and the simple kernel's (D 24);
 * the lse alone without a window too. A window of 63 puts the key one past
 * a CTA's first row at the end of a tile (64 or 32 keys) counted from the
 * CTA's first key: the last tile that may skip the causal test. */
static void attn_causal_window_agrees(void) {
    const int32_t a[] = {1, 70, 133}, b[] = {5, 40}, d[] = {17, 3, 64, 129}, d256[] = {1, 33, 97, 64};
    const int64_t windows[] = {1, 5, 63, 64, 65, 130};
    causal_case_w(a, 3, 8, 2, 64, 0, 1);
    causal_case_w(a, 3, 4, 4, 128, 0, 1);
    causal_case_w(d256, 4, 6, 1, 256, 0, 1);
    for (size_t w = 0; w < sizeof windows / sizeof *windows; w++) {
        causal_case_w(a, 3, 8, 2, 64, windows[w], 1);
        causal_case_w(d, 4, 6, 2, 64, windows[w], w % 2);
        causal_case_w(a, 3, 4, 4, 128, windows[w], 1);
        causal_case_w(d256, 4, 6, 1, 256, windows[w], 1);
        causal_case_w(b, 2, 3, 3, 24, windows[w], 1);
    }
    /* a CTA's last row at 64 k + 1 past its first: with a window of at
     * least a tile, the first tile's first key is one its last row no
     * longer sees (the edge of the tiles that skip the test) */
    const int32_t edge[] = {130, 66, 258};
    for (int64_t W = 64; W <= 66; W++) {
        causal_case_w(edge, 3, 2, 2, 64, W, W == 64);
        causal_case_w(edge, 3, 4, 2, 128, W, W == 65);
    }
    if (AG_BIG) {
        const int32_t e[] = {2048, 1000, 1};
        causal_case_w(e, 3, 64, 8, 64, 128, 1); /* gpt-oss's heads and window */
        causal_case_w(e, 3, 32, 8, 128, 4096, 1);
    }
}

/* Blocks of a packed batch: sequence s has ctx[s] context keys (stored one
 * sequence after another from key 0), then every block's own B keys follow
 * all the context. Block anchors: anchors[] per sequence, in order. */
typedef struct {
    int64_t nblk, B, NK, Hq, Hkv, D;
    dfl_block *blocks;
} dflash_shape;

static dflash_shape dflash_layout(const int32_t *ctx, int64_t nseq, const int32_t *nanch, int64_t B, int64_t Hq,
                                  int64_t Hkv, int64_t D) {
    dflash_shape s = {0, B, 0, Hq, Hkv, D, NULL};
    int64_t S = 0;
    for (int64_t i = 0; i < nseq; i++) s.nblk += nanch[i], S += ctx[i];
    s.blocks = dfl_malloc((size_t)s.nblk * sizeof(dfl_block));
    int64_t j = 0, off = 0;
    for (int64_t i = 0; i < nseq; i++) {
        for (int32_t a = 0; a < nanch[i]; a++, j++) {
            /* anchor in [0, ctx]: the block sees the context strictly before it */
            int32_t anchor = (int32_t)dfl_rng_below(&AG_RNG, (uint64_t)ctx[i] + 1);
            if (a == 0) anchor = 0; /* a block with no context at all */
            s.blocks[j].ctx_off = (int32_t)off;
            s.blocks[j].ctx_len = anchor;
            s.blocks[j].blk_off = (int32_t)(S + j * B);
        }
        off += ctx[i];
    }
    s.NK = S + s.nblk * B;
    return s;
}

/* window: the op's sliding window (0: none) */
static void dflash_case_w(const char *name, const dflash_shape *s, int64_t window) {
    const int64_t W = window, nq = s->nblk * s->B, Hq = s->Hq, Hkv = s->Hkv, D = s->D, NK = s->NK;
    float *hq = ag_randn(nq * Hq * D, 1), *hk = ag_randn(NK * Hkv * D, 1), *hv = ag_randn(NK * Hkv * D, 1);
    float *hd = ag_randn(nq * Hq * D, 1);
    ag_pair q = ag_new(hq, nq * Hq * D, AG_ACT), k = ag_new(hk, NK * Hkv * D, AG_ACT);
    ag_pair v = ag_new(hv, NK * Hkv * D, AG_ACT), dout = ag_new(hd, nq * Hq * D, AG_ACT);
    ag_pair blk = ag_new(s->blocks, s->nblk * 3, AG_I32);
    ag_pair out = ag_new(NULL, nq * Hq * D, AG_ACT), lse = ag_new(NULL, nq * Hq, AG_F32);
    char what[96];
    REF->attn_dflash(out.r, lse.r, q.r, k.r, v.r, blk.r, s->nblk, s->B, NK, Hq, Hkv, D, W);
    DEV->attn_dflash(out.d, lse.d, q.d, k.d, v.d, blk.d, s->nblk, s->B, NK, Hq, Hkv, D, W);
    snprintf(what, sizeof what, "%s out", name);
    ag_check(what, &out, NMSE_INNER);
    snprintf(what, sizeof what, "%s lse", name);
    ag_check(what, &lse, NMSE_F32);

    /* gradient scale from a zero-started reference pass */
    ag_pair z = ag_new(NULL, nq * Hq * D, AG_ACT), zk = ag_new(NULL, NK * Hkv * D, AG_ACT),
            zv = ag_new(NULL, NK * Hkv * D, AG_ACT);
    REF->attn_dflash_bwd(z.r, zk.r, zv.r, dout.r, out.r, lse.r, q.r, k.r, v.r, blk.r, s->nblk, s->B, NK, Hq, Hkv, D, W);
    float *g0 = ag_get(REF, z.r, nq * Hq * D, AG_ACT), *g1 = ag_get(REF, zk.r, NK * Hkv * D, AG_ACT),
          *g2 = ag_get(REF, zv.r, NK * Hkv * D, AG_ACT);
    ag_pair dq = ag_grad(nq * Hq * D, AG_ACT, ag_rms(g0, nq * Hq * D));
    ag_pair dk = ag_grad(NK * Hkv * D, AG_ACT, ag_rms(g1, NK * Hkv * D));
    ag_pair dv = ag_grad(NK * Hkv * D, AG_ACT, ag_rms(g2, NK * Hkv * D));
    REF->attn_dflash_bwd(dq.r, dk.r, dv.r, dout.r, out.r, lse.r, q.r, k.r, v.r, blk.r, s->nblk, s->B, NK, Hq, Hkv, D, W);
    DEV->attn_dflash_bwd(dq.d, dk.d, dv.d, dout.d, out.d, lse.d, q.d, k.d, v.d, blk.d, s->nblk, s->B, NK, Hq, Hkv, D, W);
    snprintf(what, sizeof what, "%s dq", name);
    ag_check(what, &dq, NMSE_INNER);
    snprintf(what, sizeof what, "%s dk", name);
    ag_check(what, &dk, NMSE_INNER);
    snprintf(what, sizeof what, "%s dv", name);
    ag_check(what, &dv, NMSE_INNER);
    /* CUDA's other dq kernel: recomputing S and dP where the default reads
     * the dS its dk/dv kernel stored (DFLASH_CUDA_DS_MAX_MB=0 turns the
     * store off; read at every call) */
    {
        ag_pair dq2 = ag_grad(nq * Hq * D, AG_ACT, ag_rms(g0, nq * Hq * D));
        REF->attn_dflash_bwd(dq2.r, NULL, NULL, dout.r, out.r, lse.r, q.r, k.r, v.r, blk.r, s->nblk, s->B, NK, Hq, Hkv,
                             D, W);
        setenv("DFLASH_CUDA_DS_MAX_MB", "0", 1);
        DEV->attn_dflash_bwd(dq2.d, zk.d, zv.d, dout.d, out.d, lse.d, q.d, k.d, v.d, blk.d, s->nblk, s->B, NK, Hq,
                             Hkv, D, W);
        unsetenv("DFLASH_CUDA_DS_MAX_MB");
        snprintf(what, sizeof what, "%s dq (recomputed)", name);
        ag_check(what, &dq2, NMSE_INNER);
        ag_free(&dq2);
    }

    /* deterministic: the same call twice, bit for bit (the second over what
     * the first wrote: the op writes, it does not add) */
    if (DEV->act_bytes == 2) {
        uint16_t *b1 = dfl_malloc((size_t)NK * Hkv * D * 2), *b2 = dfl_malloc((size_t)NK * Hkv * D * 2);
        for (int rep = 0; rep < 2; rep++) {
            DEV->attn_dflash_bwd(NULL, zk.d, NULL, dout.d, out.d, lse.d, q.d, k.d, v.d, blk.d, s->nblk, s->B, NK,
                                 Hq, Hkv, D, W);
            DEV->act_to_bf16(rep ? b2 : b1, zk.d, NK * Hkv * D);
        }
        T_CHECKF(memcmp(b1, b2, (size_t)NK * Hkv * D * 2) == 0, "%s: dk differs between two identical calls", name);
        free(b1), free(b2);
        /* and dk alone is the reference's dk: no dv (nor dq) needed for it */
        ag_pair alone = {dk.r, zk.d, NK * Hkv * D, AG_ACT};
        snprintf(what, sizeof what, "%s dk alone", name);
        ag_check(what, &alone, NMSE_INNER);
    }
    ag_free(&q), ag_free(&k), ag_free(&v), ag_free(&dout), ag_free(&blk), ag_free(&out), ag_free(&lse);
    ag_free(&z), ag_free(&zk), ag_free(&zv), ag_free(&dq), ag_free(&dk), ag_free(&dv);
    free(hq), free(hk), free(hv), free(hd), free(g0), free(g1), free(g2);
}

static void dflash_case(const char *name, const dflash_shape *s) { dflash_case_w(name, s, 0); }

static void attn_dflash_agrees(void) {
    /* tensor cores (D 64), G = 4, B = 16, two packed sequences */
    const int32_t ctx_a[] = {100, 80}, anc_a[] = {5, 3};
    dflash_shape a = dflash_layout(ctx_a, 2, anc_a, 16, 8, 2, 64);
    dflash_case("dflash D64 G4 B16", &a);
    /* simple kernels (D 40), G = 3, B = 5 */
    const int32_t ctx_b[] = {50}, anc_b[] = {6};
    dflash_shape b = dflash_layout(ctx_b, 1, anc_b, 5, 6, 2, 40);
    dflash_case("dflash D40 G3 B5", &b);
    /* tensor cores, D 128 */
    const int32_t ctx_c[] = {70}, anc_c[] = {3};
    dflash_shape c = dflash_layout(ctx_c, 1, anc_c, 16, 4, 2, 128);
    dflash_case("dflash D128 G2 B16", &c);
    /* tensor cores with partial row tiles (B*G = 20) */
    const int32_t ctx_d[] = {90, 7}, anc_d[] = {4, 2};
    dflash_shape d = dflash_layout(ctx_d, 2, anc_d, 5, 4, 1, 64);
    dflash_case("dflash D64 G4 B5", &d);
    /* 40 blocks share the first key tiles: more than one chunk per tile */
    const int32_t ctx_e[] = {150}, anc_e[] = {40};
    dflash_shape e = dflash_layout(ctx_e, 1, anc_e, 4, 2, 2, 64);
    dflash_case("dflash D64 G1 B4 x40", &e);
    /* D 256: the forward on tensor cores (32-key tiles, Q re-read from shared
     * memory), the backward on the simple kernels; G = 6 B = 3 (18 rows) */
    const int32_t ctx_g[] = {75, 40}, anc_g[] = {3, 2};
    dflash_shape g = dflash_layout(ctx_g, 2, anc_g, 3, 6, 1, 256);
    dflash_case("dflash D256 G6 B3", &g);
    /* G = 6 over B = 16: 96 rows, two 64-row steps of the dk/dv kernel, and
     * G does not divide the 16 rows between a thread's row chunks at D 64
     * (the per-chunk division); anchors past 64 keys: whole key tiles */
    const int32_t ctx_h[] = {200}, anc_h[] = {5};
    dflash_shape h = dflash_layout(ctx_h, 1, anc_h, 16, 6, 1, 64);
    dflash_case("dflash D64 G6 B16", &h);
    /* G = 3, B = 7: 21 rows padded to 64 */
    const int32_t ctx_i[] = {130, 66}, anc_i[] = {3, 3};
    dflash_shape i = dflash_layout(ctx_i, 2, anc_i, 7, 6, 2, 64);
    dflash_case("dflash D64 G3 B7", &i);
    /* blocks laid out by hand: own keys before the context, in the context's
     * last tile, sharing a tile with it, and right after it (the key tiles a
     * block touches: one run or two, in either order) */
    const dfl_block own[] = {{130, 120, 0}, {0, 117, 120}, {30, 90, 120}, {64, 0, 150},
                              {130, 40, 170}, {0, 0, 190}, {0, 50, 200}};
    dflash_shape j = {7, 16, 250, 8, 2, 64, NULL};
    j.blocks = dfl_malloc(sizeof own);
    memcpy(j.blocks, own, sizeof own);
    dflash_case("dflash D64 G4 B16 by hand", &j);
    /* keys 30..199 seen by no block: whole key tiles (64..191) without a
     * chunk, whose dk, dv the backward must still write (as zeros) */
    const dfl_block unseen[] = {{0, 10, 200}, {0, 30, 216}};
    dflash_shape u = {2, 16, 232, 8, 2, 64, NULL};
    u.blocks = dfl_malloc(sizeof unseen);
    memcpy(u.blocks, unseen, sizeof unseen);
    dflash_case("dflash D64 G4 B16 unseen tiles", &u);
    free(u.blocks);
    free(a.blocks), free(b.blocks), free(c.blocks), free(d.blocks), free(e.blocks), free(g.blocks);
    free(h.blocks), free(i.blocks), free(j.blocks);
    if (AG_BIG) { /* Qwen3-8B drafter heads, a 1024-token sample, 64 anchors */
        const int32_t ctx_f[] = {1024}, anc_f[] = {64};
        dflash_shape f = dflash_layout(ctx_f, 1, anc_f, 16, 32, 8, 128);
        dflash_case("dflash Qwen3-8B heads", &f);
        free(f.blocks);
    }
}

/* ---- DFlash blocks under a sliding window (a drafter's sliding layer) --------
 * ops.h attn_dflash with window W > 0: the query in slot o of a block sees
 * the context keys kv in [ctx_off, ctx_end) with kv >= ctx_end + o + 1 - W
 * (ctx_end = ctx_off + ctx_len) and its own keys blk_off .. blk_off + o.
 * Checked twice: against a dense oracle of its own (below; it needs no
 * reference backend), and DEV against REF like every other op. The shapes
 * put anchors near a sequence's start (ctx_len < W: the window reaches
 * before the sequence and is cut at ctx_off) and far from it (ctx_len > W),
 * in packed sequences (ctx_off > 0), windows 1, 3 (B = 4: shorter than the
 * block, the last slots see no context) and 20, and head dims a window 0
 * call would take to the tensor cores (64) and to the simple kernels (40). */

/* Blocks at chosen anchors: sequence s has ctx[s] context keys (stored one
 * sequence after another from key 0); block i belongs to sequence seq[i]
 * and has anchor anc[i]; the blocks' own keys follow all the context. */
static dflash_shape dflash_anchored(const int32_t *ctx, int64_t nseq, const int32_t *seq, const int32_t *anc,
                                    int64_t nblk, int64_t B, int64_t Hq, int64_t Hkv, int64_t D) {
    dflash_shape s = {nblk, B, 0, Hq, Hkv, D, dfl_malloc((size_t)nblk * sizeof(dfl_block))};
    int64_t S = 0, *off = dfl_malloc((size_t)nseq * sizeof(int64_t));
    for (int64_t i = 0; i < nseq; i++) off[i] = S, S += ctx[i];
    for (int64_t j = 0; j < nblk; j++) {
        DFL_ASSERT(seq[j] < nseq && anc[j] <= ctx[seq[j]]);
        s.blocks[j] = (dfl_block){(int32_t)off[seq[j]], anc[j], (int32_t)(S + j * B)};
    }
    s.NK = S + nblk * B;
    free(off);
    return s;
}

/* The rule as ops.h states it (W = 0: the whole context and block). */
static int win_sees(const dfl_block *b, int64_t B, int64_t W, int64_t o, int64_t kv) {
    const int64_t end = (int64_t)b->ctx_off + b->ctx_len;
    const int ctx = kv >= b->ctx_off && kv < end && (W == 0 || kv >= end + o + 1 - W);
    const int own = kv >= b->blk_off && kv < b->blk_off + (W ? o + 1 : B);
    return ctx || own;
}

/* Attention over the dense mask in double, a naive softmax per row, and its
 * gradients (dS = P (dP - rowsum(P dP)), all written out): out, lse, dq
 * [nq, Hq, D], dk, dv [NK, Hkv, D], from the same bf16 inputs as the op. */
typedef struct {
    double *out, *lse, *dq, *dk, *dv;
} win_oracle;

static win_oracle win_oracle_run(const dflash_shape *s, int64_t W, const float *q, const float *k, const float *v,
                                 const float *dout) {
    const int64_t B = s->B, Hq = s->Hq, Hkv = s->Hkv, D = s->D, NK = s->NK, nq = s->nblk * B, G = Hq / Hkv;
    const double scale = 1.0 / sqrt((double)D);
    win_oracle o = {dfl_calloc((size_t)(nq * Hq * D), 8), dfl_calloc((size_t)(nq * Hq), 8),
                    dfl_calloc((size_t)(nq * Hq * D), 8), dfl_calloc((size_t)(NK * Hkv * D), 8),
                    dfl_calloc((size_t)(NK * Hkv * D), 8)};
    double *sc = dfl_malloc((size_t)NK * 8), *dp = dfl_malloc((size_t)NK * 8);
    for (int64_t t = 0; t < nq; t++) {
        const dfl_block *b = &s->blocks[t / B];
        for (int64_t h = 0; h < Hq; h++) {
            const int64_t row = t * Hq + h, hk = h / G;
            const float *qr = q + row * D, *gr = dout + row * D;
            double m = -INFINITY, l = 0, delta = 0;
            for (int64_t kv = 0; kv < NK; kv++) { /* scores and dP on the mask, -inf off it */
                sc[kv] = -INFINITY, dp[kv] = 0;
                if (!win_sees(b, B, W, t % B, kv)) continue;
                double x = 0, y = 0;
                for (int64_t d = 0; d < D; d++) {
                    x += (double)qr[d] * k[(kv * Hkv + hk) * D + d];
                    y += (double)gr[d] * v[(kv * Hkv + hk) * D + d];
                }
                sc[kv] = x * scale, dp[kv] = y;
                m = sc[kv] > m ? sc[kv] : m;
            }
            for (int64_t kv = 0; kv < NK; kv++) l += exp(sc[kv] - m);
            o.lse[row] = m + log(l);
            for (int64_t kv = 0; kv < NK; kv++) { /* P, in sc */
                sc[kv] = exp(sc[kv] - o.lse[row]);
                delta += sc[kv] * dp[kv];
                for (int64_t d = 0; d < D; d++) o.out[row * D + d] += sc[kv] * v[(kv * Hkv + hk) * D + d];
            }
            for (int64_t kv = 0; kv < NK; kv++) {
                if (sc[kv] == 0) continue; /* off the mask (exp(-inf)); keeps unseen keys' gradients exactly 0 */
                const double ds = sc[kv] * (dp[kv] - delta);
                for (int64_t d = 0; d < D; d++) {
                    o.dq[row * D + d] += scale * ds * k[(kv * Hkv + hk) * D + d];
                    o.dk[(kv * Hkv + hk) * D + d] += scale * ds * qr[d];
                    o.dv[(kv * Hkv + hk) * D + d] += sc[kv] * gr[d];
                }
            }
        }
    }
    free(sc), free(dp);
    return o;
}

static void win_oracle_free(win_oracle *o) { free(o->out), free(o->lse), free(o->dq), free(o->dk), free(o->dv); }

/* DEV's buffer (act or f32) against the oracle's values by nmse, printed
 * and checked; with zeros_exact, also every value the oracle has exactly 0
 * (a key no row sees) must be exactly 0: one key seen across the window's
 * edge fails there even where the nmse would hide it. Returns the nmse. */
static double win_check(const char *what, const void *dev, ag_kind kind, const double *want, int64_t n, double limit,
                        int zeros_exact) {
    float *d = ag_get(DEV, dev, n, kind);
    double num = 0, den = 0;
    int finite = 1;
    int64_t stray = 0;
    for (int64_t i = 0; i < n; i++) {
        finite &= isfinite(d[i]) != 0;
        num += (d[i] - want[i]) * (d[i] - want[i]), den += want[i] * want[i];
        stray += zeros_exact && want[i] == 0 && d[i] != 0;
    }
    double e = den > 0 ? num / den : num;
    printf("  nmse %-28s %.2e (limit %.0e)\n", what, e, limit);
    T_CHECKF(finite && e <= limit, "%s: nmse %.3g, limit %.0e%s", what, e, limit, finite ? "" : ", non-finite values");
    T_CHECKF(stray == 0, "%s: %lld values nonzero where no row sees the key", what, (long long)stray);
    free(d);
    return finite ? e : INFINITY;
}

/* DEV alone against the oracle: out, lse, then dq, dk, dv of one call (dq
 * from the dS the dk/dv kernel stored, where the tensor cores take it), dq
 * of a call with the store off (DFLASH_CUDA_DS_MAX_MB=0: dq recomputes S
 * and dP), and dk of a call asking for dk alone (into buffers of random
 * values: the op writes, and writes zeros for the keys no row sees).
 * Limits: out is rounded to bf16 once (NMSE_ROUND) on the simple kernels
 * (D 40), and P is rounded to bf16 for the P V product on the tensor cores
 * (D 64, 128, 256: NMSE_INNER, window or not); lse is f32 (NMSE_F32); the
 * gradients are built on the op's bf16 out (delta) and rounded once
 * (NMSE_INNER). Each check's worst nmse over the cases is kept in
 * win_worst (printed at the end of a test). */
static double win_worst[6];
static void win_case_check(const char *what, const void *dev, ag_kind kind, const double *want, int64_t n,
                           double limit, int zeros_exact, int slot) {
    const double r = win_check(what, dev, kind, want, n, limit, zeros_exact) / limit;
    if (r > win_worst[slot]) win_worst[slot] = r;
}

static void win_oracle_case(const char *name, const dflash_shape *s, int64_t W) {
    const int64_t nq = s->nblk * s->B, Hq = s->Hq, Hkv = s->Hkv, D = s->D, NK = s->NK;
    const int64_t nqd = nq * Hq * D, nkd = NK * Hkv * D;
    float *hq = ag_randn(nqd, 1), *hk = ag_randn(nkd, 1), *hv = ag_randn(nkd, 1), *hd = ag_randn(nqd, 1);
    float *g0 = ag_randn(nqd, 1), *g1 = ag_randn(nkd, 1);
    void *q = ag_put(DEV, hq, nqd, AG_ACT), *k = ag_put(DEV, hk, nkd, AG_ACT), *v = ag_put(DEV, hv, nkd, AG_ACT);
    void *dout = ag_put(DEV, hd, nqd, AG_ACT), *blk = ag_put(DEV, s->blocks, s->nblk * 3, AG_I32);
    void *out = ag_put(DEV, NULL, nqd, AG_ACT), *lse = ag_put(DEV, NULL, nq * Hq, AG_F32);
    void *dq = ag_put(DEV, g0, nqd, AG_ACT), *dk = ag_put(DEV, g1, nkd, AG_ACT), *dv = ag_put(DEV, g1, nkd, AG_ACT);
    void *dk1 = ag_put(DEV, g1, nkd, AG_ACT), *dq2 = ag_put(DEV, g0, nqd, AG_ACT);
    win_oracle o = win_oracle_run(s, W, hq, hk, hv, hd);
    DEV->attn_dflash(out, lse, q, k, v, blk, s->nblk, s->B, NK, Hq, Hkv, D, W);
    DEV->attn_dflash_bwd(dq, dk, dv, dout, out, lse, q, k, v, blk, s->nblk, s->B, NK, Hq, Hkv, D, W);
    DEV->attn_dflash_bwd(NULL, dk1, NULL, dout, out, lse, q, k, v, blk, s->nblk, s->B, NK, Hq, Hkv, D, W);
    setenv("DFLASH_CUDA_DS_MAX_MB", "0", 1);
    DEV->attn_dflash_bwd(dq2, dk1, dv, dout, out, lse, q, k, v, blk, s->nblk, s->B, NK, Hq, Hkv, D, W);
    unsetenv("DFLASH_CUDA_DS_MAX_MB");
    const int tc = D == 64 || D == 128 || D == 256; /* a forward the tensor cores take (aligned buffers) */
    char what[96];
    snprintf(what, sizeof what, "%s W%lld out", name, (long long)W);
    win_case_check(what, out, AG_ACT, o.out, nqd, tc ? NMSE_INNER : NMSE_ROUND, 0, 0);
    snprintf(what, sizeof what, "%s W%lld lse", name, (long long)W);
    win_case_check(what, lse, AG_F32, o.lse, nq * Hq, NMSE_F32, 0, 1);
    snprintf(what, sizeof what, "%s W%lld dq", name, (long long)W);
    win_case_check(what, dq, AG_ACT, o.dq, nqd, NMSE_INNER, 0, 2);
    snprintf(what, sizeof what, "%s W%lld dk", name, (long long)W);
    win_case_check(what, dk, AG_ACT, o.dk, nkd, NMSE_INNER, 1, 3);
    snprintf(what, sizeof what, "%s W%lld dv", name, (long long)W);
    win_case_check(what, dv, AG_ACT, o.dv, nkd, NMSE_INNER, 1, 4);
    snprintf(what, sizeof what, "%s W%lld dk alone", name, (long long)W);
    win_case_check(what, dk1, AG_ACT, o.dk, nkd, NMSE_INNER, 1, 3);
    snprintf(what, sizeof what, "%s W%lld dq (recomputed)", name, (long long)W);
    win_case_check(what, dq2, AG_ACT, o.dq, nqd, NMSE_INNER, 0, 5);
    win_oracle_free(&o);
    void *bufs[] = {q, k, v, dout, blk, out, lse, dq, dk, dv, dk1, dq2};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) DEV->free(bufs[i]);
    free(hq), free(hk), free(hv), free(hd), free(g0), free(g1);
}

/* The shapes of the window tests, packed sequences with anchors near a
 * sequence's start (the window cut at ctx_off) and far from it:
 *  0  B 16, D 64, G 2 over sequences of 90 and 50 keys, anchors 0, 5, 19,
 *     40, 90 and 2, 30, 50;
 *  1  B 4, D 40, G 3 (the simple kernels) over 30, 70 and 7 keys, anchors
 *     0 to 70 (66, 70: past the first key tile, so that lists cut to the
 *     window leave that tile out for them);
 *  2  B 16, D 128, G 1 over 300 and 130 keys (10 key tiles), anchors at and
 *     around tile edges (64, 65, 128, 129) and past every window;
 *  3  B 4, D 64, G 4 over 150 and 70 keys: windows 1 and 3 shorter than
 *     the block (its last slots see no context);
 *  4  B 16, D 128, G 4: 64 rows, one whole forward CTA a (block, KV head);
 *  5  B 16, D 64, G 6: 96 rows, two forward CTAs (the second's slots 10 to
 *     15: its window edge is not slot 0's) and two dk/dv steps, padded;
 *  6  B 3, D 256, G 6: the forward on the tensor cores (32-key tiles), the
 *     backward on the simple kernels.
 * The tensor-core shapes (all but 1) take every window of WINDOWS: 1, 3,
 * 20, the tile edges 63, 64, 65, and 100, 200 (whole context tiles inside
 * the window, the CTA-uniform unmasked ones). */
#define WIN_SHAPES 7
static dflash_shape win_shape(int which) {
    switch (which) {
    case 0: {
        const int32_t ctx[] = {90, 50}, seq[] = {0, 0, 0, 0, 0, 1, 1, 1}, anc[] = {0, 5, 19, 40, 90, 2, 30, 50};
        return dflash_anchored(ctx, 2, seq, anc, 8, 16, 4, 2, 64);
    }
    case 1: {
        const int32_t ctx[] = {30, 70, 7}, seq[] = {0, 0, 0, 1, 1, 1, 1, 1, 2},
                      anc[] = {1, 12, 30, 0, 3, 21, 66, 70, 7};
        return dflash_anchored(ctx, 3, seq, anc, 9, 4, 6, 2, 40);
    }
    case 2: {
        const int32_t ctx[] = {300, 130}, seq[] = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1},
                      anc[] = {0, 10, 64, 65, 128, 200, 300, 3, 64, 129, 130};
        return dflash_anchored(ctx, 2, seq, anc, 11, 16, 2, 2, 128);
    }
    case 3: {
        const int32_t ctx[] = {150, 70}, seq[] = {0, 0, 0, 0, 0, 0, 1, 1, 1}, anc[] = {0, 2, 63, 64, 100, 150, 1, 40, 70};
        return dflash_anchored(ctx, 2, seq, anc, 9, 4, 8, 2, 64);
    }
    case 4: {
        const int32_t ctx[] = {260}, seq[] = {0, 0, 0, 0, 0, 0, 0}, anc[] = {0, 1, 66, 127, 128, 191, 260};
        return dflash_anchored(ctx, 1, seq, anc, 7, 16, 4, 1, 128);
    }
    case 5: {
        const int32_t ctx[] = {170, 40}, seq[] = {0, 0, 0, 0, 1, 1}, anc[] = {0, 30, 100, 170, 5, 40};
        return dflash_anchored(ctx, 2, seq, anc, 6, 16, 6, 1, 64);
    }
    default: {
        const int32_t ctx[] = {75, 140}, seq[] = {0, 0, 0, 1, 1, 1}, anc[] = {0, 30, 75, 10, 100, 140};
        return dflash_anchored(ctx, 2, seq, anc, 6, 3, 6, 1, 256);
    }
    }
}
static const char *const WIN_NAMES[WIN_SHAPES] = {"dflash-swa D64 G2 B16", "dflash-swa D40 G3 B4",
                                                  "dflash-swa D128 G1 B16", "dflash-swa D64 G4 B4",
                                                  "dflash-swa D128 G4 B16", "dflash-swa D64 G6 B16",
                                                  "dflash-swa D256 G6 B3"};
static const int64_t WINDOWS[] = {1, 3, 20, 63, 64, 65, 100, 200};
/* the windows shape `which` takes: the first three for the simple kernels */
static int win_count(int which) { return which == 1 ? 3 : (int)(sizeof WINDOWS / sizeof *WINDOWS); }

static void win_worst_print(void) {
    static const char *const what[6] = {"out", "lse", "dq", "dk", "dv", "dq (recomputed)"};
    printf("  worst nmse / limit over the window cases:");
    for (int i = 0; i < 6; i++) printf(" %s %.3f%s", what[i], win_worst[i], i < 5 ? "," : "\n");
    memset(win_worst, 0, sizeof win_worst);
}

/* the oracle alone (no REF): every shape and window, a window of 2^40 (no
 * bound's arithmetic may overflow), and window 0 as the oracle's own
 * control (DEV's window-0 kernels answer there) */
static void attn_dflash_window_oracle(void) {
    for (int w = 0; w < WIN_SHAPES; w++) {
        dflash_shape s = win_shape(w);
        win_oracle_case(WIN_NAMES[w], &s, 0);
        for (int i = 0; i < win_count(w); i++) win_oracle_case(WIN_NAMES[w], &s, WINDOWS[i]);
        win_oracle_case(WIN_NAMES[w], &s, (int64_t)1 << 40); /* past every key: the own block's causality alone */
        free(s.blocks);
    }
    win_worst_print();
}

/* DEV against REF (the CPU's sliding window), as attn_dflash_agrees */
static void attn_dflash_window_agrees(void) {
    for (int w = 0; w < WIN_SHAPES; w++) {
        dflash_shape s = win_shape(w);
        for (int i = 0; i < win_count(w); i++) {
            char name[64];
            snprintf(name, sizeof name, "%s W%lld", WIN_NAMES[w], (long long)WINDOWS[i]);
            dflash_case_w(name, &s, WINDOWS[i]);
        }
        free(s.blocks);
    }
    if (AG_BIG) { /* Qwen3-8B drafter heads, a window of 2048 over a 3000-token sample */
        const int32_t ctx_f[] = {3000}, anc_f[] = {32};
        dflash_shape f = dflash_layout(ctx_f, 1, anc_f, 16, 32, 8, 128);
        dflash_case_w("dflash-swa Qwen3-8B heads W2048", &f, 2048);
        free(f.blocks);
    }
}

/* gpt-oss: the clamped SwiGLU (inputs past both limits; out aliasing up).
 * Outputs saturated by both clamps are all one value with one rounding
 * error, so limits of 2.5 and up keep them a few percent of n (at limit 1,
 * a third of them: nmse 4e-6, most of NMSE_ROUND). */
static void swiglu_oss_case(int64_t n, float alpha, float limit) {
    float *hg = ag_randn(n, 3), *hu = ag_randn(n, 3);
    ag_pair g = ag_new(hg, n, AG_ACT), u = ag_new(hu, n, AG_ACT), out = ag_new(NULL, n, AG_ACT);
    char what[64];
    REF->swiglu_oss(out.r, g.r, u.r, n, alpha, limit);
    DEV->swiglu_oss(out.d, g.d, u.d, n, alpha, limit);
    snprintf(what, sizeof what, "swiglu_oss n %lld", (long long)n);
    ag_check(what, &out, NMSE_ROUND);
    REF->swiglu_oss(u.r, g.r, u.r, n, alpha, limit);
    DEV->swiglu_oss(u.d, g.d, u.d, n, alpha, limit);
    snprintf(what, sizeof what, "swiglu_oss n %lld (out = up)", (long long)n);
    ag_check(what, &u, NMSE_ROUND);
    ag_free(&g), ag_free(&u), ag_free(&out);
    free(hg), free(hu);
}

/* sinks from far below to far above the lse: factors ~1 to ~0 */
static void attn_sinks_case(int64_t T, int64_t Hq, int64_t D) {
    float *ho = ag_randn(T * Hq * D, 1), *hl = ag_randn(T * Hq, 4), *hs = ag_randn(Hq, 1);
    for (int64_t h = 0; h < Hq; h++) hs[h] += (float)(h % 4) * 10 - 15; /* -15, -5, 5, 15 */
    ag_pair o = ag_new(ho, T * Hq * D, AG_ACT), l = ag_new(hl, T * Hq, AG_F32), sk = ag_new(hs, Hq, AG_F32);
    REF->attn_sinks(o.r, l.r, sk.r, T, Hq, D);
    DEV->attn_sinks(o.d, l.d, sk.d, T, Hq, D);
    char what[64];
    snprintf(what, sizeof what, "attn_sinks %lldx%lldx%lld", (long long)T, (long long)Hq, (long long)D);
    ag_check(what, &o, NMSE_ROUND);
    ag_free(&o), ag_free(&l), ag_free(&sk);
    free(ho), free(hl), free(hs);
}

/* gpt-oss's sliding-window attention with sinks as the model runs it:
 * attn_dflash over blocks of 1 (row i sees keys i-W < j <= i), then
 * attn_sinks on each side's own lse */
static void attn_window_sinks_case(int64_t T, int64_t W, int64_t Hq, int64_t Hkv, int64_t D) {
    dfl_block *bl = dfl_malloc((size_t)T * sizeof *bl);
    for (int64_t i = 0; i < T; i++) {
        int32_t lo = (int32_t)(i - W + 1 > 0 ? i - W + 1 : 0);
        bl[i] = (dfl_block){lo, (int32_t)i - lo, (int32_t)i};
    }
    float *hq = ag_randn(T * Hq * D, 1), *hk = ag_randn(T * Hkv * D, 1), *hv = ag_randn(T * Hkv * D, 1);
    float *hs = ag_randn(Hq, 2);
    ag_pair q = ag_new(hq, T * Hq * D, AG_ACT), k = ag_new(hk, T * Hkv * D, AG_ACT), v = ag_new(hv, T * Hkv * D, AG_ACT);
    ag_pair blk = ag_new(bl, T * 3, AG_I32), sk = ag_new(hs, Hq, AG_F32);
    ag_pair out = ag_new(NULL, T * Hq * D, AG_ACT), lse = ag_new(NULL, T * Hq, AG_F32);
    REF->attn_dflash(out.r, lse.r, q.r, k.r, v.r, blk.r, T, 1, T, Hq, Hkv, D, 0);
    DEV->attn_dflash(out.d, lse.d, q.d, k.d, v.d, blk.d, T, 1, T, Hq, Hkv, D, 0);
    REF->attn_sinks(out.r, lse.r, sk.r, T, Hq, D);
    DEV->attn_sinks(out.d, lse.d, sk.d, T, Hq, D);
    char what[96];
    snprintf(what, sizeof what, "window %lld + sinks D%lld G%lld", (long long)W, (long long)D, (long long)(Hq / Hkv));
    ag_check(what, &out, NMSE_INNER);
    ag_free(&q), ag_free(&k), ag_free(&v), ag_free(&blk), ag_free(&sk), ag_free(&out), ag_free(&lse);
    free(hq), free(hk), free(hv), free(hs), free(bl);
}

/* after the others, so that their inputs stay as they were */
static void gptoss_agrees(void) {
    swiglu_oss_case(1003, 1.702f, 2.5f); /* vector body and scalar tail */
    swiglu_oss_case(1024, 1.702f, 7.0f); /* gpt-oss's own limit */
    swiglu_oss_case(203, 1.702f, 4.0f);
    attn_sinks_case(37, 8, 64);
    attn_sinks_case(5, 3, 40);
    attn_window_sinks_case(100, 16, 8, 2, 64); /* tensor cores */
    attn_window_sinks_case(37, 8, 4, 2, 40);   /* simple kernels */
    attn_window_sinks_case(70, 128, 4, 1, 64); /* window longer than the sequence: causal */
}

/* No blocks, no queries: every key is unseen, and dk, dv (pre-filled) come
 * back as zeros on both sides. */
static void attn_dflash_bwd_without_blocks(void) {
    const int64_t NK = 70, Hq = 4, Hkv = 2, D = 64, n = NK * Hkv * D;
    float *hk = ag_randn(n, 1), *hv = ag_randn(n, 1), *hq = ag_randn(Hq * D, 1);
    ag_pair k = ag_new(hk, n, AG_ACT), v = ag_new(hv, n, AG_ACT), q = ag_new(hq, Hq * D, AG_ACT);
    ag_pair dk = ag_grad(n, AG_ACT, 1), dv = ag_grad(n, AG_ACT, 1), blk = ag_new(NULL, 3, AG_I32);
    ag_pair lse = ag_new(NULL, Hq, AG_F32);
    for (int side = 0; side < 2; side++) {
        const dfl_ops *o = side ? DEV : REF;
        void *b_dk = side ? dk.d : dk.r, *b_dv = side ? dv.d : dv.r, *b_q = side ? q.d : q.r;
        /* q stands in for dout and out: with no blocks nothing of them is read */
        o->attn_dflash_bwd(NULL, b_dk, b_dv, b_q, b_q, side ? lse.d : lse.r, b_q, side ? k.d : k.r,
                           side ? v.d : v.r, side ? blk.d : blk.r, 0, 16, NK, Hq, Hkv, D, 0);
        float *gk = ag_get(o, b_dk, n, AG_ACT), *gv = ag_get(o, b_dv, n, AG_ACT);
        int64_t nonzero = 0;
        for (int64_t i = 0; i < n; i++) nonzero += gk[i] != 0.0f || gv[i] != 0.0f;
        T_CHECKF(nonzero == 0, "%s: %lld dk/dv values are not zero", o->name, (long long)nonzero);
        free(gk), free(gv);
    }
    ag_free(&k), ag_free(&v), ag_free(&q), ag_free(&dk), ag_free(&dv), ag_free(&blk), ag_free(&lse);
    free(hk), free(hv), free(hq);
}

/* ---- LM head ------------------------------------------------------------------ */

typedef struct {
    int64_t N, H, V;
    ag_pair h, th, w, gs, lab;
    float *gap; /* the reference's top-1 minus top-2, to skip near ties */
} lm_case;

static lm_case lm_new(int64_t N, int64_t H, int64_t V) {
    lm_case c = {N, H, V, {0}, {0}, {0}, {0}, {0}, NULL};
    float *hh = ag_randn(N * H, 1), *ht = ag_randn(N * H, 1), *hw = ag_randn(V * H, 0.3);
    for (int64_t i = 0; i < N * H; i++) ht[i] = bf16_round(0.7f * ht[i] + 0.7f * hh[i]); /* near the drafter */
    float *gs = dfl_malloc((size_t)N * 4);
    int32_t *lab = dfl_malloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) {
        gs[i] = i % 5 == 2 ? 0.0f : (float)(0.5 + dfl_rng_uniform(&AG_RNG)) / (float)N;
        lab[i] = i % 7 == 3 ? -1 : (int32_t)dfl_rng_below(&AG_RNG, (uint64_t)V);
    }
    c.h = ag_new(hh, N * H, AG_ACT), c.th = ag_new(ht, N * H, AG_ACT), c.w = ag_new(hw, V * H, AG_ACT);
    c.gs = ag_new(gs, N, AG_F32), c.lab = ag_new(lab, N, AG_I32);
    ag_pair pred = ag_new(NULL, N, AG_I32), gap = ag_new(NULL, N, AG_F32);
    REF->lmhead_argmax(pred.r, gap.r, c.h.r, c.w.r, N, H, V);
    c.gap = ag_get(REF, gap.r, N, AG_F32);
    ag_free(&pred), ag_free(&gap);
    free(hh), free(ht), free(hw), free(gs), free(lab);
    return c;
}

static void lm_free(lm_case *c) {
    ag_free(&c->h), ag_free(&c->th), ag_free(&c->w), ag_free(&c->gs), ag_free(&c->lab);
    free(c->gap);
}

/* predictions agree wherever the reference's top-2 gap is not a near tie */
static void lm_check_pred(const char *what, const ag_pair *p, const float *gap) {
    int32_t *r = dfl_malloc((size_t)p->n * 4), *d = dfl_malloc((size_t)p->n * 4);
    REF->download(r, p->r, (size_t)p->n * 4);
    DEV->download(d, p->d, (size_t)p->n * 4);
    int bad = 0, used = 0;
    for (int64_t i = 0; i < p->n; i++) {
        if (gap && gap[i] < 1e-3f) continue;
        used++;
        bad += r[i] != d[i];
    }
    printf("  pred %-28s %d of %d rows differ\n", what, bad, used);
    T_CHECKF(bad == 0 && used > 0, "%s: %d of %d predictions differ", what, bad, used);
    free(r), free(d);
}

static void lmhead_ce_case(int64_t N, int64_t H, int64_t V) {
    lm_case c = lm_new(N, H, V);
    ag_pair loss = ag_new(NULL, N, AG_F32), pred = ag_new(NULL, N, AG_I32), dh = ag_new(NULL, N * H, AG_ACT);
    REF->lmhead_ce(loss.r, pred.r, dh.r, c.h.r, c.w.r, c.lab.r, c.gs.r, N, H, V);
    float *g0 = ag_get(REF, dh.r, N * H, AG_ACT);
    ag_free(&dh);
    dh = ag_grad(N * H, AG_ACT, ag_rms(g0, N * H));
    REF->lmhead_ce(loss.r, pred.r, dh.r, c.h.r, c.w.r, c.lab.r, c.gs.r, N, H, V);
    DEV->lmhead_ce(loss.d, pred.d, dh.d, c.h.d, c.w.d, c.lab.d, c.gs.d, N, H, V);
    ag_check("lmhead_ce loss", &loss, NMSE_F32);
    ag_check("lmhead_ce dh", &dh, NMSE_INNER);
    lm_check_pred("lmhead_ce pred", &pred, c.gap);
    /* no gradient wanted: loss and pred only */
    DEV->lmhead_ce(loss.d, pred.d, NULL, c.h.d, c.w.d, c.lab.d, NULL, N, H, V);
    ag_check("lmhead_ce loss (no dh)", &loss, NMSE_F32);
    ag_free(&loss), ag_free(&pred), ag_free(&dh);
    lm_free(&c);
    free(g0);
}

static void lmhead_kl_case(int64_t N, int64_t H, int64_t V) {
    lm_case c = lm_new(N, H, V);
    ag_pair loss = ag_new(NULL, N, AG_F32), pred = ag_new(NULL, N, AG_I32), tpred = ag_new(NULL, N, AG_I32);
    ag_pair dh = ag_new(NULL, N * H, AG_ACT);
    REF->lmhead_kl(loss.r, pred.r, tpred.r, dh.r, c.h.r, c.th.r, c.w.r, c.gs.r, N, H, V);
    float *g0 = ag_get(REF, dh.r, N * H, AG_ACT);
    ag_free(&dh);
    dh = ag_grad(N * H, AG_ACT, ag_rms(g0, N * H));
    REF->lmhead_kl(loss.r, pred.r, tpred.r, dh.r, c.h.r, c.th.r, c.w.r, c.gs.r, N, H, V);
    DEV->lmhead_kl(loss.d, pred.d, tpred.d, dh.d, c.h.d, c.th.d, c.w.d, c.gs.d, N, H, V);
    ag_check("lmhead_kl loss", &loss, NMSE_KL);
    ag_check("lmhead_kl dh", &dh, NMSE_INNER);
    lm_check_pred("lmhead_kl pred", &pred, c.gap);
    /* the target's predictions: near ties judged by the target's own gap */
    ag_pair tg = ag_new(NULL, N, AG_F32), tp = ag_new(NULL, N, AG_I32);
    REF->lmhead_argmax(tp.r, tg.r, c.th.r, c.w.r, N, H, V);
    float *tgap = ag_get(REF, tg.r, N, AG_F32);
    lm_check_pred("lmhead_kl tpred", &tpred, tgap);
    ag_free(&loss), ag_free(&pred), ag_free(&tpred), ag_free(&dh), ag_free(&tg), ag_free(&tp);
    lm_free(&c);
    free(g0), free(tgap);
}

/* lmhead_argmax on both tables into pred and gap, checked (labels end in `suffix`) */
static void argmax_check(const char *suffix, const lm_case *c, ag_pair *pred, ag_pair *gap, int64_t N, int64_t H,
                         int64_t V) {
    char what[96];
    REF->lmhead_argmax(pred->r, gap->r, c->h.r, c->w.r, N, H, V);
    DEV->lmhead_argmax(pred->d, gap->d, c->h.d, c->w.d, N, H, V);
    snprintf(what, sizeof what, "lmhead_argmax pred%s", suffix);
    lm_check_pred(what, pred, c->gap);
    snprintf(what, sizeof what, "lmhead_argmax gap%s", suffix);
    ag_check(what, gap, 1e-6);
}

static void lmhead_agrees(void) {
    lmhead_ce_case(37, 64, 1000);
    lmhead_ce_case(21, 40, 999);
    lmhead_kl_case(37, 64, 1000);
    lmhead_kl_case(19, 24, 777);
    { /* V % 4 == 0: rows read 16 bytes at a time on CUDA */
        lm_case c4 = lm_new(29, 64, 1000);
        ag_pair pred4 = ag_new(NULL, 29, AG_I32), gap4 = ag_new(NULL, 29, AG_F32);
        argmax_check(" (V % 4 == 0)", &c4, &pred4, &gap4, 29, 64, 1000);
        lm_free(&c4);
        ag_free(&pred4), ag_free(&gap4);
    }
    lm_case c = lm_new(45, 64, 1001);
    ag_pair pred = ag_new(NULL, 45, AG_I32), gap = ag_new(NULL, 45, AG_F32);
    argmax_check("", &c, &pred, &gap, 45, 64, 1001);
    /* sampling at T = 0.7: the same draw from the same keys on both tables
     * (near ties of the perturbed scores skipped, as for the argmax) */
    uint64_t keys[45];
    for (int i = 0; i < 45; i++) keys[i] = dfl_sample_key(dfl_sample_seq_key(5, 1), 100 + i);
    /* and among the top 40, top-p 0.9: where one token is kept its gap is
     * inf, so the gaps are compared only unfiltered; the draws always */
    const dfl_sampling how[2] = {{0.7f, 0, 0}, {2.0f, 40, 0.9f}};
    for (int k = 0; k < 2; k++) {
        REF->lmhead_sample(pred.r, gap.r, c.h.r, c.w.r, keys, &how[k], 45, 64, 1001);
        float *sgap = ag_get(REF, gap.r, 45, AG_F32);
        DEV->lmhead_sample(pred.d, gap.d, c.h.d, c.w.d, keys, &how[k], 45, 64, 1001);
        lm_check_pred(k ? "lmhead_sample pred, top-k/p" : "lmhead_sample pred", &pred, sgap);
        if (!k) ag_check("lmhead_sample gap", &gap, 1e-6);
        int several = 0; /* rows where the filter kept more than one token */
        for (int i = 0; i < 45; i++) several += isfinite(sgap[i]);
        T_CHECKF(several >= 40, "only %d of 45 rows drew among several tokens", several);
        free(sgap);
    }
    /* the top-k cut exactly, on both tables: at T = 1000 the draw is near
     * uniform over the kept, so each row's draw must be among its top k by
     * logit (computed here in double) and, for k = 1, the argmax itself */
    float *hh = ag_get(REF, c.h.r, 45 * 64, AG_ACT), *hw = ag_get(REF, c.w.r, 1001 * 64, AG_ACT);
    int32_t dp[45];
    for (int k = 1; k <= 3; k += 2) {
        const dfl_sampling flat = {1000.0f, k, 0};
        int outside = 0, distinct = 0, seen[1001] = {0};
        DEV->lmhead_sample(pred.d, NULL, c.h.d, c.w.d, keys, &flat, 45, 64, 1001);
        DEV->download(dp, pred.d, sizeof dp);
        for (int i = 0; i < 45; i++) {
            double zd = 0, above = 0;
            for (int j = 0; j < 64; j++) zd += (double)hh[i * 64 + j] * hw[dp[i] * 64 + j];
            for (int v = 0; v < 1001; v++) { /* tokens of higher logit than the draw */
                double z = 0;
                for (int j = 0; j < 64; j++) z += (double)hh[i * 64 + j] * hw[v * 64 + j];
                above += z > zd;
            }
            outside += above >= k;
            distinct += !seen[dp[i]]++;
        }
        printf("  lmhead_sample top-k %d at T=1000: %d of 45 draws outside the top k, %d distinct\n", k, outside,
               distinct);
        T_CHECKF(outside == 0 && (k == 1 || distinct > 45 / 2), "top-k %d: %d draws outside, %d distinct", k, outside,
                 distinct);
    }
    free(hh), free(hw);
    ag_free(&pred), ag_free(&gap);
    lm_free(&c);
    if (AG_BIG) lmhead_ce_case(300, 1024, 151936); /* the Qwen3 vocabulary, several chunks */
}

/* ---- views ----------------------------------------------------------------------- */

/* copy_2d: a column block of one matrix into a column block of another (the
 * target's taps, side by side); every other byte of the destination kept. */
static void copy_2d_agrees(void) {
    const int64_t rows = 37, sw = 29, dw = 61, w = 13, s0 = 5, d0 = 40;
    float *hs = ag_randn(rows * sw, 1), *hd = ag_randn(rows * dw, 1);
    float *want = dfl_malloc((size_t)(rows * dw) * 4);
    memcpy(want, hd, (size_t)(rows * dw) * 4);
    for (int64_t r = 0; r < rows; r++) memcpy(want + r * dw + d0, hs + r * sw + s0, (size_t)w * 4);
    const dfl_ops *sides[2] = {REF, DEV};
    for (int k = 0; k < 2; k++) {
        const dfl_ops *o = sides[k];
        void *src = ag_put(o, hs, rows * sw, AG_F32), *dst = ag_put(o, hd, rows * dw, AG_F32);
        o->copy_2d((float *)dst + d0, (size_t)dw * 4, (const float *)src + s0, (size_t)sw * 4, (size_t)w * 4, (size_t)rows);
        o->copy_2d(dst, (size_t)dw * 4, src, (size_t)sw * 4, (size_t)w * 4, 0); /* no rows: nothing */
        float *got = ag_get(o, dst, rows * dw, AG_F32);
        T_CHECKF(!memcmp(got, want, (size_t)(rows * dw) * 4), "%s: copy_2d moved other bytes than the block", o->name);
        free(got);
        o->free(src), o->free(dst);
    }
    free(hs), free(hd), free(want);
}

/* host_alloc's memory (page-locked on CUDA) as the source and the target of
 * the transfers that use it: load_act of bf16 and f32 (the trainer's
 * features), upload, act_to_bf16 and download (the tapped states): the
 * same values through it as through malloc's memory, 64-byte aligned. */
static void host_memory_agrees(void) {
    const int64_t n = 3001;
    const dfl_ops *sides[2] = {REF, DEV};
    for (int k = 0; k < 2; k++) {
        const dfl_ops *o = sides[k];
        float *src = ag_randn(n, 1);
        uint16_t *hb = o->host_alloc((size_t)n * 2), *back = o->host_alloc((size_t)n * 2);
        float *hf = o->host_alloc((size_t)n * 4), *fback = o->host_alloc((size_t)n * 4);
        T_CHECKF(((uintptr_t)hb | (uintptr_t)back | (uintptr_t)hf | (uintptr_t)fback) % 64 == 0, "%s: not 64-byte aligned",
                 o->name);
        for (int64_t i = 0; i < n; i++) hb[i] = dfl_f32_to_bf16(src[i]), hf[i] = src[i];
        void *act = o->alloc((size_t)n * (size_t)o->act_bytes), *raw = o->alloc((size_t)n * 4);
        o->load_act(act, hb, DFL_BF16, n);
        o->act_to_bf16(back, act, n);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++) bad += back[i] != hb[i];
        o->load_act(act, hf, DFL_F32, n);
        o->act_to_f32(fback, act, n);
        for (int64_t i = 0; i < n; i++) /* f32 in: the act type's rounding of it */
            bad += fback[i] != (o->act_bytes == 2 ? dfl_bf16_to_f32(dfl_f32_to_bf16(src[i])) : src[i]);
        o->upload(raw, hf, (size_t)n * 4);
        memset(fback, 0, (size_t)n * 4);
        o->download(fback, raw, (size_t)n * 4);
        for (int64_t i = 0; i < n; i++) bad += fback[i] != hf[i];
        T_CHECKF(bad == 0, "%s: %lld values changed through host_alloc memory", o->name, (long long)bad);
        o->free(act), o->free(raw);
        o->host_free(hb), o->host_free(back), o->host_free(hf), o->host_free(fback);
        o->host_free(NULL);
        free(src);
    }
}

/* Ops on views that start inside their buffers at an element offset that is
 * not a multiple of 8 (model code offsets rows with DFL_AT): the launchers
 * must take their unaligned paths (the emulation aborts on a misaligned
 * 16-byte access, as the GPU faults), with the same results. */
#define AG_VIEW(o, p, off) DFL_AT(o, p, off)
static void views_agree(void) {
    const int64_t n = 301, off = 3, rows = 4, dim = 64; /* rows * dim <= n */
    float *ha = ag_randn(n + off, 1), *hb = ag_randn(n + off, 1);
    ag_pair a = ag_new(ha, n + off, AG_ACT), b = ag_new(hb, n + off, AG_ACT), o = ag_new(NULL, n + off, AG_ACT);
    REF->add(AG_VIEW(REF, o.r, off), AG_VIEW(REF, a.r, off), AG_VIEW(REF, b.r, off), n);
    DEV->add(AG_VIEW(DEV, o.d, off), AG_VIEW(DEV, a.d, off), AG_VIEW(DEV, b.d, off), n);
    ag_check("add on views at +3", &o, NMSE_ROUND);
    REF->swiglu(AG_VIEW(REF, o.r, off), AG_VIEW(REF, a.r, off), AG_VIEW(REF, b.r, off), n);
    DEV->swiglu(AG_VIEW(DEV, o.d, off), AG_VIEW(DEV, a.d, off), AG_VIEW(DEV, b.d, off), n);
    ag_check("swiglu on views at +3", &o, NMSE_ROUND);
    /* rows of 64 starting 3 elements in */
    float *hw = ag_randn(dim, 1);
    ag_pair w = ag_new(hw, dim, AG_ACT), rstd = ag_new(NULL, rows, AG_F32);
    REF->rmsnorm(AG_VIEW(REF, o.r, off), rstd.r, AG_VIEW(REF, a.r, off), w.r, rows, dim, 1e-6f);
    DEV->rmsnorm(AG_VIEW(DEV, o.d, off), rstd.d, AG_VIEW(DEV, a.d, off), w.d, rows, dim, 1e-6f);
    ag_check("rmsnorm on rows at +3", &o, NMSE_ROUND);
    ag_free(&a), ag_free(&b), ag_free(&o), ag_free(&w), ag_free(&rstd);
    free(ha), free(hb), free(hw);
    /* causal attention, head dim 64, q/k/v/out 4 elements in: the simple kernel */
    const int64_t T = 40, Hq = 4, Hkv = 2, D = 64, vo = 4;
    const int32_t cu[] = {0, 23, 40};
    float *hq = ag_randn(T * Hq * D + vo, 1), *hk = ag_randn(T * Hkv * D + vo, 1), *hv = ag_randn(T * Hkv * D + vo, 1);
    ag_pair q = ag_new(hq, T * Hq * D + vo, AG_ACT), k = ag_new(hk, T * Hkv * D + vo, AG_ACT);
    ag_pair v = ag_new(hv, T * Hkv * D + vo, AG_ACT), c = ag_new(cu, 3, AG_I32);
    ag_pair out = ag_new(NULL, T * Hq * D + vo, AG_ACT);
    REF->attn_causal(AG_VIEW(REF, out.r, vo), NULL, AG_VIEW(REF, q.r, vo), AG_VIEW(REF, k.r, vo), AG_VIEW(REF, v.r, vo),
                     c.r, 2, T, Hq, Hkv, D, 0);
    DEV->attn_causal(AG_VIEW(DEV, out.d, vo), NULL, AG_VIEW(DEV, q.d, vo), AG_VIEW(DEV, k.d, vo), AG_VIEW(DEV, v.d, vo),
                     c.d, 2, T, Hq, Hkv, D, 0);
    ag_check("attn_causal on views at +4", &out, NMSE_INNER);
    ag_free(&q), ag_free(&k), ag_free(&v), ag_free(&c), ag_free(&out);
    free(hq), free(hk), free(hv);
}

/* ---- optimizer ----------------------------------------------------------------- */

static void adamw_agrees(void) {
    const int64_t n = 10007;
    float *p = ag_randn(n, 1), *g = ag_randn(n, 0.1), *m = ag_randn(n, 0.01), *v = ag_randn(n, 1e-3);
    for (int64_t i = 0; i < n; i++) v[i] = v[i] * v[i]; /* second moments are >= 0 */
    ag_pair P = ag_new(p, n, AG_F32), G = ag_new(g, n, AG_F32), M = ag_new(m, n, AG_F32), V = ag_new(v, n, AG_F32);
    ag_pair W = ag_new(NULL, n, AG_ACT); /* compute weights, written by the last step */
    for (int64_t t = 1; t <= 3; t++) {
        REF->adamw(P.r, t == 3 ? W.r : NULL, G.r, M.r, V.r, n, 6e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, 0.5f, t);
        DEV->adamw(P.d, t == 3 ? W.d : NULL, G.d, M.d, V.d, n, 6e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, 0.5f, t);
    }
    ag_check("adamw p", &P, NMSE_EXACT);
    ag_check("adamw m", &M, NMSE_EXACT);
    ag_check("adamw v", &V, NMSE_EXACT);
    ag_check("adamw wt (the new p as compute weights)", &W, NMSE_ROUND);
    /* the compute weights it wrote are master_to_wt of its p, bit for bit */
    {
        void *cast = DEV->alloc((size_t)n * DEV->act_bytes);
        DEV->master_to_wt(cast, P.d, n);
        float *a = ag_get(DEV, W.d, n, AG_ACT), *b = ag_get(DEV, cast, n, AG_ACT);
        T_CHECKF(memcmp(a, b, (size_t)n * sizeof(float)) == 0, "adamw's wt differs from master_to_wt of its p");
        DEV->free(cast);
        free(a), free(b);
    }
    ag_free(&W);
    /* sumsq on identical inputs (the CPU's p on both sides: a GPU's p may
     * differ from it by an ulp where the compiler fused a multiply-add,
     * 1e-9 of the sum on the first H200 run): both sum exact f32 squares in
     * double, in other orders, so they agree to n * 2^-53 */
    float *ph = ag_get(REF, P.r, n, AG_F32);
    ag_pair S = ag_new(ph, n, AG_F32);
    double sr = REF->sumsq(S.r, n), sd = DEV->sumsq(S.d, n);
    printf("  sumsq rel. diff %.2e (limit 1e-12)\n", fabs(sd - sr) / sr);
    T_CHECKF(fabs(sd - sr) <= 1e-12 * sr, "sumsq %.17g vs %.17g", sd, sr);
    T_CHECK(DEV->sumsq(S.d, n) == sd); /* deterministic */
    ag_free(&S), ag_free(&P), ag_free(&G), ag_free(&M), ag_free(&V);
    free(ph);
    free(p), free(g), free(m), free(v);
}

/* ---- mixture of experts ----------------------------------------------------------- */
/* moe_route: the listing (offsets, rows, pos) and so the experts chosen
 * must equal the CPU's bit for bit; the weights are f32 by NMSE_F32 (the
 * same f32 formulas; expf may differ by an ulp). Both backends are also
 * checked against a plain oracle: each token's experts by a sort on
 * (logit descending, id ascending) (for these logits p rises strictly with
 * the logit: no underflow, bf16 steps far above an f32 ulp, equal logits
 * give equal p), the weights by a softmax in double, and the listing by
 * its definition. gather_rows is exact; moe_combine is one f32 sum rounded
 * once (NMSE_ROUND), into an x that starts from random values. */

/* Router logits [T, E] as bf16 values. tied: drawn from five values, so
 * most rows hold runs of equal p inside the top k and across its cut, where
 * the lower expert id must win; else normal (scale 2). */
static float *moe_logits(int64_t T, int64_t E, int tied) {
    float *l = ag_randn(T * E, 2);
    if (tied)
        for (int64_t i = 0; i < T * E; i++) l[i] = 0.5f * (float)dfl_rng_below(&AG_RNG, 5) - 1.0f;
    return l;
}


/* Problems with one backend's listing, by its definition: offsets rise from
 * 0 to T*k; pair (t, j) is listed at pos[t*k+j] with rows[] = t, inside the
 * range of expert ids[t*k+j]; within an expert the tokens rise (stable in
 * (token, slot) order; a token picks an expert at most once). */
static int moe_listing_bad(const int64_t *off, const int32_t *rows, const int32_t *pos, const int32_t *ids,
                           int64_t T, int64_t E, int64_t k) {
    int bad = off[0] != 0 || off[E] != T * k;
    for (int64_t e = 0; e < E; e++) bad += off[e + 1] < off[e];
    if (bad) return bad;
    for (int64_t i = 0; i < T * k; i++) {
        const int32_t p = pos[i], e = ids[i];
        if (p < off[e] || p >= off[e + 1] || rows[p] != i / k) bad++;
    }
    for (int64_t e = 0; e < E; e++)
        for (int64_t p = off[e] + 1; p < off[e + 1]; p++) bad += rows[p] <= rows[p - 1];
    return bad;
}

/* one backend's route outputs, downloaded */
typedef struct {
    int64_t *off;
    int32_t *rows, *pos;
    float *w;
} moe_routed;

static moe_routed moe_run_route(const dfl_ops *o, const void *logits, int64_t T, int64_t E, int64_t k, int norm) {
    const int64_t n = T * k;
    moe_routed r = {dfl_malloc((size_t)(E + 1) * 8), dfl_malloc((size_t)(n ? n : 1) * 4),
                    dfl_malloc((size_t)(n ? n : 1) * 4), NULL};
    memset(r.off, 0x55, (size_t)(E + 1) * 8); /* every offset must be written */
    void *rows = o->alloc((size_t)(n ? n : 1) * 4), *pos = o->alloc((size_t)(n ? n : 1) * 4);
    void *w = o->alloc((size_t)(n ? n : 1) * 4);
    o->moe_route(r.off, rows, pos, w, logits, T, E, k, norm);
    o->download(r.rows, rows, (size_t)n * 4);
    o->download(r.pos, pos, (size_t)n * 4);
    r.w = ag_get(o, w, n, AG_F32);
    o->free(rows), o->free(pos), o->free(w);
    return r;
}

static void moe_routed_free(moe_routed *r) { free(r->off), free(r->rows), free(r->pos), free(r->w); }

static void moe_route_case(int64_t T, int64_t E, int64_t k, int norm, int tied) {
    const int64_t n = T * k;
    float *hl = moe_logits(T, E, tied);
    ag_pair lg = ag_new(hl, T * E, AG_ACT);
    moe_routed r = moe_run_route(REF, lg.r, T, E, k, norm), d = moe_run_route(DEV, lg.d, T, E, k, norm);
    int32_t *ids = dfl_malloc((size_t)(n ? n : 1) * 4);
    float *w = dfl_malloc((size_t)(n ? n : 1) * 4);
    moe_oracle(ids, w, hl, T, E, k, norm);
    char what[96];
    snprintf(what, sizeof what, "moe_route T %d E %d k %d%s%s", (int)T, (int)E, (int)k, norm ? " norm" : "",
             tied ? " tied" : "");
    /* the CPU and the device against the oracle's experts and listing */
    int bad_r = moe_listing_bad(r.off, r.rows, r.pos, ids, T, E, k);
    int bad_d = moe_listing_bad(d.off, d.rows, d.pos, ids, T, E, k);
    T_CHECKF(bad_r == 0, "%s: CPU: %d pairs not where the oracle's experts put them", what, bad_r);
    T_CHECKF(bad_d == 0, "%s: device: %d pairs not where the oracle's experts put them", what, bad_d);
    /* the device against the CPU: the listing bit for bit */
    T_CHECKF(memcmp(r.off, d.off, (size_t)(E + 1) * 8) == 0, "%s: offsets differ", what);
    T_CHECKF(memcmp(r.rows, d.rows, (size_t)n * 4) == 0 && memcmp(r.pos, d.pos, (size_t)n * 4) == 0,
             "%s: rows or pos differ", what);
    int finite = 1, same = 0;
    for (int64_t i = 0; i < n; i++) {
        finite &= isfinite(d.w[i]) != 0;
        same += memcmp(&d.w[i], &r.w[i], 4) == 0;
    }
    double e = t_nmse_f32(d.w, r.w, n), eo = t_nmse_f32(r.w, w, n);
    printf("  nmse %-40s wts %.2e (limit %.0e), %d of %d equal bits; CPU vs double %.2e\n", what, e, NMSE_F32,
           same, (int)n, eo);
    T_CHECKF(finite && e <= NMSE_F32, "%s: wts nmse %.3g%s", what, e, finite ? "" : ", non-finite values");
    T_CHECKF(eo <= NMSE_F32, "%s: CPU wts against the double softmax: nmse %.3g", what, eo);
    ag_free(&lg);
    moe_routed_free(&r), moe_routed_free(&d);
    free(hl), free(ids), free(w);
}

/* NaN and infinite logits: the p of such a row are all NaN (the CPU's
 * formulas), and both backends then take experts 0..k-1 with NaN weights;
 * the other rows are unaffected. */
static void moe_route_nonfinite(void) {
    const int64_t T = 5, E = 12, k = 3;
    float *hl = moe_logits(T, E, 0);
    hl[1 * E + 7] = NAN;       /* row 1: one NaN */
    hl[2 * E + 0] = NAN;       /* row 2: NaN first (the CPU's max is NaN) */
    hl[3 * E + 9] = INFINITY;  /* row 3: +inf - +inf */
    for (int64_t e = 0; e < E; e++) hl[4 * E + e] = -INFINITY; /* row 4: all -inf */
    ag_pair lg = ag_new(hl, T * E, AG_ACT);
    for (int norm = 0; norm < 2; norm++) {
        moe_routed r = moe_run_route(REF, lg.r, T, E, k, norm), d = moe_run_route(DEV, lg.d, T, E, k, norm);
        T_CHECK(memcmp(r.off, d.off, (size_t)(E + 1) * 8) == 0);
        T_CHECK(memcmp(r.rows, d.rows, (size_t)(T * k) * 4) == 0 && memcmp(r.pos, d.pos, (size_t)(T * k) * 4) == 0);
        int32_t ids[15];
        float w[15];
        moe_oracle(ids, w, hl, 1, E, k, norm); /* row 0 is finite */
        for (int64_t t = 1; t < T; t++)
            for (int64_t j = 0; j < k; j++) ids[t * k + j] = (int32_t)j;
        T_CHECK(moe_listing_bad(r.off, r.rows, r.pos, ids, T, E, k) == 0);
        T_CHECK(moe_listing_bad(d.off, d.rows, d.pos, ids, T, E, k) == 0);
        int nan_ok = 1;
        for (int64_t i = k; i < T * k; i++) nan_ok &= isnan(r.w[i]) && isnan(d.w[i]);
        T_CHECKF(nan_ok, "norm %d: the weights of the non-finite rows are not NaN on both", norm);
        T_CHECK(t_nmse_f32(d.w, r.w, k) <= NMSE_F32 && t_nmse_f32(r.w, w, k) <= NMSE_F32);
        moe_routed_free(&r), moe_routed_free(&d);
    }
    ag_free(&lg);
    free(hl);
}

static void moe_route_agrees(void) {
    moe_route_case(0, 8, 2, 1, 0);     /* no tokens: offsets all 0 */
    moe_route_case(1, 8, 1, 0, 0);
    moe_route_case(1, 8, 8, 1, 1);     /* k = E */
    moe_route_case(37, 60, 2, 0, 0);
    moe_route_case(37, 60, 8, 1, 1);
    moe_route_case(64, 8, 2, 1, 1);
    moe_route_case(300, 128, 8, 1, 0); /* Qwen3-30B-A3B; 2400 pairs: three chunks of the listing */
    moe_route_case(300, 128, 8, 0, 1);
    moe_route_case(257, 256, 8, 1, 0); /* Qwen3.5-35B-A3B */
    moe_route_case(129, 512, 10, 1, 1); /* Qwen3.5-397B */
    moe_route_case(129, 512, 10, 0, 0);
    moe_route_case(1500, 60, 1, 0, 1); /* one expert a token, two chunks */
    moe_route_case(2100, 60, 4, 1, 0); /* nine chunks: two blocks of the listing's count */
    moe_route_nonfinite();
    if (AG_BIG) moe_route_case(16384, 512, 10, 1, 0); /* a long prefill: 163840 pairs */
}

/* n rows of H from a table of V rows (views at element offset `off`) */
static void gather_rows_case(int64_t n, int64_t H, int64_t V, int64_t off) {
    float *hin = ag_randn(V * H + off, 1);
    int32_t *rows = dfl_malloc((size_t)(n ? n : 1) * 4);
    for (int64_t i = 0; i < n; i++) rows[i] = (int32_t)dfl_rng_below(&AG_RNG, (uint64_t)V);
    ag_pair in = ag_new(hin, V * H + off, AG_ACT), r = ag_new(rows, n, AG_I32), out = ag_new(NULL, n * H + off, AG_ACT);
    REF->gather_rows(AG_VIEW(REF, out.r, off), AG_VIEW(REF, in.r, off), r.r, n, H);
    DEV->gather_rows(AG_VIEW(DEV, out.d, off), AG_VIEW(DEV, in.d, off), r.d, n, H);
    char what[64];
    snprintf(what, sizeof what, "gather_rows n %d H %d at +%d", (int)n, (int)H, (int)off);
    ag_check(what, &out, 0.0); /* a gather of bf16 values: exact */
    ag_free(&in), ag_free(&r), ag_free(&out);
    free(hin), free(rows);
}

static void gather_rows_agrees(void) {
    gather_rows_case(0, 64, 5, 0);
    gather_rows_case(296, 64, 37, 0); /* 16-byte path, rows repeated */
    gather_rows_case(101, 37, 20, 0); /* odd H: scalar */
    gather_rows_case(50, 64, 20, 3);  /* views not 16-byte aligned: scalar */
}

/* x[T, H] += the k listed expert rows of a CPU routing (E experts),
 * weighted, and the gated shared expert when `shared` */
static void moe_combine_case(int64_t T, int64_t E, int64_t k, int64_t H, int shared) {
    const int64_t n = T * k;
    float *hl = moe_logits(T, E, 0);
    ag_pair lg = ag_new(hl, T * E, AG_ACT);
    moe_routed rt = moe_run_route(REF, lg.r, T, E, k, 1);
    float *hy = ag_randn(n * H, 1), *hs = ag_randn(T * H, 1), *hg = ag_randn(T, 2);
    ag_pair pos = ag_new(rt.pos, n, AG_I32), w = ag_new(rt.w, n, AG_F32), y = ag_new(hy, n * H, AG_ACT);
    ag_pair sh = ag_new(hs, T * H, AG_ACT), sg = ag_new(hg, T, AG_ACT), x = ag_grad(T * H, AG_ACT, 1.0);
    REF->moe_combine(x.r, y.r, pos.r, w.r, shared ? sh.r : NULL, shared ? sg.r : NULL, T, k, H);
    DEV->moe_combine(x.d, y.d, pos.d, w.d, shared ? sh.d : NULL, shared ? sg.d : NULL, T, k, H);
    char what[64];
    snprintf(what, sizeof what, "moe_combine T %d k %d H %d%s", (int)T, (int)k, (int)H, shared ? " shared" : "");
    ag_check(what, &x, NMSE_ROUND);
    ag_free(&lg), ag_free(&pos), ag_free(&w), ag_free(&y), ag_free(&sh), ag_free(&sg), ag_free(&x);
    moe_routed_free(&rt);
    free(hl), free(hy), free(hs), free(hg);
}

static void moe_combine_agrees(void) {
    moe_combine_case(0, 8, 2, 64, 1);
    moe_combine_case(1, 8, 2, 64, 0);
    moe_combine_case(37, 60, 8, 64, 0);  /* 16-byte path */
    moe_combine_case(37, 60, 8, 64, 1);
    moe_combine_case(45, 128, 8, 37, 1); /* odd H: scalar */
    moe_combine_case(20, 512, 10, 1040, 1); /* H over the threads of a block */
}

/* ---- matmul_grouped ---------------------------------------------------------------
 * The experts' products against the CPU (each group the matmul op on its
 * rows: tests/unit/test_ops_cpu.c checks that bit for bit), NMSE_ROUND:
 * every output is one f32 sum rounded to bf16 once. Under the emulation
 * (tests/emu) the cuBLAS calls are also counted, so each case states which
 * path it takes: 'G' one grouped call, 'F' one cublasGemmEx per group with
 * rows (the fallback), '0' no GEMM at all. DFLASH_CUDA_NO_GROUPED=1 turns
 * every 'G' into 'F'. */
extern void dfl_emu_grouped_not_supported(int on) __attribute__((weak));
extern void dfl_emu_blas_calls(unsigned long *gemm, unsigned long *grouped) __attribute__((weak));

typedef struct {
    const char *name;
    const int64_t *rows; /* per group */
    int64_t G, K, N;
    int64_t w_stride, w_off; /* group e's weights at w_off + e * w_stride */
    int64_t view;            /* in and out are views at this element offset */
    char path;
} grouped_shape;

static void grouped_case(const grouped_shape *s) {
    int64_t *off = dfl_malloc((size_t)(s->G + 1) * 8), used = 0;
    off[0] = 0;
    for (int64_t e = 0; e < s->G; e++) off[e + 1] = off[e] + s->rows[e], used += s->rows[e] > 0;
    const int64_t R = off[s->G], v = s->view, K = s->K, N = s->N;
    const int64_t nw = s->G ? s->w_off + (s->G - 1) * s->w_stride + N * K : 0;
    const int64_t no = R * N + v + 8; /* and 8 values after the rows, which must keep their start values */
    float *hx = ag_randn(R * K + v, 1), *hw = ag_randn(nw, 0.2), *ho = ag_randn(no, 1);
    ag_pair x = ag_new(hx, R * K + v, AG_ACT), w = ag_new(hw, nw, AG_ACT);
    const int no_grouped = getenv("DFLASH_CUDA_NO_GROUPED") && strcmp(getenv("DFLASH_CUDA_NO_GROUPED"), "0") != 0;
    const char path = s->path == 'G' && no_grouped ? 'F' : s->path;
    for (int acc = 0; acc < 2; acc++) {
        ag_pair o = ag_new(ho, no, AG_ACT); /* random start values: overwritten, or added to */
        unsigned long g0 = 0, q0 = 0, g1 = 0, q1 = 0;
        if (dfl_emu_blas_calls) dfl_emu_blas_calls(&g0, &q0);
        REF->matmul_grouped(AG_VIEW(REF, o.r, v), AG_VIEW(REF, x.r, v), AG_VIEW(REF, w.r, s->w_off),
                            REF->wt_bytes == 2 ? DFL_BF16 : DFL_F32, off, s->G, s->w_stride, K, N, acc);
        DEV->matmul_grouped(AG_VIEW(DEV, o.d, v), AG_VIEW(DEV, x.d, v), AG_VIEW(DEV, w.d, s->w_off),
                            DEV->wt_bytes == 2 ? DFL_BF16 : DFL_F32, off, s->G, s->w_stride, K, N, acc);
        char what[96];
        snprintf(what, sizeof what, "grouped %s%s", s->name, acc ? " (acc)" : "");
        ag_check(what, &o, NMSE_ROUND);
        if (dfl_emu_blas_calls) {
            dfl_emu_blas_calls(&g1, &q1);
            const unsigned long gemms = path == 'F' && K > 0 ? (unsigned long)used : 0, grouped = path == 'G';
            T_CHECKF(g1 - g0 == gemms && q1 - q0 == grouped,
                     "%s: %lu cublasGemmEx and %lu grouped calls, expected %lu and %lu (path %c)", what, g1 - g0,
                     q1 - q0, gemms, grouped, path);
        }
        ag_free(&o);
    }
    ag_free(&x), ag_free(&w);
    free(off), free(hx), free(hw), free(ho);
}

static void moe_matmul_grouped_agrees(void) {
    static const int64_t gaps[] = {0, 5, 0, 3, 17, 1, 0}, one[] = {40}, none[] = {0, 0, 0};
    static const int64_t mixed[] = {3, 0, 9, 2, 1};
    int64_t many[128];
    for (int e = 0; e < 128; e++) many[e] = (int64_t)dfl_rng_below(&AG_RNG, 5); /* 0..4 rows: some empty */
    many[0] = 2, many[127] = 3;
    const int64_t I = 24, H = 40; /* a stacked [E, 2I, H] gate_up tensor: gate rows, then up rows */
    const grouped_shape shapes[] = {
        {"empty groups first, inside, last; odd K, N", gaps, 7, 37, 29, 29 * 37, 0, 0, 'G'},
        {"one group", one, 1, 64, 48, 64 * 48, 0, 0, 'G'},
        {"128 groups of 0-4 rows", many, 128, 64, 40, 64 * 40, 0, 0, 'G'},
        {"gate rows of [E, 2I, H]", mixed, 5, H, I, 2 * I * H, 0, 0, 'G'},
        {"up rows of [E, 2I, H]", mixed, 5, H, I, 2 * I * H, I * H, 0, 'G'},
        {"K, N even, not multiples of 8", mixed, 5, 38, 30, 2 * 38 * 30 + 2, 0, 0, 'G'},
        {"views at +1 (not 16-byte aligned)", mixed, 5, 64, 40, 64 * 40, 0, 1, 'F'},
        {"no groups", none, 0, 16, 8, 128, 0, 0, '0'},
        {"every group empty", none, 3, 16, 8, 128, 0, 0, '0'},
        {"K = 0", mixed, 5, 0, 8, 0, 0, 0, 'F'},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) grouped_case(&shapes[i]);
    if (dfl_emu_grouped_not_supported) { /* cuBLAS without the grouped call for these types: the fallback */
        dfl_emu_grouped_not_supported(1);
        const grouped_shape fb[] = {
            {"NOT_SUPPORTED: empty groups, odd K, N", gaps, 7, 37, 29, 29 * 37, 0, 0, 'F'},
            {"NOT_SUPPORTED: up rows of [E, 2I, H]", mixed, 5, H, I, 2 * I * H, I * H, 0, 'F'},
            {"NOT_SUPPORTED: 128 groups", many, 128, 64, 40, 64 * 40, 0, 0, 'F'},
        };
        for (size_t i = 0; i < sizeof fb / sizeof *fb; i++) grouped_case(&fb[i]);
        dfl_emu_grouped_not_supported(0);
    }
    if (AG_BIG) { /* Qwen3-30B-A3B's down projections: 128 experts, 768 -> 2048, ~512 rows each (NOTES.md) */
        int64_t big[128];
        for (int e = 0; e < 128; e++) big[e] = 384 + (int64_t)dfl_rng_below(&AG_RNG, 257);
        big[5] = 0, big[77] = 1;
        const grouped_shape b = {"Qwen3-30B-A3B down", big, 128, 768, 2048, 768 * 2048, 0, 0, 'G'};
        grouped_case(&b);
    }
}

/* ---- all ------------------------------------------------------------------------- */

/* DFLASH_TEST_ONLY=word[,word...] runs only the tests whose name contains
 * one of the words (the GPU script uses it to run the attention and MoE
 * tests under compute-sanitizer). */
static int ag_wanted(const char *name) {
    const char *only = getenv("DFLASH_TEST_ONLY");
    if (!only || !*only) return 1;
    for (const char *w = only; *w;) {
        size_t n = strcspn(w, ",");
        char word[64];
        snprintf(word, sizeof word, "%.*s", (int)(n < sizeof word - 1 ? n : sizeof word - 1), w);
        if (n && strstr(name, word)) return 1;
        w += n + (w[n] == ',');
    }
    return 0;
}
#define AG_RUN(fn) \
    do { if (ag_wanted(#fn)) T_RUN(fn); } while (0)

static void ops_agree_all(uint64_t seed) {
    dfl_rng_seed(&AG_RNG, seed);
    AG_RUN(conversions_round_to_nearest_even);
    AG_RUN(matmul_agrees);
    AG_RUN(matmul_bwd_agrees);
    AG_RUN(rmsnorm_agrees);
    AG_RUN(rope_agrees);
    AG_RUN(qk_norm_rope_agrees);
    AG_RUN(elementwise_agrees);
    AG_RUN(embed_agrees);
    AG_RUN(attn_causal_agrees);
    AG_RUN(attn_causal_window_agrees);
    AG_RUN(attn_dflash_agrees);
    AG_RUN(attn_dflash_window_oracle);
    AG_RUN(attn_dflash_window_agrees);
    AG_RUN(attn_dflash_bwd_without_blocks);
    AG_RUN(lmhead_agrees);
    AG_RUN(views_agree);
    AG_RUN(host_memory_agrees);
    AG_RUN(copy_2d_agrees);
    AG_RUN(adamw_agrees);
    AG_RUN(moe_route_agrees);
    AG_RUN(gather_rows_agrees);
    AG_RUN(moe_combine_agrees);
    AG_RUN(moe_matmul_grouped_agrees); /* "moe": tests/gpu/run.sh runs it under compute-sanitizer */
    AG_RUN(gptoss_agrees);
}

#endif
