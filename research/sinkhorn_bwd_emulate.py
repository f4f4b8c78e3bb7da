#!/usr/bin/env python3
"""Numerical emulation of Sinkhorn backward formulations (SPEC.md section 4) in f32/f64.

CPU-only experiment for branch exp/sinkhorn-variants: each candidate kernel's arithmetic is
replayed with numpy over many matrices at once (f32 ops round like the GPU's; an FMA is an
f64 product-sum rounded once to f32; rcp.approx is the correctly rounded reciprocal with an
optional random +-1 ulp) and judged against an f64 evaluation of the reference
(crates/dsv4-core/src/ops/sinkhorn/reference.rs) with SPEC section 8's measure: max over
rows of max |got - ref| / max |ref row| (row = n entries, as the GPU tests and `dsv4 check`
judge; the golden runner uses the whole matrix as the row).

    python3 research/sinkhorn_bwd_emulate.py [--m 262144] [--golden PATH]
"""
import argparse
import json
import struct
import sys

import numpy as np

f32, f64 = np.float32, np.float64
RNG = np.random.default_rng(0)
ULP_NOISE = True  # rcp.approx / ex2.approx: +-1 ulp at random


def fma(a, b, c):
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(f32)


def noisy(v, ulps=1):
    """v (f32) moved by up to `ulps` ulp either way at random: an approximate MUFU result."""
    if not ULP_NOISE:
        return v
    s = RNG.integers(-ulps, ulps + 1, size=v.shape).astype(np.int32)
    return (v.view(np.int32) + s).view(f32)


def rcp32(d):
    return noisy((f32(1.0) / d).astype(f32))


def exp32(x):
    return noisy(np.exp(x.astype(f64)).astype(f32))


def steps(repeat):
    yield "cols"
    for _ in range(repeat - 1):
        yield "rows"
        yield "cols"


# ---- reference (f64), as reference.rs --------------------------------------------------
def softmax64(x):
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def ax(kind):
    return -1 if kind == "rows" else -2


def ref_backward(x, dout, repeat, eps):
    x, dout = x.astype(f64), dout.astype(f64)
    z = softmax64(x)
    y = z + eps
    tape = []
    for k in steps(repeat):
        den = eps + y.sum(axis=ax(k), keepdims=True)
        y = y / den
        tape.append((k, y, den))
    g = dout.copy()
    for k, v, den in reversed(tape):
        g = (g - (g * v).sum(axis=ax(k), keepdims=True)) / den
    s = (g * z).sum(axis=-1, keepdims=True)
    return z * (g - s)


# ---- the f32 softmax + eps as the kernels compute it ------------------------------------
def softmax_eps32(x, eps, exp=exp32, fused=False):
    """(z, K): z = softmax(x) (f32, exp / sum * rcp), K = z + eps (fused: K = fma(e, rcp,
    eps), one rounding, as the forward kernel since v19); `exp` maps x - max."""
    x = x.astype(f32)
    m = x.max(axis=-1, keepdims=True)
    e = exp(x - m)
    s = np.zeros_like(e[..., :1])
    for j in range(e.shape[-1]):
        s = s + e[..., j:j + 1]
    inv = rcp32(s)
    z = e * inv
    if fused:
        return z, fma(e, inv, np.full_like(e, f32(eps)))
    return z, (z + f32(eps)).astype(f32)


# ---- candidate 0: the g-formulation in f32 (v2's first f32 kernel) ---------------------
def bwd_g32(x, dout, repeat, eps):
    eps = f32(eps)
    z, y = softmax_eps32(x, eps)
    tape = []
    for k in steps(repeat):
        den = y.sum(axis=ax(k), keepdims=True, dtype=f32) + eps
        y = y * rcp32(den)
        tape.append((k, y, den))
    g = dout.astype(f32)
    for k, v, den in reversed(tape):
        dot = (g * v).sum(axis=ax(k), keepdims=True, dtype=f32)
        g = (g - dot) * rcp32(den)
    s = (g * z).sum(axis=-1, keepdims=True, dtype=f32)
    return z * (g - s)


# ---- candidates 1-3: the h-formulation (h = y * g = dL/dlog y) --------------------------
# Reverse of v = u / den along an axis, in h:   h_u = h_v - v * (sums of h_v along the axis)
# (no division); softmax: dx = h0 * w - z * sum_j(h0 * w),  w = z / (z + eps).
def fwd_factors32(K, repeat, eps):
    """The forward kernel's scale-factor form: y = diag(a) K diag(b). Returns the tape of
    (kind, a, b) after every step (f32)."""
    n = K.shape[-1]
    a = np.ones(K.shape[:-1], f32)  # [M, n]
    b = np.ones(K.shape[:-1], f32)
    eps = f32(eps)
    tape = []
    for k in steps(repeat):
        if k == "rows":
            s = np.zeros_like(a)
            for j in range(n):
                s = fma(K[:, :, j], b[:, j:j + 1], s)
            a = (a * rcp32(fma(a, s, np.full_like(a, eps)))).astype(f32)
        else:
            s = np.zeros_like(b)
            for i in range(n):
                s = fma(K[:, i, :], a[:, i:i + 1], s)
            b = (b * rcp32(fma(b, s, np.full_like(b, eps)))).astype(f32)
        tape.append((k, a, b))
    return tape


