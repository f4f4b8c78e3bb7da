"""``apply_dsv4_kernels_to_nemo()`` against NeMo AutoModel 0.7.0's own torch paths, in
NeMo's own layers: ``DeepseekV4Attention`` for compress ratios 0, 4 and 128, plain and
packed sequences, forward and backward (output, input and parameter gradients), a few
optimizer steps whose losses must track, the fused lightning indexer's selection, the
fused query RMSNorm + RoPE (``fused_qnorm_rope=True``: the recompiled forward, its
fallbacks, and the layer with it against NeMo's own path and against the unfused patch,
plain, packed and context-parallel over two CPU processes), and
``DeepseekV4HyperConnection``.

The reference is NeMo's eager path (``BackendConfig(attn="torch")``). For packed sequences
it is NeMo's sparse path (what ``BackendConfig(attn="tilelang")`` runs) on the seeds' own
torch functions, with the causal ``-inf`` of the seeds' TileLang indexer scores: with
documents that do not start on a compressed-window boundary NeMo's torch paths place a
pooled window by its first token's in-document position, so a window can be selected
(ratio 4) or attended (ratio 128, eager) before its last token, where the seeds' TileLang
path and ours (causal on the packed row's positions) wait for it.

Skips without torch or ``nemo_automodel``; the patch bookkeeping and a small f32 model run
on the CPU (our torch composites), the DeepSeek-V4-shaped bf16 cases need a CUDA device
(our kernels). On the GPU machine:

    PYTHONPATH=<dsv4_kernels + nemo_automodel 0.7.0> python -m pytest -v -s python/tests/test_nemo_integration.py
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import tempfile
import types

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("nemo_automodel.components.models.deepseek_v4.layers")
seeds = pytest.importorskip("nemo_automodel.components.models.deepseek_v4.optimized_kernels")

from nemo_automodel.components.models.common.utils import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v4.cp import build_packed_seq_ids  # noqa: E402

from dsv4_kernels.integrations import NemoKernelPatch, apply_dsv4_kernels_to_nemo, revert_dsv4_kernels_for_nemo  # noqa: E402
from dsv4_kernels.integrations import nemo as integration  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PAD = -1000  # NeMo's padding value in rectangular packed-length rows


def rel(got, ref) -> float:
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _no_patch_leaks():
    revert_dsv4_kernels_for_nemo()
    yield
    revert_dsv4_kernels_for_nemo()


# -- the patch bookkeeping (CPU) ---------------------------------------------------------

_V4_NAMES = ("dsv4_sparse_attention", "build_dsv4_sparse_topk_indices", "dsv4_indexer_scores", "dsv4_sinkhorn_normalize", "_dsv4_kernel_backend", "_dsv4_sinkhorn_backend")


def _snapshot():
    snap = {name: getattr(L, name) for name in _V4_NAMES}
    snap["Indexer.forward"] = L.DeepseekV4Indexer.__dict__["forward"]
    return snap


def test_apply_patches_and_undo_restores():
    before = _snapshot()
    handle = apply_dsv4_kernels_to_nemo()
    assert isinstance(handle, NemoKernelPatch) and handle.active
    after = _snapshot()
    assert all(after[k] is not before[k] for k in before), "every entry point is rebound"
    assert L._dsv4_kernel_backend(BackendConfig(attn="torch")) == "tilelang"  # the sparse path, whatever the config
    assert any(name.endswith("DeepseekV4Indexer.forward") for name in handle.patched)
    handle.undo()
    assert not handle.active and _snapshot() == before
    handle.undo()  # a second undo does nothing
    assert _snapshot() == before


def test_apply_again_replaces_and_revert_reports():
    before = _snapshot()
    first = apply_dsv4_kernels_to_nemo(fused_indexer=True)
    second = apply_dsv4_kernels_to_nemo(fused_indexer=False)
    assert not first.active and second.active
    assert L.DeepseekV4Indexer.__dict__["forward"] is before["Indexer.forward"]  # no fused indexer this time
    assert revert_dsv4_kernels_for_nemo() is True and revert_dsv4_kernels_for_nemo() is False
    assert _snapshot() == before
    with apply_dsv4_kernels_to_nemo() as handle:
        assert handle.active
    assert _snapshot() == before


def test_apply_options_are_checked_before_patching():
    before = _snapshot()
    with pytest.raises(ValueError, match="backward_impl"):
        apply_dsv4_kernels_to_nemo(backward_impl="fast")
    with pytest.raises(TypeError, match="qnorm_rope"):
        apply_dsv4_kernels_to_nemo(qnorm_rope=True)  # the option is `fused_qnorm_rope`
    assert _snapshot() == before


def test_v41_modules_are_patched_too():
    v41_attention = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.attention")
    v41_layers = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.layers")
    sa, sk = v41_attention.dsv4_sparse_attention, v41_layers.dsv4_sinkhorn_normalize
    with apply_dsv4_kernels_to_nemo():
        assert v41_attention.dsv4_sparse_attention is L.dsv4_sparse_attention is not sa
        assert v41_layers.dsv4_sinkhorn_normalize is L.dsv4_sinkhorn_normalize is not sk
    assert v41_attention.dsv4_sparse_attention is sa and v41_layers.dsv4_sinkhorn_normalize is sk


# -- building NeMo's layer and its inputs ------------------------------------------------


def make_config(small: bool, ratio: int) -> DeepseekV4Config:
    if small:  # a CPU-sized layer (f32)
        dims = dict(hidden_size=256, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2, index_n_heads=4, index_head_dim=32,
                    index_topk=16, sliding_window=32, torch_dtype="float32")
    else:  # DeepSeek-V4's attention shapes (H=64, D=512; indexer H=64, D=128), a narrower model
        dims = dict(hidden_size=1024, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512, o_lora_rank=256, o_groups=8, index_n_heads=64,
                    index_head_dim=128, index_topk=256, sliding_window=128, torch_dtype="bfloat16")
    return DeepseekV4Config(num_hidden_layers=1, compress_ratios=[ratio], **dims)


def make_attention(cfg: DeepseekV4Config, device, dtype, seed=0):
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            attn = L.DeepseekV4Attention(cfg, 0, backend=BackendConfig(attn="torch"))
    finally:
        torch.set_default_dtype(previous)
    attn.init_weights(torch.device(device), init_std=0.02)
    with torch.no_grad():  # nonzero sinks and window offsets, so their gradients mean something
        attn.sinks_param.weight.normal_(0.0, 1.0)
        if attn.compressor is not None:
            attn.compressor.ape_param.weight.normal_(0.0, 0.1)
    return attn


def make_inputs(cfg: DeepseekV4Config, batch: int, seq: int, packed: bool, device, dtype, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, seq, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    kwargs = {}
    if packed:  # row 0: three documents (none aligned to a compressed window), row 1: one
        a, b = seq // 3 + 5, seq // 2 - 3
        lens = torch.tensor([[a, b, seq - a - b], [seq, PAD, PAD]])
        kwargs["packed_seq_ids"] = build_packed_seq_ids(lens, seq_len=seq, device=device, padding_value=PAD)
        pos = torch.stack([torch.cat([torch.arange(n) for n in row if n > 0]) for row in lens.tolist()]).to(device)
        mask = L.build_packed_causal_padding_mask(torch.where(lens > 0, lens, 0), seq, dtype, device, sliding_window=cfg.sliding_window)
    else:
        pos = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1).contiguous()
        mask = L.build_causal_padding_mask(None, seq, dtype, device, batch, sliding_window=cfg.sliding_window)
    rot = L.DeepseekV4RotaryEmbedding(cfg.rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim).to(device)
    rot_c = L.DeepseekV4RotaryEmbedding(cfg.compress_rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim, rope_scaling=cfg.rope_scaling).to(device)
    call = dict(position_embeddings=rot(x, pos), attention_mask=mask, position_embeddings_compress=rot_c(x, pos), rotary_compress=rot_c, position_ids=pos, **kwargs)
    return x, call


def seeds_causal_indexer_scores(q, pooled_kv, weights, *, compress_ratio, softmax_scale, backend=None, query_start=0, query_total_len=None):
    """The seeds' torch indexer scores with their TileLang path's causal ``-inf``
    (``p >= (query_start + s + 1) // compress_ratio``)."""
    scores = seeds.indexer_scores_torch(q, pooled_kv, weights, softmax_scale)
    ends = (torch.arange(q.shape[1], device=q.device) + query_start + 1) // compress_ratio
    hidden = torch.arange(pooled_kv.shape[1], device=q.device).view(1, 1, -1) >= ends.view(1, -1, 1)
    return scores.masked_fill(hidden, float("-inf"))


@contextlib.contextmanager
def seeds_sparse_path():
    """NeMo's sparse path (index builder + sparse attention) on the seeds' own torch functions."""
    saved = {name: getattr(L, name) for name in ("_dsv4_kernel_backend", "dsv4_sparse_attention", "dsv4_indexer_scores")}
    L._dsv4_kernel_backend = lambda backend: "tilelang"
    L.dsv4_sparse_attention = lambda q, kv, sinks, idx, scale, backend=None, **kw: seeds.dsv4_sparse_attention(q, kv, sinks, idx, scale, backend="torch")
    L.dsv4_indexer_scores = seeds_causal_indexer_scores
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(L, name, value)


def run_layer(attn, x, call, grad_seed=2):
    """Forward + backward of ``<out, g>``: ``(out, dx, {parameter: grad})``."""
    xx = x.detach().clone().requires_grad_(True)
    attn.zero_grad(set_to_none=True)
    out, _ = attn(xx, **call)
    g = torch.randn(out.shape, generator=torch.Generator(device="cpu").manual_seed(grad_seed)).to(out.device)
    (out.float() * g).sum().backward()
    return out.detach(), xx.grad, {n: p.grad for n, p in attn.named_parameters()}


def compare(tag, got, ref, tol_out, tol_grad):
    errs = {"out": rel(got[0], ref[0]), "dx": rel(got[1], ref[1])}
    for name, g_ref in ref[2].items():
        g_got = got[2][name]
        assert (g_got is None) == (g_ref is None), f"{tag}: gradient presence of {name} differs"
        if g_ref is not None and g_ref.norm() > 0:
            errs[name] = rel(g_got, g_ref)
    worst = max(((e, n) for n, e in errs.items() if n not in ("out", "dx")), default=(0.0, "-"))
    print(f"{tag}: out {errs['out']:.2e} dx {errs['dx']:.2e} worst parameter grad {worst[1]} {worst[0]:.2e}")
    assert errs["out"] <= tol_out and errs["dx"] <= tol_grad, errs
    bad = {n: e for n, e in errs.items() if e > tol_grad}
    assert not bad, f"{tag}: {bad}"


def reference_and_ours(cfg, batch, seq, packed, device, dtype, **apply_kwargs):
    ref_layer = make_attention(cfg, device, dtype)
    our_layer = copy.deepcopy(ref_layer)
    x, call = make_inputs(cfg, batch, seq, packed, device, dtype)
    with seeds_sparse_path() if packed else contextlib.nullcontext():
        ref = run_layer(ref_layer, x, call)
    with apply_dsv4_kernels_to_nemo(**apply_kwargs):
        ours = run_layer(our_layer, x, call)
    return ref, ours


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_attention_matches_seeds_cpu_f32(ratio, packed):
    cfg = make_config(small=True, ratio=ratio)
    ref, ours = reference_and_ours(cfg, 2, 512, packed, "cpu", torch.float32)
    compare(f"cpu ratio={ratio} packed={packed}", ours, ref, 1e-5, 1e-4)


# -- DeepSeek-V4 shapes on the GPU (bf16, our CUDA kernels) -------------------------------

GPU_SEQ = 2048


@cuda
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_attention_matches_seeds_gpu_bf16(ratio, packed):
    cfg = make_config(small=False, ratio=ratio)
    ref, ours = reference_and_ours(cfg, 1 if not packed else 2, GPU_SEQ, packed, "cuda", torch.bfloat16)
    compare(f"cuda ratio={ratio} packed={packed}", ours, ref, 1e-2, 2e-2)


@cuda
def test_deterministic_backward_is_bitwise_repeatable():
    cfg = make_config(small=False, ratio=4)
    layer = make_attention(cfg, "cuda", torch.bfloat16)
    x, call = make_inputs(cfg, 1, 1024, False, "cuda", torch.bfloat16)
    with apply_dsv4_kernels_to_nemo(backward_impl="deterministic"):
        a, b = run_layer(layer, x, call), run_layer(layer, x, call)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2] if a[2][n] is not None)


