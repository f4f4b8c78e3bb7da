"""Issue 41's crash hunt on a GPU: the shared reproducer's indices under inputs that a real
client can hand the attention (sinks of -inf, NaN in unselected kv rows or in an empty
row's upstream gradient, large logits, int64 or strided indices), and NeMo AutoModel
0.7.0's own DeepseekV4Attention at the issue's shape, with and without `init_weights`
(torch.empty parameters are whatever the allocator held), each case in its own process so
a sticky CUDA error ends only that case.

    PYTHONPATH=<dsv4_kernels[:nemo_automodel]> python3 research/issue41_hunt.py all   # driver
    python3 research/issue41_hunt.py CASE                                              # one case

Prints one line a case: `CASE: ok` with the finite/NaN census of the gradients, or the
error. Reads the reproducer from $DSV4_SHARED_DIR/repro (default ../shared/repro).
"""

from __future__ import annotations

import io
import json
import lzma
import os
import subprocess
import sys
import time
from pathlib import Path

H, D = 64, 512
CASES = [
    "repro_atomic", "repro_deterministic", "repro_portable_atomic", "nemo_noinit", "nemo_init", "repro_portable_deterministic",
    "repro_dout_nan_empty", "repro_sinks_neginf", "repro_kv_nan_unselected", "repro_after_garbage", "repro_i64", "repro_strided",
    "repro_big_logits", "repro_plan_deterministic", "nemo_init_padmask",
]


def load_idx(torch):
    import numpy as np
    shared = Path(os.environ.get("DSV4_SHARED_DIR") or Path(__file__).resolve().parents[2] / "shared")
    raw = lzma.open(shared / "repro" / "sa_bwd_crash_idx.npy.xz").read()
    return torch.from_numpy(np.load(io.BytesIO(raw))).cuda()


def census(**tensors):
    out = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = None
            continue
        t = t.float()
        out[name] = {"nan": int(t.isnan().sum()), "inf": int(t.isinf().sum()), "absmax": float(t.nan_to_num(0, 0, 0).abs().max()) if t.numel() else 0.0}
    return out


def repro(case):
    import torch
    import dsv4_kernels as dk
    idx = load_idx(torch)
    empty = [2102, 2174]
    gen = torch.Generator(device="cuda").manual_seed(41)
    q = (torch.randn(1, 4096, H, D, device="cuda", generator=gen) * 0.5).bfloat16()
    kv = (torch.randn(1, 5120, D, device="cuda", generator=gen) * 0.5).bfloat16()
    sinks = torch.randn(H, device="cuda", generator=gen)
    dout = torch.randn(1, 4096, H, D, device="cuda", generator=gen).bfloat16()
    impl = "deterministic" if "deterministic" in case else "atomic"
    plan = None
    if case == "repro_i64":
        idx = idx.long()
    elif case == "repro_strided":
        wide = torch.full((1, 4096, 700), -1, dtype=torch.int32, device="cuda")
        wide[..., :640] = idx
        idx = wide[..., :640]
    elif case == "repro_sinks_neginf":
        sinks[:8] = float("-inf")
    elif case == "repro_kv_nan_unselected":
        used = torch.zeros(5120, dtype=torch.bool, device="cuda")
        used[idx[idx >= 0].long()] = True
        kv[0, ~used] = float("nan")
        print(f"  {int((~used).sum())} kv rows no slot selects set to NaN")
    elif case == "repro_dout_nan_empty":
        dout[0, empty] = float("nan")
    elif case == "repro_big_logits":
        q = q * 60
    elif case == "repro_plan_deterministic":
        plan = dk.plan_dsv4_sparse_indices(idx, 5120, "cuda")
    elif case == "repro_after_garbage":
        # A warm process: the caching allocator's free blocks hold earlier data (here a
        # pattern that reads as large ints / huge floats) when our workspaces come from it.
        junk = torch.full((3 << 28,), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
        del junk
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sinks)]
    out = dk.dsv4_sparse_attention(*leaves, None if plan is not None else idx, D ** -0.5, "cuda", backward_impl=impl, plan=plan)
    out.backward(dout)
    torch.cuda.synchronize()
    dq, dkv, ds = (t.grad for t in leaves)
    res = census(out=out, dq=dq, dkv=dkv, dsinks=ds)
    res["empty_rows_out_nonzero"] = int(torch.count_nonzero(out[0, empty].float().nan_to_num(1.0)))
    res["empty_rows_dq_nonzero"] = int(torch.count_nonzero(dq[0, empty].float().nan_to_num(1.0)))
    return res


