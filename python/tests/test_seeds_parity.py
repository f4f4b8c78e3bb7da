"""Parity with the seeds themselves: NeMo AutoModel 0.7.0's own torch references against this package's `backend="cuda"`, forward and backward, at
DeepSeek-V4 shapes. Runs where torch with CUDA and the `nemo_automodel` package are
importable (the GPU machine, with the wheel on PYTHONPATH); the same calls go to both
modules, which is the drop-in claim. (The 0.7.0 wheel ships no qnorm_rope module;
test_gpu.py checks qnorm_rope against a torch composite of SPEC.md section 5.)
"""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
seeds = pytest.importorskip("nemo_automodel.components.models.deepseek_v4.optimized_kernels")

import dsv4_kernels as dk  # noqa: E402

DEV = "cuda"


def rel(got, ref):
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)), "-inf / NaN placement differs"
    assert not torch.isnan(got).any()
    g, r = got[fin], ref[fin]
    return ((g - r).norm() / r.norm().clamp_min(1e-30)).item()


def selection(b, s, p, r, k, gen):
    """Random distinct causal pooled-key picks [b, s, k] (-1 past the visible count)."""
    out = torch.full((b, s, k), -1, dtype=torch.int32)
    for si in range(s):
        vis = min((si + 1) // r, p)
        take = min(k, vis)
        if take:
            out[:, si, :take] = torch.stack([torch.randperm(vis, generator=gen)[:take] for _ in range(b)]).int()
    return out.to(DEV)


@pytest.mark.parametrize("s", [512, 2048])
def test_sparse_attention_matches_seeds(s):
    gen = torch.Generator().manual_seed(s)
    b, h, d, window, k, r = 1, 64, 512, 128, 512, 4
    p = s // r
    kl = s + p
    sel = selection(b, s, p, r, k, gen)
    args = dict(batch_size=b, seq_len=s, key_len=kl, window_size=window, device=torch.device(DEV), compress_ratio=r, compressed_topk=sel, n_pooled=p)
    idx_seeds = seeds.build_dsv4_sparse_topk_indices(**args)
    idx = dk.build_dsv4_sparse_topk_indices(**args)
    assert torch.equal(idx.long().cpu(), idx_seeds.long().cpu()), "index builder differs from the seeds'"

    q0 = torch.randn(b, s, h, d, generator=gen).bfloat16().to(DEV)
    kv0 = torch.randn(b, kl, d, generator=gen).bfloat16().to(DEV)
    sinks0 = torch.randn(h, generator=gen).to(DEV)
    g = torch.randn(b, s, h, d, generator=gen).bfloat16().to(DEV)
    scale = d ** -0.5
    res = {}
    for name, fn in [("seeds", lambda *a: seeds.sparse_attention_torch(*a)), ("cuda", lambda *a: dk.dsv4_sparse_attention(*a, backend="cuda"))]:
        q, kv, sinks = (t.clone().requires_grad_() for t in (q0, kv0, sinks0))
        out = fn(q, kv, sinks, idx, scale)
        out.backward(g)
        res[name] = (out.detach(), q.grad, kv.grad, sinks.grad)
    (o_s, dq_s, dkv_s, ds_s), (o, dq, dkv, ds) = res["seeds"], res["cuda"]
    errs = dict(out=rel(o, o_s), dq=rel(dq, dq_s), dkv=rel(dkv, dkv_s), dsinks=rel(ds, ds_s))
    print(f"sparse_attention S={s}: {errs}")
    assert errs["out"] <= 1e-2 and errs["dq"] <= 1e-2
    assert errs["dkv"] <= 5e-3 + 4e-3  # bf16 dkv on both sides: each rounds to 2^-9
    assert errs["dsinks"] <= 5e-3


def test_indexer_matches_seeds():
    gen = torch.Generator().manual_seed(7)
    b, s, h, d, r, k = 1, 2048, 64, 128, 4, 512
    p = s // r
    q0 = torch.randn(b, s, h, d, generator=gen).bfloat16().to(DEV)
    kv0 = torch.randn(b, p, d, generator=gen).bfloat16().to(DEV)
    w0 = torch.rand(b, s, h, generator=gen).to(DEV)
    scale = d ** -0.5
    ref = seeds.indexer_scores_torch(q0, kv0, w0, scale)
    got = dk.dsv4_indexer_scores(q0, kv0, w0, compress_ratio=r, softmax_scale=scale, backend="cuda")
    vis = torch.arange(p, device=DEV).view(1, 1, p) < ((torch.arange(s, device=DEV) + 1) // r).view(1, s, 1)
    assert torch.isneginf(got[~vis.expand_as(got)]).all(), "non-visible keys must score -inf"
    err = ((got[vis.expand_as(got)] - ref[vis.expand_as(ref)]).abs().max() / ref.abs().amax()).item()
    print(f"indexer scores: max err / max |ref| = {err:.2e}")
    assert err <= 1e-5

    sel = selection(b, s, p, r, k, gen)
    res = {}
    for name, fn in [
        ("seeds", lambda *a: seeds.extract_indexer_topk_scores_torch(seeds.indexer_scores_torch(a[0], a[1], a[2], scale), sel.long())),
        ("cuda", lambda *a: dk.dsv4_indexer_topk_scores(*a, sel, compress_ratio=r, softmax_scale=scale, backend="cuda")),
    ]:
        q, kv, w = (t.clone().requires_grad_() for t in (q0, kv0, w0))
        out = fn(q, kv, w)
        gs = torch.where(torch.isfinite(out), torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEV), 0.0)
        torch.where(torch.isfinite(out), out, 0.0).backward(gs)
        res[name] = (out.detach(), q.grad, kv.grad, w.grad)
    (o_s, dq_s, dkv_s, dw_s), (o, dq, dkv, dw) = res["seeds"], res["cuda"]
    errs = dict(scores=rel(o, o_s), dq=rel(dq, dq_s), dpooled_kv=rel(dkv.float(), dkv_s.float()), dweights=rel(dw, dw_s))
    print(f"indexer top-k scores: {errs}")
    assert errs["scores"] <= 1e-5 and errs["dq"] <= 1e-2
    assert errs["dpooled_kv"] <= 5e-3 + 4e-3 and errs["dweights"] <= 5e-3


@pytest.mark.parametrize("m,repeat", [(65536, 20), (4096, 1)])
def test_sinkhorn_matches_seeds(m, repeat):
    gen = torch.Generator().manual_seed(m)
    x0 = (3 * torch.randn(m, 4, 4, generator=gen)).to(DEV)
    g = torch.randn(m, 4, 4, generator=gen).to(DEV)
    res = {}
    for name, fn in [("seeds", seeds.sinkhorn_normalize_torch), ("cuda", lambda x, repeat, eps: dk.dsv4_sinkhorn_normalize(x, backend="cuda", repeat=repeat, eps=eps))]:
        x = x0.clone().requires_grad_()
        y = fn(x, repeat=repeat, eps=1e-6)
        y.backward(g.transpose(-1, -2).contiguous().transpose(-1, -2))  # a non-contiguous gradient
        res[name] = (y.detach(), x.grad)
    err_y = rel(res["cuda"][0], res["seeds"][0])
    err_dx = rel(res["cuda"][1], res["seeds"][1])
    print(f"sinkhorn m={m} repeat={repeat}: out {err_y:.2e} dx {err_dx:.2e}")
    assert err_y <= 1e-5 and err_dx <= 1e-4
