/* model_config.h: the Hugging Face config.json of a Qwen3, Llama, Mistral,
 * Qwen2, Qwen3.5 or gpt-oss model, dense or mixture of experts (Qwen3-MoE,
 * Qwen3.5-MoE, gpt-oss).
 *
 * The target (Qwen3ForCausalLM, LlamaForCausalLM, and the Qwen3.5 hybrids
 * Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration, whose text
 * settings sit under "text_config") and the drafter (a Qwen3 config with
 * DFlash keys, spec §1.1) are read through this. Both
 * spellings are accepted: rope_theta + rope_scaling (transformers 4.x) and
 * rope_parameters (5.x); torch_dtype and dtype. Values dflash cannot honour
 * (attention bias, sliding windows of a Qwen3-MoE or Qwen3.5 target,
 * another activation) are refused with a message naming the key, never
 * ignored. Sliding-window layers are read for gpt-oss, Qwen3, Qwen2 and
 * Mistral targets and for drafters (Qwen3.6-27B's).
 */
#ifndef DFLASH_MODEL_CONFIG_H
#define DFLASH_MODEL_CONFIG_H

#include <jansson.h>
#include <stdint.h>

/* The most parameters (elements) a config may imply: far above any real
 * model, low enough that every shape product and byte count fits in int64. */
#define DFL_MAX_PARAMS (INT64_C(1) << 46)
/* The most decoder layers a config may have (a layer count fits an int). */
#define DFL_MAX_LAYERS 100000

typedef enum { DFL_ROPE_DEFAULT = 0, DFL_ROPE_LLAMA3 = 1, DFL_ROPE_YARN = 2 } dfl_rope_type;

/* End-of-sequence ids a config may list (released models list 1 to 3; a
 * longer list is refused, not cut, as a cut id would never stop a
 * generation). */
#define DFL_MAX_EOS 64

typedef struct {
    char    architecture[64];   /* architectures[0] */
    char    model_type[32];
    char    dtype[16];          /* "bfloat16", "float32", ... ("" if absent) */
    int64_t hidden_size, intermediate_size, num_hidden_layers;
    int64_t num_attention_heads, num_key_value_heads, head_dim;
    int64_t vocab_size, max_position_embeddings;
    double  rms_norm_eps;
    int     tie_word_embeddings;
    int     qk_norm;            /* per-head q_norm/k_norm (Qwen3): 1; Llama, Qwen2: 0 */
    int     qkv_bias;           /* q_proj, k_proj and v_proj have biases (Qwen2): 1 */
    /* Qwen3.5 hybrid (targets-extraction §3): Gated DeltaNet ("linear
     * attention") layers between gated full-attention layers. */
    int     hybrid;
    int     qwen3_next;         /* Qwen3NextForCausalLM: the hybrid with fused DeltaNet projections, Qwen3-MoE's sparse-layer rule */
    int     norm_plus_one;      /* RMSNorms scale by (1 + w) (Qwen3.5), not w */
    int     attn_output_gate;   /* q_proj also yields a sigmoid gate per head */
    int64_t rotary_dim;         /* dims of each head RoPE rotates (head_dim unless partial) */
    int64_t lin_k_heads, lin_v_heads, lin_k_dim, lin_v_dim, lin_conv; /* the DeltaNet layers */
    int64_t full_attention_interval;
    char    weight_prefix[32];  /* "model." or "model.language_model." (the VLM layout) */
    /* Mixture of experts (Qwen3-MoE, Qwen3.5-MoE; 0 experts: dense). A
     * sparse layer routes each token to experts_per_tok of num_experts
     * SwiGLU experts of width moe_intermediate_size (plus, Qwen3.5-MoE, a
     * shared expert of width shared_expert_intermediate_size, gated by a
     * sigmoid); dfl_model_config_moe_layer says which layers are sparse. */
    int64_t num_experts, experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size;
    int64_t decoder_sparse_step;
    int     norm_topk_prob;     /* the k routing weights are divided by their sum */
    /* gpt-oss (GptOssForCausalLM): biases on all four attention projections
     * (o_bias with qkv_bias), a learned sink logit per head, sliding-window
     * layers ("sliding_attention"), and experts of width
     * moe_intermediate_size (its "intermediate_size") with biases, a
     * biased router, gate and up rows interleaved in the checkpoint, and
     * the clamped activation of ops swiglu_oss (swiglu_alpha, swiglu_limit);
     * its router's softmax over the top k logits is norm_topk_prob. */
    int     gpt_oss;
    int     o_bias;
    int64_t sliding_window;     /* a sliding layer's query sees this many keys, itself included; 0: none */
    int64_t max_window_layers;  /* Qwen3/Qwen2 or a drafter without layer_types: its sliding layers start here */
    int     window_every_layer; /* Mistral, Qwen3-MoE: the window applies to every layer */
    double  swiglu_alpha, swiglu_limit;
    /* RoPE */
    dfl_rope_type rope_type;
    double  rope_theta;
    double  rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int64_t rope_original_max_pos;
    /* YaRN: the ramp's bounds (in rotations), whether its ends are rounded
     * to whole dimensions, and the factor on cos and sin */
    double  rope_beta_fast, rope_beta_slow, rope_attention_factor;
    int     rope_truncate;
    /* token ids (-1 if absent); eos may be a list */
    int64_t bos_token_id;
    int     n_eos;
    int64_t eos_token_ids[DFL_MAX_EOS];
    char    digest[17];         /* XXH64 of the config.json bytes, 16 hex digits */
    json_t *json;               /* the parsed file (owned) */
} dfl_model_config;

