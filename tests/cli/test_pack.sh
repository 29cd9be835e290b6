#!/usr/bin/env bash
# test_pack.sh: dflash-pack merge, shuffle, split, shards, re-encode,
# inspect, stats, verify, export and its refusals. Record identities are
# checked through --inspect with jq, counts and sums through Python.
source "$(dirname "$0")/lib.sh"
PY=/usr/bin/python3
GEN=$DFLASH_BUILD/tests/dfs_datagen
export SOURCE_DATE_EPOCH=1764460800   # reproducible "created", so outputs compare with cmp

$GEN -n 40 -t 12 --tokens-max 30 -H 16 -K 2 --id-prefix a -o "$T/a.dfs"
$GEN -n 25 -t 12 --tokens-max 30 -H 16 -K 2 --id-prefix b --seed 2 -o "$T/b.dfs"
ids() { dflash-pack --inspect "$@" | jq -r 'select(.type=="sample").id'; }

# ---- merge -----------------------------------------------------------------
check "merge two inputs" dflash-pack -o "$T/m.dfs" "$T/a.dfs" "$T/b.dfs"
[ "$(ids "$T/a.dfs" "$T/b.dfs")" = "$(ids "$T/m.dfs")" ] && pass "merge keeps records in order" || fail "merge order"
cat "$T/a.dfs" | dflash-pack - "$T/b.dfs" >"$T/m2.dfs" && cmp -s "$T/m.dfs" "$T/m2.dfs" &&
    pass "stdin and stdout ('-', no -o)" || fail "stdin and stdout"
dflash-pack <"$T/a.dfs" >"$T/m3.dfs" && [ "$(ids "$T/m3.dfs")" = "$(ids "$T/a.dfs")" ] &&
    pass "no inputs reads stdin" || fail "no inputs reads stdin"
# Merged payloads are copied, not re-encoded: the tensors' checksums are unchanged.
[ "$(dflash-pack --inspect "$T/a.dfs" "$T/b.dfs" | jq -c 'select(.type=="sample").tensors|map(.xxh64)')" = \
  "$(dflash-pack --inspect "$T/m.dfs" | jq -c 'select(.type=="sample").tensors|map(.xxh64)')" ] &&
    pass "merge copies stored bytes" || fail "merge copies stored bytes"

$GEN -n 3 -H 16 -K 3 -o "$T/k3.dfs"
expect_exit 65 "inputs with other layer ids are refused" dflash-pack -o "$T/x.dfs" "$T/a.dfs" "$T/k3.dfs"
grep -q 'layer_ids: \[1,6\] vs \[1,3,6\]' "$T/.err" && pass "refusal names the field and both values" ||
    fail "refusal message" "$(cat "$T/.err")"
[ ! -e "$T/x.dfs" ] && pass "no output after a refusal" || fail "no output after a refusal"
# The modes that read the inputs as one whole refuse them the same way:
# --stats would add up hidden tensors of other widths, --export would write
# one stream.json that is wrong for some records, and --verify would pass
# inputs whose concatenation it refuses.
for mode in --verify --stats "--export $T/xd"; do
    expect_exit 65 "$mode: inputs with other layer ids are refused" dflash-pack $mode "$T/a.dfs" "$T/k3.dfs"
    grep -qF "k3.dfs: stream header differs from that of $T/a.dfs (values there vs here): layer_ids: [1,6] vs [1,3,6]" "$T/.err" &&
        pass "$mode: refusal names both files, the field and both values" || fail "$mode refusal message" "$(cat "$T/.err")"
done
[ ! -e "$T/xd" ] && pass "--export: nothing written after a refusal" || fail "--export wrote $(ls "$T/xd")"
# Standard input among the inputs is checked before anything is written too
# (and kept for the export, since it cannot be opened twice).
expect_exit 65 "--export: a differing stdin is refused" sh -c "dflash-pack --export '$T/xd' '$T/a.dfs' - <'$T/k3.dfs'"
[ ! -e "$T/xd" ] && pass "  ... before anything is written" || fail "--export with stdin wrote $(ls "$T/xd")"
check "--export: stdin between two files" sh -c "dflash-pack --export '$T/xs' '$T/a.dfs' - '$T/a.dfs' <'$T/b.dfs'"
[ -f "$T/xs/000040-b-0/hidden.npy" ] && [ -f "$T/xs/000065-a-0/hidden.npy" ] && [ "$(ls "$T/xs" | wc -l)" -eq 106 ] &&
    pass "  ... exports its records in place" || fail "--export with stdin" "$(ls "$T/xs" | sed -n '40,42p')"
# A pipe that is not stdin (process substitution, a named FIFO) cannot be
# opened twice either: --export keeps it open from the header check on (it
# was reopened, read past its header: "bad magic", or a FIFO hung forever).
check "--export: a process substitution among the inputs" \
    bash -c "dflash-pack --export '$T/xp' '$T/a.dfs' <(cat '$T/b.dfs')"
[ "$(ls "$T/xp" | wc -l)" -eq 66 ] && [ -f "$T/xp/000064-b-24/hidden.npy" ] &&
    pass "  ... exports its records" || fail "--export with a process substitution" "$(ls "$T/xp" | tail -2)"
mkfifo "$T/ef.fifo"
(cat "$T/b.dfs" >"$T/ef.fifo" &)
check "--export: a named FIFO among the inputs" timeout 20 dflash-pack --export "$T/xf" "$T/a.dfs" "$T/ef.fifo"
[ "$(ls "$T/xf" | wc -l)" -eq 66 ] && pass "  ... exports its records" || fail "--export with a FIFO" "$(ls "$T/xf" | wc -l)"
# Standard input twice is refused before anything is read or written, in
# every mode (--inspect printed the first copy and then failed with 65,
# "empty input", on the second).
for mode in "-o $T/x.dfs" --inspect --stats --verify "--export $T/x2"; do
    expect_exit 2 "$mode: stdin twice is refused" sh -c "dflash-pack $mode - - <'$T/a.dfs'"
    grep -qx "dflash-pack: stdin ('-') can be read only once" "$T/.err" && [ ! -s "$T/.out" ] &&
        [ ! -e "$T/x.dfs" ] && [ ! -e "$T/x2" ] && pass "  ... named, nothing written" ||
        fail "$mode: stdin twice" "$(head -c 300 "$T/.err"; head -c 100 "$T/.out")"
