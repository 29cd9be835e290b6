/* test_dfs.c: the DFS stream reader and writer (formats/dflash-stream.md).
 *
 * Round trips of every dtype x codec x shuffle, segments and concatenation,
 * forward compatibility (unknown keys and record types), version refusal,
 * the identity diff, the hidden-state checks, and the byte shuffle against
 * the spec's worked example. Hand-made records are packed here with
 * msgpack-c directly, not with the writer under test.
 */
#include "common.h"
#include "dfs.h"
#include "dfs_hand.h"
#include "rng.h"
#include "test.h"

#include <msgpack.h>
#include <stdlib.h>
#include <unistd.h>
#include <xxhash.h>

/* The internal shuffle, checked against the spec's example. */
void dfs_shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t elem);
void dfs_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t elem);

static char dir[] = "/tmp/dflash-dfs-XXXXXX";

static const char *path_in(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    return buf[k];
}

static json_t *test_meta(int layer0) {
    return json_pack("{s:[i,i], s:s}", "layer_ids", layer0, layer0 + 8, "note", "test");
}

/* Deterministic, somewhat compressible bytes: small random walk. */
static void fill(uint8_t *p, size_t n, uint64_t seed) {
    dfl_rng r;
    dfl_rng_seed(&r, seed);
    uint8_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (dfl_rng_below(&r, 4) == 0) v = (uint8_t)dfl_rng_u64(&r);
        p[i] = (uint8_t)(v + (i & 1));
    }
}

static dfs_reader *open_or_null(const char *path) {
    dfs_reader *r = NULL;
    int rc = dfs_reader_open(&r, path);
    if (rc) fprintf(stderr, "  open: %s\n", dfl_errmsg());
    return r;
}

/* ---- round trips --------------------------------------------------------- */

static void test_round_trip_all_encodings(void) {
    /* 70001 elements: more than one 64 KiB shuffle block, a partial last one. */
    const int64_t shapes[][3] = {{2, 70001 / 2 + 1, 1}, {0, 5, 1}, {7, 1, 1}, {1, 1, 1}};
    const int nshape = 4;
    for (int dt = 0; dt < DFL_DTYPE_COUNT; dt++)
        for (int codec = 0; codec < 2; codec++)
            for (int sh = 0; sh < 2; sh++)
                for (int s = 0; s < nshape; s++) {
                    FILE *f = fopen(path_in("rt.dfs"), "wb");
                    json_t *meta = test_meta(1);
                    dfs_encoding enc = {(dfs_codec)codec, sh, 1};
                    dfs_writer *w;
                    T_CHECK(dfs_writer_open(&w, f, "rt.dfs", meta, "test_dfs", enc) == 0);
                    json_decref(meta);
                    int ndim = s == 3 ? 0 : 2; /* shape {1,1,1} tested as rank 0 */
                    uint64_t n = s == 3 ? 1 : (uint64_t)(shapes[s][0] * shapes[s][1]);
                    size_t bytes = n * dfl_dtype_size((dfl_dtype)dt);
                    uint8_t *data = malloc(bytes + 1);
                    fill(data, bytes, (uint64_t)(dt * 100 + s));
                    dfs_tensor_in in = {"x", (dfl_dtype)dt, ndim, {shapes[s][0], shapes[s][1]}, data, NULL};
                    T_CHECK(dfs_write(w, "sample-0", 1, &in) == 0);
                    T_CHECK(dfs_write(w, "sample-1", 1, &in) == 0);
                    T_CHECK(dfs_writer_close(w) == 0);
                    fclose(f);
                    dfs_reader *r = open_or_null(path_in("rt.dfs"));
                    T_CHECK(r != NULL);
                    if (!r) {
                        free(data);
                        continue;
                    }
                    dfs_sample *smp;
                    int count = 0, rc;
                    while ((rc = dfs_read(r, &smp)) == 1) {
                        dfs_tensor *t = dfs_find(smp, "x");
                        T_CHECK(t && t->dtype == (dfl_dtype)dt && t->ndim == ndim && t->raw_bytes == bytes);
                        T_CHECK(t && (int)t->codec == codec);
                        /* shuffle only with lz4, and never for 1-byte elements */
                        T_CHECK(t && t->shuffle == (codec && sh && dfl_dtype_size((dfl_dtype)dt) > 1));
                        T_CHECK(t && dfs_decode(r, t) == 0 && ((uintptr_t)t->data % 64) == 0);
                        T_CHECKF(t && t->data && !memcmp(t->data, data, bytes), "dtype %d codec %d shuffle %d shape %d",
                                 dt, codec, sh, s);
                        count++;
                    }
                    T_CHECKF(rc == 0 && count == 2, "rc %d count %d: %s", rc, count, dfl_errmsg());
                    dfs_reader_close(r);
                    free(data);
                }
}

