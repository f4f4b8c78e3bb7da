"""The eager call's Python before and after v37's third session (issue 38), A/B in one loop:
before, ``Function.apply`` and ``torch.empty`` outputs; now, the C-level apply and
``new_empty`` (``_torch_ops.call``). Same tensors (requiring grad), native call stubbed,
alternating rounds of 500 calls:

    PYTHONPATH=<site with dsv4_kernels> python research/eager_apply_ab.py
"""

import statistics
import time

import torch

from dsv4_kernels import _native, _torch_ops, ops

B, S, H, D, T = 1, 64, 8, 64, 16
q = torch.randn(B, S, H, D, dtype=torch.bfloat16, requires_grad=True)
kv = torch.randn(B, S, D, dtype=torch.bfloat16, requires_grad=True)
sinks = torch.zeros(H, requires_grad=True)
idx = torch.randint(0, S, (B, S, T), dtype=torch.int32)
_native.sparse_attention_fwd = lambda **kw: None
args = (q, kv, sinks, idx, D**-0.5, "cuda", False, False, -1, "atomic", 0)
impl = _torch_ops.sparse_attention._init_fn


def forward(ctx, *a):
    o = impl(*a)
    _torch_ops._sparse_attention_setup(ctx, a, o)
    return o


Before = type("Before", (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(_torch_ops._sparse_attention_backward)})


def before_plain(a):
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(not (isinstance(x, torch.Tensor) and type(x) is not torch.Tensor) for x in a)


def before_empty(like, shape, dtype):
    td = like.dtype if dtype == "like" else {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "i64": torch.int64}[dtype]
    return torch.empty(tuple(shape), dtype=td, device=like.device)


def before(n):
    now_empty, ops.empty = ops.empty, before_empty
    try:
        for _ in range(n):
            if before_plain(args):
                Before.apply(*args)
    finally:
        ops.empty = now_empty


def now(n):
    for _ in range(n):
        _torch_ops.call.sparse_attention(*args)


got = {"before": [], "now": []}
before(100)
now(100)
for r in range(15):
    pair = (("before", before), ("now", now)) if r % 2 == 0 else (("now", now), ("before", before))
    for name, loop in pair:
        t0 = time.perf_counter()
        loop(500)
        got[name].append((time.perf_counter() - t0) * 1e6 / 500)
for name, v in got.items():
    print(f"{name}: median {statistics.median(v):.1f} µs, min {min(v):.1f} µs a call")
