/* model_config.c: reading Qwen3, Llama, Mistral, Qwen2, Qwen3.5 and gpt-oss
 * config.json files (dense and mixture-of-experts). */
#include "model_config.h"

#include "common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* Integer key: required (def < -1 means required) or defaulted. */
static int get_int(const json_t *o, const char *key, int64_t def, int64_t *out, const char *path) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (def < -1) return dfl_err(DFL_EX_DATA, "%s: \"%s\" is missing", path, key);
        *out = def;
        return 0;
    }
    if (!json_is_integer(v)) return dfl_err(DFL_EX_DATA, "%s: \"%s\" is not an integer", path, key);
    *out = json_integer_value(v);
    return 0;
}

static int get_num(const json_t *o, const char *key, double def, double *out, const char *path) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (isnan(def)) return dfl_err(DFL_EX_DATA, "%s: \"%s\" is missing", path, key);
        *out = def;
        return 0;
    }
    if (!json_is_number(v)) return dfl_err(DFL_EX_DATA, "%s: \"%s\" is not a number", path, key);
    *out = json_number_value(v);
    return 0;
}

/* A boolean key: absent or null is false; any other non-boolean (1, "true",
 * "no") is refused, not read as false. */
static int get_bool(const json_t *o, const char *key, int *out, const char *path) {
    json_t *v = json_object_get(o, key);
    *out = json_is_true(v);
    if (v && !json_is_null(v) && !json_is_boolean(v))
        return dfl_err(DFL_EX_DATA, "%s: \"%s\" is not true or false", path, key);
    return 0;
}

static void copy_str(char *dst, size_t n, const json_t *v) {
    const char *s = json_string_value(v);
    snprintf(dst, n, "%s", s ? s : "");
}

/* x * y and x + y in int64, or -1 once past DFL_MAX_PARAMS (inputs >= 0 or -1). */
static int64_t pmul(int64_t x, int64_t y) {
    int64_t r;
    return x < 0 || y < 0 || __builtin_mul_overflow(x, y, &r) || r > DFL_MAX_PARAMS ? -1 : r;
}
static int64_t padd(int64_t x, int64_t y) { return x < 0 || y < 0 || x + y > DFL_MAX_PARAMS ? -1 : x + y; }

/* The parameters of the model the sizes describe (both embeddings, every
 * layer's projections and norms), or -1 past DFL_MAX_PARAMS: every shape
 * product the model code forms is then below 2^46. Sizes are positive. */
static int64_t count_params(const dfl_model_config *c) {
    int64_t H = c->hidden_size, I = c->intermediate_size, D = c->head_dim;
    int64_t QD = pmul(c->num_attention_heads, D), KD = pmul(c->num_key_value_heads, D);
    int64_t attn = padd(pmul(2, pmul(QD, H)), pmul(2, pmul(KD, H)));
    int64_t layer = padd(padd(attn, pmul(3, pmul(I, H))), padd(pmul(2, H), pmul(2, D)));
    if (c->hybrid) { /* a DeltaNet layer: in_proj_qkv, z, a, b, out_proj, conv; gated q_proj's gate rows */
        int64_t KD2 = pmul(2, pmul(c->lin_k_heads, c->lin_k_dim)), VD = pmul(c->lin_v_heads, c->lin_v_dim);
        int64_t lin = padd(pmul(padd(KD2, VD), padd(H, c->lin_conv)), pmul(3, pmul(VD, H)));
        layer = padd(padd(layer, lin), padd(pmul(QD, H), pmul(2, pmul(c->lin_v_heads, H))));
    }
    if (c->num_experts) { /* the experts, the router, the shared expert and its gate */
        int64_t expert = padd(pmul(3, pmul(c->moe_intermediate_size, H)), H);
        layer = padd(layer, padd(pmul(c->num_experts, expert), pmul(3, pmul(c->shared_expert_intermediate_size, H))));
        layer = padd(layer, H);
    }
    return padd(padd(pmul(2, pmul(c->vocab_size, H)), H), pmul(c->num_hidden_layers, layer));
}

/* The Gated DeltaNet hybrids: Qwen3.5 and Qwen3-Next (the same layers;
 * Qwen3-Next fuses its DeltaNet projections, see target.c) */
static int is_qwen35(const char *arch) {
    return !strcmp(arch, "Qwen3_5ForCausalLM") || !strcmp(arch, "Qwen3_5ForConditionalGeneration") ||
           !strcmp(arch, "Qwen3_5MoeForCausalLM") || !strcmp(arch, "Qwen3_5MoeForConditionalGeneration") ||
           !strcmp(arch, "Qwen3NextForCausalLM");
}

/* The released VLM layouts: text settings under text_config, weights under
 * model.language_model. */
static int is_vlm(const char *arch) {
    return !strcmp(arch, "Qwen3_5ForConditionalGeneration") || !strcmp(arch, "Qwen3_5MoeForConditionalGeneration");
}

/* the Qwen3 and Qwen2 targets, whose sliding layers Qwen3Config and
 * Qwen2Config place alike (parse_qwen_window) */
static int is_qwen_dense(const char *arch) {
    return !strcmp(arch, "Qwen3ForCausalLM") || !strcmp(arch, "Qwen2ForCausalLM");
}

static int is_moe(const char *arch) {
    return !strcmp(arch, "Qwen3MoeForCausalLM") || !strcmp(arch, "Qwen3_5MoeForCausalLM") ||
           !strcmp(arch, "Qwen3_5MoeForConditionalGeneration") || !strcmp(arch, "Qwen3NextForCausalLM");
}

/* "architectures": the model class, the list's first name (transformers
 * writes one). A value of another type is refused as such, not read as an
 * architecture "" that then is not supported. Absent, c->architecture
 * stays "": check_architecture names what is supported. */
static int parse_architecture(dfl_model_config *c, const json_t *j, const char *path) {
    const json_t *a = json_object_get(j, "architectures");
    if (!a) return 0;
    if (!json_is_array(a)) return dfl_err(DFL_EX_DATA, "%s: \"architectures\" is not a list", path);
    if (json_array_size(a) == 0) return dfl_err(DFL_EX_DATA, "%s: \"architectures\" is empty", path);
    if (!json_is_string(json_array_get(a, 0)))
        return dfl_err(DFL_EX_DATA, "%s: \"architectures\"[0] is not a string", path);
    copy_str(c->architecture, sizeof c->architecture, json_array_get(a, 0));
    return 0;
}

