//! Q RMSNorm + partial interleaved RoPE on the GPU (SPEC.md section 5): launchers for
//! `kernels/qnorm_rope/{fwd,bwd}.cu`.
//!
//! Fast kernels where x (and grad) are bf16 with unit channel stride and 16-byte aligned
//! rows, and the output is 16-byte aligned: a group of lanes per row, several rows in
//! flight (`*_fast`, shapes decided here as compile-time defines); the forward holds its
//! rows in registers, a grid of every row block; the backward is persistent, its rows
//! streamed through a shared-memory ring. Otherwise the generic kernels: one warp per
//! `(b, s, h)` row, staged in shared memory, 16-byte vector accesses where the layout
//! allows.

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
/// row block of a lane group); None when C is not a multiple of 8 or exceeds 1024. The
/// forward loads a whole row block into registers before using it: 8 / cpl rows, 1 to 4
/// (4 at C = 512: 128 bytes a thread in flight); the backward takes one row at a time
/// through its shared-memory ring.
fn fast_shape(c: usize, backward: bool) -> Option<(usize, usize, usize)> {
    if c == 0 || !c.is_multiple_of(8) {
        return None;
    }
    let chunks = c / 8;
    let lpr = chunks.next_power_of_two().min(32);
    let cpl = chunks.div_ceil(lpr);
    let u = if backward { 1 } else { (8 / cpl).clamp(1, 4) };
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

/// The fast forward's grid: one lane group per row block, every block (not persistent).
fn fast_fwd_grid(rows: usize, (lpr, _, u): (usize, usize, usize)) -> u32 {
    rows.div_ceil(u).div_ceil(FAST_THREADS / lpr).max(1) as u32
}

/// The fast backward's ring depth, `QR_STAGES` (qnorm_rope.cuh, default 4): a tuning knob
/// `DSV4_EXTRA_DEFINES` may set; the kernel sees the same define, the launcher sizes the
/// shared memory from it.
fn ring_stages() -> usize {
    crate::runtime::extra_define("QR_STAGES").and_then(|v| v.parse().ok()).unwrap_or(4)
}

/// The fast backward is persistent: one wave of resident blocks, fewer when the rows need
/// fewer. Blocks per SM: what its registers are sized for (QR_BWD_MINB), bounded by its
/// dynamic shared memory (1 KiB a block reserved by the driver).
fn ring_grid(gpu: &Gpu, rows: usize, (lpr, cpl, u): (usize, usize, usize), smem: usize) -> u32 {
    let by_regs = if cpl * u > 2 { 2 } else { 3 };
    let per_sm = (gpu.props().max_shared_per_sm as usize / (smem + 1024)).clamp(1, by_regs);
    let needed = rows.div_ceil(u).div_ceil(FAST_THREADS / lpr);
    needed.min(gpu.props().sm_count as usize * per_sm).max(1) as u32
}

/// Dynamic shared memory of the fast backward's ring: 16-byte slots per lane for x and grad,
/// `[warps][stages][u][x, grad][cpl][32 lanes]`, then rstd `[warps][stages][u][32 lanes]` f32.
fn ring_smem((_, cpl, u): (usize, usize, usize), stages: usize) -> usize {
    let warps = FAST_THREADS / 32;
    warps * stages * u * 2 * cpl * 32 * 16 + warps * stages * u * 32 * 4
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
        let k = gpu.kernel("qnorm_rope/fwd.cu", "qnorm_rope_fwd_fast", &d)?;
        // SAFETY: x is bf16 with unit channel stride and 16-byte aligned rows, C a multiple
        // of 8 (vector_width, fast_shape): each 16-byte load lies in a row; cos and sin are
        // validated [B,S,R] views; out is token-major [B,S,H,C] bf16 with a 16-byte
        // aligned base (out_vector_width) and rstd contiguous [B*S*H] f32 (checked above);
        // float4 reads of cos/sin only where cos_sin_vec checked unit r stride, 16-byte
        // aligned rows and C - R a multiple of 8; the kernel guards rows >= B*S*H and
        // chunks >= C.
        return unsafe { k.launch([fast_fwd_grid(rows, shape), 1, 1], [FAST_THREADS as u32, 1, 1], 0, &p) };
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
        let k = gpu.kernel("qnorm_rope/bwd.cu", "qnorm_rope_bwd_fast", &d)?;
        let smem = ring_smem(shape, ring_stages());
        // SAFETY: as in `forward`'s fast path, for x and grad (both bf16, unit channel
        // stride, 16-byte aligned rows, checked by vector_width); rstd contiguous [B*S*H]
        // f32; dx token-major bf16 with a 16-byte aligned base; the kernel guards rows >=
        // B*S*H (its copies ahead past the end included: zero-filled, reading nothing) and
        // chunks >= C; cos/sin as in `forward`; it indexes `smem` bytes of dynamic shared
        // memory, sized by ring_smem for its layout with QR_STAGES as the kernel sees it.
        return unsafe { k.launch([ring_grid(gpu, rows, shape, smem), 1, 1], [FAST_THREADS as u32, 1, 1], smem as u32, &p) };
    }
    let Some((warps, smem)) = warps_per_block(gpu, dm.c, 2) else { return Err(too_wide("qnorm_rope_backward", gpu, dm.c, 2)) };
    let k = gpu.kernel("qnorm_rope/bwd.cu", "qnorm_rope_bwd", &defines)?;
    // SAFETY: as in `forward`; grad is a validated logical [B,H,S,C] view (vector access
    // only where checked), rstd contiguous [B*S*H] f32, dx token-major of x's dtype; the
    // shared memory holds 2*C floats per warp as the kernel indexes.
    unsafe { k.launch([grid_for(gpu, rows, warps), 1, 1], [32 * warps as u32, 1, 1], smem as u32, &p) }
}

/// The kernel variants this family's launchers can select, rendered from their configs
/// (the kernel compile test builds these; see `tuning::compile_variants`). Files not yet
/// listed are compiled from their `// dsv4-test-defines:` lines.
pub fn compile_variants() -> Vec<crate::tuning::Variant> {
    Vec::new()
}
