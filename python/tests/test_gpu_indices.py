"""CUDA: sparse attention on the indices a real client builds (issue 41).

- The shared reproducer (``shared/repro/sa_bwd_crash_idx.npy.xz``): indices NeMo AutoModel
  0.7.0's ``DeepseekV4Attention`` built at S=4096 (rows with no valid slot, rows with only a
  window), reported to crash the Hopper backward; both backward modes, Hopper and portable
  kernels, against an f32 torch reference.
- Indices built the way that layer builds them (window + indexer top-k over pooled keys,
  through ``build_dsv4_sparse_topk_indices``), then with rows emptied at random positions,
  rows left with only their window and masked compressed slots sprinkled in, at S=4096 and
  16384.

Outputs are written into memory that held NaN just before (torch's caching allocator hands
the same blocks back), so a row a kernel leaves unwritten fails the comparison.
"""

from __future__ import annotations

import io
import lzma
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import dsv4_kernels as dk  # noqa: E402
from dsv4_kernels.bench import selection  # noqa: E402
from torch_refs import rel  # noqa: E402  (also: NaN or inf where the reference is finite fails)

DEV = "cuda"
REPO = Path(__file__).resolve().parents[2]
H, D, WINDOW, TOPK, RATIO = 64, 512, 128, 512, 4


def repro_path() -> Path:
    shared = Path(os.environ["DSV4_SHARED_DIR"]) if os.environ.get("DSV4_SHARED_DIR") else REPO.parent / "shared"
    return shared / "repro" / "sa_bwd_crash_idx.npy.xz"


def reference(q, kv, sinks, idx, scale, dout, rows=512):
    """f32 out, dq, dkv, dsinks of SPEC.md section 1 (autograd), in row chunks of one batch row."""
    k = kv.shape[1]
    # detach().clone(): `sinks` is already f32, so `.float()` alone would be the caller's
    # tensor itself and requires_grad_ would change it.
    kv32 = kv[0].detach().float().clone().requires_grad_(True)
    s32 = sinks.detach().float().clone().requires_grad_(True)
    outs, dqs = [], []
    for a in range(0, q.shape[1], rows):
        qc = q[0, a:a + rows].detach().float().clone().requires_grad_(True)
        ii = idx[0, a:a + rows].long()
        valid = (ii >= 0) & (ii < k)
        g = kv32[ii.clamp(0, k - 1)]  # [r, T, D]
        logits = torch.einsum("rhd,rtd->rht", qc, g) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        z = torch.cat([logits, s32.view(1, -1, 1).expand(qc.shape[0], -1, 1)], -1)
        p = torch.softmax(z, -1)[..., :-1]
        o = torch.einsum("rht,rtd->rhd", p, g)
        o.backward(dout[0, a:a + rows].float())
        outs.append(o.detach())
        dqs.append(qc.grad)
    return torch.cat(outs)[None], torch.cat(dqs)[None], kv32.grad[None], s32.grad


def poison_allocator(nbytes):
    """Leave NaN in the caching allocator's free blocks, so fresh outputs start as NaN."""
    x = torch.full((nbytes // 4,), float("nan"), device=DEV)
    del x


def run_ours(q, kv, sinks, idx, scale, dout, impl, plan=None):
    poison_allocator(4 * q.numel() + 8 * kv.numel())
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sinks)]
    out = dk.dsv4_sparse_attention(*leaves, None if plan is not None else idx, scale, "cuda", backward_impl=impl, plan=plan)
    out.backward(dout)
    torch.cuda.synchronize()
    return out.detach(), leaves[0].grad, leaves[1].grad, leaves[2].grad


def inputs(s, k, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(1, s, H, D, device=DEV, generator=gen) * 0.5).bfloat16()
    kv = (torch.randn(1, k, D, device=DEV, generator=gen) * 0.5).bfloat16()
    sinks = torch.randn(H, device=DEV, generator=gen)
    dout = torch.randn(1, s, H, D, device=DEV, generator=gen).bfloat16()
    return q, kv, sinks, dout


