/* records.c: hidden-state records for training and offline scoring:
 * checked, decoded, read ahead. */
#include "records.h"

#include "common.h"

#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- the stream against the target and the drafters ------------------------ */

static void add_diff(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void add_diff(char *buf, size_t n, const char *fmt, ...) {
    size_t len = strlen(buf);
    if (len + 3 >= n) return;
    if (len) len += (size_t)snprintf(buf + len, n - len, "; ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, n - len, fmt, ap);
    va_end(ap);
}

static void ids_str(char *buf, size_t n, const int *ids, int k) {
    size_t len = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < k && len < n; i++) len += (size_t)snprintf(buf + len, n - len, "%s%d", i ? "," : "", ids[i]);
    if (len < n) snprintf(buf + len, n - len, "]");
}

static void diff_target(char *diff, size_t n, const dfs_hs_meta *m, const dfl_model_config *tc) {
    if (m->hidden_size != tc->hidden_size)
        add_diff(diff, n, "hidden_size: stream %" PRId64 " vs target %" PRId64, m->hidden_size, tc->hidden_size);
    if (strcmp(m->architecture, tc->architecture))
        add_diff(diff, n, "architecture: stream %s vs target %s", m->architecture, tc->architecture);
    if (strcmp(m->config_digest, tc->digest))
        add_diff(diff, n, "config_digest: stream %s vs target config.json %s", m->config_digest, tc->digest);
    if (m->num_layers != tc->num_hidden_layers)
        add_diff(diff, n, "num_layers: stream %" PRId64 " vs target %" PRId64, m->num_layers, tc->num_hidden_layers);
    if (m->vocab_size != tc->vocab_size)
        add_diff(diff, n, "vocab_size: stream %" PRId64 " vs target %" PRId64, m->vocab_size, tc->vocab_size);
}

static void diff_drafter(char *diff, size_t n, const dfs_hs_meta *m, const dfl_drafter_config *c, const char *who) {
    int same = m->nlayers == c->K;
    for (int j = 0; same && j < c->K; j++) same = m->layer_ids[j] == c->layer_ids[j];
    if (!same) {
        char a[512], b[512];
        ids_str(a, sizeof a, m->layer_ids, m->nlayers);
        ids_str(b, sizeof b, c->layer_ids, c->K);
        add_diff(diff, n, "layer_ids: stream %s vs %s target_layer_ids %s", a, who, b);
    }
    if (m->hidden_size != c->H)
        add_diff(diff, n, "hidden_size: stream %" PRId64 " vs %s %" PRId64, m->hidden_size, who, c->H);
    if (m->vocab_size != c->V)
        add_diff(diff, n, "vocab_size: stream %" PRId64 " vs %s %" PRId64, m->vocab_size, who, (int64_t)c->V);
}

int dfl_records_check_meta(const dfs_hs_meta *m, const char *path, const dfl_model_config *tc, dfl_drafter *const *d,
                           int nd, int need_target_ids, int need_last_hidden) {
    char diff[4096] = "";
    diff_target(diff, sizeof diff, m, tc);
    for (int i = 0; i < nd; i++) {
        char who[32];
        if (nd == 1) snprintf(who, sizeof who, "drafter");
        else snprintf(who, sizeof who, "drafter %d", i + 1);
        diff_drafter(diff, sizeof diff, m, &d[i]->cfg, who);
    }
    if (diff[0]) return dfl_err(DFL_EX_DATA, "%s: the stream does not match the target/drafter: %s", path, diff);
    if (need_target_ids && !m->has_target_ids)
        return dfl_err(DFL_EX_DATA, "%s: --labels target needs \"target_ids\", which this stream does not carry", path);
    if (need_last_hidden && !m->has_last_hidden)
        return dfl_err(DFL_EX_DATA, "%s: --loss kl needs \"last_hidden\", which this stream does not carry", path);
    return 0;
}

/* ---- one record --------------------------------------------------------------- */

void dfl_record_free(dfl_record *o) {
    free(o->err), free(o->id), free(o->ids), free(o->tids), free(o->mask);
    free(o->hidden), free(o->last);
    memset(o, 0, sizeof *o);
}

static int decode(dfs_reader *r, dfs_sample *s, const char *name, dfs_tensor **out) {
    *out = dfs_find(s, name); /* present with its shape: dfs_hs_check_sample said so */
    return dfs_decode(r, *out);
}

/* The small tensors copied, the large ones swapped with the reader's buffers. */
static void keep(dfs_reader *r, dfs_tensor *ids, dfs_tensor *mask, dfs_tensor *tid, dfs_tensor *hid, dfs_tensor *last,
                 dfl_record *o) {
    const int64_t T = ids->shape[0];
    if ((size_t)T > o->cap_t) {
        free(o->ids), free(o->tids), free(o->mask);
        o->cap_t = (size_t)T;
        o->ids = dfl_malloc((size_t)T * 4), o->tids = dfl_malloc((size_t)T * 4), o->mask = dfl_malloc((size_t)T);
    }
    memcpy(o->ids, ids->data, (size_t)T * 4);
    memcpy(o->mask, mask->data, (size_t)T);
    if (tid) memcpy(o->tids, tid->data, (size_t)T * 4);
    dfs_take_decoded(r, hid, &o->hidden, &o->cap_hidden);
    if (last) dfs_take_decoded(r, last, &o->last, &o->cap_last);
    o->q = (dfl_train_seq){T, o->ids, o->mask, o->hidden, hid->dtype, tid ? o->tids : NULL, last ? o->last : NULL,
                           last ? last->dtype : DFL_F32};
}

int dfl_record_read(dfs_reader *r, const dfs_hs_meta *m, const char *path, int want_target_ids, int want_last_hidden,
                    dfl_record *o) {
    dfs_sample *s;
    int rc = dfs_read(r, &s);
    if (rc != 1) return rc;
    if ((rc = dfs_hs_check_sample(m, s, path))) return rc; /* names, dtypes, shapes */
    dfs_tensor *ids, *mask, *hid, *tid = NULL, *last = NULL;
    if (dfs_find(s, "input_ids")->shape[0] > DFL_RECORD_MAX_TOKENS)
        return dfs_sample_err(path, s->offset, s->record, s->id,
                              "tensor \"input_ids\" holds %" PRId64 " tokens, more than 2^24",
                              dfs_find(s, "input_ids")->shape[0]);
    if ((rc = decode(r, s, "input_ids", &ids)) || (rc = decode(r, s, "loss_mask", &mask)) ||
        (rc = decode(r, s, "hidden", &hid)) || (want_target_ids && (rc = decode(r, s, "target_ids", &tid))) ||
        (want_last_hidden && (rc = decode(r, s, "last_hidden", &last))))
        return rc;
    if ((rc = dfs_hs_check_sample(m, s, path))) return rc; /* the decoded values: token ids, mask */
    keep(r, ids, mask, tid, hid, last, o);
    free(o->id);
    o->id = dfl_strdup(s->id ? s->id : "");
    o->offset = s->offset;
    o->record = s->record;
    return 1;
}

int dfl_records_can_read_ahead(const char *path) {
    struct stat st;
    return strcmp(path, "-") != 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* ---- reading ahead -------------------------------------------------------------- */

/* Two records: the thread fills one while the caller holds the other. A
 * record is EMPTY (the thread's to fill), FULL (waiting for the caller) or
 * HELD (the caller's, until it takes the next one). */
enum { REC_EMPTY, REC_FULL, REC_HELD };

struct dfl_record_queue {
    dfl_record_source source;
    void *ctx;
    dfl_record rec[2];
    int state[2];
    int fill, take, held;      /* the record the thread fills next, the caller takes next, the caller holds (-1) */
    int threaded, stop, final; /* final: the caller holds the last record there is (the end, an error) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

/* The source's next record, its result and message kept in the record. */
static void fill(dfl_record_queue *q, dfl_record *o) {
    o->rc = q->source(q->ctx, o);
    free(o->err);
    o->err = o->rc > 1 ? dfl_strdup(dfl_errmsg()) : NULL; /* dfl_errmsg is the thread's own */
}

static void *queue_main(void *arg) {
    dfl_record_queue *q = arg;
    /* The tools' signal cleanup (outfile.c) must interrupt the thread that
     * writes the outputs; it would forward a signal landing here, but this
     * thread need not take them at all. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT), sigaddset(&sigs, SIGTERM), sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (!q->stop && q->state[q->fill] != REC_EMPTY) pthread_cond_wait(&q->cv, &q->mu);
        const int stop = q->stop, i = q->fill;
        pthread_mutex_unlock(&q->mu);
        if (stop) break;
        fill(q, &q->rec[i]); /* the long part, unlocked */
        pthread_mutex_lock(&q->mu);
        q->state[i] = REC_FULL;
        q->fill ^= 1;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        if (q->rec[i].rc != 1) break; /* the end of the input or an error: nothing follows */
    }
    return NULL;
}

dfl_record_queue *dfl_record_queue_new(dfl_record_source source, void *ctx, int threaded) {
    dfl_record_queue *q = dfl_calloc(1, sizeof *q);
    q->source = source;
    q->ctx = ctx;
    q->held = -1;
    if (!threaded) return q;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->threaded = pthread_create(&q->thread, NULL, queue_main, q) == 0;
    if (!q->threaded) pthread_mutex_destroy(&q->mu), pthread_cond_destroy(&q->cv); /* read when taken instead */
    return q;
}

dfl_record *dfl_record_queue_take(dfl_record_queue *q) {
    if (q->final) return &q->rec[q->held]; /* the end or the error, again */
    if (!q->threaded) {
        fill(q, &q->rec[0]);
        q->held = 0;
    } else {
        pthread_mutex_lock(&q->mu);
        if (q->held >= 0) q->state[q->held] = REC_EMPTY, pthread_cond_broadcast(&q->cv);
        while (q->state[q->take] != REC_FULL) pthread_cond_wait(&q->cv, &q->mu);
        q->held = q->take;
        q->state[q->held] = REC_HELD;
        q->take ^= 1;
        pthread_mutex_unlock(&q->mu);
    }
    dfl_record *o = &q->rec[q->held];
    q->final = o->rc != 1;
    return o;
}

void dfl_record_queue_free(dfl_record_queue *q) {
    if (!q) return;
    if (q->threaded) {
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->thread, NULL);
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
    }
    dfl_record_free(&q->rec[0]), dfl_record_free(&q->rec[1]);
    free(q);
}
