/* ops_cpu.c: the CPU reference op table: fp32 math, OpenMP loops, OpenBLAS
 * sgemm. Every act and wt buffer is float here (act_bytes = wt_bytes = 4).
 *
 * defines: dfl_ops_cpu (the table), memory, conversions, matmul(_bwd),
 * rmsnorm(_bwd), rope, swiglu(_bwd), swiglu_oss, add, attn_sinks, embed,
 * sumsq, adamw.
 * Attention lives in ops_cpu_attn.c, the LM head and losses in
 * ops_cpu_lmhead.c, the products of a few rows in ops_cpu_few_rows.c.
 *
 * OpenBLAS runs single-threaded, on fixed tiles that our threads share
 * (dfl_cpu_sgemm), so that no result depends on the thread count.
 */
/* As in ops_cpu_attn.c: lets GCC vectorize the loops over dfl_cpu_expf
 * (if-conversion of its selects). No result changes: nothing here reads
 * the floating-point exception flags. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "ops_cpu.h"

#include "common.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* memory                                                                    */

/* Fresh allocations and uploads of 8 MiB and more are zeroed or copied on
 * every thread, in runs of 2 MiB. At load time they are the first touch of
 * the weights' pages (gigabytes): the kernel zeroes each fresh page, and
 * maps each page of the file, on the thread that faults it, so one thread
 * did most of a target's start-up. Fills and copies of memory in use
 * (zero, copy, download) stay single memset/memmove calls: split over
 * threads they gained nothing measurable on a drafter step. */
#define CPU_PAR_BYTES ((size_t)8 << 20)
#define CPU_PAR_RUN ((size_t)2 << 20)

static int64_t run_count(size_t bytes) { return (int64_t)((bytes + CPU_PAR_RUN - 1) / CPU_PAR_RUN); }

/* The length of run i of `bytes` (the last one ragged). */
static size_t run_bytes(size_t bytes, int64_t i) {
    const size_t o = (size_t)i * CPU_PAR_RUN;
    return bytes - o < CPU_PAR_RUN ? bytes - o : CPU_PAR_RUN;
}

static void *cpu_alloc(size_t bytes) {
    char *p = dfl_aligned_alloc(bytes); /* exits 70 when out of memory */
    if (bytes < CPU_PAR_BYTES) return memset(p, 0, bytes);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < run_count(bytes); i++) memset(p + (size_t)i * CPU_PAR_RUN, 0, run_bytes(bytes, i));
    return p;
}

static void cpu_free(void *p) { free(p); }
static void *cpu_host_alloc(size_t bytes) { return dfl_aligned_alloc(bytes); }
static void cpu_zero(void *p, size_t bytes) { if (bytes) memset(p, 0, bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { if (bytes && dst != src) memmove(dst, src, bytes); }

static void cpu_upload(void *dst, const void *src, size_t bytes) {
    char *d = dst;
    const char *s = src;
    if (bytes < CPU_PAR_BYTES || (d < s + bytes && s < d + bytes)) { /* small, or overlapping */
        cpu_copy(dst, src, bytes);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < run_count(bytes); i++) {
        const size_t o = (size_t)i * CPU_PAR_RUN;
        memcpy(d + o, s + o, run_bytes(bytes, i));
    }
}

static void cpu_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows) {
    for (size_t r = 0; r < rows; r++) memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
}
static void cpu_sync(void) {}

/* ------------------------------------------------------------------------ */
/* bf16 widening, shared by loading and by the products on bf16 weights     */

SIMD_CLONES void dfl_cpu_widen_bf16(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        dfl_load_w8(&v, src, i, 1);
        memcpy(dst + i, &v, sizeof v);
    }
    for (; i < n; i++) dst[i] = dfl_bf16_to_f32(src[i]);
}

/* ------------------------------------------------------------------------ */
/* conversions                                                               */

