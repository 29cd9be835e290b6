// gemm_sweep.cu: for each product shape of the benchmarks, the time of the
// call kernels/matmul.cu makes (cublasGemmEx, CUBLAS_GEMM_DEFAULT) against
// every algorithm cuBLASLt's heuristic offers for it, to see what choosing
// the algorithm would gain. bf16 operands, f32 compute; random data (zeros
// time optimistically). One line per shape on stdout.
//
//   gemm_sweep < shapes      (lines: M N K layout out beta, e.g. "16384 4096 4096 nt bf16 0")
//
// layout as kernels/matmul.cu names it, row-major: nt C = A B^T, nn C = A B,
// tn C = A^T B. Built by tests/gpu/profile.sh with nvcc; not part of make.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                  \
    do {                                                                       \
        cudaError_t e_ = (x);                                                  \
        if (e_ != cudaSuccess) {                                               \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                           \
        }                                                                      \
    } while (0)
#define BK(x)                                                                  \
    do {                                                                       \
        cublasStatus_t s_ = (x);                                               \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                     \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cublasGetStatusString(s_)); \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

__global__ void fill(__nv_bfloat16 *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = __float2bfloat16(((float)(h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
    }
}

static cudaStream_t st;
static cudaEvent_t e0, e1;
static const int REPS = 10;

// column-major view of the row-major product (as kernels/matmul.cu): m = N, n = M
struct shape {
    long M, N, K;
    char layout[4], out[8];
    float beta;
    cublasOperation_t opf, ops; // ops of the first (B) and second (A) operand
    long ldf, lds, ldc;
};

static int parse(const char *line, shape *s) {
    if (sscanf(line, "%ld %ld %ld %3s %7s %f", &s->M, &s->N, &s->K, s->layout, s->out, &s->beta) != 6) return 0;
    if (!strcmp(s->layout, "nt")) s->opf = CUBLAS_OP_T, s->ops = CUBLAS_OP_N, s->ldf = s->K, s->lds = s->K;
    else if (!strcmp(s->layout, "nn")) s->opf = CUBLAS_OP_N, s->ops = CUBLAS_OP_N, s->ldf = s->N, s->lds = s->K;
    else if (!strcmp(s->layout, "tn")) s->opf = CUBLAS_OP_N, s->ops = CUBLAS_OP_T, s->ldf = s->N, s->lds = s->M;
    else return 0;
    s->ldc = s->N;
    return 1;
}

template <typename F> static float time_ms(F f) {
    for (int i = 0; i < 2; i++) f();
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < REPS; i++) f();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / REPS;
}

int main(void) {
    cublasHandle_t h;
    cublasLtHandle_t lt;
    CK(cudaStreamCreate(&st));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    BK(cublasCreate(&h));
    BK(cublasLtCreate(&lt));
    BK(cublasSetStream(h, st));
    BK(cublasSetMathMode(h, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    size_t ws_bytes = 32u << 20;
    void *ws;
    CK(cudaMalloc(&ws, ws_bytes));
    BK(cublasSetWorkspace(h, ws, ws_bytes));
    char line[256];
    printf("%-34s %9s %9s %9s %9s %5s %9s\n", "shape (M N K layout out beta)", "GemmEx", "TFLOP/s", "Lt best",
           "TFLOP/s", "algo", "Lt heur0");
    while (fgets(line, sizeof line, stdin)) {
        shape s;
        if (line[0] == '#' || !parse(line, &s)) continue;
        const int f32 = !strcmp(s.out, "f32");
        const size_t na = (size_t)s.M * s.K, nb = (size_t)s.N * s.K, nc = (size_t)s.M * s.N;
        __nv_bfloat16 *A, *B;
        void *C;
        CK(cudaMalloc(&A, na * 2));
        CK(cudaMalloc(&B, nb * 2));
        CK(cudaMalloc(&C, nc * (f32 ? 4 : 2)));
        fill<<<1024, 256, 0, st>>>(A, na, 1);
        fill<<<1024, 256, 0, st>>>(B, nb, 2);
        CK(cudaMemsetAsync(C, 0, nc * (f32 ? 4 : 2), st));
        const float alpha = 1.0f, beta = s.beta;
        const cudaDataType_t ct = f32 ? CUDA_R_32F : CUDA_R_16BF;
        float t_ex = time_ms([&] {
            BK(cublasGemmEx(h, s.opf, s.ops, (int)s.N, (int)s.M, (int)s.K, &alpha, B, CUDA_R_16BF, (int)s.ldf, A,
                            CUDA_R_16BF, (int)s.lds, &beta, C, ct, (int)s.ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
        });
        // cuBLASLt: the same product, every algorithm the heuristic returns
        cublasLtMatmulDesc_t op;
        BK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &s.opf, sizeof s.opf));
        BK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &s.ops, sizeof s.ops));
        const long m = s.N, n = s.M, k = s.K;
        cublasLtMatrixLayout_t la, lb, lc;
        BK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.opf == CUBLAS_OP_N ? m : k, s.opf == CUBLAS_OP_N ? k : m,
                                      s.ldf));
        BK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.ops == CUBLAS_OP_N ? k : n, s.ops == CUBLAS_OP_N ? n : k,
                                      s.lds));
        BK(cublasLtMatrixLayoutCreate(&lc, ct, m, n, s.ldc));
        cublasLtMatmulPreference_t pref;
        BK(cublasLtMatmulPreferenceCreate(&pref));
        BK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                sizeof ws_bytes));
        cublasLtMatmulHeuristicResult_t res[32];
        int got = 0;
        BK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 32, res, &got));
        float best = 1e30f, heur0 = 0;
        int best_i = -1;
        for (int i = 0; i < got; i++) {
            if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
            float t = time_ms([&] {
                BK(cublasLtMatmul(lt, op, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &res[i].algo, ws, ws_bytes, st));
            });
            if (i == 0) heur0 = t;
            if (t < best) best = t, best_i = i;
        }
        const double fl = 2.0 * s.M * s.N * s.K;
        char name[64];
        snprintf(name, sizeof name, "%ld %ld %ld %s %s %g", s.M, s.N, s.K, s.layout, s.out, s.beta);
        printf("%-34s %9.3f %9.1f %9.3f %9.1f %2d/%-2d %9.3f\n", name, t_ex, fl / t_ex / 1e9, best,
               fl / best / 1e9, best_i, got, heur0);
        fflush(stdout);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(op);
        CK(cudaFree(A));
        CK(cudaFree(B));
        CK(cudaFree(C));
    }
    return 0;
}
