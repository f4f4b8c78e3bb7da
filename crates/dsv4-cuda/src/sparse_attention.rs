//! Sparse MQA attention with sinks on the GPU (SPEC.md section 1) and its index plans
//! (section 6): launchers for `kernels/sparse_attention/`.
//!
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

use std::mem::size_of;

use dsv4_core::ops::sparse_attention::{BackwardImpl, Dims, SparseAttentionArgs, SparseAttentionBwdArgs, SparseIndices};
use dsv4_core::ops::sparse_indices::SparseIndexPlan;
use dsv4_core::{DType, Error, Result, Tensor, TensorView, TensorViewMut};

use crate::runtime::{Gpu, Kernel, TmaDesc};

/// Whether these kernels can run (`is_kernel_available("sparse_attn")`).
pub const READY: bool = true;

const OP_FWD: &str = "sparse_attention";
const OP_BWD: &str = "sparse_attention_backward";
const OP_DENSE: &str = "dense_attention_topk";
const OP_PLAN: &str = "plan_sparse_indices";

// ---------------------------------------------------------------------------------------
// Params structs: mirrors of kernels/sparse_attention/params.cuh (field comments there).

/// Mirrors `SparseAttnFwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FwdParams {
    pub q: u64,       // [B,S,H,D] bf16
    pub kv: u64,      // [B,K,D] bf16
    pub sinks: u64,   // [H] f32
    pub idx: u64,     // [B,S,T] i32/i64, or a plan's [B*S,1,T] i32 global coordinates
    pub row_len: u64, // [B*S] i32 or 0
    pub out: u64,     // [B,S,H,D] bf16 out
    pub lse: u64,     // [B,S,H] f32 out
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub kv_sb: i64,
    pub kv_sk: i64,
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub idx_bias: i64,
    pub sinks_sh: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub k: i32,
    pub t: i32,
    pub idx_is_i64: i32,
    pub smem_bytes: i32,
    pub sm_scale: f32,
}

/// Mirrors `SparseAttnBwdParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BwdParams {
    pub q: u64,           // [B,S,H,D] bf16
    pub kv: u64,          // [B,K,D] bf16
    pub sinks: u64,       // [H] f32
    pub idx: u64,         // as FwdParams::idx
    pub row_len: u64,     // [B*S] i32 or 0
    pub out: u64,         // [B,S,H,D] bf16
    pub dout: u64,        // [B,S,H,D] bf16
    pub lse: u64,         // [B,S,H] f32
    pub dq: u64,          // [B,S,H,D] bf16 out
    pub dkv: u64,         // atomic: [B,K,D] f32; deterministic: [wave rows, T, n_hblk, D] f32 contributions
    pub dsinks_part: u64, // [B*S, H] f32 out
    pub q_sb: i64,
    pub q_ss: i64,
    pub q_sh: i64,
    pub kv_sb: i64,
    pub kv_sk: i64,
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub idx_bias: i64,
    pub sinks_sh: i64,
    pub o_sb: i64,
    pub o_ss: i64,
    pub o_sh: i64,
    pub do_sb: i64,
    pub do_ss: i64,
    pub do_sh: i64,
    pub lse_sb: i64,
    pub lse_ss: i64,
    pub lse_sh: i64,
    pub b: i32,
    pub s: i32,
    pub h: i32,
    pub k: i32,
    pub t: i32,
    pub idx_is_i64: i32,
    pub smem_bytes: i32,
    pub rows_per_chunk: i32,
    pub chunks_per_bh: i32,
    pub chunk_base: i32,
    pub deterministic: i32,
    pub all_rows_nonempty: i32,
    pub sm_scale: f32,
    pub rows_desc: i32, // bwd_sm90.cu: launch row v is row B*S - 1 - v
}

/// Mirrors `SparseAttnInvIndexParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct InvIndexParams {
    pub idx: u64,     // as BwdParams::idx
    pub row_len: u64, // [B*S] i32 or 0
    pub counts: u64,  // [n_rb, G] i32
    pub colptr: u64,  // [G + 1] i32
    pub entries: u64, // [n_rows * T] i32
    pub contrib: u64, // [n_rows, T, n_hblk, D] f32
    pub acc: u64,     // [G, D] f32 in/out
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub idx_bias: i64,
    pub g: i64,
    pub row_base: i32,
    pub n_rows: i32,
    pub rows_per_rb: i32,
    pub n_rb: i32,
    pub s: i32,
    pub k: i32,
    pub t: i32,
    pub d: i32,
    pub n_hblk: i32,
    pub idx_is_i64: i32,
    pub entry_base: i64, // reduce: entry id of the wave's first contribution
    pub rb_lo: i32,      // reduce: the wave's row blocks of the index
    pub rb_hi: i32,
    pub rows_desc: i32,  // the main kernel's BwdParams::rows_desc: launch row v is row rows_total - 1 - v
    pub rows_total: i32, // B*S
    pub dkv_out: u64,    // reduce_f16's last wave: [G, D] bf16 written as bf16(acc + sum); 0: acc += sum
    pub partials: u64,   // reduce_f16 over several waves: [G, groups, D] f32 running group sums (zeroed); 0: one wave
    pub carried: u64,    // reduce_f16, an index per wave: [G] i32 entries of each key in earlier waves (zeroed); 0: global index
    pub last_wave: i32,  // 1: the last wave's reduce (it adds the groups' sums)
    pub pad_: i32,
}

/// Mirrors `SparseAttnConvertParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvertParams {
    pub src: u64, // [n] f32
    pub dst: u64, // [n] bf16 out
    pub n: i64,
    pub permuted: i32, // 1: src columns permuted within groups of 16 (bwd_sm90.cu's flush layout)
    pub pad_: i32,
}

/// Mirrors `SparseAttnDsinksParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DsinksParams {
    pub part: u64,   // [rows, H] f32
    pub dsinks: u64, // [H] f32 out
    pub rows: i64,
    pub h: i32,
    pub pad_: i32,
}

/// Mirrors `SparseAttnPlanParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanParams {
    pub idx: u64,     // [B,S,T] i32/i64
    pub indices: u64, // [B*S,1,T] i32 out
    pub lengths: u64, // [B*S] i32 out
    pub idx_sb: i64,
    pub idx_ss: i64,
    pub idx_st: i64,
    pub b: i32,
    pub s: i32,
    pub t: i32,
    pub k: i32,
    pub sort_cap: i32,
    pub idx_is_i64: i32,
}

/// Mirrors `SparseAttnValidRowsParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ValidRowsParams {
    pub lengths: u64,    // [rows] i32
    pub valid_rows: u64, // [rows] i64 out
    pub rows: i64,
}

/// Mirrors `SparseAttnPackParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PackParams {
    pub src: u64,
    pub dst: u64,
    pub s: [i64; 4],
    pub n: [i64; 4],
    pub n3_dst: i64,
}

const _: () = assert!(size_of::<FwdParams>() == 168);
const _: () = assert!(size_of::<BwdParams>() == 296);
const _: () = assert!(size_of::<InvIndexParams>() == 192);
const _: () = assert!(size_of::<ConvertParams>() == 32);
const _: () = assert!(size_of::<DsinksParams>() == 32);
const _: () = assert!(size_of::<PlanParams>() == 72);
const _: () = assert!(size_of::<ValidRowsParams>() == 24);
const _: () = assert!(size_of::<PackParams>() == 88);

/// `(params struct name, size in bytes)` of every params struct of this family.
pub const PARAMS_SIZES: &[(&str, usize)] = &[
    ("SparseAttnFwdParams", size_of::<FwdParams>()),
    ("SparseAttnBwdParams", size_of::<BwdParams>()),
    ("SparseAttnInvIndexParams", size_of::<InvIndexParams>()),
    ("SparseAttnConvertParams", size_of::<ConvertParams>()),
    ("SparseAttnDsinksParams", size_of::<DsinksParams>()),
    ("SparseAttnPlanParams", size_of::<PlanParams>()),
    ("SparseAttnValidRowsParams", size_of::<ValidRowsParams>()),
    ("SparseAttnPackParams", size_of::<PackParams>()),
];

// ---------------------------------------------------------------------------------------
// Tile sizes, chosen in one place.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Fwd,
    Bwd,
}

/// Compile-time tile of `fwd.cu` / `bwd.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Heads per CTA (the mma M, a multiple of 16; padded heads are masked rows).
    pub hb: usize,
    /// Slots per gathered K/V tile.
    pub bn: usize,
    /// O / dq columns per warp.
    pub dw: usize,
}

impl Tiles {
    pub fn threads(&self, d: usize) -> usize {
        (self.hb / 16) * (d / self.dw) * 32
    }
    pub fn head_blocks(&self, h: usize) -> usize {
        h.div_ceil(self.hb)
    }
}

