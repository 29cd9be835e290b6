/* dfs_hand.h: DFS records made by hand, key by key, for the tests that need
 * streams dfs_writer never writes (unknown keys, keys in another order,
 * hostile sizes). The framing is that of formats/dflash-stream.md: a 16-byte
 * prefix (magic, header length, XXH64 of the header), the msgpack header,
 * the payload. Included by tests/unit/test_dfs*.c only. */
#ifndef DFLASH_TEST_DFS_HAND_H
#define DFLASH_TEST_DFS_HAND_H

#include <msgpack.h>
#include <stdint.h>
#include <string.h>
#include <xxhash.h>

static inline int sbuf_write(void *data, const char *buf, size_t len) { return msgpack_sbuffer_write(data, buf, len); }

/* An empty header buffer and a packer that appends to it. */
static inline void hand_begin(msgpack_sbuffer *sb, msgpack_packer *pk) {
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(pk, sb, sbuf_write);
}

static inline void pk_str(msgpack_packer *pk, const char *s) {
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

/* The record prefix of an n-byte header: magic, `claimed_len` as the header
 * length (little-endian u32; a test may lie), XXH64 of the header bytes. */
static inline void hand_prefix(uint8_t pre[16], const void *hdr, size_t n, uint32_t claimed_len) {
    const uint64_t x = XXH64(hdr, n, 0);
    pre[0] = 0x89, pre[1] = 'D', pre[2] = 'F', pre[3] = 'S';
    for (int i = 0; i < 4; i++) pre[4 + i] = (uint8_t)(claimed_len >> (8 * i));
    for (int i = 0; i < 8; i++) pre[8 + i] = (uint8_t)(x >> (8 * i));
}

#endif
