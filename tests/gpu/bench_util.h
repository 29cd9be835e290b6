/* bench_util.h: what the GPU benchmarks share: random device tensors made
 * from a pool (so that 16 GB of weights need no 16 GB upload), FLOP
 * counting wrappers around the op table, and a wall clock around device
 * work (ops->sync, then dfl_now).
 *
 * The benchmarks time the op table exactly as the model code drives it
 * (one stream, host launches included). They run on any backend: on the
 * CPU with --tiny they are a smoke test of themselves (tests/cli). */
#ifndef DFLASH_BENCH_UTIL_H
#define DFLASH_BENCH_UTIL_H

#include "common.h"
#include "ops.h"
#include "rng.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const dfl_ops *OPS;
static double FLOPS; /* model FLOPs issued so far */

/* ---- random tensors from a pool ---------------------------------------------- */

#define POOL_N ((int64_t)1 << 22)
enum { POOL_ACT, POOL_WT, POOL_MASTER, POOLS };
static void *POOL[POOLS]; /* act values in [-1,1); weights in [-0.03,0.03) as act/wt and as f32 */

static inline void pool_init(uint64_t seed) {
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    float *h = dfl_malloc((size_t)POOL_N * sizeof(float));
    for (int k = 0; k < POOLS; k++) {
        double scale = k == POOL_ACT ? 1.0 : 0.03;
        /* bf16 values, so that every backend starts from identical numbers */
        for (int64_t i = 0; i < POOL_N; i++)
            h[i] = dfl_bf16_to_f32(dfl_f32_to_bf16((float)(scale * (2.0 * dfl_rng_uniform(&r) - 1.0))));
        if (k == POOL_MASTER) {
            POOL[k] = OPS->alloc((size_t)POOL_N * sizeof(float));
            OPS->upload(POOL[k], h, (size_t)POOL_N * sizeof(float));
        } else {
            POOL[k] = OPS->alloc((size_t)POOL_N * OPS->act_bytes);
            OPS->load_act(POOL[k], h, DFL_F32, POOL_N);
        }
    }
    free(h);
}

/* Fill n elements from a pool: copies of it, at a shifting offset so that
 * tensors do not all start alike. Never zeros (METHOD.md: zeros time
 * optimistically). */
static inline void pool_fill(void *dst, int64_t n, int pool) {
    size_t es = pool == POOL_MASTER ? 4 : (size_t)OPS->act_bytes;
    const char *src = (const char *)POOL[pool];
    static int64_t shift = 0;
    shift = (shift + 7919) % (POOL_N / 2);
    for (int64_t off = 0; off < n;) {
        int64_t m = n - off < POOL_N - shift ? n - off : POOL_N - shift;
        OPS->copy((char *)dst + off * es, src + shift * es, (size_t)m * es);
        off += m;
    }
}

static inline void *act_new(int64_t n) { return OPS->alloc((size_t)(n ? n : 1) * OPS->act_bytes); }
static inline void *act_rand(int64_t n, int pool) {
    void *p = act_new(n);
    pool_fill(p, n, pool);
    return p;
}
static inline float *f32_new(int64_t n) { return OPS->alloc((size_t)(n ? n : 1) * sizeof(float)); }
static inline void *i32_put(const int32_t *h, int64_t n) {
    void *p = OPS->alloc((size_t)(n ? n : 1) * 4);
    OPS->upload(p, h, (size_t)n * 4);
    return p;
}
static inline void zero_act(void *p, int64_t n) { OPS->zero(p, (size_t)n * OPS->act_bytes); }
/* a bf16/f32 act buffer of ones (norm weights) */
static inline void *act_ones(int64_t n) {
    float *h = dfl_malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) h[i] = 1.0f;
    void *p = act_new(n);
    OPS->load_act(p, h, DFL_F32, n);
    free(h);
    return p;
}

/* RoPE inverse frequencies, theta^(-2i/d) */
static inline float *inv_freq_new(int64_t d, double theta) {
    float *h = dfl_malloc((size_t)(d / 2) * sizeof(float));
    for (int64_t i = 0; i < d / 2; i++) h[i] = (float)pow(theta, -2.0 * (double)i / (double)d);
    float *p = f32_new(d / 2);
    OPS->upload(p, h, (size_t)(d / 2) * sizeof(float));
    free(h);
    return p;
}

/* ---- counted ops --------------------------------------------------------------- */

static inline void MM(void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N, int acc) {
    OPS->matmul(out, in, w, M, K, N, acc);
    FLOPS += 2.0 * (double)M * (double)K * (double)N;
}
static inline void MM_BWD(void *din, float *dw, const void *dout, const void *in, const void *w, int64_t M, int64_t K,
                   int64_t N, int acc) {
    OPS->matmul_bwd(din, dw, dout, in, w, M, K, N, acc);
    FLOPS += 2.0 * (double)M * (double)K * (double)N * ((din != NULL) + (dw != NULL));
}

/* wall time of device work: drain, then read the clock */
static inline double now_synced(void) {
    OPS->sync();
    return dfl_now();
}

/* mean wall seconds of `iters` calls of fn after one warm-up call */
static inline double time_calls(void (*fn)(void *), void *ctx, int64_t iters) {
    fn(ctx);
    double t0 = now_synced();
    for (int64_t i = 0; i < iters; i++) fn(ctx);
    return (now_synced() - t0) / (double)iters;
}

/* device cu of nseq packed sequences of len rows each */
static inline int32_t *cu_even(int64_t nseq, int64_t len) {
    int32_t *cu = dfl_malloc((size_t)(nseq + 1) * 4);
    for (int64_t s = 0; s <= nseq; s++) cu[s] = (int32_t)(s * len);
    int32_t *d = i32_put(cu, nseq + 1);
    free(cu);
    return d;
}

static inline void print_kv(const char *key, const char *fmt, double v) {
    printf("%-34s ", key);
    printf(fmt, v);
    printf("\n");
}

#endif
