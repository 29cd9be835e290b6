#!/usr/bin/env bash
# slow
# Online training, no hidden states on disk: dflash-extract | dflash-train-step.
#   - one pass through a pipe gives the checkpoint that training from the
#     extracted file gives, bit for bit (raw and byte-shuffled LZ4 streams);
#   - the epoch loop of the README (shuffled JSONL per epoch | extract |
#     train-step --resume) equals the same chain run from files;
#   - pipelines/train-online.sh (2 epochs) = the same chain from files, and a
#     re-run after a lost epoch redoes only that epoch;
#   - a pipe that ends before --steps: the steps made are saved, exit 0;
#   - -o NAMED_FIFO writes into the FIFO (it is not renamed over, as a file
#     would be; the same goes for -o /dev/null).
. "$(dirname "$0")/lib.sh"

cd "$T"
tiny_target target --layers 4 --tie no --seed 5
awk 'BEGIN { x = 3; for (i = 0; i < 12; i++) { s = ""; m = ""
      for (j = 0; j < 30; j++) { x = (x * 48271) % 2147483647; s = s (j ? "," : "") x % 60; m = m (j ? "," : "") (j < 5 ? 0 : 1) }
      printf "{\"id\":\"o%d\",\"input_ids\":[%s],\"loss_mask\":[%s]}\n", i, s, m } }' >samples.jsonl
drafter_config drafter.json block=4 target_layers=4 taps="0, 2" layers=1
EX=(dflash-extract -m target --drafter-config drafter.json -t 1)
TR=(dflash-train-step --target target --threads 1 --lr 5e-3 --anchors 4 --batch-seqs 2 --total-steps 12 --log /dev/null)
same_ckpt() { cmp -s "$1/model.safetensors" "$2/model.safetensors" && cmp -s "$1/trainer_state.safetensors" "$2/trainer_state.safetensors"; }

# ---- one pass: pipe = file ----------------------------------------------------------
"${EX[@]}" -o s.dfs samples.jsonl
"${TR[@]}" --init drafter.json --steps 6 --out file-ckpt s.dfs 2>/dev/null
"${EX[@]}" samples.jsonl | "${TR[@]}" --init drafter.json --steps 6 --out pipe-ckpt 2>/dev/null
same_ckpt file-ckpt pipe-ckpt && pass "extract | train-step = train-step on the extracted file" ||
    fail "extract | train-step = train-step on the extracted file"
"${EX[@]}" --byte-shuffle on samples.jsonl | "${TR[@]}" --init drafter.json --steps 6 --out pipe-lz4 2>/dev/null
same_ckpt file-ckpt pipe-lz4 && pass "the same through an LZ4 + byte-shuffle pipe" ||
    fail "the same through an LZ4 + byte-shuffle pipe"
"${EX[@]}" samples.jsonl | "${TR[@]}" --init drafter.json --steps 6 --out dash-ckpt - 2>/dev/null
same_ckpt file-ckpt dash-ckpt && pass "'-' reads standard input" || fail "'-' reads standard input"

# ---- the README's epoch loop, against the same chain from files -----------------------
prev=""
for e in 1 2; do
    shuf --random-source=<(yes "$e") samples.jsonl >"epoch$e.jsonl"
    start=(--init drafter.json); [ -n "$prev" ] && start=(--resume "$prev")
    "${EX[@]}" "epoch$e.jsonl" | "${TR[@]}" "${start[@]}" --steps 6 --out "online-e$e" 2>/dev/null || fail "epoch $e" "exit $?"
    prev=online-e$e
done
"${EX[@]}" -o e1.dfs epoch1.jsonl && "${EX[@]}" -o e2.dfs epoch2.jsonl
"${TR[@]}" --init drafter.json --steps 6 --out off-e1 e1.dfs 2>/dev/null
"${TR[@]}" --resume off-e1 --steps 6 --out off-e2 e2.dfs 2>/dev/null
cmp -s epoch1.jsonl epoch2.jsonl && fail "epochs are shuffled differently"
same_ckpt online-e2 off-e2 && pass "epoch loop through pipes = the same chain from files" ||
    fail "epoch loop through pipes = the same chain from files"
