/* ops_cpu.h: what lib/ops_cpu*.c share. Not an interface for model code,
 * which reaches these ops only through dfl_ops_cpu(); the unit test uses the
 * LM-head chunk hook below to exercise chunk boundaries.
 *
 * Sizes: T tokens, Hq/Hkv heads, D head dim, B block size, NK key rows,
 * N rows, H hidden, V vocab. Every buffer is f32 on the CPU.
 */
#ifndef DFLASH_OPS_CPU_H
#define DFLASH_OPS_CPU_H

#include "ops.h"

#include <stdint.h>
#include <string.h>

/* out[M,N] = in[M,K] . w[N,K]^T + beta * out (beta 0 or 1). OpenBLAS's
 * sgemm first copies (packs) the whole weight matrix, which costs more than
 * the products at a few rows: one row (decoding a token) goes through
 * sgemv, up to DFL_CPU_FEW_ROWS (verifying a block) through a kernel that
 * brings w from memory once for all of them, more through sgemm. Where K
 * >= DFL_CPU_LONG_K, up to DFL_CPU_FEW_ROWS_LONG_K rows take that kernel
 * too (a short prompt's prefill, an expert's rows in a small batch): long
 * rows make w a stream from memory, which the kernel reads once and sgemm
 * packs first. 1 thread, 32 rows: K 4096, N 4096 21.2 -> 16.1 ms; K 2048,
 * N 768 1.91 -> 1.43; K 1024, N 4096 5.4 -> 3.4. At 64 rows the kernel
 * still wins on bf16 weights, as a target's are on the CPU (1 thread:
 * 1.04-1.11x over the three shapes above and K 2048, N 2048; 2 threads:
 * 1.11-1.48x, the kernel splitting N evenly where sgemm's 3 tiles of N 768
 * split 2:1), and on f32 weights evens out (1 thread 0.90-1.03x, 2 threads
 * 1.02-1.41x); by 72 rows bf16 is even too. Shorter rows, whose w stays in
 * cache, are sgemm's past 16 rows (K 256, N 4096, 32 rows: 0.87 ms against
 * 1.15 for the kernel). (Measured on an AMD Zen 4. On an AVX-512 Xeon, where
 * OpenBLAS's sgemm runs 16 lanes, K 4096, N 4096, 1 thread, sgemm's time
 * over the kernel's with its fused multiply-adds: bf16 1.75 at 16 rows, 1.20
 * at 32, 1.07 at 40, 0.95 at 48, 0.87 at 64; f32 1.19 at 16, 0.89 at 24,
 * 0.66 at 64.) */
#define DFL_CPU_FEW_ROWS 16
#define DFL_CPU_FEW_ROWS_LONG_K 64
#define DFL_CPU_LONG_K 1024

/* Whether an M-row product with rows of K takes the few-rows kernel (M >= 2
 * for dfl_cpu_gemm_nt, whose one row goes through sgemv). */
static inline int dfl_cpu_takes_few_rows(int64_t M, int64_t K) {
    return M <= DFL_CPU_FEW_ROWS || (M <= DFL_CPU_FEW_ROWS_LONG_K && K >= DFL_CPU_LONG_K);
}
/* C[M,N] = op(A)[M,K] . op(B)[K,N] + beta * C, row-major; op transposes
 * when trans_* is set. Every product goes through it (see ops_cpu.c: the
 * bits do not depend on the thread count). */
/* The edge of the square tiles an M x N output is cut into: 1024 or 512
 * where the output has 4 of them for each of the machine's online CPUs,
 * else 256, halved down to 64 while there are fewer than 2. */
int64_t dfl_cpu_gemm_tile(int64_t M, int64_t N);
/* Test hook: when > 0, the machine's CPU count for dfl_cpu_gemm_tile. Not
 * thread-safe; set it only between calls. */
