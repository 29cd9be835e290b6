#!/usr/bin/env bash
# slow
# pipelines/eval-sweep.sh, the cron job:
#   - scores every complete checkpoint (skips temporaries, the target dir,
#     half-made dirs), one TSV line each, sorted by step, equal (but for the
#     time column) to one dflash-score call on the same checkpoints;
#   - a second run adds nothing and leaves the TSV byte for byte;
#   - a new checkpoint adds one line, the old lines kept;
#   - a held lock: the run exits 0 and adds nothing; two runs at once
#     (--wait) score each checkpoint once;
#   - a PNG plot of tau and loss against step.
. "$(dirname "$0")/lib.sh"

SW=$here/pipelines/eval-sweep.sh
if ! command -v dflash-score >/dev/null; then echo "SKIP eval sweep: dflash-score is not built yet (issue 5)"; exit 0; fi
cd "$T"
tiny_target target --layers 4 --tie no --seed 8
awk 'BEGIN { x = 9; for (i = 0; i < 10; i++) { s = ""; m = ""
      for (j = 0; j < 5; j++) { x = (x * 48271) % 2147483647; mo[j] = x % 60 }
      for (j = 0; j < 30; j++) { s = s (j ? "," : "") mo[j % 5]; m = m (j ? "," : "") (j < 5 ? 0 : 1) }
      printf "{\"id\":\"w%d\",\"input_ids\":[%s],\"loss_mask\":[%s]}\n", i, s, m } }' >samples.jsonl
drafter_config drafter.json block=4 target_layers=4 taps="0, 2" layers=1
dflash-extract -m target --drafter-config drafter.json -t 1 -o val.dfs samples.jsonl
mkdir run
TR=(dflash-train-step --target target --threads 1 --lr 1e-2 --anchors 6 --batch-seqs 2 --total-steps 40 --loop --log /dev/null)
"${TR[@]}" --init drafter.json --steps 10 --out run/ckpt-10 val.dfs 2>/dev/null
"${TR[@]}" --resume run/ckpt-10 --steps 10 --out run/ckpt-20 val.dfs 2>/dev/null
"${TR[@]}" --resume run/ckpt-20 --steps 10 --out run/ckpt-30 val.dfs 2>/dev/null
cp -r run/ckpt-10 run/.ckpt-40.tmp.AbCdEf          # a checkpoint being written: skipped
mkdir run/half && cp run/ckpt-10/config.json run/half/  # no weights: skipped
cp -r target run/target-copy                           # not a drafter: skipped
SW_ARGS=(--target target --val val.dfs --dir run -- --threads 1)
strip_time() { cut -f 2- "$1"; }

check "first sweep" "$SW" "${SW_ARGS[@]}"
dflash-score --target target --threads 1 --drafter "$T/run/ckpt-10" --drafter "$T/run/ckpt-20" --drafter "$T/run/ckpt-30" \
    val.dfs >direct.tsv
if [ "$(strip_time run/scores.tsv)" = "$(strip_time direct.tsv)" ]; then
    pass "the TSV = one dflash-score call on the three checkpoints (header once, by step)"
else
    fail "the TSV = one dflash-score call on the three checkpoints" "$(diff <(strip_time run/scores.tsv) <(strip_time direct.tsv) | head -5)"
fi
[ "$(head -c 8 run/scores.png | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] &&
    pass "a PNG plot" || fail "a PNG plot" "$(file run/scores.png 2>&1)"
# tau rises over the three checkpoints here (the motif data is easy): the plot has something to show
tau=$(awk -F'\t' 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "tau_pooled") c = i } NR > 1 { print $c }' run/scores.tsv | tr '\n' ' ')
awk -v t="$tau" 'BEGIN { split(t, a, " "); exit !(a[3] > a[1]) }' && pass "tau rises with training ($tau)" ||
    fail "tau rises with training" "$tau"

cp run/scores.tsv before.tsv
check "second sweep" "$SW" "${SW_ARGS[@]}"
cmp -s run/scores.tsv before.tsv && grep -q "nothing new" "$T/.out" &&
    pass "second sweep adds nothing" || fail "second sweep adds nothing" "$(cat "$T/.out")"

"${TR[@]}" --resume run/ckpt-30 --steps 10 --out run/ckpt-40 val.dfs 2>/dev/null
rm -rf run/.ckpt-40.tmp.AbCdEf
check "sweep after a new checkpoint" "$SW" "${SW_ARGS[@]}"
[ "$(head -n 4 run/scores.tsv)" = "$(cat before.tsv)" ] && [ "$(wc -l <run/scores.tsv)" = 5 ] &&
    [ "$(tail -1 run/scores.tsv | cut -f 3)" = "$T/run/ckpt-40" ] &&
    pass "one line added for the new checkpoint, old lines kept" || fail "one line added for the new checkpoint, old lines kept"

