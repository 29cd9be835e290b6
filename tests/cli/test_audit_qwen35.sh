#!/usr/bin/env bash
# Regressions found by using the tools on Qwen3.5 hybrid targets the way a
# user training a drafter for Qwen3.6 would (README, man pages, --help), and
# by feeding them what such a user gets wrong.
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget"
TS="dflash-train-step --threads 1"

# an 8-layer hybrid: DeltaNet layers 0-2 and 4-6, gated attention at 3 and 7
tiny_target "$T/q35" --arch qwen3.5 --layers 8 --head-dim 16 --linear-k-heads 2 --linear-v-heads 4 \
    --linear-k-dim 8 --linear-v-dim 12
python3 - "$T/data.jsonl" <<'EOF'
import json, random, sys
r = random.Random(5)
with open(sys.argv[1], "w") as f:
    for i in range(8):
        ids = [r.randrange(60) for _ in range(r.randrange(20, 32))]
        f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)}) + "\n")
EOF
drafter_config "$T/drafter.json" block=4 taps="1, 3, 6" layers=1 target_layers=8
check "extract a hybrid stream" dflash-extract -t 1 -m "$T/q35" -l 1,3,6 -o "$T/train.dfs" "$T/data.jsonl"
check "a checkpoint with trainer state" $TS --target "$T/q35" --init "$T/drafter.json" --steps 1 --out "$T/ck" "$T/train.dfs"

# edit_json FILE PYTHON: run PYTHON with the parsed FILE as d, write it back
edit_json() {
    python3 -c "import json, sys
p = sys.argv[1]; d = json.load(open(p))
$2
json.dump(d, open(p, 'w'))" "$1"
}

# ---- a checkpoint that does not fit is refused before the model is allocated --------------
# Its config.json claims a 2^38-wide MLP (2^44.6 parameters: the model, its
# gradients and AdamW moments would take 400 TB). The trainer state, the
# weights or the target say otherwise; that must be found from the headers,
# not after allocating the drafter (it used to exit 70, out of memory).
cp -r "$T/ck" "$T/bigI" && edit_json "$T/bigI/config.json" "d['intermediate_size'] = 2**38"
cp -r "$T/bigI" "$T/bigV" && edit_json "$T/bigV/config.json" "d['vocab_size'] = 62"
expect_exit 65 "--resume, drafter for another vocabulary: 65 before allocating" \
    $TS --target "$T/q35" --resume "$T/bigV" --steps 1 --out "$T/no" "$T/train.dfs"
grep -q "target vocab_size 61 differs from the drafter's vocab_size 62" "$T/.err" &&
    pass "--resume, another vocabulary: the field is named" || fail "--resume, another vocabulary: message" "$(cat "$T/.err")"
expect_exit 65 "--resume, trainer state of another shape: 65 before allocating" \
    $TS --target "$T/q35" --resume "$T/bigI" --steps 1 --out "$T/no" "$T/train.dfs"
grep -q "bigI/trainer_state.safetensors: tensor 'master' has shape \[" "$T/.err" &&
    pass "--resume, trainer state of another shape: the file and the tensor are named" ||
    fail "--resume, trainer state of another shape: message" "$(cat "$T/.err")"
expect_exit 65 "--init-from, weights of another shape: 65 before allocating" \
    $TS --target "$T/q35" --init-from "$T/bigI" --steps 0 --out "$T/no"
grep -q "bigI/model.safetensors: tensor 'layers.0.mlp.down_proj.weight' has shape" "$T/.err" &&
    pass "--init-from, weights of another shape: the file and the tensor are named" ||
    fail "--init-from, weights of another shape: message" "$(cat "$T/.err")"
expect_exit 65 "dflash-score, weights of another shape: 65 before allocating" \
    dflash-score --threads 1 --target "$T/q35" --drafter "$T/bigI" "$T/train.dfs"
expect_exit 65 "dflash-score, drafter for another vocabulary: 65 before allocating" \
    dflash-score --threads 1 --target "$T/q35" --drafter "$T/bigV" "$T/train.dfs"
[ ! -e "$T/no" ] && pass "no checkpoint from a refused one" || fail "no checkpoint from a refused one"

# ---- dflash-extract --drafter-config: a drafter for another target is refused --------------
# It checked num_target_layers only: a drafter of another hidden size or
# vocabulary got a stream (hours of extraction) that train-step then refused.
drafter_config "$T/d_h.json" block=4 taps="1, 3, 6" layers=1 target_layers=8 hidden=64
drafter_config "$T/d_v.json" block=4 taps="1, 3, 6" layers=1 target_layers=8 vocab=70
expect_exit 65 "extract --drafter-config of another hidden size: 65" \
    dflash-extract -t 1 -m "$T/q35" --drafter-config "$T/d_h.json" -o "$T/e.dfs" "$T/data.jsonl"
grep -q "d_h.json: hidden_size is 64 but the target's is 32" "$T/.err" &&
    pass "extract --drafter-config of another hidden size: the file and the field are named" ||
    fail "extract --drafter-config of another hidden size: message" "$(cat "$T/.err")"
expect_exit 65 "extract --drafter-config of another vocabulary: 65" \
    dflash-extract -t 1 -m "$T/q35" --drafter-config "$T/d_v.json" -o "$T/e.dfs" "$T/data.jsonl"
