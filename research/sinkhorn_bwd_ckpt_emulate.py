#!/usr/bin/env python3
"""The n <= 6 Sinkhorn backward (crates/dsv4-cuda/kernels/sinkhorn/bwd.cu: checkpoints
before every group of SINKHORN_BWD_CKPT_PAIRS pairs, the first group the short one, the
last group's factors kept from the forward; `keep_last=False` replays v20's kernel, every
group recomputed, the last one short) and the per-step tape kernel it replaced, replayed in f64 operation by operation (fma correctly rounded
once, via exact rationals; rcp = the kernel's MUFU.RCP64H seed, modelled as 1/d with the
low 32 bits cleared, refined by its one Newton step). Checks that the checkpointed kernel
feeds every reversed step bitwise the same factors as the tape kernel, and so returns
bitwise the same gt and dx, for several n and repeat (edge cases: repeat = 1, a last
group of one pair).

    python3 research/sinkhorn_bwd_ckpt_emulate.py [--m 8] [--pairs 2]
"""
import argparse
import struct
from fractions import Fraction

import numpy as np


def fma(a, b, c):
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def rcp(d):
    seed = struct.unpack("<d", struct.pack("<Q", struct.unpack("<Q", struct.pack("<d", 1.0 / d))[0] & ~0xFFFFFFFF))[0]
    return fma(seed, fma(-d, seed, 1.0), seed)


def at(rows, n, a, b):
    return a * n + b if rows else b * n + a


def fwd_step(rows, K, n, f, inv_f, other, eps):
    """scaled_fwd_step(_regs): f, inv_f updated in place."""
    for e in range(n):
        s = eps * inv_f[e]
        for k in range(n):
            s = fma(K[at(rows, n, e, k)], other[k], s)
        inv_f[e] = s
        f[e] = rcp(s)


def bwd_step(rows, K, n, gt, a, b, log):
    log.append((rows, tuple(a), tuple(b)))
    for e in range(n):
        s = 0.0
        for k in range(n):
            s = fma(K[at(rows, n, e, k)], gt[at(rows, n, e, k)], s)
        c = (a[e] if rows else b[e]) * s
        for k in range(n):
            i = at(rows, n, e, k)
            gt[i] = fma(-c, b[k] if rows else a[k], gt[i])


def softmax_eps(x, n, eps):
    K = [0.0] * (n * n)
    for i in range(n):
        mx = max(x[i * n:(i + 1) * n])
        s = 0.0
        for j in range(n):
            e = float(np.exp(np.float64(x[i * n + j]) - np.float64(mx)))
            K[i * n + j] = e
            s += e
        inv = 1.0 / s
        for j in range(n):
            K[i * n + j] = K[i * n + j] * inv + eps  # the compiler may contract: same in both kernels
    return K


def init_gt(d, n, a, b):
    return [float(d[i * n + j]) * a[i] * b[j] for i in range(n) for j in range(n)]


def kernel_tape(K, d, n, repeat, eps):
    """The replaced kernel: tape[k] = the factor step k set."""
    a, b, al, be = [1.0] * n, [1.0] * n, [1.0] * n, [1.0] * n
    tape = []
    fwd_step(False, K, n, b, be, a, eps); tape.append(list(b))
    for r in range(1, repeat):
        fwd_step(True, K, n, a, al, b, eps); tape.append(list(a))
        fwd_step(False, K, n, b, be, a, eps); tape.append(list(b))
    gt = init_gt(d, n, a, b)
    log = []
    for r in range(repeat - 1, 0, -1):
        bwd_step(False, K, n, gt, a, b, log)
        b = list(tape[2 * r - 2])
        bwd_step(True, K, n, gt, a, b, log)
        a = list(tape[2 * r - 3]) if r >= 2 else [1.0] * n
    bwd_step(False, K, n, gt, a, b, log)
    return gt, log, len(tape) * n


