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

static void test_refusals(void) {
    static const struct { const char *json, *why; } cases[] = {
        {"{\"architectures\":[\"MistralForCausalLM\"]," BASE "}", "not supported"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"attention_bias\":true}", "attention_bias"},
        {"{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}", "yarn"},
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
    T_RUN(test_refusals);
    T_RUN(test_default_layer_ids);
    return t_exit();
}
