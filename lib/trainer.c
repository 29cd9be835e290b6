/* trainer.c: the step loop of dflash-train-step over a hidden-state stream. */
#include "trainer.h"

#include "common.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_SEQ_TOKENS (INT64_C(1) << 24)

void dfl_trainer_init(dfl_trainer *t, dfl_drafter *d, const dfl_model_config *tcfg, const dfl_train_opts *o,
                      int64_t batch_seqs, int64_t batch_tokens, int loop, uint64_t seed) {
    memset(t, 0, sizeof *t);
    t->d = d;
    t->tcfg = tcfg;
    t->o = *o;
    t->batch_seqs = batch_seqs;
    t->batch_tokens = batch_tokens;
    t->loop = loop;
    t->seed = seed;
    dfl_rng_seed(&t->rng, seed);
    dfl_train_mb_init(&t->mb);
    t->mb.ops = d->ops; /* the features in the device's host memory: faster uploads */
    t->read_ahead = -1; /* the input decides (dfl_trainer_open) */
}

static void read_ahead_free(dfl_trainer *t);

void dfl_trainer_free(dfl_trainer *t) {
    read_ahead_free(t); /* first: its thread uses the reader */
    if (t->r) dfs_reader_close(t->r);
    free(t->path);
    free(t->real);
    free(t->anchors);
    dfl_train_mb_free(&t->mb);
    memset(t, 0, sizeof *t);
}

/* ---- the input ----------------------------------------------------------------- */

static void add_diff(char *buf, size_t n, const char *field, const char *stream, const char *want, const char *whose) {
    size_t len = strlen(buf);
    snprintf(buf + len, n - len, "%s%s: stream %s vs %s %s", len ? "; " : "", field, stream, whose, want);
}

static void ids_str(char *buf, size_t n, const int *ids, int k) {
    size_t len = 0;
    len += (size_t)snprintf(buf + len, n - len, "[");
    for (int i = 0; i < k && len < n; i++) len += (size_t)snprintf(buf + len, n - len, "%s%d", i ? "," : "", ids[i]);
    if (len < n) snprintf(buf + len, n - len, "]");
}

/* The stream's identity against the drafter and the target. */
static int check_meta(dfl_trainer *t) {
    const dfl_drafter_config *c = &t->d->cfg;
    const dfl_model_config *tc = t->tcfg;
    const dfs_hs_meta *m = &t->meta;
    char diff[2048] = "", a[512], b[512];
    int same_ids = m->nlayers == c->K;
    for (int i = 0; same_ids && i < c->K; i++) same_ids = m->layer_ids[i] == c->layer_ids[i];
    if (!same_ids) {
        ids_str(a, sizeof a, m->layer_ids, m->nlayers);
        ids_str(b, sizeof b, c->layer_ids, c->K);
        add_diff(diff, sizeof diff, "layer_ids", a, b, "drafter target_layer_ids");
    }
    if (m->hidden_size != tc->hidden_size) {
        snprintf(a, sizeof a, "%" PRId64, m->hidden_size);
        snprintf(b, sizeof b, "%" PRId64, tc->hidden_size);
        add_diff(diff, sizeof diff, "hidden_size", a, b, "target");
    }
    if (strcmp(m->architecture, tc->architecture)) add_diff(diff, sizeof diff, "architecture", m->architecture, tc->architecture, "target");
    if (strcmp(m->config_digest, tc->digest))
        add_diff(diff, sizeof diff, "config_digest", m->config_digest, tc->digest, "target config.json");
    if (m->num_layers != tc->num_hidden_layers) {
        snprintf(a, sizeof a, "%" PRId64, m->num_layers);
        snprintf(b, sizeof b, "%" PRId64, tc->num_hidden_layers);
        add_diff(diff, sizeof diff, "num_layers", a, b, "target");
    }
    if (m->vocab_size != tc->vocab_size) {
        snprintf(a, sizeof a, "%" PRId64, m->vocab_size);
        snprintf(b, sizeof b, "%" PRId64, tc->vocab_size);
        add_diff(diff, sizeof diff, "vocab_size", a, b, "target");
    }
    if (diff[0]) return dfl_err(DFL_EX_DATA, "%s: the stream does not match the drafter/target: %s", t->path, diff);
    if (t->o.labels_target && !m->has_target_ids)
        return dfl_err(DFL_EX_DATA, "%s: --labels target needs \"target_ids\", which this stream does not carry", t->path);
    if (t->o.kl && !m->has_last_hidden)
        return dfl_err(DFL_EX_DATA, "%s: --loss kl needs \"last_hidden\", which this stream does not carry", t->path);
    return 0;
}

