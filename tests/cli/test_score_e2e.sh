#!/usr/bin/env bash
# slow
# dflash-score end to end on a tiny random target (mktarget): a drafter
# trained briefly (dflash-train-step) on the target's own greedy output and
# a random one; the online loop must reproduce greedy decoding exactly, and
# offline scoring at the anchors the loop visited (--anchors-from) must give
# the same acceptance, cycle for cycle.
# E2E_TARGET: extra mktarget options for the target (test_score_e2e_qwen35.sh
# runs all of this on a Qwen3.5 hybrid).
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget" "$DFLASH_BIN/dflash-extract" "$DFLASH_BIN/dflash-train-step" \
    "$DFLASH_BIN/dflash-score"
SC="dflash-score --threads 1"
B=6
# shellcheck disable=SC2086 # E2E_TARGET is a list of options
tiny_target "$T/target" --layers 6 --tie no --seed 2 ${E2E_TARGET:-}
drafter_config "$T/drafter.json"
# prompts: 16 to train on, 6 to test on (lengths 1 .. 23)
python3 - "$T" <<'EOF'
import json, random, sys
r = random.Random(7)
d = sys.argv[1]
for name, n, lens in (("train", 16, None), ("test", 6, [1, 3, 6, 11, 17, 23])):
    with open(f"{d}/{name}.jsonl", "w") as f:
        for i in range(n):
            L = lens[i] if lens else r.randrange(2, 12)
            f.write(json.dumps({"id": f"{name}{i}", "input_ids": [r.randrange(60) for _ in range(L)]}) + "\n")
EOF

# a random drafter: --steps 0 writes the initial weights
check "extract a one-sample stream" sh -c "head -1 '$T/train.jsonl' | dflash-extract -m '$T/target' -l 1,3,4 -o '$T/one.dfs'"
check "random drafter" dflash-train-step --threads 1 --target "$T/target" --init "$T/drafter.json" --steps 0 --seed 3 \
    --out "$T/rand" "$T/one.dfs"

# the target's own greedy continuations of the training prompts -> a training stream
# (the test prompts too: a drafter that has seen them drafts them well, which is
# what the lossless check needs - long accepted runs, not generalisation)
cat "$T/train.jsonl" "$T/test.jsonl" >"$T/all.jsonl"
check "greedy output of the training prompts" $SC --target "$T/target" --drafter "$T/rand" --prompts "$T/all.jsonl" \
    --max-new-tokens 40 --ignore-eos --emit "$T/train-emit.jsonl"
# prompt + greedy output (+B more tokens for later offline slots), loss on the response
to_samples() { # EMIT PROMPTS OUT
    python3 - "$@" <<'EOF'
import json, sys
prompts = {}
for line in open(sys.argv[2]):
    p = json.loads(line)
    prompts[p["id"]] = p["input_ids"]
with open(sys.argv[3], "w") as f:
    for line in open(sys.argv[1]):
        e = json.loads(line)
        p = prompts[e["id"]]
        assert len(p) == e["prompt_tokens"]
        ids = p + e["greedy_ids"]
        f.write(json.dumps({"id": e["id"], "input_ids": ids, "loss_mask": [0] * len(p) + [1] * len(e["greedy_ids"])}) + "\n")
EOF
}
check "training samples" to_samples "$T/train-emit.jsonl" "$T/all.jsonl" "$T/train-samples.jsonl"
check "extract the training stream" dflash-extract -m "$T/target" -l 1,3,4 -o "$T/train.dfs" "$T/train-samples.jsonl"
check "train a drafter briefly" dflash-train-step --threads 1 --target "$T/target" --init "$T/drafter.json" --steps 300 \
    --lr 1e-2 --anchors 16 --batch-seqs 4 --loop --seed 1 --out "$T/good" "$T/train.dfs"

