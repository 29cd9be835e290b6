#!/usr/bin/env bash
# eval-sweep.sh: score every checkpoint of a training run that is not scored
# yet, append one TSV line per checkpoint, and plot tau and loss against step.
# Made for cron: runs that overlap take turns on a lock, a re-run adds nothing
# for checkpoints already scored, and output goes to files, not a terminal.
#
#   pipelines/eval-sweep.sh --target TARGET_DIR --val VAL.dfs --dir RUN_DIR [OPTIONS] [-- SCORE_OPTIONS]
#   pipelines/eval-sweep.sh --target TARGET_DIR --prompts P.jsonl --dir RUN_DIR [OPTIONS]
#
# A checkpoint is a directory under RUN_DIR holding model.safetensors and a
# config.json with dflash_config (dflash-train-step renames it into place only when
# complete; hidden .NAME.tmp.* directories are skipped). The new ones are scored
# in one dflash-score call (offline on VAL, or online with speculative decoding
# on PROMPTS), sorted by step, and their lines appended to TSV: the header once,
# then one line per checkpoint, its path absolute (that is how a later run
# knows it was scored). The TSV is replaced atomically (written beside, renamed).
# Then gnuplot renders PNG: tau_pooled against step, and loss (offline) on a
# second axis.
#
# Options (each also an environment variable, given here in capitals):
#   --target DIR        TARGET     the target model directory
#   --val FILE          VAL        offline: the validation stream (dflash-pack --split)
#   --prompts FILE      PROMPTS    online instead: tokenized prompts (JSONL input_ids)
#   --max-new-tokens N  MAX_NEW    online: tokens per prompt (default 256)
#   --dir DIR           CKPT_DIR   where the checkpoints appear (default .)
#   --tsv FILE          TSV        the scores (default CKPT_DIR/scores.tsv)
#   --png FILE          PNG        the plot (default: TSV with .png; "" for none)
#   --lock FILE         LOCK       the lock (default: TSV with .lock)
#   --wait SECONDS      WAIT       wait this long for the lock (default 0: if another
#                                  sweep runs, exit 0 at once and let it work)
#   after --: options for dflash-score, e.g. --device cuda --anchors 64 (or in
#                       SCORE_OPTS, split at spaces)
# An option without its value, an unknown option or a bad number: exit 2. A
# path may hold spaces or begin with '-'.
# Tools are found on PATH, or in DFLASH_BIN when set. Needs flock and jq (a
# run without them stops at once, exit 69); gnuplot only for the plot.
#
# A checkpoint dflash-score cannot score (a broken file) does not hold up the
# others: when the one call fails, each new checkpoint is scored alone, the
# good ones are appended, the bad ones are named on stderr, and the run exits
# 1 (a later run tries them again). A call that exits 0 counts only when it
# wrote exactly one line per checkpoint given; otherwise it failed too, and a
# checkpoint left without its line is named (no line) the same way. A
# directory with weights whose config.json is not readable JSON is named and
# counted the same way. Exit 0:
# every new checkpoint was scored (or none was new, or another sweep held the
# lock).
#
# Cron, every 30 minutes (crontab -e):
#   */30 * * * * cd /data/run1 && /opt/dflash/pipelines/eval-sweep.sh --target /models/Qwen3-8B --val val.dfs --dir . -- --device cuda >>sweep.log 2>&1
#
# Napkin math: offline scoring reads VAL once per call (all new checkpoints in
# one pass, on the same anchors): a 1% split of 800K samples x 1,000 tokens of
# Qwen3-8B is 8M tokens = 330 GB at 40 KiB/token; score on a few thousand
# records instead (dflash-pack --split val=0.001 or --anchors). Online scoring
# costs a target forward per verify step, ~max_new_tokens/tau per prompt.
# Expected tau for a Qwen3-8B drafter at temperature 0: ~1.5 early, 3-4 after
# the first epoch in reproductions, 6.5 (GSM8K) / 4.3 (MT-Bench) for the
# released checkpoint (dflash-spec.md 4.3).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'; }
die() { echo "eval-sweep.sh: $*" >&2; exit 2; }
need() { [ $# -ge 2 ] || die "$1 needs a value (try --help)"; }
int() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a whole number, not '$2'"; }
# A relative path that begins with '-' would read as an option to the tools: ./ before it.
dashpath() { case $1 in -*) printf './%s' "$1" ;; *) printf '%s' "$1" ;; esac; }
unavailable() { echo "eval-sweep.sh: $*" >&2; exit 69; }