# A sweep already running (the lock is held): exit 0, nothing added.
cp run/scores.tsv before.tsv
"${TR[@]}" --resume run/ckpt-40 --steps 0 --out run/ckpt-40b val.dfs 2>/dev/null
exec 8>>run/scores.lock
flock 8
check "a sweep while another holds the lock exits 0" "$SW" "${SW_ARGS[@]}"
cmp -s run/scores.tsv before.tsv && grep -q "another sweep" "$T/.out" &&
    pass "... and adds nothing" || fail "... and adds nothing" "$(cat "$T/.out")"
exec 8>&-
# Two sweeps at once, the second waiting for the lock: ckpt-40b scored once.
"$SW" --wait 60 "${SW_ARGS[@]}" >a.out 2>&1 &
"$SW" --wait 60 "${SW_ARGS[@]}" >b.out 2>&1 &
wait
[ "$(grep -c "/ckpt-40b	" run/scores.tsv)" = 1 ] && [ "$(wc -l <run/scores.tsv)" = 6 ] &&
    pass "two overlapping sweeps score the new checkpoint once" ||
    fail "two overlapping sweeps score the new checkpoint once" "$(cut -f 3 run/scores.tsv | tr '\n' ' ')"
# A TSV written by hand (or by make) with relative paths: those count as scored.
dflash-score --target target --threads 1 --drafter run/ckpt-10 val.dfs >run/rel.tsv
(cd run && dflash-score --target ../target --threads 1 --no-header --drafter ckpt-20 ../val.dfs >>rel.tsv)
check "sweep over a TSV with relative paths" "$SW" --tsv run/rel.tsv --png "" "${SW_ARGS[@]}"
n10=$(cut -f 3 run/rel.tsv | grep -c 'ckpt-10$'); n20=$(cut -f 3 run/rel.tsv | grep -c 'ckpt-20$')
[ "$n10" = 1 ] && [ "$n20" = 1 ] && [ "$(wc -l <run/rel.tsv)" = 6 ] &&
    pass "relative entries (from here and from the TSV's directory) count as scored" ||
    fail "relative entries count as scored" "$(cut -f 3 run/rel.tsv | tr '\n' ' ')"
expect_exit 2 "no --val or --prompts is a usage error" "$SW" --target target --dir run

# ---- failures are loud: exit non-zero, the cause named -----------------------------
# A PATH without one tool (path_without, lib.sh): a missing jq or flock
# stops the run (before, every checkpoint was skipped, or the lock counted as
# held, and the run exited 0 having scored nothing).
mkdir fresh && cp -r run/ckpt-10 fresh/
for tool in jq flock; do
    PATH=$(path_without $tool) "$SW" --png "" "${SW_ARGS[@]/#run/fresh}" >"$tool.out" 2>&1
    rc=$?
    [ $rc -ne 0 ] && grep -q "$tool is not installed" "$tool.out" && [ ! -s fresh/scores.tsv ] &&
        pass "no $tool: non-zero exit naming it" || fail "no $tool: non-zero exit naming it" "rc $rc: $(tail -2 "$tool.out")"
done
# One broken checkpoint among good ones: the good ones are scored, the bad one
# named, exit non-zero; the next run scores nothing twice and still says so.
mkdir mixed && cp -r run/ckpt-10 run/ckpt-30 mixed/ && cp -r run/ckpt-20 mixed/ckpt-20
head -c 100 run/ckpt-20/model.safetensors >mixed/ckpt-20/model.safetensors
"$SW" --png "" --target target --val val.dfs --dir mixed -- --threads 1 >mixed.out 2>&1
rc=$?
[ $rc -ne 0 ] && [ "$(wc -l <mixed/scores.tsv)" = 3 ] && grep -q "ckpt-20: dflash-score failed" mixed.out &&
    [ "$(cut -f 2,4- mixed/scores.tsv | sed -n 2p)" = "$(cut -f 2,4- run/scores.tsv | sed -n 2p)" ] &&
    [ "$(cut -f 2,4- mixed/scores.tsv | sed -n 3p)" = "$(cut -f 2,4- run/scores.tsv | sed -n 4p)" ] &&
    pass "a broken checkpoint: the others scored, it is named, exit non-zero" ||
    fail "a broken checkpoint: the others scored, it is named, exit non-zero" "rc $rc: $(tail -3 mixed.out); $(cut -f 3 mixed/scores.tsv | tr '\n' ' ')"
"$SW" --png "" --target target --val val.dfs --dir mixed -- --threads 1 >mixed2.out 2>&1
rc=$?
[ $rc -ne 0 ] && [ "$(wc -l <mixed/scores.tsv)" = 3 ] && grep -q "ckpt-20" mixed2.out &&
    pass "... a re-run tries it again, scores nothing twice, exit non-zero" ||
    fail "... a re-run tries it again, scores nothing twice, exit non-zero" "rc $rc: $(tail -3 mixed2.out)"
