// moe.cu: the mixture-of-experts ops of the Qwen3-MoE / Qwen3.5-MoE targets
// (contracts in lib/ops.h, reference in lib/ops_cpu_moe.c).
// defines: cuda_moe_route, cuda_gather_rows, cuda_moe_combine
//
// moe_route, in four launches and one download:
//   1. route: one warp per token. Softmax in f32 exactly as the CPU writes
//      it (max, expf, the sum taken by one lane in expert order, one
//      division each), then k rounds of a warp argmax under the CPU's
//      selection order: numbers by value, the lower id on equal values;
//      NaN only when no number is left. The order is total, so the shuffle
//      tree finds the same expert as the CPU's scan. -> ids, wts
//   2. count: one warp per chunk of the T*k (token, slot) ids. Lanes of
//      the same expert find each other with ballots over the id's bits;
//      each pair's rank among its chunk's earlier pairs of its expert
//      (kept in pos for now) and the chunk's count per expert. Plain
//      counters in shared memory, one writer per expert and step: no
//      atomics, nothing that depends on the order threads run in.
//   3. scan: per expert, the counts of the chunks before (in chunk order)
//      and in all; then offsets, the exclusive scan over experts.
//   4. scatter: pos[i] = offsets[e] + chunks before + rank, rows[pos[i]] = i/k.
//   Then offsets go to the host (the op's one synchronisation). The
//   listing is then the CPU's counting sort, stable in (token, slot) order.
// gather_rows: a grid-stride loop over rows, 16 bytes per access when the
//   rows are aligned (like embed.cu).
// moe_combine: a block per token; each thread owns 8 columns (or 1) and
//   sums k weighted expert rows and the gated shared expert in f32 in the
//   CPU's order (products rounded on their own, never fused into the add),
//   then adds into x with one rounding.
#include "common.cuh"

#include <math.h>

namespace {

// Bounds on E from the shared memory a warp takes (E floats or ints, under
// the 48 KiB a block gets without opting in). Real models: E <= 512.
constexpr int MOE_SMEM = 48 * 1024;
constexpr int64_t MOE_MAX_E = MOE_SMEM / 4;
constexpr int MAX_WARPS = 8;          // per block, route and count
constexpr int64_t CHUNK_MIN = 1024;   // pairs per warp in the count kernel, at least
constexpr int64_t MAX_CHUNKS = 1024;  // so the scan stays short for any T

// ---------------------------------------------------------------------------
// CUDA kernels

// The CPU's selection order (route_token in lib/ops_cpu_moe.c): its scan
// takes an element over the best so far only when strictly greater, so
// among numbers the larger wins and equal values keep the lower id; a NaN
// is never greater, and every p is NaN or none (a NaN or infinite logit
// makes the sum NaN). -INFINITY marks an expert already taken (p is never
// -inf otherwise). As a total order: class (number > NaN > taken), then the
// value for numbers, then the lower id.
__device__ __forceinline__ int sel_class(float p) { return p == -INFINITY ? 0 : p != p ? 1 : 2; }
__device__ __forceinline__ bool ahead(float p, int e, float q, int f) {
    const int a = sel_class(p), b = sel_class(q);
    if (a != b) return a > b;
    if (a == 2 && p != q) return p > q;
    return e < f;
}

// One warp per token. ids, wts: [T, k]; logits: [T, E]; p: E floats of
// shared memory per warp.
__global__ void route_kernel(int32_t *ids, float *wts, const bf16 *logits, int64_t T, int E, int k, int norm) {
    DYN_SMEM(float, sh);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x / 32) + warp;
    if (t >= T) return; // the whole warp
    float *p = sh + (int64_t)warp * E;
    const bf16 *row = logits + t * E;
    // max, NaN ignored (as the CPU, unless logits[0] is NaN: then every p is NaN on both)
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        float l = bf2f(row[e]);
        p[e] = l;
        mx = l > mx ? l : mx;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m = __shfl_xor_sync(0xffffffffu, mx, o);
        mx = m > mx ? m : mx;
    }
    for (int e = lane; e < E; e += 32) p[e] = expf(p[e] - mx);
    __syncwarp();
    // the sum in the CPU's order, by lane 0; the others add zeros to it (exact)
    float sum = 0.0f;
    if (lane == 0)
        for (int e = 0; e < E; e++) sum += p[e];
    sum = warp_sum(sum);
    __syncwarp(); // lane 0 has read every p before they are divided
    for (int e = lane; e < E; e += 32) p[e] /= sum;
    // k rounds of argmax; a lane reads and marks only its own experts (e % 32 == lane)
    float kept = 0.0f;
    float *w = wts + t * k;
    for (int j = 0; j < k; j++) {
        float bp = -INFINITY;
        int be = INT32_MAX;
        for (int e = lane; e < E; e += 32)
            if (ahead(p[e], e, bp, be)) bp = p[e], be = e;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float q = __shfl_xor_sync(0xffffffffu, bp, o);
            int f = __shfl_xor_sync(0xffffffffu, be, o);
            if (ahead(q, f, bp, be)) bp = q, be = f;
        }
        if (be % 32 == lane) p[be] = -INFINITY; // taken
        if (j % 32 == lane) {
            ids[t * k + j] = be;
            w[j] = bp;
        }
        kept += bp; // in slot order, as the CPU
    }
    if (norm)
        for (int j = lane; j < k; j += 32) w[j] /= kept; // the lane that wrote w[j]
}

