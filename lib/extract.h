/* extract.h: samples in, hidden-state stream out (the body of dflash-extract).
 *
 * Reads tokenized samples (jsonl.h), packs consecutive samples into batches
 * of at most batch_tokens tokens (a longer sample runs alone), runs the
 * target over each batch (target.h) and writes one stream record per sample,
 * in input order (dfs.h):
 *   input_ids   i32  [T]
 *   loss_mask   u8   [T]
 *   hidden      bf16 [T, K*H]  outputs of the K tapped layers, concatenated
 *                              in the requested order, rounded to nearest even
 *   target_ids  i32  [T]       (with_target_ids) the target's greedy next
 *                              token after input_ids[0..t]: argmax of the
 *                              logits at row t
 *   last_hidden bf16 [T, H]    (with_last_hidden) output of the last decoder
 *                              layer, BEFORE the final norm
 */
#ifndef DFLASH_EXTRACT_H
#define DFLASH_EXTRACT_H

#include "dfs.h"
#include "jsonl.h"
#include "target.h"

#include <jansson.h>
#include <stdint.h>

#define DFL_EXTRACT_MAX_TAPS 64

typedef struct {
    int        ntaps;
    const int *taps;
    int        with_target_ids;
    int        with_last_hidden;
    int64_t    batch_tokens;     /* >= 1 */
    int        skip_bad;         /* skip and count bad samples instead of stopping */
    int        progress;         /* force the progress line (else only on a terminal) */
    const char *prog;            /* prefix of warnings on stderr */
} dfl_extract_opts;

typedef struct {
    int64_t samples;        /* records written */
    int64_t tokens;         /* tokens in them */
    int64_t skipped;        /* bad samples skipped (skip_bad) */
    int64_t batches;        /* forward passes */
    int     input_error;    /* the run stopped on an input error: every record
                               written before it is complete and valid */
} dfl_extract_stats;

/* The layer ids to tap: `list` ("1,9,17", ids in [0, L)), else the ids of a
 * drafter config.json (dflash_config.target_layer_ids; if absent, the
 * reference rule for its num_hidden_layers draft layers), else the
 * reference rule for 5 draft layers. Writes up to DFL_EXTRACT_MAX_TAPS ids.
 * Returns 0, DFL_EX_USAGE (bad list, id out of range) or the config's error. */
int dfl_extract_layer_ids(const char *list, const char *drafter_config, int num_layers, int *ids, int *n);

/* A drafter config.json (--drafter-config) against the target: its
 * hidden_size and vocab_size, where given, must be the target's (the drafter
 * reads the target's states and shares its embedding and LM head), so that no
 * stream is extracted for a drafter dflash-train-step would refuse.
 * Returns 0 or DFL_EX_DATA naming the file and the field. */
int dfl_extract_check_drafter(const char *drafter_config, int64_t hidden_size, int64_t vocab_size);

/* The stream header's meta map for this target and request (dfs_hs_meta). */
json_t *dfl_extract_meta(const dfl_target *t, const dfl_extract_opts *o);

/* Run until the input ends. Returns 0 or an exit code with the error
 * recorded; st->input_error tells an input error (the stream written so far
 * is valid; close the writer normally) from an output or internal one. */
int dfl_extract_run(dfl_target *t, dfl_jsonl *in, dfs_writer *w, const dfl_extract_opts *o, dfl_extract_stats *st);

#endif