static int reopen(dfl_trainer *t) {
    if (t->r) dfs_reader_close(t->r);
    t->r = NULL;
    int rc = dfs_reader_open(&t->r, t->path);
    if (rc) return rc;
    rc = dfs_hs_meta_from_json(dfs_reader_meta(t->r), &t->meta, t->path);
    return rc ? rc : check_meta(t);
}

/* Read ahead only from a regular file: from a pipe or a FIFO the thread
 * would take a record the run may not use, and could wait at exit for a
 * writer that has nothing more to say. */
static int regular_file(const char *path) {
    struct stat st;
    return strcmp(path, "-") != 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int dfl_trainer_open(dfl_trainer *t, const char *path, int64_t skip, int64_t epoch) {
    free(t->path);
    free(t->real);
    t->path = dfl_strdup(path);
    if (!strcmp(path, "-")) {
        t->real = dfl_strdup("-");
        if (t->loop) return dfl_err(DFL_EX_USAGE, "--loop needs a file to re-read, not standard input");
    } else {
        char *rp = realpath(path, NULL);
        t->real = rp ? rp : dfl_strdup(path);
    }
    DFL_ASSERT(!t->ra); /* opened once */
    int rc = reopen(t);
    if (rc) return rc;
    t->epoch = t->in_epoch = epoch;
    t->records = t->in_records = 0;
    t->in_usable = skip > 0; /* records were used before the resume */
    t->ended = t->in_ended = 0;
    for (int64_t i = 0; i < skip; i++) {
        dfs_sample *s;
        rc = dfs_read(t->r, &s);
        if (rc == 0) return dfl_err(DFL_EX_DATA, "%s: resuming after record %" PRId64 ", but the stream holds only %" PRId64,
                                    t->path, skip, i);
        if (rc != 1) return rc;
        t->records++, t->in_records++;
    }
    if (t->read_ahead < 0) t->read_ahead = regular_file(path);
    return 0;
}

void dfl_trainer_read_ahead(dfl_trainer *t, int on) {
    DFL_ASSERT(!t->ra); /* before the first step */
    t->read_ahead = on && t->path && regular_file(t->path);
}

/* A decoded tensor of the sample with the expected dtype class and shape. */
static int get_tensor(dfl_trainer *t, dfs_sample *s, const char *name, int64_t T, int64_t width, dfs_tensor **out) {
    dfs_tensor *x = dfs_find(s, name);
    if (!x) return dfl_err(DFL_EX_DATA, "%s: record at offset %" PRIu64 " (\"%s\"): tensor \"%s\" is missing", t->path,
                           s->offset, s->id ? s->id : "", name);
    int ok = width ? (x->ndim == 2 && x->shape[0] == T && x->shape[1] == width) : (x->ndim == 1 && x->shape[0] == T);
    if (!ok) {
        char want[64];
        if (width) snprintf(want, sizeof want, "[%" PRId64 ", %" PRId64 "]", T, width);
        else snprintf(want, sizeof want, "[%" PRId64 "]", T);
        return dfl_err(DFL_EX_DATA, "%s: record at offset %" PRIu64 " (\"%s\"): tensor \"%s\" must be %s", t->path,
                       s->offset, s->id ? s->id : "", name, want);
    }
    int rc = dfs_decode(t->r, x);
    if (rc) return rc;
    *out = x;
    return 0;
}

static int bad_sample(dfl_trainer *t, dfs_sample *s, const char *what) {
    return dfl_err(DFL_EX_DATA, "%s: record at offset %" PRIu64 " (\"%s\"): %s", t->path, s->offset, s->id ? s->id : "",
                   what);
}

/* ---- records, read on the reader's side ------------------------------------------- */

/* One record as the reader hands it over: a sequence in buffers the slot
 * owns (grown, then reused), or the end of the input, or an error. */
typedef struct {
    int rc;                  /* 1: a sequence; 0: the end of the input; else an exit code */
    char *err;               /* rc's message (the reader's thread has its own dfl_errmsg) */
    int64_t records, epoch;  /* the input's position once this record is consumed */
    uint64_t offset;         /* the record's, and its id, for messages */
    char *id;
    dfl_train_seq q;         /* points into the buffers below */
    int32_t *ids, *tids, *cand;
    uint8_t *mask;
    void *hidden, *last;
    size_t cap_t, cap_hidden, cap_last;
} read_slot;

static void read_slot_free(read_slot *s) {
    free(s->err), free(s->id), free(s->ids), free(s->tids), free(s->cand), free(s->mask);
    free(s->hidden), free(s->last);
    memset(s, 0, sizeof *s);
}

/* The next record into o: read, checked and decoded, its tensors kept in
 * o (the reader's buffers are reused by the next read). Returns 1, 0 at
 * the end of the input, or an exit code. */
static int read_record(dfl_trainer *t, read_slot *o) {
    if (t->in_ended) return 0;
    dfs_sample *s;
    int rc = dfs_read(t->r, &s);
    if (rc == 0 && t->loop) {
        if (t->in_usable == 0)
            return dfl_err(DFL_EX_DATA, "%s: --loop over a stream with no usable record (none has two consecutive "
                           "supervised tokens)", t->path);
        t->in_epoch++;
        t->in_records = 0;
        t->in_usable = 0;
        if ((rc = reopen(t))) return rc;
        rc = dfs_read(t->r, &s);
    }
    if (rc == 0) {
        t->in_ended = 1;
        return 0;
    }
    if (rc != 1) return rc;
    t->in_records++;
    const dfl_drafter_config *c = &t->d->cfg;
    dfs_tensor *ids = dfs_find(s, "input_ids");
    if (!ids || ids->ndim != 1 || ids->shape[0] < 1 || ids->shape[0] > MAX_SEQ_TOKENS)
        return bad_sample(t, s, "tensor \"input_ids\" is missing or not [T] with 1 <= T <= 2^24");
    const int64_t T = ids->shape[0];
    dfs_tensor *mask, *hid, *tid = NULL, *last = NULL;
    if ((rc = get_tensor(t, s, "input_ids", T, 0, &ids)) || (rc = get_tensor(t, s, "loss_mask", T, 0, &mask)) ||
        (rc = get_tensor(t, s, "hidden", T, c->K * c->H, &hid)))
        return rc;
    if (t->o.labels_target && (rc = get_tensor(t, s, "target_ids", T, 0, &tid))) return rc;
    if (t->o.kl && (rc = get_tensor(t, s, "last_hidden", T, c->H, &last))) return rc;
    if (ids->dtype != DFL_I32 || (tid && tid->dtype != DFL_I32)) return bad_sample(t, s, "token ids must be i32");
    if (mask->dtype != DFL_U8) return bad_sample(t, s, "\"loss_mask\" must be u8");
    if (hid->dtype != DFL_BF16 && hid->dtype != DFL_F16 && hid->dtype != DFL_F32)
        return bad_sample(t, s, "\"hidden\" must be bf16, f16 or f32");
    if (last && last->dtype != hid->dtype) return bad_sample(t, s, "\"last_hidden\" must have the dtype of \"hidden\"");
    const int32_t *iv = ids->data, *tv = tid ? tid->data : NULL;
    const uint8_t *mv = mask->data;
    for (int64_t i = 0; i < T; i++) {
        if (iv[i] < 0 || iv[i] >= c->V || (tv && (tv[i] < 0 || tv[i] >= c->V)))
            return bad_sample(t, s, "a token id is outside the vocabulary");
        if (mv[i] > 1) return bad_sample(t, s, "\"loss_mask\" holds a value other than 0 and 1");
    }
    if ((size_t)T > o->cap_t) {
        free(o->ids), free(o->tids), free(o->cand), free(o->mask);
        o->cap_t = (size_t)T;
        o->ids = dfl_malloc((size_t)T * 4), o->tids = dfl_malloc((size_t)T * 4), o->cand = dfl_malloc((size_t)T * 4);
        o->mask = dfl_malloc((size_t)T);
    }
    memcpy(o->ids, iv, (size_t)T * 4);
    memcpy(o->mask, mv, (size_t)T);
    if (tv) memcpy(o->tids, tv, (size_t)T * 4);
    /* the large ones change buffers with the reader instead of being copied */
    dfs_take_decoded(t->r, hid, &o->hidden, &o->cap_hidden);
    if (last) dfs_take_decoded(t->r, last, &o->last, &o->cap_last);
    /* what --loop asks of a pass: a record the steps can use (an anchor) */
    if (dfl_anchor_candidates(o->cand, o->mask, T) > 0) t->in_usable++;
    free(o->id);
    o->id = dfl_strdup(s->id ? s->id : "");
    o->offset = s->offset;
    o->q = (dfl_train_seq){T, o->ids, o->mask, o->hidden, hid->dtype, tv ? o->tids : NULL, last ? o->last : NULL,
                           last ? last->dtype : DFL_F32};
    return 1;
}

/* read_record, its result and position kept in the slot */
static void fill_slot(dfl_trainer *t, read_slot *o) {
    o->rc = read_record(t, o);
    free(o->err);
    o->err = o->rc > 1 ? dfl_strdup(dfl_errmsg()) : NULL;
    o->records = t->in_records;
    o->epoch = t->in_epoch;
}

/* ---- reading ahead ------------------------------------------------------------------ */

/* Two slots: the thread fills one while the step holds the other. A slot
 * is EMPTY (the thread's to fill), FULL (a record waiting for the step) or
 * HELD (the step's, until it asks for the next record). */
enum { SLOT_EMPTY, SLOT_FULL, SLOT_HELD };

struct dfl_read_ahead {
    read_slot slot[2];
    int state[2];
    int fill, take, held; /* the slot the thread fills next, the step takes next, the step holds (-1) */
    int threaded, stop, final; /* final: the step holds the last record there is (the end, an error) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void *read_ahead_main(void *arg) {
    dfl_trainer *t = arg;
    struct dfl_read_ahead *ra = t->ra;
    for (;;) {
        pthread_mutex_lock(&ra->mu);
        while (!ra->stop && ra->state[ra->fill] != SLOT_EMPTY) pthread_cond_wait(&ra->cv, &ra->mu);
        const int stop = ra->stop, i = ra->fill;
        pthread_mutex_unlock(&ra->mu);
        if (stop) break;
        fill_slot(t, &ra->slot[i]); /* the long part, unlocked */
        pthread_mutex_lock(&ra->mu);
        ra->state[i] = SLOT_FULL;
        ra->fill ^= 1;
        pthread_cond_broadcast(&ra->cv);
        pthread_mutex_unlock(&ra->mu);
        if (ra->slot[i].rc != 1) break; /* the end of the input or an error: nothing follows */
    }
    return NULL;
}

