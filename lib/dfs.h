/* dfs.h: the DFS tensor stream, reader and writer.
 *
 * The normative spec is formats/dflash-stream.md (and man/dflash-stream.5).
 * In short, a stream is one or more segments; a segment is a stream-header
 * record, zero or more sample records and an end record. `cat a b` of two
 * streams is therefore a stream. Every record is
 *
 *   offset 0   4 bytes   magic 0x89 'D' 'F' 'S'
 *          4   u32 LE    N = header length, 1 <= N <= DFS_MAX_HEADER
 *          8   u64 LE    XXH64 (seed 0) of the N header bytes
 *         16   N bytes   header: one msgpack map ("type", "payload", ...)
 *       16+N   P bytes   payload: the stored bytes of the record's tensors,
 *                        back to back in header order; P = header "payload"
 *
 * Tensor payloads are raw or an LZ4 frame, optionally byte-shuffled (per
 * 64 KiB block of raw bytes) before compression, each with an XXH64 of its
 * stored bytes. Every length is capped and checked before allocation, and
 * buffers grow only as bytes actually arrive, so a hostile header cannot
 * cause a large allocation.
 *
 * Errors name the file and the byte offset of the record at fault.
 */
#ifndef DFLASH_DFS_H
#define DFLASH_DFS_H

#include "dtype.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#define DFS_VERSION_MAJOR 1
#define DFS_VERSION_MINOR 0
#define DFS_MAX_HEADER    (1u << 20)    /* header bytes per record */
#define DFS_MAX_TENSORS   64            /* tensors per sample */
#define DFS_MAX_DIMS      8
#define DFS_MAX_NAME      63            /* tensor name bytes */
#define DFS_MAX_ID        4096          /* sample id bytes */
#define DFS_MAX_TENSOR_BYTES (1ull << 36) /* raw bytes per tensor (64 GiB) */
#define DFS_SHUFFLE_BLOCK 65536         /* byte-shuffle block, raw bytes */

typedef enum { DFS_CODEC_NONE = 0, DFS_CODEC_LZ4 = 1 } dfs_codec;

typedef struct {
    char      name[DFS_MAX_NAME + 1];
    dfl_dtype dtype;
    int       ndim;
    int64_t   shape[DFS_MAX_DIMS];
    dfs_codec codec;
    int       shuffle;       /* 1: byte shuffle applied before the codec */
    uint64_t  raw_bytes;     /* numel * dtype size */
    uint64_t  stored_bytes;  /* bytes in the payload */
    uint64_t  checksum;      /* XXH64 (seed 0) of the stored bytes */
    const void *stored;      /* stored bytes; valid until the next dfs_read */
    void     *data;          /* decoded raw bytes (64-byte aligned) after dfs_decode, else NULL */
} dfs_tensor;

typedef struct {
    char      *id;
    int        ntensors;
    dfs_tensor t[DFS_MAX_TENSORS];
    uint64_t   offset;       /* byte offset of the record in its file */
    uint64_t   record;       /* its index among every record of the file, from 0 */
} dfs_sample;

/* ---- reader ------------------------------------------------------------- */

typedef struct dfs_reader dfs_reader;

/* Open a stream ("-" is stdin) and read its first stream header. Returns 0
 * or an exit code (DFL_EX_NOINPUT, DFL_EX_DATA, DFL_EX_IOERR). */
int dfs_reader_open(dfs_reader **r, const char *path);
/* The same on an open stream (a pipe, a memory stream); `name` names it in
 * errors; f is not closed by the reader. On failure *r is NULL. */
int dfs_reader_open_stream(dfs_reader **r, FILE *f, const char *name);
/* Read the next sample record. Returns 1 and sets *s (owned by the reader,
 * valid until the next call), 0 at the clean end of the stream, or an exit
 * code. Stream headers and end records between samples are consumed here:
 * end counts are checked, and a later segment whose identity fields differ
 * from the first segment's is refused (dfs_meta_diff). Every tensor's
 * checksum is verified as it is read. */
int dfs_read(dfs_reader *r, dfs_sample **s);
/* Decode a tensor of the current sample into t->data (decompress and
 * unshuffle). Returns 0 or DFL_EX_DATA. */
int dfs_decode(dfs_reader *r, dfs_tensor *t);
/* Take the decoded bytes of tensor t (after dfs_decode) out of the reader,
 * so that they outlive the next dfs_read without a copy: the reader's
 * buffer and *buf (capacity *cap; NULL and 0, or a buffer an earlier call
 * gave) change places, and t->data is then *buf. Free it with free(). */
void dfs_take_decoded(dfs_reader *r, dfs_tensor *t, void **buf, size_t *cap);
/* Threads that encode or decode one large LZ4 tensor (its independent
 * blocks at once), process-wide: n > 0, or 0 for OpenMP's default in the
 * calling thread. The tools set it from --threads. The bytes are the same
 * for any n. */
void dfs_set_codec_threads(int n);
/* The tensor named `name` in `s`, or NULL. */
dfs_tensor *dfs_find(dfs_sample *s, const char *name);
/* Meta map of the first segment's stream header (never NULL after open). */
const json_t *dfs_reader_meta(const dfs_reader *r);
/* The whole stream-header map of the first segment (producer, version, meta). */
const json_t *dfs_reader_header(const dfs_reader *r);
const char *dfs_reader_path(const dfs_reader *r);
uint64_t dfs_reader_offset(const dfs_reader *r);  /* bytes consumed so far */
int dfs_reader_segments(const dfs_reader *r);     /* stream headers read so far */
void dfs_reader_close(dfs_reader *r);

/* ---- writer ------------------------------------------------------------- */

