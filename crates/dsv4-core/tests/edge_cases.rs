//! The edge cases the reference settles before any kernel (STYLE.md habit 3): empty and
//! fully masked rows, wild indices, extreme logits and sinks, strided inputs, short
//! indexer rows, causality offsets, bf16 against f32 inputs, and outputs written into
//! caller memory.

use dsv4_core::ops::indexer::{indexer_scores, indexer_scores_into, indexer_topk, indexer_topk_scores, indexer_topk_scores_backward, lightning_indexer, IndexerArgs, IndexerTopkScoresBwdArgs};
use dsv4_core::ops::qnorm_rope::{self, qnorm_rope, qnorm_rope_backward, qnorm_rope_backward_into, qnorm_rope_into, token_major_strides, QNormRopeArgs};
use dsv4_core::ops::sinkhorn::{sinkhorn_normalize, sinkhorn_normalize_backward, sinkhorn_normalize_backward_into, sinkhorn_normalize_into, SinkhornArgs};
use dsv4_core::ops::sparse_attention::{self as sa, dense_attention_topk, dense_attention_topk_into, sparse_attention, sparse_attention_backward, sparse_attention_backward_into, sparse_attention_into, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::{build_sparse_topk_indices, build_sparse_topk_indices_into, plan_sparse_indices, BuildIndicesArgs};
use dsv4_core::real::round_bf16;
use dsv4_core::tensor::contiguous_strides;
use dsv4_core::{BackendName, DType, Device, Error, Tensor, TensorView, TensorViewMut};
use half::bf16;

const REF: BackendName = BackendName::Reference;

use dsv4_core::rng::SplitMix64 as Rng;

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}
fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rel_fro(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

fn assert_close(name: &str, got: &[f32], want: &[f64], tol: f64) {
    assert!(got.iter().all(|v| v.is_finite()), "{name}: non-finite value in {got:?}");
    let e = rel_fro(got, want);
    assert!(e <= tol, "{name}: relative error {e:.3e} > {tol:e}");
}

fn idx_i32(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::from_i32(shape, v.iter().map(|&x| x as i32).collect()).unwrap()
}

/// Everything one sparse-attention call and its backward produce, as f32.
struct AttnRun {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dkv: Vec<f32>,
    dsinks: Vec<f32>,
}

fn run_attention(q: &Tensor, kv: &Tensor, sinks: &Tensor, idx: &Tensor, dout: &Tensor, scale: Option<f32>) -> AttnRun {
    let mut a = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
    if let Some(s) = scale {
        a.sm_scale = s;
    }
    let (out, lse) = sparse_attention(REF, &a).unwrap();
    let (dq, dkv, dsinks) = sparse_attention_backward(REF, &SparseAttentionBwdArgs::new(a, out.view(), lse.view(), dout.view())).unwrap();
    let r = AttnRun { out: f32s(&out), lse: f32s(&lse), dq: f32s(&dq), dkv: f32s(&dkv), dsinks: f32s(&dsinks) };
    for (n, v) in [("out", &r.out), ("lse", &r.lse), ("dq", &r.dq), ("dkv", &r.dkv), ("dsinks", &r.dsinks)] {
        assert!(v.iter().all(|x| !x.is_nan()), "{n}: NaN");
    }
    r
}

/// The f64 reference on the same inputs: `(out, lse, grads)`.
fn attention_f64(dm: sa::Dims, q: &[f32], kv: &[f32], sinks: &[f32], idx: &[i64], scale: f64, dout: &[f32]) -> (Vec<f64>, Vec<f64>, sa::reference::Grads<f64>) {
    let (q, kv, sinks, dout) = (f64s(q), f64s(kv), f64s(sinks), f64s(dout));
    let (out, lse) = sa::reference::forward::<f64>(dm, &q, &kv, &sinks, idx, dm.t, scale, false);
    let g = sa::reference::backward::<f64>(dm, &q, &kv, &sinks, idx, dm.t, scale, &out, &lse, &dout);
    (out, lse, g)
}

// ---------------------------------------------------------------- sparse attention

#[test]
fn single_query_matches_f64() {
    let dm = sa::Dims { b: 2, s: 1, h: 2, d: 8, k: 6, t: 4 };
    let mut rng = Rng(1);
    let q = rng.vec(16 * 2, -1.0, 1.0);
    let kv = rng.vec(2 * 6 * 8, -1.0, 1.0);
    let sinks = vec![0.3, -0.4];
    let idx = vec![0, 5, 2, -1, 3, 3, 1, 4];
    let dout = rng.vec(q.len(), -1.0, 1.0);
    let t = |s: &[usize], v: &[f32]| Tensor::from_f32(s, v.to_vec()).unwrap();
    let r = run_attention(&t(&[2, 1, 2, 8], &q), &t(&[2, 6, 8], &kv), &t(&[2], &sinks), &idx_i32(&[2, 1, 4], &idx), &t(&[2, 1, 2, 8], &dout), None);
    let (out, lse, g) = attention_f64(dm, &q, &kv, &sinks, &idx, 8f64.powf(-0.5), &dout);
    assert_close("out", &r.out, &out, 1e-6);
    assert_close("lse", &r.lse, &lse, 1e-6);
    assert_close("dq", &r.dq, &g.dq, 1e-5);
    assert_close("dkv", &r.dkv, &g.dkv, 1e-5);
    assert_close("dsinks", &r.dsinks, &g.dsinks, 1e-5);
}

/// Rows with no valid slot: out 0, lse = sink exactly, every gradient 0, no NaN.
fn check_empty_rows(idx: Tensor, t: usize) {
    let (b, s, h, d, k) = (2, 3, 2, 4, 3);
    let mut rng = Rng(2);
    let q = Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap();
    let kv = Tensor::from_f32(&[b, k, d], rng.vec(b * k * d, -1.0, 1.0)).unwrap();
    let sinks = Tensor::from_f32(&[h], vec![1.5, -30.0]).unwrap();
    let dout = Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap();
    let r = run_attention(&q, &kv, &sinks, &idx, &dout, None);
    assert!(r.out.iter().all(|&v| v == 0.0), "out {:?}", r.out);
    assert_eq!(bits(&r.lse), bits(&[1.5, -30.0].repeat(b * s)));
    for (n, v) in [("dq", &r.dq), ("dkv", &r.dkv), ("dsinks", &r.dsinks)] {
        assert!(v.iter().all(|&x| x == 0.0), "{n}: {v:?}");
    }
    let a = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
    assert!(f32s(&dense_attention_topk(REF, &a).unwrap()).iter().all(|&v| v == 0.0));
    // The plan of an all-empty selection: no valid row, every length 0.
    let plan = plan_sparse_indices(REF, &idx.view(), k, false).unwrap();
    assert_eq!(plan.valid_rows.as_ref().unwrap().numel(), 0);
    assert!(plan.topk_length.as_ref().unwrap().to_i64_vec().unwrap().iter().all(|&n| n == 0));
    assert_eq!(plan.indices.shape(), &[b * s, 1, t]);
    let a = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::Plan(&plan));
    let (out, lse) = sparse_attention(REF, &a).unwrap();
    assert!(f32s(&out).iter().all(|&v| v == 0.0));
    assert_eq!(bits(&f32s(&lse)), bits(&r.lse));
}

#[test]
fn zero_slots_per_query() {
    check_empty_rows(Tensor::from_i32(&[2, 3, 0], vec![]).unwrap(), 0);
}

