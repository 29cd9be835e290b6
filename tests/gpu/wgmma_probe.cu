// wgmma_probe.cu: do the wgmma descriptors of kernels/attention.cuh read
// shared memory the way the attention kernels assume? One warpgroup
// multiplies random bf16 tiles laid out as the kernels lay them out
// (core-matrix tiles, no swizzle), in each operand form the kernels use, and
// the result is compared with the product computed here in double:
//
//   S  = Q K^T  K-major A and B from shared memory (forward S, dk/dv S^T)
//   O  = P V    A from registers, B N-major (forward P V, dk/dv P^T dO)
//   dQ = dS K   A M-major, B N-major (dq from the stored dS)
//
// and the overlapped forward's two groups in flight (S, then P V), waited
// for one at a time.
//
// For the transposed operands it also tries each descriptor with its two
// byte offsets swapped, so that a failing run says which reading the card
// has. Exit 0 when every form passes as the kernels build it, 1 when one
// fails, 2 without a 9.0 device. Built by tests/gpu/profile.sh and run.sh
// with nvcc for sm_90a; tests/cli/test_gpu_bench.sh also builds it against
// the emulation (tests/emu), where the kernels' layouts must hold and the
// swapped ones fail.
//
//   wgmma_probe
#include "attention.cuh"

#include <math.h>

using namespace attn;

dfl_cuda_state g_cuda; // the launch macros' stream (0: the default one); no backend here

namespace {

constexpr int PD = 128; // head dimension of the tiles
constexpr int PK = 64;  // keys (and rows) of a tile

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
            exit(2);                                                                           \
        }                                                                                      \
    } while (0)

// a row-major [rows][cols] tile into core-matrix order in shared memory
// (cm_off), by plain stores
template <int COLS>
__device__ void to_cm(bf16 *s, const bf16 *g, int rows) {
    for (int i = threadIdx.x; i < rows * COLS; i += blockDim.x) {
        const int r = i / COLS, c = i % COLS;
        s[cm_off<COLS>(r, c / 8) + c % 8] = g[i];
    }
    fence_proxy_async(); // generic stores, read by wgmma through the async proxy
    __syncthreads();
}

// this thread's accumulator fragments (n8 blocks of N columns) into out[64][N]
template <int N>
__device__ void store_acc(float *out, const float *acc) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, r = 16 * w + l / 4, c = l % 4;
    for (int i = 0; i < N / 8; i++)
        for (int e = 0; e < 4; e++) out[(r + 8 * (e / 2)) * N + 8 * i + 2 * c + e % 2] = acc[4 * i + e];
}

// S[64][64] = Q[64][PD] K[64][PD]^T, both K-major (the kernels' offsets)
__global__ void probe_s(float *out, const bf16 *q, const bf16 *k) {
    DYN_SMEM(bf16, sQ);
    bf16 *sK = sQ + PK * PD;
    to_cm<PD>(sQ, q, PK);
    to_cm<PD>(sK, k, PK);
    float s[PK / 2];
    wg_fence();
    for (int ks = 0; ks < PD / 16; ks++)
        wgmma_ss<PK>(s, wg_desc(sQ + ks * 128, 128, PD * 16), wg_desc(sK + ks * 128, 128, PD * 16), ks);
    wg_commit();
    wg_wait<0>();
    store_acc<PK>(out, s);
}

// this thread's A fragments of P[64][64] (row-major in global memory), as
// the kernels hold P in registers
__device__ void p_frags(uint32_t (*a)[4], const bf16 *p) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, r = 16 * w + l / 4, c = l % 4;
    auto pair = [&](int row, int col) { // two bf16 of P, the lower column in the low half
        const uint16_t lo = *(const uint16_t *)&p[row * PK + col], hi = *(const uint16_t *)&p[row * PK + col + 1];
        return (uint32_t)lo | (uint32_t)hi << 16;
    };
    for (int kk = 0; kk < PK / 16; kk++) {
        const int k0 = 16 * kk + 2 * c;
        a[kk][0] = pair(r, k0), a[kk][1] = pair(r + 8, k0), a[kk][2] = pair(r, k0 + 8), a[kk][3] = pair(r + 8, k0 + 8);
    }
}

// O[64][PD] = P[64][64] V[64][PD]: P from registers, V N-major with
// leading/stride byte offsets lbo/sbo (the kernels: PD*16, 128)
__global__ void probe_o(float *out, const bf16 *p, const bf16 *v, uint32_t lbo, uint32_t sbo) {
    DYN_SMEM(bf16, sV);
    to_cm<PD>(sV, v, PK);
    uint32_t a[PK / 16][4];
    p_frags(a, p);
    float o[PD / 2];
    for (int i = 0; i < PD / 2; i++) o[i] = 0.0f;
    wg_fence();
    for (int kk = 0; kk < PK / 16; kk++) wgmma_rs_t<PD>(o, a[kk], wg_desc(sV + kk * 16 * PD, lbo, sbo), 1);
    wg_commit();
    wg_wait<0>();
    store_acc<PD>(out, o);
}

