#!/usr/bin/env bash
# Run every tests/bench/bench_*.sh (or those whose name contains PATTERN).
# Benchmarks print tables of throughput and ratios against the reference
# tools (PyTorch, lz4, zstd) measured in the same run on the same machine.
# They assert nothing: timings never go in tests.
set -u
cd "$(dirname "$0")/../.."
: "${DFLASH_BUILD:=$PWD/build}"
: "${DFLASH_BIN:=$PWD/bin}"
export DFLASH_BUILD DFLASH_BIN
export PATH="$DFLASH_BIN:$PATH"
status=0
for b in tests/bench/bench_*.sh; do
    [ -f "$b" ] || continue
    [ $# -gt 0 ] && [[ "$b" != *"$1"* ]] && continue
    echo "=== $(basename "$b" .sh)  ($(uname -m), $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ))"
    bash "$b"
    rc=$?
    [ $rc -eq 0 ] || { echo "$(basename "$b"): failed (exit $rc)"; status=1; }
    echo
done
exit $status
