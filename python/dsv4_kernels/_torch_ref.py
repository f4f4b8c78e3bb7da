"""SPEC.md's formulas as plain torch composites: what ``backend="torch"`` (and
``"sparse_torch"``) runs for torch tensors, on the tensors' own device, differentiable
through torch autograd and traceable by ``torch.compile``.

These are the seeds' torch fallbacks re-derived from the contract, with the contract's
edge cases settled: arithmetic in f32 (bf16 inputs are widened first), results in the
seeds' dtypes (attention in q's dtype, indexer scores f32, Sinkhorn in x's dtype), an
index outside ``[0, K)`` is a masked slot that is never dereferenced, and a query row with
no valid slot gives ``out = 0`` with zero (never NaN) gradients. Imported only when torch is
importable.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_ATTENTION_DTYPES = (torch.bfloat16, torch.float32)
_NEG_INF = float("-inf")


# -- argument checks (shapes and dtypes only: nothing here reads tensor values) ----------


def _rank(x, op: str, name: str, rank: int) -> tuple:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: argument `{name}` must be a torch tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{op}: argument `{name}` has shape {list(x.shape)}, expected rank {rank}")
    return tuple(x.shape)


def _integer(x, op: str, name: str) -> None:
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{op}: argument `{name}` has dtype {x.dtype}, expected an integer dtype")


def _floating(x, op: str, name: str) -> None:
    if not x.dtype.is_floating_point:
        raise TypeError(f"{op}: argument `{name}` has dtype {x.dtype}, expected a floating dtype")


def _same_device(op: str, **tensors) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for n, d in devices.items():
        if d != first:
            raise RuntimeError(f"{op}: argument `{n}` is on {d}, the others on {first}; the torch backend runs where the tensors are")


def check_attention(op: str, q, kv, sinks, topk_idxs) -> None:
    """SPEC.md section 1's argument contract: ``q [B,S,H,D]`` bf16/f32, ``kv [B,K,D]`` of
    q's dtype, ``sinks [H]`` floating, ``topk_idxs [B,S,T]`` integer."""
    b, s, h, d = _rank(q, op, "q", 4)
    if q.dtype not in _ATTENTION_DTYPES:
        raise TypeError(f"{op}: argument `q` has dtype {q.dtype}, expected torch.bfloat16 or torch.float32")
    kb, _, kd = _rank(kv, op, "kv", 3)
    if kv.dtype != q.dtype:
        raise TypeError(f"{op}: argument `kv` has dtype {kv.dtype}, expected q's dtype {q.dtype}")
    if kb != b or kd != d:
        raise ValueError(f"{op}: argument `kv` has shape {list(kv.shape)}, expected [{b}, K, {d}]")
    _rank(sinks, op, "sinks", 1)
    _floating(sinks, op, "sinks")
    if sinks.shape[0] != h:
        raise ValueError(f"{op}: argument `sinks` has shape {list(sinks.shape)}, expected [{h}]")
    ib, is_, _ = _rank(topk_idxs, op, "topk_idxs", 3)
    _integer(topk_idxs, op, "topk_idxs")
    if (ib, is_) != (b, s):
        raise ValueError(f"{op}: argument `topk_idxs` has shape {list(topk_idxs.shape)}, expected [{b}, {s}, T]")
    _same_device(op, q=q, kv=kv, sinks=sinks, topk_idxs=topk_idxs)


