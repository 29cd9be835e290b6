# tests/bench/lib.sh: what the benchmarks share (sourced; set -u is theirs).
#   $here, $DFLASH_BIN, $DFLASH_BUILD  the checkout and its build (bin/, build/)
#   bench_require NAME REASON CMD...   unless CMD succeeds (quietly), print
#                                      "NAME: skipped: REASON" and exit 0
#   bench_workdir NAME                 $W: a scratch directory, removed at exit
# and the model makers of tests/models.sh (tiny_target, drafter_config).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
: "${DFLASH_BIN:=$here/bin}"
: "${DFLASH_BUILD:=$here/build}"
. "$here/tests/models.sh"

bench_require() {
    local name=$1 reason=$2
    shift 2
    "$@" >/dev/null 2>&1 && return 0
    echo "$name: skipped: $reason"
    exit 0
}

bench_workdir() {
    W=$(mktemp -d "${TMPDIR:-/tmp}/bench-$1.XXXXXX")
    trap 'rm -rf "$W"' EXIT
}
