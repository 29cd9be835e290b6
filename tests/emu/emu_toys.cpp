// emu_toys.cpp: small kernels with deliberate bugs of the kinds a CPU run
// hides and a GPU does not forgive (a missing barrier, a missing
// cp.async wait, shared memory over 48 KiB without its attribute, a
// misaligned vector access), each beside its correct twin. They exist to
// show that the emulation's checks (cuda_emu.h: the race detector, the
// schedules, the launch checks) catch them: tests/unit/test_ops_cuda.c runs
// them through dfl_emu_toy(). Test code only; kernels/ holds none of this.
//
// Built with the emulation (Makefile: EMU_SRC), so the same primitives as
// the real kernels (attention.cuh: cp.async, ldmatrix) are used.
#include "attention.cuh"

using namespace attn;

namespace {

// ---- plain shared memory: a neighbour exchange --------------------------------
// out[b*64 + t] = in[b*64 + (t+1) % 64]; without the barrier a thread reads
// its neighbour's slot before (or after) the neighbour wrote it, depending
// on the order the threads run in.
__global__ void toy_exchange(float *out, const float *in, int fixed) {
    __shared__ float buf[64];
    const int t = threadIdx.x;
    buf[t] = in[blockIdx.x * 64 + t];
    if (fixed) __syncthreads();
    out[blockIdx.x * 64 + t] = buf[(t + 1) % 64];
}

// ---- cp.async then ldmatrix ------------------------------------------------------
// 64 rows of 8 bf16 (one 16-byte row per thread of warps 0 and 1) copied
// into shared memory; then each of the 4 warps reads 32 rows with
// ldmatrix.x4: warps 2 and 3 read rows that warps 0 and 1 copied.
// Lane L of warp w writes out[(w*32 + L)*8 + 2m + j], m < 4, j < 2.
enum { FIX = 0, NO_WAIT = 1, NO_BARRIER = 2 };

__device__ void read_rows(float *out, const bf16 *s) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t r[4];
    ldsm_x4(r[0], r[1], r[2], r[3], s + ((w * 32 + lane) % 64) * 8);
    for (int m = 0; m < 4; m++) {
        bf16 b[2];
        memcpy(b, &r[m], 4);
        out[(w * 32 + lane) * 8 + 2 * m] = bf2f(b[0]);
        out[(w * 32 + lane) * 8 + 2 * m + 1] = bf2f(b[1]);
    }
}

__global__ void toy_cp_async(float *out, const bf16 *src, int mode) {
    DYN_SMEM(bf16, s); // [64][8]
    const int t = threadIdx.x;
    if (t < 64) cp_async16(s + t * 8, src + t * 8, true);
    cp_async_commit();
    if (mode != NO_WAIT) cp_async_wait<0>();
    if (mode != NO_BARRIER) __syncthreads();
    read_rows(out, s);
}

// ---- a double-buffered loop --------------------------------------------------------
// 4 stages of 64 rows, stage i from src + i*512, prefetched one ahead into
// two buffers; out accumulates every stage's reads. Without the barrier at
// the end of a step, the next step's prefetch overwrites the buffer that a
// slower warp has not read yet.
__global__ void toy_double_buffer(float *out, const bf16 *src, int fixed) {
    DYN_SMEM(bf16, s); // [2][64][8]
    const int t = threadIdx.x, w = t / 32, lane = t % 32;
    auto issue = [&](int i, int buf) {
        if (t < 64) cp_async16(s + buf * 512 + t * 8, src + i * 512 + t * 8, true);
    };
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    issue(0, 0);
    cp_async_commit();
    for (int it = 0; it < 4; it++) {
        pipeline_step(it + 1 < 4, [&] { issue(it + 1, (it + 1) & 1); });
        uint32_t r[4];
        ldsm_x4(r[0], r[1], r[2], r[3], s + (it & 1) * 512 + ((w * 32 + lane) % 64) * 8);
        for (int m = 0; m < 4; m++) {
            bf16 b[2];
            memcpy(b, &r[m], 4);
            acc[2 * m] += bf2f(b[0]);
            acc[2 * m + 1] += bf2f(b[1]);
        }
        if (fixed) __syncthreads();
    }
    for (int e = 0; e < 8; e++) out[t * 8 + e] = acc[e];
}

