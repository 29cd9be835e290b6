/* dfs_codec.c: byte shuffle and LZ4 frames for DFS tensor payloads.
 *
 * A tensor is stored either raw ("none") or as exactly one LZ4 frame
 * ("lz4"), optionally byte-shuffled first. The shuffle works on blocks of
 * DFS_SHUFFLE_BLOCK raw bytes, so encoding and decoding stream through a
 * 64 KiB scratch block that stays in L2, and the frames we write use 64 KiB
 * independent blocks, so each LZ4 block is one shuffle block.
 */
#include "dfs_internal.h"

#include "common.h"

#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* ---- byte shuffle -------------------------------------------------------- */

/* 2-byte elements (bf16, f16): split into the low-byte and high-byte planes. */
static void shuffle2(uint8_t *dst, const uint8_t *src, size_t m) {
    uint8_t *lo = dst, *hi = dst + m;
    size_t i = 0;
#ifdef __SSE2__
    const __m128i mask = _mm_set1_epi16(0x00ff);
    for (; i + 16 <= m; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
        _mm_storeu_si128((__m128i *)(lo + i), _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
        _mm_storeu_si128((__m128i *)(hi + i), _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
    }
#endif
    for (; i < m; i++) {
        lo[i] = src[2 * i];
        hi[i] = src[2 * i + 1];
    }
}

static void unshuffle2(uint8_t *dst, const uint8_t *src, size_t m) {
    const uint8_t *lo = src, *hi = src + m;
    size_t i = 0;
#ifdef __SSE2__
    for (; i + 16 <= m; i += 16) {
        __m128i l = _mm_loadu_si128((const __m128i *)(lo + i));
        __m128i h = _mm_loadu_si128((const __m128i *)(hi + i));
        _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm_unpacklo_epi8(l, h));
        _mm_storeu_si128((__m128i *)(dst + 2 * i + 16), _mm_unpackhi_epi8(l, h));
    }
#endif
    for (; i < m; i++) {
        dst[2 * i] = lo[i];
        dst[2 * i + 1] = hi[i];
    }
}

/* Any element size: byte j of element i goes to j*m + i. */
static void shuffle_generic(uint8_t *dst, const uint8_t *src, size_t m, size_t elem) {
    for (size_t j = 0; j < elem; j++)
        for (size_t i = 0; i < m; i++) dst[j * m + i] = src[i * elem + j];
}

static void unshuffle_generic(uint8_t *dst, const uint8_t *src, size_t m, size_t elem) {
    for (size_t j = 0; j < elem; j++)
        for (size_t i = 0; i < m; i++) dst[i * elem + j] = src[j * m + i];
}

static void shuffle_block(uint8_t *dst, const uint8_t *src, size_t len, size_t elem, int inverse) {
    size_t m = len / elem, tail = len - m * elem;
    if (elem == 2) inverse ? unshuffle2(dst, src, m) : shuffle2(dst, src, m);
    else if (elem > 1) inverse ? unshuffle_generic(dst, src, m, elem) : shuffle_generic(dst, src, m, elem);
    else memcpy(dst, src, m);
    memcpy(dst + m * elem, src + m * elem, tail);
}

void dfs_shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t elem) {
    for (size_t off = 0; off < n; off += DFS_SHUFFLE_BLOCK) {
        size_t len = n - off < DFS_SHUFFLE_BLOCK ? n - off : DFS_SHUFFLE_BLOCK;
        shuffle_block(dst + off, src + off, len, elem, 0);
    }
}

void dfs_unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t elem) {
    for (size_t off = 0; off < n; off += DFS_SHUFFLE_BLOCK) {
        size_t len = n - off < DFS_SHUFFLE_BLOCK ? n - off : DFS_SHUFFLE_BLOCK;
        shuffle_block(dst + off, src + off, len, elem, 1);
    }
}

/* ---- caps ---------------------------------------------------------------- */

uint64_t dfs_lz4_max_stored(uint64_t raw) {
    return raw + 8 * ((raw + 65535) / 65536) + 65600;
}

uint64_t dfs_lz4_max_raw(uint64_t stored) {
    if (stored > (UINT64_MAX - 65536) / 256) return UINT64_MAX;
    return 256 * stored + 65536;
}

/* ---- buffers and contexts -------------------------------------------------- */

