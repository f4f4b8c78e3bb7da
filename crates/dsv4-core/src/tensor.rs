//! Just enough tensor for the operations: an owned tensor (host or device storage) and
//! borrowed strided views over any memory, ours or a caller's (torch, numpy).
//!
//! Strides are in elements, as in torch. Owned tensors are row-major contiguous unless
//! built with explicit strides (qnorm_rope's token-major output is one such).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use half::bf16;

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F32,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F32)
    }
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::I64 => "i64",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Device memory owned by a GPU backend; dropped when the last tensor using it goes.
pub trait DeviceBuffer: Send + Sync + fmt::Debug {
    fn device_ptr(&self) -> u64;
    fn len_bytes(&self) -> usize;
    fn ordinal(&self) -> usize;
    /// Copy `dst.len()` bytes starting at byte `offset` to the host (synchronous).
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
}

/// Typed host storage: keeps every element naturally aligned.
#[derive(Clone, Debug)]
pub enum HostData {
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl HostData {
    fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::BF16 => HostData::BF16(vec![bf16::ZERO; n]),
            DType::F32 => HostData::F32(vec![0.0; n]),
            DType::I32 => HostData::I32(vec![0; n]),
            DType::I64 => HostData::I64(vec![0; n]),
        }
    }
    fn dtype(&self) -> DType {
        match self {
            HostData::BF16(_) => DType::BF16,
            HostData::F32(_) => DType::F32,
            HostData::I32(_) => DType::I32,
            HostData::I64(_) => DType::I64,
        }
    }
    fn ptr(&self) -> *const u8 {
        match self {
            HostData::BF16(v) => v.as_ptr() as *const u8,
            HostData::F32(v) => v.as_ptr() as *const u8,
            HostData::I32(v) => v.as_ptr() as *const u8,
            HostData::I64(v) => v.as_ptr() as *const u8,
        }
    }
    fn ptr_mut(&mut self) -> *mut u8 {
        match self {
            HostData::BF16(v) => v.as_mut_ptr() as *mut u8,
            HostData::F32(v) => v.as_mut_ptr() as *mut u8,
            HostData::I32(v) => v.as_mut_ptr() as *mut u8,
            HostData::I64(v) => v.as_mut_ptr() as *mut u8,
        }
    }
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

/// A borrowed, strided, read-only view of host or device memory.
#[derive(Clone, Debug)]
pub struct TensorView<'a> {
    ptr: *const u8,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
    device: Device,
    _life: PhantomData<&'a [u8]>,
}

// SAFETY: a view is a pointer plus layout; the memory it names is only read, and the
// lifetime ties it to its owner. Device pointers are never dereferenced on the host.
unsafe impl Send for TensorView<'_> {}
unsafe impl Sync for TensorView<'_> {}

/// A borrowed, strided, writable view.
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    ptr: *mut u8,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
    device: Device,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: as for TensorView; a mutable view is unique by construction (`&mut` owner or
// the caller's promise in `from_raw`).
unsafe impl Send for TensorViewMut<'_> {}
unsafe impl Sync for TensorViewMut<'_> {}

fn span_elems(shape: &[usize], strides: &[isize]) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    1 + shape.iter().zip(strides).map(|(&n, &s)| (n - 1) * s.unsigned_abs()).sum::<usize>()
}

/// Visit every element offset (in elements) in logical row-major order.
fn for_each_offset(shape: &[usize], strides: &[isize], mut f: impl FnMut(isize)) {
    let n: usize = shape.iter().product();
    if n == 0 {
        return;
    }
    let nd = shape.len();
    let mut idx = vec![0usize; nd];
    let mut off: isize = 0;
    for _ in 0..n {
        f(off);
        for d in (0..nd).rev() {
            idx[d] += 1;
            off += strides[d];
            if idx[d] < shape[d] {
                break;
            }
            off -= strides[d] * shape[d] as isize;
            idx[d] = 0;
        }
    }
}

