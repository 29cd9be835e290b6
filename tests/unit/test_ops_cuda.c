/* test_ops_cuda.c: the CUDA op table against the CPU reference, op by op
 * (tests/ops_agree.h says what is compared and with which limits).
 *
 * Linked three ways (Makefile): with the real CUDA backend (a GPU runs the
 * agreement tests; without a GPU or driver, the one check is that asking
 * for "cuda" fails cleanly with exit code 69 and CUDA's reason, and the
 * CPU still works), and as test_ops_cuda_emu with the kernels compiled for
 * the CPU against tests/emu, which runs the agreement tests everywhere.
 * DFLASH_TEST_BIG=1 adds the real-size shapes (tests/gpu/run.sh). */
#include "ops_agree.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int unavail_code;
static char unavail_msg[1024];

static void cuda_unavailable_reported_cleanly(void) {
    T_CHECKF(unavail_code == DFL_EX_UNAVAIL, "dfl_ops_get(\"cuda\") returned %d, not %d", unavail_code,
             DFL_EX_UNAVAIL);
    T_CHECKF(strstr(unavail_msg, "cuda") != NULL && strlen(unavail_msg) > 20, "message: '%s'", unavail_msg);
    const dfl_ops *o = NULL;
    T_CHECK(dfl_ops_get("cuda:1", &o) == DFL_EX_UNAVAIL && o == NULL);
    T_CHECK(dfl_ops_get("cpu", &o) == 0 && o && !strcmp(o->name, "cpu"));
}

/* ---- Qwen3.5 hybrid targets: sigmoid_mul, conv1d_silu, gated_delta -------------------
 * Limits: NMSE_ROUND for every bf16 output (each is one f32 computation
 * rounded once; the CPU keeps f32), NMSE_F32 for the f32 states of the
 * delta rule (the same f32 recurrence, sums over dk in another order). */

/* cu of a packed batch: first row `first`, then the lengths */
static int32_t *gdn_cu(const int32_t *lens, int64_t nseq, int32_t first) {
    int32_t *cu = dfl_malloc((size_t)(nseq + 1) * 4);
    cu[0] = first;
    for (int64_t s = 0; s < nseq; s++) cu[s + 1] = cu[s] + lens[s];
    return cu;
}

/* Rows [cu[0], cu[nseq]) of an output of `width` per row by nmse; the rows
 * before and after (in no sequence) must keep their start values, bit for
 * bit, and count in neither sum. */
static void check_seq_rows(const char *what, const ag_pair *p, const int32_t *cu, int64_t nseq, int64_t width,
                           double limit) {
    float *r = ag_get(REF, p->r, p->n, p->kind), *d = ag_get(DEV, p->d, p->n, p->kind);
    const int64_t lo = cu[0] * width, hi = cu[nseq] * width;
    int finite = 1, kept = 1;
    for (int64_t i = lo; i < hi; i++) finite &= isfinite(d[i]) != 0;
    for (int64_t i = 0; i < p->n; i++)
        if (i < lo || i >= hi) kept &= memcmp(&r[i], &d[i], 4) == 0;
    double e = t_nmse_f32(d + lo, r + lo, hi - lo);
    printf("  nmse %-28s %.2e (limit %.0e)\n", what, e, limit);
    T_CHECKF(finite && e <= limit, "%s: nmse %.3g, limit %.0e%s", what, e, limit, finite ? "" : ", non-finite values");
    T_CHECKF(kept, "%s: a row outside every sequence was written", what);
    free(r), free(d);
}

static void sigmoid_mul_case(int64_t n, int64_t off) {
    float *hx = ag_randn(n + off, 1), *hg = ag_randn(n + off, 2);
    ag_pair x = ag_new(hx, n + off, AG_ACT), g = ag_new(hg, n + off, AG_ACT), out = ag_grad(n + off, AG_ACT, 1);
    REF->sigmoid_mul(AG_VIEW(REF, out.r, off), AG_VIEW(REF, x.r, off), AG_VIEW(REF, g.r, off), n);
    DEV->sigmoid_mul(AG_VIEW(DEV, out.d, off), AG_VIEW(DEV, x.d, off), AG_VIEW(DEV, g.d, off), n);
    char what[64];
    snprintf(what, sizeof what, "sigmoid_mul n %d at +%d", (int)n, (int)off);
    ag_check(what, &out, NMSE_ROUND);
    REF->sigmoid_mul(x.r, x.r, g.r, n + off); /* out aliases x */
    DEV->sigmoid_mul(x.d, x.d, g.d, n + off);
    ag_check("sigmoid_mul (out = x, aliased)", &x, NMSE_ROUND);
    ag_free(&x), ag_free(&g), ag_free(&out);
    free(hx), free(hg);
}

static void sigmoid_mul_agrees(void) {
    sigmoid_mul_case(1003, 0); /* vector body and scalar tail */
    sigmoid_mul_case(1024, 0);
    sigmoid_mul_case(301, 3); /* a view that is not 16-byte aligned: scalar path */
}

/* Sequences `lens` from row `first` of T rows (rows outside every sequence
 * keep the output's random start values on both sides); hist when given
 * (nseq 1) is random. */
static void conv_case(const int32_t *lens, int64_t nseq, int32_t first, int64_t T, int64_t C, int64_t K, int hist) {
    int32_t *cu = gdn_cu(lens, nseq, first);
    DFL_ASSERT(cu[nseq] <= T);
    float *hi = ag_randn(T * C, 1), *hw = ag_randn(C * K, 0.5), *hh = hist ? ag_randn((K - 1) * C, 1) : NULL;
    ag_pair in = ag_new(hi, T * C, AG_ACT), w = ag_new(hw, C * K, AG_ACT), c = ag_new(cu, nseq + 1, AG_I32);
    ag_pair h = ag_new(hh, hist ? (K - 1) * C : 1, AG_ACT), out = ag_grad(T * C, AG_ACT, 1);
    REF->conv1d_silu(out.r, in.r, hist ? h.r : NULL, w.r, c.r, nseq, T, C, K);
    DEV->conv1d_silu(out.d, in.d, hist ? h.d : NULL, w.d, c.d, nseq, T, C, K);
    char what[96];
    snprintf(what, sizeof what, "conv1d_silu %d seqs T %d C %d K %d%s", (int)nseq, (int)T, (int)C, (int)K,
             hist ? " hist" : "");
    check_seq_rows(what, &out, cu, nseq, C, NMSE_ROUND);
    ag_free(&in), ag_free(&w), ag_free(&c), ag_free(&h), ag_free(&out);
    free(cu), free(hi), free(hw), free(hh);
}

