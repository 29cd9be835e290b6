#!/usr/bin/env python3
"""Cross-check dflash against the released reference implementations.

Our drafter oracle (drafter_reference.py) and its fixture
(tests/fixtures/drafter/, made by make_drafter.py) were written from our own
spec notes. If the notes misread the references, the C code, the oracle and
the fixture share the error and `make check` still passes. This script runs
THEIR code on OUR fixture and compares:

  zlab.load        z-lab DFlashDraftModel built from the fixture's config.json
                   takes the fixture's weights by their names: every name and
                   shape, no missing or unexpected keys.
  zlab.forward     for every fixture anchor a: their model with the context
                   target_hidden[0:a], the block [ids[a], MASK x (B-1)] and
                   position_ids 0..a+B-1, as their inference loop builds them;
                   block logits (all B slots) vs the fixture's logits.
  zlab.generate    their dflash_generate() loop itself, driven by a scripted
                   target (below) so that it visits the fixture's anchors;
                   the draft logits it computes (slots 1..B-1) vs the fixture.
  zlab.leak        control: the same forward with the anchor's own state in
                   the context (the SpecForge #473 bug) must NOT match.
  sf.load          SpecForge DFlashDraftModel takes the same weights.
  sf.anchors       SpecForge's anchor sampler, asked for every anchor, gives
                   the same candidate set as lib's dfl_anchor_candidates.
  sf.loss/sf.grad  SpecForge's OnlineDFlashModel (the DFlash loss, gamma,
                   weighted normalisation) on the fixture batch with the
                   fixture's anchors substituted for its random ones; loss
                   and every parameter gradient vs the fixture (CE).
  sf.leak, sf.gamma7  controls: anchor-inclusive context mask, gamma 7
                   instead of the fixture's; both must NOT match.
  --swa            SpecForge alone on tests/fixtures/drafter-swa (a
                   sliding-window layer): sf.load .. sf.gamma7 as above, and
                   sf.swa.full, control: the sliding layer run in full must
                   NOT match.
  sp.config        speculators' z-lab converter builds its config from our
                   config.json (layer ids must become ours + 1) and its
                   DFlashDraftModel takes our weights (only the verifier-filled
                   keys missing).
  sp.loss/sp.grad  speculators' DFlashDraftModel forward + KL loss (packed
                   row, document ids) with the fixture's anchors substituted;
                   vs the fixture's KL slot losses and gradients renormalised
                   to speculators' sum(m) + 1e-5 denominator.
  ids.rule         z-lab's and SpecForge's build_target_layer_ids vs lib's
                   dfl_default_layer_ids for L = 1..128, N = 1..8.
  ids.gamma        lib's default gamma per block size vs the values SpecForge
                   documents and ships (7 for B=16, 5 for 10, 4 for 8).
  ids.tap(.sf)     bin/dflash-extract's stream (dflash-pack --export) for
                   layer ids k < L-1 vs z-lab's (and SpecForge's)
                   extract_context_feature on the HF model of
                   tests/fixtures/targets/qwen3-untied; ids.tap.off1: HF
                   hidden_states[k] must NOT match.
  ids.tap.last     id L-1: ours is the pre-norm output of the last layer,
                   z-lab's HF path gives the normed one; a deliberate,
                   documented difference (printed with both numbers).
  sp.anchors       INFO only: speculators' own anchor candidates (a
                   different rule, loss_mask[a] and a < T-B).

Substitutions (no GPU, no flash-attn here):
  * every model runs in float64 with attn_implementation "eager" (SpecForge's
    eager path is the one that zero-fills fully masked padding blocks;
    speculators' eager path uses its create_float_mask);
  * SpecForge's eager mask value finfo(dtype).min is taken for float32 when
    the model runs in float64: eager attention softmaxes in float32, where
    float64's min becomes -inf and the fully masked padding block (keep =
    False) gives NaN gradients (in their fp32/bf16 runs the value is finite);
  * the anchor samplers are monkeypatched to return the fixture's anchors
    (SpecForge: OnlineDFlashModel._sample_anchor_positions on the instance;
    speculators: speculators.models.dflash.core.select_anchors);
  * speculators is imported from its source tree: importlib.metadata.version
    answers for "speculators", and the optional modules it imports for data
    loading (openai, datasets, hs_connectors, loguru) are replaced by empty
    stand-ins; its verifier_norm gets the fixture's target eps (1e-5), which
    in speculators is tied to the draft's eps;
  * z-lab's dflash_generate is driven by a scripted target module: prefill
    logits put the first anchor's token next, verify logits accept exactly
    as many draft tokens as needed to land on the next fixture anchor (gaps
    longer than B get an intermediate step), and its hidden_states tuple
    carries the fixture's tapped features at index layer_id + 1 and NaN at
    every other index, so a wrong tap index or a leaked row shows as NaN;
    its _cuda_time() (torch.cuda.synchronize for return_stats) becomes
    time.perf_counter, and its DynamicCache a subclass whose crop(n) keeps
    the first n tokens, as in the transformers 4.57.1 z-lab pins (5.x's crop
    only takes a negative count).

Fixture values were made in float64 and stored as float32, so agreement is
~1e-14 normalised error (nmse = sum (ref - got)^2 / sum ref^2); the bar is
1e-9. Controls must exceed 1e-4.

Usage (run by hand, not part of make check; needs torch + transformers):
  python3 tests/reference/crosscheck_impls.py --zlab Z --specforge S [--speculators P]
where Z, S, P are checkouts (work trees) of z-lab/dflash, sgl-project/SpecForge
and vllm-project/speculators. Exit status 1 if any check fails.
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch
from torch import nn
from safetensors import safe_open
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
FIX = os.path.join(ROOT, "tests", "fixtures", "drafter")
TOL, CONTROL_MIN = 1e-9, 1e-4

sys.path.insert(0, HERE)
import drafter_reference as R  # noqa: E402  (ours; used only for masks and weights)

results = []


def nmse(got, ref):
    got, ref = torch.as_tensor(got).double().flatten(), torch.as_tensor(ref).double().flatten()
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum())


def report(name, ok, detail):
    results.append(ok)
    print(f"{name:14s} {'PASS' if ok else 'FAIL'}  {detail}")


def check_close(name, got, ref, extra=""):
    e = nmse(got, ref)
    report(name, e < TOL, f"nmse {e:.3g}{extra}")


def check_control(name, got, ref, what):
    e = nmse(got, ref)
    report(name, e > CONTROL_MIN, f"nmse {e:.3g} (control: {what} must differ)")


# --------------------------------------------------------------------------
# the fixture
# --------------------------------------------------------------------------

def load_fixture():
    with open(os.path.join(FIX, "config.json")) as f:
        cfg = json.load(f)
    path = os.path.join(FIX, "case.safetensors")
    t = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    P = {k[len("param."):]: v.double() for k, v in t.items() if k.startswith("param.")}
    seqs = []
    s = 0
    while f"seq{s}.ids" in t:
        seqs.append({k: t[f"seq{s}.{k}"] for k in ("ids", "loss_mask", "hidden", "last_hidden", "anchors")})
        s += 1
    return cfg, t, P, seqs, float(meta["gamma"]), float(meta["target_eps"])


def qwen3_config(cfg):
    from transformers import Qwen3Config
    c = Qwen3Config(**cfg)
    c._attn_implementation = "eager"
    return c


def check_state_dict(name, model, P):
    sd = model.state_dict()
    want = {k: tuple(v.shape) for k, v in P.items()}
    have = {k: tuple(v.shape) for k, v in sd.items()}
    missing = sorted(set(have) - set(want))
    unexpected = sorted(set(want) - set(have))
    shapes = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    ok = not missing and not unexpected and not shapes
    if ok:
        model.load_state_dict(P, strict=True)
    report(name, ok, f"{len(want)} tensors; missing {missing or 0}, unexpected {unexpected or 0}, "
                     f"shape mismatches {shapes or 0}")
    return ok


# --------------------------------------------------------------------------
# z-lab/dflash
# --------------------------------------------------------------------------

def zlab_block_logits(model, seq, a, cfg, embed, lm_head, leak=False):
    """Their inference call for the block anchored at a, with a fresh cache
    (dflash_generate's first call): context = tapped states of 0..a-1."""
    from transformers import DynamicCache
    B, mask = R.block_size(cfg), cfg["dflash_config"]["mask_token_id"]
    ctx = a + 1 if leak else a
    hidden = seq["hidden"].double()[None, :ctx]
    block = torch.tensor([[int(seq["ids"][a])] + [mask] * (B - 1)])
    pos = torch.arange(a + B)[None] if not leak else torch.cat([torch.arange(a + 1), torch.arange(a, a + B)])[None]
    with torch.no_grad():
        out = model(target_hidden=hidden, noise_embedding=embed[block], position_ids=pos,
                    past_key_values=DynamicCache(), use_cache=True, is_causal=False)
    return out[0] @ lm_head.T                                        # [B, V]


def _legacy_crop_cache():
    from transformers import DynamicCache

    class LegacyCropCache(DynamicCache):
        """transformers 4.x crop(n): keep the first n tokens (5.x only takes
        a negative count of tokens to drop)."""

        def crop(self, max_length):
            if max_length >= 0:
                max_length -= self.get_seq_length()
            super().crop(max_length)

    return LegacyCropCache


LegacyCropCache = _legacy_crop_cache()


class ScriptedTarget(nn.Module):
    """Stands in for the target in z-lab's dflash_generate: answers the
    prefill and each verify call so that the loop's next block starts at the
    planned position, and returns the fixture's tapped features as an HF-style
    hidden_states tuple (index layer_id + 1; NaN everywhere else)."""

    def __init__(self, seq, cfg, embed, lm_head, plan):
        super().__init__()
        V, H = embed.shape
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H, _weight=embed.clone())
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight.data = lm_head.clone()
        self.calls = []
        self.lm_head.register_forward_hook(lambda _m, _i, out: self.calls.append(out.detach().clone()))
        self.device = torch.device("cpu")
        self.seq, self.plan = seq, list(plan)
        self.V, self.H, self.B = V, H, R.block_size(cfg)
        self.ids_l = cfg["dflash_config"]["target_layer_ids"]
        self.L = cfg["num_target_layers"]
        self.collision = False

    def _hidden(self, positions, valid_until):
        T = self.seq["hidden"].shape[0]
        n = len(positions)
        states = [torch.full((1, n, self.H), float("nan"), dtype=torch.float64) for _ in range(self.L + 1)]
        for i, k in enumerate(self.ids_l):
            for r, p in enumerate(positions):
                if p < min(T, valid_until):
                    states[k + 1][0, r] = self.seq["hidden"][p, i * self.H:(i + 1) * self.H].double()
        return tuple(states)

    def _onehot(self, toks):
        x = torch.full((1, len(toks), self.V), -30.0, dtype=torch.float64)
        for i, t in enumerate(toks):
            x[0, i, t] = 30.0
        return x

    def forward(self, input_ids, position_ids=None, past_key_values=None, use_cache=True, logits_to_keep=0,
                output_hidden_states=False, **_):
        ids = self.seq["ids"]
        pos = [int(p) for p in position_ids[0]]
        if len(self.calls) == 0 and pos[0] == 0:       # prefill: next token is the first anchor's
            n = len(pos)
            return types.SimpleNamespace(logits=self._onehot([int(ids[n])]),
                                         hidden_states=self._hidden(pos, n))
        start, block = pos[0], [int(t) for t in input_ids[0]]
        nxt = self.plan.pop(0) if self.plan else None
        post = [0] * self.B
        if nxt is None:                                 # last block: accept nothing
            acc = 0
            post[0] = (block[1] + 1) % self.V
            valid = start + 1
        else:
            acc = nxt - start - 1
            assert 0 <= acc <= self.B - 1, (start, nxt)
            for i in range(acc):
                post[i] = block[i + 1]
            post[acc] = int(ids[nxt])
            if acc + 1 <= self.B - 1 and block[acc + 1] == post[acc]:
                self.collision = True                   # the loop would accept further
            valid = nxt
        return types.SimpleNamespace(logits=self._onehot(post), hidden_states=self._hidden(pos, valid))