#[test]
fn all_slots_masked() {
    let k = 3i64;
    let row = [-1, k, -5, k + 7];
    check_empty_rows(idx_i32(&[2, 3, 4], &row.repeat(6)), 4);
    let row64 = [-1, i64::MIN, k, i64::MAX];
    check_empty_rows(Tensor::from_i64(&[2, 3, 4], row64.repeat(6)).unwrap(), 4);
}

#[test]
fn all_slots_masked_bf16() {
    let (b, s, h, d) = (1, 2, 2, 4);
    let q = Tensor::from_f32_as_bf16(&[b, s, h, d], &[0.5; 16]).unwrap();
    let kv = Tensor::from_f32_as_bf16(&[b, 2, d], &[0.25; 8]).unwrap();
    let sinks = Tensor::from_f32(&[h], vec![30.0, -30.0]).unwrap();
    let idx = idx_i32(&[b, s, 3], &[-1, 2, 9, -1, -1, -1]);
    let dout = Tensor::from_f32_as_bf16(&[b, s, h, d], &[1.0; 16]).unwrap();
    let r = run_attention(&q, &kv, &sinks, &idx, &dout, None);
    assert!(r.out.iter().chain(&r.dq).chain(&r.dkv).chain(&r.dsinks).all(|&v| v == 0.0));
    assert_eq!(r.lse, vec![30.0, -30.0, 30.0, -30.0]);
}

/// A sink of -inf is a head without a sink: Z = sum of exp(l). An empty row then has Z = 0:
/// out 0, lse -inf, zero gradients (not 0 / 0); other rows and heads are as usual.
#[test]
fn sink_of_minus_infinity() {
    let (b, s, h, d, k) = (1, 3, 2, 4, 3);
    let mut rng = Rng(5);
    let q = Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap();
    let kv = Tensor::from_f32(&[b, k, d], rng.vec(b * k * d, -1.0, 1.0)).unwrap();
    let sinks = Tensor::from_f32(&[h], vec![f32::NEG_INFINITY, 0.5]).unwrap();
    let dout = Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap();
    // Row 0: keys 0, 1; row 1: empty; row 2: masked slots before key 2.
    let idx = idx_i32(&[b, s, 3], &[0, 1, -1, -1, -1, -1, -1, -1, 2]);
    let r = run_attention(&q, &kv, &sinks, &idx, &dout, None);
    for (n, v) in [("out", &r.out), ("dq", &r.dq), ("dkv", &r.dkv), ("dsinks", &r.dsinks)] {
        assert!(v.iter().all(|x| x.is_finite()), "{n}: {v:?}");
    }
    assert!(r.out[h * d..2 * h * d].iter().chain(&r.dq[h * d..2 * h * d]).all(|&v| v == 0.0), "the empty row");
    assert_eq!(r.lse[h], f32::NEG_INFINITY, "the empty row's lse for the head without a sink");
    assert_eq!(r.lse[h + 1], 0.5);
    assert_eq!(r.dsinks[0], 0.0, "a sink of -inf gets no gradient");
    // Row 2, head 0: the one key's softmax is 1, so out = kv[2].
    let kv2 = &f32s(&kv)[2 * d..3 * d];
    for (o, v) in r.out[2 * h * d..2 * h * d + d].iter().zip(kv2) {
        assert!((o - v).abs() < 1e-6, "{o} vs {v}");
    }
}

#[test]
fn out_of_range_and_negative_indices_are_masked_slots() {
    let (b, s, h, d, k) = (2, 2, 2, 4, 5);
    let mut rng = Rng(3);
    let q = Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap();
    let kv = Tensor::from_f32(&[b, k, d], rng.vec(b * k * d, -1.0, 1.0)).unwrap();
    let sinks = Tensor::from_f32(&[h], vec![0.1, -0.2]).unwrap();
    let dout = Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap();
    let wild: Vec<i64> = vec![2, -2, 4, 5, 0, i64::MAX, 1, i64::MIN, 3, 1000, -1, 4, 4, -100, 6, 0];
    let clean: Vec<i64> = wild.iter().map(|&x| if (0..k as i64).contains(&x) { x } else { -1 }).collect();
    let want = run_attention(&q, &kv, &sinks, &Tensor::from_i64(&[b, s, 4], clean.clone()).unwrap(), &dout, None);
    for idx in [Tensor::from_i64(&[b, s, 4], wild.clone()).unwrap(), idx_i32(&[b, s, 4], &wild.iter().map(|&x| x.clamp(i32::MIN as i64, i32::MAX as i64)).collect::<Vec<_>>())] {
        let got = run_attention(&q, &kv, &sinks, &idx, &dout, None);
        assert_eq!(bits(&got.out), bits(&want.out));
        assert_eq!(bits(&got.lse), bits(&want.lse));
        assert_eq!(bits(&got.dq), bits(&want.dq));
        assert_eq!(bits(&got.dkv), bits(&want.dkv));
        assert_eq!(bits(&got.dsinks), bits(&want.dsinks));
    }
    // The plan drops them too: lengths count the valid slots only.
    let plan = plan_sparse_indices(REF, &Tensor::from_i64(&[b, s, 4], wild).unwrap().view(), k, false).unwrap();
    let lengths = plan.topk_length.as_ref().unwrap().to_i64_vec().unwrap();
    let want_len: Vec<i64> = clean.chunks(4).map(|r| r.iter().filter(|&&x| x >= 0).count() as i64).collect();
    assert_eq!(lengths, want_len);
    let gi = plan.indices.to_i64_vec().unwrap();
    for (r, row) in gi.chunks(4).enumerate() {
        let bi = (r / s) as i64;
        let mut keys: Vec<i64> = clean[r * 4..(r + 1) * 4].iter().filter(|&&x| x >= 0).map(|&x| bi * k as i64 + x).collect();
        keys.sort_unstable();
        keys.resize(4, -1);
        assert_eq!(row, &keys[..], "plan row {r}");
    }
}

#[test]
fn large_logits_near_tie() {
    // |l| ~ 1e4 with gaps ~ 1: a proper softmax far from 0; the sink underflows.
    let (dm, scale) = (sa::Dims { b: 1, s: 2, h: 2, d: 4, k: 6, t: 6 }, 1.0f32);
    let mut rng = Rng(4);
    let mut q = vec![0.0f32; 16];
    for r in 0..4 {
        q[r * 4] = if r % 2 == 0 { 100.0 } else { -100.0 };
        q[r * 4 + 1] = rng.uniform(-1.0, 1.0);
    }
    let mut kv = rng.vec(6 * 4, -1.0, 1.0);
    for key in 0..6 {
        kv[key * 4] = 100.0 + rng.uniform(-0.01, 0.01);
    }
    let sinks = vec![0.0, 0.0];
    let idx: Vec<i64> = vec![0, 1, 2, 3, 4, 5, 5, 4, 3, -1, 1, 0];
    let dout = rng.vec(16, -1.0, 1.0);
    let t = |s: &[usize], v: &[f32]| Tensor::from_f32(s, v.to_vec()).unwrap();
    let r = run_attention(&t(&[1, 2, 2, 4], &q), &t(&[1, 6, 4], &kv), &t(&[2], &sinks), &idx_i32(&[1, 2, 6], &idx), &t(&[1, 2, 2, 4], &dout), Some(scale));
    let (out, lse, g) = attention_f64(dm, &q, &kv, &sinks, &idx, scale as f64, &dout);
    // Heads 0 (q ~ +100 * kv): lse ~ 1e4. Heads 1 (l ~ -1e4): the sink alone, lse = 0.
    assert!(lse.iter().step_by(2).all(|&l| l > 9e3) && lse.iter().skip(1).step_by(2).all(|&l| l.abs() < 1e-300), "{lse:?}");
    // f32 logits near 1e4 carry ~1e-3 absolute error: the floor of dq and dkv here.
    assert_close("out", &r.out, &out, 1e-5);
    assert_close("lse", &r.lse, &lse, 1e-6);
    assert_close("dq", &r.dq, &g.dq, 5e-3);
    assert_close("dkv", &r.dkv, &g.dkv, 5e-3);
    assert!(r.out.chunks(4).skip(1).step_by(2).flatten().all(|&v| v == 0.0));
}

