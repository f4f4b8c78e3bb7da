//! Deterministic inputs for `bench`: bf16-representable values, staged on the device the
//! run uses, and RoPE tables.

use dsv4_core::backend;
use dsv4_core::{DType, Device, Error, Result, Tensor};

pub use dsv4_core::rng::SplitMix64 as Rng;

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

/// DeepSeek-style RoPE tables `[B,S,R]`: pair `j` rotates by `pos * theta^(-2j/R)`; the
/// first `R/2` entries hold the pair frequencies, the rest repeat them.
pub fn rope_tables(b: usize, s: usize, r: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut cos, mut sin) = (Vec::with_capacity(b * s * r), Vec::with_capacity(b * s * r));
    for _ in 0..b {
        for pos in 0..s {
            for j in 0..r {
                let f = 10000f64.powf(-2.0 * (j % (r / 2).max(1)) as f64 / r as f64);
                cos.push((pos as f64 * f).cos() as f32);
                sin.push((pos as f64 * f).sin() as f32);
            }
        }
    }
    (cos, sin)
}
