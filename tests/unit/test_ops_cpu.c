/* test_ops_cpu.c: the CPU op table against independent oracles.
 *
 * Oracles: PyTorch/transformers fixtures (tests/reference/ops_reference.py ->
 * tests/fixtures/ops/NAME.safetensors, forward and autograd backward), dense
 * attention with the DFlash mask rebuilt here from the spec's rule and
 * computed in double, central finite differences of each op's own forward,
 * and plain double loops for the trivial ops.
 *
 * Tolerances. Outputs are compared by normalised error
 * nmse = sum (a-b)^2 / sum b^2 against a reference computed in float64 (or
 * transformers in f32 for rmsnorm and rope) and stored as f32. A correct
 * fp32 implementation differs by a few ulps per element (2^-24 = 6e-8
 * relative), nmse ~1e-15..1e-13 for these short reductions; NMSE_F32 = 1e-11
 * leaves two orders of margin, while a wrong mask entry, a missing term or a
 * wrong scale gives 1e-6 or more. Finite differences: fp32 forward, step
 * FD_STEP along random directions, central difference against <grad, delta>
 * (delta the perturbation actually applied after f32 rounding); the
 * truncation error is O(step^2) and the rounding error ~1e-7 * |L| / step,
 * so agreement within FD_TOL relative is the expected level.
 */
#include "common.h"
#include "ops.h"
#include "model_config.h"
#include "moe_oracle.h"
#include "ops_cpu.h"
#include "rng.h"
#include "sample.h"
#include "safetensors.h"
#include "test.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define NMSE_F32 1e-11
#define FD_STEP 1e-2f
#define FD_TOL 2e-3

static const dfl_ops *ops;
static dfl_st *fx_dense, *fx_attn, *fx_lm, *fx_adam, *fx_gdn, *fx_yarn, *fx_oss;

/* ------------------------------------------------------------------------ */
/* fixtures and helpers                                                      */

static dfl_st *open_fx(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "tests/fixtures/ops/%s.safetensors", name);
    dfl_st *st = NULL;
    if (dfl_st_open(&st, path) != 0) {
        fprintf(stderr, "test_ops_cpu: %s (run from the repository root)\n", dfl_errmsg());
        exit(1);
    }
    return st;
}

static const dfl_st_tensor *fx_find(dfl_st *st, const char *name) {
    const dfl_st_tensor *t = dfl_st_find(st, name);
    if (!t) {
        fprintf(stderr, "test_ops_cpu: fixture tensor %s missing\n", name);
        exit(1);
    }
    return t;
}

/* A fixture tensor as a fresh f32 buffer (free with ops->free). */
static float *fx(dfl_st *st, const char *name, int64_t *n) {
    const dfl_st_tensor *t = fx_find(st, name);
    float *out = ops->alloc((size_t)t->numel * 4);
    dfl_st_to_f32(t, out);
    if (n) *n = t->numel;
    return out;
}

static int32_t *fxi(dfl_st *st, const char *name, int64_t *n) {
    const dfl_st_tensor *t = fx_find(st, name);
    if (t->dtype != DFL_I32) {
        fprintf(stderr, "test_ops_cpu: fixture tensor %s is not i32\n", name);
        exit(1);
    }
    int32_t *out = ops->alloc((size_t)t->numel * 4);
    memcpy(out, t->data, (size_t)t->numel * 4);
    if (n) *n = t->numel;
    return out;
}

static float *fbuf(int64_t n) { return ops->alloc((size_t)n * 4); }

static float *fcopy(const float *x, int64_t n) {
    float *y = fbuf(n);
    memcpy(y, x, (size_t)n * 4);
    return y;
}

static void frand(float *x, int64_t n, dfl_rng *r, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * (float)dfl_rng_normal(r);
}

/* Check nmse(a, ref) <= thr and print the figure. */
#define CHECK_NMSE(what, a, ref, n, thr)                                                               \
    do {                                                                                               \
        double e_ = t_nmse_f32((a), (ref), (n));                                                        \
        printf("  %-28s nmse %.2e (<= %.0e)\n", (what), e_, (double)(thr));                            \
        T_CHECKF(e_ <= (thr), "%s: nmse %.3e > %.1e", (what), e_, (double)(thr));                       \
    } while (0)

/* x - c elementwise, to check that an op accumulated onto a preset c. */
static float *minus(const float *x, float c, int64_t n) {
    float *y = fbuf(n);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] - c;
    return y;
}

static double dot_d(const float *a, const float *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* Central finite difference of a scalar loss L along random directions of
 * x[n], against the analytic gradient g[n]. L reads x through ctx. */
typedef double (*loss_fn)(void *ctx);

static void check_fd(const char *what, loss_fn L, void *ctx, float *x, const float *g, int64_t n, uint64_t seed) {
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    float *x0 = fcopy(x, n), *u = fbuf(n), *delta = fbuf(n);
    double worst = 0;
    for (int dir = 0; dir < 3; dir++) {
        frand(u, n, &r, 1.0f);
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] + FD_STEP * u[i];
        double lp = L(ctx);
        for (int64_t i = 0; i < n; i++) delta[i] = x[i];
        for (int64_t i = 0; i < n; i++) x[i] = x0[i] - FD_STEP * u[i];
        double lm = L(ctx);
        for (int64_t i = 0; i < n; i++) delta[i] -= x[i];
        memcpy(x, x0, (size_t)n * 4);
        double fd = lp - lm, an = dot_d(g, delta, n);
        double rel = fabs(fd - an) / (fabs(an) + 1e-3 * sqrt(dot_d(g, g, n) * dot_d(delta, delta, n)) + 1e-30);
        if (rel > worst) worst = rel;
        T_CHECKF(rel <= FD_TOL, "%s: direction %d: finite difference %.9g, analytic %.9g (rel %.2e)", what, dir,
                 fd, an, rel);
    }
    printf("  %-28s fd rel err %.2e (<= %.0e)\n", what, worst, FD_TOL);
    ops->free(x0);
    ops->free(u);
    ops->free(delta);
}

/* ------------------------------------------------------------------------ */
/* memory and conversions                                                    */

static void test_memory_and_conversions(void) {
    T_CHECK(!strcmp(ops->name, "cpu") && ops->act_bytes == 4 && ops->wt_bytes == 4);
    uint8_t *p = ops->alloc(1000);
    T_CHECK(((uintptr_t)p & 63) == 0);
    int zero = 1;
    for (int i = 0; i < 1000; i++) zero &= p[i] == 0;
    T_CHECK(zero);
    ops->free(p);

    /* bf16: 1, -2, 0x3f81 (1.0078125); f16: 1, -2, 65504; f32 verbatim */
    uint16_t bf[3] = {0x3f80, 0xc000, 0x3f81}, hf[3] = {0x3c00, 0xc000, 0x7bff};
    float f[3] = {1.5f, -0.25f, 3e38f}, *dst = fbuf(3);
    ops->load_act(dst, bf, DFL_BF16, 3);
    T_CHECK(dst[0] == 1.0f && dst[1] == -2.0f && dst[2] == 1.0078125f);
    ops->load_wt(dst, hf, DFL_F16, 3);
    T_CHECK(dst[0] == 1.0f && dst[1] == -2.0f && dst[2] == 65504.0f);
    ops->load_act(dst, f, DFL_F32, 3);
    T_CHECK(!memcmp(dst, f, 12));

    /* act -> bf16 rounds to nearest even: 1 + 2^-8 is a tie (-> 1), 1 + 3*2^-8 a tie (-> up) */
    float r[4] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 1.0f + 1.5f / 256, -3.0f};
    uint16_t out[4], *o = out;
    ops->act_to_bf16(o, r, 4);
    T_CHECK(out[0] == 0x3f80 && out[1] == 0x3f82 && out[2] == 0x3f81 && out[3] == 0xc040);
    float back[3];
    ops->act_to_f32(back, dst, 3);
    T_CHECK(!memcmp(back, f, 12));

    float m[2] = {4, 5}, *w = fbuf(2);
    ops->master_to_wt(w, m, 2);
    T_CHECK(w[0] == 4 && w[1] == 5);
    ops->master_to_wt(m, m, 2); /* dst == master: nothing */
    T_CHECK(m[0] == 4 && m[1] == 5);
    ops->zero(w, 8);
    T_CHECK(w[0] == 0 && w[1] == 0);
    ops->free(dst);
    ops->free(w);
}

/* An allocation and an upload from 8 MiB on run on every thread in runs of
 * 2 MiB (ops_cpu.c): the last run ragged, and an overlapping upload still a
 * memmove. */
static void test_large_alloc_and_upload(void) {
    const size_t n = ((size_t)8 << 20) + 4099; /* 4 full runs and a ragged one */
    const int threads = omp_get_max_threads();
    omp_set_num_threads(3);
    uint8_t *a = ops->alloc(n), *b = ops->alloc(n), *want = malloc(n);
    for (size_t i = 0; i < n; i++) want[i] = (uint8_t)(i * 2654435761u >> 13);
    memset(b, 0xa5, n);
    ops->free(b);
    b = ops->alloc(n); /* perhaps b's old pages again, not zero */
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++) nonzero += a[i] != 0 || b[i] != 0;
    T_CHECKF(nonzero == 0, "alloc(%zu): %zu bytes not zero", n, nonzero);
    ops->upload(a, want, n);
    T_CHECK(!memcmp(a, want, n));
    ops->upload(b + 7, want + 7, n - 20); /* odd start and end */
    T_CHECK(b[6] == 0 && !memcmp(b + 7, want + 7, n - 20) && b[n - 13] == 0);
    memmove(want + 1000, want, n - 1000); /* overlapping: forward */
    ops->upload(a + 1000, a, n - 1000);
    T_CHECK(!memcmp(a, want, n));
    memmove(want, want + 3, n - 3); /* and backward */
    ops->upload(a, a + 3, n - 3);
    T_CHECK(!memcmp(a, want, n));
    ops->free(a), ops->free(b);
    free(want);
    omp_set_num_threads(threads);
}

/* ------------------------------------------------------------------------ */
/* dense                                                                     */

static void test_matmul(void) {
    const int64_t M = 7, K = 13, N = 11;
    float *x = fx(fx_dense, "mm.in", NULL), *w = fx(fx_dense, "mm.w", NULL), *ref = fx(fx_dense, "mm.out", NULL);
    float *out = fbuf(M * N);
    for (int64_t i = 0; i < M * N; i++) out[i] = 1e9f; /* overwritten, not accumulated */
    ops->matmul(out, x, w, M, K, N, 0);
    CHECK_NMSE("matmul out", out, ref, M * N, NMSE_F32);
    for (int64_t i = 0; i < M * N; i++) out[i] = 2.0f;
    ops->matmul(out, x, w, M, K, N, 1);
    float *acc = minus(out, 2.0f, M * N);
    CHECK_NMSE("matmul accumulate", acc, ref, M * N, NMSE_F32);

    float *dout = fx(fx_dense, "mm.dout", NULL), *rdin = fx(fx_dense, "mm.din", NULL),
          *rdw = fx(fx_dense, "mm.dw", NULL);
    float *din = fbuf(M * K), *dw = fbuf(N * K);
    for (int64_t i = 0; i < M * K; i++) din[i] = 1.0f;
    for (int64_t i = 0; i < N * K; i++) dw[i] = -1.0f;
    ops->matmul_bwd(din, dw, dout, x, w, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    float *d1 = minus(din, 1.0f, M * K), *d2 = minus(dw, -1.0f, N * K);
    CHECK_NMSE("matmul_bwd din (+=)", d1, rdin, M * K, NMSE_F32);
    CHECK_NMSE("matmul_bwd dw (+=)", d2, rdw, N * K, NMSE_F32);
    /* NULL gradients are skipped */
    memcpy(d1, din, (size_t)(M * K) * 4);
    ops->matmul_bwd(din, NULL, dout, x, w, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    ops->matmul_bwd(NULL, NULL, dout, x, w, M, K, N, DFL_ACC_DIN | DFL_ACC_DW);
    for (int64_t i = 0; i < M * K; i++) d1[i] = din[i] - d1[i];
    CHECK_NMSE("matmul_bwd din, dw NULL", d1, rdin, M * K, NMSE_F32);
    /* without DFL_ACC_DIN: din overwritten (dw still accumulates) */
    for (int64_t i = 0; i < M * K; i++) din[i] = 1e9f;
    memcpy(d2, dw, (size_t)(N * K) * 4);
    ops->matmul_bwd(din, dw, dout, x, w, M, K, N, DFL_ACC_DW);
    CHECK_NMSE("matmul_bwd din (=)", din, rdin, M * K, NMSE_F32);
    for (int64_t i = 0; i < N * K; i++) d2[i] = dw[i] - d2[i];
    CHECK_NMSE("matmul_bwd dw (+=, din overwritten)", d2, rdw, N * K, NMSE_F32);
    /* N = 0: an empty sum, so din = 0 when overwritten, unchanged when not */
    ops->matmul_bwd(din, NULL, dout, x, w, M, K, 0, DFL_ACC_DIN | DFL_ACC_DW);
    CHECK_NMSE("matmul_bwd din (N = 0, +=)", din, rdin, M * K, NMSE_F32);
    ops->matmul_bwd(din, NULL, dout, x, w, M, K, 0, DFL_ACC_DW);
    T_CHECK(din[0] == 0 && din[M * K - 1] == 0);
    /* without DFL_ACC_DW: dw overwritten (din accumulates) */
    for (int64_t i = 0; i < N * K; i++) dw[i] = 1e9f;
    memcpy(d1, din, (size_t)(M * K) * 4);
    ops->matmul_bwd(din, dw, dout, x, w, M, K, N, DFL_ACC_DIN);
    CHECK_NMSE("matmul_bwd dw (=)", dw, rdw, N * K, NMSE_F32);
    for (int64_t i = 0; i < M * K; i++) d1[i] = din[i] - d1[i];
    CHECK_NMSE("matmul_bwd din (+=, dw overwritten)", d1, rdin, M * K, NMSE_F32);
    /* M = 0: dw an empty sum, 0 when overwritten */
    ops->matmul_bwd(NULL, dw, dout, x, w, 0, K, N, 0);
    T_CHECK(dw[0] == 0 && dw[N * K - 1] == 0);
    /* K = 0: out = 0 */
    ops->matmul(out, x, w, M, 0, N, 0);
    T_CHECK(out[0] == 0 && out[M * N - 1] == 0);
    ops->free(x), ops->free(w), ops->free(ref), ops->free(out), ops->free(acc), ops->free(dout);
    ops->free(rdin), ops->free(rdw), ops->free(din), ops->free(dw), ops->free(d1), ops->free(d2);
}

/* dfl_cpu_gemm_nt's three paths (sgemv at 1 row, the few-rows kernel up to
 * DFL_CPU_FEW_ROWS, or DFL_CPU_FEW_ROWS_LONG_K from K DFL_CPU_LONG_K on,
 * sgemm above) against a double-precision sum, across the kernel's edges:
 * rows in 4s and a remainder, K in 8-lane steps and a tail, overwrite and
 * accumulate, and a size large enough to run threaded. The error is measured
 * against the magnitude of the summed terms (sum |x w| + |out|), not of the
 * result, which cancellation can make arbitrarily small in a one-element
 * case. */
static double gemm_nt_err(int64_t M, int64_t K, int64_t N, int beta, dfl_rng *r) {
    float *x = fbuf(M * K), *w = fbuf(N * K), *out = fbuf(M * N);
    frand(x, M * K, r, 1.0f), frand(w, N * K, r, 1.0f), frand(out, M * N, r, 1.0f);
    double *ref = calloc((size_t)(M * N), sizeof *ref), *mag = calloc((size_t)(M * N), sizeof *mag);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double sum = beta ? out[m * N + n] : 0, a = beta ? fabs(out[m * N + n]) : 0;
            for (int64_t k = 0; k < K; k++) {
                double p = (double)x[m * K + k] * w[n * K + k];
                sum += p, a += fabs(p);
            }
            ref[m * N + n] = sum, mag[m * N + n] = a;
        }
    dfl_cpu_gemm_nt(out, x, w, M, K, N, (float)beta);
    double e2 = 0, m2 = 0;
    for (int64_t i = 0; i < M * N; i++) e2 += (out[i] - ref[i]) * (out[i] - ref[i]), m2 += mag[i] * mag[i];
    ops->free(x), ops->free(w), ops->free(out), free(ref), free(mag);
    return e2 / m2;
}

static void test_gemm_nt_paths(void) {
    static const int64_t Ms[] = {1, 2, 3, 4, 5, 8, 15, 16, 17}, Ks[] = {1, 7, 8, 9, 64, 257}, Ns[] = {1, 5, 33};
    dfl_rng r;
    dfl_rng_seed(&r, 41);
    double worst = 0;
    int cases = 0;
    for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
        for (size_t b = 0; b < sizeof Ks / sizeof *Ks; b++)
            for (size_t c = 0; c < sizeof Ns / sizeof *Ns; c++)
                for (int beta = 0; beta <= 1; beta++) {
                    double e = gemm_nt_err(Ms[a], Ks[b], Ns[c], beta, &r);
                    worst = e > worst ? e : worst;
                    T_CHECKF(e <= NMSE_F32, "gemm_nt M %lld K %lld N %lld beta %d: error %.3e", (long long)Ms[a],
                             (long long)Ks[b], (long long)Ns[c], beta, e);
                    cases++;
                }
    printf("  gemm_nt, %d shapes           worst error %.2e (<= %.0e)\n", cases, worst, NMSE_F32);
    double e = gemm_nt_err(16, 1024, 1024, 0, &r); /* threaded */
    printf("  gemm_nt 16 x 1024 x 1024     error %.2e (<= %.0e)\n", e, NMSE_F32);
    T_CHECKF(e <= NMSE_F32, "gemm_nt 16 x 1024 x 1024: error %.3e", e);
    /* K 0: an empty sum, 0 or the output as it was, through the few-rows
     * kernel on f32 and bf16 weights (which once divided by the row size) */
    for (int bf = 0; bf < 2; bf++)
        for (int acc = 0; acc < 2; acc++) {
            float o[3 * 40], x[1] = {0};
            const float w32[1] = {0};
            const uint16_t w16[1] = {0};
            for (int i = 0; i < 3 * 40; i++) o[i] = (float)i;
            dfl_cpu_gemm_nt_few_rows(o, x, bf ? (const void *)w16 : w32, bf ? DFL_BF16 : DFL_F32, 3, 0, 40, acc);
            int ok = 1;
            for (int i = 0; i < 3 * 40; i++) ok &= o[i] == (acc ? (float)i : 0.0f);
            T_CHECKF(ok, "few rows, K 0, %s weights, acc %d: not the empty sum", bf ? "bf16" : "f32", acc);
        }
    /* long rows: the few-rows kernel up to DFL_CPU_FEW_ROWS_LONG_K rows,
     * sgemm past it */
    static const int64_t long_Ms[] = {17, DFL_CPU_FEW_ROWS_LONG_K, DFL_CPU_FEW_ROWS_LONG_K + 1};
    for (size_t a = 0; a < sizeof long_Ms / sizeof *long_Ms; a++) {
        e = gemm_nt_err(long_Ms[a], DFL_CPU_LONG_K + 7, 37, (int)a & 1, &r);
        printf("  gemm_nt %2lld x %d x 37        error %.2e (<= %.0e)\n", (long long)long_Ms[a], DFL_CPU_LONG_K + 7,
               e, NMSE_F32);
        T_CHECKF(e <= NMSE_F32, "gemm_nt %lld x %d x 37: error %.3e", (long long)long_Ms[a], DFL_CPU_LONG_K + 7, e);
    }
}

/* dfl_cpu_sgemm cuts its output into square tiles (dfl_cpu_gemm_tile): of
 * 1024 or 512 while the output has 4 of them for each of the machine's
 * CPUs, else of 256, halved (to 128, then 64) while there are fewer than 2,
 * so that small outputs, a small drafter's weight gradients, run on more
 * than one thread. The rule, on machines of 1, 2 and 64 CPUs. */
static void test_sgemm_tile_rule(void) {
    static const struct {
        int64_t cpus, M, N, e;
    } cases[] = {
        {2, 4096, 2048, 1024}, {2, 4096, 768, 512},  {2, 4096, 256, 512}, {2, 2048, 768, 512},
        {2, 1024, 768, 256},   {64, 4096, 2048, 256}, {64, 8192, 12288, 512}, {64, 16384, 16384, 1024}, {1, 700, 520, 512},
        {1, 2100, 2200, 1024}, {1, 600, 300, 256},    {4096, 2100, 2200, 256}, {1, 256, 256, 128},
        {1, 72, 136, 128},     {2, 40, 100, 64},      {1, 1, 100, 64},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        dfl_cpu_machine_cpus_override = cases[i].cpus;
        for (int threads = 1; threads <= 7; threads += 6) { /* the threads never decide */
            dfl_ops_cpu_threads(threads);
            const int64_t e = dfl_cpu_gemm_tile(cases[i].M, cases[i].N);
            T_CHECKF(e == cases[i].e, "%lld CPUs, %d threads, %lld x %lld output: tile %lld, want %lld",
                     (long long)cases[i].cpus, threads, (long long)cases[i].M, (long long)cases[i].N, (long long)e,
                     (long long)cases[i].e);
        }
    }
    dfl_cpu_machine_cpus_override = 0;
    dfl_ops_cpu_threads(omp_get_num_procs());
    const int64_t e = dfl_cpu_gemm_tile(4096, 4096);
    T_CHECKF(e == 256 || e == 512 || e == 1024, "this machine: tile %lld for 4096 x 4096", (long long)e);
}

/* Each edge, ragged and whole, cut as one CPU cuts it (1024 and 512 too)
 * and as 4096 do (256 and less): 700 x 520 (512: 2 x 2 | 256: 3 x 3), 600
 * x 32 (256: 3 x 1), 256 x 256 (128: 2 x 2), 130 x 200 (128, ragged), 72 x
 * 136 (128: 1 x 2), 40 x 100 and 1 x 100 (64: 1 x 2), 2100 x 2200 (1024:
 * 3 x 3, edges of 52 and 152 rows whose calls are OpenBLAS's small ones
 * at K 16 | 256: 9 x 9); the four transpositions, overwrite and
 * accumulate, against a double-precision sum (as gemm_nt_err, the error
 * relative to the summed terms' magnitude); the same bits on 1 and 3
 * threads; and bf16 weights (dfl_cpu_gemm_nt_bf16, which widens a tile's
 * rows of w at a time) the bits of the same values in f32. */
static void test_sgemm_tiles(void) {
    static const int64_t shapes[][3] = {{700, 40, 520}, {600, 300, 32},  {256, 65, 256}, {130, 300, 200},
                                        {72, 700, 136}, {40, 500, 100}, {1, 333, 100},  {2100, 16, 2200}};
    static const int64_t machines[] = {1, 4096};
    dfl_rng r;
    dfl_rng_seed(&r, 43);
    double worst = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        const int64_t M = shapes[s][0], K = shapes[s][1], N = shapes[s][2];
        float *a = fbuf(M * K), *b = fbuf(K * N), *c0 = fbuf(M * N), *c1 = fbuf(M * N), *c3 = fbuf(M * N);
        double *ref = calloc((size_t)(M * N), sizeof *ref), *mag = calloc((size_t)(M * N), sizeof *mag);
        frand(a, M * K, &r, 1), frand(b, K * N, &r, 1), frand(c0, M * N, &r, 1);
        for (int t = 0; t < 8; t++) {
            const int ta = t & 1, tb = t >> 1 & 1, beta = t >> 2;
            const int64_t lda = ta ? M : K, ldb = tb ? K : N; /* A [M, K] or [K, M]; B [K, N] or [N, K] */
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) {
                    double sum = beta ? c0[i * N + j] : 0, m = beta ? fabs(c0[i * N + j]) : 0;
                    for (int64_t k = 0; k < K; k++) {
                        double p = (double)a[ta ? k * lda + i : i * lda + k] * b[tb ? j * ldb + k : k * ldb + j];
                        sum += p, m += fabs(p);
                    }
                    ref[i * N + j] = sum, mag[i * N + j] = m;
                }
            for (size_t mc = 0; mc < sizeof machines / sizeof *machines; mc++) {
                dfl_cpu_machine_cpus_override = machines[mc];
                memcpy(c1, c0, (size_t)(M * N) * 4), memcpy(c3, c0, (size_t)(M * N) * 4);
                dfl_ops_cpu_threads(1);
                dfl_cpu_sgemm(ta, tb, M, N, K, a, lda, b, ldb, (float)beta, c1, N);
                dfl_ops_cpu_threads(3);
                dfl_cpu_sgemm(ta, tb, M, N, K, a, lda, b, ldb, (float)beta, c3, N);
                T_CHECKF(!memcmp(c1, c3, (size_t)(M * N) * 4),
                         "sgemm %lld x %lld x %lld, trans %d %d, tile %lld: 1 and 3 threads differ", (long long)M,
                         (long long)K, (long long)N, ta, tb, (long long)dfl_cpu_gemm_tile(M, N));
                double e2 = 0, m2 = 0;
                for (int64_t i = 0; i < M * N; i++) e2 += (c1[i] - ref[i]) * (c1[i] - ref[i]), m2 += mag[i] * mag[i];
                worst = e2 / m2 > worst ? e2 / m2 : worst;
                T_CHECKF(e2 / m2 <= NMSE_F32, "sgemm %lld x %lld x %lld, trans %d %d, beta %d, tile %lld: error %.3e",
                         (long long)M, (long long)K, (long long)N, ta, tb, beta, (long long)dfl_cpu_gemm_tile(M, N),
                         e2 / m2);
            }
        }
        /* bf16 weights w [N, K]: the bits of the same values in f32 */
        uint16_t *wb = dfl_malloc((size_t)(N * K) * sizeof *wb);
        for (int64_t i = 0; i < N * K; i++) b[i] = dfl_bf16_to_f32(wb[i] = dfl_f32_to_bf16(b[i]));
        for (size_t mc = 0; mc < sizeof machines / sizeof *machines; mc++)
            for (int beta = 0; beta <= 1; beta++) {
                dfl_cpu_machine_cpus_override = machines[mc];
                memcpy(c1, c0, (size_t)(M * N) * 4), memcpy(c3, c0, (size_t)(M * N) * 4);
                dfl_cpu_sgemm(0, 1, M, N, K, a, K, b, K, (float)beta, c1, N);
                dfl_cpu_gemm_nt_bf16(c3, a, wb, M, K, N, (float)beta);
                T_CHECKF(!memcmp(c1, c3, (size_t)(M * N) * 4),
                         "gemm_nt_bf16 %lld x %lld x %lld, beta %d, tile %lld: not f32's bits", (long long)M,
                         (long long)K, (long long)N, beta, (long long)dfl_cpu_gemm_tile(M, N));
            }
        dfl_cpu_machine_cpus_override = 0;
        free(wb), free(ref), free(mag);
        ops->free(a), ops->free(b), ops->free(c0), ops->free(c1), ops->free(c3);
    }
    dfl_ops_cpu_threads(omp_get_num_procs());
    printf("  sgemm tiles, %zu shapes x 8 x %zu cuts   worst error %.2e (<= %.0e)\n", sizeof shapes / sizeof *shapes,
           sizeof machines / sizeof *machines, worst, NMSE_F32);
}