static void conv1d_silu_agrees(void) {
    /* rows per thread are 8 here (DFLASH_CUDA_CONV_ROWS, main): sequences
     * of 1 row, sequences and empty ones starting inside a tile, one over
     * many tiles */
    const int32_t a[] = {1, 70, 3, 0, 150, 2}, b[] = {9, 1, 30};
    conv_case(a, 6, 0, 226, 40, 4, 0);  /* 16-byte path, K 4 */
    conv_case(a, 6, 0, 226, 37, 4, 0);  /* odd C: scalar path */
    conv_case(b, 3, 5, 47, 64, 7, 0);   /* K 7 (window of 8); rows 0-4 and 45-46 in no sequence */
    conv_case(b, 3, 0, 40, 21, 3, 0);   /* K 3, scalar */
    conv_case(b, 3, 0, 40, 16, 1, 0);   /* K 1: no history at all */
    const int32_t t2[] = {2}, t9[] = {9}, t1[] = {1};
    conv_case(t2, 1, 0, 2, 40, 4, 1);   /* hist, T shorter than K-1 */
    conv_case(t9, 1, 0, 9, 40, 4, 1);   /* hist, T longer than K-1 */
    conv_case(t1, 1, 0, 1, 37, 4, 1);   /* hist, one row, scalar */
    conv_case(t9, 1, 0, 9, 24, 6, 1);   /* hist, K 6 */
    if (AG_BIG) { /* a Qwen3.5-27B GDN layer's channels, packed prefill */
        const int32_t e[] = {2048, 1000, 1};
        conv_case(e, 3, 0, 3049, 10240, 4, 0);
    }
}

/* Inputs of gated_delta with the scales of the brief: q, k, v ~ N(0,1)
 * before the l2norms, b, a ~ N(0,1) (a shifted by amean: -6 makes slow
 * decays exp(g) ~ 0.98, long memories; 0 gives exp(g) ~ 0.01-0.5), A_log =
 * log U(1,16), dt_bias ~ N(0,0.5). */
typedef struct {
    ag_pair qkv, ba, A, dt, out;
} gdn_in;

static gdn_in gdn_inputs(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, double amean) {
    const int64_t C = 2 * Hk * dk + Hv * dv;
    float *hx = ag_randn(T * C, 1), *hba = ag_randn(T * 2 * Hv, 1);
    float *hA = dfl_malloc((size_t)Hv * 4), *hdt = ag_randn(Hv, 0.5);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < Hv; j++) hba[t * 2 * Hv + Hv + j] = bf16_round(hba[t * 2 * Hv + Hv + j] + (float)amean);
    for (int64_t j = 0; j < Hv; j++) hA[j] = logf((float)(1.0 + 15.0 * dfl_rng_uniform(&AG_RNG)));
    gdn_in g = {ag_new(hx, T * C, AG_ACT), ag_new(hba, T * 2 * Hv, AG_ACT), ag_new(hA, Hv, AG_F32),
                ag_new(hdt, Hv, AG_F32), ag_grad(T * Hv * dv, AG_ACT, 0.3)};
    free(hx), free(hba), free(hA), free(hdt);
    return g;
}

static void gdn_free(gdn_in *g) { ag_free(&g->qkv), ag_free(&g->ba), ag_free(&g->A), ag_free(&g->dt), ag_free(&g->out); }

/* a packed batch, no state */
static void gdn_case(const int32_t *lens, int64_t nseq, int32_t first, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                     int64_t dv, double amean) {
    int32_t *cu = gdn_cu(lens, nseq, first);
    DFL_ASSERT(cu[nseq] <= T);
    gdn_in g = gdn_inputs(T, Hk, Hv, dk, dv, amean);
    ag_pair c = ag_new(cu, nseq + 1, AG_I32);
    REF->gated_delta(g.out.r, NULL, NULL, g.qkv.r, g.ba.r, g.A.r, g.dt.r, c.r, nseq, T, Hk, Hv, dk, dv);
    DEV->gated_delta(g.out.d, NULL, NULL, g.qkv.d, g.ba.d, g.A.d, g.dt.d, c.d, nseq, T, Hk, Hv, dk, dv);
    char what[96];
    snprintf(what, sizeof what, "gated_delta %d seqs Hk %d Hv %d %dx%d a%+.0f", (int)nseq, (int)Hk, (int)Hv, (int)dk,
             (int)dv, amean);
    check_seq_rows(what, &g.out, cu, nseq, Hv * dv, NMSE_ROUND);
    gdn_free(&g), ag_free(&c);
    free(cu);
}

/* one sequence of T rows with a start state (or none) and the steps */
static void gdn_state_case(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int with_state, double amean) {
    const int32_t len = (int32_t)T;
    int32_t *cu = gdn_cu(&len, 1, 0);
    gdn_in g = gdn_inputs(T, Hk, Hv, dk, dv, amean);
    ag_pair c = ag_new(cu, 2, AG_I32);
    float *hs = ag_randn(Hv * dk * dv, 0.5);
    ag_pair st = ag_new(hs, Hv * dk * dv, AG_F32), steps = ag_grad(T * Hv * dk * dv, AG_F32, 1);
    REF->gated_delta(g.out.r, with_state ? st.r : NULL, steps.r, g.qkv.r, g.ba.r, g.A.r, g.dt.r, c.r, 1, T, Hk, Hv, dk,
                     dv);
    DEV->gated_delta(g.out.d, with_state ? st.d : NULL, steps.d, g.qkv.d, g.ba.d, g.A.d, g.dt.d, c.d, 1, T, Hk, Hv,
                     dk, dv);
    char what[96];
    const char *how = with_state ? "state" : "no state";
    snprintf(what, sizeof what, "gated_delta T %d %dx%d %s: out", (int)T, (int)dk, (int)dv, how);
    ag_check(what, &g.out, NMSE_ROUND);
    snprintf(what, sizeof what, "gated_delta T %d %dx%d %s: steps", (int)T, (int)dk, (int)dv, how);
    ag_check(what, &steps, NMSE_F32);
    if (with_state) {
        snprintf(what, sizeof what, "gated_delta T %d %dx%d: final state", (int)T, (int)dk, (int)dv);
        ag_check(what, &st, NMSE_F32);
        /* the last step is the final state, bit for bit */
        float *fs = ag_get(DEV, st.d, Hv * dk * dv, AG_F32), *fl = ag_get(DEV, steps.d, T * Hv * dk * dv, AG_F32);
        T_CHECK(memcmp(fs, fl + (T - 1) * Hv * dk * dv, (size_t)(Hv * dk * dv) * 4) == 0);
        free(fs), free(fl);
    }
    /* every step's state, each checked alone: one wrong row cannot hide in the sum */
    float *r = ag_get(REF, steps.r, T * Hv * dk * dv, AG_F32), *d = ag_get(DEV, steps.d, T * Hv * dk * dv, AG_F32);
    double worst = 0;
    for (int64_t t = 0; t < T; t++) {
        double e = t_nmse_f32(d + t * Hv * dk * dv, r + t * Hv * dk * dv, Hv * dk * dv);
        worst = e > worst ? e : worst;
    }
    printf("  nmse %-28s %.2e (limit %.0e)\n", "  worst single step", worst, NMSE_F32);
    T_CHECKF(worst <= NMSE_F32, "worst step nmse %.3g", worst);
    gdn_free(&g), ag_free(&c), ag_free(&st), ag_free(&steps);
    free(cu), free(hs), free(r), free(d);
}

