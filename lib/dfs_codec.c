/* dfs_codec.c: byte shuffle and LZ4 frames for DFS tensor payloads.
 *
 * A tensor is stored either raw ("none") or as exactly one LZ4 frame
 * ("lz4"), optionally byte-shuffled first. The shuffle works on blocks of
 * DFS_SHUFFLE_BLOCK raw bytes, so encoding and decoding stream through a
 * 64 KiB scratch block that stays in L2, and the frames we write use 64 KiB
 * independent blocks, so each LZ4 block is one shuffle block; a large
 * tensor's blocks are decoded on several threads at once.
 */
#include "dfs_internal.h"

#include "common.h"

#include <lz4.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
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
    dfs_buf_free(&c->index);
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

static _Atomic int codec_threads; /* 0: OpenMP's default */

void dfs_set_codec_threads(int n) { atomic_store(&codec_threads, n > 0 ? n : 0); }

static int codec_thread_count(void) {
    const int n = atomic_load(&codec_threads);
    return n > 0 ? n : omp_get_max_threads();
}

/* Below this, one thread: a tensor of a few blocks takes microseconds.
 * The fuzz build takes the parallel path for every tensor, so that it
 * sees it. */
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
#define PARALLEL_MIN_BYTES 1u
#else
#define PARALLEL_MIN_BYTES (1u << 20)
#endif

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

/* A large tensor's blocks compressed at once. Each block is compressed as
 * liblz4's frame API compresses an independent block (LZ4_compress_fast_
 * extState at the frame's acceleration, into one byte less than the block,
 * stored raw when it does not shrink), so the frame is byte for byte the
 * one LZ4F_compressUpdate makes block by block (test_dfs_codec compares
 * them). The blocks go to fixed slots after the header, then move down
 * into place. dst holds hlen + nblk (4 + 64 KiB) + 4 bytes; returns the
 * frame's length. */
static size_t encode_lz4_blocks(uint8_t *dst, size_t hlen, const uint8_t *src, uint64_t n, size_t elem, int shuffle,
                                int level, int nt) {
    const size_t B = DFS_SHUFFLE_BLOCK, slot = 4 + B;
    const int64_t nblk = (int64_t)((n + B - 1) / B);
    const int accel = level < 0 ? -level + 1 : 1; /* the frame API's */
#pragma omp parallel num_threads(nt)
    {
        void *state = dfl_malloc((size_t)LZ4_sizeofState());
        uint8_t *scratch = shuffle ? dfl_aligned_alloc(B) : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nblk; i++) {
            const uint64_t off = (uint64_t)i * B;
            const int m = (int)(n - off < B ? n - off : B);
            const uint8_t *in = src + off;
            if (shuffle) {
                shuffle_block(scratch, in, (size_t)m, elem, 0);
                in = scratch;
            }
            uint8_t *blk = dst + hlen + (size_t)i * slot;
            int cs = LZ4_compress_fast_extState(state, (const char *)in, (char *)blk + 4, m, m - 1, accel);
            uint32_t w = (uint32_t)cs;
            if (cs <= 0 || cs >= m) { /* stored raw */
                memcpy(blk + 4, in, (size_t)m);
                w = (uint32_t)m | 0x80000000u;
            }
            dfs_put_le(blk, w, 4);
        }
        free(scratch);
        free(state);
    }
    size_t pos = hlen;
    for (int64_t i = 0; i < nblk; i++) {
        const uint8_t *blk = dst + hlen + (size_t)i * slot;
        const size_t len = 4 + (dfs_le32(blk) & 0x7fffffffu);
        memmove(dst + pos, blk, len);
        pos += len;
    }
    memset(dst + pos, 0, 4); /* the end mark */
    return pos + 4;
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
    /* not inside a team (dflash-extract encodes several samples at once):
     * there the blocks would run on one thread, and their slots cost a copy */
    const int nt = codec_thread_count(), blocks = nt > 1 && !omp_in_parallel() && raw_bytes >= PARALLEL_MIN_BYTES;
    size_t bound = LZ4F_compressFrameBound(raw_bytes, &prefs);
    if (blocks) { /* the slots of encode_lz4_blocks */
        const size_t slots = LZ4F_HEADER_SIZE_MAX + (size_t)((raw_bytes + DFS_SHUFFLE_BLOCK - 1) / DFS_SHUFFLE_BLOCK) *
                                                        (4 + DFS_SHUFFLE_BLOCK) + 4;
        if (slots > bound) bound = slots;
    }
    dfs_buf_reserve(out, *len + bound);
    uint8_t *dst = out->p + *len;
    size_t pos = LZ4F_compressBegin(c->cctx, dst, bound, &prefs);
    if (LZ4F_isError(pos)) goto lz4_fail;
    int shuffle = enc->shuffle && elem > 1;
    if (blocks) { /* the context wrote the header; its next LZ4F_compressBegin starts afresh */
        *len += encode_lz4_blocks(dst, pos, src, raw_bytes, elem, shuffle, prefs.compressionLevel, nt);
        return 0;
    }
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

/* ---- decode, streaming (any frame) ------------------------------------------ */

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
    if (dfs_decode_lz4_blocks(c, dst, t)) return 0;
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

