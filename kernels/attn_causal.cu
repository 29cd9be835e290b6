// attn_causal.cu: causal self-attention over packed sequences (the target's
// prefill), GQA, forward only, with an optional sliding window and lse.
// defines: cuda_attn_causal
//
// Fast path (D = 64, 128 or 256, 16-byte aligned rows): flash attention with
// mma.sync tensor cores, or wgmma (DFLASH_CUDA_WGMMA; attention.cuh,
// flash_fwd_cta). Each CTA takes 128 rows (64 for D = 256; 128 or 192 on
// wgmma) of one sequence and one KV head, in the (position, head-in-group)
// order, and visits only the keys up to its last row's position; a row's
// keys past its own position are masked.
//
// A sliding window W > 0 (a target's sliding layer: gpt-oss, Qwen3,
// Mistral; row t sees keys max(seq start, t - W + 1) .. t) is a template
// mode, CausalWindow: the CTA's keys start at its first row's first key
// (position - W + 1, not before the sequence's start), so its work is
// proportional to the window, and each row's keys below its own first are
// masked beside the causal mask. Only the tiles that can hold a masked key
// are tested: those before its last row's first key (the window's lower
// edge) and those past its first row's position (the diagonal); the tiles
// in between are every row's whole. The lse (natural-log logsumexp of the
// scaled scores, [T, Hq]; gpt-oss's sinks) is written when asked for, with
// or without a window. W = 0 without an lse compiles to the kernel's code
// from before either (the same PTX, entry by entry); the window's kernels
// use fewer registers than it (their tile tests are in int on the tile
// index). A window of T or more is none. The sequence lengths stay on the
// device: a small kernel turns cu into per-sequence tile offsets and each
// CTA finds its sequence by binary search, so no host synchronisation is
// needed. Otherwise (other D, unaligned, DFLASH_CUDA_SIMPLE=1): the simple
// kernel, which takes the window and lse too.
#include "attention.cuh"

using namespace attn;

// ---------------------------------------------------------------------------
// CUDA kernels

// tile_off[s] = sum over s' < s of ceil(len(s') * G / rows); tile_off[nseq] = total
__global__ void causal_tiles_kernel(int *tile_off, const int32_t *cu, int nseq, int G, int rows) {
    block_scan_exclusive(tile_off, nseq, [&](int s) { return (int)CEIL_DIV((int64_t)(cu[s + 1] - cu[s]) * G, rows); });
}

// 4 warps of 2 row blocks (attention.cuh, flash_fwd_cta): 128 rows a CTA for
// D <= 128, two CTAs a multiprocessor; 1 row block (64 rows) for D = 256,
// whose O accumulator alone is 128 registers a row block.
template <int D>
constexpr int CAUSAL_MB = D <= 128 ? 2 : 1;

// WGS = 2 or 3: the wgmma path, two or three warpgroups of 64 rows (128 or
// 192 rows, 256 or 384 threads), one CTA a multiprocessor (~150 registers a
// thread at D = 128), 96 or 112 KiB of shared memory (PIPE: the overlapped
// loop with three K/V stages, 128 or 144 KiB).
// LSE: the lse pointer is passed on (false: NULL, so that the plain causal
// kernel without an lse, W = 0, compiles to the code it had before either).
template <int D, int MB = CAUSAL_MB<D>, int WGS = 0, bool PIPE = false, class WIN = NoWindow, bool LSE = false>
__global__ void __launch_bounds__(WGS ? 128 * WGS : NTHREADS, WGS ? 1 : 2)
    attn_causal_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu,
                       const int *tile_off, int nseq, int Hq, int Hkv, int G, float scale_log2, WIN win) {
    constexpr int ROWS = WGS ? 64 * WGS : BM * MB;
    int tile = blockIdx.x;
    if (tile >= tile_off[nseq]) return;
    int lo = 0, hi = nseq - 1; // the last sequence whose first tile is <= tile
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tile_off[mid] <= tile) lo = mid;
        else hi = mid - 1;
    }
    int s = lo;
    int x = tile_off[s + 1] - 1 - tile; // the longest rows of a sequence first
    int64_t start = cu[s];
    int rows_total = (cu[s + 1] - cu[s]) * G;
    int r0 = x * ROWS;
    int rlast = (r0 + ROWS < rows_total ? r0 + ROWS : rows_total) - 1;
    int first = 0; // the CTA's first key (relative to start): its first row's, in a window
    if constexpr (WIN::lower) first = r0 / G - win.W + 1 > 0 ? r0 / G - win.W + 1 : 0;
    FwdSegs<D> segs;
    segs.init(start + first, start + rlast / G + 1, 0, 0);
    flash_fwd_cta<D, true, WGS ? 1 : MB, WGS, PIPE, WIN>(out, LSE ? lse : NULL, q, k, v, Hq, Hkv, G, start,
                                                         rows_total, r0, blockIdx.y, segs, start, scale_log2, win);
}

// ---------------------------------------------------------------------------
// kernel launchers

