/* test_model_config.c: config.json spellings, refusals, RoPE, default taps. */
#include "common.h"
#include "model_config.h"
#include "test.h"

static int parse(dfl_model_config *c, const char *json) {
    return dfl_model_config_parse(c, json, strlen(json), "config.json", "target");
}

#define BASE "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,\"num_attention_heads\":4," \
             "\"num_key_value_heads\":2,\"head_dim\":16,\"vocab_size\":100,\"rms_norm_eps\":1e-6"

static void test_both_rope_spellings(void) {
    dfl_model_config a, b;
    T_CHECK(parse(&a, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"rope_theta\":1000000,\"rope_scaling\":null,\"torch_dtype\":\"bfloat16\"}") == 0);
    T_CHECK(parse(&b, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"rope_parameters\":{\"rope_theta\":1000000,\"rope_type\":\"default\"},\"dtype\":\"bfloat16\"}") == 0);
    T_CHECK(a.rope_theta == 1e6 && b.rope_theta == 1e6 && a.rope_type == DFL_ROPE_DEFAULT && b.rope_type == DFL_ROPE_DEFAULT);
    T_CHECK(!strcmp(a.dtype, "bfloat16") && !strcmp(b.dtype, "bfloat16"));
    T_CHECK(a.qk_norm == 1 && a.head_dim == 16 && a.num_key_value_heads == 2);
    T_CHECK(strlen(a.digest) == 16 && strcmp(a.digest, b.digest) != 0);
    dfl_model_config_free(&a);
    dfl_model_config_free(&b);
}

static void test_llama3_rope(void) {
    dfl_model_config c;
    T_CHECK(parse(&c, "{\"architectures\":[\"LlamaForCausalLM\"]," BASE ",\"rope_theta\":500000,"
                      "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,"
                      "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":64}}") == 0);
    T_CHECK(c.qk_norm == 0 && c.rope_type == DFL_ROPE_LLAMA3);
    float f[8];
    dfl_rope_inv_freq(&c, f);
    /* Independent evaluation of the three regimes in double. */
    for (int i = 0; i < 8; i++) {
        double inv = 1.0 / pow(500000.0, 2.0 * i / 16), wl = 2 * M_PI / inv, want;
        if (wl < 64.0 / 4) want = inv;
        else if (wl > 64.0 / 1) want = inv / 8;
        else {
            double s = (64.0 / wl - 1) / 3;
            want = (1 - s) * inv / 8 + s * inv;
        }
        T_CHECKF(fabs(f[i] - want) <= 1e-6 * want, "i=%d %g vs %g", i, f[i], want);
    }
    dfl_model_config_free(&c);
}

/* YaRN's keys as transformers reads them: a top-level original length
 * before the scaling's (Phi-3's spelling), absent or 0 betas as 32 and 1,
 * the attention factor from the factor (0.1 ln 4 + 1). The frequencies
 * themselves: test_ops_cpu against transformers. */
static void test_yarn_keys(void) {
    dfl_model_config c;
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":256,"
                      "\"original_max_position_embeddings\":128,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4,"
                      "\"original_max_position_embeddings\":64,\"beta_fast\":0}}") == 0);
    T_CHECK(c.rope_type == DFL_ROPE_YARN && c.rope_original_max_pos == 128 && c.rope_truncate == 1);
    T_CHECK(c.rope_beta_fast == 32 && c.rope_beta_slow == 1);
    T_CHECKF(fabs(dfl_rope_scale(&c) - (0.1 * log(4.0) + 1)) < 1e-7, "scale %.9g", dfl_rope_scale(&c));
    dfl_model_config_free(&c);
    /* no original length anywhere: max_position_embeddings */
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":96,"
                      "\"rope_parameters\":{\"rope_type\":\"yarn\",\"rope_theta\":10000,\"factor\":1}}") == 0);
    T_CHECK(c.rope_original_max_pos == 96 && dfl_rope_scale(&c) == 1.0f);
    dfl_model_config_free(&c);
    /* "truncate": null is false, as transformers' get("truncate", True) */
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":96,"
                      "\"rope_scaling\":{\"type\":\"yarn\",\"factor\":2,\"truncate\":null}}") == 0);
    T_CHECK(c.rope_truncate == 0);
    dfl_model_config_free(&c);
    /* llama3 finds its original length as YaRN does: top level first, else
     * the scaling's, else max_position_embeddings */
    static const char *l3[] = {
        "\"original_max_position_embeddings\":128,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
        "\"low_freq_factor\":1,\"high_freq_factor\":4,\"original_max_position_embeddings\":64}",
        "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,\"high_freq_factor\":4}"};
    for (int i = 0; i < 2; i++) {
        char json[1024];
        snprintf(json, sizeof json, "{\"architectures\":[\"LlamaForCausalLM\"]," BASE ",\"max_position_embeddings\":256,%s}",
                 l3[i]);
        T_CHECK(parse(&c, json) == 0);
        T_CHECKF(c.rope_original_max_pos == (i ? 256 : 128), "case %d: %lld", i, (long long)c.rope_original_max_pos);
        dfl_model_config_free(&c);
    }
}

/* Qwen2 (Qwen2.5, DeepSeek-R1-Distill-Qwen): no q/k norms, q/k/v biases;
 * its sliding window only when use_sliding_window says so, on the layers
 * from max_window_layers on (Qwen2Config, as Qwen3Config) */
