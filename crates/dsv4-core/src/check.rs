//! Argument checks shared by every operation: each error names the argument, what was
//! expected and what came.

use crate::error::{Error, Result};
use crate::tensor::{DType, Device, TensorView, TensorViewMut};

/// `t` has rank `dims.len()` and every `Some(n)` dimension equals `n`. `spec` is the
/// shape as the docs write it (`"[B,S,H,D]"`), `dims` its values where known.
pub fn shape(op: &'static str, arg: &'static str, t: &TensorView, spec: &str, dims: &[Option<usize>]) -> Result<()> {
    let got = t.shape();
    let ok = got.len() == dims.len() && got.iter().zip(dims).all(|(&g, d)| d.is_none_or(|d| d == g));
    if ok {
        return Ok(());
    }
    let known: Vec<String> = dims.iter().map(|d| d.map_or("_".to_string(), |d| d.to_string())).collect();
    Err(Error::Shape { op, arg, expected: format!("{spec} = [{}]", known.join(", ")), got: got.to_vec() })
}

pub fn dtype(op: &'static str, arg: &'static str, t: &TensorView, allowed: &[DType]) -> Result<()> {
    if allowed.contains(&t.dtype()) {
        return Ok(());
    }
    let names: Vec<String> = allowed.iter().map(|d| d.to_string()).collect();
    Err(Error::DType { op, arg, expected: names.join(" or "), got: t.dtype() })
}

pub const FLOATS: &[DType] = &[DType::BF16, DType::F32];
pub const INTS: &[DType] = &[DType::I32, DType::I64];

/// An output view on the inputs' `device` (checked before anything is written, so a
/// backend never receives memory it cannot address), then as [`output`].
pub fn output_on(op: &'static str, arg: &'static str, t: &TensorViewMut, device: Device, want_dtype: DType, want_shape: &[usize], strides: Option<&[isize]>) -> Result<()> {
    if t.device() != device {
        return Err(Error::Device { op, arg, expected: format!("{device} (the device of the inputs)"), got: t.device() });
    }
    output(op, arg, t, want_dtype, want_shape, strides)
}

/// An output view: exactly this dtype and shape, and row-major contiguous unless
/// `strides` gives the required layout.
pub fn output(op: &'static str, arg: &'static str, t: &TensorViewMut, want_dtype: DType, want_shape: &[usize], strides: Option<&[isize]>) -> Result<()> {
    let v = t.as_view();
    if v.dtype() != want_dtype {
        return Err(Error::DType { op, arg, expected: want_dtype.to_string(), got: v.dtype() });
    }
    if v.shape() != want_shape {
        return Err(Error::Shape { op, arg, expected: format!("{want_shape:?}"), got: v.shape().to_vec() });
    }
    let layout_ok = match strides {
        None => v.is_contiguous(),
        Some(s) => v.shape().iter().zip(v.strides().iter().zip(s)).all(|(&n, (&a, &b))| n <= 1 || a == b),
    };
    if !layout_ok {
        return Err(Error::Layout {
            op,
            arg,
            reason: format!("output strides {:?} must be {:?}", v.strides(), strides.map(|s| s.to_vec()).unwrap_or_else(|| crate::tensor::contiguous_strides(want_shape))),
        });
    }
    Ok(())
}

pub fn finite(op: &'static str, arg: &'static str, x: f64) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Error::value(op, arg, "a finite number", x))
    }
}

pub fn positive(op: &'static str, arg: &'static str, x: f64) -> Result<()> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(Error::value(op, arg, "a finite number > 0", x))
    }
}

pub fn at_least(op: &'static str, arg: &'static str, x: usize, min: usize) -> Result<()> {
    if x >= min {
        Ok(())
    } else {
        Err(Error::value(op, arg, format!(">= {min}"), x))
    }
}
