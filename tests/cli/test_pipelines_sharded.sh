#!/usr/bin/env bash
# slow
# pipelines/extract-sharded.sh with local GNU parallel jobs on the CPU:
#   - the joined stream holds the records of one unsharded dflash-extract, in
#     order: byte for byte with -b 1 (each sample its own forward pass), and
#     with the default packing the same tokens and masks and hidden states
#     within one bf16 rounding step (and f32 noise near 0) (checked in NumPy from --export);
#   - a re-run redoes nothing; a deleted piece is redone alone, then re-joined;
#   - another shard count over the same work directory is refused;
#   - --sshloginfile (":" is this host) and PACK_OPTS --split work;
#   - --device cuda without a GPU fails cleanly and marks nothing done.
. "$(dirname "$0")/lib.sh"

SH=$here/pipelines/extract-sharded.sh
PY=/usr/bin/python3
tiny_target "$T/target" --vocab 97 --intermediate 64 --layers 4 --tie no --seed 3
# 23 samples of 5..40 tokens (deterministic MINSTD in awk: same bytes everywhere).
awk 'BEGIN { x = 7; for (i = 0; i < 23; i++) { x = (x * 48271) % 2147483647; n = 5 + x % 36; s = ""; m = "";
      for (j = 0; j < n; j++) { x = (x * 48271) % 2147483647; s = s (j ? "," : "") x % 97; m = m (j ? "," : "") (j < 3 ? 0 : 1) }
      printf "{\"id\":\"q%d\",\"input_ids\":[%s],\"loss_mask\":[%s]}\n", i, s, m } }' >"$T/in.jsonl"
export SOURCE_DATE_EPOCH=1764460800
records() { dflash-pack --inspect "$@" | jq -c 'select(.type == "sample") | del(.file, .offset, .index)'; }

# ---- exact: one sample per forward pass on both sides --------------------------------
dflash-extract -m "$T/target" -l 0,2 -t 1 -b 1 --byte-shuffle on -o "$T/ref1.dfs" "$T/in.jsonl"
check "sharded run (-b 1, 4 pieces, 2 jobs)" "$SH" -m "$T/target" -l 0,2 -d cpu -j 2 -n 4 -t 1 \
    -o "$T/exact.dfs" "$T/in.jsonl" -- -b 1 --byte-shuffle on
if [ "$(records "$T/exact.dfs")" = "$(records "$T/ref1.dfs")" ] && [ "$(records "$T/ref1.dfs" | wc -l)" = 23 ]; then
    pass "joined stream = unsharded extraction, record for record (checksums of every tensor)"
else
    fail "joined stream = unsharded extraction, record for record"
fi
check "joined stream verifies" dflash-pack --verify "$T/exact.dfs"
[ "$(awk '$1 ~ /^[0-9]+$/' "$T/exact.work/joblog" | wc -l)" = 4 ] && [ "$(awk '$1 ~ /^[0-9]+$/ && $7 != 0' "$T/exact.work/joblog" | wc -l)" = 0 ] &&
    pass "joblog: 4 jobs, all exit 0" || fail "joblog: 4 jobs, all exit 0" "$(cat "$T/exact.work/joblog")"

# ---- default packing: same up to one bf16 rounding step ------------------------------
dflash-extract -m "$T/target" -l 0,2 -t 1 -o "$T/ref.dfs" "$T/in.jsonl"
check "sharded run (default packing, 3 pieces)" "$SH" -m "$T/target" -l 0,2 -d cpu -j 2 -n 3 -t 1 -o "$T/pk.dfs" "$T/in.jsonl"
dflash-pack --export "$T/ex-ref" "$T/ref.dfs" && dflash-pack --export "$T/ex-pk" "$T/pk.dfs"
check "default packing: ids and masks equal, hidden within 1 bf16 step" $PY - "$T/ex-ref" "$T/ex-pk" <<'EOF'
import numpy as np, os, sys
a, b = sys.argv[1], sys.argv[2]
da = sorted(d for d in os.listdir(a) if d[0].isdigit()); db = sorted(d for d in os.listdir(b) if d[0].isdigit())
assert da == db and len(da) == 23, (da, db)
for d in da:
    for n in ("input_ids", "loss_mask"):
        assert np.array_equal(np.load(f"{a}/{d}/{n}.npy"), np.load(f"{b}/{d}/{n}.npy")), (d, n)
    x, y = np.load(f"{a}/{d}/hidden.npy"), np.load(f"{b}/{d}/hidden.npy")
    assert x.shape == y.shape
    # one bf16 step (<= |value| * 2^-7), plus the f32 rounding of the sums that
    # made a value near 0 by cancellation (relative to the row's largest value)
    step = np.maximum(np.abs(x), np.abs(y)) * 2.0 ** -7 + 1e-6 * np.abs(x).max(axis=1, keepdims=True)
    assert np.all(np.abs(x - y) <= step), (d, float(np.max(np.abs(x - y))))
