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

/* Open CORPUS/NAME split into a model directory as the fuzz target does. */
static int open_split(const char *name, dfl_st **st) {
    char path[512];
    snprintf(path, sizeof path, CORPUS "/%s", name);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static uint8_t buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    char paths[MAX_SHARDS + 1][512];
    written w[MAX_SHARDS + 1];
    int parts = write_parts(buf, n, paths, w), rc = dfl_st_open_dir(st, st_dir);
    for (int k = 0; k < parts; k++) unlink(paths[k]);
    return rc;
}

/* The sharded seed opens as a directory with its three tensors. */
static void test_sharded_seed(void) {
    dfl_st *st = NULL;
    T_CHECKF(open_split("dir-ok.txt", &st) == 0, "%s", dfl_errmsg());
    if (st) {
        T_CHECK(dfl_st_count(st) == 3 && dfl_st_find(st, "a") && dfl_st_find(st, "b") && dfl_st_find(st, "c"));
        T_CHECK(strstr(dfl_st_find(st, "a")->file, "/s1.safetensors") && strstr(dfl_st_find(st, "c")->file, "/s2.safetensors"));
        dfl_st_close(st);
    }
    T_CHECK(open_split("dir-bad-shard.txt", &st) == DFL_EX_NOINPUT && !st); /* names a missing s9 */
}

/* Bug: a tensor name in two shards was accepted, the second copy silently
 * shadowed by the first (dfl_st_find returns one of them). */
static void test_name_in_two_shards(void) {
    dfl_st *st = NULL;
    int rc = open_split("dir-regress-dup-across-shards.txt", &st);
    T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), "two shards"), "rc %d: %s", rc, dfl_errmsg());
    dfl_st_close(st);
}

int main(void) {
    T_RUN(test_replay_corpus);
    T_RUN(test_seeds_as_named);
    T_RUN(test_sharded_seed);
    T_RUN(test_name_in_two_shards);
    return t_exit();
}