@cuda
@pytest.mark.parametrize("ratio", [4, 128])
def test_optimizer_steps_track(ratio):
    """A few AdamW steps on the same data: our losses follow the seeds' eager ones."""
    cfg = make_config(small=False, ratio=ratio)
    ref_layer = make_attention(cfg, "cuda", torch.bfloat16)
    our_layer = copy.deepcopy(ref_layer)
    x, call = make_inputs(cfg, 1, GPU_SEQ, False, "cuda", torch.bfloat16)
    losses = {}
    for name, layer in (("seeds", ref_layer), ("ours", our_layer)):
        opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=1e-3)
        track = []
        with apply_dsv4_kernels_to_nemo() if name == "ours" else contextlib.nullcontext():
            for _ in range(5):
                opt.zero_grad(set_to_none=True)
                out, _ = layer(x, **call)
                loss = out.float().square().mean()  # the layer learns to shrink its output
                loss.backward()
                opt.step()
                track.append(loss.item())
        losses[name] = track
    print(f"ratio={ratio} losses: seeds {losses['seeds']} ours {losses['ours']}")
    assert losses["seeds"][-1] < losses["seeds"][0]  # it trains
    for a, b in zip(losses["ours"], losses["seeds"]):
        assert abs(a - b) <= 1e-2 * abs(b), losses