/// Shared memory of `fwd.cu` (mirrors `FwdLayout` in tile.cuh): Q, two K/V tiles, S (f32),
/// P (bf16), row statistics, a ring of three tiles' slot keys. Rows padded by 16 bytes (bank-conflict-free ldmatrix).
pub fn fwd_smem_bytes(d: usize, hb: usize, bn: usize) -> usize {
    let (qs, ss, ps) = (d + 8, bn + 4, bn + 8);
    hb * qs * 2 + 2 * bn * qs * 2 + hb * ss * 4 + hb * ps * 2 + 3 * hb * 4 + 3 * bn * 4
}

/// Shared memory of `bwd.cu` (mirrors `BwdLayout` in tile.cuh): Q, dO, two K/V tiles, P and
/// dS (bf16), lse and delta, a ring of three tiles' slot keys.
pub fn bwd_smem_bytes(d: usize, hb: usize, bn: usize) -> usize {
    let (qs, ps) = (d + 8, bn + 8);
    2 * hb * qs * 2 + 2 * bn * qs * 2 + 2 * hb * ps * 2 + 2 * hb * 4 + 3 * bn * 4
}

/// The tile for head dim `d`, `h` heads and `smem_max` bytes of opt-in shared memory:
/// - `dw`: 128 columns per warp when `d` allows (O / dq: 64 f32 registers a thread), else 64.
/// - `hb`: all heads in one CTA when `h <= 64`, so each K/V tile is gathered once per row
///   and serves every head; more heads split evenly into blocks of at most 64 (the mma M
///   is padded to 16). Threads are capped: forward 512, backward 256 — the backward keeps
///   dq, Q/dO fragments and the dKV tile live, and at 512 threads ptxas has 128 registers
///   and spills.
/// - `bn`: 64 slots per tile when shared memory allows (half the barriers per key), else
///   32 (D = 512: a key row is 1 KiB, and the backward holds Q, dO and two K/V tiles).
pub fn choose_tiles(pass: Pass, d: usize, h: usize, smem_max: usize) -> Option<Tiles> {
    if d == 0 || !d.is_multiple_of(64) || d > 512 || h == 0 {
        return None;
    }
    let dw = if d.is_multiple_of(128) { 128 } else { 64 };
    let wd = d / dw;
    let max_threads = match pass {
        Pass::Fwd => 512,
        Pass::Bwd => 256,
    };
    for hb_cap in [64usize, 48, 32, 16] {
        if (hb_cap / 16) * wd * 32 > max_threads {
            continue;
        }
        let n_blocks = h.div_ceil(hb_cap);
        let hb = h.div_ceil(n_blocks).next_multiple_of(16);
        for bn in [64usize, 32] {
            let smem = match pass {
                Pass::Fwd => fwd_smem_bytes(d, hb, bn),
                Pass::Bwd => bwd_smem_bytes(d, hb, bn),
            };
            if smem <= smem_max {
                return Some(Tiles { hb, bn, dw });
            }
        }
    }
    None
}

fn defines(d: usize, t: &Tiles, natural_exp: bool, dedup: Option<bool>) -> Vec<(&'static str, String)> {
    let mut v = vec![("SA_D", d.to_string()), ("SA_HB", t.hb.to_string()), ("SA_BN", t.bn.to_string()), ("SA_DW", t.dw.to_string()), ("SA_NATURAL_EXP", (natural_exp as i32).to_string())];
    if let Some(dd) = dedup {
        v.push(("SA_DEDUP", (dd as i32).to_string()));
    }
    v
}

// ---------------------------------------------------------------------------------------
// Input checks and preparation

fn unavailable(op: &'static str, reason: impl Into<String>) -> Error {
    Error::Unavailable { backend: "cuda".into(), op, reason: reason.into() }
}

/// What this backend takes, checked before anything is written.
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