/* Samples encoded apart (dfs_encode_sample, on other threads) and written
 * in order (dfs_write_encoded): the same stream, byte for byte, as
 * dfs_write's; a refused sample is refused the same way and leaves the
 * writer as it was; the encoded sample owns copies of its names and shapes. */
static void write_apart(const char *name, int apart, int with_bad) {
    FILE *f = fopen(path_in(name), "wb");
    json_t *meta = test_meta(2);
    dfs_writer *w;
    T_CHECK(dfs_writer_open(&w, f, name, meta, "test_dfs", (dfs_encoding){DFS_CODEC_LZ4, 1, 1}) == 0);
    json_decref(meta);
    enum { NS = 6 };
    dfs_encoded *e[NS];
    dfs_tensor_in in[NS][2];
    uint8_t *data[NS];
    char names[NS][2][16];
    for (int s = 0; s < NS; s++) {
        size_t n = 1000 + 777 * (size_t)s;
        data[s] = malloc(2 * n);
        fill(data[s], 2 * n, (uint64_t)s);
        snprintf(names[s][0], 16, "hidden");
        snprintf(names[s][1], 16, "ids");
        in[s][0] = (dfs_tensor_in){names[s][0], DFL_BF16, 2, {(int64_t)n / 2, 2}, data[s], NULL};
        in[s][1] = (dfs_tensor_in){names[s][1], DFL_I32, 1, {(int64_t)n / 4}, data[s], NULL};
        e[s] = dfs_encoded_new();
    }
    char id[NS][16];
    for (int s = 0; s < NS; s++) snprintf(id[s], 16, "s%d", s);
    if (apart) {
        int rc[NS];
#pragma omp parallel for
        for (int s = 0; s < NS; s++) rc[s] = dfs_encode_sample(w, e[s], id[s], 2, in[s]);
        for (int s = 0; s < NS; s++) {
            T_CHECK(rc[s] == 0);
            memset(names[s], 'x', sizeof names[s]); /* the caller's names may go away */
            memset(in[s], 0, sizeof in[s]);
        }
        if (with_bad) { /* two tensors of one name: refused, nothing written */
            dfs_tensor_in two[2] = {{"a", DFL_U8, 1, {1}, data[0], NULL}, {"a", DFL_U8, 1, {1}, data[0], NULL}};
            dfs_encoded *bad = dfs_encoded_new();
            T_CHECK(dfs_encode_sample(w, bad, "bad", 2, two) == DFL_EX_DATA);
            T_CHECKF(strstr(dfl_errmsg(), "two tensors named \"a\"") != NULL, "%s", dfl_errmsg());
            dfs_encoded_free(bad);
        }
        for (int s = 0; s < NS; s++) T_CHECK(dfs_write_encoded(w, e[s]) == 0);
    } else {
        for (int s = 0; s < NS; s++) T_CHECK(dfs_write(w, id[s], 2, in[s]) == 0);
    }
    T_CHECK(dfs_writer_records(w) == NS);
    T_CHECK(dfs_writer_close(w) == 0);
    fclose(f);
    for (int s = 0; s < NS; s++) free(data[s]), dfs_encoded_free(e[s]);
}

static void test_encoded_apart(void) {
    setenv("SOURCE_DATE_EPOCH", "0", 1); /* the two headers' "created" */
    write_apart("serial.dfs", 0, 0);
    write_apart("apart.dfs", 1, 1);
    unsetenv("SOURCE_DATE_EPOCH");
    size_t na = 0, nb = 0;
    char *a = NULL, *b = NULL;
    T_CHECK(dfl_read_file(path_in("serial.dfs"), 1 << 24, "stream", &a, &na) == 0);
    T_CHECK(dfl_read_file(path_in("apart.dfs"), 1 << 24, "stream", &b, &nb) == 0);
    T_CHECKF(a && b && na == nb && na > 1000 && !memcmp(a, b, na), "%zu vs %zu bytes", na, nb);
    free(a), free(b);
}

