//! SPEC.md section 4 computed directly, one `n x n` matrix at a time. The backward
//! re-runs the forward of its matrix, keeping each step's output and denominators, then
//! walks the steps in reverse.

use rayon::prelude::*;

use crate::real::Real;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Axis {
    /// Sum over the last axis (`j`), one denominator per row `i`.
    Rows,
    /// Sum over the second-to-last axis (`i`), one per column `j`.
    Cols,
}

/// `y <- y / (sums of y along axis + eps)`; returns the denominators.
fn normalise<R: Real>(y: &mut [R], n: usize, axis: Axis, eps: R) -> Vec<R> {
    let mut den = vec![eps; n];
    for i in 0..n {
        for j in 0..n {
            let a = if axis == Axis::Rows { i } else { j };
            den[a] = den[a] + y[i * n + j];
        }
    }
    for i in 0..n {
        for j in 0..n {
            y[i * n + j] = y[i * n + j] / den[if axis == Axis::Rows { i } else { j }];
        }
    }
    den
}

fn softmax_rows<R: Real>(x: &[R], n: usize) -> Vec<R> {
    let mut z = x.to_vec();
    for row in z.chunks_mut(n) {
        let m = row.iter().fold(R::neg_infinity(), |m, &v| m.max(v));
        let mut s = R::zero();
        row.iter_mut().for_each(|v| {
            *v = (*v - m).exp();
            s = s + *v;
        });
        row.iter_mut().for_each(|v| *v = *v / s);
    }
    z
}

fn steps(repeat: usize) -> impl Iterator<Item = Axis> {
    std::iter::once(Axis::Cols).chain((1..repeat).flat_map(|_| [Axis::Rows, Axis::Cols]))
}

fn forward_one<R: Real>(x: &[R], n: usize, repeat: usize, eps: R, y: &mut [R]) {
    let z = softmax_rows(x, n);
    for (o, &v) in y.iter_mut().zip(&z) {
        *o = v + eps;
    }
    for axis in steps(repeat) {
        normalise(y, n, axis, eps);
    }
}

/// Forward over `[m, n, n]` contiguous matrices.
pub fn forward<R: Real>(x: &[R], n: usize, repeat: usize, eps: R) -> Vec<R> {
    let mut y = vec![R::zero(); x.len()];
    let nn = (n * n).max(1);
    y.par_chunks_mut(nn).zip(x.par_chunks(nn)).for_each(|(yo, xi)| forward_one(xi, n, repeat, eps, yo));
    y
}

fn backward_one<R: Real>(x: &[R], dout: &[R], n: usize, repeat: usize, eps: R, dx: &mut [R]) {
    let z = softmax_rows(x, n);
    let mut y: Vec<R> = z.iter().map(|&v| v + eps).collect();
    // (axis, output of the step, denominators)
    let mut tape = Vec::new();
    for axis in steps(repeat) {
        let den = normalise(&mut y, n, axis, eps);
        tape.push((axis, y.clone(), den));
    }
    let mut g = dout.to_vec();
    for (axis, v, den) in tape.iter().rev() {
        // du = (dv - sum(dv * v)) / den, along the step's axis.
        let mut dot = vec![R::zero(); n];
        for i in 0..n {
            for j in 0..n {
                let a = if *axis == Axis::Rows { i } else { j };
                dot[a] = dot[a] + g[i * n + j] * v[i * n + j];
            }
        }
        for i in 0..n {
            for j in 0..n {
                let a = if *axis == Axis::Rows { i } else { j };
                g[i * n + j] = (g[i * n + j] - dot[a]) / den[a];
            }
        }
    }
    // y0 = z + eps, so dz = g; softmax over rows: dx = z * (dz - sum(dz * z)).
    for i in 0..n {
        let row = i * n..(i + 1) * n;
        let s: R = g[row.clone()].iter().zip(&z[row.clone()]).map(|(&a, &b)| a * b).sum();
        for j in row {
            dx[j] = z[j] * (g[j] - s);
        }
    }
}

/// Backward over `[m, n, n]` contiguous matrices.
pub fn backward<R: Real>(x: &[R], dout: &[R], n: usize, repeat: usize, eps: R) -> Vec<R> {
    let mut dx = vec![R::zero(); x.len()];
    let nn = (n * n).max(1);
    dx.par_chunks_mut(nn).zip(x.par_chunks(nn).zip(dout.par_chunks(nn))).for_each(|(d, (xi, gi))| backward_one(xi, gi, n, repeat, eps, d));
    dx
}
