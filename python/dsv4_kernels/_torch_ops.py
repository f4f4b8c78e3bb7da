"""The operations as torch custom ops (namespace ``dsv4``): fake implementations for
tracing and ``register_autograd`` backwards that call our backward ops, so that
``torch.compile(fullgraph=True)`` sees each kernel as one opaque node.

Imported only when torch is importable. Each op's real implementation calls the
array-level function of ``ops`` (outputs from torch's allocator, written in place).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _native, ops

def _workspace(nbytes: int, device: int):
    """Device memory for the CUDA kernels' workspaces, packed copies and plan buffers:
    a uint8 tensor from torch's caching allocator on the current stream (the stream the
    kernels run on), so no call allocates or frees through the driver, torch's memory
    statistics count it, and a CUDA graph capture takes it from the graph's pool."""
    dev = _devices.get(device)
    if dev is None:
        dev = _devices[device] = torch.device("cuda", int(device))
    t = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
    return t.data_ptr(), t


_devices: dict = {}


_native.set_workspace_allocator(_workspace)

# Plans cannot cross the custom-op boundary as objects: ops take a plan id (-1: none).
_plans: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_plan_ids = itertools.count()


def register_plan(plan) -> int:
    pid = next(_plan_ids)
    _plans[pid] = plan
    return pid


def _plan(plan_id: int):
    if plan_id < 0:
        return None
    plan = _plans.get(plan_id)
    if plan is None:
        raise ValueError(f"argument `plan`: plan id {plan_id} is no longer alive; keep the SparseIndexPlan referenced while it is used")
    return plan


def _grads(ctx, *grads):
    """Gradients for the inputs that need them (``None`` elsewhere), padded to the op's arity."""
    needs = ctx.needs_input_grad
    return tuple(g if (i < len(grads) and needs[i]) else None for i, g in enumerate(grads + (None,) * (len(needs) - len(grads))))


# -- sparse attention --------------------------------------------------------------------


@torch.library.custom_op("dsv4::sparse_attention", mutates_args=())
def sparse_attention(q: Tensor, kv: Tensor, sinks: Tensor, topk_idxs: Optional[Tensor], sm_scale: float, backend: str, reference_rounding: bool, all_rows_nonempty: bool,
                     plan_id: int, backward_impl: str, backward_workspace_bytes: int) -> tuple[Tensor, Tensor]:
    """``(out [B,S,H,D] q's dtype, lse [B,S,H] f32)``; the backward options ride along for autograd."""
    return ops.sparse_attention_forward(q, kv, sinks, topk_idxs, sm_scale, backend, reference_rounding=reference_rounding, all_rows_nonempty=all_rows_nonempty, plan=_plan(plan_id))


