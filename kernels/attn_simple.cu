// attn_simple.cu: the simple attention kernels: any head dim up to 256, any
// alignment. They serve the shapes the tensor-core kernels do not take
// (tiny test models), and, with DFLASH_CUDA_SIMPLE=1, are the reference the
// fast kernels are checked against on the GPU (tests/gpu/run.sh).
// defines: attn::simple_attn_causal, attn::simple_attn_dflash,
//          attn::simple_attn_dflash_dq, attn::simple_attn_dflash_dkdv
//
// One warp per query row (or per key row for dk/dv); lane L holds head dims
// L, L+32, ... (at most 8); dot products are warp sums; f32 throughout, the
// same online softmax as the CPU reference, keys in increasing order.
// Deterministic: no atomics.
//
// They take a sliding window too (ops.h attn_dflash, window > 0): each
// query row visits exactly the keys its slot sees (row_ranges), and the
// dk/dv warp tests each row's slot against its key. The tensor-core kernels
// take one as well (the top of attn_dflash.cu); these serve the shapes they
// do not (D other than 64, 128, 256; unaligned) and DFLASH_CUDA_SIMPLE.
#include "attention.cuh"

using namespace attn;

namespace {

constexpr int PL = 8; // dims per lane: D <= 256

__device__ __forceinline__ void load_vec(float *x, const bf16 *p, int D, int lane) {
#pragma unroll
    for (int i = 0; i < PL; i++) {
        int d = lane + 32 * i;
        x[i] = d < D ? bf2f(p[d]) : 0.0f;
    }
}

__device__ __forceinline__ float dot_vec(const float *x, const bf16 *p, int D, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PL; i++) {
        int d = lane + 32 * i;
        if (d < D) s += x[i] * bf2f(p[d]);
    }
    return warp_sum(s);
}

__device__ __forceinline__ void axpy_vec(float *y, float a, const bf16 *p, int D, int lane) {
#pragma unroll
    for (int i = 0; i < PL; i++) {
        int d = lane + 32 * i;
        if (d < D) y[i] += a * bf2f(p[d]);
    }
}

// p[d] = scale * x[i] for this lane's dims (the backward writes its
// gradients, it does not add to them)
__device__ __forceinline__ void store_vec(bf16 *p, const float *x, float scale, int D, int lane) {
#pragma unroll
    for (int i = 0; i < PL; i++) {
        int d = lane + 32 * i;
        if (d < D) p[d] = f2bf(scale * x[i]);
    }
}

// Online softmax state of one query row: max, sum, output accumulator.
struct Online {
    float m, l, o[PL];
    __device__ void init() {
        m = -INFINITY, l = 0.0f;
#pragma unroll
        for (int i = 0; i < PL; i++) o[i] = 0.0f;
    }
    __device__ void add(float s, const bf16 *vrow, int D, int lane) {
        float mn = fmaxf(m, s), a = expf(m - mn), p = expf(s - mn);
        l = l * a + p;
#pragma unroll
        for (int i = 0; i < PL; i++) o[i] *= a;
        axpy_vec(o, p, vrow, D, lane);
        m = mn;
    }
};

} // namespace

// ---------------------------------------------------------------------------
// CUDA kernels

__global__ void simple_causal_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                                     const int32_t *cu, int nseq, int64_t T, int Hq, int Hkv, int D, int64_t W,
                                     float scale) {
    int64_t w = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (w >= T * Hq) return;
    int64_t t = w / Hq;
    int hq = (int)(w % Hq), hkv = hq / (Hq / Hkv);
    if (t < cu[0] || t >= cu[nseq]) return; // not in any sequence
    int lo = 0, hi = nseq - 1;              // the sequence holding t
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    float x[PL];
    load_vec(x, q + w * D, D, lane);
    Online st;
    st.init();
    const int64_t first = W > 0 && t - (W - 1) > cu[lo] ? t - (W - 1) : cu[lo]; // a sliding window's first key
    for (int64_t key = first; key <= t; key++) {
        const int64_t kr = (key * Hkv + hkv) * D;
        st.add(dot_vec(x, k + kr, D, lane) * scale, v + kr, D, lane);
    }
    if (lse && lane == 0) lse[w] = st.m + logf(st.l);
    float inv = 1.0f / st.l;
#pragma unroll
    for (int i = 0; i < PL; i++) {
        int d = lane + 32 * i;
        if (d < D) out[w * D + d] = f2bf(st.o[i] * inv);
    }
}

