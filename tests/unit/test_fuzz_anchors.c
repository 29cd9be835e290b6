/* test_fuzz_anchors.c: replay tests/fuzz/corpus/fuzz_anchors through the
 * fuzz target (its invariants abort on a violation), and check the seeds:
 * ok.jsonl loads as its three ids, every hostile-* file is refused. */
#include "fuzz/fuzz_anchors.c"
#include "fuzz/replay.h"
#include "test.h"

#include <dirent.h>

#define CORPUS "tests/fuzz/corpus/fuzz_anchors"

static void test_replay_corpus(void) {
    int n = fuzz_replay(CORPUS);
    printf("  replayed %d corpus files\n", n);
    T_CHECKF(n >= 5, "replayed %d files; run from the repository root", n);
}

static void test_seeds_as_named(void) {
    json_t *m = NULL;
    T_CHECKF(dfl_score_load_anchors(CORPUS "/ok.jsonl", &m) == 0, "%s", dfl_errmsg());
    T_CHECK(json_object_size(m) == 3 && json_array_size(json_object_get(m, "a")) == 3 &&
            json_array_size(json_object_get(m, "7")) == 0 &&
            json_integer_value(json_array_get(json_object_get(m, "b"), 0)) == 16777215);
    json_decref(m);
    DIR *d = opendir(CORPUS);
    T_CHECK(d != NULL);
    if (!d) return;
    int bad = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "hostile-", 8)) continue;
        char path[512];
        snprintf(path, sizeof path, CORPUS "/%s", e->d_name);
        m = NULL;
        T_CHECKF(dfl_score_load_anchors(path, &m) == DFL_EX_DATA && !m, "%s accepted", e->d_name);
        json_decref(m);
        bad++;
    }
    closedir(d);
    T_CHECK(bad >= 5);
}

int main(void) {
    T_RUN(test_replay_corpus);
    T_RUN(test_seeds_as_named);
    return t_exit();
}
