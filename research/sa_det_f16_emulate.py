#!/usr/bin/env python3
# Usage: [EMU_S=.. EMU_P=.. EMU_TOPK=..] python3 research/sa_det_f16_emulate.py [seed] [normal|big]
# (numpy, ~25 s at the default S=1024; docs/perf/LOG.md v21)
# Emulation: deterministic dKV from contributions stored in 16 bits. Each (row, slot)
# contribution c [D] (f32 in the kernel) is stored per 64-column chunk as fp16(c / s) with
# s = the chunk's max |c| (f32), or as bf16(c) without a scale, or (not built) as
# int8 round(127 c / s); the reduce sums the
# decoded values per key in a fixed order in f32. Judged as SPEC section 8 judges dkv:
# relative Frobenius error against the exact (f64) sum, and the worst key row.
import numpy as np, sys, os, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sa_det_inputs import make_inputs
_in = make_inputs()
S, H, D, W, TOPK, P, K, big = (_in[k] for k in ("S", "H", "D", "W", "TOPK", "P", "K", "big"))
q, kv, dO, sinks, idx = (_in[k] for k in ("q", "kv", "dO", "sinks", "idx"))
sc = D ** -0.5
def contrib(s):
    Q = q[s].astype(np.float64); V = kv[idx[s]].astype(np.float64); G = dO[s].astype(np.float64)
    L = sc * Q @ V.T
    m = np.maximum(L.max(1), sinks)
    Z = np.exp(L - m[:, None]).sum(1) + np.exp(sinks - m)
    Pm = np.exp(L - m[:, None]) / Z[:, None]
    O = Pm @ V
    delta = (G * O).sum(1)
    dS = Pm * (G @ V.T - delta[:, None])
    return sc * dS.T @ Q + Pm.T @ G                   # [T, D]
def bf16(x):
    b = np.asarray(x, np.float32).view(np.uint32)
    r = ((b >> 16) & 1) + 0x7FFF
    return ((b + r) & 0xFFFF0000).view(np.float32)
def f16_scaled(c32, chunk=64):
    T = c32.shape[0]
    cc = c32.reshape(T, -1, chunk)
    s = np.abs(cc).max(2, keepdims=True).astype(np.float32)
    inv = np.where(s > 0, np.float32(1) / s, np.float32(0)).astype(np.float32)
    h = (cc * inv).astype(np.float16)
    return (h.astype(np.float32) * s).reshape(T, -1)
def i8_scaled(c32, chunk=64):
    """int8 per 64-column chunk: round(127 c / s), s = the chunk's max |c| (not built)."""
    T = c32.shape[0]
    cc = c32.reshape(T, -1, chunk)
    s = np.abs(cc).max(2, keepdims=True).astype(np.float32)
    inv = np.where(s > 0, np.float32(127) / s, np.float32(0)).astype(np.float32)
    q = np.rint(cc * inv).astype(np.int8)
    return (q.astype(np.float32) * (s / np.float32(127))).reshape(T, -1)
exact = np.zeros((K, D)); acc = {m: np.zeros((K, D), np.float32) for m in ("f32", "bf16", "f16 scaled", "i8 scaled")}
cnt = np.zeros(K, np.int64)
t0 = time.time()
for s in range(S):
    C = contrib(s); k = idx[s]
    np.add.at(exact, k, C); np.add.at(cnt, k, 1)
    c32 = C.astype(np.float32)
    for m, v in (("f32", c32), ("bf16", bf16(c32)), ("f16 scaled", f16_scaled(c32)), ("i8 scaled", i8_scaled(c32))):
        np.add.at(acc[m], k, v)
print(f"S={S} P={P} topk={TOPK} {'big' if big else 'normal'}: contributions a key: window {W}, pooled mean {cnt[S:].mean():.0f} max {cnt[S:].max()} ({time.time() - t0:.0f} s)")
nz = cnt > 0
for m, a in acc.items():
    e = a.astype(np.float64) - exact
    fro = np.linalg.norm(e[nz]) / np.linalg.norm(exact[nz])
    rows = np.linalg.norm(e[nz], axis=1) / np.maximum(np.linalg.norm(exact[nz], axis=1), 1e-300)
    out = bf16(a).astype(np.float64) - exact   # the bf16 dkv the caller gets
    fro_out = np.linalg.norm(out[nz]) / np.linalg.norm(exact[nz])
    print(f"  {m:11s} rel. Frobenius {fro:.2e}  worst key row {rows.max():.2e}   as bf16 dkv: {fro_out:.2e}")
