// attn_dflash.cu: DFlash block attention, forward and backward.
// defines: cuda_attn_dflash, cuda_attn_dflash_bwd, attn::launch_delta
//
// Block j's B queries see exactly the keys [ctx_off, ctx_off+ctx_len) ∪
// [blk_off, blk_off+B) (dfl_block). Work is proportional to the keys each
// block really sees: a CTA visits only its block's key ranges, never the
// whole S×Q rectangle.
//
// A sliding window (window W > 0, a drafter's sliding layer; ops.h): slot o
// of a block sees only the context from ctx_end + o + 1 - W on and its own
// keys up to blk_off + o. The tensor-core kernels below take it as a
// template mode (WIN; W = 0 compiles to the code without it): the forward's
// and dq's key segments are the block's reach under the window
// (block_ranges_w: slot 0's context, the whole own block), and each
// (slot, key) score is tested (DflWindow, attention.cuh) in the tiles that
// need it, the window's edge and the own block; a context tile past the
// edge for every slot of the CTA skips the test (CTA-uniform, as W = 0's
// whole tiles). dk/dv take the key tile lists cut to the window and test
// each (row, key) of a step (P = 0, so dS = 0, stored dS too, off the
// window). Work follows the window; no atomics, as W = 0. The simple
// kernels (attn_simple.cu: exactly each slot's keys) remain the path of
// every other shape and of DFLASH_CUDA_SIMPLE, and the emulation's oracle.
//
// Forward (fast path: D = 64, 128 or 256, 16-byte aligned): one CTA per
// (block, KV head, 64 rows of the block's B×G (slot, head-in-group) rows),
// the flash_fwd_cta of attention.cuh over the block's two key segments; lse
// saved (natural log, f32). D = 256 is the target's verify step (Qwen3.5's
// attention, blocks of one row, lib/target_kv.c); drafters have D = 128.
//
// Backward fast path: D = 64 or 128 (the simple kernels otherwise), with
// or without a window (as the forward, whose D = 256 takes one too).
//
// Backward, deterministic (no floating-point atomics anywhere); it writes
// dq, dk and dv (no zeroing pass before it, no read of the zeros):
//   delta = rowsum(dout ∘ out)                        (f32 scratch)
//   dq: one CTA per (block, KV head, 64 rows), like the forward: recompute
//       P = exp(S - lse), dP = dO V^T, dS = P (dP - delta), dq = scale dS K.
//   dk, dv: keys are shared by every block of a sequence whose context
//       covers them, so the work is organised by key tile instead: for each
//       tile of 64 keys, the list of blocks that see it (built on the
//       device, in block order), cut into chunks of <= 32 blocks for
//       balance. One CTA per (chunk, KV head) accumulates dK, dV for its 64
//       keys in registers over its blocks and writes an f32 partial; a
//       reduce kernel sums each tile's partials in chunk order into dk, dv
//       (zeros for a tile no block sees).
//   dq, stored dS (the default): the dk/dv kernel has every dS = P (dP -
//       delta) of a (block, key tile) in registers, rounded to bf16 for its
//       own products; it also stores them, transposed ([key][row], bf16,
//       per block and KV head the tiles it touches in key order), and dq is
//       then one product a tile, dq = scale dS K, where recomputing S and
//       dP took three. The store is 2 bytes per (row, head, key of a
//       touched tile): when it would pass DFLASH_CUDA_DS_MAX_MB (default
//       4096; 0: never), or the device has not the memory for it, or dk and
//       dv are not wanted, dq recomputes.
//   The fast kernels read lse and delta in the order they visit rows: per
//   (block, KV head) the block's B*G rows, padded to a multiple of BR with
//   lse = +inf (so P = 0 there, and a padded row adds nothing).
//   Reading the list totals back is the one host synchronisation, and a
//   forward that saves lse does it ahead for its backward, without waiting
//   (keep_tile_counts below).
#include "attention.cuh"

using namespace attn;

namespace {

constexpr int BR = 64; // query rows per step of the dk/dv kernel

// rows of a (block, KV head) in the fast kernels' lse/delta arrays
__host__ __device__ __forceinline__ int padded_rows(int B, int G) { return (B * G + BR - 1) / BR * BR; }

__device__ __forceinline__ bool sees(const int64_t *r, int64_t key) {
    return (key >= r[0] && key < r[1]) || (key >= r[2] && key < r[3]);
}

// The key tiles (of BN keys, at multiples of BN) a block touches, in key
// order: those meeting its context range or its own range (the tiles whose
// lists hold the block), as one or two runs of tile indices [a0, a1], [b0, b1].
struct TouchedTiles {
    int a0, a1, b0, b1; // inclusive; no second run: b0 > b1
    __device__ void init(const int64_t *r) {
        int s[2][2], n = 0;
        for (int i = 0; i < 2; i++) {
            if (r[2 * i] >= r[2 * i + 1]) continue; // an empty range touches no tile
            s[n][0] = (int)(r[2 * i] / BN), s[n][1] = (int)((r[2 * i + 1] - 1) / BN);
            n++;
        }
        if (n == 2 && s[1][0] < s[0][0]) { // the runs in key order
            int t0 = s[0][0], t1 = s[0][1];
            s[0][0] = s[1][0], s[0][1] = s[1][1], s[1][0] = t0, s[1][1] = t1;
        }
        if (n == 2 && s[1][0] <= s[0][1] + 1) { // overlapping or adjacent: one run
            s[0][1] = s[1][1] > s[0][1] ? s[1][1] : s[0][1];
            n = 1;
        }
        a0 = n ? s[0][0] : 0, a1 = n ? s[0][1] : -1;
        b0 = n == 2 ? s[1][0] : 0, b1 = n == 2 ? s[1][1] : -1;
    }
    __device__ int count() const { return (a1 - a0 + 1) + (b1 - b0 + 1); }
    __device__ int tile(int i) const { return i <= a1 - a0 ? a0 + i : b0 + i - (a1 - a0 + 1); }
    __device__ int index(int t) const { return t <= a1 ? t - a0 : (a1 - a0 + 1) + t - b0; }
};

// (W: the sliding window, whose lists hold only the tiles its reach meets)
__device__ __forceinline__ TouchedTiles touched_tiles(const dfl_block &b, int B, int64_t NK, int64_t W) {
    int64_t r[4];
    block_ranges_w(b, B, NK, W, r);
    TouchedTiles tt;
    tt.init(r);
    return tt;
}

} // namespace

// ---------------------------------------------------------------------------
// CUDA kernels: forward

// WIN: a sliding window W > 0 (the block's reach under it, each slot's
// keys masked in the tiles that need it); else W = 0, the code without one.
template <int D, bool WIN = false>
__global__ void __launch_bounds__(NTHREADS, 2)
    attn_dflash_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks,
                       int nblk, int B, int64_t NK, int Hq, int Hkv, int G, float scale_log2, int64_t W) {
    int j = nblk - 1 - (int)blockIdx.x; // later anchors see more context: start them first
    int64_t r[4];
    if constexpr (WIN) window_ranges(blocks[j], NK, W, 0, B, r);
    else block_ranges(blocks[j], B, NK, r);
    FwdSegs<D> segs;
    segs.init(r[0], r[1], r[2], r[3]);
    if constexpr (WIN) {
        DflWindow win;
        win.init(blocks[j], W);
        flash_fwd_cta<D, false>(out, lse, q, k, v, Hq, Hkv, G, (int64_t)j * B, B * G, blockIdx.z * BM, blockIdx.y,
                                segs, 0, scale_log2, win);
    } else {
        flash_fwd_cta<D, false>(out, lse, q, k, v, Hq, Hkv, G, (int64_t)j * B, B * G, blockIdx.z * BM, blockIdx.y,
                                segs, 0, scale_log2);
    }
}

