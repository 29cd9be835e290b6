/* drafter.c: DFlash drafter config, parameters, forward and backward. */
#include "drafter.h"

#include "common.h"
#include "safetensors.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- configuration ----------------------------------------------------- */

static int get_int_key(const json_t *o, const char *key, int64_t *out, const char *path, const char *where) {
    json_t *v = json_object_get(o, key);
    if (!v) return dfl_err(DFL_EX_DATA, "%s: \"%s%s\" is missing", path, where, key);
    if (!json_is_integer(v)) return dfl_err(DFL_EX_DATA, "%s: \"%s%s\" is not an integer", path, where, key);
    *out = json_integer_value(v);
    return 0;
}

int dfl_drafter_config_parse(dfl_drafter_config *c, const char *text, size_t len, const char *path) {
    memset(c, 0, sizeof *c);
    int rc = dfl_model_config_parse(&c->mc, text, len, path, "drafter");
    if (rc) return rc;
    const dfl_model_config *m = &c->mc;
    if (!m->qk_norm)
        return dfl_err(DFL_EX_DATA, "%s: a DFlash drafter is a Qwen3 model (q_norm/k_norm); architecture \"%s\" is not",
                       path, m->architecture);
    if (m->num_experts)
        return dfl_err(DFL_EX_DATA, "%s: a DFlash drafter has dense MLPs; architecture \"%s\" is a mixture of experts",
                       path, m->architecture);
    c->H = m->hidden_size;
    c->I = m->intermediate_size;
    c->L = m->num_hidden_layers;
    c->Hq = m->num_attention_heads;
    c->Hkv = m->num_key_value_heads;
    c->D = m->head_dim;
    c->V = m->vocab_size;
    c->eps = (float)m->rms_norm_eps;
    if (c->L > DFL_DRAFTER_MAX_LAYERS)
        return dfl_err(DFL_EX_DATA, "%s: \"num_hidden_layers\" %lld is more than %d", path, (long long)c->L,
                       DFL_DRAFTER_MAX_LAYERS);
    json_t *dc = json_object_get(m->json, "dflash_config");
    if (!json_is_object(dc)) return dfl_err(DFL_EX_DATA, "%s: \"dflash_config\" is missing or not an object", path);
    /* block_size: top level (Qwen3/Llama heads) or inside dflash_config (newer heads) */
    int64_t B = 0;
    if (json_object_get(m->json, "block_size")) {
        if ((rc = get_int_key(m->json, "block_size", &B, path, ""))) return rc;
    } else if (json_object_get(dc, "block_size")) {
        if ((rc = get_int_key(dc, "block_size", &B, path, "dflash_config."))) return rc;
        c->block_size_in_dflash_config = 1;
    } else {
        return dfl_err(DFL_EX_DATA, "%s: \"block_size\" is missing (top level or in dflash_config)", path);
    }
    if (B < 2 || B > DFL_DRAFTER_MAX_BLOCK)
        return dfl_err(DFL_EX_DATA, "%s: \"block_size\" %lld is not in [2, %d]", path, (long long)B, DFL_DRAFTER_MAX_BLOCK);
    c->block_size = (int)B;
    /* Below the block size the rules part: SpecForge's mask shows a slot
     * every earlier slot of its block, a serving engine's window would hide
     * the first ones. No released drafter is near it (Qwen3.6: 2048). */
    for (int64_t l = 0; l < c->L; l++)
        if (dfl_model_config_window(m, l) && dfl_model_config_window(m, l) < B)
            return dfl_err(DFL_EX_DATA, "%s: \"sliding_window\" %lld is smaller than the block size %lld: SpecForge's "
                           "training mask and a serving engine's window disagree there", path,
                           (long long)m->sliding_window, (long long)B);
    int64_t ntl;
    if ((rc = get_int_key(m->json, "num_target_layers", &ntl, path, ""))) return rc;
    if (ntl < 1 || ntl > 100000)
        return dfl_err(DFL_EX_DATA, "%s: \"num_target_layers\" %lld is out of range", path, (long long)ntl);
    c->num_target_layers = (int)ntl;
    if ((rc = get_int_key(dc, "mask_token_id", &c->mask_token_id, path, "dflash_config."))) return rc;
    if (c->mask_token_id < 0 || c->mask_token_id >= c->V)
        return dfl_err(DFL_EX_DATA, "%s: \"dflash_config.mask_token_id\" %lld is not a row of the %lld-token vocabulary",
                       path, (long long)c->mask_token_id, (long long)c->V);
    json_t *ids = json_object_get(dc, "target_layer_ids");
    if (!ids || json_is_null(ids)) {
        if (c->L > DFL_DRAFTER_MAX_TAPS)
            return dfl_err(DFL_EX_DATA, "%s: \"dflash_config.target_layer_ids\" is missing", path);
        c->K = (int)c->L;
        dfl_default_layer_ids(c->num_target_layers, c->K, c->layer_ids);
    } else {
        if (!json_is_array(ids) || json_array_size(ids) < 1 || json_array_size(ids) > DFL_DRAFTER_MAX_TAPS)
            return dfl_err(DFL_EX_DATA, "%s: \"dflash_config.target_layer_ids\" must be a list of 1 to %d layer ids", path,
                           DFL_DRAFTER_MAX_TAPS);
        c->K = (int)json_array_size(ids);
        for (int i = 0; i < c->K; i++) {
            json_t *v = json_array_get(ids, (size_t)i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= ntl)
                return dfl_err(DFL_EX_DATA, "%s: \"dflash_config.target_layer_ids\"[%d] is not a layer id in [0, %lld)",
                               path, i, (long long)ntl);
            c->layer_ids[i] = (int)json_integer_value(v);
        }
    }
    /* The reference rule spreads taps over [1, num_target_layers - 3]: below
     * 4 target layers it can give ids outside the target. */
    for (int i = 0; i < c->K; i++)
        if (c->layer_ids[i] < 0 || c->layer_ids[i] >= c->num_target_layers)
            return dfl_err(DFL_EX_DATA,
                           "%s: the default target_layer_ids (%d taps) do not fit %d target layers; give "
                           "\"dflash_config.target_layer_ids\"",
                           path, c->K, c->num_target_layers);
    /* fc is [H, K*H]: the rest of the parameters were bounded with the config */
    int64_t fc;
    if (__builtin_mul_overflow(c->H, c->H, &fc) || __builtin_mul_overflow(fc, (int64_t)c->K, &fc) || fc > DFL_MAX_PARAMS)
        return dfl_err(DFL_EX_DATA, "%s: fc.weight [%lld, %d * %lld] has more than 2^46 parameters", path,
                       (long long)c->H, c->K, (long long)c->H);
    return 0;
}

