#!/usr/bin/env python3
"""Golden fixtures for gpt-oss targets (GptOssForCausalLM).

Made the same way as make_targets.py's and make_targets_moe.py's (this script
imports make_targets.py's record, make_inputs, run_builders): tiny random
models built with transformers in f32, cast to bf16, saved, reloaded in f32
and what HF computes recorded in NAME/reference/ (inputs.jsonl and
expected.safetensors: input_ids, cu, hidden_states [L+1,T,H], last_prenorm,
argmax, gap; see make_targets.py), with attn_implementation="eager" and
experts_implementation="eager" (GptOssExperts' per-expert loop).

Both fixtures (tests/fixtures/targets/): GptOssForCausalLM, 4 layers,
layer_types [sliding_attention, full_attention] x 2, sliding_window 6 (HF's
mask: query q sees keys k with q - 6 < k <= q, i.e. 6 keys including itself),
4 q heads / 2 kv heads, head_dim 16 (nH*D = 64), attention_bias true (q, k,
v, o biases), one attention sink per q head, vocab 151, untied lm_head,
rms_norm_eps 1e-5, E 6 experts, top-k 2, YaRN RoPE as gpt-oss's
(rope_type yarn, factor 4, original_max_position_embeddings 16,
beta_fast 32, beta_slow 1, truncate false, theta 150000,
max_position_embeddings 64 = 16 x 4; attention factor 0.1 ln 4 + 1 =
1.138629 on cos and sin). Samples of 17, 1, 9, 70, 40 tokens (9 and more
cross the window; 70 passes max_position_embeddings).

  gpt-oss          H 40, expert I 20, swiglu_limit 2.0, swiglu_alpha 1.702;
                   saved by save_pretrained (config.json as it writes it:
                   5.x spelling rope_parameters, dtype, swiglu_alpha).
                   Every tensor BF16 (sinks and norms included), per layer i:
                     model.layers.{i}.input_layernorm.weight          [H]
                     model.layers.{i}.post_attention_layernorm.weight [H]
                     model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}
                       q [64, H] + [64], k, v [32, H] + [32], o [H, 64] + [H]
                     model.layers.{i}.self_attn.sinks                 [nH] = [4]
                     model.layers.{i}.mlp.router.weight               [E, H]
                     model.layers.{i}.mlp.router.bias                 [E]
                     model.layers.{i}.mlp.experts.gate_up_proj        [E, H, 2I]
                     model.layers.{i}.mlp.experts.gate_up_proj_bias   [E, 2I]
                     model.layers.{i}.mlp.experts.down_proj           [E, I, H]
                     model.layers.{i}.mlp.experts.down_proj_bias      [E, H]
                   plus model.embed_tokens.weight [V, H], model.norm.weight
                   [H], lm_head.weight [V, H]. The expert matrices are stored
                   input-major (x @ W, no transpose: gate_up = x @
                   gate_up_proj[e] + gate_up_proj_bias[e]) and gate / up are
                   INTERLEAVED along the last axis: gate = gate_up[..., 0::2],
                   up = gate_up[..., 1::2] (column 2j is gate unit j, 2j+1 up
                   unit j; same for gate_up_proj_bias).
  gpt-oss-mxfp4    the released gpt-oss layout: H 64, expert I 32 (MXFP4
                   blocks are 32 wide along the input axis, so H and I must
                   be multiples of 32), swiglu_limit 3.0. The expert matrices
                   as MXFP4, all else BF16:
                     model.layers.{i}.mlp.experts.gate_up_proj_blocks U8 [E, 2I, H/32, 16]
                     model.layers.{i}.mlp.experts.gate_up_proj_scales U8 [E, 2I, H/32]
                     model.layers.{i}.mlp.experts.down_proj_blocks    U8 [E, H, I/32, 16]
                     model.layers.{i}.mlp.experts.down_proj_scales    U8 [E, H, I/32]
                     model.layers.{i}.mlp.experts.gate_up_proj_bias   BF16 [E, 2I]
                     model.layers.{i}.mlp.experts.down_proj_bias      BF16 [E, H]
                   (the other names and shapes as gpt-oss's, with H 64).
                   Packed rows are OUTPUT features, columns input features,
                   i.e. the transpose of the parameter: gate_up packed
                   W[e] [2I, H] = gate_up_proj[e]^T, down packed [H, I] =
                   down_proj[e]^T (transformers' convert_moe_packed_tensors
                   decodes [E, R, G, 16] to [E, R, G*32] and returns it
                   transposed, [E, G*32, R], which becomes the parameter).
                   So packed gate_up row 2j is gate unit j and row 2j+1 up
                   unit j (interleaved rows, not halves), gate_up_proj_bias
                   interleaved the same way. Row r, block b covers inputs
                   32b..32b+31; byte m of the block holds input 32b+2m in its
                   LOW nibble and 32b+2m+1 in its HIGH nibble; a nibble is an
                   e2m1 code: bit 3 sign, bits 0-2 index into
                   [0, 0.5, 1, 1.5, 2, 3, 4, 6] (code 8 is -0); value = code
                   value * 2^(scale - 127), scale one u8 (e8m0) per row and
                   block. Codes uniform over all 16, exponents uniform in
                   -8..-2 (weights up to 1.5, rms about 0.3), so every weight
                   is exactly representable in bf16 and f32.
                   config.json in the released spelling (transformers 4.55's:
                   rope_theta + rope_scaling, torch_dtype, no swiglu_alpha,
                   which defaults to 1.702) with
                     "quantization_config": {"quant_method": "mxfp4",
                       "modules_to_not_convert": ["model.layers.*.self_attn",
                       "model.layers.*.mlp.router", "model.embed_tokens",
                       "lm_head"]}
                   as gpt-oss-20b's. One model.safetensors (the released
                   files are sharded; names are the same).
                   Oracle: transformers loading this directory itself,
                   from_pretrained(..., quantization_config=
                   Mxfp4Config(dequantize=True)) (the Mxfp4 quantizer's
                   Mxfp4Dequantize op, which calls convert_moe_packed_tensors
                   into the f32 parameters; the model is then the plain
                   GptOssExperts). Checked: the loaded gate_up_proj /
                   down_proj equal the intended values exactly (decoded here
                   from the format, not with transformers' code); a plain
                   bf16 save_pretrained of the same dequantized weights run
                   through HF gives identical hidden_states. Without
                   dequantize=True transformers 5.25 first requires
                   accelerate (not installed here: ImportError), then uses
                   the triton kernels if triton and kernels are installed
                   (they are here), dequantizing only when they are not.

The gpt-oss block, x = input_layernorm / post_attention_layernorm output
(RMSNorm: w * x / sqrt(mean(x^2) + eps), weight not 1+w), all f32:
  attention: q, k, v = x W^T + b; RoPE on q, k (halves: (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), YaRN inv_freq, cos/sin times the
    attention factor); scores = q k^T / sqrt(D) + mask (causal; sliding
    layers also the window); per head, the sink s_h joins the softmax as an
    extra logit: p = softmax([scores, s_h]) with the sink column dropped
    afterwards (rows sum to < 1, no value for the sink); o = (p v) W_o^T + b_o.
  MoE: logits = x W_r^T + b_r                [T, E]
       (top, idx) = topk(logits, k)          top-k of the LOGITS
       w = softmax(top)                      softmax over the k selected
                                             logits only (so they sum to 1)
       for each chosen expert e: h = x @ gate_up_proj[e] + gate_up_proj_bias[e]
         gate = min(h[0::2], limit); up = clamp(h[1::2], -limit, limit)
         a = gate * sigmoid(alpha * gate) * (up + 1)
         out_e = a @ down_proj[e] + down_proj_bias[e]
       y = sum_j w_j out_{idx_j}   (HF adds the experts in increasing expert
       id, not rank order)
  layer: r = r + attention(norm1(r)); r = r + MoE(norm2(r)).
  Checked by a float64 re-implementation reading the weights from the
  fixture's files (both layouts; the MXFP4 one decoded from the bytes) against
  HF's GptOssMLP outputs, with controls that must miss: softmax over all E
  then top-k, gate/up as halves (chunk) instead of interleaved, no clamp,
  no "+1" on up, no router bias; whole-model controls: no sliding window, no
  sinks, YaRN attention factor 1.

Weights (random, far from HF's init): Linear / Embedding weights
N(0, 0.1^2), every bias (attention, router, experts) N(0, 0.1^2), sinks
N(0, 1), router weight N(0, 0.5^2), RMSNorm weights 1 + N(0, 0.2^2);
gpt-oss experts gate_up_proj N(0, 0.3^2), down_proj N(0, 0.1^2);
gpt-oss-mxfp4 experts random MXFP4 as above. swiglu_limit is lowered from the
released 7.0 so that both clamps are hit often: at 7.0 they almost never
would be with these weights (fractions printed). Printed and asserted: every
expert of every layer gets tokens; the smallest router logit gap between
the k-th and (k+1)-th (and 1st and 2nd) logits above 1e-4 (a near-tie could
flip the choice or order; CPU torch.topk's order among exact ties is not the
lowest index first); clamp fractions within (0.05, 0.95) for gate and up.

Measured (torch 2.15 CPU, transformers 5.25):
                                      gpt-oss        gpt-oss-mxfp4
  clamped: gate > limit, |up| > limit 0.151, 0.306   0.086, 0.180
     (at limit 7.0)                   0.0005, 0.0005 0.015, 0.033
  tokens per expert, min              12             24
  min router logit gap                2.04e-03       1.71e-03
  float64 MLP block vs HF, max rel    2.9e-07        3.1e-07
  controls, block max rel: softmax_all 2.6e-01 / 2.1e-01, chunk 1.5 / 1.6,
     no_clamp 2.6 / 3.9, no_up_plus_1 5.8e-01 / 5.2e-01,
     no_router_bias 5.4e-01 / 3.8e-01
  whole-model controls, nmse of the last state: no_window 0.94 / 1.4,
     no_sinks 0.41 / 0.23, yarn_attention_factor_1 0.16 / 0.40
  gpt-oss-mxfp4: transformers' dequantized experts == intended values
  (exact); plain bf16 save of them through HF == reference (identical).

Run: python3 tests/reference/make_targets_gptoss.py [--only NAME,...]
     (torch + transformers, CPU, a few seconds; deterministic: a rerun gives
     the same bytes. No other fixture is touched.)
"""
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_targets as mt  # noqa: E402
from make_targets_moe import header, samples_of, states, tensors  # noqa: E402

