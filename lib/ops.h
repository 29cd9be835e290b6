/* ops.h: the table of ops the target and the drafter are written against.
 *
 * The model code in lib/ (target.c, drafter.c, train.c, score.c) is written
 * once, as a sequence of calls through a `const dfl_ops *`. Two tables
 * implement it: the CPU reference (lib/ops_cpu*.c: fp32, plain loops,
 * OpenBLAS sgemm, OpenMP) and the CUDA backend (kernels/: bf16 storage, fp32
 * accumulation, cuBLAS). Changing backends changes only the table.
 *
 * Buffers. Every pointer argument is a backend buffer from ops->alloc,
 * except where marked "host". Three kinds:
 *   act  activations and their gradients: f32 on the CPU, bf16 on CUDA
 *        (ops->act_bytes per element)
 *   wt   compute weights: f32 on the CPU, bf16 on CUDA (ops->wt_bytes)
 *   f32, i32  always 32-bit floats / ints (master weights, parameter
 *        gradients, AdamW moments, saved statistics, token ids, positions)
 * Model code never dereferences act or wt pointers; it offsets them with
 * DFL_AT(). Shapes are row-major, last index fastest, as in PyTorch.
 *
 * Gradients. Backward ops ACCUMULATE (+=) into the gradients they write,
 * as llm.c does, except where an op says it writes them: matmul_bwd and
 * swiglu_bwd write or add as their flags say, qk_norm_rope_bwd writes din,
 * attn_dflash_bwd writes dq, dk and dv (a pass over zeros saved each time).
 * A NULL gradient pointer means "not needed" (frozen weights, inputs that
 * need no gradient).
 *
 * Naming: out first, then saved-for-backward, then inputs, then weights,
 * then sizes. M,K,N for matmul; T tokens; Hq/Hkv heads; D head dim.
 */
#ifndef DFLASH_OPS_H
#define DFLASH_OPS_H

#include "dtype.h"
#include "sample.h"

#include <stddef.h>
#include <stdint.h>

typedef struct dfl_ops dfl_ops;

/* Pointer to element `i` of an act buffer (or wt buffer, with wt_bytes). */
#define DFL_AT(ops, p, i) ((void *)((char *)(p) + (size_t)(i) * (size_t)(ops)->act_bytes))
#define DFL_WAT(ops, p, i) ((void *)((char *)(p) + (size_t)(i) * (size_t)(ops)->wt_bytes))

/* One DFlash block as seen by attn_dflash: its queries are rows
 * [j*B, j*B+B) of q; it sees key rows [ctx_off, ctx_off+ctx_len) (the
 * target context strictly before its anchor) and [blk_off, blk_off+B) (its
 * own block, bidirectionally). Nothing else. */
typedef struct {
    int32_t ctx_off, ctx_len, blk_off;
} dfl_block;

/* matmul_bwd's acc: which gradients add to what they hold */
enum { DFL_ACC_DIN = 1, DFL_ACC_DW = 2 };

struct dfl_ops {
    const char *name;  /* "cpu" or "cuda" */
    int act_bytes;     /* 4 or 2 */
    int wt_bytes;      /* 4 or 2 */