int dfl_drafter_config_load(dfl_drafter_config *c, const char *path) {
    memset(c, 0, sizeof *c);
    char *buf = NULL;
    size_t n = 0;
    int rc = dfl_read_file(path, 16u << 20, "config.json", &buf, &n);
    if (rc) return rc;
    rc = dfl_drafter_config_parse(c, buf, n, path);
    free(buf);
    return rc;
}

void dfl_drafter_config_free(dfl_drafter_config *c) { dfl_model_config_free(&c->mc); }

json_t *dfl_drafter_config_json(const dfl_drafter_config *c) {
    json_t *j = json_deep_copy(c->mc.json);
    json_t *arch = json_array();
    json_array_append_new(arch, json_string("DFlashDraftModel"));
    json_object_set_new(j, "architectures", arch);
    json_t *am = json_object();
    json_object_set_new(am, "AutoModel", json_string("dflash.DFlashDraftModel"));
    json_object_set_new(j, "auto_map", am);
    json_object_set_new(j, "model_type", json_string("qwen3"));
    json_t *dc = json_object_get(j, "dflash_config");
    if (c->block_size_in_dflash_config) json_object_set_new(dc, "block_size", json_integer(c->block_size));
    else json_object_set_new(j, "block_size", json_integer(c->block_size));
    json_object_set_new(j, "num_target_layers", json_integer(c->num_target_layers));
    json_object_set_new(dc, "mask_token_id", json_integer(c->mask_token_id));
    json_t *ids = json_array();
    for (int i = 0; i < c->K; i++) json_array_append_new(ids, json_integer(c->layer_ids[i]));
    json_object_set_new(dc, "target_layer_ids", ids);
    json_object_set_new(j, "hidden_size", json_integer(c->H));
    json_object_set_new(j, "intermediate_size", json_integer(c->I));
    json_object_set_new(j, "num_hidden_layers", json_integer(c->L));
    json_object_set_new(j, "num_attention_heads", json_integer(c->Hq));
    json_object_set_new(j, "num_key_value_heads", json_integer(c->Hkv));
    json_object_set_new(j, "head_dim", json_integer(c->D));
    json_object_set_new(j, "hidden_act", json_string("silu"));
    json_object_set_new(j, "attention_bias", json_false());
    if (!json_object_get(j, "attention_dropout")) json_object_set_new(j, "attention_dropout", json_real(0.0));
    json_object_set_new(j, "rms_norm_eps", json_real(c->mc.rms_norm_eps));
    if (!json_is_object(json_object_get(j, "rope_parameters"))) {
        if (!json_object_get(j, "rope_theta")) json_object_set_new(j, "rope_theta", json_real(c->mc.rope_theta));
        if (!json_object_get(j, "rope_scaling")) json_object_set_new(j, "rope_scaling", json_null());
    }
    /* 0 (the parsed default of an absent key) would read as a context of no
     * tokens to the engines that serve the checkpoint */
    if (c->mc.max_position_embeddings > 0)
        json_object_set_new(j, "max_position_embeddings", json_integer(c->mc.max_position_embeddings));
    else
        json_object_del(j, "max_position_embeddings");
    json_object_set_new(j, "vocab_size", json_integer(c->V));
    json_object_set_new(j, "tie_word_embeddings", json_false());
    /* the layers' attention as the parser read it, spelled out for every reader */
    json_t *lt = json_array();
    int sliding = 0;
    for (int64_t i = 0; i < c->L; i++) {
        int s = dfl_model_config_window(&c->mc, i) > 0;
        json_array_append_new(lt, json_string(s ? "sliding_attention" : "full_attention"));
        sliding |= s;
    }
    json_object_set_new(j, "layer_types", lt);
    json_object_set_new(j, "use_sliding_window", json_boolean(sliding));
    json_object_set_new(j, "sliding_window", sliding ? json_integer(c->mc.sliding_window) : json_null());
    json_object_set_new(j, "dtype", json_string("bfloat16"));
    if (json_object_get(j, "torch_dtype")) json_object_set_new(j, "torch_dtype", json_string("bfloat16"));
    return j;
}