static void test_qwen2(void) {
    dfl_model_config c;
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen2ForCausalLM\"]," BASE ",\"rope_theta\":1000000,\"sliding_window\":131072,"
                      "\"use_sliding_window\":false,\"max_window_layers\":2}") == 0);
    T_CHECK(c.qkv_bias == 1 && c.qk_norm == 0);
    T_CHECK(c.sliding_window == 0 && dfl_model_config_window(&c, 3) == 0);
    dfl_model_config_free(&c);
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE "}") == 0);
    T_CHECK(c.qkv_bias == 0 && c.qk_norm == 1);
    dfl_model_config_free(&c);
    /* on, defaults: a window of 4096 from layer 28 on (none of BASE's 4) */
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen2ForCausalLM\"]," BASE ",\"use_sliding_window\":true}") == 0);
    T_CHECK(c.sliding_window == 4096 && dfl_model_config_window(&c, 3) == 0);
    dfl_model_config_free(&c);
    const char *arch[] = {"Qwen2ForCausalLM", "Qwen3ForCausalLM"};
    for (int a = 0; a < 2; a++) {
        char json[512];
        snprintf(json, sizeof json, "{\"architectures\":[\"%s\"]," BASE ",\"use_sliding_window\":true,"
                 "\"sliding_window\":64,\"max_window_layers\":2}", arch[a]);
        T_CHECK(parse(&c, json) == 0);
        for (int i = 0; i < 4; i++)
            T_CHECKF(dfl_model_config_window(&c, i) == (i >= 2 ? 64 : 0), "%s layer %d", arch[a], i);
        dfl_model_config_free(&c);
        /* layer_types over max_window_layers */
        snprintf(json, sizeof json, "{\"architectures\":[\"%s\"]," BASE ",\"use_sliding_window\":true,"
                 "\"sliding_window\":64,\"max_window_layers\":2,\"layer_types\":[\"sliding_attention\","
                 "\"full_attention\",\"full_attention\",\"sliding_attention\"]}", arch[a]);
        T_CHECK(parse(&c, json) == 0);
        for (int i = 0; i < 4; i++)
            T_CHECKF(dfl_model_config_window(&c, i) == (i % 3 ? 0 : 64), "%s layer %d", arch[a], i);
        dfl_model_config_free(&c);
    }
    /* a window not positive is refused */
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"use_sliding_window\":true,"
                      "\"sliding_window\":0}") == DFL_EX_DATA);
    T_CHECK(strstr(dfl_errmsg(), "sliding_window") != NULL);
    dfl_model_config_free(&c);
}

/* Qwen3-MoE (Qwen3MoeConfig, Qwen3MoeAttention): a window only with
 * use_sliding_window, then on every layer, max_window_layers and
 * layer_types notwithstanding; the hybrids' windows stay refused. */
static void test_qwen3_moe_window(void) {
    static const struct {
        const char *keys;
        int64_t window;
    } cases[] = {
        {",\"use_sliding_window\":true,\"sliding_window\":64,\"max_window_layers\":2", 64},
        {",\"use_sliding_window\":true,\"max_window_layers\":2", 4096}, /* absent: 4096 */
        {",\"use_sliding_window\":true,\"sliding_window\":null", 0},
        {",\"use_sliding_window\":false,\"sliding_window\":64", 0},
        {",\"sliding_window\":64", 0}, /* use_sliding_window absent: false */
        {",\"use_sliding_window\":true,\"sliding_window\":7,\"layer_types\":[\"full_attention\",\"full_attention\","
         "\"full_attention\",\"full_attention\"]", 7},
    };
    dfl_model_config c;
    char json[512];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(json, sizeof json, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," BASE "%s}", cases[k].keys);
        T_CHECKF(parse(&c, json) == 0, "case %zu: %s", k, dfl_errmsg());
        for (int i = 0; i < 4; i++)
            T_CHECKF(dfl_model_config_window(&c, i) == cases[k].window, "case %zu layer %d: %lld", k, i,
                     (long long)dfl_model_config_window(&c, i));
        dfl_model_config_free(&c);
    }
    const char *bad[] = {
        "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," BASE ",\"use_sliding_window\":true,\"sliding_window\":0}",
        "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," BASE ",\"use_sliding_window\":true,\"sliding_window\":8,"
        "\"layer_types\":[\"sliding_attention\",\"full_attention\",\"full_attention\",\"full_attention\"]}",
        "{\"architectures\":[\"Qwen3NextForCausalLM\"]," BASE ",\"use_sliding_window\":true}",
    };
    const char *field[] = {"sliding_window", "layer_types", "use_sliding_window"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        T_CHECKF(parse(&c, bad[k]) == DFL_EX_DATA, "refused %zu", k);
        T_CHECKF(strstr(dfl_errmsg(), field[k]) != NULL, "refused %zu: %s", k, dfl_errmsg());
        dfl_model_config_free(&c);
    }
}

/* Mistral: Llama's layer; any non-null sliding window (it has no
 * use_sliding_window) on every layer, whatever "layer_types" says
 * (MistralAttention ignores it) */
static void test_mistral(void) {
    dfl_model_config c;
    T_CHECK(parse(&c, "{\"architectures\":[\"MistralForCausalLM\"]," BASE ",\"sliding_window\":null}") == 0);
    T_CHECK(c.qk_norm == 0 && c.qkv_bias == 0 && dfl_model_config_window(&c, 0) == 0);
    dfl_model_config_free(&c);
    T_CHECK(parse(&c, "{\"architectures\":[\"MistralForCausalLM\"]," BASE ",\"sliding_window\":100,"
                      "\"layer_types\":[\"full_attention\",\"full_attention\",\"full_attention\",\"full_attention\"]}") == 0);
    for (int i = 0; i < 4; i++) T_CHECKF(dfl_model_config_window(&c, i) == 100, "layer %d", i);
    dfl_model_config_free(&c);
    /* absent: transformers' MistralConfig default, a window of 4096 (Mistral-7B-v0.1) */
    T_CHECK(parse(&c, "{\"architectures\":[\"MistralForCausalLM\"]," BASE "}") == 0);
    T_CHECK(dfl_model_config_window(&c, 0) == 4096 && dfl_model_config_window(&c, 3) == 4096);
    dfl_model_config_free(&c);
    T_CHECK(parse(&c, "{\"architectures\":[\"MistralForCausalLM\"]," BASE ",\"sliding_window\":-1}") == DFL_EX_DATA);
    T_CHECK(strstr(dfl_errmsg(), "sliding_window") != NULL);
    dfl_model_config_free(&c);
}