// One warp per chunk of `chunk` pairs (the last one shorter). rank[i]: pair
// i's rank among the earlier pairs of its expert in its chunk; hist[c, e]:
// chunk c's count of expert e. ids: [n]; nbits: bits that tell ids < E apart.
__global__ void count_kernel(int32_t *rank, int32_t *hist, const int32_t *ids, int64_t n, int64_t chunk,
                             int64_t nchunks, int E, int nbits) {
    DYN_SMEM(int32_t, sh);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t c = (int64_t)blockIdx.x * (blockDim.x / 32) + warp;
    if (c >= nchunks) return; // the whole warp
    int32_t *cnt = sh + (int64_t)warp * E;
    for (int e = lane; e < E; e += 32) cnt[e] = 0;
    __syncwarp();
    const int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
    const unsigned below = (1u << lane) - 1u;
    for (int64_t base = lo; base < hi; base += 32) { // uniform over the warp
        const int64_t i = base + lane;
        const bool valid = i < hi;
        const int e = valid ? ids[i] : 0;
        // the valid lanes holding e: agree with it on validity and every bit
        unsigned peers = __ballot_sync(0xffffffffu, valid);
        for (int b = 0; b < nbits; b++) {
            unsigned m = __ballot_sync(0xffffffffu, (e >> b) & 1);
            peers &= (e >> b) & 1 ? m : ~m;
        }
        const int32_t before = valid ? cnt[e] : 0;
        __syncwarp(); // every peer has read cnt[e] before the first one writes it
        if (valid) {
            rank[i] = before + __popc(peers & below);
            if ((peers & below) == 0) cnt[e] = before + __popc(peers); // the group's first lane
        }
        __syncwarp();
    }
    for (int e = lane; e < E; e += 32) hist[c * E + e] = cnt[e];
}

// One block. hist[c, e] becomes the count of expert e in chunks before c;
// offs[e] = the pairs of experts before e (offs[E] = n).
__global__ void scan_kernel(int64_t *offs, int32_t *hist, int64_t nchunks, int E) {
    constexpr int U = 8; // loads in flight per thread
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int32_t run = 0;
        for (int64_t c0 = 0; c0 < nchunks; c0 += U) {
            int32_t h[U];
#pragma unroll
            for (int u = 0; u < U; u++) h[u] = c0 + u < nchunks ? hist[(c0 + u) * E + e] : 0;
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (c0 + u < nchunks) hist[(c0 + u) * E + e] = run;
                run += h[u];
            }
        }
        offs[e + 1] = run; // the count of e, for now
    }
    __syncthreads();
    if (threadIdx.x == 0) { // E is small: one thread, in order
        offs[0] = 0;
        for (int e = 0; e < E; e++) offs[e + 1] += offs[e];
    }
}

