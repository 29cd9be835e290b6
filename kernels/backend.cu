// backend.cu: the CUDA op table (DESIGN §3): device selection, the backend
// state, memory, scratch, and the table itself. The ops live in the other
// kernels/*.cu files (common.cuh lists which file defines what).
#include "common.cuh"

#include <string.h>


dfl_cuda_state g_cuda;
static int g_ready = 0;
static dfl_ops g_table;

void cuda_fail(const char *what, const char *msg, const char *file, int line) {
    fprintf(stderr, "dflash: %s error at %s:%d: %s\n", what, file, line, msg);
    exit(DFL_EX_SOFTWARE);
}

void cuda_after_launch(const char *file, int line) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && g_cuda.sync) e = cudaStreamSynchronize(g_cuda.stream);
    if (e != cudaSuccess) cuda_fail("CUDA", cudaGetErrorString(e), file, line);
}

// ---------------------------------------------------------------------------
// memory

// Out of device memory: what the device has left, then dfl_oom (exit 70).
static void cuda_oom(size_t bytes) {
    (void)cudaGetLastError(); // not sticky: clear it so that cudaMemGetInfo answers
    size_t free_b = 0, total_b = 0;
    char detail[160] = "";
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
        char f[32], t[32];
        snprintf(detail, sizeof detail, "cuda:%d has %s free of %s", g_cuda.dev, dfl_human_bytes(f, (double)free_b),
                 dfl_human_bytes(t, (double)total_b));
    }
    dfl_oom("GPU memory", bytes, detail[0] ? detail : NULL);
}

static void *cuda_alloc(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 1;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) cuda_oom(bytes);
    if (e != cudaSuccess) cuda_fail("CUDA", cudaGetErrorString(e), __FILE__, __LINE__);
    cudaCheck(cudaMemsetAsync(p, 0, bytes, g_cuda.stream));
    return p;
}

static void cuda_free(void *p) {
    if (!p) return;
    cudaCheck(cudaStreamSynchronize(g_cuda.stream)); // nothing queued may still use it
    cudaCheck(cudaFree(p));
}

// Page-locked when the driver gives it, else plain: a 64-byte header before
// the block says which, for cuda_host_free (the block stays 64-byte aligned).
enum { HOST_HEADER = 64, HOST_PINNED = 0x50494e, HOST_PLAIN = 0x504c4e };

static void *cuda_host_alloc(size_t bytes) {
    char *p = NULL;
    if (cudaMallocHost((void **)&p, bytes + HOST_HEADER) == cudaSuccess) {
        *(int *)p = HOST_PINNED;
    } else {
        (void)cudaGetLastError(); // not sticky: left for no later check to find
        p = (char *)dfl_aligned_alloc(bytes + HOST_HEADER); // exits 70 when out of memory
        *(int *)p = HOST_PLAIN;
    }
    return p + HOST_HEADER;
}

static void cuda_host_free(void *q) {
    if (!q) return;
    char *p = (char *)q - HOST_HEADER;
    const int kind = *(int *)p;
    CU_ASSERT(kind == HOST_PINNED || kind == HOST_PLAIN);
    if (kind == HOST_PINNED) {
        cudaCheck(cudaStreamSynchronize(g_cuda.stream)); // no copy queued may still use it
        cudaCheck(cudaFreeHost(p));
    } else {
        free(p);
    }
}

static void cuda_zero(void *p, size_t bytes) {
    if (bytes) cudaCheck(cudaMemsetAsync(p, 0, bytes, g_cuda.stream));
}

static void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g_cuda.stream));
}

static void cuda_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows) {
    if (width && rows)
        cudaCheck(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, g_cuda.stream));
}

// From pageable host memory the copy is staged before the call returns, so
// the caller may reuse host_src at once (CUDA runtime API, "API sync
// behavior"); pinned host memory must stay valid until the next sync.
static void cuda_upload(void *dst, const void *host_src, size_t bytes) {
    if (bytes) cudaCheck(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, g_cuda.stream));
    LAUNCH_CHECK();
}

static void cuda_download(void *host_dst, const void *src, size_t bytes) {
    if (bytes) cudaCheck(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, g_cuda.stream));
    cudaCheck(cudaStreamSynchronize(g_cuda.stream));
}