#[test]
fn large_logits_spread() {
    // Logits spread over +-1e4: one key dominates each row; nothing overflows.
    let dm = sa::Dims { b: 1, s: 3, h: 2, d: 4, k: 5, t: 5 };
    let mut rng = Rng(5);
    let q = rng.vec(3 * 2 * 4, -100.0, 100.0);
    let kv = rng.vec(5 * 4, -100.0, 100.0);
    let sinks = vec![0.5, -0.5];
    let idx: Vec<i64> = vec![0, 1, 2, 3, 4, 4, 3, 2, -1, -1, 1, 1, 0, 9, -3];
    let dout = rng.vec(24, -1.0, 1.0);
    let t = |s: &[usize], v: &[f32]| Tensor::from_f32(s, v.to_vec()).unwrap();
    let r = run_attention(&t(&[1, 3, 2, 4], &q), &t(&[1, 5, 4], &kv), &t(&[2], &sinks), &idx_i32(&[1, 3, 5], &idx), &t(&[1, 3, 2, 4], &dout), Some(0.5));
    let (out, lse, g) = attention_f64(dm, &q, &kv, &sinks, &idx, 0.5, &dout);
    assert!(lse.iter().any(|l| l.abs() > 1e3), "the case must reach large logits: {lse:?}");
    assert_close("out", &r.out, &out, 1e-5);
    assert_close("lse", &r.lse, &lse, 1e-6);
    // Near one-hot rows: dl = p * (<dout, kv> - delta) cancels to ~0, so the gradients
    // are judged in absolute terms against their own scale (floored at 1).
    for (name, got, want) in [("dq", &r.dq, &g.dq), ("dkv", &r.dkv, &g.dkv), ("dsinks", &r.dsinks, &g.dsinks)] {
        assert!(got.iter().all(|v| v.is_finite()), "{name}");
        let worst = got.iter().zip(want.iter()).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
        let mag = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert!(worst <= 1e-4 * mag.max(1.0), "{name}: max abs error {worst:e} (scale {mag:e})");
    }
}

#[test]
fn all_logits_very_negative_leave_the_sink() {
    // Every l ~ -1e4 and the sink 0: out ~ 0 and lse ~ 0, finite, no NaN.
    let q = Tensor::from_f32(&[1, 1, 1, 2], vec![100.0, 0.0]).unwrap();
    let kv = Tensor::from_f32(&[1, 2, 2], vec![-100.0, 1.0, -99.0, 2.0]).unwrap();
    let sinks = Tensor::from_f32(&[1], vec![0.0]).unwrap();
    let dout = Tensor::from_f32(&[1, 1, 1, 2], vec![1.0, -1.0]).unwrap();
    let r = run_attention(&q, &kv, &sinks, &idx_i32(&[1, 1, 2], &[0, 1]), &dout, Some(1.0));
    assert_eq!(r.lse, vec![0.0]);
    assert!(r.out.iter().chain(&r.dq).chain(&r.dkv).chain(&r.dsinks).all(|v| v.is_finite() && v.abs() < 1e-30));
}

#[test]
fn sinks_of_plus_minus_30() {
    let dm = sa::Dims { b: 1, s: 3, h: 2, d: 8, k: 6, t: 4 };
    let mut rng = Rng(6);
    let q = rng.vec(3 * 2 * 8, -1.0, 1.0);
    let kv = rng.vec(6 * 8, -1.0, 1.0);
    let sinks = vec![30.0, -30.0];
    let idx: Vec<i64> = vec![0, 1, 2, 3, 5, 5, -1, 4, 2, 0, 1, 3];
    let dout = rng.vec(48, -1.0, 1.0);
    let t = |s: &[usize], v: &[f32]| Tensor::from_f32(s, v.to_vec()).unwrap();
    let r = run_attention(&t(&[1, 3, 2, 8], &q), &t(&[1, 6, 8], &kv), &t(&[2], &sinks), &idx_i32(&[1, 3, 4], &idx), &t(&[1, 3, 2, 8], &dout), None);
    let (out, lse, g) = attention_f64(dm, &q, &kv, &sinks, &idx, 8f64.powf(-0.5), &dout);
    // Judge each head on its own scale: head 0's output is ~e^-30 of head 1's.
    for h in 0..2 {
        let pick = |v: &[f32]| v.chunks(8).skip(h).step_by(2).flatten().copied().collect::<Vec<f32>>();
        let pick64 = |v: &[f64]| v.chunks(8).skip(h).step_by(2).flatten().copied().collect::<Vec<f64>>();
        assert_close(&format!("out head {h}"), &pick(&r.out), &pick64(&out), 1e-5);
        assert_close(&format!("dq head {h}"), &pick(&r.dq), &pick64(&g.dq), 1e-4);
    }
    assert_close("lse", &r.lse, &lse, 1e-6);
    assert!((r.lse[0] - 30.0).abs() < 1e-3 && r.lse[0] >= 30.0);
    assert_close("dsinks", &r.dsinks, &g.dsinks, 1e-4);
    assert_close("dkv", &r.dkv, &g.dkv, 1e-4);
    assert!(r.out[..8].iter().all(|v| v.abs() < 1e-11), "head 0 is all sink");
}

// ---------------------------------------------------------------- qnorm_rope

struct Rope {
    cos: Tensor,
    sin: Tensor,
}

fn rope(b: usize, s: usize, r: usize, rng: &mut Rng) -> Rope {
    let th: Vec<f32> = rng.vec(b * s * r, -3.0, 3.0);
    Rope { cos: Tensor::from_f32(&[b, s, r], th.iter().map(|t| t.cos()).collect()).unwrap(), sin: Tensor::from_f32(&[b, s, r], th.iter().map(|t| t.sin()).collect()).unwrap() }
}

fn qnorm_all(x: TensorView, rp: &Rope, grad: TensorView, r: usize) -> [Vec<f32>; 3] {
    let a = QNormRopeArgs { x, cos: rp.cos.view(), sin: rp.sin.view(), rotary: r, eps: 1e-6 };
    let (out, rstd) = qnorm_rope(REF, &a).unwrap();
    let dx = qnorm_rope_backward(REF, &a, &rstd.view(), &grad).unwrap();
    [f32s(&out), f32s(&rstd), f32s(&dx)]
}

