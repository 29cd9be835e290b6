/* dfs_pack_view.c: the read-only modes of dflash-pack: --inspect (JSON
 * lines), --stats (totals), --verify (every rule, every checksum, every
 * frame decoded) and --export (.npy files for numpy and PyTorch users). */
#include "dfs_pack.h"

#include "cli.h"
#include "common.h"
#include "outfile.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- shared ------------------------------------------------------------- */

/* A hidden-state meta is parsed into *hs (*is_hs set); 0 or an exit code. */
static int hs_meta_of(dfs_reader *r, dfs_hs_meta *hs, int *is_hs) {
    *is_hs = json_object_get(dfs_reader_meta(r), "target") != NULL;
    return *is_hs ? dfs_hs_meta_from_json(dfs_reader_meta(r), hs, dfs_reader_path(r)) : 0;
}

static int out_error(void) { return dfl_err(DFL_EX_IOERR, "stdout: write failed: %s", strerror(errno)); }

static int print_json(FILE *out, json_t *j) {
    int bad = json_dumpf(j, out, JSON_COMPACT) != 0 || fputc('\n', out) == EOF;
    json_decref(j);
    return bad ? out_error() : 0;
}

static const char *codec_name(dfs_codec c) { return c == DFS_CODEC_LZ4 ? "lz4" : "none"; }

static json_t *shape_json(const dfs_tensor *t) {
    json_t *a = json_array();
    for (int d = 0; d < t->ndim; d++) json_array_append_new(a, json_integer(t->shape[d]));
    return a;
}

/* Tokens of a sample: the length of its input_ids, or 0. */
static int64_t sample_tokens(dfs_sample *s) {
    dfs_tensor *t = dfs_find(s, "input_ids");
    return t && t->ndim == 1 ? t->shape[0] : 0;
}

/* ---- inspect ------------------------------------------------------------- */

static json_t *sample_json(const char *file, uint64_t index, dfs_sample *s) {
    json_t *ts = json_array();
    for (int i = 0; i < s->ntensors; i++) {
        const dfs_tensor *t = &s->t[i];
        char x[17];
        snprintf(x, sizeof x, "%016llx", (unsigned long long)t->checksum);
        json_array_append_new(ts, json_pack("{s:s, s:s, s:o, s:s, s:b, s:I, s:I, s:s}", "name", t->name, "dtype",
                                            dfl_dtype_name(t->dtype), "shape", shape_json(t), "codec",
                                            codec_name(t->codec), "shuffle", t->shuffle, "raw",
                                            (json_int_t)t->raw_bytes, "stored", (json_int_t)t->stored_bytes,
                                            "xxh64", x));
    }
    dfs_tensor *ids = dfs_find(s, "input_ids");
    return json_pack("{s:s, s:s, s:I, s:I, s:s, s:o, s:o}", "type", "sample", "file", file, "index",
                     (json_int_t)index, "offset", (json_int_t)s->offset, "id", s->id, "tokens",
                     ids ? json_integer(sample_tokens(s)) : json_null(), "tensors", ts);
}

int dfs_pack_inspect(const char *const *inputs, int n, int progress, FILE *out) {
    /* before the first line: a second "-" would read an empty stdin */
    if (dfs_pack_check_read_once(inputs, n)) return DFL_EX_USAGE;
    dfl_progress prog;
    uint64_t seen = 0;
    dfl_progress_init(&prog, progress, 0, "rec");
    for (int f = 0; f < n; f++) {
        dfs_reader *r;
        int rc = dfs_reader_open(&r, inputs[f]);
        if (rc) return rc;
        json_t *h = json_deep_copy(dfs_reader_header(r));
        json_object_set_new(h, "file", json_string(dfs_reader_path(r)));
        rc = print_json(out, h);
        dfs_sample *s;
        uint64_t index = 0;
        while (!rc && (rc = dfs_read(r, &s)) == 1) {
            rc = print_json(out, sample_json(dfs_reader_path(r), index++, s));
            dfl_progress_update(&prog, (double)++seen, NULL);
        }
        dfs_reader_close(r);
        if (rc) return rc;
    }
    dfl_progress_end(&prog, (double)seen, NULL);
    return 0;
}

