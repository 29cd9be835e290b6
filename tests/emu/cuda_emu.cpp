// cuda_emu.cpp: the CPU emulation behind cuda_emu.h (what it covers and
// what it does not is said there).
#include "cuda_emu.h"

#include <setjmp.h>
#include <ucontext.h>

#include <vector>

namespace emu {

enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
enum { OP_NONE, OP_SYNC, OP_SHFL, OP_BALLOT, OP_LDSM, OP_LDSM_T, OP_MMA };

// A fiber starts once through setcontext (on its own stack) and from then
// on switches with _setjmp/_longjmp, which save no signal mask: no system
// call per switch, unlike swapcontext.
struct Fiber {
    ucontext_t ctx;
    jmp_buf jb;
    bool started;
    char *stack;
    emu_uint3 tid;
    int warp, lane, state;
};

// One warp's pending collective: every live lane deposits its operands and
// where its result goes; the last lane to arrive computes all results.
struct Warp {
    int size, arrived, done, op;
    uint32_t in[32][6];
    const void *ptr[32];
    void *out[32][4];
};

Fiber *cur;
emu_uint3 g_block;
dim3 g_blockdim, g_griddim;

static const size_t STACK = 256 << 10;
static std::vector<Fiber> fibers;
static std::vector<Warp> warps;
static jmp_buf sched;
static int nthreads, block_arrived, done_count;
static Body *body;
static unsigned char *smem_buf;
static const size_t SMEM_MAX = 228 << 10;

[[noreturn]] static void die(const char *msg) {
    fprintf(stderr, "cuda_emu: block (%u,%u,%u) thread %u: %s\n", g_block.x, g_block.y, g_block.z,
            cur ? cur->tid.x : 0u, msg);
    abort();
}

emu_uint3 &cur_tid() { return cur->tid; }
void *dyn_smem() { return smem_buf; }

static void yield() {
    if (_setjmp(cur->jb) == 0) _longjmp(sched, 1);
}

static void release_block() {
    for (auto &f : fibers)
        if (f.state == WAIT_BLOCK) f.state = RUN;
    block_arrived = 0;
}

static void compute_warp(Warp &w, int wi);

static void complete_warp_if_ready(int wi) {
    Warp &w = warps[wi];
    if (w.arrived == 0 || w.arrived + w.done < w.size) return;
    if (w.done) die("a full-mask warp collective with exited lanes");
    compute_warp(w, wi);
    for (int l = 0; l < w.size; l++) {
        Fiber &f = fibers[wi * 32 + l];
        if (f.state == WAIT_WARP) f.state = RUN;
    }
    w.arrived = 0;
    w.op = OP_NONE;
}

static void fiber_main() {
    body->run();
    cur->state = DONE;
    done_count++;
    warps[cur->warp].done++;
    if (block_arrived && block_arrived + done_count == nthreads) release_block();
    complete_warp_if_ready(cur->warp);
    _longjmp(sched, 1); // never resumed
}

void syncthreads() {
    cur->state = WAIT_BLOCK;
    if (++block_arrived + done_count == nthreads) release_block();
    yield();
}

// Deposit this lane's part of collective `op` and wait for the warp.
static void collective(int op) {
    Warp &w = warps[cur->warp];
    if (w.op != OP_NONE && w.op != op) die("lanes of a warp in different collectives");
    w.op = op;
    cur->state = WAIT_WARP;
    w.arrived++;
    complete_warp_if_ready(cur->warp);
    yield();
}

void syncwarp() { collective(OP_SYNC); }

uint32_t shfl_xor(uint32_t v, int o) {
    Warp &w = warps[cur->warp];
    uint32_t r;
    w.in[cur->lane][0] = v;
    w.in[cur->lane][1] = (uint32_t)o;
    w.out[cur->lane][0] = &r;
    collective(OP_SHFL);
    return r;
}

uint32_t ballot(bool p) {
    Warp &w = warps[cur->warp];
    uint32_t r;
    w.in[cur->lane][0] = p;
    w.out[cur->lane][0] = &r;
    collective(OP_BALLOT);
    return r;
}

void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p, bool trans) {
    Warp &w = warps[cur->warp];
    w.ptr[cur->lane] = p;
    w.out[cur->lane][0] = &r0, w.out[cur->lane][1] = &r1, w.out[cur->lane][2] = &r2, w.out[cur->lane][3] = &r3;
    collective(trans ? OP_LDSM_T : OP_LDSM);
}

void mma_m16n8k16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    Warp &w = warps[cur->warp];
    uint32_t *in = w.in[cur->lane];
    in[0] = a[0], in[1] = a[1], in[2] = a[2], in[3] = a[3], in[4] = b0, in[5] = b1;
    w.out[cur->lane][0] = c;
    collective(OP_MMA);
}