def visit_plan(anchors, B):
    """Starts after the first: the fixture anchors, with intermediate starts
    where two anchors are more than B apart (one step advances at most B)."""
    plan, cur = [], anchors[0]
    for a in anchors[1:]:
        while a - cur > B:
            cur += B
            plan.append(cur)
        plan.append(a)
        cur = a
    return plan


def run_zlab(zdir, cfg, t, P, seqs):
    sys.path.insert(0, zdir)
    zm = importlib.import_module("dflash.model")
    zm._cuda_time = time.perf_counter   # return_stats times with torch.cuda.synchronize()
    zm.DynamicCache = LegacyCropCache   # z-lab pins transformers 4.57.1: crop(n) keeps n tokens
    embed, lm_head = t["embed"].double(), t["lm_head"].double()
    model = zm.DFlashDraftModel(qwen3_config(cfg)).double().eval()
    if not check_state_dict("zlab.load", model, P):
        return zm
    B = R.block_size(cfg)
    got, ref, leak = [], [], []
    for s, seq in enumerate(seqs):
        flog = t[f"ce.seq{s}.logits"]
        for j, a in enumerate(seq["anchors"].tolist()):
            got.append(zlab_block_logits(model, seq, a, cfg, embed, lm_head))
            leak.append(zlab_block_logits(model, seq, a, cfg, embed, lm_head, leak=True))
            ref.append(flog[j * B:(j + 1) * B])
    check_close("zlab.forward", torch.cat(got), torch.cat(ref), f" ({len(got)} blocks x {B} slots)")
    check_control("zlab.leak", torch.cat(leak), torch.cat(ref), "context including the anchor")

    got, ref, detail = [], [], []
    for s, seq in enumerate(seqs):
        anchors = seq["anchors"].tolist()
        plan = visit_plan(anchors, B)
        tgt = ScriptedTarget(seq, cfg, embed, lm_head, plan)
        n = anchors[0]
        out = zm.dflash_generate(model, tgt, seq["ids"][None, :n].long(), max_new_tokens=anchors[-1] + 1 - n,
                                 stop_token_ids=None, temperature=0.0, return_stats=True)
        starts = [n] + visit_plan(anchors, B)
        if tgt.collision or len(tgt.calls) != len(starts):
            report("zlab.generate", False, f"seq{s}: the scripted loop did not visit the planned starts")
            return zm
        flog = t[f"ce.seq{s}.logits"]
        for j, a in enumerate(anchors):
            got.append(tgt.calls[starts.index(a)][0])
            ref.append(flog[j * B + 1:(j + 1) * B])
        detail.append(f"seq{s} acceptance {out.acceptance_lengths}")
    check_close("zlab.generate", torch.cat(got), torch.cat(ref), f" (slots 1..{B-1}; {'; '.join(detail)})")
    return zm