/* ---- stats --------------------------------------------------------------- */

typedef struct {
    char     name[DFS_MAX_NAME + 1];
    dfl_dtype dtype;
    uint64_t raw, stored;
} tensor_total;

typedef struct {
    uint64_t files, segments, records, tokens, supervised, raw, stored;
    int      ntensors;
    tensor_total t[DFS_MAX_TENSORS * 4];
    dfl_progress prog; /* of the records counted */
} totals;

static void add_tensor(totals *tt, const dfs_tensor *t) {
    tt->raw += t->raw_bytes;
    tt->stored += t->stored_bytes;
    for (int i = 0; i < tt->ntensors; i++)
        if (!strcmp(tt->t[i].name, t->name)) {
            tt->t[i].raw += t->raw_bytes;
            tt->t[i].stored += t->stored_bytes;
            return;
        }
    if (tt->ntensors == (int)(sizeof tt->t / sizeof tt->t[0])) return; /* per-name table full: totals still count */
    tensor_total *n = &tt->t[tt->ntensors++];
    snprintf(n->name, sizeof n->name, "%s", t->name);
    n->dtype = t->dtype;
    n->raw = t->raw_bytes;
    n->stored = t->stored_bytes;
}

static double ratio(uint64_t raw, uint64_t stored) { return stored ? (double)raw / (double)stored : 0; }

static int stats_add_file(dfs_reader *r, void *ctx) {
    totals *tt = ctx;
    int rc;
    dfs_sample *s;
    while ((rc = dfs_read(r, &s)) == 1) {
        dfl_progress_update(&tt->prog, (double)++tt->records, NULL);
        tt->tokens += (uint64_t)sample_tokens(s);
        for (int i = 0; i < s->ntensors; i++) add_tensor(tt, &s->t[i]);
        dfs_tensor *m = dfs_find(s, "loss_mask");
        if (m && m->dtype == DFL_U8) {
            if ((rc = dfs_decode(r, m))) break;
            const uint8_t *v = m->data;
            for (uint64_t i = 0; i < m->raw_bytes; i++) tt->supervised += v[i];
        }
    }
    tt->files++;
    tt->segments += (uint64_t)dfs_reader_segments(r);
    return rc;
}

static int stats_print_json(const totals *tt, FILE *out) {
    json_t *per = json_object();
    for (int i = 0; i < tt->ntensors; i++)
        json_object_set_new(per, tt->t[i].name,
                            json_pack("{s:s, s:I, s:I, s:f}", "dtype", dfl_dtype_name(tt->t[i].dtype), "raw_bytes",
                                      (json_int_t)tt->t[i].raw, "stored_bytes", (json_int_t)tt->t[i].stored, "ratio",
                                      ratio(tt->t[i].raw, tt->t[i].stored)));
    json_t *j = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:o}", "files", (json_int_t)tt->files, "segments",
                          (json_int_t)tt->segments, "records", (json_int_t)tt->records, "tokens",
                          (json_int_t)tt->tokens, "supervised_tokens", (json_int_t)tt->supervised, "raw_bytes",
                          (json_int_t)tt->raw, "stored_bytes", (json_int_t)tt->stored, "ratio",
                          ratio(tt->raw, tt->stored), "tensors", per);
    return print_json(out, j);
}

static void stats_print_text(const totals *tt, FILE *out) {
    fprintf(out, "%-18s %llu\n%-18s %llu\n%-18s %llu\n%-18s %llu\n%-18s %llu\n%-18s %llu\n%-18s %llu\n%-18s %.3f\n",
            "files", (unsigned long long)tt->files, "segments", (unsigned long long)tt->segments, "records",
            (unsigned long long)tt->records, "tokens", (unsigned long long)tt->tokens, "supervised tokens",
            (unsigned long long)tt->supervised, "raw bytes", (unsigned long long)tt->raw, "stored bytes",
            (unsigned long long)tt->stored, "ratio", ratio(tt->raw, tt->stored));
    if (!tt->ntensors) return;
    fprintf(out, "\n%-20s %-5s %16s %16s %7s\n", "tensor", "dtype", "raw bytes", "stored bytes", "ratio");
    for (int i = 0; i < tt->ntensors; i++)
        fprintf(out, "%-20s %-5s %16llu %16llu %7.3f\n", tt->t[i].name, dfl_dtype_name(tt->t[i].dtype),
                (unsigned long long)tt->t[i].raw, (unsigned long long)tt->t[i].stored,
                ratio(tt->t[i].raw, tt->t[i].stored));
}

