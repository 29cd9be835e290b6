/* jsonl.h: the tokenized-sample input (JSONL), one sample a line.
 *
 *   {"id": "abc" | 17, "input_ids": [int, ...], "loss_mask": [0|1, ...]}
 *
 * "input_ids" is required and non-empty; every id must lie in [0, vocab).
 * "loss_mask" is optional (default: all ones) and must have one entry per
 * token, each 0 or 1 (true/false are accepted too). "id" is optional: a
 * string, or an integer written in decimal; without one the sample is named
 * after its line ("line-N"). Other keys are ignored. Blank lines are skipped.
 *
 * Errors name the file, the line (1-based) and the field:
 *   data.jsonl:12: input_ids[5]: token id 300 is outside the vocabulary [0, 211)
 * A bad sample is an error of that sample only: the reader has consumed its
 * line and dfl_jsonl_next() may be called again for the next one (this is
 * what --skip-bad uses). I/O errors end the input.
 */
#ifndef DFLASH_JSONL_H
#define DFLASH_JSONL_H

#include <stddef.h>
#include <stdint.h>

#define DFL_JSONL_MAX_LINE (1ull << 30) /* bytes per line (1 GiB) */
#define DFL_JSONL_MAX_ID   4096         /* bytes of a sample id */

typedef struct {
    char    *id;          /* NUL-terminated */
    int64_t  n;           /* tokens */
    int32_t *input_ids;   /* [n] */
    uint8_t *loss_mask;   /* [n], 0 or 1 */
    int64_t  line;        /* 1-based line number in the input */
} dfl_jsonl_sample;

typedef struct dfl_jsonl dfl_jsonl;

/* Open `path` ("-" is stdin). vocab_size > 0 checks token ids against it.
 * Returns 0 or DFL_EX_NOINPUT. */
int dfl_jsonl_open(dfl_jsonl **r, const char *path, int64_t vocab_size);
/* Read the next sample into *s (owned by the reader, valid until the next
 * call). Returns 1 with a sample, 0 at the end of the input, DFL_EX_DATA for
 * a bad sample (its line consumed; reading may continue), or DFL_EX_IOERR. */
int dfl_jsonl_next(dfl_jsonl *r, dfl_jsonl_sample *s);
const char *dfl_jsonl_path(const dfl_jsonl *r);
void dfl_jsonl_close(dfl_jsonl *r);

/* Parse one line (no newline needed) as a sample; the arrays are malloc'ed
 * into *s and freed with dfl_jsonl_sample_free. `path` and `line` only word
 * the messages. Returns 0 or DFL_EX_DATA. */
int dfl_jsonl_parse(dfl_jsonl_sample *s, const char *text, size_t len, int64_t vocab_size, const char *path,
                    int64_t line);
void dfl_jsonl_sample_free(dfl_jsonl_sample *s);

#endif