def check(got, want, tol=(1e-2, 1e-2, 5e-3, 5e-3)):
    for name, g, w, t in zip(("out", "dq", "dkv", "dsinks"), got, want, tol):
        e = rel(g, w)
        assert e <= t, f"{name}: relative error {e:.3e} > {t}"


@pytest.fixture
def kernels(request, monkeypatch):
    """'hopper' (the sm_90a kernels where the device has them) or 'portable' (DSV4_PORTABLE=1)."""
    if request.param == "portable":
        monkeypatch.setenv("DSV4_PORTABLE", "1")
    return request.param


@pytest.mark.parametrize("kernels", ["hopper", "portable"], indirect=True)
@pytest.mark.parametrize("impl", ["atomic", "deterministic"])
def test_shared_reproducer(kernels, impl):
    path = repro_path()
    if not path.exists():
        pytest.skip(f"no reproducer at {path}")
    idx = torch.from_numpy(np.load(io.BytesIO(lzma.open(path).read()))).to(DEV)
    b, s, t = idx.shape
    assert (b, s, t) == (1, 4096, 640)
    valid = (idx >= 0).sum(-1)[0]
    assert valid[2102] == 0 and valid[2174] == 0, "the reproducer's empty rows"
    q, kv, sinks, dout = inputs(s, 5120, seed=41)
    scale = D ** -0.5
    got = run_ours(q, kv, sinks, idx, scale, dout, impl)
    want = reference(q, kv, sinks, idx, scale, dout)
    check(got, want)
    # An empty row: out 0, dq 0.
    assert torch.count_nonzero(got[0][0, 2102]) == 0 and torch.count_nonzero(got[1][0, 2102]) == 0


@pytest.mark.parametrize("kernels", ["hopper", "portable"], indirect=True)
@pytest.mark.parametrize("impl", ["atomic", "deterministic"])
@pytest.mark.parametrize("planned", [False, True], ids=["indices", "plan"])
def test_empty_rows_have_zero_gradients_whatever_their_dout(kernels, impl, planned):
    """SPEC.md section 1: a row with no valid slot has out = 0 and zero gradients. Its
    upstream gradient may hold NaN or inf (a client's garbage, an overflow upstream): dq of
    that row is 0 and nothing of it reaches dkv or dsinks, on every kernel and mode, with
    the row scanned slot by slot (indices) or skipped (a plan)."""
    path = repro_path()
    if not path.exists():
        pytest.skip(f"no reproducer at {path}")
    idx = torch.from_numpy(np.load(io.BytesIO(lzma.open(path).read()))).to(DEV)
    empty = [2102, 2174]
    q, kv, sinks, dout = inputs(4096, 5120, seed=43)
    bad = dout.clone()
    bad[0, empty[0]] = float("nan")
    bad[0, empty[1]] = float("inf")
    scale = D ** -0.5
    plan = dk.plan_dsv4_sparse_indices(idx, 5120, "cuda") if planned else None
    got = run_ours(q, kv, sinks, idx, scale, bad, impl, plan=plan)
    clean = dout.clone()
    clean[0, empty] = 0
    want = reference(q, kv, sinks, idx, scale, clean)
    check(got, want)
    assert torch.count_nonzero(got[1][0, empty]) == 0, "an empty row's dq is not 0"


