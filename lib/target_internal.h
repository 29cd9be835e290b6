/* target_internal.h: the target's private layout, shared by target.c (the
 * packed-batch forward) and target_kv.c (incremental decoding with a KV
 * cache). Not a public interface: only lib/target*.c include it. */
#ifndef DFLASH_TARGET_INTERNAL_H
#define DFLASH_TARGET_INTERNAL_H

#include "target.h"


/* Rows per MLP chunk: large enough for full-speed GEMMs, small enough that
 * the [rows, intermediate] buffers stay modest for any sequence length. */
#define MLP_ROWS 4096

typedef struct {
    void *in_norm, *q, *k, *v, *o, *q_norm, *k_norm, *post_norm, *gate, *up, *down;
} layer_w;

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
    void *gate, *up;                          /* act [min(cap_T, MLP_ROWS), I] */
    void *taps;                               /* act [cap_taps] elements */
    head_ws head;                             /* [nrows] of the largest request */
    int32_t *ids, *pos;                       /* i32 [cap_T] */
    int32_t *cu;                              /* i32 [cap_seq + 1] */
    int32_t *host_pos;                        /* host [cap_T] */
    void *host_scratch;                       /* host, for tap downloads */
    size_t host_scratch_bytes;
} workspace;

struct dfl_target {
    const dfl_ops   *ops;
    dfl_model_config cfg;
    int              nlayers;     /* loaded */
    int              head;        /* model.norm and LM head loaded */
    void            *weights;     /* one backend allocation */
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
/* x[n, H] += the MLP of h[n, H] (gate, up: act [min(n, MLP_ROWS), I]). */
void dfl_target_mlp(const dfl_target *t, const layer_w *lw, void *x, const void *h, void *gate, void *up, int64_t n);
/* After layer l of a forward of n rows: x [n, H] into each tap slot that
 * asks for layer l (taps: act [ntaps, n, H]). */
void dfl_target_keep_taps(const dfl_target *t, void *taps, const void *x, const dfl_target_want *w, int l, int64_t n);
/* The end of a forward of n rows whose last layer left x: out's taps and
 * last hidden state, the head on nrows rows (if any), then a device sync. */
void dfl_target_finish(dfl_target *t, dfl_target_out *out, head_ws *hw, void *x, void *taps,
                       const dfl_target_want *w, int64_t n, int64_t nrows);

#endif