/* Several tensors per sample, one of them with its own encoding. */
static void test_mixed_tensors(void) {
    FILE *f = fopen(path_in("mix.dfs"), "wb");
    json_t *meta = test_meta(1);
    dfs_writer *w;
    dfs_encoding lz = {DFS_CODEC_LZ4, 1, 1}, none = {DFS_CODEC_NONE, 0, 1};
    T_CHECK(dfs_writer_open(&w, f, "mix.dfs", meta, "test_dfs", lz) == 0);
    int32_t ids[100];
    uint16_t h[100 * 8];
    for (int i = 0; i < 100; i++) ids[i] = i * 7;
    for (int i = 0; i < 800; i++) h[i] = (uint16_t)(0x3f00 + (i % 37));
    dfs_tensor_in in[2] = {{"input_ids", DFL_I32, 1, {100}, ids, &none}, {"hidden", DFL_BF16, 2, {100, 8}, h, NULL}};
    T_CHECK(dfs_write(w, "a", 2, in) == 0);
    T_CHECK(dfs_writer_records(w) == 1);
    T_CHECK(dfs_writer_close(w) == 0);
    fclose(f);
    json_decref(meta);
    dfs_reader *r = open_or_null(path_in("mix.dfs"));
    dfs_sample *s;
    T_CHECK(r != NULL);
    if (!r) return;
    int rc = dfs_read(r, &s);
    T_CHECKF(rc == 1, "rc %d: %s", rc, dfl_errmsg());
    T_CHECK(rc != 1 || (s && s->ntensors == 2));
    if (rc != 1 || !s || s->ntensors != 2) {
        dfs_reader_close(r);
        return;
    }
    T_CHECK(!strcmp(s->id, "a"));
    T_CHECK(s->t[0].codec == DFS_CODEC_NONE && s->t[1].codec == DFS_CODEC_LZ4 && s->t[1].shuffle);
    T_CHECK(dfs_decode(r, &s->t[0]) == 0 && !memcmp(s->t[0].data, ids, sizeof ids));
    T_CHECK(dfs_decode(r, &s->t[1]) == 0 && !memcmp(s->t[1].data, h, sizeof h));
    T_CHECK(s->t[1].stored_bytes < sizeof h);
    T_CHECK(json_integer_value(json_array_get(json_object_get(dfs_reader_meta(r), "layer_ids"), 1)) == 9);
    T_CHECK(!strcmp(json_string_value(json_object_get(dfs_reader_header(r), "producer")), "test_dfs"));
    T_CHECK(dfs_read(r, &s) == 0);
    dfs_reader_close(r);
}

/* Write `nseg` segments of `per` samples each to an open file. */
static void write_segments(FILE *f, int nseg, int per, const char *prefix, int layer0) {
    for (int g = 0; g < nseg; g++) {
        json_t *meta = test_meta(layer0);
        dfs_writer *w;
        T_CHECK(dfs_writer_open(&w, f, "seg", meta, "test_dfs", (dfs_encoding){DFS_CODEC_LZ4, 1, 1}) == 0);
        json_decref(meta);
        for (int i = 0; i < per; i++) {
            char id[64];
            int32_t v[3] = {g, i, 42};
            snprintf(id, sizeof id, "%s-%d-%d", prefix, g, i);
            dfs_tensor_in in = {"v", DFL_I32, 1, {3}, v, NULL};
            T_CHECK(dfs_write(w, id, 1, &in) == 0);
        }
        T_CHECK(dfs_writer_close(w) == 0);
    }
}

static int count_samples(const char *path, int *segments, int *rc_out) {
    dfs_reader *r;
    int rc = dfs_reader_open(&r, path), n = 0;
    if (rc) {
        *rc_out = rc;
        return -1;
    }
    dfs_sample *s;
    while ((rc = dfs_read(r, &s)) == 1) n++;
    *segments = dfs_reader_segments(r);
    *rc_out = rc;
    dfs_reader_close(r);
    return n;
}

