/* dflash-extract: run a target model over tokenized samples and write the
 * hidden states of chosen layers as a DFS stream. */
#include "cli.h"
#include "common.h"
#include "dfs.h"
#include "extract.h"
#include "jsonl.h"
#include "ops.h"
#include "outfile.h"
#include "target.h"

#include <stdlib.h>
#include <string.h>

static const char *model_dir = NULL, *out_path = "-", *layers = NULL, *drafter_cfg = NULL, *device = "cpu";
static dfl_strlist with = {0, NULL};
static int64_t batch_tokens = 4096, threads = 0;
static const char *compress = NULL, *byte_shuffle = "off"; /* compress NULL: not given */
static int skip_bad = 0, progress = 0;

static const dfl_opt opts[] = {
    {"model", 'm', DFL_OPT_STR, &model_dir, "DIR",
     "Target model directory (Hugging Face layout: config.json and model.safetensors or a sharded index). Required.", NULL},
    {"output", 'o', DFL_OPT_STR, &out_path, "OUT",
     "Output stream; - is stdout (refused when it is a terminal). A file is written under a temporary name and renamed.", NULL},
    {"layers", 'l', DFL_OPT_STR, &layers, "IDS",
     "Comma-separated layer ids to tap, in output order. Id k is the output of decoder layer k, 0-based "
     "(Hugging Face hidden_states[k+1]; for the last layer, before the final norm).",
     "the reference rule for 5 draft layers, e.g. 1,9,17,25,33 for 36 layers"},
    {"drafter-config", 0, DFL_OPT_STR, &drafter_cfg, "FILE",
     "Take the layer ids from a drafter's config.json (dflash_config.target_layer_ids); its num_target_layers, "
     "hidden_size and vocab_size, where given, must be the target's.", NULL},
    {"with", 'w', DFL_OPT_LIST, &with, "WHAT",
     "Also write per sample: target-ids (the target's greedy next token at every position, i32 [T]) or last-hidden "
     "(output of the last layer before the final norm, bf16 [T, H]).", NULL},
    {"batch-tokens", 'b', DFL_OPT_INT, &batch_tokens, "N",
     "Pack consecutive samples into forward passes of at most N tokens (a longer sample runs alone). On a GPU the "
     "next pass runs while the records of the one before are encoded and written; the host holds two passes' "
     "records, so memory grows with N.", NULL},
    {"threads", 't', DFL_OPT_INT, &threads, "N", "CPU threads: the target's load and forward on the CPU, and the records' encoding (byte shuffle, LZ4, checksums), one sample a thread, written in order (the encoded bytes do not depend on N). At most 4096.", "all cores"},
    {"device", 'd', DFL_OPT_STR, &device, "DEV", "cpu, cuda or cuda:N.", NULL},
    {"compress", 0, DFL_OPT_CHOICE, &compress, "none|lz4", "Codec of the output's tensors (as dflash-pack --compress, but lz4 alone does not byte-shuffle here: add --byte-shuffle on).",
     "none"},
    {"byte-shuffle", 0, DFL_OPT_CHOICE, &byte_shuffle, "on|off",
     "Byte-shuffle tensors before LZ4 (what makes bf16 compressible). on implies --compress lz4 when --compress is "
     "not given; with --compress none it is refused, as by dflash-pack.", NULL},
    {"skip-bad", 0, DFL_OPT_FLAG, &skip_bad, NULL,
     "Skip bad samples instead of stopping at the first: the first 10 reported on stderr, all counted in the closing "
     "summary.", NULL},
    {"progress", 'p', DFL_OPT_FLAG, &progress, NULL, "Show progress on stderr even when it is not a terminal.", NULL},
    {NULL, 0, 0, NULL, NULL, NULL, NULL},
};

static const dfl_cli cli = {
    "dflash-extract",
    "run a target model over tokenized samples and write hidden states as a DFS stream",
    "--model DIR [OPTIONS] [INPUT.jsonl|-] [-o OUT.dfs]",
    opts,
};

