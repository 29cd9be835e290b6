#!/usr/bin/env python3
"""Golden fixtures for the target model (lib/target.c, dflash-extract).

Makes tiny random Qwen3 and Llama models with transformers, saves them with
save_pretrained (weights in bf16, so the C code and PyTorch use identical
weights), reloads them in fp32 and records what Hugging Face computes:

  tests/fixtures/targets/NAME/            the model directory (config.json,
                                          model.safetensors or shards + index)
  tests/fixtures/targets/NAME/reference/inputs.jsonl
                                          the samples (id, input_ids, loss_mask)
  tests/fixtures/targets/NAME/reference/expected.safetensors
      input_ids    i32 [T]        the samples' tokens, concatenated
      cu           i32 [S+1]      sample s holds rows cu[s]..cu[s+1]
      hidden_states f32 [L+1,T,H] HF output.hidden_states, each sample run
                                  on its own (batch 1, positions from 0):
                                  [0] embeddings, [k+1] output of decoder
                                  layer k for k < L-1, [L] after model.norm
      last_prenorm f32 [T,H]      output of decoder layer L-1 before model.norm
                                  (captured with a forward hook)
      argmax       i32 [T]        argmax of HF's logits (greedy next token)
      gap          f32 [T]        top-1 minus top-2 logit (near-tie detector)

Models (odd sizes on purpose, not powers of two):
  qwen3-tied     Qwen3, GQA 6/3 heads, head_dim 24 (nH*D != H), tied embeddings,
                 config in the transformers 4.x spelling (rope_theta, torch_dtype)
  qwen3-untied   Qwen3, MQA 4/1, untied lm_head, config in the 5.x spelling
                 (rope_parameters, dtype) exactly as save_pretrained writes it
  llama3         Llama with llama3 RoPE scaling (all three frequency bands hit),
                 no q/k norms, eps 1e-5, untied, 4.x spelling
  qwen3-sharded  small Qwen3 saved with a small max_shard_size (index + shards)
  qwen2          Qwen2 (Qwen2.5, DeepSeek-R1-Distill-Qwen): Llama's layer with
                 biases on q_proj, k_proj, v_proj (N(0, 0.1^2), as the weights),
                 no q/k norms, GQA 4/2, head_dim 14, 4.x spelling
  mistral        Mistral (Mistral-7B-v0.3, Nemo, Small): Llama's layer, no
                 sliding window (null), head_dim 16 != H / heads (12), MQA, 4.x spelling
  qwen3-swa      Qwen3 with use_sliding_window, window 5 on layers 1-3
                 (max_window_layers 1; 4.x spelling, no layer_types in the file);
                 samples of 17, 1, 9, 40, 5 tokens
  mistral-swa    Mistral with sliding_window 7 (every layer), 5.x spelling;
                 samples of 17, 1, 9, 40, 7 tokens
                 (both: window_matters checks that the window moves the states
                 of the samples longer than it, and only those)
  qwen35-yarn    qwen35's architecture (other weights) with YaRN over its partial
                 RoPE: the attention factor scales the 8 rotated dims of each
                 head, not the 24 passed through; samples of 17, 9, 70 tokens
  qwen3-yarn     Qwen3 with YaRN RoPE (factor 4 over a pretraining length of 64:
                 extrapolated, ramped and interpolated frequencies, cos and sin
                 times the attention factor 1.139), 4.x spelling

  qwen35         Qwen3.5 dense text model (Qwen3_5ForCausalLM, model_type
                 qwen3_5_text, keys model.layers.* / model.embed_tokens /
                 model.norm / lm_head), 8 layers: Gated DeltaNet ("linear_attention")
                 at 0-2 and 4-6, gated full attention at 3 and 7 (layer_types
                 written by HF). H 48, I 88, vocab 199, untied; attention 4 q /
                 2 kv heads, head_dim 32, partial rotary 0.25 (rotary dim 8),
                 rope theta 1e7, mrope_section [2,1,1] interleaved; GDN 2 key /
                 4 value heads, dk 16, dv 24 (dk != dv), conv kernel 4.
                 Samples of 17, 1, 9, 70, 130 tokens (70 and 130 cross HF's
                 delta-rule chunk of 64).
  qwen35-vlm     the same weights in the released Qwen3.5 layout:
                 Qwen3_5ForConditionalGeneration, config model_type qwen3_5 with
                 text_config (qwen3_5_text, NO layer_types: derive it from
                 full_attention_interval 4) and a tiny vision_config; keys
                 model.language_model.*, lm_head.weight, model.visual.* (a
                 1-block vision tower) and mtp.* (part of an MTP head, not read
                 by HF); 2 shards + model.safetensors.index.json. reference/
                 is a copy of qwen35's (transformers reproduces it exactly from
                 this directory, checked).

Weights: every Linear and the embedding N(0, 0.1^2), every RMSNorm weight
1 + N(0, 0.2^2) (not ones, so a norm applied with the wrong weight shows).
With this scale every layer changes the residual stream a lot, so tapping the
wrong layer is far outside the test thresholds (checked below).
Qwen3.5 (qwen35, qwen35-vlm), by owning module:
  Linear / Embedding weights (incl. lm_head, in_proj_*, out_proj)  N(0, 0.1^2)
  Qwen3_5RMSNorm weights, used as (1 + w): input_layernorm,
    post_attention_layernorm, model.norm, self_attn.q_norm/k_norm   N(0, 0.2^2)
  linear_attn.norm (Qwen3_5RMSNormGated, plain w)                   1 + N(0, 0.2^2)
  linear_attn.conv1d.weight [C, 1, 4]                               N(0, 0.3^2)
  linear_attn.A_log   log(A), A log-uniform in [0.02, 16] (decay per token
                      exp(-A softplus(a + dt_bias)) from ~0.99 to ~0, so some
                      heads carry state across the chunk boundaries)
  linear_attn.dt_bias                                               N(0, 0.5^2)
Stored dtypes: qwen35 every tensor BF16 (save_pretrained of the bf16 model:
HF's Qwen3.5 classes keep nothing in fp32, so A_log and dt_bias are BF16
too). qwen35-vlm like the released Qwen3.5 files: linear_attn.A_log and
linear_attn.norm.weight F32 (exactly the bf16 values), all else BF16
(dt_bias included).
Extra checks of the Qwen3.5 oracle (printed): HF's interleaved mRoPE with
text-only positions equals plain 1-D partial RoPE (exact); each GDN layer's
chunked core (what HF ran) against HF's token-by-token
torch_recurrent_gated_delta_rule on the same inputs in float32 and float64;
the whole model with the recurrent core instead of the chunked one; the
model's own sensitivity to a 1e-7 relative perturbation of its input.

Run: python3 tests/reference/make_targets.py [--only NAME,...]
     (torch + transformers, CPU; --only qwen35,qwen35-vlm remakes just those)
"""
import argparse
import inspect
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import save_file

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
OUT = os.path.join(ROOT, "tests", "fixtures", "targets")
LENGTHS = [17, 1, 9, 40]


