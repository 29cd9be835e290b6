// attention.cuh: what the attention kernels share: tensor-core primitives
// (mma.sync m16n8k16 bf16 with f32 accumulation, ldmatrix, cp.async), the
// flash-attention forward CTA used by both the causal and the DFlash
// forward, the key-tile lists of the DFlash backward, and the launchers of
// the simple reference kernels (attn_simple.cu).
//
// Row tiles. Every kernel works on the query rows that share one KV head:
// with G = Hq/Hkv, the rows of a CTA are a range of the flattened index
// r = p*G + g over (position p, head-in-group g), so the row is token tok0+p,
// query head hkv*G + g. All of them see the same keys (DFlash: the block's
// context and its own block; causal: a prefix, masked per row), so one K/V
// tile in shared memory serves 64 rows of up to G heads (GQA sharing).
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16", bf16):
// lane = 4*g + c (g = lane/4 "group", c = lane%4);
//   A 16x16: a0 (row g, cols 2c..2c+1), a1 (row g+8, same), a2 (row g,
//            cols 2c+8..), a3 (row g+8, cols 2c+8..)
//   B 16x8:  b0 (k rows 2c..2c+1, col g), b1 (k rows 2c+8.., col g)
//   C 16x8:  c0,c1 (row g, cols 2c, 2c+1), c2,c3 (row g+8, same cols)
// ldmatrix.x4 gives lane L the pair (row L/4, cols 2(L%4)..) of each of four
// 8x8 matrices whose row addresses lanes 8m..8m+7 supply; with .trans the
// pair is (rows 2(L%4).., col L/4). So a row-major [rows][dims] tile gives
// A fragments (untransposed), B = tile^T fragments (untransposed: S = Q K^T
// reads K this way) and B = tile fragments (.trans: O = P V reads V so).
#ifndef DFLASH_KERNELS_ATTENTION_CUH
#define DFLASH_KERNELS_ATTENTION_CUH

#include "common.cuh"

#include <math.h>
#include <string.h>