// Visit the keys of a block: [r0,r1) then [r2,r3) minus [r0,r1).
#define FOR_BLOCK_KEYS(r, key, BODY)                                             \
    for (int64_t key = r[0]; key < r[1]; key++) BODY                            \
    for (int64_t key = r[2]; key < r[3]; key++)                                  \
        if (key < r[0] || key >= r[1]) BODY

// This warp's DFlash query row w (one warp per (token, head) row, in the
// [T, Hq] order of q): false past the last row; else its KV head and the
// key ranges of its slot in its block (row_ranges: the block's two ranges,
// under a sliding window those of the slot).
struct DflashRow {
    int64_t w, r[4];
    int lane, hkv;
    __device__ bool init(const dfl_block *blocks, int B, int64_t NK, int64_t nrows, int Hq, int Hkv, int64_t W) {
        w = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
        lane = threadIdx.x % 32;
        if (w >= nrows) return false;
        hkv = (int)(w % Hq) / (Hq / Hkv);
        const int64_t tok = w / Hq;
        row_ranges(blocks[tok / B], B, NK, W, (int)(tok % B), r);
        return true;
    }
};

__global__ void simple_dflash_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                                     const dfl_block *blocks, int B, int64_t NK, int64_t nrows, int Hq, int Hkv, int D,
                                     int64_t W, float scale) {
    DflashRow row;
    if (!row.init(blocks, B, NK, nrows, Hq, Hkv, W)) return;
    const int64_t w = row.w, *r = row.r;
    const int lane = row.lane, hkv = row.hkv;
    float x[PL];
    load_vec(x, q + w * D, D, lane);
    Online st;
    st.init();
    FOR_BLOCK_KEYS(r, key, {
        const int64_t kr = (key * Hkv + hkv) * D;
        st.add(dot_vec(x, k + kr, D, lane) * scale, v + kr, D, lane);
    })
    float inv = st.l > 0.0f ? 1.0f / st.l : 0.0f;
#pragma unroll
    for (int i = 0; i < PL; i++) {
        int d = lane + 32 * i;
        if (d < D) out[w * D + d] = f2bf(st.o[i] * inv);
    }
    if (lse && lane == 0) lse[w] = st.l > 0.0f ? st.m + logf(st.l) : -INFINITY;
}

// dq[t,h] = scale * sum_key P (dP - delta) k
__global__ void simple_dq_kernel(bf16 *dq, const bf16 *dout, const float *lse, const float *delta, const bf16 *q,
                                 const bf16 *k, const bf16 *v, const dfl_block *blocks, int B, int64_t NK,
                                 int64_t nrows, int Hq, int Hkv, int D, int64_t W, float scale) {
    DflashRow row;
    if (!row.init(blocks, B, NK, nrows, Hq, Hkv, W)) return;
    const int64_t w = row.w, *r = row.r;
    const int lane = row.lane, hkv = row.hkv;
    float x[PL], go[PL], acc[PL];
    load_vec(x, q + w * D, D, lane);
    load_vec(go, dout + w * D, D, lane);
#pragma unroll
    for (int i = 0; i < PL; i++) acc[i] = 0.0f;
    const float L = lse[w], dl = delta[w];
    FOR_BLOCK_KEYS(r, key, {
        const int64_t kr = (key * Hkv + hkv) * D;
        float p = expf(dot_vec(x, k + kr, D, lane) * scale - L);
        float ds = p * (dot_vec(go, v + kr, D, lane) - dl);
        axpy_vec(acc, ds, k + kr, D, lane);
    })
    store_vec(dq + w * D, acc, scale, D, lane);
}