void dfs_buf_reserve(dfs_buf *b, size_t n) {
    if (b->cap >= n) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < n) cap = cap > SIZE_MAX / 2 ? n : cap * 2;
    b->p = dfl_realloc(b->p, cap);
    b->cap = cap;
}

void dfs_abuf_reserve(dfs_buf *b, size_t n) {
    if (b->cap >= n) return;
    free(b->p);
    b->p = dfl_aligned_alloc(n);
    b->cap = n;
}

void dfs_buf_free(dfs_buf *b) {
    free(b->p);
    b->p = NULL;
    b->cap = 0;
}

void dfs_codec_init(dfs_codec_ctx *c) {
    memset(c, 0, sizeof *c);
}

void dfs_codec_free(dfs_codec_ctx *c) {
    if (c->cctx) LZ4F_freeCompressionContext(c->cctx);
    if (c->dctx) LZ4F_freeDecompressionContext(c->dctx);
    free(c->block);
    memset(c, 0, sizeof *c);
}

/* Scratch for shuffled data: 4 shuffle blocks (256 KiB, in L2). Decoding 4
 * blocks per LZ4F_decompress call lets liblz4 write straight into it for 4
 * LZ4 blocks out of 5; it decodes a block into its own buffer (and copies
 * it out on the next call) only when the destination is too small. */
#define SCRATCH_BYTES (4 * DFS_SHUFFLE_BLOCK)

static uint8_t *codec_block(dfs_codec_ctx *c) {
    if (!c->block) c->block = dfl_aligned_alloc(SCRATCH_BYTES);
    return c->block;
}

/* ---- encode -------------------------------------------------------------- */

/* The frames we write: 64 KiB independent blocks (one shuffle block each),
 * the content size in the frame header, no LZ4 checksums (each tensor has
 * an XXH64 of its stored bytes instead). */
static LZ4F_preferences_t frame_prefs(uint64_t raw_bytes, int accel) {
    LZ4F_preferences_t p;
    memset(&p, 0, sizeof p);
    p.frameInfo.blockSizeID = LZ4F_max64KB;
    p.frameInfo.blockMode = LZ4F_blockIndependent;
    p.frameInfo.contentChecksumFlag = LZ4F_noContentChecksum;
    p.frameInfo.blockChecksumFlag = LZ4F_noBlockChecksum;
    p.frameInfo.frameType = LZ4F_frame;
    p.frameInfo.contentSize = raw_bytes;
    p.compressionLevel = accel > 1 ? -accel : 0; /* < 0: fast mode with acceleration */
    p.autoFlush = 1;
    return p;
}

int dfs_encode(dfs_codec_ctx *c, dfs_buf *out, size_t *len, const void *raw, uint64_t raw_bytes,
               size_t elem, const dfs_encoding *enc, const char **why) {
    const uint8_t *src = raw;
    if (enc->codec == DFS_CODEC_NONE) {
        dfs_buf_reserve(out, *len + raw_bytes);
        if (raw_bytes) memcpy(out->p + *len, src, raw_bytes);
        *len += raw_bytes;
        return 0;
    }
    if (!c->cctx && LZ4F_isError(LZ4F_createCompressionContext(&c->cctx, LZ4F_VERSION))) {
        *why = "cannot create an LZ4 compression context";
        return DFL_EX_SOFTWARE;
    }
    LZ4F_preferences_t prefs = frame_prefs(raw_bytes, enc->lz4_accel);
    size_t bound = LZ4F_compressFrameBound(raw_bytes, &prefs);
    dfs_buf_reserve(out, *len + bound);
    uint8_t *dst = out->p + *len;
    size_t pos = LZ4F_compressBegin(c->cctx, dst, bound, &prefs);
    if (LZ4F_isError(pos)) goto lz4_fail;
    int shuffle = enc->shuffle && elem > 1;
    uint8_t *block = shuffle ? codec_block(c) : NULL;
    for (uint64_t off = 0; off < raw_bytes; off += DFS_SHUFFLE_BLOCK) {
        size_t n = raw_bytes - off < DFS_SHUFFLE_BLOCK ? (size_t)(raw_bytes - off) : DFS_SHUFFLE_BLOCK;
        const uint8_t *in = src + off;
        if (shuffle) {
            shuffle_block(block, in, n, elem, 0);
            in = block;
        }
        size_t r = LZ4F_compressUpdate(c->cctx, dst + pos, bound - pos, in, n, NULL);
        if (LZ4F_isError(r)) goto lz4_fail;
        pos += r;
    }
    size_t r = LZ4F_compressEnd(c->cctx, dst + pos, bound - pos, NULL);
    if (LZ4F_isError(r)) goto lz4_fail;
    *len += pos + r;
    return 0;
lz4_fail:
    /* "After an error, the state is left in a UB state": start afresh. */
    LZ4F_freeCompressionContext(c->cctx);
    c->cctx = NULL;
    *why = "LZ4 compression failed";
    return DFL_EX_SOFTWARE;
}