static void gated_delta_agrees(void) {
    /* packed, sequences of 1 row and longer, GQA 3, odd head dims (12 x 20:
     * 16 lanes' rows, half of them padding; 20 columns over two warps) */
    const int32_t a[] = {1, 37, 5, 70}, b[] = {33, 1, 17};
    gdn_case(a, 4, 0, 113, 2, 6, 12, 20, 0);
    gdn_case(a, 4, 0, 113, 2, 6, 12, 20, -6);
    gdn_case(b, 3, 3, 56, 1, 2, 64, 21, -6);  /* rows 0-2, 54-55 in no sequence; odd row stride: scalar loads */
    gdn_case(b, 3, 0, 51, 2, 4, 64, 16, -6);  /* 16-byte loads, R 8 */
    gdn_case(b, 3, 0, 51, 1, 3, 40, 8, 0);    /* dk 40 of 64 lanes' rows */
    const int32_t c[] = {1, 40, 9};
    gdn_case(c, 3, 0, 50, 2, 4, 128, 128, -6); /* the Qwen3.5 head: R 16, 16-byte loads */
    gdn_case(c, 3, 0, 50, 1, 2, 256, 24, -6);  /* 16 lanes a group */
    /* one sequence with state and steps (a verify block of 16, or 1) */
    gdn_state_case(16, 2, 6, 12, 20, 1, -6);
    gdn_state_case(16, 2, 6, 12, 21, 1, 0);    /* dv odd: scalar f32 state accesses */
    gdn_state_case(1, 1, 2, 12, 20, 1, -6);
    gdn_state_case(16, 2, 4, 128, 128, 1, -6); /* 16-byte state accesses */
    gdn_state_case(9, 2, 4, 128, 128, 0, -6);  /* steps without a start state */
    if (AG_BIG) { /* Qwen3.5-27B: Hk 16, Hv 48, 128 x 128, a packed prefill and a verify block */
        const int32_t e[] = {2048, 1000, 1};
        gdn_case(e, 3, 0, 3049, 16, 48, 128, 128, -6);
        gdn_state_case(16, 16, 48, 128, 128, 1, -6);
    }
}

/* ---- the emulation's own checks (test_ops_cuda_emu only) ------------------------
 * Defined by tests/emu (cuda_emu.cpp, emu_toys.cpp); NULL (weak) in the
 * builds against the real CUDA backend or none, where these tests are
 * skipped. */
extern void dfl_emu_set_schedule(unsigned seed) __attribute__((weak));
extern void dfl_emu_race_fatal(int on) __attribute__((weak));
extern unsigned long dfl_emu_races(void) __attribute__((weak));
extern int dfl_emu_toy(const char *name, int fixed, float *out, int n) __attribute__((weak));
extern void dfl_emu_alloc_limit(size_t bytes) __attribute__((weak));
extern unsigned long dfl_emu_alloc_refused(void) __attribute__((weak));
extern unsigned long dfl_emu_stream_syncs(void) __attribute__((weak));

/* bytes of device outputs, appended */
typedef struct {
    unsigned char *p;
    size_t n;
} bytes;

static void take(bytes *b, const void *dev, int64_t n, ag_kind kind) {
    size_t sz = (size_t)n * (kind == AG_ACT ? 2 : 4);
    b->p = dfl_realloc(b->p, b->n + sz + 1);
    if (kind == AG_ACT) DEV->act_to_bf16((uint16_t *)(b->p + b->n), dev, n);
    else DEV->download(b->p + b->n, dev, sz);
    b->n += sz;
}

static void *dput(const void *host, int64_t n, ag_kind kind) { return ag_put(DEV, host, n, kind); }

/* One DFlash attention case on the device: random q, k, v, dout of shape s
 * (which it takes over), room for out, lse, dq, dk, dv. */
typedef struct {
    dflash_shape s;
    int64_t QN, KN;
    void *q, *k, *v, *dout, *blk, *out, *lse, *dq, *dk, *dv;
} dflash_dev;

static dflash_dev dflash_dev_new(dflash_shape s) {
    dflash_dev c = {s, s.nblk * s.B * s.Hq * s.D, s.NK * s.Hkv * s.D, NULL, NULL, NULL, NULL, NULL,
                    NULL, NULL, NULL, NULL, NULL};
    float *hq = ag_randn(c.QN, 1), *hk = ag_randn(c.KN, 1), *hv = ag_randn(c.KN, 1), *hd = ag_randn(c.QN, 1);
    c.q = dput(hq, c.QN, AG_ACT), c.k = dput(hk, c.KN, AG_ACT), c.v = dput(hv, c.KN, AG_ACT);
    c.dout = dput(hd, c.QN, AG_ACT), c.blk = dput(s.blocks, s.nblk * 3, AG_I32);
    c.out = dput(NULL, c.QN, AG_ACT), c.lse = dput(NULL, s.nblk * s.B * s.Hq, AG_F32);
    c.dq = dput(NULL, c.QN, AG_ACT), c.dk = dput(NULL, c.KN, AG_ACT), c.dv = dput(NULL, c.KN, AG_ACT);
    free(hq), free(hk), free(hv), free(hd);
    return c;
}

static void dflash_dev_free(dflash_dev *c) {
    void *bufs[] = {c->q, c->k, c->v, c->dout, c->blk, c->out, c->lse, c->dq, c->dk, c->dv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) DEV->free(bufs[i]);
    free(c->s.blocks);
}

/* forward, then backward into dq, dk, dv (which it writes), under a
 * sliding window W (0: none) */
static void dflash_dev_run(dflash_dev *c, int64_t W) {
    const dflash_shape *s = &c->s;
    DEV->attn_dflash(c->out, c->lse, c->q, c->k, c->v, c->blk, s->nblk, s->B, s->NK, s->Hq, s->Hkv, s->D, W);
    DEV->attn_dflash_bwd(c->dq, c->dk, c->dv, c->dout, c->out, c->lse, c->q, c->k, c->v, c->blk, s->nblk, s->B,
                         s->NK, s->Hq, s->Hkv, s->D, W);
}

/* Every op with shared memory, warp collectives or a cross-thread order, on
 * fixed inputs, under the emulation's current schedule: all output bytes. */
