/* test_dfs_codec.c: large LZ4 tensors encoded and decoded block by block
 * on several threads (dfs_codec.c's fast path) against the streaming decoder and the
 * original bytes.
 *
 *   test_our_frames        frames of our encoder (64 KiB independent
 *                          blocks), made on 4 threads and on 1 (the same
 *                          bytes, liblz4's frame API's): u8/bf16/f32, shuffled or not,
 *                          compressible, random (blocks stored raw) and
 *                          mixed data, a whole or partial last block: the
 *                          fast path takes them and gives the bytes.
 *   test_other_frames      frames made by liblz4 with other settings: the
 *                          fast path takes independent blocks of any size
 *                          without checksums, refuses linked blocks, block
 *                          or content checksums and an early flush (short
 *                          blocks), and the decode is right either way.
 *   test_damage            a byte flipped anywhere, or the frame cut: 1 and
 *                          4 threads give the same verdict, message and
 *                          bytes.
 */
#include "common.h"
#include "dfs_internal.h"
#include "rng.h"
#include "test.h"

#include <lz4frame.h>
#include <stdlib.h>
#include <string.h>

enum { COMPRESSIBLE, RANDOM, MIXED };

/* n bytes of data: small bf16-like values, random bytes, or 64 KiB of each in turn */
static uint8_t *make_raw(size_t n, int kind, uint64_t seed) {
    dfl_rng rng;
    dfl_rng_seed(&rng, seed);
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) {
        const int rnd = kind == RANDOM || (kind == MIXED && (i >> 16) % 2);
        const uint64_t x = dfl_rng_u64(&rng);
        p[i] = rnd ? (uint8_t)x : (i % 2 ? (uint8_t)(0x3f + (x & 1)) : (uint8_t)(x % 5));
    }
    return p;
}

static dfs_tensor tensor_of(const uint8_t *stored, size_t stored_bytes, size_t raw_bytes, dfl_dtype dt, int shuffle) {
    dfs_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dt;
    t.codec = DFS_CODEC_LZ4;
    t.shuffle = shuffle;
    t.raw_bytes = raw_bytes;
    t.stored_bytes = stored_bytes;
    t.stored = stored;
    return t;
}

/* dfs_decode_into with `threads` decode threads: rc, bytes into dst, message into why */
static int decode_with(int threads, const dfs_tensor *t, uint8_t *dst, char *why) {
    dfs_set_codec_threads(threads);
    dfs_codec_ctx c;
    dfs_codec_init(&c);
    why[0] = 0;
    int rc = dfs_decode_into(&c, dst, t, why, 300);
    dfs_codec_free(&c);
    dfs_set_codec_threads(0);
    return rc;
}

/* Whether the fast path takes t (at 4 threads), with the bytes it gives. */
static int fast_path(const dfs_tensor *t, uint8_t *dst) {
    dfs_set_codec_threads(4);
    dfs_codec_ctx c;
    dfs_codec_init(&c);
    int took = dfs_decode_lz4_blocks(&c, dst, t);
    dfs_codec_free(&c);
    dfs_set_codec_threads(0);
    return took;
}

