"""Seeds-style torch references (plain torch ops, differentiable), the oracles of the
torch tests: computed in the inputs' dtype promoted to f64 unless stated."""

from __future__ import annotations

import torch


def sparse_attention_ref(q, kv, sinks, idx, scale):
    """SPEC.md section 1 by gather: a duplicated key counts twice; empty rows give 0."""
    b, s, h, d = q.shape
    k = kv.shape[1]
    valid = (idx >= 0) & (idx < k)
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    g = torch.gather(kv.unsqueeze(1).expand(b, s, k, d), 2, safe.unsqueeze(-1).expand(b, s, idx.shape[2], d))  # [b,s,t,d]
    logits = torch.einsum("bshd,bstd->bsht", q, g) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink = sinks.view(1, 1, h, 1).expand(b, s, h, 1).to(logits.dtype)
    z = torch.cat([logits, sink], -1)
    p = torch.softmax(z, -1)[..., :-1]
    return torch.einsum("bsht,bstd->bshd", p, g)


def indexer_topk_scores_ref(q, kv, w, idx, scale, ratio, query_start=0):
    """SPEC.md section 3: ``score`` at valid, causally visible slots, else -inf."""
    b, s, h, d = q.shape
    p = kv.shape[1]
    a = torch.einsum("bshd,bpd->bshp", q, kv).relu()
    scores = scale * torch.einsum("bsh,bshp->bsp", w, a)
    visible = (torch.arange(p, device=q.device).view(1, 1, p) < ((query_start + torch.arange(s, device=q.device) + 1) // ratio).view(1, s, 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    ok = (idx >= 0) & (idx < p)
    got = torch.gather(scores, 2, torch.where(ok, idx, torch.zeros_like(idx)).long())
    return torch.where(ok, got, torch.full_like(got, float("-inf")))


def sinkhorn_ref(x, repeat, eps):
    y = torch.softmax(x, -1) + eps
    y = y / (y.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        y = y / (y.sum(-1, keepdim=True) + eps)
        y = y / (y.sum(-2, keepdim=True) + eps)
    return y


def qnorm_rope_ref(x, cos, sin, rd, eps):
    """The anchors' composite: rms_norm then interleaved RoPE on the last ``rd`` channels."""
    y = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
    half = rd // 2
    pairs = y[..., -rd:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[..., :half].float().unsqueeze(1), sin[..., :half].float().unsqueeze(1)
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).to(y.dtype)
    return torch.cat([y[..., :-rd], rot], -1)


def rel(a, b):
    """||a - b|| / ||b|| over b's finite entries, after checking that -inf/NaN sit where b's do."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), "-inf/NaN placement differs"
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()
