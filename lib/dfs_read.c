/* dfs_read.c: the DFS stream reader.
 *
 * Reads strictly front to back (pipes work; nothing seeks) with memory that
 * does not grow with the number of records: one header buffer, one payload
 * buffer and one decode buffer per tensor slot, all reused. Every length is
 * checked against its cap before anything is allocated for it, and the
 * payload buffer grows only as bytes actually arrive, so a header that
 * claims 60 GiB on a 100-byte file fails with "truncated", not an
 * allocation. Every error names the file, the byte offset of the record at
 * fault and its record number (0-based, counting every record of the file).
 */
#include "dfs_internal.h"

#include "common.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* Fuzz builds skip checksum checks so that mutated headers reach the parser
 * (the usual libFuzzer convention); every other build checks them. */
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
#define CHECKSUMS_OFF 1
#else
#define CHECKSUMS_OFF 0
#endif

struct dfs_reader {
    FILE    *f;
    int      own_f;
    char    *path;           /* as named in messages ("stdin" for "-") */
    uint64_t off;            /* bytes consumed */
    uint64_t nrec;           /* records started, every type */
    uint64_t rec_off;        /* offset of the record being read */
    json_t  *header;         /* first segment's stream header */
    json_t  *meta;           /* its "meta", borrowed from header */
    int      segments;
    int      in_segment;     /* after a stream header, before its end record */
    uint64_t seg_samples, seg_raw, seg_stored;
    dfs_buf  hdr, pay;
    dfs_sample s;
    char     id[DFS_MAX_ID + 1];
    dfs_buf  dec[DFS_MAX_TENSORS];
    dfs_codec_ctx codec;
};

/* ---- errors and raw input ------------------------------------------------ */

/* "FILE: byte OFFSET (record N): message", exit code DFL_EX_DATA. */
static int vbad(const dfs_reader *r, uint64_t off, uint64_t rec, const char *fmt, va_list ap) {
    char msg[768];
    vsnprintf(msg, sizeof msg, fmt, ap);
    return dfl_err(DFL_EX_DATA, "%s: byte %llu (record %llu): %s", r->path, (unsigned long long)off,
                   (unsigned long long)rec, msg);
}

/* An error in the record being read. */
__attribute__((format(printf, 2, 3))) static int bad(dfs_reader *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = vbad(r, r->rec_off, r->nrec, fmt, ap);
    va_end(ap);
    return rc;
}

/* An error in the sample last returned by dfs_read (found when decoding). */
__attribute__((format(printf, 2, 3))) static int bad_sample(dfs_reader *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = vbad(r, r->s.offset, r->nrec - 1, fmt, ap);
    va_end(ap);
    return rc;
}

static int io_error(dfs_reader *r) {
    return dfl_err(DFL_EX_IOERR, "%s: byte %llu: read error: %s", r->path, (unsigned long long)r->off,
                   strerror(errno));
}

/* Read exactly n bytes. Returns 0, DFL_EX_IOERR, or -1 at end of file with
 * *got bytes read. */
static int read_exact(dfs_reader *r, void *buf, size_t n, size_t *got) {
    size_t k = fread(buf, 1, n, r->f);
    r->off += k;
    if (got) *got = k;
    if (k == n) return 0;
    if (ferror(r->f)) return io_error(r);
    return -1;
}

static int truncated(dfs_reader *r, const char *where, uint64_t want, uint64_t got) {
    return bad(r, "truncated: end of input inside the %s (%llu of %llu bytes)", where, (unsigned long long)got,
               (unsigned long long)want);
}

/* Read n payload bytes into r->pay, growing it only as bytes arrive. */
static int read_payload(dfs_reader *r, uint64_t n) {
    uint64_t got = 0;
    while (got < n) {
        uint64_t step = n - got, grow = got > (1u << 20) ? got : (1u << 20);
        if (step > grow) step = grow;
        dfs_buf_reserve(&r->pay, (size_t)(got + step));
        size_t k;
        int rc = read_exact(r, r->pay.p + got, (size_t)step, &k);
        got += k;
        if (rc > 0) return rc;
        if (rc < 0) return truncated(r, "payload", n, got);
    }
    return 0;
}

/* Skip n payload bytes (a record type this reader does not know). */
static int skip_payload(dfs_reader *r, uint64_t n) {
    uint8_t buf[16384];
    uint64_t got = 0;
    while (got < n) {
        size_t step = n - got < sizeof buf ? (size_t)(n - got) : sizeof buf, k;
        int rc = read_exact(r, buf, step, &k);
        got += k;
        if (rc > 0) return rc;
        if (rc < 0) return truncated(r, "payload", n, got);
    }
    return 0;
}