extern int64_t dfl_cpu_machine_cpus_override;
void dfl_cpu_sgemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                   const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
void dfl_cpu_gemm_nt(float *out, const float *in, const float *w, int64_t M, int64_t K, int64_t N, float beta);
/* dfl_cpu_gemm_nt's few-rows kernel (what it runs for M > 1 where
 * dfl_cpu_takes_few_rows; any M works), on f32 weights or on bf16 ones,
 * widened exactly (from 8 rows on, 3 rows of w at a time into a buffer;
 * else as the tiles read them): the same sums in the same order, so bf16
 * weights give the bits of f32 weights of the same values. acc: beta 1. */
void dfl_cpu_gemm_nt_few_rows(float *out, const float *in, const void *w, dfl_dtype wdt, int64_t M, int64_t K,
                              int64_t N, int acc);
/* dfl_cpu_gemm_nt for bf16 weights and rows past dfl_cpu_takes_few_rows:
 * the bits of dfl_cpu_sgemm on the same values in f32 (the same tiles),
 * widening a tile's rows of w at a time. */
void dfl_cpu_gemm_nt_bf16(float *out, const float *in, const uint16_t *w, int64_t M, int64_t K, int64_t N,
                          float beta);
/* The matmul op (ops.h): dfl_cpu_gemm_nt, and the empty cases. */
void dfl_cpu_matmul(void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N, int accumulate);

/* Kernels compiled twice, for x86-64-v3 (AVX2, FMA) and the baseline, and
 * picked at load time (an ifunc). */
#if defined(__x86_64__) && defined(__GNUC__)
#define SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SIMD_CLONES
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* Weights k .. k+7 of a row of w: f32, or bf16 widened (exactly: the bf16
 * bits are the f32's top half). bf16 is a constant where it is inlined. */
static inline __attribute__((always_inline)) void dfl_load_w8(v8f *v, const void *wr, int64_t k, int bf16) {
    if (bf16) {
        v8h h;
        memcpy(&h, (const uint16_t *)wr + k, sizeof h);
        const v8u u = __builtin_convertvector(h, v8u) << 16;
        memcpy(v, &u, sizeof *v);
    } else {
        memcpy(v, (const float *)wr + k, sizeof *v);
    }
}

/* dst[i] = src[i] widened (exact), eight at a time as dfl_load_w8 does. */
void dfl_cpu_widen_bf16(float *dst, const uint16_t *src, int64_t n);

#define V8_LOAD(v, p) memcpy(&(v), (p), sizeof(v8f))
#define V8_ADD_STORE(p, v)            \
    do {                              \
        v8f t_;                       \
        memcpy(&t_, (p), sizeof t_);  \
        t_ += (v);                    \
        memcpy((p), &t_, sizeof t_);  \
    } while (0)

/* exp(x) in f32 written so that loops over it vectorize (libm's expf is a
 * call): x = n ln2 + r with n = round(x / ln2) (Cody-Waite two-part ln2),
 * exp(r) by the Cephes expf polynomial, times 2^n built in the exponent
 * bits. Within 2 ulp of exp on [-87.3, 88] (tests/unit/test_ops_cpu.c
 * sweeps it); 0 below -87.3, where exp leaves the normal range (-inf
 * included); x is capped at 88; NaN stays NaN. The ops call it on scores
 * minus their maximum, which are <= 0. */
static inline float dfl_cpu_expf(float x) {
    /* Every branch is a select between computed values, so that the
     * compiler can if-convert and vectorize the loops that call this. */
    float xc = x > -87.3f ? x : -87.3f; /* NaN -> -87.3: the int cast stays defined */
    xc = xc < 88.0f ? xc : 88.0f;
    float t = xc * 1.44269504088896341f;
    float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) * (1 << 23);
    float scale;
    memcpy(&scale, &e, sizeof scale);
    float y = p * scale;
    float z = x < -87.3f ? 0.0f : y;
    return x == x ? z : x; /* NaN in, NaN out */
}

/* ---- Qwen3.5 hybrid ops (ops_cpu_gdn.c) ---- */
void dfl_cpu_sigmoid_mul(void *out, const void *x, const void *g, int64_t n);
void dfl_cpu_conv1d_silu(void *out, const void *in, const void *hist, const void *w, const int32_t *cu,
                         int64_t nseq, int64_t T, int64_t C, int64_t K);