/* gpt-oss-20b's config.json as released (MXFP4 experts; the 4.x spelling) */
#define OSS20B "{\"architectures\":[\"GptOssForCausalLM\"],\"attention_bias\":true,\"attention_dropout\":0.0," \
    "\"eos_token_id\":200002,\"experts_per_token\":4,\"head_dim\":64,\"hidden_act\":\"silu\",\"hidden_size\":2880," \
    "\"initial_context_length\":4096,\"intermediate_size\":2880,\"layer_types\":[" LT24 "]," \
    "\"max_position_embeddings\":131072,\"model_type\":\"gpt_oss\",\"num_attention_heads\":64," \
    "\"num_experts_per_tok\":4,\"num_hidden_layers\":24,\"num_key_value_heads\":8,\"num_local_experts\":32," \
    "\"pad_token_id\":199999,\"quantization_config\":{\"modules_to_not_convert\":[\"model.layers.*.self_attn\"," \
    "\"model.layers.*.mlp.router\",\"model.embed_tokens\",\"lm_head\"],\"quant_method\":\"mxfp4\"}," \
    "\"rms_norm_eps\":1e-05,\"rope_scaling\":{\"beta_fast\":32.0,\"beta_slow\":1.0,\"factor\":32.0," \
    "\"original_max_position_embeddings\":4096,\"rope_type\":\"yarn\",\"truncate\":false},\"rope_theta\":150000," \
    "\"router_aux_loss_coef\":0.9,\"sliding_window\":128,\"swiglu_limit\":7.0,\"tie_word_embeddings\":false," \
    "\"use_cache\":true,\"vocab_size\":201088}"
#define LT2 "\"sliding_attention\",\"full_attention\""
#define LT8 LT2 "," LT2 "," LT2 "," LT2
#define LT24 LT8 "," LT8 "," LT8

static void test_gpt_oss(void) {
    dfl_model_config c;
    T_CHECK(parse(&c, OSS20B) == 0);
    T_CHECK(c.gpt_oss && c.qkv_bias && c.o_bias && !c.qk_norm && !c.hybrid);
    T_CHECK(c.num_experts == 32 && c.experts_per_tok == 4 && c.moe_intermediate_size == 2880 && c.intermediate_size == 0);
    T_CHECK(c.norm_topk_prob == 1 && c.swiglu_alpha == 1.702 && c.swiglu_limit == 7.0);
    T_CHECK(c.head_dim == 64 && c.num_key_value_heads == 8 && c.rms_norm_eps == 1e-5 && c.rope_theta == 150000);
    T_CHECK(c.rope_type == DFL_ROPE_YARN && c.rope_factor == 32 && c.rope_original_max_pos == 4096 && !c.rope_truncate);
    for (int i = 0; i < 24; i++) {
        T_CHECKF(dfl_model_config_window(&c, i) == (i % 2 ? 0 : 128), "layer %d window %lld", i,
                 (long long)dfl_model_config_window(&c, i));
        T_CHECK(dfl_model_config_moe_layer(&c, i) == 1);
    }
    dfl_model_config_free(&c);
    /* GptOssConfig's defaults where the keys are absent: sliding at even layers, attention biases */
    T_CHECK(parse(&c, "{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":3,"
                      "\"num_attention_heads\":16,\"vocab_size\":100,\"sliding_window\":16,\"rope_scaling\":{\"rope_type\":"
                      "\"yarn\",\"factor\":32.0,\"original_max_position_embeddings\":4096,\"truncate\":false}}") == 0);
    T_CHECK(c.qkv_bias && c.o_bias && c.num_experts == 128 && c.experts_per_tok == 4 && c.moe_intermediate_size == 2880);
    T_CHECK(c.head_dim == 64 && c.num_key_value_heads == 8 && c.rope_theta == 150000 && c.swiglu_limit == 7.0);
    T_CHECK(dfl_model_config_window(&c, 0) == 16 && dfl_model_config_window(&c, 1) == 0 && dfl_model_config_window(&c, 2) == 16);
    dfl_model_config_free(&c);
    /* a null window: the sliding layers run at full attention (transformers 5.25 raises instead) */
    T_CHECK(parse(&c, "{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,"
                      "\"num_attention_heads\":16,\"vocab_size\":100,\"sliding_window\":null,\"attention_bias\":false,"
                      "\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2.0,\"original_max_position_embeddings\":64}}") == 0);
    T_CHECK(dfl_model_config_window(&c, 0) == 0 && !c.qkv_bias && !c.o_bias);
    dfl_model_config_free(&c);
    static const struct { const char *json, *why; } bad[] = {
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100}", "rope_scaling"},
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100,\"quantization_config\":{\"quant_method\":\"fp8\"},\"rope_scaling\":{\"rope_type\":\"yarn\","
         "\"factor\":2.0,\"original_max_position_embeddings\":64}}", "quant_method"},
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100,\"num_experts\":8,\"num_local_experts\":4,\"rope_scaling\":{\"rope_type\":\"yarn\","
         "\"factor\":2.0,\"original_max_position_embeddings\":64}}", "disagree"},
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100,\"layer_types\":[\"sliding_attention\",\"chunked_attention\"],\"rope_scaling\":{\"rope_type\":"
         "\"yarn\",\"factor\":2.0,\"original_max_position_embeddings\":64}}", "\"layer_types\"[1] is \"chunked_attention\""},
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100,\"sliding_window\":-4,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2.0,"
         "\"original_max_position_embeddings\":64}}", "negative"},
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100,\"num_experts_per_tok\":200,\"num_local_experts\":8,\"rope_scaling\":{\"rope_type\":\"yarn\","
         "\"factor\":2.0,\"original_max_position_embeddings\":64}}", "num_experts_per_tok"},
        {"{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":16,"
         "\"vocab_size\":100,\"intermediate_size\":0,\"rope_scaling\":{\"rope_type\":\"yarn\","
         "\"factor\":2.0,\"original_max_position_embeddings\":64}}", "\"intermediate_size\" must be positive"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        T_CHECKF(parse(&c, bad[i].json) == DFL_EX_DATA, "case %zu accepted", i);
        T_CHECKF(strstr(dfl_errmsg(), bad[i].why) != NULL, "case %zu: %s", i, dfl_errmsg());
        dfl_model_config_free(&c);
    }
    /* GptOssConfig's sliding_window default (128) where the key is absent;
     * "num_experts" alone is num_local_experts (GptOssConfig.attribute_map) */
    T_CHECK(parse(&c, "{\"architectures\":[\"GptOssForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,"
                      "\"num_attention_heads\":16,\"vocab_size\":100,\"num_experts\":8,\"rope_scaling\":{\"rope_type\":"
                      "\"yarn\",\"factor\":2.0,\"original_max_position_embeddings\":64}}") == 0);
    T_CHECKF(dfl_model_config_window(&c, 0) == 128 && dfl_model_config_window(&c, 1) == 0, "window %lld",
             (long long)dfl_model_config_window(&c, 0));
    T_CHECKF(c.num_experts == 8, "num_experts %lld (%s)", (long long)c.num_experts, dfl_errmsg());
    dfl_model_config_free(&c);
    /* a Qwen3 sliding_attention layer without use_sliding_window, and
     * sliding_attention on Llama, stay refused */
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"layer_types\":[\"sliding_attention\","
                      "\"full_attention\",\"full_attention\",\"full_attention\"]}") == DFL_EX_DATA);
    T_CHECK(strstr(dfl_errmsg(), "use_sliding_window") != NULL);
    dfl_model_config_free(&c);
    T_CHECK(parse(&c, "{\"architectures\":[\"LlamaForCausalLM\"]," BASE ",\"layer_types\":[\"sliding_attention\","
                      "\"full_attention\",\"full_attention\",\"full_attention\"]}") == DFL_EX_DATA);
    dfl_model_config_free(&c);
}

