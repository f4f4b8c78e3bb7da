"""Every golden case through the Python API with numpy arrays (the CPU reference),
judged by SPEC.md section 8. A new case or file is picked up without code changes; an
op this file does not know fails."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import dsv4_kernels as dk
from dsv4_kernels import ops

from _golden import all_cases, golden_files, judge, load, sorted_rows

CASES = all_cases()
_loaded: dict = {}


def _case(path, op, case):
    if path not in _loaded:
        _loaded[path] = load(path)
    return _loaded[path][(op, case)]


def test_golden_files_found():
    assert golden_files(), "no golden files: expected <repo>/../shared/golden/*.safetensors (or $DSV4_SHARED_DIR/golden)"
    assert CASES


@pytest.mark.parametrize("path,op,case", CASES, ids=[f"{op}.{case}" for _, op, case in CASES])
def test_golden_case(path, op, case):
    c = _case(path, op, case)
    runner = RUNNERS.get(op)
    assert runner is not None, f"golden op `{op}` has no runner in python/tests/test_golden.py"
    runner(f"{op}.{case}", c["params"], c["tensors"])


def run_sparse_attention(name, p, t):
    q, kv, sinks, idx, g = t["q"], t["kv"], t["sinks"], t["topk_idxs"], t["grad_out"]
    scale = p["sm_scale"]
    out = dk.dsv4_sparse_attention(q, kv, sinks, idx, scale, "torch")
    judge(f"{name}.out", out, t["out"], "bf16")
    judge(f"{name}.out[sparse_attention_torch]", dk.sparse_attention_torch(q, kv, sinks, idx, scale), t["out"], "bf16")
    judge(f"{name}.dense_out", dk.dense_attention_topk_torch(q, kv, sinks, idx, scale), t["dense_out"], "bf16")
    o, lse = ops.sparse_attention_forward(q, kv, sinks, idx, scale, "reference")
    for impl in ("atomic", "deterministic"):
        dq, dkv, dsinks = ops.sparse_attention_backward(q, kv, sinks, idx, o, lse, g, scale, "reference", backward_impl=impl)
        judge(f"{name}.dq[{impl}]", dq, t["dq"], "bf16")
        judge(f"{name}.dkv[{impl}]", dkv, t["dkv"], "f32grad")
        judge(f"{name}.dsinks[{impl}]", dsinks, t["dsinks"], "f32grad")
    plan = dk.plan_dsv4_sparse_indices(idx, kv.shape[1], "torch")
    assert plan.backend == "reference" and plan.kv_sequence == kv.shape[1]
    judge(f"{name}.out[plan]", dk.dsv4_sparse_attention(q, kv, sinks, None, scale, "torch", plan=plan), t["out"], "bf16")
    po, plse = ops.sparse_attention_forward(q, kv, sinks, None, scale, "reference", plan=plan)
    pdq, pdkv, _ = ops.sparse_attention_backward(q, kv, sinks, None, po, plse, g, scale, "reference", plan=plan)
    judge(f"{name}.dq[plan]", pdq, t["dq"], "bf16")
    judge(f"{name}.dkv[plan]", pdkv, t["dkv"], "f32grad")


def run_indexer(name, p, t):
    q, kv, w = t["q"], t["pooled_kv"], t["weights"]
    scale, r, qs, qt, k = p["softmax_scale"], p["compress_ratio"], p.get("query_start", 0), p.get("query_total_len"), p["topk"]
    pp = kv.shape[1]
    kk = min(k, pp)
    scores = dk.dsv4_indexer_scores(q, kv, w, r, scale, "torch", query_start=qs, query_total_len=qt)
    judge(f"{name}.scores", scores, t["scores"], "f32rows", pp)
    want_sorted = sorted_rows(t["topk_indices_sorted"])
    for tag, (idx, vals) in (("topk", ops.indexer_topk(scores, k, "torch")), ("fused_topk", ops.lightning_indexer(q, kv, w, scale, r, k, "torch", qs, qt))):
        judge(f"{name}.{tag}.indices", sorted_rows(idx), want_sorted, "exact")
        judge(f"{name}.{tag}.values", vals, t["topk_scores"], "f32rows", kk)
    topk = t["topk_indices"]
    ts = ops.indexer_topk_scores(q, kv, w, topk, scale, r, "torch", qs, qt)
    judge(f"{name}.topk_scores", ts, t["topk_scores"], "f32rows", topk.shape[2])
    if qs == 0:
        judge(f"{name}.topk_scores[dsv4_indexer_topk_scores]", dk.dsv4_indexer_topk_scores(q, kv, w, topk, r, scale, "torch"), t["topk_scores"], "f32rows", topk.shape[2])
    judge(f"{name}.extract_indexer_topk_scores_torch", dk.extract_indexer_topk_scores_torch(t["scores"], topk), t["topk_scores"], "exact")
    g = t["grad_scores"]
    for det in (False, True):
        dq, dw, dkv = ops.indexer_topk_scores_backward(q, kv, w, topk, g, scale, r, "torch", qs, qt, deterministic=det)
        judge(f"{name}.dq[det={det}]", dq, t["dq"], "bf16")
        judge(f"{name}.dweights[det={det}]", dw, t["dweights"], "f32grad")
        judge(f"{name}.dpooled_kv[det={det}]", dkv, t["dpooled_kv"], "f32grad")
    if qs == 0:
        # The V4 entry points (SBHD layout, the scale folded into the weights).
        wf = (w * np.float32(scale)).astype(np.float32)
        q_sbhd, k_sbd, w_sbh = q.transpose(1, 0, 2, 3), kv.transpose(1, 0, 2), wf.transpose(1, 0, 2)
        v_scores, v_idx = dk.v4_lighting_indexer(q_sbhd, k_sbd, w_sbh, r, k)
        assert v_idx.dtype == np.int32 and v_scores.shape == (q.shape[0], q.shape[1], k)
        judge(f"{name}.v4.indices", sorted_rows(v_idx[..., :kk]), want_sorted, "exact")
        judge(f"{name}.v4.scores", v_scores[..., :kk], t["topk_scores"], "f32rows", kk)
        gq, gw, gk = dk.batched_indexer_bwd(q_sbhd, w_sbh, k_sbd, topk, g)
        judge(f"{name}.v4.grad_q", gq.transpose(1, 0, 2, 3), t["dq"], "bf16")
        judge(f"{name}.v4.grad_k", gk.transpose(1, 0, 2), t["dpooled_kv"], "f32grad")
        judge(f"{name}.v4.grad_w", gw.transpose(1, 0, 2) * np.float32(scale), t["dweights"], "f32grad")
        gq0, gw0, gk0 = dk.indexer_bwd_interface(q_sbhd[:, 0], w_sbh[:, 0], k_sbd[:, 0], topk[0], g[0])
        judge(f"{name}.v4.grad_q[interface]", gq0, t["dq"][0], "bf16")
        judge(f"{name}.v4.grad_k[interface]", gk0, t["dpooled_kv"][0], "f32grad")


def run_sinkhorn(name, p, t):
    x, g = t["x"], t["grad_out"]
    n = x.shape[-1]
    y = dk.dsv4_sinkhorn_normalize(x, "torch", p["repeat"], p["eps"])
    judge(f"{name}.out", y, t["out"], "f32rows", n)
    judge(f"{name}.out[sinkhorn_normalize_torch]", dk.sinkhorn_normalize_torch(x, p["repeat"], p["eps"]), t["out"], "f32rows", n)
    # A Sinkhorn gradient's row scale is its matrix's (see golden.rs in dsv4-core: a row of
    # dx can cancel to ~1e-8 of its matrix, where the golden f32 values are noise).
    judge(f"{name}.dx", ops.sinkhorn_backward(x, g, p["repeat"], p["eps"], "torch"), t["dx"], "f32rows", n * n)
    # dout stored with its last two dimensions swapped: a strided view, no copy.
    g_t = np.swapaxes(np.ascontiguousarray(np.swapaxes(g, -1, -2)), -1, -2)
    assert not g_t.flags.c_contiguous
    judge(f"{name}.dx[strided dout]", ops.sinkhorn_backward(x, g_t, p["repeat"], p["eps"], "torch"), t["dx"], "f32rows", n * n)


def run_qnorm_rope(name, p, t):
    # The golden values carry the two bf16 rounding boundaries: x and grad as bf16
    # (ml_dtypes' numpy bfloat16; the f32 path has no rounding boundary to match).
    xs, cos, sin, g = t["x"].astype(bfloat16), t["cos"], t["sin"], t["grad_out"].astype(bfloat16)
    c = xs.shape[3]
    y32 = dk.qnorm_rope_triton(t["x"], cos, sin, p["rotary"], p["eps"])
    assert y32.dtype == np.float32
    judge(f"{name}.out[f32 x]", y32, t["out"], "bf16")
    # x as stored ([B,H,S,C] contiguous) and as the usual transposed token-major view.
    x_tm = np.ascontiguousarray(xs.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    for tag, x in (("", xs), ("[token-major x]", x_tm)):
        y = dk.qnorm_rope_triton(x, cos, sin, p["rotary"], p["eps"])
        assert y.dtype == bfloat16 and y.transpose(0, 2, 1, 3).flags.c_contiguous, "out must be bf16, stored token-major"
        judge(f"{name}.out{tag}", y, t["out"], "bf16ulps", c)
        _, rstd = ops.qnorm_rope_forward(x, cos, sin, p["rotary"], p["eps"], "torch")
        dx = ops.qnorm_rope_backward(x, cos, sin, p["rotary"], p["eps"], rstd, g, "torch")
        judge(f"{name}.dx{tag}", dx, t["dx"], "bf16ulps", c)


def run_build(name, p, t):
    got = dk.build_dsv4_sparse_topk_indices(
        p["batch_size"], p["seq_len"], p["key_len"], p["window_size"], "cpu",
        attention_mask=t.get("attention_mask"), compress_ratio=p.get("compress_ratio", 0), compressed_topk=t.get("compressed_topk"),
        n_pooled=p.get("n_pooled", 0), vanilla_key_len=p.get("vanilla_key_len"), q_positions=t.get("q_positions"),
        vision_token_types=t.get("vision_token_types"), max_image_tokens=p.get("max_image_tokens", 0))
    got = np.asarray(got)
    assert got.dtype == np.int32
    judge(f"{name}.indices", got, t["expected"], "exact")
    numpy_only = ops.build_sparse_topk_indices(
        p["batch_size"], p["seq_len"], p["key_len"], p["window_size"], attention_mask=t.get("attention_mask"), compress_ratio=p.get("compress_ratio", 0),
        compressed_topk=t.get("compressed_topk"), n_pooled=p.get("n_pooled", 0), vanilla_key_len=p.get("vanilla_key_len"), q_positions=t.get("q_positions"),
        vision_token_types=t.get("vision_token_types"), max_image_tokens=p.get("max_image_tokens", 0), backend="reference")
    assert isinstance(numpy_only, np.ndarray)
    judge(f"{name}.indices[ops]", numpy_only, t["expected"], "exact")


RUNNERS = {
    "sparse_attention": run_sparse_attention,
    "indexer": run_indexer,
    "sinkhorn": run_sinkhorn,
    "qnorm_rope": run_qnorm_rope,
    "build_sparse_topk_indices": run_build,
}