macro_rules! view_common {
    () => {
        pub fn dtype(&self) -> DType {
            self.dtype
        }
        pub fn shape(&self) -> &[usize] {
            &self.shape
        }
        pub fn strides(&self) -> &[isize] {
            &self.strides
        }
        pub fn device(&self) -> Device {
            self.device
        }
        pub fn numel(&self) -> usize {
            self.shape.iter().product()
        }
        pub fn is_contiguous(&self) -> bool {
            let c = contiguous_strides(&self.shape);
            self.shape.iter().zip(self.strides.iter().zip(&c)).all(|(&n, (&s, &cs))| n <= 1 || s == cs)
        }
        /// Elements from the first to one past the last addressed element.
        pub fn span_elems(&self) -> usize {
            span_elems(&self.shape, &self.strides)
        }
        /// Address of element 0 (a device address for device views).
        pub fn address(&self) -> u64 {
            self.ptr as usize as u64
        }
    };
}

impl<'a> TensorView<'a> {
    /// # Safety
    /// `ptr` must address memory of `device` valid for reads of every element the shape
    /// and strides reach, for the lifetime `'a`, not written by anyone else meanwhile.
    pub unsafe fn from_raw(ptr: *const u8, dtype: DType, shape: &[usize], strides: &[isize], device: Device) -> Self {
        TensorView { ptr, dtype, shape: shape.to_vec(), strides: strides.to_vec(), device, _life: PhantomData }
    }

    view_common!();

    /// A view of the same memory with dimensions `a` and `b` swapped.
    pub fn transpose(&self, a: usize, b: usize) -> TensorView<'a> {
        let mut v = self.clone();
        v.shape.swap(a, b);
        v.strides.swap(a, b);
        v
    }

    fn host_check(&self) -> Result<()> {
        if self.device != Device::Cpu {
            return Err(Error::Data(format!("host read of a tensor on {}", self.device)));
        }
        Ok(())
    }

    fn read<T>(&self, mut conv: impl FnMut(*const u8) -> T) -> Result<Vec<T>> {
        self.host_check()?;
        let mut out = Vec::with_capacity(self.numel());
        let size = self.dtype.size() as isize;
        // SAFETY: `from_raw`'s contract (or the owning Tensor) makes every offset the
        // shape and strides reach a valid element of this dtype.
        for_each_offset(&self.shape, &self.strides, |off| out.push(conv(unsafe { self.ptr.offset(off * size) })));
        Ok(out)
    }

    /// Logical-order values converted to f32 (host views only).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        // SAFETY (closures): `read` passes a pointer to one element of `self.dtype`.
        match self.dtype {
            DType::BF16 => self.read(|p| unsafe { (p as *const bf16).read_unaligned() }.to_f32()),
            DType::F32 => self.read(|p| unsafe { (p as *const f32).read_unaligned() }),
            DType::I32 => self.read(|p| unsafe { (p as *const i32).read_unaligned() } as f32),
            DType::I64 => self.read(|p| unsafe { (p as *const i64).read_unaligned() } as f32),
        }
    }

    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        match self.dtype {
            DType::BF16 => self.read(|p| unsafe { (p as *const bf16).read_unaligned() }.to_f64()),
            DType::F32 => self.read(|p| unsafe { (p as *const f32).read_unaligned() } as f64),
            DType::I32 => self.read(|p| unsafe { (p as *const i32).read_unaligned() } as f64),
            DType::I64 => self.read(|p| unsafe { (p as *const i64).read_unaligned() } as f64),
        }
    }

    /// Logical-order values as i64 (integer views; floats are truncated).
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        match self.dtype {
            DType::I32 => self.read(|p| unsafe { (p as *const i32).read_unaligned() } as i64),
            DType::I64 => self.read(|p| unsafe { (p as *const i64).read_unaligned() }),
            DType::BF16 => self.read(|p| unsafe { (p as *const bf16).read_unaligned() }.to_f32() as i64),
            DType::F32 => self.read(|p| unsafe { (p as *const f32).read_unaligned() } as i64),
        }
    }

    /// An owned contiguous host copy.
    pub fn to_tensor(&self) -> Result<Tensor> {
        let data = match self.dtype {
            DType::BF16 => HostData::BF16(self.read(|p| unsafe { (p as *const bf16).read_unaligned() })?),
            DType::F32 => HostData::F32(self.read(|p| unsafe { (p as *const f32).read_unaligned() })?),
            DType::I32 => HostData::I32(self.read(|p| unsafe { (p as *const i32).read_unaligned() })?),
            DType::I64 => HostData::I64(self.read(|p| unsafe { (p as *const i64).read_unaligned() })?),
        };
        Tensor::from_host(data, &self.shape)
    }
}

