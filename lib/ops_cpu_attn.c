/* ops_cpu_attn.c: attention on the CPU: causal over packed sequences (the
 * target) and the DFlash block mask, forward and backward (the drafter).
 *
 * defines: dfl_cpu_attn_causal, dfl_cpu_attn_dflash, dfl_cpu_attn_dflash_bwd
 *
 * Both are built from one tile kernel. A tile is nq consecutive query rows
 * and one kv head with its G = Hq/Hkv query heads: L = G*nq query lines, so
 * every key loaded serves all the heads of its group. The tile sees a
 * context range of key rows, every key visible to every query (but in a
 * sliding window), and an "own" range, all visible (a DFlash block) or
 * causal (a causal tile, a sliding-window block). Keys are
 * walked in tiles of KT with an online softmax (forward) or the saved lse
 * (backward), so the work is exactly the visible keys and the scratch
 * memory is fixed, O(L*(D+KT) + KT*D) per thread, whatever the sequence
 * length. The backward's two passes are described above
 * dfl_cpu_attn_dflash_bwd.
 *
 * Inside a key tile every product is a small matrix product (attn_mm:
 * mk_x16's register tiles of 6, 4 and 1 rows by 16 columns, AVX2 and FMA
 * where the CPU has them): the scores, kept transposed, K.Q^T, then P.V,
 * and in the backward V.dO^T, dS.K, dS^T.Q and P^T.dO. exp is dfl_cpu_expf, so that the softmax loops
 * vectorise.
 *
 * q[*, Hq, D], k,v[*, Hkv, D], row-major; scale 1/sqrt(D); q head h reads kv
 * head h / G. lse is the natural log-sum-exp of the scaled scores.
 */
/* GCC keeps a loop's float selects as branches (so the loop stays scalar)
 * while a compare could trap; nothing here enables FP traps. And in ISO C
 * mode (-std=c11) GCC does not contract a * b + c into one FMA: the small
 * products below then issue a multiply and an add per step, and the
 * attention ran 10-20 % slower (bench_ops_cpu causal and dflash). FMAs
 * round once where the pair rounds twice, so the AVX2 clone and the
 * baseline one (which has no FMA) differ in the last bits; nothing relies
 * on the two agreeing bit for bit. Set before the includes so that the
 * inline dfl_cpu_expf gets both. Clang ignores traps by default and
 * contracts within an expression by default. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math", "fp-contract=fast")
#endif

#include "ops_cpu.h"

#include "common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define QT 16 /* query rows per causal tile */
#define KT 64 /* keys per key tile (a multiple of 16) */

/* ------------------------------------------------------------------------ */
/* small matrix products (SIMD_CLONES, v8f: ops_cpu.h)                       */

/* C[R, 16] += A[R, K] . B[K, 16], R <= 6; A[i, k] at A + i*ai + k*ak, so
 * one kernel serves A and A^T. R is a constant where it is inlined, so the
 * accumulators unroll into 2R registers: 12 for the 6-row tiles, more
 * products in flight than the FMA pipes' latency needs (the 8 of 4 rows
 * are just enough, with nothing to spare for a late load). */
static inline __attribute__((always_inline)) void mk_x16(int R, float *C, int64_t ldc, const float *A, int64_t ai,
                                                         int64_t ak, const float *B, int64_t ldb, int64_t K) {
    v8f c[6][2] = {{{0}}}, b0, b1;
    for (int64_t k = 0; k < K; k++) {
        V8_LOAD(b0, B + k * ldb);
        V8_LOAD(b1, B + k * ldb + 8);
        const float *a = A + k * ak;
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const float ar = a[r * ai];
            c[r][0] += ar * b0, c[r][1] += ar * b1;
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        V8_ADD_STORE(C + r * ldc, c[r][0]);
        V8_ADD_STORE(C + r * ldc + 8, c[r][1]);
    }
}