/* host bf16/f16/f32 -> f32 buffer */
static void cpu_load(void *dst, const void *host_src, dfl_dtype dtype, int64_t n) {
    float *out = dst;
    switch (dtype) {
    case DFL_F32:
        cpu_copy(dst, host_src, (size_t)n * 4);
        break;
    case DFL_BF16: {
        const uint16_t *in = host_src;
        const int64_t chunk = 65536;
#pragma omp parallel for if (n > chunk)
        for (int64_t i = 0; i < n; i += chunk) dfl_cpu_widen_bf16(out + i, in + i, n - i < chunk ? n - i : chunk);
        break;
    }
    case DFL_F16: {
        const uint16_t *in = host_src;
#pragma omp parallel for if (n > 65536)
        for (int64_t i = 0; i < n; i++) out[i] = dfl_f16_to_f32(in[i]);
        break;
    }
    default:
        DFL_ASSERT(!"load_act/load_wt: dtype must be bf16, f16 or f32");
    }
}

static void cpu_act_to_f32(float *host_dst, const void *src, int64_t n) { cpu_copy(host_dst, src, (size_t)n * 4); }

static void cpu_act_to_bf16(uint16_t *host_dst, const void *src, int64_t n) {
    const float *in = src;
#pragma omp parallel for if (n > 65536)
    for (int64_t i = 0; i < n; i++) host_dst[i] = dfl_f32_to_bf16(in[i]);
}

/* The CPU computes with the master weights' values: a copy (nothing at all
 * when the model points its compute weights at the master copy). */
static void cpu_master_to_wt(void *dst, const float *master, int64_t n) { cpu_copy(dst, master, (size_t)n * 4); }

/* ------------------------------------------------------------------------ */
/* dense                                                                     */

/* cblas takes int sizes. */
static int blas_int(int64_t n) {
    DFL_ASSERT(n >= 0 && n <= 0x7fffffff);
    return (int)n;
}

/* OpenBLAS gives an element different bits for different shapes of a call
 * and for different thread counts (its small-matrix kernels, its split of
 * the work): 4 to 5 of the thread counts 2..6 differ from 1 at Qwen3-8B's
 * 4096 x 4096, and so did dflash-extract's streams at -t 1 and -t 3. So
 * each product is cut into fixed tiles of the output, which depend on the
 * shape and the machine alone, never on the thread count, and each tile is
 * one single-threaded OpenBLAS call (see blas_serial). */
#define GEMM_TILE 256

/* Larger tiles where the output still has GEMM_TILES_PER_CPU of them for
 * each of the machine's CPUs: a tile's call packs its rows of A and its
 * columns of B again, so 256 x 256 tiles pack each 4x as often as 1024 x
 * 1024 ones. One thread, AVX-512 Xeon, in GFLOP/s at 256 / 512 / 1024 /
 * the whole product as one call: 4096 x 2048 x K 768 (NT) 129 / 140 / 147 /
 * 162, 4096 x 768 x 2048 (NN) 127 / 136 / 149 / 154, a weight gradient
 * 2048 x 768 x 4096 (TN) 110 / 126 / 151 / 155. bench_extract's model on
 * 2 CPUs (its products 4096 x 2048 cut in 1024s, 4096 x 768 and x 256 in
 * 512s): the whole run 5.49-5.62 -> 4.64-5.00 s, the same bytes; 2 tiles
 * a CPU (1024s everywhere) ran no faster than 4. Large machines, whose
 * threads need the tiles, keep 256. The machine's count of online
 * CPUs (not the threads, not the affinity mask) decides, so one machine
 * always cuts a shape alike. Another machine's cut can change the last
 * bits of a ragged edge, where a small call takes OpenBLAS's small-matrix
 * kernel in one cut and not in the other; elsewhere OpenBLAS sums an
 * element alike in tiles of 256 and more (this Xeon: no element of six
 * shapes differed between cuts of 256, 512, 1024 and the whole). */
#define GEMM_TILE_MAX 1024
#define GEMM_TILES_PER_CPU 4

