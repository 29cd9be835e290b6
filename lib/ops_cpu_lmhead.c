/* ops_cpu_lmhead.c: the frozen LM head on the CPU: cross-entropy, KL to
 * the target's distribution, greedy argmax, sampling at a temperature (the
 * Gumbel-max draw of sample.h), each with its logits computed
 * a chunk of rows at a time and never whole.
 *
 * defines: dfl_cpu_lmhead_ce, dfl_cpu_lmhead_kl, dfl_cpu_lmhead_argmax, dfl_cpu_lmhead_sample,
 * dfl_cpu_lmhead_chunk_rows
 *
 * h, th [N, H]; w [V, H]. A chunk of R rows has its logits z[R, V] = h . w^T
 * made by one sgemm; the row statistics (max, argmax, log-sum-exp in double)
 * are computed in parallel over rows; then z is overwritten with
 * gscale * (softmax - target) for the rows that want a gradient, which are
 * packed to the front so that dh[rows] += G . w is one sgemm over them only.
 * Memory: one (CE, argmax) or two (KL) logits buffers of R x V floats, with
 * R = dfl_cpu_lmhead_chunk_rows(V), plus R x H for the gradient: bounded by
 * DFL_CPU_LMHEAD_FLOATS, independent of N.
 */
/* As in ops_cpu_attn.c: lets GCC vectorize the loops over dfl_cpu_expf. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "ops_cpu.h"

#include "common.h"
#include "sample.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

int64_t dfl_cpu_lmhead_rows_override;

int64_t dfl_cpu_lmhead_chunk_rows(int64_t V) {
    if (dfl_cpu_lmhead_rows_override > 0) return dfl_cpu_lmhead_rows_override;
    int64_t r = DFL_CPU_LMHEAD_FLOATS / (V > 0 ? V : 1);
    return r < 1 ? 1 : r > DFL_CPU_LMHEAD_MAX_ROWS ? DFL_CPU_LMHEAD_MAX_ROWS : r;
}

/* z[R, V] = h[R, H] . w[V, H]^T */
static void logits(float *z, const float *h, const float *w, int64_t R, int64_t H, int64_t V) {
    dfl_cpu_gemm_nt(z, h, w, R, H, V, 0.0f);
}

/* dfl_cpu_top2 (ops_cpu.h) in TOP2_LANES independent scans, lane j over
 * z[j], z[j + LANES], ... (each keeps its first maximum, its index and its
 * runner-up), so the compiler can vectorize the scan: it is a select per
 * element, where the one running scan was a compare and branch per logit
 * (half of the CE rows' time in a small drafter's step). The lanes merge
 * in index order: the maximum of the lanes' maxima with the lowest index,
 * and as runner-up the best of every other lane's maximum and every lane's
 * runner-up. A lane whose index is still -1 saw nothing above -inf. */
#define TOP2_LANES 16

SIMD_CLONES int32_t dfl_cpu_top2(const float *z, int64_t V, float *max, float *second) {
    float m1[TOP2_LANES], m2[TOP2_LANES];
    int32_t i1[TOP2_LANES];
    for (int j = 0; j < TOP2_LANES; j++) m1[j] = m2[j] = -INFINITY, i1[j] = -1;
    int64_t c = 0;
    for (; c + TOP2_LANES <= V; c += TOP2_LANES) {
#pragma omp simd
        for (int j = 0; j < TOP2_LANES; j++) {
            float x = z[c + j];
            int gt = x > m1[j];
            float lower = x > m2[j] ? x : m2[j];
            m2[j] = gt ? m1[j] : lower;
            i1[j] = gt ? (int32_t)(c + j) : i1[j];
            m1[j] = gt ? x : m1[j];
        }
    }
    for (int j = 0; c < V; c++, j++) {
        float x = z[c];
        if (x > m1[j]) m2[j] = m1[j], m1[j] = x, i1[j] = (int32_t)c;
        else if (x > m2[j]) m2[j] = x;
    }
    int best = -1;
    for (int j = 0; j < TOP2_LANES; j++)
        if (i1[j] >= 0 && (best < 0 || m1[j] > m1[best] || (m1[j] == m1[best] && i1[j] < i1[best]))) best = j;
    float run = -INFINITY;
    for (int j = 0; j < TOP2_LANES; j++) {
        if (j != best && m1[j] > run) run = m1[j];
        if (m2[j] > run) run = m2[j];
    }
    if (best < 0 || z[0] != z[0]) {
        /* every entry -inf or NaN, or z[0] NaN: z[0] is the argmax; the
         * runner-up is the largest of the others */
        if (best >= 0 && m1[best] > run) run = m1[best];
        *max = z[0], *second = run;
        return 0;
    }
    *max = z[i1[best]], *second = run;
    return i1[best];
}

