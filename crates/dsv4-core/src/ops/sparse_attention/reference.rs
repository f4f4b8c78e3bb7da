//! SPEC.md section 1 computed directly. One query row `(b, s)` at a time, all heads;
//! rows in parallel. Edge cases settled here, before any kernel:
//! - a slot is valid when `0 <= idx < K`; any other value is masked and never read;
//! - a key that appears twice in a row counts twice (a gather), the dense oracle
//!   collapses duplicates;
//! - a row with no valid slot: `Z = exp(sink)`, so `lse = sink`, `out = 0`, and every
//!   gradient of that row is 0 (`delta = <dout, 0> = 0`);
//! - the softmax runs from the running max of the logits *and* the sink, so logits of
//!   |l| ~ 1e4 and sinks of +-30 neither overflow nor lose the sink;
//! - `reference_rounding` changes only kernels' rounding (natural exp, scale before the
//!   max); this direct evaluation already uses natural exp on scaled logits.

use rayon::prelude::*;

use crate::real::{axpy, dot, rows_with_reduction, Real};

/// Sizes of one call: q `[b,s,h,d]`, kv `[b,k,d]`, indices `[b,s,t]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub s: usize,
    pub h: usize,
    pub d: usize,
    pub k: usize,
    pub t: usize,
}

/// Valid key positions of one row, in slot order (duplicates kept).
fn valid_keys(row: &[i64], k: usize) -> Vec<usize> {
    row.iter().filter(|&&i| i >= 0 && (i as usize) < k).map(|&i| i as usize).collect()
}

/// Valid key positions of one row with duplicates collapsed (the dense oracle's set).
fn key_set(row: &[i64], k: usize) -> Vec<usize> {
    let mut keys = valid_keys(row, k);
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// One row's forward: writes `out [h,d]`, returns nothing; `lse [h]`.
fn row_forward<R: Real>(dm: Dims, q: &[R], kv: &[R], sinks: &[R], keys: &[usize], scale: R, out: &mut [R], lse: &mut [R]) {
    let d = dm.d;
    let mut logits = vec![R::zero(); keys.len()];
    for h in 0..dm.h {
        let qh = &q[h * d..(h + 1) * d];
        for (l, &key) in logits.iter_mut().zip(keys) {
            *l = scale * dot(qh, &kv[key * d..(key + 1) * d]);
        }
        let m = logits.iter().fold(sinks[h], |m, &l| m.max(l));
        let oh = &mut out[h * d..(h + 1) * d];
        oh.iter_mut().for_each(|o| *o = R::zero());
        let mut z = (sinks[h] - m).exp();
        for (&l, &key) in logits.iter().zip(keys) {
            let p = (l - m).exp();
            z = z + p;
            axpy(p, &kv[key * d..(key + 1) * d], oh);
        }
        let inv = R::one() / z;
        oh.iter_mut().for_each(|o| *o = *o * inv);
        lse[h] = m + z.ln();
    }
}

/// Forward over all rows: returns `(out [b,s,h,d], lse [b,s,h])`.
/// `idx` is `[b*s, width]` local key positions (any width; invalid = masked).
pub fn forward<R: Real>(dm: Dims, q: &[R], kv: &[R], sinks: &[R], idx: &[i64], width: usize, scale: R, dedup: bool) -> (Vec<R>, Vec<R>) {
    let (hd, rows) = (dm.h * dm.d, dm.b * dm.s);
    let mut out = vec![R::zero(); rows * hd];
    let mut lse = vec![R::zero(); rows * dm.h];
    out.par_chunks_mut(hd.max(1)).zip(lse.par_chunks_mut(dm.h.max(1))).enumerate().for_each(|(r, (o, l))| {
        let b = r / dm.s.max(1);
        let row = &idx[r * width..(r + 1) * width];
        let keys = if dedup { key_set(row, dm.k) } else { valid_keys(row, dm.k) };
        let kvb = &kv[b * dm.k * dm.d..(b + 1) * dm.k * dm.d];
        row_forward(dm, &q[r * hd..(r + 1) * hd], kvb, sinks, &keys, scale, o, l);
    });
    (out, lse)
}

/// Gradients of one call: `dq [b,s,h,d]`, `dkv [b,k,d]`, `dsinks [h]`.
pub struct Grads<R> {
    pub dq: Vec<R>,
    pub dkv: Vec<R>,
    pub dsinks: Vec<R>,
}

/// Backward over all rows, from the saved `out` and `lse` (SPEC.md section 1). Rows
/// accumulate dkv and dsinks in fixed chunks summed in order, so the reference is bitwise
/// reproducible for both `backward_impl`s.
#[allow(clippy::too_many_arguments)]
pub fn backward<R: Real>(dm: Dims, q: &[R], kv: &[R], sinks: &[R], idx: &[i64], width: usize, scale: R, out: &[R], lse: &[R], dout: &[R]) -> Grads<R> {
    let (d, hd, rows) = (dm.d, dm.h * dm.d, dm.b * dm.s);
    let kvlen = dm.b * dm.k * d;
    let mut dq = vec![R::zero(); rows * hd];
    // Accumulator layout: dkv [b,k,d] then dsinks [h].
    let acc = rows_with_reduction(&mut dq, hd, kvlen + dm.h, |r, dq_row, acc| {
        let b = r / dm.s;
        let keys = valid_keys(&idx[r * width..(r + 1) * width], dm.k);
        if keys.is_empty() {
            return; // out = 0, so every gradient of this row is 0
        }
        let kvb = &kv[b * dm.k * d..(b + 1) * dm.k * d];
        let (dkv, dsinks) = acc.split_at_mut(kvlen);
        let dkvb = &mut dkv[b * dm.k * d..(b + 1) * dm.k * d];
        let mut dl = Vec::with_capacity(keys.len());
        for h in 0..dm.h {
            let o = r * hd + h * d;
            let (qh, doh, oh) = (&q[o..o + d], &dout[o..o + d], &out[o..o + d]);
            let lse_h = lse[r * dm.h + h];
            let delta = dot(doh, oh);
            dl.clear();
            let dqh = &mut dq_row[h * d..(h + 1) * d];
            for &key in &keys {
                let kvk = &kvb[key * d..(key + 1) * d];
                let p = (scale * dot(qh, kvk) - lse_h).exp();
                let dlt = p * (dot(doh, kvk) - delta);
                axpy(scale * dlt, kvk, dqh);
                dl.push((p, dlt));
            }
            for (&key, &(p, dlt)) in keys.iter().zip(&dl) {
                let dkvk = &mut dkvb[key * d..(key + 1) * d];
                axpy(scale * dlt, qh, dkvk);
                axpy(p, doh, dkvk);
            }
            dsinks[h] = dsinks[h] - (sinks[h] - lse_h).exp() * delta;
        }
    });
    let (dkv, dsinks) = acc.split_at(kvlen);
    Grads { dq, dkv: dkv.to_vec(), dsinks: dsinks.to_vec() }
}