done
# So is the same pipe or FIFO under two names, before anything is read or
# written: '-' and /dev/stdin failed later with 65 ("empty input", or "bad
# magic" when merging), and a FIFO named twice waited for a second writer.
mkfifo "$T/twice.fifo"
for mode in "-o $T/x.dfs" --inspect --stats --verify "--export $T/x2"; do
    expect_exit 2 "$mode: - and /dev/stdin (one pipe) are refused" sh -c "cat '$T/a.dfs' | dflash-pack $mode - /dev/stdin"
    grep -qxF "dflash-pack: stdin ('-') and /dev/stdin are the same pipe or FIFO, which can be read only once" "$T/.err" &&
        [ ! -s "$T/.out" ] && [ ! -e "$T/x.dfs" ] && [ ! -e "$T/x2" ] && pass "  ... both named, nothing written" ||
        fail "$mode: - and /dev/stdin" "$(head -c 300 "$T/.err"; head -c 100 "$T/.out")"
    expect_exit 2 "$mode: a FIFO named twice is refused" timeout 20 dflash-pack $mode "$T/a.dfs" "$T/twice.fifo" "$T/twice.fifo"
    grep -qxF "dflash-pack: $T/twice.fifo and $T/twice.fifo are the same pipe or FIFO, which can be read only once" "$T/.err" &&
        [ ! -s "$T/.out" ] && [ ! -e "$T/x.dfs" ] && [ ! -e "$T/x2" ] && pass "  ... both named, nothing written" ||
        fail "$mode: a FIFO twice" "$(head -c 300 "$T/.err"; head -c 100 "$T/.out")"
done
# A regular file can be read twice, also as stdin and by name.
check "--verify of a file named twice" dflash-pack --verify "$T/a.dfs" "$T/a.dfs"
check "--verify of a file as stdin and by name" sh -c "dflash-pack --verify - '$T/a.dfs' <'$T/a.dfs'"
grep -qx 'OK 80 records' "$T/.out" && pass "  ... reads it twice" || fail "file as stdin and by name" "$(cat "$T/.out")"
# The inputs are read one at a time: a few descriptors do for many shards.
for i in $(seq 30); do ln -s "$T/b.dfs" "$T/many-$i.dfs"; done
check "--verify of 30 inputs under ulimit -n 12" sh -c "ulimit -n 12; dflash-pack --verify '$T'/many-*.dfs"
grep -qx 'OK 750 records' "$T/.out" && pass "  ... reads them all" || fail "--verify of 30 inputs" "$(cat "$T/.out")"
# Merging reads them one at a time too (it opened all at once: more inputs
# than the hard limit of open files failed with 66, "Too many open files").
check "merge of 30 inputs under ulimit -n 12" sh -c "ulimit -n 12; dflash-pack -o '$T/many.dfs' '$T'/many-*.dfs"
[ "$(dflash-pack --stats --json "$T/many.dfs" | jq .records)" = 750 ] && pass "  ... merges them all" ||
    fail "merge of 30 inputs" "$(dflash-pack --stats --json "$T/many.dfs" | jq .records)"
check "--shuffle --split of 30 inputs under ulimit -n 12" \
    sh -c "ulimit -n 12; dflash-pack --shuffle --split a=1,b=1 -o '$T/msp-%s.dfs' '$T'/many-*.dfs"
$GEN -n 3 -H 32 -K 2 -o "$T/h32.dfs"
expect_exit 65 "inputs with another hidden size are refused" dflash-pack -o "$T/x.dfs" "$T/a.dfs" "$T/h32.dfs"
grep -q 'target.hidden_size: 16 vs 32' "$T/.err" && pass "hidden size named" || fail "hidden size named" "$(cat "$T/.err")"

# ---- shuffle -----------------------------------------------------------------
dflash-pack --shuffle --seed 7 -o "$T/s7.dfs" "$T/a.dfs" "$T/b.dfs"
dflash-pack --shuffle --seed 7 -o "$T/s7b.dfs" "$T/a.dfs" "$T/b.dfs"
dflash-pack --shuffle --seed 8 -o "$T/s8.dfs" "$T/a.dfs" "$T/b.dfs"
cmp -s "$T/s7.dfs" "$T/s7b.dfs" && pass "shuffle is deterministic per seed" || fail "shuffle deterministic"
[ "$(ids "$T/s7.dfs")" != "$(ids "$T/s8.dfs")" ] && pass "different seeds give different orders" || fail "seeds differ"
[ "$(ids "$T/s7.dfs")" != "$(ids "$T/m.dfs")" ] && pass "shuffle changes the order" || fail "shuffle changes order"
[ "$(ids "$T/s7.dfs" | sort)" = "$(ids "$T/m.dfs" | sort)" ] && [ "$(ids "$T/s7.dfs" | sort -u | wc -l)" -eq 65 ] &&
    pass "each record of both inputs exactly once" || fail "each record exactly once"
# External memory: a tiny --mem spills into buckets (128 open bucket files
# prove it, under a limit of 40), and gives the very same bytes as the
# in-memory shuffle.
mkdir -p "$T/tmp"
expect_exit 73 "tiny --mem uses --tmpdir" sh -c "ulimit -n 40; dflash-pack --shuffle --seed 7 --mem 4K --tmpdir '$T/tmp' -o '$T/x.dfs' '$T/a.dfs' '$T/b.dfs'"
check "default --mem holds this input in memory" sh -c "ulimit -n 40; dflash-pack --shuffle --seed 7 --tmpdir '$T/tmp' -o '$T/x.dfs' '$T/a.dfs' '$T/b.dfs'"
# A --tmpdir that cannot hold the buckets is refused before any input is
# read (it failed only once --mem was full, after reading that much; here,
# with the default --mem, never: the run passed).
: >"$T/afile"
for d in "$T/nonexistent" "$T/afile"; do
    rm -f "$T/x.dfs"
    expect_exit 73 "--shuffle --tmpdir ${d#$T/}: refused" timeout 20 dflash-pack --shuffle --tmpdir "$d" -o "$T/x.dfs" "$T/ef.fifo"
    grep -q "^dflash-pack: $d: --tmpdir: " "$T/.err" && [ ! -e "$T/x.dfs" ] && pass "  ... before reading, named" ||
        fail "--tmpdir ${d#$T/} refusal" "$(head -c 300 "$T/.err")"
