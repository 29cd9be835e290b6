// elementwise.cu: SwiGLU forward and backward, residual add.
// defines: cuda_swiglu, cuda_swiglu_bwd, cuda_add
//
// Memory-bound: each thread moves 8 bf16 (16 bytes) per access when every
// pointer is 16-byte aligned, else one element at a time. Math in f32, one
// rounding to bf16 per output. Backward outputs accumulate (+=).
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

struct bf16x8 {
    bf16 v[8];
};

template <int W>
__device__ __forceinline__ void load_w(float *f, const bf16 *p) {
    if (W == 8) {
        bf16x8 x = *(const bf16x8 *)p;
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = bf2f(x.v[i]);
    } else {
        f[0] = bf2f(*p);
    }
}

template <int W>
__device__ __forceinline__ void store_w(bf16 *p, const float *f) {
    if (W == 8) {
        bf16x8 x;
#pragma unroll
        for (int i = 0; i < 8; i++) x.v[i] = f2bf(f[i]);
        *(bf16x8 *)p = x;
    } else {
        *p = f2bf(f[0]);
    }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// W elements per step; n is a multiple of W for W = 8 (the tail goes to W = 1)
template <int W>
__global__ void swiglu_kernel(bf16 *out, const bf16 *gate, const bf16 *up, int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], o[W];
        load_w<W>(g, gate + i);
        load_w<W>(u, up + i);
#pragma unroll
        for (int k = 0; k < W; k++) o[k] = g[k] * sigmoidf_(g[k]) * u[k];
        store_w<W>(out + i, o);
    }
}

// d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g)
template <int W>
__global__ void swiglu_bwd_kernel(bf16 *dgate, bf16 *dup, const bf16 *dout, const bf16 *gate, const bf16 *up,
                                  int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float g[W], u[W], d[W], acc[W];
        load_w<W>(g, gate + i);
        load_w<W>(u, up + i);
        load_w<W>(d, dout + i);
        if (dgate) {
            load_w<W>(acc, dgate + i);
#pragma unroll
            for (int k = 0; k < W; k++) {
                float s = sigmoidf_(g[k]);
                acc[k] += d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            }
            store_w<W>(dgate + i, acc);
        }
        if (dup) {
            load_w<W>(acc, dup + i);
#pragma unroll
            for (int k = 0; k < W; k++) acc[k] += d[k] * g[k] * sigmoidf_(g[k]);
            store_w<W>(dup + i, acc);
        }
    }
}

template <int W>
__global__ void add_kernel(bf16 *out, const bf16 *a, const bf16 *b, int64_t n) {
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * W; i < n;
         i += (int64_t)gridDim.x * blockDim.x * W) {
        float x[W], y[W];
        load_w<W>(x, a + i);
        load_w<W>(y, b + i);
#pragma unroll
        for (int k = 0; k < W; k++) x[k] += y[k];
        store_w<W>(out + i, x);
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

static int grid_for(int64_t items) {
    int64_t g = CEIL_DIV(items, (int64_t)256);
    int64_t cap = (int64_t)g_cuda.sm_count * 16;
    return (int)(g < 1 ? 1 : g < cap ? g : cap);
}

// Split [0,n) into a vectorised body (multiple of 8, when every pointer is
// 16-byte aligned) and a scalar tail; `run(W, offset, count)` launches one.
template <typename F>
static void split_vec(int64_t n, int aligned, F run) {
    int64_t body = aligned ? n / 8 * 8 : 0;
    if (body) run(8, (int64_t)0, body);
    if (n > body) run(1, body, n - body);
}

void cuda_swiglu(void *out, const void *gate, const void *up, int64_t n) {
    CU_ASSERT(out && gate && up && n >= 0);
    bf16 *o = (bf16 *)out;
    const bf16 *g = (const bf16 *)gate, *u = (const bf16 *)up;
    int al = is_aligned(o, 16) && is_aligned(g, 16) && is_aligned(u, 16);
    split_vec(n, al, [&](int W, int64_t off, int64_t m) {
        if (W == 8) KLAUNCH(swiglu_kernel<8>, grid_for(m / 8), 256, 0)(o + off, g + off, u + off, m);
        else KLAUNCH(swiglu_kernel<1>, grid_for(m), 256, 0)(o + off, g + off, u + off, m);
        LAUNCH_CHECK();
    });
}

void cuda_swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate, const void *up, int64_t n) {
    CU_ASSERT(dout && gate && up && n >= 0);
    if (!dgate && !dup) return;
    bf16 *dg = (bf16 *)dgate, *du = (bf16 *)dup;
    const bf16 *d = (const bf16 *)dout, *g = (const bf16 *)gate, *u = (const bf16 *)up;
    int al = is_aligned(dg, 16) && is_aligned(du, 16) && is_aligned(d, 16) && is_aligned(g, 16) && is_aligned(u, 16);
    split_vec(n, al, [&](int W, int64_t off, int64_t m) {
        bf16 *dgo = dg ? dg + off : NULL, *duo = du ? du + off : NULL;
        if (W == 8)
            KLAUNCH(swiglu_bwd_kernel<8>, grid_for(m / 8), 256, 0)(dgo, duo, d + off, g + off, u + off, m);
        else
            KLAUNCH(swiglu_bwd_kernel<1>, grid_for(m), 256, 0)(dgo, duo, d + off, g + off, u + off, m);
        LAUNCH_CHECK();
    });
}

void cuda_add(void *out, const void *a, const void *b, int64_t n) {
    CU_ASSERT(out && a && b && n >= 0);
    bf16 *o = (bf16 *)out;
    const bf16 *x = (const bf16 *)a, *y = (const bf16 *)b;
    int al = is_aligned(o, 16) && is_aligned(x, 16) && is_aligned(y, 16);
    split_vec(n, al, [&](int W, int64_t off, int64_t m) {
        if (W == 8) KLAUNCH(add_kernel<8>, grid_for(m / 8), 256, 0)(o + off, x + off, y + off, m);
        else KLAUNCH(add_kernel<1>, grid_for(m), 256, 0)(o + off, x + off, y + off, m);
        LAUNCH_CHECK();
    });
}
