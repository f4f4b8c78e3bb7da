"""CUDA graphs: every op, forward and backward, captured with ``torch.cuda.graph`` and
replayed gives the eager results (bitwise where the op is deterministic), and
``torch.compile(mode="reduce-overhead", fullgraph=True)`` of a step that calls attention,
the indexer, Sinkhorn and qnorm_rope forward and backward runs and matches eager.

Capture needs every call to be free of host synchronisation and of driver allocations:
the kernels take their workspaces from torch's caching allocator (the graph's private
pool while capturing). Runs only where torch sees a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import dsv4_kernels as dk  # noqa: E402
from dsv4_kernels.bench import selection  # noqa: E402
from torch_refs import rel  # noqa: E402

DEV = "cuda"


def graphed(step, inputs):
    """Eager results of ``step(*leaves)`` (forward and, when it returns a loss, backward) and
    the results of a CUDA-graph replay of the same step on the same input values."""

    def run(leaves):
        out = step(*leaves)
        loss = out if out.dim() == 0 else None
        if loss is not None:
            loss.backward()
        return out, [t.grad for t in leaves if t.requires_grad]

    def fresh():
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]

    eager_out, eager_grads = run(fresh())
    static = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile and load the kernels, fill the caches
            for t in static:
                t.grad = None
            run(static)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, grads = run(static)
    # Replay on new values written into the static inputs, then the original values again.
    originals = [t.detach().clone() for t in static]
    with torch.no_grad():
        for t in static:
            if t.is_floating_point():
                t.mul_(0.5)
    g.replay()
    with torch.no_grad():
        for t, o in zip(static, originals):
            t.copy_(o)
    g.replay()
    torch.cuda.synchronize()
    return (eager_out, eager_grads), (out, grads)


def attention_case(s=512, h=64, d=512):
    p = s // 4
    gen = torch.Generator(device=DEV).manual_seed(1)
    q = (torch.randn(1, s, h, d, device=DEV, generator=gen) * 0.5).bfloat16().requires_grad_(True)
    kv = (torch.randn(1, s + p, d, device=DEV, generator=gen) * 0.5).bfloat16().requires_grad_(True)
    sinks = torch.randn(h, device=DEV, generator=gen).requires_grad_(True)
    _, idx = selection(1, s, p, 512, 128, seed=1)
    return q, kv, sinks, idx


@pytest.mark.parametrize("impl", ["atomic", "deterministic"])
def test_graph_sparse_attention(impl):
    q, kv, sinks, idx = attention_case()
    go = torch.randn(q.shape, device=DEV).bfloat16()

    def step(q, kv, sinks):
        out = dk.dsv4_sparse_attention(q, kv, sinks, idx, q.shape[-1] ** -0.5, "cuda", backward_impl=impl)
        return (out.float() * go.float()).sum()

    (eo, eg), (go_, gg) = graphed(step, [q, kv, sinks])
    assert torch.allclose(go_, eo, rtol=1e-3, atol=1e-2)
    for a, b in zip(gg, eg):
        if impl == "deterministic":
            assert torch.equal(a, b), "replay is not bitwise the eager deterministic backward"
        else:
            assert rel(a, b) <= 1e-3


def test_graph_index_builder():
    q, kv, sinks, idx = attention_case()
    s, p = q.shape[1], kv.shape[1] - q.shape[1]
    ct = idx[..., 128:].clone()
    g = torch.cuda.CUDAGraph()
    args = dict(batch_size=1, seq_len=s, key_len=s + p, window_size=128, device=DEV, compress_ratio=4, compressed_topk=ct, n_pooled=p)
    dk.build_dsv4_sparse_topk_indices(**args)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        got = dk.build_dsv4_sparse_topk_indices(**args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, dk.build_dsv4_sparse_topk_indices(**args))


def indexer_case(s=1024, h=64, d=128):
    p = s // 4
    gen = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(1, s, h, d, device=DEV, generator=gen).bfloat16().requires_grad_(True)
    k = torch.randn(1, p, d, device=DEV, generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(1, s, h, device=DEV, generator=gen) * h ** -0.5).requires_grad_(True)
    return q, k, w


def test_graph_indexer_scores_and_topk():
    q, k, w = indexer_case()
    scale = q.shape[-1] ** -0.5

    def scores(q, k, w):
        return dk.dsv4_indexer_scores(q, k, w, 4, scale, "cuda")

    (eo, _), (go_, _) = graphed(scores, [q.detach(), k.detach(), w.detach()])
    assert torch.equal(go_, eo)

    def lightning(q, k, w):
        sc, idx = dk.v4_lighting_indexer(q.transpose(0, 1), k.transpose(0, 1), (w * scale).transpose(0, 1), 4, 512)
        return sc

    (eo, _), (go_, _) = graphed(lightning, [q.detach(), k.detach(), w.detach()])
    assert torch.equal(go_, eo)


def test_graph_indexer_topk_scores_backward():
    q, k, w = indexer_case()
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        _, idx = dk.v4_lighting_indexer(q.transpose(0, 1), k.transpose(0, 1), (w * scale).transpose(0, 1), 4, 512)
    gsc = torch.randn(idx.shape, device=DEV)

    def step(q, k, w):
        sc = dk.dsv4_indexer_topk_scores(q, k, w, idx, 4, scale, "cuda")
        return torch.where(torch.isfinite(sc), sc * gsc, torch.zeros_like(sc)).sum()

    (eo, eg), (go_, gg) = graphed(step, [q, k, w])
    assert torch.allclose(go_, eo, rtol=1e-5)
    for a, b in zip(gg, eg):
        assert rel(a, b) <= 1e-3


def test_graph_sinkhorn():
    x = torch.randn(4096, 4, 4, device=DEV, requires_grad=True)
    gy = torch.randn(4096, 4, 4, device=DEV)

    def step(x):
        return (dk.dsv4_sinkhorn_normalize(x, "cuda", 20, 1e-6) * gy).sum()

    (eo, eg), (go_, gg) = graphed(step, [x])
    assert torch.equal(go_, eo) and torch.equal(gg[0], eg[0])


def test_graph_qnorm_rope():
    b, s, h, c, r = 1, 512, 64, 512, 64
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(b, s, h, c, device=DEV, generator=gen).bfloat16().transpose(1, 2).requires_grad_(True)
    ang = torch.rand(b, s, r // 2, device=DEV, generator=gen) * 6.28
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    gy = torch.randn(b, h, s, c, device=DEV, generator=gen)

    def step(x):
        return (dk.qnorm_rope_triton(x, cos, sin, r, 1e-6).float() * gy).sum()

    (eo, eg), (go_, gg) = graphed(step, [x])
    assert torch.allclose(go_, eo, rtol=1e-5) and torch.equal(gg[0], eg[0])


def test_reduce_overhead_compile_step():
    """torch.compile(mode="reduce-overhead", fullgraph=True): attention, indexer top-k scores,
    Sinkhorn and qnorm_rope forward and backward in one compiled step, CUDA-graphed."""
    q, kv, sinks, idx = attention_case(s=256)
    iq, ik, iw = indexer_case(s=256)
    scale = iq.shape[-1] ** -0.5
    with torch.no_grad():
        _, iidx = dk.v4_lighting_indexer(iq.transpose(0, 1), ik.transpose(0, 1), (iw * scale).transpose(0, 1), 4, 64)
    x = torch.randn(1024, 4, 4, device=DEV, requires_grad=True)
    ang = torch.rand(1, 256, 32, device=DEV) * 6.28
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    xr = torch.randn(1, 256, 64, 512, device=DEV).bfloat16().transpose(1, 2).requires_grad_(True)

    def step(q, kv, sinks, iq, ik, iw, x, xr):
        a = dk.dsv4_sparse_attention(q, kv, sinks, idx, q.shape[-1] ** -0.5, "cuda")
        sc = dk.dsv4_indexer_topk_scores(iq, ik, iw, iidx, 4, scale, "cuda")
        m = dk.dsv4_sinkhorn_normalize(x, "cuda", 20, 1e-6)
        y = dk.qnorm_rope_triton(xr, cos, sin, 64, 1e-6)
        return a.float().square().mean() + torch.where(torch.isfinite(sc), sc, 0).square().mean() + (m * m).sum() + y.float().square().mean()

    leaves0 = [q, kv, sinks, iq, ik, iw, x, xr]

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in leaves0]
        loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    l0, g0 = run(step)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # record, then replays
        l1, g1 = run(compiled)
    assert torch.allclose(l0, l1, rtol=1e-4)
    for a, b in zip(g0, g1):
        assert rel(b, a) <= 1e-3
