#!/usr/bin/env python3
"""Cross-check dflash-score against the reference implementations.

crosscheck_impls.py checks the drafter math (forward, loss, gradients, taps).
This script checks what bin/dflash-score (lib/score.c) makes of it: the
speculative loop, tau, per-position acceptance, and the offline
(teacher-forced) metrics, against the reference code run on the same target
and drafter.

The target and drafter are those of pipelines/demo.sh: a random 4-layer
Qwen3 (hidden 64, vocabulary 128, eos 2) and a 2-layer drafter (block 16,
taps 0 and 2) trained 600 steps on the target's own greedy continuations,
so that tau is well above 1. Pass --demo DIR to reuse a run of
`DEMO_OUT=DIR pipelines/demo.sh`; without it the demo runs first (~1 min).

Online (held-out prompts of the demo, greedy, the same max new tokens):

  on.lossless      Hugging Face greedy decoding of the target (float64, eager,
                   KV cache, our loop) = z-lab dflash_generate's output = the
                   speculative output of dflash-score = dflash-score's own
                   plain greedy output, token for token, every prompt.
  on.cycles        the per-cycle acceptance lengths (a + 1) of z-lab's
                   dflash_generate (run with the real HF target in float64)
                   = dflash-score --emit's acceptance_lengths, every cycle of
                   every prompt, and the cycle anchors = the positions the
                   lengths imply.
  on.tau.zlab      dflash-score's tau_macro = z-lab's benchmark.py tau
                   (_print_decode_summary, called on z-lab's lengths: mean
                   over responses of the mean cycle length), and its
                   histogram of lengths b = 0..B = dflash's hist (a = b - 1).
  on.tau.sp        dflash-score's tau_pooled = speculators'
                   extract_spec_decode_metrics acceptance_length (1 +
                   accepted / drafts) on vLLM-style counters made from
                   z-lab's cycles; its acceptance_at_pos_i (the fraction of
                   drafts whose slot i+1 was accepted, unconditional) = the
                   running product of dflash's conditional accept_k.
  on.eos.*         the same with an eos id that the greedy outputs hit (a
                   copy of the target whose config.json names it): the stop
                   and truncation rules of the loops.
  on.tau.off1      control: z-lab's tau without the bonus token (mean a)
                   compared with dflash's tau must FAIL.
  on.acc.uncond    control: speculators' unconditional acceptance_at_pos
                   compared directly with dflash's conditional accept_k
                   must FAIL.
  on.bf16          INFO: the same z-lab run without rounding the tapped
                   states to bf16 (see Substitutions): cycles that differ.

Offline (the demo's validation split val.dfs, every supervised anchor):

  off.sf           SpecForge's teacher-forced acceptance length, the one
                   its DFlash-family code computes (compute_accept_len and
                   the accept_len metric of OnlineDominoModel, which with a
                   plain DFlashDraftModel, whose apply_logits_head is the
                   identity, is DFlash's): run on the stream's tokens, bf16
                   features and our checkpoint, float64; vs dflash-score's
                   tau_pooled, and per record (SpecForge's batch metric on a
                   batch of one) vs tau_macro. SpecForge's own anchor
                   sampler with every candidate: the block count must agree.
  off.stats        from the predictions SpecForge's forward made (captured
                   at compute_accept_len), dflash's documented definitions
                   recomputed in PyTorch: hist of s, accept_k (conditional,
                   censored at invalid slots), accuracy_k, accuracy; vs
                   dflash-score's output.
  off.sp           speculators' DFlash compute_metrics on the same block
                   logits (labels as one-hot targets, the validity mask as
                   loss_mask): its position_k_acc and full_acc = dflash's
                   accuracy_k and accuracy. Its EAL (sum of products of
                   marginal accuracies, an independence approximation) is
                   printed as INFO beside tau_pooled - 1.
  off.gap.*        the same on a copy of the records whose loss_mask is 0
                   at every 7th response token: slots that cannot be
                   verified inside a block. dflash ends the prefix at the
                   first invalid slot; SpecForge's compute_accept_len lets
                   the prefix run through invalid slots (they count as
                   correct, add 0). off.gap.stats must still PASS;
                   off.gap.sf prints both taus, a DELIBERATE DIFFERENCE
                   documented in man dflash-score.
  off.tau.off1     control: SpecForge's accept_len without its + 1 vs
                   dflash's tau_pooled must FAIL.

Near-ties. Our target and drafter run in float32, the references in
float64. A greedy argmax whose top-2 logit margin is below TIE (1e-4) could
be decided differently by the two; every relevant argmax (the target's
greedy tokens, the verify positions used, the draft slots compared, the
offline block slots up to the first mismatch) is checked, the number below
TIE is printed, and prompts/anchors with one are excluded from the exact
comparison (both sides rerun without them) rather than loosening it.

Substitutions:
  * z-lab's dflash_generate: _cuda_time -> time.perf_counter; DynamicCache
    -> a subclass whose crop(n) keeps n tokens (transformers 4.57.1, which
    z-lab pins); extract_context_feature rounds the tapped states to bf16,
    as dflash-score does on purpose (the drafter sees what a stream stores,
    so online and offline runs at the same anchors agree exactly);
    on.bf16 shows what the rounding changes.
  * SpecForge: the eager mask value finfo(float32).min in float64 (see
    crosscheck_impls.py).
  * speculators and z-lab's benchmark.py: stand-ins for modules they import
    but these functions do not use (loguru, ...).

Tolerances: dflash-score --json writes reals with 10 significant digits,
so its numbers are compared at 1e-9 relative (1e-8 for a product of 15 of
them, 1e-6 against speculators' float32 division and SpecForge's per-record
metric, whose denominator carries + 1e-6); counts (cycles, histograms,
tokens) are compared exactly.

The offline records are the first --records of val.dfs extracted again by
dflash-extract (so that a loss_mask with gaps can be made from them); both
sides score that stream.

Usage (run by hand, not part of make check; needs torch + transformers):
  python3 tests/reference/crosscheck_score.py --zlab Z --specforge S \
      --speculators P [--demo DIR] [--prompts 16] [--records 8]
Exit status 1 if any check fails.
"""