// the same on wgmma: one warpgroup a CTA (flash_fwd_cta's WGS path; PIPE:
// overlapped, 112 KiB of shared memory at D = 128, still two a
// multiprocessor)
template <int D, bool PIPE = false, bool WIN = false>
__global__ void __launch_bounds__(128, 2)
    attn_dflash_wg_kernel(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks,
                          int nblk, int B, int64_t NK, int Hq, int Hkv, int G, float scale_log2, int64_t W) {
    int j = nblk - 1 - (int)blockIdx.x;
    int64_t r[4];
    if constexpr (WIN) window_ranges(blocks[j], NK, W, 0, B, r);
    else block_ranges(blocks[j], B, NK, r);
    FwdSegs<D> segs;
    segs.init(r[0], r[1], r[2], r[3]);
    if constexpr (WIN) {
        DflWindow win;
        win.init(blocks[j], W);
        flash_fwd_cta<D, false, 1, 1, PIPE>(out, lse, q, k, v, Hq, Hkv, G, (int64_t)j * B, B * G, blockIdx.z * BM,
                                            blockIdx.y, segs, 0, scale_log2, win);
    } else {
        flash_fwd_cta<D, false, 1, 1, PIPE>(out, lse, q, k, v, Hq, Hkv, G, (int64_t)j * B, B * G, blockIdx.z * BM,
                                            blockIdx.y, segs, 0, scale_log2);
    }
}

// ---------------------------------------------------------------------------
// CUDA kernels: backward helpers

// one warp per (token, head) row
__global__ void delta_kernel(float *delta, const bf16 *dout, const bf16 *out, int64_t n, int D) {
    int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (i >= n) return;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32) s += bf2f(dout[i * D + d]) * bf2f(out[i * D + d]);
    s = warp_sum(s);
    if (lane == 0) delta[i] = s;
}

// The rows of block j, KV head hkv, in the fast kernels' order (flattened
// r = p*G + g), padded: lse2[i] = lse * log2(e) and delta[i] = rowsum(dout
// o out) of row r = i % rtp of (j, hkv) = (i / rtp) / Hkv, % Hkv; +inf and
// 0 past the block's B*G rows. One warp per entry, D/32 adjacent elements a
// lane in one load; the index arithmetic in 32 bits (n < 2^31, checked by
// the launcher), where 64-bit divisions cost ~10x as many instructions.
template <int D>
__global__ void row_stats_kernel(float *lse2, float *delta, const float *lse, const bf16 *dout, const bf16 *out,
                                 int n, int rtp, int B, int G, int Hq, int Hkv) {
    constexpr int PER = D / 32;
    const int i = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (i >= n) return;
    const int r = i % rtp, jh = i / rtp, hkv = jh % Hkv, j = jh / Hkv;
    if (r >= B * G) {
        if (lane == 0) lse2[i] = INFINITY, delta[i] = 0.0f;
        return;
    }
    const int64_t row = ((int64_t)j * B + r / G) * Hq + (int64_t)hkv * G + r % G;
    float a[PER], b[PER], s = 0.0f;
    load_bf16s<PER>(a, dout + row * D + lane * PER);
    load_bf16s<PER>(b, out + row * D + lane * PER);
#pragma unroll
    for (int e = 0; e < PER; e++) s += a[e] * b[e];
    s = warp_sum(s);
    if (lane == 0) lse2[i] = lse[row] * LOG2E, delta[i] = s;
}

// (the block's reach under the window: the tile lists of a sliding layer
// hold only the blocks whose window meets the tile)
__device__ __forceinline__ bool block_touches_tile(const dfl_block &b, int B, int64_t NK, int64_t W, int64_t t0,
                                                   int64_t t1) {
    int64_t r[4];
    block_ranges_w(b, B, NK, W, r);
    return (r[0] < r[1] && r[0] < t1 && r[1] > t0) || (r[2] < r[3] && r[2] < t1 && r[3] > t0);
}

// one warp per key tile; lanes test 32 blocks at a time
__global__ void tile_count_kernel(int *cnt, const dfl_block *blocks, int nblk, int B, int64_t NK, int64_t W,
                                  int ntiles) {
    int tile = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (tile >= ntiles) return;
    int64_t t0 = (int64_t)tile * BN, t1 = t0 + BN;
    int n = 0;
    for (int jb = 0; jb < nblk; jb += 32) {
        int j = jb + lane;
        bool t = j < nblk && block_touches_tile(blocks[j], B, NK, W, t0, t1);
        n += __popc(__ballot_sync(0xffffffffu, t));
    }
    if (lane == 0) cnt[tile] = n;
}

__global__ void tile_scan_kernel(int *list_off, int *chunk_off, const int *cnt, int ntiles) {
    block_scan_exclusive(list_off, ntiles, [&](int i) { return cnt[i]; });
    block_scan_exclusive(chunk_off, ntiles, [&](int i) { return (cnt[i] + CHUNK - 1) / CHUNK; });
}

// same walk as tile_count_kernel, writing block indices in block order
__global__ void tile_fill_kernel(int *list, KeyChunk *chunks, const int *cnt, const int *list_off,
                                 const int *chunk_off, const dfl_block *blocks, int nblk, int B, int64_t NK,
                                 int64_t W, int ntiles) {
    int tile = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (tile >= ntiles) return;
    int64_t t0 = (int64_t)tile * BN, t1 = t0 + BN;
    int base = list_off[tile], n = 0;
    for (int jb = 0; jb < nblk; jb += 32) {
        int j = jb + lane;
        bool t = j < nblk && block_touches_tile(blocks[j], B, NK, W, t0, t1);
        unsigned mask = __ballot_sync(0xffffffffu, t);
        if (t) list[base + n + __popc(mask & ((1u << lane) - 1u))] = j;
        n += __popc(mask);
    }
    int c = cnt[tile], nch = (c + CHUNK - 1) / CHUNK;
    for (int i = lane; i < nch; i += 32) {
        KeyChunk ch;
        ch.tile = tile;
        ch.first = base + i * CHUNK;
        ch.count = c - i * CHUNK < CHUNK ? c - i * CHUNK : CHUNK;
        chunks[chunk_off[tile] + i] = ch;
    }
}

// tile_off[j] = the tiles blocks 0..j-1 touch (the stored dS's block offsets)
__global__ void block_tiles_scan_kernel(int *tile_off, const dfl_block *blocks, int nblk, int B, int64_t NK,
                                        int64_t W) {
    block_scan_exclusive(tile_off, nblk, [&](int j) { return touched_tiles(blocks[j], B, NK, W).count(); });
}

// ---------------------------------------------------------------------------
// CUDA kernels: backward, dq

// dq = scale * acc on this thread's two rows (rows g and g+8 of its warp's
// 16, each row belonging to one CTA alone: the op writes dq, it does not
// add to it); acc in the C fragment layout
template <int D>
__device__ __forceinline__ void store_dq_rows(bf16 *dq, const float (*acc)[4], const int *row, int rows_total,
                                              int64_t tok0, int G, int hkv, int Hq, float scale) {
    const int c = threadIdx.x % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (row[h] >= rows_total) continue;
        bf16 *drow = (bf16 *)row_ptr(dq, tok0, row[h], G, hkv, Hq, D);
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            __nv_bfloat162 *p = (__nv_bfloat162 *)(drow + nd * 8 + 2 * c);
            DEV_CHECK_ALIGN(p, 4);
            *p = __floats2bfloat162_rn(scale * acc[nd][2 * h], scale * acc[nd][2 * h + 1]);
        }
    }
}