static bytes schedule_run(void) {
    bytes b = {NULL, 0};
    dfl_rng_seed(&AG_RNG, 77);
    /* DFlash attention forward and backward: tensor cores (D 64; also on
     * wgmma, with the forward overlapped and not), simple (D 40), and a
     * sliding window of 20 (D 64: the tensor cores' window mode, tile lists
     * cut; mma.sync, then wgmma) */
    const int32_t ctx[] = {100, 80}, anc[] = {5, 3};
    for (int pass = 0; pass < 6; pass++) {
        if (pass == 2 || pass == 3 || pass == 5) setenv("DFLASH_CUDA_WGMMA", "1", 1);
        if (pass == 3) setenv("DFLASH_CUDA_WGMMA_PIPE", "0", 1);
        dflash_dev c = dflash_dev_new(dflash_layout(ctx, 2, anc, pass == 1 ? 5 : 16, 8, 2, pass == 1 ? 40 : 64));
        dflash_dev_run(&c, pass >= 4 ? 20 : 0);
        take(&b, c.out, c.QN, AG_ACT), take(&b, c.lse, c.s.nblk * c.s.B * c.s.Hq, AG_F32);
        take(&b, c.dq, c.QN, AG_ACT), take(&b, c.dk, c.KN, AG_ACT), take(&b, c.dv, c.KN, AG_ACT);
        dflash_dev_free(&c);
        unsetenv("DFLASH_CUDA_WGMMA"), unsetenv("DFLASH_CUDA_WGMMA_PIPE");
    }
    /* causal attention, tensor cores, G = 3 (D 64, also on wgmma with two
     * and three warpgroups, overlapped and not) and G = 6 (D 256); then a
     * window of 20 with the lse (D 64 on mma.sync, on wgmma with two
     * warpgroups overlapped and three not; D 256), and the lse without a
     * window (D 64) */
    for (int pass = 0; pass < 11; pass++) {
        const int32_t cu[] = {0, 17, 20, 84, 150};
        const int64_t T = 150, Hq = 6, Hkv = pass == 1 || pass == 8 ? 1 : 2, D = pass == 1 || pass == 8 ? 256 : 64;
        const int64_t W = pass >= 6 && pass < 10 ? 20 : 0;
        if (pass >= 2 && pass < 6) setenv("DFLASH_CUDA_WGMMA", pass % 2 ? "3" : "1", 1);
        if (pass >= 4 && pass < 6) setenv("DFLASH_CUDA_WGMMA_PIPE", "0", 1);
        if (pass == 7) setenv("DFLASH_CUDA_WGMMA", "1", 1);
        if (pass == 9) setenv("DFLASH_CUDA_WGMMA", "3", 1), setenv("DFLASH_CUDA_WGMMA_PIPE", "0", 1);
        float *hq = ag_randn(T * Hq * D, 1), *hk = ag_randn(T * Hkv * D, 1), *hv = ag_randn(T * Hkv * D, 1);
        void *q = dput(hq, T * Hq * D, AG_ACT), *k = dput(hk, T * Hkv * D, AG_ACT), *v = dput(hv, T * Hkv * D, AG_ACT);
        void *c = dput(cu, 5, AG_I32), *out = dput(NULL, T * Hq * D, AG_ACT), *lse = dput(NULL, T * Hq, AG_F32);
        const int with_lse = pass >= 6;
        DEV->attn_causal(out, with_lse ? lse : NULL, q, k, v, c, 4, T, Hq, Hkv, D, W);
        take(&b, out, T * Hq * D, AG_ACT);
        if (with_lse) take(&b, lse, T * Hq, AG_F32);
        DEV->free(q), DEV->free(k), DEV->free(v), DEV->free(c), DEV->free(out), DEV->free(lse);
        free(hq), free(hk), free(hv);
        unsetenv("DFLASH_CUDA_WGMMA"), unsetenv("DFLASH_CUDA_WGMMA_PIPE");
    }
    /* RMSNorm backward (per-warp shared rows), vector and scalar paths */
    for (int64_t dim = 37; dim <= 96; dim += 59) {
        const int64_t rows = 45;
        float *hx = ag_randn(rows * dim, 2), *hw = ag_randn(dim, 1), *hd = ag_randn(rows * dim, 1);
        void *x = dput(hx, rows * dim, AG_ACT), *w = dput(hw, dim, AG_ACT), *d = dput(hd, rows * dim, AG_ACT);
        void *out = dput(NULL, rows * dim, AG_ACT), *rstd = dput(NULL, rows, AG_F32);
        void *din = dput(NULL, rows * dim, AG_ACT), *dw = dput(NULL, dim, AG_F32);
        DEV->rmsnorm(out, rstd, x, w, rows, dim, 1e-6f);
        DEV->rmsnorm_bwd(din, dw, d, x, rstd, w, rows, dim);
        take(&b, out, rows * dim, AG_ACT), take(&b, din, rows * dim, AG_ACT), take(&b, dw, dim, AG_F32);
        DEV->free(x), DEV->free(w), DEV->free(d), DEV->free(out), DEV->free(rstd), DEV->free(din), DEV->free(dw);
        free(hx), free(hw), free(hd);
    }
    /* q/k norm + RoPE and its backward (per-warp shared rows; two head
     * groups of a token, the second part-full) */
    {
        const int64_t T = 21, nh = 12, d = 64, n = T * nh * d;
        float *hx = ag_randn(n, 2), *hw = ag_randn(d, 1), *hd = ag_randn(n, 1), inv[32];
        int32_t pos[21];
        for (int i = 0; i < 32; i++) inv[i] = (float)pow(1e4, -i / 32.0);
        for (int t = 0; t < 21; t++) pos[t] = 7 * t;
        void *x = dput(hx, n, AG_ACT), *w = dput(hw, d, AG_ACT), *dy = dput(hd, n, AG_ACT), *p = dput(pos, T, AG_I32);
        void *f = dput(inv, 32, AG_F32), *out = dput(NULL, n, AG_ACT), *rstd = dput(NULL, T * nh, AG_F32);
        void *din = dput(NULL, n, AG_ACT), *dw = dput(NULL, d, AG_F32);
        DEV->qk_norm_rope(out, rstd, x, w, 0, p, f, 1.0f, T, nh, d, 1e-6f);
        DEV->qk_norm_rope_bwd(din, dw, dy, x, rstd, w, p, f, 1.0f, T, nh, d);
        take(&b, out, n, AG_ACT), take(&b, rstd, T * nh, AG_F32), take(&b, din, n, AG_ACT), take(&b, dw, d, AG_F32);
        DEV->free(x), DEV->free(w), DEV->free(dy), DEV->free(p), DEV->free(f), DEV->free(out), DEV->free(rstd);
        DEV->free(din), DEV->free(dw);
        free(hx), free(hw), free(hd);
    }
    /* LM head: block reductions of the softmax statistics */
    {
        const int64_t N = 21, H = 40, V = 333;
        float *hh = ag_randn(N * H, 1), *ht = ag_randn(N * H, 1), *hw = ag_randn(V * H, 0.3);
        int32_t lab[21];
        for (int i = 0; i < 21; i++) lab[i] = (int32_t)dfl_rng_below(&AG_RNG, (uint64_t)V);
        void *h = dput(hh, N * H, AG_ACT), *th = dput(ht, N * H, AG_ACT), *w = dput(hw, V * H, AG_ACT);
        void *l = dput(lab, N, AG_I32), *loss = dput(NULL, N, AG_F32), *pred = dput(NULL, N, AG_I32);
        void *dh = dput(NULL, N * H, AG_ACT);
        DEV->lmhead_ce(loss, pred, dh, h, w, l, NULL, N, H, V);
        take(&b, loss, N, AG_F32), take(&b, pred, N, AG_I32), take(&b, dh, N * H, AG_ACT);
        DEV->lmhead_kl(loss, pred, NULL, dh, h, th, w, NULL, N, H, V);
        take(&b, loss, N, AG_F32), take(&b, pred, N, AG_I32), take(&b, dh, N * H, AG_ACT);
        DEV->free(h), DEV->free(th), DEV->free(w), DEV->free(l), DEV->free(loss), DEV->free(pred), DEV->free(dh);
        free(hh), free(ht), free(hw);
    }
    /* Gated DeltaNet: the lane-group butterflies of the delta rule (R 2 and
     * 16, with state and steps), the convolution's tiles, the gate */
    {
        const int32_t cu[] = {0, 1, 30, 37};
        gdn_in g = gdn_inputs(37, 2, 6, 12, 20, -6);
        void *c = dput(cu, 4, AG_I32);
        DEV->gated_delta(g.out.d, NULL, NULL, g.qkv.d, g.ba.d, g.A.d, g.dt.d, c, 3, 37, 2, 6, 12, 20);
        take(&b, g.out.d, 37 * 6 * 20, AG_ACT);
        gdn_free(&g);
        const int32_t one[] = {0, 6};
        g = gdn_inputs(6, 1, 2, 128, 128, -6);
        float *hs = ag_randn(2 * 128 * 128, 0.5);
        void *c1 = dput(one, 2, AG_I32), *st = dput(hs, 2 * 128 * 128, AG_F32), *steps = dput(NULL, 6 * 2 * 128 * 128, AG_F32);
        DEV->gated_delta(g.out.d, st, steps, g.qkv.d, g.ba.d, g.A.d, g.dt.d, c1, 1, 6, 1, 2, 128, 128);
        take(&b, g.out.d, 6 * 2 * 128, AG_ACT), take(&b, st, 2 * 128 * 128, AG_F32);
        take(&b, steps, 6 * 2 * 128 * 128, AG_F32);
        gdn_free(&g);
        float *hx = ag_randn(37 * 40, 1), *hw = ag_randn(40 * 4, 0.5);
        void *x = dput(hx, 37 * 40, AG_ACT), *w = dput(hw, 40 * 4, AG_ACT), *out = dput(NULL, 37 * 40, AG_ACT);
        DEV->conv1d_silu(out, x, NULL, w, c, 3, 37, 40, 4);
        take(&b, out, 37 * 40, AG_ACT);
        DEV->sigmoid_mul(out, x, out, 37 * 40);
        take(&b, out, 37 * 40, AG_ACT);
        DEV->free(c), DEV->free(c1), DEV->free(st), DEV->free(steps), DEV->free(x), DEV->free(w), DEV->free(out);
        free(hs), free(hx), free(hw);
    }
    /* mixture of experts: the routing's warp argmax, the listing's
     * per-warp counters (1500 pairs: two chunks), gather, combine */
    {
        const int64_t T = 150, E = 60, k = 10, H = 48, n = T * k;
        float *hl = moe_logits(T, E, 1), *hx = ag_randn(T * H, 1), *hs = ag_randn(T * H, 1), *hg = ag_randn(T, 2);
        void *lg = dput(hl, T * E, AG_ACT), *x = dput(hx, T * H, AG_ACT), *sh = dput(hs, T * H, AG_ACT);
        void *sg = dput(hg, T, AG_ACT), *rows = dput(NULL, n, AG_I32), *pos = dput(NULL, n, AG_I32);
        void *w = dput(NULL, n, AG_F32), *y = dput(NULL, n * H, AG_ACT);
        int64_t off[61];
        DEV->moe_route(off, rows, pos, w, lg, T, E, k, 1);
        DEV->gather_rows(y, x, rows, n, H);
        DEV->moe_combine(x, y, pos, w, sh, sg, T, k, H);
        take(&b, rows, n, AG_I32), take(&b, pos, n, AG_I32), take(&b, w, n, AG_F32), take(&b, x, T * H, AG_ACT);
        b.p = dfl_realloc(b.p, b.n + sizeof off);
        memcpy(b.p + b.n, off, sizeof off);
        b.n += sizeof off;
        DEV->free(lg), DEV->free(x), DEV->free(sh), DEV->free(sg), DEV->free(rows), DEV->free(pos), DEV->free(w);
        DEV->free(y);
        free(hl), free(hx), free(hs), free(hg);
    }
    /* sum of squares (block tree reductions) */
    {
        float *hx = ag_randn(5000, 1);
        void *x = dput(hx, 5000, AG_F32);
        double ss = DEV->sumsq(x, 5000);
        b.p = dfl_realloc(b.p, b.n + sizeof ss);
        memcpy(b.p + b.n, &ss, sizeof ss);
        b.n += sizeof ss;
        DEV->free(x);
        free(hx);
    }
    return b;
}

