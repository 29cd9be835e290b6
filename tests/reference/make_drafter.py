"""Golden fixtures for the drafter and its training step (tests/unit/test_drafter.c).

Writes tests/fixtures/drafter/case.safetensors (inputs, weights, reference
outputs; float32 / int32) and tests/fixtures/drafter/config.json (the drafter
config, z-lab layout), then the same case for a sliding-window drafter into
tests/fixtures/drafter-swa/ (layer 0 sliding with a window of 6, layer 1
full, as Qwen3.6-27B's drafter: sliding layers, then a full one). Run
directly or through tests/reference/make_fixtures.py; `--only drafter-swa`
writes one of them.

The case is a tiny drafter with odd sizes (H=20, 3 query heads and 1 KV head
of width 6 so q_proj is narrower than H, I=28, 2 layers, vocabulary 37, 3
taps, block size 5) on two sequences with:
  - anchors closer together than B (6 and 7),
  - blocks running past the end of the sequence (15, 17 in a 19-token one),
  - loss-masked prompt tokens and a masked hole inside the response,
  - an anchor whose block crosses the hole.
Outputs: logits and per-slot CE of every block slot, the step loss
(weighted and count normalisation), the gradient of every parameter for CE
and for KL, and the weights after three AdamW steps with warm-up, cosine
decay, global-norm clipping and weight decay (torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ as the oracle).
"""

import json
import os
import sys

import torch
import struct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import drafter_reference as R  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures")

CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "block_size": 5,
    "num_target_layers": 6,
    "dflash_config": {"mask_token_id": 36, "target_layer_ids": [0, 2, 3]},
    "hidden_size": 20,
    "intermediate_size": 28,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 6,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000.0,
    "rope_scaling": None,
    "max_position_embeddings": 512,
    "vocab_size": 37,
    "tie_word_embeddings": False,
    "layer_types": ["full_attention", "full_attention"],
    "use_sliding_window": False,
    "sliding_window": None,
    "dtype": "bfloat16",
}
# The window (6, block 5) cuts the context of every anchor past 5: slot o
# sees positions a+o-5 .. a-1 of it (slot 4: one), and its block's slots
# 0..o.
CONFIG_SWA = dict(CONFIG, layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                  sliding_window=6, max_window_layers=2)
VARIANTS = {"drafter": CONFIG, "drafter-swa": CONFIG_SWA}
GAMMA = 2.5          # small so the decay matters over B = 5
TARGET_EPS = 1e-5    # the target's rms eps (KL), different from the drafter's on purpose
ANCHORS = [[6, 7, 9, 15, 17], [4, 5, 8]]
ANCHORS_STEP2 = [[8, 11, 12], [6, 10, 11]]
ADAM = dict(peak=0.02, total=5, warmup_ratio=0.2, wd=0.1, b1=0.9, b2=0.999, eps=1e-8, clip=1.0)


def save_file(tensors, path, metadata):
    """A safetensors file written deterministically (the library's metadata
    order varies from run to run): tensors in name order, keys sorted."""
    names = sorted(tensors)
    dt = {torch.float32: "F32", torch.int32: "I32"}
    header, off, blobs = {"__metadata__": metadata}, 0, []
    for n in names:
        b = tensors[n].contiguous().numpy().tobytes()
        header[n] = {"dtype": dt[tensors[n].dtype], "shape": list(tensors[n].shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_case(g, cfg):
    H, V, K = cfg["hidden_size"], cfg["vocab_size"], R.num_taps(cfg)
    P = {}
    for name, shape in R.param_shapes(cfg).items():
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        P[name] = (1.0 + 0.2 * t) if len(shape) == 1 else 0.3 * t
    embed = torch.randn(V, H, generator=g, dtype=torch.float32)
    lm_head = 0.5 * torch.randn(V, H, generator=g, dtype=torch.float32)
    tnorm = 1.0 + 0.2 * torch.randn(H, generator=g, dtype=torch.float32)
    seqs = []
    for T, prompt, holes in [(19, 6, [12]), (13, 4, [])]:
        ids = torch.randint(0, V - 1, (T,), generator=g, dtype=torch.int32)
        lm = torch.zeros(T, dtype=torch.int32)
        lm[prompt:] = 1
        for h in holes:
            lm[h] = 0
        seqs.append({
            "ids": ids, "loss_mask": lm,
            "hidden": torch.randn(T, K * H, generator=g, dtype=torch.float32),
            "last_hidden": 2.0 * torch.randn(T, H, generator=g, dtype=torch.float32),
        })
    return P, embed, lm_head, tnorm, seqs


def f64(d):
    return {k: v.to(torch.float64) for k, v in d.items()}


def seqs64(seqs):
    return [{k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in s.items()} for s in seqs]


def grads_of(P32, cfg, seqs, anchors, lm_head, embed, loss, tnorm=None):
    P = {k: v.clone().requires_grad_(True) for k, v in f64(P32).items()}
    L, per_seq = R.step_loss(P, cfg, seqs64(seqs), anchors, lm_head.double(), embed.double(), GAMMA,
                             loss=loss, tnorm=None if tnorm is None else tnorm.double(), teps=TARGET_EPS)
    L.backward()
    return L, per_seq, {k: v.grad for k, v in P.items()}


def adam_run(P32, cfg, seqs, embed, lm_head):
    """Three optimizer steps; step 0 holds both sequences (the C test splits
    it into two micro-batches), steps 1 and 2 one sequence each."""
    params = {k: v.clone().requires_grad_(True) for k, v in f64(P32).items()}
    names = list(params)
    opt = torch.optim.AdamW([params[n] for n in names], lr=ADAM["peak"], betas=(ADAM["b1"], ADAM["b2"]),
                            eps=ADAM["eps"], weight_decay=ADAM["wd"])
    plan = [([0, 1], ANCHORS), ([0], [ANCHORS_STEP2[0]]), ([1], [ANCHORS_STEP2[1]])]
    norms = []
    for i, (which, anchors) in enumerate(plan):
        opt.zero_grad()
        L, _ = R.step_loss(params, cfg, seqs64([seqs[w] for w in which]), anchors, lm_head.double(),
                           embed.double(), GAMMA)
        L.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([params[n] for n in names], ADAM["clip"])))
        for grp in opt.param_groups:
            grp["lr"] = R.lr_at(i, ADAM["total"], ADAM["warmup_ratio"], ADAM["peak"])
        opt.step()
    return {k: v.detach() for k, v in params.items()}, norms


