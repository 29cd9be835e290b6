// matmul.cu: the dense ops through cuBLAS (bf16 operands, f32 compute and
// accumulation, bf16 or f32 results).
// defines: gemm_nt, gemm_nn, gemm_tn, cuda_matmul, cuda_matmul_bwd
//
// cuBLAS is column-major; a row-major [R,C] matrix with row stride ld is the
// column-major C×R matrix with leading dimension ld. So row-major
// C = A·B becomes column-major C^T = B^T·A^T: every call below swaps the
// operands and passes N before M (targets-extraction.md §1.4).
#include "common.cuh"

#include <limits.h>

static int fits_int(int64_t x) { return x >= 0 && x <= INT_MAX; }

static void gemm(cublasOperation_t opB, cublasOperation_t opA, void *C, int c_f32, const bf16 *A, const bf16 *B,
                 int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta) {
    CU_ASSERT(fits_int(M) && fits_int(N) && fits_int(K) && fits_int(lda) && fits_int(ldb) && fits_int(ldc));
    if (M == 0 || N == 0) return;
    if (K == 0) { // an empty sum: C = beta * C, and only 0 and 1 are used
        CU_ASSERT(beta == 0.0f || beta == 1.0f);
        size_t es = c_f32 ? 4 : 2;
        if (beta == 0.0f)
            cudaCheck(cudaMemset2DAsync(C, (size_t)ldc * es, 0, (size_t)N * es, (size_t)M, g_cuda.stream));
        return;
    }
    cublasCheck(cublasGemmEx(g_cuda.blas, opB, opA, (int)N, (int)M, (int)K, &alpha, B, CUDA_R_16BF, (int)ldb, A,
                             CUDA_R_16BF, (int)lda, &beta, C, c_f32 ? CUDA_R_32F : CUDA_R_16BF, (int)ldc,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    LAUNCH_CHECK();
}

void gemm_nt(void *C, int c_f32, const bf16 *A, const bf16 *B, int64_t M, int64_t N, int64_t K, int64_t lda,
             int64_t ldb, int64_t ldc, float alpha, float beta) {
    CU_ASSERT(lda >= K && ldb >= K && ldc >= N);
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, C, c_f32, A, B, M, N, K, lda, ldb, ldc, alpha, beta);
}

void gemm_nn(void *C, int c_f32, const bf16 *A, const bf16 *B, int64_t M, int64_t N, int64_t K, int64_t lda,
             int64_t ldb, int64_t ldc, float alpha, float beta) {
    CU_ASSERT(lda >= K && ldb >= N && ldc >= N);
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, c_f32, A, B, M, N, K, lda, ldb, ldc, alpha, beta);
}

void gemm_tn(void *C, int c_f32, const bf16 *A, const bf16 *B, int64_t M, int64_t N, int64_t K, int64_t lda,
             int64_t ldb, int64_t ldc, float alpha, float beta) {
    CU_ASSERT(lda >= M && ldb >= N && ldc >= N);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, c_f32, A, B, M, N, K, lda, ldb, ldc, alpha, beta);
}

// out[M,N] (+)= in[M,K] · w[N,K]^T
void cuda_matmul(void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N, int accumulate) {
    CU_ASSERT(out && in && w && M >= 0 && K >= 0 && N >= 0);
    gemm_nt(out, 0, (const bf16 *)in, (const bf16 *)w, M, N, K, K, K, N, 1.0f, accumulate ? 1.0f : 0.0f);
}

// din[M,K] += dout[M,N] · w[N,K];  dw[N,K] += dout^T · in   (dw f32)
void cuda_matmul_bwd(void *din, float *dw, const void *dout, const void *in, const void *w, int64_t M, int64_t K,
                     int64_t N) {
    CU_ASSERT(dout && M >= 0 && K >= 0 && N >= 0);
    if (din) {
        CU_ASSERT(w);
        gemm_nn(din, 0, (const bf16 *)dout, (const bf16 *)w, M, K, N, N, K, K, 1.0f, 1.0f);
    }
    if (dw) {
        CU_ASSERT(in);
        gemm_tn(dw, 1, (const bf16 *)dout, (const bf16 *)in, N, K, M, N, K, K, 1.0f, 1.0f);
    }
}