/// The head dim the kernels run at: D rounded up to a multiple of 64. Inputs of another D
/// are copied with zero columns appended (a zero column adds 0 to every q.k and gives a
/// zero column of out, dq and dkv), and results are cut back to D.
pub fn kernel_d(d: usize) -> usize {
    d.next_multiple_of(64)
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

/// A cuda plan: `indices [B*S,1,W]` i32 contiguous global coordinates, valid first.
fn plan_source(op: &'static str, plan: &SparseIndexPlan, dm: Dims) -> Result<IndexSource> {
    if plan.backend != "cuda" {
        return Err(Error::value(op, "plan", "a plan made for backend `cuda`", format!("a plan for backend `{}`", plan.backend)));
    }
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

// ---------------------------------------------------------------------------------------
// Forward and the dense oracle

/// out `[B,S,H,D]` bf16, lse `[B,S,H]` f32 (contiguous, validated by the caller).
pub fn forward(gpu: &Gpu, a: &SparseAttentionArgs, out: &mut TensorViewMut, lse: &mut TensorViewMut) -> Result<()> {
    let (dm, _) = a.validate()?;
    let tiles = check_supported(OP_FWD, Pass::Fwd, gpu, dm, &[("q", &a.q), ("kv", &a.kv)])?;
    let src = index_source(OP_FWD, &a.indices, dm)?;
    run_forward(gpu, a, dm, tiles, src, false, out_ptr(out), out_ptr(lse))
}

/// The dense oracle: the forward over each row's *set* of keys. The row is sorted (a plan,
/// built here unless given) and a key equal to its predecessor is masked.
pub fn dense(gpu: &Gpu, a: &SparseAttentionArgs, out: &mut TensorViewMut) -> Result<()> {
    let (dm, _) = a.validate()?;
    let tiles = check_supported(OP_DENSE, Pass::Fwd, gpu, dm, &[("q", &a.q), ("kv", &a.kv)])?;
    let owned;
    let plan = match &a.indices {
        SparseIndices::Plan(p) => *p,
        SparseIndices::TopK(idx) => {
            owned = plan_impl(OP_DENSE, gpu, idx, dm.k, true)?;
            &owned
        }
    };
    let src = plan_source(OP_DENSE, plan, dm)?;
    let lse = gpu.scratch(dm.b * dm.s * dm.h * 4)?;
    run_forward(gpu, a, dm, tiles, src, true, out_ptr(out), lse.ptr())
}

/// Dynamic shared memory of `fwd_sm90.cu` (`kSa90SmemBytes`: Q, two 64-key K/V blocks, two
/// P tiles, the blocks' slot keys, the published maxima, row sums, the producer's 1024 slot
/// keys, barriers, 1024 bytes of alignment slack).
pub const SA90_FWD_SMEM_BYTES: usize = 64 * 1024 + 2 * 64 * 1024 + 2 * 8 * 1024 + 3 * 512 + 4096 + 11 * 8 + 1024;
const _: () = assert!(SA90_FWD_SMEM_BYTES == 219_736, "fwd_sm90.cu asserts the same number");

/// Whether the forward runs the Hopper kernel: an sm_90a device (and not DSV4_PORTABLE=1),
/// kernel head dim 512, the default exp2 arithmetic, no dedup (the dense oracle).
pub fn use_hopper_fwd(gpu: &Gpu, dp: usize, reference_rounding: bool, dedup: bool) -> bool {
    gpu.hopper() && dp == 512 && !reference_rounding && !dedup && SA90_FWD_SMEM_BYTES <= gpu.props().max_shared_per_block_optin as usize
}

/// The box of `fwd_sm90.cu`'s Q loads (SA90_Q_TMA): one SW128 group, 64 columns x 64 heads.
const SA90_Q_BOX: [u32; 4] = [64, 64, 1, 1];

/// q `[B,S,H,512]` (element `strides` of b, s, h; d-stride 1) as the 4D tensor map of
/// `fwd_sm90.cu`'s Q loads: dims {512, H, S, B} innermost first and the byte strides of H, S,
/// B. A dim of size 1 is only read at coordinate 0, so its stride (which a view may give any
/// value) is replaced by the one its extent implies.
fn sa90_q_map_shape([b, s, h]: [usize; 3], strides: &[i64]) -> ([u64; 4], [u64; 3]) {
    let bytes = |st: i64| u64::try_from(st).map_or(0, |v| v.saturating_mul(2));  // negative: 0, refused
    let sh = if h == 1 { 512 * 2 } else { bytes(strides[2]) };
    let ss = if s == 1 { sh.saturating_mul(h as u64) } else { bytes(strides[1]) };
    let sb = if b == 1 { ss.saturating_mul(s as u64) } else { bytes(strides[0]) };
    ([512, h as u64, s as u64, b as u64], [sh, ss, sb])
}

fn run_forward(gpu: &Gpu, a: &SparseAttentionArgs, dm: Dims, tiles: Tiles, src: IndexSource, dedup: bool, out: u64, lse: u64) -> Result<()> {
    if dm.b * dm.s == 0 {
        return Ok(());
    }
    let dp = kernel_d(dm.d);
    let q = rows_input(gpu, &a.q, dp)?;
    let kv = rows_input(gpu, &a.kv, dp)?;
    // D not a multiple of 64: the kernel writes a padded out, cut back below.
    let out_pad = if dp != dm.d { Some(gpu.scratch(dm.b * dm.s * dm.h * dp * 2)?) } else { None };
    // The Hopper kernel (fwd_sm90.cu): D = 512, 64 heads a CTA, exp2 arithmetic, no dedup.
    let hopper = use_hopper_fwd(gpu, dp, a.reference_rounding, dedup);
    // Its Q tiles by TMA where q can be mapped (SA90_Q_TMA), unless DSV4_EXTRA_DEFINES has
    // SA90_Q_TMA=0 (the producer's cp.async, to compare); the define is passed either way
    // (it overrides DSV4_EXTRA_DEFINES), so the kernel matches the map passed.
    let q_map = if hopper && crate::runtime::extra_define("SA90_Q_TMA") != Some("0") {
        let (dims, strides) = sa90_q_map_shape([dm.b, dm.s, dm.h], &q.strides);
        gpu.tma_map_bf16(q.ptr, &dims, &strides, &SA90_Q_BOX).ok()
    } else {
        None
    };
    let (smem, k, block, grid_y) = if hopper {
        let k = gpu.kernel("sparse_attention/fwd_sm90.cu", "sparse_attn_fwd_sm90", &[("SA90_Q_TMA", (q_map.is_some() as u8).to_string())])?;
        (SA90_FWD_SMEM_BYTES, k, 384u32, dm.h.div_ceil(64))
    } else {
        let k = gpu.kernel("sparse_attention/fwd.cu", "sparse_attn_fwd", &defines(dp, &tiles, a.reference_rounding, Some(dedup)))?;
        (fwd_smem_bytes(dp, tiles.hb, tiles.bn), k, tiles.threads(dp) as u32, tiles.head_blocks(dm.h))
    };
    let p = FwdParams {
        q: q.ptr,
        kv: kv.ptr,
        sinks: a.sinks.address(),
        idx: src.ptr,
        row_len: src.row_len,
        out: out_pad.as_ref().map_or(out, |o| o.ptr()),
        lse,
        q_sb: q.strides[0],
        q_ss: q.strides[1],
        q_sh: q.strides[2],
        kv_sb: kv.strides[0],
        kv_sk: kv.strides[1],
        idx_sb: src.sb,
        idx_ss: src.ss,
        idx_st: src.st,
        idx_bias: src.bias,
        sinks_sh: a.sinks.strides()[0] as i64,
        b: dm.b as i32,
        s: dm.s as i32,
        h: dm.h as i32,
        k: dm.k as i32,
        t: src.t as i32,
        idx_is_i64: src.is_i64,
        smem_bytes: smem as i32,
        sm_scale: a.sm_scale,
    };
    // fwd_sm90.cu runs one wave of CTAs (one an SM), each taking rows x, x + grid x, ... of
    // its head block; SA90_FWD_CTAS=N in DSV4_EXTRA_DEFINES caps the wave (tests: several
    // rows a CTA on small shapes). The portable kernel takes one row a CTA.
    let grid_x = if hopper {
        let cap = crate::runtime::extra_define("SA90_FWD_CTAS").and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0);
        let wave = cap.unwrap_or(usize::MAX).min((gpu.props().sm_count as usize / grid_y).max(1));
        (dm.b * dm.s).min(wave)
    } else {
        dm.b * dm.s
    };
    let grid = [grid_x as u32, grid_y as u32, 1];
    // SAFETY: q and kv meet the loaders' row rules (`rows_input`: d-stride 1, 16-byte
    // aligned rows, or a packed copy kept alive here); the index source was validated as
    // [B,S,T] (or a cuda plan [B*S,1,T] with its [B*S] lengths) and masked slots are never
    // dereferenced; out (or the padded [B,S,H,dp] scratch) and lse are contiguous
    // [B,S,H,D] / [B,S,H] outputs (checked by the caller); B*S, K, T fit in int32; `smem`
    // is this tile's layout, which the kernel checks. fwd_sm90.cu's second parameter is a
    // TmaDesc: q's map (q as [B,S,H,512] at its strides: TMA reads only elements of q) with
    // SA90_Q_TMA=1, zeros (unread) with SA90_Q_TMA=0.
    if hopper {
        unsafe { k.launch2(grid, [block, 1, 1], smem as u32, &p, &q_map.unwrap_or(TmaDesc::ZERO))? };
    } else {
        unsafe { k.launch(grid, [block, 1, 1], smem as u32, &p)? };
    }
    if let Some(o) = &out_pad {
        // SAFETY: the scratch holds [B*S*H, dp] bf16 written above; out is [B*S*H, D].
        unsafe { unpad(gpu, o.ptr(), dm.b * dm.s * dm.h, dp, out, dm.d)? };
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Backward

/// A launch of the backward's main kernel: `bwd_sm90.cu` (`hopper`) takes the TmaDescs of q
/// and dout as its second and third parameters, the portable `bwd.cu` the params alone.
///
/// # Safety
/// As [`Kernel::launch3`] / [`Kernel::launch`]: `p` must describe live tensors as the
/// kernel reads and writes them, and `q_map`, `do_map` be maps of q and dout as
/// `[B,S,H,512]` at their strides (TMA reads only their elements), or zeros (unread) where
/// the kernel was compiled with SA90_BWD_QDO_TMA=0.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_bwd(k: &Kernel, hopper: bool, grid: [u32; 3], block: [u32; 3], smem: u32, p: &BwdParams, q_map: &TmaDesc, do_map: &TmaDesc) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe {
        if hopper {
            k.launch3(grid, block, smem, p, q_map, do_map)
        } else {
            k.launch(grid, block, smem, p)
        }
    }
}

/// dq `[B,S,H,D]` bf16, dkv `[B,K,D]` bf16, dsinks `[H]` f32 (contiguous, validated).
pub fn backward(gpu: &Gpu, a: &SparseAttentionBwdArgs, dq: &mut TensorViewMut, dkv: &mut TensorViewMut, dsinks: &mut TensorViewMut) -> Result<()> {
    let (dm, _) = a.validate()?;
    let f = &a.fwd;
    let tiles = check_supported(OP_BWD, Pass::Bwd, gpu, dm, &[("q", &f.q), ("kv", &f.kv), ("out", &a.out), ("dout", &a.dout)])?;
    let src = index_source(OP_BWD, &f.indices, dm)?;
    let deterministic = a.backward_impl == BackwardImpl::Deterministic;
    // The Hopper kernel (bwd_sm90.cu) takes 64 heads a CTA; the portable one its tile's.
    let hopper = use_hopper_bwd(gpu, kernel_d(dm.d), f.reference_rounding) && dm.h.div_ceil(SA90_BWD_HEADS) <= 65_535;
    let n_hblk = bwd_head_blocks(hopper, &tiles, dm.h);
    // The Hopper kernel stores the deterministic contributions in 16 bits (fp16 per
    // 64-column chunk with an f32 scale: bwd_sm90.cu, SA90_BWD_DET_F16); DSV4_EXTRA_DEFINES
    // SA90_BWD_DET_F16=0 keeps f32 rows (to compare).
    let format = ContribFormat::of_backward(hopper);
    let compact = format != ContribFormat::F32;
    // DSV4_SA_DET_WAVE_INDEX=1 (to compare) builds the inverted index per wave, not once.
    let wave_index = std::env::var("DSV4_SA_DET_WAVE_INDEX").as_deref() == Ok("1");
    // DSV4_SA_DET_ROUNDS=0 (to compare): waves not cut to whole rounds of CTAs.
    let rounds = std::env::var("DSV4_SA_DET_ROUNDS").as_deref() != Ok("0");
    // DSV4_SA_DET_DIAG (a diagnostic for the bench: the results are wrong): "no-reduce"
    // launches the deterministic mode's main kernels alone, "no-main" its reduces alone (over
    // whatever the workspace holds), to time each in place.
    let det_diag = std::env::var("DSV4_SA_DET_DIAG").unwrap_or_default();
    let (skip_main, skip_reduce) = (det_diag == "no-main", det_diag == "no-reduce");
    let waves = DeterministicWaves::with_rounds(gpu.props().sm_count as usize, dm, src.t, n_hblk, a.backward_workspace_bytes, format, !wave_index, rounds);
    // The deterministic Hopper backward takes the rows from the last to the first
    // (bwd_sm90.cu, rows_desc): its waves run from the last rows down, so the short
    // remainder wave is a causal selection's cheap first rows (v23, H200, both with waves
    // of whole rounds: S=4096 2.527-2.528 -> 2.508-2.509 ms, S=16384 11.41-11.42 ->
    // 11.38-11.42). The atomic one keeps B*S order (descending: 1.936-1.941 against
    // 1.891-1.894 ms at S=4096). DSV4_EXTRA_DEFINES SA90_BWD_ROWS_DESC=0 keeps B*S order in
    // the deterministic mode too (to compare).
    let rows_desc = hopper && deterministic && crate::runtime::extra_define("SA90_BWD_ROWS_DESC") != Some("0");
    if deterministic && waves.wave_rows == 0 && dm.b * dm.s > 0 {
        let need = match format {
            ContribFormat::F32 => "T*(n_head_blocks*D + 1)*4",
            ContribFormat::F16Scaled => "T*(n_head_blocks*(2*D + D/16) + 4)",
            ContribFormat::Bf16 => "T*(n_head_blocks*2*D + 4)",
        };
        return Err(unavailable(OP_BWD, format!("the deterministic backward needs at least {need} = {} bytes of workspace for one row's dkv contributions (D rounded up to a multiple of 64); backward_workspace_bytes = {}", waves.row_bytes, a.backward_workspace_bytes)));
    }
    let rows = dm.b * dm.s;
    // The kernels run at head dim dp (D rounded up to 64): inputs zero-padded, dq and dkv
    // computed padded and cut back to D.
    let dp = kernel_d(dm.d);
    let kvd = dm.b * dm.k * dp;
    let dq_pad = if dp != dm.d { Some(gpu.scratch(rows * dm.h * dp * 2)?) } else { None };

    // f32 accumulator of dkv (auxiliary: not part of the partial workspace)
    let acc = gpu.scratch(kvd * 4)?;
    gpu.zero(acc.ptr(), kvd * 4)?;
    let dsinks_part = gpu.scratch(rows * dm.h * 4)?;
    // dkv's bf16 destination: the output, or a [B,K,dp] scratch cut back at the end.
    let dkv_pad = if kvd > 0 && dp != dm.d { Some(gpu.scratch(kvd * 2)?) } else { None };
    let dkv_dst = dkv_pad.as_ref().map_or(out_ptr(dkv), |s| s.ptr());
    // The deterministic mode's last reduce writes dkv itself (no conversion launch);
    // DSV4_SA_DET_FUSED_CONVERT=0 (to compare) keeps the conversion kernel.
    let fused_convert = std::env::var("DSV4_SA_DET_FUSED_CONVERT").as_deref() != Ok("0");
    let mut converted = false;

    if rows > 0 {
        let q = rows_input(gpu, &f.q, dp)?;
        let kv = rows_input(gpu, &f.kv, dp)?;
        let out = rows_input(gpu, &a.out, dp)?;
        let dout = rows_input(gpu, &a.dout, dp)?;
        let lse_st = strides_i64(&a.lse);
        // bwd_sm90.cu's Q and dO tiles by TMA where both can be mapped (SA90_BWD_QDO_TMA),
        // unless DSV4_EXTRA_DEFINES has SA90_BWD_QDO_TMA=0 (the producer's cp.async, to
        // compare); the define is passed either way, so the kernel matches the maps passed.
        let qdo_maps = if hopper && crate::runtime::extra_define("SA90_BWD_QDO_TMA") != Some("0") {
            let map = |v: &RowsInput| {
                let (dims, strides) = sa90_q_map_shape([dm.b, dm.s, dm.h], &v.strides);
                gpu.tma_map_bf16(v.ptr, &dims, &strides, &SA90_Q_BOX).ok()
            };
            map(&q).zip(map(&dout))
        } else {
            None
        };
        let (q_map, do_map) = qdo_maps.unwrap_or((TmaDesc::ZERO, TmaDesc::ZERO));
        let (smem, k, block) = if hopper {
            // Consumer 0 takes two of the eight dKV chunks (bwd_sm90.cu, SA90_BWD_C0_CHUNKS;
            // three before the pair's S and dP became one m64n64k16 (v27): with it,
            // v27 calls 4-5, H200, two against three: atomic S=4096 1.7495-1.7592 against
            // 1.7634-1.7660 ms, S=16384 8.31-8.40 against 8.32-8.53, deterministic -0.1 to
            // -0.4 %; four lost 5 %; the deterministic mode's f32 rows were faster with none,
            // v21; over the column-halves ring, v31 call 2: atomic S=16384 8.00-8.06 ms with
            // two against 8.07-8.08 with one and 8.09-8.10 with three, deterministic 10.72-10.73
            // against 10.82-10.84). DSV4_EXTRA_DEFINES SA90_BWD_C0_CHUNKS / SA90_BWD_DET_C0_CHUNKS (0..=7; its
            // entries separated by commas) set the atomic / deterministic count to compare.
            let atomic_chunks = crate::runtime::extra_define("SA90_BWD_C0_CHUNKS").filter(|v| matches!(v.parse::<u32>(), Ok(0..=7))).unwrap_or("2");
            let det_default = if compact { "2" } else { "0" };
            let det_chunks = crate::runtime::extra_define("SA90_BWD_DET_C0_CHUNKS").filter(|v| matches!(v.parse::<u32>(), Ok(0..=7))).unwrap_or(det_default);
            let c0_chunks = if deterministic { det_chunks } else { atomic_chunks };
            let f16 = if deterministic && compact { "1" } else { "0" };
            // The atomic mode's kernel is compiled for that mode alone (bwd_sm90.cu,
            // SA90_BWD_ATOMIC: one predicated reduction a vector, 248 fewer instructions);
            // DSV4_EXTRA_DEFINES SA90_BWD_ATOMIC=0 keeps the kernel of either mode (to compare).
            let atomic_only = if !deterministic && crate::runtime::extra_define("SA90_BWD_ATOMIC") != Some("0") { "1" } else { "0" };
            let qdo_tma = if qdo_maps.is_some() { "1" } else { "0" };
            (SA90_BWD_SMEM_BYTES, gpu.kernel("sparse_attention/bwd_sm90.cu", "sparse_attn_bwd_sm90", &[("SA90_BWD_C0_CHUNKS", c0_chunks.into()), ("SA90_BWD_DET_F16", f16.into()), ("SA90_BWD_ATOMIC", atomic_only.into()), ("SA90_BWD_QDO_TMA", qdo_tma.into())])?, [384u32, 1, 1])
        } else {
            (bwd_smem_bytes(dp, tiles.hb, tiles.bn), gpu.kernel("sparse_attention/bwd.cu", "sparse_attn_bwd", &defines(dp, &tiles, f.reference_rounding, None))?, [tiles.threads(dp) as u32, 1, 1])
        };
        let mut p = BwdParams {
            q: q.ptr,
            kv: kv.ptr,
            sinks: f.sinks.address(),
            idx: src.ptr,
            row_len: src.row_len,
            out: out.ptr,
            dout: dout.ptr,
            lse: a.lse.address(),
            dq: dq_pad.as_ref().map_or(out_ptr(dq), |s| s.ptr()),
            dkv: acc.ptr(),
            dsinks_part: dsinks_part.ptr(),
            q_sb: q.strides[0],
            q_ss: q.strides[1],
            q_sh: q.strides[2],
            kv_sb: kv.strides[0],
            kv_sk: kv.strides[1],
            idx_sb: src.sb,
            idx_ss: src.ss,
            idx_st: src.st,
            idx_bias: src.bias,
            sinks_sh: f.sinks.strides()[0] as i64,
            o_sb: out.strides[0],
            o_ss: out.strides[1],
            o_sh: out.strides[2],
            do_sb: dout.strides[0],
            do_ss: dout.strides[1],
            do_sh: dout.strides[2],
            lse_sb: lse_st[0],
            lse_ss: lse_st[1],
            lse_sh: lse_st[2],
            b: dm.b as i32,
            s: dm.s as i32,
            h: dm.h as i32,
            k: dm.k as i32,
            t: src.t as i32,
            idx_is_i64: src.is_i64,
            smem_bytes: smem as i32,
            rows_per_chunk: 1,
            chunks_per_bh: dm.s as i32,
            chunk_base: 0,
            deterministic: deterministic as i32,
            all_rows_nonempty: f.all_rows_nonempty as i32,
            sm_scale: f.sm_scale,
            rows_desc: rows_desc as i32,
        };
        let chunks = dm.b * n_hblk * dm.s;
        if chunks > i32::MAX as usize {
            return Err(unavailable(OP_BWD, format!("B * head blocks * S = {chunks} CTAs exceed int32")));
        }
        if !deterministic {
            let grid = if hopper { [rows as u32, n_hblk as u32, 1] } else { [chunks as u32, 1, 1] };
            // SAFETY: as the forward's launch for q, kv, the index source; out and dout
            // pass the same row rules (`rows_input`); lse is a validated [B,S,H] f32 view
            // read through its strides; dq is a contiguous [B,S,H,D] output; `dkv` is the
            // zeroed [B,K,D] f32 accumulator and `dsinks_part` [B*S,H] f32, both live
            // until the end of this function (stream-ordered frees); chunk c covers
            // exactly one row, c < B*n_hblk*S = the grid. Hopper: CTA (x, y) owns row x < B*S
            // (chunk_base = 0; B*S - 1 - x with rows_desc) and heads [64y, 64y + 64), y <
            // n_hblk = ceil(H/64).
            unsafe { launch_bwd(&k, hopper, grid, block, smem as u32, &p, &q_map, &do_map)? };
        } else {
            // Waves of rows: the main kernel stores each valid slot's dkv contribution, an
            // inverted index lists each key's (row, slot) entries in order, and the reduce
            // adds them per key in that order: bitwise reproducible, no partial [K, D].
            let w = waves;
            let g = dm.b * dm.k;
            let index = g > 0 && src.t > 0;
            let contrib = gpu.scratch(w.wave_rows * src.t * n_hblk * format.bytes(dp))?;
            let kern = |name| gpu.kernel("sparse_attention/bwd_reduce.cu", name, &[]);
            let (count, scan_rb, scan_keys, fill) = (kern("sparse_attn_inv_count")?, kern("sparse_attn_inv_scan_rb")?, kern("sparse_attn_inv_scan_keys")?, kern("sparse_attn_inv_fill")?);
            // (sparse_attn_inv_reduce_f16: SA_REDUCE_GROUPS groups (default 4, a knob of
            // DSV4_EXTRA_DEFINES: 1..=8) of dp/8 = 64 threads a key)
            let groups = crate::runtime::extra_define("SA_REDUCE_GROUPS").and_then(|v| v.parse::<usize>().ok()).filter(|v| (1..=8).contains(v)).unwrap_or(4);
            let (reduce, reduce_threads) = if compact { (kern("sparse_attn_inv_reduce_f16")?, groups * (dp / 8)) } else { (kern("sparse_attn_inv_reduce")?, dp / 4) };
            let mut ip = InvIndexParams {
                idx: src.ptr,
                row_len: src.row_len,
                counts: 0,
                colptr: 0,
                entries: 0,
                contrib: 0,
                acc: acc.ptr(),
                idx_sb: src.sb,
                idx_ss: src.ss,
                idx_st: src.st,
                idx_bias: src.bias,
                g: g as i64,
                row_base: 0,
                n_rows: 0,
                rows_per_rb: 0,
                n_rb: 0,
                s: dm.s as i32,
                k: dm.k as i32,
                t: src.t as i32,
                d: dp as i32,
                n_hblk: n_hblk as i32,
                idx_is_i64: src.is_i64,
                entry_base: 0,
                rb_lo: 0,
                rb_hi: 0,
                rows_desc: rows_desc as i32,
                rows_total: rows as i32,
                dkv_out: 0,
                partials: 0,
                carried: 0,
                last_wave: 0,
                pad_: 0,
            };
            // Several waves: the 16-bit reduce keeps each entry group's running sum between
            // them (and, with an index per wave, each key's entries so far), so the result
            // is bitwise that of one wave whatever the workspace (bwd_reduce.cu).
            let multi = compact && w.wave_rows < rows;
            let partials = if multi && index { Some(gpu.scratch(g * groups * dp * 4)?) } else { None };
            let carried = if multi && index && !w.global { Some(gpu.scratch(g * 4)?) } else { None };
            if let Some(b) = &partials {
                gpu.zero(b.ptr(), g * groups * dp * 4)?;
                ip.partials = b.ptr();
            }
            if let Some(b) = &carried {
                gpu.zero(b.ptr(), g * 4)?;
                ip.carried = b.ptr();
            }
            // The index of rows [r0, r0 + n) in n_rb blocks of rows_per_rb rows, into the
            // buffers ip points to (an `InvIndex` of at least n rows and n_rb blocks).
            let build_index = |ip: &mut InvIndexParams, r0: usize, n: usize, rows_per_rb: usize, n_rb: usize| -> Result<()> {
                (ip.row_base, ip.n_rows, ip.rows_per_rb, ip.n_rb) = (r0 as i32, n as i32, rows_per_rb as i32, n_rb as i32);
                gpu.zero(ip.counts, n_rb * g * 4)?;
                // SAFETY (these four): the index source as validated for the main kernel;
                // rows r0.. r0+n <= B*S; counts holds n_rb*G i32 (zeroed above), colptr G+1,
                // entries n*T (one per valid slot at most); count and fill take one CTA per
                // row block, scan_keys one CTA.
                unsafe { count.launch([n_rb as u32, 1, 1], [256, 1, 1], 0, &*ip)? };
                unsafe { scan_rb.launch([grid_for(gpu, g), 1, 1], [256, 1, 1], 0, &*ip)? };
                unsafe { scan_keys.launch([1, 1, 1], [1024, 1, 1], 0, &*ip)? };
                unsafe { fill.launch([n_rb as u32, 1, 1], [32, 1, 1], 0, &*ip) }
            };
            // The global index is kept with a plan (it depends on the selection alone; the
            // plan's first deterministic backward builds it), else built here once.
            // DSV4_SA_DET_PLAN_INDEX=0 (to compare) builds it here every call.
            let plan = match &f.indices {
                SparseIndices::Plan(pl) if std::env::var("DSV4_SA_DET_PLAN_INDEX").as_deref() != Ok("0") => Some(*pl),
                _ => None,
            };
            let shape = InvIndexShape { idx: src.ptr, row_len: src.row_len, t: src.t, g, rows, n_rb: w.n_rb, rows_per_rb: w.rows_per_rb, rows_desc };
            let kept = match plan {
                Some(pl) if index && w.global => pl
                    .derived
                    .get_or_try_init(|| -> Result<InvIndex> {
                        let d = InvIndex::alloc(gpu, shape)?;
                        d.point(&mut ip);
                        build_index(&mut ip, 0, rows, w.rows_per_rb, w.n_rb)?;
                        Ok(d)
                    })?
                    .filter(|d| d.shape == shape),
                _ => None,
            };
            let own;
            let bufs: &InvIndex = match &kept {
                Some(d) => d,
                None => {
                    own = InvIndex::alloc(gpu, InvIndexShape { rows: if w.global { rows } else { w.wave_rows }, ..shape })?;
                    &own
                }
            };
            bufs.point(&mut ip);
            if index && w.global && kept.is_none() {
                build_index(&mut ip, 0, rows, w.rows_per_rb, w.n_rb)?;
            }
            let mut r0 = 0;
            while r0 < rows {
                let n = w.wave_rows.min(rows - r0);
                if index && !w.global {
                    let rows_per_rb = n.div_ceil(w.n_rb);
                    build_index(&mut ip, r0, n, rows_per_rb, n.div_ceil(rows_per_rb))?;
                    (ip.entry_base, ip.rb_lo, ip.rb_hi) = (0, 0, ip.n_rb);
                } else if index {
                    (ip.entry_base, ip.rb_lo, ip.rb_hi) = ((r0 * src.t) as i64, (r0 / w.rows_per_rb) as i32, (r0 + n).div_ceil(w.rows_per_rb) as i32);
                }
                p.chunk_base = r0 as i32;
                p.dkv = contrib.ptr();
                let grid = if hopper { [n as u32, n_hblk as u32, 1] } else { [(n * n_hblk) as u32, 1, 1] };
                // SAFETY: as the atomic launch, except that CTA i owns row r0 + i / n_hblk
                // (< B*S) and head block i % n_hblk, and stores its valid slots' dkv rows to
                // `contrib` ([wave_rows, T, n_hblk, dp] f32, local row < n <= wave_rows;
                // compact: [n, T, n_hblk, dp] fp16 then [n, T, n_hblk, dp/64] f32 scales, or
                // bf16 alone; within the wave_rows-sized buffer as n <= wave_rows).
                // Hopper: CTA (x, y) owns launch row r0 + x (row B*S - 1 - r0 - x with
                // rows_desc; the index counts the same launch rows) and head block y <
                // n_hblk.
                if !skip_main {
                    unsafe { launch_bwd(&k, hopper, grid, block, smem as u32, &p, &q_map, &do_map)? };
                }
                if index && !skip_reduce {
                    (ip.contrib, ip.n_rows) = (contrib.ptr(), n as i32);
                    // The last wave's reduce (16-bit rows) stores bf16(acc + its sum) into
                    // dkv's destination for every key.
                    let last = r0 + n == rows && compact && fused_convert;
                    ip.dkv_out = if last { dkv_dst } else { 0 };
                    ip.last_wave = (r0 + n == rows) as i32;
                    converted |= last;
                    // SAFETY: colptr/counts/entries as built above index, for rows [r0, r0 +
                    // n) (row blocks [rb_lo, rb_hi) of a global index: r0 and, but at the
                    // end, r0 + n are multiples of rows_per_rb), entries r0*T - entry_base ..
                    // of `contrib` written by the main kernel (every valid slot of the wave's
                    // rows, every head block; compact: the layout of that kernel's n rows);
                    // acc is [G, dp] f32; dp/4 <= 128 threads (compact: groups <= 8 of dp/8 =
                    // 64, dp = 512); dkv_out, when set, is dkv's [G, dp] bf16 destination
                    // (the output or dkv_pad) and every key g < G is visited (grid stride).
                    unsafe { reduce.launch([g.min(1 << 30) as u32, 1, 1], [reduce_threads as u32, 1, 1], 0, &ip)? };
                }
                r0 += n;
            }
        }
    }

    // dq cut back to D; dkv = bf16(acc) (unless the deterministic mode's last reduce wrote
    // it; padded: through a bf16 [B,K,dp] scratch, then cut back); dsinks = fixed-order sum
    // of the per-row partials
    if let Some(s) = &dq_pad {
        // SAFETY: the scratch holds [B*S*H, dp] bf16 written by the main kernel (every row
        // and head: rows > 0 launched it; rows == 0 copies nothing); dq is [B*S*H, D].
        unsafe { unpad(gpu, s.ptr(), rows * dm.h, dp, out_ptr(dq), dm.d)? };
    }
    if kvd > 0 {
        if !converted {
            let conv = gpu.kernel("sparse_attention/bwd_reduce.cu", "sparse_attn_f32_to_bf16", &[])?;
            // The Hopper kernel writes acc's columns permuted within groups of 16 (its flush layout).
            let c = ConvertParams { src: acc.ptr(), dst: dkv_dst, n: kvd as i64, permuted: hopper as i32, pad_: 0 };
            // SAFETY: `acc` holds B*K*dp f32; dst is the contiguous [B,K,D] bf16 output (dp ==
            // D) or a [B,K,dp] bf16 scratch.
            unsafe { conv.launch([grid_for(gpu, kvd), 1, 1], [256, 1, 1], 0, &c)? };
        }
        if let Some(s) = &dkv_pad {
            // SAFETY: the scratch holds [B*K, dp] bf16 written above; dkv is [B*K, D].
            unsafe { unpad(gpu, s.ptr(), dm.b * dm.k, dp, out_ptr(dkv), dm.d)? };
        }
    }
    let ds = gpu.kernel("sparse_attention/bwd_reduce.cu", "sparse_attn_dsinks", &[])?;
    let d = DsinksParams { part: dsinks_part.ptr(), dsinks: out_ptr(dsinks), rows: rows as i64, h: dm.h as i32, pad_: 0 };
    // SAFETY: `dsinks_part` holds [rows, H] f32, every entry written by the main kernel
    // (rows > 0) or none read (rows == 0); dsinks is a contiguous [H] f32 output; one CTA
    // per head (H fits in int32).
    unsafe { ds.launch([dm.h as u32, 1, 1], [256, 1, 1], 0, &d) }
}

/// The deterministic backward's inverted index (bwd_reduce.cu): per key, its (row, slot)
/// entries in row order, for `rows` rows in `n_rb` blocks of `rows_per_rb` (0: one wave's,
/// rebuilt per wave). Built for all rows of a plan, it is kept with the plan
/// (`SparseIndexPlan::derived`) and reused while its shape is the call's (the same index
/// source and sizes).
struct InvIndex {
    shape: InvIndexShape,
    counts: Tensor,  // i32 [n_rb, G]: block ends after fill
    colptr: Tensor,  // i32 [G + 1]
    entries: Tensor, // i32 [rows * T]
}

/// What an `InvIndex` was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct InvIndexShape {
    idx: u64,
    row_len: u64,
    t: usize,
    g: usize,
    rows: usize,
    n_rb: usize,
    rows_per_rb: usize,
    rows_desc: bool, // its rows numbered as the main kernel launches them (BwdParams::rows_desc)
}