#[test]
fn qnorm_rope_noncontiguous_inputs_equal_contiguous() {
    let (b, h, s, c, r) = (2, 3, 4, 10, 6);
    let mut rng = Rng(7);
    let rp = rope(b, s, r, &mut rng);
    // Token-major [B,S,H,C] storage, viewed as logical [B,H,S,C].
    let tm: Vec<f32> = rng.vec_bf16(b * s * h * c, -2.0, 2.0);
    let x_tm = Tensor::from_f32_as_bf16(&[b, s, h, c], &tm).unwrap();
    let x_view = x_tm.view().transpose(1, 2);
    assert!(!x_view.is_contiguous());
    let logical = x_view.to_f32_vec().unwrap();
    let x_contig = Tensor::from_f32_as_bf16(&[b, h, s, c], &logical).unwrap();
    let g = rng.vec_bf16(b * h * s * c, -1.0, 1.0);
    let g_contig = Tensor::from_f32_as_bf16(&[b, h, s, c], &g).unwrap();
    let want = qnorm_all(x_contig.view(), &rp, g_contig.view(), r);

    let got = qnorm_all(x_view.clone(), &rp, g_contig.view(), r);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(bits(w), bits(g), "transposed view");
    }

    // An odd strided slice: every other head of a padded buffer [B,S,2H+1,C+3], from
    // element offset (C+3)+1; the gradient is a reversed-sequence view.
    let (hp, cp) = (2 * h + 1, c + 3);
    let mut buf = vec![bf16::from_f32(f32::NAN); b * s * hp * cp];
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                for ci in 0..c {
                    buf[((bi * s + si) * hp + 2 * hi + 1) * cp + 1 + ci] = bf16::from_f32(logical[((bi * h + hi) * s + si) * c + ci]);
                }
            }
        }
    }
    let strides = [(s * hp * cp) as isize, (2 * cp) as isize, (hp * cp) as isize, 1];
    // SAFETY: every element the shape and strides reach lies inside `buf`, which outlives
    // the view and is not written meanwhile.
    let x_odd = unsafe { TensorView::from_raw(buf.as_ptr().add(cp + 1) as *const u8, DType::BF16, &[b, h, s, c], &strides, Device::Cpu) };
    assert_eq!(x_odd.to_f32_vec().unwrap(), logical);
    let mut grev = vec![bf16::ZERO; g.len()];
    for row in 0..b * h {
        for si in 0..s {
            for ci in 0..c {
                grev[(row * s + (s - 1 - si)) * c + ci] = bf16::from_f32(g[(row * s + si) * c + ci]);
            }
        }
    }
    let gstr = [(h * s * c) as isize, (s * c) as isize, -(c as isize), 1];
    // SAFETY: element 0 of the view is the last sequence row of each [S,C] block; the
    // negative sequence stride stays inside `grev`.
    let g_rev = unsafe { TensorView::from_raw(grev.as_ptr().add((s - 1) * c) as *const u8, DType::BF16, &[b, h, s, c], &gstr, Device::Cpu) };
    assert_eq!(g_rev.to_f32_vec().unwrap(), g);
    let got = qnorm_all(x_odd, &rp, g_rev, r);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(bits(w), bits(g), "odd strided slice");
    }
}

// ---------------------------------------------------------------- indexer

fn indexer_inputs(b: usize, s: usize, h: usize, d: usize, p: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng(seed);
    (
        Tensor::from_f32(&[b, s, h, d], rng.vec(b * s * h * d, -1.0, 1.0)).unwrap(),
        Tensor::from_f32(&[b, p, d], rng.vec(b * p * d, -1.0, 1.0)).unwrap(),
        Tensor::from_f32(&[b, s, h], rng.vec(b * s * h, 0.1, 1.0)).unwrap(),
    )
}

#[test]
fn indexer_rows_with_fewer_finite_scores_than_k() {
    let (b, s, h, d, p, r, k) = (2, 6, 2, 4, 4, 2, 3);
    let (q, kv, w) = indexer_inputs(b, s, h, d, p, 8);
    let a = IndexerArgs::new(q.view(), kv.view(), w.view(), 0.5, r);
    let scores = indexer_scores(REF, &a).unwrap();
    let sv = f32s(&scores);
    for (path, (idx, val)) in [("indexer_topk", indexer_topk(REF, &scores.view(), k).unwrap()), ("lightning_indexer", lightning_indexer(REF, &a, k).unwrap())] {
        assert_eq!(idx.dtype(), DType::I32);
        assert_eq!(idx.shape(), &[b, s, k]);
        let (iv, vv) = (idx.to_i64_vec().unwrap(), f32s(&val));
        for row in 0..b * s {
            let visible = (row % s + 1) / r; // query_start 0
            let n = visible.min(k);
            let ri = &iv[row * k..(row + 1) * k];
            let rv = &vv[row * k..(row + 1) * k];
            assert!(ri[..n].iter().all(|&x| x >= 0 && (x as usize) < visible), "{path} row {row}: {ri:?}");
            assert!(ri[n..].iter().all(|&x| x == -1), "{path} row {row}: {ri:?}");
            assert!(rv[n..].iter().all(|&v| v == f32::NEG_INFINITY), "{path} row {row}: {rv:?}");
            assert!(rv[..n].windows(2).all(|w| w[0] >= w[1]), "{path} row {row}: not descending {rv:?}");
            for (&i, &v) in ri[..n].iter().zip(&rv[..n]) {
                assert_eq!(v.to_bits(), sv[row * p + i as usize].to_bits());
            }
        }
    }
}

