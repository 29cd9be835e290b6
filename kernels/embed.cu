// embed.cu: embedding gather out[T,H] = table[ids[t]].
// defines: cuda_embed
//
// The ids were validated against the vocabulary by the model code (this op
// does not know V); one block copies one row, 16 bytes per access when the
// rows are aligned.
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

template <int VEC>
__global__ void embed_kernel(bf16 *out, const int32_t *ids, const bf16 *table, int64_t H) {
    int64_t t = blockIdx.x;
    const bf16 *src = table + (int64_t)ids[t] * H;
    bf16 *dst = out + t * H;
    if (VEC) {
        const uint4 *s4 = (const uint4 *)src;
        uint4 *d4 = (uint4 *)dst;
        DEV_CHECK_ALIGN(s4, 16);
        DEV_CHECK_ALIGN(d4, 16);
        for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (int64_t i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

void cuda_embed(void *out, const int32_t *ids, const void *table, int64_t T, int64_t H) {
    CU_ASSERT(out && ids && table && T >= 0 && H >= 0 && T <= INT32_MAX);
    if (T == 0 || H == 0) return;
    int vec = H % 8 == 0 && is_aligned(out, 16) && is_aligned(table, 16);
    if (vec) KLAUNCH(embed_kernel<1>, (unsigned)T, 128, 0)((bf16 *)out, ids, (const bf16 *)table, H);
    else KLAUNCH(embed_kernel<0>, (unsigned)T, 128, 0)((bf16 *)out, ids, (const bf16 *)table, H);
    LAUNCH_CHECK();
}
