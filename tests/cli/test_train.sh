#!/usr/bin/env bash
# dflash-train-step end to end on a tiny random target (mktarget) and
# hidden states extracted from it (dflash-extract): learning, resume
# bit-exactness, determinism, stream refusals, interrupted runs, released
# checkpoints, pipes, the checkpoint layout.
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget" "$DFLASH_BIN/dflash-extract"
TS="dflash-train-step --threads 1"

# A target (untied LM head) and 12 sequences: a 6-token prompt (loss_mask 0)
# and a response repeating a 4-token motif.
tiny_target "$T/target" --layers 6 --tie no --seed 2
python3 - "$T/data.jsonl" <<'EOF'
import json, random, sys
r = random.Random(5)
with open(sys.argv[1], "w") as f:
    for i in range(12):
        prompt = [r.randrange(60) for _ in range(6)]
        motif = [r.randrange(60) for _ in range(4)]
        ids = prompt + [motif[j % 4] for j in range(42)]
        f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 6 + [1] * 42}) + "\n")
EOF
check "extract the training stream" dflash-extract -m "$T/target" -l 1,3,4 --with target-ids --with last-hidden \
    -o "$T/train.dfs" "$T/data.jsonl"
check "extract a stream tapping other layers" dflash-extract -m "$T/target" -l 1,2,4 -o "$T/other.dfs" "$T/data.jsonl"
check "extract a stream without target ids" dflash-extract -m "$T/target" -l 1,3,4 -o "$T/plain.dfs" "$T/data.jsonl"
drafter_config "$T/drafter.json"
COMMON="--target $T/target --lr 1e-2 --anchors 12 --batch-seqs 4 --loop"

# ---- learning: loss falls and offline tau rises -------------------------------------
check "150 steps" $TS $COMMON --init "$T/drafter.json" --steps 150 --seed 1 --log "$T/learn.log" --out "$T/learn" "$T/train.dfs"
check "learning: loss falls by half and offline tau rises" python3 - "$T/learn.log" <<'EOF'
import json, sys
L = [json.loads(x) for x in open(sys.argv[1])]
assert len(L) == 150 and [s["step"] for s in L] == list(range(1, 151)), "one line per step"
first, last = L[:10], L[-10:]
mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)
print("loss %.3f -> %.3f, tau %.3f -> %.3f, accuracy %.3f -> %.3f" % (mean(first, "loss"), mean(last, "loss"),
      mean(first, "tau"), mean(last, "tau"), mean(first, "accuracy"), mean(last, "accuracy")))
assert mean(last, "loss") < 0.5 * mean(first, "loss"), "loss did not halve"
assert mean(last, "tau") > mean(first, "tau") + 0.1, "offline tau did not rise"
s = L[-1]
assert len(s["accuracy_per_position"]) == 5 and 1.0 <= s["tau"] <= 6.0
for k in ("grad_norm", "lr", "tokens_per_s", "block_tokens_per_s", "sequences", "tokens", "input_wait_s"):
    assert k in s, k
assert all(0 <= x["input_wait_s"] <= x["seconds"] for x in L), "input_wait_s is a part of seconds"
# warm-up then cosine: lr peaks at step floor(0.04*150) = 6 and ends near 0
assert abs(L[5]["lr"] - 1e-2) < 1e-9 and L[0]["lr"] < L[5]["lr"] and L[-1]["lr"] < 1e-5
EOF
sed 's/^/    /' "$T/.out"

# ---- the checkpoint layout ----------------------------------------------------------------
check "checkpoint: released names, bf16, shapes, config keys" python3 - "$T/learn" <<'EOF'
import json, struct, sys, os
d = sys.argv[1]
with open(os.path.join(d, "model.safetensors"), "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    hdr = json.loads(f.read(n))
meta = hdr.pop("__metadata__")
assert meta == {"format": "pt"}, meta
H, K, I, L, QD, KVD = 32, 3, 48, 2, 32, 16
want = {"fc.weight": [H, K * H], "hidden_norm.weight": [H], "norm.weight": [H]}
for i in range(L):
    p = f"layers.{i}."
    want.update({p + "self_attn.q_proj.weight": [QD, H], p + "self_attn.k_proj.weight": [KVD, H],
                 p + "self_attn.v_proj.weight": [KVD, H], p + "self_attn.o_proj.weight": [H, QD],
                 p + "self_attn.q_norm.weight": [8], p + "self_attn.k_norm.weight": [8],
                 p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
                 p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H], p + "mlp.down_proj.weight": [H, I]})
assert set(hdr) == set(want), set(hdr) ^ set(want)
assert len(hdr) == 3 + 11 * L
for k, v in hdr.items():
    assert v["dtype"] == "BF16" and v["shape"] == want[k], (k, v)
