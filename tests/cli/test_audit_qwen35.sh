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
