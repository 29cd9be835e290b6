#!/usr/bin/env bash
# bench_train.sh: dflash-train-step against the PyTorch equivalent of the same
# step (tests/bench/bench_train.py: PyTorch CPU, fp32, dense masked SDPA and
# autograd, same thread count) on the same drafter shape and the same
# sequences: a 3-layer drafter (hidden 256, 4/2 heads of 64, intermediate 768,
# block 16, 3 taps) of a random Qwen3-shaped target (mktarget, vocab 8192),
# 512-token sequences extracted by dflash-extract, 32 anchors per sequence,
# 4 sequences per step. Prints optimizer steps/s and block tokens/s of both,
# the ratio, and the peak RSS of both. Skips (exit 0, says why) without torch.
#
# Knobs: BENCH_STEPS (10), BENCH_THREADS (all cores), BENCH_HIDDEN (256; the
# intermediate size is 3x, heads of 64, half as many KV heads), BENCH_VOCAB (8192),
# BENCH_REPEAT (1): run both that many times, alternating, and keep each one's
# fastest run (on a shared machine the fastest is the least disturbed; single
# runs of the PyTorch step were seen 1.55 to 2.49 steps/s apart).
set -u
. "$(dirname "$0")/lib.sh"
steps=${BENCH_STEPS:-10}
threads=${BENCH_THREADS:-$(nproc)}
anchors=32
batch=4
H=${BENCH_HIDDEN:-256}
I=$((3 * H))
NH=$((H / 64))
NKV=$(((NH + 1) / 2))
V=${BENCH_VOCAB:-8192}
repeat=${BENCH_REPEAT:-1}

bench_require bench_train "python3 cannot import torch, safetensors and numpy" python3 -c 'import torch, safetensors, numpy'
bench_require bench_train "/usr/bin/time (GNU time) is missing" test -x /usr/bin/time
bench_workdir train

"$DFLASH_BUILD/tests/mktarget" -a qwen3 --hidden $H --layers 6 --heads $NH --kv-heads $NKV --head-dim 64 \
    --intermediate $I --vocab $V --tie no --seed 7 -o "$W/target" >/dev/null || exit 1
python3 - "$W/in.jsonl" "$V" <<'PY'
import json, random, sys
r = random.Random(1)
with open(sys.argv[1], "w") as f:
    for i in range(16):
        f.write(json.dumps({"id": i, "input_ids": [r.randrange(int(sys.argv[2]) - 192) for _ in range(512)],
                            "loss_mask": [0] * 64 + [1] * 448}) + "\n")
PY
drafter_config "$W/drafter.json" block=16 mask=$((V - 1)) taps="1, 2, 3" hidden=$H inter=$I layers=3 heads=$NH \
    kv_heads=$NKV head_dim=64 theta=1000000.0 vocab=$V
"$DFLASH_BIN/dflash-extract" -m "$W/target" -l 1,2,3 -o "$W/train.dfs" "$W/in.jsonl" || exit 1
"$DFLASH_BIN/dflash-pack" --export "$W/export" "$W/train.dfs" || exit 1

for i in $(seq "$repeat"); do
    rm -f "$W/ours-$i.log"
    /usr/bin/time -f "%e %M" -o "$W/ours-$i.time" "$DFLASH_BIN/dflash-train-step" --target "$W/target" \
        --init "$W/drafter.json" --steps $((steps + 1)) --anchors $anchors --batch-seqs $batch --loop \
        --threads "$threads" --log "$W/ours-$i.log" --out "$W/ckpt" "$W/train.dfs" || exit 1
    /usr/bin/time -f "%e %M" -o "$W/torch-$i.time" python3 "$here/tests/bench/bench_train.py" "$W/drafter.json" \
        "$W/target" "$W/export" "$threads" "$steps" $anchors $batch >"$W/torch-$i.out" 2>"$W/torch.err" ||
        { cat "$W/torch.err"; exit 1; }
done

python3 - "$W" "$repeat" "$threads" "$steps" "$H" "$V" <<'PY'
import json, sys
W, repeat, thr, steps, H, V = sys.argv[1:]
def ours(i):  # the first step is warm-up, as on the PyTorch side
    L = [json.loads(x) for x in open(f"{W}/ours-{i}.log")][1:]
    kb = int(open(f"{W}/ours-{i}.time").read().split()[1])
    return sum(s["seconds"] for s in L), len(L), sum(s["block_tokens"] for s in L), kb
def torch(i):
    _, tsteps, _, tsec, _, tblk = open(f"{W}/torch-{i}.out").read().split()
    kb = int(open(f"{W}/torch-{i}.time").read().split()[1])
    return float(tsec), int(tsteps), int(tblk), kb
runs = range(1, int(repeat) + 1)
ours_s, nsteps, ours_blk, ours_kb = min(ours(i) for i in runs)
tsec, tsteps, tblk, torch_kb = min(torch(i) for i in runs)
o_sps, t_sps = nsteps / ours_s, tsteps / tsec
print(f"bench_train: 3-layer drafter (H {H}, B 16, 3 taps, vocab {V}), 4 x 512-token sequences x 32 anchors "
      f"per step, {thr} threads, {nsteps} timed steps, best of {repeat}")
print(f"  dflash-train-step  {o_sps:7.3f} steps/s  {ours_blk / ours_s:9.1f} block tok/s   peak RSS {ours_kb / 1024:7.1f} MiB")
print(f"  PyTorch (SDPA)     {t_sps:7.3f} steps/s  {tblk / tsec:9.1f} block tok/s   peak RSS {torch_kb / 1024:7.1f} MiB")
print(f"  ratio dflash/PyTorch: {o_sps / t_sps:.2f}x  (goal >= 1.5x)")
PY