EOF

# ---- re-run: nothing redone; a deleted piece alone is redone ----------------------------
touch -d '2020-01-01' "$T/exact.work/out/"*.dfs "$T/exact.dfs" "$T/exact.work/packed"
rm "$T/exact.work/out/piece-0002.dfs"
"$SH" -m "$T/target" -l 0,2 -d cpu -j 2 -n 4 -t 1 -o "$T/exact.dfs" "$T/in.jsonl" -- -b 1 --byte-shuffle on >"$T/rerun.out" 2>&1
redone=$(find "$T/exact.work/out" -name '*.dfs' -newermt '2021-01-01' -printf '%f\n')
[ "$redone" = "piece-0002.dfs" ] && grep -q "piece-0000: done before, skipped" "$T/rerun.out" &&
    pass "re-run redoes only the missing piece" || fail "re-run redoes only the missing piece" "redone: $redone"
[ "$T/exact.dfs" -nt "$T/exact.work/out/piece-0000.dfs" ] && [ "$(records "$T/exact.dfs")" = "$(records "$T/ref1.dfs")" ] &&
    pass "the join is redone after a piece changed, same records" || fail "the join is redone after a piece changed"
before=$(stat -c %Y.%s "$T/exact.dfs")
"$SH" -m "$T/target" -l 0,2 -d cpu -j 2 -n 4 -t 1 -o "$T/exact.dfs" "$T/in.jsonl" -- -b 1 --byte-shuffle on >"$T/rerun2.out" 2>&1
[ "$(grep -c 'done before, skipped' "$T/rerun2.out")" = 4 ] && grep -q "up to date" "$T/rerun2.out" &&
    [ "$(stat -c %Y.%s "$T/exact.dfs")" = "$before" ] &&
    pass "a finished run re-run redoes nothing" || fail "a finished run re-run redoes nothing" "$(cat "$T/rerun2.out")"
expect_exit 2 "another shard count over the same work directory is refused" \
    "$SH" -m "$T/target" -l 0,2 -d cpu -j 2 -n 5 -o "$T/exact.dfs" "$T/in.jsonl"