# ---- lossless: speculative output == greedy output, both drafters, with and without eos ----
col() { # FILE COLUMN [ROW]: a TSV column by name (row 1 = the first data row)
    awk -F'\t' -v c="$2" -v r="${3:-1}" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i } NR == r + 1 { print $k }' "$1"
}
for dr in rand good; do
    check "online, $dr drafter, ignore eos" $SC --target "$T/target" --drafter "$T/$dr" --prompts "$T/test.jsonl" \
        --max-new-tokens 30 --ignore-eos --emit "$T/on-$dr.jsonl"
    cp "$T/.out" "$T/on-$dr.tsv"
    check "online, $dr drafter, stopping at eos" $SC --target "$T/target" --drafter "$T/$dr" --prompts "$T/test.jsonl" \
        --max-new-tokens 30 --emit "$T/eos-$dr.jsonl"
    cp "$T/.out" "$T/eos-$dr.tsv"
    check "  $dr: lossless, token for token, on every prompt (both runs)" python3 - "$T/on-$dr.jsonl" "$T/eos-$dr.jsonl" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    L = [json.loads(x) for x in open(path)]
    assert len(L) == 6, len(L)
    for e in L:
        assert e["output_ids"] == e["greedy_ids"], (path, e["id"])
        # the anchors advance by each cycle's length from the prompt's end
        pos = e["prompt_tokens"]
        for a, n in zip(e["anchors"], e["acceptance_lengths"]):
            assert a == pos and 1 <= n <= 6
            pos += n
    if "on-" in path:
        assert all(len(e["greedy_ids"]) == 30 for e in L)
EOF
    check "  $dr: the TSV says 0 mismatches" test "$(col "$T/on-$dr.tsv" mismatches)" = 0
done
check "the eos runs stop at an eos (id 2) or the limit" python3 - "$T/eos-good.jsonl" <<'EOF'
import json, sys
L = [json.loads(x) for x in open(sys.argv[1])]
for e in L:
    g = e["greedy_ids"]
    assert len(g) == 30 or (g[-1] == 2 and 2 not in g[:-1]), g
print(sum(len(e["greedy_ids"]) < 30 for e in L), "of", len(L), "stopped at eos")
EOF
sed 's/^/    /' "$T/.out"
check "the trained drafter drafts better than the random one" python3 - "$(col "$T/on-good.tsv" tau_macro)" \
    "$(col "$T/on-rand.tsv" tau_macro)" <<'EOF'
import sys
good, rand = float(sys.argv[1]), float(sys.argv[2])
print("online tau_macro: trained %.3f, random %.3f" % (good, rand))
assert good > rand + 1.0 and good > 2.2, (good, rand)
EOF
sed 's/^/    /' "$T/.out"

# ---- sampling at a temperature (--temperature, --seed) -----------------------------------------
# The target's tokens are drawn (Gumbel-max, keyed by seed, prompt and
# position); the draft stays greedy. Plain decoding makes the same draws, so
# the loop must still equal it token for token; the draws must depend on the
# seed and not on the threads; and at T = 1 this 60-token random target must
# leave its greedy path.
check "online at T=1, both drafters in one run" $SC --target "$T/target" --drafter "$T/good" --drafter "$T/rand" \
    --prompts "$T/test.jsonl" --max-new-tokens 30 --ignore-eos --temperature 1 --seed 11 --emit "$T/t1.jsonl"
cp "$T/.out" "$T/t1.tsv"
check "  the TSV says 0 mismatches for both, temperature 1 and seed 11" \
    test "$(col "$T/t1.tsv" mismatches 1)/$(col "$T/t1.tsv" mismatches 2)/$(col "$T/t1.tsv" temperature)/$(col "$T/t1.tsv" seed)" = "0/0/1.000000/11"
check "online at T=1 again, 2 threads" dflash-score --threads 2 --target "$T/target" --drafter "$T/good" \
    --prompts "$T/test.jsonl" --max-new-tokens 30 --ignore-eos --temperature 1 --seed 11 --emit "$T/t1b.jsonl"
check "online at T=1, seed 12" $SC --target "$T/target" --drafter "$T/good" --prompts "$T/test.jsonl" \
    --max-new-tokens 30 --ignore-eos --temperature 1 --seed 12 --emit "$T/t1c.jsonl"
