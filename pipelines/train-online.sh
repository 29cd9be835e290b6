#!/usr/bin/env bash
# train-online.sh: train a drafter with no hidden states on disk. Each epoch
# shuffles the samples, runs the target over them and pipes its hidden states
# straight into the trainer:
#
#   shuf samples.jsonl | dflash-extract ... | dflash-train-step --resume ckpt-e(N-1) ... --out ckpt-eN
#
# One pass through the pipe is one epoch; a checkpoint is written at the end
# of each (OUT/ckpt-e1, ckpt-e2, ...). Run it again after a crash: finished
# epochs are kept and training resumes from the last one. An epoch's
# checkpoint gets its name only when the epoch is whole: every tool of the
# pipe succeeded (a bad sample stops dflash-extract, exit 65, and the trainer
# would save what it had), and the trainer made at most ceil(samples /
# BATCH_SEQS) steps (one more: it stopped at --steps with samples unread;
# --batch-tokens makes steps smaller, leave it out). Otherwise the partial
# checkpoint is removed, the run exits non-zero naming the cause, and a re-run
# redoes the whole epoch. Training through the pipe gives the same checkpoint,
# bit for bit, as training from the extracted file.
#
# OUT keeps a signature of the settings its checkpoints were trained with
# (OUT/SIGNATURE, written before the first epoch: the target directory, its
# *.json files' checksums and its *.safetensors files' sizes and times, the
# samples file's path, size and time, the drafter config's checksum, the
# --init-from directory likewise, EPOCHS, BATCH_SEQS, SEED, every
# EXTRACT_OPTS and training option word, and the checksum of every file such
# a word names). A run whose signature differs from that of the checkpoints
# there is refused (exit 2, the difference shown, nothing touched) rather than
# resumed from them; so are checkpoints with no SIGNATURE (an older run): pick
# another --out, or remove them. DEVICE is not in it: a re-run may move to
# the CPU or another GPU (the checkpoints then differ by float rounding only).
#
#   pipelines/train-online.sh -m TARGET_DIR -c DRAFTER.json -o OUT_DIR [OPTIONS] SAMPLES.jsonl [-- TRAIN_OPTIONS]
#
# Options (each also an environment variable, given here in capitals):
#   -m, --model DIR        TARGET   the target model directory
#   -c, --drafter FILE     DRAFTER  drafter config (--init; its layer ids are tapped)
#       --init-from DIR    INIT_FROM  start from a released drafter instead
#   -o, --out DIR          OUT      where the per-epoch checkpoints go
#   -e, --epochs N         EPOCHS   (default 6, the paper's)
#   -d, --device DEV       DEVICE   cuda (default) or cpu, for both tools
#   -b, --batch-seqs N     BATCH_SEQS  sequences per step (default 32, SpecForge's
#                                   recipe: 4 per GPU on 8 GPUs); with the
#                                   sample count it sets the schedule's length
#   -s, --seed N           SEED     shuffle seed (epoch e uses SEED-e) and init seed
#       --extract-opts "OPTS"  EXTRACT_OPTS  more dflash-extract options, e.g. "-t 8"
#   after --: more dflash-train-step options, e.g. --lr 6e-4 --anchors 512 (or in
#                       TRAIN_OPTS, split at spaces)
# An option without its value, an unknown option or a bad number: exit 2. A
# path may hold spaces or begin with '-' (a samples file: ./-NAME).
# Tools are found on PATH, or in DFLASH_BIN when set; a run without
# dflash-extract or dflash-train-step stops at once, exit 69.
#
# Napkin math, Qwen3-8B (40 KiB of hidden states per token): 800K samples x
# 1,000 tokens would be 33 TB on disk; here the pipe holds a few records at a
# time. The price is a target forward per sample per epoch: ~13 GFLOP per
# token, 800M tokens x 6 epochs ~ 6e19 FLOP, ~2 GPU-days at 40% of an H200
# on top of the drafter's training (which is larger: ~250 H200-hours for the
# SpecForge's recipe). Extraction and training share the GPU, or use two
# (dflash-extract -d cuda:0 | dflash-train-step --device cuda:1).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; }
die() { echo "train-online.sh: $*" >&2; exit 2; }
unavailable() { echo "train-online.sh: $*" >&2; exit 69; }
need() { [ $# -ge 2 ] || die "$1 needs a value (try --help)"; }
int() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a whole number, not '$2'"; }
# A relative path that begins with '-' would read as an option to the tools: ./ before it.
dashpath() { case $1 in -*) printf './%s' "$1" ;; *) printf '%s' "$1" ;; esac; }

