#!/usr/bin/env python3
"""CPU replay of the Sinkhorn backward with n lanes a matrix (kernels/sinkhorn/bwd.cu,
DSV4_SINKHORN_BWD_LANES=1; branch exp/sinkhorn-bwd-lanes) in float64, operation by
operation as each lane runs it, judged with scripts/sinkhorn_bwd_emulate.py's reference and
measure (max over rows of max |got - ref| / max |ref row|; SPEC.md section 8 bound 1e-5).

Per lane r of a matrix (vectors in xor order, v[d] = v_{r^d}):
  K row r: exp(x - max) in f64, sum in j order, times 1/sum (IEEE division), + eps (FMA).
  forward, columns: s = eps*beta_r; s = fma(K_{r^d,r}, a_{r^d}, s) for d = 0..n-1; beta_r = s,
           b_r = rcp(s);  rows alike with K_{r,r^d} and b_{r^d}.
  rcp(d): MUFU.RCP64H seed (1/d with a random relative error of up to 2^-19, low word
          zeroed), then r + r*(1 - d*r) as two FMAs.
  gt[d] = (dout_{r,r^d} * a_r) * b_{r^d}.
  reverse, rows: H = fma chain over d of K_{r,r^d} gt[d] from 0; c = a_r*H;
           gt[d] = fma(-c, b_{r^d}, gt[d]).
  reverse, columns: q[d] = K_{r,r^d} * gt[d] (d >= n/2); q[d] = fma(K_{r,r^d}, gt[d],
           partner(r^(n/2)).q[d+n/2]) (d < n/2); then for w = n/4 .. 1:
           q[d] += partner(r^w).q[d+w] (d < w); c_r = b_r * q[0]; gt[d] = fma(-c_{r^d}, a_r, gt[d]).
  softmax (gt back in j order): z = K - eps; s = fma chain of gt_j z_j in j order;
           dx = f32(z * (gt - s)). (Summed in xor order instead, rows whose z is near
           one-hot land up to 4e-4 of the row scale from the f64 reference, which sums in j
           order: g - <g, z> cancels to ~1e-15 of g there.)
FMA is emulated with an error-free product (Veltkamp/Dekker) and sum: correctly rounded
except for rare double-rounding ties. `--order thread` replays today's one-thread kernel
(natural order, fma chains down the columns) the same way, for comparison.

    python3 scripts/sinkhorn_bwd_lanes_emulate.py [--m 65536]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sinkhorn_bwd_emulate import golden_cases, normal3, ref_backward, row_err  # noqa: E402

f32, f64 = np.float32, np.float64
RNG = np.random.default_rng(7)


def _split(x):
    c = 134217729.0 * x  # 2^27 + 1
    hi = c - (c - x)
    return hi, x - hi


def fma(a, b, c):
    """round(a*b + c), via p + e = a*b exactly and s + t = p + c exactly."""
    a, b, c = np.broadcast_arrays(np.asarray(a, f64), np.asarray(b, f64), np.asarray(c, f64))
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    s = p + c
    bp = s - p
    t = (p - (s - bp)) + (c - bp)
    return s + (t + e)


def rcp(d):
    seed = (1.0 / d) * (1.0 + RNG.uniform(-2.0 ** -19, 2.0 ** -19, d.shape))
    seed = (seed.view(np.uint64) & np.uint64(0xFFFFFFFF00000000)).view(f64)
    return fma(seed, fma(-d, seed, 1.0), seed)


def backward(x, dout, repeat, eps, order="lanes"):
    M, n, _ = x.shape
    eps = float(f32(eps))
    r = np.arange(n)
    # perm[r, d]: the column lane r's position d stands for.
    perm = (r[:, None] ^ r[None, :]) if order == "lanes" else np.broadcast_to(r[None, :], (n, n))
    rows = r[:, None]
    x = x.astype(f32)
    mx = x.max(axis=-1).astype(f64)
    E = np.exp(x.astype(f64) - mx[..., None])
    s = np.zeros((M, n))
    for j in range(n):
        s = s + E[..., j]
    K = fma(E, (1.0 / s)[..., None], eps)  # [M, i, j] natural
    Kr = K[:, rows, perm]  # Kr[m, r, d] = K[r, perm[r, d]]
    Kc = K[:, perm, rows]  # Kc[m, r, d] = K[perm[r, d], r]

    a = np.ones((M, n)); b = np.ones((M, n)); al = np.ones((M, n)); be = np.ones((M, n))
    tape = []

    def step(kind):
        nonlocal a, b, al, be
        if kind == "cols":
            s = eps * be
            for d in range(n):
                s = fma(Kc[:, :, d], a[:, perm[:, d]], s)
            be = s
            b = rcp(s)
            tape.append(b)
        else:
            s = eps * al
            for d in range(n):
                s = fma(Kr[:, :, d], b[:, perm[:, d]], s)
            al = s
            a = rcp(s)
            tape.append(a)

    step("cols")
    for _ in range(repeat - 1):
        step("rows")
        step("cols")

    dv = dout.astype(f32).astype(f64)[:, rows, perm]
    gt = (dv * a[:, :, None]) * b[:, perm]

    def row_bwd(ar, b):
        nonlocal gt
        s = np.zeros((M, n))
        for d in range(n):
            s = fma(Kr[:, :, d], gt[:, :, d], s)
        c = ar * s
        gt = fma(-c[:, :, None], b[:, perm], gt)

    def col_bwd(ar, b):
        nonlocal gt
        if order == "lanes":
            q = Kr * gt
            w = n // 2
            if w >= 1:  # first round: own product + the partner's in one FMA
                q2 = q.copy()
                for d in range(w):
                    q2[:, :, d] = fma(Kr[:, :, d], gt[:, :, d], q[:, r ^ w, d + w])
                q = q2
                w //= 2
            while w >= 1:
                q2 = q.copy()
                for d in range(w):
                    q2[:, :, d] = q[:, :, d] + q[:, r ^ w, d + w]
                q = q2
                w //= 2
            C = q[:, :, 0]  # C[m, r] = column r's sum
            c = b * C
            gt = fma(-c[:, perm], ar[:, :, None], gt)
        else:
            s = np.zeros((M, n))  # s[m, j]
            for i in range(n):
                s = fma(K[:, i, :], gt[:, i, :], s)
            c = b * s
            gt = fma(-c[:, None, :], ar[:, :, None], gt)

    ar = a
    for k in range(repeat - 1, 0, -1):
        col_bwd(ar, b)
        b = tape[2 * k - 2]
        row_bwd(ar, b)
        ar = tape[2 * k - 3] if k >= 2 else np.ones((M, n))
    col_bwd(ar, b)
    # Softmax backward in j order (gt and K back in natural order first).
    gn = np.empty_like(gt)
    gn[:, rows, perm] = gt
    z = K - eps
    s = np.zeros((M, n))
    for j in range(n):
        s = fma(gn[:, :, j], z[:, :, j], s)
    return (z * (gn - s[:, :, None])).astype(f32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=1 << 16)
    ap.add_argument("--golden", default="/work/shared/golden/dsv4_golden_public.safetensors")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    m = args.m
    sets = []
    if os.path.exists(args.golden):
        for c, x, g, _, rep, eps in golden_cases(args.golden):
            n = x.shape[-1]
            if n in (1, 2, 4):
                sets.append((f"golden {c} n={n} repeat {rep} eps {eps}", x.reshape(-1, n, n), g.reshape(-1, n, n), rep, eps))
    sets.append((f"bench {m} x 4x4 (x U(-3,3), dout U(-1,1)) repeat 20", rng.uniform(-3, 3, (m, 4, 4)).astype(f32), rng.uniform(-1, 1, (m, 4, 4)).astype(f32), 20, 1e-6))
    sets.append((f"gpu test {m} x 4x4 (x 2*normal3, dout normal3) repeat 20", 2 * normal3(rng, (m, 4, 4)), normal3(rng, (m, 4, 4)), 20, 1e-6))
    sets.append((f"{m} x 4x4 (x 8*normal3) repeat 20 eps 1e-6", 8 * normal3(rng, (m, 4, 4)), normal3(rng, (m, 4, 4)), 20, 1e-6))
    sets.append((f"{m} x 2x2 (x 2*normal3) repeat 20", 2 * normal3(rng, (m, 2, 2)), normal3(rng, (m, 2, 2)), 20, 1e-6))
    sets.append(("4096 x 4x4 eps 1e-3 repeat 7", 2 * normal3(rng, (4096, 4, 4)), normal3(rng, (4096, 4, 4)), 7, 1e-3))
    for name, x, g, rep, eps in sets:
        n = x.shape[-1]
        ref = ref_backward(x, g, rep, eps)
        lanes = backward(x, g, rep, eps, "lanes")
        thread = backward(x, g, rep, eps, "thread")
        print(f"== {name}")
        print(f"   lanes  (DSV4_SINKHORN_BWD_LANES=1) per row {row_err(lanes, ref, n):.2e}   per matrix {row_err(lanes, ref, n * n):.2e}")
        print(f"   thread (today's kernel)            per row {row_err(thread, ref, n):.2e}   per matrix {row_err(thread, ref, n * n):.2e}")
        print(f"   lanes vs thread: per row {row_err(lanes, thread.astype(f64), n):.2e}, f32 outputs bitwise equal {np.mean(lanes == thread) * 100:.2f} %")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