@pytest.mark.parametrize("kernels", ["hopper", "portable"], indirect=True)
@pytest.mark.parametrize("impl", ["atomic", "deterministic"])
def test_heads_without_a_sink(kernels, impl):
    """A sink of -inf is a head without a sink (Z = sum of exp(l)). On the reproducer's
    indices (rows whose first blocks are all masked, rows with no valid slot at all) the
    forward gave NaN where a masked block came before the first valid one (exp(-inf - -inf)),
    and 0 / 0 for an empty row. Judged against the same maths with the sink at -1e30, whose
    exp is 0 in f32: an empty row then has out 0 and zero gradients, as SPEC.md says."""
    path = repro_path()
    if not path.exists():
        pytest.skip(f"no reproducer at {path}")
    idx = torch.from_numpy(np.load(io.BytesIO(lzma.open(path).read()))).to(DEV)
    q, kv, sinks, dout = inputs(4096, 5120, seed=44)
    sinks[:8] = float("-inf")
    scale = D ** -0.5
    got = run_ours(q, kv, sinks, idx, scale, dout, impl)
    want = reference(q, kv, sinks.clamp(min=-1e30), idx, scale, dout)
    check(got, want)
    assert torch.count_nonzero(got[0][0, [2102, 2174]]) == 0, "an empty row's out is not 0"


def nemo_like_indices(s, seed):
    """Window + indexer top-k over the pooled keys as DeepseekV4Attention builds them
    (``dsv4_kernels.bench.selection``), then damaged the ways a real selection can be:
    rows emptied at random positions, rows with only their window, masked slots
    sprinkled into the compressed part."""
    p = s // RATIO
    _, idx = selection(1, s, p, TOPK, WINDOW, RATIO, seed)
    assert idx.shape == (1, s, WINDOW + min(TOPK, p)) and idx.dtype == torch.int32
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    rows = torch.randperm(s, device=DEV, generator=gen)
    empty, window_only = rows[:7], rows[7:40]
    idx[0, empty] = -1
    idx[0, window_only, WINDOW:] = -1
    holes = torch.rand(idx.shape, device=DEV, generator=gen) < 0.02
    holes[..., :WINDOW] = False
    idx = idx.masked_fill(holes, -1)
    return idx, empty


@pytest.mark.parametrize("s", [4096, 16384])
def test_nemo_like_indices(s):
    idx, empty = nemo_like_indices(s, seed=s)
    k = s + s // RATIO
    q, kv, sinks, dout = inputs(s, k, seed=s + 1)
    scale = D ** -0.5
    want = reference(q, kv, sinks, idx, scale, dout)
    atomic = run_ours(q, kv, sinks, idx, scale, dout, "atomic")
    check(atomic, want)
    det = run_ours(q, kv, sinks, idx, scale, dout, "deterministic")
    check(det, want)
    again = run_ours(q, kv, sinks, idx, scale, dout, "deterministic")
    for a, b in zip(det, again):
        assert torch.equal(a, b), "the deterministic backward is not bitwise reproducible"
    for r in empty.tolist():
        assert torch.count_nonzero(atomic[0][0, r]) == 0 and torch.count_nonzero(atomic[1][0, r]) == 0
    # A plan (valid slots compacted, empty rows listed) gives the same results.
    plan = dk.plan_dsv4_sparse_indices(idx, k, "cuda")
    planned = run_ours(q, kv, sinks, idx, scale, dout, "atomic", plan=plan)
    check(planned, want)


@pytest.mark.parametrize("s", [4096])
def test_deterministic_bits_independent_of_workspace(s):
    """The deterministic backward gives the same bits for any workspace size (any split of
    the rows into waves, an index built once or per wave)."""
    idx, _ = nemo_like_indices(s, seed=7)
    k = s + s // RATIO
    q, kv, sinks, dout = inputs(s, k, seed=8)
    scale = D ** -0.5
    results = []
    for ws in (8 << 30, 2 << 30, 256 << 20, 48 << 20):
        leaves = [t.clone().requires_grad_(True) for t in (q, kv, sinks)]
        out = dk.dsv4_sparse_attention(*leaves, idx, scale, "cuda", backward_impl="deterministic", backward_workspace_bytes=ws)
        out.backward(dout)
        results.append((ws, [t.grad for t in leaves]))
    base = results[0][1]
    for ws, grads in results[1:]:
        for name, a, b in zip(("dq", "dkv", "dsinks"), grads, base):
            assert torch.equal(a, b), f"{name} with a {ws >> 20} MiB workspace differs from the one-wave result"