import argparse
import contextlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import crosscheck_impls as X  # noqa: E402  (report, LegacyCropCache, import_speculators)

TIE = 1e-4
JTOL = 1e-9    # dflash-score --json writes reals with 10 significant digits
BIN = os.path.join(ROOT, "bin")
results = X.results
report = X.report


def control(name, compare_ok, detail):
    """A control: the comparison must fail; the line says so."""
    report(name, not compare_ok, f"control, must FAIL: comparison {'passed' if compare_ok else 'FAILED'}: {detail}")


def close(a, b, rel=1e-9):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (np.abs(a - b) <= rel * np.maximum(1.0, np.abs(b)))))


def run(*cmd, **kw):
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw).stdout


def score_json(*args):
    out = run(os.path.join(BIN, "dflash-score"), "--json", "--threads", "1", *args)
    return json.loads(out.splitlines()[0])


def margin(logits):
    """top-1 minus top-2 logit, last axis."""
    t = logits.double().topk(2, dim=-1).values
    return t[..., 0] - t[..., 1]


# --------------------------------------------------------------------------
# the demo's target and drafter
# --------------------------------------------------------------------------

def demo_dir(arg, tmp):
    if arg:
        return os.path.abspath(arg)
    d = os.path.join(tmp, "demo")
    subprocess.run(["make", "-s", "NO_CUDA=1", "all", "build/tests/mktarget"], cwd=ROOT, check=True)
    subprocess.run([os.path.join(ROOT, "pipelines", "demo.sh")], cwd=ROOT, check=True,
                   env=dict(os.environ, DEMO_OUT=d), stdout=subprocess.DEVNULL)
    return d


def last_ckpt(d):
    steps = [int(n[5:]) for n in os.listdir(d) if n.startswith("ckpt-") and n[5:].isdigit()]
    return os.path.join(d, f"ckpt-{max(steps)}"), max(steps)


def load_target(tdir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float64, attn_implementation="eager").eval()
    return hf


def load_zlab_drafter(zm, ckpt):
    from safetensors.torch import load_file
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    model = zm.DFlashDraftModel(X.qwen3_config(cfg)).double().eval()
    model.load_state_dict({k: v.double() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()},
                          strict=True)
    return model, cfg


# --------------------------------------------------------------------------
# online
# --------------------------------------------------------------------------

@torch.no_grad()
def hf_greedy(hf, prompt, max_new, eos):
    """Plain greedy decoding with a KV cache; the output stops after an eos.
    Returns the tokens and the smallest top-2 margin of the argmaxes taken."""
    from transformers import DynamicCache
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out, m = [], float("inf")
    pos = 0
    while len(out) < max_new:
        o = hf(input_ids=ids, position_ids=torch.arange(pos, pos + ids.shape[1])[None], past_key_values=cache,
               use_cache=True)
        pos += ids.shape[1]
        lg = o.logits[0, -1]
        m = min(m, float(margin(lg)))
        tok = int(lg.argmax())
        out.append(tok)
        if tok in eos:
            break
        ids = torch.tensor([[tok]])
    return out, m


class Recorder:
    """Wraps z-lab's sample(): keeps the top-2 margins of the last draft."""

    def __init__(self, zm, B):
        self.zm, self.B, self.orig = zm, B, zm.sample
        self.pending = None
        self.min_draft = self.min_verify = float("inf")
        zm.sample = self

    def __call__(self, logits, temperature=0.0):
        if logits.shape[1] == self.B - 1:
            self.pending = margin(logits[0])
        return self.orig(logits, temperature)