/* ---- decode, block by block on every thread ---------------------------------
 *
 * The frames we write have independent blocks, so a large tensor's blocks
 * can be decoded at once on several threads (a Qwen3-8B record's features,
 * 126 MB, take one core ~0.1 s: about a training step on an H200, and
 * several drafter forwards). The block headers are walked first (a 4-byte
 * size each); block i then decodes to raw bytes [i B, (i+1) B) for the
 * frame's block size B, which holds for every block but the last of a frame
 * that was not flushed early, and is checked. A frame of another kind
 * (linked blocks, checksums, a dictionary), one that is damaged, or one
 * whose blocks do not decode as expected goes through the streaming decoder
 * above, which gives the same bytes or names the damage. */

/* The frame header of an independent-block frame without checksums or
 * dictionary: its length and block size; 0 for any other. */
static size_t plain_frame_header(const uint8_t *p, size_t n, size_t *bmax) {
    if (n < 7) return 0;
    const uint8_t flg = p[4], bd = p[5];
    const int version = flg >> 6, indep = flg >> 5 & 1, bsum = flg >> 4 & 1, csize = flg >> 3 & 1, csum = flg >> 2 & 1;
    const int id = bd >> 4 & 7;
    if (version != 1 || !indep || bsum || csum || (flg & 3) || (bd & 0x8f) || id < 4) return 0;
    const size_t hlen = 4 + 2 + (csize ? 8 : 0) + 1;
    if (n < hlen || p[hlen - 1] != (uint8_t)(XXH32(p + 4, hlen - 5, 0) >> 8)) return 0;
    *bmax = (size_t)1 << (8 + 2 * id); /* 4: 64 KiB ... 7: 4 MiB */
    return hlen;
}

/* Offsets of the blocks' size words, walked from the header to the end
 * mark; the count, or -1 if the walk does not end exactly at the frame's
 * end after `want` blocks no longer than bmax. */
static int64_t index_blocks(dfs_buf *idx, const uint8_t *p, size_t n, size_t pos, size_t bmax, uint64_t want) {
    dfs_buf_reserve(idx, (size_t)want * sizeof(uint64_t) + 1);
    uint64_t *off = (uint64_t *)idx->p;
    uint64_t k = 0;
    for (;;) {
        if (n - pos < 4) return -1;
        const uint32_t w = dfs_le32(p + pos);
        if (w == 0) return pos + 4 == n && k == want ? (int64_t)k : -1;
        const size_t len = w & 0x7fffffffu;
        if (k == want || len == 0 || len > bmax || n - pos - 4 < len) return -1;
        off[k++] = pos;
        pos += 4 + len;
    }
}

/* Block k of the frame into dst (exp raw bytes; through scratch when the
 * tensor is shuffled). 0, or -1 when it does not decode to exactly exp. */
static int decode_block(uint8_t *dst, const uint8_t *p, uint64_t off, size_t exp, uint8_t *scratch, size_t elem) {
    const uint32_t w = dfs_le32(p + off);
    const size_t len = w & 0x7fffffffu;
    const uint8_t *src = p + off + 4;
    uint8_t *out = scratch ? scratch : dst;
    if (w >> 31) { /* stored uncompressed */
        if (len != exp) return -1;
        if (scratch) out = (uint8_t *)src;
        else memcpy(out, src, exp);
    } else if (LZ4_decompress_safe((const char *)src, (char *)out, (int)len, (int)exp) != (int)exp) {
        return -1;
    }
    if (scratch) dfs_unshuffle(dst, out, exp, elem);
    return 0;
}

int dfs_decode_lz4_blocks(dfs_codec_ctx *c, uint8_t *dst, const dfs_tensor *t) {
    const int nt = codec_thread_count();
    if (nt < 2 || t->raw_bytes < PARALLEL_MIN_BYTES) return 0;
    size_t bmax;
    const uint8_t *p = t->stored;
    const size_t hlen = plain_frame_header(p, t->stored_bytes, &bmax);
    if (!hlen) return 0;
    if ((p[4] >> 3 & 1) && dfs_le64(p + 6) != t->raw_bytes) return 0; /* content size */
    const uint64_t nblk = (t->raw_bytes + bmax - 1) / bmax;
    const int64_t k = index_blocks(&c->index, p, t->stored_bytes, hlen, bmax, nblk);
    if (k < 0) return 0;
    const uint64_t *off = (const uint64_t *)c->index.p;
    const size_t elem = dfl_dtype_size(t->dtype);
    const int shuffle = t->shuffle && elem > 1;
    int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
    {
        uint8_t *scratch = shuffle ? dfl_aligned_alloc(bmax) : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < k; i++) {
            const uint64_t r0 = (uint64_t)i * bmax;
            const size_t exp = t->raw_bytes - r0 < bmax ? (size_t)(t->raw_bytes - r0) : bmax;
            bad |= decode_block(dst + r0, p, off[i], exp, scratch, elem) != 0;
        }
        free(scratch);
    }
    return !bad;
}

int dfs_decode_into(dfs_codec_ctx *c, void *dst, const dfs_tensor *t, char *why, size_t whylen) {
    if (t->codec == DFS_CODEC_LZ4) return decode_lz4(c, dst, t, why, whylen);
    if (t->raw_bytes) memcpy(dst, t->stored, t->raw_bytes);
    return 0;
}
