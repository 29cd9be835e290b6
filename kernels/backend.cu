// backend.cu: the CUDA op table (DESIGN §3): device selection and the table.
// The ops themselves live in the other kernels/*.cu files.
#include <cuda_runtime.h>

extern "C" {
#include "common.h"
#include "ops.h"
}

extern "C" int dfl_ops_cuda(int dev, const dfl_ops **out) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return dfl_err(DFL_EX_UNAVAIL, "--device cuda: no CUDA device: %s", cudaGetErrorString(e));
    if (dev >= n) return dfl_err(DFL_EX_UNAVAIL, "--device cuda:%d: only %d CUDA device(s) present", dev, n);
    *out = NULL;
    return dfl_err(DFL_EX_UNAVAIL, "--device cuda: the CUDA op table is not built yet");
}