/* Row statistics of z[V]: the argmax (lowest index on ties), top-1 minus
 * top-2, and the max. */
typedef struct {
    int32_t arg;
    float max, second;
} row_top;

static row_top top2(const float *z, int64_t V) {
    row_top t;
    t.arg = dfl_cpu_top2(z, V, &t.max, &t.second);
    return t;
}

/* log sum exp z, the sum in double around the max. */
static inline float logsumexp(const float *z, int64_t V, float max) {
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < V; c++) s += dfl_cpu_expf(z[c] - max);
    return max + (float)log(s);
}

/* The gradient rows: g[n, V] (packed in z's memory) times w gives dhc[n, H],
 * added to dh at rows r0 + rows[i]. */
static void add_grad_rows(float *dh, float *dhc, const float *g, const int32_t *rows, int64_t n, int64_t r0,
                          const float *w, int64_t H, int64_t V) {
    if (n == 0) return;
    dfl_cpu_sgemm(0, 0, n, H, V, g, V, w, H, 0.0f, dhc, H);
#pragma omp parallel for if (n * H > DFL_CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float *d = dh + (r0 + rows[i]) * H;
        const float *s = dhc + i * H;
        for (int64_t c = 0; c < H; c++) d[c] += s[c];
    }
}

/* Move the gradient rows (want[i] set) of z[R, V] to the front, in order;
 * rows[] gets their chunk indices. Returns their number. */
static int64_t pack_rows(float *z, const uint8_t *want, int32_t *rows, int64_t R, int64_t V) {
    int64_t n = 0;
    for (int64_t i = 0; i < R; i++) {
        if (!want[i]) continue;
        if (n != i) memcpy(z + n * V, z + i * V, (size_t)V * sizeof(float));
        rows[n++] = (int32_t)i;
    }
    return n;
}

typedef struct {
    int64_t R;     /* rows per chunk */
    float *z;      /* [R, V] */
    float *zt;     /* [R, V] (KL only) */
    float *dhc;    /* [R, H] */
    uint8_t *want; /* [R] */
    int32_t *rows; /* [R] */
} lm_chunk;

static lm_chunk chunk_alloc(int64_t N, int64_t H, int64_t V, int two, int grad) {
    lm_chunk c = {0};
    c.R = dfl_cpu_lmhead_chunk_rows(V);
    if (c.R > N) c.R = N;
    c.z = dfl_aligned_alloc((size_t)c.R * (size_t)V * sizeof(float));
    c.zt = two ? dfl_aligned_alloc((size_t)c.R * (size_t)V * sizeof(float)) : NULL;
    c.dhc = grad ? dfl_aligned_alloc((size_t)c.R * (size_t)H * sizeof(float)) : NULL;
    c.want = dfl_calloc((size_t)c.R, 1);
    c.rows = dfl_calloc((size_t)c.R, sizeof(int32_t));
    return c;
}

static void chunk_free(lm_chunk *c) {
    free(c->z);
    free(c->zt);
    free(c->dhc);
    free(c->want);
    free(c->rows);
}

/* One row of dfl_cpu_lmhead_ce: its argmax and loss, and z[V] overwritten
 * with gs * (softmax - onehot(y)) when `grad` (exp(z - max) otherwise). A
 * clone per target, as the exponentials are most of the row. */
SIMD_CLONES static void ce_row(float *z, int64_t V, int32_t y, float gs, int grad, float *loss, int32_t *pred) {
    row_top t = top2(z, V);
    if (pred) *pred = t.arg;
    if (y < 0) {
        if (loss) *loss = 0;
        return;
    }
    float zy = z[y];
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < V; c++) z[c] = dfl_cpu_expf(z[c] - t.max), sum += z[c];
    if (loss) *loss = t.max + (float)log(sum) - zy;
    if (!grad) return;
    float g = (float)((double)gs / sum);
#pragma omp simd
    for (int64_t c = 0; c < V; c++) z[c] *= g;
    z[y] -= gs;
}

