#!/usr/bin/env bash
# dflash-extract against the Hugging Face fixtures (tests/reference/make_targets.py):
# every layer of every fixture model, the off-by-one that must fail, default
# and drafter-config layer ids, packing, encodings, stdin/stdout, bad input
# with and without --skip-bad, broken models, exit codes.
. "$(dirname "$0")/lib.sh"

TG=$FIX/targets
CMP=$DFLASH_BUILD/tests/hs_compare
MKT=$DFLASH_BUILD/tests/mktarget

ids_upto() { seq -s, 0 $(($1 - 1)); }
nlayers() { sed -n 's/.*"num_hidden_layers": *\([0-9]*\).*/\1/p' "$TG/$1/config.json"; }

# Every layer of every model, with target ids and the pre-norm last state.
for m in qwen3-tied qwen3-untied llama3 qwen3-yarn qwen2 mistral qwen3-swa mistral-swa qwen3-moe-swa qwen3-sharded qwen35 qwen35-vlm qwen35-yarn gpt-oss gpt-oss-mxfp4 qwen3-next; do
    L=$(nlayers $m)
    all=$(ids_upto "$L")
    check "$m: extract all layers" dflash-extract --model "$TG/$m" --layers "$all" --with target-ids \
        --with last-hidden -o "$T/$m.dfs" "$TG/$m/reference/inputs.jsonl"
    check "$m: every layer, target ids and last hidden match HF" "$CMP" --expect-layers "$all" "$TG/$m/reference" "$T/$m.dfs"
    cp "$T/.out" "$T/$m.cmp"
    # The off-by-one (HF hidden_states[k] for id k) must fail the threshold.
    expect_exit 1 "$m: off-by-one tap fails the comparison" "$CMP" --shift -1 "$TG/$m/reference" "$T/$m.dfs"
    expect_exit 1 "$m: one-too-deep tap fails the comparison" "$CMP" --shift 1 "$TG/$m/reference" "$T/$m.dfs"
done
sed 's/^/    /' "$T/qwen3-tied.cmp"

# Requested order is kept; a repeated id is refused (a stream stores each layer once).
check "order kept: extract 5,0,3" dflash-extract -m "$TG/qwen3-tied" -l 5,0,3 -o "$T/order.dfs" "$TG/qwen3-tied/reference/inputs.jsonl"
check "order kept: compare" "$CMP" --expect-layers 5,0,3 "$TG/qwen3-tied/reference" "$T/order.dfs"
expect_exit 2 "repeated layer id: exit 2" dflash-extract -m "$TG/qwen3-tied" -l 1,3,1 -o "$T/x.dfs" "$TG/qwen3-tied/reference/inputs.jsonl"

# Default ids: the reference rule for 5 draft layers with Python's round
# (half to even), computed here by Python as the oracle; read back from the
# stream header. 10 layers: 1,2.5,4,5.5,7 -> 1,2,4,6,7 (lround would say 1,3,4,6,7).
default_ids() { python3 -c "L=$1; print(','.join(str(int(round(1 + i*((L-3)-1)/4))) for i in range(5)))"; }
header_ids() { dflash-pack --inspect "$1" | head -1 | python3 -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['meta']['layer_ids'])))"; }
printf '{"id":"a","input_ids":[1,2,3,4,5,6,7]}\n{"id":"b","input_ids":[49,0]}\n' >"$T/small.jsonl"
for L in 10 28 36; do
    "$MKT" --hidden 16 --heads 2 --kv-heads 1 --intermediate 24 --vocab 50 --layers $L -o "$T/m$L" >/dev/null
    want=$(default_ids $L)
    check "$L layers: default layer ids" dflash-extract -m "$T/m$L" -o "$T/def$L.dfs" "$T/small.jsonl"
    got=$(header_ids "$T/def$L.dfs")
    if [ "$got" = "$want" ]; then pass "$L layers: default ids $got = Python's"; else fail "$L layers: default ids" "got $got, Python says $want"; fi
done
expect_exit 2 "6 layers: the reference rule repeats ids, refused" dflash-extract -m "$TG/qwen3-tied" -o "$T/x.dfs" "$T/small.jsonl"
if grep -q '1,2,2,2,3' "$T/.err"; then pass "6 layers: message shows the rule's ids"; else fail "6 layers: message shows the rule's ids" "$(cat "$T/.err")"; fi

