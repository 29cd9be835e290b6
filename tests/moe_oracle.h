/* moe_oracle.h: the routing of ops.h's moe_route by its definition, for
 * the tests (test_ops_cpu.c: the CPU op; ops_agree.h: both backends): each
 * token's experts by a sort of its logits (descending, the lower id first on
 * equal values; softmax is monotonic, so this is the order of p), their
 * weights from a softmax in double, renormalised when `norm`. */
#ifndef DFLASH_MOE_ORACLE_H
#define DFLASH_MOE_ORACLE_H

#include "common.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static const float *moe_oracle_row; /* the row qsort compares in */
static int moe_by_logit(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (moe_oracle_row[i] != moe_oracle_row[j]) return moe_oracle_row[i] > moe_oracle_row[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

/* ids[t, j], w[t, j] (f32 [T, k]) of logits [T, E] */
static void moe_oracle(int32_t *ids, float *w, const float *logits, int64_t T, int64_t E, int64_t k, int norm) {
    int32_t *order = dfl_malloc((size_t)E * 4);
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        for (int64_t e = 0; e < E; e++) order[e] = (int32_t)e;
        moe_oracle_row = l;
        qsort(order, (size_t)E, 4, moe_by_logit);
        double sum = 0, kept = 0;
        for (int64_t e = 0; e < E; e++) sum += exp((double)l[e] - l[order[0]]);
        for (int64_t j = 0; j < k; j++) kept += exp((double)l[order[j]] - l[order[0]]) / sum;
        for (int64_t j = 0; j < k; j++) {
            ids[t * k + j] = order[j];
            w[t * k + j] = (float)(exp((double)l[order[j]] - l[order[0]]) / sum / (norm ? kept : 1.0));
        }
    }
    free(order);
}

#endif