/* ---- parameters ------------------------------------------------------------ */

static const char *layer_names[11] = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "input_layernorm.weight",  "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight",      "mlp.down_proj.weight",
};

static void set_info(dfl_param_info *p, int64_t *off, const char *name, int ndim, int64_t d0, int64_t d1) {
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim == 2 ? d1 : 0;
    p->numel = ndim == 2 ? d0 * d1 : d0;
    p->offset = *off;
    *off += p->numel;
}

int dfl_drafter_params(const dfl_drafter_config *c, dfl_param_info *info) {
    int n = 3 + 11 * (int)c->L;
    if (!info) return n;
    int64_t off = 0, H = c->H, QD = c->Hq * c->D, KVD = c->Hkv * c->D;
    int i = 0;
    set_info(&info[i++], &off, "fc.weight", 2, H, c->K * H);
    set_info(&info[i++], &off, "hidden_norm.weight", 1, H, 0);
    for (int64_t l = 0; l < c->L; l++) {
        int64_t shapes[11][2] = {{QD, H}, {KVD, H}, {KVD, H}, {H, QD}, {c->D, 0}, {c->D, 0},
                                 {H, 0},  {H, 0},   {c->I, H}, {c->I, H}, {H, c->I}};
        for (int t = 0; t < 11; t++) {
            char name[64];
            snprintf(name, sizeof name, "layers.%lld.%s", (long long)l, layer_names[t]);
            set_info(&info[i++], &off, name, shapes[t][1] ? 2 : 1, shapes[t][0], shapes[t][1]);
        }
    }
    set_info(&info[i++], &off, "norm.weight", 1, H, 0);
    return n;
}

/* Pointers to every tensor of a flat array with `esz`-byte elements. */
static void point(const dfl_drafter *d, void *base, int esz, dfl_drafter_ptrs *p) {
    char *b = base;
    const dfl_param_info *in = d->info;
    p->fc = b + in[0].offset * esz;
    p->hidden_norm = b + in[1].offset * esz;
    p->norm = b + in[d->ntensors - 1].offset * esz;
    for (int64_t l = 0; l < d->cfg.L; l++) {
        const dfl_param_info *t = &in[2 + 11 * l];
        void **dst[11] = {&p->layer[l].q,   &p->layer[l].k,   &p->layer[l].v,    &p->layer[l].o,
                          &p->layer[l].qn,  &p->layer[l].kn,  &p->layer[l].ln1,  &p->layer[l].ln2,
                          &p->layer[l].gate, &p->layer[l].up, &p->layer[l].down};
        for (int k = 0; k < 11; k++) *dst[k] = b + t[k].offset * esz;
    }
}

/* ---- activation workspace --------------------------------------------------- */

typedef struct {
    void *h;            /* [Q,H] layer input (residual stream) */
    void *x1;           /* [Q,H] input_layernorm(h) */
    void *qpre, *q;     /* [Q,Hq*D] q_proj(x1); q_norm + rope */
    void *kpre, *k, *v; /* [NK,Hkv*D] k_proj([ctx;x1]); k_norm + rope; v_proj */
    void *att;          /* [Q,Hq*D] attention output */
    void *h1;           /* [Q,H] h + o_proj(att) */
    void *x2;           /* [Q,H] post_attention_layernorm(h1) */
    void *g, *u, *a;    /* [Q,I] gate, up, silu(gate)*up */
    float *rstd1, *rstd_q, *rstd_k, *rstd2, *lse;
} layer_acts;

struct dfl_drafter_ws {
    int64_t cap_nc, cap_q;
    void *feats, *ctx_pre, *ctx;   /* [NC,K*H], [NC,H], [NC,H] */
    float *rstd_c;
    layer_acts *la;                /* [L] */
    void *hL, *out;                /* [Q,H] after the last layer; norm(hL) */
    float *rstd_f;
    int32_t *pos, *tokens, *labels, *pred, *tpred;
    float *gscale, *loss;
    dfl_block *blocks;
    void *th_raw, *th;             /* [Q,H] KL targets */
    /* gradient scratch */
    void *dout, *dh, *dx, *dx2, *dq, *dqpre, *datt, *dk, *dkpre, *dv, *dg, *du, *da, *dctx, *dctxpre;
};

static void ws_alloc(const dfl_ops *ops, void **slot, size_t bytes) { *slot = ops->alloc(bytes ? bytes : 1); }

