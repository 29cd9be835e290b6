/* score.c: acceptance statistics, the offline scorer over a stream, the
 * online speculative loop, and the output lines of dflash-score. */
#include "score.h"

#include "cli.h"
#include "common.h"
#include "records.h"
#include "rng.h"
#include "sample.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* ---- statistics ----------------------------------------------------------------- */

void dfl_score_stats_init(dfl_score_stats *st, int B) {
    memset(st, 0, sizeof *st);
    DFL_ASSERT(B >= 2 && B <= DFL_DRAFTER_MAX_BLOCK);
    st->B = B;
}

void dfl_score_block(dfl_score_stats *st, int s, const uint8_t *valid) {
    DFL_ASSERT(s >= 0 && s < st->B);
    st->blocks++;
    st->len_sum += s + 1;
    st->hist[s]++;
    /* slot k was tried if the prefix reached it (s >= k-1) and it could be
     * verified; it was accepted if the prefix went past it (s >= k) */
    for (int k = 1; k < st->B && k <= s + 1; k++) {
        if (valid && !valid[k]) break; /* the prefix ended here, censored */
        st->reach[k]++;
        if (s >= k) st->accept[k]++;
    }
}

void dfl_score_record(dfl_score_stats *st, int64_t nblk, double len_sum) {
    if (nblk <= 0) return;
    st->scored++;
    st->macro_sum += len_sum / (double)nblk;
}

double dfl_score_tau_pooled(const dfl_score_stats *st) { return st->blocks ? st->len_sum / (double)st->blocks : NAN; }
double dfl_score_tau_macro(const dfl_score_stats *st) { return st->scored ? st->macro_sum / (double)st->scored : NAN; }

double dfl_score_accept_k(const dfl_score_stats *st, int k) {
    return st->reach[k] ? (double)st->accept[k] / (double)st->reach[k] : NAN;
}

double dfl_score_accuracy_k(const dfl_score_stats *st, int k) {
    return st->count[k] ? (double)st->correct[k] / (double)st->count[k] : NAN;
}

double dfl_score_accuracy(const dfl_score_stats *st) {
    int64_t c = 0, n = 0;
    for (int k = 1; k < st->B; k++) {
        c += st->correct[k];
        n += st->count[k];
    }
    return n ? (double)c / (double)n : NAN;
}

double dfl_score_loss(const dfl_score_stats *st) { return st->loss_den > 0 ? st->loss_num / st->loss_den : NAN; }

/* ---- offline: the blocks go through the training code -------------------------------- */

typedef struct {
    int64_t total, done;  /* blocks of the record, blocks run */
    double  sum;          /* sum of (s + 1) so far */
} rec_acc;

typedef struct {
    int64_t rec;          /* index into the in-flight records */
    int64_t nblk;
} chunk;

struct dfl_offline {
    dfl_drafter *d;
    dfl_train_opts o;
    int64_t micro_rows;
    dfl_train_mb mb;
    dfl_train_stats ts;
    dfl_score_stats st;
    chunk *chunks;        /* the chunks of the pending micro-batch, in order */
    int64_t nchunks, cap_chunks;
    rec_acc *recs;        /* records with blocks not yet run: [head, n) */
    int64_t head, nrecs, cap_recs;
};

dfl_offline *dfl_offline_new(dfl_drafter *d, const dfl_train_opts *o, int64_t micro_rows) {
    dfl_offline *s = dfl_calloc(1, sizeof *s);
    s->d = d;
    s->o = *o;
    s->o.kl = 0;
    s->o.noise_std = 0;
    s->micro_rows = micro_rows > 0 ? micro_rows : 1;
    dfl_train_mb_init(&s->mb);
    dfl_score_stats_init(&s->st, d->cfg.block_size);
    return s;
}

void dfl_offline_free(dfl_offline *s) {
    if (!s) return;
    dfl_train_mb_free(&s->mb);
    free(s->chunks);
    free(s->recs);
    free(s);
}