static float bf(uint16_t h) {
    __nv_bfloat16 b;
    b.x = h;
    return __bfloat162float(b);
}

static void compute_warp(Warp &w, int wi) {
    (void)wi;
    if ((w.op == OP_LDSM || w.op == OP_LDSM_T || w.op == OP_MMA || w.op == OP_SHFL) && w.size != 32)
        die("a fragment collective in a partial warp");
    switch (w.op) {
    case OP_SYNC:
        break;
    case OP_SHFL:
        for (int l = 0; l < w.size; l++) *(uint32_t *)w.out[l][0] = w.in[l ^ w.in[l][1]][0];
        break;
    case OP_BALLOT: {
        uint32_t m = 0;
        for (int l = 0; l < w.size; l++) m |= (w.in[l][0] ? 1u : 0u) << l;
        for (int l = 0; l < w.size; l++) *(uint32_t *)w.out[l][0] = m;
        break;
    }
    case OP_LDSM:
    case OP_LDSM_T:
        // lanes 8m..8m+7 give the row addresses of matrix m (8 rows of 8 b16)
        for (int l = 0; l < 32; l++)
            for (int m = 0; m < 4; m++) {
                uint16_t lo, hi;
                if (w.op == OP_LDSM) { // (row l/4, cols 2(l%4), +1)
                    const uint16_t *row = (const uint16_t *)w.ptr[8 * m + l / 4];
                    lo = row[2 * (l % 4)], hi = row[2 * (l % 4) + 1];
                } else { // (rows 2(l%4), +1; col l/4)
                    lo = ((const uint16_t *)w.ptr[8 * m + 2 * (l % 4)])[l / 4];
                    hi = ((const uint16_t *)w.ptr[8 * m + 2 * (l % 4) + 1])[l / 4];
                }
                *(uint32_t *)w.out[l][m] = (uint32_t)lo | (uint32_t)hi << 16;
            }
        break;
    case OP_MMA: {
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; l++) {
            int g = l / 4, c = l % 4;
            const uint32_t *in = w.in[l];
            const float *acc = (const float *)w.out[l][0];
            A[g][2 * c] = bf(in[0] & 0xffff), A[g][2 * c + 1] = bf(in[0] >> 16);
            A[g + 8][2 * c] = bf(in[1] & 0xffff), A[g + 8][2 * c + 1] = bf(in[1] >> 16);
            A[g][2 * c + 8] = bf(in[2] & 0xffff), A[g][2 * c + 9] = bf(in[2] >> 16);
            A[g + 8][2 * c + 8] = bf(in[3] & 0xffff), A[g + 8][2 * c + 9] = bf(in[3] >> 16);
            B[2 * c][g] = bf(in[4] & 0xffff), B[2 * c + 1][g] = bf(in[4] >> 16);
            B[2 * c + 8][g] = bf(in[5] & 0xffff), B[2 * c + 9][g] = bf(in[5] >> 16);
            C[g][2 * c] = acc[0], C[g][2 * c + 1] = acc[1], C[g + 8][2 * c] = acc[2], C[g + 8][2 * c + 1] = acc[3];
        }
        float D[16][8];
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 8; j++) {
                float s = C[i][j];
                for (int k = 0; k < 16; k++) s += A[i][k] * B[k][j];
                D[i][j] = s;
            }
        for (int l = 0; l < 32; l++) {
            int g = l / 4, c = l % 4;
            float *acc = (float *)w.out[l][0];
            acc[0] = D[g][2 * c], acc[1] = D[g][2 * c + 1], acc[2] = D[g + 8][2 * c], acc[3] = D[g + 8][2 * c + 1];
        }
        break;
    }
    default:
        die("unknown collective");
    }
}

// Run fiber f until it yields or ends (in a frame of its own: nothing
// here changes between the _setjmp and the _longjmp back).
__attribute__((noinline)) static void resume(Fiber *f) {
    cur = f;
    if (_setjmp(sched) == 0) {
        if (!f->started) f->started = true, setcontext(&f->ctx);
        else _longjmp(f->jb, 1);
    }
}

