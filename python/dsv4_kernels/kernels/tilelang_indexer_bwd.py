"""The seeds' indexer backward entry points (SBHD layout, explicit selections).

The selection is taken as given: every index in ``[0, P)`` contributes (no causal
mask; ``-1`` and out-of-range entries are skipped). Returns ``(grad_q, grad_w, grad_k)``:
``grad_q`` in ``index_q``'s dtype (bf16), ``grad_w`` and ``grad_k`` f32. The kernel scale
is 1 (the V4 weights carry the softmax scale).
"""

from __future__ import annotations

from .. import ops
from .._tensors import is_torch, swap01, torch


def _backward(q, w, k, topk_indices, grad_scores):
    """``q [B,S,H,D]``, ``w [B,S,H]``, ``k [B,P,D]`` -> ``(dq, dw, dk)`` in that layout."""
    p = k.shape[1]
    # compress_ratio 1 with every query placed at or past P: every pooled key is visible.
    if is_torch(q):
        dq, dw, dk = torch.ops.dsv4.indexer_topk_scores_backward(q, k, w, topk_indices, grad_scores, 1.0, 1, int(p), None, "auto", False)
    else:
        dq, dw, dk = ops.indexer_topk_scores_backward(q, k, w, topk_indices, grad_scores, 1.0, 1, "auto", int(p))
    return dq, dw, dk


def batched_indexer_bwd(index_q, weights, index_k, topk_indices, grad_scores):
    """``index_q [S,B,H,D]``, ``weights [S,B,H]``, ``index_k [S_kv,B,D]``, ``topk_indices``
    and ``grad_scores [B,S,topk]`` -> ``(grad_q [S,B,H,D], grad_w [S,B,H], grad_k [S_kv,B,D])``
    (strided views of batch-major results)."""
    dq, dw, dk = _backward(swap01(index_q), swap01(weights), swap01(index_k), topk_indices, grad_scores)
    return swap01(dq), swap01(dw), swap01(dk)


def indexer_bwd_interface(index_q, weights, index_k, topk_indices, grad_scores):
    """One batch element: ``index_q [S,H,D]``, ``weights [S,H]``, ``index_k [S_kv,D]``,
    ``topk_indices``/``grad_scores [S,topk]`` -> ``(grad_q [S,H,D], grad_w [S,H], grad_k [S_kv,D])``."""
    dq, dw, dk = _backward(index_q[None], weights[None], index_k[None], topk_indices[None], grad_scores[None])
    return dq[0], dw[0], dk[0]