done
for mem in 4K 40K 200K; do
    dflash-pack --shuffle --seed 7 --mem $mem --tmpdir "$T/tmp" -o "$T/se.dfs" "$T/a.dfs" "$T/b.dfs" &&
        cmp -s "$T/s7.dfs" "$T/se.dfs" && pass "--mem $mem gives the in-memory order" || fail "--mem $mem order"
done
[ -z "$(ls -A "$T/tmp")" ] && pass "temporary buckets removed" || fail "temporary buckets removed" "$(ls "$T/tmp")"

# ---- split -------------------------------------------------------------------
check "split" dflash-pack --split train=0.7,val=0.3 -o "$T/sp-%s.dfs" "$T/m.dfs"
[ "$(cat <(ids "$T/sp-train.dfs") <(ids "$T/sp-val.dfs") | sort)" = "$(ids "$T/m.dfs" | sort)" ] &&
    pass "split partitions the records" || fail "split partitions"
n_val=$(ids "$T/sp-val.dfs" | wc -l)
[ "$n_val" -ge 8 ] && [ "$n_val" -le 32 ] && pass "split fractions roughly kept ($n_val of 65 in val)" || fail "split fractions" "$n_val"
# Shard by shard (each input split on its own, shuffled) lands every id in the same part.
dflash-pack --split train=0.7,val=0.3 --shuffle --seed 3 -o "$T/spa-%s.dfs" "$T/a.dfs"
dflash-pack --split train=0.7,val=0.3 -o "$T/spb-%s.dfs" "$T/b.dfs"
[ "$(cat <(ids "$T/spa-val.dfs") <(ids "$T/spb-val.dfs") | sort)" = "$(ids "$T/sp-val.dfs" | sort)" ] &&
    pass "split is by id: same parts shard by shard and shuffled" || fail "split determinism"
# The rule is (XXH64(id) >> 11) / 2^53 against cumulative fractions, computed here independently.
check "split matches the documented rule (python XXH64)" $PY - "$T" "$here/tests/interop" <<'PYEOF'
import sys, subprocess, json
sys.path.insert(0, sys.argv[2])
import dfs_py
T = sys.argv[1]
def ids(p):
    out = subprocess.run(["dflash-pack", "--inspect", p], capture_output=True, check=True).stdout.decode()
    return [j["id"] for j in map(json.loads, out.splitlines()) if j["type"] == "sample"]
for part, want in (("train", 0), ("val", 1)):
    for i in ids("%s/sp-%s.dfs" % (T, part)):
        u = (dfs_py.xxh64(i.encode()) >> 11) / 2.0**53
        assert (0 if u < 0.7 else 1) == want, (i, u, part)
PYEOF
expect_exit 2 "--split needs %s in -o" dflash-pack --split a=1,b=1 -o "$T/x.dfs" "$T/a.dfs"
expect_exit 2 "--split rejects a bad fraction" dflash-pack --split a=0,b=1 -o "$T/x-%s.dfs" "$T/a.dfs"
expect_exit 2 "--split rejects a repeated name" dflash-pack --split a=1,a=1 -o "$T/x-%s.dfs" "$T/a.dfs"
# a fraction past 63 characters is read whole (the rest was dropped: 1.0...0junk was 1)
expect_exit 2 "--split rejects junk after a long fraction" dflash-pack --split "a=1.$(printf '0%.0s' {1..70})junk,b=1" \
    -o "$T/x-%s.dfs" "$T/a.dfs"
if grep -q "junk': the fraction is not a positive number" "$T/.err"; then pass "  ... naming --split and the part"
else fail "long --split fraction message" "$(cat "$T/.err")"; fi
expect_exit 2 "--split rejects a trailing comma" dflash-pack --split a=1,b=1, -o "$T/x-%s.dfs" "$T/a.dfs"
expect_exit 2 "--split rejects fractions whose sum overflows" dflash-pack --split a=1e308,b=1e308 -o "$T/x-%s.dfs" "$T/a.dfs"
grep -q 'add up to more than' "$T/.err" && pass "--split overflow explained" || fail "--split overflow message" "$(cat "$T/.err")"

# ---- shards ----------------------------------------------------------------
check "shards" dflash-pack --shards 3 -o "$T/sh-%03d.dfs" "$T/m.dfs"
[ "$(ids "$T/sh-000.dfs" | head -2 | tr '\n' ' ')" = "a-0 a-3 " ] && [ "$(ids "$T/sh-001.dfs" | head -1)" = "a-1" ] &&
    pass "shards are dealt round-robin" || fail "round-robin"
[ "$(ids "$T/sh-000.dfs" | wc -l)" -eq 22 ] && [ "$(ids "$T/sh-002.dfs" | wc -l)" -eq 21 ] &&
    pass "shard sizes 22/22/21" || fail "shard sizes"
dflash-pack --shards 2 --shuffle --seed 7 -o "$T/ss-%d.dfs" "$T/a.dfs" "$T/b.dfs"
[ "$(ids "$T/ss-0.dfs" "$T/ss-1.dfs" | sort)" = "$(ids "$T/m.dfs" | sort)" ] &&
    [ "$(ids "$T/ss-0.dfs" | head -1)" = "$(ids "$T/s7.dfs" | head -1)" ] &&
    [ "$(ids "$T/ss-1.dfs" | head -1)" = "$(ids "$T/s7.dfs" | sed -n 2p)" ] &&
    pass "shuffled shards deal the shuffled order" || fail "shuffled shards"
expect_exit 2 "--shards needs %d in -o" dflash-pack --shards 2 -o "$T/x.dfs" "$T/a.dfs"
# A width too large for a file name is refused: the number was cut off the
# end of it, every shard got one name, and all but one were lost (exit 0).
mkdir -p "$T/wide"
for w in %0150d %200d %0999d; do
    expect_exit 2 "--shards -o 'p-$w': refused" dflash-pack --shards 2 -o "$T/wide/p-$w" "$T/a.dfs"
    grep -q 'width' "$T/.err" && [ -z "$(ls -A "$T/wide")" ] && pass "  ... said, nothing written" ||
        fail "--shards -o 'p-$w'" "$(head -c 200 "$T/.err"; ls "$T/wide" | head -c 100)"