/* C[M, N] += op(A) . B[K, N], op(A)[i, k] = A[i*ai + k*ak]: row-major A
 * [M, K] is (lda, 1), A^T stored [K, M] is (1, lda). B and C row-major. */
SIMD_CLONES static void attn_mm(float *C, int64_t ldc, const float *A, int64_t ai, int64_t ak, const float *B,
                                int64_t ldb, int64_t M, int64_t N, int64_t K) {
    int64_t N16 = N & ~(int64_t)15, i = 0;
    for (; i + 6 <= M; i += 6)
        for (int64_t j = 0; j < N16; j += 16) mk_x16(6, C + i * ldc + j, ldc, A + i * ai, ai, ak, B + j, ldb, K);
    for (; i + 4 <= M; i += 4)
        for (int64_t j = 0; j < N16; j += 16) mk_x16(4, C + i * ldc + j, ldc, A + i * ai, ai, ak, B + j, ldb, K);
    for (; i < M; i++)
        for (int64_t j = 0; j < N16; j += 16) mk_x16(1, C + i * ldc + j, ldc, A + i * ai, ai, ak, B + j, ldb, K);
    if (N16 == N) return;
    for (i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            float a = A[i * ai + k * ak];
            for (int64_t j = N16; j < N; j++) C[i * ldc + j] += a * B[k * ldb + j];
        }
}

/* C[M, N] += A[M, K] . B[K, N] */
static void mm_nn(float *C, int64_t ldc, const float *A, int64_t lda, const float *B, int64_t ldb, int64_t M,
                  int64_t N, int64_t K) {
    attn_mm(C, ldc, A, lda, 1, B, ldb, M, N, K);
}

/* C[M, N] += At^T . B[K, N], At stored [K, M] */
static void mm_tn(float *C, int64_t ldc, const float *At, int64_t ldat, const float *B, int64_t ldb, int64_t M,
                  int64_t N, int64_t K) {
    attn_mm(C, ldc, At, 1, ldat, B, ldb, M, N, K);
}

/* ------------------------------------------------------------------------ */
/* tiles                                                                     */

typedef struct {
    const float *q, *k, *v;
    int64_t Hq, Hkv, D, G;
    float scale;
} attn_dims;

typedef struct {
    int64_t q0, nq;           /* query rows [q0, q0+nq) */
    int64_t ctx_off, ctx_len; /* key rows all lines see */
    int64_t own_off, own_len; /* own key rows: all visible, or key c to query i iff c <= i */
    int causal;
    /* one-query DFlash blocks run as one causal tile (group_rows): row i
     * also hides the keys before row_blk[i].ctx_off (a sliding window) */
    const dfl_block *row_blk;
    /* a drafter's sliding-window block (ops.h attn_dflash): row i sees the
     * context keys from ctx_off + ctx_len + i + 1 - window on; 0: all */
    int64_t window;
    /* a target's sliding window (ops.h attn_causal): row i, itself key
     * own_off + i, sees the keys from own_off + i + 1 - row_window on, in
     * either range; 0: all */
    int64_t row_window;
} attn_tile;

/* Per-thread scratch. Line l is query head g = l / nq, row i = l % nq.
 * Scores are kept transposed, [keys, lines], so that the softmax runs along
 * contiguous lines and no key tile is ever transposed. */
typedef struct {
    float *qp;  /* [L, D] queries */
    float *qt;  /* [D, L] queries, transposed */
    float *dop; /* [L, D] dout (backward) */
    float *dot; /* [D, L] dout, transposed (backward) */
    float *acc; /* [L, D] output (forward) or dq (backward) accumulator */
    float *kp;  /* [KT, D] the key tile's K rows of this kv head, contiguous */
    float *vp;  /* [KT, D] its V rows */
    float *st;  /* [KT, L] scores, then P */
    float *dpt; /* [KT, L] V.dO^T, then dS (backward) */
    float *m;   /* [L] running max (forward) or lse (backward) */
    float *sum; /* [L] running sum (forward) or rowsum(dout * out) (backward) */
    float *tm;  /* [L] this key tile's max, then the rescale factor (forward) */
    float *ts;  /* [L] this key tile's sum (forward) */
} attn_scratch;

