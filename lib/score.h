/* score.h: measuring a drafter (the body of dflash-score): acceptance
 * length offline on a hidden-state stream, and online in greedy
 * speculative decoding with the target (spec §1.7, §2.9, §4.1).
 *
 * Offline. Each anchor a of a record gives one block, built, run and
 * labelled by the training code (train.h: dfl_train_mb_add / _run, no
 * backward): slot k = 1..B-1 predicts the token at a+k; the slot is VALID
 * when a+k < T and loss_mask[a+k] = 1; its label is the data token (or the
 * stream's target_ids with labels = target). The block's accepted prefix
 *   s = number of leading slots k = 1, 2, ... that are valid and predicted
 *       right; the first wrong OR invalid slot ends it,
 * so an invalid slot counts as a rejection (the reference loop has no
 * invalid slots; past the end of a record nothing can be verified). Then
 *   tau_pooled  = mean over blocks of (s + 1)             (bonus counted, 1..B)
 *   tau_macro   = mean over records of the record's mean of (s + 1)
 *   accept_k    = #(s >= k) / #(s >= k-1 and slot k valid)
 *                 conditional acceptance at k given 1..k-1 accepted; a block
 *                 whose prefix reached an invalid slot k leaves the
 *                 denominator (censored), it was not rejected by the drafter
 *   accuracy_k  = #(slot k valid and right) / #(slot k valid), marginal
 *   hist[s]     = number of blocks with accepted prefix s, s = 0..B-1
 *   loss        = sum w_k m CE / sum w_k m, w_k = exp(-(k-1)/gamma), as training.
 *
 * Online. Per prompt: greedy decoding of the target (its own KV cache), and
 * the reference speculative loop (ZL dflash/model.py @ 44947fb): prefill;
 * while start < n + max_new: draft the block at `start` from the context
 * strictly before it, verify its B tokens with the target, a = leading
 * draft tokens equal to the target's argmax, commit a+1 tokens plus the
 * bonus, crop both caches; stop after a cycle that leaves an eos token in
 * the output. Cycle lengths L = a+1 feed the same statistics (every slot
 * valid): tau_macro = mean over responses of mean L (z-lab), tau_pooled =
 * sum L / cycles (vLLM/speculators), hist over a, accept_k as above.
 */
#ifndef DFLASH_SCORE_H
#define DFLASH_SCORE_H

#include "dfs.h"
#include "drafter.h"
#include "drafter_infer.h"
#include "jsonl.h"
#include "target.h"
#include "train.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

/* ---- statistics ------------------------------------------------------------ */

typedef struct {
    int     B;
    int64_t records;       /* records (prompts) read */
    int64_t scored;        /* records with at least one block / cycle */
    int64_t blocks;        /* blocks (offline) or verify cycles (online) */
    int64_t tokens;        /* offline: tokens of the records read; online: tokens generated */
    double  len_sum;       /* sum over blocks of (s + 1) */
    double  macro_sum;     /* sum over scored records of their mean (s + 1) */
    int64_t hist[DFL_DRAFTER_MAX_BLOCK];     /* [s], s = 0..B-1 */
    int64_t reach[DFL_DRAFTER_MAX_BLOCK];    /* [k]: s >= k-1 and slot k valid */
    int64_t accept[DFL_DRAFTER_MAX_BLOCK];   /* [k]: s >= k */
    int64_t correct[DFL_DRAFTER_MAX_BLOCK], count[DFL_DRAFTER_MAX_BLOCK]; /* [k] marginal (offline) */
    double  loss_num, loss_den;              /* sum w m CE, sum w m (offline) */
    /* online */
    int64_t mismatches;    /* responses that differ from greedy decoding */
    int64_t greedy_tokens;
    double  spec_s, greedy_s;        /* decode seconds (after prefill and the first draft) */
    double  tpot_spec, tpot_greedy;  /* sums over responses of seconds per output token */
} dfl_score_stats;

void dfl_score_stats_init(dfl_score_stats *st, int B);
/* One block (or cycle) with accepted prefix s; valid[k] for k = 0..B-1
 * (NULL: every slot valid). */
void dfl_score_block(dfl_score_stats *st, int s, const uint8_t *valid);
/* Close a record: nblk blocks whose (s + 1) summed to len_sum. */
void dfl_score_record(dfl_score_stats *st, int64_t nblk, double len_sum);

double dfl_score_tau_pooled(const dfl_score_stats *st);  /* NAN without blocks */
double dfl_score_tau_macro(const dfl_score_stats *st);   /* NAN without scored records */
double dfl_score_accept_k(const dfl_score_stats *st, int k);    /* NAN where nothing reached k */
double dfl_score_accuracy_k(const dfl_score_stats *st, int k);  /* NAN where no slot k was valid */
double dfl_score_accuracy(const dfl_score_stats *st);           /* pooled over k */
double dfl_score_loss(const dfl_score_stats *st);

/* ---- offline: blocks at given anchors ------------------------------------------ */

typedef struct dfl_offline dfl_offline;

/* A scorer for drafter d (target parts loaded) with the training options o
 * (gamma, labels; CE). Micro-batches hold up to micro_rows rows (context +
 * block rows; a record's anchors are split across several if needed). */
dfl_offline *dfl_offline_new(dfl_drafter *d, const dfl_train_opts *o, int64_t micro_rows);
void dfl_offline_free(dfl_offline *s);
/* Score record q at its n anchors (sorted ascending, each in [0, T)). The
 * record's features are copied; blocks run as micro-batches fill. */