/* The few-rows kernel takes tiles of 4 rows x 3 columns (the rows left in
 * one tile of 2 or 3 rows, or of 1; bf16 weights widened 3 rows of w at a
 * time from 8 rows on, by the tiles as they read them below), and for the
 * last N % 3 columns 8, 4, then 1 row to a column (bf16 read as it is). Each
 * sum is the same whatever its tile and path, so every row of an M-row
 * product is bitwise that row alone, and every element that element alone
 * (one row and one column: the one-column path; f32 and bf16 weights,
 * overwrite and accumulate): what keeps a verify block's rows equal to
 * decoding them one by one, up to the matmul op's sgemv for one row. K 259,
 * 267, 1031 and 1050, M 1 to 64 (the most rows it takes, at long K; tiles
 * of 4 rows and 8 rows many times over): a tail of 3, 7 or 2 after the
 * 8-wide steps, and tiles of 2 rows or more that prefetch (dot_tile's pf)
 * ending their k with whole cache lines of w (259, 1031) or with one to
 * three 8-wide steps more (267, 1050); N 37 leaves one column after the
 * threes, and rows that prefetch (8 or 16 rows ahead at K 259) and rows
 * that do not. */
static int few_rows_case(const float *w, const uint16_t *wb, int64_t M, int64_t K, int64_t N, int bf, int acc,
                         dfl_rng *r) {
    float *x = fbuf(M * K), *init = fbuf(M * N), *all = fbuf(M * N), *one = fbuf(M * N);
    frand(x, M * K, r, 1.0f), frand(init, M * N, r, 1.0f);
    memcpy(all, init, (size_t)(M * N) * sizeof *all), memcpy(one, init, (size_t)(M * N) * sizeof *one);
    const dfl_dtype dt = bf ? DFL_BF16 : DFL_F32;
    const void *wt = bf ? (const void *)wb : w;
    dfl_cpu_gemm_nt_few_rows(all, x, wt, dt, M, K, N, acc);
    for (int64_t m = 0; m < M; m++) dfl_cpu_gemm_nt_few_rows(one + m * N, x + m * K, wt, dt, 1, K, N, acc);
    int bad = 0;
    if (memcmp(all, one, (size_t)(M * N) * sizeof *all)) {
        bad = 1;
        fprintf(stderr, "  few rows: M %lld K %lld %s acc %d differs from row by row\n", (long long)M,
                (long long)K, bf ? "bf16" : "f32", acc);
    }
    /* and each element alone: one row, one column of w */
    int64_t odd = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const void *wn = bf ? (const void *)(wb + n * K) : (const void *)(w + n * K);
            float e = init[m * N + n];
            dfl_cpu_gemm_nt_few_rows(&e, x + m * K, wn, dt, 1, K, 1, acc);
            odd += memcmp(&e, &all[m * N + n], sizeof e) != 0;
        }
    if (odd) {
        bad = 1;
        fprintf(stderr, "  few rows: M %lld K %lld %s acc %d: %lld elements differ from the element alone\n",
                (long long)M, (long long)K, bf ? "bf16" : "f32", acc, (long long)odd);
    }
    ops->free(x), ops->free(init), ops->free(all), ops->free(one);
    return bad;
}

static void test_few_rows_grouping(void) {
    static const int64_t Ks[] = {259, 267, 1031, 1050};
    const int64_t N = 37;
    dfl_rng r;
    dfl_rng_seed(&r, 43);
    int bad = 0, cases = 0;
    for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
        const int64_t K = Ks[ki];
        float *w = fbuf(N * K);
        frand(w, N * K, &r, 1.0f);
        uint16_t *wb = malloc((size_t)(N * K) * sizeof *wb);
        for (int64_t i = 0; i < N * K; i++) wb[i] = dfl_f32_to_bf16(w[i]);
        for (int64_t M = 1; M <= DFL_CPU_FEW_ROWS_LONG_K; M++)
            for (int bf = 0; bf < 2; bf++)
                for (int acc = 0; acc < 2; acc++) bad += few_rows_case(w, wb, M, K, N, bf, acc, &r), cases++;
        ops->free(w);
        free(wb);
    }
    T_CHECKF(bad == 0, "%d of %d few-rows products differ from their rows or elements alone", bad, cases);
    printf("  few rows, K 259, 267, 1031 and 1050 x M 1..%d x f32/bf16 x acc: %d cases, each row and each element bitwise "
           "alone\n", DFL_CPU_FEW_ROWS_LONG_K, cases);
}

/* The few-rows kernel's arithmetic, element by element, against a scalar
 * model of it: eight lanes over k in steps of 8, lane l summing x[k + l] *
 * w[k + l] in order, the lanes added pairwise ((s0 + s1) + (s2 + s3)) + ...,
 * then the tail one by one, then the output's old value where it
 * accumulates. The x86-64-v3 clone fuses each multiply-add (one rounding,
 * fmaf), the baseline does not (two): the model takes the form the CPU's
 * clone has, and the kernel must give its bits exactly. So the summation
 * order the kernel's guarantees rest on is pinned, not only consistent with
 * itself, and a build that lost the fusing fails here. Shapes: K with no
 * 8-wide step (5), one (8), steps and a tail (37, 259, 1031: tiles that
 * prefetch from 2 rows on), M 1 to 17 (tiles of 4, 3, 2 and 1 rows on 3
 * columns, of 8, 4 and 1 on the last, N 7's seventh), f32 and bf16 weights
 * (widened into a buffer from 8 rows on), overwrite and accumulate. */
static int cpu_fuses_few_rows(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    return __builtin_cpu_supports("x86-64-v3"); /* what picks the clone */
#elif defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static float few_rows_model(const float *x, const float *w, int64_t K, int fused) {
    float lane[8] = {0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; l++) lane[l] = fused ? fmaf(x[k + l], w[k + l], lane[l]) : lane[l] + x[k + l] * w[k + l];
    float r = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; k < K; k++) r = fused ? fmaf(x[k], w[k], r) : r + x[k] * w[k];
    return r;
}

static void test_few_rows_exact_sums(void) {
    static const int64_t Ks[] = {5, 8, 37, 259, 1031};
    const int64_t N = 7, maxM = 17;
    const int fused = cpu_fuses_few_rows();
    dfl_rng r;
    dfl_rng_seed(&r, 47);
    int64_t checked = 0, wrong = 0;
    for (size_t ki = 0; ki < sizeof Ks / sizeof *Ks; ki++) {
        const int64_t K = Ks[ki];
        float *x = fbuf(maxM * K), *w = fbuf(N * K), *init = fbuf(maxM * N), *out = fbuf(maxM * N);
        uint16_t *wb = malloc((size_t)(N * K) * sizeof *wb);
        frand(x, maxM * K, &r, 1.0f), frand(w, N * K, &r, 1.0f), frand(init, maxM * N, &r, 1.0f);
        for (int64_t i = 0; i < N * K; i++) wb[i] = dfl_f32_to_bf16(w[i]), w[i] = dfl_bf16_to_f32(wb[i]);
        for (int64_t M = 1; M <= maxM; M++)
            for (int bf = 0; bf < 2; bf++)
                for (int acc = 0; acc < 2; acc++) {
                    memcpy(out, init, (size_t)(M * N) * sizeof *out);
                    dfl_cpu_gemm_nt_few_rows(out, x, bf ? (const void *)wb : w, bf ? DFL_BF16 : DFL_F32, M, K, N, acc);
                    for (int64_t m = 0; m < M; m++)
                        for (int64_t n = 0; n < N; n++) {
                            const float s = few_rows_model(x + m * K, w + n * K, K, fused);
                            const float want = acc ? init[m * N + n] + s : s;
                            if (memcmp(&want, &out[m * N + n], sizeof want) && wrong++ < 3)
                                fprintf(stderr, "  few rows M %lld K %lld %s acc %d [%lld, %lld]: %.9g, model %.9g\n",
                                        (long long)M, (long long)K, bf ? "bf16" : "f32", acc, (long long)m,
                                        (long long)n, out[m * N + n], want);
                            checked++;
                        }
                }
        ops->free(x), ops->free(w), ops->free(init), ops->free(out);
        free(wb);
    }
    T_CHECKF(wrong == 0, "%lld of %lld few-rows elements differ from the %s model", (long long)wrong,
             (long long)checked, fused ? "fused" : "unfused");
    printf("  few rows, %lld elements        the bits of the %s multiply-add model\n", (long long)checked,
           fused ? "fused" : "unfused");
}

/* Which path the matmul op and the grouped product take, bit for bit: the
 * few-rows kernel up to DFL_CPU_FEW_ROWS rows, and up to
 * DFL_CPU_FEW_ROWS_LONG_K from K DFL_CPU_LONG_K on; sgemm (bf16 weights:
 * dfl_cpu_gemm_nt_bf16) one row past each. Both entry points must draw the
 * line at the same place, or a group's bits would depend on whether it came
 * through matmul_grouped; and the limits the comments give must be the
 * ones the code applies. Each case first checks that the two paths differ
 * on its data somewhere, so that the comparison can tell them apart. */
static int dispatch_case(int64_t M, int64_t K, int bf, dfl_rng *r) {
    const int64_t N = 40;
    float *x = fbuf(M * K), *w = fbuf(N * K), *few = fbuf(M * N), *tiled = fbuf(M * N), *got = fbuf(M * N);
    uint16_t *wb = malloc((size_t)(N * K) * sizeof *wb);
    frand(x, M * K, r, 1.0f), frand(w, N * K, r, 1.0f);
    for (int64_t i = 0; i < N * K; i++) wb[i] = dfl_f32_to_bf16(w[i]), w[i] = dfl_bf16_to_f32(wb[i]);
    const void *wt = bf ? (const void *)wb : w;
    const size_t bytes = (size_t)(M * N) * sizeof *got;
    dfl_cpu_gemm_nt_few_rows(few, x, wt, bf ? DFL_BF16 : DFL_F32, M, K, N, 0);
    dfl_cpu_sgemm(0, 1, M, N, K, x, K, w, K, 0.0f, tiled, N);
    const int want_few = M <= DFL_CPU_FEW_ROWS || (M <= DFL_CPU_FEW_ROWS_LONG_K && K >= DFL_CPU_LONG_K);
    const float *want = want_few ? few : tiled;
    int bad = 0;
    if (!memcmp(few, tiled, bytes)) {
        fprintf(stderr, "  dispatch M %lld K %lld: both paths give the same bits; the case tells nothing\n",
                (long long)M, (long long)K);
        bad = 1;
    }
    const int64_t off[2] = {0, M};
    dfl_cpu_matmul_grouped(got, x, wt, bf ? DFL_BF16 : DFL_F32, off, 1, 0, K, N, 0);
    if (memcmp(got, want, bytes)) {
        fprintf(stderr, "  dispatch M %lld K %lld %s: matmul_grouped is not the %s path\n", (long long)M,
                (long long)K, bf ? "bf16" : "f32", want_few ? "few-rows" : "sgemm");
        bad = 1;
    }
    if (!bf) {
        dfl_cpu_matmul(got, x, w, M, K, N, 0);
        if (memcmp(got, want, bytes)) {
            fprintf(stderr, "  dispatch M %lld K %lld: the matmul op is not the %s path\n", (long long)M,
                    (long long)K, want_few ? "few-rows" : "sgemm");
            bad = 1;
        }
    }
    ops->free(x), ops->free(w), ops->free(few), ops->free(tiled), ops->free(got);
    free(wb);
    return bad;
}

