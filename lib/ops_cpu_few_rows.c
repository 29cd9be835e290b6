/* ops_cpu_few_rows.c: the few-rows kernel, out[M,N] (=|+=) in[M,K] .
 * w[N,K]^T (w f32 or bf16) for a few rows (a verify block, a short prefill,
 * an expert's rows), where OpenBLAS's sgemm would copy all of w before
 * using it: it reads w once for all M rows (ops_cpu.h says which products
 * come here: dfl_cpu_takes_few_rows).
 *
 * Multiply-adds are fused where the ISA has them (the x86-64-v3 clone), as
 * ops_cpu_attn.c's products are: one rounding instead of two, and one
 * instruction instead of two; ISO C (-std=c11) does not fuse them itself.
 * 1 thread, K 4096, N 4096, on an AVX-512 Xeon: bf16 8 rows 6.1 -> 4.6 ms,
 * 16 rows 10.5 -> 7.9, 32 rows 19.8 -> 14.3; f32 16 rows 10.8 -> 8.1. The
 * baseline clone (no FMA) rounds twice, so its last bits differ from the
 * clone's, as OpenBLAS's per-CPU kernels do; within a process every product
 * sums alike, which is what the kernel's guarantees below rest on.
 *
 * (Tried and dropped: 16-lane AVX-512 tiles of 8 rows x 3 columns. At 32
 * rows and more each tile reads 8 input rows from L2 per 24 products, twice
 * the bytes per product of the 4 x 3 tiles, and ran 10-20 % slower than
 * these 8 lanes with FMA; at 8 rows no faster.)
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=fast")
#endif

#include "ops_cpu.h"

#include "common.h"

#include <stdlib.h>
#include <string.h>

/* The sum of one product row: eight lanes over K in steps of 8, the lanes
 * added in a fixed order, then the tail. dot_tile does exactly this. */
static inline __attribute__((always_inline)) float lanes_sum(const v8f *v) {
    const v8f s = *v; /* by address: a vector argument would change the ABI without AVX */
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static inline __attribute__((always_inline)) float w_at(const void *wr, int64_t k, int bf16) {
    return bf16 ? dfl_bf16_to_f32(((const uint16_t *)wr)[k]) : ((const float *)wr)[k];
}

/* One step of dot_tile: k .. k+7 of every sum. */
static inline __attribute__((always_inline)) void tile_step(v8f s[8][3], const float *x, const void *w, int bf16,
                                                            int64_t K, int64_t k, int R, int C) {
    const size_t wsz = bf16 ? 2 : 4;
    v8f wv[3], a;
#pragma GCC unroll 3
    for (int j = 0; j < C; j++) dfl_load_w8(&wv[j], (const char *)w + (size_t)(j * K) * wsz, k, bf16);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        V8_LOAD(a, x + i * K + k);
#pragma GCC unroll 3
        for (int j = 0; j < C; j++) s[i][j] += a * wv[j];
    }
}

/* o[i * ldo + j] (=|+=) x[i * K, :] . w[j * K, :] for i < R, j < C (R and
 * C constants where it is inlined: the loops unroll and the R * C sums stay
 * in registers). Each sum is the same whatever R and C: eight lanes over k,
 * their sum, then the tail, so an element's bits do not depend on its tile.
 * pf, where not NULL: C rows of K elements of pfsz bytes (the weights that
 * come next), prefetched a cache line each per line of k. The order of the
 * steps is the same with and without it, so are the bits. */
static inline __attribute__((always_inline)) void dot_tile(float *o, int64_t ldo, const float *x, const void *w,
                                                           int bf16, int64_t K, int acc, int R, int C,
                                                           const char *pf, int64_t pfsz) {
    const size_t wsz = bf16 ? 2 : 4;
    v8f s[8][3];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 3
        for (int j = 0; j < C; j++) s[i][j] = (v8f){0};
    int64_t k = 0;
    if (pf) {
        const int64_t line = 64 / pfsz; /* elements of pf to a cache line */
        for (; k + line <= K; k += line) {
#pragma GCC unroll 3
            for (int j = 0; j < C; j++) __builtin_prefetch(pf + (j * K + k) * pfsz, 0, 2);
#pragma GCC unroll 4
            for (int64_t t = k; t < k + line; t += 8) tile_step(s, x, w, bf16, K, t, R, C);
        }
    }
    for (; k + 8 <= K; k += 8) tile_step(s, x, w, bf16, K, k, R, C);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 3
        for (int j = 0; j < C; j++) {
            const void *wr = (const char *)w + (size_t)(j * K) * wsz;
            float r = lanes_sum(&s[i][j]);
            for (int64_t t = k; t < K; t++) r += x[i * K + t] * w_at(wr, t, bf16);
            o[i * ldo + j] = acc ? o[i * ldo + j] + r : r;
        }
}