int main(int argc, char **argv) {
    char **pos;
    int npos = dfl_cli_parse(&cli, argc, argv, &pos);
    const char *in_path = npos ? pos[0] : "-";
    if (npos > 1) dfl_cli_usage_error(&cli, "one input at most (got '%s' and '%s')", pos[0], pos[1]);
    free(pos);
    if (!model_dir) dfl_cli_usage_error(&cli, "--model DIR is required");
    if (layers && drafter_cfg) dfl_cli_usage_error(&cli, "give --layers or --drafter-config, not both");
    if (dfl_out_check_name("-o", out_path)) dfl_die_last(cli.prog); /* before the model is loaded */
    if (dfl_in_check_name("--model", model_dir) || dfl_in_check_name("--drafter-config", drafter_cfg) ||
        dfl_in_check_name("input", in_path))
        dfl_die_last(cli.prog);
    /* -o INPUT would replace the samples with their hidden states, -o
     * MODEL/model.safetensors the target's weights */
    if (dfl_out_check_input("-o", out_path, "input", in_path, DFL_IN_FILE) ||
        dfl_out_check_input("-o", out_path, "--drafter-config", drafter_cfg, DFL_IN_FILE) ||
        dfl_out_check_input("-o", out_path, "--model", model_dir, DFL_IN_MODEL_DIR))
        dfl_cli_usage_error(&cli, "%s", dfl_errmsg());
    if (batch_tokens < 1 || batch_tokens > INT32_MAX) dfl_cli_usage_error(&cli, "--batch-tokens must be in [1, 2^31)");
    if (threads < 0 || threads > DFL_MAX_THREADS)
        dfl_cli_usage_error(&cli, "--threads must be in [0, %d]", DFL_MAX_THREADS);
    int want_ids = 0, want_last = 0;
    for (int i = 0; i < with.n; i++) {
        if (!strcmp(with.v[i], "target-ids")) want_ids = 1;
        else if (!strcmp(with.v[i], "last-hidden")) want_last = 1;
        else dfl_cli_usage_error(&cli, "--with: '%s' is not one of target-ids, last-hidden", with.v[i]);
    }
    free(with.v);
    /* "on implies lz4" is for --byte-shuffle on alone; against an explicit
     * --compress none it is a contradiction, refused as dflash-pack does */
    int shuffle = !strcmp(byte_shuffle, "on");
    if (shuffle && compress && !strcmp(compress, "none"))
        dfl_cli_usage_error(&cli, "--byte-shuffle on needs --compress lz4 (shuffling is part of the lz4 encoding)");
    if (dfs_check_source_date_epoch()) dfl_die_last(cli.prog);
    dfl_ops_cpu_threads(threads);

    const dfl_ops *ops;
    if (dfl_ops_get(device, &ops)) dfl_die_last(cli.prog);

    /* The tap list depends on the target's depth: read its config first. */
    dfl_model_config cfg;
    if (dfl_model_config_load_dir(&cfg, model_dir, "target")) dfl_die_last(cli.prog);
    int L = (int)cfg.num_hidden_layers, taps[DFL_EXTRACT_MAX_TAPS], ntaps = 0;
    int rc = dfl_extract_layer_ids(layers, drafter_cfg, L, taps, &ntaps);
    if (rc == DFL_EX_USAGE) dfl_cli_usage_error(&cli, "%s", dfl_errmsg());
    if (!rc && drafter_cfg) rc = dfl_extract_check_drafter(drafter_cfg, cfg.hidden_size, cfg.vocab_size);
    dfl_model_config_free(&cfg);
    if (rc) dfl_die_last(cli.prog);

    int deepest = 0;
    for (int i = 0; i < ntaps; i++) deepest = taps[i] + 1 > deepest ? taps[i] + 1 : deepest;
    dfl_target_opts topts = {want_ids || want_last ? 0 : deepest, want_ids};
    dfl_target *t;
    dfl_set_oom_hint(cli.prog, "while loading the target %s", model_dir);
    if (dfl_target_load(&t, model_dir, ops, &topts)) dfl_die_last(cli.prog);
    dfl_set_oom_hint(cli.prog, "a forward's buffers grow with --batch-tokens (now %lld)", (long long)batch_tokens);

    dfl_jsonl *in;
    if (dfl_jsonl_open(&in, in_path, dfl_target_config(t)->vocab_size)) dfl_die_last(cli.prog);
    dfl_out *out;
    if (dfl_out_open(&out, out_path, 1)) dfl_die_last(cli.prog);

    dfl_extract_opts eo = {ntaps, taps, want_ids, want_last, batch_tokens, skip_bad, progress, cli.prog};
    json_t *meta = dfl_extract_meta(t, &eo);
    char producer[64];
    snprintf(producer, sizeof producer, "dflash-extract %s", DFLASH_VERSION);
    dfs_encoding enc = {shuffle || (compress && !strcmp(compress, "lz4")) ? DFS_CODEC_LZ4 : DFS_CODEC_NONE, shuffle, 1};
    dfs_writer *w;
    /* a write error names the output as dflash-pack's do: "stdout", not "-" */
    const char *out_name = strcmp(out_path, "-") ? out_path : "stdout";
    if (dfs_writer_open(&w, dfl_out_file(out), out_name, meta, producer, enc)) {
        dfl_out_abort(out);
        dfl_die_last(cli.prog);
    }
    json_decref(meta);

    dfl_extract_stats st;
    rc = dfl_extract_run(t, in, w, &eo, &st);
    if (rc && !st.input_error) { /* output or internal failure: discard the output */
        fprintf(stderr, "%s: %s\n", cli.prog, dfl_errmsg());
        dfs_writer_abort(w);
        dfl_out_abort(out);
        exit(rc);
    }
    /* Input errors keep what was written: a complete stream up to the sample at fault. */
    char *msg = rc ? dfl_strdup(dfl_errmsg()) : NULL;
    int wrc = dfs_writer_close(w);
    if (!wrc) wrc = dfl_out_commit(out);
    else dfl_out_abort(out);
    if (wrc) dfl_die_last(cli.prog);
    if (msg) {
        fprintf(stderr, "%s: %s\n", cli.prog, msg);
        /* --skip-bad skips bad samples (65), not read errors (74) */
        fprintf(stderr, "%s: stopped; %lld samples before it were written%s\n", cli.prog, (long long)st.samples,
                rc == DFL_EX_DATA ? " (use --skip-bad to skip bad samples)" : "");
        free(msg);
    }
    if (st.skipped)
        fprintf(stderr, "%s: skipped %lld bad samples; wrote %lld samples, %lld tokens\n", cli.prog,
                (long long)st.skipped, (long long)st.samples, (long long)st.tokens);
    dfl_jsonl_close(in);
    dfl_target_free(t);
    int crc = dfl_close_stdout();
    if (rc) return rc;
    if (crc) dfl_die_last(cli.prog);
    return 0;
}