/* An output of one tile (a small drafter's weight gradients: 256 x 256)
 * ran on one thread, so its tiles are halved, down to GEMM_TILE_MIN,
 * while it has fewer than GEMM_TILES_MIN: 256 x 256 runs as 4 tiles of
 * 128, 128 x 256 as 2. A tile of 128 runs ~12 % slower than one of 256 on
 * one thread (64: ~28 %): outputs of 2 tiles or more keep 256 (4, the
 * bound tried first, cost a one-thread step 5 % and gained no more on
 * two). The shape decides, not the threads, as the bits require. On the
 * bench_train.sh drafter, 2 threads: a step ~10 % faster (median ~0.52 ->
 * ~0.45 s), the checkpoint the same bits, as OpenBLAS sums each element
 * alike in these tiles; one thread: the same time. */
#define GEMM_TILE_MIN 64
#define GEMM_TILES_MIN 2

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t dfl_cpu_machine_cpus_override;

/* The machine's online CPUs, read once (sysconf is thread-safe; two
 * threads racing here store the same value). */
static int64_t machine_cpus(void) {
    static _Atomic int64_t cpus;
    if (dfl_cpu_machine_cpus_override > 0) return dfl_cpu_machine_cpus_override;
    int64_t n = atomic_load_explicit(&cpus, memory_order_relaxed);
    if (n == 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online > 0 ? online : 1;
        atomic_store_explicit(&cpus, n, memory_order_relaxed);
    }
    return n;
}

int64_t dfl_cpu_gemm_tile(int64_t M, int64_t N) {
    const int64_t want = GEMM_TILES_PER_CPU * machine_cpus();
    for (int64_t e = GEMM_TILE_MAX; e > GEMM_TILE; e /= 2)
        if (ceil_div(M, e) * ceil_div(N, e) >= want) return e;
    int64_t e = GEMM_TILE;
    while (e > GEMM_TILE_MIN && ceil_div(M, e) * ceil_div(N, e) < GEMM_TILES_MIN) e /= 2;
    return e;
}

void dfl_cpu_sgemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                   const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M <= 0 || N <= 0) return;
    const int64_t e = dfl_cpu_gemm_tile(M, N), tm = ceil_div(M, e), tn = ceil_div(N, e);
    const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
#pragma omp parallel for schedule(dynamic, 1) if (tm * tn > 1 && M * N * K > DFL_CPU_PAR_MIN)
    for (int64_t t = 0; t < tm * tn; t++) {
        const int64_t i0 = t / tn * e, j0 = t % tn * e;
        omp_set_num_threads(1); /* this task's: OpenBLAS runs serially even where the region has one thread */
        const float *a = trans_a ? A + i0 : A + i0 * lda;   /* rows i0.. of op(A) */
        const float *b = trans_b ? B + j0 * ldb : B + j0;   /* columns j0.. of op(B) */
        cblas_sgemm(CblasRowMajor, ta, tb, blas_int(min64(e, M - i0)), blas_int(min64(e, N - j0)), blas_int(K), 1.0f,
                    a, blas_int(lda), b, blas_int(ldb), beta, C + i0 * ldc + j0, blas_int(ldc));
    }
}

/* out[M,N] = in[M,K] . w[N,K]^T + beta * out with w bf16, for more rows
 * than the few-rows kernel takes. The work is cut into panels of a tile's
 * rows of w (dfl_cpu_gemm_tile), each panel's row tiles into `slices` runs, enough
 * runs for every thread (a target's k and v projections are one or two
 * panels); a thread widens its run's panel into its own f32 buffer (exact:
 * bf16 is the top half of an f32), unless it holds that panel already,
 * then runs the run's tiles. The tiles are dfl_cpu_sgemm's, each one
 * single-threaded OpenBLAS call on the same values, so the bits are those
 * of f32 weights. The widened copy is a tile's rows x K floats a thread,
 * not the whole matrix; a panel is widened at most once a run, against the
 * run's >= 2 x the tile's rows multiply-adds per weight (one row tile:
 * 2 * M). */
