/* dfs_write.c: the DFS stream writer.
 *
 * A record's header holds each tensor's stored size and checksum, so a
 * sample's tensors are encoded into one reusable buffer first, then the
 * prefix, the header and the payload are written in one go. Nothing is
 * ever seeked: the output may be a pipe.
 */
#include "dfs_internal.h"

#include "common.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

struct dfs_writer {
    FILE        *f;
    char        *path;
    dfs_encoding enc;
    uint64_t     records, raw, stored;
    dfs_buf      hdr;          /* packed header */
    size_t       hdr_len;
    dfs_buf      payload;      /* encoded tensors of the sample being written */
    dfs_buf      dec;          /* raw bytes of a tensor being re-encoded */
    dfs_codec_ctx codec;
};

/* One tensor as it goes into a record: its header fields and stored bytes
 * (either in the record's payload buffer at `at`, or borrowed from a read
 * sample). */
typedef struct {
    const char *name;
    dfl_dtype   dtype;
    int         ndim;
    const int64_t *shape;
    dfs_codec   codec;
    int         shuffle;
    uint64_t    raw, stored, xxh64;
    const uint8_t *borrowed;   /* NULL: stored in the payload buffer at `at` */
    size_t      at;
} out_tensor;

/* ---- header packing ------------------------------------------------------ */

static int hdr_write(void *data, const char *buf, size_t len) {
    dfs_writer *w = data;
    dfs_buf_reserve(&w->hdr, w->hdr_len + len);
    memcpy(w->hdr.p + w->hdr_len, buf, len);
    w->hdr_len += len;
    return 0;
}

static void pack_kv_str(msgpack_packer *pk, const char *k, const char *v) {
    dfs_mp_pack_cstr(pk, k);
    dfs_mp_pack_cstr(pk, v);
}

static void pack_kv_u64(msgpack_packer *pk, const char *k, uint64_t v) {
    dfs_mp_pack_cstr(pk, k);
    msgpack_pack_uint64(pk, v);
}

static int write_error(const dfs_writer *w) {
    return dfl_err(DFL_EX_IOERR, "%s: write failed: %s", w->path, strerror(errno));
}

/* Write prefix + the packed header + `n` payload pieces (those not borrowed
 * are in `payload` at their `at`). */
static int write_record(dfs_writer *w, const out_tensor *t, int n, const uint8_t *payload) {
    if (w->hdr_len > DFS_MAX_HEADER)
        return dfl_err(DFL_EX_DATA, "%s: record header of %zu bytes exceeds the %u-byte cap", w->path, w->hdr_len,
                       (unsigned)DFS_MAX_HEADER);
    uint8_t pre[DFS_PREFIX];
    memcpy(pre, DFS_MAGIC, 4);
    dfs_put_le(pre + 4, w->hdr_len, 4);
    dfs_put_le(pre + 8, XXH64(w->hdr.p, w->hdr_len, 0), 8);
    if (fwrite(pre, 1, sizeof pre, w->f) != sizeof pre || fwrite(w->hdr.p, 1, w->hdr_len, w->f) != w->hdr_len)
        return write_error(w);
    for (int i = 0; i < n; i++) {
        const uint8_t *p = t[i].borrowed ? t[i].borrowed : payload + t[i].at;
        if (t[i].stored && fwrite(p, 1, t[i].stored, w->f) != t[i].stored) return write_error(w);
    }
    return 0;
}

static msgpack_packer start_header(dfs_writer *w, const char *type, int nkeys, uint64_t payload) {
    msgpack_packer pk;
    w->hdr_len = 0;
    msgpack_packer_init(&pk, w, hdr_write);
    msgpack_pack_map(&pk, (size_t)nkeys);
    pack_kv_str(&pk, "type", type);
    pack_kv_u64(&pk, "payload", payload);
    return pk;
}

/* The last second "created" can hold in YYYY-MM-DDTHH:MM:SSZ:
 * 9999-12-31T23:59:59Z. */
#define SDE_MAX INT64_C(253402300799)

