#!/usr/bin/env bash
# slow (about 2 minutes on 2 cores: its own NO_CUDA build in build-gpu/)
# tests/gpu/run.sh is run once per GPU loan, with minutes of device time:
# a script error there costs the loan. DFLASH_GPU_DRYRUN=1 runs the same
# script on the CPU with tiny shapes; here it must finish, write its 7 files,
# fill every row of the report with a result (no FAIL), give the rows the
# issue needs, and leave nothing behind in the checkout.
. "$(dirname "$0")/lib.sh"
cd "$here"
before=$(git status --porcelain 2>/dev/null)
# the dry run builds against the carried libraries, as on the device: pack
# them as one does before a GPU run (the ignored .gpu-deps/, 12 MB, 3 s)
[ -f .gpu-deps/dflash-deps.tar.gz ] || check "pack-deps.sh" bash tests/gpu/pack-deps.sh
check "run.sh dry run finishes" env DFLASH_GPU_DRYRUN=1 OUT="$T/out" bash tests/gpu/run.sh
R=$T/out/report.md
check "7 files come back" test "$(find "$T/out" -type f | wc -l)" = 7
check "the report says finished" grep -q ': finished\.$' "$R"
check "every row has a result, none failed" python3 - "$R" <<'PY'
import sys
rows = [l.split("|")[1:-1] for l in open(sys.argv[1]) if l.startswith("| ") and not l.startswith("| step") and not l.startswith("| ---")]
assert len(rows) >= 15, len(rows)
for step, result, _ in rows:
    assert result.strip(), "empty result: " + step
    assert "FAIL" not in result, step + ": " + result
print(len(rows), "rows")
PY
for r in "build" "model: extraction cpu vs cpu" "model: Qwen3.5 extraction cpu vs cpu" "model: Qwen3.5 online loop on cpu" \
    "extraction, Qwen3-8B shape" "train step, Qwen3-8B drafter" "dflash-score cpu online, untrained drafter" \
    "the same step, a sliding window of 2048" "model: drafter step gradients, bench_train --small --window 40" \
    "gpt-oss-20b attention, full layer" "gpt-oss-20b attention, sliding layer (window 128)" \
    "Gated DeltaNet, one Qwen3.5-27B layer" "Qwen3.5-27B attention layer" \
    "dflash-extract --device cpu: Qwen3.5-27B layer shapes" "model: qwen3-moe extraction cpu vs cpu" \
    "model: qwen3-moe online loop on cpu" "model: qwen35-moe extraction cpu vs cpu" "model: qwen35-moe online loop on cpu" \
    "model: gpt-oss extraction cpu vs cpu" "model: gpt-oss online loop on cpu" \
    "model: sliding-window Qwen3 extraction cpu vs cpu" "model: sliding-window Qwen3 online loop on cpu" \
    "dflash-extract --device cpu: Qwen3-30B-A3B layer shapes" "the same, one cuBLAS call per expert" \
    "dflash-extract --device cpu: gpt-oss-20b layer shapes" \
    "records decoded on the host: lz4 + byte shuffle"; do
    check "row: $r" grep -qF "| $r" "$R"
done
check "nothing left in the checkout" test "$(git status --porcelain 2>/dev/null)" = "$before"