/* The architectures dflash runs, checked before any size is read. */
static int check_architecture(const dfl_model_config *c, const char *path, const char *role) {
    static const char *archs[] = {"Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                  "DFlashDraftModel",
                                  "Qwen3_5ForCausalLM",
                                  "Qwen3_5ForConditionalGeneration", "Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM",
                                  "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "GptOssForCausalLM"};
    int known = 0;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) known |= !strcmp(c->architecture, archs[i]);
    if (!known)
        return dfl_err(DFL_EX_DATA, "%s: %s architecture \"%s\" is not supported (supported: Qwen3ForCausalLM, LlamaForCausalLM, "
                       "MistralForCausalLM, Qwen2ForCausalLM, "
                       "Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3MoeForCausalLM, "
                       "Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, GptOssForCausalLM%s)",
                       path, role, c->architecture, !strcmp(role, "drafter") ? ", DFlashDraftModel" : "");
    return 0;
}

/* The expert sizes; and a dense MLP's width wherever a layer has one. */
static int check_moe(const dfl_model_config *c, const json_t *tj, const char *path) {
    if (!c->num_experts) return 0;
    if (c->num_experts < 0) return dfl_err(DFL_EX_DATA, "%s: \"num_experts\" is negative", path);
    if (c->experts_per_tok < 1 || c->experts_per_tok > c->num_experts)
        return dfl_err(DFL_EX_DATA, "%s: \"num_experts_per_tok\" must be between 1 and \"num_experts\"", path);
    /* the CUDA router keeps a token's E probabilities in shared memory */
    if (c->num_experts > 4096)
        return dfl_err(DFL_EX_DATA, "%s: \"num_experts\" %lld is more than 4096", path, (long long)c->num_experts);
    if (c->moe_intermediate_size <= 0) /* gpt-oss names its experts' width intermediate_size */
        return dfl_err(DFL_EX_DATA, "%s: \"%s\" must be positive", path,
                       c->gpt_oss ? "intermediate_size" : "moe_intermediate_size");
    if (c->decoder_sparse_step < 1)
        return dfl_err(DFL_EX_DATA, "%s: \"decoder_sparse_step\" must be positive", path);
    if (c->shared_expert_intermediate_size < 0)
        return dfl_err(DFL_EX_DATA, "%s: \"shared_expert_intermediate_size\" is negative", path);
    json_t *only = json_object_get(tj, "mlp_only_layers"), *v;
    size_t i;
    if (only && !json_is_null(only) && !json_is_array(only))
        return dfl_err(DFL_EX_DATA, "%s: \"mlp_only_layers\" is not a list", path);
    json_array_foreach(only, i, v) {
        if (!json_is_integer(v))
            return dfl_err(DFL_EX_DATA, "%s: \"mlp_only_layers\"[%zu] is not an integer", path, i);
    }
    if (c->intermediate_size > 0) return 0;
    const int64_t L = c->num_hidden_layers; /* at most DFL_MAX_LAYERS */
    unsigned char *sparse = dfl_malloc((size_t)L);
    dfl_model_config_moe_layers(c, L, sparse);
    int64_t l = 0;
    while (l < L && sparse[l]) l++;
    free(sparse);
    if (l < L)
        return dfl_err(DFL_EX_DATA, "%s: layer %lld has a dense MLP but \"intermediate_size\" is not positive", path,
                       (long long)l);
    return 0;
}

/* Is decoder layer i a "sliding_attention" layer by the file? Mistral and
 * Qwen3-MoE with a window: every layer. Else from "layer_types", or else (transformers'
 * Qwen3Config) every layer from max_window_layers on when a window is set;
 * gpt-oss: the even layers. */
static int sliding_layer(const dfl_model_config *c, int64_t i) {
    if (c->window_every_layer) return 1;
    const json_t *lt = json_object_get(c->json, "layer_types");
    if (json_is_array(lt)) {
        const char *ty = json_string_value(json_array_get(lt, (size_t)i));
        return ty && !strcmp(ty, "sliding_attention");
    }
    return c->gpt_oss ? i % 2 == 0 : c->sliding_window > 0 && i >= c->max_window_layers;
}

/* The sliding-window layers of a drafter (spec 2.5; Qwen3.6-27B's drafter:
 * layer_types sliding x4 then full, sliding_window 2048) or of a Qwen3 or
 * Qwen2 target, read as transformers' Qwen3Config and Qwen2Config read
 * them: a window only with "use_sliding_window": true (absent: 4096, null:
 * none), the layers from "layer_types" or else from "max_window_layers"
 * (28) on. A layer named sliding with no window is refused rather than run
 * in full: transformers would run it so, SpecForge refuses it, and the
 * model was likely trained with one. */
static int parse_qwen_window(dfl_model_config *c, const json_t *j, const char *path) {
    int on, rc = get_bool(j, "use_sliding_window", &on, path);
    const json_t *sw = json_object_get(j, "sliding_window");
    if (!rc && on && !(sw && json_is_null(sw))) rc = get_int(j, "sliding_window", 4096, &c->sliding_window, path);
    rc = rc ? rc : get_int(j, "max_window_layers", 28, &c->max_window_layers, path);
    if (rc) return rc;
    if (on && sw && !json_is_null(sw) && c->sliding_window < 1)
        return dfl_err(DFL_EX_DATA, "%s: \"sliding_window\" %lld must be at least 1 (null: no window)", path,
                       (long long)c->sliding_window);
    const json_t *lt = json_object_get(j, "layer_types");
    for (size_t i = 0; json_is_array(lt) && i < json_array_size(lt); i++) {
        const char *ty = json_string_value(json_array_get(lt, i));
        if (!c->sliding_window && ty && !strcmp(ty, "sliding_attention"))
            return dfl_err(DFL_EX_DATA, "%s: \"layer_types\"[%zu] is \"sliding_attention\" but %s: give "
                           "\"use_sliding_window\": true and a \"sliding_window\", or make the layer full_attention",
                           path, i, on ? "\"sliding_window\" is null" : "\"use_sliding_window\" is not true");
    }
    return 0;
}

/* A window on every layer, as transformers' MistralAttention and
 * Qwen3MoeAttention apply it (both ignore "layer_types" and
 * "max_window_layers"). Mistral has no use_sliding_window: a non-null
 * "sliding_window" is the window, and an absent key MistralConfig's default
 * of 4096 (Mistral-7B-v0.1's); v0.2 on, Nemo and Small write null.
 * Qwen3MoeConfig keeps its window (absent: 4096) only with
 * "use_sliding_window": true. */