/* Columns n .. n+C-1 of the output, all M rows, from w's rows n .. n+C-1
 * (wn points at row n). Where R is 8 (one column): rows 8 at a time, then
 * 4, then one at a time. Where R is 4 (3 columns): 4 at a time, then the
 * rest in one tile of 2 or 3 rows rather than one row at a time, each of
 * which read all of w again: 2 rows, K 4096, N 4096, 3.6 -> 2.3 ms (f32, 1
 * thread), 3 rows 4.2 -> 2.1. (5 rows as 3 and 2 took 3.4 ms against 2.8
 * as 4 and 1: a 4-row tile is worth a lone row after it.)
 * The first tile of 2 rows or more prefetches pf (see dot_tile); one-row
 * tiles do not: a lone row streams w about as fast as memory gives it, and
 * the prefetches only cost (bf16, 1 row, K 1024: 1.73 -> 2.18 ms). Nor do
 * tiles of 2 and 3 rows on one column (f32, 3 rows, K 768: 2.7 -> 3.3 ms),
 * which stay one-row tiles. */
static inline __attribute__((always_inline)) void few_rows_columns(float *out, const float *in, const void *wn,
                                                                   int bf16, int64_t M, int64_t K, int64_t N,
                                                                   int64_t n, int acc, int R, int C,
                                                                   const char *pf, int64_t pfsz) {
#define FEW_ROWS_TILE(rows) \
    dot_tile(out + m * N + n, N, in + m * K, wn, bf16, K, acc, (rows), C, m ? NULL : pf, pfsz), m += (rows)
    int64_t m = 0;
    while (M - m >= R) FEW_ROWS_TILE(R);
    if (R == 8) {
        while (M - m >= 4) FEW_ROWS_TILE(4);
    } else if (M - m == 3) {
        FEW_ROWS_TILE(3);
    } else if (M - m == 2) {
        FEW_ROWS_TILE(2);
    }
#undef FEW_ROWS_TILE
    for (; m < M; m++) dot_tile(out + m * N + n, N, in + m * K, wn, bf16, K, acc, 1, C, NULL, 0);
}

/* Tiles of 4 rows x 3 columns: 12 sums, 3 weight vectors and an input one
 * (AVX2's 16 vector registers). A weight load serves 4 rows and an input
 * load 3 columns, where 8 rows to a column loaded 9 vectors for 8 products:
 * 16 rows at K 4096, N 4096 take 9.4 ms rather than 18 (f32, 1 thread).
 * Every product takes them, whatever M and K; the last N % 3 columns go 8
 * rows to a column. A tile of 3 columns also keeps 3 sums in flight where
 * one column keeps 1 (a lone row) to 8: with the multiply-adds fused, a sum
 * is a chain of 4-cycle FMAs (3-cycle adds before), and one chain a column
 * ran the lone rows at the chain's pace, not memory's. On an AVX-512 Xeon,
 * 1 thread, bf16, against one column at a time (the lead before the fusing
 * in brackets): 1 row, K 4096, N 12288 13.8 -> 6.8 ms; K 4096, N 4096 2.67
 * -> 1.51 ms [1.62]; 2 rows, K 512, N 4096 0.48 -> 0.18 ms [0.40]; 3 rows, K
 * 768, N 32768 10.6 -> 2.6 ms [7.3]; 8 rows, K 256, N 65536 (short rows
 * from memory, where one column at a time once streamed better, on Zen 4
 * before the prefetches below) 5.0 -> 4.5 ms [5.9]; f32, 16 rows, K 128,
 * N 16384 2.41 -> 1.17 ms (before the fusing). */

/* Where the few-rows kernel prefetches (dot_tile's pf): tiles of 3 columns
 * prefetch the next 3 rows of w while they read theirs; three rows read side
 * by side are three short streams, each crossing a page every 4 KiB, where
 * the hardware's prefetcher starts over. One column at a time prefetches
 * the row FEW_ROWS_PF_BYTES or more ahead: nearer, a prefetch finds its line
 * already on the way (8 rows, f32, K 256: 6.6 -> 8.4 ms one row ahead, 5.1
 * at 8 KiB). 1 thread, f32: 16 rows at K 4096, N 4096 9.1 -> 7.1 ms, 4 rows
 * 4.4 -> 2.4; 8 rows at K 512, N 32768 9.3 -> 4.7. */
