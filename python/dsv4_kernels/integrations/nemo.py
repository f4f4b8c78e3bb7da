"""NeMo AutoModel (0.7.0) DeepSeek-V4 layers on this project's kernels, in one call.

``apply_dsv4_kernels_to_nemo()`` rebinds, in the modules that imported them, the seeds'
functions that NeMo's DeepSeek-V4 and V4.1 layers call:

- ``deepseek_v4.layers``: ``dsv4_sparse_attention``, ``build_dsv4_sparse_topk_indices``,
  ``dsv4_indexer_scores``, ``dsv4_sinkhorn_normalize``; and ``_dsv4_kernel_backend`` /
  ``_dsv4_sinkhorn_backend`` answer ``"tilelang"`` / ``"auto"``, so ``DeepseekV4Attention``
  takes its sparse path (top-k index builder + sparse attention) whatever its
  ``BackendConfig`` (``deepseek_v4.model`` imported ``_dsv4_sinkhorn_backend`` by name: it
  is rebound there too);
- ``deepseek_v41.attention``: ``dsv4_sparse_attention`` (used when a V4.1 layer's
  ``BackendConfig.attn`` is ``"tilelang"``, with ``reference_rounding=True``, which our
  kernels implement); ``deepseek_v41.layers``: ``dsv4_sinkhorn_normalize``;
- with ``fused_indexer=True``, ``DeepseekV4Indexer.forward``: the dense ``[B,S,P]`` scores
  and ``torch.topk`` become one ``torch.ops.dsv4.lightning_indexer`` call (see
  :func:`_make_fused_indexer_forward` for when it falls back to the original);
- with ``fused_qnorm_rope=True`` (off by default: its parity test at DeepSeek-V4's shape on
  a GPU has not run yet), ``DeepseekV4Attention.forward``: NeMo's own forward, recompiled
  from its source with one change, the query's per-head RMSNorm (no weight) and partial
  interleaved RoPE as one ``torch.ops.dsv4.qnorm_rope`` call (see
  :func:`_make_fused_qnorm_rope_forward` for what is replaced and :func:`_q_unfusable`
  for when a call takes NeMo's two statements instead).

Every rebound function runs this project's CUDA kernels (``backend="cuda"``) on CUDA
tensors, whatever backend name NeMo passes, and the torch composites
(``backend="torch"``) on CPU tensors. A CUDA call our kernels cannot take (an f32 model,
say) raises the kernels' error instead of silently running something else.

The returned :class:`NemoKernelPatch` undoes exactly what it did (``undo()``, or use it as
a context manager); :func:`revert_dsv4_kernels_for_nemo` undoes the active one. Applying
again first undoes the active patch. Layers keep their own ``BackendConfig``; what changes
is the code their forward calls, so models built before or after ``apply`` are both
patched (only ``DeepseekV4HyperConnection.sinkhorn_backend`` is fixed at construction, and
the rebound Sinkhorn ignores it).

NeMo 0.7.0 applies the query's RMSNorm and RoPE inline in ``DeepseekV4Attention.forward``
through helpers it shares with the KV, the indexer and the output's inverse RoPE, so the
fused ``qnorm_rope`` replaces that forward with the same code less those two statements
(the KV, the indexer's queries and the inverse RoPE keep NeMo's helpers). DeepSeek-V4.1's
attention has no per-head query RMSNorm and rotates with complex multiplies
(``deepseek_v41.attention._apply_rope``): it is left alone.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Optional

from .. import optimized_kernels as _ok
from .._tensors import torch

if torch is not None:
    from .. import _torch_ops

_V4_LAYERS = "nemo_automodel.components.models.deepseek_v4.layers"
_V4_MODEL = "nemo_automodel.components.models.deepseek_v4.model"
_V41_ATTENTION = "nemo_automodel.components.models.deepseek_v41.attention"
_V41_LAYERS = "nemo_automodel.components.models.deepseek_v41.layers"

_lock = threading.RLock()
_active: Optional["NemoKernelPatch"] = None


@dataclass(frozen=True)
class NemoPatchOptions:
    fused_indexer: bool
    backward_impl: str
    fused_qnorm_rope: bool = False


class NemoKernelPatch:
    """What one :func:`apply_dsv4_kernels_to_nemo` call changed, and its undo.

    ``patched``: ``"module.attribute"`` names rebound; ``skipped``: optional modules left
    alone, with the reason (a V4.1 module whose import failed, say)."""

    def __init__(self, options: NemoPatchOptions, patched: list, skipped: dict):
        self.options = options
        self._patched = patched  # [(owner, attribute, original)], in the order applied
        self.skipped = skipped

    @property
    def patched(self) -> list:
        return [f"{owner.__module__}.{owner.__qualname__}.{name}" if isinstance(owner, type) else f"{owner.__name__}.{name}" for owner, name, _ in self._patched]

    @property
    def active(self) -> bool:
        return _active is self

    def undo(self) -> None:
        """Put every original back (in reverse order); a second call does nothing."""
        global _active
        with _lock:
            for owner, name, original in reversed(self._patched):
                setattr(owner, name, original)
            self._patched = []
            if _active is self:
                _active = None

    def __enter__(self) -> "NemoKernelPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"NemoKernelPatch({state}, {self.options}, {len(self._patched)} attributes)"


# -- the rebound functions ---------------------------------------------------------------


def _device_backend(x) -> str:
    """Our CUDA kernels for CUDA tensors, the torch composites elsewhere."""
    return "cuda" if x.is_cuda else "torch"


def _sparse_path_backend(backend) -> str:
    """Replaces ``layers._dsv4_kernel_backend``: every DeepseekV4Attention takes the sparse
    path (``== "tilelang"``); the name itself is ignored by the rebound functions."""
    return "tilelang"


def _sinkhorn_backend(backend) -> str:
    """Replaces ``_dsv4_sinkhorn_backend`` (the name is ignored by the rebound Sinkhorn)."""
    return "auto"


def _make_functions(options: NemoPatchOptions) -> dict:
    def dsv4_sparse_attention(q, kv, sinks, topk_idxs, sm_scale, backend=None, **kwargs):
        """The seeds' ``dsv4_sparse_attention`` on this project's kernels."""
        kwargs.setdefault("backward_impl", options.backward_impl)
        return _ok.dsv4_sparse_attention(q, kv, sinks, topk_idxs, sm_scale, _device_backend(q), **kwargs)

    def build_dsv4_sparse_topk_indices(*args, **kwargs):
        """The seeds' index builder on this project's builder (int32, exact)."""
        return _ok.build_dsv4_sparse_topk_indices(*args, **kwargs)

    def dsv4_indexer_scores(q, pooled_kv, weights, compress_ratio, softmax_scale, backend=None, query_start=0, query_total_len=None):
        """Causal indexer scores ``[B,S,P]`` f32 on this project's kernels."""
        return _ok.dsv4_indexer_scores(q, pooled_kv, weights, compress_ratio, softmax_scale, _device_backend(q), query_start, query_total_len)

    def dsv4_sinkhorn_normalize(x, backend=None, repeat=None, eps=None):
        """The seeds' Sinkhorn on this project's kernels."""
        if repeat is None or eps is None:
            raise TypeError("dsv4_sinkhorn_normalize: arguments `repeat` and `eps` are required")
        return _ok.dsv4_sinkhorn_normalize(x, _device_backend(x), repeat, eps)

    return dict(dsv4_sparse_attention=dsv4_sparse_attention, build_dsv4_sparse_topk_indices=build_dsv4_sparse_topk_indices,
                dsv4_indexer_scores=dsv4_indexer_scores, dsv4_sinkhorn_normalize=dsv4_sinkhorn_normalize)


