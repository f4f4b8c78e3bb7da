"""The numpy-level API: bad inputs raise errors that name the argument; outputs land in
the caller's memory (``out=``); inputs are read in place, strided views included."""

from __future__ import annotations

import numpy as np
import pytest

import dsv4_kernels as dk
from dsv4_kernels import ops

RNG = np.random.default_rng(0)


def bf16ish(*shape, scale=1.0):
    """f32 values that are exactly bf16-representable."""
    x = (RNG.standard_normal(shape) * scale).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def attention_inputs(b=1, s=5, h=4, d=16, k=9, t=6):
    q, kv, sinks = bf16ish(b, s, h, d), bf16ish(b, k, d), RNG.standard_normal(h).astype(np.float32)
    idx = RNG.integers(-1, k, size=(b, s, t)).astype(np.int32)
    return q, kv, sinks, idx


# -- errors ------------------------------------------------------------------------------


def test_shape_error_names_argument():
    q, kv, sinks, idx = attention_inputs()
    with pytest.raises(ValueError, match="`kv`"):
        dk.dsv4_sparse_attention(q, kv[:, :, :8], sinks, idx, 0.25, "torch")
    with pytest.raises(ValueError, match="`sinks`"):
        dk.dsv4_sparse_attention(q, kv, sinks[:3], idx, 0.25, "torch")
    with pytest.raises(ValueError, match="`topk_idxs`"):
        dk.dsv4_sparse_attention(q, kv, sinks, idx[:, :4], 0.25, "torch")


def test_dtype_error_is_type_error():
    q, kv, sinks, idx = attention_inputs()
    with pytest.raises(TypeError, match="`q`.*float64"):
        dk.dsv4_sparse_attention(q.astype(np.float64), kv, sinks, idx, 0.25, "torch")
    with pytest.raises(TypeError, match="`topk_idxs`"):
        dk.dsv4_sparse_attention(q, kv, sinks, idx.astype(np.float32), 0.25, "torch")
    with pytest.raises(TypeError, match="`x`"):
        dk.dsv4_sinkhorn_normalize(np.zeros((2, 4, 4), np.int32), "torch", 3, 1e-6)