/* SOURCE_DATE_EPOCH into *t when set. Reproducible-build tools refuse a value
 * they cannot use rather than quietly writing the current time, which
 * defeats the point of setting it. */
static int source_date_epoch(time_t *t) {
    const char *sde = getenv("SOURCE_DATE_EPOCH");
    if (!sde) return 0;
    int64_t v;
    /* digits only: strtoll would also take " 5", "+5" and "-0" */
    if (strspn(sde, "0123456789") != strlen(sde) || dfl_parse_i64(sde, &v) || v > SDE_MAX)
        return dfl_err(DFL_EX_USAGE, "SOURCE_DATE_EPOCH: '%.40s' is not a count of seconds in 0..%lld "
                                     "(up to 9999-12-31T23:59:59Z)", sde, (long long)SDE_MAX);
    *t = (time_t)v;
    return 0;
}

int dfs_check_source_date_epoch(void) {
    time_t t;
    return source_date_epoch(&t);
}

/* "created": now in UTC, or SOURCE_DATE_EPOCH for reproducible output. */
static int created_now(char *buf, size_t n) {
    time_t t = time(NULL);
    int rc = source_date_epoch(&t);
    if (rc) return rc;
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return 0;
}

/* ---- open / close -------------------------------------------------------- */

int dfs_writer_open(dfs_writer **out, FILE *f, const char *path, const json_t *meta, const char *producer,
                    dfs_encoding enc) {
    *out = NULL;
    if (!json_is_object(meta)) return dfl_err(DFL_EX_SOFTWARE, "%s: stream meta is not a JSON object", path);
    char created[32];
    int rc = created_now(created, sizeof created);
    if (rc) return rc;
    dfs_writer *w = dfl_calloc(1, sizeof *w);
    w->f = f;
    w->path = dfl_strdup(path);
    w->enc = enc;
    if (w->enc.lz4_accel < 1) w->enc.lz4_accel = 1;
    dfs_codec_init(&w->codec);
    msgpack_packer pk = start_header(w, "stream", 7, 0);
    pack_kv_str(&pk, "format", "dflash-stream");
    dfs_mp_pack_cstr(&pk, "version");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint64(&pk, DFS_VERSION_MAJOR);
    msgpack_pack_uint64(&pk, DFS_VERSION_MINOR);
    pack_kv_str(&pk, "producer", producer);
    pack_kv_str(&pk, "created", created);
    dfs_mp_pack_cstr(&pk, "meta");
    dfs_mp_pack_json(&pk, meta);
    rc = write_record(w, NULL, 0, NULL);
    if (rc) {
        dfs_writer_abort(w);
        return rc;
    }
    *out = w;
    return 0;
}

int dfs_writer_close(dfs_writer *w) {
    msgpack_packer pk = start_header(w, "end", 5, 0);
    pack_kv_u64(&pk, "records", w->records);
    pack_kv_u64(&pk, "raw", w->raw);
    pack_kv_u64(&pk, "stored", w->stored);
    int rc = write_record(w, NULL, 0, NULL);
    if (!rc && (fflush(w->f) != 0 || ferror(w->f))) rc = write_error(w);
    dfs_writer_abort(w);
    return rc;
}

void dfs_writer_abort(dfs_writer *w) {
    if (!w) return;
    free(w->path);
    dfs_buf_free(&w->hdr);
    dfs_buf_free(&w->payload);
    dfs_buf_free(&w->dec);
    dfs_codec_free(&w->codec);
    free(w);
}

uint64_t dfs_writer_records(const dfs_writer *w) { return w->records; }

/* ---- samples ------------------------------------------------------------- */

/* The encoding a tensor of this dtype really gets: shuffle only with lz4,
 * and meaningless (so off) for 1-byte elements. */
static dfs_encoding normalise(dfs_encoding e, dfl_dtype dt) {
    if (e.codec == DFS_CODEC_NONE || dfl_dtype_size(dt) == 1) e.shuffle = 0;
    e.shuffle = !!e.shuffle;
    return e;
}