static void test_gemm_nt_dispatch(void) {
    static const struct {
        int64_t M, K;
    } cases[] = {
        {DFL_CPU_FEW_ROWS, 259},
        {DFL_CPU_FEW_ROWS + 1, 259},
        {DFL_CPU_FEW_ROWS_LONG_K, DFL_CPU_LONG_K - 1},
        {DFL_CPU_FEW_ROWS + 1, DFL_CPU_LONG_K},
        {DFL_CPU_FEW_ROWS_LONG_K, DFL_CPU_LONG_K},
        {DFL_CPU_FEW_ROWS_LONG_K + 1, DFL_CPU_LONG_K},
        {DFL_CPU_FEW_ROWS_LONG_K, 2 * DFL_CPU_LONG_K + 3},
        {DFL_CPU_FEW_ROWS_LONG_K + 1, 2 * DFL_CPU_LONG_K + 3},
    };
    dfl_rng r;
    dfl_rng_seed(&r, 44);
    int bad = 0, n = 0;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int bf = 0; bf < 2; bf++) bad += dispatch_case(cases[c].M, cases[c].K, bf, &r), n++;
    T_CHECKF(bad == 0, "%d of %d products took another path than the limits say", bad, n);
    printf("  few-rows kernel up to %d rows (%d from K %d on), sgemm past: %d cases, matmul and matmul_grouped, "
           "f32 and bf16, bit for bit\n", DFL_CPU_FEW_ROWS, DFL_CPU_FEW_ROWS_LONG_K, DFL_CPU_LONG_K, n);
}

/* matmul FD: L = sum dout * (x w^T) */
typedef struct {
    float *x, *w, *dout, *out;
    int64_t M, K, N;
} mm_ctx;

static double mm_loss(void *p) {
    mm_ctx *c = p;
    ops->matmul(c->out, c->x, c->w, c->M, c->K, c->N, 0);
    return dot_d(c->out, c->dout, c->M * c->N);
}

static void test_matmul_fd(void) {
    mm_ctx c = {NULL, NULL, NULL, NULL, 9, 17, 5};
    dfl_rng r;
    dfl_rng_seed(&r, 1);
    c.x = fbuf(c.M * c.K), c.w = fbuf(c.N * c.K), c.dout = fbuf(c.M * c.N), c.out = fbuf(c.M * c.N);
    frand(c.x, c.M * c.K, &r, 1), frand(c.w, c.N * c.K, &r, 1), frand(c.dout, c.M * c.N, &r, 1);
    float *din = fbuf(c.M * c.K), *dw = fbuf(c.N * c.K);
    ops->matmul_bwd(din, dw, c.dout, c.x, c.w, c.M, c.K, c.N, DFL_ACC_DIN | DFL_ACC_DW);
    check_fd("matmul din", mm_loss, &c, c.x, din, c.M * c.K, 11);
    check_fd("matmul dw", mm_loss, &c, c.w, dw, c.N * c.K, 12);
    ops->free(c.x), ops->free(c.w), ops->free(c.dout), ops->free(c.out), ops->free(din), ops->free(dw);
}

static void test_rmsnorm(void) {
    const int64_t rows = 5, dim = 37;
    float *x = fx(fx_dense, "rms.in", NULL), *w = fx(fx_dense, "rms.w", NULL), *ref = fx(fx_dense, "rms.out", NULL);
    float *rref = fx(fx_dense, "rms.rstd", NULL), *eps = fx(fx_dense, "rms.eps", NULL);
    float *out = fbuf(rows * dim), *rstd = fbuf(rows);
    ops->rmsnorm(out, rstd, x, w, rows, dim, eps[0]);
    CHECK_NMSE("rmsnorm out", out, ref, rows * dim, NMSE_F32);
    CHECK_NMSE("rmsnorm rstd", rstd, rref, rows, NMSE_F32);
    ops->rmsnorm(out, NULL, x, w, rows, dim, eps[0]); /* rstd may be NULL */
    CHECK_NMSE("rmsnorm out (rstd NULL)", out, ref, rows * dim, NMSE_F32);
    /* (1 + w) (Qwen3.5): the weight minus one through rmsnorm1p gives the
     * same bits (1 + (w - 1) is w exactly for these w in [0.5, 2]) */
    float *wm1 = minus(w, 1.0f, dim), *out1 = fbuf(rows * dim);
    int exact = 1;
    for (int64_t i = 0; i < dim; i++) exact &= (wm1[i] + 1.0f) == w[i];
    ops->rmsnorm1p(out1, x, wm1, rows, dim, eps[0]);
    T_CHECK(!exact || !memcmp(out1, out, (size_t)(rows * dim) * 4));
    CHECK_NMSE("rmsnorm1p out", out1, ref, rows * dim, NMSE_F32);
    ops->free(wm1), ops->free(out1);

    float *dout = fx(fx_dense, "rms.dout", NULL), *rdin = fx(fx_dense, "rms.din", NULL),
          *rdw = fx(fx_dense, "rms.dw", NULL);
    float *din = fbuf(rows * dim), *dw = fbuf(dim);
    for (int64_t i = 0; i < rows * dim; i++) din[i] = 0.5f;
    for (int64_t i = 0; i < dim; i++) dw[i] = 3.0f;
    ops->rmsnorm_bwd(din, dw, dout, x, rstd, w, rows, dim);
    float *d1 = minus(din, 0.5f, rows * dim), *d2 = minus(dw, 3.0f, dim);
    CHECK_NMSE("rmsnorm_bwd din (+=)", d1, rdin, rows * dim, NMSE_F32);
    CHECK_NMSE("rmsnorm_bwd dw (+=)", d2, rdw, dim, NMSE_F32);
    ops->free(x), ops->free(w), ops->free(ref), ops->free(rref), ops->free(eps), ops->free(out), ops->free(rstd);
    ops->free(dout), ops->free(rdin), ops->free(rdw), ops->free(din), ops->free(dw), ops->free(d1), ops->free(d2);
}

typedef struct {
    float *x, *w, *dout, *out, *rstd;
    int64_t rows, dim;
} rms_ctx;

static double rms_loss(void *p) {
    rms_ctx *c = p;
    ops->rmsnorm(c->out, c->rstd, c->x, c->w, c->rows, c->dim, 1e-6f);
    return dot_d(c->out, c->dout, c->rows * c->dim);
}

static void test_rmsnorm_fd(void) {
    rms_ctx c = {NULL, NULL, NULL, NULL, NULL, 300, 41}; /* many rows: dw sums across threads */
    dfl_rng r;
    dfl_rng_seed(&r, 2);
    int64_t n = c.rows * c.dim;
    c.x = fbuf(n), c.w = fbuf(c.dim), c.dout = fbuf(n), c.out = fbuf(n), c.rstd = fbuf(c.rows);
    frand(c.x, n, &r, 1), frand(c.w, c.dim, &r, 1), frand(c.dout, n, &r, 1);
    float *din = fbuf(n), *dw = fbuf(c.dim);
    rms_loss(&c);
    ops->rmsnorm_bwd(din, dw, c.dout, c.x, c.rstd, c.w, c.rows, c.dim);
    check_fd("rmsnorm din", rms_loss, &c, c.x, din, n, 21);
    check_fd("rmsnorm dw", rms_loss, &c, c.w, dw, c.dim, 22);
    /* NULL gradients */
    float *din2 = fbuf(n), *dw2 = fbuf(c.dim);
    ops->rmsnorm_bwd(din2, NULL, c.dout, c.x, c.rstd, c.w, c.rows, c.dim);
    ops->rmsnorm_bwd(NULL, dw2, c.dout, c.x, c.rstd, c.w, c.rows, c.dim);
    T_CHECK(!memcmp(din, din2, (size_t)n * 4) && !memcmp(dw, dw2, (size_t)c.dim * 4));
    ops->free(c.x), ops->free(c.w), ops->free(c.dout), ops->free(c.out), ops->free(c.rstd);
    ops->free(din), ops->free(dw), ops->free(din2), ops->free(dw2);
}

static void test_rope(void) {
    const int64_t T = 6, nh = 3, d = 10;
    float *x = fx(fx_dense, "rope.x", NULL), *inv = fx(fx_dense, "rope.inv_freq", NULL),
          *ref = fx(fx_dense, "rope.out", NULL), *dout = fx(fx_dense, "rope.dout", NULL),
          *rdx = fx(fx_dense, "rope.dx", NULL);
    int32_t *pos = fxi(fx_dense, "rope.pos", NULL);
    float *y = fcopy(x, T * nh * d);
    ops->rope(y, pos, inv, 1.0f, T, nh, d, 0);
    CHECK_NMSE("rope out", y, ref, T * nh * d, NMSE_F32);
    /* the backward is the inverse rotation of dout (autograd fixture) */
    float *g = fcopy(dout, T * nh * d);
    ops->rope(g, pos, inv, 1.0f, T, nh, d, 1);
    CHECK_NMSE("rope inverse = autograd dx", g, rdx, T * nh * d, NMSE_F32);
    /* YaRN's scale: the rotation times the scale (transformers scales its
     * cos and sin tables), forward and backward */
    float *ys = fcopy(x, T * nh * d), *gs = fcopy(dout, T * nh * d), *want = fbuf(T * nh * d);
    ops->rope(ys, pos, inv, 1.25f, T, nh, d, 0);
    for (int64_t i = 0; i < T * nh * d; i++) want[i] = 1.25f * y[i];
    CHECK_NMSE("rope scaled = scale * rope", ys, want, T * nh * d, NMSE_F32);
    ops->rope(gs, pos, inv, 1.25f, T, nh, d, 1);
    for (int64_t i = 0; i < T * nh * d; i++) want[i] = 1.25f * rdx[i];
    CHECK_NMSE("rope scaled, backward = scale * autograd dx", gs, want, T * nh * d, NMSE_F32);
    /* inverse(forward(x)) = x */
    ops->rope(y, pos, inv, 1.0f, T, nh, d, 1);
    CHECK_NMSE("rope inverse(rope(x))", y, x, T * nh * d, NMSE_F32);
    /* a zero frequency (a partial RoPE's pass-through pair) is neither
     * rotated nor scaled, as transformers leaves those dims */
    float *z = fcopy(x, T * nh * d), inv0[5];
    for (int i = 0; i < 5; i++) inv0[i] = i == 2 ? 0.0f : inv[i];
    ops->rope(z, pos, inv0, 1.25f, T, nh, d, 0);
    int kept = 1, scaled = 1;
    for (int64_t r = 0; r < T * nh; r++) {
        kept &= z[r * d + 2] == x[r * d + 2] && z[r * d + 7] == x[r * d + 7];
        scaled &= pos[r / nh] != 0 || (z[r * d] == 1.25f * x[r * d]); /* at position 0 the rotation is the scale */
    }
    T_CHECK(kept && scaled);
    ops->free(ys), ops->free(gs), ops->free(want), ops->free(z);
    ops->free(x), ops->free(inv), ops->free(ref), ops->free(dout), ops->free(rdx), ops->free(pos), ops->free(y);
    ops->free(g);
}

/* YaRN against transformers (tests/fixtures/ops/rope_yarn.safetensors):
 * the config as the file stores it, through the config parser, gives the
 * frequencies and the scale on cos and sin that Qwen3RotaryEmbedding
 * computes, and the op with them its rotation and autograd backward. */
static void test_rope_yarn(void) {
    for (int k = 0; k < 4; k++) {
        char key[64];
        snprintf(key, sizeof key, "yarn%d.config", k);
        const char *json = dfl_st_meta(fx_yarn, key);
        dfl_model_config c;
        T_CHECKF(json && dfl_model_config_parse(&c, json, strlen(json), key, "target") == 0, "%s: %s", key,
                 json ? dfl_errmsg() : "missing");
        if (!json) continue;
        T_CHECKF(c.rope_type == DFL_ROPE_YARN, "%s: rope type %d", key, (int)c.rope_type);
        int64_t nf, n;
#define YX(name, out) (snprintf(key, sizeof key, "yarn%d." name, k), fx(fx_yarn, key, out))
        float *want_f = YX("inv_freq", &nf), *want_s = YX("scale", NULL), *x = YX("x", &n), *ref = YX("out", NULL);
        float *dout = YX("dout", NULL), *rdx = YX("dx", NULL);
        snprintf(key, sizeof key, "yarn%d.pos", k);
        int32_t *pos = fxi(fx_yarn, key, NULL);
#undef YX
        const int64_t d = c.head_dim, T = fx_find(fx_yarn, key)->shape[0], nh = n / (T * d);
        T_CHECKF(nf == d / 2, "case %d: %lld frequencies for head_dim %lld", k, (long long)nf, (long long)d);
        float *f = fbuf(d / 2), scale = dfl_rope_scale(&c);
        dfl_rope_inv_freq(&c, f);
        double worst = 0;
        for (int64_t i = 0; i < nf; i++) worst = fmax(worst, fabs(f[i] - want_f[i]) / want_f[i]);
        /* torch's pow may differ from powf by an ulp */
        printf("  yarn%d inv_freq worst relative error %.3g, scale %.9g\n", k, worst, scale);
        T_CHECKF(worst <= 2.5e-7, "case %d: inv_freq relative error %.3g", k, worst);
        T_CHECKF(scale == want_s[0], "case %d: scale %.9g, transformers %.9g", k, scale, want_s[0]);
        float *y = fcopy(x, n), *g = fcopy(dout, n);
        ops->rope(y, pos, f, scale, T, nh, d, 0);
        char what[64];
        snprintf(what, sizeof what, "yarn%d rope out", k);
        CHECK_NMSE(what, y, ref, n, NMSE_F32);
        ops->rope(g, pos, f, scale, T, nh, d, 1);
        snprintf(what, sizeof what, "yarn%d rope dx", k);
        CHECK_NMSE(what, g, rdx, n, NMSE_F32);
        ops->free(want_f), ops->free(want_s), ops->free(x), ops->free(ref), ops->free(dout), ops->free(rdx);
        ops->free(pos), ops->free(f), ops->free(y), ops->free(g);
        dfl_model_config_free(&c);
    }
}

typedef struct {
    float *x, *y, *dout, *inv;
    int32_t *pos;
    int64_t T, nh, d;
    float scale;
} rope_ctx;

static double rope_loss(void *p) {
    rope_ctx *c = p;
    int64_t n = c->T * c->nh * c->d;
    memcpy(c->y, c->x, (size_t)n * 4);
    ops->rope(c->y, c->pos, c->inv, c->scale, c->T, c->nh, c->d, 0);
    return dot_d(c->y, c->dout, n);
}

static void test_rope_fd(void) {
    rope_ctx c = {NULL, NULL, NULL, NULL, NULL, 5, 3, 14, 1.1386294f}; /* a YaRN scale */
    dfl_rng r;
    dfl_rng_seed(&r, 3);
    int64_t n = c.T * c.nh * c.d;
    c.x = fbuf(n), c.y = fbuf(n), c.dout = fbuf(n), c.inv = fbuf(c.d / 2), c.pos = ops->alloc((size_t)c.T * 4);
    frand(c.x, n, &r, 1), frand(c.dout, n, &r, 1);
    for (int64_t i = 0; i < c.d / 2; i++) c.inv[i] = (float)pow(10000.0, -2.0 * (double)i / (double)c.d);
    for (int64_t t = 0; t < c.T; t++) c.pos[t] = (int32_t)(t * 37 + 2);
    float *g = fcopy(c.dout, n);
    ops->rope(g, c.pos, c.inv, c.scale, c.T, c.nh, c.d, 1);
    check_fd("rope, scaled (inverse as backward)", rope_loss, &c, c.x, g, n, 31);
    ops->free(c.x), ops->free(c.y), ops->free(c.dout), ops->free(c.inv), ops->free(c.pos), ops->free(g);
}

/* The q/k norm with its RoPE (qk_norm_rope) and its backward, against
 * finite differences of the forward; din must be written over (its noise
 * gone), dw added to. */
typedef struct {
    float *x, *w, *y, *dout, *inv, *rstd;
    int32_t *pos;
    int64_t T, nh, d;
    float scale;
} qknr_ctx;

static double qknr_loss(void *p) {
    qknr_ctx *c = p;
    ops->qk_norm_rope(c->y, c->rstd, c->x, c->w, 0, c->pos, c->inv, c->scale, c->T, c->nh, c->d, 1e-6f);
    return dot_d(c->y, c->dout, c->T * c->nh * c->d);
}

static void qk_norm_rope_fd(float scale) {
    qknr_ctx c = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, 40, 3, 14, scale}; /* 120 rows: dw over several chunks */
    dfl_rng r;
    dfl_rng_seed(&r, 4);
    const int64_t n = c.T * c.nh * c.d;
    c.x = fbuf(n), c.w = fbuf(c.d), c.y = fbuf(n), c.dout = fbuf(n), c.inv = fbuf(c.d / 2), c.rstd = fbuf(c.T * c.nh);
    c.pos = ops->alloc((size_t)c.T * 4);
    frand(c.x, n, &r, 1), frand(c.w, c.d, &r, 1), frand(c.dout, n, &r, 1);
    for (int64_t i = 0; i < c.d / 2; i++) c.inv[i] = (float)pow(10000.0, -2.0 * (double)i / (double)c.d);
    for (int64_t t = 0; t < c.T; t++) c.pos[t] = (int32_t)(t * 37 + 2);
    float *din = fbuf(n), *dw = fbuf(c.d);
    for (int64_t i = 0; i < n; i++) din[i] = 1e9f;
    for (int64_t i = 0; i < c.d; i++) dw[i] = 3.0f;
    qknr_loss(&c);
    ops->qk_norm_rope_bwd(din, dw, c.dout, c.x, c.rstd, c.w, c.pos, c.inv, c.scale, c.T, c.nh, c.d);
    float *dw1 = minus(dw, 3.0f, c.d);
    check_fd("qk_norm_rope din (written)", qknr_loss, &c, c.x, din, n, 41);
    check_fd("qk_norm_rope dw (+=)", qknr_loss, &c, c.w, dw1, c.d, 42);
    ops->free(c.x), ops->free(c.w), ops->free(c.y), ops->free(c.dout), ops->free(c.inv), ops->free(c.rstd);
    ops->free(c.pos), ops->free(din), ops->free(dw), ops->free(dw1);
}

static void test_qk_norm_rope_fd(void) {
    qk_norm_rope_fd(1.0f);
    qk_norm_rope_fd(1.1386294f); /* YaRN's scale on cos and sin */
}