c = json.load(open(os.path.join(d, "config.json")))
assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
assert c["block_size"] == 6 and c["num_target_layers"] == 6
assert c["dflash_config"] == {"mask_token_id": 60, "target_layer_ids": [1, 3, 4]}
assert c["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and c["tie_word_embeddings"] is False
assert c["layer_types"] == ["full_attention"] * 2 and c["rms_norm_eps"] == 1e-6
s = json.load(open(os.path.join(d, "trainer_state.json")))
assert s["step"] == 150 and s["options"]["total_steps"] == 150 and s["options"]["gamma"] == 4.0
EOF

# max_position_embeddings, which serving engines read as the drafter's context
# length: a config without it takes the target's (it used to be written as 0),
# one with it keeps its own, and a 0 (from the old writer) is replaced on resume
tmax=$(python3 -c "import json; print(json.load(open('$T/target/config.json'))['max_position_embeddings'])")
check "max_position_embeddings: the learn checkpoint has the target's ($tmax)" \
    python3 -c "import json; v = json.load(open('$T/learn/config.json'))['max_position_embeddings']; assert v == $tmax, v"
python3 -c "import json; c = json.load(open('$T/drafter.json')); c['max_position_embeddings'] = 777
json.dump(c, open('$T/drafter-mp.json', 'w'))"
check "--init from a config with max_position_embeddings" $TS --target "$T/target" --init "$T/drafter-mp.json" --steps 0 --out "$T/mp"
check "  ... keeps it" python3 -c "import json; v = json.load(open('$T/mp/config.json'))['max_position_embeddings']; assert v == 777, v"

# ---- a drafter with a sliding-window layer (Qwen3.6-27B's drafter has four) -----------------
# It trains (a different model from the full one: same seed, other losses),
# its checkpoint spells the layers out, and what would run without its
# window is refused, naming the key.
python3 - "$T/drafter.json" "$T" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
swa = dict(c, layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=8)
json.dump(swa, open(sys.argv[2] + "/drafter-swa.json", "w"))
json.dump(dict(swa, use_sliding_window=False), open(sys.argv[2] + "/drafter-swa-off.json", "w"))
json.dump(dict(swa, sliding_window=5), open(sys.argv[2] + "/drafter-swa-small.json", "w"))
EOF
check "sliding window: 20 steps" $TS $COMMON --init "$T/drafter-swa.json" --steps 20 --total-steps 25 --seed 1 --log "$T/swa.log" --out "$T/swa" "$T/train.dfs"
check "  ... its checkpoint's layers, and losses other than the full drafter's" python3 - "$T/swa" "$T/swa.log" "$T/learn.log" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
assert c["layer_types"] == ["sliding_attention", "full_attention"], c["layer_types"]
assert c["use_sliding_window"] is True and c["sliding_window"] == 8, c
swa = [json.loads(x)["loss"] for x in open(sys.argv[2])]
full = [json.loads(x)["loss"] for x in open(sys.argv[3])][:20]
assert len(swa) == 20 and swa[0] != full[0] and all(a == a for a in swa), (swa[:3], full[:3])
EOF
check "  ... resumes" $TS $COMMON --resume "$T/swa" --steps 5 --out "$T/swa2" "$T/train.dfs"
expect_exit 65 "sliding layer without use_sliding_window: refused" $TS --target "$T/target" --init "$T/drafter-swa-off.json" --steps 0 --out "$T/swa-off"
grep -q 'layer_types"\[0\] is "sliding_attention" but "use_sliding_window" is not true' "$T/.err" &&
    pass "  ... naming the key" || fail "  ... naming the key" "$(cat "$T/.err")"
expect_exit 65 "sliding window smaller than the block: refused" $TS --target "$T/target" --init "$T/drafter-swa-small.json" --steps 0 --out "$T/swa-small"
grep -q '"sliding_window" 5 is smaller than the block size 6' "$T/.err" && pass "  ... saying why" ||
    fail "  ... saying why" "$(cat "$T/.err")"
check "  ... and wrote nothing" test ! -e "$T/swa-off" -a ! -e "$T/swa-small"

# ---- the defaults --help shows are the ones a run records ------------------------------------
# The help's defaults are written in the option table by hand (the real ones
# are set in options_default), so each is read back from a run that gives no
# option: trainer_state.json's options. --total-steps defaults to the --steps
# of the first run that makes steps: a --steps 0 run (a baseline to score)
# records 0, not set yet, and the help must say so.
$TS --target "$T/target" --init "$T/drafter.json" --steps 3 --out "$T/defaults" "$T/train.dfs" 2>/dev/null
$TS --target "$T/target" --init "$T/drafter.json" --steps 0 --out "$T/defaults0" 2>/dev/null
check "the defaults of --help are those a run records (block size 6)" python3 - "$T/defaults" "$T/defaults0" <<'EOF2'
import json, re, subprocess, sys
help = subprocess.run(["dflash-train-step", "--help"], capture_output=True, text=True, check=True).stdout
text = re.sub(r"\n {20,}", " ", help)  # the options' continuation lines
default = {m.group(1): m.group(2) for m in re.finditer(r"^ +(?:-\w, )?--([a-z-]+)[^\n]*\(default: ([^\n]*)\)$", text, re.M)}
o = json.load(open(sys.argv[1] + "/trainer_state.json"))["options"]
o0 = json.load(open(sys.argv[2] + "/trainer_state.json"))["options"]
for opt in ["anchors", "lr", "warmup-ratio", "weight-decay", "max-grad-norm", "batch-seqs", "batch-tokens",
            "micro-rows", "noise-std"]:
    assert float(default[opt]) == o[opt.replace("-", "_")], (opt, default[opt], o[opt.replace("-", "_")])
for opt in ["loss", "labels", "loss-norm"]:
    assert default[opt] == o[opt.replace("-", "_")], (opt, default[opt], o[opt.replace("-", "_")])
assert default["gamma"] == "7 for B >= 16, 5 for B >= 10, else 4" and o["gamma"] == 4, (default["gamma"], o["gamma"])
assert default["total-steps"].startswith("--steps of the first run") and o["total_steps"] == 3, o["total_steps"]
assert o0["total_steps"] == 0, o0["total_steps"]
assert default["total-steps"] == "--steps of the first run that makes steps", default["total-steps"]
EOF2

# ---- the schedule of a --steps 0 baseline is set by the first run that makes steps -------------
# A baseline (--steps 0, no --total-steps) used to record total_steps 1, which
# every --resume keeps: a --resume --steps 4 made one step at --lr and three
# at rate 0. Now it records 0 (not set yet) and the first --resume that makes
# steps sets it as a first run would: so baseline + resume 4 is, bit for bit,
# the 4-step run (the input is read from its start: the baseline read none).
B="$COMMON --seed 3 --warmup-ratio 0.25"
state() { python3 -c "import json, sys; print(json.load(open(sys.argv[1] + '/trainer_state.json'))$2)" "$1"; }
lrs() { python3 -c "import json, sys; print(' '.join('%.6g' % json.loads(x)['lr'] for x in open(sys.argv[1])))" "$1"; }
check "a --steps 0 baseline" $TS $B --init "$T/drafter.json" --steps 0 --out "$T/base0"
[ "$(state "$T/base0" "['options']['total_steps']")" = 0 ] && pass "  ... records total_steps 0 (not set yet)" ||
    fail "  ... records total_steps 0 (not set yet)" "$(state "$T/base0" "['options']")"
check "the same 4 steps in one run" $TS $B --init "$T/drafter.json" --steps 4 --log "$T/one4.log" --out "$T/one4" "$T/train.dfs"
check "--resume the baseline for 4 steps" $TS --target "$T/target" --loop --resume "$T/base0" --steps 4 \
    --log "$T/res4.log" --out "$T/res4" "$T/train.dfs"
grep -q "past --total-steps" "$T/.err" && fail "  ... no note of steps past the schedule" "$(cat "$T/.err")" ||
    pass "  ... no note of steps past the schedule"
[ "$(lrs "$T/res4.log")" = "$(lrs "$T/one4.log")" ] && [ "$(state "$T/res4" "['options']['total_steps']")" = 4 ] &&
    pass "  ... the learning rates of a 4-step schedule, and total_steps 4 recorded" ||
    fail "  ... the learning rates of a 4-step schedule, and total_steps 4 recorded" \
        "$(lrs "$T/res4.log") vs $(lrs "$T/one4.log"), total_steps $(state "$T/res4" "['options']['total_steps']")"
for f in model.safetensors trainer_state.safetensors config.json; do
    check "  ... bit-exact with the one run: $f" cmp "$T/one4/$f" "$T/res4/$f"
done
# the first run that makes steps gives its --total-steps, as a first run would
check "--resume the baseline with --total-steps 10" $TS --target "$T/target" --loop --resume "$T/base0" --steps 2 \
    --total-steps 10 --log "$T/res10.log" --out "$T/res10" "$T/train.dfs"
check "  ... records 10, and the rates are those of 10 steps" $TS $B --init "$T/drafter.json" --steps 2 \
    --total-steps 10 --log "$T/one10.log" --out "$T/one10" "$T/train.dfs"
[ "$(lrs "$T/res10.log")" = "$(lrs "$T/one10.log")" ] && [ "$(state "$T/res10" "['options']['total_steps']")" = 10 ] &&
    pass "  ... records 10, and the rates are those of 10 steps" ||
    fail "  ... records 10, and the rates are those of 10 steps" "$(lrs "$T/res10.log") vs $(lrs "$T/one10.log")"
# once set, it is the checkpoint's: a different one is refused as any option
expect_exit 2 "a set schedule: another --total-steps is refused (2)" $TS --target "$T/target" --resume "$T/res10" \
    --steps 1 --total-steps 12 --out "$T/res12" "$T/train.dfs"
grep -q -- "--total-steps 12 differs from the checkpoint's 10" "$T/.err" && pass "  ... naming both" ||
    fail "  ... naming both" "$(cat "$T/.err")"
# a --resume of the baseline that makes no step leaves it unset, or sets the one given
check "--resume the baseline for 0 steps" $TS --target "$T/target" --resume "$T/base0" --steps 0 --out "$T/base00" "$T/train.dfs"
[ "$(state "$T/base00" "['options']['total_steps']")" = 0 ] && pass "  ... still not set" ||
    fail "  ... still not set" "$(state "$T/base00" "['options']['total_steps']")"
check "--resume the baseline for 0 steps with --total-steps 7" $TS --target "$T/target" --resume "$T/base0" --steps 0 \
    --total-steps 7 --out "$T/base07" "$T/train.dfs"
[ "$(state "$T/base07" "['options']['total_steps']")" = 7 ] && pass "  ... records 7" ||
    fail "  ... records 7" "$(state "$T/base07" "['options']['total_steps']")"
# --total-steps given with --steps 0 is recorded as given, and kept
check "--steps 0 --total-steps 6" $TS $B --init "$T/drafter.json" --steps 0 --total-steps 6 --out "$T/base6"
check "  ... resumed for 2 steps" $TS --target "$T/target" --loop --resume "$T/base6" --steps 2 --log "$T/res6.log" \
    --out "$T/res6" "$T/train.dfs"
check "  ... as 2 steps of a 6-step schedule" $TS $B --init "$T/drafter.json" --steps 2 --total-steps 6 \
    --log "$T/one6.log" --out "$T/one6" "$T/train.dfs"
[ "$(state "$T/base6" "['options']['total_steps']")" = 6 ] && [ "$(state "$T/res6" "['options']['total_steps']")" = 6 ] &&
    [ "$(lrs "$T/res6.log")" = "$(lrs "$T/one6.log")" ] && pass "  ... 6 recorded and kept, the rates of 6 steps" ||
    fail "  ... 6 recorded and kept, the rates of 6 steps" "$(lrs "$T/res6.log") vs $(lrs "$T/one6.log")"
expect_exit 2 "--steps 0 --total-steps 0: refused (2)" $TS $B --init "$T/drafter.json" --steps 0 --total-steps 0 --out "$T/bz"
# an older checkpoint's set schedule (a baseline then recorded 1) is read as before
rm -rf "$T/old1" && cp -r "$T/base0" "$T/old1"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); s['options']['total_steps'] = 1
json.dump(s, open(sys.argv[1], 'w'))" "$T/old1/trainer_state.json"
check "an older baseline (total_steps 1) resumes" $TS --target "$T/target" --loop --resume "$T/old1" --steps 2 \
    --out "$T/old1r" "$T/train.dfs"