impl InvIndex {
    fn alloc(gpu: &Gpu, shape: InvIndexShape) -> Result<Self> {
        let InvIndexShape { t, g, rows, n_rb, .. } = shape;
        Ok(InvIndex {
            shape,
            counts: gpu.alloc(DType::I32, &[(n_rb * g).max(1)])?,
            colptr: gpu.alloc(DType::I32, &[g + 1])?,
            entries: gpu.alloc(DType::I32, &[(rows * t).max(1)])?,
        })
    }

    fn point(&self, ip: &mut InvIndexParams) {
        (ip.counts, ip.colptr, ip.entries) = (self.counts.view().address(), self.colptr.view().address(), self.entries.view().address());
    }
}

/// Heads per CTA of `bwd_sm90.cu` (its wgmma M).
pub const SA90_BWD_HEADS: usize = 64;

/// Dynamic shared memory of `bwd_sm90.cu` (`kSa90BwdSmemBytes`: Q and dO, a ring of two
/// 32-key K/V blocks, the dS, P^T and dS^T tiles, the ring's slot keys, lse and delta, the
/// nonempty-row flag, the producer's 1024 slot keys, barriers, 1024 bytes of alignment slack).
pub const SA90_BWD_SMEM_BYTES: usize = 2 * 64 * 1024 + 2 * 32 * 1024 + 3 * 8 * 1024 + 256 + 2 * 256 + 16 + 4096 + 7 * 8 + 1024;
const _: () = assert!(SA90_BWD_SMEM_BYTES == 227_144, "bwd_sm90.cu asserts the same number");

