#!/usr/bin/env bash
# normal build only (the tracer is preloaded; ASan's runtime must be first)
#
# Durability: the order in which each kind of output is synced and renamed,
# read from the calls the tools make (tests/shim/sync_trace.c, preloaded,
# records fsync, syncfs and rename with the paths they act on). A crash or a
# power loss must leave the old output or the whole new one under the real
# name, never a name whose files were not yet on disk:
#   a file      fsync(.NAME.tmp.X)  rename(.NAME.tmp.X, NAME)  fsync(parent)
#   checkpoint  fsync of each file (under its name or its temporary one) and
#               of .DIR.tmp.X, then rename(.DIR.tmp.X, DIR), fsync(parent)
#   export      syncfs(.DIR.tmp.X) (no fsync per file), rename, fsync(parent)
#   shards      every shard synced before the first is renamed
# and a failed sync is exit 74 with nothing under the real name.
. "$(dirname "$0")/lib.sh"

SHIM=$DFLASH_BUILD/tests/sync_trace.so
require_built "$DFLASH_BUILD/tests/mktarget" "$DFLASH_BUILD/tests/dfs_datagen" "$DFLASH_BIN/dflash-pack"
[ -f "$SHIM" ] || { fail "setup" "$SHIM not built"; exit 1; }
R=$(cd "$T" && pwd -P)   # the paths /proc gives for descriptors are canonical
TR=$R/trace

# traced NAME CMD...: run CMD with the tracer, its calls in $TR (fresh).
traced() {
    local name=$1; shift
    rm -f "$TR"
    SYNC_TRACE=$TR LD_PRELOAD=$SHIM check "$name" "$@"
}

# order DESC PATTERN...: the trace has lines matching each extended regex
# PATTERN, the first match of each after the first match of the one before.
order() {
    local desc=$1; shift
    if python3 - "$TR" "$@" >"$R/.order" 2>&1 <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
at = -1
for pat in sys.argv[2:]:
    hit = [i for i, l in enumerate(lines) if i > at and re.fullmatch(pat, l)]
    if not hit:
        sys.exit("no line after line %d matches %r in:\n%s" % (at + 1, pat, "\n".join(lines[:40])))
    at = hit[0]
PY
    then pass "$desc"; else fail "$desc" "$(cat "$R/.order")"; fi
}
q() { python3 -c 'import re, sys; print(re.escape(sys.argv[1]), end="")' "$1"; }   # a path as a regex

"$DFLASH_BUILD/tests/dfs_datagen" -n 30 -t 12 --tokens-max 20 -H 16 -K 2 -o "$R/a.dfs"

# ---- a file: dflash-pack -o ---------------------------------------------------------
traced "pack -o under the tracer" dflash-pack -o "$R/m.dfs" "$R/a.dfs"
tmpf="$(q "$R")/\.m\.dfs\.tmp\.[A-Za-z0-9]{6}"
order "a file: fsync of the temporary, then the rename, then fsync of the directory" \
    "fsync $tmpf" "rename $tmpf $(q "$R/m.dfs")" "fsync $(q "$R")"
[ "$(dflash-pack --inspect "$R/m.dfs" | jq -r 'select(.type=="sample").id' | wc -l)" -eq 30 ] &&
    pass "  ... and the output is whole" || fail "pack -o output"

# ---- shards: all on disk before any is renamed -----------------------------------
check "three shards" dflash-pack --shards 3 -o "$R/sh-%d.dfs" "$R/a.dfs"
for i in 0 1 2; do cp "$R/sh-$i.dfs" "$R/before-$i.dfs"; done
"$DFLASH_BUILD/tests/dfs_datagen" -n 30 -t 12 --tokens-max 20 -H 16 -K 2 --seed 9 -o "$R/c.dfs"
rm -f "$TR"
SYNC_TRACE=$TR SYNC_TRACE_FAIL=fsync:/.sh-2.dfs.tmp. LD_PRELOAD=$SHIM \
    expect_exit 74 "shards: the last one failing to sync is an I/O error (74)" \
    dflash-pack --shards 3 -o "$R/sh-%d.dfs" "$R/c.dfs"
cmp -s "$R/sh-0.dfs" "$R/before-0.dfs" && cmp -s "$R/sh-1.dfs" "$R/before-1.dfs" &&
    cmp -s "$R/sh-2.dfs" "$R/before-2.dfs" && [ -z "$(ls -A "$R" | grep '^\.sh-')" ] &&
    pass "  ... and the earlier three shards stay, none replaced, no temporary left" ||
    fail "shards after a failed sync" "$(ls -A "$R"; grep rename "$TR")"
traced "shards under the tracer" dflash-pack --shards 3 -o "$R/sh-%d.dfs" "$R/c.dfs"
last_sync=$(grep -n '^fsync .*/\.sh-[0-2]\.dfs\.tmp\.' "$TR" | tail -1 | cut -d: -f1)
first_rename=$(grep -n '^rename ' "$TR" | head -1 | cut -d: -f1)
[ -n "$last_sync" ] && [ -n "$first_rename" ] && [ "$last_sync" -lt "$first_rename" ] &&
    pass "  ... every shard synced before the first rename" || fail "shard order" "$(cat "$TR")"
[ "$(grep -c '^fsync .*/\.sh-[0-2]\.dfs\.tmp\.' "$TR")" -eq 3 ] && pass "  ... (each once)" ||
    fail "shard fsyncs" "$(cat "$TR")"

# ---- an export ----------------------------------------------------------------------
tmpd="$(q "$R")/\.ex\.tmp\.[A-Za-z0-9]{6}"
traced "export under the tracer" dflash-pack --export "$R/ex" "$R/a.dfs"
order "export: one syncfs of the temporary directory, then the rename, then fsync of the parent" \
    "syncfs $tmpd" "rename $tmpd $(q "$R/ex")" "fsync $(q "$R")"