@sparse_attention.register_fake
def _(q, kv, sinks, topk_idxs, sm_scale, backend, reference_rounding, all_rows_nonempty, plan_id, backward_impl, backward_workspace_bytes):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("dsv4::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(q: Tensor, kv: Tensor, sinks: Tensor, topk_idxs: Optional[Tensor], out: Tensor, lse: Tensor, dout: Tensor, sm_scale: float, backend: str,
                              reference_rounding: bool, all_rows_nonempty: bool, plan_id: int, backward_impl: str, backward_workspace_bytes: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dkv, dsinks)``."""
    return ops.sparse_attention_backward(q, kv, sinks, topk_idxs, out, lse, dout, sm_scale, backend, reference_rounding=reference_rounding, all_rows_nonempty=all_rows_nonempty,
                                         plan=_plan(plan_id), backward_impl=backward_impl, backward_workspace_bytes=backward_workspace_bytes)


@sparse_attention_backward.register_fake
def _(q, kv, sinks, topk_idxs, out, lse, dout, sm_scale, backend, reference_rounding, all_rows_nonempty, plan_id, backward_impl, backward_workspace_bytes):
    return q.new_empty(q.shape), kv.new_empty(kv.shape), q.new_empty(q.shape[2:3], dtype=torch.float32)


def _sparse_attention_setup(ctx, inputs, output):
    q, kv, sinks, topk_idxs, sm_scale, backend, reference_rounding, all_rows_nonempty, plan_id, backward_impl, backward_workspace_bytes = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, sinks, topk_idxs, out, lse)
    ctx.sm_scale = sm_scale
    ctx.backend = backend
    ctx.reference_rounding = reference_rounding
    ctx.all_rows_nonempty = all_rows_nonempty
    ctx.plan_id = plan_id
    ctx.backward_impl = backward_impl
    ctx.backward_workspace_bytes = backward_workspace_bytes
    ctx.mark_non_differentiable(lse)


def _sparse_attention_backward(ctx, grad_out, grad_lse):
    q, kv, sinks, topk_idxs, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dkv, dsinks = call.sparse_attention_backward(q, kv, sinks, topk_idxs, out, lse, grad_out.contiguous(), ctx.sm_scale, ctx.backend, ctx.reference_rounding,
                                                ctx.all_rows_nonempty, ctx.plan_id, ctx.backward_impl, ctx.backward_workspace_bytes)
    return _grads(ctx, dq, dkv, dsinks)


sparse_attention.register_autograd(_sparse_attention_backward, setup_context=_sparse_attention_setup)


@torch.library.custom_op("dsv4::dense_attention_topk", mutates_args=())
def dense_attention_topk(q: Tensor, kv: Tensor, sinks: Tensor, topk_idxs: Tensor, sm_scale: float, backend: str) -> Tensor:
    """The dense oracle (forward only)."""
    return ops.dense_attention(q, kv, sinks, topk_idxs, sm_scale, backend)


@dense_attention_topk.register_fake
def _(q, kv, sinks, topk_idxs, sm_scale, backend):
    return q.new_empty(q.shape)


# -- lightning indexer -------------------------------------------------------------------


@torch.library.custom_op("dsv4::indexer_scores", mutates_args=())
def indexer_scores(q: Tensor, pooled_kv: Tensor, weights: Tensor, softmax_scale: float, compress_ratio: int, query_start: int, query_total_len: Optional[int], backend: str) -> Tensor:
    """Scores ``[B,S,P]`` f32 with the causal ``-inf``."""
    return ops.indexer_scores(q, pooled_kv, weights, softmax_scale, compress_ratio, backend, query_start, query_total_len)


@indexer_scores.register_fake
def _(q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, backend):
    return q.new_empty((q.shape[0], q.shape[1], pooled_kv.shape[1]), dtype=torch.float32)


def _indexer_scores_setup(ctx, inputs, output):
    q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, backend = inputs
    ctx.save_for_backward(q, pooled_kv, weights)
    ctx.softmax_scale, ctx.compress_ratio, ctx.query_start, ctx.query_total_len, ctx.backend = softmax_scale, compress_ratio, query_start, query_total_len, backend


def _indexer_scores_backward(ctx, grad):
    # Every pooled key is a selected slot: the scores are indexer_topk_scores at 0..P-1.
    q, pooled_kv, weights = ctx.saved_tensors
    b, s, p = q.shape[0], q.shape[1], pooled_kv.shape[1]
    every = torch.arange(p, dtype=torch.int32, device=q.device).expand(b, s, p)
    dq, dw, dkv = call.indexer_topk_scores_backward(q, pooled_kv, weights, every, grad.contiguous(), ctx.softmax_scale, ctx.compress_ratio, ctx.query_start, ctx.query_total_len, ctx.backend, False)
    return _grads(ctx, dq, dkv.to(pooled_kv.dtype), dw)


indexer_scores.register_autograd(_indexer_scores_backward, setup_context=_indexer_scores_setup)


def _topk_fake(like, b, s, p, k):
    kk = torch.sym_min(k, p)
    return like.new_empty((b, s, kk), dtype=torch.int32), like.new_empty((b, s, kk), dtype=torch.float32)


@torch.library.custom_op("dsv4::indexer_topk", mutates_args=())
def indexer_topk(scores: Tensor, k: int, backend: str) -> tuple[Tensor, Tensor]:
    """``(indices [B,S,min(k,P)] i32, values f32)``."""
    return ops.indexer_topk(scores, k, backend)


@indexer_topk.register_fake
def _(scores, k, backend):
    return _topk_fake(scores, scores.shape[0], scores.shape[1], scores.shape[2], k)


@torch.library.custom_op("dsv4::lightning_indexer", mutates_args=())
def lightning_indexer(q: Tensor, pooled_kv: Tensor, weights: Tensor, softmax_scale: float, compress_ratio: int, query_start: int, query_total_len: Optional[int], k: int,
                      backend: str) -> tuple[Tensor, Tensor]:
    """Scores + top-k fused: ``(indices [B,S,min(k,P)] i32, values f32)``."""
    return ops.lightning_indexer(q, pooled_kv, weights, softmax_scale, compress_ratio, k, backend, query_start, query_total_len)


@lightning_indexer.register_fake
def _(q, pooled_kv, weights, softmax_scale, compress_ratio, query_start, query_total_len, k, backend):
    return _topk_fake(q, q.shape[0], q.shape[1], pooled_kv.shape[1], k)


@torch.library.custom_op("dsv4::indexer_topk_scores", mutates_args=())
def indexer_topk_scores(q: Tensor, pooled_kv: Tensor, weights: Tensor, topk_indices: Tensor, softmax_scale: float, compress_ratio: int, query_start: int,
                        query_total_len: Optional[int], backend: str) -> Tensor:
    """Scores of a selection ``[B,S,T]`` f32."""
    return ops.indexer_topk_scores(q, pooled_kv, weights, topk_indices, softmax_scale, compress_ratio, backend, query_start, query_total_len)


@indexer_topk_scores.register_fake
def _(q, pooled_kv, weights, topk_indices, softmax_scale, compress_ratio, query_start, query_total_len, backend):
    return q.new_empty(topk_indices.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4::indexer_topk_scores_backward", mutates_args=())
def indexer_topk_scores_backward(q: Tensor, pooled_kv: Tensor, weights: Tensor, topk_indices: Tensor, grad: Tensor, softmax_scale: float, compress_ratio: int, query_start: int,
                                 query_total_len: Optional[int], backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq q's dtype, dweights f32, dpooled_kv f32)``."""
    return ops.indexer_topk_scores_backward(q, pooled_kv, weights, topk_indices, grad, softmax_scale, compress_ratio, backend, query_start, query_total_len, deterministic=deterministic)