static void test_segments_and_cat(void) {
    FILE *f = fopen(path_in("a.dfs"), "wb");
    write_segments(f, 3, 2, "a", 1);
    fclose(f);
    f = fopen(path_in("b.dfs"), "wb");
    write_segments(f, 1, 5, "b", 1);
    fclose(f);
    int seg, rc;
    T_CHECK(count_samples(path_in("a.dfs"), &seg, &rc) == 6 && seg == 3 && rc == 0);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cat %s %s > %s", path_in("a.dfs"), path_in("b.dfs"), path_in("ab.dfs"));
    T_CHECK(system(cmd) == 0);
    T_CHECK(count_samples(path_in("ab.dfs"), &seg, &rc) == 11 && seg == 4 && rc == 0);
    /* A segment whose identity differs from the first is refused. */
    f = fopen(path_in("c.dfs"), "wb");
    write_segments(f, 1, 1, "c", 2);
    fclose(f);
    snprintf(cmd, sizeof cmd, "cat %s %s > %s", path_in("a.dfs"), path_in("c.dfs"), path_in("ac.dfs"));
    T_CHECK(system(cmd) == 0);
    T_CHECK(count_samples(path_in("ac.dfs"), &seg, &rc) == 6 && rc == DFL_EX_DATA);
    T_CHECKF(strstr(dfl_errmsg(), "layer_ids: [1,9] vs [2,10]"), "%s", dfl_errmsg());
}

/* ---- hand-made records --------------------------------------------------- */

static void put_record(FILE *f, const msgpack_sbuffer *h, const void *payload, size_t plen) {
    uint8_t pre[16];
    hand_prefix(pre, h->data, h->size, (uint32_t)h->size);
    fwrite(pre, 1, 16, f);
    fwrite(h->data, 1, h->size, f);
    if (plen) fwrite(payload, 1, plen, f);
}

static void hand_stream_header(FILE *f, int major, int extra_key) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    hand_begin(&sb, &pk);
    msgpack_pack_map(&pk, 7 + extra_key);
    if (extra_key) {
        pk_str(&pk, "future_key");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_double(&pk, 1.5);
    }
    pk_str(&pk, "meta");
    msgpack_pack_map(&pk, 0);
    pk_str(&pk, "payload");
    msgpack_pack_uint8(&pk, 0);
    pk_str(&pk, "type");
    pk_str(&pk, "stream");
    pk_str(&pk, "format");
    pk_str(&pk, "dflash-stream");
    pk_str(&pk, "version");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_int(&pk, major);
    msgpack_pack_int(&pk, 7);
    pk_str(&pk, "producer");
    pk_str(&pk, "hand");
    pk_str(&pk, "created");
    pk_str(&pk, "2026-01-01T00:00:00Z");
    put_record(f, &sb, NULL, 0);
    msgpack_sbuffer_destroy(&sb);
}

/* One u8 tensor "b" of n bytes, codec none, with unknown keys if asked. */
static void hand_sample(FILE *f, const char *id, const uint8_t *b, size_t n, int extra_keys) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    hand_begin(&sb, &pk);
    msgpack_pack_map(&pk, 4 + extra_keys);
    pk_str(&pk, "tensors");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 8 + extra_keys);
    if (extra_keys) {
        pk_str(&pk, "units");
        pk_str(&pk, "furlongs");
    }
    pk_str(&pk, "xxh64");
    msgpack_pack_uint64(&pk, XXH64(b, n, 0));
    pk_str(&pk, "stored");
    msgpack_pack_uint64(&pk, n);
    pk_str(&pk, "raw");
    msgpack_pack_uint64(&pk, n);
    pk_str(&pk, "shuffle");
    msgpack_pack_false(&pk);
    pk_str(&pk, "codec");
    pk_str(&pk, "none");
    pk_str(&pk, "shape");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint64(&pk, n);
    pk_str(&pk, "dtype");
    pk_str(&pk, "u8");
    pk_str(&pk, "name");
    pk_str(&pk, "b");
    if (extra_keys) {
        pk_str(&pk, "weather");
        msgpack_pack_nil(&pk);
    }
    pk_str(&pk, "id");
    pk_str(&pk, id);
    pk_str(&pk, "payload");
    msgpack_pack_uint64(&pk, n);
    pk_str(&pk, "type");
    pk_str(&pk, "sample");
    put_record(f, &sb, b, n);
    msgpack_sbuffer_destroy(&sb);
}

