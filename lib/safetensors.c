/* safetensors.c: validated mmap reader and deterministic writer. */
#include "safetensors.h"

#include "common.h"
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char    *path;
    void    *map;
    size_t   size;
    json_t  *header;
} st_file;

typedef struct {
    const char *name;
    int         idx;            /* in dfl_st.t */
} st_name;

struct dfl_st {
    char          *index;       /* model.safetensors.index.json of a sharded model, or NULL */
    int            nfiles;
    st_file       *files;
    int            n;
    dfl_st_tensor *t;
    st_name       *by_name;     /* the tensors in name order, once every header is read (NULL before) */
};

/* Every dtype string of the format; those dflash computes with map to a dfl_dtype. */
static const struct {
    const char *s;
    int dtype;
    int bits;
} st_dtypes[] = {
    {"BF16", DFL_BF16, 16}, {"F16", DFL_F16, 16}, {"F32", DFL_F32, 32}, {"I32", DFL_I32, 32},
    {"I64", DFL_I64, 64},   {"U8", DFL_U8, 8},    {"BOOL", -1, 8},      {"I8", -1, 8},
    {"I16", -1, 16},        {"U16", -1, 16},      {"U32", -1, 32},      {"U64", -1, 64},
    {"F64", -1, 64},        {"C64", -1, 64},      {"F8_E5M2", -1, 8},   {"F8_E4M3", -1, 8},
    {"F8_E8M0", -1, 8},     {"F8_E4M3FNUZ", -1, 8}, {"F8_E5M2FNUZ", -1, 8}, {"F4", -1, 4},
    {"F6_E2M3", -1, 6},     {"F6_E3M2", -1, 6},
};

const char *dfl_st_dtype_str(dfl_dtype t) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (st_dtypes[i].dtype == (int)t) return st_dtypes[i].s;
    return "?";
}

static int find_dtype(const char *s, int *dtype, int *bits) {
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (!strcmp(st_dtypes[i].s, s)) {
            *dtype = st_dtypes[i].dtype;
            *bits = st_dtypes[i].bits;
            return 0;
        }
    return -1;
}

static int map_file(st_file *f, const char *path) {
    int fd;
    struct stat st;
    int rc = dfl_open_regular(path, &fd, &st); /* a FIFO in a file's place refused, not waited on */
    if (rc) return rc;
    f->path = dfl_strdup(path);
    f->size = (size_t)st.st_size;
    if (f->size < 8) {
        close(fd);
        return dfl_err(DFL_EX_DATA, "%s: truncated: %zu bytes, no header length", path, f->size);
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        return dfl_err(DFL_EX_IOERR, "%s: mmap failed: %s", path, strerror(errno));
    }
    return 0;
}

typedef struct {
    uint64_t begin, end;
    int idx;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Parse one tensor entry; fills t (pointing into the header's strings). */
static int parse_entry(const char *path, const char *name, json_t *v, dfl_st_tensor *t, uint64_t *b, uint64_t *e) {
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"), *jo = json_object_get(v, "data_offsets");
    if (!json_is_object(v) || !json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) || json_array_size(jo) != 2)
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s': needs dtype, shape and data_offsets [begin, end]", path, name);
    int dtype, bits;
    if (find_dtype(json_string_value(jd), &dtype, &bits))
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s': unknown dtype '%s'", path, name, json_string_value(jd));
    size_t nd = json_array_size(js);
    if (nd > DFL_ST_MAX_DIMS) return dfl_err(DFL_EX_DATA, "%s: tensor '%s': %zu dims (max %d)", path, name, nd, DFL_ST_MAX_DIMS);
    uint64_t numel = 1;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return dfl_err(DFL_EX_DATA, "%s: tensor '%s': shape[%zu] is not a non-negative integer", path, name, i);
        t->shape[i] = json_integer_value(d);
        if (dfl_mul_overflow(numel, (uint64_t)t->shape[i], &numel))
            return dfl_err(DFL_EX_DATA, "%s: tensor '%s': shape overflows", path, name);
    }
    json_t *j0 = json_array_get(jo, 0), *j1 = json_array_get(jo, 1);
    if (!json_is_integer(j0) || !json_is_integer(j1) || json_integer_value(j0) < 0 || json_integer_value(j1) < json_integer_value(j0))
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s': bad data_offsets", path, name);
    *b = (uint64_t)json_integer_value(j0);
    *e = (uint64_t)json_integer_value(j1);
    uint64_t nbits;
    if (dfl_mul_overflow(numel, (uint64_t)bits, &nbits) || nbits % 8)
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s': size is not a whole number of bytes", path, name);
    if (*e - *b != nbits / 8)
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s': data_offsets span %llu bytes, shape and dtype need %llu",
                       path, name, (unsigned long long)(*e - *b), (unsigned long long)(nbits / 8));
    t->name = name;
    t->dtype = dtype;
    t->dtype_str = json_string_value(jd);
    t->ndim = (int)nd;
    t->numel = (int64_t)numel;
    t->nbytes = *e - *b;
    t->file = path;
    return 0;
}