static void test_our_frames(void) {
    const dfl_dtype dts[3] = {DFL_U8, DFL_BF16, DFL_F32};
    const size_t sizes[3] = {(size_t)1 << 20, ((size_t)1 << 20) + 4 * 1234, 5 * ((size_t)1 << 20) + 4 * 777};
    int cases = 0;
    for (int d = 0; d < 3; d++)
        for (int shuffle = 0; shuffle < 2; shuffle++)
            for (int si = 0; si < 3; si++)
                for (int kind = 0; kind < 3; kind++) {
                    const size_t n = sizes[si], elem = dfl_dtype_size(dts[d]);
                    uint8_t *raw = make_raw(n, kind, 10 * si + kind), *out = malloc(n);
                    /* encoded on 4 threads (blocks at once) and on 1 (liblz4's frame API): the same bytes */
                    dfs_codec_ctx c;
                    dfs_codec_init(&c);
                    dfs_buf enc = {0}, enc1 = {0};
                    size_t len = 0, len1 = 0;
                    const char *why_enc;
                    const dfs_encoding e = {DFS_CODEC_LZ4, shuffle, 1 + 7 * (kind == MIXED)};
                    dfs_set_codec_threads(4);
                    T_CHECK(dfs_encode(&c, &enc, &len, raw, n, elem, &e, &why_enc) == 0);
                    dfs_set_codec_threads(1);
                    T_CHECK(dfs_encode(&c, &enc1, &len1, raw, n, elem, &e, &why_enc) == 0);
                    dfs_set_codec_threads(0);
                    T_CHECKF(len == len1 && !memcmp(enc.p, enc1.p, len), "encoded: %zu vs %zu bytes", len, len1);
                    dfs_buf_free(&enc1);
                    dfs_codec_free(&c);
                    dfs_tensor t = tensor_of(enc.p, len, n, dts[d], shuffle);
                    memset(out, 0xee, n);
                    T_CHECKF(fast_path(&t, out) && !memcmp(out, raw, n), "dtype %d shuffle %d size %zu kind %d", d,
                             shuffle, n, kind);
                    char why[300];
                    for (int th = 1; th <= 4; th += 3) {
                        memset(out, 0xee, n);
                        T_CHECKF(decode_with(th, &t, out, why) == 0 && !memcmp(out, raw, n), "%d threads: %s", th, why);
                    }
                    cases++;
                    dfs_buf_free(&enc);
                    free(raw), free(out);
                }
    printf("  %d tensors\n", cases);
}

/* A frame of raw made by liblz4 with these settings; flush_at > 0: an early
 * flush after that many bytes (a short block in the middle). */
static uint8_t *lz4_frame(const uint8_t *raw, size_t n, LZ4F_blockSizeID_t bs, LZ4F_blockMode_t mode, int block_sum,
                          int content_sum, int content_size, size_t flush_at, size_t *len) {
    LZ4F_preferences_t p;
    memset(&p, 0, sizeof p);
    p.frameInfo.blockSizeID = bs;
    p.frameInfo.blockMode = mode;
    p.frameInfo.blockChecksumFlag = block_sum ? LZ4F_blockChecksumEnabled : LZ4F_noBlockChecksum;
    p.frameInfo.contentChecksumFlag = content_sum ? LZ4F_contentChecksumEnabled : LZ4F_noContentChecksum;
    p.frameInfo.contentSize = content_size ? n : 0;
    size_t cap = LZ4F_compressBound(n, &p) + 64 + LZ4F_HEADER_SIZE_MAX;
    uint8_t *dst = malloc(cap);
    LZ4F_cctx *cc;
    LZ4F_createCompressionContext(&cc, LZ4F_VERSION);
    size_t pos = LZ4F_compressBegin(cc, dst, cap, &p);
    if (flush_at) {
        pos += LZ4F_compressUpdate(cc, dst + pos, cap - pos, raw, flush_at, NULL);
        pos += LZ4F_flush(cc, dst + pos, cap - pos, NULL);
    }
    pos += LZ4F_compressUpdate(cc, dst + pos, cap - pos, raw + flush_at, n - flush_at, NULL);
    pos += LZ4F_compressEnd(cc, dst + pos, cap - pos, NULL);
    LZ4F_freeCompressionContext(cc);
    *len = pos;
    return dst;
}