// pos[i] (holding pair i's rank within its chunk) becomes its place in the
// listing; rows[place] = its token.
__global__ void scatter_kernel(int32_t *rows, int32_t *pos, const int32_t *ids, const int32_t *hist,
                               const int64_t *offs, int64_t n, int64_t chunk, int E, int k) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int e = ids[i];
        const int64_t at = offs[e] + hist[(i / chunk) * E + e] + pos[i];
        pos[i] = (int32_t)at;
        rows[at] = (int32_t)(i / k);
    }
}

// out[i] = in[rows[i]], rows of H; VEC: 16-byte accesses (H % 8 == 0, aligned)
template <int VEC>
__global__ void gather_rows_kernel(bf16 *out, const bf16 *in, const int32_t *rows, int64_t n, int64_t H) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const bf16 *src = in + (int64_t)rows[i] * H;
        bf16 *dst = out + i * H;
        if (VEC) {
            const uint4 *s4 = (const uint4 *)src;
            uint4 *d4 = (uint4 *)dst;
            DEV_CHECK_ALIGN(s4, 16);
            DEV_CHECK_ALIGN(d4, 16);
            for (int64_t c = threadIdx.x; c < H / 8; c += blockDim.x) d4[c] = s4[c];
        } else {
            for (int64_t c = threadIdx.x; c < H; c += blockDim.x) dst[c] = src[c];
        }
    }
}

// a product rounded on its own: the CPU reference's separate multiply and add
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef DFLASH_EMU
    return a * b;
#else
    return __fmul_rn(a, b);
#endif
}

// x[t] += sum_j wts[t,j] y[pos[t,j]] (+ sigmoid(sgate[t]) shared[t]); W
// columns per thread step (8: every row 16-byte aligned)
template <int W>
__global__ void combine_kernel(bf16 *x, const bf16 *y, const int32_t *pos, const float *wts, const bf16 *shared,
                               const bf16 *sgate, int64_t T, int k, int64_t H) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const float g = shared ? sigmoid_f(bf2f(sgate[t])) : 0.0f;
        for (int64_t c = threadIdx.x * (int64_t)W; c < H; c += (int64_t)blockDim.x * W) {
            float acc[W], v[W];
#pragma unroll
            for (int u = 0; u < W; u++) acc[u] = 0.0f;
            for (int j = 0; j < k; j++) {
                const float wj = wts[t * k + j];
                load_bf16s<W>(v, y + (int64_t)pos[t * k + j] * H + c);
#pragma unroll
                for (int u = 0; u < W; u++) acc[u] += mul_rn(wj, v[u]);
            }
            if (shared) {
                load_bf16s<W>(v, shared + t * H + c);
#pragma unroll
                for (int u = 0; u < W; u++) acc[u] += mul_rn(g, v[u]);
            }
            load_bf16s<W>(v, x + t * H + c);
#pragma unroll
            for (int u = 0; u < W; u++) v[u] += acc[u];
            store_bf16s<W>(x + t * H + c, v);
        }
    }
}

// warps per block for `per_warp` bytes of shared memory each
int warps_for(int64_t per_warp) {
    int64_t w = MOE_SMEM / per_warp;
    return (int)(w < 1 ? 1 : w > MAX_WARPS ? MAX_WARPS : w);
}

// pairs per chunk of the count kernel: a multiple of 32, at least
// CHUNK_MIN, and few enough chunks (<= MAX_CHUNKS) for a short scan
int64_t listing_chunk(int64_t n) {
    int64_t c = CEIL_DIV(n, MAX_CHUNKS);
    return CEIL_DIV(c > CHUNK_MIN ? c : CHUNK_MIN, (int64_t)32) * 32;
}

// a grid-stride kernel's blocks: one per item, at most 16 per SM
int capped_grid(int64_t items) {
    int64_t cap = (int64_t)g_cuda.sm_count * 16;
    return (int)(items < 1 ? 1 : items < cap ? items : cap);
}

} // namespace

// ---------------------------------------------------------------------------
// kernel launchers