/* The emulation runs the threads of a block in other orders (tests/emu/
 * cuda_emu.h, "Schedules"); race-free kernels give the same bits in every
 * one. */
static void emu_schedules_give_identical_bits(void) {
    dfl_emu_set_schedule(0);
    bytes ref = schedule_run();
    T_CHECK(ref.n > 100000);
    const unsigned scheds[] = {1, 2, 3, 8};
    for (size_t i = 0; i < sizeof scheds / sizeof scheds[0]; i++) {
        dfl_emu_set_schedule(scheds[i]);
        bytes got = schedule_run();
        T_CHECKF(got.n == ref.n && memcmp(got.p, ref.p, ref.n) == 0, "schedule %u: outputs differ from schedule 0",
                 scheds[i]);
        free(got.p);
    }
    dfl_emu_set_schedule(0);
    free(ref.p);
}

/* Every kernel the agreement tests ran (with races fatal) was race-free. */
static void emu_kernels_race_free(void) { T_CHECKF(dfl_emu_races() == 0, "%lu races", dfl_emu_races()); }

/* the value toy row r, column c of stage i holds (emu_toys.cpp) */
static float toy_val(int i, int r, int c) {
    int idx = i * 512 + r * 8 + c;
    return bf16_round((float)(idx / 8) + (float)(idx % 8) / 8.0f);
}

