//! Borrowed, strided views of host or device memory, ours or a caller's, and their
//! logical-order element reads (converted to f32 / f64 / i64) and writes.

use std::marker::PhantomData;

use half::bf16;

use super::{contiguous_strides, DType, Device, HostData, Tensor};
use crate::error::{Error, Result};

/// A borrowed, strided, read-only view of host or device memory.
#[derive(Clone, Debug)]
pub struct TensorView<'a> {
    pub(super) ptr: *const u8,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    pub(super) strides: Vec<isize>,
    pub(super) device: Device,
    pub(super) _life: PhantomData<&'a [u8]>,
}

// SAFETY: a view is a pointer plus layout; the memory it names is only read, and the
// lifetime ties it to its owner. Device pointers are never dereferenced on the host.
unsafe impl Send for TensorView<'_> {}
unsafe impl Sync for TensorView<'_> {}

/// A borrowed, strided, writable view.
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    pub(super) ptr: *mut u8,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    pub(super) strides: Vec<isize>,
    pub(super) device: Device,
    pub(super) _life: PhantomData<&'a mut [u8]>,
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
