// lmhead.cu: the frozen LM head fused with its losses, in row chunks so
// that the logits never exist for all rows at once.
// defines: cuda_lmhead_ce, cuda_lmhead_kl, cuda_lmhead_argmax, cuda_lmhead_sample
//
// Per chunk of R rows:
//   1. cuBLAS: z[R,V] (f32) = h[R,H] · w[V,H]^T   (for KL also zt from th)
//   2. one block per row: a single pass of online max / sum-exp / argmax
//      (lowest index on ties) / top-2, a fixed-order block reduction
//      (deterministic), loss and pred (sampling at temperature T: the
//      argmax of z * (1/T) + Gumbel noise over the tokens top-k and top-p
//      keep, their cut found first by exact integer binary searches,
//      lib/sample.h); then, with a
//      gradient, a second pass writes dz[R,V] (bf16) = gscale (softmax -
//      onehot), or gscale (p_d - p_t), zero on rows without a gradient
//      (gscale 0; CE: no label); a NULL gscale means 1 for every row, as
//      on the CPU
//   3. cuBLAS: dh[R,H] += dz · w
// Memory bound: the chunk buffers take R·V·(4 | 6 | 10) bytes (argmax | CE
// | KL with gradient), R chosen so that this stays under LOGITS_BUDGET
// (1 GiB): R = 1152 rows for CE and 704 for KL at V = 151936.
#include "common.cuh"
#include "sample.h"

#include <math.h>

namespace {

const size_t LOGITS_BUDGET = (size_t)1 << 30;
constexpr int ROW_THREADS = 512;

enum { MODE_ARGMAX, MODE_SAMPLE, MODE_CE, MODE_KL };

// Online softmax statistics and top-2 of one row (or part of it).
struct RowStat {
    float m, s;     // max and sum of exp(z - m)
    float best;     // top-1 value, its index, and the top-2 value
    int idx;
    float second;
    __device__ void init() { m = -INFINITY, s = 0.0f, best = -INFINITY, idx = INT32_MAX, second = -INFINITY; }
    __device__ void add(float z, int v) {
        if (z > m) {
            s = s * expf(m - z) + 1.0f; // expf(-inf) = 0 on the first element
            m = z;
        } else {
            s += expf(z - m);
        }
        if (z > best) { // v increases along a thread's elements: ties keep the lower index
            second = best;
            best = z, idx = v;
        } else if (z > second) {
            second = z;
        }
    }
};

__device__ __forceinline__ float scale_sum(float s, float m, float M) { return m == -INFINITY ? 0.0f : s * expf(m - M); }

__device__ void combine(RowStat &a, const RowStat &b) {
    float M = fmaxf(a.m, b.m);
    a.s = scale_sum(a.s, a.m, M) + scale_sum(b.s, b.m, M);
    a.m = M;
    bool b_better = b.best > a.best || (b.best == a.best && b.idx < a.idx);
    if (b_better) {
        a.second = fmaxf(a.best, b.second);
        a.best = b.best, a.idx = b.idx;
    } else {
        a.second = fmaxf(a.second, b.best);
    }
}

__device__ RowStat shfl_stat(const RowStat &a, int o) {
    RowStat b;
    b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
    b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
    b.best = __shfl_xor_sync(0xffffffffu, a.best, o);
    b.idx = __shfl_xor_sync(0xffffffffu, a.idx, o);
    b.second = __shfl_xor_sync(0xffffffffu, a.second, o);
    return b;
}

// The KL extra: a = sum over elements of exp(zt - mt) (zt - zd), kept on the
// scale of the target's running max mt.
__device__ float scale_kl(float a, float m, float M) { return m == -INFINITY ? 0.0f : a * expf(m - M); }

// After a reduction within each warp (every lane holding its warp's
// result): the warps' results combined in warp order, the same total for
// every thread. sh: one slot a warp; the leading barrier lets it be reused.
template <typename T, typename F>
__device__ T across_warps(T v, T *sh, F combine2) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    T t = sh[0];
    for (int w = 1; w < nw; w++) t = combine2(t, sh[w]);
    return t;
}

// Block reduction in a fixed order: lanes by xor-shuffle, then the warps'
// results in warp order. Every thread gets the total.
__device__ void block_reduce(RowStat &st, RowStat *sh) {
    for (int o = 16; o > 0; o >>= 1) {
        RowStat b = shfl_stat(st, o);
        combine(st, b);
    }
    st = across_warps(st, sh, [](RowStat a, const RowStat &b) {
        combine(a, b);
        return a;
    });
}