def make_variant(name, cfg):
    g = torch.Generator().manual_seed(20240617)
    P32, embed, lm_head, tnorm, seqs = make_case(g, cfg)
    out = {}
    for k, v in P32.items():
        out["param." + k] = v
    out["embed"] = embed
    out["lm_head"] = lm_head
    out["target_norm"] = tnorm
    for s, seq in enumerate(seqs):
        out[f"seq{s}.ids"] = seq["ids"]
        out[f"seq{s}.loss_mask"] = seq["loss_mask"]
        out[f"seq{s}.hidden"] = seq["hidden"]
        out[f"seq{s}.last_hidden"] = seq["last_hidden"]
        out[f"seq{s}.anchors"] = torch.tensor(ANCHORS[s], dtype=torch.int32)
        out[f"seq{s}.anchors2"] = torch.tensor(ANCHORS_STEP2[s], dtype=torch.int32)

    L, per_seq, grads = grads_of(P32, cfg, seqs, ANCHORS, lm_head, embed, "ce")
    out["ce.loss"] = torch.tensor([float(L.detach())], dtype=torch.float32)
    for s, (per, logits) in enumerate(per_seq):
        out[f"ce.seq{s}.logits"] = logits.detach().float()
        out[f"ce.seq{s}.slot_loss"] = per.detach().float()
    for k, v in grads.items():
        out["ce.grad." + k] = v.float()
    Lc, _ = R.step_loss(f64(P32), cfg, seqs64(seqs), ANCHORS, lm_head.double(), embed.double(), GAMMA, norm="count")
    out["ce.loss_count"] = torch.tensor([float(Lc)], dtype=torch.float32)

    Lk, per_seq_k, grads_k = grads_of(P32, cfg, seqs, ANCHORS, lm_head, embed, "kl", tnorm)
    out["kl.loss"] = torch.tensor([float(Lk.detach())], dtype=torch.float32)
    for s, (per, _) in enumerate(per_seq_k):
        out[f"kl.seq{s}.slot_loss"] = per.detach().float()
    for k, v in grads_k.items():
        out["kl.grad." + k] = v.float()

    after, norms = adam_run(P32, cfg, seqs, embed, lm_head)
    for k, v in after.items():
        out["adam.after3." + k] = v.float()
    # the change itself, computed in float64 (the test compares deltas)
    for k, v in after.items():
        out["adam.delta3." + k] = (v - P32[k].double()).float()
    out["adam.norms"] = torch.tensor(norms, dtype=torch.float32)

    OUT = os.path.join(FIXTURES, name)
    os.makedirs(OUT, exist_ok=True)
    meta = {"gamma": repr(GAMMA), "target_eps": repr(TARGET_EPS), "adam": json.dumps(ADAM),
            "made_by": "tests/reference/make_drafter.py"}
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, os.path.join(OUT, "case.safetensors"), metadata=meta)
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print(f"{name} fixtures: loss {float(L.detach()):.6f} (count {float(Lc):.6f}), kl {float(Lk.detach()):.6f}, "
          f"grad norms of the AdamW steps {', '.join(f'{n:.3f}' for n in norms)}")


def main():
    only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[1] == "--only" else list(VARIANTS)
    for name in only:
        make_variant(name, VARIANTS[name])


if __name__ == "__main__":
    main()
