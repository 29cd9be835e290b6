// rmsnorm.cu: RMSNorm forward and backward over rows of `dim`.
// defines: cuda_rmsnorm, cuda_rmsnorm_bwd, cuda_rmsnorm1p
//
// Forward: one warp per row, f32 sum of squares, rstd saved in f32, one
// rounding per output (out = in * rstd * (w + w_add), as the CPU reference;
// w_add is 1 for Qwen3.5's (1 + w) norms, summed in f32).
// Backward: one warp per row too; every lane owns a fixed set of columns, so
// the weight gradient is summed without atomics: per warp in shared memory
// (rows in a fixed order), per block over its warps, then a second kernel
// adds the per-block partials in block order. The result is deterministic.
#include "common.cuh"

// ---------------------------------------------------------------------------
// CUDA kernels

// Lane `lane` visits columns [c, c+VW) for c = lane*VW, lane*VW + 32*VW, ...
// NIT > 0 (at least that many runs a lane): the row is kept in registers
// between the sum of squares and the scaling, so it is read once. Read
// twice, a 4096-wide row came back from L2, or from memory: with 64 rows a
// multiprocessor in flight (~67 MB over the card) L2 does not hold them all
// (102 us a call at 16384 x 4096 against a ~67 us byte floor). The same
// arithmetic in the same order either way.
template <int VW, int NIT>
__global__ void rmsnorm_kernel(bf16 *out, float *rstd, const bf16 *in, const bf16 *w, float w_add, int64_t rows,
                               int dim, float eps) {
    int lane = threadIdx.x % 32;
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const bf16 *x = in + row * dim;
    bf16 *y = out + row * dim;
    float ss = 0.0f;
    if constexpr (NIT > 0) {
        typedef typename bf16_vec<VW>::type raw;
        raw held[NIT];
#pragma unroll
        for (int k = 0; k < NIT; k++) {
            const int c = lane * VW + k * 32 * VW;
            if (c < dim) held[k] = load_bf16_raw<VW>(x + c);
        }
#pragma unroll
        for (int k = 0; k < NIT; k++) {
            if (lane * VW + k * 32 * VW >= dim) break;
            float f[VW];
            unpack_bf16s<VW>(f, held[k]);
#pragma unroll
            for (int i = 0; i < VW; i++) ss += f[i] * f[i];
        }
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)dim + eps);
        if (rstd && lane == 0) rstd[row] = r;
#pragma unroll
        for (int k = 0; k < NIT; k++) {
            const int c = lane * VW + k * 32 * VW;
            if (c >= dim) break;
            float f[VW], g[VW];
            unpack_bf16s<VW>(f, held[k]);
            load_bf16s<VW>(g, w + c);
#pragma unroll
            for (int i = 0; i < VW; i++) f[i] = f[i] * r * (g[i] + w_add);
            store_bf16s<VW>(y + c, f);
        }
    } else {
        for (int c = lane * VW; c < dim; c += 32 * VW) {
            float f[VW];
            load_bf16s<VW>(f, x + c);
#pragma unroll
            for (int i = 0; i < VW; i++) ss += f[i] * f[i];
        }
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)dim + eps);
        if (rstd && lane == 0) rstd[row] = r;
        for (int c = lane * VW; c < dim; c += 32 * VW) {
            float f[VW], g[VW];
            load_bf16s<VW>(f, x + c);
            load_bf16s<VW>(g, w + c);
#pragma unroll
            for (int i = 0; i < VW; i++) f[i] = f[i] * r * (g[i] + w_add);
            store_bf16s<VW>(y + c, f);
        }
    }
}