/* Forward the pending micro-batch; fold its blocks into the statistics. */
static void offline_run(dfl_offline *s) {
    if (s->mb.b.nblk == 0) return;
    const int B = s->d->cfg.block_size;
    dfl_train_mb_run(s->d, &s->o, &s->mb, &s->ts, 0);
    int64_t j = 0;
    for (int64_t c = 0; c < s->nchunks; c++) {
        rec_acc *r = &s->recs[s->chunks[c].rec];
        for (int64_t i = 0; i < s->chunks[c].nblk; i++, j++) {
            const int sj = s->mb.streak[j];
            dfl_score_block(&s->st, sj, s->mb.valid + j * B);
            r->sum += sj + 1;
        }
        r->done += s->chunks[c].nblk;
    }
    DFL_ASSERT(j == s->mb.b.nblk);
    /* records complete in order: fold the finished ones */
    while (s->head < s->nrecs && s->recs[s->head].done == s->recs[s->head].total) {
        dfl_score_record(&s->st, s->recs[s->head].total, s->recs[s->head].sum);
        s->head++;
    }
    /* keep only the unfinished records (the chunk list is empty again) */
    memmove(s->recs, s->recs + s->head, (size_t)(s->nrecs - s->head) * sizeof *s->recs);
    s->nrecs -= s->head;
    s->head = 0;
    s->nchunks = 0;
    dfl_train_mb_reset(&s->mb);
}

void dfl_offline_add(dfl_offline *s, const dfl_train_seq *q, const int32_t *anchors, int64_t n) {
    const int64_t B = s->d->cfg.block_size;
    s->st.records++;
    s->st.tokens += q->T;
    if (n <= 0) return;
    if (s->nrecs == s->cap_recs) {
        s->cap_recs = s->cap_recs ? 2 * s->cap_recs : 64;
        s->recs = dfl_realloc(s->recs, (size_t)s->cap_recs * sizeof *s->recs);
    }
    s->recs[s->nrecs++] = (rec_acc){n, 0, 0.0};
    for (int64_t i = 0; i < n;) {
        /* as many anchors as fit: rows = context (positions < last anchor) + m B */
        int64_t m = 1;
        while (i + m < n && anchors[i + m] + (m + 1) * B <= s->micro_rows) m++;
        const int64_t rows = anchors[i + m - 1] + m * B;
        if (s->mb.b.nblk > 0 && dfl_train_mb_rows(&s->mb) + rows > s->micro_rows) offline_run(s);
        if (s->nchunks == s->cap_chunks) {
            s->cap_chunks = s->cap_chunks ? 2 * s->cap_chunks : 64;
            s->chunks = dfl_realloc(s->chunks, (size_t)s->cap_chunks * sizeof *s->chunks);
        }
        /* offline_run may have moved the records: this one is still the last */
        s->chunks[s->nchunks++] = (chunk){s->nrecs - 1, m};
        dfl_train_mb_add(&s->mb, &s->d->cfg, &s->o, q, anchors + i, m, NULL);
        i += m;
    }
}

const dfl_score_stats *dfl_offline_finish(dfl_offline *s) {
    offline_run(s);
    for (int k = 0; k < s->st.B; k++) {
        s->st.correct[k] = s->ts.correct[k];
        s->st.count[k] = s->ts.count[k];
    }
    s->st.loss_num = s->ts.num;
    s->st.loss_den = s->ts.den_w;
    return &s->st;
}

/* ---- offline: the stream ---------------------------------------------------------------- */

/* The anchors of record s from --anchors-from, in [0, T) (strictly
 * increasing: dfl_score_load_anchors checked that). */
static int anchors_from(const json_t *map, const char *path, const dfl_record *s, int64_t T, int32_t *out, int64_t *n,
                        int64_t *matched) {
    *n = 0;
    const json_t *arr = json_object_get(map, s->id);
    if (!arr) return 0;
    (*matched)++;
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) {
        json_int_t a = json_integer_value(v);
        if (a < 0 || a >= T)
            return dfs_sample_err(path, s->offset, s->record, s->id,
                                  "--anchors-from: anchor %lld is outside the record's %" PRId64 " tokens", (long long)a, T);
        out[i] = (int32_t)a;
    }
    *n = (int64_t)json_array_size(arr);
    return 0;
}

