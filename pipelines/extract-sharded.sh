#!/usr/bin/env bash
# extract-sharded.sh: hidden-state extraction fanned out over GPUs and hosts with
# GNU parallel, then merged (or re-sharded) with dflash-pack.
#
#   pipelines/extract-sharded.sh -m TARGET_DIR -o OUT.dfs [OPTIONS] SAMPLES.jsonl [-- EXTRACT_OPTIONS]
#
# The input is cut into SHARDS pieces by lines (split -n l/N: whole lines, about
# equal bytes, in order). Each piece is one GNU parallel job running
# dflash-extract on one GPU (CUDA_VISIBLE_DEVICES, --device cuda) or, with
# --device cpu, on THREADS cores. A piece's output gets its final name only
# when dflash-extract succeeded, so a re-run (after a crash, a Ctrl-C, a lost
# host) skips every finished piece and redoes only the rest. Then dflash-pack
# joins the pieces in input order into OUT: the same records, in the same
# order, as one dflash-extract over the whole file.
#
# WORKDIR keeps signatures of what its pieces were made from: the input and
# SHARDS (in/SIGNATURE), and the settings that shape the records
# (out/SIGNATURE: the model directory, its *.json files' checksums and its
# *.safetensors files' sizes and times, LAYERS, every EXTRACT_OPTS word, and
# the checksum of every file an EXTRACT_OPTS word names, e.g. the
# --drafter-config). A run whose signatures differ from those of the pieces
# there is refused (exit 2) rather than mixed with them: remove WORKDIR or
# pick another. DEVICE, JOBS and THREADS are not in it: a re-run may move to
# other GPUs or the CPU (the records then differ by float rounding only).
#
# Options (each also an environment variable, given here in capitals):
#   -m, --model DIR       MODEL   target model directory (Hugging Face layout)
#   -o, --output OUT      OUT     merged stream; with PACK_OPTS holding --split or
#                                 --shards, a pattern (data-%s.dfs, data-%03d.dfs)
#   -l, --layers IDS      LAYERS  layer ids to tap (default: dflash-extract's rule)
#   -d, --device DEV      DEVICE  cuda (default) or cpu
#   -j, --jobs N          JOBS    jobs at once per host = GPUs per host (default:
#                                 nvidia-smi -L | wc -l for cuda, 1 for cpu)
#   -n, --shards N        SHARDS  pieces of the input (default: 4 x JOBS; more
#                                 pieces = finer re-runs and better balance)
#   -t, --threads N       THREADS CPU threads per job with --device cpu
#                                 (default: cores / JOBS)
#   -w, --workdir DIR     WORKDIR pieces, per-piece streams, joblog
#                                 (default: OUT's directory/OUT-name.work)
#   -S, --sshloginfile F  SSHLOGINFILE  run on the hosts of F (GNU parallel's
#                                 format, e.g. "8/gpu-node-01"; ":" is this host)
#   --pack-opts "OPTS"    PACK_OPTS options of the final dflash-pack, e.g.
#                                 "--shuffle --seed 1 --split train=0.99,val=0.01"
#   after --: options passed to every dflash-extract, e.g. --byte-shuffle on
#                                 --with target-ids (or in EXTRACT_OPTS, split
#                                 at spaces)
# An option without its value, an unknown option or a bad number: exit 2. A
# path may hold spaces or begin with '-' (the input file: ./-NAME).
# Tools are found on PATH, or in DFLASH_BIN when set; a run without
# dflash-extract, dflash-pack or GNU parallel (or flock, for -d cuda) stops at
# once, exit 69.
#
# Several hosts: WORKDIR, the input, the model directory and the dflash tools
# must be at the same paths on every host (a shared filesystem), and bash,
# flock and GNU parallel installed there. On each host a job takes the first
# GPU whose lock file (${TMPDIR:-/tmp}/dflash-gpu-N.lock) it can flock, so the
# JOBS jobs of a host never share a GPU, whatever parallel's slot numbers are.
#
# Napkin math (bf16 hidden states; K taps of width H, 2 bytes each):
#   bytes per token = K * H * 2: Qwen3-8B / Llama-3.1-8B (H 4096, K 5) 40 KiB,
#   Qwen3-4B (H 2560) 25 KiB, Qwen3-0.6B (H 1024) 10 KiB. Per million tokens:
#   41 GB, 26 GB, 10 GB. --byte-shuffle on (byte shuffle + LZ4) stores about 0.85
#   to 0.9 of that (see README: "A real run"); plain LZ4 gains nothing on bf16.
#   800K samples x 1,000 tokens on Qwen3-8B = 33 TB raw: use --shards and
#   train from the pieces, or train online (dflash-extract | dflash-train-step).
#   Rate: the best public capture is ~27,000 tokens/s per H200 for Qwen3-8B,
#   i.e. ~1.1 GB/s of output per GPU: one NVMe drive per one or two GPUs.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; }
die() { echo "extract-sharded.sh: $*" >&2; exit 2; }
unavailable() { echo "extract-sharded.sh: $*" >&2; exit 69; }
need() { [ $# -ge 2 ] || die "$1 needs a value (try --help)"; }
int() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a whole number, not '$2'"; }
# A relative path that begins with '-' would read as an option to the tools: ./ before it.
dashpath() { case $1 in -*) printf './%s' "$1" ;; *) printf '%s' "$1" ;; esac; }

