#!/usr/bin/env python3
"""Golden fixtures for mixture-of-experts targets (Qwen3-MoE, Qwen3.5-MoE).

Made the same way as make_targets.py's (whose functions this script imports):
tiny random models built with transformers, weights saved in bf16, reloaded
in fp32, and what HF computes recorded in NAME/reference/ (inputs.jsonl and
expected.safetensors: input_ids, cu, hidden_states [L+1,T,H], last_prenorm,
argmax, gap; see make_targets.py). HF runs with attn_implementation="eager"
and experts_implementation="eager" (the per-expert loop in the modeling
file). transformers' default on CPU, "grouped_mm", agrees on qwen3-moe
(nmse 1.8e-14); it refuses qwen35-moe's expert size (torch's CPU grouped_mm
wants 16-byte strides, 18 floats are 72 bytes).

Fixtures (tests/fixtures/targets/):
  qwen3-moe        Qwen3MoeForCausalLM, layout of the released Qwen3-30B-A3B
                   files: one tensor per expert
                     model.layers.{i}.mlp.gate.weight                 [E, H]  router
                     model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I, H]
                     model.layers.{i}.mlp.experts.{e}.up_proj.weight   [I, H]
                     model.layers.{i}.mlp.experts.{e}.down_proj.weight [H, I]
                   (what save_pretrained writes by default in transformers
                   5.x: its in-memory fused experts are split again on save,
                   "save_original_format"); the dense layer has
                   model.layers.{i}.mlp.{gate,up}_proj.weight [Id, H],
                   mlp.down_proj.weight [H, Id]. config.json in the spelling
                   of the released file (num_experts, rope_theta,
                   rope_scaling null, torch_dtype).
                   H 40, 4 layers, attention 4 q / 2 kv heads, head_dim 16
                   (nH*D = 64 != H), q/k norms, rope theta 1e6, eps 1e-6,
                   vocab 151, untied; E 6 experts, top-k 2, expert I 20,
                   norm_topk_prob true; dense intermediate_size Id 36;
                   decoder_sparse_step 1, mlp_only_layers [1]:
                   layers 0, 2, 3 sparse (MoE), layer 1 dense SwiGLU.
                   Samples of 17, 1, 9, 70, 40 tokens.
  qwen3-moe-fused  the same bf16 weights in transformers 5.x's fused layout
                     model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H]
                       expert e's rows 0..I-1 = its gate_proj, I..2I-1 = up_proj
                       (Qwen3MoeExperts.forward: linear(x, gate_up_proj[e]).chunk(2)
                       -> gate, up; checked against qwen3-moe's files)
                     model.layers.{i}.mlp.experts.down_proj    [E, H, I]
                   (no ".weight" suffix), written by
                   save_pretrained(save_original_format=False), config.json
                   exactly as that writes it (5.x spelling: num_local_experts,
                   rope_parameters, dtype). reference/ is a copy of qwen3-moe's;
                   transformers reproduces it exactly from this directory.
  qwen3-moe-swa    qwen3-moe's shapes (other weights) with use_sliding_window,
                   window 6 on every layer, as Qwen3MoeAttention applies it
                   (max_window_layers 3 in the file, ignored); samples of
                   17, 1, 9, 40, 6 tokens; mt.window_matters checks that the
                   window moves the states of the samples longer than it,
                   and only those
  qwen35-moe       Qwen3_5MoeForCausalLM (text only, model_type
                   qwen3_5_moe_text), saved by save_pretrained as it writes
                   it: per-expert tensors as above, layer_types written.
                   8 layers: Gated DeltaNet at 0-2, 4-6, gated full attention
                   at 3, 7 (as make_targets.py's qwen35: H 48, 4 q / 2 kv heads,
                   head_dim 32, partial rotary 0.25, theta 1e7, mrope [2,1,1]
                   interleaved; GDN 2 k / 4 v heads, dk 16, dv 24, conv 4;
                   vocab 199, untied). MoE MLP in EVERY layer: E 7 experts,
                   top-k 3, expert I 18, plus a shared expert of I_s 26
                   (mlp.shared_expert.{gate,up}_proj.weight [I_s, H],
                   mlp.shared_expert.down_proj.weight [H, I_s],
                   mlp.shared_expert_gate.weight [1, H]).
                   Samples of 17, 1, 9, 70 tokens (70 crosses HF's delta-rule
                   chunk of 64).
  qwen35-moe-vlm   the same weights in the released Qwen3.5-MoE layout
                   (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B):
                   Qwen3_5MoeForConditionalGeneration, config model_type
                   qwen3_5_moe with text_config (qwen3_5_moe_text, NO
                   layer_types: derive it from full_attention_interval 4) and
                   a tiny vision_config; keys model.language_model.*,
                   lm_head.weight, model.visual.* (1-block vision tower),
                   mtp.* (part of an MTP head with a per-expert MoE, as in
                   Qwen3.5-35B-A3B; HF ignores mtp.*); 2 shards + index;
                   routed experts FUSED as in the released files
                   (model.language_model.layers.{i}.mlp.experts.gate_up_proj
                   [E, 2I, H], .down_proj [E, H, I]); linear_attn.A_log and
                   linear_attn.norm.weight F32 (as make_targets.py's
                   qwen35-vlm), all else BF16. reference/ is a copy of
                   qwen35-moe's (reproduced exactly, as the VLM and through
                   AutoModelForCausalLM).

Evidence for the released Qwen3.5-MoE layout (public material found with
the search tools; no checkpoint was downloaded): sgl-project/sglang-jax issue
1251 (an RFC that reads Qwen3.5-35B-A3B's model.safetensors.index.json): each
MoE layer has only mlp.experts.gate_up_proj and mlp.experts.down_proj, no
".weight" suffix, 80 such tensors for 40 layers; shared expert, its gate and
the router as named above; its config.json does carry an explicit
text_config.layer_types (so a reader must take either that or
full_attention_interval; qwen35-moe has layer_types, qwen35-moe-vlm not).
1CatAI/1Cat-vLLM PR 21: Qwen3.6-35B-A3B stores gate_up_proj
[E, 2*I, H] and down_proj [E, H, I], split as gate = rows [:I], up = [I:].
paiml/realizar issue 132: Qwen3.5-35B-A3B gate_up_proj [256, 1024, 2048].
lightllm's Qwen3.5 loader (split_fused_expert_weights: "Qwen3.5-MoE stores
expert weights in fused format") and NVIDIA-NeMo/Megatron-Bridge PR 4706
("Qwen3.5 / Qwen3-VL routed experts are stored fused") say the same.
ISEEKYAN/mbridge PR 145: the MTP layer's experts are per expert
(mtp.layers.0.mlp.experts.{e}.gate_proj.weight) in Qwen3.5-35B-A3B and
fused in Qwen3.6-35B-A3B. transformers agrees: its
checkpoint conversion for qwen3_5_moe_text only merges per-expert keys into
the fused parameters (so both load) and has no transpose (unlike
qwen3_vl_moe, whose files store gate_up_proj [E, H, 2I]).

Which layers are sparse (Qwen3MoeDecoderLayer.__init__, transformers 5.24):
  layer i has a Qwen3MoeSparseMoeBlock iff
      i not in config.mlp_only_layers and config.num_experts > 0
      and (i + 1) % config.decoder_sparse_step == 0
  else a dense Qwen3MoeMLP of config.intermediate_size. mlp_only_layers
  defaults to [] and norm_topk_prob to FALSE in Qwen3MoeConfig (the released
  Qwen3-30B-A3B config says true). Qwen3.5-MoE: every layer is sparse
  (Qwen3_5MoeDecoderLayer always builds Qwen3_5MoeSparseMoeBlock; no
  mlp_only_layers / decoder_sparse_step / dense intermediate_size).

The MoE block, x = post_attention_layernorm output [T, H], all in f32:
  logits = x W_router^T                       [T, E]   (mlp.gate.weight, no bias)
  p      = softmax(logits) over all E experts  (f32)
  (w, idx) = topk(p, k)                        the k largest probabilities
  Qwen3-MoE:   if norm_topk_prob: w = w / sum(w)   (else w stays the raw
               softmax probability)
  Qwen3.5-MoE: w = w / sum(w) ALWAYS (Qwen3_5MoeTopKRouter has no
               norm_topk_prob; a norm_topk_prob key in config.json is ignored)
  routed(x) = sum_j w_j * down_e (silu(gate_e x) * (up_e x)),  e = idx_j
  Qwen3-MoE:   y = routed(x)
  Qwen3.5-MoE: y = routed(x) + sigmoid(x . w_sg) * down_s(silu(gate_s x) * (up_s x))
               (w_sg = mlp.shared_expert_gate.weight [1, H]: one scalar gate
               per token, sigmoid, multiplying the shared expert's output;
               the shared expert always runs)
  layer out = residual + y.
  Checked below by a plain float64 re-implementation reading the weights from
  the fixture's files (both layouts) against HF's module output, with
  controls (no renormalisation, gate/up halves swapped, the k-th expert
  replaced by the (k+1)-th, no sigmoid on the shared gate) that must fail.

Weights (random, far from HF's init): Linear / Embedding N(0, 0.1^2);
experts (gate_up_proj, down_proj) N(0, 0.1^2); router mlp.gate.weight
N(0, 0.5^2) so the top-k is decisive; shared_expert_gate N(0, 0.3^2);
Qwen3-MoE RMSNorm weights 1 + N(0, 0.2^2); Qwen3.5-MoE as make_targets.py's
Qwen3.5 (q35_init_weights: (1+w) norms N(0, 0.2^2), gated norm 1 + N(0, 0.2^2),
conv N(0, 0.3^2), A_log log-uniform A in [0.02, 16], dt_bias N(0, 0.5^2)).
Printed and asserted per fixture: every expert of every sparse layer gets
tokens; the smallest routing margin over all tokens and sparse layers,
(p_k - p_k+1) / p_k (relative) and log(p_k / p_k+1) (logit gap), above
1e-4 (the C code computes the router in f32 from the same bf16 weights, so a
near-tie could flip an expert choice); every layer moves the residual stream
(make_targets.record).

Measured (torch 2.15 CPU, transformers 5.24):
                          qwen3-moe    qwen35-moe
  tokens x sparse layers  137 x 3      97 x 8
  tokens per expert, min  6            29
  min (p_k - p_k+1)/p_k   1.49e-03     4.47e-04
  float64 block vs HF     4.6e-07      4.9e-07   max|a-b|/max|b|, every layer
  whole model, that block 7.3e-14      1.1e-11   nmse, worst hidden state
  controls, last state:   no_renorm 1.4e-03, swap_gate_up 5.8e-02,
   nmse vs the reference  next_expert 1.6e-02 (qwen3-moe); no_renorm 2.2e-02,
                          swap_gate_up 7.3e-01, next_expert 1.4e-01,
                          shared_no_sigmoid 1.5 (qwen35-moe)
  The fused / VLM copies give the same numbers from their own files, and
  transformers reproduces the recorded hidden_states from them bit for bit.

Run: python3 tests/reference/make_targets_moe.py [--only NAME,...]
     (torch + transformers, CPU, about 40 s; deterministic: a rerun gives the
     same bytes. The fixtures of make_targets.py are not touched.)
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_targets as mt  # noqa: E402

OUT = mt.OUT
EAGER = {"experts_implementation": "eager"}
ME = "tests/reference/make_targets_moe.py"
NOTE = ", eager experts loop"
ROUTER_STD = 0.5
EXPERT_STD = 0.1
SHARED_GATE_STD = 0.3
MIN_REL_MARGIN = 1e-4

Q3M_LENGTHS = [17, 1, 9, 70, 40]
Q35M_LENGTHS = [17, 1, 9, 70]


def q3m_module():
    import transformers.models.qwen3_moe.modeling_qwen3_moe as m
    return m


def q35m_module():
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as m
    return m


def owners(model):
    out = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = mod
    return out


def header(d):
    """{name: (dtype, shape)} over every safetensors file in d."""
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as h:
                for k in h.keys():
                    s = h.get_slice(k)
                    out[k] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def samples_of(d):
    with open(os.path.join(d, "reference", "inputs.jsonl")) as f:
        return [json.loads(line) for line in f]


def states(model, samples):
    hs = []
    with torch.no_grad():
        for s in samples:
            o = model(input_ids=torch.tensor([s["input_ids"]]), output_hidden_states=True)
            hs.append(torch.stack([h[0] for h in o.hidden_states]))
    return torch.cat(hs, dim=1)


# ---------------------------------------------------------------------------
# The MoE block written out from the formulas (docstring), float64, weights
# read from the fixture's files in either layout.

def expert_weights(t, prefix, e, inter):
    """(gate [I,H], up [I,H], down [H,I]) of expert e under `prefix` (…mlp)."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in t:
        gu = t[fused][e]
        assert gu.shape[0] == 2 * inter
        return gu[:inter], gu[inter:], t[f"{prefix}.experts.down_proj"][e]
    return tuple(t[f"{prefix}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe_reference(x, t, prefix, E, k, inter, renorm, shared, variant=None):
    """y [T, H] of the MoE block for input x [T, H], float64. variant: None
    (the real math) or one of the controls: "no_renorm", "swap_gate_up",
    "next_expert" (k-th choice replaced by the (k+1)-th), "shared_no_sigmoid"."""
    x = x.double()
    w = {key: v.double() for key, v in t.items() if key.startswith(prefix + ".")}
    logits = x @ w[f"{prefix}.gate.weight"].T                  # [T, E]
    p = torch.softmax(logits, dim=-1)
    top, idx = p.topk(k + 1, dim=-1)
    if variant == "next_expert":
        top = torch.cat([top[:, : k - 1], top[:, k:]], dim=-1)
        idx = torch.cat([idx[:, : k - 1], idx[:, k:]], dim=-1)
    else:
        top, idx = top[:, :k], idx[:, :k]
    if renorm and variant != "no_renorm":
        top = top / top.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(E):
        g, u, dn = (a.double() for a in expert_weights(w, prefix, e, inter))
        if variant == "swap_gate_up":
            g, u = u, g
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if len(rows):
            y[rows] += top[rows, slot, None] * swiglu(x[rows], g, u, dn)
    if shared:
        s = swiglu(x, *(w[f"{prefix}.shared_expert.{p}_proj.weight"] for p in ("gate", "up", "down")))
        gate = x @ w[f"{prefix}.shared_expert_gate.weight"].T   # [T, 1]
        y = y + (gate if variant == "shared_no_sigmoid" else torch.sigmoid(gate)) * s
    return y


def capture_mlp(model, layers, samples):
    """Per layer index: list over samples of (mlp input [T,H], mlp output
    [T,H]) from forward hooks, each sample run alone."""
    got = {i: [] for i in range(len(layers))}
    cur = {}

    def hook(i):
        def f(_m, inp, out):
            cur[i] = (inp[0][0].detach().clone(), (out[0] if isinstance(out, tuple) else out)[0].detach().clone())
        return f

    hs = [layers[i].mlp.register_forward_hook(hook(i)) for i in range(len(layers))]
    try:
        with torch.no_grad():
            for s in samples:
                cur.clear()
                model(input_ids=torch.tensor([s["input_ids"]]))
                for i in range(len(layers)):
                    got[i].append(cur[i])
    finally:
        for h in hs:
            h.remove()
    return got


def check_moe(name, model, model_dir, samples, ref_hs, sparse, E, k, inter, renorm, shared, prefix_of,
              dense_inter=None):
    """Routing spread and margins; the float64 re-implementation against
    HF's module outputs on every layer (dense layers: plain SwiGLU), with the
    weights read from model_dir's files; then the whole model with it in place
    of HF's MoE blocks against the recorded states ref_hs [L+1, T, H], and the
    controls, which must miss them. Returns the smallest relative margin."""
    t = tensors(model_dir)
    layers = model.model.layers
    got = capture_mlp(model, layers, samples)
    worst_rel, worst_logit, where = math.inf, math.inf, None
    counts = {}
    worst_err = 0.0
    variants = ["no_renorm"] * renorm + ["swap_gate_up", "next_expert"] + ["shared_no_sigmoid"] * shared
    controls = {}
    for i in range(len(layers)):
        x = torch.cat([a for a, _ in got[i]])
        y = torch.cat([b for _, b in got[i]])
        prefix = prefix_of(i)
        if not sparse[i]:
            ref = swiglu(x.double(), *(t[f"{prefix}.{p}_proj.weight"].double() for p in ("gate", "up", "down")))
            assert t[f"{prefix}.gate_proj.weight"].shape[0] == dense_inter
            worst_err = max(worst_err, mt.rel_max(y, ref))
            continue
        logits = x.double() @ t[f"{prefix}.gate.weight"].double().T
        p = torch.softmax(logits, -1)
        srt = p.sort(-1, descending=True).values
        rel = (srt[:, k - 1] - srt[:, k]) / srt[:, k - 1]
        lg = torch.log(srt[:, k - 1] / srt[:, k])
        j = int(rel.argmin())
        if rel[j] < worst_rel:
            worst_rel, where = float(rel[j]), (i, j)
        worst_logit = min(worst_logit, float(lg.min()))
        counts[i] = torch.bincount(p.topk(k, -1).indices.flatten(), minlength=E).tolist()
        # HF's own router on the same input picks the same experts
        _, _, hf_idx = layers[i].mlp.gate(x)
        assert torch.equal(hf_idx.sort(-1).values, p.topk(k, -1).indices.sort(-1).values), i
        ref = moe_reference(x, t, prefix, E, k, inter, renorm, shared)
        worst_err = max(worst_err, mt.rel_max(y, ref))
        for v in variants:
            c = moe_reference(x, t, prefix, E, k, inter, renorm, shared, variant=v)
            controls[v] = min(controls.get(v, math.inf), mt.nmse(c, y.double()))
    print(f"    {name}: experts chosen per sparse layer (E={E}, top-{k}): "
          + "; ".join(f"layer {i} {c}" for i, c in counts.items()))
    print(f"    {name}: smallest routing margin over {sum(len(s['input_ids']) for s in samples)} tokens x "
          f"{len(counts)} sparse layers: (p_k - p_k+1)/p_k = {worst_rel:.3e} (layer {where[0]}, row {where[1]}), "
          f"log(p_k/p_k+1) min {worst_logit:.3e}")
    print(f"    {name}: float64 MoE block from the formulas vs HF's module output (every layer): "
          f"max|a-b|/max|b| {worst_err:.2e}; controls, nmse of the block output (min over layers): "
          + ", ".join(f"{v} {c:.1e}" for v, c in controls.items()))
    assert all(min(c) > 0 for c in counts.values()), counts
    assert worst_rel > MIN_REL_MARGIN, worst_rel
    assert worst_err < 1e-5, worst_err

    def run_with(variant):
        blocks = [(i, layers[i].mlp) for i in range(len(layers)) if sparse[i]]
        for i, blk in blocks:
            def fwd(hidden_states, _p=prefix_of(i)):
                sh = hidden_states.shape
                y = moe_reference(hidden_states.reshape(-1, sh[-1]), t, _p, E, k, inter, renorm, shared, variant)
                return y.to(hidden_states.dtype).reshape(sh)
            blk.forward = fwd
        try:
            hs = states(model, samples)
        finally:
            for _, blk in blocks:
                del blk.forward
        return [mt.nmse(hs[j], ref_hs[j]) for j in range(ref_hs.shape[0])]

    real = run_with(None)
    whole = {v: run_with(v)[-1] for v in variants}
    print(f"    {name}: whole model with that block in place of HF's: nmse per hidden state max {max(real):.1e}; "
          f"controls, nmse of the last state: " + ", ".join(f"{v} {c:.1e}" for v, c in whole.items()))
    assert max(real) < 1e-10, real
    assert all(c > 1e-6 for c in whole.values()), whole
    return worst_rel


def check_grouped_mm(name, model_dir, samples, ref_hs):
    """transformers' default experts implementation on CPU ("grouped_mm")
    against the eager loop the reference was recorded with."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    impl = model.config._experts_implementation
    try:
        hs = states(model.eval(), samples)
    except RuntimeError as e:  # torch's CPU grouped_mm wants 16-byte strides: I*4 % 16 == 0
        assert "multiple of 16 bytes" in str(e), e
        print(f"    {name}: experts_implementation {impl!r} cannot run these sizes ({e}); not compared")
        return
    worst = max(mt.nmse(hs[k], ref_hs[k]) for k in range(hs.shape[0]))
    print(f"    {name}: experts_implementation {impl!r} vs the eager loop: nmse per hidden state max {worst:.2e}")
    assert worst < 1e-10, worst


def write_config(path, c):
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------
# Qwen3-MoE

def q3m_config():
    return dict(vocab_size=151, hidden_size=40, intermediate_size=36, moe_intermediate_size=20,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[1], rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def q3m_is_sparse(cfg, i):
    """Qwen3MoeDecoderLayer.__init__'s rule."""
    return i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0


def q3m_init_weights(model, seed):
    m = q3m_module()
    g = torch.Generator().manual_seed(seed)
    own = owners(model)
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod = own[name]
            r = torch.randn(p.shape, generator=g)
            if isinstance(mod, m.Qwen3MoeRMSNorm):            # y = w * norm(x)
                kind, v = "norm", 1 + 0.2 * r
            elif isinstance(mod, m.Qwen3MoeTopKRouter):
                kind, v = "router", ROUTER_STD * r
            elif isinstance(mod, m.Qwen3MoeExperts):
                kind, v = "experts", EXPERT_STD * r
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and name.endswith(".weight"):
                kind, v = "matrix", 0.1 * r
            else:
                raise AssertionError(f"no init rule for {name} ({type(mod).__name__})")
            p.copy_(v)
            seen.add(kind)
    assert seen == {"norm", "router", "experts", "matrix"}, seen


def q3m_expected_keys(cfg, prefix, fused):
    """{name: shape} of one layer's MLP in the per-expert or fused layout."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if fused:
        return {f"{prefix}.gate.weight": (E, H), f"{prefix}.experts.gate_up_proj": (E, 2 * I, H),
                f"{prefix}.experts.down_proj": (E, H, I)}
    out = {f"{prefix}.gate.weight": (E, H)}
    for e in range(E):
        out.update({f"{prefix}.experts.{e}.gate_proj.weight": (I, H), f"{prefix}.experts.{e}.up_proj.weight": (I, H),
                    f"{prefix}.experts.{e}.down_proj.weight": (H, I)})
    return out


def q3m_check_layout(d, cfg, fused):
    hdr = header(d)
    assert all(dt == "BF16" for dt, _ in hdr.values()), {k: v for k, v in hdr.items() if v[0] != "BF16"}
    H, Id = cfg.hidden_size, cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp"
        have = {k: s for k, (_, s) in hdr.items() if k.startswith(prefix + ".")}
        if q3m_is_sparse(cfg, i):
            want = q3m_expected_keys(cfg, prefix, fused)
        else:
            want = {f"{prefix}.gate_proj.weight": (Id, H), f"{prefix}.up_proj.weight": (Id, H),
                    f"{prefix}.down_proj.weight": (H, Id)}
        assert have == want, (d, i, sorted(have), sorted(want))
    return hdr


def build_qwen3_moe(name, seed, overrides=None, lengths=Q3M_LENGTHS, no_window=None):
    """overrides: config keys over q3m_config's; no_window: the config edits
    that turn a sliding-window fixture's window off (mt.window_matters)."""
    m = q3m_module()
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    cfg = transformers.Qwen3MoeConfig(**dict(q3m_config(), **(overrides or {})))
    model = m.Qwen3MoeForCausalLM(cfg)
    sparse = [q3m_is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)]
    assert sparse == [True, False, True, True], sparse
    assert [isinstance(lay.mlp, m.Qwen3MoeSparseMoeBlock) for lay in model.model.layers] == sparse
    q3m_init_weights(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d)  # transformers 5.x splits the fused experts again on save
    q3m_check_layout(d, cfg, fused=False)
    # The per-expert tensors on disk are the in-memory fused ones: gate rows first.
    t = tensors(d)
    I = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        if sparse[i]:
            ex = model.model.layers[i].mlp.experts
            for e in range(cfg.num_experts):
                pre = f"model.layers.{i}.mlp.experts.{e}"
                assert torch.equal(ex.gate_up_proj[e, :I], t[pre + ".gate_proj.weight"])
                assert torch.equal(ex.gate_up_proj[e, I:], t[pre + ".up_proj.weight"])
                assert torch.equal(ex.down_proj[e], t[pre + ".down_proj.weight"])
    # config.json in the spelling of the released Qwen3-30B-A3B file
    cpath = os.path.join(d, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    assert c["num_local_experts"] == cfg.num_experts and "num_experts" not in c, "5.x writes num_local_experts"
    c = mt.old_spelling(c)
    c["num_experts"] = c.pop("num_local_experts")
    write_config(cpath, c)
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.num_experts == 6 and back.num_experts_per_tok == 2 and back.norm_topk_prob is True
    assert back.mlp_only_layers == [1] and back.decoder_sparse_step == 1
    assert back.rope_parameters == cfg.rope_parameters, back.rope_parameters
    assert back.sliding_window == cfg.sliding_window, (back.sliding_window, cfg.sliding_window)
    window = mt.window_matters(d, no_window, EAGER) if no_window else None

    def extra(model_fp32, samples, hs_all):
        lt = model_fp32.model.layers
        assert [isinstance(lay.mlp, m.Qwen3MoeSparseMoeBlock) for lay in lt] == sparse
        assert model_fp32.config._experts_implementation == "eager"
        check_moe(name, model_fp32, d, samples, torch.cat(hs_all, dim=1), sparse, cfg.num_experts,
                  cfg.num_experts_per_tok, I, True, False, lambda i: f"model.layers.{i}.mlp",
                  dense_inter=cfg.intermediate_size)
        check_grouped_mm(name, d, samples, torch.cat(hs_all, dim=1))
        if window:
            window(model_fp32, samples, hs_all)

    mt.record(d, mt.make_inputs(cfg.vocab_size, seed + 1, lengths), os.path.join(d, "reference"), extra,
              load_kwargs=EAGER, made_by=ME, note=NOTE)
    print(f"    {name}: every tensor BF16, experts per expert; {mt.dir_size(d)} bytes")


def build_qwen3_moe_fused(name, src_name):
    m = q3m_module()
    src, d = os.path.join(OUT, src_name), os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    model, info = m.Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.save_pretrained(d, save_original_format=False)
    cfg = model.config
    q3m_check_layout(d, cfg, fused=True)
    a, b = tensors(src), tensors(d)
    I = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        if not q3m_is_sparse(cfg, i):
            continue
        gu, dn = b[f"model.layers.{i}.mlp.experts.gate_up_proj"], b[f"model.layers.{i}.mlp.experts.down_proj"]
        for e in range(cfg.num_experts):
            pre = f"model.layers.{i}.mlp.experts.{e}"
            assert torch.equal(gu[e, :I], a[pre + ".gate_proj.weight"]), (i, e)  # gate rows first
            assert torch.equal(gu[e, I:], a[pre + ".up_proj.weight"]), (i, e)
            assert torch.equal(dn[e], a[pre + ".down_proj.weight"]), (i, e)
    same = [k for k in a if k in b]
    assert all(torch.equal(a[k], b[k]) for k in same) and len(same) == len(b) - 2 * sum(
        q3m_is_sparse(cfg, i) for i in range(cfg.num_hidden_layers))
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["num_local_experts"] == 6 and "rope_parameters" in c and "dtype" in c, sorted(c)
    shutil.copytree(os.path.join(src, "reference"), os.path.join(d, "reference"))
    # transformers loads the fused layout and reproduces the reference exactly
    ref = load_file(os.path.join(d, "reference", "expected.safetensors"))
    samples = samples_of(d)
    fp32, info = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **EAGER)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hs = states(fp32.eval(), samples)
    assert torch.equal(hs, ref["hidden_states"]), (hs - ref["hidden_states"]).abs().max()
    sparse = [q3m_is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)]
    check_moe(name, fp32, d, samples, ref["hidden_states"], sparse, cfg.num_experts, cfg.num_experts_per_tok,
              I, True, False,
              lambda i: f"model.layers.{i}.mlp", dense_inter=cfg.intermediate_size)
    print(f"    {name}: fused experts (gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I]); "
          f"transformers reproduces {src_name}'s hidden_states exactly; {mt.dir_size(d)} bytes")