#[test]
fn indexer_topk_ties_nan_and_infinities() {
    let sc = [3.0, f32::NAN, 3.0, f32::INFINITY, 5.0, f32::NEG_INFINITY, 1.0];
    let scores = Tensor::from_f32(&[1, 1, 7], sc.to_vec()).unwrap();
    let (idx, val) = indexer_topk(REF, &scores.view(), 6).unwrap();
    // Finite scores only, descending, ties to the lower index.
    assert_eq!(idx.to_i64_vec().unwrap(), vec![4, 0, 2, 6, -1, -1]);
    assert_eq!(f32s(&val), vec![5.0, 3.0, 3.0, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
}

#[test]
fn indexer_k_greater_than_p() {
    let (b, s, h, d, p) = (1, 8, 2, 4, 3);
    let (q, kv, w) = indexer_inputs(b, s, h, d, p, 9);
    let a = IndexerArgs::new(q.view(), kv.view(), w.view(), 1.0, 1);
    let (idx, val) = lightning_indexer(REF, &a, 10).unwrap();
    assert_eq!(idx.shape(), &[b, s, p]);
    assert_eq!(val.shape(), &[b, s, p]);
    let scores = indexer_scores(REF, &a).unwrap();
    let (idx2, _) = indexer_topk(REF, &scores.view(), 10).unwrap();
    assert_eq!(idx.to_i64_vec().unwrap(), idx2.to_i64_vec().unwrap());
    // The last row sees every key: a permutation of 0..P.
    let mut last = idx.to_i64_vec().unwrap()[(s - 1) * p..].to_vec();
    last.sort_unstable();
    assert_eq!(last, vec![0, 1, 2]);
}

#[test]
fn indexer_query_start_causality() {
    let (b, s, h, d, p, r, qs) = (2, 5, 2, 4, 6, 3, 5);
    let (q, kv, w) = indexer_inputs(b, s, h, d, p, 10);
    let mut a = IndexerArgs::new(q.view(), kv.view(), w.view(), 0.25, r);
    a.query_start = qs;
    a.query_total_len = Some(qs + s + 2);
    let sv = f32s(&indexer_scores(REF, &a).unwrap());
    let mut a0 = a.clone();
    a0.query_start = 0;
    a0.query_total_len = None;
    let sv0 = f32s(&indexer_scores(REF, &a0).unwrap());
    for row in 0..b * s {
        let visible = (qs + row % s + 1) / r;
        for pi in 0..p {
            let v = sv[row * p + pi];
            if pi < visible {
                assert!(v.is_finite(), "row {row} key {pi}");
                // Same score as without the offset where both see the key.
                if pi < (row % s + 1) / r {
                    assert_eq!(v.to_bits(), sv0[row * p + pi].to_bits());
                }
            } else {
                assert_eq!(v, f32::NEG_INFINITY, "row {row} key {pi} must be masked (visible {visible})");
            }
        }
    }
    // The selection's scores: -inf exactly where not visible; its backward ignores those.
    let t = 4;
    let sel: Vec<i64> = (0..b * s).flat_map(|row| [0, (row % p) as i64, 5, -1]).collect();
    let sel_t = Tensor::from_i64(&[b, s, t], sel.clone()).unwrap();
    let ts = f32s(&indexer_topk_scores(REF, &a, &sel_t.view()).unwrap());
    for row in 0..b * s {
        let visible = (qs + row % s + 1) / r;
        for j in 0..t {
            let i = sel[row * t + j];
            let v = ts[row * t + j];
            if i >= 0 && (i as usize) < visible {
                assert_eq!(v.to_bits(), sv[row * p + i as usize].to_bits());
            } else {
                assert_eq!(v, f32::NEG_INFINITY);
            }
        }
    }
    let g = Tensor::from_f32(&[b, s, t], ts.iter().map(|v| if v.is_finite() { 0.0 } else { 1e30 }).collect()).unwrap();
    let bw = IndexerTopkScoresBwdArgs { fwd: a, topk_indices: sel_t.view(), grad: g.view(), deterministic: true };
    let (dq, dw, dkv) = indexer_topk_scores_backward(REF, &bw).unwrap();
    for v in [dq, dw, dkv] {
        assert!(f32s(&v).iter().all(|&x| x == 0.0), "gradient at -inf scores must be ignored");
    }
}

// ---------------------------------------------------------------- sinkhorn

#[test]
fn sinkhorn_noncontiguous_x_and_dout() {
    let (m, n) = (3, 4);
    let mut rng = Rng(11);
    let xs = rng.vec(m * n * n, -2.0, 2.0);
    let gs = rng.vec(m * n * n, -1.0, 1.0);
    let x = Tensor::from_f32(&[m, n, n], xs).unwrap();
    let g = Tensor::from_f32(&[n, n, m], gs).unwrap();
    let (xt, gt) = (x.view().transpose(1, 2), g.view().transpose(0, 2));
    assert!(!xt.is_contiguous() && !gt.is_contiguous());
    let x_c = xt.to_tensor().unwrap();
    let g_c = Tensor::from_f32(&[m, n, n], gt.to_f32_vec().unwrap()).unwrap();
    for repeat in [1, 20] {
        let a = SinkhornArgs { x: xt.clone(), repeat, eps: 1e-6 };
        let ac = SinkhornArgs { x: x_c.view(), repeat, eps: 1e-6 };
        assert_eq!(bits(&f32s(&sinkhorn_normalize(REF, &a).unwrap())), bits(&f32s(&sinkhorn_normalize(REF, &ac).unwrap())));
        let want = f32s(&sinkhorn_normalize_backward(REF, &ac, &g_c.view()).unwrap());
        assert_eq!(bits(&f32s(&sinkhorn_normalize_backward(REF, &a, &gt).unwrap())), bits(&want));
        assert_eq!(bits(&f32s(&sinkhorn_normalize_backward(REF, &ac, &gt).unwrap())), bits(&want));
    }
}

#[test]
fn sinkhorn_output_is_doubly_stochastic() {
    let x = Tensor::from_f32(&[2, 3, 4, 4], Rng(12).vec(96, -3.0, 3.0)).unwrap();
    let y = f32s(&sinkhorn_normalize(REF, &SinkhornArgs { x: x.view(), repeat: 20, eps: 1e-6 }).unwrap());
    for mtx in y.chunks(16) {
        for i in 0..4 {
            let row: f32 = mtx[i * 4..(i + 1) * 4].iter().sum();
            let col: f32 = (0..4).map(|j| mtx[j * 4 + i]).sum();
            assert!((row - 1.0).abs() < 1e-4 && (col - 1.0).abs() < 1e-4, "{row} {col}");
        }
    }
}

// ---------------------------------------------------------------- bf16 vs f32

#[test]
fn bf16_inputs_round_only_the_outputs() {
    // bf16-representable values: the reference computes the same f32 arithmetic, and a
    // bf16 output is exactly the f32 result rounded once.
    let (b, s, h, d, k, t) = (2, 3, 2, 8, 5, 4);
    let mut rng = Rng(13);
    let (q, kv, dout) = (rng.vec_bf16(b * s * h * d, -1.0, 1.0), rng.vec_bf16(b * k * d, -1.0, 1.0), rng.vec_bf16(b * s * h * d, -1.0, 1.0));
    let sinks = Tensor::from_f32(&[h], vec![0.2, -0.7]).unwrap();
    let idx = idx_i32(&[b, s, t], &[0, 1, 1, 4, 2, -1, 3, 0, 4, 4, 4, 4, -1, -1, -1, -1, 1, 2, 3, 0, 0, 9, 2, 3]);
    let mk = |dt: DType, shape: &[usize], v: &[f32]| if dt == DType::BF16 { Tensor::from_f32_as_bf16(shape, v).unwrap() } else { Tensor::from_f32(shape, v.to_vec()).unwrap() };
    let f = |dt: DType| {
        let (qt, kvt) = (mk(dt, &[b, s, h, d], &q), mk(dt, &[b, k, d], &kv));
        let a = SparseAttentionArgs::new(qt.view(), kvt.view(), sinks.view(), SparseIndices::TopK(idx.view()));
        let (out, lse) = sparse_attention(REF, &a).unwrap();
        assert_eq!(out.dtype(), dt);
        // Both backwards get the same (bf16-rounded) saved output and dout.
        let out_r: Vec<f32> = f32s(&out).into_iter().map(round_bf16).collect();
        let (ot, dt_) = (mk(dt, &[b, s, h, d], &out_r), mk(dt, &[b, s, h, d], &dout));
        let (dq, dkv, ds) = sparse_attention_backward(REF, &SparseAttentionBwdArgs::new(a, ot.view(), lse.view(), dt_.view())).unwrap();
        assert_eq!((dq.dtype(), dkv.dtype(), ds.dtype()), (dt, dt, DType::F32));
        [f32s(&out), f32s(&lse), f32s(&dq), f32s(&dkv), f32s(&ds)]
    };
    let (h16, h32) = (f(DType::BF16), f(DType::F32));
    for (i, name) in ["out", "lse", "dq", "dkv", "dsinks"].iter().enumerate() {
        let want: Vec<f32> = if [0, 2, 3].contains(&i) { h32[i].iter().map(|&v| round_bf16(v)).collect() } else { h32[i].clone() };
        assert_eq!(bits(&h16[i]), bits(&want), "sparse_attention {name}");
    }

    // Indexer: f32 scores identical; dq rounded once; dweights, dpooled_kv f32.
    let (p, hh) = (4, 2);
    let (iq, ikv) = (rng.vec_bf16(b * s * hh * d, -1.0, 1.0), rng.vec_bf16(b * p * d, -1.0, 1.0));
    let w = Tensor::from_f32(&[b, s, hh], rng.vec(b * s * hh, -1.0, 1.0)).unwrap();
    let sel = idx_i32(&[b, s, 2], &[0, 1, 1, 2, 3, 0, 2, 2, 0, -1, 1, 3]);
    let g = Tensor::from_f32(&[b, s, 2], rng.vec(b * s * 2, -1.0, 1.0)).unwrap();
    let f = |dt: DType| {
        let (qt, kvt) = (mk(dt, &[b, s, hh, d], &iq), mk(dt, &[b, p, d], &ikv));
        let a = IndexerArgs::new(qt.view(), kvt.view(), w.view(), 0.3, 1);
        let sc = indexer_scores(REF, &a).unwrap();
        let ts = indexer_topk_scores(REF, &a, &sel.view()).unwrap();
        let (dq, dw, dkv) = indexer_topk_scores_backward(REF, &IndexerTopkScoresBwdArgs { fwd: a, topk_indices: sel.view(), grad: g.view(), deterministic: false }).unwrap();
        assert_eq!((sc.dtype(), dq.dtype(), dw.dtype(), dkv.dtype()), (DType::F32, dt, DType::F32, DType::F32));
        [f32s(&sc), f32s(&ts), f32s(&dq), f32s(&dw), f32s(&dkv)]
    };
    let (h16, h32) = (f(DType::BF16), f(DType::F32));
    for (i, name) in ["scores", "topk_scores", "dq", "dweights", "dpooled_kv"].iter().enumerate() {
        let want: Vec<f32> = if i == 2 { h32[i].iter().map(|&v| round_bf16(v)).collect() } else { h32[i].clone() };
        assert_eq!(bits(&h16[i]), bits(&want), "indexer {name}");
    }
}

#[test]
fn qnorm_rope_bf16_has_its_rounding_boundaries_f32_none() {
    let (b, h, s, c, r) = (1, 2, 3, 8, 4);
    let mut rng = Rng(14);
    let rp = rope(b, s, r, &mut rng);
    let x = rng.vec_bf16(b * h * s * c, -2.0, 2.0);
    let g = rng.vec_bf16(b * h * s * c, -1.0, 1.0);
    let dm = qnorm_rope::Dims { b, h, s, c, r };
    let (cos, sin) = (f32s(&rp.cos), f32s(&rp.sin));
    for (dt, round) in [(DType::BF16, true), (DType::F32, false)] {
        let mk = |v: &[f32]| if round { Tensor::from_f32_as_bf16(&[b, h, s, c], v).unwrap() } else { Tensor::from_f32(&[b, h, s, c], v.to_vec()).unwrap() };
        let (xt, gt) = (mk(&x), mk(&g));
        let [out, rstd, dx] = qnorm_all(xt.view(), &rp, gt.view(), r);
        let (wo, wr) = qnorm_rope::reference::forward::<f32>(dm, &x, &cos, &sin, 1e-6, round);
        let wd = qnorm_rope::reference::backward::<f32>(dm, &x, &cos, &sin, &wr, &g, round);
        let rd = |v: Vec<f32>| if round { v.into_iter().map(round_bf16).collect() } else { v };
        assert_eq!(bits(&out), bits(&rd(wo)), "{dt} out");
        assert_eq!(bits(&rstd), bits(&wr), "{dt} rstd");
        assert_eq!(bits(&dx), bits(&rd(wd)), "{dt} dx");
    }
}

// ---------------------------------------------------------------- outputs in caller memory

/// A caller's f32 buffer with `pad` NaN sentinels either side of `n` poisoned elements.
struct Poisoned {
    buf: Vec<f32>,
    pad: usize,
    n: usize,
}

impl Poisoned {
    fn new(n: usize) -> Self {
        Poisoned { buf: vec![f32::NAN; n + 6], pad: 3, n }
    }
    fn view(&mut self, dtype: DType, shape: &[usize]) -> TensorViewMut<'_> {
        assert_eq!(dtype, DType::F32);
        // SAFETY: `shape` is contiguous with `n` elements starting `pad` into `buf`.
        unsafe { TensorViewMut::from_raw(self.buf.as_mut_ptr().add(self.pad) as *mut u8, dtype, shape, &contiguous_strides(shape), Device::Cpu) }
    }
    fn body(&self) -> &[f32] {
        &self.buf[self.pad..self.pad + self.n]
    }
    fn sentinels_intact(&self) -> bool {
        self.buf[..self.pad].iter().chain(&self.buf[self.pad + self.n..]).all(|v| v.is_nan())
    }
}

fn layout_err(e: Error, arg: &str) {
    assert!(matches!(e, Error::Layout { .. }), "{e}");
    assert!(e.to_string().contains(&format!("`{arg}`")), "{e}");
}

#[test]
fn into_functions_fill_caller_memory() {
    let (b, s, h, d, k, t) = (1, 3, 2, 4, 5, 3);
    let mut rng = Rng(15);
    let q = Tensor::from_f32(&[b, s, h, d], rng.vec(24, -1.0, 1.0)).unwrap();
    let kv = Tensor::from_f32(&[b, k, d], rng.vec(20, -1.0, 1.0)).unwrap();
    let sinks = Tensor::from_f32(&[h], vec![0.0, 0.5]).unwrap();
    let idx = idx_i32(&[b, s, t], &[0, 1, 4, -1, -1, -1, 2, 2, 3]);
    let dout = Tensor::from_f32(&[b, s, h, d], rng.vec(24, -1.0, 1.0)).unwrap();
    let a = SparseAttentionArgs::new(q.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx.view()));
    let (out, lse) = sparse_attention(REF, &a).unwrap();

    let (mut po, mut pl) = (Poisoned::new(24), Poisoned::new(6));
    sparse_attention_into(REF, &a, &mut po.view(DType::F32, &[b, s, h, d]), &mut pl.view(DType::F32, &[b, s, h])).unwrap();
    assert_eq!(bits(po.body()), bits(&f32s(&out)));
    assert_eq!(bits(pl.body()), bits(&f32s(&lse)));
    assert!(po.sentinels_intact() && pl.sentinels_intact());

    let mut pd = Poisoned::new(24);
    dense_attention_topk_into(REF, &a, &mut pd.view(DType::F32, &[b, s, h, d])).unwrap();
    assert_eq!(bits(pd.body()), bits(&f32s(&dense_attention_topk(REF, &a).unwrap())));

    let bw = SparseAttentionBwdArgs::new(a.clone(), out.view(), lse.view(), dout.view());
    let (dq, dkv, ds) = sparse_attention_backward(REF, &bw).unwrap();
    let (mut p1, mut p2, mut p3) = (Poisoned::new(24), Poisoned::new(20), Poisoned::new(2));
    sparse_attention_backward_into(REF, &bw, &mut p1.view(DType::F32, &[b, s, h, d]), &mut p2.view(DType::F32, &[b, k, d]), &mut p3.view(DType::F32, &[h])).unwrap();
    assert_eq!(bits(p1.body()), bits(&f32s(&dq)));
    assert_eq!(bits(p2.body()), bits(&f32s(&dkv)));
    assert_eq!(bits(p3.body()), bits(&f32s(&ds)));
    assert!(p1.sentinels_intact() && p2.sentinels_intact() && p3.sentinels_intact());

    // A transposed output view is rejected, and nothing is written.
    let mut tr = Tensor::zeros(DType::F32, &[b, s, d, h]);
    let addr = tr.view_mut().address() as usize as *mut u8;
    // SAFETY: the strides permute the dimensions of `tr`, whose elements they all reach.
    let mut trv = unsafe { TensorViewMut::from_raw(addr, DType::F32, &[b, s, h, d], &[24, 8, 1, 2], Device::Cpu) };
    let mut pl = Poisoned::new(6);
    layout_err(sparse_attention_into(REF, &a, &mut trv, &mut pl.view(DType::F32, &[b, s, h])).unwrap_err(), "out");
    assert!(pl.body().iter().all(|v| v.is_nan()));
    layout_err(dense_attention_topk_into(REF, &a, &mut trv).unwrap_err(), "out");
    let (mut p2, mut p3) = (Poisoned::new(20), Poisoned::new(2));
    let e = sparse_attention_backward_into(REF, &bw, &mut trv, &mut p2.view(DType::F32, &[b, k, d]), &mut p3.view(DType::F32, &[h]));
    layout_err(e.unwrap_err(), "dq");

    // Indexer scores, sinkhorn, the index builder.
    let (iq, ikv, iw) = indexer_inputs(1, 4, 2, 4, 3, 16);
    let ia = IndexerArgs::new(iq.view(), ikv.view(), iw.view(), 1.0, 1);
    let mut ps = Poisoned::new(12);
    indexer_scores_into(REF, &ia, &mut ps.view(DType::F32, &[1, 4, 3])).unwrap();
    assert_eq!(bits(ps.body()), bits(&f32s(&indexer_scores(REF, &ia).unwrap())));
    assert!(ps.sentinels_intact());

    let x = Tensor::from_f32(&[2, 3, 3], rng.vec(18, -1.0, 1.0)).unwrap();
    let g = Tensor::from_f32(&[2, 3, 3], rng.vec(18, -1.0, 1.0)).unwrap();
    let sa_ = SinkhornArgs { x: x.view(), repeat: 3, eps: 1e-6 };
    let mut py = Poisoned::new(18);
    sinkhorn_normalize_into(REF, &sa_, &mut py.view(DType::F32, &[2, 3, 3])).unwrap();
    assert_eq!(bits(py.body()), bits(&f32s(&sinkhorn_normalize(REF, &sa_).unwrap())));
    let mut pg = Poisoned::new(18);
    sinkhorn_normalize_backward_into(REF, &sa_, &g.view(), &mut pg.view(DType::F32, &[2, 3, 3])).unwrap();
    assert_eq!(bits(pg.body()), bits(&f32s(&sinkhorn_normalize_backward(REF, &sa_, &g.view()).unwrap())));
    let mut tr = Tensor::zeros(DType::F32, &[2, 3, 3]);
    let addr = tr.view_mut().address() as usize as *mut u8;
    // SAFETY: the strides permute the dimensions of `tr`, whose elements they all reach.
    let mut trv = unsafe { TensorViewMut::from_raw(addr, DType::F32, &[2, 3, 3], &[9, 1, 3], Device::Cpu) };
    layout_err(sinkhorn_normalize_into(REF, &sa_, &mut trv).unwrap_err(), "out");
    layout_err(sinkhorn_normalize_backward_into(REF, &sa_, &g.view(), &mut trv).unwrap_err(), "dx");

    let ba = BuildIndicesArgs::new(2, 3, 3, 2);
    let want = build_sparse_topk_indices(REF, &ba).unwrap();
    let mut buf = vec![i32::MIN; 2 * 3 * 2 + 2];
    // SAFETY: 12 contiguous i32 starting at element 1 of a 14-element buffer.
    let mut ov = unsafe { TensorViewMut::from_raw(buf.as_mut_ptr().add(1) as *mut u8, DType::I32, &[2, 3, 2], &[6, 2, 1], Device::Cpu) };
    build_sparse_topk_indices_into(REF, &ba, &mut ov).unwrap();
    assert_eq!(buf[1..13].iter().map(|&x| x as i64).collect::<Vec<_>>(), want.to_i64_vec().unwrap());
    assert_eq!((buf[0], buf[13]), (i32::MIN, i32::MIN));
    let mut ov = unsafe { TensorViewMut::from_raw(buf.as_mut_ptr() as *mut u8, DType::I32, &[2, 3, 2], &[6, 1, 3], Device::Cpu) };
    layout_err(build_sparse_topk_indices_into(REF, &ba, &mut ov).unwrap_err(), "out");
}

