// common.cuh: what every kernels/*.cu shares: error checks that exit 70 with
// file:line, the backend state (device, stream, cuBLAS handles, workspace),
// grow-only scratch buffers, bf16 helpers, warp/block reductions, and the
// declarations of every op of the CUDA table (one .cu per op or op family).
//
// Conventions (DESIGN §3): act and wt buffers are bf16, f32 buffers stay
// f32, all arithmetic accumulates in f32. Every op runs on g_cuda.stream and
// is asynchronous unless it returns data to the host (download, act_to_*,
// sumsq). With DFLASH_CUDA_SYNC=1 every op synchronises and checks for errors
// on return, so a failing kernel is reported by the op that launched it.
#ifndef DFLASH_KERNELS_COMMON_CUH
#define DFLASH_KERNELS_COMMON_CUH

#ifdef DFLASH_EMU
// tests/emu: the same sources compiled for the CPU, with an emulation of the
// CUDA subset used here (warps as fibers, ldmatrix/mma by the PTX fragment
// layouts, cuBLAS by its column-major definition), so that every kernel and
// launcher is checked against the CPU reference where there is no GPU.
#include "cuda_emu.h"
#else
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "common.h"
#include "ops.h"
}

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------
// error checks

[[noreturn]] void cuda_fail(const char *what, const char *msg, const char *file, int line);

#define cudaCheck(x)                                                                   \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) cuda_fail("CUDA", cudaGetErrorString(e_), __FILE__, __LINE__); \
    } while (0)

#define cublasCheck(x)                                                                 \
    do {                                                                               \
        cublasStatus_t s_ = (x);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                               \
            cuda_fail("cuBLAS", cublasGetStatusString(s_), __FILE__, __LINE__);        \
    } while (0)

// Launcher preconditions: programmer errors, never bad input (DFL_ASSERT).
#define CU_ASSERT(x) DFL_ASSERT(x)

// After every launch: catch bad configurations at once; in DFLASH_CUDA_SYNC
// mode also wait, so an illegal access is reported here and not later.
#define LAUNCH_CHECK() cuda_after_launch(__FILE__, __LINE__)
void cuda_after_launch(const char *file, int line);

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// Kernel launch on the backend's stream: KLAUNCH(kernel, grid, block, smem)(args...)
#ifdef DFLASH_EMU
#define KLAUNCH(kernel, grid, block, smem) emu::launcher(grid, block, smem, kernel)
#define DYN_SMEM(T, name) T *name = (T *)emu::dyn_smem()
#else
#define KLAUNCH(kernel, grid, block, smem) kernel<<<(grid), (block), (smem), g_cuda.stream>>>
// the block's dynamic shared memory, 16-byte aligned
#define DYN_SMEM(T, name)                                     \
    extern __shared__ __align__(16) unsigned char name##_raw[]; \
    T *name = (T *)name##_raw
#endif

// ---------------------------------------------------------------------------
// backend state (backend.cu)

struct dfl_cuda_state {
    int dev;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;        // cuBLAS workspace (Hopper wants 32 MiB)
    size_t blas_ws_bytes;
    int sm_count;
    size_t smem_optin;    // max dynamic shared memory per block
    int pools;            // stream-ordered allocation (cudaMallocAsync) supported
    int simple;           // DFLASH_CUDA_SIMPLE=1: reference kernels for attention
    int sync;             // DFLASH_CUDA_SYNC=1: synchronise after every launch
    int64_t lmhead_rows;  // DFLASH_CUDA_LMHEAD_ROWS=n: rows per LM-head chunk (tests)
    int64_t conv_rows;    // DFLASH_CUDA_CONV_ROWS=n: rows per conv1d_silu thread (tests)
    int no_grouped;       // DFLASH_CUDA_NO_GROUPED=1: matmul_grouped as one GEMM per group
    int sm90;             // a compute capability 9.0 device (the sm_90a code, wgmma, runs)
};
extern dfl_cuda_state g_cuda;

// Grow-only device scratch, stream-ordered (cudaMallocAsync): valid until the
// next call with the same slot. An op takes what it needs once and splits it.
// SCRATCH_TILE_COUNTS + i: the key-tile counts a DFlash forward keeps for its
// backward (attn_dflash.cu), TILE_COUNT_SLOTS of them.
constexpr int TILE_COUNT_SLOTS = 16;
enum {
    SCRATCH_OP,
    SCRATCH_STAGING,
    SCRATCH_LOGITS,
    SCRATCH_LISTS,
    SCRATCH_PART,
    SCRATCH_DS,
    SCRATCH_TILE_COUNTS,
    SCRATCH_SLOTS = SCRATCH_TILE_COUNTS + TILE_COUNT_SLOTS
};
void *cuda_scratch(int slot, size_t bytes);
// The same, but NULL (the slot then empty) where the device has not the
// memory: for a buffer an op can do without.
void *cuda_scratch_try(int slot, size_t bytes);

