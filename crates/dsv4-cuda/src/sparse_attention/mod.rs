//! Sparse MQA attention with sinks on the GPU (SPEC.md section 1) and its index plans
//! (section 6): launchers for `kernels/sparse_attention/`.
//!
//! - `fwd_sm90.cu` / `bwd_sm90.cu` (sm_90a, D = 512, 64 heads a CTA): a producer warpgroup
//!   and two wgmma consumers (their headers say how); `forward.rs` and `backward.rs` choose
//!   them. `config.rs`: the kernels' typed configs and the defines rendered from them.
//! - `fwd.cu`: one CTA per (query row, head block); gathered K/V tiles double-buffered by
//!   cp.async; `S = Q K^T` and `O += P V` on mma.sync m16n8k16 bf16; online softmax whose
//!   running max starts at the sink. With `SA_DEDUP=1` over a sorted plan it is the dense
//!   oracle (repeated keys count once).
//! - `bwd.cu`: one CTA per chunk (batch, head block, consecutive rows); delta fused in,
//!   `dq` written once, `dkv` reduced in f32 by 16-byte vector atomics (`atomic`) or, per
//!   wave of rows, stored per slot and summed per key in (row, slot) order through an
//!   inverted index (`deterministic`, `bwd_reduce.cu`), `dsinks` from per-row partials.
//! - `bwd_reduce.cu`: the fixed-order reductions; `plan.cu`: the plan layout built on the
//!   GPU; `pack.cu`: contiguous copies of inputs the tensor-core loaders cannot read.
//!
//! The cuda backend is bf16-in (q, kv, out, dout): f32 inputs are the reference's. The
//! kernels take a head dim D that is a multiple of 64; any other D <= 512 runs at D rounded
//! up to 64 (`kernel_d`): q, kv, out, dout copied with zero columns appended by `pack.cu`
//! (a zero column changes no dot product and gets a zero gradient), out, dq and dkv
//! computed padded and cut back to D by the same kernel.

mod backward;
mod config;
mod deterministic;
mod forward;
mod params;
mod plan;
#[cfg(test)]
mod tests;
mod tiles;

