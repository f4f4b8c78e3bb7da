//! Sinkhorn normalisation on the GPU (SPEC.md section 4): launchers for
//! `kernels/sinkhorn/{fwd,bwd}.cu`.
//!
//! One thread per matrix, the whole `n x n` matrix in registers; `n` is a compile-time
//! define (1..=8). float4 accesses where x (and dout) are contiguous and 16-byte aligned
//! (`SINKHORN_VEC`, `SINKHORN_DVEC`). The backward runs in f64: it recomputes the forward
//! and keeps a tape in shared memory: for n <= 6 a checkpoint of the scale factors every
//! [`SinkhornBwdConfig`] pairs of rounds, recomputed in the reverse; for n >= 7 each step's
//! `n` denominators, `(2*repeat - 1) * n` doubles per thread, plus the matrix itself (`n*n`
//! doubles). Inputs come validated by `dsv4-core` (`SinkhornArgs::validate`, the outputs'
//! shape and contiguity).

use dsv4_core::ops::sinkhorn::SinkhornArgs;
use dsv4_core::{Error, Result, TensorView, TensorViewMut};

use crate::kernel_config;
use crate::tuning::{configured, Variant};

use crate::runtime::Gpu;

const OP: &str = "sinkhorn_normalize";
const OP_BWD: &str = "sinkhorn_normalize_backward";
const MAX_LEAD: usize = 6;

/// Mirrors `SinkhornLayout` (kernels/sinkhorn/sinkhorn.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SinkhornLayout {
    /// Leading dims, outermost first, padded with 1.
    pub(crate) lead_size: [i64; MAX_LEAD],
    /// Their strides (elements).
    pub(crate) lead_stride: [i64; MAX_LEAD],
    /// Stride of dim -2.
    pub(crate) row_stride: i64,
    /// Stride of dim -1.
    pub(crate) col_stride: i64,
}

/// Mirrors `SinkhornParams` (kernels/sinkhorn/sinkhorn.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SinkhornParams {
    /// `[..., n, n]` f32, strides in `x_layout`.
    pub(crate) x: u64,
    /// `[..., n, n]` f32, strides in `dout_layout`; backward only (0 forward).
    pub(crate) dout: u64,
    /// `[M, n, n]` f32 contiguous: y (forward) or dx (backward).
    pub(crate) out: u64,
    pub(crate) x_layout: SinkhornLayout,
    pub(crate) dout_layout: SinkhornLayout,
    /// `M`, the number of matrices.
    pub(crate) matrices: i64,
    pub(crate) repeat: i32,
    pub(crate) eps: f32,
}

const _: () = assert!(std::mem::size_of::<SinkhornLayout>() == 112);
const _: () = assert!(std::mem::size_of::<SinkhornParams>() == 264);

pub(crate) const PARAMS_SIZES: &[(&str, usize)] = &[("SinkhornLayout", 112), ("SinkhornParams", 264)];

kernel_config! {
    /// `sinkhorn/fwd.cu`.
    pub struct SinkhornFwdConfig("sinkhorn_fwd") {
        /// Reciprocals per pair of rounds taken on the FMA pipe (`SINKHORN_FWD_NEWTON`; 0 when
        /// eps < [`FMA_RCP_MIN_EPS`]): 4, H200 1M matrices 0.0573 ms against 0.0627 with 0 and
        /// 0.0579 / 0.0587 / 0.0603 with 3 / 5 / 8 (DECISIONS.md, Sinkhorn; LOG.md v20).
        pub fma_rcps: u32 = 4,
    }
}

kernel_config! {
    /// `sinkhorn/bwd.cu`.
    pub struct SinkhornBwdConfig("sinkhorn_bwd") {
        /// (row, column) pairs per checkpoint of the n <= 5 tape (`SINKHORN_BWD_CKPT_PAIRS`):
        /// 4, H200 n = 4: 0.3477 ms at 1M matrices against 0.3570 with 3 and 0.3945 with 5
        /// (DECISIONS.md; LOG.md v8, v9).
        pub ckpt_pairs: u32 = 4,
        /// The same for n >= 6: 2, where 3 or more spill at n = 6 (255 registers).
        pub ckpt_pairs_n6: u32 = 2,
        /// Threads per block when nonzero (32, 64, 96 or 128, if its tape fits a block); 0 picks
        /// by shared memory ([`bwd_block`]): 64 then 32 for n <= 6 (v21: 0.3372 against 0.3398
        /// ms at 1M with 128), 128 down to 32 for n >= 7.
        pub threads: u32 = 0,
    }
}