static void test_swiglu(void) {
    int64_t n;
    float *g = fx(fx_dense, "sw.gate", &n), *u = fx(fx_dense, "sw.up", NULL), *ref = fx(fx_dense, "sw.out", NULL),
          *dout = fx(fx_dense, "sw.dout", NULL), *rdg = fx(fx_dense, "sw.dgate", NULL),
          *rdu = fx(fx_dense, "sw.dup", NULL);
    float *out = fbuf(n), *dg = fbuf(n), *du = fbuf(n);
    ops->swiglu(out, g, u, n);
    CHECK_NMSE("swiglu out", out, ref, n, NMSE_F32);
    for (int64_t i = 0; i < n; i++) dg[i] = 1, du[i] = -1;
    ops->swiglu_bwd(dg, du, dout, g, u, n, 1);
    float *d1 = minus(dg, 1, n), *d2 = minus(du, -1, n);
    CHECK_NMSE("swiglu_bwd dgate (+=)", d1, rdg, n, NMSE_F32);
    CHECK_NMSE("swiglu_bwd dup (+=)", d2, rdu, n, NMSE_F32);
    memcpy(d1, dg, (size_t)n * 4);
    ops->swiglu_bwd(dg, NULL, dout, g, u, n, 1);
    for (int64_t i = 0; i < n; i++) d1[i] = dg[i] - d1[i];
    CHECK_NMSE("swiglu_bwd dgate, dup NULL", d1, rdg, n, NMSE_F32);
    for (int64_t i = 0; i < n; i++) dg[i] = 1e9f, du[i] = 1e9f; /* overwritten, not accumulated */
    ops->swiglu_bwd(dg, du, dout, g, u, n, 0);
    CHECK_NMSE("swiglu_bwd dgate (=)", dg, rdg, n, NMSE_F32);
    CHECK_NMSE("swiglu_bwd dup (=)", du, rdu, n, NMSE_F32);
    ops->free(g), ops->free(u), ops->free(ref), ops->free(dout), ops->free(rdg), ops->free(rdu);
    ops->free(out), ops->free(dg), ops->free(du), ops->free(d1), ops->free(d2);
}

typedef struct {
    float *g, *u, *dout, *out;
    int64_t n;
} sw_ctx;

static double sw_loss(void *p) {
    sw_ctx *c = p;
    ops->swiglu(c->out, c->g, c->u, c->n);
    return dot_d(c->out, c->dout, c->n);
}

static void test_swiglu_fd(void) {
    sw_ctx c = {NULL, NULL, NULL, NULL, 301};
    dfl_rng r;
    dfl_rng_seed(&r, 4);
    c.g = fbuf(c.n), c.u = fbuf(c.n), c.dout = fbuf(c.n), c.out = fbuf(c.n);
    frand(c.g, c.n, &r, 3), frand(c.u, c.n, &r, 1), frand(c.dout, c.n, &r, 1);
    float *dg = fbuf(c.n), *du = fbuf(c.n);
    ops->swiglu_bwd(dg, du, c.dout, c.g, c.u, c.n, 1);
    check_fd("swiglu dgate", sw_loss, &c, c.g, dg, c.n, 41);
    check_fd("swiglu dup", sw_loss, &c, c.u, du, c.n, 42);
    ops->free(c.g), ops->free(c.u), ops->free(c.dout), ops->free(c.out), ops->free(dg), ops->free(du);
}

/* gpt-oss's clamped SwiGLU against the formula in double. */
static double swiglu_oss_d(float gate, float up, float alpha, float limit) {
    double g = gate > limit ? limit : gate, u = up > limit ? limit : up < -limit ? -limit : up;
    return (u + 1) * g / (1 + exp(-(double)alpha * g));
}

static void test_swiglu_oss(void) {
    const int64_t n = 1001;
    const float alpha = 1.702f, limit = 2.5f;
    dfl_rng r;
    dfl_rng_seed(&r, 61);
    float *g = fbuf(n), *u = fbuf(n), *out = fbuf(n), *want = fbuf(n);
    frand(g, n, &r, 4), frand(u, n, &r, 4);
    /* the edges exactly, just past them, and far past them */
    const float edge[] = {limit, -limit, nextafterf(limit, 9), nextafterf(-limit, -9), 40, -40};
    for (int i = 0; i < 6; i++) g[i] = edge[i], u[i] = 0.5f, g[i + 6] = 1.0f, u[i + 6] = edge[i];
    int64_t hit[3] = {0, 0, 0}; /* gate > limit, up > limit, up < -limit */
    for (int64_t i = 0; i < n; i++) {
        hit[0] += g[i] > limit, hit[1] += u[i] > limit, hit[2] += u[i] < -limit;
        want[i] = (float)swiglu_oss_d(g[i], u[i], alpha, limit);
    }
    T_CHECKF(hit[0] > 10 && hit[1] > 10 && hit[2] > 10, "clamps hit %lld %lld %lld times", (long long)hit[0],
             (long long)hit[1], (long long)hit[2]);
    ops->swiglu_oss(out, g, u, n, alpha, limit);
    CHECK_NMSE("swiglu_oss vs double", out, want, n, NMSE_F32);
    /* past the limit the output is the edge's, exactly; gate has no lower clamp (-40: ~0) */
    T_CHECK(out[0] == out[2] && out[0] == out[4] && out[6] == out[8] && out[6] == out[10]);
    T_CHECK(out[7] == out[9] && out[7] == out[11] && fabsf(out[5]) < 1e-20f && out[1] < -0.01f);
    ops->swiglu_oss(g, g, u, n, alpha, limit); /* out aliases gate */
    CHECK_NMSE("swiglu_oss (out = gate)", g, want, n, NMSE_F32);
    /* NaN stays NaN, as torch.clamp keeps it */
    float gn[2] = {NAN, 1.0f}, un[2] = {0.5f, NAN}, on[2];
    ops->swiglu_oss(on, gn, un, 2, alpha, limit);
    T_CHECKF(isnan(on[0]) && isnan(on[1]), "NaN in: %g %g out", on[0], on[1]);
    ops->free(g), ops->free(u), ops->free(out), ops->free(want);
}

/* transformers' GptOssExperts._apply_gate on interleaved gate_up [N, 2I] */
static void test_swiglu_oss_fixture(void) {
    int64_t n2;
    float *gu = fx(fx_oss, "oss.gate_up", &n2), *ref = fx(fx_oss, "oss.out", NULL);
    float *a = fx(fx_oss, "oss.alpha", NULL), *l = fx(fx_oss, "oss.limit", NULL);
    const int64_t n = n2 / 2;
    float *g = fbuf(n), *u = fbuf(n), *out = fbuf(n);
    for (int64_t i = 0; i < n; i++) g[i] = gu[2 * i], u[i] = gu[2 * i + 1];
    ops->swiglu_oss(out, g, u, n, a[0], l[0]);
    CHECK_NMSE("swiglu_oss vs transformers", out, ref, n, NMSE_F32);
    ops->free(gu), ops->free(ref), ops->free(a), ops->free(l), ops->free(g), ops->free(u), ops->free(out);
}

/* attn_sinks against the formula in double, with lse far below and far
 * above the sink (factor ~0 and ~1) and in between. Every row is also
 * checked alone, so rows scaled to almost nothing count. */
static void test_attn_sinks(void) {
    const int64_t T = 11, Hq = 3, D = 7, n = T * Hq * D;
    const float sinks[3] = {-1.5f, 0.25f, 3.0f};
    const float off[] = {-200, -60, -20, -3, -0.5f, 0, 0.5f, 3, 20, 60, 200}; /* lse - sink, by t */
    dfl_rng r;
    dfl_rng_seed(&r, 62);
    float *out = fbuf(n), *lse = fbuf(T * Hq), *want = fbuf(n);
    frand(out, n, &r, 1);
    double worst = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hq; h++) {
            lse[t * Hq + h] = sinks[h] + off[t] + 0.1f * (float)h;
            double f = 1 / (1 + exp((double)sinks[h] - lse[t * Hq + h]));
            for (int64_t c = 0; c < D; c++) want[(t * Hq + h) * D + c] = (float)(out[(t * Hq + h) * D + c] * f);
        }
    ops->attn_sinks(out, lse, sinks, T, Hq, D);
    CHECK_NMSE("attn_sinks vs double", out, want, n, NMSE_F32);
    for (int64_t row = 0; row < T * Hq; row++) {
        double e = 0, m = 0;
        for (int64_t c = 0; c < D; c++) {
            const int64_t i = row * D + c;
            e = fmax(e, fabs((double)out[i] - want[i])), m = fmax(m, fabs((double)want[i]));
        }
        if (m > 0) worst = fmax(worst, e / m);
        else T_CHECKF(e == 0, "row %lld: %g where 0", (long long)row, e);
    }
    printf("  %-28s max rel err %.2e (<= 1e-6)\n", "attn_sinks per row", worst);
    T_CHECKF(worst <= 1e-6, "attn_sinks: a row off by %.3g relative", worst);
    ops->free(out), ops->free(lse), ops->free(want);
}

/* transformers' gpt-oss eager attention (sinks, a causal sliding window
 * W) as attn_dflash with blocks of 1 (row i: keys i-W < j <= i, its own
 * key as the block), then attn_sinks on the lse it saved. */
static void test_attn_sinks_fixture(void) {
    int32_t *dims = fxi(fx_oss, "sink.dims", NULL);
    const int64_t T = dims[0], Hq = dims[1], Hkv = dims[2], D = dims[3], W = dims[4];
    float *q = fx(fx_oss, "sink.q", NULL), *k = fx(fx_oss, "sink.k", NULL), *v = fx(fx_oss, "sink.v", NULL);
    float *sinks = fx(fx_oss, "sink.sinks", NULL), *ref = fx(fx_oss, "sink.out", NULL);
    dfl_block *blocks = calloc((size_t)T, sizeof *blocks);
    for (int64_t i = 0; i < T; i++) {
        int32_t lo = (int32_t)(i - W + 1 > 0 ? i - W + 1 : 0);
        blocks[i] = (dfl_block){lo, (int32_t)i - lo, (int32_t)i};
    }
    float *out = fbuf(T * Hq * D), *lse = fbuf(T * Hq);
    ops->attn_dflash(out, lse, q, k, v, blocks, T, 1, T, Hq, Hkv, D, 0);
    /* the sinks matter here: without them the output is far off */
    double e0 = t_nmse_f32(out, ref, T * Hq * D);
    printf("  %-28s nmse %.2e (>= 1e-2)\n", "attn window, sinks left out", e0);
    T_CHECKF(e0 >= 1e-2, "the fixture does not depend on the sinks: nmse %.3g", e0);
    ops->attn_sinks(out, lse, sinks, T, Hq, D);
    CHECK_NMSE("attn window + sinks vs HF", out, ref, T * Hq * D, NMSE_F32);
    ops->free(dims), ops->free(q), ops->free(k), ops->free(v), ops->free(sinks), ops->free(ref);
    ops->free(out), ops->free(lse), free(blocks);
}

static void test_add_embed_sumsq(void) {
    float a[5] = {1, 2, 3, 4, 5}, b[5] = {0.5f, -2, 1e-8f, 0, 7}, out[5];
    ops->add(out, a, b, 5);
    for (int i = 0; i < 5; i++) T_CHECK(out[i] == a[i] + b[i]);
    ops->add(a, a, b, 5); /* aliasing */
    T_CHECK(a[0] == 1.5f && a[4] == 12.0f);
    /* bias[c] added to each row: 3 rows of 5 */
    float xb[15], bias[5] = {0.25f, -1, 3, 0, 1e-3f};
    for (int i = 0; i < 15; i++) xb[i] = (float)i;
    ops->add_bias(xb, bias, 3, 5);
    for (int i = 0; i < 15; i++) T_CHECKF(xb[i] == (float)i + bias[i % 5], "add_bias [%d] %g", i, xb[i]);

    float table[4 * 3];
    for (int i = 0; i < 12; i++) table[i] = (float)i;
    int32_t ids[3] = {2, 0, 3};
    float e[9];
    ops->embed(e, ids, table, 3, 3);
    for (int t = 0; t < 3; t++)
        for (int c = 0; c < 3; c++) T_CHECK(e[t * 3 + c] == table[ids[t] * 3 + c]);

    /* sumsq: many terms of mixed scale, against a compensated double sum */
    int64_t n = 200003;
    float *x = fbuf(n);
    dfl_rng r;
    dfl_rng_seed(&r, 5);
    frand(x, n, &r, 1);
    x[7] = 1e4f;
    long double want = 0;
    for (int64_t i = 0; i < n; i++) want += (long double)x[i] * x[i];
    double got = ops->sumsq(x, n);
    T_CHECKF(fabs(got - (double)want) <= 1e-12 * (double)want, "sumsq %.17g want %.17Lg", got, want);
    ops->free(x);
}

/* ------------------------------------------------------------------------ */
/* attention                                                                 */

/* Dense attention in double with an explicit mask[nq, nk] (1 = visible);
 * lse[nq, Hq], unless NULL: the log-sum-exp of the visible scaled scores. */
static void dense_attn_d(double *out, double *lse, const float *q, const float *k, const float *v, const uint8_t *mask,
                         int64_t nq, int64_t nk, int64_t Hq, int64_t Hkv, int64_t D) {
    double *s = calloc((size_t)nk, sizeof(double));
    double scale = 1.0 / sqrt((double)D);
    for (int64_t i = 0; i < nq; i++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t kh = h / (Hq / Hkv);
            double mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < nk; j++) {
                if (!mask[i * nk + j]) continue;
                double d = 0;
                for (int64_t c = 0; c < D; c++) d += (double)q[(i * Hq + h) * D + c] * k[(j * Hkv + kh) * D + c];
                s[j] = d * scale;
                if (s[j] > mx) mx = s[j];
            }
            double *o = out + (i * Hq + h) * D;
            for (int64_t c = 0; c < D; c++) o[c] = 0;
            for (int64_t j = 0; j < nk; j++) {
                if (!mask[i * nk + j]) continue;
                double p = exp(s[j] - mx);
                sum += p;
                for (int64_t c = 0; c < D; c++) o[c] += p * v[(j * Hkv + kh) * D + c];
            }
            for (int64_t c = 0; c < D; c++) o[c] /= sum;
            if (lse) lse[i * Hq + h] = mx + log(sum);
        }
    free(s);
}

static double nmse_fd(const float *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
    return den > 0 ? num / den : num;
}

/* The largest |lse - want|, want the dense_attn_d lse in double. */
static double lse_error(const float *lse, const double *want, int64_t n) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++) worst = fabs(lse[i] - want[i]) > worst ? fabs(lse[i] - want[i]) : worst;
    return worst;
}

static void test_attn_causal_fixture(void) {
    const int64_t T = 90, Hq = 6, Hkv = 2, D = 12;
    int64_t ncu;
    float *q = fx(fx_attn, "causal.q", NULL), *k = fx(fx_attn, "causal.k", NULL), *v = fx(fx_attn, "causal.v", NULL),
          *ref = fx(fx_attn, "causal.out", NULL);
    int32_t *cu = fxi(fx_attn, "causal.cu", &ncu);
    float *out = fbuf(T * Hq * D);
    ops->attn_causal(out, NULL, q, k, v, cu, ncu - 1, T, Hq, Hkv, D, 0);
    CHECK_NMSE("attn_causal out", out, ref, T * Hq * D, NMSE_F32);
    ops->free(q), ops->free(k), ops->free(v), ops->free(ref), ops->free(cu), ops->free(out);
}

/* Perturb key/value row r (every kv head) and check, row by row, that the
 * output changes exactly where mask[., r] is set. Returns the number of
 * (query, key) entries that disagree with the mask. */
typedef void (*attn_run)(void *ctx, float *out);

static int64_t mask_by_perturbation(attn_run run, void *ctx, float *k, float *v, const uint8_t *mask, int64_t nq,
                                    int64_t nk, int64_t Hq, int64_t Hkv, int64_t D) {
    int64_t row = Hq * D, bad = 0;
    float *base = fbuf(nq * row), *pert = fbuf(nq * row);
    run(ctx, base);
    for (int64_t r = 0; r < nk; r++) {
        for (int which = 0; which < 2; which++) { /* perturb k, then v */
            float *x = which ? v : k;
            float *saved = fcopy(x + r * Hkv * D, Hkv * D);
            for (int64_t c = 0; c < Hkv * D; c++) x[r * Hkv * D + c] += 0.75f + 0.01f * (float)c;
            run(ctx, pert);
            memcpy(x + r * Hkv * D, saved, (size_t)(Hkv * D) * 4);
            ops->free(saved);
            for (int64_t i = 0; i < nq; i++) {
                int same = !memcmp(base + i * row, pert + i * row, (size_t)row * 4);
                /* a row that sees one key gives it weight 1 whatever its k */
                int64_t seen = 0;
                for (int64_t j = 0; j < nk; j++) seen += mask[i * nk + j] != 0;
                if (!which && seen == 1 && mask[i * nk + r]) continue;
                if (same == (mask[i * nk + r] != 0)) bad++;
            }
        }
    }
    ops->free(base), ops->free(pert);
    return bad;
}

typedef struct {
    float *q, *k, *v, *lse;
    int32_t *cu;
    dfl_block *blocks;
    int64_t nseq, T, nblk, B, NK, Hq, Hkv, D;
    int64_t window; /* attn_dflash's: 0, or a sliding window */
} attn_ctx;

static void run_causal(void *p, float *out) {
    attn_ctx *c = p;
    ops->attn_causal(out, c->lse, c->q, c->k, c->v, c->cu, c->nseq, c->T, c->Hq, c->Hkv, c->D, c->window);
}

static void test_attn_causal_mask(void) {
    /* sequences of 37, 1, 80 and 5 rows (tiles of 16 split, keys beyond 64) */
    int32_t cu[5] = {0, 37, 38, 118, 123};
    attn_ctx c = {0};
    c.cu = cu, c.nseq = 4, c.T = 123, c.Hq = 4, c.Hkv = 2, c.D = 8;
    dfl_rng r;
    dfl_rng_seed(&r, 6);
    c.q = fbuf(c.T * c.Hq * c.D), c.k = fbuf(c.T * c.Hkv * c.D), c.v = fbuf(c.T * c.Hkv * c.D);
    frand(c.q, c.T * c.Hq * c.D, &r, 1), frand(c.k, c.T * c.Hkv * c.D, &r, 1), frand(c.v, c.T * c.Hkv * c.D, &r, 1);
    uint8_t *mask = calloc((size_t)(c.T * c.T), 1);
    for (int s = 0; s < 4; s++)
        for (int i = cu[s]; i < cu[s + 1]; i++)
            for (int j = cu[s]; j <= i; j++) mask[i * c.T + j] = 1;
    float *out = fbuf(c.T * c.Hq * c.D);
    double *want = calloc((size_t)(c.T * c.Hq * c.D), sizeof(double));
    run_causal(&c, out);
    dense_attn_d(want, NULL, c.q, c.k, c.v, mask, c.T, c.T, c.Hq, c.Hkv, c.D);
    double e = nmse_fd(out, want, c.T * c.Hq * c.D);
    printf("  %-28s nmse %.2e (<= %.0e)\n", "attn_causal vs dense double", e, NMSE_F32);
    T_CHECKF(e <= NMSE_F32, "nmse %.3e", e);
    int64_t bad = mask_by_perturbation(run_causal, &c, c.k, c.v, mask, c.T, c.T, c.Hq, c.Hkv, c.D);
    T_CHECKF(bad == 0, "%lld (query, key) entries disagree with the causal mask", (long long)bad);
    ops->free(c.q), ops->free(c.k), ops->free(c.v), ops->free(out);
    free(mask), free(want);
}