/* Qwen3-Next-80B-A3B's config.json as released (Qwen3-Coder-Next has the
 * same keys): the hybrid's layers, MoE by Qwen3-MoE's layer rule */
static void test_qwen3_next(void) {
    static const char *next80b =
        "{\"architectures\":[\"Qwen3NextForCausalLM\"],\"attention_bias\":false,\"attention_dropout\":0.0,"
        "\"bos_token_id\":151643,\"decoder_sparse_step\":1,\"eos_token_id\":151645,\"full_attention_interval\":4,"
        "\"head_dim\":256,\"hidden_act\":\"silu\",\"hidden_size\":2048,\"initializer_range\":0.02,"
        "\"intermediate_size\":5120,\"linear_conv_kernel_dim\":4,\"linear_key_head_dim\":128,\"linear_num_key_heads\":16,"
        "\"linear_num_value_heads\":32,\"linear_value_head_dim\":128,\"max_position_embeddings\":262144,"
        "\"mlp_only_layers\":[],\"model_type\":\"qwen3_next\",\"moe_intermediate_size\":512,\"norm_topk_prob\":true,"
        "\"num_attention_heads\":16,\"num_experts\":512,\"num_experts_per_tok\":10,\"num_hidden_layers\":48,"
        "\"num_key_value_heads\":2,\"output_router_logits\":false,\"partial_rotary_factor\":0.25,\"rms_norm_eps\":1e-06,"
        "\"rope_scaling\":null,\"rope_theta\":10000000,\"router_aux_loss_coef\":0.001,"
        "\"shared_expert_intermediate_size\":512,\"tie_word_embeddings\":false,\"torch_dtype\":\"bfloat16\","
        "\"use_cache\":true,\"use_sliding_window\":false,\"vocab_size\":151936}";
    dfl_model_config c;
    T_CHECK(parse(&c, next80b) == 0);
    T_CHECK(c.hybrid && c.qwen3_next && c.norm_plus_one && c.attn_output_gate && !c.gpt_oss);
    T_CHECK(c.rotary_dim == 64 && c.lin_k_heads == 16 && c.lin_v_heads == 32 && c.full_attention_interval == 4);
    T_CHECK(c.num_experts == 512 && c.experts_per_tok == 10 && c.moe_intermediate_size == 512 &&
            c.shared_expert_intermediate_size == 512 && c.norm_topk_prob && c.intermediate_size == 5120);
    for (int i = 0; i < 48; i++) {
        T_CHECKF(dfl_model_config_linear_layer(&c, i) == ((i + 1) % 4 != 0), "layer %d", i);
        T_CHECK(dfl_model_config_moe_layer(&c, i) == 1);
    }
    dfl_model_config_free(&c);
    /* Qwen3-Next reads mlp_only_layers and decoder_sparse_step, as Qwen3-MoE (Qwen3.5-MoE does not) */
    static const char *dense1 =
        "{\"architectures\":[\"Qwen3NextForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,"
        "\"num_attention_heads\":4,\"vocab_size\":100,\"num_experts\":4,\"num_experts_per_tok\":2,\"mlp_only_layers\":[1],"
        "\"norm_topk_prob\":false}";
    T_CHECK(parse(&c, dense1) == 0);
    T_CHECK(dfl_model_config_moe_layer(&c, 0) == 1 && dfl_model_config_moe_layer(&c, 1) == 0);
    unsigned char sparse[4];
    dfl_model_config_moe_layers(&c, 4, sparse);
    T_CHECK(sparse[0] == 1 && sparse[1] == 0 && sparse[2] == 1 && sparse[3] == 1);
    T_CHECK(c.norm_topk_prob == 0 && c.num_key_value_heads == 2 && c.head_dim == 256 && c.rotary_dim == 64);
    dfl_model_config_free(&c);
    /* defaults as Qwen3NextConfig: 512 experts, 10 a token, a dense width of 5632 */
    T_CHECK(parse(&c, "{\"architectures\":[\"Qwen3NextForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":4,"
                      "\"num_attention_heads\":4,\"vocab_size\":100}") == 0);
    T_CHECK(c.num_experts == 512 && c.experts_per_tok == 10 && c.intermediate_size == 5632 && c.norm_topk_prob == 1);
    dfl_model_config_free(&c);
}

static void test_refusals(void) {
    static const struct { const char *json, *why; } cases[] = {
        {"{\"architectures\":[\"GemmaForCausalLM\"]," BASE "}", "not supported"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"attention_bias\":true}", "attention_bias"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"rope_scaling\":{\"rope_type\":\"dynamic\",\"factor\":4}}", "dynamic"},
        /* YaRN: no pretraining length (nor max_position_embeddings), a factor below 1, ... */
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}",
         "\"original_max_position_embeddings\" is missing"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":64,\"rope_scaling\":{\"type\":\"yarn\"}}",
         "\"factor\" is missing"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":64,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":0.5}}",
         "\"factor\" must be"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":64,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":2,"
         "\"beta_fast\":-1}}", "\"beta_fast\" and \"beta_slow\" must be positive"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":64,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":2,"
         "\"truncate\":\"no\"}}", "\"truncate\" is not true or false"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":64,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":2,"
         "\"attention_factor\":-1}}", "attention factor -1"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"max_position_embeddings\":64,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":2,"
         "\"mscale\":\"big\"}}", "\"mscale\" is not a number"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"],\"hidden_size\":64}", "intermediate_size"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"hidden_act\":\"gelu\"}", "hidden_act"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"layer_types\":[\"sliding_attention\"]}", "layer_types"},
        {"[]", "not a JSON object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dfl_model_config c;
        int rc = parse(&c, cases[i].json);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), cases[i].why) && strstr(dfl_errmsg(), "config.json"),
                 "case %zu: rc %d '%s'", i, rc, dfl_errmsg());
        dfl_model_config_free(&c);
    }
}

