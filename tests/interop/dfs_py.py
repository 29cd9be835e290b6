#!/usr/bin/python3
"""dfs_py.py: an independent reader and writer of DFS streams, written from
formats/dflash-stream.md alone, for interoperability tests of dflash.

Uses only the standard library, python3-msgpack, python3-lz4 and
python3-numpy (Debian's /usr/bin/python3). XXH64 is implemented here in
pure Python from the public algorithm description (xxHash spec,
"XXH64 algorithm description"), so the checksums are checked by code that
shares nothing with dflash or libxxhash.

    dfs_py.py selftest                      XXH64 vectors, shuffle example
    dfs_py.py write OUT EXPECT.json [--seed N] [--codec none|lz4] [--shuffle]
                                            a stream of known values, their
                                            digests into EXPECT.json
    dfs_py.py check STREAM EXPECT.json      read STREAM, compare every
                                            tensor with EXPECT.json
    dfs_py.py dump STREAM                   one JSON line per sample
    dfs_py.py example OUT                   the spec's example stream
    dfs_py.py stored STREAM INDEX NAME      a tensor's stored bytes (stdout)
    dfs_py.py shuffled STREAM INDEX NAME    its shuffled raw bytes (stdout)
"""
import hashlib
import json
import struct
import sys

import lz4.frame
import msgpack
import numpy as np

# ---- XXH64 ------------------------------------------------------------------

P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
P3 = 0x165667B19E3779F9
P4 = 0x85EBCA77C2B2AE63
P5 = 0x27D4EB2F165667C5
M64 = (1 << 64) - 1


def _rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


def _round(acc, lane):
    acc = (acc + lane * P2) & M64
    return (_rotl(acc, 31) * P1) & M64


def _merge(acc, v):
    acc ^= _round(0, v)
    return (acc * P1 + P4) & M64


