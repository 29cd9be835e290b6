/* ops_cpu_attn.c: attention on the CPU: causal over packed sequences (the
 * target) and the DFlash block mask, forward and backward (the drafter).
 *
 * defines: dfl_cpu_attn_causal, dfl_cpu_attn_dflash, dfl_cpu_attn_dflash_bwd
 *
 * Both are built from one tile kernel. A tile is nq consecutive query rows
 * and one kv head with its G = Hq/Hkv query heads (L = G*nq query lines, so
 * every key loaded is used by all heads of its group). The tile sees a
 * context range of key rows, every key visible to every query, and an "own"
 * range, all visible (a DFlash block) or causal (a causal tile). The keys
 * are walked in tiles of KT with an online softmax, so the work is exactly
 * the visible keys and the scratch memory is fixed (O(L*(D+KT)) per
 * thread), whatever the sequence length.
 *
 * q[*, Hq, D], k,v[*, Hkv, D], row-major; scale 1/sqrt(D); q head h reads kv
 * head h / G. lse is the natural log-sum-exp of the scaled scores.
 */
#include "ops_cpu.h"

#include "common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define QT 16 /* query rows per causal tile */
#define KT 64 /* keys per key tile */

typedef struct {
    const float *q, *k, *v;
    int64_t Hq, Hkv, D, G;
    float scale;
} attn_dims;

typedef struct {
    int64_t q0, nq;             /* query rows [q0, q0+nq) */
    int64_t ctx_off, ctx_len;   /* key rows all lines see */
    int64_t own_off, own_len;   /* own key rows: all visible, or key c to query i iff c <= i */
    int causal;
} attn_tile;

/* Per-thread scratch; line l is query head g = l / nq, row i = l % nq. */
typedef struct {
    float *qp;  /* [L, D] queries */
    float *dop; /* [L, D] dout (backward) */
    float *acc; /* [L, D] output (forward) or dq (backward) accumulator */
    float *s;   /* [L, KT] scores, then probabilities */
    float *dp;  /* [L, KT] dout . v, then dS (backward) */
    float *m;   /* [L] running max (forward) or lse (backward) */
    float *sum; /* [L] running sum (forward) or rowsum(dout * out) (backward) */
} attn_scratch;

static attn_scratch scratch_alloc(int64_t L, int64_t D) {
    attn_scratch sc;
    size_t ld = (size_t)L * (size_t)D, lk = (size_t)L * KT;
    float *p = dfl_aligned_alloc((3 * ld + 2 * lk + 2 * (size_t)L) * sizeof(float));
    sc.qp = p;
    sc.dop = sc.qp + ld;
    sc.acc = sc.dop + ld;
    sc.s = sc.acc + ld;
    sc.dp = sc.s + lk;
    sc.m = sc.dp + lk;
    sc.sum = sc.m + L;
    return sc;
}

static void scratch_free(attn_scratch *sc) { free(sc->qp); }