# Other settings over the same work directory: refused, nothing reused or redone.
cp -r "$T/target" "$T/target2"
before=$(stat -c %Y.%s "$T/exact.dfs" "$T/exact.work/out/"*.dfs)
for v in "layers:-l 0,1 -o $T/exact.dfs $T/in.jsonl -- -b 1 --byte-shuffle on" \
         "extract options:-l 0,2 -o $T/exact.dfs $T/in.jsonl -- -b 1" \
         "model:-l 0,2 -m $T/target2 -o $T/exact.dfs $T/in.jsonl -- -b 1 --byte-shuffle on"; do
    # shellcheck disable=SC2086
    "$SH" -m "$T/target" -d cpu -j 2 -n 4 -t 1 ${v#*:} >"$T/sig.out" 2>&1
    rc=$?
    [ $rc = 2 ] && grep -q "other settings" "$T/sig.out" && [ "$(stat -c %Y.%s "$T/exact.dfs" "$T/exact.work/out/"*.dfs)" = "$before" ] &&
        pass "other ${v%%:*} over the same work directory: refused, pieces kept" ||
        fail "other ${v%%:*} over the same work directory: refused, pieces kept" "rc $rc: $(tail -2 "$T/sig.out")"
done
# A file named in the extract options (a drafter config) changed under the same name.
printf '{"dflash_config": {"target_layer_ids": [0, 2]}}\n' >"$T/dc.json"
check "sharded run with --drafter-config" "$SH" -m "$T/target" -d cpu -j 2 -n 2 -t 1 -o "$T/dc.dfs" "$T/in.jsonl" -- --drafter-config "$T/dc.json"
printf '{"dflash_config": {"target_layer_ids": [1, 3]}}\n' >"$T/dc.json"
expect_exit 2 "the --drafter-config file changed: refused" "$SH" -m "$T/target" -d cpu -j 2 -n 2 -t 1 -o "$T/dc.dfs" "$T/in.jsonl" -- --drafter-config "$T/dc.json"

# Arguments: a missing value, a bad number, an unknown option: exit 2, named.
expect_exit 2 "-n with no value: exit 2" "$SH" -m "$T/target" -o "$T/x.dfs" "$T/in.jsonl" -n
grep -q -- "-n needs a value" "$T/.err" && pass "... naming -n" || fail "... naming -n" "$(cat "$T/.err")"
expect_exit 2 "-t many: exit 2" "$SH" -m "$T/target" -d cpu -t many -o "$T/x.dfs" "$T/in.jsonl"
grep -q -- "--threads" "$T/.err" && pass "... naming --threads" || fail "... naming --threads" "$(cat "$T/.err")"
expect_exit 2 "an unknown option: exit 2" "$SH" -m "$T/target" --bogus -o "$T/x.dfs" "$T/in.jsonl"
grep -q -- "--bogus" "$T/.err" && pass "... naming it" || fail "... naming it" "$(cat "$T/.err")"
# Paths with spaces, beginning with '-': model, input, output, a file in the extract options.
cp -r "$T/target" "$T/-tar get" && cp "$T/in.jsonl" "$T/-in put.jsonl" && mkdir "$T/my dir"
printf '{"dflash_config": {"target_layer_ids": [0, 2]}}\n' >"$T/my dir/d c.json"
(cd "$T" && "$SH" -m "-tar get" -d cpu -j 2 -n 3 -t 1 -o "-out put.dfs" "./-in put.jsonl" -- -b 1 --byte-shuffle on \
    --drafter-config "$T/my dir/d c.json") >"$T/sp.out" 2>&1
rc=$?
[ $rc = 0 ] && [ "$(records "$T/-out put.dfs")" = "$(records "$T/ref1.dfs")" ] &&
    pass "paths with spaces beginning with '-': the records of one run" ||
    fail "paths with spaces beginning with '-': the records of one run" "rc $rc: $(tail -3 "$T/sp.out")"

# ---- --sshloginfile with this host, and a split of the join ---------------------------
echo "2/:" >"$T/hosts"
check "--sshloginfile (local host) with --pack-opts --split" "$SH" -m "$T/target" -l 0,2 -d cpu -n 2 -t 1 -S "$T/hosts" \
    --pack-opts "--split train=0.8,val=0.2" -o "$T/part-%s.dfs" "$T/in.jsonl" -- -b 1 --byte-shuffle on
n_train=$(records "$T/part-train.dfs" | wc -l); n_val=$(records "$T/part-val.dfs" | wc -l)
[ $((n_train + n_val)) = 23 ] && [ "$n_val" -ge 1 ] &&
    [ "$(cat <(records "$T/part-train.dfs") <(records "$T/part-val.dfs") | sort)" = "$(records "$T/ref1.dfs" | sort)" ] &&
    pass "split parts hold every record once ($n_train + $n_val)" || fail "split parts hold every record once"

# ---- --device cuda with no usable GPU (a CPU build or no driver) ------------------------
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    pass "cuda failure (skipped: this machine has a GPU)"
else
    TMPDIR=$T "$SH" -m "$T/target" -l 0,2 -d cuda -j 1 -n 2 -o "$T/gpu.dfs" "$T/in.jsonl" >"$T/gpu.out" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ ! -e "$T/gpu.dfs" ] && [ -z "$(ls "$T/gpu.work/out" | grep -v "^SIGNATURE$")" ] && grep -q "0 of 2 pieces done" "$T/gpu.out" &&
        pass "--device cuda without a GPU: non-zero exit, nothing marked done" ||
        fail "--device cuda without a GPU: non-zero exit, nothing marked done" "rc $rc: $(tail -3 "$T/gpu.out")"
fi
expect_exit 2 "no --model is a usage error" "$SH" -o "$T/x.dfs" "$T/in.jsonl"
expect_exit 66 "a missing input is exit 66" "$SH" -m "$T/target" -o "$T/x.dfs" "$T/nope.jsonl"
# A missing tool stops the run before any work: exit 69, the tool named
# (DFLASH_BIN unset: the script would put the tools back on PATH).
for tool in dflash-extract dflash-pack parallel; do
    PATH=$(path_without $tool) env -u DFLASH_BIN "$SH" -m "$T/target" -l 0,2 -d cpu -n 2 -o "$T/no-$tool.dfs" "$T/in.jsonl" >"$T/no-$tool.out" 2>&1
    rc=$?
    [ $rc = 69 ] && grep -q "$tool is not" "$T/no-$tool.out" && [ ! -e "$T/no-$tool.work" ] && [ ! -e "$T/no-$tool.dfs" ] &&
        pass "no $tool: exit 69 naming it, nothing made" || fail "no $tool: exit 69 naming it, nothing made" "rc $rc: $(tail -2 "$T/no-$tool.out")"
done
PATH=$(path_without flock) env -u DFLASH_BIN "$SH" -m "$T/target" -l 0,2 -d cuda -n 2 -o "$T/no-flock.dfs" "$T/in.jsonl" >"$T/no-flock.out" 2>&1
rc=$?
[ $rc = 69 ] && grep -q "flock is not installed" "$T/no-flock.out" &&
    pass "no flock with -d cuda: exit 69 naming it" || fail "no flock with -d cuda: exit 69 naming it" "rc $rc: $(tail -2 "$T/no-flock.out")"
