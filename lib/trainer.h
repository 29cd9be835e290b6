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
 *
 * From a regular file, a thread reads ahead: it reads, checks and decodes
 * the next record while the step works on the current one (on a GPU host,
 * decoding a record costs the CPU about as long as the device takes for its
 * step), and hands records over in order, errors included, at the point
 * the step would have met them. From standard input or a FIFO records are
 * read as they are needed (reading ahead would take a record the run may
 * not use out of the pipe). dfl_trainer_read_ahead(t, 0) turns it off.
 */
#ifndef DFLASH_TRAINER_H
#define DFLASH_TRAINER_H

#include "dfs.h"
#include "drafter.h"
#include "model_config.h"
#include "records.h"
#include "train.h"

#include <jansson.h>

/* The largest count of steps the trainer takes or stores: --steps,
 * --total-steps, and trainer_state.json's step, options.total_steps,
 * input.records and input.epoch. Sums of two (the step a run ends at) are
 * far from overflowing an int64_t, every count is exact as a double (the
 * schedule's floor(R * T), the progress line) and in a JSON reader that
 * reads numbers as doubles; and no training comes near it. */
#define DFL_TRAIN_MAX_STEPS (INT64_C(1) << 53)

typedef struct {
    dfl_drafter *d;              /* not owned */
    const dfl_model_config *tcfg; /* the target's config, not owned */
    dfl_train_opts o;
    int64_t batch_seqs, batch_tokens;
    int     loop;                /* re-read the input file at its end */
    uint64_t seed;
    dfl_rng rng;
    int64_t step;                /* optimizer steps made, in total */
    /* input, as the steps have consumed it */
    char   *path;                /* as given ("-": stdin) */
    char   *real;                /* realpath of a file, "-" for stdin */
    int64_t records, epoch;      /* records consumed in this epoch; completed passes */
    int     ended;
    /* the reader's side (the read-ahead thread's, once it runs): it may be
     * a record ahead of the steps */
    dfs_reader *r;
    dfs_hs_meta meta;
    int64_t in_records, in_epoch; /* records read in this epoch; completed passes */
    int64_t in_usable;           /* records with an anchor candidate read in this epoch */
    int     in_ended;
    int32_t *cand;               /* scratch of the anchor candidates */
    size_t  cap_cand;
    int     read_ahead;          /* read the next record on a thread (default: from a file) */
    dfl_record_queue *q;         /* the records handed over */
    /* scratch */
    dfl_train_mb mb;
    int32_t *anchors;
    int64_t cap;
} dfl_trainer;

/* Per-step figures for the log line. */
typedef struct {
    int64_t step;                /* 1-based, after the step */
    double  loss, accuracy, tau, grad_norm, lr, seconds;
    double  input_wait;          /* seconds the step waited for its records (reading them, or the read-ahead) */
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
/* Can the input at `path` ("-": stdin) be read with `loop`? --loop opens it
 * again at the end of each pass, so it needs a regular file: standard input,
 * a FIFO or a pipe (/dev/fd/N from a shell's <(...)) is spent after one pass
 * and would block or read as an empty stream. Cheap (a stat): the tool calls
 * it before loading the models; dfl_trainer_open checks it again. Returns 0
 * or DFL_EX_USAGE with the error recorded; a path that does not exist is
 * left to the open to report. */
int dfl_trainer_check_loop(const char *path, int loop);
/* Read ahead on a thread (on != 0: the default, for a regular file only) or not;
 * after dfl_trainer_open, before the first step. The records, the steps
 * and every error are the same either way. */
void dfl_trainer_read_ahead(dfl_trainer *t, int on);

/* One optimizer step. *made = 1 if a step was made, 0 if the input ended
 * before any sequence. Returns 0 or an exit code. */
int dfl_trainer_step(dfl_trainer *t, dfl_step_log *log, int *made);

/* The log line of a step (one JSON object). */
json_t *dfl_step_log_json(const dfl_trainer *t, const dfl_step_log *log);

/* trainer_state.json: step, options, RNG, input position, target identity. */
json_t *dfl_trainer_state_json(const dfl_trainer *t);
/* Restore step, RNG and seed from a state; the options are the caller's
 * business (dfl_trainer_opts_json / the tool). Returns 0 or DFL_EX_DATA
 * with an error naming `path`, the trainer_state.json the state came from
 * (a step that is not a count in [0, DFL_TRAIN_MAX_STEPS] among them). */
int dfl_trainer_restore(dfl_trainer *t, const json_t *state, const char *path);
/* The options of a state that must match on resume, as stored. */
json_t *dfl_trainer_opts_json(const dfl_trainer *t);

#endif