/// Whether the backward runs the Hopper kernel: an sm_90a device (and not DSV4_PORTABLE=1),
/// kernel head dim 512, the default exp2 arithmetic (`reference_rounding` runs the portable
/// kernel's natural-exp variant).
pub fn use_hopper_bwd(gpu: &Gpu, dp: usize, reference_rounding: bool) -> bool {
    gpu.hopper() && dp == 512 && !reference_rounding && SA90_BWD_SMEM_BYTES <= gpu.props().max_shared_per_block_optin as usize
}

/// Head blocks of the backward kernel that runs: 64 heads a CTA on the Hopper path, the
/// portable tile's `hb` otherwise. The deterministic contributions are `[rows, T, n_hblk,
/// D]`, so the workspace and its waves are sized with this number.
pub fn bwd_head_blocks(hopper: bool, tiles: &Tiles, h: usize) -> usize {
    if hopper {
        h.div_ceil(SA90_BWD_HEADS)
    } else {
        tiles.head_blocks(h)
    }
}

/// How the deterministic backward splits its rows: waves of `wave_rows` consecutive launch
/// rows (B*S order, or its reverse: `BwdParams::rows_desc`), whose per-slot dkv
/// contributions (`T * n_hblk` contributions a row, [`ContribFormat::bytes`] each) fit
/// `backward_workspace_bytes` with the inverted index (`T` i32 entries a row and `[n_rb,
/// B*K]` i32 block counts), each wave a multiple of the rows that fill whole rounds of CTAs
/// where that keeps 3/4 of the rows that fit. `global`: one index for all rows in
/// `n_rb` blocks of `rows_per_rb` rows, built before the waves (each wave a run of whole
/// blocks), when it takes at most a quarter of the workspace and its entry ids fit in
/// int32; else an index per wave (`n_rb` blocks of that wave). `wave_rows == 0`: not even
/// one row fits (`row_bytes` a row is the least).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeterministicWaves {
    pub row_bytes: usize,
    pub wave_rows: usize,
    pub n_rb: usize,
    pub global: bool,
    pub rows_per_rb: usize,
}