template <int D>
constexpr size_t dq_smem_bytes() { return (size_t)(2 * BM + 4 * BN) * (D + 8) * sizeof(bf16); }

// (WIN: a sliding window W > 0, as the forward's)
template <int D, bool WIN = false>
__global__ void __launch_bounds__(NTHREADS, 2)
    attn_dflash_dq_kernel(bf16 *dq, const bf16 *dout, const float *lse2p, const float *deltap, const bf16 *q,
                          const bf16 *k, const bf16 *v, const dfl_block *blocks, int nblk, int B, int64_t NK, int Hq,
                          int Hkv, int G, float scale_log2, float scale, int64_t W) {
    constexpr int SD = D + 8, ND = D / 8;
    DYN_SMEM(bf16, sQ);
    bf16 *sdO = sQ + BM * SD;
    bf16 *sK = sdO + BM * SD, *sV = sK + 2 * BN * SD; // [2][BN][SD] each
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int j = nblk - 1 - (int)blockIdx.x, hkv = blockIdx.y, r0 = blockIdx.z * BM;
    const int rows_total = B * G;
    const int64_t tok0 = (int64_t)j * B;
    int64_t rg[4];
    if constexpr (WIN) window_ranges(blocks[j], NK, W, 0, B, rg);
    else block_ranges(blocks[j], B, NK, rg);
    KeySegs segs;
    segs.init(rg[0], rg[1], rg[2], rg[3]);

    int row[2] = {r0 + warp * 16 + g, r0 + warp * 16 + g + 8};
    // the window: this thread's rows' slots, and where the context tiles
    // every row of the CTA sees whole begin (flash_fwd_cta's test)
    DflWindow win{};
    int slot[2] = {row[0] / G, row[1] / G};
    int64_t win_full = 0;
    if constexpr (WIN) {
        win.init(blocks[j], W);
        win_full = win.full_from(((r0 + BM < rows_total ? r0 + BM : rows_total) - 1) / G);
    }
    float lse2[2], dl[2];
    const int64_t sbase = ((int64_t)j * Hkv + hkv) * padded_rows(B, G);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        bool ok = row[h] < rows_total;
        lse2[h] = ok ? lse2p[sbase + row[h]] : 0.0f;
        dl[h] = ok ? deltap[sbase + row[h]] : 0.0f;
    }

    const int nt = segs.ntiles();
    load_qrows<D>(sQ, BM, q, tok0, r0, rows_total, G, hkv, Hq);
    load_qrows<D>(sdO, BM, dout, tok0, r0, rows_total, G, hkv, Hq);
    if (nt > 0) load_kv_tile<D>(sK, sV, k, v, segs, 0, 0, Hkv, hkv);
    cp_async_commit();

    float acc[ND][4];
    zero_frags<ND>(acc);

    for (int it = 0; it < nt; it++) {
        const int buf = it & 1;
        pipeline_step(it + 1 < nt, [&] { load_kv_tile<D>(sK, sV, k, v, segs, it + 1, buf ^ 1, Hkv, hkv); });
        const bf16 *kt = sK + buf * BN * SD, *vt = sV + buf * BN * SD;
        const int64_t k0 = segs.start(it);

        // S = Q K^T and dP = dO V^T, 16 rows x 64 keys each
        float s[8][4], dp[8][4];
        two_scores<8, D>(s, dp, sQ + warp * 16 * SD, sdO + warp * 16 * SD, kt, vt);
        // P = exp(S - lse) on visible keys; dS = P (dP - delta), kept in s
        // (a tile inside its segment skips the per-key tests: CTA-uniform)
        if (segs.full(it) && (!WIN || (it < segs.n0 && k0 >= win_full))) {
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float p = exp2f(s[nb][e] * scale_log2 - lse2[e >> 1]);
                    s[nb][e] = p * (dp[nb][e] - dl[e >> 1]);
                }
            }
        } else {
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int64_t key = k0 + nb * 8 + 2 * c + (e & 1);
                    const bool keep = segs.ok(it, key) && (!WIN || win.sees(slot[e >> 1], key));
                    float p = keep ? exp2f(s[nb][e] * scale_log2 - lse2[e >> 1]) : 0.0f;
                    s[nb][e] = p * (dp[nb][e] - dl[e >> 1]);
                }
            }
        }
        // acc += dS K
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t a[4];
            c_to_a(a, s[2 * kk], s[2 * kk + 1]);
            mma_tile<ND, SD, true>(acc, a, kt, kk);
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    store_dq_rows<D>(dq, acc, row, rows_total, tok0, G, hkv, Hq, scale);
}

// dq from the stored dS: CTA (block, KV head, 64 of its padded rows), one
// product a touched key tile, dq = scale dS K. A tile's dS^T slice (64
// keys x 64 rows, bf16) and its K rows arrive by cp.async, double-buffered;
// A fragments of dS come transposed out of the [key][row] slice (ldmatrix
// .trans). Keys a row does not see (outside its block's ranges, or past
// its slot's window) have dS = 0 in the store, rows past the block's B*G
// too: no masks here.
// WG: the product on wgmma, both operands from core-matrix tiles: the dS^T
// slice is dS as an M-major A, the K tile an N-major B.
constexpr int DSS = BM + 8; // row stride of a dS^T slice in shared memory

template <int D, bool WG = false>
constexpr size_t dq_ds_smem_bytes() { return (size_t)2 * BN * (WG ? D + BM : (D + 8) + DSS) * sizeof(bf16); }