static void read_ahead_start(dfl_trainer *t) {
    struct dfl_read_ahead *ra = dfl_calloc(1, sizeof *ra);
    ra->held = -1;
    t->ra = ra;
    if (!t->read_ahead) return;
    pthread_mutex_init(&ra->mu, NULL);
    pthread_cond_init(&ra->cv, NULL);
    ra->threaded = pthread_create(&ra->thread, NULL, read_ahead_main, t) == 0;
    if (!ra->threaded) pthread_mutex_destroy(&ra->mu), pthread_cond_destroy(&ra->cv); /* read as needed instead */
}

static void read_ahead_free(dfl_trainer *t) {
    struct dfl_read_ahead *ra = t->ra;
    if (!ra) return;
    if (ra->threaded) {
        pthread_mutex_lock(&ra->mu);
        ra->stop = 1;
        pthread_cond_broadcast(&ra->cv);
        pthread_mutex_unlock(&ra->mu);
        pthread_join(ra->thread, NULL); /* it finishes the record it is reading, if any */
        pthread_mutex_destroy(&ra->mu);
        pthread_cond_destroy(&ra->cv);
    }
    read_slot_free(&ra->slot[0]), read_slot_free(&ra->slot[1]);
    free(ra);
    t->ra = NULL;
}

/* The next record, read ahead or now; the one taken before is given back. */
static read_slot *take_record(dfl_trainer *t) {
    if (!t->ra) read_ahead_start(t);
    struct dfl_read_ahead *ra = t->ra;
    if (ra->final) return &ra->slot[ra->held]; /* the end or the error, again */
    if (!ra->threaded) {
        fill_slot(t, &ra->slot[0]);
        ra->held = 0;
    } else {
        pthread_mutex_lock(&ra->mu);
        if (ra->held >= 0) ra->state[ra->held] = SLOT_EMPTY, pthread_cond_broadcast(&ra->cv);
        while (ra->state[ra->take] != SLOT_FULL) pthread_cond_wait(&ra->cv, &ra->mu);
        ra->held = ra->take;
        ra->state[ra->held] = SLOT_HELD;
        ra->take ^= 1;
        pthread_mutex_unlock(&ra->mu);
    }
    read_slot *o = &ra->slot[ra->held];
    ra->final = o->rc != 1;
    return o;
}

