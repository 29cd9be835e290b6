# tests/models.sh: the small models the CLI tests and the benchmarks make
# (sourced by tests/cli/lib.sh and tests/bench/lib.sh; defines functions only).
#   tiny_target DIR [MKTARGET OPTION...]   a tiny random target: vocab 61,
#       hidden 32, intermediate 48, 4 heads, 2 KV heads (head_dim 8); the
#       options given are added (--layers, --seed, --tie ...; a later option
#       overrides an earlier one). Needs $DFLASH_BUILD/tests/mktarget.
#   drafter_config FILE [KEY=VALUE...]     a DFlash drafter config.json in the
#       z-lab layout. Defaults: a drafter for `tiny_target --layers 6` (block
#       6, taps 1, 3, 4, 2 layers); the keys below replace them.

tiny_target() {
    local dir=$1
    shift
    "$DFLASH_BUILD/tests/mktarget" -o "$dir" --vocab 61 --hidden 32 --intermediate 48 --heads 4 --kv-heads 2 "$@" >/dev/null
}

drafter_config() {
    local file=$1 kv
    shift
    local -A c=([block]=6 [target_layers]=6 [mask]=60 [taps]="1, 3, 4" [hidden]=32 [inter]=48 [layers]=2 [heads]=4
                [kv_heads]=2 [head_dim]=8 [theta]=10000.0 [vocab]=61)
    for kv in "$@"; do
        [ -n "${c[${kv%%=*}]+set}" ] || { echo "drafter_config: unknown key in '$kv'" >&2; return 2; }
        c[${kv%%=*}]=${kv#*=}
    done
    cat >"$file" <<EOF
{"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": ${c[block]}, "num_target_layers": ${c[target_layers]},
 "dflash_config": {"mask_token_id": ${c[mask]}, "target_layer_ids": [${c[taps]}]},
 "hidden_size": ${c[hidden]}, "intermediate_size": ${c[inter]}, "num_hidden_layers": ${c[layers]}, "num_attention_heads": ${c[heads]},
 "num_key_value_heads": ${c[kv_heads]}, "head_dim": ${c[head_dim]}, "rms_norm_eps": 1e-06, "rope_theta": ${c[theta]}, "vocab_size": ${c[vocab]}}
EOF
}