// dQ[64][PD] = dS[64][64] K[64][PD]: dS^T stored [key][row] (an M-major A,
// offsets alo/aso; the kernels: 64*16, 128), K N-major (blo/bso; PD*16, 128)
__global__ void probe_dq(float *out, const bf16 *dst, const bf16 *k, uint32_t alo, uint32_t aso, uint32_t blo,
                         uint32_t bso) {
    DYN_SMEM(bf16, sS);
    bf16 *sK = sS + PK * PK;
    to_cm<PK>(sS, dst, PK);
    to_cm<PD>(sK, k, PK);
    float acc[PD / 2];
    for (int i = 0; i < PD / 2; i++) acc[i] = 0.0f;
    wg_fence();
    for (int kk = 0; kk < PK / 16; kk++)
        wgmma_ss<PD, true>(acc, wg_desc(sS + kk * 16 * PK, alo, aso), wg_desc(sK + kk * 16 * PD, blo, bso), 1);
    wg_commit();
    wg_wait<0>();
    store_acc<PD>(out, acc);
}

// The overlapped forward's schedule in miniature: S = Q K^T committed as
// one group, O = P V as the next; after wait_group 1 the older group (S) is
// complete and S is read; after wait_group 0, O.
__global__ void probe_pipe(float *out_s, float *out_o, const bf16 *q, const bf16 *k, const bf16 *p, const bf16 *v) {
    DYN_SMEM(bf16, sQ);
    bf16 *sK = sQ + PK * PD, *sV = sK + PK * PD;
    to_cm<PD>(sQ, q, PK);
    to_cm<PD>(sK, k, PK);
    to_cm<PD>(sV, v, PK);
    uint32_t a[PK / 16][4];
    p_frags(a, p);
    float s[PK / 2], o[PD / 2];
    for (int i = 0; i < PD / 2; i++) o[i] = 0.0f;
    wg_fence();
    for (int ks = 0; ks < PD / 16; ks++)
        wgmma_ss<PK>(s, wg_desc(sQ + ks * 128, 128, PD * 16), wg_desc(sK + ks * 128, 128, PD * 16), ks);
    wg_commit();
    for (int kk = 0; kk < PK / 16; kk++) wgmma_rs_t<PD>(o, a[kk], wg_desc(sV + kk * 16 * PD, PD * 16, 128), 1);
    wg_commit();
    wg_wait<1>();
    store_acc<PK>(out_s, s);
    wg_wait<0>();
    store_acc<PD>(out_o, o);
}

// ---- host --------------------------------------------------------------------

uint64_t g_state = 0x9e3779b97f4a7c15ull;
float uniform_pm1() {
    g_state = g_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_state >> 40) & 0xffffff) / (float)0x800000 - 1.0f;
}

// n random bf16 on the device; their values (exactly) in host[]
bf16 *random_tile(float *host, int n) {
    bf16 *h = (bf16 *)malloc((size_t)n * sizeof(bf16));
    for (int i = 0; i < n; i++) {
        h[i] = __float2bfloat16_rn(uniform_pm1());
        host[i] = __bfloat162float(h[i]);
    }
    bf16 *d;
    CK(cudaMalloc((void **)&d, (size_t)n * sizeof(bf16)));
    CK(cudaMemcpyAsync(d, h, (size_t)n * sizeof(bf16), cudaMemcpyHostToDevice, g_cuda.stream));
    CK(cudaStreamSynchronize(g_cuda.stream));
    free(h);
    return d;
}

// wait for the kernel just launched, and check it
void finish(void) {
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(g_cuda.stream));
}

// Σ(a-b)² / Σb² of the device result against the reference
double nmse(const float *dev, const double *ref, int n) {
    float *h = (float *)malloc((size_t)n * 4);
    CK(cudaMemcpyAsync(h, dev, (size_t)n * 4, cudaMemcpyDeviceToHost, g_cuda.stream));
    CK(cudaStreamSynchronize(g_cuda.stream));
    double e = 0, s = 0;
    for (int i = 0; i < n; i++) e += (h[i] - ref[i]) * (h[i] - ref[i]), s += ref[i] * ref[i];
    free(h);
    return s > 0 ? e / s : e;
}

// a[m][kn] (ta: stored [kn][m]) times b[kn][n] (tb: stored [n][kn]), in double
void ref_product(double *c, const float *a, bool ta, const float *b, bool tb, int m, int kn, int n) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int t = 0; t < kn; t++) s += (double)(ta ? a[t * m + i] : a[i * kn + t]) * (tb ? b[j * kn + t] : b[t * n + j]);
            c[i * n + j] = s;
        }
}