# ---------------------------------------------------------------------------
# Qwen3.5-MoE

def q35m_text_config():
    c = mt.q35_text_config()
    del c["intermediate_size"]
    c.update(moe_intermediate_size=18, shared_expert_intermediate_size=26, num_experts=7, num_experts_per_tok=3)
    return c


def q35m_init_weights(model, seed, m=None, prefix="Qwen3_5Moe"):
    """make_targets.q35_init_weights's rules with the MoE module classes, plus
    the router, the fused experts and the shared expert gate. m and prefix:
    another hybrid MoE's modeling module and class prefix (Qwen3-Next's)."""
    m = m or q35m_module()
    cls = {k: getattr(m, prefix + k) for k in ("RMSNorm", "RMSNormGated", "TopKRouter", "Experts")}
    g = torch.Generator().manual_seed(seed)
    own = owners(model)
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod = own[name]
            r = torch.randn(p.shape, generator=g)
            if isinstance(mod, cls["RMSNorm"]):                # y = norm(x) * (1 + w)
                kind, v = "norm1p", 0.2 * r
            elif isinstance(mod, cls["RMSNormGated"]):         # y = w * norm(x) * silu(z)
                kind, v = "gated_norm", 1 + 0.2 * r
            elif isinstance(mod, torch.nn.Conv1d):
                kind, v = "conv", 0.3 * r
            elif name.endswith("linear_attn.A_log"):
                u = torch.rand(p.shape, generator=g)
                kind, v = "A_log", math.log(0.02) + u * (math.log(16.0) - math.log(0.02))
            elif name.endswith("linear_attn.dt_bias"):
                kind, v = "dt_bias", 0.5 * r
            elif isinstance(mod, cls["TopKRouter"]):
                kind, v = "router", ROUTER_STD * r
            elif isinstance(mod, cls["Experts"]):
                kind, v = "experts", EXPERT_STD * r
            elif name.endswith("mlp.shared_expert_gate.weight"):
                kind, v = "shared_gate", SHARED_GATE_STD * r
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and name.endswith(".weight"):
                kind, v = "matrix", 0.1 * r
            else:
                raise AssertionError(f"no init rule for {name} ({type(mod).__name__})")
            p.copy_(v)
            seen.add(kind)
    assert seen == {"norm1p", "gated_norm", "conv", "A_log", "dt_bias", "router", "experts", "shared_gate",
                    "matrix"}, seen