static attn_scratch scratch_alloc(int64_t L, int64_t D) {
    attn_scratch sc;
    size_t ld = (size_t)(L * D), lk = (size_t)(L * KT), l = (size_t)L;
    size_t kd = (size_t)(KT * D);
    float *p = dfl_aligned_alloc((5 * ld + 2 * kd + 2 * lk + 4 * l) * sizeof(float));
    sc.qp = p, sc.qt = sc.qp + ld, sc.dop = sc.qt + ld, sc.dot = sc.dop + ld, sc.acc = sc.dot + ld;
    sc.kp = sc.acc + ld, sc.vp = sc.kp + kd;
    sc.st = sc.vp + kd, sc.dpt = sc.st + lk;
    sc.m = sc.dpt + lk, sc.sum = sc.m + l, sc.tm = sc.sum + l, sc.ts = sc.tm + l;
    return sc;
}

static void scratch_free(attn_scratch *sc) { free(sc->qp); }

/* Offset of (row, head) in a [*, nh, D] tensor. */
static inline int64_t at_head(int64_t row, int64_t head, int64_t nh, int64_t D) { return (row * nh + head) * D; }

/* The L lines of a tile (from a [*, Hq, D] tensor) into dst[L, D] and,
 * transposed, into dstt[D, L]. */
static void pack_lines(float *dst, float *dstt, const float *src, const attn_dims *a, const attn_tile *t,
                       int64_t kvh) {
    int64_t L = a->G * t->nq, D = a->D;
    for (int64_t g = 0; g < a->G; g++)
        for (int64_t i = 0; i < t->nq; i++)
            memcpy(dst + (g * t->nq + i) * D, src + at_head(t->q0 + i, kvh * a->G + g, a->Hq, D),
                   (size_t)D * sizeof(float));
    for (int64_t l = 0; l < L; l++)
        for (int64_t d = 0; d < D; d++) dstt[d * L + l] = dst[l * D + d];
}

/* Rows [r0, r0+n) of kv head kvh of src into dst[n, D]: contiguous, where
 * the rows of one head lie Hkv*D apart (4 KiB for 8 heads of 128, which
 * maps every row to the same L1 set). A product that walks down the rows
 * (the B operand of P.V, dS.K) needs this; one that reads a few rows
 * along D at a time (the A operand of K.Q^T) does not. */
static void load_rows(float *dst, const float *src, const attn_dims *a, int64_t kvh, int64_t r0, int64_t n) {
    for (int64_t c = 0; c < n; c++)
        memcpy(dst + c * a->D, src + at_head(r0 + c, kvh, a->Hkv, a->D), (size_t)a->D * sizeof(float));
}

/* K and V rows [r0, r0+n) of kv head kvh into sc->kp, sc->vp [n, D]. */
static void load_kv_tile(attn_scratch *sc, const attn_dims *a, int64_t kvh, int64_t r0, int64_t n) {
    load_rows(sc->kp, a->k, a, kvh, r0, n);
    load_rows(sc->vp, a->v, a, kvh, r0, n);
}

/* The rows [*lo, *hi) of a tile that see key row r, index idx of range
 * `own` (row_blk aside): in a causal own range rows from idx on; in a
 * sliding window's context the rows up to r - ctx_end + window; in a
 * target's window the rows up to r - own_off + row_window. */
static inline void rows_seeing(const attn_tile *t, int own, int64_t idx, int64_t r, int64_t *lo, int64_t *hi) {
    int64_t a = own && t->causal ? idx : 0;
    int64_t b = !own && t->window ? r - (t->ctx_off + t->ctx_len) + t->window : t->nq;
    if (t->row_window && r - t->own_off + t->row_window < b) b = r - t->own_off + t->row_window;
    *lo = a < t->nq ? a : t->nq;
    *hi = b < *lo ? *lo : b < t->nq ? b : t->nq;
}