/* A bad value is named by its key (and, for a size, its value); a value
 * of a type the key cannot have is refused, not read as absent. The sizes
 * were "sizes must be positive", architectures [12] an architecture "",
 * and eos_token_id "x" or rope_scaling 5 no end token and no scaling. */
#define SIZES_BUT(k) "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,\"num_attention_heads\":4," \
                     "\"num_key_value_heads\":2,\"rms_norm_eps\":1e-6," k
#define QWEN3 "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE
static void test_fields_named(void) {
    static const struct { const char *json, *why; } cases[] = {
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," SIZES_BUT("\"head_dim\":16,\"vocab_size\":0") "}",
         "\"vocab_size\" 0 must be positive"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," SIZES_BUT("\"head_dim\":0,\"vocab_size\":100") "}",
         "\"head_dim\" 0 must be positive"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," SIZES_BUT("\"head_dim\":-4,\"vocab_size\":100") "}",
         "\"head_dim\" -4 must be positive"},
        {"{\"architectures\":[12]," BASE "}", "\"architectures\"[0] is not a string"},
        {"{\"architectures\":\"Qwen3ForCausalLM\"," BASE "}", "\"architectures\" is not a list"},
        {"{\"architectures\":[]," BASE "}", "\"architectures\" is empty"},
        {QWEN3 ",\"eos_token_id\":\"x\"}", "\"eos_token_id\" is not an integer, a list of integers or null"},
        {QWEN3 ",\"eos_token_id\":2.0}", "\"eos_token_id\" is not an integer"},
        {QWEN3 ",\"eos_token_id\":[1,\"x\"]}", "\"eos_token_id\"[1] is not an integer"},
        {QWEN3 ",\"bos_token_id\":\"x\"}", "\"bos_token_id\" is not an integer or null"},
        {QWEN3 ",\"rope_scaling\":\"x\"}", "\"rope_scaling\" is not an object or null"},
        {QWEN3 ",\"rope_scaling\":5}", "\"rope_scaling\" is not an object or null"},
        {QWEN3 ",\"rope_parameters\":[1]}", "\"rope_parameters\" is not an object or null"},
        {QWEN3 ",\"rope_scaling\":{\"rope_type\":5}}", "\"rope_scaling\".rope_type is not a string"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dfl_model_config c;
        int rc = parse(&c, cases[i].json);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), cases[i].why) && strstr(dfl_errmsg(), "config.json"),
                 "case %zu: rc %d '%s', wanted '%s'", i, rc, dfl_errmsg(), cases[i].why);
        dfl_model_config_free(&c);
    }
    /* the forms transformers writes are read */
    dfl_model_config c;
    T_CHECK(parse(&c, QWEN3 ",\"eos_token_id\":[5,7],\"bos_token_id\":null,\"rope_scaling\":null}") == 0);
    T_CHECK(c.n_eos == 2 && c.eos_token_ids[0] == 5 && c.eos_token_ids[1] == 7 && c.bos_token_id == -1);
    dfl_model_config_free(&c);
    T_CHECK(parse(&c, QWEN3 ",\"eos_token_id\":3,\"bos_token_id\":1,\"rope_parameters\":null}") == 0);
    T_CHECK(c.n_eos == 1 && c.eos_token_ids[0] == 3 && c.bos_token_id == 1);
    dfl_model_config_free(&c);
    T_CHECK(parse(&c, QWEN3 ",\"eos_token_id\":null}") == 0 && c.n_eos == 0);
    dfl_model_config_free(&c);
    /* a list is kept whole up to DFL_MAX_EOS ids (the ninth was dropped
     * without a word), and refused past it */
    char json[4096];
    for (int n = 9; n <= DFL_MAX_EOS + 1; n += DFL_MAX_EOS - 8) {
        int k = snprintf(json, sizeof json, QWEN3 ",\"eos_token_id\":[");
        for (int i = 0; i < n; i++) k += snprintf(json + k, sizeof json - (size_t)k, "%s%d", i ? "," : "", 100 + i);
        snprintf(json + k, sizeof json - (size_t)k, "]}");
        int rc = parse(&c, json);
        if (n <= DFL_MAX_EOS) {
            T_CHECKF(rc == 0 && c.n_eos == n && c.eos_token_ids[n - 1] == 100 + n - 1, "%d ids: rc %d, %d kept", n,
                     rc, c.n_eos);
        } else {
            T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "\"eos_token_id\" lists 65 ids, more than 64"),
                     "%d ids: rc %d '%s'", n, rc, dfl_errmsg());
        }
        dfl_model_config_free(&c);
    }
}

/* Qwen3.5: the flat text config and the released VLM one (settings under
 * text_config, weights under model.language_model.), the transformers
 * defaults (interval-4 layer pattern, 1/4 rotary) and the refusals. */
#define Q35 "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":8,\"num_attention_heads\":4," \
            "\"num_key_value_heads\":2,\"head_dim\":32,\"vocab_size\":100,\"linear_num_key_heads\":2," \
            "\"linear_key_head_dim\":16,\"linear_value_head_dim\":24"
#define Q35_V4 ",\"linear_num_value_heads\":4"
#define Q35_ROPE "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":10000000,\"mrope_section\":[2,1,1]," \
                 "\"mrope_interleaved\":true,\"partial_rotary_factor\":0.25}"

