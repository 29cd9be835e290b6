#!/usr/bin/env bash
# tests/gpu/score_trained.sh: the online scoring benchmark, speculative loop
# against plain greedy decoding of the same target, with an untrained drafter
# (tau near 1: the loop's cost per cycle) and with one trained here for a few
# hundred steps on the target's own greedy continuations (the recipe of
# pipelines/demo.sh: tau well above 1, so the loop's speed-up shows).
# Called by tests/gpu/run.sh; every step runs on --device $DEV.
#
#   SHAPE=gpu   a Qwen3-0.6B-shaped target cut to 8 layers (vocabulary
#               151936, hidden 1024), a 1-layer drafter reading layers 1,3,5
#   SHAPE=tiny  the demo's target (vocabulary 128, hidden 64), 2-layer drafter:
#               a CPU run of this script (DFLASH_GPU_DRYRUN)
#
# Variables: BIN, BUILD (bin/ and the build with tests/mktarget), DEV (cuda or
# cpu), SHAPE, TARGET (a target of that shape to use, or where to make it;
# TARGET_ONLY=1 makes it and stops);
# to shrink a run: STEPS (training steps, 300), N_TRAIN (training prompts),
# NEW (tokens generated for each), N_EVAL, EVAL_NEW (the same for scoring).
# Prints its work, then one "RESULT|step|result|detail"
# line per measurement for the report; exits non-zero when a tool fails.
set -u
cd "$(dirname "$0")/../.."
. tests/models.sh
export PATH="$BIN:$PATH"
DEV=${DEV:-cuda}
SHAPE=${SHAPE:-gpu}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
result() { echo "RESULT|$1|$2|$3"; }
run() { echo "\$ $*" >&2; "$@"; }

case $SHAPE in
gpu)
    TARGET_ARGS=(--vocab 151936 --hidden 1024 --intermediate 3072 --layers 8 --heads 16 --kv-heads 8 --head-dim 128 --tie yes)
    DRAFTER=(hidden=1024 inter=3072 layers=1 heads=16 kv_heads=8 head_dim=128 vocab=151936)
    LAYERS="1, 3, 5" NLAYERS=8 MASK=151669 PROMPT_VOCAB=151000
    n_train=64 n_eval=8 new=128 eval_new=256 LR=3e-3
    ;;
tiny)
    TARGET_ARGS=(--vocab 128 --hidden 64 --intermediate 128 --layers 4 --heads 4 --kv-heads 2 --tie no --seed 7)
    DRAFTER=(hidden=64 inter=128 layers=2 heads=4 kv_heads=2 head_dim=16 vocab=128)
    LAYERS="0, 2" NLAYERS=4 MASK=127 PROMPT_VOCAB=128
    n_train=128 n_eval=8 new=96 eval_new=96 LR=2e-2
    ;;
*) echo "score_trained.sh: SHAPE must be gpu or tiny" >&2; exit 2 ;;
esac
STEPS=${STEPS:-300} N_TRAIN=${N_TRAIN:-$n_train} N_EVAL=${N_EVAL:-$n_eval} NEW=${NEW:-$new} EVAL_NEW=${EVAL_NEW:-$eval_new}
D=(--device "$DEV")

# the target: made here unless TARGET names one; a TARGET that does not exist
# yet is made there and kept (run.sh's end-to-end extraction makes it so,
# with TARGET_ONLY=1: the shape is written only in this file)
[ -n "${TARGET:-}" ] || TARGET=$T/target
if [ ! -f "$TARGET/config.json" ]; then
    mkdir -p "$(dirname "$TARGET")"
    run "$BUILD/tests/mktarget" -o "$TARGET" "${TARGET_ARGS[@]}" >/dev/null || exit 1
fi
[ "${TARGET_ONLY:-0}" = 1 ] && exit 0
drafter_config "$T/drafter.json" block=16 target_layers=$NLAYERS mask=$MASK taps="$LAYERS" theta=1000000.0 "${DRAFTER[@]}"
python3 - "$T" "$N_TRAIN" "$N_EVAL" "$PROMPT_VOCAB" <<'PY'
import json, random, sys
d, n_train, n_eval, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
r = random.Random(3)
for name, n in (("train", n_train), ("eval", n_eval)):
    with open(f"{d}/prompts-{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{name}{i}", "input_ids": [r.randrange(vocab) for _ in range(16)]}) + "\n")
PY

