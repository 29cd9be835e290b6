/* extract.c: batching samples through the target and writing the stream. */
#include "extract.h"

#include "cli.h"
#include "common.h"

#include <errno.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- layer ids ---------------------------------------------------------- */

static int parse_list(const char *list, int L, int *ids, int *n) {
    *n = 0;
    const char *s = list;
    if (!*s) return dfl_err(DFL_EX_USAGE, "--layers: empty list");
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*end && *end != ','))
            return dfl_err(DFL_EX_USAGE, "--layers: '%s' is not a comma-separated list of layer ids", list);
        if (v < 0 || v >= L)
            return dfl_err(DFL_EX_USAGE, "--layers: layer id %ld is outside [0, %d) for this %d-layer target", v, L, L);
        if (*n == DFL_EXTRACT_MAX_TAPS) return dfl_err(DFL_EX_USAGE, "--layers: more than %d ids", DFL_EXTRACT_MAX_TAPS);
        ids[(*n)++] = (int)v;
        if (!*end) return 0;
        s = end + 1;
    }
}

static int from_drafter(const char *path, int L, int *ids, int *n) {
    json_t *j;
    int rc = dfl_load_json(path, DFL_JSON_FILE_MAX, "drafter config.json", &j);
    if (rc) return rc;
    json_t *ntl = json_object_get(j, "num_target_layers");
    json_t *ids_j = json_object_get(json_object_get(j, "dflash_config"), "target_layer_ids");
    *n = 0;
    if (json_is_integer(ntl) && json_integer_value(ntl) != L) {
        rc = dfl_err(DFL_EX_DATA, "%s: num_target_layers is %lld but the target has %d layers", path,
                     (long long)json_integer_value(ntl), L);
    } else if (ids_j) {
        size_t i;
        json_t *v;
        if (!json_is_array(ids_j) || json_array_size(ids_j) == 0 || json_array_size(ids_j) > DFL_EXTRACT_MAX_TAPS)
            rc = dfl_err(DFL_EX_DATA, "%s: dflash_config.target_layer_ids: not a list of 1 to %d ids", path,
                         DFL_EXTRACT_MAX_TAPS);
        json_array_foreach(ids_j, i, v) {
            if (rc) break;
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= L)
                rc = dfl_err(DFL_EX_DATA, "%s: dflash_config.target_layer_ids[%zu]: not a layer id in [0, %d)", path, i, L);
            else ids[(*n)++] = (int)json_integer_value(v);
        }
    } else { /* the reference computes a default from the draft depth */
        json_t *nd = json_object_get(j, "num_hidden_layers");
        if (!json_is_integer(nd) || json_integer_value(nd) < 1 || json_integer_value(nd) > DFL_EXTRACT_MAX_TAPS)
            rc = dfl_err(DFL_EX_DATA, "%s: no dflash_config.target_layer_ids and no usable num_hidden_layers", path);
        else {
            *n = (int)json_integer_value(nd);
            dfl_default_layer_ids(L, *n, ids);
            /* the rule spreads over [1, L-3]: below 4 layers it leaves the target */
            for (int i = 0; i < *n && !rc; i++)
                if (ids[i] < 0 || ids[i] >= L)
                    rc = dfl_err(DFL_EX_DATA, "%s: the default target_layer_ids (%d taps) do not fit a %d-layer target; "
                                 "give dflash_config.target_layer_ids", path, *n, L);
        }
    }
    json_decref(j);
    return rc;
}

