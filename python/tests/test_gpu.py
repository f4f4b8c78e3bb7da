"""CUDA: backend="cuda" against torch references at DeepSeek-V4 shapes (attention H=64,
D=512, 640 slots; indexer H=64, D=128), forward and backward, on torch's current stream,
and a torch.compile(fullgraph=True) run. Runs only where torch sees a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import dsv4_kernels as dk  # noqa: E402
from dsv4_kernels import ops  # noqa: E402
from dsv4_kernels.bench import selection  # noqa: E402

from torch_refs import indexer_topk_scores_ref, qnorm_rope_ref, rel, sinkhorn_ref, sparse_attention_ref  # noqa: E402

DEV = "cuda"


def make_topk(b, s, p, t_c, window):
    """The anchors' selection: random causal indexer top-k, then window + compressed slots."""
    _, idx = selection(b, s, p, t_c, window)
    assert idx.dtype == torch.int32 and idx.device.type == "cuda" and idx.shape == (b, s, window + min(t_c, p))
    return idx


def attention_inputs(s=2048, h=64, d=512, b=1):
    p = s // 4
    torch.manual_seed(0)
    q = (torch.randn(b, s, h, d, device=DEV) * 0.5).bfloat16()
    kv = (torch.randn(b, s + p, d, device=DEV) * 0.5).bfloat16()
    sinks = torch.randn(h, device=DEV)
    idx = make_topk(b, s, p, 512, 128)  # 640 slots
    return q, kv, sinks, idx


def attention_ref(q, kv, sinks, idx, scale, go, chunk=256):
    """f32 reference out and grads, computed in query chunks (memory)."""
    outs, dqs = [], []
    kv32 = kv.float().requires_grad_(True)
    sinks32 = sinks.clone().requires_grad_(True)
    for a in range(0, q.shape[1], chunk):
        qc = q[:, a:a + chunk].float().requires_grad_(True)
        o = torch.nan_to_num(sparse_attention_ref(qc, kv32, sinks32, idx[:, a:a + chunk], scale))
        o.backward(go[:, a:a + chunk].float())
        outs.append(o.detach())
        dqs.append(qc.grad)
    return torch.cat(outs, 1), torch.cat(dqs, 1), kv32.grad, sinks32.grad


@pytest.mark.parametrize("impl", ["atomic", "deterministic"])
def test_sparse_attention_dsv4_shapes(impl):
    q, kv, sinks, idx = attention_inputs()
    scale = q.shape[-1] ** -0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
    out = dk.dsv4_sparse_attention(*leaves, idx, scale, "cuda", backward_impl=impl)
    go = torch.randn_like(out)
    out.backward(go)
    ref_out, ref_dq, ref_dkv, ref_dsinks = attention_ref(q, kv, sinks, idx, scale, go)
    assert out.dtype == torch.bfloat16
    assert rel(out, ref_out) <= 1e-2
    assert rel(leaves[0].grad, ref_dq) <= 1e-2
    assert rel(leaves[1].grad, ref_dkv) <= 5e-3
    assert rel(leaves[2].grad, ref_dsinks) <= 5e-3
    if impl == "deterministic":
        again = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
        dk.dsv4_sparse_attention(*again, idx, scale, "cuda", backward_impl=impl).backward(go)
        assert torch.equal(again[1].grad, leaves[1].grad) and torch.equal(again[0].grad, leaves[0].grad)


def test_sparse_attention_plan_and_reference_agree():
    q, kv, sinks, idx = attention_inputs(s=256)
    scale = q.shape[-1] ** -0.5
    plan = dk.plan_dsv4_sparse_indices(idx, kv.shape[1], "cuda")
    assert plan.backend == "cuda"
    a = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "cuda")
    b = dk.dsv4_sparse_attention(q, kv, sinks, None, scale, "cuda", plan=plan)
    c = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "torch")  # the torch composite, on the GPU
    d = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "auto")
    assert c.device.type == "cuda"
    for x in (b, c, d):
        assert rel(x, a) <= 1e-2


def test_sparse_attention_on_a_side_stream():
    q, kv, sinks, idx = attention_inputs(s=256)
    scale = q.shape[-1] ** -0.5
    want = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "cuda")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def indexer_inputs(s=2048, h=64, d=128, b=1):
    p = s // 4
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device=DEV).bfloat16()
    k = torch.randn(b, p, d, device=DEV).bfloat16()
    w = torch.randn(b, s, h, device=DEV) * h ** -0.5
    return q, k, w


