/* target.c: Qwen3 / Llama / Qwen3.5 forward over packed sequences, through
 * dfl_ops.
 *
 * Per decoder layer (Hugging Face Qwen3DecoderLayer / LlamaDecoderLayer):
 *   h = RMSNorm_in(x)
 *   q = h Wq^T [T, Hq, D], k = h Wk^T, v = h Wv^T [T, Hkv, D]
 *   Qwen3 only: q = RMSNorm_qn(q), k = RMSNorm_kn(k), per head over D
 *   q, k = RoPE(q, pos), RoPE(k, pos)        NeoX pairing (i, i + D/2)
 *   a = softmax(q k^T / sqrt(D) + causal) v   per sequence, GQA h -> h / (Hq/Hkv)
 *   x = x + a Wo^T
 *   h = RMSNorm_post(x)
 *   x = x + Wdown (silu(Wgate h) * (Wup h))
 * The residual additions are folded into the output GEMMs (accumulate = 1).
 *
 * Qwen3.5 (targets-extraction §3): RMSNorms scale by (1 + w) (folded into
 * the weights at load); its attention layers rotate only the first
 * rotary_dim dims of each head (folded into a head-dim permutation at
 * load, see xform) and gate the attention output, a = a * sigmoid(h Wg^T);
 * the others are Gated DeltaNet layers (dfl_target_linear_attn).
 */
#include "target.h"
#include "target_internal.h"

#include "common.h"
#include "safetensors.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

const dfl_model_config *dfl_target_config(const dfl_target *t) { return &t->cfg; }
const dfl_ops *dfl_target_ops(const dfl_target *t) { return t->ops; }
int dfl_target_loaded_layers(const dfl_target *t) { return t->nlayers; }
uint64_t dfl_target_weight_bytes(const dfl_target *t) { return t->weight_bytes; }

/* ---- loading ------------------------------------------------------------ */

/* How a checkpoint tensor becomes a compute tensor. Qwen3.5 needs more than
 * a dtype conversion; every rewrite is a reordering (exact). Its (1 + w)
 * norms keep w as stored: rmsnorm1p forms 1 + w in f32, as transformers
 * does (a bf16 weight holding 1 + w would round it by up to 2^-8).
 *   XF_HEAD_ROWS  rows of per-head projections: head h's rows
 *                 [h*stride + off, +D) of the source, in the rotary order
 *                 below when `perm` is set (q_proj's query or gate rows, k_proj)
 *   XF_NORM_PERM  q_norm / k_norm: the rotary order
 *   XF_F32        a small f32 parameter (A_log, dt_bias, sinks) into f32 memory
 *   XF_QKVZ       Qwen3-Next's fused DeltaNet projections, regrouped into
 *                 Qwen3.5's (qkvz_rows): `part` 0 the q|k|v rows of
 *                 in_proj_qkvz, 1 its z rows, 2 the b|a rows of in_proj_ba
 *   XF_EXPERTS    gpt-oss's stacked experts, as [E, rows, cols] (out, in):
 *                 from MXFP4 blocks and scales, or from transformers'
 *                 [E, cols, rows] (transposed); with `interleave`, rows
 *                 0, 2, 4 ... (gate) first, then 1, 3, 5 ... (up)
 * The rotary order: a partial RoPE (Qwen3.5 rotates the first rotary_dim
 * dims of each head, pairing (i, i + rotary_dim/2)) becomes the full-width
 * op's pairing (i, i + D/2) with zero frequencies for the rest, once the
 * head dims of q and k are permuted alike: dot products q.k, all attention
 * uses of them, do not change under a common permutation, and v is not
 * permuted, so the attention output is unchanged. */
typedef enum { XF_NONE, XF_HEAD_ROWS, XF_NORM_PERM, XF_F32, XF_EXPERTS, XF_QKVZ } xform;

/* One tensor to load: its name, expected shape, and where its pointer goes. */
typedef struct {
    char name[192];
    int ndim;
    int64_t shape[3];
    void **dst;        /* set to the start of this tensor's memory ... */
    int64_t dst_off;   /* ... unless > 0: then written at *dst + dst_off elements (a concatenation) */
    xform xf;
    int64_t heads, stride, off, perm; /* XF_HEAD_ROWS, XF_NORM_PERM */
    int64_t rows, cols;                /* XF_EXPERTS (heads: the experts) */
    int mxfp4, transposed, interleave; /* XF_EXPERTS */
    int part;                          /* XF_QKVZ */
    int mat;                           /* a layer's projection matrix or experts: in t->mats (mat_dtype) */
    int64_t out_numel; /* elements written (the source's unless XF_HEAD_ROWS) */
    const dfl_st_tensor *src, *scales; /* scales: MXFP4's */
} wspec;

/* The plan. Each tensor is looked up in the checkpoint as it is planned,
 * and planning stops at the first one missing or misshapen (rc): the list
 * never outgrows the checkpoint, whatever sizes config.json claims (a MoE
 * config's layers x experts can ask for 10^9 tensors of a file with few). */
typedef struct {
    wspec *v;
    int n, cap;
    const dfl_st *st;
    int rc;
    wspec discard; /* returned once rc is set, for the caller's field writes */
} wlist;

/* A fresh spec at the end of the list for `name`; the pointer returned is
 * valid until the next push (the list grows by realloc). */
static wspec *push_spec(wlist *l, void **dst, const char *name) {
    if (l->n == l->cap) l->v = dfl_realloc(l->v, (size_t)(l->cap = l->cap ? 2 * l->cap : 64) * sizeof *l->v);
    wspec *w = &l->v[l->n++];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->dst = dst;
    return w;
}

/* Add a tensor to the list, checked against the checkpoint. */
static wspec *want(wlist *l, void **dst, int ndim, int64_t d0, int64_t d1, int64_t d2, const char *name) {
    if (l->rc) return memset(&l->discard, 0, sizeof l->discard);
    wspec *w = push_spec(l, dst, name);
    w->ndim = ndim;
    w->shape[0] = d0;
    w->shape[1] = d1;
    w->shape[2] = d2;
    if ((l->rc = dfl_st_get(l->st, w->name, ndim, w->shape, &w->src))) {
        l->n--;
        return memset(&l->discard, 0, sizeof l->discard);
    }
    return w;
}

/* A tensor of decoder layer i: PREFIX layers.i.SUFFIX. */
static wspec *want_layer(wlist *l, const dfl_target *t, void **dst, int ndim, int64_t d0, int64_t d1, int64_t d2, int i,
                         const char *suffix) {
    char name[128];
    snprintf(name, sizeof name, "%slayers.%d.%s", t->cfg.weight_prefix, i, suffix);
    return want(l, dst, ndim, d0, d1, d2, name);
}

/* Rows of head h from [h*stride + off, +D) of a [heads*stride, H] projection. */
static wspec *want_head_rows(wlist *l, const dfl_target *t, void **dst, int64_t heads, int64_t stride, int64_t off,
                             int perm, int i, const char *suffix) {
    const int64_t H = t->cfg.hidden_size, D = t->cfg.head_dim;
    wspec *w = want_layer(l, t, dst, 2, heads * stride, H, 0, i, suffix);
    w->xf = XF_HEAD_ROWS;
    w->heads = heads;
    w->stride = stride;
    w->off = off;
    w->perm = perm;
    w->out_numel = heads * D * H;
    return w;
}

/* q_norm / k_norm: in the rotary order when perm. (The spec is set up
 * before the next want(): that may move the list.) */
static void want_norm_perm(wlist *l, const dfl_target *t, void **dst, int perm, int i, const char *suffix) {
    wspec *w = want_layer(l, t, dst, 1, t->cfg.head_dim, 0, 0, i, suffix);
    if (perm) w->xf = XF_NORM_PERM;
    w->perm = perm;
}

