#!/usr/bin/env bash
# bench_ops_cpu.sh: the CPU op table beside PyTorch on the same shapes, same
# machine, same run, same thread count.
#
#   matmul          dflash matmul (OpenBLAS sgemm) vs torch.nn.functional.linear
#   attn_dflash     fwd, and fwd+bwd, vs scaled_dot_product_attention with the
#                   dense DFlash mask (SpecForge's SDPA path); fwd also vs
#                   flex_attention with the same mask (torch.compile, CPU has
#                   no flex backward). Set BENCH_FLEX=0 to skip its ~1 min compile.
#   attn_causal     vs scaled_dot_product_attention(is_causal=True)
#   lmhead_ce       loss + dh (chunked) vs logits = h w^T, cross_entropy, backward
#   matmul_grouped  a MoE layer's expert products, the weights f32 and bf16
#                   (the CPU keeps bf16 experts as bf16) vs a loop of F.linear
#                   over the experts in f32 (transformers' eager experts); with
#                   one expert, a dense layer's product (the CPU keeps every
#                   bf16 matrix of a target as bf16) vs F.linear in f32
#
# Times are process CPU time (all threads) of the best of REPS calls: the
# machine is shared, and CPU time is steadier there than wall time. Each line
# ends with the ratio torch/dflash: above 1 means dflash is faster.
#
# Env: DFLASH_BUILD (default build), BENCH_THREADS (default 1), BENCH_FLEX (1).
set -u
cd "$(dirname "$0")/../.."
build=${DFLASH_BUILD:-build}
threads=${BENCH_THREADS:-1}
bench=$build/tests/bench_ops_cpu
[ -x "$bench" ] || { echo "bench_ops_cpu: $bench not built (make check-build)"; exit 1; }
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
if ! python3 -c 'import torch' 2>/dev/null; then
    echo "bench_ops_cpu: torch not importable; dflash figures only"
    "$bench" matmul 512 2048 2048 3
    "$bench" dflash 512 32 16 32 8 128 3
    "$bench" causal 2048 32 8 128 2
    "$bench" lmhead 128 1024 32000 2
    "$bench" grouped 128 4 2048 768 3
    "$bench" grouped 1 16 4096 4096 3
    "$bench" grouped 1 64 4096 4096 3
    "$bench" grouped 1 65 4096 4096 3
    exit 0
fi

