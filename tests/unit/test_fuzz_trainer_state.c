/* test_fuzz_trainer_state.c: replay tests/fuzz/corpus/fuzz_trainer_state
 * through the fuzz target (its invariants abort on a violation), and pin the
 * trainer_state.json bugs it found: each hostile-* seed was accepted before
 * its fix (rng words with a sign, spaces or "0x"; an all-zero RNG state; a
 * seed that is not a decimal number; a step past 2^53, whose step + --steps
 * overflowed). ok-baseline.json is a --steps 0 checkpoint: step 0 and
 * options.total_steps 0, a schedule not set yet; ok-step-2p53.json is at
 * the largest step taken. */
#include "fuzz/fuzz_trainer_state.c"
#include "fuzz/replay.h"
#include "test.h"

#define CORPUS "tests/fuzz/corpus/fuzz_trainer_state"

static void test_replay_corpus(void) {
    int n = fuzz_replay(CORPUS);
    printf("  replayed %d corpus files\n", n);
    T_CHECKF(n >= 8, "replayed %d files; run from the repository root", n);
}

static int restore_file(const char *name, dfl_trainer *t) {
    char path[512];
    snprintf(path, sizeof path, CORPUS "/%s", name);
    json_error_t je;
    json_t *j = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!j) return -1;
    static dfl_model_config tcfg;
    snprintf(tcfg.digest, sizeof tcfg.digest, "0123456789abcdef");
    memset(t, 0, sizeof *t);
    t->tcfg = &tcfg;
    int rc = dfl_trainer_restore(t, j, path);
    json_decref(j);
    return rc;
}

static void test_ok_seed(void) {
    dfl_trainer t;
    T_CHECKF(restore_file("ok.json", &t) == 0, "%s", dfl_errmsg());
    T_CHECK(t.step == 12 && t.seed == 42 && t.rng.s[0] == UINT64_C(0x9e3779b97f4a7c15) &&
            t.rng.s[3] == UINT64_C(0x0123456789abcdef));
}

/* The restore takes no option (dflash-train-step reads them), so a schedule
 * not set yet must not stop a baseline's state from being restored. */
static void test_baseline_seed(void) {
    dfl_trainer t;
    T_CHECKF(restore_file("ok-baseline.json", &t) == 0, "%s", dfl_errmsg());
    T_CHECK(t.step == 0 && t.seed == 42);
}

/* The largest step a state may hold (DFL_TRAIN_MAX_STEPS) is taken. */
static void test_step_limit_seed(void) {
    dfl_trainer t;
    T_CHECKF(restore_file("ok-step-2p53.json", &t) == 0, "%s", dfl_errmsg());
    T_CHECK(t.step == DFL_TRAIN_MAX_STEPS && t.step == INT64_C(9007199254740992));
}

static void test_hostile_refused(void) {
    static const struct { const char *file, *msg; } cases[] = {
        {"hostile-rng-sign.json", "\"rng\"[0]"},   {"hostile-rng-space-0x.json", "\"rng\"[0]"},
        {"hostile-rng-zero.json", "all zero"},     {"hostile-seed.json", "\"seed\""},
        {"hostile-seed-text.json", "\"seed\""},    {"hostile-step.json", "\"step\""},
        {"hostile-digest.json", "target config"},  {"hostile-rng-short.json", "\"rng\""},
        {"hostile-step-huge.json", "\"step\" is not a count in [0, 2^53]"},
        {"hostile-step-2p53-plus-1.json", "\"step\" is not a count in [0, 2^53]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dfl_trainer t;
        int rc = restore_file(cases[i].file, &t);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), cases[i].msg), "%s: rc %d: %s", cases[i].file, rc,
                 dfl_errmsg());
        T_CHECK(t.step == 0); /* nothing restored from a refused state */
    }
}

int main(void) {
    T_RUN(test_replay_corpus);
    T_RUN(test_ok_seed);
    T_RUN(test_baseline_seed);
    T_RUN(test_step_limit_seed);
    T_RUN(test_hostile_refused);
    return t_exit();
}
