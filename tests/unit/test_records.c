/* test_records.c: lib/records.c beyond what tests/cli/test_records.sh sees
 * through the tools.
 *
 *   test_queue_*         the read-ahead queue against reading in line: the
 *                        same records in the same order, an error handed
 *                        over where the caller meets it and again after,
 *                        the source on the thread only and never more than
 *                        one record ahead of the caller; freed while the
 *                        thread waits.
 *   test_check_meta      every differing field named, "drafter" for one,
 *                        "drafter 2" among several; the options' tensors.
 *   test_record_too_long a record of 2^24 + 1 tokens is refused by name.
 */
#include "common.h"
#include "records.h"
#include "test.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the queue ---------------------------------------------------------------- */

typedef struct {
    int n;                  /* records before the end (or the error) */
    int fail;               /* end with an error instead of the end */
    atomic_int made, taken; /* source calls, caller's takes */
    atomic_int ahead_bad;   /* a record made more than one ahead of the caller */
    atomic_int on_caller;   /* the source ran on the caller's thread */
    pthread_t caller;
} counter_src;

static int counter_next(void *ctx, dfl_record *o) {
    counter_src *c = ctx;
    const int i = atomic_fetch_add(&c->made, 1) + 1; /* 1-based */
    /* two records in memory: the slot of record i - 2 is given back when
     * the caller takes record i - 1 (the counter counts takes begun) */
    if (i > 2 && i > atomic_load(&c->taken) + 1) atomic_store(&c->ahead_bad, 1);
    if (pthread_equal(pthread_self(), c->caller)) atomic_store(&c->on_caller, 1);
    usleep(200); /* let the caller run ahead of the thread now and then */
    if (i > c->n) return c->fail ? dfl_err(DFL_EX_DATA, "record %d: spoiled", i) : 0;
    o->q.T = i;
    o->records = 10 * i;
    return 1;
}

/* Take every record; the sequence of (rc, T) as a string, and the message. */
static void drain(int threaded, counter_src *c, char *seq, size_t n, char *msg, size_t nmsg) {
    c->caller = pthread_self();
    dfl_record_queue *q = dfl_record_queue_new(counter_next, c, threaded);
    seq[0] = 0;
    for (int k = 0; k < 100; k++) {
        atomic_fetch_add(&c->taken, 1);
        dfl_record *o = dfl_record_queue_take(q);
        size_t len = strlen(seq);
        snprintf(seq + len, n - len, "%d:%" PRId64 ":%" PRId64 " ", o->rc, o->rc == 1 ? o->q.T : 0,
                 o->rc == 1 ? o->records : 0);
        if (o->rc != 1) {
            snprintf(msg, nmsg, "%s", o->err ? o->err : "");
            /* asked again: the same record */
            dfl_record *again = dfl_record_queue_take(q);
            T_CHECK(again == o && again->rc == o->rc);
            usleep(2000);
            break;
        }
    }
    dfl_record_queue_free(q);
}

static void test_queue_same_as_in_line(void) {
    for (int fail = 0; fail < 2; fail++) {
        char seq[2][512], msg[2][128];
        counter_src c[2] = {{.n = 7, .fail = fail}, {.n = 7, .fail = fail}};
        drain(0, &c[0], seq[0], sizeof seq[0], msg[0], sizeof msg[0]);
        drain(1, &c[1], seq[1], sizeof seq[1], msg[1], sizeof msg[1]);
        T_CHECKF(!strcmp(seq[0], seq[1]), "in line %s, ahead %s", seq[0], seq[1]);
        const char *want = fail ? "1:1:10 1:2:20 1:3:30 1:4:40 1:5:50 1:6:60 1:7:70 65:0:0 "
                                : "1:1:10 1:2:20 1:3:30 1:4:40 1:5:50 1:6:60 1:7:70 0:0:0 ";
        T_CHECKF(!strcmp(seq[1], want), "%s", seq[1]);
        T_CHECKF(!strcmp(msg[0], fail ? "record 8: spoiled" : ""), "%s", msg[0]);
        T_CHECKF(!strcmp(msg[1], msg[0]), "%s vs %s", msg[1], msg[0]);
        /* the thread stops at the end or the error: no call past it */
        T_CHECKF(atomic_load(&c[1].made) == 8, "%d source calls", atomic_load(&c[1].made));
        T_CHECK(!atomic_load(&c[1].ahead_bad));
        T_CHECK(!atomic_load(&c[1].on_caller)); /* threaded: the source runs on the thread */
        T_CHECK(atomic_load(&c[0].on_caller));  /* in line: on the caller's */
    }
}

