// gdn.cu: the Gated DeltaNet ops of the Qwen3.5 hybrid target (lib/ops.h
// has the contracts, lib/ops_cpu_gdn.c the reference): its causal depthwise
// convolution and its gated delta rule in the recurrent form. (The gated
// attention's sigmoid_mul is in elementwise.cu.)
// defines: cuda_conv1d_silu, cuda_gated_delta
//
// conv1d_silu: one thread per (tile of rows, 8 channels). The thread keeps
// the last KMAX input rows of its channels in registers (a window shifted by
// one row per output row, constant indices only) and its K taps, so each
// input row is read once per tile; the window is refilled at the tile's
// first row and at every sequence start (zeros, or `hist`). Sequences are
// found in the device array cu (a binary search for the tile's first row,
// then a walk).
//
// gated_delta: the recurrence is independent per column c of the state S
// [dk, dv]: with q, k, beta, g of the row, column c only needs its own
// S[:, c], v[c] and sums over dk. So a group of KT consecutive lanes owns CV
// columns: lane ki of the group holds rows [ki*R, ki*R+R) of them (R*CV
// floats of S in registers for the whole sequence, R = dk/KT rounded up),
// and every sum over dk is R products in the lane then a butterfly over
// the KT lanes (__shfl_xor: all lanes get bitwise the same sum). Nothing is
// shared between warps: no shared memory, no __syncthreads. A block is W
// warps = W*32/KT*CV columns of one (sequence, value head); the grid is
// (nseq*Hv, column blocks). Each lane also loads its R elements of q and k
// (the l2norms are butterflies too) and folds the norms into scalars: with
// raw k, kS = decay/|k| sum S k, u = beta (v - kS) / |k|, S = decay S + k u,
// out = scale/|q| sum S q. Row t+1's inputs are loaded (as raw bf16) while
// row t is computed, so the sequential chain is not one memory latency per
// row.
//
// Cost (Qwen3.5-27B: Hk 16, Hv 48, dk = dv = 128; KT 8, R 16, CV 4: 8 warps
// per head and row). Per (row, head) the state takes 4 x 16384 f32
// operations (S k, the update as a multiply and an FMA, S q): 1.03e11 for a
// prefill of 16 x 2048 tokens (1.57M (row, head) steps), 3.1 ms at the
// CUDA cores' 67 TFLOP/s. The instructions around them (the l2norms each
// lane group redoes, 30 shuffles per lane, bf16 conversions, the gate
// math, addressing) make ~550 SASS instructions per warp and row (sm_90a,
// 168 registers, no spills: 3 blocks of 4 warps per SM), ~4.4K warp
// instructions per (row, head), 6.9G per layer: issue-bound at one per
// clock per scheduler (132 SMs x 4 x ~1.75 GHz), ~7.5 ms, expect 7-10 ms
// per GDN layer (3 warps per scheduler cover the ~500-cycle dependent
// chain of a row; blocks of unequal sequences end unevenly). The bytes
// (qkv, ba, out: ~1.1 GB) take ~0.25 ms. For the 48 GDN layers of a
// 32K-token prefill that is ~0.35-0.5 s beside ~2.2 s of projections at
// 790 TFLOP/s. The chunked (WY) form (research targets-extraction.md §3.5,
// chunks of 64) moves the work into tensor-core products, ~180K flops per
// (row, head), 0.28 TFLOP per layer, ~1 ms at 300-400 TFLOP/s: ~7x faster
// prefill, at the price of bf16 (fla) or tf32 intermediates (§3.7).
// Whatever the batch, one sequence takes ~0.3 us per row (its dependent
// chain): a lone 32K-token sequence is ~10 ms per layer on 384 warps, where
// the chunked form would also be parallel inside each chunk. Computing the
// gates and l2norms once per (row, head) in a pre-pass, instead of in every
// warp, would save ~25% of the instructions (not done: unmeasured).
// A verify step (nseq 1, 16 rows, state and steps: W 1, 384 warps) is
// latency- and store-bound: 16 dependent rows of ~0.3 us, 3 MB of state
// read and written, 50 MB of steps written (12 us at ~4.3 TB/s): ~15-25 us
// per layer, ~1 ms over 48 layers, mostly the steps.
#include "common.cuh"