n=$(grep -c '^fsync ' "$TR")
[ "$n" -eq 1 ] && pass "  ... and no fsync per exported file (90 files, 1 fsync)" ||
    fail "export fsyncs" "$n fsyncs: $(grep '^fsync' "$TR" | head -3)"
[ "$(ls "$R/ex" | wc -l)" -eq 31 ] && pass "  ... and the export is whole" || fail "export output" "$(ls "$R/ex" | wc -l)"
traced "export over an earlier one" dflash-pack --export "$R/ex" "$R/a.dfs"
order "  ... synced, exchanged in one step, the parent synced, then the old one removed" \
    "syncfs $tmpd" "exchange $tmpd $(q "$R/ex")" "fsync $(q "$R")" "rmdir $tmpd"
tmpo="$(q "$R")/\.ex\.old\.[A-Za-z0-9]{6}"
SYNC_TRACE_FAIL=exchange traced "export over an earlier one, without RENAME_EXCHANGE" \
    dflash-pack --export "$R/ex" "$R/a.dfs"
order "  ... synced, two renames, the parent synced, then the old one removed" \
    "syncfs $tmpd" "rename $(q "$R/ex") $tmpo" "rename $tmpd $(q "$R/ex")" "fsync $(q "$R")" "rmdir $tmpo"
[ "$(ls "$R/ex" | wc -l)" -eq 31 ] && [ -z "$(ls -A "$R" | grep '^\.ex\.')" ] &&
    pass "  ... and the export is whole, nothing left beside it" || fail "export by renames" "$(ls -A "$R")"

rm -f "$TR"
SYNC_TRACE=$TR SYNC_TRACE_FAIL=syncfs LD_PRELOAD=$SHIM \
    expect_exit 74 "export: a failed sync is an I/O error (74)" dflash-pack --export "$R/ex2" "$R/a.dfs"
grep -q "ex2: cannot sync the new output to disk: Input/output error" "$T/.err" &&
    pass "  ... naming the output" || fail "sync failure message" "$(cat "$T/.err")"
[ ! -e "$R/ex2" ] && [ -z "$(ls -A "$R" | grep '^\.ex2\.')" ] &&
    pass "  ... with nothing left, under the real name or a temporary one" || fail "failed export left" "$(ls -A "$R")"
rm -f "$TR"
SYNC_TRACE=$TR SYNC_TRACE_FAIL=syncfs LD_PRELOAD=$SHIM \
    expect_exit 74 "  ... and over an earlier export" dflash-pack --export "$R/ex" "$R/a.dfs"
[ "$(ls "$R/ex" | wc -l)" -eq 31 ] && ! grep -q '^exchange' "$TR" && pass "  ... which is kept as it was" ||
    fail "the earlier export after a failed sync" "$(ls "$R/ex" | wc -l)"

# ---- a checkpoint -------------------------------------------------------------------
tiny_target "$R/target" --layers 6 --seed 2
python3 -c "
import json
with open('$R/d.jsonl', 'w') as f:
    for i in range(4): f.write(json.dumps({'id': 's%d' % i, 'input_ids': [(7 * i + j) % 60 for j in range(30)]}) + '\n')"
dflash-extract -m "$R/target" -l 1,3,4 -o "$R/t.dfs" "$R/d.jsonl" 2>"$R/.x" || fail "setup" "$(cat "$R/.x")"
drafter_config "$R/drafter.json"
TRAIN="dflash-train-step --threads 1 --target $R/target --anchors 4 --batch-seqs 2 --loop --init $R/drafter.json"
traced "train-step under the tracer" $TRAIN --steps 1 --out "$R/ck" "$R/t.dfs"
tmpc="$(q "$R")/\.ck\.tmp\.[A-Za-z0-9]{6}"
for f in config.json model.safetensors trainer_state.safetensors trainer_state.json; do
    order "checkpoint: $f synced before the directory is renamed into place" \
        "fsync $tmpc/(\\.$(q "$f")\\.tmp\\.[A-Za-z0-9]{6}|$(q "$f"))" "rename $tmpc $(q "$R/ck")"
done
order "checkpoint: the directory synced, renamed, then the parent synced" \
    "fsync $tmpc" "rename $tmpc $(q "$R/ck")" "fsync $(q "$R")"

rm -f "$TR"
SYNC_TRACE=$TR SYNC_TRACE_FAIL=fsync:/config.json LD_PRELOAD=$SHIM \
    expect_exit 74 "checkpoint: config.json failing to sync is an I/O error (74)" \
    $TRAIN --steps 1 --out "$R/ck2" "$R/t.dfs"
grep -q "ck2: cannot sync the new output to disk" "$T/.err" && pass "  ... naming the checkpoint" ||
    fail "checkpoint sync failure message" "$(cat "$T/.err")"
[ ! -e "$R/ck2" ] && [ -z "$(ls -A "$R" | grep '^\.ck2\.')" ] && pass "  ... with nothing left" ||
    fail "failed checkpoint left" "$(ls -A "$R")"

# ---- dflash-extract -o --------------------------------------------------------------
traced "extract under the tracer" dflash-extract -m "$R/target" -l 1,3,4 -o "$R/x.dfs" "$R/d.jsonl"
tmpx="$(q "$R")/\.x\.dfs\.tmp\.[A-Za-z0-9]{6}"
order "extract -o: fsync, rename, fsync of the directory" \
    "fsync $tmpx" "rename $tmpx $(q "$R/x.dfs")" "fsync $(q "$R")"