def test_indexer_dsv4_shapes():
    q, k, w = indexer_inputs()
    scale = q.shape[-1] ** -0.5
    s, p = q.shape[1], k.shape[1]
    scores = dk.dsv4_indexer_scores(q, k, w, 4, scale, "cuda")
    every = torch.arange(p, dtype=torch.int32, device=DEV).expand(1, s, p)
    ref = indexer_topk_scores_ref(q.float(), k.float(), w, every, scale, 4)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), fin)
    row_scale = ref.masked_fill(~fin, 0).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert ((scores - ref).masked_fill(~fin, 0).abs() / row_scale).max().item() <= 1e-5
    # Fused top-k (V4 layout) selects the reference's set where scores have no ties.
    sc, idx = dk.v4_lighting_indexer(q.transpose(0, 1), k.transpose(0, 1), (w * scale).transpose(0, 1), 4, 512)
    top = ref.topk(512, dim=-1)
    want = torch.where(torch.isinf(top.values), -1, top.indices).sort(-1).values
    agree = (idx.long().sort(-1).values == want).float().mean().item()
    assert agree > 0.999, agree
    # topk scores forward + backward against the reference's autograd.
    leaves = [t.clone().requires_grad_(True) for t in (q, k, w)]
    got = dk.dsv4_indexer_topk_scores(*leaves, idx, 4, scale, "cuda")
    g = torch.randn_like(got).masked_fill(torch.isinf(got), 0.0)
    got.backward(g)
    r = [q.float().requires_grad_(True), k.float().requires_grad_(True), w.clone().requires_grad_(True)]
    want_s = indexer_topk_scores_ref(*r, idx, scale, 4)
    want_s.backward(g, inputs=r)
    assert rel(got, want_s) <= 1e-4
    assert rel(leaves[0].grad, r[0].grad) <= 1e-2
    assert rel(leaves[1].grad, r[1].grad) <= 1e-2  # bf16 pooled_kv gradient (f32 accumulated)
    assert rel(leaves[2].grad, r[2].grad) <= 5e-3


def test_sinkhorn_cuda():
    x = torch.randn(65536, 4, 4, device=DEV, requires_grad=True)
    y = dk.dsv4_sinkhorn_normalize(x, "cuda", 20, 1e-6)
    g = torch.randn(65536, 4, 4, device=DEV).transpose(-1, -2)
    y.backward(g)
    xr = x.detach().clone().requires_grad_(True)
    yr = sinkhorn_ref(xr, 20, 1e-6)
    yr.backward(g)
    assert (y - yr).abs().max().item() <= 1e-5
    assert rel(x.grad, xr.grad) <= 1e-4


def test_qnorm_rope_cuda():
    b, s, h, c, r = 1, 1024, 64, 512, 64
    torch.manual_seed(0)
    x = torch.randn(b, s, h, c, device=DEV).bfloat16().transpose(1, 2).requires_grad_(True)
    ang = torch.rand(b, s, r // 2, device=DEV) * 6.28
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    y = dk.qnorm_rope_triton(x, cos, sin, r, 1e-6)
    assert y.transpose(1, 2).is_contiguous() and y.dtype == torch.bfloat16
    xr = x.detach().clone().requires_grad_(True)
    yr = qnorm_rope_ref(xr, cos, sin, r, 1e-6)
    assert rel(y, yr) <= 1e-2
    g = torch.randn(b, h, s, c, device=DEV).bfloat16()
    y.backward(g)
    yr.backward(g)
    assert rel(x.grad, xr.grad) <= 2e-2
    # Against our CPU reference (the same two rounding boundaries): 1e-2 and close elementwise.
    out_ref, rstd_ref = ops.qnorm_rope_forward(x.detach(), cos, sin, r, 1e-6, "reference")
    assert rel(y, out_ref) <= 1e-2


def test_kernels_available():
    for name in ("sinkhorn", "sparse_attn", "indexer", "qnorm_rope"):
        assert dk.is_dsv4_kernel_available(name), name


def test_torch_compile_fullgraph_cuda():
    q, kv, sinks, idx = attention_inputs(s=256)
    scale = q.shape[-1] ** -0.5
    x = torch.randn(1024, 4, 4, device=DEV)

    def layer(q, kv, sinks, x):
        a = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "cuda")
        m = dk.dsv4_sinkhorn_normalize(x, "cuda", 20, 1e-6)
        return a.float().square().mean() + (m * m).sum()

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, kv, sinks, x)]
        loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    l0, g0 = run(layer)
    l1, g1 = run(torch.compile(layer, fullgraph=True))
    assert torch.allclose(l0, l1, rtol=1e-4)
    for a, b in zip(g0, g1):
        assert rel(b, a) <= 1e-3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    x = torch.randn(64, 4, 4, device="cuda:1")
    with torch.cuda.device(1):
        y = dk.dsv4_sinkhorn_normalize(x, "cuda", 20, 1e-6)
    assert y.device == x.device
    assert (y - sinkhorn_ref(x, 20, 1e-6)).abs().max().item() <= 1e-5