/// How the deterministic backward stores each slot's dkv contribution (one head block):
/// f32 values (the portable kernel; the Hopper one with SA90_BWD_DET_F16=0), fp16 values
/// and an f32 scale per 64 columns (the Hopper kernel's default), or bf16 values alone
/// (SA90_BWD_DET_BF16=1: measured in v23, 0-1 % faster for less precision).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContribFormat {
    F32,
    F16Scaled,
    Bf16,
}

impl ContribFormat {
    /// The format of the backward that runs (`hopper`: bwd_sm90.cu): its default, or what
    /// DSV4_EXTRA_DEFINES asks for (SA90_BWD_DET_F16=0: f32; SA90_BWD_DET_BF16=1: bf16).
    pub fn of_backward(hopper: bool) -> Self {
        if !hopper || crate::runtime::extra_define("SA90_BWD_DET_F16") == Some("0") {
            ContribFormat::F32
        } else if crate::runtime::extra_define("SA90_BWD_DET_BF16") == Some("1") {
            ContribFormat::Bf16
        } else {
            ContribFormat::F16Scaled
        }
    }

    /// Bytes of one contribution at kernel head dim `dp`.
    pub fn bytes(self, dp: usize) -> usize {
        match self {
            ContribFormat::F32 => 4 * dp,
            ContribFormat::F16Scaled => 2 * dp + 4 * (dp / 64),
            ContribFormat::Bf16 => 2 * dp,
        }
    }
}

