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

/// One row's forward: writes `out [h,d]` and `lse [h]`. Keys are the outer loop so each
/// gathered kv row is read once for all heads (MQA: every head shares it).
fn row_forward<R: Real>(dm: Dims, q: &[R], kv: &[R], sinks: &[R], keys: &[usize], scale: R, out: &mut [R], lse: &mut [R]) {
    let (d, h, t) = (dm.d, dm.h, keys.len());
    // logits[h * t + j] = scale * <q[h], kv[keys[j]]>
    let mut logits = vec![R::zero(); h * t];
    for (j, &key) in keys.iter().enumerate() {
        let kvk = &kv[key * d..(key + 1) * d];
        for hh in 0..h {
            logits[hh * t + j] = scale * dot(&q[hh * d..(hh + 1) * d], kvk);
        }
    }
    // p[h, j] = exp(l - m_h), Z_h = sum_j p + exp(sink_h - m_h), m_h includes the sink.
    for hh in 0..h {
        let row = &mut logits[hh * t..(hh + 1) * t];
        let m = row.iter().fold(sinks[hh], |m, &l| m.max(l));
        if m.f64() == f64::NEG_INFINITY {
            // No term at all (an empty row whose sink is -inf): Z = 0, lse = -inf, out = 0.
            lse[hh] = m;
            continue;
        }
        let mut z = (sinks[hh] - m).exp();
        for l in row.iter_mut() {
            *l = (*l - m).exp();
            z = z + *l;
        }
        let inv = R::one() / z;
        row.iter_mut().for_each(|p| *p = *p * inv);
        lse[hh] = m + z.ln();
    }
    out.iter_mut().for_each(|o| *o = R::zero());
    for (j, &key) in keys.iter().enumerate() {
        let kvk = &kv[key * d..(key + 1) * d];
        for hh in 0..h {
            axpy(logits[hh * t + j], kvk, &mut out[hh * d..(hh + 1) * d]);
        }
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
        let (h, t) = (dm.h, keys.len());
        let (qr, dor, or) = (&q[r * hd..(r + 1) * hd], &dout[r * hd..(r + 1) * hd], &out[r * hd..(r + 1) * hd]);
        let delta: Vec<R> = (0..h).map(|hh| dot(&dor[hh * d..(hh + 1) * d], &or[hh * d..(hh + 1) * d])).collect();
        // Keys outer, heads inner: each gathered kv row is read once for all heads.
        // p[h,j] = exp(l - lse), dl[h,j] = p * (<dout_h, kv_j> - delta_h).
        let mut p = vec![R::zero(); h * t];
        let mut dl = vec![R::zero(); h * t];
        for (j, &key) in keys.iter().enumerate() {
            let kvk = &kvb[key * d..(key + 1) * d];
            for hh in 0..h {
                let pj = (scale * dot(&qr[hh * d..(hh + 1) * d], kvk) - lse[r * h + hh]).exp();
                p[hh * t + j] = pj;
                dl[hh * t + j] = pj * (dot(&dor[hh * d..(hh + 1) * d], kvk) - delta[hh]);
            }
        }
        for (j, &key) in keys.iter().enumerate() {
            let kvk = &kvb[key * d..(key + 1) * d];
            for hh in 0..h {
                // dq_h += scale * dl * kv_j
                axpy(scale * dl[hh * t + j], kvk, &mut dq_row[hh * d..(hh + 1) * d]);
            }
            let dkvk = &mut dkvb[key * d..(key + 1) * d];
            for hh in 0..h {
                // dkv_j += scale * dl * q_h + p * dout_h
                axpy(scale * dl[hh * t + j], &qr[hh * d..(hh + 1) * d], dkvk);
                axpy(p[hh * t + j], &dor[hh * d..(hh + 1) * d], dkvk);
            }
        }
        for hh in 0..h {
            dsinks[hh] = dsinks[hh] - (sinks[hh] - lse[r * h + hh]).exp() * delta[hh];
        }
    });
    let (dkv, dsinks) = acc.split_at(kvlen);
    Grads { dq, dkv: dkv.to_vec(), dsinks: dsinks.to_vec() }
}
