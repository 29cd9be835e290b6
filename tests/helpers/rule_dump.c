/* rule_dump: print the small rules of libdflash that tests/reference/
 * crosscheck_impls.py compares with the reference implementations (z-lab,
 * SpecForge), one per line, as plain text:
 *
 *   rule_dump layer-ids MAX_L MAX_N   "ids L N: i0 i1 ..." for L = 1..MAX_L,
 *                                      N = 1..MAX_N (dfl_default_layer_ids)
 *   rule_dump gamma B...               "gamma B: G" (dfl_train_opts_default)
 *   rule_dump anchors MASK...          "anchors MASK: a0 a1 ..." where MASK is
 *                                      a loss mask written as 0/1 characters
 *                                      (dfl_anchor_candidates)
 *
 * Run by hand through the script; no test depends on it. */
#include "model_config.h"
#include "train.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int layer_ids(int max_l, int max_n) {
    int ids[64];
    if (max_n < 1 || max_n > 64 || max_l < 1) return 2;
    for (int L = 1; L <= max_l; L++)
        for (int n = 1; n <= max_n; n++) {
            dfl_default_layer_ids(L, n, ids);
            printf("ids %d %d:", L, n);
            for (int i = 0; i < n; i++) printf(" %d", ids[i]);
            printf("\n");
        }
    return 0;
}

static int gammas(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        dfl_train_opts o;
        int b = atoi(argv[i]);
        dfl_train_opts_default(&o, b);
        printf("gamma %d: %.17g\n", b, o.gamma);
    }
    return 0;
}

static int anchors(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        int64_t T = (int64_t)strlen(argv[i]);
        uint8_t *m = malloc((size_t)T + 1);
        int32_t *c = malloc(((size_t)T + 1) * sizeof *c);
        if (!m || !c) return 70;
        for (int64_t t = 0; t < T; t++) m[t] = argv[i][t] == '1';
        int64_t n = dfl_anchor_candidates(c, m, T);
        printf("anchors %s:", argv[i]);
        for (int64_t k = 0; k < n; k++) printf(" %d", (int)c[k]);
        printf("\n");
        free(m);
        free(c);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "layer-ids")) return layer_ids(atoi(argv[2]), atoi(argv[3]));
    if (argc >= 2 && !strcmp(argv[1], "gamma")) return gammas(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "anchors")) return anchors(argc - 2, argv + 2);
    fprintf(stderr, "usage: rule_dump layer-ids MAX_L MAX_N | gamma B... | anchors MASK...\n");
    return 2;
}
