/* test_dfs_corrupt.c: the reader on damaged and hostile input.
 *
 * A small valid stream (about 2 KB) is cut at every byte offset and has
 * every byte flipped (two patterns); each variant must be refused with
 * DFL_EX_DATA, cleanly: no crash, no hang, no large allocation. Every byte
 * of a record is covered by a check (magic, caps, header XXH64, tensor
 * XXH64), so no flip can pass. Then hand-made hostile records: huge
 * length prefixes, payload sizes far beyond the file, msgpack containers
 * announcing 2^32-1 elements, deep nesting.
 *
 * Large allocations are caught by an address-space limit (normal build) or
 * ASan's max_allocation_size_mb (sanitizer build): either turns an
 * allocation beyond 64 MiB into a failure.
 */
#include "common.h"
#include "dfs.h"
#include "dfs_hand.h"
#include "test.h"

#include <msgpack.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <xxhash.h>

#ifdef UNDER_ASAN
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "max_allocation_size_mb=64:allocator_may_return_null=1"; }
#endif

/* Read a whole stream held in memory: every record, every tensor decoded.
 * Returns 0 for a valid stream or the reader's exit code. */
static int read_all(const uint8_t *buf, size_t len) {
    FILE *f = len ? fmemopen((void *)buf, len, "rb") : fopen("/dev/null", "rb");
    if (!f) return -1;
    dfs_reader *r;
    int rc = dfs_reader_open_stream(&r, f, "mem");
    if (!rc) {
        dfs_sample *s;
        while ((rc = dfs_read(r, &s)) == 1)
            for (int i = 0; i < s->ntensors && rc == 1; i++)
                if (dfs_decode(r, &s->t[i])) rc = dfl_errcode();
        dfs_reader_close(r);
    }
    fclose(f);
    return rc;
}

static uint8_t *stream;
static size_t stream_len;

/* Two samples with lz4+shuffle, lz4 and raw tensors. */
static void make_stream(void) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    json_t *meta = json_pack("{s:s}", "purpose", "corruption test");
    dfs_writer *w;
    dfs_encoding lz = {DFS_CODEC_LZ4, 1, 1}, none = {DFS_CODEC_NONE, 0, 1};
    T_CHECK(dfs_writer_open(&w, f, "mem", meta, "test_dfs_corrupt", lz) == 0);
    json_decref(meta);
    for (int k = 0; k < 2; k++) {
        int32_t ids[40];
        uint8_t mask[40];
        uint16_t h[40 * 8];
        for (int i = 0; i < 40; i++) {
            ids[i] = 1000 + i * 13 + k;
            mask[i] = i > 10;
        }
        for (int i = 0; i < 40 * 8; i++) h[i] = (uint16_t)(0x3c00 + ((i * 37 + k) % 300));
        dfs_tensor_in in[3] = {{"input_ids", DFL_I32, 1, {40}, ids, NULL},
                               {"loss_mask", DFL_U8, 1, {40}, mask, &none},
                               {"hidden", DFL_BF16, 2, {40, 8}, h, NULL}};
        T_CHECK(dfs_write(w, k ? "second" : "first", 3, in) == 0);
    }
    T_CHECK(dfs_writer_close(w) == 0);
    fclose(f);
    stream = (uint8_t *)buf;
    stream_len = len;
}

static void test_valid_baseline(void) {
    T_CHECKF(stream_len > 1000 && stream_len < 4000, "stream is %zu bytes", stream_len);
    T_CHECKF(read_all(stream, stream_len) == 0, "%s", dfl_errmsg());
}

static void test_truncated_everywhere(void) {
    int bad = 0;
    for (size_t n = 0; n < stream_len; n++) {
        int rc = read_all(stream, n);
        if (rc != DFL_EX_DATA) {
            if (bad++ < 5) fprintf(stderr, "  cut at %zu: rc %d (%s)\n", n, rc, dfl_errmsg());
        }
    }
    T_CHECKF(bad == 0, "%d cuts not refused", bad);
    /* The message says where. */
    read_all(stream, stream_len - 3);
    T_CHECKF(strstr(dfl_errmsg(), "mem: byte ") && strstr(dfl_errmsg(), "truncated"), "%s", dfl_errmsg());
}