// ---- wgmma in flight ----------------------------------------------------------------
// One warpgroup multiplies A (64 x 16, all ones) by B (16 x 64, column n all
// n), both K-major in shared memory: thread t's accumulator j (fragment
// i = j/4, element e = j%4) is 16 * (8i + 2(lane%4) + e%2), written to
// out[t*32 + j]. The buggy modes: read the accumulators before the wait,
// write one of them before it, overwrite B before it, never wait.
enum { WG_FIX = 0, WG_EARLY_READ, WG_WRITE, WG_OVERWRITE, WG_NO_WAIT };

__global__ void toy_wgmma(float *out, int mode) {
    DYN_SMEM(bf16, sa); // [64][16] A, then [64][16] B^T, 8x8 core matrices: LBO 128 B, SBO 256 B
    bf16 *sb = sa + 64 * 16;
    const int t = threadIdx.x;
    auto fill_b = [&](float scale) {
        for (int i = t; i < 64 * 16; i += 128) {
            const int r = i / 16, k = i % 16, off = (r / 8) * 128 + (k / 8) * 64 + (r % 8) * 8 + k % 8;
            sa[off] = f2bf(1.0f);
            sb[off] = f2bf(scale * (float)r);
        }
        fence_proxy_async();
        __syncthreads();
    };
    fill_b(1.0f);
    float d[32];
    for (int j = 0; j < 32; j++) d[j] = 0.0f;
    wg_fence();
    wgmma_ss<64>(d, wg_desc(sa, 128, 256), wg_desc(sb, 128, 256), 0);
    wg_commit();
    if (mode == WG_EARLY_READ)
        for (int j = 0; j < 32; j++) out[t * 32 + j] = d[j];
    if (mode == WG_WRITE) d[5] = 1.0f;
    if (mode == WG_OVERWRITE) fill_b(0.0f);
    if (mode == WG_NO_WAIT) return;
    wg_wait<0>();
    if (mode != WG_EARLY_READ)
        for (int j = 0; j < 32; j++) out[t * 32 + j] = d[j];
}

// The same product with A and B brought in by cp.async: each thread that
// waits for its copies must fence them for the async proxy before the
// barrier, or wgmma may read shared memory as it was before they landed.
// src: A then B^T, already in the core-matrix order of toy_wgmma.
__global__ void toy_wgmma_cp(float *out, const bf16 *src, int fenced) {
    DYN_SMEM(bf16, sa); // as toy_wgmma's
    bf16 *sb = sa + 64 * 16;
    const int t = threadIdx.x;
    for (int c = t; c < 2 * 64 * 16 / 8; c += 128) cp_async16(sa + 8 * c, src + 8 * c, true);
    cp_async_commit();
    cp_async_wait<0>();
    if (fenced) fence_proxy_async();
    __syncthreads();
    float d[32];
    wg_fence();
    wgmma_ss<64>(d, wg_desc(sa, 128, 256), wg_desc(sb, 128, 256), 0);
    wg_commit();
    wg_wait<0>();
    for (int j = 0; j < 32; j++) out[t * 32 + j] = d[j];
}

// ---- launch and alignment checks -----------------------------------------------------
__global__ void toy_big_smem(float *out) {
    DYN_SMEM(float, s);
    s[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}

__global__ void toy_vector(float *out, const bf16 *in) {
    float f[8];
    load_bf16s<8>(f, in);
    out[threadIdx.x] = f[threadIdx.x % 8];
}

// the 64*8 (x4 for the double buffer) bf16 inputs: row r col c of stage i is
// i*64 + r + c/8 rounded to bf16 (not exact past 8 significant bits; the
// test's toy_val rounds alike)
bf16 *toy_rows(int stages) {
    bf16 *p = (bf16 *)malloc((size_t)stages * 512 * sizeof(bf16));
    for (int i = 0; i < stages * 512; i++) p[i] = __float2bfloat16_rn((float)(i / 8) + (float)(i % 8) / 8.0f);
    return p;
}

} // namespace

