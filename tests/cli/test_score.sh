#!/usr/bin/env bash
# dflash-score: output format (TSV columns, JSON lines, appending), anchors,
# several drafters, stdin, and refusals with their exit codes. Fast: a tiny
# target and a random drafter (tests/cli/test_score_e2e.sh trains one).
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget" "$DFLASH_BIN/dflash-extract" "$DFLASH_BIN/dflash-train-step" \
    "$DFLASH_BIN/dflash-score"
SC="dflash-score --threads 1"
# check/expect_exit write $T/.out and $T/.err: keep a command's before checking them
keep() { cp "$T/.out" "$T/out.txt"; cp "$T/.err" "$T/err.txt"; }
tiny_target "$T/target" --layers 6 --tie no --seed 2
python3 - "$T" <<'EOF'
import json, random, sys
r = random.Random(5)
d = sys.argv[1]
with open(f"{d}/data.jsonl", "w") as f:
    for i, (p, n) in enumerate([(4, 20), (7, 9), (3, 1), (5, 30)]):
        ids = [r.randrange(60) for _ in range(p + n)]
        mask = [0] * p + [1] * n
        mask[p + n // 2] = 0  # a hole inside the response
        f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": mask}) + "\n")
with open(f"{d}/prompts.jsonl", "w") as f:
    for i, n in enumerate([1, 5, 12]):
        f.write(json.dumps({"id": f"p{i}", "input_ids": [r.randrange(60) for _ in range(n)]}) + "\n")
EOF
drafter_config "$T/drafter.json"
check "extract the stream" dflash-extract -m "$T/target" -l 1,3,4 -o "$T/val.dfs" "$T/data.jsonl"
check "extract a stream with target ids" dflash-extract -m "$T/target" -l 1,3,4 --with target-ids -o "$T/val-tid.dfs" "$T/data.jsonl"
check "extract a stream tapping other layers" dflash-extract -m "$T/target" -l 1,2,4 -o "$T/other.dfs" "$T/data.jsonl"
check "a random drafter" dflash-train-step --threads 1 --target "$T/target" --init "$T/drafter.json" --steps 0 --out "$T/d1" "$T/val.dfs"
check "another" dflash-train-step --threads 1 --target "$T/target" --init "$T/drafter.json" --steps 0 --seed 9 --out "$T/d2" "$T/val.dfs"

# ---- offline: the columns ------------------------------------------------------------------
check "offline, default anchors" $SC --target "$T/target" --drafter "$T/d1" "$T/val.dfs"
cp "$T/.out" "$T/off.tsv"
check "  header and one row, documented columns, every supervised anchor" python3 - "$T/off.tsv" "$T/data.jsonl" <<'EOF'
import json, sys
lines = open(sys.argv[1]).read().split("\n")
assert lines[-1] == "" and len(lines) == 3, lines
head = lines[0].split("\t")
assert head == ["time", "mode", "drafter", "step", "input", "records", "blocks", "tokens", "tau_macro", "tau_pooled",
                "loss", "accuracy", "accept_k", "accuracy_k", "hist", "block_size", "labels", "gamma", "anchors",
                "seed"], head
row = dict(zip(head, lines[1].split("\t")))
S = [json.loads(x) for x in open(sys.argv[2])]
blocks = sum(sum(1 for a in range(len(s["loss_mask"]) - 1) if s["loss_mask"][a] and s["loss_mask"][a + 1]) for s in S)
assert row["blocks"] == str(blocks), (row["blocks"], blocks)
assert row["records"] == "4" and row["tokens"] == str(sum(len(s["input_ids"]) for s in S))
assert row["mode"] == "offline" and row["step"] == "0" and row["anchors"] == "all" and row["seed"] == ""
assert row["block_size"] == "6" and row["labels"] == "data" and row["gamma"] == "4.000000"
import re
assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["time"]), row["time"]
assert len(row["accept_k"].split(",")) == 5 and len(row["accuracy_k"].split(",")) == 5
hist = [int(x) for x in row["hist"].split(",")]
assert len(hist) == 6 and sum(hist) == blocks
tau = sum((s + 1) * h for s, h in enumerate(hist)) / blocks
assert abs(float(row["tau_pooled"]) - tau) < 1e-6, (row["tau_pooled"], tau)
assert 1.0 <= float(row["tau_macro"]) <= 6.0 and float(row["loss"]) > 0
EOF
check "--json: one object per drafter, same fields" $SC --json --target "$T/target" --drafter "$T/d1" --drafter "$T/d2" "$T/val.dfs"
keep
check "  ... parses" python3 - "$T/out.txt" "$T/off.tsv" <<'EOF'
import json, sys
L = [json.loads(x) for x in open(sys.argv[1])]
assert len(L) == 2 and [x["drafter"].split("/")[-1] for x in L] == ["d1", "d2"]
head = open(sys.argv[2]).readline().rstrip("\n").split("\t")
assert list(L[0]) == head, list(L[0])
assert L[0]["blocks"] == L[1]["blocks"] and isinstance(L[0]["hist"], list) and L[0]["seed"] is None
row = open(sys.argv[2]).read().split("\n")[1].split("\t")
assert "%.6f" % L[0]["tau_pooled"] == row[head.index("tau_pooled")]
EOF
check "--anchors 3 --seed 5: the same anchors for both drafters" $SC --target "$T/target" --anchors 3 --seed 5 \
    --drafter "$T/d1" --drafter "$T/d2" "$T/val.dfs"
