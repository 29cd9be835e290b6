/* dfs_datagen: deterministic synthetic hidden-state streams for tests and
 * benchmarks (the lz4 `datagen` of dflash).
 *
 * Each sample has input_ids (uniform token ids), a loss_mask (the first 30%
 * of tokens unsupervised, "the prompt"), and hidden [T, K*H] bf16 shaped
 * like real activations (research/performance-anchors.md, section 5.4):
 * every channel of every tapped layer has a log-normal scale
 * exp(0.5 * N(0,1)), 4 channels per layer are outliers at 100x, and each
 * value is scale * N(0,1), rounded to bf16. Optional target_ids and
 * last_hidden [T, H]. The same options and seed give the same bytes.
 *
 *   dfs_datagen --records 8 --tokens 64 --hidden 32 --layers 3 -o s.dfs
 *   dfs_datagen --raw --records 32 --tokens 1024 --hidden 4096 -o h.bin
 */
#include "cli.h"
#include "common.h"
#include "dfs.h"
#include "outfile.h"
#include "rng.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static const char *output = "-", *compress = "lz4", *byte_shuffle = "on", *id_prefix = "s";
static int64_t records = 4, tokens = 64, tokens_max = 0, hidden = 64, layers = 2, num_layers = 8, vocab = 1000;
static int64_t seed = 1, first_index = 0;
static int target_ids, last_hidden, raw;

static const dfl_opt opts[] = {
    {"output", 'o', DFL_OPT_STR, &output, "FILE", "Output file ('-': stdout).", NULL},
    {"records", 'n', DFL_OPT_INT, &records, "N", "Number of samples.", NULL},
    {"tokens", 't', DFL_OPT_INT, &tokens, "T", "Tokens per sample (the minimum with --tokens-max).", NULL},
    {"tokens-max", 0, DFL_OPT_INT, &tokens_max, "T2", "If above --tokens: lengths uniform in [T, T2].", NULL},
    {"hidden", 'H', DFL_OPT_INT, &hidden, "H", "Hidden size of the target.", NULL},
    {"layers", 'K', DFL_OPT_INT, &layers, "K", "Tapped layers (hidden is [T, K*H]).", NULL},
    {"num-layers", 0, DFL_OPT_INT, &num_layers, "L", "Decoder layers of the (pretend) target.", NULL},
    {"vocab", 0, DFL_OPT_INT, &vocab, "V", "Vocabulary size.", NULL},
    {"seed", 's', DFL_OPT_INT, &seed, "S", "Seed of all data (the channel scales too).", NULL},
    {"id-prefix", 0, DFL_OPT_STR, &id_prefix, "P", "Sample ids are P-INDEX.", NULL},
    {"first-index", 0, DFL_OPT_INT, &first_index, "I", "INDEX of the first sample.", NULL},
    {"target-ids", 0, DFL_OPT_FLAG, &target_ids, NULL, "Add target_ids i32 [T].", NULL},
    {"last-hidden", 0, DFL_OPT_FLAG, &last_hidden, NULL, "Add last_hidden bf16 [T, H].", NULL},
    {"compress", 0, DFL_OPT_CHOICE, &compress, "none|lz4", "Codec of every tensor.", NULL},
    {"byte-shuffle", 0, DFL_OPT_CHOICE, &byte_shuffle, "on|off", "Byte shuffle before LZ4.", NULL},
    {"raw", 0, DFL_OPT_FLAG, &raw, NULL,
     "Write only the hidden tensors' raw bf16 bytes, back to back (for lz4/zstd benchmarks on the same bytes).", NULL},
    {NULL, 0, 0, NULL, NULL, NULL, NULL},
};

static const dfl_cli cli = {"dfs_datagen", "deterministic synthetic hidden-state DFS streams",
                            "[--records N] [--tokens T] [--hidden H] [--layers K] [--seed S] [-o FILE]", opts};

/* Per-channel scales of K layers of H channels: log-normal, 4 outliers each. */
static float *channel_scales(dfl_rng *r, int64_t K, int64_t H) {
    float *s = dfl_malloc((size_t)(K * H) * sizeof *s);
    for (int64_t i = 0; i < K * H; i++) s[i] = (float)exp(0.5 * dfl_rng_normal(r));
    for (int64_t k = 0; k < K; k++)
        for (int o = 0; o < 4 && o < H; o++) s[k * H + (int64_t)dfl_rng_below(r, (uint64_t)H)] *= 100.0f;
    return s;
}

/* Fill n bf16 values: value i is scale[i % width] * N(0,1). Box-Muller,
 * both outputs used. */
static void fill_bf16(uint16_t *out, int64_t n, const float *scale, int64_t width, dfl_rng *r) {
    for (int64_t i = 0; i < n; i += 2) {
        double u1 = dfl_rng_uniform(r), u2 = dfl_rng_uniform(r);
        if (u1 < 0x1.0p-60) u1 = 0x1.0p-60;
        double m = sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
        out[i] = dfl_f32_to_bf16((float)(m * cos(a)) * scale[i % width]);
        if (i + 1 < n) out[i + 1] = dfl_f32_to_bf16((float)(m * sin(a)) * scale[(i + 1) % width]);
    }
}