/* expected toy outputs: lane L of warp w, register m, half j reads row
 * (w*32 + 8m + L/4) % 64, column 2(L%4) + j, summed over `stages` */
static void toy_expect(float *e, int stages) {
    for (int w = 0; w < 4; w++)
        for (int L = 0; L < 32; L++)
            for (int m = 0; m < 4; m++)
                for (int j = 0; j < 2; j++) {
                    float acc = 0;
                    for (int i = 0; i < stages; i++) acc += toy_val(i, (w * 32 + 8 * m + L / 4) % 64, 2 * (L % 4) + j);
                    e[(w * 32 + L) * 8 + 2 * m + j] = acc;
                }
}

/* The race detector finds the missing wait, the missing barrier after a
 * wait, and the missing barrier before a double buffer is overwritten, in
 * toy kernels built with the same cp.async/ldmatrix primitives, under every
 * schedule; their correct twins have no race and the right values. */
static void emu_race_detector_catches_toys(void) {
    static float out[1024], want[1024];
    const char *toys[] = {"cp_async_wait", "cp_async_barrier", "double_buffer"};
    dfl_emu_race_fatal(0);
    for (unsigned sched = 0; sched < 3; sched++) {
        dfl_emu_set_schedule(sched);
        for (int t = 0; t < 3; t++) {
            unsigned long r0 = dfl_emu_races();
            T_CHECK(dfl_emu_toy(toys[t], 0, out, 1024) == 1024);
            T_CHECKF(dfl_emu_races() > r0, "%s (schedule %u): the race was not reported", toys[t], sched);
            r0 = dfl_emu_races();
            T_CHECK(dfl_emu_toy(toys[t], 1, out, 1024) == 1024);
            T_CHECKF(dfl_emu_races() == r0, "%s fixed (schedule %u): %lu races reported", toys[t], sched,
                     dfl_emu_races() - r0);
            toy_expect(want, t == 2 ? 4 : 1);
            T_CHECKF(memcmp(out, want, sizeof want) == 0, "%s fixed (schedule %u): wrong values", toys[t], sched);
        }
    }
    dfl_emu_set_schedule(0);
    dfl_emu_race_fatal(1);
}

/* A race in plain shared-memory code (no cp.async or ldmatrix for the
 * detector to see): a neighbour exchange without its barrier gives
 * different bits under different schedules, and wrong values under some;
 * with the barrier, the right values under all. */
static void emu_schedules_expose_plain_races(void) {
    float want[256], got[256], first[256];
    for (int i = 0; i < 256; i++) want[i] = (float)((i / 64) * 64 + (i % 64 + 1) % 64 + 1);
    int differ = 0, wrong = 0;
    for (unsigned sched = 0; sched < 6; sched++) {
        dfl_emu_set_schedule(sched);
        T_CHECK(dfl_emu_toy("exchange", 0, sched ? got : first, 256) == 256);
        if (sched) differ |= memcmp(got, first, sizeof got) != 0;
        wrong |= memcmp(sched ? got : first, want, sizeof want) != 0;
        T_CHECK(dfl_emu_toy("exchange", 1, got, 256) == 256);
        T_CHECKF(memcmp(got, want, sizeof want) == 0, "exchange fixed (schedule %u): wrong values", sched);
    }
    dfl_emu_set_schedule(0);
    T_CHECKF(differ && wrong, "the racy exchange gave %s under 6 schedules", differ ? "right values" : "the same bits");
}

/* fork, run toy `name` (the buggy version) in the child; true if the child
 * aborted with `msg` in what it wrote to stderr */
static int toy_aborts(const char *name, const char *msg) {
    int fd[2];
    if (pipe(fd) != 0) return 0;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        float out[64];
        dfl_emu_toy(name, 0, out, 64);
        _exit(0);
    }
    close(fd[1]);
    char buf[4096];
    t_read_pipe(fd[0], buf, sizeof buf);
    int st = 0;
    waitpid(pid, &st, 0);
    int ok = WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT && strstr(buf, msg) != NULL;
    if (!ok) fprintf(stderr, "  %s: child status %d, stderr: %s\n", name, st, buf);
    return ok;
}

/* wgmma runs deferred, as on the GPU: its accumulators read before the
 * wait that covers it are NaN, B overwritten before that wait changes the
 * product, a write to the accumulators in flight or a thread that never
 * waits aborts, and so does a wgmma over cp.async data that its threads
 * did not fence for the async proxy; the correct twins give the exact
 * product. */
static void emu_wgmma_in_flight(void) {
    static float out[4096];
    const int mode_fix = 1, mode_bug = 0;
    T_CHECK(dfl_emu_toy("wgmma_early_read", mode_fix, out, 4096) == 4096);
    int wrong = 0;
    for (int t = 0; t < 128; t++)
        for (int j = 0; j < 32; j++) wrong += out[t * 32 + j] != 16.0f * (float)(8 * (j / 4) + 2 * (t % 4) + j % 2);
    T_CHECKF(wrong == 0, "wgmma toy: %d of 4096 accumulators wrong", wrong);
    T_CHECK(dfl_emu_toy("wgmma_early_read", mode_bug, out, 4096) == 4096);
    int nan = 0;
    for (int i = 0; i < 4096; i++) nan += isnan(out[i]);
    T_CHECKF(nan == 4096, "wgmma read before its wait: %d of 4096 accumulators NaN", nan);
    T_CHECK(dfl_emu_toy("wgmma_overwrite", mode_bug, out, 4096) == 4096);
    int zero = 0;
    for (int i = 0; i < 4096; i++) zero += out[i] == 0.0f;
    T_CHECKF(zero == 4096, "wgmma with B overwritten in flight: %d of 4096 products from the new B", zero);
    T_CHECK(toy_aborts("wgmma_write_in_flight", "written while a wgmma on them is in flight"));
    T_CHECK(toy_aborts("wgmma_no_wait", "ended with a wgmma in flight"));
    /* operands brought by cp.async: fenced for the async proxy, the same
     * exact product; unfenced, an abort at the wgmma's issue */
    memset(out, 0, sizeof out);
    T_CHECK(dfl_emu_toy("wgmma_no_proxy_fence", mode_fix, out, 4096) == 4096);
    wrong = 0;
    for (int t = 0; t < 128; t++)
        for (int j = 0; j < 32; j++) wrong += out[t * 32 + j] != 16.0f * (float)(8 * (j / 4) + 2 * (t % 4) + j % 2);
    T_CHECKF(wrong == 0, "wgmma toy from cp.async: %d of 4096 accumulators wrong", wrong);
    T_CHECK(toy_aborts("wgmma_no_proxy_fence", "no fence.proxy.async"));
}

