/* mktarget: write a deterministic random tiny Qwen3, Llama, Qwen2, Qwen3.5
 * or gpt-oss model (dense, or Qwen3 / Qwen3.5 with a mixture of experts:
 * --experts N; gpt-oss always has one)
 * directory (config.json + model.safetensors, bf16), with no Python. Used by the tests,
 * the benchmarks and `make demo` wherever a target model is needed.
 *
 * Weights (each tensor from its own stream, seeded by --seed and the tensor
 * name, so changing one size does not reshuffle unrelated tensors):
 *   embedding             N(0, 1)              the residual starts at rms 1
 *   q, k, v, gate, up     N(0, 1/fan_in)        unit-variance projections
 *   o, down               N(0, 1/(2 L fan_in))  each of the 2L residual
 *                                              branches adds ~1/(2L) variance,
 *                                              so the stream stays O(1) deep
 *   lm_head (untied)      N(0, 1/H)             unit-variance logits
 *   RMSNorm weights       1 + N(0, 0.1^2)  (Qwen3.5 stores w of its 1 + w: N(0, 0.1^2))
 * Qwen3.5's Gated DeltaNet layers: in_proj_qkv, z, a, b N(0, 1/H), conv1d
 * N(0, 1/K), out_proj as o, norm 1 + N(0, 0.1^2), dt_bias N(0, 0.5^2),
 * A_log = log(U(1, 16)) (transformers' initialisation);
 * gpt-oss: attention biases N(0, 0.5^2) (o_proj's as o), sinks N(0, 1),
 * router N(0, 4/H) with bias N(0, 1), experts stacked as transformers
 * saves them (gate_up_proj [E, H, 2I], gate and up interleaved; down_proj
 * [E, I, H]) with biases N(0, 0.5^2), layers alternating sliding (--window)
 * and full, YaRN as the released files;
 * so activations stay well-conditioned through any number of layers and
 * attention is neither uniform nor one-hot.
 */
#include "cli.h"
#include "common.h"
#include "outfile.h"
#include "rng.h"
#include "safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

static const char *arch = "qwen3", *tie = "yes", *out_dir = NULL, *spelling = "old";
static int64_t vocab = 211, hidden = 72, inter = 136, layers = 6, heads = 6, kv_heads = 3, head_dim = 0;
static int64_t seed = 1, max_pos = 4096;
static double theta = 0, eps = 0;
static int llama3_scaling = 0, yarn_scaling = 0;
static int qwen2 = 0; /* --arch qwen2: Qwen3's config keys, Llama's layer plus q/k/v biases */
static int gpt_oss = 0; /* --arch gpt-oss */
static int64_t window = -1; /* gpt-oss: 16; Qwen3/Qwen2: none */
static int64_t lin_k_heads = 2, lin_v_heads = 4, lin_k_dim = 16, lin_v_dim = 24, conv_k = 4, full_interval = 4;
static double rotary = 0.25;
static int64_t experts = 0, experts_per_tok = 2, moe_inter = 40, shared_inter = 0, sparse_step = 1;