done
expect_exit 2 "--split and --shards exclude each other" dflash-pack --shards 2 --split a=1 -o "$T/x-%d.dfs" "$T/a.dfs"

# Many shards: each output is a registered temporary file until the end (more
# than 64 used to abort on an assertion and leave them all behind). With at
# least as many shards as records, shard i holds record i and the rest are
# empty streams.
shard_list() { local i; for ((i = 0; i < $2; i++)); do echo "$1-$i.dfs"; done; }
dealt() { dflash-pack --inspect $(shard_list "$1" "$2") | jq -r 'select(.type=="sample") | "\(.file) \(.id)"'; }
deal() { ids "$2" | awk -v p="$1" '{ print p "-" (NR - 1) ".dfs", $0 }'; }
no_tmp() { [ -z "$(ls -A "$1" | grep '\.tmp\.')" ]; }
mkdir -p "$T/many/tmp"
for n in 65 300; do
    check "--shards $n" dflash-pack --shards $n -o "$T/many/p$n-%d.dfs" "$T/m.dfs"
    [ "$(dealt "$T/many/p$n" $n)" = "$(deal "$T/many/p$n" "$T/m.dfs")" ] &&
        [ "$(dflash-pack --inspect $(shard_list "$T/many/p$n" $n) | grep -c '"type":"stream"')" = $n ] &&
        pass "--shards $n: $n streams, shard i holds record i" || fail "--shards $n: $n streams, shard i holds record i"
done
check "--shards 300 --shuffle, spilling" dflash-pack --shards 300 --shuffle --seed 7 --mem 4K --tmpdir "$T/many/tmp" \
    -o "$T/many/s-%d.dfs" "$T/a.dfs" "$T/b.dfs"
[ "$(dealt "$T/many/s" 300)" = "$(deal "$T/many/s" "$T/s7.dfs")" ] &&
    pass "--shards 300 --shuffle: the shuffled order dealt" || fail "--shards 300 --shuffle: the shuffled order dealt"
no_tmp "$T/many" && [ -z "$(ls -A "$T/many/tmp")" ] && pass "many shards: no temporary file or bucket left" ||
    fail "many shards: no temporary file or bucket left" "$(ls -A "$T/many" "$T/many/tmp" | grep -v '^[ps]' | head -5)"
# --shards 4096, the most it takes, needs more than the usual soft limit of
# 1024 open files: dflash-pack raises it (up to the hard limit).
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -ge 8192 ]; then
    mkdir -p "$T/most"
    (ulimit -Sn 1024 && dflash-pack --shards 4096 -o "$T/most/p-%d.dfs" "$T/m.dfs") 2>"$T/.err"
    rc=$?
    [ $rc = 0 ] && [ "$(ls "$T/most" | grep -c '^p-[0-9]*\.dfs$')" = 4096 ] && no_tmp "$T/most" &&
        [ "$(dflash-pack --stats --json "$T"/most/p-*.dfs | jq .records)" = 65 ] &&
        pass "--shards 4096 under ulimit -Sn 1024: 4096 shards, 65 records" ||
        fail "--shards 4096 under ulimit -Sn 1024" "rc $rc: $(head -c 300 "$T/.err")"
    rm -rf "$T/most"
else
    echo "SKIP --shards 4096: the hard limit of open files is $hard"
fi
# Interrupted with 300 temporary outputs and the shuffle's buckets: nothing
# of them is left.
d=$T/many-kill
mkdir -p "$d/tmp"
mkfifo "$d.fifo"
dflash-pack --shards 300 --shuffle --mem 2K --tmpdir "$d/tmp" -o "$d/p-%d.dfs" - <"$d.fifo" &
pid=$!
exec 3>"$d.fifo"
cat "$T/a.dfs" >&3            # no end of input: the tool waits for more
for _ in $(seq 200); do [ -n "$(ls -A "$d/tmp")" ] && [ "$(ls -A "$d" | grep -c '\.tmp\.')" = 300 ] && break; sleep 0.05; done
[ "$(ls -A "$d" | grep -c '\.tmp\.')" = 300 ] && [ -n "$(ls -A "$d/tmp")" ] &&
    pass "--shards 300: 300 temporary outputs and buckets before the kill" || fail "--shards 300: temporary outputs before the kill" "$(ls -A "$d" | head -3)"
kill -TERM $pid
wait $pid 2>/dev/null
rc=$?
exec 3>&-
rm -f "$d.fifo"
left=$(cd "$d" && ls -A . tmp | grep -v -e '^tmp$' -e '^$' -e ':$' | head -3)
[ $rc = 143 ] && [ -z "$left" ] && pass "--shards 300, SIGTERM: no output, temporary or bucket file left (143)" ||
    fail "--shards 300, SIGTERM: leftovers" "rc $rc: $left"

# ---- re-encoding ------------------------------------------------------------
exports_equal() { rm -rf "$T/e1" "$T/e2"; dflash-pack --export "$T/e1" "$1" && dflash-pack --export "$T/e2" "$2" && diff -r -q -x stream.json "$T/e1" "$T/e2" >/dev/null; }
for enc in "--compress none" "--compress lz4 --byte-shuffle off" "--compress lz4" "--compress lz4 --accel 8"; do
    dflash-pack $enc -o "$T/re.dfs" "$T/a.dfs" && exports_equal "$T/a.dfs" "$T/re.dfs" &&
        pass "re-encode $enc keeps the values" || fail "re-encode $enc"
done
dflash-pack --compress none -o "$T/none.dfs" "$T/a.dfs"
[ "$(dflash-pack --inspect "$T/none.dfs" | jq -r 'select(.type=="sample").tensors[].codec' | sort -u)" = none ] &&
    pass "--compress none stores raw" || fail "--compress none"
dflash-pack --compress lz4 -o "$T/back.dfs" "$T/none.dfs"
[ "$(dflash-pack --inspect "$T/back.dfs" | jq -r 'select(.type=="sample").tensors[] | select(.name=="hidden") | "\(.codec) \(.shuffle)"' | sort -u)" = "lz4 true" ] &&
    pass "--compress lz4 shuffles by default" || fail "--compress lz4 default shuffle"