OUT = mt.OUT
ME = "tests/reference/make_targets_gptoss.py"
EAGER = {"experts_implementation": "eager"}
NOTE = ", eager experts loop"
LENGTHS = [17, 1, 9, 70, 40]
ROUTER_STD = 0.5
GATE_UP_STD = 0.3
DOWN_STD = 0.1
BIAS_STD = 0.1
MIN_LOGIT_GAP = 1e-4
# e2m1 magnitudes of codes 0..7; bit 3 is the sign (codes 8..15 negative)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
RELEASED_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gptoss_config(H, I, limit):
    return transformers.GptOssConfig(
        vocab_size=151, hidden_size=H, intermediate_size=I, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=6, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6,
        max_position_embeddings=64,  # = original 16 x factor 4, as gpt-oss's 4096 x 32 = 131072
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False},
        attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False, swiglu_limit=limit)


def init_weights(model, seed):
    m = transformers.models.gpt_oss.modeling_gpt_oss
    g = torch.Generator().manual_seed(seed)
    own = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            own[f"{mname}.{pname}" if mname else pname] = (mod, pname)
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod, pn = own[name]
            r = torch.randn(p.shape, generator=g)
            if isinstance(mod, m.GptOssRMSNorm):
                kind, v = "norm", 1 + 0.2 * r
            elif pn == "sinks":
                kind, v = "sinks", r
            elif isinstance(mod, m.GptOssTopKRouter):
                kind, v = ("router", ROUTER_STD * r) if pn == "weight" else ("bias", BIAS_STD * r)
            elif isinstance(mod, m.GptOssExperts):
                kind, v = {"gate_up_proj": ("gate_up", GATE_UP_STD * r), "down_proj": ("down", DOWN_STD * r)}.get(
                    pn, ("bias", BIAS_STD * r))
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                kind, v = ("matrix", 0.1 * r) if pn == "weight" else ("bias", BIAS_STD * r)
            else:
                raise AssertionError(f"no init rule for {name}")
            p.copy_(v)
            seen.add(kind)
    assert seen == {"norm", "sinks", "router", "bias", "gate_up", "down", "matrix"}, seen