static void cuda_sync(void) { cudaCheck(cudaStreamSynchronize(g_cuda.stream)); }

static struct {
    void *p;
    size_t cap;
    size_t failed; // the smallest size cuda_scratch_try could not get (0: none): not tried again
} g_scratch[SCRATCH_SLOTS];

// Grow-only: a slot is reallocated only when an op needs more than ever
// before, so this is rare and the allocation is no hot-loop cost. Stream-
// ordered (the old buffer is freed after the work queued on it) where the
// device supports memory pools; otherwise (some virtualised GPUs report no
// pool support, and cudaMallocAsync then fails with "operation not
// supported") a drained stream and plain cudaFree/cudaMalloc.
void *cuda_scratch_try(int slot, size_t bytes) {
    CU_ASSERT(slot >= 0 && slot < SCRATCH_SLOTS);
    if (bytes <= g_scratch[slot].cap) return g_scratch[slot].p;
    if (g_scratch[slot].failed && bytes >= g_scratch[slot].failed) return NULL;
    size_t cap = bytes + bytes / 4 + 256;
    cudaError_t e;
    if (g_cuda.pools) {
        if (g_scratch[slot].p) cudaCheck(cudaFreeAsync(g_scratch[slot].p, g_cuda.stream));
        e = cudaMallocAsync(&g_scratch[slot].p, cap, g_cuda.stream);
    } else {
        cudaCheck(cudaStreamSynchronize(g_cuda.stream));
        if (g_scratch[slot].p) cudaCheck(cudaFree(g_scratch[slot].p));
        e = cudaMalloc(&g_scratch[slot].p, cap);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); // an allocation failure is not sticky: clear it for the next check
        g_scratch[slot].p = NULL;
        g_scratch[slot].cap = 0;
        g_scratch[slot].failed = bytes;
        return NULL;
    }
    g_scratch[slot].cap = cap;
    return g_scratch[slot].p;
}

void *cuda_scratch(int slot, size_t bytes) {
    void *p = cuda_scratch_try(slot, bytes);
    if (!p && bytes) cuda_oom(bytes + bytes / 4 + 256);
    return p;
}

// ---------------------------------------------------------------------------
// the table

static int env_flag(const char *name) {
    const char *s = getenv(name);
    return s && *s && strcmp(s, "0") != 0;
}

static void fill_table(dfl_ops *t) {
    memset(t, 0, sizeof *t);
    t->name = "cuda";
    t->act_bytes = 2;
    t->wt_bytes = 2;
    t->alloc = cuda_alloc;
    t->free = cuda_free;
    t->host_alloc = cuda_host_alloc;
    t->host_free = cuda_host_free;
    t->zero = cuda_zero;
    t->copy = cuda_copy;
    t->copy_2d = cuda_copy_2d;
    t->upload = cuda_upload;
    t->download = cuda_download;
    t->sync = cuda_sync;
    t->load_act = cuda_load_act;
    t->load_wt = cuda_load_wt;
    t->act_to_f32 = cuda_act_to_f32;
    t->act_to_bf16 = cuda_act_to_bf16;
    t->master_to_wt = cuda_master_to_wt;
    t->matmul = cuda_matmul;
    t->matmul_bwd = cuda_matmul_bwd;
    t->matmul_grouped = cuda_matmul_grouped;
    t->rmsnorm = cuda_rmsnorm;
    t->rmsnorm_bwd = cuda_rmsnorm_bwd;
    t->rmsnorm1p = cuda_rmsnorm1p;
    t->rope = cuda_rope;
    t->qk_norm_rope = cuda_qk_norm_rope;
    t->qk_norm_rope_bwd = cuda_qk_norm_rope_bwd;
    t->swiglu = cuda_swiglu;
    t->swiglu_bwd = cuda_swiglu_bwd;
    t->swiglu_oss = cuda_swiglu_oss;
    t->add = cuda_add;
    t->add_bias = cuda_add_bias;
    t->embed = cuda_embed;
    t->sigmoid_mul = cuda_sigmoid_mul;
    t->conv1d_silu = cuda_conv1d_silu;
    t->gated_delta = cuda_gated_delta;
    t->moe_route = cuda_moe_route;
    t->gather_rows = cuda_gather_rows;
    t->moe_combine = cuda_moe_combine;
    t->attn_causal = cuda_attn_causal;
    t->attn_dflash = cuda_attn_dflash;
    t->attn_dflash_bwd = cuda_attn_dflash_bwd;
    t->attn_sinks = cuda_attn_sinks;
    t->lmhead_ce = cuda_lmhead_ce;
    t->lmhead_kl = cuda_lmhead_kl;
    t->lmhead_argmax = cuda_lmhead_argmax;
    t->lmhead_sample = cuda_lmhead_sample;
    t->sumsq = cuda_sumsq;
    t->adamw = cuda_adamw;
}

