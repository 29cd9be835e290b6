/* test_ops_cuda.c: the CUDA op table against the CPU reference, op by op
 * (tests/ops_agree.h says what is compared and with which limits).
 *
 * Linked three ways (Makefile): with the real CUDA backend (a GPU runs the
 * agreement tests; without a GPU or driver, the one check is that asking
 * for "cuda" fails cleanly with exit code 69 and CUDA's reason, and the
 * CPU still works), and as test_ops_cuda_emu with the kernels compiled for
 * the CPU against tests/emu, which runs the agreement tests everywhere.
 * DFLASH_TEST_BIG=1 adds the real-size shapes (tests/gpu/run.sh). */
#include "ops_agree.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int unavail_code;
static char unavail_msg[1024];

static void cuda_unavailable_reported_cleanly(void) {
    T_CHECKF(unavail_code == DFL_EX_UNAVAIL, "dfl_ops_get(\"cuda\") returned %d, not %d", unavail_code,
             DFL_EX_UNAVAIL);
    T_CHECKF(strstr(unavail_msg, "cuda") != NULL && strlen(unavail_msg) > 20, "message: '%s'", unavail_msg);
    const dfl_ops *o = NULL;
    T_CHECK(dfl_ops_get("cuda:1", &o) == DFL_EX_UNAVAIL && o == NULL);
    T_CHECK(dfl_ops_get("cpu", &o) == 0 && o && !strcmp(o->name, "cpu"));
}

int main(void) {
    setenv("DFLASH_CUDA_LMHEAD_ROWS", "16", 0); /* several LM-head chunks at test sizes */
    const dfl_ops *cuda = NULL;
    int rc = dfl_ops_get("cuda", &cuda);
    if (rc != 0) {
        unavail_code = rc;
        snprintf(unavail_msg, sizeof unavail_msg, "%s", dfl_errmsg());
        printf("no CUDA backend here (exit code %d): %s\n", rc, unavail_msg);
        T_RUN(cuda_unavailable_reported_cleanly);
        return t_exit();
    }
    REF = dfl_ops_cpu();
    DEV = cuda;
    AG_BIG = getenv("DFLASH_TEST_BIG") && strcmp(getenv("DFLASH_TEST_BIG"), "0") != 0;
    const char *simple = getenv("DFLASH_CUDA_SIMPLE");
    printf("CUDA backend%s%s\n", simple && strcmp(simple, "0") ? " (simple attention kernels)" : "",
           AG_BIG ? ", with the real-size shapes" : "");
    ops_agree_all(20261130);
    return t_exit();
}