grep -q "note: steps 2..2 are past --total-steps 1" "$T/.err" && pass "  ... keeping its schedule, with the note" ||
    fail "  ... keeping its schedule, with the note" "$(cat "$T/.err")"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); s['options']['total_steps'] = -1
json.dump(s, open(sys.argv[1], 'w'))" "$T/old1/trainer_state.json"
expect_exit 65 "a stored total_steps -1: 65" $TS --target "$T/target" --resume "$T/old1" --steps 1 --out "$T/oldn" "$T/train.dfs"
grep -q "trainer_state.json: options.total_steps is -1" "$T/.err" && pass "  ... naming the field" ||
    fail "  ... naming the field" "$(cat "$T/.err")"
# AdamW's constants are stored options too: checked (they were read by
# nothing, any value of any type resumed with the defaults) and taken.
for bad in 'beta1|"x"|options.beta1 is not a number' 'beta2|1.0|options.beta2 is 1, must be in [0, 1)' \
           'adam_eps|0|options.adam_eps is 0, must be a positive float' 'beta1|-0.5|options.beta1 is -0.5, must be in [0, 1)' \
           'beta1|DEL|options.beta1 is missing'; do
    IFS='|' read -r key val want <<<"$bad"
    rm -rf "$T/adam" && cp -r "$T/base6" "$T/adam"
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); o = s['options']
if sys.argv[3] == 'DEL': del o[sys.argv[2]]
else: o[sys.argv[2]] = json.loads(sys.argv[3])
json.dump(s, open(sys.argv[1], 'w'))" "$T/adam/trainer_state.json" "$key" "$val"
    expect_exit 65 "a stored $key $val: 65" $TS --target "$T/target" --loop --resume "$T/adam" --steps 1 --out "$T/adamr" "$T/train.dfs"
    grep -qF "trainer_state.json: $want" "$T/.err" && pass "  ... naming the field" || fail "  ... naming the field" "$(cat "$T/.err")"
