/* dfs_bench: single-thread throughput of the DFS writer and reader (and
 * both on every thread: the writer as dflash-extract encodes records, several
 * at once, and as dflash-pack does, a large tensor's LZ4 blocks at once; the
 * reader decoding a large tensor's blocks at once).
 *
 *   dfs_bench STREAM
 *
 * Loads every sample of STREAM (decoded) into memory, then for each encoding
 * (none, lz4, lz4 + byte shuffle) writes them all to a memory buffer and
 * reads them back from it, timing both: write = encode + checksum + header;
 * read = parse + verify checksums; decode = read + decompress + unshuffle
 * into the reader's aligned buffers. Throughput is raw tensor bytes per
 * second, the best of 3 runs (as lz4 -b and zstd -b report). The ratio is
 * raw / stored over all tensors, and for "hidden" alone.
 * Prints one tab-separated line per encoding (used by bench_stream.sh).
 */
#include "common.h"
#include "dfs.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *id;
    int n;
    dfs_tensor_in t[DFS_MAX_TENSORS];
    char names[DFS_MAX_TENSORS][DFS_MAX_NAME + 1];
} held;

static held *load(const char *path, int *count, uint64_t *raw_total) {
    dfs_reader *r;
    if (dfs_reader_open(&r, path)) dfl_die_last("dfs_bench");
    held *h = NULL;
    int n = 0, cap = 0;
    dfs_sample *s;
    *raw_total = 0;
    while (dfs_read(r, &s) == 1) {
        if (n == cap) h = dfl_realloc(h, sizeof *h * (size_t)(cap = cap ? 2 * cap : 64));
        held *x = &h[n++];
        x->id = dfl_strdup(s->id);
        x->n = s->ntensors;
        for (int i = 0; i < s->ntensors; i++) {
            dfs_tensor *t = &s->t[i];
            if (dfs_decode(r, t)) dfl_die_last("dfs_bench");
            snprintf(x->names[i], sizeof x->names[i], "%s", t->name);
            void *copy = dfl_aligned_alloc(t->raw_bytes ? t->raw_bytes : 1);
            memcpy(copy, t->data, t->raw_bytes);
            x->t[i] = (dfs_tensor_in){x->names[i], t->dtype, t->ndim, {0}, copy, NULL};
            memcpy(x->t[i].shape, t->shape, sizeof t->shape);
            *raw_total += t->raw_bytes;
        }
    }
    dfs_reader_close(r);
    *count = n;
    return h;
}

/* Write all samples to buf with `enc`; returns the seconds taken and the length. */
static double write_all(held *h, int n, dfs_encoding enc, char *buf, size_t cap, long *len) {
    json_t *meta = json_object();
    FILE *f = fmemopen(buf, cap, "wb");
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    dfs_writer *w;
    double t0 = dfl_now();
    if (dfs_writer_open(&w, f, "mem", meta, "dfs_bench", enc)) dfl_die_last("dfs_bench");
    for (int i = 0; i < n; i++)
        if (dfs_write(w, h[i].id, h[i].n, h[i].t)) dfl_die_last("dfs_bench");
    if (dfs_writer_close(w)) dfl_die_last("dfs_bench");
    double t = dfl_now() - t0;
    *len = ftell(f);
    fclose(f);
    json_decref(meta);
    return t;
}

/* The same on every thread, as dflash-extract writes: waves of 2 samples a
 * thread (at most 8) encoded at once (dfs_encode_sample), then written in
 * order. */
static double write_all_apart(held *h, int n, dfs_encoding enc, char *buf, size_t cap, long *len) {
    json_t *meta = json_object();
    FILE *f = fmemopen(buf, cap, "wb");
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    const int wave = 2 * omp_get_max_threads() < 8 ? 2 * omp_get_max_threads() : 8;
    dfs_encoded **e = dfl_malloc((size_t)wave * sizeof *e);
    for (int i = 0; i < wave; i++) e[i] = dfs_encoded_new();
    dfs_writer *w;
    double t0 = dfl_now();
    if (dfs_writer_open(&w, f, "mem", meta, "dfs_bench", enc)) dfl_die_last("dfs_bench");
    for (int s0 = 0; s0 < n; s0 += wave) {
        const int m = n - s0 < wave ? n - s0 : wave;
        int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
        for (int i = 0; i < m; i++) bad |= dfs_encode_sample(w, e[i], h[s0 + i].id, h[s0 + i].n, h[s0 + i].t) != 0;
        if (bad) dfl_die("dfs_bench", DFL_EX_SOFTWARE, "encoding failed");
        for (int i = 0; i < m; i++)
            if (dfs_write_encoded(w, e[i])) dfl_die_last("dfs_bench");
    }
    if (dfs_writer_close(w)) dfl_die_last("dfs_bench");
    double t = dfl_now() - t0;
    *len = ftell(f);
    fclose(f);
    for (int i = 0; i < wave; i++) dfs_encoded_free(e[i]);
    free(e);
    json_decref(meta);
    return t;
}