MODEL=${MODEL:-} OUT=${OUT:-} LAYERS=${LAYERS:-} DEVICE=${DEVICE:-cuda} JOBS=${JOBS:-}
SHARDS=${SHARDS:-} THREADS=${THREADS:-} WORKDIR=${WORKDIR:-} SSHLOGINFILE=${SSHLOGINFILE:-}
PACK_OPTS=${PACK_OPTS:-} EXTRACT_OPTS=${EXTRACT_OPTS:-}
INPUT="" XARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -m|--model) need "$@"; MODEL=$2; shift 2 ;;
        -o|--output) need "$@"; OUT=$2; shift 2 ;;
        -l|--layers) need "$@"; LAYERS=$2; shift 2 ;;
        -d|--device) need "$@"; DEVICE=$2; shift 2 ;;
        -j|--jobs) need "$@"; JOBS=$2; shift 2 ;;
        -n|--shards) need "$@"; SHARDS=$2; shift 2 ;;
        -t|--threads) need "$@"; THREADS=$2; shift 2 ;;
        -w|--workdir) need "$@"; WORKDIR=$2; shift 2 ;;
        -S|--sshloginfile) need "$@"; SSHLOGINFILE=$2; shift 2 ;;
        --pack-opts) need "$@"; PACK_OPTS=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; XARGS=("$@"); break ;;
        -*) die "unknown option '$1' (try --help)" ;;
        *) [ -z "$INPUT" ] || die "one input file, not '$INPUT' and '$1'"; INPUT=$1; shift ;;
    esac
done
[ -n "$MODEL" ] || die "--model DIR is required"
[ -n "$OUT" ] || die "--output OUT is required"
[ -n "$INPUT" ] || die "an input JSONL file is required"
[ -z "$JOBS" ] || { int "--jobs (JOBS)" "$JOBS"; [ "$JOBS" -ge 1 ] || die "--jobs (JOBS) must be at least 1"; }
[ -z "$SHARDS" ] || int "--shards (SHARDS)" "$SHARDS"
[ -z "$THREADS" ] || int "--threads (THREADS)" "$THREADS"
MODEL=$(dashpath "$MODEL") OUT=$(dashpath "$OUT") INPUT=$(dashpath "$INPUT") WORKDIR=$(dashpath "$WORKDIR")
SSHLOGINFILE=$(dashpath "$SSHLOGINFILE")
# The extract options as words: EXTRACT_OPTS split at spaces, then those after
# -- as given; passed to the jobs shell-quoted.
read -ra words <<<"$EXTRACT_OPTS"
words+=(${XARGS[@]+"${XARGS[@]}"})
EXTRACT_OPTS=""
[ ${#words[@]} -eq 0 ] || printf -v EXTRACT_OPTS '%q ' "${words[@]}"
[ -f "$INPUT" ] || { echo "extract-sharded.sh: $INPUT: not a regular file" >&2; exit 66; }
case "$DEVICE" in cpu|cuda) ;; *) die "--device is cpu or cuda, not '$DEVICE'" ;; esac
[ -d "$MODEL" ] || { echo "extract-sharded.sh: $MODEL: no such directory" >&2; exit 66; }
MODEL=$(realpath "$MODEL")   # jobs may run elsewhere (ssh): absolute paths only
if [ -n "${DFLASH_BIN:-}" ]; then DFLASH_BIN=$(realpath "$DFLASH_BIN"); export PATH="$DFLASH_BIN:$PATH"; fi
for t in dflash-extract dflash-pack; do
    command -v $t >/dev/null || unavailable "$t is not on PATH (set DFLASH_BIN); nothing extracted"