/* A target's sliding window (attn_causal's window): row t sees the keys
 * max(its sequence's first, t - W + 1) .. t; windows shorter than a tile
 * of rows (1, 3), about one (16, 17), across tiles (40) and longer than
 * every sequence (1000, the same as none); out and lse against the dense
 * mask in double, and every (query, key) entry by perturbation. */
static void test_attn_causal_window(void) {
    int32_t cu[5] = {0, 37, 38, 118, 123};
    const int64_t windows[] = {1, 3, 16, 17, 40, 1000, 0};
    attn_ctx c = {0};
    c.cu = cu, c.nseq = 4, c.T = 123, c.Hq = 6, c.Hkv = 2, c.D = 8;
    dfl_rng r;
    dfl_rng_seed(&r, 16);
    c.q = fbuf(c.T * c.Hq * c.D), c.k = fbuf(c.T * c.Hkv * c.D), c.v = fbuf(c.T * c.Hkv * c.D);
    c.lse = fbuf(c.T * c.Hq);
    frand(c.q, c.T * c.Hq * c.D, &r, 1), frand(c.k, c.T * c.Hkv * c.D, &r, 1), frand(c.v, c.T * c.Hkv * c.D, &r, 1);
    uint8_t *mask = calloc((size_t)(c.T * c.T), 1);
    float *out = fbuf(c.T * c.Hq * c.D);
    double *want = calloc((size_t)(c.T * c.Hq * c.D), sizeof(double));
    double *want_lse = calloc((size_t)(c.T * c.Hq), sizeof(double));
    for (size_t w = 0; w < sizeof windows / sizeof *windows; w++) {
        c.window = windows[w];
        memset(mask, 0, (size_t)(c.T * c.T));
        for (int s = 0; s < 4; s++)
            for (int64_t i = cu[s]; i < cu[s + 1]; i++)
                for (int64_t j = cu[s]; j <= i; j++) mask[i * c.T + j] = !c.window || j > i - c.window;
        run_causal(&c, out);
        dense_attn_d(want, want_lse, c.q, c.k, c.v, mask, c.T, c.T, c.Hq, c.Hkv, c.D);
        double e = nmse_fd(out, want, c.T * c.Hq * c.D);
        double le = lse_error(c.lse, want_lse, c.T * c.Hq);
        printf("  attn_causal window %-4lld nmse %.2e (<= %.0e), lse off by %.1e\n", (long long)c.window, e,
               NMSE_F32, le);
        T_CHECKF(e <= NMSE_F32, "window %lld: nmse %.3e", (long long)c.window, e);
        T_CHECKF(le < 1e-5, "window %lld: lse off by %.3g", (long long)c.window, le);
        int64_t bad = mask_by_perturbation(run_causal, &c, c.k, c.v, mask, c.T, c.T, c.Hq, c.Hkv, c.D);
        T_CHECKF(bad == 0, "window %lld: %lld (query, key) entries disagree with the mask", (long long)c.window,
                 (long long)bad);
    }
    ops->free(c.q), ops->free(c.k), ops->free(c.v), ops->free(c.lse), ops->free(out);
    free(mask), free(want), free(want_lse);
}

/* A DFlash training layout: context rows [0, S) hold packed sequences
 * seq_lo[s]..seq_hi[s]; block j is anchored at anchor[j] inside sequence
 * aseq[j], and its B tokens are key rows S + j*B. */
typedef struct {
    int nseq, nblk;
    int32_t seq_lo[4], seq_hi[4], aseq[16], anchor[16];
    int64_t S, B;
} dfl_layout;

/* Spec section 2.5, with SpecForge/speculators' packing condition:
 * context strictly before the anchor and in the same sequence, the own
 * block bidirectionally, no other block. */
static int dflash_allowed(const dfl_layout *L, int64_t qi, int64_t kv) {
    int64_t j = qi / L->B;
    if (kv < L->S) return kv >= L->seq_lo[L->aseq[j]] && kv < L->anchor[j];
    return (kv - L->S) / L->B == j;
}

/* The same in a sliding window of W (SpecForge's create_dflash_sdpa_mask,
 * spec 2.5): the query in slot o sees the context from a_j + o - (W - 1)
 * on, and the block's slots 0..o only. */
static int dflash_allowed_window(const dfl_layout *L, int64_t qi, int64_t kv, int64_t W) {
    int64_t j = qi / L->B, o = qi % L->B;
    if (!dflash_allowed(L, qi, kv)) return 0;
    if (kv < L->S) return kv >= L->anchor[j] + o - (W - 1);
    return (kv - L->S) % L->B <= o;
}

static dfl_block *layout_blocks(const dfl_layout *L) {
    dfl_block *b = calloc((size_t)L->nblk, sizeof *b);
    for (int j = 0; j < L->nblk; j++) {
        int32_t lo = L->seq_lo[L->aseq[j]];
        b[j] = (dfl_block){lo, L->anchor[j] - lo, (int32_t)(L->S + j * L->B)};
    }
    return b;
}

static void run_dflash(void *p, float *out) {
    attn_ctx *c = p;
    ops->attn_dflash(out, c->lse, c->q, c->k, c->v, c->blocks, c->nblk, c->B, c->NK, c->Hq, c->Hkv, c->D, c->window);
}

/* three sequences of context; anchors at sequence starts (ctx_len 0),
 * closer together than B, next to each sequence end */
static const dfl_layout mask_layout = {3, 9, {0, 70, 75}, {70, 75, 150}, {0, 0, 0, 0, 1, 1, 2, 2, 2},
                                       {0, 3, 5, 69, 70, 74, 75, 100, 149}, 150, 16};

/* An attn_ctx over L's blocks with Hq query heads (2 kv heads of 16) and
 * random q, k, v from seed. */
static attn_ctx layout_ctx(const dfl_layout *L, int64_t Hq, uint64_t seed) {
    attn_ctx c = {0};
    c.nblk = L->nblk, c.B = L->B, c.NK = L->S + L->nblk * L->B, c.Hq = Hq, c.Hkv = 2, c.D = 16;
    c.blocks = layout_blocks(L);
    int64_t nq = c.nblk * c.B;
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    c.q = fbuf(nq * c.Hq * c.D), c.k = fbuf(c.NK * c.Hkv * c.D), c.v = fbuf(c.NK * c.Hkv * c.D);
    c.lse = fbuf(nq * c.Hq);
    frand(c.q, nq * c.Hq * c.D, &r, 1), frand(c.k, c.NK * c.Hkv * c.D, &r, 1), frand(c.v, c.NK * c.Hkv * c.D, &r, 1);
    return c;
}

static void layout_ctx_free(attn_ctx *c) {
    ops->free(c->q), ops->free(c->k), ops->free(c->v), ops->free(c->lse);
    free(c->blocks);
}

static void test_attn_dflash_mask(void) {
    const dfl_layout L = mask_layout;
    attn_ctx c = layout_ctx(&L, 8, 7);
    int64_t nq = c.nblk * c.B;
    uint8_t *mask = calloc((size_t)(nq * c.NK), 1);
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < c.NK; j++) mask[i * c.NK + j] = (uint8_t)dflash_allowed(&L, i, j);
    float *out = fbuf(nq * c.Hq * c.D);
    double *want = calloc((size_t)(nq * c.Hq * c.D), sizeof(double));
    run_dflash(&c, out);
    dense_attn_d(want, NULL, c.q, c.k, c.v, mask, nq, c.NK, c.Hq, c.Hkv, c.D);
    double e = nmse_fd(out, want, nq * c.Hq * c.D);
    printf("  %-28s nmse %.2e (<= %.0e)\n", "attn_dflash vs dense double", e, NMSE_F32);
    T_CHECKF(e <= NMSE_F32, "nmse %.3e", e);
    int64_t bad = mask_by_perturbation(run_dflash, &c, c.k, c.v, mask, nq, c.NK, c.Hq, c.Hkv, c.D);
    T_CHECKF(bad == 0, "%lld (query, key) entries disagree with the spec 2.5 mask", (long long)bad);
    /* a NaN query poisons its own output row, and only that one */
    c.q[5 * c.Hq * c.D] = NAN;
    run_dflash(&c, out);
    int64_t nan_rows = 0;
    for (int64_t i = 0; i < nq * c.Hq; i++) nan_rows += isnan(out[i * c.D]) != 0;
    T_CHECKF(isnan(out[5 * c.Hq * c.D]) && nan_rows == 1, "%lld rows are NaN", (long long)nan_rows);
    layout_ctx_free(&c);
    ops->free(out);
    free(mask), free(want);
}

/* Sliding-window blocks (a drafter's sliding layer): the mask test above
 * for windows of 1 (the query's own key alone), 2, 16 (= B), 17, 40 and
 * 100 (more than any context), against the dense mask in double, and by
 * perturbation. */
static void test_attn_dflash_window(void) {
    const dfl_layout L = mask_layout;
    attn_ctx c = layout_ctx(&L, 4, 17);
    int64_t nq = c.nblk * c.B;
    uint8_t *mask = calloc((size_t)(nq * c.NK), 1);
    float *out = fbuf(nq * c.Hq * c.D);
    double *want = calloc((size_t)(nq * c.Hq * c.D), sizeof(double));
    static const int64_t windows[] = {1, 2, 16, 17, 40, 100};
    for (size_t w = 0; w < sizeof windows / sizeof windows[0]; w++) {
        c.window = windows[w];
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < c.NK; j++) mask[i * c.NK + j] = (uint8_t)dflash_allowed_window(&L, i, j, c.window);
        run_dflash(&c, out);
        dense_attn_d(want, NULL, c.q, c.k, c.v, mask, nq, c.NK, c.Hq, c.Hkv, c.D);
        double e = nmse_fd(out, want, nq * c.Hq * c.D);
        printf("  %-28s W %3lld nmse %.2e (<= %.0e)\n", "attn_dflash window vs dense", (long long)c.window, e, NMSE_F32);
        T_CHECKF(e <= NMSE_F32, "window %lld: nmse %.3e", (long long)c.window, e);
        int64_t bad = mask_by_perturbation(run_dflash, &c, c.k, c.v, mask, nq, c.NK, c.Hq, c.Hkv, c.D);
        T_CHECKF(bad == 0, "window %lld: %lld (query, key) entries disagree with the sliding mask", (long long)c.window,
                 (long long)bad);
    }
    layout_ctx_free(&c);
    ops->free(out);
    free(mask), free(want);
}

/* One-query blocks (B = 1), as the targets' sliding-window and KV-cached
 * attention lay them out, which the CPU runs QT rows to a tile: runs of
 * causal rows (windows of 5, of 70 and none; two sequences), broken by
 * blocks that do not fit a run (a context not ending at the own key, a
 * window that shrinks back, an own key out of order), against the dense
 * mask in double, out and lse. */
static void test_attn_dflash_rows(void) {
    enum { NQ = 120, NK = 130 };
    dfl_block *bl = calloc(NQ, sizeof *bl);
    for (int i = 0; i < NQ; i++) {
        int seq0 = i < 50 ? 0 : 50, r = i - seq0, W = i < 30 ? 5 : i < 50 ? 0 : 70;
        int lo = W && r - W + 1 > 0 ? r - W + 1 : 0;
        bl[i] = (dfl_block){seq0 + lo, r - lo, i};
    }
    bl[7] = (dfl_block){0, 3, 7};      /* context ends before its own key's row */
    bl[40] = (dfl_block){20, 20, 40};  /* a lower bound above its neighbours' (a run allows it) */
    bl[52] = (dfl_block){60, 0, 60};   /* an own key out of order: a tile of its own */
    bl[90] = (dfl_block){50, 40, 125}; /* own key elsewhere */
    attn_ctx c = {0};
    c.nblk = NQ, c.B = 1, c.NK = NK, c.Hq = 6, c.Hkv = 2, c.D = 16, c.blocks = bl;
    dfl_rng r;
    dfl_rng_seed(&r, 11);
    c.q = fbuf(NQ * c.Hq * c.D), c.k = fbuf(NK * c.Hkv * c.D), c.v = fbuf(NK * c.Hkv * c.D), c.lse = fbuf(NQ * c.Hq);
    frand(c.q, NQ * c.Hq * c.D, &r, 1), frand(c.k, NK * c.Hkv * c.D, &r, 1), frand(c.v, NK * c.Hkv * c.D, &r, 1);
    uint8_t *mask = calloc((size_t)(NQ * NK), 1);
    for (int i = 0; i < NQ; i++) {
        for (int j = bl[i].ctx_off; j < bl[i].ctx_off + bl[i].ctx_len; j++) mask[i * NK + j] = 1;
        mask[i * NK + bl[i].blk_off] = 1;
    }
    float *out = fbuf(NQ * c.Hq * c.D);
    double *want = calloc((size_t)(NQ * c.Hq * c.D), sizeof(double));
    run_dflash(&c, out);
    double *want_lse = calloc((size_t)(NQ * c.Hq), sizeof(double));
    dense_attn_d(want, want_lse, c.q, c.k, c.v, mask, NQ, NK, c.Hq, c.Hkv, c.D);
    double e = nmse_fd(out, want, NQ * c.Hq * c.D);
    printf("  %-28s nmse %.2e (<= %.0e)\n", "attn_dflash B=1 vs dense", e, NMSE_F32);
    T_CHECKF(e <= NMSE_F32, "nmse %.3e", e);
    double worst = lse_error(c.lse, want_lse, NQ * c.Hq);
    T_CHECKF(worst < 1e-5, "lse off by %.3g", worst);
    int64_t bad = mask_by_perturbation(run_dflash, &c, c.k, c.v, mask, NQ, NK, c.Hq, c.Hkv, c.D);
    T_CHECKF(bad == 0, "%lld (query, key) entries disagree with the blocks", (long long)bad);
    ops->free(c.q), ops->free(c.k), ops->free(c.v), ops->free(c.lse), ops->free(out);
    free(mask), free(want), free(want_lse), free(bl);
}

static void test_attn_dflash_fixture(void) {
    int32_t *dims = fxi(fx_attn, "dfl.dims", NULL), *bl = fxi(fx_attn, "dfl.blocks", NULL);
    int64_t S = dims[0], B = dims[1], Hq = dims[2], Hkv = dims[3], D = dims[4], nblk;
    nblk = fx_find(fx_attn, "dfl.blocks")->shape[0];
    int64_t NK = S + nblk * B, nq = nblk * B;
    dfl_block *blocks = calloc((size_t)nblk, sizeof *blocks);
    for (int64_t j = 0; j < nblk; j++) blocks[j] = (dfl_block){bl[3 * j], bl[3 * j + 1], bl[3 * j + 2]};
    float *q = fx(fx_attn, "dfl.q", NULL), *k = fx(fx_attn, "dfl.k", NULL), *v = fx(fx_attn, "dfl.v", NULL);
    float *ref = fx(fx_attn, "dfl.out", NULL), *rlse = fx(fx_attn, "dfl.lse", NULL);
    float *out = fbuf(nq * Hq * D), *lse = fbuf(nq * Hq);
    ops->attn_dflash(out, lse, q, k, v, blocks, nblk, B, NK, Hq, Hkv, D, 0);
    CHECK_NMSE("attn_dflash out", out, ref, nq * Hq * D, NMSE_F32);
    CHECK_NMSE("attn_dflash lse", lse, rlse, nq * Hq, NMSE_F32);

    float *dout = fx(fx_attn, "dfl.dout", NULL), *rdq = fx(fx_attn, "dfl.dq", NULL),
          *rdk = fx(fx_attn, "dfl.dk", NULL), *rdv = fx(fx_attn, "dfl.dv", NULL);
    float *dq = fbuf(nq * Hq * D), *dk = fbuf(NK * Hkv * D), *dv = fbuf(NK * Hkv * D);
    /* the op writes its gradients: what they held before must not show */
    for (int64_t i = 0; i < nq * Hq * D; i++) dq[i] = 1;
    for (int64_t i = 0; i < NK * Hkv * D; i++) dk[i] = 2, dv[i] = -1;
    ops->attn_dflash_bwd(dq, dk, dv, dout, out, lse, q, k, v, blocks, nblk, B, NK, Hq, Hkv, D, 0);
    CHECK_NMSE("attn_dflash_bwd dq (written)", dq, rdq, nq * Hq * D, NMSE_F32);
    CHECK_NMSE("attn_dflash_bwd dk (written)", dk, rdk, NK * Hkv * D, NMSE_F32);
    CHECK_NMSE("attn_dflash_bwd dv (written)", dv, rdv, NK * Hkv * D, NMSE_F32);
    /* NULL gradients: each alone gives the same values */
    float *dk2 = fbuf(NK * Hkv * D);
    ops->attn_dflash_bwd(NULL, dk2, NULL, dout, out, lse, q, k, v, blocks, nblk, B, NK, Hq, Hkv, D, 0);
    CHECK_NMSE("attn_dflash_bwd dk alone", dk2, rdk, NK * Hkv * D, NMSE_F32);
    ops->free(dims), ops->free(bl), free(blocks), ops->free(q), ops->free(k), ops->free(v), ops->free(ref);
    ops->free(rlse), ops->free(out), ops->free(lse), ops->free(dout), ops->free(rdq), ops->free(rdk);
    ops->free(rdv), ops->free(dq), ops->free(dk), ops->free(dv), ops->free(dk2);
}

/* Finite differences of attn_dflash where blocks share keys: context keys
 * (overlapping ranges, one of 70 rows: more than a key tile) and, since
 * dfl_blocks are arbitrary, own-block keys too (blocks 2 and 3). */
typedef struct {
    attn_ctx a;
    float *out, *dout;
} dfl_fd_ctx;

static double dflash_loss(void *p) {
    dfl_fd_ctx *c = p;
    run_dflash(&c->a, c->out);
    return dot_d(c->out, c->dout, c->a.nblk * c->a.B * c->a.Hq * c->a.D);
}

static void test_attn_dflash_fd(void) {
    dfl_fd_ctx c = {0};
    attn_ctx *a = &c.a;
    a->nblk = 5, a->B = 3, a->NK = 90, a->Hq = 6, a->Hkv = 2, a->D = 10;
    dfl_block blocks[5] = {{0, 0, 75}, {0, 70, 78}, {0, 71, 81}, {5, 30, 81}, {40, 30, 87}};
    a->blocks = blocks;
    int64_t nq = a->nblk * a->B, nqe = nq * a->Hq * a->D, nke = a->NK * a->Hkv * a->D;
    dfl_rng r;
    dfl_rng_seed(&r, 8);
    a->q = fbuf(nqe), a->k = fbuf(nke), a->v = fbuf(nke), a->lse = fbuf(nq * a->Hq);
    c.out = fbuf(nqe), c.dout = fbuf(nqe);
    frand(a->q, nqe, &r, 1), frand(a->k, nke, &r, 1), frand(a->v, nke, &r, 1), frand(c.dout, nqe, &r, 1);
    dflash_loss(&c);
    float *dq = fbuf(nqe), *dk = fbuf(nke), *dv = fbuf(nke);
    for (int pass = 0; pass < 3; pass++) {
        /* no window; a window of 40 (context cut for the blocks of 70 and
         * 71, not for those of 30); of 2 (one context key for slot 0) */
        a->window = pass == 0 ? 0 : pass == 1 ? 40 : 2;
        dflash_loss(&c);
        ops->attn_dflash_bwd(dq, dk, dv, c.dout, c.out, a->lse, a->q, a->k, a->v, blocks, a->nblk, a->B, a->NK, a->Hq,
                             a->Hkv, a->D, a->window);
        printf("  window %lld:\n", (long long)a->window);
        check_fd("attn_dflash dq", dflash_loss, &c, a->q, dq, nqe, 81);
        check_fd("attn_dflash dk", dflash_loss, &c, a->k, dk, nke, 82);
        check_fd("attn_dflash dv", dflash_loss, &c, a->v, dv, nke, 83);
    }
    ops->free(a->q), ops->free(a->k), ops->free(a->v), ops->free(a->lse), ops->free(c.out), ops->free(c.dout);
    ops->free(dq), ops->free(dk), ops->free(dv);
}