#include <string.h>

// ---------------------------------------------------------------------------
// CUDA kernels

// torch.nn.functional.softplus (beta 1, threshold 20), as the CPU reference
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- conv1d_silu ----

// the largest s in [0, nseq] with cu[s] <= t, or -1 when t < cu[0]
__device__ __forceinline__ int seq_of_row(const int32_t *cu, int nseq, int64_t t) {
    int lo = -1, hi = nseq; // invariant: cu[lo] <= t (lo = -1: none), cu[hi+1..] > t
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (cu[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// The raw input of row r for the sequence starting at lo (VW channels at c):
// in[r] inside it, before it hist[K-1-(lo-r)] (when given and in range) or 0.
template <int VW>
__device__ __forceinline__ void conv_fetch(float *x, const bf16 *in, const bf16 *hist, int64_t r, int64_t lo,
                                           int64_t c, int64_t C, int K) {
    if (r >= lo) {
        load_bf16s<VW>(x, in + r * C + c);
        return;
    }
    int64_t hr = (K - 1) - (lo - r);
    if (hist && hr >= 0) {
        load_bf16s<VW>(x, hist + hr * C + c);
        return;
    }
#pragma unroll
    for (int e = 0; e < VW; e++) x[e] = 0.0f;
}

// Thread: channels [c, c+VW), rows [t0, t0+rpt). win[d] = input row t-d;
// wr[d] = w[c, K-1-d] (0 for d >= K), so out[t] = silu(sum_d wr[d] win[d]).
template <int VW, int KMAX>
__global__ void conv1d_silu_kernel(bf16 *out, const bf16 *in, const bf16 *hist, const bf16 *w, const int32_t *cu,
                                   int nseq, int64_t T, int64_t C, int K, int64_t rpt) {
    const int64_t groups = C / VW;
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t c = (idx % groups) * VW, t0 = (idx / groups) * rpt;
    if (t0 >= T) return;
    const int64_t t1 = t0 + rpt < T ? t0 + rpt : T;
    float wr[KMAX][VW];
#pragma unroll
    for (int d = 0; d < KMAX; d++)
#pragma unroll
        for (int e = 0; e < VW; e++) wr[d][e] = d < K ? bf2f(w[(c + e) * K + (K - 1 - d)]) : 0.0f;
    int s = seq_of_row(cu, nseq, t0);
    int64_t lo = s >= 0 ? cu[s] : 0, next = s < nseq ? cu[s + 1] : INT64_MAX;
    float win[KMAX][VW];
    bool fresh = true; // the window holds nothing of this sequence yet
    for (int64_t t = t0; t < t1; t++) {
        while (t >= next) { // the next sequence (skipping empty ones)
            s++;
            lo = cu[s];
            next = s < nseq ? cu[s + 1] : INT64_MAX;
            fresh = true;
        }
        if (s < 0 || s >= nseq) continue; // a row of no sequence: not written
        if (fresh) {
#pragma unroll
            for (int d = 1; d < KMAX; d++) {
                if (d < K) conv_fetch<VW>(win[d], in, hist, t - d, lo, c, C, K);
                else
#pragma unroll
                    for (int e = 0; e < VW; e++) win[d][e] = 0.0f;
            }
            fresh = false;
        } else {
#pragma unroll
            for (int d = KMAX - 1; d >= 1; d--)
#pragma unroll
                for (int e = 0; e < VW; e++) win[d][e] = win[d - 1][e];
        }
        load_bf16s<VW>(win[0], in + t * C + c);
        float acc[VW];
#pragma unroll
        for (int e = 0; e < VW; e++) acc[e] = 0.0f;
#pragma unroll
        for (int d = KMAX - 1; d >= 0; d--) // taps in the reference's order, oldest first
#pragma unroll
            for (int e = 0; e < VW; e++) acc[e] = fmaf(wr[d][e], win[d][e], acc[e]);
#pragma unroll
        for (int e = 0; e < VW; e++) acc[e] = acc[e] / (1.0f + expf(-acc[e]));
        store_bf16s<VW>(out + t * C + c, acc);
    }
}

// ---- gated_delta ----

// N bf16 kept as raw bits between their load and their use (the prefetch
// of the next row), read as f32 only when the row is computed.
template <int N>
struct RawBf16 {
    uint4 u[(N + 7) / 8];
};

// p[0..N) into r: 16-byte loads (VEC: p 16-byte aligned, all N valid) or
// element by element, the n <= N valid ones (the rest 0).
template <int N, bool VEC>
__device__ __forceinline__ void raw_load(RawBf16<N> &r, const bf16 *p, int n) {
    if (VEC) {
        static_assert(!VEC || N % 8 == 0, "16-byte loads need N % 8 == 0");
#pragma unroll
        for (int i = 0; i < N / 8; i++) {
            DEV_CHECK_ALIGN(p + 8 * i, 16);
            r.u[i] = *(const uint4 *)(p + 8 * i);
        }
    } else {
        bf16 *b = (bf16 *)r.u;
#pragma unroll
        for (int e = 0; e < N; e++) b[e] = e < n ? p[e] : f2bf(0.0f);
    }
}

template <int N>
__device__ __forceinline__ void raw_f32(float *f, const RawBf16<N> &r) {
    const bf16 *b = (const bf16 *)r.u;
#pragma unroll
    for (int e = 0; e < N; e++) f[e] = bf2f(b[e]);
}

// sum over the KT consecutive lanes of a group (every lane gets the same bits)
template <int KT>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = 1; o < KT; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// n <= CV valid f32 at p <- f (vec: CV == 4, all valid, p 16-byte aligned)
template <int CV>
__device__ __forceinline__ void store_f32s(float *p, const float *f, int n, bool vec) {
    if (CV == 4 && vec) {
        DEV_CHECK_ALIGN(p, 16);
        uint4 u;
        memcpy(&u, f, 16);
        *(uint4 *)p = u;
    } else {
#pragma unroll
        for (int c = 0; c < CV; c++)
            if (c < n) p[c] = f[c];
    }
}

template <int CV>
__device__ __forceinline__ void load_f32s(float *f, const float *p, int n, bool vec) {
    if (CV == 4 && vec) {
        DEV_CHECK_ALIGN(p, 16);
        uint4 u = *(const uint4 *)p;
        memcpy(f, &u, 16);
    } else {
#pragma unroll
        for (int c = 0; c < CV; c++) f[c] = c < n ? p[c] : 0.0f;
    }
}

// One row's inputs for one lane: its R elements of q and k, its CV of v,
// and the head's b and a.
template <int R, int CV>
struct GdnRow {
    RawBf16<R> q, k;
    bf16 v[CV];
    bf16 b, a;
};

// The row's pointers: q and k of key head kh at the lane's rows i0..,
// v of value head j at its columns c0...
template <int R, int CV, bool VEC>
__device__ __forceinline__ void gdn_load_row(GdnRow<R, CV> &in, const bf16 *qkv, const bf16 *ba, int64_t t,
                                             int64_t C, int Hk, int Hv, int dk, int dv, int kh, int j, int i0,
                                             int c0) {
    const bf16 *row = qkv + t * C;
    const int nk = dk - i0 < R ? dk - i0 : R; // valid rows of this lane (may be <= 0)
    raw_load<R, VEC>(in.q, row + (int64_t)kh * dk + i0, nk);
    raw_load<R, VEC>(in.k, row + (int64_t)(Hk + kh) * dk + i0, nk);
    const bf16 *v = row + 2 * (int64_t)Hk * dk + (int64_t)j * dv + c0;
#pragma unroll
    for (int c = 0; c < CV; c++) in.v[c] = c0 + c < dv ? v[c] : f2bf(0.0f);
    in.b = ba[t * 2 * Hv + j];
    in.a = ba[t * 2 * Hv + Hv + j];
}

// Block: W = blockDim.x / 32 warps; lane group vi of warp w owns columns
// [c0, c0+CV), c0 = ((blockIdx.y * W + w) * (32/KT) + vi) * CV, of value
// head j = blockIdx.x % Hv of sequence s = blockIdx.x / Hv; lane ki of the
// group owns rows [ki*R, ki*R+R). Lanes past dk or dv compute on zeros and
// store nothing, but stay in the loop for the shuffles.
template <int KT, int R, int CV, bool VEC>
__global__ void __launch_bounds__(128) gated_delta_kernel(bf16 *out, float *state, float *steps, const bf16 *qkv,
                                                         const bf16 *ba, const float *A_log, const float *dt_bias,
                                                         const int32_t *cu, int Hk, int Hv, int dk, int dv,
                                                         int f32vec) {
    static_assert(32 % KT == 0, "lane groups tile a warp");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, W = blockDim.x / 32;
    const int ki = lane % KT, vi = lane / KT;
    const int s = blockIdx.x / Hv, j = blockIdx.x % Hv, kh = j / (Hv / Hk);
    const int c0 = ((int)(blockIdx.y * W + warp) * (32 / KT) + vi) * CV, i0 = ki * R;
    const int ncol = dv - c0 < CV ? dv - c0 : CV; // valid columns (may be <= 0)
    const bool vec = f32vec && ncol == CV;         // 16-byte f32 state accesses
    const int64_t C = 2 * (int64_t)Hk * dk + (int64_t)Hv * dv;
    const int64_t lo = cu[s], hi = cu[s + 1];

    float S[R][CV];
    if (state) {
        const float *st = state + (int64_t)j * dk * dv;
#pragma unroll
        for (int m = 0; m < R; m++) {
            if (i0 + m < dk && ncol > 0) load_f32s<CV>(S[m], st + (int64_t)(i0 + m) * dv + c0, ncol, vec);
            else
#pragma unroll
                for (int c = 0; c < CV; c++) S[m][c] = 0.0f;
        }
    } else {
#pragma unroll
        for (int m = 0; m < R; m++)
#pragma unroll
            for (int c = 0; c < CV; c++) S[m][c] = 0.0f;
    }

    const float scale = 1.0f / sqrtf((float)dk), rate = expf(A_log[j]), dtb = dt_bias[j];
    GdnRow<R, CV> nxt;
    if (lo < hi) gdn_load_row<R, CV, VEC>(nxt, qkv, ba, lo, C, Hk, Hv, dk, dv, kh, j, i0, c0);
    for (int64_t t = lo; t < hi; t++) {
        float q[R], k[R], v[CV];
        raw_f32<R>(q, nxt.q);
        raw_f32<R>(k, nxt.k);
#pragma unroll
        for (int c = 0; c < CV; c++) v[c] = bf2f(nxt.v[c]);
        const float b = bf2f(nxt.b), a = bf2f(nxt.a);
        if (t + 1 < hi) gdn_load_row<R, CV, VEC>(nxt, qkv, ba, t + 1, C, Hk, Hv, dk, dv, kh, j, i0, c0);

        // l2norms: 1/|q| (times the scale) and 1/|k|, as x / sqrt(sum x^2 + 1e-6)
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int m = 0; m < R; m++) sq = fmaf(q[m], q[m], sq), sk = fmaf(k[m], k[m], sk);
        sq = group_sum<KT>(sq);
        sk = group_sum<KT>(sk);
        const float iq = 1.0f / sqrtf(sq + 1e-6f) * scale, ik = 1.0f / sqrtf(sk + 1e-6f);
        const float beta = sigmoid_f(b), decay = expf(-rate * softplus_f(a + dtb));

        // u = beta (v - decay S^T k/|k|), divided by |k| once more for the update with raw k
        float p[CV];
#pragma unroll
        for (int c = 0; c < CV; c++) {
            p[c] = 0.0f;
#pragma unroll
            for (int m = 0; m < R; m++) p[c] = fmaf(S[m][c], k[m], p[c]);
        }
#pragma unroll
        for (int o = 1; o < KT; o <<= 1)
#pragma unroll
            for (int c = 0; c < CV; c++) p[c] += __shfl_xor_sync(0xffffffffu, p[c], o);
        float u[CV];
#pragma unroll
        for (int c = 0; c < CV; c++) u[c] = beta * (v[c] - decay * ik * p[c]) * ik;

        // S = decay S + k u^T;  o = S^T q
        float o[CV];
#pragma unroll
        for (int c = 0; c < CV; c++) o[c] = 0.0f;
#pragma unroll
        for (int m = 0; m < R; m++)
#pragma unroll
            for (int c = 0; c < CV; c++) {
                S[m][c] = fmaf(decay, S[m][c], k[m] * u[c]);
                o[c] = fmaf(S[m][c], q[m], o[c]);
            }
#pragma unroll
        for (int sh = 1; sh < KT; sh <<= 1)
#pragma unroll
            for (int c = 0; c < CV; c++) o[c] += __shfl_xor_sync(0xffffffffu, o[c], sh);

        if (ki == 0) {
            bf16 *dst = out + t * (int64_t)Hv * dv + (int64_t)j * dv + c0;
#pragma unroll
            for (int c = 0; c < CV; c++)
                if (c < ncol) dst[c] = f2bf(o[c] * iq);
        }
        if (steps && ncol > 0) {
            float *st = steps + (t * Hv + j) * (int64_t)dk * dv;
#pragma unroll
            for (int m = 0; m < R; m++)
                if (i0 + m < dk) store_f32s<CV>(st + (int64_t)(i0 + m) * dv + c0, S[m], ncol, vec);
        }
    }
    if (state && ncol > 0) {
        float *st = state + (int64_t)j * dk * dv;
#pragma unroll
        for (int m = 0; m < R; m++)
            if (i0 + m < dk) store_f32s<CV>(st + (int64_t)(i0 + m) * dv + c0, S[m], ncol, vec);
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

enum { CONV_KMAX = 8 };

template <int VW, int KMAX>
static void launch_conv(bf16 *out, const bf16 *in, const bf16 *hist, const bf16 *w, const int32_t *cu, int nseq,
                        int64_t T, int64_t C, int K) {
    // rows per thread: enough threads to fill the GPU (~2048 per SM), and
    // the window's refill ((K-1)/rpt extra row reads) amortised over up to 64
    const int64_t groups = C / VW, want = (int64_t)g_cuda.sm_count * 2048;
    int64_t rpt = g_cuda.conv_rows > 0 ? g_cuda.conv_rows : T * groups / want;
    rpt = rpt < 1 ? 1 : rpt > 64 ? 64 : rpt;
    const int64_t threads = groups * CEIL_DIV(T, rpt);
    auto *kernel = conv1d_silu_kernel<VW, KMAX>;
    KLAUNCH(kernel, (unsigned)CEIL_DIV(threads, (int64_t)128), 128, 0)(out, in, hist, w, cu, nseq, T, C, K, rpt);
    LAUNCH_CHECK();
}

void cuda_conv1d_silu(void *out, const void *in, const void *hist, const void *w, const int32_t *cu, int64_t nseq,
                      int64_t T, int64_t C, int64_t K) {
    CU_ASSERT(out && in && w && cu && nseq >= 0 && nseq < INT32_MAX && T >= 0 && C > 0 && K > 0);
    CU_ASSERT(!hist || nseq == 1);
    if (K > CONV_KMAX) {
        char msg[96];
        snprintf(msg, sizeof msg, "conv1d_silu: kernel size %lld over %d is not supported", (long long)K, CONV_KMAX);
        cuda_fail("CUDA", msg, __FILE__, __LINE__);
    }
    if (T == 0 || nseq == 0) return;
    CU_ASSERT(CEIL_DIV(C * T, (int64_t)128) < INT32_MAX);
    const bool vec = C % 8 == 0 && is_aligned(out, 16) && is_aligned(in, 16) && is_aligned(hist, 16);
    bf16 *o = (bf16 *)out;
    const bf16 *i = (const bf16 *)in, *h = (const bf16 *)hist, *wt = (const bf16 *)w;
    if (vec && K <= 4) launch_conv<8, 4>(o, i, h, wt, cu, (int)nseq, T, C, (int)K);
    else if (vec) launch_conv<8, 8>(o, i, h, wt, cu, (int)nseq, T, C, (int)K);
    else if (K <= 4) launch_conv<1, 4>(o, i, h, wt, cu, (int)nseq, T, C, (int)K);
    else launch_conv<1, 8>(o, i, h, wt, cu, (int)nseq, T, C, (int)K);
}

enum { GDN_CV = 4 }; // state columns per lane group

template <int KT, int R, bool VEC>
static void launch_gdn(bf16 *out, float *state, float *steps, const bf16 *qkv, const bf16 *ba, const float *A_log,
                       const float *dt_bias, const int32_t *cu, int64_t nseq, int Hk, int Hv, int dk, int dv) {
    const int cols_per_warp = 32 / KT * GDN_CV, warps_needed = (int)CEIL_DIV(dv, cols_per_warp);
    // Up to 4 warps per block, fewer when that leaves the GPU short of
    // blocks (a verify step: one sequence, 48 heads).
    int W = warps_needed < 4 ? warps_needed : 4;
    while (W > 1 && nseq * Hv * CEIL_DIV(warps_needed, W) < 2 * (int64_t)g_cuda.sm_count) W /= 2;
    const int64_t colblocks = CEIL_DIV(warps_needed, W);
    CU_ASSERT(nseq * Hv <= INT32_MAX && colblocks <= 65535);
    // 16-byte f32 accesses to state/steps: rows of dv floats 16-byte aligned
    const int f32vec = dv % 4 == 0 && is_aligned(state, 16) && is_aligned(steps, 16);
    auto *kernel = gated_delta_kernel<KT, R, GDN_CV, VEC>;
    KLAUNCH(kernel, dim3((unsigned)(nseq * Hv), (unsigned)colblocks), 32 * W, 0)(out, state, steps, qkv, ba, A_log,
                                                                                dt_bias, cu, Hk, Hv, dk, dv, f32vec);
    LAUNCH_CHECK();
}

void cuda_gated_delta(void *out, float *state, float *steps, const void *qkv, const void *ba, const float *A_log,
                      const float *dt_bias, const int32_t *cu, int64_t nseq, int64_t T, int64_t Hk, int64_t Hv,
                      int64_t dk, int64_t dv) {
    CU_ASSERT(out && qkv && ba && A_log && dt_bias && cu && nseq >= 0 && T >= 0);
    CU_ASSERT((!state && !steps) || nseq == 1);
    CU_ASSERT(Hk > 0 && Hv > 0 && Hv % Hk == 0 && Hv <= INT32_MAX && dk > 0 && dv > 0 && dv <= INT32_MAX);
    if (dk > 256) {
        char msg[96];
        snprintf(msg, sizeof msg, "gated_delta: key head dim %lld over 256 is not supported", (long long)dk);
        cuda_fail("CUDA", msg, __FILE__, __LINE__);
    }
    if (nseq == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *x = (const bf16 *)qkv, *g = (const bf16 *)ba;
    const int ik = (int)Hk, iv = (int)Hv, k = (int)dk, v = (int)dv;
    // 16-byte q/k loads: every lane's R rows whole and 16-byte aligned
    const int64_t C = 2 * Hk * dk + Hv * dv;
    const bool vec = C % 8 == 0 && dk % 8 == 0 && is_aligned(qkv, 16);
#define GDN(KT, R)                                                                                       \
    (vec && dk == (KT) * (R) ? launch_gdn<KT, R, true>(o, state, steps, x, g, A_log, dt_bias, cu, nseq, ik, iv, k, v) \
                             : launch_gdn<KT, R, false>(o, state, steps, x, g, A_log, dt_bias, cu, nseq, ik, iv, k, v))
    if (dk <= 16) launch_gdn<8, 2, false>(o, state, steps, x, g, A_log, dt_bias, cu, nseq, ik, iv, k, v);
    else if (dk <= 32) launch_gdn<8, 4, false>(o, state, steps, x, g, A_log, dt_bias, cu, nseq, ik, iv, k, v);
    else if (dk <= 64) GDN(8, 8);
    else if (dk <= 128) GDN(8, 16);
    else GDN(16, 16);
#undef GDN
}
