/* dfs_meta.c: the hidden-state meta map, the identity diff between stream
 * headers, and the per-sample checks of a hidden-state stream
 * (formats/dflash-stream.md, "Hidden-state streams"). */
#include "dfs_internal.h"

#include "common.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* The meta keys that say what a stream's tensors mean. Streams that differ
 * in any of them cannot be merged or concatenated. */
static const char *const identity_fields[] = {
    "target.architecture", "target.model_type", "target.config_digest", "target.hidden_size",
    "target.num_layers",   "target.vocab_size", "layer_ids",            "layer_convention",
    "hidden_dtype",        "has_target_ids",    "has_last_hidden",
};

json_t *dfs_hs_meta_to_json(const dfs_hs_meta *m) {
    json_t *ids = json_array();
    for (int i = 0; i < m->nlayers; i++) json_array_append_new(ids, json_integer(m->layer_ids[i]));
    return json_pack("{s:{s:s, s:s, s:s, s:I, s:I, s:I}, s:o, s:s, s:s, s:b, s:b}",
                     "target", "architecture", m->architecture, "model_type", m->model_type, "config_digest",
                     m->config_digest, "hidden_size", (json_int_t)m->hidden_size, "num_layers",
                     (json_int_t)m->num_layers, "vocab_size", (json_int_t)m->vocab_size, "layer_ids", ids,
                     "layer_convention", "output-of-layer", "hidden_dtype", m->hidden_dtype, "has_target_ids",
                     m->has_target_ids, "has_last_hidden", m->has_last_hidden);
}

/* The meta checked is the first stream header's, which a stream must start
 * with: record 0, at byte 0. */
static int meta_bad(const char *path, const char *field, const char *what) {
    return dfl_err(DFL_EX_DATA, "%s: byte 0 (record 0): stream meta: \"%s\" %s", path, field, what);
}

static int get_str(const json_t *o, const char *key, char *buf, size_t n, const char *path, const char *field) {
    const json_t *v = json_object_get(o, key);
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) >= n)
        return meta_bad(path, field, "must be a non-empty string");
    memcpy(buf, json_string_value(v), json_string_length(v) + 1);
    return 0;
}

static int get_pos(const json_t *o, const char *key, int64_t *v, const char *path, const char *field) {
    const json_t *j = json_object_get(o, key);
    if (!json_is_integer(j) || json_integer_value(j) <= 0) return meta_bad(path, field, "must be a positive integer");
    *v = json_integer_value(j);
    return 0;
}

static int get_bool(const json_t *o, const char *key, int *v, const char *path) {
    const json_t *j = json_object_get(o, key);
    if (!json_is_boolean(j)) return meta_bad(path, key, "must be true or false");
    *v = json_is_true(j);
    return 0;
}

static int digest_ok(const char *s) {
    if (strlen(s) != 16) return 0;
    for (; *s; s++)
        if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f'))) return 0;
    return 1;
}

static int layer_ids_from_json(const json_t *ids, dfs_hs_meta *m, const char *path) {
    size_t n = json_array_size(ids);
    if (!json_is_array(ids) || n == 0 || n > 64)
        return meta_bad(path, "layer_ids", "must be an array of 1 to 64 layer ids");
    m->nlayers = (int)n;
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(ids, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= m->num_layers)
            return meta_bad(path, "layer_ids", "must hold integers in [0, target.num_layers)");
        m->layer_ids[i] = (int)json_integer_value(v);
        for (size_t j = 0; j < i; j++)
            if (m->layer_ids[j] == m->layer_ids[i]) return meta_bad(path, "layer_ids", "repeats a layer");
    }
    return 0;
}