def xxh64(data, seed=0):
    data = bytes(data)
    n, i = len(data), 0
    if n >= 32:
        v1, v2, v3, v4 = (seed + P1 + P2) & M64, (seed + P2) & M64, seed, (seed - P1) & M64
        lanes = struct.unpack_from("<%dQ" % (4 * (n // 32)), data, 0)
        for k in range(0, len(lanes), 4):
            v1 = _round(v1, lanes[k])
            v2 = _round(v2, lanes[k + 1])
            v3 = _round(v3, lanes[k + 2])
            v4 = _round(v4, lanes[k + 3])
        i = 32 * (n // 32)
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & M64
        for v in (v1, v2, v3, v4):
            h = _merge(h, v)
    else:
        h = (seed + P5) & M64
    h = (h + n) & M64
    while i + 8 <= n:
        h ^= _round(0, struct.unpack_from("<Q", data, i)[0])
        h = (_rotl(h, 27) * P1 + P4) & M64
        i += 8
    if i + 4 <= n:
        h ^= (struct.unpack_from("<I", data, i)[0] * P1) & M64
        h = (_rotl(h, 23) * P2 + P3) & M64
        i += 4
    while i < n:
        h ^= (data[i] * P5) & M64
        h = (_rotl(h, 11) * P1) & M64
        i += 1
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    h = (h * P3) & M64
    h ^= h >> 32
    return h


# ---- format constants -------------------------------------------------------

MAGIC = b"\x89DFS"
MAX_HEADER = 1 << 20
MAX_TENSORS, MAX_DIMS, MAX_NAME, MAX_ID = 64, 8, 63, 4096
MAX_TENSOR_BYTES = 1 << 36
SHUFFLE_BLOCK = 65536
DTYPES = {"bf16": ("<u2", 2), "f16": ("<f2", 2), "f32": ("<f4", 4), "i32": ("<i4", 4), "i64": ("<i8", 8), "u8": ("|u1", 1)}


class StreamError(Exception):
    pass


def shuffle(raw, elem, inverse=False):
    """Byte shuffle per 64 KiB block of raw bytes: byte j of element i of a
    block of m elements goes to position j*m + i of the block."""
    raw = np.frombuffer(bytes(raw), dtype=np.uint8)
    out = np.empty_like(raw)
    for off in range(0, len(raw), SHUFFLE_BLOCK):
        blk = raw[off:off + SHUFFLE_BLOCK]
        m = len(blk) // elem
        if inverse:
            out[off:off + m * elem] = blk[:m * elem].reshape(elem, m).T.reshape(-1)
        else:
            out[off:off + m * elem] = blk[:m * elem].reshape(m, elem).T.reshape(-1)
        out[off + m * elem:off + len(blk)] = blk[m * elem:]
    return out.tobytes()


def max_stored(raw):
    return raw + 8 * ((raw + 65535) // 65536) + 65600


# ---- reader -----------------------------------------------------------------


def _utf8(s, what, limit):
    if not isinstance(s, str) or len(s.encode()) > limit or "\0" in s:
        raise StreamError("%s is not a UTF-8 string of at most %d bytes" % (what, limit))


def _uint(v, what):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise StreamError("%s is not an unsigned integer" % what)
    return v


def _read_exact(f, n, what):
    b = f.read(n)
    if len(b) != n:
        raise StreamError("truncated in the %s" % what)
    return b


def read_records(f):
    """Yield (offset, header map, payload bytes) for every record."""
    off = 0
    while True:
        pre = f.read(16)
        if not pre:
            return
        if len(pre) < 16:
            raise StreamError("byte %d: truncated record prefix" % off)
        if pre[:4] != MAGIC:
            raise StreamError("byte %d: bad magic" % off)
        n, want = struct.unpack("<IQ", pre[4:])
        if not 1 <= n <= MAX_HEADER:
            raise StreamError("byte %d: header length %d out of range" % (off, n))
        hb = _read_exact(f, n, "header")
        if xxh64(hb) != want:
            raise StreamError("byte %d: header checksum mismatch" % off)
        try:
            h = msgpack.unpackb(hb, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData) as e:
            raise StreamError("byte %d: bad msgpack header: %s" % (off, e))
        if not isinstance(h, dict) or not isinstance(h.get("type"), str):
            raise StreamError("byte %d: header is not a map with a type" % off)
        p = _uint(h.get("payload"), "payload")
        payload = _read_exact(f, p, "payload")
        yield off, h, payload
        off += 16 + n + p


def _tensor_info(t):
    if not isinstance(t, dict):
        raise StreamError("tensor is not a map")
    _utf8(t.get("name"), "name", MAX_NAME)
    if not t["name"]:
        raise StreamError("empty tensor name")
    if t.get("dtype") not in DTYPES or t.get("codec") not in ("none", "lz4") or not isinstance(t.get("shuffle"), bool):
        raise StreamError("tensor %s: bad dtype, codec or shuffle" % t["name"])
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise StreamError("tensor %s: bad shape" % t["name"])
    numel = 1
    for d in shape:
        numel *= _uint(d, "dimension")
    raw, stored = _uint(t.get("raw"), "raw"), _uint(t.get("stored"), "stored")
    _uint(t.get("xxh64"), "xxh64")
    if raw != numel * DTYPES[t["dtype"]][1] or raw > MAX_TENSOR_BYTES:
        raise StreamError("tensor %s: raw size does not match shape and dtype" % t["name"])
    if t["codec"] == "none" and (stored != raw or t["shuffle"]):
        raise StreamError("tensor %s: codec none needs stored == raw, no shuffle" % t["name"])
    if t["codec"] == "lz4" and (stored > max_stored(raw) or raw > 256 * stored + 65536):
        raise StreamError("tensor %s: impossible lz4 sizes" % t["name"])


def decode(t, stored):
    """The raw bytes of a tensor from its stored bytes."""
    if t["codec"] == "lz4":
        if stored[:4] != b"\x04\x22\x4d\x18":
            raise StreamError("tensor %s: not an LZ4 frame" % t["name"])
        d = lz4.frame.LZ4FrameDecompressor()
        raw = d.decompress(stored)
        if not d.eof or d.unused_data:
            raise StreamError("tensor %s: stored bytes are not exactly one LZ4 frame" % t["name"])
        if len(raw) != t["raw"]:
            raise StreamError("tensor %s: frame decodes to %d bytes, want %d" % (t["name"], len(raw), t["raw"]))
        if t["shuffle"]:
            raw = shuffle(raw, DTYPES[t["dtype"]][1], inverse=True)
        return raw
    return stored


def read_stream(path):
    """Yield (stream header, sample header, {name: numpy array}) per sample,
    checking every rule of the spec on the way."""
    with open(path, "rb") as f:
        first, in_segment, count = None, False, 0
        for off, h, payload in read_records(f):
            typ = h["type"]
            if typ == "stream":
                if in_segment:
                    raise StreamError("byte %d: stream header inside a segment" % off)
                if h.get("format") != "dflash-stream" or not isinstance(h.get("version"), list):
                    raise StreamError("byte %d: not a dflash-stream header" % off)
                if h["version"][0] != 1:
                    raise StreamError("byte %d: unsupported major version %d" % (off, h["version"][0]))
                if not isinstance(h.get("meta"), dict):
                    raise StreamError("byte %d: meta is not a map" % off)
                first = first or h
                in_segment, count = True, 0
            elif not in_segment:
                raise StreamError("byte %d: %s record outside a segment" % (off, typ))
            elif typ == "end":
                if _uint(h.get("records"), "records") != count:
                    raise StreamError("byte %d: end record count %d != %d" % (off, h["records"], count))
                in_segment = False
            elif typ == "sample":
                _utf8(h.get("id"), "id", MAX_ID)
                ts = h.get("tensors")
                if not isinstance(ts, list) or len(ts) > MAX_TENSORS:
                    raise StreamError("byte %d: bad tensors" % off)
                for t in ts:
                    _tensor_info(t)
                if len({t["name"] for t in ts}) != len(ts):
                    raise StreamError("byte %d: duplicate tensor names" % off)
                if sum(t["stored"] for t in ts) != len(payload):
                    raise StreamError("byte %d: payload does not match the tensors" % off)
                arrays, pos = {}, 0
                for t in ts:
                    stored = payload[pos:pos + t["stored"]]
                    pos += t["stored"]
                    if xxh64(stored) != t["xxh64"]:
                        raise StreamError("byte %d: tensor %s checksum mismatch" % (off, t["name"]))
                    raw = decode(t, stored)
                    arrays[t["name"]] = np.frombuffer(raw, dtype=DTYPES[t["dtype"]][0]).reshape(t["shape"])
                count += 1
                yield first, h, arrays
            # any other record type: skipped (its payload was read and dropped)
        if first is None:
            raise StreamError("empty input")
        if in_segment:
            raise StreamError("truncated: no end record")


# ---- writer -----------------------------------------------------------------


def _record(f, header, payload=b""):
    hb = msgpack.packb(header, use_bin_type=True)
    f.write(MAGIC + struct.pack("<IQ", len(hb), xxh64(hb)) + hb + payload)


def stream_header(meta, extra=None):
    h = {"type": "stream", "payload": 0, "format": "dflash-stream", "version": [1, 0],
         "producer": "dfs_py.py", "created": "2026-01-01T00:00:00Z", "meta": meta}
    h.update(extra or {})
    return h


def encode(name, arr, dtype, codec, shuf, frame_opts=None):
    raw = np.ascontiguousarray(arr).astype(DTYPES[dtype][0], copy=False).tobytes()
    elem = DTYPES[dtype][1]
    shuf = bool(shuf and codec == "lz4" and elem > 1)
    if codec == "lz4":
        stored = lz4.frame.compress(shuffle(raw, elem) if shuf else raw, **(frame_opts or {}))
    else:
        stored = raw
    info = {"name": name, "dtype": dtype, "shape": list(arr.shape), "codec": codec, "shuffle": shuf,
            "raw": len(raw), "stored": len(stored), "xxh64": xxh64(stored)}
    return info, stored


def sample_record(f, sid, tensors, extra=None):
    infos, payload = [], b""
    for info, stored in tensors:
        infos.append(info)
        payload += stored
    h = {"type": "sample", "payload": len(payload), "id": sid, "tensors": infos}
    h.update(extra or {})
    _record(f, h, payload)


def end_record(f, n):
    _record(f, {"type": "end", "payload": 0, "records": n})


def bf16(x):
    """float32 -> bf16 bits, round to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def known_samples(seed):
    """Samples with every dtype; one bf16 tensor crosses 64 KiB blocks."""
    rng = np.random.RandomState(seed)
    out = []
    for k in range(3):
        T = 5 + 7 * k
        ids = rng.randint(0, 32000, size=T).astype(np.int32)
        mask = (np.arange(T) >= 2).astype(np.uint8)
        hidden = bf16(rng.standard_normal((T, 24)) * np.exp(rng.standard_normal(24) * 0.5))
        out.append(("py-%d" % k, [("input_ids", ids, "i32"), ("loss_mask", mask, "u8"), ("hidden", hidden, "bf16"),
                                  ("f16", rng.standard_normal((3, 4)).astype(np.float16), "f16"),
                                  ("f32", rng.standard_normal((2, 3, 2)).astype(np.float32), "f32"),
                                  ("i64", rng.randint(-2**40, 2**40, size=4).astype(np.int64), "i64"),
                                  ("scalar", np.array(3.5, dtype=np.float32), "f32"),
                                  ("empty", np.zeros((0, 3), dtype=np.int32), "i32")]))
    big = bf16(rng.standard_normal(70001) * 3)
    out.append(("py-big", [("hidden", big.reshape(70001, 1), "bf16")]))
    return out


def digest(arr):
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def cmd_write(out, expect, seed, codec, shuf):
    samples = known_samples(seed)
    meta = {"purpose": "interop", "layer_ids": [1, 2]}
    frame_variants = [{}, {"block_size": lz4.frame.BLOCKSIZE_MAX4MB, "content_checksum": True},
                      {"block_linked": False, "store_size": False}, {"block_checksum": True}]
    with open(out, "wb") as f:
        # segment 1: the first two samples, with keys and a record type the
        # reader does not know (it must ignore and skip them)
        f.write(b"")
        _record(f, stream_header(meta, {"x-future": {"a": [1, 2.5, None]}}))
        for i, (sid, ts) in enumerate(samples[:2]):
            enc = [encode(n, a, dt, codec, shuf, frame_variants[(i + j) % 4]) for j, (n, a, dt) in enumerate(ts)]
            enc[0][0]["x-note"] = "ignored"
            sample_record(f, sid, enc, {"x-extra": True})
            _record(f, {"type": "x-index", "payload": 5, "entries": [1]}, b"12345")
        end_record(f, 2)
        # segment 2: the rest
        _record(f, stream_header(meta))
        for sid, ts in samples[2:]:
            sample_record(f, sid, [encode(n, a, dt, codec, shuf) for n, a, dt in ts])
        end_record(f, len(samples) - 2)
    with open(expect, "w") as f:
        json.dump({sid: {n: {"dtype": dt, "shape": list(a.shape), "sha256": digest(a)} for n, a, dt in ts}
                   for sid, ts in samples}, f, indent=1)


def cmd_check(path, expect):
    want = json.load(open(expect))
    seen = set()
    for _, h, arrays in read_stream(path):
        sid = h["id"]
        if sid not in want:
            raise StreamError("unexpected sample %s" % sid)
        for name, w in want[sid].items():
            a = arrays.get(name)
            if a is None or list(a.shape) != w["shape"] or digest(a) != w["sha256"]:
                raise StreamError("sample %s tensor %s differs from the values written" % (sid, name))
        seen.add(sid)
    if seen != set(want):
        raise StreamError("samples missing: %s" % sorted(set(want) - seen))
    print("OK %d samples match" % len(seen))


def cmd_dump(path):
    for _, h, arrays in read_stream(path):
        print(json.dumps({"id": h["id"], "tensors": {
            n: {"dtype": t["dtype"], "codec": t["codec"], "shuffle": t["shuffle"], "shape": t["shape"],
                "sha256": digest(arrays[n])} for n, t in ((t["name"], t) for t in h["tensors"])}}))


def cmd_example(out):
    """The spec's example: one sample, input_ids i32 [3] raw, hidden bf16
    [3, 2] lz4 + shuffle (1, 2, -1, 0.5, -2, 3)."""
    meta = {"note": "example"}
    with open(out, "wb") as f:
        h = stream_header(meta)
        h["producer"] = "example"
        _record(f, h)
        ids = np.array([101, 102, 103], dtype=np.int32)
        hid = bf16(np.array([[1, 2], [-1, 0.5], [-2, 3]], dtype=np.float32))
        sample_record(f, "ex-0", [encode("input_ids", ids, "i32", "none", False),
                                  encode("hidden", hid, "bf16", "lz4", True,
                                         {"block_linked": False, "store_size": True})])
        end_record(f, 1)


def tensor_of(path, index, name):
    with open(path, "rb") as f:
        k = 0
        for _, h, payload in read_records(f):
            if h["type"] != "sample":
                continue
            if k == index:
                pos = 0
                for t in h["tensors"]:
                    if t["name"] == name:
                        return t, payload[pos:pos + t["stored"]]
                    pos += t["stored"]
            k += 1
    raise StreamError("no tensor %s in sample %d" % (name, index))


def selftest():
    vectors = [(b"", 0, 0xEF46DB3751D8E999), (b"a", 0, 0xD24EC4F1A98C6E5B), (b"abc", 0, 0x44BC2CF5AD770999),
               (b"0123456789abcdef0123456789abcdef0123456789", 0, 0xA76190C3ACF08A1C),
               (bytes(range(256)) * 3, 0, 0x8E03C838C596036F), (bytes(range(256)) * 3, 123456789, 0x057B7950FE218529),
               (b"a", 123456789, 0x2A565CD10118594A)]
    for data, seed, want in vectors:
        got = xxh64(data, seed)
        if got != want:
            raise StreamError("xxh64 of %d bytes seed %d: %016x, want %016x" % (len(data), seed, got, want))
    # the spec's worked example: bf16 1, 2, -1
    if shuffle(bytes([0x80, 0x3F, 0x00, 0x40, 0x80, 0xBF]), 2) != bytes([0x80, 0x00, 0x80, 0x3F, 0x40, 0xBF]):
        raise StreamError("shuffle example")
    x = bytes(range(256)) * 300
    if shuffle(shuffle(x, 4), 4, inverse=True) != x:
        raise StreamError("shuffle round trip")
    print("OK selftest")


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    cmd, args = argv[1], argv[2:]
    try:
        if cmd == "selftest":
            selftest()
        elif cmd == "write":
            seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 1
            codec = args[args.index("--codec") + 1] if "--codec" in args else "lz4"
            cmd_write(args[0], args[1], seed, codec, "--shuffle" in args)
        elif cmd == "check":
            cmd_check(args[0], args[1])
        elif cmd == "dump":
            cmd_dump(args[0])
        elif cmd == "example":
            cmd_example(args[0])
        elif cmd in ("stored", "shuffled"):
            t, stored = tensor_of(args[0], int(args[1]), args[2])
            if cmd == "shuffled":
                stored = lz4.frame.decompress(stored) if t["codec"] == "lz4" else stored
            sys.stdout.buffer.write(stored)
        else:
            print(__doc__)
            return 2
    except StreamError as e:
        print("dfs_py.py: %s" % e, file=sys.stderr)
        return 65
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
