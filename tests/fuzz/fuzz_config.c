/* fuzz_config: the config.json readers on arbitrary bytes, from memory.
 *
 *   dfl_model_config_parse (role "target"): a Qwen3/Llama/Qwen3.5 config.json,
 *     dense or mixture of experts
 *   dfl_drafter_config_parse: a DFlash drafter config.json (z-lab layout)
 *   dfl_extract_layer_ids: dflash-extract --drafter-config (takes a path:
 *     the bytes go to a memfd opened as /proc/self/fd/N), for targets of
 *     1, 2, 3, 6 and 36 layers
 *
 * Every input must give success or DFL_EX_DATA. After a success the harness
 * checks what the model code relies on (and abort()s when it does not hold):
 * positive sizes, head_dim even, query heads a multiple of the KV heads, the
 * weight shapes the model forms (heads * head_dim, vocab * hidden, ...) and
 * their total fit in int64 without overflow, the layer count fits an int,
 * a positive finite epsilon, finite RoPE frequencies (theta, llama3 and YaRN
 * factors) and a positive finite YaRN scale on cos and sin;
 * for a drafter also block_size, num_target_layers, mask_token_id and every
 * target layer id in range, the parameter table built without overflow, and
 * the checkpoint's config.json (dfl_drafter_config_json) read back to the
 * same values; for the extract tap list, 1 to 64 distinct ids in [0, L).
 */
#include "common.h"
#include "fuzz_util.h"
#include "drafter.h"
#include "extract.h"
#include "model_config.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* a*b+... in int64 without overflow */
static int64_t mul(int64_t a, int64_t b) {
    int64_t r;
    FUZZ_CHECK(!__builtin_mul_overflow(a, b, &r));
    return r;
}
static int64_t add(int64_t a, int64_t b) {
    int64_t r;
    FUZZ_CHECK(!__builtin_add_overflow(a, b, &r));
    return r;
}