void dfl_offline_add(dfl_offline *s, const dfl_train_seq *q, const int32_t *anchors, int64_t n);
/* Run what is pending; the statistics are then complete. */
const dfl_score_stats *dfl_offline_finish(dfl_offline *s);

typedef struct {
    int64_t anchors;            /* per record: 0 = every supervised anchor */
    uint64_t seed;              /* RNG of the drawn anchors */
    const json_t *anchors_from; /* object: record id -> array of anchors (--anchors-from), or NULL */
    int     labels_target;
    int     progress;
    int     read_ahead;         /* decode the next record on a thread (from a regular file only) */
} dfl_score_stream_opts;

/* Read the stream at `path` ("-": stdin), checked against the target and
 * every drafter (dfl_records_check_meta), and score every drafter on the
 * same anchors. *records = records read. Returns 0 or an exit code. */
int dfl_score_stream(dfl_offline *const *s, dfl_drafter *const *d, int nd, const dfl_model_config *tcfg,
                     const char *path, const dfl_score_stream_opts *o, int64_t *records);

/* Load an --anchors-from file (JSON lines with "id" and "anchors"): an
 * object id -> anchors. Returns 0, DFL_EX_NOINPUT or DFL_EX_DATA (file:line). */
int dfl_score_load_anchors(const char *path, json_t **out);

/* ---- online: decoding ------------------------------------------------------------ */

typedef struct {
    int64_t max_new;            /* new tokens (>= 1) */
    int     n_eos;              /* stop tokens (0: none) */
    const int64_t *eos;
    /* 0: greedy. T > 0: the target's tokens are drawn from softmax(z / T),
     * the token at position p by the draw dfl_sample_key(seq_key, p)
     * (sample.h), in plain decoding and in the speculative loop alike. The
     * draft stays greedy, as in the reference. */
    float    temperature;
    uint64_t seq_key;
    int32_t  top_k;             /* sampling among the top k (0: off) */
    float    top_p;             /* and the top-p nucleus of those (0: off) */
} dfl_gen_opts;

typedef struct {
    int32_t *ids;               /* generated tokens (the prompt excluded), truncated as the reference */
    int64_t  n;
    int32_t *len;               /* a+1 of every cycle (speculative only) */
    int32_t *anchors;           /* the anchor position of every cycle */
    int64_t  ncycles;
    double   prefill_s, decode_s;
    int64_t  cap, cap_c;
} dfl_gen_result;

void dfl_gen_result_free(dfl_gen_result *r);

/* Plain decoding of the target (KV cache kv, of the target t): greedy, or
 * sampled at o->temperature. */
int dfl_greedy_generate(dfl_target *t, dfl_target_kv *kv, const int32_t *prompt, int64_t n, const dfl_gen_opts *o,
                        dfl_gen_result *r);
/* The reference speculative loop with drafter d (its context cache dc). The
 * drafter reads the tapped states rounded to bf16, as a stream stores them. */
int dfl_spec_generate(dfl_target *t, dfl_target_kv *kv, dfl_drafter *d, dfl_drafter_cache *dc, const int32_t *prompt,
                      int64_t n, const dfl_gen_opts *o, dfl_gen_result *r);

typedef struct {
    int64_t max_new;
    int     ignore_eos;
    float    temperature;       /* 0: greedy; T > 0: sampled (dfl_gen_opts) */
    uint64_t seed;              /* a prompt's draws: dfl_sample_seq_key(seed, XXH64 of its id) */
    int32_t  top_k;             /* 0: off */
    float    top_p;             /* 0: off */
    int     progress;
    FILE   *emit;               /* JSON lines per prompt and drafter, or NULL */
    const char *emit_name;      /* its name, for messages */
    const char *const *names;   /* drafter names for the emitted lines */
} dfl_online_opts;

/* Decode every prompt of `in` plainly and with each drafter; st[i] gets
 * drafter i's statistics. Returns 0 or an exit code (a bad prompt line:
 * DFL_EX_DATA naming the file and line). */
int dfl_score_online(dfl_target *t, dfl_drafter *const *d, int nd, dfl_jsonl *in, const dfl_online_opts *o,
                     dfl_score_stats *st);

/* ---- output lines ------------------------------------------------------------------ */

typedef struct {
    const char *time;           /* UTC ISO-8601 */
    const char *drafter;        /* checkpoint path */
    int64_t     step;           /* -1: none (released checkpoint) */
    const char *input;          /* stream or prompts path */
    int         online;
    /* offline settings */
    const char *labels;         /* "data" | "target" */
    double      gamma;
    const char *anchors;        /* "all", "N", "file" */
    int64_t     seed;           /* -1: none */
    /* online settings */
    int64_t     max_new;
    double      temperature;
    int64_t     sample_seed;    /* -1: none (temperature 0) */
    int64_t     top_k;          /* -1: none */
    double      top_p;          /* NaN: none */
} dfl_score_line;

/* The line of one drafter: a JSON object whose keys, in order, are the TSV
 * columns (man dflash-score, OUTPUT). */
json_t *dfl_score_line_json(const dfl_score_line *l, const dfl_score_stats *st);
/* TSV: the header (the keys) and a row (lists comma-separated, null empty,
 * NaN in lists "nan", reals %.6f). */
void dfl_score_tsv_header(FILE *f, const json_t *line);
void dfl_score_tsv_row(FILE *f, const json_t *line);

#endif
