"""Where the host time of one call through torch goes (issue 38), on a GPU machine:

    PYTHONPATH=<site with dsv4_kernels> python research/host_profile.py [--s 4096] [--iters 50]

For each op (the eager calls that the public functions make, `_torch_ops.call`), host
microseconds per call, median of 5 rounds of `iters` queued calls (no synchronisation):
- `full`: the whole call;
- `python`: the same call with its native function replaced by a no-op (our Python layer,
  torch.empty of the outputs, autograd.Function where the op has one);
- `native`: the native function alone, called with the descriptors the op passed it (the
  PyO3 argument parsing, the Rust op, the launches and the workspace callbacks);
- `native, driver alloc`: the same with torch's allocator hook cleared (workspaces from
  cuMemAllocAsync on the stream);
- `allocs`, `alloc us`: workspace callbacks per call and the microseconds spent in them.
Then a cProfile of the atomic backward (the 14 entries with the most own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

import dsv4_kernels as dk
from dsv4_kernels import _native, _torch_ops
from dsv4_kernels.bench import selection

_ops = _torch_ops.call
DEV = "cuda"


def per_call_us(fn, iters, rounds=5):
    fn()
    torch.cuda.synchronize()
    got = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        got.append((time.perf_counter() - t0) * 1e6 / iters)
        torch.cuda.synchronize()
    return statistics.median(got)


class Native:
    """Swap one native function for a recorder, a no-op, or back."""

    def __init__(self, name):
        self.name, self.real = name, getattr(_native, name)
        self.kwargs = None

    def record(self, fn):
        def rec(**kw):
            self.kwargs = kw
            return self.real(**kw)

        setattr(_native, self.name, rec)
        fn()
        setattr(_native, self.name, self.real)
        torch.cuda.synchronize()

    def stubbed(self, fn, iters):
        setattr(_native, self.name, lambda **kw: None)
        try:
            return per_call_us(fn, iters)
        finally:
            setattr(_native, self.name, self.real)

    def alone(self, iters):
        kw = self.kwargs
        return per_call_us(lambda: self.real(**kw), iters)


class AllocClock:
    calls, seconds = 0, 0.0

    def __call__(self, nbytes, device):
        t0 = time.perf_counter()
        r = _torch_ops._workspace(nbytes, device)
        AllocClock.seconds += time.perf_counter() - t0
        AllocClock.calls += 1
        return r


def cases(s):
    b, h, d, window = 1, 64, 512, 128
    p = s // 4
    _, idx = selection(b, s, p, 512, window)
    g = torch.Generator(device=DEV).manual_seed(1)
    q = (torch.randn(b, s, h, d, device=DEV, generator=g) * 0.5).bfloat16()
    kv = (torch.randn(b, s + p, d, device=DEV, generator=g) * 0.5).bfloat16()
    sinks = torch.randn(h, device=DEV, generator=g)
    plan = dk.plan_dsv4_sparse_indices(idx, s + p, "cuda")
    sc = d ** -0.5
    out, lse = _ops.sparse_attention(q, kv, sinks, idx, sc, "cuda", False, False, -1, "atomic", 2 << 30)
    dout = torch.randn_like(out)
    yield "sparse_attention fwd (plan)", "sparse_attention_fwd", lambda: _ops.sparse_attention(q, kv, sinks, None, sc, "cuda", False, False, plan._id, "atomic", 2 << 30)
    for impl in ("atomic", "deterministic"):
        yield f"sparse_attention bwd {impl} (plan)", "sparse_attention_bwd", \
            lambda impl=impl: _ops.sparse_attention_backward(q, kv, sinks, None, out, lse, dout, sc, "cuda", False, False, plan._id, impl, 2 << 30)
    hi, di = 64, 128
    qi = torch.randn(b, s, hi, di, device=DEV).bfloat16()
    kvi = torch.randn(b, p, di, device=DEV).bfloat16()
    w = torch.randn(b, s, hi, device=DEV)
    yield "indexer_scores", "indexer_scores", lambda: _ops.indexer_scores(qi, kvi, w, di ** -0.5, 4, 0, None, "cuda")
    yield "lightning_indexer", "lightning_indexer", lambda: _ops.lightning_indexer(qi, kvi, w, di ** -0.5, 4, 0, None, 512, "cuda")
    ti, _ = _ops.lightning_indexer(qi, kvi, w, di ** -0.5, 4, 0, None, 512, "cuda")
    gs = torch.randn(ti.shape, device=DEV)
    yield "indexer_topk_scores fwd", "indexer_topk_scores", lambda: _ops.indexer_topk_scores(qi, kvi, w, ti, di ** -0.5, 4, 0, None, "cuda")
    yield "indexer_topk_scores bwd", "indexer_topk_scores_bwd", lambda: _ops.indexer_topk_scores_backward(qi, kvi, w, ti, gs, di ** -0.5, 4, 0, None, "cuda", False)
    x = torch.randn(65536, 4, 4, device=DEV)
    yield "sinkhorn fwd", "sinkhorn_fwd", lambda: _ops.sinkhorn(x, 20, 1e-6, "cuda")
    yield "sinkhorn bwd", "sinkhorn_bwd", lambda: _ops.sinkhorn_backward(x, x, 20, 1e-6, "cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, S={a.s}: host us per call")
    print(f"{'op':36} {'full':>7} {'python':>7} {'native':>7} {'drv-alloc':>9} {'allocs':>6} {'alloc us':>8}")
    bwd_fn = None
    for name, native_name, fn in cases(a.s):
        if not hasattr(_native, native_name):
            print(f"{name:36} (no native `{native_name}`)")
            continue
        nat = Native(native_name)
        full = per_call_us(fn, a.iters)
        py = nat.stubbed(fn, a.iters)
        nat.record(fn)
        alone = nat.alone(a.iters)
        AllocClock.calls, AllocClock.seconds = 0, 0.0
        _native.set_workspace_allocator(AllocClock())
        n = 3 * a.iters
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        allocs, alloc_us = AllocClock.calls / n, AllocClock.seconds * 1e6 / n
        _native.set_workspace_allocator(None)
        drv = nat.alone(a.iters)
        _native.set_workspace_allocator(_torch_ops._workspace)
        print(f"{name:36} {full:7.1f} {py:7.1f} {alone:7.1f} {drv:9.1f} {allocs:6.1f} {alloc_us:8.1f}")
        if name.startswith("sparse_attention bwd atomic"):
            bwd_fn = fn
    sys.stdout.flush()
    if bwd_fn is not None:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            bwd_fn()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