TARGET=${TARGET:-} DRAFTER=${DRAFTER:-} INIT_FROM=${INIT_FROM:-} OUT=${OUT:-} EPOCHS=${EPOCHS:-6}
DEVICE=${DEVICE:-cuda} BATCH_SEQS=${BATCH_SEQS:-32} SEED=${SEED:-0} TRAIN_OPTS=${TRAIN_OPTS:-}
EXTRACT_OPTS=${EXTRACT_OPTS:-}
SAMPLES="" TRAIN_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -m|--model) need "$@"; TARGET=$2; shift 2 ;;
        -c|--drafter) need "$@"; DRAFTER=$2; shift 2 ;;
        --init-from) need "$@"; INIT_FROM=$2; shift 2 ;;
        -o|--out) need "$@"; OUT=$2; shift 2 ;;
        -e|--epochs) need "$@"; EPOCHS=$2; shift 2 ;;
        -d|--device) need "$@"; DEVICE=$2; shift 2 ;;
        -b|--batch-seqs) need "$@"; BATCH_SEQS=$2; shift 2 ;;
        -s|--seed) need "$@"; SEED=$2; shift 2 ;;
        --extract-opts) need "$@"; EXTRACT_OPTS=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; TRAIN_ARGS=("$@"); break ;;
        -*) die "unknown option '$1' (try --help)" ;;
        *) [ -z "$SAMPLES" ] || die "one samples file, not '$SAMPLES' and '$1'"; SAMPLES=$1; shift ;;
    esac
done
[ -n "$TARGET" ] || die "--model DIR is required"
[ -n "$DRAFTER" ] || die "--drafter CONFIG.json is required (its layer ids are the ones tapped)"
[ -n "$OUT" ] || die "--out DIR is required"
[ -n "$SAMPLES" ] || die "a samples JSONL file is required"
int "--epochs (EPOCHS)" "$EPOCHS"; int "--batch-seqs (BATCH_SEQS)" "$BATCH_SEQS"; int "--seed (SEED)" "$SEED"
[ "$BATCH_SEQS" -ge 1 ] || die "--batch-seqs (BATCH_SEQS) must be at least 1"
TARGET=$(dashpath "$TARGET") DRAFTER=$(dashpath "$DRAFTER") INIT_FROM=$(dashpath "$INIT_FROM") OUT=$(dashpath "$OUT")
SAMPLES=$(dashpath "$SAMPLES")
[ -f "$SAMPLES" ] || { echo "train-online.sh: $SAMPLES: no such file" >&2; exit 66; }
[ -n "${DFLASH_BIN:-}" ] && export PATH="$DFLASH_BIN:$PATH"
for t in dflash-extract dflash-train-step; do
    command -v $t >/dev/null || unavailable "$t is not on PATH (set DFLASH_BIN); nothing trained"
done
mkdir -p "$OUT"

# The step count of checkpoint DIR (trainer_state.json, written by the tool
# with an indent of 2: "step" is the third key).
step_of() { sed -n 's/^  "step": \([0-9]*\),\{0,1\}$/\1/p' "$1/trainer_state.json" | head -n 1 | grep . || echo 0; }

# The schedule spans every epoch: ceil(samples / batch) steps each.
n=$(grep -c . "$SAMPLES" || true)
per_epoch=$(( (n + BATCH_SEQS - 1) / BATCH_SEQS ))
[ "$per_epoch" -ge 1 ] || die "$SAMPLES has no samples"
total=$(( per_epoch * EPOCHS ))

