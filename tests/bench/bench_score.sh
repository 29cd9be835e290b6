#!/usr/bin/env bash
# bench_score.sh: the online loop of dflash-score (greedy speculative decoding
# with a DFlash drafter, target and drafter KV caches) against plain greedy
# decoding of the same target with its KV cache, same binary, same threads,
# same prompts, on the CPU. The target is a random Qwen3-shaped model
# (mktarget: hidden 256, 6 layers, 4/2 heads of 64, intermediate 768, vocab
# 4096); the drafter (2 layers, block 8, taps 1,3,4) is trained briefly by
# dflash-train-step on the target's own greedy continuations of the training
# prompts, then decodes held-out prompts and the training prompts, greedily,
# and the training prompts sampled at the temperatures BENCH_TEMPS (0.02
# and 1: this random target's logits are flat, a few tenths apart, so at 1
# its draws are noise that no drafter predicts, and the draft is accepted
# only at low temperatures). Prints tau (z-lab macro and pooled), decode
# tokens/s of both loops and their ratio, and checks nothing: timings never
# go in tests.
#
# Knobs: BENCH_THREADS (all cores), BENCH_STEPS (300 training steps),
# BENCH_NEW (128 new tokens per prompt), BENCH_TEMPS ("0.02 1"). BENCH_ARCH=qwen3.5
# (bench_score_qwen35.sh): a Qwen3.5 hybrid target of the same width (Gated
# DeltaNet layers 0, 1, 3, 4 with 2/4 heads of 64; gated attention layers
# 2, 5), whose verify blocks keep and replay the DeltaNet state.
set -u
. "$(dirname "$0")/lib.sh"
export PATH="$DFLASH_BIN:$PATH"
threads=${BENCH_THREADS:-$(nproc)}
steps=${BENCH_STEPS:-300}
new=${BENCH_NEW:-128}
temps=${BENCH_TEMPS:-0.02 1}
bench_workdir score

arch=${BENCH_ARCH:-qwen3}
arch_opts=()
[ "$arch" = qwen3.5 ] && arch_opts=(--full-interval 3 --linear-k-heads 2 --linear-v-heads 4 --linear-k-dim 64 --linear-v-dim 64)
"$DFLASH_BUILD/tests/mktarget" -a "$arch" --hidden 256 --layers 6 --heads 4 --kv-heads 2 --head-dim 64 \
    --intermediate 768 --vocab 4096 --tie no --seed 7 "${arch_opts[@]}" -o "$W/target" >/dev/null || exit 1
python3 - "$W" <<'PY'
import json, random, sys
r = random.Random(1)
d = sys.argv[1]
for name, n in (("train", 24), ("test", 8)):
    with open(f"{d}/{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{name}{i}", "input_ids": [r.randrange(4000) for _ in range(r.randrange(16, 64))]}) + "\n")
PY
drafter_config "$W/drafter.json" block=8 mask=4095 hidden=256 inter=768 head_dim=64 theta=1000000.0 vocab=4096
T1="--threads $threads"
head -1 "$W/train.jsonl" | dflash-extract -m "$W/target" -l 1,3,4 -o "$W/one.dfs" || exit 1
dflash-train-step $T1 --target "$W/target" --init "$W/drafter.json" --steps 0 --out "$W/rand" "$W/one.dfs" || exit 1
# the target's greedy continuations of the training prompts -> a training stream
dflash-score $T1 --target "$W/target" --drafter "$W/rand" --prompts "$W/train.jsonl" --max-new-tokens "$new" \
    --ignore-eos --emit "$W/emit.jsonl" >/dev/null || exit 1
python3 - "$W/emit.jsonl" "$W/train.jsonl" "$W/samples.jsonl" <<'PY'
import json, sys
P = {json.loads(l)["id"]: json.loads(l)["input_ids"] for l in open(sys.argv[2])}
with open(sys.argv[3], "w") as f:
    for l in open(sys.argv[1]):
        e = json.loads(l)
        p = P[e["id"]]
        f.write(json.dumps({"id": e["id"], "input_ids": p + e["greedy_ids"],
                            "loss_mask": [0] * len(p) + [1] * len(e["greedy_ids"])}) + "\n")
PY
dflash-extract $T1 -m "$W/target" -l 1,3,4 -o "$W/train.dfs" "$W/samples.jsonl" || exit 1
t0=$(date +%s)
dflash-train-step $T1 --target "$W/target" --init "$W/drafter.json" --steps "$steps" --lr 3e-3 --anchors 32 \
    --batch-seqs 8 --loop --seed 1 --log "$W/train.log" --out "$W/good" "$W/train.dfs" || exit 1
t1=$(date +%s)

head -8 "$W/train.jsonl" >"$W/seen.jsonl"
for set in test seen; do
    dflash-score $T1 --json --target "$W/target" --drafter "$W/rand" --drafter "$W/good" --prompts "$W/$set.jsonl" \
        --max-new-tokens "$new" --ignore-eos >"$W/$set.json" || exit 1
done
# sampled (the draft greedy, as in z-lab's benchmark): plain decoding samples
# too, so "greedy tok/s" there is plain sampling's
for temp in $temps; do
    dflash-score $T1 --json --target "$W/target" --drafter "$W/rand" --drafter "$W/good" --prompts "$W/seen.jsonl" \
        --max-new-tokens "$new" --ignore-eos --temperature "$temp" --seed 0 >"$W/seen-t$temp.json" || exit 1
done
python3 - "$W" "$threads" "$steps" "$((t1 - t0))" "$new" "$arch" "$temps" <<'PY'
import json, sys
W, threads, steps, secs, new, arch, temps = sys.argv[1:]
last = [json.loads(l) for l in open(f"{W}/train.log")][-1]
print(f"target: mktarget {arch} hidden 256, 6 layers, vocab 4096; drafter: 2 layers, block 8; {threads} threads, "
      f"{new} new tokens per prompt (eos ignored)")
print(f"drafter trained {steps} steps in {secs} s on 24 greedy continuations (last step: loss {last['loss']:.3f}, "
      f"offline tau {last['tau']:.3f})")
print(f"{'prompts':<22}{'drafter':<9}{'tau_macro':>10}{'tau_pooled':>11}{'spec tok/s':>12}{'greedy tok/s':>14}"
      f"{'tok/s ratio':>12}{'speedup':>9}{'mismatches':>11}")
sets = [("test", "8 held-out"), ("seen", "8 trained-on")] + [(f"seen-t{x}", f"8 trained-on, T={x}") for x in temps.split()]
for name, what in sets:
    for r in (json.loads(l) for l in open(f"{W}/{name}.json")):
        d = r["drafter"].rsplit("/", 1)[-1]
        ratio = r["tokens_per_s"] / r["greedy_tokens_per_s"]
        print(f"{what:<22}{d:<9}{r['tau_macro']:>10.3f}{r['tau_pooled']:>11.3f}{r['tokens_per_s']:>12.1f}"
              f"{r['greedy_tokens_per_s']:>14.1f}{ratio:>12.2f}{r['speedup']:>9.2f}{r['mismatches']:>11}")
PY