int dfl_extract_check_drafter(const char *path, int64_t hidden_size, int64_t vocab_size) {
    json_t *j;
    int rc = dfl_load_json(path, DFL_JSON_FILE_MAX, "drafter config.json", &j); /* read once already by dfl_extract_layer_ids */
    if (rc) return rc;
    const char *keys[2] = {"hidden_size", "vocab_size"};
    const int64_t want[2] = {hidden_size, vocab_size};
    for (int i = 0; i < 2 && !rc; i++) {
        json_t *v = json_object_get(j, keys[i]);
        if (json_is_integer(v) && json_integer_value(v) != want[i])
            rc = dfl_err(DFL_EX_DATA, "%s: %s is %lld but the target's is %lld (a drafter for another target)", path,
                         keys[i], (long long)json_integer_value(v), (long long)want[i]);
    }
    json_decref(j);
    return rc;
}

/* The stream stores each tapped layer once (dfs_hs_meta refuses repeats). */
static int find_repeat(const int *ids, int n) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (ids[i] == ids[j]) return i;
    return -1;
}

static void format_ids(char *buf, size_t cap, const int *ids, int n) {
    buf[0] = 0;
    for (int i = 0; i < n; i++) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%d", i ? "," : "", ids[i]);
}

int dfl_extract_layer_ids(const char *list, const char *drafter_config, int L, int *ids, int *n) {
    char buf[512];
    int rc, r;
    if (list) {
        if ((rc = parse_list(list, L, ids, n))) return rc;
        if ((r = find_repeat(ids, *n)) >= 0)
            return dfl_err(DFL_EX_USAGE, "--layers: layer id %d is repeated (a stream holds each layer once)", ids[r]);
        return 0;
    }
    if (drafter_config) {
        if ((rc = from_drafter(drafter_config, L, ids, n))) return rc;
        if ((r = find_repeat(ids, *n)) >= 0)
            return dfl_err(DFL_EX_DATA, "%s: target_layer_ids repeats layer %d, which a stream cannot hold", drafter_config,
                           ids[r]);
        return 0;
    }
    *n = 5;
    dfl_default_layer_ids(L, 5, ids);
    format_ids(buf, sizeof buf, ids, *n);
    for (int i = 0; i < *n; i++)
        if (ids[i] < 0 || ids[i] >= L)
            return dfl_err(DFL_EX_USAGE, "the default layer ids do not fit a %d-layer target; give --layers", L);
    /* Below 8 layers the reference rule repeats ids (6 layers: 1,2,2,2,3). */
    if (find_repeat(ids, *n) >= 0)
        return dfl_err(DFL_EX_USAGE, "the reference rule gives layer ids %s for this %d-layer target, with repeats, "
                                     "which a stream cannot hold; give --layers", buf, L);
    return 0;
}

json_t *dfl_extract_meta(const dfl_target *t, const dfl_extract_opts *o) {
    const dfl_model_config *c = dfl_target_config(t);
    dfs_hs_meta m;
    memset(&m, 0, sizeof m);
    snprintf(m.architecture, sizeof m.architecture, "%s", c->architecture);
    snprintf(m.model_type, sizeof m.model_type, "%s", c->model_type);
    snprintf(m.config_digest, sizeof m.config_digest, "%s", c->digest);
    m.hidden_size = c->hidden_size;
    m.num_layers = c->num_hidden_layers;
    m.vocab_size = c->vocab_size;
    m.nlayers = o->ntaps;
    for (int i = 0; i < o->ntaps; i++) m.layer_ids[i] = o->taps[i];
    snprintf(m.hidden_dtype, sizeof m.hidden_dtype, "bf16");
    m.has_target_ids = o->with_target_ids;
    m.has_last_hidden = o->with_last_hidden;
    return dfs_hs_meta_to_json(&m);
}

/* ---- the batch of pending samples --------------------------------------- */

typedef struct {
    int64_t  n, cap;          /* samples */
    char   **id;
    int32_t *cu;              /* [n+1] */
    int64_t  tok_cap;
    int32_t *ids;             /* [cu[n]] */
    uint8_t *mask;
} batch;