/// Below this eps the forward takes every reciprocal from the MUFU (`fma_rcps` = 0): the
/// FMA-pipe reciprocal's bit-trick seed holds for denominators in [2^-125, 2^125], and the
/// steps' denominators stay within about [n eps, 1 / eps] (a column of K can be all eps, so
/// its factor reaches 1 / (n eps)), far inside that range for eps >= 1e-20.
const FMA_RCP_MIN_EPS: f32 = 1e-20;

/// What a launch's kernel variant depends on besides the config: n and the float4 paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    n: usize,
    /// x contiguous and 16-byte aligned, out 16-byte aligned, n*n a multiple of 4.
    vec: bool,
    /// dout contiguous and 16-byte aligned, n*n a multiple of 4 (backward).
    dvec: bool,
}

/// Whether `v` can take the float4 path: contiguous `[M, n, n]`, 16-byte aligned base,
/// `n*n` a multiple of 4.
fn vector_ok(n: usize, v: &TensorView) -> bool {
    (n * n).is_multiple_of(4) && v.is_contiguous() && v.address().is_multiple_of(16)
}

fn shape_of(n: usize, x: &TensorView, out: &TensorViewMut, dout: Option<&TensorView>) -> Shape {
    Shape { n, vec: vector_ok(n, x) && out.address().is_multiple_of(16), dvec: dout.is_some_and(|d| vector_ok(n, d)) }
}

/// The defines of `sinkhorn/fwd.cu` for a launch with this eps.
fn fwd_defines(cfg: &SinkhornFwdConfig, sh: Shape, eps: f32) -> Vec<(&'static str, String)> {
    let fma_rcps = if eps < FMA_RCP_MIN_EPS { 0 } else { cfg.fma_rcps };
    vec![("SINKHORN_N", sh.n.to_string()), ("SINKHORN_VEC", (sh.vec as u8).to_string()), ("SINKHORN_FWD_NEWTON", fma_rcps.to_string())]
}

/// `(row, column)` pairs per checkpoint of the backward's tape for n.
fn ckpt_pairs(cfg: &SinkhornBwdConfig, n: usize) -> usize {
    (if n >= 6 { cfg.ckpt_pairs_n6 } else { cfg.ckpt_pairs }).max(1) as usize
}

