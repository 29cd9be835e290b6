#!/usr/bin/env bash
# Regressions found by using the tools as the README and the man pages say:
# output safety (what --out may replace, bad output paths found before the
# work, modes under the umask), signals the caller ignores, option ranges,
# the learning-rate schedule past --total-steps, log write errors, options a
# mode does not use, bad target configs.
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget"
TS="dflash-train-step --threads 1"

tiny_target "$T/target" --layers 6 --tie no --seed 2
python3 - "$T/data.jsonl" <<'EOF'
import json, random, sys
r = random.Random(5)
with open(sys.argv[1], "w") as f:
    for i in range(6):
        ids = [r.randrange(60) for _ in range(24)]
        f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * 20}) + "\n")
EOF
drafter_config "$T/drafter.json" block=4 taps="1, 3" layers=1
check "extract a stream" dflash-extract -t 1 -m "$T/target" -l 1,3 -o "$T/train.dfs" "$T/data.jsonl"
INIT="$TS --target $T/target --init $T/drafter.json"

# ---- --out: what a checkpoint may replace ------------------------------------------------
# An existing directory that holds other things is never emptied (it used to
# lose its plain files, its subdirectories moved to a hidden name).
mkdir -p "$T/mine/sub" && echo precious >"$T/mine/notes.txt" && echo x >"$T/mine/sub/y"
expect_exit 73 "--out DIR holding other files: refused (73)" $INIT --steps 0 --out "$T/mine"
grep -Eq "mine: exists and holds '(notes.txt|sub)'" "$T/.err" && pass "--out refusal names the directory and the file" ||
    fail "--out refusal names the directory and the file" "$(cat "$T/.err")"
[ "$(cat "$T/mine/notes.txt" 2>/dev/null)" = precious ] && [ -f "$T/mine/sub/y" ] &&
    [ -z "$(ls -A "$T" | grep '^\.mine\.tmp')" ] && pass "--out DIR: its files and subdirectories are untouched" ||
    fail "--out DIR: its files and subdirectories are untouched" "$(ls -la "$T" "$T/mine")"
# a symbolic link to a checkpoint is not followed into (the files of the
# checkpoint it points to stayed, but used to be deleted through the link)
check "a checkpoint" $INIT --steps 0 --out "$T/ck0"
ln -s ck0 "$T/link"
expect_exit 73 "--out SYMLINK: refused (73)" $INIT --steps 0 --out "$T/link"
[ -f "$T/ck0/model.safetensors" ] && [ -L "$T/link" ] && pass "--out SYMLINK: the target checkpoint is untouched" ||
    fail "--out SYMLINK: the target checkpoint is untouched"
# a checkpoint directory is replaced, with or without a trailing slash
check "--out an existing checkpoint: replaced" $INIT --steps 0 --seed 3 --out "$T/ck0"
check "--out an existing checkpoint with a trailing slash: replaced" $INIT --steps 0 --seed 4 --out "$T/ck0/"
[ -z "$(ls -A "$T" | grep '\.tmp\.')" ] && [ -f "$T/ck0/model.safetensors" ] &&
    pass "--out ck/: no temporary directory left, checkpoint in place" || fail "--out ck/: leftovers" "$(ls -A "$T")"
# a bad --out fails before the steps (it used to train, then exit 73)
mkdir -p "$T/ro" && chmod 555 "$T/ro"
for o in "$T/missing/ck" "$T/data.jsonl"; do
    expect_exit 73 "--out $(basename "$(dirname "$o")")/$(basename "$o"): 73" $INIT --steps 3 --log "$T/bad.log" --out "$o" "$T/train.dfs"
    [ ! -s "$T/bad.log" ] && pass "--out $(basename "$o"): refused before any step" || fail "--out $(basename "$o"): refused before any step" "$(cat "$T/bad.log")"
    rm -f "$T/bad.log"
done
if [ "$(id -u)" != 0 ]; then
    expect_exit 73 "--out in a read-only directory: 73" $INIT --steps 3 --log "$T/bad.log" --out "$T/ro/ck" "$T/train.dfs"
    [ ! -s "$T/bad.log" ] && pass "--out read-only: refused before any step" || fail "--out read-only: refused before any step"