def init_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def old_spelling(cfg):
    """Rewrite a 5.x config dict in the 4.x spelling real Qwen3/Llama files use."""
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    cfg["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def make_inputs(vocab, seed, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        if n > 2:  # the first and last rows of the vocabulary
            ids[1], ids[2] = 0, vocab - 1
        mask = (torch.rand(n, generator=g) < 0.7).int().tolist()
        mask[0] = 0
        sid = f"sample-{i}" if i % 2 == 0 else 1000 + i  # ids may be strings or integers
        samples.append({"id": sid, "input_ids": ids, "loss_mask": mask})
    return samples


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def record(model_dir, samples, ref_dir, extra_check=None, load_kwargs=None,
           made_by="tests/reference/make_targets.py", note=""):
    """HF's states on `samples` into ref_dir; extra_check(model, samples, hs_all)
    runs further model-specific checks of the oracle before anything is written.
    load_kwargs go to from_pretrained (make_targets_moe.py: the eager experts
    loop); made_by and note only change the metadata line."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **(load_kwargs or {}))
    model.eval()
    layers = model.model.layers
    L = len(layers)
    outs = {}

    def hook(idx):
        def f(_mod, _inp, out):
            outs[idx] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        return f

    handles = [layers[i].register_forward_hook(hook(i)) for i in range(L)]
    hs_all, pre_all, am_all, gap_all, ids_all, cu = [], [], [], [], [], [0]
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["input_ids"]])
            out = model(input_ids=ids, output_hidden_states=True)
            hs = torch.stack([h[0] for h in out.hidden_states])  # [L+1, T, H]
            assert hs.shape[0] == L + 1
            # The convention this fixture pins down: hidden_states[k+1] is the
            # output of layer k, except the last entry, which is post-norm.
            for k in range(L - 1):
                assert torch.equal(hs[k + 1], outs[k][0]), k
            assert torch.allclose(hs[L], model.model.norm(outs[L - 1][0]), atol=1e-6)
            assert not torch.allclose(hs[L], outs[L - 1][0])
            logits = out.logits[0]
            top2 = logits.topk(2, dim=-1)
            hs_all.append(hs)
            pre_all.append(outs[L - 1][0])
            am_all.append(logits.argmax(-1).to(torch.int32))
            gap_all.append((top2.values[:, 0] - top2.values[:, 1]).float())
            ids_all.append(ids[0].to(torch.int32))
            cu.append(cu[-1] + ids.shape[1])
        # Sanity of the oracle: a right-padded batch gives the same states.
        T = max(len(s["input_ids"]) for s in samples)
        pad = torch.zeros(len(samples), T, dtype=torch.long)
        att = torch.zeros(len(samples), T, dtype=torch.long)
        for i, s in enumerate(samples):
            pad[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
            att[i, : len(s["input_ids"])] = 1
        bout = model(input_ids=pad, attention_mask=att, output_hidden_states=True)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            for k in range(L + 1):
                assert torch.allclose(bout.hidden_states[k][i, :n], hs_all[i][k], atol=1e-4, rtol=1e-4), (i, k)
    for h in handles:
        h.remove()
    if extra_check is not None:
        extra_check(model, samples, hs_all)

    hs = torch.cat(hs_all, dim=1).contiguous()
    # Every layer must move the residual stream far beyond the bf16 test
    # threshold, or an off-by-one tap could pass unnoticed.
    for k in range(L):
        d = nmse(hs[k], hs[k + 1])
        assert d > 1e-3, (model_dir, k, d)
    os.makedirs(ref_dir, exist_ok=True)
    tensors = {
        "input_ids": torch.cat(ids_all).contiguous(),
        "cu": torch.tensor(cu, dtype=torch.int32),
        "hidden_states": hs,
        "last_prenorm": torch.cat(pre_all).contiguous(),
        "argmax": torch.cat(am_all).contiguous(),
        "gap": torch.cat(gap_all).contiguous(),
    }
    save_file(tensors, os.path.join(ref_dir, "expected.safetensors"),
              # one key: safetensors writes a metadata map in hash order
              metadata={"made_by": f"{made_by} with torch {torch.__version__}, "
                                   f"transformers {transformers.__version__}: HF output.hidden_states, "
                                   f"fp32 compute on bf16 weights, eager attention{note}"})
    with open(os.path.join(ref_dir, "inputs.jsonl"), "w") as f:
        for s in samples:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")
    gaps = tensors["gap"]
    print(f"  {os.path.basename(model_dir)}: L={L} T={hs.shape[1]} H={hs.shape[2]} "
          f"min gap {gaps.min():.2e}, {int((gaps < 1e-3).sum())} gaps < 1e-3")


def window_matters(d, no_window, load_kwargs=None):
    """An extra_check for a sliding-window fixture: the same weights without
    the window (config.json with the no_window edits, in a scratch copy of
    the directory: from_pretrained's overrides come after the config's
    derived layer_types) must give states far from these on the samples
    longer than the window, and the same ones on the others, or the fixture
    would not test the window. load_kwargs go to from_pretrained, as record's."""
    def check(model, samples, hs_all):
        with tempfile.TemporaryDirectory() as tmp:
            for f in os.listdir(d):
                if f != "config.json" and os.path.isfile(os.path.join(d, f)):
                    os.symlink(os.path.join(d, f), os.path.join(tmp, f))
            with open(os.path.join(d, "config.json")) as f:
                c = json.load(f)
            c.update(no_window)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(c, f)
            full = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="eager", **(load_kwargs or {}))
        full.eval()
        assert "sliding_attention" not in (getattr(full.config, "layer_types", None) or [])
        W = model.config.sliding_window
        with torch.no_grad():
            for s, hs in zip(samples, hs_all):
                out = full(input_ids=torch.tensor([s["input_ids"]]), output_hidden_states=True)
                d_last = nmse(out.hidden_states[-1][0], hs[-1])
                if len(s["input_ids"]) > W:
                    assert d_last > 1e-3, (d, len(s["input_ids"]), d_last)
                else:
                    assert d_last < 1e-12, (d, len(s["input_ids"]), d_last)
        print(f"  {os.path.basename(d)}: window {W} changes the samples longer than it")
    return check