# The settings of the training, checked against those of the checkpoints in
# OUT (as extract-sharded.sh checks its pieces).
dirsig() {   # WHAT DIR: a model directory by its path, *.json checksums, weights' sizes and times
    local f
    echo "$1 $(realpath -m -- "$2")"
    for f in "$2"/*.json; do [ -f "$f" ] && echo "$1 json ${f##*/} $(cksum <"$f")"; done
    for f in "$2"/*.safetensors; do [ -f "$f" ] && echo "$1 weights ${f##*/} $(stat -L -c '%s %Y' -- "$f")"; done
    return 0
}
filesig() {   # WORD: the checksum of a file it names (as is, or after '=')
    local v=${1#*=}
    [ -f "$1" ] && echo "file $(cksum <"$1")"
    [ "$v" != "$1" ] && [ -f "$v" ] && echo "file $(cksum <"$v")"
    return 0
}
settings() {
    local w
    dirsig model "$TARGET"
    echo "samples $(realpath -m -- "$SAMPLES") $(stat -L -c '%s %Y' -- "$SAMPLES")"
    echo "drafter $(cksum <"$DRAFTER" 2>/dev/null || echo missing)"
    [ -z "$INIT_FROM" ] || dirsig init-from "$INIT_FROM"
    echo "epochs $EPOCHS"
    echo "batch-seqs $BATCH_SEQS"
    echo "seed $SEED"
    for w in ${xwords[@]+"${xwords[@]}"}; do echo "extract-opt $w"; filesig "$w"; done
    for w in ${twords[@]+"${twords[@]}"}; do echo "train-opt $w"; filesig "$w"; done
    return 0
}
read -ra xwords <<<"$EXTRACT_OPTS"
read -ra twords <<<"$TRAIN_OPTS"
twords+=(${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"})
sig=$(settings)
if [ -n "$(find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ckpt-e*' -print -quit)" ]; then
    if [ -f "$OUT/SIGNATURE" ]; then
        [ "$(cat "$OUT/SIGNATURE")" = "$sig" ] ||
            die "$OUT holds checkpoints trained with other settings (target, samples, drafter config, epochs, batch, seed, extract or train options); these differ: $(diff "$OUT/SIGNATURE" <(echo "$sig") | grep '^[<>]' | tr '\n' ' ')- remove them or pick another --out"
    else
        die "$OUT holds checkpoints with no record of their settings (SIGNATURE; an older run?); remove them or pick another --out"
    fi
else
    echo "$sig" >"$OUT/SIGNATURE"
fi

for ((e = 1; e <= EPOCHS; e++)); do
    ck="$OUT/ckpt-e$e"
    if [ -d "$ck" ]; then echo "epoch $e: done before ($ck)"; continue; fi
    prev_step=0
    if [ "$e" = 1 ]; then
        if [ -n "$INIT_FROM" ]; then start=(--init-from "$INIT_FROM"); else start=(--init "$DRAFTER"); fi
        start+=(--seed "$SEED")
    else
        start=(--resume "$OUT/ckpt-e$((e - 1))")
        prev_step=$(step_of "$OUT/ckpt-e$((e - 1))")
    fi
    echo "epoch $e of $EPOCHS: up to $per_epoch steps (schedule: $total) -> $ck"
    rm -f "$ck.log"   # a redone epoch logs afresh
    part="$OUT/.ckpt-e$e.partial"   # hidden (eval-sweep.sh skips it); renamed when the epoch is whole
    rm -rf "$part"
    # --steps per_epoch + 1: the pass ends with the input, the tool saves and exits 0
    # shellcheck disable=SC2086
    shuf --random-source=<(yes "$SEED-$e") "$SAMPLES" |
        dflash-extract -m "$TARGET" --drafter-config "$DRAFTER" --device "$DEVICE" $EXTRACT_OPTS |
        dflash-train-step --target "$TARGET" "${start[@]}" --steps $((per_epoch + 1)) --total-steps "$total" \
            --batch-seqs "$BATCH_SEQS" --device "$DEVICE" --log "$ck.log" $TRAIN_OPTS ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} --out "$part" &&
        st=(0 0 0) || st=("${PIPESTATUS[@]}")
    # Any tool failing fails the epoch; the cause is the first status that is
    # not a broken pipe (141: a tool whose reader had stopped).
    tools=(shuf dflash-extract dflash-train-step) why="" rc=0
    for i in 0 1 2; do
        [ "${st[$i]}" -eq 0 ] && continue
        why="$why${why:+, }${tools[$i]} exited ${st[$i]}"
        if [ "$rc" -eq 0 ] || { [ "$rc" -eq 141 ] && [ "${st[$i]}" -ne 141 ]; }; then rc=${st[$i]}; fi
    done
    # A full epoch takes at most per_epoch steps; a trainer that made
    # per_epoch + 1 stopped at --steps with samples left unread (a step took
    # fewer than BATCH_SEQS sequences: --batch-tokens?), which would drop them.
    made=0; [ -f "$part/trainer_state.json" ] && made=$(( $(step_of "$part") - prev_step ))
    if [ "$made" -gt "$per_epoch" ]; then
        rm -rf "$part"
        echo "train-online.sh: epoch $e failed: dflash-train-step made $made steps, more than the $per_epoch that $n samples take in steps of $BATCH_SEQS sequences, and stopped with samples left; no $ck (with --batch-tokens a step holds fewer sequences: leave it out)${why:+; $why}" >&2
        exit 1
    fi
    if [ "$rc" -ne 0 ]; then
        rm -rf "$part"
        echo "train-online.sh: epoch $e failed ($why): not all its samples were trained on, so no $ck; run again to redo epoch $e" >&2
        exit "$rc"
    fi
    mv -T "$part" "$ck"
done
echo "done: $OUT/ckpt-e$EPOCHS"