static void ws_free(const dfl_ops *ops, struct dfl_drafter_ws *w, int64_t L) {
    if (!w) return;
    void **flat[] = {&w->feats, &w->ctx_pre, &w->ctx, (void **)&w->rstd_c, &w->hL, &w->out, (void **)&w->rstd_f,
                     (void **)&w->pos, (void **)&w->tokens, (void **)&w->labels, (void **)&w->pred,
                     (void **)&w->tpred, (void **)&w->gscale, (void **)&w->loss, (void **)&w->blocks, &w->th_raw,
                     &w->th, &w->dout, &w->dh, &w->dx, &w->dx2, &w->dq, &w->dqpre, &w->datt, &w->dk, &w->dkpre,
                     &w->dv, &w->dg, &w->du, &w->da, &w->dctx, &w->dctxpre};
    for (size_t i = 0; i < sizeof flat / sizeof flat[0]; i++)
        if (*flat[i]) ops->free(*flat[i]);
    if (w->la) {
        for (int64_t l = 0; l < L; l++) {
            layer_acts *a = &w->la[l];
            void *p[] = {a->h, a->x1, a->qpre, a->q, a->kpre, a->k, a->v, a->att, a->h1, a->x2, a->g, a->u, a->a,
                         a->rstd1, a->rstd_q, a->rstd_k, a->rstd2, a->lse};
            for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
                if (p[i]) ops->free(p[i]);
        }
        free(w->la);
    }
    free(w);
}

static void ws_sizes(const dfl_drafter *d, int64_t NC, int64_t Q, uint64_t *act_elems, uint64_t *f32_elems) {
    const dfl_drafter_config *c = &d->cfg;
    uint64_t NK = (uint64_t)(NC + Q), QD = (uint64_t)(c->Hq * c->D), KVD = (uint64_t)(c->Hkv * c->D);
    uint64_t H = (uint64_t)c->H, I = (uint64_t)c->I;
    uint64_t per_layer = (uint64_t)Q * (4 * H + 3 * QD + 3 * I) + NK * 3 * KVD;
    *act_elems = (uint64_t)NC * ((uint64_t)c->K * H + 2 * H) + (uint64_t)c->L * per_layer + (uint64_t)Q * 4 * H +
                 (uint64_t)Q * (4 * H + 3 * QD + 3 * I) + NK * 3 * KVD + (uint64_t)NC * 2 * H;
    *f32_elems = (uint64_t)NC + (uint64_t)c->L * ((uint64_t)Q * (2 + 2 * (uint64_t)c->Hq) + NK * (uint64_t)c->Hkv) +
                 (uint64_t)Q * 3;
}

uint64_t dfl_drafter_ws_bytes(const dfl_drafter *d, int64_t NC, int64_t nblk) {
    uint64_t a, f;
    ws_sizes(d, NC, nblk * d->cfg.block_size, &a, &f);
    return a * (uint64_t)d->ops->act_bytes + f * 4 + (uint64_t)(NC + nblk * d->cfg.block_size) * 24;
}

/* Make sure the workspace holds NC context rows and Q block rows. */
static void ws_ensure(dfl_drafter *d, int64_t NC, int64_t Q) {
    struct dfl_drafter_ws *w = d->ws;
    if (w && NC <= w->cap_nc && Q <= w->cap_q) return;
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    int64_t cap_nc = w ? (NC > w->cap_nc ? NC : w->cap_nc) : NC;
    int64_t cap_q = w ? (Q > w->cap_q ? Q : w->cap_q) : Q;
    ws_free(ops, w, c->L);
    w = dfl_calloc(1, sizeof *w);
    w->cap_nc = cap_nc;
    w->cap_q = cap_q;
    size_t ab = (size_t)ops->act_bytes, NK = (size_t)(cap_nc + cap_q), q = (size_t)cap_q, nc = (size_t)cap_nc;
    size_t H = (size_t)c->H, I = (size_t)c->I, QD = (size_t)(c->Hq * c->D), KVD = (size_t)(c->Hkv * c->D);
    size_t KH = (size_t)c->K * H, B = (size_t)c->block_size;
#define A(slot, bytes) ws_alloc(ops, (void **)&(slot), (bytes))
    A(w->feats, nc * KH * ab);
    A(w->ctx_pre, nc * H * ab);
    A(w->ctx, nc * H * ab);
    A(w->rstd_c, nc * 4);
    w->la = dfl_calloc((size_t)c->L, sizeof *w->la);
    for (int64_t l = 0; l < c->L; l++) {
        layer_acts *a = &w->la[l];
        A(a->h, q * H * ab);
        A(a->x1, q * H * ab);
        A(a->qpre, q * QD * ab);
        A(a->q, q * QD * ab);
        A(a->kpre, NK * KVD * ab);
        A(a->k, NK * KVD * ab);
        A(a->v, NK * KVD * ab);
        A(a->att, q * QD * ab);
        A(a->h1, q * H * ab);
        A(a->x2, q * H * ab);
        A(a->g, q * I * ab);
        A(a->u, q * I * ab);
        A(a->a, q * I * ab);
        A(a->rstd1, q * 4);
        A(a->rstd_q, q * (size_t)c->Hq * 4);
        A(a->rstd_k, NK * (size_t)c->Hkv * 4);
        A(a->rstd2, q * 4);
        A(a->lse, q * (size_t)c->Hq * 4);
    }
    A(w->hL, q * H * ab);
    A(w->out, q * H * ab);
    A(w->rstd_f, q * 4);
    A(w->pos, NK * 4);
    A(w->tokens, q * 4);
    A(w->labels, q * 4);
    A(w->pred, q * 4);
    A(w->tpred, q * 4);
    A(w->gscale, q * 4);
    A(w->loss, q * 4);
    A(w->blocks, (q / B + 1) * sizeof(dfl_block));
    A(w->th_raw, q * H * ab);
    A(w->th, q * H * ab);
    A(w->dout, q * H * ab);
    A(w->dh, q * H * ab);
    A(w->dx, q * H * ab);
    A(w->dx2, q * H * ab);
    A(w->dq, q * QD * ab);
    A(w->dqpre, q * QD * ab);
    A(w->datt, q * QD * ab);
    A(w->dk, NK * KVD * ab);
    A(w->dkpre, NK * KVD * ab);
    A(w->dv, NK * KVD * ab);
    A(w->dg, q * I * ab);
    A(w->du, q * I * ab);
    A(w->da, q * I * ab);
    A(w->dctx, nc * H * ab);
    A(w->dctxpre, nc * H * ab);
#undef A
    d->ws = w;
}