/* ---- record framing ---------------------------------------------------- */

/* Read the next record's prefix and header and parse the header. Returns 1
 * with *mp filled (caller destroys), 0 at a clean end of input (no byte of a
 * new record), or an error code. */
static int next_record(dfs_reader *r, msgpack_unpacked *mp, uint64_t *payload) {
    uint8_t pre[DFS_PREFIX];
    size_t got;
    r->rec_off = r->off;
    int rc = read_exact(r, pre, sizeof pre, &got);
    if (rc > 0) return rc;
    if (rc < 0 && got == 0) return 0;
    if (rc < 0) return truncated(r, "record prefix", sizeof pre, got);
    if (memcmp(pre, DFS_MAGIC, 4) != 0)
        return bad(r, "bad magic %02x %02x %02x %02x (a record starts with 89 44 46 53, \"\\x89DFS\")", pre[0],
                   pre[1], pre[2], pre[3]);
    uint32_t n = dfs_le32(pre + 4);
    if (n == 0 || n > DFS_MAX_HEADER)
        return bad(r, "header length %u is outside 1..%u", n, (unsigned)DFS_MAX_HEADER);
    dfs_buf_reserve(&r->hdr, n);
    rc = read_exact(r, r->hdr.p, n, &got);
    if (rc > 0) return rc;
    if (rc < 0) return truncated(r, "header", n, got);
    uint64_t want = dfs_le64(pre + 8), have = XXH64(r->hdr.p, n, 0);
    if (want != have && !CHECKSUMS_OFF)
        return bad(r, "header checksum mismatch (XXH64 of the %u header bytes is %016llx, the prefix says %016llx)", n,
                   (unsigned long long)have, (unsigned long long)want);
    const char *why;
    if (dfs_mp_parse(mp, r->hdr.p, n, &why)) return bad(r, "%s", why);
    const msgpack_object *h = &mp->data;
    const msgpack_object_kv *dup = dfs_mp_dup_key(h);
    const msgpack_object *type = dfs_mp_get(h, "type");
    if (dup || !type || type->type != MSGPACK_OBJECT_STR || dfs_mp_u64(dfs_mp_get(h, "payload"), payload)) {
        rc = dup ? bad(r, "duplicate key \"%.*s\" in the header", (int)dup->key.via.str.size, dup->key.via.str.ptr)
                     : bad(r, "header lacks a string \"type\" or an unsigned integer \"payload\"");
        msgpack_unpacked_destroy(mp); /* after the message: dup points into it */
        return rc;
    }
    return 1;
}

/* ---- stream headers ---------------------------------------------------- */

/* Check a stream header; for the first segment keep it, for later ones
 * compare its identity fields with the first. */
static int stream_header(dfs_reader *r, const msgpack_object *h) {
    const msgpack_object *v = dfs_mp_get(h, "version");
    uint64_t major, minor;
    if (!dfs_mp_str_eq(dfs_mp_get(h, "format"), "dflash-stream"))
        return bad(r, "stream header: \"format\" is not \"dflash-stream\"");
    if (!v || v->type != MSGPACK_OBJECT_ARRAY || v->via.array.size != 2 || dfs_mp_u64(&v->via.array.ptr[0], &major) ||
        dfs_mp_u64(&v->via.array.ptr[1], &minor))
        return bad(r, "stream header: \"version\" is not [major, minor]");
    if (major != DFS_VERSION_MAJOR)
        return bad(r, "stream version %llu.%llu is not supported (this reader reads version %d.x, up to %d.%d)",
                   (unsigned long long)major, (unsigned long long)minor, DFS_VERSION_MAJOR, DFS_VERSION_MAJOR,
                   DFS_VERSION_MINOR);
    const msgpack_object *producer = dfs_mp_get(h, "producer"), *created = dfs_mp_get(h, "created");
    const msgpack_object *meta = dfs_mp_get(h, "meta");
    if (!producer || producer->type != MSGPACK_OBJECT_STR || !created || created->type != MSGPACK_OBJECT_STR)
        return bad(r, "stream header: \"producer\" and \"created\" must be strings");
    if (!meta || meta->type != MSGPACK_OBJECT_MAP) return bad(r, "stream header: \"meta\" is not a map");
    char why[800];
    json_t *j = dfs_mp_to_json(h, why, sizeof why);
    if (!j) return bad(r, "stream header: %s", why);
    json_object_del(j, "payload");
    r->segments++;
    r->in_segment = 1;
    r->seg_samples = r->seg_raw = r->seg_stored = 0;
    if (!r->header) {
        r->header = j;
        r->meta = json_object_get(j, "meta");
        return 0;
    }
    char diff[900];
    int nd = dfs_meta_diff(r->meta, json_object_get(j, "meta"), diff, sizeof diff);
    json_decref(j);
    if (nd) return bad(r, "segment %d's stream header differs from the first segment's: %s", r->segments, diff);
    return 0;
}