# --------------------------------------------------------------------------
# SpecForge
# --------------------------------------------------------------------------

def batch_of(seqs):
    T = max(s["ids"].shape[0] for s in seqs)
    N = max(s["anchors"].shape[0] for s in seqs)
    n = len(seqs)
    KH = seqs[0]["hidden"].shape[1]
    ids = torch.zeros(n, T, dtype=torch.long)
    lm = torch.zeros(n, T, dtype=torch.float64)
    hid = torch.zeros(n, T, KH, dtype=torch.float64)
    anc = torch.zeros(n, N, dtype=torch.long)
    keep = torch.zeros(n, N, dtype=torch.bool)
    for i, s in enumerate(seqs):
        Ti, Ni = s["ids"].shape[0], s["anchors"].shape[0]
        ids[i, :Ti] = s["ids"].long()
        lm[i, :Ti] = s["loss_mask"].double()
        hid[i, :Ti] = s["hidden"].double()
        anc[i, :Ni] = s["anchors"].long()
        keep[i, :Ni] = True
    return ids, lm, hid, anc, keep


def rule_dump(*args):
    exe = os.path.join(ROOT, "build", "tests", "rule_dump")
    subprocess.run(["make", "-s", "NO_CUDA=1", "build/tests/rule_dump"], cwd=ROOT, check=True)
    return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout.splitlines()