/* ---- the model -------------------------------------------------------------- */

static dfl_drafter *drafter_create(const dfl_ops *ops, const dfl_drafter_config *cfg, int training) {
    dfl_drafter *d = dfl_calloc(1, sizeof *d);
    d->ops = ops;
    d->cfg = *cfg;
    d->cfg.mc.json = json_incref(cfg->mc.json);
    d->ntensors = dfl_drafter_params(cfg, NULL);
    d->info = dfl_calloc((size_t)d->ntensors, sizeof *d->info);
    dfl_drafter_params(cfg, d->info);
    d->nparams = d->info[d->ntensors - 1].offset + d->info[d->ntensors - 1].numel;
    size_t n = (size_t)d->nparams;
    d->master = ops->alloc(n * 4);
    if (training) { /* gradients and AdamW moments: 3x the parameters, training only */
        d->grad = ops->alloc(n * 4);
        d->m = ops->alloc(n * 4);
        d->v = ops->alloc(n * 4);
    }
    d->wt = ops->wt_bytes == 4 ? (void *)d->master : ops->alloc(n * (size_t)ops->wt_bytes);
    d->W.layer = dfl_calloc((size_t)cfg->L, sizeof(dfl_drafter_layer));
    d->G.layer = dfl_calloc((size_t)cfg->L, sizeof(dfl_drafter_layer));
    point(d, d->wt, ops->wt_bytes, &d->W);
    if (training) point(d, d->grad, 4, &d->G);
    d->inv_freq = ops->alloc((size_t)(cfg->D / 2) * 4);
    float *inv = dfl_malloc((size_t)(cfg->D / 2) * 4);
    dfl_rope_inv_freq(&cfg->mc, inv);
    d->rope_scale = dfl_rope_scale(&cfg->mc);
    ops->upload(d->inv_freq, inv, (size_t)(cfg->D / 2) * 4);
    free(inv);
    return d;
}

dfl_drafter *dfl_drafter_new(const dfl_ops *ops, const dfl_drafter_config *cfg) { return drafter_create(ops, cfg, 1); }

dfl_drafter *dfl_drafter_new_frozen(const dfl_ops *ops, const dfl_drafter_config *cfg) {
    return drafter_create(ops, cfg, 0);
}

/* The target's embedding, LM head (possibly the same buffer) and final
 * norm, released and forgotten. */
static void release_target(dfl_drafter *d) {
    const dfl_ops *ops = d->ops;
    if (d->lm_head && d->lm_head != d->embed) ops->free(d->lm_head);
    if (d->embed) ops->free(d->embed);
    if (d->target_norm) ops->free(d->target_norm);
    d->lm_head = d->embed = d->target_norm = NULL;
}

void dfl_drafter_free(dfl_drafter *d) {
    if (!d) return;
    const dfl_ops *ops = d->ops;
    ws_free(ops, d->ws, d->cfg.L);
    if (d->wt != (void *)d->master) ops->free(d->wt);
    ops->free(d->master);
    if (d->grad) {
        ops->free(d->grad);
        ops->free(d->m);
        ops->free(d->v);
    }
    ops->free(d->inv_freq);
    release_target(d);
    free(d->W.layer);
    free(d->G.layer);
    free(d->info);
    json_decref(d->cfg.mc.json);
    free(d);
}

void dfl_drafter_sync_weights(dfl_drafter *d) {
    if (d->wt != (void *)d->master) d->ops->master_to_wt(d->wt, d->master, d->nparams);
}

void dfl_drafter_set_master(dfl_drafter *d, const float *host) {
    d->ops->upload(d->master, host, (size_t)d->nparams * 4);
    dfl_drafter_sync_weights(d);
}

void dfl_drafter_get_master(const dfl_drafter *d, float *host) {
    d->ops->download(host, d->master, (size_t)d->nparams * 4);
}

void dfl_drafter_init_weights(dfl_drafter *d, double init_std, double (*next_normal)(void *), void *rng) {
    float *host = dfl_malloc((size_t)d->nparams * 4);
    for (int t = 0; t < d->ntensors; t++) {
        const dfl_param_info *p = &d->info[t];
        float *dst = host + p->offset;
        for (int64_t i = 0; i < p->numel; i++) dst[i] = p->ndim == 2 ? (float)(init_std * next_normal(rng)) : 1.0f;
    }
    dfl_drafter_set_master(d, host);
    free(host);
}

void dfl_drafter_zero_grad(dfl_drafter *d) {
    DFL_ASSERT(d->grad); /* not a frozen (inference) drafter */
    d->ops->zero(d->grad, (size_t)d->nparams * 4);
    d->grad_fresh = 0;
}