# tsv FILE ROW COLUMN: a value of dflash-score's TSV output
tsv() { awk -F'\t' -v c="$3" -v r="$2" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i } NR == r + 1 { print $k }' "$1"; }
row_of() { # LABEL FILE ROW: a report row of one drafter's online run
    result "$1" "$(tsv "$2" "$3" tokens_per_s) tok/s" \
        "plain greedy $(tsv "$2" "$3" greedy_tokens_per_s) tok/s; tau $(tsv "$2" "$3" tau_pooled); speed-up $(tsv "$2" "$3" speedup); mismatches $(tsv "$2" "$3" mismatches)"
}

# The untrained drafter (0 steps), and with it the training responses: the
# target's greedy continuations (any drafter gives the same greedy output).
run dflash-train-step --target "$TARGET" --init "$T/drafter.json" --steps 0 --out "$T/ckpt-0" || exit 1
run dflash-score "${D[@]}" --target "$TARGET" --drafter "$T/ckpt-0" --prompts "$T/prompts-train.jsonl" \
    --max-new-tokens "$NEW" --ignore-eos --emit "$T/gen.emit" >"$T/gen.tsv" || exit 1
python3 - "$T" <<'PY'
import json, sys
d = sys.argv[1]
prompts = {}
for line in open(f"{d}/prompts-train.jsonl"):
    p = json.loads(line)
    prompts[p["id"]] = p["input_ids"]
with open(f"{d}/samples.jsonl", "w") as f:
    for line in open(f"{d}/gen.emit"):
        e = json.loads(line)
        p, g = prompts[e["id"]], e["greedy_ids"]
        f.write(json.dumps({"id": e["id"], "input_ids": p + g, "loss_mask": [0] * len(p) + [1] * len(g)}) + "\n")
PY
run dflash-extract "${D[@]}" -m "$TARGET" --drafter-config "$T/drafter.json" -o "$T/samples.dfs" "$T/samples.jsonl" || exit 1
t0=$(date +%s.%N)
run dflash-train-step "${D[@]}" --target "$TARGET" --init "$T/drafter.json" --steps "$STEPS" --loop --lr "$LR" \
    --anchors 16 --batch-seqs 8 --log "$T/train.log" --out "$T/ckpt-$STEPS" "$T/samples.dfs" || exit 1
t1=$(date +%s.%N)
first=$(head -n 1 "$T/train.log" | jq -r .loss) last=$(tail -n 1 "$T/train.log" | jq -r .loss)
result "dflash-train-step $DEV: $STEPS steps on the target's greedy continuations" \
    "$(awk -v a="$t0" -v b="$t1" -v n="$STEPS" 'BEGIN {printf "%.1f steps/s", n / (b - a)}')" \
    "whole tool incl. load; loss $first -> $last; $N_TRAIN samples of 16 + $NEW tokens, 8 per step, 16 anchors each"

run dflash-score "${D[@]}" --target "$TARGET" --drafter "$T/ckpt-0" --drafter "$T/ckpt-$STEPS" \
    --prompts "$T/prompts-eval.jsonl" --max-new-tokens "$EVAL_NEW" --ignore-eos >"$T/eval.tsv" || exit 1
cat "$T/eval.tsv"
row_of "dflash-score $DEV online, untrained drafter ($N_EVAL prompts x $EVAL_NEW tokens)" "$T/eval.tsv" 1
row_of "dflash-score $DEV online, drafter after $STEPS steps" "$T/eval.tsv" 2
# The trained drafter on N_EVAL of its own training prompts: on this random
# target nothing generalises to unseen prompts (tau stays 1 above), but the
# continuations it was trained on it drafts well, so the loop's speed-up at
# tau > 1 shows (the first H200 run scored unseen prompts only). The
# training continuations were NEW tokens long: scoring goes that far.
head -n "$N_EVAL" "$T/prompts-train.jsonl" >"$T/prompts-seen.jsonl"
run dflash-score "${D[@]}" --target "$TARGET" --drafter "$T/ckpt-$STEPS" --prompts "$T/prompts-seen.jsonl" \
    --max-new-tokens "$NEW" --ignore-eos >"$T/seen.tsv" || exit 1
cat "$T/seen.tsv"
row_of "dflash-score $DEV online, drafter after $STEPS steps, on $N_EVAL of its training prompts ($NEW tokens)" \
    "$T/seen.tsv" 1
