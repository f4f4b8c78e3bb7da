"""The seeds' V4 lightning indexer in V4's native SBHD layout.

``index_q [S,B,H,D]`` bf16, ``index_k [S_kv,B,D]`` bf16 (the pooled keys), ``weights
[S,B,H]`` f32 (the softmax and head scales already folded in, so the kernel scale is 1).
Returns ``(scores [B,S,k'] f32, topk_indices [B,S,k'] int32)`` with ``k' = min(topk, S_kv)``
(as the seeds' ``torch.topk`` over the pooled keys): pooled key ``p`` is visible to query
``s`` when ``p < (s + 1) // compress_ratio``; indices are ordered by descending score,
``-1`` (score ``-inf``) past a row's visible count. With ``topk_indices`` given, those
indices come back as given with their scores (``[B,S,T]``, T their width). The layout
change is a view (no copy).
"""

from __future__ import annotations

from typing import Optional

from .. import ops
from .._tensors import is_torch, swap01, torch

_SCALE = 1.0  # the V4 weights carry the softmax scale


def pytorch_extract_topk_scores(logits, topk_indices, dim=-1):
    """Gather ``logits`` at ``topk_indices`` along ``dim``; ``-inf`` wherever the index is
    outside ``[0, logits.shape[dim])`` (``-1`` and the like)."""
    from ..optimized_kernels import _gather_scores

    return _gather_scores(logits, topk_indices, dim)


if torch is not None:
    _dsv4 = torch.ops.dsv4

    class V4IndexerFunction(torch.autograd.Function):
        """Autograd function for the V4 indexer; inputs in V4's SBHD layout:
        q ``[seqlen, batch, heads, dim]`` bf16, k ``[seqlen_kv, batch, dim]`` bf16,
        weights ``[seqlen, batch, heads]`` f32."""

        @staticmethod
        def forward(ctx, index_q, index_k, weights, compress_ratio: int, topk: int, topk_indices: Optional[torch.Tensor] = None):
            q, k, w = swap01(index_q), swap01(index_k), swap01(weights)
            if topk_indices is None:
                indices, scores = _dsv4.lightning_indexer(q, k, w, _SCALE, int(compress_ratio), 0, None, int(topk), "auto")
            else:
                indices = topk_indices
                scores = _dsv4.indexer_topk_scores(q, k, w, indices, _SCALE, int(compress_ratio), 0, None, "auto")
            ctx.save_for_backward(index_q, index_k, weights, indices)
            ctx.compress_ratio = int(compress_ratio)
            ctx.mark_non_differentiable(indices)
            return scores, indices

        @staticmethod
        def backward(ctx, grad_scores, grad_indices):
            index_q, index_k, weights, indices = ctx.saved_tensors
            needs_q, needs_k, needs_w = ctx.needs_input_grad[:3]
            if not (needs_q or needs_k or needs_w):
                return None, None, None, None, None, None
            dq, dw, dk = _dsv4.indexer_topk_scores_backward(swap01(index_q), swap01(index_k), swap01(weights), indices, grad_scores.contiguous(), _SCALE, ctx.compress_ratio, 0,
                                                            None, "auto", False)
            return (swap01(dq) if needs_q else None, swap01(dk).to(index_k.dtype) if needs_k else None, swap01(dw) if needs_w else None, None, None, None)

else:

    class V4IndexerFunction:  # type: ignore[no-redef]
        """Without torch: ``apply`` runs the forward on numpy arrays (no autograd)."""

        @staticmethod
        def apply(index_q, index_k, weights, compress_ratio, topk, topk_indices=None):
            return _numpy_forward(index_q, index_k, weights, compress_ratio, topk, topk_indices)


def _numpy_forward(index_q, index_k, weights, compress_ratio, topk, topk_indices):
    q, k, w = swap01(index_q), swap01(index_k), swap01(weights)
    if topk_indices is None:
        indices, scores = ops.lightning_indexer(q, k, w, _SCALE, compress_ratio, topk, "auto")
        return scores, indices
    return ops.indexer_topk_scores(q, k, w, topk_indices, _SCALE, compress_ratio, "auto"), topk_indices


def v4_lighting_indexer(index_q, index_k, weights, compress_ratio: int, topk: int, topk_indices=None):
    """Main entry point of the V4 indexer: ``(scores [B,S,k'] f32, indices [B,S,k'] int32)``,
    ``k' = min(topk, S_kv)`` (``[B,S,T]`` with ``topk_indices [B,S,T]`` given)."""
    if is_torch(index_q):
        return V4IndexerFunction.apply(index_q, index_k, weights, compress_ratio, topk, topk_indices)
    return _numpy_forward(index_q, index_k, weights, compress_ratio, topk, topk_indices)
