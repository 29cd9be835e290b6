/* ops.c: choosing a backend by name. */
#include "ops.h"

#include "common.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#ifdef DFLASH_HAVE_CUDA
/* kernels/backend.cu: initialise device `dev` and return its table. */
int dfl_ops_cuda(int dev, const dfl_ops **out);
#endif

int dfl_ops_get(const char *device, const dfl_ops **out) {
    *out = NULL;
    if (!strcmp(device, "cpu")) {
        *out = dfl_ops_cpu();
        return 0;
    }
    if (strncmp(device, "cuda", 4) != 0 || (device[4] && device[4] != ':'))
        return dfl_err(DFL_EX_USAGE, "--device: '%s' is not one of cpu, cuda, cuda:N", device);
    int dev = 0;
    if (device[4] == ':') {
        char *end;
        long v = strtol(device + 5, &end, 10);
        if (end == device + 5 || *end || v < 0 || v > 1024)
            return dfl_err(DFL_EX_USAGE, "--device: '%s' is not one of cpu, cuda, cuda:N", device);
        dev = (int)v;
    }
#ifdef DFLASH_HAVE_CUDA
    return dfl_ops_cuda(dev, out);
#else
    (void)dev;
    return dfl_err(DFL_EX_UNAVAIL, "--device %s: this dflash was built without CUDA (nvcc was not found at build time)", device);
#endif
}

void dfl_ops_cpu_threads(int64_t n) {
    if (n <= 0) return;
    omp_set_num_threads((int)n); /* OpenBLAS runs single-threaded: dfl_ops_cpu */
}