fi
chmod 755 "$T/ro"

# ---- negative integer options: refused (they used to mean "not given") --------------------
check "a checkpoint to score" $INIT --steps 2 --out "$T/ck2" "$T/train.dfs"
SC="dflash-score --threads 1 --target $T/target --drafter $T/ck2"
for o in "--anchors -3" "--seed -1" "--micro-rows -2"; do
    expect_exit 2 "dflash-score $o: 2" $SC $o "$T/train.dfs"
done
expect_exit 2 "dflash-score --max-new-tokens -1: 2" $SC --prompts "$T/data.jsonl" --max-new-tokens -1
for o in "--anchors -3" "--batch-seqs -1" "--batch-tokens -5" "--micro-rows -1" "--total-steps -4" "--seed -1"; do
    expect_exit 2 "dflash-train-step $o: 2" $INIT --steps 1 $o --out "$T/neg" "$T/train.dfs"
done
expect_exit 2 "dflash-train-step --resume --anchors -3: 2 (differs from the checkpoint's)" \
    $TS --target "$T/target" --resume "$T/ck2" --steps 1 --anchors -3 --out "$T/neg" "$T/train.dfs"
[ ! -e "$T/neg" ] && pass "no checkpoint from refused options" || fail "no checkpoint from refused options"

# ---- an empty output path (an unset shell variable: --out "$CKPT"): refused before the work ----
# naming the option, exit 73 as the other bad output paths (--out '' used to
# train every step and fail at the rename; -o '' and --emit '' the same after
# the whole pass; --tmpdir '' put the shuffle's buckets in /). Run from an
# empty directory, where a temporary name beside '' would go.
mkdir -p "$T/ecwd" && pushd "$T/ecwd" >/dev/null
empty_path() { # CODE OPT NAME CMD...: exit CODE, the option named, nothing written
    local code=$1 opt=$2 name=$3; shift 3
    expect_exit "$code" "$name: $code" "$@"
    grep -q "^${1}: $opt '': an empty path names no file or directory" "$T/.err" && [ -z "$(ls -A "$T/ecwd")" ] &&
        pass "$name: the option named, nothing written" || fail "$name: the option named, nothing written" "$(cat "$T/.err"; ls -A "$T/ecwd")"
}
empty_out() { empty_path 73 "$@"; }
empty_out --out "dflash-train-step --out ''" $INIT --steps 3 --log "$T/e.log" --out "" "$T/train.dfs"
[ ! -s "$T/e.log" ] && pass "dflash-train-step --out '': refused before any step" || fail "dflash-train-step --out '': refused before any step" "$(cat "$T/e.log")"
empty_out --log "dflash-train-step --log ''" $INIT --steps 3 --log "" --out "$T/e-ck" "$T/train.dfs"
empty_out -o "dflash-extract -o ''" dflash-extract -t 1 -m "$T/target" -l 1,3 -o "" "$T/data.jsonl"
empty_out -o "dflash-pack -o ''" dflash-pack -o "" "$T/train.dfs"
empty_out --export "dflash-pack --export ''" dflash-pack --export "" "$T/train.dfs"
empty_out --tmpdir "dflash-pack --tmpdir ''" dflash-pack --shuffle --mem 1 --tmpdir "" -o "$T/e.dfs" "$T/train.dfs"
empty_out --emit "dflash-score --emit ''" $SC --prompts "$T/data.jsonl" --max-new-tokens 2 --emit ""
# the same for inputs, exit 66 (--target '' and --model '' read /config.json,
# the path joined with "/"; an empty stream name failed with ": cannot open")
empty_in() { empty_path 66 "$@"; }
EX="dflash-extract -t 1 -o $T/e.dfs"
empty_in --model "dflash-extract --model ''" $EX -m "" -l 1,3 "$T/data.jsonl"
empty_in --drafter-config "dflash-extract --drafter-config ''" $EX -m "$T/target" --drafter-config "" "$T/data.jsonl"
empty_in input "dflash-extract ''" $EX -m "$T/target" -l 1,3 ""
empty_in input "dflash-pack ''" dflash-pack -o "$T/e.dfs" ""
empty_in input "dflash-pack FILE '' (the second of two)" dflash-pack -o "$T/e.dfs" "$T/train.dfs" ""
SC0="dflash-score --threads 1"
empty_in --target "dflash-score --target ''" $SC0 --target "" --drafter "$T/ck2" "$T/train.dfs"
empty_in --drafter "dflash-score --drafter ''" $SC0 --target "$T/target" --drafter "$T/ck2" --drafter "" "$T/train.dfs"
empty_in --anchors-from "dflash-score --anchors-from ''" $SC --anchors-from "" "$T/train.dfs"
empty_in --prompts "dflash-score --prompts ''" $SC --prompts "" --max-new-tokens 2
empty_in input "dflash-score ''" $SC ""
TS0="$TS --steps 1 --out $T/e-ck"
empty_in --target "dflash-train-step --target ''" $TS0 --target "" --init "$T/drafter.json" "$T/train.dfs"
empty_in --init "dflash-train-step --init ''" $TS0 --target "$T/target" --init "" "$T/train.dfs"
empty_in --init-from "dflash-train-step --init-from ''" $TS0 --target "$T/target" --init-from "" "$T/train.dfs"
empty_in --resume "dflash-train-step --resume ''" $TS0 --target "$T/target" --resume "" "$T/train.dfs"
empty_in input "dflash-train-step ''" $TS0 --target "$T/target" --init "$T/drafter.json" ""
popd >/dev/null
[ ! -e "$T/e-ck" ] && [ ! -e "$T/e.dfs" ] && pass "empty output and input paths: no output written elsewhere" ||
    fail "empty output and input paths: no output written elsewhere" "$(ls "$T")"