done
for t in parallel $([ "$DEVICE" = cuda ] && echo flock); do
    command -v $t >/dev/null || unavailable "$t is not installed (make deps); nothing extracted"
done

if [ -z "$JOBS" ]; then
    if [ "$DEVICE" = cuda ]; then JOBS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); else JOBS=1; fi
    [ "$JOBS" -ge 1 ] 2>/dev/null || JOBS=1
fi
SHARDS=${SHARDS:-$((4 * JOBS))}
[ "$SHARDS" -ge 1 ] 2>/dev/null || die "--shards must be a positive integer"
[ -n "$THREADS" ] || THREADS=$(( $(nproc) / JOBS )); [ "$THREADS" -ge 1 ] || THREADS=1
base=$(basename "$OUT" .dfs)
WORKDIR=${WORKDIR:-$(dirname "$OUT")/${base//%/}.work}
mkdir -p "$WORKDIR/in" "$WORKDIR/out"
WORKDIR=$(cd "$WORKDIR" && pwd)

# 1. Cut the input into pieces, once. The signature file says which input and
# how many pieces; a changed input or count is refused instead of mixed.
sig="$(realpath "$INPUT") $(stat -c '%s %Y' "$INPUT") shards=$SHARDS"
if [ -f "$WORKDIR/in/SIGNATURE" ]; then
    [ "$(cat "$WORKDIR/in/SIGNATURE")" = "$sig" ] ||
        die "$WORKDIR holds pieces of another input or count ($(cat "$WORKDIR/in/SIGNATURE")); remove it or pick another --workdir"
else
    rm -f "$WORKDIR"/in/piece-*
    split -n "l/$SHARDS" -d -a 4 --additional-suffix=.jsonl "$INPUT" "$WORKDIR/in/piece-"
    echo "$sig" >"$WORKDIR/in/SIGNATURE"
fi

# The settings of the extraction, checked against those of the pieces there.
settings() {
    local w v f
    echo "model $MODEL"
    for f in "$MODEL"/*.json; do [ -f "$f" ] && echo "json ${f##*/} $(cksum <"$f")"; done
    for f in "$MODEL"/*.safetensors; do [ -f "$f" ] && echo "weights ${f##*/} $(stat -L -c '%s %Y' -- "$f")"; done
    echo "layers $LAYERS"
    for w in ${words[@]+"${words[@]}"}; do
        echo "opt $w"
        v=${w#*=}
        [ -f "$w" ] && echo "file $(cksum <"$w")"
        [ "$v" != "$w" ] && [ -f "$v" ] && echo "file $(cksum <"$v")"
    done
    return 0
}
osig=$(settings)
if [ -f "$WORKDIR/out/SIGNATURE" ]; then
    [ "$(cat "$WORKDIR/out/SIGNATURE")" = "$osig" ] ||
        die "$WORKDIR holds pieces extracted with other settings (model, layers or extract options); these differ: $(diff "$WORKDIR/out/SIGNATURE" <(echo "$osig") | grep '^[<>]' | tr '\n' ' ')- remove it or pick another --workdir"
elif [ -n "$(find "$WORKDIR/out" -name 'piece-*.dfs' -print -quit)" ]; then
    die "$WORKDIR/out holds pieces with no record of their settings (out/SIGNATURE); remove them or pick another --workdir"
else
    echo "$osig" >"$WORKDIR/out/SIGNATURE"
fi

# 2. One job per piece. Runs in a fresh bash on its host (local or ssh), so it
# gets everything through exported variables and this exported function.
extract_piece() {
    local piece=$1 name out
    name=$(basename "$piece" .jsonl)
    out="$DFL_WORKDIR/out/$name.dfs"
    [ -e "$out" ] && { echo "$name: done before, skipped"; return 0; }
    [ -n "$DFL_BIN" ] && PATH="$DFL_BIN:$PATH"
    eval "local -a xo=($DFL_EXTRACT_OPTS)"   # shell-quoted words
    local -a cmd=(dflash-extract -m "$DFL_MODEL" -o "$out.part" ${xo[@]+"${xo[@]}"})
    [ -n "$DFL_LAYERS" ] && cmd+=(-l "$DFL_LAYERS")
    if [ "$DFL_DEVICE" = cpu ]; then
        "${cmd[@]}" --device cpu --threads "$DFL_THREADS" "$piece" || return
    else
        # Take the first free GPU of this host; the lock is held until the job ends.
        local g
        for ((g = 0; g < DFL_JOBS; g++)); do
            exec 9>"${TMPDIR:-/tmp}/dflash-gpu-$g.lock"
            if flock -n 9; then
                CUDA_VISIBLE_DEVICES=$g "${cmd[@]}" --device cuda "$piece" || return
                break
            fi
            exec 9>&-
        done
        [ "$g" -lt "$DFL_JOBS" ] || { echo "$name: no free GPU among $DFL_JOBS" >&2; return 75; }
    fi
    mv -f "$out.part" "$out"   # the final name only for a complete, successful piece
    echo "$name: extracted"
}
export -f extract_piece
export DFL_WORKDIR="$WORKDIR" DFL_MODEL="$MODEL" DFL_LAYERS="$LAYERS" DFL_DEVICE="$DEVICE" \
       DFL_JOBS="$JOBS" DFL_THREADS="$THREADS" DFL_EXTRACT_OPTS="$EXTRACT_OPTS" DFL_BIN="${DFLASH_BIN:-}"
par=(parallel --jobs "$JOBS" --joblog "+$WORKDIR/joblog" --line-buffer --halt never)
[ -n "$SSHLOGINFILE" ] && par+=(--sshloginfile "$SSHLOGINFILE")
for v in extract_piece DFL_WORKDIR DFL_MODEL DFL_LAYERS DFL_DEVICE DFL_JOBS DFL_THREADS DFL_EXTRACT_OPTS DFL_BIN; do
    par+=(--env "$v")
done
pieces=("$WORKDIR"/in/piece-*.jsonl)
rc=0
printf '%s\n' "${pieces[@]}" | "${par[@]}" extract_piece {} || rc=$?
done_count=$(find "$WORKDIR/out" -name 'piece-*.dfs' | wc -l)
if [ "$rc" -ne 0 ] || [ "$done_count" -ne "${#pieces[@]}" ]; then
    echo "extract-sharded.sh: $done_count of ${#pieces[@]} pieces done; see $WORKDIR/joblog, then run again to finish" >&2
    exit 1
fi

# 3. Join the pieces in input order (or shuffle/split/shard them: PACK_OPTS).
# A stamp in WORKDIR records the dflash-pack command; it is redone only when
# that command changed, a piece is newer than the stamp, or OUT is missing.
outs=("$WORKDIR"/out/piece-*.dfs)
stamp="$WORKDIR/packed"
want="dflash-pack $PACK_OPTS -o $OUT"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -z "$(find "${outs[@]}" -newer "$stamp")" ] &&
   { [[ "$OUT" == *%* ]] || [ -e "$OUT" ]; }; then
    echo "$OUT: up to date"
else
    rm -f "$stamp"
    # shellcheck disable=SC2086
    dflash-pack $PACK_OPTS -o "$OUT" "${outs[@]}"
    echo "$want" >"$stamp"
    echo "$OUT: ${#outs[@]} pieces joined"
fi