impl DeterministicWaves {
    /// `format`: how a contribution is stored. `global`: the global index allowed (false:
    /// an index per wave, to compare).
    pub fn for_sizes(sm_count: usize, dm: Dims, t: usize, n_hblk: usize, workspace: usize, format: ContribFormat, global: bool) -> Self {
        Self::with_rounds(sm_count, dm, t, n_hblk, workspace, format, global, true)
    }

    /// `for_sizes`, with waves of whole rounds of CTAs or not (`rounds`: false to compare).
    #[allow(clippy::too_many_arguments)]
    pub fn with_rounds(sm_count: usize, dm: Dims, t: usize, n_hblk: usize, workspace: usize, format: ContribFormat, global: bool, rounds: bool) -> Self {
        let rows = dm.b * dm.s;
        let slot_bytes = n_hblk * format.bytes(kernel_d(dm.d));
        // a row: T slots of n_hblk contributions and one i32 index entry
        let row_bytes = t * (slot_bytes + 4);
        let g = (dm.b * dm.k).max(1);
        // Row blocks: enough warps to fill the device, and [n_rb, B*K] counters <= 256 MiB.
        let rb_cap = (4 * sm_count).min(((256usize << 20) / (4 * g)).max(1));
        // Rows whose CTAs (n_hblk a row, one an SM: bwd_sm90.cu's shared memory) fill whole
        // rounds of the device: a wave of a multiple of them has no last round of a few CTAs
        // beside idle SMs (v23, H200 S=16384, 2 GiB: waves of 3,040 rows took 24 rounds of
        // 132 CTAs each, of 3,036 rows 23; 11.68-11.72 -> 11.41-11.42 ms). A multiple is
        // taken when it holds at least 3/4 of the rows that fit.
        let round_rows = (sm_count / gcd(sm_count.max(1), n_hblk.max(1))).max(1);
        let whole_rounds = |fit: usize, block: usize| -> usize {
            if !rounds {
                return 0;
            }
            let unit = block / gcd(block, round_rows) * round_rows;
            let w = fit / unit * unit;
            if 4 * w >= 3 * fit { w } else { 0 }
        };
        if global && t > 0 && rows > 0 && rows * t <= i32::MAX as usize {
            // Rows a wave holds beside the index of blocks of `rows_per_rb` rows (None: the
            // index takes more than a quarter of the workspace).
            let fit = |rows_per_rb: usize| -> Option<usize> {
                let n_rb = rows.div_ceil(rows_per_rb);
                let index_bytes = rows * t * 4 + n_rb * g * 4 + (g + 1) * 4;
                (index_bytes <= workspace / 4).then(|| (workspace - index_bytes) / (t * slot_bytes))
            };
            let least = rows.div_ceil(rb_cap.min(rows));
            if let Some(per) = fit(least) {
                let wave = |rows_per_rb: usize, wave_rows: usize| DeterministicWaves { row_bytes, wave_rows, n_rb: rows.div_ceil(rows_per_rb), global: true, rows_per_rb };
                if per >= rows {
                    return wave(least, rows);
                }
                // Block sizes least..=2 least (fewer blocks: still <= rb_cap): the one whose
                // waves of whole rounds and whole blocks hold the most rows, else waves of
                // whole blocks.
                let aligned = (least..=2 * least).filter_map(|d| Some((whole_rounds(fit(d)? / d * d, d), d))).filter(|&(w, _)| w > 0).max_by_key(|&(w, d)| (w, std::cmp::Reverse(d)));
                let (wave_rows, rows_per_rb) = aligned.unwrap_or((per / least * least, least));
                if wave_rows > 0 {
                    return wave(rows_per_rb, wave_rows);
                }
            }
        }
        // entry ids local * T + t stay below 2^31
        let id_cap = (i32::MAX as usize).checked_div(t).unwrap_or(rows);
        let fit = workspace.checked_div(row_bytes).map_or(rows, |w| w.min(rows).min(id_cap));
        let wave_rows = if fit < rows { Some(whole_rounds(fit, 1)).filter(|&w| w > 0).unwrap_or(fit) } else { fit };
        let n_rb = rb_cap.clamp(1, wave_rows.max(1));
        DeterministicWaves { row_bytes, wave_rows, n_rb, global: false, rows_per_rb: 0 }
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

// ---------------------------------------------------------------------------------------
// Plans

/// A plan in the cuDNN layout of SPEC.md section 6, built on the GPU with no host round
/// trip: `indices` i32 `[B*S,1,T]` global `b*K+k` ascending (duplicates kept) then -1,
/// `topk_length` i32 `[B*S]`, and unless `all_rows_nonempty`, `valid_rows` i64 `[B*S]`:
/// the nonempty rows ascending, then -1 (a fixed length, so no count is read back).
pub fn plan(gpu: &Gpu, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
    plan_impl(OP_PLAN, gpu, topk_idxs, kv_len, all_rows_nonempty)
}

fn plan_impl(op: &'static str, gpu: &Gpu, topk_idxs: &TensorView, kv_len: usize, all_rows_nonempty: bool) -> Result<SparseIndexPlan> {
    let (b, s, t) = (topk_idxs.shape()[0], topk_idxs.shape()[1], topk_idxs.shape()[2]);
    let rows = b * s;
    if rows > i32::MAX as usize || t > i32::MAX as usize || (b as u64) * (kv_len as u64) > i32::MAX as u64 {
        return Err(unavailable(op, format!("B*S = {rows}, T = {t} and B*K = {} must fit in int32", b * kv_len)));
    }
    let sort_cap = t.max(1).next_power_of_two();
    let smem = sort_cap * 4;
    let smem_max = gpu.props().max_shared_per_block_optin as usize;
    if smem > smem_max {
        return Err(unavailable(op, format!("T = {t} slots per row: the row sort needs {smem} bytes of shared memory, the device has {smem_max}")));
    }
    let indices = gpu.alloc(DType::I32, &[rows, 1, t])?;
    let lengths = gpu.alloc(DType::I32, &[rows])?;
    if rows > 0 {
        let st = strides_i64(topk_idxs);
        let p = PlanParams {
            idx: topk_idxs.address(),
            indices: indices.view().address(),
            lengths: lengths.view().address(),
            idx_sb: st[0],
            idx_ss: st[1],
            idx_st: st[2],
            b: b as i32,
            s: s as i32,
            t: t as i32,
            k: kv_len as i32,
            sort_cap: sort_cap as i32,
            idx_is_i64: (topk_idxs.dtype() == DType::I64) as i32,
        };
        let k = gpu.kernel("sparse_attention/plan.cu", "sparse_attn_plan_rows", &[])?;
        let threads = (sort_cap / 2).clamp(32, 1024) as u32;
        // SAFETY: topk_idxs is a validated [B,S,T] integer view read through its strides;
        // indices [B*S,1,T] and lengths [B*S] are fresh contiguous i32 tensors; the shared
        // sort buffer holds sort_cap ints (checked against the device limit above).
        unsafe { k.launch([rows as u32, 1, 1], [threads, 1, 1], smem as u32, &p)? };
    }
    let valid_rows = if all_rows_nonempty {
        None
    } else {
        let v = gpu.alloc(DType::I64, &[rows])?;
        if rows > 0 {
            let k = gpu.kernel("sparse_attention/plan.cu", "sparse_attn_valid_rows", &[])?;
            let p = ValidRowsParams { lengths: lengths.view().address(), valid_rows: v.view().address(), rows: rows as i64 };
            // SAFETY: lengths holds B*S i32 (written by the launch above, same stream);
            // valid_rows is a fresh [B*S] i64 tensor; one CTA of 1024 threads.
            unsafe { k.launch([1, 1, 1], [1024, 1, 1], 0, &p)? };
        }
        Some(v)
    };
    Ok(SparseIndexPlan { backend: "cuda", indices, topk_length: Some(lengths), valid_rows, kv_len, batch: b, seq: s, slots: t, all_rows_nonempty, derived: Default::default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sa90_q_map_shapes_are_mappable() {
        use crate::runtime::tma_bf16_problem;
        // contiguous [B,S,H,512]
        let (d, st) = sa90_q_map_shape([2, 300, 64], &[300 * 64 * 512, 64 * 512, 512]);
        assert_eq!(d, [512, 64, 300, 2]);
        assert_eq!(st, [1024, 64 * 1024, 300 * 64 * 1024]);
        assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
        // a [B,H,S,D] tensor transposed to [B,S,H,D]; H = 1 and B = 1 with odd strides
        let (d, st) = sa90_q_map_shape([1, 300, 7], &[3, 512, 300 * 512]);
        assert_eq!(st, [300 * 1024, 1024, 300 * 1024]);
        assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
        let (d, st) = sa90_q_map_shape([3, 5, 1], &[5 * 520, 520, 1]);
        assert_eq!(st, [1024, 1040, 5 * 1040]);
        assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
        let (d, st) = sa90_q_map_shape([1, 1, 1], &[1, 1, 1]);
        assert_eq!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX), None);
        // a head stride of 516 elements (1,032 bytes) is refused: the launcher then compiles
        // the cp.async Q loads (rows_input packs such a q anyway: strides of 8 elements)
        let (d, st) = sa90_q_map_shape([1, 4, 8], &[0, 8 * 516, 516]);
        assert!(tma_bf16_problem(0x1000, &d, &st, &SA90_Q_BOX).is_some());
    }

    #[test]
    fn tiles_fit_hopper_and_ampere() {
        for smem in [232_448usize, 166_912] {
            for d in (64..=512).step_by(64) {
                for h in [1usize, 3, 16, 17, 64, 100, 128] {
                    for pass in [Pass::Fwd, Pass::Bwd] {
                        let t = choose_tiles(pass, d, h, smem).unwrap_or_else(|| panic!("no tile for {pass:?} d={d} h={h} smem={smem}"));
                        let bytes = match pass {
                            Pass::Fwd => fwd_smem_bytes(d, t.hb, t.bn),
                            Pass::Bwd => bwd_smem_bytes(d, t.hb, t.bn),
                        };
                        assert!(bytes <= smem);
                        assert!(t.hb.is_multiple_of(16) && t.hb <= 64 && t.hb * t.head_blocks(h) >= h);
                        assert!(t.threads(d) <= if pass == Pass::Fwd { 512 } else { 256 });
                    }
                }
            }
        }
        // The DeepSeek-V4 shape on an H100/H200: all 64 heads in one forward CTA.
        assert_eq!(choose_tiles(Pass::Fwd, 512, 64, 232_448), Some(Tiles { hb: 64, bn: 64, dw: 128 }));
        assert_eq!(choose_tiles(Pass::Fwd, 100, 64, 232_448), None);
        // Other head dims run padded: the golden's D = 8, 16, 32 at 64; 512 stays 512.
        assert_eq!([8, 16, 32, 64, 65, 96, 200, 512].map(kernel_d), [64, 64, 64, 64, 128, 128, 256, 512]);
    }

    #[test]
    fn deterministic_waves_fit_the_workspace() {
        let dm = Dims { b: 2, s: 1024, h: 64, d: 512, k: 1280, t: 640 };
        let (rows, g) = (2048usize, 2 * 1280);
        // An index per wave (the global one not allowed).
        let w = DeterministicWaves::for_sizes(132, dm, dm.t, 2, 2 << 30, ContribFormat::F32, false);
        assert_eq!(w.row_bytes, 640 * (2 * 512 + 1) * 4);
        // (818 rows fit; two head blocks a row: 66 rows fill a round of 132 CTAs)
        assert_eq!((2usize << 30) / w.row_bytes, 818);
        assert_eq!((w.wave_rows, w.global), (792, false));
        assert!(w.n_rb >= 1 && w.n_rb <= 4 * 132);
        let small = DeterministicWaves::for_sizes(132, dm, dm.t, 2, w.row_bytes * 3, ContribFormat::F32, true);
        assert_eq!((small.wave_rows, small.global), (3, false), "the global index takes more than a quarter of this workspace");
        assert_eq!(DeterministicWaves::for_sizes(132, dm, dm.t, 2, w.row_bytes - 1, ContribFormat::F32, true).wave_rows, 0);
        // No slots: every row in one wave.
        assert_eq!(DeterministicWaves::for_sizes(132, dm, 0, 2, 1, ContribFormat::F32, true).wave_rows, 2048);
        // The global index: waves of whole row blocks, contributions and index within the workspace.
        for ws in [2usize << 30, 256 << 20, 64 << 20] {
            let gw = DeterministicWaves::for_sizes(132, dm, dm.t, 2, ws, ContribFormat::F32, true);
            assert!(gw.global, "{ws}: {gw:?}");
            assert_eq!(gw.n_rb, rows.div_ceil(gw.rows_per_rb));
            assert!(gw.n_rb <= 4 * 132);
            let index_bytes = rows * 640 * 4 + gw.n_rb * g * 4 + (g + 1) * 4;
            assert!(gw.wave_rows > 0 && (gw.wave_rows.is_multiple_of(gw.rows_per_rb) || gw.wave_rows == rows), "{gw:?}");
            assert!(gw.wave_rows * 640 * 2 * 512 * 4 + index_bytes <= ws, "{ws}: {gw:?}");
            // at least 3/4 of the rows that fit
            assert!(4 * (gw.wave_rows + gw.rows_per_rb) * 640 * 2 * 512 * 4 + 4 * index_bytes > 3 * ws || gw.wave_rows == rows, "{ws}: {gw:?}");
        }
        // The bench's shapes (H200: 132 SMs, one head block): waves of whole rounds of 132
        // CTAs, in whole blocks of the global index.
        for (s, k, want) in [(16384usize, 20480usize, 3036usize), (4096, 5120, 3036)] {
            let dm = Dims { b: 1, s, h: 64, d: 512, k, t: 640 };
            let w = DeterministicWaves::for_sizes(132, dm, 640, 1, 2 << 30, ContribFormat::F16Scaled, true);
            assert!(w.global && w.wave_rows == want && want.is_multiple_of(w.rows_per_rb) && w.n_rb <= 4 * 132, "S={s}: {w:?}");
            // 4 GiB: S=4096 in one wave
            let big = DeterministicWaves::for_sizes(132, dm, 640, 1, 4 << 30, ContribFormat::F16Scaled, true);
            assert!(big.wave_rows == s || big.wave_rows.is_multiple_of(132), "S={s}: {big:?}");
        }
        // Two head blocks a row: 66 rows fill a round.
        let dm2 = Dims { b: 1, s: 16384, h: 128, d: 512, k: 20480, t: 640 };
        let w2 = DeterministicWaves::for_sizes(132, dm2, 640, 2, 2 << 30, ContribFormat::F16Scaled, true);
        assert!(w2.wave_rows.is_multiple_of(66) && w2.wave_rows.is_multiple_of(w2.rows_per_rb), "{w2:?}");
        // The Hopper kernel's 16-bit contributions: fp16 values and an f32 scale per 64
        // columns, and the T entries, about half the f32 rows.
        let c = DeterministicWaves::for_sizes(132, dm, dm.t, 2, 2 << 30, ContribFormat::F16Scaled, false);
        assert_eq!(c.row_bytes, 640 * (2 * (2 * 512 + 512 / 16) + 4));
        assert!(c.wave_rows > 19 * w.wave_rows / 10);
        // bf16 values alone (SA90_BWD_DET_BF16=1): 2 bytes a value and the entry.
        assert_eq!(DeterministicWaves::for_sizes(132, dm, dm.t, 2, 2 << 30, ContribFormat::Bf16, false).row_bytes, 640 * (2 * 2 * 512 + 4));
    }

    #[test]
    fn backward_head_blocks_follow_the_kernel() {
        // Hopper: 64 heads a CTA whatever the portable tile.
        let t = choose_tiles(Pass::Bwd, 512, 64, 232_448).unwrap();
        assert!(t.hb < 64, "the portable D = 512 backward tile holds fewer than 64 heads: {t:?}");
        for (h, want) in [(1usize, 1usize), (17, 1), (64, 1), (65, 2), (100, 2), (128, 2), (129, 3)] {
            assert_eq!(bwd_head_blocks(true, &t, h), want, "h = {h}");
            assert_eq!(bwd_head_blocks(false, &t, h), t.head_blocks(h), "h = {h}");
        }
        // Fewer head blocks: a row's contributions are smaller, so more rows fit a wave.
        let dm = Dims { b: 1, s: 4096, h: 64, d: 512, k: 5120, t: 640 };
        let ws = 64 << 20;
        let hop = DeterministicWaves::for_sizes(132, dm, dm.t, bwd_head_blocks(true, &t, dm.h), ws, ContribFormat::F32, true);
        let port = DeterministicWaves::for_sizes(132, dm, dm.t, bwd_head_blocks(false, &t, dm.h), ws, ContribFormat::F32, true);
        assert_eq!(hop.row_bytes, 640 * (512 + 1) * 4);
        assert!(hop.wave_rows > port.wave_rows);
        // The shared-memory layout fits an H100/H200 block.
        const { assert!(SA90_BWD_SMEM_BYTES <= 232_448) };
    }
}