static void test_queue_freed_while_waiting(void) {
    counter_src c = {.n = 1000};
    c.caller = pthread_self();
    dfl_record_queue *q = dfl_record_queue_new(counter_next, &c, 1);
    atomic_fetch_add(&c.taken, 1);
    dfl_record *o = dfl_record_queue_take(q);
    T_CHECK(o->rc == 1 && o->q.T == 1);
    usleep(5000); /* the thread fills record 2, then waits for a free record */
    dfl_record_queue_free(q);
    T_CHECKF(atomic_load(&c.made) == 2, "%d source calls", atomic_load(&c.made));
    /* freed before the first take */
    q = dfl_record_queue_new(counter_next, &c, 1);
    dfl_record_queue_free(q);
}

/* ---- the stream against the target and the drafters ------------------------------ */

static dfs_hs_meta meta_of(void) {
    dfs_hs_meta m;
    memset(&m, 0, sizeof m);
    snprintf(m.architecture, sizeof m.architecture, "Qwen3ForCausalLM");
    snprintf(m.config_digest, sizeof m.config_digest, "0123456789abcdef");
    snprintf(m.hidden_dtype, sizeof m.hidden_dtype, "bf16");
    m.hidden_size = 32, m.num_layers = 6, m.vocab_size = 61, m.nlayers = 3;
    m.layer_ids[0] = 1, m.layer_ids[1] = 3, m.layer_ids[2] = 4;
    return m;
}

static void test_check_meta(void) {
    dfl_model_config tc;
    memset(&tc, 0, sizeof tc);
    snprintf(tc.architecture, sizeof tc.architecture, "Qwen3ForCausalLM");
    snprintf(tc.digest, sizeof tc.digest, "0123456789abcdef");
    tc.hidden_size = 32, tc.num_hidden_layers = 6, tc.vocab_size = 61;
    dfl_drafter d1, d2;
    memset(&d1, 0, sizeof d1);
    d1.cfg.K = 3, d1.cfg.H = 32, d1.cfg.V = 61;
    d1.cfg.layer_ids[0] = 1, d1.cfg.layer_ids[1] = 3, d1.cfg.layer_ids[2] = 4;
    d2 = d1;
    dfl_drafter *ds[2] = {&d1, &d2};
    dfs_hs_meta m = meta_of();
    T_CHECKF(dfl_records_check_meta(&m, "s.dfs", &tc, ds, 2, 0, 0) == 0, "%s", dfl_errmsg());
    d2.cfg.layer_ids[2] = 5;
    T_CHECK(dfl_records_check_meta(&m, "s.dfs", &tc, ds, 2, 0, 0) == DFL_EX_DATA);
    T_CHECKF(strstr(dfl_errmsg(), "s.dfs: the stream does not match") &&
             strstr(dfl_errmsg(), "layer_ids: stream [1,3,4] vs drafter 2 target_layer_ids [1,3,5]") &&
             !strstr(dfl_errmsg(), "drafter 1"), "%s", dfl_errmsg());
    T_CHECK(dfl_records_check_meta(&m, "s.dfs", &tc, ds + 1, 1, 0, 0) == DFL_EX_DATA);
    T_CHECKF(strstr(dfl_errmsg(), "vs drafter target_layer_ids [1,3,5]"), "%s", dfl_errmsg());
    /* every field at once, each named with both values */
    m.hidden_size = 16, m.vocab_size = 60, m.num_layers = 7;
    snprintf(m.architecture, sizeof m.architecture, "LlamaForCausalLM");
    snprintf(m.config_digest, sizeof m.config_digest, "fedcba9876543210");
    T_CHECK(dfl_records_check_meta(&m, "s.dfs", &tc, ds, 1, 0, 0) == DFL_EX_DATA);
    const char *want[] = {"hidden_size: stream 16 vs target 32", "architecture: stream LlamaForCausalLM vs target",
                          "config_digest: stream fedcba9876543210 vs target config.json 0123456789abcdef",
                          "num_layers: stream 7 vs target 6", "vocab_size: stream 60 vs target 61",
                          "hidden_size: stream 16 vs drafter 32", "vocab_size: stream 60 vs drafter 61"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) T_CHECKF(strstr(dfl_errmsg(), want[i]), "%s", want[i]);
    /* the options' tensors */
    m = meta_of();
    T_CHECK(dfl_records_check_meta(&m, "s.dfs", &tc, ds, 1, 1, 0) == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "--labels target needs \"target_ids\""));
    T_CHECK(dfl_records_check_meta(&m, "s.dfs", &tc, ds, 1, 0, 1) == DFL_EX_DATA &&
            strstr(dfl_errmsg(), "--loss kl needs \"last_hidden\""));
    m.has_target_ids = m.has_last_hidden = 1;
    T_CHECK(dfl_records_check_meta(&m, "s.dfs", &tc, ds, 1, 1, 1) == 0);
}

