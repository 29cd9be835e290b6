// cuda_emu.h: a CPU emulation of the CUDA subset that kernels/ uses, so
// that the very same kernel sources (compiled as C++ with -DDFLASH_EMU)
// run and are checked against the CPU reference on a machine without a GPU
// (tests/emu/test_ops_emu.c; built by the Makefile, run by tests/run.sh).
//
// What is emulated, and how faithfully:
// - A CTA's threads are fibers (ucontext) of one OS thread; CTAs run one
//   after another, so function-static variables serve as __shared__ arrays.
//   __syncthreads and warp collectives are real barriers: a thread waits
//   until every live thread of its block (warp) arrives; a barrier that can
//   never complete (divergent __syncthreads) aborts with a message, and so
//   do a __syncthreads that some thread of the block exited before reaching
//   and a full-mask warp collective with exited lanes.
// - ldmatrix (.x4, .trans) and mma.sync m16n8k16 (bf16 in, f32 accumulate)
//   follow the fragment layouts of the PTX ISA; so does wgmma m64nNk16
//   (a warpgroup collective; its shared-memory operands by the canonical
//   no-swizzle layouts of their descriptors, checked uniform across the
//   warpgroup and read through the race detector), deferred like the
//   hardware's: a wgmma runs when a wgmma.wait_group covers its commit
//   group, reading its shared-memory operands then; from its issue until
//   then its accumulator registers hold NaN (a read too early gives NaN), a
//   write to them in that time aborts, and so does a thread that ends with
//   a wgmma in flight. cp.async is deferred: the
//   16 bytes land only when the issuing thread's cp.async.wait_group covers
//   its group (or the thread ends), so reading them earlier sees stale bytes.
//   Dynamic shared memory is filled with 0xFF bytes (NaN in bf16 and f32)
//   before each CTA, so reading a byte no thread wrote shows up as NaN.
// - A shared-memory race detector over what cp.async writes and ldmatrix
//   reads (every shared access of the tensor-core attention kernels), per
//   16-byte granule, by barrier interval ("epoch"): a read of bytes whose
//   cp.async is not yet waited for, a read in the same interval as another
//   thread's wait (a __syncthreads is missing after it), and a cp.async over
//   bytes another warp read, or another thread wrote, in the same interval
//   (a __syncthreads is missing before the overwrite); and a wgmma issued
//   over bytes whose cp.async landed without a fence.proxy.async by its
//   thread since (the async proxy, through which wgmma reads, may not see
//   them). A race aborts, unless
//   dfl_emu_race_fatal(0) asked for a count (dfl_emu_races) instead. Plain
//   C++ loads and stores of shared memory cannot be seen; for them, see the
//   schedules below.
// - Schedules: by default warps run one at a time, each as far as it can
//   before the next (the first warp differs between blocks), lanes in order,
//   so a missing __syncthreads between writing and reading shared memory
//   gives wrong results here. dfl_emu_set_schedule(s) (or DFLASH_EMU_SCHED=s)
//   with s != 0 runs every block in a different seeded order: warps and
//   lanes shuffled, odd s one warp at a time, even s all threads round-robin
//   from one switch point to the next, with extra switch points at cp.async.
//   A kernel without races gives bit-identical results under every schedule
//   (tests/unit/test_ops_cuda.c compares them); a race usually does not.
// - Launch checks as the GPU makes them: block and grid limits, dynamic
//   shared memory over 48 KiB only after cudaFuncSetAttribute raised the
//   kernel's limit (and never over 227 KiB), 16-byte alignment of cp.async
//   and ldmatrix addresses and of the kernels' vector accesses
//   (DEV_CHECK_ALIGN in kernels/common.cuh).
// - The runtime: device memory is host memory, copies are memcpy, streams
//   are no-ops; one fake device with 132 SMs and 227 KiB of opt-in shared
//   memory, whose occupancy query counts blocks by Hopper's thread and
//   shared-memory limits. cuBLAS: cublasGemmEx and cublasGemmGroupedBatchedEx by their
//   column-major definitions, f32 accumulation; the grouped call checks
//   that its pointer arrays and every matrix lie in (emulated) device
//   memory, and the bf16 pointer alignment the cuBLAS documentation asks
//   for (both fault on the GPU), and can be made to answer
//   CUBLAS_STATUS_NOT_SUPPORTED (dfl_emu_grouped_not_supported); allocations
//   over a size can be made to fail (dfl_emu_alloc_limit), as on a device
//   without the memory.
// Not emulated: timing, bank conflicts, the asynchrony of streams, memory
// ordering between blocks.
#ifndef DFLASH_CUDA_EMU_H
#define DFLASH_CUDA_EMU_H

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

