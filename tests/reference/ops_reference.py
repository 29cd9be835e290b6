#!/usr/bin/env python3
"""ops_reference.py: golden fixtures for the CPU op table (tests/unit/test_ops_cpu.c).

Writes tests/fixtures/ops/{dense,attn,lmhead,adamw,rope_yarn,gptoss}.safetensors: random inputs
with odd sizes, and what PyTorch / transformers compute from them, forward and
autograd backward. Needs torch and transformers; CI only reads the committed
files.

The oracles:
  rmsnorm, rope  transformers' Qwen3RMSNorm and Qwen3RotaryEmbedding +
                 apply_rotary_pos_emb, in f32 (their f32 rounding of the angle
                 pos * inv_freq is part of the contract)
  matmul, swiglu, attention, LM head
                 the same math in float64 from the f32 inputs (so the fixture
                 is more exact than the code under test), stored as f32
  adamw          torch.optim.AdamW(foreach=False) on f32 parameters
  rope_yarn      transformers' YaRN RoPE (Qwen3RotaryEmbedding of a config with
                 rope_type yarn: its inv_freq, attention_scaling and rotation),
                 four configs; each config's JSON is in the file's metadata
                 ("yarnN.config"), as save_pretrained would write it
  gptoss         transformers' gpt-oss: GptOssExperts._apply_gate (the clamped
                 SwiGLU, on interleaved gate_up [N, 2I]) and
                 eager_attention_forward (sinks) over one causal sequence
                 with a sliding window, both in float64; alpha, limit and the
                 window in the metadata and as tensors
Backward: torch.autograd of sum(dout * out) (or of sum(gscale * loss)) in float64.

Usage: python3 tests/reference/ops_reference.py [--only NAME,...] [OUTDIR]
(--only gptoss writes that file alone; each file's inputs come from the one
generator in the order above, but for gptoss, which has its own)
"""
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3RMSNorm, Qwen3RotaryEmbedding,
                                                      apply_rotary_pos_emb)

ARGS = sys.argv[1:]
ONLY = None
if ARGS[:1] == ["--only"]:
    ONLY, ARGS = set(ARGS[1].split(",")), ARGS[2:]
OUT = ARGS[0] if ARGS else os.path.join(os.path.dirname(__file__), "..", "fixtures", "ops")
G = torch.Generator().manual_seed(20260211)


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=G) * scale).float()


def f32(t):
    return t.detach().float().clone().contiguous()  # never a view of a tensor updated later


def i32(t):
    return torch.as_tensor(t, dtype=torch.int32).contiguous()


def grads_of(fn, inputs, dout):
    """Run fn on float64 copies of inputs (requiring grad); return out (f32) and
    the gradients of sum(dout * out) (f32)."""
    xs = [x.double().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    (out * dout.double()).sum().backward()
    return f32(out), [f32(x.grad) for x in xs]


# ---------------------------------------------------------------------------
def dense():
    t = {}
    # matmul: out[M,N] = in[M,K] w[N,K]^T
    M, K, N = 7, 13, 11
    x, w, dout = randn(M, K), randn(N, K), randn(M, N)
    out, (dx, dw) = grads_of(lambda a, b: a @ b.T, [x, w], dout)
    t.update({"mm.in": x, "mm.w": w, "mm.out": out, "mm.dout": dout, "mm.din": dx, "mm.dw": dw})

    # rmsnorm (transformers Qwen3RMSNorm, f32), rows of very different scale
    rows, dim, eps = 5, 37, 1e-6
    x = randn(rows, dim) * torch.tensor([[1e-3], [0.5], [1.0], [3.0], [40.0]])
    w = 1.0 + randn(dim, scale=0.3)
    norm = Qwen3RMSNorm(dim, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(w)
    xr = x.clone().requires_grad_(True)
    y = norm(xr)
    dout = randn(rows, dim)
    (y * dout).sum().backward()
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    t.update({"rms.in": x, "rms.w": w, "rms.out": f32(y), "rms.rstd": f32(rstd), "rms.dout": dout,
              "rms.din": f32(xr.grad), "rms.dw": f32(norm.weight.grad), "rms.eps": torch.tensor([eps]).float()})

    # rope (Qwen3RotaryEmbedding + apply_rotary_pos_emb, f32); x[T, nh, d]
    T, nh, d = 6, 3, 10
    cfg = Qwen3Config(hidden_size=nh * d, num_attention_heads=nh, num_key_value_heads=nh, head_dim=d,
                      rope_theta=10000.0, max_position_embeddings=8192)
    rot = Qwen3RotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 7, 300, 3001, 8190]])
    x = randn(T, nh, d)
    xr = x.clone().requires_grad_(True)
    cos, sin = rot(xr, pos)
    y, _ = apply_rotary_pos_emb(xr.transpose(0, 1)[None], xr.transpose(0, 1)[None], cos, sin)
    y = y[0].transpose(0, 1)
    dout = randn(T, nh, d)
    (y * dout).sum().backward()
    t.update({"rope.x": x, "rope.pos": i32(pos[0]), "rope.inv_freq": f32(rot.inv_freq), "rope.out": f32(y),
              "rope.dout": dout, "rope.dx": f32(xr.grad)})

    # swiglu: silu(gate) * up
    n = 53
    g, u, dout = randn(n, scale=3.0), randn(n), randn(n)
    out, (dg, du) = grads_of(lambda a, b: F.silu(a) * b, [g, u], dout)
    t.update({"sw.gate": g, "sw.up": u, "sw.out": out, "sw.dout": dout, "sw.dgate": dg, "sw.dup": du})
    return t