done
rm -rf "$T/adam" && cp -r "$T/base6" "$T/adam"
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); s['options']['beta2'] = 0.99
json.dump(s, open(sys.argv[1], 'w'))" "$T/adam/trainer_state.json"
check "a stored beta2 0.99 resumes" $TS --target "$T/target" --loop --resume "$T/adam" --steps 1 --out "$T/adamr" "$T/train.dfs"
[ "$(state "$T/adamr" "['options']['beta2']")" = 0.99 ] && pass "  ... with it, kept" ||
    fail "  ... with it, kept" "$(state "$T/adamr" "['options']['beta2']")"

# ---- resume: N then N more equals 2N, bit for bit ------------------------------------------
O="$COMMON --total-steps 10 --seed 7"
check "2N steps in one run" $TS $O --init "$T/drafter.json" --steps 10 --out "$T/r2n" "$T/train.dfs"
check "N steps" $TS $O --init "$T/drafter.json" --steps 5 --out "$T/rn" "$T/train.dfs"
check "--resume and N more" $TS --target "$T/target" --loop --resume "$T/rn" --steps 5 --out "$T/rnn" "$T/train.dfs"
for f in model.safetensors trainer_state.safetensors trainer_state.json config.json; do
    check "resume bit-exact: $f" cmp "$T/r2n/$f" "$T/rnn/$f"
done
# the input position crosses an epoch boundary here (12 records, 4 per step)
check "resume position: epoch and records recorded" grep -q '"epoch": 3' "$T/r2n/trainer_state.json"
expect_exit 2 "--resume with a different --gamma is refused" $TS --target "$T/target" --resume "$T/rn" --gamma 3 \
    --steps 1 --out "$T/x" "$T/train.dfs"
cp "$T/.err" "$T/err.txt"
check "  ... naming the option" grep -q -- "--gamma" "$T/err.txt"
mkdir -p "$T/model-only"
cp "$T/rn/config.json" "$T/rn/model.safetensors" "$T/model-only/"
expect_exit 66 "--resume of a model-only checkpoint is refused" $TS --target "$T/target" --resume "$T/model-only" \
    --steps 1 --out "$T/x" "$T/train.dfs"
# A FIFO in place of the trainer state is refused, not waited on.
for f in trainer_state.json trainer_state.safetensors; do
    rm -rf "$T/fifo-state"
    cp -r "$T/rn" "$T/fifo-state"
    rm "$T/fifo-state/$f"
    mkfifo "$T/fifo-state/$f"
    expect_exit 66 "--resume with a FIFO as $f: exit 66, no hang" timeout 60 $TS --target "$T/target" \
        --resume "$T/fifo-state" --steps 1 --out "$T/x" "$T/train.dfs"
    cp "$T/.err" "$T/err.txt"
    check "  ... named" grep -q "fifo-state/$f: is a pipe or FIFO, not a regular file" "$T/err.txt"
done
# a max_position_embeddings of 0 (as the old code wrote) is replaced by the target's
cp -r "$T/rn" "$T/mp0"
python3 -c "import json; p = '$T/mp0/config.json'; c = json.load(open(p)); c['max_position_embeddings'] = 0; json.dump(c, open(p, 'w'))"
check "--resume a checkpoint with max_position_embeddings 0" $TS --target "$T/target" --loop --resume "$T/mp0" --steps 1 \
    --out "$T/mp1" "$T/train.dfs"
check "  ... writes the target's" python3 -c "import json; v = json.load(open('$T/mp1/config.json'))['max_position_embeddings']; assert v == $tmax, v"