# Layer ids from a drafter config.
printf '{"architectures":["DFlashDraftModel"],"num_target_layers":6,"num_hidden_layers":3,"dflash_config":{"mask_token_id":7,"target_layer_ids":[4,1,2]}}\n' >"$T/drafter.json"
check "drafter config: extract" dflash-extract -m "$TG/qwen3-tied" --drafter-config "$T/drafter.json" -o "$T/dr.dfs" "$TG/qwen3-tied/reference/inputs.jsonl"
check "drafter config: ids 4,1,2" "$CMP" --expect-layers 4,1,2 "$TG/qwen3-tied/reference" "$T/dr.dfs"
printf '{"num_target_layers":36,"dflash_config":{"target_layer_ids":[1,9]}}\n' >"$T/drafter36.json"
expect_exit 65 "drafter config for another target depth is refused" dflash-extract -m "$TG/qwen3-tied" --drafter-config "$T/drafter36.json" -o "$T/x.dfs" "$TG/qwen3-tied/reference/inputs.jsonl"
expect_exit 2 "--layers with --drafter-config is a usage error" dflash-extract -m "$TG/qwen3-tied" -l 1 --drafter-config "$T/drafter.json" -o "$T/x.dfs" "$TG/qwen3-tied/reference/inputs.jsonl"

# Packing: one sample per forward and everything in one forward both match HF.
for bt in 1 100000; do
    check "--batch-tokens $bt: extract" dflash-extract -m "$TG/llama3" -l 0,2,4 --with target-ids -b $bt -o "$T/b$bt.dfs" "$TG/llama3/reference/inputs.jsonl"
    check "--batch-tokens $bt: matches HF" "$CMP" "$TG/llama3/reference" "$T/b$bt.dfs"
done

# stdin to stdout; compressed and byte-shuffled outputs read back the same.
check "stdin to stdout" sh -c "cat '$TG/qwen3-untied/reference/inputs.jsonl' | dflash-extract -m '$TG/qwen3-untied' -l 1,3 - >'$T/pipe.dfs'"
check "stdin to stdout: matches HF" "$CMP" "$TG/qwen3-untied/reference" "$T/pipe.dfs"
check "--compress lz4 --byte-shuffle on: extract" dflash-extract -m "$TG/qwen3-untied" -l 1,3 --compress lz4 --byte-shuffle on -o "$T/z.dfs" "$TG/qwen3-untied/reference/inputs.jsonl"
check "--compress lz4 --byte-shuffle on: matches HF" "$CMP" "$TG/qwen3-untied/reference" "$T/z.dfs"

# Records are encoded on every thread, a wave of samples at a time, then
# written in order: the stream does not depend on the thread count (the
# header's time fixed by SOURCE_DATE_EPOCH; 13 samples in batches of ~2,
# waves of 2 and 6), and its stored bytes are those of the serial writer
# (dflash-pack re-encoding an uncompressed extraction).
python3 -c "
import json, random
r = random.Random(3)
for i in range(13):
    print(json.dumps({'id': 's%d' % i, 'input_ids': [r.randrange(50) for _ in range(r.randrange(1, 30))]}))
" >"$T/many.jsonl"
for th in 1 3; do
    check "encoded on $th thread(s): extract" env SOURCE_DATE_EPOCH=0 dflash-extract -m "$TG/qwen3-untied" -l 1,3 \
        --threads $th -b 40 --byte-shuffle on -o "$T/th$th.dfs" "$T/many.jsonl"
done
check "encoded on 1 or 3 threads: the same bytes" cmp "$T/th1.dfs" "$T/th3.dfs"
check "uncompressed: extract" dflash-extract -m "$TG/qwen3-untied" -l 1,3 --threads 3 -b 40 -o "$T/th0.dfs" "$T/many.jsonl"
check "uncompressed, re-encoded by dflash-pack" dflash-pack --byte-shuffle on -o "$T/thp.dfs" "$T/th0.dfs"
stored_sums() { dflash-pack --inspect "$1" | grep -o '"xxh64":"[0-9a-f]*"'; }
stored_sums "$T/th3.dfs" >"$T/th3.sums"
stored_sums "$T/thp.dfs" >"$T/thp.sums"
check "encoded on 3 threads: every tensor's stored bytes as the serial writer's" cmp "$T/th3.sums" "$T/thp.sums"
check "  (and there are 13 records of tensors)" test "$(grep -c xxh64 "$T/th3.sums")" -ge 13
if [ "$(stat -c %s "$T/z.dfs")" -lt "$(stat -c %s "$T/pipe.dfs")" ]; then pass "compressed output is smaller"; else fail "compressed output is smaller"; fi