/* The next record as a training sequence, the input's position moved past
 * it. *got = 0 at the end of the input. */
static int next_seq(dfl_trainer *t, dfl_train_seq *q, int *got) {
    *got = 0;
    if (t->ended) return 0;
    read_slot *o = take_record(t);
    t->records = o->records;
    t->epoch = o->epoch;
    if (o->rc == 0) t->ended = 1;
    if (o->rc != 1) return o->rc ? dfl_err(o->rc, "%s", o->err) : 0;
    /* keep the first sample's hidden dtype for the whole run (one micro-batch, one dtype) */
    if (t->mb.nseq > 0 && t->o.noise_std <= 0 && o->q.hidden_dtype != t->mb.b.feats_dtype)
        return dfl_err(DFL_EX_DATA, "%s: record at offset %" PRIu64 " (\"%s\"): \"hidden\" changes dtype within the stream",
                       t->path, o->offset, o->id);
    if (o->q.T > t->cap) { /* the step's anchors of this sequence */
        t->cap = o->q.T;
        t->anchors = dfl_realloc(t->anchors, (size_t)t->cap * 4);
    }
    *q = o->q;
    *got = 1;
    return 0;
}

/* ---- the step ---------------------------------------------------------------------- */

int dfl_trainer_step(dfl_trainer *t, dfl_step_log *log, int *made) {
    *made = 0;
    const double t0 = dfl_now();
    const dfl_drafter_config *c = &t->d->cfg;
    const int64_t B = c->block_size;
    dfl_train_stats st;
    memset(&st, 0, sizeof st);
    dfl_drafter_start_grad(t->d);
    dfl_train_mb_reset(&t->mb);
    int64_t nseq = 0, tokens = 0, rec0 = t->records;
    double input_wait = 0;
    int rc = 0;
    while ((t->batch_seqs <= 0 || nseq < t->batch_seqs) && (t->batch_tokens <= 0 || tokens < t->batch_tokens)) {
        dfl_train_seq q;
        int got;
        const double w0 = dfl_now();
        rc = next_seq(t, &q, &got);
        input_wait += dfl_now() - w0;
        if (rc) return rc;
        if (!got) break;
        int64_t n = dfl_anchors_sample(t->anchors, q.loss_mask, q.T, t->o.anchors, &t->rng);
        if (n == 0) continue; /* no two consecutive supervised tokens */
        int64_t rows = t->anchors[n - 1] + n * B;
        if (t->mb.nseq > 0 && dfl_train_mb_rows(&t->mb) + rows > t->o.micro_rows) {
            dfl_train_mb_run(t->d, &t->o, &t->mb, &st, 1);
            dfl_train_mb_reset(&t->mb);
        }
        dfl_train_mb_add(&t->mb, c, &t->o, &q, t->anchors, n, &t->rng);
        nseq++;
        tokens += q.T;
    }
    if (nseq == 0) return 0;
    dfl_train_mb_run(t->d, &t->o, &t->mb, &st, 1);
    dfl_train_mb_reset(&t->mb);
    double gn, lr;
    dfl_train_apply(t->d, &t->o, &st, t->step, &gn, &lr);
    t->step++;
    *made = 1;
    if (log) {
        memset(log, 0, sizeof *log);
        log->step = t->step;
        log->loss = dfl_train_loss(&t->o, &st);
        log->accuracy = dfl_train_accuracy(&st);
        log->tau = dfl_train_tau(&st);
        log->grad_norm = gn;
        log->lr = lr;
        for (int64_t k = 1; k < B; k++) log->acc_k[k] = st.count[k] ? (double)st.correct[k] / (double)st.count[k] : NAN;
        log->nseq = st.nseq;
        log->tokens = st.tokens;
        log->block_tokens = st.block_tokens;
        log->records = t->records - rec0;
        log->seconds = dfl_now() - t0;
        log->input_wait = input_wait;
    }
    return 0;
}

