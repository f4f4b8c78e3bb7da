//! Just enough tensor for the operations: an owned tensor (host or device storage) and
//! borrowed strided views over any memory, ours or a caller's (torch, numpy).
//!
//! Strides are in elements, as in torch. Owned tensors are row-major contiguous unless
//! built with explicit strides (qnorm_rope's token-major output is one such).
//!
//! Files: `dtype.rs` (element types, devices, typed host storage), `view.rs` (the borrowed
//! strided views and their element reads and writes); the owned [`Tensor`] is here.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use half::bf16;

use crate::error::{Error, Result};

mod dtype;
mod view;

pub use dtype::{DType, Device, HostData};
pub use view::{TensorView, TensorViewMut};

/// Device memory owned by a GPU backend; dropped when the last tensor using it goes.
pub trait DeviceBuffer: Send + Sync + fmt::Debug {
    fn device_ptr(&self) -> u64;
    fn len_bytes(&self) -> usize;
    fn ordinal(&self) -> usize;
    /// Copy `dst.len()` bytes starting at byte `offset` to the host (synchronous).
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
}

#[derive(Clone, Debug)]
pub enum Storage {
    Host(HostData),
    Device(Arc<dyn DeviceBuffer>),
}

/// Row-major strides of a shape, in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![1isize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1) as isize;
    }
    strides
}

/// An owned tensor.
#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Storage,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
}

impl Tensor {
    /// Zero-filled host tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Self {
        let n = shape.iter().product();
        Tensor { storage: Storage::Host(HostData::zeros(dtype, n)), dtype, shape: shape.to_vec(), strides: contiguous_strides(shape) }
    }

    pub fn from_host(data: HostData, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        let len = match &data {
            HostData::BF16(v) => v.len(),
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
            HostData::I64(v) => v.len(),
        };
        if len != n {
            return Err(Error::Data(format!("Tensor::from_host: {len} elements for shape {shape:?} ({n} elements)")));
        }
        Ok(Tensor { dtype: data.dtype(), storage: Storage::Host(data), shape: shape.to_vec(), strides: contiguous_strides(shape) })
    }

    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        Self::from_host(HostData::F32(data), shape)
    }
    pub fn from_i32(shape: &[usize], data: Vec<i32>) -> Result<Self> {
        Self::from_host(HostData::I32(data), shape)
    }
    pub fn from_i64(shape: &[usize], data: Vec<i64>) -> Result<Self> {
        Self::from_host(HostData::I64(data), shape)
    }
    /// Rounds each value to bf16 (round to nearest even).
    pub fn from_f32_as_bf16(shape: &[usize], data: &[f32]) -> Result<Self> {
        Self::from_host(HostData::BF16(data.iter().map(|&x| bf16::from_f32(x)).collect()), shape)
    }

    /// A tensor over device memory, contiguous unless `strides` is given.
    pub fn from_device(buf: Arc<dyn DeviceBuffer>, dtype: DType, shape: &[usize], strides: Option<Vec<isize>>) -> Self {
        Tensor { storage: Storage::Device(buf), dtype, shape: shape.to_vec(), strides: strides.unwrap_or_else(|| contiguous_strides(shape)) }
    }

    /// Reinterpret the same storage with another shape and strides (the caller vouches that
    /// every addressed element lies inside the storage).
    pub fn with_layout(mut self, shape: &[usize], strides: &[isize]) -> Self {
        self.shape = shape.to_vec();
        self.strides = strides.to_vec();
        self
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Host(_) => Device::Cpu,
            Storage::Device(b) => Device::Cuda(b.ordinal()),
        }
    }

    fn raw_ptr(&self) -> *const u8 {
        match &self.storage {
            Storage::Host(h) => h.ptr(),
            Storage::Device(b) => b.device_ptr() as usize as *const u8,
        }
    }

    pub fn view(&self) -> TensorView<'_> {
        TensorView { ptr: self.raw_ptr(), dtype: self.dtype, shape: self.shape.clone(), strides: self.strides.clone(), device: self.device(), _life: PhantomData }
    }

    pub fn view_mut(&mut self) -> TensorViewMut<'_> {
        let device = self.device();
        let ptr = match &mut self.storage {
            Storage::Host(h) => h.ptr_mut(),
            Storage::Device(b) => b.device_ptr() as usize as *mut u8,
        };
        TensorViewMut { ptr, dtype: self.dtype, shape: self.shape.clone(), strides: self.strides.clone(), device, _life: PhantomData }
    }

    /// A host copy (device tensors are copied back; host tensors are cloned).
    pub fn to_host(&self) -> Result<Tensor> {
        match &self.storage {
            Storage::Host(_) => Ok(self.clone()),
            Storage::Device(buf) => {
                let span = self.view().span_elems();
                let mut host = HostData::zeros(self.dtype, span);
                let bytes = span * self.dtype.size();
                // SAFETY: `host` holds `span` elements of this dtype, i.e. `bytes` bytes.
                let dst = unsafe { std::slice::from_raw_parts_mut(host.ptr_mut(), bytes) };
                buf.copy_to_host(0, dst)?;
                Ok(Tensor { storage: Storage::Host(host), dtype: self.dtype, shape: self.shape.clone(), strides: self.strides.clone() })
            }
        }
    }

    /// Logical-order values as f32 (host tensors only; see `to_host`).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        self.to_host()?.view().to_f32_vec()
    }
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        self.to_host()?.view().to_f64_vec()
    }
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        self.to_host()?.view().to_i64_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_read_and_write_round_trip() {
        // [2,3] row-major, viewed transposed as [3,2].
        let t = Tensor::from_f32(&[2, 3], vec![0., 1., 2., 3., 4., 5.]).unwrap();
        let v = t.view().transpose(0, 1);
        assert_eq!(v.to_f32_vec().unwrap(), vec![0., 3., 1., 4., 2., 5.]);
        assert!(!v.is_contiguous());
        let mut o = Tensor::zeros(DType::BF16, &[3, 2]);
        o.view_mut().write_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 1.0 + 1.0 / 512.0]).unwrap();
        let back = o.to_f32_vec().unwrap();
        assert_eq!(back[5], 1.0); // 1 + 2^-9 rounds to even in bf16 (8 mantissa bits)
    }
}
