// adamw.cu: the optimizer over flat f32 arrays (DESIGN §3: parameters,
// gradients and moments are each one allocation).
// defines: cuda_adamw, cuda_sumsq
#include "common.cuh"

#include <math.h>

// ---------------------------------------------------------------------------
// CUDA kernels

// torch.optim.AdamW (single-tensor path), in its order and f32 roundings,
// as the CPU reference: g = gscale grad; p *= 1 - lr wd (when wd != 0);
// m = lerp(m, g, 1 - b1); v = v b2 + (1 - b2) g^2;
// p += -step * m / (sqrt(v) / bc2_sqrt + eps). One fused pass.
__global__ void adamw_kernel(float *p, const float *grad, float *m, float *v, int64_t n, float decay, float w1,
                             float b2, float w2, float eps, float gscale, float neg_step, float bc2_sqrt,
                             int lerp_small) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = gscale * grad[i];
        float pi = p[i] * decay;
        float mo = m[i];
        float mi = lerp_small ? mo + w1 * (g - mo) : g - (g - mo) * (1.0f - w1);
        float vi = v[i] * b2 + w2 * g * g;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi + neg_step * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

// Sum of squares in f64, deterministic: a fixed grid, a fixed assignment of
// elements to threads, fixed-order tree reductions, then one block over the
// per-block partials.
enum { SUMSQ_BLOCKS = 512, SUMSQ_THREADS = 256 };

__device__ double block_sum_f64(double v) {
    __shared__ double s[SUMSQ_THREADS];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
        __syncthreads();
    }
    return s[0];
}

__global__ void sumsq_kernel(double *part, const float *x, int64_t n) {
    double acc = 0.0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        double f = x[i];
        acc += f * f;
    }
    double s = block_sum_f64(acc);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ void sumsq_final_kernel(double *out, const double *part, int nparts) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += part[i];
    double s = block_sum_f64(acc);
    if (threadIdx.x == 0) *out = s;
}

// ---------------------------------------------------------------------------
// kernel launchers

void cuda_adamw(float *p, const float *grad, float *m, float *v, int64_t n, float lr, float b1, float b2, float eps,
                float wd, float gscale, int64_t t) {
    CU_ASSERT(p && grad && m && v && n >= 0 && t >= 1);
    if (n == 0) return;
    // the Python-side scalars in double, each rounded to f32 where it meets a tensor
    float decay = wd != 0.0f ? (float)(1.0 - (double)lr * (double)wd) : 1.0f;
    float w1 = (float)(1.0 - (double)b1), w2 = (float)(1.0 - (double)b2);
    double bc1 = 1.0 - pow((double)b1, (double)t), bc2 = 1.0 - pow((double)b2, (double)t);
    float neg_step = (float)-((double)lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    int64_t g = CEIL_DIV(n, (int64_t)256);
    int64_t cap = (int64_t)g_cuda.sm_count * 8;
    KLAUNCH(adamw_kernel, (unsigned)(g < cap ? g : cap), 256, 0)(p, grad, m, v, n, decay, w1, b2, w2, eps, gscale,
                                                                neg_step, bc2_sqrt, w1 < 0.5f);
    LAUNCH_CHECK();
}

double cuda_sumsq(const float *x, int64_t n) {
    CU_ASSERT(x && n >= 0);
    if (n == 0) return 0.0;
    double *part = (double *)cuda_scratch(SCRATCH_OP, (SUMSQ_BLOCKS + 1) * sizeof(double));
    KLAUNCH(sumsq_kernel, SUMSQ_BLOCKS, SUMSQ_THREADS, 0)(part, x, n);
    LAUNCH_CHECK();
    KLAUNCH(sumsq_final_kernel, 1, SUMSQ_THREADS, 0)(part + SUMSQ_BLOCKS, part, SUMSQ_BLOCKS);
    LAUNCH_CHECK();
    double r;
    cudaCheck(cudaMemcpyAsync(&r, part + SUMSQ_BLOCKS, sizeof r, cudaMemcpyDeviceToHost, g_cuda.stream));
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
    return r;
}