static void check_model(const dfl_model_config *c) {
    FUZZ_CHECK(c->json && json_is_object(c->json));
    FUZZ_CHECK(memchr(c->architecture, 0, sizeof c->architecture) && memchr(c->model_type, 0, sizeof c->model_type) &&
          memchr(c->dtype, 0, sizeof c->dtype));
    FUZZ_CHECK(strlen(c->digest) == 16);
    FUZZ_CHECK(c->hidden_size > 0 && c->intermediate_size >= 0 && c->num_hidden_layers > 0 && c->num_attention_heads > 0 &&
          c->num_key_value_heads > 0 && c->head_dim > 0 && c->vocab_size > 0);
    FUZZ_CHECK(c->intermediate_size > 0 || c->num_experts > 0); /* no dense MLP only in a mixture of experts */
    FUZZ_CHECK(c->num_hidden_layers <= INT_MAX); /* target.c keeps it in an int */
    FUZZ_CHECK(c->head_dim % 2 == 0);
    FUZZ_CHECK(c->num_attention_heads % c->num_key_value_heads == 0);
    float eps = (float)c->rms_norm_eps;
    FUZZ_CHECK(eps > 0 && isfinite(eps));
    /* the shapes target.c and drafter.c form, and the whole model */
    int64_t H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size, D = c->head_dim;
    int64_t QD = mul(c->num_attention_heads, D), KD = mul(c->num_key_value_heads, D);
    int64_t layer = add(add(add(mul(QD, H), mul(2, mul(KD, H))), mul(H, QD)), add(mul(3, mul(I, H)), add(mul(2, H), mul(2, D))));
    int64_t total = add(add(mul(2, mul(V, H)), H), mul(c->num_hidden_layers, layer));
    FUZZ_CHECK(mul(total, 4) > 0);
    /* partial RoPE and the Qwen3.5 hybrid's DeltaNet shapes */
    FUZZ_CHECK(c->rotary_dim >= 2 && c->rotary_dim % 2 == 0 && c->rotary_dim <= D);
    FUZZ_CHECK(c->hybrid || c->rotary_dim == D);
    FUZZ_CHECK(c->qwen3_next == !strcmp(c->architecture, "Qwen3NextForCausalLM") && (!c->qwen3_next || c->hybrid));
    if (c->hybrid) {
        FUZZ_CHECK(c->lin_k_heads > 0 && c->lin_v_heads > 0 && c->lin_k_dim > 0 && c->lin_v_dim > 0);
        FUZZ_CHECK(c->lin_v_heads % c->lin_k_heads == 0 && c->lin_conv >= 1 && c->lin_conv <= 8);
        FUZZ_CHECK(c->full_attention_interval > 0 && c->norm_plus_one);
        int64_t VD = mul(c->lin_v_heads, c->lin_v_dim), C = add(mul(2, mul(c->lin_k_heads, c->lin_k_dim)), VD);
        int64_t lin = add(add(mul(C, H), mul(3, mul(VD, H))), add(mul(C, c->lin_conv), mul(QD, H)));
        FUZZ_CHECK(mul(add(mul(c->num_hidden_layers, add(layer, lin)), total), 4) > 0);
        FUZZ_CHECK(mul(mul(c->lin_v_heads, c->lin_k_dim), c->lin_v_dim) > 0);
        for (int64_t i = 0; i < c->num_hidden_layers && i < 1000; i++) {
            int lt = dfl_model_config_linear_layer(c, i);
            FUZZ_CHECK(lt == 0 || lt == 1);
        }
    } else {
        FUZZ_CHECK(dfl_model_config_linear_layer(c, 0) == 0);
    }
    /* mixture of experts: the sizes the router and the experts' buffers
     * take, every dense layer with a width, the whole model in int64 */
    if (c->num_experts) {
        FUZZ_CHECK(c->num_experts >= 1 && c->num_experts <= 4096);
        FUZZ_CHECK(c->experts_per_tok >= 1 && c->experts_per_tok <= c->num_experts);
        FUZZ_CHECK(c->moe_intermediate_size > 0 && c->shared_expert_intermediate_size >= 0 && c->decoder_sparse_step >= 1);
        FUZZ_CHECK(c->norm_topk_prob == 0 || c->norm_topk_prob == 1);
        int64_t expert = add(mul(3, mul(c->moe_intermediate_size, H)), H);
        int64_t moe = add(mul(c->num_experts, expert), mul(3, mul(c->shared_expert_intermediate_size, H)));
        FUZZ_CHECK(mul(add(mul(c->num_hidden_layers, moe), total), 4) > 0);
        unsigned char all[1000];
        const int64_t n = c->num_hidden_layers < 1000 ? c->num_hidden_layers : 1000;
        dfl_model_config_moe_layers(c, n, all);
        for (int64_t i = 0; i < n; i++) {
            int sparse = dfl_model_config_moe_layer(c, i);
            FUZZ_CHECK(sparse == 0 || sparse == 1);
            FUZZ_CHECK(sparse == all[i]); /* the one-pass listing agrees */
            FUZZ_CHECK(sparse || c->intermediate_size > 0);
        }
    } else {
        FUZZ_CHECK(dfl_model_config_moe_layer(c, 0) == 0);
    }
    FUZZ_CHECK(c->tie_word_embeddings == 0 || c->tie_word_embeddings == 1);
    FUZZ_CHECK(c->gpt_oss == !strcmp(c->architecture, "GptOssForCausalLM"));
    FUZZ_CHECK(c->gpt_oss || c->qkv_bias == !strcmp(c->architecture, "Qwen2ForCausalLM"));
    FUZZ_CHECK(c->o_bias == (c->gpt_oss && c->qkv_bias));
    FUZZ_CHECK(c->qk_norm == (strcmp(c->architecture, "LlamaForCausalLM") && strcmp(c->architecture, "MistralForCausalLM") &&
                              strcmp(c->architecture, "Qwen2ForCausalLM") && !c->gpt_oss));
    for (int64_t i = 0; i < c->num_hidden_layers && i < 64; i++) {
        int64_t w = dfl_model_config_window(c, i);
        FUZZ_CHECK(w == 0 || (w == c->sliding_window && w > 0)); /* gpt-oss, and Qwen3/Qwen2/Mistral with windows */
    }
    if (c->gpt_oss) FUZZ_CHECK(c->num_experts > 0 && c->norm_topk_prob && isfinite((float)c->swiglu_limit));
    FUZZ_CHECK(c->n_eos >= 0 && c->n_eos <= DFL_MAX_EOS);
    /* RoPE */
    FUZZ_CHECK(c->rope_type == DFL_ROPE_DEFAULT || c->rope_type == DFL_ROPE_LLAMA3 || c->rope_type == DFL_ROPE_YARN);
    float theta = (float)c->rope_theta;
    FUZZ_CHECK(theta > 0 && isfinite(theta));
    if (c->rope_type == DFL_ROPE_LLAMA3) {
        FUZZ_CHECK(c->rope_original_max_pos > 0);
        FUZZ_CHECK((float)c->rope_factor > 0 && isfinite((float)c->rope_factor));
        FUZZ_CHECK((float)c->rope_low_freq_factor > 0 && (float)c->rope_high_freq_factor > (float)c->rope_low_freq_factor &&
              isfinite((float)c->rope_high_freq_factor));
    }
    if (c->rope_type == DFL_ROPE_YARN) {
        FUZZ_CHECK(c->rope_original_max_pos > 0 && (float)c->rope_factor >= 1 && isfinite((float)c->rope_factor));
        FUZZ_CHECK(c->rope_beta_fast > 0 && c->rope_beta_slow > 0 && isfinite(c->rope_beta_fast) &&
                   isfinite(c->rope_beta_slow));
    }
    const float scale = dfl_rope_scale(c);
    FUZZ_CHECK(scale > 0 && isfinite(scale) && (c->rope_type == DFL_ROPE_YARN || scale == 1.0f));
    if (c->head_dim <= 1 << 16) {
        float *f = malloc((size_t)(c->head_dim / 2) * sizeof *f);
        dfl_rope_inv_freq(c, f);
        for (int64_t i = 0; i < c->head_dim / 2; i++) FUZZ_CHECK(isfinite(f[i]) && f[i] >= 0);
        free(f);
    }
}

