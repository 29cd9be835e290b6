#!/usr/bin/env bash
# The records dflash-train-step and dflash-score read (lib/records.c): a bad
# record, written by the independent Python writer (tests/interop/dfs_py.py),
# stops both tools with exit 65 and a message naming the file, the record,
# the tensor and the position, whether records are read ahead or not; and
# reading ahead gives the same figures as reading in line.
. "$(dirname "$0")/lib.sh"

require_built "$DFLASH_BUILD/tests/mktarget" "$DFLASH_BIN/dflash-extract" "$DFLASH_BIN/dflash-train-step" \
    "$DFLASH_BIN/dflash-score"
PY=/usr/bin/python3
tiny_target "$T/target" --layers 6 --tie no --seed 2
python3 - "$T/data.jsonl" <<'EOF'
import json, random, sys
r = random.Random(7)
with open(sys.argv[1], "w") as f:
    for i in range(6):
        ids = [r.randrange(60) for _ in range(30)]
        f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * 26}) + "\n")
EOF
check "extract the stream" dflash-extract -m "$T/target" -l 1,3,4 --with target-ids -o "$T/good.dfs" "$T/data.jsonl"
drafter_config "$T/drafter.json"
check "a random drafter" dflash-train-step --threads 1 --target "$T/target" --init "$T/drafter.json" --steps 0 \
    --out "$T/d1" "$T/good.dfs"

# The good stream again, record s3 spoiled one way (the others as they were).
spoil() { # KIND OUT
    $PY - "$here/tests/interop" "$T/good.dfs" "$1" "$2" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import dfs_py
src, kind, out = sys.argv[2:5]
recs = list(dfs_py.read_stream(src))
with open(out, "wb") as f:
    dfs_py._record(f, dfs_py.stream_header(recs[0][0]["meta"]))
    for head, h, arrays in recs:
        arrays = {k: np.array(v) for k, v in arrays.items()}
        if h["id"] == "s3":
            if kind == "mask": arrays["loss_mask"][9] = 2
            elif kind == "vocab": arrays["input_ids"][5] = 61
            elif kind == "tvocab": arrays["target_ids"][7] = -1
            elif kind == "width": arrays["hidden"] = arrays["hidden"][:, :-1]
            elif kind == "dtype": arrays["hidden"] = arrays["hidden"].view(np.float16)
            elif kind == "missing": del arrays["loss_mask"]
        dtype = {"input_ids": "i32", "target_ids": "i32", "loss_mask": "u8"}
        hd = "f16" if arrays["hidden"].dtype == np.float16 else "bf16"
        dfs_py.sample_record(f, h["id"], [dfs_py.encode(k, v, dtype.get(k, hd), "lz4", True)
                                          for k, v in arrays.items()])
    dfs_py.end_record(f, len(recs))
EOF
}

TRAIN="dflash-train-step --threads 1 --target $T/target --init $T/drafter.json --anchors 4 --batch-seqs 1 --steps 6"
SCORE="dflash-score --threads 1 --target $T/target --drafter $T/d1"
# kind, what the message must hold (s3 is record 4: the stream header is 0)
while IFS='|' read -r kind want; do
    check "spoil s3: $kind" spoil "$kind" "$T/$kind.dfs"
    for ra in on off; do
        expect_exit 65 "dflash-train-step, $kind, --read-ahead $ra: exit 65" $TRAIN --labels target --read-ahead $ra \
            --log "$T/log-$kind-$ra" --out "$T/x" "$T/$kind.dfs"
        cp "$T/.err" "$T/train-$kind-$ra.err"
        check "  ... the message names the file and the record" grep -qE "^dflash-[a-z-]+: $T/$kind.dfs: byte [0-9]+ \(record 4\): sample " "$T/train-$kind-$ra.err"
        check "  ... '$want'" grep -qF "sample \"s3\": $want" "$T/train-$kind-$ra.err"
        check "  ... after the three steps before the record" test "$(wc -l <"$T/log-$kind-$ra")" -eq 3
        check "  ... and no checkpoint" test ! -e "$T/x"
        expect_exit 65 "dflash-score, $kind, --read-ahead $ra: exit 65" $SCORE --labels target --read-ahead $ra \
            "$T/$kind.dfs"
        cp "$T/.err" "$T/score-$kind-$ra.err"
        check "  ... and no result line" test ! -s "$T/.out"
        check "  ... the message names the file and the record" grep -qE "^dflash-[a-z-]+: $T/$kind.dfs: byte [0-9]+ \(record 4\): sample " "$T/score-$kind-$ra.err"
        check "  ... '$want'" grep -qF "sample \"s3\": $want" "$T/score-$kind-$ra.err"
    done
    check "  ... the same message with and without reading ahead" cmp "$T/score-$kind-on.err" "$T/score-$kind-off.err"
done <<'EOF'
mask|tensor "loss_mask"[9] is 2, not 0 or 1
vocab|tensor "input_ids"[5] is 61, outside the vocabulary [0, 61)
tvocab|tensor "target_ids"[7] is -1, outside the vocabulary [0, 61)
width|tensor "hidden" must be bf16 [30, 96]
dtype|tensor "hidden" must be bf16 [30, 96]
missing|tensor "loss_mask" is missing (want u8 [30])
EOF

# ---- reading ahead or not: the same figures -----------------------------------------------------
for ra in on off; do
    check "dflash-score --read-ahead $ra" $SCORE --json --anchors 5 --seed 3 --read-ahead $ra "$T/good.dfs"
    cp "$T/.out" "$T/score-$ra.json"
done
check "  ... the same figures" $PY - "$T/score-on.json" "$T/score-off.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
for x in (a, b):
    x.pop("time")
assert a == b and a["records"] == 6 and a["blocks"] == 30, (a, b)
EOF
check "  ... and from standard input" $SCORE --json --anchors 5 --seed 3 - <"$T/good.dfs"
cp "$T/.out" "$T/score-stdin.json"
check "  ... the same figures" $PY - "$T/score-on.json" "$T/score-stdin.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
for x in (a, b):
    x.pop("time"), x.pop("input")
assert a == b, (a, b)
EOF
expect_exit 2 "--read-ahead with --prompts is refused (the online mode reads no stream)" $SCORE --read-ahead off \
    --prompts "$T/data.jsonl"
expect_exit 2 "--read-ahead takes on or off" $SCORE --read-ahead maybe "$T/good.dfs"