awk 'NR % 2 == 1' "$T/test.jsonl" | tac >"$T/shard.jsonl" # prompts 4, 2, 0: a shard, reordered
check "online at T=1, seed 11, a reordered shard of the prompts" $SC --target "$T/target" --drafter "$T/good" \
    --prompts "$T/shard.jsonl" --max-new-tokens 30 --ignore-eos --temperature 1 --seed 11 --emit "$T/t1d.jsonl"
check "  lossless per prompt, same draws for every drafter, thread count and shard, new draws for a new seed" \
    python3 - "$T/t1.jsonl" "$T/t1b.jsonl" "$T/t1c.jsonl" "$T/on-good.jsonl" "$T/t1d.jsonl" <<'EOF'
import json, sys
t1, t1b, t1c, greedy, t1d = ([json.loads(x) for x in open(p)] for p in sys.argv[1:])
assert len(t1) == 12 and len(t1b) == 6 and len(t1c) == 6 and len(t1d) == 3
for e in t1:
    assert e["output_ids"] == e["greedy_ids"] and len(e["output_ids"]) == 30, e["id"]
by = {}
for e in t1:
    by.setdefault(e["id"], []).append(e["output_ids"])
assert all(a == b for a, b in by.values()), "two drafters met different draws"
assert [e["output_ids"] for e in t1b] == [by[e["id"]][0] for e in t1b], "the draws depend on the threads"
assert [e["id"] for e in t1d] == ["test4", "test2", "test0"], [e["id"] for e in t1d]
assert [e["output_ids"] for e in t1d] == [by[e["id"]][0] for e in t1d], "the draws depend on the prompt's place"
g = {e["id"]: e["greedy_ids"] for e in greedy}
off_greedy = sum(by[i][0] != g[i] for i in g)
new_seed = sum(e["output_ids"] != by[e["id"]][0] for e in t1c)
print("T=1 leaves the greedy path on %d of 6 prompts; seed 12 draws differently on %d of 6" % (off_greedy, new_seed))
assert off_greedy >= 4 and new_seed >= 4, (off_greedy, new_seed)
EOF
sed 's/^/    /' "$T/.out"
echo "    online tau_macro at T=1: trained $(col "$T/t1.tsv" tau_macro 1), random $(col "$T/t1.tsv" tau_macro 2)"
# Qwen's recommended sampling (T 0.6, top-k 20, top-p 0.95): still lossless
check "online at T=0.6, top-k 20, top-p 0.95, both drafters" $SC --target "$T/target" --drafter "$T/good" \
    --drafter "$T/rand" --prompts "$T/test.jsonl" --max-new-tokens 30 --ignore-eos --temperature 0.6 --top-k 20 \
    --top-p 0.95 --seed 11 --emit "$T/tkp.jsonl"
cp "$T/.out" "$T/tkp.tsv"
check "  0 mismatches for both, top_k 20 and top_p 0.95 in the line" \
    test "$(col "$T/tkp.tsv" mismatches 1)/$(col "$T/tkp.tsv" mismatches 2)/$(col "$T/tkp.tsv" top_k)/$(col "$T/tkp.tsv" top_p)" = "0/0/20/0.950000"
check "  lossless per prompt; the filters change the draws of T=0.6 alone" $SC --target "$T/target" \
    --drafter "$T/good" --prompts "$T/test.jsonl" --max-new-tokens 30 --ignore-eos --temperature 0.6 --seed 11 \
    --emit "$T/t06.jsonl"
check "  ... compared" python3 - "$T/tkp.jsonl" "$T/t06.jsonl" <<'EOF'
import json, sys
tkp, t06 = ([json.loads(x) for x in open(p)] for p in sys.argv[1:])
assert all(e["output_ids"] == e["greedy_ids"] for e in tkp)
plain = {e["id"]: e["output_ids"] for e in t06}
changed = sum(e["output_ids"] != plain[e["id"]] for e in tkp if "good" in e["drafter"])
print("top-k 20 / top-p 0.95 change the T=0.6 draws on %d of 6 prompts" % changed)
assert changed >= 3, changed
EOF
sed 's/^/    /' "$T/.out"
expect_exit 2 "--top-k without --temperature is a usage error" $SC --target "$T/target" --drafter "$T/good" \
    --prompts "$T/test.jsonl" --top-k 20
