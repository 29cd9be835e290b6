#!/usr/bin/env python3
"""Golden fixtures for Qwen3-Next targets (Qwen3NextForCausalLM, model_type
qwen3_next: Qwen3-Next-80B-A3B, Qwen3-Coder-Next).

Made like make_targets.py's and make_targets_moe.py's (whose helpers this
script imports): a tiny random model built with transformers, saved by
save_pretrained in bf16 exactly as it writes it, reloaded in f32 and what HF
computes recorded in NAME/reference/ (inputs.jsonl and expected.safetensors:
input_ids, cu, hidden_states [L+1,T,H], last_prenorm, argmax, gap; see
make_targets.py). HF runs with attn_implementation="eager" and
experts_implementation="eager".

Fixture (tests/fixtures/targets/):
  qwen3-next   H 48, 8 layers, layer_types (HF derives them from
               full_attention_interval 4 and writes layer_types):
               Gated DeltaNet ("linear_attention") at 0-2, 4-6, gated full
               attention at 3, 7. Attention 4 q / 2 kv heads, head_dim 32,
               partial_rotary_factor 0.25 (rotary dim 8, plain 1-D RoPE, no
               mRoPE), rope theta 1e7, eps 1e-6. GDN: Hk 2 key heads, Hv 4
               value heads (r = Hv/Hk = 2 value heads per key-head group),
               dk 16, dv 24, conv kernel 4. MoE: E 7 experts, top-k 3,
               expert I 18, shared expert I_s 26 with a sigmoid gate,
               norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [1]:
               layer 1 is a dense SwiGLU MLP of intermediate_size 36 (checked:
               HF builds Qwen3NextMLP there), every other layer a
               Qwen3NextSparseMoeBlock. vocab 199, untied.
               Samples of 17, 1, 9, 70 tokens (70 crosses HF's delta-rule
               chunk of 64).

What save_pretrained writes (transformers 5.25; every tensor BF16, A_log and
dt_bias included: Qwen3-Next's classes keep nothing in fp32):
  model.embed_tokens.weight [V, H], model.norm.weight [H], lm_head.weight [V, H]
  model.layers.{i}.input_layernorm.weight / post_attention_layernorm.weight [H]
  linear layer:
    linear_attn.in_proj_qkvz.weight [2*Hk*dk + 2*Hv*dv, H] = [256, 48]
    linear_attn.in_proj_ba.weight   [2*Hv, H]              = [8, 48]
    linear_attn.conv1d.weight       [2*Hk*dk + Hv*dv, 1, K] = [160, 1, 4] (no bias)
    linear_attn.A_log [Hv], linear_attn.dt_bias [Hv]
    linear_attn.norm.weight [dv]   (gated RMSNorm, PLAIN w: w * norm(o) * silu(z))
    linear_attn.out_proj.weight [H, Hv*dv] = [48, 96]
  full layer:
    self_attn.q_proj.weight [nH*2*D, H] = [256, 48]  (query and gate, see below)
    self_attn.k_proj.weight, v_proj.weight [nKV*D, H] = [64, 48]
    self_attn.o_proj.weight [H, nH*D] = [48, 128]
    self_attn.q_norm.weight, k_norm.weight [D]  ((1 + w) RMSNorms)
  MoE layer (per expert, the conversion "qwen3_next" -> qwen2_moe splits
  transformers' fused in-memory experts again on save):
    mlp.gate.weight [E, H] (router)
    mlp.experts.{e}.gate_proj.weight / up_proj.weight [I, H], down_proj.weight [H, I]
    mlp.shared_expert.gate_proj.weight / up_proj.weight [I_s, H],
    mlp.shared_expert.down_proj.weight [H, I_s], mlp.shared_expert_gate.weight [1, H]
  dense layer 1: mlp.gate_proj.weight / up_proj.weight [36, H], mlp.down_proj.weight [H, 36]

Norms: every Qwen3NextRMSNorm (input_layernorm, post_attention_layernorm,
model.norm, AND self_attn.q_norm / k_norm) computes norm(x) * (1 + w) (HF
inits w to zeros); linear_attn.norm (Qwen3NextRMSNormGated) is
w * norm(o) * silu(z) with w inited to ones (norm over dv per value head).

Full attention's q_proj (Qwen3NextAttention.forward: view(T, nH, 2D).chunk(2)):
per head h, rows h*2D + [0, D) are query head h and rows h*2D + [D, 2D) its
output gate; out = o_proj(attn * sigmoid(gate)) -- the same interleaved
[query D | gate D] per head as Qwen3.5's.

GDN row layout (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering: the
projection viewed as [T, Hk, S] and split along S), r = Hv/Hk value heads per
key-head group. in_proj_qkvz [Hk*S, H] holds Hk groups of
S = 2*dk + 2*r*dv rows; group g (0..Hk-1), base = g*S:
  base + [0, dk)                           q, key head g
  base + dk + [0, dk)                      k, key head g
  base + 2*dk + j*dv + [0, dv),      j<r   v, value head g*r + j
  base + 2*dk + r*dv + j*dv + [0, dv), j<r z, value head g*r + j
Here (dk 16, dv 24, r 2, S 128, 256 rows): [0,16) q0, [16,32) k0, [32,56) v0,
[56,80) v1, [80,104) z0, [104,128) z1, [128,144) q1, [144,160) k1,
[160,184) v2, [184,208) v3, [208,232) z2, [232,256) z3.
in_proj_ba [2*Hv, H] holds Hk groups of 2r rows; group g, base = g*2r:
  base + j        b, value head g*r + j   (j < r)
  base + r + j    a, value head g*r + j
Here: rows [b0 b1 a0 a1 b2 b3 a2 a3].
Value head j reads key/query head j // r (repeat_interleave in the delta rule).
conv1d's channels (mixed_qkv = cat(q, k, v) after the regrouping): q of all
key heads (Hk*dk, head-major), then k of all key heads (Hk*dk), then v of all
value heads (Hv*dv, value head order 0..Hv-1): the same channel order as
Qwen3.5's in_proj_qkv / conv1d. So the Qwen3.5 separate layout is the row
permutation
  in_proj_qkv = [q rows of groups 0..Hk-1; k rows of groups 0..Hk-1; v rows of groups 0..Hk-1]
  in_proj_z   = [z rows of groups 0..Hk-1]
  in_proj_b   = [b rows of groups 0..Hk-1],  in_proj_a = [a rows of groups 0..Hk-1]
and conv1d.weight, A_log, dt_bias, norm.weight need no change.
Checked below (printed): (1) the projections rebuilt from the saved tensors
by this permutation against the query/key/value/z/b/a that
fix_query_key_value_ordering returns inside HF's forward; (2) every GDN
layer written out in float64 (separate layout, conv, l2norm, delta rule,
gated norm, out_proj) against HF's module output; (3) every full-attention
layer written out in float64 ((1+w) q/k norms, interleaved gate, partial
RoPE) against HF's module output; controls that must fail: the naive
contiguous split of in_proj_qkvz (q|k|v|z blocks) and of in_proj_ba
(b|a), and q_proj read as [all queries | all gates].

config.json as save_pretrained writes it (5.x spelling): architectures
["Qwen3NextForCausalLM"], model_type qwen3_next, dtype "bfloat16",
rope_parameters {rope_type default, rope_theta 1e7, partial_rotary_factor
0.25}, layer_types (8 entries), num_experts (NOT num_local_experts, unlike
Qwen3-MoE's 5.x save), num_experts_per_tok, moe_intermediate_size,
shared_expert_intermediate_size, norm_topk_prob, decoder_sparse_step,
mlp_only_layers, intermediate_size, linear_{conv_kernel_dim, key_head_dim,
num_key_heads, num_value_heads, value_head_dim}, head_dim, hidden_size,
num_attention_heads, num_key_value_heads, num_hidden_layers, rms_norm_eps,
tie_word_embeddings, vocab_size, attention_bias, attention_dropout,
bos/eos/pad_token_id, hidden_act, initializer_range, max_position_embeddings,
output_router_logits, router_aux_loss_coef, use_cache,
transformers_version. NOT written: full_attention_interval (consumed into
layer_types), attn_output_gate (Qwen3-Next always gates; Qwen3.5 writes
it), mamba_ssm_dtype, rope_theta / partial_rotary_factor at top level.
Defaults a reader of released files (4.x spelling: rope_theta,
partial_rotary_factor top level, full_attention_interval, no layer_types)
must know: Qwen3NextConfig defaults partial_rotary_factor to 0.25 when absent
(checked by hand: a config without it loads with 0.25), full_attention_interval
to 4, mlp_only_layers to [], decoder_sparse_step to 1, norm_topk_prob to TRUE
(Qwen3MoeConfig's is false).

The MoE block (Qwen3NextSparseMoeBlock, as Qwen3.5-MoE's but with
norm_topk_prob honoured): p = softmax(x W_router^T) over all E (f32), top-k,
w = w / sum(w) iff norm_topk_prob, y = sum_j w_j down_e(silu(gate_e x) up_e x)
+ sigmoid(x . w_sg) * shared_expert(x). Layer i is sparse iff
i not in mlp_only_layers and num_experts > 0 and (i+1) % decoder_sparse_step == 0
(else Qwen3NextMLP of intermediate_size).

Measured (torch 2.15 CPU, transformers 5.25, no fla / causal-conv1d):
  projections by the documented permutation vs fix_query_key_value_ordering
    max abs diff: f32 0 (bit for bit), f64 1.1e-06 (HF's own f32 rounding)
  float64 GDN layer from the formulas vs HF, max|a-b|/max|b|  1.1e-06
    control, naive q|k|v|z and b|a split                      9.9e-01
  float64 gated attention vs HF                                5.2e-07
    control, q_proj as [all queries | all gates]               3.5e-01
  MoE: tokens per expert min 26; routing margin (p_k-p_k+1)/p_k min 4.7e-04;
    float64 block vs HF 3.4e-07; whole model with it nmse max 5.3e-12;
    controls (last state nmse): no_renorm 1.5e-02, swap_gate_up 7.1e-01,
    next_expert 1.4e-01, shared_no_sigmoid 1.5
  whole model with HF's recurrent f32 delta rule instead of the chunked one:
    nmse per hidden state max 2.2e-11
  logits: min top-1/top-2 gap 8.5e-05 (1 of 97 tokens below 1e-3)

Weights (random, far from HF's init), by owning module: Linear / Embedding
N(0, 0.1^2); (1+w) RMSNorms N(0, 0.2^2); gated norm 1 + N(0, 0.2^2); conv1d
N(0, 0.3^2); A_log = log A, A log-uniform in [0.02, 16] (some heads keep
state across the chunk boundary); dt_bias N(0, 0.5^2); router N(0, 0.5^2);
experts N(0, 0.1^2); shared_expert_gate N(0, 0.3^2).

Run: python3 tests/reference/make_targets_qwen3next.py [--only qwen3-next]
     (torch + transformers, CPU, about 5 s; deterministic: a rerun gives the
     same bytes. No other fixture is touched.)
"""
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_targets as mt  # noqa: E402
import make_targets_moe as mm  # noqa: E402