static void check_same(const dfl_drafter_config *a, const dfl_drafter_config *b) {
    FUZZ_CHECK(a->H == b->H && a->I == b->I && a->L == b->L && a->Hq == b->Hq && a->Hkv == b->Hkv && a->D == b->D &&
          a->V == b->V && a->eps == b->eps);
    FUZZ_CHECK(a->block_size == b->block_size && a->num_target_layers == b->num_target_layers &&
          a->mask_token_id == b->mask_token_id && a->K == b->K);
    FUZZ_CHECK(!memcmp(a->layer_ids, b->layer_ids, sizeof(int) * (size_t)a->K));
    FUZZ_CHECK(a->mc.rope_type == b->mc.rope_type && a->mc.rope_theta == b->mc.rope_theta &&
          a->mc.rope_factor == b->mc.rope_factor && a->mc.rope_low_freq_factor == b->mc.rope_low_freq_factor &&
          a->mc.rope_high_freq_factor == b->mc.rope_high_freq_factor &&
          a->mc.rope_original_max_pos == b->mc.rope_original_max_pos);
    FUZZ_CHECK(a->mc.rope_beta_fast == b->mc.rope_beta_fast && a->mc.rope_beta_slow == b->mc.rope_beta_slow &&
          a->mc.rope_truncate == b->mc.rope_truncate && dfl_rope_scale(&a->mc) == dfl_rope_scale(&b->mc));
}