expect_exit 2 "--top-p 0 is a usage error" $SC --target "$T/target" --drafter "$T/good" --prompts "$T/test.jsonl" \
    --temperature 1 --top-p 0
expect_exit 2 "--temperature offline is a usage error" $SC --target "$T/target" --drafter "$T/good" --temperature 1 \
    "$T/train.dfs"
expect_exit 2 "--temperature -1 is a usage error" $SC --target "$T/target" --drafter "$T/good" --prompts \
    "$T/test.jsonl" --temperature -1
expect_exit 2 "--temperature 1e-4 (below 0.001) is a usage error" $SC --target "$T/target" --drafter "$T/good" \
    --prompts "$T/test.jsonl" --temperature 1e-4

# ---- offline == online at the anchors the loop visited ---------------------------------------
# The stream holds prompt + the greedy continuation, B tokens longer than the
# online run, so every slot the loop verified is a valid offline slot.
check "greedy continuations B tokens longer" $SC --target "$T/target" --drafter "$T/rand" --prompts "$T/test.jsonl" \
    --max-new-tokens $((30 + B)) --ignore-eos --emit "$T/long-emit.jsonl"
check "test samples" to_samples "$T/long-emit.jsonl" "$T/test.jsonl" "$T/test-samples.jsonl"
check "extract the test stream" dflash-extract -m "$T/target" -l 1,3,4 --with target-ids -o "$T/test.dfs" "$T/test-samples.jsonl"
for dr in rand good; do
    check "offline at the online anchors, $dr" $SC --target "$T/target" --drafter "$T/$dr" --anchors-from "$T/on-$dr.jsonl" \
        "$T/test.dfs"
    cp "$T/.out" "$T/off-$dr.tsv"
    for c in blocks tau_macro tau_pooled hist accept_k; do
        check "  $dr: offline $c == online $c ($(col "$T/on-$dr.tsv" $c))" test "$(col "$T/off-$dr.tsv" $c)" = "$(col "$T/on-$dr.tsv" $c)"
    done
done
check "  ... and --labels target gives the same (the stream is greedy output)" $SC --target "$T/target" --drafter "$T/good" \
    --labels target --anchors-from "$T/on-good.jsonl" "$T/test.dfs"
check "  ... same tau" test "$(col "$T/.out" tau_pooled)" = "$(col "$T/on-good.tsv" tau_pooled)"

# ---- several drafters side by side; released checkpoints -------------------------------------
mkdir -p "$T/released"
cp "$T/good/config.json" "$T/good/model.safetensors" "$T/released/"
check "offline, three drafters, every supervised anchor" $SC --target "$T/target" --drafter "$T/rand" --drafter "$T/good" \
    --drafter "$T/released" "$T/test.dfs"
cp "$T/.out" "$T/three.tsv"
check "  three rows after the header, the same blocks" python3 - "$T/three.tsv" "$T/test-samples.jsonl" <<'EOF'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
assert len(rows) == 3, rows
# every supervised anchor: a with loss_mask[a] = loss_mask[a+1] = 1
n = 0
for line in open(sys.argv[2]):
    m = json.loads(line)["loss_mask"]
    n += sum(1 for a in range(len(m) - 1) if m[a] and m[a + 1])
assert all(int(r["blocks"]) == n for r in rows), (n, [r["blocks"] for r in rows])
assert rows[0]["step"] == "0" and rows[1]["step"] == "300" and rows[2]["step"] == "", [r["step"] for r in rows]
assert rows[1]["tau_pooled"] == rows[2]["tau_pooled"] and rows[1]["hist"] == rows[2]["hist"], "released != ours"
assert float(rows[1]["tau_pooled"]) > float(rows[0]["tau_pooled"])
assert all(r["records"] == "6" and r["mode"] == "offline" and r["anchors"] == "all" for r in rows)
EOF

