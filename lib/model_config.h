/* model_config.h: the Hugging Face config.json of a Qwen3 or Llama model.
 *
 * Both the target (Qwen3ForCausalLM, LlamaForCausalLM) and the drafter (a
 * Qwen3 config with DFlash keys, spec §1.1) are read through this. Both
 * spellings are accepted: rope_theta + rope_scaling (transformers 4.x) and
 * rope_parameters (5.x); torch_dtype and dtype. Values dflash cannot honour
 * (attention bias, sliding windows, YaRN, another activation) are refused
 * with a message naming the key, never ignored.
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

typedef enum { DFL_ROPE_DEFAULT = 0, DFL_ROPE_LLAMA3 = 1 } dfl_rope_type;

typedef struct {
    char    architecture[64];   /* architectures[0] */
    char    model_type[32];
    char    dtype[16];          /* "bfloat16", "float32", ... ("" if absent) */
    int64_t hidden_size, intermediate_size, num_hidden_layers;
    int64_t num_attention_heads, num_key_value_heads, head_dim;
    int64_t vocab_size, max_position_embeddings;
    double  rms_norm_eps;
    int     tie_word_embeddings;
    int     qk_norm;            /* per-head q_norm/k_norm (Qwen3): 1; Llama: 0 */
    /* RoPE */
    dfl_rope_type rope_type;
    double  rope_theta;
    double  rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int64_t rope_original_max_pos;
    /* token ids (-1 if absent); eos may be a list */
    int64_t bos_token_id;
    int     n_eos;
    int64_t eos_token_ids[8];
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

/* RoPE inverse frequencies, head_dim/2 floats, computed in f32 as
 * transformers does (including the llama3 rescaling). */
void dfl_rope_inv_freq(const dfl_model_config *c, float *inv_freq);

/* The reference default tap rule (spec §1.2): n taps spread over [1, L-3],
 * Python round() (half to even); one tap is L/2. Writes n ids. */
void dfl_default_layer_ids(int num_target_layers, int n, int *ids);

#endif