@indexer_topk_scores_backward.register_fake
def _(q, pooled_kv, weights, topk_indices, grad, softmax_scale, compress_ratio, query_start, query_total_len, backend, deterministic):
    return q.new_empty(q.shape), q.new_empty(weights.shape, dtype=torch.float32), q.new_empty(pooled_kv.shape, dtype=torch.float32)


def _indexer_topk_scores_setup(ctx, inputs, output):
    q, pooled_kv, weights, topk_indices, softmax_scale, compress_ratio, query_start, query_total_len, backend = inputs
    ctx.save_for_backward(q, pooled_kv, weights, topk_indices)
    ctx.softmax_scale, ctx.compress_ratio, ctx.query_start, ctx.query_total_len, ctx.backend = softmax_scale, compress_ratio, query_start, query_total_len, backend


def _indexer_topk_scores_backward(ctx, grad):
    q, pooled_kv, weights, topk_indices = ctx.saved_tensors
    dq, dw, dkv = call.indexer_topk_scores_backward(q, pooled_kv, weights, topk_indices, grad.contiguous(), ctx.softmax_scale, ctx.compress_ratio, ctx.query_start, ctx.query_total_len, ctx.backend, False)
    return _grads(ctx, dq, dkv.to(pooled_kv.dtype), dw)


indexer_topk_scores.register_autograd(_indexer_topk_scores_backward, setup_context=_indexer_topk_scores_setup)


# -- Sinkhorn ----------------------------------------------------------------------------


