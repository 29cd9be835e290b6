/* ops_cpu_gdn.c: the CPU ops of the Qwen3.5 hybrid target: the gated
 * attention's output gate, the Gated DeltaNet's causal depthwise
 * convolution and its gated delta rule (ops.h has the contracts).
 *
 * The delta rule runs in its recurrent form, one row at a time, with the
 * state in f32, exactly as written in ops.h (transformers'
 * torch_recurrent_gated_delta_rule). Hugging Face's prefill uses the
 * chunked (WY) form of the same recurrence; the two agree to f32 rounding
 * (tests/fixtures/ops/gdn.safetensors records both). Parallel over
 * (sequence, value head) pairs: each owns its state.
 */
#include "ops_cpu.h"

#include "common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* torch.nn.functional.softplus with beta 1, threshold 20. */
static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void dfl_cpu_sigmoid_mul(void *out_, const void *x_, const void *g_, int64_t n) {
    float *out = out_;
    const float *x = x_, *g = g_;
#pragma omp parallel for if (n > DFL_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * sigmoidf(g[i]);
}

/* The raw input that row r (r < lo: before the sequence) contributes. */
static inline float conv_in(const float *in, const float *hist, int64_t r, int64_t lo, int64_t c, int64_t C, int64_t K) {
    if (r >= lo) return in[r * C + c];
    int64_t hr = (K - 1) - (lo - r); /* hist row; lo - r is in [1, K-1] */
    return hist && hr >= 0 ? hist[hr * C + c] : 0.0f;
}

void dfl_cpu_conv1d_silu(void *out_, const void *in_, const void *hist_, const void *w_, const int32_t *cu,
                         int64_t nseq, int64_t T, int64_t C, int64_t K) {
    float *out = out_;
    const float *in = in_, *hist = hist_, *w = w_;
    DFL_ASSERT(!hist || nseq == 1);
    (void)T;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t lo = cu[s], hi = cu[s + 1];
#pragma omp parallel for if ((hi - lo) * C * K > DFL_CPU_PAR_MIN)
        for (int64_t t = lo; t < hi; t++)
            for (int64_t c = 0; c < C; c++) {
                float acc = 0;
                for (int64_t j = 0; j < K; j++) acc += w[c * K + j] * conv_in(in, hist, t - (K - 1) + j, lo, c, C, K);
                out[t * C + c] = acc / (1.0f + expf(-acc));
            }
    }
}

/* x / sqrt(sum x^2 + 1e-6), then times `scale` (two roundings, as torch). */
static void l2norm_scaled(float *dst, const float *x, int64_t n, float scale) {
    float ss = 0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) dst[i] = x[i] * inv * scale;
}

/* One row of the recurrence for one value head: S [dk, dv] in place. The
 * decay is applied while S^T k is formed, and S^T q while S is updated:
 * two passes over S instead of four, each inner loop along dv (contiguous,
 * vectorised; the sums per column keep the order of the plain loops). */
SIMD_CLONES
static void delta_step(float *restrict S, float *restrict o, float *restrict u, const float *restrict q,
                       const float *restrict k, const float *restrict v, float decay, float beta, int64_t dk,
                       int64_t dv) {
    for (int64_t c = 0; c < dv; c++) u[c] = 0, o[c] = 0;
    for (int64_t i = 0; i < dk; i++) {
        float *Si = S + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) {
            Si[c] *= decay;
            u[c] += Si[c] * ki; /* S^T k */
        }
    }
    for (int64_t c = 0; c < dv; c++) u[c] = (v[c] - u[c]) * beta;
    for (int64_t i = 0; i < dk; i++) {
        float *Si = S + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) {
            Si[c] += ki * u[c];
            o[c] += Si[c] * qi; /* S^T q */
        }
    }
}

void dfl_cpu_gated_delta(void *out_, float *state, float *steps, const void *qkv_, const void *ba_,
                         const float *A_log, const float *dt_bias, const int32_t *cu, int64_t nseq, int64_t T,
                         int64_t Hk, int64_t Hv, int64_t dk, int64_t dv) {
    float *out = out_;
    const float *qkv = qkv_, *ba = ba_;
    DFL_ASSERT((!state && !steps) || nseq == 1);
    DFL_ASSERT(Hk > 0 && Hv % Hk == 0);
    const int64_t C = 2 * Hk * dk + Hv * dv, group = Hv / Hk;
    const float scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for collapse(2) if (T * Hv * dk * dv > DFL_CPU_PAR_MIN)
    for (int64_t s = 0; s < nseq; s++)
        for (int64_t j = 0; j < Hv; j++) {
            float *S = state ? state + j * dk * dv : calloc((size_t)(dk * dv), sizeof *S);
            float *tmp = malloc((size_t)(2 * dk + dv) * sizeof *tmp);
            DFL_ASSERT(S && tmp);
            float *qn = tmp, *kn = tmp + dk, *u = tmp + 2 * dk;
            const float decay_rate = expf(A_log[j]);
            for (int64_t t = cu[s]; t < cu[s + 1]; t++) {
                const float *row = qkv + t * C, *abr = ba + t * 2 * Hv;
                l2norm_scaled(qn, row + (j / group) * dk, dk, scale);
                l2norm_scaled(kn, row + Hk * dk + (j / group) * dk, dk, 1.0f);
                float beta = sigmoidf(abr[j]);
                float g = -decay_rate * softplusf(abr[Hv + j] + dt_bias[j]);
                delta_step(S, out + t * Hv * dv + j * dv, u, qn, kn, row + 2 * Hk * dk + j * dv, expf(g), beta, dk, dv);
                if (steps) memcpy(steps + (t * Hv + j) * dk * dv, S, (size_t)(dk * dv) * sizeof *S);
            }
            if (!state) free(S);
            free(tmp);
        }
}
