// rope.cu: rotary position embedding, NeoX pairing (i, i + d/2), in place.
// defines: cuda_rope
//
// One thread per (token, pair index): it computes the angle once, in f32
// exactly as the CPU reference does (pos as float times inv_freq, then a
// correctly range-reduced sincosf), and rotates that pair in every head.
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

__global__ void rope_kernel(bf16 *x, const int32_t *pos, const float *inv_freq, int64_t T, int nh, int d,
                            float sign) {
    int half = d / 2;
    int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= T * half) return;
    int64_t t = idx / half;
    int i = (int)(idx % half);
    float th = (float)pos[t] * inv_freq[i];
    float s, c;
    sincosf(th, &s, &c);
    s *= sign;
    bf16 *row = x + t * (int64_t)nh * d;
    for (int h = 0; h < nh; h++) {
        bf16 *p = row + (int64_t)h * d;
        float a = bf2f(p[i]), b = bf2f(p[i + half]);
        p[i] = f2bf(a * c - b * s);
        p[i + half] = f2bf(b * c + a * s);
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

void cuda_rope(void *x, const int32_t *pos, const float *inv_freq, int64_t T, int64_t nh, int64_t d, int inverse) {
    CU_ASSERT(x && pos && inv_freq && T >= 0 && nh > 0 && d > 0 && d % 2 == 0 && nh <= INT32_MAX && d <= INT32_MAX);
    int64_t n = T * (d / 2);
    if (n == 0) return;
    KLAUNCH(rope_kernel, (unsigned)CEIL_DIV(n, (int64_t)256), 256, 0)(
        (bf16 *)x, pos, inv_freq, T, (int)nh, (int)d, inverse ? -1.0f : 1.0f);
    LAUNCH_CHECK();
}