/* ------------------------------------------------------------------------ */
/* LM head                                                                   */

typedef struct {
    float *h, *th, *w, *gscale, *loss, *dh;
    int32_t *labels, *pred, *tpred;
    int64_t N, H, V;
} lm_ctx;

static lm_ctx lm_fixture(void) {
    lm_ctx c = {0};
    int64_t n;
    c.h = fx(fx_lm, "lm.h", NULL), c.th = fx(fx_lm, "lm.th", NULL), c.w = fx(fx_lm, "lm.w", &n);
    c.gscale = fx(fx_lm, "lm.gscale", &c.N), c.labels = fxi(fx_lm, "lm.labels", NULL);
    c.H = fx_find(fx_lm, "lm.h")->shape[1], c.V = n / c.H;
    c.loss = fbuf(c.N), c.dh = fbuf(c.N * c.H);
    c.pred = ops->alloc((size_t)c.N * 4), c.tpred = ops->alloc((size_t)c.N * 4);
    return c;
}

static void lm_free(lm_ctx *c) {
    ops->free(c->h), ops->free(c->th), ops->free(c->w), ops->free(c->gscale), ops->free(c->labels);
    ops->free(c->loss), ops->free(c->dh), ops->free(c->pred), ops->free(c->tpred);
}

static int same_i32(const int32_t *a, const int32_t *b, int64_t n) { return !memcmp(a, b, (size_t)n * 4); }

static void test_lmhead_ce(void) {
    lm_ctx c = lm_fixture();
    float *rloss = fx(fx_lm, "ce.loss", NULL), *rdh = fx(fx_lm, "ce.dh", NULL);
    int32_t *rpred = fxi(fx_lm, "ce.pred", NULL);
    /* chunk sizes: automatic, 1, 5 and 16 (not dividing N = 37), > N */
    int64_t chunks[5] = {0, 1, 5, 16, 1000};
    for (int ci = 0; ci < 5; ci++) {
        dfl_cpu_lmhead_rows_override = chunks[ci];
        char what[64];
        for (int64_t i = 0; i < c.N * c.H; i++) c.dh[i] = 0.25f;
        ops->lmhead_ce(c.loss, c.pred, c.dh, c.h, c.w, c.labels, c.gscale, c.N, c.H, c.V);
        float *d = minus(c.dh, 0.25f, c.N * c.H);
        snprintf(what, sizeof what, "lmhead_ce loss (chunk %lld)", (long long)chunks[ci]);
        CHECK_NMSE(what, c.loss, rloss, c.N, NMSE_F32);
        snprintf(what, sizeof what, "lmhead_ce dh += (chunk %lld)", (long long)chunks[ci]);
        CHECK_NMSE(what, d, rdh, c.N * c.H, NMSE_F32);
        T_CHECK(same_i32(c.pred, rpred, c.N));
        /* rows with gscale 0 or no label: dh untouched (exactly) */
        for (int64_t i = 0; i < c.N; i++)
            if (c.gscale[i] == 0 || c.labels[i] < 0)
                for (int64_t j = 0; j < c.H; j++) T_CHECK(c.dh[i * c.H + j] == 0.25f);
        ops->free(d);
    }
    dfl_cpu_lmhead_rows_override = 0;
    /* forward only: dh NULL, gscale NULL */
    memset(c.loss, 0, (size_t)c.N * 4);
    ops->lmhead_ce(c.loss, c.pred, NULL, c.h, c.w, c.labels, NULL, c.N, c.H, c.V);
    CHECK_NMSE("lmhead_ce loss (no grad)", c.loss, rloss, c.N, NMSE_F32);
    /* gscale NULL means 1 */
    float *ones = fbuf(c.N), *dh1 = fbuf(c.N * c.H);
    for (int64_t i = 0; i < c.N; i++) ones[i] = 1;
    memset(c.dh, 0, (size_t)(c.N * c.H) * 4);
    ops->lmhead_ce(c.loss, c.pred, c.dh, c.h, c.w, c.labels, NULL, c.N, c.H, c.V);
    ops->lmhead_ce(c.loss, c.pred, dh1, c.h, c.w, c.labels, ones, c.N, c.H, c.V);
    T_CHECK(!memcmp(c.dh, dh1, (size_t)(c.N * c.H) * 4));
    memset(c.dh, 0, (size_t)(c.N * c.H) * 4), memset(dh1, 0, (size_t)(c.N * c.H) * 4);
    ops->lmhead_kl(c.loss, c.pred, NULL, c.dh, c.h, c.th, c.w, NULL, c.N, c.H, c.V);
    ops->lmhead_kl(c.loss, c.pred, NULL, dh1, c.h, c.th, c.w, ones, c.N, c.H, c.V);
    T_CHECK(!memcmp(c.dh, dh1, (size_t)(c.N * c.H) * 4));
    ops->free(ones), ops->free(dh1);
    ops->free(rloss), ops->free(rdh), ops->free(rpred);
    lm_free(&c);
}

static double ce_loss(void *p) {
    lm_ctx *c = p;
    ops->lmhead_ce(c->loss, c->pred, NULL, c->h, c->w, c->labels, NULL, c->N, c->H, c->V);
    return dot_d(c->loss, c->gscale, c->N);
}

static double kl_loss(void *p) {
    lm_ctx *c = p;
    ops->lmhead_kl(c->loss, c->pred, NULL, NULL, c->h, c->th, c->w, c->gscale, c->N, c->H, c->V);
    return dot_d(c->loss, c->gscale, c->N);
}

static void test_lmhead_fd(void) {
    lm_ctx c = lm_fixture();
    dfl_cpu_lmhead_rows_override = 7;
    ops->lmhead_ce(c.loss, c.pred, c.dh, c.h, c.w, c.labels, c.gscale, c.N, c.H, c.V);
    check_fd("lmhead_ce dh", ce_loss, &c, c.h, c.dh, c.N * c.H, 91);
    memset(c.dh, 0, (size_t)(c.N * c.H) * 4);
    ops->lmhead_kl(c.loss, c.pred, NULL, c.dh, c.h, c.th, c.w, c.gscale, c.N, c.H, c.V);
    check_fd("lmhead_kl dh", kl_loss, &c, c.h, c.dh, c.N * c.H, 92);
    dfl_cpu_lmhead_rows_override = 0;
    lm_free(&c);
}

static void test_lmhead_kl(void) {
    lm_ctx c = lm_fixture();
    float *rloss = fx(fx_lm, "kl.loss", NULL), *rdh = fx(fx_lm, "kl.dh", NULL);
    int32_t *rpred = fxi(fx_lm, "kl.pred", NULL), *rtpred = fxi(fx_lm, "kl.tpred", NULL);
    int64_t chunks[4] = {0, 1, 6, 64};
    for (int ci = 0; ci < 4; ci++) {
        dfl_cpu_lmhead_rows_override = chunks[ci];
        char what[64];
        for (int64_t i = 0; i < c.N * c.H; i++) c.dh[i] = -0.5f;
        for (int64_t i = 0; i < c.N; i++) c.loss[i] = 99.0f;
        ops->lmhead_kl(c.loss, c.pred, c.tpred, c.dh, c.h, c.th, c.w, c.gscale, c.N, c.H, c.V);
        float *d = minus(c.dh, -0.5f, c.N * c.H);
        snprintf(what, sizeof what, "lmhead_kl loss (chunk %lld)", (long long)chunks[ci]);
        CHECK_NMSE(what, c.loss, rloss, c.N, NMSE_F32);
        snprintf(what, sizeof what, "lmhead_kl dh += (chunk %lld)", (long long)chunks[ci]);
        CHECK_NMSE(what, d, rdh, c.N * c.H, NMSE_F32);
        T_CHECK(same_i32(c.pred, rpred, c.N) && same_i32(c.tpred, rtpred, c.N));
        for (int64_t i = 0; i < c.N; i++)
            if (c.gscale[i] == 0) {
                T_CHECK(c.loss[i] == 0);
                for (int64_t j = 0; j < c.H; j++) T_CHECK(c.dh[i * c.H + j] == -0.5f);
            }
        ops->free(d);
    }
    dfl_cpu_lmhead_rows_override = 0;
    /* KL of a distribution with itself is 0 and so is its gradient */
    memset(c.dh, 0, (size_t)(c.N * c.H) * 4);
    ops->lmhead_kl(c.loss, c.pred, NULL, c.dh, c.h, c.h, c.w, c.gscale, c.N, c.H, c.V);
    double mx = 0;
    for (int64_t i = 0; i < c.N; i++) mx = fmax(mx, fabs(c.loss[i]));
    T_CHECKF(mx < 1e-6, "KL(p||p) = %g", mx);
    ops->free(rloss), ops->free(rdh), ops->free(rpred), ops->free(rtpred);
    lm_free(&c);
}

static void test_lmhead_argmax(void) {
    lm_ctx c = lm_fixture();
    float *rgap = fx(fx_lm, "am.gap", NULL), *gap = fbuf(c.N);
    int32_t *rpred = fxi(fx_lm, "ce.pred", NULL);
    int64_t chunks[3] = {0, 4, 100};
    for (int ci = 0; ci < 3; ci++) {
        dfl_cpu_lmhead_rows_override = chunks[ci];
        ops->lmhead_argmax(c.pred, gap, c.h, c.w, c.N, c.H, c.V);
        T_CHECK(same_i32(c.pred, rpred, c.N));
        CHECK_NMSE("lmhead_argmax gap", gap, rgap, c.N, NMSE_F32);
    }
    dfl_cpu_lmhead_rows_override = 0;

    /* ties go to the lowest index: w rows 5 and 17 equal, row 0 of h along them */
    const int64_t H = 8, V = 23, N = 3;
    float *w = fbuf(V * H), *h = fbuf(N * H), g[3];
    int32_t pred[3], pred2[3];
    dfl_rng r;
    dfl_rng_seed(&r, 9);
    frand(w, V * H, &r, 0.1f);
    memcpy(w + 17 * H, w + 5 * H, (size_t)H * 4);
    for (int64_t j = 0; j < H; j++) h[j] = 40 * w[5 * H + j];
    /* row 1: all logits 0 -> index 0; row 2: logits equal at 9 and 20, both max */
    memcpy(w + 20 * H, w + 9 * H, (size_t)H * 4);
    for (int64_t j = 0; j < H; j++) h[2 * H + j] = 40 * w[9 * H + j];
    ops->lmhead_argmax(pred, g, h, w, N, H, V);
    T_CHECKF(pred[0] == 5 && g[0] == 0, "pred %d gap %g", pred[0], g[0]);
    T_CHECKF(pred[1] == 0 && g[1] == 0, "pred %d gap %g", pred[1], g[1]);
    T_CHECKF(pred[2] == 9 && g[2] == 0, "pred %d gap %g", pred[2], g[2]);
    int32_t labels[3] = {0, 0, 0};
    float loss[3];
    ops->lmhead_ce(loss, pred2, NULL, h, w, labels, NULL, N, H, V);
    T_CHECK(!memcmp(pred, pred2, sizeof pred));
    ops->lmhead_argmax(pred2, NULL, h, w, N, H, V); /* gap may be NULL */
    T_CHECK(!memcmp(pred, pred2, sizeof pred));
    ops->free(w), ops->free(h), ops->free(rgap), ops->free(gap), ops->free(rpred);
    lm_free(&c);
}

/* dfl_cpu_top2 (16 interleaved scans merged) against the one running scan
 * it replaces, "z[c] > max, else z[c] > second" from z[0], on rows built to
 * break a merge: few distinct values (ties within and across lanes), signed
 * zeros, -inf and NaN anywhere, z[0] NaN, every entry -inf, lengths around
 * the lane count. The argmax and max must match to the bit, the runner-up
 * in value (which zero, -0 or +0, is met first depends on the order). */
static int32_t top2_scan(const float *z, int64_t V, float *max, float *second) {
    int32_t arg = 0;
    float m = z[0], s = -INFINITY;
    for (int64_t c = 1; c < V; c++) {
        if (z[c] > m) s = m, m = z[c], arg = (int32_t)c;
        else if (z[c] > s) s = z[c];
    }
    *max = m, *second = s;
    return arg;
}

static void test_top2_matches_scan(void) {
    static const float pool[8] = {1.0f, 2.0f, -3.0f, 0.0f, -0.0f, -INFINITY, NAN, 2.0f};
    const int64_t lens[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 100, 1000, 8192};
    dfl_rng r;
    dfl_rng_seed(&r, 31);
    float *z = fbuf(8192);
    int bad = 0, runs = 0;
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
        int64_t V = lens[li];
        for (int rep = 0; rep < 200; rep++, runs++) {
            int kind = rep % 5; /* 0 pool, 1 pool without NaN, 2 random, 3 all -inf/NaN, 4 random + z[0] NaN */
            for (int64_t c = 0; c < V; c++) {
                uint32_t u = (uint32_t)(dfl_rng_u64(&r) >> 32);
                if (kind == 2 || kind == 4) z[c] = (float)(u % 1000) * 0.01f - 5.0f;
                else if (kind == 3) z[c] = u % 3 ? -INFINITY : NAN;
                else z[c] = pool[u % (kind == 1 ? 6 : 8)];
            }
            if (kind == 4) z[0] = NAN;
            float m, s, em, es;
            int32_t a = dfl_cpu_top2(z, V, &m, &s), ea = top2_scan(z, V, &em, &es);
            if (a != ea || memcmp(&m, &em, 4) || !(s == es)) {
                if (bad++ < 5)
                    fprintf(stderr, "  V %lld kind %d: arg %d max %g second %g, scan %d %g %g\n", (long long)V, kind,
                            a, m, s, ea, em, es);
            }
        }
    }
    T_CHECKF(bad == 0, "%d of %d rows differ from the scan", bad, runs);
    ops->free(z);
}

/* Sampling at a temperature: the draws follow softmax(z / T), restricted to
 * the tokens top-k and top-p keep. Oracle: the softmax computed here in
 * double from the same h and w, the kept set by sorting (ties with the cut
 * kept); 60000 draws of one row under 60000 keys, no draw outside the kept
 * set, and a chi-square test over the kept entries (at most 11 degrees of
 * freedom: mean 11, sd 4.7; the limit 45 is p ~ 1e-5, and the keys are
 * fixed, so the test is deterministic). A wrong temperature scaling (T for
 * 1/T, or none) or a noise that is not Gumbel gives thousands. */
static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static double sample_chi2(const float *h, const float *h_expect, const float *w, int64_t H, int64_t V,
                          const dfl_sampling *sp, int64_t N, int *nkept) {
    float *hs = fbuf(N * H);
    uint64_t *keys = dfl_malloc((size_t)N * sizeof *keys);
    int32_t *pred = dfl_malloc((size_t)N * sizeof *pred);
    for (int64_t i = 0; i < N; i++) {
        memcpy(hs + i * H, h, (size_t)H * 4);
        keys[i] = dfl_sample_key(dfl_sample_seq_key(42, 0), i);
    }
    ops->lmhead_sample(pred, NULL, hs, w, keys, sp, N, H, V);
    double z[64], p[64], sorted[64], zmax = -INFINITY, sum = 0, chi2 = 0, cut = -INFINITY;
    int64_t count[64] = {0};
    for (int64_t v = 0; v < V; v++) {
        z[v] = 0;
        for (int64_t j = 0; j < H; j++) z[v] += (double)h_expect[j] * w[v * H + j];
        z[v] /= sp->temperature;
        zmax = fmax(zmax, z[v]);
        sorted[v] = z[v];
    }
    qsort(sorted, (size_t)V, sizeof *sorted, cmp_desc);
    int64_t kept = sp->top_k > 0 && sp->top_k < V ? sp->top_k : V;
    cut = sorted[kept - 1];
    if (sp->top_p > 0 && sp->top_p < 1) { /* the fewest highest reaching top_p of the top-k mass */
        double total = 0, acc = 0;
        for (int64_t i = 0; i < kept; i++) total += exp(sorted[i] - zmax);
        int64_t n = 0;
        while (acc < sp->top_p * total) acc += exp(sorted[n++] - zmax);
        T_CHECKF(fabs(acc - sp->top_p * total) > 1e-4 * total && fabs(acc - exp(sorted[n - 1] - zmax) -
                 sp->top_p * total) > 1e-4 * total, "top_p %g lands on a boundary: pick another", (double)sp->top_p);
        cut = sorted[n - 1];
    }
    *nkept = 0;
    for (int64_t v = 0; v < V; v++) sum += p[v] = z[v] >= cut ? exp(z[v] - zmax) : 0, *nkept += z[v] >= cut;
    for (int64_t i = 0; i < N; i++) {
        T_CHECK(pred[i] >= 0 && pred[i] < V);
        if (pred[i] >= 0 && pred[i] < V) count[pred[i]]++;
    }
    for (int64_t v = 0; v < V; v++) {
        if (p[v] == 0) {
            T_CHECKF(count[v] == 0, "%lld draws of entry %lld, which the filter drops", (long long)count[v], (long long)v);
            continue;
        }
        double e = (double)N * p[v] / sum;
        T_CHECKF(e >= 20, "expected count %g of entry %lld is too small for the test", e, (long long)v);
        chi2 += (count[v] - e) * (count[v] - e) / e;
    }
    ops->free(hs), free(keys), free(pred);
    return chi2;
}

