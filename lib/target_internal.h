/* target_internal.h: the target's private layout, shared by target.c (the
 * packed-batch forward) and target_kv.c (incremental decoding with a KV
 * cache). Not a public interface: only lib/target*.c include it. */
#ifndef DFLASH_TARGET_INTERNAL_H
#define DFLASH_TARGET_INTERNAL_H

#include "target.h"


/* Rows per MLP chunk: large enough for full-speed GEMMs, small enough that
 * the [rows, intermediate] buffers stay modest for any sequence length. */
#define MLP_ROWS 4096
/* (token, expert) pairs per chunk of a sparse MLP: each expert's product
 * gets rows / E * k of them, so the chunks are longer than dense ones
 * (8192 tokens at 8 experts a token: 512 rows an expert of 128). */
#define MOE_PAIRS 65536

typedef struct {
    int linear; /* a Gated DeltaNet layer (Qwen3.5 "linear_attention"); else attention */
    /* "mat": in t->mats, of t->mat_dt (dfl_target_matmul); the rest wt */
    void *q, *k, *v, *o, *gate, *up, *down;  /* mat */
    void *in_norm, *q_norm, *k_norm, *post_norm;
    void *attn_gate;                  /* gated attention: q_proj's gate rows, mat [Hq*D, H] */
    void *q_bias, *k_bias, *v_bias;   /* Qwen2: wt [Hq*D], [Hkv*D], [Hkv*D]; else NULL */
    /* Gated DeltaNet: mat in_proj_qkv [C, H], in_proj_z [Hv*dv, H] and
     * out_proj [H, Hv*dv]; wt in_proj_b and in_proj_a as one [2*Hv, H],
     * conv1d [C, K], norm [dv]; f32 A_log, dt_bias [Hv]. C = 2*Hk*dk + Hv*dv. */
    void *lin_qkv, *lin_z, *lin_ba, *lin_conv, *lin_norm, *lin_out;
    float *A_log, *dt_bias;
    /* A sparse MLP (mixture of experts; then gate, up, down are unused):
     * router wt [E, H]; experts' gate and up rows mat [E, 2*Im, H] (expert
     * e: its Im gate rows, then its Im up rows); their down mat [E, H, Im].
     * Qwen3.5-MoE's shared expert: sh_gate, sh_up mat [Is, H], sh_down mat
     * [H, Is], and sh_mix wt [1, H], whose sigmoid scales it per token. */
    int moe;
    void *router, *exp_gate_up, *exp_down, *sh_gate, *sh_up, *sh_down, *sh_mix;
    /* gpt-oss: o_proj's bias wt [H]; the sinks f32 [Hq]; the router's
     * bias wt [E]; the experts' biases wt [E, 2*Im] (gate, then up, as
     * exp_gate_up) and [E, H]. window: the keys a query sees, itself
     * included (0: all before it; any target with sliding layers) */
    void *o_bias;
    float *sinks;
    int64_t window;
    void *router_bias, *exp_gate_up_bias, *exp_down_bias;
} layer_w;

/* The MLP's buffers for one chunk (in both workspaces). cap_rows below:
 * min(cap_n, the sparse chunk, dfl_target_moe_rows) in a MoE model, else
 * min(cap_n, MLP_ROWS); a dense layer's chunk is min(cap_n, MLP_ROWS) rows
 * in either, which may be longer (more than 16 experts a token). */
typedef struct {
    int64_t cap_n;            /* grown for forwards of up to this many rows (clamped to the longest chunk) */
    void *gate, *up;          /* act [the larger of cap_rows * (widest of Im, Is) and dense rows * I] */
    /* sparse layers (ops moe_route, gather_rows, moe_combine) */
    void *logits;             /* act [cap_rows, E] */
    int32_t *rows, *pos;      /* i32 [cap_rows * k] */
    float *wts;               /* f32 [cap_rows * k] */
    void *xs, *ys;            /* act [cap_rows * k, H]: the experts' inputs and outputs, listed by expert */
    void *shared, *mix;       /* act [cap_rows, H], [cap_rows]: the shared expert and its gate logit */
    int64_t *offsets;         /* host [E + 1] */
} mlp_ws;

/* The buffers of a Gated DeltaNet layer (and the attention gate) for n rows. */
typedef struct {
    int64_t cap_rows;
    void *raw, *conv;                         /* act [n, C]: the projection, after the conv */
    void *z, *o, *y;                          /* act [n, Hv*dv]: gate, recurrence output, normed */
    void *ba;                                 /* act [n, 2*Hv] */
    void *agate;                              /* act [n, Hq*D] */
} lin_ws;

/* The head's buffers (model.norm and LM head on chosen rows), in both workspaces. */
typedef struct {
    int64_t cap_rows;
    void *sel, *normed;                       /* act [cap_rows, H] */
    int32_t *pred;                            /* i32 [cap_rows] */
    float *gap;                               /* f32 [cap_rows] */
} head_ws;

