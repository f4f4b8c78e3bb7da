"""The seeds' semantics where this package once differed (issue #39): top-k score gathers
that mask every out-of-range index, ``backend="torch"`` as torch code on the tensors' own
device (differentiable, the dense oracle too), the V4 indexer's ``min(topk, P)`` columns,
and ``is_dsv4_kernel_available``'s ValueError for an unknown name.

numpy-only tests run everywhere (CI); the torch ones skip without torch. No GPU needed:
torch code on the tensors' device is shown by making the native layer refuse every call
(``ops.run``, through which every kernel and CPU-reference call and its host copies go).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import dsv4_kernels as dk
from dsv4_kernels import ops
from dsv4_kernels.kernels import tilelang_indexer

RNG = np.random.default_rng(39)


def bf16ish(*shape):
    """f32 values that bf16 represents exactly (the reference takes them as bf16 inputs)."""
    x = RNG.standard_normal(shape).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


# -- 1. gathers of top-k scores: -inf for every index outside [0, P) ---------------------


@pytest.mark.parametrize("fn", [dk.extract_indexer_topk_scores_torch, tilelang_indexer.pytorch_extract_topk_scores], ids=["extract", "pytorch_extract"])
def test_gather_masks_indices_past_the_end_numpy(fn):
    logits = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    idx = np.array([[[0, 4, 5, -1], [7, 2, -3, 3], [5, 5, 1, 0]]] * 2, dtype=np.int32)
    got = fn(logits, idx)
    assert got.shape == idx.shape and got.dtype == np.float32
    valid = (idx >= 0) & (idx < 5)
    want = np.where(valid, np.take_along_axis(logits, np.where(valid, idx, 0), -1), -np.inf)
    np.testing.assert_array_equal(got, want)


def test_pytorch_extract_takes_dim_numpy():
    logits = RNG.standard_normal((4, 3)).astype(np.float32)  # gathered along dim 0 (size 4)
    idx = np.array([[0, 4, 3], [-1, 1, 9]])
    got = tilelang_indexer.pytorch_extract_topk_scores(logits, idx, dim=0)
    assert np.isneginf(got[0, 1]) and np.isneginf(got[1, 0]) and np.isneginf(got[1, 2])
    assert got[0, 0] == logits[0, 0] and got[0, 2] == logits[3, 2] and got[1, 1] == logits[1, 1]


def test_gather_from_an_empty_axis_is_all_masked_numpy():
    got = dk.extract_indexer_topk_scores_torch(np.zeros((1, 2, 0), np.float32), np.array([[[0, -1]] * 2]))
    assert got.shape == (1, 2, 2) and np.isneginf(got).all()


# -- 4. the V4 lightning indexer: min(topk, P) columns, as the seeds' torch.topk ----------


def test_v4_indexer_returns_min_topk_p_columns_numpy():
    s, p, h, d, r = 9, 3, 2, 8, 2
    q, k, w = bf16ish(s, 1, h, d), bf16ish(p, 1, d), RNG.standard_normal((s, 1, h)).astype(np.float32)
    scores, idx = dk.v4_lighting_indexer(q, k, w, r, 8)  # topk 8 > P 3
    assert scores.shape == (1, s, p) and idx.shape == (1, s, p) and idx.dtype == np.int32
    for si in range(s):
        vis = min((si + 1) // r, p)
        assert sorted(idx[0, si, :vis].tolist()) == list(range(vis)) and (idx[0, si, vis:] == -1).all()
        assert np.isfinite(scores[0, si, :vis]).all() and np.isneginf(scores[0, si, vis:]).all()
    scores2, idx2 = dk.v4_lighting_indexer(q, k, w, r, 2)  # topk 2 < P: 2 columns
    assert scores2.shape == (1, s, 2) and idx2.shape == (1, s, 2)
    given = np.full((1, s, 5), -1, np.int32)  # a given selection keeps its own width
    given[0, :, 0] = 0
    scores3, idx3 = dk.v4_lighting_indexer(q, k, w, r, 8, given)
    assert scores3.shape == (1, s, 5) and idx3 is given


# -- 5. is_dsv4_kernel_available ----------------------------------------------------------


def test_kernel_availability_rejects_unknown_names():
    for name in ("sinkhorn", "sparse_attn", "indexer", "qnorm_rope"):
        assert isinstance(dk.is_dsv4_kernel_available(name), bool)
    for name in ("unknown", "sparse_attention", "", "SINKHORN"):
        with pytest.raises(ValueError, match="Unknown DeepSeek V4 kernel name"):
            dk.is_dsv4_kernel_available(name)


# -- torch: 1 again, and 2 / 3 (backend="torch" is torch code where the tensors are) ------

torch_only = pytest.mark.skipif(dk.optimized_kernels.torch is None, reason="needs torch")


def _torch():
    return pytest.importorskip("torch")


@torch_only
def test_gather_masks_indices_past_the_end_torch():
    torch = _torch()
    logits = torch.randn(2, 3, 5)
    idx = torch.tensor([[[0, 4, 5, -1], [7, 2, -3, 3], [5, 5, 1, 0]]] * 2)
    valid = (idx >= 0) & (idx < 5)
    want = torch.where(valid, torch.gather(logits, -1, torch.where(valid, idx, 0)), float("-inf"))
    for fn in (dk.extract_indexer_topk_scores_torch, tilelang_indexer.pytorch_extract_topk_scores):
        got = fn(logits, idx.int())
        assert got.dtype == torch.float32 and torch.equal(got, want)
    got0 = tilelang_indexer.pytorch_extract_topk_scores(logits[0], torch.tensor([[0, 2, 1, 0, 2], [1, 3, -1, 2, 0]]), dim=0)
    assert torch.isneginf(got0[1, 1]) and torch.isneginf(got0[1, 2]) and got0[1, 3] == logits[0, 2, 3]


def _attention_case(torch, b=2, s=6, h=3, d=16, k=11, t=7, dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    q = (torch.randn(b, s, h, d, generator=g) * 0.5).to(dtype)
    kv = (torch.randn(b, k, d, generator=g) * 0.5).to(dtype)
    sinks = torch.randn(h, generator=g)
    idx = torch.randint(-3, k + 3, (b, s, t), generator=g, dtype=torch.int32)  # -3..-1 and >= K: masked
    idx[0, min(1, s - 1)] = -1  # an empty row
    idx[b - 1, min(2, s - 1), :3] = min(4, k - 1)  # a key named three times
    return q, kv, sinks, idx


def _indexer_case(torch, b=2, s=12, h=4, d=16, p=5, seed=0, dtype=None):
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    kv = torch.randn(b, p, d, generator=g).to(dtype)
    w = torch.randn(b, s, h, generator=g) * h ** -0.5
    return q, kv, w


def _torch_backend_calls(torch):
    """Every torch-backend entry point as ``(name, call(inputs), output dtype)``: the dtype
    is ``"f32"`` or the name of the input whose dtype the output keeps."""
    return [
        ("dsv4_sparse_attention", lambda a: dk.dsv4_sparse_attention(a["q"], a["kv"], a["sinks"], a["idx"], 0.25, "torch"), "q"),
        ("dsv4_sparse_attention sparse_torch", lambda a: dk.dsv4_sparse_attention(a["q"], a["kv"], a["sinks"], a["idx"], 0.25, backend="sparse_torch"), "q"),
        ("sparse_attention_torch", lambda a: dk.sparse_attention_torch(a["q"], a["kv"], a["sinks"], a["idx"], 0.25), "q"),
        ("dense_attention_topk_torch", lambda a: dk.dense_attention_topk_torch(a["q"], a["kv"], a["sinks"], a["idx"], 0.25), "q"),
        ("dsv4_indexer_scores", lambda a: dk.dsv4_indexer_scores(a["qi"], a["kvi"], a["wi"], compress_ratio=4, softmax_scale=0.25, backend="torch"), "f32"),
        ("indexer_scores_torch", lambda a: dk.indexer_scores_torch(a["qi"], a["kvi"], a["wi"], 0.25), "f32"),
        ("dsv4_indexer_topk_scores", lambda a: dk.dsv4_indexer_topk_scores(a["qi"], a["kvi"], a["wi"], a["ti"], compress_ratio=4, softmax_scale=0.25, backend="torch"), "f32"),
        ("dsv4_sinkhorn_normalize", lambda a: dk.dsv4_sinkhorn_normalize(a["x"], backend="torch", repeat=5, eps=1e-6), "x"),
        ("sinkhorn_normalize_torch", lambda a: dk.sinkhorn_normalize_torch(a["x"], repeat=5, eps=1e-6), "x"),
        ("extract_indexer_topk_scores_torch", lambda a: dk.extract_indexer_topk_scores_torch(a["x"][..., 0, :], a["ti"][:, :4, :2]), "x"),
    ]


def _inputs(torch, dtype=None):
    q, kv, sinks, idx = _attention_case(torch, dtype=dtype)
    qi, kvi, wi = _indexer_case(torch, dtype=dtype)
    ti = torch.randint(-1, 7, (2, 12, 3), dtype=torch.int32)
    x = torch.randn(2, 4, 4, 4)
    return dict(q=q, kv=kv, sinks=sinks, idx=idx, qi=qi, kvi=kvi, wi=wi, ti=ti, x=x)


@torch_only
def test_torch_backend_dtypes_on_the_tensors_device():
    """Results stay on the inputs' device (``meta`` here: shapes without memory) in the
    seeds' dtypes: attention in q's, indexer scores f32, Sinkhorn in x's."""
    torch = _torch()
    for dtype in (torch.float32, torch.bfloat16):
        a = _inputs(torch, dtype)
        m = {k: v.to("meta") for k, v in a.items()}
        for name, call, out_like in _torch_backend_calls(torch):
            got = call(m)
            assert got.device.type == "meta", name
            want_dtype = torch.float32 if out_like == "f32" else m[out_like].dtype
            assert got.dtype == want_dtype, (name, got.dtype)