jq -e '.step == 12' online-e2/trainer_state.json >/dev/null && pass "two epochs of 6 steps: step 12" ||
    fail "two epochs of 6 steps: step 12" "$(head -c 300 online-e2/trainer_state.json)"

# ---- pipelines/train-online.sh ----------------------------------------------------------
TO=$here/pipelines/train-online.sh
check "train-online.sh, 2 epochs on the CPU" "$TO" -m target -c drafter.json -o online -e 2 -d cpu -b 2 -s 7 \
    --extract-opts "-t 1" samples.jsonl -- --threads 1 --lr 5e-3 --anchors 4
# the same by hand, from files: 12 samples / 2 per step = 6 steps an epoch, 12 in all
for e in 1 2; do shuf --random-source=<(yes "7-$e") samples.jsonl | "${EX[@]}" -o "f$e.dfs"; done
TF=(dflash-train-step --target target --threads 1 --lr 5e-3 --anchors 4 --batch-seqs 2 --total-steps 12 --steps 7 --log /dev/null)
"${TF[@]}" --init drafter.json --seed 7 --out man-e1 f1.dfs 2>/dev/null
"${TF[@]}" --resume man-e1 --out man-e2 f2.dfs 2>/dev/null
same_ckpt online/ckpt-e2 man-e2 && pass "train-online.sh = the same two epochs from files" ||
    fail "train-online.sh = the same two epochs from files"
rm -rf online/ckpt-e2
stamp=$(stat -c %Y.%s online/ckpt-e1/model.safetensors)
"$TO" -m target -c drafter.json -o online -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 1" samples.jsonl -- --threads 1 --lr 5e-3 --anchors 4 >again.out 2>&1
grep -q "epoch 1: done before" again.out && same_ckpt online/ckpt-e2 man-e2 &&
    [ "$(stat -c %Y.%s online/ckpt-e1/model.safetensors)" = "$stamp" ] &&
    pass "train-online.sh again: epoch 1 kept, epoch 2 redone, same bytes" ||
    fail "train-online.sh again: epoch 1 kept, epoch 2 redone, same bytes" "$(tail -3 again.out)"

# The settings of the checkpoints are recorded (OUT/SIGNATURE); a re-run with
# others (seed, samples, a train or extract option) is refused, exit 2, the
# difference shown, nothing touched; checkpoints with no record are refused too.
[ -f online/SIGNATURE ] && pass "train-online.sh records its settings in OUT/SIGNATURE" ||
    fail "train-online.sh records its settings in OUT/SIGNATURE" "$(ls -A online)"