# ---- --log on a full disk: exit 74 (the lines used to be lost with exit 0) -----------------
expect_exit 74 "--log /dev/full: 74" $INIT --steps 2 --log /dev/full --out "$T/logfull" "$T/train.dfs"
grep -q "/dev/full: write failed" "$T/.err" && pass "--log /dev/full: the message names the log" || fail "--log /dev/full: message" "$(cat "$T/.err")"

# ---- a checkpoint that cannot be written: 74, named under its own path, the old one kept ----
# (writes fail with EFBIG past `ulimit -f`; the message used to name the
# temporary directory, already removed when the user read it)
check "a checkpoint to keep" $INIT --steps 1 --out "$T/ckfull" "$T/train.dfs"
sum_before=$(cat "$T/ckfull"/* | cksum)
# 1 KiB lets config.json through and stops model.safetensors; 0 stops
# config.json. Stderr comes back through a pipe, which the limit does not stop.
for kib in 1 0; do
    err=$( (trap "" XFSZ; ulimit -f $kib; exec $INIT --steps 2 --seed 9 --log /dev/null --out "$T/ckfull/" "$T/train.dfs" 2>&1 >/dev/null) )
    rc=$?
    [ $rc = 74 ] && pass "checkpoint write failure (ulimit -f $kib): 74" || fail "checkpoint write failure (ulimit -f $kib): 74" "exit $rc: $err"
    echo "$err" | grep -Eq "^dflash-train-step: $T/ckfull/[a-z_]+\.(safetensors|json): write failed: File too large$" &&
        pass "checkpoint write failure (ulimit -f $kib): the message names the file in the checkpoint" ||
        fail "checkpoint write failure (ulimit -f $kib): the message names the file in the checkpoint" "$err"
    [ "$(cat "$T/ckfull"/* | cksum)" = "$sum_before" ] && [ -z "$(ls -A "$T" | grep '\.tmp\.')" ] &&
        pass "checkpoint write failure (ulimit -f $kib): the old checkpoint kept, no temporary directory left" ||
        fail "checkpoint write failure (ulimit -f $kib): the old checkpoint kept, no temporary directory left" "$(ls -A "$T")"
done

# ---- a signal ignored at the start stays ignored (nohup, a script's background job) ----------
# (the cleanup replaced SIG_IGN with its handler: a hangup under nohup killed a
# run and lost every step). env sets the disposition, whatever this shell's.
# sig_run ENV-OPTION SIGNAL: a 600-step run; SIGNAL once it logs steps (its
# handlers are set by then); sets rc and at (the steps logged then).
sig_run() {
    rm -rf "$T/sig" "$T/sig.log"
    env "$1" $INIT --steps 600 --loop --log "$T/sig.log" --out "$T/sig" "$T/train.dfs" 2>"$T/sig.err" &
    local pid=$!
    for _ in $(seq 1000); do [ -s "$T/sig.log" ] && break; sleep 0.01; done
    at=$(wc -l <"$T/sig.log")
    kill -"$2" $pid
    wait $pid 2>/dev/null
    rc=$?
}
for s in HUP INT; do
    sig_run --ignore-signal=$s $s
    [ $rc = 0 ] && [ "$at" -lt 600 ] && [ "$(wc -l <"$T/sig.log")" = 600 ] && [ -f "$T/sig/model.safetensors" ] &&
        pass "SIG$s ignored at the start: the run goes on to its checkpoint (signalled at step $at)" ||
        fail "SIG$s ignored at the start: the run goes on to its checkpoint" "rc $rc, signalled at step $at: $(head -c 300 "$T/sig.err")"
done
sig_run --default-signal=HUP,INT HUP
[ $rc = 129 ] && [ ! -e "$T/sig" ] && [ -z "$(ls -A "$T" | grep '^\.sig\.tmp\.')" ] &&
    pass "SIGHUP by default: no checkpoint, no temporary directory, death by the signal (129)" ||
    fail "SIGHUP by default: no checkpoint, no temporary directory, death by the signal" "rc $rc; $(ls -A "$T")"

# ---- outputs follow the umask, as lz4's and zstd's do (files were 0644, directories 0755) ------
for m in 077 002; do
    rm -rf "$T/um" && mkdir "$T/um"
    (umask $m && dflash-pack -o "$T/um/p.dfs" "$T/train.dfs" &&
        dflash-extract -t 1 -m "$T/target" -l 1,3 -o "$T/um/e.dfs" "$T/data.jsonl" &&
        dflash-pack --export "$T/um/ex" "$T/train.dfs" && $INIT --steps 0 --out "$T/um/ck") 2>"$T/.err"
    rc=$?
    f=$(printf '%o' $((0666 & ~0$m))) d=$(printf '%o' $((0777 & ~0$m)))
    odd=$(find "$T/um" -mindepth 1 \( -type f ! -perm "$f" -o -type d ! -perm "$d" \) -printf '%m %P\n' | head -5)
    [ $rc = 0 ] && [ -z "$odd" ] && [ -f "$T/um/e.dfs" ] && [ -f "$T/um/ck/model.safetensors" ] &&
        [ -f "$T/um/ck/config.json" ] && [ -f "$T/um/ex/000000-s0/hidden.npy" ] &&
        pass "umask $m: streams, an export and a checkpoint are $f, their directories $d" ||
        fail "umask $m: streams, an export and a checkpoint are $f, their directories $d" "rc $rc: $odd $(head -c 200 "$T/.err")"
done

# ---- pipelines/demo.sh --help prints its header (it used to start the demo) ---------------
mkdir -p "$T/demo" && echo keep >"$T/demo/mine"
(cd "$T/demo" && DEMO_OUT=out "$here/pipelines/demo.sh" --help) >"$T/demo.help" 2>&1
rc=$?
[ $rc = 0 ] && grep -q "Variables: DEMO_OUT" "$T/demo.help" && [ ! -e "$T/demo/out" ] &&
    pass "demo.sh --help: the header, exit 0, nothing run" || fail "demo.sh --help" "rc $rc, $(head -c 300 "$T/demo.help")"
expect_exit 2 "demo.sh with an unknown argument: 2" env DEMO_OUT="$T/demo/out" "$here/pipelines/demo.sh" --fast
[ ! -e "$T/demo/out" ] && pass "demo.sh --fast: nothing run" || fail "demo.sh --fast: nothing run"

# ---- dflash-pack: the read-only modes refuse the options of the writing modes ----------------
# (--verify -o x.dfs, --inspect --shuffle, ... used to run, ignoring them)
for o in "--verify -o $T/v.dfs" "--inspect --shuffle" "--stats --split a=1,b=1" "--export $T/ex --compress lz4" \
         "--inspect --shards 2" "--verify --byte-shuffle on"; do
    expect_exit 2 "dflash-pack $(echo "$o" | sed "s|$T/||g"): 2" dflash-pack $o "$T/train.dfs"
done
[ ! -e "$T/v.dfs" ] && [ ! -e "$T/ex" ] && pass "dflash-pack: nothing written by a refused command line" ||
    fail "dflash-pack: nothing written by a refused command line"
check "dflash-pack --verify alone still runs" dflash-pack --verify "$T/train.dfs"

# ---- bad target config fields: refused, naming the file and the field -----------------------
# (a num_hidden_layers that disagrees with the weights passed when the taps were
# shallow, and went into the stream header; a non-boolean flag read as false)
badcfg() {
    rm -rf "$T/bt" && cp -r "$T/target" "$T/bt"
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); exec(sys.argv[2]); json.dump(c, open(sys.argv[1], 'w'))" \
        "$T/bt/config.json" "$1"
}
for e in "c['num_hidden_layers'] = 100" "c['num_hidden_layers'] = 4" "c['tie_word_embeddings'] = 'no'" \
         "c['attention_bias'] = 1" "c['use_sliding_window'] = 'false'"; do
    badcfg "$e"
    expect_exit 65 "target config $e: 65" dflash-extract -t 1 -m "$T/bt" -l 1 -o "$T/bad.dfs" "$T/data.jsonl"
    field=$(echo "$e" | sed "s/c\['\([a-z_]*\)'\].*/\1/")
    grep -q "bt/config.json: \"$field\"" "$T/.err" && pass "target config $e: file and field named" ||
        fail "target config $e: file and field named" "$(cat "$T/.err")"
done
badcfg "c['tie_word_embeddings'] = None"
check "target config tie_word_embeddings null: as absent (false)" dflash-extract -t 1 -m "$T/bt" -l 1 -o "$T/ok.dfs" "$T/data.jsonl"

# ---- a corrupt trainer_state.json input position: 65 (a negative count was taken as 0) -------
check "a checkpoint to resume" $INIT --steps 2 --out "$T/ckr" "$T/train.dfs"
# a resumed run with every step past the schedule is refused, saying how to go
# on: ckr made 2 steps with --total-steps 2 (the default, its --steps), so
# steps 3..4 would run at learning rate 0 and change no weight (the man page's
# "continue for 1000 more steps" example did that, exit 0, with only a note)
expect_exit 2 "resume with every step past --total-steps: refused (2)" $TS --target "$T/target" --resume "$T/ckr" \
    --steps 2 --log "$T/past.log" --out "$T/ckp" "$T/train.dfs"
grep -q "ckr: the checkpoint is at step 2, the end of its learning-rate schedule (--total-steps 2" "$T/.err" &&
    grep -q "with --init-from $T/ckr; give the first run of a training the --total-steps of all its runs" "$T/.err" &&
    pass "  ... naming the step, the schedule and the ways on" || fail "  ... naming the step, the schedule and the ways on" "$(cat "$T/.err")"
[ ! -e "$T/ckp" ] && [ ! -s "$T/past.log" ] && pass "  ... before any step" || fail "  ... before any step"
check "a run within the schedule" $INIT --steps 2 --total-steps 4 --out "$T/ckq" "$T/train.dfs"
grep -q "past --total-steps" "$T/.err" && fail "no note within the schedule" "$(cat "$T/.err")" ||
    pass "no note within the schedule"
# partly past it: the run is made, and the note says where the rate is 0 and what to give
check "resume partly past --total-steps: runs" $TS --target "$T/target" --resume "$T/ckq" --steps 4 --out "$T/ckp" "$T/train.dfs"
grep -q "note: steps 5..6 are past --total-steps 4, where the learning rate is 0 and the weights do not change (give the first run of a training the --total-steps of all its runs)" "$T/.err" &&
    pass "  ... the note names the steps and the fix" || fail "  ... the note names the steps and the fix" "$(cat "$T/.err")"
for e in "s['input']['records'] = -5" "s['input']['epoch'] = 'one'" "del s['input']['records']"; do
    rm -rf "$T/ckb" && cp -r "$T/ckr" "$T/ckb"
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); exec(sys.argv[2]); json.dump(s, open(sys.argv[1], 'w'))" \
        "$T/ckb/trainer_state.json" "s['input']['path'] = '$(realpath "$T/train.dfs")'; $e"
    expect_exit 65 "resume with trainer_state.json $e: 65" $TS --target "$T/target" --resume "$T/ckb" --steps 1 --out "$T/ckc" "$T/train.dfs"
    field=$(echo "$e" | sed "s/.*\['input'\]\['\([a-z]*\)'\].*/\1/")
    grep -q "ckb/trainer_state.json: input.$field is not a count" "$T/.err" && pass "resume with $e: file and field named" ||
        fail "resume with $e: file and field named" "$(cat "$T/.err")"