static json_t *num_or_null(double x) { return isfinite(x) ? json_real(x) : json_null(); }

json_t *dfl_step_log_json(const dfl_trainer *t, const dfl_step_log *l) {
    json_t *acc = json_array();
    for (int k = 1; k < t->d->cfg.block_size; k++) json_array_append_new(acc, num_or_null(l->acc_k[k]));
    double s = l->seconds > 0 ? l->seconds : 1e-9;
    return json_pack("{sI sf sf so sf sf sf sI sI sI sf sf sf sf}", "step", (json_int_t)l->step, "loss", l->loss,
                     "accuracy", l->accuracy, "accuracy_per_position", acc, "tau", l->tau, "grad_norm", l->grad_norm,
                     "lr", l->lr, "sequences", (json_int_t)l->nseq, "tokens", (json_int_t)l->tokens, "block_tokens",
                     (json_int_t)l->block_tokens, "tokens_per_s", (double)l->tokens / s, "block_tokens_per_s",
                     (double)l->block_tokens / s, "seconds", l->seconds, "input_wait_s", l->input_wait);
}

/* ---- state -------------------------------------------------------------------------- */

json_t *dfl_trainer_opts_json(const dfl_trainer *t) {
    const dfl_train_opts *o = &t->o;
    return json_pack("{sI sf ss ss ss sf sf sf sf sf sf sf sf sI sI sI sI}", "anchors", (json_int_t)o->anchors, "gamma",
                     o->gamma, "loss", o->kl ? "kl" : "ce", "labels", o->labels_target ? "target" : "data", "loss_norm",
                     o->norm_count ? "count" : "weighted", "noise_std", o->noise_std, "lr", o->lr, "warmup_ratio",
                     o->warmup_ratio, "weight_decay", o->weight_decay, "beta1", o->beta1, "beta2", o->beta2, "adam_eps",
                     o->adam_eps, "max_grad_norm", o->max_grad_norm, "total_steps", (json_int_t)o->total_steps,
                     "batch_seqs", (json_int_t)t->batch_seqs, "batch_tokens", (json_int_t)t->batch_tokens,
                     "micro_rows", (json_int_t)o->micro_rows);
}