typedef struct {
    dfs_reader *r;
    const dfs_hs_meta *m;
    const char *path;
    int labels_target;
} stream_source;

static int next_record(void *ctx, dfl_record *o) {
    stream_source *src = ctx;
    return dfl_record_read(src->r, src->m, src->path, src->labels_target, 0, o);
}

/* The anchors of record o: --anchors-from, drawn, or every candidate. */
static int record_anchors(const dfl_record *o, const dfl_score_stream_opts *opt, const char *path, dfl_rng *rng,
                          int32_t *anchors, int64_t *n, int64_t *matched) {
    if (opt->anchors_from) return anchors_from(opt->anchors_from, path, o, o->q.T, anchors, n, matched);
    if (opt->anchors > 0) *n = dfl_anchors_sample(anchors, o->q.loss_mask, o->q.T, opt->anchors, rng);
    else *n = dfl_anchor_candidates(anchors, o->q.loss_mask, o->q.T);
    return 0;
}

int dfl_score_stream(dfl_offline *const *sc, dfl_drafter *const *d, int nd, const dfl_model_config *tcfg,
                     const char *path, const dfl_score_stream_opts *o, int64_t *records) {
    *records = 0;
    dfs_reader *r = NULL;
    int rc = dfs_reader_open(&r, path);
    if (rc) return rc;
    dfs_hs_meta m;
    if ((rc = dfs_hs_meta_from_json(dfs_reader_meta(r), &m, path)) ||
        (rc = dfl_records_check_meta(&m, path, tcfg, d, nd, o->labels_target, 0))) {
        dfs_reader_close(r);
        return rc;
    }
    stream_source src = {r, &m, path, o->labels_target};
    dfl_record_queue *q = dfl_record_queue_new(next_record, &src, o->read_ahead && dfl_records_can_read_ahead(path));
    dfl_rng rng;
    dfl_rng_seed(&rng, o->seed);
    int32_t *anchors = NULL;
    int64_t cap = 0, matched = 0, nfrom = o->anchors_from ? (int64_t)json_object_size(o->anchors_from) : 0;
    dfl_progress pg;
    dfl_progress_init(&pg, o->progress, 0, "rec");
    for (;;) {
        const dfl_record *rec = dfl_record_queue_take(q);
        if (rec->rc != 1) {
            rc = rec->rc ? dfl_err(rec->rc, "%s", rec->err) : 0;
            break;
        }
        if (rec->q.T > cap) {
            cap = rec->q.T;
            anchors = dfl_realloc(anchors, (size_t)cap * sizeof *anchors);
        }
        int64_t n;
        if ((rc = record_anchors(rec, o, path, &rng, anchors, &n, &matched))) break;
        for (int i = 0; i < nd; i++) dfl_offline_add(sc[i], &rec->q, anchors, n);
        (*records)++;
        dfl_progress_update(&pg, (double)*records, NULL);
    }
    dfl_progress_end(&pg, (double)*records, NULL);
    dfl_record_queue_free(q); /* before the reader: its thread reads from it */
    free(anchors);
    dfs_reader_close(r);
    if (!rc && o->anchors_from && matched < nfrom)
        rc = dfl_err(DFL_EX_DATA, "%s: %" PRId64 " of the %" PRId64 " ids of --anchors-from are not in the stream", path,
                     nfrom - matched, nfrom);
    return rc;
}

/* The positions of one line's "anchors": integers in [0, 2^24), strictly
 * increasing (the order blocks are scored in; checked here, where the fault
 * can be named by its file and line, not against the stream later). */
static int anchors_check(const json_t *arr, const char *path, int64_t lineno) {
    for (size_t i = 0; i < json_array_size(arr); i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= DFL_RECORD_MAX_TOKENS)
            return dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": anchors[%zu] is not a position", path, lineno, i);
        if (i > 0 && json_integer_value(v) <= json_integer_value(json_array_get(arr, i - 1)))
            return dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": anchors must increase (anchors[%zu] is %lld, after %lld)",
                           path, lineno, i, (long long)json_integer_value(v),
                           (long long)json_integer_value(json_array_get(arr, i - 1)));
    }
    return 0;
}

