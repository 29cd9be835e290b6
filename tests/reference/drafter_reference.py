"""PyTorch reference of the DFlash drafter and its training step.

Written from the specification (shared research notes, dflash-spec.md §1-§2),
not from any trainer's code, so that it is an independent oracle for
lib/drafter.c and lib/train.c. Everything is computed in float64 from
float32 inputs; the C code (fp32) is compared against it by normalised error.

The math, spelled out (one sequence of T tokens, anchors a_0 < ... < a_{N-1},
block size B, K tapped target layers of width H):

  ctx      = hidden_norm(fc(hidden[0:T]))                 [T, H]
  block j  = [ids[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1
  h        = embed(block tokens)                           [N*B, H]
  layer l:   x = input_layernorm(h)
             q = rope(q_norm(q_proj(x)))                   queries: block rows only
             k = rope(k_norm(k_proj([ctx; x])))            keys: context rows then block rows
             v = v_proj([ctx; x])
             h = h + o_proj(attn(q, k, v, allowed))
             h = h + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(h)
  out      = norm(h);  logits = lm_head(out)               (the target's lm_head, frozen)

  allowed(q in block j, kv) = (kv is context row t and t < a_j)
                              or (kv is a row of block j)           (spec §2.5)
  a sliding-window layer (window W; layer_types[l] == "sliding_attention"
  with use_sliding_window, as transformers' Qwen3Config reads them) also
  needs, for the query in slot o of block j (position a_j + o):
                              t >= a_j + o - (W - 1)   (W keys, itself included)
                              a block row's slot <= o  (the block is causal)

  label y_{j,k} = ids[a_j + k] (same position), k = 1..B-1
  mask  m_{j,k} = [k > 0] [a_j + k < T] loss_mask[a_j + k]
  weight w_k    = exp(-(k - 1) / gamma)
  loss          = sum w m CE / sum w m      ("weighted"; "count" divides by sum m)

KL variant (spec §2.6, speculators): the target distribution for slot k is
softmax(lm_head(target_norm(last_hidden[a_j + k - 1]))) and the per-slot loss
is KL(p_target || p_drafter).
"""

import math

import torch

torch.set_default_dtype(torch.float64)

