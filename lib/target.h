/* target.h: the target model (Qwen3, Llama, the Qwen3.5 hybrid), written
 * once against dfl_ops.
 *
 * Loads a Hugging Face model directory (config.json + model.safetensors or a
 * sharded index) and runs the forward pass over a packed batch: several
 * sequences back to back, each with its own positions from 0 and its own
 * causal mask (attn_causal's cu offsets), none seeing another.
 *
 * What a forward can give (all optional, chosen per call):
 *   taps        the output of decoder layer k (0-based) for each requested
 *               id k, in the requested order. This is Hugging Face's
 *               output.hidden_states[k+1] for k < L-1; for k = L-1 it is the
 *               output of the last layer BEFORE model.norm (HF's last entry
 *               is after the norm). It is the DFlash target_layer_ids
 *               convention ("output of layer k").
 *   last_hidden the output of the last decoder layer, before model.norm.
 *   normed      model.norm of the last layer's output (HF's last
 *               hidden_states entry), for chosen rows.
 *   argmax      greedy next-token ids (argmax of the LM head logits on the
 *               normed rows, lowest id on ties) and the top-1 minus top-2
 *               logit gap, for the same rows.
 * The pass stops after the deepest layer it needs: with taps only, after
 * layer max(k); the final norm and LM head run only when asked for.
 *
 * Numerics. The residual stream lives in ops "act" buffers: f32 on the CPU
 * backend (every op in f32, matching Hugging Face run in fp32 up to GEMM
 * reduction order), bf16 on CUDA (bf16 storage, f32 accumulation, as HF and
 * SGLang run bf16 models). On the CPU this is deliberately more exact than
 * HF's bf16 inference: the states written are the f32 model's, rounded once
 * to bf16 on output.
 *
 * Memory: the weights (as compute weights: f32 on the CPU, but for the
 * layers' matrices, which stay bf16 there when the file's are) plus a workspace
 * that grows to the largest batch seen: a few [T, H]-sized buffers (q, k, v
 * and the attention output included), the taps [T, K, H], and two MLP
 * buffers of at most [4096, I] (the MLP runs in row chunks). Nothing grows
 * with the number of batches run.
 */
#ifndef DFLASH_TARGET_H
#define DFLASH_TARGET_H

#include "model_config.h"
#include "ops.h"

#include <stdint.h>

typedef struct dfl_target dfl_target;

typedef struct {
    /* Load decoder layers [0, nlayers) only (0: all). A forward may then use
     * no tap deeper than nlayers-1 and no final output. */
    int nlayers;
    /* Load model.norm and the LM head (lm_head.weight, or the embedding when
     * tie_word_embeddings is true). Needed for normed and argmax. */
    int head;
} dfl_target_opts;

/* Load `dir` for `ops`. Returns 0, DFL_EX_NOINPUT (cannot open), DFL_EX_DATA
 * (bad config, unsupported model, missing or misshapen tensor, bad file). */
int dfl_target_load(dfl_target **t, const char *dir, const dfl_ops *ops, const dfl_target_opts *opts);
void dfl_target_free(dfl_target *t);
const dfl_model_config *dfl_target_config(const dfl_target *t);
const dfl_ops *dfl_target_ops(const dfl_target *t);
int dfl_target_loaded_layers(const dfl_target *t);
/* Bytes of compute weights held by the backend. */
uint64_t dfl_target_weight_bytes(const dfl_target *t);

/* A packed batch: sequence s is rows [cu[s], cu[s+1]) of ids. Host arrays. */
typedef struct {
    const int32_t *ids;  /* [T], each in [0, vocab) */
    const int32_t *cu;   /* [nseq+1], cu[0] = 0, strictly increasing, cu[nseq] = T */
    int64_t nseq;
} dfl_target_batch;