void dfl_cpu_gemm_nt_bf16(float *out, const float *in, const uint16_t *w, int64_t M, int64_t K, int64_t N,
                          float beta) {
    if (M <= 0 || N <= 0) return;
    const int64_t e = dfl_cpu_gemm_tile(M, N), tm = ceil_div(M, e), tn = ceil_div(N, e);
    const int64_t want = 8 * (int64_t)omp_get_max_threads(); /* runs, for an even finish */
    const int64_t slices = min64(tm, ceil_div(want, tn));
#pragma omp parallel if (tm * tn > 1 && M * N * K > DFL_CPU_PAR_MIN)
    {
        float *panel = NULL;
        int64_t held = -1; /* the panel in `panel` */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < tn * slices; r++) {
            const int64_t p = r / slices, s = r % slices;
            const int64_t j0 = p * e, n = min64(e, N - j0);
            if (!panel) panel = dfl_aligned_alloc((size_t)(e * K) * sizeof *panel);
            if (held != p) dfl_cpu_widen_bf16(panel, w + j0 * K, n * K);
            held = p;
            omp_set_num_threads(1); /* as in dfl_cpu_sgemm: OpenBLAS runs serially */
            for (int64_t t = s * tm / slices; t < (s + 1) * tm / slices; t++) {
                const int64_t i0 = t * e;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(min64(e, M - i0)), blas_int(n),
                            blas_int(K), 1.0f, in + i0 * K, blas_int(K), panel, blas_int(K), beta,
                            out + i0 * N + j0, blas_int(N));
            }
        }
        free(panel);
    }
}

/* One row: sgemv over fixed tiles of w's rows, as dfl_cpu_sgemm does. */
static void gemv_tiled(float *out, const float *in, const float *w, int64_t K, int64_t N, float beta) {
    const int64_t tn = ceil_div(N, GEMM_TILE);
#pragma omp parallel for schedule(dynamic, 1) if (tn > 1 && N * K > DFL_CPU_PAR_MIN)
    for (int64_t t = 0; t < tn; t++) {
        const int64_t j0 = t * GEMM_TILE;
        omp_set_num_threads(1);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, blas_int(min64(GEMM_TILE, N - j0)), blas_int(K), 1.0f, w + j0 * K,
                    blas_int(K), in, 1, beta, out + j0, 1);
    }
}

void dfl_cpu_gemm_nt(float *out, const float *in, const float *w, int64_t M, int64_t K, int64_t N, float beta) {
    DFL_ASSERT(beta == 0.0f || beta == 1.0f);
    if (M == 1) gemv_tiled(out, in, w, K, N, beta);
    else if (dfl_cpu_takes_few_rows(M, K)) dfl_cpu_gemm_nt_few_rows(out, in, w, DFL_F32, M, K, N, beta != 0.0f);
    else dfl_cpu_sgemm(0, 1, M, N, K, in, K, w, K, beta, out, N);
}

/* out[M,N] = in[M,K] . w[N,K]^T (+ out) */
void dfl_cpu_matmul(void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N, int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate) memset(out, 0, (size_t)M * (size_t)N * 4);
        return;
    }
    dfl_cpu_gemm_nt(out, in, w, M, K, N, accumulate ? 1.0f : 0.0f);
}

/* din[M,K] (+)= dout[M,N] . w[N,K];  dw[N,K] (+)= dout^T . in[M,K] */
static void cpu_matmul_bwd(void *din, float *dw, const void *dout, const void *in, const void *w, int64_t M,
                           int64_t K, int64_t N, int acc) {
    if (K <= 0) return;
    /* empty sums: an overwritten gradient becomes 0 */
    if (din && M > 0 && N <= 0 && !(acc & DFL_ACC_DIN)) memset(din, 0, (size_t)(M * K) * sizeof(float));
    if (dw && N > 0 && M <= 0 && !(acc & DFL_ACC_DW)) memset(dw, 0, (size_t)(N * K) * sizeof(float));
    if (M <= 0 || N <= 0) return;
    if (din) dfl_cpu_sgemm(0, 0, M, K, N, dout, N, w, K, acc & DFL_ACC_DIN ? 1.0f : 0.0f, din, K);
    if (dw) dfl_cpu_sgemm(1, 0, N, K, M, dout, N, in, K, acc & DFL_ACC_DW ? 1.0f : 0.0f, dw, K);
}

