//! Q RMSNorm + partial interleaved RoPE on the GPU (SPEC.md section 5): launchers for
//! `kernels/qnorm_rope/{fwd,bwd}.cu`.
//!
//! Fast kernels where x (and grad) are bf16 with unit channel stride and 16-byte aligned
//! rows, and the output is 16-byte aligned: a group of lanes per row holding the row in
//! registers, several rows in flight (`*_fast`, shapes decided here as compile-time
//! defines). Otherwise the generic kernels: one warp per `(b, s, h)` row, staged in shared
//! memory, 16-byte vector accesses where the layout allows.

use dsv4_core::ops::qnorm_rope::{token_major_strides, Dims, QNormRopeArgs};
use dsv4_core::{DType, Error, Result, TensorView, TensorViewMut};

use crate::runtime::Gpu;

const OP: &str = "qnorm_rope";

/// Mirrors `QNormRopeParams` (kernels/qnorm_rope/qnorm_rope.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QNormRopeParams {
    /// Logical `[B,H,S,C]`, x's dtype, strides `x_stride`.
    pub x: u64,
    /// `[B,S,R]` f32, strides `cos_stride`.
    pub cos: u64,
    /// `[B,S,R]` f32, strides `sin_stride`.
    pub sin: u64,
    /// Backward: logical `[B,H,S,C]`, strides `g_stride`; 0 forward.
    pub grad: u64,
    /// Backward: `[B*S*H]` f32 token-major; 0 forward.
    pub rstd_in: u64,
    /// `[B,S,H,C]` contiguous token-major, x's dtype.
    pub out: u64,
    /// Forward: `[B*S*H]` f32 token-major; 0 backward.
    pub rstd_out: u64,
    pub x_stride: [i64; 4],
    pub g_stride: [i64; 4],
    pub cos_stride: [i64; 3],
    pub sin_stride: [i64; 3],
    pub b: i64,
    pub h: i64,
    pub s: i64,
    pub c: i64,
    pub r: i64,
    pub eps: f32,
    pub pad: i32,
}

const _: () = assert!(std::mem::size_of::<QNormRopeParams>() == 216);

pub const PARAMS_SIZES: &[(&str, usize)] = &[("QNormRopeParams", 216)];

fn strides<const N: usize>(v: &TensorView) -> [i64; N] {
    std::array::from_fn(|i| v.strides()[i] as i64)
}

/// Elements per access for a logical `[B,H,S,C]` view: 16 bytes' worth when the channel
/// stride is 1, C is a multiple of it, and every row start is 16-byte aligned.
fn vector_width(v: &TensorView) -> usize {
    let esz = v.dtype().size();
    let vec = 16 / esz;
    let st = v.strides();
    let aligned = v.address().is_multiple_of(16) && st[..3].iter().zip(v.shape()).all(|(&s, &n)| n <= 1 || (s as i64 * esz as i64) % 16 == 0);
    if st[3] == 1 && v.shape()[3].is_multiple_of(vec) && aligned {
        vec
    } else {
        1
    }
}

/// Output vector width: the output is contiguous token-major, so only its base and C matter.
fn out_vector_width(out: &TensorViewMut) -> usize {
    let vec = 16 / out.dtype().size();
    if out.address().is_multiple_of(16) && out.shape()[3].is_multiple_of(vec) {
        vec
    } else {
        1
    }
}

fn check_token_major(arg: &'static str, t: &TensorViewMut) -> Result<()> {
    let sh = t.shape();
    let want = token_major_strides([sh[0], sh[1], sh[2], sh[3]]);
    let ok = sh.iter().zip(t.strides().iter().zip(&want)).all(|(&n, (&s, &w))| n <= 1 || s == w);
    if !ok {
        return Err(Error::Layout { op: OP, arg, reason: format!("the CUDA kernels write token-major storage (strides {want:?}); got strides {:?}", t.strides()) });
    }
    Ok(())
}