@torch.library.custom_op("dsv4::sinkhorn", mutates_args=())
def sinkhorn(x: Tensor, repeat: int, eps: float, backend: str) -> Tensor:
    return ops.sinkhorn_forward(x, repeat, eps, backend)


@sinkhorn.register_fake
def _(x, repeat, eps, backend):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dsv4::sinkhorn_backward", mutates_args=())
def sinkhorn_backward(x: Tensor, dout: Tensor, repeat: int, eps: float, backend: str) -> Tensor:
    return ops.sinkhorn_backward(x, dout, repeat, eps, backend)


@sinkhorn_backward.register_fake
def _(x, dout, repeat, eps, backend):
    return x.new_empty(x.shape, dtype=torch.float32)


def _sinkhorn_setup(ctx, inputs, output):
    x, repeat, eps, backend = inputs
    ctx.save_for_backward(x)
    ctx.repeat, ctx.eps, ctx.backend = repeat, eps, backend


def _sinkhorn_backward(ctx, dout):
    (x,) = ctx.saved_tensors
    # Non-contiguous dout (a transposed matmul site's gradient) is taken as it is.
    return _grads(ctx, call.sinkhorn_backward(x, dout, ctx.repeat, ctx.eps, ctx.backend))


sinkhorn.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup)


# -- qnorm_rope --------------------------------------------------------------------------


def _token_major_fake(x):
    b, h, s, c = x.shape
    return x.new_empty_strided((b, h, s, c), (s * h * c, c, h * c, 1))