# ---------------------------------------------------------------------------
def attention(q, k, v, mask):
    """q[nq,Hq,D], k,v[nk,Hkv,D], mask[nq,nk] bool (True = visible); float64 math.
    Returns out[nq,Hq,D] and lse[nq,Hq]."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    kk = k.repeat_interleave(Hq // Hkv, dim=1)  # q head h reads kv head h // G
    vv = v.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) / D ** 0.5
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vv), lse.T


def dflash_layout():
    """Two packed sequences of context ([0,50), [50,75)) and blocks anchored in
    them: anchors closer together than B, ctx_len 0 at each sequence start,
    anchors near each sequence end. Block j's keys are the context of its
    sequence strictly before its anchor, and rows S + j*B .. + B."""
    seqs = [(0, 50), (50, 75)]
    anchors = [(0, 0), (0, 10), (0, 12), (0, 47), (1, 50), (1, 52), (1, 53), (1, 73)]
    return seqs, anchors


def attn():
    t = {}
    torch.manual_seed(0)
    # causal over packed sequences of lengths 70, 1, 19 (tiles of 16 queries,
    # 64 keys: both split), Hq 6, Hkv 2
    lens = [70, 1, 19]
    T, Hq, Hkv, D = sum(lens), 6, 2, 12
    q, k, v = randn(T, Hq, D), randn(T, Hkv, D), randn(T, Hkv, D)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for s in range(len(lens)):
        for i in range(cu[s], cu[s + 1]):
            mask[i, cu[s]:i + 1] = True
    out, _ = attention(q.double(), k.double(), v.double(), mask)
    t.update({"causal.q": q, "causal.k": k, "causal.v": v, "causal.cu": i32(cu), "causal.out": f32(out)})

    # dflash: S context rows, then nblk blocks of B rows; mask by spec section 2.5
    seqs, anchors = dflash_layout()
    S, B, Hq, Hkv, D = 75, 5, 6, 3, 12
    nblk = len(anchors)
    NK = S + nblk * B
    q, k, v = randn(nblk * B, Hq, D), randn(NK, Hkv, D), randn(NK, Hkv, D)
    mask = torch.zeros(nblk * B, NK, dtype=torch.bool)
    blocks = []
    for j, (s, a) in enumerate(anchors):
        lo = seqs[s][0]
        for o in range(B):
            qi = j * B + o
            for kv in range(NK):
                if kv < S:
                    mask[qi, kv] = lo <= kv < a  # same sequence, strictly before the anchor
                else:
                    mask[qi, kv] = (kv - S) // B == j  # own block, bidirectional
        blocks.append([lo, a - lo, S + j * B])
    dout = randn(nblk * B, Hq, D)
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    out, lse = attention(qd, kd, vd, mask)
    (out * dout.double()).sum().backward()
    t.update({"dfl.q": q, "dfl.k": k, "dfl.v": v, "dfl.blocks": i32(blocks), "dfl.out": f32(out),
              "dfl.lse": f32(lse), "dfl.dout": dout, "dfl.dq": f32(qd.grad), "dfl.dk": f32(kd.grad),
              "dfl.dv": f32(vd.grad), "dfl.dims": i32([S, B, Hq, Hkv, D])})
    return t


# ---------------------------------------------------------------------------
def lmhead():
    t = {}
    N, H, V = 37, 24, 203
    h, th, w = randn(N, H), randn(N, H), randn(V, H, scale=0.5)
    labels = torch.randint(0, V, (N,), generator=G)
    labels[[3, 11, 30]] = -1
    gscale = torch.rand(N, generator=G).float() + 0.1
    gscale[[5, 11, 20, 36]] = 0.0
    gscale[7] = -0.5  # a negative scale is legal (the op just scales)

    hd = h.double().requires_grad_(True)
    z = hd @ w.double().T
    lse = torch.logsumexp(z, -1)
    ce = torch.where(labels >= 0, lse - z.gather(1, labels.clamp(min=0)[:, None])[:, 0], torch.zeros(()))
    (ce * gscale.double() * (labels >= 0)).sum().backward()
    t.update({"lm.h": h, "lm.th": th, "lm.w": w, "lm.labels": i32(labels), "lm.gscale": gscale,
              "ce.loss": f32(ce), "ce.pred": i32(z.argmax(-1)), "ce.dh": f32(hd.grad)})

    hd = h.double().requires_grad_(True)
    zd, zt = hd @ w.double().T, th.double() @ w.double().T
    kl = F.kl_div(F.log_softmax(zd, -1), F.log_softmax(zt, -1), log_target=True, reduction="none").sum(-1)
    kl = torch.where(gscale != 0, kl, torch.zeros(()))
    (kl * gscale.double()).sum().backward()
    top2 = z.detach().topk(2, dim=-1).values
    t.update({"kl.loss": f32(kl), "kl.pred": i32(zd.argmax(-1)), "kl.tpred": i32(zt.argmax(-1)),
              "kl.dh": f32(hd.grad), "am.gap": f32(top2[:, 0] - top2[:, 1])})
    return t


# ---------------------------------------------------------------------------
def adamw():
    # Hyperparameters exactly representable in f32, so PyTorch's Python
    # doubles equal the C op's float arguments.
    n, steps = 1001, 6
    lr, b1, b2, eps, wd, gs = (float(torch.tensor(x, dtype=torch.float32)) for x in
                               (3e-3, 0.9, 0.95, 1e-8, 0.1, 0.625))
    p = torch.nn.Parameter(randn(n))
    p0 = f32(p)
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    grads = randn(steps, n) * torch.logspace(-4, 1, n)[None].float()
    ps = []
    for s in range(steps):
        p.grad = (grads[s] * gs).float()  # the C op multiplies by gscale itself
        opt.step()
        ps.append(f32(p))
    st = opt.state[p]
    return {"adam.p0": p0, "adam.grads": grads, "adam.p": torch.stack(ps), "adam.m": f32(st["exp_avg"]),
            "adam.v": f32(st["exp_avg_sq"]),
            "adam.hyper": torch.tensor([lr, b1, b2, eps, wd, gs]).float()}


# ---------------------------------------------------------------------------
YARN_CASES = (
    # Qwen3's model-card recipe: 4x a 32K pretraining context, 128-wide heads
    dict(head_dim=128, max_position_embeddings=131072,
         rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                          "original_max_position_embeddings": 32768}),
    # the ramp's bounds not rounded (truncate false), both betas given
    dict(head_dim=24, max_position_embeddings=1024,
         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 256, "beta_fast": 8.0, "beta_slow": 2.0,
                          "truncate": False}),
    # DeepSeek's spelling: the attention factor from mscale / mscale_all_dim
    dict(head_dim=16, max_position_embeddings=2560,
         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                          "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5}),
    # the 4.x spelling (rope_scaling, "type"), an explicit attention factor,
    # no original length: max_position_embeddings stands for it
    dict(head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
         rope_scaling={"type": "yarn", "factor": 2.0, "attention_factor": 0.8}),
)


def rope_yarn():
    """Per case: x[T, nh, d] rotated by transformers' YaRN RoPE (cos and sin
    times attention_scaling), and the autograd dx of sum(dout * out)."""
    import copy
    import json
    t, meta = {}, {}
    for i, kw in enumerate(YARN_CASES):
        d, nh, T = kw["head_dim"], 2, 5
        # a copy: transformers fills the dict it is given in (e.g. the original length)
        cfg = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=nh * d, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=nh, num_key_value_heads=nh, vocab_size=64,
                          **copy.deepcopy(kw))
        rot = Qwen3RotaryEmbedding(cfg)
        cfg_json = json.loads(cfg.to_json_string())
        if "rope_scaling" in kw:  # the file as a 4.x checkpoint has it
            cfg_json.pop("rope_parameters", None)
            cfg_json["rope_theta"], cfg_json["rope_scaling"] = kw["rope_theta"], kw["rope_scaling"]
        meta[f"yarn{i}.config"] = json.dumps(cfg_json, sort_keys=True)
        top = kw["max_position_embeddings"] - 1
        pos = torch.tensor([[0, 3, 1000 % top, top // 2, top]])
        x, dout = randn(T, nh, d), randn(T, nh, d)
        xr = x.clone().requires_grad_(True)
        cos, sin = rot(xr, pos)
        y, _ = apply_rotary_pos_emb(xr.transpose(0, 1)[None], xr.transpose(0, 1)[None], cos, sin)
        y = y[0].transpose(0, 1)
        (y * dout).sum().backward()
        t.update({f"yarn{i}.x": x, f"yarn{i}.pos": i32(pos[0]), f"yarn{i}.inv_freq": f32(rot.inv_freq),
                  f"yarn{i}.scale": torch.tensor([rot.attention_scaling]).float(), f"yarn{i}.out": f32(y),
                  f"yarn{i}.dout": dout, f"yarn{i}.dx": f32(xr.grad)})
    return t, meta


# ---------------------------------------------------------------------------
def gptoss():
    """gpt-oss's expert activation and attention sinks, by transformers'
    own functions in float64 from f32 inputs."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, eager_attention_forward
    g = torch.Generator().manual_seed(20261205)  # its own: the other files keep their bytes

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).float()

    # alpha as the C op's float holds it; limit 2 so that both clamps are hit
    alpha, limit = float(torch.tensor(1.702, dtype=torch.float32)), 2.0
    N, I = 7, 29
    gate_up = rn(N, 2 * I, scale=2.5)
    gate_up[0, 0:6] = torch.tensor([limit, -limit, -limit, limit, 9.0, -9.0])  # edges, and far past them
    cfg = GptOssConfig(hidden_size=8, intermediate_size=I, num_local_experts=1, swiglu_alpha=alpha,
                       swiglu_limit=limit)
    experts = GptOssExperts(cfg)
    assert experts.alpha == alpha and experts.limit == limit
    out = experts._apply_gate(gate_up.double())
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    assert (gate > limit).any() and (up > limit).any() and (up < -limit).any() and (gate < -limit).any()

    # one causal sequence, sliding window W: row i sees keys i-W < j <= i
    T, Hq, Hkv, D, W = 37, 4, 2, 16, 8
    q, k, v = rn(T, Hq, D), rn(T, Hkv, D), rn(T, Hkv, D)
    sinks = torch.tensor([-4.0, 0.5, 2.0, 12.0]).float() + rn(Hq, scale=0.1)  # below and far above the lse
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & (j > i - W)
    mask = torch.zeros(T, T, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)

    class Attn(torch.nn.Module):  # what eager_attention_forward reads of its module
        def __init__(self):
            super().__init__()
            self.num_key_value_groups = Hq // Hkv
            self.sinks = torch.nn.Parameter(sinks.double())

    m = Attn().eval()
    with torch.no_grad():
        att, _ = eager_attention_forward(m, q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                         v.double().transpose(0, 1)[None], mask[None, None], scaling=D ** -0.5)
    t = {"oss.gate_up": gate_up, "oss.out": f32(out), "oss.alpha": torch.tensor([alpha]).float(),
         "oss.limit": torch.tensor([limit]).float(), "sink.q": q, "sink.k": k, "sink.v": v, "sink.sinks": sinks,
         "sink.out": f32(att[0]), "sink.dims": i32([T, Hq, Hkv, D, W])}
    meta = {"oss.alpha": repr(alpha), "oss.limit": repr(limit), "sink.window": str(W),
            "transformers": __import__("transformers").__version__}
    return t, meta


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, fn in (("dense", dense), ("attn", attn), ("lmhead", lmhead), ("adamw", adamw),
                     ("rope_yarn", rope_yarn), ("gptoss", gptoss)):
        if ONLY is not None and name not in ONLY:
            continue
        tensors, meta = fn(), {}
        if isinstance(tensors, tuple):
            tensors, meta = tensors
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        path = os.path.join(OUT, name + ".safetensors")
        save_file(tensors, path, metadata={"generator": "tests/reference/ops_reference.py",
                                           "torch": torch.__version__, **meta})
        print(f"{path}: {len(tensors)} tensors, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
