/* bench_ops_cpu.c: time CPU ops for tests/bench/bench_ops_cpu.sh.
 *
 *   bench_ops_cpu matmul M K N REPS          out[M,N] = in[M,K] w[N,K]^T
 *   bench_ops_cpu dflash S NBLK B HQ HKV D REPS
 *       attn_dflash forward, then forward + backward, on the training
 *       layout: S context rows, block j anchored at (j + 0.5) * S / NBLK,
 *       its keys at S + j*B
 *   bench_ops_cpu causal T HQ HKV D REPS      attn_causal, one sequence of T
 *   bench_ops_cpu lmhead N H V REPS           lmhead_ce with gradient
 *   bench_ops_cpu grouped E ROWS K N REPS
 *       matmul_grouped: E experts of ROWS rows each, w [E, N, K] in f32,
 *       then in bf16 (a MoE target's experts on the CPU)
 *
 * Prints "name seconds gflop_per_s" lines, the best of REPS calls, in CPU
 * time of the whole process (all threads): on a shared machine that is
 * steadier than wall time. Inputs are random; nothing is checked here
 * (tests/unit does that).
 */
#include "common.h"
#include "ops.h"
#include "rng.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const dfl_ops *ops;

static float *rand_buf(int64_t n, dfl_rng *r) {
    float *x = ops->alloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) x[i] = (float)dfl_rng_normal(r);
    return x;
}

static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int64_t arg(char **argv, int i) { return strtoll(argv[i], NULL, 10); }

static void report(const char *name, double best, double flop) {
    printf("%s %.6f %.2f\n", name, best, flop / best * 1e-9);
}

static void bench_matmul(int64_t M, int64_t K, int64_t N, int reps, dfl_rng *r) {
    float *x = rand_buf(M * K, r), *w = rand_buf(N * K, r), *out = ops->alloc((size_t)(M * N) * 4);
    double best = 1e30;
    for (int i = 0; i < reps + 1; i++) {
        double t0 = cpu_now();
        ops->matmul(out, x, w, M, K, N, 0);
        double dt = cpu_now() - t0;
        if (i > 0 && dt < best) best = dt; /* the first call warms up */
    }
    report("matmul", best, 2.0 * (double)M * (double)K * (double)N);
    ops->free(x), ops->free(w), ops->free(out);
}

static void bench_dflash(int64_t S, int64_t nblk, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int reps,
                         dfl_rng *r) {
    int64_t NK = S + nblk * B, nq = nblk * B;
    dfl_block *blocks = calloc((size_t)nblk, sizeof *blocks);
    double visible = 0; /* query-key pairs actually attended, per head */
    for (int64_t j = 0; j < nblk; j++) {
        int32_t a = (int32_t)(((double)j + 0.5) * (double)S / (double)nblk);
        blocks[j] = (dfl_block){0, a, (int32_t)(S + j * B)};
        visible += (double)B * (double)(a + B);
    }
    float *q = rand_buf(nq * Hq * D, r), *k = rand_buf(NK * Hkv * D, r), *v = rand_buf(NK * Hkv * D, r);
    float *dout = rand_buf(nq * Hq * D, r), *out = ops->alloc((size_t)(nq * Hq * D) * 4);
    float *lse = ops->alloc((size_t)(nq * Hq) * 4);
    float *dq = ops->alloc((size_t)(nq * Hq * D) * 4), *dk = ops->alloc((size_t)(NK * Hkv * D) * 4),
          *dv = ops->alloc((size_t)(NK * Hkv * D) * 4);
    double fwd = 1e30, both = 1e30;
    for (int i = 0; i < reps + 1; i++) {
        double t0 = cpu_now();
        ops->attn_dflash(out, lse, q, k, v, blocks, nblk, B, NK, Hq, Hkv, D, 0);
        double t1 = cpu_now();
        ops->attn_dflash_bwd(dq, dk, dv, dout, out, lse, q, k, v, blocks, nblk, B, NK, Hq, Hkv, D, 0);
        double t2 = cpu_now();
        if (i > 0 && t1 - t0 < fwd) fwd = t1 - t0;
        if (i > 0 && t2 - t0 < both) both = t2 - t0;
    }
    /* flops of the visible pairs: 4 D per pair forward (QK^T, PV); 10 D backward (QK^T, dO V^T, dQ, dK, dV) */
    report("dflash_fwd", fwd, 4.0 * (double)D * visible * (double)Hq);
    report("dflash_fwd_bwd", both, 14.0 * (double)D * visible * (double)Hq);
    free(blocks);
    ops->free(q), ops->free(k), ops->free(v), ops->free(dout), ops->free(out), ops->free(lse);
    ops->free(dq), ops->free(dk), ops->free(dv);
}