# ---- reading ahead: the same run, and errors where the steps meet them ------------------------
check "--read-ahead off: 2N steps" $TS $O --read-ahead off --init "$T/drafter.json" --steps 10 --out "$T/r2n-off" \
    "$T/train.dfs"
for f in model.safetensors trainer_state.safetensors trainer_state.json; do
    check "read ahead (the default) or not: identical $f" cmp "$T/r2n/$f" "$T/r2n-off/$f"
done
# the stream cut inside a record: the steps before it are made, then the same error either way
CUT="--target $T/target --lr 1e-2 --anchors 12 --batch-seqs 1 --total-steps 12"
head -c $(( $(stat -c %s "$T/train.dfs") * 3 / 5 )) "$T/train.dfs" >"$T/cut.dfs"
for ra in on off; do
    expect_exit 65 "a stream cut inside a record, --read-ahead $ra: exit 65" $TS $CUT --read-ahead $ra \
        --init "$T/drafter.json" --steps 12 --log "$T/cut-$ra.log" --out "$T/x" "$T/cut.dfs"
    cp "$T/.err" "$T/cut-$ra.err"
done
check "  ... the same message" cmp "$T/cut-on.err" "$T/cut-off.err"
check "  ... naming the file" grep -q "cut.dfs" "$T/cut-on.err"
check "  ... after the same steps, with the same losses" python3 - "$T/cut-on.log" "$T/cut-off.log" <<'EOF'
import json, sys
a, b = ([json.loads(x) for x in open(f)] for f in sys.argv[1:])
same = lambda L: [(x["step"], x["loss"], x["grad_norm"], x["tokens"]) for x in L]
assert len(a) >= 3 and same(a) == same(b), (same(a), same(b))
print(len(a), "steps")
EOF
check "  ... and no checkpoint" test ! -e "$T/x"
ncut=$(wc -l <"$T/cut-on.log")
# the thread has read into the cut by then; the run never needs that record
check "the steps before the cut alone, read ahead: exit 0" $TS $CUT --init "$T/drafter.json" --steps "$ncut" \
    --out "$T/cut-ok" "$T/cut.dfs"
check "  ... a checkpoint at step $ncut" grep -q "\"step\": $ncut," "$T/cut-ok/trainer_state.json"
expect_exit 2 "--read-ahead takes on or off" $TS $CUT --read-ahead maybe --init "$T/drafter.json" --steps 1 \
    --out "$T/x" "$T/train.dfs"
# a FIFO is read as records are needed: three steps from a writer that then
# keeps the FIFO open end without waiting for it (reading ahead would block
# on a fourth record that never comes)
python3 - "$T/data.jsonl" "$T/three.jsonl" <<'EOF'
import sys
lines = open(sys.argv[1]).readlines()[:3]
open(sys.argv[2], "w").writelines(lines)
EOF
check "a three-record stream" dflash-extract -m "$T/target" -l 1,3,4 -o "$T/three.dfs" "$T/three.jsonl"
mkfifo "$T/fifo"
{ cat "$T/three.dfs"; sleep 30; } >"$T/fifo" &
writer=$!
check "three steps from a FIFO whose writer stays, without waiting for it" timeout 15 $TS $CUT \
    --init "$T/drafter.json" --steps 3 --out "$T/fifo-ck" "$T/fifo"
kill $writer 2>/dev/null; wait $writer 2>/dev/null
check "  ... the checkpoint of the same steps from a file" sh -c "$TS $CUT --init '$T/drafter.json' --steps 3 \
    --out '$T/file-ck' '$T/three.dfs' && cmp '$T/fifo-ck/model.safetensors' '$T/file-ck/model.safetensors'"

# ---- determinism ----------------------------------------------------------------------------
check "same seed again" $TS $O --init "$T/drafter.json" --steps 10 --out "$T/r2n-again" "$T/train.dfs"
for f in model.safetensors trainer_state.safetensors trainer_state.json; do
    check "same seed, same data: identical $f" cmp "$T/r2n/$f" "$T/r2n-again/$f"
done
check "another seed" $TS $COMMON --total-steps 10 --seed 8 --init "$T/drafter.json" --steps 10 --out "$T/seed8" "$T/train.dfs"
if cmp -s "$T/r2n/model.safetensors" "$T/seed8/model.safetensors"; then fail "another seed gives other weights"; else pass "another seed gives other weights"; fi
# Any thread count, the same checkpoint: wide enough (hidden 128) that the
# products and the other ops run on several threads, where OpenBLAS's own
# split of a product gave other bits at other thread counts.
tiny_target "$T/wide" --layers 4 --hidden 128 --intermediate 384 --seed 4
python3 -c "
import json, random
r = random.Random(6)
for i in range(4):
    print(json.dumps({'id': 'w%d' % i, 'input_ids': [r.randrange(61) for _ in range(r.randrange(300, 400))]}))
" >"$T/wide.jsonl"
check "a wide stream" dflash-extract -m "$T/wide" -l 1,3 -o "$T/wide.dfs" "$T/wide.jsonl"
drafter_config "$T/wide.json" hidden=128 inter=384 head_dim=32 target_layers=4 taps="1, 3" layers=1
for th in 1 3; do
    check "wide drafter on $th thread(s)" dflash-train-step --threads $th --target "$T/wide" --init "$T/wide.json" \
        --anchors 64 --batch-seqs 2 --steps 2 --log /dev/null --out "$T/wide-t$th" "$T/wide.dfs"
done
for f in model.safetensors trainer_state.safetensors trainer_state.json; do
    check "1 or 3 threads: identical $f" cmp "$T/wide-t1/$f" "$T/wide-t3/$f"
done