grep -q "d_v.json: vocab_size is 70 but the target's is 61" "$T/.err" &&
    pass "extract --drafter-config of another vocabulary: the file and the field are named" ||
    fail "extract --drafter-config of another vocabulary: message" "$(cat "$T/.err")"
[ ! -e "$T/e.dfs" ] && pass "extract --drafter-config for another target: no stream" || fail "extract --drafter-config for another target: no stream"
check "extract --drafter-config of this target" \
    dflash-extract -t 1 -m "$T/q35" --drafter-config "$T/drafter.json" -o "$T/e.dfs" "$T/data.jsonl"
dflash-pack --inspect "$T/e.dfs" | head -1 | grep -q '"layer_ids":\[1,3,6\]' &&
    pass "extract --drafter-config: its layer ids" || fail "extract --drafter-config: its layer ids"

# ---- a sharded VLM checkpoint whose layer_types disagree with its weights ------------------
# The missing tensor was reported in the first shard opened (model-00002-of-00002),
# a file that has nothing to do with it: it is missing from the index.
VLM=$FIX/targets/qwen35-vlm
cp -r "$VLM" "$T/vlm" && rm -rf "$T/vlm/reference"
edit_json "$T/vlm/config.json" "d['text_config']['layer_types'] = ['linear_attention'] * 4 + ['full_attention'] * 4"
expect_exit 65 "VLM, layer_types against the weights: 65" \
    dflash-extract -t 1 -m "$T/vlm" -l 6 -o "$T/vlm.dfs" "$T/data.jsonl"
grep -q "vlm/model.safetensors.index.json: tensor 'model.language_model.layers.3.linear_attn.in_proj_qkv.weight' is missing" "$T/.err" &&
    pass "VLM, a tensor missing from the shards: the index is named" || fail "VLM, missing tensor: message" "$(cat "$T/.err")"
[ ! -e "$T/vlm.dfs" ] && pass "VLM, layer_types against the weights: no stream" || fail "VLM, layer_types against the weights: no stream"

# ---- pipelines/Makefile's drafter config from a released (VLM) Qwen3.5 config.json ---------
# Its sizes are in text_config: the jq recipe failed ("null (null) and null
# (null) cannot be divided") where README step 2 says the Makefile makes it.
(cd "$T" && make -s -f "$here/pipelines/Makefile" TARGET="$VLM" OUT=mk LAYERS=1,3,6 MASK_TOKEN=198 DRAFT_LAYERS=1 \
    BLOCK=4 mk/drafter.json) >"$T/.out" 2>&1 && pass "pipelines/Makefile drafter.json from a VLM target" ||
    fail "pipelines/Makefile drafter.json from a VLM target" "$(cat "$T/.out")"
jq -e '.hidden_size == 48 and .intermediate_size == 88 and .head_dim == 32 and .vocab_size == 199 and
       .num_target_layers == 8 and .rope_theta == 10000000 and .max_position_embeddings == 256' "$T/mk/drafter.json" >/dev/null 2>&1 &&
    pass "pipelines/Makefile drafter.json: the text model's sizes" || fail "pipelines/Makefile drafter.json: sizes" "$(cat "$T/mk/drafter.json" 2>&1)"
check "a drafter from that config on the VLM target" $TS --target "$VLM" --init "$T/mk/drafter.json" --steps 0 --out "$T/mkck"

# ---- layer_types holding a non-string: named as such (it read '"?"', as if the file said so) --
cp -r "$T/q35" "$T/lt" && edit_json "$T/lt/config.json" "d['layer_types'][2] = 3"
expect_exit 65 "layer_types[2] not a string: 65" dflash-extract -t 1 -m "$T/lt" -l 1 -o "$T/lt.dfs" "$T/data.jsonl"
grep -q 'lt/config.json: "layer_types"\[2\] is not a string' "$T/.err" && pass "layer_types[2] not a string: message" ||
    fail "layer_types[2] not a string: message" "$(cat "$T/.err")"

# ---- outputs: a directory is refused before the work, the input is never the output --------
# -o DIR failed at the rename, after the whole extraction (and --split had
# already put its other parts in place); -o INPUT replaced the samples.
mkdir -p "$T/adir" "$T/sp-val.dfs"
expect_exit 73 "extract -o DIR: 73" dflash-extract -t 1 -m "$T/q35" -l 1 -o "$T/adir" "$T/data.jsonl"
grep -q "adir: is a directory" "$T/.err" && ! grep -q "rename" "$T/.err" && pass "extract -o DIR: refused before the extraction" ||
    fail "extract -o DIR: refused before the extraction" "$(cat "$T/.err")"
expect_exit 73 "pack --split with a part that is a directory: 73" \
    dflash-pack --split train=0.5,val=0.5 -o "$T/sp-%s.dfs" "$T/train.dfs"
[ ! -e "$T/sp-train.dfs" ] && pass "pack --split: no part written when another cannot be" ||
    fail "pack --split: no part written when another cannot be"
cp "$T/data.jsonl" "$T/in.jsonl"
expect_exit 2 "extract -o INPUT: 2" dflash-extract -t 1 -m "$T/q35" -l 1 -o "$T/in.jsonl" "$T/in.jsonl"
cmp -s "$T/in.jsonl" "$T/data.jsonl" && pass "extract -o INPUT: the samples are kept" || fail "extract -o INPUT: the samples are kept"
