// elementwise.cu: SwiGLU forward and backward, gpt-oss's clamped SwiGLU,
// residual add, sigmoid gate, a projection's bias, attention sinks.
// defines: cuda_swiglu, cuda_swiglu_bwd, cuda_swiglu_oss, cuda_add, cuda_sigmoid_mul,
// cuda_add_bias, cuda_attn_sinks
//
// Memory-bound: each thread moves 8 bf16 (16 bytes) per access when every
// pointer is 16-byte aligned, else one element at a time. Math in f32, one
// rounding to bf16 per output. Backward outputs accumulate (+=).
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

// W elements per step; n is a multiple of W for W = 8 (the tail goes to W = 1)
template <int W>
__global__ void swiglu_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], o[W];
        load_bf16s<W>(g, gate + i);
        load_bf16s<W>(u, up + i);
#pragma unroll
        for (int k = 0; k < W; k++) o[k] = g[k] * sigmoid_f(g[k]) * u[k];
        store_bf16s<W>(out + i, o);
    }
}

// gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
// (u + 1) * g * sigmoid(alpha * g); comparisons keep a NaN (torch.clamp)
template <int W>
__global__ void swiglu_oss_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n, float alpha,
                                  float limit) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], o[W];
        load_bf16s<W>(g, gate + i);
        load_bf16s<W>(u, up + i);
#pragma unroll
        for (int k = 0; k < W; k++) {
            const float gc = g[k] > limit ? limit : g[k];
            const float uc = u[k] > limit ? limit : u[k] < -limit ? -limit : u[k];
            o[k] = (uc + 1.0f) * (gc * sigmoid_f(gc * alpha));
        }
        store_bf16s<W>(out + i, o);
    }
}

// W values at p, or W zeros where the result overwrites
template <int W, bool ACC>
__device__ __forceinline__ void old_or_zero(float *v, const bf16 *p) {
    if (ACC) load_bf16s<W>(v, p);
    else
        for (int k = 0; k < W; k++) v[k] = 0.0f;
}

// d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g); ACC: added to the old values
template <int W, bool ACC>
__global__ void swiglu_bwd_kernel(bf16 *dgate, bf16 *dup, const bf16 *dout, const bf16 *gate, const bf16 *up,
                                  int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], d[W], acc[W];
        load_bf16s<W>(g, gate + i);
        load_bf16s<W>(u, up + i);
        load_bf16s<W>(d, dout + i);
        if (dgate) {
            old_or_zero<W, ACC>(acc, dgate + i);
#pragma unroll
            for (int k = 0; k < W; k++) {
                float s = sigmoid_f(g[k]);
                acc[k] += d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            }
            store_bf16s<W>(dgate + i, acc);
        }
        if (dup) {
            old_or_zero<W, ACC>(acc, dup + i);
#pragma unroll
            for (int k = 0; k < W; k++) acc[k] += d[k] * g[k] * sigmoid_f(g[k]);
            store_bf16s<W>(dup + i, acc);
        }
    }
}

// out = Op(a, b) elementwise
struct AddOp {
    __device__ float operator()(float x, float y) const { return x + y; }
};
struct SigmoidMulOp { // the gated attention's output gate (Qwen3.5)
    __device__ float operator()(float x, float g) const { return x * sigmoid_f(g); }
};

template <int W, class Op>
__global__ void binary_kernel(bf16 *out, const bf16 *a, const bf16 *b, int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float x[W], y[W];
        load_bf16s<W>(x, a + i);
        load_bf16s<W>(y, b + i);
#pragma unroll
        for (int k = 0; k < W; k++) x[k] = Op()(x[k], y[k]);
        store_bf16s<W>(out + i, x);
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

// blocks of 256 threads for `items` work items, at most 16 per SM (the
// kernels loop over the rest)
static inline int elementwise_grid(int64_t items) {
    int64_t g = CEIL_DIV(items, (int64_t)256);
    int64_t cap = (int64_t)g_cuda.sm_count * 16;
    return (int)(g < 1 ? 1 : g < cap ? g : cap);
}

// p + off, keeping NULL (an output that is not wanted) NULL
template <typename T>
static inline T *shift_ptr(T *p, int64_t off) { return p ? p + off : p; }

// Run an elementwise op over [0,n): kernel k8 (8 elements per access) over
// the body, a multiple of 8, when every pointer is 16-byte aligned (NULL
// counts as aligned), then k1 over the rest. The kernels take
// (pointers..., count) with every pointer indexed like [0,n).
template <typename K8, typename K1, typename... P>
static void launch_split(int64_t n, K8 k8, K1 k1, P... p) {
    const bool aligned = (is_aligned(p, 16) && ...);
    const int64_t body = aligned ? n / 8 * 8 : 0;
    if (body) {
        KLAUNCH(k8, elementwise_grid(body / 8), 256, 0)(p..., body);
        LAUNCH_CHECK();
    }
    if (n > body) {
        KLAUNCH(k1, elementwise_grid(n - body), 256, 0)(shift_ptr(p, body)..., n - body);
        LAUNCH_CHECK();
    }
}

void cuda_swiglu(void *out, const void *gate, const void *up, int64_t n) {
    CU_ASSERT(out && gate && up && n >= 0);
    launch_split(n, swiglu_kernel<8>, swiglu_kernel<1>, (bf16 *)out, (const bf16 *)gate, (const bf16 *)up);
}

void cuda_swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate, const void *up, int64_t n,
                     int accumulate) {
    CU_ASSERT(dout && gate && up && n >= 0);
    if (!dgate && !dup) return;
    if (accumulate)
        launch_split(n, swiglu_bwd_kernel<8, true>, swiglu_bwd_kernel<1, true>, (bf16 *)dgate, (bf16 *)dup,
                     (const bf16 *)dout, (const bf16 *)gate, (const bf16 *)up);
    else
        launch_split(n, swiglu_bwd_kernel<8, false>, swiglu_bwd_kernel<1, false>, (bf16 *)dgate, (bf16 *)dup,
                     (const bf16 *)dout, (const bf16 *)gate, (const bf16 *)up);
}