use dsv4_core::ops::sparse_attention::{BackwardImpl, Dims, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::SparseIndexPlan;
use dsv4_core::{DType, Error, Result, Tensor, TensorView, TensorViewMut};

pub(crate) use backward::backward;
// For tests/gpu_sparse_attention.rs: which backward kernel runs, and its head blocks.
#[doc(hidden)]
pub use backward::{bwd_head_blocks, use_hopper_bwd};
pub(crate) use config::compile_variants;
pub use config::{SaBwdConfig, SaDetConfig, SaFwdConfig};
// For tests/gpu_sparse_attention.rs: the size of the deterministic backward's contributions.
#[doc(hidden)]
pub use deterministic::ContribFormat;
use forward::{sa90_q_map_shape, SA90_Q_BOX};
// For tests/gpu_sparse_attention.rs: which forward kernel runs.
#[doc(hidden)]
pub use forward::use_hopper_fwd;
pub(crate) use forward::{dense, forward};
pub(crate) use params::*;
pub(crate) use plan::plan;
use plan::plan_impl;
// For tests/gpu_sparse_attention.rs: the tiles the launchers choose, and the padded head dim.
#[doc(hidden)]
pub use tiles::{choose_tiles, kernel_d, Pass, Tiles};
pub(crate) use tiles::{bwd_smem_bytes, fwd_smem_bytes};

use crate::runtime::{Gpu, Kernel, TmaDesc};

/// Whether these kernels can run (`is_kernel_available("sparse_attn")`).
pub(crate) const READY: bool = true;

const OP_FWD: &str = "sparse_attention";
const OP_BWD: &str = "sparse_attention_backward";
const OP_DENSE: &str = "dense_attention_topk";
const OP_PLAN: &str = "plan_sparse_indices";
// ---------------------------------------------------------------------------------------
// Input checks and preparation

/// The call's sizes from its arguments, which dsv4-core validated (`SparseAttentionArgs::
/// validate`) before calling the backend.
fn dims(a: &SparseAttentionArgs) -> Dims {
    let q = a.q.shape();
    let t = match &a.indices {
        SparseIndices::TopK(idx) => idx.shape()[2],
        SparseIndices::Plan(plan) => plan.slots,
    };
    Dims { b: q[0], s: q[1], h: q[2], d: q[3], k: a.kv.shape()[1], t }
}

fn unavailable(op: &'static str, reason: impl Into<String>) -> Error {
    Error::Unavailable { backend: "cuda".into(), op, reason: reason.into() }
}

/// What this backend takes beyond dsv4-core's checks, checked before anything is written.
fn check_supported(op: &'static str, pass: Pass, gpu: &Gpu, dm: Dims, bf16_args: &[(&str, &TensorView)]) -> Result<Tiles> {
    for (name, v) in bf16_args {
        if v.dtype() != DType::BF16 {
            return Err(unavailable(op, format!("`{name}` is {}: the cuda kernels take bf16 (f32 inputs are the reference backend's)", v.dtype())));
        }
    }
    if dm.d == 0 || dm.d > 512 {
        return Err(unavailable(op, format!("head_dim D = {}: the cuda kernels take 1 <= D <= 512", dm.d)));
    }
    let lim = i32::MAX as usize;
    if dm.b.saturating_mul(dm.s) > lim || dm.k > lim || dm.t > lim || dm.h > lim {
        return Err(unavailable(op, format!("sizes B*S = {}, K = {}, T = {}, H = {} must each fit in int32", dm.b * dm.s, dm.k, dm.t, dm.h)));
    }
    let smem_max = gpu.props().max_shared_per_block_optin as usize;
    let dp = kernel_d(dm.d);
    choose_tiles(pass, dp, dm.h, smem_max).ok_or_else(|| unavailable(op, format!("D = {} (kernel D = {dp}), H = {}: even the smallest tile needs more than the device's {smem_max} bytes of shared memory per block", dm.d, dm.h)))
}

fn strides_i64(v: &TensorView) -> Vec<i64> {
    v.strides().iter().map(|&s| s as i64).collect()
}

/// A bf16 input as the tensor-core loaders read it, `dp` (the kernel head dim) wide:
/// d-stride 1, every other stride a multiple of 8 elements and a 16-byte aligned base;
/// otherwise (or when the last dim is narrower than `dp`) a packed contiguous copy with
/// zero columns appended (kept alive in `_copy`).
struct RowsInput {
    ptr: u64,
    strides: Vec<i64>,
    _copy: Option<Tensor>,
}

fn rows_input(gpu: &Gpu, v: &TensorView, dp: usize) -> Result<RowsInput> {
    let st = strides_i64(v);
    let nd = st.len();
    let shape = v.shape();
    let aligned = v.address().is_multiple_of(16) && (shape[nd - 1] <= 1 || st[nd - 1] == 1) && st[..nd - 1].iter().zip(shape).all(|(&s, &n)| n <= 1 || s % 8 == 0);
    if (aligned && shape[nd - 1] == dp) || v.numel() == 0 {
        return Ok(RowsInput { ptr: v.address(), strides: st, _copy: None });
    }
    let mut padded = shape.to_vec();
    padded[nd - 1] = dp;
    let copy = gpu.alloc(DType::BF16, &padded)?;
    // SAFETY: `src` addresses every element its shape and strides reach (a validated view);
    // `dst` is a fresh contiguous tensor of the padded shape.
    unsafe { pack(gpu, v.address(), &st, shape, copy.view().address(), dp)? };
    let strides = dsv4_core::tensor::contiguous_strides(&padded).iter().map(|&s| s as i64).collect();
    Ok(RowsInput { ptr: copy.view().address(), strides, _copy: Some(copy) })
}

/// `sparse_attn_pack`: the bf16 tensor at `src` (`shape`, `strides`, rank 1..=4) copied to
/// the contiguous tensor at `dst` of the same shape except a last dim of `n3_dst` (zero
/// columns appended, or trailing columns dropped).
///
/// # Safety
/// `src` must address every element that `shape` and `strides` reach, and `dst` must hold
/// `shape[..last].product() * n3_dst` bf16.
unsafe fn pack(gpu: &Gpu, src: u64, strides: &[i64], shape: &[usize], dst: u64, n3_dst: usize) -> Result<()> {
    let nd = shape.len();
    let mut p = PackParams { src, dst, s: [0; 4], n: [1; 4], n3_dst: n3_dst as i64 };
    let off = 4 - nd;
    for i in 0..nd {
        p.s[off + i] = strides[i];
        p.n[off + i] = shape[i] as i64;
    }
    let total = shape[..nd - 1].iter().product::<usize>() * n3_dst;
    if total == 0 {
        return Ok(());
    }
    let k = gpu.kernel("sparse_attention/pack.cu", "sparse_attn_pack", &[])?;
    // SAFETY: the caller's contract; PackParams mirrors the header; the grid-stride loop
    // stays below `total`.
    unsafe { k.launch([grid_for(gpu, total), 1, 1], [256, 1, 1], 0, &p) }
}

/// A padded `[rows, dp]` bf16 result at `src` cut back to the contiguous `[rows, d]` at `dst`.
///
/// # Safety
/// `src` must hold `rows * dp` bf16 and `dst` `rows * d` bf16.
unsafe fn unpad(gpu: &Gpu, src: u64, rows: usize, dp: usize, dst: u64, d: usize) -> Result<()> {
    // SAFETY: the caller's contract ([rows, d] of a [rows, dp] row-major buffer).
    unsafe { pack(gpu, src, &[dp as i64, 1], &[rows, d], dst, d) }
}

/// Blocks of 256 threads for a grid-stride loop over `n` elements.
fn grid_for(gpu: &Gpu, n: usize) -> u32 {
    let want = n.div_ceil(256).max(1);
    want.min(gpu.props().sm_count as usize * 8).max(1) as u32
}

/// Where a row's slots come from, as the kernels read them.
#[derive(Clone, Copy, Debug)]
struct IndexSource {
    ptr: u64,
    sb: i64,
    ss: i64,
    st: i64,
    bias: i64,
    is_i64: i32,
    row_len: u64,
    t: usize,
}

fn index_source(op: &'static str, indices: &SparseIndices, dm: Dims) -> Result<IndexSource> {
    match indices {
        SparseIndices::TopK(v) => {
            let st = strides_i64(v);
            Ok(IndexSource { ptr: v.address(), sb: st[0], ss: st[1], st: st[2], bias: 0, is_i64: (v.dtype() == DType::I64) as i32, row_len: 0, t: dm.t })
        }
        SparseIndices::Plan(plan) => plan_source(op, plan, dm),
    }
}

/// A cuda plan (dsv4-core checked its backend and sizes): `indices [B*S,1,W]` i32
/// contiguous global coordinates, valid first. Its tensors are public fields, so their
/// layout is checked here, before the kernels read them.
fn plan_source(op: &'static str, plan: &SparseIndexPlan, dm: Dims) -> Result<IndexSource> {
    let v = plan.indices.view();
    let w = *v.shape().last().unwrap_or(&0);
    if v.dtype() != DType::I32 || v.shape() != [dm.b * dm.s, 1, w] || !v.is_contiguous() {
        return Err(Error::value(op, "plan", format!("indices i32 [{}, 1, W] contiguous", dm.b * dm.s), format!("{} {:?}", v.dtype(), v.shape())));
    }
    let row_len = match &plan.topk_length {
        Some(l) if l.dtype() == DType::I32 && l.shape() == [dm.b * dm.s] => l.view().address(),
        Some(l) => return Err(Error::value(op, "plan.topk_length", format!("i32 [{}]", dm.b * dm.s), format!("{} {:?}", l.dtype(), l.shape()))),
        None => 0,
    };
    Ok(IndexSource { ptr: v.address(), sb: (dm.s * w) as i64, ss: w as i64, st: 1, bias: dm.k as i64, is_i64: 0, row_len, t: w })
}

fn out_ptr(v: &TensorViewMut) -> u64 {
    v.as_view().address()
}