static void test_flipped_everywhere(void) {
    uint8_t *copy = malloc(stream_len);
    static const uint8_t patterns[2] = {0xff, 0x01};
    int bad = 0;
    for (int p = 0; p < 2; p++)
        for (size_t i = 0; i < stream_len; i++) {
            memcpy(copy, stream, stream_len);
            copy[i] ^= patterns[p];
            int rc = read_all(copy, stream_len);
            if (rc != DFL_EX_DATA && bad++ < 5)
                fprintf(stderr, "  flip %02x at %zu: rc %d (%s)\n", patterns[p], i, rc, dfl_errmsg());
        }
    T_CHECKF(bad == 0, "%d flips not refused", bad);
    free(copy);
}

/* A record with an arbitrary header (raw bytes) and a valid checksum. */
static size_t record(uint8_t *out, const uint8_t *hdr, uint32_t n, uint32_t claimed_len) {
    hand_prefix(out, hdr, n, claimed_len);
    memcpy(out + 16, hdr, n);
    return 16 + n;
}

/* The valid stream's first record (the stream header) followed by `rec`. */
static int after_header(const uint8_t *rec, size_t n) {
    uint32_t h0 = stream[4] | stream[5] << 8 | stream[6] << 16 | (uint32_t)stream[7] << 24;
    size_t first = 16 + h0;
    uint8_t *buf = malloc(first + n + 64);
    memcpy(buf, stream, first);
    memcpy(buf + first, rec, n);
    int rc = read_all(buf, first + n);
    free(buf);
    return rc;
}

/* A sample header claiming one raw u8 tensor of `raw` bytes (payload `raw`)
 * followed by only `have` bytes of payload. */