done

# ---- a stored choice outside the option's words: 65, naming the file, field and value ------
# (options.loss "foo" used to train as ce, labels "bar" as data, exit 0)
for e in "loss=foo:ce|kl" "labels=bar:data|target" "loss_norm=sum:weighted|count"; do
    kv=${e%%:*} key=${kv%%=*} val=${kv#*=} words=${e#*:}
    rm -rf "$T/ckb" && cp -r "$T/ckr" "$T/ckb"
    python3 -c "import json, sys; p = sys.argv[1]; s = json.load(open(p)); s['options'][sys.argv[2]] = sys.argv[3]; json.dump(s, open(p, 'w'))" \
        "$T/ckb/trainer_state.json" "$key" "$val"
    expect_exit 65 "resume with options.$key \"$val\": 65" $TS --target "$T/target" --resume "$T/ckb" --steps 1 --out "$T/ckc" "$T/train.dfs"
    grep -qF "ckb/trainer_state.json: options.$key is \"$val\", not one of $words" "$T/.err" &&
        pass "resume with options.$key \"$val\": file, field and value named" ||
        fail "resume with options.$key \"$val\": file, field and value named" "$(cat "$T/.err")"
done
[ ! -e "$T/ckc" ] && pass "no checkpoint from a bad stored choice" || fail "no checkpoint from a bad stored choice"
# ---- other bad stored values: 65, naming the file and the field ----------------------------------
# (options.anchors 0 used to be reported as a command-line error, "--anchors must
# be at least 1", exit 2; a string for a number as "options.lr is missing"; a
# bad "step" named only the directory)
while IFS='|' read -r e msg; do
    rm -rf "$T/ckb" && cp -r "$T/ckr" "$T/ckb"
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); exec(sys.argv[2]); json.dump(s, open(sys.argv[1], 'w'))" \
        "$T/ckb/trainer_state.json" "$e"
    expect_exit 65 "resume with $e: 65" $TS --target "$T/target" --resume "$T/ckb" --steps 1 --out "$T/ckc" "$T/train.dfs"
    grep -qF "dflash-train-step: $T/ckb/trainer_state.json: $msg" "$T/.err" && pass "resume with $e: the file and the field named" ||
        fail "resume with $e: the file and the field named" "$(cat "$T/.err")"
