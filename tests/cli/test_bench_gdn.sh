#!/usr/bin/env bash
# tests/gpu/bench_gdn.c on the CPU: it cannot be timed here, but it must
# build, run its tiny shapes through the CPU op table with finite outputs,
# print every row the GPU run reads (the attention alone with --attn-only),
# and refuse a missing CUDA device with exit code 69.
. "$(dirname "$0")/lib.sh"
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"
G=$DFLASH_BUILD/gpu
require_built "$G/bench_gdn"

check "bench_gdn --tiny on the CPU" sh -c "'$G/bench_gdn' --device cpu --tiny --iters 1 >'$T/gdn.txt'"
check "bench_gdn: every row, finite outputs" python3 - "$T/gdn.txt" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
for k in ("attn_causal ms", "TFLOP/s", "conv1d_silu ms", "gated_delta ms", "f32 floor ms", "steps per s",
          "conv1d_silu us", "gated_delta us", "byte floor us"):
    assert re.search(re.escape(k) + r"\s+[0-9.e+]+\n", t), (k, t)
assert re.findall(r"non-finite outputs\s+(\d+)", t) == ["0", "0", "0"], t
PY
check "bench_gdn --attn-only: the attention rows alone" sh -c "'$G/bench_gdn' --device cpu --tiny --iters 1 --attn-only >'$T/attn.txt'"
check "  ... and no DeltaNet row" python3 - "$T/attn.txt" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
assert re.search(r"attn_causal ms\s+[0-9.e+]+\n", t) and "gated_delta" not in t, t
assert re.findall(r"non-finite outputs\s+(\d+)", t) == ["0"], t
PY
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
    expect_exit 69 "bench_gdn --device cuda without a GPU: exit 69" "$G/bench_gdn" --tiny
fi
expect_exit 2 "bench_gdn: bad option" "$G/bench_gdn" --no-such-option
