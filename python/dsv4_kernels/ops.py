"""Array-level operations: numpy arrays or torch tensors in, results written into
preallocated memory (yours with ``out=``, else fresh), no autograd.

Every function takes ``backend``: ``"torch"``/``"reference"``/``"sparse_torch"`` (the CPU
reference; CUDA tensors are copied to the host and back), ``"cuda"`` (this project's
kernels; ``"tilelang"``/``"cudnn"`` map to it with a one-time warning), or ``"auto"`` (the
CUDA kernels for CUDA tensors when they can take the call, else the reference). Errors
name the argument: ``ValueError`` (shape, layout, value), ``TypeError`` (dtype),
``RuntimeError`` (device, driver; ``BackendUnavailableError`` when a named backend cannot
run the call).
"""

from __future__ import annotations

import warnings

from . import _native
from ._tensors import ARRAY_TYPES, check_no_overlap, describe, empty, empty_token_major, is_array, is_cuda, is_torch, torch

BackendUnavailableError = _native.BackendUnavailableError

_ALIASES = {"torch": "reference", "reference": "reference", "sparse_torch": "reference", "cpu": "reference", "cuda": "cuda", "auto": "auto", "tilelang": "cuda", "cudnn": "cuda"}
_warned: set = set()


def resolve_backend(backend) -> str:
    """The native backend a seed backend name runs on."""
    name = _ALIASES.get(backend) if isinstance(backend, str) else None
    if name is None:
        raise ValueError(f"argument `backend` = {backend!r}, expected one of {', '.join(sorted(_ALIASES))}")
    if backend in ("tilelang", "cudnn") and backend not in _warned:
        _warned.add(backend)
        warnings.warn(f"backend={backend!r} runs this project's CUDA kernels (backend='cuda')", stacklevel=3)
    return name


def _set_stream(descs) -> None:
    """Make the native calls of this thread launch on torch's current stream of the first
    CUDA descriptor's device."""
    for d in descs:
        if d[4] >= 0:
            _native.set_stream(d[4], _current_raw_stream(d[4]))
            return