/* ---- samples ------------------------------------------------------------ */

/* Parse one tensor map into t. Returns 0 or an error (already recorded). */
static int tensor_info(dfs_reader *r, int i, const msgpack_object *m, dfs_tensor *t) {
    if (m->type != MSGPACK_OBJECT_MAP) return bad(r, "tensor %d: not a map", i);
    if (dfs_mp_dup_key(m)) return bad(r, "tensor %d: duplicate key", i);
    memset(t, 0, sizeof *t);
    if (dfs_mp_str(dfs_mp_get(m, "name"), t->name, sizeof t->name) || !t->name[0])
        return bad(r, "tensor %d: \"name\" must be a UTF-8 string of 1 to %d bytes", i, DFS_MAX_NAME);
    char s[16];
    if (dfs_mp_str(dfs_mp_get(m, "dtype"), s, sizeof s) || dfl_dtype_parse(s, &t->dtype))
        return bad(r, "tensor \"%s\": \"dtype\" is not one of bf16, f16, f32, i32, i64, u8", t->name);
    if (dfs_mp_str(dfs_mp_get(m, "codec"), s, sizeof s) || (strcmp(s, "none") && strcmp(s, "lz4")))
        return bad(r, "tensor \"%s\": \"codec\" is not \"none\" or \"lz4\"", t->name);
    t->codec = strcmp(s, "lz4") ? DFS_CODEC_NONE : DFS_CODEC_LZ4;
    const msgpack_object *sh = dfs_mp_get(m, "shuffle");
    if (!sh || sh->type != MSGPACK_OBJECT_BOOLEAN) return bad(r, "tensor \"%s\": \"shuffle\" is not a boolean", t->name);
    t->shuffle = sh->via.boolean;
    if (dfs_mp_u64(dfs_mp_get(m, "raw"), &t->raw_bytes) || dfs_mp_u64(dfs_mp_get(m, "stored"), &t->stored_bytes) ||
        dfs_mp_u64(dfs_mp_get(m, "xxh64"), &t->checksum))
        return bad(r, "tensor \"%s\": \"raw\", \"stored\" and \"xxh64\" must be unsigned integers", t->name);
    const msgpack_object *shape = dfs_mp_get(m, "shape");
    if (!shape || shape->type != MSGPACK_OBJECT_ARRAY || shape->via.array.size > DFS_MAX_DIMS)
        return bad(r, "tensor \"%s\": \"shape\" is not an array of at most %d dimensions", t->name, DFS_MAX_DIMS);
    uint64_t numel = 1, bytes;
    t->ndim = (int)shape->via.array.size;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t dim;
        if (dfs_mp_u64(&shape->via.array.ptr[d], &dim) || dim > (uint64_t)INT64_MAX || dfl_mul_overflow(numel, dim, &numel))
            return bad(r, "tensor \"%s\": shape dimension %d is not a valid size", t->name, d);
        t->shape[d] = (int64_t)dim;
    }
    if (dfl_mul_overflow(numel, dfl_dtype_size(t->dtype), &bytes) || bytes > DFS_MAX_TENSOR_BYTES)
        return bad(r, "tensor \"%s\": larger than the %llu-byte cap", t->name, (unsigned long long)DFS_MAX_TENSOR_BYTES);
    if (t->raw_bytes != bytes)
        return bad(r, "tensor \"%s\": \"raw\" is %llu but its shape and dtype make %llu bytes", t->name,
                   (unsigned long long)t->raw_bytes, (unsigned long long)bytes);
    if (t->codec == DFS_CODEC_NONE && (t->stored_bytes != t->raw_bytes || t->shuffle))
        return bad(r, "tensor \"%s\": codec none needs stored == raw and shuffle false", t->name);
    if (t->codec == DFS_CODEC_LZ4 &&
        (t->stored_bytes > dfs_lz4_max_stored(t->raw_bytes) || t->raw_bytes > dfs_lz4_max_raw(t->stored_bytes)))
        return bad(r, "tensor \"%s\": %llu stored bytes cannot be an LZ4 frame of %llu raw bytes", t->name,
                   (unsigned long long)t->stored_bytes, (unsigned long long)t->raw_bytes);
    return 0;
}