// g = dout * w;  din += r g - x r^3 (g·x) / dim;  dw += dout * x * r
// Block b handles rows [b*rpb, (b+1)*rpb); its warp k handles every
// nwarps-th of them. Shared memory: one f32 dw row per warp.
template <int VW>
__global__ void rmsnorm_bwd_kernel(bf16 *din, float *dw_part, const bf16 *dout, const bf16 *in, const float *rstd,
                                   const bf16 *w, int64_t rows, int dim, int64_t rpb) {
    DYN_SMEM(float, sdw); // [nwarps][dim]
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    float *mydw = sdw + (int64_t)warp * dim;
    if (dw_part)
        for (int c = lane; c < dim; c += 32) mydw[c] = 0.0f;
    __syncwarp(); // lanes then accumulate columns another lane zeroed
    int64_t r0 = blockIdx.x * rpb, r1 = r0 + rpb < rows ? r0 + rpb : rows;
    for (int64_t row = r0 + warp; row < r1; row += nwarps) {
        const bf16 *x = in + row * dim, *dy = dout + row * dim;
        float r = rstd[row];
        float gx = 0.0f;
        for (int c = lane * VW; c < dim; c += 32 * VW) {
            float f[VW], g[VW], d[VW];
            load_bf16s<VW>(f, x + c);
            load_bf16s<VW>(g, w + c);
            load_bf16s<VW>(d, dy + c);
#pragma unroll
            for (int i = 0; i < VW; i++) gx += d[i] * g[i] * f[i];
        }
        gx = warp_sum(gx);
        float k = r * r * r * gx / (float)dim;
        for (int c = lane * VW; c < dim; c += 32 * VW) {
            float f[VW], g[VW], d[VW];
            load_bf16s<VW>(f, x + c);
            load_bf16s<VW>(d, dy + c);
            if (din) {
                float acc[VW];
                load_bf16s<VW>(g, w + c);
                load_bf16s<VW>(acc, din + row * dim + c);
#pragma unroll
                for (int i = 0; i < VW; i++) acc[i] += r * d[i] * g[i] - f[i] * k;
                store_bf16s<VW>(din + row * dim + c, acc);
            }
            if (dw_part) add_dw_terms<VW>(mydw + c, d, f, r);
        }
    }
    if (dw_part) warp_rows_to_partial(dw_part, sdw, dim);
}

