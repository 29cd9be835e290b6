#!/usr/bin/env bash
# tests/gpu/profile.sh: where the GPU time of the two benchmarks with goals
# goes (extraction, Qwen3-8B shape; the Qwen3-8B drafter's training step):
# the device time per op and per cuBLAS product shape (DFLASH_CUDA_PROFILE=1),
# the variants that wait for a measurement (the training step with dq
# recomputing, DFLASH_CUDA_DS_MAX_MB=0; both benchmarks with the attention
# on wgmma, DFLASH_CUDA_WGMMA=1 and 3, and without the forward's overlap,
# DFLASH_CUDA_WGMMA_PIPE=0), then every product shape timed as
# kernels/matmul.cu calls it against the algorithms cuBLASLt offers
# (tests/gpu/gemm_sweep.cu) and torch.matmul.
# Writes profile.log, smi.csv (clocks, power), shapes.txt, gemm_sweep.txt and
# torch_mm.txt under $OUT. About 90 s on an H200.
#
#   run(command="bash tests/gpu/profile.sh", carry=[".gpu-deps"], timeout_s=300)
#
# PROFILE_GEMM=0 skips the product sweep (gemm_sweep, torch.matmul);
# PROFILE_NCU=1 adds Nsight Compute on the attention kernels, mma.sync and
# wgmma (ncu_*.txt: occupancy, stall reasons), about 20 s more.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
B=$PWD/build-gpu
CORES=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 16)
LOG=$OUT/profile.log
: >"$LOG"
MAKEARGS=(-j"$CORES" BUILD="$B" BIN="$B/bin")
. tests/gpu/deps.sh
gpu_deps || { echo "profile.sh: no msgpack-c/lz4/jansson/xxhash/OpenBLAS: carry .gpu-deps (tests/gpu/pack-deps.sh)"; exit 1; }
step() { printf '\n===== %s (at %ss) =====\n' "$1" "$SECONDS" | tee -a "$LOG"; }
step build
make "${MAKEARGS[@]}" "$B/gpu/bench_extract" "$B/gpu/bench_train" "$B/tests/test_ops_cuda" >>"$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }
step "wgmma layout probe (tests/gpu/wgmma_probe.cu: the descriptors the attention kernels use, on the card)"
if nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Ilib -Ikernels tests/gpu/wgmma_probe.cu \
    -o "$B/wgmma_probe" >>"$LOG" 2>&1; then
    timeout 30 "$B/wgmma_probe" 2>&1 | tee -a "$LOG"
else
    echo "wgmma_probe did not build" | tee -a "$LOG"
fi
step "op agreement (test_ops_cuda, synced launches)"
DFLASH_CUDA_SYNC=1 timeout 60 "$B/tests/test_ops_cuda" >>"$LOG" 2>&1
echo "test_ops_cuda: exit $?, $(grep -c '^PASS' "$LOG") passed, $(grep -c '^FAIL' "$LOG") failed" | tee -a "$LOG"
nvcc -O2 -std=c++17 -arch=sm_90a tests/gpu/gemm_sweep.cu -lcublasLt -lcublas -o "$B/gemm_sweep" >>"$LOG" 2>&1 ||
    echo "gemm_sweep did not build" | tee -a "$LOG"
{ command -v nsys ncu; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv; } >>"$LOG" 2>&1

# clocks and power while the benchmarks run (is the card at its power limit?)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 >"$OUT/smi.csv" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT
step "bench_extract (plain, then profiled)"
"$B/gpu/bench_extract" --iters 3 2>&1 | tee -a "$LOG"
DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_extract" --iters 2 >>"$LOG" 2>&1
step "bench_train (plain, then profiled)"
"$B/gpu/bench_train" --steps 3 2>&1 | tee -a "$LOG"
DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_train" --steps 2 >>"$LOG" 2>&1
step "bench_extract, RMSNorm forward reading its rows twice (DFLASH_CUDA_NORM_REGS=0), profiled"
DFLASH_CUDA_NORM_REGS=0 DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_extract" --iters 2 2>&1 | tee -a "$LOG"
step "bench_train, dq recomputing S and dP (DFLASH_CUDA_DS_MAX_MB=0; the default reads the stored dS)"
DFLASH_CUDA_DS_MAX_MB=0 "$B/gpu/bench_train" --steps 3 2>&1 | tee -a "$LOG"
for wg in 1 3; do
    step "bench_extract, causal attention on wgmma (DFLASH_CUDA_WGMMA=$wg), plain then profiled"
    DFLASH_CUDA_WGMMA=$wg "$B/gpu/bench_extract" --iters 3 2>&1 | tee -a "$LOG"
    DFLASH_CUDA_WGMMA=$wg DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_extract" --iters 2 >>"$LOG" 2>&1
done
step "bench_train, DFlash attention forward and dk/dv on wgmma (DFLASH_CUDA_WGMMA=1), plain then profiled"
DFLASH_CUDA_WGMMA=1 "$B/gpu/bench_train" --steps 3 2>&1 | tee -a "$LOG"
DFLASH_CUDA_WGMMA=1 DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_train" --steps 2 >>"$LOG" 2>&1
step "the same two on wgmma without the forward's overlap (DFLASH_CUDA_WGMMA_PIPE=0), profiled"
DFLASH_CUDA_WGMMA=1 DFLASH_CUDA_WGMMA_PIPE=0 DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_extract" --iters 2 2>&1 | tee -a "$LOG"
DFLASH_CUDA_WGMMA=1 DFLASH_CUDA_WGMMA_PIPE=0 DFLASH_CUDA_PROFILE=1 "$B/gpu/bench_train" --steps 2 2>&1 | tee -a "$LOG"