void dfl_cpu_lmhead_ce(float *loss, int32_t *pred, void *dh_, const void *h_, const void *w_,
                       const int32_t *labels, const float *gscale, int64_t N, int64_t H, int64_t V) {
    if (N <= 0) return;
    DFL_ASSERT(V > 0 && H > 0);
    float *dh = dh_;
    const float *h = h_, *w = w_;
    lm_chunk ck = chunk_alloc(N, H, V, 0, dh != NULL);
    for (int64_t r0 = 0; r0 < N; r0 += ck.R) {
        int64_t R = N - r0 < ck.R ? N - r0 : ck.R;
        logits(ck.z, h + r0 * H, w, R, H, V);
#pragma omp parallel for if (R * V > DFL_CPU_PAR_MIN)
        for (int64_t i = 0; i < R; i++) {
            float *z = ck.z + i * V;
            int64_t r = r0 + i;
            int32_t y = labels ? labels[r] : -1;
            DFL_ASSERT(y < V);
            float gs = gscale ? gscale[r] : 1.0f;
            ck.want[i] = dh && y >= 0 && gs != 0;
            ce_row(z, V, y, gs, ck.want[i], loss ? loss + r : NULL, pred ? pred + r : NULL);
        }
        if (dh) {
            int64_t n = pack_rows(ck.z, ck.want, ck.rows, R, V);
            add_grad_rows(dh, ck.dhc, ck.z, ck.rows, n, r0, w, H, V);
        }
    }
    chunk_free(&ck);
}

/* One row of dfl_cpu_lmhead_kl past its argmaxes: the loss, and zd[V]
 * overwritten with gs * (p_d - p_t) when `grad`. A clone per target. */
SIMD_CLONES static void kl_row(float *zd, const float *zt, int64_t V, float max_d, float max_t, float gs, int grad,
                               float *loss) {
    float lse_d = logsumexp(zd, V, max_d), lse_t = logsumexp(zt, V, max_t);
    /* sum p_t (log p_t - log p_d); p_t = 0 terms are 0 (finite logs) */
    double kl = 0;
#pragma omp simd reduction(+ : kl)
    for (int64_t c = 0; c < V; c++) {
        float lpt = zt[c] - lse_t, lpd = zd[c] - lse_d;
        kl += (double)dfl_cpu_expf(lpt) * ((double)lpt - (double)lpd);
    }
    if (loss) *loss = (float)kl;
    if (!grad) return;
#pragma omp simd
    for (int64_t c = 0; c < V; c++) zd[c] = gs * (dfl_cpu_expf(zd[c] - lse_d) - dfl_cpu_expf(zt[c] - lse_t));
}

void dfl_cpu_lmhead_kl(float *loss, int32_t *pred, int32_t *tpred, void *dh_, const void *h_, const void *th_,
                       const void *w_, const float *gscale, int64_t N, int64_t H, int64_t V) {
    if (N <= 0) return;
    DFL_ASSERT(V > 0 && H > 0);
    float *dh = dh_;
    const float *h = h_, *th = th_, *w = w_;
    lm_chunk ck = chunk_alloc(N, H, V, 1, dh != NULL);
    for (int64_t r0 = 0; r0 < N; r0 += ck.R) {
        int64_t R = N - r0 < ck.R ? N - r0 : ck.R;
        logits(ck.z, h + r0 * H, w, R, H, V);
        logits(ck.zt, th + r0 * H, w, R, H, V);
#pragma omp parallel for if (R * V > DFL_CPU_PAR_MIN)
        for (int64_t i = 0; i < R; i++) {
            float *zd = ck.z + i * V;
            const float *zt = ck.zt + i * V;
            int64_t r = r0 + i;
            row_top td = top2(zd, V), tt = top2(zt, V);
            if (pred) pred[r] = td.arg;
            if (tpred) tpred[r] = tt.arg;
            float gs = gscale ? gscale[r] : 1.0f;
            ck.want[i] = dh && gs != 0;
            if (gs == 0) {
                if (loss) loss[r] = 0;
                continue;
            }
            kl_row(zd, zt, V, td.max, tt.max, gs, ck.want[i], loss ? loss + r : NULL);
        }
        if (dh) {
            int64_t n = pack_rows(ck.z, ck.want, ck.rows, R, V);
            add_grad_rows(dh, ck.dhc, ck.z, ck.rows, n, r0, w, H, V);
        }
    }
    chunk_free(&ck);
}