# dflash-score exits 0 but writes no line for one checkpoint (here a wrapper
# drops it): that one is named and not counted as scored, the others are
# kept, exit non-zero; a later run (a good dflash-score) scores it.
mkdir lost fake && cp -r run/ckpt-10 run/ckpt-20 run/ckpt-30 lost/
printf '#!/usr/bin/env bash\nout=$(%q "$@") || exit\nprintf "%%s\\n" "$out" | grep -v "/ckpt-20\t"\nexit 0\n' \
    "$(command -v dflash-score)" >fake/dflash-score
chmod +x fake/dflash-score
DFLASH_BIN=$T/fake "$SW" --png "" --target target --val val.dfs --dir lost -- --threads 1 >lost.out 2>&1
rc=$?
[ $rc -ne 0 ] && [ "$(cut -f 3 lost/scores.tsv | tail -n +2 | tr '\n' ' ')" = "$T/lost/ckpt-10 $T/lost/ckpt-30 " ] &&
    grep -q "lost/ckpt-20: dflash-score exited 0 but wrote no line for it" lost.out &&
    pass "dflash-score exits 0 but writes no line for a checkpoint: it is named, the others kept, exit non-zero" ||
    fail "dflash-score exits 0 but writes no line for a checkpoint: it is named, the others kept, exit non-zero" "rc $rc: $(tail -3 lost.out); $(cut -f 3 lost/scores.tsv | tr '\n' ' ')"
"$SW" --png "" --target target --val val.dfs --dir lost -- --threads 1 >lost2.out 2>&1
rc=$?
[ $rc = 0 ] && [ "$(cut -f 3 lost/scores.tsv | tail -n +2 | tr '\n' ' ')" = "$T/lost/ckpt-10 $T/lost/ckpt-30 $T/lost/ckpt-20 " ] &&
    pass "... a later run scores it" || fail "... a later run scores it" "rc $rc: $(tail -3 lost2.out); $(cut -f 3 lost/scores.tsv | tr '\n' ' ')"
# Every checkpoint bad (weights, but a config.json cut short): non-zero, named.
mkdir allbad && cp -r run/ckpt-10 allbad/ && head -c 20 run/ckpt-10/config.json >allbad/ckpt-10/config.json
"$SW" --png "" --target target --val val.dfs --dir allbad -- --threads 1 >allbad.out 2>&1
rc=$?
[ $rc -ne 0 ] && grep -q "ckpt-10: weights but no readable config.json" allbad.out &&
    pass "every checkpoint unreadable: non-zero exit, each named" ||
    fail "every checkpoint unreadable: non-zero exit, each named" "rc $rc: $(tail -3 allbad.out)"

# ---- arguments: a missing value or an unknown option is exit 2, named ---------------
expect_exit 2 "--target with no value: exit 2" "$SW" --val val.dfs --dir run --target
grep -q -- "--target needs a value" "$T/.err" && pass "... naming --target" || fail "... naming --target" "$(cat "$T/.err")"
expect_exit 2 "an unknown option: exit 2" "$SW" --target target --val val.dfs --bogus
grep -q -- "--bogus" "$T/.err" && pass "... naming it" || fail "... naming it" "$(cat "$T/.err")"
expect_exit 2 "--wait soon: exit 2" "$SW" --target target --val val.dfs --dir run --wait soon
grep -q -- "--wait" "$T/.err" && pass "... naming --wait" || fail "... naming --wait" "$(cat "$T/.err")"
# Paths with spaces that begin with '-': the run directory, the stream, a checkpoint.
mkdir -- "-my run" && cp -r run/ckpt-10 "./-my run/ckpt 10" && cp val.dfs "./-v al.dfs"
check "paths with spaces, beginning with '-'" "$SW" --target target --val "-v al.dfs" --dir "-my run" -- --threads 1
[ "$(wc -l <"./-my run/scores.tsv")" = 2 ] && [ "$(tail -1 "./-my run/scores.tsv" | cut -f 3)" = "$T/-my run/ckpt 10" ] &&
    [ -s "./-my run/scores.png" ] && pass "... scored and plotted" || fail "... scored and plotted" "$(cat "$T/.out" "$T/.err")"
check "... again" "$SW" --target target --val "-v al.dfs" --dir "-my run" -- --threads 1
grep -q "nothing new" "$T/.out" && pass "... a second run adds nothing" || fail "... a second run adds nothing" "$(cat "$T/.out")"
# A quote in the run directory's name (the plot's output file and title).
mkdir "it's run" && cp -r run/ckpt-10 "it's run/"
check "a quote in the run directory's name" "$SW" --target target --val val.dfs --dir "it's run" -- --threads 1
[ "$(head -c 8 "it's run/scores.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] &&
    pass "... plotted" || fail "... plotted" "$(cat "$T/.err")"
