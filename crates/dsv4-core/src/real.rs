//! The scalar type of the reference math: f32 (what the reference backend runs) or f64
//! (what `dsv4 check` and the gradient checks compare against).

pub trait Real: num_traits::Float + num_traits::FromPrimitive + std::iter::Sum + std::fmt::Debug + Send + Sync + 'static {
    fn of(x: f64) -> Self;
    fn f64(self) -> f64;
}

impl Real for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn f64(self) -> f64 {
        self
    }
}

/// `<a, b>`, accumulated in R.
#[inline]
pub fn dot<R: Real>(a: &[R], b: &[R]) -> R {
    let mut acc = [R::zero(); 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] = acc[l] + a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s = R::zero();
    for i in chunks * 8..a.len() {
        s = s + a[i] * b[i];
    }
    acc.iter().fold(s, |x, &y| x + y)
}

/// `y += alpha * x`.
#[inline]
pub fn axpy<R: Real>(alpha: R, x: &[R], y: &mut [R]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = *yi + alpha * xi;
    }
}

/// Round an f32 to the nearest bf16 and back (the kernels' bf16 storage boundary).
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Rows are reduced in this many fixed chunks whatever the thread count, so reductions
/// across rows are bitwise reproducible run to run and machine to machine.
const REDUCE_CHUNKS: usize = 32;

/// For each row `r` in `0..n_rows` (in parallel), call `f(r, row_out, acc)` with the
/// row's own slice of `out` (`row_len > 0` values) and an accumulator of `acc_len` values
/// shared by a fixed chunk of rows; return the accumulators summed in chunk order.
pub fn rows_with_reduction<R: Real>(out: &mut [R], row_len: usize, acc_len: usize, f: impl Fn(usize, &mut [R], &mut [R]) + Sync) -> Vec<R> {
    use rayon::prelude::*;
    assert!(row_len > 0 && out.len().is_multiple_of(row_len));
    let n_rows = out.len() / row_len;
    let per_chunk = n_rows.div_ceil(REDUCE_CHUNKS).max(1);
    let partials: Vec<Vec<R>> = out
        .par_chunks_mut(per_chunk * row_len)
        .enumerate()
        .map(|(c, out_chunk)| {
            let mut acc = vec![R::zero(); acc_len];
            for (i, row_out) in out_chunk.chunks_mut(row_len).enumerate() {
                f(c * per_chunk + i, row_out, &mut acc);
            }
            acc
        })
        .collect();
    let mut total = vec![R::zero(); acc_len];
    for p in &partials {
        axpy(R::one(), p, &mut total);
    }
    total
}