/* ---- one record ------------------------------------------------------------------ */

static void test_record_too_long(void) {
    char path[] = "/tmp/test_records.XXXXXX";
    int fd = mkstemp(path);
    T_CHECK(fd >= 0);
    FILE *f = fdopen(fd, "wb");
    dfs_hs_meta m = meta_of();
    m.hidden_size = 1, m.nlayers = 1;
    json_t *meta = dfs_hs_meta_to_json(&m);
    dfs_writer *w;
    T_CHECK(dfs_writer_open(&w, f, path, meta, "test_records", (dfs_encoding){DFS_CODEC_NONE, 0, 1}) == 0);
    for (int k = 0; k < 2; k++) { /* the longest record taken, then one token more */
        const int64_t T = DFL_RECORD_MAX_TOKENS + k;
        void *zeros = dfl_calloc((size_t)T, 4);
        dfs_tensor_in t[3] = {{"input_ids", DFL_I32, 1, {T}, zeros, NULL},
                              {"loss_mask", DFL_U8, 1, {T}, zeros, NULL},
                              {"hidden", DFL_BF16, 2, {T, 1}, zeros, NULL}};
        T_CHECK(dfs_write(w, k ? "long" : "ok", 3, t) == 0);
        free(zeros);
    }
    T_CHECK(dfs_writer_close(w) == 0);
    fclose(f);
    json_decref(meta);
    dfs_reader *r;
    T_CHECK(dfs_reader_open(&r, path) == 0);
    dfl_record o;
    memset(&o, 0, sizeof o);
    T_CHECKF(dfl_record_read(r, &m, path, 0, 0, &o) == 1, "%s", dfl_errmsg());
    T_CHECK(o.q.T == DFL_RECORD_MAX_TOKENS && !strcmp(o.id, "ok"));
    T_CHECK(dfl_record_read(r, &m, path, 0, 0, &o) == DFL_EX_DATA);
    T_CHECKF(strstr(dfl_errmsg(), "sample \"long\": tensor \"input_ids\" holds 16777217 tokens, more than 2^24"),
             "%s", dfl_errmsg());
    dfs_reader_close(r);
    dfl_record_free(&o);
    unlink(path);
}

int main(void) {
    T_RUN(test_queue_same_as_in_line);
    T_RUN(test_queue_freed_while_waiting);
    T_RUN(test_check_meta);
    T_RUN(test_record_too_long);
    return t_exit();
}
