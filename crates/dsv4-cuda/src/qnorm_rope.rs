//! Q RMSNorm + partial interleaved RoPE on the GPU (SPEC.md section 5): launchers for
//! `kernels/qnorm_rope/`.
//!
//! Fast kernels (`fwd_fast.cu`, `bwd_fast.cu`) where x (and grad) are bf16 with unit
//! channel stride and 16-byte aligned rows, and the output is 16-byte aligned: a group of
//! lanes per row, several rows in flight (shapes decided here as compile-time defines); the
//! forward holds its rows in registers, a grid of every row block; the backward is
//! persistent, its rows streamed through a shared-memory ring. Otherwise the generic
//! kernels (`fwd.cu`, `bwd.cu`): one warp per `(b, s, h)` row, staged in shared memory,
//! 16-byte vector accesses where the layout allows. Inputs and outputs come validated by
//! `dsv4-core` (`QNormRopeArgs::validate`, token-major outputs, a contiguous rstd).

use dsv4_core::ops::qnorm_rope::{Dims, QNormRopeArgs};
use dsv4_core::{DType, Error, Result, TensorView, TensorViewMut};

use crate::kernel_config;
use crate::runtime::Gpu;
use crate::tuning::{configured, Variant};

const OP: &str = "qnorm_rope";

/// Mirrors `QNormRopeParams` (kernels/qnorm_rope/qnorm_rope.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct QNormRopeParams {
    /// Logical `[B,H,S,C]`, x's dtype, strides `x_stride`.
    pub(crate) x: u64,
    /// `[B,S,R]` f32, strides `cos_stride`.
    pub(crate) cos: u64,
    /// `[B,S,R]` f32, strides `sin_stride`.
    pub(crate) sin: u64,
    /// Backward: logical `[B,H,S,C]`, strides `g_stride`; 0 forward.
    pub(crate) grad: u64,
    /// Backward: `[B*S*H]` f32 token-major; 0 forward.
    pub(crate) rstd_in: u64,
    /// `[B,S,H,C]` contiguous token-major, x's dtype.
    pub(crate) out: u64,
    /// Forward: `[B*S*H]` f32 token-major; 0 backward.
    pub(crate) rstd_out: u64,
    pub(crate) x_stride: [i64; 4],
    pub(crate) g_stride: [i64; 4],
    pub(crate) cos_stride: [i64; 3],
    pub(crate) sin_stride: [i64; 3],
    pub(crate) b: i64,
    pub(crate) h: i64,
    pub(crate) s: i64,
    pub(crate) c: i64,
    pub(crate) r: i64,
    pub(crate) eps: f32,
    pub(crate) pad: i32,
}

const _: () = assert!(std::mem::size_of::<QNormRopeParams>() == 216);

pub(crate) const PARAMS_SIZES: &[(&str, usize)] = &[("QNormRopeParams", 216)];

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

kernel_config! {
    /// `qnorm_rope/fwd_fast.cu` (the generic `fwd.cu` has no choices).
    pub struct QnormRopeFwdConfig("qnorm_rope_fwd") {
        /// 16-byte chunks a lane loads before using any (rows per block `QR_U` = this / chunks
        /// per lane, 1 to 4): 8, four rows at C = 512: fwd 0.589 ms against 0.688 for the
        /// persistent row loop (DECISIONS.md, qnorm_rope; LOG.md v7).
        pub chunks_in_flight: usize = 8,
    }
}

kernel_config! {
    /// `qnorm_rope/bwd_fast.cu` (the generic `bwd.cu` has no choices).
    pub struct QnormRopeBwdConfig("qnorm_rope_bwd") {
        /// Ring stages (`QR_STAGES`, stages - 1 row blocks in flight a lane group): 4, the depth
        /// the ring backward was measured with (fwd + bwd 1.536 -> 1.495 ms, LOG.md v7; not
        /// swept since).
        pub stages: usize = 4,
    }
}

