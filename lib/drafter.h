/* drafter.h: the DFlash drafter (spec §1), forward and backward, written
 * once against the op table.
 *
 *   ctx      = hidden_norm(fc(features))                 context rows [NC, H]
 *   h        = embed(block tokens)                        block rows   [Q, H]
 *   layer l:   x = input_layernorm(h)
 *              q = rope(q_norm(q_proj(x)))                queries: block rows only
 *              k = rope(k_norm(k_proj([ctx; x])))         the layer's own k_proj/k_norm
 *              v = v_proj([ctx; x])                       on context AND block rows
 *              h = h + o_proj(attn_dflash(q, k, v))       block j sees dfl_block j only
 *              h = h + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(h)
 *   out      = norm(h)                                    lm_head(out): the target's
 *
 * The embedding and LM head are the target's, frozen (read from the target
 * directory); the drafter owns fc, hidden_norm, the layers and norm.
 *
 * Memory (llm.c): fp32 master weights, their gradients and the AdamW moments
 * are each ONE backend allocation with a pointer per tensor, so zeroing,
 * the norm, clipping and AdamW are single flat calls. The compute weights
 * (ops->wt_bytes per element) are a cast of the master (the same buffer on
 * the CPU, where both are fp32).
 */
#ifndef DFLASH_DRAFTER_H
#define DFLASH_DRAFTER_H

#include "model_config.h"
#include "ops.h"

#include <jansson.h>
#include <stdint.h>

#define DFL_DRAFTER_MAX_TAPS 64
#define DFL_DRAFTER_MAX_LAYERS 256
#define DFL_DRAFTER_MAX_BLOCK 1024

/* ---- configuration ----------------------------------------------------- */

typedef struct {
    dfl_model_config mc;        /* the Qwen3 fields; mc.json is the parsed file */
    int64_t H, I, L, Hq, Hkv, D, V;
    float   eps;                /* rms_norm_eps */
    int     block_size;         /* B */
    int     block_size_in_dflash_config; /* where the file had it (written back the same way) */
    int     num_target_layers;
    int64_t mask_token_id;
    int     K;                  /* len(target_layer_ids): fc is [H, K*H] (spec §5.13) */
    int     layer_ids[DFL_DRAFTER_MAX_TAPS];
} dfl_drafter_config;

/* Parse a drafter config.json (z-lab layout, spec §1.1): a Qwen3 config plus
 * block_size (top level or inside dflash_config), num_target_layers and
 * dflash_config {mask_token_id, target_layer_ids}. A missing
 * target_layer_ids gets the reference default (num_hidden_layers taps).
 * Returns 0 or DFL_EX_DATA / DFL_EX_NOINPUT naming the file and key. */
int dfl_drafter_config_parse(dfl_drafter_config *c, const char *text, size_t len, const char *path);
int dfl_drafter_config_load(dfl_drafter_config *c, const char *path);
void dfl_drafter_config_free(dfl_drafter_config *c);
/* The config.json of a checkpoint: the parsed file with every key of the
 * released layout set from the parsed values (new reference). A
 * max_position_embeddings that is not positive is left out, never written
 * as 0 (the reader's default then applies). */
json_t *dfl_drafter_config_json(const dfl_drafter_config *c);
/* What a drafter's config may leave to its target: max_position_embeddings,
 * when absent, null or not positive, becomes the target's. The z-lab
 * drafters carry their target's (40960 for Qwen3-8B), and serving engines
 * read it as the drafter's context length. */
void dfl_drafter_config_from_target(dfl_drafter_config *c, const dfl_model_config *tcfg);

/* ---- parameters ------------------------------------------------------------ */

typedef struct {
    char    name[64];           /* released name, no "model." prefix */
    int     ndim;
    int64_t shape[2];
    int64_t offset, numel;      /* elements into the flat parameter array */
} dfl_param_info;

/* One layer's tensors, pointers into a flat array (master, grad, wt, ...). */
typedef struct {
    void *q, *k, *v, *o, *qn, *kn, *ln1, *ln2, *gate, *up, *down;
} dfl_drafter_layer;

typedef struct {
    void *fc, *hidden_norm, *norm;
    dfl_drafter_layer *layer;   /* [L] */
} dfl_drafter_ptrs;

/* Tensor table in checkpoint order (fc, hidden_norm, layers.0.*, ..., norm).
 * Returns the count (3 + 11 L); info may be NULL to count. */
int dfl_drafter_params(const dfl_drafter_config *c, dfl_param_info *info);

/* ---- the model -------------------------------------------------------------- */

/* One micro-batch, host side. Context rows (the tapped target features of
 * every sequence at the positions some block may see) come first in the
 * key/value rows, then the blocks' B rows each. */
typedef struct {
    int64_t NC;                 /* context rows */
    int64_t nblk;               /* blocks; Q = nblk * B query rows */
    const void *feats;          /* [NC, K*H] host, feats_dtype */
    dfl_dtype feats_dtype;
    const int32_t *pos;         /* [NC + Q] absolute positions: context rows, then block rows */
    const int32_t *tokens;      /* [Q] block tokens: anchor token, then mask ids */
    const dfl_block *blocks;    /* [nblk] ctx_off/ctx_len into rows [0,NC), blk_off = NC + j*B */
    const int32_t *labels;      /* [Q] label or -1 (no loss); CE */
    const float *gscale;        /* [Q] loss weight of each row (w_k * m); 0: no loss */
    const void *target_h;       /* [Q, H] host, target_h_dtype: KL only, the target's pre-norm
                                   last hidden state whose distribution row q is trained on */
    dfl_dtype target_h_dtype;
} dfl_drafter_batch;