def instrumented_generate(zm, model, hf, prompt, max_new, eos, B):
    """z-lab's loop, with the relevant margins of every cycle recorded."""
    rec = Recorder(zm, B)
    cyc = []
    try:
        out = zm.dflash_generate(model, _CycleTarget(hf, rec, cyc), torch.tensor([prompt]), max_new_tokens=max_new,
                                 stop_token_ids=eos or None, temperature=0.0, return_stats=True)
    finally:
        zm.sample = rec.orig
    for a, (dm, vm) in zip([L - 1 for L in out.acceptance_lengths], cyc):
        if dm is not None:
            rec.min_draft = min(rec.min_draft, float(dm[:min(a + 1, B - 1)].min()))
        rec.min_verify = min(rec.min_verify, float(vm[:a + 1].min()))
    return ([int(t) for t in out.output_ids[0, len(prompt):]], [int(x) for x in out.acceptance_lengths],
            min(rec.min_draft, rec.min_verify))


class _CycleTarget(nn.Module):
    """The real HF target, passed through; after each verify call it files
    the cycle's draft and verify margins (the sample() wrapper saw them)."""

    def __init__(self, hf, rec, cyc):
        super().__init__()
        self.hf, self.rec, self.cyc = hf, rec, cyc
        self.model, self.lm_head, self.device = hf.model, hf.lm_head, torch.device("cpu")
        self.prefill_margin = float("inf")

    def forward(self, input_ids, **kw):
        out = self.hf(input_ids=input_ids, **kw)
        if input_ids.shape[1] == self.rec.B:
            self.cyc.append((self.rec.pending, margin(out.logits[0])))
            self.rec.pending = None
        return out


def bf16_taps(zm, on):
    orig = zm.__dict__.setdefault("_orig_extract_context_feature", zm.extract_context_feature)
    zm.extract_context_feature = ((lambda hs, ids: orig(hs, ids).to(torch.bfloat16).to(torch.float64)) if on else orig)


def online_stats(lengths_per_prompt, B):
    """dflash's documented online statistics from per-prompt cycle lengths."""
    allL = [L for ls in lengths_per_prompt for L in ls]
    hist = [sum(1 for L in allL if L - 1 == a) for a in range(B)]
    reach = [sum(1 for L in allL if L - 1 >= k - 1) for k in range(1, B)]
    acc = [sum(1 for L in allL if L - 1 >= k) for k in range(1, B)]
    return hist, [a / r if r else float("nan") for a, r in zip(acc, reach)]


def zlab_summary(bench, lengths_per_prompt, B):
    """z-lab benchmark.py's own summary on these lengths: (tau, histogram)."""
    ns = types.SimpleNamespace
    responses = [{1: ns(time_per_output_token=1.0), B: ns(time_per_output_token=1.0, acceptance_lengths=ls)}
                 for ls in lengths_per_prompt]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench._print_decode_summary(responses, B)
    txt = buf.getvalue()
    tau = float(txt.split("Average Acceptance length:")[1].split()[0])
    hist = [float(x.strip(" '%")) / 100 for x in txt.split("histogram:")[1].strip().strip("[]").split(",")]
    return tau, hist, txt


def import_zlab_benchmark(zdir):
    for name in ("loguru",):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                m = types.ModuleType(name)
                m.logger = types.SimpleNamespace(info=print, warning=print, error=print, debug=print)
                sys.modules[name] = m
    bench = importlib.import_module("dflash.benchmark")
    bench.print = print   # rich's print: plain text for parsing
    return bench


def import_perf_utils(pdir):
    path = os.path.join(pdir, "scripts", "evaluate", "perf_utils.py")
    spec = importlib.util.spec_from_file_location("sp_perf_utils", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sp_perf_utils"] = mod
    spec.loader.exec_module(mod)
    return mod


def vllm_counters(pu, lengths, B):
    """vLLM's spec-decode counters for these cycles (one draft per cycle,
    B-1 draft tokens each; per_pos[i] = drafts whose slot i+1 was accepted)."""
    a = [L - 1 for L in lengths]
    return [pu.Counter("vllm:spec_decode_num_drafts", float(len(a))),
            pu.Counter("vllm:spec_decode_num_draft_tokens", float(len(a) * (B - 1))),
            pu.Counter("vllm:spec_decode_num_accepted_tokens", float(sum(a))),
            pu.Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [float(sum(1 for x in a if x > i))
                                                                       for i in range(B - 1)])]