def build(name, arch, cfg_kwargs, seed, spelling="old", max_shard_size=None, lengths=LENGTHS, drop=(),
          no_window=None):
    """drop: config keys removed from the file (a 4.x Qwen3 file has no
    layer_types); no_window: the from_pretrained overrides that turn a
    sliding-window fixture's window off (window_matters)."""
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**cfg_kwargs)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**cfg_kwargs)
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**cfg_kwargs)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**cfg_kwargs)
        model = transformers.LlamaForCausalLM(cfg)
    init_weights(model, seed)
    model = model.to(torch.bfloat16)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(d, **kw)
    cpath = os.path.join(d, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    assert "rope_parameters" in c and "dtype" in c, "expected the transformers 5.x spelling"
    if spelling == "old" or drop:
        c = old_spelling(c) if spelling == "old" else c
        for k in drop:
            c.pop(k)
        with open(cpath, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
            f.write("\n")
    # The file we read back must mean what we built.
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.rope_parameters == cfg.rope_parameters, (back.rope_parameters, cfg.rope_parameters)
    assert getattr(back, "layer_types", None) == getattr(cfg, "layer_types", None)
    assert getattr(back, "sliding_window", None) == getattr(cfg, "sliding_window", None)
    check = window_matters(d, no_window) if no_window else None
    record(d, make_inputs(cfg.vocab_size, seed + 1, lengths), os.path.join(d, "reference"), check)


# ---------------------------------------------------------------------------
# Qwen3.5 hybrid targets: Gated DeltaNet ("linear_attention") layers and
# gated full-attention layers (see the docstring at the top).

Q35_LENGTHS = [17, 1, 9, 70, 130]  # 70 and 130 cross HF's delta-rule chunk of 64 (1 and 2 boundaries)
Q35_TOKEN_IDS = dict(vision_start_token_id=193, vision_end_token_id=194, image_token_id=195, video_token_id=196)


def q35_text_config():
    """The text settings, spelled as in Qwen3.5-27B's text_config (research §3.1).
    rotary dim = int(32 * 0.25) = 8 = 4 frequencies; mrope_section [2, 1, 1]
    splits those 4 as the real [11, 11, 10] splits its 32 (sum = rotary dim / 2)."""
    return dict(vocab_size=199, hidden_size=48, intermediate_size=88, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=24, linear_conv_kernel_dim=4, full_attention_interval=4,
                rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                attention_dropout=0.0, attn_output_gate=True, mamba_ssm_dtype="float32",
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def q35_module():
    import transformers.models.qwen3_5.modeling_qwen3_5 as m
    return m


def q35_init_weights(model, seed):
    """Random weights far from HF's init (which makes every (1+w) norm and the
    gated norm an identity): classified by the module that owns each tensor,
    so a (1+w) norm can never be mistaken for a plain one."""
    m = q35_module()
    g = torch.Generator().manual_seed(seed)
    owner = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = mod
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod = owner[name]
            r = torch.randn(p.shape, generator=g)
            if isinstance(mod, m.Qwen3_5RMSNorm):          # y = norm(x) * (1 + w)
                kind, v = "norm1p", 0.2 * r
            elif isinstance(mod, m.Qwen3_5RMSNormGated):   # y = w * norm(x) * silu(z)
                kind, v = "gated_norm", 1 + 0.2 * r
            elif isinstance(mod, torch.nn.Conv1d):         # [C, 1, K], no bias
                kind, v = "conv", 0.3 * r
            elif name.endswith("linear_attn.A_log"):
                # log-uniform A in [0.02, 16]: decays exp(g) from ~0.99 (state
                # kept past a chunk boundary) to ~0 per token
                u = torch.rand(p.shape, generator=g)
                kind, v = "A_log", math.log(0.02) + u * (math.log(16.0) - math.log(0.02))
            elif name.endswith("linear_attn.dt_bias"):
                kind, v = "dt_bias", 0.5 * r
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and name.endswith(".weight"):
                kind, v = "matrix", 0.1 * r
            else:
                raise AssertionError(f"no init rule for {name} ({type(mod).__name__})")
            p.copy_(v)
            seen.add(kind)
    assert seen == {"norm1p", "gated_norm", "conv", "A_log", "dt_bias", "matrix"}, seen


def plain_function(fn):
    """The Python function behind HF's name. A decorator leaves it in
    __wrapped__; transformers 5.25 turns a function a hub kernel may replace
    into an nn.Module instance ("Func") whose forward calls the original,
    held in its closure, when no kernel is active (none is, here)."""
    fn = getattr(fn, "__wrapped__", fn)
    if isinstance(fn, torch.nn.Module):
        cells = type(fn).forward.__closure__ or ()
        inner = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)]
        assert len(inner) == 1, f"{type(fn).__qualname__}: {len(inner)} functions in its forward's closure"
        fn = inner[0]
    return fn


def hf_in_float64(fn):
    """HF's own function run in float64: its source with torch.float32 replaced
    by torch.float64 (it upcasts everything to float32 first), executed in its
    module's namespace. Nothing else in the algorithm changes."""
    m = q35_module()
    fn = plain_function(fn)
    lines = inspect.getsource(fn).splitlines()
    while lines[0].startswith("@"):
        lines.pop(0)
    src = "\n".join(lines)
    assert src.count("torch.float32") >= 1
    ns = dict(vars(m))
    exec(compile(src.replace("torch.float32", "torch.float64"), f"<{fn.__name__} float64>", "exec"), ns)
    return ns[fn.__name__]


def rel_max(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def q35_check_mrope(model):
    """HF's interleaved mRoPE with the text-only positions Qwen3_5TextModel
    builds (t = h = w = position) must equal plain 1-D RoPE over the first
    rotary_dim = 8 dims (rotate_half within those 8, theta 1e7, angles
    pos * inv_freq in float32); dims 8..31 pass through."""
    m = q35_module()
    cfg = model.config
    D = cfg.head_dim
    rd = int(D * cfg.rope_parameters["partial_rotary_factor"])
    theta = cfg.rope_parameters["rope_theta"]
    T = 300
    x = torch.zeros(1, T, cfg.hidden_size)
    p = torch.arange(T)
    pos = p.view(1, 1, -1).expand(3, 1, -1)  # what Qwen3_5TextModel.forward passes (rows t, h, w)
    cos, sin = model.model.rotary_emb(x, pos)
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    ang = p.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    assert cos.shape == (1, T, rd), cos.shape
    assert torch.equal(cos[0], emb.cos()) and torch.equal(sin[0], emb.sin())
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, cfg.num_attention_heads, T, D, generator=g)
    k = torch.randn(1, cfg.num_key_value_heads, T, D, generator=g)
    qh, kh = m.apply_rotary_pos_emb(q, k, cos, sin)

    def plain(t):
        r, rest = t[..., :rd], t[..., rd:]
        half = rd // 2
        rot = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
        return torch.cat([r * emb.cos() + rot * emb.sin(), rest], dim=-1)

    assert torch.equal(qh, plain(q)) and torch.equal(kh, plain(k))
    # Control: positions that differ between sections do change the angles,
    # so the check above is not vacuous (frequency 1 is h's, 2 is w's here).
    cos2, _ = model.model.rotary_emb(x, torch.stack([p, 2 * p, 3 * p]).view(3, 1, -1))
    differ = [i for i in range(rd // 2) if not torch.equal(cos2[0, :, i], emb.cos()[:, i])]
    assert differ == [1, 2], differ
    print(f"    mrope: text-only interleaved mRoPE == 1-D RoPE over dims 0..{rd - 1} (theta {theta:g}), "
          f"exact; control: sections t/h/w = p/2p/3p change frequencies {differ}")


def q35_check_gdn(model, samples, hs_all):
    """Each GDN layer's core as HF ran it (torch_chunk_gated_delta_rule, chunk
    64, float32) against HF's token-by-token torch_recurrent_gated_delta_rule
    on the same inputs, in float32 and in float64; then the whole model with
    the recurrent core in place of the chunked one (what a token-by-token C
    implementation would get) against the recorded states."""
    m = q35_module()
    chunk = m.torch_chunk_gated_delta_rule
    rec32 = m.torch_recurrent_gated_delta_rule
    rec64 = hf_in_float64(rec32)
    calls = []

    def capture(query, key, value, g=None, beta=None, **kw):
        assert kw.get("use_qk_l2norm_in_kernel") is True and kw.get("initial_state") is None
        out, state = chunk(query, key, value, g=g, beta=beta, **kw)
        calls.append([t.detach().clone() for t in (query, key, value, g, beta, out)])
        return out, state

    def run_all():
        hs = []
        with torch.no_grad():
            for s in samples:
                o = model(input_ids=torch.tensor([s["input_ids"]]), output_hidden_states=True)
                hs.append(torch.stack([h[0] for h in o.hidden_states]))
        return hs

    try:
        m.torch_chunk_gated_delta_rule = capture
        again = run_all()
    finally:
        m.torch_chunk_gated_delta_rule = chunk
    ngdn = sum(t == "linear_attention" for t in model.config.layer_types)
    assert len(calls) == ngdn * len(samples), len(calls)
    for a, b in zip(again, hs_all):
        assert torch.equal(a, b)  # the capture changed nothing
    worst = {"chunk32-rec64": 0.0, "rec32-rec64": 0.0, "chunk32-rec32": 0.0}
    for q, k, v, g, beta, out in calls:
        kw = dict(g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        r32, _ = rec32(q, k, v, **kw)
        r64, _ = rec64(q.double(), k.double(), v.double(), g=g.double(), beta=beta.double(),
                       use_qk_l2norm_in_kernel=True)
        assert r64.dtype == torch.float64
        worst["chunk32-rec64"] = max(worst["chunk32-rec64"], rel_max(out, r64))
        worst["rec32-rec64"] = max(worst["rec32-rec64"], rel_max(r32, r64))
        worst["chunk32-rec32"] = max(worst["chunk32-rec32"], rel_max(out, r32))
    print("    gdn core, max over %d calls of max|a-b|/max|b|: %s" % (
        len(calls), ", ".join(f"{k} {v:.2e}" for k, v in worst.items())))
    assert worst["chunk32-rec64"] < 1e-5 and worst["rec32-rec64"] < 1e-5, worst

    def as_recurrent(impl, dtype):
        def f(query, key, value, g=None, beta=None, chunk_size=64, **kw):
            o, st = impl(*(t.to(dtype) for t in (query, key, value)), g=g.to(dtype), beta=beta.to(dtype), **kw)
            return o.to(query.dtype), st
        return f

    for label, impl, dt in (("recurrent float32", rec32, torch.float32), ("recurrent float64", rec64, torch.float64)):
        try:
            m.torch_chunk_gated_delta_rule = as_recurrent(impl, dt)
            alt = run_all()
        finally:
            m.torch_chunk_gated_delta_rule = chunk
        hs_a, hs_b = torch.cat(alt, dim=1), torch.cat(hs_all, dim=1)
        per_layer = [nmse(hs_a[k], hs_b[k]) for k in range(hs_b.shape[0])]
        print(f"    whole model with the {label} core instead of the chunked one: "
              f"nmse per hidden state max {max(per_layer):.2e} (last {per_layer[-1]:.2e})")
        assert max(per_layer) < 1e-9, per_layer
    # How sensitive the model is to float32 rounding in itself: the same HF
    # forward on embeddings perturbed by a relative 1e-7 (about one float32 ulp).
    g = torch.Generator().manual_seed(7)
    worst = [0.0] * len(hs_all[0])
    with torch.no_grad():
        for s, ref in zip(samples, hs_all):
            e = ref[0][None]
            o = model(inputs_embeds=e * (1 + 1e-7 * torch.randn(e.shape, generator=g)), output_hidden_states=True)
            for k, h in enumerate(o.hidden_states):
                worst[k] = max(worst[k], nmse(h[0], ref[k]))
    print("    conditioning: embeddings x (1 + 1e-7 N(0,1)) -> nmse per hidden state (max over samples) "
          + " ".join(f"{w:.1e}" for w in worst))


def q35_check(model, samples, hs_all):
    q35_check_mrope(model)
    q35_check_gdn(model, samples, hs_all)


def q35_dtypes(files):
    """{dtype: sorted names} over safetensors files, read from their headers."""
    from safetensors import safe_open
    out = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out.setdefault(h.get_slice(k).get_dtype(), []).append(k)
    return {k: sorted(v) for k, v in out.items()}


def dir_size(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def build_qwen35(name, seed, rope=None, lengths=Q35_LENGTHS):
    """rope: keys replacing those of rope_parameters (qwen35-yarn: YaRN over
    the partial RoPE, whose pass-through dims transformers leaves unscaled)."""
    m = q35_module()
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    kw = q35_text_config()
    if rope:
        kw["rope_parameters"] = {**kw["rope_parameters"], **rope}
    cfg = transformers.Qwen3_5TextConfig(**kw)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"], cfg.layer_types
    model = m.Qwen3_5ForCausalLM(cfg)
    q35_init_weights(model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    assert c["model_type"] == "qwen3_5_text" and c["layer_types"] == cfg.layer_types
    assert "full_attention_interval" not in c  # HF consumes it; layer_types is what it writes
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.rope_parameters == cfg.rope_parameters and back.layer_types == cfg.layer_types
    dts = q35_dtypes([os.path.join(d, "model.safetensors")])
    assert list(dts) == ["BF16"], {k: len(v) for k, v in dts.items()}
    check = q35_check if not rope else lambda model, samples, hs: q35_check_gdn(model, samples, hs)
    record(d, make_inputs(cfg.vocab_size, seed + 1, lengths), os.path.join(d, "reference"), check)
    print(f"    {name}: every tensor BF16; {dir_size(d)} bytes")


def q35_vision_config():
    """A tiny vision tower (1 block, width 16), only so that HF can build and
    load the whole Qwen3_5ForConditionalGeneration."""
    return dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, in_channels=3, patch_size=2,
                temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16)


def q35_mtp_tensors(cfg, g):
    """The MTP head's tensor names as in the released Qwen3.5 files (one
    gated-attention decoder layer plus fc/pre-fc norms); a text-only reader
    must ignore all of them. Random bf16 values."""
    H, D, nKV, I = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    shapes = {  # a subset of the real head, enough names to trip a reader that matches suffixes
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.k_proj.weight": (nKV * D, H),
        "mtp.layers.0.self_attn.q_norm.weight": (D,),
        "mtp.layers.0.self_attn.k_norm.weight": (D,),
        "mtp.layers.0.mlp.down_proj.weight": (H, I),
    }
    return {k: (0.1 * torch.randn(s, generator=g)).to(torch.bfloat16) for k, s in shapes.items()}


def finish_vlm_shards(d, mtp):
    """As the released Qwen3.5 files, in the 2 shards save_pretrained wrote in
    d: linear_attn.A_log and linear_attn.norm.weight in F32 (exactly the bf16
    values; dt_bias and the rest stay BF16), the MTP head `mtp` (name ->
    tensor) in the last shard; the index rewritten to match."""
    from safetensors.torch import load_file
    index_path = os.path.join(d, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    wmap = {}
    for i, sh in enumerate(shards):
        path = os.path.join(d, sh)
        t = load_file(path)
        for k in t:
            if k.endswith("linear_attn.A_log") or k.endswith("linear_attn.norm.weight"):
                t[k] = t[k].float()
        if i == len(shards) - 1:
            t.update(mtp)
        save_file(t, path, metadata={"format": "pt"})
        wmap.update({k: sh for k in t})
    allt = [v for sh in shards for v in load_file(os.path.join(d, sh)).values()]
    index["weight_map"] = dict(sorted(wmap.items()))
    index["metadata"]["total_size"] = sum(v.numel() * v.element_size() for v in allt)
    if "total_parameters" in index["metadata"]:
        index["metadata"]["total_parameters"] = sum(v.numel() for v in allt)
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def build_qwen35_vlm(name, src_name, seed):
    """The weights of fixture src_name in the released Qwen3.5 layout."""
    from safetensors.torch import load_file
    m = q35_module()
    src, d = os.path.join(OUT, src_name), os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    text = load_file(os.path.join(src, "model.safetensors"))
    tcfg = dict(q35_text_config(), mtp_num_hidden_layers=1)
    cfg = transformers.Qwen3_5Config(text_config=tcfg, vision_config=q35_vision_config(),
                                     tie_word_embeddings=False, **Q35_TOKEN_IDS)
    model = m.Qwen3_5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.model.visual.named_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.float()
          for k, v in text.items()}
    res = model.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys and all(k.startswith("model.visual.") for k in res.missing_keys), res
    model = model.to(torch.bfloat16)
    model.save_pretrained(d, max_shard_size="400KB")
    index_path = os.path.join(d, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2, shards
    assert set(index["weight_map"]) == {k for k in model.state_dict()}, "unexpected key layout"
    finish_vlm_shards(d, q35_mtp_tensors(tcfg, g))
    # The reader must derive layer_types from full_attention_interval here.
    cpath = os.path.join(d, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    assert c["model_type"] == "qwen3_5" and c["text_config"]["model_type"] == "qwen3_5_text"
    assert c["architectures"] == ["Qwen3_5ForConditionalGeneration"], c["architectures"]
    del c["text_config"]["layer_types"]
    c["text_config"]["full_attention_interval"] = 4
    with open(cpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    shutil.copytree(os.path.join(src, "reference"), os.path.join(d, "reference"))
    q35_check_vlm(d, src)
    dts = q35_dtypes([os.path.join(d, sh) for sh in shards])
    print(f"    {name}: {len(shards)} shards; " + "; ".join(
        f"{k} {len(v)} tensors" + (f" ({', '.join(sorted(set(n.split('.')[-2] + '.' + n.split('.')[-1] for n in v)))})"
                                   if k != "BF16" else "") for k, v in dts.items()) + f"; {dir_size(d)} bytes")


def q35_check_vlm(d, src):
    """transformers loads the directory as the VLM and as a text-only causal LM,
    and both give (a)'s recorded states bit for bit."""
    from safetensors.torch import load_file
    ref = load_file(os.path.join(src, "reference", "expected.safetensors"))
    with open(os.path.join(src, "reference", "inputs.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    a_cfg = transformers.AutoConfig.from_pretrained(src)
    v_cfg = transformers.AutoConfig.from_pretrained(d)
    assert v_cfg.text_config.layer_types == a_cfg.layer_types, v_cfg.text_config.layer_types
    vlm, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info  # HF drops ignored mtp.* from the list
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        nmtp = sum(k.startswith("mtp.") for k in json.load(f)["weight_map"])
    assert nmtp > 0
    txt, tinfo = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(txt).__name__ == "Qwen3_5ForCausalLM", type(txt)
    assert not tinfo["missing_keys"] and not tinfo["mismatched_keys"], tinfo
    A = vlm.model.language_model.layers[0].linear_attn.A_log
    assert A.dtype == torch.float32
    for mdl in (vlm, txt):
        mdl.eval()
        hs = []
        with torch.no_grad():
            for s in samples:
                o = mdl(input_ids=torch.tensor([s["input_ids"]]), output_hidden_states=True)
                hs.append(torch.stack([h[0] for h in o.hidden_states]))
        hs = torch.cat(hs, dim=1)
        assert torch.equal(hs, ref["hidden_states"]), (type(mdl).__name__, (hs - ref["hidden_states"]).abs().max())
    print(f"    {os.path.basename(d)}: Qwen3_5ForConditionalGeneration and AutoModelForCausalLM "
          f"({type(txt).__name__}) load it (its {nmtp} mtp.* tensors ignored) "
          f"and reproduce {os.path.basename(src)}'s hidden_states exactly; "
          f"layer_types derived from full_attention_interval")


def build_existing():
    """The four Qwen3/Llama fixtures, one builder each."""
    common = dict(hidden_act="silu", max_position_embeddings=256, attention_bias=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return {
        "qwen3-tied": lambda: build("qwen3-tied", "qwen3", dict(
            common, vocab_size=211, hidden_size=72, intermediate_size=136,
            num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3, head_dim=24,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=11),
        "qwen3-untied": lambda: build("qwen3-untied", "qwen3", dict(
            common, vocab_size=173, hidden_size=48, intermediate_size=88,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=22, spelling="new"),
        "llama3": lambda: build("llama3", "llama", dict(
            common, vocab_size=157, hidden_size=64, intermediate_size=112,
            num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-5, tie_word_embeddings=False, mlp_bias=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}), seed=33),
        "qwen3-yarn": lambda: build("qwen3-yarn", "qwen3", dict(
            common, vocab_size=139, hidden_size=40, intermediate_size=72,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=20,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}), seed=77),
        "qwen2": lambda: build("qwen2", "qwen2", dict(
            common, vocab_size=149, hidden_size=56, intermediate_size=104,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=14,
            rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=88),
        "mistral": lambda: build("mistral", "mistral", dict(
            common, vocab_size=163, hidden_size=48, intermediate_size=92,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=99),
        # sliding windows: Qwen3's from max_window_layers on (layers 1-3
        # of 4; a 4.x file, no layer_types), Mistral's on every layer; a
        # sample exactly as long as the window, one shorter, three longer
        "qwen3-swa": lambda: build("qwen3-swa", "qwen3", dict(
            common, vocab_size=131, hidden_size=40, intermediate_size=76,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
            max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=111,
            lengths=[17, 1, 9, 40, 5], drop=("layer_types",), no_window={"use_sliding_window": False}),
        "mistral-swa": lambda: build("mistral-swa", "mistral", dict(
            common, vocab_size=127, hidden_size=48, intermediate_size=80,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=7,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=122,
            lengths=[17, 1, 9, 40, 7], no_window={"sliding_window": None}),
        "qwen3-sharded": lambda: build("qwen3-sharded", "qwen3", dict(
            common, vocab_size=97, hidden_size=32, intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=44,
            max_shard_size="20KB"),
    }


def run_builders(prog, builders, description):
    """A fixture script's command line: --only NAMES (default all), then the
    chosen builders in the table's order (later fixtures may read the files
    of earlier ones: qwen35-vlm reads qwen35's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--only", metavar="NAMES",
                    help="comma-separated fixture names to (re)make, default all: " + ",".join(builders))
    args = ap.parse_args()
    names = list(builders) if args.only is None else [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in builders]
    if unknown or not names:
        ap.error(f"unknown fixture name(s) {unknown}; known: {','.join(builders)}")
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.makedirs(OUT, exist_ok=True)
    print(f"{prog}: torch {torch.__version__}, transformers {transformers.__version__} -> {OUT}")
    for n in builders:
        if n in names:
            builders[n]()
    return 0


def main():
    builders = build_existing()
    builders["qwen35"] = lambda: build_qwen35("qwen35", seed=55)
    builders["qwen35-vlm"] = lambda: build_qwen35_vlm("qwen35-vlm", "qwen35", seed=66)
    builders["qwen35-yarn"] = lambda: build_qwen35(
        "qwen35-yarn", seed=67, rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        lengths=[17, 9, 70])
    return run_builders("make_targets", builders, "Make the target fixtures under tests/fixtures/targets/.")


if __name__ == "__main__":
    sys.exit(main())
