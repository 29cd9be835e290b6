/* trainer.c: the step loop of dflash-train-step over a hidden-state stream. */
#include "trainer.h"

#include "common.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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

void dfl_trainer_free(dfl_trainer *t) {
    dfl_record_queue_free(t->q); /* first: its thread uses the reader */
    if (t->r) dfs_reader_close(t->r);
    free(t->path);
    free(t->real);
    free(t->anchors);
    free(t->cand);
    dfl_train_mb_free(&t->mb);
    memset(t, 0, sizeof *t);
}

/* ---- the input ----------------------------------------------------------------- */

static int reopen(dfl_trainer *t) {
    if (t->r) dfs_reader_close(t->r);
    t->r = NULL;
    int rc = dfs_reader_open(&t->r, t->path);
    if (rc) return rc;
    rc = dfs_hs_meta_from_json(dfs_reader_meta(t->r), &t->meta, t->path);
    return rc ? rc : dfl_records_check_meta(&t->meta, t->path, t->tcfg, &t->d, 1, t->o.labels_target, t->o.kl);
}

int dfl_trainer_check_loop(const char *path, int loop) {
    if (!loop) return 0;
    if (!strcmp(path, "-")) return dfl_err(DFL_EX_USAGE, "--loop needs a file to re-read, not standard input");
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return dfl_err(DFL_EX_USAGE, "%s: --loop needs a regular file it can re-read, and this is %s (write the "
                       "stream to a file first, or leave out --loop)", path, dfl_file_kind(st.st_mode));
    return 0;
}

int dfl_trainer_open(dfl_trainer *t, const char *path, int64_t skip, int64_t epoch) {
    int rc = dfl_trainer_check_loop(path, t->loop);
    if (rc) return rc;
    free(t->path);
    free(t->real);
    t->path = dfl_strdup(path);
    if (!strcmp(path, "-")) {
        t->real = dfl_strdup("-");
    } else {
        char *rp = realpath(path, NULL);
        t->real = rp ? rp : dfl_strdup(path);
    }
    DFL_ASSERT(!t->q); /* opened once */
    rc = reopen(t);
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
    if (t->read_ahead < 0) t->read_ahead = dfl_records_can_read_ahead(path);
    return 0;
}

void dfl_trainer_read_ahead(dfl_trainer *t, int on) {
    DFL_ASSERT(!t->q); /* before the first step */
    t->read_ahead = on && t->path && dfl_records_can_read_ahead(t->path);
}

/* The next record into o, on the reader's side (the read-ahead thread's
 * once it runs): at the end of a pass, --loop starts the next one. */
static int next_record(void *ctx, dfl_record *o) {
    dfl_trainer *t = ctx;
    if (t->in_ended) return 0;
    int rc = dfl_record_read(t->r, &t->meta, t->path, t->o.labels_target, t->o.kl, o);
    if (rc == 0 && t->loop) {
        if (t->in_usable == 0)
            return dfl_err(DFL_EX_DATA, "%s: --loop over a stream with no usable record (none has two consecutive "
                           "supervised tokens)", t->path);
        t->in_epoch++;
        t->in_records = 0;
        t->in_usable = 0;
        if ((rc = reopen(t))) return rc;
        rc = dfl_record_read(t->r, &t->meta, t->path, t->o.labels_target, t->o.kl, o);
    }
    if (rc == 0) t->in_ended = 1;
    if (rc != 1) return rc;
    t->in_records++;
    /* what --loop asks of a pass: a record the steps can use (an anchor) */
    if ((size_t)o->q.T > t->cap_cand) {
        t->cap_cand = (size_t)o->q.T;
        t->cand = dfl_realloc(t->cand, t->cap_cand * 4);
    }
    if (dfl_anchor_candidates(t->cand, o->q.loss_mask, o->q.T) > 0) t->in_usable++;
    o->records = t->in_records;
    o->epoch = t->in_epoch;
    return 1;
}

/* The next record as a training sequence, the input's position moved past
 * it. *got = 0 at the end of the input. */
static int next_seq(dfl_trainer *t, dfl_train_seq *q, int *got) {
    *got = 0;
    if (t->ended) return 0;
    if (!t->q) t->q = dfl_record_queue_new(next_record, t, t->read_ahead > 0);
    dfl_record *o = dfl_record_queue_take(t->q);
    if (o->rc == 0) t->ended = 1;
    if (o->rc != 1) return o->rc ? dfl_err(o->rc, "%s", o->err) : 0;
    t->records = o->records;
    t->epoch = o->epoch;
    /* keep the first sample's hidden dtype for the whole run (one micro-batch, one dtype) */
    if (t->mb.nseq > 0 && t->o.noise_std <= 0 && o->q.hidden_dtype != t->mb.b.feats_dtype)
        return dfs_sample_err(t->path, o->offset, o->record, o->id, "\"hidden\" changes dtype within the stream");
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

/* JSON has no NaN or infinity: json_pack's "f" fails on them, and the step
 * whose loss diverged printed "(null)" for its whole line. As in
 * dflash-score's lines, a figure that is not finite is written null. */
static json_t *num_or_null(double x) { return isfinite(x) ? json_real(x) : json_null(); }

json_t *dfl_step_log_json(const dfl_trainer *t, const dfl_step_log *l) {
    json_t *acc = json_array();
    for (int k = 1; k < t->d->cfg.block_size; k++) json_array_append_new(acc, num_or_null(l->acc_k[k]));
    double s = l->seconds > 0 ? l->seconds : 1e-9;
    json_t *j = json_pack("{sI so so so so so so sI sI sI so so so so}", "step", (json_int_t)l->step, "loss",
                          num_or_null(l->loss), "accuracy", num_or_null(l->accuracy), "accuracy_per_position", acc,
                          "tau", num_or_null(l->tau), "grad_norm", num_or_null(l->grad_norm), "lr", num_or_null(l->lr),
                          "sequences", (json_int_t)l->nseq, "tokens", (json_int_t)l->tokens, "block_tokens",
                          (json_int_t)l->block_tokens, "tokens_per_s", num_or_null((double)l->tokens / s),
                          "block_tokens_per_s", num_or_null((double)l->block_tokens / s), "seconds",
                          num_or_null(l->seconds), "input_wait_s", num_or_null(l->input_wait));
    DFL_ASSERT(j); /* only an allocation can fail now */
    return j;
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
    /* bounded: the run's last step, step + --steps, must not overflow */
    if (!json_is_integer(step) || json_integer_value(step) < 0 || json_integer_value(step) > DFL_TRAIN_MAX_STEPS)
        return dfl_err(DFL_EX_DATA, "%s: \"step\" is not a count in [0, 2^53]", path);
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
