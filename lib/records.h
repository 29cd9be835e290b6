/* records.h: the hidden-state records that training and offline scoring
 * read: the stream checked against the target and the drafters, each
 * record checked and decoded into buffers of its own, and (from a regular
 * file) read ahead on a thread while the caller's device works.
 *
 * On a GPU host, decoding a Qwen3-8B record (LZ4, XXH64, the byte shuffle)
 * costs the CPU about as long as the device takes to train on it, and
 * several times what a scoring forward takes: read in line, the device
 * would wait for the CPU half of the time.
 */
#ifndef DFLASH_RECORDS_H
#define DFLASH_RECORDS_H

#include "dfs.h"
#include "drafter.h"
#include "model_config.h"
#include "train.h"

/* Longest record the tools take (tokens). */
#define DFL_RECORD_MAX_TOKENS (INT64_C(1) << 24)

/* The stream's meta against the target and the nd drafters: layer ids,
 * hidden size, architecture, config digest, layers, vocabulary; and
 * "target_ids" / "last_hidden" when the caller needs them. Returns 0, or
 * DFL_EX_DATA naming `path` and every field that differs with both values
 * ("drafter" when nd is 1, "drafter 2" among several). */
int dfl_records_check_meta(const dfs_hs_meta *m, const char *path, const dfl_model_config *tc, dfl_drafter *const *d,
                           int nd, int need_target_ids, int need_last_hidden);

/* One record, checked and decoded; it owns its buffers (grown, then
 * reused by the next record read into it). */
typedef struct {
    int rc;                  /* 1: a record; 0: the end of the input; else an exit code */
    char *err;               /* rc's message, kept for the thread that takes the record */
    uint64_t offset, record; /* the record's byte offset, index and id, for messages */
    char *id;
    dfl_train_seq q;         /* points into the buffers below */
    int64_t records, epoch;  /* the source's position after this record (its caller's bookkeeping) */
    int32_t *ids, *tids;
    uint8_t *mask;
    void *hidden, *last;
    size_t cap_t, cap_hidden, cap_last;
} dfl_record;

void dfl_record_free(dfl_record *o);

/* The next record of r into o: presence, dtype and shape of every tensor
 * (dfs_hs_check_sample), T <= DFL_RECORD_MAX_TOKENS, token ids in the
 * vocabulary and loss_mask in {0, 1}; "input_ids", "loss_mask" and
 * "hidden" decoded, and "target_ids" / "last_hidden" when asked for. The
 * large tensors change buffers with the reader instead of being copied.
 * Returns 1, 0 at the end of the stream, or an exit code (DFL_EX_DATA
 * naming `path`, the record's offset and id, and the tensor). */
int dfl_record_read(dfs_reader *r, const dfs_hs_meta *m, const char *path, int want_target_ids, int want_last_hidden,
                    dfl_record *o);

/* ---- reading ahead -------------------------------------------------------- */

/* Fills o with the source's next record: returns 1, 0 (the end) or an exit
 * code with its message set (dfl_err). */
typedef int (*dfl_record_source)(void *ctx, dfl_record *o);

typedef struct dfl_record_queue dfl_record_queue;

/* Records of `source`, in order. threaded != 0: a thread fills the next
 * record while the caller holds the current one (two records in memory);
 * the source is then called on that thread only, and must not be used by
 * the caller until dfl_record_queue_free. threaded = 0 (or no thread to be
 * had): each record is read when taken. */
dfl_record_queue *dfl_record_queue_new(dfl_record_source source, void *ctx, int threaded);
/* The next record (o->rc: 1, 0 or an exit code with o->err); the record
 * taken before is given back. After the end or an error, the same record
 * again. */
dfl_record *dfl_record_queue_take(dfl_record_queue *q);
/* Stops the thread (it finishes the record it is reading, if any). */
void dfl_record_queue_free(dfl_record_queue *q);

/* Whether records may be read ahead from path: a regular file. From a
 * pipe or a FIFO a thread would take a record the run may not use, and
 * could wait at exit for a writer with nothing more to say. */
int dfl_records_can_read_ahead(const char *path);

#endif
