// matmul.cu: the dense ops through cuBLAS (bf16 operands, f32 compute and
// accumulation, bf16 or f32 results).
// defines: gemm_nt, gemm_nn, gemm_tn, cuda_matmul, cuda_matmul_bwd, cuda_matmul_grouped
//
// cuBLAS is column-major; a row-major [R,C] matrix with row stride ld is the
// column-major C×R matrix with leading dimension ld. So row-major
// C = A·B becomes column-major C^T = B^T·A^T: every call below swaps the
// operands and passes N before M (targets-extraction.md §1.4).
#include "common.cuh"

#include <limits.h>

#include <algorithm>

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
    const int prof = cuda_prof_begin();
    cublasCheck(cublasGemmEx(g_cuda.blas, opB, opA, (int)N, (int)M, (int)K, &alpha, B, CUDA_R_16BF, (int)ldb, A,
                             CUDA_R_16BF, (int)lda, &beta, C, c_f32 ? CUDA_R_32F : CUDA_R_16BF, (int)ldc,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    LAUNCH_CHECK();
    if (prof >= 0) {
        char key[96]; // layout: A then B as gemm_nt/nn/tn name them
        snprintf(key, sizeof key, "g %lld x %lld x %lld %s%s %s beta %g", (long long)M, (long long)N, (long long)K,
                 opA == CUBLAS_OP_N ? "n" : "t", opB == CUBLAS_OP_T ? "t" : "n", c_f32 ? "f32" : "bf16", beta);
        cuda_prof_end(prof, key);
    }
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

// din[M,K] (+)= dout[M,N] · w[N,K];  dw[N,K] (+)= dout^T · in   (dw f32)
void cuda_matmul_bwd(void *din, float *dw, const void *dout, const void *in, const void *w, int64_t M, int64_t K,
                     int64_t N, int acc) {
    CU_ASSERT(dout && M >= 0 && K >= 0 && N >= 0);
    if (din) {
        CU_ASSERT(w);
        gemm_nn(din, 0, (const bf16 *)dout, (const bf16 *)w, M, K, N, N, K, K, 1.0f, acc & DFL_ACC_DIN ? 1.0f : 0.0f);
    }
    if (dw) {
        CU_ASSERT(in);
        gemm_tn(dw, 1, (const bf16 *)dout, (const bf16 *)in, N, K, M, N, K, K, 1.0f, acc & DFL_ACC_DW ? 1.0f : 0.0f);
    }
}

// ---------------------------------------------------------------------------
// matmul_grouped: the experts' products of a MoE layer in one cuBLAS call
//
// cublasGemmGroupedBatchedEx (cuBLAS 12.5+) with one problem per expert that
// has rows (group_size 1 each: the problems differ in their row counts), the
// operands swapped as in gemm above: cuBLAS's m = N, n = the expert's rows,
// A = w_e (op T), B = in_e. bf16 A/B/C with CUBLAS_COMPUTE_32F is one of
// the documented combinations. The A/B/C pointer arrays must be in device
// memory (uploaded to the op scratch); the size, leading-dimension, scale,
// transpose and group-size arrays are read on the host.
//
// One gemm_nt per expert instead (the matmul op's very calls) when
// - DFLASH_CUDA_NO_GROUPED=1 (so that a benchmark can time both),
// - cuBLAS answers CUBLAS_STATUS_NOT_SUPPORTED (any other failure exits 70
//   as every cuBLAS call does),
// - K = 0 (an empty sum: gemm_nt writes the zeros itself),
// - a matrix pointer is not aligned as the grouped call requires of bf16
//   operands (cuBLAS documentation: 16 bytes where a row of k elements is a
//   multiple of 16 bytes, else 4 where it is a multiple of 4; checked here
//   by both K and N for C, whose rows are N long). Not for the models'
//   shapes (widths multiples of 8, buffers 256-byte aligned); a view at an
//   odd element would otherwise fault ("misaligned address").

static size_t grouped_align(int64_t row_elems) {
    const int64_t b = row_elems * (int64_t)sizeof(bf16);
    return b % 16 == 0 ? 16 : b % 4 == 0 ? 4 : 1;
}

// Host arrays of the grouped call, grow-only (one stream, one caller at a
// time, as the whole backend). The pointer block is the source of a
// pageable cudaMemcpyAsync, which is staged before the call returns
// (backend.cu, cuda_upload), so reusing it on the next call is safe.
struct grouped_args {
    const void **ptrs; // A | B | C, `cap` each
    cublasOperation_t *ta, *tb;
    int *m, *n, *k, *lda, *ldb, *ldc, *size;
    float *alpha, *beta;
    int64_t cap;
};
static grouped_args g_grouped;

static void grouped_reserve(int64_t count) {
    grouped_args &a = g_grouped;
    if (count <= a.cap) return;
    free(a.ptrs), free(a.ta), free(a.tb), free(a.m), free(a.n), free(a.k), free(a.lda), free(a.ldb), free(a.ldc),
        free(a.size), free(a.alpha), free(a.beta);
    const size_t c = (size_t)count;
    a.ptrs = (const void **)dfl_malloc(3 * c * sizeof *a.ptrs);
    a.ta = (cublasOperation_t *)dfl_malloc(c * sizeof *a.ta);
    a.tb = (cublasOperation_t *)dfl_malloc(c * sizeof *a.tb);
    int **ints[] = {&a.m, &a.n, &a.k, &a.lda, &a.ldb, &a.ldc, &a.size};
    for (int **p : ints) *p = (int *)dfl_malloc(c * sizeof(int));
    a.alpha = (float *)dfl_malloc(c * sizeof(float));
    a.beta = (float *)dfl_malloc(c * sizeof(float));
    a.cap = count;
}

static void grouped_by_gemm(void *out, const void *in, const void *w, const int64_t *offsets, int64_t G,
                            int64_t w_stride, int64_t K, int64_t N, float beta) {
    for (int64_t e = 0; e < G; e++) {
        const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
        if (rows == 0) continue;
        gemm_nt((bf16 *)out + r0 * N, 0, (const bf16 *)in + r0 * K, (const bf16 *)w + e * w_stride, rows, N, K, K,
                K, N, 1.0f, beta);
    }
}

// out[r] (+)= in[r] · w_e^T for rows r of group e (ops.h); w is wt (bf16)
void cuda_matmul_grouped(void *out, const void *in, const void *w, dfl_dtype wdt, const int64_t *offsets,
                         int64_t G, int64_t w_stride, int64_t K, int64_t N, int accumulate) {
    CU_ASSERT(out && in && w && wdt == DFL_BF16 && offsets && G >= 0 && G <= INT_MAX && w_stride >= 0 &&
              fits_int(K) && fits_int(N));
    CU_ASSERT(G == 0 || offsets[0] == 0);
    const float beta = accumulate ? 1.0f : 0.0f;
    const size_t a_in = grouped_align(K), a_out = std::max(grouped_align(K), grouped_align(N));
    int64_t count = 0;
    int aligned = 1;
    for (int64_t e = 0; e < G; e++) {
        const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
        CU_ASSERT(rows >= 0 && fits_int(rows));
        if (rows == 0) continue;
        count++;
        aligned &= is_aligned((const bf16 *)w + e * w_stride, a_in) && is_aligned((const bf16 *)in + r0 * K, a_in) &&
                   is_aligned((bf16 *)out + r0 * N, a_out);
    }
    if (count == 0 || N == 0) return; // nothing to compute: no launch
    if (g_cuda.no_grouped || K == 0 || !aligned) {
        grouped_by_gemm(out, in, w, offsets, G, w_stride, K, N, beta);
        return;
    }
    grouped_reserve(count);
    grouped_args &a = g_grouped;
    const void **A = a.ptrs, **B = a.ptrs + count, **C = a.ptrs + 2 * count;
    for (int64_t e = 0, i = 0; e < G; e++) {
        const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
        if (rows == 0) continue;
        A[i] = (const bf16 *)w + e * w_stride;
        B[i] = (const bf16 *)in + r0 * K;
        C[i] = (bf16 *)out + r0 * N;
        a.ta[i] = CUBLAS_OP_T, a.tb[i] = CUBLAS_OP_N;
        a.m[i] = (int)N, a.n[i] = (int)rows, a.k[i] = (int)K;
        a.lda[i] = (int)K, a.ldb[i] = (int)K, a.ldc[i] = (int)N;
        a.size[i] = 1, a.alpha[i] = 1.0f, a.beta[i] = beta;
        i++;
    }
    const size_t ptr_bytes = 3 * (size_t)count * sizeof(void *);
    void **dptrs = (void **)cuda_scratch(SCRATCH_OP, ptr_bytes);
    cudaCheck(cudaMemcpyAsync(dptrs, a.ptrs, ptr_bytes, cudaMemcpyHostToDevice, g_cuda.stream));
    cublasStatus_t s = cublasGemmGroupedBatchedEx(
        g_cuda.blas, a.ta, a.tb, a.m, a.n, a.k, a.alpha, (const void *const *)dptrs, CUDA_R_16BF, a.lda,
        (const void *const *)(dptrs + count), CUDA_R_16BF, a.ldb, a.beta, (void *const *)(dptrs + 2 * count),
        CUDA_R_16BF, a.ldc, (int)count, a.size, CUBLAS_COMPUTE_32F);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) {
        grouped_by_gemm(out, in, w, offsets, G, w_stride, K, N, beta);
        return;
    }
    cublasCheck(s);
    LAUNCH_CHECK();
}