static const dfl_opt opts[] = {
    {"arch", 'a', DFL_OPT_CHOICE, &arch, "qwen3|llama|qwen2|qwen3.5|gpt-oss",
     "Architecture: Qwen3ForCausalLM (q/k norms), LlamaForCausalLM, Qwen2ForCausalLM (biases on q, k and v, no q/k "
     "norms), Qwen3_5ForCausalLM (Gated DeltaNet and gated attention layers), or GptOssForCausalLM (needs "
     "--experts; --intermediate is ignored).", NULL},
    {"window", 0, DFL_OPT_INT, &window, "N",
     "sliding_window: gpt-oss's sliding layers (0, 2, 4 ...; default 16); qwen3/qwen2: use_sliding_window, "
     "the layers from max_window_layers = layers/2 on (default: none).", NULL},
    {"output", 'o', DFL_OPT_STR, &out_dir, "DIR", "Model directory to write (created; files in it are replaced).", NULL},
    {"vocab", 0, DFL_OPT_INT, &vocab, "N", "vocab_size.", NULL},
    {"hidden", 0, DFL_OPT_INT, &hidden, "N", "hidden_size.", NULL},
    {"intermediate", 0, DFL_OPT_INT, &inter, "N", "intermediate_size.", NULL},
    {"layers", 0, DFL_OPT_INT, &layers, "N", "num_hidden_layers.", NULL},
    {"heads", 0, DFL_OPT_INT, &heads, "N", "num_attention_heads.", NULL},
    {"kv-heads", 0, DFL_OPT_INT, &kv_heads, "N", "num_key_value_heads (divides --heads).", NULL},
    {"head-dim", 0, DFL_OPT_INT, &head_dim, "N", "head_dim (even).", "hidden/heads"},
    {"tie", 0, DFL_OPT_CHOICE, &tie, "yes|no", "tie_word_embeddings (no: write lm_head.weight).", NULL},
    {"rope-theta", 0, DFL_OPT_DOUBLE, &theta, "X", "RoPE base.", "1e6 for qwen3, 5e5 for llama"},
    {"llama3-scaling", 0, DFL_OPT_FLAG, &llama3_scaling, NULL,
     "Add llama3 RoPE scaling (factor 8, low 1, high 4, original context max-position/4).", NULL},
    {"yarn-scaling", 0, DFL_OPT_FLAG, &yarn_scaling, NULL,
     "Add YaRN RoPE scaling (factor 4, original context max-position/4; not with --llama3-scaling).", NULL},
    {"eps", 0, DFL_OPT_DOUBLE, &eps, "X", "rms_norm_eps.", "1e-6 for qwen3, 1e-5 for llama"},
    {"max-position", 0, DFL_OPT_INT, &max_pos, "N", "max_position_embeddings.", NULL},
    {"config-spelling", 0, DFL_OPT_CHOICE, &spelling, "old|new",
     "old: rope_theta, rope_scaling, torch_dtype (transformers 4.x, as released files); new: rope_parameters, dtype (5.x).", NULL},
    {"linear-k-heads", 0, DFL_OPT_INT, &lin_k_heads, "N", "qwen3.5: linear_num_key_heads.", NULL},
    {"linear-v-heads", 0, DFL_OPT_INT, &lin_v_heads, "N", "qwen3.5: linear_num_value_heads (a multiple of the key heads).", NULL},
    {"linear-k-dim", 0, DFL_OPT_INT, &lin_k_dim, "N", "qwen3.5: linear_key_head_dim.", NULL},
    {"linear-v-dim", 0, DFL_OPT_INT, &lin_v_dim, "N", "qwen3.5: linear_value_head_dim.", NULL},
    {"conv-kernel", 0, DFL_OPT_INT, &conv_k, "N", "qwen3.5: linear_conv_kernel_dim.", NULL},
    {"full-interval", 0, DFL_OPT_INT, &full_interval, "N", "qwen3.5: every N-th layer is full attention.", NULL},
    {"rotary", 0, DFL_OPT_DOUBLE, &rotary, "X", "qwen3.5: partial_rotary_factor.", NULL},
    {"experts", 0, DFL_OPT_INT, &experts, "N",
     "qwen3, qwen3.5: a mixture of N experts in every layer's MLP (Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM; "
     "experts one tensor each, as the released Qwen3-MoE files); 0: dense.", NULL},
    {"experts-per-tok", 0, DFL_OPT_INT, &experts_per_tok, "N", "with --experts: num_experts_per_tok.", NULL},
    {"moe-intermediate", 0, DFL_OPT_INT, &moe_inter, "N", "with --experts: moe_intermediate_size.", NULL},
    {"shared-intermediate", 0, DFL_OPT_INT, &shared_inter, "N",
     "with --experts, qwen3.5: shared_expert_intermediate_size (Qwen3.5-MoE always has one).", "40"},
    {"sparse-step", 0, DFL_OPT_INT, &sparse_step, "N",
     "with --experts, qwen3: decoder_sparse_step (every N-th layer sparse, the others a dense MLP of --intermediate).",
     NULL},
    {"seed", 's', DFL_OPT_INT, &seed, "N", "Random seed.", NULL},
    {NULL, 0, 0, NULL, NULL, NULL, NULL},
};

