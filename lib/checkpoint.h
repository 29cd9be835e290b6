/* checkpoint.h: drafter checkpoint directories (formats/checkpoint.md).
 *
 *   DIR/config.json                 the drafter config, released z-lab layout
 *   DIR/model.safetensors           bf16 weights, released names (no "model." prefix)
 *   DIR/trainer_state.safetensors   f32 "master", "adam_m", "adam_v" [nparams] (optional)
 *   DIR/trainer_state.json          step, schedule, RNG, input position, options (optional)
 *
 * A directory is written under a temporary name beside DIR and renamed into
 * place when complete (dfl_tmpdir_create/commit), so an interrupted run never
 * leaves a half checkpoint under the final name.
 */
#ifndef DFLASH_CHECKPOINT_H
#define DFLASH_CHECKPOINT_H

#include "drafter.h"

#include <jansson.h>

/* Write `d` (its master weights, rounded to bf16) to DIR; with `state` (a
 * JSON object) also the trainer state (f32 master, AdamW moments and the
 * JSON). Returns 0 or an exit code. */
int dfl_ckpt_save(const char *dir, const dfl_drafter *d, const json_t *state);

/* Before training: can a checkpoint be written to DIR? (It does not exist or
 * is a checkpoint directory, and its parent is writable.) 0 or 73, so that a
 * bad --out fails before the steps, not after them. */
int dfl_ckpt_check_out(const char *dir);

/* The drafter config of a checkpoint directory (DIR/config.json). */
int dfl_ckpt_load_config(const char *dir, dfl_drafter_config *c);

/* 1 if DIR holds trainer state (trainer_state.json), else 0. */
int dfl_ckpt_has_state(const char *dir);

/* Load model.safetensors (ours or a released checkpoint: bf16, f16 or f32;
 * names with or without the "model." prefix) into d's master weights.
 * Every tensor must be present with its shape; unknown tensors are refused. */
int dfl_ckpt_load_weights(const char *dir, dfl_drafter *d);

/* Before the drafter is allocated: does DIR's model.safetensors (or its
 * trainer state: trainer_state.json's format, trainer_state.safetensors's
 * shapes) fit a drafter of config c? Reads headers only, so a checkpoint
 * that disagrees costs no allocation the size of the model. 0 or an exit
 * code naming the file and the tensor. */
int dfl_ckpt_check_weights(const char *dir, const dfl_drafter_config *c);
int dfl_ckpt_check_state(const char *dir, const dfl_drafter_config *c);

/* Load the trainer state: master weights and AdamW moments into d, and the
 * JSON (returned in *state, owned by the caller). */
int dfl_ckpt_load_state(const char *dir, dfl_drafter *d, json_t **state);

#endif
