/* dflash-pack: merge, shuffle, split, shard, inspect, verify and export DFS
 * streams (man dflash-pack). Options are parsed here; the work is in
 * lib/dfs_pack.c and lib/dfs_pack_view.c. */
#include "cli.h"
#include "common.h"
#include "dfs_pack.h"
#include "outfile.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *output = "-", *tmpdir = NULL, *split = NULL;
static const char *compress = "keep", *byte_shuffle = "keep", *export_dir = NULL;
static int shuffle, inspect, stats, verify, as_json, progress;
static int64_t seed = 0, shards = 0, accel = 1;
#define DEFAULT_MEM (1ull << 30)
static uint64_t mem = DEFAULT_MEM;

static const dfl_opt opts[] = {
    {"output", 'o', DFL_OPT_STR, &output, "FILE",
     "Write the merged stream to FILE ('-': stdout). With --split, a pattern holding one %s (the part's name); "
     "with --shards, a pattern holding one %d, e.g. %03d (the shard's number).", NULL},
    {"shuffle", 0, DFL_OPT_FLAG, &shuffle, NULL,
     "Shuffle the records of all inputs uniformly: each record draws a random 64-bit key from the --seed RNG and "
     "the output is sorted by key. The order depends only on the seed and the inputs (not on --mem).", NULL},
    {"seed", 0, DFL_OPT_INT, &seed, "N",
     "Seed of the --shuffle RNG, 0 to 2^63-1 (with --shuffle only, as --mem and --tmpdir).", "0"},
    {"mem", 0, DFL_OPT_SIZE, &mem, "SIZE",
     "Records held in memory while shuffling; beyond it they go to temporary bucket files in --tmpdir.", "1G"},
    {"tmpdir", 0, DFL_OPT_STR, &tmpdir, "DIR",
     "Directory for the shuffle's temporary files, removed afterwards; it must exist and be writable.",
     "$TMPDIR or /tmp"},
    {"split", 0, DFL_OPT_STR, &split, "NAME=F,...",
     "Split records by id into parts with these fractions (normalised to sum 1), e.g. train=0.99,val=0.01. "
     "A record goes to the part where (XXH64(id) >> 11) / 2^53 falls among the cumulative fractions, so the same id "
     "lands in the same part in every run and every shard.", NULL},
    {"shards", 0, DFL_OPT_INT, &shards, "N",
     "Deal the output records round-robin into N files (at most 4096): record i (in output order) goes to shard i "
     "mod N.", NULL},
    {"compress", 0, DFL_OPT_CHOICE, &compress, "keep|none|lz4",
     "Re-encode tensors with this codec; keep copies each tensor's stored bytes as they are.", NULL},
    {"byte-shuffle", 0, DFL_OPT_CHOICE, &byte_shuffle, "keep|on|off",
     "Byte-shuffle tensors before LZ4 (given alone it implies --compress lz4; with --compress lz4 the default is on).", NULL},
    {"accel", 0, DFL_OPT_INT, &accel, "N",
     "LZ4 acceleration when re-encoding (1 = lz4 -1; higher is faster, larger), 1 to 65537; only with an LZ4 "
     "re-encoding.", NULL},
    {"inspect", 0, DFL_OPT_FLAG, &inspect, NULL,
     "Print each input's stream header as one JSON line, then one JSON line per record (id, tokens, tensors with "
     "dtype, shape, codec, shuffle, raw and stored bytes).", NULL},
    {"stats", 0, DFL_OPT_FLAG, &stats, NULL,
     "Print totals over all inputs: files, segments, records, tokens, supervised tokens, raw and stored bytes, ratio, "
     "and the same per tensor name.", NULL},
    {"json", 0, DFL_OPT_FLAG, &as_json, NULL, "With --stats: one JSON object instead of aligned text.", NULL},
    {"verify", 0, DFL_OPT_FLAG, &verify, NULL,
     "Check every record: structure, checksums, LZ4 frames decoded, hidden-state shapes and token ids. Prints "
     "\"OK N records\", or the first problem and exits 65.", NULL},
    {"export", 0, DFL_OPT_STR, &export_dir, "DIR",
     "Write each record's tensors as DIR/INDEX-ID/NAME.npy (bf16 as float32, exactly), and the stream header as "
     "DIR/stream.json. DIR appears only when complete; an earlier export there is replaced whole, anything else "
     "in it is refused (exit 73).", NULL},
    {"progress", 0, DFL_OPT_FLAG, &progress, NULL,
     "Show progress (records read) on stderr even when it is not a terminal, in every mode.", NULL},
    {NULL, 0, 0, NULL, NULL, NULL, NULL},
};

static const dfl_cli cli = {
    "dflash-pack",
    "merge, shuffle, split, shard, inspect and verify DFS tensor streams",
    "[-o OUT] [--shuffle [--seed N]] [--compress C] [IN...]\n"
    "--split NAME=F,... -o 'PATTERN-%s.dfs' [--shuffle] [IN...]\n"
    "--shards N -o 'PATTERN-%03d.dfs' [--shuffle] [IN...]\n"
    "--inspect | --stats [--json] | --verify | --export DIR [IN...]",
    opts,
};

/* The encoding asked for by --compress and --byte-shuffle. */
static void encoding(dfs_pack_opts *o) {
    int c_keep = !strcmp(compress, "keep"), s_keep = !strcmp(byte_shuffle, "keep");
    o->reencode = !(c_keep && s_keep);
    if (!o->reencode) return;
    if (!strcmp(compress, "none") && !strcmp(byte_shuffle, "on"))
        dfl_cli_usage_error(&cli, "--byte-shuffle on needs --compress lz4 (shuffling is part of the lz4 encoding)");
    o->enc.codec = !strcmp(compress, "none") ? DFS_CODEC_NONE : DFS_CODEC_LZ4;
    o->enc.shuffle = o->enc.codec == DFS_CODEC_LZ4 && strcmp(byte_shuffle, "off") != 0;
    o->enc.lz4_accel = (int)accel;
}