// (WIN: a sliding window W > 0, whose blocks' stored tiles are the ones
// their reach under it touches)
template <int D, bool WG = false, bool WIN = false>
__global__ void __launch_bounds__(NTHREADS, 4)
    attn_dflash_dq_ds_kernel(bf16 *dq, const bf16 *ds, const int *tile_off, const bf16 *k, const dfl_block *blocks,
                             int nblk, int B, int64_t NK, int Hq, int Hkv, int G, float scale, int64_t W) {
    constexpr int SD = WG ? D : D + 8, SS = WG ? BM : DSS, ND = D / 8, CPK = BM / 8;
    DYN_SMEM(bf16, sK);                // [2][BN][SD]
    bf16 *sS = sK + 2 * BN * SD;       // [2][BN][SS]: keys x rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int j = nblk - 1 - (int)blockIdx.x, hkv = blockIdx.y, r0 = blockIdx.z * BM;
    const int rows_total = B * G, rtp = padded_rows(B, G);
    const int64_t tok0 = (int64_t)j * B;
    const TouchedTiles tt = touched_tiles(blocks[j], B, NK, WIN ? W : 0); // as the lists and tile_off
    const int nt = tt.count();
    const bf16 *dsj = ds + (int64_t)tile_off[j] * Hkv * BN * rtp + r0;

    // tile i: its K rows, and keys x rows [r0, r0+64) of its dS^T (chunk
    // `part` of key `key`; core-matrix tiles for wgmma, as load_keys_cm)
    auto issue = [&](int i, int buf) {
        const bf16 *src = dsj + ((int64_t)i * Hkv + hkv) * BN * rtp;
        if constexpr (WG) load_keys_cm<D, BN>(sK + buf * BN * SD, k, (int64_t)tt.tile(i) * BN, NK, Hkv, hkv);
        else load_keys<D>(sK + buf * BN * SD, k, (int64_t)tt.tile(i) * BN, NK, Hkv, hkv);
        for (int cc = threadIdx.x; cc < BN * CPK; cc += NTHREADS) {
            const int key = WG ? cm_row<BM>(cc) : cc / CPK, part = WG ? cm_chunk<BM>(cc) : cc % CPK;
            bf16 *dst = sS + buf * BN * SS + (WG ? cc * 8 : key * DSS + part * 8);
            cp_async16(dst, src + (int64_t)key * rtp + part * 8, true);
        }
    };
    if (nt > 0) issue(0, 0);
    cp_async_commit();

    float acc[ND][4];
    zero_frags<ND>(acc);
    for (int it = 0; it < nt; it++) {
        const int buf = it & 1;
        pipeline_step<WG>(it + 1 < nt, [&] { issue(it + 1, buf ^ 1); });
        const bf16 *kt = sK + buf * BN * SD, *st = sS + buf * BN * SS;
        if constexpr (WG) { // 16 keys a step: A = dS (M-major: the next 8 rows 128 B on, the next 8 keys BM*16)
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
                wgmma_ss<D, true>(&acc[0][0], wg_desc(st + kk * 16 * BM, BM * 16, 128),
                               wg_desc(kt + kk * 16 * D, D * 16, 128), 1);
            wg_commit();
            wg_wait<0>();
        } else {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                // A = dS[warp's 16 rows][keys kk*16 ..]: 8x8 matrix m holds keys
                // kk*16 + (m/2)*8 .., rows warp*16 + (m%2)*8 .. of the slice
                uint32_t a[4];
                const int m = lane / 8;
                ldsm_x4_t(a[0], a[1], a[2], a[3],
                          st + (kk * 16 + (m / 2) * 8 + lane % 8) * DSS + warp * 16 + (m % 2) * 8);
                mma_tile<ND, SD, true>(acc, a, kt, kk);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    const int row[2] = {r0 + warp * 16 + g, r0 + warp * 16 + g + 8};
    store_dq_rows<D>(dq, acc, row, rows_total, tok0, G, hkv, Hq, scale);
}

// ---------------------------------------------------------------------------
// CUDA kernels: backward, dk and dv

template <int D, bool WG = false, bool WIN = false>
constexpr size_t dkdv_smem_bytes() {
    return (size_t)(2 * BN + 4 * BR) * (WG ? D : D + 8) * sizeof(bf16) + 4 * BR * sizeof(float) +
           (size_t)CHUNK * ((WIN ? 7 : 5) * sizeof(int64_t) + sizeof(int));
}

// CTA (chunk, KV head): warp w owns keys tile*64 + w*16 .. +16 and
// accumulates their dK, dV over (block, BR-row step) pairs, double-buffered.
// Per step the work is 16 keys x BR rows a warp, so what a step costs
// besides its products is kept small: the chunk's block indices and key
// ranges are read once into shared memory, lse and delta arrive by cp.async
// in visiting order (padded rows have P = 0: no row test), and a thread's
// row addresses take one division by G a step (where G divides the rows
// between its chunks: D/8 threads a row, so 8 rows apart at D = 128).
// Two CTAs a multiprocessor: 255 registers, 107 KiB of shared memory.
// With ds (not NULL) it also stores each step's dS^T for the dq kernel.
//
// WG: the four products on wgmma (the CTA is one warpgroup, its 64 keys the
// M of every product): S^T and dP^T with K, V and Q, dO all from shared
// memory (core-matrix tiles), dV and dK with P^T and dS^T from registers
// and dO, Q as N-major operands. The pointwise part is the same code on the
// same fragments.
//
// WIN: a sliding window W > 0. A key's rows are no longer all or none: per
// step and key the rows that see it are those below a bound (through the
// context: slot r / G <= key - (ctx_end + 1 - W)) or from a bound on
// (through the own block: slot >= key - blk_off), two integer compares a
// score; P = 0 (so dS = 0, in the store too) on the others.
template <int D, bool WG = false, bool WIN = false>
__global__ void __launch_bounds__(NTHREADS, 2)
    attn_dflash_dkdv_kernel(float *part_dk, float *part_dv, bf16 *ds, const KeyChunk *chunks, const int *list,
                            const int *tile_off, const bf16 *dout, const float *lse2p, const float *deltap,
                            const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks, int B, int64_t NK,
                            int Hq, int Hkv, int G, float scale_log2, float scale, int64_t W) {
    constexpr int SD = WG ? D : D + 8, ND = D / 8, CPR = D / 8, NCH = BR * CPR / NTHREADS, NB = BR / 8;
    static_assert(BR * CPR % NTHREADS == 0 && BR % 16 == 0, "whole row chunks per thread");
    static_assert(!WG || (BN == 64 && NTHREADS == 128), "wgmma: the CTA is one warpgroup, M = its 64 keys");
    DYN_SMEM(bf16, sK);
    bf16 *sV = sK + BN * SD;
    bf16 *sQ = sV + BN * SD, *sdO = sQ + 2 * BR * SD; // [2][BR][SD] each
    float *sL = (float *)(sdO + 2 * BR * SD), *sDl = sL + 2 * BR; // [2][BR] each
    int64_t *sRg = (int64_t *)(sDl + 2 * BR);          // [CHUNK][4] key ranges
    int64_t *sDs = sRg + 4 * CHUNK;                    // [CHUNK] where each block's dS^T of this tile goes
    int *sJ = (int *)(sDs + CHUNK);                    // [CHUNK] block indices
    int64_t *sWn = (int64_t *)(sJ + CHUNK);            // WIN: [CHUNK][2] ctx_end + 1 - W, blk_off
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const KeyChunk ch = chunks[blockIdx.x];
    const int hkv = blockIdx.y;
    const int64_t kt0 = (int64_t)ch.tile * BN;
    const int rows_total = B * G, rtp = padded_rows(B, G), nrt = rtp / BR, total = ch.count * nrt;

    if constexpr (WG) {
        load_keys_cm<D, BN>(sK, k, kt0, NK, Hkv, hkv);
        load_keys_cm<D, BN>(sV, v, kt0, NK, Hkv, hkv);
    } else {
        load_keys<D>(sK, k, kt0, NK, Hkv, hkv);
        load_keys<D>(sV, v, kt0, NK, Hkv, hkv);
    }
    for (int i = threadIdx.x; i < ch.count; i += NTHREADS) {
        const int jj = list[ch.first + i];
        sJ[i] = jj;
        if constexpr (WIN) { // the block's reach (the ranges its list entries and stored tiles follow)
            const dfl_block b = blocks[jj];
            window_ranges(b, NK, W, 0, B, sRg + 4 * i);
            sWn[2 * i] = (int64_t)b.ctx_off + b.ctx_len + 1 - W, sWn[2 * i + 1] = b.blk_off;
        } else {
            block_ranges(blocks[jj], B, NK, sRg + 4 * i);
        }
        if (ds) {
            TouchedTiles tt;
            tt.init(sRg + 4 * i);
            sDs[i] = ((int64_t)(tile_off[jj] + tt.index(ch.tile)) * Hkv + hkv) * BN * rtp;
        }
    }
    __syncthreads(); // sJ before the first issue

    // this thread's row chunks: rows ri + n*RSTEP of a step, 16 bytes kc of each
    constexpr int RSTEP = NTHREADS / CPR;
    const int ri = threadIdx.x / CPR, kc = threadIdx.x % CPR;
    const bool g_divides = RSTEP % G == 0;
    // step `it`: block sJ[it / nrt], rows (it % nrt) * BR .. +BR
    auto issue = [&](int it, int buf) {
        const int bi = it / nrt, rr = (it % nrt) * BR, jj = sJ[bi];
        const int64_t tok0 = (int64_t)jj * B;
        bf16 *sq = sQ + buf * BR * SD, *sd = sdO + buf * BR * SD;
        if constexpr (WG) { // core-matrix tiles: chunk c of the step in shared-memory order (load_qrows_cm)
#pragma unroll
            for (int n = 0; n < NCH; n++) {
                const int c = threadIdx.x + n * NTHREADS, i = cm_row<D>(c), kk = cm_chunk<D>(c);
                const int r = rr + i;
                const bool ok = r < rows_total;
                const int64_t off = ((tok0 + r / G) * Hq + (int64_t)hkv * G + r % G) * D + kk * 8;
                cp_async16(sq + c * 8, ok ? q + off : q, ok);
                cp_async16(sd + c * 8, ok ? dout + off : dout, ok);
            }
        } else {
            const int r0 = rr + ri, p0 = r0 / G, m0 = r0 % G;
#pragma unroll
            for (int n = 0; n < NCH; n++) {
                const int r = r0 + n * RSTEP;
                const bool ok = r < rows_total;
                const int pq = g_divides ? p0 + n * (RSTEP / G) : r / G, pm = g_divides ? m0 : r % G;
                const int64_t off = ((tok0 + pq) * Hq + (int64_t)hkv * G + pm) * D + kc * 8;
                const int at = (ri + n * RSTEP) * SD + kc * 8;
                cp_async16(sq + at, ok ? q + off : q, ok);
                cp_async16(sd + at, ok ? dout + off : dout, ok);
            }
        }
        const int64_t sb = ((int64_t)jj * Hkv + hkv) * rtp + rr;
        if (threadIdx.x < BR / 4) cp_async16(sL + buf * BR + 4 * threadIdx.x, lse2p + sb + 4 * threadIdx.x, true);
        else if (threadIdx.x < BR / 2) {
            const int t = threadIdx.x - BR / 4;
            cp_async16(sDl + buf * BR + 4 * t, deltap + sb + 4 * t, true);
        }
    };
    if (total > 0) issue(0, 0);
    cp_async_commit();

    float dk[ND][4], dv[ND][4];
    zero_frags<ND>(dk);
    zero_frags<ND>(dv);
    const int64_t key[2] = {kt0 + warp * 16 + g, kt0 + warp * 16 + g + 8};

    for (int it = 0; it < total; it++) {
        const int buf = it & 1;
        pipeline_step<WG>(it + 1 < total, [&] { issue(it + 1, buf ^ 1); });
        const int64_t *rg = sRg + 4 * (it / nrt);
        bool vis[2];
        int rlo[2], rhi[2]; // WIN: the step's rows r (of the block's) that see key h: r < rlo[h] or r >= rhi[h]
        if constexpr (WIN) {
            const int64_t *wn = sWn + 2 * (it / nrt);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                // (ranges clamped to NK: key < NK in them); slots below d see
                // it through the context, d >= 1 there (min'd before the
                // product: a window past every key leaves d near W)
                const int64_t kk = key[h], rb = rtp, d = kk - wn[0] + 1, dc = d < rb ? d : rb;
                const int64_t lo = kk >= rg[0] && kk < rg[1] ? dc * G : 0;
                rlo[h] = (int)(lo < rb ? lo : rb) - (it % nrt) * BR;
                rhi[h] = kk >= rg[2] && kk < rg[3] ? (int)((kk - wn[1]) * G) - (it % nrt) * BR : INT32_MAX;
                vis[h] = false;
            }
        } else {
            vis[0] = key[0] < NK && sees(rg, key[0]), vis[1] = key[1] < NK && sees(rg, key[1]);
            rlo[0] = rlo[1] = rhi[0] = rhi[1] = 0;
        }
        const bf16 *qt = sQ + buf * BR * SD, *ot = sdO + buf * BR * SD;
        const float *lt = sL + buf * BR, *dt = sDl + buf * BR;

        // S^T = K Q^T and dP^T = V dO^T: this warp's 16 K and V rows against the step's BR rows
        float st[NB][4], dpt[NB][4];
        if constexpr (WG) { // M = the 64 keys, N = the step's rows, 16 columns a step
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) {
                wgmma_ss<BR>(&st[0][0], wg_desc(sK + ks * 128, 128, D * 16), wg_desc(qt + ks * 128, 128, D * 16),
                             ks);
                wgmma_ss<BR>(&dpt[0][0], wg_desc(sV + ks * 128, 128, D * 16), wg_desc(ot + ks * 128, 128, D * 16),
                             ks);
            }
            wg_commit();
            wg_wait<0>();
        } else {
            two_scores<NB, D>(st, dpt, sK + warp * 16 * SD, sV + warp * 16 * SD, qt, ot);
        }
        // P^T on visible keys (padded rows: lse +inf, P 0); dS^T = P^T (dP^T - delta) into dpt
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = nb * 8 + 2 * c + (e & 1);
                float p = exp2f(st[nb][e] * scale_log2 - lt[col]);
                if constexpr (WIN) p = col < rlo[e >> 1] || col >= rhi[e >> 1] ? p : 0.0f;
                else p = vis[e >> 1] ? p : 0.0f;
                st[nb][e] = p;
                dpt[nb][e] = p * (dpt[nb][e] - dt[col]);
            }
        }
        if (ds) { // dS^T[key][row] of this step, as the products below round it
            bf16 *dst = ds + sDs[it / nrt] + (it % nrt) * BR;
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    uint32_t *p = (uint32_t *)(dst + (warp * 16 + g + 8 * h) * rtp + nb * 8 + 2 * c);
                    DEV_CHECK_ALIGN(p, 4);
                    *p = pack_bf16(dpt[nb][2 * h], dpt[nb][2 * h + 1]);
                }
        }
        // dV += P^T dO, dK += dS^T Q
        if constexpr (WG) { // P^T and dS^T from registers, dO and Q as N-major Bs, 16 rows a step
            wg_product_rs<D, NB / 2>(&dv[0][0], st, ot);
            wg_product_rs<D, NB / 2>(&dk[0][0], dpt, qt);
            wg_commit();
            wg_wait<0>();
        } else {
#pragma unroll
            for (int kk = 0; kk < NB / 2; kk++) {
                uint32_t ap[4], ad[4];
                c_to_a(ap, st[2 * kk], st[2 * kk + 1]);
                c_to_a(ad, dpt[2 * kk], dpt[2 * kk + 1]);
                mma_tile<ND, SD, true>(dv, ap, ot, kk);
                mma_tile<ND, SD, true>(dk, ad, qt, kk);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    // this chunk's partial [BN][D] for this KV head
    const int64_t pbase = ((int64_t)blockIdx.x * Hkv + hkv) * BN * D;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int kr = warp * 16 + g + 8 * h;
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
            int64_t o = pbase + (int64_t)kr * D + nd * 8 + 2 * c;
            DEV_CHECK_ALIGN(part_dk + o, 8);
            *(float2 *)(part_dk + o) = make_float2(scale * dk[nd][2 * h], scale * dk[nd][2 * h + 1]);
            *(float2 *)(part_dv + o) = make_float2(dv[nd][2 * h], dv[nd][2 * h + 1]);
        }
    }
}