/* Set the tile's lines of the rows outside [lo, hi) in one key's column
 * s[L] (line g*nq + i) to val. */
static inline void hide_rows(float *s, float val, int64_t G, int64_t nq, int64_t lo, int64_t hi) {
    for (int64_t g = 0; g < G && (lo > 0 || hi < nq); g++) {
        for (int64_t i = 0; i < lo; i++) s[g * nq + i] = val;
        for (int64_t i = hi; i < nq; i++) s[g * nq + i] = val;
    }
}

/* ------------------------------------------------------------------------ */
/* forward                                                                   */

/* Key rows [r0, r0+n) (index k0 of range `own`): scores St = K.Q^T (K
 * read in place), then the online softmax update of every line (rescale
 * the accumulated output and sum by exp(m_old - m_new)), then acc += P.V.
 * The scale is applied where the exponent is taken: the tile's maximum of
 * the raw scores times the scale is the maximum of the scaled scores
 * (scale > 0, and rounding is monotone), so that is the same number. */
SIMD_CLONES static void attn_fwd_key_tile(const attn_dims *a, const attn_tile *t, int64_t kvh, attn_scratch *sc,
                                          int own, int64_t k0, int64_t r0, int64_t n) {
    int64_t L = a->G * t->nq, D = a->D, nq = t->nq;
    float *restrict tm = sc->tm, *restrict ts = sc->ts, *restrict m = sc->m;
    const float scale = a->scale;
    load_rows(sc->vp, a->v, a, kvh, r0, n);
    memset(sc->st, 0, (size_t)(n * L) * sizeof(float));
    mm_nn(sc->st, L, a->k + at_head(r0, kvh, a->Hkv, D), a->Hkv * D, sc->qt, L, n, L, D);
    for (int64_t l = 0; l < L; l++) tm[l] = -INFINITY, ts[l] = 0;
    for (int64_t c = 0; c < n; c++) {
        float *restrict s = sc->st + c * L;
        int64_t lo, hi;
        rows_seeing(t, own, k0 + c, r0 + c, &lo, &hi);
        hide_rows(s, -INFINITY, a->G, nq, lo, hi);
        for (int64_t i = 0; t->row_blk && i < nq; i++)
            if (r0 + c < t->row_blk[i].ctx_off)
                for (int64_t g = 0; g < a->G; g++) s[g * nq + i] = -INFINITY;
#pragma omp simd
        for (int64_t l = 0; l < L; l++) tm[l] = s[l] > tm[l] ? s[l] : tm[l];
    }
#pragma omp simd
    for (int64_t l = 0; l < L; l++) {
        float mx = tm[l] * scale > m[l] ? tm[l] * scale : m[l];
        /* exp(m_old - m_new): 0 on a line's first visible tile (m_old = -inf, acc = 0) */
        float corr = dfl_cpu_expf(m[l] - mx);
        tm[l] = mx == -INFINITY ? 1.0f : corr;
        m[l] = mx;
    }
    for (int64_t c = 0; c < n; c++) {
        float *restrict s = sc->st + c * L;
#pragma omp simd
        for (int64_t l = 0; l < L; l++) {
            float e = dfl_cpu_expf(s[l] * scale - m[l]);
            s[l] = s[l] == -INFINITY ? 0.0f : e;
            ts[l] += s[l];
        }
    }
    for (int64_t l = 0; l < L; l++) {
        float corr = tm[l], *restrict acc = sc->acc + l * D;
        sc->sum[l] = sc->sum[l] * corr + ts[l];
        if (corr != 1.0f) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        }
    }
    mm_tn(sc->acc, D, sc->st, L, sc->vp, D, L, D, n);
}

