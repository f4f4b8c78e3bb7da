//! Finite-difference checks, in f64, of every backward of SPEC.md against the generic
//! reference math (`ops::*::reference::<f64>`). The loss is always `L = sum(out * G)` with
//! a random `G`, differentiated by central differences, one input element at a time.

use dsv4_core::ops::indexer::reference as ix;
use dsv4_core::ops::qnorm_rope::reference as qr;
use dsv4_core::ops::sinkhorn::reference as sk;
use dsv4_core::ops::sparse_attention::reference as sa;

use dsv4_core::rng::SplitMix64 as Rng;

fn weighted_sum(out: &[f64], g: &[f64]) -> f64 {
    out.iter().zip(g).filter(|(o, _)| o.is_finite()).map(|(o, g)| o * g).sum()
}

/// Central differences of `loss` with respect to every element of `x`.
fn numeric_grad(x: &[f64], step: f64, mut loss: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + step;
            let up = loss(&xp);
            xp[i] = x[i] - step;
            let down = loss(&xp);
            xp[i] = x[i];
            (up - down) / (2.0 * step)
        })
        .collect()
}

/// `max |analytic - numeric| <= rtol * max |numeric|` (the gradient's own scale), and the
/// gradient is not trivially zero.
fn assert_grad(name: &str, analytic: &[f64], numeric: &[f64], rtol: f64) {
    assert_eq!(analytic.len(), numeric.len(), "{name}: length");
    assert!(analytic.iter().all(|v| v.is_finite()), "{name}: non-finite analytic gradient");
    let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(scale > 1e-3, "{name}: numeric gradient is ~0 (scale {scale:e}); the check would prove nothing");
    let (worst, at) = analytic.iter().zip(numeric).enumerate().map(|(i, (a, n))| ((a - n).abs(), i)).fold((0.0, 0), |m, x| if x.0 > m.0 { x } else { m });
    assert!(worst <= rtol * scale, "{name}: element {at}: analytic {} vs numeric {} (|diff| {worst:.3e} > {rtol:e} * scale {scale:.3e})", analytic[at], numeric[at]);
}

const STEP: f64 = 1e-5;
const RTOL: f64 = 1e-8;

// ---------------------------------------------------------------- sparse attention

/// Rows with duplicates, every kind of masked slot and one empty row.
fn attention_indices(dm: sa::Dims) -> Vec<i64> {
    let k = dm.k as i64;
    let rows: Vec<Vec<i64>> = vec![
        vec![0, 2, 2, -1, 4, 1],             // a duplicate and a -1
        vec![3, k, -7, 3, 3, 0],             // a triple, K itself, a negative
        vec![-1, -1, k + 100, -1, k, -2],    // empty: out 0, no gradient
        vec![4, 3, 2, 1, 0, i64::MAX],       // every key once
        vec![1, 1, -1, i64::MIN, 4, 2],      // duplicate pair
        vec![2, -1, -1, -1, -1, -1],         // a single key
    ];
    assert_eq!(rows.len(), dm.b * dm.s);
    rows.into_iter().flat_map(|r| r[..dm.t].to_vec()).collect()
}

fn check_sparse_attention(dm: sa::Dims, scale: f64, sink_range: f64, seed: u64) {
    let mut rng = Rng(seed);
    let q = rng.vec(dm.b * dm.s * dm.h * dm.d, -1.0, 1.0);
    let kv = rng.vec(dm.b * dm.k * dm.d, -1.0, 1.0);
    let sinks = rng.vec(dm.h, -sink_range, sink_range);
    let g = rng.vec(q.len(), -1.0, 1.0);
    let idx = attention_indices(dm);
    let loss = |q: &[f64], kv: &[f64], sinks: &[f64]| weighted_sum(&sa::forward::<f64>(dm, q, kv, sinks, &idx, dm.t, scale, false).0, &g);

    let (out, lse) = sa::forward::<f64>(dm, &q, &kv, &sinks, &idx, dm.t, scale, false);
    let grads = sa::backward::<f64>(dm, &q, &kv, &sinks, &idx, dm.t, scale, &out, &lse, &g);

    assert_grad("dq", &grads.dq, &numeric_grad(&q, STEP, |x| loss(x, &kv, &sinks)), RTOL);
    assert_grad("dkv", &grads.dkv, &numeric_grad(&kv, STEP, |x| loss(&q, x, &sinks)), RTOL);
    assert_grad("dsinks", &grads.dsinks, &numeric_grad(&sinks, STEP, |x| loss(&q, &kv, x)), RTOL);

    // The empty row (row 2): out 0, lse = sink, dq exactly 0.
    let hd = dm.h * dm.d;
    assert!(out[2 * hd..3 * hd].iter().all(|&v| v == 0.0));
    for h in 0..dm.h {
        assert_eq!(lse[2 * dm.h + h], sinks[h]);
    }
    assert!(grads.dq[2 * hd..3 * hd].iter().all(|&v| v == 0.0));
}

