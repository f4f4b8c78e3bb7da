//! GPU tests of the lightning indexer (SPEC.md sections 2 and 3): the CUDA backend against
//! the reference backend on the same bf16-representable inputs (the reference gets them
//! as f32). Outputs are poisoned first (NaN / huge indices) and must be fully overwritten.
//! `small_*` tests are cheap enough for compute-sanitizer.
//!
//! Run with `scripts/gpu-test.sh` (they are ignored without a GPU).

mod common;

use dsv4_core::backend::{reference_backend, KernelBackend};
use dsv4_core::compare::{judge, Tolerance};
use dsv4_core::ops::indexer::{IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::{DType, Tensor, TensorView};
use common::*;


fn reference() -> &'static dyn KernelBackend {
    reference_backend()
}

fn alloc(dtype: DType, shape: &[usize]) -> Tensor {
    let t = cuda().alloc(dtype, shape, DEV).unwrap();
    poison(&t, if dtype == DType::I32 || dtype == DType::I64 { 0x7F } else { 0xFF });
    t
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    s: usize,
    h: usize,
    d: usize,
    p: usize,
    r: usize,
    query_start: usize,
}

/// Host inputs (f32 holding bf16 values; weights plain f32) and their device copies
/// (q and pooled_kv as bf16).
struct Inputs {
    c: Case,
    scale: f32,
    q: Tensor,
    kv: Tensor,
    w: Tensor,
    dq: Tensor,
    dkv: Tensor,
    dw: Tensor,
}

impl Inputs {
    fn new(c: Case, seed: u64) -> Inputs {
        let mut rng = Rng(seed);
        let q: Vec<f32> = (0..c.b * c.s * c.h * c.d).map(|_| rng.bf16_normal()).collect();
        let kv: Vec<f32> = (0..c.b * c.p * c.d).map(|_| rng.bf16_normal()).collect();
        // Weights in [-0.2, 1): both signs, but a row's few visible scores (a query that
        // sees one key) rarely cancel to a tiny fraction of their terms, which would make
        // "1e-5 of the row scale" a test of summation order rather than of the kernel.
        let w: Vec<f32> = (0..c.b * c.s * c.h).map(|_| 0.4 + 0.6 * rng.sym()).collect();
        let qt = Tensor::from_f32(&[c.b, c.s, c.h, c.d], q.clone()).unwrap();
        let kvt = Tensor::from_f32(&[c.b, c.p, c.d], kv.clone()).unwrap();
        let wt = Tensor::from_f32(&[c.b, c.s, c.h], w).unwrap();
        let dq = up(&Tensor::from_f32_as_bf16(&[c.b, c.s, c.h, c.d], &q).unwrap());
        let dkv = up(&Tensor::from_f32_as_bf16(&[c.b, c.p, c.d], &kv).unwrap());
        let dw = up(&wt);
        Inputs { c, scale: 1.0 / (c.d as f32).sqrt(), q: qt, kv: kvt, w: wt, dq, dkv, dw }
    }
    fn host_args(&self) -> IndexerArgs<'_> {
        let mut a = IndexerArgs::new(self.q.view(), self.kv.view(), self.w.view(), self.scale, self.c.r);
        a.query_start = self.c.query_start;
        a
    }
    fn dev_args(&self) -> IndexerArgs<'_> {
        let mut a = IndexerArgs::new(self.dq.view(), self.dkv.view(), self.dw.view(), self.scale, self.c.r);
        a.query_start = self.c.query_start;
        a
    }
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

fn ref_scores(inp: &Inputs) -> Tensor {
    let c = inp.c;
    let mut out = Tensor::zeros(DType::F32, &[c.b, c.s, c.p]);
    reference().indexer_scores(&inp.host_args(), &mut out.view_mut()).unwrap();
    out
}

fn gpu_scores(a: &IndexerArgs, c: Case) -> Tensor {
    let mut out = alloc(DType::F32, &[c.b, c.s, c.p]);
    cuda().indexer_scores(a, &mut out.view_mut()).unwrap();
    out
}

fn check_scores(name: &str, got: &Tensor, reference: &Tensor, row_len: usize) {
    let j = judge(name, &f64s(got), &f64s(reference), Tolerance::F32Rows { row_len });
    assert!(j.pass, "{j}");
}