/* Per row: rstd = 1/sqrt(mean(x^2) + eps), out = (x * rstd) * w, the order
 * of transformers' Qwen3RMSNorm in f32 (the sum of squares in double). */
/* out = (in * rstd) * (w + w_add), w_add 0 (rmsnorm) or 1 (rmsnorm1p). */
SIMD_CLONES static void rmsnorm_rows(float *out, float *rstd, const float *in, const float *w, float w_add,
                                     int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim > DFL_CPU_PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = in + r * dim;
        float *y = out + r * dim;
        double ss = 0;
        /* in any order: a sum of squares in double rounds to the same f32
         * mean but for a last-bit tie, and the order is fixed per dim */
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += (double)x[i] * x[i];
        float rs = 1.0f / sqrtf((float)(ss / (double)dim) + eps);
        if (rstd) rstd[r] = rs;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) y[i] = (x[i] * rs) * (w[i] + w_add);
    }
}

static void cpu_rmsnorm(void *out, float *rstd, const void *in, const void *w, int64_t rows, int64_t dim, float eps) {
    rmsnorm_rows(out, rstd, in, w, 0.0f, rows, dim, eps);
}

static void cpu_rmsnorm1p(void *out, const void *in, const void *w, int64_t rows, int64_t dim, float eps) {
    rmsnorm_rows(out, NULL, in, w, 1.0f, rows, dim, eps);
}

/* Sums over rows are split into fixed chunks of rows (a function of the
 * row count only), summed in double and then in chunk order: the result
 * does not depend on the thread count. */
static int64_t row_chunk(int64_t rows) {
    int64_t c = (rows + 255) / 256;
    return c < 64 ? 64 : c;
}

/* With y = x r w, r = (mean(x^2) + eps)^-1/2:
 *   dx_i = r w_i dy_i - x_i r^3 / dim * sum_j dy_j w_j x_j,   dw_i = sum_rows dy_i x_i r. */
SIMD_CLONES static void rmsnorm_bwd_chunks(float *din, double *part, const float *dout, const float *in,
                                           const float *rstd, const float *w, int64_t rows, int64_t dim,
                                           int64_t chunk, int64_t nch) {
#pragma omp parallel for schedule(dynamic) if (nch > 1 && rows * dim > DFL_CPU_PAR_MIN)
    for (int64_t ch = 0; ch < nch; ch++) {
        double *mine = part ? part + ch * dim : NULL;
        int64_t r1 = (ch + 1) * chunk < rows ? (ch + 1) * chunk : rows;
        for (int64_t r = ch * chunk; r < r1; r++) {
            const float *x = in + r * dim, *dy = dout + r * dim;
            float rs = rstd[r];
            if (din) {
                double dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < dim; i++) dot += (double)dy[i] * w[i] * x[i];
                float c = (float)(dot / (double)dim) * rs * rs * rs;
                float *dx = din + r * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) dx[i] += rs * w[i] * dy[i] - c * x[i];
            }
            if (mine)
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) mine[i] += (double)dy[i] * (x[i] * rs);
        }
    }
}

static void cpu_rmsnorm_bwd(void *din, float *dw, const void *dout, const void *in, const float *rstd,
                            const void *w, int64_t rows, int64_t dim) {
    int64_t chunk = row_chunk(rows), nch = (rows + chunk - 1) / chunk;
    double *part = dw ? dfl_calloc((size_t)(nch * dim), sizeof(double)) : NULL;
    rmsnorm_bwd_chunks(din, part, dout, in, rstd, w, rows, dim, chunk, nch);
    if (dw) {
#pragma omp parallel for if (nch * dim > DFL_CPU_PAR_MIN)
        for (int64_t i = 0; i < dim; i++) {
            double s = 0;
            for (int64_t ch = 0; ch < nch; ch++) s += part[ch * dim + i];
            dw[i] += (float)s;
        }
        free(part);
    }
}