cmp -s <(dflash-pack --inspect "$T/back.dfs" | jq -c 'select(.type=="sample").tensors') \
       <(dflash-pack --inspect "$T/a.dfs" | jq -c 'select(.type=="sample").tensors') &&
    pass "lz4 re-encode reproduces the original stored bytes" || fail "lz4 re-encode bytes"
expect_exit 2 "--byte-shuffle on with --compress none" dflash-pack --compress none --byte-shuffle on -o "$T/x.dfs" "$T/a.dfs"

# ---- inspect, stats --------------------------------------------------------
dflash-pack --inspect "$T/a.dfs" >"$T/insp"
[ "$(head -1 "$T/insp" | jq -r '.type + " " + .format + " " + (.version|tostring) + " " + (.meta.layer_ids|tostring)')" = "stream dflash-stream [1,0] [1,6]" ] &&
    pass "inspect: stream header line" || fail "inspect header line" "$(head -1 "$T/insp")"
[ "$(jq -s 'map(select(.type=="sample")) | length' "$T/insp")" -eq 40 ] && pass "inspect: one line per record" || fail "inspect lines"
check "inspect: fields of a record line" jq -s -e 'map(select(.index==3))[0] | .id=="a-3" and .tokens==(.tensors[0].shape[0]) and (.tensors|map(.name)==["input_ids","loss_mask","hidden"]) and (.tensors[2].dtype=="bf16") and (.tensors[2].shape[1]==32) and (.tensors[2].raw==.tokens*64)' "$T/insp"
dflash-pack --stats --json "$T/a.dfs" "$T/b.dfs" >"$T/stats.json"
check "stats agree with an independent count" $PY - "$T/stats.json" "$T/a.dfs" "$T/b.dfs" "$here/tests/interop" <<'PYEOF'
import sys, json
sys.path.insert(0, sys.argv[4])
import dfs_py
st = json.load(open(sys.argv[1]))
rec = tok = sup = raw = stored = 0
for p in sys.argv[2:4]:
    for _, h, arrays in dfs_py.read_stream(p):
        rec += 1
        tok += len(arrays["input_ids"])
        sup += int(arrays["loss_mask"].sum())
        raw += sum(t["raw"] for t in h["tensors"])
        stored += sum(t["stored"] for t in h["tensors"])
assert (st["files"], st["segments"], st["records"], st["tokens"], st["supervised_tokens"], st["raw_bytes"], st["stored_bytes"]) == (2, 2, rec, tok, sup, raw, stored), (st, rec, tok, sup, raw, stored)
assert abs(st["ratio"] - raw / stored) < 1e-9
assert st["tensors"]["hidden"]["dtype"] == "bf16"
PYEOF
dflash-pack --stats "$T/a.dfs" >"$T/stats.txt"
grep -Eq '^records +40$' "$T/stats.txt" && grep -Eq '^hidden +bf16 ' "$T/stats.txt" && pass "stats text" || fail "stats text" "$(cat "$T/stats.txt")"

# ---- verify ----------------------------------------------------------------
check "verify a good stream" dflash-pack --verify "$T/m.dfs"
grep -qx 'OK 65 records' "$T/.out" && pass "verify prints OK N records" || fail "verify output" "$(cat "$T/.out")"
size=$(stat -c %s "$T/a.dfs")
for off in 20 700 $((size / 2)) $((size - 30)); do
    cp "$T/a.dfs" "$T/flip.dfs"
    printf '\x55' | dd of="$T/flip.dfs" bs=1 seek=$off conv=notrunc 2>/dev/null
    cmp -s "$T/a.dfs" "$T/flip.dfs" && printf '\xaa' | dd of="$T/flip.dfs" bs=1 seek=$off conv=notrunc 2>/dev/null
    expect_exit 65 "verify catches a flipped byte at $off" dflash-pack --verify "$T/flip.dfs"
done
grep -Eq "flip.dfs: byte [0-9]+ \(record [0-9]+\): " "$T/.err" && pass "error names file, byte offset and record" ||
    fail "error format" "$(cat "$T/.err")"
head -c $((size - 5)) "$T/a.dfs" >"$T/cut.dfs"
expect_exit 65 "verify catches truncation" dflash-pack --verify "$T/cut.dfs"
grep -q truncated "$T/.err" && pass "truncation is named" || fail "truncation named" "$(cat "$T/.err")"
expect_exit 66 "missing input" dflash-pack --verify "$T/nope.dfs"
mkdir -p "$T/adir"
expect_exit 66 "a directory as an input" dflash-pack --verify "$T/adir"
grep -qx "dflash-pack: $T/adir: is a directory" "$T/.err" && pass "  ... is named" || fail "directory input message" "$(cat "$T/.err")"
: >"$T/empty.dfs"
expect_exit 65 "empty input" dflash-pack --verify "$T/empty.dfs"
# Hidden-state rules: a token id beyond the vocabulary (the datagen meta says 1000).
$GEN -n 2 -t 5 -H 16 -K 2 --vocab 5000 -o "$T/v5000.dfs"
$PY - "$T/v5000.dfs" "$T/v1000.dfs" <<'PYEOF'
import sys, msgpack, struct
sys.path.insert(0, "tests/interop")
import dfs_py
src, dst = sys.argv[1:]
with open(src, "rb") as f, open(dst, "wb") as out:
    for off, h, payload in dfs_py.read_records(f):
        if h["type"] == "stream":
            h["meta"]["target"]["vocab_size"] = 10   # ids up to 5000 are now out of range
        dfs_py._record(out, h, payload)
PYEOF
expect_exit 65 "verify checks token ids against the vocabulary" dflash-pack --verify "$T/v1000.dfs"
grep -Eq 'v1000.dfs: byte [0-9]+ \(record 1\): sample "s-0": tensor "input_ids"\[[0-9]+\] is [0-9]+, outside' "$T/.err" &&
    pass "token id error named, in the reader's form FILE: byte N (record N)" || fail "token id error" "$(cat "$T/.err")"
# A hidden-state meta that breaks its rules: the first header, byte 0, record 0.
$PY - "$T/v5000.dfs" "$T/rep.dfs" <<'PYEOF'
import sys
sys.path.insert(0, "tests/interop")
import dfs_py
src, dst = sys.argv[1:]
with open(src, "rb") as f, open(dst, "wb") as out:
    for off, h, payload in dfs_py.read_records(f):
        if h["type"] == "stream":
            h["meta"]["layer_ids"] = [1, 1]
        dfs_py._record(out, h, payload)
