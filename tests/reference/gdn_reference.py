#!/usr/bin/env python3
"""gdn_reference.py: golden fixtures for the Gated DeltaNet ops of the op table
(Qwen3.5 "linear_attention" layers): tests/fixtures/ops/gdn.safetensors.

Random f32 inputs with odd sizes; the expected outputs are computed in float64
from those f32 values and stored as f32 (so the fixture is more exact than any
f32 code under test). Needs torch and transformers; CI only reads the file.

The ops and their tensors (all F32 unless marked I32; C = channels, K = kernel):

sigmoid_mul(out, x, g, n): out = x * sigmoid(g)
  sigmul.x [523]  sigmul.g [523] (includes 0, +-20, +-100)  sigmul.out [523]

conv1d_silu(out, in, hist, w, cu, nseq, T, C, K): causal depthwise conv then
SiLU, per packed sequence s = rows [cu[s], cu[s+1]); rows before a sequence
start are 0, or with hist (nseq 1) hist[(K-1) + (r - cu[0])] for r < cu[0]
(hist row K-2 is the row just before the first one). w = HF conv1d.weight
[C, 1, K] squeezed to [C, K]; out[t, c] = silu(sum_j w[c, j] x[t-(K-1)+j, c]).
  conv.in [17, 37]  conv.w [37, 4]  conv.cu I32 [4] = 0 5 6 17 (lengths 5, 1, 11)
  conv.out [17, 37]
  conv_hist2.in [2, 37]  conv_hist2.hist [3, 37]  conv_hist2.w [37, 4]
  conv_hist2.cu I32 [2] = 0 2  conv_hist2.out [2, 37]
  conv_hist2.hist_next [3, 37]  (the last K-1 rows of [hist; in]: the history
                                 a following call would use; T 2 < K-1 on purpose)
  conv_hist9.*  the same with T 9 (cu 0 9, in/out [9, 37])
Oracles: HF's causal_conv1d_fn (F.conv1d, groups C, padding K-1, truncated to
T, SiLU) on each sequence alone, and HF's causal_conv1d_update for the
history cases (conv over [hist; in], its conv_state update = hist_next); both
in float64 and both checked against the direct sum above.

gated_delta(out, state, steps, qkv, ba, A_log, dt_bias, cu, nseq, T, Hk, Hv,
dk, dv): the gated delta rule of Qwen3_5GatedDeltaNet after its conv.
qkv row = q [Hk*dk] | k [Hk*dk] | v [Hv*dv] (heads contiguous in each);
ba row = b [Hv] | a [Hv]. Value head j reads key/query head j / (Hv/Hk).
  q = l2norm(q) * dk^-0.5, k = l2norm(k), l2norm(x) = x * rsqrt(sum x^2 + 1e-6)
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (torch softplus:
  beta 1, threshold 20)
  S [dk, dv] per value head, 0 at each sequence start (or `state` [Hv, dk, dv]):
  S = exp(g) S;  S += k (beta (v - S^T k))^T;  out_t = S^T q
  out [T, Hv*dv]; final state [Hv, dk, dv]; steps [T, Hv, dk, dv] = S after each row.
Sizes Hk 2, Hv 6, dk 12, dv 20 (qkv width 168, out width 120).
  gdn.sizes I32 [4] = Hk Hv dk dv
  gdn.qkv [78, 168]  gdn.ba [78, 12]  gdn.A_log [6]  gdn.dt_bias [6]
  gdn.cu I32 [4] = 0 7 8 78 (lengths 7, 1, 70: 70 crosses HF's chunk of 64)
  gdn.out [78, 120]  gdn.final [3, 6, 12, 20] (each sequence's final state)
  gdn.g [78, 6]  gdn.beta [78, 6]  (the gates, for debugging)
  gdn_state.qkv [5, 168]  gdn_state.ba [5, 12]  gdn_state.A_log [6]
  gdn_state.dt_bias [6]  gdn_state.cu I32 [2] = 0 5  gdn_state.init [6, 12, 20]
  gdn_state.out [5, 120]  gdn_state.final [6, 12, 20]  gdn_state.steps [5, 6, 12, 20]
The inputs reach the corners: A spread over 0.005..16 (decay per row from
~0.997 to ~1e-5, so the slow heads carry state over all 70 rows), a + dt_bias
above the softplus threshold 20 and far below 0, b at +-30, a row whose q and
k are scaled by 1e-3 (sum q^2 ~ 1e-5: the 1e-6 inside the rsqrt matters).
Oracle: HF's torch_recurrent_gated_delta_rule (use_qk_l2norm_in_kernel=True)
run in float64 (its source with torch.float32 -> torch.float64; it upcasts to
float32 otherwise), one sequence at a time, initial_state/output_final_state
for the state case; checked against an independent float64 loop written from
the formulas above (which also gives steps; each step is checked against HF's
final state of the prefix). HF's float32 recurrent and chunked (chunk 64)
paths are compared with the oracle and the differences printed.

Usage: python3 tests/reference/gdn_reference.py [OUTDIR]
"""
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_targets import hf_in_float64, q35_module  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "fixtures", "ops")
G = torch.Generator().manual_seed(20260335)
HK, HV, DK, DV = 2, 6, 12, 20


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=G) * scale).float()