static void test_qwen35(void) {
    dfl_model_config a, b;
    T_CHECK(parse(&a, "{\"architectures\":[\"Qwen3_5ForCausalLM\"],\"model_type\":\"qwen3_5_text\"," Q35 Q35_V4 "," Q35_ROPE
                      ",\"layer_types\":[\"linear_attention\",\"full_attention\",\"linear_attention\",\"linear_attention\","
                      "\"linear_attention\",\"linear_attention\",\"linear_attention\",\"full_attention\"]}") == 0);
    T_CHECK(a.hybrid && a.norm_plus_one && a.attn_output_gate && a.rotary_dim == 8 && a.lin_k_heads == 2 &&
            a.lin_v_heads == 4 && a.lin_k_dim == 16 && a.lin_v_dim == 24 && a.lin_conv == 4);
    T_CHECK(!strcmp(a.weight_prefix, "model."));
    /* layer_types as written, not the interval rule */
    T_CHECK(!dfl_model_config_linear_layer(&a, 1) && dfl_model_config_linear_layer(&a, 3) &&
            !dfl_model_config_linear_layer(&a, 7) && dfl_model_config_linear_layer(&a, 0));
    float f[16];
    dfl_rope_inv_freq(&a, f);
    for (int i = 0; i < 16; i++) { /* 4 frequencies of an 8-wide RoPE, then no rotation */
        double want = i < 4 ? 1.0 / pow(1e7, 2.0 * i / 8) : 0.0;
        T_CHECKF(fabs(f[i] - want) <= 1e-6 * want, "i=%d %g vs %g", i, f[i], want);
    }
    T_CHECK(parse(&b, "{\"architectures\":[\"Qwen3_5ForConditionalGeneration\"],\"model_type\":\"qwen3_5\","
                      "\"tie_word_embeddings\":false,\"vision_config\":{\"depth\":2,\"hidden_size\":16},"
                      "\"text_config\":{\"model_type\":\"qwen3_5_text\"," Q35 Q35_V4 ",\"rope_parameters\":{\"rope_theta\":10000000},"
                      "\"eos_token_id\":7,\"dtype\":\"bfloat16\"}}") == 0);
    T_CHECK(b.hybrid && b.hidden_size == 64 && b.num_hidden_layers == 8 && !strcmp(b.weight_prefix, "model.language_model."));
    T_CHECK(b.rotary_dim == 8 && b.full_attention_interval == 4 && b.n_eos == 1 && b.eos_token_ids[0] == 7);
    T_CHECK(!strcmp(b.dtype, "bfloat16"));
    for (int i = 0; i < 8; i++) /* no layer_types: every 4th layer is full attention */
        T_CHECKF(dfl_model_config_linear_layer(&b, i) == ((i + 1) % 4 != 0), "layer %d", i);
    dfl_model_config_free(&a);
    dfl_model_config_free(&b);
    static const struct { const char *json, *why; } bad[] = {
        {"{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35 ",\"layer_types\":[\"linear_attention\"]}", "one type for each"},
        {"{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35 ",\"linear_num_value_heads\":3}", "linear_num_value_heads"},
        {"{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35 ",\"partial_rotary_factor\":0.01}", "partial_rotary_factor"},
        {"{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35 ",\"linear_conv_kernel_dim\":0}", "positive"},
        {"{\"architectures\":[\"Qwen3_5ForConditionalGeneration\"]," Q35 "}", "text_config"},
        {"{\"architectures\":[\"Qwen3NextForCausalLM\"]," Q35 ",\"linear_num_value_heads\":3}", "linear_num_value_heads"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"partial_rotary_factor\":0.5}", "hybrids only"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"layer_types\":[\"linear_attention\"]}", "layer_types"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        dfl_model_config c;
        int rc = parse(&c, bad[i].json);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), bad[i].why), "case %zu: rc %d, %s", i, rc, dfl_errmsg());
        dfl_model_config_free(&c);
    }
}

/* Keys a Qwen3.5 config may leave out take transformers' values
 * (Qwen3_5TextConfig / Qwen3_5Config, checked with transformers 5.24):
 * head_dim 256 and 4 KV heads (not hidden/heads and all heads), layer_types
 * null = absent, and a VLM's LM head is tied by its top-level key only
 * (absent: untied, whatever text_config says). A bad size is reported as
 * such, not as a rotary mismatch. */
#define Q35_MIN "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,\"num_attention_heads\":8," \
                "\"vocab_size\":100"
static void test_qwen35_defaults(void) {
    dfl_model_config a, b, v;
    T_CHECK(parse(&a, "{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35_MIN ",\"layer_types\":null}") == 0);
    T_CHECKF(a.head_dim == 256 && a.num_key_value_heads == 4 && a.rotary_dim == 64, "head_dim %lld, kv heads %lld",
             (long long)a.head_dim, (long long)a.num_key_value_heads);
    for (int i = 0; i < 4; i++) T_CHECKF(dfl_model_config_linear_layer(&a, i) == (i != 3), "layer %d", i);
    T_CHECK(parse(&b, "{\"architectures\":[\"Qwen3ForCausalLM\"]," Q35_MIN "}") == 0);
    T_CHECK(b.head_dim == 8 && b.num_key_value_heads == 8); /* Qwen3 keeps hidden/heads and all heads */
    T_CHECK(parse(&v, "{\"architectures\":[\"Qwen3_5ForConditionalGeneration\"],"
                      "\"text_config\":{" Q35_MIN ",\"tie_word_embeddings\":true}}") == 0);
    T_CHECK(v.tie_word_embeddings == 0);
    dfl_model_config_free(&v);
    T_CHECK(parse(&v, "{\"architectures\":[\"Qwen3_5ForConditionalGeneration\"],\"tie_word_embeddings\":true,"
                      "\"text_config\":{" Q35_MIN ",\"tie_word_embeddings\":false}}") == 0);
    T_CHECK(v.tie_word_embeddings == 1);
    dfl_model_config_free(&a);
    dfl_model_config_free(&b);
    dfl_model_config_free(&v);
    int rc = parse(&a, "{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35_MIN ",\"head_dim\":0}");
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "\"head_dim\" 0 must be positive"), "rc %d, %s", rc, dfl_errmsg());
    dfl_model_config_free(&a);
    /* the VLM's key is named where it is, under text_config */
    rc = parse(&v, "{\"architectures\":[\"Qwen3_5ForConditionalGeneration\"],\"text_config\":{" Q35_MIN ",\"head_dim\":0}}");
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "\"text_config.head_dim\" 0 must be positive"), "rc %d, %s", rc,
             dfl_errmsg());
    dfl_model_config_free(&v);
    rc = parse(&a, "{\"architectures\":[\"Qwen3_5ForCausalLM\"]," Q35_MIN ",\"linear_conv_kernel_dim\":0}");
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "\"linear_conv_kernel_dim\" 0 must be positive"), "rc %d, %s", rc,
             dfl_errmsg());
    dfl_model_config_free(&a);
}