# -- the fused indexer -------------------------------------------------------------------

# id(position_ids) -> (weakref, tensor version, query start, answer): the layers of one
# forward share one position_ids tensor, so the host sync of the check happens once.
_positions_seen: dict = {}


def _positions_are_plain(position_ids, query_start: int, seq_len: int) -> bool:
    """Whether every row of ``position_ids`` is ``query_start + arange(seq_len)`` (None is:
    NeMo then takes exactly those positions). The fused kernel's causal mask is
    ``p < (query_start + s + 1) // r``; the layer's is ``p < (position + 1) // r``."""
    if position_ids is None:
        return True
    pos = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    if pos.dim() != 2 or pos.shape[-1] != seq_len or pos.dtype.is_floating_point:
        return False
    key = id(position_ids)
    seen = _positions_seen.get(key)
    if seen is not None and seen[0]() is position_ids and seen[1] == position_ids._version and seen[2] == query_start:
        return seen[3]
    want = torch.arange(query_start, query_start + seq_len, device=pos.device, dtype=pos.dtype)
    plain = bool(torch.equal(pos, want.expand_as(pos)))  # one host sync per new tensor
    if len(_positions_seen) > 64:
        _positions_seen.clear()
    _positions_seen[key] = (weakref.ref(position_ids), position_ids._version, query_start, plain)
    return plain