PYEOF
expect_exit 65 "verify checks the hidden-state meta" dflash-pack --verify "$T/rep.dfs"
grep -qF 'rep.dfs: byte 0 (record 0): stream meta: "layer_ids" repeats a layer' "$T/.err" &&
    pass "meta error in the reader's form FILE: byte 0 (record 0)" || fail "meta error" "$(cat "$T/.err")"

# ---- export ------------------------------------------------------------------
check "export" dflash-pack --export "$T/ex" "$T/a.dfs"
[ -f "$T/ex/000000-a-0/hidden.npy" ] && [ -f "$T/ex/000039-a-39/loss_mask.npy" ] && [ -f "$T/ex/stream.json" ] &&
    pass "export layout DIR/INDEX-ID/NAME.npy" || fail "export layout" "$(ls "$T/ex" | head)"
check "numpy loads the export" $PY -c "
import numpy as np, sys
h = np.load('$T/ex/000000-a-0/hidden.npy'); i = np.load('$T/ex/000000-a-0/input_ids.npy')
m = np.load('$T/ex/000000-a-0/loss_mask.npy')
assert h.dtype == np.float32 and h.shape == (i.shape[0], 32) and i.dtype == np.int32 and m.dtype == np.uint8
assert ((h.view(np.uint32) & 0xffff) == 0).all()   # bf16 values, exactly
"

# Tensor names that reduce to one file name ("a/b", "a_b") are refused: one
# file would have silently replaced the other.
$PY - "$T/collide.dfs" "$here/tests/interop" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np
from dfs_py import _record, stream_header, encode, sample_record, end_record
with open(sys.argv[1], "wb") as f:
    _record(f, stream_header({}))
    sample_record(f, "ok", [encode("a/b", np.array([1], np.int32), "i32", "none", False)])
    sample_record(f, "c", [encode("a/b", np.array([1], np.int32), "i32", "none", False),
                           encode("x", np.array([3], np.int32), "i32", "none", False),
                           encode("a_b", np.array([2], np.int32), "i32", "none", False)])
    end_record(f, 2)
PYEOF
expect_exit 65 "export: two tensors of one file name are refused" dflash-pack --export "$T/cx" "$T/collide.dfs"
grep -Eq 'collide.dfs: byte [0-9]+ \(record 2\): sample "c": tensors "a/b" and "a_b" would both be exported as a_b.npy' "$T/.err" &&
    pass "  ... naming the record and both tensors" || fail "export collision message" "$(cat "$T/.err")"
[ ! -e "$T/cx" ] && [ -z "$(ls -A "$T" | grep '^\.cx\.')" ] && pass "  ... and no export, not even the records before it" ||
    fail "export collision output" "$(ls -AR "$T/cx" 2>&1; ls -A "$T" | grep '^\.cx\.')"

# The export is written into a temporary directory beside DIR and put in
# place only when complete: an error or a signal leaves DIR as it was (absent,
# or the previous export whole), and a smaller export replaces a larger one
# whole. It was filled record by record under its real name: a damaged input
# left half an export, and a re-export left the earlier one's extra records
# beside the new stream.json (a loader globbing DIR got a mix of both).
leftovers() { ls -A "$(dirname "$1")" | grep -F ".$(basename "$1")." ; }
records() { ls "$1" | grep -c '^[0-9]\{6\}-'; }
check "re-export: a larger export first" dflash-pack --export "$T/rx" "$T/a.dfs"
check "re-export: a smaller stream over it" dflash-pack --export "$T/rx" "$T/b.dfs"
[ "$(records "$T/rx")" = 25 ] && [ -z "$(ls "$T/rx" | grep -e '-a-')" ] && [ -f "$T/rx/stream.json" ] &&
    [ "$(ls "$T/rx/000024-b-24")" = "$(ls "$T/ex/000000-a-0")" ] && [ -z "$(leftovers "$T/rx")" ] &&
    pass "  ... leaves exactly the new records, no temporary directory" ||
    fail "re-export over a larger export" "$(records "$T/rx") records: $(ls "$T/rx" | grep -e '-a-' | head -2) $(leftovers "$T/rx")"
size=$(stat -c %s "$T/a.dfs")
head -c $((size / 2)) "$T/a.dfs" >"$T/half.dfs"
expect_exit 65 "export of a stream truncated midway" dflash-pack --export "$T/hx" "$T/half.dfs"
grep -q 'half.dfs: byte [0-9]* (record [0-9]*): truncated' "$T/.err" && [ ! -e "$T/hx" ] && [ -z "$(leftovers "$T/hx")" ] &&
    pass "  ... is named, and leaves no DIR and no temporary directory" ||
    fail "truncated export leftovers" "$(cat "$T/.err"; ls -A "$T/hx" 2>&1 | head -3; leftovers "$T/hx")"
cp -a "$T/rx" "$T/rx.before"
expect_exit 65 "re-export of a stream truncated midway" dflash-pack --export "$T/rx" "$T/half.dfs"
diff -r "$T/rx.before" "$T/rx" >/dev/null && [ -z "$(leftovers "$T/rx")" ] &&
    pass "  ... leaves the previous export intact, no temporary directory" ||
    fail "truncated re-export" "$(diff -r "$T/rx.before" "$T/rx" | head -3; leftovers "$T/rx")"
rm -rf "$T/rx.before"

# DIR is checked before any input is read (a FIFO nobody writes would block
# the reading): anything but an earlier export, an empty directory or
# nothing is refused (73), naming what is in the way, and left untouched.
mkfifo "$T/never.fifo"
mkdir -p "$T/emp0/000000-x"   # "." and ".." from there: an empty directory, an export of one empty record
mkdir -p "$T/ud/data" && echo keep >"$T/ud/notes.txt" && echo keep >"$T/ud/data/x"
expect_exit 73 "export into an unrelated non-empty directory is refused" timeout 20 dflash-pack --export "$T/ud" "$T/never.fifo"
grep -Eq "ud: exists and holds '(notes.txt|data)', which is not part of this output" "$T/.err" &&
    [ "$(cat "$T/ud/notes.txt" "$T/ud/data/x")" = "$(printf 'keep\nkeep')" ] && [ "$(ls -A "$T/ud" | wc -l)" = 2 ] &&
    [ -z "$(leftovers "$T/ud")" ] && pass "  ... naming the path and what is in it, before reading, untouched" ||
    fail "unrelated DIR refusal" "$(cat "$T/.err"; ls -AR "$T/ud")"