@torch_only
def test_torch_backend_makes_no_native_call(monkeypatch):
    """Every native call (kernel or CPU reference, with its host copies) goes through
    ``ops.run``: with it refusing, ``backend="torch"`` still answers, so it ran torch code."""
    torch = _torch()

    def refuse(*args, **kwargs):
        raise AssertionError("backend='torch' on torch tensors reached the native layer")

    monkeypatch.setattr(ops, "run", refuse)
    a = _inputs(torch)
    for name, call, _ in _torch_backend_calls(torch):
        assert torch.isfinite(call(a)).any(), name
    # backend="reference" stays this project's exact CPU reference.
    with pytest.raises(AssertionError, match="native layer"):
        dk.dsv4_sparse_attention(a["q"], a["kv"], a["sinks"], a["idx"], 0.25, "reference")


@torch_only
def test_torch_backend_matches_the_reference_backend():
    """The torch composites and this project's CPU reference compute the same contract."""
    torch = _torch()
    a = _inputs(torch)
    q, kv, sinks, idx = a["q"], a["kv"], a["sinks"], a["idx"]
    for fn in (lambda be: dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, be), lambda be: dk.dense_attention_topk_torch(q, kv, sinks, idx, 0.25) if be == "torch" else ops.dense_attention(q, kv, sinks, idx, 0.25, be)):
        got, want = fn("torch"), fn("reference")
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch")[0, 1] == 0).all()  # the empty row
    qi, kvi, wi, ti = a["qi"], a["kvi"], a["wi"], a["ti"]
    for be_q in (0, 3):
        got = dk.dsv4_indexer_scores(qi, kvi, wi, 4, 0.25, "torch", query_start=be_q, query_total_len=12 + be_q)
        want = dk.dsv4_indexer_scores(qi, kvi, wi, 4, 0.25, "reference", query_start=be_q, query_total_len=12 + be_q)
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    got = dk.dsv4_indexer_topk_scores(qi, kvi, wi, ti, 4, 0.25, "torch")
    want = dk.dsv4_indexer_topk_scores(qi, kvi, wi, ti, 4, 0.25, "reference")
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(dk.indexer_scores_torch(qi, kvi, wi, 0.25)).all()  # the seeds' unmasked scores
    x = a["x"]
    assert torch.allclose(dk.dsv4_sinkhorn_normalize(x, "torch", 7, 1e-6), dk.dsv4_sinkhorn_normalize(x, "reference", 7, 1e-6), rtol=1e-5, atol=1e-6)