LAYER_TENSORS = [
    # (suffix, shape function of the config)
    ("self_attn.q_proj.weight", lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"])),
    ("self_attn.k_proj.weight", lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"])),
    ("self_attn.v_proj.weight", lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"])),
    ("self_attn.o_proj.weight", lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"])),
    ("self_attn.q_norm.weight", lambda c: (c["head_dim"],)),
    ("self_attn.k_norm.weight", lambda c: (c["head_dim"],)),
    ("input_layernorm.weight", lambda c: (c["hidden_size"],)),
    ("post_attention_layernorm.weight", lambda c: (c["hidden_size"],)),
    ("mlp.gate_proj.weight", lambda c: (c["intermediate_size"], c["hidden_size"])),
    ("mlp.up_proj.weight", lambda c: (c["intermediate_size"], c["hidden_size"])),
    ("mlp.down_proj.weight", lambda c: (c["hidden_size"], c["intermediate_size"])),
]


def num_taps(cfg):
    return len(cfg["dflash_config"]["target_layer_ids"])


def block_size(cfg):
    return cfg.get("block_size", cfg.get("dflash_config", {}).get("block_size"))


def param_shapes(cfg):
    """Every drafter tensor (released z-lab names, no `model.` prefix) and its shape."""
    H = cfg["hidden_size"]
    shapes = {"fc.weight": (H, num_taps(cfg) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        for suffix, fn in LAYER_TENSORS:
            shapes[f"layers.{i}.{suffix}"] = fn(cfg)
    return shapes


def rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def inv_freq(cfg):
    D = cfg["head_dim"]
    # computed in float32 as transformers does, then used in float64
    f = 1.0 / (torch.tensor(float(cfg["rope_theta"]), dtype=torch.float32)
               ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    return f.to(torch.float64)


def rope(x, pos, inv):
    """x [T, nh, D], NeoX pairing (rotate_half), angle pos * inv_freq."""
    ang = pos.to(torch.float64)[:, None] * inv[None, :]            # [T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def layer_window(cfg, i):
    """Layer i's sliding window (keys a query sees, itself included), or
    None: transformers' Qwen3Config rule (a window only with
    use_sliding_window; layer_types, else the layers from max_window_layers)."""
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return None
    lt = cfg.get("layer_types")
    sliding = lt[i] == "sliding_attention" if lt is not None else i >= cfg.get("max_window_layers", 28)
    return cfg["sliding_window"] if sliding else None


def allowed_mask(T, anchors, B, window=None):
    """Boolean [N*B, T + N*B]: the rule of spec §2.5, written literally."""
    N = len(anchors)
    m = torch.zeros(N * B, T + N * B, dtype=torch.bool)
    for q in range(N * B):
        j, o = q // B, q % B
        for kv in range(T + N * B):
            if kv < T:
                m[q, kv] = kv < anchors[j] and (window is None or kv >= anchors[j] + o - (window - 1))
            else:
                m[q, kv] = (kv - T) // B == j and (window is None or (kv - T) % B <= o)
    return m


def block_tokens(ids, anchors, B, mask_id):
    toks, pos = [], []
    for a in anchors:
        toks += [int(ids[a])] + [mask_id] * (B - 1)
        pos += list(range(a, a + B))
    return torch.tensor(toks), torch.tensor(pos)


def drafter_out(P, cfg, hidden, ids, anchors, embed):
    """Final-normed drafter output [N*B, H] for one sequence."""
    H, Hq, Hkv, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, B = cfg["rms_norm_eps"], block_size(cfg)
    T = hidden.shape[0]
    toks, bpos = block_tokens(ids, anchors, B, cfg["dflash_config"]["mask_token_id"])
    Q = len(toks)
    inv = inv_freq(cfg)
    kpos = torch.cat([torch.arange(T), bpos])
    ctx = rmsnorm(hidden @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    h = embed[toks]
    for i in range(cfg["num_hidden_layers"]):
        L = lambda s: P[f"layers.{i}.{s}"]
        x = rmsnorm(h, L("input_layernorm.weight"), eps)
        q = rmsnorm((x @ L("self_attn.q_proj.weight").T).view(Q, Hq, D), L("self_attn.q_norm.weight"), eps)
        kv_in = torch.cat([ctx, x], 0)
        k = rmsnorm((kv_in @ L("self_attn.k_proj.weight").T).view(T + Q, Hkv, D), L("self_attn.k_norm.weight"), eps)
        v = (kv_in @ L("self_attn.v_proj.weight").T).view(T + Q, Hkv, D)
        q = rope(q, bpos, inv)
        k = rope(k, kpos, inv)
        g = Hq // Hkv
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
        allowed = allowed_mask(T, anchors, B, layer_window(cfg, i))
        s = s.masked_fill(~allowed[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(Q, Hq * D)
        h = h + o @ L("self_attn.o_proj.weight").T
        y = rmsnorm(h, L("post_attention_layernorm.weight"), eps)
        a = torch.nn.functional.silu(y @ L("mlp.gate_proj.weight").T) * (y @ L("mlp.up_proj.weight").T)
        h = h + a @ L("mlp.down_proj.weight").T
    return rmsnorm(h, P["norm.weight"], eps)


def slot_weight(k, gamma):
    return math.exp(-(k - 1) / gamma) if k >= 1 else 0.0


def labels_and_mask(ids, loss_mask, anchors, B, label_ids=None):
    """Per slot (j, k): label, validity m, as flat lists of length N*B.
    label_ids (optional, same length as ids) replaces the data tokens."""
    T = len(ids)
    src = ids if label_ids is None else label_ids
    y, m = [], []
    for a in anchors:
        for k in range(B):
            p = a + k
            ok = k > 0 and p < T and int(loss_mask[p]) == 1
            y.append(int(src[p]) if ok else -1)
            m.append(1.0 if ok else 0.0)
    return torch.tensor(y), torch.tensor(m)


def sequence_terms(P, cfg, seq, anchors, lm_head, embed, gamma, loss="ce", tnorm=None, teps=None):
    """Per-slot losses [N*B] (0 where masked), weights w*m, counts m, logits."""
    B = block_size(cfg)
    out = drafter_out(P, cfg, seq["hidden"], seq["ids"], anchors, embed)
    logits = out @ lm_head.T
    y, m = labels_and_mask(seq["ids"], seq["loss_mask"], anchors, B)
    w = torch.tensor([slot_weight(k, gamma) for _ in anchors for k in range(B)])
    logp = logits.log_softmax(-1)
    if loss == "ce":
        per = -logp.gather(1, y.clamp(min=0)[:, None])[:, 0]
    else:
        T = seq["hidden"].shape[0]
        # slot k's target distribution comes from position a+k-1 (clamped for
        # slots that carry no loss anyway)
        rows = torch.tensor([min(max(a + k - 1, 0), T - 1) for a in anchors for k in range(B)])
        tl = rmsnorm(seq["last_hidden"][rows], tnorm, teps) @ lm_head.T
        tlogp = tl.log_softmax(-1)
        per = (tlogp.exp() * (tlogp - logp)).sum(-1)
    per = torch.where(m > 0, per, torch.zeros_like(per))
    return per, w * m, m, logits


def step_loss(P, cfg, seqs, anchors, lm_head, embed, gamma, norm="weighted", loss="ce", tnorm=None, teps=None):
    """The loss of one optimizer step over several sequences: one normaliser
    for the whole step, however it is split into micro-batches."""
    num, den_w, den_c = 0.0, 0.0, 0.0
    per_seq = []
    for seq, anc in zip(seqs, anchors):
        per, wm, m, logits = sequence_terms(P, cfg, seq, anc, lm_head, embed, gamma, loss, tnorm, teps)
        num = num + (wm * per).sum()
        den_w = den_w + wm.sum()
        den_c = den_c + m.sum()
        per_seq.append((per, logits))
    den = den_w if norm == "weighted" else den_c
    return num / den, per_seq


def lr_at(step_index, total, warmup_ratio, peak):
    """Learning rate of the optimizer step with 0-based index i (i steps done
    before it): linear warm-up over W = floor(ratio * total) steps
    (peak * (i+1) / W), then cosine from peak to 0 over the rest
    (peak * 0.5 * (1 + cos(pi * (i - W) / (total - W))))."""
    W = int(math.floor(warmup_ratio * total))
    if step_index < W:
        return peak * (step_index + 1) / W
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step_index - W) / max(1, total - W)))
