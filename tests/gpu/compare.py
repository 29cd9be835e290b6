#!/usr/bin/env python3
"""compare.py: compare a tool's outputs on two devices (tests/gpu/model_checks.sh).

  compare.py npy DIR_A DIR_B NAME=LIMIT...   dflash-pack --export trees: float
        tensors by nmse = sum (b-a)^2 / sum a^2 over all samples (A is the
        reference), integer ones by the fraction that agree (LIMIT a
        fraction, or 'exact')
  compare.py logs A.log B.log KEY=REL...     JSON-lines logs, step by step:
        max relative difference of each KEY
  compare.py safetensors A B LIMIT           every tensor by nmse; the worst
  compare.py grads A.bin B.bin LIMIT         bench_train --grad-out files (f32,
        tensors listed in A.bin.json): every tensor by nmse; the worst
Prints one line per quantity; exits 1 when one is over its limit.
"""
import json
import os
import struct
import sys

import numpy as np


def load_npy_tree(d):
    out = {}
    for sub in sorted(os.listdir(d)):
        p = os.path.join(d, sub)
        if not os.path.isdir(p):
            continue
        for f in sorted(os.listdir(p)):
            if f.endswith(".npy"):
                out.setdefault(f[:-4], []).append(np.load(os.path.join(p, f)))
    return out


def nmse(a, b):
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    den = float((a * a).sum())
    num = float(((b - a) ** 2).sum())
    return num / den if den > 0 else num


def cmp_npy(da, db, limits):
    A, B = load_npy_tree(da), load_npy_tree(db)
    bad = 0
    for spec in limits:
        name, lim = spec.split("=")
        if name not in A or name not in B or len(A[name]) != len(B[name]):
            print("%s: missing or different sample count" % name)
            bad += 1
            continue
        a = np.concatenate([x.ravel() for x in A[name]])
        b = np.concatenate([x.ravel() for x in B[name]])
        if a.dtype.kind == "f":
            e = nmse(a, b)
            ok = np.isfinite(b).all() and e <= float(lim)
            print("%s nmse %.3g (limit %s)%s" % (name, e, lim, "" if ok else "  OVER"))
        else:
            agree = float((a == b).mean()) if a.size else 1.0
            need = 1.0 if lim == "exact" else float(lim)
            ok = agree >= need
            print("%s agree %.4f (need %s)%s" % (name, agree, lim, "" if ok else "  UNDER"))
        bad += not ok
    return bad


def cmp_logs(fa, fb, limits):
    A = [json.loads(x) for x in open(fa) if x.strip()]
    B = [json.loads(x) for x in open(fb) if x.strip()]
    if len(A) != len(B) or not A:
        print("logs: %d vs %d steps" % (len(A), len(B)))
        return 1
    bad = 0
    for spec in limits:
        k, lim = spec.split("=")
        rel = max(abs(b[k] - a[k]) / max(abs(a[k]), 1e-30) for a, b in zip(A, B))
        ok = rel <= float(lim)
        print("%s max rel. diff %.3g over %d steps (limit %s), %s" % (
            k, rel, len(A), lim, ", ".join("%.5g/%.5g" % (a[k], b[k]) for a, b in zip(A, B))) + ("" if ok else "  OVER"))
        bad += not ok
    return bad


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, t in head.items():
            if name == "__metadata__":
                continue
            f.seek(base + t["data_offsets"][0])
            raw = f.read(t["data_offsets"][1] - t["data_offsets"][0])
            if t["dtype"] == "BF16":
                v = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif t["dtype"] == "F32":
                v = np.frombuffer(raw, dtype=np.float32)
            elif t["dtype"] == "F16":
                v = np.frombuffer(raw, dtype=np.float16)
            else:
                continue
            out[name] = v
        return out


def cmp_safetensors(fa, fb, lim):
    A, B = read_safetensors(fa), read_safetensors(fb)
    if set(A) != set(B):
        print("tensor names differ")
        return 1
    worst = max((nmse(A[k], B[k]), k) for k in A)
    ok = worst[0] <= float(lim)
    print("worst tensor nmse %.3g (%s), limit %s, %d tensors%s" % (worst[0], worst[1], lim, len(A), "" if ok else "  OVER"))
    return 0 if ok else 1


def cmp_grads(fa, fb, lim):
    a, b = np.fromfile(fa, dtype=np.float32), np.fromfile(fb, dtype=np.float32)
    layout = json.load(open(fa + ".json"))
    if a.size != b.size or not np.isfinite(b).all():
        print("gradients: sizes %d vs %d or non-finite values" % (a.size, b.size))
        return 1
    errs = sorted(((nmse(a[o:o + n], b[o:o + n]), k) for k, (o, n) in layout.items()), reverse=True)
    ok = errs[0][0] <= float(lim)
    print("gradient nmse: all %.3g; worst tensor %.3g (%s), limit %s; next %s%s" % (
        nmse(a, b), errs[0][0], errs[0][1], lim, ", ".join("%s %.2g" % (k, e) for e, k in errs[1:4]),
        "" if ok else "  OVER"))
    return 0 if ok else 1


def main():
    mode = sys.argv[1]
    if mode == "npy":
        bad = cmp_npy(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif mode == "logs":
        bad = cmp_logs(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif mode == "safetensors":
        bad = cmp_safetensors(sys.argv[2], sys.argv[3], sys.argv[4])
    elif mode == "grads":
        bad = cmp_grads(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit("compare.py: unknown mode " + mode)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
