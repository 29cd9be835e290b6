# tests/cli/lib.sh: helpers for the CLI tests (sourced).
#   pass NAME / fail NAME MSG     report one check
#   check NAME CMD...             pass if CMD exits 0
#   expect_exit CODE NAME CMD...  pass if CMD exits CODE
#   $T                            a scratch directory, removed at exit
#   require_built FILE...         fail "setup" and exit 1 unless each FILE is executable
#   tiny_target, drafter_config   the small models of tests/models.sh
# Tools are found in $DFLASH_BIN (default: bin/ of the checkout); python3 is
# one with numpy, msgpack and lz4 (/usr/bin/python3 if the first on PATH
# lacks them).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
: "${DFLASH_BIN:=$here/bin}"
: "${DFLASH_BUILD:=$here/build}"
export PATH="$DFLASH_BIN:$PATH"
FIX=$here/tests/fixtures
. "$here/tests/models.sh"
T=$(mktemp -d "${TMPDIR:-/tmp}/dflash-cli.XXXXXX")
trap 'rm -rf "$T"' EXIT

# The tests' python3 is the one `make deps` equips (Debian's numpy, msgpack,
# lz4). Where another python3 comes first on PATH without them (pyenv, a
# virtualenv), the system's goes first for the test.
py_mods='import numpy, msgpack, lz4.frame'
if ! python3 -c "$py_mods" 2>/dev/null && /usr/bin/python3 -c "$py_mods" 2>/dev/null; then
    mkdir -p "$T/.python"
    ln -s /usr/bin/python3 "$T/.python/python3"
    export PATH="$T/.python:$PATH"
fi

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1${2:+: $2}"; }
check() {
    local name=$1; shift
    if "$@" >"$T/.out" 2>"$T/.err"; then pass "$name"; else fail "$name" "exit $? from: $* ($(head -c 300 "$T/.err"))"; fi
}
expect_exit() {
    local code=$1 name=$2; shift 2
    "$@" >"$T/.out" 2>"$T/.err"
    local rc=$?
    if [ "$rc" -eq "$code" ]; then pass "$name"; else fail "$name" "expected exit $code, got $rc from: $* ($(head -c 300 "$T/.err"))"; fi
}
# A PATH that holds every command of this one but NAME...: a directory of
# links (the first of each name on PATH), for the runs of a missing tool.
path_without() {
    local dir d f n
    dir=$(mktemp -d "$T/path-without.XXXXXX")
    IFS=: read -ra dirs <<<"$PATH"
    for d in "${dirs[@]}"; do
        for f in "$d"/*; do
            n=${f##*/}
            [ -x "$f" ] && [ ! -e "$dir/$n" ] || continue
            [[ " $* " == *" $n "* ]] || ln -s "$f" "$dir/$n"
        done
    done
    echo "$dir"
}
require_built() {
    local x
    for x in "$@"; do
        [ -x "$x" ] || { fail "setup" "missing $x"; exit 1; }
    done
}