static void plan_attention(dfl_target *t, wlist *l, layer_w *w, int i) {
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, D = c->head_dim, Hq = c->num_attention_heads, Hkv = c->num_key_value_heads;
    const int64_t QD = Hq * D, KD = Hkv * D;
    const int perm = c->rotary_dim != D;
    if (c->attn_output_gate) { /* q_proj: per head, D query rows then D gate rows */
        want_head_rows(l, t, &w->q, Hq, 2 * D, 0, perm, i, "self_attn.q_proj.weight")->mat = 1;
        want_head_rows(l, t, &w->attn_gate, Hq, 2 * D, D, 0, i, "self_attn.q_proj.weight")->mat = 1;
    } else if (perm) {
        want_head_rows(l, t, &w->q, Hq, D, 0, 1, i, "self_attn.q_proj.weight")->mat = 1;
    } else {
        want_layer(l, t, &w->q, 2, QD, H, 0, i, "self_attn.q_proj.weight")->mat = 1;
    }
    if (perm) want_head_rows(l, t, &w->k, Hkv, D, 0, 1, i, "self_attn.k_proj.weight")->mat = 1;
    else want_layer(l, t, &w->k, 2, KD, H, 0, i, "self_attn.k_proj.weight")->mat = 1;
    want_layer(l, t, &w->v, 2, KD, H, 0, i, "self_attn.v_proj.weight")->mat = 1;
    want_layer(l, t, &w->o, 2, H, QD, 0, i, "self_attn.o_proj.weight")->mat = 1;
    if (c->qkv_bias) {
        want_layer(l, t, &w->q_bias, 1, QD, 0, 0, i, "self_attn.q_proj.bias");
        want_layer(l, t, &w->k_bias, 1, KD, 0, 0, i, "self_attn.k_proj.bias");
        want_layer(l, t, &w->v_bias, 1, KD, 0, 0, i, "self_attn.v_proj.bias");
    }
    if (c->o_bias) want_layer(l, t, &w->o_bias, 1, H, 0, 0, i, "self_attn.o_proj.bias");
    if (c->gpt_oss) want_layer(l, t, (void **)&w->sinks, 1, Hq, 0, 0, i, "self_attn.sinks")->xf = XF_F32;
    w->window = dfl_model_config_window(c, i);
    if (c->qk_norm) {
        want_norm_perm(l, t, &w->q_norm, perm, i, "self_attn.q_norm.weight");
        want_norm_perm(l, t, &w->k_norm, perm, i, "self_attn.k_norm.weight");
    }
}

/* A Gated DeltaNet layer (Qwen3.5 linear_attn; targets-extraction §3.2).
 * in_proj_b and in_proj_a are loaded as one [2*Hv, H] matrix (b rows, then
 * a rows), so that one GEMM gives both. */
/* Qwen3-Next's in_proj_qkvz [C + VD, H] and in_proj_ba [2*Hv, H] hold, per
 * key head g, q_g, k_g, then its r = Hv/Hk value heads' v rows and z rows
 * (in_proj_ba: their b rows, then a rows; transformers'
 * fix_query_key_value_ordering): one tensor read twice, as Qwen3.5's. */
static void want_fused_linear(wlist *l, const dfl_target *t, void **dst, int part, int64_t rows, int i) {
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, Hk = c->lin_k_heads, Hv = c->lin_v_heads, dk = c->lin_k_dim, dv = c->lin_v_dim;
    const int64_t src_rows = part < 2 ? Hk * (2 * dk) + 2 * Hv * dv : 2 * Hv;
    wspec *w = want_layer(l, t, dst, 2, src_rows, H, 0, i,
                          part < 2 ? "linear_attn.in_proj_qkvz.weight" : "linear_attn.in_proj_ba.weight");
    w->xf = XF_QKVZ;
    w->part = part;
    w->mat = part < 2; /* in_proj_ba's few rows stay wt, with in_proj_b and in_proj_a's */
    w->out_numel = rows * H;
}

static void plan_linear(dfl_target *t, wlist *l, layer_w *w, int i) {
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, Hv = c->lin_v_heads, VD = Hv * c->lin_v_dim;
    const int64_t C = 2 * c->lin_k_heads * c->lin_k_dim + VD;
    if (c->qwen3_next) {
        want_fused_linear(l, t, &w->lin_qkv, 0, C, i);
        want_fused_linear(l, t, &w->lin_z, 1, VD, i);
        want_fused_linear(l, t, &w->lin_ba, 2, 2 * Hv, i);
    } else {
        want_layer(l, t, &w->lin_qkv, 2, C, H, 0, i, "linear_attn.in_proj_qkv.weight")->mat = 1;
        want_layer(l, t, &w->lin_z, 2, VD, H, 0, i, "linear_attn.in_proj_z.weight")->mat = 1;
        want_layer(l, t, &w->lin_ba, 2, Hv, H, 0, i, "linear_attn.in_proj_b.weight");
        want_layer(l, t, &w->lin_ba, 2, Hv, H, 0, i, "linear_attn.in_proj_a.weight")->dst_off = Hv * H;
    }
    want_layer(l, t, &w->lin_conv, 3, C, 1, c->lin_conv, i, "linear_attn.conv1d.weight");
    want_layer(l, t, (void **)&w->dt_bias, 1, Hv, 0, 0, i, "linear_attn.dt_bias")->xf = XF_F32;
    want_layer(l, t, (void **)&w->A_log, 1, Hv, 0, 0, i, "linear_attn.A_log")->xf = XF_F32;
    want_layer(l, t, &w->lin_norm, 1, c->lin_v_dim, 0, 0, i, "linear_attn.norm.weight"); /* plain w */
    want_layer(l, t, &w->lin_out, 2, H, VD, 0, i, "linear_attn.out_proj.weight")->mat = 1;
}

/* A sparse MLP (targets-extraction: Qwen3-MoE, Qwen3.5-MoE). The experts
 * come one tensor each (mlp.experts.E.gate_proj.weight ..., as the
 * released Qwen3-MoE files) or stacked (mlp.experts.gate_up_proj [E, 2*Im,
 * H] and down_proj [E, H, Im], as transformers 5 keeps them); either way
 * they land in one [E, 2*Im, H] and one [E, H, Im] tensor (concatenations,
 * in the order load_all lays them out). */
static void plan_moe(dfl_target *t, wlist *l, layer_w *w, int i) {
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, E = c->num_experts, Im = c->moe_intermediate_size, Is = c->shared_expert_intermediate_size;
    char name[128], suffix[64];
    want_layer(l, t, &w->router, 2, E, H, 0, i, "mlp.gate.weight");
    snprintf(name, sizeof name, "%slayers.%d.mlp.experts.gate_up_proj", c->weight_prefix, i);
    if (dfl_st_find(l->st, name)) {
        want_layer(l, t, &w->exp_gate_up, 3, E, 2 * Im, H, i, "mlp.experts.gate_up_proj")->mat = 1;
        want_layer(l, t, &w->exp_down, 3, E, H, Im, i, "mlp.experts.down_proj")->mat = 1;
    } else {
        for (int64_t e = 0; e < E && !l->rc; e++) {
            snprintf(suffix, sizeof suffix, "mlp.experts.%lld.gate_proj.weight", (long long)e);
            wspec *g = want_layer(l, t, &w->exp_gate_up, 2, Im, H, 0, i, suffix);
            g->dst_off = e * 2 * Im * H, g->mat = 1;
            snprintf(suffix, sizeof suffix, "mlp.experts.%lld.up_proj.weight", (long long)e);
            wspec *u = want_layer(l, t, &w->exp_gate_up, 2, Im, H, 0, i, suffix);
            u->dst_off = (e * 2 + 1) * Im * H, u->mat = 1;
        }
        for (int64_t e = 0; e < E && !l->rc; e++) {
            snprintf(suffix, sizeof suffix, "mlp.experts.%lld.down_proj.weight", (long long)e);
            wspec *d = want_layer(l, t, &w->exp_down, 2, H, Im, 0, i, suffix);
            d->dst_off = e * H * Im, d->mat = 1;
        }
    }
    if (Is) {
        want_layer(l, t, &w->sh_gate, 2, Is, H, 0, i, "mlp.shared_expert.gate_proj.weight")->mat = 1;
        want_layer(l, t, &w->sh_up, 2, Is, H, 0, i, "mlp.shared_expert.up_proj.weight")->mat = 1;
        want_layer(l, t, &w->sh_down, 2, H, Is, 0, i, "mlp.shared_expert.down_proj.weight")->mat = 1;
        want_layer(l, t, &w->sh_mix, 2, 1, H, 0, i, "mlp.shared_expert_gate.weight");
    }
}

/* w as XF_EXPERTS of E experts of [rows, cols] */
static void set_experts(wspec *w, int64_t E, int64_t rows, int64_t cols, int interleave) {
    w->xf = XF_EXPERTS;
    w->heads = E;
    w->rows = rows;
    w->cols = cols;
    w->interleave = interleave;
    w->out_numel = E * rows * cols;
}

/* One of gpt-oss's stacked expert tensors, [E, rows, cols] once loaded:
 * from MXFP4 (NAME_blocks [E, rows, cols/32, 16] and NAME_scales [E, rows,
 * cols/32], the released files) when the file has them, else from the
 * [E, cols, rows] tensor NAME that transformers saves. */