/* Parse `path` (a config.json). `role` ("target", "drafter") only words the
 * messages. Returns 0, DFL_EX_NOINPUT or DFL_EX_DATA (naming file and key). */
int dfl_model_config_load(dfl_model_config *c, const char *path, const char *role);
/* The same for DIR/config.json (a model or checkpoint directory). */
int dfl_model_config_load_dir(dfl_model_config *c, const char *dir, const char *role);
/* Parse a config already in memory (bytes of a config.json). */
int dfl_model_config_parse(dfl_model_config *c, const char *text, size_t len, const char *path, const char *role);
void dfl_model_config_free(dfl_model_config *c);

/* Is decoder layer i a Gated DeltaNet ("linear_attention") layer? From
 * "layer_types", or else every layer but each full_attention_interval-th. */
int dfl_model_config_linear_layer(const dfl_model_config *c, int64_t i);

/* The keys a query of decoder layer i sees at most, itself included
 * (transformers' sliding window: key j is seen from query i when i - W <
 * j <= i), for a sliding layer of gpt-oss, Qwen3, Qwen2, Mistral or a
 * drafter; 0 for full attention. */
int64_t dfl_model_config_window(const dfl_model_config *c, int64_t i);

/* Is decoder layer i's MLP a mixture of experts? Qwen3-MoE: unless listed
 * in "mlp_only_layers", every decoder_sparse_step-th layer (transformers'
 * Qwen3MoeDecoderLayer); Qwen3.5-MoE: every layer; Qwen3-Next as Qwen3-MoE. */
int dfl_model_config_moe_layer(const dfl_model_config *c, int64_t i);
/* dfl_model_config_moe_layer of layers [0, n) into sparse[n] (1: sparse),
 * in time linear in n and the length of "mlp_only_layers". */
void dfl_model_config_moe_layers(const dfl_model_config *c, int64_t n, unsigned char *sparse);

/* RoPE inverse frequencies, head_dim/2 floats, computed in f32 as
 * transformers does (including the llama3 and YaRN rescalings). With a
 * partial rotary_dim, the first rotary_dim/2 are those of a rotary_dim-wide
 * RoPE and the rest are 0 (no rotation). */
void dfl_rope_inv_freq(const dfl_model_config *c, float *inv_freq);
/* The factor on RoPE's cos and sin (transformers' attention_scaling): YaRN's
 * attention factor, 1 for the other types. It scales q and k both, so the
 * attention logits by its square. */
float dfl_rope_scale(const dfl_model_config *c);

/* The reference default tap rule (spec §1.2): n taps spread over [1, L-3],
 * Python round() (half to even); one tap is L/2. Writes n ids. */
void dfl_default_layer_ids(int num_target_layers, int n, int *ids);

#endif
