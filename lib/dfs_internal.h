/* dfs_internal.h: pieces shared by the lib/dfs_*.c files. Not an interface:
 * tools and other library parts use dfs.h.
 *
 * dfs_codec.c    byte shuffle, LZ4 frame encode/decode, size caps
 * dfs_msgpack.c  the msgpack pre-scan, msgpack <-> JSON, header field access
 * dfs_read.c     the reader
 * dfs_write.c    the writer
 * dfs_meta.c     hidden-state meta, identity diff
 */
#ifndef DFLASH_DFS_INTERNAL_H
#define DFLASH_DFS_INTERNAL_H

#include "dfs.h"

#include <lz4frame.h>
#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>

#define DFS_MAGIC "\x89" "DFS"
#define DFS_PREFIX 16          /* magic + u32 length + u64 checksum */
#define DFS_MAX_DEPTH 16       /* containers nested in a header, the header map included */

/* Little-endian fields: the record prefix, LZ4 frame headers and blocks. */
static inline uint32_t dfs_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t dfs_le64(const uint8_t *p) { return dfs_le32(p) | (uint64_t)dfs_le32(p + 4) << 32; }
static inline void dfs_put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- dfs_codec.c -------------------------------------------------------- */

/* Byte shuffle (and its inverse) of n raw bytes of elements of `elem` bytes,
 * block by block (DFS_SHUFFLE_BLOCK raw bytes; the last block may be
 * shorter). Within a block of m = len/elem whole elements, byte j of element
 * i moves to j*m + i; the len % elem trailing bytes (only possible when the
 * tensor itself is not a whole number of elements, which the format forbids)
 * would be copied as they are. dst and src must not overlap. */
void dfs_shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t elem);
void dfs_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t elem);

/* The caps on an lz4 tensor's sizes (formats/dflash-stream.md, "Caps"). */
uint64_t dfs_lz4_max_stored(uint64_t raw);   /* raw + 8*ceil(raw/64Ki) + 65600 */
uint64_t dfs_lz4_max_raw(uint64_t stored);   /* 256*stored + 64Ki, saturating */

/* A growable byte buffer. dfs_buf_reserve keeps the contents (realloc);
 * dfs_abuf_reserve gives a 64-byte aligned buffer and drops the contents. */
typedef struct {
    uint8_t *p;
    size_t   cap;
} dfs_buf;
void dfs_buf_reserve(dfs_buf *b, size_t n);
void dfs_abuf_reserve(dfs_buf *b, size_t n);
void dfs_buf_free(dfs_buf *b);

/* Contexts and scratch for encoding/decoding, owned by a reader or writer. */
typedef struct {
    LZ4F_cctx *cctx;
    LZ4F_dctx *dctx;
    uint8_t   *block;    /* DFS_SHUFFLE_BLOCK bytes, 64-byte aligned */
    dfs_buf    index;    /* the LZ4 block offsets of the frame being decoded */
} dfs_codec_ctx;
void dfs_codec_init(dfs_codec_ctx *c);
void dfs_codec_free(dfs_codec_ctx *c);

/* Encode `raw_bytes` bytes at `raw` with `enc` (shuffle ignored for 1-byte
 * elements), appending the stored bytes to out at offset *len (out grows).
 * Returns 0 or DFL_EX_SOFTWARE (an LZ4 failure) with `why` set. */
int dfs_encode(dfs_codec_ctx *c, dfs_buf *out, size_t *len, const void *raw, uint64_t raw_bytes,
               size_t elem, const dfs_encoding *enc, const char **why);
/* Decode t's stored bytes into dst (t->raw_bytes bytes). Returns 0, or -1
 * with *why describing the damage (the caller adds file and offset). */
int dfs_decode_into(dfs_codec_ctx *c, void *dst, const dfs_tensor *t, char *why, size_t whylen);
/* dfs_decode_into's fast path for an lz4 tensor of 1 MiB or more, when
 * more than one decode thread is allowed: a frame with independent blocks
 * and no checksums or dictionary, its blocks decoded at once. Returns 1 when
 * dst holds the tensor, 0 when the frame must be streamed instead (another
 * kind of frame, damage, blocks that do not decode to the block size). */
int dfs_decode_lz4_blocks(dfs_codec_ctx *c, uint8_t *dst, const dfs_tensor *t);

/* ---- dfs_msgpack.c ------------------------------------------------------ */

/* Check that [p, p+n) is exactly one msgpack object, a map, nested at most
 * DFS_MAX_DEPTH deep, whose every container and string length fits in the
 * bytes that remain. Run before msgpack_unpack_next, which trusts lengths.
 * Returns 0, or -1 with *why set. */
int dfs_mp_prescan(const uint8_t *p, size_t n, const char **why);
/* Parse a pre-scanned header into *out (caller destroys). 0 or -1. */
int dfs_mp_parse(msgpack_unpacked *out, const uint8_t *p, size_t n, const char **why);

/* Map lookup by string key; NULL if absent. Duplicate keys are found by
 * dfs_mp_dup_key (returns the first duplicated key or NULL). */
const msgpack_object *dfs_mp_get(const msgpack_object *map, const char *key);
const msgpack_object_kv *dfs_mp_dup_key(const msgpack_object *map);
/* Typed field access; each returns 0, or -1 with `why` written. */
int dfs_mp_u64(const msgpack_object *o, uint64_t *v);
int dfs_mp_str(const msgpack_object *o, char *buf, size_t cap); /* UTF-8, no NUL, fits */
int dfs_mp_str_eq(const msgpack_object *o, const char *s);
/* Valid UTF-8 without NUL bytes. */
int dfs_utf8_ok(const char *s, size_t n);

/* msgpack -> JSON (maps with string keys, no bin/ext, integers in int64
 * range, finite floats). Returns NULL on anything else, always with why
 * written, naming the field by its path from `o` (meta "target.x"). */
json_t *dfs_mp_to_json(const msgpack_object *o, char *why, size_t whylen);
/* JSON -> msgpack through `pk`. Returns 0 or the packer's error. */
int dfs_mp_pack_json(msgpack_packer *pk, const json_t *j);
/* Pack a C string as a msgpack str. */
int dfs_mp_pack_cstr(msgpack_packer *pk, const char *s);

/* ---- dfs_read.c / dfs_write.c ---------------------------------------- */

/* The identity check between segments and inputs lives in dfs_meta.c. */

#endif