cp "$T/.out" "$T/a3.tsv"
check "  ... blocks = sum of min(3, candidates), seed recorded" python3 - "$T/a3.tsv" "$T/data.jsonl" <<'EOF'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
S = [json.loads(x) for x in open(sys.argv[2])]
n = sum(min(3, sum(1 for a in range(len(s["loss_mask"]) - 1) if s["loss_mask"][a] and s["loss_mask"][a + 1])) for s in S)
assert [r["blocks"] for r in rows] == [str(n)] * 2, ([r["blocks"] for r in rows], n)
assert all(r["anchors"] == "3" and r["seed"] == "5" for r in rows)
EOF
check "same seed, same result" bash -c "$SC --target '$T/target' --anchors 3 --seed 5 --drafter '$T/d1' --drafter '$T/d2' \
    '$T/val.dfs' | cut -f2- | cmp - <(cut -f2- '$T/a3.tsv')"
check "stdin, --no-header appends a row" sh -c "cat '$T/off.tsv' >'$T/log.tsv' && $SC --no-header --target '$T/target' \
    --drafter '$T/d1' <'$T/val.dfs' >>'$T/log.tsv'"
check "  ... the log holds a header and two rows of the same fields" python3 - "$T/log.tsv" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
assert len(rows) == 2 and rows[1]["input"] == "-", rows
for k in ("blocks", "tau_pooled", "hist", "accept_k"):
    assert rows[0][k] == rows[1][k], k
EOF
check "--labels target" $SC --target "$T/target" --drafter "$T/d1" --labels target "$T/val-tid.dfs"
check "--micro-rows 40 splits the work, same numbers" bash -c "$SC --target '$T/target' --drafter '$T/d1' --micro-rows 40 \
    '$T/val.dfs' | cut -f6- | cmp - <(cut -f6- '$T/off.tsv')"

# ---- online ------------------------------------------------------------------------------------
check "online: lossless on three prompts" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/prompts.jsonl" \
    --max-new-tokens 9 --emit "$T/emit.jsonl"
cp "$T/.out" "$T/on.tsv"
# A write error on the --emit file names it (ulimit -f: 1 KiB of any file the
# process writes, so stdout goes to /dev/null and stderr through a pipe).
( trap '' XFSZ; ulimit -f 1; $SC --target "$T/target" --drafter "$T/d1" --drafter "$T/d2" --prompts "$T/prompts.jsonl" \
    --max-new-tokens 60 --ignore-eos --emit "$T/big.jsonl" 2>&1 >/dev/null | cat >"$T/big.err"; exit "${PIPESTATUS[0]}" )
rc=$?
[ $rc -eq 74 ] && grep -qx "dflash-score: $T/big.jsonl: write failed: File too large" "$T/big.err" &&
    pass "--emit write error: exit 74, names the file" || fail "--emit write error" "rc $rc: $(cat "$T/big.err")"