typedef struct dfl_drafter dfl_drafter;

struct dfl_drafter {
    const dfl_ops *ops;
    dfl_drafter_config cfg;
    int ntensors;
    dfl_param_info *info;
    int64_t nparams;
    float *master, *grad, *m, *v;   /* f32 backend buffers, nparams each */
    void  *wt;                      /* compute weights (== master when wt_bytes == 4) */
    dfl_drafter_ptrs W, G;          /* views of wt and grad */
    /* the target's frozen parts */
    void  *embed, *lm_head, *target_norm;   /* wt [V,H], wt [V,H], wt [H] (NULL if absent) */
    float  target_eps;
    int    target_norm_plus_one; /* Qwen3.5's final norm scales by (1 + w) */
    float *inv_freq;                /* f32 [D/2] */
    float  rope_scale;              /* on RoPE's cos and sin: dfl_rope_scale */
    struct dfl_drafter_ws *ws;      /* activations, grown as needed */
    int grad_fresh;                 /* dfl_drafter_start_grad was called and no backward has run
                                       since: the next one writes each weight matrix's gradient
                                       instead of adding to it */
};

/* Create the drafter for `cfg` (copied; the caller keeps ownership of its
 * json) on `ops`, all parameters zero. */
dfl_drafter *dfl_drafter_new(const dfl_ops *ops, const dfl_drafter_config *cfg);
/* The same for inference (scoring): no gradients and no AdamW moments (grad,
 * m, v and G are NULL); only forward passes may be run on it. */
dfl_drafter *dfl_drafter_new_frozen(const dfl_ops *ops, const dfl_drafter_config *cfg);
void dfl_drafter_free(dfl_drafter *d);

/* Fill the master weights as Qwen3 initialises them: linear weights normal
 * with std `init_std` (config initializer_range, default 0.02), norm weights
 * one; then master_to_wt. Draws from `next_normal` (host). */
void dfl_drafter_init_weights(dfl_drafter *d, double init_std, double (*next_normal)(void *), void *rng);
/* Host f32 master <-> backend (both nparams floats). */
void dfl_drafter_set_master(dfl_drafter *d, const float *host);
void dfl_drafter_get_master(const dfl_drafter *d, float *host);
/* Refresh the compute weights from the master (after an optimizer step). */
void dfl_drafter_sync_weights(dfl_drafter *d);

/* Load the target's frozen embed_tokens, lm_head (embed_tokens when tied)
 * and final norm from a model directory (dfl_st_open_dir) whose config is
 * `tcfg`. Checks the shapes against the drafter (hidden size, vocabulary,
 * mask id inside the table). Returns 0 or an exit code. */
int dfl_drafter_load_target(dfl_drafter *d, const char *dir, const dfl_model_config *tcfg);
/* Does config c fit the target of directory dir (hidden_size, vocab_size,
 * num_target_layers)? 0 or DFL_EX_DATA. dfl_drafter_load_target checks it
 * too; call it first to refuse a drafter for another target before
 * allocating it. */
int dfl_drafter_check_target(const dfl_drafter_config *c, const dfl_model_config *tcfg, const char *dir);
/* Same from host f32 arrays (tests). target_norm may be NULL. A second call
 * replaces the target weights of the first. */
void dfl_drafter_set_target(dfl_drafter *d, const float *embed, const float *lm_head, const float *target_norm,
                            float target_eps);

/* Forward pass of a micro-batch: stores every activation the backward pass
 * needs and leaves the final-normed output in dfl_drafter_output(). */
void dfl_drafter_forward(dfl_drafter *d, const dfl_drafter_batch *b);
/* The final-normed output rows [Q, H] (act) of the last forward. */
const void *dfl_drafter_output(const dfl_drafter *d);

/* Loss heads on the last forward. Per row: loss (host f32 [Q], the
 * unweighted CE or KL of the row, 0 where gscale is 0 / labels < 0), pred
 * (host i32 [Q], the drafter's argmax), tpred (KL only, may be NULL: the
 * target's argmax). With `backward` set, d(Σ gscale * loss)/d(out) is kept
 * for dfl_drafter_backward. kl selects lmhead_kl (needs target_h). */
void dfl_drafter_loss(dfl_drafter *d, const dfl_drafter_batch *b, int kl, int backward,
                      float *loss, int32_t *pred, int32_t *tpred);
/* Backward pass of the last forward/loss: ACCUMULATES d(Σ gscale*loss)/dθ
 * into d->grad (zero it with dfl_drafter_zero_grad at the step start, or
 * begin with dfl_drafter_start_grad). */
void dfl_drafter_backward(dfl_drafter *d, const dfl_drafter_batch *b);
void dfl_drafter_zero_grad(dfl_drafter *d);
/* The gradient's start without zeroing all of it: the vectors (norm
 * weights) are zeroed here, the weight matrices are overwritten by the next
 * backward pass's first products into them (~4 GB of memset fewer a step
 * at the Qwen3-8B drafter's size). The gradient reads as the sum of the
 * backward passes since, once one has run. */
void dfl_drafter_start_grad(dfl_drafter *d);

/* Bytes of activation workspace a micro-batch of NC context rows and nblk
 * blocks needs (for --progress / planning). */
uint64_t dfl_drafter_ws_bytes(const dfl_drafter *d, int64_t NC, int64_t nblk);

#endif