namespace attn {

constexpr int BM = 64;        // query rows per CTA (4 warps x 16)
constexpr int BN = 64;        // keys per tile
constexpr int NTHREADS = 128; // 4 warps
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------
// primitives

#ifdef DFLASH_EMU
// tests/emu: ldmatrix and mma by the fragment layouts; cp.async deferred to
// its wait_group (so a read before the wait sees stale bytes) and checked,
// with ldmatrix, by the emulation's shared-memory race detector.
__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const bf16 *p) {
    emu::ldmatrix_x4(r0, r1, r2, r3, p, false);
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const bf16 *p) {
    emu::ldmatrix_x4(r0, r1, r2, r3, p, true);
}
__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    emu::mma_m16n8k16(c, a, b0, b1);
}
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    emu::cp_async16(smem, gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
#else
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

// c += a · b   (16x16 bf16 · 16x8 bf16 -> 16x8 f32)
__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte global -> shared copy; !valid writes 16 zero bytes instead (the
// source is not read, but must be a mapped address: pass any valid one).
// Both addresses 16-byte aligned. The "memory" clobbers keep the compiler
// from moving ordinary shared-memory accesses across the issue and the
// wait (the asm statements are otherwise opaque to it).
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#endif

// ---------------------------------------------------------------------------
// Hopper warpgroup products (wgmma.mma_async, sm_90a only): the 4 warps of a
// warpgroup multiply 64 rows at once, B (and A, where it is a shared tile)
// read by the tensor cores straight from shared memory through a descriptor:
// a K/V tile crosses the shared-memory port once per warpgroup, where
// mma.sync's ldmatrix moves it once per warp. The accumulator and register A
// layouts are mma.sync's, warp w of the group on rows 16w.. (PTX ISA,
// "Matrix Fragments for wgmma.mma_async.m64nNk16").
//
// Tiles for wgmma use the no-swizzle "core matrix" layout: 8 rows of 16
// bytes contiguous (128 B), core matrices of a row group in chunk order,
// row groups one after another: [row/8][D/8][row%8][8] for D-wide rows.
// One layout serves both operand kinds (PTX ISA, "Shared Memory Matrix
// Layout", canonical layouts): K-major (S = Q K^T's A = Q and B = K^T:
// leading byte offset 128 = the next 8 columns, stride byte offset D*16 =
// the next 8 rows) and N-major (O = P V's B = V: the same tile with the
// roles swapped, leading offset D*16 = the next 8 keys, stride offset 128 =
// the next 8 columns).

// the element offset of 16-byte chunk ch of row r in such a tile
template <int D>
__device__ __forceinline__ int cm_off(int r, int ch) { return (r / 8) * (D / 8) * 64 + ch * 64 + (r % 8) * 8; }
// the inverse: the c-th 16-byte chunk of such a tile in shared-memory order
// is chunk cm_chunk(c) of row cm_row(c) (cm_off(cm_row(c), cm_chunk(c)) == 8c)
template <int D>
__device__ __forceinline__ int cm_row(int c) { return c / D * 8 + c % 8; }
template <int D>
__device__ __forceinline__ int cm_chunk(int c) { return c / 8 % (D / 8); }

#ifdef DFLASH_EMU
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return emu::smem_addr(p); }
template <int N, bool TRANS = false>
__device__ __forceinline__ void wgmma_ss(float *d, uint64_t da, uint64_t db, int scale_d) {
    emu::wgmma_m64k16(d, N, NULL, da, db, TRANS, TRANS, scale_d != 0);
}
template <int N>
__device__ __forceinline__ void wgmma_rs_t(float *d, const uint32_t *a, uint64_t db, int scale_d) {
    emu::wgmma_m64k16(d, N, a, 0, db, false, true, scale_d != 0);
}
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_commit() { emu::wgmma_commit(); }
template <int N>
__device__ __forceinline__ void wg_wait() { emu::wgmma_wait(N); }
__device__ __forceinline__ void fence_proxy_async() { emu::fence_proxy_async(); }
#else
// the sm_90a pass of nvcc defines this; the compute_90 PTX pass cannot
// assemble wgmma (the launchers use these kernels only on a 9.0 device)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ARCH 1
#endif
// The accumulator operands of an m64nNk16 wgmma: N/2 f32 registers, %0.. in
// the instruction text, d[0..] as asm operands.
#define WG_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_ACC64(d) \
    WG_ACC32(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// d[N/2] (+)= A · B (N = 64 or 128; scale_d 0: d = A · B), A the 64 x 16
// tile of descriptor da, B the 16 x N tile of db: K-major both (A = Q, B^T =
// K: S = Q K^T), or with TRANS M-major A and N-major B (dS^T and K: dQ).
template <int N, bool TRANS = false>
__device__ __forceinline__ void wgmma_ss(float *d, uint64_t da, uint64_t db, int scale_d) {
#ifdef WG_ARCH
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, "
                     "%32, %33, p, 1, 1, %35, %35;\n}\n"
                     : WG_ACC32(d)
                     : "l"(da), "l"(db), "r"(scale_d), "n"((int)TRANS));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, "
                     "%64, %65, p, 1, 1, %67, %67;\n}\n"
                     : WG_ACC64(d)
                     : "l"(da), "l"(db), "r"(scale_d), "n"((int)TRANS));
#else
    __trap();
#endif
}
// d[N/2] (+)= A · B, A = this thread's 4 registers, B = the 16 x N tile of db
// (N-major: V, dO, Q in P V, P^T dO, dS^T Q)
template <int N>
__device__ __forceinline__ void wgmma_rs_t(float *d, const uint32_t *a, uint64_t db, int scale_d) {
#ifdef WG_ARCH
    if constexpr (N == 64)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                     : WG_ACC32(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, "
                     "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : WG_ACC64(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
#else
    __trap();
#endif
}
// before a warpgroup's first wgmma after its registers were written
__device__ __forceinline__ void wg_fence() {
#ifdef WG_ARCH
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#ifdef WG_ARCH
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// every committed wgmma of this warpgroup but the N most recent groups done
// (their registers may be read, their shared-memory operands overwritten)
template <int N>
__device__ __forceinline__ void wg_wait() {
#ifdef WG_ARCH
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// shared memory written by this thread (cp.async) made visible to the async
// proxy that wgmma reads it through; then a barrier for the other threads
__device__ __forceinline__ void fence_proxy_async() {
#ifdef WG_ARCH
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
#endif

// A descriptor of a tile at p (16-byte aligned, in shared memory), no
// swizzle, with the given leading and stride byte offsets.
__device__ __forceinline__ uint64_t wg_desc(const bf16 *p, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((smem_u32(p) & 0x3ffff) >> 4) | (uint64_t)((lbo & 0x3ffff) >> 4) << 16 |
           (uint64_t)((sbo & 0x3ffff) >> 4) << 32;
}

// two f32 -> one register of two bf16 (the lower column in the low half)
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

// The accumulator of a 16x16 tile (two 16x8 C fragments) as an A fragment.
__device__ __forceinline__ void c_to_a(uint32_t *a, const float *c0, const float *c1) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}

// acc[D/2] += A · T, A = this warpgroup's 64 x 16*NK2 bf16 A fragments a,
// T as in wg_product_rs. Issued, not committed; the caller fences first.
template <int D, int NK2>
__device__ __forceinline__ void wg_product_ra(float *acc, const uint32_t (*a)[4], const bf16 *t) {
#pragma unroll
    for (int kk = 0; kk < NK2; kk++) wgmma_rs_t<D>(acc, a[kk], wg_desc(t + kk * 16 * D, D * 16, 128), 1);
}

// acc[D/2] += P · T over 16*NK2 rows of T: P = this warpgroup's 64 x 16*NK2
// accumulator fragments p (NK2 pairs of 8-column blocks, rounded to bf16 as
// A fragments, all converted before the first product reads them), T the
// core-matrix tile t (16*NK2 rows of D) as an N-major B. Issued, not
// committed: the caller commits and waits.
template <int D, int NK2>
__device__ __forceinline__ void wg_product_rs(float *acc, const float (*p)[4], const bf16 *t) {
    uint32_t a[NK2][4];
#pragma unroll
    for (int kk = 0; kk < NK2; kk++) c_to_a(a[kk], p[2 * kk], p[2 * kk + 1]);
    wg_fence();
    wg_product_ra<D, NK2>(acc, a, t);
}

// a if A, else b (two arrays of one shape, or not)
template <bool A, typename X, typename Y>
__device__ __forceinline__ auto &select_ref(X &a, Y &b) {
    if constexpr (A) return a;
    else return b;
}

// n accumulator fragments times their rows' factors (alpha[0]: rows g,
// alpha[1]: rows g+8)
template <int N>
__device__ __forceinline__ void rescale_frags(float (*c)[4], const float *alpha) {
#pragma unroll
    for (int i = 0; i < N; i++) c[i][0] *= alpha[0], c[i][1] *= alpha[0], c[i][2] *= alpha[1], c[i][3] *= alpha[1];
}

// n accumulator fragments set to zero
template <int N>
__device__ __forceinline__ void zero_frags(float (*c)[4]) {
#pragma unroll
    for (int i = 0; i < N; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
}

// The A fragment of a warp's 16 rows, columns [ks*16, ks*16+16), of a
// row-major shared tile with row stride SD (rows16: the warp's first row).
template <int SD>
__device__ __forceinline__ void load_a(uint32_t *a, const bf16 *rows16, int ks) {
    const int lane = threadIdx.x % 32;
    ldsm_x4(a[0], a[1], a[2], a[3], rows16 + (lane % 16) * SD + ks * 16 + (lane / 16) * 8);
}

// c[m][n] += a[m] · B_n for m < MB row blocks and n < N, B_n an 8-column
// slice of a 16-row operand taken from a row-major shared tile t (stride
// SD) by ldmatrix.x4 (two n per load, each used for the MB A fragments:
// ldmatrix traffic per product divided by MB), in either orientation:
//   TRANS = false: B = t[n*8 .. n*8+8, kb*16 .. +16)^T, tile rows as columns:
//     S = Q K^T, dP = dO V^T (and S^T = K Q^T, dP^T = V dO^T in dk/dv);
//   TRANS = true:  B = t[kb*16 .. +16, n*8 .. n*8+8), read transposed:
//     O = P V, dQ = dS K, dV = P^T dO, dK = dS^T Q.
// Lanes 8m..8m+7 give the 8 row addresses of the m-th 8x8 matrix: row
// block `outer` (8 rows per n pair) and column block `inner` (16 per kb).
template <int MB, int N, int SD, bool TRANS>
__device__ __forceinline__ void mma_tile_rows(float (*c)[N][4], const uint32_t (*a)[4], const bf16 *t, int kb) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < N; n += 2) {
        const int outer = (n + lane / 16) * 8, inner = kb * 16 + ((lane / 8) % 2) * 8;
        uint32_t b0, b1, b2, b3;
        if (TRANS) ldsm_x4_t(b0, b1, b2, b3, t + (inner + lane % 8) * SD + outer);
        else ldsm_x4(b0, b1, b2, b3, t + (outer + lane % 8) * SD + inner);
#pragma unroll
        for (int m = 0; m < MB; m++) {
            mma16816(c[m][n], a[m], b0, b1);
            mma16816(c[m][n + 1], a[m], b2, b3);
        }
    }
}

// The same for one row block: c[n] += a · B_n.
template <int N, int SD, bool TRANS>
__device__ __forceinline__ void mma_tile(float (*c)[4], const uint32_t *a, const bf16 *t, int kb) {
    mma_tile_rows<1, N, SD, TRANS>((float (*)[N][4])c, (const uint32_t (*)[4])a, t, kb);
}

// x = A_a · t1^T and y = A_b · t2^T over all D columns, A_a and A_b the
// warp's 16 rows of shared tiles ra and rb (stride D+8): two N*8-column
// score blocks, S and dP (S^T and dP^T in the dk/dv kernel).
template <int N, int D>
__device__ __forceinline__ void two_scores(float (*x)[4], float (*y)[4], const bf16 *ra, const bf16 *rb,
                                           const bf16 *t1, const bf16 *t2) {
    constexpr int SD = D + 8;
    zero_frags<N>(x);
    zero_frags<N>(y);
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        uint32_t a[4], b[4];
        load_a<SD>(a, ra, ks);
        load_a<SD>(b, rb, ks);
        mma_tile<N, SD, false>(x, a, t1, ks);
        mma_tile<N, SD, false>(y, b, t2, ks);
    }
}

// One step of a double-buffered cp.async pipeline. Stage `it` was issued
// and committed one step earlier; this issues stage it+1 into the other
// buffer when there is one (`more`), waits until every group but that
// newest one has landed (this thread's copies of stage it), and the barrier
// then makes all threads' copies of stage it visible to the whole CTA. The
// caller ends each step with another __syncthreads, so that the next step's
// issue does not overwrite a buffer a slower warp is still reading.
// ASYNC_PROXY: the stage is read by wgmma (through the async proxy), so each
// thread fences its landed copies for it before the barrier.
template <bool ASYNC_PROXY = false, typename F>
__device__ __forceinline__ void pipeline_step(bool more, F issue_next) {
    if (more) {
        issue_next();
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    if (ASYNC_PROXY) fence_proxy_async();
    __syncthreads();
}

// Row r of a flattened (position, head-in-group) row range: element pointer.
__device__ __forceinline__ const bf16 *row_ptr(const bf16 *base, int64_t tok0, int r, int G, int hkv, int Hq, int D) {
    return base + ((tok0 + r / G) * (int64_t)Hq + (int64_t)hkv * G + r % G) * D;
}

// cp.async `nrows` rows of D bf16 into s[nrows][D+8]: query-like rows
// r0+i (i < nrows) of the flattened range, zero past `rows_total`.
template <int D>
__device__ __forceinline__ void load_qrows(bf16 *s, int nrows, const bf16 *base, int64_t tok0, int r0, int rows_total,
                                           int G, int hkv, int Hq) {
    constexpr int CPR = D / 8, SD = D + 8;
    for (int c = threadIdx.x; c < nrows * CPR; c += blockDim.x) {
        int i = c / CPR, k = c % CPR;
        bool ok = r0 + i < rows_total;
        const bf16 *g = ok ? row_ptr(base, tok0, r0 + i, G, hkv, Hq, D) + k * 8 : base;
        cp_async16(s + i * SD + k * 8, g, ok);
    }
}

// cp.async TN key rows k0.. of one KV head into s[TN][D+8], zero from kend.
template <int D, int TN = BN>
__device__ __forceinline__ void load_keys(bf16 *s, const bf16 *base, int64_t k0, int64_t kend, int Hkv, int hkv) {
    constexpr int CPR = D / 8, SD = D + 8;
    for (int c = threadIdx.x; c < TN * CPR; c += blockDim.x) {
        int i = c / CPR, k = c % CPR;
        bool ok = k0 + i < kend;
        const bf16 *g = ok ? base + ((k0 + i) * Hkv + hkv) * (int64_t)D + k * 8 : base;
        cp_async16(s + i * SD + k * 8, g, ok);
    }
}

// The same two copies into core-matrix tiles (cm_off) for wgmma: c counts
// the tile's 16-byte chunks in shared-memory order (row group, chunk, row
// in the group), so a warp's copies land in 512 contiguous bytes.
template <int D>
__device__ __forceinline__ void load_qrows_cm(bf16 *s, int nrows, const bf16 *base, int64_t tok0, int r0,
                                              int rows_total, int G, int hkv, int Hq) {
    constexpr int CPR = D / 8;
    for (int c = threadIdx.x; c < nrows * CPR; c += blockDim.x) {
        const int i = cm_row<D>(c), k = cm_chunk<D>(c);
        const bool ok = r0 + i < rows_total;
        const bf16 *g = ok ? row_ptr(base, tok0, r0 + i, G, hkv, Hq, D) + k * 8 : base;
        cp_async16(s + c * 8, g, ok);
    }
}
template <int D, int TN>
__device__ __forceinline__ void load_keys_cm(bf16 *s, const bf16 *base, int64_t k0, int64_t kend, int Hkv, int hkv) {
    constexpr int CPR = D / 8;
    for (int c = threadIdx.x; c < TN * CPR; c += blockDim.x) {
        const int i = cm_row<D>(c), k = cm_chunk<D>(c);
        const bool ok = k0 + i < kend;
        const bf16 *g = ok ? base + ((k0 + i) * Hkv + hkv) * (int64_t)D + k * 8 : base;
        cp_async16(s + c * 8, g, ok);
    }
}

// The keys a CTA visits: segment 0 [s0,e0) then segment 1 [s1,e1) minus
// segment 0 (the DFlash union); tiles of TN keys, each within one segment.
template <int TN>
struct KeySegsT {
    int64_t s0, e0, s1, e1;
    int n0, n1;
    __device__ void init(int64_t a0, int64_t b0, int64_t a1, int64_t b1) {
        s0 = a0, e0 = b0 > a0 ? b0 : a0, s1 = a1, e1 = b1 > a1 ? b1 : a1;
        n0 = (int)((e0 - s0 + TN - 1) / TN);
        n1 = (int)((e1 - s1 + TN - 1) / TN);
    }
    __device__ int ntiles() const { return n0 + n1; }
    __device__ int64_t start(int i) const { return i < n0 ? s0 + (int64_t)i * TN : s1 + (int64_t)(i - n0) * TN; }
    __device__ int64_t end(int i) const { return i < n0 ? e0 : e1; }
    // may tile i's key `key` be used (inside its segment, counted once)?
    __device__ bool ok(int i, int64_t key) const {
        return key < end(i) && (i < n0 || key < s0 || key >= e0);
    }
    // may every key of tile i be used (ok for all TN of them)?
    __device__ bool full(int i) const {
        const int64_t a = start(i), b = a + TN;
        return b <= end(i) && (i < n0 || b <= s0 || a >= e0);
    }
};

// the 64-key tiles of the backward kernels
using KeySegs = KeySegsT<BN>;

// cp.async key tile i of `segs` from k and v into buffer `buf` of sK and sV
// ([2][TN][D+8] each).
// CM: core-matrix tiles ([2][TN][D] each) for wgmma.
template <int D, int TN = BN, bool CM = false>
__device__ __forceinline__ void load_kv_tile(bf16 *sK, bf16 *sV, const bf16 *k, const bf16 *v,
                                             const KeySegsT<TN> &segs, int i, int buf, int Hkv, int hkv) {
    if constexpr (CM) {
        load_keys_cm<D, TN>(sK + buf * TN * D, k, segs.start(i), segs.end(i), Hkv, hkv);
        load_keys_cm<D, TN>(sV + buf * TN * D, v, segs.start(i), segs.end(i), Hkv, hkv);
    } else {
        constexpr int SD = D + 8;
        load_keys<D, TN>(sK + buf * TN * SD, k, segs.start(i), segs.end(i), Hkv, hkv);
        load_keys<D, TN>(sV + buf * TN * SD, v, segs.start(i), segs.end(i), Hkv, hkv);
    }
}

// Exclusive prefix sums out[0..n] (out[n] = total) of val(0..n-1), by one
// block of 1024 threads: each thread sums a contiguous run, the runs are
// scanned in shared memory, then each thread writes its run.
template <typename F>
__device__ void block_scan_exclusive(int *out, int n, F val) {
    __shared__ int part[1024];
    const int tid = threadIdx.x, nt = blockDim.x;
    __syncthreads(); // part[] may still be read by a previous call
    int per = (n + nt - 1) / nt, a = tid * per, b = a + per < n ? a + per : n;
    int sum = 0;
    for (int i = a; i < b; i++) sum += val(i);
    part[tid] = sum;
    __syncthreads();
    for (int off = 1; off < nt; off *= 2) {
        int x = tid >= off ? part[tid - off] : 0;
        __syncthreads();
        part[tid] += x;
        __syncthreads();
    }
    int run = tid ? part[tid - 1] : 0;
    for (int i = a; i < b; i++) {
        out[i] = run;
        run += val(i);
    }
    if (tid == nt - 1) out[n] = part[nt - 1];
}

// The attention kernels on wgmma (flash_fwd_cta's WGS path, the DFlash dk/dv
// kernel's WG path)? Only on a 9.0 device (the sm_90a code) and for D = 64
// or 128; opted into with DFLASH_CUDA_WGMMA=1 until a GPU run has measured
// it against mma.sync (=3: the causal kernel with three warpgroups a CTA
// instead of two).
// Read at every call, so that a test can run both paths in one process.
// Returns 0 (mma.sync), or the warpgroups a causal CTA should have.
static inline int use_wgmma(int64_t D) {
    const char *s = getenv("DFLASH_CUDA_WGMMA");
    if (!g_cuda.sm90 || (D != 64 && D != 128) || !s || !*s || strcmp(s, "0") == 0) return 0;
    return strcmp(s, "3") == 0 ? 3 : 2;
}

// The wgmma forward kernels with flash_fwd_cta's PIPE overlap, unless
// DFLASH_CUDA_WGMMA_PIPE=0 (read at every call, like use_wgmma).
static inline bool wgmma_pipe(void) {
    const char *s = getenv("DFLASH_CUDA_WGMMA_PIPE");
    return !(s && strcmp(s, "0") == 0);
}

// Raise a kernel's dynamic shared memory limit once, when it needs > 48 KiB.
template <typename K>
static void allow_smem(K kernel, size_t bytes) {
    if (bytes <= (48u << 10)) return;
    CU_ASSERT(bytes <= g_cuda.smem_optin);
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

// A DFlash block's two key ranges [r0,r1) (context), [r2,r3) (own block),
// clamped into [0, NK]: a guard; the model code builds valid blocks, and an
// out-of-range one must not fault.
__device__ __forceinline__ void block_ranges(const dfl_block &b, int B, int64_t NK, int64_t *r) {
    auto cl = [&](int64_t x) { return x < 0 ? (int64_t)0 : x > NK ? NK : x; };
    r[0] = cl(b.ctx_off);
    r[1] = cl((int64_t)b.ctx_off + b.ctx_len);
    r[2] = cl(b.blk_off);
    r[3] = cl((int64_t)b.blk_off + B);
}

// The same under a sliding window W > 0 (ops.h attn_dflash; W = 0: the
// ranges above). Slot o of the block sees the context keys from
// ctx_end + o + 1 - W on and its own keys blk_off .. blk_off + o, so slot
// 0 sees the most context and the context any slot sees starts at
// max(ctx_off, ctx_end - W + 1): block_ranges_w gives that union (the
// block's reach, work proportional to the window), row_ranges slot o's own
// ranges (exactly the keys it sees; its context may be empty when o >= W).
__device__ __forceinline__ void window_ranges(const dfl_block &b, int64_t NK, int64_t W, int64_t o, int64_t own,
                                              int64_t *r) {
    auto cl = [&](int64_t x) { return x < 0 ? (int64_t)0 : x > NK ? NK : x; };
    const int64_t end = (int64_t)b.ctx_off + b.ctx_len, lo = end + o + 1 - W;
    r[0] = cl(lo > b.ctx_off ? lo : (int64_t)b.ctx_off);
    r[1] = cl(end);
    r[2] = cl(b.blk_off);
    r[3] = cl((int64_t)b.blk_off + own);
}

__device__ __forceinline__ void block_ranges_w(const dfl_block &b, int B, int64_t NK, int64_t W, int64_t *r) {
    if (W > 0) window_ranges(b, NK, W, 0, B, r);
    else block_ranges(b, B, NK, r);
}

__device__ __forceinline__ void row_ranges(const dfl_block &b, int B, int64_t NK, int64_t W, int o, int64_t *r) {
    if (W > 0) window_ranges(b, NK, W, o, o + 1, r);
    else block_ranges(b, B, NK, r);
}

// The window's rule per (slot, key) for the tensor-core kernels, which visit
// the block's reach (block_ranges_w) and test each score there: slot o
// sees key iff key >= max(ctx_off, ctx_end + o + 1 - W) and key < ctx_end,
// or blk_off <= key <= blk_off + o. For keys in [0, NK) (every key a kernel
// visits) that is row_ranges' answer. NoWindow (W = 0) has no test: a
// kernel given it compiles to its code without a window.
struct NoWindow {
    static constexpr bool on = false, lower = false;
};
struct DflWindow {
    static constexpr bool on = true, lower = false;
    int64_t ctx_off, ctx_end, lo, blk_off; // lo: slot 0's first context key before the cut at ctx_off
    __device__ void init(const dfl_block &b, int64_t W) {
        ctx_off = b.ctx_off, ctx_end = (int64_t)b.ctx_off + b.ctx_len, lo = ctx_end + 1 - W, blk_off = b.blk_off;
    }
    __device__ bool sees(int o, int64_t key) const {
        return (key >= ctx_off && key >= lo + o && key < ctx_end) || (key >= blk_off && key <= blk_off + o);
    }
    // every slot up to o_max sees every context key from here on (up to
    // ctx_end): a tile of the context segment starting here needs no test
    __device__ int64_t full_from(int o_max) const { return lo + o_max > ctx_off ? lo + o_max : ctx_off; }
};
// A target's sliding window on the causal path (attn_causal, window W > 0):
// the row at position p sees keys kbase + p - W + 1 .. kbase + p, a lower
// bound beside the causal mask's upper one. Not DFlash's (on = false).
struct CausalWindow {
    static constexpr bool on = false, lower = true;
    int W;
};

// ---------------------------------------------------------------------------
// forward CTA: 64 flattened rows [r0, r0+64) of one KV head, all keys of
// `segs`; CAUSAL masks key > kbase + row position, and with a CausalWindow
// `win` key < kbase + row position - W + 1 too; a DflWindow `win` masks the
// keys its row's slot (row position) does not see (DFlash's sliding
// window). Writes out (and lse, the natural-log logsumexp of the scaled
// scores, when lse != NULL).
//
// D = 64, 128: tiles of 64 keys, the warp's Q fragments held in registers
// for the whole key loop. D = 256 (Qwen3.5's attention): the O accumulator
// alone is 128 registers a thread, so Q is re-read from shared memory at
// every tile (64 registers fewer: no spill under the 255 of two CTAs a
// multiprocessor) and tiles are 32 keys, which keeps the CTA at 99 KiB of
// shared memory, two a multiprocessor, where 64-key tiles would take 165 KiB
// and leave one.
template <int D>
constexpr int FWD_KEYS = D > 128 ? 32 : BN;
template <int D>
constexpr bool FWD_Q_IN_REGS = D <= 128;
template <int D>
using FwdSegs = KeySegsT<FWD_KEYS<D>>;

template <int D, int ROWS = BM>
constexpr size_t fwd_smem_bytes() { return (size_t)(ROWS + 4 * FWD_KEYS<D>) * (D + 8) * sizeof(bf16); }
// the wgmma path's (core-matrix tiles, no padding; D = 64 or 128)
// (PIPE: three K/V stages instead of two)
template <int D, int ROWS, bool PIPE = false>
constexpr size_t fwd_wg_smem_bytes() { return (size_t)(ROWS + (PIPE ? 6 : 4) * BN) * D * sizeof(bf16); }

// A CTA of 4 warps (NTHREADS), each with MB blocks of 16 rows (rows
// warp*16*MB + m*16 + ..): MB = 1 (64 rows) for the DFlash forward, whose
// blocks have 64 rows a KV head, and D = 256; MB = 2 (128 rows) for the
// causal prefill at D <= 128. Two row blocks a warp, as FlashAttention-2 does, halve the
// ldmatrix traffic per product and give each warp two independent chains
// (the kernel is latency-bound at 16 rows a warp), and a K/V tile in
// shared memory serves 128 rows: half the L2 traffic.
//
// WGS > 0: the wgmma path (D = 64 or 128, MB = 1): WGS warpgroups (4*WGS
// warps, 64*WGS rows) whose products S = Q K^T and O += P V are warpgroup
// wgmmas on core-matrix tiles (Q and K/V from shared memory, P from
// registers); the masks and the online softmax are the same code, on the
// same fragments.
//
// PIPE (wgmma only): FlashAttention-3's intra-warpgroup overlap. Tile it's
// S = Q K^T and tile it-1's O += P V are issued together; the softmax of
// tile it runs while the P V product is still on the tensor cores. So O is
// rescaled one tile late: by tile it-1's factor, just before P V of tile
// it-1 adds to it (both then relative to tile it-1's row maxima). P V of
// tile it-1 reads V while tile it+1 loads, so K/V have three stages, and
// one barrier a tile suffices: tile it+1 goes into the stage of tile it-2,
// whose P V every warpgroup waited for before the barrier.
template <int D, bool CAUSAL, int MB = 1, int WGS = 0, bool PIPE = false, class WIN = NoWindow>
__device__ __forceinline__ void flash_fwd_cta(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                                              int Hq, int Hkv, int G, int64_t tok0, int rows_total, int r0, int hkv,
                                              const FwdSegs<D> &segs, int64_t kbase, float scale_log2,
                                              const WIN &win = WIN()) {
    constexpr bool WG = WGS > 0;
    static_assert(!WG || (MB == 1 && (D == 64 || D == 128)), "wgmma: one row block a warp, D 64 or 128");
    static_assert(!PIPE || WG, "the pipelined forward is a wgmma path");
    constexpr int NSTAGE = PIPE ? 3 : 2;
    constexpr int SD = WG ? D : D + 8, ND = D / 8, KS = D / 16, ROWS = WG ? 64 * WGS : BM * MB;
    constexpr int TN = FWD_KEYS<D>, NB = TN / 8; // keys per tile, 8-key score fragments
    constexpr bool QREG = FWD_Q_IN_REGS<D> && MB == 1 && !WG;
    DYN_SMEM(bf16, sQ);
    bf16 *sK = sQ + ROWS * SD; // [NSTAGE][TN][SD]
    bf16 *sV = sK + NSTAGE * TN * SD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const bf16 *sQw = sQ + warp * 16 * MB * SD; // this warp's 16*MB rows (mma.sync)
    const bf16 *sQg = sQ + (warp / 4) * 64 * D;  // this warpgroup's 64 rows (wgmma)

    // this thread's rows: row block m, rows g and g+8 of it
    const int row0 = r0 + warp * 16 * MB + g; // + m*16 + 8h
    int pos[MB][2];                            // positions fit int: T * Hq <= INT32_MAX
#pragma unroll
    for (int m = 0; m < MB; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) pos[m][h] = (row0 + m * 16 + 8 * h) / G;
    // the CTA's first position: a causal tile whose last key is at or
    // before it needs no causal mask for any row of the CTA
    const int64_t pos_min = r0 / G;
    // a sliding window (DFlash, WIN::on; pos is the row's slot): the tiles
    // of the context segment from win_full on are seen whole by every row
    // of the CTA (up to its last slot): no per-key test there
    static_assert(!(WIN::on && CAUSAL), "a window is DFlash's");
    static_assert(!WIN::lower || CAUSAL, "a lower key bound is the causal window's");
    int64_t win_full = 0;
    if constexpr (WIN::on) win_full = win.full_from(((r0 + ROWS < rows_total ? r0 + ROWS : rows_total) - 1) / G);
    // a causal window (one segment from kbase + kfirst): keys relative to
    // kbase in int, tile it's first at kfirst + it * TN. Every row of the CTA
    // sees every key from its last row's first key (position - W + 1) to its
    // first row's position (pos_min): the tiles [t_lo, t_hi) lie there and
    // need no test, the others (the window's lower edge, the diagonal) do.
    int kfirst = 0, t_lo = 0, t_hi = 0;
    if constexpr (WIN::lower) {
        kfirst = (int)(segs.s0 - kbase);
        const int low_full = ((r0 + ROWS < rows_total ? r0 + ROWS : rows_total) - 1) / G - win.W + 1;
        t_lo = low_full > kfirst ? (low_full - kfirst + TN - 1) / TN : 0;
        t_hi = ((int)pos_min - kfirst + 1) / TN; // (kfirst <= pos_min)
    }

    const int nt = segs.ntiles();
    if constexpr (WG) load_qrows_cm<D>(sQ, ROWS, q, tok0, r0, rows_total, G, hkv, Hq);
    else load_qrows<D>(sQ, ROWS, q, tok0, r0, rows_total, G, hkv, Hq);
    if (nt > 0) load_kv_tile<D, TN, WG>(sK, sV, k, v, segs, 0, 0, Hkv, hkv);
    cp_async_commit();

    float o[MB][ND][4];
#pragma unroll
    for (int m = 0; m < MB; m++) zero_frags<ND>(o[m]);
    float mrow[MB][2], l[MB][2];
#pragma unroll
    for (int m = 0; m < MB; m++) mrow[m][0] = mrow[m][1] = -INFINITY, l[m][0] = l[m][1] = 0.0f;
    uint32_t qf[QREG ? KS : 1][4];
    // PIPE: the previous tile's P (f32, then as bf16 A fragments) and its O
    // factors. P has registers of its own (without PIPE it replaces S in
    // place), converted at the top of the next step: ptxas hoists a wgmma
    // wait above the exponentials that precede it in the same basic block,
    // which would take them out of the overlap.
    float p_own[PIPE ? MB : 1][PIPE ? NB : 1][4];
    uint32_t pa[PIPE ? NB / 2 : 1][4];
    float alpha_prev[2] = {0.0f, 0.0f};
    auto take_p = [&] { // once the P V product in flight is done: P is its next A
        wg_wait<0>();
#pragma unroll
        for (int kk = 0; kk < NB / 2; kk++) c_to_a(pa[kk], p_own[0][2 * kk], p_own[0][2 * kk + 1]);
    };

    for (int it = 0; it < nt; it++) {
        const int buf = it % NSTAGE;
        if constexpr (PIPE) { // tile it landed and visible; then tile it+1 into tile it-2's stage
            if (it > 0) take_p();
            cp_async_wait<0>();
            fence_proxy_async();
            __syncthreads();
            if (it + 1 < nt) {
                load_kv_tile<D, TN, true>(sK, sV, k, v, segs, it + 1, (it + 1) % NSTAGE, Hkv, hkv);
                cp_async_commit();
            }
        } else {
            pipeline_step<WG>(it + 1 < nt,
                              [&] { load_kv_tile<D, TN, WG>(sK, sV, k, v, segs, it + 1, buf ^ 1, Hkv, hkv); });
        }
        if constexpr (QREG) {
            if (it == 0) {
#pragma unroll
                for (int ks = 0; ks < KS; ks++) load_a<SD>(qf[ks], sQw, ks);
            }
        }
        const bf16 *kt = sK + buf * TN * SD, *vt = sV + buf * TN * SD;
        const int64_t k0 = segs.start(it);

        // S = Q K^T for 16*MB rows x TN keys
        float s[MB][NB][4];
        if constexpr (WG) { // the warpgroup's 64 rows: K-major A (Q) and B^T (K) tiles, 16 columns a step
            if constexpr (PIPE) rescale_frags<ND>(o[0], alpha_prev); // before the fence: P V reads O
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                wgmma_ss<TN>(&s[0][0][0], wg_desc(sQg + ks * 128, 128, D * 16), wg_desc(kt + ks * 128, 128, D * 16),
                             ks);
            wg_commit();
            if constexpr (PIPE) {
                if (it > 0) { // the previous tile's O += P V, in flight during this tile's softmax
                    wg_fence(); // (ptxas schedules P's conversion past the first fence)
                    wg_product_ra<D, NB / 2>(&o[0][0][0], pa, sV + (it - 1) % NSTAGE * TN * SD);
                    wg_commit();
                    wg_wait<1>();
                } else {
                    wg_wait<0>();
                }
            } else {
                wg_wait<0>();
            }
        } else {
#pragma unroll
            for (int m = 0; m < MB; m++) zero_frags<NB>(s[m]);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                if constexpr (QREG) {
                    mma_tile_rows<1, NB, SD, false>(s, &qf[ks], kt, ks);
                } else {
                    uint32_t a[MB][4];
#pragma unroll
                    for (int m = 0; m < MB; m++) load_a<SD>(a[m], sQw + m * 16 * SD, ks);
                    mma_tile_rows<MB, NB, SD, false>(s, a, kt, ks);
                }
            }
        }

        // mask, online softmax in log2 units. Most tiles lie inside their
        // segment and (causal) before every row of the CTA, (window) in the
        // context past the window's edge for every row: those skip the
        // per-key tests, which otherwise cost more issue slots than the
        // tile's products (a CTA-uniform branch). Scores stay unscaled
        // (scale_log2 > 0 commutes with max): the scale goes into the
        // exponent's fused multiply-add.
        float mx[MB][2];
#pragma unroll
        for (int m = 0; m < MB; m++) mx[m][0] = mx[m][1] = -INFINITY;
        // scores whose key fails keep(m, kr, h) (kr: the key's place in the
        // tile; row half h of row block m) become -inf; then the row maxima
        auto mask_max = [&](auto keep) {
#pragma unroll
            for (int m = 0; m < MB; m++)
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        if (!keep(m, nb * 8 + 2 * c + (e & 1), e >> 1)) s[m][nb][e] = -INFINITY;
                        mx[m][e >> 1] = fmaxf(mx[m][e >> 1], s[m][nb][e]);
                    }
        };
        bool unmasked;
        if constexpr (WIN::lower) unmasked = it >= t_lo && it < t_hi;
        else
            unmasked = segs.full(it) && (!CAUSAL || k0 + TN - 1 - kbase <= pos_min) &&
                       (!WIN::on || (it < segs.n0 && k0 >= win_full));
        if (unmasked) {
            mask_max([](int, int, int) { return true; });
        } else if constexpr (WIN::lower) { // the causal mask and the window's lower edge
            const int cb = kfirst + it * TN, W = win.W; // keys past the segment's end are past every row's own
            mask_max([&](int m, int kr, int h) { return cb + kr <= pos[m][h] && cb + kr + W > pos[m][h]; });
        } else if constexpr (CAUSAL) { // one segment: keys relative to k0 in int
            const int64_t left = segs.end(it) - k0;
            const int lim = left < TN ? (int)left : TN, cb = (int)(k0 - kbase);
            mask_max([&](int m, int kr, int h) { return kr < lim && cb + kr <= pos[m][h]; });
        } else if constexpr (WIN::on) { // the window's edge and the own block: each (slot, key)
            mask_max([&](int m, int kr, int h) { return segs.ok(it, k0 + kr) && win.sees(pos[m][h], k0 + kr); });
        } else {
            mask_max([&](int, int kr, int) { return segs.ok(it, k0 + kr); });
        }
        float alpha[MB][2];
        auto &pt = select_ref<PIPE>(p_own, s); // P
#pragma unroll
        for (int m = 0; m < MB; m++) {
            float base[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                mx[m][h] = fmaxf(mx[m][h], __shfl_xor_sync(0xffffffffu, mx[m][h], 1));
                mx[m][h] = fmaxf(mx[m][h], __shfl_xor_sync(0xffffffffu, mx[m][h], 2));
                float mnew = fmaxf(mrow[m][h], mx[m][h] * scale_log2);
                base[h] = mnew == -INFINITY ? 0.0f : mnew; // a row with no key yet
                alpha[m][h] = exp2f(mrow[m][h] - base[h]);
                mrow[m][h] = mnew;
                l[m][h] *= alpha[m][h];
            }
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    pt[m][nb][e] = exp2f(fmaf(s[m][nb][e], scale_log2, -base[e >> 1]));
                    l[m][e >> 1] += pt[m][nb][e];
                }
            }
            // unconditional: a branch skipping it when every alpha is 1
            // made no measurable difference at D = 128, and is the likeliest
            // cause of D = 256's slowdown in the same run (the branch keeps
            // the 128 multiplies from interleaving with the P V products;
            // tests/gpu/NOTES.md)
            if constexpr (!PIPE) rescale_frags<ND>(o[m], alpha[m]);
        }

        // O += P V
        if constexpr (PIPE) { // issued at the next step
            alpha_prev[0] = alpha[0][0], alpha_prev[1] = alpha[0][1];
        } else if constexpr (WG) { // P from registers, V as an N-major B, 16 keys a step
            wg_product_rs<D, NB / 2>(&o[0][0][0], s[0], vt);
            wg_commit();
            wg_wait<0>();
        } else {
#pragma unroll
            for (int kk = 0; kk < NB / 2; kk++) {
                uint32_t a[MB][4];
#pragma unroll
                for (int m = 0; m < MB; m++) c_to_a(a[m], s[m][2 * kk], s[m][2 * kk + 1]);
                mma_tile_rows<MB, ND, SD, true>(o, a, vt, kk);
            }
        }
        if constexpr (!PIPE) __syncthreads(); // the next iteration's prefetch overwrites this buffer
    }
    if constexpr (PIPE) { // the last tile's O += P V
        if (nt > 0) {
            take_p();
            rescale_frags<ND>(o[0], alpha_prev);
            wg_fence();
            wg_product_ra<D, NB / 2>(&o[0][0][0], pa, sV + (nt - 1) % NSTAGE * TN * SD);
            wg_commit();
            wg_wait<0>();
        }
    }
    cp_async_wait<0>(); // (no tile at all: the Q copy is still in flight)

    // finish: O / l, lse = (m + log2 l) ln 2
