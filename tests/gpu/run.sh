#!/usr/bin/env bash
# tests/gpu/run.sh: every GPU check and benchmark of dflash in one run, for a
# machine with a CUDA GPU (an H200: root, 16 cores, no network). Writes a
# report (report.md, rewritten after every step: a run cut short still has
# one) and raw logs, 7 files, under $OUT (default ./gpu-out).
#
#   1. build: make -j16 (kernels for sm_90a + PTX), in build-gpu/
#   2. op agreement, CUDA vs the CPU reference (build-gpu/tests/test_ops_cuda):
#      fast kernels with synchronous launches, the simple attention kernels,
#      the real-size shapes
#   3. whole-model agreement, --device cpu vs --device cuda: one drafter
#      training step's gradients (bench_train --grad-out), then the tools
#      that exist (tests/gpu/model_checks.sh)
#   4. benchmarks: extraction (Qwen3-8B shape), one drafter training step
#      (MFU); the tools end to end on a Qwen3-0.6B-shaped target: extraction,
#      online scoring against plain greedy decoding with an untrained drafter
#      and with one trained there (tests/gpu/score_trained.sh); extraction
#      of a Qwen3.5 hybrid with Qwen3.5-27B's layer shapes, and of a
#      mixture-of-experts target with Qwen3-30B-A3B's; then the training
#      step in PyTorch when it is installed
#   5. the attention and MoE tests under compute-sanitizer memcheck and racecheck,
#      with the time that is left (the runtime may not support them)
#   6. report.md: a summary table, then where each raw log is
#
# Time: about 4 minutes. Past DFLASH_GPU_BUDGET seconds (default 250) the
# optional steps are skipped, and later ones get only the time left; the
# report says which.
#
# Running it through the device tool, from the repository root (HERE first:
# bash tests/gpu/pack-deps.sh, which writes the ignored .gpu-deps/):
#   run(command="DFLASH_COMMIT=<git rev-parse --short HEAD> bash tests/gpu/run.sh", carry=[".gpu-deps"],
#       timeout_s=420)
# DFLASH_GPU_DRYRUN=1 runs the same script without a GPU (CPU, tiny shapes):
# a test of the script itself.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
BUDGET=${DFLASH_GPU_BUDGET:-250}
DRY=${DFLASH_GPU_DRYRUN:-0}
B=$ROOT/build-gpu
ENV_LOG=$OUT/env.log BUILD_LOG=$OUT/build.log TEST_LOG=$OUT/tests.log MODEL_LOG=$OUT/model.log
BENCH_LOG=$OUT/bench.log TORCH_LOG=$OUT/bench.log MEM_LOG=$OUT/gpumem.log REPORT=$OUT/report.md
: >"$ENV_LOG"; : >"$BUILD_LOG"; : >"$TEST_LOG"; : >"$MODEL_LOG"; : >"$BENCH_LOG"; : >"$MEM_LOG"
# Scratch files stay out of $OUT: the device tool brings back at most 8
# files, and a run cut short must not leave half-written extras there.
TMPD=$(mktemp -d)
PART=$TMPD/part X=$TMPD/x
ROWS=() # report rows: "| step | result | detail |"
CORES=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 16)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CORES} # the CPU reference of the agreement tests

elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET - $(elapsed))); }
built=0
# the device tool's copy of the tree may carry a stale .git: the caller can
# name the commit (DFLASH_COMMIT=$(git rev-parse --short HEAD) here)
COMMIT=${DFLASH_COMMIT:-$(git log -1 --format=%h 2>/dev/null)}
# report.md as it stands, rewritten after every row (and at the end), so
# that a run cut short (the device tool's timeout, a hang) still leaves the
# steps it finished. $1: the state line.
write_report() {
    {
        echo "# dflash GPU run"
        echo
        echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT, $(elapsed) s: $1."
        echo
        echo "| step | result | detail |"
        echo "| --- | --- | --- |"
        printf '%s\n' "${ROWS[@]}"
        echo
        echo "Raw logs beside this file: env.log (machine), build.log, tests.log (every nmse"
        echo "printed), model.log, bench.log (PyTorch's step too), gpumem.log (memory.used samples)."
        echo
        echo "MFU counts model FLOPs (tests/gpu/bench_train.c: 2MKN per matrix product issued,"
        echo "attention 4D forward and 8D backward per query, visible key and head) over 989 TFLOP/s."
        if [ "$built" != 1 ] && [ -s "$BUILD_LOG" ]; then
            echo
            echo '## build.log (tail)'
            echo '```'
            tail -n 40 "$BUILD_LOG"
            echo '```'
        fi
        if grep -q '^FAIL' "$TEST_LOG" 2>/dev/null; then
            echo
            echo '## failing checks'
            echo '```'
            grep -B2 -A8 'check failed' "$TEST_LOG" | head -n 60
            echo '```'
        fi
    } >"$TMPD/report.md" && cp "$TMPD/report.md" "$REPORT.new" && mv -f "$REPORT.new" "$REPORT"
}
row() {
    ROWS+=("| $1 | $2 | $3 |")
    echo "[$(elapsed)s] $1: $2 ${3:+($3)}"
    write_report "in progress (if this line stays, the run was cut short after the last row)"
}
# GPU memory while a benchmark runs: nvidia-smi samples memory.used every
# 200 ms into gpumem.log; mem_peak prints the peak (MiB) since mem_watch.
MEM_PID=
mem_watch() {
    [ "$DRY" = 1 ] && return
    command -v nvidia-smi >/dev/null || return
    echo "== $1" >>"$MEM_LOG"
    nvidia-smi --query-gpu=memory.used,clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 >>"$MEM_LOG" 2>/dev/null &
    MEM_PID=$!
}
mem_peak() {
    [ -n "$MEM_PID" ] || { echo "?"; return; }
    kill "$MEM_PID" 2>/dev/null; wait "$MEM_PID" 2>/dev/null
    MEM_PID=
    # the last section's samples: memory peak; the SM clock and power while
    # busy (samples above 200 W), as medians: H200s cap their power at 700 W
    local sec peak clk pw
    sec=$(awk '/^==/ {buf = ""; next} {buf = buf $0 "\n"} END {printf "%s", buf}' "$MEM_LOG")
    peak=$(printf '%b' "$sec" | awk -F', *' '$1 + 0 > m {m = $1 + 0} END {printf "%.1f GiB", m / 1024}')
    median() { sort -n | awk '{a[NR] = $1} END {if (NR) print a[int((NR + 1) / 2)]}'; }
    clk=$(printf '%b' "$sec" | awk -F', *' '$3 + 0 > 200 {print $2 + 0}' | median)
    pw=$(printf '%b' "$sec" | awk -F', *' '$3 + 0 > 200 {printf "%d\n", $3 + 0}' | median)
    echo "$peak${clk:+; busy: SM clock median $clk MHz, power $pw W}"
}
trap '[ -n "$MEM_PID" ] && kill "$MEM_PID" 2>/dev/null; rm -rf "$TMPD"' EXIT
section() { printf '\n===== %s (at %ss) =====\n' "$1" "$(elapsed)" >>"$2"; }
# value LOG KEY: the value printed after KEY in a "key   value" line
value() { grep -m1 -F "$2" "$1" 2>/dev/null | cut -c36- | awk '{print $1}'; }