#define FEW_ROWS_PF_BYTES 8192

/* Rows of w ahead that one column at a time prefetches (rows of rowbytes;
 * K 0 has nothing to prefetch, and no rows to divide by). */
static int64_t few_rows_pf_ahead(int64_t rowbytes) {
    return rowbytes > 0 ? (FEW_ROWS_PF_BYTES + rowbytes - 1) / rowbytes : 1;
}

/* The parallel loops stay in the SIMD_CLONES functions themselves, so
 * that each target's clone gets its own outlined loop body. */
SIMD_CLONES static void gemm_nt_few_rows(float *out, const float *in, const float *w, int64_t M, int64_t K,
                                         int64_t N, int acc) {
    const int64_t tiled = N / 3; /* column groups of 3 */
#pragma omp parallel if (M * N * K > 16 * DFL_CPU_PAR_MIN)
    {
        const int64_t d = few_rows_pf_ahead(4 * K);
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < tiled; g++) few_rows_columns(out, in, w + 3 * g * K, 0, M, K, N, 3 * g, acc, 4, 3,
                                                           g + 1 < tiled ? (const char *)(w + 3 * (g + 1) * K) : NULL, 4);
#pragma omp for schedule(static) nowait /* the region's end waits */
        for (int64_t n = 3 * tiled; n < N; n++) few_rows_columns(out, in, w + n * K, 0, M, K, N, n, acc, 8, 1,
                                                                      n + d < N ? (const char *)(w + (n + d) * K) : NULL, 4);
    }
}

/* bf16 weights: from FEW_ROWS_WIDEN_M rows on, each thread widens 3 rows of
 * w at a time into its own buffer (exact) and runs the f32 tiles on it;
 * widening once for all M rows costs less than widening a vector for each
 * tile of 4 rows (1 thread, K 4096, N 4096: 16 rows 7.6 ms against 10.4, 8
 * rows 4.8 against 5.2). Fewer rows, fewer tiles: the tiles widen w as they
 * read it (4 rows 3.5 -> 2.5 ms, 7 rows 6.1 -> 5.1), and so does one row (a
 * decode step), where widening first would double its time. */
#define FEW_ROWS_WIDEN_M 8

SIMD_CLONES static void gemm_nt_few_rows_bf16(float *out, const float *in, const uint16_t *w, int64_t M, int64_t K,
                                              int64_t N, int acc) {
    const int64_t tiled = N / 3; /* column groups of 3 */
#pragma omp parallel if (M * N * K > 16 * DFL_CPU_PAR_MIN)
    {
        const int64_t d = few_rows_pf_ahead(2 * K);
        float *buf = tiled && M >= FEW_ROWS_WIDEN_M ? dfl_aligned_alloc((size_t)(3 * K) * sizeof *buf) : NULL;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < tiled; g++) {
            const char *next = g + 1 < tiled ? (const char *)(w + 3 * (g + 1) * K) : NULL;
            if (buf) {
                dfl_cpu_widen_bf16(buf, w + 3 * g * K, 3 * K);
                few_rows_columns(out, in, buf, 0, M, K, N, 3 * g, acc, 4, 3, next, 2);
            } else {
                few_rows_columns(out, in, w + 3 * g * K, 1, M, K, N, 3 * g, acc, 4, 3, next, 2);
            }
        }
#pragma omp for schedule(static) nowait
        for (int64_t n = 3 * tiled; n < N; n++) few_rows_columns(out, in, w + n * K, 1, M, K, N, n, acc, 8, 1,
                                                                      n + d < N ? (const char *)(w + (n + d) * K) : NULL, 2);
        free(buf);
    }
}

void dfl_cpu_gemm_nt_few_rows(float *out, const float *in, const void *w, dfl_dtype wdt, int64_t M, int64_t K,
                              int64_t N, int acc) {
    DFL_ASSERT(wdt == DFL_F32 || wdt == DFL_BF16);
    if (wdt == DFL_BF16) gemm_nt_few_rows_bf16(out, in, w, M, K, N, acc);
    else gemm_nt_few_rows(out, in, w, M, K, N, acc);
}