def _current_raw_stream(dev: int) -> int:
    """torch's current stream on ``dev`` as a ``cudaStream_t`` integer (its C accessor,
    where this torch has it: no Stream object per call)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream


def _describe_all(op, arrays):
    """Descriptors of the arrays of ``arrays`` (None and native objects, such as a plan,
    pass as they are) and whether any of them is CUDA memory: one pass per call."""
    descs, on_cuda = {}, False
    for k, v in arrays.items():
        if isinstance(v, ARRAY_TYPES):
            d = descs[k] = describe(v, op, k)
            if d[4] >= 0:
                on_cuda = True
        else:
            descs[k] = v
    return descs, on_cuda


def _host_fallback(fn, op, inputs, outputs, scalars):
    host_in = {k: (v.cpu() if is_cuda(v) else v) for k, v in inputs.items()}
    host_out = {k: (torch.empty_strided(v.size(), v.stride(), dtype=v.dtype) if is_cuda(v) else v) for k, v in outputs.items()}
    fn(backend="reference", **_describe_all(op, host_in)[0], **_describe_all(op, host_out)[0], **scalars)
    for k, v in outputs.items():
        if host_out[k] is not v:
            v.copy_(host_out[k])


def run(fn, op: str, family: str, backend, inputs: dict, outputs: dict, scalars: dict, user_out: bool = False) -> None:
    """Call native ``fn`` with descriptors of ``inputs`` and ``outputs`` on the backend
    that ``backend`` names (see the module documentation)."""
    name = resolve_backend(backend)
    in_descs, in_cuda = _describe_all(op, inputs)
    out_descs, out_cuda = _describe_all(op, outputs)
    if user_out:
        check_no_overlap(op, out_descs, {k: d for k, d in in_descs.items() if isinstance(d, tuple)})
    on_cuda = in_cuda or out_cuda
    if on_cuda and name == "reference":
        return _host_fallback(fn, op, inputs, outputs, scalars)
    if on_cuda and name == "auto":
        if not _native.is_kernel_available(family):
            return _host_fallback(fn, op, inputs, outputs, scalars)
        name = "cuda"
    elif name == "auto":
        name = "reference"
    if name != "reference":
        _set_stream(out_descs.values())
    try:
        fn(backend=name, **in_descs, **out_descs, **scalars)
    except BackendUnavailableError:
        if backend != "auto" or not on_cuda:
            raise
        _host_fallback(fn, op, inputs, outputs, scalars)


def _or_empty(given, like, shape, dtype):
    return given if given is not None else empty(like, shape, dtype)


def _shape(x, op, name, rank):
    if not is_array(x):
        raise TypeError(f"{op}: argument `{name}` must be a numpy array or a torch tensor, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{op}: argument `{name}` has shape {list(x.shape)}, expected rank {rank}")
    return tuple(int(n) for n in x.shape)


def _native_plan(plan):
    return None if plan is None else getattr(plan, "_native", plan)


# -- sparse attention (SPEC.md section 1) ------------------------------------------------


def sparse_attention_forward(q, kv, sinks, topk_idxs=None, sm_scale=None, backend="auto", *, reference_rounding=False, all_rows_nonempty=False, plan=None, out=None, lse=None):
    """``(out [B,S,H,D] in q's dtype, lse [B,S,H] f32)``; ``topk_idxs`` may be None with ``plan``."""
    b, s, h, d = _shape(q, "sparse_attention", "q", 4)
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    user = out is not None or lse is not None
    out = _or_empty(out, q, (b, s, h, d), "like")
    lse = _or_empty(lse, q, (b, s, h), "f32")
    run(_native.sparse_attention_fwd, "sparse_attention", "sparse_attn", backend,
        dict(q=q, kv=kv, sinks=sinks, topk_idxs=None if plan is not None else topk_idxs, plan=_native_plan(plan)),
        dict(out=out, lse=lse), dict(sm_scale=sm_scale, reference_rounding=bool(reference_rounding), all_rows_nonempty=bool(all_rows_nonempty)), user)
    return out, lse


def sparse_attention_backward(q, kv, sinks, topk_idxs, out, lse, dout, sm_scale=None, backend="auto", *, reference_rounding=False, all_rows_nonempty=False, plan=None,
                              backward_impl="atomic", backward_workspace_bytes=2 * 1024**3, dq=None, dkv=None, dsinks=None):
    """``(dq in q's dtype, dkv in kv's dtype, dsinks [H] f32)`` from the forward's ``out``, ``lse``."""
    b, s, h, d = _shape(q, "sparse_attention_backward", "q", 4)
    _, k, _ = _shape(kv, "sparse_attention_backward", "kv", 3)
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    user = dq is not None or dkv is not None or dsinks is not None
    dq = _or_empty(dq, q, (b, s, h, d), "like")
    dkv = _or_empty(dkv, kv, (b, k, d), "like")
    dsinks = _or_empty(dsinks, q, (h,), "f32")
    run(_native.sparse_attention_bwd, "sparse_attention_backward", "sparse_attn", backend,
        dict(q=q, kv=kv, sinks=sinks, topk_idxs=None if plan is not None else topk_idxs, plan=_native_plan(plan), out=out, lse=lse, dout=dout),
        dict(dq=dq, dkv=dkv, dsinks=dsinks),
        dict(sm_scale=sm_scale, reference_rounding=bool(reference_rounding), all_rows_nonempty=bool(all_rows_nonempty), backward_impl=backward_impl, backward_workspace_bytes=int(backward_workspace_bytes)), user)
    return dq, dkv, dsinks


def dense_attention(q, kv, sinks, topk_idxs, sm_scale=None, backend="auto", *, out=None):
    """The dense oracle (duplicate keys collapse): ``out [B,S,H,D]`` in q's dtype."""
    b, s, h, d = _shape(q, "dense_attention_topk", "q", 4)
    sm_scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    user = out is not None
    out = _or_empty(out, q, (b, s, h, d), "like")
    run(_native.dense_attention_topk, "dense_attention_topk", "sparse_attn", backend, dict(q=q, kv=kv, sinks=sinks, topk_idxs=topk_idxs), dict(out=out), dict(sm_scale=sm_scale), user)
    return out


# -- lightning indexer (SPEC.md sections 2 and 3) ----------------------------------------


def _indexer_scalars(softmax_scale, compress_ratio, query_start, query_total_len):
    return dict(softmax_scale=float(softmax_scale), compress_ratio=int(compress_ratio), query_start=int(query_start), query_total_len=None if query_total_len is None else int(query_total_len))


def indexer_scores(q, pooled_kv, weights, softmax_scale, compress_ratio, backend="auto", query_start=0, query_total_len=None, *, out=None):
    """Scores ``[B,S,P]`` f32 with the causal ``-inf``."""
    b, s, _, _ = _shape(q, "indexer_scores", "q", 4)
    p = _shape(pooled_kv, "indexer_scores", "pooled_kv", 3)[1]
    user = out is not None
    out = _or_empty(out, q, (b, s, p), "f32")
    run(_native.indexer_scores, "indexer_scores", "indexer", backend, dict(q=q, pooled_kv=pooled_kv, weights=weights), dict(out=out),
        _indexer_scalars(softmax_scale, compress_ratio, query_start, query_total_len), user)
    return out


def indexer_topk(scores, k, backend="auto", *, indices=None, values=None):
    """``(indices [B,S,min(k,P)] i32, values f32)``: descending, ``-1``/``-inf`` past the finite count."""
    b, s, p = _shape(scores, "indexer_topk", "scores", 3)
    kk = min(int(k), p)
    user = indices is not None or values is not None
    indices = _or_empty(indices, scores, (b, s, kk), "i32")
    values = _or_empty(values, scores, (b, s, kk), "f32")
    run(_native.indexer_topk, "indexer_topk", "indexer", backend, dict(scores=scores), dict(indices=indices, values=values), dict(k=int(k)), user)
    return indices, values


def lightning_indexer(q, pooled_kv, weights, softmax_scale, compress_ratio, k, backend="auto", query_start=0, query_total_len=None, *, indices=None, values=None):
    """Scores and top-k fused: ``(indices [B,S,min(k,P)] i32, values f32)``."""
    b, s, _, _ = _shape(q, "lightning_indexer", "q", 4)
    p = _shape(pooled_kv, "lightning_indexer", "pooled_kv", 3)[1]
    kk = min(int(k), p)
    user = indices is not None or values is not None
    indices = _or_empty(indices, q, (b, s, kk), "i32")
    values = _or_empty(values, q, (b, s, kk), "f32")
    run(_native.lightning_indexer, "lightning_indexer", "indexer", backend, dict(q=q, pooled_kv=pooled_kv, weights=weights), dict(indices=indices, values=values),
        dict(_indexer_scalars(softmax_scale, compress_ratio, query_start, query_total_len), k=int(k)), user)
    return indices, values


def indexer_topk_scores(q, pooled_kv, weights, topk_indices, softmax_scale, compress_ratio, backend="auto", query_start=0, query_total_len=None, *, out=None):
    """Scores of a selection ``[B,S,T]`` f32 (``-inf`` where masked or not causally visible)."""
    b, s, _, _ = _shape(q, "indexer_topk_scores", "q", 4)
    t = _shape(topk_indices, "indexer_topk_scores", "topk_indices", 3)[2]
    user = out is not None
    out = _or_empty(out, q, (b, s, t), "f32")
    run(_native.indexer_topk_scores, "indexer_topk_scores", "indexer", backend, dict(q=q, pooled_kv=pooled_kv, weights=weights, topk_indices=topk_indices), dict(out=out),
        _indexer_scalars(softmax_scale, compress_ratio, query_start, query_total_len), user)
    return out


def indexer_topk_scores_backward(q, pooled_kv, weights, topk_indices, grad, softmax_scale, compress_ratio, backend="auto", query_start=0, query_total_len=None, *,
                                 deterministic=False, dq=None, dweights=None, dpooled_kv=None):
    """``(dq in q's dtype, dweights [B,S,H] f32, dpooled_kv [B,P,D] f32)``."""
    b, s, h, d = _shape(q, "indexer_topk_scores_backward", "q", 4)
    p = _shape(pooled_kv, "indexer_topk_scores_backward", "pooled_kv", 3)[1]
    user = dq is not None or dweights is not None or dpooled_kv is not None
    dq = _or_empty(dq, q, (b, s, h, d), "like")
    dweights = _or_empty(dweights, q, (b, s, h), "f32")
    dpooled_kv = _or_empty(dpooled_kv, q, (b, p, d), "f32")
    run(_native.indexer_topk_scores_bwd, "indexer_topk_scores_backward", "indexer", backend,
        dict(q=q, pooled_kv=pooled_kv, weights=weights, topk_indices=topk_indices, grad=grad), dict(dq=dq, dweights=dweights, dpooled_kv=dpooled_kv),
        dict(_indexer_scalars(softmax_scale, compress_ratio, query_start, query_total_len), deterministic=bool(deterministic)), user)
    return dq, dweights, dpooled_kv


# -- Sinkhorn (SPEC.md section 4) --------------------------------------------------------


def sinkhorn_forward(x, repeat, eps, backend="auto", *, out=None):
    """``out`` (x's shape, f32)."""
    if not is_array(x):
        raise TypeError(f"sinkhorn_normalize: argument `x` must be a numpy array or a torch tensor, got {type(x).__name__}")
    user = out is not None
    out = _or_empty(out, x, tuple(x.shape), "f32")
    run(_native.sinkhorn_fwd, "sinkhorn_normalize", "sinkhorn", backend, dict(x=x), dict(out=out), dict(repeat=int(repeat), eps=float(eps)), user)
    return out


def sinkhorn_backward(x, dout, repeat, eps, backend="auto", *, dx=None):
    """``dx`` (x's shape, f32); ``dout`` may have any strides."""
    if not is_array(x):
        raise TypeError(f"sinkhorn_normalize_backward: argument `x` must be a numpy array or a torch tensor, got {type(x).__name__}")
    user = dx is not None
    dx = _or_empty(dx, x, tuple(x.shape), "f32")
    run(_native.sinkhorn_bwd, "sinkhorn_normalize_backward", "sinkhorn", backend, dict(x=x, dout=dout), dict(dx=dx), dict(repeat=int(repeat), eps=float(eps)), user)
    return dx


# -- qnorm_rope (SPEC.md section 5) ------------------------------------------------------


def qnorm_rope_forward(x, cos, sin, rotary, eps, backend="auto", *, out=None, rstd=None):
    """``(out logical [B,H,S,C] token-major in x's dtype, rstd [B*S*H] f32)``."""
    b, h, s, c = _shape(x, "qnorm_rope", "x", 4)
    user = out is not None or rstd is not None
    out = out if out is not None else empty_token_major(x, b, h, s, c)
    rstd = _or_empty(rstd, x, (b * s * h,), "f32")
    run(_native.qnorm_rope_fwd, "qnorm_rope", "qnorm_rope", backend, dict(x=x, cos=cos, sin=sin), dict(out=out, rstd=rstd), dict(rotary=int(rotary), eps=float(eps)), user)
    return out, rstd


def qnorm_rope_backward(x, cos, sin, rotary, eps, rstd, grad, backend="auto", *, dx=None):
    """``dx`` logical ``[B,H,S,C]``, token-major storage, x's dtype; ``grad`` any strides."""
    b, h, s, c = _shape(x, "qnorm_rope_backward", "x", 4)
    user = dx is not None
    dx = dx if dx is not None else empty_token_major(x, b, h, s, c)
    run(_native.qnorm_rope_bwd, "qnorm_rope_backward", "qnorm_rope", backend, dict(x=x, cos=cos, sin=sin, rstd=rstd, grad=grad), dict(dx=dx),
        dict(rotary=int(rotary), eps=float(eps)), user)
    return dx


# -- index construction and plans (SPEC.md section 6) ------------------------------------


def build_indices_width(seq_len, key_len, window_size, compress_ratio=0, compressed_topk=None, n_pooled=0, vanilla_key_len=None, vision=False, max_image_tokens=0, batch_size=1):
    """``W'``, the last dimension of ``build_sparse_topk_indices``'s result."""
    return _native.build_indices_width(batch_size=int(batch_size), seq_len=int(seq_len), key_len=int(key_len), window_size=int(window_size), compress_ratio=int(compress_ratio),
                                       n_pooled=int(n_pooled), compressed_width=None if compressed_topk is None else int(compressed_topk.shape[-1]),
                                       vanilla_key_len=None if vanilla_key_len is None else int(vanilla_key_len), vision=bool(vision), max_image_tokens=int(max_image_tokens))


def build_sparse_topk_indices(batch_size, seq_len, key_len, window_size, *, like=None, attention_mask=None, compress_ratio=0, compressed_topk=None, n_pooled=0,
                              vanilla_key_len=None, q_positions=None, vision_token_types=None, max_image_tokens=0, backend="auto", out=None):
    """``[B,S,W']`` int32 key slots, allocated beside ``like`` (an array; numpy when None)."""
    import numpy as np

    width = build_indices_width(seq_len, key_len, window_size, compress_ratio, compressed_topk, n_pooled, vanilla_key_len, vision_token_types is not None, max_image_tokens, batch_size)
    user = out is not None
    if out is None:
        out = empty(like, (batch_size, seq_len, width), "i32") if like is not None else np.empty((batch_size, seq_len, width), np.int32)
    scalars = dict(batch_size=int(batch_size), seq_len=int(seq_len), key_len=int(key_len), window_size=int(window_size), compress_ratio=int(compress_ratio), n_pooled=int(n_pooled),
                   vanilla_key_len=None if vanilla_key_len is None else int(vanilla_key_len), max_image_tokens=int(max_image_tokens))
    inputs = dict(attention_mask=attention_mask, compressed_topk=compressed_topk, q_positions=q_positions, vision_token_types=vision_token_types)

    def fn(backend, out, **kw):
        # The result's device comes from its descriptor: the builder may have no tensor input.
        _native.build_sparse_topk_indices(backend=backend, device=out[4], out=out, **kw)

    run(fn, "build_sparse_topk_indices", "sparse_attn", backend, inputs, dict(out=out), scalars, user)
    return out


def plan_sparse_indices(topk_idxs, kv_len, backend="auto", all_rows_nonempty=False):
    """A native plan for the backend that ``backend`` resolves to on ``topk_idxs``' device."""
    name = resolve_backend(backend)
    if is_cuda(topk_idxs) and name == "reference":
        raise BackendUnavailableError("plan_sparse_indices: a reference plan needs host indices; pass topk_idxs.cpu() or use backend='cuda'")
    if name == "auto":
        name = "cuda" if is_cuda(topk_idxs) and _native.is_kernel_available("sparse_attn") else "reference"
        if is_cuda(topk_idxs) and name == "reference":
            topk_idxs = topk_idxs.cpu()
    desc = describe(topk_idxs, "plan_sparse_indices", "topk_idxs")
    if name == "cuda":
        _set_stream([desc])
    return _native.plan_sparse_indices(backend=name, topk_idxs=desc, kv_len=int(kv_len), all_rows_nonempty=bool(all_rows_nonempty))