#[test]
fn qnorm_rope_into_writes_token_major_storage() {
    let (b, h, s, c, r) = (2, 3, 2, 6, 4);
    let mut rng = Rng(17);
    let rp = rope(b, s, r, &mut rng);
    let x = Tensor::from_f32_as_bf16(&[b, h, s, c], &rng.vec(b * h * s * c, -2.0, 2.0)).unwrap();
    let g = Tensor::from_f32_as_bf16(&[b, h, s, c], &rng.vec(b * h * s * c, -1.0, 1.0)).unwrap();
    let a = QNormRopeArgs { x: x.view(), cos: rp.cos.view(), sin: rp.sin.view(), rotary: r, eps: 1e-6 };
    let (out, rstd) = qnorm_rope(REF, &a).unwrap();
    assert_eq!(out.strides(), &token_major_strides([b, h, s, c]));
    let dx = qnorm_rope_backward(REF, &a, &rstd.view(), &g.view()).unwrap();
    let (lo, ldx) = (f32s(&out), f32s(&dx));

    let n = b * h * s * c;
    let strides = token_major_strides([b, h, s, c]);
    let mut mem = vec![bf16::from_f32(f32::NAN); n];
    let mut rmem = Poisoned::new(b * s * h);
    // SAFETY: token-major strides address exactly the n elements of `mem`.
    let mut ov = unsafe { TensorViewMut::from_raw(mem.as_mut_ptr() as *mut u8, DType::BF16, &[b, h, s, c], &strides, Device::Cpu) };
    qnorm_rope_into(REF, &a, &mut ov, &mut rmem.view(DType::F32, &[b * s * h])).unwrap();
    // Memory is [B,S,H,C]: mem[((b*S + s)*H + h)*C + c] = out[b,h,s,c].
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                for ci in 0..c {
                    let got = mem[((bi * s + si) * h + hi) * c + ci].to_f32();
                    assert_eq!(got.to_bits(), lo[((bi * h + hi) * s + si) * c + ci].to_bits());
                }
            }
        }
    }
    assert_eq!(bits(rmem.body()), bits(&f32s(&rstd)));
    assert!(rmem.sentinels_intact());

    let mut dmem = vec![bf16::from_f32(f32::NAN); n];
    let mut dv = unsafe { TensorViewMut::from_raw(dmem.as_mut_ptr() as *mut u8, DType::BF16, &[b, h, s, c], &strides, Device::Cpu) };
    qnorm_rope_backward_into(REF, &a, &rstd.view(), &g.view(), &mut dv).unwrap();
    let dv_logical = dv.as_view().to_f32_vec().unwrap();
    assert_eq!(bits(&dv_logical), bits(&ldx));

    // A contiguous [B,H,S,C] output is the wrong layout.
    let mut wrong = Tensor::zeros(DType::BF16, &[b, h, s, c]);
    let mut rs = Poisoned::new(b * s * h);
    layout_err(qnorm_rope_into(REF, &a, &mut wrong.view_mut(), &mut rs.view(DType::F32, &[b * s * h])).unwrap_err(), "out");
    layout_err(qnorm_rope_backward_into(REF, &a, &rstd.view(), &g.view(), &mut wrong.view_mut()).unwrap_err(), "dx");
}