# ---- environment -------------------------------------------------------------------
{
    date -u
    uname -a
    echo "cores: $CORES"
    free -g | head -2
    command -v nvidia-smi >/dev/null && nvidia-smi && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
    command -v nvcc >/dev/null && nvcc --version
    command -v compute-sanitizer >/dev/null && echo "compute-sanitizer: $(command -v compute-sanitizer)"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1
    git log -1 --oneline 2>/dev/null
} >>"$ENV_LOG" 2>&1
GPU=$(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[ "$DRY" = 1 ] && GPU="none (dry run: CPU, tiny shapes)"
row "machine" "${GPU:-no GPU found}" "$CORES cores; see env.log"

# ---- 1. build ------------------------------------------------------------------------
MAKEARGS=(-j"$CORES" BUILD="$B" BIN="$B/bin")
. tests/gpu/deps.sh
if gpu_deps $([ "$DRY" = 1 ] && echo carried-only); then
    deps=$GPU_DEPS
else
    row "build" "FAIL" "msgpack-c/lz4/jansson/xxhash/OpenBLAS missing: run tests/gpu/pack-deps.sh here and carry .gpu-deps"
    deps=""
fi
[ "$DRY" = 1 ] && MAKEARGS+=(NO_CUDA=1)
if [ -n "$deps" ]; then
    section "make ${MAKEARGS[*]}" "$BUILD_LOG"
    targets=("$B/tests/test_ops_cuda" "$B/gpu/bench_extract" "$B/gpu/bench_train" "$B/gpu/bench_gdn" "$B/gpu/bench_attn" all)
    [ -f tests/helpers/mktarget.c ] && targets+=("$B/tests/mktarget")
    [ -f tests/helpers/dfs_bench.c ] && targets+=("$B/tests/dfs_bench" "$B/tests/dfs_datagen")
    if make "${MAKEARGS[@]}" "${targets[@]}" >>"$BUILD_LOG" 2>&1; then
        built=1
        row "build" "ok" "$(($(elapsed)))s; $deps; $(grep -m1 'CUDA backend' "$BUILD_LOG")"
    else
        # Another compiler may warn where ours does not: the gate for that is
        # CI, not this run; build again without -Werror and say so.
        section "make again without -Werror" "$BUILD_LOG"
        if make "${MAKEARGS[@]}" WARN="-Wall -Wextra -Wshadow -Wstrict-prototypes -Wno-unused-parameter" \
            NVCCFLAGS="-O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90 -lineinfo -Ilib -Ikernels" \
            "${targets[@]}" >>"$BUILD_LOG" 2>&1; then
            built=1
            row "build" "ok, without -Werror" "this compiler warns: see the first make in build.log; $deps"
        else
            row "build" "FAIL" "see build.log (tail below)"
        fi
    fi
fi

run_test() { # LABEL ENV... -- : one run of test_ops_cuda, its PASS/FAIL lines counted
    local label=$1; shift
    section "$label" "$TEST_LOG"
    echo "env: $*" >>"$TEST_LOG"
    local t0=$(date +%s)
    env "$@" timeout "${TT:-150}" "$B/tests/test_ops_cuda" >>"$PART" 2>&1
    local rc=$?
    cat "$PART" >>"$TEST_LOG"
    local p f
    p=$(grep -c '^PASS ' "$PART")
    f=$(grep -c '^FAIL ' "$PART")
    local worst
    worst=$(grep -o 'nmse .*' "$PART" | awk '{l=substr($NF,1,length($NF)-1)+0; if (l > 0) {r=$(NF-2)/l; if (r>m) {m=r; w=$2" "$3" "$4}}} END {if (m) printf "worst nmse/limit %.2f (%s)", m, w}')
    rm -f "$PART"
    if [ "$rc" -eq 0 ] && [ "$f" -eq 0 ]; then row "$label" "ok" "$p passed, $(($(date +%s) - t0))s; $worst"
    else row "$label" "FAIL" "$p passed, $f failed, exit $rc; see tests.log"; fi
}

if [ "$built" = 1 ]; then
    # ---- 2. op agreement ----------------------------------------------------------------
    if [ "$DRY" = 1 ]; then
        run_test "ops: no device reported cleanly"
    else
        run_test "ops: fast kernels, synced launches" DFLASH_CUDA_SYNC=1
        run_test "ops: simple attention kernels" DFLASH_CUDA_SIMPLE=1
        run_test "ops: real-size shapes" DFLASH_TEST_BIG=1
        # the MoE tests again with the grouped GEMM's fallback (per-expert calls)
        run_test "ops: MoE, one cuBLAS call per expert" DFLASH_CUDA_NO_GROUPED=1 DFLASH_TEST_ONLY=moe
        # the wgmma descriptors on the card (tests/gpu/wgmma_probe.cu): which layouts it reads
        section "wgmma layout probe" "$TEST_LOG"
        if nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Ilib -Ikernels tests/gpu/wgmma_probe.cu \
            -o "$B/wgmma_probe" >>"$TEST_LOG" 2>&1; then
            timeout 30 "$B/wgmma_probe" >"$X.probe" 2>&1
            rc=$?
            cat "$X.probe" >>"$TEST_LOG"
            detail=$(grep -E ' (ok|FAIL) \(nmse' "$X.probe" | sed -E 's/ +/ /g; s/ \(nmse [^)]*\)//' | paste -sd ';' -)
            [ $rc -eq 0 ] && row "wgmma layout probe" "ok" "$detail" || row "wgmma layout probe" "FAIL" "exit $rc: $detail"
            rm -f "$X.probe"
        else
            row "wgmma layout probe" "FAIL" "did not build; see tests.log"
        fi
    fi

    # ---- 3. whole-model agreement ----------------------------------------------------------
    if [ "$(left)" -gt 120 ]; then
        DEV=cuda
        [ "$DRY" = 1 ] && DEV=cpu
        section "model checks (--device cpu vs --device $DEV)" "$MODEL_LOG"
        BIN=$B/bin BUILD=$B DEV=$DEV OUT=$OUT bash tests/gpu/model_checks.sh >>"$MODEL_LOG" 2>&1
        while IFS='|' read -r _ step result detail; do
            [ -n "$step" ] && row "$(echo $step)" "$(echo $result)" "$(echo $detail)"
        done < <(grep '^RESULT|' "$MODEL_LOG" | sed 's/^RESULT//')
    else
        row "model checks" "skipped" "time budget"
    fi

    # ---- 4. benchmarks ----------------------------------------------------------------------
    BDEV=(--device cuda)
    [ "$DRY" = 1 ] && BDEV=(--device cpu --tiny)
    # bench NAME SECONDS [ARGS]: one benchmark binary on BDEV, its output in
    # $X and bench.log, its exit status in rc, its GPU memory peak in peak
    bench() {
        local name=$1 secs=$2
        shift 2
        section "$name${*:+ $*} ${BDEV[*]}" "$BENCH_LOG"
        mem_watch "$name $*"
        timeout "$secs" "$B/gpu/$name" "$@" "${BDEV[@]}" >"$X" 2>&1
        rc=$?
        peak=$(mem_peak)
        cat "$X" >>"$BENCH_LOG"
    }
    bench bench_extract 120
    if [ $rc -eq 0 ]; then
        row "extraction, Qwen3-8B shape (layers 0..33), 8 x 2048 tokens" "$(value "$X" 'tokens/s') tok/s" \
            "$(value "$X" 'achieved TFLOP/s') TFLOP/s, MFU $(value "$X" 'MFU') %; anchor 27K (SGLang), goal 45K; GPU memory peak $peak (predicted ~16 GiB)"
    else row "extraction benchmark" "FAIL" "exit $rc; see bench.log"; fi
    if [ "$(left)" -gt 90 ]; then
        bench bench_extract 120 --download
        [ $rc -eq 0 ] && row "extraction incl. D2H of the 5 taps (pageable)" "$(value "$X" 'tokens/s') tok/s" \
            "non-finite sampled values: $(value "$X" 'non-finite')"
    fi
    # the forward attention on wgmma (kernels/attention.cuh; opt-in until
    # measured here): two or three warpgroups a CTA, overlapped; then two,
    # not overlapped (DFLASH_CUDA_WGMMA_PIPE=0)
    for wg in 1 3 1p0; do
        [ "$(left)" -gt 150 ] || break
        DFLASH_CUDA_WGMMA=${wg%p0} DFLASH_CUDA_WGMMA_PIPE=$([ $wg = 1p0 ] && echo 0 || echo 1) bench bench_extract 120
        [ $rc -eq 0 ] && row "the same extraction, causal attention on wgmma (DFLASH_CUDA_WGMMA=${wg%p0}$([ $wg = 1p0 ] && echo ', DFLASH_CUDA_WGMMA_PIPE=0'))" \
            "$(value "$X" 'tokens/s') tok/s" "MFU $(value "$X" 'MFU') %; $([ $wg = 3 ] && echo three || echo two) warpgroups a CTA, $([ $wg = 1p0 ] && echo 'softmax not overlapped' || echo 'softmax overlapped with P V')"
    done
    bench bench_train 150
    if [ $rc -eq 0 ]; then
        row "train step, Qwen3-8B drafter, 512 anchors x 16, 3072 tokens" "MFU $(value "$X" 'MFU') %" \
            "$(value "$X" 'step time s') s/step, $(value "$X" 'achieved TFLOP/s') TFLOP/s of $(value "$X" 'model TFLOP per step') TFLOP/step; goal 55 %; phases: fwd $(value "$X" 'phase forward') s, head $(value "$X" 'phase LM head') s, bwd $(value "$X" 'phase backward') s, opt $(value "$X" 'phase optimizer') s; GPU memory peak $peak (predicted ~29 GiB)"
    else row "train-step benchmark" "FAIL" "exit $rc; see bench.log"; fi
    if [ "$(left)" -gt 140 ]; then # a sliding-window drafter (Qwen3.6-27B's pattern: 4 sliding layers, then full)
        bench bench_train 150 --window 2048
        [ $rc -eq 0 ] && row "the same step, a sliding window of 2048 on layers 0-3 (bench_train --window 2048)" \
            "MFU $(value "$X" 'MFU') %" "$(value "$X" 'step time s') s/step, $(value "$X" 'achieved TFLOP/s') TFLOP/s of $(value "$X" 'model TFLOP per step') TFLOP/step (attention over the keys the window leaves); phases fwd $(value "$X" 'phase forward') s, bwd $(value "$X" 'phase backward') s"
        [ $rc -eq 0 ] || row "train-step benchmark, --window 2048" "FAIL" "exit $rc; see bench.log"
    fi
    if [ "$(left)" -gt 130 ]; then # the DFlash forward on wgmma
        DFLASH_CUDA_WGMMA=1 bench bench_train 150
        [ $rc -eq 0 ] && row "the same step, DFlash attention forward and dk/dv on wgmma (DFLASH_CUDA_WGMMA=1)" \
            "MFU $(value "$X" 'MFU') %" "$(value "$X" 'step time s') s/step; phases fwd $(value "$X" 'phase forward') s, bwd $(value "$X" 'phase backward') s"
    fi
    if [ "$(left)" -gt 130 ]; then # the DFlash forward on wgmma, not overlapped
        DFLASH_CUDA_WGMMA=1 DFLASH_CUDA_WGMMA_PIPE=0 bench bench_train 150
        [ $rc -eq 0 ] && row "the same step on wgmma, the forward not overlapped (DFLASH_CUDA_WGMMA_PIPE=0)" \
            "MFU $(value "$X" 'MFU') %" "$(value "$X" 'step time s') s/step; phase fwd $(value "$X" 'phase forward') s"
    fi
    if [ "$(left)" -gt 120 ]; then # the other dq kernel, for the record (kernels/attn_dflash.cu)
        DFLASH_CUDA_DS_MAX_MB=0 bench bench_train 150
        [ $rc -eq 0 ] && row "the same step, dq recomputing S and dP (DFLASH_CUDA_DS_MAX_MB=0)" \
            "MFU $(value "$X" 'MFU') %" "$(value "$X" 'step time s') s/step; phase bwd $(value "$X" 'phase backward') s; GPU memory peak $peak"
    fi
    # gpt-oss-20b's attention (64/8 heads of 64, 16 x 2048 tokens, the lse
    # for its sinks): attn_causal with the layer's window against the
    # attn_dflash one-row blocks it replaced; a full layer and a sliding one
    for w in 0 128; do
        [ "$(left)" -gt 110 ] || break
        what="gpt-oss-20b attention, $([ $w = 0 ] && echo 'full layer' || echo "sliding layer (window $w)"), 16 x 2048 tokens"
        bench bench_attn 60 --window $w
        if [ $rc -eq 0 ]; then
            row "$what: attn_causal against one-row blocks" "$(value "$X" 'speed-up')x" \
                "attn_causal $(value "$X" 'attn_causal ms') ms ($(value "$X" 'attn_causal TFLOP/s') TFLOP/s), one-row attn_dflash blocks $(value "$X" 'one-row blocks ms') ms ($(value "$X" 'one-row blocks TFLOP/s') TFLOP/s); outputs nmse $(value "$X" 'outputs nmse')"
        else row "$what" "FAIL" "exit $rc; see bench.log"; fi
    done
    # where the time goes: device time per op, product shape and attention
    # stage (DFLASH_CUDA_PROFILE=1, kernels/profile.cu), in bench.log
    if [ "$DRY" != 1 ] && [ "$(left)" -gt 100 ]; then
        for b in "bench_extract --iters 2" "bench_train --steps 2"; do
            section "$b, profiled (DFLASH_CUDA_PROFILE=1)" "$BENCH_LOG"
            DFLASH_CUDA_PROFILE=1 timeout 120 "$B/gpu/"$b "${BDEV[@]}" >>"$BENCH_LOG" 2>&1
        done
        row "per-op device time of both benchmarks" "in bench.log" \
            "DFLASH_CUDA_PROFILE=1: ops, cuBLAS products by shape, attention stages; first calls apart"
    fi
    rm -f "$X"
    # the real tool end to end (JSONL in, DFS stream out): a Qwen3-0.6B-shaped
    # target cut to 8 layers (mktarget's host RNG is the slow part), 32 x 2048
    # tokens, packed 16384 at a time
    # (the online scoring below reuses that target)
    W=$TMPD/work && mkdir -p "$W"
    if [ "$DRY" != 1 ] && [ -x "$B/bin/dflash-extract" ] && [ -x "$B/tests/mktarget" ] && [ "$(left)" -gt 120 ]; then
        section "dflash-extract --device cuda end to end" "$BENCH_LOG"
        BIN="$B/bin" BUILD="$B" SHAPE=gpu TARGET="$W/target" TARGET_ONLY=1 bash tests/gpu/score_trained.sh >>"$BENCH_LOG" 2>&1
        python3 -c "
import json, random
r = random.Random(1)
with open('$W/in.jsonl', 'w') as f:
    for i in range(32):
        f.write(json.dumps({'id': i, 'input_ids': [r.randrange(151000) for _ in range(2048)]}) + '\\n')
"
        for z in "" "--byte-shuffle on"; do
            t0=$(date +%s.%N)
            if timeout 60 "$B/bin/dflash-extract" -m "$W/target" -d cuda -b 16384 $z -o "$W/out.dfs" "$W/in.jsonl" >>"$BENCH_LOG" 2>&1; then
                t1=$(date +%s.%N)
                row "dflash-extract --device cuda ${z:-(no compression)}: 8-layer Qwen3-0.6B shape, 65536 tokens" \
                    "$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f tok/s", 65536 / (b - a)}')" \
                    "whole tool: JSONL parse, load, forward, D2H, $([ -n "$z" ] && echo "shuffle + LZ4, ")write $(du -m "$W/out.dfs" | cut -f1) MB"
            else
                row "dflash-extract --device cuda ${z:-}" "FAIL" "see bench.log"
            fi
        done
        rm -f "$W/out.dfs"
    fi

    # the host's side of training and scoring on this machine's cores: a
    # record's tensors decoded on one thread and on all (dfs_bench, 256 MiB of
    # activation-like bf16; DFLASH_GPU_DRYRUN: 16 MiB)
    if [ -x "$B/tests/dfs_bench" ] && [ -x "$B/tests/dfs_datagen" ] && [ "$(left)" -gt 60 ]; then
        section "dfs_bench: records decoded on the host" "$BENCH_LOG"
        if "$B/tests/dfs_datagen" --records "$([ "$DRY" = 1 ] && echo 2 || echo 32)" --tokens 1024 --hidden 4096 \
               --layers 1 --seed 7 --compress none -o "$W/none.dfs" >>"$BENCH_LOG" 2>&1 &&
           timeout 90 "$B/tests/dfs_bench" "$W/none.dfs" >"$W/dfs.tsv" 2>>"$BENCH_LOG"; then
            cat "$W/dfs.tsv" >>"$BENCH_LOG"
            row "records decoded on the host: lz4 + byte shuffle" \
                "$(awk -F'\t' '$1 == "lz4+shuffle" {one = $6} $1 ~ /^lz4\+shuffle x/ {n = substr($1, 14); all = $6}
                               END {printf "%s MB/s on 1 thread, %s on %s threads", one, all, n}' "$W/dfs.tsv")" \
                "raw bf16; a Qwen3-8B record (126 MB) decodes in 126/rate s, against a ~0.13-0.15 s training step"
        else
            row "records decoded on the host" "FAIL" "see bench.log"
        fi
        rm -f "$W/none.dfs" "$W/dfs.tsv"
    fi

    # the online scoring loop against plain greedy decoding, both on the GPU,
    # on the same target: with an untrained drafter (tau near 1: the loop's
    # cost per cycle), then with one trained here on the target's greedy
    # continuations (tests/gpu/score_trained.sh: the speed-up itself)
    if [ -x "$B/bin/dflash-score" ] && [ -x "$B/bin/dflash-train-step" ] && [ -x "$B/tests/mktarget" ] && [ "$(left)" -gt 90 ]; then
        section "tests/gpu/score_trained.sh (online scoring)" "$BENCH_LOG"
        if [ "$DRY" = 1 ]; then
            knobs=(DEV=cpu SHAPE=tiny STEPS=2 N_TRAIN=8 NEW=16 N_EVAL=2 EVAL_NEW=16)
        else
            knobs=(DEV=cuda SHAPE=gpu)
            [ -f "$W/target/config.json" ] && knobs+=(TARGET="$W/target")
        fi
        tt=$(($(left) - 30 > 180 ? 180 : $(left) - 30))
        env BIN="$B/bin" BUILD="$B" "${knobs[@]}" timeout "$tt" bash tests/gpu/score_trained.sh >"$TMPD/score.log" 2>&1
        rc=$?
        cat "$TMPD/score.log" >>"$BENCH_LOG"
        while IFS='|' read -r _ step result detail; do
            [ -n "$step" ] && row "$step" "$result" "$detail"
        done < <(grep '^RESULT|' "$TMPD/score.log")
        [ $rc -eq 0 ] || row "online scoring (tests/gpu/score_trained.sh)" "FAIL" "exit $rc$([ $rc = 124 ] && echo ": timeout ${tt}s"); see bench.log"
    fi
    rm -rf "$W"

    # the training step in PyTorch, when it is there and time allows (after
    # the tools, whose rows matter more than its compile time)
    if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && [ "$(left)" -gt 60 ]; then
        section "torch_step.py (flex_attention)" "$TORCH_LOG"
        timeout $(($(left) - 10 > 150 ? 150 : $(left) - 10)) python3 tests/gpu/torch_step.py >>"$TORCH_LOG" 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then
            ts=$(value "$TORCH_LOG" 'torch step time s')
            ours=$(grep -m1 'step time s' "$BENCH_LOG" | awk '{print $NF}')
            row "same step in PyTorch ($(value "$TORCH_LOG" 'torch version'), flex_attention)" \
                "MFU $(value "$TORCH_LOG" 'torch MFU') %" \
                "$ts s/step; dflash is $(awk -v a="$ts" -v b="$ours" 'BEGIN {if (b > 0) printf "%.2fx", a / b; else print "?"}') as fast"
        else
            row "same step in PyTorch" "FAIL/timeout" "exit $rc; see bench.log"
        fi
    else
        row "same step in PyTorch" "skipped" "no CUDA PyTorch, or time budget"
    fi

    # the Gated DeltaNet ops of one Qwen3.5-27B layer alone (bench_gdn): a
    # packed prefill and a verify step, beside their floors
    if [ -x "$B/gpu/bench_gdn" ] && [ "$(left)" -gt 45 ]; then
        section "bench_gdn" "$BENCH_LOG"
        X=$TMPD/gdn.txt
        if [ "$DRY" = 1 ]; then gdn_args=(--device cpu --tiny --iters 1); else gdn_args=(--device cuda); fi
        if timeout 30 "$B/gpu/bench_gdn" "${gdn_args[@]}" >"$X" 2>&1; then
            row "Gated DeltaNet, one Qwen3.5-27B layer: prefill 16 x 2048" \
                "$(value "$X" "gated_delta ms") ms" \
                "gated_delta (f32 floor $(value "$X" "f32 floor ms") ms), conv1d_silu $(value "$X" "conv1d_silu ms") ms; predicted 7-10 ms and 0.3-0.5 ms"
            row "Gated DeltaNet, verify of 16 rows" "$(value "$X" "gated_delta us") us" \
                "conv1d_silu $(value "$X" "conv1d_silu us") us, byte floor $(value "$X" "byte floor us") us; predicted 5-10 us"
            # the same attention on the simple CUDA-core kernel that served
            # head dim 256 before the tensor-core path: the ratio
            Y=$TMPD/attn-simple.txt
            simple="not run (time budget)"
            if [ "$(left)" -gt 40 ] && DFLASH_CUDA_SIMPLE=1 timeout 30 "$B/gpu/bench_gdn" "${gdn_args[@]}" --attn-only \
                >"$Y" 2>&1; then
                simple="$(value "$Y" "attn_causal ms") ms on the simple kernel"
                cat "$Y" >>"$BENCH_LOG"
            fi
            row "Qwen3.5-27B attention layer: causal prefill 16 x 2048, 24/4 heads of 256" \
                "$(value "$X" "attn_causal ms") ms" \
                "$(value "$X" "TFLOP/s") TFLOP/s on tensor cores; $simple; predicted 3-4 ms (~40 ms or worse simple)"
        else
            row "bench_gdn" "FAIL" "see bench.log"
        fi
        cat "$X" >>"$BENCH_LOG"
    fi

    # extract_rate MODEL DEV LAYERS N LEN [ENV...]: dflash-extract over N random
    # samples of LEN tokens (batches of 8 samples) into MODEL.dfs, then the
    # same process on one token (start-up: weights read and uploaded); sets
    # ntok, rate (steady tok/s, start-up taken off) and whole (the whole
    # tool's rate and times). Non-zero when the run failed.
    extract_rate() {
        local model=$1 dev=$2 layers=$3 n=$4 len=$5 t0 t1 t2
        shift 5
        python3 -c "
import json, random
r = random.Random(2)
with open('$model-in.jsonl', 'w') as f:
    for i in range($n):
        f.write(json.dumps({'id': i, 'input_ids': [r.randrange(300) for _ in range($len)]}) + '\n')
"
        echo '{"id": "one", "input_ids": [1]}' >"$model-one.jsonl"
        t0=$(date +%s.%N)
        env "$@" timeout 60 "$B/bin/dflash-extract" -m "$model" -d "$dev" -l "$layers" -b $((8 * len)) \
            -o "$model.dfs" "$model-in.jsonl" >>"$BENCH_LOG" 2>&1 || return 1
        t1=$(date +%s.%N)
        env "$@" timeout 30 "$B/bin/dflash-extract" -m "$model" -d "$dev" -l "$layers" -o "$model-one.dfs" \
            "$model-one.jsonl" >>"$BENCH_LOG" 2>&1
        t2=$(date +%s.%N)
        ntok=$((n * len))
        rate=$(awk -v a="$t0" -v b="$t1" -v c="$t2" -v n=$ntok 'BEGIN {s = (b - a) - (c - b); printf "%.0f tok/s steady", (s > 0 ? n / s : 0)}')
        whole=$(awk -v a="$t0" -v b="$t1" -v c="$t2" -v n=$ntok 'BEGIN {printf "whole tool %.0f tok/s (%.1f s, start-up %.1f s)", n / (b - a), b - a, c - b}')
    }

    # a Qwen3.5 hybrid target: Qwen3.5-27B's layer shapes (hidden 5120, 24/4
    # heads of 256, DeltaNet 16/48 heads of 128), 4 layers = 3 Gated DeltaNet
    # + 1 gated attention (the model's 3:1 pattern), vocabulary cut to 32000
    # (mktarget's host RNG); 16 x 2048 tokens. The whole 64-layer model runs
    # at more than 4/64 of this rate.
    if [ -x "$B/bin/dflash-extract" ] && [ -x "$B/tests/mktarget" ] && [ "$(left)" -gt 75 ]; then
        section "dflash-extract, Qwen3.5-27B layer shapes" "$BENCH_LOG"
        mkdir -p "$W"
        if [ "$DRY" = 1 ]; then
            q35=(--hidden 64 --intermediate 96 --heads 4 --kv-heads 2 --head-dim 32 --linear-k-heads 2
                 --linear-v-heads 4 --linear-k-dim 16 --linear-v-dim 16 --vocab 300) n35=4 len35=64 d35=cpu
        else
            q35=(--hidden 5120 --intermediate 17408 --heads 24 --kv-heads 4 --head-dim 256 --linear-k-heads 16
                 --linear-v-heads 48 --linear-k-dim 128 --linear-v-dim 128 --vocab 32000) n35=16 len35=2048 d35=cuda
        fi
        "$B/tests/mktarget" -a qwen3.5 -o "$W/t35" --layers 4 --tie no --seed 5 "${q35[@]}" >>"$BENCH_LOG" 2>&1
        mem_watch "qwen3.5 extract"
        if extract_rate "$W/t35" "$d35" 0,2,3 "$n35" "$len35"; then
            row "dflash-extract --device $d35: Qwen3.5-27B layer shapes, 3 DeltaNet + 1 gated attention layers, $ntok tokens" \
                "$rate" "$whole, batches of $((8 * len35)) tokens, GPU memory peak $(mem_peak); the 64-layer model: more than 1/16 of this (the taps' download and the stream's writing do not grow with layers)"
        else
            mem_peak >/dev/null
            row "dflash-extract --device $d35, Qwen3.5-27B layer shapes" "FAIL" "see bench.log"
        fi
        rm -rf "$W"
    fi

    # a mixture-of-experts target: Qwen3-30B-A3B's layer shapes (hidden 2048,
    # 32/4 heads of 128, 128 experts of width 768, 8 a token), 2 layers,
    # vocabulary cut to 32000 (mktarget's host RNG); 16 x 2048 tokens, so an
    # expert gets ~1K rows a batch of 16K tokens. The 48-layer model runs at
    # more than 2/48 of this rate. Then the same with one cuBLAS call per expert
    # (the grouped GEMM's fallback), when time is left.
    if [ -x "$B/bin/dflash-extract" ] && [ -x "$B/tests/mktarget" ] && [ "$(left)" -gt 60 ]; then
        section "dflash-extract, Qwen3-30B-A3B layer shapes" "$BENCH_LOG"
        mkdir -p "$W"
        if [ "$DRY" = 1 ]; then
            moe=(--hidden 64 --intermediate 96 --heads 4 --kv-heads 2 --head-dim 16 --experts 8 --experts-per-tok 2
                 --moe-intermediate 24 --vocab 300) nm=4 lenm=64 dm=cpu
        else
            moe=(--hidden 2048 --intermediate 6144 --heads 32 --kv-heads 4 --head-dim 128 --experts 128
                 --experts-per-tok 8 --moe-intermediate 768 --vocab 32000) nm=16 lenm=2048 dm=cuda
        fi
        "$B/tests/mktarget" -o "$W/tm" --layers 2 --tie no --seed 7 "${moe[@]}" >>"$BENCH_LOG" 2>&1
        mem_watch "moe extract"
        if extract_rate "$W/tm" "$dm" 0,1 "$nm" "$lenm"; then
            row "dflash-extract --device $dm: Qwen3-30B-A3B layer shapes (128 experts, 8 a token), 2 layers, $ntok tokens" \
                "$rate" "$whole, batches of $((8 * lenm)) tokens, GPU memory peak $(mem_peak); the experts through cuBLAS grouped GEMMs; the 48-layer model: more than 1/24 of this (the taps' download and the stream's writing do not grow with layers)"
            mv "$W/tm.dfs" "$W/grouped.dfs"
            # the device time of its ops, apart from the tool's I/O (the
            # steady rate above is the difference of two whole-tool runs)
            if [ "$DRY" != 1 ]; then
                section "the same under DFLASH_CUDA_PROFILE=1" "$BENCH_LOG"
                DFLASH_CUDA_PROFILE=1 timeout 60 "$B/bin/dflash-extract" -m "$W/tm" -d "$dm" -l 0,1 -b $((8 * lenm)) \
                    -o "$W/prof.dfs" "$W/tm-in.jsonl" >>"$BENCH_LOG" 2>&1
            fi
            if [ "$(left)" -gt 40 ]; then
                if extract_rate "$W/tm" "$dm" 0,1 "$nm" "$lenm" DFLASH_CUDA_NO_GROUPED=1; then
                    # the records' checksums (the headers differ by their time stamps)
                    sums() { "$B/bin/dflash-pack" --inspect "$1" | grep -o '"xxh64":"[0-9a-f]*"'; }
                    same=$(cmp -s <(sums "$W/grouped.dfs") <(sums "$W/tm.dfs") && echo "the same tensors, bit for bit" ||
                        echo "other roundings")
                    row "the same, one cuBLAS call per expert (DFLASH_CUDA_NO_GROUPED=1)" "$rate" \
                        "$whole; against the grouped row above; its stream against the grouped one's: $same"
                else
                    row "the same, one cuBLAS call per expert (DFLASH_CUDA_NO_GROUPED=1)" "FAIL" "see bench.log"
                fi
            fi
        else
            mem_peak >/dev/null
            row "dflash-extract --device $dm, Qwen3-30B-A3B layer shapes" "FAIL" "see bench.log"
        fi
        rm -rf "$W"
    fi

    # gpt-oss: gpt-oss-20b's layer shapes (hidden 2880, 64/8 heads of 64,
    # 32 experts of width 2880, 4 a token, sinks), 2 layers: layer 0 slides
    # (window 128), layer 1 is full; vocabulary cut to 32000 (mktarget's host
    # RNG); 16 x 2048 tokens. Both layers run attn_causal (the window, the
    # lse for the sinks). The 24-layer model runs at more than 2/24 of this.
    if [ -x "$B/bin/dflash-extract" ] && [ -x "$B/tests/mktarget" ] && [ "$(left)" -gt 60 ]; then
        section "dflash-extract, gpt-oss-20b layer shapes" "$BENCH_LOG"
        mkdir -p "$W"
        if [ "$DRY" = 1 ]; then
            oss=(--hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --experts 8 --experts-per-tok 2
                 --moe-intermediate 24 --window 16 --vocab 300) no=4 leno=64 do=cpu
        else
            oss=(--hidden 2880 --heads 64 --kv-heads 8 --head-dim 64 --experts 32 --experts-per-tok 4
                 --moe-intermediate 2880 --window 128 --vocab 32000) no=16 leno=2048 do=cuda
        fi
        "$B/tests/mktarget" -a gpt-oss -o "$W/to" --layers 2 --tie no --seed 11 "${oss[@]}" >>"$BENCH_LOG" 2>&1
        mem_watch "gpt-oss extract"
        if extract_rate "$W/to" "$do" 0,1 "$no" "$leno"; then
            row "dflash-extract --device $do: gpt-oss-20b layer shapes (sinks, window 128, 32 experts, 4 a token), 2 layers, $ntok tokens" \
                "$rate" "$whole, batches of $((8 * leno)) tokens, GPU memory peak $(mem_peak); the 24-layer model: more than 1/12 of this"
        else
            mem_peak >/dev/null
            row "dflash-extract --device $do, gpt-oss-20b layer shapes" "FAIL" "see bench.log"
        fi
        rm -rf "$W"
    fi

    # ---- 5. the attention kernels under compute-sanitizer, as time allows ----------------
    if [ "$DRY" != 1 ]; then
        if command -v compute-sanitizer >/dev/null; then
            for tool in memcheck racecheck; do
                if [ "$(left)" -lt 40 ]; then row "ops: attention and MoE under $tool" "skipped" "time budget"; continue; fi
                tt=$(($(left) - 10 > 90 ? 90 : $(left) - 10))
                section "compute-sanitizer --tool $tool (attention and MoE tests)" "$TEST_LOG"
                t0=$(date +%s)
                DFLASH_TEST_ONLY=attn,moe timeout $tt compute-sanitizer --tool $tool --error-exitcode 99 \
                    "$B/tests/test_ops_cuda" >"$PART" 2>&1
                rc=$?
                cat "$PART" >>"$TEST_LOG"
                summary=$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$PART")
                rm -f "$PART"
                case $rc in
                0) row "ops: attention and MoE under $tool" "ok" "$summary; $(($(date +%s) - t0))s" ;;
                124) row "ops: attention and MoE under $tool" "timeout" "${tt}s, the time left" ;;
                *) row "ops: attention and MoE under $tool" "see tests.log" "exit $rc: $summary (errors, or a runtime without sanitizer support)" ;;
                esac
            done
        else
            row "ops: compute-sanitizer" "skipped" "not installed"
        fi
    fi

fi

# ---- 6. report -------------------------------------------------------------------------
write_report "finished"
echo
cat "$REPORT"
grep -q '| FAIL' "$REPORT" && exit 1
exit 0