// Every failure before the table exists is "unavailable" (exit 69) with
// CUDA's own words, never an abort: a binary built with CUDA must work, and
// say why, on a machine without a GPU or driver.
extern "C" int dfl_ops_cuda(int dev, const dfl_ops **out) {
    *out = NULL;
    if (g_ready) {
        if (dev != g_cuda.dev)
            return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: this process already uses cuda:%d", dev, g_cuda.dev);
        *out = &g_table;
        return 0;
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return dfl_err(DFL_EX_UNAVAIL, "--device cuda: no CUDA device: %s", cudaGetErrorString(e));
    if (n <= 0) return dfl_err(DFL_EX_UNAVAIL, "--device cuda: no CUDA device: none found");
    if (dev >= n) return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: only %d CUDA device(s) present", dev, n);
    cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, dev)) != cudaSuccess || (e = cudaSetDevice(dev)) != cudaSuccess)
        return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: %s", dev, cudaGetErrorString(e));
    if (prop.major < 9)
        return dfl_err(DFL_EX_UNAVAIL,
                       "--device cuda:%d: %s has compute capability %d.%d; this dflash is built for 9.0 (Hopper) and newer",
                       dev, prop.name, prop.major, prop.minor);
    memset(&g_cuda, 0, sizeof g_cuda);
    g_cuda.dev = dev;
    g_cuda.sm_count = prop.multiProcessorCount;
    g_cuda.sm90 = prop.major == 9 && prop.minor == 0;
    g_cuda.smem_optin = prop.sharedMemPerBlockOptin;
    int pools = 0;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev) != cudaSuccess) {
        pools = 0;
        (void)cudaGetLastError(); // not left for the first LAUNCH_CHECK to find
    }
    g_cuda.pools = pools;
    g_cuda.simple = env_flag("DFLASH_CUDA_SIMPLE");
    g_cuda.sync = env_flag("DFLASH_CUDA_SYNC");
    g_cuda.no_grouped = env_flag("DFLASH_CUDA_NO_GROUPED");
    const char *rows = getenv("DFLASH_CUDA_LMHEAD_ROWS");
    g_cuda.lmhead_rows = rows ? atoll(rows) : 0;
    const char *conv_rows = getenv("DFLASH_CUDA_CONV_ROWS");
    g_cuda.conv_rows = conv_rows ? atoll(conv_rows) : 0;
    if ((e = cudaStreamCreateWithFlags(&g_cuda.stream, cudaStreamNonBlocking)) != cudaSuccess)
        return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: %s", dev, cudaGetErrorString(e));
    cublasStatus_t s = cublasCreate(&g_cuda.blas);
    if (s != CUBLAS_STATUS_SUCCESS)
        return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: cuBLAS: %s", dev, cublasGetStatusString(s));
    g_cuda.blas_ws_bytes = 32u << 20;
    if ((e = cudaMalloc(&g_cuda.blas_ws, g_cuda.blas_ws_bytes)) != cudaSuccess)
        return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: %s", dev, cudaGetErrorString(e));
    cublasCheck(cublasSetStream(g_cuda.blas, g_cuda.stream));
    // bf16 results: no split-K partial sums rounded to bf16 (accuracy, and
    // results that do not depend on the algorithm cuBLAS picks as much)
    cublasCheck(cublasSetMathMode(g_cuda.blas, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    cublasCheck(cublasSetWorkspace(g_cuda.blas, g_cuda.blas_ws, g_cuda.blas_ws_bytes));
    fill_table(&g_table);
    if (env_flag("DFLASH_CUDA_PROFILE")) {
        cuda_prof_init();
        cuda_prof_wrap(&g_table);
    }
    g_ready = 1;
    *out = &g_table;
    return 0;
}
