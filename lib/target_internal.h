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

/* The workspace: grows to the largest batch seen, never shrinks. */
typedef struct {
    int64_t cap_T, cap_taps, cap_rows, cap_seq;
    void *x, *h, *q, *k, *v, *ao;             /* act, sized by cap_T */
    void *gate, *up;                          /* act [min(cap_T, MLP_ROWS), I] */
    void *taps;                               /* act [cap_taps] elements */
    void *sel, *normed;                       /* act [cap_rows, H] */
    int32_t *pred;                            /* i32 [cap_rows] */
    float *gap;                               /* f32 [cap_rows] */
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

/* target.c: model.norm and the LM head's argmax on the wanted rows of x. */
void dfl_target_head(dfl_target *t, dfl_target_out *out, const void *x, const dfl_target_want *w, int64_t nrows,
                     void *sel, void *normed, int32_t *pred, float *gap);

#endif