typedef struct {
    dfs_codec codec;
    int       shuffle;
    int       lz4_accel;    /* LZ4 acceleration, 1 = default (lz4 -1) */
} dfs_encoding;

/* A tensor to write from raw bytes. */
typedef struct {
    const char *name;
    dfl_dtype   dtype;
    int         ndim;
    int64_t     shape[DFS_MAX_DIMS];
    const void *data;
    const dfs_encoding *enc; /* NULL: the writer's default */
} dfs_tensor_in;

typedef struct dfs_writer dfs_writer;

/* Start a segment on `f` (not closed by the writer): write the stream header
 * with `meta` (a JSON object, copied) and `producer` ("dflash-extract 0.1.0").
 * `path` names the output in error messages. "created" is the current time,
 * or SOURCE_DATE_EPOCH when set; a value it cannot be is refused (exit 2). */
/* Check SOURCE_DATE_EPOCH: unset, or decimal seconds in 0..253402300799
 * (9999-12-31T23:59:59Z). Returns 0, or DFL_EX_USAGE with the reason
 * recorded. Tools that write streams call it before creating any output. */
int dfs_check_source_date_epoch(void);
int dfs_writer_open(dfs_writer **w, FILE *f, const char *path, const json_t *meta,
                    const char *producer, dfs_encoding enc);
int dfs_write(dfs_writer *w, const char *id, int ntensors, const dfs_tensor_in *t);
/* Write a sample read from a stream. Tensors whose stored encoding equals
 * the writer's are copied as stored (no decode); others are re-encoded. With
 * keep_encoding set, every tensor is copied as stored. Re-encoding decodes
 * into the writer's own buffers (or uses t->data if already decoded), so
 * `from` may be NULL and its decode buffers are left alone. */
int dfs_write_sample(dfs_writer *w, dfs_reader *from, dfs_sample *s, int keep_encoding);
/* A sample copied out of its reader (id and stored bytes owned), to hold
 * many in memory (dflash-pack --shuffle); write it with dfs_write_sample
 * (from may be NULL). dfs_sample_size is the memory it takes. */
dfs_sample *dfs_sample_clone(const dfs_sample *s);
uint64_t dfs_sample_size(const dfs_sample *s);
void dfs_sample_free(dfs_sample *s);
/* A sample encoded apart from the writer's own buffers, so that several
 * threads can encode samples at once (each into its own dfs_encoded) and
 * the writer then writes them in order: dfs_encode_sample does dfs_write's
 * checks and encoding (the same errors, the same bytes) and only reads w;
 * dfs_write_encoded writes the record. The tensors' data is read during
 * dfs_encode_sample only; names and shapes are copied. */
typedef struct dfs_encoded dfs_encoded;
dfs_encoded *dfs_encoded_new(void);
void dfs_encoded_free(dfs_encoded *e);
int dfs_encode_sample(const dfs_writer *w, dfs_encoded *e, const char *id, int ntensors, const dfs_tensor_in *t);
int dfs_write_encoded(dfs_writer *w, const dfs_encoded *e);
/* Write the end record and free the writer. Returns 0 or DFL_EX_IOERR. */
int dfs_writer_close(dfs_writer *w);
/* Free without writing the end record (the output will be discarded). */
void dfs_writer_abort(dfs_writer *w);
uint64_t dfs_writer_records(const dfs_writer *w);

/* ---- hidden-state metadata --------------------------------------------- */

/* The meta map of a hidden-state stream (formats/dflash-stream.md, "Hidden
 * states"), as written by dflash-extract and checked by its readers. */
typedef struct {
    char    architecture[64];    /* "Qwen3ForCausalLM" */
    char    model_type[32];      /* "qwen3" */
    char    config_digest[40];   /* XXH64 hex of the target's config.json bytes */
    int64_t hidden_size, num_layers, vocab_size;
    int     nlayers;             /* K tapped layers */
    int     layer_ids[64];       /* id k = output of decoder layer k (HF hidden_states[k+1]) */
    char    hidden_dtype[8];     /* "bf16" */
    int     has_target_ids;      /* samples carry "target_ids" */
    int     has_last_hidden;     /* samples carry "last_hidden" (pre-norm, [T, H]) */
} dfs_hs_meta;

json_t *dfs_hs_meta_to_json(const dfs_hs_meta *m);
/* Parse and check; `path` names the stream in errors. Returns 0 or DFL_EX_DATA. */
int dfs_hs_meta_from_json(const json_t *meta, dfs_hs_meta *m, const char *path);

/* Compare the identity fields of two meta maps (target architecture and
 * config digest, hidden size, layer ids and convention, hidden dtype).
 * Returns the number of differing fields and writes their names, with both
 * values, into buf ("layer_ids: [1,9] vs [2,10]; hidden_size: ..."). */
int dfs_meta_diff(const json_t *a, const json_t *b, char *buf, size_t n);

/* Check a sample of a hidden-state stream against its meta: input_ids i32
 * [T], loss_mask u8 [T], hidden [T, K*H], and target_ids / last_hidden when
 * the meta announces them; for tensors already decoded (t->data set), also
 * token ids in [0, vocab_size) and loss_mask values 0 or 1. Returns 0 or
 * DFL_EX_DATA naming `path`, the record offset, the sample and the tensor. */
int dfs_hs_check_sample(const dfs_hs_meta *m, const dfs_sample *s, const char *path);

/* The error of a bad sample, as dfs_hs_check_sample words it, in the
 * reader's form: "PATH: byte OFFSET (record N): sample "ID": <fmt ...>".
 * Returns DFL_EX_DATA. */
int dfs_sample_err(const char *path, uint64_t offset, uint64_t record, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#endif