/* Read the stream in buf (decoding every tensor if `decode`); seconds taken. */
static double read_all(const char *buf, long len, int decode, uint64_t *stored, uint64_t *hraw, uint64_t *hstored) {
    FILE *f = fmemopen((void *)buf, (size_t)len, "rb");
    dfs_reader *r;
    double t0 = dfl_now();
    if (dfs_reader_open_stream(&r, f, "mem")) dfl_die_last("dfs_bench");
    dfs_sample *s;
    int rc;
    *stored = *hraw = *hstored = 0;
    while ((rc = dfs_read(r, &s)) == 1)
        for (int i = 0; i < s->ntensors; i++) {
            if (decode && dfs_decode(r, &s->t[i])) dfl_die_last("dfs_bench");
            *stored += s->t[i].stored_bytes;
            if (!strcmp(s->t[i].name, "hidden")) {
                *hraw += s->t[i].raw_bytes;
                *hstored += s->t[i].stored_bytes;
            }
        }
    if (rc) dfl_die_last("dfs_bench");
    double t = dfl_now() - t0;
    dfs_reader_close(r);
    fclose(f);
    return t;
}

static double min3(double a, double b, double c) { return a < b ? (a < c ? a : c) : (b < c ? b : c); }

typedef double (*writer_fn)(held *h, int n, dfs_encoding enc, char *buf, size_t cap, long *len);

/* Best of 3 runs of each phase, as lz4 -b and zstd -b report. */
static void run(const char *label, held *h, int n, uint64_t raw, dfs_encoding enc, char *buf, size_t cap,
                writer_fn write) {
    long len;
    uint64_t stored, hraw, hstored;
    double tw = min3(write(h, n, enc, buf, cap, &len), write(h, n, enc, buf, cap, &len),
                     write(h, n, enc, buf, cap, &len));
    double tr = min3(read_all(buf, len, 0, &stored, &hraw, &hstored), read_all(buf, len, 0, &stored, &hraw, &hstored),
                     read_all(buf, len, 0, &stored, &hraw, &hstored));
    double td = min3(read_all(buf, len, 1, &stored, &hraw, &hstored), read_all(buf, len, 1, &stored, &hraw, &hstored),
                     read_all(buf, len, 1, &stored, &hraw, &hstored));
    printf("%s\t%.4f\t%.4f\t%.0f\t%.0f\t%.0f\n", label, (double)raw / (double)stored, (double)hraw / (double)hstored,
           raw / tw / 1e6, raw / tr / 1e6, raw / td / 1e6);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: dfs_bench STREAM\n");
        return 2;
    }
    int n;
    uint64_t raw;
    held *h = load(argv[1], &n, &raw);
    size_t cap = (size_t)(raw + raw / 8 + (64u << 20));
    char *buf = dfl_malloc(cap);
    memset(buf, 0, cap); /* fault the pages in before timing */
    printf("encoding\tratio\thidden_ratio\twrite_MBps\tread_MBps\tdecode_MBps\n");
    dfs_set_codec_threads(1);
    run("none", h, n, raw, (dfs_encoding){DFS_CODEC_NONE, 0, 1}, buf, cap, write_all);
    run("lz4", h, n, raw, (dfs_encoding){DFS_CODEC_LZ4, 0, 1}, buf, cap, write_all);
    run("lz4+shuffle", h, n, raw, (dfs_encoding){DFS_CODEC_LZ4, 1, 1}, buf, cap, write_all);
    char label[64]; /* the write as dflash-extract does it, and the decode, on every core */
    dfs_set_codec_threads(0);
    snprintf(label, sizeof label, "lz4+shuffle x%d", omp_get_max_threads());
    run(label, h, n, raw, (dfs_encoding){DFS_CODEC_LZ4, 1, 1}, buf, cap, write_all_apart);
    /* one tensor at a time, its blocks on every core (as dflash-pack writes) */
    snprintf(label, sizeof label, "lz4+shuffle blocks x%d", omp_get_max_threads());
    run(label, h, n, raw, (dfs_encoding){DFS_CODEC_LZ4, 1, 1}, buf, cap, write_all);
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < h[i].n; k++) free((void *)h[i].t[k].data);
        free(h[i].id);
    }
    free(h);
    free(buf);
    return 0;
}