static inline float dotf(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpyf(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Offset of (row, head) in a [*, nh, D] tensor. */
static inline int64_t at_head(int64_t row, int64_t head, int64_t nh, int64_t D) { return (row * nh + head) * D; }

/* Copy the L query lines of a tile (from a [*, Hq, D] tensor) into dst[L, D]. */
static void pack_lines(float *dst, const float *src, const attn_dims *a, const attn_tile *t, int64_t kvh) {
    for (int64_t g = 0; g < a->G; g++)
        for (int64_t i = 0; i < t->nq; i++)
            memcpy(dst + (g * t->nq + i) * a->D, src + at_head(t->q0 + i, kvh * a->G + g, a->Hq, a->D),
                   (size_t)a->D * sizeof(float));
}

/* Key c of a key tile starting at index k0 of the own range is visible to
 * row i of a causal tile iff k0 + c <= i. Returns the number of keys row i
 * sees in that tile (n when the range is not causal). */
static inline int64_t visible_keys(const attn_tile *t, int own, int64_t k0, int64_t n, int64_t i) {
    if (!own || !t->causal) return n;
    int64_t v = i - k0 + 1;
    return v < 0 ? 0 : v > n ? n : v;
}

/* ------------------------------------------------------------------------ */
/* forward                                                                   */

/* One key tile, rows [r0, r0+n), of range `own` (0 ctx, 1 own): scores and
 * the online softmax update of every line. */
static void fwd_key_tile(const attn_dims *a, const attn_tile *t, int64_t kvh, attn_scratch *sc, int own,
                         int64_t k0, int64_t r0, int64_t n) {
    int64_t L = a->G * t->nq, D = a->D;
    for (int64_t l = 0; l < L; l++) {
        int64_t nv = visible_keys(t, own, k0, n, l % t->nq);
        float *s = sc->s + l * KT;
        const float *ql = sc->qp + l * D;
        for (int64_t c = 0; c < nv; c++) s[c] = dotf(ql, a->k + at_head(r0 + c, kvh, a->Hkv, D), D) * a->scale;
        if (nv == 0) continue;
        float mx = sc->m[l];
        for (int64_t c = 0; c < nv; c++) mx = fmaxf(mx, s[c]);
        float corr = expf(sc->m[l] - mx); /* 0 on the first visible tile: m = -inf, acc = 0 */
        float *acc = sc->acc + l * D;
        if (corr != 1.0f) {
            sc->sum[l] *= corr;
            for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        }
        sc->m[l] = mx;
        float sum = 0;
        for (int64_t c = 0; c < nv; c++) {
            float p = expf(s[c] - mx);
            sum += p;
            axpyf(acc, p, a->v + at_head(r0 + c, kvh, a->Hkv, D), D);
        }
        sc->sum[l] += sum;
    }
}

static void tile_fwd(float *out, float *lse, const attn_dims *a, const attn_tile *t, int64_t kvh,
                     attn_scratch *sc) {
    int64_t L = a->G * t->nq, D = a->D;
    pack_lines(sc->qp, a->q, a, t, kvh);
    memset(sc->acc, 0, (size_t)(L * D) * sizeof(float));
    for (int64_t l = 0; l < L; l++) sc->m[l] = -INFINITY, sc->sum[l] = 0;
    for (int own = 0; own < 2; own++) {
        int64_t off = own ? t->own_off : t->ctx_off, len = own ? t->own_len : t->ctx_len;
        for (int64_t k0 = 0; k0 < len; k0 += KT)
            fwd_key_tile(a, t, kvh, sc, own, k0, off + k0, len - k0 < KT ? len - k0 : KT);
    }
    for (int64_t l = 0; l < L; l++) {
        int64_t g = l / t->nq, i = l % t->nq, head = kvh * a->G + g;
        float *o = out + at_head(t->q0 + i, head, a->Hq, D);
        float inv = 1.0f / sc->sum[l]; /* every line sees at least one key */
        for (int64_t d = 0; d < D; d++) o[d] = sc->acc[l * D + d] * inv;
        if (lse) lse[(t->q0 + i) * a->Hq + head] = sc->m[l] + logf(sc->sum[l]);
    }
}

static attn_dims dims_of(const void *q, const void *k, const void *v, int64_t Hq, int64_t Hkv, int64_t D) {
    DFL_ASSERT(Hq > 0 && Hkv > 0 && D > 0 && Hq % Hkv == 0);
    attn_dims a = {q, k, v, Hq, Hkv, D, Hq / Hkv, (float)(1.0 / sqrt((double)D))};
    return a;
}

void dfl_cpu_attn_causal(void *out, const void *q, const void *k, const void *v, const int32_t *cu,
                         int64_t nseq, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
    attn_dims a = dims_of(q, k, v, Hq, Hkv, D);
    /* One tile per QT rows of each sequence. */
    int64_t ntile = 0;
    DFL_ASSERT(cu[0] == 0 && cu[nseq] == T);
    for (int64_t s = 0; s < nseq; s++) {
        DFL_ASSERT(cu[s + 1] >= cu[s]);
        ntile += (cu[s + 1] - cu[s] + QT - 1) / QT;
    }
    attn_tile *tiles = dfl_calloc((size_t)ntile + 1, sizeof *tiles);
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++)
        for (int64_t t0 = cu[s]; t0 < cu[s + 1]; t0 += QT) {
            int64_t nq = cu[s + 1] - t0 < QT ? cu[s + 1] - t0 : QT;
            tiles[n++] = (attn_tile){t0, nq, cu[s], t0 - cu[s], t0, nq, 1};
        }
#pragma omp parallel
    {
        attn_scratch sc = scratch_alloc(a.G * QT, D);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < ntile * Hkv; task++)
            tile_fwd(out, NULL, &a, &tiles[task / Hkv], task % Hkv, &sc);
        scratch_free(&sc);
    }
    free(tiles);
}