// one warp per (key, KV head): the blocks of its tile's list that see it,
// in block order, and their rows of this KV head's query heads (under a
// sliding window W > 0, the rows whose slot sees the key)
__global__ void simple_dkdv_kernel(bf16 *dk, bf16 *dv, const bf16 *dout, const float *lse, const float *delta,
                                   const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks,
                                   const int *list, const int *list_off, int B, int64_t NK, int Hq, int Hkv, int D,
                                   int64_t W, float scale) {
    int64_t w = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (w >= NK * Hkv) return;
    int64_t key = w / Hkv;
    int hkv = (int)(w % Hkv), G = Hq / Hkv;
    int tile = (int)(key / BN);
    float kx[PL], vx[PL], gk[PL], gv[PL];
    load_vec(kx, k + w * D, D, lane);
    load_vec(vx, v + w * D, D, lane);
#pragma unroll
    for (int i = 0; i < PL; i++) gk[i] = gv[i] = 0.0f;
    for (int e = list_off[tile]; e < list_off[tile + 1]; e++) {
        int j = list[e];
        int64_t r[4];
        block_ranges_w(blocks[j], B, NK, W, r);
        if (!((key >= r[0] && key < r[1]) || (key >= r[2] && key < r[3]))) continue;
        for (int row = 0; row < B * G; row++) {
            if (W > 0) { // the slot's own ranges: warp-uniform, as the key is
                row_ranges(blocks[j], B, NK, W, row / G, r);
                if (!((key >= r[0] && key < r[1]) || (key >= r[2] && key < r[3]))) continue;
            }
            int64_t qi = ((int64_t)j * B + row / G) * Hq + (int64_t)hkv * G + row % G; // (token, head) row
            float p = expf(dot_vec(kx, q + qi * D, D, lane) * scale - lse[qi]);
            axpy_vec(gv, p, dout + qi * D, D, lane);
            float ds = p * (dot_vec(vx, dout + qi * D, D, lane) - delta[qi]);
            axpy_vec(gk, ds, q + qi * D, D, lane);
        }
    }
    if (dk) store_vec(dk + w * D, gk, scale, D, lane);
    if (dv) store_vec(dv + w * D, gv, 1.0f, D, lane);
}

// ---------------------------------------------------------------------------
// kernel launchers

static unsigned warps_grid(int64_t nwarps) { return (unsigned)CEIL_DIV(nwarps * 32, (int64_t)256); }

void attn::simple_attn_causal(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu,
                              int64_t nseq, int64_t T, int Hq, int Hkv, int D, int64_t window) {
    CU_ASSERT(D <= 32 * PL && window >= 0);
    KLAUNCH(simple_causal_kernel, warps_grid(T * Hq), 256, 0)(out, lse, q, k, v, cu, (int)nseq, T, Hq, Hkv, D,
                                                                       window, 1.0f / sqrtf((float)D));
    LAUNCH_CHECK();
}

void attn::simple_attn_dflash(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                              const dfl_block *blocks, int64_t nblk, int B, int64_t NK, int Hq, int Hkv, int D,
                              int64_t window) {
    CU_ASSERT(D <= 32 * PL && window >= 0);
    int64_t nrows = nblk * B * Hq;
    KLAUNCH(simple_dflash_kernel, warps_grid(nrows), 256, 0)(out, lse, q, k, v, blocks, B, NK, nrows, Hq,
                                                                      Hkv, D, window, 1.0f / sqrtf((float)D));
    LAUNCH_CHECK();
}

void attn::simple_attn_dflash_dq(bf16 *dq, const bf16 *dout, const float *lse, const float *delta, const bf16 *q,
                                 const bf16 *k, const bf16 *v, const dfl_block *blocks, int64_t nblk, int B,
                                 int64_t NK, int Hq, int Hkv, int D, int64_t window) {
    CU_ASSERT(D <= 32 * PL && window >= 0);
    int64_t nrows = nblk * B * Hq;
    KLAUNCH(simple_dq_kernel, warps_grid(nrows), 256, 0)(dq, dout, lse, delta, q, k, v, blocks, B, NK, nrows,
                                                                  Hq, Hkv, D, window, 1.0f / sqrtf((float)D));
    LAUNCH_CHECK();
}

void attn::simple_attn_dflash_dkdv(bf16 *dk, bf16 *dv, const bf16 *dout, const float *lse, const float *delta,
                                   const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks,
                                   const TileLists *tl, int B, int64_t NK, int Hq, int Hkv, int D, int64_t window) {
    CU_ASSERT(D <= 32 * PL && window >= 0);
    if (NK == 0) return; // with an empty list every key's warp writes zeros
    KLAUNCH(simple_dkdv_kernel, warps_grid(NK * Hkv), 256, 0)(dk, dv, dout, lse, delta, q, k, v, blocks,
                                                                       tl->list, tl->list_off, B, NK, Hq, Hkv, D,
                                                                       window, 1.0f / sqrtf((float)D));
    LAUNCH_CHECK();
}
