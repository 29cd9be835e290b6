#!/usr/bin/env bash
# Outputs that would replace what a tool reads: -o of dflash-extract, --emit
# of dflash-score, --log of dflash-train-step against the input, the configs
# and the model and checkpoint directories (exit 2, before any work, every
# input intact), and the outputs beside them that stay allowed.
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget" "$DFLASH_BIN/dflash-extract" "$DFLASH_BIN/dflash-train-step" \
    "$DFLASH_BIN/dflash-score"
tiny_target "$T/target" --layers 6 --seed 2
drafter_config "$T/drafter.json"
printf '%s\n' '{"id":"a","input_ids":[1,2,3,4,5,6,7,8],"loss_mask":[0,0,1,1,1,1,1,1]}' \
    '{"id":"b","input_ids":[9,8,7,6,5,4,3,2,1,0]}' >"$T/data.jsonl"
printf '%s\n' '{"id":"p","input_ids":[1,2,3]}' >"$T/prompts.jsonl"
check "extract the stream" dflash-extract -m "$T/target" --drafter-config "$T/drafter.json" -o "$T/s.dfs" "$T/data.jsonl"
check "a checkpoint" dflash-train-step --threads 1 --target "$T/target" --init "$T/drafter.json" --steps 1 \
    --total-steps 10 --out "$T/ck" "$T/s.dfs"
(cd "$T" && find target ck drafter.json data.jsonl prompts.jsonl s.dfs -type f -print0 | sort -z |
    xargs -0 md5sum) >"$T/before.md5"

# refused with exit 2, naming both options; $3 is a word the message must hold
refused() {
    local name=$1 word=$2
    shift 2
    expect_exit 2 "$name" "$@"
    grep -q -- "$word" "$T/.err" || fail "$name: message" "no '$word' in: $(head -c 300 "$T/.err")"
}
X="dflash-extract -m $T/target"
refused "extract -o the input" "is the input file" $X -l 1 -o "$T/data.jsonl" "$T/data.jsonl"
refused "extract -o the input by another name" "is the input file" $X -l 1 -o "$T/./data.jsonl" "$T/data.jsonl"
refused "extract -o --drafter-config" "is the --drafter-config file" \
    $X --drafter-config "$T/drafter.json" -o "$T/drafter.json" "$T/data.jsonl"
refused "extract -o the target's weights" "would replace a file of the --model directory" \
    $X -l 1 -o "$T/target/model.safetensors" "$T/data.jsonl"
refused "extract -o the target's config, through .." "would replace a file of the --model directory" \
    $X -l 1 -o "$T/target/../target/config.json" "$T/data.jsonl"

S="dflash-score --threads 1 --target $T/target --drafter $T/ck --prompts $T/prompts.jsonl --max-new-tokens 3"
refused "score --emit the prompts" "is the --prompts file" $S --emit "$T/prompts.jsonl"
refused "score --emit the drafter's weights" "would replace a file of the --drafter directory" \
    $S --emit "$T/ck/model.safetensors"
refused "score --emit the target's config" "would replace a file of the --target directory" \
    $S --emit "$T/target/config.json"

TS="dflash-train-step --threads 1 --target $T/target"
refused "train --log the input stream" "is the input file" \
    $TS --init "$T/drafter.json" --steps 1 --log "$T/s.dfs" --out "$T/x" "$T/s.dfs"
refused "train --log the --init config" "is the --init file" \
    $TS --init "$T/drafter.json" --steps 1 --log "$T/drafter.json" --out "$T/x" "$T/s.dfs"
refused "train --log the --out path" "is the --out directory" \
    $TS --init "$T/drafter.json" --steps 1 --log "$T/x" --out "$T/x" "$T/s.dfs"
refused "train --log inside the --out directory" "inside the --out directory" \
    $TS --resume "$T/ck" --steps 1 --log "$T/ck/train.log" --out "$T/ck" "$T/s.dfs"
refused "train --log a file of --resume" "would replace a file of the --resume directory" \
    $TS --resume "$T/ck" --steps 1 --log "$T/ck/trainer_state.json" --out "$T/ck2" "$T/s.dfs"
refused "train --log a file of --init-from" "would replace a file of the --init-from directory" \
    $TS --init-from "$T/ck" --steps 1 --log "$T/ck/config.json" --out "$T/ck2" "$T/s.dfs"
refused "train --log the target's weights" "would replace a file of the --target directory" \
    $TS --init "$T/drafter.json" --steps 1 --log "$T/target/model.safetensors" --out "$T/x" "$T/s.dfs"

(cd "$T" && md5sum --quiet -c before.md5) >"$T/md5.txt" 2>&1 && pass "every input intact" ||
    fail "every input intact" "$(head -c 300 "$T/md5.txt")"
[ ! -e "$T/x" ] && [ ! -e "$T/ck2" ] && [ -z "$(find "$T" -name '.*.tmp.*')" ] && pass "no output, no temporary" ||
    fail "no output, no temporary" "$(find "$T" -name '.*.tmp.*' -o -name x -o -name ck2)"

# allowed: a new file in the model's directory (as run from inside it), a
# log beside the checkpoint, --out over the checkpoint resumed
check "extract into a new file of the model directory" $X -l 1 -o "$T/target/new.dfs" "$T/data.jsonl"
check "  and from inside it" bash -c "cd '$T/target' && dflash-extract -m . -l 1 -o again.dfs ../data.jsonl"
check "train --resume in place, --log beside" $TS --resume "$T/ck" --steps 1 --loop --log "$T/train.log" \
    --out "$T/ck" "$T/s.dfs"
[ -s "$T/train.log" ] && pass "  the log written" || fail "  the log written"