static void hand_record(FILE *f, const char *type, const char *count_key, uint64_t count, size_t payload) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    hand_begin(&sb, &pk);
    msgpack_pack_map(&pk, count_key ? 3 : 2);
    pk_str(&pk, "type");
    pk_str(&pk, type);
    pk_str(&pk, "payload");
    msgpack_pack_uint64(&pk, payload);
    if (count_key) {
        pk_str(&pk, count_key);
        msgpack_pack_uint64(&pk, count);
    }
    uint8_t junk[64];
    memset(junk, 0xab, sizeof junk);
    put_record(f, &sb, junk, payload);
    msgpack_sbuffer_destroy(&sb);
}

static void test_forward_compatible(void) {
    FILE *f = fopen(path_in("fwd.dfs"), "wb");
    uint8_t b[5] = {1, 2, 3, 4, 5};
    hand_stream_header(f, 1, 1);
    hand_sample(f, "one", b, 5, 1);
    hand_record(f, "index", "entries", 3, 40); /* unknown type with a payload: skipped */
    hand_sample(f, "two", b, 3, 0);
    hand_record(f, "end", "records", 2, 0);
    fclose(f);
    dfs_reader *r = open_or_null(path_in("fwd.dfs"));
    T_CHECK(r != NULL);
    if (!r) return;
    dfs_sample *s;
    /* Each read's rc and the sample's tensor count are checked before the
     * sample is touched: a failed read reports a failed check, not a crash. */
    int rc = dfs_read(r, &s);
    T_CHECKF(rc == 1, "first read: rc %d: %s", rc, dfl_errmsg());
    if (rc != 1 || !s) goto out;
    T_CHECK(s->ntensors == 1);
    if (s->ntensors != 1) goto out;
    T_CHECK(!strcmp(s->id, "one") && s->t[0].raw_bytes == 5);
    T_CHECK(dfs_decode(r, &s->t[0]) == 0 && s->t[0].data && !memcmp(s->t[0].data, b, 5));
    rc = dfs_read(r, &s);
    T_CHECKF(rc == 1, "second read (after the unknown record): rc %d: %s", rc, dfl_errmsg());
    if (rc != 1 || !s) goto out;
    T_CHECK(s->ntensors == 1);
    if (s->ntensors != 1) goto out;
    T_CHECK(!strcmp(s->id, "two") && s->t[0].raw_bytes == 3);
    rc = dfs_read(r, &s);
    T_CHECKF(rc == 0, "third read: rc %d: %s", rc, dfl_errmsg());
    /* The unknown header key is kept in the header map. */
    T_CHECK(json_object_get(dfs_reader_header(r), "future_key") != NULL);
out:
    dfs_reader_close(r);
}

static int open_expect_error(const char *name, const char *needle) {
    dfs_reader *r;
    int rc = dfs_reader_open(&r, path_in(name));
    if (rc == 0) {
        dfs_sample *s;
        while ((rc = dfs_read(r, &s)) == 1) {
        }
        dfs_reader_close(r);
    }
    if (rc != DFL_EX_DATA || !strstr(dfl_errmsg(), needle)) {
        fprintf(stderr, "  %s: rc %d, message: %s\n", name, rc, dfl_errmsg());
        return 0;
    }
    return 1;
}