// launch_split for pointers only; the two scalars make this one by hand
void cuda_swiglu_oss(void *out, const void *gate, const void *up, int64_t n, float alpha, float limit) {
    CU_ASSERT(out && gate && up && n >= 0);
    const bool aligned = is_aligned(out, 16) && is_aligned(gate, 16) && is_aligned(up, 16);
    const int64_t body = aligned ? n / 8 * 8 : 0;
    if (body) {
        KLAUNCH(swiglu_oss_kernel<8>, elementwise_grid(body / 8), 256, 0)((bf16 *)out, (const bf16 *)gate,
                                                                         (const bf16 *)up, body, alpha, limit);
        LAUNCH_CHECK();
    }
    if (n > body) {
        KLAUNCH(swiglu_oss_kernel<1>, elementwise_grid(n - body), 256, 0)(
            (bf16 *)out + body, (const bf16 *)gate + body, (const bf16 *)up + body, n - body, alpha, limit);
        LAUNCH_CHECK();
    }
}

void cuda_add(void *out, const void *a, const void *b, int64_t n) {
    CU_ASSERT(out && a && b && n >= 0);
    launch_split(n, binary_kernel<8, AddOp>, binary_kernel<1, AddOp>, (bf16 *)out, (const bf16 *)a, (const bf16 *)b);
}

// x[r, c] += bias[c], one thread an element (grid-stride): the bias row is
// small and stays in cache; a projection's output is read and written once.
__global__ void add_bias_kernel(bf16 *x, const bf16 *bias, int64_t n, int64_t cols) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(bias[i % cols]));
}

void cuda_add_bias(void *x, const void *bias, int64_t rows, int64_t cols) {
    CU_ASSERT(x && bias && rows >= 0 && cols > 0);
    const int64_t n = rows * cols;
    if (n == 0) return;
    KLAUNCH(add_bias_kernel, elementwise_grid(n), 256, 0)((bf16 *)x, (const bf16 *)bias, n, cols);
    LAUNCH_CHECK();
}

void cuda_sigmoid_mul(void *out, const void *x, const void *g, int64_t n) {
    CU_ASSERT(out && x && g && n >= 0);
    launch_split(n, binary_kernel<8, SigmoidMulOp>, binary_kernel<1, SigmoidMulOp>, (bf16 *)out, (const bf16 *)x,
                 (const bf16 *)g);
}

// out[t, h, :] *= 1 / (1 + exp(sinks[h] - lse[t, h])), one thread an
// element; the factor is recomputed per element (cheap next to the load).
__global__ void attn_sinks_kernel(bf16 *out, const float *lse, const float *sinks, int64_t n, int64_t Hq,
                                  int64_t D) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / D;
        const float s = 1.0f / (1.0f + expf(sinks[r % Hq] - lse[r]));
        out[i] = f2bf(bf2f(out[i]) * s);
    }
}

void cuda_attn_sinks(void *out, const float *lse, const float *sinks, int64_t T, int64_t Hq, int64_t D) {
    CU_ASSERT(out && lse && sinks && T >= 0 && Hq > 0 && D > 0);
    const int64_t n = T * Hq * D;
    if (n == 0) return;
    KLAUNCH(attn_sinks_kernel, elementwise_grid(n), 256, 0)((bf16 *)out, lse, sinks, n, Hq, D);
    LAUNCH_CHECK();
}
