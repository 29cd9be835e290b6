#!/usr/bin/env bash
# The GPU benchmarks and scripts (tests/gpu) on the CPU: they cannot be
# timed here, but they must build, run their tiny shapes through the CPU op
# table, start from the loss of a uniform guess, and report a missing CUDA
# device with exit code 69. The scripts must at least parse.
. "$(dirname "$0")/lib.sh"
# the benchmarks keep their buffers to the end, by design: no leak report
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=0"
G=$DFLASH_BUILD/gpu
if [ ! -x "$G/bench_train" ] || [ ! -x "$G/bench_extract" ]; then
    fail "setup" "no $G/bench_train or bench_extract (make check-build builds them)"
    exit 1
fi

check "bench_train --tiny on the CPU" sh -c "'$G/bench_train' --device cpu --tiny --steps 1 >'$T/train.txt'"
check "bench_train: step 0 loss is ln V at random init" python3 - "$T/train.txt" <<'PY'
import math, re, sys
t = open(sys.argv[1]).read()
m = re.search(r"step 0 weighted loss\s+([0-9.]+) \(ln V = ([0-9.]+)\)", t)
assert m, t
loss, lnv = float(m.group(1)), float(m.group(2))
assert abs(loss - lnv) < 0.05 * lnv, (loss, lnv)
for k in ("step time s", "model TFLOP per step", "MFU vs 989", "phase backward s"):
    assert k in t, k
PY
# --window: the layers but the last slide; their attention counts only the
# keys the window leaves (slot o: min(anchor, W - o - 1) + o + 1 <= W)
check "bench_train --tiny --window 5 on the CPU" sh -c "'$G/bench_train' --device cpu --tiny --steps 1 --window 5 >'$T/trainw.txt'"
check "bench_train --window: keys a row cut to the window, layers 0 .. L-2" python3 - "$T/trainw.txt" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
m = re.search(r"attention keys a row ([0-9.]+), window=5 on layers 0\.\.0 \(([0-9.]+) keys a row there\)", t)
assert m, t
full, win = float(m.group(1)), float(m.group(2))
assert 0 < win <= 5 < full, (full, win)
PY
expect_exit 2 "bench_train --window -1: usage error" "$G/bench_train" --device cpu --tiny --window -1

# bench_attn: attn_causal with a window and the lse against the one-row
# attn_dflash blocks it replaced (the same keys: the run fails if they differ)
for w in 0 5; do
    check "bench_attn --tiny --window $w on the CPU" sh -c "'$G/bench_attn' --device cpu --tiny --iters 1 --window $w >'$T/attn$w.txt'"
    check "bench_attn --window $w: the two ways agree" python3 - "$T/attn$w.txt" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
for k in ("attn_causal ms", "attn_causal TFLOP/s", "one-row blocks ms", "one-row blocks TFLOP/s", "speed-up"):
    assert re.search(re.escape(k) + r"\s+[0-9.e+-]+\n", t), (k, t)
assert float(re.search(r"outputs nmse\s+(\S+)", t).group(1)) < 1e-10, t
PY
done
if [ -x "$G/bench_attn_emu" ]; then # the tensor-core window kernel (emulated) against the one-row blocks
    check "bench_attn --window 5, CUDA kernels emulated: the two ways agree" \
        "$G/bench_attn_emu" --device cuda --tiny --iters 1 --window 5
fi
expect_exit 2 "bench_attn: --heads not a multiple of --kv-heads" "$G/bench_attn" --device cpu --heads 6 --kv-heads 4

check "bench_extract --tiny --download on the CPU" \
    sh -c "'$G/bench_extract' --device cpu --tiny --download --iters 1 >'$T/extract.txt'"
check "bench_extract: taps finite" grep -q "non-finite sampled tap values *0$" "$T/extract.txt"

# without a GPU (here), asking for cuda is "unavailable", exit 69, with a reason
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
    expect_exit 69 "bench_train --device cuda without a GPU: exit 69" "$G/bench_train" --tiny
    cp "$T/.err" "$T/cuda.err"
    check "... with CUDA's reason or 'built without CUDA'" grep -Eq "no CUDA device|without CUDA" "$T/cuda.err"
fi
expect_exit 2 "bench_train: bad option" "$G/bench_train" --no-such-option