[ ! -e "$T/big.jsonl" ] && ! ls -A "$T" | grep -q '^\.big\.jsonl\.' && pass "  ... and leaves nothing" ||
    fail "--emit write error left $(ls -A "$T" | grep big)"
check "  ... columns, emitted lines" python3 - "$T/on.tsv" "$T/emit.jsonl" <<'EOF'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
assert len(rows) == 1 and list(rows[0]) == ["time", "mode", "drafter", "step", "input", "records", "blocks", "tokens",
    "tau_macro", "tau_pooled", "accept_k", "hist", "block_size", "max_new_tokens", "tokens_per_s",
    "greedy_tokens_per_s", "speedup", "mismatches", "temperature", "seed", "top_k", "top_p"], list(rows[0])
r = rows[0]
assert r["mode"] == "online" and r["records"] == "3" and r["mismatches"] == "0" and r["max_new_tokens"] == "9"
E = [json.loads(x) for x in open(sys.argv[2])]
assert [e["id"] for e in E] == ["p0", "p1", "p2"]
assert all(e["output_ids"] == e["greedy_ids"] and len(e["anchors"]) == len(e["acceptance_lengths"]) for e in E)
assert int(r["blocks"]) == sum(len(e["acceptance_lengths"]) for e in E)
assert int(r["tokens"]) == sum(len(e["output_ids"]) for e in E)
assert sum(int(x) for x in r["hist"].split(",")) == int(r["blocks"])
EOF

# A --top-p below the smallest float keeps only the most probable token, as
# any tiny P does: at --temperature 1000 (near uniform) the draws are the
# greedy run's argmax. 1e-50 used to round to 0.0f, "off": a draw from all.
check "online greedy, 20 tokens" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/prompts.jsonl" \
    --max-new-tokens 20 --ignore-eos --emit "$T/argmax.jsonl"
for p in 1e-50 1e-30 1; do
    check "online at T=1000, --top-p $p" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/prompts.jsonl" \
        --max-new-tokens 20 --ignore-eos --temperature 1000 --top-p $p --seed 3 --json --emit "$T/topp-$p.jsonl"
    cp "$T/.out" "$T/topp-$p.json"
done
check "  ... a tiny --top-p draws the argmax, 1e-50 as 1e-30 (not as 1, all tokens); reported as given" python3 - \
    "$T/argmax.jsonl" "$T/topp-1e-50.jsonl" "$T/topp-1e-30.jsonl" "$T/topp-1.jsonl" "$T/topp-1e-50.json" <<'EOF'
import json, sys
greedy, p50, p30, p1 = ({e["id"]: e["output_ids"] for e in map(json.loads, open(f))} for f in sys.argv[1:5])
assert len(greedy) == 3 and all(len(x) == 20 for x in greedy.values()), greedy
assert p50 == greedy, (p50, greedy)
assert p30 == greedy, (p30, greedy)
assert p1 != greedy, "T=1000 drew the argmax from all tokens: the checks above prove nothing"
line = json.load(open(sys.argv[5]))
assert line["top_p"] == 1e-50 and line["mismatches"] == 0, line
EOF

