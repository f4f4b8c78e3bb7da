//! Fused Q RMSNorm + partial interleaved RoPE into token-major storage (SPEC.md section 5).

pub mod cases;
pub mod reference;

pub use reference::Dims;

use crate::backend::{alloc_output, common_device, select, BackendName};
use crate::check;
use crate::error::{Error, Result};
use crate::tensor::{DType, Device, Tensor, TensorView, TensorViewMut};

const OP: &str = "qnorm_rope";

#[derive(Clone, Debug)]
pub struct QNormRopeArgs<'a> {
    /// Logical `[B,H,S,C]`, any strides (typically a transposed `[B,S,H,C]`); bf16 or f32.
    pub x: TensorView<'a>,
    /// `[B,S,R]` f32; the first `R/2` entries hold the pair frequencies.
    pub cos: TensorView<'a>,
    /// `[B,S,R]` f32, cos's frequency order.
    pub sin: TensorView<'a>,
    /// `R`: trailing channels rotated, even, `<= C`.
    pub rotary: usize,
    pub eps: f32,
}

/// Strides of the token-major storage of a logical `[B,H,S,C]` tensor.
pub fn token_major_strides(b_h_s_c: [usize; 4]) -> [isize; 4] {
    let [_, h, s, c] = b_h_s_c.map(|v| v as isize);
    [s * h * c, c, h * c, 1]
}

impl QNormRopeArgs<'_> {
    pub fn validate(&self) -> Result<(Dims, Device)> {
        check::dtype(OP, "x", &self.x, check::FLOATS)?;
        check::shape(OP, "x", &self.x, "[B,H,S,C]", &[None; 4])?;
        let (b, h, s, c) = (self.x.shape()[0], self.x.shape()[1], self.x.shape()[2], self.x.shape()[3]);
        check::at_least(OP, "x.shape[3] (channels)", c, 1)?;
        if !self.rotary.is_multiple_of(2) || self.rotary > c {
            return Err(Error::value(OP, "rotary", format!("an even number <= C = {c}"), self.rotary));
        }
        check::positive(OP, "eps", self.eps as f64)?;
        for (name, t) in [("cos", &self.cos), ("sin", &self.sin)] {
            check::dtype(OP, name, t, &[DType::F32])?;
            check::shape(OP, name, t, "[B,S,R]", &[Some(b), Some(s), Some(self.rotary)])?;
        }
        let device = common_device(OP, &[("x", &self.x), ("cos", &self.cos), ("sin", &self.sin)])?;
        Ok((Dims { b, h, s, c, r: self.rotary }, device))
    }
}

fn out_shape(dm: Dims) -> [usize; 4] {
    [dm.b, dm.h, dm.s, dm.c]
}

/// Allocate a logical `[B,H,S,C]` tensor with token-major storage.
fn alloc_token_major(be: &dyn crate::backend::KernelBackend, dtype: DType, dm: Dims, device: Device) -> Result<Tensor> {
    let t = alloc_output(be, dtype, &[dm.b, dm.s, dm.h, dm.c], device)?;
    Ok(t.with_layout(&out_shape(dm), &token_major_strides(out_shape(dm))))
}

/// Forward: `(out logical [B,H,S,C] token-major in x's dtype, rstd [B*S*H] f32)`.
pub fn qnorm_rope(backend: BackendName, a: &QNormRopeArgs) -> Result<(Tensor, Tensor)> {
    let (dm, device) = a.validate()?;
    let be = select(backend, OP, device)?;
    let mut out = alloc_token_major(be, a.x.dtype(), dm, device)?;
    let mut rstd = alloc_output(be, DType::F32, &[dm.b * dm.s * dm.h], device)?;
    be.qnorm_rope_fwd(a, &mut out.view_mut(), &mut rstd.view_mut())?;
    Ok((out, rstd))
}

pub fn qnorm_rope_into(backend: BackendName, a: &QNormRopeArgs, out: &mut TensorViewMut, rstd: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = a.validate()?;
    check::output_on(OP, "out", out, device, a.x.dtype(), &out_shape(dm), Some(&token_major_strides(out_shape(dm))))?;
    check::output_on(OP, "rstd", rstd, device, DType::F32, &[dm.b * dm.s * dm.h], None)?;
    select(backend, OP, device)?.qnorm_rope_fwd(a, out, rstd)
}

fn validate_bwd(a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView) -> Result<(Dims, Device)> {
    let (dm, device) = a.validate()?;
    check::dtype(OP, "rstd", rstd, &[DType::F32])?;
    check::shape(OP, "rstd", rstd, "[B*S*H]", &[Some(dm.b * dm.s * dm.h)])?;
    check::dtype(OP, "grad", grad, check::FLOATS)?;
    check::shape(OP, "grad", grad, "[B,H,S,C]", &out_shape(dm).map(Some))?;
    common_device(OP, &[("x", &a.x), ("rstd", rstd), ("grad", grad)])?;
    Ok((dm, device))
}

/// Backward: `dx` logical `[B,H,S,C]`, token-major storage, x's dtype.
pub fn qnorm_rope_backward(backend: BackendName, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView) -> Result<Tensor> {
    let (dm, device) = validate_bwd(a, rstd, grad)?;
    let be = select(backend, OP, device)?;
    let mut dx = alloc_token_major(be, a.x.dtype(), dm, device)?;
    be.qnorm_rope_bwd(a, rstd, grad, &mut dx.view_mut())?;
    Ok(dx)
}

pub fn qnorm_rope_backward_into(backend: BackendName, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let (dm, device) = validate_bwd(a, rstd, grad)?;
    check::output_on(OP, "dx", dx, device, a.x.dtype(), &out_shape(dm), Some(&token_major_strides(out_shape(dm))))?;
    select(backend, OP, device)?.qnorm_rope_bwd(a, rstd, grad, dx)
}