static int check_id(const dfs_writer *w, const char *id) {
    size_t n = strlen(id);
    if (n > DFS_MAX_ID || !dfs_utf8_ok(id, n))
        return dfl_err(DFL_EX_DATA, "%s: sample id \"%.40s...\" is not UTF-8 of at most %d bytes", w->path, id, DFS_MAX_ID);
    return 0;
}

static int check_tensor(const dfs_writer *w, const char *id, const dfs_tensor_in *t, uint64_t *raw) {
    size_t n = strlen(t->name);
    if (n == 0 || n > DFS_MAX_NAME || !dfs_utf8_ok(t->name, n))
        return dfl_err(DFL_EX_DATA, "%s: sample \"%s\": tensor name \"%s\" is not UTF-8 of 1 to %d bytes", w->path, id,
                       t->name, DFS_MAX_NAME);
    if ((unsigned)t->dtype >= DFL_DTYPE_COUNT || t->ndim < 0 || t->ndim > DFS_MAX_DIMS)
        return dfl_err(DFL_EX_DATA, "%s: sample \"%s\": tensor \"%s\": bad dtype or rank", w->path, id, t->name);
    uint64_t numel = 1;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0 || dfl_mul_overflow(numel, (uint64_t)t->shape[d], &numel))
            return dfl_err(DFL_EX_DATA, "%s: sample \"%s\": tensor \"%s\": bad shape", w->path, id, t->name);
    if (dfl_mul_overflow(numel, dfl_dtype_size(t->dtype), raw) || *raw > DFS_MAX_TENSOR_BYTES)
        return dfl_err(DFL_EX_DATA, "%s: sample \"%s\": tensor \"%s\" exceeds %llu bytes", w->path, id, t->name,
                       (unsigned long long)DFS_MAX_TENSOR_BYTES);
    return 0;
}

static int check_names(const dfs_writer *w, const char *id, int n, const char *const *names) {
    if (n < 0 || n > DFS_MAX_TENSORS)
        return dfl_err(DFL_EX_DATA, "%s: sample \"%s\": %d tensors (at most %d)", w->path, id, n, DFS_MAX_TENSORS);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (!strcmp(names[i], names[j]))
                return dfl_err(DFL_EX_DATA, "%s: sample \"%s\": two tensors named \"%s\"", w->path, id, names[i]);
    return 0;
}

static int emit_sample(dfs_writer *w, const char *id, const out_tensor *o, int n, const uint8_t *payload_buf) {
    uint64_t payload = 0;
    for (int i = 0; i < n; i++) payload += o[i].stored;
    msgpack_packer pk = start_header(w, "sample", 4, payload);
    pack_kv_str(&pk, "id", id);
    dfs_mp_pack_cstr(&pk, "tensors");
    msgpack_pack_array(&pk, (size_t)n);
    for (int i = 0; i < n; i++) {
        msgpack_pack_map(&pk, 8);
        pack_kv_str(&pk, "name", o[i].name);
        pack_kv_str(&pk, "dtype", dfl_dtype_name(o[i].dtype));
        dfs_mp_pack_cstr(&pk, "shape");
        msgpack_pack_array(&pk, (size_t)o[i].ndim);
        for (int d = 0; d < o[i].ndim; d++) msgpack_pack_uint64(&pk, (uint64_t)o[i].shape[d]);
        pack_kv_str(&pk, "codec", o[i].codec == DFS_CODEC_LZ4 ? "lz4" : "none");
        dfs_mp_pack_cstr(&pk, "shuffle");
        o[i].shuffle ? msgpack_pack_true(&pk) : msgpack_pack_false(&pk);
        pack_kv_u64(&pk, "raw", o[i].raw);
        pack_kv_u64(&pk, "stored", o[i].stored);
        pack_kv_u64(&pk, "xxh64", o[i].xxh64);
    }
    int rc = write_record(w, o, n, payload_buf);
    if (rc) return rc;
    w->records++;
    for (int i = 0; i < n; i++) {
        w->raw += o[i].raw;
        w->stored += o[i].stored;
    }
    return 0;
}

/* Checksums of the tensors encoded into `payload` (after all of them are
 * encoded, when the buffer no longer moves). */
