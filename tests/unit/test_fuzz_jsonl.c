/* test_fuzz_jsonl.c: replay tests/fuzz/corpus/fuzz_jsonl through the fuzz
 * target (it aborts on a broken invariant), in both builds, and check the
 * seeds give what their names promise (vocabulary 1000, as the target). */
#include "fuzz/fuzz_jsonl.c"
#include "fuzz/replay.h"
#include "test.h"

#include <dirent.h>

#define CORPUS "tests/fuzz/corpus/fuzz_jsonl"

static void test_replay_corpus(void) {
    int n = fuzz_replay(CORPUS);
    printf("  replayed %d corpus files\n", n);
    T_CHECKF(n >= 5, "replayed %d files; run from the repository root", n);
}

static void test_seeds_as_named(void) {
    DIR *d = opendir(CORPUS);
    T_CHECK(d != NULL);
    if (!d) return;
    int seen = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int ok = !strncmp(e->d_name, "ok", 2), bad = !strncmp(e->d_name, "bad-", 4);
        if (!ok && !bad) continue;
        char path[512];
        snprintf(path, sizeof path, CORPUS "/%s", e->d_name);
        FILE *f = fopen(path, "rb");
        char buf[4096];
        size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
        if (f) fclose(f);
        dfl_jsonl_sample s;
        int rc = dfl_jsonl_parse(&s, buf, n, 1000, path, 1);
        T_CHECKF(rc == (ok ? 0 : DFL_EX_DATA), "%s: rc %d: %s", e->d_name, rc, dfl_errmsg());
        if (rc == 0) dfl_jsonl_sample_free(&s);
        seen++;
    }
    closedir(d);
    T_CHECK(seen >= 8);
}

int main(void) {
    T_RUN(test_replay_corpus);
    T_RUN(test_seeds_as_named);
    return t_exit();
}