static int parse_every_layer_window(dfl_model_config *c, const json_t *j, const char *path, int gated) {
    int on = 1, rc = gated ? get_bool(j, "use_sliding_window", &on, path) : 0;
    const json_t *sw = json_object_get(j, "sliding_window");
    if (rc || !on || json_is_null(sw)) return rc;
    if ((rc = get_int(j, "sliding_window", 4096, &c->sliding_window, path))) return rc;
    if (c->sliding_window < 1)
        return dfl_err(DFL_EX_DATA, "%s: \"sliding_window\" %lld must be at least 1 (null: no window)", path,
                       (long long)c->sliding_window);
    c->window_every_layer = 1;
    return 0;
}

/* Does the file's "use_sliding_window" mean something to dflash (a
 * drafter's and a Qwen3, Qwen2 or Qwen3-MoE target's), or is true refused? */
static int reads_use_sliding_window(const dfl_model_config *c, int drafter) {
    return drafter || is_qwen_dense(c->architecture) || !strcmp(c->architecture, "Qwen3MoeForCausalLM");
}

/* A size read from KEY that must be at least `min`. */
typedef struct {
    const char *key;
    int64_t v, min;
} size_key;

/* The first of n sizes below its minimum, refused by key and value:
 * "head_dim" 0 must be positive (a VLM's key under text_config; an absent
 * key is named with the default it took, as head_dim's from hidden_size /
 * num_attention_heads). */
static int check_size_keys(const size_key *s, size_t n, const dfl_model_config *c, const json_t *tj, const char *path) {
    const char *pre = tj != c->json ? "text_config." : "";
    for (size_t i = 0; i < n; i++) {
        if (s[i].v >= s[i].min) continue;
        return dfl_err(DFL_EX_DATA, "%s: \"%s%s\" %lld must be %s%s", path, pre, s[i].key, (long long)s[i].v,
                       s[i].min ? "positive" : "at least 0", json_object_get(tj, s[i].key) ? "" : " (absent: the default)");
    }
    return 0;
}

/* The sizes every architecture needs, each positive; intermediate_size may
 * be 0 with experts (a layer without a dense MLP; check_moe). */
static int check_sizes(const dfl_model_config *c, const json_t *tj, const char *path) {
    const size_key s[] = {
        {"hidden_size", c->hidden_size, 1},
        {"num_hidden_layers", c->num_hidden_layers, 1},
        {"num_attention_heads", c->num_attention_heads, 1},
        {"num_key_value_heads", c->num_key_value_heads, 1},
        {"head_dim", c->head_dim, 1},
        {"vocab_size", c->vocab_size, 1},
        {"intermediate_size", c->intermediate_size, c->num_experts ? 0 : 1},
    };
    return check_size_keys(s, sizeof s / sizeof s[0], c, tj, path);
}

/* The Gated DeltaNet sizes of the Qwen3.5 and Qwen3-Next hybrids. */
static int check_hybrid_sizes(const dfl_model_config *c, const json_t *tj, const char *path) {
    const size_key s[] = {
        {"linear_num_key_heads", c->lin_k_heads, 1},
        {"linear_num_value_heads", c->lin_v_heads, 1},
        {"linear_key_head_dim", c->lin_k_dim, 1},
        {"linear_value_head_dim", c->lin_v_dim, 1},
        {"linear_conv_kernel_dim", c->lin_conv, 1},
        {"full_attention_interval", c->full_attention_interval, 1},
    };
    return check_size_keys(s, sizeof s / sizeof s[0], c, tj, path);
}

/* Refuse what the model code would silently get wrong. */
static int check_supported(const dfl_model_config *c, const json_t *tj, const char *path, int drafter) {
    const json_t *j = tj;
    int rc;
    static const char *off[] = {"mlp_bias", "use_sliding_window", "attention_bias"};
    /* gpt-oss reads attention_bias (parse_gpt_oss); a drafter and a Qwen3,
     * Qwen2 or Qwen3-MoE target may have sliding layers */
    for (size_t i = 0; i < sizeof off / sizeof off[0] - (size_t)c->gpt_oss; i++) {
        int on;
        if (reads_use_sliding_window(c, drafter) && !strcmp(off[i], "use_sliding_window")) continue;
        if ((rc = get_bool(j, off[i], &on, path))) return rc;
        if (on) return dfl_err(DFL_EX_DATA, "%s: \"%s\": true is not supported", path, off[i]);
    }
    json_t *act = json_object_get(j, "hidden_act");
    if (act && strcmp(json_string_value(act) ? json_string_value(act) : "", "silu"))
        return dfl_err(DFL_EX_DATA, "%s: \"hidden_act\" must be \"silu\"", path);
    json_t *lt = json_object_get(j, "layer_types"), *v;
    size_t i;
    json_array_foreach(lt, i, v) {
        const char *ty = json_string_value(v);
        if (!ty) return dfl_err(DFL_EX_DATA, "%s: \"layer_types\"[%zu] is not a string", path, i);
        const char *other = c->hybrid                                                      ? "linear_attention"
                            : c->gpt_oss || drafter || is_qwen_dense(c->architecture) ? "sliding_attention"
                                                                                      : NULL;
        if (strcmp(ty, "full_attention") && (!other || strcmp(ty, other)))
            return dfl_err(DFL_EX_DATA, "%s: \"layer_types\"[%zu] is \"%s\"; only full_attention%s%s %s supported", path,
                           i, ty, other ? " and " : "", other ? other : "", other ? "are" : "is");
    }
    if (lt && !json_is_null(lt) && (!json_is_array(lt) || (int64_t)json_array_size(lt) != c->num_hidden_layers))
        return dfl_err(DFL_EX_DATA, "%s: \"layer_types\" must list one type for each of the %lld layers", path,
                       (long long)c->num_hidden_layers);
    if ((rc = check_sizes(c, tj, path))) return rc;
    if (c->head_dim % 2) return dfl_err(DFL_EX_DATA, "%s: \"head_dim\" %lld must be even for RoPE", path, (long long)c->head_dim);
    if (c->num_attention_heads % c->num_key_value_heads)
        return dfl_err(DFL_EX_DATA, "%s: num_attention_heads %lld is not a multiple of num_key_value_heads %lld", path,
                       (long long)c->num_attention_heads, (long long)c->num_key_value_heads);
    if (c->rotary_dim != c->head_dim && !c->hybrid)
        return dfl_err(DFL_EX_DATA, "%s: a partial_rotary_factor other than 1 is supported for the Qwen3.5 and Qwen3-Next hybrids only", path);
    if (c->rotary_dim < 2 || c->rotary_dim % 2 || c->rotary_dim > c->head_dim)
        return dfl_err(DFL_EX_DATA, "%s: \"partial_rotary_factor\" gives %lld rotary dims of a %lld-dim head; they must be "
                       "even and at least 2", path, (long long)c->rotary_dim, (long long)c->head_dim);
    if (c->hybrid) {
        if ((rc = check_hybrid_sizes(c, tj, path))) return rc;
        if (c->lin_v_heads % c->lin_k_heads)
            return dfl_err(DFL_EX_DATA, "%s: linear_num_value_heads %lld is not a multiple of linear_num_key_heads %lld",
                           path, (long long)c->lin_v_heads, (long long)c->lin_k_heads);
        if (c->lin_conv > 8)
            return dfl_err(DFL_EX_DATA, "%s: \"linear_conv_kernel_dim\" %lld is more than 8", path, (long long)c->lin_conv);
    }
    /* the model code computes in f32: the f32 value must be positive and finite */
    float eps = (float)c->rms_norm_eps;
    if (!(eps > 0 && isfinite(eps))) return dfl_err(DFL_EX_DATA, "%s: \"rms_norm_eps\" must be a positive float", path);
    if (c->num_hidden_layers > DFL_MAX_LAYERS)
        return dfl_err(DFL_EX_DATA, "%s: \"num_hidden_layers\" %lld is more than %d", path,
                       (long long)c->num_hidden_layers, DFL_MAX_LAYERS);
    /* after the layer count is bounded: it scans every layer */
    if ((rc = check_moe(c, tj, path))) return rc;
    if (count_params(c) < 0)
        return dfl_err(DFL_EX_DATA, "%s: the sizes imply more than 2^46 parameters", path);
    return 0;
}