static void checksum_encoded(const uint8_t *payload, out_tensor *o, int n) {
    for (int i = 0; i < n; i++)
        if (!o[i].borrowed) o[i].xxh64 = XXH64(payload + o[i].at, o[i].stored, 0);
}

/* Check a sample's tensors and encode them into `payload` with codec
 * context `c`, filling o[] (names and shapes point into t). Touches nothing
 * of w but reads its path and default encoding, so threads may encode
 * samples at once, each with its own c and payload. */
static int encode_tensors(const dfs_writer *w, dfs_codec_ctx *c, dfs_buf *payload, const char *id, int ntensors,
                          const dfs_tensor_in *t, out_tensor *o) {
    const char *names[DFS_MAX_TENSORS] = {0};
    int rc = check_id(w, id);
    if (rc) return rc;
    if (ntensors < 0 || ntensors > DFS_MAX_TENSORS) return check_names(w, id, ntensors, NULL);
    for (int i = 0; i < ntensors; i++) names[i] = t[i].name;
    if ((rc = check_names(w, id, ntensors, names))) return rc;
    size_t len = 0;
    for (int i = 0; i < ntensors; i++) {
        memset(&o[i], 0, sizeof o[i]);
        if ((rc = check_tensor(w, id, &t[i], &o[i].raw))) return rc;
        o[i].name = t[i].name;
        o[i].dtype = t[i].dtype;
        o[i].ndim = t[i].ndim;
        o[i].shape = t[i].shape;
        dfs_encoding e = normalise(t[i].enc ? *t[i].enc : w->enc, t[i].dtype);
        if (e.lz4_accel < 1) e.lz4_accel = 1;
        const char *why = NULL;
        o[i].at = len;
        if (dfs_encode(c, payload, &len, t[i].data, o[i].raw, dfl_dtype_size(t[i].dtype), &e, &why))
            return dfl_err(DFL_EX_SOFTWARE, "%s: tensor \"%s\": %s", w->path, t[i].name, why);
        o[i].stored = len - o[i].at;
        o[i].codec = e.codec;
        o[i].shuffle = e.shuffle;
    }
    checksum_encoded(payload->p, o, ntensors);
    return 0;
}

int dfs_write(dfs_writer *w, const char *id, int ntensors, const dfs_tensor_in *t) {
    out_tensor o[DFS_MAX_TENSORS];
    int rc = encode_tensors(w, &w->codec, &w->payload, id, ntensors, t, o);
    return rc ? rc : emit_sample(w, id, o, ntensors, w->payload.p);
}

/* ---- samples encoded apart (dfs_encoded) ---------------------------------- */

struct dfs_encoded {
    char         *id;
    int           n;
    dfs_tensor_in in[DFS_MAX_TENSORS];              /* copies: names point into `names` */
    char          names[DFS_MAX_TENSORS][DFS_MAX_NAME + 2];
    out_tensor    o[DFS_MAX_TENSORS];
    dfs_buf       payload;
    dfs_codec_ctx codec;
};

dfs_encoded *dfs_encoded_new(void) {
    dfs_encoded *e = dfl_calloc(1, sizeof *e);
    dfs_codec_init(&e->codec);
    return e;
}

void dfs_encoded_free(dfs_encoded *e) {
    if (!e) return;
    free(e->id);
    dfs_buf_free(&e->payload);
    dfs_codec_free(&e->codec);
    free(e);
}

int dfs_encode_sample(const dfs_writer *w, dfs_encoded *e, const char *id, int ntensors, const dfs_tensor_in *t) {
    free(e->id);
    e->id = dfl_strdup(id);
    e->n = 0;
    if (ntensors < 0 || ntensors > DFS_MAX_TENSORS) return check_names(w, id, ntensors, NULL);
    for (int i = 0; i < ntensors; i++) { /* the sample's own copies (a name too long is refused below) */
        e->in[i] = t[i];
        snprintf(e->names[i], sizeof e->names[i], "%s", t[i].name);
        e->in[i].name = strlen(t[i].name) < sizeof e->names[i] ? e->names[i] : t[i].name;
    }
    int rc = encode_tensors(w, &e->codec, &e->payload, id, ntensors, e->in, e->o);
    if (!rc) e->n = ntensors;
    return rc;
}

