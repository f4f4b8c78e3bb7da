//! Sinkhorn normalisation on the GPU (SPEC.md section 4): launchers for
//! `kernels/sinkhorn/{fwd,bwd}.cu`.
//!
//! A group of `G = pow2ceil(n)` lanes holds one matrix (lane i = row i); `n` is a
//! compile-time define (1..=8). The backward recomputes the forward and keeps each step's
//! input in shared memory, `(2*repeat - 1) * n` floats per lane.

use dsv4_core::ops::sinkhorn::SinkhornArgs;
use dsv4_core::{Error, Result, TensorView, TensorViewMut};

use crate::runtime::Gpu;

const OP: &str = "sinkhorn_normalize";
const MAX_LEAD: usize = 6;

/// Mirrors `SinkhornLayout` (kernels/sinkhorn/sinkhorn.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SinkhornLayout {
    /// Leading dims, outermost first, padded with 1.
    pub lead_size: [i64; MAX_LEAD],
    /// Their strides (elements).
    pub lead_stride: [i64; MAX_LEAD],
    /// Stride of dim -2.
    pub row_stride: i64,
    /// Stride of dim -1.
    pub col_stride: i64,
}

/// Mirrors `SinkhornParams` (kernels/sinkhorn/sinkhorn.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SinkhornParams {
    /// `[..., n, n]` f32, strides in `x_layout`.
    pub x: u64,
    /// `[..., n, n]` f32, strides in `dout_layout`; backward only (0 forward).
    pub dout: u64,
    /// `[M, n, n]` f32 contiguous: y (forward) or dx (backward).
    pub out: u64,
    pub x_layout: SinkhornLayout,
    pub dout_layout: SinkhornLayout,
    /// `M`, the number of matrices.
    pub matrices: i64,
    pub repeat: i32,
    pub eps: f32,
}

const _: () = assert!(std::mem::size_of::<SinkhornLayout>() == 112);
const _: () = assert!(std::mem::size_of::<SinkhornParams>() == 264);

pub const PARAMS_SIZES: &[(&str, usize)] = &[("SinkhornLayout", 112), ("SinkhornParams", 264)];

/// Lanes per matrix for `n` (as `sinkhorn::G` in the header).
fn group(n: usize) -> usize {
    n.next_power_of_two()
}

/// The layout of a `[..., n, n]` view, its leading dims merged where the strides allow.
fn layout(v: &TensorView) -> Result<SinkhornLayout> {
    let nd = v.shape().len();
    let (shape, strides) = (v.shape(), v.strides());
    let mut dims: Vec<(i64, i64)> = Vec::new();
    for d in 0..nd - 2 {
        let (n, s) = (shape[d] as i64, strides[d] as i64);
        if n == 1 {
            continue;
        }
        match dims.last_mut() {
            // (outer size, outer stride) then (n, s): one dim when outer stride == n * s.
            Some(last) if last.1 == n * s => *last = (last.0 * n, s),
            _ => dims.push((n, s)),
        }
    }
    if dims.len() > MAX_LEAD {
        return Err(Error::Unavailable { backend: "cuda".into(), op: OP, reason: format!("the leading dimensions of a {shape:?} tensor with strides {strides:?} need {} strided dims; the kernel takes at most {MAX_LEAD}", dims.len()) });
    }
    let mut l = SinkhornLayout { lead_size: [1; MAX_LEAD], lead_stride: [0; MAX_LEAD], row_stride: strides[nd - 2] as i64, col_stride: strides[nd - 1] as i64 };
    let off = MAX_LEAD - dims.len();
    for (i, (n, s)) in dims.into_iter().enumerate() {
        l.lead_size[off + i] = n;
        l.lead_stride[off + i] = s;
    }
    Ok(l)
}

fn check_out(arg: &'static str, out: &TensorViewMut) -> Result<()> {
    if !out.is_contiguous() {
        return Err(Error::Layout { op: OP, arg, reason: "the CUDA kernels write a contiguous output".into() });
    }
    Ok(())
}

/// Blocks for a grid-stride sweep: enough to fill the device a few times over.
fn grid_for(gpu: &Gpu, matrices: usize, per_block: usize) -> u32 {
    let needed = matrices.div_ceil(per_block);
    needed.min(gpu.props().sm_count as usize * 16).max(1) as u32
}