def axis_sum32(h, kind):
    n = h.shape[-1]
    if kind == "rows":
        s = h[:, :, 0:1]
        for j in range(1, n):
            s = s + h[:, :, j:j + 1]
    else:
        s = h[:, 0:1, :]
        for i in range(1, n):
            s = s + h[:, i:i + 1, :]
    return s


def bwd_h32(x, dout, repeat, eps, fix_dominant=False, hsum64=False):
    """f32 everywhere; v of each step rebuilt as K_ij * (a_i * H_i) * b_j from the tape."""
    z, K = softmax_eps32(x, eps)
    tape = fwd_factors32(K, repeat, eps)
    _, a, b = tape[-1]
    P = ((K * a[:, :, None]).astype(f32) * b[:, None, :]).astype(f32)
    h = (dout.astype(f32) * P).astype(f32)
    for k, a, b in reversed(tape):
        if hsum64:
            H = h.astype(f64).sum(axis=ax(k), keepdims=True).astype(f32)
        else:
            H = axis_sum32(h, k)
        if k == "rows":
            c = (a[:, :, None] * H).astype(f32)  # [M, n, 1]
            h = fma(-(c * K).astype(f32), np.broadcast_to(b[:, None, :], h.shape), h)
        else:
            c = (b[:, None, :] * H).astype(f32)  # [M, 1, n]
            h = fma(-(K * c).astype(f32), np.broadcast_to(a[:, :, None], h.shape), h)
    w = (z * rcp32(K)).astype(f32)
    hw = (h * w).astype(f32)
    s = axis_sum32(hw, "rows")
    dx = fma(-z, np.broadcast_to(s, z.shape), hw)
    if fix_dominant:
        # sum_j dx_ij = 0 exactly: the largest-z entry of a row as minus the others' sum.
        jm = z.argmax(axis=-1)
        n = z.shape[-1]
        tot = np.zeros(z.shape[:-1], f32)
        for j in range(n):
            tot = tot + np.where(jm == j, f32(0), dx[:, :, j])
        np.put_along_axis(dx, jm[:, :, None], (-tot)[:, :, None], axis=-1)
    return dx


def bwd_h_mixed(x, dout, repeat, eps):
    """f32 forward recompute (tape of f32 factors); the backward sweep in f64."""
    z, K = softmax_eps32(x, eps)
    tape = fwd_factors32(K, repeat, eps)
    K64, z64 = K.astype(f64), z.astype(f64)
    _, a, b = tape[-1]
    h = dout.astype(f64) * K64 * a[:, :, None] * b[:, None, :]
    for k, a, b in reversed(tape):
        v = K64 * a.astype(f64)[:, :, None] * b.astype(f64)[:, None, :]
        h = h - v * h.sum(axis=ax(k), keepdims=True)
    w = z64 / K64
    hw = h * w
    return (hw - z64 * hw.sum(axis=-1, keepdims=True)).astype(f32)


# ---- candidate: f64 scaled-gradient sweep (what DSV4_SINKHORN_BWD_VARIANT=1 computes) ----
# Forward in scale factors, y = diag(a) K diag(b), with alpha = 1/a kept beside a:
#   rows: alpha_i <- sum_j K_ij b_j + eps * alpha_i,  a_i <- 1 / alpha_i   (a / den, den = a s + eps)
# (columns alike); 1/d = MUFU.RCP64H refined by ONE Newton step: modelled as the exact
# reciprocal times (1 + delta), |delta| <= 4e-12 (a 2^-19 seed squared).
# Backward in gt = h / K = dL/dy * (a b^T): no division, no denominators:
#   rows:  H_i = sum_j K_ij gt_ij,  gt -= (a * H) b^T        (a, b: the factors after the step)
#   cols:  C_j = sum_i K_ij gt_ij,  gt -= a (b * C)^T
# gt starts as dout * (a b^T) and ends as dL/dy0; dx = z * (gt - sum_j gt z).
def rcp64_newton1(d):
    return (1.0 / d) * (1.0 + RNG.uniform(-4e-12, 4e-12, d.shape))