#pragma unroll
    for (int m = 0; m < MB; m++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            l[m][h] += __shfl_xor_sync(0xffffffffu, l[m][h], 1);
            l[m][h] += __shfl_xor_sync(0xffffffffu, l[m][h], 2);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = row0 + m * 16 + 8 * h;
            if (row >= rows_total) continue;
            float inv = l[m][h] > 0.0f ? 1.0f / l[m][h] : 0.0f;
            bf16 *orow = (bf16 *)row_ptr(out, tok0, row, G, hkv, Hq, D);
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                DEV_CHECK_ALIGN(orow + nd * 8 + 2 * c, 4);
                *(uint32_t *)(orow + nd * 8 + 2 * c) = pack_bf16(o[m][nd][2 * h] * inv, o[m][nd][2 * h + 1] * inv);
            }
            if (lse && c == 0) {
                int64_t t = tok0 + row / G;
                lse[t * Hq + (int64_t)hkv * G + row % G] =
                    l[m][h] > 0.0f ? (mrow[m][h] + log2f(l[m][h])) * LN2 : -INFINITY;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// DFlash backward: for every tile of BN keys, the blocks that see any of
// its keys, in block order (so sums over them are deterministic), cut into
// chunks of at most CHUNK blocks (one CTA each, for balance).

constexpr int CHUNK = 32;

struct KeyChunk {
    int tile, first, count; // list[first .. first+count) are block indices
};

struct TileLists {
    int ntiles;         // ceil(NK / BN)
    int *small;         // device: cnt[ntiles], list_off[ntiles+1], chunk_off[ntiles+1]
    int *cnt, *list_off, *chunk_off;
    int *list;          // device: [nlist] block indices, by tile then block
    KeyChunk *chunks;   // device: [nchunks]
    int *tile_off;      // device: [nblk+1] exclusive sums of the tiles each block touches
    int nlist, nchunks; // host copies of the totals (nlist: also tile_off[nblk])
};

// Device ints of the counts (cnt, list_off, chunk_off) behind the lists.
static inline size_t tile_lists_small_ints(int64_t NK) { return (size_t)3 * (CEIL_DIV(NK, (int64_t)BN) + 1); }

// delta[t*Hq + h] = sum_d dout[t,h,d] * out[t,h,d]  (f32), rows n = T*Hq
void launch_delta(float *delta, const bf16 *dout, const bf16 *out, int64_t n, int D);

// ---------------------------------------------------------------------------
// the simple kernels (attn_simple.cu): any D <= 256, any alignment

void simple_attn_causal(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const int32_t *cu,
                        int64_t nseq, int64_t T, int Hq, int Hkv, int D, int64_t window);
// (window: the op's sliding window, 0 for none; the tensor-core kernels
// take one too, see the top of attn_dflash.cu)
void simple_attn_dflash(bf16 *out, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks,
                        int64_t nblk, int B, int64_t NK, int Hq, int Hkv, int D, int64_t window);
void simple_attn_dflash_dq(bf16 *dq, const bf16 *dout, const float *lse, const float *delta, const bf16 *q,
                           const bf16 *k, const bf16 *v, const dfl_block *blocks, int64_t nblk, int B, int64_t NK,
                           int Hq, int Hkv, int D, int64_t window);
void simple_attn_dflash_dkdv(bf16 *dk, bf16 *dv, const bf16 *dout, const float *lse, const float *delta,
                             const bf16 *q, const bf16 *k, const bf16 *v, const dfl_block *blocks, const TileLists *tl,
                             int B, int64_t NK, int Hq, int Hkv, int D, int64_t window);

} // namespace attn

#endif