static void tile_fwd(float *out, float *lse, const attn_dims *a, const attn_tile *t, int64_t kvh,
                     attn_scratch *sc) {
    int64_t L = a->G * t->nq, D = a->D;
    pack_lines(sc->qp, sc->qt, a->q, a, t, kvh);
    memset(sc->acc, 0, (size_t)(L * D) * sizeof(float));
    for (int64_t l = 0; l < L; l++) sc->m[l] = -INFINITY, sc->sum[l] = 0;
    for (int own = 0; own < 2; own++) {
        int64_t off = own ? t->own_off : t->ctx_off, len = own ? t->own_len : t->ctx_len;
        for (int64_t k0 = 0; k0 < len; k0 += KT)
            attn_fwd_key_tile(a, t, kvh, sc, own, k0, off + k0, len - k0 < KT ? len - k0 : KT);
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t g = l / t->nq, i = l % t->nq, head = kvh * a->G + g;
        float *o = out + at_head(t->q0 + i, head, a->Hq, D);
        float inv = 1.0f / sc->sum[l]; /* every line sees at least one key */
        for (int64_t d = 0; d < D; d++) o[d] = sc->acc[l * D + d] * inv;
        if (lse) lse[(t->q0 + i) * a->Hq + head] = sc->m[l] + logf(sc->sum[l]);
    }
}

/* Multiply-adds of one pass over the blocks' visible keys, to decide on a
 * parallel region (a decoding step's few 1-row blocks run on one thread). */
static int64_t dflash_work(const dfl_block *blocks, int64_t nblk, int64_t B, int64_t Hq, int64_t D) {
    int64_t keys = 0;
    for (int64_t j = 0; j < nblk; j++) keys += blocks[j].ctx_len + B;
    return keys * B * Hq * D;
}

static attn_dims dims_of(const void *q, const void *k, const void *v, int64_t Hq, int64_t Hkv, int64_t D) {
    DFL_ASSERT(Hq > 0 && Hkv > 0 && D > 0 && Hq % Hkv == 0);
    attn_dims a = {q, k, v, Hq, Hkv, D, Hq / Hkv, (float)(1.0 / sqrt((double)D))};
    return a;
}

void dfl_cpu_attn_causal(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *cu,
                         int64_t nseq, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t window) {
    attn_dims a = dims_of(q, k, v, Hq, Hkv, D);
    /* One tile per QT rows of each sequence; in a window its context starts
     * at its first row's first key. */
    int64_t ntile = 0;
    DFL_ASSERT(cu[0] == 0 && cu[nseq] == T && window >= 0);
    for (int64_t s = 0; s < nseq; s++) {
        DFL_ASSERT(cu[s + 1] >= cu[s]);
        ntile += (cu[s + 1] - cu[s] + QT - 1) / QT;
    }
    attn_tile *tiles = dfl_calloc((size_t)ntile + 1, sizeof *tiles);
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++)
        for (int64_t t0 = cu[s]; t0 < cu[s + 1]; t0 += QT) {
            int64_t nq = cu[s + 1] - t0 < QT ? cu[s + 1] - t0 : QT;
            int64_t lo = window && t0 - (window - 1) > cu[s] ? t0 - (window - 1) : cu[s];
            tiles[n++] = (attn_tile){t0, nq, lo, t0 - lo, t0, nq, 1, NULL, 0, window};
        }
    int64_t work = 0; /* query-key pairs, at most */
    for (int64_t s = 0; s < nseq; s++) work += (cu[s + 1] - cu[s]) * (cu[s + 1] - cu[s] + 1) / 2;
#pragma omp parallel if (work * Hq * D > DFL_CPU_PAR_MIN)
    {
        attn_scratch sc = scratch_alloc(a.G * QT, D);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < ntile * Hkv; task++)
            tile_fwd(out, lse, &a, &tiles[task / Hkv], task % Hkv, &sc);
        scratch_free(&sc);
    }
    free(tiles);
}

/* Block j: query rows [j*B, j*B+B), its dfl_block's two key ranges; in a
 * sliding window the context is cut to the keys its first row sees (the
 * later rows see fewer, rows_seeing) and the block is causal. */
