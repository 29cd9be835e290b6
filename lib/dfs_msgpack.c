/* dfs_msgpack.c: safe msgpack parsing of record headers, and msgpack <-> JSON.
 *
 * msgpack-c trusts the length prefixes of arrays, maps and strings: a
 * 5-byte "array32 of 2^32-1 entries" makes it reserve gigabytes. So before
 * any header reaches msgpack_unpack_next, dfs_mp_prescan walks its bytes and
 * checks that every announced element count and string length fits in the
 * bytes that remain. After that, msgpack-c's allocation is bounded by a
 * small multiple of the header length (itself capped at DFS_MAX_HEADER).
 */
#include "dfs_internal.h"

#include "common.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- pre-scan ------------------------------------------------------------ */

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* Size of the fixed part after the type byte, the length of a following
 * body (str/bin/ext) and the number of child objects (arrays, maps).
 * Returns -1 for the never-used byte 0xc1. */
static int mp_item(const uint8_t *p, size_t avail, size_t *head, uint64_t *body, uint64_t *kids) {
    uint8_t b = p[0];
    *head = 1;
    *body = 0;
    *kids = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) return 0;
    if (b <= 0x8f) { *kids = 2u * (b & 0x0f); return 0; }
    if (b <= 0x9f) { *kids = b & 0x0f; return 0; }
    if (b <= 0xbf) { *body = b & 0x1f; return 0; }
    static const struct { uint8_t len; uint8_t extra; uint8_t kind; } tab[] = {
        /* kind: 0 fixed size `len`, 1 body length in `len` bytes (+extra), 2 array, 3 map */
        [0xc4 - 0xc4] = {1, 0, 1}, [0xc5 - 0xc4] = {2, 0, 1}, [0xc6 - 0xc4] = {4, 0, 1},
        [0xc7 - 0xc4] = {1, 1, 1}, [0xc8 - 0xc4] = {2, 1, 1}, [0xc9 - 0xc4] = {4, 1, 1},
        [0xca - 0xc4] = {4, 0, 0}, [0xcb - 0xc4] = {8, 0, 0},
        [0xcc - 0xc4] = {1, 0, 0}, [0xcd - 0xc4] = {2, 0, 0}, [0xce - 0xc4] = {4, 0, 0}, [0xcf - 0xc4] = {8, 0, 0},
        [0xd0 - 0xc4] = {1, 0, 0}, [0xd1 - 0xc4] = {2, 0, 0}, [0xd2 - 0xc4] = {4, 0, 0}, [0xd3 - 0xc4] = {8, 0, 0},
        [0xd4 - 0xc4] = {2, 0, 0}, [0xd5 - 0xc4] = {3, 0, 0}, [0xd6 - 0xc4] = {5, 0, 0}, [0xd7 - 0xc4] = {9, 0, 0},
        [0xd8 - 0xc4] = {17, 0, 0},
        [0xd9 - 0xc4] = {1, 0, 1}, [0xda - 0xc4] = {2, 0, 1}, [0xdb - 0xc4] = {4, 0, 1},
        [0xdc - 0xc4] = {2, 0, 2}, [0xdd - 0xc4] = {4, 0, 2}, [0xde - 0xc4] = {2, 0, 3}, [0xdf - 0xc4] = {4, 0, 3},
    };
    if (b == 0xc1) return -1;
    const int i = b - 0xc4;
    size_t len = tab[i].len;
    *head = 1 + len + tab[i].extra;
    if (avail < *head) return 0; /* caller reports truncation */
    if (tab[i].kind == 1) *body = be(p + 1, (int)len);
    else if (tab[i].kind == 2) *kids = be(p + 1, (int)len);
    else if (tab[i].kind == 3) *kids = 2 * be(p + 1, (int)len);
    return 0;
}