def f32(t):
    return t.detach().float().clone().contiguous()


def i32(t):
    return torch.as_tensor(t, dtype=torch.int32).contiguous()


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ---------------------------------------------------------------------------
def sigmoid_mul():
    n = 523
    x, g = randn(n), randn(n, scale=4.0)
    g[:6] = torch.tensor([0.0, 20.0, -20.0, 100.0, -100.0, 1e-3])
    out = x.double() * torch.sigmoid(g.double())
    return {"sigmul.x": x, "sigmul.g": g, "sigmul.out": f32(out)}


# ---------------------------------------------------------------------------
def conv_direct(x, w, hist=None):
    """x [T, C], w [C, K], hist [K-1, C] or None (zeros); float64 direct sum."""
    T, C = x.shape
    K = w.shape[1]
    h = torch.zeros(K - 1, C, dtype=x.dtype) if hist is None else hist
    xx = torch.cat([h, x])  # row r of x is row r + K-1 here
    out = torch.zeros(T, C, dtype=x.dtype)
    for t in range(T):
        for j in range(K):
            out[t] += w[:, j] * xx[t + j]
    return F.silu(out)


def conv_cases():
    m = q35_module()
    t = {}
    C, K = 37, 4
    # packed: HF's causal_conv1d_fn on each sequence alone
    lens = [5, 1, 11]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x, w = randn(cu[-1], C), randn(C, K, scale=0.5)
    outs = []
    for s in range(len(lens)):
        xs = x[cu[s]:cu[s + 1]].double()
        o = m.causal_conv1d_fn(xs.T[None].contiguous(), w.double(), None, activation="silu")[0].T
        assert o.dtype == torch.float64
        d = conv_direct(xs, w.double())
        assert rel(o, d) < 1e-13, rel(o, d)
        outs.append(o)
    out = torch.cat(outs)
    # Control: one conv over the packed rows (history leaking across sequences) differs.
    leak = conv_direct(x.double(), w.double())
    assert rel(leak, out) > 1e-2
    t.update({"conv.in": x, "conv.w": w, "conv.cu": i32(cu), "conv.out": f32(out)})
    # with history, nseq 1: HF's causal_conv1d_update (the decode path) with a
    # conv state of K-1 columns
    for T in (2, 9):
        x, hist, w = randn(T, C), randn(K - 1, C), randn(C, K, scale=0.5)
        state = hist.double().T[None].contiguous()  # [1, C, K-1]
        o = m.causal_conv1d_update(x.double().T[None].contiguous(), state, w.double(), None, "silu")[0].T
        d = conv_direct(x.double(), w.double(), hist.double())
        assert rel(o, d) < 1e-13, rel(o, d)
        hist_next = state[0].T
        assert torch.equal(hist_next, torch.cat([hist.double(), x.double()])[-(K - 1):])
        p = f"conv_hist{T}."
        t.update({p + "in": x, p + "hist": hist, p + "w": w, p + "cu": i32([0, T]), p + "out": f32(o),
                  p + "hist_next": f32(hist_next)})
    return t