extern "C" {
#include "common.h"
}
extern "C" float dfl_f16_to_f32(uint16_t h);

struct emu_uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct float2 {
    float x, y;
};
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct uint4 {
    uint32_t x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    uint32_t x, y;
};

// ---- bf16 and f16 -----------------------------------------------------------

struct __nv_bfloat16 {
    uint16_t x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
struct __half {
    uint16_t x;
};

// round to nearest even, as __float2bfloat16_rn: the CPU reference's own
// conversions (lib/common.h)
static inline float __bfloat162float(__nv_bfloat16 b) { return dfl_bf16_to_f32(b.x); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{dfl_f32_to_bf16(f)}; }
static inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
static inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    return float2{__bfloat162float(v.x), __bfloat162float(v.y)};
}
static inline float __half2float(__half h) { return dfl_f16_to_f32(h.x); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// ---- threads, warps, blocks -------------------------------------------------

namespace emu {

struct Fiber;
extern Fiber *cur;
extern emu_uint3 g_block;
extern dim3 g_blockdim, g_griddim;
emu_uint3 &cur_tid();

void syncthreads();
void syncwarp();
uint32_t shfl_xor(uint32_t v, int o);
uint32_t ballot(bool p);
void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p, bool trans);
void mma_m16n8k16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1);
// wgmma.mma_async.m64nNk16 (bf16 in, f32 accumulate), a collective of the
// 128 threads of a warpgroup (4 consecutive warps from a multiple of 4),
// carried out at the wgmma_wait that covers it (the A registers are copied
// at issue): d[N/2] this thread's accumulators (added to when
// scale_d), A from this thread's 4 registers a, or from shared memory by
// a_desc when a is NULL (M-major when tnsp_a); B from shared memory by
// b_desc, N-major when tnsp_b. Descriptors as the PTX ISA defines them (start, leading and
// stride byte offsets >> 4), no-swizzle layouts only, addresses in the
// dynamic shared memory's window (smem_addr).
void wgmma_m64k16(float *d, int N, const uint32_t *a, uint64_t a_desc, uint64_t b_desc, bool tnsp_a, bool tnsp_b,
                  bool scale_d);
// wgmma.commit_group (the wgmma issued since the last commit form a group)
// and wgmma.wait_group n (all but the n most recent groups complete), the
// latter a collective of the warpgroup
void wgmma_commit();
void wgmma_wait(int n);
// fence.proxy.async.shared::cta: a wgmma may read what this thread's
// cp.async wrote only after this thread's fence (following the wait that
// landed it); the emulation aborts otherwise
void fence_proxy_async();
uint32_t smem_addr(const void *p);
void *dyn_smem();
// cp.async 16 bytes (zeros when !valid), deferred to the wait that covers it
void cp_async16(void *smem, const void *gmem, bool valid);
void cp_async_commit();
void cp_async_wait(int n);
// a vector access of `a` bytes at p must be aligned to a (dies otherwise)
void check_align(const void *p, size_t a, const char *file, int line);
// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) for kernel `fn`
int set_max_dyn_smem(const void *fn, int bytes);

// Runs `body` as every thread of every block of the grid.
struct Body {
    virtual void run() = 0;
    virtual ~Body() {}
};
void run_grid(dim3 grid, dim3 block, size_t smem, Body *body, const void *fn);

template <typename F>
struct FnBody : Body {
    F *f;
    void run() override { (*f)(); }
};

template <typename K>
struct Launch {
    dim3 g, b;
    size_t smem;
    K k;
    template <typename... A>
    void operator()(A... a) {
        auto fn = [&]() { k(a...); };
        FnBody<decltype(fn)> body;
        body.f = &fn;
        run_grid(g, b, smem, &body, reinterpret_cast<const void *>(k));
    }
};
template <typename K>
Launch<K> launcher(dim3 g, dim3 b, size_t smem, K k) {
    return Launch<K>{g, b, smem, k};
}

} // namespace emu

// For tests (tests/unit/test_ops_cuda.c finds them as weak symbols): the
// schedule (0: the default), whether a race aborts (default) or is counted,
// and the count.
extern "C" void dfl_emu_set_schedule(unsigned seed);
extern "C" void dfl_emu_race_fatal(int on);
extern "C" unsigned long dfl_emu_races(void);

#define threadIdx (emu::cur_tid())
#define blockIdx (emu::g_block)
#define blockDim (emu::g_blockdim)
#define gridDim (emu::g_griddim)

