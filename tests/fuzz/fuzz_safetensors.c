/* fuzz_safetensors: the safetensors reader (lib/safetensors.c) on arbitrary
 * bytes.
 *
 * The reader only takes paths (it mmaps the file), so each input is written
 * to a memfd and opened as /proc/self/fd/N. When the input holds the
 * separator SEP, it is also split into a model directory in a private tmpfs
 * (or $TMPDIR) folder: part 0 is model.safetensors.index.json, part k >= 1 is
 * the shard "sK.safetensors", and dfl_st_open_dir reads it (the sharded path).
 *
 * Every input must give success or DFL_EX_DATA (and, for a directory whose
 * index names a shard that is not there, DFL_EX_NOINPUT). After a success
 * the harness checks, against the bytes it wrote, what the reader promises:
 * every tensor's bytes lie inside its file's data buffer, the tensors of a
 * file tile that buffer exactly (so they equal the file's bytes after the
 * header, in offset order), sizes agree with dtype and shape, names are
 * unique, and bf16/f16/f32 tensors convert. A violation abort()s.
 */
#include "common.h"
#include "fuzz_util.h"
#include "dtype.h"
#include "safetensors.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define SEP "\n@@shard@@\n"
#define MAX_SHARDS 8

typedef struct {
    const char *path;
    const uint8_t *bytes;
    size_t len;
} written;

typedef struct {
    const uint8_t *p;
    uint64_t n;
} piece;

static int piece_cmp(const void *a, const void *b) {
    const piece *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? -1 : 1;
    return x->n < y->n ? -1 : x->n > y->n;
}

/* The tensors of one written file tile its buffer: sorted by address they
 * are back to back, and together equal the bytes after the header. */
static void check_file(const dfl_st *st, const written *w) {
    FUZZ_CHECK(w->len >= 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | w->bytes[i];
    FUZZ_CHECK(hlen <= DFL_ST_MAX_HEADER && hlen + 8 <= w->len);
    uint64_t buf = w->len - 8 - hlen;
    int n = dfl_st_count(st), k = 0;
    piece *ps = calloc((size_t)n + 1, sizeof *ps);
    for (int i = 0; i < n; i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        if (strcmp(t->file, w->path)) continue;
        ps[k].p = t->data;
        ps[k].n = t->nbytes;
        k++;
    }
    qsort(ps, (size_t)k, sizeof *ps, piece_cmp);
    uint64_t total = 0;
    for (int i = 0; i < k; i++) {
        if (i) FUZZ_CHECK(ps[i].p == ps[i - 1].p + ps[i - 1].n);
        total += ps[i].n;
    }
    FUZZ_CHECK(total == buf);
    /* The bytes themselves: reading them also proves they are mapped. */
    const uint8_t *want = w->bytes + 8 + hlen;
    for (int i = 0; i < k; i++) {
        FUZZ_CHECK(memcmp(ps[i].p, want, ps[i].n) == 0);
        want += ps[i].n;
    }
    free(ps);
}

static void check_tensors(const dfl_st *st, const written *files, int nfiles) {
    int n = dfl_st_count(st);
    for (int i = 0; i < n; i++) {
        const dfl_st_tensor *t = dfl_st_at(st, i);
        FUZZ_CHECK(t->name && t->dtype_str && t->file);
        FUZZ_CHECK(strcmp(t->name, "__metadata__") != 0);
        FUZZ_CHECK(dfl_st_find(st, t->name) == t); /* names are unique */
        FUZZ_CHECK(t->ndim >= 0 && t->ndim <= DFL_ST_MAX_DIMS);
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            FUZZ_CHECK(t->shape[d] >= 0);
            FUZZ_CHECK(!__builtin_mul_overflow(numel, t->shape[d], &numel));
        }
        FUZZ_CHECK(numel == t->numel);
        if (t->dtype >= 0) {
            FUZZ_CHECK((uint64_t)numel * dfl_dtype_size((dfl_dtype)t->dtype) == t->nbytes);
            FUZZ_CHECK(!strcmp(dfl_st_dtype_str((dfl_dtype)t->dtype), t->dtype_str));
        }
        int known = 0;
        for (int f = 0; f < nfiles; f++) known |= !strcmp(t->file, files[f].path);
        FUZZ_CHECK(known);
        if (t->dtype == DFL_BF16 || t->dtype == DFL_F16 || t->dtype == DFL_F32) {
            const dfl_st_tensor *got;
            FUZZ_CHECK(dfl_st_get(st, t->name, t->ndim, t->shape, &got) == 0 && got == t);
            float *f = malloc((size_t)numel * sizeof *f + 1);
            dfl_st_to_f32(t, f);
            free(f);
        }
    }
    (void)dfl_st_meta(st, "format");
    const dfl_st_tensor *none;
    FUZZ_CHECK(dfl_st_get(st, "no such tensor \x01", 0, NULL, &none) == DFL_EX_DATA && !none);
}