def run_specforge(sdir, cfg, t, P, seqs, gamma):
    sys.path.insert(0, sdir)
    fm = importlib.import_module("specforge.algorithms.common.dflash_family_model")
    sfd = importlib.import_module("specforge.modeling.draft.dflash")
    V, H = t["embed"].shape
    # eager attention softmaxes in float32: float64's finfo.min (their
    # additive mask value) becomes -inf there, and the fully masked padding
    # block then gives NaN gradients; use float32's min, as in their fp32/bf16
    # runs
    real_prep = sfd._prepare_dflash_eager_mask
    sfd._prepare_dflash_eager_mask = lambda mask, dtype: real_prep(
        mask, torch.float32 if dtype == torch.float64 else dtype)
    draft = sfd.DFlashDraftModel(qwen3_config(cfg)).double()
    if not check_state_dict("sf.load", draft, P):
        return sfd
    head = nn.Linear(H, V, bias=False).double()
    head.weight.data = t["lm_head"].double().clone()
    head.requires_grad_(False)
    emb = nn.Embedding(V, H, _weight=t["embed"].double().clone())
    emb.requires_grad_(False)
    ids, lm, hid, anc, keep = batch_of(seqs)

    def online(g, model=None):
        return fm.OnlineDFlashModel(draft_model=model or draft, target_lm_head=head, target_embed_tokens=emb,
                                    mask_token_id=cfg["dflash_config"]["mask_token_id"],
                                    block_size=R.block_size(cfg), attention_backend="sdpa", num_anchors=512,
                                    loss_decay_gamma=g, objective_chunk_blocks=128, loss_type="dflash")

    # their sampler, asked for every anchor, vs lib's candidate rule
    sampler = online(gamma)
    sampler.num_anchors = 10 ** 6
    masks = [lm[i] for i in range(lm.shape[0])]
    g = torch.Generator().manual_seed(7)
    masks += [(torch.rand(23, generator=g) < 0.7).double() for _ in range(6)]
    theirs = []
    for m in masks:
        a, k = sampler._sample_anchor_positions(m.shape[0], m[None], torch.device("cpu"))
        theirs.append(a[0][k[0]].tolist())
    lines = rule_dump("anchors", *["".join(str(int(x)) for x in m.tolist()) for m in masks])
    ours = [[int(x) for x in ln.split(":")[1].split()] for ln in lines]
    report("sf.anchors", theirs == ours, f"candidate sets of {len(masks)} loss masks "
                                          f"(e.g. seq0 {ours[0]})" + ("" if theirs == ours else f" theirs {theirs}"))

    def loss_and_grads(g, leak=False, model=None):
        model = model or draft
        m = online(g, model)
        m._sample_anchor_positions = lambda seq_len, loss_mask, device: (anc, keep)
        orig = fm.create_dflash_sdpa_mask
        if leak:
            fm.create_dflash_sdpa_mask = lambda anchor_positions, **kw: orig(anchor_positions=anchor_positions + 1, **kw)
        try:
            model.zero_grad(set_to_none=True)
            loss, _acc, _m = m(input_ids=ids, hidden_states=hid, loss_mask=lm)
            loss.backward()
        finally:
            fm.create_dflash_sdpa_mask = orig
        return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    loss, grads = loss_and_grads(gamma)
    names = sorted(grads)
    check_close("sf.loss", loss, t["ce.loss"], f" (theirs {float(loss):.7f}, ours {float(t['ce.loss'][0]):.7f})")
    worst = max(names, key=lambda k: nmse(grads[k], t["ce.grad." + k]))
    check_close("sf.grad", torch.cat([grads[k].flatten() for k in names]),
                torch.cat([t["ce.grad." + k].flatten() for k in names]),
                f" ({len(names)} tensors; worst {worst} {nmse(grads[worst], t['ce.grad.' + worst]):.3g})")
    ref_grad = torch.cat([t["ce.grad." + k].flatten() for k in names])
    _, gk = loss_and_grads(gamma, leak=True)
    check_control("sf.leak", torch.cat([gk[k].flatten() for k in names]), ref_grad,
                  "gradient with a kv <= anchor context mask")
    _, g7 = loss_and_grads(7.0)
    check_control("sf.gamma7", torch.cat([g7[k].flatten() for k in names]), ref_grad,
                  f"gradient with gamma 7 instead of the fixture's {gamma}")
    if cfg.get("use_sliding_window"):
        # the sliding fixture: the same weights with every layer full must differ
        full = sfd.DFlashDraftModel(qwen3_config(dict(cfg, use_sliding_window=False, sliding_window=None,
                                                      layer_types=["full_attention"] * cfg["num_hidden_layers"])))
        full = full.double()
        full.load_state_dict(P, strict=True)
        _, gf = loss_and_grads(gamma, model=full)
        check_control("sf.swa.full", torch.cat([gf[k].flatten() for k in names]), ref_grad,
                      "gradient with the sliding layer run in full")
    return sfd


