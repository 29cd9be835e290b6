#!/usr/bin/env bash
# slow (about 2 min): the whole-model checks of tests/gpu/model_checks.sh,
# --device cpu against --device cuda, run here with the CUDA kernels
# compiled for the CPU against the emulation in tests/emu: the model code
# (dflash-extract, dflash-train-step, a drafter step's gradients) through
# every CUDA kernel and launcher, agreeing with the CPU within the limits
# stated in model_checks.sh. Not under ASan (no emulated build there).
. "$(dirname "$0")/lib.sh"
E=$DFLASH_BUILD/emu/bin
if [ ! -x "$E/dflash-extract" ] || [ ! -x "$DFLASH_BUILD/gpu/bench_train_emu" ]; then
    echo "no emulated build in $DFLASH_BUILD (SAN builds have none): nothing to do"
    exit 0
fi
BIN=$E BUILD=$DFLASH_BUILD BENCH=$DFLASH_BUILD/gpu/bench_train_emu DEV=cuda OUT=$T \
    bash "$here/tests/gpu/model_checks.sh" >"$T/log" 2>&1
while IFS='|' read -r _ step res detail; do
    case $res in
    ok) pass "$step: $detail" ;;
    "not yet") echo "skip $step: $detail" ;;
    *) fail "$step" "$res: $detail" ;;
    esac
done < <(grep '^RESULT|' "$T/log")
grep -q '^RESULT|' "$T/log" || { fail "model_checks.sh" "no results"; sed 's/^/    /' "$T/log" | tail -20; }
