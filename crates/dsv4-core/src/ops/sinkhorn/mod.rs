//! Sinkhorn normalisation of the hyper-connection mixing matrices (SPEC.md section 4).

pub mod cases;
pub mod reference;

use crate::backend::{alloc_output, common_device, select, BackendName};
use crate::check;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

const OP: &str = "sinkhorn_normalize";

#[derive(Clone, Debug)]
pub struct SinkhornArgs<'a> {
    /// `[..., n, n]` f32, any strides.
    pub x: TensorView<'a>,
    /// `>= 1`: one column normalisation, then `repeat - 1` row + column rounds.
    pub repeat: usize,
    /// `> 0`, added to the softmax and to every denominator.
    pub eps: f32,
}

impl SinkhornArgs<'_> {
    /// Validate; returns `(matrices, n, device)`.
    pub fn validate(&self) -> Result<(usize, usize, Device)> {
        check::dtype(OP, "x", &self.x, &[DType::F32])?;
        let shape = self.x.shape();
        if shape.len() < 2 || shape[shape.len() - 1] != shape[shape.len() - 2] || shape[shape.len() - 1] == 0 {
            return Err(Error::Shape { op: OP, arg: "x", expected: "[..., n, n] with n >= 1".into(), got: shape.to_vec() });
        }
        check::at_least(OP, "repeat", self.repeat, 1)?;
        check::positive(OP, "eps", self.eps as f64)?;
        let n = shape[shape.len() - 1];
        Ok((self.x.numel() / (n * n), n, self.x.device()))
    }
}

pub fn sinkhorn_normalize(backend: BackendName, a: &SinkhornArgs) -> Result<Tensor> {
    let (_, _, device) = a.validate()?;
    let be = select(backend, OP, device)?;
    let mut out = alloc_output(be, DType::F32, a.x.shape(), device)?;
    be.sinkhorn_fwd(a, &mut out.view_mut())?;
    Ok(out)
}

pub fn sinkhorn_normalize_into(backend: BackendName, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()> {
    let (_, _, device) = a.validate()?;
    check::output_on(OP, "out", out, device, DType::F32, a.x.shape(), None)?;
    select(backend, OP, device)?.sinkhorn_fwd(a, out)
}

fn validate_bwd(a: &SinkhornArgs, dout: &TensorView) -> Result<Device> {
    let (_, _, device) = a.validate()?;
    check::dtype(OP, "dout", dout, &[DType::F32])?;
    if dout.shape() != a.x.shape() {
        return Err(Error::Shape { op: OP, arg: "dout", expected: format!("{:?} (x's shape)", a.x.shape()), got: dout.shape().to_vec() });
    }
    common_device(OP, &[("x", &a.x), ("dout", dout)])?;
    Ok(device)
}

/// Backward: `dx` (x's shape, f32) from `dout` (any strides), recomputing the forward.
pub fn sinkhorn_normalize_backward(backend: BackendName, a: &SinkhornArgs, dout: &TensorView) -> Result<Tensor> {
    let device = validate_bwd(a, dout)?;
    let be = select(backend, OP, device)?;
    let mut dx = alloc_output(be, DType::F32, a.x.shape(), device)?;
    be.sinkhorn_bwd(a, dout, &mut dx.view_mut())?;
    Ok(dx)
}

pub fn sinkhorn_normalize_backward_into(backend: BackendName, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let device = validate_bwd(a, dout)?;
    check::output_on(OP, "dx", dx, device, DType::F32, a.x.shape(), None)?;
    select(backend, OP, device)?.sinkhorn_bwd(a, dout, dx)
}
