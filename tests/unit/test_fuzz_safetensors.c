/* test_fuzz_safetensors.c: replay tests/fuzz/corpus/fuzz_safetensors through
 * the fuzz target (its invariants abort on a violation), and check that the
 * hand-made seeds (tests/fuzz/seeds/make_st_seeds.py, written from the
 * format description) give what their names promise: ok-* open, bad-* are
 * refused with DFL_EX_DATA. */
#include "fuzz/fuzz_safetensors.c"
#include "fuzz/replay.h"
#include "test.h"

#include <dirent.h>

#define CORPUS "tests/fuzz/corpus/fuzz_safetensors"

static void test_replay_corpus(void) {
    int n = fuzz_replay(CORPUS);
    printf("  replayed %d corpus files\n", n);
    T_CHECKF(n >= 20, "replayed %d files; run from the repository root", n);
}

static void test_seeds_as_named(void) {
    DIR *d = opendir(CORPUS);
    T_CHECK(d != NULL);
    if (!d) return;
    int ok = 0, bad = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int want_ok = !strncmp(e->d_name, "ok-", 3), want_bad = !strncmp(e->d_name, "bad-", 4);
        if (!want_ok && !want_bad) continue;
        char path[512];
        snprintf(path, sizeof path, CORPUS "/%s", e->d_name);
        dfl_st *st = NULL;
        int rc = dfl_st_open(&st, path);
        T_CHECKF(rc == (want_ok ? 0 : DFL_EX_DATA), "%s: rc %d: %s", e->d_name, rc, dfl_errmsg());
        dfl_st_close(st);
        ok += want_ok;
        bad += want_bad;
    }
    closedir(d);
    T_CHECKF(ok >= 5 && bad >= 10, "%d ok, %d bad seeds", ok, bad);
}

/* The sharded seed opens as a directory with its three tensors. */
static void test_sharded_seed(void) {
    FILE *f = fopen(CORPUS "/dir-ok.txt", "rb");
    T_CHECK(f != NULL);
    if (!f) return;
    uint8_t buf[4096];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    T_CHECK(make_dir() == 0);
    fuzz_dir(buf, n); /* aborts on a broken invariant */
    /* and by hand: split, write, open */
    const uint8_t *s1 = memmem(buf, n, SEP, strlen(SEP)), *s2 = s1 ? memmem(s1 + 1, n - (size_t)(s1 + 1 - buf), SEP, strlen(SEP)) : NULL;
    T_CHECK(s1 && s2);
    if (!s1 || !s2) return;
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", st_dir);
    write_all(p, buf, (size_t)(s1 - buf));
    snprintf(p, sizeof p, "%s/s1.safetensors", st_dir);
    write_all(p, s1 + strlen(SEP), (size_t)(s2 - s1) - strlen(SEP));
    snprintf(p, sizeof p, "%s/s2.safetensors", st_dir);
    write_all(p, s2 + strlen(SEP), n - (size_t)(s2 - buf) - strlen(SEP));
    dfl_st *st = NULL;
    T_CHECKF(dfl_st_open_dir(&st, st_dir) == 0, "%s", dfl_errmsg());
    if (st) {
        T_CHECK(dfl_st_count(st) == 3 && dfl_st_find(st, "a") && dfl_st_find(st, "b") && dfl_st_find(st, "c"));
        T_CHECK(strstr(dfl_st_find(st, "a")->file, "/s1.safetensors") && strstr(dfl_st_find(st, "c")->file, "/s2.safetensors"));
        dfl_st_close(st);
    }
}

int main(void) {
    T_RUN(test_replay_corpus);
    T_RUN(test_seeds_as_named);
    T_RUN(test_sharded_seed);
    return t_exit();
}