# The forward does not depend on the thread count either: its products run
# as fixed tiles of single-threaded OpenBLAS calls. OpenBLAS's own split of
# a product gave other bits at other thread counts (1 ulp in a few values
# at these widths, at 4096 too), so -t 1 and -t 3 wrote other streams.
tiny_target "$T/wide" --layers 4 --hidden 128 --intermediate 384 --seed 4
python3 -c "
import json, random
r = random.Random(4)
for i in range(4):
    print(json.dumps({'id': 'w%d' % i, 'input_ids': [r.randrange(61) for _ in range(r.randrange(500, 700))]}))
" >"$T/wide.jsonl"
for th in 1 2 3; do
    check "forward on $th thread(s): extract" env SOURCE_DATE_EPOCH=0 dflash-extract -m "$T/wide" -l 1,3 \
        --threads $th -o "$T/wide$th.dfs" "$T/wide.jsonl"
done
check "forward on 1 or 2 threads: the same bytes" cmp "$T/wide1.dfs" "$T/wide2.dfs"
check "forward on 1 or 3 threads: the same bytes" cmp "$T/wide1.dfs" "$T/wide3.dfs"

# Bad samples. Lines 2, 4, 5, 6 are bad; 1, 3, 7 are good.
good=$TG/qwen3-tied/reference/inputs.jsonl
{
    sed -n 1p "$good"
    echo '{"id": "oor", "input_ids": [1, 2, 211]}'
    sed -n 2p "$good"
    echo '{"id": "empty", "input_ids": []}'
    echo '{"id": "mask", "input_ids": [1, 2, 3], "loss_mask": [1, 1]}'
    echo '{"id": "broken", "input_ids": [1, 2'
    sed -n 3p "$good"
} >"$T/bad.jsonl"
expect_exit 65 "bad sample stops with exit 65" dflash-extract -m "$TG/qwen3-tied" -l 1,4 -o "$T/stop.dfs" "$T/bad.jsonl"
if grep -q 'bad.jsonl:2: input_ids\[2\]: token id 211 is outside the vocabulary' "$T/.err"; then pass "error names file, line and field"; else fail "error names file, line and field" "$(cat "$T/.err")"; fi
check "stopped output is a valid stream with the sample before" "$CMP" "$TG/qwen3-tied/reference" "$T/stop.dfs"
cp "$T/.out" "$T/stop.cmp"
check "stopped output passes dflash-pack --verify" dflash-pack --verify "$T/stop.dfs"
cp "$T/stop.cmp" "$T/.out"
if grep -q '^samples: 1$' "$T/.out"; then pass "stopped output holds exactly the samples before"; else fail "stopped output holds exactly the samples before" "$(cat "$T/.out")"; fi
# The same stop after several batches (-b 1: a batch a sample), where the
# device runs a batch while the host writes the one before: every batch
# before the bad sample is written, in order.
{ sed -n 1,3p "$good"; echo '{"id": "oor", "input_ids": [1, 2, 211]}'; sed -n 4p "$good"; } >"$T/bad3.jsonl"
# (SOURCE_DATE_EPOCH: the two streams' "created" in their headers the same)
expect_exit 65 "a bad sample after three batches stops with exit 65" env SOURCE_DATE_EPOCH=0 dflash-extract \
    -m "$TG/qwen3-tied" -l 1,4 -b 1 -o "$T/stop3.dfs" "$T/bad3.jsonl"
check "  ... the output is the three samples before it, valid" "$CMP" "$TG/qwen3-tied/reference" "$T/stop3.dfs"
if grep -q '^samples: 3$' "$T/.out"; then pass "  ... exactly those three"; else fail "  ... exactly those three" "$(cat "$T/.out")"; fi
check "  ... the records of a run over those three alone" sh -c "sed -n 1,3p '$good' >'$T/first3.jsonl' &&
    SOURCE_DATE_EPOCH=0 dflash-extract -m '$TG/qwen3-tied' -l 1,4 -b 1 -o '$T/first3.dfs' '$T/first3.jsonl' &&
    cmp '$T/first3.dfs' '$T/stop3.dfs'"
expect_exit 0 "--skip-bad: exit 0" dflash-extract -m "$TG/qwen3-tied" -l 1,4 --skip-bad -o "$T/skip.dfs" "$T/bad.jsonl"
if grep -q 'skipped 4 bad samples' "$T/.err" && grep -q 'bad.jsonl:6: malformed JSON' "$T/.err" &&
   grep -q 'bad.jsonl:4: input_ids: empty sample' "$T/.err" && grep -q 'bad.jsonl:5: loss_mask' "$T/.err"; then
    pass "--skip-bad: each bad sample reported and counted"
