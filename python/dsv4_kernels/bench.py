"""Timings through the torch API, as a training step calls the kernels.

    python -m dsv4_kernels.bench [TARGET ...] [--s 4096 16384] [--b 1] [--h 64] [--d 512]
                                 [--slots 640] [--iters 50] [--cooldown-ms 500] [--json FILE]

Targets: ``nemo-layer`` (NeMo AutoModel's DeepseekV4Attention forward + backward, the
seeds' torch path, and their TileLang path where ``tilelang`` is installed, against ours, with peak memory; needs nemo_automodel), ``attention`` (forward, backward atomic and deterministic, through the
ops that the public functions and autograd call, with and without a plan), ``indexer``
(scores, ``lightning_indexer`` = scores + top-k, top-k scores forward + backward),
``sinkhorn``, ``qnorm_rope``, ``builder``; ``all`` (the default) is every kernel target.

Every row reports, in milliseconds:
- ``gpu``: CUDA events around ``iters`` calls queued back to back, divided by ``iters``
  (the amortised GPU time under sustained load: no idle, no cache flush);
- ``host``: wall time of queueing those calls (no synchronisation) divided by ``iters``:
  what one call costs the CPU; when it approaches ``gpu`` the call waits for the device;
- ``cool``: one call after ``--cooldown-ms`` of idle (events around it), as a step that
  follows host-side work sees it.
Where NeMo AutoModel 0.7.0 is importable, the seeds' torch functions run in the same loop
on the same tensors (rows ``seeds-torch``), with the ratio to ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import dsv4_kernels as dk
from dsv4_kernels import _torch_ops

DEV = "cuda"
_ops = _torch_ops.call  # what the public functions call: the custom ops under torch.compile, their implementations in eager mode


def timed(fn, iters, cooldown_ms):
    """(gpu ms, host ms, cool ms) of ``fn`` (see the module documentation)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / iters)
        host.append((t1 - t0) * 1e3 / iters)
    time.sleep(cooldown_ms / 1e3)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return statistics.median(gpu), statistics.median(host), start.elapsed_time(end)


