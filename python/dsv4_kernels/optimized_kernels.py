"""The seeds' ``deepseek_v4.optimized_kernels`` functions, same names, arguments and
defaults, on this project's kernels.

torch tensors go through the ``dsv4`` custom ops (autograd, ``torch.compile``), or with a
torch backend name through plain torch code (below); numpy arrays through
:mod:`dsv4_kernels.ops` (no autograd; bf16 inputs are given as f32 arrays holding
bf16-representable values, which the reference accepts).

Backends: ``"torch"``/``"sparse_torch"`` with torch tensors run torch composites of
SPEC.md's formulas on the tensors' own device (:mod:`dsv4_kernels._torch_ref`: f32
arithmetic, torch autograd, as the seeds' torch fallbacks), and with numpy arrays the CPU
reference; ``"reference"`` is this project's exact CPU reference for both (CUDA tensors are
copied to the host and back); ``"cuda"`` this project's kernels (``"tilelang"``/``"cudnn"``
map to it with a one-time warning); ``"auto"`` the CUDA kernels where they can take the
call, else the reference.
"""

from __future__ import annotations

from typing import Literal, Optional

from . import _native, ops
from ._tensors import is_torch, torch

Dsv4SparseAttentionBackend = Literal["torch", "sparse_torch", "tilelang", "cudnn", "cuda", "auto"]
Dsv4IndexerBackend = Literal["torch", "tilelang", "cuda", "auto"]
Dsv4SinkhornBackend = Literal["torch", "tilelang", "cuda", "auto"]

if torch is not None:
    from . import _torch_ops, _torch_ref

    # The ops: torch.ops.dsv4 while torch.compile traces, their implementations in eager mode.
    _dsv4 = _torch_ops.call

# The seed backend names that select the torch composites for torch tensors.
_TORCH_BACKENDS = ("torch", "sparse_torch")
# The kernel families `is_dsv4_kernel_available` answers for (the seeds' three and qnorm_rope).
_KERNEL_NAMES = ("sinkhorn", "sparse_attn", "indexer", "qnorm_rope")


def _torch_path(*xs) -> bool:
    return any(is_torch(x) for x in xs)


def _torch_composite(backend, *xs) -> bool:
    """Whether the call runs :mod:`._torch_ref` (torch tensors and a torch backend name)."""
    return isinstance(backend, str) and backend in _TORCH_BACKENDS and _torch_path(*xs)


class SparseIndexPlan:
    """Sparse-attention indices prepared once for every layer that consumes the same
    selection (``plan_dsv4_sparse_indices``). The layout is the backend's own: for the
    reference, int32 ``[batch * sequence, 1, padded_width]`` global flat coordinates
    ``b * kv_sequence + k`` (valid entries first, ascending, then -1), int32
    ``topk_length [batch * sequence]`` and, unless every row is nonempty, int64
    ``valid_rows``. Using a plan with another backend is an error.

    ``indices``, ``topk_length`` and ``valid_rows`` are host copies for inspection (torch
    tensors when the plan was made from a torch tensor, else numpy arrays).

    With the CUDA backend, the plan's first deterministic backward also builds the inverted
    index that backward needs (key -> its (row, slot) entries) and the plan keeps it, so the
    later deterministic backwards of every layer sharing the plan skip that work; it holds
    4 bytes a slot plus per-row-block counts (84 MB at 16,384 rows, 640 slots, 20,480 keys) until the
    plan is freed."""

    def __init__(self, native, as_torch: bool):
        self._native = native
        self._as_torch = as_torch and torch is not None
        self._id = _torch_ops.register_plan(self) if torch is not None else -1

    @property
    def backend(self) -> str:
        return self._native.backend

    @property
    def kv_sequence(self) -> int:
        return self._native.kv_sequence

    def _tensor(self, name):
        import numpy as np

        got = self._native.host_tensor(name)
        if got is None:
            return None
        values, dtype, shape = got
        arr = np.asarray(values, dtype=np.int32 if dtype == "i32" else np.int64).reshape(shape)
        return torch.from_numpy(arr) if self._as_torch else arr

    @property
    def indices(self):
        return self._tensor("indices")

    @property
    def topk_length(self):
        return self._tensor("topk_length")

    @property
    def valid_rows(self):
        return self._tensor("valid_rows")

    def __repr__(self) -> str:
        return f"SparseIndexPlan({self._native!r})"


def plan_dsv4_sparse_indices(topk_idxs, kv_sequence: int, backend: Dsv4SparseAttentionBackend, all_rows_nonempty: bool = False) -> SparseIndexPlan:
    """Prepare the per-call index work of ``dsv4_sparse_attention`` once for a shared selection."""
    return SparseIndexPlan(ops.plan_sparse_indices(topk_idxs, kv_sequence, backend, all_rows_nonempty), is_torch(topk_idxs))