/* The pretraining length of a scaled RoPE (llama3, yarn), as transformers
 * 5's standardize_rope_params finds it: the top-level key (Phi-3's
 * spelling) before the scaling's, else max_position_embeddings. */
static int parse_original_length(dfl_model_config *c, const json_t *j, const json_t *scaling, const char *path) {
    const int64_t fallback = c->max_position_embeddings > 0 ? c->max_position_embeddings : -2;
    const json_t *from = json_object_get(j, "original_max_position_embeddings") ? j : scaling;
    return get_int(from, "original_max_position_embeddings", fallback, &c->rope_original_max_pos, path);
}

/* Llama 3.1's frequency bands (transformers _compute_llama3_parameters). */
static int parse_llama3(dfl_model_config *c, const json_t *j, const json_t *scaling, const char *path) {
    int rc;
    c->rope_type = DFL_ROPE_LLAMA3;
    if ((rc = get_num(scaling, "factor", NAN, &c->rope_factor, path))) return rc;
    if ((rc = get_num(scaling, "low_freq_factor", NAN, &c->rope_low_freq_factor, path))) return rc;
    if ((rc = get_num(scaling, "high_freq_factor", NAN, &c->rope_high_freq_factor, path))) return rc;
    if ((rc = parse_original_length(c, j, scaling, path))) return rc;
    /* As f32 (how dfl_rope_inv_freq computes): factor >= 1 only lowers
     * frequencies; 0 < low < high (finite) and a positive original length
     * keep the interpolation finite. */
    float factor = (float)c->rope_factor, lo = (float)c->rope_low_freq_factor, hi = (float)c->rope_high_freq_factor;
    if (!(factor >= 1 && isfinite(factor)) || !(lo > 0 && hi > lo && isfinite(hi)) || c->rope_original_max_pos < 1)
        return dfl_err(DFL_EX_DATA, "%s: llama3 rope factors are inconsistent", path);
    return 0;
}

/* YaRN's mscale (the paper's eq. 21): 0.1 m ln(s) + 1, and 1 for s <= 1. */
static double yarn_mscale(double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * log(s) + 1.0; }

/* A number key where absent, null and 0 all mean the default, as
 * transformers reads YaRN's optional keys (`get(key) or default`). */
static int get_num_or(const json_t *o, const char *key, double def, double *out, const char *path) {
    int rc = get_num(o, key, def, out, path);
    if (!rc && *out == 0) *out = def;
    return rc;
}

/* YaRN (transformers 5 _compute_yarn_parameters): the factor as given
 * (transformers 4.x replaced it by max_position_embeddings /
 * original_max_position_embeddings when both were present); "truncate"
 * absent is true, null false (transformers: get("truncate", True)). */
static int parse_yarn(dfl_model_config *c, const json_t *j, const json_t *scaling, const char *path) {
    int rc, trunc = 1;
    double att = NAN, ms = 0, ms_all = 0;
    c->rope_type = DFL_ROPE_YARN;
    if ((rc = get_num(scaling, "factor", NAN, &c->rope_factor, path))) return rc;
    if ((rc = parse_original_length(c, j, scaling, path))) return rc;
    if ((rc = get_num_or(scaling, "beta_fast", 32, &c->rope_beta_fast, path))) return rc;
    if ((rc = get_num_or(scaling, "beta_slow", 1, &c->rope_beta_slow, path))) return rc;
    const json_t *af = json_object_get(scaling, "attention_factor");
    if (af && !json_is_null(af) && (rc = get_num(scaling, "attention_factor", NAN, &att, path))) return rc;
    if ((rc = get_num(scaling, "mscale", 0, &ms, path)) || (rc = get_num(scaling, "mscale_all_dim", 0, &ms_all, path)))
        return rc;
    json_t *t = json_object_get(scaling, "truncate");
    if (t && !json_is_null(t) && !json_is_boolean(t))
        return dfl_err(DFL_EX_DATA, "%s: \"truncate\" is not true or false", path);
    if (json_is_false(t) || json_is_null(t)) trunc = 0;
    c->rope_truncate = trunc;
    if (!(c->rope_factor >= 1 && isfinite((float)c->rope_factor)))
        return dfl_err(DFL_EX_DATA, "%s: yarn rope \"factor\" must be a float of at least 1", path);
    if (c->rope_original_max_pos < 1)
        return dfl_err(DFL_EX_DATA, "%s: yarn rope \"original_max_position_embeddings\" must be positive", path);
    if (!(c->rope_beta_fast > 0 && c->rope_beta_slow > 0 && isfinite(c->rope_beta_fast) && isfinite(c->rope_beta_slow)))
        return dfl_err(DFL_EX_DATA, "%s: yarn rope \"beta_fast\" and \"beta_slow\" must be positive", path);
    if (isnan(att))
        att = ms != 0 && ms_all != 0 ? yarn_mscale(c->rope_factor, ms) / yarn_mscale(c->rope_factor, ms_all)
                                     : yarn_mscale(c->rope_factor, 1);
    if (!(att > 0 && isfinite((float)att)))
        return dfl_err(DFL_EX_DATA, "%s: yarn rope attention factor %g is not a positive float", path, att);
    c->rope_attention_factor = att;
    return 0;
}