def q35m_expected_mlp(tc, prefix, fused):
    H, E = tc["hidden_size"], tc["num_experts"]
    I, Is = tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
    out = q3m_expected_keys(argparse.Namespace(hidden_size=H, num_experts=E, moe_intermediate_size=I), prefix, fused)
    out.update({f"{prefix}.shared_expert.gate_proj.weight": (Is, H), f"{prefix}.shared_expert.up_proj.weight": (Is, H),
                f"{prefix}.shared_expert.down_proj.weight": (H, Is), f"{prefix}.shared_expert_gate.weight": (1, H)})
    return out


def build_qwen35_moe(name, seed):
    m = q35m_module()
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    tc = q35m_text_config()
    cfg = transformers.Qwen3_5MoeTextConfig(**tc)
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2, cfg.layer_types
    assert not hasattr(cfg, "norm_topk_prob")
    model = m.Qwen3_5MoeForCausalLM(cfg)
    q35m_init_weights(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d)  # per-expert, as transformers 5.x writes it by default
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["model_type"] == "qwen3_5_moe_text" and c["layer_types"] == cfg.layer_types
    assert c["architectures"] == ["Qwen3_5MoeForCausalLM"], c["architectures"]
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.rope_parameters == cfg.rope_parameters and back.layer_types == cfg.layer_types
    hdr = header(d)
    assert all(dt == "BF16" for dt, _ in hdr.values())
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp"
        have = {k: s for k, (_, s) in hdr.items() if k.startswith(prefix + ".")}
        assert have == q35m_expected_mlp(tc, prefix, fused=False), (i, sorted(have))

    def extra(model_fp32, samples, hs_all):
        assert model_fp32.config._experts_implementation == "eager"
        n = cfg.num_hidden_layers
        check_moe(name, model_fp32, d, samples, torch.cat(hs_all, dim=1), [True] * n, cfg.num_experts,
                  cfg.num_experts_per_tok,
                  cfg.moe_intermediate_size, True, True, lambda i: f"model.layers.{i}.mlp")
        check_grouped_mm(name, d, samples, torch.cat(hs_all, dim=1))

    mt.record(d, mt.make_inputs(cfg.vocab_size, seed + 1, Q35M_LENGTHS), os.path.join(d, "reference"), extra,
              load_kwargs=EAGER, made_by=ME, note=NOTE)
    print(f"    {name}: every tensor BF16, experts per expert; {mt.dir_size(d)} bytes")