def dsv4_sparse_attention(q, kv, sinks, topk_idxs, sm_scale: float, backend: Dsv4SparseAttentionBackend, reference_rounding: bool = False, backward_impl: str = "atomic",
                          backward_workspace_bytes: int = 2 * 1024**3, all_rows_nonempty: bool = False, plan: Optional[SparseIndexPlan] = None):
    """Sparse MQA attention with sinks: ``q [B,S,H,D]``, ``kv [B,K,D]``, ``sinks [H]`` f32,
    ``topk_idxs [B,S,T]`` (-1 masked; None only with ``plan``) -> ``[B,S,H,D]`` in q's dtype.

    With torch tensors and ``backend="torch"``/``"sparse_torch"`` (and no ``plan``) this is
    the torch composite on the tensors' device, differentiated by torch autograd: its
    arithmetic is already ``reference_rounding``'s (logits scaled before the maximum,
    natural ``exp``), and ``backward_impl``, ``backward_workspace_bytes`` and
    ``all_rows_nonempty`` do not apply to it."""
    if backward_impl not in ("atomic", "deterministic"):
        raise ValueError(f"argument `backward_impl` = {backward_impl!r}, expected 'atomic' or 'deterministic'")
    if topk_idxs is None and plan is None:
        raise ValueError("dsv4_sparse_attention: argument `topk_idxs` is None and no `plan` was given")
    if plan is None and _torch_composite(backend, q, kv, sinks):
        _torch_ref.check_attention("dsv4_sparse_attention", q, kv, sinks, topk_idxs)
        return _torch_ref.sparse_attention(q, kv, sinks, topk_idxs, float(sm_scale))
    if _torch_path(q, kv, sinks):
        out, _ = _dsv4.sparse_attention(q, kv, sinks, None if plan is not None else topk_idxs, float(sm_scale), backend, bool(reference_rounding), bool(all_rows_nonempty),
                                        -1 if plan is None else plan._id, backward_impl, int(backward_workspace_bytes))
        return out
    out, _ = ops.sparse_attention_forward(q, kv, sinks, topk_idxs, sm_scale, backend, reference_rounding=reference_rounding, all_rows_nonempty=all_rows_nonempty, plan=plan)
    return out


def sparse_attention_torch(q, kv, sinks, topk_idxs, sm_scale: float):
    """The sparse MQA reference (a duplicated key counts twice, like a gather)."""
    return dsv4_sparse_attention(q, kv, sinks, topk_idxs, sm_scale, "torch")


def dense_attention_topk_torch(q, kv, sinks, topk_idxs, sm_scale: float):
    """The dense oracle over the *set* of valid keys (duplicates collapse), f32 arithmetic,
    output in q's dtype; differentiable for torch tensors (torch autograd on their device)."""
    if _torch_path(q, kv, sinks):
        _torch_ref.check_attention("dense_attention_topk_torch", q, kv, sinks, topk_idxs)
        return _torch_ref.dense_attention_topk(q, kv, sinks, topk_idxs, float(sm_scale))
    return ops.dense_attention(q, kv, sinks, topk_idxs, sm_scale, "torch")


def dsv4_indexer_scores(q, pooled_kv, weights, compress_ratio: int, softmax_scale: float, backend: Dsv4IndexerBackend, query_start: int = 0, query_total_len: Optional[int] = None):
    """Indexer scores ``[B,S,P]`` f32, ``-inf`` where ``p >= (query_start + s + 1) // compress_ratio``."""
    if _torch_composite(backend, q, pooled_kv, weights):
        _torch_ref.check_indexer("dsv4_indexer_scores", q, pooled_kv, weights, compress_ratio, int(query_start), query_total_len)
        return _torch_ref.indexer_scores(q, pooled_kv, weights, float(softmax_scale), int(compress_ratio), int(query_start))
    if _torch_path(q, pooled_kv, weights):
        return _dsv4.indexer_scores(q, pooled_kv, weights, float(softmax_scale), int(compress_ratio), int(query_start), query_total_len, backend)
    return ops.indexer_scores(q, pooled_kv, weights, softmax_scale, compress_ratio, backend, query_start, query_total_len)


def indexer_scores_torch(q, pooled_kv, weights, softmax_scale: float):
    """FP32 indexer scores ``[B,S,P]`` without the causal mask (as the seeds' torch fallback)."""
    if _torch_path(q, pooled_kv, weights):
        _torch_ref.check_indexer("indexer_scores_torch", q, pooled_kv, weights)
        return _torch_ref.indexer_scores(q, pooled_kv, weights, float(softmax_scale))
    p = pooled_kv.shape[1]
    # compress_ratio 1 with every query placed at or past P sees every pooled key.
    return dsv4_indexer_scores(q, pooled_kv, weights, 1, softmax_scale, "torch", query_start=p)