static inline void __syncthreads() { emu::syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    emu::syncwarp();
}
static inline unsigned __ballot_sync(unsigned mask, int p) {
    (void)mask;
    return emu::ballot(p != 0);
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int o) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    (void)mask;
    uint32_t u;
    memcpy(&u, &v, 4);
    u = emu::shfl_xor(u, o);
    T r;
    memcpy(&r, &u, 4);
    return r;
}

// ---- runtime ----------------------------------------------------------------

typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2 };
enum cudaDeviceAttr { cudaDevAttrMemoryPoolsSupported = 115 };
typedef void *cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
enum { cudaStreamNonBlocking = 1, cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaDeviceProp {
    char name[256];
    int major, minor, multiProcessorCount;
    size_t sharedMemPerBlockOptin;
};

const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s);
cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int v, size_t w, size_t h, cudaStream_t s);
cudaError_t cudaMemcpy2DAsync(void *d, size_t dpitch, const void *s, size_t spitch, size_t w, size_t h,
                              cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int dev);
// Pinned host memory (refused over dfl_emu_alloc_limit, as device memory)
// and events: the emulated stream has finished its work when a call
// returns, so every event is complete once recorded.
typedef struct emu_event *cudaEvent_t;
enum { cudaEventDisableTiming = 2 };
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
template <typename K>
static inline cudaError_t cudaFuncSetAttribute(K k, int attr, int v) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
    return emu::set_max_dyn_smem(reinterpret_cast<const void *>(k), v) ? cudaSuccess : cudaErrorInvalidValue;
}
// blocks of `threads` threads and `smem` bytes of dynamic shared memory that
// fit on one multiprocessor by Hopper's limits: 2048 threads, 32 blocks,
// 228 KiB of shared memory with 1 KiB reserved a block (registers are not
// modelled)
template <typename K>
static inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *n, K, int threads, size_t smem) {
    if (threads <= 0 || threads > 1024) return cudaErrorInvalidValue;
    const int by_threads = 2048 / threads, by_smem = (int)((size_t)(228 << 10) / (smem + 1024));
    *n = by_threads < by_smem ? by_threads : by_smem;
    if (*n > 32) *n = 32;
    return cudaSuccess;
}

// ---- cuBLAS -----------------------------------------------------------------

typedef void *cublasHandle_t;
typedef int cublasStatus_t;
enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum cublasOperation_t { CUBLAS_OP_N, CUBLAS_OP_T };
enum cudaDataType { CUDA_R_16BF, CUDA_R_32F };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT };

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t n);
enum { CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16 };
static inline cublasStatus_t cublasSetMathMode(cublasHandle_t, int) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B,
                            cudaDataType bt, int ldb, const void *beta, void *C, cudaDataType ct, int ldc,
                            cublasComputeType_t cp, cublasGemmAlgo_t algo);
// For each group g and each of its group_size[g] problems i (in order):
// C_i = alpha[g] op(A_i) op(B_i) + beta[g] C_i with group g's sizes;
// Aarray, Barray, Carray in device memory, every other array on the host.
cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t h, const cublasOperation_t transa_array[],
                                          const cublasOperation_t transb_array[], const int m_array[],
                                          const int n_array[], const int k_array[], const void *alpha_array,
                                          const void *const Aarray[], cudaDataType Atype, const int lda_array[],
                                          const void *const Barray[], cudaDataType Btype, const int ldb_array[],
                                          const void *beta_array, void *const Carray[], cudaDataType Ctype,
                                          const int ldc_array[], int group_count, const int group_size[],
                                          cublasComputeType_t cp);

// For tests (weak in tests/ops_agree.h): make cublasGemmGroupedBatchedEx
// answer CUBLAS_STATUS_NOT_SUPPORTED (on != 0) or compute (0, the
// default); count the calls of cublasGemmEx and of the grouped call that
// computed something (returned success).
extern "C" void dfl_emu_grouped_not_supported(int on);
// cudaMalloc (and cudaMallocAsync, cudaMallocHost) of more than `bytes` fails with
// cudaErrorMemoryAllocation (0: no limit); how many have failed so far
extern "C" void dfl_emu_alloc_limit(size_t bytes);
extern "C" unsigned long dfl_emu_alloc_refused(void);
extern "C" void dfl_emu_blas_calls(unsigned long *gemm, unsigned long *grouped);
// cudaStreamSynchronize calls so far (the host waiting for the whole stream;
// an event synchronisation is not counted: it waits for work long issued)
extern "C" unsigned long dfl_emu_stream_syncs(void);


#endif