/* What fails a launch or faults on the GPU aborts the emulation too: shared
 * memory over 48 KiB without the kernel's attribute raised, a 16-byte
 * access that is not 16-byte aligned. The correct versions run. */
static void emu_launch_checks_abort(void) {
    float out[64];
    T_CHECK(toy_aborts("big_smem", "over 48 KiB without cudaFuncSetAttribute"));
    T_CHECK(toy_aborts("misaligned", "not 16-byte aligned"));
    T_CHECK(dfl_emu_toy("big_smem", 1, out, 64) == 32);
    T_CHECK(dfl_emu_toy("misaligned", 1, out, 64) == 8);
    for (int i = 0; i < 8; i++) T_CHECK(out[i] == (float)(8 + i));
}

/* dq, dk, dv of a backward over lse, blocks blk */
static bytes dflash_bwd_bits(dflash_dev *c, const void *lse, const void *blk, unsigned long *syncs) {
    const dflash_shape *s = &c->s;
    bytes b = {NULL, 0};
    unsigned long s0 = dfl_emu_stream_syncs ? dfl_emu_stream_syncs() : 0;
    DEV->attn_dflash_bwd(c->dq, c->dk, c->dv, c->dout, c->out, lse, c->q, c->k, c->v, blk, s->nblk, s->B, s->NK,
                         s->Hq, s->Hkv, s->D, 0);
    *syncs = dfl_emu_stream_syncs ? dfl_emu_stream_syncs() - s0 : 0;
    take(&b, c->dq, c->QN, AG_ACT), take(&b, c->dk, c->KN, AG_ACT), take(&b, c->dv, c->KN, AG_ACT);
    return b;
}

static int same_bits(const bytes *a, const bytes *b) { return a->n == b->n && memcmp(a->p, b->p, a->n) == 0; }

/* A forward that saves lse counts its key tiles for the backward, which
 * then fills its lists without draining the stream (emulation: no
 * cudaStreamSynchronize in the backward), and gives the bits of a backward
 * that counts by itself (over a copy of lse, which no forward wrote). The
 * counts are kept per lse: two forwards over other blocks, into another
 * lse and then into the same one, each leave their own. */
static void attn_dflash_bwd_takes_forward_counts(void) {
    const int32_t ctx[] = {300, 140}, anc[] = {9, 5};
    dflash_dev c = dflash_dev_new(dflash_layout(ctx, 2, anc, 16, 8, 2, 64));
    const dflash_shape *s = &c.s;
    dflash_shape s2 = dflash_layout(ctx, 2, anc, 16, 8, 2, 64); /* other anchors, the same sizes */
    void *blk2 = dput(s2.blocks, s->nblk * 3, AG_I32), *lse2 = dput(NULL, s->nblk * s->B * s->Hq, AG_F32);
    void *lse_copy = dput(NULL, s->nblk * s->B * s->Hq, AG_F32);
    const size_t lse_bytes = (size_t)(s->nblk * s->B * s->Hq) * 4;
    unsigned long syncs = 0;

    DEV->attn_dflash(c.out, c.lse, c.q, c.k, c.v, c.blk, s->nblk, s->B, s->NK, s->Hq, s->Hkv, s->D, 0);
    bytes kept = dflash_bwd_bits(&c, c.lse, c.blk, &syncs);
    T_CHECKF(syncs == 0, "the backward after its forward drained the stream %lu times", syncs);
    DEV->copy(lse_copy, c.lse, lse_bytes);
    bytes counted = dflash_bwd_bits(&c, lse_copy, c.blk, &syncs);
    T_CHECKF(!dfl_emu_stream_syncs || syncs == 1, "a backward counting by itself: %lu syncs, not 1", syncs);
    T_CHECK(same_bits(&kept, &counted));

    /* blocks 2 into lse2: lse keeps blocks 1's counts */
    void *out2 = dput(NULL, c.QN, AG_ACT);
    DEV->attn_dflash(out2, lse2, c.q, c.k, c.v, blk2, s->nblk, s->B, s->NK, s->Hq, s->Hkv, s->D, 0);
    bytes again = dflash_bwd_bits(&c, c.lse, c.blk, &syncs);
    T_CHECKF(syncs == 0 && same_bits(&kept, &again), "after another lse's forward: %lu syncs, bits %s", syncs,
             same_bits(&kept, &again) ? "equal" : "differ");
    /* blocks 2 into lse itself: its counts are now blocks 2's */
    DEV->attn_dflash(c.out, c.lse, c.q, c.k, c.v, blk2, s->nblk, s->B, s->NK, s->Hq, s->Hkv, s->D, 0);
    bytes kept2 = dflash_bwd_bits(&c, c.lse, blk2, &syncs);
    T_CHECKF(syncs == 0, "the backward after its forward drained the stream %lu times", syncs);
    DEV->copy(lse_copy, c.lse, lse_bytes);
    bytes counted2 = dflash_bwd_bits(&c, lse_copy, blk2, &syncs);
    T_CHECK(same_bits(&kept2, &counted2));
    T_CHECK(!same_bits(&kept, &kept2)); /* the two block sets do differ */

    free(kept.p), free(counted.p), free(again.p), free(kept2.p), free(counted2.p);
    DEV->free(blk2), DEV->free(lse2), DEV->free(lse_copy), DEV->free(out2);
    free(s2.blocks);
    dflash_dev_free(&c);
}

/* The DFlash backward's store of dS (dq from dS) is the one large buffer it
 * can do without: where the device cannot allocate it, dq is recomputed
 * (the bits of DFLASH_CUDA_DS_MAX_MB=0) and nothing exits. Run in a child
 * process, since the device scratch is grow-only and process-wide: the
 * backward runs once with DFLASH_CUDA_DS_MAX_MB=0 (every other scratch
 * buffer is then in place), then with the store wanted and every new
 * allocation refused by the emulated device. */
static int ds_fallback_child(void) {
    const int32_t ctx[] = {900, 800}, anc[] = {30, 24}; /* a larger store than any earlier test's (else exit 3) */
    dflash_dev c = dflash_dev_new(dflash_layout(ctx, 2, anc, 16, 8, 2, 64));
    bytes got[2] = {{NULL, 0}, {NULL, 0}};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0) setenv("DFLASH_CUDA_DS_MAX_MB", "0", 1);
        else unsetenv("DFLASH_CUDA_DS_MAX_MB"), dfl_emu_alloc_limit(1);
        dflash_dev_run(&c, 0); /* the second pass over the first's results: they must not show */
        take(&got[pass], c.dq, c.QN, AG_ACT), take(&got[pass], c.dk, c.KN, AG_ACT), take(&got[pass], c.dv, c.KN, AG_ACT);
    }
    if (dfl_emu_alloc_refused() == 0) return 3;        /* the store was never asked for */
    if (got[0].n != got[1].n || memcmp(got[0].p, got[1].p, got[0].n) != 0) return 4;
    return 0;
}

