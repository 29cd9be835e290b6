"""The PyTorch side of tests/bench/bench_train.sh: the same DFlash training
step as dflash-train-step (same drafter shape, same sequences, same anchors
per sequence, same loss, clip and AdamW), written the way the Python trainers
do it: each sequence's full context plus its blocks in one dense masked SDPA
call (batched over the step's sequences), full logits, autograd.

usage: bench_train.py DRAFTER_CONFIG TARGET_DIR EXPORT_DIR THREADS STEPS ANCHORS BATCH
prints: "steps S seconds X block_tokens N" for the timed steps (the first step,
warm-up, excluded).
"""
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch
from safetensors import safe_open

cfg_path, target_dir, export_dir = sys.argv[1:4]
threads, steps, anchors, batch = (int(x) for x in sys.argv[4:8])
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = json.load(open(cfg_path))
H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
B, K = cfg["block_size"], len(cfg["dflash_config"]["target_layer_ids"])
MASK, eps, gamma = cfg["dflash_config"]["mask_token_id"], cfg["rms_norm_eps"], 7.0

with safe_open(os.path.join(target_dir, "model.safetensors"), "pt") as f:
    embed = f.get_tensor("model.embed_tokens.weight").float()
    lm_head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else embed

seqs = []
for d in sorted(glob.glob(os.path.join(export_dir, "*/"))):
    if not os.path.exists(os.path.join(d, "hidden.npy")):
        continue
    seqs.append({k: torch.from_numpy(np.load(os.path.join(d, k + ".npy")))
                 for k in ("input_ids", "loss_mask", "hidden")})


def lin(o, i):
    return torch.nn.Parameter(torch.randn(o, i) * 0.02)


def ones(n):
    return torch.nn.Parameter(torch.ones(n))


P = {"fc": lin(H, K * H), "hn": ones(H), "norm": ones(H)}
for l in range(L):
    P.update({f"{l}.q": lin(Hq * D, H), f"{l}.k": lin(Hkv * D, H), f"{l}.v": lin(Hkv * D, H),
              f"{l}.o": lin(H, Hq * D), f"{l}.qn": ones(D), f"{l}.kn": ones(D), f"{l}.ln1": ones(H),
              f"{l}.ln2": ones(H), f"{l}.g": lin(I, H), f"{l}.u": lin(I, H), f"{l}.d": lin(H, I)})
opt = torch.optim.AdamW(P.values(), lr=6e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2).float() / D))


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos):  # x [b, h, n, D], pos [b, n]
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def batch_of(group):
    """Anchors (uniform subset of the candidates, sorted), block tokens,
    positions, labels, weights and the boolean mask of spec §2.5."""
    ids = torch.stack([s["input_ids"].long() for s in group])
    lm = torch.stack([s["loss_mask"].long() for s in group])
    hid = torch.stack([s["hidden"].float() for s in group])
    b, S = ids.shape
    anc = []
    for r in range(b):
        cand = torch.nonzero((lm[r, :-1] == 1) & (lm[r, 1:] == 1))[:, 0]
        anc.append(cand[torch.randperm(len(cand))[:anchors]].sort().values)
    A = torch.stack(anc)                                      # [b, N] (equal counts here)
    N = A.shape[1]
    offs = torch.arange(B)
    pos = (A[..., None] + offs).reshape(b, N * B)              # [b, Q]
    tok = torch.full((b, N, B), MASK)
    tok[:, :, 0] = ids.gather(1, A)
    tok = tok.reshape(b, N * B)
    valid = (pos < S) & (offs.repeat(N)[None] > 0)
    lab = ids.gather(1, pos.clamp(max=S - 1))
    valid &= lm.gather(1, pos.clamp(max=S - 1)) == 1
    w = torch.exp(-(offs.repeat(N).float() - 1) / gamma)[None] * valid
    j = torch.arange(N * B) // B
    ctx_ok = torch.arange(S)[None, None] < A.gather(1, j[None].expand(b, -1))[..., None]   # [b, Q, S]
    blk_ok = (j[:, None] == j[None, :])[None].expand(b, -1, -1)                             # [b, Q, Q]
    mask = torch.cat([ctx_ok, blk_ok], -1)[:, None]                                          # [b, 1, Q, S+Q]
    return hid, tok, pos, lab, w, mask, S


def step(group, i, total):
    hid, tok, pos, lab, w, mask, S = batch_of(group)
    b, Q = tok.shape
    ctx = rms(hid @ P["fc"].T, P["hn"])
    h = embed[tok]
    kpos = torch.cat([torch.arange(S)[None].expand(b, -1), pos], 1)
    for l in range(L):
        x = rms(h, P[f"{l}.ln1"])
        q = rope(rms((x @ P[f"{l}.q"].T).view(b, Q, Hq, D), P[f"{l}.qn"]).transpose(1, 2), pos)
        kv = torch.cat([ctx, x], 1)
        k = rope(rms((kv @ P[f"{l}.k"].T).view(b, S + Q, Hkv, D), P[f"{l}.kn"]).transpose(1, 2), kpos)
        v = (kv @ P[f"{l}.v"].T).view(b, S + Q, Hkv, D).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = h + o.transpose(1, 2).reshape(b, Q, Hq * D) @ P[f"{l}.o"].T
        y = rms(h, P[f"{l}.ln2"])
        h = h + (torch.nn.functional.silu(y @ P[f"{l}.g"].T) * (y @ P[f"{l}.u"].T)) @ P[f"{l}.d"].T
    logits = rms(h, P["norm"]) @ lm_head.T
    ce = torch.nn.functional.cross_entropy(logits.reshape(b * Q, -1), lab.reshape(-1), reduction="none")
    loss = (ce * w.reshape(-1)).sum() / w.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
    W = int(0.04 * total)
    for g in opt.param_groups:
        g["lr"] = 6e-4 * ((i + 1) / W if i < W else 0.5 * (1 + math.cos(math.pi * (i - W) / max(1, total - W))))
    opt.step()
    return b * Q


k = 0
groups = []
for i in range(steps + 1):
    groups.append([seqs[(k + r) % len(seqs)] for r in range(batch)])
    k += batch
step(groups[0], 0, steps + 1)  # warm-up
t0 = time.perf_counter()
blk = 0
for i in range(1, steps + 1):
    blk += step(groups[i], i, steps + 1)
dt = time.perf_counter() - t0
print(f"steps {steps} seconds {dt:.4f} block_tokens {blk}")