impl<'a> TensorViewMut<'a> {
    /// # Safety
    /// `ptr` must address memory of `device` valid for reads and writes of every element
    /// the shape and strides reach, for `'a`, with no other reader or writer meanwhile.
    pub unsafe fn from_raw(ptr: *mut u8, dtype: DType, shape: &[usize], strides: &[isize], device: Device) -> Self {
        TensorViewMut { ptr, dtype, shape: shape.to_vec(), strides: strides.to_vec(), device, _life: PhantomData }
    }

    view_common!();

    /// A read-only view of the same memory.
    pub fn as_view(&self) -> TensorView<'_> {
        TensorView { ptr: self.ptr, dtype: self.dtype, shape: self.shape.clone(), strides: self.strides.clone(), device: self.device, _life: PhantomData }
    }

    /// Write logical-order f32 values, converted to this view's dtype (bf16: round to
    /// nearest even). Host views only.
    pub fn write_f32(&mut self, data: &[f32]) -> Result<()> {
        if self.device != Device::Cpu {
            return Err(Error::Data(format!("host write to a tensor on {}", self.device)));
        }
        if data.len() != self.numel() {
            return Err(Error::Data(format!("write of {} values into a view of {} elements", data.len(), self.numel())));
        }
        let size = self.dtype.size() as isize;
        let mut it = data.iter();
        let (ptr, dtype) = (self.ptr, self.dtype);
        // SAFETY: `from_raw`'s contract (or the owning Tensor) makes every offset valid.
        for_each_offset(&self.shape, &self.strides, |off| {
            let x = *it.next().unwrap();
            unsafe {
                let p = ptr.offset(off * size);
                match dtype {
                    DType::BF16 => (p as *mut bf16).write_unaligned(bf16::from_f32(x)),
                    DType::F32 => (p as *mut f32).write_unaligned(x),
                    DType::I32 => (p as *mut i32).write_unaligned(x as i32),
                    DType::I64 => (p as *mut i64).write_unaligned(x as i64),
                }
            }
        });
        Ok(())
    }

    /// Write logical-order integers (integer views only).
    pub fn write_i64(&mut self, data: &[i64]) -> Result<()> {
        if self.device != Device::Cpu || !self.dtype.is_int() {
            return Err(Error::Data(format!("integer host write to a {} tensor on {}", self.dtype, self.device)));
        }
        if data.len() != self.numel() {
            return Err(Error::Data(format!("write of {} values into a view of {} elements", data.len(), self.numel())));
        }
        let size = self.dtype.size() as isize;
        let mut it = data.iter();
        let (ptr, dtype) = (self.ptr, self.dtype);
        for_each_offset(&self.shape, &self.strides, |off| {
            let x = *it.next().unwrap();
            // SAFETY: as in write_f32.
            unsafe {
                let p = ptr.offset(off * size);
                if dtype == DType::I32 {
                    (p as *mut i32).write_unaligned(x as i32)
                } else {
                    (p as *mut i64).write_unaligned(x)
                }
            }
        });
        Ok(())
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