else
    fail "--skip-bad: each bad sample reported and counted" "$(cat "$T/.err")"
fi
check "--skip-bad: output passes dflash-pack --verify" dflash-pack --verify "$T/skip.dfs"
check "--skip-bad: output verifies" "$CMP" "$TG/qwen3-tied/reference" "$T/skip.dfs"
if grep -q '^samples: 3$' "$T/.out"; then pass "--skip-bad: the 3 good samples written"; else fail "--skip-bad: the 3 good samples written" "$(cat "$T/.out")"; fi
# A NUL byte makes its line a bad sample (named by line and column), and
# only that line: the next is read on its own, not glued onto it.
{ sed -n 1p "$good" | tr -d '\n'; printf '\0junk\n'; sed -n 2,3p "$good"; } >"$T/nul.jsonl"
expect_exit 65 "a NUL byte in a line: exit 65" dflash-extract -m "$TG/qwen3-tied" -l 1,4 -o "$T/nul-stop.dfs" "$T/nul.jsonl"
if grep -q "nul.jsonl:1: column $(( $(sed -n 1p "$good" | wc -c) )): a NUL byte" "$T/.err"; then pass "  ... named by file, line and column"
else fail "NUL byte message" "$(cat "$T/.err")"; fi
expect_exit 0 "  ... --skip-bad skips that line only" dflash-extract -m "$TG/qwen3-tied" -l 1,4 --skip-bad -o "$T/nul.dfs" "$T/nul.jsonl"
if grep -q 'skipped 1 bad samples; wrote 2 samples' "$T/.err"; then pass "  ... the 2 good samples after it written"
else fail "NUL byte --skip-bad" "$(cat "$T/.err")"; fi

# Broken models and bad options.
mkdir -p "$T/trunc" "$T/dynamic" "$T/arch"
cp "$TG/qwen3-tied/config.json" "$T/trunc/"
head -c 500000 "$TG/qwen3-tied/model.safetensors" >"$T/trunc/model.safetensors"
expect_exit 65 "truncated safetensors: exit 65" dflash-extract -m "$T/trunc" -l 1,4 -o "$T/x.dfs" "$good"
cp "$TG/qwen3-tied/model.safetensors" "$T/dynamic/"
sed 's/"rope_scaling": null/"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}/' \
    "$TG/qwen3-tied/config.json" >"$T/dynamic/config.json"
expect_exit 65 "rope dynamic: exit 65" dflash-extract -m "$T/dynamic" -l 1,4 -o "$T/x.dfs" "$good"
if grep -q dynamic "$T/.err"; then pass "rope dynamic: message names it"; else fail "rope dynamic: message names it" "$(cat "$T/.err")"; fi
cp "$TG/qwen3-tied/model.safetensors" "$T/arch/"
sed 's/Qwen3ForCausalLM/GPT2LMHeadModel/' "$TG/qwen3-tied/config.json" >"$T/arch/config.json"
expect_exit 65 "unknown architecture: exit 65" dflash-extract -m "$T/arch" -l 1,4 -o "$T/x.dfs" "$good"
expect_exit 66 "missing model directory: exit 66" dflash-extract -m "$T/nope" -o "$T/x.dfs" "$good"
# A FIFO in place of the target's config.json or weights is refused, not
# opened (a plain open waits for a writer forever).
for f in config.json model.safetensors; do
    rm -rf "$T/fifo-target"
    cp -r "$TG/qwen3-tied" "$T/fifo-target"
    rm "$T/fifo-target/$f"
    mkfifo "$T/fifo-target/$f"
    expect_exit 66 "a FIFO as the target's $f: exit 66, no hang" timeout 60 dflash-extract -m "$T/fifo-target" -l 1,4 -o "$T/x.dfs" "$good"
    if grep -q "fifo-target/$f: is a pipe or FIFO, not a regular file" "$T/.err"; then pass "  ... named"; else fail "FIFO $f message" "$(cat "$T/.err")"; fi