def selection(b, s, p, t_c, window, ratio=4, seed=0):
    """``(compressed_topk [B,S,min(t_c,P)], indices [B,S,window+min(t_c,P)] i32)`` the way
    NeMo's DeepseekV4Attention builds them: random indexer scores with the causal -inf,
    ``torch.topk``, -1 past each row's visible count, then the index builder."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.rand(b, s, p, device=DEV, generator=gen)
    valid_end = ((torch.arange(s, device=DEV) + 1) // ratio).view(1, s, 1)
    scores = scores.masked_fill(torch.arange(p, device=DEV).view(1, 1, p) >= valid_end, float("-inf"))
    top = scores.topk(min(t_c, p), dim=-1)
    ct = torch.where(top.indices >= valid_end, -1, top.indices)
    return ct, dk.build_dsv4_sparse_topk_indices(batch_size=b, seq_len=s, key_len=s + p, window_size=window, device=DEV, compress_ratio=ratio, compressed_topk=ct,
                                                 n_pooled=p)


def seeds():
    try:
        from nemo_automodel.components.models.deepseek_v4 import optimized_kernels as sk
    except Exception:  # noqa: BLE001 - optional peer
        return None
    return sk


def bench_attention(a, rows, add):
    b, h, d, window = a.b, a.h, a.d, 128
    for s in a.s:
        p = s // 4
        t_c = a.slots - window
        _, idx = selection(b, s, p, t_c, window)
        gen = torch.Generator(device=DEV).manual_seed(1)
        q = (torch.randn(b, s, h, d, device=DEV, generator=gen) * 0.5).bfloat16()
        kv = (torch.randn(b, s + p, d, device=DEV, generator=gen) * 0.5).bfloat16()
        sinks = torch.randn(h, device=DEV, generator=gen)
        scale = d ** -0.5
        plan = dk.plan_dsv4_sparse_indices(idx, s + p, "cuda")
        shape = f"B={b} S={s} H={h} D={d} T={idx.shape[-1]}"
        out, lse = _ops.sparse_attention(q, kv, sinks, idx, scale, "cuda", False, False, -1, "atomic", 2 << 30)
        dout = torch.randn_like(out)
        add(rows, "sparse_attention fwd", shape, lambda: _ops.sparse_attention(q, kv, sinks, idx, scale, "cuda", False, False, -1, "atomic", 2 << 30))
        add(rows, "sparse_attention fwd (plan)", shape, lambda: _ops.sparse_attention(q, kv, sinks, None, scale, "cuda", False, False, plan._id, "atomic", 2 << 30))
        for impl in ("atomic", "deterministic"):
            add(rows, f"sparse_attention bwd {impl} (plan)", shape,
                lambda impl=impl: _ops.sparse_attention_backward(q, kv, sinks, None, out, lse, dout, scale, "cuda", False, False, plan._id, impl, 2 << 30))
        leaves = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]

        def step():
            o = dk.dsv4_sparse_attention(*leaves, None, scale, "cuda", plan=plan)
            o.backward(dout)

        add(rows, "sparse_attention fwd+bwd autograd (plan)", shape, step)
        sk = seeds()
        if sk is not None and s <= 4096:
            add(rows, "seeds-torch sparse_attention_torch fwd", shape, lambda: sk.sparse_attention_torch(q, kv, sinks, idx, scale), peer_of="sparse_attention fwd")


def bench_indexer(a, rows, add):
    h, d, b = 64, 128, a.b
    for s in a.s:
        p = s // 4
        gen = torch.Generator(device=DEV).manual_seed(2)
        q = torch.randn(b, s, h, d, device=DEV, generator=gen).bfloat16()
        k = torch.randn(b, p, d, device=DEV, generator=gen).bfloat16()
        w = torch.randn(b, s, h, device=DEV, generator=gen) * h ** -0.5
        scale = d ** -0.5
        shape = f"B={b} S={s} H={h} D={d} P={p}"
        add(rows, "indexer_scores", shape, lambda: _ops.indexer_scores(q, k, w, scale, 4, 0, None, "cuda"))
        add(rows, "lightning_indexer (scores + top-512)", shape, lambda: _ops.lightning_indexer(q, k, w, scale, 4, 0, None, 512, "cuda"))
        idx, _ = _ops.lightning_indexer(q, k, w, scale, 4, 0, None, 512, "cuda")
        sc = _ops.indexer_topk_scores(q, k, w, idx, scale, 4, 0, None, "cuda")
        g = torch.where(torch.isfinite(sc), torch.randn_like(sc), 0)
        add(rows, "indexer_topk_scores fwd", shape + " T=512", lambda: _ops.indexer_topk_scores(q, k, w, idx, scale, 4, 0, None, "cuda"))
        add(rows, "indexer_topk_scores bwd", shape + " T=512", lambda: _ops.indexer_topk_scores_backward(q, k, w, idx, g, scale, 4, 0, None, "cuda", False))
        sk = seeds()
        if sk is not None and s <= 4096:
            def peer():
                scores = sk.indexer_scores_torch(q, k, w, scale)
                return scores.topk(512, dim=-1)
            add(rows, "seeds-torch indexer_scores_torch + topk", shape, peer, peer_of="lightning_indexer (scores + top-512)")


def bench_sinkhorn(a, rows, add):
    for m in (65536, 1048576):
        x = torch.randn(m, 4, 4, device=DEV)
        g = torch.randn(m, 4, 4, device=DEV)
        shape = f"M={m} n=4 repeat=20"
        add(rows, "sinkhorn fwd", shape, lambda: _ops.sinkhorn(x, 20, 1e-6, "cuda"))
        add(rows, "sinkhorn bwd", shape, lambda: _ops.sinkhorn_backward(x, g, 20, 1e-6, "cuda"))
        sk = seeds()
        if sk is not None:
            add(rows, "seeds-torch sinkhorn_normalize_torch", shape, lambda: sk.sinkhorn_normalize_torch(x, 20, 1e-6), peer_of="sinkhorn fwd")


def bench_qnorm_rope(a, rows, add):
    b, h, c, r = a.b, a.h, a.d, 64
    for s in a.s:
        x = torch.randn(b, s, h, c, device=DEV).bfloat16().transpose(1, 2)
        ang = torch.rand(b, s, r // 2, device=DEV) * 6.28
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        y, rstd = _ops.qnorm_rope(x, cos, sin, r, 1e-6, "cuda")
        gy = torch.randn_like(y)
        shape = f"B={b} H={h} S={s} C={c} rope={r}"
        add(rows, "qnorm_rope fwd", shape, lambda: _ops.qnorm_rope(x, cos, sin, r, 1e-6, "cuda"))
        add(rows, "qnorm_rope bwd", shape, lambda: _ops.qnorm_rope_backward(x, cos, sin, r, 1e-6, rstd, gy, "cuda"))


def bench_builder(a, rows, add):
    for s in a.s:
        p = s // 4
        ct, idx = selection(a.b, s, p, a.slots - 128, 128)
        shape = f"B={a.b} S={s} W=128 Tc={ct.shape[-1]}"
        add(rows, "build_sparse_topk_indices", shape, lambda: dk.build_dsv4_sparse_topk_indices(batch_size=a.b, seq_len=s, key_len=s + p, window_size=128, device=DEV,
                                                                                               compress_ratio=4, compressed_topk=ct, n_pooled=p))
        add(rows, "plan_sparse_indices", shape, lambda: dk.plan_dsv4_sparse_indices(idx, s + p, "cuda"))


def bench_nemo_layer(a, rows, add):
    """NeMo AutoModel 0.7.0's DeepseekV4Attention (hidden 4096, H=64, D=512, compress ratio 4,
    window 128, top-512) forward + backward: the seeds' torch path (its eager attention over
    the dense mask), then ours (apply_dsv4_kernels_to_nemo); time, peak memory, and the share
    of ours spent in this project's kernels (profiler, CUDA time of kernels by name)."""
    try:
        from nemo_automodel.components.models.common.utils import BackendConfig
        from nemo_automodel.components.models.deepseek_v4 import layers as L
        from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
    except Exception as e:  # noqa: BLE001 - optional
        print(f"nemo-layer: NeMo AutoModel is not importable ({e}); skipped")
        return
    from dsv4_kernels.integrations.nemo import apply_dsv4_kernels_to_nemo

    cfg = DeepseekV4Config(num_hidden_layers=1, compress_ratios=[4], hidden_size=4096, num_attention_heads=64, head_dim=512, index_topk=512, sliding_window=128)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        torch_layer = L.DeepseekV4Attention(cfg, 0, backend=BackendConfig(attn="torch"))
        # NeMo's parameters start as torch.empty (whatever the allocator held): initialise
        # them as its model does, so every row times real arithmetic, not NaN.
        torch_layer.init_weights(torch.device(DEV), init_std=0.02)
        try:  # the seeds' TileLang kernels, where tilelang is installed
            import tilelang  # noqa: F401

            tl_layer = L.DeepseekV4Attention(cfg, 0, backend=BackendConfig(attn="tilelang"))
            tl_layer.load_state_dict(torch_layer.state_dict())
        except Exception as e:  # noqa: BLE001 - optional peer
            print(f"nemo-layer: no seeds-tilelang row ({type(e).__name__}: {e})", flush=True)
            tl_layer = None
    torch.set_default_dtype(torch.float32)
    rot = L.DeepseekV4RotaryEmbedding(cfg.rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim).to(DEV)
    rotc = L.DeepseekV4RotaryEmbedding(cfg.compress_rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim, rope_scaling=cfg.rope_scaling).to(DEV)
    for s in a.s:
        x = torch.randn(a.b, s, 4096, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(s, device=DEV)[None].expand(a.b, -1)
        pe, pec = rot(x, pos), rotc(x, pos)
        mask = L.build_causal_padding_mask(None, s, torch.bfloat16, DEV, a.b, sliding_window=128)
        g = torch.randn(a.b, s, 4096, device=DEV, dtype=torch.bfloat16)

        def step(layer):
            out, _ = layer(x, pe, attention_mask=mask, position_embeddings_compress=pec, rotary_compress=rotc, position_ids=pos)
            out.backward(g)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        shape = f"B={a.b} S={s} hidden=4096 H=64 D=512"
        # patched: the options of apply_dsv4_kernels_to_nemo, or None for a seeds' path
        runs = [("ours", {}, torch_layer), ("ours+qnorm_rope", {"fused_qnorm_rope": True}, torch_layer), ("seeds-torch", None, torch_layer)] + ([("seeds-tilelang", None, tl_layer)] if tl_layer is not None else [])
        for name, patched, layer in runs:
            handle = apply_dsv4_kernels_to_nemo(**patched) if patched is not None else None
            try:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                try:
                    add(rows, f"nemo-layer fwd+bwd {name}", shape, lambda: step(layer), peer_of=None if patched is not None else "nemo-layer fwd+bwd ours")
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    print(f"nemo-layer fwd+bwd {name:20s} {shape}: out of memory", flush=True)
                    rows.append({"op": f"nemo-layer fwd+bwd {name}", "shape": shape, "error": "out of memory"})
                    continue
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                rows[-1]["peak_gib"] = peak
                print(f"    peak memory above the inputs: {peak:.2f} GiB", flush=True)
                if patched is not None:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        step(layer)
                        torch.cuda.synchronize()
                    ours_us = total_us = 0.0
                    for e in prof.key_averages():
                        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                        if e.key.startswith(("sparse_attn", "indexer", "idx", "sinkhorn", "qnorm", "build_indices", "topk", "dsv4")):
                            ours_us += t
                        total_us += t
                    rows[-1]["ours_kernels_share"] = ours_us / max(total_us, 1e-9)
                    print(f"    this project's kernels: {ours_us / 1e3:.3f} ms of {total_us / 1e3:.3f} ms of CUDA time; the largest:", flush=True)
                    top_kernels(prof)
            finally:
                if handle is not None:
                    handle.undo()


def host_profile(fn, n, top=10):
    """Where one call's host time goes: cProfile over ``n`` queued calls, the functions with
    the most own time (microseconds per call), native calls included."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    entries = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in st.stats.values())
    print(f"    host profile ({n} calls, {total / n * 1e6:.1f} us/call of own time in all):", flush=True)
    for (file, line, func), (cc, nc, tt, ct, _) in entries:
        where = func if file == "~" else f"{file.rsplit('/', 2)[-2]}/{file.rsplit('/', 1)[-1]}:{line}({func})"
        print(f"      {tt / n * 1e6:8.2f} us own {ct / n * 1e6:8.2f} us cum  x{nc / n:4.1f}  {where}", flush=True)


def top_kernels(prof, top=15):
    """The profiler's CUDA kernels with the most device time (ms per profiled step)."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        rows.append((t, e.count, e.key))
    for t, c, k in sorted(rows, reverse=True)[:top]:
        print(f"      {t / 1e3:8.3f} ms  x{c:<4d} {k[:110]}", flush=True)


TARGETS = {"attention": bench_attention, "indexer": bench_indexer, "sinkhorn": bench_sinkhorn, "qnorm_rope": bench_qnorm_rope, "builder": bench_builder, "nemo-layer": bench_nemo_layer}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsv4_kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", default=["all"], help="attention indexer sinkhorn qnorm_rope builder nemo-layer all")
    ap.add_argument("--s", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--slots", type=int, default=640)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cooldown-ms", type=float, default=500.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="after each row of ours, profile N calls with cProfile and print where the host time goes")
    a = ap.parse_args(argv)
    names = [n for n in TARGETS if n != "nemo-layer"] if "all" in a.targets else a.targets
    rows = []
    ours = {}

    def add(rows, name, shape, fn, peer_of=None):
        gpu, host, cool = timed(fn, a.iters, a.cooldown_ms)
        row = {"op": name, "shape": shape, "gpu_ms": gpu, "host_ms": host, "cool_ms": cool}
        if peer_of is not None and (peer_of, shape) in ours:
            row["peer_over_ours"] = gpu / ours[(peer_of, shape)]
        else:
            ours[(name, shape)] = gpu
        rows.append(row)
        ratio = f"  peer/ours {row['peer_over_ours']:.2f}x" if "peer_over_ours" in row else ""
        print(f"{name:44s} {shape:34s} gpu {gpu:9.4f}  host {host:8.4f}  cool {cool:9.4f} ms{ratio}", flush=True)
        if a.host_profile and peer_of is None:
            host_profile(fn, a.host_profile)

    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, iters {a.iters}, cooldown {a.cooldown_ms} ms", flush=True)
    for n in names:
        if n not in TARGETS:
            ap.error(f"unknown target {n!r}; expected one of {', '.join(TARGETS)}, all")
        TARGETS[n](a, rows, add)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