json_t *dfl_trainer_state_json(const dfl_trainer *t) {
    json_t *rng = json_array();
    for (int i = 0; i < 4; i++) {
        char hex[20];
        snprintf(hex, sizeof hex, "%016" PRIx64, t->rng.s[i]);
        json_array_append_new(rng, json_string(hex));
    }
    char seed[24];
    snprintf(seed, sizeof seed, "%" PRIu64, t->seed);
    json_t *ids = json_array();
    for (int i = 0; i < t->d->cfg.K; i++) json_array_append_new(ids, json_integer(t->d->cfg.layer_ids[i]));
    return json_pack("{ss sI sI so so ss s{ss sI sI sb} s{ss ss sI sI so}}", "format", "dflash-trainer-state", "version",
                     (json_int_t)1, "step", (json_int_t)t->step, "options", dfl_trainer_opts_json(t), "rng", rng, "seed",
                     seed, "input", "path", t->real ? t->real : "-", "records", (json_int_t)t->records, "epoch",
                     (json_int_t)t->epoch, "loop", t->loop, "target", "architecture", t->tcfg->architecture,
                     "config_digest", t->tcfg->digest, "hidden_size", (json_int_t)t->tcfg->hidden_size, "num_layers",
                     (json_int_t)t->tcfg->num_hidden_layers, "layer_ids", ids);
}

