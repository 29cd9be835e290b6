#!/usr/bin/env bash
# bench_stream.sh: DFS write/read throughput per core and compression ratio on
# bf16 activation-like data (dfs_datagen: per-channel log-normal scales, 4
# outlier channels per layer), beside `lz4 -1` and `zstd -1` (their -b
# benchmark modes, one thread) on exactly the same hidden-state bytes.
#
#   BENCH_MB=256 tests/bench/run.sh stream
#
# Throughput is raw tensor bytes per second on one thread ("xN": on N
# threads, the write with records encoded apart and written in order, as
# dflash-extract does, and the decode with each tensor's LZ4 blocks decoded
# at once, as the trainer's and scorer's readers do). "read" is parsing
# plus XXH64 of every tensor; "decode" adds LZ4 decompression and unshuffle
# into aligned buffers (what a trainer pays). Goal: decode >= 1500 MB/s per
# core, and lz4+shuffle compressing better than lz4 -1 on the same bytes.
set -eu
: "${BENCH_MB:=256}"
T=$(mktemp -d "${TMPDIR:-/tmp}/dflash-bench.XXXXXX")
trap 'rm -rf "$T"' EXIT
GEN=$DFLASH_BUILD/tests/dfs_datagen
H=4096 TOK=1024
recs=$(( BENCH_MB * 1048576 / (TOK * H * 2) ))
[ "$recs" -ge 1 ] || recs=1
args="--records $recs --tokens $TOK --hidden $H --layers 1 --seed 7"
$GEN $args --compress none -o "$T/none.dfs"
$GEN $args --raw -o "$T/hidden.bin"
raw_mb=$(( $(stat -c %s "$T/hidden.bin") / 1048576 ))
echo "data: $recs records x $TOK tokens x hidden $H bf16 = $raw_mb MiB of hidden states"
echo

"$DFLASH_BUILD/tests/dfs_bench" "$T/none.dfs" >"$T/dfs.tsv"
lz4_line=$(lz4 -b1 -i3 "$T/hidden.bin" 2>&1 | tr '\r' '\n' | grep -E 'MB/s.*MB/s' | tail -1)
zstd_line=$(zstd -b1 -i3 -T1 "$T/hidden.bin" 2>&1 | tr '\r' '\n' | grep -E 'MB/s.*MB/s' | tail -1)
# " =-hidden.bin : 268435456 -> 269490960 (0.996),9876.5 MB/s ,5432.1 MB/s" (zstd: "(x1.266)")
parse() { echo "$1" | sed -E 's/.*\(x?([0-9.]+)\), *([0-9.]+) MB\/s *, *([0-9.]+) MB\/s.*/\1 \2 \3/'; }
# The same bytes byte-shuffled in 64 KiB blocks, as DFS stores them: lz4 -1 with
# 64 KB blocks on these is the fair reference for DFS's lz4+shuffle speed.
/usr/bin/python3 - "$T/hidden.bin" "$T/shuffled.bin" <<'PY'
import sys, numpy as np
raw = np.fromfile(sys.argv[1], dtype=np.uint8)
out = np.empty_like(raw)
for off in range(0, len(raw), 65536):
    b = raw[off:off + 65536]; m = len(b) // 2
    out[off:off + 2 * m] = b.reshape(m, 2).T.reshape(-1)
out.tofile(sys.argv[2])
PY
lz4s_line=$(lz4 -b1 -i3 -B4 "$T/shuffled.bin" 2>&1 | tr '\r' '\n' | grep -E 'MB/s.*MB/s' | tail -1)
read -r lz4_ratio lz4_c lz4_d <<<"$(parse "$lz4_line")"
read -r lz4s_ratio lz4s_c lz4s_d <<<"$(parse "$lz4s_line")"
read -r zstd_ratio zstd_c zstd_d <<<"$(parse "$zstd_line")"

# Tool level: dflash-pack --verify (reads, checks, decodes every tensor) on the
# lz4+shuffle stream, from the page cache.
dflash-pack --compress lz4 --byte-shuffle on -o "$T/ls.dfs" "$T/none.dfs"
cat "$T/ls.dfs" >/dev/null
t0=$(date +%s.%N); dflash-pack --verify "$T/ls.dfs" >/dev/null; t1=$(date +%s.%N)
verify_mbps=$(echo "$raw_mb $t0 $t1" | awk '{printf "%.0f", $1 * 1.048576 / ($3 - $2)}')

awk -v lr="$lz4_ratio" -v lc="$lz4_c" -v ld="$lz4_d" -v sr="$lz4s_ratio" -v sc="$lz4s_c" -v sd="$lz4s_d" -v zr="$zstd_ratio" -v zc="$zstd_c" -v zd="$zstd_d" \
    -v vm="$verify_mbps" 'BEGIN { FS = "\t" }
NR == 1 { printf "%-22s %8s %8s %11s %11s %11s\n", "encoding (1 thread)", "ratio", "hidden", "write MB/s", "read MB/s", "decode MB/s"; next }
{ printf "%-22s %8.3f %8.3f %11.0f %11.0f %11.0f\n", "dfs " $1, $2, $3, $4, $5, $6; r[$1] = $3; d[$1] = $6 }
END {
    printf "%-22s %8s %8.3f %11.0f %11s %11.0f\n", "lz4 -1 (same bytes)", "", lr, lc, "", ld
    printf "%-22s %8s %8.3f %11.0f %11s %11.0f\n", "lz4 -1 -B4 (shuffled)", "", sr, sc, "", sd
    printf "%-22s %8s %8.3f %11.0f %11s %11.0f\n", "zstd -1 (same bytes)", "", zr, zc, "", zd
    printf "\n"
    printf "dfs lz4+shuffle ratio / lz4 -1 ratio:   %.3f  (goal > 1)\n", r["lz4+shuffle"] / lr
    printf "dfs lz4+shuffle ratio / zstd -1 ratio:  %.3f\n", r["lz4+shuffle"] / zr
    printf "dfs lz4+shuffle decode / lz4 -d speed on the shuffled bytes:  %.3f  (DFS adds XXH64, unshuffle, parsing)\n", d["lz4+shuffle"] / sd
    printf "dfs lz4+shuffle decode / zstd -d speed on the raw bytes: %.3f\n", d["lz4+shuffle"] / zd
    printf "dfs lz4+shuffle decode: %.0f MB/s per core (goal >= 1500)\n", d["lz4+shuffle"]
    printf "dflash-pack --verify of the lz4+shuffle stream: %.0f MB/s raw (whole tool, page cache)\n", vm
}' "$T/dfs.tsv"