/// Warps per block: up to 8, as many as fit `bufs` rows of C floats each in half an SM's
/// shared memory; None when one warp's rows exceed the per-block limit.
fn warps_per_block(gpu: &Gpu, c: usize, bufs: usize) -> Option<(usize, usize)> {
    let per_warp = bufs * c * 4;
    let props = gpu.props();
    let budget = (props.max_shared_per_sm as usize / 2).min(props.max_shared_per_block_optin as usize);
    let warps = (budget / per_warp.max(1)).min(8);
    if warps >= 1 {
        return Some((warps, warps * per_warp));
    }
    (per_warp <= props.max_shared_per_block_optin as usize).then_some((1, per_warp))
}

fn too_wide(op: &'static str, gpu: &Gpu, c: usize, bufs: usize) -> Error {
    Error::Unavailable { backend: "cuda".into(), op, reason: format!("C = {c} channels need {} bytes of shared memory per row; the device allows {} per block", bufs * c * 4, gpu.props().max_shared_per_block_optin) }
}

fn is_bf16(t: DType) -> &'static str {
    if t == DType::BF16 {
        "1"
    } else {
        "0"
    }
}

/// Threads per block of the fast kernels.
const FAST_THREADS: usize = 256;

/// The fast kernels' shape for C channels: (lanes per row, 16-byte chunks per lane, rows per
/// lane group in flight); None when C is not a multiple of 8 or exceeds 1024. The backward
/// holds x and grad, and prefetches the next rows, so it takes half the rows at a time.
fn fast_shape(c: usize, backward: bool) -> Option<(usize, usize, usize)> {
    if c == 0 || !c.is_multiple_of(8) {
        return None;
    }
    let chunks = c / 8;
    let lpr = chunks.next_power_of_two().min(32);
    let cpl = chunks.div_ceil(lpr);
    let u = if cpl <= 2 && !backward { 2 } else { 1 };
    (cpl <= 4).then_some((lpr, cpl, u))
}

/// Whether cos and sin allow one float4 per chunk (`QR_CS_VEC`): unit r stride, 16-byte
/// aligned `(b, s)` rows, and C - R a multiple of 8 (so a chunk is rotated whole or not).
fn cos_sin_vec(a: &QNormRopeArgs, c: usize, r: usize) -> bool {
    let ok = |v: &TensorView| {
        let (sh, st) = (v.shape(), v.strides());
        v.address().is_multiple_of(16) && st[2] == 1 && (0..2).all(|d| sh[d] <= 1 || st[d] % 4 == 0)
    };
    (c - r).is_multiple_of(8) && ok(&a.cos) && ok(&a.sin)
}

