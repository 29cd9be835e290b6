// elementwise.cu: SwiGLU forward and backward, residual add.
// defines: cuda_swiglu, cuda_swiglu_bwd, cuda_add
//
// Memory-bound: each thread moves 8 bf16 (16 bytes) per access when every
// pointer is 16-byte aligned, else one element at a time. Math in f32, one
// rounding to bf16 per output. Backward outputs accumulate (+=).
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// W elements per step; n is a multiple of W for W = 8 (the tail goes to W = 1)
template <int W>
__global__ void swiglu_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], o[W];
        load_bf16s<W>(g, gate + i);
        load_bf16s<W>(u, up + i);
#pragma unroll
        for (int k = 0; k < W; k++) o[k] = g[k] * sigmoidf_(g[k]) * u[k];
        store_bf16s<W>(out + i, o);
    }
}

// d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g)
template <int W>
__global__ void swiglu_bwd_kernel(bf16 *dgate, bf16 *dup, const bf16 *dout, const bf16 *gate, const bf16 *up,
                                  int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], d[W], acc[W];
        load_bf16s<W>(g, gate + i);
        load_bf16s<W>(u, up + i);
        load_bf16s<W>(d, dout + i);
        if (dgate) {
            load_bf16s<W>(acc, dgate + i);
#pragma unroll
            for (int k = 0; k < W; k++) {
                float s = sigmoidf_(g[k]);
                acc[k] += d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            }
            store_bf16s<W>(dgate + i, acc);
        }
        if (dup) {
            load_bf16s<W>(acc, dup + i);
#pragma unroll
            for (int k = 0; k < W; k++) acc[k] += d[k] * g[k] * sigmoidf_(g[k]);
            store_bf16s<W>(dup + i, acc);
        }
    }
}

template <int W>
__global__ void add_kernel(bf16 *out, const bf16 *a, const bf16 *b, int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float x[W], y[W];
        load_bf16s<W>(x, a + i);
        load_bf16s<W>(y, b + i);
#pragma unroll
        for (int k = 0; k < W; k++) x[k] += y[k];
        store_bf16s<W>(out + i, x);
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

void cuda_swiglu(void *out, const void *gate, const void *up, int64_t n) {
    CU_ASSERT(out && gate && up && n >= 0);
    launch_split(n, swiglu_kernel<8>, swiglu_kernel<1>, (bf16 *)out, (const bf16 *)gate, (const bf16 *)up);
}

void cuda_swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate, const void *up, int64_t n) {
    CU_ASSERT(dout && gate && up && n >= 0);
    if (!dgate && !dup) return;
    launch_split(n, swiglu_bwd_kernel<8>, swiglu_bwd_kernel<1>, (bf16 *)dgate, (bf16 *)dup, (const bf16 *)dout,
                 (const bf16 *)gate, (const bf16 *)up);
}

void cuda_add(void *out, const void *a, const void *b, int64_t n) {
    CU_ASSERT(out && a && b && n >= 0);
    launch_split(n, add_kernel<8>, add_kernel<1>, (bf16 *)out, (const bf16 *)a, (const bf16 *)b);
}