static void test_refusals(void) {
    uint8_t b[5] = {1, 2, 3, 4, 5};
    FILE *f = fopen(path_in("v2.dfs"), "wb");
    hand_stream_header(f, 2, 0);
    hand_record(f, "end", "records", 0, 0);
    fclose(f);
    T_CHECK(open_expect_error("v2.dfs", "version 2.7 is not supported"));
    T_CHECK(open_expect_error("v2.dfs", "1.0"));

    f = fopen(path_in("count.dfs"), "wb");
    hand_stream_header(f, 1, 0);
    hand_sample(f, "one", b, 5, 0);
    hand_record(f, "end", "records", 2, 0);
    fclose(f);
    T_CHECK(open_expect_error("count.dfs", "end record says 2 sample records, the segment has 1"));

    f = fopen(path_in("noend.dfs"), "wb");
    hand_stream_header(f, 1, 0);
    hand_sample(f, "one", b, 5, 0);
    fclose(f);
    T_CHECK(open_expect_error("noend.dfs", "without an end record"));

    f = fopen(path_in("empty.dfs"), "wb");
    fclose(f);
    T_CHECK(open_expect_error("empty.dfs", "empty input"));

    f = fopen(path_in("first.dfs"), "wb");
    hand_sample(f, "one", b, 5, 0);
    fclose(f);
    T_CHECK(open_expect_error("first.dfs", "byte 0 (record 0): the first record is not a stream header"));

    f = fopen(path_in("after.dfs"), "wb");
    hand_stream_header(f, 1, 0);
    hand_record(f, "end", "records", 0, 0);
    hand_sample(f, "one", b, 5, 0);
    fclose(f);
    T_CHECK(open_expect_error("after.dfs", "(record 2): expected a stream header after the end record"));

    /* A duplicated key (found by the fuzzer: the message once read freed memory). */
    f = fopen(path_in("dup.dfs"), "wb");
    hand_stream_header(f, 1, 0);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    hand_begin(&sb, &pk);
    msgpack_pack_map(&pk, 3);
    pk_str(&pk, "type");
    pk_str(&pk, "end");
    pk_str(&pk, "payload");
    msgpack_pack_uint8(&pk, 0);
    pk_str(&pk, "type");
    pk_str(&pk, "sample");
    put_record(f, &sb, NULL, 0);
    msgpack_sbuffer_destroy(&sb);
    fclose(f);
    T_CHECK(open_expect_error("dup.dfs", "duplicate key \"type\" in the header"));

    dfs_reader *r;
    T_CHECK(dfs_reader_open(&r, path_in("does-not-exist")) == DFL_EX_NOINPUT && r == NULL);
}

/* ---- meta ---------------------------------------------------------------- */

static dfs_hs_meta sample_hs_meta(void) {
    dfs_hs_meta m;
    memset(&m, 0, sizeof m);
    snprintf(m.architecture, sizeof m.architecture, "Qwen3ForCausalLM");
    snprintf(m.model_type, sizeof m.model_type, "qwen3");
    snprintf(m.config_digest, sizeof m.config_digest, "0123456789abcdef");
    m.hidden_size = 8;
    m.num_layers = 4;
    m.vocab_size = 50;
    m.nlayers = 2;
    m.layer_ids[0] = 1;
    m.layer_ids[1] = 3;
    snprintf(m.hidden_dtype, sizeof m.hidden_dtype, "bf16");
    m.has_target_ids = 1;
    return m;
}

static void test_meta_diff(void) {
    dfs_hs_meta m = sample_hs_meta(), back;
    json_t *a = dfs_hs_meta_to_json(&m);
    T_CHECK(dfs_hs_meta_from_json(a, &back, "x") == 0);
    T_CHECK(!memcmp(&m, &back, sizeof m));
    T_CHECK(!strcmp(json_string_value(json_object_get(a, "layer_convention")), "output-of-layer"));
    char buf[512];
    T_CHECK(dfs_meta_diff(a, a, buf, sizeof buf) == 0 && buf[0] == 0);
    dfs_hs_meta m2 = m;
    m2.layer_ids[1] = 2;
    m2.hidden_size = 16;
    json_t *b = dfs_hs_meta_to_json(&m2);
    T_CHECK(dfs_meta_diff(a, b, buf, sizeof buf) == 2);
    T_CHECKF(strstr(buf, "layer_ids: [1,3] vs [1,2]") && strstr(buf, "target.hidden_size: 8 vs 16"), "%s", buf);
    json_t *c = json_object();
    T_CHECK(dfs_meta_diff(a, c, buf, sizeof buf) == 11 && strstr(buf, "(absent)"));
    T_CHECK(dfs_meta_diff(c, c, buf, sizeof buf) == 0);
    /* Non-identity keys do not count. */
    json_object_set_new(b, "dataset", json_string("x"));
    json_object_set_new(c, "dataset", json_string("y"));
    json_t *b2 = json_deep_copy(b);
    json_object_set_new(b2, "dataset", json_string("z"));
    T_CHECK(dfs_meta_diff(b, b2, buf, sizeof buf) == 0);
    /* Refusals of from_json. */
    json_object_set_new(b2, "layer_convention", json_string("hf-index"));
    T_CHECK(dfs_hs_meta_from_json(b2, &back, "s.dfs") == DFL_EX_DATA && strstr(dfl_errmsg(), "layer_convention"));
    json_object_set_new(b2, "layer_convention", json_string("output-of-layer"));
    json_object_set_new(b2, "layer_ids", json_pack("[i,i]", 1, 4));
    T_CHECK(dfs_hs_meta_from_json(b2, &back, "s.dfs") == DFL_EX_DATA && strstr(dfl_errmsg(), "layer_ids"));
    json_object_set_new(b2, "layer_ids", json_pack("[i,i]", 1, 1));
    T_CHECK(dfs_hs_meta_from_json(b2, &back, "s.dfs") == DFL_EX_DATA && strstr(dfl_errmsg(), "repeats"));
    json_object_set_new(b2, "layer_ids", json_pack("[i]", 1));
    json_object_set_new(json_object_get(b2, "target"), "config_digest", json_string("XYZ"));
    T_CHECK(dfs_hs_meta_from_json(b2, &back, "s.dfs") == DFL_EX_DATA && strstr(dfl_errmsg(), "config_digest"));
    json_decref(a);
    json_decref(b);
    json_decref(b2);
    json_decref(c);
}

