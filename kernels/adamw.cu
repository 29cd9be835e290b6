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
struct adamw_args {
    float decay, w1, b2, w2, eps, gscale, neg_step, bc2_sqrt;
    int lerp_small;
};

__device__ __forceinline__ void adamw_one(float &p, float grad, float &m, float &v, const adamw_args &a) {
    float g = a.gscale * grad;
    float pi = p * a.decay;
    float mo = m;
    float mi = a.lerp_small ? mo + a.w1 * (g - mo) : g - (g - mo) * (1.0f - a.w1);
    float vi = v * a.b2 + a.w2 * g * g;
    float denom = sqrtf(vi) / a.bc2_sqrt + a.eps;
    p = pi + a.neg_step * mi / denom;
    m = mi;
    v = vi;
}

// Four elements a thread and iteration through 16-byte accesses (the
// arrays 16-byte aligned, wt 8-byte: the launcher checks), the n % 4 last
// ones scalar: the same arithmetic per element, so the same bits. wt (may
// be NULL): the new p rounded to bf16, as master_to_wt rounds it.
__global__ void adamw_kernel(float *p, bf16 *wt, const float *grad, float *m, float *v, int64_t n, adamw_args a,
                             int vec) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t done = 0;
    if (vec) {
        const int64_t n4 = n / 4;
        for (int64_t i = first; i < n4; i += stride) {
            float4 pp = ((float4 *)p)[i], gg = ((const float4 *)grad)[i], mm = ((float4 *)m)[i], vv = ((float4 *)v)[i];
            adamw_one(pp.x, gg.x, mm.x, vv.x, a);
            adamw_one(pp.y, gg.y, mm.y, vv.y, a);
            adamw_one(pp.z, gg.z, mm.z, vv.z, a);
            adamw_one(pp.w, gg.w, mm.w, vv.w, a);
            ((float4 *)p)[i] = pp, ((float4 *)m)[i] = mm, ((float4 *)v)[i] = vv;
            if (wt) {
                const float q4[4] = {pp.x, pp.y, pp.z, pp.w};
                store_bf16s<4>(wt + 4 * i, q4);
            }
        }
        done = n4 * 4;
    }
    for (int64_t i = done + first; i < n; i += stride) {
        adamw_one(p[i], grad[i], m[i], v[i], a);
        if (wt) wt[i] = f2bf(p[i]);
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

// x 16-byte aligned (vec): four elements a thread and iteration, the n % 4
// last ones after, each added in that fixed order.
__global__ void sumsq_kernel(double *part, const float *x, int64_t n, int vec) {
    double acc = 0.0;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t done = 0;
    if (vec) {
        for (int64_t i = first; i < n / 4; i += stride) {
            const float4 f = ((const float4 *)x)[i];
            acc += (double)f.x * f.x, acc += (double)f.y * f.y, acc += (double)f.z * f.z, acc += (double)f.w * f.w;
        }
        done = n / 4 * 4;
    }
    for (int64_t i = done + first; i < n; i += stride) {
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

void cuda_adamw(float *p, void *wt, const float *grad, float *m, float *v, int64_t n, float lr, float b1, float b2,
                float eps, float wd, float gscale, int64_t t) {
    CU_ASSERT(p && grad && m && v && n >= 0 && t >= 1);
    if (n == 0) return;
    // the Python-side scalars in double, each rounded to f32 where it meets a tensor
    float decay = wd != 0.0f ? (float)(1.0 - (double)lr * (double)wd) : 1.0f;
    float w1 = (float)(1.0 - (double)b1), w2 = (float)(1.0 - (double)b2);
    double bc1 = 1.0 - pow((double)b1, (double)t), bc2 = 1.0 - pow((double)b2, (double)t);
    float neg_step = (float)-((double)lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    const adamw_args a = {decay, w1, b2, w2, eps, gscale, neg_step, bc2_sqrt, w1 < 0.5f};
    const int vec = is_aligned(p, 16) && is_aligned(grad, 16) && is_aligned(m, 16) && is_aligned(v, 16) &&
                    (!wt || is_aligned(wt, 8));
    int64_t g = CEIL_DIV(vec ? n / 4 + 1 : n, (int64_t)256);
    int64_t cap = (int64_t)g_cuda.sm_count * 8;
    KLAUNCH(adamw_kernel, (unsigned)(g < cap ? g : cap), 256, 0)(p, (bf16 *)wt, grad, m, v, n, a, vec);
    LAUNCH_CHECK();
}

double cuda_sumsq(const float *x, int64_t n) {
    CU_ASSERT(x && n >= 0);
    if (n == 0) return 0.0;
    double *part = (double *)cuda_scratch(SCRATCH_OP, (SUMSQ_BLOCKS + 1) * sizeof(double));
    KLAUNCH(sumsq_kernel, SUMSQ_BLOCKS, SUMSQ_THREADS, 0)(part, x, n, is_aligned(x, 16));
    LAUNCH_CHECK();
    KLAUNCH(sumsq_final_kernel, 1, SUMSQ_THREADS, 0)(part + SUMSQ_BLOCKS, part, SUMSQ_BLOCKS);
    LAUNCH_CHECK();
    double r;
    cudaCheck(cudaMemcpyAsync(&r, part + SUMSQ_BLOCKS, sizeof r, cudaMemcpyDeviceToHost, g_cuda.stream));
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
    return r;
}