static void test_other_frames(void) {
    const size_t n = 3 * ((size_t)1 << 20) + 2 * 999;
    uint8_t *raw = make_raw(n, MIXED, 3), *out = malloc(n);
    struct {
        const char *what;
        LZ4F_blockSizeID_t bs;
        LZ4F_blockMode_t mode;
        int block_sum, content_sum, content_size;
        size_t flush_at;
        int fast; /* the fast path should take it */
    } cases[] = {
        {"64 KiB independent, content size", LZ4F_max64KB, LZ4F_blockIndependent, 0, 0, 1, 0, 1},
        {"4 MiB independent, no content size", LZ4F_max4MB, LZ4F_blockIndependent, 0, 0, 0, 0, 1},
        {"256 KiB independent", LZ4F_max256KB, LZ4F_blockIndependent, 0, 0, 1, 0, 1},
        {"1 MiB independent", LZ4F_max1MB, LZ4F_blockIndependent, 0, 0, 0, 0, 1},
        {"linked blocks", LZ4F_max64KB, LZ4F_blockLinked, 0, 0, 1, 0, 0},
        {"block checksums", LZ4F_max64KB, LZ4F_blockIndependent, 1, 0, 1, 0, 0},
        {"content checksum", LZ4F_max4MB, LZ4F_blockIndependent, 0, 1, 1, 0, 0},
        {"flushed early (a short block)", LZ4F_max64KB, LZ4F_blockIndependent, 0, 0, 1, 100000, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        for (int shuffle = 0; shuffle < 2; shuffle++) {
            /* shuffled: the frame holds the shuffled bytes, as our encoder's */
            uint8_t *src = raw;
            if (shuffle) {
                src = malloc(n);
                dfs_shuffle(src, raw, n, 2);
            }
            size_t len;
            uint8_t *f = lz4_frame(src, n, cases[i].bs, cases[i].mode, cases[i].block_sum, cases[i].content_sum,
                                   cases[i].content_size, cases[i].flush_at, &len);
            dfs_tensor t = tensor_of(f, len, n, DFL_BF16, shuffle);
            memset(out, 0xee, n);
            const int took = fast_path(&t, out);
            T_CHECKF(took == cases[i].fast, "%s, shuffle %d: fast path %d", cases[i].what, shuffle, took);
            if (took) T_CHECKF(!memcmp(out, raw, n), "%s: fast path bytes", cases[i].what);
            char why[300];
            memset(out, 0xee, n);
            T_CHECKF(decode_with(4, &t, out, why) == 0 && !memcmp(out, raw, n), "%s, shuffle %d: %s", cases[i].what,
                     shuffle, why);
            free(f);
            if (shuffle) free(src);
        }
    free(raw), free(out);
}

static void test_damage(void) {
    const size_t n = 2 * ((size_t)1 << 20) + 2 * 321;
    uint8_t *raw = make_raw(n, MIXED, 9), *a = malloc(n), *b = malloc(n);
    dfs_codec_ctx c;
    dfs_codec_init(&c);
    dfs_buf enc = {0};
    size_t len = 0;
    const char *why_enc;
    const dfs_encoding e = {DFS_CODEC_LZ4, 1, 1};
    T_CHECK(dfs_encode(&c, &enc, &len, raw, n, 2, &e, &why_enc) == 0);
    dfs_codec_free(&c);
    uint8_t *f = malloc(len);
    dfl_rng rng;
    dfl_rng_seed(&rng, 4);
    int failed = 0, tried = 0;
    for (int k = 0; k < 300; k++) {
        memcpy(f, enc.p, len);
        size_t at = k < 40 ? (size_t)k : (size_t)(dfl_rng_u64(&rng) % len); /* the header, then anywhere */
        size_t flen = len;
        if (k % 10 == 9) flen = at; /* cut there instead */
        else f[at] ^= (uint8_t)(1 + dfl_rng_u64(&rng) % 255);
        dfs_tensor t = tensor_of(f, flen, n, DFL_BF16, 1);
        char wa[300], wb[300];
        memset(a, 0, n), memset(b, 0, n);
        const int ra = decode_with(1, &t, a, wa), rb = decode_with(4, &t, b, wb);
        T_CHECKF(ra == rb && !strcmp(wa, wb) && (ra || !memcmp(a, b, n)), "byte %zu%s: %d '%s' vs %d '%s'", at,
                 flen < len ? " (cut)" : "", ra, wa, rb, wb);
        failed += ra != 0;
        tried++;
    }
    printf("  %d damaged frames, %d refused\n", tried, failed);
    T_CHECK(failed > tried / 4); /* most damage is seen (the rest decodes to other bytes, as LZ4 allows) */
    free(f);
    dfs_buf_free(&enc);
    free(raw), free(a), free(b);
}

int main(void) {
    T_RUN(test_our_frames);
    T_RUN(test_other_frames);
    T_RUN(test_damage);
    return t_exit();
}
