//! Tensors as the Python layer hands them over: plain descriptors of caller memory
//! (torch tensors, numpy arrays), turned into core views without a copy.

use dsv4_core::{DType, Device, TensorView, TensorViewMut};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// `(data_ptr, dtype, shape, strides, device)` as built by `dsv4_kernels._tensors`:
/// `dtype` one of `bf16 f32 i32 i64` (anything else is the caller's dtype name, rejected
/// here), strides in elements, `device` -1 for host memory or a CUDA ordinal.
#[derive(Clone, Debug)]
pub struct Desc {
    ptr: u64,
    dtype: String,
    shape: Vec<usize>,
    strides: Vec<isize>,
    device: i64,
}

impl<'py> FromPyObject<'py> for Desc {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        let (ptr, dtype, shape, strides, device): (u64, String, Vec<usize>, Vec<isize>, i64) = ob.extract()?;
        Ok(Desc { ptr, dtype, shape, strides, device })
    }
}

/// An address that is never dereferenced: zero-element tensors may report a null pointer.
const EMPTY_ADDR: u64 = 64;

fn dtype_of(op: &str, arg: &str, name: &str) -> PyResult<DType> {
    match name {
        "bf16" => Ok(DType::BF16),
        "f32" => Ok(DType::F32),
        "i32" => Ok(DType::I32),
        "i64" => Ok(DType::I64),
        other => Err(PyTypeError::new_err(format!("{op}: argument `{arg}` has dtype {other}, which no kernel takes (expected bf16, f32, i32 or i64 as the operation documents)"))),
    }
}

impl Desc {
    fn checked(&self, op: &str, arg: &str) -> PyResult<(u64, DType, Device)> {
        let dtype = dtype_of(op, arg, &self.dtype)?;
        if self.shape.len() != self.strides.len() {
            return Err(PyValueError::new_err(format!("{op}: argument `{arg}`: shape {:?} and strides {:?} differ in rank", self.shape, self.strides)));
        }
        let device = match self.device {
            -1 => Device::Cpu,
            i if i >= 0 => Device::Cuda(i as usize),
            i => return Err(PyValueError::new_err(format!("{op}: argument `{arg}`: device index {i} is neither -1 (host) nor a CUDA ordinal"))),
        };
        let numel: usize = self.shape.iter().product();
        let ptr = match (self.ptr, numel) {
            (0, 0) => EMPTY_ADDR,
            (0, _) => return Err(PyValueError::new_err(format!("{op}: argument `{arg}` has a null data pointer and {numel} elements"))),
            (p, _) => p,
        };
        Ok((ptr, dtype, device))
    }

    /// A read-only view of the described memory.
    ///
    /// # Safety
    /// The descriptor must describe live memory of its device holding every element its
    /// shape and strides reach, kept alive and not written by anyone else while the view
    /// is used. `dsv4_kernels` builds descriptors from the tensors it holds for the whole
    /// call and never passes an output that overlaps an input.
    pub unsafe fn view(&self, op: &str, arg: &str) -> PyResult<TensorView<'_>> {
        let (ptr, dtype, device) = self.checked(op, arg)?;
        // SAFETY: forwarded from this function's contract.
        Ok(unsafe { TensorView::from_raw(ptr as usize as *const u8, dtype, &self.shape, &self.strides, device) })
    }

    /// A writable view of the described memory.
    ///
    /// # Safety
    /// As for [`Desc::view`], and no other view of the same memory may exist while this
    /// one is used.
    pub unsafe fn view_mut(&self, op: &str, arg: &str) -> PyResult<TensorViewMut<'_>> {
        let (ptr, dtype, device) = self.checked(op, arg)?;
        // SAFETY: forwarded from this function's contract.
        Ok(unsafe { TensorViewMut::from_raw(ptr as usize as *mut u8, dtype, &self.shape, &self.strides, device) })
    }
}