static void test_hs_check_sample(void) {
    dfs_hs_meta m = sample_hs_meta();
    dfs_sample s;
    memset(&s, 0, sizeof s);
    s.id = "x";
    s.ntensors = 4;
    int32_t ids[3] = {1, 2, 49}, tg[3] = {0, 0, 50};
    uint8_t mask[3] = {0, 1, 1};
    s.t[0] = (dfs_tensor){.name = "input_ids", .dtype = DFL_I32, .ndim = 1, .shape = {3}, .data = ids};
    s.t[1] = (dfs_tensor){.name = "loss_mask", .dtype = DFL_U8, .ndim = 1, .shape = {3}, .data = mask};
    s.t[2] = (dfs_tensor){.name = "hidden", .dtype = DFL_BF16, .ndim = 2, .shape = {3, 16}};
    s.t[3] = (dfs_tensor){.name = "target_ids", .dtype = DFL_I32, .ndim = 1, .shape = {3}};
    T_CHECKF(dfs_hs_check_sample(&m, &s, "p") == 0, "%s", dfl_errmsg());
    s.t[3].data = tg; /* 50 == vocab_size: out of range */
    T_CHECK(dfs_hs_check_sample(&m, &s, "p") == DFL_EX_DATA && strstr(dfl_errmsg(), "target_ids"));
    s.t[3].data = NULL;
    s.t[2].shape[1] = 8;
    T_CHECK(dfs_hs_check_sample(&m, &s, "p") == DFL_EX_DATA && strstr(dfl_errmsg(), "bf16 [3, 16]"));
    s.t[2].shape[1] = 16;
    s.ntensors = 3;
    T_CHECK(dfs_hs_check_sample(&m, &s, "p") == DFL_EX_DATA && strstr(dfl_errmsg(), "target_ids\" is missing"));
    s.ntensors = 4;
    mask[0] = 2;
    T_CHECK(dfs_hs_check_sample(&m, &s, "p") == DFL_EX_DATA && strstr(dfl_errmsg(), "loss_mask"));
}

/* ---- byte shuffle --------------------------------------------------------- */

static void test_shuffle_example(void) {
    /* The spec's example: three bf16 values 0x3f80, 0x4000, 0xbf80 (1, 2, -1)
     * are the bytes 80 3f 00 40 80 bf, shuffled 80 00 80 3f 40 bf. */
    const uint8_t raw[6] = {0x80, 0x3f, 0x00, 0x40, 0x80, 0xbf}, want[6] = {0x80, 0x00, 0x80, 0x3f, 0x40, 0xbf};
    uint8_t out[6], back[6];
    dfs_shuffle(out, raw, 6, 2);
    T_CHECK(!memcmp(out, want, 6));
    dfs_unshuffle(back, out, 6, 2);
    T_CHECK(!memcmp(back, raw, 6));
    /* Blocks: 65536 + 8 bytes of i32; the last block is shuffled on its own. */
    size_t n = 65536 + 8;
    uint8_t *a = malloc(n), *b = malloc(n), *c = malloc(n);
    for (size_t i = 0; i < n; i++) a[i] = (uint8_t)(i * 31 + (i >> 8));
    dfs_shuffle(b, a, n, 4);
    int ok = 1;
    size_t m = 65536 / 4;
    for (size_t i = 0; i < m && ok; i++)
        for (size_t j = 0; j < 4; j++) ok &= b[j * m + i] == a[i * 4 + j];
    for (size_t i = 0; i < 2; i++)
        for (size_t j = 0; j < 4; j++) ok &= b[65536 + j * 2 + i] == a[65536 + i * 4 + j];
    T_CHECK(ok);
    dfs_unshuffle(c, b, n, 4);
    T_CHECK(!memcmp(a, c, n));
    /* The SSE2 path of 2-byte elements against the definition. */
    dfs_shuffle(b, a, n, 2);
    ok = 1;
    m = 65536 / 2;
    for (size_t i = 0; i < m && ok; i++) ok &= b[i] == a[2 * i] && b[m + i] == a[2 * i + 1];
    T_CHECK(ok);
    free(a);
    free(b);
    free(c);
}