// DFLASH_CUDA_PROFILE=1 (profile.cu): device time per op and per cuBLAS
// product, printed to stderr at exit. begin returns a slot (-1 when off);
// end names the key of the call the slot began.
void cuda_prof_init(void);
int cuda_prof_begin(void);
void cuda_prof_end(int slot, const char *key);
void cuda_prof_wrap(dfl_ops *t); // every device op of the table timed
// The kernels of one stage of an op, timed as "key" while in scope.
struct cuda_prof_scope {
    int slot;
    const char *key;
    explicit cuda_prof_scope(const char *k) : slot(cuda_prof_begin()), key(k) {}
    ~cuda_prof_scope() { cuda_prof_end(slot, key); }
};

// ---------------------------------------------------------------------------
// device helpers

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Is p aligned to `a` bytes (for the vectorised paths)?
static inline int is_aligned(const void *p, size_t a) { return ((uintptr_t)p % a) == 0; }

// A vector access needs its natural alignment on the GPU (a misaligned
// 16-byte load faults: "misaligned address"); x86 does not care, so the
// emulation checks it where the GPU would fault. Free on the GPU.
#ifdef DFLASH_EMU
#define DEV_CHECK_ALIGN(p, a) emu::check_align((const void *)(p), (a), __FILE__, __LINE__)
#else
#define DEV_CHECK_ALIGN(p, a) ((void)0)
#endif

// W consecutive bf16 <-> f32 in one access of 2W bytes (W = 2, 4 or 8; p
// aligned to it: the launchers check before they pick W > 1), or one
// element (W = 1). Through a plain integer vector type of that size (uint4
// has alignment 16): a struct of W bf16 has alignment 2, and the compiler
// then splits the "vector" access into 2-byte ones.
template <int W> struct bf16_vec;
template <> struct bf16_vec<1> { typedef unsigned short type; };
template <> struct bf16_vec<2> { typedef uint32_t type; };
template <> struct bf16_vec<4> { typedef uint2 type; };
template <> struct bf16_vec<8> { typedef uint4 type; };

// The W elements as loaded, kept in bf16 (a kernel holding many rows in
// registers converts them when it uses them: unpack_bf16s).
template <int W>
__device__ __forceinline__ typename bf16_vec<W>::type load_bf16_raw(const bf16 *p) {
    DEV_CHECK_ALIGN(p, 2 * W);
    return *(const typename bf16_vec<W>::type *)p;
}

template <int W>
__device__ __forceinline__ void unpack_bf16s(float *f, typename bf16_vec<W>::type u) {
    const bf16 *b = (const bf16 *)&u;
#pragma unroll
    for (int i = 0; i < W; i++) f[i] = bf2f(b[i]);
}

template <int W>
__device__ __forceinline__ void load_bf16s(float *f, const bf16 *p) {
    static_assert(W == 1 || W == 2 || W == 4 || W == 8, "1, 2, 4 or 8 elements");
    if constexpr (W == 1) f[0] = bf2f(*p);
    else unpack_bf16s<W>(f, load_bf16_raw<W>(p));
}

template <int W>
__device__ __forceinline__ void store_bf16s(bf16 *p, const float *f) {
    static_assert(W == 1 || W == 2 || W == 4 || W == 8, "1, 2, 4 or 8 elements");
    if constexpr (W == 1) {
        *p = f2bf(f[0]);
    } else {
        DEV_CHECK_ALIGN(p, 2 * W);
        typename bf16_vec<W>::type u;
        bf16 *b = (bf16 *)&u;
#pragma unroll
        for (int i = 0; i < W; i++) b[i] = f2bf(f[i]);
        *(typename bf16_vec<W>::type *)p = u;
    }
}

// ---------------------------------------------------------------------------
// Column sums over many rows in a fixed order (the norms' weight gradients):
// each warp adds its rows' terms into a shared-memory row of its own, the
// block sums its warps' rows in warp order (warp_rows_to_partial), and
// cuda_sum_partials adds the blocks' partials in block order.