/* One line of an --anchors-from file (l bytes, not blank) into map. */
static int anchors_line(json_t *map, const char *path, int64_t lineno, const char *line, size_t l) {
    json_error_t je;
    json_t *o = json_loadb(line, l, JSON_REJECT_DUPLICATES, &je);
    if (!o || !json_is_object(o)) {
        int rc = dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": not a JSON object%s%s", path, lineno, o ? "" : ": ",
                         o ? "" : je.text);
        json_decref(o);
        return rc;
    }
    json_t *id = json_object_get(o, "id"), *arr = json_object_get(o, "anchors");
    char idbuf[32];
    const char *ids = json_string_value(id);
    if (json_is_integer(id)) {
        snprintf(idbuf, sizeof idbuf, "%lld", (long long)json_integer_value(id));
        ids = idbuf;
    }
    int rc = 0;
    if (!ids) rc = dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": \"id\" is missing or not a string or integer", path, lineno);
    else if (!json_is_array(arr))
        rc = dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": \"anchors\" is missing or not a list", path, lineno);
    else if (json_object_get(map, ids))
        rc = dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": id \"%s\" appears twice (a file of one drafter's run is needed)",
                     path, lineno, ids);
    if (!rc) rc = anchors_check(arr, path, lineno);
    if (!rc) json_object_set(map, ids, arr);
    json_decref(o);
    return rc;
}

int dfl_score_load_anchors(const char *path, json_t **out) {
    *out = NULL;
    FILE *f = fopen(path, "r");
    if (!f) return dfl_err(DFL_EX_NOINPUT, "%s: cannot open: %s", path, strerror(errno));
    json_t *map = json_object();
    char *line = NULL;
    size_t lcap = 0;
    ssize_t len;
    int64_t lineno = 0;
    int rc = dfl_refuse_directory(f, path);
    while (!rc && (len = getline(&line, &lcap, f)) >= 0) {
        lineno++;
        size_t l = (size_t)len;
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' ')) l--;
        if (l) rc = anchors_line(map, path, lineno, line, l);
    }
    if (!rc && ferror(f)) rc = dfl_err(DFL_EX_IOERR, "%s: read error", path);
    free(line);
    fclose(f);
    if (rc) {
        json_decref(map);
        return rc;
    }
    *out = map;
    return 0;
}

/* ---- online: decoding ------------------------------------------------------------- */

void dfl_gen_result_free(dfl_gen_result *r) {
    free(r->ids);
    free(r->len);
    free(r->anchors);
    memset(r, 0, sizeof *r);
}

static void push_id(dfl_gen_result *r, int32_t id) {
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 256;
        r->ids = dfl_realloc(r->ids, (size_t)r->cap * sizeof *r->ids);
    }
    r->ids[r->n++] = id;
}

static void push_cycle(dfl_gen_result *r, int32_t len, int32_t anchor) {
    if (r->ncycles == r->cap_c) {
        r->cap_c = r->cap_c ? 2 * r->cap_c : 64;
        r->len = dfl_realloc(r->len, (size_t)r->cap_c * sizeof *r->len);
        r->anchors = dfl_realloc(r->anchors, (size_t)r->cap_c * sizeof *r->anchors);
    }
    r->len[r->ncycles] = len;
    r->anchors[r->ncycles++] = anchor;
}

static int is_eos(const dfl_gen_opts *o, int32_t id) {
    for (int i = 0; i < o->n_eos; i++)
        if (o->eos[i] == id) return 1;
    return 0;
}

static void reset_result(dfl_gen_result *r) {
    r->n = 0;
    r->ncycles = 0;
    r->prefill_s = r->decode_s = 0;
}

/* Sampling (o->temperature > 0): the keys of rows whose tokens are drawn at
 * positions pos0, pos0+1, ... into keys[0..n), and into the want. */
static void sample_rows(dfl_target_want *w, uint64_t *keys, const dfl_gen_opts *o, int64_t pos0, int64_t n) {
    if (!(o->temperature > 0)) return;
    for (int64_t i = 0; i < n; i++) keys[i] = dfl_sample_key(o->seq_key, pos0 + i);
    w->temperature = o->temperature;
    w->sample_keys = keys;
    w->top_k = o->top_k;
    w->top_p = o->top_p;
}