// Run toy `name` (its correct version when `fixed`) on the emulated device
// under the current schedule; out receives its results (n floats). Returns
// the number of floats written, or -1 for an unknown name or a short out.
// "big_smem" and "misaligned" do not return: the emulation aborts, as the
// GPU fails the launch or the access (the fixed versions do return).
extern "C" int dfl_emu_toy(const char *name, int fixed, float *out, int n) {
    if (!strcmp(name, "exchange")) {
        if (n < 256) return -1;
        float in[256];
        for (int i = 0; i < 256; i++) in[i] = (float)(i + 1);
        KLAUNCH(toy_exchange, 4, 64, 0)(out, in, fixed);
        return 256;
    }
    if (!strcmp(name, "cp_async_wait") || !strcmp(name, "cp_async_barrier")) {
        if (n < 1024) return -1;
        bf16 *src = toy_rows(1);
        int mode = fixed ? FIX : name[9] == 'w' ? NO_WAIT : NO_BARRIER;
        KLAUNCH(toy_cp_async, 1, 128, 64 * 8 * sizeof(bf16))(out, src, mode);
        free(src);
        return 1024;
    }
    if (!strcmp(name, "double_buffer")) {
        if (n < 1024) return -1;
        bf16 *src = toy_rows(4);
        KLAUNCH(toy_double_buffer, 1, 128, 2 * 64 * 8 * sizeof(bf16))(out, src, fixed);
        free(src);
        return 1024;
    }
    if (!strcmp(name, "wgmma_no_proxy_fence")) { // toy_wgmma's product; the buggy version aborts
        if (fixed && n < 4096) return -1;
        bf16 *src = (bf16 *)malloc(2 * 64 * 16 * sizeof(bf16));
        for (int i = 0; i < 64 * 16; i++) {
            const int r = i / 16, k = i % 16, off = (r / 8) * 128 + (k / 8) * 64 + (r % 8) * 8 + k % 8;
            src[off] = __float2bfloat16_rn(1.0f);
            src[64 * 16 + off] = __float2bfloat16_rn((float)r);
        }
        KLAUNCH(toy_wgmma_cp, 1, 128, 2 * 64 * 16 * sizeof(bf16))(out, src, fixed);
        free(src);
        return 4096;
    }
    if (!strncmp(name, "wgmma_", 6)) { // 128 x 32 floats; the aborting modes write none
        static const char *modes[] = {"early_read", "write_in_flight", "overwrite", "no_wait"};
        int mode = -1;
        for (int m = 0; m < 4; m++)
            if (!strcmp(name + 6, modes[m])) mode = m + 1;
        if (mode < 0 || ((mode == WG_EARLY_READ || mode == WG_OVERWRITE || fixed) && n < 4096)) return -1;
        KLAUNCH(toy_wgmma, 1, 128, 2 * 64 * 16 * sizeof(bf16))(out, fixed ? WG_FIX : mode);
        return 4096;
    }
    if (!strcmp(name, "big_smem")) { // 64 KiB
        if (n < 32) return -1;
        if (fixed) cudaFuncSetAttribute(toy_big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10);
        KLAUNCH(toy_big_smem, 1, 32, 64 << 10)(out);
        return 32;
    }
    if (!strcmp(name, "misaligned")) { // a 16-byte load at an offset of 1 bf16
        if (n < 8) return -1;
        alignas(16) bf16 in[16];
        for (int i = 0; i < 16; i++) in[i] = __float2bfloat16_rn((float)i);
        KLAUNCH(toy_vector, 1, 8, 0)(out, fixed ? in + 8 : in + 1);
        return 8;
    }
    return -1;
}