@torch_only
def test_torch_backend_gradients_match_the_reference_backend():
    torch = _torch()
    a = _inputs(torch)
    go = torch.randn(a["q"].shape)
    grads = {}
    for be in ("torch", "reference"):
        leaves = [a[k].clone().requires_grad_(True) for k in ("q", "kv", "sinks")]
        dk.dsv4_sparse_attention(*leaves, a["idx"], 0.25, be).backward(go)
        grads[be] = [t.grad for t in leaves]
    for got, want, name in zip(grads["torch"], grads["reference"], ("q", "kv", "sinks")):
        assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-4, atol=1e-5), name
    assert (grads["torch"][0][0, 1] == 0).all()  # the empty row: zero gradient, never NaN


@torch_only
def test_dense_oracle_is_differentiable():
    torch = _torch()
    q, kv, sinks, idx = _attention_case(torch, b=1, s=3, h=2, d=4, k=5, t=4)
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, kv, sinks))
    with warnings.catch_warnings():  # gradcheck warns about f32 inputs: the oracle computes in f32
        warnings.simplefilter("ignore")
        assert torch.autograd.gradcheck(lambda q, kv, s: dk.dense_attention_topk_torch(q, kv, s, idx, 0.5), leaves, eps=1e-2, atol=5e-3, rtol=5e-2)
    f32 = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
    out = dk.dense_attention_topk_torch(*f32, idx, 0.5)
    assert out.requires_grad
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in f32)


@torch_only
def test_v4_indexer_returns_min_topk_p_columns_torch():
    torch = _torch()
    q, kv, w = _indexer_case(torch, b=1, s=16, h=4, d=16, p=3, dtype=torch.bfloat16)
    scores, idx = dk.v4_lighting_indexer(q.transpose(0, 1), kv.transpose(0, 1), w.transpose(0, 1), 4, 8)
    assert scores.shape == (1, 16, 3) and idx.shape == (1, 16, 3) and idx.dtype == torch.int32
    given = torch.tensor([[[0, -1, 5, 1]] * 16], dtype=torch.int32)  # 5 >= P: masked
    s2, i2 = dk.v4_lighting_indexer(q.transpose(0, 1), kv.transpose(0, 1), w.transpose(0, 1), 4, 8, given)
    assert s2.shape == (1, 16, 4) and torch.equal(i2, given) and torch.isneginf(s2[..., 1:3]).all()