/* Mixture of experts: which layers are sparse (Qwen3-MoE: mlp_only_layers
 * and decoder_sparse_step, as transformers' Qwen3MoeDecoderLayer; Qwen3.5-MoE:
 * all), the defaults of Qwen3MoeConfig / Qwen3_5MoeTextConfig (transformers
 * 5.24: 128 experts, 8 per token, width 768, norm_topk_prob false; Qwen3.5:
 * 256, 8, 512, a shared expert of 512, always renormalised), and the
 * refusals. */
#define MOE_BASE "\"hidden_size\":64,\"num_hidden_layers\":6,\"num_attention_heads\":4,\"num_key_value_heads\":2," \
                 "\"head_dim\":16,\"vocab_size\":100"
static void test_moe(void) {
    dfl_model_config a, b, d, v;
    T_CHECK(parse(&a, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,"
                      "\"num_experts\":6,\"num_experts_per_tok\":2,\"moe_intermediate_size\":20,"
                      "\"norm_topk_prob\":true,\"decoder_sparse_step\":2,\"mlp_only_layers\":[3]}") == 0);
    T_CHECK(a.num_experts == 6 && a.experts_per_tok == 2 && a.moe_intermediate_size == 20 && a.norm_topk_prob &&
            a.shared_expert_intermediate_size == 0 && !a.hybrid && a.qk_norm && !strcmp(a.weight_prefix, "model."));
    for (int i = 0; i < 6; i++) /* every 2nd layer (1, 3, 5), but not 3 */
        T_CHECKF(dfl_model_config_moe_layer(&a, i) == (i == 1 || i == 5), "layer %d", i);
    T_CHECK(parse(&d, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96}") == 0);
    T_CHECK(d.num_experts == 128 && d.experts_per_tok == 8 && d.moe_intermediate_size == 768 && !d.norm_topk_prob &&
            d.decoder_sparse_step == 1);
    for (int i = 0; i < 6; i++) T_CHECKF(dfl_model_config_moe_layer(&d, i), "layer %d", i);
    dfl_model_config_free(&d);
    /* transformers 5's spelling of the expert count */
    T_CHECK(parse(&d, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,"
                      "\"num_local_experts\":12}") == 0);
    T_CHECK(d.num_experts == 12);
    dfl_model_config_free(&d);
    T_CHECK(parse(&d, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,"
                      "\"num_local_experts\":12,\"num_experts\":12}") == 0);
    T_CHECK(d.num_experts == 12);
    dfl_model_config_free(&d);
    /* Qwen3_5MoeTextConfig has no num_local_experts: the default 256 */
    T_CHECK(parse(&d, "{\"architectures\":[\"Qwen3_5MoeForCausalLM\"]," MOE_BASE ",\"num_local_experts\":12}") == 0);
    T_CHECK(d.num_experts == 256);
    /* Qwen3.5-MoE: no intermediate_size; a shared expert; every layer sparse */
    T_CHECK(parse(&v, "{\"architectures\":[\"Qwen3_5MoeForConditionalGeneration\"],\"model_type\":\"qwen3_5_moe\","
                      "\"text_config\":{" MOE_BASE ",\"num_experts\":8,\"num_experts_per_tok\":3,"
                      "\"moe_intermediate_size\":24,\"shared_expert_intermediate_size\":40,\"norm_topk_prob\":false}}") == 0);
    T_CHECK(v.hybrid && v.num_experts == 8 && v.experts_per_tok == 3 && v.moe_intermediate_size == 24 &&
            v.shared_expert_intermediate_size == 40 && v.norm_topk_prob && v.intermediate_size == 0 &&
            !strcmp(v.weight_prefix, "model.language_model."));
    for (int i = 0; i < 6; i++) T_CHECKF(dfl_model_config_moe_layer(&v, i), "layer %d", i);
    T_CHECK(parse(&b, "{\"architectures\":[\"Qwen3_5MoeForCausalLM\"]," MOE_BASE "}") == 0);
    T_CHECK(b.num_experts == 256 && b.experts_per_tok == 8 && b.moe_intermediate_size == 512 &&
            b.shared_expert_intermediate_size == 512 && !strcmp(b.weight_prefix, "model."));
    /* a dense model is never sparse */
    dfl_model_config q;
    T_CHECK(parse(&q, "{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"num_experts\":4}") == 0);
    T_CHECK(q.num_experts == 0 && !dfl_model_config_moe_layer(&q, 0));
    dfl_model_config *all[] = {&a, &b, &d, &v, &q};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) dfl_model_config_free(all[i]);
    static const struct { const char *json, *why; } bad[] = {
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts\":4,"
         "\"num_experts_per_tok\":5}", "num_experts_per_tok"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts_per_tok\":0}",
         "num_experts_per_tok"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts\":0}",
         "num_experts"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"moe_intermediate_size\":0}",
         "moe_intermediate_size"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"decoder_sparse_step\":0}",
         "decoder_sparse_step"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"mlp_only_layers\":3}",
         "mlp_only_layers"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"mlp_only_layers\":[\"1\"]}",
         "mlp_only_layers\"[0]"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":0,\"mlp_only_layers\":[2]}",
         "layer 2 has a dense MLP"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts\":-3}",
         "\"num_experts\" is negative"},
        /* transformers would take num_local_experts (7), not num_experts */
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts\":5,\"num_experts_per_tok\":2,"
         "\"num_local_experts\":7}", "disagree"},
        {"{\"architectures\":[\"Qwen3_5MoeForCausalLM\"]," MOE_BASE ",\"shared_expert_intermediate_size\":-1}",
         "shared_expert_intermediate_size"},
        /* refused at once, not after a scan of 4e15 layers for dense ones */
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":4000000000000000,"
         "\"num_attention_heads\":4,\"vocab_size\":100,\"decoder_sparse_step\":2,\"mlp_only_layers\":[1,2,3]}",
         "num_hidden_layers"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"norm_topk_prob\":1}",
         "norm_topk_prob"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts\":5000}",
         "4096"},
        {"{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,\"num_experts\":4000000,"
         "\"moe_intermediate_size\":4000000}", "4096"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        dfl_model_config c;
        int rc = parse(&c, bad[i].json);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), bad[i].why), "case %zu: rc %d, %s", i, rc, dfl_errmsg());
        dfl_model_config_free(&c);
    }
    /* absent keys: transformers 5.24's defaults (Qwen3MoeConfig: 4 KV heads,
     * a dense width of 6144, head_dim hidden/heads; Qwen3_5MoeTextConfig: 2
     * KV heads, 256-wide heads) */
    T_CHECK(parse(&a, "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":2,"
                      "\"num_attention_heads\":8,\"vocab_size\":100,\"mlp_only_layers\":[0]}") == 0);
    T_CHECKF(a.num_key_value_heads == 4 && a.intermediate_size == 6144 && a.head_dim == 8,
             "kv heads %lld, intermediate %lld, head_dim %lld", (long long)a.num_key_value_heads,
             (long long)a.intermediate_size, (long long)a.head_dim);
    T_CHECK(!dfl_model_config_moe_layer(&a, 0) && dfl_model_config_moe_layer(&a, 1));
    dfl_model_config_free(&a);
    T_CHECK(parse(&a, "{\"architectures\":[\"Qwen3_5MoeForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":4,"
                      "\"num_attention_heads\":8,\"vocab_size\":100}") == 0);
    T_CHECKF(a.num_key_value_heads == 2 && a.head_dim == 256 && a.intermediate_size == 0, "kv heads %lld",
             (long long)a.num_key_value_heads);
    dfl_model_config_free(&a);
    /* experts so wide that the parameters pass 2^46 */
    int rc = parse(&a, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"intermediate_size\":96,"
                       "\"num_experts\":4000,\"moe_intermediate_size\":4000000000}");
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "2^46"), "rc %d, %s", rc, dfl_errmsg());
    dfl_model_config_free(&a);
}