step "Qwen3.5-27B attention layer (head dim 256), tensor cores"
make "${MAKEARGS[@]}" "$B/gpu/bench_gdn" >>"$LOG" 2>&1 && "$B/gpu/bench_gdn" --attn-only 2>&1 | tee -a "$LOG"

# every product of the two benchmarks (row-major M N K, layout, output, beta)
SHAPES=$OUT/shapes.txt
cat >"$SHAPES" <<'EOF'
# extraction, T = 16384
16384 4096 4096 nt bf16 0
16384 1024 4096 nt bf16 0
16384 6144 4096 nt bf16 0
16384 4096 4096 nt bf16 1
16384 12288 4096 nt bf16 0
16384 24576 4096 nt bf16 0
16384 4096 12288 nt bf16 1
# training forward, Q = 8192, S = 3072
8192 4096 4096 nt bf16 0
3072 1024 4096 nt bf16 0
8192 1024 4096 nt bf16 0
8192 12288 4096 nt bf16 0
8192 4096 12288 nt bf16 0
3072 4096 20480 nt bf16 0
1152 151936 4096 nt f32 0
# training backward: din (nn, bf16, beta 1), dW (tn, f32, beta 1), LM head dh
8192 12288 4096 nn bf16 1
8192 4096 12288 nn bf16 1
8192 4096 4096 nn bf16 1
3072 4096 1024 nn bf16 1
8192 4096 1024 nn bf16 1
1152 4096 151936 nn bf16 1
4096 12288 8192 tn f32 1
12288 4096 8192 tn f32 1
4096 4096 8192 tn f32 1
1024 4096 3072 tn f32 1
1024 4096 8192 tn f32 1
4096 20480 3072 tn f32 1
EOF
# Nsight Compute on the attention kernels: where their warps stall
if [ "${PROFILE_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    SECTIONS=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
    step "ncu: attn_causal_kernel (one launch of a mid layer)"
    timeout 120 ncu "${SECTIONS[@]}" --kernel-name regex:attn_causal_kernel --launch-skip 40 --launch-count 1 \
        "$B/gpu/bench_extract" --iters 1 >"$OUT/ncu_causal.txt" 2>&1
    tail -5 "$OUT/ncu_causal.txt" | tee -a "$LOG"
    step "ncu: the DFlash backward kernels (one layer)"
    timeout 120 ncu "${SECTIONS[@]}" --kernel-name regex:'attn_dflash_(dkdv|dq|dq_ds)_kernel' --launch-skip 10 \
        --launch-count 2 "$B/gpu/bench_train" --steps 1 >"$OUT/ncu_dflash.txt" 2>&1
    tail -5 "$OUT/ncu_dflash.txt" | tee -a "$LOG"
    # the same kernels on wgmma (DFLASH_CUDA_WGMMA=1)
    step "ncu: attn_causal_kernel on wgmma"
    DFLASH_CUDA_WGMMA=1 timeout 120 ncu "${SECTIONS[@]}" --kernel-name regex:attn_causal_kernel --launch-skip 40 \
        --launch-count 1 "$B/gpu/bench_extract" --iters 1 >"$OUT/ncu_causal_wg.txt" 2>&1
    tail -5 "$OUT/ncu_causal_wg.txt" | tee -a "$LOG"
    step "ncu: the DFlash backward kernels on wgmma"
    DFLASH_CUDA_WGMMA=1 timeout 120 ncu "${SECTIONS[@]}" --kernel-name regex:'attn_dflash_(dkdv|dq_ds)_kernel' \
        --launch-skip 10 --launch-count 2 "$B/gpu/bench_train" --steps 1 >"$OUT/ncu_dflash_wg.txt" 2>&1
    tail -5 "$OUT/ncu_dflash_wg.txt" | tee -a "$LOG"
fi
[ "${PROFILE_GEMM:-1}" = 1 ] || { step done; echo "profile.sh: $SECONDS s"; exit 0; }
step "gemm_sweep: GemmEx as called vs cuBLASLt's algorithms"
[ -x "$B/gemm_sweep" ] && "$B/gemm_sweep" <"$SHAPES" 2>&1 | tee "$OUT/gemm_sweep.txt" >>"$LOG"
step "torch.matmul, the same shapes"
python3 - "$SHAPES" <<'EOF' 2>&1 | tee "$OUT/torch_mm.txt" >>"$LOG"
import sys, torch
dev = "cuda"
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    M, N, K, lay, out, beta = line.split()
    M, N, K = int(M), int(N), int(K)
    a = (torch.rand(M, K, device=dev) - .5).bfloat16() if lay != "tn" else (torch.rand(K, M, device=dev) - .5).bfloat16()
    b = (torch.rand(N, K, device=dev) - .5).bfloat16() if lay == "nt" else (torch.rand(K, N, device=dev) - .5).bfloat16()
    f = {"nt": lambda: a @ b.t(), "nn": lambda: a @ b, "tn": lambda: a.t() @ b}[lay]
    for _ in range(2): f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10): f()
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 10
    print(f"{M} {N} {K} {lay} bf16-out: {ms:.3f} ms {2*M*N*K/ms/1e9:.1f} TFLOP/s")
EOF
step done
echo "profile.sh: $SECONDS s"
