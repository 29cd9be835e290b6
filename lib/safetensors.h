/* safetensors.h: memory-mapped, validated safetensors reading and writing.
 *
 * Layout (huggingface/safetensors README): u64 LE header length N, N bytes
 * of JSON {"NAME": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
 * "__metadata__": {str: str}}, then the byte buffer. The reader checks every
 * rule before trusting the header: N <= 100 MB and within the file, JSON
 * object with no duplicate keys, known dtype strings, shapes whose products
 * do not overflow, end - begin == numel * size, and tensors that tile the
 * buffer from 0 to its end with no gap or overlap.
 *
 * A model directory holds model.safetensors or model.safetensors.index.json
 * with its shards; dfl_st_open_dir handles both.
 */
#ifndef DFLASH_SAFETENSORS_H
#define DFLASH_SAFETENSORS_H

#include "dtype.h"

#include <jansson.h>
#include <stdint.h>

#define DFL_ST_MAX_HEADER 100000000ull
#define DFL_ST_MAX_DIMS 8

typedef struct {
    const char *name;
    int         dtype;     /* a dfl_dtype, or -1 for a valid type dflash does not use */
    const char *dtype_str; /* as in the file: "BF16", "F32", ... */
    int         ndim;
    int64_t     shape[DFL_ST_MAX_DIMS];
    int64_t     numel;
    const void *data;      /* inside the mapping; may be unaligned */
    uint64_t    nbytes;
    const char *file;      /* the shard it lives in */
} dfl_st_tensor;

typedef struct dfl_st dfl_st;

/* Open one .safetensors file. Returns 0 or DFL_EX_NOINPUT / DFL_EX_DATA. */
int dfl_st_open(dfl_st **st, const char *path);
/* Open a model directory: model.safetensors.index.json (sharded) if present,
 * else model.safetensors. Every shard named in the index is validated. */
int dfl_st_open_dir(dfl_st **st, const char *dir);
void dfl_st_close(dfl_st *st);

int dfl_st_count(const dfl_st *st);
const dfl_st_tensor *dfl_st_at(const dfl_st *st, int i);
const dfl_st_tensor *dfl_st_find(const dfl_st *st, const char *name);
/* Find `name` and check its shape (ndim entries); dtype must be bf16, f16 or
 * f32. Returns 0 or DFL_EX_DATA naming the file, the tensor and both shapes. */
int dfl_st_get(const dfl_st *st, const char *name, int ndim, const int64_t *shape, const dfl_st_tensor **out);
/* The same for a U8 tensor (MXFP4 blocks and scales). */
int dfl_st_get_u8(const dfl_st *st, const char *name, int ndim, const int64_t *shape, const dfl_st_tensor **out);
/* A "__metadata__" value of the first file, or NULL. */
const char *dfl_st_meta(const dfl_st *st, const char *key);

/* Convert a bf16/f16/f32 tensor to f32 (n = t->numel floats). */
void dfl_st_to_f32(const dfl_st_tensor *t, float *out);
/* The same for its elements [off, off + n) (flat index). */
void dfl_st_range_to_f32(const dfl_st_tensor *t, int64_t off, int64_t n, float *out);
/* MXFP4 (gpt-oss's experts): nblocks blocks of 32 values, each 16 bytes of
 * FP4 E2M1 codes (two a byte, the low nibble first) and one E8M0 scale
 * byte (2^(s - 127)), into out[32 * nblocks]. Exact in f32, and in bf16. */
void dfl_mxfp4_to_f32(const uint8_t *blocks, const uint8_t *scales, int64_t nblocks, float *out);
void dfl_mxfp4_to_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t nblocks, uint16_t *out);

/* ---- writing ---- */
typedef struct {
    const char *name;
    dfl_dtype   dtype;
    int         ndim;
    int64_t     shape[DFL_ST_MAX_DIMS];
    const void *data;
} dfl_st_in;

/* Write a .safetensors file the way the reference writer does: header padded
 * with spaces to a multiple of 8, tensors sorted by descending dtype size then
 * name, `metadata` (an object of strings, may be NULL) as "__metadata__".
 * Written under a temporary name and renamed. Returns 0 or an exit code. */
int dfl_st_write(const char *path, const dfl_st_in *t, int n, const json_t *metadata);

/* "BF16" for DFL_BF16, etc. */
const char *dfl_st_dtype_str(dfl_dtype t);

#endif
