/* test_fuzz_config.c: replay tests/fuzz/corpus/fuzz_config through the fuzz
 * target (its invariants abort on a violation), check the seeds give the
 * results their names promise, and pin each config-reader bug the fuzzer
 * found: every case here was accepted before its fix. */
#include "fuzz/fuzz_config.c"
#include "fuzz/replay.h"
#include "test.h"

#define CORPUS "tests/fuzz/corpus/fuzz_config"

static void test_replay_corpus(void) {
    int n = fuzz_replay(CORPUS);
    printf("  replayed %d corpus files\n", n);
    T_CHECKF(n >= 10, "replayed %d files; run from the repository root", n);
}

/* The fixture configs parse; the hand-made hostile ones do not. */
static void test_seeds_as_named(void) {
    static const char *ok_target[] = {"llama3.json", "qwen3-tied.json", "qwen3-untied.json", "llama3-rope-parameters.json",
                                      "qwen35.json", "qwen35-vlm.json", "qwen3-moe.json", "qwen3-moe-fused.json",
                                      "qwen35-moe-vlm.json", "gpt-oss-20b.json", "qwen3-next-80b.json"};
    static const char *ok_drafter[] = {"drafter.json", "drafter-v5-default-ids.json"};
    static const char *bad[] = {"hostile-huge-sizes.json", "hostile-many-layers.json", "hostile-rope.json",
                                "hostile-eps-mask.json", "not-json.json"};
    char path[256];
    for (size_t i = 0; i < sizeof ok_target / sizeof *ok_target; i++) {
        dfl_model_config c;
        snprintf(path, sizeof path, CORPUS "/%s", ok_target[i]);
        T_CHECKF(dfl_model_config_load(&c, path, "target") == 0, "%s", dfl_errmsg());
        dfl_model_config_free(&c);
    }
    for (size_t i = 0; i < sizeof ok_drafter / sizeof *ok_drafter; i++) {
        dfl_drafter_config c;
        snprintf(path, sizeof path, CORPUS "/%s", ok_drafter[i]);
        T_CHECKF(dfl_drafter_config_load(&c, path) == 0, "%s", dfl_errmsg());
        dfl_drafter_config_free(&c);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        dfl_drafter_config c;
        snprintf(path, sizeof path, CORPUS "/%s", bad[i]);
        T_CHECKF(dfl_drafter_config_load(&c, path) == DFL_EX_DATA, "%s accepted", bad[i]);
        dfl_drafter_config_free(&c);
    }
}

#define SIZES(H, I, L, HQ, D, V)                                                                              \
    "\"hidden_size\":" #H ",\"intermediate_size\":" #I ",\"num_hidden_layers\":" #L ",\"num_attention_heads\":" #HQ \
    ",\"num_key_value_heads\":1,\"head_dim\":" #D ",\"vocab_size\":" #V
#define QWEN "{\"architectures\":[\"Qwen3ForCausalLM\"],"

static int target_rc(const char *json, const char *want_msg) {
    dfl_model_config c;
    int rc = dfl_model_config_parse(&c, json, strlen(json), "config.json", "target");
    if (rc && want_msg && !strstr(dfl_errmsg(), want_msg)) {
        fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", dfl_errmsg(), want_msg);
        rc = -1;
    }
    dfl_model_config_free(&c);
    return rc;
}

/* Bug: sizes whose products overflow int64 (UB in target.c/drafter.c shape
 * arithmetic, a wrapped allocation) and layer counts past an int were
 * accepted. */
static void test_sizes_bounded(void) {
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 100) "}", NULL) == 0);
    T_CHECK(target_rc(QWEN SIZES(1099511627776, 1099511627776, 4, 4, 16, 100) "}", "2^46") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 4611686018427387904) "}", "2^46") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 8589934592, 4, 16, 100) "}", "num_hidden_layers") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4611686018427387904, 2, 100) "}", "2^46") == DFL_EX_DATA);
}

/* Bug: an epsilon that is 0 (or inf) in f32, and RoPE settings giving
 * infinite or NaN frequencies, were accepted. */