cp -a "$T/rx" "$T/rx2" && echo note >"$T/rx2/000003-b-3/README"
expect_exit 73 "an export with a stray file in a record directory is refused" dflash-pack --export "$T/rx2" "$T/a.dfs"
grep -q "rx2: exists and holds '000003-b-3/README'" "$T/.err" && [ "$(records "$T/rx2")" = 25 ] &&
    [ -f "$T/rx2/000003-b-3/README" ] && pass "  ... naming it, untouched" || fail "stray file refusal" "$(cat "$T/.err")"
echo x >"$T/uf"
expect_exit 73 "export onto a plain file is refused" dflash-pack --export "$T/uf" "$T/a.dfs"
grep -q "uf: exists and is not a directory" "$T/.err" && [ "$(cat "$T/uf")" = x ] && pass "  ... untouched" ||
    fail "export onto a file" "$(cat "$T/.err")"
for dot in . ..; do
    expect_exit 73 "--export $dot is refused before reading (it cannot be renamed)" \
        sh -c "cd '$T/emp0/000000-x' && timeout 20 dflash-pack --export $dot '$T/never.fifo'"
    grep -q "$dot: the current or parent directory cannot be replaced" "$T/.err" && [ "$(ls -A "$T/emp0")" = 000000-x ] &&
        [ -z "$(ls -A "$T/emp0/000000-x")" ] &&
        pass "  ... said, nothing written" || fail "--export $dot refusal" "$(cat "$T/.err"; ls -A "$T/emp0")"
done
mkdir "$T/emp"
check "export into an empty directory" dflash-pack --export "$T/emp" "$T/b.dfs"
[ "$(records "$T/emp")" = 25 ] && [ -z "$(leftovers "$T/emp")" ] && pass "  ... fills it" || fail "export into an empty directory"

# SIGTERM during an export (its input still open: the records so far are
# in the temporary directory) leaves no temporary directory, and DIR as it
# was: absent, or the previous export whole.
$GEN -n 200 -t 8 --tokens-max 16 -H 16 -K 2 --id-prefix m -o "$T/many.dfs"   # 600 files, each synced: seconds
for prior in none export; do
    d=$T/ex-kill-$prior
    mkdir -p "$d"
    [ $prior = export ] && dflash-pack --export "$d/out" "$T/b.dfs" && cp -a "$d/out" "$T/out.before"
    mkfifo "$d.fifo"
    dflash-pack --export "$d/out" - <"$d.fifo" &
    pid=$!
    exec 3>"$d.fifo"
    cat "$T/many.dfs" >&3            # no end of input: the tool waits for more
    tmp() { ls -d "$d"/.out.tmp.* 2>/dev/null | head -1; }
    for _ in $(seq 600); do [ -n "$(tmp)" ] && [ "$(records "$(tmp)")" = 200 ] && break; sleep 0.05; done
    [ -n "$(tmp)" ] && [ "$(records "$(tmp)")" = 200 ] && pass "SIGTERM during --export ($prior before): 200 records in a temporary directory" ||
        fail "SIGTERM during --export ($prior before): the records before the kill" "$(ls -A "$d")"
    kill -TERM $pid
    wait $pid 2>/dev/null
    rc=$?
    exec 3>&-
    rm -f "$d.fifo"
    if [ $prior = none ]; then [ -z "$(ls -A "$d")" ]; else [ "$(ls -A "$d")" = out ] && diff -r "$T/out.before" "$d/out" >/dev/null; fi &&
        [ $rc = 143 ] && pass "  ... SIGTERM (143) leaves no temporary directory, and DIR as it was" ||
        fail "  ... SIGTERM during --export ($prior before)" "rc $rc: $(ls -A "$d" | head -3)"
done
rm -rf "$T/out.before"

# ---- usage and outputs ------------------------------------------------------
# --progress shows progress in every mode, as --help says (the read-only
# modes took it and showed nothing: a long --verify looked hung). The final
# line counts the records; stdout stays clean.
for mode in --verify --stats --inspect "--export $T/xpr" "-o $T/x.dfs"; do
    check "$mode --progress" dflash-pack $mode --progress "$T/a.dfs" "$T/b.dfs"
    tr '\r' '\n' <"$T/.err" | grep -Eq '^65 rec ' && ! grep -q ' rec ' "$T/.out" && pass "  ... on stderr: 65 rec" ||
        fail "$mode --progress" "$(tr '\r' '\n' <"$T/.err" | tail -2)"
done
expect_exit 2 "two modes at once" dflash-pack --inspect --verify "$T/a.dfs"
# Options that would do nothing are refused, as -o is with --inspect: a
# --seed without --shuffle gave the inputs' order, silently (with --split or
# --shards too, whose parts then came out unshuffled).
for opts in "--seed 7" "--seed 7 --shards 2" "--mem 4K" "--tmpdir $T" "--accel 8" "--compress none --accel 8" \
            "--inspect --seed 7" "--verify --accel 8" "--stats --mem 4K"; do
    rm -f "$T"/ig*.dfs
    case $opts in --inspect* | --verify* | --stats*) out= ;; *) out="-o $T/ig-%d.dfs" ;; esac
    expect_exit 2 "$opts: refused, it would do nothing" dflash-pack $opts $out "$T/a.dfs"
    grep -Eq -e '--(seed|mem|tmpdir|accel)[^:]* go(es)? with' "$T/.err" && [ ! -s "$T/.out" ] &&
        [ -z "$(ls "$T"/ig*.dfs 2>/dev/null)" ] && pass "  ... said, nothing written" ||
        fail "$opts refusal" "$(head -c 300 "$T/.err")"