TARGET=${TARGET:-} VAL=${VAL:-} PROMPTS=${PROMPTS:-} MAX_NEW=${MAX_NEW:-256} CKPT_DIR=${CKPT_DIR:-.}
TSV=${TSV:-} PNG=${PNG-unset} LOCK=${LOCK:-} WAIT=${WAIT:-0} SCORE_OPTS=${SCORE_OPTS:-}
SCORE_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --target) need "$@"; TARGET=$2; shift 2 ;;
        --val) need "$@"; VAL=$2; shift 2 ;;
        --prompts) need "$@"; PROMPTS=$2; shift 2 ;;
        --max-new-tokens) need "$@"; MAX_NEW=$2; shift 2 ;;
        --dir) need "$@"; CKPT_DIR=$2; shift 2 ;;
        --tsv) need "$@"; TSV=$2; shift 2 ;;
        --png) need "$@"; PNG=$2; shift 2 ;;
        --lock) need "$@"; LOCK=$2; shift 2 ;;
        --wait) need "$@"; WAIT=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; SCORE_ARGS=("$@"); break ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done
[ -n "$TARGET" ] || die "--target DIR is required"
[ -n "$VAL" ] || [ -n "$PROMPTS" ] || die "--val STREAM or --prompts FILE is required"
[ -z "$VAL" ] || [ -z "$PROMPTS" ] || die "--val and --prompts exclude each other (one TSV per kind of score)"
int "--max-new-tokens (MAX_NEW)" "$MAX_NEW"
[[ $WAIT =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--wait (WAIT) must be a number of seconds, not '$WAIT'"
TARGET=$(dashpath "$TARGET") VAL=$(dashpath "$VAL") PROMPTS=$(dashpath "$PROMPTS") CKPT_DIR=$(dashpath "$CKPT_DIR")
TSV=$(dashpath "$TSV") LOCK=$(dashpath "$LOCK")
[ "$PNG" = unset ] || PNG=$(dashpath "$PNG")
[ -d "$CKPT_DIR" ] || { echo "eval-sweep.sh: $CKPT_DIR: no such directory" >&2; exit 66; }
[ -n "${DFLASH_BIN:-}" ] && export PATH="$DFLASH_BIN:$PATH"
command -v dflash-score >/dev/null || unavailable "dflash-score is not on PATH (set DFLASH_BIN)"
for t in flock jq; do
    command -v "$t" >/dev/null || unavailable "$t is not installed (make deps); nothing scored"
done
TSV=${TSV:-$CKPT_DIR/scores.tsv}
[ "$PNG" = unset ] && PNG=${TSV%.tsv}.png
LOCK=${LOCK:-${TSV%.tsv}.lock}

# One sweep at a time. The lock is held until this script exits.
exec 9>>"$LOCK"
rc=0; flock -w "$WAIT" 9 || rc=$?
if [ "$rc" -eq 1 ]; then
    echo "eval-sweep.sh: another sweep holds $LOCK; leaving the work to it"
    exit 0
elif [ "$rc" -ne 0 ]; then
    echo "eval-sweep.sh: flock $LOCK failed (exit $rc); nothing scored" >&2
    exit 1
fi

# Column NAME of a TSV header line, 1-based (0 if absent).
col_of() { awk -F'\t' -v c="$1" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) { print i; exit } print 0 }' "$2"; }

# The checkpoints: complete directories, by step (trainer_state.json), else by name.
scored=""
if [ -s "$TSV" ]; then
    dcol=$(col_of drafter "$TSV")
    [ "$dcol" -gt 0 ] || { echo "eval-sweep.sh: $TSV: no 'drafter' column in the header" >&2; exit 65; }
    # each entry canonical; a relative one taken from the TSV's directory and from here
    tsvdir=$(dirname "$TSV")
    scored=$(tail -n +2 "$TSV" | cut -f "$dcol" | while IFS= read -r p; do
        case "$p" in
            /*) realpath -m "$p" ;;
            *) realpath -m "$tsvdir/$p"; realpath -m "$p" ;;
        esac
    done)
fi
new=() bad=()
while IFS=$'\t' read -r step dir; do
    grep -qxF -- "$dir" <<<"$scored" && continue
    if [ "$step" = bad ]; then
        bad+=("$dir"); echo "eval-sweep.sh: $dir: weights but no readable config.json; not scored" >&2
    else
        new+=("$dir")
    fi
done < <(
    find "$CKPT_DIR" -mindepth 1 -maxdepth 1 -type d ! -name '.*' | while IFS= read -r d; do
        [ -f "$d/model.safetensors" ] || continue
        # jq -e: 0 a drafter, 1 another model (skipped), else unreadable (reported)
        jrc=0; jq -e 'has("dflash_config")' "$d/config.json" >/dev/null 2>&1 || jrc=$?
        if [ "$jrc" -eq 1 ]; then continue; elif [ "$jrc" -ne 0 ]; then printf 'bad\t%s\n' "$(realpath "$d")"; continue; fi
        step=$(jq -r '.step // empty' "$d/trainer_state.json" 2>/dev/null || true)
        printf '%s\t%s\n' "${step:-0}" "$(realpath "$d")"
    done | sort -t$'\t' -k1,1n -k2,2V)

# Score DRAFTER... into FILE (stdout of dflash-score), 0 on success: dflash-score
# exited 0 and FILE holds its header, then exactly one line per DRAFTER. When it
# exited 0 but the lines do not match, unlined names the DRAFTERs without
# exactly one line (or says how many lines are for none of them).
unlined=""
score() {
    local out=$1; shift
    local -a a=(--target "$TARGET")
    local d; for d in "$@"; do a+=(--drafter "$d"); done
    if [ -n "$VAL" ]; then a+=("$VAL"); else a+=(--prompts "$PROMPTS" --max-new-tokens "$MAX_NEW"); fi
    # shellcheck disable=SC2086
    dflash-score $SCORE_OPTS ${SCORE_ARGS[@]+"${SCORE_ARGS[@]}"} "${a[@]}" >"$out" || return
    unlined=$(printf '%s\n' "$@" | awk -F'\t' -v n=$# '
        FILENAME == ARGV[1] { if (FNR == 1) { for (i = 1; i <= NF; i++) if ($i == "drafter") c = i }
                              else { lines++; if (c) seen[$c]++ }
                              next }
        { if (seen[$0] == 1) ok++; else print }
        END { if (ok == n && lines != n) print "(" lines - n " line(s) for no checkpoint given)" }' "$out" -)
    [ -z "$unlined" ] || return 3
}

if [ ${#new[@]} -eq 0 ]; then
    echo "eval-sweep.sh: nothing new to score in $CKPT_DIR"
else
    echo "eval-sweep.sh: scoring ${#new[@]} checkpoint(s): ${new[*]##*/}"
    tmp=$(mktemp "$TSV.XXXXXX")
    trap 'rm -f "$tmp" "$tmp.all" "$tmp.one"' EXIT
    if ! score "$tmp" "${new[@]}"; then
        # One call failed, or exited 0 without a line for each checkpoint:
        # score each alone, keep the good ones (in step order).
        [ -z "$unlined" ] || echo "eval-sweep.sh: dflash-score exited 0 but wrote no line (or more than one) for: $(tr '\n' ' ' <<<"$unlined")- scoring each alone" >&2
        : >"$tmp"
        for d in "${new[@]}"; do
            if [ ${#new[@]} -gt 1 ]; then
                unlined=""
                if score "$tmp.one" "$d"; then
                    if [ -s "$tmp" ]; then tail -n +2 "$tmp.one" >>"$tmp"; else cat "$tmp.one" >"$tmp"; fi
                    continue
                fi
            fi
            bad+=("$d")
            if [ -n "$unlined" ]; then
                echo "eval-sweep.sh: $d: dflash-score exited 0 but wrote no line for it (or more than one); not scored" >&2
            else
                echo "eval-sweep.sh: $d: dflash-score failed on it; not scored" >&2
            fi
        done
    fi
    # old lines + the new ones without their header, renamed into place
    if [ -s "$tmp" ]; then
        if [ -s "$TSV" ]; then { cat "$TSV"; tail -n +2 "$tmp"; } >"$tmp.all"; else cp "$tmp" "$tmp.all"; fi
        mv "$tmp.all" "$TSV"
    fi
fi

# The plot: tau (and loss, offline) against step, from the columns by name.
# Without gnuplot, no plot, but the run goes on to its exit status.
plot_scores() {
    command -v gnuplot >/dev/null || { echo "eval-sweep.sh: gnuplot is not installed (make deps); no plot" >&2; return 0; }
    local scol tcol lcol data title plot
    scol=$(col_of step "$TSV") tcol=$(col_of tau_pooled "$TSV") lcol=$(col_of loss "$TSV")
    data=$(mktemp)
    awk -F'\t' -v s="$scol" -v t="$tcol" -v l="$lcol" 'NR > 1 { print $s "\t" $t "\t" (l ? $l : "NaN") }' "$TSV" |
        sort -n >"$data"
    # gnuplot strings in single quotes: a quote in a name is doubled
    gq() { local q="'"; printf "'%s'" "${1//$q/$q$q}"; }
    title="$(basename -- "$(realpath -- "$CKPT_DIR")"): $( [ -n "$VAL" ] && echo "offline on $(basename -- "$VAL")" || echo "online on $(basename -- "$PROMPTS")")"
    plot="plot $(gq "$data") using 1:2 with linespoints title 'tau (mean accepted length)' axes x1y1"
    [ "$lcol" -gt 0 ] && plot="$plot, '' using 1:3 with linespoints title 'loss' axes x1y2"
    gnuplot <<EOF
set terminal png size 900,500
set output $(gq "$PNG.tmp")
set datafile separator "\t"
set title $(gq "$title") noenhanced
set xlabel 'step'
set ylabel 'tau'
set y2label 'loss'
set ytics nomirror
set y2tics
set grid
set key below
$plot
EOF
    mv "$PNG.tmp" "$PNG"
    rm -f "$data"
}
if [ -n "$PNG" ] && [ -s "$TSV" ] && [ "$(wc -l <"$TSV")" -gt 1 ]; then plot_scores; fi
if [ ${#bad[@]} -gt 0 ]; then
    echo "eval-sweep.sh: ${#bad[@]} checkpoint(s) not scored: ${bad[*]}" >&2
    exit 1
fi
