/* dtype.h: element types shared by the stream, safetensors and the ops. */
#ifndef DFLASH_DTYPE_H
#define DFLASH_DTYPE_H

#include <stddef.h>

typedef enum {
    DFL_BF16 = 0,
    DFL_F16  = 1,
    DFL_F32  = 2,
    DFL_I32  = 3,
    DFL_I64  = 4,
    DFL_U8   = 5,
    DFL_DTYPE_COUNT
} dfl_dtype;

/* "bf16", "f16", "f32", "i32", "i64", "u8" (the stream's spelling). */
const char *dfl_dtype_name(dfl_dtype t);
size_t dfl_dtype_size(dfl_dtype t);
/* Parse the stream's spelling; returns 0 or -1. */
int dfl_dtype_parse(const char *s, dfl_dtype *out);

#endif