static void attn_dflash_bwd_without_memory_for_ds(void) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) _exit(ds_fallback_child());
    int st = 0;
    waitpid(pid, &st, 0);
    T_CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0,
             "child status %d (exit 3: no allocation refused; 4: other results than DFLASH_CUDA_DS_MAX_MB=0; 70: a "
             "refused allocation ended the process)",
             st);
}

/* host_alloc where the driver refuses page-locked memory (emulation: every
 * allocation refused, and counted): plain memory instead, which carries
 * the same bytes and is freed as plain memory. */
static void host_alloc_without_pinned_memory(void) {
    const unsigned long refused = dfl_emu_alloc_refused();
    enum { N = 4096 };
    dfl_emu_alloc_limit(1);
    float *h = DEV->host_alloc(N * sizeof(float));
    dfl_emu_alloc_limit(0);
    T_CHECKF(dfl_emu_alloc_refused() == refused + 1, "page-locked memory asked for %lu times, not once",
             dfl_emu_alloc_refused() - refused);
    for (int i = 0; i < N; i++) h[i] = (float)i;
    void *d = DEV->alloc(N * sizeof(float));
    DEV->upload(d, h, N * sizeof(float));
    memset(h, 0, N * sizeof(float));
    DEV->download(h, d, N * sizeof(float));
    int bad = 0;
    for (int i = 0; i < N; i++) bad += h[i] != (float)i;
    T_CHECKF(bad == 0, "%d values changed", bad);
    DEV->free(d);
    DEV->host_free(h);
}

/* The attention kernels again on wgmma (DFLASH_CUDA_WGMMA; used on a 9.0
 * device only, elsewhere these repeat the mma.sync kernels): the causal one
 * with two warpgroups a CTA and with three, the DFlash forward and dk/dv;
 * the forward kernels overlapped (the default) and not
 * (DFLASH_CUDA_WGMMA_PIPE=0). */
static void with_wgmma(const char *value, const char *pipe, void (*test)(void)) {
    setenv("DFLASH_CUDA_WGMMA", value, 1);
    setenv("DFLASH_CUDA_WGMMA_PIPE", pipe, 1);
    test();
    unsetenv("DFLASH_CUDA_WGMMA"), unsetenv("DFLASH_CUDA_WGMMA_PIPE");
}
static void attn_causal_agrees_wgmma2(void) { with_wgmma("1", "1", attn_causal_agrees); }
static void attn_causal_agrees_wgmma3(void) { with_wgmma("3", "1", attn_causal_agrees); }
static void attn_dflash_agrees_wgmma(void) { with_wgmma("1", "1", attn_dflash_agrees); }
static void attn_causal_agrees_wgmma2_serial(void) { with_wgmma("1", "0", attn_causal_agrees); }
static void attn_causal_agrees_wgmma3_serial(void) { with_wgmma("3", "0", attn_causal_agrees); }
static void attn_dflash_agrees_wgmma_serial(void) { with_wgmma("1", "0", attn_dflash_agrees); }
/* a target's sliding window and lse on the causal wgmma kernels */
static void attn_causal_window_agrees_wgmma2(void) { with_wgmma("1", "1", attn_causal_window_agrees); }
static void attn_causal_window_agrees_wgmma3(void) { with_wgmma("3", "1", attn_causal_window_agrees); }
static void attn_causal_window_agrees_wgmma2_serial(void) { with_wgmma("1", "0", attn_causal_window_agrees); }
/* the sliding window's tensor-core kernels on wgmma too, against the oracle */
static void attn_dflash_window_oracle_wgmma(void) { with_wgmma("1", "1", attn_dflash_window_oracle); }
static void attn_dflash_window_oracle_wgmma_serial(void) { with_wgmma("1", "0", attn_dflash_window_oracle); }

int main(void) {
    setenv("DFLASH_CUDA_LMHEAD_ROWS", "16", 0); /* several LM-head chunks at test sizes */
    setenv("DFLASH_CUDA_CONV_ROWS", "8", 0);    /* conv1d_silu tiles of 8 rows at test sizes */
    const dfl_ops *cuda = NULL;
    int rc = dfl_ops_get("cuda", &cuda);
    if (rc != 0) {
        unavail_code = rc;
        snprintf(unavail_msg, sizeof unavail_msg, "%s", dfl_errmsg());
        printf("no CUDA backend here (exit code %d): %s\n", rc, unavail_msg);
        T_RUN(cuda_unavailable_reported_cleanly);
        return t_exit();
    }
    REF = dfl_ops_cpu();
    DEV = cuda;
    AG_BIG = getenv("DFLASH_TEST_BIG") && strcmp(getenv("DFLASH_TEST_BIG"), "0") != 0;
    const char *simple = getenv("DFLASH_CUDA_SIMPLE");
    printf("CUDA backend%s%s\n", simple && strcmp(simple, "0") ? " (simple attention kernels)" : "",
           AG_BIG ? ", with the real-size shapes" : "");
    ops_agree_all(20261130);
    AG_RUN(sigmoid_mul_agrees);
    AG_RUN(conv1d_silu_agrees);
    AG_RUN(gated_delta_agrees);
    AG_RUN(attn_dflash_bwd_takes_forward_counts);
    /* last, so that a wgmma kernel that faults on a GPU costs no other result */
    AG_RUN(attn_causal_agrees_wgmma2);
    AG_RUN(attn_causal_agrees_wgmma3);
    AG_RUN(attn_dflash_agrees_wgmma);
    AG_RUN(attn_causal_agrees_wgmma2_serial);
    AG_RUN(attn_causal_agrees_wgmma3_serial);
    AG_RUN(attn_dflash_agrees_wgmma_serial);
    AG_RUN(attn_dflash_window_oracle_wgmma);
    AG_RUN(attn_dflash_window_oracle_wgmma_serial);
    AG_RUN(attn_causal_window_agrees_wgmma2);
    AG_RUN(attn_causal_window_agrees_wgmma3);
    AG_RUN(attn_causal_window_agrees_wgmma2_serial);
    if (dfl_emu_set_schedule && dfl_emu_toy && !getenv("DFLASH_TEST_ONLY")) {
        T_RUN(emu_kernels_race_free);
        T_RUN(emu_schedules_give_identical_bits);
        T_RUN(emu_race_detector_catches_toys);
        T_RUN(emu_schedules_expose_plain_races);
        T_RUN(emu_launch_checks_abort);
        T_RUN(emu_wgmma_in_flight);
        T_RUN(attn_dflash_bwd_without_memory_for_ds);
        T_RUN(host_alloc_without_pinned_memory);
    }
    return t_exit();
}