# ---- the CUDA backend, through the emulated kernels (tests/emu) ------------------------------
# The same code on the CUDA op table (bf16 activations): the loop must stay
# lossless against the CUDA target's own greedy decoding; against the CPU
# (f32) it differs by bf16 roundings only: tau and loss close.
E=$DFLASH_BUILD/emu/bin/dflash-score
if [ -x "$E" ]; then
    head -3 "$T/test.jsonl" >"$T/t3.jsonl"
    check "cuda (emulated): online, trained drafter" "$E" --device cuda --threads 1 --target "$T/target" \
        --drafter "$T/good" --prompts "$T/t3.jsonl" --max-new-tokens 16 --ignore-eos --emit "$T/emu-on.jsonl"
    cp "$T/.out" "$T/emu-on.tsv"
    check "  lossless on the CUDA table (0 mismatches)" test "$(col "$T/emu-on.tsv" mismatches)" = 0
    check "cuda (emulated): online at T=1, top-k 20, top-p 0.9" "$E" --device cuda --threads 1 --target "$T/target" \
        --drafter "$T/good" --prompts "$T/t3.jsonl" --max-new-tokens 16 --ignore-eos --temperature 1 --top-k 20 \
        --top-p 0.9 --seed 11
    check "  lossless at T=1 on the CUDA table (0 mismatches)" test "$(col "$T/.out" mismatches)" = 0
    check "cpu: online, the same prompts and length" $SC --target "$T/target" --drafter "$T/good" \
        --prompts "$T/t3.jsonl" --max-new-tokens 16 --ignore-eos --emit "$T/cpu16-on.jsonl"
    # Where the greedy outputs agree, the drafter saw the same contexts on
    # both: its acceptance must agree too (bf16 may flip a near-tie block).
    # Where they differ (a near-tie of the target's logits turned by bf16
    # activations: not a limit), the responses go separate ways.
    check "  tau within 0.5 of the CPU's where the greedy outputs agree" python3 - "$T/emu-on.jsonl" \
        "$T/cpu16-on.jsonl" <<'PY'
import json, sys
a = {e["id"]: e for e in map(json.loads, open(sys.argv[1]))}
b = {e["id"]: e for e in map(json.loads, open(sys.argv[2]))}
tau = lambda e: sum(e["acceptance_lengths"]) / len(e["acceptance_lengths"])
same = [k for k in a if a[k]["greedy_ids"] == b[k]["greedy_ids"]]
print("greedy outputs equal on %d of %d prompts; tau there: cuda %s, cpu %s" %
      (len(same), len(a), [round(tau(a[k]), 3) for k in same], [round(tau(b[k]), 3) for k in same]))
assert same and abs(sum(tau(a[k]) for k in same) - sum(tau(b[k]) for k in same)) / len(same) < 0.5
PY
    sed 's/^/    /' "$T/.out"
    check "cuda (emulated): offline" "$E" --device cuda --threads 1 --target "$T/target" --drafter "$T/good" \
        --anchors 4 --seed 2 "$T/test.dfs"
    cp "$T/.out" "$T/emu-off.tsv"
    check "cpu: offline, same anchors" $SC --target "$T/target" --drafter "$T/good" --anchors 4 --seed 2 "$T/test.dfs"
    cp "$T/.out" "$T/cpu-off.tsv"
    check "  same blocks, tau within one block's flip, loss within 2 %" python3 - "$T/emu-off.tsv" "$T/cpu-off.tsv" <<'PY'
import csv, sys
g, c = (list(csv.DictReader(open(p), delimiter="\t"))[0] for p in sys.argv[1:])
print("tau_pooled cuda %s cpu %s, loss cuda %s cpu %s" % (g["tau_pooled"], c["tau_pooled"], g["loss"], c["loss"]))
assert g["blocks"] == c["blocks"]
# bf16 against f32 may turn a near-tie argmax, which moves one block's
# accepted length by up to B-1 = 5: tau may differ by that over the blocks,
# no more. A systematic error (mask, labels) moves many blocks and the loss.
assert abs(float(g["tau_pooled"]) - float(c["tau_pooled"])) <= 5.0 / int(g["blocks"]) + 1e-9
assert abs(float(g["loss"]) / float(c["loss"]) - 1) < 0.02
PY
    sed 's/^/    /' "$T/.out"
else
    echo "no emulated CUDA build in $DFLASH_BUILD: the CUDA-table checks are skipped"
fi
