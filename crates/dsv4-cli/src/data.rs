//! Deterministic inputs for `check` and `bench`: bf16-representable values, staged on
//! the device the run uses.

use dsv4_core::backend;
use dsv4_core::{DType, Device, Error, Result, Tensor};

/// splitmix64: small, fast, reproducible everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
    pub fn f32_values(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.uniform() * scale) as f32).collect()
    }
    /// Values already rounded to bf16, so every backend reads the same numbers.
    pub fn bf16_values(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| dsv4_core::real::round_bf16((self.uniform() * scale * 1.7) as f32)).collect()
    }
}

/// Puts host values on the run's device in a dtype.
pub struct Staged {
    pub device: Device,
}

impl Staged {
    pub fn put(&self, values: &[f32], shape: &[usize], dtype: DType) -> Result<Tensor> {
        let host = match dtype {
            DType::BF16 => Tensor::from_f32_as_bf16(shape, values)?,
            DType::F32 => Tensor::from_f32(shape, values.to_vec())?,
            DType::I32 => Tensor::from_i32(shape, values.iter().map(|&v| v as i32).collect())?,
            DType::I64 => Tensor::from_i64(shape, values.iter().map(|&v| v as i64).collect())?,
        };
        match self.device {
            Device::Cpu => Ok(host),
            Device::Cuda(_) => backend::cuda_backend().map_err(Error::Cuda)?.upload(&host.view(), self.device),
        }
    }
}