static void test_lmhead_sample(void) {
    const int64_t H = 4, V = 12, N = 60000;
    float *w = fbuf(V * H), h[4] = {1.0f, -0.5f, 0.25f, 0.75f};
    dfl_rng r;
    dfl_rng_seed(&r, 21);
    frand(w, V * H, &r, 0.4f);
    /* temperatures; then top-k alone, top-p alone, both (kept: 5, 4 and 3 of 12) */
    const dfl_sampling cases[6] = {{1.0f, 0, 0}, {0.5f, 0, 0}, {2.0f, 0, 0}, {1.0f, 5, 0}, {1.0f, 0, 0.4f},
                                   {0.7f, 8, 0.45f}};
    for (int k = 0; k < 6; k++) {
        int kept;
        double chi2 = sample_chi2(h, h, w, H, V, &cases[k], N, &kept);
        printf("  sample T=%.1f top-k %d top-p %.2f: %d kept, chi-square %.1f\n", cases[k].temperature,
               cases[k].top_k, cases[k].top_p, kept, chi2);
        int filtered = dfl_sampling_filters(&cases[k]);
        T_CHECKF(chi2 < 45 && (filtered ? kept >= 3 && kept < V : kept == V), "case %d: %d kept, chi-square %g", k,
                 kept, chi2);
    }
    /* the test has power: draws at T = 0.5 (logits doubled) against T = 1 */
    float h2[4];
    for (int j = 0; j < 4; j++) h2[j] = 2 * h[j];
    int kept;
    double wrong = sample_chi2(h2, h, w, H, V, &cases[0], N, &kept);
    printf("  sample T=0.5 against the T=1 distribution: chi-square %.0f\n", wrong);
    T_CHECKF(wrong > 1000, "chi-square %g", wrong);
    ops->free(w);

    /* the noise itself: standard Gumbel (mean 0.5772, variance pi^2/6),
     * finite and inside [-2.81, 16.64] */
    double m = 0, m2 = 0, lo = INFINITY, hi = -INFINITY;
    const int64_t M = 1000000;
    for (int64_t i = 0; i < M; i++) {
        double g = dfl_gumbel(dfl_sample_key(7, i / 1000), i % 1000);
        m += g, m2 += g * g, lo = fmin(lo, g), hi = fmax(hi, g);
    }
    m /= M, m2 = m2 / M - m * m;
    printf("  gumbel: mean %.4f variance %.4f range [%.2f, %.2f]\n", m, m2, lo, hi);
    T_CHECKF(fabs(m - 0.5772157) < 0.005 && fabs(m2 - 1.6449341) < 0.01, "mean %g variance %g", m, m2);
    T_CHECKF(isfinite(lo) && isfinite(hi) && lo >= -2.82 && hi <= 16.64, "range [%g, %g]", lo, hi);

    /* the op is argmax(z / T + g) row by row, keyed per row, whatever the
     * chunking; a tiny temperature gives the argmax where it is clear */
    lm_ctx c = lm_fixture();
    uint64_t *keys = dfl_malloc((size_t)c.N * sizeof *keys);
    for (int64_t i = 0; i < c.N; i++) keys[i] = dfl_sample_key(3, 1000 + i);
    float *gap = fbuf(c.N), *agap = fbuf(c.N);
    int32_t *apred = dfl_malloc((size_t)c.N * 4);
    ops->lmhead_argmax(apred, agap, c.h, c.w, c.N, c.H, c.V);
    int64_t chunks[3] = {0, 4, 100};
    for (int ci = 0; ci < 3; ci++) {
        dfl_cpu_lmhead_rows_override = chunks[ci];
        const dfl_sampling s08 = {0.8f, 0, 0};
        ops->lmhead_sample(c.pred, gap, c.h, c.w, keys, &s08, c.N, c.H, c.V);
        int bad = 0, used = 0;
        for (int64_t i = 0; i < c.N; i++) {
            double best = -INFINITY, second = -INFINITY;
            int32_t arg = -1;
            for (int64_t v = 0; v < c.V; v++) {
                double z = 0;
                for (int64_t j = 0; j < c.H; j++) z += (double)c.h[i * c.H + j] * c.w[v * c.H + j];
                double s = z / 0.8 + dfl_gumbel(keys[i], v);
                if (s > best) second = best, best = s, arg = (int32_t)v;
                else if (s > second) second = s;
            }
            if (best - second < 1e-4) continue;
            used++;
            bad += c.pred[i] != arg || fabs(gap[i] - (best - second)) > 1e-4 * (1 + fabs(best));
        }
        T_CHECKF(bad == 0 && used > c.N / 2, "chunk rows %lld: %d of %d draws differ", (long long)chunks[ci], bad, used);
    }
    dfl_cpu_lmhead_rows_override = 0;
    const dfl_sampling cold = {1e-3f, 0, 0};
    ops->lmhead_sample(c.pred, NULL, c.h, c.w, keys, &cold, c.N, c.H, c.V);
    int clear = 0, same = 0;
    for (int64_t i = 0; i < c.N; i++)
        if (agap[i] > 0.05f) clear++, same += c.pred[i] == apred[i];
    T_CHECKF(clear > 0 && same == clear, "T=0.001: %d of %d clear argmaxes drawn", same, clear);
    free(keys), free(apred), ops->free(gap), ops->free(agap);
    lm_free(&c);
}

/* The logits buffers are chunk_rows(V) x V floats: bounded by
 * DFL_CPU_LMHEAD_FLOATS (or one row), and a function of V alone, not N. */
static void test_lmhead_memory_bound(void) {
    int64_t Vs[5] = {7, 1000, 151936, 262144, (int64_t)1 << 23};
    for (int i = 0; i < 5; i++) {
        int64_t R = dfl_cpu_lmhead_chunk_rows(Vs[i]);
        T_CHECKF(R >= 1 && (R * Vs[i] <= DFL_CPU_LMHEAD_FLOATS || R == 1) && R <= DFL_CPU_LMHEAD_MAX_ROWS,
                 "V %lld: %lld rows", (long long)Vs[i], (long long)R);
    }
    T_CHECK(dfl_cpu_lmhead_chunk_rows(151936) * 151936 <= DFL_CPU_LMHEAD_FLOATS);
}

/* ------------------------------------------------------------------------ */
/* optimizer                                                                 */

static void test_adamw(void) {
    int64_t n, ns;
    float *p = fx(fx_adam, "adam.p0", &n), *grads = fx(fx_adam, "adam.grads", &ns), *ref = fx(fx_adam, "adam.p", NULL);
    float *rm = fx(fx_adam, "adam.m", NULL), *rv = fx(fx_adam, "adam.v", NULL), *hp = fx(fx_adam, "adam.hyper", NULL);
    int64_t steps = ns / n;
    float *m = fbuf(n), *v = fbuf(n);
    for (int64_t s = 0; s < steps; s++) {
        ops->adamw(p, s % 2 ? p : NULL, grads + s * n, m, v, n, hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], s + 1);
        char what[64];
        snprintf(what, sizeof what, "adamw p after step %lld", (long long)(s + 1));
        CHECK_NMSE(what, p, ref + s * n, n, 1e-13);
    }
    CHECK_NMSE("adamw m", m, rm, n, 1e-13);
    CHECK_NMSE("adamw v", v, rv, n, 1e-13);
    ops->free(p), ops->free(grads), ops->free(ref), ops->free(rm), ops->free(rv), ops->free(hp);
    ops->free(m), ops->free(v);
}

/* ------------------------------------------------------------------------ */
/* the vectorisable exp                                                      */

/* Within 2 ulp of exp (in double) on [-87.3, 88], sampled at 400k points
 * and around zero densely; 0 below the normal range; NaN stays NaN. */
static void test_expf(void) {
    double worst = 0, at = 0;
    for (int64_t i = 0; i <= 400000; i++) {
        float x = (float)(-87.3 + (88.0 + 87.3) * (double)i / 400000.0);
        if (i % 2) x = (float)((double)(i - 200000) * 1e-6); /* [-0.2, 0.2] */
        double want = exp((double)x);
        double ulp = nextafterf((float)want, INFINITY) - (float)want;
        double err = fabs((double)dfl_cpu_expf(x) - want) / ulp;
        if (err > worst) worst = err, at = x;
    }
    printf("  %-28s %.3f ulp at %g (<= 2)\n", "dfl_cpu_expf vs exp", worst, at);
    T_CHECKF(worst <= 2.0, "%.3f ulp at %g", worst, at);
    T_CHECK(dfl_cpu_expf(-INFINITY) == 0.0f && dfl_cpu_expf(-100.0f) == 0.0f && dfl_cpu_expf(0.0f) == 1.0f);
    T_CHECK(isnan(dfl_cpu_expf(NAN)));
}

/* ------------------------------------------------------------------------ */
/* determinism                                                               */

/* Every sum that crosses threads has a fixed order, so 1 and 3 threads give
 * the same bits. */
typedef struct {
    float *out, *lse, *dq, *dk, *dv, *rdx, *rdw, *dh;
    double ss;
} run_out;

static run_out run_all(int threads, attn_ctx *c, float *dout, float *x, float *w, int64_t rows, int64_t dim,
                       lm_ctx *lm) {
    omp_set_num_threads(threads);
    run_out r;
    int64_t nq = c->nblk * c->B;
    r.out = fbuf(nq * c->Hq * c->D), r.lse = fbuf(nq * c->Hq), r.dq = fbuf(nq * c->Hq * c->D);
    r.dk = fbuf(c->NK * c->Hkv * c->D), r.dv = fbuf(c->NK * c->Hkv * c->D);
    ops->attn_dflash(r.out, r.lse, c->q, c->k, c->v, c->blocks, c->nblk, c->B, c->NK, c->Hq, c->Hkv, c->D, 0);
    ops->attn_dflash_bwd(r.dq, r.dk, r.dv, dout, r.out, r.lse, c->q, c->k, c->v, c->blocks, c->nblk, c->B, c->NK,
                         c->Hq, c->Hkv, c->D, 0);
    float *y = fbuf(rows * dim), *rstd = fbuf(rows);
    r.rdx = fbuf(rows * dim), r.rdw = fbuf(dim);
    ops->rmsnorm(y, rstd, x, w, rows, dim, 1e-6f);
    ops->rmsnorm_bwd(r.rdx, r.rdw, x /* as dout */, x, rstd, w, rows, dim);
    r.ss = ops->sumsq(x, rows * dim);
    r.dh = fbuf(lm->N * lm->H);
    ops->lmhead_ce(lm->loss, lm->pred, r.dh, lm->h, lm->w, lm->labels, lm->gscale, lm->N, lm->H, lm->V);
    ops->lmhead_kl(lm->loss, lm->pred, NULL, r.dh, lm->h, lm->th, lm->w, lm->gscale, lm->N, lm->H, lm->V);
    ops->free(y), ops->free(rstd);
    return r;
}

static void run_free(run_out *r) {
    ops->free(r->out), ops->free(r->lse), ops->free(r->dq), ops->free(r->dk), ops->free(r->dv);
    ops->free(r->rdx), ops->free(r->rdw), ops->free(r->dh);
}

static void test_thread_count_invariance(void) {
    /* many blocks share context rows: sums of many terms, where order shows */
    dfl_layout L = {2, 11, {0, 90}, {90, 200}, {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1},
                    {0, 50, 51, 60, 70, 80, 89, 95, 150, 160, 199}, 200, 16};
    attn_ctx c = {0};
    c.nblk = L.nblk, c.B = L.B, c.NK = L.S + L.nblk * L.B, c.Hq = 4, c.Hkv = 2, c.D = 32;
    c.blocks = layout_blocks(&L);
    int64_t nq = c.nblk * c.B, rows = 700, dim = 33;
    dfl_rng r;
    dfl_rng_seed(&r, 10);
    c.q = fbuf(nq * c.Hq * c.D), c.k = fbuf(c.NK * c.Hkv * c.D), c.v = fbuf(c.NK * c.Hkv * c.D);
    float *dout = fbuf(nq * c.Hq * c.D), *x = fbuf(rows * dim), *w = fbuf(dim);
    frand(c.q, nq * c.Hq * c.D, &r, 1), frand(c.k, c.NK * c.Hkv * c.D, &r, 1), frand(c.v, c.NK * c.Hkv * c.D, &r, 1);
    frand(dout, nq * c.Hq * c.D, &r, 1), frand(x, rows * dim, &r, 1), frand(w, dim, &r, 1);
    lm_ctx lm = lm_fixture();
    dfl_cpu_lmhead_rows_override = 5;
    run_out a = run_all(1, &c, dout, x, w, rows, dim, &lm), b = run_all(3, &c, dout, x, w, rows, dim, &lm);
    dfl_cpu_lmhead_rows_override = 0;
    omp_set_num_threads(3);
#define SAME(f, n) T_CHECKF(!memcmp(a.f, b.f, (size_t)(n) * 4), "%s differs between 1 and 3 threads", #f)
    SAME(out, nq * c.Hq * c.D);
    SAME(lse, nq * c.Hq);
    SAME(dq, nq * c.Hq * c.D);
    SAME(dk, c.NK * c.Hkv * c.D);
    SAME(dv, c.NK * c.Hkv * c.D);
    SAME(rdx, rows * dim);
    SAME(rdw, dim);
    SAME(dh, lm.N * lm.H);
#undef SAME
    T_CHECK(a.ss == b.ss);
    run_free(&a), run_free(&b), lm_free(&lm);
    ops->free(c.q), ops->free(c.k), ops->free(c.v), ops->free(dout), ops->free(x), ops->free(w), free(c.blocks);
}

/* The products, through the tools' own thread setting: OpenBLAS alone gave
 * other bits at other thread counts (and dflash-extract other streams at
 * -t 1 and -t 3). Shapes that are not multiples of its kernels' widths,
 * one row (sgemv), a few rows (our kernel), several tiles each way. */
static void test_products_thread_count_invariance(void) {
    static const int64_t shapes[][3] = {{1000, 136, 72}, {333, 512, 520}, {600, 48, 32}, {1, 700, 900}, {7, 300, 610}};
    static const int threads[] = {2, 3, 5};
    dfl_rng r;
    dfl_rng_seed(&r, 12);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t M = shapes[s][0], K = shapes[s][1], N = shapes[s][2];
        float *in = fbuf(M * K), *w = fbuf(N * K), *dout = fbuf(M * N);
        frand(in, M * K, &r, 1), frand(w, N * K, &r, 1), frand(dout, M * N, &r, 1);
        float *out[2], *din[2], *dw[2];
        for (int i = 0; i < 2; i++) out[i] = fbuf(M * N), din[i] = fbuf(M * K), dw[i] = fbuf(N * K);
        for (size_t t = 0; t <= sizeof threads / sizeof threads[0]; t++) {
            const int i = t > 0, n = t ? threads[t - 1] : 1; /* [0]: one thread, [1]: n */
            dfl_ops_cpu_threads(n);
            ops->matmul(out[i], in, w, M, K, N, 0);
            ops->matmul(out[i], in, w, M, K, N, 1); /* accumulating: out = 2 x the product, in two sums */
            ops->matmul_bwd(din[i], dw[i], dout, in, w, M, K, N, 0);
            T_CHECKF(omp_get_max_threads() == n, "the products left %d threads, not %d", omp_get_max_threads(), n);
            if (!i) continue;
            T_CHECKF(!memcmp(out[0], out[1], (size_t)(M * N) * 4), "matmul %lldx%lldx%lld: 1 and %d threads differ",
                     (long long)M, (long long)K, (long long)N, n);
            T_CHECKF(!memcmp(din[0], din[1], (size_t)(M * K) * 4), "din %lldx%lldx%lld: 1 and %d threads differ",
                     (long long)M, (long long)K, (long long)N, n);
            T_CHECKF(!memcmp(dw[0], dw[1], (size_t)(N * K) * 4), "dw %lldx%lldx%lld: 1 and %d threads differ",
                     (long long)M, (long long)K, (long long)N, n);
        }
        for (int i = 0; i < 2; i++) ops->free(out[i]), ops->free(din[i]), ops->free(dw[i]);
        ops->free(in), ops->free(w), ops->free(dout);
    }
    dfl_ops_cpu_threads(omp_get_num_procs());
}

/* ------------------------------------------------------------------------ */
/* Qwen3.5 hybrid ops, against tests/fixtures/ops/gdn.safetensors
 * (tests/reference/gdn_reference.py: transformers' own recurrent gated delta
 * rule and causal_conv1d functions run in float64). Our f32 recurrence is
 * within ~3e-7 relative of it (nmse ~1e-13); 1e-10 catches any slip (a
 * state leaking across sequences, a lost l2norm eps, a missed history row
 * cost > 1e-4, checked by the fixture script's own controls). */
#define NMSE_GDN 1e-10

static void test_sigmoid_mul(void) {
    int64_t n;
    float *x = fx(fx_gdn, "sigmul.x", &n), *g = fx(fx_gdn, "sigmul.g", NULL), *ref = fx(fx_gdn, "sigmul.out", NULL);
    float *out = fbuf(n);
    ops->sigmoid_mul(out, x, g, n);
    CHECK_NMSE("sigmoid_mul", out, ref, n, NMSE_F32);
    ops->sigmoid_mul(x, x, g, n); /* in place */
    T_CHECK(!memcmp(x, out, (size_t)n * 4));
    ops->free(x), ops->free(g), ops->free(ref), ops->free(out);
}

/* conv1d_silu packed (3 sequences) and with a history (T 2 < K-1 and 9). */
static void test_conv1d_silu(void) {
    static const char *cases[] = {"conv", "conv_hist2", "conv_hist9"};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char name[64];
        const dfl_st_tensor *tin;
        snprintf(name, sizeof name, "%s.in", cases[c]);
        tin = fx_find(fx_gdn, name);
        const int64_t T = tin->shape[0], C = tin->shape[1];
        int64_t ncu, nw;
        float *in = fx(fx_gdn, name, NULL);
        snprintf(name, sizeof name, "%s.w", cases[c]);
        float *w = fx(fx_gdn, name, &nw);
        snprintf(name, sizeof name, "%s.cu", cases[c]);
        int32_t *cu = fxi(fx_gdn, name, &ncu);
        snprintf(name, sizeof name, "%s.out", cases[c]);
        float *ref = fx(fx_gdn, name, NULL), *hist = NULL, *out = fbuf(T * C);
        if (c > 0) {
            snprintf(name, sizeof name, "%s.hist", cases[c]);
            hist = fx(fx_gdn, name, NULL);
        }
        ops->conv1d_silu(out, in, hist, w, cu, ncu - 1, T, C, nw / C);
        CHECK_NMSE(cases[c], out, ref, T * C, NMSE_GDN);
        if (hist) { /* without the history the first K-1 rows must differ */
            ops->conv1d_silu(out, in, NULL, w, cu, 1, T, C, nw / C);
            T_CHECK(t_nmse_f32(out, ref, T * C) > 1e-4);
            ops->free(hist);
        } else { /* one sequence instead of three: the history leaks, rows differ */
            int32_t one[2] = {0, (int32_t)T};
            ops->conv1d_silu(out, in, NULL, w, one, 1, T, C, nw / C);
            T_CHECK(t_nmse_f32(out, ref, T * C) > 1e-4);
        }
        ops->free(in), ops->free(w), ops->free(cu), ops->free(ref), ops->free(out);
    }
}

typedef struct {
    int64_t T, Hk, Hv, dk, dv, nseq;
    float *qkv, *ba, *A_log, *dt_bias;
    int32_t *cu;
} gdn_case;

static void gdn_open(gdn_case *g, const char *pre, const int32_t *sizes) {
    char name[64];
    g->Hk = sizes[0], g->Hv = sizes[1], g->dk = sizes[2], g->dv = sizes[3];
    snprintf(name, sizeof name, "%s.qkv", pre);
    g->T = fx_find(fx_gdn, name)->shape[0];
    g->qkv = fx(fx_gdn, name, NULL);
    snprintf(name, sizeof name, "%s.ba", pre);
    g->ba = fx(fx_gdn, name, NULL);
    snprintf(name, sizeof name, "%s.A_log", pre);
    g->A_log = fx(fx_gdn, name, NULL);
    snprintf(name, sizeof name, "%s.dt_bias", pre);
    g->dt_bias = fx(fx_gdn, name, NULL);
    snprintf(name, sizeof name, "%s.cu", pre);
    int64_t ncu;
    g->cu = fxi(fx_gdn, name, &ncu);
    g->nseq = ncu - 1;
}