/* Validate the header of f and append its tensors to st. */
static int load_header(dfl_st *st, st_file *f) {
    const unsigned char *p = f->map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | p[i];
    if (n > DFL_ST_MAX_HEADER) return dfl_err(DFL_EX_DATA, "%s: header length %llu exceeds the 100 MB limit", f->path, (unsigned long long)n);
    /* the 8 bytes of the length come first: a file of exactly n bytes is short by 8 */
    if (n + 8 > f->size)
        return dfl_err(DFL_EX_DATA, "%s: truncated: header length %llu needs %llu bytes with its 8-byte prefix, the file has %zu",
                       f->path, (unsigned long long)n, (unsigned long long)n + 8, f->size);
    if (n < 2 || p[8] != '{') return dfl_err(DFL_EX_DATA, "%s: header is not a JSON object", f->path);
    json_error_t je;
    f->header = json_loadb((const char *)p + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    if (!f->header || !json_is_object(f->header))
        return dfl_err(DFL_EX_DATA, "%s: header JSON: %s at byte %d", f->path, f->header ? "not an object" : je.text, je.position);
    uint64_t buf_size = f->size - 8 - n;
    size_t count = json_object_size(f->header);
    span *spans = dfl_calloc(count, sizeof *spans);
    int ns = 0, rc = 0;
    st->t = dfl_realloc(st->t, sizeof(dfl_st_tensor) * (size_t)(st->n + (int)count));
    const char *key;
    json_t *v;
    json_object_foreach(f->header, key, v) {
        if (!strcmp(key, "__metadata__")) {
            if (!json_is_object(v)) { rc = dfl_err(DFL_EX_DATA, "%s: __metadata__ is not an object", f->path); break; }
            continue;
        }
        dfl_st_tensor *t = &st->t[st->n];
        memset(t, 0, sizeof *t);
        if ((rc = parse_entry(f->path, key, v, t, &spans[ns].begin, &spans[ns].end))) break;
        t->data = p + 8 + n + spans[ns].begin;
        spans[ns].idx = st->n++;
        ns++;
    }
    if (!rc) {
        qsort(spans, (size_t)ns, sizeof *spans, span_cmp);
        uint64_t at = 0;
        for (int i = 0; i < ns && !rc; i++) {
            if (spans[i].begin != at)
                rc = dfl_err(DFL_EX_DATA, "%s: tensor '%s': data_offsets [%llu, %llu] %s", f->path, st->t[spans[i].idx].name,
                             (unsigned long long)spans[i].begin, (unsigned long long)spans[i].end,
                             spans[i].begin < at ? "overlap the previous tensor" : "leave a gap after the previous tensor");
            at = spans[i].end;
        }
        if (!rc && at != buf_size)
            rc = dfl_err(DFL_EX_DATA, "%s: %s: tensors cover %llu bytes of a %llu-byte buffer", f->path,
                         at > buf_size ? "truncated" : "trailing bytes", (unsigned long long)at, (unsigned long long)buf_size);
    }
    free(spans);
    return rc;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(((const st_name *)a)->name, ((const st_name *)b)->name);
}

/* The name index dfl_st_find searches (a MoE checkpoint has ~10^4-10^5
 * tensors: one scan of them per lookup is quadratic over a load). A name
 * in two shards sorts next to itself: its position is returned in *dup
 * (else -1). */
static void build_index(dfl_st *st, int *dup) {
    st->by_name = dfl_malloc((size_t)(st->n ? st->n : 1) * sizeof *st->by_name);
    for (int i = 0; i < st->n; i++) st->by_name[i] = (st_name){st->t[i].name, i};
    qsort(st->by_name, (size_t)st->n, sizeof *st->by_name, name_cmp);
    *dup = -1;
    for (int i = 1; i < st->n && *dup < 0; i++)
        if (!strcmp(st->by_name[i - 1].name, st->by_name[i].name)) *dup = i;
}

static void add_file(dfl_st *st, st_file **f) {
    st->files = dfl_realloc(st->files, sizeof(st_file) * (size_t)(st->nfiles + 1));
    *f = &st->files[st->nfiles++];
    memset(*f, 0, sizeof **f);
}

int dfl_st_open(dfl_st **out, const char *path) {
    dfl_st *st = dfl_calloc(1, sizeof *st);
    st_file *f;
    add_file(st, &f);
    int rc = map_file(f, path);
    if (!rc) rc = load_header(st, f);
    if (!rc) {
        int dup; /* none: the header's JSON has no duplicate keys */
        build_index(st, &dup);
    }
    if (rc) {
        dfl_st_close(st);
        st = NULL;
    }
    *out = st;
    return rc;
}

static int check_unique_names(dfl_st *st, const char *index_path) {
    int dup;
    build_index(st, &dup);
    if (dup < 0) return 0;
    const dfl_st_tensor *a = &st->t[st->by_name[dup - 1].idx], *b = &st->t[st->by_name[dup].idx];
    /* the shard opened first, named first */
    if (a > b) {
        const dfl_st_tensor *x = a;
        a = b;
        b = x;
    }
    return dfl_err(DFL_EX_DATA, "%s: tensor '%s' is in two shards: %s and %s", index_path, b->name, a->file, b->file);
}

static int open_index(dfl_st *st, const char *dir, const char *index_path) {
    json_t *idx;
    /* an index is smaller than the headers it indexes */
    int rc = dfl_load_json(index_path, DFL_ST_MAX_HEADER, "safetensors index", &idx);
    if (rc) return rc;
    json_t *wm = json_object_get(idx, "weight_map");
    st->index = dfl_strdup(index_path);
    if (!json_is_object(wm)) rc = dfl_err(DFL_EX_DATA, "%s: no \"weight_map\" object", index_path);
    const char *name;
    json_t *v;
    /* Open each distinct shard once, in order of first appearance. */
    json_object_foreach(wm, name, v) {
        if (rc) break;
        const char *shard = json_string_value(v);
        if (!shard || strchr(shard, '/')) { rc = dfl_err(DFL_EX_DATA, "%s: weight_map[\"%s\"] is not a file name", index_path, name); break; }
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", dir, shard);
        int seen = 0;
        for (int i = 0; i < st->nfiles; i++) seen |= !strcmp(st->files[i].path, path);
        if (seen) continue;
        st_file *f;
        add_file(st, &f);
        if (!(rc = map_file(f, path))) rc = load_header(st, f);
    }
    /* A name in two shards would be found in the first and shadow the other. */
    if (!rc) rc = check_unique_names(st, index_path);
    /* Every tensor the index names must be in the shard it names. */
    json_object_foreach(wm, name, v) {
        if (rc) break;
        const dfl_st_tensor *t = dfl_st_find(st, name);
        const char *slash = t ? strrchr(t->file, '/') : NULL;
        if (!t || strcmp(slash ? slash + 1 : t->file, json_string_value(v)))
            rc = dfl_err(DFL_EX_DATA, "%s: tensor '%s' is not in shard %s", index_path, name, json_string_value(v));
    }
    json_decref(idx);
    return rc;
}

int dfl_st_open_dir(dfl_st **out, const char *dir) {
    char path[PATH_MAX];
    struct stat sb;
    if (stat(dir, &sb) != 0) return dfl_err(DFL_EX_NOINPUT, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return dfl_st_open(out, dir);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (access(path, R_OK) == 0) {
        dfl_st *st = dfl_calloc(1, sizeof *st);
        int rc = open_index(st, dir, path);
        if (rc) {
            dfl_st_close(st);
            st = NULL;
        }
        *out = st;
        return rc;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (access(path, R_OK) != 0)
        return dfl_err(DFL_EX_NOINPUT, "%s: neither model.safetensors nor model.safetensors.index.json", dir);
    return dfl_st_open(out, path);
}

void dfl_st_close(dfl_st *st) {
    if (!st) return;
    for (int i = 0; i < st->nfiles; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        json_decref(st->files[i].header);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->t);
    free(st->by_name);
    free(st->index);
    free(st);
}

int dfl_st_count(const dfl_st *st) { return st->n; }
const dfl_st_tensor *dfl_st_at(const dfl_st *st, int i) { return &st->t[i]; }

const dfl_st_tensor *dfl_st_find(const dfl_st *st, const char *name) {
    if (!st->by_name) { /* headers still being read */
        for (int i = 0; i < st->n; i++)
            if (!strcmp(st->t[i].name, name)) return &st->t[i];
        return NULL;
    }
    int lo = 0, hi = st->n; /* binary search of [lo, hi) */
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(st->by_name[mid].name, name);
        if (!c) return &st->t[st->by_name[mid].idx];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static void shape_str(char *buf, size_t n, int nd, const int64_t *s) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < nd && k < n; i++) k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* dfl_st_get, or with u8 set dfl_st_get_u8 */
static int get_checked(const dfl_st *st, const char *name, int ndim, const int64_t *shape, int u8,
                       const dfl_st_tensor **out) {
    const dfl_st_tensor *t = dfl_st_find(st, name);
    *out = NULL;
    /* a sharded model's tensor missing from every shard: the index is the table of contents */
    const char *where = st->index ? st->index : st->nfiles ? st->files[0].path : "safetensors";
    if (!t) return dfl_err(DFL_EX_DATA, "%s: tensor '%s' is missing", where, name);
    if (u8 && t->dtype != DFL_U8)
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s' has dtype %s; expected U8", t->file, name, t->dtype_str);
    if (!u8 && t->dtype != DFL_BF16 && t->dtype != DFL_F16 && t->dtype != DFL_F32)
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s' has dtype %s; expected BF16, F16 or F32", t->file, name, t->dtype_str);
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        char want[128], got[128];
        shape_str(want, sizeof want, ndim, shape);
        shape_str(got, sizeof got, t->ndim, t->shape);
        return dfl_err(DFL_EX_DATA, "%s: tensor '%s' has shape %s; expected %s", t->file, name, got, want);
    }
    *out = t;
    return 0;
}

int dfl_st_get(const dfl_st *st, const char *name, int ndim, const int64_t *shape, const dfl_st_tensor **out) {
    return get_checked(st, name, ndim, shape, 0, out);
}

int dfl_st_get_u8(const dfl_st *st, const char *name, int ndim, const int64_t *shape, const dfl_st_tensor **out) {
    return get_checked(st, name, ndim, shape, 1, out);
}

const char *dfl_st_meta(const dfl_st *st, const char *key) {
    if (!st->nfiles) return NULL;
    json_t *m = json_object_get(st->files[0].header, "__metadata__");
    return json_string_value(json_object_get(m, key));
}

void dfl_st_to_f32(const dfl_st_tensor *t, float *out) { dfl_st_range_to_f32(t, 0, t->numel, out); }

/* OCP MX FP4 (E2M1): sign, two exponent bits, one mantissa bit */
static const float fp4_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Into f32 (of) or bf16 (ob). Every MXFP4 value, 2 significant bits times
 * a power of two, is a bf16 value (subnormals included: their bits stay in
 * the top half of the f32), so the bf16 is exact too. */
static void mxfp4_decode(const uint8_t *blocks, const uint8_t *scales, int64_t nblocks, float *of, uint16_t *ob) {
    #pragma omp parallel for schedule(static) if (nblocks > 1 << 12)
    for (int64_t b = 0; b < nblocks; b++) {
        const int e = (int)scales[b] - 127; /* E8M0: a power of two */
        const uint8_t *q = blocks + 16 * b;
        for (int j = 0; j < 32; j++) { /* the low nibble is the first of the two values */
            const float v = ldexpf(fp4_e2m1[j & 1 ? q[j / 2] >> 4 : q[j / 2] & 15], e);
            if (of) of[32 * b + j] = v;
            else ob[32 * b + j] = dfl_f32_to_bf16(v);
        }
    }
}

void dfl_mxfp4_to_f32(const uint8_t *blocks, const uint8_t *scales, int64_t nblocks, float *out) {
    mxfp4_decode(blocks, scales, nblocks, out, NULL);
}

void dfl_mxfp4_to_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t nblocks, uint16_t *out) {
    mxfp4_decode(blocks, scales, nblocks, NULL, out);
}

void dfl_st_range_to_f32(const dfl_st_tensor *t, int64_t off, int64_t n, float *out) {
    DFL_ASSERT(off >= 0 && n >= 0 && off + n <= t->numel);
    const unsigned char *p = (const unsigned char *)t->data + (size_t)off * dfl_dtype_size((dfl_dtype)t->dtype);
    if (t->dtype == DFL_F32) {
        memcpy(out, p, (size_t)n * 4);
    } else if (t->dtype == DFL_BF16) {
        #pragma omp parallel for schedule(static) if (n > 1 << 16)
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = dfl_bf16_to_f32(h);
        }
    } else {
        DFL_ASSERT(t->dtype == DFL_F16);
        #pragma omp parallel for schedule(static) if (n > 1 << 16)
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = dfl_f16_to_f32(h);
        }
    }
}

