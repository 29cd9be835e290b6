/* dtype.c: names and sizes of element types. */
#include "dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtypes[DFL_DTYPE_COUNT] = {
    [DFL_BF16] = {"bf16", 2}, [DFL_F16] = {"f16", 2}, [DFL_F32] = {"f32", 4},
    [DFL_I32] = {"i32", 4},   [DFL_I64] = {"i64", 8}, [DFL_U8] = {"u8", 1},
};

const char *dfl_dtype_name(dfl_dtype t) { return (unsigned)t < DFL_DTYPE_COUNT ? dtypes[t].name : "?"; }
size_t dfl_dtype_size(dfl_dtype t) { return (unsigned)t < DFL_DTYPE_COUNT ? dtypes[t].size : 0; }

int dfl_dtype_parse(const char *s, dfl_dtype *out) {
    for (int i = 0; i < DFL_DTYPE_COUNT; i++)
        if (!strcmp(s, dtypes[i].name)) {
            *out = (dfl_dtype)i;
            return 0;
        }
    return -1;
}
