"""dsv4_kernels: DeepSeek-V4 attention-layer training kernels, a drop-in for NeMo
AutoModel's ``deepseek_v4`` kernel functions (same names, arguments and defaults).

torch is optional: with torch, every function takes torch tensors (CPU or CUDA) and is
differentiable through ``torch.ops.dsv4`` custom ops; without it, numpy arrays run on the
CPU reference. :mod:`dsv4_kernels.ops` has the array-level forms with ``out=``.
"""

from . import _native, ops
from ._native import BackendUnavailableError
from .kernels.qnorm_rope import qnorm_rope, qnorm_rope_triton
from .kernels.tilelang_indexer import V4IndexerFunction, pytorch_extract_topk_scores, v4_lighting_indexer
from .kernels.tilelang_indexer_bwd import batched_indexer_bwd, indexer_bwd_interface
from .optimized_kernels import (
    SparseIndexPlan,
    build_dsv4_sparse_topk_indices,
    dense_attention_topk_torch,
    dsv4_indexer_scores,
    dsv4_indexer_topk_scores,
    dsv4_sinkhorn_normalize,
    dsv4_sparse_attention,
    extract_indexer_topk_scores_torch,
    indexer_scores_torch,
    is_dsv4_kernel_available,
    plan_dsv4_sparse_indices,
    sinkhorn_normalize_torch,
    sparse_attention_torch,
)


def describe() -> list:
    """Lines describing the backends this process can use."""
    return list(_native.describe())


__all__ = [
    "BackendUnavailableError",
    "SparseIndexPlan",
    "V4IndexerFunction",
    "batched_indexer_bwd",
    "build_dsv4_sparse_topk_indices",
    "dense_attention_topk_torch",
    "describe",
    "dsv4_indexer_scores",
    "dsv4_indexer_topk_scores",
    "dsv4_sinkhorn_normalize",
    "dsv4_sparse_attention",
    "extract_indexer_topk_scores_torch",
    "indexer_bwd_interface",
    "indexer_scores_torch",
    "is_dsv4_kernel_available",
    "ops",
    "plan_dsv4_sparse_indices",
    "pytorch_extract_topk_scores",
    "qnorm_rope",
    "qnorm_rope_triton",
    "sinkhorn_normalize_torch",
    "sparse_attention_torch",
    "v4_lighting_indexer",
]