def _make_fused_indexer_forward(layers, original):
    """``DeepseekV4Indexer.forward`` with the lightning indexer fused: the same pooled keys,
    queries and head weights as the original (computed by NeMo's own helpers), then one
    ``torch.ops.dsv4.lightning_indexer`` call for scores + top-k instead of the dense
    ``[B,S,P]`` scores, the causal mask and ``torch.topk``.

    Returns int64 ``[B,S,min(index_topk,P)]`` like the original. The selection is the
    same *set* of visible keys where scores have no ties (the layer uses it only as a set:
    the sparse index builder and the compressed mask); slots past a row's visible count
    are ``-1`` where the original leaves arbitrary masked positions, which the compressor
    turns into ``-1`` anyway. The indexer gets no gradient on either path (top-k indices
    are discrete), so the fused path runs under ``no_grad``.

    Falls back to the original forward for packed sequences (``packed_seq_ids``: the
    window metadata masks), CPU tensors, ``start_pos != 0``, and positions other than
    ``query_start + arange(S)``."""

    def forward(self, hidden_states, q_residual, rotary, position_embeddings, cache, layer_idx, start_pos, position_ids=None, packed_seq_ids=None, cp_group=None):
        args = (hidden_states, q_residual, rotary, position_embeddings, cache, layer_idx, start_pos)
        kwargs = dict(position_ids=position_ids, packed_seq_ids=packed_seq_ids, cp_group=cp_group)
        batch, seq_len, _ = hidden_states.shape
        cp_active = layers.dsv4_cp_enabled(cp_group)
        query_start = layers.dsv4_cp_rank(cp_group) * seq_len if cp_active else 0
        query_total_len = layers.dsv4_cp_size(cp_group) * seq_len if cp_active else None
        if packed_seq_ids is not None or not hidden_states.is_cuda or start_pos != 0 or not _positions_are_plain(position_ids, query_start, seq_len):
            return original(self, *args, **kwargs)

        with torch.no_grad():
            ratio, dtype = self.compress_ratio, hidden_states.dtype
            x32 = hidden_states.float()
            # Pooled keys: gated pools of `ratio`-token windows (overlapping), normalised, RoPE'd.
            ready_kv, ready_gate, pool_base = cache.accumulate_windows(self.wkv(x32), self.wgate(x32), layer_idx, "indexer_state", ratio, start_pos)
            pooled = layers._pool_windows(ready_kv, ready_gate, self.ape_param(x32), ratio, self.head_dim, overlap=self.overlap, cp_group=cp_group, window_seq_ids=None)
            pooled = self.kv_norm(pooled.to(dtype))
            if pooled.shape[1] > 0:
                cos_p, sin_p = rotary(pooled, layers._rope_pool_positions(pooled.shape[1], pool_base, ratio, pooled.device, pooled.shape[0]))
                pooled = layers._apply_partial_rope(pooled.unsqueeze(1), cos_p, sin_p, self.rope_head_dim).squeeze(1)
            pooled_kv = cache.update_pool(pooled, layer_idx, "indexer_state")
            if cp_active:
                pooled_kv = layers.dsv4_cp_all_gather(pooled_kv, dim=1, cp_group=cp_group)
            # Queries [B,S,H,D] with RoPE, and the per-head weights (head count folded in).
            cos, sin = position_embeddings
            q = self.wq_b(q_residual).view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
            q = layers._apply_partial_rope(q, cos, sin, self.rope_head_dim).transpose(1, 2)
            weights = self.weights_proj(hidden_states).float() * (self.n_heads ** -0.5)

            k = min(self.index_topk, pooled_kv.shape[1])
            if k == 0:
                return torch.empty((batch, seq_len, 0), dtype=torch.long, device=hidden_states.device)
            # The kernel reads bf16 queries and keys (as the seeds' TileLang indexer).
            indices, _ = torch.ops.dsv4.lightning_indexer(q.to(torch.bfloat16), pooled_kv.to(torch.bfloat16), weights, float(self.softmax_scale), int(ratio), int(query_start),
                                                          query_total_len, int(k), "cuda")
        return indices.long()

    forward.__doc__ = _make_fused_indexer_forward.__doc__
    forward.__wrapped__ = original
    return forward


# -- the fused Q RMSNorm + RoPE ----------------------------------------------------------

