//! SPEC.md sections 2 and 3 computed directly. Edge cases:
//! - a pooled key `p` is visible to query `s` when `p < (query_start + s + 1) / r`
//!   (integer division), else its score is `-inf`;
//! - top-k ranks finite scores only (NaN and -inf never selected), descending, ties to
//!   the lower index; slots past the finite count are -1 with value -inf;
//! - the backward ignores slots whose score is -inf (masked, out of range, not visible).

use rayon::prelude::*;

use crate::real::{axpy, dot, rows_with_reduction, Real};

/// q `[b,s,h,d]`, pooled_kv `[b,p,d]`, weights `[b,s,h]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub s: usize,
    pub h: usize,
    pub d: usize,
    pub p: usize,
}

/// The causal scoring rule of one call.
#[derive(Clone, Copy, Debug)]
pub struct Causal {
    pub compress_ratio: usize,
    pub query_start: usize,
}

impl Causal {
    /// Pooled keys visible to local query `s`.
    pub fn visible(&self, s: usize) -> usize {
        (self.query_start + s + 1) / self.compress_ratio
    }
}

fn score_one<R: Real>(dm: Dims, q_row: &[R], w_row: &[R], kv_p: &[R], scale: R) -> R {
    let mut acc = R::zero();
    for h in 0..dm.h {
        let a = dot(&q_row[h * dm.d..(h + 1) * dm.d], kv_p);
        acc = acc + w_row[h] * a.max(R::zero());
    }
    scale * acc
}

/// `[b,s,p]` scores with the causal -inf.
pub fn scores<R: Real>(dm: Dims, q: &[R], kv: &[R], w: &[R], scale: R, causal: Causal) -> Vec<R> {
    let mut out = vec![R::zero(); dm.b * dm.s * dm.p];
    out.par_chunks_mut(dm.p.max(1)).enumerate().for_each(|(r, row)| {
        let (b, s) = (r / dm.s, r % dm.s);
        let visible = causal.visible(s);
        let q_row = &q[r * dm.h * dm.d..(r + 1) * dm.h * dm.d];
        let w_row = &w[r * dm.h..(r + 1) * dm.h];
        for (p, o) in row.iter_mut().enumerate() {
            *o = if p < visible { score_one(dm, q_row, w_row, &kv[(b * dm.p + p) * dm.d..(b * dm.p + p + 1) * dm.d], scale) } else { R::neg_infinity() };
        }
    });
    out
}

/// Per row of `[rows, p]` scores: the `k` best finite scores, descending, ties to the lower
/// index; `(-1, -inf)` past the finite count. Returns `(indices, values)`, `[rows, k]`.
pub fn topk<R: Real>(scores: &[R], p: usize, k: usize) -> (Vec<i64>, Vec<R>) {
    let rows = scores.len().checked_div(p).unwrap_or(0);
    let mut idx = vec![-1i64; rows * k];
    let mut val = vec![R::neg_infinity(); rows * k];
    idx.par_chunks_mut(k.max(1)).zip(val.par_chunks_mut(k.max(1))).enumerate().for_each(|(r, (ir, vr))| {
        let row = &scores[r * p..(r + 1) * p];
        let mut cand: Vec<usize> = (0..p).filter(|&i| row[i].is_finite()).collect();
        cand.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        for (j, &c) in cand.iter().take(k).enumerate() {
            ir[j] = c as i64;
            vr[j] = row[c];
        }
    });
    (idx, val)
}

/// `[b,s,t]` scores of the selected slots (`-inf` where masked or not visible).
pub fn topk_scores<R: Real>(dm: Dims, q: &[R], kv: &[R], w: &[R], idx: &[i64], t: usize, scale: R, causal: Causal) -> Vec<R> {
    let mut out = vec![R::neg_infinity(); dm.b * dm.s * t];
    out.par_chunks_mut(t.max(1)).enumerate().for_each(|(r, row)| {
        let (b, s) = (r / dm.s, r % dm.s);
        let visible = causal.visible(s).min(dm.p);
        let q_row = &q[r * dm.h * dm.d..(r + 1) * dm.h * dm.d];
        let w_row = &w[r * dm.h..(r + 1) * dm.h];
        for (j, o) in row.iter_mut().enumerate() {
            let p = idx[r * t + j];
            if p >= 0 && (p as usize) < visible {
                let p = p as usize;
                *o = score_one(dm, q_row, w_row, &kv[(b * dm.p + p) * dm.d..(b * dm.p + p + 1) * dm.d], scale);
            }
        }
    });
    out
}

pub struct Grads<R> {
    pub dq: Vec<R>,
    pub dweights: Vec<R>,
    pub dpooled_kv: Vec<R>,
}

/// Backward of `topk_scores` given `g [b,s,t]` (SPEC.md section 3). Deterministic.
pub fn topk_scores_backward<R: Real>(dm: Dims, q: &[R], kv: &[R], w: &[R], idx: &[i64], t: usize, grad: &[R], scale: R, causal: Causal) -> Grads<R> {
    let (hd, d) = (dm.h * dm.d, dm.d);
    let rows = dm.b * dm.s;
    // Each row's output is dq [h,d] followed by dweights [h].
    let row_len = hd + dm.h;
    let mut rows_out = vec![R::zero(); rows * row_len];
    let dpooled_kv = rows_with_reduction(&mut rows_out, row_len, dm.b * dm.p * d, |r, row_out, dkv| {
        let (b, s) = (r / dm.s, r % dm.s);
        let visible = causal.visible(s).min(dm.p);
        let (dq_row, dw_row) = row_out.split_at_mut(hd);
        for j in 0..t {
            let p = idx[r * t + j];
            let g = grad[r * t + j];
            if p < 0 || (p as usize) >= visible || g == R::zero() {
                continue;
            }
            let p = p as usize;
            let kv_p = &kv[(b * dm.p + p) * d..(b * dm.p + p + 1) * d];
            for h in 0..dm.h {
                let qh = &q[r * hd + h * d..r * hd + (h + 1) * d];
                let a = dot(qh, kv_p);
                if a > R::zero() {
                    dw_row[h] = dw_row[h] + g * scale * a;
                    let c = g * scale * w[r * dm.h + h];
                    axpy(c, kv_p, &mut dq_row[h * d..(h + 1) * d]);
                    axpy(c, qh, &mut dkv[(b * dm.p + p) * d..(b * dm.p + p + 1) * d]);
                }
            }
        }
    });
    let mut dq = Vec::with_capacity(rows * hd);
    let mut dweights = Vec::with_capacity(rows * dm.h);
    for row in rows_out.chunks(row_len) {
        dq.extend_from_slice(&row[..hd]);
        dweights.extend_from_slice(&row[hd..]);
    }
    Grads { dq, dweights, dpooled_kv }
}