def bwd_scaled64(x, dout, repeat, eps, rcp=rcp64_newton1):
    z = softmax64(x.astype(f64))  # f64 exp of f32 x - max, f64 sum, times 1/sum
    K = z + eps
    n = K.shape[-1]
    a = np.ones(K.shape[:-1]); b = np.ones(K.shape[:-1])
    al = np.ones_like(a); be = np.ones_like(b)
    tape = []
    for k in steps(repeat):
        if k == "rows":
            al = (K * b[:, None, :]).sum(-1) + eps * al
            a = rcp(al)
        else:
            be = (K * a[:, :, None]).sum(-2) + eps * be
            b = rcp(be)
        tape.append((k, a, b))
    gt = dout.astype(f64) * a[:, :, None] * b[:, None, :]
    for k, a, b in reversed(tape):
        if k == "rows":
            H = (K * gt).sum(-1)
            gt = gt - (a * H)[:, :, None] * b[:, None, :]
        else:
            C = (K * gt).sum(-2)
            gt = gt - a[:, :, None] * (b * C)[:, None, :]
    s = (gt * z).sum(-1, keepdims=True)
    return (z * (gt - s)).astype(f32)


# ---- judging ----------------------------------------------------------------------------
def row_err(got, ref, row_len):
    g = got.astype(f64).reshape(-1, row_len)
    r = ref.reshape(-1, row_len)
    scale = np.abs(r).max(axis=1)
    e = np.abs(g - r).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, e / scale, np.where(e > 0, np.inf, 0.0))
    return q.max()


def normal3(rng, shape):
    return (rng.uniform(-1, 1, shape) + rng.uniform(-1, 1, shape) + rng.uniform(-1, 1, shape)).astype(f32)


def golden_cases(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        base = 8 + n
        meta = hdr.get("__metadata__", {})

        def t(name):
            h = hdr[name]
            s, e = h["data_offsets"]
            f.seek(base + s)
            return np.frombuffer(f.read(e - s), dtype=np.float32).reshape(h["shape"])

        cases = sorted({k.rsplit(".", 1)[0] for k in hdr if k.startswith("sinkhorn.")})
        for c in cases:
            p = json.loads(meta[c])
            yield c, t(c + ".x"), t(c + ".grad_out"), t(c + ".dx"), p["repeat"], p["eps"]


CANDIDATES = {
    "g32 (v2's f32 kernel)": lambda x, g, r, e: bwd_g32(x, g, r, e),
    "h32": lambda x, g, r, e: bwd_h32(x, g, r, e),
    "h32 + dominant fix": lambda x, g, r, e: bwd_h32(x, g, r, e, fix_dominant=True),
    "h32, sums in f64": lambda x, g, r, e: bwd_h32(x, g, r, e, hsum64=True),
    "h mixed (f32 fwd, f64 sweep)": lambda x, g, r, e: bwd_h_mixed(x, g, r, e),
    "BWD_VARIANT=1 (f64 scaled, 1 Newton)": lambda x, g, r, e: bwd_scaled64(x, g, r, e),
    "scaled f64, seed 2^-19 no Newton": lambda x, g, r, e: bwd_scaled64(x, g, r, e, rcp=lambda d: (1.0 / d) * (1.0 + RNG.uniform(-2e-6, 2e-6, d.shape))),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1 << 18)
    ap.add_argument("--golden", default="/work/shared/golden/dsv4_golden_public.safetensors")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    sets = []
    for c, x, g, dx, rep, eps in golden_cases(args.golden):
        n = x.shape[-1]
        sets.append((f"golden {c} n={n} repeat {rep} eps {eps}", x.reshape(-1, n, n), g.reshape(-1, n, n), rep, eps, dx.reshape(-1, n, n)))
    m = args.m
    sets.append((f"bench {m} x 4x4 (x U(-3,3), dout U(-1,1))", rng.uniform(-3, 3, (m, 4, 4)).astype(f32), rng.uniform(-1, 1, (m, 4, 4)).astype(f32), 20, 1e-6, None))
    sets.append((f"gpu test {m} x 4x4 (x 2*normal3, dout normal3)", 2 * normal3(rng, (m, 4, 4)), normal3(rng, (m, 4, 4)), 20, 1e-6, None))
    m8 = max(m // 4, 1)
    sets.append((f"gpu test {m8} x 8x8 (x 2*normal3)", 2 * normal3(rng, (m8, 8, 8)), normal3(rng, (m8, 8, 8)), 20, 1e-6, None))
    sets.append((f"gpu test {m8} x 7x7 (x 2*normal3)", 2 * normal3(rng, (m8, 7, 7)), normal3(rng, (m8, 7, 7)), 20, 1e-6, None))
    sets.append((f"gpu test 4096 x 8x8 eps 1e-3 repeat 7", 2 * normal3(rng, (4096, 8, 8)), normal3(rng, (4096, 8, 8)), 7, 1e-3, None))
    for name, x, g, rep, eps, gold in sets:
        n = x.shape[-1]
        ref = ref_backward(x, g, rep, eps)
        print(f"== {name}" + (f" (golden f32 dx vs f64, per matrix: {row_err(gold, ref, n * n):.2e})" if gold is not None else ""))
        for cname, fn in CANDIDATES.items():
            if args.only and args.only not in cname:
                continue
            got = fn(x, g, rep, eps)
            print(f"   {cname:32s} per row {row_err(got, ref, n):.2e}   per matrix {row_err(got, ref, n * n):.2e}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