static void batch_add(batch *b, const dfl_jsonl_sample *s) {
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 16;
        b->id = dfl_realloc(b->id, (size_t)b->cap * sizeof *b->id);
        b->cu = dfl_realloc(b->cu, (size_t)(b->cap + 1) * sizeof *b->cu);
        if (b->n == 0) b->cu[0] = 0;
    }
    int64_t T = b->cu[b->n], need = T + s->n;
    if (need > b->tok_cap) {
        while (b->tok_cap < need) b->tok_cap = b->tok_cap ? 2 * b->tok_cap : 4096;
        b->ids = dfl_realloc(b->ids, (size_t)b->tok_cap * sizeof *b->ids);
        b->mask = dfl_realloc(b->mask, (size_t)b->tok_cap);
    }
    memcpy(b->ids + T, s->input_ids, (size_t)s->n * sizeof *b->ids);
    memcpy(b->mask + T, s->loss_mask, (size_t)s->n);
    b->id[b->n] = dfl_strdup(s->id);
    b->cu[b->n + 1] = (int32_t)need;
    b->n++;
}

static void batch_clear(batch *b) {
    for (int64_t i = 0; i < b->n; i++) free(b->id[i]);
    b->n = 0;
}

static void batch_free(batch *b) {
    batch_clear(b);
    free(b->id);
    free(b->cu);
    free(b->ids);
    free(b->mask);
}

/* A sample's tensors on the host, ready to encode. */
typedef struct {
    uint16_t *hidden, *last;
    int32_t  *tids;
    int64_t   cap;   /* rows */
    dfs_tensor_in tv[5];
    int       nt;
} rec_bufs;

/* The states in the device's host memory (page-locked on CUDA): they come
 * down at the link's rate. */
static void rec_reserve(rec_bufs *r, const dfl_ops *ops, int64_t T, int64_t K, int64_t H) {
    if (T <= r->cap) return;
    ops->host_free(r->hidden);
    ops->host_free(r->last);
    free(r->tids);
    r->hidden = ops->host_alloc((size_t)(T * K * H) * sizeof *r->hidden);
    r->last = ops->host_alloc((size_t)(T * H) * sizeof *r->last);
    r->tids = dfl_malloc((size_t)T * sizeof *r->tids);
    r->cap = T;
}

static void rec_free(rec_bufs *r, const dfl_ops *ops) {
    ops->host_free(r->hidden);
    ops->host_free(r->last);
    free(r->tids);
}

/* ---- the pipeline: the device runs a batch while the host writes the one before ----
 *
 * A batch goes through three stages: its forward is started (on a GPU the
 * call returns while the device works), its records are fetched (brought
 * to the host, which waits for the forward there), and they are written
 * (encoded in parallel, then written in order). The next batch's forward
 * starts before the previous batch is written, so the tool's slowest host
 * work (byte shuffle and LZ4 at ~0.5 GB/s a core, where a GPU makes ~1.7
 * GB/s of Qwen3-8B taps, and the disk) overlaps the device's forward
 * instead of following it. A batch is fetched before the next one starts
 * (the target's outputs are one set of device buffers), and the host holds
 * two batches' samples at most: the one being written and the one being
 * gathered. On the CPU the forward is done when its call returns: the same
 * stages in the same order, the same bytes.
 *
 * Writing encodes a wave of samples at once, one encoder each: two a thread
 * keep the threads busy when samples differ in length; at most MAX_SLOTS,
 * as each holds its record encoded (8 x 168 MB for 4096-token samples of
 * Qwen3-8B's 5 taps), and 8 encoders make ~4 GB/s. The stream is the same
 * bytes whatever the thread count. */
enum { MAX_SLOTS = 8 };

typedef struct {
    batch     b;
    rec_bufs *r;     /* one per sample of b, once fetched */
    int64_t   nr;
} stage;

typedef struct {
    dfs_encoded *enc[MAX_SLOTS];
    int          rc[MAX_SLOTS];
} encoders;