// dw[c] += the sum over blocks b of part[b][c], in a fixed order: thread
// (x, y) of a 32 x 8 block sums column c = 32*blockIdx.x + x over b = y,
// y + 8, ..., four loads in flight; then row y = 0 adds the 8 sums in y
// order. (One thread a column walking all ~1000 partials waited a load
// latency per partial: ~0.3 ms for the 128 columns of a q/k norm.)
__global__ void sum_partials_kernel(float *dw, const float *part, int nparts, int dim) {
    __shared__ float sums[8][33];
    const int x = threadIdx.x % 32, y = threadIdx.x / 32, c = blockIdx.x * 32 + x;
    float s = 0.0f;
    if (c < dim) {
        int b = y;
        for (; b + 24 < nparts; b += 32) {
            float v0 = part[(int64_t)b * dim + c], v1 = part[(int64_t)(b + 8) * dim + c];
            float v2 = part[(int64_t)(b + 16) * dim + c], v3 = part[(int64_t)(b + 24) * dim + c];
            s += v0, s += v1, s += v2, s += v3;
        }
        for (; b < nparts; b += 8) s += part[(int64_t)b * dim + c];
    }
    sums[y][x] = s;
    __syncthreads();
    if (y == 0 && c < dim) {
        float t = 0.0f;
        for (int k = 0; k < 8; k++) t += sums[k][x];
        dw[c] += t;
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

// The row in registers unless DFLASH_CUDA_NORM_REGS=0 (read at every call,
// so that a test or the profile can run both forms in one process).
static bool norm_regs(void) {
    const char *s = getenv("DFLASH_CUDA_NORM_REGS");
    return !(s && strcmp(s, "0") == 0);
}

template <int VW, int NIT>
static void launch_fwd(unsigned grid, int threads, bf16 *out, float *rstd, const bf16 *in, const bf16 *w, float w_add,
                       int64_t rows, int dim, float eps) {
    auto kernel = rmsnorm_kernel<VW, NIT>;
    KLAUNCH(kernel, grid, threads, 0)(out, rstd, in, w, w_add, rows, dim, eps);
}

static void launch_rmsnorm(void *out, float *rstd, const void *in, const void *w, float w_add, int64_t rows,
                           int64_t dim, float eps) {
    CU_ASSERT(out && in && w && rows >= 0 && dim > 0 && dim <= INT32_MAX);
    if (rows == 0) return;
    int vec = dim % 8 == 0 && is_aligned(out, 16) && is_aligned(in, 16) && is_aligned(w, 16);
    const int64_t runs = CEIL_DIV(dim, (int64_t)256); // of 8 columns a lane
    // the row in registers up to 4096 columns (DFLASH_CUDA_NORM_REGS=0: read twice, to compare);
    // 4 warps a block there, as a thread then takes up to ~155 registers
    const int regs = vec && runs <= 16 && norm_regs();
    const int warps = regs ? 4 : 8;
    const unsigned grid = (unsigned)CEIL_DIV(rows, (int64_t)warps);
    bf16 *o = (bf16 *)out;
    const bf16 *x = (const bf16 *)in, *g = (const bf16 *)w;
    if (regs && runs <= 8) launch_fwd<8, 8>(grid, warps * 32, o, rstd, x, g, w_add, rows, (int)dim, eps);
    else if (regs) launch_fwd<8, 16>(grid, warps * 32, o, rstd, x, g, w_add, rows, (int)dim, eps);
    else if (vec) launch_fwd<8, 0>(grid, warps * 32, o, rstd, x, g, w_add, rows, (int)dim, eps);
    else launch_fwd<1, 0>(grid, warps * 32, o, rstd, x, g, w_add, rows, (int)dim, eps);
    LAUNCH_CHECK();
}

void cuda_rmsnorm(void *out, float *rstd, const void *in, const void *w, int64_t rows, int64_t dim, float eps) {
    launch_rmsnorm(out, rstd, in, w, 0.0f, rows, dim, eps);
}

void cuda_rmsnorm1p(void *out, const void *in, const void *w, int64_t rows, int64_t dim, float eps) {
    launch_rmsnorm(out, NULL, in, w, 1.0f, rows, dim, eps);
}

// One wave of blocks (one_wave_blocks), each with as many rows as that
// takes. (The first version launched 8 blocks a multiprocessor, 2.7 waves
// of 8 rows a block at H = 4096: 146 us a call against a ~61 us byte
// floor.)
template <int VW>
static void launch_bwd(int warps, size_t smem, bf16 *din, float *dw, const bf16 *dout, const bf16 *in,
                       const float *rstd, const bf16 *w, int64_t rows, int dim) {
    static size_t smem_set = 48 << 10;
    if (smem > smem_set) {
        cudaCheck(cudaFuncSetAttribute(rmsnorm_bwd_kernel<VW>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        smem_set = smem;
    }
    int64_t rpb;
    const int64_t nblk = one_wave_blocks(rmsnorm_bwd_kernel<VW>, warps * 32, smem, rows, warps, &rpb);
    float *part = dw ? (float *)cuda_scratch(SCRATCH_OP, (size_t)nblk * dim * 4) : NULL;
    KLAUNCH(rmsnorm_bwd_kernel<VW>, (unsigned)nblk, warps * 32, smem)(din, part, dout, in, rstd, w, rows, dim, rpb);
    LAUNCH_CHECK();
    if (dw) cuda_sum_partials(dw, part, (int)nblk, dim);
}

void cuda_sum_partials(float *dw, const float *part, int nparts, int dim) {
    KLAUNCH(sum_partials_kernel, (unsigned)CEIL_DIV(dim, 32), 256, 0)(dw, part, nparts, dim);
    LAUNCH_CHECK();
}

void cuda_rmsnorm_bwd(void *din, float *dw, const void *dout, const void *in, const float *rstd, const void *w,
                      int64_t rows, int64_t dim) {
    CU_ASSERT(dout && in && rstd && w && rows >= 0 && dim > 0 && dim <= INT32_MAX);
    if (rows == 0 || (!din && !dw)) return;
    int warps = 4;
    while (warps > 1 && (size_t)warps * dim * 4 > g_cuda.smem_optin) warps /= 2;
    size_t smem = dw ? (size_t)warps * dim * 4 : 0;
    CU_ASSERT(smem <= g_cuda.smem_optin); // dim up to ~57K columns
    int vec = dim % 8 == 0 && is_aligned(din, 16) && is_aligned(dout, 16) && is_aligned(in, 16) && is_aligned(w, 16);
    if (vec)
        launch_bwd<8>(warps, smem, (bf16 *)din, dw, (const bf16 *)dout, (const bf16 *)in, rstd, (const bf16 *)w, rows,
                      (int)dim);
    else
        launch_bwd<1>(warps, smem, (bf16 *)din, dw, (const bf16 *)dout, (const bf16 *)in, rstd, (const bf16 *)w, rows,
                      (int)dim);
}