/* Clone a sample, drop the reader, write the clone elsewhere. */
static void test_clone(void) {
    FILE *f = fopen(path_in("cl.dfs"), "wb");
    write_segments(f, 1, 3, "cl", 1);
    fclose(f);
    dfs_reader *r = open_or_null(path_in("cl.dfs"));
    dfs_sample *s, *held[3];
    int n = 0;
    while (r && n < 3 && dfs_read(r, &s) == 1) held[n++] = dfs_sample_clone(s);
    T_CHECK(n == 3);
    dfs_reader_close(r);
    f = fopen(path_in("cl2.dfs"), "wb");
    json_t *meta = test_meta(1);
    dfs_writer *w;
    T_CHECK(dfs_writer_open(&w, f, "cl2", meta, "t", (dfs_encoding){DFS_CODEC_NONE, 0, 1}) == 0);
    json_decref(meta);
    for (int i = n - 1; i >= 0; i--) T_CHECK(dfs_write_sample(w, NULL, held[i], 0) == 0);
    T_CHECK(dfs_writer_close(w) == 0);
    fclose(f);
    for (int i = 0; i < n; i++) dfs_sample_free(held[i]);
    r = open_or_null(path_in("cl2.dfs"));
    int k = 2;
    while (r && dfs_read(r, &s) == 1) {
        char id[32];
        snprintf(id, sizeof id, "cl-0-%d", k);
        T_CHECK(!strcmp(s->id, id) && s->t[0].codec == DFS_CODEC_NONE);
        T_CHECK(dfs_decode(r, &s->t[0]) == 0 && ((int32_t *)s->t[0].data)[1] == k);
        k--;
    }
    T_CHECK(k == -1);
    dfs_reader_close(r);
}

/* dfs_take_decoded: a taken tensor outlives the reads after it, with no
 * copy (the reader decodes the next records into other buffers), and the
 * buffers handed back and forth stay 64-byte aligned. */
static void test_take_decoded(void) {
    FILE *f = fopen(path_in("tk.dfs"), "wb");
    write_segments(f, 1, 5, "tk", 1);
    fclose(f);
    dfs_reader *r = open_or_null(path_in("tk.dfs"));
    void *buf[2] = {NULL, NULL};
    size_t cap[2] = {0, 0};
    dfs_sample *s;
    int k = 0;
    while (r && dfs_read(r, &s) == 1) {
        T_CHECK(dfs_decode(r, &s->t[0]) == 0);
        const void *decoded = s->t[0].data;
        dfs_take_decoded(r, &s->t[0], &buf[k % 2], &cap[k % 2]);
        T_CHECK(buf[k % 2] == decoded && s->t[0].data == decoded && cap[k % 2] >= 12);
        T_CHECK(((uintptr_t)buf[k % 2] % 64) == 0);
        /* the record before this one, taken a read ago, is still whole */
        if (k > 0) T_CHECKF(((int32_t *)buf[(k - 1) % 2])[1] == k - 1, "record %d", k - 1);
        k++;
    }
    T_CHECK(k == 5 && ((int32_t *)buf[0])[1] == 4 && ((int32_t *)buf[1])[1] == 3);
    dfs_reader_close(r);
    free(buf[0]), free(buf[1]);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    T_RUN(test_round_trip_all_encodings);
    T_RUN(test_mixed_tensors);
    T_RUN(test_encoded_apart);
    T_RUN(test_segments_and_cat);
    T_RUN(test_forward_compatible);
    T_RUN(test_refusals);
    T_RUN(test_meta_diff);
    T_RUN(test_hs_check_sample);
    T_RUN(test_shuffle_example);
    T_RUN(test_clone);
    T_RUN(test_take_decoded);
    if (t_rm_rf(dir) != 0) return 1;
    return t_exit();
}
