// convert.cu: moving tensors in and out of the bf16 storage.
// defines: cuda_load_act, cuda_load_wt, cuda_act_to_f32, cuda_act_to_bf16, cuda_master_to_wt
//
// All roundings to bf16 are round-to-nearest-even (__float2bfloat16_rn), as
// dfl_f32_to_bf16 and PyTorch do.
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

// vec (in 16-byte, out 8-byte aligned): four elements a thread and
// iteration, the n % 4 last ones after.
__global__ void f32_to_bf16_kernel(bf16 *out, const float *in, int64_t n, int vec) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t done = 0;
    if (vec) {
        for (int64_t i = first; i < n / 4; i += stride) {
            const float4 f = ((const float4 *)in)[i];
            const float q4[4] = {f.x, f.y, f.z, f.w};
            store_bf16s<4>(out + 4 * i, q4);
        }
        done = n / 4 * 4;
    }
    for (int64_t i = done + first; i < n; i += stride) out[i] = f2bf(in[i]);
}

__global__ void f16_to_bf16_kernel(bf16 *out, const __half *in, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = f2bf(__half2float(in[i])); // f16 -> f32 is exact
}

// ---------------------------------------------------------------------------
// kernel launchers

static int grid_for(int64_t n, int block) {
    int64_t g = CEIL_DIV(n, (int64_t)block);
    int64_t cap = (int64_t)g_cuda.sm_count * 16;
    return (int)(g < cap ? g : cap);
}

void cuda_master_to_wt(void *dst, const float *master, int64_t n) {
    CU_ASSERT(dst && master && n >= 0);
    if (n == 0) return;
    const int vec = is_aligned(master, 16) && is_aligned(dst, 8);
    KLAUNCH(f32_to_bf16_kernel, grid_for(vec ? n / 4 + 1 : n, 256), 256, 0)((bf16 *)dst, master, n, vec);
    LAUNCH_CHECK();
}

// Host bf16/f16/f32 -> device bf16. bf16 is copied as is; the others go
// through a staging buffer in chunks of at most 64 MiB and a cast kernel.
static void load_bf16(void *dst, const void *host_src, dfl_dtype dtype, int64_t n) {
    CU_ASSERT(dst && (host_src || n == 0) && n >= 0);
    CU_ASSERT(dtype == DFL_BF16 || dtype == DFL_F16 || dtype == DFL_F32);
    if (n == 0) return;
    if (dtype == DFL_BF16) {
        cudaCheck(cudaMemcpyAsync(dst, host_src, (size_t)n * 2, cudaMemcpyHostToDevice, g_cuda.stream));
        LAUNCH_CHECK();
        return;
    }
    size_t es = dtype == DFL_F32 ? 4 : 2;
    int64_t chunk = (int64_t)((64u << 20) / es);
    void *stage = cuda_scratch(SCRATCH_STAGING, (size_t)(n < chunk ? n : chunk) * es);
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t m = n - off < chunk ? n - off : chunk;
        // stream order makes the next chunk's copy wait for this cast
        cudaCheck(cudaMemcpyAsync(stage, (const char *)host_src + off * es, (size_t)m * es, cudaMemcpyHostToDevice,
                                  g_cuda.stream));
        bf16 *out = (bf16 *)dst + off;
        if (dtype == DFL_F32)
            KLAUNCH(f32_to_bf16_kernel, grid_for(m, 256), 256, 0)(out, (const float *)stage, m, is_aligned(out, 8));
        else
            KLAUNCH(f16_to_bf16_kernel, grid_for(m, 256), 256, 0)(out, (const __half *)stage, m);
        LAUNCH_CHECK();
    }
}

void cuda_load_act(void *dst, const void *host_src, dfl_dtype dtype, int64_t n) { load_bf16(dst, host_src, dtype, n); }
void cuda_load_wt(void *dst, const void *host_src, dfl_dtype dtype, int64_t n) { load_bf16(dst, host_src, dtype, n); }

void cuda_act_to_bf16(uint16_t *host_dst, const void *src, int64_t n) {
    CU_ASSERT(src && (host_dst || n == 0) && n >= 0);
    if (n) cudaCheck(cudaMemcpyAsync(host_dst, src, (size_t)n * 2, cudaMemcpyDeviceToHost, g_cuda.stream));
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
}

// bf16 -> f32 is exact, so it is done on the host after a half-size copy.
void cuda_act_to_f32(float *host_dst, const void *src, int64_t n) {
    CU_ASSERT(src && (host_dst || n == 0) && n >= 0);
    const int64_t CHUNK = 1 << 20;
    uint16_t *tmp = (uint16_t *)dfl_malloc((size_t)(n < CHUNK ? (n ? n : 1) : CHUNK) * 2);
    for (int64_t off = 0; off < n; off += CHUNK) {
        int64_t m = n - off < CHUNK ? n - off : CHUNK;
        cudaCheck(cudaMemcpyAsync(tmp, (const uint16_t *)src + off, (size_t)m * 2, cudaMemcpyDeviceToHost,
                                  g_cuda.stream));
        cudaCheck(cudaStreamSynchronize(g_cuda.stream));
        for (int64_t i = 0; i < m; i++) host_dst[off + i] = dfl_bf16_to_f32(tmp[i]);
    }
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
    free(tmp);
}