void cuda_moe_route(int64_t *offsets, int32_t *rows, int32_t *pos, float *wts, const void *logits, int64_t T,
                    int64_t E, int64_t k, int norm) {
    CU_ASSERT(offsets && T >= 0 && E >= 1 && E <= MOE_MAX_E && k >= 1 && k <= E && T <= INT32_MAX / k);
    const int64_t n = T * k;
    if (n == 0) {
        for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
        return;
    }
    CU_ASSERT(rows && pos && wts && logits);
    const int64_t chunk = listing_chunk(n);
    const int64_t nchunks = CEIL_DIV(n, chunk);
    // scratch: ids [n] i32, hist [nchunks, E] i32, offs [E+1] i64 (8-byte aligned)
    const size_t ids_bytes = (size_t)n * 4, hist_bytes = (size_t)(nchunks * E) * 4;
    const size_t offs_at = CEIL_DIV(ids_bytes + hist_bytes, (size_t)8) * 8;
    char *mem = (char *)cuda_scratch(SCRATCH_OP, offs_at + (size_t)(E + 1) * 8);
    int32_t *ids = (int32_t *)mem, *hist = (int32_t *)(mem + ids_bytes);
    int64_t *offs = (int64_t *)(mem + offs_at);
    int nbits = 0;
    while (((int64_t)1 << nbits) < E) nbits++;

    const int rw = warps_for(E * 4);
    KLAUNCH(route_kernel, (unsigned)CEIL_DIV(T, (int64_t)rw), 32 * rw, (size_t)rw * E * 4)(
        ids, wts, (const bf16 *)logits, T, (int)E, (int)k, norm);
    LAUNCH_CHECK();
    const int cw = warps_for(E * 4);
    KLAUNCH(count_kernel, (unsigned)CEIL_DIV(nchunks, (int64_t)cw), 32 * cw, (size_t)cw * E * 4)(
        pos, hist, ids, n, chunk, nchunks, (int)E, nbits);
    LAUNCH_CHECK();
    KLAUNCH(scan_kernel, 1, 512, 0)(offs, hist, nchunks, (int)E);
    LAUNCH_CHECK();
    KLAUNCH(scatter_kernel, capped_grid(CEIL_DIV(n, (int64_t)256)), 256, 0)(rows, pos, ids, hist, offs, n, chunk,
                                                                           (int)E, (int)k);
    LAUNCH_CHECK();
    cudaCheck(cudaMemcpyAsync(offsets, offs, (size_t)(E + 1) * 8, cudaMemcpyDeviceToHost, g_cuda.stream));
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
}

void cuda_gather_rows(void *out, const void *in, const int32_t *rows, int64_t n, int64_t H) {
    CU_ASSERT(n >= 0 && H >= 0);
    if (n == 0 || H == 0) return;
    CU_ASSERT(out && in && rows);
    const int vec = H % 8 == 0 && is_aligned(out, 16) && is_aligned(in, 16);
    if (vec) KLAUNCH(gather_rows_kernel<1>, capped_grid(n), 128, 0)((bf16 *)out, (const bf16 *)in, rows, n, H);
    else KLAUNCH(gather_rows_kernel<0>, capped_grid(n), 128, 0)((bf16 *)out, (const bf16 *)in, rows, n, H);
    LAUNCH_CHECK();
}

void cuda_moe_combine(void *x, const void *y, const int32_t *pos, const float *wts, const void *shared,
                      const void *sgate, int64_t T, int64_t k, int64_t H) {
    CU_ASSERT(T >= 0 && k >= 1 && k <= INT32_MAX && H >= 0);
    if (T == 0 || H == 0) return;
    CU_ASSERT(x && y && pos && wts && (!shared || sgate));
    const int vec = H % 8 == 0 && is_aligned(x, 16) && is_aligned(y, 16) && is_aligned(shared, 16);
    if (vec)
        KLAUNCH(combine_kernel<8>, capped_grid(T), 128, 0)((bf16 *)x, (const bf16 *)y, pos, wts,
                                                               (const bf16 *)shared, (const bf16 *)sgate, T, (int)k, H);
    else
        KLAUNCH(combine_kernel<1>, capped_grid(T), 128, 0)((bf16 *)x, (const bf16 *)y, pos, wts,
                                                               (const bf16 *)shared, (const bf16 *)sgate, T, (int)k, H);
    LAUNCH_CHECK();
}