// ---------------------------------------------------------------- empty extents

#[test]
fn empty_extents_give_empty_or_masked_results() {
    // S = 0 queries, K = 0 keys, P = 0 pooled keys, zero matrices: no panic, no NaN.
    let q0 = zeros_f32(&[2, 0, 2, 4]);
    let kv = zeros_f32(&[2, 3, 4]);
    let sinks = Tensor::from_f32(&[2], vec![0.5, -0.5]).unwrap();
    let idx0 = Tensor::from_i32(&[2, 0, 3], vec![]).unwrap();
    let a = SparseAttentionArgs::new(q0.view(), kv.view(), sinks.view(), SparseIndices::TopK(idx0.view()));
    let (out, lse) = sparse_attention(REF, &a).unwrap();
    assert_eq!((out.shape(), lse.shape()), (&[2, 0, 2, 4][..], &[2, 0, 2][..]));
    let (dq, dkv, ds) = sparse_attention_backward(REF, &SparseAttentionBwdArgs::new(a, out.view(), lse.view(), out.view())).unwrap();
    assert_eq!(dq.numel(), 0);
    assert!(f32s(&dkv).iter().chain(&f32s(&ds)).all(|&v| v == 0.0));

    // K = 0: every slot is masked.
    let q = Tensor::from_f32(&[1, 2, 2, 4], (0..16).map(|i| i as f32 * 0.1).collect()).unwrap();
    let kv0 = zeros_f32(&[1, 0, 4]);
    let idx = idx_i32(&[1, 2, 2], &[0, -1, 1, 0]);
    let dout = Tensor::from_f32(&[1, 2, 2, 4], vec![1.0; 16]).unwrap();
    let r = run_attention(&q, &kv0, &sinks, &idx, &dout, None);
    assert!(r.out.iter().chain(&r.dq).chain(&r.dsinks).all(|&v| v == 0.0) && r.dkv.is_empty());
    assert_eq!(r.lse, vec![0.5, -0.5, 0.5, -0.5]);

    // Indexer with P = 0: scores [B,S,0], top-k [B,S,0].
    let (iq, _, iw) = indexer_inputs(1, 3, 2, 4, 1, 18);
    let p0 = zeros_f32(&[1, 0, 4]);
    let ia = IndexerArgs::new(iq.view(), p0.view(), iw.view(), 1.0, 1);
    assert_eq!(indexer_scores(REF, &ia).unwrap().shape(), &[1, 3, 0]);
    let (i, v) = lightning_indexer(REF, &ia, 4).unwrap();
    assert_eq!((i.shape(), v.shape()), (&[1, 3, 0][..], &[1, 3, 0][..]));

    // Sinkhorn over zero matrices, qnorm_rope over zero tokens, the builder over S = 0.
    let x0 = zeros_f32(&[0, 4, 4]);
    let sk0 = SinkhornArgs { x: x0.view(), repeat: 2, eps: 1e-6 };
    assert_eq!(sinkhorn_normalize(REF, &sk0).unwrap().shape(), &[0, 4, 4]);
    assert_eq!(sinkhorn_normalize_backward(REF, &sk0, &x0.view()).unwrap().shape(), &[0, 4, 4]);
    let xq = Tensor::from_f32_as_bf16(&[1, 2, 0, 4], &[]).unwrap();
    let cs = zeros_f32(&[1, 0, 2]);
    let qa = QNormRopeArgs { x: xq.view(), cos: cs.view(), sin: cs.view(), rotary: 2, eps: 1e-6 };
    let (o, rs) = qnorm_rope(REF, &qa).unwrap();
    assert_eq!((o.numel(), rs.numel()), (0, 0));
    assert_eq!(qnorm_rope_backward(REF, &qa, &rs.view(), &xq.view()).unwrap().numel(), 0);
    let b0 = build_sparse_topk_indices(REF, &BuildIndicesArgs::new(2, 0, 0, 4)).unwrap();
    assert_eq!(b0.shape(), &[2, 0, 0]);
}

