/* dflash-train-step: advance a DFlash drafter checkpoint by N optimizer
 * steps (man dflash-train-step). Options are parsed here; the math is in
 * lib/drafter.c, lib/train.c and lib/trainer.c, the checkpoint format in
 * lib/checkpoint.c. */
#include "checkpoint.h"
#include "cli.h"
#include "common.h"
#include "drafter.h"
#include "model_config.h"
#include "ops.h"
#include "outfile.h"
#include "rng.h"
#include "trainer.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PROG "dflash-train-step"

/* Options that change the math start at a "not given" value, so that
 * --resume can tell a given value (which must match the checkpoint's) from
 * one to take from the checkpoint. The help shows the real defaults. */
static const char *target_dir, *init_cfg, *init_from, *resume, *out_dir, *log_path, *device = "cpu";
static const char *loss = NULL, *labels = NULL, *loss_norm = NULL, *read_ahead = "on";
#define UNSET INT64_MIN /* an integer option not given (a given negative value is refused, not ignored) */
static int64_t steps = -1, anchors = UNSET, total_steps = UNSET, batch_seqs = UNSET, batch_tokens = UNSET,
               micro_rows = UNSET;
static int64_t seed = 0, threads = 0;
static double gamma_ = NAN, noise_std = NAN, lr = NAN, warmup_ratio = NAN, weight_decay = NAN, max_grad_norm = NAN;
static int loop, progress;

