/* drafter_infer.h: the drafter at inference, one block at a time, with a
 * context K/V cache (spec §1.7, §5.10).
 *
 * The context K/V of a layer depend only on the context features and that
 * layer's k_proj, k_norm and v_proj (spec §1.4), so they are computed once,
 * when the context rows arrive, and kept. A draft call:
 *   1. appends n new context rows (features of positions len .. len+n-1,
 *      the tokens committed since the last call): ctx = hidden_norm(fc(f)),
 *      then per layer k = rope(k_norm(k_proj(ctx))), v = v_proj(ctx) into
 *      the cache; len += n;
 *   2. drafts the block anchored at position len (= the anchor, never its
 *      own context): tokens [anchor token, mask x (B-1)] at positions
 *      len .. len+B-1, every layer attending to the cached context rows
 *      [0, len) and to the block's own B rows bidirectionally. The block's
 *      K/V go after the cache and are never kept;
 *   3. returns the greedy token of each slot 1..B-1 (argmax of the target's
 *      LM head on norm(h), lowest id on ties).
 * This is dfl_drafter_forward for one block whose context is every earlier
 * position, computed incrementally (equal up to f32 summation order).
 */
#ifndef DFLASH_DRAFTER_INFER_H
#define DFLASH_DRAFTER_INFER_H

#include "drafter.h"

#include <stdint.h>

typedef struct dfl_drafter_cache dfl_drafter_cache;

/* A cache for up to `cap` context positions (the block's B rows come on
 * top). The drafter must have its target parts loaded. */
dfl_drafter_cache *dfl_drafter_cache_new(dfl_drafter *d, int64_t cap);
void dfl_drafter_cache_free(dfl_drafter_cache *c);
int64_t dfl_drafter_cache_len(const dfl_drafter_cache *c);
/* Keep context positions [0, len). */
void dfl_drafter_cache_crop(dfl_drafter_cache *c, int64_t len);

/* Append n >= 0 context rows feats [n, K*H] (host, dtype bf16/f16/f32) and
 * draft the block anchored at the new length with `anchor` in slot 0:
 * draft[k-1] = the drafter's token for slot k, k = 1..B-1. With `out` (host
 * f32 [B, H], may be NULL) also the final-normed block rows. Returns 0, or
 * DFL_EX_DATA when the positions would exceed the capacity. */
int dfl_drafter_draft(dfl_drafter_cache *c, const void *feats, dfl_dtype dtype, int64_t n, int32_t anchor,
                      int32_t *draft, float *out);

#endif