def dsv4_indexer_topk_scores(q, pooled_kv, weights, topk_indices, compress_ratio: int, softmax_scale: float, backend: Dsv4IndexerBackend):
    """Scores ``[B,S,T]`` f32 of a selection (``-inf`` where masked or causally hidden); differentiable."""
    if _torch_composite(backend, q, pooled_kv, weights):
        _torch_ref.check_indexer("dsv4_indexer_topk_scores", q, pooled_kv, weights, compress_ratio)
        return _torch_ref.indexer_topk_scores(q, pooled_kv, weights, topk_indices, float(softmax_scale), int(compress_ratio))
    if _torch_path(q, pooled_kv, weights):
        return _dsv4.indexer_topk_scores(q, pooled_kv, weights, topk_indices, float(softmax_scale), int(compress_ratio), 0, None, backend)
    return ops.indexer_topk_scores(q, pooled_kv, weights, topk_indices, softmax_scale, compress_ratio, backend)


def extract_indexer_topk_scores_torch(logits, topk_indices):
    """Top-k score values gathered from ``logits [..., P]``; ``-inf`` at every index outside
    ``[0, P)`` (``-1`` and the like), which is never dereferenced."""
    return _gather_scores(logits, topk_indices, -1)


def _gather_scores(logits, topk_indices, dim):
    """``logits`` gathered at ``topk_indices`` along ``dim``, ``-inf`` where an index is not
    in ``[0, logits.shape[dim])`` (torch tensors or numpy arrays)."""
    if is_torch(logits):
        return _torch_ref.gather_scores(logits, topk_indices, dim)
    import numpy as np

    logits = np.asarray(logits)
    idx = np.asarray(topk_indices)
    n = logits.shape[dim]
    valid = (idx >= 0) & (idx < n)
    if n == 0:
        return np.full(idx.shape, -np.inf, dtype=logits.dtype)
    got = np.take_along_axis(logits, np.where(valid, idx, 0).astype(np.int64), axis=dim)
    return np.where(valid, got, np.asarray(-np.inf, dtype=logits.dtype)).astype(logits.dtype, copy=False)


def dsv4_sinkhorn_normalize(x, backend: Dsv4SinkhornBackend, repeat: int, eps: float):
    """Sinkhorn-normalise ``x [..., n, n]`` f32 (softmax, then column / row rounds)."""
    if _torch_composite(backend, x):
        return _torch_ref.sinkhorn(x, int(repeat), float(eps))
    if _torch_path(x):
        return _dsv4.sinkhorn(x, int(repeat), float(eps), backend)
    return ops.sinkhorn_forward(x, repeat, eps, backend)


def sinkhorn_normalize_torch(x, repeat: int, eps: float):
    """The Sinkhorn reference."""
    return dsv4_sinkhorn_normalize(x, "torch", repeat, eps)


def build_dsv4_sparse_topk_indices(batch_size: int, seq_len: int, key_len: int, window_size: int, device=None, attention_mask=None, compress_ratio: int = 0, compressed_topk=None,
                                   n_pooled: int = 0, vanilla_key_len: Optional[int] = None, q_positions=None, vision_token_types=None, max_image_tokens: int = 0):
    """Int32 ``[B,S,W']`` key slots: a causal local window, then the compressed keys
    (SPEC.md section 6). A torch tensor on ``device`` when torch is importable and no
    argument is a numpy array; a numpy array otherwise."""
    tensors = (attention_mask, compressed_topk, q_positions, vision_token_types)
    import numpy as np

    if torch is not None and not any(isinstance(t, np.ndarray) for t in tensors):
        dev = torch.device(device if device is not None else "cpu")
        return _dsv4.build_sparse_topk_indices(int(batch_size), int(seq_len), int(key_len), int(window_size), dev, attention_mask, int(compress_ratio), compressed_topk,
                                               int(n_pooled), vanilla_key_len, q_positions, vision_token_types, int(max_image_tokens))
    return ops.build_sparse_topk_indices(batch_size, seq_len, key_len, window_size, attention_mask=attention_mask, compress_ratio=compress_ratio, compressed_topk=compressed_topk,
                                         n_pooled=n_pooled, vanilla_key_len=vanilla_key_len, q_positions=q_positions, vision_token_types=vision_token_types,
                                         max_image_tokens=max_image_tokens, backend="torch")


def is_dsv4_kernel_available(name: str) -> bool:
    """Whether this project's GPU kernels for ``name`` (sinkhorn, sparse_attn, indexer,
    qnorm_rope) can run in this process; no side effects. Any other name is a ValueError,
    as in the seeds."""
    if name not in _KERNEL_NAMES:
        raise ValueError(f"Unknown DeepSeek V4 kernel name: {name!r}; expected one of {', '.join(_KERNEL_NAMES)}")
    return bool(_native.is_kernel_available(name))