done <<'CASES'
s['options']['anchors'] = 0|options.anchors is 0, must be at least 1
s['options']['warmup_ratio'] = 1.5|options.warmup_ratio is 1.5, must be in [0, 1]
s['options']['batch_seqs'] = 0; s['options']['batch_tokens'] = 0|options.batch_seqs and options.batch_tokens are both 0
s['options']['loss'] = 'kl'; s['options']['labels'] = 'target'|options.labels is "target" with options.loss "kl"
s['options']['lr'] = '0.01'|options.lr is not a number
s['options']['micro_rows'] = 16384.0|options.micro_rows is not an integer
del s['options']['gamma']|options.gamma is missing
s['step'] = -1|"step" is not a count
CASES
# a stored value out of range is the file's fault even when the option is given
rm -rf "$T/ckb" && cp -r "$T/ckr" "$T/ckb"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); s['options']['anchors'] = 0; json.dump(s, open(sys.argv[1], 'w'))" "$T/ckb/trainer_state.json"
expect_exit 65 "resume with options.anchors 0 and --anchors 4 given: 65" $TS --target "$T/target" --resume "$T/ckb" --anchors 4 --steps 1 --out "$T/ckc" "$T/train.dfs"
[ ! -e "$T/ckc" ] && pass "no checkpoint from a bad stored value" || fail "no checkpoint from a bad stored value"