done
mkfifo "$T/fifo.json"
expect_exit 66 "a FIFO as --drafter-config: exit 66, no hang" timeout 60 dflash-extract -m "$TG/qwen3-tied" --drafter-config "$T/fifo.json" -o "$T/x.dfs" "$good"
expect_exit 66 "missing input: exit 66" dflash-extract -m "$TG/qwen3-tied" -l 1,4 -o "$T/x.dfs" "$T/nope.jsonl"
expect_exit 2 "layer id out of range: exit 2" dflash-extract -m "$TG/qwen3-tied" -l 1,6 -o "$T/x.dfs" "$good"
expect_exit 2 "bad --with: exit 2" dflash-extract -m "$TG/qwen3-tied" --with logits -o "$T/x.dfs" "$good"
expect_exit 2 "no --model: exit 2" dflash-extract -o "$T/x.dfs" "$good"
# A directory as the input is refused before anything runs: no output, and
# no hint to use --skip-bad (which skips bad samples, not read errors).
mkdir -p "$T/indir"
expect_exit 66 "a directory as the input: exit 66" dflash-extract -m "$TG/qwen3-tied" -l 1,4 -o "$T/x.dfs" "$T/indir"
if grep -qx "dflash-extract: $T/indir: is a directory" "$T/.err" && ! grep -q -- --skip-bad "$T/.err"; then
    pass "  ... named, without the --skip-bad hint"; else fail "directory input message" "$(cat "$T/.err")"; fi
if [ ! -e "$T/x.dfs" ]; then pass "  ... and no output"; else fail "directory input left an output"; rm -f "$T/x.dfs"; fi
# --byte-shuffle on implies lz4 only when --compress is not given; against
# --compress none it is refused (in either order), as dflash-pack does.
expect_exit 2 "--compress none --byte-shuffle on: exit 2" dflash-extract -m "$TG/qwen3-tied" -l 1,4 --compress none --byte-shuffle on -o "$T/x.dfs" "$good"
expect_exit 2 "--byte-shuffle on --compress none: exit 2" dflash-extract -m "$TG/qwen3-tied" -l 1,4 --byte-shuffle on --compress none -o "$T/x.dfs" "$good"
check "--byte-shuffle on alone: extract" dflash-extract -m "$TG/qwen3-tied" -l 1,4 --byte-shuffle on -o "$T/bs.dfs" "$good"
[ "$(dflash-pack --inspect "$T/bs.dfs" | jq -r 'select(.type=="sample").tensors[] | select(.name=="hidden") | "\(.codec) \(.shuffle)"' | sort -u)" = "lz4 true" ] &&
    pass "  ... writes lz4, shuffled" || fail "--byte-shuffle on alone"
expect_exit 2 "SOURCE_DATE_EPOCH that is not a time: exit 2" env SOURCE_DATE_EPOCH=abc dflash-extract -m "$TG/qwen3-tied" -l 1,4 -o "$T/x.dfs" "$good"
if grep -q "SOURCE_DATE_EPOCH: 'abc' is not a count of seconds" "$T/.err"; then pass "  ... named"; else fail "SOURCE_DATE_EPOCH message" "$(cat "$T/.err")"; fi
expect_exit 2 "SOURCE_DATE_EPOCH past 9999: exit 2" env SOURCE_DATE_EPOCH=253402300800 dflash-extract -m "$TG/qwen3-tied" -l 1,4 -o "$T/x.dfs" "$good"
# A write past ulimit -f ends the tool by SIGXFSZ (128+25), as any signal
# that ends it: after removing its temporary output (it was left).
expect_exit 153 "a write past ulimit -f: exit 153 (SIGXFSZ)" bash -c \
    "ulimit -c 0 -f 4; dflash-extract -m '$TG/qwen3-tied' -l 1,4 -o '$T/fsz.dfs' '$good'; exit \$?"
if ls -a "$T" | grep -q '^\.fsz\.dfs\.tmp\.' || [ -e "$T/fsz.dfs" ]; then fail "  ... leaves no temporary output" "$(ls -a "$T")"
else pass "  ... leaves no temporary output"; fi
expect_exit 69 "--device cuda without a GPU: exit 69" dflash-extract -m "$TG/qwen3-tied" -l 1,4 --device cuda -o "$T/x.dfs" "$good"
if [ ! -e "$T/x.dfs" ]; then pass "failed runs leave no output file"; else fail "failed runs leave no output file"; fi
if ls -a "$T" | grep -q '\.tmp\.'; then fail "no temporary files left behind"; else pass "no temporary files left behind"; fi

# mktarget models run too (the generator other tests and the demo use).
check "mktarget llama" "$MKT" -a llama --tie no --llama3-scaling --hidden 40 --heads 4 --kv-heads 2 --layers 3 --vocab 50 -o "$T/mk"
check "mktarget model extracts" dflash-extract -m "$T/mk" -l 0,1,2 --with target-ids -o "$T/mk.dfs" "$T/small.jsonl"
check "--help" dflash-extract --help