torch_bench() {
    python3 - "$threads" "${BENCH_FLEX:-1}" "$@" <<'EOF'
import sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
flex = sys.argv[2] == "1"
op, args = sys.argv[3], [int(a) for a in sys.argv[4:]]

def best(fn, reps):
    fn()
    b = 1e30
    for _ in range(reps):
        t = time.process_time(); fn(); b = min(b, time.process_time() - t)
    return b

if op == "matmul":
    M, K, N, reps = args
    x, w = torch.randn(M, K), torch.randn(N, K)
    print("matmul", best(lambda: F.linear(x, w), reps))
elif op == "dflash":
    S, nblk, B, Hq, Hkv, D, reps = args
    NK, nq = S + nblk * B, nblk * B
    anch = [int((j + 0.5) * S / nblk) for j in range(nblk)]  # as bench_ops_cpu.c
    mask = torch.zeros(nq, NK, dtype=torch.bool)
    for j, a in enumerate(anch):
        mask[j * B:(j + 1) * B, :a] = True
        mask[j * B:(j + 1) * B, S + j * B:S + (j + 1) * B] = True
    q = torch.randn(1, Hq, nq, D, requires_grad=True)
    k = torch.randn(1, Hkv, NK, D, requires_grad=True)
    v = torch.randn(1, Hkv, NK, D, requires_grad=True)
    do = torch.randn(1, Hq, nq, D)
    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    def both():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(do)
    print("dflash_fwd", best(fwd, reps))
    print("dflash_fwd_bwd", best(both, reps))
    if flex:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        at = torch.tensor(anch)
        def mask_mod(b, h, qi, kv):
            j = qi // B
            return ((kv < S) & (kv < at[j])) | ((kv >= S) & ((kv - S) // B == j))
        bm = create_block_mask(mask_mod, None, None, nq, NK, device="cpu")
        fa = torch.compile(flex_attention)
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        print("dflash_fwd_flex", best(lambda: fa(qd, kd, vd, block_mask=bm, enable_gqa=True), reps))
elif op == "causal":
    T, Hq, Hkv, D, reps = args
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    print("causal", best(fwd, reps))
elif op == "lmhead":
    N, H, V, reps = args
    h, w = torch.randn(N, H, requires_grad=True), torch.randn(V, H)
    labels = torch.randint(0, V, (N,))
    def ce():
        h.grad = None
        (F.cross_entropy(h @ w.T, labels, reduction="none") / N).sum().backward()
    print("lmhead_ce_grad", best(ce, reps))
elif op == "grouped":
    E, rows, K, N, reps = args
    x, w = torch.randn(E, rows, K), torch.randn(E, N, K)
    def experts():
        for e in range(E):
            F.linear(x[e], w[e])
    t = best(experts, reps)
    print("grouped_f32", t)
    print("grouped_bf16", t)
EOF
}

# compare LABEL DFLASH_ARGS...: run both, one line per (figure, torch variant)
compare() {
    local label=$1; shift
    local ours theirs
    ours=$("$bench" "$@") || { echo "$label: bench_ops_cpu failed"; return; }
    theirs=$(torch_bench "$@" 2>/dev/null)
    while read -r name secs gflops; do
        echo "$theirs" | while read -r tname tsecs; do
            local variant
            case "$tname" in
                "$name") variant=torch ;;
                "${name}_flex") variant=torch-flex ;;
                *) continue ;;
            esac
            awk -v n="$name" -v l="$label" -v s="$secs" -v g="$gflops" -v tv="$variant" -v ts="$tsecs" \
                'BEGIN { printf "%-15s %-27s dflash %8.4f s %6.1f GFLOP/s | %-10s %8.4f s | ratio %5.2f\n", n, l, s, g, tv, ts, ts / s }'
        done
    done <<<"$ours"
}

echo "bench_ops_cpu: $threads thread(s); times are CPU seconds per call (best of reps); ratio = torch / dflash"
compare "M512 K2048 N2048" matmul 512 2048 2048 3
compare "M2048 K1024 N3072" matmul 2048 1024 3072 2
compare "S512 nblk32 B16 32/8x128" dflash 512 32 16 32 8 128 3
compare "S2048 nblk128 B16 32/8x128" dflash 2048 128 16 32 8 128 1
compare "T2048 32/8x128" causal 2048 32 8 128 2
compare "N128 H1024 V32000" lmhead 128 1024 32000 2
# Qwen3-30B-A3B's experts (H 2048, width 768): a verify step's row or so
# per expert, and an extraction batch's hundreds
compare "E128 rows1 K2048 N768" grouped 128 1 2048 768 3
compare "E128 rows4 K2048 N768" grouped 128 4 2048 768 3
compare "E16 rows256 K2048 N768" grouped 16 256 2048 768 2
# a dense target's matrix (Qwen3-8B's q_proj): a decode step's row, a
# verify step's 16 rows (block 16), a short prefill's 64 rows (the most
# the few-rows kernel takes at this K), 65 rows (the fewest sgemm takes
# here), an extraction batch's 2048
compare "E1 rows1 K4096 N4096" grouped 1 1 4096 4096 5
compare "E1 rows16 K4096 N4096" grouped 1 16 4096 4096 5
compare "E1 rows64 K4096 N4096" grouped 1 64 4096 4096 3
compare "E1 rows65 K4096 N4096" grouped 1 65 4096 4096 3
compare "E1 rows2048 K4096 N4096" grouped 1 2048 4096 4096 2