# ---- a terminal on standard input: refused like dflash-pack does (they used to wait on it) ----
if command -v script >/dev/null; then
    for c in "dflash-score --threads 1 --target $T/target --drafter $T/ck2" \
             "dflash-train-step --threads 1 --target $T/target --init $T/drafter.json --steps 1 --out $T/tty"; do
        script -qec "$c" /dev/null </dev/null >"$T/tty.out" 2>&1
        rc=$?
        [ $rc = 2 ] && grep -q "refusing to read a binary stream from a terminal" "$T/tty.out" &&
            pass "${c%% *} with stdin a terminal: 2" || fail "${c%% *} with stdin a terminal: 2" "rc $rc: $(head -c 300 "$T/tty.out")"
    done
    script -qec "dflash-train-step --threads 1 --target $T/target --init $T/drafter.json --steps 0 --out $T/tty0" /dev/null </dev/null >/dev/null 2>&1 &&
        [ -f "$T/tty0/model.safetensors" ] && pass "dflash-train-step --steps 0 --init reads no input: a terminal is fine" ||
        fail "dflash-train-step --steps 0 --init reads no input: a terminal is fine"
fi

# ---- a failed write to stdout names stdout, as every other output's error names its file ----
# (dfl_close_stdout said "writing output failed: No space left on device",
# naming nothing)
while IFS='|' read -r name cmd; do
    expect_exit 74 "$name >/dev/full: 74" sh -c "$cmd >/dev/full"
    grep -q "^${name%% *}: stdout: write failed: No space left on device$" "$T/.err" &&
        pass "$name >/dev/full: the message names stdout" || fail "$name >/dev/full: the message names stdout" "$(cat "$T/.err")"