// dk, dv = the sum of each tile's chunk partials, in chunk order; zeros
// for keys no block sees (tiles without chunks). A thread sums 4 adjacent
// elements (16-byte loads of the partials, an 8-byte store), each in the
// order one thread per element would add it, and unrolls the chunks so that
// several partials' loads are in flight at once. The partials' bytes should
// bound it; a 4-byte load per element and chunk left it latency-bound (222
// us a layer at the training benchmark's shape, against ~90 us of bytes).
__global__ void dkdv_reduce_kernel(bf16 *dk, bf16 *dv, const float *part_dk, const float *part_dv, const int *chunk_off,
                                   int Hkv, int64_t NK, int D) {
    const int tile = blockIdx.x, hkv = blockIdx.y;
    const int c0 = chunk_off[tile], c1 = chunk_off[tile + 1];
    const int64_t next = (int64_t)Hkv * BN * D / 4; // float4s from one chunk's partial to the next
    for (int idx = 4 * threadIdx.x; idx < BN * D; idx += 4 * blockDim.x) {
        const int64_t key = (int64_t)tile * BN + idx / D;
        if (key >= NK) break;
        float sk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (c1 > c0) {
            const int64_t first = (((int64_t)c0 * Hkv + hkv) * BN * D + idx) / 4;
            const float4 *pk = (const float4 *)part_dk + first, *pv = (const float4 *)part_dv + first;
            DEV_CHECK_ALIGN(pk, 16);
#pragma unroll 4
            for (int ci = 0; ci < c1 - c0; ci++) {
                const float4 a = pk[ci * next], b = pv[ci * next];
                sk[0] += a.x, sk[1] += a.y, sk[2] += a.z, sk[3] += a.w;
                sv[0] += b.x, sv[1] += b.y, sv[2] += b.z, sv[3] += b.w;
            }
        }
        const int64_t o = (key * Hkv + hkv) * D + idx % D;
        if (dk) store_bf16s<4>(dk + o, sk);
        if (dv) store_bf16s<4>(dv + o, sv);
    }
}