def test_value_errors():
    x = RNG.standard_normal((2, 4, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="`repeat`"):
        dk.dsv4_sinkhorn_normalize(x, "torch", 0, 1e-6)
    with pytest.raises(ValueError, match="`eps`"):
        dk.dsv4_sinkhorn_normalize(x, "torch", 3, -1.0)
    with pytest.raises(ValueError, match="`x`"):
        dk.dsv4_sinkhorn_normalize(x[:, :3], "torch", 3, 1e-6)
    with pytest.raises(ValueError, match="`backend`"):
        dk.dsv4_sinkhorn_normalize(x, "no-such-backend", 3, 1e-6)
    q, kv, sinks, idx = attention_inputs()
    with pytest.raises(ValueError, match="`backward_impl`"):
        dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch", backward_impl="fast")
    with pytest.raises(ValueError, match="`topk_idxs`"):
        dk.dsv4_sparse_attention(q, kv, sinks, None, 0.25, "torch")
    xq = bf16ish(1, 2, 3, 16)
    cs = np.ones((1, 3, 7), np.float32)
    with pytest.raises(ValueError, match="`rotary`"):
        dk.qnorm_rope_triton(xq, cs, cs, 7, 1e-6)


def test_not_an_array():
    with pytest.raises(TypeError, match="`x`"):
        dk.dsv4_sinkhorn_normalize([[1.0]], "torch", 3, 1e-6)


def test_cuda_backend_on_host_arrays_is_an_error_not_a_fallback():
    x = RNG.standard_normal((2, 4, 4)).astype(np.float32)
    with pytest.raises(RuntimeError, match="cuda"):
        dk.dsv4_sinkhorn_normalize(x, "cuda", 3, 1e-6)
    with pytest.raises(dk.BackendUnavailableError):
        dk.dsv4_sinkhorn_normalize(x, "cuda", 3, 1e-6)


def test_tilelang_maps_to_cuda_with_a_warning():
    x = RNG.standard_normal((2, 4, 4)).astype(np.float32)
    ops._warned.discard("tilelang")
    with pytest.warns(UserWarning, match="cuda"), pytest.raises(dk.BackendUnavailableError):
        dk.dsv4_sinkhorn_normalize(x, "tilelang", 3, 1e-6)


def test_plan_for_another_backend_is_rejected_and_plan_shape_checked():
    q, kv, sinks, idx = attention_inputs()
    plan = dk.plan_dsv4_sparse_indices(idx, kv.shape[1], "torch")
    with pytest.raises(ValueError, match="`plan`"):
        dk.dsv4_sparse_attention(q, kv[:, :7], sinks, None, 0.25, "torch", plan=plan)


def test_out_overlapping_an_input_is_rejected():
    x = RNG.standard_normal((2, 4, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="overlaps `x`"):
        ops.sinkhorn_forward(x, 3, 1e-6, "reference", out=x)


def test_wrong_out_shape_and_layout():
    x = RNG.standard_normal((2, 4, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="`out`"):
        ops.sinkhorn_forward(x, 3, 1e-6, "reference", out=np.empty((2, 4, 5), np.float32))
    with pytest.raises(ValueError, match="`out`"):
        ops.sinkhorn_forward(x, 3, 1e-6, "reference", out=np.empty((2, 4, 4), np.float32).transpose(0, 2, 1))
    with pytest.raises(TypeError, match="`out`"):
        ops.sinkhorn_forward(x, 3, 1e-6, "reference", out=np.empty((2, 4, 4), np.float64))


# -- no copies ---------------------------------------------------------------------------


def test_out_is_written_in_place():
    q, kv, sinks, idx = attention_inputs()
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full(q.shape[:3], np.nan, np.float32)
    o, l = ops.sparse_attention_forward(q, kv, sinks, idx, 0.25, "reference", out=out, lse=lse)
    assert o is out and l is lse
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_array_equal(out, dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch"))
    x = RNG.standard_normal((3, 4, 4)).astype(np.float32)
    buf = np.full((3, 4, 4), np.nan, np.float32)
    assert ops.sinkhorn_forward(x, 5, 1e-6, "reference", out=buf) is buf
    np.testing.assert_allclose(buf.sum(-2), 1.0, rtol=1e-4)


def test_out_can_be_a_view_into_a_larger_buffer():
    x = RNG.standard_normal((3, 4, 4)).astype(np.float32)
    big = np.full((5, 4, 4), -7.0, np.float32)
    ops.sinkhorn_forward(x, 5, 1e-6, "reference", out=big[1:4])
    assert (big[0] == -7).all() and (big[4] == -7).all()
    np.testing.assert_array_equal(big[1:4], ops.sinkhorn_forward(x, 5, 1e-6, "reference"))


def test_strided_inputs_are_read_in_place():
    # A transposed, sliced view: same results as its contiguous copy, and no copy is made
    # (the native layer sees the view's own address and strides).
    base = RNG.standard_normal((2, 4, 8, 8)).astype(np.float32)
    x = base[:, 1:4, ::2, ::2].swapaxes(-1, -2)  # [2,3,4,4], non-contiguous
    assert not x.flags.c_contiguous and np.shares_memory(x, base)
    from dsv4_kernels._tensors import describe
    ptr, dtype, shape, strides, dev = describe(x, "t", "x")
    assert ptr == x.__array_interface__["data"][0] and strides == tuple(s // 4 for s in x.strides) and dev == -1
    np.testing.assert_array_equal(ops.sinkhorn_forward(x, 4, 1e-6, "reference"), ops.sinkhorn_forward(np.ascontiguousarray(x), 4, 1e-6, "reference"))
    q, kv, sinks, idx = attention_inputs(b=2, s=5, h=4, d=16)
    q_sbhd = np.ascontiguousarray(q.transpose(1, 0, 2, 3))
    q_view = q_sbhd.transpose(1, 0, 2, 3)  # BSHD view of SBHD storage
    np.testing.assert_array_equal(dk.dsv4_sparse_attention(q_view, kv, sinks, idx, 0.25, "torch"), dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch"))


def test_negative_strides():
    x = RNG.standard_normal((3, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(ops.sinkhorn_forward(x[::-1], 4, 1e-6, "reference"), ops.sinkhorn_forward(x[::-1].copy(), 4, 1e-6, "reference"))


def test_inputs_are_not_modified():
    q, kv, sinks, idx = attention_inputs()
    before = [a.copy() for a in (q, kv, sinks, idx)]
    dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch")
    for a, b in zip((q, kv, sinks, idx), before):
        np.testing.assert_array_equal(a, b)


# -- behaviour ---------------------------------------------------------------------------


def test_empty_row_gives_zero_and_plan_tensors():
    q, kv, sinks, idx = attention_inputs()
    idx[0, 2] = -1
    out = dk.dsv4_sparse_attention(q, kv, sinks, idx, 0.25, "torch")
    assert (out[0, 2] == 0).all()
    plan = dk.plan_dsv4_sparse_indices(idx, kv.shape[1], "torch")
    assert plan.indices.dtype == np.int32 and plan.indices.shape[:2] == (5, 1)
    assert plan.topk_length[2] == 0
    assert plan.valid_rows is not None and 2 not in set(plan.valid_rows.tolist())
    assert dk.plan_dsv4_sparse_indices(idx, kv.shape[1], "torch", all_rows_nonempty=True).valid_rows is None
    # The plan orders each row's keys ascending: the same sum in another order.
    np.testing.assert_allclose(dk.dsv4_sparse_attention(q, kv, sinks, None, 0.25, "torch", plan=plan), out, rtol=1e-5, atol=1e-6)


def test_kernel_availability_matches_the_machine():
    # The kernels are available exactly when the CUDA driver and a device are: false on a
    # machine without a GPU (CI), true on the GPU machine; an unknown name is a ValueError (as the seeds).
    has_gpu = any(line.startswith("cuda:0:") for line in dk.describe())
    for name in ("sinkhorn", "sparse_attn", "indexer", "qnorm_rope"):
        assert dk.is_dsv4_kernel_available(name) is has_gpu
    with pytest.raises(ValueError, match="unknown"):
        dk.is_dsv4_kernel_available("unknown")


def test_build_indices_numpy_window():
    got = np.asarray(dk.build_dsv4_sparse_topk_indices(1, 4, 4, 2, "cpu"))
    np.testing.assert_array_equal(got[0], [[0, -1], [0, 1], [1, 2], [2, 3]])


def test_lightning_indexer_returns_min_topk_p_columns():
    q, kv, w = bf16ish(5, 1, 2, 8), bf16ish(2, 1, 8), RNG.standard_normal((5, 1, 2)).astype(np.float32)
    scores, idx = dk.v4_lighting_indexer(q, kv, w, 2, 4)  # topk 4 > P = 2: min(topk, P) columns, as the seeds' torch.topk
    assert scores.shape == (1, 5, 2) and idx.shape == (1, 5, 2) and idx.dtype == np.int32
    # query s sees pooled keys p < (s + 1) // 2
    assert (idx[0, 0] == -1).all() and (idx[0, 1, 1:] == -1).all() and idx[0, 1, 0] == 0