OUT = mt.OUT
EAGER = {"experts_implementation": "eager"}
ME = "tests/reference/make_targets_qwen3next.py"
NOTE = ", eager experts loop"
LENGTHS = [17, 1, 9, 70]


def q3n_module():
    import transformers.models.qwen3_next.modeling_qwen3_next as m
    return m


def q3n_config():
    return dict(vocab_size=199, hidden_size=48, intermediate_size=36, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=24, linear_conv_kernel_dim=4, full_attention_interval=4,
                moe_intermediate_size=18, shared_expert_intermediate_size=26, num_experts=7,
                num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                attention_dropout=0.0, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})


def q3n_is_sparse(cfg, i):
    """Qwen3NextDecoderLayer.__init__'s rule."""
    return i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0


def q3n_init_weights(model, seed):
    """make_targets_moe.q35m_init_weights's rules with Qwen3-Next's classes."""
    mm.q35m_init_weights(model, seed, q3n_module(), "Qwen3Next")


def expected_keys(c, i, sparse, linear):
    """{name: shape} of layer i as the docstring lists it."""
    H, D, nH, nKV = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    Hk, Hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if linear:
        out.update({p + "linear_attn.in_proj_qkvz.weight": (2 * Hk * dk + 2 * Hv * dv, H),
                    p + "linear_attn.in_proj_ba.weight": (2 * Hv, H),
                    p + "linear_attn.conv1d.weight": (2 * Hk * dk + Hv * dv, 1, c["linear_conv_kernel_dim"]),
                    p + "linear_attn.A_log": (Hv,), p + "linear_attn.dt_bias": (Hv,),
                    p + "linear_attn.norm.weight": (dv,), p + "linear_attn.out_proj.weight": (H, Hv * dv)})
    else:
        out.update({p + "self_attn.q_proj.weight": (nH * 2 * D, H), p + "self_attn.k_proj.weight": (nKV * D, H),
                    p + "self_attn.v_proj.weight": (nKV * D, H), p + "self_attn.o_proj.weight": (H, nH * D),
                    p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
    if sparse:
        out.update(mm.q35m_expected_mlp(c, p + "mlp", fused=False))
    else:
        Id = c["intermediate_size"]
        out.update({p + "mlp.gate_proj.weight": (Id, H), p + "mlp.up_proj.weight": (Id, H),
                    p + "mlp.down_proj.weight": (H, Id)})
    return out


# ---------------------------------------------------------------------------
# The documented GDN row layout, as index lists.

def gdn_rows(Hk, Hv, dk, dv):
    """Row indices into in_proj_qkvz / in_proj_ba giving Qwen3.5's separate
    layout: (qkv rows [2*Hk*dk + Hv*dv], z rows [Hv*dv], b rows [Hv], a rows [Hv])."""
    r = Hv // Hk
    S = 2 * dk + 2 * r * dv
    q, k, v, z, b, a = [], [], [], [], [], []
    for g in range(Hk):
        base = g * S
        q += range(base, base + dk)
        k += range(base + dk, base + 2 * dk)
        v += range(base + 2 * dk, base + 2 * dk + r * dv)
        z += range(base + 2 * dk + r * dv, base + S)
        b += range(g * 2 * r, g * 2 * r + r)
        a += range(g * 2 * r + r, g * 2 * r + 2 * r)
    return q + k + v, z, b, a


def gdn_rows_naive(Hk, Hv, dk, dv):
    """Control: in_proj_qkvz read as contiguous q|k|v|z blocks, in_proj_ba as b|a."""
    n = 2 * Hk * dk + Hv * dv
    return (list(range(n)), list(range(n, n + Hv * dv)), list(range(Hv)), list(range(Hv, 2 * Hv)))


def l2n(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def rms(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def gdn_layer64(x, t, p, c, rows):
    """Float64 GDN layer from the formulas, weights read from the files and
    permuted into the separate layout by `rows`. x [T, H] -> [T, H]."""
    Hk, Hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    K = c["linear_conv_kernel_dim"]
    x = x.double()
    W = t[p + "in_proj_qkvz.weight"].double()
    Wba = t[p + "in_proj_ba.weight"].double()
    iqkv, iz, ib, ia = rows
    qkv, z = x @ W[iqkv].T, x @ W[iz].T
    b, a = x @ Wba[ib].T, x @ Wba[ia].T
    T = x.shape[0]
    w = t[p + "conv1d.weight"].double()[:, 0]          # [C, K]
    xx = torch.cat([torch.zeros(K - 1, qkv.shape[1], dtype=x.dtype), qkv])
    conv = sum(w[:, j] * xx[j:j + T] for j in range(K))
    conv = F.silu(conv)
    q, k, v = torch.split(conv, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k, v = q.reshape(T, Hk, dk), k.reshape(T, Hk, dk), v.reshape(T, Hv, dv)
    beta = torch.sigmoid(b)
    gl = -t[p + "A_log"].double().exp() * F.softplus(a + t[p + "dt_bias"].double())
    r = Hv // Hk
    S = torch.zeros(Hv, dk, dv, dtype=x.dtype)
    o = torch.zeros(T, Hv, dv, dtype=x.dtype)
    for s in range(T):
        for j in range(Hv):
            h = j // r
            qt, kt = l2n(q[s, h]) * dk ** -0.5, l2n(k[s, h])
            S[j] = torch.exp(gl[s, j]) * S[j]
            S[j] = S[j] + torch.outer(kt, beta[s, j] * (v[s, j] - S[j].T @ kt))
            o[s, j] = S[j].T @ qt
    zz = z.reshape(T, Hv, dv)
    y = t[p + "norm.weight"].double() * rms(o, c["rms_norm_eps"]) * F.silu(zz)
    return y.reshape(T, Hv * dv) @ t[p + "out_proj.weight"].double().T


def attn_layer64(x, t, p, c, interleaved=True):
    """Float64 gated full attention from the formulas. x [T, H] -> [T, H]."""
    nH, nKV, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]
    rp = c["rope_parameters"]
    rd = int(D * rp["partial_rotary_factor"])
    x = x.double()
    T = x.shape[0]
    qg = x @ t[p + "q_proj.weight"].double().T               # [T, nH*2D]
    if interleaved:
        qg = qg.reshape(T, nH, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
    else:  # control
        q, gate = qg[:, :nH * D].reshape(T, nH, D), qg[:, nH * D:].reshape(T, nH, D)
    k = (x @ t[p + "k_proj.weight"].double().T).reshape(T, nKV, D)
    v = (x @ t[p + "v_proj.weight"].double().T).reshape(T, nKV, D)
    q = rms(q, eps) * (1 + t[p + "q_norm.weight"].double())
    k = rms(k, eps) * (1 + t[p + "k_norm.weight"].double())
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(u):
        rr, rest = u[..., :rd], u[..., rd:]
        rot = torch.cat([-rr[..., rd // 2:], rr[..., :rd // 2]], dim=-1)
        return torch.cat([rr * cos + rot * sin, rest], dim=-1)

    q, k = rope(q), rope(k)
    out = torch.zeros(T, nH, D, dtype=x.dtype)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(nH):
        kh = h // (nH // nKV)
        s = (q[:, h] @ k[:, kh].T) * D ** -0.5
        out[:, h] = torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v[:, kh]
    out = out * torch.sigmoid(gate)
    return out.reshape(T, nH * D) @ t[p + "o_proj.weight"].double().T


def check_mixers(name, model, d, samples, c):
    """The layout checks of the docstring, on every layer and sample."""
    t = mm.tensors(d)
    layers = model.model.layers
    Hk, Hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    rows, naive = gdn_rows(Hk, Hv, dk, dv), gdn_rows_naive(Hk, Hv, dk, dv)
    assert sorted(rows[0] + rows[1]) == list(range(2 * Hk * dk + 2 * Hv * dv))
    assert sorted(rows[2] + rows[3]) == list(range(2 * Hv))
    cur = {}
    handles = []
    for i, lay in enumerate(layers):
        mixer = lay.linear_attn if c["layer_types"][i] == "linear_attention" else lay.self_attn

        def pre(_m, args, kwargs, i=i):
            cur.setdefault(i, {})["x"] = (kwargs.get("hidden_states", args[0] if args else None))[0].detach().clone()

        def post(_m, args, kwargs, out, i=i):
            cur[i]["y"] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()
        handles.append(mixer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mixer.register_forward_hook(post, with_kwargs=True))
        if c["layer_types"][i] == "linear_attention":
            orig = mixer.fix_query_key_value_ordering

            def fix(mixed_qkvz, mixed_ba, i=i, orig=orig):
                res = orig(mixed_qkvz, mixed_ba)
                cur[i]["fix"] = [r[0].detach().clone() for r in res]
                return res
            mixer.fix_query_key_value_ordering = fix
    worst = {"proj_f32_absmax": 0.0, "proj_f64_absmax": 0.0, "gdn_rel": 0.0, "attn_rel": 0.0}
    ctrl = {"gdn_naive_rel": math.inf, "attn_not_interleaved_rel": math.inf}
    try:
        with torch.no_grad():
            for s in samples:
                cur.clear()
                model(input_ids=torch.tensor([s["input_ids"]]))
                for i in range(len(layers)):
                    x, y = cur[i]["x"], cur[i]["y"]
                    p = f"model.layers.{i}."
                    if c["layer_types"][i] == "linear_attention":
                        q, k, v, z, b, a = cur[i]["fix"]
                        T = x.shape[0]
                        hf_qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
                        hf = [hf_qkv, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1)]
                        W = t[p + "linear_attn.in_proj_qkvz.weight"]
                        Wba = t[p + "linear_attn.in_proj_ba.weight"]
                        mats = [W[rows[0]], W[rows[1]], Wba[rows[2]], Wba[rows[3]]]
                        for hv, mw in zip(hf, mats):
                            worst["proj_f32_absmax"] = max(worst["proj_f32_absmax"],
                                                           float((F.linear(x, mw.float()) - hv).abs().max()))
                            worst["proj_f64_absmax"] = max(worst["proj_f64_absmax"],
                                                           float((x.double() @ mw.double().T - hv).abs().max()))
                        worst["gdn_rel"] = max(worst["gdn_rel"],
                                               mt.rel_max(y, gdn_layer64(x, t, p + "linear_attn.", c, rows)))
                        if T > 1:
                            ctrl["gdn_naive_rel"] = min(ctrl["gdn_naive_rel"], mt.rel_max(
                                y, gdn_layer64(x, t, p + "linear_attn.", c, naive)))
                    else:
                        worst["attn_rel"] = max(worst["attn_rel"], mt.rel_max(y, attn_layer64(x, t, p + "self_attn.", c)))
                        ctrl["attn_not_interleaved_rel"] = min(ctrl["attn_not_interleaved_rel"], mt.rel_max(
                            y, attn_layer64(x, t, p + "self_attn.", c, interleaved=False)))
    finally:
        for h in handles:
            h.remove()
        for lay in layers:
            if hasattr(lay, "linear_attn"):
                del lay.linear_attn.fix_query_key_value_ordering
    print(f"    {name}: GDN projections rebuilt by the documented row permutation vs HF's "
          f"fix_query_key_value_ordering (q|k|v, z, b, a; every GDN layer and sample): max abs diff "
          f"f32 {worst['proj_f32_absmax']:.2e}, f64 {worst['proj_f64_absmax']:.2e}")
    print(f"    {name}: float64 layers from the formulas vs HF's module outputs, max|a-b|/max|b|: "
          f"GDN {worst['gdn_rel']:.2e}, gated attention {worst['attn_rel']:.2e}; controls (min): "
          f"GDN with naive contiguous q|k|v|z, b|a split {ctrl['gdn_naive_rel']:.2e}, "
          f"attention with q_proj as [queries | gates] {ctrl['attn_not_interleaved_rel']:.2e}")
    assert worst["proj_f32_absmax"] < 1e-5 and worst["proj_f64_absmax"] < 1e-5, worst
    assert worst["gdn_rel"] < 1e-5 and worst["attn_rel"] < 1e-5, worst
    assert all(v > 1e-2 for v in ctrl.values()), ctrl


def build_qwen3_next(name, seed):
    m = q3n_module()
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    cfg = transformers.Qwen3NextConfig(**q3n_config())
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2, cfg.layer_types
    model = m.Qwen3NextForCausalLM(cfg)
    sparse = [q3n_is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)]
    assert sparse == [True, False] + [True] * 6, sparse
    assert [isinstance(lay.mlp, m.Qwen3NextSparseMoeBlock) for lay in model.model.layers] == sparse
    assert isinstance(model.model.layers[1].mlp, m.Qwen3NextMLP)
    assert model.model.layers[1].mlp.gate_proj.weight.shape == (cfg.intermediate_size, cfg.hidden_size)
    q3n_init_weights(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["model_type"] == "qwen3_next" and c["architectures"] == ["Qwen3NextForCausalLM"], c
    assert c["layer_types"] == cfg.layer_types
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.rope_parameters == cfg.rope_parameters and back.layer_types == cfg.layer_types
    assert back.mlp_only_layers == [1] and back.norm_topk_prob is True
    hdr = mm.header(d)
    assert all(dt == "BF16" for dt, _ in hdr.values()), {k: v for k, v in hdr.items() if v[0] != "BF16"}
    want = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,),
            "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        want.update(expected_keys(c, i, sparse[i], cfg.layer_types[i] == "linear_attention"))
    have = {k: s for k, (_, s) in hdr.items()}
    assert have == want, (sorted(set(have) ^ set(want)), {k: (have.get(k), want[k]) for k in want
                                                            if have.get(k) != want[k]})
    # The per-expert tensors on disk are the in-memory fused ones (gate rows first).
    t = mm.tensors(d)
    I = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        if sparse[i]:
            ex = model.model.layers[i].mlp.experts
            for e in range(cfg.num_experts):
                pre = f"model.layers.{i}.mlp.experts.{e}"
                assert torch.equal(ex.gate_up_proj[e, :I], t[pre + ".gate_proj.weight"])
                assert torch.equal(ex.gate_up_proj[e, I:], t[pre + ".up_proj.weight"])
                assert torch.equal(ex.down_proj[e], t[pre + ".down_proj.weight"])
    print(f"    {name}: config.json keys: {sorted(c)}")
    for i in (0, 1, 3):
        print(f"    {name}: layer {i}: " + "; ".join(
            f"{k[len(f'model.layers.{i}.'):]} {hdr[k][0]} {list(hdr[k][1])}" for k in sorted(hdr)
            if k.startswith(f"model.layers.{i}.") and ".experts." not in k))

    def extra(model_fp32, samples, hs_all):
        assert model_fp32.config._experts_implementation == "eager"
        assert [isinstance(lay.mlp, m.Qwen3NextSparseMoeBlock) for lay in model_fp32.model.layers] == sparse
        check_mixers(name, model_fp32, d, samples, c)
        mm.check_moe(name, model_fp32, d, samples, torch.cat(hs_all, dim=1), sparse, cfg.num_experts,
                     cfg.num_experts_per_tok, I, True, True, lambda i: f"model.layers.{i}.mlp",
                     dense_inter=cfg.intermediate_size)
        q3n_check_gdn_core(model_fp32, samples, hs_all)

    mt.record(d, mt.make_inputs(cfg.vocab_size, seed + 1, LENGTHS), os.path.join(d, "reference"), extra,
              load_kwargs=EAGER, made_by=ME, note=NOTE)
    print(f"    {name}: every tensor BF16, experts per expert; {mt.dir_size(d)} bytes")


def q3n_check_gdn_core(model, samples, hs_all):
    """The whole model with HF's token-by-token recurrent delta rule in place
    of the chunked one it ran (chunk 64): what a recurrent C implementation
    would get."""
    m = q3n_module()
    chunk, rec = m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule

    def f(query, key, value, g=None, beta=None, chunk_size=64, **kw):
        return rec(query, key, value, g=g, beta=beta, **kw)
    try:
        m.torch_chunk_gated_delta_rule = f
        alt = mm.states(model, samples)
    finally:
        m.torch_chunk_gated_delta_rule = chunk
    ref = torch.cat(hs_all, dim=1)
    per = [mt.nmse(alt[k], ref[k]) for k in range(ref.shape[0])]
    print(f"    whole model with HF's recurrent float32 core instead of the chunked one: "
          f"nmse per hidden state max {max(per):.2e} (last {per[-1]:.2e})")
    assert max(per) < 1e-9, per


def main():
    builders = {"qwen3-next": lambda: build_qwen3_next("qwen3-next", seed=111)}
    return mt.run_builders("make_targets_qwen3next", builders,
                           "Make the Qwen3-Next target fixture under tests/fixtures/targets/.")


if __name__ == "__main__":
    sys.exit(main())