# --------------------------------------------------------------------------
# speculators
# --------------------------------------------------------------------------

def import_speculators(pdir, other_roots):
    # SpecForge's root holds a datasets/ folder that would shadow the
    # 'datasets' package: its modules are loaded, so drop the roots now
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) not in other_roots]
    real_version = importlib.metadata.version
    importlib.metadata.version = lambda n: "0.0.0+crosscheck" if n == "speculators" else real_version(n)

    class _Null:
        def __getattr__(self, _k):
            return self

        def __call__(self, *a, **k):
            return self

    class _Stub(types.ModuleType):
        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return type(k, (), {})

    loguru = types.ModuleType("loguru")
    loguru.logger = _Null()
    sys.modules.setdefault("loguru", loguru)
    sys.path.insert(0, os.path.join(pdir, "src"))
    stubbed = []
    for _ in range(40):
        try:
            importlib.import_module("speculators.models.dflash")
            importlib.import_module("speculators.convert.dflash.converter")
            break
        except ModuleNotFoundError as e:
            if e.name is None or e.name.startswith("speculators"):
                raise
            stubbed.append(e.name)
            parts = e.name.split(".")
            for i in range(1, len(parts) + 1):
                mname = ".".join(parts[:i])
                if mname not in sys.modules:
                    mod = _Stub(mname)
                    mod.__path__ = []
                    sys.modules[mname] = mod
            for k in [k for k in sys.modules if k.startswith("speculators")]:
                del sys.modules[k]
    return stubbed