void dfl_drafter_start_grad(dfl_drafter *d) {
    DFL_ASSERT(d->grad);
    for (int t = 0; t < d->ntensors; t++)
        if (d->info[t].ndim != 2) d->ops->zero(d->grad + d->info[t].offset, (size_t)d->info[t].numel * 4);
    d->grad_fresh = 1;
}

void dfl_drafter_set_target(dfl_drafter *d, const float *embed, const float *lm_head, const float *target_norm,
                            float target_eps) {
    const dfl_ops *ops = d->ops;
    release_target(d); /* a second call replaces the weights: the first ones were leaked */
    size_t VH = (size_t)(d->cfg.V * d->cfg.H);
    d->embed = ops->alloc(VH * (size_t)ops->wt_bytes);
    ops->load_wt(d->embed, embed, DFL_F32, (int64_t)VH);
    if (lm_head == embed) {
        d->lm_head = d->embed;
    } else {
        d->lm_head = ops->alloc(VH * (size_t)ops->wt_bytes);
        ops->load_wt(d->lm_head, lm_head, DFL_F32, (int64_t)VH);
    }
    if (target_norm) {
        d->target_norm = ops->alloc((size_t)d->cfg.H * (size_t)ops->wt_bytes);
        ops->load_wt(d->target_norm, target_norm, DFL_F32, d->cfg.H);
    }
    d->target_eps = target_eps;
}

/* A safetensors tensor into a fresh wt buffer (copied to aligned memory
 * first when the mapping leaves it unaligned). */
static void *load_st_wt(const dfl_ops *ops, const dfl_st_tensor *t) {
    void *dst = ops->alloc((size_t)t->numel * (size_t)ops->wt_bytes);
    size_t esz = dfl_dtype_size((dfl_dtype)t->dtype);
    if (((uintptr_t)t->data % esz) == 0) {
        ops->load_wt(dst, t->data, (dfl_dtype)t->dtype, t->numel);
    } else {
        void *tmp = dfl_aligned_alloc(t->nbytes);
        memcpy(tmp, t->data, t->nbytes);
        ops->load_wt(dst, tmp, (dfl_dtype)t->dtype, t->numel);
        free(tmp);
    }
    return dst;
}

void dfl_drafter_config_from_target(dfl_drafter_config *c, const dfl_model_config *tcfg) {
    if (c->mc.max_position_embeddings <= 0) c->mc.max_position_embeddings = tcfg->max_position_embeddings;
}

int dfl_drafter_check_target(const dfl_drafter_config *c, const dfl_model_config *tcfg, const char *dir) {
    if (tcfg->hidden_size != c->H)
        return dfl_err(DFL_EX_DATA, "%s: target hidden_size %lld differs from the drafter's hidden_size %lld", dir,
                       (long long)tcfg->hidden_size, (long long)c->H);
    if (tcfg->vocab_size != c->V)
        return dfl_err(DFL_EX_DATA, "%s: target vocab_size %lld differs from the drafter's vocab_size %lld", dir,
                       (long long)tcfg->vocab_size, (long long)c->V);
    if (tcfg->num_hidden_layers != c->num_target_layers)
        return dfl_err(DFL_EX_DATA, "%s: target num_hidden_layers %lld differs from the drafter's num_target_layers %d",
                       dir, (long long)tcfg->num_hidden_layers, c->num_target_layers);
    return 0;
}

int dfl_drafter_load_target(dfl_drafter *d, const char *dir, const dfl_model_config *tcfg) {
    const dfl_drafter_config *c = &d->cfg;
    int rc = dfl_drafter_check_target(c, tcfg, dir);
    if (rc) return rc;
    dfl_st *st;
    rc = dfl_st_open_dir(&st, dir);
    if (rc) return rc;
    int64_t shape[2] = {c->V, c->H};
    const dfl_st_tensor *emb, *head = NULL, *norm;
    char emb_name[96], norm_name[96];
    snprintf(emb_name, sizeof emb_name, "%sembed_tokens.weight", tcfg->weight_prefix);
    snprintf(norm_name, sizeof norm_name, "%snorm.weight", tcfg->weight_prefix);
    rc = dfl_st_get(st, emb_name, 2, shape, &emb);
    if (!rc && !tcfg->tie_word_embeddings) rc = dfl_st_get(st, "lm_head.weight", 2, shape, &head);
    if (!rc) rc = dfl_st_get(st, norm_name, 1, shape + 1, &norm);
    if (rc) {
        dfl_st_close(st);
        return rc;
    }
    d->embed = load_st_wt(d->ops, emb);
    d->lm_head = head ? load_st_wt(d->ops, head) : d->embed;
    d->target_norm = load_st_wt(d->ops, norm);
    d->target_norm_plus_one = tcfg->norm_plus_one; /* Qwen3.5: applied by rmsnorm1p */
    d->target_eps = (float)tcfg->rms_norm_eps;
    dfl_st_close(st);
    return 0;
}

/* ---- forward ------------------------------------------------------------------ */

const void *dfl_drafter_output(const dfl_drafter *d) { return d->ws->out; }