/* The workspace: grows to the largest batch seen, never shrinks. */
typedef struct {
    int64_t cap_T, cap_taps, cap_seq;
    void *x, *h, *q, *k, *v, *ao;             /* act, sized by cap_T */
    mlp_ws mlp;                               /* for forwards of cap_T rows */
    void *taps;                               /* act [cap_taps] elements */
    head_ws head;                             /* [nrows] of the largest request */
    lin_ws lin;                               /* hybrid targets */
    int32_t *ids, *pos;                       /* i32 [cap_T] */
    int32_t *cu;                              /* i32 [cap_seq + 1] */
    int32_t *host_pos;                        /* host [cap_T] */
    float *lse; /* gpt-oss: the attention's log-sum-exp for its sinks, f32 [cap_T * Hq] */
} workspace;

struct dfl_target {
    const dfl_ops   *ops;
    dfl_model_config cfg;
    int              nlayers;     /* loaded */
    int              head;        /* model.norm and LM head loaded */
    void            *weights;     /* one backend allocation */
    void            *mats;        /* the layers' projection matrices and experts (target.c mat_dtype) */
    dfl_dtype        mat_dt;      /* their elements: wt, or bf16 on the CPU (target.c mat_dtype) */
    void            *params_f32;  /* the f32 parameters (A_log, dt_bias), or NULL */
    uint64_t         weight_bytes;
    void            *embed, *final_norm, *lm_head; /* lm_head may alias embed */
    layer_w         *layers;
    float           *inv_freq;    /* f32 [D/2], backend */
    workspace        ws;
};

/* target.c, shared with target_kv.c: */
/* A fresh zeroed backend buffer of `bytes` in place of `old` (contents are
 * not kept: workspaces are refilled every forward). */
void *dfl_target_regrow(const dfl_ops *ops, void *old, size_t bytes);
/* Grow hw to hold nrows rows; free its buffers. */
void dfl_target_head_reserve(const dfl_target *t, head_ws *hw, int64_t nrows);
void dfl_target_head_free(const dfl_ops *ops, head_ws *hw);
/* out = the model's RMSNorm of in [rows, dim] with weight w: w, or (1 + w)
 * for Qwen3.5 (ops rmsnorm1p), eps rms_norm_eps. */
void dfl_target_norm(const dfl_target *t, void *out, const void *in, const void *w, int64_t rows, int64_t dim);
/* out[M, N] (+)= in[M, K] w^T for w one of the layers' matrices (in
 * t->mats, of t->mat_dt: bf16 on the CPU for bf16 files). */
void dfl_target_matmul(const dfl_target *t, void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N,
                       int accumulate);
/* out[T, N] = in[T, K] w^T (w: a layer's matrix, as dfl_target_matmul's),
 * plus bias[N] on every row when bias is not NULL (Qwen2's q, k and v
 * projections). */
void dfl_target_proj(const dfl_target *t, void *out, const void *in, const void *w, const void *bias, int64_t T,
                     int64_t K, int64_t N);
/* q or k of an attention layer from its projection `in` (T rows of nh
 * heads), rotated by pos: with the model's q/k norms, normed (norm_w) and
 * rotated into out in one pass (ops->qk_norm_rope); without, rotated in
 * place (out must be in). */
void dfl_target_qk_rope(const dfl_target *t, void *out, const void *in, const void *norm_w, const int32_t *pos,
                        int64_t T, int64_t nh);
/* Grow lw to n rows (no-op for a model without hybrid layers); free it. */
void dfl_target_lin_reserve(const dfl_target *t, lin_ws *lw, int64_t n);
void dfl_target_lin_free(const dfl_ops *ops, lin_ws *lw);
/* x[n, H] += the Gated DeltaNet layer of h[n, H] (sequences cu, nseq; conv
 * history, state and steps as the ops conv1d_silu and gated_delta take
 * them). Leaves the layer's raw projection in ws->raw and the recurrence's
 * inputs in ws->conv and ws->ba. */
void dfl_target_linear_attn(const dfl_target *t, const layer_w *lw, lin_ws *ws, void *x, const void *h,
                            const int32_t *cu, int64_t nseq, int64_t n, const void *hist, float *state, float *steps);
/* Tokens per chunk of a sparse MLP: MOE_PAIRS / k. */
int64_t dfl_target_moe_rows(const dfl_model_config *c);
/* Grow mw for forwards of n rows (it holds min(n, a chunk)); free it. */
void dfl_target_mlp_reserve(const dfl_target *t, mlp_ws *mw, int64_t n);
void dfl_target_mlp_free(const dfl_ops *ops, mlp_ws *mw);
/* x[n, H] += the MLP of h[n, H], dense or sparse, in chunks (MLP_ROWS or
 * dfl_target_moe_rows rows). A sparse layer reads its routing back to the
 * host once a chunk. */
void dfl_target_mlp(const dfl_target *t, const layer_w *lw, mlp_ws *mw, void *x, const void *h, int64_t n);
/* The sampling fields of a want (temperature, keys): 0 or DFL_EX_USAGE. */
int dfl_target_check_sampling(const dfl_target_want *w);
/* After layer l of a forward of n rows: x [n, H] into each tap slot that
 * asks for layer l (taps: act [n, ntaps, H], a column block each). */
void dfl_target_keep_taps(const dfl_target *t, void *taps, const void *x, const dfl_target_want *w, int l, int64_t n);
/* The end of a forward of n rows whose last layer left x: out's taps and
 * last hidden state, the head on nrows rows (if any), then a device sync. */
void dfl_target_finish(dfl_target *t, dfl_target_out *out, head_ws *hw, void *x, void *taps,
                       const dfl_target_want *w, int64_t n, int64_t nrows);

#endif
