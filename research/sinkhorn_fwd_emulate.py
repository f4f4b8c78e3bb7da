#!/usr/bin/env python3
"""Forward variants of the Sinkhorn kernel (SPEC.md section 4) replayed in f32 with numpy
and judged like the GPU tests (max |got - ref| / max |ref row|, rows of n, f64 reference).
Companion of sinkhorn_bwd_emulate.py (same conventions: FMA = one rounding; MUFU results
+-1 ulp at random). CPU only; not a measurement of any GPU.

    python3 research/sinkhorn_fwd_emulate.py [--m 262144]
"""
import argparse

import numpy as np

from sinkhorn_bwd_emulate import exp32, f32, f64, fma, noisy, rcp32, row_err, softmax64, softmax_eps32, steps, normal3


def ref_forward(x, repeat, eps):
    y = softmax64(x.astype(f64)) + eps
    for k in steps(repeat):
        y = y / (eps + y.sum(axis=-1 if k == "rows" else -2, keepdims=True))
    return y


def matvec(K, v, kind):
    """s_i = sum_j K_ij v_j (rows) or s_j = sum_i K_ij v_i (cols), FMA chains in index order."""
    n = K.shape[-1]
    s = np.zeros(K.shape[:-1], f32)
    for t in range(n):
        s = fma(K[:, :, t], v[:, t:t + 1], s) if kind == "rows" else fma(K[:, t, :], v[:, t:t + 1], s)
    return s


def fwd_v0(x, repeat, eps):
    """The kernel before v15: a_i *= rcp(a_i s_i + eps)."""
    _, K = softmax_eps32(x, eps)
    a = np.ones(K.shape[:-1], f32); b = np.ones_like(a); e = np.full_like(a, f32(eps))
    for k in steps(repeat):
        if k == "rows":
            a = (a * rcp32(fma(a, matvec(K, b, "rows"), e))).astype(f32)
        else:
            b = (b * rcp32(fma(b, matvec(K, a, "cols"), e))).astype(f32)
    return ((K * a[:, :, None]).astype(f32) * b[:, None, :]).astype(f32)


def pair_rcp(d, pairs):
    """1/d per column of d [M, n]: columns (2p, 2p+1) for p < pairs share one reciprocal:
    r = rcp(d0 d1); 1/d0 = r d1, 1/d1 = r d0. The rest: one rcp each."""
    out = np.empty_like(d)
    n = d.shape[-1]
    done = 0
    for p in range(pairs):
        i, j = 2 * p, 2 * p + 1
        if j >= n:
            break
        r = rcp32((d[:, i] * d[:, j]).astype(f32))
        out[:, i] = (r * d[:, j]).astype(f32)
        out[:, j] = (r * d[:, i]).astype(f32)
        done = j + 1
    for i in range(done, n):
        out[:, i] = rcp32(d[:, i])
    return out


def rcp_fma32(d):
    """fwd.cu rcp_fma, replayed exactly: the bit-trick seed, x (1 + e + e^2), a Newton step."""
    one = np.ones_like(d)
    x = (np.int32(0x7EF311C3) - d.view(np.int32)).view(f32)
    e = fma(-d, x, one)
    x = fma(x, fma(e, e, e), x)
    e = fma(-d, x, one)
    return fma(x, e, x)


