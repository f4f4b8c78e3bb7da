"""The seeds' ``deepseek_v4.kernels`` modules: the V4 lightning indexer, its backward, and
the fused Q RMSNorm + RoPE."""

from .qnorm_rope import qnorm_rope_triton
from .tilelang_indexer import V4IndexerFunction, pytorch_extract_topk_scores, v4_lighting_indexer
from .tilelang_indexer_bwd import batched_indexer_bwd, indexer_bwd_interface

__all__ = ["V4IndexerFunction", "batched_indexer_bwd", "indexer_bwd_interface", "pytorch_extract_topk_scores", "qnorm_rope_triton", "v4_lighting_indexer"]