# The two consecutive statements of NeMo 0.7.0's `DeepseekV4Attention.forward`
# (deepseek_v4/layers.py lines 1317 and 1319) that one fused call replaces, and the call.
_Q_NORM = "q = _rms_norm_last_dim(q, self.config.rms_norm_eps)"
_Q_ROPE = "q = _apply_partial_rope(q, cos, sin, self.rope_head_dim)"
_Q_FUSED_NAME = "_dsv4_q_norm_rope"
_Q_FUSED = f"q = {_Q_FUSED_NAME}(self, q, cos, sin)"


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # a torch before 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (none can be before torch.distributed.tensor is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def _q_unfusable(q, cos, sin, rotary, eps) -> Optional[str]:
    """Why one call of NeMo's query normalisation + RoPE cannot be our fused op, or None
    when it can.

    NeMo computes ``_apply_partial_rope(F.rms_norm(q, (D,), eps=eps), cos, sin, R)``:
    ``y = q * rsqrt(mean(q^2) + eps)`` in f32, stored in q's dtype; then, on the last ``R``
    channels, interleaved pairs ``(2j, 2j+1)`` rotated in f32 by ``cos[..., j]`` /
    ``sin[..., j]`` (the first half of its ``[B',S,R]`` tables, in any float dtype, read as
    f32) and stored in q's dtype. Our op (SPEC.md section 5) computes that with the same
    two roundings for bf16 and none for f32, with the same gradient (the upstream gradient
    rotated back and rounded to q's dtype, then the RMSNorm backward), given the tables as
    f32. It is the same math only for: a plain (not DTensor) bf16 or f32 ``q`` of 4 dims
    on a CPU or CUDA device, autocast off (an autocast may run the norm in another
    dtype), ``R`` even with ``0 < R <= D``, ``eps > 0``, and tables of shape ``[1 or
    B, S, R]`` on q's device that need no gradient. Anything else takes NeMo's own
    statements."""
    if any(_is_dtensor(t) for t in (q, cos, sin)):
        return "a DTensor"
    if q.dtype not in (torch.bfloat16, torch.float32):
        return f"q is {q.dtype}"
    if q.dim() != 4 or q.device.type not in ("cpu", "cuda"):
        return "q is not a 4-dim CPU or CUDA tensor"
    if _autocast_enabled(q.device.type):
        return "autocast is on"
    if not isinstance(rotary, int) or rotary <= 0 or rotary % 2 or rotary > q.shape[-1]:
        return f"rope_head_dim = {rotary!r}"
    if not isinstance(eps, (int, float)) or not eps > 0:
        return f"rms_norm_eps = {eps!r}"
    b, _, s, _ = q.shape
    for t in (cos, sin):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] not in (1, b) or tuple(t.shape[1:]) != (s, rotary) or t.device != q.device:
            return "the rotary tables are not [1 or B, S, rope_head_dim] on q's device"
        if not t.dtype.is_floating_point or (t.requires_grad and torch.is_grad_enabled()):
            return "the rotary tables are not fixed float tensors"
    return None


def _make_q_norm_rope(layers):
    """``(module, q, cos, sin) -> q`` normalised and rotated: our fused op where
    :func:`_q_unfusable` allows, else NeMo's two statements (through ``layers``' current
    helpers, as the original forward)."""

    def q_norm_rope(module, q, cos, sin):
        eps, rotary = module.config.rms_norm_eps, module.rope_head_dim
        if _q_unfusable(q, cos, sin, rotary, eps) is not None:
            return layers._apply_partial_rope(layers._rms_norm_last_dim(q, eps), cos, sin, rotary)
        b = q.shape[0]
        cos, sin = (t.float().expand(b, -1, -1) for t in (cos, sin))  # an exact upcast, as NeMo's `.float()`
        out, _ = _torch_ops.call.qnorm_rope(q, cos, sin, int(rotary), float(eps), _device_backend(q))
        return out

    return q_norm_rope


def _statement(src: str) -> str:
    return ast.dump(ast.parse(src).body[0])


def _code_at(code, path):
    """The code object nested in ``code`` along ``path`` (``co_name`` of each level), the
    one whose definition starts last where several match (a redefinition replaced it)."""
    for name in path:
        found = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name]
        if not found:
            return None
        code = max(found, key=lambda c: c.co_firstlineno)
    return code


