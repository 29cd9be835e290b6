/* jsonl.c: reading tokenized samples, one JSON object a line. */
#include "jsonl.h"

#include "common.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dfl_jsonl {
    FILE   *f;
    int     is_stdin;
    char   *path;
    int64_t vocab;
    int64_t line;        /* lines read so far */
    char   *buf;         /* the current line */
    size_t  cap;
    dfl_jsonl_sample cur;
};

int dfl_jsonl_open(dfl_jsonl **out, const char *path, int64_t vocab_size) {
    *out = NULL;
    int is_stdin = !strcmp(path, "-");
    if (is_stdin && dfl_stdin_check("<stdin>")) return DFL_EX_NOINPUT;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: %s", path, strerror(errno));
    int rc = dfl_refuse_directory(f, is_stdin ? "<stdin>" : path);
    if (rc) {
        if (!is_stdin) fclose(f);
        return rc;
    }
    dfl_jsonl *r = dfl_calloc(1, sizeof *r);
    r->f = f;
    r->is_stdin = is_stdin;
    r->path = dfl_strdup(is_stdin ? "<stdin>" : path);
    r->vocab = vocab_size;
    *out = r;
    return 0;
}

const char *dfl_jsonl_path(const dfl_jsonl *r) { return r->path; }

void dfl_jsonl_sample_free(dfl_jsonl_sample *s) {
    free(s->id);
    free(s->input_ids);
    free(s->loss_mask);
    memset(s, 0, sizeof *s);
}

void dfl_jsonl_close(dfl_jsonl *r) {
    if (!r) return;
    if (!r->is_stdin) fclose(r->f);
    dfl_jsonl_sample_free(&r->cur);
    free(r->buf);
    free(r->path);
    free(r);
}

/* Read one line into r->buf (without the newline), by its real length:
 * fgets and strlen would end the line at a NUL byte, and the bytes after it
 * (the next line too, since fgets took the newline) would be read as a line
 * of their own. The buffer grows only as bytes arrive; a line longer than
 * the cap is consumed and refused, and so is a line holding a NUL byte (no
 * JSON text has one), naming the byte's 1-based column.
 * Returns 1 (a line), 0 (end of input), DFL_EX_DATA (too long, or a NUL
 * byte), DFL_EX_IOERR. */
static int read_line(dfl_jsonl *r, size_t *len) {
    size_t n = 0;
    uint64_t col = 0, nul_col = 0;
    int c, got = 0, too_long = 0;
    flockfile(r->f); /* one lock for the line, not one a byte */
    while ((c = getc_unlocked(r->f)) != EOF) {
        got = 1;
        if (c == '\n') break;
        col++;
        if (c == 0 && !nul_col) nul_col = col;
        if (too_long) continue; /* at the cap: drop the bytes, keep reading to the newline */
        if (n == r->cap) {
            size_t ncap = r->cap ? r->cap * 2 : 65536;
            if (ncap > DFL_JSONL_MAX_LINE) ncap = DFL_JSONL_MAX_LINE;
            if (ncap == n) {
                too_long = 1;
                continue;
            }
            r->buf = dfl_realloc(r->buf, ncap);
            r->cap = ncap;
        }
        r->buf[n++] = (char)c;
    }
    funlockfile(r->f);
    if (ferror(r->f)) return dfl_err(DFL_EX_IOERR, "%s: read error: %s", r->path, strerror(errno));
    if (!got) return 0;
    r->line++;
    if (too_long)
        return dfl_err(DFL_EX_DATA, "%s:%lld: line longer than %llu bytes", r->path, (long long)r->line,
                       (unsigned long long)DFL_JSONL_MAX_LINE);
    if (nul_col)
        return dfl_err(DFL_EX_DATA, "%s:%lld: column %llu: a NUL byte (a JSONL line is text)", r->path,
                       (long long)r->line, (unsigned long long)nul_col);
    if (n > 0 && r->buf[n - 1] == '\r') n--;
    *len = n;
    return 1;
}

static int blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r') return 0;
    return 1;
}

