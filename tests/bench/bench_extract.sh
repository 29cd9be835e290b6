#!/usr/bin/env bash
# bench_extract.sh: dflash-extract against transformers (PyTorch CPU, fp32,
# same thread count) on one random Qwen3-shaped model of ~100M parameters
# (hidden 768, 12 layers, 12/4 heads, head_dim 64, intermediate 2048, vocab
# 32000, tied; written by mktarget, the same weights for both) over 512-token
# samples, tapping the default 5 layers. Prints tokens/s of both, their ratio
# and the peak RSS of both. Skips (exit 0, says why) without torch.
#
# Knobs: BENCH_SAMPLES (16), BENCH_THREADS (all cores), BENCH_BATCH_TOKENS (4096),
# BENCH_REPEAT (1): run both that many times, alternating, and keep each
# one's fastest run (on a shared machine the fastest is the least disturbed).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
: "${DFLASH_BIN:=$here/bin}"
: "${DFLASH_BUILD:=$here/build}"
samples=${BENCH_SAMPLES:-16}
threads=${BENCH_THREADS:-$(nproc)}
bt=${BENCH_BATCH_TOKENS:-4096}
repeat=${BENCH_REPEAT:-1}

if ! python3 -c 'import torch, transformers' 2>/dev/null; then
    echo "bench_extract: skipped: python3 cannot import torch and transformers"
    exit 0
fi
if [ ! -x /usr/bin/time ]; then
    echo "bench_extract: skipped: /usr/bin/time (GNU time) is missing"
    exit 0
fi
W=$(mktemp -d "${TMPDIR:-/tmp}/bench-extract.XXXXXX")
trap 'rm -rf "$W"' EXIT

"$DFLASH_BUILD/tests/mktarget" -a qwen3 --hidden 768 --layers 12 --heads 12 --kv-heads 4 --head-dim 64 \
    --intermediate 2048 --vocab 32000 --tie yes --seed 7 -o "$W/model" || exit 1
python3 - "$samples" >"$W/in.jsonl" <<'PY'
import json, random, sys
r = random.Random(1)
for i in range(int(sys.argv[1])):
    print(json.dumps({"id": i, "input_ids": [r.randrange(32000) for _ in range(512)]}))
PY
layers=$(python3 -c "L=12; print(','.join(str(int(round(1 + i*((L-3)-1)/4))) for i in range(5)))")

# keep_best NEW BEST: keep in BEST the line whose first field (seconds) is smallest.
keep_best() {
    if [ ! -s "$2" ] || awk -v a="$(cut -d' ' -f1 "$1")" -v b="$(cut -d' ' -f1 "$2")" 'BEGIN { exit !(a < b) }'; then cp "$1" "$2"; fi
}
for i in $(seq "$repeat"); do
    /usr/bin/time -f "%e %M" -o "$W/ours.t" "$DFLASH_BIN/dflash-extract" -m "$W/model" -l "$layers" \
        -t "$threads" -b "$bt" -o "$W/out.dfs" "$W/in.jsonl" || exit 1
    keep_best "$W/ours.t" "$W/ours.time"
    /usr/bin/time -f "%e %M" -o "$W/torch.t" python3 "$here/tests/bench/bench_extract.py" "$W/model" "$W/in.jsonl" \
        "$threads" "$layers" >"$W/torch.o" 2>"$W/torch.err" || { cat "$W/torch.err"; exit 1; }
    read -r _ _ _ _ _ loop <"$W/torch.o"
    echo "$loop $(cat "$W/torch.t") $(cat "$W/torch.o")" >"$W/torch.l"
    keep_best "$W/torch.l" "$W/torch.best"
done

read -r ours_s ours_kb <"$W/ours.time"
read -r _ torch_s torch_kb _ torch_tok _ torch_load _ torch_loop <"$W/torch.best"
tokens=$((samples * 512))
python3 - "$tokens" "$ours_s" "$ours_kb" "$torch_tok" "$torch_load" "$torch_loop" "$torch_s" "$torch_kb" "$threads" "$layers" <<'PY'
import sys
tok, ours_s, ours_kb, ttok, tload, tloop, twall, tkb, thr, layers = sys.argv[1:]
tok, ours_s, ttok, tloop, twall = int(tok), float(ours_s), int(ttok), float(tloop), float(twall)
ours_tps = tok / ours_s          # whole process: load, forward, bf16, stream writing
torch_tps = ttok / tloop         # forward loop only (model load and imports excluded)
print(f"bench_extract: Qwen3-shaped 100M model, {tok} tokens (512-token samples), {thr} threads, layers {layers}")
print(f"  dflash-extract  {ours_tps:9.1f} tok/s  (whole process {ours_s:.2f} s)   peak RSS {int(ours_kb)/1024:7.1f} MiB")
print(f"  transformers    {torch_tps:9.1f} tok/s  (forward loop {tloop:.2f} s; process {twall:.2f} s)   peak RSS {int(tkb)/1024:7.1f} MiB")
print(f"  ratio dflash/transformers: {ours_tps / torch_tps:.2f}x  (goal >= 1.5x)")
PY
