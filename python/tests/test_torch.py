"""torch (CPU): autograd through the dsv4 custom ops against torch autograd of
seeds-style references, gradcheck, opcheck, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import dsv4_kernels as dk  # noqa: E402
from dsv4_kernels import ops  # noqa: E402

from torch_refs import indexer_topk_scores_ref, qnorm_rope_ref, sinkhorn_ref, sparse_attention_ref  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()


def attention_case(b=2, s=5, h=3, d=16, k=11, t=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, s, h, d, generator=g) * 0.5).to(dtype)
    kv = (torch.randn(b, k, d, generator=g) * 0.5).to(dtype)
    sinks = torch.randn(h, generator=g)
    idx = torch.randint(-1, k + 2, (b, s, t), generator=g, dtype=torch.int32)
    idx[0, min(1, s - 1)] = -1  # an empty row
    idx[b - 1, min(2, s - 1), :3] = min(4, k - 1)  # a duplicated key
    return q, kv, sinks, idx


# -- sparse attention --------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["atomic", "deterministic"])
def test_sparse_attention_autograd_matches_reference(impl):
    q, kv, sinks, idx = attention_case()
    scale = 16 ** -0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
    out = dk.dsv4_sparse_attention(*leaves, idx, scale, "torch", backward_impl=impl)
    go = torch.randn_like(out)
    out.backward(go)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, kv, sinks)]
    ref = sparse_attention_ref(*ref_leaves, idx, scale)
    ref = torch.nan_to_num(ref)  # the empty row: 0
    ref.backward(go.double())
    assert rel(out, ref) < 1e-5
    assert (out[0, 1] == 0).all()
    for got, want, name in zip(leaves, ref_leaves, ("q", "kv", "sinks")):
        assert rel(got.grad, torch.nan_to_num(want.grad)) < 1e-4, name


def test_sparse_attention_bf16_and_only_needed_grads():
    q, kv, sinks, idx = attention_case(dtype=torch.bfloat16)
    qg = q.clone().requires_grad_(True)
    out = dk.dsv4_sparse_attention(qg, kv, sinks, idx, 0.25, "torch")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    out.float().square().sum().backward()
    assert qg.grad is not None and qg.grad.dtype == torch.bfloat16
    ref = torch.nan_to_num(sparse_attention_ref(q.double(), kv.double(), sinks.double(), idx, 0.25))
    assert rel(out, ref) < 1e-2


def test_sparse_attention_deterministic_is_bitwise_repeatable():
    q, kv, sinks, idx = attention_case(seed=3)
    grads = []
    for _ in range(2):
        kvg = kv.clone().requires_grad_(True)
        dk.dsv4_sparse_attention(q, kvg, sinks, idx, 0.25, "torch", backward_impl="deterministic").sum().backward()
        grads.append(kvg.grad)
    assert torch.equal(grads[0], grads[1])


def test_sparse_attention_plan_autograd():
    q, kv, sinks, idx = attention_case()
    plan = dk.plan_dsv4_sparse_indices(idx, kv.shape[1], "torch")
    assert isinstance(plan.indices, torch.Tensor) and plan.indices.dtype == torch.int32
    a = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
    b = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
    dk.dsv4_sparse_attention(*a, idx, 0.25, "torch").sum().backward()
    dk.dsv4_sparse_attention(*b, None, 0.25, "torch", plan=plan).sum().backward()
    for x, y in zip(a, b):
        assert rel(y.grad, x.grad) < 1e-5


def test_dense_oracle_collapses_duplicates():
    q, kv, sinks, idx = attention_case()
    idx[0, 0] = torch.arange(idx.shape[2], dtype=torch.int32)  # a row of distinct keys
    dense = dk.dense_attention_topk_torch(q, kv, sinks, idx, 0.25)
    sparse = dk.sparse_attention_torch(q, kv, sinks, idx, 0.25)
    assert not torch.allclose(dense[1, 2], sparse[1, 2])  # the row with a duplicated key
    assert torch.allclose(dense[0, 0], sparse[0, 0], atol=1e-6)


def test_sparse_attention_gradcheck():
    q, kv, sinks, idx = attention_case(b=1, s=3, h=2, d=4, k=5, t=4)
    fn = lambda q, kv, sinks: dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.5, "torch")  # noqa: E731
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, kv, sinks))
    with pytest.warns(UserWarning):  # gradcheck warns about f32 inputs: the kernels compute in f32
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-2, atol=5e-3, rtol=5e-2)


def test_sbhd_views_are_not_copied():
    q, kv, sinks, idx = attention_case()
    q_sbhd = q.transpose(0, 1).contiguous()
    view = q_sbhd.transpose(0, 1)
    assert not view.is_contiguous() and view.data_ptr() == q_sbhd.data_ptr()
    assert torch.equal(dk.dsv4_sparse_attention(view, kv, sinks, idx, 0.25, "torch"), dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch"))


def test_torch_errors_name_the_argument():
    q, kv, sinks, idx = attention_case()
    with pytest.raises(TypeError, match="`kv`"):
        dk.dsv4_sparse_attention(q, kv.bfloat16(), sinks, idx, 0.25, "torch")
    with pytest.raises(TypeError, match="`q`"):
        dk.dsv4_sparse_attention(q.half(), kv.half(), sinks, idx, 0.25, "torch")
    with pytest.raises(ValueError, match="`sinks`"):
        dk.dsv4_sparse_attention(q, kv, sinks[:1], idx, 0.25, "torch")
    with pytest.raises(RuntimeError, match="cuda"):
        dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "cuda")


def test_out_from_torch_allocator_and_user_out():
    q, kv, sinks, idx = attention_case()
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(q.shape[:3])
    o, _ = ops.sparse_attention_forward(q, kv, sinks, idx, 0.25, "reference", out=out, lse=lse)
    assert o is out and torch.isfinite(out).all()


# -- indexer -----------------------------------------------------------------------------


def indexer_case(b=2, s=12, h=4, d=16, p=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    kv = torch.randn(b, p, d, generator=g).to(dtype)
    w = torch.randn(b, s, h, generator=g) * h ** -0.5
    return q, kv, w


def test_indexer_topk_scores_autograd_matches_reference():
    q, kv, w = indexer_case()
    idx = torch.randint(-1, 3, (2, 12, 3), dtype=torch.int32)
    a = [t.clone().requires_grad_(True) for t in (q, kv, w)]
    got = dk.dsv4_indexer_topk_scores(*a, idx, 4, 0.25, "torch")
    r = [t.double().requires_grad_(True) for t in (q, kv, w)]
    want = indexer_topk_scores_ref(*r, idx, 0.25, 4)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    g = torch.randn_like(got).masked_fill(torch.isinf(got), 0.0)
    got.backward(g)
    want.backward(g.double(), inputs=r)
    for x, y, name in zip(a, r, ("q", "pooled_kv", "weights")):
        assert rel(x.grad, y.grad) < 1e-4, name


def test_indexer_scores_are_differentiable_and_causal():
    q, kv, w = indexer_case()
    a = [t.clone().requires_grad_(True) for t in (q, kv, w)]
    s = dk.dsv4_indexer_scores(*a, 4, 0.25, "torch")
    p = kv.shape[1]
    every = torch.arange(p, dtype=torch.int32).expand(2, 12, p)
    r = [t.double().requires_grad_(True) for t in (q, kv, w)]
    want = indexer_topk_scores_ref(*r, every, 0.25, 4)
    assert torch.equal(torch.isinf(s), torch.isinf(want)) and rel(s, want) < 1e-5
    g = torch.randn_like(s).masked_fill(torch.isinf(s), 0.0)
    s.backward(g)
    want.backward(g.double(), inputs=r)
    for x, y in zip(a, r):
        assert rel(x.grad, y.grad) < 1e-4
    unmasked = dk.indexer_scores_torch(q, kv, w, 0.25)
    assert torch.isfinite(unmasked).all()


def test_v4_indexer_function_forward_backward():
    q, kv, w = indexer_case(b=1, s=16, h=4, d=16, p=4, dtype=torch.bfloat16)
    q_sbhd = q.transpose(0, 1).contiguous().requires_grad_(True)
    k_sbd = kv.transpose(0, 1).contiguous().requires_grad_(True)
    w_sbh = w.transpose(0, 1).contiguous().requires_grad_(True)
    scores, idx = dk.v4_lighting_indexer(q_sbhd, k_sbd, w_sbh, 4, 2)
    assert scores.shape == (1, 16, 2) and scores.dtype == torch.float32 and idx.dtype == torch.int32
    full = indexer_topk_scores_ref(q.double(), kv.double(), w.double(), torch.arange(4, dtype=torch.int32).expand(1, 16, 4), 1.0, 4)
    top = full.topk(2, dim=-1)
    want_idx = torch.where(torch.isinf(top.values), -1, top.indices)
    assert torch.equal(idx.sort(-1).values, want_idx.sort(-1).values.int())
    g = torch.randn_like(scores).masked_fill(torch.isinf(scores), 0.0)
    scores.backward(g)
    r = [t.double().requires_grad_(True) for t in (q, kv, w)]
    indexer_topk_scores_ref(*r, idx, 1.0, 4).backward(g.double(), inputs=r)
    assert q_sbhd.grad.dtype == torch.bfloat16 and k_sbd.grad.dtype == torch.bfloat16
    assert rel(q_sbhd.grad.transpose(0, 1), r[0].grad) < 1e-2
    assert rel(k_sbd.grad.transpose(0, 1), r[1].grad) < 1e-2
    assert rel(w_sbh.grad.transpose(0, 1), r[2].grad) < 5e-3
    # With the selection given.
    s2, i2 = dk.V4IndexerFunction.apply(q_sbhd.detach(), k_sbd.detach(), w_sbh.detach(), 4, 2, idx)
    assert torch.equal(i2, idx) and torch.allclose(s2, scores.detach())


def test_indexer_bwd_interface_shapes_and_dtypes():
    q, kv, w = indexer_case(b=1, dtype=torch.bfloat16)
    idx = torch.randint(-1, 3, (1, 12, 3), dtype=torch.int32)
    g = torch.randn(1, 12, 3)
    gq, gw, gk = dk.indexer_bwd_interface(q[0], w[0], kv[0], idx[0], g[0])
    assert gq.shape == q[0].shape and gq.dtype == torch.bfloat16
    assert gw.shape == w[0].shape and gw.dtype == torch.float32
    assert gk.shape == kv[0].shape and gk.dtype == torch.float32
    bq, bw, bk = dk.batched_indexer_bwd(q.transpose(0, 1), w.transpose(0, 1), kv.transpose(0, 1), idx, g)
    assert torch.equal(bq[:, 0], gq) and torch.equal(bw[:, 0], gw) and torch.equal(bk[:, 0], gk)


# -- Sinkhorn, qnorm_rope ----------------------------------------------------------------


def test_sinkhorn_autograd_with_strided_grad():
    x = torch.randn(6, 4, 4, requires_grad=True)
    y = dk.dsv4_sinkhorn_normalize(x, "torch", 20, 1e-6)
    g = torch.randn(6, 4, 4).transpose(-1, -2)  # non-contiguous, as from a transposed matmul
    y.backward(g)
    xr = x.detach().double().requires_grad_(True)
    yr = sinkhorn_ref(xr, 20, 1e-6)
    yr.backward(g.double())
    assert rel(y, yr) < 1e-5 and rel(x.grad, xr.grad) < 1e-4


def test_sinkhorn_gradcheck():
    x = torch.randn(2, 4, 4, requires_grad=True)
    with pytest.warns(UserWarning):
        assert torch.autograd.gradcheck(lambda x: dk.dsv4_sinkhorn_normalize(x, "torch", 3, 1e-6), (x,), eps=1e-2, atol=5e-3, rtol=5e-2)


def test_qnorm_rope_matches_composite_and_is_token_major():
    b, h, s, c, r = 2, 3, 5, 32, 8
    base = torch.randn(b, s, h, c).bfloat16()
    x = base.transpose(1, 2).requires_grad_(True)
    ang = torch.rand(b, s, r // 2) * 6.28
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    y = dk.qnorm_rope_triton(x, cos, sin, r, 1e-6)
    assert y.shape == (b, h, s, c) and y.dtype == torch.bfloat16 and y.transpose(1, 2).is_contiguous()
    xr = x.detach().clone().requires_grad_(True)
    yr = qnorm_rope_ref(xr, cos, sin, r, 1e-6)
    assert rel(y, yr) < 1e-2
    g = torch.randn(b, h, s, c).bfloat16()
    y.backward(g)
    yr.backward(g)
    assert x.grad.dtype == torch.bfloat16 and rel(x.grad, xr.grad) < 2e-2
    assert dk.qnorm_rope is dk.qnorm_rope_triton


def test_build_indices_torch():
    got = dk.build_dsv4_sparse_topk_indices(2, 6, 6 + 2, 3, torch.device("cpu"), compress_ratio=4, n_pooled=2)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int32 and got.shape == (2, 6, 5)
    ct = torch.tensor([[[1, -1]] * 6] * 2)  # int64, as torch.topk gives
    got2 = dk.build_dsv4_sparse_topk_indices(2, 6, 8, 3, "cpu", compress_ratio=4, compressed_topk=ct, n_pooled=2)
    assert got2.shape == (2, 6, 5) and (got2[..., 3] == 7).all() and (got2[..., 4] == -1).all()


# -- custom-op registration and torch.compile ---------------------------------------------


def test_opcheck_custom_ops():
    q, kv, sinks, idx = attention_case(b=1, s=3, h=2, d=8, k=5, t=4)
    torch.library.opcheck(torch.ops.dsv4.sparse_attention.default, (q.requires_grad_(True), kv, sinks, idx, 0.3, "torch", False, False, -1, "atomic", 2 ** 31))
    x = torch.randn(3, 4, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.dsv4.sinkhorn.default, (x, 4, 1e-6, "torch"))
    qi, kvi, wi = indexer_case(b=1, s=8, p=2)
    ti = torch.randint(-1, 2, (1, 8, 2), dtype=torch.int32)
    torch.library.opcheck(torch.ops.dsv4.indexer_topk_scores.default, (qi.requires_grad_(True), kvi, wi, ti, 0.5, 4, 0, None, "torch"))
    torch.library.opcheck(torch.ops.dsv4.lightning_indexer.default, (qi.detach(), kvi, wi, 0.5, 4, 0, None, 2, "torch"))
    xq = torch.randn(1, 5, 2, 16).bfloat16().transpose(1, 2).requires_grad_(True)
    cs = torch.rand(1, 5, 8)
    torch.library.opcheck(torch.ops.dsv4.qnorm_rope.default, (xq, cs, cs, 8, 1e-6, "torch"))


def test_torch_compile_fullgraph():
    q, kv, sinks, idx = attention_case(b=1, s=6, h=2, d=8, k=9, t=5)
    x = torch.randn(3, 4, 4)
    qi, kvi, wi = indexer_case(b=1, s=8, h=2, d=8, p=2)

    def layer(q, kv, sinks, x, qi, kvi, wi):
        a = dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.3, "torch")
        m = dk.dsv4_sinkhorn_normalize(x, "torch", 5, 1e-6)
        scores, sel = dk.v4_lighting_indexer(qi.transpose(0, 1), kvi.transpose(0, 1), wi.transpose(0, 1), 4, 2)
        y = dk.qnorm_rope_triton(q.transpose(1, 2), torch.ones(1, 6, 4), torch.zeros(1, 6, 4), 4, 1e-6)
        return a.sum() + m.sum() + torch.where(torch.isfinite(scores), scores, 0).sum() + y.float().sum()

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, kv, sinks, x, qi, kvi, wi)]
        loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    l0, g0 = run(layer)
    l1, g1 = run(compiled)
    assert torch.allclose(l0, l1)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b)