/* NeoX rotate-half RoPE on x[T, nh, d], in place. The angle is the f32
 * product pos * inv_freq (transformers' f32 matmul of one term), its cos and
 * sin in f32, each times scale in f32; inverse negates the sine, the exact
 * backward pass. */
static void cpu_rope(void *x_, const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh,
                     int64_t d, int inverse) {
    DFL_ASSERT(d % 2 == 0);
    float *x = x_;
    int64_t half = d / 2;
#pragma omp parallel for if (T * nh * d > DFL_CPU_PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        float p = (float)pos[t];
        float *xt = x + t * nh * d;
        for (int64_t i = 0; i < half; i++) {
            float th = p * inv_freq[i];
            /* a zero frequency: a partial RoPE's pass-through pair, unscaled */
            const float m = inv_freq[i] != 0.0f ? scale : 1.0f;
            float c = cosf(th) * m, s = sinf(th) * m;
            if (inverse) s = -s;
            for (int64_t h = 0; h < nh; h++) {
                float *xh = xt + h * d;
                float x0 = xh[i], x1 = xh[i + half];
                xh[i] = x0 * c - x1 * s;
                xh[i + half] = x1 * c + x0 * s;
            }
        }
    }
}

/* The composition, which is what the op is defined as. */
static void cpu_qk_norm_rope(void *out, float *rstd, const void *in, const void *w, int plus_one,
                             const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d,
                             float eps) {
    rmsnorm_rows(out, rstd, in, w, plus_one ? 1.0f : 0.0f, T * nh, d, eps);
    cpu_rope(out, pos, inv_freq, scale, T, nh, d, 0);
}

/* The composition again: rope's inverse on a copy of dout, then the norm's
 * backward into a zeroed din. */
static void cpu_qk_norm_rope_bwd(void *din, float *dw, const void *dout, const void *in, const float *rstd,
                                 const void *w, const int32_t *pos, const float *inv_freq, float scale, int64_t T,
                                 int64_t nh, int64_t d) {
    const size_t bytes = (size_t)(T * nh * d) * sizeof(float);
    float *g = dfl_malloc(bytes);
    memcpy(g, dout, bytes);
    cpu_rope(g, pos, inv_freq, scale, T, nh, d, 1);
    if (din) memset(din, 0, bytes);
    cpu_rmsnorm_bwd(din, dw, g, in, rstd, w, T * nh, d);
    free(g);
}

/* silu(g) = g / (1 + exp(-g)), as PyTorch's CPU kernel writes it, with
 * dfl_cpu_expf (within 2 ulp of expf, as PyTorch's vectorized exp is within
 * 1) so that the loop vectorizes: libm's expf was a call per element. For
 * g below -88 exp(-g) is capped at exp(88) (about 1.7e38) where expf gives
 * inf: silu is then g * 6e-39 instead of -0, below any f32 sum's rounding. */
SIMD_CLONES static void cpu_swiglu(void *out_, const void *gate_, const void *up_, int64_t n) {
    float *out = out_;
    const float *g = gate_, *u = up_;
#pragma omp parallel for simd if (n > 16384)
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + dfl_cpu_expf(-g[i])) * u[i];
}

/* dst[0, m) = v, or += v when add */
static inline void put_or_add(float *restrict dst, const float *restrict v, int64_t m, int add) {
    if (!add) {
        memcpy(dst, v, (size_t)m * sizeof(float));
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < m; j++) dst[j] += v[j];
}

/* d silu(g)/dg = s (1 + g (1 - s)) with s = sigmoid(g). A block of
 * elements at a time, its sigmoids in a buffer that both gradients read,
 * so that each loop is straight and vectorizes (either output may be NULL,
 * and either may be added to). */