static const dfl_cli cli = {
    "mktarget",
    "write a deterministic random tiny Qwen3/Llama/Qwen3.5 model directory (test helper)",
    "[OPTIONS] -o DIR",
    opts,
};

/* One tensor: name, shape, and how to draw it. */
typedef struct {
    char name[96];
    int64_t shape[3];
    int ndim;
    double std, mean;
    int log_uniform; /* log(U(1, 16)) instead of N(mean, std^2) */
    uint16_t *data;
} tspec;

static tspec *specs;
static int nspecs;

static void add(const char *fmt, int layer, int64_t d0, int64_t d1, double mean, double std) {
    specs = dfl_realloc(specs, sizeof *specs * (size_t)(nspecs + 1));
    tspec *t = &specs[nspecs++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, fmt, layer);
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->ndim = d1 ? 2 : 1;
    t->mean = mean;
    t->std = std;
}

static void fill(tspec *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    t->data = dfl_malloc((size_t)n * sizeof *t->data);
    dfl_rng r;
    dfl_rng_seed(&r, (uint64_t)seed ^ XXH64(t->name, strlen(t->name), 0));
    for (int64_t i = 0; i < n; i++) {
        double x = t->log_uniform ? log(1 + 15 * dfl_rng_uniform(&r)) : t->mean + t->std * dfl_rng_normal(&r);
        t->data[i] = dfl_f32_to_bf16((float)x);
    }
}

/* A sparse MLP: the router N(0, 4/H) (logits of spread ~2: decisive top-k
 * choices), the experts as the dense MLP's matrices; Qwen3.5's shared
 * expert and its gate row N(0, 1/H). */
static void add_moe_layer(int l, int hybrid, double res) {
    const int64_t H = hidden;
    char fmt[128];
    add("model.layers.%d.mlp.gate.weight", l, experts, H, 0, 2 / sqrt((double)H));
    for (int64_t e = 0; e < experts; e++) {
        snprintf(fmt, sizeof fmt, "model.layers.%%d.mlp.experts.%lld.gate_proj.weight", (long long)e);
        add(fmt, l, moe_inter, H, 0, 1 / sqrt((double)H));
        snprintf(fmt, sizeof fmt, "model.layers.%%d.mlp.experts.%lld.up_proj.weight", (long long)e);
        add(fmt, l, moe_inter, H, 0, 1 / sqrt((double)H));
        snprintf(fmt, sizeof fmt, "model.layers.%%d.mlp.experts.%lld.down_proj.weight", (long long)e);
        add(fmt, l, H, moe_inter, 0, res / sqrt((double)moe_inter));
    }
    if (!hybrid) return;
    add("model.layers.%d.mlp.shared_expert.gate_proj.weight", l, shared_inter, H, 0, 1 / sqrt((double)H));
    add("model.layers.%d.mlp.shared_expert.up_proj.weight", l, shared_inter, H, 0, 1 / sqrt((double)H));
    add("model.layers.%d.mlp.shared_expert.down_proj.weight", l, H, shared_inter, 0, res / sqrt((double)shared_inter));
    add("model.layers.%d.mlp.shared_expert_gate.weight", l, 1, H, 0, 1 / sqrt((double)H));
}

static void add3(const char *fmt, int layer, int64_t d0, int64_t d1, int64_t d2, double mean, double std) {
    add(fmt, layer, d0, d1, mean, std);
    specs[nspecs - 1].ndim = 3;
    specs[nspecs - 1].shape[2] = d2;
}

/* gpt-oss's sparse MLP, as transformers' GptOssMLP saves it. */
static void add_oss_moe_layer(int l, double res) {
    const int64_t H = hidden, E = experts, I = moe_inter;
    add("model.layers.%d.mlp.router.weight", l, E, H, 0, 2 / sqrt((double)H));
    add("model.layers.%d.mlp.router.bias", l, E, 0, 0, 1);
    add3("model.layers.%d.mlp.experts.gate_up_proj", l, E, H, 2 * I, 0, 1 / sqrt((double)H));
    add("model.layers.%d.mlp.experts.gate_up_proj_bias", l, E, 2 * I, 0, 0.5);
    add3("model.layers.%d.mlp.experts.down_proj", l, E, I, H, 0, res / sqrt((double)I));
    add("model.layers.%d.mlp.experts.down_proj_bias", l, E, H, 0, res * 0.5);
}