/* ---- one file, through a memfd ---- */

static void fuzz_file(const uint8_t *data, size_t size) {
    char path[64];
    int fd = fuzz_memfd("fuzz_st", data, size, path, sizeof path);
    dfl_st *st = NULL;
    int rc = dfl_st_open(&st, path);
    if (rc == 0) {
        written w = {path, data, size};
        check_tensors(st, &w, 1);
        check_file(st, &w);
        dfl_st_close(st);
    } else {
        FUZZ_CHECK(rc == DFL_EX_DATA && st == NULL);
    }
    close(fd);
}

/* ---- a sharded model directory ---- */

static char st_dir[256];

static void remove_dir(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", st_dir);
    unlink(p);
    for (int k = 1; k <= MAX_SHARDS; k++) {
        snprintf(p, sizeof p, "%s/s%d.safetensors", st_dir, k);
        unlink(p);
    }
    rmdir(st_dir);
}

static int make_dir(void) {
    if (st_dir[0]) return 0;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(st_dir, sizeof st_dir, "%s/fuzz_st.XXXXXX", base);
    if (!mkdtemp(st_dir)) return -1;
    atexit(remove_dir);
    return 0;
}

static void write_all(const char *path, const uint8_t *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(p, 1, n, f) != n) abort();
    if (fclose(f)) abort();
}

/* Split the input at SEP into the index and shards of st_dir; returns the
 * number of parts written (w[k] describes part k). */
static int write_parts(const uint8_t *data, size_t size, char paths[][512], written *w) {
    if (make_dir()) abort();
    snprintf(paths[0], 512, "%s/model.safetensors.index.json", st_dir);
    size_t seplen = strlen(SEP);
    const uint8_t *at = data, *end = data + size;
    int nparts = 0;
    while (nparts <= MAX_SHARDS) {
        const uint8_t *s = memmem(at, (size_t)(end - at), SEP, seplen);
        const uint8_t *stop = s ? s : end;
        if (nparts) snprintf(paths[nparts], 512, "%s/s%d.safetensors", st_dir, nparts);
        w[nparts] = (written){paths[nparts], at, (size_t)(stop - at)};
        write_all(paths[nparts], at, (size_t)(stop - at));
        nparts++;
        if (!s) break;
        at = s + seplen;
    }
    return nparts;
}

static void fuzz_dir(const uint8_t *data, size_t size) {
    char paths[MAX_SHARDS + 1][512];
    written w[MAX_SHARDS + 1];
    int nparts = write_parts(data, size, paths, w);
    dfl_st *st = NULL;
    int rc = dfl_st_open_dir(&st, st_dir);
    if (rc == 0) {
        check_tensors(st, w, nparts);
        for (int k = 0; k < nparts; k++) {
            int used = 0;
            for (int i = 0; i < dfl_st_count(st); i++) used |= !strcmp(dfl_st_at(st, i)->file, w[k].path);
            if (used) check_file(st, &w[k]);
        }
        dfl_st_close(st);
    } else {
        FUZZ_CHECK((rc == DFL_EX_DATA || rc == DFL_EX_NOINPUT) && st == NULL);
    }
    for (int k = 0; k < nparts; k++) unlink(paths[k]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_file(data, size);
    if (size && memmem(data, size, SEP, strlen(SEP))) fuzz_dir(data, size);
    return 0;
}