# ---------------------------------------------------------------------------
def gdn_inputs(T, A):
    qkv = randn(T, 2 * HK * DK + HV * DV)
    b, a = randn(T, HV, scale=2.0), randn(T, HV)
    A_log = torch.log(torch.tensor(A, dtype=torch.float64)).float()
    dt_bias = randn(HV, scale=0.5)
    return qkv, b, a, A_log, dt_bias


def gates(b, a, A_log, dt_bias):
    """Qwen3_5GatedDeltaNet.forward's beta and g, in float64."""
    beta = torch.sigmoid(b.double())
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return beta, g


def split_qkv(qkv):
    T = qkv.shape[0]
    q, k, v = torch.split(qkv.double(), [HK * DK, HK * DK, HV * DV], dim=-1)
    return q.reshape(T, HK, DK), k.reshape(T, HK, DK), v.reshape(T, HV, DV)


def own_gdn(qkv, beta, g, S0=None, eps=1e-6):
    """Independent float64 loop from the formulas; returns out [T, Hv*dv],
    final [Hv, dk, dv], steps [T, Hv, dk, dv]."""
    q, k, v = split_qkv(qkv)
    T = q.shape[0]
    S = torch.zeros(HV, DK, DV, dtype=torch.float64) if S0 is None else S0.double().clone()
    out = torch.zeros(T, HV, DV, dtype=torch.float64)
    steps = torch.zeros(T, HV, DK, DV, dtype=torch.float64)
    for t in range(T):
        for j in range(HV):
            h = j // (HV // HK)
            qt = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + eps) * DK ** -0.5
            kt = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + eps)
            S[j] = torch.exp(g[t, j]) * S[j]
            u = beta[t, j] * (v[t, j] - S[j].T @ kt)
            S[j] = S[j] + torch.outer(kt, u)
            out[t, j] = S[j].T @ qt
        steps[t] = S
    return out.reshape(T, HV * DV), S.clone(), steps


def hf_gdn(fn, qkv, beta, g, S0=None, dtype=torch.float64):
    """An HF delta-rule function on one sequence: inputs [1, T, H, d]."""
    q, k, v = split_qkv(qkv)
    kw = dict(g=g[None].to(dtype), beta=beta[None].to(dtype), use_qk_l2norm_in_kernel=True,
              output_final_state=True)
    if S0 is not None:
        kw["initial_state"] = S0[None].to(dtype)
    o, st = fn(q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), **kw)
    return o[0].reshape(o.shape[1], HV * DV), st[0]