// Block sum of exact integers (any order gives the same total); every
// thread gets it. sh: ROW_THREADS / 32 slots.
__device__ uint64_t block_sum_u64(uint64_t x, uint64_t *sh) {
    for (int o = 16; o > 0; o >>= 1) { // as two 32-bit shuffles
        uint32_t lo = __shfl_xor_sync(0xffffffffu, (uint32_t)x, o), hi = __shfl_xor_sync(0xffffffffu, (uint32_t)(x >> 32), o);
        x += (uint64_t)hi << 32 | lo;
    }
    return across_warps(x, sh, [](uint64_t a, uint64_t b) { return a + b; });
}

__device__ float block_max(float x, float *sh) {
    return across_warps(warp_max(x), sh, [](float a, float b) { return fmaxf(a, b); });
}

// The largest key u >= lo with F(u) >= target, F(u) = the sum over tokens
// with key(s) >= u of 1 (by_mass false) or their top-p mass: a binary search
// over the 32-bit keys, one exact block sum a step (lib/sample.h; the CPU
// gets the same u by a radix descent).
__device__ uint32_t cut_search(const float *z, int V, float inv_t, float mx, bool by_mass, uint32_t lo,
                               uint64_t target, uint64_t *sh) {
    uint32_t hi = 0xFFFFFFFFu;
    while (lo < hi) {
        const uint32_t mid = lo + (uint32_t)(((uint64_t)hi - lo + 1) / 2);
        uint64_t f = 0;
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            const float s = z[v] * inv_t;
            if (dfl_float_key(s) >= mid) f += by_mass ? dfl_top_p_mass(s, mx) : 1;
        }
        if (block_sum_u64(f, sh) >= target) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The cut of sample.h for one row (tokens with key >= it are kept).
__device__ uint32_t sample_cut(const float *z, int V, const dfl_sampling &sp, float inv_t, uint64_t *shu, float *shf) {
    float mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, z[v] * inv_t);
    mx = block_max(mx, shf);
    uint32_t cut = 0;
    if (sp.top_k > 0 && sp.top_k < V) cut = cut_search(z, V, inv_t, mx, false, 0, (uint64_t)sp.top_k, shu);
    if (sp.top_p > 0 && sp.top_p < 1) {
        uint64_t q = 0;
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            const float s = z[v] * inv_t;
            if (dfl_float_key(s) >= cut) q += dfl_top_p_mass(s, mx);
        }
        const uint64_t Q = block_sum_u64(q, shu);
        cut = cut_search(z, V, inv_t, mx, true, cut, dfl_top_p_target(sp.top_p, Q), shu);
    }
    return cut;
}

} // namespace

// ---------------------------------------------------------------------------
// CUDA kernels