void dfl_drafter_forward(dfl_drafter *d, const dfl_drafter_batch *b) {
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    const int64_t B = c->block_size, NC = b->NC, nblk = b->nblk, Q = nblk * B, NK = NC + Q;
    const int64_t H = c->H, I = c->I, Hq = c->Hq, Hkv = c->Hkv, D = c->D, QD = Hq * D, KVD = Hkv * D, KH = c->K * H;
    const float eps = c->eps;
    ws_ensure(d, NC, Q);
    struct dfl_drafter_ws *w = d->ws;
    size_t hb = (size_t)(Q * H) * (size_t)ops->act_bytes;

    ops->upload(w->pos, b->pos, (size_t)NK * 4);
    ops->upload(w->tokens, b->tokens, (size_t)Q * 4);
    ops->upload(w->blocks, b->blocks, (size_t)nblk * sizeof(dfl_block));
    /* context: ctx = hidden_norm(fc(features)) [NC, H], the same for every layer */
    if (NC > 0) {
        ops->load_act(w->feats, b->feats, b->feats_dtype, NC * KH);
        ops->matmul(w->ctx_pre, w->feats, d->W.fc, NC, KH, H, 0);
        ops->rmsnorm(w->ctx, w->rstd_c, w->ctx_pre, d->W.hidden_norm, NC, H, eps);
    }
    /* block rows: the target's embedding of [anchor token, mask x (B-1)] */
    ops->embed(w->la[0].h, w->tokens, d->embed, Q, H);
    const int32_t *qpos = w->pos + NC;
    for (int64_t l = 0; l < c->L; l++) {
        layer_acts *a = &w->la[l];
        const dfl_drafter_layer *W = &d->W.layer[l];
        void *hnext = l + 1 < c->L ? w->la[l + 1].h : w->hL;
        ops->rmsnorm(a->x1, a->rstd1, a->h, W->ln1, Q, H, eps);
        /* queries from the block rows only; q_norm per head before RoPE */
        ops->matmul(a->qpre, a->x1, W->q, Q, H, QD, 0);
        ops->qk_norm_rope(a->q, a->rstd_q, a->qpre, W->qn, 0, qpos, d->inv_freq, d->rope_scale, Q, Hq, D, eps);
        /* keys/values: context rows through THIS layer's k_proj/v_proj, then block rows */
        if (NC > 0) {
            ops->matmul(a->kpre, w->ctx, W->k, NC, H, KVD, 0);
            ops->matmul(a->v, w->ctx, W->v, NC, H, KVD, 0);
        }
        ops->matmul(DFL_AT(ops, a->kpre, NC * KVD), a->x1, W->k, Q, H, KVD, 0);
        ops->matmul(DFL_AT(ops, a->v, NC * KVD), a->x1, W->v, Q, H, KVD, 0);
        ops->qk_norm_rope(a->k, a->rstd_k, a->kpre, W->kn, 0, w->pos, d->inv_freq, d->rope_scale, NK, Hkv, D,
                          eps);
        ops->attn_dflash(a->att, a->lse, a->q, a->k, a->v, w->blocks, nblk, B, NK, Hq, Hkv, D,
                         dfl_model_config_window(&c->mc, l));
        ops->copy(a->h1, a->h, hb);
        ops->matmul(a->h1, a->att, W->o, Q, QD, H, 1);
        /* MLP */
        ops->rmsnorm(a->x2, a->rstd2, a->h1, W->ln2, Q, H, eps);
        ops->matmul(a->g, a->x2, W->gate, Q, H, I, 0);
        ops->matmul(a->u, a->x2, W->up, Q, H, I, 0);
        ops->swiglu(a->a, a->g, a->u, Q * I);
        ops->copy(hnext, a->h1, hb);
        ops->matmul(hnext, a->a, W->down, Q, I, H, 1);
    }
    ops->rmsnorm(w->out, w->rstd_f, w->hL, d->W.norm, Q, H, eps);
}

void dfl_drafter_loss(dfl_drafter *d, const dfl_drafter_batch *b, int kl, int backward, float *loss, int32_t *pred,
                      int32_t *tpred) {
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    struct dfl_drafter_ws *w = d->ws;
    const int64_t Q = b->nblk * c->block_size, H = c->H, V = c->V;
    ops->upload(w->gscale, b->gscale, (size_t)Q * 4);
    void *dh = NULL;
    if (backward) {
        ops->zero(w->dout, (size_t)(Q * H) * (size_t)ops->act_bytes);
        dh = w->dout;
    }
    if (kl) {
        DFL_ASSERT(b->target_h && d->target_norm);
        /* the target's distribution: its own final norm, then its LM head */
        ops->load_act(w->th_raw, b->target_h, b->target_h_dtype, Q * H);
        if (d->target_norm_plus_one) ops->rmsnorm1p(w->th, w->th_raw, d->target_norm, Q, H, d->target_eps);
        else ops->rmsnorm(w->th, NULL, w->th_raw, d->target_norm, Q, H, d->target_eps);
        ops->lmhead_kl(w->loss, w->pred, w->tpred, dh, w->out, w->th, d->lm_head, w->gscale, Q, H, V);
        if (tpred) ops->download(tpred, w->tpred, (size_t)Q * 4);
    } else {
        ops->upload(w->labels, b->labels, (size_t)Q * 4);
        ops->lmhead_ce(w->loss, w->pred, dh, w->out, d->lm_head, w->labels, w->gscale, Q, H, V);
    }
    if (loss) ops->download(loss, w->loss, (size_t)Q * 4);
    if (pred) ops->download(pred, w->pred, (size_t)Q * 4);
}