/* Block j: query rows [j*B, j*B+B), its dfl_block's two key ranges. */
static attn_tile block_tile(const dfl_block *b, int64_t j, int64_t B, int64_t NK) {
    DFL_ASSERT(b->ctx_len >= 0 && b->ctx_off >= 0 && (int64_t)b->ctx_off + b->ctx_len <= NK);
    DFL_ASSERT(b->blk_off >= 0 && (int64_t)b->blk_off + B <= NK);
    return (attn_tile){j * B, B, b->ctx_off, b->ctx_len, b->blk_off, B, 0};
}

void dfl_cpu_attn_dflash(void *out, float *lse, const void *q, const void *k, const void *v,
                         const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK, int64_t Hq, int64_t Hkv,
                         int64_t D) {
    attn_dims a = dims_of(q, k, v, Hq, Hkv, D);
    DFL_ASSERT(B > 0);
#pragma omp parallel
    {
        attn_scratch sc = scratch_alloc(a.G * B, D);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < nblk * Hkv; task++) {
            attn_tile t = block_tile(&blocks[task / Hkv], task / Hkv, B, NK);
            tile_fwd(out, lse, &a, &t, task % Hkv, &sc);
        }
        scratch_free(&sc);
    }
}

/* ------------------------------------------------------------------------ */
/* backward                                                                  */

/* The flash-attention backward with the saved lse: P = exp(S - lse),
 * dS = P * (dout.v - rowsum(dout * out)), dq += scale dS k, dk += scale dS^T q,
 * dv += P^T dout. dk/dv go to this thread's partial [NK, D] buffers. */
static void bwd_key_tile(const attn_dims *a, const attn_tile *t, int64_t kvh, attn_scratch *sc, int own,
                         int64_t k0, int64_t r0, int64_t n, float *dkp, float *dvp) {
    int64_t L = a->G * t->nq, D = a->D;
    for (int64_t l = 0; l < L; l++) {
        int64_t nv = visible_keys(t, own, k0, n, l % t->nq);
        float *p = sc->s + l * KT, *ds = sc->dp + l * KT;
        const float *ql = sc->qp + l * D, *dol = sc->dop + l * D;
        float *dql = sc->acc + l * D;
        for (int64_t c = 0; c < nv; c++) {
            const float *kc = a->k + at_head(r0 + c, kvh, a->Hkv, D);
            const float *vc = a->v + at_head(r0 + c, kvh, a->Hkv, D);
            p[c] = expf(dotf(ql, kc, D) * a->scale - sc->m[l]);
            ds[c] = p[c] * (dotf(dol, vc, D) - sc->sum[l]);
            axpyf(dql, ds[c], kc, D);
        }
        for (int64_t c = nv; c < n; c++) p[c] = 0, ds[c] = 0;
    }
    for (int64_t c = 0; c < n; c++) {
        float *dkc = dkp ? dkp + (r0 + c) * D : NULL, *dvc = dvp ? dvp + (r0 + c) * D : NULL;
        for (int64_t l = 0; l < L; l++) {
            float p = sc->s[l * KT + c], ds = sc->dp[l * KT + c];
            if (p == 0 && ds == 0) continue;
            if (dkc) axpyf(dkc, ds * a->scale, sc->qp + l * D, D);
            if (dvc) axpyf(dvc, p, sc->dop + l * D, D);
        }
    }
}

