#!/usr/bin/env python3
"""Hand-made seeds for fuzz_safetensors, written byte by byte from the format
description (huggingface/safetensors README), not by dflash's writer.
Usage: make_st_seeds.py OUTDIR"""
import json, os, struct, sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
SEP = b"\n@@shard@@\n"


def st(header, buf, pad=True, hlen=None):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    n = len(h) if hlen is None else hlen
    return struct.pack("<Q", n) + h + buf


def put(name, b):
    with open(os.path.join(out, name), "wb") as f:
        f.write(b)


bf = struct.pack("<6H", *[0x3F80, 0x4000, 0xBF80, 0x0000, 0x7F80, 0x7FC0])
f32 = struct.pack("<f", 1.5)
put("ok-bf16.st", st({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}, bf))
put("ok-empty.st", st({}, b""))
put("ok-meta.st", st({"__metadata__": {"format": "pt"}, "s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, f32))
put("ok-zero-size.st", st({"z": {"dtype": "F16", "shape": [0, 5], "data_offsets": [0, 0]},
                           "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, f32))
put("ok-mixed.st", st({"i": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
                       "b": {"dtype": "BOOL", "shape": [2], "data_offsets": [8, 10]},
                       "f4": {"dtype": "F4", "shape": [4], "data_offsets": [10, 12]},
                       "h": {"dtype": "F16", "shape": [2], "data_offsets": [12, 16]}}, bytes(range(16))))
put("bad-overlap.st", st({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                          "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, bytes(6)))
put("bad-gap.st", st({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                      "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, bytes(6)))
put("bad-beyond.st", st({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
put("bad-huge-offsets.st", st({"a": {"dtype": "U8", "shape": [1], "data_offsets": [18446744073709551615, 0]}}, b"x"))
put("bad-shape-overflow.st", st({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 0]}}, b""))
put("bad-odd-f4.st", st({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"x"))
put("bad-9-dims.st", st({"a": {"dtype": "U8", "shape": [1] * 9, "data_offsets": [0, 1]}}, b"x"))
put("bad-meta.st", st({"__metadata__": [1]}, b""))
put("bad-hlen-huge.st", st({}, b"", hlen=1 << 40))
put("bad-hlen-past-end.st", st({}, b"", hlen=100))
put("bad-dup-key.st", struct.pack("<Q", 2 * 49) + (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},' +
                                                   b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}')[:98] + b"x")
put("bad-short.st", b"\x02\x00\x00")

# a sharded model directory: index, SEP, shard 1, SEP, shard 2
index = {"metadata": {"total_size": 16},
         "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors"}}
s1 = st({"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}, bf[:8])
s2 = st({"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
         "c": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32 + f32)
put("dir-ok.txt", json.dumps(index).encode() + SEP + s1 + SEP + s2)
bad = dict(index, weight_map={"a": "s2.safetensors", "b": "s2.safetensors", "c": "s9.safetensors"})
put("dir-bad-shard.txt", json.dumps(bad).encode() + SEP + s1 + SEP + s2)
put("dir-bad-slash.txt", json.dumps({"weight_map": {"a": "../s1.safetensors"}}).encode() + SEP + s1)