/* ---- backward ----------------------------------------------------------------- */

void dfl_drafter_backward(dfl_drafter *d, const dfl_drafter_batch *b) {
    DFL_ASSERT(d->grad); /* not a frozen (inference) drafter */
    const dfl_ops *ops = d->ops;
    const dfl_drafter_config *c = &d->cfg;
    const int64_t B = c->block_size, NC = b->NC, nblk = b->nblk, Q = nblk * B, NK = NC + Q;
    const int64_t H = c->H, I = c->I, Hq = c->Hq, Hkv = c->Hkv, D = c->D, QD = Hq * D, KVD = Hkv * D, KH = c->K * H;
    struct dfl_drafter_ws *w = d->ws;
    const size_t ab = (size_t)ops->act_bytes;
    const int32_t *qpos = w->pos + NC;
    /* a weight matrix's first product: adds to its gradient, or writes it
     * (the first backward after dfl_drafter_start_grad); later ones add */
    const int first_dw = d->grad_fresh ? 0 : DFL_ACC_DW;
    const int din = DFL_ACC_DIN;

    /* dh: gradient of the residual stream, carried down through the layers */
    ops->zero(w->dh, (size_t)(Q * H) * ab);
    ops->rmsnorm_bwd(w->dh, d->G.norm, w->dout, w->hL, w->rstd_f, d->W.norm, Q, H);
    if (NC > 0) ops->zero(w->dctx, (size_t)(NC * H) * ab);
    for (int64_t l = c->L - 1; l >= 0; l--) {
        layer_acts *a = &w->la[l];
        const dfl_drafter_layer *W = &d->W.layer[l];
        const dfl_drafter_layer *G = &d->G.layer[l];
        /* MLP: h_next = h1 + down(silu(gate(x2)) * up(x2)) */
        /* (the first product into each input gradient overwrites it: no zeroing) */
        ops->matmul_bwd(w->da, G->down, w->dh, a->a, W->down, Q, I, H, first_dw);
        ops->swiglu_bwd(w->dg, w->du, w->da, a->g, a->u, Q * I, 0);
        ops->matmul_bwd(w->dx2, G->gate, w->dg, a->x2, W->gate, Q, H, I, first_dw);
        ops->matmul_bwd(w->dx2, G->up, w->du, a->x2, W->up, Q, H, I, din | first_dw);
        ops->rmsnorm_bwd(w->dh, G->ln2, w->dx2, a->h1, a->rstd2, W->ln2, Q, H); /* dh: now d/dh1 */
        /* attention: h1 = h + o_proj(att) */
        ops->matmul_bwd(w->datt, G->o, w->dh, a->att, W->o, Q, QD, H, first_dw);
        /* writes dq, dk and dv: no zeroing */
        ops->attn_dflash_bwd(w->dq, w->dk, w->dv, w->datt, a->att, a->lse, a->q, a->k, a->v, w->blocks, nblk, B, NK,
                             Hq, Hkv, D, dfl_model_config_window(&c->mc, l));
        /* RoPE's backward (the inverse rotation), then the q/k norm's: one
         * pass each, writing dqpre and dkpre */
        ops->qk_norm_rope_bwd(w->dqpre, G->qn, w->dq, a->qpre, a->rstd_q, W->qn, qpos, d->inv_freq, d->rope_scale, Q,
                              Hq, D);
        ops->qk_norm_rope_bwd(w->dkpre, G->kn, w->dk, a->kpre, a->rstd_k, W->kn, w->pos, d->inv_freq, d->rope_scale,
                              NK, Hkv, D);
        ops->matmul_bwd(w->dx, G->q, w->dqpre, a->x1, W->q, Q, H, QD, first_dw);
        ops->matmul_bwd(w->dx, G->k, DFL_AT(ops, w->dkpre, NC * KVD), a->x1, W->k, Q, H, KVD, din | first_dw);
        ops->matmul_bwd(w->dx, G->v, DFL_AT(ops, w->dv, NC * KVD), a->x1, W->v, Q, H, KVD, din | first_dw);
        if (NC > 0) {
            ops->matmul_bwd(w->dctx, G->k, w->dkpre, w->ctx, W->k, NC, H, KVD, din | DFL_ACC_DW);
            ops->matmul_bwd(w->dctx, G->v, w->dv, w->ctx, W->v, NC, H, KVD, din | DFL_ACC_DW);
        }
        ops->rmsnorm_bwd(w->dh, G->ln1, w->dx, a->h, a->rstd1, W->ln1, Q, H); /* dh: now d/dh */
    }
    /* the embedding is the target's, frozen: dh stops here */
    if (NC > 0) {
        ops->zero(w->dctxpre, (size_t)(NC * H) * ab);
        ops->rmsnorm_bwd(w->dctxpre, d->G.hidden_norm, w->dctx, w->ctx_pre, w->rstd_c, d->W.hidden_norm, NC, H);
        ops->matmul_bwd(NULL, d->G.fc, w->dctxpre, w->feats, d->W.fc, NC, KH, H, first_dw);
    } else if (d->grad_fresh) { /* no context: fc's gradient is 0, written here as no product writes it */
        ops->zero(d->G.fc, (size_t)(H * KH) * 4);
    }
    d->grad_fresh = 0;
}