static void run_block() {
    block_arrived = done_count = 0;
    for (size_t i = 0; i < warps.size(); i++) warps[i].arrived = warps[i].done = 0, warps[i].op = OP_NONE;
    for (int i = 0; i < nthreads; i++) {
        Fiber &f = fibers[i];
        f.state = RUN;
        f.started = false;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = NULL;
        makecontext(&f.ctx, fiber_main, 0);
    }
    memset(smem_buf, 0xff, SMEM_MAX);
    // Warps run one at a time, each as far as it can go (to a block barrier
    // or its end) before the next, starting from a different warp in each
    // block: a warp that overwrites shared memory another warp still reads,
    // or reads what another has not written yet, for want of a barrier, then
    // computes a wrong result instead of getting lucky.
    const int nw = (int)warps.size();
    const int first = (int)((g_block.x + 3u * g_block.y + 5u * g_block.z) % (unsigned)nw);
    for (;;) {
        bool ran = false;
        for (int k = 0; k < nw; k++) {
            int w = (first + k) % nw;
            for (bool again = true; again;) {
                again = false;
                for (int i = 32 * w; i < 32 * w + warps[w].size; i++) {
                    if (fibers[i].state != RUN) continue;
                    resume(&fibers[i]);
                    ran = again = true;
                }
            }
        }
        if (done_count == nthreads) break;
        if (!ran) die("deadlock: a barrier that not every live thread reaches");
    }
    cur = NULL;
}

void run_grid(dim3 grid, dim3 block, size_t smem, Body *b) {
    if (smem > SMEM_MAX) die("dynamic shared memory over 228 KiB");
    if (!smem_buf) smem_buf = (unsigned char *)aligned_alloc(128, SMEM_MAX);
    int n = (int)(block.x * block.y * block.z);
    if (n <= 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0) die("invalid launch configuration");
    if ((int)fibers.size() < n) {
        size_t old = fibers.size();
        fibers.resize(n);
        for (size_t i = old; i < (size_t)n; i++) fibers[i].stack = (char *)malloc(STACK);
    }
    nthreads = n;
    warps.assign((n + 31) / 32, Warp());
    for (int i = 0; i < n; i++) {
        Fiber &f = fibers[i];
        f.tid.x = (unsigned)i % block.x;
        f.tid.y = (unsigned)i / block.x % block.y;
        f.tid.z = (unsigned)i / (block.x * block.y);
        f.warp = i / 32, f.lane = i % 32;
    }
    for (int i = 0; i < (int)warps.size(); i++) warps[i].size = n - 32 * i < 32 ? n - 32 * i : 32;
    g_blockdim = block, g_griddim = grid;
    body = b;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                g_block.x = x, g_block.y = y, g_block.z = z;
                run_block();
            }
}

} // namespace emu

// ---- runtime ----------------------------------------------------------------

const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
    (void)dev;
    memset(p, 0, sizeof *p);
    strcpy(p->name, "dflash CPU emulation of an H200");
    p->major = 9, p->minor = 0, p->multiProcessorCount = 132;
    p->sharedMemPerBlockOptin = 227 << 10;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = NULL;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = aligned_alloc(256, (n + 255) / 256 * 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void *p) {
    free(p);
    return cudaSuccess;
}
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t) {
    cudaError_t e = cudaMalloc(p, n);
    if (e == cudaSuccess) memset(*p, 0xff, n); // uninitialised, as on a GPU
    return e;
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
    memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemset2DAsync(void *p, size_t pitch, int v, size_t w, size_t h, cudaStream_t) {
    for (size_t r = 0; r < h; r++) memset((char *)p + r * pitch, v, w);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t) {
    memmove(d, s, n);
    return cudaSuccess;
}

// ---- cuBLAS -----------------------------------------------------------------

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = NULL;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void *, size_t) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(cublasStatus_t s) { return s ? "CUBLAS_STATUS_INVALID_VALUE" : "success"; }

static float load_el(const void *p, cudaDataType t, size_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

// C = alpha op(A) op(B) + beta C, column-major: element (i,j) of an
// m-row matrix with leading dimension ld is at i + j*ld.
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType at, int lda, const void *B,
                            cudaDataType bt, int ldb, const void *beta, void *C, cudaDataType ct, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t) {
    if (at != CUDA_R_16BF || bt != CUDA_R_16BF) return CUBLAS_STATUS_INVALID_VALUE;
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    if (lda < (ta == CUBLAS_OP_N ? m : k) || ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
        return CUBLAS_STATUS_INVALID_VALUE;
    float al = *(const float *)alpha, be = *(const float *)beta;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0.0f;
            for (int p = 0; p < k; p++) {
                float a = load_el(A, at, ta == CUBLAS_OP_N ? (size_t)i + (size_t)p * lda : (size_t)p + (size_t)i * lda);
                float b = load_el(B, bt, tb == CUBLAS_OP_N ? (size_t)p + (size_t)j * ldb : (size_t)j + (size_t)p * ldb);
                s += a * b;
            }
            size_t ci = (size_t)i + (size_t)j * ldc;
            float old = be != 0.0f ? load_el(C, ct, ci) : 0.0f;
            float r = al * s + be * old;
            if (ct == CUDA_R_32F) ((float *)C)[ci] = r;
            else ((__nv_bfloat16 *)C)[ci] = __float2bfloat16_rn(r);
        }
    return CUBLAS_STATUS_SUCCESS;
}