fn zeros_f32(shape: &[usize]) -> Tensor {
    Tensor::zeros(DType::F32, shape)
}

#[test]
fn builder_wild_compressed_indices_and_positions() {
    // compressed_topk entries far outside [0, P) become -1, like any slot outside [0, K).
    let (b, s, v, p) = (1, 3, 3, 2);
    let ct = Tensor::from_i64(&[b, s, 3], vec![0, i64::MAX, -1, i64::MIN, 1, 2, i64::MAX - 1, 5, 1]).unwrap();
    let a = BuildIndicesArgs { n_pooled: p, compressed_topk: Some(ct.view()), ..BuildIndicesArgs::new(b, s, v + p, 2) };
    let out = build_sparse_topk_indices(REF, &a).unwrap().to_i64_vec().unwrap();
    let comp: Vec<i64> = out.chunks(5).flat_map(|r| r[2..].to_vec()).collect();
    assert_eq!(comp, vec![3, -1, -1, -1, 4, -1, -1, -1, 4]);
    // Extreme positions: nothing visible before 0; everything causal far after.
    let qp = Tensor::from_i64(&[s], vec![i64::MIN, -1, i64::MAX]).unwrap();
    let a = BuildIndicesArgs { n_pooled: p, compress_ratio: 1, q_positions: Some(qp.view()), vanilla_key_len: Some(v), ..BuildIndicesArgs::new(b, s, v + p, 2) };
    let out = build_sparse_topk_indices(REF, &a).unwrap().to_i64_vec().unwrap();
    assert_eq!(&out[..8], &[-1; 8]);
    assert_eq!(&out[8..], &[-1, -1, 3, 4]);
}

#[test]
fn qnorm_rope_rstd_is_token_major() {
    let (b, h, s, c) = (2, 3, 4, 5);
    let xs = Rng(19).vec(b * h * s * c, -2.0, 2.0);
    let x = Tensor::from_f32(&[b, h, s, c], xs.clone()).unwrap();
    let cs = zeros_f32(&[b, s, 0]);
    let eps = 1e-6f32;
    let (_, rstd) = qnorm_rope(REF, &QNormRopeArgs { x: x.view(), cos: cs.view(), sin: cs.view(), rotary: 0, eps }).unwrap();
    let rstd = f32s(&rstd);
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                let row = &xs[((bi * h + hi) * s + si) * c..][..c];
                let want = 1.0 / (row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64 + eps as f64).sqrt();
                let got = rstd[(bi * s + si) * h + hi] as f64;
                assert!((got - want).abs() <= 1e-6 * want, "rstd[{bi},{si},{hi}] = {got}, want {want}");
            }
        }
    }
}

#[test]
fn auto_on_cpu_is_the_reference() {
    let x = Tensor::from_f32(&[2, 4, 4], Rng(20).vec(32, -1.0, 1.0)).unwrap();
    let a = SinkhornArgs { x: x.view(), repeat: 5, eps: 1e-6 };
    assert_eq!(bits(&f32s(&sinkhorn_normalize(BackendName::Auto, &a).unwrap())), bits(&f32s(&sinkhorn_normalize(REF, &a).unwrap())));
}