/* The largest u with F(u) >= target, F(u) = sum of w[v] (1 when w is NULL)
 * over v with key[v] >= u (and >= floor): a radix descent over the key's
 * four bytes, from the top bin of each down, carrying the sum above. */
static uint32_t cut_select(const uint32_t *key, const uint64_t *w, int64_t V, uint32_t floor, uint64_t target) {
    uint32_t prefix = 0;
    uint64_t above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        uint64_t hist[256] = {0};
        const uint32_t hi = shift == 24 ? 0 : ~0u << (shift + 8); /* the bytes fixed so far */
        for (int64_t v = 0; v < V; v++)
            if (key[v] >= floor && (key[v] & hi) == prefix) hist[(key[v] >> shift) & 255] += w ? w[v] : 1;
        int b = 255;
        for (; b > 0 && above + hist[b] < target; b--) above += hist[b];
        prefix |= (uint32_t)b << shift;
    }
    return prefix;
}

/* The cut of sample.h for one row of scaled logits s[V]: tokens with
 * key >= the result are kept. key[V], mass[V]: scratch. */
static uint32_t sample_cut(const float *s, int64_t V, const dfl_sampling *sp, uint32_t *key, uint64_t *mass) {
    float mx = s[0];
    for (int64_t v = 0; v < V; v++) key[v] = dfl_float_key(s[v]), mx = fmaxf(mx, s[v]);
    uint32_t cut = 0;
    if (sp->top_k > 0 && sp->top_k < V) cut = cut_select(key, NULL, V, 0, (uint64_t)sp->top_k);
    if (sp->top_p > 0 && sp->top_p < 1) {
        uint64_t Q = 0;
        for (int64_t v = 0; v < V; v++) {
            mass[v] = dfl_top_p_mass(s[v], mx);
            if (key[v] >= cut) Q += mass[v];
        }
        cut = cut_select(key, mass, V, cut, dfl_top_p_target(sp->top_p, Q));
    }
    return cut;
}

/* argmax, or with keys the Gumbel-max draw of sp (top-k, top-p) */
static void top_rows(int32_t *pred, float *gap, const float *h, const float *w, const uint64_t *keys,
                     const dfl_sampling *sp, int64_t N, int64_t H, int64_t V) {
    if (N <= 0) return;
    DFL_ASSERT(V > 0 && H > 0);
    lm_chunk ck = chunk_alloc(N, H, V, 0, 0);
    const float inv_t = keys ? 1.0f / sp->temperature : 1.0f;
    const int filter = keys && dfl_sampling_filters(sp);
    for (int64_t r0 = 0; r0 < N; r0 += ck.R) {
        int64_t R = N - r0 < ck.R ? N - r0 : ck.R;
        logits(ck.z, h + r0 * H, w, R, H, V);
#pragma omp parallel for if (R * V > DFL_CPU_PAR_MIN)
        for (int64_t i = 0; i < R; i++) {
            float *z = ck.z + i * V;
            if (keys) {
                for (int64_t c = 0; c < V; c++) z[c] *= inv_t;
                uint32_t cut = 0, *key = NULL;
                uint64_t *mass = NULL;
                if (filter) {
                    key = dfl_malloc((size_t)V * sizeof *key), mass = dfl_malloc((size_t)V * sizeof *mass);
                    cut = sample_cut(z, V, sp, key, mass);
                }
                for (int64_t c = 0; c < V; c++)
                    z[c] = !filter || key[c] >= cut ? z[c] + dfl_gumbel(keys[r0 + i], c) : -INFINITY;
                free(key), free(mass);
            }
            row_top t = top2(z, V);
            if (pred) pred[r0 + i] = t.arg;
            if (gap) gap[r0 + i] = t.max - t.second;
        }
    }
    chunk_free(&ck);
}

void dfl_cpu_lmhead_argmax(int32_t *pred, float *gap, const void *h, const void *w, int64_t N, int64_t H,
                           int64_t V) {
    top_rows(pred, gap, h, w, NULL, NULL, N, H, V);
}

void dfl_cpu_lmhead_sample(int32_t *pred, float *gap, const void *h, const void *w, const uint64_t *keys,
                           const dfl_sampling *s, int64_t N, int64_t H, int64_t V) {
    DFL_ASSERT(keys && s && s->temperature > 0 && isfinite(1.0f / s->temperature));
    top_rows(pred, gap, h, w, keys, s, N, H, V);
}