    /* ---- memory ---- */
    void *(*alloc)(size_t bytes);             /* zeroed; aborts (exit 70) on failure */
    void (*free)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);
    /* rows rows of width bytes each, from src (rows spitch bytes apart) to
     * dst (dpitch apart): a column block of a row-major matrix, on the
     * device. The two may not overlap. */
    void (*copy_2d)(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows);
    void (*upload)(void *dst, const void *host_src, size_t bytes);
    void (*download)(void *host_dst, const void *src, size_t bytes);
    void (*sync)(void);
    /* Host memory for the large transfers (a micro-batch's features up, the
     * tapped states down): page-locked on CUDA, where copies from pageable
     * memory go through a staging buffer at about half the link's rate;
     * plain memory on the CPU, and on CUDA when page-locked memory cannot
     * be had. Not zeroed; aborts (exit 70) only when no memory at all can
     * be had. An upload or load_act from it may still be reading it after
     * the call returns: write it again only after a call that waits for
     * the device (download, act_to_*, sync). host_free(NULL) does nothing. */
    void *(*host_alloc)(size_t bytes);
    void (*host_free)(void *p);

    /* ---- conversions ---- */
    /* host array of `dtype` (bf16/f16/f32) -> act or wt buffer */
    void (*load_act)(void *dst, const void *host_src, dfl_dtype dtype, int64_t n);
    void (*load_wt)(void *dst, const void *host_src, dfl_dtype dtype, int64_t n);
    /* act -> host f32 / host bf16 (round to nearest even) */
    void (*act_to_f32)(float *host_dst, const void *src, int64_t n);
    void (*act_to_bf16)(uint16_t *host_dst, const void *src, int64_t n);
    /* f32 master weights -> compute weights (a copy on the CPU, a cast on CUDA) */
    void (*master_to_wt)(void *dst, const float *master, int64_t n);

    /* ---- dense ---- */
    /* out[M,N] = in[M,K] · w[N,K]^T, plus out when accumulate is set. */
    void (*matmul)(void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N, int accumulate);
    /* din[M,K] = dout[M,N] · w, plus din when acc has DFL_ACC_DIN;
     * dw[N,K] = dout^T · in (f32), plus dw when acc has DFL_ACC_DW. Either
     * may be NULL. Overwriting spares the caller a zeroing pass and the
     * product a read. */
    void (*matmul_bwd)(void *din, float *dw, const void *dout, const void *in, const void *w,
                       int64_t M, int64_t K, int64_t N, int acc);
    /* out = in * rstd * w per row of `dim`, rstd = 1/sqrt(mean(in^2) + eps)
     * computed in f32 and saved in rstd[rows] (f32, may be NULL). */
    void (*rmsnorm)(void *out, float *rstd, const void *in, const void *w, int64_t rows, int64_t dim, float eps);
    void (*rmsnorm_bwd)(void *din, float *dw, const void *dout, const void *in, const float *rstd,
                        const void *w, int64_t rows, int64_t dim);
    /* The same with a (1 + w) scale (Qwen3.5's norms store w): out = in *
     * rstd * (1 + w), the sum formed in f32 from the stored w, as
     * transformers does; forward only. A weight pre-added on the host would
     * round 1 + w to bf16 on CUDA (up to 2^-8 relative, per channel). */
    void (*rmsnorm1p)(void *out, const void *in, const void *w, int64_t rows, int64_t dim, float eps);
    /* Rotate x[T, nh, d] in place, NeoX pairing (i, i + d/2): with
     * th = pos[t] * inv_freq[i], c = cos th * scale and s = sin th * scale
     * (each rounded to f32, as transformers scales its cos and sin tables),
     * x_i' = x_i c - x_{i+d/2} s and x_{i+d/2}' = x_{i+d/2} c + x_i s.
     * inverse = 1 uses -s: the transpose, which is the backward pass (and
     * the inverse when scale is 1). pos: i32 [T]; inv_freq: f32 [d/2];
     * scale: YaRN's attention factor, else 1 (dfl_rope_scale). A pair whose
     * inv_freq is 0 is not rotated and not scaled (a partial RoPE's pass-
     * through dims, which transformers leaves as they are). */
    void (*rope)(void *x, const int32_t *pos, const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d,
                 int inverse);
    /* A per-head q/k norm and its RoPE in one pass (the forward of targets
     * and drafters): for each row (t, h) of in[T, nh, d], y = in * rstd * w
     * (plus_one: * (1 + w), as rmsnorm1p), then out = y rotated as rope
     * rotates it by pos[t]; the same as rmsnorm (or rmsnorm1p) into out,
     * then rope on out. rstd[T * nh] (f32) is saved as rmsnorm saves it
     * when not NULL (training: qk_norm_rope_bwd reads it). out may alias in. */
    void (*qk_norm_rope)(void *out, float *rstd, const void *in, const void *w, int plus_one, const int32_t *pos,
                         const float *inv_freq, float scale, int64_t T, int64_t nh, int64_t d, float eps);
    /* Its backward (plain norms, plus_one 0): dout rotated back (rope's
     * inverse), then rmsnorm_bwd from the saved rstd, except that din is
     * written, not added to (no zeroing pass before it); dw[d] (f32) is
     * added to. din may be NULL. */
    void (*qk_norm_rope_bwd)(void *din, float *dw, const void *dout, const void *in, const float *rstd,
                             const void *w, const int32_t *pos, const float *inv_freq, float scale, int64_t T,
                             int64_t nh, int64_t d);
    /* out = silu(gate) * up, elementwise (out may alias gate or up). */
    void (*swiglu)(void *out, const void *gate, const void *up, int64_t n);
    /* dgate = dout * up * silu'(gate), dup = dout * silu(gate), each plus
     * its old value when accumulate is set (either may be NULL). */
    void (*swiglu_bwd)(void *dgate, void *dup, const void *dout, const void *gate, const void *up, int64_t n,
                       int accumulate);
    /* gpt-oss's expert activation (forward only): with g = min(gate, limit)
     * and u = clamp(up, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g),
     * elementwise in f32 (out may alias gate or up). */
    void (*swiglu_oss)(void *out, const void *gate, const void *up, int64_t n, float alpha, float limit);
    /* out = a + b (out may alias a or b). */
    void (*add)(void *out, const void *a, const void *b, int64_t n);
    /* x[r, c] += bias[c] for each of rows rows of cols (bias: wt [cols]):
     * a projection's bias (Qwen2's q, k and v), the sum in f32, one rounding. */
    void (*add_bias)(void *x, const void *bias, int64_t rows, int64_t cols);
    /* out[T,H] = table[ids[t]] (table: wt [V,H]). */
    void (*embed)(void *out, const int32_t *ids, const void *table, int64_t T, int64_t H);

    /* ---- Qwen3.5 hybrid targets (forward only) ---- */
    /* out = x * sigmoid(g), elementwise: the gated attention's output gate
     * (out may alias x). */
    void (*sigmoid_mul)(void *out, const void *x, const void *g, int64_t n);
    /* Causal depthwise convolution over time, then SiLU, per sequence of a
     * packed batch (sequence s: rows [cu[s], cu[s+1]) of in[T,C]):
     *   out[t,c] = silu(sum_{j<K} w[c,j] * x[t-(K-1)+j, c])
     * where x[r] = in[r] inside the sequence; before its first row x is 0,
     * or, when hist (act [K-1, C]; only with nseq == 1) is given,
     * x[cu[0]-i] = hist[K-1-i] (the raw inputs of the positions before).
     * w: wt [C, K]; cu: i32 [nseq+1]. out aliases neither in nor hist. */
    void (*conv1d_silu)(void *out, const void *in, const void *hist, const void *w, const int32_t *cu,
                        int64_t nseq, int64_t T, int64_t C, int64_t K);
    /* Gated DeltaNet recurrence over packed sequences. qkv: act [T, 2*Hk*dk
     * + Hv*dv], per row q | k | v (heads contiguous); ba: act [T, 2*Hv],
     * per row b | a. Value head j reads key head j / (Hv/Hk). Per row t:
     *   q = l2norm(q_t) / sqrt(dk), k = l2norm(k_t)  (x / sqrt(sum x^2 + 1e-6))
     *   beta = sigmoid(b_t[j]), g = -exp(A_log[j]) * softplus(a_t[j] + dt_bias[j])
     *   S = exp(g) S;  S += k (beta (v_t - S^T k))^T;  out[t, j] = S^T q
     * with S [dk, dv] in f32, 0 at the start of every sequence; softplus as
     * torch's (x above 20 passes through). A_log, dt_bias: f32 [Hv].
     * state: f32 [Hv, dk, dv] or NULL. With it (nseq must be 1) S starts
     * from *state and the final S is written back. steps: f32 [T, Hv, dk,
     * dv] or NULL (nseq 1): S after every row, the rollback points of a
     * speculative block. out: act [T, Hv*dv]. */
    void (*gated_delta)(void *out, float *state, float *steps, const void *qkv, const void *ba,
                        const float *A_log, const float *dt_bias, const int32_t *cu, int64_t nseq, int64_t T,
                        int64_t Hk, int64_t Hv, int64_t dk, int64_t dv);

    /* ---- mixture of experts (Qwen3-MoE, Qwen3.5-MoE targets; forward only) ---- */
    /* Route T tokens over E experts, k of them each (1 <= k <= E). With
     * p = softmax(logits[t]) in f32 (logits: act [T, E]), token t's experts
     * are its k largest p in descending order (the lower expert id first
     * among equal p); their weights are those p, divided by the sum of the
     * k when norm is set. The T*k (token, slot) pairs are then listed by
     * expert, in (token, slot) order inside an expert:
     *   offsets  host i64 [E+1]: expert e's pairs are listed at
     *            [offsets[e], offsets[e+1]); offsets[E] = T*k
     *   rows     i32 [T*k]: the token of listed pair i
     *   pos      i32 [T*k]: where pair (t, j) is listed, at index t*k + j
     *   wts      f32 [T*k]: pair (t, j)'s weight, at index t*k + j
     * The listing depends on nothing but the inputs (no atomics' order).
     * On CUDA the offsets are read back: one host synchronisation. */
    void (*moe_route)(int64_t *offsets, int32_t *rows, int32_t *pos, float *wts, const void *logits, int64_t T,
                      int64_t E, int64_t k, int norm);
    /* The experts' products, one call for all of them: for each group
     * e < G, rows r in [offsets[e], offsets[e+1]) (host i64, offsets[0] =
     * 0): out[r] (+)= in[r] · w_e^T, w_e = the [N, K] matrix at element
     * e * w_stride of w. in: act [offsets[G], K]; out: act [offsets[G], N].
     * Groups without rows are skipped. Each group is the matmul op on its
     * rows (same roundings), except that on the CPU a group of one row
     * takes the kernel of a few rows rather than sgemv. w's elements are
     * wdt: the backend's wt (DFL_BF16 on CUDA, DFL_F32 on the CPU), or, on
     * the CPU, DFL_BF16 too: a MoE target's experts, most of its weights,
     * then take half the memory, and are widened to f32 (exactly) as they
     * are read, so the bits are those of f32 weights of the same values. */
    void (*matmul_grouped)(void *out, const void *in, const void *w, dfl_dtype wdt, const int64_t *offsets,
                           int64_t G, int64_t w_stride, int64_t K, int64_t N, int accumulate);
    /* out[i] = in[rows[i]] for i < n: rows of H elements (act). */
    void (*gather_rows)(void *out, const void *in, const int32_t *rows, int64_t n, int64_t H);
    /* x[t] += sum_j wts[t*k+j] * y[pos[t*k+j]]  (j = 0 .. k-1), plus, when
     * shared is not NULL, sigmoid(sgate[t]) * shared[t] (the shared
     * expert, Qwen3.5-MoE); summed in f32 in that order and rounded into x
     * once. x, shared: act [T, H]; y: act [T*k, H] (the experts' outputs
     * in listed order); sgate: act [T]. */
    void (*moe_combine)(void *x, const void *y, const int32_t *pos, const float *wts, const void *shared,
                        const void *sgate, int64_t T, int64_t k, int64_t H);

    /* ---- attention (scale 1/sqrt(D); q head h uses kv head h / (Hq/Hkv)) ---- */
    /* Causal self-attention over packed sequences: sequence s holds rows
     * [cu[s], cu[s+1]) of q[T,Hq,D], k,v[T,Hkv,D]; no row sees another
     * sequence. cu: i32 [nseq+1]. Forward only (the target). window W > 0:
     * a sliding-window layer, row t sees only the keys t - W + 1 .. t of
     * its sequence (itself and the W - 1 before it); 0: every key up to
     * itself. lse [T, Hq] (f32, natural log of the scaled scores' sum of
     * exponentials, as attn_dflash's) is written unless NULL: attn_sinks
     * needs it. */
    void (*attn_causal)(void *out, float *lse, const void *q, const void *k, const void *v, const int32_t *cu,
                        int64_t nseq, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
    /* DFlash block attention: q[nblk*B, Hq, D], k,v[NK, Hkv, D], out like q.
     * Block j sees exactly the keys of blocks[j] (dfl_block, i32 triples).
     * window W > 0 makes it a drafter's sliding-window layer (spec 2.5, as
     * SpecForge, vLLM and SGLang serve it): the query in slot o of a block
     * sees only the context keys at index >= ctx_off + ctx_len + o + 1 - W
     * (W keys, itself included, counting the block's slots as the positions
     * after the context) and only the block's keys blk_off .. blk_off + o
     * (causal). window 0: the whole context and the whole block.
     * lse[nblk*B, Hq] (f32) is saved for the backward pass; NULL when none
     * follows (scoring, verifying). The backward must be given the blocks
     * (the same contents) of the forward that wrote its lse. */
    void (*attn_dflash)(void *out, float *lse, const void *q, const void *k, const void *v,
                        const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t window);
    /* Its backward from the saved lse: dq (like q), dk, dv (like k, v) are
     * WRITTEN, not added to: every row, zeros for keys no block sees. Any
     * of the three may be NULL. window: the forward's. */
    void (*attn_dflash_bwd)(void *dq, void *dk, void *dv, const void *dout, const void *out,
                            const float *lse, const void *q, const void *k, const void *v,
                            const dfl_block *blocks, int64_t nblk, int64_t B, int64_t NK,
                            int64_t Hq, int64_t Hkv, int64_t D, int64_t window);

    /* Attention sinks (gpt-oss; forward only): each head h's softmax over
     * its keys gets one more logit, sinks[h], whose probability is dropped.
     * Given the natural log-sum-exp of the scaled scores (lse [T, Hq], f32,
     * as attn_dflash saves it) and the attention's output without the sink,
     * out[t, h, :] *= 1 / (1 + exp(sinks[h] - lse[t, h])), formed in f32.
     * out: act [T, Hq, D]; sinks: f32 [Hq]. */
    void (*attn_sinks)(void *out, const float *lse, const float *sinks, int64_t T, int64_t Hq, int64_t D);

    /* ---- LM head and losses (w: wt [V,H], frozen; logits never whole) ---- */
    /* With z_i = h_i · w^T: pred[i] = argmax z_i (lowest index on ties);
     * for rows with labels[i] >= 0, loss[i] = logsumexp(z_i) - z_i[labels[i]]
     * (else 0); if dh, dh_i += gscale[i] * (softmax(z_i) - onehot) · w for
     * rows with gscale[i] != 0 and labels[i] >= 0 (the others: no gradient).
     * loss, gscale: f32 [N]; pred, labels: i32 [N]. gscale NULL means 1. */
    void (*lmhead_ce)(float *loss, int32_t *pred, void *dh, const void *h, const void *w,
                      const int32_t *labels, const float *gscale, int64_t N, int64_t H, int64_t V);
    /* KL(p_t || p_d) with p_t = softmax(th_i · w^T) (th: the target's
     * final-normed hidden state, act [N,H]) and p_d = softmax(h_i · w^T):
     * loss[i] = sum p_t (log p_t - log p_d); dh_i += gscale[i] (p_d - p_t) · w;
     * pred[i] = argmax of the drafter, tpred[i] (may be NULL) of the target.
     * Rows with gscale[i] == 0 get loss 0 and no gradient; gscale NULL means 1. */
    void (*lmhead_kl)(float *loss, int32_t *pred, int32_t *tpred, void *dh, const void *h, const void *th,
                      const void *w, const float *gscale, int64_t N, int64_t H, int64_t V);
    /* pred[i] = argmax_v h_i · w_v (lowest index on ties); gap[i] (f32, may be
     * NULL) = top-1 minus top-2 logit, to tell near-ties apart in tests. */
    void (*lmhead_argmax)(int32_t *pred, float *gap, const void *h, const void *w, int64_t N, int64_t H, int64_t V);
    /* Sampling (sample.h) at s->temperature T > 0: pred[i] = argmax_v
     * (z_iv * (1/T) + dfl_gumbel(keys[i], v)) (lowest index on ties) over
     * the tokens s->top_k and s->top_p keep (all when off), a draw from
     * softmax(z_i / T) restricted to them, fixed by the row's key; gap[i]
     * (may be NULL) = top-1 minus top-2 of those perturbed scores (-inf
     * beyond the kept). keys: host u64 [N]; s: host. */
    void (*lmhead_sample)(int32_t *pred, float *gap, const void *h, const void *w, const uint64_t *keys,
                          const dfl_sampling *s, int64_t N, int64_t H, int64_t V);

    /* ---- optimizer (all f32) ---- */
    double (*sumsq)(const float *x, int64_t n);
    /* PyTorch AdamW, step t >= 1, on g = gscale * grad:
     * p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
     * p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
     * wt (a wt buffer of n, or NULL; it may be p itself on the CPU, where
     * compute weights are the master ones): set to the new p as
     * master_to_wt would, in the same pass (on CUDA that saves reading p
     * again, a third of the optimizer's time). */
    void (*adamw)(float *p, void *wt, const float *grad, float *m, float *v, int64_t n, float lr, float b1,
                  float b2, float eps, float wd, float gscale, int64_t t);
};

/* The CPU reference table. */
const dfl_ops *dfl_ops_cpu(void);
/* Look up a backend by name ("cpu" or "cuda"). Returns 0, or DFL_EX_UNAVAIL
 * with the reason recorded ("built without CUDA", "no CUDA device: ...").
 * `device` may be "cuda" or "cuda:N". */
int dfl_ops_get(const char *device, const dfl_ops **out);

/* Threads of the CPU work (OpenMP regions and OpenBLAS) for a tool's
 * --threads N; N <= 0 keeps the defaults (all cores). */
void dfl_ops_cpu_threads(int64_t n);

/* The most --threads a tool takes, each tool refusing more with exit 2:
 * libgomp overflows its stack long before 100000 threads, and the counts
 * OpenMP and the record codec take are ints (2^32 + 1 became 1). */
#define DFL_MAX_THREADS 4096

#endif