def _make_fused_qnorm_rope_forward(layers, original):
    """``DeepseekV4Attention.forward`` with the query's RMSNorm + RoPE fused: NeMo's own
    forward, recompiled from its module's source (same file, line numbers, compiler
    context and globals: what this patch rebinds in that module is seen as by the
    original) with one change. The consecutive statements

        q = _rms_norm_last_dim(q, self.config.rms_norm_eps)       # layers.py:1317
        q = _apply_partial_rope(q, cos, sin, self.rope_head_dim)  # layers.py:1319

    become ``q = _dsv4_q_norm_rope(self, q, cos, sin)`` (a closure cell: nothing is added
    to NeMo's module): one ``torch.ops.dsv4.qnorm_rope`` call on the query ``[B,H,S,D]``
    with the forward's own ``cos``/``sin`` (NeMo's rotary tables for these rows, so
    positions, packed documents and context-parallel shards are as NeMo computed them),
    or NeMo's two statements where :func:`_q_unfusable` says the math would differ. The
    result is stored token-major (the sparse path's ``q.transpose(1, 2).contiguous()``
    then copies nothing). The KV's RoPE, the compressor's and the indexer's, and the
    inverse RoPE of the output stay NeMo's.

    Raises RuntimeError (nothing patched) unless ``original`` is a plain function whose
    module source compiles to its running bytecode and holds both statements once, one
    after the other, at the top level of its body."""

    def refuse(why):
        return RuntimeError(f"apply_dsv4_kernels_to_nemo(fused_qnorm_rope=True): {why} (written for NeMo AutoModel 0.7.0); nothing was patched")

    if not isinstance(original, types.FunctionType) or hasattr(original, "__wrapped__") or original.__code__.co_freevars:
        raise refuse(f"DeepseekV4Attention.forward is {original!r}, not NeMo's plain function")
    owner, _, name = original.__qualname__.rpartition(".")
    if not owner or "." in owner or "<" in owner:
        raise refuse(f"{original.__qualname__} is not a method of a module-level class")
    try:
        filename = inspect.getsourcefile(original)
        if filename:
            linecache.checkcache(filename)
        source = "".join(linecache.getlines(filename, original.__globals__)) if filename else ""
        tree = ast.parse(source, filename)
    except (OSError, TypeError, SyntaxError) as e:
        raise refuse(f"cannot read {original.__qualname__}'s source ({e})") from e

    def compiled(path):
        return _code_at(compile(tree, filename, "exec", dont_inherit=True), path)

    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    defs = [n for n in (classes[-1].body if classes else []) if isinstance(n, ast.FunctionDef) and n.name == name]
    unchanged = compiled((owner, name)) if defs else None
    if unchanged is None or unchanged.co_code != original.__code__.co_code or unchanged.co_firstlineno != original.__code__.co_firstlineno:
        raise refuse(f"{filename} does not compile to the running {original.__qualname__}")
    fn = defs[-1]
    norm, rope = _statement(_Q_NORM), _statement(_Q_ROPE)
    at = [i for i in range(len(fn.body) - 1) if ast.dump(fn.body[i]) == norm and ast.dump(fn.body[i + 1]) == rope]
    if len(at) != 1 or sum(ast.dump(st) in (norm, rope) for st in fn.body) != 2:
        raise refuse(f"{original.__qualname__} does not hold `{_Q_NORM}` then `{_Q_ROPE}` once")
    fused = ast.parse(_Q_FUSED).body[0]
    for node in ast.walk(fused):  # at the replaced statement's place (tracebacks)
        if "lineno" in node._attributes:
            ast.copy_location(node, fn.body[at[0]])
    fn.body[at[0]:at[0] + 2] = [fused]
    # def _dsv4_make(_dsv4_q_norm_rope): <forward>; return forward  (in the class body).
    maker = ast.parse(f"def _dsv4_make({_Q_FUSED_NAME}):\n    return {name}\n").body[0]
    for node in ast.walk(maker):
        if "lineno" in node._attributes:
            ast.copy_location(node, fn)
    maker.body.insert(0, fn)
    body = classes[-1].body
    body[body.index(fn)] = maker
    code = compiled((owner, "_dsv4_make", name))
    if code is None or code.co_freevars != (_Q_FUSED_NAME,):
        raise refuse(f"the recompiled {original.__qualname__} does not take `{_Q_FUSED_NAME}` from its closure")
    forward = types.FunctionType(code, original.__globals__, name, original.__defaults__, (types.CellType(_make_q_norm_rope(layers)),))
    forward.__kwdefaults__ = original.__kwdefaults__
    forward.__annotations__ = dict(original.__annotations__)
    forward.__qualname__ = original.__qualname__
    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original
    return forward