def gdn_cases():
    m = q35_module()
    rec64 = hf_in_float64(m.torch_recurrent_gated_delta_rule)
    rec32, chunk32 = m.torch_recurrent_gated_delta_rule, m.torch_chunk_gated_delta_rule
    t = {}
    A = [0.005, 0.05, 0.3, 1.0, 4.0, 16.0]

    # packed, three sequences
    lens = [7, 1, 70]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    qkv, b, a, A_log, dt_bias = gdn_inputs(T, A)
    qkv[3, :2 * HK * DK] *= 1e-3          # tiny q and k: eps in the l2norm matters
    a[10, 0], a[40, 5] = 25.0, 30.0       # a + dt_bias > 20: softplus threshold (identity) path
    a[11, 1], a[50, 2] = -30.0, -25.0     # softplus ~ 1e-13: no decay at all
    b[12, 3], b[60, 4] = 30.0, -30.0      # beta 1 (overwrite) and ~1e-13 (no write)
    assert float((a[10, 0] + dt_bias[0])) > 20 and float((a[40, 5] + dt_bias[5])) > 20
    beta, g = gates(b, a, A_log, dt_bias)
    outs, finals = [], []
    diffs = {"own": 0.0, "rec32": 0.0, "chunk32": 0.0}
    for s in range(len(lens)):
        r = slice(cu[s], cu[s + 1])
        o, st = hf_gdn(rec64, qkv[r], beta[r], g[r])
        oo, so, _ = own_gdn(qkv[r], beta[r], g[r])
        diffs["own"] = max(diffs["own"], rel(oo, o), rel(so, st))
        for name, fn in (("rec32", rec32), ("chunk32", chunk32)):
            o32, s32 = hf_gdn(fn, qkv[r], beta[r], g[r], dtype=torch.float32)
            assert o32.dtype == torch.float32
            diffs[name] = max(diffs[name], rel(o32, o), rel(s32, st))
        outs.append(o)
        finals.append(st)
    out = torch.cat(outs)
    # Controls: the eps of the l2norm shows at the tiny row 3; the state must be reset at sequence starts, and the slow heads
    # must carry it far (else the 70-row sequence would not test the carry).
    leak, _ = hf_gdn(rec64, qkv, beta, g)
    assert rel(leak[cu[2]:], out[cu[2]:]) > 1e-3
    no_eps, _, _ = own_gdn(qkv[:cu[1]], beta[:cu[1]], g[:cu[1]], eps=0.0)
    assert rel(no_eps[3], out[3]) > 1e-2, rel(no_eps[3], out[3])
    tail_no_carry, _ = hf_gdn(rec64, qkv[cu[2] + 64:], beta[cu[2] + 64:], g[cu[2] + 64:])
    assert rel(tail_no_carry, out[cu[2] + 64:]) > 1e-2
    print(f"  gdn packed {lens}: max|a-b|/max|b| vs HF recurrent float64: own float64 loop {diffs['own']:.1e}, "
          f"HF recurrent float32 {diffs['rec32']:.1e}, HF chunked float32 {diffs['chunk32']:.1e} (out and states)")
    assert diffs["own"] < 1e-12 and diffs["rec32"] < 1e-5 and diffs["chunk32"] < 1e-5, diffs
    t.update({"gdn.sizes": i32([HK, HV, DK, DV]), "gdn.qkv": qkv, "gdn.ba": torch.cat([b, a], dim=1).contiguous(),
              "gdn.A_log": A_log, "gdn.dt_bias": dt_bias, "gdn.cu": i32(cu), "gdn.out": f32(out),
              "gdn.final": f32(torch.stack(finals)), "gdn.g": f32(g), "gdn.beta": f32(beta)})

    # one sequence continuing from a state
    T = 5
    qkv, b, a, A_log, dt_bias = gdn_inputs(T, [0.01, 0.1, 0.5, 2.0, 6.0, 0.02])
    S0 = randn(HV, DK, DV)
    beta, g = gates(b, a, A_log, dt_bias)
    o, st = hf_gdn(rec64, qkv, beta, g, S0)
    oo, so, steps = own_gdn(qkv, beta, g, S0)
    d_own = max(rel(oo, o), rel(so, st))
    d_steps = max(rel(steps[i], hf_gdn(rec64, qkv[:i + 1], beta[:i + 1], g[:i + 1], S0)[1]) for i in range(T))
    o32, s32 = hf_gdn(chunk32, qkv, beta, g, S0, dtype=torch.float32)
    d_chunk = max(rel(o32, o), rel(s32, st))
    o0, _ = hf_gdn(rec64, qkv, beta, g)
    assert rel(o0, o) > 1e-2  # control: the initial state matters
    print(f"  gdn with a state, T {T}: own loop {d_own:.1e}, its steps vs HF prefix finals {d_steps:.1e}, "
          f"HF chunked float32 {d_chunk:.1e}")
    assert d_own < 1e-12 and d_steps < 1e-12 and d_chunk < 1e-5
    t.update({"gdn_state.qkv": qkv, "gdn_state.ba": torch.cat([b, a], dim=1).contiguous(),
              "gdn_state.A_log": A_log, "gdn_state.dt_bias": dt_bias, "gdn_state.cu": i32([0, T]),
              "gdn_state.init": S0, "gdn_state.out": f32(o), "gdn_state.final": f32(st),
              "gdn_state.steps": f32(steps)})
    return t


def main():
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tensors = {}
    tensors.update(sigmoid_mul())
    tensors.update(conv_cases())
    tensors.update(gdn_cases())
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "gdn.safetensors")
    # one metadata key: safetensors writes the map in hash order, and the file should not change between runs
    save_file(tensors, path, metadata={"generator": f"tests/reference/gdn_reference.py with torch {torch.__version__}, "
                                                    f"transformers {transformers.__version__}"})
    print(f"gdn_reference: {len(tensors)} tensors, {os.path.getsize(path)} bytes -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