static int parse_id(dfl_jsonl_sample *s, const json_t *v, const char *path, int64_t line) {
    char buf[32];
    if (!v || json_is_null(v)) {
        snprintf(buf, sizeof buf, "line-%lld", (long long)line);
        s->id = dfl_strdup(buf);
    } else if (json_is_integer(v)) {
        snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(v));
        s->id = dfl_strdup(buf);
    } else if (json_is_string(v)) {
        size_t n = json_string_length(v);
        if (n == 0 || n > DFL_JSONL_MAX_ID)
            return dfl_err(DFL_EX_DATA, "%s:%lld: id: must be 1 to %d bytes, not %zu", path, (long long)line,
                           DFL_JSONL_MAX_ID, n);
        s->id = dfl_strdup(json_string_value(v));
    } else {
        return dfl_err(DFL_EX_DATA, "%s:%lld: id: must be a string or an integer", path, (long long)line);
    }
    return 0;
}

static int parse_ids(dfl_jsonl_sample *s, const json_t *a, int64_t vocab, const char *path, int64_t line) {
    if (!a) return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids: missing", path, (long long)line);
    if (!json_is_array(a)) return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids: not an array", path, (long long)line);
    size_t n = json_array_size(a);
    if (n == 0) return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids: empty sample", path, (long long)line);
    if (n > INT32_MAX) return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids: too many tokens", path, (long long)line);
    s->n = (int64_t)n;
    s->input_ids = dfl_malloc(n * sizeof *s->input_ids);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v))
            return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids[%zu]: not an integer", path, (long long)line, i);
        json_int_t t = json_integer_value(v);
        if (t < 0 || t > INT32_MAX || (vocab > 0 && t >= vocab)) {
            if (vocab > 0)
                return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids[%zu]: token id %lld is outside the vocabulary [0, %lld)",
                               path, (long long)line, i, (long long)t, (long long)vocab);
            return dfl_err(DFL_EX_DATA, "%s:%lld: input_ids[%zu]: token id %lld is out of range", path,
                           (long long)line, i, (long long)t);
        }
        s->input_ids[i] = (int32_t)t;
    }
    return 0;
}

static int parse_mask(dfl_jsonl_sample *s, const json_t *a, const char *path, int64_t line) {
    s->loss_mask = dfl_malloc((size_t)s->n);
    if (!a || json_is_null(a)) {
        memset(s->loss_mask, 1, (size_t)s->n);
        return 0;
    }
    if (!json_is_array(a)) return dfl_err(DFL_EX_DATA, "%s:%lld: loss_mask: not an array", path, (long long)line);
    if ((int64_t)json_array_size(a) != s->n)
        return dfl_err(DFL_EX_DATA, "%s:%lld: loss_mask: %zu entries for %lld input_ids", path, (long long)line,
                       json_array_size(a), (long long)s->n);
    for (int64_t i = 0; i < s->n; i++) {
        json_t *v = json_array_get(a, (size_t)i);
        int64_t m = json_is_integer(v) ? json_integer_value(v) : json_is_boolean(v) ? json_is_true(v) : -1;
        if (m != 0 && m != 1)
            return dfl_err(DFL_EX_DATA, "%s:%lld: loss_mask[%lld]: must be 0 or 1", path, (long long)line, (long long)i);
        s->loss_mask[i] = (uint8_t)m;
    }
    return 0;
}

int dfl_jsonl_parse(dfl_jsonl_sample *s, const char *text, size_t len, int64_t vocab, const char *path,
                    int64_t line) {
    memset(s, 0, sizeof *s);
    s->line = line;
    json_error_t je;
    json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!j) return dfl_err(DFL_EX_DATA, "%s:%lld: malformed JSON: %s (column %d)", path, (long long)line, je.text, je.column);
    int rc;
    if (!json_is_object(j)) rc = dfl_err(DFL_EX_DATA, "%s:%lld: not a JSON object", path, (long long)line);
    else if ((rc = parse_id(s, json_object_get(j, "id"), path, line))) {}
    else if ((rc = parse_ids(s, json_object_get(j, "input_ids"), vocab, path, line))) {}
    else rc = parse_mask(s, json_object_get(j, "loss_mask"), path, line);
    json_decref(j);
    if (rc) dfl_jsonl_sample_free(s);
    s->line = line;
    return rc;
}

int dfl_jsonl_next(dfl_jsonl *r, dfl_jsonl_sample *s) {
    dfl_jsonl_sample_free(&r->cur);
    for (;;) {
        size_t len = 0;
        int rc = read_line(r, &len);
        if (rc != 1) return rc;
        if (blank(r->buf, len)) continue;
        rc = dfl_jsonl_parse(&r->cur, r->buf, len, r->vocab, r->path, r->line);
        if (rc) return rc;
        *s = r->cur;
        return 1;
    }
}
