#!/usr/bin/env bash
# test_oom.sh: running out of memory, on the CPU and on the (emulated) GPU,
# ends a tool with exit 70 and one line that names the tool, the size it
# could not get and what to lower, and leaves no output behind. The CPU
# runs under `ulimit -v` (the ASan build, which reserves terabytes of
# address space, caps single allocations instead); the GPU is the
# emulated device of tests/emu with DFLASH_EMU_DEVICE_BYTES of memory (only
# runs that fail early: the emulated kernels are slow at these sizes, and
# test_cuda_emu_model.sh runs the tools there to the end).
. "$(dirname "$0")/lib.sh"
PY=/usr/bin/python3

# A target whose MLP buffers are large beside everything else: intermediate
# 16384 at hidden 64, so 20 samples of 1000 tokens in one 20000-token batch
# want hundreds of MiB where the weights take 13 MB.
"$DFLASH_BUILD/tests/mktarget" -a qwen3 --hidden 64 --layers 2 --heads 2 --kv-heads 1 --head-dim 32 \
    --intermediate 16384 --vocab 256 --tie yes --seed 1 -o "$T/tgt" >/dev/null
$PY -c "
import json
for s in range(20): print(json.dumps({'id': s, 'input_ids': [(i * 7 + s) % 256 for i in range(1000)]}))" >"$T/in.jsonl"

if ldd "$(command -v dflash-extract)" 2>/dev/null | grep -q libasan; then
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}max_allocation_size_mb=32:allocator_may_return_null=1"
    limit() { "$@"; }
else
    # 600 MiB of address space beyond the program and its libraries (a
    # build with CUDA maps cuBLAS's hundreds of MiB even on --device cpu)
    x=$(command -v dflash-extract)
    maps_kib=$({ echo "$x"; ldd "$x" | awk '/=> \// { print $3 } /^\t\// { print $1 }'; } |
        xargs stat -L -c %s | awk '{ s += $1 } END { print int(s / 1024) }')
    limit() { (ulimit -v $((614400 + maps_kib)); "$@"); }
fi

# ---- the CPU -------------------------------------------------------------------
mkdir "$T/cpu"
limit dflash-extract -m "$T/tgt" -l 0,1 -b 20000 -t 1 -o "$T/cpu/out.dfs" "$T/in.jsonl" 2>"$T/err"
rc=$?
[ $rc -eq 70 ] && pass "CPU: out of memory exits 70" || fail "CPU: out of memory exits 70" "exit $rc: $(cat "$T/err")"
re='^dflash-extract: out of memory allocating [0-9]+\.[0-9] (MiB|GiB) \([0-9]+ bytes\); a forward.s buffers grow with --batch-tokens \(now 20000\)$'
grep -v '^==[0-9]*==WARNING: AddressSanitizer failed to allocate' "$T/err" >"$T/err1" # ASan's own line
[ "$(wc -l <"$T/err1")" -eq 1 ] && grep -Eq "$re" "$T/err1" &&
    pass "CPU: one line naming the tool, the size and --batch-tokens" || fail "CPU: the message" "$(cat "$T/err")"
[ -z "$(ls -A "$T/cpu")" ] && pass "CPU: no output and no temporary left" || fail "CPU: leftovers" "$(ls -A "$T/cpu")"

# ---- the emulated GPU ------------------------------------------------------------
E=$DFLASH_BUILD/emu/bin
if [ ! -x "$E/dflash-extract" ]; then
    echo "no emulated build in $DFLASH_BUILD (SAN builds have none): GPU checks skipped"
    exit 0
fi
mkdir "$T/gpu"
gpu() { # gpu DEVICE_BYTES BATCH: the emulated extraction on a device of that many bytes
    DFLASH_EMU_DEVICE_BYTES=$1 "$E/dflash-extract" -d cuda -m "$T/tgt" -l 0,1 -b "$2" -t 1 -o "$T/gpu/out.dfs" \
        "$T/in.jsonl" 2>"$T/err"
}
gpu 100000000 20000
rc=$?
re='^dflash-extract: out of GPU memory allocating [0-9]+\.[0-9] MiB \([0-9]+ bytes\), cuda:0 has [0-9]+\.[0-9] MiB free of 95\.4 MiB; a forward.s buffers grow with --batch-tokens \(now 20000\)$'
[ $rc -eq 70 ] && [ "$(wc -l <"$T/err")" -eq 1 ] && grep -Eq "$re" "$T/err" &&
    pass "GPU: exit 70, what the device has left, --batch-tokens" || fail "GPU: the batch" "exit $rc: $(cat "$T/err")"
[ -z "$(ls -A "$T/gpu")" ] && pass "GPU: no output and no temporary left" || fail "GPU: leftovers" "$(ls -A "$T/gpu")"
gpu 36000000 20000
rc=$?
re='^dflash-extract: out of GPU memory allocating .*, cuda:0 has .* free of 34\.3 MiB; while loading the target .*/tgt$'
[ $rc -eq 70 ] && grep -Eq "$re" "$T/err" && pass "GPU: out of memory while loading says so" ||
    fail "GPU: the load" "exit $rc: $(cat "$T/err")"