/* rope_theta/rope_scaling (4.x) or rope_parameters (5.x). Each is an
 * object or null (transformers' Optional[dict]): any other value is
 * refused, not read as no scaling; so is a rope_type that is not a string. */
static int parse_rope(dfl_model_config *c, const json_t *j, const char *path) {
    json_t *rp = json_object_get(j, "rope_parameters"), *rs = json_object_get(j, "rope_scaling");
    static const char *const keys[2] = {"rope_parameters", "rope_scaling"};
    const json_t *given[2] = {rp, rs};
    for (int i = 0; i < 2; i++)
        if (given[i] && !json_is_null(given[i]) && !json_is_object(given[i]))
            return dfl_err(DFL_EX_DATA, "%s: \"%s\" is not an object or null", path, keys[i]);
    const json_t *scaling = json_is_object(rp) ? rp : (json_is_object(rs) ? rs : NULL);
    const double theta_def = c->gpt_oss ? 150000.0 : 10000.0; /* GptOssConfig.default_theta */
    int rc = get_num(json_is_object(rp) ? rp : j, "rope_theta", json_is_object(rp) ? NAN : theta_def, &c->rope_theta, path);
    if (rc && json_is_object(rp)) rc = get_num(j, "rope_theta", NAN, &c->rope_theta, path);
    if (rc) return rc;
    /* f32 RoPE: a base of at least 1 keeps every frequency in (0, 1] */
    if (!(c->rope_theta >= 1 && isfinite((float)c->rope_theta)))
        return dfl_err(DFL_EX_DATA, "%s: \"rope_theta\" must be a float of at least 1", path);
    c->rope_type = DFL_ROPE_DEFAULT;
    c->rope_attention_factor = 1;
    if (!scaling) return 0;
    const char *tkey = json_object_get(scaling, "rope_type") ? "rope_type" : "type";
    json_t *t = json_object_get(scaling, tkey);
    if (t && !json_is_null(t) && !json_is_string(t))
        return dfl_err(DFL_EX_DATA, "%s: \"%s\".%s is not a string", path, scaling == rp ? keys[0] : keys[1], tkey);
    const char *type = json_string_value(t) ? json_string_value(t) : "default";
    if (!strcmp(type, "default")) return 0;
    if (!strcmp(type, "llama3")) return parse_llama3(c, j, scaling, path);
    if (!strcmp(type, "yarn")) return parse_yarn(c, j, scaling, path);
    return dfl_err(DFL_EX_DATA, "%s: rope type \"%s\" is not supported (supported: default, llama3, yarn)", path, type);
}

/* bos_token_id (an integer or null) and eos_token_id (an integer, a list
 * of them, or null), as transformers' configs give them. A present value
 * of another type ("x", 5.0, a list holding a string) is refused, not read
 * as no token: online scoring would then never stop at an end of sequence.
 * `pre` names the object they are in ("text_config." or ""). */
static int parse_token_ids(dfl_model_config *c, const json_t *j, const char *pre, const char *path) {
    json_t *b = json_object_get(j, "bos_token_id"), *e = json_object_get(j, "eos_token_id"), *v;
    if (b && !json_is_null(b) && !json_is_integer(b))
        return dfl_err(DFL_EX_DATA, "%s: \"%sbos_token_id\" is not an integer or null", path, pre);
    c->bos_token_id = json_is_integer(b) ? json_integer_value(b) : -1;
    c->n_eos = 0;
    if (json_is_integer(e)) {
        c->eos_token_ids[c->n_eos++] = json_integer_value(e);
    } else if (json_is_array(e)) {
        size_t i;
        json_array_foreach(e, i, v) {
            if (!json_is_integer(v))
                return dfl_err(DFL_EX_DATA, "%s: \"%seos_token_id\"[%zu] is not an integer", path, pre, i);
            if (c->n_eos == DFL_MAX_EOS)
                return dfl_err(DFL_EX_DATA, "%s: \"%seos_token_id\" lists %zu ids, more than %d", path, pre,
                               json_array_size(e), DFL_MAX_EOS);
            c->eos_token_ids[c->n_eos++] = json_integer_value(v);
        }
    } else if (e && !json_is_null(e)) {
        return dfl_err(DFL_EX_DATA, "%s: \"%seos_token_id\" is not an integer, a list of integers or null", path, pre);
    }
    return 0;
}

/* The Qwen3.5 keys (defaults as transformers' Qwen3_5TextConfig). */
static int parse_hybrid(dfl_model_config *c, const json_t *tj, const char *path) {
    int rc = 0, gate = 1; /* Qwen3.5's attention has the output gate unless told otherwise */
    rc = rc ? rc : get_int(tj, "linear_num_key_heads", 16, &c->lin_k_heads, path);
    rc = rc ? rc : get_int(tj, "linear_num_value_heads", 32, &c->lin_v_heads, path);
    rc = rc ? rc : get_int(tj, "linear_key_head_dim", 128, &c->lin_k_dim, path);
    rc = rc ? rc : get_int(tj, "linear_value_head_dim", 128, &c->lin_v_dim, path);
    rc = rc ? rc : get_int(tj, "linear_conv_kernel_dim", 4, &c->lin_conv, path);
    rc = rc ? rc : get_int(tj, "full_attention_interval", 4, &c->full_attention_interval, path);
    if (!rc && json_object_get(tj, "attn_output_gate")) rc = get_bool(tj, "attn_output_gate", &gate, path);
    c->attn_output_gate = gate;
    c->norm_plus_one = 1;
    return rc;
}

