/* trainer.h: the dflash-train-step loop: read hidden-state records as they
 * are needed, make optimizer steps, keep what a bit-exact resume needs.
 *
 * A step takes records until it holds batch_seqs usable sequences (0: no
 * limit) or at least batch_tokens tokens (0: no limit), whichever comes
 * first; records without an anchor candidate are read and skipped. The
 * sequences go through micro-batches of at most opts.micro_rows rows
 * (context + block rows; a longer sequence gets one of its own). If the
 * input ends, the step is made with what it has; a step with no sequence
 * is not made.
 */
#ifndef DFLASH_TRAINER_H
#define DFLASH_TRAINER_H

#include "dfs.h"
#include "drafter.h"
#include "model_config.h"
#include "train.h"

#include <jansson.h>

typedef struct {
    dfl_drafter *d;              /* not owned */
    const dfl_model_config *tcfg; /* the target's config, not owned */
    dfl_train_opts o;
    int64_t batch_seqs, batch_tokens;
    int     loop;                /* re-read the input file at its end */
    uint64_t seed;
    dfl_rng rng;
    int64_t step;                /* optimizer steps made, in total */
    /* input */
    char   *path;                /* as given ("-": stdin) */
    char   *real;                /* realpath of a file, "-" for stdin */
    dfs_reader *r;
    dfs_hs_meta meta;
    int64_t records, epoch;      /* records consumed in this epoch; completed passes */
    int64_t usable;              /* sequences with anchors seen in this epoch */
    int     ended;
    /* scratch */
    dfl_train_mb mb;
    int32_t *anchors, *ids;
    uint8_t *mask;
    int64_t cap;
} dfl_trainer;

/* Per-step figures for the log line. */
typedef struct {
    int64_t step;                /* 1-based, after the step */
    double  loss, accuracy, tau, grad_norm, lr, seconds;
    double  acc_k[DFL_DRAFTER_MAX_BLOCK]; /* k = 1..B-1; NAN where no slot counted */
    int64_t nseq, tokens, block_tokens, records;
} dfl_step_log;

void dfl_trainer_init(dfl_trainer *t, dfl_drafter *d, const dfl_model_config *tcfg, const dfl_train_opts *o,
                      int64_t batch_seqs, int64_t batch_tokens, int loop, uint64_t seed);
void dfl_trainer_free(dfl_trainer *t);

/* Open the input ("-": stdin), check its meta against the drafter and the
 * target (layer ids, hidden size, target architecture, config digest, and
 * target_ids / last_hidden when the options need them; every mismatching
 * field is named), and skip `skip` records of it. */
int dfl_trainer_open(dfl_trainer *t, const char *path, int64_t skip, int64_t epoch);

/* One optimizer step. *made = 1 if a step was made, 0 if the input ended
 * before any sequence. Returns 0 or an exit code. */
int dfl_trainer_step(dfl_trainer *t, dfl_step_log *log, int *made);

/* The log line of a step (one JSON object). */
json_t *dfl_step_log_json(const dfl_trainer *t, const dfl_step_log *log);

/* trainer_state.json: step, options, RNG, input position, target identity. */
json_t *dfl_trainer_state_json(const dfl_trainer *t);
/* Restore step, RNG and seed from a state; the options are the caller's
 * business (dfl_trainer_opts_json / the tool). Returns 0 or DFL_EX_DATA. */
int dfl_trainer_restore(dfl_trainer *t, const json_t *state, const char *path);
/* The options of a state that must match on resume, as stored. */
json_t *dfl_trainer_opts_json(const dfl_trainer *t);

#endif