/* A long mlp_only_layers (the file may hold a million entries) is read in
 * one pass, not once per layer: 100000 layers, all dense but the ones not
 * listed (every 1000th), listed in reverse with a negative and an
 * out-of-range entry. dfl_model_config_moe_layers must agree with the
 * per-layer dfl_model_config_moe_layer on a short list too. */
static void test_moe_long_layer_list(void) {
    enum { L = 100000 };
    size_t cap = (size_t)L * 8 + 1024, n = 0;
    char *j = dfl_malloc(cap);
    n += (size_t)snprintf(j + n, cap - n, "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":8,"
                          "\"num_hidden_layers\":%d,\"num_attention_heads\":2,\"num_key_value_heads\":1,\"vocab_size\":10,"
                          "\"num_experts\":2,\"num_experts_per_tok\":1,\"moe_intermediate_size\":4,\"intermediate_size\":%%d,"
                          "\"mlp_only_layers\":[-1,%d", L, L + 7);
    for (int i = L - 1; i >= 0; i--)
        if (i % 1000) n += (size_t)snprintf(j + n, cap - n, ",%d", i);
    snprintf(j + n, cap - n, "]}");
    char *text = dfl_malloc(cap + 16);
    dfl_model_config c;
    snprintf(text, cap + 16, j, 8);
    T_CHECKF(parse(&c, text) == 0, "%s", dfl_errmsg());
    unsigned char *sparse = dfl_malloc(L);
    dfl_model_config_moe_layers(&c, L, sparse);
    int bad = 0;
    for (int i = 0; i < L; i++) bad += sparse[i] != (i % 1000 == 0);
    T_CHECKF(bad == 0, "%d layers wrong", bad);
    dfl_model_config_free(&c);
    snprintf(text, cap + 16, j, 0); /* the dense layers have no width */
    int rc = parse(&c, text);
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "layer 1 has a dense MLP"), "rc %d, %s", rc, dfl_errmsg());
    dfl_model_config_free(&c);
    T_CHECKF(parse(&c, "{\"architectures\":[\"Qwen3MoeForCausalLM\"]," MOE_BASE ",\"num_experts\":4,\"num_experts_per_tok\":2,"
                      "\"decoder_sparse_step\":2,\"mlp_only_layers\":[5,-2,9,0,5]}") == 0, "%s", dfl_errmsg());
    dfl_model_config_moe_layers(&c, 8, sparse);
    for (int i = 0; i < 8; i++)
        T_CHECKF(sparse[i] == dfl_model_config_moe_layer(&c, i) && sparse[i] == (i == 1 || i == 3 || i == 7),
                 "layer %d", i);
    dfl_model_config_free(&c);
    free(sparse);
    free(text);
    free(j);
}

static void test_default_layer_ids(void) {
    int ids[5];
    dfl_default_layer_ids(36, 5, ids);
    T_CHECK(ids[0] == 1 && ids[1] == 9 && ids[2] == 17 && ids[3] == 25 && ids[4] == 33);
    dfl_default_layer_ids(32, 5, ids);
    T_CHECK(ids[0] == 1 && ids[1] == 8 && ids[2] == 15 && ids[3] == 22 && ids[4] == 29);
    /* L=26: 1 + 5.5 = 6.5 and 1 + 16.5 = 17.5; Python rounds half to even: 6 and 18. */
    dfl_default_layer_ids(26, 5, ids);
    T_CHECK(ids[0] == 1 && ids[1] == 6 && ids[2] == 12 && ids[3] == 18 && ids[4] == 23);
    dfl_default_layer_ids(36, 1, ids);
    T_CHECK(ids[0] == 18);
}

int main(void) {
    T_RUN(test_both_rope_spellings);
    T_RUN(test_llama3_rope);
    T_RUN(test_yarn_keys);
    T_RUN(test_qwen2);
    T_RUN(test_qwen3_moe_window);
    T_RUN(test_mistral);
    T_RUN(test_gpt_oss);
    T_RUN(test_qwen3_next);
    T_RUN(test_refusals);
    T_RUN(test_fields_named);
    T_RUN(test_qwen35);
    T_RUN(test_qwen35_defaults);
    T_RUN(test_moe);
    T_RUN(test_moe_long_layer_list);
    T_RUN(test_default_layer_ids);
    return t_exit();
}