fn fast_defines(shape: (usize, usize, usize), cs_vec: bool) -> [(&'static str, String); 4] {
    [("QR_LPR", shape.0.to_string()), ("QR_CPL", shape.1.to_string()), ("QR_U", shape.2.to_string()), ("QR_CS_VEC", (cs_vec as u8).to_string())]
}

/// Resident 256-thread blocks per SM the fast kernels' registers are sized for: mirrors
/// QR_FWD_MINB / QR_BWD_MINB (kernels/qnorm_rope/qnorm_rope.cuh).
fn fast_min_blocks((_, cpl, u): (usize, usize, usize), backward: bool, cs_vec: bool) -> usize {
    match (backward, cpl * u) {
        (false, w) if w <= 4 && cs_vec => 3,
        (false, _) => 2,
        (true, w) if w <= 2 => {
            if cs_vec {
                3
            } else {
                2
            }
        }
        (true, _) => 1,
    }
}

/// The fast kernels are persistent: one wave of resident blocks (SMs x blocks per SM), fewer
/// when the rows need fewer.
fn fast_grid(gpu: &Gpu, rows: usize, shape: (usize, usize, usize), backward: bool, cs_vec: bool) -> u32 {
    let (lpr, _, u) = shape;
    let needed = rows.div_ceil(u).div_ceil(FAST_THREADS / lpr);
    let wave = gpu.props().sm_count as usize * fast_min_blocks(shape, backward, cs_vec);
    needed.min(wave).max(1) as u32
}

/// An experimental variant of the fast kernels (qnorm_rope.cuh: `DSV4_QNORM_FWD_VARIANT`,
/// `DSV4_QNORM_BWD_VARIANT`, ring depth `QR_STAGES`) as `DSV4_EXTRA_DEFINES` sets it: the
/// kernels see the same define, the launcher sizes their grid and shared memory from it;
/// `default` when absent or not a number.
fn extra_define(name: &str, default: usize) -> usize {
    crate::runtime::extra_define(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Resident blocks per SM of a ring variant: what its registers are sized for
/// (QR_RING_FWD_MINB / QR_RING_BWD_MINB), bounded by its dynamic shared memory (1 KiB a
/// block reserved by the driver).
fn ring_grid(gpu: &Gpu, rows: usize, (lpr, cpl, u): (usize, usize, usize), smem: usize, backward: bool) -> u32 {
    let by_regs = if backward && cpl * u > 2 { 2 } else { 3 };
    let per_sm = (gpu.props().max_shared_per_sm as usize / (smem + 1024)).clamp(1, by_regs);
    let needed = rows.div_ceil(u).div_ceil(FAST_THREADS / lpr);
    needed.min(gpu.props().sm_count as usize * per_sm).max(1) as u32
}

/// Dynamic shared memory of a ring variant: `bulk` = the bulk-copy layout (mbarriers, then
/// whole rows per lane group), else the cp.async layout (16-byte slots per lane); `tensors`
/// rows a stage row (x; or x and grad), `rstd` adds the backward's per-lane rstd slots.
fn ring_smem((lpr, cpl, u): (usize, usize, usize), c: usize, stages: usize, bulk: bool, tensors: usize, rstd: bool) -> usize {
    let warps = FAST_THREADS / 32;
    let rows = if bulk {
        let groups = FAST_THREADS / lpr;
        (groups * stages * 8).next_multiple_of(128) + groups * stages * u * tensors * c * 2
    } else {
        warps * stages * u * tensors * cpl * 32 * 16
    };
    rows + if rstd { warps * stages * u * 32 * 4 } else { 0 }
}

fn grid_for(gpu: &Gpu, rows: usize, warps: usize) -> u32 {
    rows.div_ceil(warps).min(gpu.props().sm_count as usize * 32).max(1) as u32
}

/// The params both directions share: inputs, sizes and eps; the direction's own
/// pointers (out/rstd forward; grad/rstd/dx backward) are set by the caller.
fn base_params(a: &QNormRopeArgs, dm: Dims) -> QNormRopeParams {
    QNormRopeParams {
        x: a.x.address(),
        cos: a.cos.address(),
        sin: a.sin.address(),
        grad: 0,
        rstd_in: 0,
        out: 0,
        rstd_out: 0,
        x_stride: strides(&a.x),
        g_stride: [0; 4],
        cos_stride: strides(&a.cos),
        sin_stride: strides(&a.sin),
        b: dm.b as i64,
        h: dm.h as i64,
        s: dm.s as i64,
        c: dm.c as i64,
        r: dm.r as i64,
        eps: a.eps,
        pad: 0,
    }
}

pub fn forward(gpu: &Gpu, a: &QNormRopeArgs, out: &mut TensorViewMut, rstd: &mut TensorViewMut) -> Result<()> {
    let (dm, _) = a.validate()?;
    check_token_major("out", out)?;
    if !rstd.is_contiguous() {
        return Err(Error::Layout { op: OP, arg: "rstd", reason: "the CUDA kernels write a contiguous rstd".into() });
    }
    let rows = dm.b * dm.s * dm.h;
    if rows == 0 {
        return Ok(());
    }
    let defines = [("QR_X_BF16", is_bf16(a.x.dtype()).to_string()), ("QR_X_VEC", vector_width(&a.x).to_string()), ("QR_O_VEC", out_vector_width(out).to_string())];
    let fast = fast_shape(dm.c, false).filter(|_| a.x.dtype() == DType::BF16 && vector_width(&a.x) == 8 && out_vector_width(out) == 8);
    let p = QNormRopeParams { out: out.address(), rstd_out: rstd.address(), ..base_params(a, dm) };
    if let Some(shape) = fast {
        let mut d = defines.to_vec();
        let cs_vec = cos_sin_vec(a, dm.c, dm.r);
        d.extend(fast_defines(shape, cs_vec));
        // Experimental variants (qnorm_rope.cuh); 0, the default, launches as before.
        let variant = extra_define("DSV4_QNORM_FWD_VARIANT", 0);
        if variant != 0 {
            let shape = if variant == 2 { (shape.0, shape.1, (8 / shape.1).clamp(1, 4)) } else { shape };
            let mut d = defines.to_vec();
            d.extend(fast_defines(shape, cs_vec));
            let k = gpu.kernel("qnorm_rope/fwd.cu", "qnorm_rope_fwd_fast", &d)?;
            let (grid, smem) = if variant <= 2 {
                (rows.div_ceil(shape.2).div_ceil(FAST_THREADS / shape.0).max(1) as u32, 0)
            } else {
                let bulk = variant == 4 && gpu.props().arch == "sm_90a";
                let smem = ring_smem(shape, dm.c, extra_define("QR_STAGES", 4), bulk, 1, false);
                (ring_grid(gpu, rows, shape, smem, false), smem)
            };
            // SAFETY: as for the default launch below (same checks, same params); the ring
            // variants index `smem` bytes of dynamic shared memory, sized by ring_smem for
            // the kernel's layout (QR_STAGES as the kernel sees it); bulk copies move whole
            // rows of C * 2 bytes (a multiple of 16) from 16-byte aligned row starts.
            return unsafe { k.launch([grid, 1, 1], [FAST_THREADS as u32, 1, 1], smem as u32, &p) };
        }
        let k = gpu.kernel("qnorm_rope/fwd.cu", "qnorm_rope_fwd_fast", &d)?;
        // SAFETY: x is bf16 with unit channel stride and 16-byte aligned rows, C a multiple
        // of 8 (vector_width, fast_shape): each 16-byte load lies in a row; cos and sin are
        // validated [B,S,R] views; out is token-major [B,S,H,C] bf16 with a 16-byte
        // aligned base (out_vector_width) and rstd contiguous [B*S*H] f32 (checked above);
        // float4 reads of cos/sin only where cos_sin_vec checked unit r stride, 16-byte
        // aligned rows and C - R a multiple of 8; the kernel guards rows >= B*S*H (its
        // persistent loop's prefetch past the end included) and chunks >= C.
        return unsafe { k.launch([fast_grid(gpu, rows, shape, false, cs_vec), 1, 1], [FAST_THREADS as u32, 1, 1], 0, &p) };
    }
    let Some((warps, smem)) = warps_per_block(gpu, dm.c, 1) else { return Err(too_wide(OP, gpu, dm.c, 1)) };
    let k = gpu.kernel("qnorm_rope/fwd.cu", "qnorm_rope_fwd", &defines)?;
    // SAFETY: x, cos and sin are validated views ([B,H,S,C] / [B,S,R]) whose strides reach
    // only their own elements, and 16-byte accesses are enabled only where alignment and
    // unit channel stride were checked (vector_width); out is token-major [B,S,H,C] of x's
    // dtype and rstd contiguous [B*S*H] f32 (checked above); the shared memory holds C
    // floats per warp as the kernel indexes.
    unsafe { k.launch([grid_for(gpu, rows, warps), 1, 1], [32 * warps as u32, 1, 1], smem as u32, &p) }
}

pub fn backward(gpu: &Gpu, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let (dm, _) = a.validate()?;
    check_token_major("dx", dx)?;
    if !rstd.is_contiguous() {
        return Err(Error::Layout { op: "qnorm_rope_backward", arg: "rstd", reason: "the CUDA kernels read a contiguous rstd".into() });
    }
    let rows = dm.b * dm.s * dm.h;
    if rows == 0 {
        return Ok(());
    }
    let defines = [
        ("QR_X_BF16", is_bf16(a.x.dtype()).to_string()),
        ("QR_G_BF16", is_bf16(grad.dtype()).to_string()),
        ("QR_X_VEC", vector_width(&a.x).to_string()),
        ("QR_G_VEC", vector_width(grad).to_string()),
        ("QR_O_VEC", out_vector_width(dx).to_string()),
    ];
    let fast = fast_shape(dm.c, true).filter(|_| a.x.dtype() == DType::BF16 && grad.dtype() == DType::BF16 && vector_width(&a.x) == 8 && vector_width(grad) == 8 && out_vector_width(dx) == 8);
    let p = QNormRopeParams { grad: grad.address(), rstd_in: rstd.address(), out: dx.address(), g_stride: strides(grad), ..base_params(a, dm) };
    if let Some(shape) = fast {
        let mut d = defines.to_vec();
        let cs_vec = cos_sin_vec(a, dm.c, dm.r);
        d.extend(fast_defines(shape, cs_vec));
        // Experimental variants (qnorm_rope.cuh); 0, the default, launches as before.
        let variant = extra_define("DSV4_QNORM_BWD_VARIANT", 0);
        if variant != 0 {
            let k = gpu.kernel("qnorm_rope/bwd.cu", "qnorm_rope_bwd_fast", &d)?;
            let bulk = variant == 2 && gpu.props().arch == "sm_90a";
            let smem = ring_smem(shape, dm.c, extra_define("QR_STAGES", 4), bulk, 2, true);
            // SAFETY: as for the default launch below; the kernel indexes `smem` bytes of
            // dynamic shared memory, sized by ring_smem for its layout; bulk copies move
            // whole rows of C * 2 bytes from 16-byte aligned row starts.
            return unsafe { k.launch([ring_grid(gpu, rows, shape, smem, true), 1, 1], [FAST_THREADS as u32, 1, 1], smem as u32, &p) };
        }
        let k = gpu.kernel("qnorm_rope/bwd.cu", "qnorm_rope_bwd_fast", &d)?;
        // SAFETY: as in `forward`'s fast path, for x and grad (both bf16, unit channel
        // stride, 16-byte aligned rows, checked by vector_width); rstd contiguous [B*S*H]
        // f32; dx token-major bf16 with a 16-byte aligned base; the kernel guards rows >=
        // B*S*H (prefetch included) and chunks >= C; cos/sin as in `forward`.
        return unsafe { k.launch([fast_grid(gpu, rows, shape, true, cs_vec), 1, 1], [FAST_THREADS as u32, 1, 1], 0, &p) };
    }
    let Some((warps, smem)) = warps_per_block(gpu, dm.c, 2) else { return Err(too_wide("qnorm_rope_backward", gpu, dm.c, 2)) };
    let k = gpu.kernel("qnorm_rope/bwd.cu", "qnorm_rope_bwd", &defines)?;
    // SAFETY: as in `forward`; grad is a validated logical [B,H,S,C] view (vector access
    // only where checked), rstd contiguous [B*S*H] f32, dx token-major of x's dtype; the
    // shared memory holds 2*C floats per warp as the kernel indexes.
    unsafe { k.launch([grid_for(gpu, rows, warps), 1, 1], [32 * warps as u32, 1, 1], smem as u32, &p) }
}