static const dfl_opt opts[] = {
    {"target", 0, DFL_OPT_STR, &target_dir, "DIR",
     "The target model directory (config.json, model.safetensors or an index): its frozen embed_tokens, lm_head "
     "(embed_tokens when tied) and final norm are the drafter's. Required.", NULL},
    {"init", 0, DFL_OPT_STR, &init_cfg, "CONFIG.json",
     "Start a new drafter from this config (z-lab layout: a Qwen3 config with block_size, num_target_layers and "
     "dflash_config {mask_token_id, target_layer_ids}); weights drawn from the --seed RNG (normal with std "
     "initializer_range, default 0.02; norms 1).", NULL},
    {"init-from", 0, DFL_OPT_STR, &init_from, "CKPT",
     "Start from the weights of a checkpoint directory in the released layout (ours or a released z-lab drafter); "
     "the optimizer, schedule and step count start fresh.", NULL},
    {"resume", 0, DFL_OPT_STR, &resume, "CKPT",
     "Continue a checkpoint written by this tool: weights, AdamW moments, step, schedule, RNG and input position. "
     "Options that change the math must be left out or equal the checkpoint's.", NULL},
    {"steps", 'n', DFL_OPT_INT, &steps, "N", "Optimizer steps to make in this run, at most 2^53. Required.", "none"},
    {"out", 'o', DFL_OPT_STR, &out_dir, "CKPT",
     "Write the checkpoint directory here (under a temporary name, renamed when complete). An existing CKPT is "
     "replaced only if it is a checkpoint directory; anything else, or an empty CKPT, is refused before training. "
     "Required.", NULL},
    {"anchors", 0, DFL_OPT_INT, &anchors, "N", "Blocks per sequence: up to N anchors drawn anew each time a sequence "
     "is used.", "512"},
    {"gamma", 0, DFL_OPT_DOUBLE, &gamma_, "G",
     "Loss decay over block positions: w_k = exp(-(k-1)/G).", "7 for B >= 16, 5 for B >= 10, else 4"},
    {"loss", 0, DFL_OPT_CHOICE, &loss, "ce|kl",
     "ce: cross-entropy against the labels; kl: KL divergence from the target's next-token distribution, made from "
     "the stream's last_hidden through the target's final norm and LM head (position a+k-1 for slot k).", "ce"},
    {"labels", 0, DFL_OPT_CHOICE, &labels, "data|target",
     "CE labels: the data tokens, or the stream's target_ids (the target's greedy tokens).", "data"},
    {"loss-norm", 0, DFL_OPT_CHOICE, &loss_norm, "weighted|count",
     "Divide the step's summed weighted loss by the sum of the weights of its supervised slots, or by their count.",
     "weighted"},
    {"noise-std", 0, DFL_OPT_DOUBLE, &noise_std, "S",
     "Add Gaussian noise N(0, S^2) to the drafter's context features (the tapped target hidden states, before fc), "
     "from the --seed RNG; labels, block tokens and the KL target are never perturbed.", "0"},
    {"lr", 0, DFL_OPT_DOUBLE, &lr, "LR", "Peak learning rate.", "0.0006"},
    {"warmup-ratio", 0, DFL_OPT_DOUBLE, &warmup_ratio, "R",
     "Linear warm-up over floor(R * total steps) steps, then cosine decay to 0.", "0.04"},
    {"total-steps", 0, DFL_OPT_INT, &total_steps, "N",
     "Length of the learning-rate schedule over the whole training (all runs): give the first run the total, as "
     "--resume keeps it; a --resume with every step past it (at learning rate 0) is refused. A --steps 0 run "
     "without it leaves the schedule unset (recorded as 0), for the first run that makes steps to set. At most 2^53.",
     "--steps of the first run that makes steps"},
    {"weight-decay", 0, DFL_OPT_DOUBLE, &weight_decay, "W", "AdamW decoupled weight decay.", "0"},
    {"max-grad-norm", 0, DFL_OPT_DOUBLE, &max_grad_norm, "X",
     "Clip the global gradient norm: scale by min(1, X / (norm + 1e-6)); 0 disables.", "1"},
    {"batch-seqs", 0, DFL_OPT_INT, &batch_seqs, "N", "Sequences per optimizer step (0: no limit). SpecForge's Qwen3-8B recipe takes 32: 4 per GPU on 8 GPUs, one loss normaliser over all.", "4"},
    {"batch-tokens", 0, DFL_OPT_INT, &batch_tokens, "N",
     "Tokens per optimizer step: a step stops taking sequences once it holds N tokens (0: no limit).", "0"},
    {"micro-rows", 0, DFL_OPT_INT, &micro_rows, "N",
     "Rows (context + block) per micro-batch; gradients accumulate over the micro-batches of a step.", "16384"},
    {"loop", 0, DFL_OPT_FLAG, &loop, NULL, "Re-read the input file from its start when it ends (epochs). It must be "
     "a regular file: standard input, a FIFO or a pipe cannot be read again and is refused before the first step.",
     NULL},
    {"read-ahead", 0, DFL_OPT_CHOICE, &read_ahead, "on|off",
     "From a regular file, read and decode the next record on a thread while a step runs (standard input or a "
     "FIFO is read as records are needed). The same steps either way; off saves the memory of two records.", "on"},
    {"log", 0, DFL_OPT_STR, &log_path, "FILE", "Append the per-step JSON lines to FILE instead of stderr.", NULL},
    {"device", 0, DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N.", NULL},
    {"seed", 0, DFL_OPT_INT, &seed, "N", "Seed of the RNG (initial weights, anchors, noise); on --resume the "
     "checkpoint's RNG state continues instead.", NULL},
    {"threads", 0, DFL_OPT_INT, &threads, "N",
     "CPU threads, for the ops and for decoding each record's large tensors (0: OpenMP's default; at most 4096).",
     NULL},
    {"progress", 0, DFL_OPT_FLAG, &progress, NULL, "Show progress on stderr even when it is not a terminal.", NULL},
    {NULL, 0, 0, NULL, NULL, NULL, NULL},
};

static const dfl_cli cli = {
    PROG,
    "advance a DFlash drafter checkpoint by N optimizer steps",
    "--target DIR --init CONFIG.json --steps N --out CKPT [OPTIONS] [STREAM]\n"
    "--target DIR --init-from CKPT --steps N --out CKPT [OPTIONS] [STREAM]\n"
    "--target DIR --resume CKPT --steps N --out CKPT [OPTIONS] [STREAM]",
    opts,
};

/* ---- options against a checkpoint's ------------------------------------------------- */

static char state_path[4200]; /* CKPT/trainer_state.json on --resume */

/* A stored value the run cannot use: the checkpoint is bad input (65), and
 * the message names its file and field, not an option the user never gave. */
static DFL_NORETURN void bad_state(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void bad_state(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: %s: ", PROG, state_path);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(DFL_EX_DATA);
}

/* The options that change the math, stored in trainer_state.json as
 * options.KEY: on --resume each takes the checkpoint's value, and one given
 * too must equal it. */
static const struct {
    const char *key, *opt; /* options.KEY, --OPT */
    char type;             /* 'i' int64_t, 'd' double, 's' a choice (const char *) */
    void *v;
} math[] = {
    {"anchors", "anchors", 'i', &anchors},
    {"gamma", "gamma", 'd', &gamma_},
    {"loss", "loss", 's', &loss},
    {"labels", "labels", 's', &labels},
    {"loss_norm", "loss-norm", 's', &loss_norm},
    {"noise_std", "noise-std", 'd', &noise_std},
    {"lr", "lr", 'd', &lr},
    {"warmup_ratio", "warmup-ratio", 'd', &warmup_ratio},
    {"weight_decay", "weight-decay", 'd', &weight_decay},
    {"max_grad_norm", "max-grad-norm", 'd', &max_grad_norm},
    {"total_steps", "total-steps", 'i', &total_steps},
    {"batch_seqs", "batch-seqs", 'i', &batch_seqs},
    {"batch_tokens", "batch-tokens", 'i', &batch_tokens},
    {"micro_rows", "micro-rows", 'i', &micro_rows},
};
#define NMATH (sizeof math / sizeof math[0])
typedef char value_text[64];

/* A double in the fewest digits (15 or 17) that read back as the same
 * value: equal texts are equal values, and 0.3 is not shown as
 * 0.29999999999999999. */
static void real_text(double x, value_text t) {
    snprintf(t, sizeof(value_text), "%.15g", x);
    if (strtod(t, NULL) != x) snprintf(t, sizeof(value_text), "%.17g", x);
}

/* math[k]'s value as text ("" when not given). */
static void math_text(size_t k, value_text t) {
    t[0] = 0;
    if (math[k].type == 'i' && *(int64_t *)math[k].v != UNSET) {
        snprintf(t, sizeof(value_text), "%lld", (long long)*(int64_t *)math[k].v);
    } else if (math[k].type == 'd' && !isnan(*(double *)math[k].v)) {
        real_text(*(double *)math[k].v, t);
    } else if (math[k].type == 's' && *(const char **)math[k].v) {
        snprintf(t, sizeof(value_text), "%s", *(const char **)math[k].v);
    }
}

/* options.KEY of the state into math[k], of the right JSON type; a choice
 * is held to the option's words, as on the command line (the code tests
 * only for the non-default words, "kl", "target" and "count", so any other
 * string, a hand edit or a later version's new loss, would quietly train
 * with the default). */
static void take_stored(const json_t *o, size_t k) {
    const char *key = math[k].key;
    const json_t *s = json_object_get(o, key);
    if (!s) bad_state("options.%s is missing", key);
    if (math[k].type == 'i') {
        if (!json_is_integer(s)) bad_state("options.%s is not an integer", key);
        *(int64_t *)math[k].v = json_integer_value(s);
    } else if (math[k].type == 'd') {
        if (!json_is_number(s)) bad_state("options.%s is not a number", key);
        *(double *)math[k].v = json_number_value(s);
    } else {
        const char *str = json_string_value(s), *words = dfl_cli_choices(&cli, math[k].opt);
        if (!str) bad_state("options.%s is not a string", key);
        if (!dfl_cli_choice_ok(words, str)) bad_state("options.%s is \"%s\", not one of %s", key, str, words);
        *(const char **)math[k].v = str;
    }
}

/* AdamW's constants: stored in options as the rest are, but no option
 * gives them (a first run takes dfl_train_opts_default's). On --resume they
 * are the checkpoint's too, checked as the others (their type here, their
 * range in check_adam): a hand edit, or another version's values, must not
 * go on silently with the defaults. */
static double beta1 = NAN, beta2 = NAN, adam_eps = NAN;
static const struct {
    const char *key;
    double *v;
} adam[] = {{"beta1", &beta1}, {"beta2", &beta2}, {"adam_eps", &adam_eps}};
#define NADAM (sizeof adam / sizeof adam[0])

/* On --resume: the stored options replace the given ones, kept in `given`
 * for check_given() once the stored values have passed check_ranges() (a
 * bad stored value is the file's fault, whatever was given). */
static void options_from_state(const json_t *o, value_text given[NMATH]) {
    if (!json_is_object(o)) bad_state("\"options\" is missing or not an object");
    for (size_t k = 0; k < NMATH; k++) {
        math_text(k, given[k]);
        take_stored(o, k);
    }
    for (size_t k = 0; k < NADAM; k++) {
        const json_t *s = json_object_get(o, adam[k].key);
        if (!s) bad_state("options.%s is missing", adam[k].key);
        if (!json_is_number(s)) bad_state("options.%s is not a number", adam[k].key);
        *adam[k].v = json_number_value(s);
    }
}

static void check_given(value_text given[NMATH]) {
    for (size_t k = 0; k < NMATH; k++) {
        value_text stored;
        math_text(k, stored);
        if (given[k][0] && strcmp(given[k], stored))
            dfl_die(PROG, DFL_EX_USAGE, "--%s %s differs from the checkpoint's %s (options that change the math must "
                    "match on --resume; leave it out to keep the checkpoint's)", math[k].opt, given[k], stored);
    }
}

/* The schedule's length for a run whose schedule is not set yet (a first
 * run, or a --resume of a --steps 0 baseline, stored as 0): the --total-steps
 * given, else this run's --steps. A run of 0 steps without one leaves it
 * unset, 0: taking 0 steps as the length (it used to become 1, kept by every
 * --resume) would run all of a later --resume's steps but one at rate 0. */
static int64_t schedule_length(int64_t given) {
    if (given != UNSET) return given;
    return steps > 0 ? steps : 0;
}

static void options_default(int B) {
    dfl_train_opts d;
    dfl_train_opts_default(&d, B);
    if (anchors == UNSET) anchors = d.anchors;
    if (isnan(gamma_)) gamma_ = d.gamma;
    if (!loss) loss = "ce";
    if (!labels) labels = "data";
    if (!loss_norm) loss_norm = "weighted";
    if (isnan(noise_std)) noise_std = 0;
    if (isnan(lr)) lr = d.lr;
    if (isnan(warmup_ratio)) warmup_ratio = d.warmup_ratio;
    if (isnan(weight_decay)) weight_decay = d.weight_decay;
    if (isnan(max_grad_norm)) max_grad_norm = d.max_grad_norm;
    total_steps = schedule_length(total_steps);
    if (batch_seqs == UNSET) batch_seqs = 4;
    if (batch_tokens == UNSET) batch_tokens = 0;
    if (micro_rows == UNSET) micro_rows = d.micro_rows;
    beta1 = d.beta1;
    beta2 = d.beta2;
    adam_eps = d.adam_eps;
}

/* A value that breaks `rule` ("must be at least 1"). On --resume every
 * value is the checkpoint's, so the error is in its trainer_state.json (65),
 * not on a command line that may not hold the option at all. */
static void out_of_range(int ok, const char *opt, const char *rule) {
    if (ok) return;
    for (size_t k = 0; k < NMATH; k++) {
        if (strcmp(math[k].opt, opt)) continue;
        value_text t;
        math_text(k, t);
        if (resume) bad_state("options.%s is %s, %s", math[k].key, t, rule);
        dfl_cli_usage_error(&cli, "--%s %s", opt, rule);
    }
    DFL_ASSERT(!"no such option");
}

/* AdamW computes in f32: 1 - beta^t must stay above 0 there, and eps be a
 * positive f32. Out of range they are the checkpoint's (no option gives
 * them; a first run's defaults pass). */
static void check_adam(void) {
    const int ok[NADAM] = {beta1 >= 0 && (float)beta1 < 1, beta2 >= 0 && (float)beta2 < 1,
                           (float)adam_eps > 0 && isfinite((float)adam_eps)};
    for (size_t k = 0; k < NADAM; k++) {
        if (ok[k]) continue;
        value_text t;
        real_text(*adam[k].v, t);
        bad_state("options.%s is %s, %s", adam[k].key, t, k < 2 ? "must be in [0, 1)" : "must be a positive float");
    }
}

static void check_ranges(void) {
    out_of_range(anchors >= 1, "anchors", "must be at least 1");
    out_of_range(gamma_ > 0, "gamma", "must be positive");
    out_of_range(noise_std >= 0, "noise-std", "must be >= 0");
    out_of_range(lr >= 0, "lr", "must be >= 0");
    out_of_range(warmup_ratio >= 0 && warmup_ratio <= 1, "warmup-ratio", "must be in [0, 1]");
    out_of_range(weight_decay >= 0, "weight-decay", "must be >= 0");
    out_of_range(max_grad_norm >= 0, "max-grad-norm", "must be >= 0");
    /* 0 only from a --steps 0 run without --total-steps (a given 0 is refused in main) */
    out_of_range(total_steps >= 0 && total_steps <= DFL_TRAIN_MAX_STEPS, "total-steps",
                 "must be in [1, 2^53] (or 0, not set yet)");
    out_of_range(micro_rows >= 1, "micro-rows", "must be at least 1");
    out_of_range(batch_seqs >= 0, "batch-seqs", "must be >= 0");
    out_of_range(batch_tokens >= 0, "batch-tokens", "must be >= 0");
    check_adam();
    if (batch_seqs == 0 && batch_tokens == 0) {
        if (resume) bad_state("options.batch_seqs and options.batch_tokens are both 0: a step needs a limit");
        dfl_cli_usage_error(&cli, "--batch-seqs 0 needs a --batch-tokens limit");
    }
    if (!strcmp(loss, "kl") && !strcmp(labels, "target")) {
        if (resume) bad_state("options.labels is \"target\" with options.loss \"kl\" (labels apply to ce only)");
        dfl_cli_usage_error(&cli, "--labels applies to --loss ce only");
    }
}

/* Steps past the schedule run at learning rate 0: the weights come out as
 * they went in, after the compute of every step. The usual way there is a
 * --resume of a first run that gave no --total-steps (it defaults to that
 * run's --steps) and, being part of the math, the schedule cannot change on
 * --resume. So a resumed run with every step past it is refused before the
 * target is loaded, saying how to go on; a run partly past it gets a note. */
static void check_schedule(int64_t at) {
    if (steps <= 0) return;
    if (resume && at >= total_steps)
        dfl_die(PROG, DFL_EX_USAGE, "--resume %s: the checkpoint is at step %lld, the end of its learning-rate schedule "
                "(--total-steps %lld, fixed by its first run, whose --steps is the default), so every step would run at "
                "learning rate 0 and leave the weights as they are. To train on, start a new schedule from its weights "
                "with --init-from %s; give the first run of a training the --total-steps of all its runs", resume,
                (long long)at, (long long)total_steps, resume);
    if (at + steps > total_steps)
        fprintf(stderr, "%s: note: steps %lld..%lld are past --total-steps %lld, where the learning rate is 0 and the "
                "weights do not change (give the first run of a training the --total-steps of all its runs)\n", PROG,
                (long long)total_steps + 1, (long long)(at + steps), (long long)total_steps);
}

/* input.KEY of the state, a count in [0, 2^53]: --loop adds 1 to the
 * epoch at the end of each pass, which must not overflow. */
static int64_t stored_count(const json_t *in, const char *key) {
    const json_t *v = json_object_get(in, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > DFL_TRAIN_MAX_STEPS)
        bad_state("input.%s is not a count in [0, 2^53]", key);
    return json_integer_value(v);
}

/* The log writes a loss that is not finite as null and the run goes on, as
 * asked; the first such step is also said on stderr, which a --log file
 * would not show. */
static void warn_not_finite(const dfl_step_log *lg) {
    static int warned;
    if (isfinite(lg->loss) || warned) return;
    warned = 1;
    fprintf(stderr, "%s: warning: the loss is %s at step %lld (logged as null); the training has diverged, "
            "perhaps from too high a --lr\n", PROG, isnan(lg->loss) ? "NaN" : "infinite", (long long)lg->step);
}

static double next_normal(void *r) { return dfl_rng_normal((dfl_rng *)r); }

/* --log must not be (or append to) what the run reads, nor lie in the
 * --out directory, which the checkpoint replaces at the end. */
static void check_log_path(const char *input) {
    if (dfl_out_check_input("--log", log_path, "input", input, DFL_IN_FILE) ||
        dfl_out_check_input("--log", log_path, "--init", init_cfg, DFL_IN_FILE) ||
        dfl_out_check_input("--log", log_path, "--target", target_dir, DFL_IN_MODEL_DIR) ||
        dfl_out_check_input("--log", log_path, "--init-from", init_from, DFL_IN_MODEL_DIR) ||
        dfl_out_check_input("--log", log_path, "--resume", resume, DFL_IN_MODEL_DIR) ||
        dfl_out_check_input("--log", log_path, "--out", out_dir, DFL_IN_OUT_DIR))
        dfl_cli_usage_error(&cli, "%s", dfl_errmsg());
}

static FILE *open_log(void) {
    if (!log_path) return stderr;
    FILE *f = fopen(log_path, "a");
    if (!f) dfl_die(PROG, DFL_EX_CANTCREAT, "%s: cannot open the log: %s", log_path, strerror(errno));
    return f;
}

int main(int argc, char **argv) {
    char **pos;
    int npos = dfl_cli_parse(&cli, argc, argv, &pos);
    if (npos > 1) dfl_cli_usage_error(&cli, "one input stream at most (got %d)", npos);
    const char *input = npos ? pos[0] : "-";
    if (!target_dir) dfl_cli_usage_error(&cli, "--target DIR is required");
    if (!out_dir) dfl_cli_usage_error(&cli, "--out CKPT is required");
    /* an empty --out (an unset shell variable) used to train every step,
     * then fail at the rename */
    if (dfl_out_check_name("--out", out_dir) || dfl_out_check_name("--log", log_path)) dfl_die_last(PROG);
    if (dfl_in_check_name("--target", target_dir) || dfl_in_check_name("--init", init_cfg) ||
        dfl_in_check_name("--init-from", init_from) || dfl_in_check_name("--resume", resume) ||
        dfl_in_check_name("input", input))
        dfl_die_last(PROG);
    check_log_path(input);
    if (steps < 0) dfl_cli_usage_error(&cli, "--steps N is required (N >= 0)");
    /* bounded, as the step counts of a checkpoint: the step a run ends at,
     * its own plus --steps, must not overflow */
    if (steps > DFL_TRAIN_MAX_STEPS) dfl_cli_usage_error(&cli, "--steps must be in [0, 2^53]");
    if (!!init_cfg + !!init_from + !!resume != 1)
        dfl_cli_usage_error(&cli, "give exactly one of --init, --init-from and --resume");
    /* as dflash-extract and dflash-score: 100000 overflowed libgomp's stack,
     * 2^32 + 1 became 1 in the (int) of the codec's count */
    if (threads < 0 || threads > DFL_MAX_THREADS)
        dfl_cli_usage_error(&cli, "--threads must be in [0, %d]", DFL_MAX_THREADS);
    /* here, not in check_ranges: there 0 is a stored unset schedule, given it is no schedule */
    if (total_steps != UNSET && (total_steps < 1 || total_steps > DFL_TRAIN_MAX_STEPS))
        dfl_cli_usage_error(&cli, "--total-steps must be in [1, 2^53]");
    /* as dflash-pack and dflash-score: -1 would silently mean 2^64-1 */
    if (seed < 0) dfl_cli_usage_error(&cli, "--seed must be >= 0");
    dfl_ops_cpu_threads(threads);
    dfs_set_codec_threads((int)threads); /* the records' decoding too */
    if (!strcmp(input, "-") && (steps > 0 || resume) && isatty(STDIN_FILENO))
        dfl_cli_usage_error(&cli, "refusing to read a binary stream from a terminal; give a STREAM or redirect stdin");
    /* before the models are loaded: a --loop that cannot re-read its input
     * would fail (or block) only at the end of the first pass */
    if ((steps > 0 || resume) && dfl_trainer_check_loop(input, loop)) dfl_die_last(PROG);
    if (dfl_ckpt_check_out(out_dir)) dfl_die_last(PROG);

    const dfl_ops *ops;
    if (dfl_ops_get(device, &ops)) dfl_die_last(PROG);
    dfl_set_oom_hint(PROG, "while loading the drafter and the target's embedding and LM head");

    /* the target */
    dfl_model_config tcfg;
    if (dfl_model_config_load_dir(&tcfg, target_dir, "target")) dfl_die_last(PROG);

    /* the drafter */
    dfl_drafter_config dcfg;
    int rc = init_cfg ? dfl_drafter_config_load(&dcfg, init_cfg) : dfl_ckpt_load_config(init_from ? init_from : resume, &dcfg);
    if (rc) dfl_die_last(PROG);
    /* A drafter for another target, or a checkpoint whose tensors do not
     * fit its config, is refused from the headers, before the model, its
     * gradients and AdamW moments are allocated. */
    if (dfl_drafter_check_target(&dcfg, &tcfg, target_dir) || (init_from && dfl_ckpt_check_weights(init_from, &dcfg)) ||
        (resume && dfl_ckpt_check_state(resume, &dcfg)))
        dfl_die_last(PROG);
    dfl_drafter_config_from_target(&dcfg, &tcfg);
    json_t *state = NULL;
    dfl_drafter *d = dfl_drafter_new(ops, &dcfg);
    value_text given[NMATH];
    const int64_t given_total = total_steps; /* options_from_state replaces it */
    if (resume) {
        snprintf(state_path, sizeof state_path, "%s/trainer_state.json", resume);
        if (dfl_ckpt_load_state(resume, d, &state)) dfl_die_last(PROG);
        options_from_state(json_object_get(state, "options"), given);
        /* a baseline's unset schedule is set by this run as by a first run;
         * the given --total-steps then equals it, and check_given passes */
        if (total_steps == 0) total_steps = schedule_length(given_total);
    } else {
        options_default(dcfg.block_size);
    }
    check_ranges();
    if (resume) check_given(given);
    dfl_train_opts o;
    dfl_train_opts_default(&o, dcfg.block_size);
    o.anchors = anchors;
    o.gamma = gamma_;
    o.kl = !strcmp(loss, "kl");
    o.labels_target = !strcmp(labels, "target");
    o.norm_count = !strcmp(loss_norm, "count");
    o.noise_std = noise_std;
    o.lr = lr;
    o.warmup_ratio = warmup_ratio;
    o.weight_decay = weight_decay;
    o.max_grad_norm = max_grad_norm;
    o.beta1 = beta1;
    o.beta2 = beta2;
    o.adam_eps = adam_eps;
    o.total_steps = total_steps;
    o.micro_rows = micro_rows;

    dfl_trainer t;
    dfl_trainer_init(&t, d, &tcfg, &o, batch_seqs, batch_tokens, loop, (uint64_t)seed);
    int64_t skip = 0, epoch = 0;
    if (resume) {
        if (dfl_trainer_restore(&t, state, state_path)) dfl_die_last(PROG);
        const json_t *in = json_object_get(state, "input");
        const char *was = json_string_value(json_object_get(in, "path"));
        char *rp = strcmp(input, "-") ? realpath(input, NULL) : NULL;
        if (rp && was && !strcmp(rp, was)) {
            skip = stored_count(in, "records");
            epoch = stored_count(in, "epoch");
        } else if (strcmp(input, "-")) {
            fprintf(stderr, "%s: note: %s is not the checkpoint's input (%s); reading it from its start\n", PROG, input,
                    was ? was : "?");
        }
        free(rp);
    } else if (init_cfg) {
        const json_t *ir = json_object_get(dcfg.mc.json, "initializer_range");
        dfl_drafter_init_weights(d, json_is_number(ir) ? json_number_value(ir) : 0.02, next_normal, &t.rng);
    } else if (dfl_ckpt_load_weights(init_from, d)) {
        dfl_die_last(PROG);
    }
    check_schedule(t.step);
    if (dfl_drafter_load_target(d, target_dir, &tcfg)) dfl_die_last(PROG);
    /* --steps 0 from --init or --init-from writes the starting checkpoint (an
     * untrained drafter to score, a released one brought into our layout):
     * nothing is trained, so no input is read. */
    if ((steps > 0 || resume) && dfl_trainer_open(&t, input, skip, epoch)) dfl_die_last(PROG);
    dfl_set_oom_hint(PROG, "a micro-batch's buffers grow with --micro-rows (now %lld)", (long long)micro_rows);
    if (!strcmp(read_ahead, "off")) dfl_trainer_read_ahead(&t, 0);

    FILE *logf = open_log();
    dfl_progress pg;
    dfl_progress_init(&pg, progress, (double)steps, "step");
    int64_t made_steps = 0;
    for (; made_steps < steps; made_steps++) {
        dfl_step_log lg;
        int made;
        if (dfl_trainer_step(&t, &lg, &made)) dfl_die_last(PROG);
        if (!made) break;
        warn_not_finite(&lg);
        json_t *line = dfl_step_log_json(&t, &lg);
        char *s = json_dumps(line, JSON_COMPACT | JSON_REAL_PRECISION(8));
        DFL_ASSERT(s); /* never "(null)" in the log */
        fprintf(logf, "%s\n", s);
        free(s);
        json_decref(line);
        /* a --log that cannot be written (full disk) stops the run: training
         * on without the log the user asked for would go unnoticed */
        if ((fflush(logf) != 0 || ferror(logf)) && logf != stderr)
            dfl_die(PROG, DFL_EX_IOERR, "%s: write failed: %s", log_path, strerror(errno));
        char extra[96];
        snprintf(extra, sizeof extra, "loss %.4f tau %.3f", lg.loss, lg.tau);
        dfl_progress_update(&pg, (double)(made_steps + 1), extra);
    }
    dfl_progress_end(&pg, (double)made_steps, NULL);
    if (logf != stderr && fclose(logf) != 0) dfl_die(PROG, DFL_EX_IOERR, "%s: write error", log_path);

    json_t *st = dfl_trainer_state_json(&t);
    if (dfl_ckpt_save(out_dir, d, st)) dfl_die_last(PROG);
    json_decref(st);
    if (made_steps < steps)
        fprintf(stderr, "%s: the input ended after %lld of %lld steps (step %lld in all); checkpoint written to %s\n", PROG,
                (long long)made_steps, (long long)steps, (long long)t.step, out_dir);
    json_decref(state);
    dfl_trainer_free(&t);
    dfl_drafter_free(d);
    dfl_drafter_config_free(&dcfg);
    dfl_model_config_free(&tcfg);
    free(pos);
    return dfl_close_stdout() ? (dfl_die_last(PROG), 1) : 0;
}
