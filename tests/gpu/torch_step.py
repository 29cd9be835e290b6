#!/usr/bin/env python3
"""torch_step.py: the training step of bench_train.c in PyTorch, to time the
two side by side on the same GPU (tests/gpu/run.sh).

The same model and data shapes (Qwen3-8B DFlash drafter: 5 layers, hidden
4096, 32/8 heads of 128, intermediate 12288, vocab 151936, 5 taps; one
3072-token sample, 512 anchors of 16), written as the reference trainers
do (SpecForge: fp32 master weights with bf16 autocast, flex_attention with a
block mask for the DFlash mask, the frozen target LM head, cross-entropy
weighted exp(-(k-1)/7), clip to norm 1, AdamW). FLOPs are counted with the
formula of bench_train.c, so TFLOP/s and MFU compare like with like.

  python3 tests/gpu/torch_step.py [--steps 3] [--tiny] [--sdpa]

Prints key/value lines like bench_train. Needs a CUDA device.
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


def rope_cos_sin(pos, d, theta, dtype):
    inv = theta ** (-torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    f = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):  # x [T, h, d]; NeoX pairing (i, i + d/2)
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class Layer(nn.Module):
    def __init__(s, H, HQ, HKV, D, I):
        super().__init__()
        s.HQ, s.HKV, s.D = HQ, HKV, D
        s.q = nn.Linear(H, HQ * D, bias=False)
        s.k = nn.Linear(H, HKV * D, bias=False)
        s.v = nn.Linear(H, HKV * D, bias=False)
        s.o = nn.Linear(HQ * D, H, bias=False)
        s.gate = nn.Linear(H, I, bias=False)
        s.up = nn.Linear(H, I, bias=False)
        s.down = nn.Linear(I, H, bias=False)
        s.qn, s.kn = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
        s.n_in, s.n_post = nn.RMSNorm(H, eps=1e-6), nn.RMSNorm(H, eps=1e-6)

    def forward(s, h, ctx, qcs, kcs, attend):
        Q = h.shape[0]
        x = s.n_in(h)
        q = rotate(s.qn(s.q(x).view(Q, s.HQ, s.D)), *qcs)
        kk = torch.cat([s.k(ctx), s.k(x)], 0).view(-1, s.HKV, s.D)
        k = rotate(s.kn(kk), *kcs)
        v = torch.cat([s.v(ctx), s.v(x)], 0).view(-1, s.HKV, s.D)
        a = attend(q, k, v).reshape(Q, s.HQ * s.D)
        h = h + s.o(a)
        x2 = s.n_post(h)
        return h + s.down(F.silu(s.gate(x2)) * s.up(x2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--sdpa", action="store_true", help="dense-mask SDPA instead of flex_attention")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of this script")
    a = ap.parse_args()
    if a.tiny:
        S, NA, B, H, HQ, HKV, D, I, V, K, L = 64, 4, 4, 64, 4, 2, 16, 96, 500, 2, 2
    else:
        S, NA, B, H, HQ, HKV, D, I, V, K, L = 3072, 512, 16, 4096, 32, 8, 128, 12288, 151936, 5, 5
    Q, NK = NA * B, S + NA * B
    dev = a.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)

    fc = nn.Linear(K * H, H, bias=False)
    hn, fn = nn.RMSNorm(H, eps=1e-6), nn.RMSNorm(H, eps=1e-6)
    layers = nn.ModuleList([Layer(H, HQ, HKV, D, I) for _ in range(L)])
    model = nn.ModuleDict(dict(fc=fc, hn=hn, fn=fn, layers=layers)).to(dev)
    params = list(model.parameters())
    nparam = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    embed_w = (torch.rand(V, H, device=dev, dtype=torch.bfloat16) * 0.06 - 0.03)
    lm_w = (torch.rand(V, H, device=dev, dtype=torch.bfloat16) * 0.06 - 0.03)

    taps = torch.rand(S, K * H, device=dev, dtype=torch.bfloat16) * 2 - 1
    anchors = torch.sort(torch.randperm(S - B, generator=g)[:NA] + 1).values.to(dev)
    kk = torch.arange(B, device=dev)
    qpos = (anchors[:, None] + kk[None, :]).reshape(-1)
    kpos = torch.cat([torch.arange(S, device=dev), qpos])
    mask_id = min(151669, V - 1)
    ids = torch.full((NA, B), mask_id, device=dev, dtype=torch.long)
    ids[:, 0] = torch.randint(0, min(151669, V), (NA,), generator=g).to(dev)
    ids = ids.reshape(-1)
    labels = torch.randint(0, V, (Q,), generator=g).to(dev)
    w = torch.exp(-(kk.float() - 1) / 7.0)
    w[0] = 0
    wts = w.repeat(NA)
    wts = wts / wts.sum()
    qcs = rope_cos_sin(qpos, D, 1e6, torch.bfloat16)
    kcs = rope_cos_sin(kpos, D, 1e6, torch.bfloat16)
    blk_of_q = torch.arange(Q, device=dev) // B
    anchor_of_q = anchors[blk_of_q]

    if a.sdpa:
        kv = torch.arange(NK, device=dev)
        allowed = (kv[None, :] < anchor_of_q[:, None]) | ((kv[None, :] >= S) & ((kv[None, :] - S) // B == blk_of_q[:, None]))

        def attend(q, k, v):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               attn_mask=allowed[None, None], enable_gqa=True)
            return o[0].transpose(0, 1)
        how = "SDPA with a dense mask (all %d x %d scores)" % (Q, NK)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            j = q_idx // B
            return (kv_idx < anchors[j]) | ((kv_idx >= S) & ((kv_idx - S) // B == j))
        bm = create_block_mask(mask_mod, 1, None, Q, NK, device=dev)
        flex = torch.compile(flex_attention, dynamic=False)

        def attend(q, k, v):
            o = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=bm,
                     enable_gqa=True)
            return o[0].transpose(0, 1)
        how = "flex_attention (compiled) with a block mask"

    def step():
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16):
            ctx = hn(fc(taps))
            h = F.embedding(ids, embed_w)
            for layer in layers:
                h = layer(h, ctx, qcs, kcs, attend)
            out = fn(h)
            loss = 0
            for c0 in range(0, Q, 2048):  # chunked LM head, as the reference trainers do
                logits = out[c0:c0 + 2048] @ lm_w.t()
                ce = F.cross_entropy(logits.float(), labels[c0:c0 + 2048], reduction="none")
                loss = loss + (ce * wts[c0:c0 + 2048]).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # model FLOPs, the formula of bench_train.c
    keys = float(B * (anchors + B).sum().item())
    per_layer = 2 * Q * H * HQ * D + 2 * 2 * NK * H * HKV * D + 2 * Q * HQ * D * H + 3 * 2 * Q * H * I
    flops = 3 * L * per_layer + L * 12 * keys * D * HQ + 2 * 2 * Q * H * V + 2 * 2 * S * K * H * H
    # (layers: fwd + din + dW; attention 4 + 8 per key; LM head fwd + dh; fc fwd + dW)

    t0 = time.time()
    loss0 = step().item()
    step()
    sync()
    warm = time.time() - t0
    t0 = time.time()
    for _ in range(a.steps):
        step()
    sync()
    el = (time.time() - t0) / a.steps
    print("%-34s %s" % ("torch attention", how))
    print("%-34s %s" % ("torch version", torch.__version__))
    print("%-34s %.2f" % ("torch warm-up s (2 steps, compile)", warm))
    print("%-34s %.4f (ln V = %.4f)" % ("torch step 0 weighted loss", loss0, math.log(V)))
    print("%-34s %.4f" % ("torch step time s", el))
    print("%-34s %.2f" % ("model TFLOP per step", flops / 1e12))
    print("%-34s %.1f" % ("torch achieved TFLOP/s", flops / el / 1e12))
    print("%-34s %.1f" % ("torch MFU vs 989 TFLOP/s %", 100 * flops / el / 989e12))
    if dev.startswith("cuda"):
        print("%-34s %.3f GiB" % ("torch peak memory", torch.cuda.max_memory_allocated() / 2**30))
    print("torch_step: params=%d" % nparam)


if __name__ == "__main__":
    main()