#define SWIGLU_BLOCK 512
SIMD_CLONES static void cpu_swiglu_bwd(void *dgate_, void *dup_, const void *dout_, const void *gate_,
                                       const void *up_, int64_t n, int accumulate) {
    float *dgate = dgate_, *dup = dup_;
    const float *dout = dout_, *gate = gate_, *up = up_;
#pragma omp parallel for if (n > 16384)
    for (int64_t b = 0; b < n; b += SWIGLU_BLOCK) {
        const int64_t m = n - b < SWIGLU_BLOCK ? n - b : SWIGLU_BLOCK;
        const float *g = gate + b, *u = up + b, *dy = dout + b;
        float s[SWIGLU_BLOCK], d[SWIGLU_BLOCK];
#pragma omp simd
        for (int64_t j = 0; j < m; j++) s[j] = 1.0f / (1.0f + dfl_cpu_expf(-g[j]));
        if (dgate) {
#pragma omp simd
            for (int64_t j = 0; j < m; j++) d[j] = dy[j] * u[j] * (s[j] * (1.0f + g[j] * (1.0f - s[j])));
            put_or_add(dgate + b, d, m, accumulate);
        }
        if (dup) {
#pragma omp simd
            for (int64_t j = 0; j < m; j++) d[j] = dy[j] * (g[j] * s[j]);
            put_or_add(dup + b, d, m, accumulate);
        }
    }
}

/* gpt-oss's clamped SwiGLU, in transformers' order (sigmoid, then the
 * products). Comparisons, not fminf/fmaxf: a NaN input stays NaN, as
 * torch.clamp keeps it. */
static void cpu_swiglu_oss(void *out_, const void *gate_, const void *up_, int64_t n, float alpha, float limit) {
    float *out = out_;
    const float *gate = gate_, *up = up_;
#pragma omp parallel for if (n > 16384)
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i] > limit ? limit : gate[i];
        float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        out[i] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
    }
}

static void cpu_add_bias(void *x_, const void *bias_, int64_t rows, int64_t cols) {
    float *x = x_;
    const float *b = bias_;
#pragma omp parallel for if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) x[r * cols + c] += b[c];
}

