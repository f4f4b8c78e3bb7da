"""The seeds' training Q RMSNorm + partial interleaved RoPE in token-major storage.

Two bf16 rounding boundaries, as the seeds: normalise before rotating, and rotate the
upstream gradient back before the RMSNorm backward (SPEC.md section 5).
"""

from __future__ import annotations

from .. import ops
from .._tensors import is_torch, torch


def qnorm_rope_triton(x, cos, sin, rotary: int, eps: float):
    """Normalise ``x`` (logical ``[batch, heads, sequence, channels]``, any strides) and rotate
    its trailing ``rotary`` interleaved channel pairs with ``cos``/``sin [batch, sequence,
    rotary]`` f32 (the first half holds the pair frequencies). Returns x's logical shape in
    x's dtype with token-major storage (``out.transpose(1, 2)`` is contiguous)."""
    if is_torch(x):
        out, _ = torch.ops.dsv4.qnorm_rope(x, cos, sin, int(rotary), float(eps), "auto")
        return out
    out, _ = ops.qnorm_rope_forward(x, cos, sin, rotary, eps, "auto")
    return out


qnorm_rope = qnorm_rope_triton