@torch.library.custom_op("dsv4::qnorm_rope", mutates_args=())
def qnorm_rope(x: Tensor, cos: Tensor, sin: Tensor, rotary: int, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    """``(out logical [B,H,S,C] token-major, rstd [B*S*H] f32)``."""
    return ops.qnorm_rope_forward(x, cos, sin, rotary, eps, backend)


@qnorm_rope.register_fake
def _(x, cos, sin, rotary, eps, backend):
    b, h, s, _ = x.shape
    return _token_major_fake(x), x.new_empty((b * s * h,), dtype=torch.float32)


@torch.library.custom_op("dsv4::qnorm_rope_backward", mutates_args=())
def qnorm_rope_backward(x: Tensor, cos: Tensor, sin: Tensor, rotary: int, eps: float, rstd: Tensor, grad: Tensor, backend: str) -> Tensor:
    return ops.qnorm_rope_backward(x, cos, sin, rotary, eps, rstd, grad, backend)


@qnorm_rope_backward.register_fake
def _(x, cos, sin, rotary, eps, rstd, grad, backend):
    return _token_major_fake(x)


def _qnorm_rope_setup(ctx, inputs, output):
    x, cos, sin, rotary, eps, backend = inputs
    _, rstd = output
    ctx.save_for_backward(x, cos, sin, rstd)
    ctx.rotary, ctx.eps, ctx.backend = rotary, eps, backend
    ctx.mark_non_differentiable(rstd)


def _qnorm_rope_backward(ctx, grad, grad_rstd):
    x, cos, sin, rstd = ctx.saved_tensors
    # grad may have any strides (the kernel reads them).
    return _grads(ctx, call.qnorm_rope_backward(x, cos, sin, ctx.rotary, ctx.eps, rstd, grad, ctx.backend))


qnorm_rope.register_autograd(_qnorm_rope_backward, setup_context=_qnorm_rope_setup)


# -- index construction ------------------------------------------------------------------


@torch.library.custom_op("dsv4::build_sparse_topk_indices", mutates_args=())
def build_sparse_topk_indices(batch_size: int, seq_len: int, key_len: int, window_size: int, device: torch.device, attention_mask: Optional[Tensor], compress_ratio: int,
                              compressed_topk: Optional[Tensor], n_pooled: int, vanilla_key_len: Optional[int], q_positions: Optional[Tensor], vision_token_types: Optional[Tensor],
                              max_image_tokens: int) -> Tensor:
    """``[B,S,W']`` int32 on ``device``."""
    like = torch.empty(0, device=device)
    return ops.build_sparse_topk_indices(batch_size, seq_len, key_len, window_size, like=like, attention_mask=attention_mask, compress_ratio=compress_ratio,
                                         compressed_topk=compressed_topk, n_pooled=n_pooled, vanilla_key_len=vanilla_key_len, q_positions=q_positions,
                                         vision_token_types=vision_token_types, max_image_tokens=max_image_tokens)


@build_sparse_topk_indices.register_fake
def _(batch_size, seq_len, key_len, window_size, device, attention_mask, compress_ratio, compressed_topk, n_pooled, vanilla_key_len, q_positions, vision_token_types, max_image_tokens):
    width = ops.build_indices_width(seq_len, key_len, window_size, compress_ratio, compressed_topk, n_pooled, vanilla_key_len, vision_token_types is not None, max_image_tokens, batch_size)
    return torch.empty((batch_size, seq_len, width), dtype=torch.int32, device=device)


# -- calls -------------------------------------------------------------------------------


_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def _plain(args):
    """The arguments for the eager path, or None where a call must take the custom-op
    dispatcher: a torch.compile trace, a dispatch mode (make_fx, fake or functional
    tensors), a functorch transform, or a tensor subclass. A tensor that outlived a
    functorch transform is unwrapped first, as ``autograd.Function.apply`` does."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or (_transforms_active is not None and _transforms_active()):
        return None
    for a in args:
        if isinstance(a, Tensor):
            if type(a) is not Tensor:
                return None
            if _unwrap_if_dead is not None and _unwrap_if_dead(a) is not a:
                return tuple(_unwrap_if_dead(x) if isinstance(x, Tensor) else x for x in args)
    return args


def _eager_function(name, impl, setup, backward):
    """The op as a ``torch.autograd.Function`` over the same implementation, context setup
    and backward that the custom op registers (a ``forward(ctx, ...)`` that runs both: a
    separate ``setup_context`` would make every call bind its arguments by inspection).
    Returns its C-level ``apply``: ``Function.apply``'s Python only binds defaults for a
    ``setup_context`` (there is none), routes functorch transforms and unwraps dead
    wrappers, which ``_plain`` has already decided."""

    def forward(ctx, *args):
        output = impl(*args)
        setup(ctx, args, output)
        return output

    fn = type(f"_{name}_function", (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return super(torch.autograd.Function, fn).apply


class _Calls:
    """The ops as the package calls them. While torch.compile or another tracer runs, the
    ``torch.ops.dsv4`` custom ops (one opaque node each, with their fake kernels). In eager
    mode the same implementations directly, through a ``torch.autograd.Function`` where the
    op has a backward: the results, the autograd graph and the streams are the same, without
    the custom-op dispatcher's Python on every call (tens of microseconds a call, more than
    our own launch path)."""

    def add(self, op, setup=None, backward=None):
        impl = getattr(op, "_init_fn", None)
        if impl is None:  # a torch without CustomOpDef._init_fn: the custom op every time
            eager = op
        elif backward is None:
            eager = impl
        else:
            eager = _eager_function(op._name, impl, setup, backward)

        def call(*args):
            plain = _plain(args)
            return op(*args) if plain is None else eager(*plain)

        call.__name__ = call.__qualname__ = op._name
        call.__doc__ = impl.__doc__ if impl is not None else None
        setattr(self, op._name, call)


call = _Calls()
call.add(sparse_attention, _sparse_attention_setup, _sparse_attention_backward)
call.add(sparse_attention_backward)
call.add(dense_attention_topk)
call.add(indexer_scores, _indexer_scores_setup, _indexer_scores_backward)
call.add(indexer_topk)
call.add(lightning_indexer)
call.add(indexer_topk_scores, _indexer_topk_scores_setup, _indexer_topk_scores_backward)
call.add(indexer_topk_scores_backward)
call.add(sinkhorn, _sinkhorn_setup, _sinkhorn_backward)
call.add(sinkhorn_backward)
call.add(qnorm_rope, _qnorm_rope_setup, _qnorm_rope_backward)
call.add(qnorm_rope_backward)
call.add(build_sparse_topk_indices)