static attn_tile block_tile(const dfl_block *b, int64_t j, int64_t B, int64_t NK, int64_t window) {
    DFL_ASSERT(b->ctx_len >= 0 && b->ctx_off >= 0 && (int64_t)b->ctx_off + b->ctx_len <= NK);
    DFL_ASSERT(b->blk_off >= 0 && (int64_t)b->blk_off + B <= NK && window >= 0);
    int64_t end = (int64_t)b->ctx_off + b->ctx_len, lo = b->ctx_off;
    if (window && end - (window - 1) > lo) lo = end - (window - 1);
    return (attn_tile){j * B, B, lo, end - lo, b->blk_off, B, window > 0, NULL, window, 0};
}

/* One-query blocks (B = 1: a target's causal rows, plain or in a sliding
 * window, as target.c and target_kv.c lay them out) whose queries, taken
 * QT at a time, share one causal tile: rows j0.. whose own keys follow one
 * another, each seeing the keys from its ctx_off up to its own. Each key
 * is then loaded once for the tile's rows, not once a row. Returns the
 * tiles written into tiles[] (at most nblk). */
static int64_t group_rows(attn_tile *tiles, const dfl_block *blocks, int64_t nblk, int64_t NK) {
    int64_t n = 0;
    for (int64_t j0 = 0; j0 < nblk;) {
        const dfl_block *b0 = &blocks[j0];
        int64_t len = 1;
        while (len < QT && j0 + len < nblk) {
            const dfl_block *b = &blocks[j0 + len];
            if (b->blk_off != b0->blk_off + len || b->ctx_off + b->ctx_len != b->blk_off || b->ctx_off < b0->ctx_off)
                break;
            len++;
        }
        if (len == 1 || b0->ctx_off + b0->ctx_len != b0->blk_off) {
            tiles[n++] = block_tile(b0, j0, 1, NK, 0);
            j0++;
            continue;
        }
        DFL_ASSERT(b0->ctx_off >= 0 && b0->ctx_len >= 0 && (int64_t)b0->blk_off + len <= NK);
        tiles[n++] = (attn_tile){j0, len, b0->ctx_off, b0->ctx_len, b0->blk_off, len, 1, b0, 0, 0};
        j0 += len;
    }
    return n;
}

void dfl_cpu_attn_dflash(void *out, float *lse, const void *q, const void *k, const void *v,
                         const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t window) {
    attn_dims a = dims_of(q, k, v, Hq, Hkv, D);
    DFL_ASSERT(B > 0 && window >= 0);
    attn_tile *rows = NULL; /* B = 1: the rows grouped into causal tiles */
    int64_t ntile = nblk;
    if (B == 1 && nblk > 1 && !window) {
        rows = dfl_malloc((size_t)nblk * sizeof *rows);
        ntile = group_rows(rows, blocks, nblk, NK);
    }
#pragma omp parallel if (dflash_work(blocks, nblk, B, Hq, D) > DFL_CPU_PAR_MIN)
    {
        attn_scratch sc = scratch_alloc(a.G * (rows ? QT : B), D);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < ntile * Hkv; task++) {
            attn_tile t = rows ? rows[task / Hkv] : block_tile(&blocks[task / Hkv], task / Hkv, B, NK, window);
            tile_fwd(out, lse, &a, &t, task % Hkv, &sc);
        }
        scratch_free(&sc);
    }
    free(rows);
}

/* ------------------------------------------------------------------------ */
/* backward                                                                  */

/* The flash-attention backward with the saved lse, in two passes that
 * each own what they write, so no sums race and the result does not depend
 * on the thread count or the schedule. It writes dq, dk and dv (every row,
 * zeros for keys no block sees), as the CUDA kernels do:
 *   dq pass, per (block, kv head): over the block's visible keys,
 *     P = exp(scale K.Q^T - lse), dS = P * (V.dO^T - rowsum(dO*O)),
 *     dq = scale dS.K;
 *   dk/dv pass, per (key tile of KT rows, kv head): over the blocks that see
 *     any of those rows, in block order, the same P and dS, then
 *     dk = scale dS^T.Q, dv = P^T.dO.
 * P and dS are recomputed in both (7 matrix products instead of 5), the
 * price of needing no per-thread [NK, D] partial sums. Backward is for
 * DFlash block tiles only (with or without a sliding window). */