int dfs_pack_stats(const char *const *inputs, int n, int as_json, int progress, FILE *out) {
    totals *tt = dfl_calloc(1, sizeof *tt);
    dfl_progress_init(&tt->prog, progress, 0, "rec");
    /* one table of totals: the inputs must agree */
    int rc = dfs_pack_each_input(inputs, n, 0, stats_add_file, tt);
    if (!rc) dfl_progress_end(&tt->prog, (double)tt->records, NULL);
    if (!rc && as_json) rc = stats_print_json(tt, out);
    else if (!rc) stats_print_text(tt, out);
    free(tt);
    return rc;
}

/* ---- verify -------------------------------------------------------------- */

typedef struct {
    uint64_t     total; /* records verified */
    dfl_progress prog;
} verify_ctx;

static int verify_input(dfs_reader *r, void *ctx) {
    verify_ctx *v = ctx;
    dfs_hs_meta hs;
    int is_hs, rc = hs_meta_of(r, &hs, &is_hs);
    dfs_sample *s;
    while (!rc && (rc = dfs_read(r, &s)) == 1) {
        rc = 0;
        for (int i = 0; i < s->ntensors && !rc; i++) rc = dfs_decode(r, &s->t[i]);
        if (!rc && is_hs) rc = dfs_hs_check_sample(&hs, s, dfs_reader_path(r));
        if (!rc) dfl_progress_update(&v->prog, (double)++v->total, NULL);
    }
    return rc;
}

int dfs_pack_verify(const char *const *inputs, int n, int progress, FILE *out) {
    verify_ctx v = {0};
    dfl_progress_init(&v.prog, progress, 0, "rec");
    /* Inputs that merging would refuse are not a valid whole (nor is their
     * concatenation, which the reader refuses): the same check here. */
    int rc = dfs_pack_each_input(inputs, n, 0, verify_input, &v);
    if (rc) return rc;
    dfl_progress_end(&v.prog, (double)v.total, NULL);
    if (fprintf(out, "OK %llu records\n", (unsigned long long)v.total) < 0) return out_error();
    return 0;
}

/* ---- export ---------------------------------------------------------------- */

/* Keep letters, digits, '.', '_' and '-'; anything else (and a leading '.',
 * so no "..") becomes '_'; at most 80 bytes. */
static void sanitise(char *dst, const char *src, size_t cap) {
    size_t k = 0;
    for (; src[k] && k + 1 < cap && k < 80; k++) {
        char c = src[k];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                 (c == '.' && k > 0);
        dst[k] = ok ? c : '_';
    }
    dst[k] = 0;
}

/* numpy's descr for each dtype; bf16 is exported as float32 (exact). */
static const char *npy_descr(dfl_dtype t) {
    switch (t) {
    case DFL_BF16: return "<f4";
    case DFL_F16: return "<f2";
    case DFL_F32: return "<f4";
    case DFL_I32: return "<i4";
    case DFL_I64: return "<i8";
    case DFL_U8: return "|u1";
    default: return "|u1";
    }
}

/* .npy v1.0: magic, version, u16 header length, a dict literal padded with
 * spaces to a multiple of 64 bytes and ended by '\n', then the data. */