# ---- stream refusals ------------------------------------------------------------------------
expect_exit 65 "a stream tapping other layers is refused" $TS $COMMON --init "$T/drafter.json" --steps 1 --out "$T/x" "$T/other.dfs"
cp "$T/.err" "$T/err.txt"
check "  ... naming layer_ids and both lists" grep -q 'layer_ids: stream \[1,2,4\] vs drafter target_layer_ids \[1,3,4\]' "$T/err.txt"
tiny_target "$T/target2" --layers 6 --tie no --seed 3
sed -i 's/"rms_norm_eps": [^,]*/"rms_norm_eps": 1e-05/' "$T/target2/config.json"
expect_exit 65 "a stream from another target config is refused" $TS --target "$T/target2" --init "$T/drafter.json" \
    --steps 1 --out "$T/x" "$T/train.dfs"
cp "$T/.err" "$T/err.txt"
check "  ... naming config_digest" grep -q 'config_digest' "$T/err.txt"
expect_exit 65 "--labels target on a stream without target_ids is refused" $TS $COMMON --labels target \
    --init "$T/drafter.json" --steps 1 --out "$T/x" "$T/plain.dfs"
expect_exit 65 "--loss kl on a stream without last_hidden is refused" $TS $COMMON --loss kl \
    --init "$T/drafter.json" --steps 1 --out "$T/x" "$T/plain.dfs"
python3 -c "
import json
for i in range(3):
    print(json.dumps({'id': i, 'input_ids': list(range(1, 21)), 'loss_mask': [i % 2 for i in range(20)]}))" >"$T/sparse.jsonl"
check "extract a stream with no two consecutive supervised tokens" dflash-extract -m "$T/target" -l 1,3,4 \
    -o "$T/sparse.dfs" "$T/sparse.jsonl"
expect_exit 65 "--loop over a stream with no usable record is refused (no endless loop)" $TS $COMMON \
    --init "$T/drafter.json" --steps 5 --out "$T/x" "$T/sparse.dfs"
head -c $(($(stat -c %s "$T/train.dfs") / 2)) "$T/train.dfs" >"$T/trunc.dfs"
expect_exit 65 "a truncated stream is an error, not a short input" $TS $COMMON --init "$T/drafter.json" --steps 50 \
    --out "$T/x" "$T/trunc.dfs"
check "no checkpoint after the refusals" test ! -e "$T/x"
check "--labels target" $TS $COMMON --labels target --init "$T/drafter.json" --steps 3 --out "$T/lt" "$T/train.dfs"
check "--loss kl" $TS $COMMON --loss kl --init "$T/drafter.json" --steps 3 --log "$T/kl.log" --out "$T/kl" "$T/train.dfs"
check "--loss kl: finite, positive loss" python3 -c "
import json, math
L = [json.loads(x) for x in open('$T/kl.log')]
assert len(L) == 3 and all(math.isfinite(s['loss']) and s['loss'] > 0 for s in L)"
check "--noise-std" $TS $COMMON --noise-std 0.5 --init "$T/drafter.json" --steps 2 --out "$T/noise" "$T/train.dfs"
if cmp -s "$T/noise/model.safetensors" "$T/r2n/model.safetensors"; then fail "--noise-std changes the result"; else pass "--noise-std changes the result"; fi

# ---- interrupted runs -----------------------------------------------------------------------
$TS $COMMON --init "$T/drafter.json" --steps 1000000 --out "$T/killed" "$T/train.dfs" 2>/dev/null &
pid=$!
sleep 1
kill -TERM $pid
wait $pid
check "a killed run leaves no checkpoint" test ! -e "$T/killed"
check "  ... and no temporary directory" sh -c "! ls -a '$T' | grep -q '^\.killed\.tmp'"
# (rn is inside its schedule: a --resume at its end is refused before it runs)
cp -r "$T/rn" "$T/keep"
$TS --target "$T/target" --loop --resume "$T/rn" --steps 1000000 --out "$T/keep" "$T/train.dfs" 2>/dev/null &
pid=$!
sleep 1
kill -TERM $pid
wait $pid
rc=$?
[ $rc = 143 ] && pass "a resumed run killed while it runs: 143" || fail "a resumed run killed while it runs: 143" "exit $rc"
check "a killed run leaves the previous checkpoint under its name intact" cmp "$T/rn/model.safetensors" "$T/keep/model.safetensors"

# ---- released checkpoints: --init-from without trainer state ----------------------------------
mkdir -p "$T/released" "$T/released-prefixed"
cp "$T/learn/config.json" "$T/learn/model.safetensors" "$T/released/"
cp "$T/learn/config.json" "$T/released-prefixed/"
# the same weights with "model." before every name (the loaders accept both)
python3 - "$T/learn/model.safetensors" "$T/released-prefixed/model.safetensors" <<'EOF'
import json, struct, sys
src = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", src[:8])[0]
hdr = json.loads(src[8:8 + n])
new = {("model." + k if k != "__metadata__" else k): v for k, v in hdr.items()}
h = json.dumps(new).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(h)) + h + src[8 + n:])
EOF
for r in released released-prefixed; do
    check "--init-from $r --steps 0" $TS --target "$T/target" --init-from "$T/$r" --steps 0 --out "$T/from-$r" "$T/train.dfs"
    check "  ... keeps its weights exactly" cmp "$T/learn/model.safetensors" "$T/from-$r/model.safetensors"
done
check "--init --steps 0 writes the initial drafter without reading any input" sh -c \
    "$TS --target '$T/target' --init '$T/drafter.json' --seed 3 --steps 0 --out '$T/init0' </dev/null"