def run_online(zm, bench, pu, d, tmp, tag, eos_id=None, max_new=128, nprompts=None):
    ckpt, _ = last_ckpt(d)
    tdir = os.path.join(d, "target")
    if eos_id is not None:
        tdir = os.path.join(tmp, "target-eos")
        shutil.copytree(os.path.join(d, "target"), tdir, dirs_exist_ok=True)
        with open(os.path.join(tdir, "config.json")) as f:
            c = json.load(f)
        c["eos_token_id"] = eos_id
        with open(os.path.join(tdir, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
    hf = load_target(tdir)
    model, cfg = load_zlab_drafter(zm, ckpt)
    B = cfg["block_size"]
    eos = [eos_id] if eos_id is not None else []
    with open(os.path.join(d, "prompts-eval.jsonl")) as f:
        prompts = [json.loads(ln) for ln in f][:nprompts]

    # the references
    bf16_taps(zm, True)
    ref = {}
    for p in prompts:
        g, gm = hf_greedy(hf, p["input_ids"], max_new, eos)
        z, L, zmarg = instrumented_generate(zm, model, hf, p["input_ids"], max_new, eos, B)
        ref[p["id"]] = dict(greedy=g, zlab=z, lengths=L, margin=min(gm, zmarg))

    # dflash-score on all prompts; ties excluded by rerunning without them
    def dflash(subset):
        pf, ef = os.path.join(tmp, f"{tag}.prompts.jsonl"), os.path.join(tmp, f"{tag}.emit.jsonl")
        with open(pf, "w") as f:
            for p in subset:
                f.write(json.dumps(p) + "\n")
        line = score_json("--target", tdir, "--drafter", ckpt, "--prompts", pf, "--max-new-tokens", max_new,
                          "--emit", ef, *([] if eos else ["--ignore-eos"]))
        with open(ef) as f:
            emit = {e["id"]: e for e in map(json.loads, f)}
        return line, emit

    ties = [p["id"] for p in prompts if ref[p["id"]]["margin"] < TIE]
    kept = [p for p in prompts if p["id"] not in ties]
    if ties:   # INFO: do the excluded prompts agree anyway?
        _, emit_all = dflash(prompts)
        agree = [i for i in ties if ref[i]["zlab"] == emit_all[i]["output_ids"] == ref[i]["greedy"]
                 and ref[i]["lengths"] == emit_all[i]["acceptance_lengths"]]
        print(f"{'on.' + tag + 'ties':14s} INFO  near-tie prompts {ties}: outputs and cycles agree anyway on "
              f"{len(agree)} of {len(ties)} (margins {[round(ref[i]['margin'], 7) for i in ties]})")
    line, emit = dflash(kept)
    ids = [p["id"] for p in kept]
    min_margin = min(ref[i]["margin"] for i in ids)
    tie_note = (f"{len(ties)} of {len(prompts)} prompts with a top-2 margin < {TIE:g} excluded {ties}; "
                f"smallest margin kept {min_margin:.3g}")

    lossless_bad = [i for i in ids if not (ref[i]["greedy"] == ref[i]["zlab"] == emit[i]["output_ids"]
                                           == emit[i]["greedy_ids"])]
    ntok = sum(len(ref[i]["greedy"]) for i in ids)
    stopped = sum(1 for i in ids if len(ref[i]["greedy"]) < max_new)
    report(f"on.{tag}lossless", not lossless_bad and line["mismatches"] == 0,
           f"{len(ids)} prompts, {ntok} tokens ({stopped} stopped at eos {eos or '-'}): HF greedy = z-lab = "
           f"dflash spec = dflash greedy; mismatches column {line['mismatches']}"
           + (f"; differ: {lossless_bad}" if lossless_bad else "") + f"; {tie_note}")

    zl = [ref[i]["lengths"] for i in ids]
    dl = [emit[i]["acceptance_lengths"] for i in ids]
    n = len(ids)
    anchors_ok = all(emit[i]["anchors"] == list(np.cumsum([emit[i]["prompt_tokens"]] + emit[i]["acceptance_lengths"]
                                                          )[:-1]) for i in ids)
    bad = [i for i, a, b in zip(ids, zl, dl) if a != b]
    report(f"on.{tag}cycles", not bad and anchors_ok,
           f"{sum(map(len, zl))} cycles: z-lab acceptance_lengths = dflash --emit on {n - len(bad)}/{n} prompts; "
           f"anchors consistent {anchors_ok}; e.g. {ids[0]} {zl[0][:12]}..." + (f"; differ: {bad}" if bad else ""))

    tau_z, hist_z, _ = zlab_summary(bench, zl, B)
    tau_exact = float(np.mean([np.mean(ls) for ls in zl]))          # their expression, unrounded
    hist_d = line["hist"]                                             # by a = 0..B-1
    cyc = sum(hist_d)
    hist_ok = hist_z[0] == 0 and all(hist_z[a + 1] == float(f"{100 * hist_d[a] / cyc:.1f}") / 100 for a in range(B))
    ok = close(line["tau_macro"], tau_exact, JTOL) and f"{line['tau_macro']:.2f}" == f"{tau_z:.2f}" and hist_ok
    report(f"on.{tag}tau.zlab", ok, f"dflash tau_macro {line['tau_macro']:.6f}, z-lab benchmark.py tau {tau_z:.2f} "
                                    f"(unrounded {tau_exact:.6f}); histogram of b = a+1 (their 1-decimal %) = "
                                    f"dflash hist {hist_d}")

    m = pu.extract_spec_decode_metrics([c for ls in zl for c in vllm_counters(pu, ls, B)])
    # a slot no cycle reached has accept_k nan (null); the product is 0 from there
    surv = np.cumprod(np.nan_to_num(np.array(line["accept_k"], dtype=np.float64), nan=0.0))
    sp_pos = np.array([m[f"acceptance_at_pos_{i}"] for i in range(B - 1)])
    _, acc_ref = online_stats(zl, B)
    oks = (close(line["tau_pooled"], m["acceptance_length"], JTOL), close(surv, sp_pos, 1e-8),
           close(line["accept_k"], acc_ref, JTOL))
    ok = all(oks)
    report(f"on.{tag}tau.sp", ok, f"dflash tau_pooled {line['tau_pooled']:.6f}, speculators acceptance_length "
                                  f"{m['acceptance_length']:.6f}; prod(accept_1..k) = acceptance_at_pos_(k-1): "
                                  f"{np.round(sp_pos[:5], 4).tolist()}...; accept_k {np.round(line['accept_k'][:5], 4).tolist()}...")
    if tag == "":
        tau_nobonus = float(np.mean([np.mean([L - 1 for L in ls]) for ls in zl]))
        control("on.tau.off1", close(line["tau_macro"], tau_nobonus, JTOL),
                f"dflash tau {line['tau_macro']:.4f} vs z-lab's without the bonus token {tau_nobonus:.4f}")
        control("on.acc.uncond", close(line["accept_k"], sp_pos, JTOL),
                f"dflash conditional accept_k {np.round(line['accept_k'][:3], 4).tolist()} vs speculators' "
                f"unconditional acceptance_at_pos {np.round(sp_pos[:3], 4).tolist()}")
        # what the bf16 rounding of the taps changes in z-lab's loop
        bf16_taps(zm, False)
        diff = 0
        for i in ids[:8]:
            p = next(q for q in prompts if q["id"] == i)
            _, L, _ = instrumented_generate(zm, model, hf, p["input_ids"], max_new, eos, B)
            diff += L != ref[i]["lengths"]
        bf16_taps(zm, True)
        print(f"{'on.bf16':14s} INFO  z-lab's loop with full-precision taps (no bf16 rounding): cycle lengths "
              f"differ on {diff} of {min(8, len(ids))} prompts (dflash drafts from bf16 taps, as a stream stores them)")
    return ref, ids


def pick_eos(ref, ids, max_new, mask_id):
    """A token that the greedy outputs first hit mid-response in many prompts."""
    count = {}
    for i in ids:
        seen = set()
        for pos, t in enumerate(ref[i]["greedy"]):
            if t not in seen:
                seen.add(t)
                if 8 <= pos < max_new - 8 and t != mask_id:
                    count[t] = count.get(t, 0) + 1
    return max(sorted(count), key=lambda t: count[t])


# --------------------------------------------------------------------------
# offline
# --------------------------------------------------------------------------

def export_stream(dfs, out):
    run(os.path.join(BIN, "dflash-pack"), "--export", out, dfs)
    recs = []
    for name in sorted(n for n in os.listdir(out) if os.path.isdir(os.path.join(out, n))):
        g = lambda k: np.load(os.path.join(out, name, k + ".npy"))  # noqa: E731
        recs.append(dict(id=name.split("-", 1)[1], ids=g("input_ids"), mask=g("loss_mask"), hidden=g("hidden")))
    return recs


def sub_stream(d, recs, ckpt, tmp, gap):
    """The records again through dflash-extract (the same features as the
    split they come from); with gap, loss_mask 0 at every 7th supervised
    token."""
    name = "gap" if gap else "sub"
    jl = os.path.join(tmp, name + ".jsonl")
    with open(jl, "w") as f:
        for r in recs:
            m = [int(x) for x in r["mask"]]
            sup = [i for i, x in enumerate(m) if x]
            for j, i in enumerate(sup):
                if gap and j % 7 == 3:
                    m[i] = 0
            f.write(json.dumps({"id": r["id"], "input_ids": [int(x) for x in r["ids"]], "loss_mask": m}) + "\n")
    out = os.path.join(tmp, name + ".dfs")
    run(os.path.join(BIN, "dflash-extract"), "-m", os.path.join(d, "target"), "--drafter-config",
        os.path.join(ckpt, "config.json"), "--threads", "1", "-o", out, jl)
    return out, export_stream(out, os.path.join(tmp, name))


def sf_offline(fm, sfd, ckpt, d, recs, gamma, anchors=None):
    """SpecForge's DFlash-family forward per record (batch of one), float64.
    Returns its per-record accept_len metrics, the captured predictions,
    labels and validity, and the block logits."""
    from safetensors.torch import load_file
    from safetensors import safe_open
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    B, mask_id = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    draft = sfd.DFlashDraftModel(X.qwen3_config(cfg)).double().eval()
    draft.load_state_dict({k: v.double() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()},
                          strict=True)
    with safe_open(os.path.join(d, "target", "model.safetensors"), "pt") as f:
        emb_w, head_w = f.get_tensor("model.embed_tokens.weight").double(), f.get_tensor("lm_head.weight").double()
    V, H = emb_w.shape
    head = nn.Linear(H, V, bias=False).double()
    head.weight.data = head_w
    emb = nn.Embedding(V, H, _weight=emb_w)
    cap, logits = [], []
    real = fm.compute_accept_len

    def capture(pred, target, valid):
        acc = real(pred, target, valid)
        cap.append((pred.clone(), target.clone(), valid.clone(), acc.clone()))
        return acc

    fm.compute_accept_len = capture
    hook = head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    per_rec = []
    try:
        for r in recs:
            T = len(r["ids"])
            m = fm.OnlineDominoModel(draft_model=draft, target_lm_head=head, target_embed_tokens=emb,
                                     mask_token_id=mask_id, block_size=B, attention_backend="sdpa", num_anchors=T,
                                     loss_decay_gamma=gamma, objective_chunk_blocks=10 ** 6)
            if anchors is not None:
                a = torch.tensor([anchors[r["id"]]])
                m._sample_anchor_positions = lambda seq_len, loss_mask, device, a=a: (a, torch.ones_like(a, dtype=torch.bool))
            n0, l0 = len(cap), len(logits)
            with torch.no_grad():
                _loss, _acc, met = m(input_ids=torch.from_numpy(r["ids"].astype(np.int64))[None],
                                     hidden_states=torch.from_numpy(r["hidden"]).double()[None],
                                     loss_mask=torch.from_numpy(r["mask"]).double()[None])
            assert len(cap) == n0 + 2 and len(logits) == l0 + 1, "expected one chunk per record"
            per_rec.append(dict(id=r["id"], accept_len=float(met["base_accept_len"]), pred=cap[n0][0][0],
                                target=cap[n0][1][0], valid=cap[n0][2][0], accepted=cap[n0][3][0],
                                logits=logits[l0][0].reshape(-1, B, V)))
    finally:
        fm.compute_accept_len = real
        hook.remove()
    return per_rec, B


def dflash_defs(per_rec, B):
    """dflash's offline definitions (man dflash-score) on SpecForge's predictions."""
    hist = [0] * B
    reach, acc, corr, cnt = [0] * B, [0] * B, [0] * B, [0] * B
    lens, macro = [], []
    for r in per_rec:
        ok = (r["pred"] == r["target"]) & r["valid"]
        rl = []
        for j in range(ok.shape[0]):
            s = 0
            while s + 1 < B and bool(ok[j, s + 1]):
                s += 1
            hist[s] += 1
            rl.append(s + 1)
            for k in range(1, min(B, s + 2)):
                if not bool(r["valid"][j, k]):
                    break
                reach[k] += 1
                acc[k] += s >= k
            for k in range(1, B):
                if bool(r["valid"][j, k]):
                    cnt[k] += 1
                    corr[k] += bool(ok[j, k])
        lens += rl
        if rl:
            macro.append(np.mean(rl))
    nan = float("nan")
    return dict(hist=hist, tau_pooled=float(np.mean(lens)), tau_macro=float(np.mean(macro)),
                accept_k=[acc[k] / reach[k] if reach[k] else nan for k in range(1, B)],
                accuracy_k=[corr[k] / cnt[k] if cnt[k] else nan for k in range(1, B)],
                accuracy=sum(corr) / sum(cnt), blocks=len(lens))


def sf_taus(per_rec):
    """SpecForge's accept_len pooled over records from its own per-block
    `accepted` (sum (accepted+1) over valid blocks / valid blocks), and its
    per-record metric averaged over records."""
    num = den = 0.0
    for r in per_rec:
        vb = r["valid"].any(dim=-1).double()
        num += float(((r["accepted"].double() + 1) * vb).sum())
        den += float(vb.sum())
    return num / den, float(np.mean([r["accept_len"] for r in per_rec])), den


def tie_anchors(per_rec, B):
    """Anchors whose relevant slots (1 .. first mismatch, valid) have a top-2
    margin below TIE in the float64 logits."""
    bad = {}
    for r in per_rec:
        mg = margin(r["logits"])
        ok = (r["pred"] == r["target"]) & r["valid"]
        for j in range(ok.shape[0]):
            k = 1
            while k < B and bool(ok[j, k]):
                k += 1
            upto = min(k, B - 1)   # the first wrong slot decides too
            v = r["valid"][j, 1:upto + 1]
            if v.any() and float(mg[j, 1:upto + 1][v].min()) < TIE:
                bad.setdefault(r["id"], []).append(j)
    return bad


def sp_metrics(spm, per_rec, B, gamma):
    """speculators' DFlash compute_metrics on the same block logits."""
    lg = torch.cat([r["logits"].reshape(-1, r["logits"].shape[-1]) for r in per_rec])[None]
    tgt = torch.cat([r["target"].reshape(-1) for r in per_rec])
    val = torch.cat([r["valid"].reshape(-1) for r in per_rec]).double()[None]
    onehot = torch.nn.functional.one_hot(tgt, lg.shape[-1]).double()[None] * 10.0
    eager = importlib.import_module("speculators.losses.eager")   # the fused default needs a GPU (triton)
    _loss, met = spm.compute_metrics(lg, onehot, val, block_size=B, gamma=gamma,
                                     loss_config={"kl_div": (eager.kl_div_loss, 1.0)})
    acc_k = [float(met[f"position_{k}_acc_sum"] / met[f"position_{k}_acc_total"]) for k in range(1, B)]
    return acc_k, float(met["full_acc_sum"] / met["full_acc_total"]), float(met["eal_sum"])


def run_offline(fm, sfd, spm, d, tmp, tag, dfs, recs):
    ckpt, _ = last_ckpt(d)
    with open(os.path.join(ckpt, "config.json")) as f:
        B = json.load(f)["block_size"]
    gamma = 7.0
    per_rec, B = sf_offline(fm, sfd, ckpt, d, recs, gamma)
    ties = tie_anchors(per_rec, B)
    nt = sum(map(len, ties.values()))
    anchors = None
    if nt:
        # rerun both sides at the tie-free anchors only
        anchors = {}
        for r in per_rec:
            all_a = _sf_anchor_list(r, recs)
            anchors[r["id"]] = [a for j, a in enumerate(all_a) if j not in ties.get(r["id"], [])]
        per_rec, B = sf_offline(fm, sfd, ckpt, d, recs, gamma, anchors)
        af = os.path.join(tmp, f"{tag}anchors.jsonl")
        with open(af, "w") as f:
            for i, a in anchors.items():
                f.write(json.dumps({"id": i, "anchors": a}) + "\n")
        line = score_json("--target", os.path.join(d, "target"), "--drafter", ckpt, "--gamma", gamma,
                          "--anchors-from", af, dfs)
    else:
        line = score_json("--target", os.path.join(d, "target"), "--drafter", ckpt, "--gamma", gamma, dfs)
    tie_note = f"{nt} blocks with a top-2 margin < {TIE:g} excluded"
    ref = dflash_defs(per_rec, B)
    sf_pooled, sf_macro, sf_blocks = sf_taus(per_rec)
    gap = tag == "gap."
    same = close(line["tau_pooled"], sf_pooled, JTOL) and close(line["tau_macro"], sf_macro, 1e-6)
    blocks_ok = line["blocks"] == sf_blocks
    if not gap:
        report(f"off.{tag}sf", same and blocks_ok,
               f"{line['blocks']} blocks (SpecForge's sampler: {sf_blocks:.0f}) on {line['records']} records: dflash "
               f"tau_pooled {line['tau_pooled']:.6f} tau_macro {line['tau_macro']:.6f}; SpecForge accept_len pooled "
               f"{sf_pooled:.6f}, mean of per-record {sf_macro:.6f}; {tie_note}")
        control("off.tau.off1", close(line["tau_pooled"], sf_pooled - 1, JTOL),
                f"dflash {line['tau_pooled']:.4f} vs SpecForge's accept_len without its + 1 {sf_pooled - 1:.4f}")
    else:
        thru = sum(1 for r in per_rec for j in range(r["valid"].shape[0])
                   if int(r["accepted"][j]) != dflash_defs([dict(r, pred=r["pred"][j:j + 1], target=r["target"][j:j + 1],
                                                                  valid=r["valid"][j:j + 1])], B)["tau_pooled"] - 1)
        report(f"off.{tag}sf", blocks_ok and not same and thru > 0,
               f"DELIBERATE DIFFERENCE (man dflash-score): dflash tau_pooled {line['tau_pooled']:.6f} (prefix ends "
               f"at the first invalid slot), SpecForge accept_len {sf_pooled:.6f} (runs through invalid slots); "
               f"{thru} of {line['blocks']} blocks differ; {tie_note}")
    ok = (line["hist"] == ref["hist"] and close(line["accept_k"], ref["accept_k"], JTOL)
          and close(line["accuracy_k"], ref["accuracy_k"], JTOL) and close(line["accuracy"], ref["accuracy"], JTOL)
          and close(line["tau_pooled"], ref["tau_pooled"], JTOL) and close(line["tau_macro"], ref["tau_macro"], JTOL))
    report(f"off.{tag}stats", ok, f"hist {line['hist'][:6]}... accept_k {np.round(line['accept_k'][:4], 4).tolist()}... "
                                  f"accuracy_k {np.round(line['accuracy_k'][:4], 4).tolist()}... = dflash's definitions "
                                  f"on SpecForge's predictions" + ("" if ok else f"; ref hist {ref['hist']} accept_k "
                                                                              f"{ref['accept_k']}"))
    if spm is not None:
        acc_k, full, eal = sp_metrics(spm, per_rec, B, gamma)
        # speculators divides its counts in float32
        ok = close(line["accuracy_k"], acc_k, 1e-6) and close(line["accuracy"], full, 1e-6)
        report(f"off.{tag}sp", ok, f"speculators position_k_acc {np.round(acc_k[:4], 4).tolist()}... full_acc "
                                   f"{full:.6f} = dflash accuracy_k, accuracy {line['accuracy']:.6f}")
        print(f"{'off.' + tag + 'eal':14s} INFO  speculators EAL (independence approximation) {eal:.4f} + 1 = "
              f"{eal + 1:.4f} vs dflash tau_pooled {line['tau_pooled']:.4f}")
    return line


def _sf_anchor_list(r, recs):
    rec = next(q for q in recs if q["id"] == r["id"])
    m = rec["mask"]
    return [a for a in range(len(m) - 1) if m[a] and m[a + 1]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zlab", required=True, help="work tree of z-lab/dflash")
    ap.add_argument("--specforge", required=True, help="work tree of sgl-project/SpecForge")
    ap.add_argument("--speculators", required=True, help="work tree of vllm-project/speculators")
    ap.add_argument("--demo", help="a pipelines/demo.sh output directory (default: run the demo in a temporary one)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts of the demo to decode (default 16)")
    ap.add_argument("--only", choices=("online", "offline"), help="run one half of the checks")
    ap.add_argument("--records", type=int, default=8, help="validation records to score offline (default 8)")
    a = ap.parse_args()
    torch.manual_seed(0)
    zdir, sdir, pdir = map(os.path.abspath, (a.zlab, a.specforge, a.speculators))
    subprocess.run(["make", "-s", "NO_CUDA=1", "all"], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        d = demo_dir(a.demo, tmp)
        ckpt, step = last_ckpt(d)
        print(f"target {d}/target, drafter {ckpt} (step {step})")
        sys.path.insert(0, zdir)
        zm = importlib.import_module("dflash.model")
        zm._cuda_time = time.perf_counter
        zm.DynamicCache = X.LegacyCropCache
        bench = import_zlab_benchmark(zdir)
        pu = import_perf_utils(pdir)

        if a.only != "offline":
            ref, ids = run_online(zm, bench, pu, d, tmp, "", None, a.max_new_tokens, a.prompts)
            with open(os.path.join(ckpt, "config.json")) as f:
                mask_id = json.load(f)["dflash_config"]["mask_token_id"]
            eos = pick_eos(ref, ids, a.max_new_tokens, mask_id)
            print(f"{'on.eos':14s} INFO  eos id {eos} (first hit mid-response in the most greedy outputs)")
            run_online(zm, bench, pu, d, tmp, "eos.", eos, a.max_new_tokens, a.prompts)

        if a.only != "online":
            sys.path.insert(0, sdir)
            sfd = importlib.import_module("specforge.modeling.draft.dflash")
            fm = importlib.import_module("specforge.algorithms.common.dflash_family_model")
            real_prep = sfd._prepare_dflash_eager_mask
            sfd._prepare_dflash_eager_mask = lambda mask, dtype: real_prep(
                mask, torch.float32 if dtype == torch.float64 else dtype)
            X.import_speculators(pdir, {zdir, sdir})
            spm = importlib.import_module("speculators.models.dflash.metrics")

            val = os.path.join(d, "val.dfs")
            recs = export_stream(val, os.path.join(tmp, "val"))[:a.records]
            for gap in (False, True):
                dfs, srecs = sub_stream(d, recs, ckpt, tmp, gap)
                if not gap:
                    diff = max(float(np.abs(x["hidden"] - y["hidden"]).max()) for x, y in zip(recs, srecs))
                    print(f"{'off.stream':14s} INFO  {len(srecs)} records of val.dfs re-extracted "
                          f"({sum(len(r['ids']) for r in srecs)} tokens; max |feature - val.dfs| {diff:.3g}); "
                          f"both sides score this stream")
                run_offline(fm, sfd, spm, d, tmp, "gap." if gap else "", dfs, srecs)
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