static void want_experts(wlist *l, const dfl_target *t, void **dst, int64_t rows, int64_t cols, int interleave, int i,
                         const char *name) {
    const int64_t E = t->cfg.num_experts;
    char full[192], sfx[64];
    snprintf(sfx, sizeof sfx, "mlp.experts.%s_blocks", name);
    snprintf(full, sizeof full, "%slayers.%d.%s", t->cfg.weight_prefix, i, sfx);
    if (l->rc) return;
    wspec *w;
    const dfl_st_tensor *bl = dfl_st_find(l->st, full), *sc = NULL;
    if (bl) {
        if (cols % 32) {
            l->rc = dfl_err(DFL_EX_DATA, "%s: MXFP4 tensor '%s': its %lld columns are not whole blocks of 32", bl->file,
                            full, (long long)cols);
            return;
        }
        const int64_t bshape[4] = {E, rows, cols / 32, 16}, sshape[4] = {E, rows, cols / 32, 0};
        if ((l->rc = dfl_st_get_u8(l->st, full, 4, bshape, &bl))) return;
        snprintf(full, sizeof full, "%slayers.%d.mlp.experts.%s_scales", t->cfg.weight_prefix, i, name);
        if ((l->rc = dfl_st_get_u8(l->st, full, 3, sshape, &sc))) return;
        w = push_spec(l, dst, full); /* its sources the two U8 tensors */
        w->src = bl;
        w->scales = sc;
        w->mxfp4 = 1;
    } else {
        snprintf(sfx, sizeof sfx, "mlp.experts.%s", name);
        w = want_layer(l, t, dst, 3, E, cols, rows, i, sfx);
        w->transposed = 1;
    }
    set_experts(w, E, rows, cols, interleave);
    w->mat = 1;
}

/* gpt-oss's sparse MLP: a router with a bias, experts with biases, gate
 * and up interleaved (transformers: gate = gate_up[..., ::2], up =
 * gate_up[..., 1::2]), laid out as plan_moe's. */
static void plan_moe_oss(dfl_target *t, wlist *l, layer_w *w, int i) {
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, E = c->num_experts, Im = c->moe_intermediate_size;
    want_layer(l, t, &w->router, 2, E, H, 0, i, "mlp.router.weight");
    want_layer(l, t, &w->router_bias, 1, E, 0, 0, i, "mlp.router.bias");
    want_experts(l, t, &w->exp_gate_up, 2 * Im, H, 1, i, "gate_up_proj");
    want_experts(l, t, &w->exp_down, H, Im, 0, i, "down_proj");
    set_experts(want_layer(l, t, &w->exp_gate_up_bias, 2, E, 2 * Im, 0, i, "mlp.experts.gate_up_proj_bias"), E,
                2 * Im, 1, 1);
    want_layer(l, t, &w->exp_down_bias, 2, E, H, 0, i, "mlp.experts.down_proj_bias");
}

/* The tensors of the model, with the shapes config.json implies. */
static void plan_weights(dfl_target *t, wlist *l) {
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
    char name[128];
    snprintf(name, sizeof name, "%sembed_tokens.weight", c->weight_prefix);
    want(l, &t->embed, 2, V, H, 0, name);
    unsigned char *sparse = dfl_malloc((size_t)t->nlayers);
    dfl_model_config_moe_layers(c, t->nlayers, sparse);
    for (int i = 0; i < t->nlayers && !l->rc; i++) {
        layer_w *w = &t->layers[i];
        w->linear = dfl_model_config_linear_layer(c, i);
        want_layer(l, t, &w->in_norm, 1, H, 0, 0, i, "input_layernorm.weight");
        if (w->linear) plan_linear(t, l, w, i);
        else plan_attention(t, l, w, i);
        want_layer(l, t, &w->post_norm, 1, H, 0, 0, i, "post_attention_layernorm.weight");
        w->moe = sparse[i];
        if (w->moe) {
            if (c->gpt_oss) plan_moe_oss(t, l, w, i);
            else plan_moe(t, l, w, i);
            continue;
        }
        want_layer(l, t, &w->gate, 2, I, H, 0, i, "mlp.gate_proj.weight")->mat = 1;
        want_layer(l, t, &w->up, 2, I, H, 0, i, "mlp.up_proj.weight")->mat = 1;
        want_layer(l, t, &w->down, 2, H, I, 0, i, "mlp.down_proj.weight")->mat = 1;
    }
    free(sparse);
    if (t->head) {
        snprintf(name, sizeof name, "%snorm.weight", c->weight_prefix);
        want(l, &t->final_norm, 1, H, 0, 0, name);
        /* Tied: the LM head is the embedding (HF ties them; a stored
         * lm_head.weight is then ignored, as HF's tie overrides it). The
         * VLM layout keeps lm_head at the top level too. */
        if (!c->tie_word_embeddings) want(l, &t->lm_head, 2, V, H, 0, "lm_head.weight");
    }
}

/* Drop the pages of a mapped tensor we have converted, so the peak resident
 * size is the compute weights plus one tensor, not both copies of the model. */
static void release_pages(const void *p, uint64_t n) {
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0) return;
    uintptr_t a = ((uintptr_t)p + (uintptr_t)pg - 1) & ~((uintptr_t)pg - 1);
    uintptr_t e = ((uintptr_t)p + n) & ~((uintptr_t)pg - 1);
    if (e > a) madvise((void *)a, e - a, MADV_DONTNEED);
}

/* The rotary order of head dim n (see xform): the source dim it holds. */
static int64_t rotary_src_dim(int64_t n, int64_t D, int64_t R) {
    const int64_t r2 = R / 2, h2 = D / 2;
    if (n < r2) return n;                               /* rotated, first of each pair */
    if (n < h2) return R + (n - r2);                    /* passed through, first half */
    if (n < h2 + r2) return r2 + (n - h2);              /* rotated, second of each pair */
    return R + (h2 - r2) + (n - h2 - r2);               /* passed through, second half */
}

/* The source row of an expert's row r of R: gate and up interleaved in the
 * file (gpt-oss) become the gate half, then the up half. */
static int64_t expert_src_row(int64_t r, int64_t R, int interleave) {
    return !interleave ? r : r < R / 2 ? 2 * r : 2 * (r - R / 2) + 1;
}

/* Square tiles of the transposing gather: a tile's rows of o and of src stay
 * in L1 (32 x 32 values of each, up to twice that of src with interleaving),
 * where a whole row of o read src a cache line per element, at a stride of
 * R values. */
#define EXPERT_TILE 32

/* One expert's rows [R, C] from its source: rows reordered (interleave),
 * and with `transposed` read from src [C, R]. The tiles of rows on all
 * threads: a released MoE's experts are gigabytes, and this is load time.
 * A copy of values, so one for each element size: f32 (f32 and f16
 * sources) and bf16 (bf16 and MXFP4 sources, kept in bf16). */