static int write_npy(const char *path, const dfs_tensor *t) {
    char shape[256] = "(";
    size_t k = 1;
    for (int d = 0; d < t->ndim; d++)
        k += (size_t)snprintf(shape + k, sizeof shape - k, "%lld,%s", (long long)t->shape[d],
                              d + 1 < t->ndim ? " " : "");
    if (t->ndim > 1) shape[--k] = 0; /* "(2, 3)" not "(2, 3,)"; "(5,)" keeps its comma */
    snprintf(shape + k, sizeof shape - k, ")");
    char head[512];
    int n = snprintf(head, sizeof head, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", npy_descr(t->dtype),
                     shape);
    int total = 10 + n + 1, pad = (64 - total % 64) % 64;
    memset(head + n, ' ', (size_t)pad);
    head[n + pad] = '\n';
    uint16_t hl = (uint16_t)(n + pad + 1);
    dfl_out *o;
    int rc = dfl_out_open_staged(&o, path, 1);
    if (rc) return rc;
    FILE *f = dfl_out_file(o);
    fwrite("\x93NUMPY\x01\x00", 1, 8, f);
    uint8_t le[2] = {(uint8_t)hl, (uint8_t)(hl >> 8)};
    fwrite(le, 1, 2, f);
    fwrite(head, 1, hl, f);
    if (t->dtype == DFL_BF16) {
        const uint16_t *v = t->data;
        uint64_t cnt = t->raw_bytes / 2;
        float buf[4096];
        for (uint64_t i = 0; i < cnt; i += 4096) {
            size_t m = cnt - i < 4096 ? (size_t)(cnt - i) : 4096;
            for (size_t j = 0; j < m; j++) buf[j] = dfl_bf16_to_f32(v[i + j]);
            fwrite(buf, 4, m, f);
        }
    } else {
        fwrite(t->data, 1, t->raw_bytes, f);
    }
    return dfl_out_commit(o);
}

/* A record directory, in the export's temporary directory: new, so one
 * that exists already is an error (two records of one index cannot be). */
static int make_dir(const char *path) {
    if (mkdir(path, 0777) == 0) return 0; /* less the umask, as mkdir(1) */
    return dfl_err(DFL_EX_CANTCREAT, "%s: cannot create directory: %s", path, strerror(errno));
}

static int export_header(dfs_reader *r, const char *dir) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/stream.json", dir);
    dfl_out *o;
    int rc = dfl_out_open_staged(&o, path, 0);
    if (rc) return rc;
    json_dumpf(dfs_reader_header(r), dfl_out_file(o), JSON_INDENT(2));
    fputc('\n', dfl_out_file(o));
    return dfl_out_commit(o);
}

/* The file names of s's tensors. Two tensor names can reduce to one
 * ("a/b" and "a_b"): refused, since one file would silently replace the
 * other, and a renamed one would no longer say which tensor it holds. */
static int export_names(dfs_reader *r, const dfs_sample *s, char (*names)[96]) {
    for (int i = 0; i < s->ntensors; i++) {
        sanitise(names[i], s->t[i].name, sizeof names[i]);
        for (int j = 0; j < i; j++)
            if (!strcmp(names[i], names[j]))
                return dfs_sample_err(dfs_reader_path(r), s->offset, s->record, s->id,
                                      "tensors \"%s\" and \"%s\" would both be exported as %s.npy", s->t[j].name,
                                      s->t[i].name, names[i]);
    }
    return 0;
}

static int export_sample(dfs_reader *r, dfs_sample *s, const char *dir, uint64_t index) {
    char id[96], sub[PATH_MAX], names[DFS_MAX_TENSORS][96];
    int rc = export_names(r, s, names);
    if (rc) return rc;
    sanitise(id, s->id, sizeof id);
    snprintf(sub, sizeof sub, "%s/%06llu-%s", dir, (unsigned long long)index, id);
    rc = make_dir(sub);
    for (int i = 0; i < s->ntensors && !rc; i++) {
        char path[PATH_MAX + 128], name[sizeof names[i]];
        memcpy(name, names[i], sizeof name); /* a length gcc's format check can bound */
        snprintf(path, sizeof path, "%s/%s.npy", sub, name);
        rc = dfs_decode(r, &s->t[i]);
        if (!rc) rc = write_npy(path, &s->t[i]);
    }
    return rc;
}

/* A record directory's name, as export_sample makes it: at least 6
 * digits, '-', then the id as sanitise() leaves it (possibly empty). */
static int is_record_dir(const char *name) {
    size_t k = 0;
    while (name[k] >= '0' && name[k] <= '9') k++;
    if (k < 6 || name[k] != '-') return 0;
    char id[96];
    sanitise(id, name + k + 1, sizeof id);
    return !strcmp(id, name + k + 1);
}

/* What an earlier export holds, and so all that a new one may replace:
 * stream.json and record directories of .npy files. */