const double LIMIT = 1e-10; // f32 accumulation of exact bf16 products: ~1e-14; a wrong layout: ~1

int report(const char *what, double e) {
    const int ok = e <= LIMIT;
    printf("%-64s %s (nmse %.2e)\n", what, ok ? "ok" : "FAIL", e);
    return ok;
}

} // namespace

int main(void) {
    int dev = 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("wgmma_probe: %s, compute capability %d.%d\n", prop.name, prop.major, prop.minor);
    if (prop.major != 9 || prop.minor != 0) {
        printf("not a 9.0 device: the sm_90a code does not run here\n");
        return 2;
    }
    float *hq = (float *)malloc(PK * PD * 4), *hk = (float *)malloc(PK * PD * 4), *hv = (float *)malloc(PK * PD * 4);
    float *hp = (float *)malloc(PK * PK * 4);
    bf16 *q = random_tile(hq, PK * PD), *k = random_tile(hk, PK * PD), *v = random_tile(hv, PK * PD);
    bf16 *p = random_tile(hp, PK * PK);
    float *out;
    CK(cudaMalloc((void **)&out, PK * PD * 4));
    double *ref = (double *)malloc(PK * PD * sizeof(double));
    int all = 1;

    const size_t s_smem = 2 * PK * PD * sizeof(bf16);
    CK(cudaFuncSetAttribute(probe_s, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s_smem));
    KLAUNCH(probe_s, 1, 128, s_smem)(out, q, k);
    finish();
    ref_product(ref, hq, false, hk, true, PK, PD, PK);
    all &= report("S = Q K^T: K-major A and B", nmse(out, ref, PK * PK));

    // the swapped variants read past the tile: room for them (64 and 96 KiB)
    ref_product(ref, hp, false, hv, false, PK, PK, PD);
    const size_t o_smem = 4 * PK * PD * sizeof(bf16);
    CK(cudaFuncSetAttribute(probe_o, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)o_smem));
    for (int swap = 0; swap < 2; swap++) {
        CK(cudaMemsetAsync(out, 0, PK * PD * 4, g_cuda.stream));
        KLAUNCH(probe_o, 1, 128, o_smem)(out, p, v, swap ? 128u : (uint32_t)PD * 16, swap ? (uint32_t)PD * 16 : 128u);
        finish();
        const int ok = report(swap ? "O = P V: register A, N-major B, offsets swapped (not the kernels')"
                                   : "O = P V: register A, N-major B (as the kernels)",
                              nmse(out, ref, PK * PD));
        if (!swap) all &= ok;
    }

    // dS^T is hp read as [key][row]: dQ = (hp^T) K
    ref_product(ref, hp, true, hk, false, PK, PK, PD);
    const size_t dq_smem = (PK * PK + 5 * PK * PD) * sizeof(bf16);
    CK(cudaFuncSetAttribute(probe_dq, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dq_smem));
    for (int variant = 0; variant < 4; variant++) {
        const bool sa = variant & 1, sb = variant & 2;
        CK(cudaMemsetAsync(out, 0, PK * PD * 4, g_cuda.stream));
        KLAUNCH(probe_dq, 1, 128, dq_smem)(out, p, k, sa ? 128u : (uint32_t)PK * 16, sa ? (uint32_t)PK * 16 : 128u,
                                           sb ? 128u : (uint32_t)PD * 16, sb ? (uint32_t)PD * 16 : 128u);
        finish();
        char what[96];
        snprintf(what, sizeof what, "dQ = dS K: M-major A%s, N-major B%s%s", sa ? " (swapped)" : "",
                 sb ? " (swapped)" : "", variant ? "" : " (as the kernels)");
        const int ok = report(what, nmse(out, ref, PK * PD));
        if (!variant) all &= ok;
    }
    // two groups in flight, waited for one at a time (DFLASH_CUDA_WGMMA_PIPE)
    float *out2;
    CK(cudaMalloc((void **)&out2, PK * PK * 4));
    const size_t pipe_smem = 3 * PK * PD * sizeof(bf16);
    CK(cudaFuncSetAttribute(probe_pipe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pipe_smem));
    KLAUNCH(probe_pipe, 1, 128, pipe_smem)(out2, out, q, k, p, v);
    finish();
    ref_product(ref, hq, false, hk, true, PK, PD, PK);
    all &= report("overlap: S after wait_group 1, P V still in flight", nmse(out2, ref, PK * PK));
    ref_product(ref, hp, false, hv, false, PK, PK, PD);
    all &= report("overlap: P V after wait_group 0", nmse(out, ref, PK * PD));
    CK(cudaFree(out2));

    printf("wgmma_probe: %s\n", all ? "the kernels' layouts hold" : "a layout the kernels use does NOT hold");
    return all ? 0 : 1;
}
