/* train.h: DFlash training (spec §2): anchors, blocks, labels, loss
 * weights, micro-batches, the optimizer step and the step loop.
 *
 * One optimizer step consumes whole sequences. For each sequence:
 *   anchors  up to opts.anchors positions a with loss_mask[a] = loss_mask[a+1] = 1
 *            (a <= T-2), drawn without replacement, sorted; redrawn every time
 *            the sequence is used;
 *   block j  [ids[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1;
 *   context  the target features at positions < a_j (never a_j itself), and
 *            the block's own B rows bidirectionally; no other block;
 *   label    slot k (1..B-1) -> the token at a_j+k (data, or the target's
 *            greedy token with --labels target); no loss on slot 0, past the
 *            end, or where loss_mask = 0;
 *   weight   w_k = exp(-(k-1)/gamma).
 * The loss of a step is sum(w m loss) / sum(w m) (or / sum(m)), the sums
 * running over EVERY slot of the step, whatever its split into
 * micro-batches: each micro-batch's backward pass accumulates the gradient
 * of the UNnormalised sum sum(w m loss), and the optimizer divides by the
 * step's normaliser once, before clipping. The split changes only the order
 * of floating-point additions.
 */
#ifndef DFLASH_TRAIN_H
#define DFLASH_TRAIN_H

#include "drafter.h"
#include "rng.h"

#include <stdint.h>

typedef struct {
    int64_t anchors;        /* per sequence (512) */
    double  gamma;          /* loss decay (7 for B = 16) */
    int     kl;             /* 0: CE, 1: KL to the target's distribution */
    int     labels_target;  /* CE labels: 0 data tokens, 1 the stream's target_ids */
    int     norm_count;     /* 0: divide by sum(w m), 1: by sum(m) */
    double  noise_std;      /* Gaussian noise on the context features (fc input) */
    double  lr, warmup_ratio, weight_decay, beta1, beta2, adam_eps, max_grad_norm;
    int64_t total_steps;
    int64_t micro_rows;     /* context + block rows per micro-batch (a longer sequence gets its own) */
} dfl_train_opts;

void dfl_train_opts_default(dfl_train_opts *o, int block_size);

/* w_k = exp(-(k-1)/gamma) for k >= 1, 0 for k = 0. */
double dfl_slot_weight(int k, double gamma);
/* Learning rate of the step with 0-based index i: linear warm-up over
 * W = floor(warmup_ratio * total) steps, lr * (i+1) / W, then cosine to 0,
 * lr * (1 + cos(pi * (i - W) / (total - W))) / 2; 0 from i = total on. */
double dfl_lr_at(int64_t i, int64_t total, double warmup_ratio, double peak);

/* Anchor candidates of a sequence: positions a <= T-2 with loss_mask[a] and
 * loss_mask[a+1] set. Writes them to cand (T entries) and returns the count. */
int64_t dfl_anchor_candidates(int32_t *cand, const uint8_t *loss_mask, int64_t T);
/* Draw min(max_anchors, #candidates) anchors without replacement, sorted
 * ascending, into out (T entries). Returns the count. */
int64_t dfl_anchors_sample(int32_t *out, const uint8_t *loss_mask, int64_t T, int64_t max_anchors, dfl_rng *rng);

/* One training sequence (host memory, not owned). */
typedef struct {
    int64_t T;
    const int32_t *ids;          /* [T] */
    const uint8_t *loss_mask;    /* [T] 0/1 */
    const void *hidden;          /* [T, K*H] tapped target features, hidden_dtype */
    dfl_dtype hidden_dtype;
    const int32_t *target_ids;   /* [T] the target's greedy token for position t+1 (from logits at t), or NULL */
    const void *last_hidden;     /* [T, H] the target's last hidden state (pre-norm), or NULL */
    dfl_dtype last_dtype;
} dfl_train_seq;

/* A micro-batch under construction (host arrays, grown as needed). */
typedef struct {
    dfl_drafter_batch b;        /* what the drafter reads; pointers into the arrays below */
    int64_t cap_nc, cap_q, nseq, tokens;
    int     B;
    size_t  feat_esz;
    void   *feats;
    const dfl_ops *ops;         /* the device the features are loaded to: feats is its host_alloc
                                   memory (faster copies); NULL (dfl_train_mb_init): malloc */
    int32_t *ctx_pos, *blk_pos, *pos, *tokens_arr, *labels;
    float  *gscale;
    uint8_t *valid;             /* [Q] the row carries a loss (m = 1) */
    int32_t *metric_label;      /* [Q] label used for accuracy (CE: the label; KL: filled after the loss) */
    dfl_block *blocks;
    void   *target_h;
    size_t  th_esz;
    int32_t *streak;            /* [nblk] after dfl_train_mb_run: s_j, block j's accepted prefix
                                   (leading slots with a loss whose prediction is right) */
} dfl_train_mb;

void dfl_train_mb_init(dfl_train_mb *mb);
void dfl_train_mb_reset(dfl_train_mb *mb);
void dfl_train_mb_free(dfl_train_mb *mb);
/* Append a sequence with its n anchors (sorted). Context rows: positions
 * 0 .. a_last-1 (the last anchor's context covers every other's). With
 * o->noise_std > 0, N(0, noise_std^2) noise from `rng` is added to those
 * context features (in f32, in row order) and nothing else. */
void dfl_train_mb_add(dfl_train_mb *mb, const dfl_drafter_config *c, const dfl_train_opts *o, const dfl_train_seq *s,
                      const int32_t *anchors, int64_t n, dfl_rng *rng);
/* Rows (context + block) the micro-batch holds. */
int64_t dfl_train_mb_rows(const dfl_train_mb *mb);

/* Per-step statistics. */
typedef struct {
    double  num;            /* sum w m loss */
    double  den_w, den_c;   /* sum w m, sum m */
    int64_t correct[DFL_DRAFTER_MAX_BLOCK], count[DFL_DRAFTER_MAX_BLOCK];
    double  streak_sum;     /* sum over blocks of s_j */
    int64_t nblocks, nseq, tokens, block_tokens;
} dfl_train_stats;

/* Forward, loss and backward of one micro-batch; gradients accumulate into
 * d->grad (unnormalised: sum of w m dloss). Adds to *st. */
void dfl_train_mb_run(dfl_drafter *d, const dfl_train_opts *o, dfl_train_mb *mb, dfl_train_stats *st, int backward);

/* The optimizer step after every micro-batch of step i (0-based): divide the
 * gradient by the step's normaliser, global-norm clip (factor
 * min(1, max/(norm + 1e-6))), AdamW at dfl_lr_at(i). Returns the gradient
 * norm before clipping in *grad_norm and the rate in *lr. */
void dfl_train_apply(dfl_drafter *d, const dfl_train_opts *o, const dfl_train_stats *st, int64_t i, double *grad_norm,
                     double *lr);

/* Metrics of a step: loss, accuracy, offline tau (mean over blocks of s_j + 1). */
double dfl_train_loss(const dfl_train_opts *o, const dfl_train_stats *st);
double dfl_train_accuracy(const dfl_train_stats *st);
double dfl_train_tau(const dfl_train_stats *st);

#endif