/// The defines of `sinkhorn/bwd.cu`.
fn bwd_defines(cfg: &SinkhornBwdConfig, sh: Shape) -> Vec<(&'static str, String)> {
    vec![
        ("SINKHORN_N", sh.n.to_string()),
        ("SINKHORN_VEC", (sh.vec as u8).to_string()),
        ("SINKHORN_DVEC", (sh.dvec as u8).to_string()),
        ("SINKHORN_BWD_CKPT_PAIRS", ckpt_pairs(cfg, sh.n).to_string()),
    ]
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

/// Threads per forward block (one matrix each; the kernel is bounded for 256).
const FWD_THREADS: usize = 128;

fn blocks(matrices: usize, threads: usize) -> u32 {
    matrices.div_ceil(threads).max(1) as u32
}

/// `(M, n)`: matrices and their size, from the validated `x`.
fn dims(a: &SinkhornArgs) -> (usize, usize) {
    let shape = a.x.shape();
    let n = shape[shape.len() - 1];
    (a.x.numel() / (n * n), n)
}

pub(crate) fn forward(gpu: &Gpu, a: &SinkhornArgs, out: &mut TensorViewMut) -> Result<()> {
    let (m, n) = dims(a);
    if m == 0 {
        return Ok(());
    }
    let cfg = configured::<SinkhornFwdConfig>()?;
    let k = gpu.kernel("sinkhorn/fwd.cu", "sinkhorn_fwd", &fwd_defines(&cfg, shape_of(n, &a.x, out, None), a.eps))?;
    let p = SinkhornParams { x: a.x.address(), dout: 0, out: out.address(), x_layout: layout(&a.x)?, dout_layout: SinkhornLayout::default(), matrices: m as i64, repeat: a.repeat as i32, eps: a.eps };
    // SAFETY: `x` is a validated `[..., n, n]` f32 view whose every element the layout
    // reaches lies in its allocation (float4 reads only when it is contiguous and 16-byte
    // aligned, vector_ok); `out` is contiguous f32 of x's shape (M*n*n elements, validated
    // by dsv4-core); one thread per matrix, threads past M return, 128 a block; the kernel is sinkhorn_fwd, which takes SinkhornParams.
    unsafe { k.launch([blocks(m, FWD_THREADS), 1, 1], [FWD_THREADS as u32, 1, 1], 0, &p) }
}

/// Shared-memory bytes the backward needs per thread (one matrix): for n <= 6 a
/// checkpoint of 2n doubles per group of `ckpt_pairs` (row, column) pairs; for n >= 7 n
/// doubles per step and the n*n matrix.
fn bwd_bytes_per_thread(cfg: &SinkhornBwdConfig, n: usize, repeat: usize) -> usize {
    if n <= 6 {
        8 * 2 * n * (repeat - 1).div_ceil(ckpt_pairs(cfg, n))
    } else {
        8 * ((2 * repeat - 1) * n + n * n)
    }
}

/// Threads per backward block, and its shared-memory bytes: `cfg.threads` when set and its
/// tape fits a block; else the largest block (n <= 6: 64 or 32 threads; n >= 7: 128 down to
/// 32) of which four fit an SM's shared memory; else 32 threads if that fits the per-block
/// limit; None when even 32 threads exceed it. `(max_shared_per_sm, max_shared_per_block)`
/// are the device's limits.
fn bwd_block(cfg: &SinkhornBwdConfig, (per_sm, per_block): (usize, usize), n: usize, repeat: usize) -> Option<(usize, usize)> {
    let per_thread = bwd_bytes_per_thread(cfg, n, repeat);
    let set = cfg.threads as usize;
    if [32, 64, 96, 128].contains(&set) && set * per_thread <= per_block {
        return Some((set, set * per_thread));
    }
    // Each resident block also costs 1 KiB of shared memory reserved by the driver.
    let budget = (per_sm / 4).saturating_sub(1024).min(per_block);
    let order: &[usize] = if n <= 6 { &[64, 32] } else { &[128, 64, 32] };
    for &threads in order {
        if threads * per_thread <= budget {
            return Some((threads, threads * per_thread));
        }
    }
    (32 * per_thread <= per_block).then_some((32, 32 * per_thread))
}

pub(crate) fn backward(gpu: &Gpu, a: &SinkhornArgs, dout: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let (m, n) = dims(a);
    if m == 0 {
        return Ok(());
    }
    let cfg = configured::<SinkhornBwdConfig>()?;
    let props = gpu.props();
    let per_block = props.max_shared_per_block_optin as usize;
    let Some((threads, smem)) = bwd_block(&cfg, (props.max_shared_per_sm as usize, per_block), n, a.repeat) else {
        let reason = format!("repeat = {} with n = {n} needs {} bytes of on-chip tape per matrix; 32 matrices exceed the device's {per_block} bytes of shared memory per block", a.repeat, bwd_bytes_per_thread(&cfg, n, a.repeat));
        return Err(Error::Unavailable { backend: "cuda".into(), op: OP_BWD, reason });
    };
    let k = gpu.kernel("sinkhorn/bwd.cu", "sinkhorn_bwd", &bwd_defines(&cfg, shape_of(n, &a.x, dx, Some(dout))))?;
    let p = SinkhornParams { x: a.x.address(), dout: dout.address(), out: dx.address(), x_layout: layout(&a.x)?, dout_layout: layout(dout)?, matrices: m as i64, repeat: a.repeat as i32, eps: a.eps };
    // SAFETY: `x` and `dout` are validated `[..., n, n]` f32 views of one shape whose
    // layouts reach only their own elements (float4 reads only of one that is contiguous
    // and 16-byte aligned, vector_ok); `dx` is contiguous f32 of that shape (dsv4-core); one
    // thread per matrix, threads past M return, at most 128 a block (the kernel's bound);
    // the dynamic shared memory is what the kernel indexes (n <= 6: 2n doubles per
    // checkpoint of the SINKHORN_BWD_CKPT_PAIRS it was built with, the same ckpt_pairs;
    // n >= 7: (2*repeat-1)*n + n*n doubles per thread), within the device limit (bwd_block).
    unsafe { k.launch([blocks(m, threads), 1, 1], [threads as u32, 1, 1], smem as u32, &p) }
}

/// The kernel variants the launchers select with the default configs: every n, the float4
/// paths n allows, and (n = 4) the eps that takes the forward's MUFU-only path.
pub fn compile_variants() -> Vec<Variant> {
    const ARCHS: &[&str] = &["sm_90a", "sm_80"];
    let (fwd, bwd) = (SinkhornFwdConfig::default(), SinkhornBwdConfig::default());
    let mut v = Vec::new();
    for n in 1..=8 {
        let vec_opts: &[bool] = if (n * n) % 4 == 0 { &[false, true] } else { &[false] };
        for &vec in vec_opts {
            let sh = Shape { n, vec, dvec: vec };
            v.push(Variant { path: "sinkhorn/fwd.cu", archs: ARCHS, defines: fwd_defines(&fwd, sh, 1e-6) });
            v.push(Variant { path: "sinkhorn/bwd.cu", archs: ARCHS, defines: bwd_defines(&bwd, sh) });
        }
    }
    let n4 = Shape { n: 4, vec: true, dvec: false };
    v.push(Variant { path: "sinkhorn/fwd.cu", archs: ARCHS, defines: fwd_defines(&fwd, n4, 1e-25) });
    v.push(Variant { path: "sinkhorn/bwd.cu", archs: ARCHS, defines: bwd_defines(&bwd, n4) });
    v.push(Variant { path: "sinkhorn/bwd.cu", archs: ARCHS, defines: bwd_defines(&bwd, Shape { n: 4, vec: false, dvec: true }) });
    v
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
        let c = SinkhornBwdConfig::default();
        // n <= 6: ceil((repeat - 1) / pairs) checkpoints of 2n doubles (pairs 4, 2 at n = 6).
        assert_eq!(bwd_bytes_per_thread(&c, 4, 20), 320);
        assert_eq!(bwd_bytes_per_thread(&c, 4, 21), 320);
        assert_eq!(bwd_bytes_per_thread(&c, 4, 22), 8 * 8 * 6);
        assert_eq!(bwd_bytes_per_thread(&c, 4, 1), 0);
        assert_eq!(bwd_bytes_per_thread(&c, 1, 2), 16);
        assert_eq!(bwd_bytes_per_thread(&c, 6, 20), 8 * 12 * 10);
        // n >= 7: n doubles per step and the matrix.
        assert_eq!(bwd_bytes_per_thread(&c, 8, 20), 8 * (39 * 8 + 64));
    }

    fn defs(v: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        v.iter().map(|(k, x)| (*k, x.to_string())).collect()
    }

    /// The defines are those the launcher passed before the typed configs (bb7d6e1: N,
    /// VEC and DVEC from `defines`, the forward's SINKHORN_FWD_NEWTON=0 below 1e-20 and its
    /// kernel default 4 otherwise, the backward's pairs 4 / 2 from `backward_ckpt_pairs`),
    /// less the forward's SINKHORN_DVEC=0 (the forward never reads dout).
    #[test]
    fn defines_match_the_previous_launcher() {
        let (f, b) = (SinkhornFwdConfig::default(), SinkhornBwdConfig::default());
        // NeMo's call: n = 4 (hc_mult), repeat 20, eps 1e-6, contiguous f32.
        let nemo = Shape { n: 4, vec: true, dvec: true };
        assert_eq!(fwd_defines(&f, nemo, 1e-6), defs(&[("SINKHORN_N", "4"), ("SINKHORN_VEC", "1"), ("SINKHORN_FWD_NEWTON", "4")]));
        assert_eq!(bwd_defines(&b, nemo), defs(&[("SINKHORN_N", "4"), ("SINKHORN_VEC", "1"), ("SINKHORN_DVEC", "1"), ("SINKHORN_BWD_CKPT_PAIRS", "4")]));
        // A small eps takes every reciprocal from the MUFU.
        assert_eq!(fwd_defines(&f, nemo, 1e-25)[2], ("SINKHORN_FWD_NEWTON", "0".to_string()));
        // Strided, odd and large n (the small GPU tests).
        let n6 = Shape { n: 6, vec: false, dvec: true };
        assert_eq!(bwd_defines(&b, n6), defs(&[("SINKHORN_N", "6"), ("SINKHORN_VEC", "0"), ("SINKHORN_DVEC", "1"), ("SINKHORN_BWD_CKPT_PAIRS", "2")]));
        assert_eq!(bwd_defines(&b, Shape { n: 5, vec: false, dvec: false })[3].1, "4");
        assert_eq!(bwd_defines(&b, Shape { n: 8, vec: true, dvec: true })[3].1, "2");
        assert_eq!(fwd_defines(&f, Shape { n: 7, vec: false, dvec: false }, 1e-6), defs(&[("SINKHORN_N", "7"), ("SINKHORN_VEC", "0"), ("SINKHORN_FWD_NEWTON", "4")]));
    }

    #[test]
    fn backward_blocks() {
        let c = SinkhornBwdConfig::default();
        // H100/H200: 228 KiB an SM, 227 KiB a block.
        let hopper = (228 << 10, 227 << 10);
        // n = 4, repeat 20: 320 bytes a thread, 64-thread blocks.
        assert_eq!(bwd_block(&c, hopper, 4, 20), Some((64, 64 * 320)));
        // n = 8, repeat 20: 3008 bytes a thread, no block of four an SM: 32 threads.
        assert_eq!(bwd_block(&c, hopper, 8, 20), Some((32, 32 * 3008)));
        // n = 8, repeat 1: 576 bytes a thread, 64 threads (128 exceed a quarter SM).
        assert_eq!(bwd_block(&c, hopper, 8, 1), Some((64, 64 * 576)));
        let set = SinkhornBwdConfig { threads: 128, ..c };
        assert_eq!(bwd_block(&set, hopper, 4, 20), Some((128, 128 * 320)));
        assert_eq!(bwd_block(&c, hopper, 8, 2000), None);
    }
}
