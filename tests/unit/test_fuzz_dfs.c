/* test_fuzz_dfs.c: replay tests/fuzz/corpus/fuzz_dfs through the fuzz
 * target's entry point (built without libFuzzer), in both builds. */
#include "fuzz/fuzz_dfs.c"
#include "fuzz/replay.h"
#include "test.h"

static void test_replay_corpus(void) {
    int n = fuzz_replay("tests/fuzz/corpus/fuzz_dfs");
    printf("  replayed %d corpus files\n", n);
    T_CHECKF(n >= 5, "replayed %d files; run from the repository root", n);
}

int main(void) {
    T_RUN(test_replay_corpus);
    return t_exit();
}
