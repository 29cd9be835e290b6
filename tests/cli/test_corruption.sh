#!/usr/bin/env bash
# test_corruption.sh: dflash-pack --verify on damaged and hostile streams,
# through the command line: every cut and flip must exit 65 with a message
# (the exhaustive byte-by-byte sweep runs in-process in test_dfs_corrupt;
# here a dense sample of offsets goes through the tool). The normal build
# runs under `ulimit -v` so that any large allocation fails loudly; the ASan
# build caps single allocations with max_allocation_size_mb instead.
source "$(dirname "$0")/lib.sh"
PY=/usr/bin/python3
GEN=$DFLASH_BUILD/tests/dfs_datagen

if ldd "$(command -v dflash-pack)" 2>/dev/null | grep -q libasan; then
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}max_allocation_size_mb=64:allocator_may_return_null=1"
    limit() { "$@"; }
    step=37   # sanitizer runs are slower; the exhaustive sweep is in test_dfs_corrupt
else
    step=11
    limit() { (ulimit -v 262144; "$@"); }   # 256 MiB of address space
fi

$GEN -n 3 -t 10 -H 8 -K 2 --target-ids -o "$T/s.dfs"
size=$(stat -c %s "$T/s.dfs")
check "baseline verifies under the memory limit" limit dflash-pack --verify "$T/s.dfs"
[ "$size" -gt 1500 ] && [ "$size" -lt 4000 ] && pass "small stream ($size bytes)" || fail "stream size" "$size"

bad_cut=0 bad_flip=0 n=0
for ((off = 0; off < size; off += step)); do
    head -c $off "$T/s.dfs" >"$T/cut.dfs"
    limit dflash-pack --verify "$T/cut.dfs" >/dev/null 2>"$T/err"
    rc=$?
    if [ $rc -ne 65 ] || ! grep -q 'cut.dfs: ' "$T/err"; then bad_cut=$((bad_cut + 1)); echo "  cut at $off: exit $rc: $(cat "$T/err")"; fi
    cp "$T/s.dfs" "$T/flip.dfs"
    b=$(od -An -tu1 -j $off -N1 "$T/s.dfs" | tr -d ' ')
    printf "\\$(printf %o $((b ^ 0x5a)))" | dd of="$T/flip.dfs" bs=1 seek=$off conv=notrunc 2>/dev/null
    limit dflash-pack --verify "$T/flip.dfs" >/dev/null 2>"$T/err"
    rc=$?
    if [ $rc -ne 65 ]; then bad_flip=$((bad_flip + 1)); echo "  flip at $off: exit $rc: $(cat "$T/err")"; fi
    n=$((n + 1))
done
[ $bad_cut -eq 0 ] && pass "$n cuts each exit 65 with a message" || fail "cuts" "$bad_cut not refused cleanly"
[ $bad_flip -eq 0 ] && pass "$n flips each exit 65" || fail "flips" "$bad_flip not refused"

# Hand-made hostile records after a valid stream header, with valid header checksums.
$PY - "$T" "$T/s.dfs" "$here/tests/interop" <<'PYEOF'
import sys, struct
sys.path.insert(0, sys.argv[3])
import dfs_py
T, src = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
first = 16 + struct.unpack_from("<I", data, 4)[0]
def rec(hdr, claimed=None, payload=b""):
    return b"\x89DFS" + struct.pack("<IQ", len(hdr) if claimed is None else claimed, dfs_py.xxh64(hdr)) + hdr + payload