static int sample_header(dfs_reader *r, const msgpack_object *h, uint64_t payload) {
    dfs_sample *s = &r->s;
    if (dfs_mp_str(dfs_mp_get(h, "id"), r->id, sizeof r->id))
        return bad(r, "sample: \"id\" must be a UTF-8 string of at most %d bytes", DFS_MAX_ID);
    const msgpack_object *ts = dfs_mp_get(h, "tensors");
    if (!ts || ts->type != MSGPACK_OBJECT_ARRAY || ts->via.array.size > DFS_MAX_TENSORS)
        return bad(r, "sample \"%s\": \"tensors\" is not an array of at most %d maps", r->id, DFS_MAX_TENSORS);
    s->id = r->id;
    s->offset = r->rec_off;
    s->record = r->nrec;
    s->ntensors = (int)ts->via.array.size;
    uint64_t sum = 0;
    for (int i = 0; i < s->ntensors; i++) {
        int rc = tensor_info(r, i, &ts->via.array.ptr[i], &s->t[i]);
        if (rc) return rc;
        for (int j = 0; j < i; j++)
            if (!strcmp(s->t[j].name, s->t[i].name)) return bad(r, "sample \"%s\": two tensors named \"%s\"", r->id, s->t[i].name);
        sum += s->t[i].stored_bytes; /* each is below 2^37, so 64 of them cannot overflow */
    }
    if (sum != payload)
        return bad(r, "sample \"%s\": \"payload\" is %llu but the tensors store %llu bytes", r->id,
                   (unsigned long long)payload, (unsigned long long)sum);
    return 0;
}

/* Read the payload of the sample whose header is parsed, point the tensors
 * at it and verify every checksum. */
static int sample_payload(dfs_reader *r, uint64_t payload) {
    int rc = read_payload(r, payload);
    if (rc) return rc;
    uint64_t pos = 0;
    for (int i = 0; i < r->s.ntensors; i++) {
        dfs_tensor *t = &r->s.t[i];
        t->stored = r->pay.p + pos;
        t->data = NULL;
        pos += t->stored_bytes;
        uint64_t h = XXH64(t->stored, t->stored_bytes, 0);
        if (h != t->checksum && !CHECKSUMS_OFF)
            return bad(r, "sample \"%s\", tensor \"%s\": checksum mismatch (XXH64 of the stored bytes is %016llx, the header says %016llx)",
                       r->id, t->name, (unsigned long long)h, (unsigned long long)t->checksum);
        r->seg_raw += t->raw_bytes;
        r->seg_stored += t->stored_bytes;
    }
    r->seg_samples++;
    return 0;
}

static int end_record(dfs_reader *r, const msgpack_object *h) {
    uint64_t n, v;
    if (dfs_mp_u64(dfs_mp_get(h, "records"), &n)) return bad(r, "end record: \"records\" is not an unsigned integer");
    if (n != r->seg_samples)
        return bad(r, "end record says %llu sample records, the segment has %llu", (unsigned long long)n,
                   (unsigned long long)r->seg_samples);
    const msgpack_object *raw = dfs_mp_get(h, "raw"), *stored = dfs_mp_get(h, "stored");
    if (raw && (dfs_mp_u64(raw, &v) || v != r->seg_raw))
        return bad(r, "end record: \"raw\" does not match the segment's %llu raw bytes", (unsigned long long)r->seg_raw);
    if (stored && (dfs_mp_u64(stored, &v) || v != r->seg_stored))
        return bad(r, "end record: \"stored\" does not match the segment's %llu stored bytes",
                   (unsigned long long)r->seg_stored);
    r->in_segment = 0;
    return 0;
}

/* ---- public API ---------------------------------------------------------- */

int dfs_read(dfs_reader *r, dfs_sample **s) {
    *s = NULL;
    for (;;) {
        msgpack_unpacked mp;
        uint64_t payload;
        int rc = next_record(r, &mp, &payload);
        if (rc == 0) {
            if (!r->in_segment) return 0;
            return bad(r, "truncated: the input ends without an end record (segment %d has %llu sample records so far)",
                       r->segments, (unsigned long long)r->seg_samples);
        }
        if (rc != 1) return rc;
        const msgpack_object *h = &mp.data, *type = dfs_mp_get(h, "type");
        int is_stream = dfs_mp_str_eq(type, "stream"), is_sample = dfs_mp_str_eq(type, "sample");
        int is_end = dfs_mp_str_eq(type, "end");
        if (!r->in_segment && !is_stream) {
            rc = bad(r, "expected a stream header after the end record, found a record of type \"%.*s\"",
                     (int)type->via.str.size, type->via.str.ptr);
        } else if (is_stream && r->in_segment) {
            rc = bad(r, "stream header inside a segment (the previous segment has no end record)");
        } else if (is_stream) {
            rc = stream_header(r, h);
            if (!rc) rc = skip_payload(r, payload);
        } else if (is_sample) {
            rc = sample_header(r, h, payload);
            if (!rc) rc = sample_payload(r, payload);
        } else if (is_end) {
            rc = end_record(r, h);
            if (!rc) rc = skip_payload(r, payload);
        } else {
            rc = skip_payload(r, payload); /* unknown record type: skipped */
        }
        msgpack_unpacked_destroy(&mp);
        r->nrec++;
        if (rc) return rc;
        if (is_sample) {
            *s = &r->s;
            return 1;
        }
    }
}