static void gdn_close(gdn_case *g) { ops->free(g->qkv), ops->free(g->ba), ops->free(g->A_log), ops->free(g->dt_bias), ops->free(g->cu); }

/* Packed sequences (7, 1, 70: past HF's 64-row chunk) from zero states; each
 * sequence alone with a state gives its final state. */
static void test_gated_delta(void) {
    int32_t *sizes = fxi(fx_gdn, "gdn.sizes", NULL);
    gdn_case g;
    gdn_open(&g, "gdn", sizes);
    const int64_t VD = g.Hv * g.dv, S = g.Hv * g.dk * g.dv;
    float *out = fbuf(g.T * VD), *ref = fx(fx_gdn, "gdn.out", NULL), *fin = fx(fx_gdn, "gdn.final", NULL);
    ops->gated_delta(out, NULL, NULL, g.qkv, g.ba, g.A_log, g.dt_bias, g.cu, g.nseq, g.T, g.Hk, g.Hv, g.dk, g.dv);
    CHECK_NMSE("gated_delta packed", out, ref, g.T * VD, NMSE_GDN);
    float *state = fbuf(S);
    for (int64_t s = 0; s < g.nseq; s++) {
        const int64_t r0 = g.cu[s], n = g.cu[s + 1] - r0, C = 2 * g.Hk * g.dk + VD;
        int32_t one[2] = {0, (int32_t)n};
        memset(state, 0, (size_t)S * 4);
        ops->gated_delta(out, state, NULL, g.qkv + r0 * C, g.ba + r0 * 2 * g.Hv, g.A_log, g.dt_bias, one, 1, n, g.Hk,
                         g.Hv, g.dk, g.dv);
        CHECK_NMSE("  final state of a sequence", state, fin + s * S, S, NMSE_GDN);
        CHECK_NMSE("  its output alone", out, ref + r0 * VD, n * VD, NMSE_GDN);
    }
    /* one sequence instead of three: the state leaks into the next */
    int32_t all[2] = {0, (int32_t)g.T};
    ops->gated_delta(out, NULL, NULL, g.qkv, g.ba, g.A_log, g.dt_bias, all, 1, g.T, g.Hk, g.Hv, g.dk, g.dv);
    T_CHECK(t_nmse_f32(out, ref, g.T * VD) > 1e-4);
    ops->free(out), ops->free(ref), ops->free(fin), ops->free(state);
    gdn_close(&g);

    /* from a given state, with the state after every row (rollback points) */
    gdn_open(&g, "gdn_state", sizes);
    float *st = fx(fx_gdn, "gdn_state.init", NULL), *steps = fbuf(g.T * S);
    float *rfin = fx(fx_gdn, "gdn_state.final", NULL), *rsteps = fx(fx_gdn, "gdn_state.steps", NULL);
    out = fbuf(g.T * VD), ref = fx(fx_gdn, "gdn_state.out", NULL);
    ops->gated_delta(out, st, steps, g.qkv, g.ba, g.A_log, g.dt_bias, g.cu, 1, g.T, g.Hk, g.Hv, g.dk, g.dv);
    CHECK_NMSE("gated_delta from a state", out, ref, g.T * VD, NMSE_GDN);
    CHECK_NMSE("  final state", st, rfin, S, NMSE_GDN);
    CHECK_NMSE("  state after every row", steps, rsteps, g.T * S, NMSE_GDN);
    T_CHECK(!memcmp(steps + (g.T - 1) * S, st, (size_t)S * 4));
    ops->free(st), ops->free(steps), ops->free(rfin), ops->free(rsteps), ops->free(out), ops->free(ref);
    gdn_close(&g);
    ops->free(sizes);
}

/* ------------------------------------------------------------------------ */
/* mixture of experts: routing against a hand-worked case and a sorting     */
/* oracle, the combine against its formula in double                        */

/* Three tokens, four experts, k 2, worked by hand: token 0 takes 3 then 2;
 * token 1 ties three ways at 1 and takes 0, 1 (lower ids first); token 2
 * ties at 5 and takes 0, 2. Listed by expert: e0: (1,0) (2,0); e1: (1,1);
 * e2: (0,1) (2,1); e3: (0,0). */
static void test_moe_route_by_hand(void) {
    const float logits[12] = {0, 1, 2, 3, 1, 1, 0, 1, 5, -1, 5, 5};
    const int64_t want_off[5] = {0, 2, 3, 5, 6};
    const int32_t want_rows[6] = {1, 2, 1, 0, 2, 0}, want_pos[6] = {5, 3, 0, 2, 1, 4};
    const int32_t ids[6] = {3, 2, 0, 1, 0, 2};
    for (int norm = 0; norm < 2; norm++) {
        int64_t off[5];
        int32_t rows[6], pos[6];
        float w[6], want_w[6];
        ops->moe_route(off, rows, pos, w, logits, 3, 4, 2, norm);
        T_CHECK(!memcmp(off, want_off, sizeof off));
        T_CHECK(!memcmp(rows, want_rows, sizeof rows));
        T_CHECK(!memcmp(pos, want_pos, sizeof pos));
        for (int t = 0; t < 3; t++) {
            double sum = 0;
            for (int e = 0; e < 4; e++) sum += exp((double)logits[t * 4 + e]);
            double p0 = exp((double)logits[t * 4 + ids[2 * t]]) / sum, p1 = exp((double)logits[t * 4 + ids[2 * t + 1]]) / sum;
            want_w[2 * t] = (float)(norm ? p0 / (p0 + p1) : p0);
            want_w[2 * t + 1] = (float)(norm ? p1 / (p0 + p1) : p1);
        }
        CHECK_NMSE(norm ? "moe_route weights, norm" : "moe_route weights", w, want_w, 6, NMSE_F32);
        if (norm) T_CHECK(w[2] == 0.5f && w[3] == 0.5f && w[4] == 0.5f && w[5] == 0.5f); /* equal p */
    }
}


/* Random logits on a grid of 1/64 in [-4, 4] (many equal values, and p
 * rising strictly with the logit otherwise): each token's experts by a sort
 * on (logit descending, id ascending), weights by a softmax in double, the
 * listing by a stable sort of the (token, slot) pairs on the expert. With
 * T*E over the parallel threshold, on 1 and 3 threads. */
static void test_moe_route_oracle(void) {
    const int64_t T = 700, E = 128, k = 8, n = T * k;
    dfl_rng r;
    dfl_rng_seed(&r, 31);
    float *logits = fbuf(T * E), *w = fbuf(n), *want_w = fbuf(n), *w1 = fbuf(n);
    for (int64_t i = 0; i < T * E; i++) logits[i] = (float)((int)dfl_rng_below(&r, 513) - 256) / 64.0f;
    int32_t *ids = dfl_malloc((size_t)n * 4);
    moe_oracle(ids, want_w, logits, T, E, k, 1);
    /* the listing: pairs sorted by expert, stable (insertion sort of indices) */
    int32_t *want_rows = dfl_malloc((size_t)n * 4), *want_pos = dfl_malloc((size_t)n * 4), *lst = dfl_malloc((size_t)n * 4);
    int64_t *want_off = dfl_calloc((size_t)E + 1, 8);
    int64_t m = 0;
    for (int64_t e = 0; e < E; e++) {
        want_off[e] = m;
        for (int64_t i = 0; i < n; i++)
            if (ids[i] == e) lst[m++] = (int32_t)i;
    }
    want_off[E] = m;
    T_CHECK(m == n);
    for (int64_t p = 0; p < n; p++) want_rows[p] = lst[p] / (int32_t)k, want_pos[lst[p]] = (int32_t)p;
    int64_t *off = dfl_malloc((size_t)(E + 1) * 8);
    int32_t *rows = dfl_malloc((size_t)n * 4), *pos = dfl_malloc((size_t)n * 4);
    for (int threads = 1; threads <= 3; threads += 2) {
        omp_set_num_threads(threads);
        ops->moe_route(off, rows, pos, threads == 1 ? w1 : w, logits, T, E, k, 1);
        T_CHECKF(!memcmp(off, want_off, (size_t)(E + 1) * 8), "%d threads: offsets", threads);
        T_CHECKF(!memcmp(rows, want_rows, (size_t)n * 4), "%d threads: rows", threads);
        T_CHECKF(!memcmp(pos, want_pos, (size_t)n * 4), "%d threads: pos", threads);
    }
    omp_set_num_threads(3);
    CHECK_NMSE("moe_route weights (oracle)", w, want_w, n, NMSE_F32);
    T_CHECK(!memcmp(w, w1, (size_t)n * 4));
    ops->free(logits), ops->free(w), ops->free(want_w), ops->free(w1);
    free(ids), free(want_rows), free(want_pos), free(lst), free(want_off), free(off), free(rows), free(pos);
}

/* gather_rows copies rows; moe_combine against its formula in double, with
 * and without the shared expert, onto x's start values */
static void test_moe_gather_combine(void) {
    const int64_t T = 5, k = 3, H = 7, n = T * k;
    dfl_rng r;
    dfl_rng_seed(&r, 32);
    float *in = fbuf(T * H), *y = fbuf(n * H), *sh = fbuf(T * H), *sg = fbuf(T), *wts = fbuf(n), *x = fbuf(T * H);
    float *x0 = fbuf(T * H), *want = fbuf(T * H);
    frand(in, T * H, &r, 1), frand(sh, T * H, &r, 1), frand(sg, T, &r, 2), frand(wts, n, &r, 0.3f), frand(x0, T * H, &r, 1);
    int32_t rows[15], pos[15];
    for (int64_t i = 0; i < n; i++) rows[i] = (int32_t)((i * 7 + 3) % T), pos[i] = (int32_t)((i * 4 + 1) % n);
    ops->gather_rows(y, in, rows, n, H);
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < H; c++) T_CHECK(y[i * H + c] == in[rows[i] * H + c]);
    for (int shared = 0; shared < 2; shared++) {
        memcpy(x, x0, (size_t)(T * H) * 4);
        ops->moe_combine(x, y, pos, wts, shared ? sh : NULL, shared ? sg : NULL, T, k, H);
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < H; c++) {
                double acc = x0[t * H + c];
                for (int64_t j = 0; j < k; j++) acc += (double)wts[t * k + j] * y[pos[t * k + j] * H + c];
                if (shared) acc += sh[t * H + c] / (1.0 + exp(-(double)sg[t]));
                want[t * H + c] = (float)acc;
            }
        CHECK_NMSE(shared ? "moe_combine, shared expert" : "moe_combine", x, want, T * H, NMSE_F32);
    }
    ops->free(in), ops->free(y), ops->free(sh), ops->free(sg), ops->free(wts), ops->free(x), ops->free(x0);
    ops->free(want);
}

/* matmul_grouped is the matmul op on each group's rows: bit for bit
 * against one matmul call per group (test_matmul and test_gemm_nt_paths
 * check that op against its oracles), but for a group of one row, which
 * takes the few-rows kernel (that op's path for 2..16 rows, 2..64 where K
 * >= 1024) instead of
 * sgemv. Groups of 0 rows (first, middle, last), 1 row, a few (the
 * few-rows kernel) and more than DFL_CPU_FEW_ROWS (sgemm: one tile, and
 * 2 x 3 tiles of 256), odd K and N, the weights inside a stacked
 * [G, 2N, K] tensor (w_stride 2NK: the gate half, then the up half at +NK),
 * overwrite and accumulate onto random values; the weights in f32 and in
 * bf16 (the same values: widened exactly, the same bits). Nothing outside
 * the listed rows is written, and no group at all writes nothing. */
static void grouped_shape_bits(const int64_t *rows, int G, int64_t K, int64_t N, uint64_t seed) {
    const int64_t stride = 2 * N * K;
    int64_t *off = dfl_calloc((size_t)G + 1, sizeof *off);
    for (int e = 0; e < G; e++) off[e + 1] = off[e] + rows[e];
    const int64_t R = off[G];
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    float *x = fbuf(R * K), *w = fbuf(G * stride), *start = fbuf(R * N + 1);
    float *got = fbuf(R * N + 1), *want = fbuf(R * N + 1);
    frand(x, R * K, &r, 1), frand(w, G * stride, &r, 0.3f), frand(start, R * N + 1, &r, 1);
    uint16_t *wb = dfl_malloc((size_t)(G * stride) * sizeof *wb);
    for (int64_t i = 0; i < G * stride; i++) w[i] = dfl_bf16_to_f32(wb[i] = dfl_f32_to_bf16(w[i]));
    for (int c = 0; c < 8; c++) {
        const int bf = c & 1, half = c >> 1 & 1, acc = c >> 2;
        const float *wh = w + half * N * K;
        memcpy(got, start, (size_t)(R * N + 1) * 4), memcpy(want, start, (size_t)(R * N + 1) * 4);
        if (bf) ops->matmul_grouped(got, x, wb + half * N * K, DFL_BF16, off, G, stride, K, N, acc);
        else ops->matmul_grouped(got, x, wh, DFL_F32, off, G, stride, K, N, acc);
        for (int e = 0; e < G; e++)
            if (rows[e] == 1)
                dfl_cpu_gemm_nt_few_rows(want + off[e] * N, x + off[e] * K, wh + e * stride, DFL_F32, 1, K, N, acc);
            else if (rows[e])
                ops->matmul(want + off[e] * N, x + off[e] * K, wh + e * stride, rows[e], K, N, acc);
        T_CHECKF(memcmp(got, want, (size_t)(R * N + 1) * 4) == 0,
                 "K %lld N %lld, %s weights, %s half, accumulate %d: not the per-group matmul", (long long)K,
                 (long long)N, bf ? "bf16" : "f32", half ? "up" : "gate", acc);
        T_CHECK(memcmp(&got[R * N], &start[R * N], 4) == 0);
        float d = 0; /* and the outputs did change: the comparison above is not of two no-ops */
        for (int64_t i = 0; i < R * N; i++) d = fmaxf(d, fabsf(got[i] - start[i]));
        T_CHECK(d > 0.1f);
    }
    /* no groups, and groups without rows: nothing written */
    memcpy(got, start, (size_t)(R * N + 1) * 4);
    const int64_t none[4] = {0, 0, 0, 0};
    ops->matmul_grouped(got, x, w, DFL_F32, none, 0, stride, K, N, 0);
    ops->matmul_grouped(got, x, w, DFL_F32, none, 3, stride, K, N, 0);
    ops->matmul_grouped(got, x, wb, DFL_BF16, none, 3, stride, K, N, 0);
    T_CHECK(memcmp(got, start, (size_t)(R * N + 1) * 4) == 0);
    /* K = 0: an empty sum, so 0 (overwrite) or the start values (accumulate) */
    ops->matmul_grouped(got, x, w, DFL_F32, off, G, stride, 0, N, 1);
    T_CHECK(memcmp(got, start, (size_t)(R * N + 1) * 4) == 0);
    ops->matmul_grouped(got, x, wb, DFL_BF16, off, G, stride, 0, N, 0);
    int zero = 1;
    for (int64_t i = 0; i < R * N; i++) zero &= got[i] == 0.0f;
    T_CHECK(zero && memcmp(&got[R * N], &start[R * N], 4) == 0);
    ops->free(x), ops->free(w), ops->free(start), ops->free(got), ops->free(want);
    free(wb);
    free(off);
}

static void test_matmul_grouped(void) {
    static const int64_t small[] = {0, 1, 5, 0, 23, 16, 4, 0}, tiled[] = {300, 2, 0, 17},
                         wide[] = {16, 3, 0, 9, 40, 49};
    grouped_shape_bits(small, 8, 19, 13, 33);
    grouped_shape_bits(tiled, 4, 37, 520, 34);
    /* few rows on big enough products for the threads to share them (the
     * bf16 weights widened into each thread's buffer: 8 rows or more), N % 3 = 1;
     * at this K, 40 rows take the few-rows kernel and 49 sgemm */
    grouped_shape_bits(wide, 6, 1030, 301, 35);
}

int main(void) {
    /* an odd thread count, whatever the environment: uneven splits */
    omp_set_num_threads(3);
    ops = dfl_ops_cpu();
    const dfl_ops *byname = NULL;
    T_CHECK(dfl_ops_get("cpu", &byname) == 0 && byname == ops);
    fx_dense = open_fx("dense"), fx_attn = open_fx("attn"), fx_lm = open_fx("lmhead"), fx_adam = open_fx("adamw");
    fx_gdn = open_fx("gdn"), fx_yarn = open_fx("rope_yarn"), fx_oss = open_fx("gptoss");
    T_RUN(test_memory_and_conversions);
    T_RUN(test_large_alloc_and_upload);
    T_RUN(test_products_thread_count_invariance);
    T_RUN(test_matmul);
    T_RUN(test_matmul_fd);
    T_RUN(test_gemm_nt_paths);
    T_RUN(test_sgemm_tile_rule);
    T_RUN(test_sgemm_tiles);
    T_RUN(test_few_rows_grouping);
    T_RUN(test_few_rows_exact_sums);
    T_RUN(test_gemm_nt_dispatch);
    T_RUN(test_rmsnorm);
    T_RUN(test_rmsnorm_fd);
    T_RUN(test_rope);
    T_RUN(test_rope_fd);
    T_RUN(test_rope_yarn);
    T_RUN(test_qk_norm_rope_fd);
    T_RUN(test_swiglu);
    T_RUN(test_swiglu_fd);
    T_RUN(test_swiglu_oss);
    T_RUN(test_swiglu_oss_fixture);
    T_RUN(test_add_embed_sumsq);
    T_RUN(test_attn_causal_fixture);
    T_RUN(test_attn_causal_mask);
    T_RUN(test_attn_causal_window);
    T_RUN(test_attn_dflash_fixture);
    T_RUN(test_attn_dflash_mask);
    T_RUN(test_attn_dflash_window);
    T_RUN(test_attn_dflash_rows);
    T_RUN(test_attn_dflash_fd);
    T_RUN(test_attn_sinks);
    T_RUN(test_attn_sinks_fixture);
    T_RUN(test_lmhead_ce);
    T_RUN(test_lmhead_kl);
    T_RUN(test_lmhead_fd);
    T_RUN(test_lmhead_argmax);
    T_RUN(test_top2_matches_scan);
    T_RUN(test_lmhead_sample);
    T_RUN(test_lmhead_memory_bound);
    T_RUN(test_adamw);
    T_RUN(test_sigmoid_mul);
    T_RUN(test_conv1d_silu);
    T_RUN(test_gated_delta);
    T_RUN(test_moe_route_by_hand);
    T_RUN(test_moe_route_oracle);
    T_RUN(test_moe_gather_combine);
    T_RUN(test_matmul_grouped);
    T_RUN(test_expf);
    T_RUN(test_thread_count_invariance);
    dfl_st_close(fx_dense), dfl_st_close(fx_attn), dfl_st_close(fx_lm), dfl_st_close(fx_adam), dfl_st_close(fx_gdn);
    dfl_st_close(fx_yarn), dfl_st_close(fx_oss);
    return t_exit();
}
