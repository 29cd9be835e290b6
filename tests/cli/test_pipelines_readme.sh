#!/usr/bin/env bash
# slow
# The README's commands run as written, on a tiny target: every indented
# command block after the first (make deps/demo/check), in order, in one bash
# -e script. "Qwen3-8B" is a link to the tiny target ("Qwen3.6-27B" to a tiny
# Qwen3.5 hybrid); only sizes are scaled
# down (steps, tokens, layer ids of a 4-layer model, the mask token of a
# 61-token vocabulary) and cuda becomes cpu. A renamed option, a wrong file
# name or a broken loop in the README fails here, in a pipe too (pipefail:
# `dflash-score ... | cut` used to pass with dflash-score exiting 2).
. "$(dirname "$0")/lib.sh"

if ! command -v dflash-score >/dev/null; then echo "SKIP README commands: dflash-score is not built yet (issue 5)"; exit 0; fi
cd "$T"
tiny_target target --layers 4 --tie no --seed 12
ln -s target Qwen3-8B
# the Qwen3.5 example: a tiny hybrid of 8 layers (taps 1,3,6 for 1,16,31,46,61)
"$DFLASH_BUILD/tests/mktarget" -a qwen3.5 -o target35 --vocab 61 --hidden 32 --intermediate 48 --heads 4 --kv-heads 2 \
    --head-dim 16 --layers 8 --seed 3 >/dev/null
ln -s target35 Qwen3.6-27B
awk 'BEGIN { x = 21; for (i = 0; i < 24; i++) { s = ""; m = ""
      for (j = 0; j < 20; j++) { x = (x * 48271) % 2147483647; s = s (j ? "," : "") x % 60; m = m (j ? "," : "") (j < 4 ? 0 : 1) }
      printf "{\"id\":\"r%d\",\"input_ids\":[%s],\"loss_mask\":[%s]}\n", i, s, m } }' >samples.jsonl
head -3 samples.jsonl | jq -c '{id, input_ids: .input_ids[:6]}' >mt-bench.jsonl
cp mt-bench.jsonl prompts.jsonl
ln -s "$here/pipelines" pipelines

# The blocks, in order, minus the first.
awk '/^    / { if (!inb) n++; inb = 1; if (n > 1) print substr($0, 5); next } { inb = 0 }' "$here/README.md" >readme.sh
[ "$(grep -c . readme.sh)" -ge 15 ] || fail "README blocks found" "$(wc -l <readme.sh) lines"
# After the tour's checkpoints exist, the tool paragraphs use files in ".".
sed -i '/^dflash-extract -m Qwen3-8B -l /i cp run/drafter.json drafter.json 2>/dev/null || true' readme.sh
sed -i '/^dflash-extract -m Qwen3-8B -l /i ln -sf run/train.dfs train.dfs; ln -sf run/val.dfs val.dfs; cp -r run/ckpt-20000 ckpt-1000' readme.sh
sed -i '/^start="--init drafter.json"/i cp run/drafter.json drafter.json' readme.sh
sed -i -e 's/-d cuda/-d cpu/g; s/--device cuda/--device cpu/g' \
    -e 's/--steps 10000 /--steps 6 /g; s/--steps 25000 /--steps 3 /g; s/--steps 1000 /--steps 4 /g' \
    -e 's/--batch-seqs 32 /--batch-seqs 4 /g; s/--total-steps 150000/--total-steps 40/g; s/--max-new-tokens 2048/--max-new-tokens 8/g' \
    -e 's/-l 1,9,17,25,33/-l 1,2/; s/-l 1,16,31,46,61/-l 1,3,6/; s/-j 8 /-j 2 /' \
    -e 's|OUT=run run/drafter.json|OUT=run LAYERS=1,2 DRAFT_LAYERS=1 BLOCK=4 MASK_TOKEN=60 run/drafter.json|' \
    -e 's/--split train=0.99,val=0.01/--split train=0.75,val=0.25/' readme.sh
export OMP_NUM_THREADS=1
if bash -e -o pipefail readme.sh >readme.out 2>&1; then
    pass "the README's commands run ($(grep -c . readme.sh) lines)"
else
    fail "the README's commands run" "$(tail -5 readme.out)"
fi
for f in qwen36.dfs run/drafter.json run/samples.dfs run/train.dfs run/val.dfs run/ckpt-10000 run/ckpt-20000 ckpt-e6 ckpt-2000; do
    [ -e "$f" ] || fail "README output $f" "missing"
done
jq -e '.step == 18' ckpt-e6/trainer_state.json >/dev/null && pass "the README's epoch loop: 6 epochs of 3 steps" ||
    fail "the README's epoch loop: 6 epochs of 3 steps"