/// GPU top-k of `scores` (any device tensor) -> (indices, values) on the host.
fn gpu_topk(scores: &TensorView, k: usize) -> (Vec<i64>, Vec<f32>) {
    let (b, s, p) = (scores.shape()[0], scores.shape()[1], scores.shape()[2]);
    let kk = k.min(p);
    let mut idx = alloc(DType::I32, &[b, s, kk]);
    let mut val = alloc(DType::F32, &[b, s, kk]);
    cuda().indexer_topk(scores, k, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
    (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap())
}

fn ref_topk(scores: &Tensor, k: usize) -> (Vec<i64>, Vec<f32>) {
    let (b, s, p) = (scores.shape()[0], scores.shape()[1], scores.shape()[2]);
    let kk = k.min(p);
    let mut idx = Tensor::zeros(DType::I32, &[b, s, kk]);
    let mut val = Tensor::zeros(DType::F32, &[b, s, kk]);
    reference().indexer_topk(&scores.view(), k, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
    (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap())
}

fn assert_same_selection(name: &str, got: &(Vec<i64>, Vec<f32>), want: &(Vec<i64>, Vec<f32>)) {
    assert_eq!(got.0.len(), want.0.len(), "{name}: lengths");
    for (i, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert_eq!(g, w, "{name}: index slot {i}: got {g}, reference {w}");
    }
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        assert!(g.to_bits() == w.to_bits() || g == w, "{name}: value slot {i}: got {g}, reference {w}");
    }
}

/// The GPU selection `got` (indices per row of `kk`) is a top-k of the reference scores:
/// the right count, distinct visible keys, descending GPU values, and every selected key's
/// reference score within the scores tolerance of the reference k-th best.
fn assert_topk_of_reference(name: &str, got: &(Vec<i64>, Vec<f32>), ref_scores: &[f64], p: usize, kk: usize) {
    for (r, row) in ref_scores.chunks(p).enumerate() {
        let mut finite: Vec<f64> = row.iter().copied().filter(|x| x.is_finite()).collect();
        finite.sort_by(|a, b| b.partial_cmp(a).unwrap());
        let want = kk.min(finite.len());
        let scale = finite.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        let gi = &got.0[r * kk..(r + 1) * kk];
        let gv = &got.1[r * kk..(r + 1) * kk];
        let n = gi.iter().filter(|&&i| i >= 0).count();
        assert_eq!(n, want, "{name}: row {r}: {n} selected, {want} finite scores to take");
        assert!(gi[..n].iter().all(|&i| i >= 0) && gi[n..].iter().all(|&i| i == -1), "{name}: row {r}: -1 only at the end");
        assert!(gv[n..].iter().all(|&v| v == f32::NEG_INFINITY), "{name}: row {r}: -inf past the count");
        let mut seen = std::collections::HashSet::new();
        for j in 0..n {
            let i = gi[j] as usize;
            assert!(i < p && row[i].is_finite() && seen.insert(i), "{name}: row {r}: bad or repeated index {i}");
            if j > 0 {
                assert!(gv[j] <= gv[j - 1], "{name}: row {r}: values not descending at slot {j}");
            }
        }
        if want > 0 {
            let kth = finite[want - 1];
            let worst = gi[..n].iter().map(|&i| row[i as usize]).fold(f64::INFINITY, f64::min);
            assert!(worst >= kth - 4e-5 * scale, "{name}: row {r}: selected score {worst} below the reference k-th {kth}");
        }
    }
}

fn case(b: usize, s: usize, h: usize, d: usize, p: usize, r: usize, query_start: usize) -> Case {
    Case { b, s, h, d, p, r, query_start }
}

const SMALL_CASES: [Case; 6] = [
    Case { b: 2, s: 7, h: 3, d: 16, p: 5, r: 1, query_start: 0 },
    Case { b: 1, s: 13, h: 17, d: 40, p: 9, r: 2, query_start: 3 },
    Case { b: 2, s: 5, h: 5, d: 20, p: 11, r: 1, query_start: 4 }, // D % 8 != 0: packed
    Case { b: 1, s: 33, h: 64, d: 128, p: 37, r: 4, query_start: 100 },
    Case { b: 2, s: 9, h: 16, d: 64, p: 70, r: 1, query_start: 61 },
    Case { b: 1, s: 19, h: 8, d: 136, p: 130, r: 3, query_start: 0 }, // queries 0, 1 see no key
];

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_scores_match_reference() {
    for (i, &c) in SMALL_CASES.iter().enumerate() {
        let inp = Inputs::new(c, 100 + i as u64);
        let got = gpu_scores(&inp.dev_args(), c);
        check_scores(&format!("scores {c:?}"), &got, &ref_scores(&inp), c.p);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_scores_of_strided_inputs() {
    // q viewed from [B,H,S,D] storage (aligned rows: used in place) and pooled_kv with
    // every other element (d-stride 2: packed first).
    let c = case(2, 11, 6, 32, 13, 2, 5);
    let inp = Inputs::new(c, 7);
    let qh = inp.q.view().to_f32_vec().unwrap();
    let mut q_bhsd = vec![0f32; qh.len()];
    for b in 0..c.b {
        for s in 0..c.s {
            for h in 0..c.h {
                for d in 0..c.d {
                    q_bhsd[((b * c.h + h) * c.s + s) * c.d + d] = qh[((b * c.s + s) * c.h + h) * c.d + d];
                }
            }
        }
    }
    let q_dev = up(&Tensor::from_f32_as_bf16(&[c.b, c.h, c.s, c.d], &q_bhsd).unwrap());
    let q_view = q_dev.view().transpose(1, 2);
    let kvh = inp.kv.view().to_f32_vec().unwrap();
    let kv2: Vec<f32> = kvh.iter().flat_map(|&x| [x, 7.0]).collect();
    let kv_dev = up(&Tensor::from_f32_as_bf16(&[c.b, c.p, 2 * c.d], &kv2).unwrap()).with_layout(&[c.b, c.p, c.d], &[(c.p * 2 * c.d) as isize, (2 * c.d) as isize, 2]);
    let mut a = IndexerArgs::new(q_view, kv_dev.view(), inp.dw.view(), inp.scale, c.r);
    a.query_start = c.query_start;
    let got = gpu_scores(&a, c);
    check_scores("strided scores", &got, &ref_scores(&inp), c.p);
}

/// Rows built to hit every rule of the selection: ties, -0/+0, -inf, +inf, NaN, rows
/// with fewer finite scores than k, all -inf rows.
fn crafted_scores(rows: usize, p: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let mut v = Vec::with_capacity(rows * p);
    for r in 0..rows {
        let kind = r % 5;
        for _ in 0..p {
            let u = rng.below(100);
            let x = match kind {
                0 => rng.sym() * 10.0,                            // distinct values
                1 => (rng.below(7) as f32 - 3.0) * 0.5,               // heavy ties
                2 if u < 70 => f32::NEG_INFINITY,                     // few finite
                3 => f32::NEG_INFINITY,                               // nothing finite
                _ if u < 5 => f32::NAN,
                _ if u < 8 => f32::INFINITY,
                _ if u < 14 => f32::NEG_INFINITY,
                _ if u < 20 => 0.0,
                _ if u < 26 => -0.0,
                _ => rng.sym(),
            };
            v.push(x);
        }
    }
    v
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_topk_is_exact() {
    // (B, S, P, k): k > P, k == P, small rows, long rows streamed from global memory,
    // large k; the DSV4 k = 512 and an uneven k over rows of every kind.
    for (i, &(b, s, p, k)) in [(2, 5, 7, 16), (1, 5, 9, 9), (2, 5, 100, 10), (1, 5, 1000, 512), (1, 5, 5000, 3000), (1, 5, 70000, 2048), (1, 5, 1, 1), (1, 10, 4096, 512), (2, 5, 2048, 300)].iter().enumerate() {
        let scores = Tensor::from_f32(&[b, s, p], crafted_scores(b * s, p, 40 + i as u64)).unwrap();
        let dev = up(&scores);
        let got = gpu_topk(&dev.view(), k);
        assert_same_selection(&format!("topk B={b} S={s} P={p} k={k}"), &got, &ref_topk(&scores, k));
    }
    // Non-contiguous scores: every other element of a [B,S,2P] buffer.
    let (b, s, p, k) = (2, 5, 300, 64);
    let raw = crafted_scores(b * s, 2 * p, 99);
    let dense: Vec<f32> = raw.chunks(2 * p).flat_map(|r| r.iter().step_by(2).copied().collect::<Vec<_>>()).collect();
    let dev = up(&Tensor::from_f32(&[b, s, 2 * p], raw).unwrap()).with_layout(&[b, s, p], &[(s * 2 * p) as isize, (2 * p) as isize, 2]);
    let got = gpu_topk(&dev.view(), k);
    assert_same_selection("strided topk", &got, &ref_topk(&Tensor::from_f32(&[b, s, p], dense).unwrap(), k));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_fused_topk_matches_unfused_and_reference() {
    for (i, &c) in SMALL_CASES.iter().enumerate() {
        let inp = Inputs::new(c, 200 + i as u64);
        for k in [1, 4, c.p, c.p + 3] {
            let scores = gpu_scores(&inp.dev_args(), c);
            let unfused = gpu_topk(&scores.view(), k);
            let kk = k.min(c.p);
            let mut idx = alloc(DType::I32, &[c.b, c.s, kk]);
            let mut val = alloc(DType::F32, &[c.b, c.s, kk]);
            cuda().indexer_fused_topk(&inp.dev_args(), k, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
            let fused = (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap());
            let name = format!("fused {c:?} k={k}");
            assert_same_selection(&name, &fused, &unfused);
            // The bounded-scratch path, 3 queries a block (the last one partial).
            let mut idx = alloc(DType::I32, &[c.b, c.s, kk]);
            let mut val = alloc(DType::F32, &[c.b, c.s, kk]);
            dsv4_cuda::indexer::chunked_topk(dsv4_cuda::gpu(0).unwrap(), &inp.dev_args(), k, &mut idx.view_mut(), &mut val.view_mut(), 3 * c.b * c.p * 4).unwrap();
            let chunked = (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap());
            assert_same_selection(&format!("chunked {c:?} k={k}"), &chunked, &unfused);
            // The unfused GPU selection is exactly the reference top-k of the GPU scores.
            assert_same_selection(&name, &unfused, &ref_topk(&scores.to_host().unwrap(), k));
            assert_topk_of_reference(&name, &fused, &f64s(&ref_scores(&inp)), c.p, kk);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_fused_topk_long_rows_take_the_chunked_path() {
    // P = 20000: two rows of scores exceed the fused kernel's shared memory, so blocks of
    // queries are scored into a bounded scratch and selected by topk.cu.
    let c = case(1, 40, 8, 32, 20000, 1, 19990);
    let inp = Inputs::new(c, 77);
    for k in [600, 16384] {
        let kk = k.min(c.p);
        let scores = gpu_scores(&inp.dev_args(), c);
        let unfused = gpu_topk(&scores.view(), k);
        let mut idx = alloc(DType::I32, &[c.b, c.s, kk]);
        let mut val = alloc(DType::F32, &[c.b, c.s, kk]);
        cuda().indexer_fused_topk(&inp.dev_args(), k, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
        let fused = (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap());
        let name = format!("chunked fused {c:?} k={k}");
        assert_same_selection(&name, &fused, &unfused);
        assert_same_selection(&name, &unfused, &ref_topk(&scores.to_host().unwrap(), k));
        assert_topk_of_reference(&name, &fused, &f64s(&ref_scores(&inp)), c.p, kk);
    }
}

/// A selection `[B,S,T]` mixing top picks, random keys (visible or not), -1, out-of-range
/// indices and duplicates.
fn selection(c: Case, t: usize, seed: u64) -> Vec<i64> {
    let mut rng = Rng(seed);
    (0..c.b * c.s * t)
        .map(|_| match rng.below(10) {
            0 => -1,
            1 => (c.p + rng.below(5) as usize) as i64,
            2 => -(rng.below(100) as i64) - 2,
            _ => rng.below(c.p.max(1) as u64) as i64,
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_topk_scores_match_reference() {
    for (i, &c) in SMALL_CASES.iter().enumerate() {
        let inp = Inputs::new(c, 300 + i as u64);
        for (t, dtype) in [(7, DType::I32), (130, DType::I64)] {
            let sel = selection(c, t, 400 + i as u64);
            let host = match dtype {
                DType::I32 => Tensor::from_i32(&[c.b, c.s, t], sel.iter().map(|&x| x as i32).collect()).unwrap(),
                _ => Tensor::from_i64(&[c.b, c.s, t], sel.clone()).unwrap(),
            };
            let dev = up(&host);
            let mut want = Tensor::zeros(DType::F32, &[c.b, c.s, t]);
            reference().indexer_topk_scores(&inp.host_args(), &host.view(), &mut want.view_mut()).unwrap();
            let mut got = alloc(DType::F32, &[c.b, c.s, t]);
            cuda().indexer_topk_scores(&inp.dev_args(), &dev.view(), &mut got.view_mut()).unwrap();
            check_scores(&format!("topk_scores {c:?} T={t} {dtype}"), &got, &want, t);
        }
    }
}

struct Grads {
    dq: Tensor,
    dw: Tensor,
    dkv: Tensor,
}

fn gpu_backward(inp: &Inputs, sel: &Tensor, grad: &Tensor, deterministic: bool) -> Grads {
    let c = inp.c;
    let a = IndexerTopkScoresBwdArgs { fwd: inp.dev_args(), topk_indices: sel.view(), grad: grad.view(), deterministic };
    let mut g = Grads { dq: alloc(DType::BF16, &[c.b, c.s, c.h, c.d]), dw: alloc(DType::F32, &[c.b, c.s, c.h]), dkv: alloc(DType::F32, &[c.b, c.p, c.d]) };
    cuda().indexer_topk_scores_bwd(&a, &mut g.dq.view_mut(), &mut g.dw.view_mut(), &mut g.dkv.view_mut()).unwrap();
    g
}

fn check_backward(name: &str, inp: &Inputs, sel_host: &Tensor, grad_host: &Tensor, got: &Grads) {
    let c = inp.c;
    let a = IndexerTopkScoresBwdArgs { fwd: inp.host_args(), topk_indices: sel_host.view(), grad: grad_host.view(), deterministic: true };
    let mut dq = Tensor::zeros(DType::F32, &[c.b, c.s, c.h, c.d]);
    let mut dw = Tensor::zeros(DType::F32, &[c.b, c.s, c.h]);
    let mut dkv = Tensor::zeros(DType::F32, &[c.b, c.p, c.d]);
    reference().indexer_topk_scores_bwd(&a, &mut dq.view_mut(), &mut dw.view_mut(), &mut dkv.view_mut()).unwrap();
    for (what, g, w, tol) in [("dq", &got.dq, &dq, Tolerance::Bf16), ("dweights", &got.dw, &dw, Tolerance::F32Grad), ("dpooled_kv", &got.dkv, &dkv, Tolerance::F32Grad)] {
        let j = judge(&format!("{name} {what}"), &f64s(g), &f64s(w), tol);
        assert!(j.pass, "{j}");
    }
}

fn bits(t: &Tensor) -> Vec<u64> {
    f64s(t).iter().map(|x| x.to_bits()).collect()
}

fn backward_case(c: Case, t: usize, seed: u64) {
    let inp = Inputs::new(c, seed);
    let sel = Tensor::from_i32(&[c.b, c.s, t], selection(c, t, seed + 1).iter().map(|&x| x as i32).collect()).unwrap();
    backward_of_selection(&inp, &sel, seed);
}

/// Backward of the scores of a given host selection `[B,S,T]` i32 (random gradients with
/// zeros): atomic and deterministic against the reference, deterministic bit-stable.
fn backward_of_selection(inp: &Inputs, sel: &Tensor, seed: u64) {
    let (c, t) = (inp.c, sel.shape()[2]);
    let mut rng = Rng(seed + 2);
    let grad = Tensor::from_f32(&[c.b, c.s, t], (0..c.b * c.s * t).map(|i| if i % 7 == 3 { 0.0 } else { rng.sym() }).collect()).unwrap();
    let (sel_d, grad_d) = (up(sel), up(&grad));
    let name = format!("backward {c:?} T={t}");
    let atomic = gpu_backward(inp, &sel_d, &grad_d, false);
    check_backward(&format!("{name} atomic"), inp, sel, &grad, &atomic);
    let first = gpu_backward(inp, &sel_d, &grad_d, true);
    check_backward(&format!("{name} deterministic"), inp, sel, &grad, &first);
    for run in 1..5 {
        let again = gpu_backward(inp, &sel_d, &grad_d, true);
        assert!(bits(&again.dkv) == bits(&first.dkv), "{name}: deterministic dpooled_kv differs at run {run}");
        assert!(bits(&again.dq) == bits(&first.dq) && bits(&again.dw) == bits(&first.dw), "{name}: dq/dw differ at run {run}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_backward_matches_reference_and_is_deterministic() {
    for (i, &c) in SMALL_CASES.iter().enumerate() {
        backward_case(c, 9 + i, 500 + i as u64);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn backward_multi_tile_and_multi_query_ctas() {
    // T = 130: three 64-slot tiles of the tensor-core backward, the last one partial.
    backward_case(case(1, 40, 64, 128, 300, 1, 0), 130, 600);
    // S = 600: deterministic CTAs walk several queries (about two CTAs per SM).
    backward_case(case(1, 600, 16, 64, 200, 2, 7), 70, 610);
}

/// DSV4-sized forward: scores within 1e-5 of the row scale, the GPU selection exactly the
/// reference selection of the GPU scores, fused == unfused, and a top-k of the reference.
fn large_forward(c: Case, k: usize, seed: u64) {
    let inp = Inputs::new(c, seed);
    let scores = gpu_scores(&inp.dev_args(), c);
    let want = ref_scores(&inp);
    check_scores(&format!("scores {c:?}"), &scores, &want, c.p);
    let unfused = gpu_topk(&scores.view(), k);
    assert_same_selection("topk of the GPU scores", &unfused, &ref_topk(&scores.to_host().unwrap(), k));
    let kk = k.min(c.p);
    let mut idx = alloc(DType::I32, &[c.b, c.s, kk]);
    let mut val = alloc(DType::F32, &[c.b, c.s, kk]);
    cuda().indexer_fused_topk(&inp.dev_args(), k, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
    let fused = (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap());
    assert_same_selection("fused == unfused", &fused, &unfused);
    assert_topk_of_reference("fused vs reference", &fused, &f64s(&want), c.p, kk);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn dsv4_forward_k_above_p() {
    large_forward(case(2, 1024, 64, 128, 256, 4, 0), 512, 11);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn dsv4_forward_top512() {
    large_forward(case(1, 4096, 64, 128, 1024, 4, 0), 512, 12);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn dsv4_forward_context_parallel_rank() {
    // The second half of a 8192-token sequence: query_start > 0, P not a tile multiple.
    large_forward(case(1, 1024, 64, 128, 2000, 4, 4096), 512, 13);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn dsv4_topk_scores_and_backward() {
    let c = case(1, 1024, 64, 128, 256, 4, 0);
    let inp = Inputs::new(c, 21);
    // The real selection: top-512 of the scores (k > P: every visible key, then -1).
    let mut idx = alloc(DType::I32, &[c.b, c.s, c.p]);
    let mut val = alloc(DType::F32, &[c.b, c.s, c.p]);
    cuda().indexer_fused_topk(&inp.dev_args(), 512, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
    let sel = idx.to_host().unwrap();
    let mut want = Tensor::zeros(DType::F32, &[c.b, c.s, c.p]);
    reference().indexer_topk_scores(&inp.host_args(), &sel.view(), &mut want.view_mut()).unwrap();
    let mut got = alloc(DType::F32, &[c.b, c.s, c.p]);
    cuda().indexer_topk_scores(&inp.dev_args(), &idx.view(), &mut got.view_mut()).unwrap();
    check_scores("topk_scores", &got, &want, c.p);
    backward_case(c, 512, 22);
    // The backward of the real selection: the early queries' trailing -1 slots make whole
    // 64-slot tiles (and warp slabs of the forward) that are skipped.
    backward_of_selection(&inp, &sel, 23);
}

// ---- the Hopper kernel (scores_sm90.cu) against the portable one (scores.cu) ----------

/// Both paths on the same device inputs. The two kernels sum the heads in different
/// orders, so their f32 scores differ in the last bits: dense scores must agree within
/// the scores tolerance with identical -inf positions; the fused selections must have the
/// same counts and -1 tails, and where an index differs, the two keys' (portable) scores
/// must be within the tolerance of each other (a near-tie resolved the other way), as must
/// the values. Each path's fused selection is also bitwise `topk` of its own dense scores.
fn hopper_vs_portable(c: Case, k: usize, seed: u64) {
    use dsv4_cuda::indexer::{fused_topk_with, scores_with, ScoresPath};
    let gpu = dsv4_cuda::gpu(0).unwrap();
    if gpu.props().arch != "sm_90a" {
        eprintln!("hopper_vs_portable: skipped, the device is {} (not sm_90a)", gpu.props().arch);
        return;
    }
    let inp = Inputs::new(c, seed);
    let a = inp.dev_args();
    let kk = k.min(c.p);
    let dense = |path| {
        let mut out = alloc(DType::F32, &[c.b, c.s, c.p]);
        scores_with(gpu, &a, &mut out.view_mut(), path).unwrap();
        out
    };
    let fused = |path| {
        let mut idx = alloc(DType::I32, &[c.b, c.s, kk]);
        let mut val = alloc(DType::F32, &[c.b, c.s, kk]);
        fused_topk_with(gpu, &a, k, &mut idx.view_mut(), &mut val.view_mut(), path).unwrap();
        (idx.to_i64_vec().unwrap(), val.to_f32_vec().unwrap())
    };
    let name = format!("hopper vs portable {c:?} k={k}");
    let (sh, sp) = (dense(ScoresPath::Hopper), dense(ScoresPath::Portable));
    let (fh, fp) = (fused(ScoresPath::Hopper), fused(ScoresPath::Portable));
    // Dense: close, and -inf exactly where the portable kernel (and SPEC) put it.
    check_scores(&format!("{name}: dense"), &sh, &sp, c.p);
    let (vh, vp) = (sh.to_f32_vec().unwrap(), sp.to_f32_vec().unwrap());
    for (i, (x, y)) in vh.iter().zip(&vp).enumerate() {
        assert_eq!(x.is_finite(), y.is_finite(), "{name}: dense element {i}: hopper {x}, portable {y}");
    }
    // Each path's fused top-k is its own dense scores' top-k, bit for bit.
    assert_same_selection(&format!("{name}: hopper fused == topk(hopper dense)"), &fh, &gpu_topk(&sh.view(), k));
    assert_same_selection(&format!("{name}: portable fused == topk(portable dense)"), &fp, &gpu_topk(&sp.view(), k));
    // Across the paths: equal up to near-ties.
    let mut identical_rows = 0;
    let rows = c.b * c.s;
    for r in 0..rows {
        let row = &vp[r * c.p..(r + 1) * c.p];
        let scale = row.iter().filter(|x| x.is_finite()).fold(0.0f32, |m, x| m.max(x.abs()));
        let tol = 2e-5 * scale;
        let (ih, ip) = (&fh.0[r * kk..(r + 1) * kk], &fp.0[r * kk..(r + 1) * kk]);
        let (xh, xp) = (&fh.1[r * kk..(r + 1) * kk], &fp.1[r * kk..(r + 1) * kk]);
        let nh = ih.iter().filter(|&&i| i >= 0).count();
        let np = ip.iter().filter(|&&i| i >= 0).count();
        assert_eq!(nh, np, "{name}: row {r}: {nh} keys selected by hopper, {np} by portable");
        for j in 0..kk {
            if j >= np {
                assert!(ih[j] == -1 && xh[j] == f32::NEG_INFINITY, "{name}: row {r} slot {j}: expected (-1, -inf), got ({}, {})", ih[j], xh[j]);
                continue;
            }
            assert!((xh[j] - xp[j]).abs() <= tol, "{name}: row {r} slot {j}: value {} (hopper) vs {} (portable), tolerance {tol}", xh[j], xp[j]);
            if ih[j] != ip[j] {
                let (a_, b_) = (row[ih[j] as usize], row[ip[j] as usize]);
                assert!((a_ - b_).abs() <= tol, "{name}: row {r} slot {j}: index {} (hopper) vs {} (portable), portable scores {a_} vs {b_}: not a near-tie", ih[j], ip[j]);
            }
        }
        identical_rows += (ih == ip) as usize;
    }
    println!("{name}: {identical_rows} of {rows} rows select identical indices");
    assert!(2 * identical_rows >= rows, "{name}: only {identical_rows} of {rows} rows identical");
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn hopper_scores_match_portable_small() {
    // Padded heads (17 -> 32) and head dim (40 -> one group of 64), r = 1 and 2, partial
    // query blocks, rows that see no key, k > P.
    hopper_vs_portable(case(1, 37, 17, 40, 29, 2, 5), 8, 700);
    hopper_vs_portable(case(2, 77, 16, 64, 70, 1, 3), 16, 701);
    hopper_vs_portable(case(2, 301, 32, 128, 300, 1, 0), 64, 702);
    hopper_vs_portable(case(1, 33, 64, 128, 37, 4, 100), 600, 703);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn hopper_scores_match_portable_dsv4() {
    // DSV4 shapes: H = 64, D = 128, r = 4, top-512. B = 2 with k > P; S = 4096; an odd S
    // with query_start > 0 and P not a multiple of the 64-key tile.
    hopper_vs_portable(case(2, 1024, 64, 128, 256, 4, 0), 512, 710);
    hopper_vs_portable(case(1, 4096, 64, 128, 1024, 4, 0), 512, 711);
    hopper_vs_portable(case(2, 1001, 64, 128, 900, 4, 2047), 512, 712);
}

// ---- the Hopper backward (bwd_sm90.cu) against the reference and bwd_mma.cu -------------

/// Whether the device runs the Hopper kernels (else the test says so and passes).
fn on_sm90(test: &str) -> bool {
    let arch = dsv4_cuda::gpu(0).unwrap().props().arch.clone();
    if arch != "sm_90a" {
        eprintln!("{test}: skipped, the device is {arch} (not sm_90a)");
    }
    arch == "sm_90a"
}

/// The atomic backward on device inputs by the kernel `path` picks.
fn gpu_backward_path(inp: &Inputs, sel: &Tensor, grad: &Tensor, path: dsv4_cuda::indexer::BwdPath) -> Grads {
    let c = inp.c;
    let gpu = dsv4_cuda::gpu(0).unwrap();
    let a = IndexerTopkScoresBwdArgs { fwd: inp.dev_args(), topk_indices: sel.view(), grad: grad.view(), deterministic: false };
    let mut g = Grads { dq: alloc(DType::BF16, &[c.b, c.s, c.h, c.d]), dw: alloc(DType::F32, &[c.b, c.s, c.h]), dkv: alloc(DType::F32, &[c.b, c.p, c.d]) };
    dsv4_cuda::indexer::topk_scores_backward_with(gpu, &a, &mut g.dq.view_mut(), &mut g.dw.view_mut(), &mut g.dkv.view_mut(), path).unwrap();
    g
}

/// Gradients for a host selection: random, a seventh of them 0, and NaN or inf at every
/// masked or invisible slot (the kernels must never read them: SPEC.md section 3 ignores
/// those entries).
fn poisoned_grad(c: Case, sel: &[i64], t: usize, seed: u64) -> Tensor {
    let mut rng = Rng(seed);
    let g = (0..c.b * c.s * t)
        .map(|i| {
            let s = (i / t) % c.s;
            let vis = ((c.query_start + s + 1) / c.r).min(c.p) as i64;
            let key = sel[i];
            if key < 0 || key >= vis {
                if i % 2 == 0 { f32::NAN } else { f32::INFINITY }
            } else if i % 7 == 3 {
                0.0
            } else {
                rng.sym()
            }
        })
        .collect();
    Tensor::from_f32(&[c.b, c.s, t], g).unwrap()
}

/// `bwd_sm90.cu` on a host selection `[B,S,T]`: against the reference (SPEC.md tolerances)
/// and against `bwd_mma.cu` on the same device inputs (the same bf16 G and products, summed
/// in another order: within the same tolerances of each other).
fn hopper_backward_of_selection(name: &str, inp: &Inputs, sel: &[i64], t: usize, seed: u64) {
    use dsv4_cuda::indexer::BwdPath;
    let c = inp.c;
    let sel_host = Tensor::from_i32(&[c.b, c.s, t], sel.iter().map(|&x| x as i32).collect()).unwrap();
    let grad = poisoned_grad(c, sel, t, seed);
    let (sel_d, grad_d) = (up(&sel_host), up(&grad));
    let name = format!("{name} {c:?} T={t}");
    let hopper = gpu_backward_path(inp, &sel_d, &grad_d, BwdPath::Hopper);
    check_backward(&format!("{name} hopper"), inp, &sel_host, &grad, &hopper);
    let portable = gpu_backward_path(inp, &sel_d, &grad_d, BwdPath::Portable);
    for (what, x, y, tol) in [("dq", &hopper.dq, &portable.dq, Tolerance::Bf16), ("dweights", &hopper.dw, &portable.dw, Tolerance::F32Grad), ("dpooled_kv", &hopper.dkv, &portable.dkv, Tolerance::F32Grad)] {
        let j = judge(&format!("{name} hopper vs bwd_mma {what}"), &f64s(x), &f64s(y), tol);
        assert!(j.pass, "{j}");
    }
    // The i64 index path reads the same slots.
    let sel64 = up(&Tensor::from_i64(&[c.b, c.s, t], sel.to_vec()).unwrap());
    let wide = gpu_backward_path(inp, &sel64, &grad_d, BwdPath::Hopper);
    assert!(bits(&wide.dq) == bits(&hopper.dq) && bits(&wide.dw) == bits(&hopper.dw), "{name}: i64 indices change dq / dw");
    check_backward(&format!("{name} hopper i64"), inp, &sel_host, &grad, &wide);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_backward_odd_shapes() {
    if !on_sm90("small_hopper_backward_odd_shapes") {
        return;
    }
    // (case, T): heads 1..64 (padded to the wgmma's 64), D = 8..128 (one or two SW128
    // groups, zero columns past D), r = 1..4, query_start > 0, B = 2, T from 1 (one partial
    // tile) to 130 (three, the last partial), rows that see no key, and many rows per CTA
    // (ring phases and q buffers carried across rows).
    let cases = [
        (case(2, 7, 3, 16, 5, 1, 0), 9),
        (case(1, 13, 17, 40, 9, 2, 3), 70),
        (case(1, 33, 64, 128, 37, 4, 100), 64),
        (case(2, 9, 16, 64, 70, 1, 61), 1),
        (case(1, 19, 1, 8, 130, 3, 0), 130),
        (case(2, 300, 33, 120, 150, 2, 5), 65),
        (case(1, 600, 64, 128, 200, 4, 7), 128),
        (case(2, 517, 49, 72, 301, 1, 0), 33),
    ];
    for (i, &(c, t)) in cases.iter().enumerate() {
        let inp = Inputs::new(c, 800 + i as u64);
        hopper_backward_of_selection("odd shapes", &inp, &selection(c, t, 810 + i as u64), t, 820 + i as u64);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn small_hopper_backward_masks_and_duplicates() {
    if !on_sm90("small_hopper_backward_masks_and_duplicates") {
        return;
    }
    let c = case(2, 150, 64, 128, 90, 1, 0);
    let t = 150;
    let inp = Inputs::new(c, 830);
    let mut rng = Rng(831);
    let sel: Vec<i64> = (0..c.b * c.s)
        .flat_map(|row| {
            let s = row % c.s;
            let vis = (s + 1).min(c.p) as u64;
            let key = rng.below(vis) as i64;
            let kind = row % 5;
            let mut r = Rng(900 + row as u64);
            (0..t)
                .map(move |j| match kind {
                    0 => -1,                                             // every slot masked: all tiles skipped
                    1 => key,                                            // one key in every slot
                    2 => if j < 64 { -1 } else { (j as i64) % 3 },       // a masked first tile, then 3 keys repeated
                    3 => if j % 2 == 0 { (c.p + j) as i64 } else { key }, // out of range, duplicates
                    _ => r.below(c.p as u64 + 4) as i64 - 2,             // random, some invisible or negative
                })
                .collect::<Vec<_>>()
        })
        .collect();
    hopper_backward_of_selection("masks and duplicates", &inp, &sel, t, 832);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh"]
fn hopper_backward_dsv4_shape() {
    if !on_sm90("hopper_backward_dsv4_shape") {
        return;
    }
    // H = 64, D = 128, r = 4, top-512: the real selection (every visible key for k > P,
    // then -1: whole skipped tiles) and a random one; B = 2 with query_start > 0 and P not a
    // multiple of the tile.
    let c = case(1, 1024, 64, 128, 256, 4, 0);
    let inp = Inputs::new(c, 840);
    let mut idx = alloc(DType::I32, &[c.b, c.s, c.p]);
    let mut val = alloc(DType::F32, &[c.b, c.s, c.p]);
    cuda().indexer_fused_topk(&inp.dev_args(), 512, &mut idx.view_mut(), &mut val.view_mut()).unwrap();
    hopper_backward_of_selection("dsv4 real selection", &inp, &idx.to_i64_vec().unwrap(), c.p, 841);
    hopper_backward_of_selection("dsv4 random selection", &inp, &selection(c, 512, 842), 512, 843);
    let c = case(2, 257, 64, 128, 900, 4, 2047);
    let inp = Inputs::new(c, 844);
    hopper_backward_of_selection("dsv4 context-parallel rank", &inp, &selection(c, 512, 845), 512, 846);
}
