//! SplitMix64: a tiny, fast, reproducible generator for tests, `dsv4 check` and
//! `dsv4 bench` (the same seed gives the same inputs on every machine).

use crate::real::{round_bf16, Real};

/// The state is public so `SplitMix64(seed)` reads as what it is.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, n)` (`n = 0` gives 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform<R: Real>(&mut self, lo: R, hi: R) -> R {
        lo + (hi - lo) * R::of(self.unit())
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.unit().max(f64::MIN_POSITIVE);
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos()
    }
    pub fn vec<R: Real>(&mut self, n: usize, lo: R, hi: R) -> Vec<R> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Uniform values already rounded to bf16, so every backend reads the same numbers.
    pub fn vec_bf16(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| round_bf16(self.uniform(lo, hi))).collect()
    }
}