def nemo(case):
    import torch
    from nemo_automodel.components.models.common.utils import BackendConfig
    from nemo_automodel.components.models.deepseek_v4 import layers as L
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
    from dsv4_kernels.integrations.nemo import apply_dsv4_kernels_to_nemo
    import dsv4_kernels as dk

    s = 4096
    cfg = DeepseekV4Config(num_hidden_layers=1, compress_ratios=[4], torch_dtype="bfloat16")  # hidden 4096, H=64, D=512, window 128, top-512
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        attn = L.DeepseekV4Attention(cfg, 0, backend=BackendConfig())
    torch.set_default_dtype(prev)
    if case != "nemo_noinit":
        attn.init_weights(torch.device("cuda"), init_std=0.02)
    x = torch.randn(1, s, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(s, device="cuda").unsqueeze(0)
    two_d = None
    if case == "nemo_init_padmask":
        two_d = torch.ones(1, s, device="cuda", dtype=torch.long)
        two_d[0, -300:] = 0  # right padding
    mask = L.build_causal_padding_mask(two_d, s, torch.bfloat16, "cuda", 1, sliding_window=cfg.sliding_window)
    rot = L.DeepseekV4RotaryEmbedding(cfg.rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim).to("cuda")
    rot_c = L.DeepseekV4RotaryEmbedding(cfg.compress_rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim, rope_scaling=cfg.rope_scaling).to("cuda")
    seen = {}
    real_attention = dk.dsv4_sparse_attention

    def spy(q, kv, sinks, idx, *a, **k):
        v = (idx >= 0) & (idx < kv.shape[1])
        n = v.sum(-1)
        win = v[..., :cfg.sliding_window].sum(-1)
        seen.update(rows=int(n.numel()), empty_rows=int((n == 0).sum()), empty_window_rows=int((win == 0).sum()), q_finite=bool(torch.isfinite(q).all()), kv_finite=bool(torch.isfinite(kv).all()),
                    sinks=[float(sinks.min()), float(sinks.max())])
        return real_attention(q, kv, sinks, idx, *a, **k)

    with apply_dsv4_kernels_to_nemo():
        L.dsv4_sparse_attention, saved = spy, L.dsv4_sparse_attention
        try:
            out, _ = attn(x, position_embeddings=rot(x, pos), attention_mask=mask, position_embeddings_compress=rot_c(x, pos), rotary_compress=rot_c, position_ids=pos)
        finally:
            L.dsv4_sparse_attention = saved
        (out.float().sum()).backward()
        torch.cuda.synchronize()
    grads = {n: p.grad for n, p in attn.named_parameters() if p.grad is not None}
    res = {"indices": seen, "out": census(out=out)["out"]}
    res["grads_with_nan"] = sorted(n for n, g in grads.items() if not torch.isfinite(g).all())
    return res


def one(case):
    t0 = time.time()
    res = repro(case) if case.startswith("repro") else nemo(case)
    print(f"{case}: ok {time.time() - t0:.1f} s {json.dumps(res)}")


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which != "all":
        if "portable" in which:
            os.environ["DSV4_PORTABLE"] = "1"
        one(which)
        return
    failed = 0
    for case in CASES:
        env = dict(os.environ)
        if "portable" in case:
            env["DSV4_PORTABLE"] = "1"
        try:
            r = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            failed += 1
            print(f"{case}: FAILED: no result in 90 s")
            continue
        lines = (r.stdout + r.stderr).strip().splitlines()
        if r.returncode != 0:
            failed += 1
            tail = [l for l in lines if "Error" in l or "error" in l][-3:] or lines[-3:]
            print(f"{case}: FAILED rc={r.returncode}: {' | '.join(tail)}")
        else:
            print("\n".join(l for l in lines if l.startswith(case + ":") or l.startswith("  ")))
    print(f"issue41_hunt: {failed} of {len(CASES)} cases failed")


if __name__ == "__main__":
    main()
