//! SPEC.md section 5 computed directly, one `(b, h, s)` row of `C` channels at a time, in
//! logical `[B,H,S,C]` order. `round` puts the two bf16 rounding boundaries in place (the
//! normalised row before rotating; the rotated-back gradient), as the kernels store them.

use rayon::prelude::*;

use crate::real::{round_bf16, Real};

/// x `[b,h,s,c]`, cos/sin `[b,s,r]` (first r/2 entries used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub s: usize,
    pub c: usize,
    pub r: usize,
}

fn rnd<R: Real>(round: bool, x: R) -> R {
    if round {
        R::of(round_bf16(x.f64() as f32) as f64)
    } else {
        x
    }
}

/// Token-major index of logical row `(b, h, s)`: `(b*S + s)*H + h`.
pub fn token_major_row(dm: Dims, b: usize, h: usize, s: usize) -> usize {
    (b * dm.s + s) * dm.h + h
}

/// Returns `(out [b,h,s,c] logical order, rstd [b*s*h] token-major)`.
pub fn forward<R: Real>(dm: Dims, x: &[R], cos: &[R], sin: &[R], eps: R, round: bool) -> (Vec<R>, Vec<R>) {
    let (c, rot0) = (dm.c, dm.c - dm.r);
    let mut out = vec![R::zero(); x.len()];
    let rstd_logical: Vec<R> = out
        .par_chunks_mut(c.max(1))
        .enumerate()
        .map(|(row, y)| {
            let (b, s) = (row / (dm.h * dm.s), row % dm.s);
            let xr = &x[row * c..(row + 1) * c];
            let ms: R = xr.iter().map(|&v| v * v).sum::<R>() / R::of(c as f64);
            let rstd = R::one() / (ms + eps).sqrt();
            for (o, &v) in y.iter_mut().zip(xr) {
                *o = rnd(round, v * rstd);
            }
            let f = (b * dm.s + s) * dm.r;
            for j in 0..dm.r / 2 {
                let (ci, si) = (cos[f + j], sin[f + j]);
                let (a, bb) = (y[rot0 + 2 * j], y[rot0 + 2 * j + 1]);
                y[rot0 + 2 * j] = rnd(round, a * ci - bb * si);
                y[rot0 + 2 * j + 1] = rnd(round, a * si + bb * ci);
            }
            rstd
        })
        .collect();
    let mut rstd = vec![R::zero(); rstd_logical.len()];
    for (row, &v) in rstd_logical.iter().enumerate() {
        let (b, h, s) = (row / (dm.h * dm.s), (row / dm.s) % dm.h, row % dm.s);
        rstd[token_major_row(dm, b, h, s)] = v;
    }
    (out, rstd)
}

/// Returns `dx [b,h,s,c]` in logical order, from `g` in logical order.
pub fn backward<R: Real>(dm: Dims, x: &[R], cos: &[R], sin: &[R], rstd: &[R], g: &[R], round: bool) -> Vec<R> {
    let (c, rot0) = (dm.c, dm.c - dm.r);
    let mut dx = vec![R::zero(); x.len()];
    dx.par_chunks_mut(c.max(1)).enumerate().for_each(|(row, d)| {
        let (b, h, s) = (row / (dm.h * dm.s), (row / dm.s) % dm.h, row % dm.s);
        let rs = rstd[token_major_row(dm, b, h, s)];
        let mut gp = g[row * c..(row + 1) * c].to_vec();
        let f = (b * dm.s + s) * dm.r;
        for j in 0..dm.r / 2 {
            let (ci, si) = (cos[f + j], sin[f + j]);
            let (ga, gb) = (gp[rot0 + 2 * j], gp[rot0 + 2 * j + 1]);
            gp[rot0 + 2 * j] = rnd(round, ga * ci + gb * si);
            gp[rot0 + 2 * j + 1] = rnd(round, gb * ci - ga * si);
        }
        let xr = &x[row * c..(row + 1) * c];
        let mean: R = gp.iter().zip(xr).map(|(&gv, &xv)| gv * xv * rs).sum::<R>() / R::of(c as f64);
        for ((o, &gv), &xv) in d.iter_mut().zip(&gp).zip(xr) {
            *o = rs * (gv - xv * rs * mean);
        }
    });
    dx
}
