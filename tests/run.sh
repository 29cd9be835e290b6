#!/usr/bin/env bash
# Run every test of dflash and print one tally: "N passed, N failed".
#
#   tests/run.sh               the build in $DFLASH_BUILD / $DFLASH_BIN
#   tests/run.sh --with-asan   then the unit and CLI tests again against the
#                              ASan+UBSan build in $DFLASH_ASAN_BUILD / _BIN
#   tests/run.sh PATTERN       only tests whose name contains PATTERN
#
# A test program or script prints "PASS name" / "FAIL name" lines; one that
# exits non-zero without printing a FAIL line counts as one failure, so a
# crash is never silent.
set -u
cd "$(dirname "$0")/.."
root=$PWD
with_asan=0
pattern=""
for a in "$@"; do
    case "$a" in
        --with-asan) with_asan=1 ;;
        *) pattern="$a" ;;
    esac
done

: "${DFLASH_BUILD:=$root/build}"
: "${DFLASH_BIN:=$root/bin}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp:print_suppressions=0}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

passed=0
failed=0
failures=()
log_dir=$(mktemp -d "${TMPDIR:-/tmp}/dflash-tests.XXXXXX")
trap 'rm -rf "$log_dir"' EXIT

# run_one LABEL CMD...: run, echo its PASS/FAIL lines, count them.
run_one() {
    local label=$1; shift
    local log="$log_dir/$(echo "$label" | tr '/ ' '__').log"
    "$@" >"$log" 2>&1
    local rc=$?
    local p f
    p=$(grep -c '^PASS ' "$log")
    f=$(grep -c '^FAIL ' "$log")
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        f=1
        echo "FAIL $label (exit $rc)" >>"$log"
    fi
    passed=$((passed + p))
    failed=$((failed + f))
    if [ "$f" -gt 0 ]; then
        failures+=("$label")
        echo "--- $label: $p passed, $f failed"
        sed 's/^/    /' "$log" | tail -n 60
    else
        echo "--- $label: $p passed"
    fi
}

# run_suite BUILD BIN TAG
run_suite() {
    local build=$1 bin=$2 tag=$3
    export DFLASH_BIN=$bin DFLASH_BUILD=$build
    for t in "$build"/tests/test_*; do
        [ -x "$t" ] || continue
        local name="$tag$(basename "$t")"
        [ -n "$pattern" ] && [[ "$name" != *"$pattern"* ]] && continue
        run_one "$name" "$t"
    done
    for s in tests/cli/test_*.sh; do
        [ -f "$s" ] || continue
        local name="${tag}cli/$(basename "$s" .sh)"
        [ -n "$pattern" ] && [[ "$name" != *"$pattern"* ]] && continue
        # Slow end-to-end scripts run once, in the normal build only, as do
        # those that preload a library (ASan's runtime must come first).
        if [ -n "$tag" ] && grep -Eq '^# (slow|normal build only)' "$s"; then continue; fi
        run_one "$name" bash "$s"
    done
}

run_suite "$DFLASH_BUILD" "$DFLASH_BIN" ""
if [ "$with_asan" = 1 ]; then
    run_suite "$DFLASH_ASAN_BUILD" "$DFLASH_ASAN_BIN" "asan/"
fi

echo
if [ ${#failures[@]} -gt 0 ]; then
    echo "failed: ${failures[*]}"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
