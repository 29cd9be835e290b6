#!/usr/bin/env bash
# test_interop.sh: dflash-pack against an independent implementation of the
# stream spec (tests/interop/dfs_py.py: Python msgpack, lz4.frame, numpy and
# a pure-Python XXH64) and against the lz4 CLI.
source "$(dirname "$0")/lib.sh"
PY=/usr/bin/python3
DFS_PY=$here/tests/interop/dfs_py.py

check "python selftest (XXH64 vectors from libxxhash, shuffle example)" $PY "$DFS_PY" selftest

# Python writes (two segments, unknown keys and record types, LZ4 frames with
# linked and independent blocks, 64 KiB and 4 MiB blocks, content and block
# checksums, with and without content size); dflash-pack reads and verifies.
for enc in "--codec lz4 --shuffle" "--codec lz4" "--codec none"; do
    $PY "$DFS_PY" write "$T/py.dfs" "$T/py.json" $enc
    check "dflash-pack --verify reads python's stream ($enc)" dflash-pack --verify "$T/py.dfs"
    grep -q '^OK 4 records$' "$T/.out" && pass "verify counts 4 records ($enc)" || fail "verify count" "$(cat "$T/.out")"
    # Values survive copy, re-encoding and shuffling by dflash-pack, read back by Python.
    for args in "" "--compress lz4 --byte-shuffle on" "--compress lz4 --byte-shuffle off" "--compress none" "--shuffle --seed 3 --mem 1K"; do
        dflash-pack $args -o "$T/c.dfs" "$T/py.dfs" &&
            check "python reads dflash-pack $args output ($enc)" $PY "$DFS_PY" check "$T/c.dfs" "$T/py.json"
    done
done

# Export: .npy files read by numpy equal the values Python wrote.
$PY "$DFS_PY" write "$T/py.dfs" "$T/py.json" --codec lz4 --shuffle
check "export" dflash-pack --export "$T/npy" "$T/py.dfs"
check "numpy reads the export (bf16 exactly as float32)" $PY - "$T/npy" "$T/py.dfs" "$DFS_PY" <<'PYEOF'
import sys, os, glob, numpy as np
sys.path.insert(0, os.path.dirname(sys.argv[3]))
import dfs_py
out, stream = sys.argv[1], sys.argv[2]
dirs = sorted(glob.glob(os.path.join(out, "[0-9]*-*")))
samples = list(dfs_py.read_stream(stream))
assert len(dirs) == len(samples) == 4, (dirs, len(samples))
assert os.path.exists(os.path.join(out, "stream.json"))
for d, (_, h, arrays) in zip(dirs, samples):
    assert d.endswith("-" + h["id"]), (d, h["id"])
    for name, a in arrays.items():
        b = np.load(os.path.join(d, name + ".npy"))
        if a.dtype == np.uint16:  # bf16 bits: exported as float32 exactly
            a = (a.astype(np.uint32) << 16).view(np.float32)
        assert b.dtype == a.dtype and b.shape == a.shape, (name, b.dtype, a.dtype, b.shape, a.shape)
        assert a.tobytes() == b.tobytes(), name
PYEOF

# dflash-pack writes (datagen, 64 KiB independent frames); Python reads it and
# its digests equal those of dflash-pack's own export.
"$DFLASH_BUILD/tests/dfs_datagen" -n 3 -t 40 -H 16 -K 2 --target-ids --last-hidden -o "$T/g.dfs"
check "python reads dfs_datagen's stream" $PY "$DFS_PY" dump "$T/g.dfs"
[ "$(wc -l <"$T/.out")" -eq 3 ] && pass "python sees 3 samples" || fail "python sample count" "$(cat "$T/.out")"

# The lz4 CLI decodes a stored tensor, and the result is the byte shuffle of
# the raw values (as numpy computes it from dflash-pack's export).
$PY "$DFS_PY" stored "$T/g.dfs" 1 hidden >"$T/h.lz4"
if lz4 -dc "$T/h.lz4" >"$T/h.shuf" 2>/dev/null && $PY "$DFS_PY" shuffled "$T/g.dfs" 1 hidden | cmp -s - "$T/h.shuf"; then
    pass "lz4 CLI decodes a stored tensor like lz4.frame"
else
    fail "lz4 CLI decodes a stored tensor like lz4.frame"
fi
dflash-pack --export "$T/gx" "$T/g.dfs" >/dev/null
check "lz4 CLI output is the shuffle of the exported values" $PY - "$T/h.shuf" "$T/gx" <<'PYEOF'
import sys, glob, numpy as np
shuf = np.frombuffer(open(sys.argv[1], "rb").read(), dtype=np.uint8)
vals = np.load(glob.glob(sys.argv[2] + "/000001-*/hidden.npy")[0])      # float32 from bf16
bits = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
raw = np.frombuffer(bits, dtype=np.uint8)
out = np.empty_like(raw)
for off in range(0, len(raw), 65536):       # per 64 KiB block: low bytes, then high bytes
    blk = raw[off:off + 65536]
    m = len(blk) // 2
    out[off:off + 2 * m] = blk.reshape(m, 2).T.reshape(-1)
assert out.tobytes() == shuf.tobytes()
PYEOF

# The spec's example stream (formats/dflash-stream.md, "Example").
$PY "$DFS_PY" example "$T/ex.dfs"
check "dflash-pack verifies the spec example" dflash-pack --verify "$T/ex.dfs"
if cmp -s "$T/ex.dfs" "$here/tests/interop/example.dfs"; then pass "spec example bytes unchanged"; else fail "spec example bytes unchanged" "tests/interop/example.dfs differs from dfs_py.py example"; fi