static void bench_causal(int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int reps, dfl_rng *r) {
    float *q = rand_buf(T * Hq * D, r), *k = rand_buf(T * Hkv * D, r), *v = rand_buf(T * Hkv * D, r);
    float *out = ops->alloc((size_t)(T * Hq * D) * 4);
    int32_t cu[2] = {0, (int32_t)T};
    double best = 1e30;
    for (int i = 0; i < reps + 1; i++) {
        double t0 = cpu_now();
        ops->attn_causal(out, NULL, q, k, v, cu, 1, T, Hq, Hkv, D, 0);
        double dt = cpu_now() - t0;
        if (i > 0 && dt < best) best = dt;
    }
    report("causal", best, 4.0 * (double)D * (double)T * (double)(T + 1) / 2 * (double)Hq);
    ops->free(q), ops->free(k), ops->free(v), ops->free(out);
}

static void bench_lmhead(int64_t N, int64_t H, int64_t V, int reps, dfl_rng *r) {
    float *h = rand_buf(N * H, r), *w = rand_buf(V * H, r), *dh = ops->alloc((size_t)(N * H) * 4);
    float *loss = ops->alloc((size_t)N * 4), *gs = ops->alloc((size_t)N * 4);
    int32_t *labels = ops->alloc((size_t)N * 4), *pred = ops->alloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) labels[i] = (int32_t)dfl_rng_below(r, (uint64_t)V), gs[i] = 1.0f / (float)N;
    double best = 1e30;
    for (int i = 0; i < reps + 1; i++) {
        double t0 = cpu_now();
        ops->lmhead_ce(loss, pred, dh, h, w, labels, gs, N, H, V);
        double dt = cpu_now() - t0;
        if (i > 0 && dt < best) best = dt;
    }
    report("lmhead_ce_grad", best, 4.0 * (double)N * (double)H * (double)V);
    ops->free(h), ops->free(w), ops->free(dh), ops->free(loss), ops->free(gs), ops->free(labels), ops->free(pred);
}

static void bench_grouped(int64_t E, int64_t rows, int64_t K, int64_t N, int reps, dfl_rng *r) {
    const int64_t R = E * rows;
    float *x = rand_buf(R * K, r), *w = rand_buf(E * N * K, r), *out = ops->alloc((size_t)(R * N) * 4);
    uint16_t *wb = ops->alloc((size_t)(E * N * K) * 2);
    for (int64_t i = 0; i < E * N * K; i++) wb[i] = dfl_f32_to_bf16(w[i]);
    int64_t *off = dfl_malloc((size_t)(E + 1) * sizeof *off);
    for (int64_t e = 0; e <= E; e++) off[e] = e * rows;
    for (int bf = 0; bf < 2; bf++) {
        double best = 1e30;
        for (int i = 0; i < reps + 1; i++) {
            double t0 = cpu_now();
            ops->matmul_grouped(out, x, bf ? (const void *)wb : w, bf ? DFL_BF16 : DFL_F32, off, E, N * K, K, N, 0);
            double dt = cpu_now() - t0;
            if (i > 0 && dt < best) best = dt;
        }
        report(bf ? "grouped_bf16" : "grouped_f32", best, 2.0 * (double)R * (double)K * (double)N);
    }
    ops->free(x), ops->free(w), ops->free(out), ops->free(wb);
    free(off);
}

int main(int argc, char **argv) {
    ops = dfl_ops_cpu();
    dfl_rng r;
    dfl_rng_seed(&r, 1);
    if (argc == 6 && !strcmp(argv[1], "matmul"))
        bench_matmul(arg(argv, 2), arg(argv, 3), arg(argv, 4), (int)arg(argv, 5), &r);
    else if (argc == 9 && !strcmp(argv[1], "dflash"))
        bench_dflash(arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5), arg(argv, 6), arg(argv, 7),
                     (int)arg(argv, 8), &r);
    else if (argc == 7 && !strcmp(argv[1], "causal"))
        bench_causal(arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5), (int)arg(argv, 6), &r);
    else if (argc == 6 && !strcmp(argv[1], "lmhead"))
        bench_lmhead(arg(argv, 2), arg(argv, 3), arg(argv, 4), (int)arg(argv, 5), &r);
    else if (argc == 7 && !strcmp(argv[1], "grouped"))
        bench_grouped(arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5), (int)arg(argv, 6), &r);
    else {
        fprintf(stderr, "usage: bench_ops_cpu matmul M K N REPS | dflash S NBLK B HQ HKV D REPS | "
                        "causal T HQ HKV D REPS | lmhead N H V REPS | grouped E ROWS K N REPS\n");
        return 2;
    }
    return 0;
}