# One whole training step through the CUDA kernels (run by the CPU
# emulation of tests/emu) against the CPU: every gradient tensor by nmse.
# Limit 2e-3: the CUDA backend stores activations in bf16 (the CPU in f32)
# and rounds attention probabilities and LM-head gradients to bf16; seen
# here: 3e-5 over all, 3e-4 for the worst tensor; a wrong gradient is ~1.
E=$G/bench_train_emu
if [ -x "$E" ]; then
    for cfg in tiny small; do
        check "bench_train --$cfg: one step on the CPU" "$E" --device cpu --$cfg --grad-out "$T/g-cpu-$cfg.bin"
        check "bench_train --$cfg: one step, CUDA kernels emulated" "$E" --device cuda --$cfg --grad-out "$T/g-cuda-$cfg.bin"
        check "bench_train --$cfg: gradients agree" \
            python3 "$here/tests/gpu/compare.py" grads "$T/g-cpu-$cfg.bin" "$T/g-cuda-$cfg.bin" 2e-3
        sed 's/^/    /' "$T/.out"
    done
    # a sliding window of 5 on layer 0: the window kernels' gradients
    check "bench_train --tiny --window 5: one step on the CPU" "$E" --device cpu --tiny --window 5 --grad-out "$T/g-cpu-w.bin"
    check "bench_train --tiny --window 5: one step, CUDA kernels emulated" \
        "$E" --device cuda --tiny --window 5 --grad-out "$T/g-cuda-w.bin"
    check "bench_train --tiny --window 5: gradients agree" \
        python3 "$here/tests/gpu/compare.py" grads "$T/g-cpu-w.bin" "$T/g-cuda-w.bin" 2e-3
    sed 's/^/    /' "$T/.out"
    check "bench_train --tiny: the window changes the gradients" sh -c \
        "! python3 '$here/tests/gpu/compare.py' grads '$T/g-cpu-tiny.bin' '$T/g-cpu-w.bin' 1e-3"
fi

for s in tests/gpu/run.sh tests/gpu/model_checks.sh tests/gpu/pack-deps.sh tests/gpu/score_trained.sh \
    tests/gpu/profile.sh tests/gpu/deps.sh; do
    check "bash -n $s" bash -n "$here/$s"
done
# profile.sh builds gemm_sweep.cu with nvcc on the GPU machine: it must build
NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
if [ -n "$NVCC" ]; then
    check "gemm_sweep.cu builds (nvcc, sm_90a)" "$NVCC" -O2 -std=c++17 -arch=sm_90a "$here/tests/gpu/gemm_sweep.cu" \
        -lcublasLt -lcublas -o "$T/gemm_sweep"
fi
# profile.sh and run.sh run wgmma_probe.cu first on the GPU: built against
# the emulation here, the kernels' layouts must hold, the four swapped ones
# fail (the probe can tell them apart) and the overlap's two groups in
# flight give both products; and it must build with nvcc
P=$DFLASH_BUILD/gpu/wgmma_probe_emu
if [ -x "$P" ]; then
    check "wgmma_probe (emulated): the kernels' layouts hold" sh -c "'$P' >'$T/probe.txt' 2>&1"
    check "wgmma_probe (emulated): 3 forms and 2 overlap rows ok, the 4 swapped layouts fail" sh -c \
        "test \$(grep -c ' ok (nmse' '$T/probe.txt') -eq 5 && test \$(grep -c '^overlap: .* ok (nmse' '$T/probe.txt') -eq 2 && test \$(grep -c 'swapped.* FAIL' '$T/probe.txt') -eq 4"
fi
if [ -n "$NVCC" ]; then
    check "wgmma_probe.cu builds (nvcc, sm_90a)" "$NVCC" -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a \
        -I"$here/lib" -I"$here/kernels" "$here/tests/gpu/wgmma_probe.cu" -o "$T/wgmma_probe"
fi
check "python scripts compile" python3 -m py_compile "$here/tests/gpu/compare.py" "$here/tests/gpu/torch_step.py"

# The online scoring benchmark of the GPU run, on the CPU with its smallest
# knobs: every tool of the recipe runs, and its report rows come out whole.
if [ -x "$DFLASH_BUILD/tests/mktarget" ]; then
    BIN=$DFLASH_BIN BUILD=$DFLASH_BUILD DEV=cpu SHAPE=tiny STEPS=2 N_TRAIN=4 NEW=8 N_EVAL=2 EVAL_NEW=8 \
        bash "$here/tests/gpu/score_trained.sh" >"$T/st.out" 2>"$T/st.err"
    rc=$?
    [ $rc -eq 0 ] && pass "score_trained.sh (tiny, cpu): runs" || fail "score_trained.sh (tiny, cpu): runs" "exit $rc: $(tail -5 "$T/st.err")"
    check "score_trained.sh: four rows (training, then three online runs), lossless, with numbers" python3 - "$T/st.out" <<'PY'
import re, sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1]) if l.startswith("RESULT|")]
assert len(rows) == 4, rows
assert re.match(r"[0-9.]+ steps/s$", rows[0][2]), rows[0]
for r in rows[1:]:
    assert re.match(r"[0-9.]+ tok/s$", r[2]), r
    m = re.search(r"plain greedy ([0-9.]+) tok/s; tau ([0-9.]+); speed-up ([0-9.]+); mismatches (\d+)$", r[3])
    assert m, r
    assert float(m.group(2)) >= 1 and m.group(4) == "0", r
PY
fi