static const char *const export_files[] = {"stream.json", NULL};
static const dfl_dir_layout export_layout = {export_files, is_record_dir, ".npy"};

/* Digits in the decimal form of n. */
static int decimal_digits(uint64_t n) {
    int k = 1;
    while (n >= 10) n /= 10, k++;
    return k;
}

/* The names in `dir` of the record directories narrower than `width`, read
 * whole before any is renamed: a directory renamed while it is being read
 * may be listed again, or another one not at all (readdir(3)). */
static char **narrow_record_dirs(const char *dir, int width, size_t *count) {
    DIR *d = opendir(dir);
    if (!d) return NULL;
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!is_record_dir(e->d_name) || (int)strspn(e->d_name, "0123456789") >= width) continue;
        if (n == cap) names = dfl_realloc(names, (cap = cap ? 2 * cap : 1024) * sizeof *names);
        names[n++] = dfl_strdup(e->d_name);
    }
    closedir(d);
    *count = n;
    return names ? names : dfl_calloc(1, sizeof *names);
}

int dfs_export_pad_indices(const char *dir, uint64_t records) {
    int width = records ? decimal_digits(records - 1) : 1;
    if (width <= 6) return 0;
    size_t n = 0;
    char **names = narrow_record_dirs(dir, width, &n);
    if (!names) return dfl_err(DFL_EX_CANTCREAT, "%s: cannot read directory: %s", dir, strerror(errno));
    char from[PATH_MAX + 256], to[PATH_MAX + 256];
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        if (!rc) {
            int pad = width - (int)strspn(names[i], "0123456789");
            snprintf(from, sizeof from, "%s/%s", dir, names[i]);
            snprintf(to, sizeof to, "%s/%0*d%s", dir, pad, 0, names[i]);
            if (rename(from, to) != 0)
                rc = dfl_err(DFL_EX_CANTCREAT, "%s: cannot rename to %s: %s", from, to, strerror(errno));
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

typedef struct {
    const char  *dir;   /* the temporary directory being filled */
    uint64_t     index; /* records exported so far */
    int          started;
    dfl_progress prog;
} export_ctx;

static int export_input(dfs_reader *r, void *ctx) {
    export_ctx *x = ctx;
    int rc = 0;
    if (!x->started) { /* the first input: every input has been checked by now */
        x->started = 1;
        rc = export_header(r, x->dir);
    }
    dfs_sample *s;
    while (!rc && (rc = dfs_read(r, &s)) == 1) {
        rc = export_sample(r, s, x->dir, x->index++);
        dfl_progress_update(&x->prog, (double)x->index, NULL);
    }
    return rc;
}

/* The export is written into a temporary directory beside DIR
 * (".DIR.tmp.XXXXXX", removed on an error or a signal) and put in place
 * only when every record is in it, so DIR is never a partial export nor
 * a mix of an earlier, larger one and this one. DIR is checked first,
 * before any input is read: it may be absent, empty or an earlier export,
 * which is replaced whole (see dfl_tmpdir_commit_layout for the one crash
 * window: the old export left under a hidden name beside the new one). */
int dfs_pack_export(const char *const *inputs, int n, const char *dir, int progress) {
    int rc = dfl_tmpdir_check_layout(dir, &export_layout);
    if (rc) return rc;
    char tmp[PATH_MAX];
    if ((rc = dfl_tmpdir_create_layout(dir, tmp, sizeof tmp, &export_layout))) return rc;
    export_ctx x = {tmp, 0, 0, {0}};
    dfl_progress_init(&x.prog, progress, 0, "rec");
    /* One stream.json describes every record: the inputs must agree, and
     * are all checked before anything is written. */
    rc = dfs_pack_each_input(inputs, n, 1, export_input, &x);
    if (!rc) rc = dfs_export_pad_indices(tmp, x.index);
    if (!rc) rc = dfl_tmpdir_commit_layout(tmp, dir, &export_layout);
    if (rc) {
        rc = dfl_tmpdir_name_err(rc, tmp, dir);
        dfl_tmpdir_abort(tmp);
        return rc;
    }
    dfl_progress_end(&x.prog, (double)x.index, NULL);
    return 0;
}