/* ---- writing ---- */

static int write_order(const void *a, const void *b) {
    const dfl_st_in *x = *(const dfl_st_in *const *)a, *y = *(const dfl_st_in *const *)b;
    size_t sx = dfl_dtype_size(x->dtype), sy = dfl_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

static uint64_t tensor_bytes(const dfl_st_in *t) {
    uint64_t n = dfl_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n;
}

int dfl_st_write(const char *path, const dfl_st_in *t, int n, const json_t *metadata) {
    const dfl_st_in **order = dfl_calloc((size_t)n, sizeof *order);
    for (int i = 0; i < n; i++) order[i] = &t[i];
    qsort(order, (size_t)n, sizeof *order, write_order);
    json_t *h = json_object();
    if (metadata) json_object_set(h, "__metadata__", (json_t *)metadata);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        json_t *e = json_object(), *shape = json_array();
        for (int d = 0; d < order[i]->ndim; d++) json_array_append_new(shape, json_integer(order[i]->shape[d]));
        uint64_t nb = tensor_bytes(order[i]);
        json_object_set_new(e, "dtype", json_string(dfl_st_dtype_str(order[i]->dtype)));
        json_object_set_new(e, "shape", shape);
        json_object_set_new(e, "data_offsets", json_pack("[II]", (json_int_t)at, (json_int_t)(at + nb)));
        json_object_set_new(h, order[i]->name, e);
        at += nb;
    }
    char *text = json_dumps(h, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(h);
    size_t len = strlen(text), padded = (len + 7) / 8 * 8;
    dfl_out *o;
    int rc = dfl_out_open(&o, path, 1);
    if (!rc) {
        FILE *f = dfl_out_file(o);
        unsigned char le[8];
        for (int i = 0; i < 8; i++) le[i] = (unsigned char)((uint64_t)padded >> (8 * i));
        fwrite(le, 1, 8, f);
        fwrite(text, 1, len, f);
        for (size_t i = len; i < padded; i++) fputc(' ', f);
        for (int i = 0; i < n; i++) fwrite(order[i]->data, 1, tensor_bytes(order[i]), f);
        rc = dfl_out_commit(o);
    }
    free(text);
    free(order);
    return rc;
}