/* The mixture-of-experts keys (defaults as transformers' Qwen3MoeConfig,
 * Qwen3_5MoeTextConfig and Qwen3NextConfig). Qwen3.5-MoE always
 * renormalises the k weights and always has a shared expert; Qwen3-MoE
 * renormalises by norm_topk_prob (default false) and has no shared expert;
 * Qwen3-Next has the shared expert and norm_topk_prob (default true). */
static int parse_moe(dfl_model_config *c, const json_t *tj, const char *path) {
    int rc = 0;
    const int q35 = c->hybrid, next = c->qwen3_next;
    /* Qwen3-MoE: transformers 5 writes "num_local_experts" and maps
     * "num_experts" onto it (the released files say "num_experts"); given
     * both, it keeps num_local_experts: two different counts are refused.
     * Qwen3_5MoeTextConfig reads "num_experts" alone. */
    if (!q35 && json_object_get(tj, "num_local_experts")) {
        int64_t local = 0;
        rc = rc ? rc : get_int(tj, "num_local_experts", 0, &local, path);
        rc = rc ? rc : get_int(tj, "num_experts", local, &c->num_experts, path);
        if (!rc && c->num_experts != local)
            return dfl_err(DFL_EX_DATA, "%s: \"num_experts\" %lld and \"num_local_experts\" %lld disagree", path,
                           (long long)c->num_experts, (long long)local);
    } else {
        rc = rc ? rc : get_int(tj, "num_experts", next ? 512 : q35 ? 256 : 128, &c->num_experts, path);
    }
    rc = rc ? rc : get_int(tj, "num_experts_per_tok", next ? 10 : 8, &c->experts_per_tok, path);
    rc = rc ? rc : get_int(tj, "moe_intermediate_size", q35 ? 512 : 768, &c->moe_intermediate_size, path);
    rc = rc ? rc : get_int(tj, "decoder_sparse_step", 1, &c->decoder_sparse_step, path);
    if (q35) {
        rc = rc ? rc : get_int(tj, "shared_expert_intermediate_size", 512, &c->shared_expert_intermediate_size, path);
        c->norm_topk_prob = 1;
        if (next && json_object_get(tj, "norm_topk_prob")) rc = rc ? rc : get_bool(tj, "norm_topk_prob", &c->norm_topk_prob, path);
    } else {
        rc = rc ? rc : get_bool(tj, "norm_topk_prob", &c->norm_topk_prob, path);
    }
    if (!rc && c->num_experts == 0)
        return dfl_err(DFL_EX_DATA, "%s: \"num_experts\" is 0 in a mixture-of-experts architecture", path);
    return rc;
}

/* The share of each head RoPE rotates: in rope_parameters (5.x) or beside
 * it; Qwen3.5 defaults to 0.25, the others to all of it. */
static int parse_rotary_dim(dfl_model_config *c, const json_t *tj, const char *path) {
    json_t *rp = json_object_get(tj, "rope_parameters");
    double f = 1.0;
    int rc = get_num(tj, "partial_rotary_factor", c->hybrid ? 0.25 : 1.0, &f, path);
    if (!rc && json_is_object(rp) && json_object_get(rp, "partial_rotary_factor"))
        rc = get_num(rp, "partial_rotary_factor", 1.0, &f, path);
    if (rc) return rc;
    if (!(f > 0 && f <= 1)) return dfl_err(DFL_EX_DATA, "%s: \"partial_rotary_factor\" must be in (0, 1]", path);
    c->rotary_dim = (int64_t)((double)c->head_dim * f); /* int(head_dim * factor), as transformers */
    return 0;
}

/* The gpt-oss keys (defaults as transformers' GptOssConfig). Its
 * "intermediate_size" is the experts' width; every layer is sparse; the
 * router's softmax over the top k logits is the softmax over all of them
 * renormalised over the k (norm_topk_prob). A null sliding_window leaves
 * the sliding layers at full attention (transformers refuses to run it). */
static int parse_gpt_oss(dfl_model_config *c, const json_t *j, const char *path) {
    int rc = 0, bias = 1;
    int64_t local = 0;
    if (json_object_get(j, "attention_bias")) rc = get_bool(j, "attention_bias", &bias, path);
    c->qkv_bias = c->o_bias = bias;
    /* "num_experts" is an alias of num_local_experts (GptOssConfig.attribute_map): either alone names the count */
    const json_t *lv = json_object_get(j, "num_local_experts");
    rc = rc ? rc : get_int(j, "num_local_experts", 128, &local, path);
    rc = rc ? rc : get_int(j, "num_experts", local, &c->num_experts, path);
    if (!rc && lv && !json_is_null(lv) && c->num_experts != local)
        return dfl_err(DFL_EX_DATA, "%s: \"num_experts\" %lld and \"num_local_experts\" %lld disagree", path,
                       (long long)c->num_experts, (long long)local);
    rc = rc ? rc : get_int(j, "num_experts_per_tok", 4, &c->experts_per_tok, path);
    rc = rc ? rc : get_int(j, "intermediate_size", 2880, &c->moe_intermediate_size, path);
    /* absent: GptOssConfig's 128; null (transformers 5.25 then fails in
     * create_sliding_window_causal_mask): no window, as OpenAI's reference
     * code reads a window of 0 */
    const json_t *sw = json_object_get(j, "sliding_window");
    rc = rc ? rc : get_int(j, "sliding_window", sw ? 0 : 128, &c->sliding_window, path);
    rc = rc ? rc : get_num(j, "swiglu_alpha", 1.702, &c->swiglu_alpha, path);
    rc = rc ? rc : get_num(j, "swiglu_limit", 7.0, &c->swiglu_limit, path);
    if (rc) return rc;
    c->intermediate_size = 0;
    c->decoder_sparse_step = 1;
    c->norm_topk_prob = 1;
    if (c->num_experts == 0) return dfl_err(DFL_EX_DATA, "%s: \"num_local_experts\" is 0", path);
    if (c->sliding_window < 0) return dfl_err(DFL_EX_DATA, "%s: \"sliding_window\" is negative", path);
    if (!isfinite((float)c->swiglu_alpha) || !isfinite((float)c->swiglu_limit))
        return dfl_err(DFL_EX_DATA, "%s: \"swiglu_alpha\" and \"swiglu_limit\" must be finite floats", path);
    const json_t *q = json_object_get(j, "quantization_config"), *m = json_object_get(q, "quant_method");
    if (q && !json_is_null(q) && (!json_is_string(m) || strcmp(json_string_value(m), "mxfp4")))
        return dfl_err(DFL_EX_DATA, "%s: \"quantization_config\": only \"quant_method\": \"mxfp4\" is supported", path);
    if (!json_is_object(json_object_get(j, "rope_scaling")) && !json_is_object(json_object_get(j, "rope_parameters")))
        return dfl_err(DFL_EX_DATA, "%s: a gpt-oss config without \"rope_scaling\" or \"rope_parameters\" is not "
                       "supported (the released files give YaRN's)", path);
    return 0;
}