done
check "--accel with --compress lz4" dflash-pack --compress lz4 --accel 8 -o "$T/x.dfs" "$T/a.dfs"
check "--accel with --byte-shuffle off (an LZ4 re-encoding)" dflash-pack --byte-shuffle off --accel 8 -o "$T/x.dfs" "$T/a.dfs"
check "--seed 0, --mem 1G and --accel 1 (the defaults) alone" dflash-pack --seed 0 --mem 1G --accel 1 -o "$T/x.dfs" "$T/a.dfs"
expect_exit 2 "unknown option" dflash-pack --frobnicate "$T/a.dfs"
check "--help" dflash-pack --help
grep -q -- '--shuffle' "$T/.out" && pass "--help lists options" || fail "--help lists options"
expect_exit 2 "binary stdout to a terminal is refused" $PY -c "
import os, pty, subprocess, sys
m, s = pty.openpty()
r = subprocess.run(['dflash-pack', '$T/a.dfs'], stdout=s, stderr=subprocess.PIPE)
sys.stderr.write(r.stderr.decode()); sys.exit(r.returncode)"
grep -q terminal "$T/.err" && pass "terminal refusal explained" || fail "terminal refusal message" "$(cat "$T/.err")"
expect_exit 2 "reading a stream from a terminal is refused" $PY -c "
import os, pty, subprocess, sys
m, s = pty.openpty()
r = subprocess.run(['dflash-pack', '--verify'], stdin=s, stderr=subprocess.PIPE)
sys.stderr.write(r.stderr.decode()); sys.exit(r.returncode)"
expect_exit 73 "unwritable output" dflash-pack -o "$T/no/such/dir/x.dfs" "$T/a.dfs"
# A closed stdout (>&-, as some daemons start their children) with nothing
# to print there is no error, as for cp or gzip -c >file: the output was
# written, and exit 74 ("writing output failed: Bad file descriptor") said
# otherwise. What does go to stdout still fails on a closed one.
rm -f "$T/cl.dfs"
check "-o FILE with stdout closed" sh -c "dflash-pack -o '$T/cl.dfs' '$T/a.dfs' >&-"
cmp -s <(ids "$T/cl.dfs") <(ids "$T/a.dfs") && pass "  ... writes the output" || fail "-o FILE with stdout closed: output"
check "--shards with stdout closed" sh -c "dflash-pack --shards 3 -o '$T/cl-%d.dfs' '$T/a.dfs' >&-"
check "--export with stdout closed" sh -c "dflash-pack --export '$T/clx' '$T/a.dfs' >&-"
expect_exit 74 "--verify with stdout closed: its line is lost, exit 74" sh -c "dflash-pack --verify '$T/a.dfs' >&-"
expect_exit 2 "--seed -1 is refused (as 2^64-1 is)" dflash-pack --shuffle --seed -1 -o "$T/x.dfs" "$T/a.dfs"
# SOURCE_DATE_EPOCH: refused unless it is a time "created" can hold (before
# any output exists); the last second of 9999 is the largest.
for v in abc -1 1e9 '' ' 5' 253402300800; do
    expect_exit 2 "SOURCE_DATE_EPOCH='$v' is refused" env SOURCE_DATE_EPOCH="$v" dflash-pack -o "$T/sde.dfs" "$T/a.dfs"
    grep -q "SOURCE_DATE_EPOCH: '$v' is not a count of seconds" "$T/.err" && [ ! -e "$T/sde.dfs" ] &&
        pass "  ... named, and no output" || fail "SOURCE_DATE_EPOCH='$v' refusal" "$(cat "$T/.err"; ls "$T/sde.dfs" 2>&1)"
done
SOURCE_DATE_EPOCH=253402300799 dflash-pack -o "$T/sde.dfs" "$T/a.dfs" &&
    [ "$(dflash-pack --inspect "$T/sde.dfs" | head -1 | jq -r .created)" = 9999-12-31T23:59:59Z ] &&
    pass "SOURCE_DATE_EPOCH=253402300799 gives 9999-12-31T23:59:59Z" || fail "SOURCE_DATE_EPOCH largest"

# A closed pipe ends the tool by SIGPIPE, as it ends cat (141); with SIGPIPE
# ignored the write fails with 74 (the pages said 74 for both). 2 MB of raw
# records: more than a pipe holds, so the writer is still writing.
$GEN -n 64 -t 128 -H 64 -K 2 -o "$T/big.dfs"
dflash-pack --compress none "$T/big.dfs" 2>"$T/.err" | head -c 10 >/dev/null
rc=${PIPESTATUS[0]}
[ $rc = 141 ] && [ ! -s "$T/.err" ] && pass "closed pipe: killed by SIGPIPE (141), silently" || fail "closed pipe: 141" "rc $rc: $(cat "$T/.err")"
(trap '' PIPE; dflash-pack --compress none "$T/big.dfs" 2>"$T/.err" | head -c 10 >/dev/null; exit ${PIPESTATUS[0]})
rc=$?
[ $rc = 74 ] && grep -q 'write failed: Broken pipe' "$T/.err" && pass "closed pipe, SIGPIPE ignored: write failed (74)" ||
    fail "closed pipe, SIGPIPE ignored: write failed (74)" "rc $rc: $(cat "$T/.err")"

# A killed write leaves neither the output nor a temporary file; a killed
# shuffle leaves no buckets.
for sig in TERM INT; do
    d=$T/kill-$sig
    mkdir -p "$d/tmp"
    mkfifo "$d.fifo"
    # (env: a background job of a script ignores SIGINT, and so would the tool)
    env --default-signal=INT,TERM dflash-pack --shuffle --mem 2K --tmpdir "$d/tmp" -o "$d/out.dfs" - <"$d.fifo" &
    pid=$!
    exec 3>"$d.fifo"
    cat "$T/a.dfs" >&3            # the whole stream but no end of input: the tool waits for more
    for _ in $(seq 100); do [ -n "$(ls -A "$d/tmp")" ] && [ -n "$(ls -A "$d" | grep -v '^tmp$')" ] && break; sleep 0.05; done
    [ -n "$(ls -A "$d/tmp")" ] && pass "SIG$sig: buckets exist before the kill" || fail "SIG$sig: no buckets before the kill"
    kill -$sig $pid
    wait $pid 2>/dev/null
    exec 3>&-
    rm -f "$d.fifo"
    left=$(cd "$d" && ls -A . tmp | grep -v -e '^tmp$' -e '^$' -e ':$')
    [ -z "$left" ] && pass "SIG$sig leaves no output, temporary or bucket file" || fail "SIG$sig cleanup" "$left"
done