static void check_drafter(const dfl_drafter_config *c, int roundtrip) {
    check_model(&c->mc);
    FUZZ_CHECK(c->mc.qk_norm);
    FUZZ_CHECK(c->H == c->mc.hidden_size && c->L == c->mc.num_hidden_layers && c->V == c->mc.vocab_size);
    FUZZ_CHECK(c->L >= 1 && c->L <= DFL_DRAFTER_MAX_LAYERS);
    FUZZ_CHECK(c->block_size >= 2 && c->block_size <= DFL_DRAFTER_MAX_BLOCK);
    FUZZ_CHECK(c->num_target_layers >= 1);
    FUZZ_CHECK(c->mask_token_id >= 0 && c->mask_token_id < c->V);
    FUZZ_CHECK(c->K >= 1 && c->K <= DFL_DRAFTER_MAX_TAPS);
    for (int i = 0; i < c->K; i++) FUZZ_CHECK(c->layer_ids[i] >= 0 && c->layer_ids[i] < c->num_target_layers);
    /* the parameter table (fc is [H, K*H]) and the flat array's size in bytes */
    int64_t fc = mul(c->H, mul(c->K, c->H));
    (void)fc;
    int n = dfl_drafter_params(c, NULL);
    FUZZ_CHECK(n == 3 + 11 * (int)c->L);
    dfl_param_info *info = calloc((size_t)n, sizeof *info);
    dfl_drafter_params(c, info);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        FUZZ_CHECK(info[i].numel > 0 && info[i].offset == total);
        total = add(total, info[i].numel);
    }
    FUZZ_CHECK(mul(total, 4) > 0);
    free(info);
    if (!roundtrip) return;
    /* what a checkpoint writes must read back as the same drafter */
    json_t *j = dfl_drafter_config_json(c);
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(j);
    FUZZ_CHECK(text);
    dfl_drafter_config back;
    int rc = dfl_drafter_config_parse(&back, text, strlen(text), "roundtrip");
    if (rc) fprintf(stderr, "fuzz_config: round trip: %s\n%s\n", dfl_errmsg(), text);
    FUZZ_CHECK(rc == 0);
    check_drafter(&back, 0);
    check_same(c, &back);
    dfl_drafter_config_free(&back);
    free(text);
}

static void check_extract_ids(const uint8_t *data, size_t size) {
    char path[64];
    int fd = fuzz_memfd("fuzz_config", data, size, path, sizeof path);
    static const int layers[] = {1, 2, 3, 6, 36};
    for (size_t k = 0; k < sizeof layers / sizeof layers[0]; k++) {
        int L = layers[k], ids[DFL_EXTRACT_MAX_TAPS], n = -1;
        int rc = dfl_extract_layer_ids(NULL, path, L, ids, &n);
        if (rc) {
            FUZZ_CHECK(rc == DFL_EX_DATA);
            continue;
        }
        FUZZ_CHECK(n >= 1 && n <= DFL_EXTRACT_MAX_TAPS);
        for (int i = 0; i < n; i++) {
            FUZZ_CHECK(ids[i] >= 0 && ids[i] < L);
            for (int j = 0; j < i; j++) FUZZ_CHECK(ids[i] != ids[j]);
        }
    }
    close(fd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_extract_ids(data, size);
    const char *text = (const char *)data;
    dfl_model_config mc;
    int rc = dfl_model_config_parse(&mc, text, size, "fuzz", "target");
    if (rc == 0) check_model(&mc);
    else FUZZ_CHECK(rc == DFL_EX_DATA);
    dfl_model_config_free(&mc);

    dfl_drafter_config dc;
    rc = dfl_drafter_config_parse(&dc, text, size, "fuzz");
    if (rc == 0) check_drafter(&dc, 1);
    else FUZZ_CHECK(rc == DFL_EX_DATA);
    dfl_drafter_config_free(&dc);
    return 0;
}