# The defaults --help shows (written in the option table by hand; the real
# ones are set in check_options) are the ones a run without the options
# records: offline labels, anchors, gamma (block 6), seed; online
# max-new-tokens, temperature, top-k, top-p (--ignore-eos: every response
# is max-new-tokens long).
check "online with the default options" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/prompts.jsonl" --ignore-eos
cp "$T/.out" "$T/on-default.tsv"
check "  ... the defaults of --help are those the runs record" python3 - "$T/off.tsv" "$T/on-default.tsv" <<'EOF'
import csv, re, subprocess, sys
help = subprocess.run(["dflash-score", "--help"], capture_output=True, text=True, check=True).stdout
text = re.sub(r"\n {20,}", " ", help)
default = {m.group(1): m.group(2) for m in re.finditer(r"^ +(?:-\w, )?--([a-z-]+)[^\n]*\(default: ([^\n]*)\)$", text, re.M)}
off = next(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
on = next(csv.DictReader(open(sys.argv[2]), delimiter="\t"))
assert off["labels"] == default["labels"], (off["labels"], default["labels"])
assert default["anchors"] == "0" and off["anchors"] == "all" and off["seed"] == "", off
assert default["gamma"] == "7 for B >= 16, 5 for B >= 10, else 4" and float(off["gamma"]) == 4, off["gamma"]
assert on["max_new_tokens"] == default["max-new-tokens"], (on["max_new_tokens"], default["max-new-tokens"])
assert int(on["tokens"]) == 3 * int(default["max-new-tokens"]), on["tokens"]
assert float(on["temperature"]) == float(default["temperature"]) == 0 and on["seed"] == "", on
assert default["top-k"] == default["top-p"] == "off" and on["top_k"] == on["top_p"] == "", on
EOF

# ---- refusals ----------------------------------------------------------------------------------
expect_exit 65 "a stream tapping other layers" $SC --target "$T/target" --drafter "$T/d1" "$T/other.dfs"
keep
check "  ... names layer_ids and both lists" grep -q 'layer_ids: stream \[1,2,4\] vs drafter target_layer_ids \[1,3,4\]' "$T/err.txt"
mkdir -p "$T/wide"
cp "$T/d1/model.safetensors" "$T/wide/"
sed 's/"hidden_size": 32/"hidden_size": 24/' "$T/d1/config.json" >"$T/wide/config.json"
expect_exit 65 "a drafter whose hidden size differs from the target's" $SC --target "$T/target" --drafter "$T/wide" "$T/val.dfs"
keep
check "  ... says so" grep -q "target hidden_size 32 differs from the drafter's hidden_size 24" "$T/err.txt"
expect_exit 65 "  ... online too" $SC --target "$T/target" --drafter "$T/wide" --prompts "$T/prompts.jsonl"
mkdir -p "$T/deep"
cp "$T/d1/model.safetensors" "$T/deep/"
sed 's/"num_target_layers": 6/"num_target_layers": 8/; s/\[1, *3, *4\]/[1, 3, 7]/' "$T/d1/config.json" >"$T/deep/config.json"
expect_exit 65 "a drafter tapping layer 7 of an 8-layer target, on this 6-layer one" $SC --target "$T/target" \
    --drafter "$T/deep" --prompts "$T/prompts.jsonl"
keep
check "  ... says so" grep -q "num_hidden_layers 6 differs from the drafter's num_target_layers 8" "$T/err.txt"
expect_exit 66 "a missing target directory" $SC --target "$T/nope" --drafter "$T/d1" "$T/val.dfs"
expect_exit 66 "a missing drafter" $SC --target "$T/target" --drafter "$T/nope" "$T/val.dfs"
# A FIFO in place of a checkpoint's file is refused, not opened (a plain
# open waits for a writer forever); timeout ends a hang as exit 124.
for f in model.safetensors config.json; do
    rm -rf "$T/fifo-drafter"
    cp -r "$T/d1" "$T/fifo-drafter"
    rm "$T/fifo-drafter/$f"
    mkfifo "$T/fifo-drafter/$f"
    expect_exit 66 "a FIFO as the drafter's $f: exit 66, no hang" timeout 60 $SC --target "$T/target" --drafter "$T/fifo-drafter" "$T/val.dfs"
    keep
    check "  ... named" grep -q "fifo-drafter/$f: is a pipe or FIFO, not a regular file" "$T/err.txt"
done
printf '{"id": "a", "input_ids": [1, 2]}\n{"id": "b", "input_ids": [1, 2\n' >"$T/bad.jsonl"
expect_exit 65 "a malformed prompt file" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/bad.jsonl"
keep
check "  ... names the line" grep -q "bad.jsonl:2:" "$T/err.txt"
printf '{"id": "a", "input_ids": [1, 61]}\n' >"$T/oov.jsonl"
expect_exit 65 "a prompt token outside the vocabulary" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/oov.jsonl"
keep
check "  ... names line and field" grep -q "oov.jsonl:1: input_ids\[1\]" "$T/err.txt"
head -c $(($(stat -c %s "$T/val.dfs") * 2 / 3)) "$T/val.dfs" >"$T/trunc.dfs"
expect_exit 65 "a truncated stream" $SC --target "$T/target" --drafter "$T/d1" "$T/trunc.dfs"
keep
check "  ... prints no result line" test ! -s "$T/out.txt"
expect_exit 65 "--labels target on a stream without target_ids" $SC --target "$T/target" --drafter "$T/d1" --labels target "$T/val.dfs"
printf '{"id": "s0", "anchors": [4, 5]}\n{"id": "zz", "anchors": [1]}\n' >"$T/from.jsonl"
expect_exit 65 "--anchors-from with an id the stream lacks" $SC --target "$T/target" --drafter "$T/d1" --anchors-from "$T/from.jsonl" "$T/val.dfs"
printf '{"id": "s0", "anchors": [4, 99]}\n' >"$T/from.jsonl"
expect_exit 65 "--anchors-from with an anchor past the record" $SC --target "$T/target" --drafter "$T/d1" --anchors-from "$T/from.jsonl" "$T/val.dfs"
# Anchors that do not increase are a fault of the anchors file: named by its
# file and line when it is loaded, not against a record of the stream.
printf '{"id": "s1", "anchors": [1]}\n{"id": "s0", "anchors": [4, 4]}\n' >"$T/from.jsonl"
expect_exit 65 "--anchors-from with anchors that do not increase" $SC --target "$T/target" --drafter "$T/d1" --anchors-from "$T/from.jsonl" "$T/val.dfs"
grep -qx "dflash-score: $T/from.jsonl:2: anchors must increase (anchors\[1\] is 4, after 4)" "$T/.err" &&
    pass "  ... named by the anchors file and line" || fail "anchors order message" "$(cat "$T/.err")"
printf '{"id": "s0", "anchors": [4, 5, 9]}\n' >"$T/from.jsonl"
check "--anchors-from: exactly those blocks" $SC --target "$T/target" --drafter "$T/d1" --anchors-from "$T/from.jsonl" "$T/val.dfs"
keep
check "  ... 3 blocks, anchors 'file'" python3 -c "
import csv; r = list(csv.DictReader(open('$T/out.txt'), delimiter='\t'))[0]
assert r['blocks'] == '3' and r['anchors'] == 'file' and r['records'] == '4', r"
expect_exit 69 "--device cuda without CUDA" $SC --device cuda --target "$T/target" --drafter "$T/d1" "$T/val.dfs"
expect_exit 2 "no --drafter" $SC --target "$T/target" "$T/val.dfs"
expect_exit 2 "--anchors with --prompts" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/prompts.jsonl" --anchors 3
expect_exit 2 "--emit without --prompts" $SC --target "$T/target" --drafter "$T/d1" --emit "$T/x.jsonl" "$T/val.dfs"
check "--help" $SC --help
keep
check "  ... lists the options" grep -q -- "--anchors-from" "$T/out.txt"

# ---- a drafter trained against another target config.json: scored, with a warning ------------
mkdir -p "$T/target2"
cp "$T/target/"* "$T/target2/"
printf '\n' >>"$T/target2/config.json" # the same model, other bytes: another digest
check "online against the drafter's own target" $SC --target "$T/target" --drafter "$T/d1" --prompts "$T/prompts.jsonl" \
    --max-new-tokens 4
keep
check "  ... no warning" sh -c "! grep -q warning '$T/err.txt'"
check "online against a target with another config.json" $SC --target "$T/target2" --drafter "$T/d1" \
    --prompts "$T/prompts.jsonl" --max-new-tokens 4
keep
check "  ... a warning naming the drafter and both digests" python3 - "$T/err.txt" "$T/d1" "$T/target/config.json" \
    "$T/target2/config.json" <<'EOF'
import json, sys
err, d1, c1, c2 = sys.argv[1:]
text = open(err).read()
dig = json.load(open(d1 + "/trainer_state.json"))["target"]["config_digest"]
assert "warning" in text and d1 in text and dig in text and c2 in text, text
assert text.count("\n") == 1, text
EOF
check "  ... and the result line" test -s "$T/out.txt"