snap() { find "$1" -printf '%p %s %T@\n' | sort; }
before=$(snap online)
head -11 samples.jsonl >fewer.jsonl
sigcase() {   # NAME GREP ARGS...: exit 2, the message, nothing touched
    local name=$1 want=$2; shift 2
    "$TO" "$@" >sig.out 2>&1
    local rc=$?
    [ $rc = 2 ] && grep -q "other settings" sig.out && grep -q -- "$want" sig.out && [ "$(snap online)" = "$before" ] &&
        pass "train-online.sh, $name: refused (exit 2), the difference shown, nothing touched" ||
        fail "train-online.sh, $name: refused (exit 2), the difference shown, nothing touched" "rc $rc: $(tail -3 sig.out)"
}
sigcase "another seed" "seed 8" -m target -c drafter.json -o online -e 2 -d cpu -b 2 -s 8 --extract-opts "-t 1" samples.jsonl -- --threads 1 --lr 5e-3 --anchors 4
sigcase "another samples file" "fewer.jsonl" -m target -c drafter.json -o online -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 1" fewer.jsonl -- --threads 1 --lr 5e-3 --anchors 4
sigcase "another train option" "6e-3" -m target -c drafter.json -o online -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 1" samples.jsonl -- --threads 1 --lr 6e-3 --anchors 4
sigcase "another extract option" "extract-opt 2" -m target -c drafter.json -o online -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 2" samples.jsonl -- --threads 1 --lr 5e-3 --anchors 4
{ cat drafter.json; echo; } >drafter2.json   # the same config, other bytes
sigcase "another drafter config" "drafter [0-9]" -m target -c drafter2.json -o online -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 1" samples.jsonl -- --threads 1 --lr 5e-3 --anchors 4
cp -r online legacy && rm -f legacy/SIGNATURE
before_l=$(snap legacy)
"$TO" -m target -c drafter.json -o legacy -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 1" samples.jsonl -- --threads 1 --lr 5e-3 --anchors 4 >sig.out 2>&1
rc=$?
[ $rc = 2 ] && grep -q "no record of their settings" sig.out && grep -q -- "another --out" sig.out && [ "$(snap legacy)" = "$before_l" ] &&
    pass "train-online.sh, checkpoints with no SIGNATURE (an older run): refused (exit 2), told what to do, nothing touched" ||
    fail "train-online.sh, checkpoints with no SIGNATURE (an older run): refused (exit 2), told what to do, nothing touched" "rc $rc: $(tail -3 sig.out)"

# A bad sample stops dflash-extract (exit 65); the trainer saves what it had.
# That epoch is not done: no checkpoint under its name, exit non-zero naming
# the tool, and a re-run (the sample fixed) redoes it: the bytes of a clean run.
{ head -5 samples.jsonl; echo '{"id":"bad","input_ids":[1,2,999999],"loss_mask":[0,1,1]}'; tail -n +6 samples.jsonl; } >bad.jsonl
TO_ARGS=(-m target -c drafter.json -o badrun -e 2 -d cpu -b 2 -s 7 --extract-opts "-t 1")
"$TO" "${TO_ARGS[@]}" bad.jsonl -- --threads 1 --lr 5e-3 --anchors 4 >bad.out 2>&1
rc=$?
[ $rc -ne 0 ] && [ ! -e badrun/ckpt-e1 ] && [ -z "$(ls -A badrun | grep -v -e '\.log$' -e '^SIGNATURE$')" ] &&
    grep -q "epoch 1 failed (.*dflash-extract exited 65" bad.out &&
    pass "an epoch whose extraction failed: no checkpoint, exit non-zero naming the tool" ||
    fail "an epoch whose extraction failed: no checkpoint, exit non-zero naming the tool" "rc $rc: $(ls -A badrun); $(tail -2 bad.out)"
"$TO" "${TO_ARGS[@]}" bad.jsonl -- --threads 1 --lr 5e-3 --anchors 4 >bad2.out 2>&1
rc=$?
[ $rc -ne 0 ] && ! grep -q "done before" bad2.out && [ ! -e badrun/ckpt-e1 ] &&
    pass "... run again: still not counted as done" || fail "... run again: still not counted as done" "rc $rc: $(tail -2 bad2.out)"
grep -v '"bad"' bad.jsonl >fixed.jsonl
"$TO" "${TO_ARGS[@]}" fixed.jsonl -- --threads 1 --lr 5e-3 --anchors 4 >bad3.out 2>&1
rc=$?
[ $rc = 0 ] && same_ckpt badrun/ckpt-e2 man-e2 &&
    pass "... the sample fixed: both epochs redone, the bytes of a clean run" ||
    fail "... the sample fixed: both epochs redone, the bytes of a clean run" "rc $rc: $(tail -2 bad3.out)"

# Steps smaller than --batch-seqs (--batch-tokens): the trainer reaches its
# --steps with samples unread (here all in the pipe's buffer, so no tool
# fails): the epoch is refused, not kept short.
"$TO" -m target -c drafter.json -o tokrun -e 1 -d cpu -b 2 -s 7 --extract-opts "-t 1" samples.jsonl -- --threads 1 --anchors 4 \
    --batch-tokens 10 >tok.out 2>&1