int dfs_write_encoded(dfs_writer *w, const dfs_encoded *e) { return emit_sample(w, e->id, e->o, e->n, e->payload.p); }

/* A stored tensor that does not decode, found while re-encoding: in the
 * reader's form when the sample's reader is known. A shuffled sample has
 * come through memory or a bucket file: its input and offset are lost, and
 * only its id names it. */
static int undecodable(const dfs_reader *from, const dfs_sample *s, const dfs_tensor *t, const char *why) {
    if (from)
        return dfl_err(DFL_EX_DATA, "%s: byte %llu (record %llu): sample \"%s\", tensor \"%s\": %s",
                       dfs_reader_path(from), (unsigned long long)s->offset, (unsigned long long)s->record, s->id,
                       t->name, why);
    return dfl_err(DFL_EX_DATA, "shuffled input record: sample \"%s\", tensor \"%s\": %s", s->id, t->name, why);
}

int dfs_write_sample(dfs_writer *w, dfs_reader *from, dfs_sample *s, int keep_encoding) {
    /* decoding uses the writer's own buffers, so the reader's decode slots stay untouched */
    out_tensor o[DFS_MAX_TENSORS];
    size_t len = 0;
    for (int i = 0; i < s->ntensors; i++) {
        const dfs_tensor *t = &s->t[i];
        o[i] = (out_tensor){t->name, t->dtype, t->ndim, t->shape, t->codec, t->shuffle,
                            t->raw_bytes, t->stored_bytes, t->checksum, t->stored, 0};
        dfs_encoding have = normalise((dfs_encoding){t->codec, t->shuffle, 1}, t->dtype);
        dfs_encoding want = keep_encoding ? have : normalise(w->enc, t->dtype);
        if (want.codec == have.codec && want.shuffle == have.shuffle) continue; /* copy as stored */
        const void *raw = t->data;
        if (!raw) {
            char why[300];
            dfs_abuf_reserve(&w->dec, (size_t)(t->raw_bytes ? t->raw_bytes : 1));
            if (dfs_decode_into(&w->codec, w->dec.p, t, why, sizeof why)) return undecodable(from, s, t, why);
            raw = w->dec.p;
        }
        const char *why = NULL;
        o[i].borrowed = NULL;
        o[i].at = len;
        if (dfs_encode(&w->codec, &w->payload, &len, raw, t->raw_bytes, dfl_dtype_size(t->dtype), &want, &why))
            return dfl_err(DFL_EX_SOFTWARE, "%s: tensor \"%s\": %s", w->path, t->name, why);
        o[i].stored = len - o[i].at;
        o[i].codec = want.codec;
        o[i].shuffle = want.shuffle;
    }
    checksum_encoded(w->payload.p, o, s->ntensors);
    return emit_sample(w, s->id, o, s->ntensors, w->payload.p);
}

/* ---- samples held in memory ---------------------------------------------- */

dfs_sample *dfs_sample_clone(const dfs_sample *s) {
    size_t idlen = strlen(s->id) + 1;
    uint64_t stored = 0;
    for (int i = 0; i < s->ntensors; i++) stored += s->t[i].stored_bytes;
    dfs_sample *c = dfl_malloc(sizeof *c + idlen + (size_t)stored);
    memcpy(c, s, sizeof *c);
    char *p = (char *)(c + 1);
    c->id = memcpy(p, s->id, idlen);
    p += idlen;
    for (int i = 0; i < s->ntensors; i++) {
        if (s->t[i].stored_bytes) memcpy(p, s->t[i].stored, s->t[i].stored_bytes);
        c->t[i].stored = p;
        c->t[i].data = NULL;
        p += s->t[i].stored_bytes;
    }
    return c;
}

uint64_t dfs_sample_size(const dfs_sample *s) {
    uint64_t n = sizeof *s + strlen(s->id) + 1;
    for (int i = 0; i < s->ntensors; i++) n += s->t[i].stored_bytes;
    return n;
}

void dfs_sample_free(dfs_sample *s) { free(s); }
