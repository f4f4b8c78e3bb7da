"""Inputs of the deterministic-backward emulations (sa_det_grid_emulate.py,
sa_det_f16_emulate.py): one sequence, H heads of dim D, each row taking a W-key window and
TOPK of P pooled keys; sizes from EMU_S / EMU_H / EMU_D / EMU_W / EMU_TOPK / EMU_P, the seed
from argv[1], `big` (argv[2]) for peaked attention (one large logit per row)."""
import os
import sys

import numpy as np


def make_inputs():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    S, H, D, W, TOPK, P = (int(os.environ.get(k, v)) for k, v in (("EMU_S", 1024), ("EMU_H", 64), ("EMU_D", 512), ("EMU_W", 128), ("EMU_TOPK", 512), ("EMU_P", 1024)))
    big = len(sys.argv) > 2 and sys.argv[2] == "big"
    K = S + P
    q = rng.standard_normal((S, H, D)).astype(np.float32)
    kv = rng.standard_normal((K, D)).astype(np.float32)
    dO = rng.standard_normal((S, H, D)).astype(np.float32)
    if big:
        q *= 4.0
    sinks = rng.uniform(-1, 1, H)
    idx = np.empty((S, W + TOPK), np.int64)
    for s in range(S):
        idx[s, :W] = np.arange(s - W + 1, s + 1) % S        # window keys (wrapped; causality does not matter here)
        idx[s, W:] = S + rng.choice(P, TOPK, replace=False)   # selected pooled keys
    return dict(S=S, H=H, D=D, W=W, TOPK=TOPK, P=P, K=K, big=big, q=q, kv=kv, dO=dO, sinks=sinks, idx=idx)
