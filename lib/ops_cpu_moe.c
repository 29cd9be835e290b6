/* ops_cpu_moe.c: the CPU ops of the mixture-of-experts targets (Qwen3-MoE,
 * Qwen3.5-MoE): routing, the gather of each expert's rows and the weighted
 * combine, and the experts' matrix products (ops.h has the contracts).
 *
 * The routing follows transformers' Qwen3MoeSparseMoeBlock: softmax over
 * all experts in f32, then top-k, then (norm_topk_prob) division by the sum
 * of the k. The listing by expert is a counting sort, stable, so it is the
 * same on every thread count and on every backend.
 */
#include "ops_cpu.h"

#include "common.h"

#include <math.h>
#include <stdlib.h>

/* Token t's k experts (descending p, lower id first on ties) into ids[k],
 * their weights into w[k]. p: f32 scratch [E]. */
static void route_token(int32_t *ids, float *w, float *p, const float *logits, int64_t E, int64_t k, int norm) {
    float mx = logits[0];
    for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0;
    for (int64_t e = 0; e < E; e++) sum += p[e] = expf(logits[e] - mx);
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float kept = 0;
    for (int64_t j = 0; j < k; j++) { /* k is small (8 of 128 in Qwen3-30B-A3B): selection, k passes */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (p[e] != -INFINITY && (best < 0 || p[e] > p[best])) best = e; /* a NaN row: the lowest ids */
        ids[j] = (int32_t)best;
        w[j] = p[best];
        kept += p[best];
        p[best] = -INFINITY; /* taken */
    }
    if (norm)
        for (int64_t j = 0; j < k; j++) w[j] /= kept;
}

void dfl_cpu_moe_route(int64_t *offsets, int32_t *rows, int32_t *pos, float *wts, const void *logits_, int64_t T,
                       int64_t E, int64_t k, int norm) {
    const float *logits = logits_;
    DFL_ASSERT(k >= 1 && k <= E);
    int32_t *ids = dfl_malloc((size_t)(T * k) * sizeof *ids);
#pragma omp parallel if (T * E > DFL_CPU_PAR_MIN)
    {
        float *p = dfl_malloc((size_t)E * sizeof *p);
#pragma omp for
        for (int64_t t = 0; t < T; t++) route_token(ids + t * k, wts + t * k, p, logits + t * E, E, k, norm);
        free(p);
    }
    /* counting sort of the pairs by expert, stable in (token, slot) order */
    for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t i = 0; i < T * k; i++) offsets[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int64_t *next = dfl_malloc((size_t)E * sizeof *next);
    for (int64_t e = 0; e < E; e++) next[e] = offsets[e];
    for (int64_t i = 0; i < T * k; i++) {
        int64_t at = next[ids[i]]++;
        rows[at] = (int32_t)(i / k);
        pos[i] = (int32_t)at;
    }
    free(next);
    free(ids);
}

/* One product per expert with rows: up to DFL_CPU_FEW_ROWS rows (64 where K
 * >= 1024: dfl_cpu_takes_few_rows), the few-rows kernel, on the weights as
 * they are (bf16 widened a few rows of w at a time, or read as it is: an
 * expert of a verify step or a decode step has a row or a few, and its
 * weights are read once); more rows, the tiled sgemm, bf16 weights widened a
 * panel of rows at a time (dfl_cpu_gemm_nt_bf16: N*K conversions against
 * rows*N*K multiply-adds). So the bits do not depend on the weights' dtype.
 * One row goes through the few-rows kernel too, not sgemv (the matmul op's
 * path): no bf16 sgemv exists, and widening a whole matrix for one row costs
 * more than the product. No parallel loop over experts here: each product
 * parallelises itself where it is big enough. A target's dense bf16 matrices
 * come here too, as one group (target.c dfl_target_matmul). */
void dfl_cpu_matmul_grouped(void *out_, const void *in_, const void *w_, dfl_dtype wdt, const int64_t *offsets,
                            int64_t G, int64_t w_stride, int64_t K, int64_t N, int accumulate) {
    float *out = out_;
    const float *in = in_;
    DFL_ASSERT(G >= 0 && K >= 0 && N >= 0 && w_stride >= 0);
    DFL_ASSERT(G == 0 || offsets[0] == 0);
    DFL_ASSERT(wdt == DFL_F32 || wdt == DFL_BF16);
    const size_t esz = dfl_dtype_size(wdt);
    for (int64_t e = 0; e < G; e++) {
        const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
        DFL_ASSERT(rows >= 0);
        if (rows == 0) continue;
        const void *we = (const char *)w_ + (size_t)(e * w_stride) * esz;
        if (dfl_cpu_takes_few_rows(rows, K) && K > 0 && N > 0) {
            dfl_cpu_gemm_nt_few_rows(out + r0 * N, in + r0 * K, we, wdt, rows, K, N, accumulate);
            continue;
        }
        if (wdt == DFL_BF16 && K > 0)
            dfl_cpu_gemm_nt_bf16(out + r0 * N, in + r0 * K, we, rows, K, N, accumulate ? 1.0f : 0.0f);
        else
            dfl_cpu_matmul(out + r0 * N, in + r0 * K, we, rows, K, N, accumulate);
    }
}

void dfl_cpu_gather_rows(void *out_, const void *in_, const int32_t *rows, int64_t n, int64_t H) {
    float *out = out_;
    const float *in = in_;
#pragma omp parallel for if (n * H > DFL_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < H; c++) out[i * H + c] = in[(int64_t)rows[i] * H + c];
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

void dfl_cpu_moe_combine(void *x_, const void *y_, const int32_t *pos, const float *wts, const void *shared_,
                         const void *sgate_, int64_t T, int64_t k, int64_t H) {
    float *x = x_;
    const float *y = y_, *shared = shared_, *sgate = sgate_;
#pragma omp parallel for if (T * k * H > DFL_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float g = shared ? sigmoidf(sgate[t]) : 0.0f;
        for (int64_t c = 0; c < H; c++) {
            float acc = 0;
            for (int64_t j = 0; j < k; j++) acc += wts[t * k + j] * y[(int64_t)pos[t * k + j] * H + c];
            if (shared) acc += g * shared[t * H + c];
            x[t * H + c] += acc;
        }
    }
}