int dfs_reader_open_stream(dfs_reader **out, FILE *f, const char *name) {
    dfs_reader *r = dfl_calloc(1, sizeof *r);
    r->f = f;
    r->path = dfl_strdup(name);
    dfs_codec_init(&r->codec);
    msgpack_unpacked mp;
    uint64_t payload;
    int rc = next_record(r, &mp, &payload);
    if (rc == 0) rc = bad(r, "empty input: a stream starts with a stream header record");
    if (rc != 1) {
        dfs_reader_close(r);
        *out = NULL;
        return rc;
    }
    if (!dfs_mp_str_eq(dfs_mp_get(&mp.data, "type"), "stream")) rc = bad(r, "the first record is not a stream header");
    else rc = stream_header(r, &mp.data);
    msgpack_unpacked_destroy(&mp);
    if (!rc) rc = skip_payload(r, payload);
    r->nrec++;
    if (rc) {
        dfs_reader_close(r);
        r = NULL;
    }
    *out = r;
    return rc;
}

int dfs_reader_open(dfs_reader **out, const char *path) {
    *out = NULL;
    int is_stdin = !strcmp(path, "-");
    if (is_stdin && dfl_stdin_check("stdin")) return DFL_EX_NOINPUT;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: %s", path, strerror(errno));
    if (!is_stdin) setvbuf(f, NULL, _IOFBF, 1 << 18);
    int rc = dfl_refuse_directory(f, is_stdin ? "stdin" : path);
    if (!rc) rc = dfs_reader_open_stream(out, f, is_stdin ? "stdin" : path);
    if (rc && !is_stdin) fclose(f);
    if (!rc) (*out)->own_f = !is_stdin;
    return rc;
}

int dfs_decode(dfs_reader *r, dfs_tensor *t) {
    if (t->data) return 0;
    DFL_ASSERT(t >= r->s.t && t < r->s.t + r->s.ntensors);
    dfs_buf *b = &r->dec[t - r->s.t];
    dfs_abuf_reserve(b, (size_t)(t->raw_bytes ? t->raw_bytes : 1));
    char why[300];
    if (dfs_decode_into(&r->codec, b->p, t, why, sizeof why))
        return bad_sample(r, "sample \"%s\", tensor \"%s\": %s", r->id, t->name, why);
    t->data = b->p;
    return 0;
}

void dfs_take_decoded(dfs_reader *r, dfs_tensor *t, void **buf, size_t *cap) {
    DFL_ASSERT(t >= r->s.t && t < r->s.t + r->s.ntensors);
    dfs_buf *b = &r->dec[t - r->s.t];
    DFL_ASSERT(t->data && t->data == b->p); /* decoded, into the reader's buffer */
    uint8_t *p = b->p;
    size_t c = b->cap;
    b->p = *buf, b->cap = *cap; /* 64-byte aligned too: it came from a reader (or is NULL, capacity 0) */
    *buf = p, *cap = c;
}

dfs_tensor *dfs_find(dfs_sample *s, const char *name) {
    for (int i = 0; i < s->ntensors; i++)
        if (!strcmp(s->t[i].name, name)) return &s->t[i];
    return NULL;
}

const json_t *dfs_reader_meta(const dfs_reader *r) { return r->meta; }
const json_t *dfs_reader_header(const dfs_reader *r) { return r->header; }
const char *dfs_reader_path(const dfs_reader *r) { return r->path; }
uint64_t dfs_reader_offset(const dfs_reader *r) { return r->off; }
int dfs_reader_segments(const dfs_reader *r) { return r->segments; }

void dfs_reader_close(dfs_reader *r) {
    if (!r) return;
    if (r->own_f) fclose(r->f);
    json_decref(r->header);
    free(r->path);
    dfs_buf_free(&r->hdr);
    dfs_buf_free(&r->pay);
    for (int i = 0; i < DFS_MAX_TENSORS; i++) dfs_buf_free(&r->dec[i]);
    dfs_codec_free(&r->codec);
    free(r);
}
