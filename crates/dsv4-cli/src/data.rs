//! Deterministic inputs for `check` and `bench`: bf16-representable values, staged on
//! the device the run uses.

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