static void test_f32_values(void) {
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 100) ",\"rms_norm_eps\":1e-60}", "rms_norm_eps") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 100) ",\"rms_norm_eps\":1e60}", "rms_norm_eps") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 100) ",\"rope_theta\":-1.0}", "rope_theta") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 100) ",\"rope_theta\":0}", "rope_theta") == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN SIZES(64, 96, 4, 4, 16, 100) ",\"rope_theta\":1e300}", "rope_theta") == DFL_EX_DATA);
#define LLAMA3(F, LO, HI, OLD)                                                                                  \
    "{\"architectures\":[\"LlamaForCausalLM\"]," SIZES(64, 96, 4, 4, 16, 100) ",\"rope_theta\":500000,"         \
    "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":" #F ",\"low_freq_factor\":" #LO ",\"high_freq_factor\":" #HI \
    ",\"original_max_position_embeddings\":" #OLD "}}"
    T_CHECK(target_rc(LLAMA3(8.0, 1.0, 4.0, 64), NULL) == 0);
    T_CHECK(target_rc(LLAMA3(1e-300, 1.0, 4.0, 64), "llama3") == DFL_EX_DATA);
    T_CHECK(target_rc(LLAMA3(8.0, 0.0, 4.0, 64), "llama3") == DFL_EX_DATA);
    T_CHECK(target_rc(LLAMA3(8.0, 1.0, 1e300, 64), "llama3") == DFL_EX_DATA);
    T_CHECK(target_rc(LLAMA3(8.0, 1.0, 4.0, 0), "llama3") == DFL_EX_DATA);
}

#define DRAFTER(H, NTL, IDS)                                                                                    \
    "{\"architectures\":[\"DFlashDraftModel\"]," SIZES(H, 28, 2, 3, 6, 37) ",\"block_size\":4,"                 \
    "\"num_target_layers\":" #NTL ",\"dflash_config\":{\"mask_token_id\":3" IDS "}}"

static int drafter_rc(const char *json, const char *want_msg) {
    dfl_drafter_config c;
    int rc = dfl_drafter_config_parse(&c, json, strlen(json), "config.json");
    if (rc && want_msg && !strstr(dfl_errmsg(), want_msg)) {
        fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", dfl_errmsg(), want_msg);
        rc = -1;
    }
    dfl_drafter_config_free(&c);
    return rc;
}

/* Bug: without target_layer_ids, the reference rule over fewer than 4 target
 * layers gave ids outside the target (2 layers: 1, -1), and the drafter
 * config and dflash-extract --drafter-config accepted them. */
static void test_default_ids_in_range(void) {
    T_CHECK(drafter_rc(DRAFTER(20, 6, ""), NULL) == 0);
    T_CHECK(drafter_rc(DRAFTER(20, 2, ""), "target_layer_ids") == DFL_EX_DATA);
    T_CHECK(drafter_rc(DRAFTER(20, 1, ""), "target_layer_ids") == DFL_EX_DATA);
    static const char *json[2] = {DRAFTER(20, 2, ""), DRAFTER(20, 6, "")};
    static const int L[2] = {2, 6};
    for (int k = 0; k < 2; k++) {
        char path[] = "/tmp/test_fuzz_config.XXXXXX";
        int fd = mkstemp(path);
        T_CHECK(fd >= 0 && write(fd, json[k], strlen(json[k])) == (ssize_t)strlen(json[k]));
        close(fd);
        int ids[DFL_EXTRACT_MAX_TAPS], n = 0, rc = dfl_extract_layer_ids(NULL, path, L[k], ids, &n);
        if (k == 0) T_CHECK(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "target_layer_ids"));
        else T_CHECK(rc == 0 && n == 2 && ids[0] == 1 && ids[1] == 3); /* 2 taps over [1, 6-3] */
        unlink(path);
    }
}

/* Bug: fc.weight [H, K*H] could overflow int64 when the rest of the model
 * is small (H = 2^22, K = 64). */
static void test_fc_bounded(void) {
    T_CHECK(drafter_rc(DRAFTER(4194304, 6, ",\"target_layer_ids\":[0,1,2,3,4,5]"), "fc.weight") == DFL_EX_DATA);
}

/* Bug: the default head_dim (hidden_size / num_attention_heads) was
 * computed for any non-zero head count: INT64_MIN / -1 traps (SIGFPE). */
static void test_head_dim_default_division(void) {
    T_CHECK(target_rc("{\"hidden_size\":-9223372036854775808,\"num_attention_heads\":-1,\"intermediate_size\":1,"
                      "\"num_hidden_layers\":1,\"vocab_size\":1}", NULL) == DFL_EX_DATA);
    T_CHECK(target_rc(QWEN "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":4,"
                      "\"num_attention_heads\":4,\"vocab_size\":100}", NULL) == 0);
}

int main(void) {
    T_RUN(test_replay_corpus);
    T_RUN(test_seeds_as_named);
    T_RUN(test_sizes_bounded);
    T_RUN(test_f32_values);
    T_RUN(test_default_ids_in_range);
    T_RUN(test_fc_bounded);
    T_RUN(test_head_dim_default_division);
    return t_exit();
}