def kernel_ckpt(K, d, n, repeat, eps, P, keep_last):
    """The kernel: (al, be) before every group of pairs, recomputed in the reverse;
    keep_last (SINKHORN_BWD_KEEP_LAST): group 0 the short one, the last group's factors
    kept from the forward."""
    a, b, al, be = [1.0] * n, [1.0] * n, [1.0] * n, [1.0] * n
    tape = []
    G = (repeat - 1 + P - 1) // P
    first0 = 1 + (repeat - 1) - (G - 1) * P if keep_last else 1 + P
    fwd_step(False, K, n, b, be, a, eps)
    r = 1
    for g in range(G):
        tape.append((list(al), list(be)))
        end = first0 if g == 0 else first0 + g * P
        if keep_last and g == G - 1:
            break
        while r < min(end, repeat):
            fwd_step(True, K, n, a, al, b, eps)
            fwd_step(False, K, n, b, be, a, eps)
            r += 1
    A = [[0.0] * n for _ in range(P)]
    B = [[0.0] * n for _ in range(P)]
    if keep_last and G > 0:
        pairs = repeat - 1 if G == 1 else P
        assert r + pairs == repeat
        for q in range(pairs):
            fwd_step(True, K, n, A[q], al, B[q - 1] if q else b, eps)
            fwd_step(False, K, n, B[q], be, A[q], eps)
            a, b = list(A[q]), list(B[q])
    gt = init_gt(d, n, a, b)
    log = []
    for g in range(G - 1, -1, -1):
        start = 1 if g == 0 else first0 + (g - 1) * P
        pairs = min(first0 if g == 0 else first0 + g * P, repeat) - start
        assert 1 <= pairs <= P
        al, be = list(tape[g][0]), list(tape[g][1])
        b = [rcp(v) for v in be]
        if not (keep_last and g == G - 1):
            for q in range(pairs):
                fwd_step(True, K, n, A[q], al, B[q - 1] if q else b, eps)
                fwd_step(False, K, n, B[q], be, A[q], eps)
        for q in range(pairs - 1, -1, -1):
            bwd_step(False, K, n, gt, A[q], B[q], log)
            bwd_step(True, K, n, gt, A[q], B[q - 1] if q else b, log)
    a = [1.0] * n
    bwd_step(False, K, n, gt, a, b, log)
    return gt, log, len(tape) * 2 * n


def dx_of(K, gt, n, eps):
    out = []
    for i in range(n):
        z = [K[i * n + j] - eps for j in range(n)]
        s = 0.0
        for j in range(n):
            s = fma(gt[i * n + j], z[j], s)
        out += [float(np.float32(z[j] * (gt[i * n + j] - s))) for j in range(n)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ok = True
    for n in (1, 2, 4, 5, 6):
        for repeat in (1, 2, 3, 4, 7, 20):
            for eps in (1e-6, 1e-3):
                same = True
                for _ in range(args.m):
                    x = [float(v) for v in rng.uniform(-3, 3, n * n).astype(np.float32)]
                    d = [float(v) for v in rng.uniform(-1, 1, n * n).astype(np.float32)]
                    K = softmax_eps(x, n, eps)
                    g0, l0, w0 = kernel_tape(K, d, n, repeat, eps)
                    for keep_last in (False, True):
                        g1, l1, w1 = kernel_ckpt(K, d, n, repeat, eps, args.pairs, keep_last)
                        same &= l0 == l1 and g0 == g1 and dx_of(K, g0, n, eps) == dx_of(K, g1, n, eps)
                    assert len(l0) == 2 * repeat - 1
                print(f"n={n} repeat={repeat:2d} eps={eps:g}: tape {8 * w0:5d} B -> ckpt {8 * w1:5d} B a thread; "
                      f"factors of all {2 * repeat - 1} reversed steps, gt, dx bitwise equal: {same}")
                ok &= same
    print("ALL EQUAL" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