@cuda
def test_fused_indexer_selects_the_seeds_set():
    """The fused indexer forward against NeMo's own (dense torch scores + torch.topk) on the
    same module and inputs: the same set of visible keys per query where scores do not tie."""
    cfg = make_config(small=False, ratio=4)
    cfg.index_topk = 512
    seq = 4096  # P = 1024 > topk: the selection matters
    layer = make_attention(cfg, "cuda", torch.bfloat16)
    x, call = make_inputs(cfg, 1, seq, False, "cuda", torch.bfloat16)
    indexer = layer.compressor.indexer
    q_residual = layer.q_norm(layer.wq_a(x))
    args = (x, q_residual, call["rotary_compress"], call["position_embeddings_compress"])

    def select():
        return indexer(*args, L.DeepseekV4TrainCache(), 0, 0, position_ids=call["position_ids"])

    with torch.no_grad():
        want = select()
        with apply_dsv4_kernels_to_nemo(fused_indexer=True) as handle:
            assert any(n.endswith("DeepseekV4Indexer.forward") for n in handle.patched)
            got = select()
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape == (1, seq, 512)
    visible = ((torch.arange(seq, device="cuda") + 1) // 4).clamp(max=512).view(1, seq, 1)
    slot = torch.arange(512, device="cuda").view(1, 1, 512)
    # The original leaves arbitrary masked positions past the visible count (the compressor
    # turns them into -1); ours gives -1 there.
    assert (got[slot.expand_as(got) >= visible] == -1).all()
    p = seq // 4  # pooled keys
    chosen = torch.zeros(1, seq, p + 1, dtype=torch.bool, device="cuda")  # + a sentinel column
    chosen.scatter_(-1, torch.where(slot < visible, want, p), True)
    hits = torch.gather(chosen, -1, torch.where(got >= 0, got, p)) & (got >= 0)
    agree = hits.sum().item() / (got >= 0).sum().item()
    print(f"fused indexer: {agree:.6f} of our selected keys are in the seeds' selection")
    assert (got >= 0).sum() == (slot < visible).sum() and agree > 0.999, agree


@cuda
def test_hyper_connection_matches_seeds():
    torch.manual_seed(0)
    hc = L.DeepseekV4HyperConnection(hc_mult=4, hidden_size=1024, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6).cuda()
    hc.init_weights(0.02)
    with torch.no_grad():
        hc.base.normal_(0.0, 0.5)
    streams = torch.randn(2, 1024, 4, 1024, device="cuda").bfloat16()
    res = {}
    for name in ("seeds", "ours"):
        hc.zero_grad(set_to_none=True)
        with apply_dsv4_kernels_to_nemo() if name == "ours" else contextlib.nullcontext():
            pre, post, comb = hc(streams)
        g = torch.randn(comb.shape, generator=torch.Generator(device="cpu").manual_seed(3)).cuda()
        (pre.sum() + post.square().sum() + (comb * g).sum()).backward()
        res[name] = (comb.detach(), {n: p.grad for n, p in hc.named_parameters()})
    assert rel(res["ours"][0], res["seeds"][0]) <= 1e-5
    for n, g in res["seeds"][1].items():
        assert rel(res["ours"][1][n], g) <= 1e-4, n


def test_fused_indexer_falls_back_off_its_contract():
    """Packed sequences, CPU tensors, offsets and irregular positions take NeMo's own forward."""
    seen = []
    original = lambda self, *a, **kw: seen.append(kw) or "original"  # noqa: E731
    forward = integration._make_fused_indexer_forward(L, original)
    x = torch.zeros(1, 8, 4)
    assert forward(None, x, None, None, None, None, 0, 0) == "original"  # CPU tensors
    assert forward(None, x, None, None, None, None, 0, 0, packed_seq_ids=torch.ones(1, 8)) == "original"
    assert len(seen) == 2
    assert integration._positions_are_plain(None, 0, 8)
    assert integration._positions_are_plain(torch.arange(8), 0, 8) and integration._positions_are_plain(torch.arange(8).expand(3, 8), 0, 8)
    assert not integration._positions_are_plain(torch.arange(8) + 1, 0, 8) and integration._positions_are_plain(torch.arange(8) + 1, 1, 8)
    pos = torch.arange(8)
    assert integration._positions_are_plain(pos, 0, 8)
    pos[3] = 0  # an in-place change is seen (the cached answer is keyed on the tensor's version)
    assert not integration._positions_are_plain(pos, 0, 8)


# -- the fused query RMSNorm + RoPE (fused_qnorm_rope=True) ------------------------------


def _attention_forward():
    return L.DeepseekV4Attention.__dict__["forward"]


@pytest.fixture
def qnorm_rope_calls(monkeypatch):
    """The fused op's calls (the fused forward looks it up on every call): q's dtypes."""
    from dsv4_kernels import _torch_ops

    seen = []
    real = _torch_ops.call.qnorm_rope
    monkeypatch.setattr(_torch_ops.call, "qnorm_rope", lambda *a: seen.append(a[0].dtype) or real(*a))
    return seen


def test_fused_qnorm_rope_patch_and_undo():
    original = _attention_forward()
    with apply_dsv4_kernels_to_nemo() as handle:  # off by default
        assert _attention_forward() is original and not handle.options.fused_qnorm_rope
    handle = apply_dsv4_kernels_to_nemo(fused_qnorm_rope=True)
    fused = _attention_forward()
    assert fused is not original and fused.__wrapped__ is original and handle.options.fused_qnorm_rope
    assert any(name.endswith("DeepseekV4Attention.forward") for name in handle.patched)
    assert (fused.__qualname__, fused.__module__, fused.__defaults__, fused.__kwdefaults__) == (original.__qualname__, original.__module__, original.__defaults__, original.__kwdefaults__)
    assert fused.__globals__ is original.__globals__  # the functions the patch rebinds in NeMo's module are seen
    assert not hasattr(L, "_dsv4_q_norm_rope") and not hasattr(L, "_dsv4_make")  # nothing added to NeMo's module
    # NeMo's code, line for line, less the two query statements (the fused call sits on the first one's line).
    lines, first = inspect.getsourcelines(original)
    norm_line = first + next(i for i, line in enumerate(lines) if "q = _rms_norm_last_dim(q," in line)
    rope_line = first + next(i for i, line in enumerate(lines) if "q = _apply_partial_rope(q, cos, sin," in line)
    code_lines = lambda f: {line for *_, line in f.__code__.co_lines() if line is not None}  # noqa: E731
    assert code_lines(original) - code_lines(fused) == {rope_line} and code_lines(fused) <= code_lines(original)
    assert norm_line in code_lines(fused) and "_rms_norm_last_dim" not in fused.__code__.co_names
    assert fused.__code__.co_filename == original.__code__.co_filename and fused.__code__.co_firstlineno == original.__code__.co_firstlineno
    again = apply_dsv4_kernels_to_nemo(fused_qnorm_rope=True)  # rebuilt from NeMo's forward, not the fused one
    assert not handle.active and _attention_forward().__wrapped__ is original
    again.undo()
    assert _attention_forward() is original
    handle.undo()
    assert _attention_forward() is original


def test_fused_qnorm_rope_refuses_a_forward_it_does_not_know(monkeypatch, tmp_path):
    before = _snapshot()
    original = _attention_forward()

    def forward(self, *args, **kwargs):  # someone else's wrapper
        return original(self, *args, **kwargs)

    forward.__wrapped__ = original
    monkeypatch.setattr(L.DeepseekV4Attention, "forward", forward)
    with pytest.raises(RuntimeError, match="nothing was patched"):
        apply_dsv4_kernels_to_nemo(fused_qnorm_rope=True)
    assert _snapshot() == before and L.DeepseekV4Attention.__dict__["forward"] is forward
    monkeypatch.undo()
    # Forwards whose source lacks the two statements, or holds them twice.
    source = "def _rms_norm_last_dim(x, eps):\n    return x\n\ndef _apply_partial_rope(x, cos, sin, r):\n    return x\n\nclass DeepseekV4Attention:\n    def forward(self, q, cos, sin):\n{}        return q\n"
    norm = "        q = _rms_norm_last_dim(q, self.config.rms_norm_eps)\n"
    rope = "        q = _apply_partial_rope(q, cos, sin, self.rope_head_dim)\n"
    for i, body in enumerate((norm, rope + norm, norm + rope + norm + rope, norm + rope)):
        path = tmp_path / f"fake_layers_{i}.py"
        path.write_text(source.format(body))
        namespace = {"__name__": f"fake_layers_{i}"}
        exec(compile(path.read_text(), str(path), "exec"), namespace)
        fake = namespace["DeepseekV4Attention"].forward
        if i < 3:
            with pytest.raises(RuntimeError, match="does not hold"):
                integration._make_fused_qnorm_rope_forward(L, fake)
        else:  # the exact pair: replaced
            assert integration._make_fused_qnorm_rope_forward(L, fake).__code__.co_freevars == ("_dsv4_q_norm_rope",)
    path.write_text("# edited after import\n" + source.format(norm + rope))  # the running forward no longer is this source
    with pytest.raises(RuntimeError, match="does not compile to the running"):
        integration._make_fused_qnorm_rope_forward(L, namespace["DeepseekV4Attention"].forward)


def _q_inputs(dtype, table_batch, positions="plain", batch=2, seq=33, heads=4, dim=64, rotary=16, device="cpu", seed=0):
    """NeMo's query ``[B,H,S,D]`` (a transposed view of the projection's ``[B,S,H*D]``, a
    leaf to take the gradient at) and its rotary tables (``DeepseekV4RotaryEmbedding`` with
    YaRN, in the model dtype like NeMo's) at plain, offset (a context-parallel shard) or
    restarting (packed documents) positions."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, seq, heads * dim, generator=g).mul(3.0).to(device=device, dtype=dtype).requires_grad_(True)
    q = x.view(batch, seq, heads, dim).transpose(1, 2)
    pos = {"plain": torch.arange(seq), "offset": torch.arange(seq) + 5 * seq, "packed": torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)])}[positions]
    pos = pos.to(device).unsqueeze(0).expand(table_batch, -1)
    rot = L.DeepseekV4RotaryEmbedding(160000.0, dim, rotary / dim, rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)).to(device)
    cos, sin = rot(x, pos)
    return x, q, cos, sin


def _nemo_q(q, cos, sin, rotary, eps=1e-6):
    """NeMo's two statements (layers.py:1317, 1319)."""
    return L._apply_partial_rope(L._rms_norm_last_dim(q, eps), cos, sin, rotary)


def _q_module(rotary, eps=1e-6):
    return types.SimpleNamespace(config=types.SimpleNamespace(rms_norm_eps=eps), rope_head_dim=rotary)


def _q_and_grad(fn, x, q, cos, sin, seed=3):
    out = fn(q, cos, sin)
    g = torch.randn(out.shape, generator=torch.Generator(device="cpu").manual_seed(seed)).to(device=out.device, dtype=out.dtype)
    (dx,) = torch.autograd.grad((out.float() * g.float()).sum(), x)
    return out.detach(), dx


def _bf16_ulps(got, ref):
    """Elementwise distance in bf16 ulps of the reference's magnitude."""
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(ref.double().abs().clamp_min(1e-30))))
    return ((got.double() - ref.double()).abs() / ulp).max().item()