check "  ... the same weights as with a stream given" sh -c \
    "$TS --target '$T/target' --init '$T/drafter.json' --seed 3 --steps 0 --out '$T/init0s' '$T/train.dfs' &&
     cmp '$T/init0/model.safetensors' '$T/init0s/model.safetensors'"
check "--init-from a released checkpoint trains from step 0" $TS $COMMON --init-from "$T/released" --steps 2 \
    --log "$T/from.log" --out "$T/from" "$T/train.dfs"
check "  ... with a fresh schedule" sh -c "head -1 '$T/from.log' | grep -q '\"step\":1,' && grep -q '\"step\": 2,' '$T/from/trainer_state.json'"
check "  ... and starts where the checkpoint was (loss below a fresh drafter's)" python3 -c "
import json
a = json.loads(open('$T/from.log').readline())['loss']; b = json.loads(open('$T/learn.log').readline())['loss']
assert a < 0.7 * b, (a, b)"

# ---- a tied target: its embedding is also the LM head ------------------------------------------
tiny_target "$T/tied" --layers 6 --tie yes --seed 4
check "tied target: extract" dflash-extract -m "$T/tied" -l 1,3,4 -o "$T/tied.dfs" "$T/data.jsonl"
check "tied target: train" $TS --target "$T/tied" --init "$T/drafter.json" --anchors 12 --steps 2 --out "$T/tied-ck" "$T/tied.dfs"

# ---- pipes, short input, devices ------------------------------------------------------------------
check "dflash-extract | dflash-train-step" sh -c "dflash-extract -m '$T/target' -l 1,3,4 '$T/data.jsonl' | \
    $TS --target '$T/target' --init '$T/drafter.json' --anchors 12 --steps 2 --out '$T/piped'"
check "  ... wrote a checkpoint" test -f "$T/piped/model.safetensors"
check "the input ends first: 3 steps of 4 sequences, exit 0" $TS --target "$T/target" --init "$T/drafter.json" \
    --steps 50 --batch-seqs 4 --out "$T/short" "$T/train.dfs"
cp "$T/.err" "$T/err.txt"
check "  ... says how many steps it made" grep -q "after 3 of 50 steps" "$T/err.txt"
check "  ... and still writes the checkpoint" grep -q '"step": 3,' "$T/short/trainer_state.json"
# --loop opens its input again at the end of each pass, so it needs a regular
# file: a FIFO and a pipe path (a shell's <(...)) are refused before the first
# step, naming the path (the FIFO used to block forever at the end of the first
# pass, the pipe path to fail there as an "empty input", the steps lost). No
# writer opens the FIFO: the refusal must come without opening it.
mkfifo "$T/loop-fifo"
LOOP="$TS --target $T/target --init $T/drafter.json --anchors 12 --batch-seqs 4 --steps 20 --loop"
expect_exit 2 "--loop on a FIFO: refused (2)" timeout 20 $LOOP --log "$T/loop-fifo.log" --out "$T/x" "$T/loop-fifo"
grep -q "loop-fifo: --loop needs a regular file it can re-read" "$T/.err" &&
    pass "  ... naming the FIFO and what --loop needs" || fail "  ... naming the FIFO and what --loop needs" "$(cat "$T/.err")"
expect_exit 2 "--loop on a pipe path <(...): refused (2)" $LOOP --log "$T/loop-pipe.log" --out "$T/x" <(cat "$T/train.dfs")
grep -Eq "/dev/fd/[0-9]+: --loop needs a regular file it can re-read, and this is a pipe" "$T/.err" &&
    pass "  ... naming the pipe path and what --loop needs" || fail "  ... naming the pipe path and what --loop needs" "$(cat "$T/.err")"
check "  ... before any step, with no checkpoint" sh -c "! test -s '$T/loop-fifo.log' && ! test -s '$T/loop-pipe.log' && ! test -e '$T/x'"
expect_exit 69 "--device cuda without CUDA: exit 69" $TS --device cuda --target "$T/target" --init "$T/drafter.json" \
    --steps 1 --out "$T/x" "$T/train.dfs"
expect_exit 2 "--init and --resume together: usage error" $TS --target "$T/target" --init "$T/drafter.json" \
    --resume "$T/learn" --steps 1 --out "$T/x" "$T/train.dfs"
expect_exit 66 "a missing target directory: exit 66" $TS --target "$T/nope" --init "$T/drafter.json" --steps 1 \
    --out "$T/x" "$T/train.dfs"
check "--help" $TS --help

# ---- limits: --threads, the step counts, and the counts a checkpoint stores ---------------------
# --threads 100000 overflowed libgomp's stack (SIGSEGV) and 2^32 + 1 became 1
# in an (int) cast: refused as by dflash-extract and dflash-score
for n in 100000 4294967297 -1; do
    expect_exit 2 "--threads $n: refused (2)" $TS --threads $n --target "$T/target" --init "$T/drafter.json" --steps 1 \
        --out "$T/x" "$T/train.dfs"
    grep -qF -- "--threads must be in [0, 4096]" "$T/.err" && pass "  ... naming the range" ||
        fail "  ... naming the range" "$(cat "$T/.err")"
done
# Step counts are at most 2^53: the resumed step plus --steps 2^63-1 overflowed,
# and so did floor(R * T) and T - W of the schedule for T = 2^63-1.
while IFS='|' read -r args msg; do
    # shellcheck disable=SC2086
    expect_exit 2 "$args: refused (2)" $TS --target "$T/target" $args --out "$T/x" "$T/train.dfs"
    grep -qF -- "$msg" "$T/.err" && pass "  ... $msg" || fail "  ... $msg" "$(cat "$T/.err")"