/* P and dS for key rows [r0, r0+n) (index k0 of range `own`) of one
 * tile's lines, kept [keys, lines] in sc->st and sc->dpt (the K, V rows
 * left in sc->kp, sc->vp), 0 where a row does not see the key; sc->m holds
 * lse, sc->sum rowsum(dO*O). */
SIMD_CLONES static void attn_bwd_p_ds(const attn_dims *a, const attn_tile *t, int64_t kvh, attn_scratch *sc, int own,
                                      int64_t k0, int64_t r0, int64_t n) {
    int64_t L = a->G * t->nq, D = a->D;
    const float *restrict m = sc->m, *restrict sum = sc->sum;
    memset(sc->st, 0, (size_t)(n * L) * sizeof(float));
    memset(sc->dpt, 0, (size_t)(n * L) * sizeof(float));
    load_kv_tile(sc, a, kvh, r0, n);
    mm_nn(sc->st, L, sc->kp, D, sc->qt, L, n, L, D);
    mm_nn(sc->dpt, L, sc->vp, D, sc->dot, L, n, L, D);
    for (int64_t c = 0; c < n; c++) {
        float *restrict p = sc->st + c * L, *restrict ds = sc->dpt + c * L;
#pragma omp simd
        for (int64_t l = 0; l < L; l++) {
            p[l] = dfl_cpu_expf(p[l] * a->scale - m[l]);
            ds[l] = p[l] * (ds[l] - sum[l]);
        }
        int64_t lo, hi;
        rows_seeing(t, own, k0 + c, r0 + c, &lo, &hi);
        hide_rows(p, 0.0f, a->G, t->nq, lo, hi);
        hide_rows(ds, 0.0f, a->G, t->nq, lo, hi);
    }
}

/* Pack a tile's q and dout lines, its lse and rowsum(dO*O) (precomputed in
 * dsum[rows, Hq]) into the scratch. */
static void bwd_pack(const float *dout, const float *lse, const float *dsum, const attn_dims *a, const attn_tile *t,
                     int64_t kvh, attn_scratch *sc) {
    pack_lines(sc->qp, sc->qt, a->q, a, t, kvh);
    pack_lines(sc->dop, sc->dot, dout, a, t, kvh);
    for (int64_t l = 0; l < a->G * t->nq; l++) {
        int64_t g = l / t->nq, i = l % t->nq, head = kvh * a->G + g;
        sc->m[l] = lse[(t->q0 + i) * a->Hq + head];
        sc->sum[l] = dsum[(t->q0 + i) * a->Hq + head];
    }
}

static void tile_bwd_dq(float *dq, const float *dout, const float *lse, const float *dsum, const attn_dims *a,
                        const attn_tile *t, int64_t kvh, attn_scratch *sc) {
    int64_t L = a->G * t->nq, D = a->D;
    bwd_pack(dout, lse, dsum, a, t, kvh, sc);
    memset(sc->acc, 0, (size_t)(L * D) * sizeof(float));
    for (int own = 0; own < 2; own++) {
        int64_t off = own ? t->own_off : t->ctx_off, len = own ? t->own_len : t->ctx_len;
        for (int64_t k0 = 0; k0 < len; k0 += KT) {
            int64_t n = len - k0 < KT ? len - k0 : KT;
            attn_bwd_p_ds(a, t, kvh, sc, own, k0, off + k0, n);
            mm_tn(sc->acc, D, sc->dpt, L, sc->kp, D, L, D, n);
        }
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t g = l / t->nq, i = l % t->nq, head = kvh * a->G + g;
        float *dql = dq + at_head(t->q0 + i, head, a->Hq, D);
        for (int64_t d = 0; d < D; d++) dql[d] = a->scale * sc->acc[l * D + d];
    }
}