/* gpt-oss's keys, as the released gpt-oss-20b config.json spells them. */
static void oss_config(json_t *c) {
    json_object_set_new(c, "num_local_experts", json_integer(experts));
    json_object_set_new(c, "num_experts_per_tok", json_integer(experts_per_tok));
    json_object_set_new(c, "intermediate_size", json_integer(moe_inter));
    json_object_set_new(c, "sliding_window", json_integer(window));
    json_object_set_new(c, "swiglu_limit", json_real(7.0));
    json_object_set_new(c, "attention_bias", json_true());
    json_t *lt = json_array();
    for (int64_t i = 0; i < layers; i++) json_array_append_new(lt, json_string(i % 2 ? "full_attention" : "sliding_attention"));
    json_object_set_new(c, "layer_types", lt);
    json_object_set_new(c, "rope_theta", json_real(theta));
    json_object_set_new(c, "rope_scaling", json_pack("{sssfsfsfsIsb}", "rope_type", "yarn", "factor", 32.0, "beta_fast", 32.0,
                                                     "beta_slow", 1.0, "original_max_position_embeddings",
                                                     (json_int_t)4096, "truncate", 0));
    json_object_set_new(c, "torch_dtype", json_string("bfloat16"));
    json_object_set_new(c, "transformers_version", json_string("4.55.0"));
}

/* A Gated DeltaNet layer (transformers Qwen3_5GatedDeltaNet's tensors). */
static void add_linear_layer(int l, double res) {
    const int64_t H = hidden, VD = lin_v_heads * lin_v_dim, C = 2 * lin_k_heads * lin_k_dim + VD;
    const double sh = 1 / sqrt((double)H);
    add("model.layers.%d.linear_attn.in_proj_qkv.weight", l, C, H, 0, sh);
    add("model.layers.%d.linear_attn.in_proj_z.weight", l, VD, H, 0, sh);
    add("model.layers.%d.linear_attn.in_proj_b.weight", l, lin_v_heads, H, 0, sh);
    add("model.layers.%d.linear_attn.in_proj_a.weight", l, lin_v_heads, H, 0, sh);
    add("model.layers.%d.linear_attn.conv1d.weight", l, C, 1, 0, 1 / sqrt((double)conv_k));
    specs[nspecs - 1].ndim = 3;
    specs[nspecs - 1].shape[2] = conv_k;
    add("model.layers.%d.linear_attn.dt_bias", l, lin_v_heads, 0, 0, 0.5);
    add("model.layers.%d.linear_attn.A_log", l, lin_v_heads, 0, 0, 0);
    specs[nspecs - 1].log_uniform = 1;
    add("model.layers.%d.linear_attn.norm.weight", l, lin_v_dim, 0, 1, 0.1);
    add("model.layers.%d.linear_attn.out_proj.weight", l, H, VD, 0, res / sqrt((double)VD));
}

/* The Qwen3.5 keys, as transformers' Qwen3_5TextConfig writes them. */
static void hybrid_config(json_t *c) {
    json_object_set_new(c, "linear_num_key_heads", json_integer(lin_k_heads));
    json_object_set_new(c, "linear_num_value_heads", json_integer(lin_v_heads));
    json_object_set_new(c, "linear_key_head_dim", json_integer(lin_k_dim));
    json_object_set_new(c, "linear_value_head_dim", json_integer(lin_v_dim));
    json_object_set_new(c, "linear_conv_kernel_dim", json_integer(conv_k));
    json_t *lt = json_array();
    for (int64_t i = 0; i < layers; i++)
        json_array_append_new(lt, json_string((i + 1) % full_interval ? "linear_attention" : "full_attention"));
    json_object_set_new(c, "layer_types", lt);
    json_object_set_new(c, "rope_parameters", json_pack("{sssfsf}", "rope_type", "default", "rope_theta", theta,
                                                        "partial_rotary_factor", rotary));
    json_object_set_new(c, "dtype", json_string("bfloat16"));
}