def check_indexer(op: str, q, pooled_kv, weights, compress_ratio: Optional[int] = None, query_start: int = 0, query_total_len: Optional[int] = None) -> None:
    """SPEC.md section 2's argument contract: ``q [B,S,H,D]``, ``pooled_kv [B,P,D]``,
    ``weights [B,S,H]``, all floating; ``compress_ratio >= 1``; the query block
    ``[query_start, query_start + S)`` inside ``query_total_len``."""
    b, s, h, d = _rank(q, op, "q", 4)
    _floating(q, op, "q")
    kb, _, kd = _rank(pooled_kv, op, "pooled_kv", 3)
    _floating(pooled_kv, op, "pooled_kv")
    if kb != b or kd != d:
        raise ValueError(f"{op}: argument `pooled_kv` has shape {list(pooled_kv.shape)}, expected [{b}, P, {d}]")
    if tuple(_rank(weights, op, "weights", 3)) != (b, s, h):
        raise ValueError(f"{op}: argument `weights` has shape {list(weights.shape)}, expected [{b}, {s}, {h}]")
    _floating(weights, op, "weights")
    if compress_ratio is not None and int(compress_ratio) < 1:
        raise ValueError(f"{op}: argument `compress_ratio` = {compress_ratio}, expected >= 1")
    if query_start < 0:
        raise ValueError(f"{op}: argument `query_start` = {query_start}, expected >= 0")
    if query_total_len is not None and query_start + s > query_total_len:
        raise ValueError(f"{op}: argument `query_total_len` = {query_total_len} is shorter than query_start + S = {query_start + s}")
    _same_device(op, q=q, pooled_kv=pooled_kv, weights=weights)


# -- sparse attention (SPEC.md section 1) ------------------------------------------------


