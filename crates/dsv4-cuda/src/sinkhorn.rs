//! Sinkhorn normalisation on the GPU (SPEC.md section 4): launchers for
//! `kernels/sinkhorn/{fwd,bwd}.cu`.
//!
//! One thread per matrix, the whole `n x n` matrix in registers; `n` is a compile-time
//! define (1..=8). float4 accesses where x (and dout) are contiguous and 16-byte aligned
//! (`SINKHORN_VEC`). The backward runs in f64: it recomputes the forward and keeps a tape
//! in shared memory: for n <= 6 a checkpoint of the scale factors every 3 (row, column)
//! pairs (2 at n = 6), recomputed in the reverse; for n >= 7 each step's `n` denominators,
//! `(2*repeat - 1) * n` doubles per thread, plus the matrix itself (`n*n` doubles).

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

/// Whether `v` can take the float4 path: contiguous `[M, n, n]`, 16-byte aligned base,
/// `n*n` a multiple of 4.
fn vector_ok(n: usize, v: &TensorView) -> bool {
    (n * n).is_multiple_of(4) && v.is_contiguous() && v.address().is_multiple_of(16)
}

/// Defines: n; float4 for x and out (`SINKHORN_VEC`, which needs out's base 16-byte
/// aligned too); float4 for dout (`SINKHORN_DVEC`, backward).
fn defines(n: usize, x: &TensorView, out: &TensorViewMut, dout: Option<&TensorView>) -> [(&'static str, String); 3] {
    let vec = vector_ok(n, x) && out.address().is_multiple_of(16);
    let dvec = dout.is_some_and(|d| vector_ok(n, d));
    [("SINKHORN_N", n.to_string()), ("SINKHORN_VEC", (vec as u8).to_string()), ("SINKHORN_DVEC", (dvec as u8).to_string())]
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

/// Threads per forward block (one matrix each).
const FWD_THREADS: usize = 128;

fn blocks(matrices: usize, threads: usize) -> u32 {
    matrices.div_ceil(threads).max(1) as u32
}

/// Below this eps the forward takes every reciprocal from the MUFU (`SINKHORN_FWD_NEWTON=0`):
/// the FMA-pipe reciprocal's bit-trick seed holds for denominators in [2^-125, 2^125], and
/// the steps' denominators stay within about [n eps, 1 / eps] (a column of K can be all eps,
/// so its factor reaches 1 / (n eps)), far inside that range for eps >= 1e-20.
const FMA_RCP_MIN_EPS: f32 = 1e-20;

pub fn forward(gpu: &Gpu, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()> {
    let (m, n, _) = a.validate()?;
    check_out("out", out)?;
    if m == 0 {
        return Ok(());
    }
    let mut defs = defines(n, &a.x, out, None).to_vec();
    if a.eps < FMA_RCP_MIN_EPS {
        defs.push(("SINKHORN_FWD_NEWTON", "0".into()));
    }
    let k = gpu.kernel("sinkhorn/fwd.cu", "sinkhorn_fwd", &defs)?;
    let p = SinkhornParams { x: a.x.address(), dout: 0, out: out.address(), x_layout: layout(&a.x)?, dout_layout: SinkhornLayout::default(), matrices: m as i64, repeat: a.repeat as i32, eps: a.eps };
    // SAFETY: `x` is a validated `[..., n, n]` f32 view whose every element the layout
    // reaches lies in its allocation (float4 reads only when it is contiguous and 16-byte
    // aligned, vector_ok); `out` is contiguous f32 of x's shape (M*n*n elements, checked
    // above); one thread per matrix, threads past M return; the kernel is sinkhorn_fwd,
    // which takes SinkhornParams.
    unsafe { k.launch([blocks(m, FWD_THREADS), 1, 1], [FWD_THREADS as u32, 1, 1], 0, &p) }
}

/// `(row, column)` pairs per checkpoint of the n <= 6 backward (`SINKHORN_BWD_CKPT_PAIRS`
/// in kernels/sinkhorn/bwd.cu): 4 (at n = 4 on the H200 0.0300 / 0.3477 ms at 65,536 / 1M
/// matrices against 0.0304 / 0.3570 with 3; no spills for n <= 5), or 2 at n = 6 where 3
/// spills (255 registers). `DSV4_EXTRA_DEFINES=SINKHORN_BWD_CKPT_PAIRS=P` (bench sweeps; the
/// kernel sees the same define) replaces it for every n <= 6.
fn backward_ckpt_pairs(n: usize) -> usize {
    let knob = crate::runtime::extra_define("SINKHORN_BWD_CKPT_PAIRS").and_then(|v| v.parse::<usize>().ok()).filter(|p| (1..=8).contains(p));
    match knob {
        Some(p) if n <= 6 => p,
        _ if n >= 6 => 2,
        _ => 4,
    }
}

/// Shared-memory bytes the backward needs per thread (one matrix): for n <= 6 a
/// checkpoint of 2n doubles per group of `backward_ckpt_pairs` (row, column) pairs; for
/// n >= 7 n doubles per step and the n*n matrix.
fn backward_bytes_per_thread(n: usize, repeat: usize) -> usize {
    if n <= 6 {
        8 * 2 * n * (repeat - 1).div_ceil(backward_ckpt_pairs(n))
    } else {
        8 * ((2 * repeat - 1) * n + n * n)
    }
}

/// Threads per backward block, and its shared-memory bytes: the largest block (n <= 6: 64
/// or 32 threads; n >= 7: 128 down to 32) of which four fit an SM's shared memory; else 32
/// threads if that fits the per-block limit; None when even 32 threads exceed it.
pub fn backward_block(gpu: &Gpu, n: usize, repeat: usize) -> Option<(usize, usize)> {
    let per_thread = backward_bytes_per_thread(n, repeat);
    let props = gpu.props();
    // Each resident block also costs 1 KiB of shared memory reserved by the driver.
    let budget = (props.max_shared_per_sm as usize / 4).saturating_sub(1024).min(props.max_shared_per_block_optin as usize);
    // `DSV4_EXTRA_DEFINES=SINKHORN_BWD_THREADS=T` (bench sweeps): T threads a block when
    // its tape fits the per-block limit (the kernel ignores the define).
    let knob = crate::runtime::extra_define("SINKHORN_BWD_THREADS").and_then(|v| v.parse::<usize>().ok()).filter(|t| [32, 64, 96, 128].contains(t));
    if let Some(t) = knob.filter(|t| t * per_thread <= props.max_shared_per_block_optin as usize) {
        return Some((t, t * per_thread));
    }
    // n <= 6 (one checkpointed tape a thread, register-bound: 3 blocks of 128 an SM at
    // n = 4): 64-thread blocks first (v21, H200 n = 4: 65,536 / 1M matrices 0.0296 / 0.3406
    // -> 0.0294 / 0.3398 ms; 32 threads measured the same at 1M, 0.0292-0.0297 at 65,536).
    let order: &[usize] = if n <= 6 { &[64, 32] } else { &[128, 64, 32] };
    for &threads in order {
        if threads * per_thread <= budget {
            return Some((threads, threads * per_thread));
        }
    }
    (32 * per_thread <= props.max_shared_per_block_optin as usize).then_some((32, 32 * per_thread))
}

pub fn backward(gpu: &Gpu, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let (m, n, _) = a.validate()?;
    check_out("dx", dx)?;
    if m == 0 {
        return Ok(());
    }
    let Some((threads, smem)) = backward_block(gpu, n, a.repeat) else {
        return Err(Error::Unavailable {
            backend: "cuda".into(),
            op: "sinkhorn_normalize_backward",
            reason: format!("repeat = {} with n = {n} needs {} bytes of on-chip tape per matrix; 32 matrices exceed the device's {} bytes of shared memory per block", a.repeat, backward_bytes_per_thread(n, a.repeat), gpu.props().max_shared_per_block_optin),
        });
    };
    let [dn, dv, dd] = defines(n, &a.x, dx, Some(dout));
    let k = gpu.kernel("sinkhorn/bwd.cu", "sinkhorn_bwd", &[dn, dv, dd, ("SINKHORN_BWD_CKPT_PAIRS", backward_ckpt_pairs(n).to_string())])?;
    let p = SinkhornParams { x: a.x.address(), dout: dout.address(), out: dx.address(), x_layout: layout(&a.x)?, dout_layout: layout(dout)?, matrices: m as i64, repeat: a.repeat as i32, eps: a.eps };
    // SAFETY: `x` and `dout` are validated `[..., n, n]` f32 views of one shape whose
    // layouts reach only their own elements (float4 reads only of one that is contiguous
    // and 16-byte aligned, vector_ok); `dx` is contiguous f32 of that shape; one thread
    // per matrix, threads past M return; the dynamic shared memory is what the kernel
    // indexes (n <= 6: 2n doubles per checkpoint of the SINKHORN_BWD_CKPT_PAIRS it was
    // built with, the same backward_ckpt_pairs; n >= 7: (2*repeat-1)*n + n*n doubles per
    // thread), within the device limit (backward_block).
    unsafe { k.launch([blocks(m, threads), 1, 1], [threads as u32, 1, 1], smem as u32, &p) }
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

    #[test]
    fn backward_tape_bytes() {
        // n <= 6: ceil((repeat - 1) / pairs) checkpoints of 2n doubles (pairs 4, 2 at n = 6).
        assert_eq!(backward_bytes_per_thread(4, 20), 320);
        assert_eq!(backward_bytes_per_thread(4, 21), 320);
        assert_eq!(backward_bytes_per_thread(4, 22), 8 * 8 * 6);
        assert_eq!(backward_bytes_per_thread(4, 1), 0);
        assert_eq!(backward_bytes_per_thread(1, 2), 16);
        assert_eq!(backward_bytes_per_thread(6, 20), 8 * 12 * 10);
        // n >= 7: n doubles per step and the matrix.
        assert_eq!(backward_bytes_per_thread(8, 20), 8 * (39 * 8 + 64));
    }
}

/// The kernel variants this family's launchers can select, rendered from their configs
/// (the kernel compile test builds these; see `tuning::compile_variants`). Files not yet
/// listed are compiled from their `// dsv4-test-defines:` lines.
pub fn compile_variants() -> Vec<crate::tuning::Variant> {
    Vec::new()
}