static void cpu_add(void *out_, const void *a_, const void *b_, int64_t n) {
    float *out = out_;
    const float *a = a_, *b = b_;
#pragma omp parallel for if (n > 65536)
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* The sink's share of the softmax, removed: sum / (sum + exp(sink)) with
 * sum = exp(lse). exp overflowing to inf gives the limit 0. */
static void cpu_attn_sinks(void *out_, const float *lse, const float *sinks, int64_t T, int64_t Hq, int64_t D) {
    float *out = out_;
#pragma omp parallel for if (T * Hq * D > 65536)
    for (int64_t r = 0; r < T * Hq; r++) {
        float s = 1.0f / (1.0f + expf(sinks[r % Hq] - lse[r]));
        for (int64_t c = 0; c < D; c++) out[r * D + c] *= s;
    }
}

/* out[T,H] = table[ids[t]]; the caller has checked the ids against V. */
static void cpu_embed(void *out_, const int32_t *ids, const void *table_, int64_t T, int64_t H) {
    float *out = out_;
    const float *table = table_;
#pragma omp parallel for if (T * H > 65536)
    for (int64_t t = 0; t < T; t++) {
        DFL_ASSERT(ids[t] >= 0);
        memcpy(out + t * H, table + (int64_t)ids[t] * H, (size_t)H * 4);
    }
}

/* ------------------------------------------------------------------------ */
/* optimizer                                                                 */

/* Partial sums over fixed chunks, added in chunk order: the same double
 * whatever the thread count. */
#define SUMSQ_CHUNK 65536
static double cpu_sumsq(const float *x, int64_t n) {
    int64_t nch = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    double *part = dfl_calloc((size_t)nch + 1, sizeof(double)), s = 0;
#pragma omp parallel for if (nch > 1)
    for (int64_t ch = 0; ch < nch; ch++) {
        int64_t i1 = (ch + 1) * SUMSQ_CHUNK < n ? (ch + 1) * SUMSQ_CHUNK : n;
        double p = 0;
        for (int64_t i = ch * SUMSQ_CHUNK; i < i1; i++) p += (double)x[i] * x[i];
        part[ch] = p;
    }
    for (int64_t ch = 0; ch < nch; ch++) s += part[ch];
    free(part);
    return s;
}

/* torch.optim.AdamW, single-tensor path (torch/optim/adam.py,
 * _single_tensor_adam with decoupled weight decay), in its order and
 * precision: Python-side scalars in double, each rounded to f32 where it
 * meets a tensor; the moments' update is lerp for m (weight < 0.5 form)
 * and mul + addcmul for v; the step is addcdiv with value -step_size. */
static void cpu_adamw(float *p, void *wt_, const float *grad, float *m, float *v, int64_t n, float lr, float b1,
                      float b2, float eps, float wd, float gscale, int64_t t) {
    DFL_ASSERT(t >= 1);
    float decay = (float)(1.0 - (double)lr * (double)wd);
    float w1 = (float)(1.0 - (double)b1);
    float w2 = (float)(1.0 - (double)b2);
    double bc1 = 1.0 - pow((double)b1, (double)t);
    double bc2 = 1.0 - pow((double)b2, (double)t);
    float neg_step = (float)-((double)lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    int lerp_small = w1 < 0.5f;
#pragma omp parallel for if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        float g = gscale * grad[i];
        float pi = wd != 0 ? p[i] * decay : p[i];
        float mi = lerp_small ? m[i] + w1 * (g - m[i]) : g - (g - m[i]) * (1.0f - w1);
        float vi = v[i] * b2 + w2 * g * g;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi + neg_step * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
    if (wt_ && wt_ != (void *)p) cpu_master_to_wt(wt_, p, n);
}

/* ------------------------------------------------------------------------ */
/* the table                                                                 */

static const dfl_ops cpu_ops = {
    .name = "cpu",
    .act_bytes = 4,
    .wt_bytes = 4,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .upload = cpu_upload,
    .download = cpu_copy,
    .sync = cpu_sync,
    .load_act = cpu_load,
    .load_wt = cpu_load,
    .act_to_f32 = cpu_act_to_f32,
    .act_to_bf16 = cpu_act_to_bf16,
    .master_to_wt = cpu_master_to_wt,
    .matmul = dfl_cpu_matmul,
    .matmul_grouped = dfl_cpu_matmul_grouped,
    .matmul_bwd = cpu_matmul_bwd,
    .rmsnorm = cpu_rmsnorm,
    .qk_norm_rope = cpu_qk_norm_rope,
    .qk_norm_rope_bwd = cpu_qk_norm_rope_bwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .rmsnorm1p = cpu_rmsnorm1p,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .swiglu_bwd = cpu_swiglu_bwd,
    .swiglu_oss = cpu_swiglu_oss,
    .add = cpu_add,
    .add_bias = cpu_add_bias,
    .embed = cpu_embed,
    .sigmoid_mul = dfl_cpu_sigmoid_mul,
    .conv1d_silu = dfl_cpu_conv1d_silu,
    .gated_delta = dfl_cpu_gated_delta,
    .moe_route = dfl_cpu_moe_route,
    .gather_rows = dfl_cpu_gather_rows,
    .moe_combine = dfl_cpu_moe_combine,
    .attn_causal = dfl_cpu_attn_causal,
    .attn_dflash = dfl_cpu_attn_dflash,
    .attn_dflash_bwd = dfl_cpu_attn_dflash_bwd,
    .attn_sinks = cpu_attn_sinks,
    .lmhead_ce = dfl_cpu_lmhead_ce,
    .lmhead_kl = dfl_cpu_lmhead_kl,
    .lmhead_argmax = dfl_cpu_lmhead_argmax,
    .lmhead_sample = dfl_cpu_lmhead_sample,
    .sumsq = cpu_sumsq,
    .adamw = cpu_adamw,
};

/* OpenBLAS single-threaded everywhere (see dfl_cpu_sgemm). Its OpenMP build
 * (openblas_get_parallel() 2) follows the calling task's thread count,
 * which each tile sets to 1; its openblas_set_num_threads would set ours
 * too. A pthreads build (1) runs its own pool, which is set to 1 here. */
static void blas_serial(void) {
    if (openblas_get_parallel() == 1) openblas_set_num_threads(1);
}

const dfl_ops *dfl_ops_cpu(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, blas_serial);
    return &cpu_ops;
}