int dfs_mp_prescan(const uint8_t *p, size_t n, const char **why) {
    uint64_t left[DFS_MAX_DEPTH + 1]; /* objects still expected at each level */
    int depth = 0;
    uint64_t pending = 1;             /* objects expected in total */
    size_t pos = 0;
    left[0] = 1;
    if (n == 0 || !((p[0] >= 0x80 && p[0] <= 0x8f) || p[0] == 0xde || p[0] == 0xdf)) {
        *why = "header is not a msgpack map";
        return -1;
    }
    while (pending) {
        if (pos >= n) {
            *why = "msgpack header ends inside an object";
            return -1;
        }
        size_t head;
        uint64_t body, kids;
        if (mp_item(p + pos, n - pos, &head, &body, &kids) < 0) {
            *why = "msgpack header uses the reserved byte 0xc1";
            return -1;
        }
        if (head > n - pos || body > n - pos - head) {
            *why = "msgpack length runs past the end of the header";
            return -1;
        }
        pos += head + (size_t)body;
        pending--;
        left[depth]--;
        /* Each child takes at least one byte, so more children than the
         * bytes that remain cannot be real. */
        if (kids > n - pos || pending + kids > n - pos) {
            *why = "msgpack element count exceeds the bytes in the header";
            return -1;
        }
        if (kids) {
            if (depth == DFS_MAX_DEPTH) {
                *why = "msgpack header nested too deeply";
                return -1;
            }
            left[++depth] = kids;
            pending += kids;
        }
        while (depth > 0 && left[depth] == 0) depth--;
    }
    if (pos != n) {
        *why = "bytes after the msgpack map in the header";
        return -1;
    }
    return 0;
}

int dfs_mp_parse(msgpack_unpacked *out, const uint8_t *p, size_t n, const char **why) {
    if (dfs_mp_prescan(p, n, why)) return -1;
    size_t off = 0;
    msgpack_unpacked_init(out);
    msgpack_unpack_return r = msgpack_unpack_next(out, (const char *)p, n, &off);
    if (r != MSGPACK_UNPACK_SUCCESS || off != n || out->data.type != MSGPACK_OBJECT_MAP) {
        /* NOMEM is treated as bad input: the pre-scan should make it impossible. */
        *why = r == MSGPACK_UNPACK_NOMEM_ERROR ? "msgpack header too large to unpack" : "malformed msgpack header";
        msgpack_unpacked_destroy(out);
        return -1;
    }
    return 0;
}

/* ---- field access ---------------------------------------------------------- */

static int key_is(const msgpack_object *k, const char *key, size_t len) {
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == len && !memcmp(k->via.str.ptr, key, len);
}

const msgpack_object *dfs_mp_get(const msgpack_object *map, const char *key) {
    if (map->type != MSGPACK_OBJECT_MAP) return NULL;
    size_t len = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (key_is(&map->via.map.ptr[i].key, key, len)) return &map->via.map.ptr[i].val;
    return NULL;
}

/* Quadratic, but headers are capped and maps in them are small. */
const msgpack_object_kv *dfs_mp_dup_key(const msgpack_object *map) {
    const msgpack_object_kv *kv = map->via.map.ptr;
    uint32_t n = map->via.map.size;
    for (uint32_t i = 0; i < n; i++) {
        if (kv[i].key.type != MSGPACK_OBJECT_STR) continue;
        for (uint32_t j = i + 1; j < n; j++)
            if (key_is(&kv[j].key, kv[i].key.via.str.ptr, kv[i].key.via.str.size)) return &kv[i];
    }
    return NULL;
}

int dfs_mp_u64(const msgpack_object *o, uint64_t *v) {
    if (!o || o->type != MSGPACK_OBJECT_POSITIVE_INTEGER) return -1;
    *v = o->via.u64;
    return 0;
}