int dfl_greedy_generate(dfl_target *t, dfl_target_kv *kv, const int32_t *prompt, int64_t n, const dfl_gen_opts *o,
                        dfl_gen_result *r) {
    reset_result(r);
    const dfl_ops *ops = dfl_target_ops(t);
    if (n + o->max_new > dfl_target_kv_cap(kv))
        return dfl_err(DFL_EX_SOFTWARE, "greedy: the KV cache holds %lld positions, %lld needed",
                       (long long)dfl_target_kv_cap(kv), (long long)(n + o->max_new));
    dfl_target_kv_crop(kv, 0);
    const int32_t last = (int32_t)(n - 1), zero = 0;
    dfl_target_want w = {.argmax = 1, .rows = &last, .nrows = 1};
    uint64_t key;
    sample_rows(&w, &key, o, n, 1); /* the prompt's last row draws position n */
    dfl_target_out out;
    double t0 = dfl_now();
    int rc = dfl_target_kv_forward(kv, &out, prompt, n, &w);
    if (rc) return rc;
    int32_t tok;
    ops->download(&tok, out.argmax, sizeof tok);
    push_id(r, tok);
    double t1 = dfl_now();
    r->prefill_s = t1 - t0;
    w.rows = &zero;
    while (r->n < o->max_new && !is_eos(o, tok)) {
        sample_rows(&w, &key, o, n + r->n, 1); /* the row at n + r->n - 1 draws the next position */
        if ((rc = dfl_target_kv_forward(kv, &out, &tok, 1, &w))) return rc;
        ops->download(&tok, out.argmax, sizeof tok);
        push_id(r, tok);
    }
    r->decode_s = dfl_now() - t1;
    return 0;
}

int dfl_spec_generate(dfl_target *t, dfl_target_kv *kv, dfl_drafter *d, dfl_drafter_cache *dc, const int32_t *prompt,
                      int64_t n, const dfl_gen_opts *o, dfl_gen_result *r) {
    reset_result(r);
    const dfl_ops *ops = dfl_target_ops(t);
    const dfl_drafter_config *c = &d->cfg;
    const int64_t B = c->block_size, KH = (int64_t)c->K * c->H, max_len = n + o->max_new;
    if (max_len + B > dfl_target_kv_cap(kv) || max_len > INT32_MAX - B)
        return dfl_err(DFL_EX_SOFTWARE, "speculative: the KV cache holds %lld positions, %lld needed",
                       (long long)dfl_target_kv_cap(kv), (long long)(max_len + B));
    /* output_ids of the reference: the prompt, then mask ids */
    int32_t *buf = dfl_malloc((size_t)(max_len + B) * sizeof *buf), *post = dfl_malloc((size_t)B * sizeof *post);
    memcpy(buf, prompt, (size_t)n * sizeof *buf);
    for (int64_t i = n; i < max_len + B; i++) buf[i] = (int32_t)c->mask_token_id;
    uint16_t *feats = dfl_malloc((size_t)((n > B ? n : B) * KH) * sizeof *feats);
    dfl_target_kv_crop(kv, 0);
    dfl_drafter_cache_crop(dc, 0);

    /* prefill: the first token and the context features of the prompt */
    const int32_t last = (int32_t)(n - 1);
    dfl_target_want w = {.ntaps = c->K, .taps = c->layer_ids, .argmax = 1, .rows = &last, .nrows = 1};
    uint64_t keys[DFL_DRAFTER_MAX_BLOCK];
    sample_rows(&w, keys, o, n, 1);
    dfl_target_out out;
    double t0 = dfl_now(), tdec = 0;
    int rc = dfl_target_kv_forward(kv, &out, prompt, n, &w);
    if (!rc) {
        ops->download(&buf[n], out.argmax, sizeof *buf);
        dfl_target_taps_to_bf16(t, &out, 0, n, feats);
        r->prefill_s = dfl_now() - t0;
    }
    int64_t start = n, nfeat = n, checked = n;
    w.rows = NULL;
    w.nrows = 0;
    w.may_crop = 1; /* the rejected tail of each block is cropped away */
    while (!rc && start < max_len) {
        int32_t *block = buf + start; /* slot 0: the last committed token */
        int32_t draft[DFL_DRAFTER_MAX_BLOCK];
        if ((rc = dfl_drafter_draft(dc, feats, DFL_BF16, nfeat, block[0], draft, NULL))) break;
        if (r->ncycles == 0) tdec = dfl_now(); /* decode time starts after the first draft (reference) */
        int32_t blk[DFL_DRAFTER_MAX_BLOCK];
        blk[0] = block[0];
        memcpy(blk + 1, draft, (size_t)(B - 1) * sizeof *blk);
        sample_rows(&w, keys, o, start + 1, B); /* block row i draws position start+i+1 */
        if ((rc = dfl_target_kv_forward(kv, &out, blk, B, &w))) break;
        ops->download(post, out.argmax, (size_t)B * sizeof *post);
        int64_t a = 0;
        while (a < B - 1 && blk[a + 1] == post[a]) a++;
        memcpy(block, blk, (size_t)(a + 1) * sizeof *block);
        block[a + 1] = post[a]; /* the bonus token */
        dfl_target_taps_to_bf16(t, &out, 0, a + 1, feats);
        nfeat = a + 1;
        push_cycle(r, (int32_t)(a + 1), (int32_t)start);
        start += a + 1;
        dfl_target_kv_crop(kv, start);
        /* stop once a stop token is among the committed tokens */
        int stop = 0;
        for (; checked <= start && !stop; checked++) stop = is_eos(o, buf[checked]);
        if (stop) break;
    }
    if (!rc) {
        r->decode_s = r->ncycles ? dfl_now() - tdec : 0;
        int64_t end = start + 1 < max_len ? start + 1 : max_len;
        for (int64_t i = n; i < end; i++) {
            push_id(r, buf[i]);
            if (is_eos(o, buf[i])) break;
        }
    }
    free(buf);
    free(post);
    free(feats);
    return rc;
}