/// The fast kernels' shape for C channels: lanes per row, 16-byte chunks per lane, rows per
/// row block of a lane group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FastShape {
    lpr: usize,
    cpl: usize,
    u: usize,
}

/// `fast_shape`'s answer for C channels; None when C is not a multiple of 8 or exceeds 1024
/// (at most 4 chunks a lane). The forward loads a whole row block into registers before
/// using it (`chunks_in_flight` / cpl rows, 1 to 4); the backward takes one row at a time
/// through its shared-memory ring.
fn fast_shape(c: usize, chunks_in_flight: Option<usize>) -> Option<FastShape> {
    if c == 0 || !c.is_multiple_of(8) {
        return None;
    }
    let chunks = c / 8;
    let lpr = chunks.next_power_of_two().min(32);
    let cpl = chunks.div_ceil(lpr);
    let u = chunks_in_flight.map_or(1, |n| (n / cpl).clamp(1, 4));
    (cpl <= 4).then_some(FastShape { lpr, cpl, u })
}

fn flag(b: bool) -> String {
    (b as u8).to_string()
}

/// Defines of `fwd.cu`: x's dtype, the vector widths of x and of the output.
fn fwd_defines(x_bf16: bool, x_vec: usize, o_vec: usize) -> Vec<(&'static str, String)> {
    vec![("QR_X_BF16", flag(x_bf16)), ("QR_X_VEC", x_vec.to_string()), ("QR_O_VEC", o_vec.to_string())]
}

/// Defines of `bwd.cu`: the dtypes of x and grad, the vector widths of x, grad and dx.
fn bwd_defines(x_bf16: bool, g_bf16: bool, x_vec: usize, g_vec: usize, o_vec: usize) -> Vec<(&'static str, String)> {
    vec![("QR_X_BF16", flag(x_bf16)), ("QR_G_BF16", flag(g_bf16)), ("QR_X_VEC", x_vec.to_string()), ("QR_G_VEC", g_vec.to_string()), ("QR_O_VEC", o_vec.to_string())]
}