def run_speculators(pdir, other_roots, cfg, t, P, seqs, gamma, target_eps):
    stubbed = import_speculators(pdir, other_roots)
    core = importlib.import_module("speculators.models.dflash.core")
    conv = importlib.import_module("speculators.convert.dflash.converter")
    eager = importlib.import_module("speculators.losses.eager")
    V, H = t["embed"].shape
    B = R.block_size(cfg)
    with tempfile.TemporaryDirectory() as base:
        with open(os.path.join(base, "config.json"), "w") as f:
            json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
                       "num_hidden_layers": cfg["num_target_layers"], "vocab_size": V,
                       "rms_norm_eps": target_eps}, f)
        spcfg = conv.DFlashConverter()._build_config(json.loads(json.dumps(cfg)), base, None)
    want_ids = [k + 1 for k in cfg["dflash_config"]["target_layer_ids"] if k + 1 != cfg["num_target_layers"]]
    spcfg.transformer_layer_config._attn_implementation = "eager"
    model = core.DFlashDraftModel(config=spcfg)
    missing, unexpected = model.load_state_dict(P, strict=False)
    filled = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"}
    ok = (spcfg.aux_hidden_state_layer_ids == want_ids and not unexpected and set(missing) <= filled)
    report("sp.config", ok, f"aux_hidden_state_layer_ids {spcfg.aux_hidden_state_layer_ids} (ours + 1: {want_ids}); "
                            f"unexpected {unexpected or 0}; missing only verifier-filled {sorted(missing)}"
                            + (f"; stand-ins for {stubbed}" if stubbed else ""))
    if not ok:
        return
    with torch.no_grad():
        model.embed_tokens.weight.copy_(t["embed"])
        model.lm_head.weight.copy_(t["lm_head"])
        model.verifier_lm_head.weight.copy_(t["lm_head"])
        model.verifier_norm.weight.copy_(t["target_norm"])
    model.verifier_norm.variance_epsilon = target_eps
    model.double()

    # one packed row: documents back to back, positions restarting, doc ids
    offs, parts = 0, []
    anchors = []
    for d, s in enumerate(seqs):
        Ti = s["ids"].shape[0]
        parts.append((s, torch.full((Ti,), d), torch.arange(Ti)))
        anchors += [offs + a for a in s["anchors"].tolist()]
        offs += Ti
    cat = lambda key, dt: torch.cat([p[0][key] for p in parts]).to(dt)[None]  # noqa: E731
    ids, lm = cat("ids", torch.long), cat("loss_mask", torch.float64)
    hid, last = cat("hidden", torch.float64), cat("last_hidden", torch.float64)
    doc = torch.cat([p[1] for p in parts])[None]
    pos = torch.cat([p[2] for p in parts])[None]
    N = len(anchors)
    anc, valid = torch.tensor(anchors), torch.ones(N, dtype=torch.bool)
    real_select = core.select_anchors
    core.select_anchors = lambda loss_mask, num_anchors, block_size: (anc, valid)
    try:
        model.zero_grad(set_to_none=True)
        _, loss, _metrics = model(hidden_states=hid, input_ids=ids, loss_mask=lm, verifier_last_hidden_states=last,
                                  document_ids=doc, position_ids=pos, loss_config={"kl_div": (eager.kl_div_loss, 1.0)},
                                  gamma=gamma, max_anchors=N, per_position_loss_weight="fixed-exp-decay")
        loss.backward()
    finally:
        core.select_anchors = real_select

    # ours, renormalised: the fixture's KL loss is sum(w m kl) / sum(w m);
    # speculators divides the same numerator by sum(m) + 1e-5
    sw, sm = 0.0, 0.0
    for s in seqs:
        y, m = R.labels_and_mask(s["ids"], s["loss_mask"], s["anchors"].tolist(), B)
        w = torch.tensor([R.slot_weight(k, gamma) for _ in s["anchors"].tolist() for k in range(B)])
        sw += float((w * m).sum())
        sm += float(m.sum())
    scale = sw / (sm + 1e-5)
    ref = float(t["kl.loss"][0]) * scale
    check_close("sp.loss", loss.detach(), torch.tensor([ref]),
                f" (theirs {float(loss.detach()):.7f}, ours {ref:.7f} = fixture kl.loss x sum(wm)/(sum(m)+1e-5))")
    names = sorted(P)
    got = {k: p.grad for k, p in model.named_parameters() if k in P}
    worst = max(names, key=lambda k: nmse(got[k], t["kl.grad." + k] * scale))
    check_close("sp.grad", torch.cat([got[k].flatten() for k in names]),
                torch.cat([t["kl.grad." + k].flatten() * scale for k in names]),
                f" ({len(names)} tensors; worst {worst} {nmse(got[worst], t['kl.grad.' + worst] * scale):.3g})")
    # not compared, reported: speculators' own anchor candidates
    m0 = seqs[0]["loss_mask"][None].long()
    a, v = real_select(m0, 10 ** 4, B)
    print(f"{'sp.anchors':14s} INFO  speculators' candidates for seq0 {sorted(a[v].tolist())} "
          f"(loss_mask[a] and a < T-B; dflash and SpecForge take loss_mask[a] = loss_mask[a+1] = 1, a <= T-2)")