def _attend(logits: Tensor, values: Tensor, sinks: Tensor, equation: str) -> Tensor:
    """``softmax([logits, sink]) @ values`` without the sink column's value (it is zero).

    ``logits [B,S,H,N]`` f32 with ``-inf`` at masked keys; the sink joins the row's
    softmax as one more logit, so the row maximum includes it: a row whose keys are all
    masked gets probability 1 on the sink, ``out = 0`` and finite gradients."""
    b, s, h, _ = logits.shape
    sink = sinks.float().view(1, 1, h, 1).expand(b, s, h, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum(equation, probs, values)


def sparse_attention(q: Tensor, kv: Tensor, sinks: Tensor, topk_idxs: Tensor, sm_scale: float) -> Tensor:
    """``out [B,S,H,D]`` in q's dtype: each query attends to the keys its slots name,
    gathered (a key named twice counts twice); ``l_t = sm_scale * <q, kv[idx_t]>``,
    ``out = sum_t exp(l_t) kv[idx_t] / (sum_t exp(l_t) + exp(sinks[h]))``."""
    b, s, _, d = q.shape
    n_keys, t = kv.shape[1], topk_idxs.shape[-1]
    valid = (topk_idxs >= 0) & (topk_idxs < n_keys)  # [B,S,T]
    safe = torch.where(valid, topk_idxs, torch.zeros_like(topk_idxs)).long()
    if n_keys == 0:  # nothing to gather: every slot is masked
        picked = kv.new_zeros((b, s, t, d), dtype=torch.float32)
    else:
        # Rows of the flattened [B*K, D] keys (its backward adds into dkv, never a [B,S,K,D] buffer).
        rows = safe + (torch.arange(b, device=kv.device) * n_keys).view(b, 1, 1)
        picked = kv.float().reshape(b * n_keys, d).index_select(0, rows.reshape(-1)).view(b, s, t, d)  # [B,S,T,D]
    logits = torch.einsum("bshd,bstd->bsht", q.float(), picked) * float(sm_scale)
    logits = logits.masked_fill(~valid.unsqueeze(2), _NEG_INF)
    return _attend(logits, picked, sinks, "bsht,bstd->bshd").to(q.dtype)


def dense_attention_topk(q: Tensor, kv: Tensor, sinks: Tensor, topk_idxs: Tensor, sm_scale: float) -> Tensor:
    """The dense oracle: the same formula over the *set* of valid keys of each row
    (duplicates collapse), as a masked ``[B,S,H,K]`` softmax. ``out`` in q's dtype."""
    b, s, _, _ = q.shape
    n_keys = kv.shape[1]
    valid = (topk_idxs >= 0) & (topk_idxs < n_keys)
    # One sentinel column past the keys takes every masked slot, so -1 never lands on key 0.
    slot = torch.where(valid, topk_idxs, torch.full_like(topk_idxs, n_keys)).long()
    allowed = torch.zeros((b, s, n_keys + 1), dtype=torch.bool, device=q.device).scatter_(-1, slot, True)[..., :n_keys]
    kv32 = kv.float()
    logits = torch.einsum("bshd,bkd->bshk", q.float(), kv32) * float(sm_scale)
    logits = logits.masked_fill(~allowed.unsqueeze(2), _NEG_INF)
    return _attend(logits, kv32, sinks, "bshk,bkd->bshd").to(q.dtype)


# -- lightning indexer (SPEC.md sections 2 and 3) ----------------------------------------


def _visible(s: int, p: int, compress_ratio: int, query_start: int, device) -> Tensor:
    """``[1,S,P]`` bool: pooled key ``p`` is visible to query ``s`` when
    ``p < (query_start + s + 1) // compress_ratio``."""
    ends = (torch.arange(s, device=device) + (int(query_start) + 1)) // int(compress_ratio)
    return torch.arange(p, device=device).view(1, 1, p) < ends.view(1, s, 1)


def indexer_scores(q: Tensor, pooled_kv: Tensor, weights: Tensor, softmax_scale: float, compress_ratio: Optional[int] = None, query_start: int = 0) -> Tensor:
    """``[B,S,P]`` f32: ``sum_h weights[b,s,h] * softmax_scale * relu(<q[b,s,h], pooled_kv[b,p]>)``,
    and ``-inf`` where ``p`` is not causally visible (no mask when ``compress_ratio`` is None,
    as the seeds' ``indexer_scores_torch``)."""
    dots = torch.einsum("bshd,bpd->bshp", q.float(), pooled_kv.float())
    scores = (torch.relu(dots) * float(softmax_scale) * weights.float().unsqueeze(-1)).sum(dim=2)
    if compress_ratio is None:
        return scores
    return scores.masked_fill(~_visible(q.shape[1], pooled_kv.shape[1], compress_ratio, query_start, q.device), _NEG_INF)


def gather_scores(logits: Tensor, topk_indices: Tensor, dim: int = -1) -> Tensor:
    """``logits`` gathered at ``topk_indices`` along ``dim``; ``-inf`` where an index is
    outside ``[0, n)`` (``n = logits.shape[dim]``), which is never dereferenced."""
    n = logits.shape[dim]
    valid = (topk_indices >= 0) & (topk_indices < n)
    if n == 0:
        return torch.full(topk_indices.shape, _NEG_INF, dtype=logits.dtype, device=logits.device)
    safe = torch.where(valid, topk_indices, torch.zeros_like(topk_indices)).long()
    got = torch.gather(logits, dim, safe)
    return torch.where(valid, got, torch.full((), _NEG_INF, dtype=got.dtype, device=got.device))


def indexer_topk_scores(q: Tensor, pooled_kv: Tensor, weights: Tensor, topk_indices: Tensor, softmax_scale: float, compress_ratio: int, query_start: int = 0) -> Tensor:
    """``[B,S,T]`` f32: the causal indexer score at each selected pooled key, ``-inf`` at a
    masked slot or a key the query cannot see."""
    _integer(topk_indices, "indexer_topk_scores", "topk_indices")
    return gather_scores(indexer_scores(q, pooled_kv, weights, softmax_scale, compress_ratio, query_start), topk_indices, -1)


# -- Sinkhorn (SPEC.md section 4) --------------------------------------------------------


def sinkhorn(x: Tensor, repeat: int, eps: float) -> Tensor:
    """Softmax over the last axis plus ``eps``, a column normalisation, then ``repeat - 1``
    row + column rounds (each ``u / (sum u + eps)``). f32 arithmetic for half inputs;
    result in x's dtype."""
    _floating(x, "sinkhorn_normalize", "x")
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"sinkhorn_normalize: argument `x` has shape {list(x.shape)}, expected [..., n, n]")
    if int(repeat) < 1:
        raise ValueError(f"sinkhorn_normalize: argument `repeat` = {repeat}, expected >= 1")
    if not float(eps) >= 0.0:
        raise ValueError(f"sinkhorn_normalize: argument `eps` = {eps}, expected >= 0")
    y = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    y = torch.softmax(y, dim=-1) + eps
    y = y / (y.sum(dim=-2, keepdim=True) + eps)
    for _ in range(int(repeat) - 1):
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
        y = y / (y.sum(dim=-2, keepdim=True) + eps)
    return y.to(x.dtype)