void dfl_cpu_gated_delta(void *out, float *state, float *steps, const void *qkv, const void *ba,
                         const float *A_log, const float *dt_bias, const int32_t *cu, int64_t nseq, int64_t T,
                         int64_t Hk, int64_t Hv, int64_t dk, int64_t dv);

/* ---- mixture of experts (ops_cpu_moe.c) ---- */
void dfl_cpu_moe_route(int64_t *offsets, int32_t *rows, int32_t *pos, float *wts, const void *logits, int64_t T,
                       int64_t E, int64_t k, int norm);
void dfl_cpu_matmul_grouped(void *out, const void *in, const void *w, dfl_dtype wdt, const int64_t *offsets,
                            int64_t G, int64_t w_stride, int64_t K, int64_t N, int accumulate);
void dfl_cpu_gather_rows(void *out, const void *in, const int32_t *rows, int64_t n, int64_t H);
void dfl_cpu_moe_combine(void *x, const void *y, const int32_t *pos, const float *wts, const void *shared,
                         const void *sgate, int64_t T, int64_t k, int64_t H);

/* ---- attention (ops_cpu_attn.c) ---- */
void dfl_cpu_attn_causal(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *cu,
                         int64_t nseq, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
void dfl_cpu_attn_dflash(void *out, float *lse, const void *q, const void *k, const void *v,
                         const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                         int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
void dfl_cpu_attn_dflash_bwd(void *dq, void *dk, void *dv, const void *dout, const void *out,
                             const float *lse, const void *q, const void *k, const void *v,
                             const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                             int64_t Hq, int64_t Hkv, int64_t D, int64_t window);

/* Work (elements touched, or multiply-adds) below which a loop runs on one
 * thread: a parallel region costs a few microseconds when the machine is
 * idle and a scheduler time slice per barrier when it is busy (OpenMP's
 * threads spin while one of them waits for a core), so small problems, a
 * tiny model or one decoding step, must not open one. */
#define DFL_CPU_PAR_MIN ((int64_t)1 << 16)

/* ---- LM head and losses (ops_cpu_lmhead.c) ---- */
void dfl_cpu_lmhead_ce(float *loss, int32_t *pred, void *dh, const void *h, const void *w,
                       const int32_t *labels, const float *gscale, int64_t N, int64_t H, int64_t V);
void dfl_cpu_lmhead_kl(float *loss, int32_t *pred, int32_t *tpred, void *dh, const void *h, const void *th,
                       const void *w, const float *gscale, int64_t N, int64_t H, int64_t V);
void dfl_cpu_lmhead_argmax(int32_t *pred, float *gap, const void *h, const void *w, int64_t N, int64_t H, int64_t V);
void dfl_cpu_lmhead_sample(int32_t *pred, float *gap, const void *h, const void *w, const uint64_t *keys,
                           const dfl_sampling *s, int64_t N, int64_t H, int64_t V);

/* Rows of logits held at once for a vocabulary of V: the logits buffers are
 * rows x V floats, at most DFL_CPU_LMHEAD_FLOATS (+ one row when V alone
 * exceeds it), whatever N is. */
#define DFL_CPU_LMHEAD_FLOATS ((int64_t)1 << 22) /* 16 MiB per logits buffer */
#define DFL_CPU_LMHEAD_MAX_ROWS 128
int64_t dfl_cpu_lmhead_chunk_rows(int64_t V);
/* The top two of z[V], V >= 1: returns the argmax, the lowest index of the
 * maximum; *max = z[argmax], *second = the largest of the others (-inf
 * when V is 1). NaN entries are ignored, except z[0]: a NaN there is the
 * argmax and the max (so the row's statistics come out NaN). The scalar
 * scan "z[c] > max, else z[c] > second" from z[0] gives the same three
 * (the runner-up the same in value: a zero's sign may differ). */
int32_t dfl_cpu_top2(const float *z, int64_t V, float *max, float *second);
/* Test hook: when > 0, the number of rows per chunk (instead of the rule
 * above). Not thread-safe; set it only between calls. */
extern int64_t dfl_cpu_lmhead_rows_override;

#endif