// m[i] += a[i] * b[i] * r for i < W: a lane's run of W adjacent columns of
// its warp's dW row, in one shared-memory access of 4W bytes where W allows
// (W = 2: a float2; W a multiple of 4: float4s). Element by element, lanes
// whose runs lie 4W bytes apart meet in the same banks: at W = 8 every
// scalar access was an 8-way conflict (8 loads and 8 stores of 8 passes
// each, an estimated ~60 us of an RMSNorm backward at H = 4096), where a
// warp's float4 access takes 8 passes. Each element adds the same terms in
// the same order either way.
template <int W>
__device__ __forceinline__ void add_dw_terms(float *m, const float *a, const float *b, float r) {
    if constexpr (W % 4 == 0) {
        DEV_CHECK_ALIGN(m, 16);
#pragma unroll
        for (int i = 0; i < W; i += 4) {
            float4 s = *(float4 *)(m + i);
            s.x += a[i] * b[i] * r, s.y += a[i + 1] * b[i + 1] * r;
            s.z += a[i + 2] * b[i + 2] * r, s.w += a[i + 3] * b[i + 3] * r;
            *(float4 *)(m + i) = s;
        }
    } else if constexpr (W == 2) {
        DEV_CHECK_ALIGN(m, 8);
        float2 s = *(float2 *)m;
        s.x += a[0] * b[0] * r, s.y += a[1] * b[1] * r;
        *(float2 *)m = s;
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) m[i] += a[i] * b[i] * r;
    }
}

// After the block's last row: part[blockIdx.x][c] = the sum over warps, in
// warp order, of sdw[warp][c].
__device__ __forceinline__ void warp_rows_to_partial(float *part, const float *sdw, int dim) {
    __syncthreads();
    const int nwarps = blockDim.x / 32;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < nwarps; k++) s += sdw[(int64_t)k * dim + c];
        part[blockIdx.x * (int64_t)dim + c] = s;
    }
}

// One wave of `kernel` (threads and smem bytes a block) over `units`, at
// least min_per units a block, so that a block's fixed costs (its dW rows,
// its partial) are paid once a wave and no last wave runs part-full:
// returns the blocks, and in *per the units of each.
template <typename K>
static int64_t one_wave_blocks(K kernel, int threads, size_t smem, int64_t units, int64_t min_per, int64_t *per) {
    int per_sm = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    const int64_t wave = (int64_t)g_cuda.sm_count * (per_sm > 0 ? per_sm : 1);
    *per = CEIL_DIV(units, wave);
    if (*per < min_per) *per = min_per;
    return CEIL_DIV(units, *per);
}

// ---------------------------------------------------------------------------
// GEMM helpers (matmul.cu), used by the LM-head ops too. Row-major shapes.

// C[M,N] (bf16 or f32, per c_f32) = alpha * A[M,K] · B[N,K]^T + beta * C.
// lda/ldb/ldc are row strides in elements.
void gemm_nt(void *C, int c_f32, const bf16 *A, const bf16 *B, int64_t M, int64_t N, int64_t K,
             int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta);
// C[M,N] = alpha * A[M,K] · B[K,N] + beta * C   (B row-major [K,N])
void gemm_nn(void *C, int c_f32, const bf16 *A, const bf16 *B, int64_t M, int64_t N, int64_t K,
             int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta);
// C[M,N] = alpha * A[K,M]^T · B[K,N] + beta * C   (both row-major with K rows)
void gemm_tn(void *C, int c_f32, const bf16 *A, const bf16 *B, int64_t M, int64_t N, int64_t K,
             int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta);

// ---------------------------------------------------------------------------
// the ops of the table, one definition each in kernels/<op>.cu

// convert.cu
void cuda_load_act(void *dst, const void *host_src, dfl_dtype dtype, int64_t n);
void cuda_load_wt(void *dst, const void *host_src, dfl_dtype dtype, int64_t n);
void cuda_act_to_f32(float *host_dst, const void *src, int64_t n);
void cuda_act_to_bf16(uint16_t *host_dst, const void *src, int64_t n);
void cuda_master_to_wt(void *dst, const float *master, int64_t n);
// matmul.cu
void cuda_matmul(void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N, int accumulate);
void cuda_matmul_bwd(void *din, float *dw, const void *dout, const void *in, const void *w, int64_t M,
                     int64_t K, int64_t N, int acc);
void cuda_matmul_grouped(void *out, const void *in, const void *w, dfl_dtype wdt, const int64_t *offsets,
                         int64_t G, int64_t w_stride, int64_t K, int64_t N, int accumulate);