# --------------------------------------------------------------------------
# layer ids: the default rule, gamma, and which state a tap id means
# --------------------------------------------------------------------------

def run_layer_ids(zm, sfd, sdir):
    max_l, max_n = 128, 8
    ours = {}
    for ln in rule_dump("layer-ids", str(max_l), str(max_n)):
        head, vals = ln.split(":")
        _, L, n = head.split()
        ours[(int(L), int(n))] = [int(x) for x in vals.split()]
    bad = [(k, v, zm.build_target_layer_ids(*k)) for k, v in ours.items() if zm.build_target_layer_ids(*k) != v]
    if sfd is not None:
        bad += [(k, v, sfd.build_target_layer_ids(*k)) for k, v in ours.items()
                if sfd.build_target_layer_ids(*k) != v]
    ties = sum(1 for (L, n) in ours if n > 1 and any(((L - 4) * i) % (n - 1) * 2 == (n - 1) for i in range(n)))
    report("ids.rule", not bad, f"{len(ours)} (L, N) pairs, {ties} with a .5 tie; e.g. (36,5) {ours[(36, 5)]}, "
                                f"(32,5) {ours[(32, 5)]}" + (f"; first mismatch {bad[0]}" if bad else ""))

    # gamma: SpecForge ships 7 for B = 16 in every DFlash example config and
    # documents 7/5/4 for B = 16/10/8 (commit b8da45ae)
    shipped = set()
    cfgdir = os.path.join(sdir, "examples", "configs")
    for fn in sorted(os.listdir(cfgdir)):
        if "dflash" in fn and fn.endswith(".yaml"):
            for ln in open(os.path.join(cfgdir, fn)):
                if ln.strip().startswith("loss_decay_gamma:"):
                    shipped.add(float(ln.split(":")[1]))
    gl = {int(ln.split()[1].rstrip(":")): float(ln.split()[2]) for ln in rule_dump("gamma", "8", "10", "16")}
    ok = gl == {8: 4.0, 10: 5.0, 16: 7.0} and shipped == {7.0}
    report("ids.gamma", ok, f"lib defaults {gl}; SpecForge example configs {sorted(shipped)} (B = 16)")