static json_t *make_config(int qwen, int hybrid) {
    json_t *c = json_object();
    const char *archs[2][3] = {{"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM"},
                               {"", "Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM"}};
    const char *types[2][3] = {{"llama", "qwen3", "qwen3_5_text"}, {"", "qwen3_moe", "qwen3_5_moe_text"}};
    const int moe = experts > 0 && !gpt_oss, kind = hybrid ? 2 : qwen;
    json_object_set_new(c, "architectures", json_pack("[s]", gpt_oss ? "GptOssForCausalLM" : qwen2 ? "Qwen2ForCausalLM" : archs[moe][kind]));
    json_object_set_new(c, "model_type", json_string(gpt_oss ? "gpt_oss" : qwen2 ? "qwen2" : types[moe][kind]));
    if (moe) {
        json_object_set_new(c, "num_experts", json_integer(experts));
        json_object_set_new(c, "num_experts_per_tok", json_integer(experts_per_tok));
        json_object_set_new(c, "moe_intermediate_size", json_integer(moe_inter));
        if (hybrid) json_object_set_new(c, "shared_expert_intermediate_size", json_integer(shared_inter));
        else json_object_set_new(c, "norm_topk_prob", json_true()); /* as Qwen3-30B-A3B */
        if (sparse_step != 1) json_object_set_new(c, "decoder_sparse_step", json_integer(sparse_step));
    }
    json_object_set_new(c, "vocab_size", json_integer(vocab));
    json_object_set_new(c, "hidden_size", json_integer(hidden));
    json_object_set_new(c, "intermediate_size", json_integer(inter));
    json_object_set_new(c, "num_hidden_layers", json_integer(layers));
    json_object_set_new(c, "num_attention_heads", json_integer(heads));
    json_object_set_new(c, "num_key_value_heads", json_integer(kv_heads));
    json_object_set_new(c, "head_dim", json_integer(head_dim));
    json_object_set_new(c, "hidden_act", json_string("silu"));
    json_object_set_new(c, "max_position_embeddings", json_integer(max_pos));
    json_object_set_new(c, "rms_norm_eps", json_real(eps));
    json_object_set_new(c, "tie_word_embeddings", json_boolean(!strcmp(tie, "yes")));
    json_object_set_new(c, "attention_bias", json_false());
    json_object_set_new(c, "attention_dropout", json_real(0));
    json_object_set_new(c, "initializer_range", json_real(0.02));
    json_object_set_new(c, "use_cache", json_true());
    json_object_set_new(c, "bos_token_id", json_integer(vocab > 1 ? 1 : 0));
    json_object_set_new(c, "eos_token_id", json_integer(vocab > 2 ? 2 : 0));
    if (gpt_oss) {
        oss_config(c);
        return c;
    }
    if (hybrid) {
        hybrid_config(c);
        json_object_set_new(c, "transformers_version", json_string("5.24.0"));
        return c;
    }
    if (qwen) {
        json_object_set_new(c, "use_sliding_window", json_boolean(window > 0));
        json_object_set_new(c, "sliding_window", window > 0 ? json_integer(window) : json_null());
        json_object_set_new(c, "max_window_layers", json_integer(window > 0 ? layers / 2 : layers));
    } else {
        json_object_set_new(c, "mlp_bias", json_false());
        json_object_set_new(c, "pretraining_tp", json_integer(1));
    }
    json_t *scaling = json_null();
    if (llama3_scaling)
        scaling = json_pack("{sssfsfsfsI}", "rope_type", "llama3", "factor", 8.0, "low_freq_factor", 1.0,
                            "high_freq_factor", 4.0, "original_max_position_embeddings", (json_int_t)(max_pos / 4));
    if (yarn_scaling)
        scaling = json_pack("{sssfsI}", "rope_type", "yarn", "factor", 4.0, "original_max_position_embeddings",
                            (json_int_t)(max_pos / 4));
    if (!strcmp(spelling, "new")) {
        json_t *rp = json_is_object(scaling) ? scaling : json_pack("{ss}", "rope_type", "default");
        if (!json_is_object(scaling)) json_decref(scaling);
        json_object_set_new(rp, "rope_theta", json_real(theta));
        json_object_set_new(c, "rope_parameters", rp);
        json_object_set_new(c, "dtype", json_string("bfloat16"));
    } else {
        json_object_set_new(c, "rope_theta", json_real(theta));
        json_object_set_new(c, "rope_scaling", scaling);
        json_object_set_new(c, "torch_dtype", json_string("bfloat16"));
    }
    json_object_set_new(c, "transformers_version", json_string("4.51.0"));
    return c;
}