done <<CASES
dflash-pack --inspect|dflash-pack --inspect $T/train.dfs
dflash-pack --stats|dflash-pack --stats $T/train.dfs
dflash-pack --verify|dflash-pack --verify $T/train.dfs
dflash-pack (a merge)|dflash-pack $T/train.dfs
dflash-score|$SC $T/train.dfs
dflash-extract|dflash-extract -t 1 -m $T/target -l 1,3 $T/data.jsonl
CASES

# ---- standard input closed (<&-): 'cannot open input' (66) naming stdin --------------------
# (it was a read error, 74: "stdin: byte 0: read error: Bad file descriptor").
# A file opened first must not take descriptor 0 and be read as stdin.
while IFS='|' read -r name cmd; do
    expect_exit 66 "$name with stdin closed: 66" sh -c "$cmd <&-"
    grep -Eq "^${name%% *}: <?stdin>?: cannot open: standard input is closed$" "$T/.err" &&
        pass "$name with stdin closed: the message names stdin" || fail "$name with stdin closed: the message names stdin" "$(cat "$T/.err")"
done <<CASES
dflash-pack --inspect -|dflash-pack --inspect -
dflash-pack --verify FILE -|dflash-pack --verify $T/train.dfs -
dflash-pack (a merge) FILE -|dflash-pack -o $T/closed.dfs $T/train.dfs -
dflash-score|$SC
dflash-train-step|$INIT --steps 1 --out $T/closed-ck
dflash-extract|dflash-extract -t 1 -m $T/target -l 1,3 -o $T/closed.dfs
CASES
[ ! -e "$T/closed.dfs" ] && [ ! -e "$T/closed-ck" ] && pass "stdin closed: no output" || fail "stdin closed: no output"