def load(d, **kw):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **EAGER, **kw)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config._experts_implementation == "eager"
    return model.eval()


def print_header(name, d):
    hdr = header(d)
    print(f"    {name}: model.safetensors header ({len(hdr)} tensors):")
    for k in sorted(hdr, key=lambda k: (k.split(".")[2] if k.startswith("model.layers.") else "", k)):
        if k.startswith("model.layers.") and not k.startswith("model.layers.0."):
            continue
        print(f"      {k:52s} {hdr[k][0]:5s} {list(hdr[k][1])}")
    print("      (model.layers.1-3.* as model.layers.0.*)")
    return hdr


# ---------------------------------------------------------------------------
# MXFP4, written from the format (OCP MX e2m1 + e8m0), not from transformers.

def fp4_decode(codes):
    """codes: int tensor of 0..15 -> float64 e2m1 values (bit 3 sign)."""
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def mxfp4_random(g, E, R, C, exp_lo, exp_hi):
    """Random packed weights of logical shape [E, R, C] (R rows = output
    features, C = input features, blocks of 32 along C). Returns (blocks u8
    [E, R, C/32, 16], scales u8 [E, R, C/32], values float64 [E, R, C])."""
    assert C % 32 == 0
    codes = torch.randint(0, 16, (E, R, C), generator=g)
    exps = torch.randint(exp_lo, exp_hi + 1, (E, R, C // 32), generator=g)
    lo, hi = codes[..., 0::2], codes[..., 1::2]                      # element 2j low nibble, 2j+1 high
    blocks = (lo | (hi << 4)).to(torch.uint8).reshape(E, R, C // 32, 16)
    scales = (exps + 127).to(torch.uint8)
    values = fp4_decode(codes) * torch.pow(2.0, exps.double()).repeat_interleave(32, dim=-1)
    return blocks, scales, values


def mxfp4_unpack(blocks, scales):
    """Inverse of the packing above, from the bytes: [E, R, C] float64."""
    b = blocks.to(torch.int64)
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-2], -1)
    e = scales.to(torch.int64) - 127
    return fp4_decode(codes) * torch.pow(2.0, e.double()).repeat_interleave(32, dim=-1)


# ---------------------------------------------------------------------------
# The MLP block from the formulas, float64, weights from the fixture's files.

def expert_params(t, i):
    """(gate_up [E, H, 2I], gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H]) float64,
    from either layout: bf16 parameters or MXFP4 packed rows (transposed here)."""
    p = f"model.layers.{i}.mlp.experts."
    if p + "gate_up_proj" in t:
        gu, dn = t[p + "gate_up_proj"].double(), t[p + "down_proj"].double()
    else:
        gu = mxfp4_unpack(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"]).transpose(1, 2)
        dn = mxfp4_unpack(t[p + "down_proj_blocks"], t[p + "down_proj_scales"]).transpose(1, 2)
    return gu, t[p + "gate_up_proj_bias"].double(), dn, t[p + "down_proj_bias"].double()


def mlp_reference(x, t, i, k, limit, alpha, variant=None, stats=None):
    """GptOssMLP output for x [T, H] (post_attention_layernorm output), float64.
    variant (controls that must miss): "softmax_all" (softmax over all E then
    top-k, no renormalisation), "chunk" (gate = first I columns, up = last I),
    "no_clamp", "no_up_plus_1", "no_router_bias"."""
    x = x.double()
    pre = f"model.layers.{i}.mlp.router."
    bias = t[pre + "bias"].double() * (0 if variant == "no_router_bias" else 1)
    logits = x @ t[pre + "weight"].double().T + bias
    top, idx = logits.topk(k, dim=-1)
    w = torch.softmax(top, dim=-1)
    if variant == "softmax_all":
        w = torch.softmax(logits, dim=-1).gather(1, idx)
    gu, gb, dn, db = expert_params(t, i)
    y = torch.zeros_like(x)
    I = gu.shape[-1] // 2
    for e in range(gu.shape[0]):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if not len(rows):
            continue
        h = x[rows] @ gu[e] + gb[e]
        gate, up = (h[:, :I], h[:, I:]) if variant == "chunk" else (h[:, 0::2], h[:, 1::2])
        if stats is not None:
            stats["gate7"] += int((gate > 7.0).sum())
            stats["up7"] += int((up.abs() > 7.0).sum())
            stats["gate"] += int((gate > limit).sum())
            stats["up"] += int((up.abs() > limit).sum())
            stats["n"] += gate.numel()
        if variant != "no_clamp":
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = gate * torch.sigmoid(alpha * gate) * (up + (0 if variant == "no_up_plus_1" else 1))
        y[rows] += w[rows, slot, None] * (act @ dn[e] + db[e])
    return y, logits, idx


def capture_mlp(model, samples):
    layers = model.model.layers
    got = {i: [] for i in range(len(layers))}
    cur = {}

    def hook(i):
        def f(_m, inp, out):
            cur[i] = (inp[0][0].detach().clone(), out[0][0].detach().clone())
        return f

    hs = [layers[i].mlp.register_forward_hook(hook(i)) for i in range(len(layers))]
    try:
        with torch.no_grad():
            for s in samples:
                cur.clear()
                model(input_ids=torch.tensor([s["input_ids"]]))
                for i in cur:
                    got[i].append(cur[i])
    finally:
        for h in hs:
            h.remove()
    return got


def check_mlp(name, model, d, samples):
    """The float64 block from the files vs HF's GptOssMLP outputs, per layer;
    routing margins, expert coverage, clamp fractions; controls."""
    cfg = model.config
    t = tensors(d)
    got = capture_mlp(model, samples)
    stats = {"gate": 0, "up": 0, "n": 0, "gate7": 0, "up7": 0}
    worst, min_gap, min_cnt = 0.0, float("inf"), None
    ctrl = {v: 0.0 for v in ("softmax_all", "chunk", "no_clamp", "no_up_plus_1", "no_router_bias")}
    for i, pairs in got.items():
        x = torch.cat([a for a, _ in pairs])
        ref = torch.cat([b for _, b in pairs]).double()
        y, logits, idx = mlp_reference(x, t, i, cfg.num_experts_per_tok, cfg.swiglu_limit, cfg.swiglu_alpha,
                                       stats=stats)
        rel = ((y - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, rel)
        srt = logits.sort(dim=-1, descending=True).values
        k = cfg.num_experts_per_tok
        min_gap = min(min_gap, (srt[:, k - 1] - srt[:, k]).min().item(), (srt[:, 0] - srt[:, 1]).min().item())
        cnt = torch.bincount(idx.flatten(), minlength=cfg.num_local_experts)
        min_cnt = int(cnt.min()) if min_cnt is None else min(min_cnt, int(cnt.min()))
        for v in ctrl:
            yc = mlp_reference(x, t, i, k, cfg.swiglu_limit, cfg.swiglu_alpha, variant=v)[0]
            ctrl[v] = max(ctrl[v], ((yc - ref).abs().max() / ref.abs().max()).item())
    fg, fu = stats["gate"] / stats["n"], stats["up"] / stats["n"]
    print(f"    {name}: float64 MLP block from the files vs HF, max|a-b|/max|b| over layers {worst:.1e}; "
          f"min router logit gap (k-th - (k+1)-th, and 1st - 2nd) {min_gap:.2e}; tokens per expert min {min_cnt}")
    print(f"    {name}: swiglu_limit {cfg.swiglu_limit}: clamped fraction over {stats['n']} routed (token, expert, "
          f"unit) values: gate > limit {fg:.3f}, |up| > limit {fu:.3f} (at the released 7.0: "
          f"{stats['gate7'] / stats['n']:.4f}, {stats['up7'] / stats['n']:.4f})")
    print(f"    {name}: controls (max rel, must miss): " + ", ".join(f"{k} {v:.1e}" for k, v in ctrl.items()))
    assert worst < 1e-5, worst
    assert min_gap > MIN_LOGIT_GAP, min_gap
    assert min_cnt > 0
    assert 0.05 < fg < 0.95 and 0.05 < fu < 0.95, (fg, fu)
    assert all(v > 1e-3 for v in ctrl.values()), ctrl
    return fg, fu


def read_config(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


def write_config(d, c):
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


def expected_keys(cfg, mxfp4):
    H, I, E, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.vocab_size
    nq, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": ("BF16", (V, H)), "model.norm.weight": ("BF16", (H,)),
           "lm_head.weight": ("BF16", (V, H))}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": ("BF16", (H,)), p + "post_attention_layernorm.weight": ("BF16", (H,)),
            p + "self_attn.q_proj.weight": ("BF16", (nq * D, H)), p + "self_attn.q_proj.bias": ("BF16", (nq * D,)),
            p + "self_attn.k_proj.weight": ("BF16", (nkv * D, H)), p + "self_attn.k_proj.bias": ("BF16", (nkv * D,)),
            p + "self_attn.v_proj.weight": ("BF16", (nkv * D, H)), p + "self_attn.v_proj.bias": ("BF16", (nkv * D,)),
            p + "self_attn.o_proj.weight": ("BF16", (H, nq * D)), p + "self_attn.o_proj.bias": ("BF16", (H,)),
            p + "self_attn.sinks": ("BF16", (nq,)),
            p + "mlp.router.weight": ("BF16", (E, H)), p + "mlp.router.bias": ("BF16", (E,)),
            p + "mlp.experts.gate_up_proj_bias": ("BF16", (E, 2 * I)),
            p + "mlp.experts.down_proj_bias": ("BF16", (E, H)),
        })
        if mxfp4:
            out.update({p + "mlp.experts.gate_up_proj_blocks": ("U8", (E, 2 * I, H // 32, 16)),
                        p + "mlp.experts.gate_up_proj_scales": ("U8", (E, 2 * I, H // 32)),
                        p + "mlp.experts.down_proj_blocks": ("U8", (E, H, I // 32, 16)),
                        p + "mlp.experts.down_proj_scales": ("U8", (E, H, I // 32))})
        else:
            out.update({p + "mlp.experts.gate_up_proj": ("BF16", (E, H, 2 * I)),
                        p + "mlp.experts.down_proj": ("BF16", (E, I, H))})
    return out


def check_controls(name, model, samples, hs_all):
    """Whole-model controls that must move the last hidden state: no sliding
    window, no sinks, YaRN without its attention factor."""
    ref = torch.cat(hs_all, dim=1)
    rot = model.model.rotary_emb
    res = {}

    def run(key):
        res[key] = mt.nmse(states(model, samples)[-1], ref[-1])

    with torch.no_grad():
        assert torch.equal(states(model, samples), ref)
        sw = model.config.sliding_window
        model.config.sliding_window = 10 ** 6
        run("no_window")
        model.config.sliding_window = sw
        sinks = [lay.self_attn.sinks.detach().clone() for lay in model.model.layers]
        for lay in model.model.layers:
            lay.self_attn.sinks.fill_(-1e30)
        run("no_sinks")
        for lay, v in zip(model.model.layers, sinks):
            lay.self_attn.sinks.copy_(v)
        af = rot.attention_scaling
        rot.attention_scaling = 1.0
        run("yarn_attention_factor_1")
        rot.attention_scaling = af
        assert torch.equal(states(model, samples), ref)
    print(f"    {name}: YaRN attention factor {af:.6f}; whole-model controls, nmse of the last state (must miss): "
          + ", ".join(f"{k} {v:.1e}" for k, v in res.items()))
    assert all(v > 1e-4 for v in res.values()), res


def extra_check(name, d):
    def f(model, samples, hs_all):
        check_mlp(name, model, d, samples)
        check_controls(name, model, samples, hs_all)
    return f


# ---------------------------------------------------------------------------

def build_gpt_oss(name, seed, H=40, I=20, limit=None):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    cfg = gptoss_config(H, I, limit)
    model = transformers.GptOssForCausalLM(cfg)
    init_weights(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d)
    c = read_config(d)
    assert c["architectures"] == ["GptOssForCausalLM"] and c["model_type"] == "gpt_oss"
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.rope_parameters == cfg.rope_parameters and back.layer_types == cfg.layer_types
    hdr = print_header(name, d)
    assert hdr == expected_keys(cfg, mxfp4=False), set(hdr.items()) ^ set(expected_keys(cfg, False).items())
    print(f"    {name}: config.json as save_pretrained writes it: {json.dumps(c, sort_keys=True)}")
    mt.record(d, mt.make_inputs(cfg.vocab_size, seed + 1, LENGTHS), os.path.join(d, "reference"),
              extra_check(name, d), load_kwargs=EAGER, made_by=ME, note=NOTE)
    print(f"    {name}: {mt.dir_size(d)} bytes")


def build_gpt_oss_mxfp4(name, seed, H=64, I=32, limit=None, exp_lo=-8, exp_hi=-2):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    cfg = gptoss_config(H, I, limit)
    model = transformers.GptOssForCausalLM(cfg)
    init_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 7)
    E, L = cfg.num_local_experts, cfg.num_hidden_layers
    packed, intended = {}, {}
    with torch.no_grad():
        for i in range(L):
            ex = model.model.layers[i].mlp.experts
            p = f"model.layers.{i}.mlp.experts."
            # packed rows = output features: gate_up [E, 2I, H], down [E, H, I]
            gb, gs, gv = mxfp4_random(g, E, 2 * I, H, exp_lo, exp_hi)
            db, ds, dv = mxfp4_random(g, E, H, I, exp_lo, exp_hi)
            assert torch.equal(mxfp4_unpack(gb, gs), gv) and torch.equal(mxfp4_unpack(db, ds), dv)
            packed.update({p + "gate_up_proj_blocks": gb, p + "gate_up_proj_scales": gs,
                           p + "down_proj_blocks": db, p + "down_proj_scales": ds})
            # the parameters are the transposes: gate_up_proj [E, H, 2I], down_proj [E, I, H]
            intended[p + "gate_up_proj"] = gv.transpose(1, 2).contiguous()
            intended[p + "down_proj"] = dv.transpose(1, 2).contiguous()
            ex.gate_up_proj.copy_(intended[p + "gate_up_proj"])
            ex.down_proj.copy_(intended[p + "down_proj"])
    model = model.to(torch.bfloat16)
    for k, v in intended.items():  # exactly representable in bf16
        assert torch.equal(model.get_parameter(k).double(), v), k
    with tempfile.TemporaryDirectory() as plain:
        model.save_pretrained(plain)  # the dequantized weights as a plain bf16 checkpoint
        t = tensors(plain)
        for k in intended:
            del t[k]
        t.update(packed)
        os.makedirs(d)
        save_file({k: t[k].contiguous() for k in sorted(t)}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copy(os.path.join(plain, "generation_config.json"), d)
        c = read_config(plain)
        # the released gpt-oss config.json spelling (transformers 4.55): rope_theta + rope_scaling,
        # torch_dtype, no swiglu_alpha (1.702 by default), quantization_config
        c = mt.old_spelling(c)
        assert c.pop("swiglu_alpha") == 1.702
        c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": RELEASED_NOT_CONVERT}
        write_config(d, c)
        back = transformers.AutoConfig.from_pretrained(d)
        assert back.rope_parameters == cfg.rope_parameters and back.swiglu_alpha == 1.702
        hdr = print_header(name, d)
        assert hdr == expected_keys(cfg, mxfp4=True), set(hdr.items()) ^ set(expected_keys(cfg, True).items())
        print(f"    {name}: config.json: {json.dumps(c, sort_keys=True)}")

        qc = transformers.Mxfp4Config(dequantize=True)
        # transformers' own loading of the MXFP4 directory must give the intended values
        hf = load(d, quantization_config=qc)
        for k, v in intended.items():
            got = hf.get_parameter(k)
            assert got.dtype == torch.float32 and torch.equal(got.double(), v), k
        assert isinstance(hf.model.layers[0].mlp.experts, transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts)
        del hf
        mt.record(d, mt.make_inputs(cfg.vocab_size, seed + 1, LENGTHS), os.path.join(d, "reference"),
                  extra_check(name, d), load_kwargs=dict(EAGER, quantization_config=qc), made_by=ME,
                  note=NOTE + ", MXFP4 experts dequantized by transformers (Mxfp4Config(dequantize=True))")
        # the same dequantized weights saved plainly in bf16 give the same states
        ref = load_file(os.path.join(d, "reference", "expected.safetensors"))["hidden_states"]
        hs = states(load(plain), samples_of(d))
        err = mt.nmse(ref, hs) if not torch.equal(ref, hs) else 0.0
        print(f"    {name}: plain bf16 save of the dequantized weights through HF vs reference: "
              f"{'identical' if torch.equal(ref, hs) else f'nmse {err:.2e}'}")
        assert float(err) < 1e-12
    print(f"    {name}: {mt.dir_size(d)} bytes")


def main():
    builders = {
        "gpt-oss": lambda: build_gpt_oss("gpt-oss", seed=111, limit=LIMIT),
        "gpt-oss-mxfp4": lambda: build_gpt_oss_mxfp4("gpt-oss-mxfp4", seed=222, limit=LIMIT_MX),
    }
    return mt.run_builders("make_targets_gptoss", builders, "Make the gpt-oss target fixtures under tests/fixtures/targets/.")


LIMIT = float(os.environ.get("GPTOSS_LIMIT", "2.0"))
LIMIT_MX = float(os.environ.get("GPTOSS_LIMIT_MX", "3.0"))

if __name__ == "__main__":
    sys.exit(main())
