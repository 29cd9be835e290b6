/* dflash-score: acceptance length of DFlash drafters, offline on a
 * hidden-state stream or online in speculative decoding with the target
 * (man dflash-score). Options are parsed here; the measuring is in
 * lib/score.c, the caches in lib/target_kv.c and lib/drafter_infer.c. */
#include "checkpoint.h"
#include "cli.h"
#include "common.h"
#include "drafter.h"
#include "jsonl.h"
#include "model_config.h"
#include "ops.h"
#include "outfile.h"
#include "score.h"
#include "target.h"
#include "train.h"

#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PROG "dflash-score"

static const char *target_dir, *prompts, *emit_path, *anchors_from_path, *device = "cpu";
static const char *labels = NULL, *read_ahead = NULL;
static dfl_strlist drafters = {0, NULL};
#define UNSET INT64_MIN /* an integer option not given (a given negative value is refused, not ignored) */
static int64_t anchors = UNSET, seed = UNSET, micro_rows = UNSET, max_new = UNSET, threads = 0, top_k = UNSET;
static double gamma_ = NAN, temperature = NAN, top_p = NAN;
static int json_out, no_header, ignore_eos, progress;

static const dfl_opt opts[] = {
    {"target", 0, DFL_OPT_STR, &target_dir, "DIR",
     "The target model directory (config.json, model.safetensors or an index). Offline only its embedding, LM head "
     "and final norm are read (the drafter's frozen parts); online the whole model runs. Required.", NULL},
    {"drafter", 0, DFL_OPT_LIST, &drafters, "CKPT",
     "A drafter checkpoint directory (ours or a released z-lab one: config.json and model.safetensors). Repeat to "
     "score several on the same anchors or prompts; one output line each, in the order given. Required.", NULL},
    {"labels", 0, DFL_OPT_CHOICE, &labels, "data|target",
     "Offline: compare the drafts with the stream's tokens, or with its target_ids (the target's greedy tokens), as "
     "training does.", "data"},
    {"anchors", 0, DFL_OPT_INT, &anchors, "N",
     "Offline: draw N anchors per record (without replacement, from the --seed RNG) instead of using every supervised "
     "anchor (a with loss_mask[a] = loss_mask[a+1] = 1). 0 means every one.", "0"},
    {"seed", 0, DFL_OPT_INT, &seed, "N",
     "Seed of the RNG that draws --anchors (offline), or the target's tokens at --temperature T > 0 (online; no "
     "effect at 0).", "0"},
    {"anchors-from", 0, DFL_OPT_STR, &anchors_from_path, "FILE",
     "Offline: score exactly at the anchors of an --emit file of an online run (its \"anchors\" per id; records are "
     "matched by id, and every id of the file must be in the stream).", NULL},
    {"gamma", 0, DFL_OPT_DOUBLE, &gamma_, "G",
     "Offline: decay of the reported loss over block positions, w_k = exp(-(k-1)/G), as training.",
     "7 for B >= 16, 5 for B >= 10, else 4"},
    {"micro-rows", 0, DFL_OPT_INT, &micro_rows, "N",
     "Offline: rows (context + block) per drafter forward; memory grows with N.", "8192"},
    {"read-ahead", 0, DFL_OPT_CHOICE, &read_ahead, "on|off",
     "Offline: from a regular file, read and decode the next record on a thread while the drafters run on this "
     "one (standard input or a FIFO is read as records are needed). The same figures either way; off saves the "
     "memory of a record.", "on"},
    {"prompts", 0, DFL_OPT_STR, &prompts, "FILE",
     "Online: run speculative decoding with the target on these prompts (tokenized JSONL: input_ids; loss_mask is "
     "ignored), beside plain decoding of the target (greedy, or sampled at --temperature).", NULL},
    {"max-new-tokens", 0, DFL_OPT_INT, &max_new, "N", "Online: tokens to generate per prompt.", "256"},
    {"temperature", 0, DFL_OPT_DOUBLE, &temperature, "T",
     "Online: draw the target's tokens from softmax(logits / T) instead of taking the argmax; the draft stays "
     "greedy and a drafted token is accepted when it equals the target's draw, as in the z-lab reference. The draw "
     "at each position is fixed by --seed, the prompt's id and the position, so plain decoding makes "
     "the same draws and the speculative output must equal it (mismatches 0), and every drafter meets the same "
     "draws. 0 is greedy; otherwise T is in [0.001, 1000].", "0"},
    {"top-k", 0, DFL_OPT_INT, &top_k, "K",
     "Online, with --temperature: draw among the K tokens of highest logit (those tied with the K-th too).", "off"},
    {"top-p", 0, DFL_OPT_DOUBLE, &top_p, "P",
     "Online, with --temperature: draw among the fewest highest tokens that hold at least P of the probability "
     "(after --top-k, as transformers orders them; ties with the last one kept). P in (0, 1].", "off"},
    {"ignore-eos", 0, DFL_OPT_FLAG, &ignore_eos, NULL,
     "Online: do not stop at the target's eos ids; every response is --max-new-tokens long.", NULL},
    {"emit", 0, DFL_OPT_STR, &emit_path, "FILE",
     "Online: write one JSON line per prompt and drafter: id, drafter, prompt_tokens, output_ids (speculative), "
     "greedy_ids, acceptance_lengths (a+1 of every cycle) and anchors (the position of every cycle's anchor).", NULL},
    {"json", 0, DFL_OPT_FLAG, &json_out, NULL, "Write JSON lines instead of TSV.", NULL},
    {"no-header", 0, DFL_OPT_FLAG, &no_header, NULL, "TSV without the header row (to append to a file).", NULL},
    {"device", 0, DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N.", NULL},
    {"threads", 0, DFL_OPT_INT, &threads, "N",
     "CPU threads, for the ops and for decoding each record's large tensors (0: OpenMP's default; at most 4096).",
     NULL},
    {"progress", 0, DFL_OPT_FLAG, &progress, NULL, "Show progress on stderr even when it is not a terminal.", NULL},
    {NULL, 0, 0, NULL, NULL, NULL, NULL},
};

static const dfl_cli cli = {
    PROG,
    "acceptance length of DFlash drafters, offline on a stream or online with the target",
    "--target DIR --drafter CKPT [--drafter CKPT ...] [OPTIONS] [STREAM]\n"
    "--target DIR --drafter CKPT [--drafter CKPT ...] --prompts PROMPTS.jsonl [--max-new-tokens N] [OPTIONS]",
    opts,
};

/* The step of a checkpoint's trainer state; -1 for a released checkpoint.
 * A drafter trained against a target whose config.json differs from
 * --target's (the sizes agree, or loading it would have failed) is scored,
 * since that can be the experiment (another revision of the target), but
 * not silently: a warning names both configs' digests. */
static int64_t ckpt_step(const char *dir, const dfl_model_config *tcfg) {
    if (!dfl_ckpt_has_state(dir)) return -1;
    char path[4200];
    snprintf(path, sizeof path, "%s/trainer_state.json", dir);
    json_t *j;
    if (dfl_load_json(path, DFL_JSON_FILE_MAX, "trainer_state.json", &j)) dfl_die_last(PROG);
    json_t *s = json_object_get(j, "step");
    if (!json_is_integer(s) || json_integer_value(s) < 0)
        dfl_die(PROG, DFL_EX_DATA, "%s: \"step\" is missing or not a count", path);
    const char *dig = json_string_value(json_object_get(json_object_get(j, "target"), "config_digest"));
    if (dig && strcmp(dig, tcfg->digest))
        fprintf(stderr, "%s: warning: %s was trained against another target config.json (digest %s; "
                        "%s/config.json: %s)\n",
                PROG, dir, dig, target_dir, tcfg->digest);
    int64_t step = json_integer_value(s);
    json_decref(j);
    return step;
}

/* --top-p P as the sampler's float, where 0 means off. A positive P below
 * the smallest float rounds to 0 (1e-50 did), and the draw was silently
 * from every token. Any P below FLT_MIN, the smallest normal float, keeps
 * only the most probable token and its ties, as FLT_MIN does: it is clamped
 * there. The output lines report P as given. */
static float top_p_float(double p) {
    if (isnan(p)) return 0.0f;
    return p < FLT_MIN ? FLT_MIN : (float)p;
}

static void utc_now(char *buf, size_t n) {
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(buf, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static void check_options(int online, int npos, char **pos) {
    if (!target_dir) dfl_cli_usage_error(&cli, "--target DIR is required");
    if (drafters.n < 1) dfl_cli_usage_error(&cli, "--drafter CKPT is required");
    if (threads < 0 || threads > DFL_MAX_THREADS)
        dfl_cli_usage_error(&cli, "--threads must be in [0, %d]", DFL_MAX_THREADS);
    if (online) {
        if (npos) dfl_cli_usage_error(&cli, "--prompts reads no stream (got '%s')", pos[0]);
        if (labels || anchors != UNSET || anchors_from_path || !isnan(gamma_) || micro_rows != UNSET || read_ahead)
            dfl_cli_usage_error(&cli, "--labels, --anchors, --anchors-from, --gamma, --micro-rows and --read-ahead are "
                                      "for the offline mode (a stream), not --prompts");
        if (max_new == UNSET) max_new = 256;
        if (max_new < 1 || max_new > (1 << 24)) dfl_cli_usage_error(&cli, "--max-new-tokens must be in [1, 2^24]");
        if (isnan(temperature)) temperature = 0;
        if (!(temperature == 0 || (temperature >= 1e-3 && temperature <= 1e3)))
            dfl_cli_usage_error(&cli, "--temperature must be 0 (greedy) or in [0.001, 1000]");
        if (seed == UNSET) seed = 0;
        if (seed < 0) dfl_cli_usage_error(&cli, "--seed must be >= 0");
        if ((top_k != UNSET || !isnan(top_p)) && temperature == 0)
            dfl_cli_usage_error(&cli, "--top-k and --top-p need --temperature > 0 (greedy takes the argmax)");
        if (top_k != UNSET && (top_k < 1 || top_k > INT32_MAX)) dfl_cli_usage_error(&cli, "--top-k must be >= 1");
        if (!isnan(top_p) && !(top_p > 0 && top_p <= 1)) dfl_cli_usage_error(&cli, "--top-p must be in (0, 1]");
    } else {
        if (npos > 1) dfl_cli_usage_error(&cli, "one input stream at most (got %d)", npos);
        if ((!npos || !strcmp(pos[0], "-")) && isatty(STDIN_FILENO))
            dfl_cli_usage_error(&cli, "refusing to read a binary stream from a terminal; give a STREAM or redirect stdin");
        if (max_new != UNSET || emit_path || ignore_eos || !isnan(temperature) || top_k != UNSET || !isnan(top_p))
            dfl_cli_usage_error(&cli, "--max-new-tokens, --temperature, --top-k, --top-p, --emit and --ignore-eos need "
                                      "--prompts (the online mode)");
        if (anchors_from_path && (anchors != UNSET || seed != UNSET))
            dfl_cli_usage_error(&cli, "give --anchors-from or --anchors/--seed, not both");
        if (anchors == UNSET) anchors = 0;
        if (seed == UNSET) seed = 0;
        if (seed < 0) dfl_cli_usage_error(&cli, "--seed must be >= 0");
        if (anchors < 0 || anchors > (1 << 24)) dfl_cli_usage_error(&cli, "--anchors must be in [0, 2^24]");
        if (micro_rows == UNSET) micro_rows = 8192;
        if (micro_rows < 1) dfl_cli_usage_error(&cli, "--micro-rows must be at least 1");
        if (!isnan(gamma_) && !(gamma_ > 0)) dfl_cli_usage_error(&cli, "--gamma must be positive");
        if (!labels) labels = "data";
        if (!read_ahead) read_ahead = "on";
    }
}

/* "" (an unset shell variable) for an input: --target '' read /config.json */
static void check_input_names(int npos, char **pos) {
    int rc = dfl_in_check_name("--target", target_dir) || dfl_in_check_name("--anchors-from", anchors_from_path) ||
             dfl_in_check_name("--prompts", prompts);
    for (int i = 0; !rc && i < drafters.n; i++) rc = dfl_in_check_name("--drafter", drafters.v[i]);
    for (int i = 0; !rc && i < npos; i++) rc = dfl_in_check_name("input", pos[i]);
    if (rc) dfl_die_last(PROG);
}

/* --emit must not replace the prompts, or a model's files, once the run
 * ends (it is renamed into place then). */
static void check_emit_path(void) {
    int rc = dfl_out_check_input("--emit", emit_path, "--prompts", prompts, DFL_IN_FILE) ||
             dfl_out_check_input("--emit", emit_path, "--target", target_dir, DFL_IN_MODEL_DIR);
    for (int i = 0; !rc && i < drafters.n; i++)
        rc = dfl_out_check_input("--emit", emit_path, "--drafter", drafters.v[i], DFL_IN_MODEL_DIR);
    if (rc) dfl_cli_usage_error(&cli, "%s", dfl_errmsg());
}

static dfl_drafter *load_drafter(const dfl_ops *ops, const char *dir, const dfl_model_config *tcfg) {
    dfl_drafter_config c;
    if (dfl_ckpt_load_config(dir, &c)) dfl_die_last(PROG);
    /* a drafter made for another target is named as such, and both checks
     * read headers only: a mismatch costs no allocation the size of the model */
    if (dfl_drafter_check_target(&c, tcfg, target_dir) || dfl_ckpt_check_weights(dir, &c)) {
        fprintf(stderr, "%s: %s: %s\n", PROG, dir, dfl_errmsg());
        exit(dfl_errcode());
    }
    dfl_drafter *d = dfl_drafter_new_frozen(ops, &c);
    dfl_drafter_config_free(&c);
    if (dfl_drafter_load_target(d, target_dir, tcfg) || dfl_ckpt_load_weights(dir, d)) {
        fprintf(stderr, "%s: %s: %s\n", PROG, dir, dfl_errmsg());
        exit(dfl_errcode());
    }
    return d;
}

static void print_lines(json_t **lines, int n) {
    for (int i = 0; i < n; i++) {
        if (json_out) {
            char *s = json_dumps(lines[i], JSON_COMPACT | JSON_REAL_PRECISION(10));
            printf("%s\n", s);
            free(s);
        } else {
            if (i == 0 && !no_header) dfl_score_tsv_header(stdout, lines[i]);
            dfl_score_tsv_row(stdout, lines[i]);
        }
    }
}

int main(int argc, char **argv) {
    char **pos;
    int npos = dfl_cli_parse(&cli, argc, argv, &pos);
    const int online = prompts != NULL;
    check_options(online, npos, pos);
    if (dfl_out_check_name("--emit", emit_path)) dfl_die_last(PROG); /* before the models are loaded */
    check_input_names(npos, pos);
    check_emit_path();
    const char *input = online ? prompts : npos ? pos[0] : "-";
    dfl_ops_cpu_threads(threads);
    dfs_set_codec_threads((int)threads); /* the records' decoding too */
    char when[32];
    utc_now(when, sizeof when);

    const dfl_ops *ops;
    if (dfl_ops_get(device, &ops)) dfl_die_last(PROG);
    dfl_set_oom_hint(PROG, "while loading the drafters%s", online ? " and the target" : "");
    dfl_model_config tcfg;
    if (dfl_model_config_load_dir(&tcfg, target_dir, "target")) dfl_die_last(PROG);

    const int nd = drafters.n;
    dfl_drafter **d = dfl_calloc((size_t)nd, sizeof *d);
    int64_t *steps = dfl_calloc((size_t)nd, sizeof *steps);
    for (int i = 0; i < nd; i++) {
        d[i] = load_drafter(ops, drafters.v[i], &tcfg);
        steps[i] = ckpt_step(drafters.v[i], &tcfg);
    }
    json_t **lines = dfl_calloc((size_t)nd, sizeof *lines);
    dfl_score_line line = {when, NULL, -1, input, online, labels, 0, NULL, -1, max_new, online ? temperature : 0,
                           online && temperature > 0 ? seed : -1, top_k != UNSET ? top_k : -1, top_p};

    if (online) {
        dfl_target *t;
        dfl_target_opts topts = {0, 1};
        if (dfl_target_load(&t, target_dir, ops, &topts)) dfl_die_last(PROG);
        dfl_set_oom_hint(PROG, "the KV caches grow with a prompt's length plus --max-new-tokens (now %lld)",
                         (long long)max_new);
        dfl_jsonl *in;
        if (dfl_jsonl_open(&in, prompts, tcfg.vocab_size)) dfl_die_last(PROG);
        dfl_out *emit = NULL;
        if (emit_path && dfl_out_open(&emit, emit_path, 0)) dfl_die_last(PROG);
        dfl_online_opts oo = {.max_new = max_new,
                              .ignore_eos = ignore_eos,
                              .temperature = (float)temperature,
                              .seed = (uint64_t)seed,
                              .top_k = top_k != UNSET ? (int32_t)top_k : 0,
                              .top_p = top_p_float(top_p),
                              .progress = progress,
                              .emit = emit ? dfl_out_file(emit) : NULL,
                              .emit_name = emit ? dfl_out_path(emit) : NULL,
                              .names = drafters.v};
        dfl_score_stats *st = dfl_calloc((size_t)nd, sizeof *st);
        int rc = dfl_score_online(t, d, nd, in, &oo, st);
        if (rc) {
            dfl_out_abort(emit);
            dfl_die_last(PROG);
        }
        if (emit && dfl_out_commit(emit)) dfl_die_last(PROG);
        for (int i = 0; i < nd; i++) {
            line.drafter = drafters.v[i];
            line.step = steps[i];
            lines[i] = dfl_score_line_json(&line, &st[i]);
        }
        free(st);
        dfl_jsonl_close(in);
        dfl_target_free(t);
    } else {
        json_t *from = NULL;
        if (anchors_from_path && dfl_score_load_anchors(anchors_from_path, &from)) dfl_die_last(PROG);
        dfl_offline **sc = dfl_calloc((size_t)nd, sizeof *sc);
        double *gam = dfl_calloc((size_t)nd, sizeof *gam);
        for (int i = 0; i < nd; i++) {
            dfl_train_opts o;
            dfl_train_opts_default(&o, d[i]->cfg.block_size);
            if (!isnan(gamma_)) o.gamma = gamma_;
            o.labels_target = !strcmp(labels, "target");
            gam[i] = o.gamma;
            sc[i] = dfl_offline_new(d[i], &o, micro_rows);
        }
        dfl_set_oom_hint(PROG, "a forward's buffers grow with --micro-rows (now %lld)", (long long)micro_rows);
        dfl_score_stream_opts so = {anchors, (uint64_t)seed, from, !strcmp(labels, "target"), progress,
                                    !strcmp(read_ahead, "on")};
        int64_t records;
        if (dfl_score_stream(sc, d, nd, &tcfg, input, &so, &records)) dfl_die_last(PROG);
        char anc[32];
        if (from) snprintf(anc, sizeof anc, "file");
        else if (anchors > 0) snprintf(anc, sizeof anc, "%lld", (long long)anchors);
        else snprintf(anc, sizeof anc, "all");
        line.anchors = anc;
        line.seed = !from && anchors > 0 ? seed : -1;
        for (int i = 0; i < nd; i++) {
            line.drafter = drafters.v[i];
            line.step = steps[i];
            line.gamma = gam[i];
            lines[i] = dfl_score_line_json(&line, dfl_offline_finish(sc[i]));
            dfl_offline_free(sc[i]);
        }
        free(sc);
        free(gam);
        json_decref(from);
    }
    print_lines(lines, nd);
    for (int i = 0; i < nd; i++) {
        json_decref(lines[i]);
        dfl_drafter_free(d[i]);
    }
    free(lines);
    free(d);
    free(steps);
    free(drafters.v);
    free(pos);
    dfl_model_config_free(&tcfg);
    if (dfl_close_stdout()) dfl_die_last(PROG);
    return 0;
}