def q35m_mtp_tensors(tc, g):
    """Part of the MTP head under the names of the released Qwen3.5-35B-A3B
    files (its MTP layer's routed experts stored per expert); a text-only
    reader must ignore all of them. Random bf16 values."""
    H, D, nKV = tc["hidden_size"], tc["head_dim"], tc["num_key_value_heads"]
    E, I, Is = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
    p = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.k_proj.weight": (nKV * D, H),
        p + "self_attn.q_norm.weight": (D,),
        p + "self_attn.k_norm.weight": (D,),
        p + "mlp.gate.weight": (E, H),
        p + "mlp.shared_expert.gate_proj.weight": (Is, H),
        p + "mlp.shared_expert.up_proj.weight": (Is, H),
        p + "mlp.shared_expert.down_proj.weight": (H, Is),
        p + "mlp.shared_expert_gate.weight": (1, H),
    }
    for e in range(E):
        shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (I, H), p + f"mlp.experts.{e}.up_proj.weight": (I, H),
                       p + f"mlp.experts.{e}.down_proj.weight": (H, I)})
    return {k: (0.1 * torch.randn(s, generator=g)).to(torch.bfloat16) for k, s in shapes.items()}


def build_qwen35_moe_vlm(name, src_name, seed):
    m = q35m_module()
    src, d = os.path.join(OUT, src_name), os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    text, info = m.Qwen3_5MoeForCausalLM.from_pretrained(src, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tc = dict(q35m_text_config(), mtp_num_hidden_layers=1)
    cfg = transformers.Qwen3_5MoeConfig(text_config=tc, vision_config=mt.q35_vision_config(),
                                        tie_word_embeddings=False, **mt.Q35_TOKEN_IDS)
    model = m.Qwen3_5MoeForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.model.visual.named_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.float()
          for k, v in text.state_dict().items()}
    res = model.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys and all(k.startswith("model.visual.") for k in res.missing_keys), res
    model = model.to(torch.bfloat16)
    # The released Qwen3.5-MoE files store the routed experts fused.
    model.save_pretrained(d, max_shard_size="500KB", save_original_format=False)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    shards = sorted(set(wm.values()))
    assert len(shards) == 2, shards
    assert set(wm) == set(model.state_dict()), "unexpected key layout"
    mt.finish_vlm_shards(d, q35m_mtp_tensors(tc, g))
    allt = tensors(d)
    cpath = os.path.join(d, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    assert c["model_type"] == "qwen3_5_moe" and c["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert c["architectures"] == ["Qwen3_5MoeForConditionalGeneration"], c["architectures"]
    del c["text_config"]["layer_types"]
    c["text_config"]["full_attention_interval"] = 4
    write_config(cpath, c)
    # layout: fused routed experts, the same values as src's per-expert files
    hdr = header(d)
    a = tensors(src)
    E, I = tc["num_experts"], tc["moe_intermediate_size"]
    for i in range(tc["num_hidden_layers"]):
        prefix = f"model.language_model.layers.{i}.mlp"
        have = {k: s for k, (_, s) in hdr.items() if k.startswith(prefix + ".")}
        assert have == q35m_expected_mlp(tc, prefix, fused=True), (i, sorted(have))
        gu, dn = allt[prefix + ".experts.gate_up_proj"], allt[prefix + ".experts.down_proj"]
        for e in range(E):
            pre = f"model.layers.{i}.mlp.experts.{e}"
            assert torch.equal(gu[e, :I], a[pre + ".gate_proj.weight"])  # gate rows first
            assert torch.equal(gu[e, I:], a[pre + ".up_proj.weight"])
            assert torch.equal(dn[e], a[pre + ".down_proj.weight"])
    shutil.copytree(os.path.join(src, "reference"), os.path.join(d, "reference"))
    q35m_check_vlm(d, src, tc)
    dts = {}
    for k, (dt, _) in hdr.items():
        dts.setdefault(dt, []).append(k)
    kinds = {k: f"{len(v)} tensors" + (f" ({', '.join(sorted(set('.'.join(n.split('.')[-2:]) for n in v)))})"
                                       if k != "BF16" else "") for k, v in sorted(dts.items())}
    print(f"    {name}: {len(shards)} shards; " + "; ".join(f"{k} {v}" for k, v in kinds.items())
          + f"; {mt.dir_size(d)} bytes")


def q35m_check_vlm(d, src, tc):
    """transformers loads the directory as the VLM and as a text-only causal
    LM; both give src's recorded states bit for bit."""
    m = q35m_module()
    ref = load_file(os.path.join(src, "reference", "expected.safetensors"))
    samples = samples_of(src)
    a_cfg = transformers.AutoConfig.from_pretrained(src)
    v_cfg = transformers.AutoConfig.from_pretrained(d)
    assert v_cfg.text_config.layer_types == a_cfg.layer_types, v_cfg.text_config.layer_types
    vlm, info = m.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **EAGER)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        nmtp = sum(k.startswith("mtp.") for k in json.load(f)["weight_map"])
    assert nmtp > 0
    txt, tinfo = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **EAGER)
    assert type(txt).__name__ == "Qwen3_5MoeForCausalLM", type(txt)
    assert not tinfo["missing_keys"] and not tinfo["mismatched_keys"], tinfo
    assert vlm.model.language_model.layers[0].linear_attn.A_log.dtype == torch.float32
    for mdl in (vlm, txt):
        hs = states(mdl.eval(), samples)
        assert torch.equal(hs, ref["hidden_states"]), (type(mdl).__name__, (hs - ref["hidden_states"]).abs().max())
    # the float64 block re-implementation on the fused files too
    n = tc["num_hidden_layers"]
    check_moe(os.path.basename(d), txt, d, samples, ref["hidden_states"], [True] * n, tc["num_experts"],
              tc["num_experts_per_tok"],
              tc["moe_intermediate_size"], True, True, lambda i: f"model.language_model.layers.{i}.mlp")
    print(f"    {os.path.basename(d)}: Qwen3_5MoeForConditionalGeneration and AutoModelForCausalLM "
          f"({type(txt).__name__}) load it (its {nmtp} mtp.* tensors ignored) and reproduce "
          f"{os.path.basename(src)}'s hidden_states exactly; layer_types derived from full_attention_interval")


def main():
    builders = {
        "qwen3-moe": lambda: build_qwen3_moe("qwen3-moe", seed=77),
        "qwen3-moe-fused": lambda: build_qwen3_moe_fused("qwen3-moe-fused", "qwen3-moe"),
        # Qwen3MoeAttention slides every layer; max_window_layers 3 is
        # there to be ignored (Qwen3's rule would slide layer 3 alone)
        "qwen3-moe-swa": lambda: build_qwen3_moe(
            "qwen3-moe-swa", seed=133, overrides=dict(use_sliding_window=True, sliding_window=6, max_window_layers=3),
            lengths=[17, 1, 9, 40, 6], no_window={"use_sliding_window": False}),
        "qwen35-moe": lambda: build_qwen35_moe("qwen35-moe", seed=88),
        "qwen35-moe-vlm": lambda: build_qwen35_moe_vlm("qwen35-moe-vlm", "qwen35-moe", seed=99),
    }
    # the fused / VLM fixtures read the others' files: the table's order matters
    return mt.run_builders("make_targets_moe", builders, "Make the MoE target fixtures under tests/fixtures/targets/.")


if __name__ == "__main__":
    sys.exit(main())