#[test]
fn sparse_attention_backward_matches_finite_differences() {
    let dm = sa::Dims { b: 2, s: 3, h: 2, d: 4, k: 5, t: 6 };
    check_sparse_attention(dm, 0.5, 1.0, 1);
}

#[test]
fn sparse_attention_backward_default_scale_and_strong_sinks() {
    // Default scale D^-0.5, odd head dim, sinks that dominate some rows.
    let dm = sa::Dims { b: 3, s: 2, h: 3, d: 5, k: 5, t: 5 };
    check_sparse_attention(dm, 1.0 / (5f64).sqrt(), 3.0, 2);
}

#[test]
fn sparse_attention_duplicate_counts_twice_in_gradient() {
    // One row [0, 0]: the same as the row [0] with the key's logit shifted by ln 2.
    let dm = sa::Dims { b: 1, s: 1, h: 1, d: 3, k: 2, t: 2 };
    let (q, kv, sinks) = (vec![0.3, -0.2, 0.5], vec![0.1, 0.7, -0.4, 0.9, 0.2, 0.3], vec![0.25]);
    let (out2, lse2) = sa::forward::<f64>(dm, &q, &kv, &sinks, &[0, 0], 2, 1.0, false);
    let (out1, lse1) = sa::forward::<f64>(dm, &q, &kv, &[sinks[0] - 2f64.ln()], &[0, -1], 2, 1.0, false);
    for (a, b) in out2.iter().zip(&out1) {
        assert!((a - b).abs() < 1e-14, "{a} vs {b}");
    }
    assert!((lse2[0] - (lse1[0] + 2f64.ln())).abs() < 1e-14);
}

// ---------------------------------------------------------------- indexer

#[test]
fn indexer_topk_scores_backward_matches_finite_differences() {
    let dm = ix::Dims { b: 2, s: 4, h: 3, d: 6, p: 5 };
    let t = 6;
    let causal = ix::Causal { compress_ratio: 2, query_start: 3 };
    let scale = 0.7;
    // Choose inputs whose every <q, pooled_kv> is away from the relu kink.
    let mut seed = 10;
    let (q, kv) = loop {
        let mut rng = Rng(seed);
        let q = rng.vec(dm.b * dm.s * dm.h * dm.d, -1.0, 1.0);
        let kv = rng.vec(dm.b * dm.p * dm.d, -1.0, 1.0);
        let min_a = (0..dm.b * dm.s * dm.h)
            .flat_map(|row| (0..dm.p).map(move |p| (row, p)))
            .map(|(row, p)| {
                let b = row / (dm.s * dm.h);
                let qr = &q[row * dm.d..(row + 1) * dm.d];
                let kr = &kv[(b * dm.p + p) * dm.d..(b * dm.p + p + 1) * dm.d];
                qr.iter().zip(kr).map(|(x, y)| x * y).sum::<f64>().abs()
            })
            .fold(f64::INFINITY, f64::min);
        if min_a > 0.02 {
            break (q, kv);
        }
        seed += 1;
    };
    let mut rng = Rng(seed + 1000);
    let w = rng.vec(dm.b * dm.s * dm.h, -1.0, 1.0);
    // Duplicates, -1, >= P, negatives and (for early rows) causally invisible keys.
    let idx: Vec<i64> = (0..dm.b * dm.s).flat_map(|r| [(r % 5) as i64, 0, 0, -1, 5, 4 - (r % 3) as i64]).collect();
    let g = rng.vec(dm.b * dm.s * t, -1.0, 1.0); // random at -inf slots too: ignored
    let fwd = |q: &[f64], kv: &[f64], w: &[f64]| ix::topk_scores::<f64>(dm, q, kv, w, &idx, t, scale, causal);
    let scores = fwd(&q, &kv, &w);
    assert!(scores.iter().any(|v| v.is_infinite()) && scores.iter().any(|v| v.is_finite()));
    let loss = |q: &[f64], kv: &[f64], w: &[f64]| weighted_sum(&fwd(q, kv, w), &g);
    let grads = ix::topk_scores_backward::<f64>(dm, &q, &kv, &w, &idx, t, &g, scale, causal);
    assert_grad("dq", &grads.dq, &numeric_grad(&q, STEP, |x| loss(x, &kv, &w)), RTOL);
    assert_grad("dweights", &grads.dweights, &numeric_grad(&w, STEP, |x| loss(&q, &kv, x)), RTOL);
    assert_grad("dpooled_kv", &grads.dpooled_kv, &numeric_grad(&kv, STEP, |x| loss(&q, x, &w)), RTOL);
}