# -- apply / revert ----------------------------------------------------------------------


def _import_nemo(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "nemo_automodel":
            raise ImportError(f"apply_dsv4_kernels_to_nemo needs NeMo AutoModel (`pip install nemo-automodel==0.7.0`): cannot import {name}") from e
        raise


def _optional(name: str, skipped: dict):
    try:
        return importlib.import_module(name)
    except Exception as e:  # an optional model family whose own dependencies are missing
        skipped[name] = f"{type(e).__name__}: {e}"
        return None


def apply_dsv4_kernels_to_nemo(*, fused_indexer: bool = True, backward_impl: str = "atomic", fused_qnorm_rope: bool = False) -> NemoKernelPatch:
    """Make NeMo AutoModel's DeepSeek-V4 (and V4.1) layers call this project's kernels
    (see the module documentation for what is rebound). Returns the undo handle.

    ``fused_indexer``: the indexer's scores + top-k as one fused kernel call;
    ``backward_impl``: the sparse attention backward, ``"atomic"`` or ``"deterministic"``
    (bitwise repeatable);
    ``fused_qnorm_rope``: ``DeepseekV4Attention``'s query RMSNorm + partial RoPE as one
    fused ``qnorm_rope`` call (:func:`_make_fused_qnorm_rope_forward`). Off by default: its
    CPU tests match NeMo's own path, but its parity test at DeepSeek-V4's shape on a GPU
    (``test_fused_qnorm_rope_matches_nemo_gpu_bf16``) has not run yet.
    Raises ImportError when torch or NeMo AutoModel cannot be imported, RuntimeError (and
    patches nothing) when this NeMo lacks what an option replaces."""
    global _active
    if backward_impl not in ("atomic", "deterministic"):
        raise ValueError(f"argument `backward_impl` = {backward_impl!r}, expected 'atomic' or 'deterministic'")
    if torch is None:
        raise ImportError("apply_dsv4_kernels_to_nemo needs torch")
    options = NemoPatchOptions(bool(fused_indexer), backward_impl, bool(fused_qnorm_rope))
    layers = _import_nemo(_V4_LAYERS)
    skipped: dict = {}
    functions = _make_functions(options)

    plan = [(layers, name, fn) for name, fn in functions.items()]
    plan += [(layers, "_dsv4_kernel_backend", _sparse_path_backend), (layers, "_dsv4_sinkhorn_backend", _sinkhorn_backend)]
    model = _optional(_V4_MODEL, skipped)
    if model is not None:
        plan.append((model, "_dsv4_sinkhorn_backend", _sinkhorn_backend))
    v41_attention = _optional(_V41_ATTENTION, skipped)
    if v41_attention is not None:
        plan.append((v41_attention, "dsv4_sparse_attention", functions["dsv4_sparse_attention"]))
    v41_layers = _optional(_V41_LAYERS, skipped)
    if v41_layers is not None:
        plan.append((v41_layers, "dsv4_sinkhorn_normalize", functions["dsv4_sinkhorn_normalize"]))

    with _lock:
        if _active is not None:
            _active.undo()
        missing = [f"{owner.__name__}.{name}" for owner, name, _ in plan if not hasattr(owner, name)]
        indexer_cls = getattr(layers, "DeepseekV4Indexer", None)
        if fused_indexer and indexer_cls is None:
            missing.append(f"{layers.__name__}.DeepseekV4Indexer")
        attention_cls = getattr(layers, "DeepseekV4Attention", None)
        if fused_qnorm_rope and attention_cls is None:
            missing.append(f"{layers.__name__}.DeepseekV4Attention")
        if missing:
            raise RuntimeError(f"apply_dsv4_kernels_to_nemo: this NeMo AutoModel lacks {', '.join(missing)} (written for 0.7.0); nothing was patched")
        if fused_indexer:
            plan.append((indexer_cls, "forward", _make_fused_indexer_forward(layers, indexer_cls.forward)))
        if fused_qnorm_rope:
            plan.append((attention_cls, "forward", _make_fused_qnorm_rope_forward(layers, attention_cls.__dict__.get("forward"))))
        done = []
        for owner, name, value in plan:
            done.append((owner, name, owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)))
            setattr(owner, name, value)
        _active = NemoKernelPatch(options, done, skipped)
        return _active


def revert_dsv4_kernels_for_nemo() -> bool:
    """Undo the active :func:`apply_dsv4_kernels_to_nemo`; False when none was active."""
    with _lock:
        if _active is None:
            return False
        _active.undo()
        return True