static void tile_bwd(float *dq, float *dkp, float *dvp, const float *dout, const float *out, const float *lse,
                     const attn_dims *a, const attn_tile *t, int64_t kvh, attn_scratch *sc) {
    int64_t L = a->G * t->nq, D = a->D;
    pack_lines(sc->qp, a->q, a, t, kvh);
    pack_lines(sc->dop, dout, a, t, kvh);
    memset(sc->acc, 0, (size_t)(L * D) * sizeof(float));
    for (int64_t l = 0; l < L; l++) {
        int64_t g = l / t->nq, i = l % t->nq, head = kvh * a->G + g;
        sc->m[l] = lse[(t->q0 + i) * a->Hq + head];
        sc->sum[l] = dotf(sc->dop + l * D, out + at_head(t->q0 + i, head, a->Hq, D), D);
    }
    for (int own = 0; own < 2; own++) {
        int64_t off = own ? t->own_off : t->ctx_off, len = own ? t->own_len : t->ctx_len;
        for (int64_t k0 = 0; k0 < len; k0 += KT)
            bwd_key_tile(a, t, kvh, sc, own, k0, off + k0, len - k0 < KT ? len - k0 : KT, dkp, dvp);
    }
    if (dq)
        for (int64_t l = 0; l < L; l++) {
            int64_t g = l / t->nq, i = l % t->nq, head = kvh * a->G + g;
            axpyf(dq + at_head(t->q0 + i, head, a->Hq, D), a->scale, sc->acc + l * D, D);
        }
}

/* Blocks share context keys (and overlapping anchors share block keys), so
 * dk/dv are summed per thread: each thread owns partial [NK, D] buffers for
 * the kv head being processed (memory: threads * 2 * NK * D floats), added
 * into dk/dv after each head. dq rows belong to one block each: no race. */
void dfl_cpu_attn_dflash_bwd(void *dq, void *dk_, void *dv_, const void *dout, const void *out, const float *lse,
                             const void *q, const void *k, const void *v, const dfl_block *blocks, int64_t nblk,
                             int64_t B, int64_t NK, int64_t Hq, int64_t Hkv, int64_t D) {
    attn_dims a = dims_of(q, k, v, Hq, Hkv, D);
    float *dk = dk_, *dv = dv_;
    DFL_ASSERT(B > 0);
    int nt = omp_get_max_threads();
    size_t part_n = (size_t)NK * (size_t)D;
    float *dkpart = dk ? dfl_calloc((size_t)nt * part_n, sizeof(float)) : NULL;
    float *dvpart = dv ? dfl_calloc((size_t)nt * part_n, sizeof(float)) : NULL;
#pragma omp parallel
    {
        attn_scratch sc = scratch_alloc(a.G * B, D);
        size_t me = (size_t)omp_get_thread_num() * part_n;
        float *dkp = dkpart ? dkpart + me : NULL, *dvp = dvpart ? dvpart + me : NULL;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
#pragma omp for schedule(dynamic)
            for (int64_t j = 0; j < nblk; j++) {
                attn_tile t = block_tile(&blocks[j], j, B, NK);
                tile_bwd(dq, dkp, dvp, dout, out, lse, &a, &t, kvh, &sc);
            }
            /* implicit barrier: every partial of this head is complete */
#pragma omp for
            for (int64_t r = 0; r < NK; r++) {
                for (int th = 0; th < nt; th++) {
                    size_t o = (size_t)th * part_n + (size_t)r * (size_t)D;
                    if (dk) {
                        axpyf(dk + at_head(r, kvh, Hkv, D), 1.0f, dkpart + o, D);
                        memset(dkpart + o, 0, (size_t)D * sizeof(float));
                    }
                    if (dv) {
                        axpyf(dv + at_head(r, kvh, Hkv, D), 1.0f, dvpart + o, D);
                        memset(dvpart + o, 0, (size_t)D * sizeof(float));
                    }
                }
            }
        }
        scratch_free(&sc);
    }
    free(dkpart);
    free(dvpart);
}