// One block per row of the chunk; rows are row0 + blockIdx.x of the op.
// zd: the drafter's (or only) logits, zt: the target's (KL). dz (bf16) is
// written, zeros included, for every row when it is not NULL.
template <int MODE>
__global__ void __launch_bounds__(ROW_THREADS)
    lmhead_rows_kernel(bf16 *dz, const float *zd, const float *zt, int V, int64_t row0, float *loss, int32_t *pred,
                       int32_t *tpred, float *gap, const int32_t *labels, const float *gscale, const uint64_t *keys,
                       dfl_sampling sp) {
    __shared__ RowStat sh[ROW_THREADS / 32];
    __shared__ float shk[ROW_THREADS / 32];
    __shared__ uint64_t shu[ROW_THREADS / 32];
    const int64_t r = blockIdx.x, i = row0 + r;
    const float *z = zd + r * V, *y = MODE == MODE_KL ? zt + r * V : NULL;
    const float inv_t = MODE == MODE_SAMPLE ? 1.0f / sp.temperature : 1.0f;
    const bool filter = MODE == MODE_SAMPLE && dfl_sampling_filters(&sp);
    const uint32_t cut = filter ? sample_cut(z, V, sp, inv_t, shu, shk) : 0;

    RowStat st, tt;
    st.init();
    tt.init();
    float kl = 0.0f; // on the scale of tt.m
    // CE and argmax read the row 16 bytes at a time where V % 4 == 0 (the
    // chunk's rows are then 16-byte aligned): a thread's elements still come
    // in increasing order, as RowStat's ties need
    const bool vec = (MODE == MODE_CE || MODE == MODE_ARGMAX) && V % 4 == 0;
    if (vec) {
        const float4 *z4 = (const float4 *)z;
        for (int q = threadIdx.x; q < V / 4; q += blockDim.x) {
            const float4 f = z4[q];
            st.add(f.x, 4 * q), st.add(f.y, 4 * q + 1), st.add(f.z, 4 * q + 2), st.add(f.w, 4 * q + 3);
        }
    }
    for (int v = vec ? V : threadIdx.x; v < V; v += blockDim.x) {
        float a = z[v];
        if (MODE == MODE_SAMPLE) {
            const float s = a * inv_t;
            a = !filter || dfl_float_key(s) >= cut ? s + dfl_gumbel(keys[i], v) : -INFINITY;
        }
        st.add(a, v);
        if (MODE == MODE_KL) {
            float b = y[v];
            float mold = tt.m;
            tt.add(b, v);
            kl = scale_kl(kl, mold, tt.m) + expf(b - tt.m) * (b - a);
        }
    }
    if (MODE == MODE_KL) {
        // bring every thread's kl term to the row max before tt is reduced
        float mloc = tt.m;
        RowStat red = tt;
        block_reduce(red, sh);
        kl = scale_kl(kl, mloc, red.m);
        tt = red;
        kl = warp_sum(kl);
        __syncthreads();
        if (threadIdx.x % 32 == 0) shk[threadIdx.x / 32] = kl;
        __syncthreads();
        kl = 0.0f;
        for (int w = 0; w < (int)blockDim.x / 32; w++) kl += shk[w];
    }
    block_reduce(st, sh);
    const float lse = st.m + logf(st.s);
    const float g = gscale ? gscale[i] : 1.0f;
    const int lab = MODE == MODE_CE && labels ? labels[i] : -1;
    const bool has_label = lab >= 0 && lab < V;

    if (threadIdx.x == 0) {
        if (pred) pred[i] = st.idx;
        if ((MODE == MODE_ARGMAX || MODE == MODE_SAMPLE) && gap) gap[i] = st.best - st.second;
        if (MODE == MODE_CE && loss) loss[i] = has_label ? lse - z[lab] : 0.0f;
        if (MODE == MODE_KL) {
            if (tpred) tpred[i] = tt.idx;
            float lse_t = tt.m + logf(tt.s);
            if (loss) loss[i] = g != 0.0f ? kl / tt.s - lse_t + lse : 0.0f;
        }
    }
    if (!dz) return;
    bf16 *d = dz + r * V;
    if (g == 0.0f || (MODE == MODE_CE && !has_label)) { // no gradient from this row
        for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = f2bf(0.0f);
        return;
    }
    if (MODE == MODE_CE && vec) { // 16 bytes of z in, 8 of dz out (V % 4 == 0)
        const float4 *z4 = (const float4 *)z;
        for (int q = threadIdx.x; q < V / 4; q += blockDim.x) {
            const float4 f = z4[q];
            const float zf[4] = {f.x, f.y, f.z, f.w};
            float out4[4];
#pragma unroll
            for (int k = 0; k < 4; k++) out4[k] = g * (expf(zf[k] - lse) - (4 * q + k == lab ? 1.0f : 0.0f));
            store_bf16s<4>(d + 4 * q, out4);
        }
    } else if (MODE == MODE_CE) {
        for (int v = threadIdx.x; v < V; v += blockDim.x)
            d[v] = f2bf(g * (expf(z[v] - lse) - (v == lab ? 1.0f : 0.0f)));
    } else if (MODE == MODE_KL) {
        float lse_t = tt.m + logf(tt.s);
        for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = f2bf(g * (expf(z[v] - lse) - expf(y[v] - lse_t)));
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

// Rows per chunk so that R * V * bytes_per_elem <= LOGITS_BUDGET, the
// chunks of one call as even as multiples of 64 rows allow (8192 rows at V
// = 151936: 8 x 1024, where the budget's 1152 left a tail of 128 whose
// products ran at ~60 % of the others' rate).
static int64_t chunk_rows(int64_t N, int64_t V, int bytes_per_elem) {
    if (g_cuda.lmhead_rows > 0) return g_cuda.lmhead_rows < N ? g_cuda.lmhead_rows : N; // tests: chunk boundaries
    int64_t r = (int64_t)(LOGITS_BUDGET / ((size_t)V * bytes_per_elem));
    if (r >= 64) r = r / 64 * 64;
    if (r < 1) r = 1;
    if (r >= N) return N;
    const int64_t chunks = CEIL_DIV(N, r), even = CEIL_DIV(CEIL_DIV(N, chunks), (int64_t)64) * 64;
    return even < r ? even : r;
}

template <int MODE>
static void lmhead_run(float *loss, int32_t *pred, int32_t *tpred, float *gap, void *dh, const void *h, const void *th,
                       const void *w, const int32_t *labels, const float *gscale, int64_t N, int64_t H, int64_t V,
                       const uint64_t *keys = NULL, dfl_sampling sp = dfl_sampling{1.0f, 0, 0.0f}) {
    CU_ASSERT(h && w && N >= 0 && H > 0 && V > 0 && V <= INT32_MAX);
    if (N == 0) return;
    const int nlog = MODE == MODE_KL ? 2 : 1;
    const int bytes = 4 * nlog + (dh ? 2 : 0);
    const int64_t R = chunk_rows(N, V, bytes);
    char *mem = (char *)cuda_scratch(SCRATCH_LOGITS, (size_t)R * V * bytes);
    float *zd = (float *)mem, *zt = MODE == MODE_KL ? zd + R * V : NULL;
    bf16 *dz = dh ? (bf16 *)(mem + (size_t)R * V * 4 * nlog) : NULL;
    const bf16 *wb = (const bf16 *)w;
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        const int64_t n = N - r0 < R ? N - r0 : R;
        gemm_nt(zd, 1, (const bf16 *)h + r0 * H, wb, n, V, H, H, H, V, 1.0f, 0.0f);
        if (MODE == MODE_KL) gemm_nt(zt, 1, (const bf16 *)th + r0 * H, wb, n, V, H, H, H, V, 1.0f, 0.0f);
        KLAUNCH(lmhead_rows_kernel<MODE>, (unsigned)n, ROW_THREADS, 0)(dz, zd, zt, (int)V, r0, loss, pred,
                                                                                tpred, gap, labels, gscale, keys,
                                                                                sp);
        LAUNCH_CHECK();
        if (dh) gemm_nn((bf16 *)dh + r0 * H, 0, dz, wb, n, H, V, V, H, H, 1.0f, 1.0f);
    }
}

void cuda_lmhead_ce(float *loss, int32_t *pred, void *dh, const void *h, const void *w, const int32_t *labels,
                    const float *gscale, int64_t N, int64_t H, int64_t V) {
    lmhead_run<MODE_CE>(loss, pred, NULL, NULL, dh, h, NULL, w, labels, gscale, N, H, V);
}

void cuda_lmhead_kl(float *loss, int32_t *pred, int32_t *tpred, void *dh, const void *h, const void *th,
                    const void *w, const float *gscale, int64_t N, int64_t H, int64_t V) {
    CU_ASSERT(th);
    lmhead_run<MODE_KL>(loss, pred, tpred, NULL, dh, h, th, w, NULL, gscale, N, H, V);
}

void cuda_lmhead_argmax(int32_t *pred, float *gap, const void *h, const void *w, int64_t N, int64_t H, int64_t V) {
    lmhead_run<MODE_ARGMAX>(NULL, pred, NULL, gap, NULL, h, NULL, w, NULL, NULL, N, H, V);
}

// keys: host [N], staged to the device (N is a verify block: a few rows)
void cuda_lmhead_sample(int32_t *pred, float *gap, const void *h, const void *w, const uint64_t *keys,
                        const dfl_sampling *s, int64_t N, int64_t H, int64_t V) {
    CU_ASSERT(keys && s && s->temperature > 0 && isfinite(1.0f / s->temperature));
    if (N <= 0) return;
    uint64_t *dkeys = (uint64_t *)cuda_scratch(SCRATCH_OP, (size_t)N * sizeof *dkeys);
    cudaCheck(cudaMemcpyAsync(dkeys, keys, (size_t)N * sizeof *dkeys, cudaMemcpyHostToDevice, g_cuda.stream));
    lmhead_run<MODE_SAMPLE>(NULL, pred, NULL, gap, NULL, h, NULL, w, NULL, NULL, N, H, V, dkeys, *s);
}