typedef struct {
    int        ntaps;        /* 0..64 */
    const int *taps;         /* layer ids in [0, L), repeats allowed */
    int        last_hidden;  /* want the pre-norm output of layer L-1 */
    int        normed;       /* want model.norm(...) at `rows` */
    int        argmax;       /* want argmax ids and gaps at `rows` */
    const int32_t *rows;     /* host [nrows] row indices into the batch; NULL: all T rows */
    int64_t    nrows;
    /* Cached forwards only: the caller may crop back into these rows (a
     * speculative block). A hybrid target (Qwen3.5) then keeps what it
     * needs to rebuild its recurrent state at any of them; it can crop only
     * to 0 or into the last forward made with this set. Other targets
     * ignore it. */
    int        may_crop;
    /* With argmax: 0 for the argmax (greedy), or T > 0 to sample each row
     * at temperature T, row i by the draw of sample_keys[i] (host [nrows],
     * sample.h), among the tokens top_k and top_p keep (0: off); out->argmax
     * then holds the drawn ids. */
    float      temperature;
    const uint64_t *sample_keys;
    int32_t    top_k;
    float      top_p;
} dfl_target_want;

/* Outputs of the last forward, owned by the target and valid until the next
 * forward. Pointers are backend buffers (see ops.h), NULL when not asked for. */
typedef struct {
    int64_t  T, nrows;
    int      ntaps;
    void    *taps;         /* act [T, ntaps, H], as the stream's "hidden": tap j of row t at
                              DFL_AT(ops, taps, (t*ntaps + j)*H) */
    void    *last_hidden;  /* act [T, H] */
    void    *normed;       /* act [nrows, H] */
    int32_t *argmax;       /* i32 [nrows]: argmax, or the drawn ids (temperature) */
    float   *gap;          /* f32 [nrows] */
} dfl_target_out;

/* Run the forward. Returns 0, DFL_EX_DATA (a token id outside the
 * vocabulary, a malformed batch) or DFL_EX_USAGE (a tap id out of range, an
 * output the load options excluded), with the error recorded. */
int dfl_target_forward(dfl_target *t, dfl_target_out *out, const dfl_target_batch *b, const dfl_target_want *w);

/* Copy rows [row0, row0+n) of the taps to the host as bf16 (round to nearest
 * even), layers side by side: dst[n, ntaps*H], row r = tap0 | tap1 | ...
 * (the stream's "hidden" tensor; the device holds them so: one copy). */
void dfl_target_taps_to_bf16(dfl_target *t, const dfl_target_out *o, int64_t row0, int64_t n, uint16_t *dst);
/* The same in f32 (tests, the CPU reference). */
void dfl_target_taps_to_f32(dfl_target *t, const dfl_target_out *o, int64_t row0, int64_t n, float *dst);

/* ---- incremental decoding with a KV cache (target_kv.c) ------------------
 *
 * One sequence at a time: the cache holds the keys and values of positions
 * [0, len) of every loaded layer. dfl_target_kv_forward runs n new tokens at
 * positions len .. len+n-1 (each sees the cache and the new tokens before
 * it, causally), appends their keys and values, and gives the same outputs
 * as dfl_target_forward for those n rows (taps [n, ntaps, H], argmax ...),
 * equal to the full-sequence forward up to f32 summation order. Crop drops
 * positions >= len (the rejected tail of a verified block). Prefill is a
 * forward from len 0; speculative verification is a forward of B tokens. */
typedef struct dfl_target_kv dfl_target_kv;

/* A cache for up to `cap` positions (1 <= cap <= 2^31 - 1). */
dfl_target_kv *dfl_target_kv_new(dfl_target *t, int64_t cap);
void dfl_target_kv_free(dfl_target_kv *kv);
int64_t dfl_target_kv_len(const dfl_target_kv *kv);
int64_t dfl_target_kv_cap(const dfl_target_kv *kv);
/* Keep positions [0, len); len <= the current length. 0 empties the cache. */
void dfl_target_kv_crop(dfl_target_kv *kv, int64_t len);
/* Run ids[0..n) at positions len..len+n-1 (rows of the batch are these n
 * tokens; w->rows index them). Outputs in *out as dfl_target_forward's, valid
 * until the next forward of this cache. Returns 0, DFL_EX_DATA (token id
 * outside the vocabulary, n < 1, or len + n beyond the capacity) or
 * DFL_EX_USAGE (a tap or output the load options excluded). */
int dfl_target_kv_forward(dfl_target_kv *kv, dfl_target_out *out, const int32_t *ids, int64_t n, const dfl_target_want *w);

#endif