int dfs_hs_meta_from_json(const json_t *meta, dfs_hs_meta *m, const char *path) {
    memset(m, 0, sizeof *m);
    const json_t *t = json_object_get(meta, "target");
    if (!json_is_object(t)) return meta_bad(path, "target", "must be a map (is this a hidden-state stream?)");
    int rc;
    if ((rc = get_str(t, "architecture", m->architecture, sizeof m->architecture, path, "target.architecture")) ||
        (rc = get_str(t, "model_type", m->model_type, sizeof m->model_type, path, "target.model_type")) ||
        (rc = get_str(t, "config_digest", m->config_digest, sizeof m->config_digest, path, "target.config_digest")) ||
        (rc = get_pos(t, "hidden_size", &m->hidden_size, path, "target.hidden_size")) ||
        (rc = get_pos(t, "num_layers", &m->num_layers, path, "target.num_layers")) ||
        (rc = get_pos(t, "vocab_size", &m->vocab_size, path, "target.vocab_size")))
        return rc;
    if (!digest_ok(m->config_digest)) return meta_bad(path, "target.config_digest", "must be 16 lowercase hex digits");
    if ((rc = layer_ids_from_json(json_object_get(meta, "layer_ids"), m, path))) return rc;
    const json_t *conv = json_object_get(meta, "layer_convention");
    if (!json_is_string(conv) || strcmp(json_string_value(conv), "output-of-layer"))
        return meta_bad(path, "layer_convention", "must be \"output-of-layer\"");
    if ((rc = get_str(meta, "hidden_dtype", m->hidden_dtype, sizeof m->hidden_dtype, path, "hidden_dtype"))) return rc;
    dfl_dtype dt;
    if (dfl_dtype_parse(m->hidden_dtype, &dt) || (dt != DFL_BF16 && dt != DFL_F16 && dt != DFL_F32))
        return meta_bad(path, "hidden_dtype", "must be \"bf16\", \"f16\" or \"f32\"");
    if ((rc = get_bool(meta, "has_target_ids", &m->has_target_ids, path)) ||
        (rc = get_bool(meta, "has_last_hidden", &m->has_last_hidden, path)))
        return rc;
    int64_t width;
    if (m->hidden_size > (INT64_C(1) << 40) || (width = m->hidden_size * m->nlayers) > (INT64_C(1) << 40))
        return meta_bad(path, "target.hidden_size", "is implausibly large");
    return 0;
}

/* The value at a dotted path ("target.hidden_size"), or NULL. */
static const json_t *at_path(const json_t *o, const char *path) {
    const char *dot = strchr(path, '.');
    if (!dot) return json_object_get(o, path);
    char head[64];
    snprintf(head, sizeof head, "%.*s", (int)(dot - path), path);
    return at_path(json_object_get(o, head), dot + 1);
}

static void append(char *buf, size_t n, size_t *len, const char *s) {
    size_t k = strlen(s);
    if (*len + 1 >= n) return;
    if (k > n - *len - 1) k = n - *len - 1;
    memcpy(buf + *len, s, k);
    *len += k;
    buf[*len] = 0;
}

static void append_value(char *buf, size_t n, size_t *len, const json_t *v) {
    char *s = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    char cut[120];
    snprintf(cut, sizeof cut, "%s", s ? s : "(absent)");
    free(s);
    append(buf, n, len, cut);
}

int dfs_meta_diff(const json_t *a, const json_t *b, char *buf, size_t n) {
    int count = 0;
    size_t len = 0;
    if (n) buf[0] = 0;
    for (size_t i = 0; i < sizeof identity_fields / sizeof identity_fields[0]; i++) {
        const json_t *va = at_path(a, identity_fields[i]), *vb = at_path(b, identity_fields[i]);
        if ((!va && !vb) || (va && vb && json_equal(va, vb))) continue;
        if (count++) append(buf, n, &len, "; ");
        append(buf, n, &len, identity_fields[i]);
        append(buf, n, &len, ": ");
        append_value(buf, n, &len, va);
        append(buf, n, &len, " vs ");
        append_value(buf, n, &len, vb);
    }
    return count;
}

/* ---- hidden-state samples ------------------------------------------------ */