#define DEFINE_EXPERT_ROWS(NAME, T)                                                                          \
    static void NAME(T *o, const T *src, int64_t R, int64_t C, int interleave, int transposed) {             \
        const int64_t nr = (R + EXPERT_TILE - 1) / EXPERT_TILE;                                              \
        if (!transposed) {                                                                                   \
            _Pragma("omp parallel for schedule(static) if (R * C > 1 << 16)")                                \
            for (int64_t r = 0; r < R; r++)                                                                  \
                memcpy(o + r * C, src + expert_src_row(r, R, interleave) * C, (size_t)C * sizeof *o);        \
            return;                                                                                          \
        }                                                                                                    \
        _Pragma("omp parallel for schedule(static) if (R * C > 1 << 16)")                                    \
        for (int64_t rt = 0; rt < nr; rt++) {                                                                \
            const int64_t r0 = rt * EXPERT_TILE, r1 = r0 + EXPERT_TILE < R ? r0 + EXPERT_TILE : R;           \
            for (int64_t k0 = 0; k0 < C; k0 += EXPERT_TILE) {                                                \
                const int64_t k1 = k0 + EXPERT_TILE < C ? k0 + EXPERT_TILE : C;                              \
                for (int64_t r = r0; r < r1; r++) {                                                          \
                    const T *s = src + expert_src_row(r, R, interleave);                                     \
                    for (int64_t k = k0; k < k1; k++) o[r * C + k] = s[k * R];                               \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_EXPERT_ROWS(expert_rows, float)
DEFINE_EXPERT_ROWS(expert_rows_bf16, uint16_t)

/* XF_QKVZ: the source row of row n of Qwen3.5's layout (see plan_linear). */
static int64_t qkvz_row(const dfl_model_config *c, int part, int64_t n) {
    const int64_t Hk = c->lin_k_heads, Hv = c->lin_v_heads, dk = c->lin_k_dim, dv = c->lin_v_dim, r = Hv / Hk;
    const int64_t group = 2 * dk + 2 * r * dv; /* rows of one key head's group in in_proj_qkvz */
    if (part == 2) { /* b of value head j, then a */
        const int64_t j = n < Hv ? n : n - Hv;
        return j / r * 2 * r + (n < Hv ? 0 : r) + j % r;
    }
    if (part == 0 && n < 2 * Hk * dk) { /* q of key head h, then k */
        const int64_t m = n % (Hk * dk);
        return m / dk * group + (n < Hk * dk ? 0 : dk) + m % dk;
    }
    const int64_t m = part == 0 ? n - 2 * Hk * dk : n, j = m / dv; /* row m % dv of value head j's v (or z) */
    return j / r * group + 2 * dk + (part == 0 ? 0 : r * dv) + j % r * dv + m % dv;
}

/* The source row of row r of a reordered tensor: XF_HEAD_ROWS and XF_QKVZ
 * rows of a matrix, XF_NORM_PERM single values. */
static int64_t reordered_src_row(const dfl_target *t, const wspec *w, int64_t r) {
    const int64_t D = t->cfg.head_dim, R = t->cfg.rotary_dim;
    if (w->xf == XF_QKVZ) return qkvz_row(&t->cfg, w->part, r);
    if (w->xf == XF_NORM_PERM) return rotary_src_dim(r, D, R);
    const int64_t d = r % D; /* XF_HEAD_ROWS */
    return r / D * w->stride + w->off + (w->perm ? rotary_src_dim(d, D, R) : d);
}

/* A reordered tensor's w->out_numel values, in the source's dtype: its rows
 * copied as they are (exact, whatever the dtype), on every thread. Nothing
 * is converted here: the backend's load_wt converts them as it does a
 * tensor taken as it is, so a reordered matrix costs one copy of its own
 * size, not an f32 copy of the whole source (Qwen3.5's q_proj, read for
 * its query rows and again for its gate rows) and one of the output. */
static void *reordered(const dfl_target *t, const wspec *w) {
    const dfl_st_tensor *s = w->src;
    const int64_t len = w->xf == XF_NORM_PERM ? 1 : s->shape[1], rows = w->out_numel / len;
    const size_t rb = (size_t)len * dfl_dtype_size((dfl_dtype)s->dtype);
    char *out = dfl_aligned_alloc((size_t)rows * rb);
    const char *src = s->data;
    #pragma omp parallel for schedule(static) if (w->out_numel > 1 << 16)
    for (int64_t r = 0; r < rows; r++) memcpy(out + (size_t)r * rb, src + (size_t)reordered_src_row(t, w, r) * rb, rb);
    return out;
}

/* The dtype of a spec's values in the backend's memory (load_all lays them
 * out): f32 parameters f32, matrices mat_dtype's, the rest (norms, biases,
 * the embedding) the backend's wt. */
static dfl_dtype dst_dtype(const dfl_target *t, const wspec *w) {
    if (w->xf == XF_F32) return DFL_F32;
    if (w->mat) return t->mat_dt;
    return t->ops->wt_bytes == 2 ? DFL_BF16 : DFL_F32;
}

/* Matrices kept in bf16 by a backend computing in f32 (the CPU: see
 * mat_dtype): their bf16 values as they are. */
static int raw_bf16(const dfl_target *t, const wspec *w) {
    return dst_dtype(t, w) == DFL_BF16 && t->ops->wt_bytes != 2;
}

/* n values of dtype dt at src (the file's mapping or a reordered copy)
 * into dst. */
static void load_values(dfl_target *t, const wspec *w, void *dst, const void *src, dfl_dtype dt, int64_t n) {
    if (raw_bf16(t, w)) { /* bf16 in the file (mat_dtype) */
        t->ops->upload(dst, src, (size_t)n * 2);
        t->ops->sync();
        return;
    }
    size_t esz = dfl_dtype_size(dt);
    void *tmp = NULL;
    if ((uintptr_t)src % esz) { /* files from other writers may be unaligned */
        tmp = dfl_aligned_alloc((size_t)n * esz);
        memcpy(tmp, src, (size_t)n * esz);
        src = tmp;
    }
    t->ops->load_wt(dst, src, dt, n);
    if (tmp) t->ops->sync(); /* tmp is freed next */
    free(tmp);
}

/* `len` values of an expert's source from element `off`, in f32: MXFP4
 * decoded (beside f32 matrices: mat_dtype), the others widened. */
static void expert_src_f32(const wspec *w, int64_t off, int64_t len, float *f) {
    if (w->mxfp4)
        dfl_mxfp4_to_f32((const uint8_t *)w->src->data + off / 2, (const uint8_t *)w->scales->data + off / 32,
                         len / 32, f);
    else
        dfl_st_range_to_f32(w->src, off, len, f);
}

/* The same in bf16 (w16 a buffer of len values): MXFP4 decoded, bf16 as it
 * is (copied where the file leaves it unaligned, else read in place). */
static const uint16_t *expert_src_bf16(const wspec *w, int64_t off, int64_t len, uint16_t *w16) {
    if (w->mxfp4) {
        dfl_mxfp4_to_bf16((const uint8_t *)w->src->data + off / 2, (const uint8_t *)w->scales->data + off / 32,
                          len / 32, w16);
        return w16;
    }
    const char *p = (const char *)w->src->data + (size_t)off * 2;
    if ((uintptr_t)p % 2 == 0) return (const uint16_t *)p;
    memcpy(w16, p, (size_t)len * 2);
    return w16;
}

/* XF_EXPERTS into place one expert at a time: its source, its rows
 * reordered (expert_rows), then loaded into its slot of dst. Where the
 * backend keeps them in bf16 (mat_dtype: the CPU's bf16 matrices, or the
 * GPU; the experts' biases are wt) and the file holds bf16 or MXFP4, all
 * of it is in bf16, which holds those values exactly; else in f32. What
 * the load holds beside the weights is one expert, not the whole stack
 * twice over (gpt-oss-120b: a layer's gate_up, 128 x 5760 x 2880, is 8.5
 * GB in f32), and the buffers are the same ones for every expert, so their
 * pages are faulted in once. */
static void load_experts(dfl_target *t, const wspec *w, void *dst) {
    const int64_t E = w->heads, R = w->rows, C = w->cols, n = R * C;
    const int in_bf16 = dst_dtype(t, w) == DFL_BF16 && (w->mxfp4 || w->src->dtype == DFL_BF16);
    const size_t esz = dfl_dtype_size(dst_dtype(t, w));
    void *src = dfl_malloc((size_t)n * (in_bf16 ? 2 : 4)), *o = dfl_malloc((size_t)n * (in_bf16 ? 2 : 4));
    for (int64_t e = 0; e < E; e++) {
        void *at = (char *)dst + (size_t)(e * n) * esz;
        if (in_bf16) {
            expert_rows_bf16(o, expert_src_bf16(w, e * n, n, src), R, C, w->interleave, w->transposed);
            load_values(t, w, at, o, DFL_BF16, n);
        } else {
            expert_src_f32(w, e * n, n, src);
            expert_rows(o, src, R, C, w->interleave, w->transposed);
            load_values(t, w, at, o, DFL_F32, n);
        }
        t->ops->sync(); /* o is reused next */
    }
    free(src);
    free(o);
}

static void load_one(dfl_target *t, const wspec *w, void *dst) {
    const dfl_st_tensor *s = w->src;
    if (w->xf == XF_EXPERTS) {
        load_experts(t, w, dst);
    } else if (w->xf == XF_F32) {
        float *f = dfl_malloc((size_t)s->numel * sizeof *f);
        dfl_st_to_f32(s, f);
        t->ops->upload(dst, f, (size_t)s->numel * sizeof *f);
        t->ops->sync(); /* f is freed next */
        free(f);
    } else if (w->xf != XF_NONE) {
        void *r = reordered(t, w);
        load_values(t, w, dst, r, (dfl_dtype)s->dtype, w->out_numel);
        t->ops->sync(); /* r is freed next */
        free(r);
    } else {
        load_values(t, w, dst, s->data, (dfl_dtype)s->dtype, s->numel);
    }
    release_pages(s->data, s->nbytes);
    if (w->scales) release_pages(w->scales->data, w->scales->nbytes);
}

static int check_arch(const dfl_model_config *c, const char *path) {
    static const char *archs[] = {"Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                  "Qwen3_5ForCausalLM",
                                  "Qwen3_5ForConditionalGeneration", "Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM",
                                  "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "GptOssForCausalLM"};
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (!strcmp(c->architecture, archs[i])) return 0;
    return dfl_err(DFL_EX_DATA, "%s: architecture \"%s\" is not a supported target (Qwen3ForCausalLM, LlamaForCausalLM, "
                   "MistralForCausalLM, Qwen2ForCausalLM, "
                   "Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM, "
                   "Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, GptOssForCausalLM)", path, c->architecture);
}

/* num_hidden_layers must be the weights' layer count even when only the
 * first layers are loaded (extraction stops after the deepest tap): it goes
 * into the stream header and the default layer ids. */
static int check_layer_count(const dfl_st *st, const dfl_model_config *c, const char *path) {
    char name[128];
    int L = (int)c->num_hidden_layers;
    snprintf(name, sizeof name, "%slayers.%d.input_layernorm.weight", c->weight_prefix, L - 1);
    if (!dfl_st_find(st, name))
        return dfl_err(DFL_EX_DATA, "%s: \"num_hidden_layers\" is %d, but the weights have no %s", path, L, name);
    snprintf(name, sizeof name, "%slayers.%d.input_layernorm.weight", c->weight_prefix, L);
    if (dfl_st_find(st, name))
        return dfl_err(DFL_EX_DATA, "%s: \"num_hidden_layers\" is %d, but the weights have %s", path, L, name);
    return 0;
}

/* The dtype of the layers' projection matrices and experts (wspec mat):
 * the backend's wt, except where that is f32 (the CPU) and every one of
 * them holds bf16 values (bf16 or MXFP4 in the file, as released
 * checkpoints are): then bf16, which is exact and halves what they take.
 * They are nearly all of a model: Qwen3-8B 6.9 of its 8.2 G weights (the
 * rest: the embedding and the LM head, shared with a drafter, which stay
 * wt), Qwen3-30B-A3B 29.9 of 30.5 G. dfl_target_matmul widens them for each
 * product. */
static dfl_dtype mat_dtype(const dfl_ops *ops, const wlist *l) {
    if (ops->wt_bytes == 2) return DFL_BF16;
    for (int i = 0; i < l->n; i++)
        if (l->v[i].mat && !l->v[i].mxfp4 && l->v[i].src->dtype != DFL_BF16) return DFL_F32;
    return DFL_BF16;
}

/* Place every tensor: compute weights in one backend allocation, the
 * matrices in another, the f32 parameters in a third; then convert each
 * into place. */
static void load_all(dfl_target *t, wlist *l) {
    const dfl_ops *ops = t->ops;
    uint64_t nwt = 0, nmat = 0, nf32 = 0;
    for (int i = 0; i < l->n; i++) {
        wspec *w = &l->v[i];
        if (!w->out_numel) w->out_numel = w->src->numel;
        if (w->xf == XF_F32) nf32 += (uint64_t)w->out_numel;
        else if (w->mat) nmat += (uint64_t)w->out_numel;
        else nwt += (uint64_t)w->out_numel;
    }
    t->mat_dt = mat_dtype(ops, l);
    const uint64_t xb = dfl_dtype_size(t->mat_dt);
    t->weight_bytes = nwt * (uint64_t)ops->wt_bytes + nmat * xb + nf32 * sizeof(float);
    t->weights = ops->alloc(nwt * (uint64_t)ops->wt_bytes);
    t->mats = nmat ? ops->alloc(nmat * xb) : NULL;
    t->params_f32 = nf32 ? ops->alloc(nf32 * sizeof(float)) : NULL;
    uint64_t off = 0, offx = 0, off32 = 0;
    for (int i = 0; i < l->n; i++) {
        wspec *w = &l->v[i];
        void *at;
        const uint64_t esz = dfl_dtype_size(dst_dtype(t, w));
        if (w->xf == XF_F32) {
            at = (float *)t->params_f32 + off32;
            off32 += (uint64_t)w->out_numel;
        } else if (w->mat) {
            at = (char *)t->mats + offx * xb;
            offx += (uint64_t)w->out_numel;
        } else {
            at = DFL_WAT(ops, t->weights, off);
            off += (uint64_t)w->out_numel;
        }
        if (!w->dst_off) *w->dst = at; /* a concatenation's later parts follow its first in memory */
        else DFL_ASSERT(at == (char *)*w->dst + (uint64_t)w->dst_off * esz);
        load_one(t, w, at);
    }
}

int dfl_target_load(dfl_target **out, const char *dir, const dfl_ops *ops, const dfl_target_opts *opts) {
    *out = NULL;
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return dfl_err(DFL_EX_NOINPUT, "%s: path too long", dir);
    dfl_target *t = dfl_calloc(1, sizeof *t);
    t->ops = ops;
    int rc = dfl_model_config_load(&t->cfg, path, "target");
    if (!rc) rc = check_arch(&t->cfg, path);
    if (rc) {
        dfl_target_free(t);
        return rc;
    }
    int L = (int)t->cfg.num_hidden_layers;
    t->nlayers = opts && opts->nlayers > 0 && opts->nlayers < L ? opts->nlayers : L;
    t->head = opts ? opts->head : 0;
    t->layers = dfl_calloc((size_t)t->nlayers, sizeof *t->layers);

    dfl_st *st = NULL;
    if ((rc = dfl_st_open_dir(&st, dir))) {
        dfl_target_free(t);
        return rc;
    }
    if ((rc = check_layer_count(st, &t->cfg, path))) {
        dfl_st_close(st);
        dfl_target_free(t);
        return rc;
    }
    wlist l = {.st = st};
    /* Every name and shape is checked before anything large is allocated. */
    plan_weights(t, &l);
    rc = l.rc;
    if (!rc) {
        load_all(t, &l);
        if (t->head && t->cfg.tie_word_embeddings) t->lm_head = t->embed;
        int64_t half = t->cfg.head_dim / 2;
        float *f = dfl_malloc((size_t)half * sizeof *f);
        dfl_rope_inv_freq(&t->cfg, f);
        t->inv_freq = ops->alloc((size_t)half * sizeof *f);
        ops->upload(t->inv_freq, f, (size_t)half * sizeof *f);
        ops->sync();
        free(f);
    }
    free(l.v);
    dfl_st_close(st);
    if (rc) {
        dfl_target_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

static void ws_free(const dfl_ops *ops, workspace *w) {
    void *bufs[] = {w->x, w->h, w->q, w->k, w->v, w->ao, w->taps, w->ids, w->pos, w->cu, w->lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(bufs[i]);
    dfl_target_head_free(ops, &w->head);
    dfl_target_lin_free(ops, &w->lin);
    dfl_target_mlp_free(ops, &w->mlp);
    free(w->host_pos);
    memset(w, 0, sizeof *w);
}

void dfl_target_free(dfl_target *t) {
    if (!t) return;
    if (t->ops) {
        ws_free(t->ops, &t->ws);
        if (t->weights) t->ops->free(t->weights);
        if (t->mats) t->ops->free(t->mats);
        if (t->params_f32) t->ops->free(t->params_f32);
        if (t->inv_freq) t->ops->free(t->inv_freq);
    }
    free(t->layers);
    dfl_model_config_free(&t->cfg);
    free(t);
}

/* ---- workspace ---------------------------------------------------------- */

void *dfl_target_regrow(const dfl_ops *ops, void *old, size_t bytes) {
    if (old) ops->free(old);
    return ops->alloc(bytes ? bytes : 1);
}

void dfl_target_head_reserve(const dfl_target *t, head_ws *hw, int64_t nrows) {
    const dfl_ops *ops = t->ops;
    const int64_t H = t->cfg.hidden_size;
    if (nrows <= hw->cap_rows) return;
    hw->sel = dfl_target_regrow(ops, hw->sel, (size_t)(nrows * H) * (size_t)ops->act_bytes);
    hw->normed = dfl_target_regrow(ops, hw->normed, (size_t)(nrows * H) * (size_t)ops->act_bytes);
    hw->pred = dfl_target_regrow(ops, hw->pred, (size_t)nrows * sizeof(int32_t));
    hw->gap = dfl_target_regrow(ops, hw->gap, (size_t)nrows * sizeof(float));
    hw->cap_rows = nrows;
}

void dfl_target_head_free(const dfl_ops *ops, head_ws *hw) {
    void *bufs[] = {hw->sel, hw->normed, hw->pred, hw->gap};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(bufs[i]);
    memset(hw, 0, sizeof *hw);
}

void dfl_target_lin_reserve(const dfl_target *t, lin_ws *lw, int64_t n) {
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    if (!c->hybrid || n <= lw->cap_rows) return;
    const size_t a = (size_t)ops->act_bytes;
    const int64_t VD = c->lin_v_heads * c->lin_v_dim, C = 2 * c->lin_k_heads * c->lin_k_dim + VD;
    lw->raw = dfl_target_regrow(ops, lw->raw, (size_t)(n * C) * a);
    lw->conv = dfl_target_regrow(ops, lw->conv, (size_t)(n * C) * a);
    lw->z = dfl_target_regrow(ops, lw->z, (size_t)(n * VD) * a);
    lw->o = dfl_target_regrow(ops, lw->o, (size_t)(n * VD) * a);
    lw->y = dfl_target_regrow(ops, lw->y, (size_t)(n * VD) * a);
    lw->ba = dfl_target_regrow(ops, lw->ba, (size_t)(n * 2 * c->lin_v_heads) * a);
    lw->agate = dfl_target_regrow(ops, lw->agate, (size_t)(n * c->num_attention_heads * c->head_dim) * a);
    lw->cap_rows = n;
}

void dfl_target_lin_free(const dfl_ops *ops, lin_ws *lw) {
    void *bufs[] = {lw->raw, lw->conv, lw->z, lw->o, lw->y, lw->ba, lw->agate};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(bufs[i]);
    memset(lw, 0, sizeof *lw);
}

static void ws_reserve(dfl_target *t, int64_t T, int64_t ntap_elems, int64_t nrows, int64_t nseq) {
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    workspace *w = &t->ws;
    size_t a = (size_t)ops->act_bytes;
    int64_t H = c->hidden_size, D = c->head_dim;
    int64_t QD = c->num_attention_heads * D, KD = c->num_key_value_heads * D;
    if (T > w->cap_T) {
        w->x = dfl_target_regrow(ops, w->x, (size_t)(T * H) * a);
        w->h = dfl_target_regrow(ops, w->h, (size_t)(T * H) * a);
        w->q = dfl_target_regrow(ops, w->q, (size_t)(T * QD) * a);
        w->k = dfl_target_regrow(ops, w->k, (size_t)(T * KD) * a);
        w->v = dfl_target_regrow(ops, w->v, (size_t)(T * KD) * a);
        /* ao holds the raw q (and k) projections before their norms, then
         * the attention output: at least as large as either. */
        w->ao = dfl_target_regrow(ops, w->ao, (size_t)(T * (QD > KD ? QD : KD)) * a);
        dfl_target_mlp_reserve(t, &w->mlp, T);
        w->ids = dfl_target_regrow(ops, w->ids, (size_t)T * sizeof(int32_t));
        w->pos = dfl_target_regrow(ops, w->pos, (size_t)T * sizeof(int32_t));
        free(w->host_pos);
        w->host_pos = dfl_malloc((size_t)T * sizeof(int32_t));
        if (c->gpt_oss) w->lse = dfl_target_regrow(ops, w->lse, (size_t)(T * c->num_attention_heads) * sizeof(float));
        w->cap_T = T;
    }
    if (ntap_elems > w->cap_taps) {
        w->taps = dfl_target_regrow(ops, w->taps, (size_t)ntap_elems * a);
        w->cap_taps = ntap_elems;
    }
    dfl_target_head_reserve(t, &w->head, nrows);
    dfl_target_lin_reserve(t, &w->lin, T);
    if (nseq > w->cap_seq) {
        w->cu = dfl_target_regrow(ops, w->cu, (size_t)(nseq + 1) * sizeof(int32_t));
        w->cap_seq = nseq;
    }
}

/* ---- forward ------------------------------------------------------------ */

static int check_batch(const dfl_target *t, const dfl_target_batch *b, int64_t *T) {
    if (b->nseq < 1 || b->nseq > INT32_MAX) return dfl_err(DFL_EX_DATA, "target: a batch needs 1 or more sequences");
    if (b->cu[0] != 0) return dfl_err(DFL_EX_DATA, "target: batch offsets must start at 0");
    for (int64_t s = 0; s < b->nseq; s++)
        if (b->cu[s + 1] <= b->cu[s]) return dfl_err(DFL_EX_DATA, "target: sequence %lld of the batch is empty", (long long)s);
    *T = b->cu[b->nseq];
    int64_t V = t->cfg.vocab_size;
    for (int64_t i = 0; i < *T; i++)
        if (b->ids[i] < 0 || b->ids[i] >= V)
            return dfl_err(DFL_EX_DATA, "target: token id %d at row %lld is outside the vocabulary [0, %lld)",
                           (int)b->ids[i], (long long)i, (long long)V);
    return 0;
}

/* Check the request; *need = the number of layers it runs. */
int dfl_target_check_sampling(const dfl_target_want *w) {
    if (!(w->temperature >= 0) || isinf(w->temperature) || (w->temperature > 0 && isinf(1.0f / w->temperature)))
        return dfl_err(DFL_EX_USAGE, "target: temperature %g is not 0 or a finite number whose inverse is finite",
                       (double)w->temperature);
    if (w->temperature > 0 && (!w->argmax || !w->sample_keys))
        return dfl_err(DFL_EX_USAGE, "target: sampling at a temperature needs argmax and a key per row");
    if (w->top_k < 0 || !(w->top_p >= 0 && w->top_p <= 1) || ((w->top_k || w->top_p) && !(w->temperature > 0)))
        return dfl_err(DFL_EX_USAGE, "target: top_k %d, top_p %g: need top_k >= 0, top_p in [0, 1] and a temperature",
                       (int)w->top_k, (double)w->top_p);
    return 0;
}

static int check_want(const dfl_target *t, const dfl_target_want *w, int64_t T, int *need) {
    int L = (int)t->cfg.num_hidden_layers;
    *need = 0;
    if (w->ntaps < 0 || w->ntaps > 64) return dfl_err(DFL_EX_USAGE, "target: %d taps requested (at most 64)", w->ntaps);
    for (int j = 0; j < w->ntaps; j++) {
        if (w->taps[j] < 0 || w->taps[j] >= L)
            return dfl_err(DFL_EX_USAGE, "layer id %d is outside [0, %d) for this %d-layer model", w->taps[j], L, L);
        if (w->taps[j] + 1 > *need) *need = w->taps[j] + 1;
    }
    if (w->last_hidden || w->normed || w->argmax) *need = L;
    if (*need > t->nlayers)
        return dfl_err(DFL_EX_USAGE, "target: layer %d requested but only %d layers were loaded", *need - 1, t->nlayers);
    if ((w->normed || w->argmax) && !t->head)
        return dfl_err(DFL_EX_USAGE, "target: the final norm and LM head were not loaded");
    if (w->rows) {
        if (w->nrows < 0 || w->nrows > INT32_MAX) return dfl_err(DFL_EX_USAGE, "target: bad row count");
        for (int64_t i = 0; i < w->nrows; i++)
            if (w->rows[i] < 0 || w->rows[i] >= T)
                return dfl_err(DFL_EX_USAGE, "target: row %d is outside the batch of %lld rows", (int)w->rows[i], (long long)T);
    }
    return dfl_target_check_sampling(w);
}

void dfl_target_norm(const dfl_target *t, void *out, const void *in, const void *w, int64_t rows, int64_t dim) {
    const float eps = (float)t->cfg.rms_norm_eps;
    if (t->cfg.norm_plus_one) t->ops->rmsnorm1p(out, in, w, rows, dim, eps);
    else t->ops->rmsnorm(out, NULL, in, w, rows, dim, eps);
}

/* On the CPU the matrices may be bf16 (mat_dtype): then a one-group
 * matmul_grouped, which takes their dtype, with the bits of the matmul op
 * on f32 weights of the same values (but at one row: no bf16 sgemv). */
void dfl_target_matmul(const dfl_target *t, void *out, const void *in, const void *w, int64_t M, int64_t K, int64_t N,
                       int accumulate) {
    const dfl_ops *ops = t->ops;
    if (dfl_dtype_size(t->mat_dt) == (size_t)ops->wt_bytes) {
        ops->matmul(out, in, w, M, K, N, accumulate);
    } else {
        const int64_t rows[2] = {0, M};
        ops->matmul_grouped(out, in, w, t->mat_dt, rows, 1, 0, K, N, accumulate);
    }
}

void dfl_target_proj(const dfl_target *t, void *out, const void *in, const void *w, const void *bias, int64_t T,
                     int64_t K, int64_t N) {
    dfl_target_matmul(t, out, in, w, T, K, N, 0);
    if (bias) t->ops->add_bias(out, bias, T, N);
}

void dfl_target_qk_rope(const dfl_target *t, void *out, const void *in, const void *norm_w, const int32_t *pos,
                        int64_t T, int64_t nh) {
    const dfl_model_config *c = &t->cfg;
    if (c->qk_norm) {
        t->ops->qk_norm_rope(out, NULL, in, norm_w, c->norm_plus_one, pos, t->inv_freq, dfl_rope_scale(c), T, nh,
                             c->head_dim,
                             (float)c->rms_norm_eps);
    } else {
        DFL_ASSERT(out == in);
        t->ops->rope(out, pos, t->inv_freq, dfl_rope_scale(c), T, nh, c->head_dim, 0);
    }
}

/* The Gated DeltaNet mixer (transformers Qwen3_5GatedDeltaNet):
 *   raw = h Wqkv^T; q|k|v = silu(causal depthwise conv(raw)) per sequence
 *   z = h Wz^T; b|a = h Wba^T
 *   o = gated delta rule (q, k, v, b, a)             (ops.h gated_delta)
 *   o = RMSNorm_w(o) per value head * silu(z)      (norm before gate, plain w)
 *   x += o Wout^T */
void dfl_target_linear_attn(const dfl_target *t, const layer_w *lw, lin_ws *ws, void *x, const void *h,
                            const int32_t *cu, int64_t nseq, int64_t n, const void *hist, float *state, float *steps) {
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, Hk = c->lin_k_heads, Hv = c->lin_v_heads, dk = c->lin_k_dim, dv = c->lin_v_dim;
    const int64_t VD = Hv * dv, C = 2 * Hk * dk + VD;
    dfl_target_matmul(t, ws->raw, h, lw->lin_qkv, n, H, C, 0);
    ops->conv1d_silu(ws->conv, ws->raw, hist, lw->lin_conv, cu, nseq, n, C, c->lin_conv);
    dfl_target_matmul(t, ws->z, h, lw->lin_z, n, H, VD, 0);
    ops->matmul(ws->ba, h, lw->lin_ba, n, H, 2 * Hv, 0);
    ops->gated_delta(ws->o, state, steps, ws->conv, ws->ba, lw->A_log, lw->dt_bias, cu, nseq, n, Hk, Hv, dk, dv);
    ops->rmsnorm(ws->y, NULL, ws->o, lw->lin_norm, n * Hv, dv, (float)c->rms_norm_eps);
    ops->swiglu(ws->y, ws->z, ws->y, n * VD);                /* silu(z) * normed */
    dfl_target_matmul(t, x, ws->y, lw->lin_out, n, VD, H, 1); /* x += o Wout^T */
}

static void layer_forward(dfl_target *t, const layer_w *lw, int64_t T, int64_t nseq) {
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    workspace *w = &t->ws;
    int64_t H = c->hidden_size, D = c->head_dim;
    int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads;

    dfl_target_norm(t, w->h, w->x, lw->in_norm, T, H);
    if (lw->linear) {
        dfl_target_linear_attn(t, lw, &w->lin, w->x, w->h, w->cu, nseq, T, NULL, NULL, NULL);
    } else {
        /* with q/k norms: project into ao, then norm + rotate each head into q / k */
        void *qsrc = c->qk_norm ? w->ao : w->q, *ksrc = c->qk_norm ? w->ao : w->k;
        dfl_target_proj(t, qsrc, w->h, lw->q, lw->q_bias, T, H, Hq * D);
        dfl_target_qk_rope(t, w->q, qsrc, lw->q_norm, w->pos, T, Hq);
        dfl_target_proj(t, ksrc, w->h, lw->k, lw->k_bias, T, H, Hkv * D);
        dfl_target_qk_rope(t, w->k, ksrc, lw->k_norm, w->pos, T, Hkv);
        dfl_target_proj(t, w->v, w->h, lw->v, lw->v_bias, T, H, Hkv * D);
        /* a sliding layer's window (0: none); gpt-oss: the lse for its sinks */
        ops->attn_causal(w->ao, lw->sinks ? w->lse : NULL, w->q, w->k, w->v, w->cu, nseq, T, Hq, Hkv, D, lw->window);
        if (lw->sinks) ops->attn_sinks(w->ao, w->lse, lw->sinks, T, Hq, D);
        if (lw->attn_gate) { /* Qwen3.5: attn * sigmoid(h Wgate^T) */
            dfl_target_matmul(t, w->lin.agate, w->h, lw->attn_gate, T, H, Hq * D, 0);
            ops->sigmoid_mul(w->ao, w->ao, w->lin.agate, T * Hq * D);
        }
        dfl_target_matmul(t, w->x, w->ao, lw->o, T, Hq * D, H, 1); /* x += attn Wo^T */
        if (lw->o_bias) ops->add_bias(w->x, lw->o_bias, T, H);
    }

    dfl_target_norm(t, w->h, w->x, lw->post_norm, T, H);
    dfl_target_mlp(t, lw, &w->mlp, w->x, w->h, T);
}

int64_t dfl_target_moe_rows(const dfl_model_config *c) {
    return c->experts_per_tok > 0 && MOE_PAIRS / c->experts_per_tok > 0 ? MOE_PAIRS / c->experts_per_tok : 1;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

void dfl_target_mlp_reserve(const dfl_target *t, mlp_ws *mw, int64_t n) {
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t E = c->num_experts, sparse = E ? dfl_target_moe_rows(c) : 0;
    const int64_t rows = min64(n, E ? sparse : MLP_ROWS);
    /* the rows of the longer chunk: a model's dense layers (MLP_ROWS a
     * chunk) may have longer chunks than its sparse ones (k > 16) */
    const int64_t need = min64(n, sparse > MLP_ROWS ? sparse : MLP_ROWS);
    if (need <= mw->cap_n) return;
    const size_t a = (size_t)ops->act_bytes;
    int any_dense = 0; /* a MoE model's intermediate_size may name no layer's width */
    for (int i = 0; i < t->nlayers; i++) any_dense |= !t->layers[i].moe;
    const int64_t H = c->hidden_size, k = c->experts_per_tok;
    const int64_t dense = any_dense ? min64(n, MLP_ROWS) * c->intermediate_size : 0;
    /* a sparse chunk's rows * k pairs through the experts at once, its rows
     * through the shared expert; a dense chunk's rows */
    int64_t scratch = E ? rows * k * c->moe_intermediate_size : 0;
    if (rows * c->shared_expert_intermediate_size > scratch) scratch = rows * c->shared_expert_intermediate_size;
    if (dense > scratch) scratch = dense;
    mw->gate = dfl_target_regrow(ops, mw->gate, (size_t)scratch * a);
    mw->up = dfl_target_regrow(ops, mw->up, (size_t)scratch * a);
    if (E) {
        mw->logits = dfl_target_regrow(ops, mw->logits, (size_t)(rows * E) * a);
        mw->rows = dfl_target_regrow(ops, mw->rows, (size_t)(rows * k) * sizeof(int32_t));
        mw->pos = dfl_target_regrow(ops, mw->pos, (size_t)(rows * k) * sizeof(int32_t));
        mw->wts = dfl_target_regrow(ops, mw->wts, (size_t)(rows * k) * sizeof(float));
        mw->xs = dfl_target_regrow(ops, mw->xs, (size_t)(rows * k * H) * a);
        mw->ys = dfl_target_regrow(ops, mw->ys, (size_t)(rows * k * H) * a);
        if (c->shared_expert_intermediate_size) {
            mw->shared = dfl_target_regrow(ops, mw->shared, (size_t)(rows * H) * a);
            mw->mix = dfl_target_regrow(ops, mw->mix, (size_t)rows * a);
        }
        if (!mw->offsets) mw->offsets = dfl_malloc((size_t)(E + 1) * sizeof *mw->offsets);
    }
    mw->cap_n = need;
}

void dfl_target_mlp_free(const dfl_ops *ops, mlp_ws *mw) {
    void *bufs[] = {mw->gate, mw->up, mw->logits, mw->rows, mw->pos, mw->wts, mw->xs, mw->ys, mw->shared, mw->mix};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) ops->free(bufs[i]);
    free(mw->offsets);
    memset(mw, 0, sizeof *mw);
}

/* out[m, H] (+)= down · (silu(h gate^T) * (h up^T)): a SwiGLU MLP of width
 * I on m rows (gate, up: act [m, I] scratch). */
static void swiglu_mlp(const dfl_target *t, void *out, int accumulate, const void *h, const void *wg, const void *wu,
                       const void *wd, void *gate, void *up, int64_t m, int64_t H, int64_t I) {
    dfl_target_matmul(t, gate, h, wg, m, H, I, 0);
    dfl_target_matmul(t, up, h, wu, m, H, I, 0);
    t->ops->swiglu(gate, gate, up, m * I); /* elementwise, in place */
    dfl_target_matmul(t, out, gate, wd, m, I, H, accumulate);
}

/* y[r, :N] += bias_e for the rows r of each expert e (listed by expert,
 * offsets on the host); expert e's bias is the wt vector at e * stride. */
static void expert_bias(const dfl_ops *ops, void *y, const void *bias, const int64_t *offsets, int64_t E, int64_t stride,
                        int64_t N) {
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = offsets[e], n = offsets[e + 1] - r0;
        if (n > 0) ops->add_bias(DFL_AT(ops, y, r0 * N), DFL_WAT(ops, bias, e * stride), n, N);
    }
}

/* x[m, H] += the mixture of experts of h[m, H] (m <= moe rows): route, list
 * each expert's rows together, run the experts on their rows (each product
 * one grouped call for all experts: on CUDA one cuBLAS grouped GEMM instead
 * of a launch per expert), then add each token's k outputs by their
 * weights (and the gated shared expert). */
static void moe_mlp(const dfl_target *t, const layer_w *lw, mlp_ws *mw, void *x, const void *h, int64_t m) {
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size, E = c->num_experts, k = c->experts_per_tok, Im = c->moe_intermediate_size;
    const int64_t Is = c->shared_expert_intermediate_size;
    ops->matmul(mw->logits, h, lw->router, m, H, E, 0);
    if (lw->router_bias) ops->add_bias(mw->logits, lw->router_bias, m, E);
    ops->moe_route(mw->offsets, mw->rows, mw->pos, mw->wts, mw->logits, m, E, k, c->norm_topk_prob);
    ops->gather_rows(mw->xs, h, mw->rows, m * k, H);
    const int64_t n = m * k, gu = 2 * Im * H; /* listed pairs; an expert's gate and up rows in exp_gate_up */
    const dfl_dtype xdt = t->mat_dt;
    const void *up = (const char *)lw->exp_gate_up + (size_t)(Im * H) * dfl_dtype_size(xdt);
    ops->matmul_grouped(mw->gate, mw->xs, lw->exp_gate_up, xdt, mw->offsets, E, gu, H, Im, 0);
    ops->matmul_grouped(mw->up, mw->xs, up, xdt, mw->offsets, E, gu, H, Im, 0);
    if (c->gpt_oss) {
        expert_bias(ops, mw->gate, lw->exp_gate_up_bias, mw->offsets, E, 2 * Im, Im);
        expert_bias(ops, mw->up, DFL_WAT(ops, lw->exp_gate_up_bias, Im), mw->offsets, E, 2 * Im, Im);
        ops->swiglu_oss(mw->gate, mw->gate, mw->up, n * Im, (float)c->swiglu_alpha, (float)c->swiglu_limit);
    } else {
        ops->swiglu(mw->gate, mw->gate, mw->up, n * Im);
    }
    ops->matmul_grouped(mw->ys, mw->gate, lw->exp_down, xdt, mw->offsets, E, H * Im, Im, H, 0);
    if (c->gpt_oss) expert_bias(ops, mw->ys, lw->exp_down_bias, mw->offsets, E, H, H);
    if (Is) {
        swiglu_mlp(t, mw->shared, 0, h, lw->sh_gate, lw->sh_up, lw->sh_down, mw->gate, mw->up, m, H, Is);
        ops->matmul(mw->mix, h, lw->sh_mix, m, H, 1, 0);
    }
    ops->moe_combine(x, mw->ys, mw->pos, mw->wts, Is ? mw->shared : NULL, Is ? mw->mix : NULL, m, k, H);
}

/* The MLP is row-wise: it runs in chunks so its buffers stay bounded
 * however long a sequence is. */
void dfl_target_mlp(const dfl_target *t, const layer_w *lw, mlp_ws *mw, void *x, const void *h, int64_t n) {
    const dfl_ops *ops = t->ops;
    const int64_t H = t->cfg.hidden_size, I = t->cfg.intermediate_size;
    const int64_t chunk = lw->moe ? dfl_target_moe_rows(&t->cfg) : MLP_ROWS;
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
        int64_t m = min64(n - r0, chunk);
        void *xr = DFL_AT(ops, x, r0 * H);
        const void *hr = DFL_AT(ops, h, r0 * H);
        if (lw->moe) moe_mlp(t, lw, mw, xr, hr, m);
        else swiglu_mlp(t, xr, 1, hr, lw->gate, lw->up, lw->down, mw->gate, mw->up, m, H, I); /* x += mlp */
    }
}

/* The head of a forward (both paths, through dfl_target_finish): of
 * the last layer's output x, the wanted rows (gathered into sel, runs of
 * consecutive rows in one copy) through model.norm into normed, then the LM
 * head's argmax and gap; fills out's normed/argmax/gap. */
static void target_head(dfl_target *t, dfl_target_out *out, head_ws *hw, const void *x, const dfl_target_want *w,
                        int64_t nrows) {
    void *sel = hw->sel, *normed = hw->normed;
    int32_t *pred = hw->pred;
    float *gap = hw->gap;
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    const int64_t H = c->hidden_size;
    const void *in = x;
    if (w->rows) {
        for (int64_t i = 0; i < nrows;) {
            int64_t j = i + 1;
            while (j < nrows && w->rows[j] == w->rows[j - 1] + 1) j++;
            ops->copy(DFL_AT(ops, sel, i * H), DFL_AT(ops, x, (int64_t)w->rows[i] * H),
                      (size_t)((j - i) * H) * (size_t)ops->act_bytes);
            i = j;
        }
        in = sel;
    }
    dfl_target_norm(t, normed, in, t->final_norm, nrows, H);
    out->nrows = nrows;
    out->normed = w->normed ? normed : NULL;
    if (w->argmax) {
        dfl_sampling s = {w->temperature, w->top_k, w->top_p};
        if (w->temperature > 0)
            ops->lmhead_sample(pred, gap, normed, t->lm_head, w->sample_keys, &s, nrows, H, c->vocab_size);
        else
            ops->lmhead_argmax(pred, gap, normed, t->lm_head, nrows, H, c->vocab_size);
        out->argmax = pred;
        out->gap = gap;
    }
}

void dfl_target_keep_taps(const dfl_target *t, void *taps, const void *x, const dfl_target_want *w, int l, int64_t n) {
    const dfl_ops *ops = t->ops;
    const int64_t H = t->cfg.hidden_size;
    const size_t row = (size_t)H * (size_t)ops->act_bytes;
    for (int j = 0; j < w->ntaps; j++)
        if (w->taps[j] == l) ops->copy_2d(DFL_AT(ops, taps, (int64_t)j * H), row * (size_t)w->ntaps, x, row, row, (size_t)n);
}

void dfl_target_finish(dfl_target *t, dfl_target_out *out, head_ws *hw, void *x, void *taps,
                       const dfl_target_want *w, int64_t n, int64_t nrows) {
    out->T = n;
    out->ntaps = w->ntaps;
    out->taps = w->ntaps ? taps : NULL;
    out->last_hidden = w->last_hidden ? x : NULL;
    if (nrows) target_head(t, out, hw, x, w, nrows);
    t->ops->sync();
}

int dfl_target_forward(dfl_target *t, dfl_target_out *out, const dfl_target_batch *b, const dfl_target_want *w) {
    memset(out, 0, sizeof *out);
    const dfl_ops *ops = t->ops;
    const dfl_model_config *c = &t->cfg;
    int64_t T = 0, H = c->hidden_size;
    int rc = check_batch(t, b, &T);
    if (rc) return rc;
    int need;
    if ((rc = check_want(t, w, T, &need))) return rc;
    int64_t nrows = (w->normed || w->argmax) ? (w->rows ? w->nrows : T) : 0;
    ws_reserve(t, T, (int64_t)w->ntaps * T * H, nrows, b->nseq);
    workspace *ws = &t->ws;

    for (int64_t s = 0; s < b->nseq; s++) /* positions restart at 0 in every sequence */
        for (int32_t r = b->cu[s]; r < b->cu[s + 1]; r++) ws->host_pos[r] = r - b->cu[s];
    ops->upload(ws->ids, b->ids, (size_t)T * sizeof(int32_t));
    ops->upload(ws->pos, ws->host_pos, (size_t)T * sizeof(int32_t));
    ops->upload(ws->cu, b->cu, (size_t)(b->nseq + 1) * sizeof(int32_t));

    ops->embed(ws->x, ws->ids, t->embed, T, H);
    for (int l = 0; l < need; l++) {
        layer_forward(t, &t->layers[l], T, b->nseq);
        dfl_target_keep_taps(t, ws->taps, ws->x, w, l, T); /* x is now the output of layer l */
    }
    dfl_target_finish(t, out, &ws->head, ws->x, ws->taps, w, T, nrows);
    return 0;
}

/* ---- downloads ---------------------------------------------------------- */

// The rows are laid out on the device as the stream wants them (taps side
// by side): one download, no interleaving on the host.
static void taps_to_host(dfl_target *t, const dfl_target_out *o, int64_t row0, int64_t n, void *dst, size_t esz) {
    const dfl_ops *ops = t->ops;
    const int64_t H = t->cfg.hidden_size, K = o->ntaps;
    DFL_ASSERT(row0 >= 0 && n >= 0 && row0 + n <= o->T);
    const void *src = DFL_AT(ops, o->taps, row0 * K * H);
    if (esz == 2) ops->act_to_bf16((uint16_t *)dst, src, n * K * H);
    else ops->act_to_f32((float *)dst, src, n * K * H);
}

void dfl_target_taps_to_bf16(dfl_target *t, const dfl_target_out *o, int64_t row0, int64_t n, uint16_t *dst) {
    taps_to_host(t, o, row0, n, dst, 2);
}

void dfl_target_taps_to_f32(dfl_target *t, const dfl_target_out *o, int64_t row0, int64_t n, float *dst) {
    taps_to_host(t, o, row0, n, dst, 4);
}