@pytest.mark.parametrize("positions", ["plain", "offset", "packed"])
@pytest.mark.parametrize("table_batch", [1, 2], ids=["tables_b1", "tables_bB"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_q_norm_rope_matches_nemo_cpu(dtype, table_batch, positions, qnorm_rope_calls):
    """The fused query step against NeMo's two statements on the same query and tables."""
    rotary = 16
    x, q, cos, sin = _q_inputs(dtype, table_batch, positions, rotary=rotary)
    fused = integration._make_q_norm_rope(L)
    ours = _q_and_grad(lambda q, c, s: fused(_q_module(rotary), q, c, s), x, q, cos, sin)
    assert qnorm_rope_calls == [dtype]
    ref = _q_and_grad(lambda q, c, s: _nemo_q(q, c, s, rotary), x, q, cos, sin)
    assert ours[0].dtype == ref[0].dtype == dtype and ours[0].shape == ref[0].shape == q.shape
    assert ours[1].dtype == dtype and ours[0].transpose(1, 2).is_contiguous()  # token-major
    if dtype == torch.float32:
        assert rel(ours[0], ref[0]) <= 1e-6 and rel(ours[1], ref[1]) <= 1e-6
    else:  # the same two roundings: at most one bf16 ulp apart (f32 summation order)
        assert _bf16_ulps(ours[0], ref[0]) <= 1 and rel(ours[1], ref[1]) <= 1e-3


def test_q_norm_rope_falls_back_off_its_contract(qnorm_rope_calls):
    """Where the math would differ, NeMo's own statements run (bitwise NeMo's result)."""
    fused = integration._make_q_norm_rope(L)
    rotary = 16

    def same(x, q, cos, sin, module=None, reason=None):
        module = module or _q_module(rotary)
        assert reason is None or reason in (integration._q_unfusable(q, cos, sin, module.rope_head_dim, module.config.rms_norm_eps) or "")
        got = fused(module, q, cos, sin)
        want = _nemo_q(q, cos, sin, module.rope_head_dim, module.config.rms_norm_eps)
        assert got.dtype == want.dtype and torch.equal(got, want)

    for dtype in (torch.float16, torch.float64):
        same(*_q_inputs(dtype, 2), reason="q is")
    x, q, cos, sin = _q_inputs(torch.bfloat16, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same(x, q, cos, sin, reason="autocast")
    same(x, q, cos.detach().requires_grad_(True), sin, reason="fixed")  # a table that needs a gradient
    wide_cos, wide_sin = (torch.cat([t, t], dim=-1) for t in (cos, sin))  # NeMo reads the first half of any width
    same(x, q, wide_cos, wide_sin, reason="rotary tables")
    same(x, q, cos, sin, module=_q_module(rotary, eps=0.0), reason="rms_norm_eps")
    assert qnorm_rope_calls == []
    assert integration._q_unfusable(q, cos, sin, 15, 1e-6).startswith("rope_head_dim")
    assert integration._q_unfusable(q, cos, sin, 0, 1e-6).startswith("rope_head_dim")
    assert integration._q_unfusable(q, cos, sin, rotary, 1e-6) is None


def _three_ways(cfg, batch, seq, packed, dtype):
    """NeMo's own path (as in reference_and_ours), our patch unfused, our patch with the
    fused query step: three copies of one layer on the same inputs."""
    ref_layer = make_attention(cfg, "cpu", dtype)
    layers = [copy.deepcopy(ref_layer) for _ in range(2)]
    x, call = make_inputs(cfg, batch, seq, packed, "cpu", dtype)
    with seeds_sparse_path() if packed else contextlib.nullcontext():
        ref = run_layer(ref_layer, x, call) if dtype == torch.float32 else None
    with apply_dsv4_kernels_to_nemo():
        unfused = run_layer(layers[0], x, call)
    with apply_dsv4_kernels_to_nemo(fused_qnorm_rope=True):
        fused = run_layer(layers[1], x, call)
    return ref, unfused, fused


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fused_qnorm_rope_layer_matches_cpu_f32(ratio, packed, qnorm_rope_calls):
    cfg = make_config(small=True, ratio=ratio)
    ref, unfused, fused = _three_ways(cfg, 2, 512, packed, torch.float32)
    assert qnorm_rope_calls == [torch.float32]  # one fused call, in the fused run only
    compare(f"cpu fused qnorm_rope vs NeMo ratio={ratio} packed={packed}", fused, ref, 1e-5, 1e-4)
    compare(f"cpu fused vs unfused qnorm_rope ratio={ratio} packed={packed}", fused, unfused, 1e-6, 1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fused_qnorm_rope_layer_matches_unfused_cpu_bf16(packed, qnorm_rope_calls):
    """bf16 (the two rounding boundaries in place): the fused query step against NeMo's
    statements, with the rest of the layer on our kernels both times."""
    cfg = make_config(small=True, ratio=4)
    cfg.torch_dtype = "bfloat16"
    _, unfused, fused = _three_ways(cfg, 2, 256, packed, torch.bfloat16)
    assert qnorm_rope_calls == [torch.bfloat16]
    compare(f"cpu bf16 fused vs unfused qnorm_rope packed={packed}", fused, unfused, 2e-3, 1e-2)


CP_RATIOS = (0, 4, 128)


def _cp_worker(rank, world, init, out_dir):
    """One context-parallel rank (gloo, CPU), for each compress ratio, unfused then fused:
    a contiguous query shard of one sequence, NeMo's CP mask, rotary tables at the shard's
    positions, forward + backward; saves outputs, gradients and the fused op's call count."""
    import torch.distributed as dist
    from nemo_automodel.components.models.deepseek_v4.cp import build_dsv4_cp_causal_padding_mask

    from dsv4_kernels import _torch_ops

    calls = []
    real = _torch_ops.call.qnorm_rope
    _torch_ops.call.qnorm_rope = lambda *a: calls.append(1) or real(*a)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        for ratio in CP_RATIOS:
            cfg = make_config(small=True, ratio=ratio)
            seq = 256
            n = seq // world
            x_full = torch.randn(1, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
            pos = torch.arange(rank * n, (rank + 1) * n).unsqueeze(0)
            mask = build_dsv4_cp_causal_padding_mask(position_ids=pos, key_len=seq, dtype=torch.float32, device="cpu", cp_group=group, sliding_window=cfg.sliding_window)
            rot = L.DeepseekV4RotaryEmbedding(cfg.rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim)
            rot_c = L.DeepseekV4RotaryEmbedding(cfg.compress_rope_theta, cfg.head_dim, cfg.qk_rope_head_dim / cfg.head_dim, rope_scaling=cfg.rope_scaling)
            for fused in (False, True):
                layer = make_attention(cfg, "cpu", torch.float32)
                x = x_full[:, rank * n:(rank + 1) * n].clone().requires_grad_(True)
                call = dict(position_embeddings=rot(x, pos), attention_mask=mask, position_embeddings_compress=rot_c(x, pos), rotary_compress=rot_c, position_ids=pos, _dsv4_cp_group=group)
                calls.clear()
                with apply_dsv4_kernels_to_nemo(fused_qnorm_rope=fused):
                    out, _ = layer(x, **call)
                    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(2 + rank))).sum().backward()
                grads = {k: p.grad for k, p in layer.named_parameters()}
                torch.save((out.detach(), x.grad, grads, len(calls)), os.path.join(out_dir, f"{ratio}-{int(fused)}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fused_qnorm_rope_context_parallel_cpu():
    """Two CP ranks (gloo, two CPU processes), compress ratios 0, 4 and 128: the fused
    query step gives the unfused patch's outputs, input gradients and (summed over ranks)
    parameter gradients; the rows' positions come from NeMo's tables for each shard."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    world = 2
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_cp_worker, args=(r, world, "file://" + os.path.join(d, "store"), d)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        saved = {(ratio, fused): [torch.load(os.path.join(d, f"{ratio}-{fused}-{r}.pt")) for r in range(world)] for ratio in CP_RATIOS for fused in (0, 1)}
    for ratio in CP_RATIOS:
        results = {}
        for fused in (0, 1):
            shards = saved[ratio, fused]
            assert [s[3] for s in shards] == [fused] * world  # one fused call a rank, in the fused run only
            grads = {k: (sum(s[2][k] for s in shards) if shards[0][2][k] is not None else None) for k in shards[0][2]}
            results[fused] = (torch.cat([s[0] for s in shards], 1), torch.cat([s[1] for s in shards], 1), grads)
        compare(f"cp=2 fused vs unfused qnorm_rope ratio={ratio}", results[1], results[0], 1e-6, 1e-5)


@cuda
@pytest.mark.parametrize("table_batch", [1, 2], ids=["tables_b1", "tables_bB"])
def test_fused_qnorm_rope_matches_nemo_gpu_bf16(table_batch, qnorm_rope_calls):
    """DeepSeek-V4's query (H=64, D=512, rope 64) on our CUDA kernel against NeMo's two
    statements on CUDA: output within 2 bf16 ulps (SPEC.md section 8), input gradient."""
    rotary = 64
    x, q, cos, sin = _q_inputs(torch.bfloat16, table_batch, "packed", batch=2, seq=GPU_SEQ, heads=64, dim=512, rotary=rotary, device="cuda")
    fused = integration._make_q_norm_rope(L)
    ours = _q_and_grad(lambda q, c, s: fused(_q_module(rotary), q, c, s), x, q, cos, sin)
    ref = _q_and_grad(lambda q, c, s: _nemo_q(q, c, s, rotary), x, q, cos, sin)
    assert qnorm_rope_calls == [torch.bfloat16]
    ulps, e_dx = _bf16_ulps(ours[0], ref[0]), rel(ours[1], ref[1])
    print(f"cuda qnorm_rope vs NeMo: out {ulps:.0f} ulps, {rel(ours[0], ref[0]):.2e}; dx {e_dx:.2e}")
    assert ulps <= 2 and rel(ours[0], ref[0]) <= 1e-2 and e_dx <= 1e-2


@cuda
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_fused_qnorm_rope_layer_matches_gpu_bf16(ratio, packed, qnorm_rope_calls):
    """The DeepSeek-V4-shaped layer with the fused query step: against NeMo's own path
    (the tolerance of test_attention_matches_seeds_gpu_bf16) and against the unfused patch."""
    cfg = make_config(small=False, ratio=ratio)
    batch = 1 if not packed else 2
    ref, ours = reference_and_ours(cfg, batch, GPU_SEQ, packed, "cuda", torch.bfloat16, fused_qnorm_rope=True, backward_impl="deterministic")
    assert qnorm_rope_calls == [torch.bfloat16]
    compare(f"cuda fused qnorm_rope vs NeMo ratio={ratio} packed={packed}", ours, ref, 1e-2, 2e-2)
    layer = make_attention(cfg, "cuda", torch.bfloat16)
    x, call = make_inputs(cfg, batch, GPU_SEQ, packed, "cuda", torch.bfloat16)
    with apply_dsv4_kernels_to_nemo(backward_impl="deterministic"):
        unfused = run_layer(layer, x, call)
    compare(f"cuda fused vs unfused qnorm_rope ratio={ratio} packed={packed}", ours, unfused, 5e-3, 1e-2)