static void stage_free(stage *g, const dfl_ops *ops) {
    for (int64_t i = 0; i < g->nr; i++) rec_free(&g->r[i], ops);
    free(g->r);
    batch_free(&g->b);
}

/* Sample s of the batch into r: its tensors on the host, listed in r->tv. */
static void sample_tensors(dfl_target *t, const dfl_target_out *out, const batch *b, int64_t s, rec_bufs *r,
                           const dfl_extract_opts *o) {
    const dfl_ops *ops = dfl_target_ops(t);
    const int64_t H = dfl_target_config(t)->hidden_size, K = o->ntaps;
    const int64_t r0 = b->cu[s], n = b->cu[s + 1] - r0;
    rec_reserve(r, ops, n, K, H);
    dfs_tensor_in *tv = r->tv;
    int nt = 0;
    tv[nt++] = (dfs_tensor_in){"input_ids", DFL_I32, 1, {n}, b->ids + r0, NULL};
    tv[nt++] = (dfs_tensor_in){"loss_mask", DFL_U8, 1, {n}, b->mask + r0, NULL};
    dfl_target_taps_to_bf16(t, out, r0, n, r->hidden);
    tv[nt++] = (dfs_tensor_in){"hidden", DFL_BF16, 2, {n, K * H}, r->hidden, NULL};
    if (o->with_target_ids) {
        ops->download(r->tids, out->argmax + r0, (size_t)n * sizeof(int32_t));
        tv[nt++] = (dfs_tensor_in){"target_ids", DFL_I32, 1, {n}, r->tids, NULL};
    }
    if (o->with_last_hidden) {
        ops->act_to_bf16(r->last, DFL_AT(ops, out->last_hidden, r0 * H), n * H);
        tv[nt++] = (dfs_tensor_in){"last_hidden", DFL_BF16, 2, {n, H}, r->last, NULL};
    }
    r->nt = nt;
}

/* Stage 1: the forward of g's batch, started. */
static int start_forward(dfl_target *t, stage *g, dfl_target_out *out, const dfl_extract_opts *o,
                         dfl_extract_stats *st) {
    dfl_target_batch in = {g->b.ids, g->b.cu, g->b.n};
    dfl_target_want want = {
        .ntaps = o->ntaps, .taps = o->taps, .last_hidden = o->with_last_hidden, .argmax = o->with_target_ids};
    int rc = dfl_target_forward(t, out, &in, &want);
    if (!rc) st->batches++;
    return rc;
}

/* Stage 2: every sample's tensors on the host (the first download waits
 * for the forward). */
static void fetch_records(dfl_target *t, stage *g, const dfl_target_out *out, const dfl_extract_opts *o) {
    if (g->b.n > g->nr) {
        g->r = dfl_realloc(g->r, (size_t)g->b.n * sizeof *g->r);
        memset(g->r + g->nr, 0, (size_t)(g->b.n - g->nr) * sizeof *g->r);
        g->nr = g->b.n;
    }
    for (int64_t s = 0; s < g->b.n; s++) sample_tensors(t, out, &g->b, s, &g->r[s], o);
}

/* Stage 3: g's records encoded a wave at a time, written in order; the
 * batch is then empty. */
static int write_records(stage *g, encoders *e, dfs_writer *w, dfl_extract_stats *st) {
    const int wave = 2 * omp_get_max_threads() < MAX_SLOTS ? 2 * omp_get_max_threads() : MAX_SLOTS;
    const batch *b = &g->b;
    int rc = 0;
    for (int i = 0; i < wave; i++)
        if (!e->enc[i]) e->enc[i] = dfs_encoded_new();
    for (int64_t s0 = 0; s0 < b->n && !rc; s0 += wave) {
        const int m = (int)(b->n - s0 < wave ? b->n - s0 : wave);
#pragma omp parallel for schedule(dynamic, 1) if (m > 1)
        for (int i = 0; i < m; i++) e->rc[i] = dfs_encode_sample(w, e->enc[i], b->id[s0 + i], g->r[s0 + i].nt, g->r[s0 + i].tv);
        for (int i = 0; i < m && !rc; i++) {
            const rec_bufs *r = &g->r[s0 + i];
            /* an encoder's message is its thread's: encode that sample again here */
            if (e->rc[i]) rc = dfs_encode_sample(w, e->enc[i], b->id[s0 + i], r->nt, r->tv);
            if (!rc) rc = dfs_write_encoded(w, e->enc[i]);
            if (!rc) {
                st->samples++;
                st->tokens += b->cu[s0 + i + 1] - b->cu[s0 + i];
            }
        }
    }
    batch_clear(&g->b);
    return rc;
}