/// Defines of `fwd_fast.cu` / `bwd_fast.cu` (`stages`: the backward's ring).
fn fast_defines(sh: FastShape, cs_vec: bool, stages: Option<usize>) -> Vec<(&'static str, String)> {
    let mut d = vec![("QR_LPR", sh.lpr.to_string()), ("QR_CPL", sh.cpl.to_string()), ("QR_U", sh.u.to_string()), ("QR_CS_VEC", flag(cs_vec))];
    d.extend(stages.map(|s| ("QR_STAGES", s.to_string())));
    d
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

/// Threads per block of the fast kernels (their `__launch_bounds__`).
const FAST_THREADS: usize = 256;

/// Whether cos and sin allow one float4 per chunk (`QR_CS_VEC`): unit r stride, 16-byte
/// aligned `(b, s)` rows, and C - R a multiple of 8 (so a chunk is rotated whole or not).
fn cos_sin_vec(a: &QNormRopeArgs, c: usize, r: usize) -> bool {
    let ok = |v: &TensorView| {
        let (sh, st) = (v.shape(), v.strides());
        v.address().is_multiple_of(16) && st[2] == 1 && (0..2).all(|d| sh[d] <= 1 || st[d] % 4 == 0)
    };
    (c - r).is_multiple_of(8) && ok(&a.cos) && ok(&a.sin)
}

/// The fast forward's grid: one lane group per row block, every block (not persistent).
fn fast_fwd_grid(rows: usize, sh: FastShape) -> u32 {
    rows.div_ceil(sh.u).div_ceil(FAST_THREADS / sh.lpr).max(1) as u32
}

/// The fast backward is persistent: one wave of resident blocks, fewer when the rows need
/// fewer. Blocks per SM: what its registers are sized for (`MIN_BLOCKS` of bwd_fast.cu),
/// bounded by its dynamic shared memory (1 KiB a block reserved by the driver).
fn ring_grid(gpu: &Gpu, rows: usize, sh: FastShape, smem: usize) -> u32 {
    let by_regs = if sh.cpl * sh.u > 2 { 2 } else { 3 };
    let per_sm = (gpu.props().max_shared_per_sm as usize / (smem + 1024)).clamp(1, by_regs);
    let needed = rows.div_ceil(sh.u).div_ceil(FAST_THREADS / sh.lpr);
    needed.min(gpu.props().sm_count as usize * per_sm).max(1) as u32
}

/// Dynamic shared memory of the fast backward's ring: 16-byte slots per lane for x and grad,
/// `[warps][stages][u][x, grad][cpl][32 lanes]`, then rstd `[warps][stages][u][32 lanes]` f32.
fn ring_smem(sh: FastShape, stages: usize) -> usize {
    let warps = FAST_THREADS / 32;
    warps * stages * sh.u * 2 * sh.cpl * 32 * 16 + warps * stages * sh.u * 32 * 4
}

fn grid_for(gpu: &Gpu, rows: usize, warps: usize) -> u32 {
    rows.div_ceil(warps).min(gpu.props().sm_count as usize * 32).max(1) as u32
}

/// The validated dimensions of `a` (x is logical `[B,H,S,C]`).
fn dims(a: &QNormRopeArgs) -> Dims {
    let sh = a.x.shape();
    Dims { b: sh[0], h: sh[1], s: sh[2], c: sh[3], r: a.rotary }
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

pub(crate) fn forward(gpu: &Gpu, a: &QNormRopeArgs, out: &mut TensorViewMut, rstd: &mut TensorViewMut) -> Result<()> {
    let dm = dims(a);
    let rows = dm.b * dm.s * dm.h;
    if rows == 0 {
        return Ok(());
    }
    let cfg = configured::<QnormRopeFwdConfig>()?;
    let (x_bf16, x_vec, o_vec) = (a.x.dtype() == DType::BF16, vector_width(&a.x), out_vector_width(out));
    let p = QNormRopeParams { out: out.address(), rstd_out: rstd.address(), ..base_params(a, dm) };
    if let Some(sh) = fast_shape(dm.c, Some(cfg.chunks_in_flight)).filter(|_| x_bf16 && x_vec == 8 && o_vec == 8) {
        let k = gpu.kernel("qnorm_rope/fwd_fast.cu", "qnorm_rope_fwd_fast", &fast_defines(sh, cos_sin_vec(a, dm.c, dm.r), None))?;
        // SAFETY: x is bf16 with unit channel stride and 16-byte aligned rows, C a multiple
        // of 8 (vector_width, fast_shape): each 16-byte load lies in a row; cos and sin are
        // validated [B,S,R] views; out is token-major [B,S,H,C] bf16 with a 16-byte
        // aligned base (out_vector_width) and rstd contiguous [B*S*H] f32 (dsv4-core);
        // float4 reads of cos/sin only where cos_sin_vec checked unit r stride, 16-byte
        // aligned rows and C - R a multiple of 8; the kernel guards rows >= B*S*H and
        // chunks >= C.
        return unsafe { k.launch([fast_fwd_grid(rows, sh), 1, 1], [FAST_THREADS as u32, 1, 1], 0, &p) };
    }
    let Some((warps, smem)) = warps_per_block(gpu, dm.c, 1) else { return Err(too_wide(OP, gpu, dm.c, 1)) };
    let k = gpu.kernel("qnorm_rope/fwd.cu", "qnorm_rope_fwd", &fwd_defines(x_bf16, x_vec, o_vec))?;
    // SAFETY: x, cos and sin are validated views ([B,H,S,C] / [B,S,R]) whose strides reach
    // only their own elements, and 16-byte accesses are enabled only where alignment and
    // unit channel stride were checked (vector_width); out is token-major [B,S,H,C] of x's
    // dtype and rstd contiguous [B*S*H] f32 (dsv4-core); the shared memory holds C floats
    // per warp as the kernel indexes.
    unsafe { k.launch([grid_for(gpu, rows, warps), 1, 1], [32 * warps as u32, 1, 1], smem as u32, &p) }
}

pub(crate) fn backward(gpu: &Gpu, a: &QNormRopeArgs, rstd: &TensorView, grad: &TensorView, dx: &mut TensorViewMut) -> Result<()> {
    let dm = dims(a);
    let rows = dm.b * dm.s * dm.h;
    if rows == 0 {
        return Ok(());
    }
    let cfg = configured::<QnormRopeBwdConfig>()?;
    let (x_bf16, g_bf16) = (a.x.dtype() == DType::BF16, grad.dtype() == DType::BF16);
    let (x_vec, g_vec, o_vec) = (vector_width(&a.x), vector_width(grad), out_vector_width(dx));
    let p = QNormRopeParams { grad: grad.address(), rstd_in: rstd.address(), out: dx.address(), g_stride: strides(grad), ..base_params(a, dm) };
    if let Some(sh) = fast_shape(dm.c, None).filter(|_| x_bf16 && g_bf16 && x_vec == 8 && g_vec == 8 && o_vec == 8) {
        let stages = cfg.stages.max(2);
        let k = gpu.kernel("qnorm_rope/bwd_fast.cu", "qnorm_rope_bwd_fast", &fast_defines(sh, cos_sin_vec(a, dm.c, dm.r), Some(stages)))?;
        let smem = ring_smem(sh, stages);
        // SAFETY: as in `forward`'s fast path, for x and grad (both bf16, unit channel
        // stride, 16-byte aligned rows, checked by vector_width); rstd contiguous [B*S*H]
        // f32; dx token-major bf16 with a 16-byte aligned base; the kernel guards rows >=
        // B*S*H (its copies ahead past the end included: zero-filled, reading nothing) and
        // chunks >= C; cos/sin as in `forward`; it indexes `smem` bytes of dynamic shared
        // memory, sized by ring_smem for its layout with the QR_STAGES it was built with.
        return unsafe { k.launch([ring_grid(gpu, rows, sh, smem), 1, 1], [FAST_THREADS as u32, 1, 1], smem as u32, &p) };
    }
    let Some((warps, smem)) = warps_per_block(gpu, dm.c, 2) else { return Err(too_wide("qnorm_rope_backward", gpu, dm.c, 2)) };
    let k = gpu.kernel("qnorm_rope/bwd.cu", "qnorm_rope_bwd", &bwd_defines(x_bf16, g_bf16, x_vec, g_vec, o_vec))?;
    // SAFETY: as in `forward`; grad is a validated logical [B,H,S,C] view (vector access
    // only where checked), rstd contiguous [B*S*H] f32, dx token-major of x's dtype
    // (dsv4-core); the shared memory holds 2*C floats per warp as the kernel indexes.
    unsafe { k.launch([grid_for(gpu, rows, warps), 1, 1], [32 * warps as u32, 1, 1], smem as u32, &p) }
}

/// The kernel variants the launchers select with the default configs: the generic kernels
/// for every combination of dtypes and vector widths, the fast ones for every shape of C <= 1024
/// (a multiple of 8) with and without float4 cos/sin.
pub fn compile_variants() -> Vec<Variant> {
    const ARCHS: &[&str] = &["sm_90a", "sm_80"];
    let (fwd, bwd) = (QnormRopeFwdConfig::default(), QnormRopeBwdConfig::default());
    let mut v = Vec::new();
    let widths = |bf16: bool| [1, if bf16 { 8 } else { 4 }];
    for x_bf16 in [false, true] {
        for x_vec in widths(x_bf16) {
            for o_vec in widths(x_bf16) {
                v.push(Variant { path: "qnorm_rope/fwd.cu", archs: ARCHS, defines: fwd_defines(x_bf16, x_vec, o_vec) });
            }
        }
        for g_bf16 in [false, true] {
            for x_vec in widths(x_bf16) {
                for g_vec in widths(g_bf16) {
                    for o_vec in widths(x_bf16) {
                        v.push(Variant { path: "qnorm_rope/bwd.cu", archs: ARCHS, defines: bwd_defines(x_bf16, g_bf16, x_vec, g_vec, o_vec) });
                    }
                }
            }
        }
    }
    let mut fwd_shapes: Vec<FastShape> = (1..=128).filter_map(|chunks| fast_shape(8 * chunks, Some(fwd.chunks_in_flight))).collect();
    let mut bwd_shapes: Vec<FastShape> = (1..=128).filter_map(|chunks| fast_shape(8 * chunks, None)).collect();
    fwd_shapes.dedup();
    bwd_shapes.dedup();
    for cs_vec in [false, true] {
        v.extend(fwd_shapes.iter().map(|&sh| Variant { path: "qnorm_rope/fwd_fast.cu", archs: ARCHS, defines: fast_defines(sh, cs_vec, None) }));
        v.extend(bwd_shapes.iter().map(|&sh| Variant { path: "qnorm_rope/bwd_fast.cu", archs: ARCHS, defines: fast_defines(sh, cs_vec, Some(bwd.stages)) }));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defs(v: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        v.iter().map(|(k, x)| (*k, x.to_string())).collect()
    }

    #[test]
    fn fast_shapes() {
        // DSV4: C = 512 (H = 64, rope 64): 32 lanes x 2 chunks, 4 rows a block forward.
        assert_eq!(fast_shape(512, Some(8)), Some(FastShape { lpr: 32, cpl: 2, u: 4 }));
        assert_eq!(fast_shape(512, None), Some(FastShape { lpr: 32, cpl: 2, u: 1 }));
        assert_eq!(fast_shape(8, Some(8)), Some(FastShape { lpr: 1, cpl: 1, u: 4 }));
        assert_eq!(fast_shape(1024, Some(8)), Some(FastShape { lpr: 32, cpl: 4, u: 2 }));
        assert_eq!(fast_shape(768, Some(8)), Some(FastShape { lpr: 32, cpl: 3, u: 2 }));
        assert_eq!(fast_shape(1032, Some(8)), None);
        assert_eq!(fast_shape(7, None), None);
        assert_eq!(ring_smem(FastShape { lpr: 32, cpl: 2, u: 1 }, 4), 8 * 4 * 2 * 2 * 32 * 16 + 8 * 4 * 32 * 4);
    }

    /// The defines are those the launcher passed before the typed configs (bb7d6e1), less
    /// the generic keys the fast kernels never read (QR_X_BF16, QR_X_VEC, QR_O_VEC and,
    /// backward, QR_G_*: always bf16 and 8 there), plus QR_STAGES, whose kernel default (4)
    /// the launcher used to leave implicit.
    #[test]
    fn defines_match_the_previous_launcher() {
        // DSV4: x bf16 [B,H,S,C] with C = 512, rope 64, contiguous cos/sin rows of 64 f32.
        let sh = fast_shape(512, Some(QnormRopeFwdConfig::default().chunks_in_flight)).unwrap();
        assert_eq!(fast_defines(sh, true, None), defs(&[("QR_LPR", "32"), ("QR_CPL", "2"), ("QR_U", "4"), ("QR_CS_VEC", "1")]));
        let sh = fast_shape(512, None).unwrap();
        assert_eq!(fast_defines(sh, true, Some(QnormRopeBwdConfig::default().stages)), defs(&[("QR_LPR", "32"), ("QR_CPL", "2"), ("QR_U", "1"), ("QR_CS_VEC", "1"), ("QR_STAGES", "4")]));
        // The generic kernels (the small GPU tests' f32, odd C and strided cases).
        assert_eq!(fwd_defines(false, 4, 1), defs(&[("QR_X_BF16", "0"), ("QR_X_VEC", "4"), ("QR_O_VEC", "1")]));
        assert_eq!(bwd_defines(true, false, 1, 4, 8), defs(&[("QR_X_BF16", "1"), ("QR_G_BF16", "0"), ("QR_X_VEC", "1"), ("QR_G_VEC", "4"), ("QR_O_VEC", "8")]));
    }
}