/* dk, dv of key rows [t0, t1) of kv head kvh, from every block that sees
 * some of them, in block order. */
static void key_tile_bwd_dkv(float *dk, float *dv, const float *dout, const float *lse, const float *dsum,
                             const attn_dims *a, const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                             int64_t window, int64_t kvh, int64_t t0, int64_t t1, attn_scratch *sc) {
    int64_t D = a->D, L = a->G * B, ld = a->Hkv * D;
    for (int64_t r = t0; r < t1; r++) { /* the products below add into these rows */
        if (dk) memset(dk + at_head(r, kvh, a->Hkv, D), 0, (size_t)D * sizeof(float));
        if (dv) memset(dv + at_head(r, kvh, a->Hkv, D), 0, (size_t)D * sizeof(float));
    }
    for (int64_t j = 0; j < nblk; j++) {
        attn_tile t = block_tile(&blocks[j], j, B, NK, window);
        int packed = 0;
        for (int own = 0; own < 2; own++) {
            int64_t off = own ? t.own_off : t.ctx_off, len = own ? t.own_len : t.ctx_len;
            int64_t lo = off > t0 ? off : t0, hi = off + len < t1 ? off + len : t1;
            if (lo >= hi) continue;
            if (!packed) {
                bwd_pack(dout, lse, dsum, a, &t, kvh, sc);
                packed = 1;
            }
            attn_bwd_p_ds(a, &t, kvh, sc, own, lo - off, lo, hi - lo);
            if (dv) mm_nn(dv + at_head(lo, kvh, a->Hkv, D), ld, sc->st, L, sc->dop, D, hi - lo, D, L);
            if (dk) {
                for (int64_t e = 0; e < (hi - lo) * L; e++) sc->dpt[e] *= a->scale;
                mm_nn(dk + at_head(lo, kvh, a->Hkv, D), ld, sc->dpt, L, sc->qp, D, hi - lo, D, L);
            }
        }
    }
}

void dfl_cpu_attn_dflash_bwd(void *dq, void *dk, void *dv, const void *dout_, const void *out_, const float *lse,
                             const void *q, const void *k, const void *v, const dfl_block *blocks, int64_t nblk,
                             int64_t B, int64_t NK, int64_t Hq, int64_t Hkv, int64_t D, int64_t window) {
    attn_dims a = dims_of(q, k, v, Hq, Hkv, D);
    const float *dout = dout_, *out = out_;
    DFL_ASSERT(B > 0 && window >= 0);
    int64_t nq = nblk * B, ntile = (NK + KT - 1) / KT;
    /* rowsum(dO * O) per query row and head */
    float *dsum = dfl_aligned_alloc((size_t)(nq * Hq + 1) * sizeof(float));
    int par = dflash_work(blocks, nblk, B, Hq, D) > DFL_CPU_PAR_MIN;
#pragma omp parallel for if (par)
    for (int64_t r = 0; r < nq * Hq; r++) {
        float s = 0;
        for (int64_t d = 0; d < D; d++) s += dout[r * D + d] * out[r * D + d];
        dsum[r] = s;
    }
#pragma omp parallel if (par)
    {
        attn_scratch sc = scratch_alloc(a.G * B, D);
        if (dq) {
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < nblk * Hkv; task++) {
                attn_tile t = block_tile(&blocks[task / Hkv], task / Hkv, B, NK, window);
                tile_bwd_dq(dq, dout, lse, dsum, &a, &t, task % Hkv, &sc);
            }
        }
        if (dk || dv) {
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < ntile * Hkv; task++) {
                int64_t t0 = task / Hkv * KT, t1 = t0 + KT < NK ? t0 + KT : NK;
                key_tile_bwd_dkv(dk, dv, dout, lse, dsum, &a, blocks, nblk, B, NK, window, task % Hkv, t0, t1, &sc);
            }
        }
        scratch_free(&sc);
    }
    free(dsum);
}