// rmsnorm.cu
void cuda_rmsnorm(void *out, float *rstd, const void *in, const void *w, int64_t rows, int64_t dim, float eps);
void cuda_rmsnorm1p(void *out, const void *in, const void *w, int64_t rows, int64_t dim, float eps);
void cuda_rmsnorm_bwd(void *din, float *dw, const void *dout, const void *in, const float *rstd, const void *w,
                      int64_t rows, int64_t dim);
// dw[dim] += the sum of part[nparts][dim] over its rows, in a fixed order
void cuda_sum_partials(float *dw, const float *part, int nparts, int dim);
// rope.cu
void cuda_rope(void *x, const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d,
               int inverse);
void cuda_qk_norm_rope(void *out, float *rstd, const void *in, const void *w, int plus_one, const int32_t *pos,
                       const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d, float eps);
void cuda_qk_norm_rope_bwd(void *din, float *dw, const void *dout, const void *in, const float *rstd, const void *w,
                           const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d);
// elementwise.cu
void cuda_swiglu(void *out, const void *gate, const void *up, int64_t n);
void cuda_swiglu_bwd(void *dgate, void *dup, const void *dout, const void *gate, const void *up, int64_t n,
                     int accumulate);
void cuda_add(void *out, const void *a, const void *b, int64_t n);
void cuda_add_bias(void *x, const void *bias, int64_t rows, int64_t cols);
void cuda_swiglu_oss(void *out, const void *gate, const void *up, int64_t n, float alpha, float limit);
void cuda_attn_sinks(void *out, const float *lse, const float *sinks, int64_t T, int64_t Hq, int64_t D);
void cuda_sigmoid_mul(void *out, const void *x, const void *g, int64_t n);
// gdn.cu
void cuda_conv1d_silu(void *out, const void *in, const void *hist, const void *w, const int32_t *cu, int64_t nseq,
                      int64_t T, int64_t C, int64_t K);
void cuda_gated_delta(void *out, float *state, float *steps, const void *qkv, const void *ba, const float *A_log,
                      const float *dt_bias, const int32_t *cu, int64_t nseq, int64_t T, int64_t Hk, int64_t Hv,
                      int64_t dk, int64_t dv);
// moe.cu
void cuda_moe_route(int64_t *offsets, int32_t *rows, int32_t *pos, float *wts, const void *logits, int64_t T,
                    int64_t E, int64_t k, int norm);
void cuda_gather_rows(void *out, const void *in, const int32_t *rows, int64_t n, int64_t H);
void cuda_moe_combine(void *x, const void *y, const int32_t *pos, const float *wts, const void *shared,
                      const void *sgate, int64_t T, int64_t k, int64_t H);
// embed.cu
void cuda_embed(void *out, const int32_t *ids, const void *table, int64_t T, int64_t H);
// attn_causal.cu
void cuda_attn_causal(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *cu,
                      int64_t nseq, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
// attn_dflash.cu
void cuda_attn_dflash(void *out, float *lse, const void *q, const void *k, const void *v, const dfl_block *blocks,
                      int64_t nblk, int64_t B, int64_t NK, int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
void cuda_attn_dflash_bwd(void *dq, void *dk, void *dv, const void *dout, const void *out, const float *lse,
                          const void *q, const void *k, const void *v, const dfl_block *blocks, int64_t nblk,
                          int64_t B, int64_t NK, int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
// lmhead.cu
void cuda_lmhead_ce(float *loss, int32_t *pred, void *dh, const void *h, const void *w, const int32_t *labels,
                    const float *gscale, int64_t N, int64_t H, int64_t V);
void cuda_lmhead_kl(float *loss, int32_t *pred, int32_t *tpred, void *dh, const void *h, const void *th,
                    const void *w, const float *gscale, int64_t N, int64_t H, int64_t V);
void cuda_lmhead_argmax(int32_t *pred, float *gap, const void *h, const void *w, int64_t N, int64_t H, int64_t V);
void cuda_lmhead_sample(int32_t *pred, float *gap, const void *h, const void *w, const uint64_t *keys,
                        const dfl_sampling *s, int64_t N, int64_t H, int64_t V);
// adamw.cu
double cuda_sumsq(const float *x, int64_t n);
void cuda_adamw(float *p, void *wt, const float *grad, float *m, float *v, int64_t n, float lr, float b1, float b2,
                float eps, float wd, float gscale, int64_t t);

#endif