static int huge_payload(uint64_t raw, const char *codec, uint64_t stored, size_t have) {
    msgpack_sbuffer sb;
    msgpack_packer pk;
    hand_begin(&sb, &pk);
    msgpack_pack_map(&pk, 4);
    pk_str(&pk, "type");
    pk_str(&pk, "sample");
    pk_str(&pk, "payload");
    msgpack_pack_uint64(&pk, stored);
    pk_str(&pk, "id");
    pk_str(&pk, "big");
    pk_str(&pk, "tensors");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_map(&pk, 8);
    pk_str(&pk, "name");
    pk_str(&pk, "x");
    pk_str(&pk, "dtype");
    pk_str(&pk, "u8");
    pk_str(&pk, "shape");
    msgpack_pack_array(&pk, 1);
    msgpack_pack_uint64(&pk, raw);
    pk_str(&pk, "codec");
    pk_str(&pk, codec);
    pk_str(&pk, "shuffle");
    msgpack_pack_false(&pk);
    pk_str(&pk, "raw");
    msgpack_pack_uint64(&pk, raw);
    pk_str(&pk, "stored");
    msgpack_pack_uint64(&pk, stored);
    pk_str(&pk, "xxh64");
    msgpack_pack_uint64(&pk, 0);
    uint8_t *rec = calloc(1, 16 + sb.size + have);
    size_t n = record(rec, (const uint8_t *)sb.data, (uint32_t)sb.size, (uint32_t)sb.size);
    /* `have` bytes of an LZ4 frame start (or zeros for codec none) */
    if (have >= 4) memcpy(rec + n, "\x04\x22\x4d\x18", 4);
    int rc = after_header(rec, n + have);
    free(rec);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static void test_hostile(void) {
    uint8_t rec[256];
    /* Header length prefixes: 0, above the cap, 2^32-1, and the cap itself
     * with nothing behind it. */
    static const uint32_t lens[] = {0, DFS_MAX_HEADER + 1, 0xffffffffu, DFS_MAX_HEADER};
    for (size_t i = 0; i < 4; i++) {
        size_t n = record(rec, (const uint8_t *)"\x80", 1, lens[i]);
        T_CHECKF(after_header(rec, n) == DFL_EX_DATA, "length %u: %s", lens[i], dfl_errmsg());
    }
    /* Wrong magic. */
    size_t n = record(rec, (const uint8_t *)"\x80", 1, 1);
    rec[3] = 'X';
    T_CHECK(after_header(rec, n) == DFL_EX_DATA && strstr(dfl_errmsg(), "bad magic"));
    /* msgpack containers that announce far more than they hold. */
    static const struct {
        const char *bytes;
        uint32_t n;
        const char *why;
    } mp[] = {
        {"\xdd\xff\xff\xff\xff", 5, "not a msgpack map"},                 /* array32 of 2^32-1 */
        {"\xdf\xff\xff\xff\xff", 5, "exceeds the bytes"},                 /* map32 of 2^32-1 pairs */
        {"\x81\xa1t\xdd\x04\x00\x00\x00", 8, "exceeds the bytes"},       /* {"t": array32 of 2^26} */
        {"\x81\xa1t\xdb\xff\xff\xff\xff", 8, "past the end"},            /* {"t": str32 of 2^32-1} */
        {"\x81\xa1t\xc6\x7f\xff\xff\xff", 8, "past the end"},            /* {"t": bin32} */
        {"\x81\xa1t\xc1", 4, "0xc1"},                                    /* reserved byte */
        {"\x81\xa1t\xc0\xc0", 5, "after the msgpack map"},              /* trailing bytes */
    };
    for (size_t i = 0; i < sizeof mp / sizeof mp[0]; i++) {
        n = record(rec, (const uint8_t *)mp[i].bytes, mp[i].n, mp[i].n);
        int rc = after_header(rec, n);
        T_CHECKF(rc == DFL_EX_DATA && strstr(dfl_errmsg(), mp[i].why), "case %zu: rc %d: %s", i, rc, dfl_errmsg());
    }
    /* Nesting: {"t": [[[[...]]]]} 40 deep. */
    uint8_t deep[64] = {0x81, 0xa1, 't'};
    for (int i = 0; i < 40; i++) deep[3 + i] = 0x91;
    deep[43] = 0xc0;
    n = record(rec, deep, 44, 44);
    T_CHECK(after_header(rec, n) == DFL_EX_DATA && strstr(dfl_errmsg(), "nested too deeply"));
    /* Payloads far beyond the input: refused as truncated, never allocated. */
    T_CHECKF(huge_payload(60ull << 30, "none", 60ull << 30, 100) == DFL_EX_DATA && strstr(dfl_errmsg(), "truncated"),
             "%s", dfl_errmsg());
    T_CHECKF(huge_payload(1ull << 40, "none", 1ull << 40, 100) == DFL_EX_DATA && strstr(dfl_errmsg(), "cap"), "%s",
             dfl_errmsg());
    /* lz4: 100 stored bytes cannot make 60 GiB. */
    T_CHECKF(huge_payload(60ull << 30, "lz4", 100, 100) == DFL_EX_DATA && strstr(dfl_errmsg(), "cannot be an LZ4"), "%s",
             dfl_errmsg());
    /* lz4 at the largest plausible expansion: header accepted, frame refused. */
    T_CHECKF(huge_payload(256 * 100 + 65536, "lz4", 100, 100) == DFL_EX_DATA, "%s", dfl_errmsg());
}

/* Limit the address space (normal build) so a large allocation fails. */
static void limit_memory(void) {
#ifndef UNDER_ASAN
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long pages = 0;
    if (f && fscanf(f, "%lu", &pages) == 1) {
        rlim_t cur = (rlim_t)pages * 4096 + (64u << 20);
        struct rlimit rl = {cur, cur};
        setrlimit(RLIMIT_AS, &rl);
    }
    if (f) fclose(f);
#endif
}

int main(void) {
    make_stream();
    limit_memory();
    T_RUN(test_valid_baseline);
    T_RUN(test_truncated_everywhere);
    T_RUN(test_flipped_everywhere);
    T_RUN(test_hostile);
    free(stream);
    return t_exit();
}