rc=$?
[ $rc -ne 0 ] && [ ! -e tokrun/ckpt-e1 ] && grep -q "made 7 steps, more than the 6" tok.out &&
    pass "an epoch that stopped at --steps with samples unread: refused" ||
    fail "an epoch that stopped at --steps with samples unread: refused" "rc $rc: $(ls -A tokrun); $(tail -2 tok.out)"

# Arguments: a missing value, a bad number, an unknown option: exit 2, named.
expect_exit 2 "-e with no value: exit 2" "$TO" -m target -c drafter.json -o x samples.jsonl -e
grep -q -- "-e needs a value" "$T/.err" && pass "... naming -e" || fail "... naming -e" "$(cat "$T/.err")"
expect_exit 2 "-b two: exit 2" "$TO" -m target -c drafter.json -o x -b two samples.jsonl
grep -q -- "--batch-seqs" "$T/.err" && pass "... naming --batch-seqs" || fail "... naming --batch-seqs" "$(cat "$T/.err")"
expect_exit 2 "an unknown option: exit 2" "$TO" -m target -c drafter.json -o x --bogus samples.jsonl
grep -q -- "--bogus" "$T/.err" && pass "... naming it" || fail "... naming it" "$(cat "$T/.err")"
# A missing tool stops the run before any work: exit 69, the tool named
# (DFLASH_BIN unset: the script would put the tools back on PATH).
for tool in dflash-extract dflash-train-step; do
    PATH=$(path_without $tool) env -u DFLASH_BIN "$TO" -m target -c drafter.json -o "no-$tool" -d cpu samples.jsonl >"no-$tool.out" 2>&1
    rc=$?
    [ $rc = 69 ] && grep -q "$tool is not on PATH" "no-$tool.out" && [ ! -e "no-$tool" ] &&
        pass "no $tool: exit 69 naming it, nothing made" || fail "no $tool: exit 69 naming it, nothing made" "rc $rc: $(tail -2 "no-$tool.out")"
done
# Paths with spaces, beginning with '-': the same two epochs, the same bytes.
cp -r target "./-tar get" && cp drafter.json "./-draf ter.json" && cp samples.jsonl "./-sam ples.jsonl"
check "train-online.sh, paths with spaces beginning with '-'" "$TO" -m "-tar get" -c "-draf ter.json" -o "-on line" -e 2 -d cpu -b 2 -s 7 \
    --extract-opts "-t 1" "./-sam ples.jsonl" -- --threads 1 --lr 5e-3 --anchors 4
same_ckpt "./-on line/ckpt-e2" man-e2 && pass "... the bytes of the plain run" || fail "... the bytes of the plain run" "$(tail -2 "$T/.err")"

# ---- a pipe that runs dry -------------------------------------------------------------
head -3 samples.jsonl | "${EX[@]}" | "${TR[@]}" --init drafter.json --steps 50 --out short 2>short.err
rc=$?
[ $rc = 0 ] && [ -f short/model.safetensors ] && jq -e '.step >= 1 and .step < 50' short/trainer_state.json >/dev/null &&
    pass "input ends before --steps: the steps made are saved, exit 0" ||
    fail "input ends before --steps: the steps made are saved, exit 0" "rc $rc: $(tail -2 short.err)"

# ---- -o a named pipe --------------------------------------------------------------------
mkfifo fifo
cat fifo >from-fifo.dfs &
reader=$!
SOURCE_DATE_EPOCH=1764460800 "${EX[@]}" -o fifo samples.jsonl
SOURCE_DATE_EPOCH=1764460800 "${EX[@]}" -o s-fixed.dfs samples.jsonl
if [ -p fifo ]; then wait $reader; else kill $reader; wait $reader; fi 2>/dev/null
[ -p fifo ] && cmp -s from-fifo.dfs s-fixed.dfs && pass "-o FIFO: written through the pipe, which stays a pipe" ||
    fail "-o FIFO: written through the pipe, which stays a pipe" "$(ls -l fifo)"