def run_tap(zm, sfd):
    """bin/dflash-extract vs z-lab's extract_context_feature on a real HF model."""
    from transformers import AutoModelForCausalLM
    tdir = os.path.join(ROOT, "tests", "fixtures", "targets", "qwen3-untied")
    exe_x, exe_p = os.path.join(ROOT, "bin", "dflash-extract"), os.path.join(ROOT, "bin", "dflash-pack")
    subprocess.run(["make", "-s", "NO_CUDA=1", "bin/dflash-extract", "bin/dflash-pack"], cwd=ROOT, check=True)
    hf = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    L = hf.config.num_hidden_layers
    inner = list(range(L - 1))
    with tempfile.TemporaryDirectory() as tmp:
        dfs, exp = os.path.join(tmp, "x.dfs"), os.path.join(tmp, "exp")
        subprocess.run([exe_x, "--model", tdir, "--layers", ",".join(map(str, inner + [L - 1])),
                        os.path.join(tdir, "reference", "inputs.jsonl"), "-o", dfs], check=True)
        subprocess.run([exe_p, "--export", exp, dfs], check=True)
        ours, zl, sf, shifted, last_ours, last_post, last_pre = [], [], [], [], [], [], []
        H = hf.config.hidden_size
        for rec in sorted(d for d in os.listdir(exp) if os.path.isdir(os.path.join(exp, d))):
            ids = torch.from_numpy(np.load(os.path.join(exp, rec, "input_ids.npy")).astype(np.int64))[None]
            mine = torch.from_numpy(np.load(os.path.join(exp, rec, "hidden.npy")))
            pre = []
            h = hf.model.layers[L - 1].register_forward_hook(lambda _m, _i, out: pre.append(
                out[0] if isinstance(out, tuple) else out))
            with torch.no_grad():
                out = hf(input_ids=ids, output_hidden_states=True)
            h.remove()
            hs = out.hidden_states
            ours.append(mine[:, :len(inner) * H])
            zl.append(zm.extract_context_feature(hs, inner)[0])
            if sfd is not None:
                sf.append(sfd.extract_context_feature(hs, inner)[0])
            shifted.append(torch.cat([hs[k] for k in inner], -1)[0])        # hidden_states[k]: one too shallow
            last_ours.append(mine[:, len(inner) * H:])
            last_post.append(zm.extract_context_feature(hs, [L - 1])[0])
            last_pre.append(pre[0].reshape(-1, H))
    bf16 = 1e-5   # the stream stores bf16 (tests/unit/test_target.c BF16_TOL)
    e = nmse(torch.cat(ours), torch.cat(zl))
    report("ids.tap", e < bf16, f"nmse {e:.3g} (< {bf16:g}, bf16 stream) for ids {inner} of a {L}-layer Qwen3: "
                                f"dflash-extract == z-lab hidden_states[k+1]")
    if sf:
        e = nmse(torch.cat(ours), torch.cat(sf))
        report("ids.tap.sf", e < bf16, f"nmse {e:.3g}: dflash-extract == SpecForge extract_context_feature")
    check_control("ids.tap.off1", torch.cat(ours), torch.cat(shifted), "hidden_states[k] (off by one)")
    e_post = nmse(torch.cat(last_ours), torch.cat(last_post))
    e_pre = nmse(torch.cat(last_ours), torch.cat(last_pre))
    report("ids.tap.last", e_pre < bf16,
           f"id L-1: vs the pre-norm output of layer L-1 nmse {e_pre:.3g}; vs z-lab's hidden_states[L] "
           f"(after the final norm) nmse {e_post:.3g}. DELIBERATE DIFFERENCE, documented in man dflash-extract "
           f"('Layer ids'): the residual stream after layer L-1, as an engine capturing after the last layer "
           f"sees it; z-lab's HF path would feed the normed state. The default rule never picks L-1, and "
           f"speculators' converter drops id L-1 (its last layer is verifier_last_hidden_states)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zlab", required=True, help="work tree of z-lab/dflash")
    ap.add_argument("--specforge", required=True, help="work tree of sgl-project/SpecForge")
    ap.add_argument("--speculators", help="work tree of vllm-project/speculators")
    ap.add_argument("--swa", action="store_true",
                    help="SpecForge alone on tests/fixtures/drafter-swa (a sliding-window layer): z-lab's HF model "
                         "takes its window from flash-attn only (eager ignores it), speculators reads another rule")
    a = ap.parse_args()
    if a.swa:
        global FIX
        FIX = FIX + "-swa"
        cfg, t, P, seqs, gamma, _ = load_fixture()
        run_specforge(os.path.abspath(a.specforge), cfg, t, P, seqs, gamma)
        print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
        return 0 if all(results) else 1
    torch.manual_seed(0)
    cfg, t, P, seqs, gamma, target_eps = load_fixture()
    zm = run_zlab(os.path.abspath(a.zlab), cfg, t, P, seqs)
    sfd = run_specforge(os.path.abspath(a.specforge), cfg, t, P, seqs, gamma)
    if a.speculators:
        run_speculators(os.path.abspath(a.speculators), {os.path.abspath(a.zlab), os.path.abspath(a.specforge)}, cfg, t, P, seqs, gamma, target_eps)
    run_layer_ids(zm, sfd, os.path.abspath(a.specforge))
    run_tap(zm, sfd)
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