/* The gathered batch through its forward, and the batch before it written
 * meanwhile: then the gathered one is the one to write next, and the
 * other, emptied, gathers. On a forward's error the batch before is still
 * written (as it was before the forward started). */
static int advance(dfl_target *t, stage **gather, stage **ready, encoders *e, dfs_writer *w,
                   const dfl_extract_opts *o, dfl_extract_stats *st) {
    dfl_target_out out;
    int rc = start_forward(t, *gather, &out, o, st);
    const int wrc = (*ready)->b.n ? write_records(*ready, e, w, st) : 0;
    if (rc || wrc) return rc ? rc : wrc;
    fetch_records(t, *gather, &out, o);
    stage *x = *gather;
    *gather = *ready, *ready = x;
    return 0;
}

int dfl_extract_run(dfl_target *t, dfl_jsonl *in, dfs_writer *w, const dfl_extract_opts *o, dfl_extract_stats *st) {
    memset(st, 0, sizeof *st);
    stage stages[2] = {0};
    stage *gather = &stages[0], *ready = &stages[1];
    encoders e = {0};
    dfl_progress pr;
    dfl_progress_init(&pr, o->progress, 0, "tok");
    int rc = 0, input_rc = 0;
    char *input_msg = NULL;
    for (;;) {
        dfl_jsonl_sample s;
        int r = dfl_jsonl_next(in, &s);
        if (r == 0) break;
        if (r == DFL_EX_DATA && o->skip_bad) {
            if (st->skipped < 10) fprintf(stderr, "%s: skipping bad sample: %s\n", o->prog, dfl_errmsg());
            else if (st->skipped == 10) fprintf(stderr, "%s: (further bad samples are skipped silently)\n", o->prog);
            st->skipped++;
            continue;
        }
        if (r != 1) { /* stop; what is pending still gets written */
            input_rc = r;
            input_msg = dfl_strdup(dfl_errmsg());
            break;
        }
        batch *b = &gather->b;
        if (b->n > 0 && b->cu[b->n] + s.n > o->batch_tokens && (rc = advance(t, &gather, &ready, &e, w, o, st))) break;
        batch_add(&gather->b, &s);
        b = &gather->b;
        if (b->cu[b->n] >= o->batch_tokens && (rc = advance(t, &gather, &ready, &e, w, o, st))) break;
        dfl_progress_update(&pr, (double)st->tokens, NULL);
    }
    /* the last batches: the gathered one through its forward, then both written */
    if (!rc && gather->b.n) rc = advance(t, &gather, &ready, &e, w, o, st);
    if (!rc && ready->b.n) rc = write_records(ready, &e, w, st);
    char extra[64];
    snprintf(extra, sizeof extra, "%lld samples", (long long)st->samples);
    dfl_progress_end(&pr, (double)st->tokens, extra);
    if (!rc && input_rc) {
        rc = dfl_err(input_rc, "%s", input_msg);
        st->input_error = 1;
    }
    free(input_msg);
    stage_free(&stages[0], dfl_target_ops(t)), stage_free(&stages[1], dfl_target_ops(t));
    for (int i = 0; i < MAX_SLOTS; i++) dfs_encoded_free(e.enc[i]);
    return rc;
}