int dfs_utf8_ok(const char *s, size_t n) {
    const uint8_t *p = (const uint8_t *)s, *end = p + n;
    while (p < end) {
        uint8_t c = *p;
        if (c == 0) return 0;
        if (c < 0x80) { p++; continue; }
        int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
        if (len == 0 || c > 0xf4 || c == 0xc0 || c == 0xc1 || end - p < len) return 0;
        uint32_t cp = c & (0x7f >> len);
        for (int i = 1; i < len; i++) {
            if ((p[i] & 0xc0) != 0x80) return 0;
            cp = cp << 6 | (p[i] & 0x3f);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        p += len;
    }
    return 1;
}

int dfs_mp_str(const msgpack_object *o, char *buf, size_t cap) {
    if (!o || o->type != MSGPACK_OBJECT_STR || o->via.str.size >= cap) return -1;
    if (!dfs_utf8_ok(o->via.str.ptr, o->via.str.size)) return -1;
    memcpy(buf, o->via.str.ptr, o->via.str.size);
    buf[o->via.str.size] = 0;
    return 0;
}

int dfs_mp_str_eq(const msgpack_object *o, const char *s) {
    return o && key_is(o, s, strlen(s));
}

/* ---- msgpack <-> JSON --------------------------------------------------- */

/* Where a conversion is in the header: the dotted path of map keys and
 * array indices from the header map ("meta.target.hidden_size",
 * "meta.layer_ids[1]"), so that a refusal names the field. */
typedef struct {
    char   path[512];
    size_t len;
    char  *why;
    size_t whylen;
} to_json_ctx;

/* The field at the current path as a message names it: meta's fields as
 * the stream meta checks do (meta "target.hidden_size"), others quoted. */
static void field_name(const to_json_ctx *c, char *buf, size_t n) {
    if (c->len == 0) snprintf(buf, n, "the header");
    else if (strncmp(c->path, "meta.", 5) == 0) snprintf(buf, n, "meta \"%s\"", c->path + 5);
    else snprintf(buf, n, "\"%s\"", c->path);
}

/* Refuse the value at the current path: "<field> <what>" into why. Always
 * writes why, so no caller ever prints an unset buffer. */
static json_t *refuse(const to_json_ctx *c, const char *what) {
    char f[600];
    field_name(c, f, sizeof f);
    snprintf(c->why, c->whylen, "%s %s", f, what);
    return NULL;
}

/* Append ".key" or "[i]" to the path; each returns the old length, for
 * path_pop. A path too long for the buffer is cut: it only feeds a message. */
static size_t path_grow(to_json_ctx *c, int k) {
    size_t old = c->len, room = sizeof c->path - c->len;
    c->len += k < 0 ? 0 : (size_t)k < room ? (size_t)k : room - 1;
    return old;
}

static size_t path_key(to_json_ctx *c, const char *key) {
    return path_grow(c, snprintf(c->path + c->len, sizeof c->path - c->len, "%s%s", c->len ? "." : "", key));
}

static size_t path_index(to_json_ctx *c, uint32_t i) {
    return path_grow(c, snprintf(c->path + c->len, sizeof c->path - c->len, "[%u]", (unsigned)i));
}

static void path_pop(to_json_ctx *c, size_t old) {
    c->len = old;
    c->path[old] = 0;
}

static json_t *to_json(to_json_ctx *c, const msgpack_object *o);

static json_t *float_to_json(to_json_ctx *c, double v) {
    /* JSON has no NaN or infinity; jansson's json_real returns NULL for them. */
    if (isnan(v)) return refuse(c, "is NaN, not a finite number");
    if (isinf(v)) return refuse(c, v > 0 ? "is Infinity, not a finite number" : "is -Infinity, not a finite number");
    json_t *j = json_real(v);
    return j ? j : refuse(c, "cannot be converted to JSON (out of memory)");
}

static json_t *array_to_json(to_json_ctx *c, const msgpack_object *o) {
    json_t *a = json_array();
    if (!a) return refuse(c, "cannot be converted to JSON (out of memory)");
    for (uint32_t i = 0; i < o->via.array.size; i++) {
        size_t old = path_index(c, i);
        json_t *v = to_json(c, &o->via.array.ptr[i]);
        if (v && json_array_append_new(a, v)) v = refuse(c, "cannot be converted to JSON (out of memory)");
        if (!v) {
            json_decref(a);
            return NULL;
        }
        path_pop(c, old);
    }
    return a;
}

static json_t *map_to_json(to_json_ctx *c, const msgpack_object *o) {
    const msgpack_object_kv *dup = dfs_mp_dup_key(o);
    if (dup) {
        char what[300];
        const int klen = (int)(dup->key.via.str.size > 255 ? 255 : dup->key.via.str.size);
        snprintf(what, sizeof what, "repeats the key \"%.*s\"", klen, dup->key.via.str.ptr);
        return refuse(c, what);
    }
    json_t *m = json_object();
    if (!m) return refuse(c, "cannot be converted to JSON (out of memory)");
    for (uint32_t i = 0; i < o->via.map.size; i++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[i];
        char key[256];
        if (dfs_mp_str(&kv->key, key, sizeof key)) {
            json_decref(m);
            return refuse(c, "has a key that is not a UTF-8 string of at most 255 bytes");
        }
        size_t old = path_key(c, key);
        json_t *v = to_json(c, &kv->val);
        if (v && json_object_set_new(m, key, v)) v = refuse(c, "cannot be converted to JSON (out of memory)");
        if (!v) {
            json_decref(m);
            return NULL;
        }
        path_pop(c, old);
    }
    return m;
}

static json_t *to_json(to_json_ctx *c, const msgpack_object *o) {
    json_t *j = NULL;
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: j = json_null(); break;
    case MSGPACK_OBJECT_BOOLEAN: j = json_boolean(o->via.boolean); break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (o->via.u64 > INT64_MAX) return refuse(c, "is an integer above 2^63-1, which JSON readers cannot hold");
        j = json_integer((json_int_t)o->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: j = json_integer((json_int_t)o->via.i64); break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return float_to_json(c, o->via.f64);
    case MSGPACK_OBJECT_STR:
        if (!dfs_utf8_ok(o->via.str.ptr, o->via.str.size)) return refuse(c, "is not valid UTF-8 (or contains NUL)");
        j = json_stringn(o->via.str.ptr, o->via.str.size);
        break;
    case MSGPACK_OBJECT_ARRAY: return array_to_json(c, o);
    case MSGPACK_OBJECT_MAP: return map_to_json(c, o);
    default: return refuse(c, "is of a type JSON cannot hold (bin or ext)");
    }
    return j ? j : refuse(c, "cannot be converted to JSON (out of memory)");
}

json_t *dfs_mp_to_json(const msgpack_object *o, char *why, size_t whylen) {
    to_json_ctx c = {.len = 0, .why = why, .whylen = whylen};
    c.path[0] = 0;
    return to_json(&c, o);
}

int dfs_mp_pack_cstr(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    int rc = msgpack_pack_str(pk, n);
    return rc ? rc : msgpack_pack_str_body(pk, s, n);
}

int dfs_mp_pack_json(msgpack_packer *pk, const json_t *j) {
    int rc = 0;
    switch (json_typeof(j)) {
    case JSON_NULL: return msgpack_pack_nil(pk);
    case JSON_TRUE: return msgpack_pack_true(pk);
    case JSON_FALSE: return msgpack_pack_false(pk);
    case JSON_INTEGER: return msgpack_pack_int64(pk, (int64_t)json_integer_value(j));
    case JSON_REAL: return msgpack_pack_double(pk, json_real_value(j));
    case JSON_STRING: {
        size_t n = json_string_length(j);
        rc = msgpack_pack_str(pk, n);
        return rc ? rc : msgpack_pack_str_body(pk, json_string_value(j), n);
    }
    case JSON_ARRAY: {
        size_t i;
        json_t *v;
        rc = msgpack_pack_array(pk, json_array_size(j));
        json_array_foreach(j, i, v) if (!rc) rc = dfs_mp_pack_json(pk, v);
        return rc;
    }
    case JSON_OBJECT: {
        const char *k;
        json_t *v;
        rc = msgpack_pack_map(pk, json_object_size(j));
        json_object_foreach((json_t *)j, k, v) {
            if (!rc) rc = dfs_mp_pack_cstr(pk, k);
            if (!rc) rc = dfs_mp_pack_json(pk, v);
        }
        return rc;
    }
    }
    return -1;
}
