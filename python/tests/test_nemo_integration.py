"""``apply_dsv4_kernels_to_nemo()`` against NeMo AutoModel 0.7.0's own torch paths, in
NeMo's own layers: ``DeepseekV4Attention`` for compress ratios 0, 4 and 128, plain and
packed sequences, forward and backward (output, input and parameter gradients), a few
optimizer steps whose losses must track, the fused lightning indexer's selection, and
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
        apply_dsv4_kernels_to_nemo(qnorm_rope=True)  # not offered (see the module documentation)
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