int dfl_trainer_restore(dfl_trainer *t, const json_t *state, const char *path) {
    json_t *step = json_object_get(state, "step"), *rng = json_object_get(state, "rng");
    if (!json_is_integer(step) || json_integer_value(step) < 0)
        return dfl_err(DFL_EX_DATA, "%s: \"step\" is not a count", path);
    if (!json_is_array(rng) || json_array_size(rng) != 4) return dfl_err(DFL_EX_DATA, "%s: \"rng\" is not 4 words", path);
    dfl_rng r;
    for (int i = 0; i < 4; i++) {
        /* exactly 16 hex digits: strtoull alone also takes a sign, spaces and "0x" */
        const char *h = json_string_value(json_array_get(rng, (size_t)i));
        int ok = h && strlen(h) == 16;
        for (int k = 0; ok && k < 16; k++) ok = isxdigit((unsigned char)h[k]) != 0;
        if (!ok) return dfl_err(DFL_EX_DATA, "%s: \"rng\"[%d] is not 16 hex digits", path, i);
        r.s[i] = strtoull(h, NULL, 16);
    }
    if (!(r.s[0] | r.s[1] | r.s[2] | r.s[3])) /* xoshiro256** would give zeros forever */
        return dfl_err(DFL_EX_DATA, "%s: \"rng\" is all zero", path);
    const json_t *tg = json_object_get(state, "target");
    const char *dig = json_string_value(json_object_get(tg, "config_digest"));
    if (!dig || strcmp(dig, t->tcfg->digest))
        return dfl_err(DFL_EX_DATA, "%s: trained against target config %s, but --target has config %s", path,
                       dig ? dig : "(none)", t->tcfg->digest);
    const char *seed = json_string_value(json_object_get(state, "seed"));
    uint64_t sv = 0;
    if (seed) { /* a decimal u64, as dfl_trainer_state_json writes it */
        int ok = *seed != 0 && strlen(seed) <= 20;
        for (const char *c = seed; ok && *c; c++) ok = *c >= '0' && *c <= '9';
        errno = 0;
        if (ok) sv = strtoull(seed, NULL, 10);
        if (!ok || errno) return dfl_err(DFL_EX_DATA, "%s: \"seed\" is not a decimal number below 2^64", path);
    }
    t->step = json_integer_value(step);
    t->rng = r;
    if (seed) t->seed = sv;
    return 0;
}