// ---------------------------------------------------------------- sinkhorn

fn check_sinkhorn(n: usize, repeat: usize, eps: f64, seed: u64) {
    let m = 2;
    let mut rng = Rng(seed);
    let x = rng.vec(m * n * n, -2.0, 2.0);
    let g = rng.vec(x.len(), -1.0, 1.0);
    let dx = sk::backward::<f64>(&x, &g, n, repeat, eps);
    let num = numeric_grad(&x, STEP, |x| weighted_sum(&sk::forward::<f64>(x, n, repeat, eps), &g));
    if n == 1 {
        // softmax of one entry is the constant 1: the gradient is exactly 0.
        assert!(dx.iter().all(|&v| v == 0.0) && num.iter().all(|&v| v.abs() < 1e-9), "n = 1: {dx:?} {num:?}");
        return;
    }
    assert_grad(&format!("sinkhorn n={n} repeat={repeat} eps={eps:e}"), &dx, &num, RTOL);
}

#[test]
fn sinkhorn_backward_matches_finite_differences() {
    for n in 1..=5 {
        for repeat in [1, 2, 20] {
            for eps in [1e-6, 1e-2] {
                check_sinkhorn(n, repeat, eps, (n * 100 + repeat) as u64);
            }
        }
    }
}

// ---------------------------------------------------------------- qnorm_rope

fn check_qnorm_rope(dm: qr::Dims, eps: f64, seed: u64) {
    let mut rng = Rng(seed);
    let x = rng.vec(dm.b * dm.h * dm.s * dm.c, -2.0, 2.0);
    // Real rotations in the first R/2 entries; the second half is never read.
    let mut cos = vec![f64::NAN; dm.b * dm.s * dm.r];
    let mut sin = vec![f64::NAN; dm.b * dm.s * dm.r];
    for row in 0..dm.b * dm.s {
        for j in 0..dm.r / 2 {
            let th: f64 = rng.uniform(-3.0, 3.0);
            cos[row * dm.r + j] = th.cos();
            sin[row * dm.r + j] = th.sin();
        }
    }
    let g = rng.vec(x.len(), -1.0, 1.0);
    let (out, rstd) = qr::forward::<f64>(dm, &x, &cos, &sin, eps, false);
    assert!(out.iter().all(|v| v.is_finite()));
    let dx = qr::backward::<f64>(dm, &x, &cos, &sin, &rstd, &g, false);
    let num = numeric_grad(&x, STEP, |x| weighted_sum(&qr::forward::<f64>(dm, x, &cos, &sin, eps, false).0, &g));
    assert_grad(&format!("qnorm_rope {dm:?}"), &dx, &num, RTOL);
}

#[test]
fn qnorm_rope_backward_matches_finite_differences() {
    check_qnorm_rope(qr::Dims { b: 2, h: 3, s: 2, c: 8, r: 4 }, 1e-6, 1);
    check_qnorm_rope(qr::Dims { b: 1, h: 2, s: 3, c: 6, r: 6 }, 1e-6, 2); // every channel rotated
    check_qnorm_rope(qr::Dims { b: 1, h: 2, s: 2, c: 5, r: 0 }, 1e-6, 3); // RMSNorm only, odd C
    check_qnorm_rope(qr::Dims { b: 2, h: 1, s: 2, c: 4, r: 2 }, 0.5, 4); // eps that matters
}

#[test]
fn qnorm_rope_backward_with_general_cos_sin() {
    // The backward is the exact transpose of the rotation, whatever cos and sin hold.
    let dm = qr::Dims { b: 1, h: 2, s: 2, c: 6, r: 4 };
    let mut rng = Rng(77);
    let x = rng.vec(dm.b * dm.h * dm.s * dm.c, -2.0, 2.0);
    let cos = rng.vec(dm.b * dm.s * dm.r, -1.5, 1.5);
    let sin = rng.vec(dm.b * dm.s * dm.r, -1.5, 1.5);
    let g = rng.vec(x.len(), -1.0, 1.0);
    let (_, rstd) = qr::forward::<f64>(dm, &x, &cos, &sin, 1e-6, false);
    let dx = qr::backward::<f64>(dm, &x, &cos, &sin, &rstd, &g, false);
    let num = numeric_grad(&x, STEP, |x| weighted_sum(&qr::forward::<f64>(dm, x, &cos, &sin, 1e-6, false).0, &g));
    assert_grad("qnorm_rope general rotation", &dx, &num, RTOL);
}