static int shape_is(const dfs_tensor *t, int ndim, int64_t d0, int64_t d1) {
    return t->ndim == ndim && t->shape[0] == d0 && (ndim < 2 || t->shape[1] == d1);
}

int dfs_sample_err(const char *path, uint64_t offset, uint64_t record, const char *id, const char *fmt, ...) {
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return dfl_err(DFL_EX_DATA, "%s: byte %" PRIu64 " (record %" PRIu64 "): sample \"%s\": %s", path, offset, record,
                   id ? id : "", msg);
}

#define sample_bad(path, s, ...) dfs_sample_err(path, (s)->offset, (s)->record, (s)->id, __VA_ARGS__)

/* Check one tensor's presence, dtype and shape ([T] or [T, width]). */
static int want_tensor(const char *path, const dfs_sample *s, const char *name, dfl_dtype dt, int ndim, int64_t T,
                       int64_t width) {
    const dfs_tensor *t = dfs_find((dfs_sample *)s, name);
    char want[96];
    if (ndim == 1) snprintf(want, sizeof want, "%s [%" PRId64 "]", dfl_dtype_name(dt), T);
    else snprintf(want, sizeof want, "%s [%" PRId64 ", %" PRId64 "]", dfl_dtype_name(dt), T, width);
    if (!t) return sample_bad(path, s, "tensor \"%s\" is missing (want %s)", name, want);
    if (t->dtype != dt || !shape_is(t, ndim, T, width))
        return sample_bad(path, s, "tensor \"%s\" must be %s", name, want);
    return 0;
}

/* Values of decoded tensors: token ids below the vocabulary, mask 0 or 1. */
static int check_values(const char *path, const dfs_sample *s, const dfs_hs_meta *m) {
    static const char *const ids[2] = {"input_ids", "target_ids"};
    for (int k = 0; k < 2; k++) {
        const dfs_tensor *t = dfs_find((dfs_sample *)s, ids[k]);
        if (!t || !t->data) continue;
        const int32_t *v = t->data;
        for (int64_t i = 0; i < t->shape[0]; i++)
            if (v[i] < 0 || v[i] >= m->vocab_size)
                return sample_bad(path, s, "tensor \"%s\"[%" PRId64 "] is %" PRId32
                                  ", outside the vocabulary [0, %" PRId64 ")", ids[k], i, v[i], m->vocab_size);
    }
    const dfs_tensor *mask = dfs_find((dfs_sample *)s, "loss_mask");
    if (mask && mask->data) {
        const uint8_t *v = mask->data;
        for (int64_t i = 0; i < mask->shape[0]; i++)
            if (v[i] > 1)
                return sample_bad(path, s, "tensor \"loss_mask\"[%" PRId64 "] is %d, not 0 or 1", i, (int)v[i]);
    }
    return 0;
}

int dfs_hs_check_sample(const dfs_hs_meta *m, const dfs_sample *s, const char *path) {
    const dfs_tensor *ids = dfs_find((dfs_sample *)s, "input_ids");
    if (!ids || ids->ndim != 1 || ids->shape[0] < 1)
        return sample_bad(path, s, "tensor \"input_ids\" must be i32 [T] with T >= 1");
    int64_t T = ids->shape[0];
    dfl_dtype hd;
    dfl_dtype_parse(m->hidden_dtype, &hd);
    int rc;
    if ((rc = want_tensor(path, s, "input_ids", DFL_I32, 1, T, 0)) ||
        (rc = want_tensor(path, s, "loss_mask", DFL_U8, 1, T, 0)) ||
        (rc = want_tensor(path, s, "hidden", hd, 2, T, m->hidden_size * m->nlayers)))
        return rc;
    if (m->has_target_ids && (rc = want_tensor(path, s, "target_ids", DFL_I32, 1, T, 0))) return rc;
    if (m->has_last_hidden && (rc = want_tensor(path, s, "last_hidden", hd, 2, T, m->hidden_size))) return rc;
    return check_values(path, s, m);
}