int dfl_model_config_parse(dfl_model_config *c, const char *text, size_t len, const char *path, const char *role) {
    memset(c, 0, sizeof *c);
    json_error_t je;
    json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!j || !json_is_object(j)) {
        json_decref(j);
        return dfl_err(DFL_EX_DATA, "%s: not a JSON object: %s (line %d)", path, j ? "" : je.text, je.line);
    }
    c->json = j;
    snprintf(c->digest, sizeof c->digest, "%016llx", (unsigned long long)XXH64(text, len, 0));
    copy_str(c->model_type, sizeof c->model_type, json_object_get(j, "model_type"));
    copy_str(c->dtype, sizeof c->dtype, json_object_get(j, "dtype") ? json_object_get(j, "dtype") : json_object_get(j, "torch_dtype"));
    /* The Qwen3.5 checkpoints are VLMs: the language model's settings are
     * its "text_config", its weights under model.language_model. */
    int rc = parse_architecture(c, j, path);
    rc = rc ? rc : check_architecture(c, path, role);
    if (rc) return rc;
    c->hybrid = is_qwen35(c->architecture);
    c->qwen3_next = !strcmp(c->architecture, "Qwen3NextForCausalLM");
    const json_t *tj = j;
    snprintf(c->weight_prefix, sizeof c->weight_prefix, "model.");
    if (is_vlm(c->architecture)) {
        tj = json_object_get(j, "text_config");
        if (!json_is_object(tj)) return dfl_err(DFL_EX_DATA, "%s: \"text_config\" is missing or not an object", path);
        snprintf(c->weight_prefix, sizeof c->weight_prefix, "model.language_model.");
        if (!c->dtype[0]) copy_str(c->dtype, sizeof c->dtype, json_object_get(tj, "dtype"));
    }
    const int moe = is_moe(c->architecture);
    c->gpt_oss = !strcmp(c->architecture, "GptOssForCausalLM");
    /* Absent keys: the defaults of Qwen3_5TextConfig (4 KV heads, 256-wide
     * heads), Qwen3_5MoeTextConfig (2 KV heads; no dense MLP, and no
     * intermediate_size) and Qwen3MoeConfig (4 KV heads, a dense width of
     * 6144 for the layers that have one) */
    const int64_t kv_def = c->gpt_oss ? 8 : moe ? (c->hybrid ? 2 : 4) : c->hybrid ? 4 : -1;
    rc = rc ? rc : get_int(tj, "hidden_size", -2, &c->hidden_size, path);
    rc = rc ? rc : get_int(tj, "intermediate_size", moe ? (c->qwen3_next ? 5632 : c->hybrid ? 0 : 6144) : c->gpt_oss ? 2880 : -2,
                           &c->intermediate_size, path);
    rc = rc ? rc : get_int(tj, "num_hidden_layers", -2, &c->num_hidden_layers, path);
    rc = rc ? rc : get_int(tj, "num_attention_heads", -2, &c->num_attention_heads, path);
    rc = rc ? rc : get_int(tj, "num_key_value_heads", kv_def > 0 ? kv_def : c->num_attention_heads, &c->num_key_value_heads, path);
    rc = rc ? rc : get_int(tj, "head_dim", c->hybrid ? 256 : c->gpt_oss ? 64 : c->num_attention_heads > 0 ? c->hidden_size / c->num_attention_heads : 0,
                           &c->head_dim, path);
    rc = rc ? rc : get_int(tj, "vocab_size", -2, &c->vocab_size, path);
    rc = rc ? rc : get_int(tj, "max_position_embeddings", 0, &c->max_position_embeddings, path);
    rc = rc ? rc : get_num(tj, "rms_norm_eps", c->gpt_oss ? 1e-5 : 1e-6, &c->rms_norm_eps, path);
    rc = rc ? rc : parse_rope(c, tj, path);
    rc = rc ? rc : parse_rotary_dim(c, tj, path);
    if (!rc && c->hybrid) rc = parse_hybrid(c, tj, path);
    if (!rc && moe) rc = parse_moe(c, tj, path);
    if (!rc && c->gpt_oss) rc = parse_gpt_oss(c, tj, path);
    const int drafter = !strcmp(role, "drafter");
    if (!rc && (drafter || is_qwen_dense(c->architecture)) && !c->gpt_oss && !c->hybrid) rc = parse_qwen_window(c, tj, path);
    if (!rc && !strcmp(c->architecture, "MistralForCausalLM")) rc = parse_every_layer_window(c, tj, path, 0);
    if (!rc && !strcmp(c->architecture, "Qwen3MoeForCausalLM")) rc = parse_every_layer_window(c, tj, path, 1);
    int tie = 0;
    /* The VLM's LM head is tied by its top-level key alone (absent: false),
     * as transformers' Qwen3_5Config; text_config's copy is not read. */
    rc = rc ? rc : get_bool(j, "tie_word_embeddings", &tie, path);
    if (rc) return rc;
    c->tie_word_embeddings = tie;
    /* Qwen2 (Qwen2.5, DeepSeek-R1-Distill-Qwen): Llama's layer plus biases on q, k and v */
    if (!c->gpt_oss) c->qkv_bias = !strcmp(c->architecture, "Qwen2ForCausalLM");
    c->qk_norm = strcmp(c->architecture, "LlamaForCausalLM") && strcmp(c->architecture, "MistralForCausalLM") &&
                 strcmp(c->architecture, "Qwen2ForCausalLM") && !c->gpt_oss;
    const json_t *ids = json_object_get(tj, "eos_token_id") ? tj : j;
    if ((rc = parse_token_ids(c, ids, ids != j ? "text_config." : "", path))) return rc;
    return check_supported(c, tj, path, drafter);
}