def fwd_v1(x, repeat, eps, pairs=1, exp=exp32, fused=False, rcp=None):
    """The kernel since v15 (pairs=0): alpha = 1/a kept beside a; alpha <- K b + eps alpha
    (den / a, no multiply by a), a <- 1/alpha, with `pairs` pairs of denominators sharing
    one MUFU (SINKHORN_FWD_PAIR on branch exp/sinkhorn-fwd-pipe2: all pairs); `exp` the
    softmax's exponential (default expf's, +-1 ulp); fused: K = fma(e, rcp, eps); rcp: every
    reciprocal of the steps by this function instead (rcp_fma32: SINKHORN_FWD_NEWTON's, its
    worst case, all of them)."""
    _, K = softmax_eps32(x, eps, exp=exp, fused=fused)
    inv = rcp if rcp is not None else (lambda d: pair_rcp(d, pairs))
    a = np.ones(K.shape[:-1], f32); b = np.ones_like(a); al = np.ones_like(a); be = np.ones_like(a)
    e = f32(eps)
    for k in steps(repeat):
        if k == "rows":
            al = fma(np.full_like(al, e), al, matvec(K, b, "rows"))
            a = inv(al)
        else:
            be = fma(np.full_like(be, e), be, matvec(K, a, "cols"))
            b = inv(be)
    return ((K * a[:, :, None]).astype(f32) * b[:, None, :]).astype(f32)


def fwd_v2(x, repeat, eps):
    """FWD_VARIANT=2: the v2 steps, den = a s + eps, with entries 0 and 1 sharing a MUFU."""
    _, K = softmax_eps32(x, eps)
    a = np.ones(K.shape[:-1], f32); b = np.ones_like(a); e = np.full_like(a, f32(eps))
    for k in steps(repeat):
        if k == "rows":
            a = (a * pair_rcp(fma(a, matvec(K, b, "rows"), e), 1)).astype(f32)
        else:
            b = (b * pair_rcp(fma(b, matvec(K, a, "cols"), e), 1)).astype(f32)
    return ((K * a[:, :, None]).astype(f32) * b[:, None, :]).astype(f32)


def ex2_32(d):
    """The forward's softmax exponential (fwd.cu softmax_exp): ex2.approx of f32((x - max)
    log2 e), the MUFU result moved by up to +-2 ulp at random (PTX: ex2.approx's relative
    error ~2^-22)."""
    return noisy(np.exp2((d.astype(f32) * f32(1.4426950408889634)).astype(f32).astype(f64)).astype(f32), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1 << 18)
    args = ap.parse_args()
    rng = np.random.default_rng(3)
    m = args.m
    sets = [
        (f"bench {m} x 4x4 (x U(-3,3))", rng.uniform(-3, 3, (m, 4, 4)).astype(f32), 20, 1e-6),
        (f"gpu test {m} x 4x4 (x 2*normal3)", 2 * normal3(rng, (m, 4, 4)), 20, 1e-6),
        (f"gpu test {m // 4} x 8x8", 2 * normal3(rng, (m // 4, 8, 8)), 20, 1e-6),
        (f"gpu test {m // 4} x 5x5 repeat 10", 2 * normal3(rng, (m // 4, 5, 5)), 10, 1e-6),
        ("gpu test 4096 x 8x8 eps 1e-3 repeat 7", 2 * normal3(rng, (4096, 8, 8)), 7, 1e-3),
        ("x 8*normal3 4096 x 4x4 (extreme logits)", 8 * normal3(rng, (4096, 4, 4)), 20, 1e-6),
    ]
    for name, x, rep, eps in sets:
        n = x.shape[-1]
        ref = ref_forward(x, rep, eps)
        print(f"== {name}")
        for cname, fn in [("den (before v15)", fwd_v0), ("alpha, expf (v15-v18)", lambda x, r, e: fwd_v1(x, r, e, pairs=0)), ("alpha, 1 pair", fwd_v1), ("den, 1 pair", fwd_v2), ("alpha, all pairs", lambda x, r, e: fwd_v1(x, r, e, pairs=8)), ("alpha, ex2, fused (v19)", lambda x, r, e: fwd_v1(x, r, e, pairs=0, exp=ex2_32, fused=True)), ("v20 worst case: all rcp_fma", lambda x, r, e: fwd_v1(x, r, e, pairs=0, exp=ex2_32, fused=True, rcp=rcp_fma32))]:
            print(f"   {cname:28s} per row {row_err(fn(x, rep, eps), ref, n):.2e}")


if __name__ == "__main__":
    main()