/* ---- decode -------------------------------------------------------------- */

typedef struct {
    LZ4F_dctx     *d;
    const uint8_t *src;
    size_t         left;    /* stored bytes not yet consumed */
    int            ended;   /* LZ4F_decompress returned 0: frame complete */
    const char    *err;
} frame_in;

/* Decode until `want` bytes are in dst or the frame ends; returns bytes written. */
static size_t frame_fill(frame_in *f, uint8_t *dst, size_t want) {
    size_t got = 0;
    while (got < want && !f->ended && !f->err) {
        size_t dn = want - got, sn = f->left;
        size_t r = LZ4F_decompress(f->d, dst + got, &dn, f->src, &sn, NULL);
        if (LZ4F_isError(r)) {
            f->err = LZ4F_getErrorName(r);
            break;
        }
        f->src += sn;
        f->left -= sn;
        got += dn;
        if (r == 0) f->ended = 1;
        else if (dn == 0 && sn == 0) f->err = "the LZ4 frame ends early (truncated frame)";
    }
    return got;
}

static int decode_lz4(dfs_codec_ctx *c, uint8_t *dst, const dfs_tensor *t, char *why, size_t whylen) {
    const uint8_t *src = t->stored;
    if (t->stored_bytes < 4 || memcmp(src, "\x04\x22\x4d\x18", 4) != 0) {
        snprintf(why, whylen, "stored bytes do not start with the LZ4 frame magic 04 22 4d 18");
        return -1;
    }
    if (!c->dctx && LZ4F_isError(LZ4F_createDecompressionContext(&c->dctx, LZ4F_VERSION))) {
        snprintf(why, whylen, "cannot create an LZ4 decompression context");
        return -1;
    }
    LZ4F_resetDecompressionContext(c->dctx);
    frame_in f = {c->dctx, src, t->stored_bytes, 0, NULL};
    size_t elem = dfl_dtype_size(t->dtype);
    int shuffle = t->shuffle && elem > 1;
    uint8_t *block = shuffle ? codec_block(c) : NULL;
    uint64_t got = 0;
    if (!shuffle) {
        got = frame_fill(&f, dst, t->raw_bytes);
    } else {
        /* Chunks start at multiples of the shuffle block, so unshuffling a
         * chunk block by block is unshuffling the tensor's blocks. */
        while (got < t->raw_bytes && !f.err) {
            size_t n = t->raw_bytes - got < SCRATCH_BYTES ? (size_t)(t->raw_bytes - got) : SCRATCH_BYTES;
            size_t k = frame_fill(&f, block, n);
            if (k < n) {
                got += k;
                break;
            }
            dfs_unshuffle(dst + got, block, n, elem);
            got += n;
        }
    }
    if (!f.err && got == t->raw_bytes && !f.ended) {
        uint8_t extra;
        if (frame_fill(&f, &extra, 1)) f.err = "the LZ4 frame decodes to more than the tensor's raw bytes";
    }
    if (f.err) {
        snprintf(why, whylen, "bad LZ4 frame: %s", f.err);
        return -1;
    }
    if (got != t->raw_bytes) {
        snprintf(why, whylen, "the LZ4 frame decodes to %llu bytes, the tensor needs %llu",
                 (unsigned long long)got, (unsigned long long)t->raw_bytes);
        return -1;
    }
    if (f.left) {
        snprintf(why, whylen, "%llu stored bytes after the end of the LZ4 frame", (unsigned long long)f.left);
        return -1;
    }
    return 0;
}

int dfs_decode_into(dfs_codec_ctx *c, void *dst, const dfs_tensor *t, char *why, size_t whylen) {
    if (t->codec == DFS_CODEC_LZ4) return decode_lz4(c, dst, t, why, whylen);
    if (t->raw_bytes) memcpy(dst, t->stored, t->raw_bytes);
    return 0;
}