// ---------------------------------------------------------------------------
// kernel launchers

void attn::launch_delta(float *delta, const bf16 *dout, const bf16 *out, int64_t n, int D) {
    if (n == 0) return;
    KLAUNCH(delta_kernel, (unsigned)CEIL_DIV(n * 32, (int64_t)256), 256, 0)(delta, dout, out, n, D);
    LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// The key-tile lists of the backward, and the counts a forward keeps for it
//
// Sizing the lists, the dk/dv partials and the stored dS, and the dk/dv
// grid, needs two totals on the host. Counting on the device and reading
// them back drains the stream and leaves the GPU idle while the host waits
// and refills it (~0.13 ms a layer at the training benchmark's shape). So a
// forward that saves lse (training: its backward follows) also counts its
// blocks' key tiles and copies the totals to pinned host memory behind an
// event, without waiting. The backward given that lse, the same blocks
// pointer and the same shape finds them, waits on the event (complete long
// since: the LM head and the later layers ran in between) and fills the
// lists without stopping the stream. Otherwise (no forward seen for that
// lse, its slot reused since, another blocks pointer or shape) it counts and
// waits itself. lse ties the two calls: it is only valid for the blocks the
// forward saw, so a backward over other block contents would be wrong with
// or without the kept counts.

// cnt, list_off and chunk_off in small (tile_lists_small_ints ints); the
// totals list_off[ntiles], chunk_off[ntiles] copied to tot[0], tot[1] (host)
// in stream order, not waited for. ntiles > 0.
static void count_tiles(int *small, int *tot, const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                        int64_t W) {
    const int ntiles = (int)CEIL_DIV(NK, (int64_t)BN);
    int *cnt = small, *list_off = small + ntiles, *chunk_off = small + 2 * ntiles + 1;
    KLAUNCH(tile_count_kernel, (unsigned)CEIL_DIV((int64_t)ntiles * 32, (int64_t)256), 256, 0)(cnt, blocks, (int)nblk,
                                                                                             (int)B, NK, W, ntiles);
    LAUNCH_CHECK();
    KLAUNCH(tile_scan_kernel, 1, 1024, 0)(list_off, chunk_off, cnt, ntiles);
    LAUNCH_CHECK();
    cudaCheck(cudaMemcpyAsync(&tot[0], list_off + ntiles, sizeof(int), cudaMemcpyDeviceToHost, g_cuda.stream));
    cudaCheck(cudaMemcpyAsync(&tot[1], chunk_off + ntiles, sizeof(int), cudaMemcpyDeviceToHost, g_cuda.stream));
}

// *tl from counts in small and their totals on the host: the lists in
// SCRATCH_LISTS, filled on the device.
static void fill_tile_lists(TileLists *tl, int *small, const int *tot, const dfl_block *blocks, int64_t nblk,
                            int64_t B, int64_t NK, int64_t W) {
    const int ntiles = tl->ntiles;
    tl->small = small;
    tl->cnt = small;
    tl->list_off = small + ntiles;
    tl->chunk_off = small + 2 * ntiles + 1;
    tl->nlist = tot[0];
    tl->nchunks = tot[1];
    size_t list_bytes = ((size_t)tl->nlist * sizeof(int) + 15) / 16 * 16;
    size_t chunk_bytes = ((size_t)tl->nchunks * sizeof(KeyChunk) + 15) / 16 * 16;
    char *mem = (char *)cuda_scratch(SCRATCH_LISTS, list_bytes + chunk_bytes + (size_t)(nblk + 1) * sizeof(int));
    tl->list = (int *)mem;
    tl->chunks = (KeyChunk *)(mem + list_bytes);
    tl->tile_off = (int *)(mem + list_bytes + chunk_bytes);
    KLAUNCH(tile_fill_kernel, (unsigned)CEIL_DIV((int64_t)ntiles * 32, (int64_t)256), 256, 0)(
        tl->list, tl->chunks, tl->cnt, tl->list_off, tl->chunk_off, blocks, (int)nblk, (int)B, NK, W, ntiles);
    LAUNCH_CHECK();
    KLAUNCH(block_tiles_scan_kernel, 1, 1024, 0)(tl->tile_off, blocks, (int)nblk, (int)B, NK, W);
    LAUNCH_CHECK();
}

// A forward's counts: its key (the window too: it cuts the lists), device
// counts (scratch slot SCRATCH_TILE_COUNTS + its index), pinned totals and
// their event.
struct KeptCounts {
    const float *lse;
    const dfl_block *blocks;
    int64_t nblk, B, NK, W;
    int *small, *tot;
    cudaEvent_t ready;
    uint64_t used; // 0: empty; else when it was last written or read
};
static KeptCounts g_kept[TILE_COUNT_SLOTS];
static uint64_t g_kept_clock;

static bool kept_for(const KeptCounts &e, const float *lse, const dfl_block *blocks, int64_t nblk, int64_t B,
                     int64_t NK, int64_t W) {
    return e.used && e.lse == lse && e.blocks == blocks && e.nblk == nblk && e.B == B && e.NK == NK && e.W == W;
}

// The forward's part: count into the slot of this lse (or the least
// recently used one), the totals behind an event.
static void keep_tile_counts(const float *lse, const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                             int64_t W) {
    int slot = 0;
    for (int i = 0; i < TILE_COUNT_SLOTS; i++) {
        if (g_kept[i].used && g_kept[i].lse == lse) {
            slot = i;
            break;
        }
        if (g_kept[i].used < g_kept[slot].used) slot = i;
    }
    KeptCounts &e = g_kept[slot];
    if (!e.tot) {
        cudaCheck(cudaMallocHost((void **)&e.tot, 2 * sizeof(int)));
        cudaCheck(cudaEventCreateWithFlags(&e.ready, cudaEventDisableTiming));
    }
    e.small = (int *)cuda_scratch(SCRATCH_TILE_COUNTS + slot, tile_lists_small_ints(NK) * sizeof(int));
    count_tiles(e.small, e.tot, blocks, nblk, B, NK, W);
    cudaCheck(cudaEventRecord(e.ready, g_cuda.stream));
    e.lse = lse, e.blocks = blocks, e.nblk = nblk, e.B = B, e.NK = NK, e.W = W;
    e.used = ++g_kept_clock;
}

// The backward's part: *tl from the counts a forward kept for this lse, or
// counted now into small (tile_lists_small_ints ints of the caller's
// scratch) with the stream drained to read their totals.
static void build_tile_lists(TileLists *tl, int *small, const float *lse, const dfl_block *blocks, int64_t nblk,
                             int64_t B, int64_t NK, int64_t W) {
    memset(tl, 0, sizeof *tl);
    tl->ntiles = (int)CEIL_DIV(NK, (int64_t)BN);
    if (tl->ntiles == 0) return;
    for (int i = 0; i < TILE_COUNT_SLOTS; i++) {
        KeptCounts &e = g_kept[i];
        if (!kept_for(e, lse, blocks, nblk, B, NK, W)) continue;
        cudaCheck(cudaEventSynchronize(e.ready));
        e.used = ++g_kept_clock;
        fill_tile_lists(tl, e.small, e.tot, blocks, nblk, B, NK, W);
        return;
    }
    int tot[2];
    count_tiles(small, tot, blocks, nblk, B, NK, W);
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
    fill_tile_lists(tl, small, tot, blocks, nblk, B, NK, W);
}

// (W > 0: the window's kernels)
template <int D, bool WG = false, bool PIPE = false>
static void launch_fwd(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks,
                       int64_t nblk, int B, int64_t NK, int Hq, int Hkv, int64_t W) {
    int G = Hq / Hkv;
    size_t smem = WG ? fwd_wg_smem_bytes<D, BM, PIPE>() : fwd_smem_bytes<D>();
    const bool win = W > 0;
    auto kernel = win ? attn_dflash_kernel<D, true> : attn_dflash_kernel<D>;
    if constexpr (WG) kernel = win ? attn_dflash_wg_kernel<D, PIPE, true> : attn_dflash_wg_kernel<D, PIPE>;
    static int once[2];
    if (!once[win]) allow_smem(kernel, smem), once[win] = 1;
    dim3 grid((unsigned)nblk, (unsigned)Hkv, (unsigned)CEIL_DIV(B * G, BM));
    KLAUNCH(kernel, grid, NTHREADS, smem)(out, lse, q, k, v, blocks, (int)nblk, B, NK, Hq, Hkv, G,
                                          LOG2E / sqrtf((float)D), W);
    LAUNCH_CHECK();
}

// lse may be NULL when no backward pass follows (scoring).
void cuda_attn_dflash(void *out, float *lse, const void *q, const void *k, const void *v, const dfl_block *blocks,
                      int64_t nblk, int64_t B, int64_t NK, int64_t Hq, int64_t Hkv, int64_t D, int64_t window) {
    CU_ASSERT(out && q && k && v && blocks && nblk >= 0 && B > 0 && NK >= 0 && window >= 0);
    CU_ASSERT(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && Hkv <= 65535);
    CU_ASSERT(nblk * B * Hq <= INT32_MAX && B * (Hq / Hkv) <= INT32_MAX && CEIL_DIV(B * (Hq / Hkv), BM) <= 65535);
    if (nblk == 0) return;
    bf16 *o = (bf16 *)out;
    const bf16 *qq = (const bf16 *)q, *kk = (const bf16 *)k, *vv = (const bf16 *)v;
    int aligned = is_aligned(o, 16) && is_aligned(qq, 16) && is_aligned(kk, 16) && is_aligned(vv, 16);
    const int64_t W = window;
    if (!g_cuda.simple && aligned && use_wgmma(D)) {
        const bool pipe = wgmma_pipe();
        if (D == 128 && pipe) launch_fwd<128, true, true>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
        else if (D == 128) launch_fwd<128, true>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
        else if (pipe) launch_fwd<64, true, true>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
        else launch_fwd<64, true>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
    } else if (!g_cuda.simple && aligned && D == 128) launch_fwd<128>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
    else if (!g_cuda.simple && aligned && D == 256) launch_fwd<256>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
    else if (!g_cuda.simple && aligned && D == 64) launch_fwd<64>(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, W);
    else simple_attn_dflash(o, lse, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, (int)D, W);
    // saving lse means a backward follows: count its key tiles now, unwaited
    if (lse && NK > 0 && CEIL_DIV(NK, (int64_t)BN) < INT32_MAX / 4) keep_tile_counts(lse, blocks, nblk, B, NK, window);
}

// DFLASH_CUDA_DS_MAX_MB: the most bytes the stored dS may take (read at
// every call, so a test can run both dq kernels in one process).
static size_t ds_max_bytes(void) {
    const char *s = getenv("DFLASH_CUDA_DS_MAX_MB");
    long long mb = s && *s ? atoll(s) : 4096;
    return mb > 0 ? (size_t)mb << 20 : 0;
}

// The fast backward: lse and delta in visiting order (row_stats_kernel),
// then the dk/dv partials (storing dS) and their reduction, and dq (from
// dS, or recomputing). WIN: under the sliding window W > 0.
template <int D, bool WIN = false>
static void launch_bwd(bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *out, const float *lse,
                       const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks, const TileLists *tl,
                       float *stats, int64_t nblk, int B, int64_t NK, int Hq, int Hkv, int64_t W) {
    const int G = Hq / Hkv, rtp = padded_rows(B, G);
    const float scale = 1.0f / sqrtf((float)D), scale_log2 = LOG2E * scale;
    const int64_t n = nblk * Hkv * rtp;
    float *lse2p = stats, *deltap = stats + n;
    {
        cuda_prof_scope ps("k attn_dflash_bwd: row statistics");
        CU_ASSERT(n <= INT32_MAX - 256); // the int row index of a last block past n too
        KLAUNCH(row_stats_kernel<D>, (unsigned)CEIL_DIV(n * 32, (int64_t)256), 256, 0)(lse2p, deltap, lse, dout, out,
                                                                                     (int)n, rtp, B, G, Hq, Hkv);
        LAUNCH_CHECK();
    }
    // dq from the stored dS when dk/dv run and the store fits (see the top)
    const size_t ds_bytes = tl ? (size_t)tl->nlist * Hkv * BN * rtp * sizeof(bf16) : 0;
    bf16 *ds = dq && tl && tl->nchunks > 0 && ds_bytes <= ds_max_bytes()
                   ? (bf16 *)cuda_scratch_try(SCRATCH_DS, ds_bytes) // no memory for it: recompute instead
                   : NULL;
    if (dq && !ds) {
        cuda_prof_scope ps("k attn_dflash_bwd: dq (recomputing S, dP)");
        size_t smem = dq_smem_bytes<D>();
        auto kernel = attn_dflash_dq_kernel<D, WIN>;
        static int once = 0;
        if (!once) allow_smem(kernel, smem), once = 1;
        dim3 grid((unsigned)nblk, (unsigned)Hkv, (unsigned)CEIL_DIV(B * G, BM));
        KLAUNCH(kernel, grid, NTHREADS, smem)(dq, dout, lse2p, deltap, q, k, v, blocks, (int)nblk, B, NK, Hq, Hkv, G,
                                              scale_log2, scale, W);
        LAUNCH_CHECK();
    }
    if (tl && tl->ntiles > 0) {
        size_t part_elems = (size_t)tl->nchunks * Hkv * BN * D;
        float *part = NULL;
        if (tl->nchunks > 0) {
            part = (float *)cuda_scratch(SCRATCH_PART, 2 * part_elems * sizeof(float));
            const bool wg = use_wgmma(D) != 0;
            size_t smem = wg ? dkdv_smem_bytes<D, true, WIN>() : dkdv_smem_bytes<D, false, WIN>();
            auto kernel = wg ? attn_dflash_dkdv_kernel<D, true, WIN> : attn_dflash_dkdv_kernel<D, false, WIN>;
            static int once[2];
            if (!once[wg]) allow_smem(kernel, smem), once[wg] = 1;
            dim3 grid((unsigned)tl->nchunks, (unsigned)Hkv);
            cuda_prof_scope ps(wg ? "k attn_dflash_bwd: dk dv partials (wgmma)" : "k attn_dflash_bwd: dk dv partials");
            KLAUNCH(kernel, grid, NTHREADS, smem)(
                part, part + part_elems, ds, tl->chunks, tl->list, tl->tile_off, dout, lse2p, deltap, q, k, v, blocks,
                B, NK, Hq, Hkv, G, scale_log2, scale, W);
            LAUNCH_CHECK();
        }
        // also when no block sees a key: the reduction writes the zeros then
        cuda_prof_scope ps("k attn_dflash_bwd: dk dv reduce");
        KLAUNCH(dkdv_reduce_kernel, dim3((unsigned)tl->ntiles, (unsigned)Hkv), 256, 0)(
            dk, dv, part, part ? part + part_elems : NULL, tl->chunk_off, Hkv, NK, D);
        LAUNCH_CHECK();
    }
    if (ds) {
        const bool wg = use_wgmma(D) != 0;
        cuda_prof_scope ps(wg ? "k attn_dflash_bwd: dq from dS (wgmma)" : "k attn_dflash_bwd: dq from dS");
        size_t smem = wg ? dq_ds_smem_bytes<D, true>() : dq_ds_smem_bytes<D>();
        auto kernel = wg ? attn_dflash_dq_ds_kernel<D, true, WIN> : attn_dflash_dq_ds_kernel<D, false, WIN>;
        static int once[2];
        if (!once[wg]) allow_smem(kernel, smem), once[wg] = 1;
        dim3 grid((unsigned)nblk, (unsigned)Hkv, (unsigned)(rtp / BM));
        KLAUNCH(kernel, grid, NTHREADS, smem)(dq, ds, tl->tile_off, k, blocks, (int)nblk, B, NK, Hq, Hkv, G, scale,
                                              W);
        LAUNCH_CHECK();
    }
}

void cuda_attn_dflash_bwd(void *dq, void *dk, void *dv, const void *dout, const void *out, const float *lse,
                          const void *q, const void *k, const void *v, const dfl_block *blocks, int64_t nblk,
                          int64_t B, int64_t NK, int64_t Hq, int64_t Hkv, int64_t D, int64_t window) {
    CU_ASSERT(dout && out && lse && q && k && v && blocks && nblk >= 0 && B > 0 && NK >= 0 && window >= 0);
    CU_ASSERT(Hq > 0 && Hkv > 0 && Hq % Hkv == 0 && D > 0 && Hkv <= 65535);
    CU_ASSERT(nblk * B * Hq <= INT32_MAX && B * (Hq / Hkv) <= INT32_MAX - BR && CEIL_DIV(B * (Hq / Hkv), BM) <= 65535);
    CU_ASSERT(CEIL_DIV(NK, (int64_t)BN) < INT32_MAX / 4);
    if (!dq && !dk && !dv) return;
    if (nblk == 0) { // no queries: no key is seen, and the op writes its gradients
        const size_t kv_bytes = (size_t)(NK * Hkv * D) * sizeof(bf16);
        if (dk && kv_bytes) cudaCheck(cudaMemsetAsync(dk, 0, kv_bytes, g_cuda.stream));
        if (dv && kv_bytes) cudaCheck(cudaMemsetAsync(dv, 0, kv_bytes, g_cuda.stream));
        return;
    }
    bf16 *gq = (bf16 *)dq, *gk = (bf16 *)dk, *gv = (bf16 *)dv;
    const bf16 *go = (const bf16 *)dout, *oo = (const bf16 *)out, *qq = (const bf16 *)q, *kk = (const bf16 *)k,
               *vv = (const bf16 *)v;
    int aligned = is_aligned(gq, 16) && is_aligned(gk, 16) && is_aligned(gv, 16) && is_aligned(go, 16) &&
                  is_aligned(qq, 16) && is_aligned(kk, 16) && is_aligned(vv, 16);
    const int fast = !g_cuda.simple && aligned && (D == 128 || D == 64);
    const int want_kv = dk || dv;
    // scratch: the row statistics (fast: lse2 and delta in visiting order,
    // padded; simple: delta per row), then the small tile-list arrays
    const int64_t nstat = fast ? 2 * nblk * Hkv * padded_rows((int)B, (int)(Hq / Hkv)) : nblk * B * Hq;
    const size_t sbytes = ((size_t)nstat * sizeof(float) + 15) / 16 * 16;
    char *mem = (char *)cuda_scratch(SCRATCH_OP, sbytes + (want_kv ? tile_lists_small_ints(NK) * sizeof(int) : 0));
    float *stats = (float *)mem;
    TileLists tl;
    if (want_kv) {
        cuda_prof_scope ps("k attn_dflash_bwd: key tile lists");
        build_tile_lists(&tl, (int *)(mem + sbytes), lse, blocks, nblk, B, NK, window);
    }
    const TileLists *tlp = want_kv ? &tl : NULL;
    const int64_t W = window;
    if (fast && D == 128 && W > 0)
        launch_bwd<128, true>(gq, gk, gv, go, oo, lse, qq, kk, vv, blocks, tlp, stats, nblk, (int)B, NK, (int)Hq,
                              (int)Hkv, W);
    else if (fast && D == 128)
        launch_bwd<128>(gq, gk, gv, go, oo, lse, qq, kk, vv, blocks, tlp, stats, nblk, (int)B, NK, (int)Hq, (int)Hkv, 0);
    else if (fast && W > 0)
        launch_bwd<64, true>(gq, gk, gv, go, oo, lse, qq, kk, vv, blocks, tlp, stats, nblk, (int)B, NK, (int)Hq,
                             (int)Hkv, W);
    else if (fast)
        launch_bwd<64>(gq, gk, gv, go, oo, lse, qq, kk, vv, blocks, tlp, stats, nblk, (int)B, NK, (int)Hq, (int)Hkv, 0);
    else {
        launch_delta(stats, go, oo, nblk * B * Hq, (int)D);
        if (gq)
            simple_attn_dflash_dq(gq, go, lse, stats, qq, kk, vv, blocks, nblk, (int)B, NK, (int)Hq, (int)Hkv, (int)D,
                                  window);
        if (tlp)
            simple_attn_dflash_dkdv(gk, gv, go, lse, stats, qq, kk, vv, blocks, tlp, (int)B, NK, (int)Hq, (int)Hkv,
                                    (int)D, window);
    }
}