static json_t *ids_json(const int32_t *v, int64_t n) {
    json_t *a = json_array();
    for (int64_t i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

static int emit_line(const dfl_online_opts *o, const char *id, const char *name, int64_t n, const dfl_gen_result *sp,
                     const dfl_gen_result *g) {
    FILE *f = o->emit;
    json_t *j = json_pack("{ss ss sI so so so so}", "id", id, "drafter", name, "prompt_tokens", (json_int_t)n,
                          "output_ids", ids_json(sp->ids, sp->n), "greedy_ids", ids_json(g->ids, g->n),
                          "acceptance_lengths", ids_json(sp->len, sp->ncycles), "anchors",
                          ids_json(sp->anchors, sp->ncycles));
    int bad = json_dumpf(j, f, JSON_COMPACT) != 0 || fputc('\n', f) == EOF;
    json_decref(j);
    /* worded as the output's other write errors (outfile.c) */
    return bad ? dfl_err(DFL_EX_IOERR, "%s: write failed: %s", o->emit_name ? o->emit_name : "--emit", strerror(errno))
               : 0;
}

int dfl_score_online(dfl_target *t, dfl_drafter *const *d, int nd, dfl_jsonl *in, const dfl_online_opts *o,
                     dfl_score_stats *st) {
    const dfl_model_config *tc = dfl_target_config(t);
    dfl_gen_opts go = {o->max_new, o->ignore_eos ? 0 : tc->n_eos, tc->eos_token_ids, o->temperature, 0, o->top_k,
                       o->top_p};
    int Bmax = 0;
    for (int i = 0; i < nd; i++) {
        dfl_score_stats_init(&st[i], d[i]->cfg.block_size);
        if (d[i]->cfg.block_size > Bmax) Bmax = d[i]->cfg.block_size;
    }
    dfl_target_kv *kv = NULL;
    dfl_drafter_cache **dc = dfl_calloc((size_t)nd, sizeof *dc);
    int64_t cap = 0;
    dfl_gen_result g = {0}, sp = {0};
    dfl_progress pg;
    dfl_progress_init(&pg, o->progress, 0, "prompt");
    int rc = 0;
    int64_t prompts = 0;
    for (;;) {
        dfl_jsonl_sample s;
        int r = dfl_jsonl_next(in, &s);
        if (r == 0) break;
        if (r != 1) {
            rc = r;
            break;
        }
        const int64_t need = s.n + o->max_new + Bmax;
        if (need > INT32_MAX - DFL_DRAFTER_MAX_BLOCK) {
            rc = dfl_err(DFL_EX_DATA, "%s:%" PRId64 ": the prompt and --max-new-tokens exceed 2^31 positions",
                         dfl_jsonl_path(in), s.line);
            break;
        }
        if (need > cap) { /* caches sized for the longest prompt so far */
            cap = need + need / 4;
            dfl_target_kv_free(kv);
            kv = dfl_target_kv_new(t, cap);
            for (int i = 0; i < nd; i++) {
                dfl_drafter_cache_free(dc[i]);
                dc[i] = dfl_drafter_cache_new(d[i], cap);
            }
        }
        go.seq_key = dfl_sample_seq_key(o->seed, XXH64(s.id, strlen(s.id), 0)); /* by id: shards draw alike */
        if (prompts == 0) { /* warm-up (thread pools, workspaces), untimed and discarded */
            dfl_gen_opts wo = go;
            wo.max_new = o->max_new < 4 * Bmax ? o->max_new : 4 * Bmax;
            rc = dfl_greedy_generate(t, kv, s.input_ids, s.n, &wo, &g);
            for (int i = 0; i < nd && !rc; i++) rc = dfl_spec_generate(t, kv, d[i], dc[i], s.input_ids, s.n, &wo, &sp);
            if (rc) break;
        }
        if ((rc = dfl_greedy_generate(t, kv, s.input_ids, s.n, &go, &g))) break;
        for (int i = 0; i < nd && !rc; i++) {
            if ((rc = dfl_spec_generate(t, kv, d[i], dc[i], s.input_ids, s.n, &go, &sp))) break;
            dfl_score_stats *x = &st[i];
            double len_sum = 0;
            for (int64_t c = 0; c < sp.ncycles; c++) {
                dfl_score_block(x, sp.len[c] - 1, NULL);
                len_sum += sp.len[c];
            }
            x->records++;
            dfl_score_record(x, sp.ncycles, len_sum);
            x->tokens += sp.n;
            x->greedy_tokens += g.n;
            x->mismatches += sp.n != g.n || memcmp(sp.ids, g.ids, (size_t)g.n * sizeof *g.ids) != 0;
            x->spec_s += sp.decode_s;
            x->greedy_s += g.decode_s;
            if (sp.n) x->tpot_spec += sp.decode_s / (double)sp.n;
            if (g.n) x->tpot_greedy += g.decode_s / (double)g.n;
            if (o->emit) rc = emit_line(o, s.id, o->names ? o->names[i] : "", s.n, &sp, &g);
        }
        if (rc) break;
        prompts++;
        dfl_progress_update(&pg, (double)prompts, NULL);
    }
    dfl_progress_end(&pg, (double)prompts, NULL);
    dfl_gen_result_free(&g);
    dfl_gen_result_free(&sp);
    for (int i = 0; i < nd; i++) dfl_drafter_cache_free(dc[i]);
    free(dc);
    dfl_target_kv_free(kv);
    return rc;
}

/* ---- output lines ------------------------------------------------------------------ */

static json_t *num_or_null(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static json_t *int_or_null(int64_t x) { return x >= 0 ? json_integer(x) : json_null(); }

json_t *dfl_score_line_json(const dfl_score_line *l, const dfl_score_stats *st) {
    const int B = st->B;
    json_t *j = json_object(), *acc = json_array(), *hist = json_array();
    for (int k = 1; k < B; k++) json_array_append_new(acc, num_or_null(dfl_score_accept_k(st, k)));
    for (int s = 0; s < B; s++) json_array_append_new(hist, json_integer(st->hist[s]));
    json_object_set_new(j, "time", json_string(l->time));
    json_object_set_new(j, "mode", json_string(l->online ? "online" : "offline"));
    json_object_set_new(j, "drafter", json_string(l->drafter));
    json_object_set_new(j, "step", int_or_null(l->step));
    json_object_set_new(j, "input", json_string(l->input));
    json_object_set_new(j, "records", json_integer(st->records));
    json_object_set_new(j, "blocks", json_integer(st->blocks));
    json_object_set_new(j, "tokens", json_integer(st->tokens));
    json_object_set_new(j, "tau_macro", num_or_null(dfl_score_tau_macro(st)));
    json_object_set_new(j, "tau_pooled", num_or_null(dfl_score_tau_pooled(st)));
    if (!l->online) {
        json_t *ak = json_array();
        for (int k = 1; k < B; k++) json_array_append_new(ak, num_or_null(dfl_score_accuracy_k(st, k)));
        json_object_set_new(j, "loss", num_or_null(dfl_score_loss(st)));
        json_object_set_new(j, "accuracy", num_or_null(dfl_score_accuracy(st)));
        json_object_set_new(j, "accept_k", acc);
        json_object_set_new(j, "accuracy_k", ak);
        json_object_set_new(j, "hist", hist);
        json_object_set_new(j, "block_size", json_integer(B));
        json_object_set_new(j, "labels", json_string(l->labels));
        json_object_set_new(j, "gamma", json_real(l->gamma));
        json_object_set_new(j, "anchors", json_string(l->anchors));
        json_object_set_new(j, "seed", int_or_null(l->seed));
    } else {
        double tps = st->spec_s > 0 ? (double)st->tokens / st->spec_s : NAN;
        double gps = st->greedy_s > 0 ? (double)st->greedy_tokens / st->greedy_s : NAN;
        double speedup = st->tpot_spec > 0 ? st->tpot_greedy / st->tpot_spec : NAN;
        json_object_set_new(j, "accept_k", acc);
        json_object_set_new(j, "hist", hist);
        json_object_set_new(j, "block_size", json_integer(B));
        json_object_set_new(j, "max_new_tokens", json_integer(l->max_new));
        json_object_set_new(j, "tokens_per_s", num_or_null(tps));
        json_object_set_new(j, "greedy_tokens_per_s", num_or_null(gps));
        json_object_set_new(j, "speedup", num_or_null(speedup));
        json_object_set_new(j, "mismatches", json_integer(st->mismatches));
        json_object_set_new(j, "temperature", json_real(l->temperature));
        json_object_set_new(j, "seed", int_or_null(l->sample_seed));
        json_object_set_new(j, "top_k", int_or_null(l->top_k));
        json_object_set_new(j, "top_p", num_or_null(l->top_p));
    }
    return j;
}

/* A string field: tabs and line ends would break the row; they are written
 * as \t, \n and \r (and a backslash as \\). */
static void put_str(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '\t') fputs("\\t", f);
        else if (*s == '\n') fputs("\\n", f);
        else if (*s == '\r') fputs("\\r", f);
        else if (*s == '\\') fputs("\\\\", f);
        else fputc(*s, f);
    }
}

static void put_value(FILE *f, const json_t *v, int in_list) {
    if (json_is_string(v)) put_str(f, json_string_value(v));
    else if (json_is_integer(v)) fprintf(f, "%lld", (long long)json_integer_value(v));
    else if (json_is_real(v)) fprintf(f, "%.6f", json_real_value(v));
    else if (json_is_null(v)) fputs(in_list ? "nan" : "", f);
    else if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) {
            if (i) fputc(',', f);
            put_value(f, x, 1);
        }
    }
}

void dfl_score_tsv_header(FILE *f, const json_t *line) {
    const char *key;
    json_t *v;
    int first = 1;
    json_object_foreach((json_t *)line, key, v) {
        fprintf(f, "%s%s", first ? "" : "\t", key);
        first = 0;
    }
    fputc('\n', f);
}

void dfl_score_tsv_row(FILE *f, const json_t *line) {
    const char *key;
    json_t *v;
    int first = 1;
    json_object_foreach((json_t *)line, key, v) {
        if (!first) fputc('\t', f);
        put_value(f, v, 0);
        first = 0;
    }
    fputc('\n', f);
}