cases = {
    "len-max": rec(b"\x80", 0xFFFFFFFF),
    "len-cap": rec(b"\x80", 1 << 20),
    "array32": rec(b"\xdd\xff\xff\xff\xff"),
    "map32": rec(b"\xdf\xff\xff\xff\xff"),
    "nested-array32": rec(b"\x81\xa1t\xdd\x04\x00\x00\x00"),
    "str32": rec(b"\x81\xa1t\xdb\xff\xff\xff\xff"),
    "deep": rec(b"\x81\xa1t" + b"\x91" * 40 + b"\xc0"),
    "bad-magic": b"\x89DFX" + rec(b"\x80")[4:],
    "huge-payload": rec(dfs_py.msgpack.packb({"type": "sample", "payload": 60 << 30, "id": "x", "tensors": [
        {"name": "x", "dtype": "u8", "shape": [60 << 30], "codec": "none", "shuffle": False,
         "raw": 60 << 30, "stored": 60 << 30, "xxh64": 0}]}), None, b"\0" * 100),
    "unknown-type-huge": rec(dfs_py.msgpack.packb({"type": "future", "payload": 1 << 62}), None, b"\0" * 100),
    "lz4-expansion": rec(dfs_py.msgpack.packb({"type": "sample", "payload": 100, "id": "x", "tensors": [
        {"name": "x", "dtype": "u8", "shape": [256 * 100 + 65536], "codec": "lz4", "shuffle": False,
         "raw": 256 * 100 + 65536, "stored": 100, "xxh64": dfs_py.xxh64(b"\x04\x22\x4d\x18" + b"\0" * 96)}]}),
        None, b"\x04\x22\x4d\x18" + b"\0" * 96),
}
for name, r in cases.items():
    open("%s/h-%s.dfs" % (T, name), "wb").write(data[:first] + r)
hdr = dfs_py.msgpack.packb(dfs_py.stream_header({}, {"version": [2, 0]}))
open("%s/h-version2.dfs" % T, "wb").write(rec(hdr) + rec(dfs_py.msgpack.packb({"type": "end", "payload": 0, "records": 0})))
PYEOF
for f in "$T"/h-*.dfs; do
    name=$(basename "$f" .dfs)
    expect_exit 65 "hostile $name" limit dflash-pack --verify "$f"
done
expect_exit 65 "version 2 refused" dflash-pack --verify "$T/h-version2.dfs"
grep -q 'version 2.0 is not supported' "$T/.err" && pass "version refusal names both versions" || fail "version message" "$(cat "$T/.err")"

# Header values JSON cannot hold (NaN, infinities, integers past 2^63-1, bin)
# are refused with a message naming the field; jansson's json_real() gives
# NULL for NaN and infinities, and the reader once printed an unset buffer.
$PY - "$T" "$here/tests/interop" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[2])
from dfs_py import _record, stream_header, end_record
for name, meta in {"nan": {"f": float("nan")}, "ninf": {"t": {"x": [1, float("-inf")]}},
                   "u64": {"a": 2**64 - 1}, "bin": {"b": b"\0"}}.items():
    with open("%s/m-%s.dfs" % (sys.argv[1], name), "wb") as f:
        _record(f, stream_header(meta))
        end_record(f, 0)
PYEOF
for c in 'nan|meta "f" is NaN, not a finite number' 'ninf|meta "t.x[1]" is -Infinity, not a finite number' \
         'u64|meta "a" is an integer above 2^63-1' 'bin|meta "b" is of a type JSON cannot hold'; do
    name=${c%%|*} want=${c#*|}
    expect_exit 65 "meta $name refused" dflash-pack --verify "$T/m-$name.dfs"
    grep -qF "m-$name.dfs: byte 0 (record 0): stream header: $want" "$T/.err" && pass "meta $name names the field" ||
        fail "meta $name message" "$(cat -v "$T/.err")"
done

# A stored LZ4 frame that does not decode, under a checksum that matches (so
# reading passes): re-encoding finds it, and names the file, byte and record
# as the reader does (it used to name neither the file nor the record).
$PY - "$T/frame.dfs" "$here/tests/interop" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np
from dfs_py import _record, stream_header, encode, sample_record, end_record, xxh64
info, stored = encode("x", np.arange(100, dtype=np.int32), "i32", "lz4", False)
stored = stored[:4] + bytes([stored[4] ^ 0x40]) + stored[5:]   # the frame's version bits
info["xxh64"] = xxh64(stored)
with open(sys.argv[1], "wb") as f:
    _record(f, stream_header({}))
    sample_record(f, "c", [(info, stored)])
    end_record(f, 1)
PYEOF
expect_exit 65 "re-encoding a frame that does not decode" dflash-pack --compress none -o "$T/frame-out.dfs" "$T/frame.dfs"
grep -Eq 'frame.dfs: byte [0-9]+ \(record 1\): sample "c", tensor "x": bad LZ4 frame' "$T/.err" &&
    pass "  ... named in the reader's form" || fail "re-encode message" "$(cat "$T/.err")"
