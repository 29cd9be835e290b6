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

Weights: every Linear and the embedding N(0, 0.1^2), every RMSNorm weight
1 + N(0, 0.2^2) (not ones, so a norm applied with the wrong weight shows).
With this scale every layer changes the residual stream a lot, so tapping the
wrong layer is far outside the test thresholds (checked below).

Run: python3 tests/reference/make_targets.py   (torch + transformers, CPU)
"""
import json
import os
import shutil
import sys

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


def make_inputs(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(LENGTHS):
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


def record(model_dir, samples, ref_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
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
              metadata={"made_by": f"tests/reference/make_targets.py with torch {torch.__version__}, "
                                   f"transformers {transformers.__version__}: HF output.hidden_states, "
                                   "fp32 compute on bf16 weights, eager attention"})
    with open(os.path.join(ref_dir, "inputs.jsonl"), "w") as f:
        for s in samples:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")
    gaps = tensors["gap"]
    print(f"  {os.path.basename(model_dir)}: L={L} T={hs.shape[1]} H={hs.shape[2]} "
          f"min gap {gaps.min():.2e}, {int((gaps < 1e-3).sum())} gaps < 1e-3")


def build(name, arch, cfg_kwargs, seed, spelling="old", max_shard_size=None):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**cfg_kwargs)
        model = transformers.Qwen3ForCausalLM(cfg)
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
    if spelling == "old":
        c = old_spelling(c)
        with open(cpath, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
            f.write("\n")
    # The file we read back must mean what we built.
    back = transformers.AutoConfig.from_pretrained(d)
    assert back.rope_parameters == cfg.rope_parameters, (back.rope_parameters, cfg.rope_parameters)
    record(d, make_inputs(cfg.vocab_size, seed + 1), os.path.join(d, "reference"))


def main():
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.makedirs(OUT, exist_ok=True)
    print(f"make_targets: torch {torch.__version__}, transformers {transformers.__version__} -> {OUT}")
    common = dict(hidden_act="silu", max_position_embeddings=256, attention_bias=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None)
    build("qwen3-tied", "qwen3", dict(common, vocab_size=211, hidden_size=72, intermediate_size=136,
          num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3, head_dim=24,
          rms_norm_eps=1e-6, tie_word_embeddings=True,
          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=11)
    build("qwen3-untied", "qwen3", dict(common, vocab_size=173, hidden_size=48, intermediate_size=88,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
          rms_norm_eps=1e-6, tie_word_embeddings=False,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=22, spelling="new")
    build("llama3", "llama", dict(common, vocab_size=157, hidden_size=64, intermediate_size=112,
          num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rms_norm_eps=1e-5, tie_word_embeddings=False, mlp_bias=False,
          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}), seed=33)
    build("qwen3-sharded", "qwen3", dict(common, vocab_size=97, hidden_size=32, intermediate_size=64,
          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
          rms_norm_eps=1e-6, tie_word_embeddings=True,
          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=44,
          max_shard_size="20KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