done <<CASES
--resume $T/rn --steps 9223372036854775807|--steps must be in [0, 2^53]
--init $T/drafter.json --steps 9007199254740993|--steps must be in [0, 2^53]
--init $T/drafter.json --steps 1 --warmup-ratio 1 --total-steps 9223372036854775807|--total-steps must be in [1, 2^53]
CASES
check "  ... and no checkpoint" test ! -e "$T/x"
# 2^53 itself is taken: the input (12 records, 4 a step) ends first, exit 0
check "--steps 2^53 --warmup-ratio 1: runs until the input ends" $TS --target "$T/target" --init "$T/drafter.json" \
    --steps 9007199254740992 --warmup-ratio 1 --log "$T/big.log" --out "$T/big" "$T/train.dfs"
grep -q "after 3 of 9007199254740992 steps" "$T/.err" &&
    python3 -c "import json; s = json.load(open('$T/big/trainer_state.json'))
assert s['step'] == 3 and s['options']['total_steps'] == 2**53, s
L = [json.loads(x) for x in open('$T/big.log')]
assert all(abs(x['lr'] - 6e-4 * i / 2**53) < 1e-7 * x['lr'] for x, i in zip(L, (1, 2, 3))) and len(L) == 3, L" &&
    pass "  ... 3 steps, total_steps 2^53, the warm-up's first rates" || fail "  ... 3 steps, total_steps 2^53" "$(cat "$T/.err")"
# A checkpoint's counts past 2^53 are errors in its trainer_state.json (65),
# naming the field: input.epoch 2^63-1 overflowed at the end of the next
# --loop pass, "step" in step + --steps, options.total_steps in the schedule.
while IFS='|' read -r e msg; do
    rm -rf "$T/ckb" && cp -r "$T/rn" "$T/ckb"
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); exec(sys.argv[2]); json.dump(s, open(sys.argv[1], 'w'))" \
        "$T/ckb/trainer_state.json" "$e"
    expect_exit 65 "resume with $e: 65" $TS --target "$T/target" --loop --resume "$T/ckb" --steps 3 --out "$T/x" \
        "$T/train.dfs"
    grep -qF "dflash-train-step: $T/ckb/trainer_state.json: $msg" "$T/.err" && pass "  ... $msg" ||
        fail "  ... $msg" "$(cat "$T/.err")"
done <<'CASES'
s['input']['epoch'] = 2**63 - 1|input.epoch is not a count in [0, 2^53]
s['input']['records'] = 2**53 + 1|input.records is not a count in [0, 2^53]
s['step'] = 2**63 - 1|"step" is not a count in [0, 2^53]
s['options']['total_steps'] = 2**63 - 1|options.total_steps is 9223372036854775807, must be in [1, 2^53] (or 0, not set yet)
CASES
check "  ... and no checkpoint" test ! -e "$T/x"

# ---- a diverged loss: null in the log, one warning, the run goes on -------------------------------
# A loss that is not finite made json_pack fail: every line from there on was
# "(null)", and nothing said why.
check "--lr 1e308: the run ends, exit 0" $TS --target "$T/target" --init "$T/drafter.json" --anchors 12 --batch-seqs 1 \
    --steps 4 --lr 1e308 --log "$T/nan.log" --out "$T/nan" "$T/train.dfs"
cp "$T/.err" "$T/nan.err"
check "  ... every line JSON, a non-finite loss null, one warning naming its first step" python3 - "$T/nan.log" \
    "$T/nan.err" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
assert "(null)" not in text and "NaN" not in text and "Infinity" not in text, text
L = [json.loads(x) for x in text.splitlines()]
assert [x["step"] for x in L] == [1, 2, 3, 4], text
bad = [x["step"] for x in L if x["loss"] is None]
assert bad and all(isinstance(x["loss"], float) for x in L if x["step"] < bad[0]), text
err = open(sys.argv[2]).read().splitlines()
warn = [x for x in err if "warning" in x]
assert len(warn) == 1 and re.fullmatch(r"dflash-train-step: warning: the loss is (NaN|infinite) at step %d \(logged as "
    r"null\); the training has diverged, perhaps from too high a --lr" % bad[0], warn[0]), err
EOF
check "  ... and the checkpoint is written" test -f "$T/nan/trainer_state.json"

# ---- every logged step: the metrics are mutually consistent ----------------------------
# Per-position accuracies (a null: no row with a loss at that position) lie in
# [0,1]; the overall accuracy, their row-weighted mean, lies between their min
# and max; offline tau = 1 + mean accepted prefix lies in [1, 1 + sum of the
# per-position accuracies] (a block's prefix reaches position k only if k is
# right, and a position's count is at most the number of blocks).
check "every step line of every log: accuracies in [0,1], 1 <= tau <= 1 + sum of them" python3 - \
    "$T/learn.log" "$T/cut-on.log" "$T/cut-off.log" "$T/kl.log" "$T/from.log" <<'EOF'
import json, math, sys
eps, n = 1e-6, 0
for path in sys.argv[1:]:
    lines = open(path).read().splitlines()
    assert lines, path + " is empty"
    for i, line in enumerate(lines):
        s, where = json.loads(line), "%s line %d" % (path, i + 1)
        acc = s["accuracy_per_position"]
        assert len(acc) == 5, (where, acc)
        real = [a for a in acc if a is not None]
        assert real, (where, "no position has a loss", acc)
        for a in real:
            assert isinstance(a, (int, float)) and math.isfinite(a) and -eps <= a <= 1 + eps, (where, acc)
        assert min(real) - eps <= s["accuracy"] <= max(real) + eps, (where, s["accuracy"], acc)
        assert 1 - eps <= s["tau"] <= 1 + sum(real) + eps, (where, "tau", s["tau"], "accuracies", acc)
        n += 1
print("%d step lines checked" % n)
EOF
sed 's/^/    /' "$T/.out"