static int write_config(const json_t *c, const char *path) {
    dfl_out *o;
    int rc = dfl_out_open(&o, path, 0);
    if (rc) return rc;
    if (json_dumpf(c, dfl_out_file(o), JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(9)) != 0 || fputc('\n', dfl_out_file(o)) == EOF) {
        dfl_out_abort(o);
        return dfl_err(DFL_EX_IOERR, "%s: write error", path);
    }
    return dfl_out_commit(o);
}

int main(int argc, char **argv) {
    char **pos;
    int npos = dfl_cli_parse(&cli, argc, argv, &pos);
    if (npos) dfl_cli_usage_error(&cli, "unexpected argument '%s'", pos[0]);
    free(pos);
    if (!out_dir) dfl_cli_usage_error(&cli, "-o DIR is required");
    if (llama3_scaling && yarn_scaling) dfl_cli_usage_error(&cli, "--llama3-scaling and --yarn-scaling exclude each other");
    qwen2 = !strcmp(arch, "qwen2");
    gpt_oss = !strcmp(arch, "gpt-oss");
    int hybrid = !strcmp(arch, "qwen3.5"), qwen = hybrid || qwen2 || !strcmp(arch, "qwen3");
    if (!head_dim && heads > 0) head_dim = hidden / heads;
    if (!theta) theta = gpt_oss ? 150000 : hybrid ? 1e7 : qwen ? 1e6 : 5e5;
    if (!eps) eps = qwen ? 1e-6 : 1e-5;
    if (window < 0) window = gpt_oss ? 16 : 0;
    if (window && !gpt_oss && (hybrid || !qwen)) dfl_cli_usage_error(&cli, "--window is for gpt-oss, qwen3 and qwen2");
    if (gpt_oss && (experts < 1 || experts_per_tok < 1 || experts_per_tok > experts || moe_inter < 1 || window < 0))
        dfl_cli_usage_error(&cli, "gpt-oss needs --experts, 1 <= experts-per-tok <= experts, a positive "
                                  "--moe-intermediate and a window of at least 0");
    if (vocab < 1 || hidden < 1 || inter < 1 || layers < 1 || heads < 1 || kv_heads < 1 || head_dim < 2 ||
        head_dim % 2 || heads % kv_heads || max_pos < 4)
        dfl_cli_usage_error(&cli, "sizes must be positive, head_dim even, heads a multiple of kv-heads");
    if (hybrid && (lin_k_heads < 1 || lin_v_heads < 1 || lin_v_heads % lin_k_heads || lin_k_dim < 1 || lin_v_dim < 1 ||
                   conv_k < 1 || conv_k > 8 || full_interval < 1 || !(rotary > 0 && rotary <= 1)))
        dfl_cli_usage_error(&cli, "qwen3.5 sizes must be positive, linear-v-heads a multiple of linear-k-heads, "
                                  "conv-kernel at most 8, rotary in (0, 1]");
    if (!shared_inter) shared_inter = 40;
    if (experts && !gpt_oss && (!qwen || qwen2 || experts_per_tok < 1 || experts_per_tok > experts || moe_inter < 1 || shared_inter < 1 ||
                    sparse_step < 1 || (hybrid && sparse_step != 1)))
        dfl_cli_usage_error(&cli, "--experts needs qwen3 or qwen3.5, 1 <= experts-per-tok <= experts, positive widths "
                                  "and a positive sparse-step (1 for qwen3.5)");
    if (mkdir(out_dir, 0777) != 0 && errno != EEXIST) dfl_die(cli.prog, DFL_EX_CANTCREAT, "%s: %s", out_dir, strerror(errno));

    int64_t H = hidden, I = inter, D = head_dim, QD = heads * D, KD = kv_heads * D;
    double res = 1.0 / sqrt(2.0 * (double)layers);
    add("model.embed_tokens.weight", 0, vocab, H, 0, 1);
    const double norm_mean = hybrid ? 0 : 1; /* Qwen3.5 norms scale by 1 + w */
    for (int l = 0; l < layers; l++) {
        add("model.layers.%d.input_layernorm.weight", l, H, 0, norm_mean, 0.1);
        if (hybrid && (l + 1) % full_interval) {
            add_linear_layer(l, res);
        } else {
            /* Qwen3.5's q_proj holds each head's query rows, then its gate rows */
            add("model.layers.%d.self_attn.q_proj.weight", l, hybrid ? 2 * QD : QD, H, 0, 1 / sqrt((double)H));
            add("model.layers.%d.self_attn.k_proj.weight", l, KD, H, 0, 1 / sqrt((double)H));
            add("model.layers.%d.self_attn.v_proj.weight", l, KD, H, 0, 1 / sqrt((double)H));
            add("model.layers.%d.self_attn.o_proj.weight", l, H, QD, 0, res / sqrt((double)QD));
            if (qwen2 || gpt_oss) {
                add("model.layers.%d.self_attn.q_proj.bias", l, QD, 0, 0, 0.5);
                add("model.layers.%d.self_attn.k_proj.bias", l, KD, 0, 0, 0.5);
                add("model.layers.%d.self_attn.v_proj.bias", l, KD, 0, 0, 0.5);
            }
            if (gpt_oss) {
                add("model.layers.%d.self_attn.o_proj.bias", l, H, 0, 0, res * 0.5);
                add("model.layers.%d.self_attn.sinks", l, heads, 0, 0, 1);
            } else if (qwen && !qwen2) {
                add("model.layers.%d.self_attn.q_norm.weight", l, D, 0, norm_mean, 0.1);
                add("model.layers.%d.self_attn.k_norm.weight", l, D, 0, norm_mean, 0.1);
            }
        }
        add("model.layers.%d.post_attention_layernorm.weight", l, H, 0, norm_mean, 0.1);
        if (gpt_oss) {
            add_oss_moe_layer(l, res);
            continue;
        }
        if (experts && (l + 1) % sparse_step == 0) {
            add_moe_layer(l, hybrid, res);
            continue;
        }
        add("model.layers.%d.mlp.gate_proj.weight", l, I, H, 0, 1 / sqrt((double)H));
        add("model.layers.%d.mlp.up_proj.weight", l, I, H, 0, 1 / sqrt((double)H));
        add("model.layers.%d.mlp.down_proj.weight", l, H, I, 0, res / sqrt((double)I));
    }
    add("model.norm.weight", 0, H, 0, norm_mean, 0.1);
    if (strcmp(tie, "yes")) add("lm_head.weight", 0, vocab, H, 0, 1 / sqrt((double)H));

    dfl_st_in *in = dfl_calloc((size_t)nspecs, sizeof *in);
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < nspecs; i++) fill(&specs[i]);
    for (int i = 0; i < nspecs; i++) {
        in[i].name = specs[i].name;
        in[i].dtype = DFL_BF16;
        in[i].ndim = specs[i].ndim;
        for (int d = 0; d < 3; d++) in[i].shape[d] = specs[i].shape[d];
        in[i].data = specs[i].data;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", out_dir);
    json_t *meta = json_pack("{ss}", "format", "pt");
    int rc = dfl_st_write(path, in, nspecs, meta);
    json_decref(meta);
    if (rc) dfl_die_last(cli.prog);
    json_t *c = make_config(qwen, hybrid);
    snprintf(path, sizeof path, "%s/config.json", out_dir);
    if ((rc = write_config(c, path))) dfl_die_last(cli.prog);
    json_decref(c);
    for (int i = 0; i < nspecs; i++) free(specs[i].data);
    free(specs);
    free(in);
    rc = dfl_close_stdout();
    if (rc) dfl_die_last(cli.prog);
    return 0;
}