int dfl_model_config_linear_layer(const dfl_model_config *c, int64_t i) {
    if (!c->hybrid) return 0;
    const json_t *j = c->json, *tj = json_object_get(j, "text_config");
    const json_t *lt = json_object_get(json_is_object(tj) ? tj : j, "layer_types");
    if (json_is_array(lt)) {
        const char *ty = json_string_value(json_array_get(lt, (size_t)i));
        return ty && !strcmp(ty, "linear_attention");
    }
    return (i + 1) % c->full_attention_interval != 0;
}

int64_t dfl_model_config_window(const dfl_model_config *c, int64_t i) {
    return c->sliding_window > 0 && sliding_layer(c, i) ? c->sliding_window : 0;
}

int dfl_model_config_moe_layer(const dfl_model_config *c, int64_t i) {
    if (!c->num_experts) return 0;
    if (c->hybrid && !c->qwen3_next) return 1; /* Qwen3.5-MoE; Qwen3-Next as Qwen3-MoE */
    const json_t *only = json_object_get(c->json, "mlp_only_layers"), *v;
    size_t k;
    json_array_foreach(only, k, v) {
        if (json_is_integer(v) && json_integer_value(v) == i) return 0;
    }
    return (i + 1) % c->decoder_sparse_step == 0;
}

/* The same for layers [0, n) in one pass over mlp_only_layers (which may
 * be as long as the file allows: a scan of it per layer is quadratic). */
void dfl_model_config_moe_layers(const dfl_model_config *c, int64_t n, unsigned char *sparse) {
    for (int64_t i = 0; i < n; i++)
        sparse[i] = c->num_experts && ((c->hybrid && !c->qwen3_next) || (i + 1) % c->decoder_sparse_step == 0);
    if (!c->num_experts || (c->hybrid && !c->qwen3_next)) return;
    const json_t *only = json_object_get(c->json, "mlp_only_layers"), *v;
    size_t k;
    json_array_foreach(only, k, v) {
        json_int_t i = json_is_integer(v) ? json_integer_value(v) : -1;
        if (i >= 0 && i < n) sparse[i] = 0;
    }
}

int dfl_model_config_load(dfl_model_config *c, const char *path, const char *role) {
    char *text = NULL;
    size_t len = 0;
    memset(c, 0, sizeof *c);
    int rc = dfl_read_file(path, 16u << 20, "config.json", &text, &len);
    if (rc) return rc;
    rc = dfl_model_config_parse(c, text, len, path, role);
    free(text);
    return rc;
}

int dfl_model_config_load_dir(dfl_model_config *c, const char *dir, const char *role) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path) {
        memset(c, 0, sizeof *c);
        return dfl_err(DFL_EX_NOINPUT, "%s: path too long", dir);
    }
    return dfl_model_config_load(c, path, role);
}

void dfl_model_config_free(dfl_model_config *c) {
    json_decref(c->json);
    c->json = NULL;
}

/* transformers _compute_llama3_parameters, on the default frequencies */
static void llama3_bands(const dfl_model_config *c, float *inv_freq, int64_t half) {
    float factor = (float)c->rope_factor, lo = (float)c->rope_low_freq_factor, hi = (float)c->rope_high_freq_factor;
    float old = (float)c->rope_original_max_pos, low_wl = old / lo, high_wl = old / hi;
    for (int64_t i = 0; i < half; i++) {
        float wl = 2.0f * (float)M_PI / inv_freq[i], f = inv_freq[i];
        float scaled = wl > low_wl ? f / factor : f;
        if (!(wl < high_wl) && !(wl > low_wl)) {
            float s = (old / wl - lo) / (hi - lo);
            scaled = (1.0f - s) * scaled / factor + s * scaled;
        }
        inv_freq[i] = scaled;
    }
}

/* The dimension (of `rot`) whose wavelength fits `rotations` times into the
 * pretraining length (in double, as transformers' Python). */
static double yarn_dim(double rotations, int64_t rot, double base, double orig) {
    return (double)rot * log(orig / (rotations * 2 * M_PI)) / (2 * log(base));
}

/* transformers _compute_yarn_parameters: each frequency is the pretrained
 * one (extrapolation) below the ramp, the one divided by factor
 * (interpolation) above it, a linear mix on it; in f32 as torch computes,
 * from the same powers as the default frequencies. */
static void yarn_mix(const dfl_model_config *c, float *inv_freq, int64_t rot) {
    double base = c->rope_theta, orig = (double)c->rope_original_max_pos;
    double low = yarn_dim(c->rope_beta_fast, rot, base, orig), high = yarn_dim(c->rope_beta_slow, rot, base, orig);
    if (c->rope_truncate) low = floor(low), high = ceil(high);
    low = fmax(low, 0), high = fmin(high, (double)(rot - 1));
    if (low == high) high += 0.001; /* transformers: no division by zero */
    const float lo = (float)low, span = (float)(high - low), factor = (float)c->rope_factor;
    for (int64_t i = 0; i < rot / 2; i++) {
        float pos_freq = powf((float)base, (float)(2 * i) / (float)rot);
        float ramp = fminf(fmaxf(((float)i - lo) / span, 0.0f), 1.0f), extra = 1.0f - ramp;
        float interp_part = (1.0f / (factor * pos_freq)) * (1.0f - extra);
        float extra_part = (1.0f / pos_freq) * extra;
        inv_freq[i] = interp_part + extra_part;
    }
}

void dfl_rope_inv_freq(const dfl_model_config *c, float *inv_freq) {
    int64_t half = c->head_dim / 2, rot = c->rotary_dim ? c->rotary_dim : c->head_dim;
    float base = (float)c->rope_theta;
    for (int64_t i = 0; i < half; i++) inv_freq[i] = 2 * i < rot ? 1.0f / powf(base, (float)(2 * i) / (float)rot) : 0.0f;
    if (c->rope_type == DFL_ROPE_LLAMA3) llama3_bands(c, inv_freq, half);
    if (c->rope_type == DFL_ROPE_YARN) yarn_mix(c, inv_freq, rot);
}

float dfl_rope_scale(const dfl_model_config *c) {
    return c->rope_type == DFL_ROPE_YARN ? (float)c->rope_attention_factor : 1.0f;
}

void dfl_default_layer_ids(int L, int n, int *ids) {
    if (n == 1) {
        ids[0] = L / 2;
        return;
    }
    double start = 1, end = L - 3;
    for (int i = 0; i < n; i++) ids[i] = (int)nearbyint(start + i * (end - start) / (n - 1)); /* half to even */
}