static json_t *make_meta(void) {
    dfs_hs_meta m;
    memset(&m, 0, sizeof m);
    snprintf(m.architecture, sizeof m.architecture, "Qwen3ForCausalLM");
    snprintf(m.model_type, sizeof m.model_type, "qwen3");
    char cfg[128];
    int n = snprintf(cfg, sizeof cfg, "dfs_datagen hidden=%lld layers=%lld vocab=%lld", (long long)hidden,
                     (long long)num_layers, (long long)vocab);
    snprintf(m.config_digest, sizeof m.config_digest, "%016llx", (unsigned long long)XXH64(cfg, (size_t)n, 0));
    m.hidden_size = hidden;
    m.num_layers = num_layers;
    m.vocab_size = vocab;
    m.nlayers = (int)layers;
    for (int i = 0; i < m.nlayers; i++) /* spread over 1 .. L-2 like the reference rule */
        m.layer_ids[i] = layers == 1 ? 1 : (int)(1 + (int64_t)i * (num_layers - 3) / (layers - 1));
    snprintf(m.hidden_dtype, sizeof m.hidden_dtype, "bf16");
    m.has_target_ids = target_ids;
    m.has_last_hidden = last_hidden;
    json_t *j = dfs_hs_meta_to_json(&m);
    json_object_set_new(j, "generator", json_pack("{s:s, s:I}", "name", "dfs_datagen", "seed", (json_int_t)seed));
    return j;
}

int main(int argc, char **argv) {
    char **pos;
    if (dfl_cli_parse(&cli, argc, argv, &pos)) dfl_cli_usage_error(&cli, "no positional arguments");
    free(pos);
    if (records < 0 || tokens < 1 || hidden < 1 || layers < 1 || layers > 64 || vocab < 1 || num_layers < layers + 2 ||
        (tokens_max && tokens_max < tokens))
        dfl_cli_usage_error(&cli, "need records >= 0, tokens >= 1, 1 <= layers <= 64, num-layers >= layers + 2");
    dfl_rng r;
    dfl_rng_seed(&r, (uint64_t)seed);
    float *scale = channel_scales(&r, layers, hidden), *last_scale = channel_scales(&r, 1, hidden);
    dfs_encoding enc = {strcmp(compress, "lz4") ? DFS_CODEC_NONE : DFS_CODEC_LZ4, !strcmp(byte_shuffle, "on"), 1};
    dfl_out *out;
    if (dfl_out_open(&out, output, 1)) dfl_die_last(cli.prog);
    FILE *f = dfl_out_file(out);
    dfs_writer *w = NULL;
    json_t *meta = make_meta();
    if (!raw && dfs_writer_open(&w, f, output, meta, "dfs_datagen " DFLASH_VERSION, enc)) dfl_die_last(cli.prog);
    json_decref(meta);
    int64_t tmax = tokens_max > tokens ? tokens_max : tokens, width = layers * hidden;
    int32_t *ids = dfl_malloc((size_t)tmax * 4), *tgt = dfl_malloc((size_t)tmax * 4);
    uint8_t *mask = dfl_malloc((size_t)tmax);
    uint16_t *h = dfl_malloc((size_t)(tmax * width) * 2), *lh = dfl_malloc((size_t)(tmax * hidden) * 2);
    for (int64_t i = 0; i < records; i++) {
        int64_t T = tokens_max > tokens ? tokens + (int64_t)dfl_rng_below(&r, (uint64_t)(tokens_max - tokens + 1)) : tokens;
        for (int64_t t = 0; t < T; t++) {
            ids[t] = (int32_t)dfl_rng_below(&r, (uint64_t)vocab);
            tgt[t] = (int32_t)dfl_rng_below(&r, (uint64_t)vocab);
            mask[t] = t >= (T * 3) / 10;
        }
        fill_bf16(h, T * width, scale, width, &r);
        if (last_hidden) fill_bf16(lh, T * hidden, last_scale, hidden, &r);
        if (raw) {
            if (fwrite(h, 2, (size_t)(T * width), f) != (size_t)(T * width)) dfl_die(cli.prog, DFL_EX_IOERR, "write failed");
            continue;
        }
        dfs_tensor_in in[5] = {
            {"input_ids", DFL_I32, 1, {T}, ids, NULL},
            {"loss_mask", DFL_U8, 1, {T}, mask, NULL},
            {"hidden", DFL_BF16, 2, {T, width}, h, NULL},
        };
        int n = 3;
        if (target_ids) in[n++] = (dfs_tensor_in){"target_ids", DFL_I32, 1, {T}, tgt, NULL};
        if (last_hidden) in[n++] = (dfs_tensor_in){"last_hidden", DFL_BF16, 2, {T, hidden}, lh, NULL};
        char id[128];
        snprintf(id, sizeof id, "%s-%lld", id_prefix, (long long)(first_index + i));
        if (dfs_write(w, id, n, in)) dfl_die_last(cli.prog);
    }
    if (w && dfs_writer_close(w)) dfl_die_last(cli.prog);
    if (dfl_out_commit(out)) dfl_die_last(cli.prog);
    free(scale);
    free(last_scale);
    free(ids);
    free(tgt);
    free(mask);
    free(h);
    free(lh);
    if (dfl_close_stdout()) dfl_die_last(cli.prog);
    return 0;
}