template <int D, int WGS, bool PIPE, class WIN, bool LSE>
static void launch_causal_in(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu,
                             int64_t nseq, int64_t T, int Hq, int Hkv, WIN win) {
    constexpr int MB = CAUSAL_MB<D>, ROWS = WGS ? 64 * WGS : BM * MB, THREADS = WGS ? 128 * WGS : NTHREADS;
    int G = Hq / Hkv;
    int *tile_off = (int *)cuda_scratch(SCRATCH_OP, (size_t)(nseq + 1) * sizeof(int));
    KLAUNCH(causal_tiles_kernel, 1, 1024, 0)(tile_off, cu, (int)nseq, G, ROWS);
    LAUNCH_CHECK();
    size_t smem = WGS ? fwd_wg_smem_bytes<D, ROWS, PIPE>() : fwd_smem_bytes<D, ROWS>();
    auto kernel = attn_causal_kernel<D, MB, WGS, PIPE, WIN, LSE>;
    static int once = 0;
    if (!once) allow_smem(kernel, smem), once = 1;
    dim3 grid((unsigned)(CEIL_DIV(T * G, (int64_t)ROWS) + nseq), (unsigned)Hkv);
    float scale_log2 = LOG2E / sqrtf((float)D);
    cuda_prof_scope ps(WIN::lower ? (PIPE  ? "k attn_causal: kernel (window, wgmma, overlapped)"
                                     : WGS ? "k attn_causal: kernel (window, wgmma)"
                                           : "k attn_causal: kernel (window)")
                       : PIPE ? "k attn_causal: kernel (wgmma, overlapped)"
                       : WGS  ? "k attn_causal: kernel (wgmma)"
                              : "k attn_causal: kernel");
    KLAUNCH(kernel, grid, THREADS, smem)(out, lse, q, k, v, cu, tile_off, (int)nseq, Hq, Hkv, G, scale_log2, win);
    LAUNCH_CHECK();
}

// window W > 0: the CausalWindow mode (W < T here: a longer window is none),
// its lse asked for or not at run time; W = 0: the plain kernel, with the
// lse (gpt-oss's full layers) or without (the code it had before windows)
template <int D, int WGS = 0, bool PIPE = false>
static void launch_causal(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu,
                          int64_t nseq, int64_t T, int Hq, int Hkv, int W) {
    if (W > 0) launch_causal_in<D, WGS, PIPE, CausalWindow, true>(out, lse, q, k, v, cu, nseq, T, Hq, Hkv, {W});
    else if (lse) launch_causal_in<D, WGS, PIPE, NoWindow, true>(out, lse, q, k, v, cu, nseq, T, Hq, Hkv, {});
    else launch_causal_in<D, WGS, PIPE, NoWindow, false>(out, NULL, q, k, v, cu, nseq, T, Hq, Hkv, {});
}

// the wgmma kernels: wgs warpgroups a CTA, overlapped (PIPE) or not
template <int D>
static void launch_causal_wg(int wgs, bool pipe, bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                             const int32_t *cu, int64_t nseq, int64_t T, int Hq, int Hkv, int W) {
    if (wgs == 3 && pipe) launch_causal<D, 3, true>(out, lse, q, k, v, cu, nseq, T, Hq, Hkv, W);
    else if (wgs == 3) launch_causal<D, 3>(out, lse, q, k, v, cu, nseq, T, Hq, Hkv, W);
    else if (pipe) launch_causal<D, 2, true>(out, lse, q, k, v, cu, nseq, T, Hq, Hkv, W);
    else launch_causal<D, 2>(out, lse, q, k, v, cu, nseq, T, Hq, Hkv, W);
}

void cuda_attn_causal(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *cu,
                      int64_t nseq, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t window) {
    CU_ASSERT(out && q && k && v && cu && nseq >= 0 && T >= 0 && window >= 0);
    CU_ASSERT(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && Hq <= 65535 && Hkv <= 65535);
    CU_ASSERT(T * Hq <= INT32_MAX && nseq < INT32_MAX);
    if (T == 0 || nseq == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *qq = (const bf16 *)q, *kk = (const bf16 *)k, *vv = (const bf16 *)v;
    int aligned = is_aligned(o, 16) && is_aligned(qq, 16) && is_aligned(kk, 16) && is_aligned(vv, 16);
    const int W = window < T ? (int)window : 0; // no sequence is longer than T: a longer window is none
    const int wgs = aligned && !g_cuda.simple ? use_wgmma(D) : 0;
    const int hq = (int)Hq, hkv = (int)Hkv;
    if (wgs && D == 128) launch_causal_wg<128>(wgs, wgmma_pipe(), o, lse, qq, kk, vv, cu, nseq, T, hq, hkv, W);
    else if (wgs) launch_causal_wg<64>(wgs, wgmma_pipe(), o, lse, qq, kk, vv, cu, nseq, T, hq, hkv, W);
    else if (!g_cuda.simple && aligned && D == 128) launch_causal<128>(o, lse, qq, kk, vv, cu, nseq, T, hq, hkv, W);
    else if (!g_cuda.simple && aligned && D == 256) launch_causal<256>(o, lse, qq, kk, vv, cu, nseq, T, hq, hkv, W);
    else if (!g_cuda.simple && aligned && D == 64) launch_causal<64>(o, lse, qq, kk, vv, cu, nseq, T, hq, hkv, W);
    else simple_attn_causal(o, lse, qq, kk, vv, cu, nseq, T, hq, hkv, (int)D, W);
}