pub fn forward(gpu: &Gpu, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()> {
    let (m, n, _) = a.validate()?;
    check_out("out", out)?;
    if m == 0 {
        return Ok(());
    }
    let k = gpu.kernel("sinkhorn/fwd.cu", "sinkhorn_fwd", &[("SINKHORN_N", n.to_string())])?;
    let p = SinkhornParams { x: a.x.address(), dout: 0, out: out.address(), x_layout: layout(&a.x)?, dout_layout: SinkhornLayout::default(), matrices: m as i64, repeat: a.repeat as i32, eps: a.eps };
    // 256 lanes: 256 / G matrices per block per sweep; the forward keeps nothing on chip.
    let lanes = 256usize;
    let grid = grid_for(gpu, m, lanes / group(n));
    // SAFETY: `x` is a validated `[..., n, n]` f32 view whose every element the layout
    // reaches lies in its allocation; `out` is contiguous f32 of x's shape (M*n*n
    // elements, checked above); the kernel is sinkhorn_fwd, which takes SinkhornParams.
    unsafe { k.launch([grid, 1, 1], [lanes as u32, 1, 1], 0, &p) }
}

/// Lanes per block for the backward, and its shared-memory bytes: the largest block
/// (256 down to 32 lanes) whose tape fits half an SM's shared memory, so two blocks can
/// be resident; None when even 32 lanes exceed the per-block limit.
pub fn backward_block(gpu: &Gpu, n: usize, repeat: usize) -> Option<(usize, usize)> {
    let per_lane = (2 * repeat - 1) * n * 4;
    let props = gpu.props();
    let budget = (props.max_shared_per_sm as usize / 2).min(props.max_shared_per_block_optin as usize);
    for lanes in [256usize, 128, 64, 32] {
        if lanes * per_lane <= budget {
            return Some((lanes, lanes * per_lane));
        }
    }
    (32 * per_lane <= props.max_shared_per_block_optin as usize).then_some((32, 32 * per_lane))
}

pub fn backward(gpu: &Gpu, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let (m, n, _) = a.validate()?;
    check_out("dx", dx)?;
    if m == 0 {
        return Ok(());
    }
    let Some((lanes, smem)) = backward_block(gpu, n, a.repeat) else {
        return Err(Error::Unavailable {
            backend: "cuda".into(),
            op: "sinkhorn_normalize_backward",
            reason: format!("repeat = {} with n = {n} needs {} bytes of on-chip tape per matrix row; 32 rows exceed the device's {} bytes of shared memory per block", a.repeat, (2 * a.repeat - 1) * n * 4, gpu.props().max_shared_per_block_optin),
        });
    };
    let k = gpu.kernel("sinkhorn/bwd.cu", "sinkhorn_bwd", &[("SINKHORN_N", n.to_string())])?;
    let p = SinkhornParams { x: a.x.address(), dout: dout.address(), out: dx.address(), x_layout: layout(&a.x)?, dout_layout: layout(dout)?, matrices: m as i64, repeat: a.repeat as i32, eps: a.eps };
    let grid = grid_for(gpu, m, lanes / group(n));
    // SAFETY: `x` and `dout` are validated `[..., n, n]` f32 views of one shape whose
    // layouts reach only their own elements; `dx` is contiguous f32 of that shape; the
    // dynamic shared memory is the tape size the kernel indexes ((2*repeat-1)*n floats per
    // lane), within the device limit (backward_block).
    unsafe { k.launch([grid, 1, 1], [lanes as u32, 1, 1], smem as u32, &p) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_core::{DType, Device};

    #[test]
    fn leading_dims_merge_when_contiguous() {
        let shape = [2usize, 3, 5, 4, 4];
        let strides = dsv4_core::tensor::contiguous_strides(&shape);
        // SAFETY: a layout-only view; nothing is dereferenced.
        let v = unsafe { TensorView::from_raw(std::ptr::null(), DType::F32, &shape, &strides, Device::Cuda(0)) };
        let l = layout(&v).unwrap();
        assert_eq!(l.lead_size, [1, 1, 1, 1, 1, 30]);
        assert_eq!(l.lead_stride[5], 16);
        assert_eq!((l.row_stride, l.col_stride), (4, 1));
        // Transposed last two dims, and a broken middle stride.
        let v2 = unsafe { TensorView::from_raw(std::ptr::null(), DType::F32, &[2, 3, 4, 4], &[100, 16, 1, 4], Device::Cuda(0)) };
        let l2 = layout(&v2).unwrap();
        assert_eq!(&l2.lead_size[4..], &[2, 3]);
        assert_eq!(&l2.lead_stride[4..], &[100, 16]);
        assert_eq!((l2.row_stride, l2.col_stride), (1, 4));
    }
}