/* --accel tunes LZ4 compression: with nothing to compress it would do
 * nothing (--compress keep copies the stored bytes; none stores raw). */
static void accel_used(const dfs_pack_opts *o, int modes) {
    if (accel != 1 && (modes || !o->reencode || o->enc.codec != DFS_CODEC_LZ4))
        dfl_cli_usage_error(&cli, "--accel goes with an LZ4 re-encoding (--compress lz4, or --byte-shuffle alone)");
}

int main(int argc, char **argv) {
    char **pos;
    int npos = dfl_cli_parse(&cli, argc, argv, &pos);
    static const char *stdin_only[] = {"-"};
    const char *const *inputs = npos ? (const char *const *)pos : stdin_only;
    int ninputs = npos ? npos : 1;
    for (int i = 0; i < ninputs; i++)
        if (!strcmp(inputs[i], "-") && isatty(STDIN_FILENO))
            dfl_cli_usage_error(&cli, "refusing to read a binary stream from a terminal; give a FILE or redirect stdin");
    int modes = inspect + stats + verify + (export_dir != NULL);
    if (modes > 1) dfl_cli_usage_error(&cli, "--inspect, --stats, --verify and --export exclude each other");
    if (as_json && !stats) dfl_cli_usage_error(&cli, "--json goes with --stats");
    if (modes && (strcmp(output, "-") || shuffle || split || shards || strcmp(compress, "keep") ||
                  strcmp(byte_shuffle, "keep")))
        dfl_cli_usage_error(&cli, "--inspect, --stats, --verify and --export write no stream: -o, --shuffle, --split, "
                                  "--shards, --compress and --byte-shuffle do not go with them");
    if (accel < 1 || accel > 65537) dfl_cli_usage_error(&cli, "--accel must be in 1..65537");
    /* Options that would change nothing are refused, as -o with --inspect
     * is: --seed 7 without --shuffle gave the inputs' order, silently. The
     * defaults' values stand for "not given" (giving them changes nothing). */
    if (!shuffle && (seed != 0 || mem != DEFAULT_MEM || tmpdir))
        dfl_cli_usage_error(&cli, "--seed, --mem and --tmpdir go with --shuffle (without it the order is the inputs')");
    /* as dflash-score: -1 would silently mean 2^64-1, which itself is
     * refused as out of range, so one value had two spellings, one refused */
    if (seed < 0) dfl_cli_usage_error(&cli, "--seed must be >= 0");
    /* "" (an unset shell variable) names no file: -o would fail at the rename
     * after the whole pass, --tmpdir '' would put the buckets in / */
    if (dfl_out_check_name("-o", output) || dfl_out_check_name("--export", export_dir) ||
        dfl_out_check_name("--tmpdir", tmpdir))
        dfl_die_last(cli.prog);
    for (int i = 0; i < ninputs; i++)
        if (dfl_in_check_name("input", inputs[i])) dfl_die_last(cli.prog);
    int rc;
    if (modes) {
        accel_used(NULL, modes);
        if (inspect) rc = dfs_pack_inspect(inputs, ninputs, progress, stdout);
        else if (stats) rc = dfs_pack_stats(inputs, ninputs, as_json, progress, stdout);
        else if (verify) rc = dfs_pack_verify(inputs, ninputs, progress, stdout);
        else rc = dfs_pack_export(inputs, ninputs, export_dir, progress);
    } else {
        dfs_pack_opts o;
        memset(&o, 0, sizeof o);
        o.inputs = inputs;
        o.ninputs = ninputs;
        o.output = output;
        o.shuffle = shuffle;
        o.seed = (uint64_t)seed;
        o.mem = mem;
        if (shuffle) {
            char m[32];
            dfl_set_oom_hint(cli.prog, "--mem (now %s) bounds the records the shuffle holds",
                             dfl_human_bytes(m, (double)mem));
        }
        o.tmpdir = tmpdir ? tmpdir : getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        o.progress = progress;
        o.producer = "dflash-pack " DFLASH_VERSION;
        if (split && shards) dfl_cli_usage_error(&cli, "--split and --shards exclude each other");
        if (shards < 0 || shards > DFS_PACK_MAX_SHARDS)
            dfl_cli_usage_error(&cli, "--shards must be in 0..%d (0: no shards)", DFS_PACK_MAX_SHARDS);
        o.shards = (int)shards;
        if (split && dfs_pack_parse_split(split, &o)) dfl_cli_usage_error(&cli, "%s", dfl_errmsg());
        if (split && dfs_pack_pattern_ok(output, 's'))
            dfl_cli_usage_error(&cli, "--split needs -o with exactly one %%s (and %%%% for a literal %%)");
        if (shards && dfs_pack_pattern_ok(output, 'd'))
            dfl_cli_usage_error(&cli, "--shards needs -o with exactly one %%d, e.g. 'train-%%03d.dfs' (a width of at "
                                      "most %d)", DFS_PACK_MAX_WIDTH);
        encoding(&o);
        accel_used(&o, 0);
        if (shuffle && dfs_pack_check_tmpdir(o.tmpdir)) dfl_die_last(cli.prog); /* not once --mem is full */
        if (dfs_check_source_date_epoch()) dfl_die_last(cli.prog); /* before any output exists */
        rc = dfs_pack_run(&o);
    }
    free(pos);
    if (rc) dfl_die_last(cli.prog);
    if (dfl_close_stdout()) dfl_die_last(cli.prog);
    return 0;
}
